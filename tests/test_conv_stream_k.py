"""Stream K on the forward kernel (kernel.py `_stream_range`, `_stream_unit`, `_part_slots`;
config.stream_plan, stream_units, stream_slots, stream_cost; emulate.stream_run): the walk
covers every k-tile of every output tile once, in ranges balanced within one k-tile, its
fix-up sums each tile's parts in k order from slots no two units share, the CPU model of the
compiled function computes the convolution exactly (fp64) on small awkward shapes whatever
order the units run in, and the plan and its cost as docs/conv/NOTES.md ("Stream K for the
M = 1568 3x3s") states them. The fix-up's reduce-add form (config.STREAM1, `stream_reduce`:
every part added into its tile's one fp32 slot, the last reading that slot alone): the same
walk, its sum the convolution's up to fp32 rounding in any arrival order, its slots and flags
left zero across launches, priced as "Stream K's one-slot fix-up" states, and the ordered
form taken under torch's deterministic algorithms."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import SPEC, emulate, launch
from forgekernel.kernels.conv.sm90.config import (
    SMALL,
    SQUARE,
    STREAM,
    STREAM1,
    SplitPlan,
    params_for,
    plan_cost,
    stream_cost,
    stream_plan,
    stream_slots,
    stream_units,
)
from forgekernel.kernels.conv.sm90.geometry import Geometry

F64 = torch.float64
# (ranges, k-tiles a block, blocks): the M = 1568 3x3s on 128x128 c1x1 (52 tiles x 72) and on
# c2x1 (28 blocks over 66 clusters); one k-tile a range (stream_plan takes no more ranges than
# k-tiles); ranges longer than a block (whole blocks in the middle of a range); one block;
# ragged everything
WALKS = [
    (132, 72, 52),
    (66, 72, 28),
    (108, 18, 6),
    (7, 5, 3),
    (3, 4, 10),
    (5, 100, 1),
    (13, 9, 7),
    (1, 6, 4),
]


@pytest.mark.parametrize("ranges, k_tiles, blocks", WALKS)
def test_the_walk_covers_every_k_tile_once_in_balanced_ranges(ranges, k_tiles, blocks):
    seen = []
    lengths = []
    for z in range(ranges):
        units = stream_units(z, ranges, k_tiles, blocks)
        lengths.append(sum(u[2] for u in units))
        for block, k0, count, _ in units:
            assert 0 <= k0 and count >= 1 and k0 + count <= k_tiles  # one block a unit
            seen += [(block, kt) for kt in range(k0, k0 + count)]
        # a range's units are consecutive k-tiles of the walk
        flat = [b * k_tiles + k for b, k0, c, _ in units for k in range(k0, k0 + c)]
        assert flat == list(range(flat[0], flat[0] + len(flat)) if flat else [])
    assert sorted(seen) == [(b, kt) for b in range(blocks) for kt in range(k_tiles)]
    assert max(lengths) - min(lengths) <= 1
    assert sum(lengths) == blocks * k_tiles


@pytest.mark.parametrize("ranges, k_tiles, blocks", WALKS)
def test_the_fix_up_sums_each_block_in_k_order_from_its_own_slots(ranges, k_tiles, blocks):
    """Each block's parts are the units that cover it, in cluster (= k) order; the slot each
    parks in is the one the summing part reads for it (part 0: its first or last slot), no two
    parked units of the launch share a slot, and every slot is one of the 2 R the workspace
    holds."""
    covering = {}
    owned = {}
    for z in range(ranges):
        for block, k0, _, parts in stream_units(z, ranges, k_tiles, blocks):
            covering.setdefault(block, []).append((k0, z, parts))
            own, summed = stream_slots(z, block, ranges, k_tiles, blocks)
            assert len(summed) == parts
            if parts > 1:  # parked (a whole block's unit goes straight to the epilogue)
                assert own not in owned.values() and 0 <= own < 2 * ranges
                owned[(z, block)] = own
    for block, units in covering.items():
        assert [k0 for k0, _, _ in units] == sorted(k0 for k0, _, _ in units)
        assert units[0][0] == 0 and all(parts == len(units) for _, _, parts in units)
        clusters = [z for _, z, _ in units]
        assert clusters == list(range(clusters[0], clusters[0] + len(units)))
        if len(units) > 1:  # parked: read back in k order from the slots they parked in
            _, summed = stream_slots(clusters[0], block, ranges, k_tiles, blocks)
            assert summed == [owned[(z, block)] for z in clusters]


def test_the_plan_of_the_m1568_3x3s():
    """132 ranges of 28-29 k-tiles over 52 tiles (c1x1), 66 of 30-31 over 28 blocks (c2x1);
    two fp32 slots a CTA; the walk's arithmetic in Int32."""
    plan = stream_plan(SMALL, 1568, 512, 512, 9)
    assert plan == SplitPlan(STREAM, 29, 132, 52, 0)
    assert plan.workspace_floats == 2 * 132 * 128 * 128
    wide = stream_plan(SQUARE, 1568, 512, 512, 9)
    assert (wide.per_split, wide.parts, wide.tiles) == (31, 66, 56)
    assert wide.workspace_floats == 2 * 66 * 2 * 128 * 128
    # no more ranges than k-tiles: a short walk leaves clusters out rather than empty
    assert stream_plan(SMALL, 200, 40, 24, 9).parts == 2 * 9
    with pytest.raises(ValueError, match="overflows"):
        stream_plan(SMALL, 1 << 24, 1 << 12, 512, 9)


