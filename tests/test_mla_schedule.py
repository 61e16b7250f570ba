"""A decode step's schedule (`forgekernel.mla_decode_schedule`, `mla_decode(..., schedule=)`;
MLA_NOTES.md, "A schedule made once a step"), on the CPU replay of test_mla_worklist (the
scheduling kernel and the worklist pass replaced by schedule.py and the seesaw replay, every
partial O row no item writes NaN):

- one schedule, the scheduling kernel run once, read by three layers' calls (other queries,
  other caches), the step's partial scratch poisoned with NaN before every call: each output
  the reference's; decode, MTP 2 and packed forms, 16 and 128 heads;
- a uniform batch's schedule gives the default plan's bits; calls without a schedule keep the
  default plan (no worklist compile, no scheduling kernel);
- a schedule used with a problem it was not made for raises ValueError before any launch."""

from __future__ import annotations

import importlib
import random
import sys

import pytest
import torch
from sweeps import slow_past
from test_mla_worklist import (  # noqa: F401
    SCALE,
    _assert_close,
    _problem,
    compiles,
    cpu_worklist,
)

import forgekernel
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90 import params_for, schedule
from forgekernel.kernels.attention.mla.sm90.config import (
    MIN_TOKENS_PER_SPLIT,
    RESIDENT,
    TILE,
    tile_split_plan,
)
from forgekernel.reference.mla import mla_decode_ref, mla_prefill_ref

op = importlib.import_module("forgekernel.ops.mla")
RAGGED = [1, 0, 300, 1000, 64, 65, 4096, 2]


@pytest.fixture
def stale_scratch(monkeypatch):
    """The step's partial scratch NaN at every call's entry (another op, another layer)."""
    make = mla_launch._partials

    def poisoned(*args):
        o, lp = make(*args)
        o.fill_(float("nan"))
        lp.fill_(float("nan"))
        return o, lp

    monkeypatch.setattr(mla_launch, "_partials", poisoned)


def _layers(b, hq, lens, s_q=1, layers=3):
    """Three layers' inputs over one batch's lengths and table shape."""
    return [_problem(b, hq, lens, s_q, seed=seed) for seed in range(layers)]


def test_decode_form_rows_come_with_the_schedule(cpu_worklist, stale_scratch, monkeypatch):  # noqa: F811
    """s_q 2 in the decode form: the schedule carries its rows as the packed form's (0, 2, 4,
    ..) and a layer's call launches no torch.arange of its own (one kernel launch fewer a call:
    the MTP cases' glue); the call without a schedule still makes them; both the reference's."""
    lens = [700, 3, 129, 0]
    qn, qp, ckv, kpe, table, seq = _problem(len(lens), 16, lens, 2)
    schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64, s_q=2)
    assert torch.equal(schedule.rows_cu, torch.arange(0, 10, 2, dtype=torch.int32))
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    arange, callers = torch.arange, []

    def recorded(*args, **kwargs):  # the op's own aranges (the CPU replay makes others)
        callers.append(sys._getframe(1).f_code.co_filename)
        return arange(*args, **kwargs)

    for form in (schedule, None):
        callers.clear()
        monkeypatch.setattr(torch, "arange", recorded)
        out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True, schedule=form)  # fmt: skip
        monkeypatch.setattr(torch, "arange", arange)
        made = callers.count(op.__file__)
        assert made == (0 if form is not None else 1), made
        _assert_close(out, lse, want, want_lse)
    assert forgekernel.mla_decode_schedule(seq, 16, table, page_size=64).rows_cu is None


@pytest.mark.parametrize(("hq", "lens", "s_q"), [(16, RAGGED, 1), (128, RAGGED[:5], 1),
                                                 (16, [700, 3, 129, 0], 2)])  # fmt: skip
def test_one_schedule_serves_every_layer(cpu_worklist, stale_scratch, hq, lens, s_q):  # noqa: F811
    layers = _layers(len(lens), hq, lens, s_q)
    table, seq = layers[0][4], layers[0][5]
    schedule = forgekernel.mla_decode_schedule(seq, hq, table, page_size=64, s_q=s_q)
    assert len(cpu_worklist["sched"]) == 1 and schedule.work.shape[0] > 1
    for qn, qp, ckv, kpe, table_l, seq_l in layers:
        want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table_l, seq_l, SCALE)
        out, lse = op.mla_decode(qn, qp, ckv, kpe, table_l, seq_l, softmax_scale=SCALE,
                                 return_lse=True, schedule=schedule)  # fmt: skip
        _assert_close(out, lse, want, want_lse)
    assert len(cpu_worklist["sched"]) == 1  # made once a step, never in a layer's call
    passes = [k for k in cpu_worklist["keys"] if k["kind"] == "partial"]
    assert passes and all(k.get("worklist", False) for k in passes)


