"""The sparse direct pass's `sink` and `fused` forms compiled for sm_90a on the CPU (cu13 ptxas,
cuobjdump) beside the plain direct form they extend (bf16, 16 heads a CTA): the figures
docs/attention/MLA_NOTES.md "The fused DSA prefill" quotes.

- sink: the plain form's registers (212), no spills; the epilogue gains the sigmoid's exp2 and
  reciprocal per row (2 MUFU.EX2 + 2 MUFU.RCP a thread), nothing else of the pass moves.
- fused (sink on, int64 positions): 211 registers, no spills, the same shared memory; the
  mainloop's WGMMAs, cp.async copies and stmatrix unchanged; q_pe's rotation 16 LDS.U16 +
  16 STS.U16 a thread behind one more barrier and proxy fence; the epilogue's 128 16-bit
  stores of O become 64 pair stores of e4m3 (64 F2FP.SATFINITE.E4M3 a thread), the 2 LSE
  stores gain the 16 scales', and 32 butterfly shuffles (2 per group and row) take the groups'
  amax."""

from __future__ import annotations

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.mla.sm90 import params_for  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

from test_mla_seesaw_compile import _compiled  # noqa: E402

PLAIN = params_for("sparse", "bfloat16", 16, direct=True)


def _count(ops, prefix: str) -> int:
    return sum(v for k, v in ops.items() if k.startswith(prefix))


def test_sink_form():
    res0, ops0, _ = _compiled(PLAIN)
    res, ops, _ = _compiled(params_for("sparse", "bfloat16", 16, direct=True, sink=True))
    assert res["spill_bytes"] == res0["spill_bytes"] == 0
    assert res["registers"] == res0["registers"] == 212
    assert ops["MUFU.EX2"] == ops0["MUFU.EX2"] + 2 and ops["MUFU.RCP"] == ops0["MUFU.RCP"] + 2
    for name in ("HGMMA", "LDGSTS", "BAR", "STSM", "LDS", "STS", "STG", "F2FP", "SHFL"):
        assert _count(ops, name) == _count(ops0, name), name


def test_fused_form():
    res0, ops0, _ = _compiled(PLAIN)
    res, ops, ptx = _compiled(params_for("sparse", "bfloat16", 16, direct=True, sink=True,
                                         fused=True, rope="float32", positions="int64"))
    assert res["spill_bytes"] == 0 and res["registers"] == 211
    assert res["smem_bytes"] == res0["smem_bytes"]
    for name in ("HGMMA", "LDGSTS", "STSM", "WARPGROUP"):
        assert _count(ops, name) == _count(ops0, name), name
    assert ops["LDS.U16"] == ops0.get("LDS.U16", 0) + 16  # q_pe's rotation, in place
    assert ops["STS.U16"] == ops0.get("STS.U16", 0) + 16
    assert _count(ops, "BAR.SYNC") == _count(ops0, "BAR.SYNC") + 1
    assert ops["F2FP.SATFINITE.E4M3.F32.PACK_AB_MERGE_C"] == 64  # 128 values a thread, pairs
    assert ops0["STG.E.U16"] == 128 and ops["STG.E.U16"] == 64
    assert ops0["STG.E"] == 2 and ops["STG.E"] == 2 + 16  # the LSE's, the 16 groups' scales
    assert ops["SHFL.BFLY"] == ops0["SHFL.BFLY"] + 32
    assert "cvt.rn.satfinite.e4m3x2.f32" in ptx and "div.rn.f32" in ptx
