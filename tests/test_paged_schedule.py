"""A decode step's schedule for paged attention (`forgekernel.attention_paged_schedule`,
paged/sm90/launch.py `make_schedule`, the pass's and the combine's `ranges` forms), on the CPU:
the kernels replaced by their algorithms (the scheduling kernel: MLA's ranges form as
tests/test_mla_worklist.py replays it; the pass: test_attention_paged's `_partial` per item;
the combine over each sequence's item range), the compiles' keys, SASS and resources."""

from __future__ import annotations

import importlib
import math
import re

import pytest
import torch
from cubins import GLOBAL, sass_builder
from sweeps import slow_past
from test_attention_paged import _partial, _problem, install_cpu_decode
from test_mla_worklist import combine_ranges, ranged_schedule

import forgekernel
from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
from forgekernel.kernels.attention.mla.sm90 import schedule as mla_schedule
from forgekernel.kernels.attention.paged.sm90 import SPEC, schedule_params
from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
from forgekernel.kernels.attention.paged.sm90.config import RESIDENT, TILE, params_for
from forgekernel.reference.paged_attention import paged_attention_ref
from forgekernel.runtime import pdl

op_module = importlib.import_module("forgekernel.ops.attention_paged")
SMS = 132


def _ranged_partial(p):
    """The pass's ranges form: item i = (sequence, split) of the list writes its heads' partial
    at (i, 0); every other partial row NaN (the combine reads only a sequence's items). A
    sequence of one item (decode.py `single`) writes its final O (0 where it saw no key) and
    natural LSE at its row instead, its partial row left NaN (`_combine_ranges` leaves it)."""

    def partial(q, k, v, pt, seq, op_, lp, out, lse, direct, scale_log2, per, page_size, group,
                work, vs, cu, causal):  # fmt: skip
        assert direct == 0 and vs is None and cu is None and op_.shape[1] == 1
        per_keys, count = int(work[0, 0]), int(work[0, 1])
        listed = work[mla_schedule.HEADER : mla_schedule.HEADER + count].tolist()
        splits = max((s for _, s in listed), default=0) + 1
        b, hq, d = q.shape
        full_o = torch.empty(splits, b, hq, d)
        full_l = torch.empty(splits, b, hq)
        _partial(q, k, v, pt, seq, full_o, full_l, scale_log2, per_keys, page_size, group, None,
                 None, None, causal, heads=p["heads"])  # fmt: skip
        op_.fill_(float("nan"))
        lp.fill_(float("nan"))
        units = [u for u, _ in listed]
        for i, (u, s) in enumerate(listed):
            assert s * per_keys < max(int(seq[u]), 1)  # an item with keys (or a 0-key unit's)
            if units.count(u) == 1:
                assert s == 0 and units[i + 1 : i + 2] != [u]  # a unit's items are adjacent
                seen = torch.isfinite(full_l[0, u])
                out[u] = torch.where(seen[:, None], full_o[0, u], 0.0).to(out.dtype)
                lse[u] = full_l[0, u] * math.log(2.0)
                continue
            op_[i, 0] = full_o[s, u]
            lp[i, 0] = full_l[s, u]

    return partial


def _combine_ranges(op_, lp, out, lse, rows):
    """The paged ranges combine (`singles`): test_mla_worklist's, the rows of one item left as
    the pass wrote them."""
    single = rows[:, 1] == 1
    kept = out[single].clone(), lse[single].clone()
    combine_ranges(op_, lp, out, lse, rows)
    out[single], lse[single] = kept


@pytest.fixture
def cpu_schedule(monkeypatch):
    """The paged kernels (plain and ranges) and MLA's scheduling kernel as their algorithms;
    yields the scheduling calls (keys per split, items, splits) and the paged compile keys."""
    calls = {"sched": [], "keys": []}
    plain = install_cpu_decode(monkeypatch)
    cpu_get = paged_launch.get_kernel  # install_cpu_decode's

    def get_kernel(spec, params):
        p = dict(params)
        if spec is MLA_SPEC:
            assert p["kind"] == "worklist" and p["ranges"] and p["qtokens"] == 1
            return lambda *a: ranged_schedule(calls, 1, *a)
        assert spec is SPEC
        calls["keys"].append(p)
        if p.get("ranges", False):
            return _combine_ranges if p["kind"] == "combine" else _ranged_partial(p)
        return cpu_get(spec, params)

    monkeypatch.setattr(paged_launch, "get_kernel", get_kernel)
    calls["plain"] = plain
    yield calls
    paged_launch._plans.clear()


