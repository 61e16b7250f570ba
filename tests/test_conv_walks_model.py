"""The stride-1 forward's walk model (config.py `choose_plan`: FWD_IM2COL_ROWS_128,
TILED_ROWS_128, RECT_START) replayed on the H200 table of 2026-12-02 15:48
(benchmarks/logs/sm_90a/2026-12-02T1548-land8-device-run.log, "Call B conv_fwd_walks.txt":
scripts/conv_fwd_walks.py, each stride-1 conv_fwd bench case's plan timed on the im2col walk
and on rectangles 8 and 16 wide, L2-warm graph replays): on every case the chooser keeps the
timed tile and split and takes the fastest walk or one within 2% of it, or (a 1x1, whose
rectangles only the stem's im2col and a strided data gradient's phases ask for) the plan it
makes a user's 1x1 on the im2col walk; the data gradient's stride-1 launches share the terms."""

from __future__ import annotations

from dataclasses import replace

import pytest

from forgekernel.kernels.conv.sm90.config import (
    FWD_IM2COL_ROWS_128,
    IM2COL_ROWS_128,
    LARGE,
    NARROW,
    RECT_START,
    SMALL,
    SQUARE,
    TILED_ROWS_128,
    choose_plan,
)

SMS = 132
WITHIN = 1.02

# (case, (M, K, C, taps, pixels as the launcher sees them), the timed plan's tile, parts,
# {walk: ms}); rect 0 is the im2col walk. An unpadded 1x1's pixels are one plane 8 wide.
MEASURED_WALKS = [
    ("n4-c128-16x64x64-k128-3x3x3", (262144, 128, 128, 27, (4, 16, 64, 64)), SQUARE, 1,
     {0: 0.5692, 8: 0.5558, 16: 0.5557}),
    ("n1-c128-16x128x128-k128-3x3x3", (262144, 128, 128, 27, (1, 16, 128, 128)), SQUARE, 1,
     {0: 0.5697, 8: 0.5552, 16: 0.5555}),
    ("n2-c128-8x64x64-k256-3x3x3", (65536, 256, 128, 27, (2, 8, 64, 64)), LARGE, 1,
     {0: 0.1841, 8: 0.1759, 16: 0.1753}),
    ("n2-c256-8x64x64-k256-3x3x3", (65536, 256, 256, 27, (2, 8, 64, 64)), LARGE, 1,
     {0: 0.3748, 8: 0.3526, 16: 0.3526}),
    ("n2-c256-4x32x32-k512-3x3x3", (8192, 512, 256, 27, (2, 4, 32, 32)), LARGE, 1,
     {0: 0.0878, 8: 0.0839, 16: 0.0839}),
    ("n2-c512-4x32x32-k512-3x3x3", (8192, 512, 512, 27, (2, 4, 32, 32)), LARGE, 1,
     {0: 0.1814, 8: 0.1692, 16: 0.1685}),
    ("n1-c512-8x32x32-k512-3x3x3", (8192, 512, 512, 27, (1, 8, 32, 32)), LARGE, 1,
     {0: 0.1841, 8: 0.1736, 16: 0.1729}),
    ("n2-c512-8x64x64-k512-3x3x3", (65536, 512, 512, 27, (2, 8, 64, 64)), LARGE, 1,
     {0: 1.4601, 8: 1.3689, 16: 1.3570}),
    ("n1-c128-16x128x128-k128-1x3x3", (262144, 128, 128, 9, (1, 16, 128, 128)), SQUARE, 1,
     {0: 0.1974, 8: 0.1959, 16: 0.1959}),
    ("n2-c256-8x64x64-k256-1x3x3", (65536, 256, 256, 9, (2, 8, 64, 64)), LARGE, 1,
     {0: 0.1295, 8: 0.1239, 16: 0.1238}),
    ("n2-c512-4x32x32-k512-1x3x3", (8192, 512, 512, 9, (2, 4, 32, 32)), LARGE, 1,
     {0: 0.0633, 8: 0.0603, 16: 0.0601}),
    ("n32-c64-56x56-k64-1x1", (100352, 64, 64, 1, (1, 1, 12544, 8)), NARROW, 1,
     {0: 0.0079, 8: 0.0104, 16: 0.0180}),
    ("n32-c64-56x56-k64-3x3", (100352, 64, 64, 9, (32, 1, 56, 56)), NARROW, 1,
     {0: 0.0376, 8: 0.0442, 16: 0.0442}),
    ("n32-c64-56x56-k256-1x1", (100352, 256, 64, 1, (1, 1, 12544, 8)), NARROW, 1,
     {0: 0.0242, 8: 0.0314, 16: 0.0587}),
    ("n32-c256-56x56-k64-1x1", (100352, 64, 256, 1, (1, 1, 12544, 8)), NARROW, 1,
     {0: 0.0191, 8: 0.0206, 16: 0.0393}),
    ("n32-c256-56x56-k128-1x1", (100352, 128, 256, 1, (1, 1, 12544, 8)), SQUARE, 1,
     {0: 0.0222, 8: 0.0226, 16: 0.0414}),
    ("n32-c128-28x28-k128-3x3", (25088, 128, 128, 9, (32, 1, 28, 28)), SQUARE, 1,
     {0: 0.0272, 8: 0.0270, 16: 0.0270}),
    ("n32-c256-14x14-k1024-1x1", (6272, 1024, 256, 1, (1, 1, 784, 8)), SMALL, 1,
     {0: 0.0115, 8: 0.0124, 16: 0.0220}),
    ("n32-c1024-14x14-k256-1x1", (6272, 256, 1024, 1, (1, 1, 784, 8)), SQUARE, 1,
     {0: 0.0135, 8: 0.0135, 16: 0.0241}),
    ("n32-c256-14x14-k256-3x3", (6272, 256, 256, 9, (32, 1, 14, 14)), SQUARE, 1,
     {0: 0.0266, 8: 0.0261, 16: 0.0262}),
    ("n32-c1024-14x14-k512-1x1", (6272, 512, 1024, 1, (1, 1, 784, 8)), NARROW, 1,
     {0: 0.0331, 8: 0.0325, 16: 0.0626}),
    ("n32-c512-7x7-k512-3x3", (1568, 512, 512, 9, (32, 1, 7, 7)), LARGE, 4,
     {0: 0.0270, 8: 0.0442, 16: 0.0440}),
    ("n8-c512-64x64-k512-3x3", (32768, 512, 512, 9, (8, 1, 64, 64)), LARGE, 1,
     {0: 0.2518, 8: 0.2375, 16: 0.2376}),
    ("n8-c512-128x128-k512-3x3", (131072, 512, 512, 9, (8, 1, 128, 128)), LARGE, 1,
     {0: 1.0366, 8: 0.9707, 16: 0.9612}),
]  # fmt: skip