def test_the_cost_model_of_the_m1568_3x3s():
    """docs/conv/NOTES.md's units: stream K 47.6 at the forward's park weight 1 (today's plan
    47.4), 41.0 at 0.5 (44.2), 34.3 with free parks (41.0); c2x1 above c1x1 at every weight."""
    pixels = (32, 1, 7, 7)
    today = plan_cost(SQUARE, 0, 2, 1568, 512, 512, 9, pixels=pixels)
    assert today[1:] == (36, 2) and today[0] == pytest.approx(47.4, abs=0.05)
    got = {w: stream_cost(STREAM, 1568, 512, 512, 9, pixels=pixels, park_weight=w) for w in
           (1.0, 0.5, 0.0)}  # fmt: skip
    assert {w: round(t, 1) for w, (t, _, _) in got.items()} == {1.0: 47.6, 0.5: 41.0, 0.0: 34.3}
    assert all(r[1:] == (29, 132) for r in got.values())
    wide = replace(SQUARE, split=True, stream_k=True)
    for w, (t, _, _) in got.items():
        assert stream_cost(wide, 1568, 512, 512, 9, pixels=pixels, park_weight=w)[0] > t
    # the strided twin prices alike (the strided rows are the stride-1 im2col walk's terms)
    assert stream_cost(STREAM, 1568, 512, 512, 9, strided=True)[0] == pytest.approx(got[1.0][0])


def _conv(n, c, k, hw, f, pad, dgrad, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 1, *hw, c, generator=g, dtype=F64)
    w = torch.randn(c, 1, f, f, k, generator=g, dtype=F64) if dgrad else None
    if not dgrad:
        w = torch.randn(k, 1, f, f, c, generator=g, dtype=F64)
    geometry = Geometry((1, f, f), (0, pad, pad), (0, pad, pad))
    return x, w, geometry


def _reference(x, w, pad, dgrad):
    """conv2d of x (N, 1, H, W, C) with the forward filter: w (K, 1, R, S, C), or in the
    data-gradient mode w (C', 1, R, S, K) read N-major with its taps reversed."""
    xs = x[:, 0].permute(0, 3, 1, 2)
    if dgrad:  # W[k, c, r, s] = w[c, 0, R-1-r, S-1-s, k]
        wf = w[:, 0].flip(1, 2).permute(3, 0, 1, 2)
    else:
        wf = w[:, 0].permute(0, 3, 1, 2)
    return F.conv2d(xs, wf, padding=pad).permute(0, 2, 3, 1)


# (batch, C, K, map, filter, padding, dgrad, the clusters a wave holds, cluster_m): ragged
# channels (C 72: two channel blocks, the second 8 wide; K 136: two N tiles), several M tiles,
# ranges shorter and longer than a tile, more clusters than k-tiles (one k-tile a range), a
# 2x1 cluster (a padded M tile)
CASES = [
    (4, 72, 136, (9, 9), 3, 1, False, 7, 1),
    (4, 72, 136, (9, 9), 3, 1, True, 13, 1),
    (2, 24, 40, (13, 11), 3, 0, False, 132, 1),
    (3, 72, 136, (9, 7), 3, 1, False, 5, 2),
    (3, 16, 24, (10, 10), 3, 1, True, 4, 2),
    (1, 128, 64, (6, 6), 1, 0, False, 3, 1),
]


