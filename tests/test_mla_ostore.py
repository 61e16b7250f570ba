"""The seesaw pass's direct form with its O through shared memory (seesaw.py, compile key
`ostore`): each thread's normalized O converted to q's dtype and stored over the K buffers
(rows O16_STRIDE elements apart), a proxy fence and __syncthreads, then warp 0's elected lane
sends each written row by one 1 KB bulk copy (`_send_rows`, the partial form's send) to the
rows the default's scalar stores wrote.

- The replay: the traced P V fragment through the staging and `_send_rows`' loop writes
  out[q_off + token, head0 + h] = O row token x pitch + h in q's dtype, bit for bit the
  default's (o * inv then one conversion), every written row once, nothing else; the staging
  inside kl, rows 16-byte aligned; the bank spread of its 32-bit stores.
- The source the replay follows, after the row sums' __syncthreads (no WGMMA or TMA load on the
  K buffers in flight past it: the partial form's argument).
- The selection: the knob (on by default since 2026-12-03 14:25), out's alignment, the blocks,
  the check and sanitize cases that run it; the compile: one UBLKCP loop in place of 128
  STG.E.U16 a thread, no spills, the rest of the SASS's counts as the default's, and its steady
  pair loops the partial form's (MLA_NOTES.md, "next/mla-ur")."""

from __future__ import annotations

import inspect

import pytest
import torch
from sweeps import slow_past  # tests/ is on the path

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.mla.sm90 import config, launch, seesaw  # noqa: E402


def _direct_epilogue(coords, heads, qtokens, sq, q_off, head0, o, out, sent):
    """The ostore epilogue on the traced fragment: both warpgroups' threads stage O (already
    normalized, in out's dtype) at (row, wg COLS + column), rows O16_STRIDE apart (the kernel's
    `local_tile(sO, (ROWS, COLS), (0, wg))` and `partition_C`); then `_send_rows` copies staged
    row r < G of token r // pitch < sq and head r % pitch < H, 512 values, to out[q_off +
    token, head0 + r % pitch]. Counts each staged element and each row sent; returns the staged
    elements' last offset + 1."""
    pitch = max(heads, seesaw.Q_BOX_MIN)
    staged = torch.full((seesaw.ROWS * seesaw.O16_STRIDE,), float("nan"), dtype=out.dtype)
    count = torch.zeros(staged.shape, dtype=torch.int32)
    for wg in range(2):
        for rows in coords.values():
            for crd in rows:
                for row, col in crd:
                    at = row * seesaw.O16_STRIDE + wg * seesaw.COLS + col
                    staged[at] = o[row, wg * seesaw.COLS + col]
                    count[at] += 1
    assert int(count.max()) == 1 and int(count.sum()) == seesaw.ROWS * seesaw.D_LATENT
    for r in range(pitch * qtokens):  # _send_rows
        token = r // pitch
        if token < sq and r % pitch < heads:
            row = staged[r * seesaw.O16_STRIDE :][: seesaw.D_LATENT]
            out[q_off + token, head0 + r % pitch] = row
            sent[q_off + token, head0 + r % pitch] += 1
    return int(torch.nonzero(count).max()) + 1


@pytest.mark.parametrize(
    "heads, qtokens, sq", [(64, 1, 1), (32, 2, 2), (32, 2, 1), (16, 4, 3), (16, 1, 0), (8, 2, 1)]
)
def test_ostore_stages_and_sends_every_row_once(heads, qtokens, sq):
    from mla_seesaw_probe import output_coords

    coords = output_coords(heads, qtokens)
    g = torch.Generator().manual_seed(heads * 5 + qtokens + sq)
    o = torch.randn(64, 512, generator=g)
    inv = torch.rand(64, 1, generator=g) + 0.5
    o16 = (o * inv).to(torch.bfloat16)  # `_write_split`'s o * inv, then the one conversion
    rows, hq, q_off, head0 = 9, 3 * heads, 2, heads
    out = torch.full((rows, hq, 512), float("nan"), dtype=torch.bfloat16)
    sent = torch.zeros(rows, hq, dtype=torch.int32)
    end = _direct_epilogue(coords, heads, qtokens, sq, q_off, head0, o16, out, sent)
    assert end * 2 <= 2 * 64 * 512 * 2  # inside kl (STAGES x 64 x 512 16-bit values)
    # a bulk copy's source, destination and size: 16-byte multiples (rows of 1 KB)
    assert seesaw.O16_STRIDE * 2 % 16 == 0 and seesaw.D_LATENT * 2 % 16 == 0
    want = torch.zeros_like(sent)
    want[q_off : q_off + sq, head0 : head0 + heads] = 1
    assert torch.equal(sent, want)
    pitch = max(heads, seesaw.Q_BOX_MIN)
    block = out[q_off : q_off + sq, head0 : head0 + heads]
    assert torch.equal(block.view(torch.int16), o16[: sq * pitch].view(sq, pitch, 512)[:, :heads]
                       .view(torch.int16))  # fmt: skip
    assert out[sent == 0].isnan().all()


