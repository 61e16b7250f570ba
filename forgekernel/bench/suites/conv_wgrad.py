"""Conv2d weight-gradient suite (issue 23; the bar: >= 1.05x cuDNN at the median, no case below
0.95x): the issue's point (N32 C256 56x56 K256 3x3), ResNet-50's 3x3 and 1x1 layers (batch 32,
one at 64), the stride-2 downsampling layers, the stem (C = 3) and SD VAE decoder blocks
(batch 8). Shared parts: `conv_layers`.

Ours is the implicit-GEMM weight-gradient kernel (kernels/conv/sm90/wgrad.py: the dense GEMM's
kernel with dY^T and the im2col of x as operands, split over the pixels); the first GPU check
(2026-12-01) measured the interim explicit im2col + dense GEMM it replaced.
No `as_gemm` variant (conv_fwd / conv_dgrad have it on their 1x1s): dw = dy^T x reduces over
the pixels, along which neither operand is contiguous, and the dense GEMM takes A K-major only
(docs/conv/NOTES.md, "1x1 convolutions as GEMMs").
"""

from __future__ import annotations

import math
from typing import Any

from forgekernel.bench.suite import Case, OpSuite
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import WGRAD_SPEC

BENCH_CASES = L.unique(
    (
        L.conv_case("wgrad", 32, 256, 256, (56, 56), 3, group="resnet", source="issue23"),
        *L.resnet50("wgrad", 32, lambda c, k, hw, f, s: s == 1 and c > 3, "resnet"),
        L.conv_case("wgrad", 64, 64, 64, (56, 56), 3, group="resnet", source="resnet50.layer1"),
        *L.stride2_layers("wgrad", "stride2"),
        *L.resnet50("wgrad", 32, lambda c, k, hw, f, s: c == 3, "stem"),
        *L.sd_vae_decoder("wgrad", 8, "sd_vae"),
    )
)
# Odd edges: 3 input channels, 5 / 40 / 136 output channels, odd sizes, kernels 1 to 7,
# stride 2, dilation 2, a 3-D gradient; and a moderate case.
CHECK_CASES = (
    L.conv_case("wgrad", 2, 3, 5, (17, 19), 3),
    L.conv_case("wgrad", 2, 24, 40, (13, 11), 5, 2),
    L.conv_case("wgrad", 3, 72, 136, (9, 7), 3, dilation=2),
    L.conv_case("wgrad", 2, 16, 32, (10, 10), 2, 2, 0),
    L.conv_case("wgrad", 1, 3, 16, (30, 30), 7, 2),
    L.conv_case("wgrad", 2, 64, 64, (9, 9), 1),
    L.conv_case("wgrad", 1, 8, 16, (4, 6, 6), 3),
    L.conv_case("wgrad", 4, 128, 128, (28, 28), 3, group="resnet"),
)
# the fifth: the stem's fold kernel (C 3, 7x7, stride 2)
SANITIZE_CASES = (CHECK_CASES[0], CHECK_CASES[2], CHECK_CASES[6], CHECK_CASES[4])


def variants(case: Case) -> dict[str, Any]:
    """`stem_copy` / `im2col` on the stem (conv_layers.stem_variants: ours runs it by the fold of
    kernels/conv/sm90/stem.py); on the unpadded stride-1 1x1s (C and K multiples of 8, pixels
    of 8; the rectangles' walk over one plane) the split's variants (`one_by_one_variants`)."""
    stem = L.stem_variants(case)
    if stem:
        return stem
    found = {}
    if case.name in NO_PDL_CASES:
        found = {"no_pdl": L.run_no_pdl, "pdl_late": L.run_pdl_late}
    p = case.params
    m = p["n"] * math.prod(L.output_spatial(p))
    one = all(v == 1 for v in (*p["kernel"], *p["stride"])) and not any(p["padding"])
    if p["op"] != "wgrad" or not one or m % 8 or p["c"] % 8 or p["k"] % 8:
        return found
    return {**one_by_one_variants(p["k"], p["c"], _one_plane_k_tiles(p)), **found}


