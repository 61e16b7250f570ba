"""Time every GEMM config the bundle holds (standard + candidates, bf16 "nk") against cuBLAS on
the suite's key shapes; prints one row per (shape, config). Run on the GPU after a bundle made
with `forgekernel bundle DIR --candidates`:  bash DIR/run.sh ... is not needed, call
    PYTHONPATH=... python3 scripts/gemm_sweep.py  (scripts/device_run.sh does it)."""

from __future__ import annotations

import functools
import json
import os
import sys

import torch

from forgekernel.kernels.gemm.dense.sm90 import SPEC
from forgekernel.kernels.gemm.dense.sm90.config import (
    CANDIDATES,
    LARGE,
    SMALL,
    STANDARD_CONFIGS,
    params_for,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.timing import median, rotation_sets, time_interleaved

SHAPES = (
    [(128, 8192, 8192)]
    if os.environ.get("SWEEP_SKINNY")
    else [
        (4096, 4096, 4096),
        (8192, 8192, 8192),
        (8192, 28672, 8192),
        (8192, 8192, 28672),
        (8192, 10240, 8192),
        (64, 8192, 8192),
        (128, 8192, 8192),
        (256, 8192, 8192),
        (1000, 3000, 4104),
    ]
)


def _fits(cfg, m: int) -> bool:
    """Skinny tiles only for skinny M; LARGE and SMALL everywhere. Not the stream-K ones (a
    workspace and a plan: the launcher's, timed by `forgekernel bench gemm`'s variants and
    scripts/gemm_split_probe.py), nor the swapped ones (their operands and C view: the
    launcher's) or an A box shorter than M (this calls the kernel directly)."""
    if cfg.stream_k or cfg.swap or not cfg.fits(m):
        return False
    skinny = cfg.tile_m * cfg.tile_n < 128 * 128
    return cfg in (LARGE, SMALL) or skinny == (m <= 256)


def _call(fn, clusters, a, b, c):
    fn(a, b, c, None, None, 0, None, None, None, clusters)


def main() -> None:
    out_path = sys.argv[1] if len(sys.argv) > 1 else None
    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for m, n, k in SHAPES:
        sets = rotation_sets(2 * (m * k + n * k + m * n))
        args = [
            (
                torch.randn(m, k, device="cuda", dtype=torch.bfloat16),
                torch.randn(n, k, device="cuda", dtype=torch.bfloat16),
                torch.empty(m, n, device="cuda", dtype=torch.bfloat16),
            )
            for _ in range(sets)
        ]
        fns = {"cublas": lambda a, b, c: torch.matmul(a, b.t(), out=c)}
        for cfg in STANDARD_CONFIGS + CANDIDATES:
            if not _fits(cfg, m):
                continue
            only = os.environ.get("SWEEP_ONLY")
            if only and only not in cfg.tag() and cfg != LARGE:
                continue
            fn = get_kernel(SPEC, params_for("bfloat16", False, cfg))
            cl = cfg.cluster_m * cfg.cluster_n
            fns[cfg.tag()] = functools.partial(_call, fn, sms // cl)
        ref = args[0][0].float() @ args[0][1].float().t()
        samples = time_interleaved(fns, rotate=args, reps=15)
        base = median(samples["cublas"])
        for name, s in samples.items():
            a, b, c = args[0]
            fns[name](a, b, c)
            err = (c.float() - ref).abs().max().item()
            ms = median(s)
            rows.append(
                {
                    "shape": f"{m}x{n}x{k}",
                    "config": name,
                    "ms": ms,
                    "tflops": 2 * m * n * k / ms / 1e9,
                    "ratio": base / ms,
                    "maxerr": err,
                }
            )
            print(
                f"{m}x{n}x{k:<6} {rows[-1]['tflops']:6.1f} TF/s {ms * 1e3:8.1f} us "
                f"ratio {base / ms:5.3f} err {err:6.3g} {name}",
                flush=True,
            )
    if out_path:
        with open(out_path, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
