"""The MLA seesaw pass's gather form (seesaw.py `gather`, MLA_NOTES.md "The seesaw over gathered
rows", "gather adopted") on the CPU: which compile key each page size takes (the rule: page size
1 by default, `launch.GATHER_PAGES`; FORGEKERNEL_MLA_GATHER / plan_form(gather=) either way), the
adopted keys prebuilt, the op through the launcher with the kernels replayed
(tests/mla_seesaw.py `seesaw_partial(gather=True)`: each tile's rows gathered one by one, keys
clamped to the split's last) against reference.mla with NaN in every stale slot, bit for bit the
page-64 seesaw's replay on the same keys in 64-row pages, and the kernel's gather partition (its
thread -> (row, 16 bytes) map, `_gather_rows`' clamp) replayed on the host."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import test_mla_decode as decode_tests
import torch
from test_mla_decode import SCALE, _assert_close, _problem

from forgekernel.kernels.attention.mla.sm90 import SPEC, gather_params
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import TILE, params_for
from forgekernel.reference.mla import mla_decode_ref
from forgekernel.runtime import pdl
from forgekernel.runtime.pdl import built_on

op = importlib.import_module("forgekernel.ops.mla")
cpu_kernels = decode_tests.cpu_kernels  # the launcher's kernels replayed (test_mla_decode)


def _key(monkeypatch, page_size, hq=16, lens=(300, 5), s_q=1, fp8=False, env=None, form=None):
    """The compile key of the pass the launcher plans for a bf16 problem (`_plan`)."""
    for name, value in (env or {}).items():
        monkeypatch.setenv(name, value)
    monkeypatch.setattr(mla_launch, "get_kernel", lambda spec, p: dict(p))
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    pages = -(-max(lens) // page_size)
    kernel, *_ = mla_launch._plan(
        "partial", torch.bfloat16, len(lens), hq, pages * page_size, s_q, 0, fp8, page_size,
        form=form,
    )  # fmt: skip
    return kernel


# (FORGEKERNEL_MLA_GATHER, plan_form's gather) -> what the switch asks: every page size off the
# tile (True), none (False), the rule (None: page size 1)
SWITCHES = {
    "rule": ({}, None),
    "env1": ({"FORGEKERNEL_MLA_GATHER": "1"}, None),
    "env0": ({"FORGEKERNEL_MLA_GATHER": "0"}, None),
    "form1": ({}, True),
    "form0": ({}, False),
    "form0_over_env1": ({"FORGEKERNEL_MLA_GATHER": "1"}, False),  # the bench's `was` under env
    "form1_over_env0": ({"FORGEKERNEL_MLA_GATHER": "0"}, True),
    "rule_form_none_env1": ({"FORGEKERNEL_MLA_GATHER": "1"}, None),
}
ASKED = {"rule": None, "env1": True, "env0": False, "form1": True, "form0": False,
         "form0_over_env1": False, "form1_over_env0": True,
         "rule_form_none_env1": True}  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 2, 16, 24, 32, 96, 64, 128])
@pytest.mark.parametrize("switch", list(SWITCHES))
def test_which_pass_each_page_size_takes(monkeypatch, page_size, switch):
    """Whole-tile pages: the seesaw's TMA form, whatever the switch; other pages: the seesaw's
    gather form at page size 1 (the rule: the measured page size) and decode.py's role-split
    pass at the others (16, 24, ...: not measured), unless the switch says otherwise
    (plan_form(gather=) over FORGEKERNEL_MLA_GATHER over the rule)."""
    env, gather = SWITCHES[switch]
    form = None if gather is None else (None, None, False, True, gather)
    key = _key(monkeypatch, page_size, env=env, form=form)
    whole = page_size % TILE == 0
    asked = ASKED[switch]
    takes = not whole and (page_size == 1 if asked is None else asked)
    assert key.get("gather", False) == takes
    assert key.get("tma", False) == (whole or takes)


def test_the_rule_is_page_size_one():
    """launch.takes_gather: the rule's page sizes are the measured one; a switch decides alone."""
    assert mla_launch.GATHER_PAGES == (1,)
    assert mla_launch.takes_gather(1, None) and not mla_launch.takes_gather(16, None)
    assert not mla_launch.takes_gather(1, False) and mla_launch.takes_gather(16, True)


