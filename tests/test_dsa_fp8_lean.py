"""DSA's sparse pass over FlashMLA's FP8 cache in its `lean` form (candidate; decode.py
`_load_wg_staged`, MLA_NOTES.md "DSA FP8: the two gaps to FlashMLA, and the issue's chain") on
the CPU: its compile keys (keyed only when on, candidates only), the launcher's pick
(plan_form(lean=True), FORGEKERNEL_MLA_LEAN=1; 16-bit caches and the paged forms ignore it)
through the replay of the sparse pass against reference.dsa, the bench's variants, and its SASS
beside the standard compile's (cu13 ptxas, sm_90a): the same WGMMAs, barriers and copies, no
bulk-prefetch waterfall, the tile's loads issued before any prefetch, no spills. The same for the
sparse direct pass's `wide` form (O staged, 16-byte stores; plan_form(wide=True), the scalar
form where out's rows are not 16-byte aligned). The GPU's checks:
tests/gpu/test_dsa_fp8_lean_gpu.py."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from test_dsa_sparse import (
    LATENT,
    SCALE,
    _assert_close,
    _fp8_want,
    _problem,
    op,
)
from test_dsa_sparse import sparse_kernels as sparse_kernels  # noqa: F401  (the replay fixture)
from test_mla_decode import _fp8_cache

from forgekernel.bench.suites import dsa_sparse as suite
from forgekernel.kernels.attention.mla.sm90 import SPEC, lean_params, wide_params
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import FP8_DTYPE, params_for
from forgekernel.kernels.attention.mla.sm90.decode import Bar

# ---------------------------------------------------------------- keys and selection


def test_lean_is_keyed_only_when_on():
    base = params_for("sparse", FP8_DTYPE, 16, fp8=True, direct=True)
    lean = params_for("sparse", FP8_DTYPE, 16, fp8=True, direct=True, lean=True)
    assert dict(lean) == dict(base) | {"lean": True} and "lean" not in dict(base)
    for kwargs in ({"kind": "sparse", "fp8": False}, {"kind": "partial", "fp8": True}):
        kind = kwargs.pop("kind")
        with pytest.raises(ValueError, match="lean"):
            params_for(kind, FP8_DTYPE, 16, lean=True, **kwargs)
    assert not any(dict(p).get("lean") for p in SPEC.standard_params())
    candidates = [p for p in SPEC.candidate_params()
                  if dict(p).get("lean") and not dict(p).get("wide")]  # fmt: skip
    assert set(candidates) == set(lean_params()) and len(candidates) == len(lean_params())
    assert {(dict(p)["heads"], dict(p).get("direct", False), dict(p)["lean"])
            for p in candidates} == {
        (h, d, lean) for h in (16, 64) for d in (False, True) for lean in (True, 2)
    }  # fmt: skip
    assert sorted(candidates)  # one value type a key: the keys sort
    far = params_for("sparse", FP8_DTYPE, 16, fp8=True, lean="far")
    assert dict(far)["lean"] == 2 and far != params_for("sparse", FP8_DTYPE, 16, fp8=True,
                                                         lean=True)  # fmt: skip
    with pytest.raises(ValueError, match="lean must be"):
        params_for("sparse", FP8_DTYPE, 16, fp8=True, lean="near")


def test_lean_needs_the_sparse_fp8_pass():
    assert not mla_launch._lean("partial", True, (None, None, False, True, False, True))
    assert not mla_launch._lean("sparse", False, (None, None, False, True, False, True))
    assert mla_launch._lean("sparse", True, (None, None, False, True, False, True))
    assert not mla_launch._lean("sparse", True, mla_launch.SCHEDULED)  # five fields
    assert not mla_launch._lean("sparse", True, None)
    assert mla_launch._lean("sparse", True, (None, None, False, True, False, "far")) == "far"
    with pytest.raises(ValueError, match="lean must be"):
        with mla_launch.plan_form(lean="near"):
            pass


def _fp8_problem(tokens, hq, page_size, valid, topk, pad, seed=0):
    qn, qp, _, _, idx = _problem(tokens, hq, page_size, valid, topk, pad=pad, seed=seed)
    pages = max(-(-max(valid, default=1) // page_size), 1) + 3
    packed = _fp8_cache(pages, page_size, torch.Generator().manual_seed(seed + 5))
    return qn, qp, packed, idx


# (tokens, hq, page size, valid, topk, pad): split plans (1, 3, 5 tokens), one-split plans
# (128 tokens at 16 heads, 64 at 128), 24 heads (blocks of 8, compiled at the call)
LEAN_CASES = [
    (1, 16, 64, [2048], 2048, "end"),
    (3, 16, 1, [64, 0, 17], 64, "scattered"),
    (5, 128, 16, [1, 200, 0, 77, 130], 200, "end"),
    (128, 16, 64, [(7 * t) % 257 for t in range(128)], 256, "scattered"),
    (64, 128, 64, [(11 * t) % 257 for t in range(64)], 256, "scattered"),
    (3, 24, 16, [40, 3, 90], 100, "end"),
]


@pytest.mark.parametrize("lean", [True, "far"])
@pytest.mark.parametrize("case", LEAN_CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-p{c[2]}-k{c[4]}")
def test_plan_form_takes_the_lean_compile(sparse_kernels, case, lean):
    """plan_form(lean=True): every FP8 sparse call (split plans and one-split plans, direct or
    not) takes its plan's key with `lean`, keyed apart from the standard plan in one process
    (the call after it is the standard's again); the replayed result is the reference's and
    the standard's bit for bit (the form moves loads, not arithmetic)."""
    qn, qp, packed, idx = _fp8_problem(*case)
    out = torch.full((case[0], case[1], LATENT), float("nan"), dtype=qn.dtype)
    base, base_lse = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                             return_lse=True)  # fmt: skip
    with mla_launch.plan_form(lean=lean):
        got, lse = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                           out=out, return_lse=True)  # fmt: skip
    again, _ = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    want, want_lse = _fp8_want(qn, qp, packed, idx)
    assert got is out
    _assert_close(out, lse, want, want_lse, atol=2e-2 + float(want.abs().max()) * 2**-8)
    assert torch.equal(out, base) and torch.equal(lse, base_lse) and torch.equal(again, base)
    keys = [p for p, _ in sparse_kernels]
    n = len(keys) // 3
    assert all(not k.get("lean") for k in keys[:n] + keys[2 * n :])
    value = 2 if lean == "far" else True
    assert all(k.get("lean") == value and k["fp8"] for k in keys[n : 2 * n])
    assert [dict(k, lean=value) for k in keys[:n]] == keys[n : 2 * n]