def _close(out, lse, want, want_lse):
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    assert torch.all(out[~finite] == 0)


CASES = [  # (b, hq, hkv, d, page_size, lens, width in pages or None)
    (3, 8, 2, 64, 16, [37, 0, 100], None),
    (2, 12, 4, 128, 1, [5, 70], None),
    (2, 16, 2, 256, 64, [300, 1], None),
    # slow (~3 s of an idle CPU, 2026-12-07): its edges are the others' (an empty and a 1-key
    # sequence, a page and one key past it: b4's 33 at page 32; a long one: b4's 2048)
    pytest.param((5, 32, 8, 128, 16, [0, 1, 64, 65, 4000], None), marks=pytest.mark.slow),
    (6, 32, 8, 128, 16, [100, 3000, 64, 0, 1500, 700], 256),  # a table for 4096 keys
    (4, 4, 4, 128, 32, [1, 33, 2048, 0], None),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_{c[2]}_d{c[3]}_p{c[4]}")
def test_one_schedule_serves_every_layer(cpu_schedule, case):
    """One schedule, three layers' queries and caches: each layer's output the reference's,
    the scheduling kernel launched once (the step's), every call on the ranges kernels."""
    b, hq, hkv, d, page_size, lens, width = case
    q, k, v, pt, seq = _problem(b, hq, hkv, d, page_size, lens)
    if width is not None:  # a wider table (as a serving engine captures): garbage past the pages
        pt = torch.cat([pt, torch.full((b, width - pt.shape[1]), -1, dtype=torch.int32)], 1)
    schedule = forgekernel.attention_paged_schedule(
        seq, pt, num_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=page_size
    )
    assert len(cpu_schedule["sched"]) == 1
    for layer in range(3):
        q, k, v, _, _ = _problem(b, hq, hkv, d, page_size, lens, seed=layer)
        out, lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True, schedule=schedule)
        want, want_lse = paged_attention_ref(q, k, v, pt, seq)
        _close(out, lse, want, want_lse)
    assert len(cpu_schedule["sched"]) == 1  # made once a step, never in a layer's call
    passes = [p for p in cpu_schedule["keys"] if p["kind"] == "partial"]
    assert passes and all(p.get("ranges") for p in passes)
    assert not cpu_schedule["plain"]  # no plain pass ran


def test_one_sequence_keeps_the_width_plan(cpu_schedule):
    """A batch of one: the schedule holds no list (nothing launched) and the call takes the
    width plan's pass, the reference's output."""
    q, k, v, pt, seq = _problem(1, 16, 2, 256, 64, [300])
    schedule = forgekernel.attention_paged_schedule(seq, pt, num_heads=16, num_kv_heads=2,
                                                    head_dim=256, page_size=64)  # fmt: skip
    assert schedule.work.shape[0] == 0 and not cpu_schedule["sched"]
    out, lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True, schedule=schedule)
    _close(out, lse, *paged_attention_ref(q, k, v, pt, seq))
    assert cpu_schedule["plain"] and not cpu_schedule["sched"]


def test_a_long_sequence_among_short_ones_gets_many_splits(cpu_schedule):
    """The list cuts the batch's longest sequence into many items and the short ones into
    one each (the width plan spreads every sequence over the same splits). The schedule reads
    the lengths and the table's width only: no K / V cache is made (`_problem`'s for these lengths
    is two 65539-page bf16 caches, 2 GiB, about a minute of randn on CI's CPU)."""
    lens = [64] * 31 + [32768]
    seq = torch.tensor(lens, dtype=torch.int32)
    pages = -(-max(lens) // 16)
    pt = torch.randperm(32 * pages, generator=torch.Generator().manual_seed(0)).view(32, pages)
    pt = pt.to(torch.int32)
    forgekernel.attention_paged_schedule(seq, pt, num_heads=32, num_kv_heads=8, head_dim=128,
                                         page_size=16)  # fmt: skip
    ((per_keys, items, _),) = cpu_schedule["sched"]
    per_unit = [sum(1 for u, _ in items if u == i) for i in range(32)]
    assert per_unit[:31] == [1] * 31 and per_unit[31] == -(-32768 // per_keys) > 8
    assert per_keys % TILE == 0


def test_schedule_matches_the_plain_call(cpu_schedule):
    q, k, v, pt, seq = _problem(6, 32, 8, 128, 16, [100, 3000, 64, 0, 1500, 700])
    plain, plain_lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True)
    schedule = forgekernel.attention_paged_schedule(seq, pt, num_heads=32, num_kv_heads=8,
                                                    head_dim=128, page_size=16)  # fmt: skip
    got, got_lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True, schedule=schedule)
    _close(got, got_lse, plain.float(), plain_lse)


