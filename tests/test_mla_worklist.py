"""The seesaw pass's device-side work list (candidate, FORGEKERNEL_MLA_WORKLIST=1 or
`launch.plan_form(worklist=True)`; MLA_NOTES.md, "A device-side work list for ragged batches"),
on the CPU:

- schedule.py, the scheduling kernel's reference: uniform batches (every unit the table's
  width of keys) get the width plan's tiles per split and its grid, CTA for CTA; ragged ones
  cover every key of every unit exactly once, in at most the plan's splits a unit and the
  list's capacity; empty sequences, length 1, lengths past the table; the bench's mixed batch;
- the launcher on the replay (the scheduling kernel and the worklist pass replaced by their
  Python forms: schedule.py, and test_mla_decode's seesaw replay restricted to the list's
  items, every other partial O row NaN): decode, MTP / packed, 16 and 128 heads against the
  reference, a uniform batch bit for bit the standard plan's, the plan and its keys;
- the compiles (sm_90a, CPU): the scheduling kernel and the worklist pass, registers, spills,
  the pass's main loop the standard's (its SASS opcode counts but the prologue's)."""

from __future__ import annotations

import functools
import importlib
import math
import random

import pytest
import torch
from cubins import build
from mla_seesaw import seesaw_partial
from split_combine import combine_splits

from forgekernel.kernels.attention.mla.sm90 import SPEC, params_for, schedule
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import (
    MIN_TOKENS_PER_SPLIT,
    RESIDENT,
    TILE,
    heads_per_cta,
    tile_split_plan,
)
from forgekernel.reference.mla import mla_decode_ref, mla_prefill_ref

op = importlib.import_module("forgekernel.ops.mla")
SMS = 132
SLOTS = SMS * RESIDENT
SCALE = 0.1
MIXED = tuple(range(100, 48 * 170, 170))  # the bench's b48-h16-p64-mixed


def _width_plan(units: int, blocks: int, width: int) -> tuple[int, int]:
    """The host's plan (splits, tiles per split) for a table `width` tiles wide."""
    splits, per = tile_split_plan(units, blocks, width * TILE, SMS, RESIDENT)
    return splits, per // TILE