def test_environment_switch(sparse_kernels, monkeypatch):
    """FORGEKERNEL_MLA_LEAN=1 (read when a plan is first built) takes the lean compile; a bad
    value raises; 16-bit caches ignore it."""
    qn, qp, packed, idx = _fp8_problem(*LEAN_CASES[1])
    monkeypatch.setenv("FORGEKERNEL_MLA_LEAN", "1")
    op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE)
    qn16, qp16, ckv, kpe, idx16 = _problem(3, 16, 16, [3, 50, 0], 64)
    op.dsa_sparse_attention(qn16, qp16, ckv, kpe, idx16, softmax_scale=SCALE)
    mla_launch._plans.clear()
    monkeypatch.setenv("FORGEKERNEL_MLA_LEAN", "far")
    op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE)
    assert [p.get("lean", False) for p, _ in sparse_kernels] == [True, False, 2]
    mla_launch._plans.clear()
    monkeypatch.setenv("FORGEKERNEL_MLA_LEAN", "yes")
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_LEAN"):
        op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE)


def test_bench_variants():
    """The suite's `lean` variant on the two weakest FP8 cases against FlashMLA, the median's
    case and t1 (the control), through plan_form(lean=True)."""
    named = {name for name, forms in suite.PLAN_FORMS.items() if "lean" in forms}
    assert named == {
        "t1-h16-p64-k2048-L32768-fp8", "t64-h16-p64-k2048-L32768-fp8",
        "t128-h16-p64-k2048-L32768-fp8", "t64-h128-p64-k2048-L8192-fp8",
    }  # fmt: skip
    assert all(suite.PLAN_FORMS[n]["lean"] == {"lean": True} for n in named)
    far = {name for name, forms in suite.PLAN_FORMS.items() if "lean_far" in forms}
    assert far == named - {"t1-h16-p64-k2048-L32768-fp8"}
    assert all(suite.PLAN_FORMS[n]["lean_far"] == {"lean": "far"} for n in far)


# ---------------------------------------------------------------- SASS

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
_LINE = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")


def _sass(params):
    from cubins import build

    found = build(SPEC, params)
    lines = [(int(m[1], 16), m[2]) for m in map(_LINE.search, found.sass.splitlines()) if m]
    return found.resources, Counter(_OP.findall(found.sass)), lines