def test_ostore_bank_spread():
    """A warp's 32-bit staging stores (rows lane // 4, column pair lane % 4) on 32 distinct
    banks at the padded stride (8 ways on 4 banks without it)."""
    for stride, ways in ((seesaw.O16_STRIDE, 1), (seesaw.D_LATENT, 8)):
        banks = [((lane // 4) * stride + 2 * (lane % 4)) // 2 % 32 for lane in range(32)]
        assert max(banks.count(b) for b in set(banks)) == ways


def _in_order(src: str, lines: list[str]) -> None:
    """Each of `lines` occurs in `src` after the one before it."""
    at = 0
    for line in lines:
        at = src.index(line, at) + len(line)


def test_ostore_is_the_kernels():
    """The staging comes after the row sums' __syncthreads and `_write_split` (which then
    normalizes O in place and stores no O itself), over kl in out's dtype with the padded rows
    (`_staged`), and a proxy fence and __syncthreads part it from `_send_rows`' bulk copies,
    issued by warp 0's elected lane (the partial form's block: tests/test_mla_seesaw.py)."""
    src = inspect.getsource(seesaw.MlaSeesawSm90.kernel)
    _in_order(src, [
        "cute.arch.sync_threads()\n        row_max",
        "self._write_split(",
        "if const_expr(not self.direct or self.ostore):",
        "sO, tOrO = self._staged(storage, mOp, acc_o)",
        "cute.autovec_copy(tOrO, thr_pv.partition_C(half))",
        "cute.arch.fence_view_async_shared()",
        "cute.arch.sync_threads()",
        "if warp == 0:",
        "with cute.arch.elect_one():",
        "self._send_rows(mOp, sO, (w_split, w_off, sq, head0))",
    ])  # fmt: skip
    staging = inspect.getsource(seesaw.MlaSeesawSm90._staged)
    _in_order(staging, [
        "if self.direct:",
        "o_type, stride = mOp.element_type, O16_STRIDE",
        "tOrO.store(acc_o.load().to(o_type))",
        "cute.recast_ptr(storage.kl.data_ptr(), dtype=o_type)",
        "cute.make_layout((ROWS, D_LATENT), stride=(stride, 1))",
    ])  # fmt: skip
    write = inspect.getsource(seesaw.MlaSeesawSm90._write_split)
    assert "if const_expr(not self.direct or self.ostore):" in write
    assert "0 if self.ostore else cute.size(o, mode=[1])" in write
    send = inspect.getsource(seesaw.MlaSeesawSm90._send_rows)
    _in_order(send, [
        "cute.make_copy_atom(cpasync.CopyBulkS2GOp(), mOp.element_type)",
        "if self._written(r, token, sq):",
        "at_row = (q_off + token, head0 + r % self.pitch, None)",
        "row = mOp[at_row].iterator",
    ])  # fmt: skip
    with pytest.raises(ValueError, match="direct"):
        seesaw.MlaSeesawSm90(64, ostore=True)


def test_ostore_selection(monkeypatch):
    """FORGEKERNEL_MLA_OSTORE (default on, "0" off); out's rows 16-byte aligned (base and outer
    strides); the blocks; the keys."""
    monkeypatch.delenv("FORGEKERNEL_MLA_OSTORE", raising=False)
    assert launch.ostore_enabled()
    monkeypatch.setenv("FORGEKERNEL_MLA_OSTORE", "0")
    assert not launch.ostore_enabled()
    monkeypatch.setenv("FORGEKERNEL_MLA_OSTORE", "on")
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_OSTORE"):
        launch.ostore_enabled()
    out = torch.empty(7, 4, 520, dtype=torch.bfloat16)
    assert launch._wide_rows(out[:, :, :512])
    assert not launch._wide_rows(torch.empty(7, 4, 513, dtype=torch.bfloat16)[:, :, :512])
    assert not launch._wide_rows(out.view(-1)[1 : 1 + 7 * 4 * 512].view(7, 4, 512))
    assert config.runs_ostore(64, 1) and config.runs_ostore(32, 2) and config.runs_ostore(16, 1)
    assert not config.runs_ostore(32, 1) and not config.runs_ostore(16, 2)
    with pytest.raises(ValueError, match="direct"):
        config.params_for("partial", "bfloat16", 64, tma=True, ostore=True)
    a = config.params_for("partial", "bfloat16", 64, tma=True, direct=True)
    b = config.params_for("partial", "bfloat16", 64, tma=True, direct=True, ostore=True)
    assert a != b and dict(b)["ostore"] is True and "ostore" not in dict(a)


# (b, hq, lens, s_q) -> the compile key's (heads, qtokens, ostore) of its plan on 132 SMs
OSTORE_PLANS = [
    ((4, 128, [1, 63, 65, 200], 1), (64, 1, True)),  # direct 64 x 1
    ((2, 128, [70, 190], 2), (32, 2, True)),  # direct 32 x 2 (MTP 2)
    ((64, 128, [4096] * 64, 1), (64, 1, True)),  # b64-h128-L4096: one wave, one split
    ((2, 128, [65, 513], 1), (64, 1, False)),  # 3 splits: the partial pass
    ((3, 16, [37, 0, 100], 1), (16, 1, True)),  # direct 16 x 1
    ((3, 16, [5, 0, 130], 2), (16, 2, False)),  # direct 16 x 2: not an ostore block
]


def _launch_keys(monkeypatch):
    """The launcher on no-op kernels that record their compile keys (a list, per call)."""
    seen = []

    def get_kernel(spec, params):
        return lambda *args: seen.append(dict(params))

    monkeypatch.setattr(launch, "_plans", type(launch._plans)())
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    return seen


def _decode(b, hq, lens, s_q, out=None):
    """launch.mla_decode on zeros (page 64, every table entry page 0; packed by s_q when s_q >
    1) into `out` (rows, hq, 512) or a fresh one."""
    bf = torch.bfloat16
    rows, pages = b * s_q, max(1, -(-max(lens) // 64))
    qn, qp = torch.zeros(rows, hq, 512, dtype=bf), torch.zeros(rows, hq, 64, dtype=bf)
    ckv, kpe = torch.zeros(1, 64, 512, dtype=bf), torch.zeros(1, 64, 64, dtype=bf)
    table = torch.zeros(b, pages, dtype=torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32)
    cu = torch.arange(0, rows + 1, s_q, dtype=torch.int32) if s_q > 1 else None
    out = torch.empty(rows, hq, 512, dtype=bf) if out is None else out
    launch.mla_decode(qn, qp, ckv, kpe, table, seq, 0.1, out, torch.empty(rows, hq), cu, s_q)


@pytest.mark.parametrize(
    ("problem", "want"), OSTORE_PLANS, ids=[f"b{p[0]}-h{p[1]}-sq{p[3]}" for p, _ in OSTORE_PLANS]
)
def test_ostore_plans(monkeypatch, problem, want):
    """The ostore compile runs the direct plans of the OSTORE_BLOCKS by default, where out's
    rows are 16-byte aligned (an out 8 bytes off takes the direct form's scalar stores, a plan
    of its own); FORGEKERNEL_MLA_OSTORE=0 keeps every plan on them."""
    seen = _launch_keys(monkeypatch)
    monkeypatch.delenv("FORGEKERNEL_MLA_OSTORE", raising=False)
    _decode(*problem)
    heads, qtokens, ostore = want
    assert (seen[0]["heads"], seen[0].get("qtokens", 1)) == (heads, qtokens)
    assert seen[0].get("ostore", False) == ostore and seen[0].get("direct", False) >= ostore
    if not ostore:
        return
    b, hq, _, s_q = problem
    buf = torch.empty(b * s_q * hq * 512 + 4, dtype=torch.bfloat16)
    for out, wide in ((buf[4:].view(b * s_q, hq, 512), False), (buf[:-4].view(-1, hq, 512), True)):
        seen.clear()
        _decode(*problem, out=out)
        assert seen[0]["direct"] and seen[0].get("ostore", False) == wide
    assert len(launch._plans) == 2  # aligned and not: two plans, each built once
    monkeypatch.setenv("FORGEKERNEL_MLA_OSTORE", "0")
    launch._plans.clear()
    seen.clear()
    _decode(*problem)
    assert seen[0]["direct"] and "ostore" not in seen[0]


def test_check_and_sanitize_cases_run_both_ostore_compiles(monkeypatch):
    """mla_decode's check cases, and its sanitize cases, reach the ostore compile of both blocks
    (`forgekernel check --sanitize mla_decode` is their compute-sanitizer run)."""
    from forgekernel.bench.suites import mla_decode as suite

    seen = _launch_keys(monkeypatch)
    monkeypatch.delenv("FORGEKERNEL_MLA_OSTORE", raising=False)

    def blocks(cases):
        found = set()
        for case in cases:
            p = case.params
            if suite.fp8(case) or p["page"] != 64 or "q_lens" in p:
                continue
            seen.clear()
            _decode(p["b"], p["hq"], list(p["lens"]), p["s_q"])
            found |= {(k["heads"], k.get("qtokens", 1)) for k in seen if k.get("ostore")}
        return found

    assert blocks(suite.CHECK_CASES) == set(config.OSTORE_BLOCKS)
    assert blocks(suite.SANITIZE_CASES) == set(config.OSTORE_BLOCKS)


# The default direct compile the ostore build is compared with: the bf16 64 x 1 block's alone.
# The f16 32 x 2 block (two query tokens a CTA, the other dtype) is checked on its ostore
# build's own counts (one bulk-copy loop, no 16-bit scalar store, no spills, its steady loops):
# the ostore epilogue is one code path (seesaw.py, `ostore`) for both blocks, whose moved and
# kept counts the 64 x 1 compare proves. One MLA compile fewer (~10 to 17 s of CI's CPU).
# The baseline stays in CI: a standard key (`_standard_params`' direct seesaw blocks, prebuilt:
# the pass of the 64 x 1 direct plans where out's rows are not 16-byte aligned or
# FORGEKERNEL_MLA_OSTORE=0; the scalar-store direct epilogue is every other direct block's
# default), and CI's only compile of a seesaw direct key without `ostore`.
OSTORE_BASELINE = ("bfloat16", 64, 1)
# (instructions, R2UR) of each warpgroup's steady pair loop (tests/cubins.py `steady_loops`),
# cu13 ptxas: the partial form's of the same block (64 x 1: 1013 / 828, R2UR 4 / 4; 32 x 2
# bf16: 1032 / 842, 20 / 16), where the default direct compile's (scalar stores) and the
# ostore one's before its rows went by bulk copies read 1136-1140 / 962-965 with 97 / 63-71
# R2UR (MLA_NOTES.md, "next/mla-ur")
OSTORE_LOOPS = {
    ("bfloat16", 64, 1): [(1013, 4), (828, 4)],
    ("float16", 32, 2): [(1033, 20), (846, 16)],
}


# CI: the baseline block; the f16 32 x 2 block is slow (~12 s of CI's CPU, 2026-12-06)
@pytest.mark.parametrize(
    "dtype, heads, qtokens",
    slow_past([("bfloat16", 64, 1), ("float16", 32, 2)], keep=OSTORE_BASELINE, unpack=True),
)
def test_ostore_compile(dtype, heads, qtokens):
    """One UBLKCP (warp 0's elected lane's loop over the rows), no 16-bit scalar store, the
    LSE's two STG.E; no spills; the steady pair loops the partial form's (OSTORE_LOOPS).
    Against the default direct compile of the block (OSTORE_BASELINE): its 128 STG.E.U16 a
    thread become the bulk copies, with 64 STS (bf16 pairs) more, one more BAR.SYNC and one
    more proxy fence; the mainloop's HGMMA and loads unchanged, its loops' R2UR traffic gone."""
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    from test_mla_seesaw_compile import _compiled, _loops

    key = {"tma": True, "direct": True}
    params = config.params_for("partial", dtype, heads, qtokens, **key, ostore=True)
    res, ops, _ = _compiled(params)
    assert res["spill_bytes"] == 0 and res["registers"] <= 240
    assert ops["STG.E.U16"] == 0 and ops["STG.E.128"] == 0 and ops["LDS.128"] == 0
    assert ops["UBLKCP.G.S"] == 1
    assert ops["STG.E"] == 2  # the LSE
    assert _loops(params) == OSTORE_LOOPS[(dtype, heads, qtokens)]
    if (dtype, heads, qtokens) != OSTORE_BASELINE:
        return
    params0 = config.params_for("partial", dtype, heads, qtokens, **key)
    res0, ops0, _ = _compiled(params0)
    assert ops0["STG.E.U16"] == 128 and ops0["UBLKCP.G.S"] == 0
    assert ops0["STG.E"] == 2
    assert ops["STS"] == ops0["STS"] + 64
    assert all(r2ur > 50 for _, r2ur in _loops(params0))  # (the scalar stores' form)

    def count(counts, prefix):
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    for op in ("HGMMA", "UTMALDG", "WARPGROUP.DEPBAR", "SYNCS.EXCH", "STSM"):
        assert count(ops, op) == count(ops0, op), op
    assert count(ops, "BAR.SYNC") == count(ops0, "BAR.SYNC") + 1
    assert count(ops, "FENCE.VIEW.ASYNC.S") == count(ops0, "FENCE.VIEW.ASYNC.S") + 1