def test_gather_keys_and_what_they_exclude(monkeypatch):
    """The gather form takes no FP8 cache (page 1 included: decode.py's pass), no work list and
    not FORGEKERNEL_MLA_SCHEDULE=roles; a plan of one split takes its direct form (and `ostore`
    at 64 x 1), page 1 by the rule as with the switch."""
    on = {"FORGEKERNEL_MLA_GATHER": "1"}
    for env in ({}, on):
        fp8 = _key(monkeypatch, 1, env=env, fp8=True)
        assert fp8.get("fp8", False) and not fp8.get("gather", False) and not fp8.get("tma", False)
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER")
    roles = {"FORGEKERNEL_MLA_SCHEDULE": "roles"}
    assert not _key(monkeypatch, 1, env=roles).get("tma", False)
    assert not _key(monkeypatch, 16, env={**roles, **on}).get("tma", False)
    monkeypatch.setenv("FORGEKERNEL_MLA_SCHEDULE", "seesaw")
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER")
    listed = _key(monkeypatch, 1, lens=(65536,), env={"FORGEKERNEL_MLA_WORKLIST": "1"})
    assert listed.get("gather", False) and not listed.get("worklist", False)
    direct = _key(monkeypatch, 1, hq=128, lens=(100,) * 132)
    assert direct == dict(params_for("partial", "bfloat16", 64, tma=True, direct=True,
                                     ostore=True, gather=True))  # fmt: skip
    with pytest.raises(ValueError, match="gather"):
        params_for("partial", "bfloat16", 16, gather=True)  # not the seesaw pass
    with pytest.raises(ValueError, match="gather"):
        params_for("partial", "bfloat16", 16, tma=True, worklist=True, gather=True)
    for dropped in ("fenced", "unfenced"):  # the build without the fences is gone
        with pytest.raises(ValueError, match="gather must be"):
            with mla_launch.plan_form(gather=dropped):
                pass
    monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "yes")
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_GATHER must be '0' or '1'"):
        mla_launch.gather_mode()
    monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "unfenced")  # valid until 2026-12-05
    with pytest.raises(ValueError, match="unfenced was removed on 2026-12-05; use 0 or 1"):
        mla_launch.gather_mode()


PDL_OFF = {
    "on": (contextlib.nullcontext, {}),
    "env0": (contextlib.nullcontext, {"FORGEKERNEL_PDL": "0"}),
    "off": (pdl.off, {}),
}


@pytest.mark.parametrize("pdl_state", list(PDL_OFF))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_page1_plan_takes_a_prebuilt_key(monkeypatch, dtype, pdl_state):
    """The rule's class is prebuilt: whatever block, query tokens, split count or direct form a
    16-bit page-1 plan picks (1-128 heads, MTP 1-4 and prefill blocks, one split to many), its
    pass's key is a standard one (`forgekernel build`: no JIT stall on a first call). With PDL
    (the default) the gather form's; without (FORGEKERNEL_PDL=0, `pdl.off()`) decode.py's, as
    before the rule (the gather keys are PDL builds only; a combine without PDL is a `pdl: off`
    key as at every page size, runtime/pdl.py)."""
    monkeypatch.setattr(mla_launch, "get_kernel", lambda spec, p: p)
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    context, env = PDL_OFF[pdl_state]
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    on = pdl_state == "on"
    standard = set(SPEC.standard_params())
    seen = set()
    with context():
        for hq in (1, 2, 4, 8, 16, 32, 64, 128):
            for qtokens in (1, 2, 4):
                for units, width in ((1, 65536), (2, 300), (16, 4096), (132, 100), (600, 40)):
                    for narrow in (False, True):
                        kernel, combine, *_ = mla_launch._plan(
                            "partial", dtype, units, hq, width, qtokens, 0, False, 1,
                            narrow=narrow,
                        )  # fmt: skip
                        where = (hq, qtokens, units)
                        assert kernel in standard, where
                        assert dict(kernel).get("gather", False) == on, where
                        assert dict(kernel).get("tma", False) == on, where
                        if on:
                            assert combine is None or combine in standard
                        else:
                            assert combine is None or dict(combine)["pdl"] == "off"
                        seen.add(kernel)
        # forced, gather is taken without PDL too (its `pdl: off` key compiles at the first call)
        for form in ((None, None, False, True, True), None):
            if form is None:
                monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "1")
            kernel, *_ = mla_launch._plan(
                "partial", dtype, 16, 16, 4096, 1, 0, False, 1, form=form
            )  # fmt: skip
            assert dict(kernel)["gather"] and built_on(dict(kernel)) == on
    assert {dict(k).get("direct", False) for k in seen} == {False, True}
    assert any(dict(k).get("ostore", False) for k in seen) == on