@pytest.mark.parametrize("n, c, k, hw, f, pad, dgrad, ranges, cm", CASES)
@pytest.mark.parametrize("seed", [None, 1, 2])
def test_the_model_computes_the_convolution(n, c, k, hw, f, pad, dgrad, ranges, cm, seed):
    """The CPU model of the compiled stream-K function (its units in launch order or a random
    one), given the launcher's workspace and flags: the convolution, fp64, every flag left
    zero."""
    x, w, geometry = _conv(n, c, k, hw, f, pad, dgrad, seed or 0)
    cfg = replace(STREAM, cluster_m=cm)
    params = params_for("bfloat16", False, cfg, dgrad=dgrad)
    p, q = hw[0] + 2 * pad - f + 1, hw[1] + 2 * pad - f + 1
    m = n * p * q
    plan = stream_plan(cfg, m, k, c, f * f, num_sms=ranges * cm)
    ranges = plan.parts
    y = torch.full((m, k), float("nan"), dtype=F64)
    work = torch.full((plan.workspace_floats,), float("nan"), dtype=torch.float32)
    flags = torch.zeros(plan.tiles, dtype=torch.int32)
    fn = emulate.compiled(params, order_seed=seed)
    fn(x, w, y, None, work, flags, *geometry.kernel_args(), plan.per_split, ranges)
    want = _reference(x, w, pad, dgrad).reshape(m, k)
    assert torch.allclose(y, want, rtol=1e-5, atol=1e-4), (y - want).abs().max()
    assert not flags.any()


@pytest.mark.parametrize("dgrad", [False, True])
def test_the_launcher_runs_a_stream_k_plan(conv_models, dgrad):
    """launch.fprop / launch.dgrad with the bench's `streamk` plan: the candidate build of the
    forward (or its data-gradient mode), the result torch's (132 ranges over a 3x3 of 72
    k-tiles on 7 x 7 maps: ranges of 2-3 k-tiles, up to 37 parts a tile)."""
    from forgekernel.bench.suites import conv_layers as L

    g = torch.Generator().manual_seed(3)
    n, c, k = 2, 512, 200
    x = torch.randn(n, 1, 7, 7, c, generator=g, dtype=F64)
    geometry = Geometry((1, 3, 3), (0, 1, 1), (0, 1, 1))
    plan = L.stream_plan(SMALL)
    if dgrad:  # dx (N, 1, 7, 7, k) at dy = x of the convolution with w (c, 1, 3, 3, k)
        w = torch.randn(c, 1, 3, 3, k, generator=g, dtype=F64)
        out = torch.empty(n, 1, 7, 7, k, dtype=F64)
        launch.dgrad(x, w, out, geometry, plan)
        dy, wt = x[:, 0].permute(0, 3, 1, 2), w[:, 0].permute(0, 3, 1, 2)
        want = F.conv_transpose2d(dy, wt, padding=1).permute(0, 2, 3, 1)
    else:
        w = torch.randn(k, 1, 3, 3, c, generator=g, dtype=F64)
        out = torch.empty(n, 1, 7, 7, k, dtype=F64)
        launch.fprop(x, w, None, out, geometry, plan)
        want = _reference(x, w, 1, False)
    assert torch.allclose(out[:, 0], want, rtol=1e-5, atol=1e-4)
    # the model runs in fp64: the key the bench's bfloat16 asks for is a candidate build
    assert [got for _, got in conv_models] == [
        dict(params_for("float64", False, STREAM, dgrad=dgrad))
    ]
    key = dict(params_for("bfloat16", False, STREAM, dgrad=dgrad))
    assert key in [dict(p) for p in SPEC.candidate_params()]