def test_packed_schedule_serves_every_layer(cpu_worklist, stale_scratch):  # noqa: F811
    q_lens, k_lens = [1, 3, 0, 2, 4], [40, 3, 10, 0, 700]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    table, seq = _problem(5, 16, k_lens)[4:]
    for causal in (True, False):
        schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64, causal=causal,
                                                   cu_seqlens_q=cu, max_seqlen_q=4)  # fmt: skip
        for seed in range(3):
            _, _, ckv, kpe, table, _ = _problem(5, 16, k_lens, seed=seed)
            g = torch.Generator().manual_seed(10 + seed)
            q = torch.randn(int(cu[-1]), 16, 576, generator=g).to(torch.bfloat16)
            qn, qp = q[..., :512], q[..., 512:]
            want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
            out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                     cu_seqlens_q=cu, max_seqlen_q=4, causal=causal,
                                     return_lse=True, schedule=schedule)  # fmt: skip
            _assert_close(out, lse, want, want_lse)
    assert len(cpu_worklist["sched"]) == 2


def test_uniform_schedule_is_the_default_plan_bit_for_bit(cpu_worklist):  # noqa: F811
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, [300] * 3)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    assert not cpu_worklist["sched"]
    assert not any(k.get("worklist", False) or k["kind"] == "worklist"
                   for k in cpu_worklist["keys"])  # fmt: skip
    schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64)
    got, got_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True, schedule=schedule)  # fmt: skip
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


def test_one_split_plans_take_no_list(cpu_worklist):  # noqa: F811
    """132 sequences: a plan of one split (the direct form), an empty list, the call's plan."""
    lens = [(i * 37) % 256 for i in range(132)]
    qn, qp, ckv, kpe, table, seq = _problem(132, 16, lens, width=4)
    schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64)
    assert schedule.work.shape == (0, 2) and not cpu_worklist["sched"]
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                             return_lse=True, schedule=schedule)  # fmt: skip
    _assert_close(out, lse, want, want_lse)
    assert [k for k in cpu_worklist["keys"] if k["kind"] == "partial"][-1]["direct"]


@pytest.mark.parametrize(
    ("b", "hq", "width", "page", "s_q", "packed"),
    [(5, 16, 70, 64, 1, False), (1, 16, 1024, 64, 1, False), (132, 16, 4, 64, 1, False),
     (4, 128, 40, 64, 2, False), (5, 16, 11, 64, 4, True), (3, 16, 8, 1, 1, False),
     (16, 16, 64, 128, 1, False)],
)  # fmt: skip
def test_schedule_shape_is_the_list_made(cpu_worklist, b, hq, width, page, s_q, packed):  # noqa: F811
    """The custom op's fake (shapes alone) gives the list's shape the launcher makes."""
    seq = torch.full((b,), width * page, dtype=torch.int32)
    cu = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32) if packed or s_q > 1 else None
    work, rows = mla_launch.make_schedule(seq, hq, width, page, torch.bfloat16, cu, s_q, True)
    shapes = mla_launch.schedule_shapes(b, hq, width, page, s_q, cu is not None, None)
    assert (tuple(work.shape), tuple(rows.shape)) == shapes
    if b == 1:  # one unit (one row block): no list, the call keeps the width plan
        assert shapes == ((0, 2), (0, 3))


# ---------------------------------------------------------------- a schedule for another problem


def _bad(schedule, **change):
    """mla_decode's arguments for the problem `schedule` was made for, with `change`."""
    p = {"b": 4, "hq": 16, "width": 8, "page": 64, "s_q": 1, "dtype": torch.bfloat16} | change
    g = torch.Generator().manual_seed(0)
    pages = p["b"] * p["width"]
    qn = torch.randn(p["b"], p["s_q"], p["hq"], 512, generator=g).to(p["dtype"])
    qp = torch.randn(p["b"], p["s_q"], p["hq"], 64, generator=g).to(p["dtype"])
    ckv = torch.randn(pages, p["page"], 512, generator=g).to(p["dtype"])
    kpe = torch.randn(pages, p["page"], 64, generator=g).to(p["dtype"])
    table = torch.arange(pages, dtype=torch.int32).view(p["b"], p["width"])
    seq = torch.full((p["b"],), 100, dtype=torch.int32)
    return qn, qp, ckv, kpe, table, seq