def test_gather_keys_are_standard():
    """The gather form's keys (every seesaw block with `gather`: partial, direct, direct
    `ostore`; both dtypes) are standard builds, none a candidate; the fenced blocks the GPU
    tests and the bench ran among them; no key is the dropped build without the fences."""
    standard = SPEC.standard_params()
    keys = gather_params()
    assert set(keys) <= set(standard) and not set(keys) & set(SPEC.candidate_params())
    assert len(set(keys)) == len(keys) == 54
    assert {p for p in standard if dict(p).get("gather", False)} == set(keys)
    for dtype in ("bfloat16", "float16"):
        for heads, qt in ((16, 1), (64, 1), (16, 2), (32, 2)):
            for direct in (False, True):
                assert params_for("partial", dtype, heads, qt, tma=True, direct=direct,
                                  gather=True) in keys  # fmt: skip
    assert not any("unfenced" in dict(p) for p in (*standard, *SPEC.candidate_params()))


def test_the_suite_checks_and_sanitizes_the_gather_form(monkeypatch):
    """The suite's sanitize cases (a subset of its check cases) reach the gather form's direct
    16 x 1 and partial 64 x 1 keys at 16-bit page 1; its bench's page-1 cases carry `was`."""
    from forgekernel.bench.suites import mla_decode as suite

    found = set()
    for case in suite.SANITIZE_CASES:
        p = case.params
        if p["page"] != 1 or suite.fp8(case):
            continue
        key = _key(monkeypatch, 1, hq=p["hq"], lens=p["lens"], s_q=p["s_q"])
        assert key.get("gather", False)
        found.add((key.get("direct", False), key["heads"]))
    assert found == {(True, 16), (False, 64)}
    assert all(c in suite.CHECK_CASES for c in suite.SANITIZE_CASES)
    for name in suite.GATHER_CASES:
        (case,) = [c for c in suite.BENCH_CASES if c.name == name]
        assert set(suite.variants(case)) == {"was"}


GATHER_CASES = [
    # b, hq, page_size, lens, s_q, combined, dtype
    (3, 16, 1, [1, 0, 300], 1, False, torch.bfloat16),
    (2, 16, 16, [65, 1000], 1, True, torch.float16),
    (3, 16, 16, [40, 1, 130], 2, False, torch.bfloat16),
    (2, 128, 1, [0, 513], 1, True, torch.bfloat16),
    (2, 128, 16, [70, 190], 2, False, torch.float16),
    (2, 16, 24, [47, 2000], 1, False, torch.bfloat16),
]


@pytest.mark.parametrize(("b", "hq", "page_size", "lens", "s_q", "combined", "dtype"),
                         GATHER_CASES)  # fmt: skip
