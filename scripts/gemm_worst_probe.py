"""Time the dense bf16 GEMM's old and new picks against cuBLAS on the cases under (or near) 0.95x
cuBLAS on the H100 (issue 17; docs/gemm/NOTES.md "The two cases under 0.95x on the H100"), in
one process: per shape the suite's inputs (as many sets as the bench rotates), each
configuration forced through the op and checked against the fp32 reference with the suite's
criterion, then timed beside cuBLAS with the bench's timer (`time_interleaved`: CUDA-graph
replays over the rotated sets). ratio = cuBLAS ms / ours (> 1: ours is faster). Last, the
name of each shape's cuBLAS kernel (torch.profiler, one call). The JSON is rewritten after
every shape; a configuration that fails gets a row with its error.

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/gemm_worst_probe.py OUT.json

Kernels: the standard set and the candidates (`forgekernel build --only gemm_dense_sm90
--candidates`); anything missing compiles on first use (~5-15 s each).
"""

from __future__ import annotations

import json
import sys

import torch

from forgekernel.bench.check import expected, free, verify
from forgekernel.bench.report import format_table
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90 import config as C
from forgekernel.kernels.gemm.dense.sm90.launch import config_for
from forgekernel.runtime.device import num_sms
from forgekernel.runtime.timing import median, rotation_sets, time_interleaved

DTYPE = torch.bfloat16
# (M, N, K): (label, configuration) rows, the chooser's pick of today first.
ROWS = {
    (4096, 576, 7168): [
        ("pick", None),
        ("fit144_c21 (old pick)", C.FIT_144),
        ("fit144_c12", C.FIT_144_A),
        ("fit144_n", C.FIT_144_N),
        ("tall96", C.TALL_96),
    ],
    (16384, 4608, 3584): [
        ("pick", None),
        ("large (old pick)", C.LARGE),
        ("large_band6", C.LARGE_BAND),
        ("large_n", C.LARGE_N),
        ("large_stream", C.LARGE_STREAM),
    ],
    (16384, 4096, 12288): [
        ("pick", None),
        ("large (old pick)", C.LARGE),
        ("large_band6", C.LARGE_BAND),
        ("large_n", C.LARGE_N),
    ],
    (777, 4096, 14336): [("pick", None)],
    (2048, 7168, 5120): [("pick", None)],
}


def pick(m: int, n: int, k: int, device: torch.device):
    """The configuration the op runs for (M, N, K) on `device` with none forced (launch.py
    `_choose`): a tuning record's, else the chooser's for the device's SM count."""
    return config_for(DTYPE, False, m, n, k, num_sms(device.index))


def forced(cfg):
    """run(inputs, out): the op with `cfg` forced (None: the chooser's pick)."""

    def run(inputs, out):
        from forgekernel.ops.gemm import gemm

        return gemm(inputs["a"], inputs["b"], out=out, b_layout="nk", config=cfg)

    return run


def cublas_kernel(inputs) -> str:
    """The device kernels of one torch.matmul into `out` (the suite's comparator)."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            gemm_suite.cublas(inputs)
            torch.cuda.synchronize()
        kinds = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return "; ".join(sorted({e.name for e in kinds}))
    except Exception as e:  # noqa: BLE001 (the names are a note: the timing stands without)
        return f"profiler failed: {type(e).__name__}: {e}"[:200]


def measure(shape, rows, suite, gen, device) -> list[dict]:
    m, n, k = shape
    case = gemm_suite._case(m, n, k, group="probe")
    sets = [gemm_suite.make_inputs(case, DTYPE, device, gen)]
    sets += [gemm_suite.make_inputs(case, DTYPE, device, gen)
             for _ in range(rotation_sets(suite.bytes(case, DTYPE)) - 1)]  # fmt: skip
    expect = expected(suite, sets[0])
    out_rows, fns = [], {}
    for label, cfg in rows:
        tag = (cfg or pick(m, n, k, device)).tag()
        row = {"shape": case.name, "config": label, "tag": tag}
        out_rows.append(row)
        try:
            cmp = verify(suite, sets[0], device, run=forced(cfg), expect=expect)[1][0]
        except Exception as e:  # noqa: BLE001 (a config the kernel rejects: recorded)
            row["status"] = f"failed: {type(e).__name__}: {e}"[:200]
            continue
        row.update(max_err=cmp.err, status="ok" if cmp.ok else cmp.message)
        if cmp.ok:
            fns[label] = forced(cfg)
    fns["cublas"] = lambda inputs, out: gemm_suite.cublas(inputs)
    rotate = [(inputs, gemm_suite.alloc_out(inputs)) for inputs in sets]
    samples = time_interleaved(fns, rotate=rotate, warmup=max(5, len(rotate)), reps=15)
    ref_ms = median(samples["cublas"])
    for row in out_rows:
        if row["config"] in samples:
            ms = median(samples[row["config"]])
            row.update(us=1e3 * ms, cublas_us=1e3 * ref_ms, ratio=ref_ms / ms)
    out_rows.append(
        {"shape": case.name, "config": "cublas", "us": 1e3 * ref_ms, "tag": cublas_kernel(sets[0])}
    )
    return out_rows


def main(argv: list[str]) -> None:
    if not argv:
        sys.exit(__doc__)
    device = torch.device("cuda")
    suite = gemm_suite.suite()
    gen = torch.Generator(device=device).manual_seed(0)
    rows: list[dict] = []
    print(torch.cuda.get_device_name(), flush=True)
    for shape, configs in ROWS.items():
        rows += measure(shape, configs, suite, gen, device)
        free(device)
        with open(argv[0], "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)
    headers = ("shape", "config", "us", "cuBLAS us", "ratio", "status", "tag")
    table = [
        [r["shape"], r["config"], f"{r['us']:.1f}" if "us" in r else "-",
         f"{r['cublas_us']:.1f}" if "cublas_us" in r else "-",
         f"{r['ratio']:.3f}" if "ratio" in r else "-", r.get("status", ""), r["tag"]]
        for r in rows
    ]  # fmt: skip
    print(format_table(headers, table))


if __name__ == "__main__":
    main(sys.argv[1:])
