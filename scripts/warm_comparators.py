"""The comparators' first calls of `forgekernel bench SUITE`, made ahead in another process so
that their one-off costs land in the on-disk caches before the bench runs:

    python3 scripts/warm_comparators.py gdn_prefill kda_prefill [--list]

fla 0.6.0's Triton kernels autotune on their first call per key (heads and dims, not T): for
`chunk_gated_delta_rule`'s forward on Hopper 28 configs over its 5 kernels, each compiled then
timed, for `chunk_kda`'s 82 over 6; gdn_prefill's bench has three (H, HV), kda_prefill's two. Triton
keeps the compiled kernels and (fla's `cache_results`) the tuned configs on disk, so the bench's own
process then loads them instead of tuning again. The calls are the bench's own, in its order (the
host probe's case first, then every bench case in its bench dtype) on the bench's inputs
(`make_inputs`, seed --seed), so each key is tuned on the shape the bench would tune it on.
Started in the background at the beginning of a device call (scripts/device_jit_run.sh: WARM)
it overlaps the checks; the bench waits for it. One line per case: the seconds its first calls
took (in all, then each comparator's), what the comparators that say so ran (cuDNN's KDA
engine), the comparators that raised. A sidecar comparator (bench/sidecar.py: FlashQLA, whose
TileLang compiles each kernel on its first call into ~/.tilelang; fla on triton 3.7.1) makes its
first call in its own child, untimed. A comparator whose compiled kernels stay in its process
(`cache_in_process`: FlashInfer 0.7.2.post1's sm90 GDN prefill, `cute.compile` into a dict) is
not called: its compiles here would be spent again at the bench's first calls."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
FIRST_CALL = SimpleNamespace(methods=(), warmup=0, reps=0, eager_reps=0)  # a sidecar's timing


def plan(suite) -> list:
    """(case, dtype) in the bench's order of first calls: the host case, then the bench cases
    (each once)."""
    from forgekernel.bench.harness import host_case

    dtype = suite.dtypes_for_bench()[0]
    cases = [host_case(suite)] if suite.bench_cases or suite.host_case else []
    cases += [c for c in suite.bench_cases if c not in cases]
    return [(case, dtype) for case in cases]


def warm(suite, seed: int, device) -> None:
    """Every comparator once on every case of `plan`; a comparator that raises is named."""
    import torch

    from forgekernel.bench import sidecar
    from forgekernel.bench.check import free, sync
    from forgekernel.bench.harness import _what_ran, resolve_comparators
    from forgekernel.bench.sidecar import Sidecar

    comps, _ = resolve_comparators(suite)
    for index, (case, dtype) in enumerate(plan(suite)):
        t0 = time.perf_counter()
        gen = torch.Generator(device=device).manual_seed(seed + index)
        inputs = suite.make_inputs(case, dtype, device, gen)
        raised, ran, each, left = [], [], [], []
        for name, comp in comps.items():
            if getattr(comp, "cache_in_process", False):
                left.append(name)
                continue
            c0 = time.perf_counter()
            try:
                if isinstance(comp, Sidecar):  # its first call in its child, no timing method
                    sidecar.run(comp, inputs, sets=1, timing=FIRST_CALL, device=device)
                    continue
                comp(inputs)
                sync(device)
            except Exception as e:  # the bench reports it; here it only costs nothing more
                why = f": {str(e)[:300]}" if isinstance(comp, Sidecar) else ""  # the child's
                raised.append(f"{name} ({type(e).__name__}{why})")
                continue
            finally:  # which comparator's compiles and tuning the case's seconds went to
                each.append(f"{name} {time.perf_counter() - c0:.1f}")
            what = _what_ran(comp, inputs)  # cuDNN's engine choice, as the bench records it
            ran += [f"; {name} ran {what}"] if what else []
        del inputs
        free(device)
        took = time.perf_counter() - t0
        print(f"{suite.name} {case.name}: {took:.1f} s ({', '.join(each)})" + "".join(ran) +
              (f"; raised: {', '.join(raised)}" if raised else "") +
              (f"; left to the bench: {', '.join(left)}" if left else ""), flush=True)  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("suites", nargs="+")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--list", action="store_true", help="print the calls' cases and exit")
    args = parser.parse_args(argv)
    from forgekernel.bench.suites import get_suite

    for name in args.suites:
        suite = get_suite(name)
        if args.list:
            for case, dtype in plan(suite):
                print(name, case.name, str(dtype).removeprefix("torch."))
            continue
        import torch

        warm(suite, args.seed, torch.device("cuda", torch.cuda.current_device()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
