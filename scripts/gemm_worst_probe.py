"""The dense GEMM's slowest bench cases of 2026-12-02 15:48 (issue 17), each timed with the
configurations that could lift it (`PROBES`, config.py's candidates) beside the chooser's pick and
cuBLAS, through the bench itself (`harness.bench_case`: verification, CUDA-graph replays over
rotated inputs, eager launches with L2 flushed): one (case, candidate) at a time, so that a
candidate that fails to launch or verify loses only its own row. The candidates most likely to
fault (the swapped stream-K plans, first run here) come last; the JSON is rewritten after every
row. docs/gemm/NOTES.md "The slowest cases of the 15:48 bench" says what each row decides.

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/gemm_worst_probe.py OUT.json [CASE ...]

CASE: names as printed (e.g. 300x28672x4096); default all. Kernels compile on first use (about
5 s each on the host CPU), or come from a bundle built with `forgekernel build --candidates`.
"""

from __future__ import annotations

import dataclasses
import json
import sys

import torch

from forgekernel.bench.harness import BenchTiming, bench_case, resolve_comparators
from forgekernel.bench.suite import Case
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import (
    DECODE_13,
    DECODE_48,
    DECODE_112,
    DECODE_256,
    DECODE_STREAM,
    FIT_144,
    SQUARE,
    STAGE_BACK,
    SWAP_N,
    SWAP_STREAM_144,
    SWAP_TALL_80,
    WIDE,
    choose_config,
)

# (M, N, K): (label, configuration) rows, each timed beside the chooser's pick and cuBLAS. The
# controls: 512x10240x5120 (the swap at 7 token tiles: its re-read weight), 777x4096x14336
# and 129x10240x8192 (every token tile of a weight tile in one round already: the raster should
# not matter), 1x4096x4096 (10.7 us at 13 stages on 2026-12-01, 11.9 at 22).
PROBES = {
    (300, 28672, 4096): (("swap80_n", SWAP_N[0]), ("swaptall_n", SWAP_N[2])),
    (512, 10240, 5120): (("swap80_n", SWAP_N[0]),),
    (777, 4096, 14336): (("swap208_n", SWAP_N[1]), ("swap208_s5", STAGE_BACK[1])),
    (512, 3584, 3584): (("fit112_s7", STAGE_BACK[0]),),
    (129, 10240, 8192): (
        ("swaptall_n", SWAP_N[2]),
        ("swap_sk144", SWAP_STREAM_144),
        # no box past the 129 tokens (144 columns read 15 zero rows), but the 1x2-cluster walk
        ("swaptall_sk", dataclasses.replace(SWAP_TALL_80, stream_k=True)),
    ),
    (256, 8192, 8192): (("square", SQUARE), ("fit144", FIT_144)),
    (1, 4608, 3584): (
        ("a8_s13", DECODE_13[0]),
        ("n48_a8", DECODE_48[0]),
        ("n48_a8_s13", dataclasses.replace(DECODE_48[0], stages=13)),
        ("sk_a8", DECODE_STREAM[0]),
    ),
    (1, 4096, 4096): (("a8_s13", DECODE_13[0]),),
    (32, 5120, 5120): (("a32_s13", DECODE_13[1]), ("n48_a32", DECODE_48[1])),
    (4, 28672, 4096): (
        ("a8_s13", DECODE_13[0]),
        ("n112_a8", DECODE_112),
        ("sk_a8", DECODE_STREAM[0]),
    ),
    (16, 32768, 512): (("n256_a16", DECODE_256),),
    # WIDE in bands of 4 cluster rows walked N-first: a round's A rows 8 MB and B columns 25 MB
    # where M-first touches all 41 MB of A and 5 MB of B (the L2 holds 50 MB)
    (5000, 6144, 4096): (
        ("wide_band4", dataclasses.replace(WIDE, raster_along_m=False, swizzle=4)),
    ),
}


def cases(names: list[str]) -> list[tuple[Case, str, object]]:
    """(case, label, configuration) rows in run order: the swapped stream-K rows last."""
    rows = []
    for (m, n, k), candidates in PROBES.items():
        name = f"{m}x{n}x{k}"
        if names and name not in names:
            continue
        case = Case(name, {"m": m, "n": n, "k": k, "b_layout": "nk"}, "probe")
        rows += [(case, label, cfg) for label, cfg in candidates]
    return sorted(rows, key=lambda r: r[2].swap and r[2].stream_k)


def row(suite, case: Case, label: str, cfg, comps, missing, seed: int) -> dict:
    probe = dataclasses.replace(suite, variants=lambda c: {label: _forced(cfg)})
    rec = bench_case(
        probe,
        case,
        torch.bfloat16,
        comps=comps,
        missing=missing,
        seed=seed,
        device=torch.device("cuda"),
        timing=BenchTiming(),
    )
    out = {"case": case.name, "label": label, "config": cfg.tag(), "status": rec["status"]}
    out["pick"] = choose_config(case.params["m"], case.params["n"], case.params["k"]).tag()
    for method, view in (("graph", rec), ("eager", rec.get("eager") or {})):
        ours = (view.get("ours") or {}).get("ms")
        cublas = ((view.get("comparators") or {}).get("cublas") or {}).get("ms")
        variant = (view.get("variants") or {}).get(label) or {}
        out[method] = {
            "pick_us": ours and ours * 1e3,
            "cublas_us": cublas and cublas * 1e3,
            "candidate_us": variant.get("ms") and variant["ms"] * 1e3,
            "candidate_status": variant.get("status"),
        }
    return out


def _forced(cfg):
    def run(inputs, out):
        from forgekernel.ops.gemm import gemm

        return gemm(inputs["a"], inputs["b"], out=out, b_layout="nk", config=cfg)

    return run


def _line(r: dict) -> str:
    cells = []
    for method in ("graph", "eager"):
        f = r[method]
        pick, cub, cand = f["pick_us"], f["cublas_us"], f["candidate_us"]
        if not (pick and cub):
            cells.append(f"{method}: {r['status'][:60]}")
            continue
        got = f"{cand:8.1f} us {cub / cand:5.3f}x" if cand else f"{f['candidate_status']}"[:40]
        cells.append(f"{method}: pick {pick:8.1f} ({cub / pick:5.3f}x) cand {got}")
    return f"{r['case']:18s} {r['label']:12s} {r['config']:34s} " + " | ".join(cells)


def main() -> None:
    out_path, names = sys.argv[1], sys.argv[2:]
    suite = gemm_suite.suite()
    comps, missing = resolve_comparators(suite)
    rows = []
    for i, (case, label, cfg) in enumerate(cases(names)):
        rows.append(row(suite, case, label, cfg, comps, missing, seed=i))
        print(_line(rows[-1]), flush=True)
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