def _same_tile(plan, cfg) -> bool:
    return replace(plan.config, split=False) == cfg


@pytest.mark.parametrize(("name", "problem", "cfg", "parts", "ms"), MEASURED_WALKS,
                         ids=[w[0] for w in MEASURED_WALKS])  # fmt: skip
def test_the_chooser_takes_the_measured_fastest_walk(name, problem, cfg, parts, ms):
    m, k, c, taps, pixels = problem
    plan = choose_plan(m, k, c, taps, SMS, pixels)
    if taps == 1 and not (_same_tile(plan, cfg) and plan.parts == parts):
        # a user's 1x1 walks im2col rows (launch._launch); its rectangles' plan may be that one
        assert plan == choose_plan(m, k, c, taps, SMS), name
        return
    assert _same_tile(plan, cfg) and plan.parts == parts, (name, plan)
    assert ms[plan.rect] <= WITHIN * min(ms.values()), (name, plan.rect, ms)


def test_the_refit_moves_what_the_table_said():
    """128x256 c2x1: the rectangles (4-7% ahead; the tie went to im2col); 128x64 on C = 64: the
    im2col walk (15-25% ahead; the rectangles were taken); K = 128 conv3d 128x128: the
    rectangles (2% ahead); the split 7x7: the im2col walk."""
    picks = {w[0]: choose_plan(*w[1][:4], SMS, w[1][4]).rect for w in MEASURED_WALKS}
    assert all(picks[w[0]] > 0 for w in MEASURED_WALKS if w[2] == LARGE and w[3] == 1)
    assert picks["n32-c64-56x56-k64-3x3"] == 0 and picks["n32-c64-56x56-k64-1x1"] == 0
    assert picks["n4-c128-16x64x64-k128-3x3x3"] > 0 and picks["n32-c512-7x7-k512-3x3"] == 0
    # the terms: the stride-1 im2col box dearer than the multiply-adds of 128x256 c2x1, a tiled
    # box cheaper, a rectangle tile's start (docs/conv/NOTES.md, "The walks refit")
    assert FWD_IM2COL_ROWS_128 > IM2COL_ROWS_128 == 2.0 > TILED_ROWS_128 and RECT_START > 0


def test_strided_plans_keep_the_im2col_rate():
    """Without pixels (strided, a user's 1x1) the chooser is the 12-01 one: rows at 2.0 (the
    refit's stride-1 rate would split 3136 x 1024 x 1024 3x3 five ways, untimed)."""
    plan = choose_plan(3136, 1024, 1024, 9, SMS)
    assert plan.rect == 0 and plan.parts == 1 and plan.config == LARGE


def test_data_gradient_stride_one_uses_the_same_walks():
    """The stride-1 data gradient is the forward kernel's dgrad mode on the same chooser (dY's
    pixels = dX's at stride 1): conv_dgrad's C = 64 56x56 3x3 walks im2col, its C = 512 3x3
    128x256 the rectangles; a 1x1 (no pixels: launch._launch) the im2col walk."""
    assert choose_plan(32 * 56 * 56, 64, 64, 9, SMS, (32, 1, 56, 56)).rect == 0
    for hw in (64, 128, 256):
        plan = choose_plan(8 * hw * hw, 512, 512, 9, SMS, (8, 1, hw, hw))
        assert plan.config == LARGE and plan.rect > 0
    assert choose_plan(32 * 56 * 56, 64, 256, 1, SMS).rect == 0
