"""The narrow full-K FP8 tiles (64 rows, 32-112 columns, one CTA a tile over the whole K;
`config.narrow_config`, docs/gemm/NOTES.md "Narrow full-K FP8 tiles"; the chooser's pick where
M <= 512, the 128-column tiles leave SMs idle and the pick's grid is one round of at least half
the SMs since 2026-12-05, "Narrow adopted": standard builds) on an sm90 GPU, forced through
the launcher: against the fp64 reference into a NaN-poisoned out on awkward shapes (M and N
off the tile, N off 8 through the launcher's scratch, K odd multiples of 128, tiles over two
blocks of B's scales: 48 / 80 / 96 / 112 columns), with B's scales graded by powers of two per
128-column block (a column promoted with its neighbour block's scale is off by 2x), bit for bit
against the 128-column full-K tile (the same WGMMA k-steps and promotions per output element),
the bench's `narrow` / `narrow_even` / `was` variants on the cases they are timed on, and the
op's own pick (`gemm_fp8`, no config) on the rule's edges."""

from __future__ import annotations

import pytest
import torch
from fp8_forced import CUDA, FP8, forced, inputs_for  # tests/gpu/ is on the path

from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm_fp8 as fp8_suite_module
from forgekernel.kernels.gemm.fp8.sm90.config import NARROW_WIDTHS, narrow_config, tiled_config

pytestmark = pytest.mark.gpu

SHAPES = (
    (200, 1000, 21 * 128),  # M off the tile, N off every width, K / 128 odd
    (1, 300, 5 * 128),  # one row (A's 8-row box), N inside three blocks
    (64, 4100, 3 * 128),  # N off 8 (the launcher's scratch), a straddling last tile
    (130, 576, 7 * 128),  # two tile rows and 2 rows, DeepSeek's kv_a width
    (16, 7168, 2048),  # a bench case (16-row box), even K
)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("width", NARROW_WIDTHS)
def test_narrow_matches_the_reference_and_the_128_column_tile(width, shape):
    m, n, k = shape
    inputs = inputs_for(m, n, k, seed=width + k // 128)
    cfg = narrow_config(m, width)
    out, cmps = verify(FP8, inputs, CUDA, run=forced(cfg))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    standard = forced(tiled_config(m))(inputs, FP8.alloc_out(inputs))
    torch.cuda.synchronize()
    assert torch.equal(out, standard)


@pytest.mark.parametrize("width", [48, 80, 96, 112, 32])
def test_narrow_promotes_each_column_with_its_own_block(width):
    """B's scales times 2^b for its 128-column block b, A's unchanged (exact): a column
    promoted with the other block's scale (a group selected on the wrong side of the boundary,
    or the tile's first block for all) is off by 2x."""
    m, n, k = 96, 1024, 9 * 128
    inputs = inputs_for(m, n, k, seed=width)
    blocks = inputs["sb"].shape[0]
    grade = 2.0 ** torch.arange(blocks, device=CUDA, dtype=torch.float32)[:, None]
    inputs["sb"] = (inputs["sb"] * grade).contiguous()
    _, cmps = verify(FP8, inputs, CUDA, run=forced(narrow_config(m, width)))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


MOVED_CASES = ("1x7168x16384", "128x7168x16384")  # the rule moved them too (not yet measured)


@pytest.mark.parametrize("variant", ["narrow", "narrow_even", "was"])
@pytest.mark.parametrize("name", fp8_suite_module.NARROW_CASES + MOVED_CASES)
def test_the_bench_variants_match_the_reference(name, variant):
    """The `narrow`, `narrow_even` and `was` variants on each case they are timed on."""
    case = next(c for c in fp8_suite_module.BENCH_CASES if c.name == name)
    run = fp8_suite_module.variants(case).get(variant)
    if run is None:
        pytest.skip(f"{variant} is not timed on {name}")
    inputs = inputs_for(*map(int, name.split("x")), seed=1)
    _, cmps = verify(FP8, inputs, CUDA, run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]


@pytest.mark.parametrize(
    "shape",
    [(1, 2088, 1024), (1, 2056, 1024), (1, 4200, 1024), (1, 130 * 128, 1024),
     (1, 131 * 128, 1024), (128, 8192, 1024), (512, 576, 1024), (512, 32 * 128 + 8, 7 * 128),
     (513, 576, 7 * 128), (77, 1000, 3 * 128), (300, 2056, 5 * 128), (1, 576, 7168)],
    ids=lambda s: "x".join(map(str, s)),
)  # fmt: skip
def test_the_ops_pick_matches_the_reference(shape):
    """`forgekernel.gemm_fp8` with its own plan (`choose_config`) against the reference into a
    NaN-poisoned out, on the rule's edges (tests/test_gemm_fp8.py `test_narrow_rule_edges`):
    narrow where its grid is one round of 66 (1x2088) to 132 (1x4200) tiles, 512x576 and
    300x2056's 64x80 (130); the 128-column plan at 65 tiles (1x2056), past one round (1x16640:
    260 tiles of 64x64; 128x8192: MID's one round of 128), with every SM busy (1x16768,
    512x4104), at M = 513, on few tiles (77x1000: 64; 1x576x7168: stream K)."""
    from forgekernel.ops.gemm_fp8 import gemm_fp8

    m, n, k = shape
    inputs = inputs_for(m, n, k, seed=m + n)

    def run(inputs, out):
        return gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"],
                        out_dtype=inputs["out_dtype"], out=out)  # fmt: skip

    _, cmps = verify(FP8, inputs, CUDA, run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
