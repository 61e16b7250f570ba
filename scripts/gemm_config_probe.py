"""Run each GEMM configuration on shapes that give every CTA one, or several, tiles, each in
its own process (a fault must not hide the next result); prints OK / WRONG / CRASH per pair.
    bash .bundle/run.sh python scripts/gemm_config_probe.py"""

from __future__ import annotations

import os
import subprocess
import sys

CHILD = """
import sys, torch, forgekernel
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
cfg = GemmConfig(**eval(sys.argv[1]))
for shape in sys.argv[2:]:
    m, n, k = map(int, shape.split('x'))
    a = torch.randn(m, k, device='cuda', dtype=torch.bfloat16)
    b = torch.randn(n, k, device='cuda', dtype=torch.bfloat16)
    c = forgekernel.gemm(a, b, config=cfg); torch.cuda.synchronize()
    err = (c.float() - a.float() @ b.float().t()).abs().max().item()
    print(shape + ':' + ('OK' if err < 4 else f'WRONG({err:.3g})'), flush=True)
"""

CONFIGS = [
    dict(tile_m=64, tile_n=64, cluster_m=1, cluster_n=2),
    dict(tile_m=64, tile_n=64, cluster_m=1),
    dict(tile_m=64, tile_n=128, cluster_m=2),
    dict(tile_m=128, tile_n=64, cluster_m=1, cluster_n=2),
    dict(tile_m=64, tile_n=256, cluster_m=2),
    dict(tile_n=128, cluster_m=2),
    dict(tile_n=128, cluster_m=1),
    # raster bands (no standard configuration swizzles): the last band narrower than the rest
    dict(swizzle=2),
    dict(swizzle=3, raster_along_m=False),
    dict(),
]
SHAPES = [
    "8192x8192x1024",
    "128x8192x1024",
    "256x8192x1024",
    "128x65536x512",
    "1024x1024x1024",
    "1000x3000x4104",
]
if os.environ.get("PROBE_ONLY"):
    CONFIGS = [c for c in CONFIGS if str(c).find(os.environ["PROBE_ONLY"]) >= 0]

for cfg in CONFIGS:
    p = subprocess.run(
        [sys.executable, "-c", CHILD, repr(cfg), *SHAPES],
        capture_output=True,
        text=True,
        timeout=120,
    )
    done = p.stdout.split()
    crash = [] if p.returncode == 0 else [f"{SHAPES[len(done)]}:CRASH"]
    print(f"{str(cfg):60s} " + " ".join(done + crash), flush=True)