@pytest.mark.parametrize(
    ("change", "what"),
    [({"b": 5}, "batch 5"), ({"hq": 32}, "num_heads 32"), ({"width": 9}, "max_pages 9"),
     ({"s_q": 2}, "s_q 2"), ({"dtype": torch.float16}, "dtype"), ({"page": 128}, "page_size")],
)  # fmt: skip
def test_a_schedule_for_another_problem_raises(cpu_worklist, change, what):  # noqa: F811
    args = _bad(None)
    schedule = forgekernel.mla_decode_schedule(args[5], 16, args[4], page_size=64)
    made = len(cpu_worklist["keys"])
    with pytest.raises(ValueError, match=what):
        op.mla_decode(*_bad(None, **change), softmax_scale=SCALE, schedule=schedule)
    assert len(cpu_worklist["keys"]) == made  # raised before any plan or launch


def test_schedule_form_and_causal_must_match(cpu_worklist):  # noqa: F811
    qn, qp, ckv, kpe, table, seq = _bad(None, s_q=2)
    schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64, s_q=2)
    with pytest.raises(ValueError, match="causal"):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, SCALE, causal=False, schedule=schedule)
    cu = torch.arange(0, 10, 2, dtype=torch.int32)
    with pytest.raises(ValueError, match="packed"):
        op.mla_decode(qn.flatten(0, 1), qp.flatten(0, 1), ckv, kpe, table, seq, SCALE,
                      cu_seqlens_q=cu, max_seqlen_q=2, schedule=schedule)  # fmt: skip
    with pytest.raises(TypeError, match="MlaDecodeSchedule"):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, SCALE, schedule=schedule.work)


def test_schedule_arguments_are_checked():
    seq, table = torch.zeros(4, dtype=torch.int32), torch.zeros(4, 8, dtype=torch.int32)
    make = op.mla_decode_schedule
    with pytest.raises(ValueError, match="CUDA"):
        make(seq, 16, table, page_size=64)
    op_check = op.check_cuda
    try:
        op.check_cuda = lambda name, t: None
        with pytest.raises(ValueError, match="page_table"):
            make(seq, 16, table[:3], page_size=64)
        with pytest.raises(ValueError, match="num_heads"):
            make(seq, 0, table, page_size=64)
        with pytest.raises(ValueError, match="s_q"):
            make(seq, 16, table, page_size=64, s_q=5)
        with pytest.raises(ValueError, match="together"):
            make(seq, 16, table, page_size=64, max_seqlen_q=2)
        with pytest.raises(ValueError, match="dtype"):
            make(seq, 16, table, page_size=64, dtype=torch.float32)
    finally:
        op.check_cuda = op_check


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_schedule_traces_as_a_custom_op(cpu_worklist, mode):  # noqa: F811
    """Traced (make_fx: torch.compile's path), the schedule is the custom op
    forgekernel::mla_decode_schedule, its fake the list's shape; the layers' calls take it."""
    from torch.fx.experimental.proxy_tensor import make_fx

    qn, qp, ckv, kpe, table, seq = _problem(8, 16, RAGGED)

    def step(qn, qp, ckv, kpe, table, seq):
        schedule = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64)
        return op.mla_decode(qn, qp, ckv, kpe, table, seq, SCALE, schedule=schedule)

    graph = make_fx(step, tracing_mode=mode)(qn, qp, ckv, kpe, table, seq)
    code = graph.code
    assert "forgekernel.mla_decode_schedule" in code and "forgekernel.mla_decode" in code
    if mode == "real":
        want, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
        out = graph(qn, qp, ckv, kpe, table, seq)
        assert float((out.float() - want).abs().max()) < 2e-2


# ---------------------------------------------------------------- the ranges form (no S bound)

SMS, SLOTS = 132, 132
RAGGED_BENCH = tuple(round(512 * 2 ** (i / 5)) for i in range(32))  # the suite's b32 ragged
MIXED = tuple(range(100, 48 * 170, 170))  # the suite's b48 mixed