def _fewest(width: int) -> int:
    return min(width, max(1, MIN_TOKENS_PER_SPLIT // TILE))


def _list(lens, blocks, width=None, cu=None, causal=True, q_blocks=1, qtokens=1):
    """(width plan's splits, keys per split, items, each unit's kv_end) of a batch."""
    width = width or max(1, max(-(-n // TILE) for n in lens))
    ends = schedule.kv_ends(lens, cu, causal, q_blocks, qtokens)
    splits, _ = _width_plan(len(ends), blocks, width)
    tiles = schedule.unit_tiles(lens, width, cu, causal, q_blocks, qtokens)
    per_keys, items = schedule.plan(tiles, blocks, splits, _fewest(width), SLOTS)
    return splits, per_keys, items, ends


UNIFORM = [  # (units, head blocks, width in tiles)
    (1, 1, 64), (1, 1, 256), (1, 1, 1024), (1, 2, 1024), (1, 2, 64), (16, 1, 64), (16, 2, 64),
    (16, 1, 128), (64, 1, 64), (64, 2, 128), (128, 1, 128), (128, 2, 128), (48, 1, 127),
    (3, 1, 5), (7, 4, 300), (2, 1, 1), (200, 1, 3), (33, 8, 17),
]  # fmt: skip


@pytest.mark.parametrize(("units", "blocks", "width"), UNIFORM)
def test_uniform_batches_take_the_width_plan(units, blocks, width):
    splits, per = _width_plan(units, blocks, width)
    splits_l, per_keys, items, _ = _list([width * TILE] * units, blocks)
    assert splits_l == splits and per_keys == per * TILE
    # the width plan's grid (split major, every CTA with keys), CTA for CTA
    assert items == [(u, s) for s in range(splits) for u in range(units)]
    assert len(items) == schedule.capacity(units, splits)


def test_uniform_batches_take_the_width_plan_swept():
    """Every uniform batch of a random sweep, and lengths off the tiles (same tile counts)."""
    rng = random.Random(7)
    for _ in range(150):
        units, blocks, width = rng.randint(1, 160), rng.choice((1, 2, 4, 8)), rng.randint(1, 400)
        splits, per = _width_plan(units, blocks, width)
        lens = [width * TILE - rng.randint(0, TILE - 1)] * units
        _, per_keys, items, _ = _list(lens, blocks, width)
        assert per_keys == per * TILE, (units, blocks, width)
        assert items == [(u, s) for s in range(splits) for u in range(units)]


def _assert_covers(splits, per_keys, items, ends, width):
    """Every key [0, min(kv_end, the items' reach)) of every unit in exactly one item; items
    with keys only, at most `splits` a unit, none past the table's width."""
    assert len(items) <= schedule.capacity(len(ends), splits)
    assert len(set(items)) == len(items)
    ranges = schedule.key_ranges(ends, per_keys, items)
    for u, end in enumerate(ends):
        mine = sorted((t0, t1) for v, t0, t1 in ranges if v == u)
        assert all(t0 < t1 for t0, t1 in mine)  # no item without keys
        assert all(s < splits for v, s in items if v == u)
        assert all(t0 < width * TILE for t0, _ in mine)
        reach = min(max(end, 0), width * TILE)
        if reach == 0:
            assert not mine
            continue
        assert mine[0][0] == 0 and all(a[1] == b[0] for a, b in zip(mine, mine[1:]))
        assert mine[-1][1] >= reach  # (== end inside the table)
        if end <= width * TILE:
            assert mine[-1][1] == end


RAGGED = [
    MIXED,
    (0, 1, 64, 65, 4096),
    (0, 0, 0),
    (1,) * 7,
    (1, 0, 8190, 1, 1, 64),
    (4096,) * 15 + (100,),
    tuple((i * 7919) % 9000 for i in range(200)),
    (65536, 100, 0, 3000),
]


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("lens", RAGGED, ids=lambda x: f"b{len(x)}_max{max(x)}")
def test_ragged_batches_cover_every_key_once(lens, blocks):
    width = max(1, max(-(-n // TILE) for n in lens))
    splits, per_keys, items, ends = _list(list(lens), blocks, width)
    _assert_covers(splits, per_keys, items, ends, width)
    order = [(s, u) for u, s in items]
    assert order == sorted(order)  # split major, units in order (the width plan's order)


def test_empty_and_length_one():
    splits, per_keys, items, _ = _list([0, 0, 0, 0], 1, width=8)
    assert items == [] and per_keys >= TILE and splits >= 1
    _, _, items, _ = _list([1, 0, 1], 1, width=8)
    assert items == [(0, 0), (2, 0)]


def test_lengths_past_the_table_reach_no_further_than_the_width():
    """A length past the table (outside the op's contract) counts the table's width: no item
    starts past it, and per stays within the width."""
    width = 16
    lens = [width * TILE * 4, 100, 3000]
    splits, per_keys, items, ends = _list(lens, 1, width)
    assert per_keys <= width * TILE
    _assert_covers(splits, per_keys, items, ends, width)


def test_packed_units_are_the_pass_units():
    """Blocks of query tokens (MTP / packed): each unit's kv_end as the pass's `_unit`."""
    q_lens, k_lens, qt = [1, 3, 0, 2, 4], [40, 3, 10, 0, 700], 2
    cu = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    q_blocks = -(-max(q_lens) // qt)
    for causal in (True, False):
        ends = schedule.kv_ends(k_lens, cu, causal, q_blocks, qt)
        assert len(ends) == len(k_lens) * q_blocks
        for b, (sq_all, sk) in enumerate(zip(q_lens, k_lens)):
            for k in range(q_blocks):
                sq = max(min(sq_all - k * qt, qt), 0)
                want = (sk - sq_all + k * qt + sq if causal else sk) if sq > 0 else 0
                assert ends[b * q_blocks + k] == want
        splits, per_keys, items, _ = _list(k_lens, 1, 11, cu, causal, q_blocks, qt)
        _assert_covers(splits, per_keys, items, ends, 11)


def test_the_mixed_batch_plan():
    """b48-h16-p64-mixed (100 .. 8090 keys, table 127 tiles wide): the width plan runs 8 x 16
    tiles, 384 CTAs (216 with keys); the list 127 items of 30 tiles, one wave (makespan 32
    tiles + overhead against the width plan's 36.5 in the 16:40 model)."""
    assert _width_plan(48, 1, 127) == (8, 16)
    splits, per_keys, items, ends = _list(list(MIXED), 1, 127)
    assert per_keys == 29 * TILE and len(items) == 130 and splits == 8
    assert max(s for _, s in items) == 4  # the longest sequence: 5 splits of the 8
    _assert_covers(splits, per_keys, items, ends, 127)


# ---------------------------------------------------------------- the launcher on the replay


def ranged_schedule(calls, qtokens, seq, cu, causal, q_blocks, blocks, splits, fewest, slots,
                    width, work, rows):  # fmt: skip
    """The scheduling kernel's `ranges` form (a decode step's schedule): schedule.py's
    `ranged_plan` into the list, each query row's item range into `rows`; list rows past the
    items and table rows no unit has: -7 (never read)."""
    cu_l = None if cu is None else cu.tolist()
    tiles = schedule.unit_tiles(seq.tolist(), width, cu_l, bool(causal), q_blocks, qtokens)
    cap = work.shape[0] - schedule.HEADER
    assert cap == schedule.ranged_capacity(len(tiles), slots)
    per_keys, items, ranges = schedule.ranged_plan(tiles, blocks, fewest, slots, cap)
    assert len(items) <= cap
    work.fill_(-7)
    rows.fill_(-7)
    work[0] = torch.tensor([per_keys, len(items)])
    for i, item in enumerate(items):
        work[schedule.HEADER + i] = torch.tensor(item)
    for r, row in enumerate(schedule.row_ranges(ranges, rows.shape[0], cu_l, q_blocks, qtokens)):
        if row is not None:
            rows[r] = torch.tensor(row)
    calls["sched"].append((per_keys, items, splits))


def ranged_partial(args, kw):
    """The pass's `ranges` form: item i = (unit, split) writes its unit's rows' partials at
    (i, query token); every other partial row NaN (no fill: the combine reads only items)."""
    work, op_, lp = args[4], args[7], args[8]
    per_keys, count = int(work[0, 0]), int(work[0, 1])
    listed = work[schedule.HEADER : schedule.HEADER + count].tolist()
    rows_q, hq = args[0].shape[0], args[0].shape[1]
    splits = max((s for _, s in listed), default=0) + 1
    full_o = torch.empty(splits, rows_q, hq, op_.shape[-1])
    full_l = torch.empty(splits, rows_q, hq)
    cu, q_blocks = args[12], args[14]
    seesaw_partial(*args[:4], None, *args[5:7], full_o, full_l, args[9], per_keys, *args[11:],
                   **kw, listed=True)  # fmt: skip
    op_.fill_(float("nan"))
    lp.fill_(float("nan"))
    for i, (u, s) in enumerate(listed):
        rows = _pass_rows(u // q_blocks, u % q_blocks, cu, kw["qtokens"], q_blocks)
        op_[i, : len(rows)] = full_o[s, rows]
        lp[i, : len(rows)] = full_l[s, rows]


def combine_ranges(op_, lp, out, lse, rows):
    """The combine's `ranges` form: row r reduces items [first, first + items) of its token."""
    for r in range(out.shape[0]):
        first, n, token = rows[r].tolist()
        assert n >= 0 and 0 <= first and first + n <= op_.shape[0]
        o, lo = op_[first : first + n, token][:, None], lp[first : first + n, token][:, None]
        if n == 0:
            o, lo = op_[:1, 0][:, None] * 0, torch.full_like(lp[:1, 0][:, None], -math.inf)
        combine_splits(o, lo, out[r : r + 1], lse[r : r + 1])


def _pass_rows(b, blk, cu, qtokens, q_blocks):
    """Query rows of unit (b, blk)."""
    if cu is None:
        return [b]
    q_all, token0 = int(cu[b + 1] - cu[b]), blk * qtokens
    sq = max(min(q_all - token0, qtokens), 0)
    return list(range(int(cu[b]) + token0, int(cu[b]) + token0 + sq))


@pytest.fixture
def cpu_worklist(monkeypatch):
    """The launcher's kernels replaced by their Python forms; the scheduling calls' (keys per
    split, items, splits) and the pass's compile keys."""
    calls = {"sched": [], "keys": []}

    def get_kernel(spec, params):
        assert spec is SPEC
        p = dict(params)
        calls["keys"].append(p)
        if p["kind"] == "combine":  # the CTA or the warp form (called alike)
            if p.get("ranges", False):
                return combine_ranges
            return combine_splits
        if p["kind"] == "worklist" and p.get("ranges", False):
            return functools.partial(ranged_schedule, calls, p["qtokens"])
        if p["kind"] == "worklist":

            def sched(seq, cu, causal, q_blocks, blocks, splits, fewest, slots, width, work, lp):
                assert (cu is None) == (p["qtokens"] == 1) and lp.dim() == 1
                cu_l = None if cu is None else cu.tolist()
                tiles = schedule.unit_tiles(
                    seq.tolist(), width, cu_l, bool(causal), q_blocks, p["qtokens"]
                )
                per_keys, items = schedule.plan(tiles, blocks, splits, fewest, slots)
                assert work.shape == (schedule.capacity(len(tiles), splits) + schedule.HEADER, 2)
                work.fill_(-7)  # rows past the items: never read
                work[0] = torch.tensor([per_keys, len(items)])
                for i, item in enumerate(items):
                    work[schedule.HEADER + i] = torch.tensor(item)
                lp.fill_(-math.inf)
                calls["sched"].append((per_keys, items, splits))

            return sched

        def partial(*args):
            assert p.get("tma", False)
            kw = {"heads": p["heads"], "qtokens": p.get("qtokens", 1)}
            if p.get("direct", False):
                return seesaw_partial(*args, **kw, direct=True)
            if not p.get("worklist", False):
                return seesaw_partial(*args, **kw)
            if p.get("ranges", False):
                return ranged_partial(args, kw)
            work, op_, lp = args[4], args[7], args[8]
            assert torch.isneginf(lp).all()  # the scheduling kernel ran first
            per_keys, count = int(work[0, 0]), int(work[0, 1])
            full_o, full_l = torch.empty_like(op_), torch.empty_like(lp)
            cu, q_blocks = args[12], args[14]
            seesaw_partial(*args[:4], None, *args[5:7], full_o, full_l, args[9], per_keys,
                           *args[11:], **kw, listed=True)  # fmt: skip
            op_.fill_(float("nan"))  # stale rows: only the items' are written
            for u, s in work[schedule.HEADER : schedule.HEADER + count].tolist():
                rows = _pass_rows(u // q_blocks, u % q_blocks, cu, kw["qtokens"], q_blocks)
                op_[s, rows] = full_o[s, rows]
                lp[s, rows] = full_l[s, rows]

        return partial

    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: SMS)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    yield calls
    mla_launch._plans.clear()


def _problem(b, hq, lens, s_q=1, dtype=torch.bfloat16, seed=0, width=None):
    g = torch.Generator().manual_seed(seed)
    max_pages = width or max(1, max(-(-n // TILE) for n in lens))
    pages = b * max_pages + 3
    ckv = torch.randn(pages, TILE, 512, generator=g).to(dtype)
    kpe = torch.randn(pages, TILE, 64, generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: b * max_pages].view(b, max_pages).int()
    for i, n in enumerate(lens):  # stale slots: NaN, never read as keys
        for j in range(max_pages):
            ckv[table[i, j], max(n - j * TILE, 0) :] = float("nan")
            kpe[table[i, j], max(n - j * TILE, 0) :] = float("nan")
    qn = torch.randn(b, s_q, hq, 512, generator=g).to(dtype)
    qp = torch.randn(b, s_q, hq, 64, generator=g).to(dtype)
    return qn, qp, ckv, kpe, table, torch.tensor(lens, dtype=torch.int32)


def _assert_close(out, lse, want, want_lse, atol=2e-2):
    assert float((out.float() - want).abs().max()) < atol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    if finite.any():
        assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


@pytest.mark.parametrize(
    ("hq", "lens", "s_q", "width"),
    [
        (16, [1, 0, 300, 1000, 64, 65], 1, None),
        (16, [0, 0, 0], 1, 8),  # no keys anywhere: every row 0 / -inf from the -inf fill
        (16, [1, 1], 1, 8),
        (128, [5, 0, 513, 2000], 1, None),
        (16, [700, 3, 129, 0], 2, None),
        (16, [4096, 100, 64, 1], 1, None),
    ],
)
def test_worklist_decode_matches_the_reference(cpu_worklist, hq, lens, s_q, width):
    qn, qp, ckv, kpe, table, seq = _problem(len(lens), hq, lens, s_q, width=width)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    with mla_launch.plan_form(worklist=True):
        out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    _assert_close(out, lse, want, want_lse)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    assert cpu_worklist["sched"], "the work list took this plan (more than one split)"
    passes = [k for k in cpu_worklist["keys"] if k["kind"] == "partial"]
    assert passes[-1].get("worklist", False)
    assert passes[-1]["heads"] == heads_per_cta(hq, passes[-1].get("qtokens", 1))


def test_worklist_packed_matches_the_reference(cpu_worklist):
    q_lens, k_lens = [1, 3, 0, 2, 4], [40, 3, 10, 0, 700]
    _, _, ckv, kpe, table, seq = _problem(5, 16, k_lens)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(int(cu[-1]), 16, 576, generator=g).to(torch.bfloat16)
    qn, qp = q[..., :512], q[..., 512:]
    for causal in (True, False):
        want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
        with mla_launch.plan_form(worklist=True):
            out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                     cu_seqlens_q=cu, max_seqlen_q=4, causal=causal,
                                     return_lse=True)  # fmt: skip
        _assert_close(out, lse, want, want_lse)
    assert {k["qtokens"] for k in cpu_worklist["keys"] if k["kind"] == "worklist"} == {4}


def test_uniform_batch_is_the_standard_plan_bit_for_bit(cpu_worklist, monkeypatch):
    """Same splits, same partials, same combine: the same bits (FORGEKERNEL_MLA_WORKLIST=1)."""
    lens = [300] * 3  # 5 tiles: 2 splits of 4 tiles
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, lens)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    assert not cpu_worklist["sched"]  # off by default
    mla_launch._plans.clear()
    monkeypatch.setenv("FORGEKERNEL_MLA_WORKLIST", "1")
    got, got_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    (per_keys, items, splits), *_ = cpu_worklist["sched"]
    assert (per_keys, splits) == (4 * TILE, 2) and len(items) == 6
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


def test_one_split_plans_keep_the_direct_form(cpu_worklist):
    """A plan of one split (132 sequences) stays direct: no list, no combine."""
    lens = [(i * 37) % 256 for i in range(132)]
    qn, qp, ckv, kpe, table, seq = _problem(132, 16, lens, width=4)
    with mla_launch.plan_form(worklist=True):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE)
    assert not cpu_worklist["sched"]
    assert [k for k in cpu_worklist["keys"] if k["kind"] == "partial"][-1]["direct"]


def test_plan_form_worklist_rejects_per_tiles():
    with pytest.raises(ValueError, match="per_tiles"):
        with mla_launch.plan_form(per_tiles=4, worklist=True):
            pass
    with pytest.raises(ValueError, match="work list"):
        params_for("partial", "bfloat16", 16, tma=True, direct=True, worklist=True)


# ---------------------------------------------------------------- the compiles (CPU, sm_90a)


@pytest.fixture(scope="module")
def compiles(tmp_path_factory):
    pytest.importorskip("cutlass")
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")

    def resources(params):
        return build(SPEC, params).resources  # cubins.build: one compile a process

    return resources


# slow: the per-call work list's scheduling kernel (kind "worklist" without `ranges`) is a
# candidate (`build --candidates`), as its pass below; the standard ranges form's compiles stay
# CI's (test_mla_schedule test_ranged_scheduling_kernel_compiles, test_pdl's ranges case)
@pytest.mark.slow
@pytest.mark.parametrize("qtokens", [1, 2])
def test_scheduling_kernel_compiles(compiles, qtokens):
    res = compiles(params_for("worklist", "bfloat16", qtokens=qtokens))
    assert res["spill_bytes"] == 0 and res["registers"] <= 64


# slow: the per-call work list's pass is a candidate (plan_form(worklist=True); `build
# --candidates`), compiled for this check alone (an MLA compile, ~8 s of an idle CPU,
# 2026-12-07); CI keeps the standard ranges pass's compare with the standard pass
# (test_mla_schedule, test_ranged_pass_is_the_standard_pass_but_its_prologue_and_write)
@pytest.mark.slow
def test_worklist_pass_is_the_standard_pass_but_its_prologue(compiles):
    res = compiles(params_for("partial", "bfloat16", 16, tma=True, worklist=True))
    std = compiles(params_for("partial", "bfloat16", 16, tma=True))
    assert res["spill_bytes"] == 0 and res["registers"] <= 255
    for kind in ("HGMMA", "UTMALDG", "STSM", "MUFU", "BAR", "SYNCS"):
        # the standard's split share divides the unit's keys by the grid's splits (one
        # MUFU.RCP); the list brings its keys per split
        extra = 1 if kind == "MUFU" else 0
        assert res["sass"].get(kind) == std["sass"].get(kind) - extra, kind


def test_worklist_grid_is_the_capacity_times_the_head_blocks():
    """The pass's grid in the worklist form: capacity x head blocks CTAs (the list's rows less
    its header), one z; head blocks fastest, as `_block`'s."""
    pytest.importorskip("cutlass")
    from types import SimpleNamespace as ns

    from forgekernel.kernels.attention.mla.sm90.seesaw import MlaSeesawSm90

    kernel = ns(worklist=True)
    work = ns(shape=(schedule.capacity(48, 8) + schedule.HEADER, 2))
    assert MlaSeesawSm90._grid(kernel, 48, 2, None, work) == (384 * 2, 1, 1)
