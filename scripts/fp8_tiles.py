"""Time the block-scaled FP8 GEMM with each candidate tile configuration forced, against
DeepGEMM, on the gemm_fp8 suite's mid / prefill / square shapes and three more (issue 21).

Per shape: the suite's quantized inputs, as many sets as the bench rotates through; each config's
kernel called as the launcher calls it, the config forced instead of `choose_config`'s; checked
against the fp64 reference with the suite's criterion (max error <= 2 x cuBLASLt's + atol), then
timed beside DeepGEMM's fp8_gemm_nt (where deep_gemm imports) with the bench's timer
(`time_interleaved`: CUDA-graph replays over the rotated sets). ratio = DeepGEMM ms / ours
(> 1: ours is faster). A config the kernel rejects (tiles wider than 128 until the dense kernel
takes them with FP8) gets a row with its error. The JSON is rewritten after every shape.

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/fp8_tiles.py OUT.json [GROUP ...]
GROUP: mid, prefill, square, extra (default all). Kernels from a bundle made after the configs
changed (`forgekernel bundle .bundle`; FORGEKERNEL_KERNEL_DIR=$PWD/.bundle/kernels).
"""

from __future__ import annotations

import json
import sys

import torch

from forgekernel.bench.check import expected, free, verify
from forgekernel.bench.report import format_table
from forgekernel.bench.suite import Case
from forgekernel.bench.suites import gemm_fp8 as fp8_suite
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import STANDARD_CONFIGS, choose_config, params_for
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms
from forgekernel.runtime.timing import median, rotation_sets, time_interleaved

DTYPE = torch.bfloat16
GROUPS = ("mid", "prefill", "square", "extra")
EXTRA = ((2048, 7168, 4096), (8192, 4608, 7168), (4096, 1536, 7168))
# Tiles the dense kernel rejects with FP8 today (tile_n must be 128; 160 is no tile_n at all);
# a prototype of the change compiles 128x192 and 128x160 without spills (issue 21 report).
WIDE = (
    GemmConfig(tile_m=128, tile_n=192, tile_k=128, cluster_m=2),
    GemmConfig(tile_m=128, tile_n=160, tile_k=128, cluster_m=2),
)


def cases(groups: tuple[str, ...]) -> list[Case]:
    suite_cases = [c for c in fp8_suite.BENCH_CASES if c.group in groups]
    extra = [Case(f"{m}x{n}x{k}", {"m": m, "n": n, "k": k}, "extra") for m, n, k in EXTRA]
    return suite_cases + (extra if "extra" in groups else [])


def configs_for(m: int, n: int, k: int) -> list[GemmConfig]:
    """The chooser's pick first, then every prebuilt 128-row tile, then the wide ones."""
    found = [choose_config(m, n, k)]
    for cfg in (*STANDARD_CONFIGS, *WIDE):
        if cfg.tile_m == 128 and cfg.fits(m) and cfg not in found:
            found.append(cfg)
    return found


def forced(cfg: GemmConfig, device: torch.device):
    """run(inputs, out) with `cfg`'s kernel: `launch.gemm_fp8`'s call (N a multiple of 8)."""
    fn = get_kernel(SPEC, params_for(dtype_name(DTYPE), cfg))
    clusters = num_sms(device.index) // (cfg.cluster_m * cfg.cluster_n)

    def run(inputs, out):
        a, b = as_tma_ready(inputs["a"]), as_tma_ready(inputs["b"])
        fn(a, b, out, None, None, 0, inputs["sa"], inputs["sb"], None, clusters)
        return out

    return run


def measure(case: Case, suite, gen, device) -> list[dict]:
    m, n, k = (case.params[x] for x in "mnk")
    assert n % 8 == 0, "forced configs write C directly: N must be a multiple of 8"
    sets = [fp8_suite.make_inputs(case, DTYPE, device, gen)]
    sets += [fp8_suite.make_inputs(case, DTYPE, device, gen)
             for _ in range(rotation_sets(suite.bytes(case, DTYPE)) - 1)]  # fmt: skip
    expect = expected(suite, sets[0])
    rows, fns = [], {}
    for i, cfg in enumerate(configs_for(m, n, k)):
        row = {"shape": case.name, "group": case.group, "config": cfg.tag(), "chosen": i == 0}
        rows.append(row)
        try:
            run = forced(cfg, device)
            cmp = verify(suite, sets[0], device, run=run, expect=expect)[1][0]
        except Exception as e:  # noqa: BLE001 (a config the kernel rejects: recorded)
            row["status"] = f"not built: {type(e).__name__}: {e}"[:200]
            continue
        row.update(max_err=cmp.err, bound=cmp.bound, status="ok" if cmp.ok else cmp.message)
        if cmp.ok:
            fns[row["config"]] = run
    deepgemm = suite.comparators().get("deepgemm")
    if deepgemm is not None:
        fns["deepgemm"] = lambda inputs, out: deepgemm(inputs)
        err = float((deepgemm(sets[0]).float() - expect[0][0]).abs().max())
        rows.append({"shape": case.name, "group": case.group, "config": "deepgemm",
                     "chosen": False, "max_err": err, "status": "comparator"})  # fmt: skip
    rotate = [(inputs, fp8_suite.alloc_out(inputs)) for inputs in sets]
    samples = time_interleaved(fns, rotate=rotate, warmup=max(5, len(rotate)), reps=15)
    ref_ms = median(samples["deepgemm"]) if deepgemm is not None else None
    for row in rows:
        if row["config"] in samples:
            ms = median(samples[row["config"]])
            row.update(ms=ms, tflops=suite.flops(case) / ms / 1e9, deepgemm_ms=ref_ms)
            row["ratio"] = ref_ms / ms if ref_ms else None
    return rows


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    path, groups = argv[0], tuple(argv[1:]) or GROUPS
    device = torch.device("cuda")
    suite = fp8_suite.suite()
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    have_dg = suite.comparators().get("deepgemm") is not None
    print(f"{torch.cuda.get_device_name()}; DeepGEMM {'found' if have_dg else 'absent'}")
    for case in cases(groups):
        rows += measure(case, suite, gen, device)
        free(device)
        with open(path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
        print(f"{case.name} done", flush=True)
    headers = ("shape", "config", "chosen", "ms", "TFLOP/s", "vs DeepGEMM", "max err", "status")
    table = [
        (r["shape"], r["config"], "*" if r["chosen"] else "", _fmt(r.get("ms"), ".4f"),
         _fmt(r.get("tflops"), ".0f"), _fmt(r.get("ratio"), ".3f"),
         _fmt(r.get("max_err"), ".3g"), r["status"][:60])
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))


if __name__ == "__main__":
    main(sys.argv[1:])