def test_a_schedule_for_another_problem_is_refused(cpu_schedule):
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    schedule = forgekernel.attention_paged_schedule(seq, pt, num_heads=8, num_kv_heads=2,
                                                    head_dim=64, page_size=16)  # fmt: skip
    assert "num_kv_heads=2" in repr(schedule)
    with pytest.raises(ValueError, match="num_heads 16 .schedule 8."):
        q2, k2, v2, pt2, seq2 = _problem(3, 16, 2, 64, 16, [37, 0, 100])
        op_module.attention_paged(q2, k2, v2, pt2, seq2, schedule=schedule)
    with pytest.raises(ValueError, match="decode form"):
        cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
        op_module.attention_paged(q, k, v, pt, seq, cu_seqlens_q=cu, max_seqlen_q=1,
                                  schedule=schedule)  # fmt: skip
    with pytest.raises(TypeError, match="AttentionPagedSchedule"):
        op_module.attention_paged(q, k, v, pt, seq, schedule=(1, 2))
    with pytest.raises(ValueError, match="head_dim"):
        forgekernel.attention_paged_schedule(seq, pt, num_heads=8, num_kv_heads=2, head_dim=96,
                                             page_size=16)  # fmt: skip
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        forgekernel.attention_paged_schedule(seq, pt, num_heads=6, num_kv_heads=4, head_dim=64,
                                             page_size=16)  # fmt: skip


def test_schedule_shapes_are_the_list_and_one_range_a_sequence(monkeypatch):
    monkeypatch.setattr(paged_launch, "num_sms", lambda device: SMS)
    work, rows = paged_launch.schedule_shapes(32, 32, 8, 128, 8192, 16, 0)
    assert work == (SMS * RESIDENT[128] + 32 + mla_schedule.HEADER, 2) and rows == (32, 3)
    assert paged_launch.schedule_shapes(0, 32, 8, 128, 8192, 16, 0) == ((0, 2), (0, 3))
    # one sequence: no list, the call keeps the width plan
    assert paged_launch.schedule_shapes(1, 32, 8, 128, 8192, 16, 0) == ((0, 2), (0, 3))


# ---------------------------------------------------------------- keys and compiles (CPU)


def test_keys_and_standard_builds():
    for bad in ({"kv": "float8_e4m3fn"}, {"qtokens": 2}):
        with pytest.raises(ValueError, match="ranges"):
            params_for("partial", "bfloat16", 128, 4, ranges=True, **bad)
    assert dict(params_for("combine", "bfloat16", 128, ranges=True))["ranges"] is True
    standard = SPEC.standard_params()
    assert all(p in standard for p in schedule_params())
    ranged = [dict(p) for p in schedule_params() if dict(p)["kind"] == "partial"]
    assert {(p["dtype"], p["head_dim"]) for p in ranged} == {
        (d, h) for d in ("float16", "bfloat16") for h in (64, 128, 256)
    }
    assert not any("kv" in p or "qtokens" in p for p in ranged)


@pytest.fixture(scope="module")
def compiled():
    build = sass_builder()
    return lambda params: build(SPEC, params)