def _ranged(lens, blocks=1, width=None, cu=None, causal=True, q_blocks=1, qtokens=1):
    """(keys per split, items, ranges, kv_ends) of a batch's schedule."""
    width = width or max(1, max(-(-n // TILE) for n in lens))
    tiles = schedule.unit_tiles(lens, width, cu, causal, q_blocks, qtokens)
    cap = schedule.ranged_capacity(len(tiles), SLOTS)
    fewest = min(width, max(1, MIN_TOKENS_PER_SPLIT // TILE))
    per_keys, items, ranges = schedule.ranged_plan(tiles, blocks, fewest, SLOTS, cap)
    assert len(items) <= cap
    return per_keys, items, ranges, schedule.kv_ends(lens, cu, causal, q_blocks, qtokens)


def _assert_ranged_covers(per_keys, items, ranges, ends, width):
    """Each unit's items are its splits 0 .. n - 1 in order at [first, first + n), units in
    order; together they cover its keys (up to the table's width) exactly once."""
    at = 0
    for u, ((first, n), end) in enumerate(zip(ranges, ends)):
        assert first == at and items[first : first + n] == [(u, s) for s in range(n)]
        at += n
        reach = min(max(end, 0), width * TILE)
        assert n == -(-reach // per_keys)  # every split has keys, none past the reach
    assert at == len(items)


def test_ragged_bench_batch_spreads_the_long_sequence():
    """b32 ragged (512 .. 37641 keys, 589 tiles wide): the width plan gives every sequence 4
    splits (128 CTAs), the long one 148 tiles a split (makespan 150 tiles); the schedule's per
    over the whole batch's 4503 tiles is 39 (one wave of 131 items within 164: the long
    sequence in 16 splits, makespan 41 tiles by the wave cost). Per 17 (~35 splits) would be
    281 items, 3 waves: 57."""
    assert _width(32, 589) == (4, 148)
    per_keys, items, ranges, ends = _ranged(list(RAGGED_BENCH))
    assert per_keys == 39 * TILE and len(items) == 131 and ranges[-1][1] == 16
    assert -(-len(items) // SLOTS) == 1
    _assert_ranged_covers(per_keys, items, ranges, ends, 589)


def _width(units, width, blocks=1):
    splits, per = tile_split_plan(units, blocks, width * TILE, SMS, RESIDENT)
    return splits, per // TILE


@pytest.mark.parametrize(
    ("units", "blocks", "width"), [(16, 1, 64), (16, 2, 64), (64, 1, 64), (1, 1, 1024), (3, 1, 5)]
)
def test_uniform_batches_keep_the_width_plan(units, blocks, width):  # fmt: skip
    """b16 x 4096 (and others): the width plan's per and splits, every unit the same."""
    splits, per = _width(units, width, blocks)
    per_keys, items, ranges, _ = _ranged([width * TILE] * units, blocks)
    assert per_keys == per * TILE and all(n == splits for _, n in ranges)
    assert len(items) == units * splits


def test_mixed_batch_schedule():
    per_keys, items, ranges, ends = _ranged(list(MIXED), width=127)
    assert per_keys == 29 * TILE and len(items) == 130
    _assert_ranged_covers(per_keys, items, ranges, ends, 127)


def test_ranged_plans_cover_every_key_once():
    rng = random.Random(3)
    for _ in range(200):
        b = rng.randint(1, 80)
        lens = [rng.choice((0, 1, 64, 65, rng.randint(0, 40000))) for _ in range(b)]
        width = max(1, max(-(-n // TILE) for n in lens))
        blocks = rng.choice((1, 2))
        per_keys, items, ranges, ends = _ranged(lens, blocks, width)
        _assert_ranged_covers(per_keys, items, ranges, ends, width)


def test_packed_row_ranges():
    q_lens, k_lens, qt = [1, 3, 0, 2, 4], [40, 3, 10, 0, 700], 2
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q_blocks = 2
    per_keys, items, ranges, ends = _ranged(k_lens, 1, 11, cu, True, q_blocks, qt)
    rows = schedule.row_ranges(ranges, len(k_lens) * 4, cu, q_blocks, qt)
    for b, sq in enumerate(q_lens):
        for t in range(sq):
            first, n = ranges[b * q_blocks + t // qt]
            assert rows[cu[b] + t] == (first, n, t % qt)
    assert rows[cu[-1] :] == [None] * (len(rows) - cu[-1])


# slow: the b32 ragged batch's replay (~20 s of CI's CPU, 2026-12-06); its schedule is
# test_ragged_bench_batch_spreads_the_long_sequence's, replays against the reference the tests above
@pytest.mark.slow
def test_ragged_bench_batch_matches_the_reference(cpu_worklist, stale_scratch):  # noqa: F811
    """The suite's b32 ragged batch at 16 heads through the launcher on the replay: the
    schedule's items (the long sequence in 16 splits) and the reference's output."""
    lens = list(RAGGED_BENCH)
    qn, qp, ckv, kpe, table, seq = _problem(32, 16, lens)
    schedule_ = forgekernel.mla_decode_schedule(seq, 16, table, page_size=64)
    ((per_keys, items, _),) = cpu_worklist["sched"]
    assert per_keys == 39 * TILE and sum(u == 31 for u, _ in items) == 16
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                             return_lse=True, schedule=schedule_)  # fmt: skip
    _assert_close(out, lse, want, want_lse)


def test_uniform_b16_schedule_keeps_the_width_plan(cpu_worklist):  # noqa: F811
    qn, qp, ckv, kpe, table, seq = _problem(16, 16, [4096] * 16)
    forgekernel.mla_decode_schedule(seq, 16, table, page_size=64)
    ((per_keys, items, splits),) = cpu_worklist["sched"]
    assert (splits, per_keys) == (8, 8 * TILE) and len(items) == 128


def test_bench_ours_makes_the_schedule_once(cpu_worklist):  # noqa: F811
    """The suite's `ours` on a 16-bit page-64 decode case: the schedule made on the input set's
    first call, the later (timed) calls mla_decode's alone; its output the `plain` variant's
    (the call without a schedule) within the bound."""
    from forgekernel.bench.suites import mla_decode as suite

    case = suite._case(6, 16, 64, (100, 3000, 64, 0, 1500, 700), tag="tiny")
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    want = suite.run_plain(inputs, None)
    assert not cpu_worklist["sched"]
    for _ in range(3):
        got = suite.run_ours(inputs, None)
        assert float((got[0].float() - want[0].float()).abs().max()) < 2e-2
    assert len(cpu_worklist["sched"]) == 1
    assert "schedule" in inputs["ours"][2] and "schedule" not in inputs["ours_plain"][2]


# ---------------------------------------------------------------- the compiles (CPU, sm_90a)


# CI: one query token (the builds test_pdl reads, one scope: SHARED_COMPILES); two are slow
@pytest.mark.parametrize("qtokens", slow_past([1, 2]))
def test_ranged_scheduling_kernel_compiles(compiles, qtokens):  # noqa: F811
    res = compiles(params_for("worklist", "bfloat16", qtokens=qtokens, ranges=True))
    assert res["spill_bytes"] == 0 and res["registers"] <= 64


@pytest.mark.parametrize("qtokens", slow_past([1, 2]))
def test_ranged_pass_is_the_standard_pass_but_its_prologue_and_write(compiles, qtokens):  # noqa: F811
    """The pass's ranges form: no spills; the standard pass's main loop, its item from the list
    (the work-list prologue: one MUFU.RCP fewer, the standard's split share of the unit's keys)
    and its partial rows at (item, token) instead of (split, query row). Its main-loop counts
    are compared at one query token with the standard pass's (that build is the seesaw and PDL
    tests', the ranges one test_pdl's: one scope, SHARED_COMPILES; the work-list pass, a
    candidate, is no longer compiled in CI: test_mla_worklist's compare of it with the standard
    pass is slow); at two tokens the ranges build is checked on its own (slow, ~9 s)."""
    res = compiles(params_for("partial", "bfloat16", 16, qtokens, tma=True, worklist=True,
                              ranges=True))  # fmt: skip
    assert res["spill_bytes"] == 0 and res["registers"] <= 255
    if qtokens != 1:
        return
    std = compiles(params_for("partial", "bfloat16", 16, qtokens, tma=True))
    for kind in ("HGMMA", "UTMALDG", "STSM", "MUFU", "BAR", "SYNCS"):
        extra = 1 if kind == "MUFU" else 0  # the work list's prologue (test_mla_worklist)
        assert res["sass"].get(kind) == std["sass"].get(kind) - extra, kind


def test_ranged_combine_compiles(compiles):  # noqa: F811
    """The combine's ranges form: at most 64 registers (8 CTAs of 128 threads an SM, as the
    split form's WAVE_CTAS assumes), no spills."""
    res = compiles(params_for("combine", "bfloat16", ranges=True))
    assert res["spill_bytes"] == 0 and res["registers"] <= 64