@pytest.mark.parametrize("rect, ranges, cm", [(8, 7, 1), (16, 5, 2), (8, 132, 1)])
def test_the_model_computes_the_convolution_on_rectangles(rect, ranges, cm):
    """Stream K on the stride-1 rectangles (the kernel's walk takes them; no build asks for
    them yet): the same walk over the rectangles' tiles, y (N, Z, P, Q, K)."""
    n, c, k, hw, f, pad = 3, 72, 136, (11, 9), 3, 1
    x, w, geometry = _conv(n, c, k, hw, f, pad, False, 5)
    cfg = replace(STREAM, cluster_m=cm)
    params = params_for("bfloat16", False, cfg, rect=rect)
    pixels = (n, 1, *hw)
    plan = stream_plan(cfg, n * hw[0] * hw[1], k, c, f * f, ranges * cm, pixels, rect)
    y = torch.full((*pixels, k), float("nan"), dtype=F64)
    work = torch.full((plan.workspace_floats,), float("nan"), dtype=torch.float32)
    flags = torch.zeros(plan.tiles, dtype=torch.int32)
    fn = emulate.compiled(params, order_seed=rect + ranges)
    fn(x, w, y, None, work, flags, *geometry.kernel_args(), plan.per_split, plan.parts)
    want = _reference(x, w, pad, False)
    assert torch.allclose(y[:, 0], want, rtol=1e-5, atol=1e-4), (y[:, 0] - want).abs().max()
    assert not flags.any()


def test_the_reduce_add_plan_holds_one_slot_a_tile():
    """The same walk as STREAM (132 ranges of 28-29 over 52 tiles); one fp32 slot a tile (3.4
    MB at M = 1568, against two a CTA: 17.3 MB); its compile key carries `stream_reduce`, the
    ordered form's and every standard key do not."""
    plan = stream_plan(STREAM1, 1568, 512, 512, 9)
    assert plan == SplitPlan(STREAM1, 29, 132, 52, 0)
    assert plan.workspace_floats == 52 * 128 * 128
    assert dict(params_for("bfloat16", False, STREAM1))["stream_reduce"] is True
    assert "stream_reduce" not in dict(params_for("bfloat16", False, STREAM))
    assert "stream_reduce" not in dict(params_for("bfloat16", True, SQUARE))
    assert STREAM1.tag() == "128x128_c1x1_s0_sk1" and STREAM.tag() == "128x128_c1x1_s0_sk"


def test_the_cost_model_of_the_reduce_add_fix_up():
    """docs/conv/NOTES.md ("Stream K's one-slot fix-up"): 43.2 units at park weight 1 (the
    zeroing priced as a park; 41.0 free), 38.7 at 0.5, 34.3 with free parks: below the ordered
    stream K (47.6 / 41.0 / 34.3) and today's plan (47.4 / 44.2 / 40.9) wherever parks cost;
    the strided twin alike; on c2x1 above c1x1."""
    pixels = (32, 1, 7, 7)
    got = {w: stream_cost(STREAM1, 1568, 512, 512, 9, pixels=pixels, park_weight=w)[0] for w in
           (1.0, 0.5, 0.0)}  # fmt: skip
    assert {w: round(t, 1) for w, t in got.items()} == {1.0: 43.2, 0.5: 38.7, 0.0: 34.3}
    free = stream_cost(STREAM1, 1568, 512, 512, 9, pixels=pixels, zero_weight=0.0)[0]
    assert round(free, 1) == 41.0
    for w, t in got.items():
        ordered = stream_cost(STREAM, 1568, 512, 512, 9, pixels=pixels, park_weight=w)[0]
        assert t < ordered or w == 0.0 and t == pytest.approx(ordered)
    assert stream_cost(STREAM1, 1568, 512, 512, 9, strided=True)[0] == pytest.approx(got[1.0])
    wide = replace(SQUARE, split=True, stream_k=True, stream_reduce=True)
    assert stream_cost(wide, 1568, 512, 512, 9, pixels=pixels)[0] > got[1.0]