# CI: D 128 (its plain pass test_pdl's, one scope: SHARED_COMPILES); D 64 and 256 are slow
@pytest.mark.parametrize("d, heads", slow_past([(128, 4), (64, 8), (256, 2)], unpack=True))
def test_ranged_pass_is_the_pass_but_its_prologue_and_write(compiled, d, heads):
    """The ranges pass: no spill, no local memory, registers within what RESIDENT CTAs of 128
    threads an SM allow (the plain pass's occupancy kept), one griddepcontrol.wait before every
    global access (the list's reads included)."""
    res, lines = compiled(params_for("partial", "bfloat16", d, heads, ranges=True))
    plain, _ = compiled(params_for("partial", "bfloat16", d, heads))
    joined = "\n".join(lines)
    assert len(re.findall(r"\bACQBULK\b", joined)) == 1
    first_global = next(i for i, x in enumerate(lines) if GLOBAL.search(x))
    assert next(i for i, x in enumerate(lines) if "ACQBULK" in x) < first_global
    assert res["spill_bytes"] == 0 and res["sass"].get("LDL", 0) == 0
    assert res["registers"] <= min(255, 65536 // (128 * RESIDENT[d]))
    assert plain["spill_bytes"] == 0


def test_ranged_combine_waits_before_its_reads(compiled):
    res, lines = compiled(params_for("combine", "bfloat16", 128, ranges=True))
    first_global = next(i for i, x in enumerate(lines) if GLOBAL.search(x))
    assert next(i for i, x in enumerate(lines) if "ACQBULK" in x) < first_global
    assert res["spill_bytes"] == 0


# slow: the build without PDL is a candidate (the bench's `no_pdl`, `build --candidates`), no
# standard configuration's (~1 s of an idle CPU, 2026-12-07)
@pytest.mark.slow
def test_ranged_combine_without_pdl_waits_for_nothing(compiled):
    off, off_lines = compiled(pdl.key(params_for("combine", "bfloat16", 128, ranges=True), False))
    assert not any("ACQBULK" in x for x in off_lines) and off["spill_bytes"] == 0


def test_lengths_past_a_split_are_not_read():
    """The list's items cover each sequence's keys once: sum over a unit's items of their keys
    is its length (schedule.py's ranged_plan on the serving mixed batch's lengths)."""
    lens = [round(512 * 2 ** (i / 5)) for i in range(32)]
    tiles = mla_schedule.unit_tiles(lens, 8192)
    slots = SMS * RESIDENT[128]
    cap = mla_schedule.ranged_capacity(len(lens), slots)
    per_keys, items, ranges = mla_schedule.ranged_plan(tiles, 8, 4, slots, cap)
    for u, n in enumerate(lens):
        mine = [s for v, s in items if v == u]
        assert mine == list(range(len(mine)))
        assert (len(mine) - 1) * per_keys < n <= len(mine) * per_keys
    assert math.isfinite(per_keys)


def test_bench_ours_makes_the_schedule_once(cpu_schedule):
    """The suite's ours on a decode case: the schedule made on the input set's first call, the
    later (timed) calls the op's alone, on the ranges kernels; the `plain` variant's output
    (the width plan) the same within the bound; packed and FP8 cases take no schedule."""
    from forgekernel.bench.suites import attention_paged as suite

    case = suite._case(6, 32, 8, 128, 16, (100, 3000, 64, 0, 1500, 700), group="mixed",
                       tag="tiny", width=8192)  # fmt: skip
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    want = suite._run_plain(inputs, None)
    assert not cpu_schedule["sched"]
    for _ in range(3):
        got = suite.run_ours(inputs, None)
        assert float((got[0].float() - want[0].float()).abs().max()) < 2e-2
    assert len(cpu_schedule["sched"]) == 1
    assert any(p.get("ranges") for p in cpu_schedule["keys"])
    spec = suite._case(2, 32, 8, 128, 16, (70, 300), q_lens=2, group="spec")
    fp8 = suite._case(2, 32, 8, 128, 16, (70, 300), group="fp8", fp8="tensor")
    for other in (spec, fp8):
        inputs = suite.make_inputs(other, torch.bfloat16, torch.device("cpu"),
                                   torch.Generator().manual_seed(0))  # fmt: skip
        assert suite._schedule(inputs) is None


def test_suite_plain_cases_are_bench_cases():
    from forgekernel.bench.suites import attention_paged as suite

    names = {c.name: c for c in suite.BENCH_CASES}
    assert set(suite.PLAIN_CASES) <= set(names)
    for name in suite.PLAIN_CASES:
        assert "plain" in suite.variants(names[name])


@pytest.mark.parametrize("mode", ["real", "fake"])
def test_schedule_traces_as_a_custom_op(cpu_schedule, mode):
    """Traced (make_fx: torch.compile's path), the schedule is the custom op
    forgekernel::attention_paged_schedule, its fake the list's shape; the layers' decode calls
    take its tensors through forgekernel::attention_paged_decode."""
    from torch.fx.experimental.proxy_tensor import make_fx

    q, k, v, pt, seq = _problem(6, 32, 8, 128, 16, [100, 3000, 64, 0, 1500, 700])

    def step(q, k, v, pt, seq):
        schedule = forgekernel.attention_paged_schedule(seq, pt, num_heads=32, num_kv_heads=8,
                                                        head_dim=128, page_size=16)  # fmt: skip
        return op_module.attention_paged(q, k, v, pt, seq, schedule=schedule)

    graph = make_fx(step, tracing_mode=mode)(q, k, v, pt, seq)
    code = graph.code
    assert "forgekernel.attention_paged_schedule" in code
    assert "forgekernel.attention_paged_decode" in code
    if mode == "real":
        want, _ = paged_attention_ref(q, k, v, pt, seq)
        assert float((graph(q, k, v, pt, seq).float() - want).abs().max()) < 2e-2
