"""`scale_warp` (the FP8 GEMM's scales loaded and staged by the producer warpgroup's warp 1, the
TMA loads issued alone by warp 0; docs/gemm/NOTES.md "next/fp8-narrow-scales"; four ahead the
64-row-box narrow tiles' standard since 2026-12-07, "next/fp8-f4sw") on an sm90 GPU, forced
through the launcher: against the fp64 reference into a NaN-poisoned out and bit for bit
against the same config without it (the same WGMMAs, the same
fp32 products A's x B's staged, the same promotions: only which warp stages them differs). The
narrow full-K tiles on awkward shapes (M under one tile and off it, N off 8 through the
launcher's scratch, K / 128 odd, a long K: 128 / 129 k-tiles over an 18-21 stage ring), with
the scales four ahead too (`_f4_sw`), and the other tiled mainloops it reaches, two and four
ahead: LARGE (B multicast over 2x1; the scale warp two ahead its standard since 2026-12-07),
LARGE_MCAST_A (A multicast over 1x2, A's scales M-major, bands of 8; four ahead its standard);
the grouped layout's tile four ahead (GROUPED_F4_SW)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from fp8_forced import CUDA, FP8, forced, inputs_for  # tests/gpu/ is on the path

from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm_fp8_grouped as grouped_module
from forgekernel.kernels.gemm.fp8.sm90 import launch
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED, LARGE, LARGE_MCAST_A, narrow_config

pytestmark = pytest.mark.gpu

GROUPED_SUITE = grouped_module.suite()
SHAPES = (
    (40, 1000, 21 * 128),  # M under one tile, N off every width, K / 128 odd
    (1, 4100, 5 * 128),  # one row (A's 8-row box), N off 8 (the launcher's scratch)
    (200, 576, 7 * 128),  # M off the tile: the last tile row moved back
    (128, 1536, 16384),  # a bench shape's tiles over a long K (128 k-tiles: the ring wraps)
    (64, 1024, 129 * 128),  # a long odd K
)


def _check(cfg, m, n, k, seed):
    """cfg with the scale warp against the reference, and bit for bit against cfg with one
    warp at the same lead (the 64-row-box narrow tiles have the scale warp as their standard
    since 2026-12-07: `cfg` may carry it either way)."""
    inputs = inputs_for(m, n, k, seed)
    out, cmps = verify(FP8, inputs, CUDA, run=forced(dataclasses.replace(cfg, scale_warp=True)))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    standard = forced(dataclasses.replace(cfg, scale_warp=False))(inputs, FP8.alloc_out(inputs))
    torch.cuda.synchronize()
    assert torch.equal(out, standard)


@pytest.mark.parametrize("ahead", [1, 4])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("width", [32, 48, 112, 80])
def test_narrow_scale_warp_matches_the_reference_and_the_standard(width, shape, ahead):
    m, n, k = shape
    cfg = dataclasses.replace(narrow_config(m, width), scale_ahead=ahead)
    _check(cfg, m, n, k, seed=width + k // 128)


@pytest.mark.parametrize("ahead", [2, 4])  # the tiles' standard lead; four (fp8_tiles twins)
@pytest.mark.parametrize(
    ("cfg", "shape"),
    [
        (LARGE, (300, 1000, 21 * 128)),
        (LARGE_MCAST_A, (8200, 2824, 384)),  # the banded walk's partial last band
        (LARGE_MCAST_A, (200, 520, 20 * 128)),
    ],
    ids=lambda x: x.tag() if hasattr(x, "tag") else "x".join(map(str, x)),
)
def test_scale_warp_on_the_other_mainloops(cfg, shape, ahead):
    _check(dataclasses.replace(cfg, scale_ahead=ahead), *shape, seed=7)


@pytest.mark.parametrize(
    "case",
    [
        # empty experts, partial segments, trailing padding tiles; a long K (56 k-tiles over the
        # ring: refilled); many small experts
        grouped_module._case(5, 2048, 7168, counts=(200, 0, 0, 31, 513), tail=256),
        grouped_module._case(4, 640, 256, counts=(1, 128, 0, 129), tail=128),
        grouped_module._case(8, 1024, 1024, counts=(5, 0, 250, 128, 64, 0, 400, 3)),
    ],
    ids=lambda c: c.name,
)
def test_grouped_scale_warp_matches_the_reference_and_the_standard(case):
    """The grouped layout's tile with the scale warp four ahead (GROUPED_F4_SW, the grouped
    bench's `f4_sw`) against the fp64 reference (padding rows zeroed as the suite's op does)
    and bit for bit against GROUPED (the same products, the same promotions)."""
    gen = torch.Generator(device=CUDA).manual_seed(11)
    inputs = GROUPED_SUITE.make_inputs(case, torch.bfloat16, CUDA, gen)
    out, cmps = verify(GROUPED_SUITE, inputs, CUDA, run=grouped_module.run_f4_sw)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    standard = GROUPED_SUITE.alloc_out(inputs)
    launch.gemm_fp8_grouped(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"],
                            inputs["m_indices"], standard, config=GROUPED)  # fmt: skip
    grouped_module._zero_padding(inputs, standard)
    torch.cuda.synchronize()
    assert torch.equal(out, standard)
