"""The KDA backward's paths side by side on the kda_bwd suite's inputs (one GPU call, ~1-2
min): the kernel path with both switches off (`both_off`), FACTORS_FROM_FIRST_PASS alone,
WY_IN_KERNEL alone, both (the device pass: kernel 1's 16-bit forms; the default since
2026-12-06, 4.6-5.8x `both_off` on the H100) and cuDNN's backward, timed together by the
bench's interleaved CUDA-graph method (`forgekernel.bench.methods.time_method`); each path's
largest gradient difference from `both_off`'s, relative to that gradient's largest entry
(docs/linear_attention/NOTES.md "KDA backward WY kernel", "Both opt-ins together", "KDA's
device pass", "Measured 2026-12-06 08:13").

    python3 scripts/probe_kda_bwd_paths.py [--case 1x2048-h16-hv16 ...] [--list]
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel

PATHS = {  # name -> (FACTORS_FROM_FIRST_PASS, WY_IN_KERNEL)
    "both_off": (False, False),
    "first_pass": (True, False),
    "wy": (False, True),
    "device_pass": (True, True),
}
DEFAULT_CASES = ("1x2048-h16-hv16", "4x8192-h16-hv16")


@contextlib.contextmanager
def path_flags(bwd, first_pass: bool, wy: bool):
    """The module switches for one call, restored after."""
    saved = bwd.FACTORS_FROM_FIRST_PASS, bwd.WY_IN_KERNEL
    bwd.FACTORS_FROM_FIRST_PASS, bwd.WY_IN_KERNEL = first_pass, wy
    try:
        yield
    finally:
        bwd.FACTORS_FROM_FIRST_PASS, bwd.WY_IN_KERNEL = saved


def candidates(suite_mod, bwd, inputs) -> dict:
    """name -> a call on `inputs` (ours under each path's switches; cuDNN where it runs)."""

    def ours(flags):
        def run(*_):
            with path_flags(bwd, *flags):
                return suite_mod.run_ours(inputs, None)

        return run

    fns = {name: ours(flags) for name, flags in PATHS.items()}
    cudnn = suite_mod.comparators().get("cudnn")
    if cudnn is not None:
        fns["cudnn"] = lambda *_: cudnn(inputs)
    return fns


def relative(a, b) -> float:
    """max |a - b| / max |b| (b's largest entry floored at 1e-30)."""
    return float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", action="append", default=[], help="a kda_bwd bench case")
    ap.add_argument("--list", action="store_true", help="print the cases and paths (no GPU)")
    args = ap.parse_args(argv)
    suite_mod = importlib.import_module("forgekernel.bench.suites.kda_bwd")
    cases = {c.name: c for c in suite_mod.BENCH_CASES}
    names = args.case or list(DEFAULT_CASES)
    for name in names:
        if name not in cases:
            raise SystemExit(f"no kda_bwd bench case {name!r}; cases: {', '.join(cases)}")
    print(f"paths: {', '.join(f'{n} {f}' for n, f in PATHS.items())}; cases: {', '.join(names)}")
    if args.list:
        return 0
    import torch

    from forgekernel.bench.methods import time_method

    bwd = importlib.import_module("forgekernel.ops.kda_bwd")
    device = torch.device("cuda")
    for index, name in enumerate(names):
        gen = torch.Generator(device=device).manual_seed(index)
        inputs = suite_mod.make_inputs(cases[name], torch.bfloat16, device, gen)
        fns = candidates(suite_mod, bwd, inputs)
        want = fns["both_off"]()
        for path in PATHS:
            got = fns[path]()
            errs = [relative(a, b) for a, b in zip(got, want) if b is not None]
            print(f"{name} {path}: max relative difference from both_off {max(errs):.3g}")
        samples = time_method("graph", fns, [()], warmup=3, reps=20, eager_reps=20)
        base = statistics.median(samples["both_off"])
        for path, s in samples.items():
            ms = statistics.median(s)
            print(f"{name} {path:12s} {ms:9.4f} ms  {base / ms:6.3f}x both_off", flush=True)
        del inputs, fns, want
        torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