def _after_stage_free(lines):
    """The instructions from warpgroup 1's STAGE_FREE wait to the first cp.async after it."""
    bar = f"BAR.SYNC.DEFER_BLOCKING {hex(int(Bar.STAGE_FREE))}, 0x100"
    start = next(i for i, (_, text) in enumerate(lines) if text == bar)
    end = next(i for i in range(start, len(lines)) if lines[i][1].startswith("LDGSTS"))
    return [text for _, text in lines[start:end]]


@pytest.mark.parametrize(("heads", "direct", "lean"),
                         [(16, True, True), (64, True, True), (16, False, True),
                          (16, True, "far")])  # fmt: skip
def test_lean_sass(heads, direct, lean):
    """The lean compile beside the standard one: the same WGMMAs, barriers, cp.async, shared
    memory traffic and dequantization; the bulk prefetch's waterfall (UBLKPF in a BRA.U.ANY
    loop, 32 trips a turn on warps 4, 5) replaced by 3 line prefetches a thread (CCTL.E.PF2)
    after the tile's commit; between STAGE_FREE and the tile's first cp.async no loop, no
    prefetch and no integer division (MUFU.RCP); registers within 4 of the standard's, no
    spills."""
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    base = params_for("sparse", FP8_DTYPE, heads, fp8=True, direct=direct)
    res0, ops0, lines0 = _sass(base)
    res, ops, lines = _sass(params_for("sparse", FP8_DTYPE, heads, fp8=True, direct=direct,
                                       lean=lean))  # fmt: skip
    assert res["spill_bytes"] == res0["spill_bytes"] == 0 and ops["STL"] == ops["LDL"] == 0
    assert res0["registers"] <= res["registers"] <= res0["registers"] + 4
    assert res["smem_bytes"] == res0["smem_bytes"]
    same = ("HGMMA.64", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE", "BAR.SYNC.DEFER_BLOCKING",
            "BAR.ARV", "LDGSTS.E.BYPASS.128", "LDG.E.128", "STSM", "LDGDEPBAR", "HMUL2.BF16_V2",
            "LDS.128", "STS.128")  # fmt: skip
    for name in same:
        assert ops[name] == ops0[name], name
    assert ops0["UBLKPF.L2"] == 2 and ops0["BRA.U.ANY"] >= 2  # the standard's waterfall
    sites = 3 if lean == "far" else 2  # the prologue's (tiles 2 [, 3]) and the loop's
    assert ops["UBLKPF.L2"] == 0 and ops["BRA.U.ANY"] == 0 and ops["CCTL.E.PF2"] == 3 * sites
    seg0, seg = _after_stage_free(lines0), _after_stage_free(lines)
    assert any(t.startswith("UBLKPF") for t in seg0) and any("MUFU.RCP" in t for t in seg0)
    assert not any(t.startswith(("UBLKPF", "CCTL", "MUFU")) or "BRA.U" in t for t in seg)
    assert sum(t.startswith("LDG.E ") for t in seg) >= 8  # the rows' entries, in one batch
    # the loop's prefetches follow its commit
    # the prefetches follow their commits: the prologue's (tile 2) warpgroup 1's first, the
    # loop's its loop's (the CTA's tile 0 the first commit)
    texts = [t for _, t in lines]
    commits = [i for i, t in enumerate(texts) if t == "LDGDEPBAR"]
    prefetches = [i for i, t in enumerate(texts) if t.startswith("CCTL.E.PF2")]
    assert len(commits) == 3 and commits[1] < prefetches[0]
    assert max(prefetches[:-3]) < commits[2] < min(prefetches[-3:])
    assert ops["MUFU.RCP"] < ops0["MUFU.RCP"]  # the RoPE rows and the prefetch's divisions


# ---------------------------------------------------------------- wide


def test_wide_keys():
    base = params_for("sparse", FP8_DTYPE, 64, fp8=True, direct=True)
    assert dict(params_for("sparse", FP8_DTYPE, 64, fp8=True, direct=True, wide=True)) == dict(
        base
    ) | {"wide": True}
    for kwargs in ({"direct": False}, {"direct": True, "fused": True, "rope": "float32",
                                       "positions": "int32"}):  # fmt: skip
        with pytest.raises(ValueError, match="wide"):
            params_for("sparse", FP8_DTYPE, 16, fp8=True, wide=True, **kwargs)
    with pytest.raises(ValueError, match="wide"):
        params_for("partial", "bfloat16", 16, direct=True, wide=True)
    assert not any(dict(p).get("wide") for p in SPEC.standard_params())
    wide = [p for p in SPEC.candidate_params() if dict(p).get("wide")]
    assert set(wide) == set(wide_params()) and len(wide) == 4
    with pytest.raises(ValueError, match="wide must be"):
        with mla_launch.plan_form(wide="yes"):
            pass


