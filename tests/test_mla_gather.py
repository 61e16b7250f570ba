"""The MLA seesaw pass's gather form (candidate; seesaw.py `gather`, MLA_NOTES.md "The seesaw over
gathered rows") on the CPU: which compile key each page size takes (FORGEKERNEL_MLA_GATHER /
plan_form(gather=True); off by default), the op through the launcher with the kernels replayed
(tests/mla_seesaw.py `seesaw_partial(gather=True)`: each tile's rows gathered one by one, keys
clamped to the split's last) against reference.mla with NaN in every stale slot, bit for bit the
page-64 seesaw's replay on the same keys in 64-row pages, and the kernel's gather partition (its
thread -> (row, 16 bytes) map, `_gather_rows`' clamp) replayed on the host."""

from __future__ import annotations

import importlib

import pytest
import test_mla_decode as decode_tests
import torch
from test_mla_decode import SCALE, _assert_close, _problem

from forgekernel.kernels.attention.mla.sm90 import SPEC, gather_params
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import TILE, params_for
from forgekernel.reference.mla import mla_decode_ref

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


@pytest.mark.parametrize("page_size", [1, 16, 32, 96, 64, 128])
@pytest.mark.parametrize("on", ["env", "form", None])
def test_which_pass_each_page_size_takes(monkeypatch, page_size, on):
    """Whole-tile pages: the seesaw's TMA form, whatever the switch; other pages: decode.py's
    role-split pass by default, the seesaw's gather form with the switch (the environment or
    plan_form(gather=True))."""
    env = {"FORGEKERNEL_MLA_GATHER": "1"} if on == "env" else {}
    form = (None, None, False, True, True) if on == "form" else None
    key = _key(monkeypatch, page_size, env=env, form=form)
    whole = page_size % TILE == 0
    assert key.get("tma", False) == (whole or on is not None)
    assert key.get("gather", False) == (not whole and on is not None)


def test_gather_keys_and_what_they_exclude(monkeypatch):
    """The gather form takes no FP8 cache, no work list and not FORGEKERNEL_MLA_SCHEDULE=roles;
    a plan of one split takes its direct form (and `ostore` at 64 x 1)."""
    on = {"FORGEKERNEL_MLA_GATHER": "1"}
    assert not _key(monkeypatch, 1, env=on, fp8=True).get("gather", False)
    roles = {**on, "FORGEKERNEL_MLA_SCHEDULE": "roles"}
    assert not _key(monkeypatch, 16, env=roles).get("tma", False)
    monkeypatch.setenv("FORGEKERNEL_MLA_SCHEDULE", "seesaw")
    listed = _key(monkeypatch, 1, lens=(65536,), env={**on, "FORGEKERNEL_MLA_WORKLIST": "1"})
    assert listed.get("gather", False) and not listed.get("worklist", False)
    direct = _key(monkeypatch, 1, hq=128, lens=(100,) * 132, env=on)
    assert direct == dict(params_for("partial", "bfloat16", 64, tma=True, direct=True,
                                     ostore=True, gather=True))  # fmt: skip
    with pytest.raises(ValueError, match="gather"):
        params_for("partial", "bfloat16", 16, gather=True)  # not the seesaw pass
    with pytest.raises(ValueError, match="gather"):
        params_for("partial", "bfloat16", 16, tma=True, worklist=True, gather=True)
    with pytest.raises(ValueError, match="unfenced"):
        params_for("partial", "bfloat16", 16, tma=True, unfenced=True)  # not the gather form
    with pytest.raises(ValueError, match="gather must be"):
        with mla_launch.plan_form(gather="fenced"):
            pass
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_GATHER"):
        monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "yes")
        mla_launch.gather_mode()


@pytest.mark.parametrize("on", ["env", "form"])
def test_the_unfenced_diagnostic_build(monkeypatch, on):
    """FORGEKERNEL_MLA_GATHER=unfenced or plan_form(gather="unfenced"): the gather form's key
    with `unfenced` (partial and direct); whole-tile pages keep the TMA form."""
    env = {"FORGEKERNEL_MLA_GATHER": "unfenced"} if on == "env" else {}
    form = (None, None, False, True, "unfenced") if on == "form" else None
    key = _key(monkeypatch, 1, env=env, form=form)
    assert key == dict(params_for("partial", "bfloat16", 16, tma=True, gather=True,
                                  unfenced=True))  # fmt: skip
    direct = _key(monkeypatch, 16, hq=128, lens=(100,) * 132, env=env, form=form)
    assert direct.get("unfenced", False) and direct.get("direct", False)
    assert "unfenced" not in _key(monkeypatch, 64, env=env, form=form)


def test_gather_keys_are_candidates_only():
    """Keyed only when on: no standard key is a gather one; the candidates hold the GPU tests'
    and the bench's blocks, partial and direct, both dtypes."""
    standard = SPEC.standard_params()
    assert not any(dict(p).get("gather", False) for p in standard)
    keys = gather_params()
    assert set(keys) <= set(SPEC.candidate_params())
    assert not set(keys) & set(standard) and len(set(keys)) == len(keys) == 22
    for dtype in ("bfloat16", "float16"):
        for heads, qt in ((16, 1), (64, 1), (16, 2), (32, 2)):
            assert params_for("partial", dtype, heads, qt, tma=True, gather=True) in keys
    for heads in (16, 64):  # the bench's page-1 blocks, the diagnostic build
        assert params_for("partial", "bfloat16", heads, tma=True, gather=True,
                          unfenced=True) in keys  # fmt: skip


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
    """The op with FORGEKERNEL_MLA_GATHER=1 on the replay (stale slots NaN: the gather reads
    none past the split) against the reference, and bit for bit the page-64 seesaw's replay on
    the same keys in 64-row pages (the same plan)."""
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