# The short weight gradients timed without programmatic dependent launch too (variant
# `no_pdl`: ours / this time is what PDL saves, docs/gemm/NOTES.md "Programmatic dependent
# launch"): three resnet 1x1s of 9-17 us and a 3x3 of 30 us.
NO_PDL_CASES = (
    "n32-c512-7x7-k2048-1x1",
    "n32-c1024-14x14-k512-1x1",
    "n32-c128-28x28-k512-1x1",
    "n32-c64-56x56-k64-3x3",
)


def one_by_one_variants(k: int, c: int, k_tiles: int) -> dict[str, Any]:
    """The variants of an unpadded stride-1 1x1 of K output and C input channels over
    `k_tiles` pixel k-tiles (docs/conv/NOTES.md, "The 1x1 weight gradients at 0.73-0.85x" and
    "The reduce split refit from 18:58"):
    - `reduce`: the reduce split (wgrad.py `_reduce_part`: every part bulk-reduce-adds its
      fp32 tile into one sum slot a tile, the last part reads that slot alone;
      `choose_wgrad_reduce`'s plan) where the model (`wgrad_time`) puts it under the parked
      split (`wgrad_prefers_reduce`), also where the launcher now takes it by itself (~1.00x);
    - `reduce_64x128`: the reduce split on the 64x128 tile where the model's reduce plan cuts
      K into more than 2 tile rows and C fits one 128-wide tile (n32-c128-28x28-k512: C whole
      in every CTA, K in 8 stripes), which tells the refit's two readings of the 18:58 table
      apart.
    (`parked_fit`, the parked split on `wgrad_time`'s best plan, ran 1.04-1.38x of ours on
    2026-12-03 21:47: dropped, docs/conv/NOTES.md "Measured 2026-12-03 21:47".)"""
    from forgekernel.kernels.conv.sm90.wgrad_config import wgrad_prefers_reduce, wgrad_tiles

    out: dict[str, Any] = {}
    plan = wgrad_prefers_reduce(k, c, 1, k_tiles)
    if plan is not None:
        out["reduce"] = run_reduce
        if c <= 128 and wgrad_tiles(plan.config, k, 1, 1) > 2:
            out["reduce_64x128"] = run_reduce_64x128
    return out


def _one_plane_k_tiles(p: dict) -> int:
    """The pixel k-tiles of an unpadded stride-1 1x1 (pixels of 8) on the launcher's walk:
    the rectangles over dY and X seen as one plane of 8-pixel rows (launch._one_plane)."""
    from forgekernel.kernels.conv.sm90.geometry import rect_k_tiles, rect_width

    rows = p["n"] * math.prod(L.output_spatial(p)) // 8
    return rect_k_tiles(1, 1, rows, 8, rect_width(rows, 8))


def _run_plan(inputs, out, plan=None, reduce: bool = False):
    """Ours with a given plan (or launch.wgrad's `reduce`), as run_ours writes dw."""
    from forgekernel.kernels.conv.sm90 import launch
    from forgekernel.ops import conv as op

    p = inputs["params"]
    dw = L.alloc_out(inputs) if out is None else out
    g = op._geometry_of(p["stride"], p["padding"], p["padding"], p["dilation"], p["kernel"])
    dy, x = op._as5d(inputs["dy"]), op._as5d(inputs["x"])
    launch.wgrad(dy, x, op._view5d(dw), g, plan, reduce)
    return dw


def run_reduce(inputs, out):
    """Ours with the reduce split's plan (launch.wgrad's `reduce`)."""
    return _run_plan(inputs, out, reduce=True)


def run_reduce_64x128(inputs, out):
    """Ours with the reduce split on the 64x128 tile (`choose_wgrad_reduce`'s parts for it)."""
    from forgekernel.kernels.conv.sm90.wgrad_config import WGRAD_SHORT, choose_wgrad_reduce

    p = inputs["params"]
    k_tiles = _one_plane_k_tiles(p)
    plan = choose_wgrad_reduce(p["k"], p["c"], 1, k_tiles, configs=(WGRAD_SHORT,))
    return _run_plan(inputs, out, plan)


def suite() -> OpSuite:
    return L.conv_suite(
        "conv_wgrad", WGRAD_SPEC.sources, CHECK_CASES, BENCH_CASES, SANITIZE_CASES, variants
    )