def test_gather_matches_the_reference_and_the_page64_replay(
    cpu_kernels, monkeypatch, b, hq, page_size, lens, s_q, combined, dtype
):
    """The op on the replay, page 1 by the rule and the other page sizes with
    FORGEKERNEL_MLA_GATHER=1 (stale slots NaN: the gather reads none past the split), against
    the reference, and bit for bit the page-64 seesaw's replay on the same keys in 64-row pages
    (the same plan)."""
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER", raising=False)
    if page_size != 1:
        monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "1")
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, page_size, lens, s_q, combined, dtype)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    _assert_close(out, lse, want, want_lse)
    params = cpu_kernels[-1][0]
    assert params.get("gather", False) and params["tma"]
    ckv64, kpe64, table64 = _as_64_pages(ckv, kpe, table, lens, page_size)
    out64, lse64 = op.mla_decode(qn, qp, ckv64, kpe64, table64, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    assert not cpu_kernels[-1][0].get("gather", False) and cpu_kernels[-1][0]["tma"]
    assert torch.equal(out, out64) and torch.equal(lse, lse64)


def test_the_plan_before_under_plan_form(cpu_kernels, monkeypatch):
    """The bench's `was` (plan_form(gather=False)) on a page-1 problem: decode.py's role-split
    pass, keyed apart from the rule's plan of the same problem (the gather form), both against
    the reference on the replay."""
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER", raising=False)
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 1, [1, 0, 300], 1, False, torch.bfloat16)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    for gather in (False, None):
        with mla_launch.plan_form(gather=gather):
            out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                     return_lse=True)  # fmt: skip
        params = cpu_kernels[-1][0]
        assert params.get("gather", False) == (gather is None)
        assert params.get("tma", False) == (gather is None)
        _assert_close(out, lse, want, want_lse)


def _as_64_pages(ckv, kpe, table, lens, ps):
    """The same keys in 64-row pages (sequence i's keys in order, NaN past its length), the
    table's width in tokens rounded up to 64 (the same tiles: the same plan)."""
    width = -(-table.shape[1] * ps // TILE)
    b = len(lens)

    def rows(cache):
        flat = cache[table.long()].flatten(1, 2)
        out = torch.full((b, width * TILE, *cache.shape[2:]), float("nan"), dtype=cache.dtype)
        for i, n in enumerate(lens):
            out[i, :n] = flat[i, :n]
        return out.view(b * width, TILE, *cache.shape[2:])

    table64 = torch.arange(b * width, dtype=torch.int32).view(b, width)
    return rows(ckv), None if kpe is None else rows(kpe), table64


# ---------------------------------------------------------------- the kernel's gather partition

WG_THREADS, SEGS, GATHER_ROWS = 128, 8, 4  # seesaw.py: a chunk row is 8 x 16 bytes


def _thread_rows(tid: int) -> list[int]:
    """`tiled_row_copy(dtype, CHUNK, 128)`'s rows of thread tid (layout (16, 8) row-major: 8
    threads a row, the next 16 rows 16 apart), as `_gather_rows` reads them (crd[0, m, 0])."""
    return [tid // SEGS + 16 * m for m in range(GATHER_ROWS)]


def test_gather_partition_covers_each_chunk_once():
    """Every (row, 16-byte column) of a 64 x 64 chunk is one thread's copy, once; a warp's
    instruction m covers four whole rows (128 bytes each: whole sectors of the cache row)."""
    seen = {}
    for tid in range(WG_THREADS):
        for m, row in enumerate(_thread_rows(tid)):
            seen.setdefault((row, tid % SEGS), []).append((tid, m))
    assert sorted(seen) == [(r, s) for r in range(TILE) for s in range(SEGS)]
    assert all(len(v) == 1 for v in seen.values())
    for warp in range(WG_THREADS // 32):
        for m in range(GATHER_ROWS):
            rows = {_thread_rows(t)[m] for t in range(32 * warp, 32 * warp + 32)}
            assert len(rows) == 4


@pytest.mark.parametrize("page_size", [1, 16, 24])
@pytest.mark.parametrize(("t0", "t1"), [(0, 1), (0, 64), (256, 300), (64, 129), (0, 1000)])
def test_gather_rows_stay_inside_the_split(page_size, t0, t1):
    """`_gather_rows`: key min(t0 + 64 tile + row, t1 - 1), its page-table index and slot:
    every index names a page holding keys < t1 (no entry past the split is read), the rows of
    the split's keys are theirs, the rest repeat its last key (masked; zeroed past the
    sequence)."""
    table_width = -(-t1 // page_size)
    for tile in range(-(-(t1 - t0) // TILE)):
        for tid in range(WG_THREADS):
            for row in _thread_rows(tid):
                token = min(t0 + tile * TILE + row, t1 - 1)
                index, slot = divmod(token, page_size)
                assert 0 <= index < table_width and 0 <= slot < page_size
                if t0 + tile * TILE + row < t1:
                    assert index * page_size + slot == t0 + tile * TILE + row
