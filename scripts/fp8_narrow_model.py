"""The narrow full-K FP8 tiles against the chooser's plan on the six mid / decode losers (issue
21; docs/gemm/NOTES.md "Narrow full-K FP8 tiles"): per case the plan's tiles, CTAs, k-tiles a
CTA and parked fp32 partials, and each 64-row width's tiles, rounds, bytes a CTA and modelled
time (fp8/sm90/config.py `narrow_time`). DSL-free. Usage: fp8_narrow_model.py [c0 cycles]."""

from __future__ import annotations

import sys

from forgekernel.kernels.gemm.dense.sm90.config import _ceil, stream_plan
from forgekernel.kernels.gemm.dense.sm90.tile import straddles
from forgekernel.kernels.gemm.fp8.sm90.config import (
    NARROW_C0,
    NARROW_GHZ,
    NARROW_T0_US,
    NARROW_WIDTHS,
    STREAM_MIN_K,
    narrow,
    narrow_config,
    narrow_time,
    wide_config,
)

SMS = 132
# (M, N, K): ours us, DeepGEMM us (H200, graph, 2026-12-05 04:20)
CASES = {
    (512, 576, 7168): (16.8, 11.7),
    (128, 1536, 7168): (13.4, 10.7),
    (16, 7168, 2048): (9.1, 7.2),
    (64, 4096, 7168): (13.7, 11.6),
    (1, 10240, 5120): (20.0, 17.5),
    (64, 36864, 7168): (72.2, 69.8),
}


def plan(m: int, n: int, k: int, measured: float) -> str:
    """The plan narrow was measured against (`wide_config`): tiles, CTAs, k-tiles a CTA, parts a
    tile and parked fp32 bytes."""
    cfg = wide_config(m, n, k)  # the plan narrow was measured against (the chooser before it)
    k_tiles, tiles = _ceil(k, 128), _ceil(m, cfg.tile_m) * _ceil(n, cfg.tile_n)
    if not cfg.stream_k:
        return f"{cfg.tag()}: {tiles} tiles, {min(tiles, SMS)} CTAs, {k_tiles} k-tiles a CTA"
    per, ctas, _ = stream_plan(cfg, m, n, k, SMS, STREAM_MIN_K)
    parts = _ceil(k_tiles, per)
    parked = tiles * (parts - 1) * cfg.tile_m * cfg.tile_n * 4 / 2**20
    # the streamed k-tiles alone at the model's per-k-tile latency: the rest of the measured
    # time is the parts' park / flag wait / sum (the fix-up) and the partials' traffic
    alone = NARROW_T0_US + per * (NARROW_C0 + cfg.tile_m * cfg.tile_n / 32) / (NARROW_GHZ * 1e3)
    return (f"{cfg.tag()}: {tiles} tiles, {ctas} CTAs, {per} k-tiles a CTA, ~{parts} parts a "
            f"tile, {parked:.1f} MB of fp32 partials parked and read back; its k-tiles alone "
            f"{alone:.1f} us, so ~{measured - alone:.1f} us of fix-up")  # fmt: skip


def main(c0: float = NARROW_C0) -> None:
    print(f"c0 = {c0} cycles a k-tile besides the tensor's, {NARROW_GHZ} GHz")
    for (m, n, k), (ours, dg) in CASES.items():
        print(f"\n{m}x{n}x{k}: ours {ours} us ({n * k / 1e6 / ours:.2f} TB/s of weight), "
              f"DeepGEMM {dg} ({n * k / 1e6 / dg:.2f}); {plan(m, n, k, ours)}")  # fmt: skip
        best = narrow(m, n, k)
        for w in NARROW_WIDTHS:
            cfg = narrow_config(m, w)
            tiles = _ceil(m, 64) * _ceil(n, w)
            rows = cfg.a_rows or 64
            cta_kb = _ceil(k, 128) * (rows + w) * 128 / 1024
            t = narrow_time(cfg, m, n, k, c0)
            mark = " <- narrow" if cfg == best else ""
            cross = " (straddles)" if straddles(w) else ""
            print(f"  64x{w}{cross}: {tiles} tiles, {tiles / SMS:.2f} rounds, {_ceil(k, 128)} "
                  f"k-tiles, {cta_kb:.0f} KB a CTA: {t:.1f} us = {t / ours:.2f}x ours, "
                  f"DeepGEMM / it {dg / t:.3f}{mark}")  # fmt: skip


if __name__ == "__main__":
    main(float(sys.argv[1]) if len(sys.argv) > 1 else NARROW_C0)