@pytest.mark.parametrize("case", [LEAN_CASES[3], LEAN_CASES[4]], ids=["t128-h16", "t64-h128"])
@pytest.mark.parametrize("lean", [False, True])
def test_plan_form_takes_the_wide_compile(sparse_kernels, case, lean):
    """plan_form(wide=True) on one-split plans: the direct key with `wide` (and `lean`), the
    reference's result, the standard's bits (the replay's direct form: the same rounding of the
    same fp32 products); an out whose rows are not 16-byte aligned takes the scalar direct form
    (keyed apart: `narrow`); split plans ignore it."""
    qn, qp, packed, idx = _fp8_problem(*case)
    tokens, hq = case[0], case[1]
    base, base_lse = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                             return_lse=True)  # fmt: skip
    out = torch.full((tokens, hq, LATENT), float("nan"), dtype=qn.dtype)
    odd = torch.full((tokens, hq, LATENT + 1), float("nan"), dtype=qn.dtype)[..., 1:]
    with mla_launch.plan_form(wide=True, lean=lean):
        got, lse = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                           out=out, return_lse=True)  # fmt: skip
        narrow, _ = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                            out=odd, return_lse=True)  # fmt: skip
    want, want_lse = _fp8_want(qn, qp, packed, idx)
    _assert_close(got, lse, want, want_lse, atol=2e-2 + float(want.abs().max()) * 2**-8)
    assert torch.equal(got, base) and torch.equal(lse, base_lse) and torch.equal(narrow, base)
    standard, wide, scalar = (p for p, _ in sparse_kernels)
    assert standard["direct"] and "wide" not in standard and "lean" not in standard
    assert wide == dict(standard, wide=True, **({"lean": True} if lean else {}))
    assert scalar == dict(standard, **({"lean": True} if lean else {}))


def test_wide_ignores_split_plans(sparse_kernels):
    qn, qp, packed, idx = _fp8_problem(*LEAN_CASES[0])  # 32 splits of one tile
    with mla_launch.plan_form(wide=True):
        op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE)
    ((params, _),) = sparse_kernels
    assert "wide" not in params and "direct" not in params


def test_wide_bench_variants():
    named = {name for name, forms in suite.PLAN_FORMS.items() if "wide" in forms}
    assert named == {"t128-h16-p64-k2048-L32768-fp8", "t64-h128-p64-k2048-L8192-fp8"}
    for name in named:
        assert suite.PLAN_FORMS[name]["wide"] == {"wide": True}
        assert suite.PLAN_FORMS[name]["lean_wide"] == {"lean": True, "wide": True}


@pytest.mark.parametrize(
    ("heads", "dtype", "fp8"),
    [(64, FP8_DTYPE, True), (16, FP8_DTYPE, True), (64, "float16", False)],
)
def test_wide_sass(heads, dtype, fp8):
    """The wide compile beside the standard direct one: the epilogue's 128 scalar 16-bit stores
    a thread become 16 STG.E.128 at 64 heads, 4 at 16 (rows past G: none; after the staging's
    32-bit shared stores and as many LDS.128), the
    LSE's two STG.E stay; the mainloop's WGMMAs, barriers (one __syncthreads more), copies and
    dequantization unchanged; registers within 4 of the standard's, no spills, the same dynamic
    shared memory (the staging lies over the K stages)."""
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    base = params_for("sparse", dtype, heads, fp8=fp8, direct=True)
    res0, ops0, _ = _sass(base)
    res, ops, _ = _sass(params_for("sparse", dtype, heads, fp8=fp8, direct=True, wide=True))
    assert res["spill_bytes"] == res0["spill_bytes"] == 0 and ops["STL"] == ops["LDL"] == 0
    assert res["registers"] <= res0["registers"] + 4 and res["smem_bytes"] == res0["smem_bytes"]
    assert ops0["STG.E.U16"] == 128 and ops["STG.E.U16"] == 0
    vectors = heads * (LATENT // 8) // 256  # a thread's 16-byte vectors of the G rows
    assert ops["STG.E.128"] == vectors and ops["STG.E"] == ops0["STG.E"] == 2
    assert ops["LDS.128"] == ops0["LDS.128"] + vectors
    assert ops["BAR.SYNC.DEFER_BLOCKING"] == ops0["BAR.SYNC.DEFER_BLOCKING"] + 1
    same = ("HGMMA.64", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR.LE", "BAR.ARV",
            "LDGSTS.E.BYPASS.128", "STSM.16.M88.4", "LDGDEPBAR", "HMUL2.BF16_V2")  # fmt: skip
    for name in same:
        assert ops[name] == ops0[name], name