@pytest.mark.parametrize("n, c, k, hw, f, pad, dgrad, ranges, cm", CASES)
def test_the_reduce_add_model_sums_in_any_arrival_order(n, c, k, hw, f, pad, dgrad, ranges, cm):
    """The CPU model of the reduce-add build on fp32 sum slots (zero, as the launcher's), its
    units in launch order and in random ones: the convolution (fp64) within fp32 rounding in
    every order, two orders within fp32 rounding of each other, and the slots and flags left
    zero (the next launch adds into zero), twice in a row on the same buffers."""
    x, w, geometry = _conv(n, c, k, hw, f, pad, dgrad, 0)
    cfg = replace(STREAM1, cluster_m=cm)
    params = params_for("bfloat16", False, cfg, dgrad=dgrad)
    p, q = hw[0] + 2 * pad - f + 1, hw[1] + 2 * pad - f + 1
    m = n * p * q
    plan = stream_plan(cfg, m, k, c, f * f, num_sms=ranges * cm)
    want = _reference(x, w, pad, dgrad).reshape(m, k)
    work = torch.zeros(plan.workspace_floats, dtype=torch.float32)
    flags = torch.zeros(plan.tiles, dtype=torch.int32)
    outs = []
    for seed in (None, 1, 2, 3):
        y = torch.full((m, k), float("nan"), dtype=F64)
        fn = emulate.compiled(params, order_seed=seed)
        fn(x, w, y, None, work, flags, *geometry.kernel_args(), plan.per_split, plan.parts)
        scale = want.abs().max()
        assert torch.allclose(y, want, rtol=1e-5, atol=1e-5 * scale), (y - want).abs().max()
        assert not flags.any() and not work.any()
        outs.append(y)
    for y in outs[1:]:
        assert torch.allclose(y, outs[0], rtol=1e-5, atol=1e-5 * want.abs().max())


def test_the_reduce_add_model_needs_zero_slots():
    """A sum slot left non-zero (a launch that did not finish) is caught by the model, as
    the flags are."""
    x, w, geometry = _conv(4, 72, 136, (9, 9), 3, 1, False, 0)
    plan = stream_plan(STREAM1, 4 * 81, 136, 72, 9, num_sms=7)
    work = torch.zeros(plan.workspace_floats, dtype=torch.float32)
    work[5] = 1.0
    flags = torch.zeros(plan.tiles, dtype=torch.int32)
    y = torch.empty(4 * 81, 136, dtype=F64)
    fn = emulate.compiled(params_for("bfloat16", False, STREAM1))
    with pytest.raises(AssertionError, match="must be zero"):
        fn(x, w, y, None, work, flags, *geometry.kernel_args(), plan.per_split, plan.parts)


@pytest.mark.parametrize("deterministic", [False, True])
@pytest.mark.parametrize("dgrad", [False, True])
def test_the_launcher_runs_the_reduce_add_plan(conv_models, dgrad, deterministic):
    """launch.fprop / launch.dgrad with the bench's `streamk1` plan, three launches in a row
    (the sum slots and flags reused: left zero by each): the candidate build with
    `stream_reduce`, or under torch's deterministic algorithms the ordered one (STREAM's key);
    the result torch's each time."""
    from forgekernel.bench.suites import conv_layers as L

    g = torch.Generator().manual_seed(4)
    n, c, k = 2, 512, 200
    geometry = Geometry((1, 3, 3), (0, 1, 1), (0, 1, 1))
    plan = L.stream_plan(SMALL, reduce=True)
    was = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(deterministic)
    try:
        for _ in range(3):
            x = torch.randn(n, 1, 7, 7, c, generator=g, dtype=F64)
            out = torch.empty(n, 1, 7, 7, k, dtype=F64)
            if dgrad:
                w = torch.randn(c, 1, 3, 3, k, generator=g, dtype=F64)
                launch.dgrad(x, w, out, geometry, plan)
                dy, wt = x[:, 0].permute(0, 3, 1, 2), w[:, 0].permute(0, 3, 1, 2)
                want = F.conv_transpose2d(dy, wt, padding=1).permute(0, 2, 3, 1)
            else:
                w = torch.randn(k, 1, 3, 3, c, generator=g, dtype=F64)
                launch.fprop(x, w, None, out, geometry, plan)
                want = _reference(x, w, 1, False)
            scale = want.abs().max()
            assert torch.allclose(out[:, 0], want, rtol=1e-5, atol=1e-5 * scale)
    finally:
        torch.use_deterministic_algorithms(was)
    cfg = STREAM if deterministic else STREAM1
    assert {str(sorted(got.items())) for _, got in conv_models} == {
        str(sorted(dict(params_for("float64", False, cfg, dgrad=dgrad)).items()))
    }
    key = dict(params_for("bfloat16", False, cfg, dgrad=dgrad))
    assert key in [dict(p) for p in SPEC.candidate_params()]
