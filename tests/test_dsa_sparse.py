"""DeepSeek sparse attention (DSA) on the CPU (the GPU's checks: tests/gpu/test_dsa_gpu.py):
compile keys and the split plan of the MLA leaf's sparse mode; its algorithm (per split of each
token's top-k list, tiles of 64 list positions scored over the 576 latent + RoPE columns at once
with one running max per row, -1 entries and positions past the split masked, P rounded to q's
dtype before P V, the split's normalized O and log2 LSE, the paged leaf's combine) replayed in
Python through the real launcher and op against reference.dsa: page sizes 1 / 16 / 64, padding
at the end and scattered, rows of -1 only, 16 / 24 / 128 heads, FlashMLA's combined cache,
topk not a multiple of 64, FlashMLA's FP8 cache (the replay dequantizes as the kernel does,
tests/test_mla_decode.py's bit-level model); FlashInfer-Bench's adapter against the
definitions' reference by their criterion; argument errors; the suite's own check; the custom
op's fake under make_fx."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from split_combine import combine_splits
from test_mla_decode import _dequantize_rows, _fp8_cache, direct_then_split
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.bench.check import verify
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES, dsa_sparse
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import (
    FP8_ROW_BYTES,
    HEADS,
    ROWS,
    TILE,
    heads_per_cta,
    params_for,
    sparse_heads,
)
from forgekernel.reference.dsa import dsa_sparse_attention_paged_ref
from forgekernel.reference.dsa_flashinfer import (
    SPARSE_ATTENTION,
    sparse_attention_inputs,
)
from forgekernel.reference.dsa_flashinfer import (
    dsa_sparse_attention_flashinfer as flashinfer_ref,
)
from forgekernel.reference.mla import flashmla_fp8_views

op = importlib.import_module("forgekernel.ops.dsa")
SCALE = dsa_sparse.SOFTMAX_SCALE
LATENT, ROPE = 512, 64


# ---------------------------------------------------------------- configuration


def test_sparse_compile_keys():
    """Kind "sparse": dtype and heads per CTA only; prebuilt for both dtypes and every heads
    per CTA dividing 16 and 128 (TP8 / TP1) and each one's own block, each in its partial
    and its direct form (`direct`: a plan of one split); one query token per CTA."""
    assert dict(params_for("sparse", "bfloat16", 16)) == {
        "kind": "sparse", "dtype": "bfloat16", "heads": 16,
    }  # fmt: skip
    assert dict(params_for("sparse", "bfloat16", 16, fp8=True, direct=True)) == {
        "kind": "sparse", "dtype": "bfloat16", "heads": 16, "fp8": True, "direct": True,
    }  # fmt: skip
    assert sparse_heads() == (*(h for h in HEADS if 16 % h == 0 and 128 % h == 0), 64)
    sparse = {p for p in SPEC.standard_params() if dict(p)["kind"] == "sparse"}
    forms = [("float16", False), ("bfloat16", False), ("bfloat16", True)]
    # over an FP8 cache the `lean` form at 16 heads and on 64-head direct plans, the 64-head
    # direct one also `wide` (test_dsa_fp8_lean.py)
    plain = {p for p in sparse if not dict(p).get("sink") and not dict(p).get("fused")}
    assert plain == {params_for("sparse", d, h, fp8=fp8, direct=direct,
                                lean=fp8 and (h == 16 or h == 64 and direct))
                     for d, fp8 in forms for h in sparse_heads()
                     for direct in (False, True)} | {
        params_for("sparse", "bfloat16", 64, fp8=True, direct=True, lean=True, wide=True)
    }  # fmt: skip
    # the sink form (keyed only when on) of every sparse direct compile
    sink = {p for p in sparse if dict(p).get("sink") and not dict(p).get("fused")}
    assert sink == {params_for("sparse", d, h, fp8=fp8, direct=True, sink=True,
                               lean=fp8 and h in (16, 64))
                    for d, fp8 in forms for h in sparse_heads()} | {
        params_for("sparse", "bfloat16", 64, fp8=True, direct=True, sink=True, lean=True,
                   wide=True)
    }  # fmt: skip
    # the fused prefill's (test_dsa_fused_prefill): 16-bit 16, over the FP8 cache 8
    assert len(sparse - plain - sink) == 24
    with pytest.raises(ValueError, match="sparse direct"):
        params_for("sparse", "bfloat16", 16, sink=True)
    with pytest.raises(ValueError, match="ostore"):
        params_for("sparse", "bfloat16", 16, direct=True, ostore=True)
    assert heads_per_cta(16) in sparse_heads() and heads_per_cta(128) in sparse_heads()
    with pytest.raises(ValueError, match="one query token"):
        params_for("sparse", "bfloat16", 8, 2)
    with pytest.raises(ValueError, match="kind"):
        params_for("dense", "bfloat16")


@pytest.mark.parametrize(("tokens", "hq", "topk"), [(1, 16, 2048), (64, 16, 2048), (1, 128, 2048),
                                                    (4096, 16, 2048), (3, 16, 100)])  # fmt: skip
def test_split_plan_covers_the_list(tokens, hq, topk):
    """Units are tokens x head blocks, the keys a token's top-k list in whole tiles; one token
    takes a split a tile (a sparse split's cost is its rows: no paged bound)."""
    splits, per = mla_launch.sparse_split_plan(tokens, hq // heads_per_cta(hq), topk, 132, 1)
    assert splits * per >= topk and (splits - 1) * per < topk and per % TILE == 0
    if tokens == 1:
        assert per == TILE


# ---------------------------------------------------------------- the kernel, replayed


def _sparse_partial(
    qn, qp, ckv, kpe, ckv_scale, idx, seq, op_, lp, scale_log2, per, page_size, cu, causal,
    q_blocks, direct=False, sink=False,
):  # fmt: skip
    """The sparse partial pass (decode.py, sparse=True) of every CTA (split, head block, token)
    at once: a row's arithmetic does not depend on its head block. Per split, list positions
    [t0, t1) in tiles of TILE, each tile's positions clamped to t1 - 1 and its entries to >= 0
    for the loads (page entry // page_size, slot entry % page_size), scored over all 576
    columns at once with one running max per (token, head) row, positions >= t1 and entries
    < 0 masked; P in q's dtype before P V. FP8 (ckv_scale given): the latent rows dequantized
    into bf16 as the kernel does. The split's O x 1 / sum and log2 LSE in fp32: the partials
    op_ / lp, or in the direct form (op_ out (tokens, Hq, 512) in q's dtype, lp the natural
    lse; one split, per covering the list) O rounded to q's dtype and the LSE x ln 2, as
    `_write_split` writes them; sink (the direct form's `sink` compile, attn_sink fp32 (Hq,) in
    seq's slot): O x sigmoid(lse - sink) before the rounding, a row that saw no key 0."""
    assert (seq is not None) == sink and cu is None and causal == 0 and q_blocks == 1
    assert direct or not sink
    tokens, topk = idx.shape
    if direct:
        assert op_.dtype == qn.dtype and op_.shape == (*qn.shape[:2], LATENT)
        assert lp.dtype == torch.float32 and lp.shape == qn.shape[:2] and per >= topk
    q = torch.cat([qn, qp], -1).double()
    for s in range(1 if direct else op_.shape[0]):
        t0, t1 = s * per, min(s * per + per, topk)
        m = torch.full(qn.shape[:2], -math.inf, dtype=torch.float64)
        lsum = torch.zeros(qn.shape[:2], dtype=torch.float64)
        o = torch.zeros(*qn.shape[:2], LATENT, dtype=torch.float64)
        for first in range(t0, t1, TILE):
            pos = torch.arange(first, first + TILE)
            entry = idx[:, pos.clamp(max=t1 - 1)].long()
            safe = entry.clamp(min=0)
            page, slot = safe // page_size, safe % page_size
            latent = ckv[page, slot]
            if ckv_scale is not None:
                latent = _dequantize_rows(latent, ckv_scale[page, slot])
            keys = torch.cat([latent, kpe[page, slot]], -1).double()  # (T, TILE, 576)
            sc = torch.einsum("thd,tkd->thk", q, keys)
            valid = (pos < t1)[None, :] & (entry >= 0)
            sc = torch.where(valid[:, None, :], sc, -math.inf)
            m_new = torch.maximum(m, sc.amax(-1))
            base = torch.where(m_new > -math.inf, m_new * scale_log2, 0.0)
            corr = torch.exp2(m * scale_log2 - base)
            p = torch.exp2(sc * scale_log2 - base[..., None])
            lsum = lsum * corr + p.sum(-1)
            pv = torch.einsum("thk,tkd->thd", p.to(qn.dtype).double(), keys[..., :LATENT])
            o = o * corr[..., None] + pv
            m = m_new
        seen = lsum > 0
        o_s = torch.where(seen[..., None], o / torch.where(seen, lsum, 1.0)[..., None], 0.0)
        lse_s = torch.where(seen, m * scale_log2 + torch.log2(lsum), -math.inf).float()
        if sink:
            lse_nat = lse_s.double() * math.log(2)
            weight = torch.where(seen, torch.sigmoid(lse_nat - seq.double()[None, :]), 0.0)
            o_s = o_s * weight[..., None]
        if direct:
            op_.copy_(o_s.float().to(op_.dtype))
            lp.copy_(lse_s * math.log(2))
        else:
            op_[s], lp[s] = o_s, lse_s


class _Calls(list):
    """The sparse pass's calls' (params, args), and the combine's launches (`combines`)."""

    combines = 0


@pytest.fixture
def sparse_kernels(monkeypatch):
    """The launcher's kernels replaced by the replay; the sparse calls' (params, args)."""
    calls = _Calls()

    def combine(*args):
        calls.combines += 1
        combine_splits(*args)

    def get_kernel(spec, params):
        assert spec is SPEC
        p = dict(params)
        if p["kind"] == "combine":  # the CTA or the warp form (called alike)
            assert params == params_for("combine", p["dtype"], warps=p.get("form") == "warps")
            return combine
        assert p["kind"] == "sparse" and p["heads"] * 1 <= ROWS and "pdl" not in p

        def partial(*args):
            assert args[0].dtype == getattr(torch, p["dtype"]) and len(args) == 15
            assert args[5].dtype == torch.int32 and args[5].stride(-1) == 1
            fp8 = p.get("fp8", False)
            assert (args[4] is not None) == fp8 and (args[2].dtype == torch.uint8) == fp8
            calls.append((p, args))
            _sparse_partial(*args, direct=p.get("direct", False), sink=p.get("sink", False))

        return partial

    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    yield calls
    mla_launch._plans.clear()


def _problem(tokens, hq, page_size, valid, topk, *, pad="end", combined=False,
             dtype=torch.bfloat16, seed=0):  # fmt: skip
    """Random q and caches; row t lists valid[t] distinct random slots, -1 after them ("end")
    or anywhere ("scattered")."""
    g = torch.Generator().manual_seed(seed)
    pages = max(-(-max(valid, default=1) // page_size), 1) + 3
    slots = pages * page_size
    if combined:
        ckv, kpe = torch.randn(pages, page_size, 1, LATENT + ROPE, generator=g).to(dtype), None
    else:
        ckv = torch.randn(pages, page_size, LATENT, generator=g).to(dtype)
        kpe = torch.randn(pages, page_size, ROPE, generator=g).to(dtype)
    idx = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t, n in enumerate(valid):
        where = torch.randperm(topk, generator=g)[:n] if pad == "scattered" else torch.arange(n)
        idx[t, where] = torch.randperm(slots, generator=g)[:n].int()
    qn = torch.randn(tokens, hq, LATENT, generator=g).to(dtype)
    qp = torch.randn(tokens, hq, ROPE, generator=g).to(dtype)
    return qn, qp, ckv, kpe, idx


def _want(qn, qp, ckv, kpe, idx):
    kv = ckv if kpe is None else torch.cat([ckv, kpe], -1)
    return dsa_sparse_attention_paged_ref(torch.cat([qn, qp], -1), kv, idx, SCALE)


def _assert_close(out, lse, want, want_lse, atol=2e-2):
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert float((out.float() - want).abs().max()) < atol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float(torch.where(finite, lse - want_lse, 0.0).abs().max()) < 1e-4


@pytest.mark.parametrize(
    ("tokens", "hq", "page_size", "valid", "topk", "pad", "combined", "dtype"),
    [
        (1, 16, 64, [2048], 2048, "end", True, torch.bfloat16),
        (3, 16, 1, [64, 0, 17], 64, "scattered", False, torch.float16),
        (5, 16, 16, [1, 200, 0, 77, 130], 200, "end", False, torch.bfloat16),
        (4, 16, 64, [300, 1000, 2, 0], 1000, "scattered", True, torch.float16),
        (2, 128, 64, [65, 513], 600, "scattered", True, torch.bfloat16),
        (3, 24, 16, [40, 3, 90], 100, "end", False, torch.bfloat16),
        (33, 16, 1, list(range(0, 33 * 3, 3)), 96, "scattered", False, torch.bfloat16),
        (2, 16, 64, [0, 0], 64, "end", False, torch.bfloat16),
    ],
)
def test_sparse_matches_the_reference(sparse_kernels, tokens, hq, page_size, valid, topk, pad,
                                      combined, dtype):  # fmt: skip
    qn, qp, ckv, kpe, idx = _problem(tokens, hq, page_size, valid, topk, pad=pad,
                                     combined=combined, dtype=dtype)  # fmt: skip
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    want, want_lse = _want(qn, qp, ckv, kpe, idx)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (tokens, hq)
    _assert_close(out, lse, want, want_lse)
    empty = torch.tensor([n == 0 for n in valid])
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    params, args = sparse_kernels[-1]
    splits, want_per = mla_launch.sparse_split_plan(tokens, hq // heads_per_cta(hq), topk, 132, 1)
    assert params == dict(params_for("sparse", str(dtype).removeprefix("torch."),
                                     heads_per_cta(hq), direct=splits == 1))  # fmt: skip
    scale_log2, per, ps = args[9:12]
    assert abs(scale_log2 - SCALE * math.log2(math.e)) < 1e-9 and ps == page_size
    assert per == want_per and sparse_kernels.combines == (splits > 1)
    assert args[7].shape == ((tokens, hq, LATENT) if splits == 1 else (splits, tokens, hq, LATENT))


def test_splits_of_a_long_list(sparse_kernels):
    """One token, topk 2048: 32 splits of a tile, the last eight all padding."""
    qn, qp, ckv, kpe, idx = _problem(1, 16, 64, [1500], 2048, pad="end")
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    _assert_close(out, lse, *_want(qn, qp, ckv, kpe, idx))
    _, args = sparse_kernels[-1]
    assert args[10] == TILE and args[7].shape[0] == 32
    assert torch.all(torch.isneginf(args[8][24:]))  # splits past the valid entries saw no key
    assert not torch.any(torch.isneginf(args[8][:24]))


@pytest.mark.parametrize(
    ("tokens", "hq", "valid", "topk", "sinks"),
    [
        (128, 16, [(7 * t) % 129 for t in range(128)], 128, "finite"),  # one split: the kernel
        (130, 24, [(5 * t) % 71 for t in range(130)], 70, "mixed"),  # 8-head blocks, +-inf
        (1, 16, [1500], 2048, "finite"),  # 32 splits: apply_sink after the combine
        (3, 16, [64, 0, 17], 64, "mixed"),  # splits, an empty row
    ],
)
def test_sink_in_the_kernel_or_after_the_combine(sparse_kernels, tokens, hq, valid, topk, sinks):
    """attn_sink: a direct plan's pass applies it (its `sink` compile, the sink in seqlens_k's
    slot; no torch pass after), a split plan's caller after the combine (apply_sink); both give
    the reference's out (the sink in the denominator) and its KV-only LSE; an empty row stays
    0 / -inf under a -inf sink."""
    qn, qp, ckv, kpe, idx = _problem(tokens, hq, 16, valid, topk, pad="scattered")
    g = torch.Generator().manual_seed(3)
    attn_sink = torch.randn(hq, generator=g)
    if sinks == "mixed":
        attn_sink[0], attn_sink[1] = -math.inf, math.inf
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       attn_sink=attn_sink, return_lse=True)  # fmt: skip
    kv = torch.cat([ckv, kpe], -1)
    want, want_lse = dsa_sparse_attention_paged_ref(torch.cat([qn, qp], -1), kv, idx, SCALE,
                                                    attn_sink=attn_sink)  # fmt: skip
    _assert_close(out, lse, want, want_lse)
    params, args = sparse_kernels[-1]
    splits, _ = mla_launch.sparse_split_plan(tokens, hq // heads_per_cta(hq), topk, 132, 1)
    assert params.get("sink", False) == (splits == 1) == params.get("direct", False)
    if splits == 1:
        assert torch.equal(args[6], attn_sink)
    else:
        assert args[6] is None
    assert sparse_kernels.combines == (splits > 1)
    if sinks == "mixed":
        assert torch.all(out[:, 1] == 0)


@pytest.mark.parametrize("per_tiles", [1, 2, 16])
def test_plan_form_sets_the_positions_a_split(sparse_kernels, per_tiles):
    """launch.plan_form(per_tiles=) on the sparse plan (the bench's variants): per_tiles x TILE
    top-k positions a split, the list's width over them; the output the reference's."""
    from forgekernel.kernels.attention.mla.sm90.config import TILE

    qn, qp, ckv, kpe, idx = _problem(1, 16, 64, [1500], 2048, pad="end")
    with mla_launch.plan_form(per_tiles=per_tiles):
        out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                           return_lse=True)  # fmt: skip
    _assert_close(out, lse, *_want(qn, qp, ckv, kpe, idx))
    _, args = sparse_kernels[-1]
    assert args[10] == per_tiles * TILE and args[7].shape[0] == 2048 // (per_tiles * TILE)


# plans of one split (sparse_split_plan at 132 SMs): the bench's t128-h16 and t64-h128 shapes
# (topk 256 here: 4 tiles; 2048 gives the same one split), a prefill's 24-head blocks of 8, two
# tokens of one tile; FP8 (packed FlashMLA rows) and 16-bit caches
DIRECT_CASES = [
    # (tokens, hq, page size, valid, topk, pad, cache)
    (128, 16, 64, [(7 * t) % 257 for t in range(128)], 256, "scattered", "fp8"),
    (128, 16, 1, [(5 * t) % 250 for t in range(128)], 250, "end", "split"),
    (64, 128, 64, [(11 * t) % 257 for t in range(64)], 256, "scattered", "fp8"),
    (64, 128, 16, [(3 * t) % 200 for t in range(64)], 200, "end", "combined"),
    (48, 24, 16, [(13 * t) % 130 for t in range(48)], 130, "scattered", "fp8"),
    (2, 16, 64, [0, 40], 64, "end", "combined"),
]


def _direct_problem(tokens, hq, page_size, valid, topk, pad, cache):
    """A DIRECT_CASES problem: (q_nope, q_pe, ckv, kpe or None, idx, reference (out, lse))."""
    qn, qp, ckv, kpe, idx = _problem(tokens, hq, page_size, valid, topk, pad=pad,
                                     combined=cache == "combined", seed=tokens + hq)  # fmt: skip
    if cache == "fp8":
        pages = max(-(-max(valid) // page_size), 1) + 3
        ckv, kpe = _fp8_cache(pages, page_size, torch.Generator().manual_seed(3)), None
        return qn, qp, ckv, kpe, idx, _fp8_want(qn, qp, ckv, idx)
    return qn, qp, ckv, kpe, idx, _want(qn, qp, ckv, kpe, idx)


@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: f"t{c[0]}-h{c[1]}-p{c[2]}-{c[6]}")
def test_direct_form_is_the_combine_of_one_split(sparse_kernels, monkeypatch, case):
    """A plan of one split runs the sparse pass's direct form: one launch writing the caller's
    NaN-poisoned out and the lse (no partials allocated, no combine), the reference's result,
    rows listing no slot 0 / -inf; and the same bits as the partial pass + the combine of the
    same one-split plan (FORGEKERNEL_MLA_DIRECT=0): O equal, LSE equal (both the split's fp32
    log2 LSE x ln 2)."""
    tokens, hq, _, valid, topk, _, cache = case
    qn, qp, ckv, kpe, idx, (want, want_lse) = _direct_problem(*case)
    splits, _ = mla_launch.sparse_split_plan(tokens, hq // heads_per_cta(hq), topk, 132, 1)
    assert splits == 1

    def call():
        out = torch.full((tokens, hq, LATENT), float("nan"), dtype=qn.dtype)
        got, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE, out=out,
                                           return_lse=True)  # fmt: skip
        assert got is out
        return out, lse

    results = direct_then_split(monkeypatch, call)
    assert sparse_kernels.combines == 1  # the partial run's alone
    (direct, _), (split, _) = sparse_kernels
    heads, fp8 = heads_per_cta(hq), cache == "fp8"
    # over an FP8 cache the lean form at 16 / 64 heads, wide with it at 64 (test_dsa_fp8_lean)
    lean = fp8 and heads in (16, 64)
    assert direct == dict(params_for("sparse", "bfloat16", heads, fp8=fp8, direct=True,
                                     lean=lean, wide=lean and heads == 64))  # fmt: skip
    assert "direct" not in split
    (out, lse), (split_out, split_lse) = results
    atol = 2e-2 + (float(want.abs().max()) * 2**-8 if cache == "fp8" else 0.0)
    _assert_close(out, lse, want, want_lse, atol=atol)
    empty = torch.tensor([n == 0 for n in valid])
    assert torch.all(out[empty] == 0) and torch.all(torch.isneginf(lse[empty]))
    assert torch.equal(out, split_out) and torch.equal(lse, split_lse)


def test_two_splits_keep_the_combine(sparse_kernels):
    """plan_form(per_tiles=2) on a one-split problem (t128-h16, 4 tiles): two splits, the
    partial pass and the combine, both the reference's result (the same math, another order of
    the sums)."""
    qn, qp, ckv, kpe, idx, (want, want_lse) = _direct_problem(*DIRECT_CASES[0])
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    with mla_launch.plan_form(per_tiles=2):
        split_out, split_lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx,
                                                       softmax_scale=SCALE,
                                                       return_lse=True)  # fmt: skip
    (direct, _), (split, args) = sparse_kernels
    assert direct.get("direct") and "direct" not in split and sparse_kernels.combines == 1
    assert args[7].shape == (2, 128, 16, LATENT) and args[10] == 2 * TILE
    atol = 2e-2 + float(want.abs().max()) * 2**-8  # (FP8 rows: values up to ~10, bf16 out)
    _assert_close(out, lse, want, want_lse, atol=atol)
    _assert_close(split_out, split_lse, want, want_lse, atol=atol)
    assert float((out.float() - split_out.float()).abs().max()) <= 2 * atol


def test_plan_form_without_the_direct_form(sparse_kernels):
    """plan_form(direct=False) (the bench's split1 variants): a one-split plan on the partial
    pass + the combine, keyed apart from the standard plan in one process; the same bits as
    the direct form."""
    qn, qp, ckv, kpe, idx, _ = _direct_problem(*DIRECT_CASES[2])
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    with mla_launch.plan_form(direct=False):
        split_out, split_lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx,
                                                       softmax_scale=SCALE,
                                                       return_lse=True)  # fmt: skip
    again, _ = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    assert [p.get("direct", False) for p, _ in sparse_kernels] == [True, False, True]
    assert sparse_kernels.combines == 1 and sparse_kernels[1][1][7].shape[0] == 1
    assert torch.equal(out, split_out) and torch.equal(lse, split_lse)
    assert torch.equal(out, again)


def test_direct_epilogue_is_the_kernels():
    """The replays' direct form is decode.py's `_write_split` direct branch: O x 1 / sum (fp32)
    rounded to out's dtype at (q_off + token, head, column), the LSE (log2) x LN2 from
    warpgroup 0's quad leaders; the partial branch's fp32 stores as before; the grid's one
    split (z 1, not the partials' leading mode)."""
    import inspect

    from forgekernel.kernels.attention.mla.sm90 import decode

    src = inspect.getsource(decode.MlaDecodeSm90._write_split)
    direct, partial = src.split("                else:\n")
    assert "if const_expr(self.direct):" in direct
    assert "value = (o[r, c] * inv).to(mOp.element_type)" in direct
    assert "mOp[q_off + token, head, o_crd[r, c][1]] = value" in direct
    assert "mLp[q_off + token, head] = lse * LN2" in direct
    assert "mOp[split, q_off + token, head, o_crd[r, c][1]] = o[r, c] * inv" in partial
    assert "mLp[split, q_off + token, head] = lse" in partial
    call = inspect.getsource(decode.MlaDecodeSm90.__call__)
    assert "1 if const_expr(self.direct) else mOp.shape[0]" in call


# slow, all three (the 16-bit 64-head sparse and the paged FP8 passes ~18 s of CI's CPU,
# 2026-12-06): CI's case until 2026-12-07, the FP8 16-head sparse pair, is two candidates (the
# form before `lean`, `was_params`: FP8 at 16 heads is `lean` in every standard key), ~4.5 s of
# an idle CPU for its split build (its direct one is test_dsa_fp8_lean's `lean` compare base).
# The direct epilogue's stores stay checked in CI on a standard key: test_dsa_fused_prefill_compile
# test_fused_form's plain direct pass (128 STG.E.U16 and the LSE's 2 STG.E a thread)
@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind", "dtype", "heads", "fp8"),
    [("sparse", "bfloat16", 16, True), ("sparse", "float16", 64, False),
     ("partial", "bfloat16", 16, True)],
)  # fmt: skip
def test_direct_compile(kind, dtype, heads, fp8):
    """decode.py's direct form against its partial form (cu13 ptxas, sm_90a): the same
    registers (229 FP8, 212 16-bit sparse; 248 the paged FP8 pass), no spills; its epilogue's
    128 fp32 STG.E a thread become 128 STG.E.U16 after one F2FP each, the LSE's two STG.E
    stay; the mainloop's WGMMAs, barriers, copies and shared-memory accesses unchanged."""
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    from test_mla_seesaw_compile import _compiled

    res0, ops0, _ = _compiled(params_for(kind, dtype, heads, fp8=fp8))
    res, ops, _ = _compiled(params_for(kind, dtype, heads, fp8=fp8, direct=True))
    assert res["spill_bytes"] == res0["spill_bytes"] == 0
    assert res["registers"] == res0["registers"] <= 255
    assert ops0["STG.E"] == 130 and ops0["STG.E.U16"] == 0
    assert ops["STG.E"] == 2 and ops["STG.E.U16"] == 128
    f2fp = "F2FP.BF16.F32.PACK_AB" if dtype == "bfloat16" else "F2FP.F16.F32.PACK_AB"
    assert ops[f2fp] == ops0[f2fp] + 128

    def count(counts, prefix):
        return sum(v for k, v in counts.items() if k.startswith(prefix))

    for op_name in ("HGMMA", "WARPGROUP", "BAR", "LDGSTS", "LDG", "STSM", "LDS", "STS", "MUFU"):
        assert count(ops, op_name) == count(ops0, op_name), op_name


def _fp8_want(qn, qp, packed, idx):
    """reference.dsa on the FP8 cache dequantized in fp32 (e4m3 x its tile scales)."""
    q8, scale, rope = flashmla_fp8_views(packed)
    latent = q8.float() * scale.repeat_interleave(128, -1)
    kv = torch.cat([latent, rope.float()], -1)
    return dsa_sparse_attention_paged_ref(torch.cat([qn, qp], -1), kv, idx, SCALE)


@pytest.mark.parametrize(
    ("tokens", "hq", "page_size", "valid", "topk", "pad", "form"),
    [
        (1, 16, 64, [2048], 2048, "end", {}),
        (3, 16, 1, [64, 0, 17], 64, "scattered", {"as_bytes": True}),
        (4, 16, 64, [300, 1000, 2, 0], 1000, "scattered", {"padded": True}),
        (2, 128, 16, [65, 513], 600, "scattered", {}),
        (3, 24, 16, [40, 3, 90], 100, "end", {"as_bytes": True, "padded": True}),
    ],
)
def test_fp8_sparse_matches_the_reference(sparse_kernels, tokens, hq, page_size, valid, topk,
                                          pad, form):  # fmt: skip
    """FlashMLA's FP8 cache (DeepSeek-V3.2's serving format; e4m3 or bytes, pages packed or
    padded): the fp8 compile of the sparse pass against reference.dsa on the dequantized
    latent."""
    qn, qp, _, _, idx = _problem(tokens, hq, page_size, valid, topk, pad=pad)
    pages = max(-(-max(valid, default=1) // page_size), 1) + 3
    packed = _fp8_cache(pages, page_size, torch.Generator().manual_seed(11), **form)
    out, lse = op.dsa_sparse_attention(qn, qp, packed, None, idx, softmax_scale=SCALE,
                                       return_lse=True)  # fmt: skip
    want, want_lse = _fp8_want(qn, qp, packed, idx)
    _assert_close(out, lse, want, want_lse, atol=2e-2 + float(want.abs().max()) * 2**-8)
    params, _ = sparse_kernels[-1]
    assert params["fp8"] and params["dtype"] == "bfloat16"


def test_out_is_written_in_place(sparse_kernels):
    """A NaN-poisoned out is the result, every element written; an out whose rows are not
    contiguous gets the result copied in."""
    qn, qp, ckv, kpe, idx = _problem(3, 16, 16, [5, 0, 70], 80, combined=True)
    want, _ = _want(qn, qp, ckv, kpe, idx)
    out = torch.full((3, 16, LATENT), float("nan"), dtype=qn.dtype)
    got = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE, out=out)
    assert got is out and float((out.float() - want).abs().max()) < 2e-2
    wide = torch.full((16, 3, LATENT * 2), float("nan"), dtype=qn.dtype)
    for view in (wide.transpose(0, 1)[..., :LATENT], wide.transpose(0, 1)[..., ::2]):
        got = op.dsa_sparse_attention(qn, qp, ckv, kpe, idx, softmax_scale=SCALE, out=view)
        assert got is view and float((view.float() - want).abs().max()) < 2e-2


def test_no_entries_or_no_tokens(sparse_kernels):
    """topk 0: every row 0 / -inf without a kernel; no tokens: empty outputs."""
    qn, qp, ckv, kpe, _ = _problem(2, 16, 16, [1, 1], 64)
    out, lse = op.dsa_sparse_attention(qn, qp, ckv, kpe, torch.zeros(2, 0, dtype=torch.int32),
                                       softmax_scale=SCALE, return_lse=True)  # fmt: skip
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse)) and not sparse_kernels
    out, lse = op.dsa_sparse_attention(qn[:0], qp[:0], ckv, kpe,
                                       torch.zeros(0, 64, dtype=torch.int32),
                                       softmax_scale=SCALE, return_lse=True)  # fmt: skip
    assert out.shape == (0, 16, LATENT) and lse.shape == (0, 16) and not sparse_kernels


@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_bench_adapter(sparse_kernels, page_size):
    """FlashInfer-Bench's definition's inputs as they are (topk 2048, valid entries scattered,
    an empty row): against reference.dsa's run of them, and the definition's own reference by
    its benchmark's criterion."""
    g = torch.Generator().manual_seed(5)
    inputs = sparse_attention_inputs(page_size, -(-3000 // page_size), [2048, 1, 0, 700],
                                     generator=g)  # fmt: skip
    out, lse = op.dsa_sparse_attention_flashinfer(**inputs)
    want, want_lse = flashinfer_ref(**inputs)
    assert out.dtype == torch.bfloat16 and out.shape == (4, 16, LATENT) and lse.shape == (4, 16)
    _assert_close(out, lse, want, want_lse, atol=2e-2)
    name = f"dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{page_size}"
    assert name in SPARSE_ATTENTION
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    defs.check_inputs(defn, inputs)
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(lse, theirs_lse) == 0
    ours_out, ours_lse = defs.run_kernel(defn, inputs)  # by op_type: the same adapter
    assert torch.equal(ours_out, out) and torch.equal(ours_lse, lse)


# ---------------------------------------------------------------- arguments


def _args(**change):
    bf = torch.bfloat16
    args = {
        "q_nope": torch.randn(2, 16, LATENT).to(bf),
        "q_pe": torch.randn(2, 16, ROPE).to(bf),
        "ckv_cache": torch.randn(10, 16, LATENT).to(bf),
        "kpe_cache": torch.randn(10, 16, ROPE).to(bf),
        "sparse_indices": torch.zeros(2, 64, dtype=torch.int32),
    }
    kwargs = {"softmax_scale": SCALE}
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    return args, kwargs


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"q_nope": torch.zeros(2, 16, 256, dtype=torch.bfloat16)}, ValueError, "512"),
        ({"q_nope": torch.zeros(2, 1, 16, 512, dtype=torch.bfloat16)}, ValueError, "tokens, H"),
        ({"q_pe": torch.zeros(2, 16, 64)}, TypeError, "q_pe must have dtype"),
        ({"q_pe": torch.zeros(2, 8, 64, dtype=torch.bfloat16)}, ValueError, "q_pe"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float16)}, TypeError, "ckv_cache"),
        ({"kpe_cache": torch.zeros(10, 8, 64, dtype=torch.bfloat16)}, ValueError, "kpe_cache"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float8_e4m3fn)}, NotImplementedError,
         "16-bit only"),
        ({"kpe_cache": torch.zeros(10, 16, 64, dtype=torch.float8_e5m2)}, NotImplementedError,
         "FP8 latent cache is FlashMLA's"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 576, dtype=torch.uint8), "kpe_cache": None},
         NotImplementedError, "per-tensor scale"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 640, dtype=torch.float8_e4m3fn), "kpe_cache": None},
         ValueError, "1, 656"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.int8), "kpe_cache": None},
         TypeError, "float8_e4m3fn or uint8"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 1320, dtype=torch.uint8)[..., :656],
          "kpe_cache": None}, ValueError, "multiples of 16 bytes"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.uint8), "kpe_cache": None,
          "q_nope": torch.zeros(2, 16, 512, dtype=torch.float16),
          "q_pe": torch.zeros(2, 16, 64, dtype=torch.float16)}, TypeError, "bf16 queries"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 512, dtype=torch.bfloat16), "kpe_cache": None},
         ValueError, "combined"),
        ({"sparse_indices": torch.zeros(2, 64, dtype=torch.int64)}, TypeError, "sparse_indices"),
        ({"sparse_indices": torch.zeros(3, 64, dtype=torch.int32)}, ValueError, "tokens = 2"),
        ({"sparse_indices": torch.zeros(2, 1, 64, dtype=torch.int32)}, ValueError,
         "sparse_indices must be 2-D"),
        ({"softmax_scale": None}, TypeError, "no default"),
        ({"softmax_scale": float("inf")}, ValueError, "softmax_scale"),
        ({"out": torch.zeros(2, 16, 512)}, TypeError, "out must have dtype"),
        ({"out": torch.zeros(2, 16, 576, dtype=torch.bfloat16)}, ValueError, "out must have"),
    ],
)  # fmt: skip
def test_bad_arguments(monkeypatch, change, err, match):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    args, kwargs = _args(**change)
    with pytest.raises(err, match=match):
        op.dsa_sparse_attention(*args.values(), **kwargs)


def test_cache_rows_and_device(monkeypatch):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    wide = torch.zeros(10, 16, 65, dtype=torch.bfloat16)
    args, kwargs = _args(kpe_cache=wide[..., 1:])  # rows 2 bytes off 16
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        op.dsa_sparse_attention(*args.values(), **kwargs)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="CUDA tensor"):
        op.dsa_sparse_attention(*_args()[0].values(), softmax_scale=SCALE)


# ---------------------------------------------------------------- suite and tracing


def test_suite_is_registered():
    """Registered since its first GPU check passed (2026-12-01)."""
    assert SUITE_MODULES["dsa_sparse"] == "forgekernel.bench.suites.dsa_sparse"
    assert "dsa_sparse" not in PENDING_SUITE_MODULES
    s = dsa_sparse.suite()
    assert s.sanitize_cases and all(c.name for c in s.bench_cases)
    names = {c.name for c in s.bench_cases + s.check_cases}
    assert len(names) == len(s.bench_cases) + len(s.check_cases)
    assert {c.params["topk"] for c in s.bench_cases} == {512, 2048}
    assert {c.params["tokens"] for c in s.bench_cases} >= {1, 16, 64, 128, 1024, 4096, 32768}
    prefill = {(c.params["hq"], c.params["topk"]) for c in s.bench_cases if c.params["prefill"]}
    assert prefill >= {(16, 512), (16, 2048), (64, 512), (64, 2048), (128, 2048)}  # issue 22


def test_suite_work_counts():
    """Valid entries: min(visible, topk) per token (decode: its sequence's length; prefill:
    the positions it sees)."""
    case = dsa_sparse._case(3, 16, 64, (10, 0, 5000), topk=64)
    assert dsa_sparse.flops(case) == 2 * (576 + 512) * 16 * (10 + 0 + 64)
    assert dsa_sparse.nbytes(case, torch.bfloat16) == 74 * 1152 + 48 * (1088 * 2 + 4)
    prefill = dsa_sparse._case(4, 16, 64, 66, topk=64, prefill=True)
    assert dsa_sparse.visible(prefill) == [(0, 63), (0, 64), (0, 65), (0, 66)]
    assert dsa_sparse.flops(prefill) == 2 * (576 + 512) * 16 * (63 + 64 * 3)
    fp8 = dsa_sparse._case(3, 16, 64, (10, 0, 5000), topk=64, cache="fp8")
    assert dsa_sparse.nbytes(fp8, torch.float16) == 74 * 656 + 48 * (1088 * 2 + 4)


def test_suite_fp8_cases_and_flashmla_call():
    """FP8 cases: bench group fp8 (the host case stays the 16-bit t1 one), bf16 queries
    whatever the dtype; FlashMLA's sparse decode called as sgl-flash-mla 1.0.0's wheel reads
    (a stub records the call): q (tokens, 1, H, 576) zero-padded to 64 heads, the FP8 cache as
    it is, indices (tokens, 1, topk) padded with -1 to 64-entry blocks, is_fp8_kvcache and the
    legacy (sm90) kernels, no causal mask; its output cut back to H heads."""
    suite = dsa_sparse.suite()
    assert suite.host_case.name == "t1-h16-p64-k2048-L8192"
    assert {c.group for c in suite.bench_cases if dsa_sparse.fp8(c)} == {"fp8"}
    case = dsa_sparse._case(3, 16, 64, (700, 5, 100), topk=100, cache="fp8")
    inputs = dsa_sparse.make_inputs(case, torch.float16, torch.device("cpu"),
                                    torch.Generator().manual_seed(0))  # fmt: skip
    assert inputs["q"].dtype == torch.bfloat16 and inputs["ckv"].shape[2:] == (1, 656)
    calls = []

    class Stub:
        @staticmethod
        def get_mla_metadata(*args, **kwargs):
            return "meta", None

        @staticmethod
        def flash_mla_with_kvcache(q, k_cache, block_table, cache_seqlens, head_dim_v, meta,
                                   **kwargs):  # fmt: skip
            calls.append((q, k_cache, block_table, cache_seqlens, head_dim_v, meta, kwargs))
            b, s_q, h, _ = q.shape
            return torch.zeros(b, s_q, h, 512), torch.zeros(b, h, s_q)

    q, idx = inputs["q"][:, None], inputs["idx"][:, None]
    out, lse = dsa_sparse.flashmla_fp8_decode(Stub, q, inputs["ckv"], idx)()
    assert out.shape == (3, 1, 16, 512) and lse.shape == (3, 16, 1) and len(calls) == 2
    q_seen, cache, table, seqlens, dv, meta, kwargs = calls[-1]
    assert q_seen.shape == (3, 1, 64, 576) and torch.equal(q_seen[:, :, :16], q)
    assert torch.all(q_seen[:, :, 16:] == 0)
    assert cache is inputs["ckv"] and table is None and seqlens is None and dv == 512
    assert meta == "meta" and kwargs["is_fp8_kvcache"] and kwargs["use_legacy"]
    assert not kwargs["causal"] and kwargs["softmax_scale"] == SCALE
    assert kwargs["indices"].shape == (3, 1, 128) and torch.equal(kwargs["indices"][..., :100], idx)
    assert torch.all(kwargs["indices"][..., 100:] == -1)


@pytest.mark.parametrize("case", dsa_sparse.CHECK_CASES, ids=lambda c: c.name)
def test_suite_inputs_follow_the_case(case):
    """Each row lists min(visible, topk) distinct slots of its own sequence's pages (all of a
    row's slots on pages no other sequence holds), -1 elsewhere; "end" padding after them."""
    inputs = dsa_sparse.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                    torch.Generator().manual_seed(1))  # fmt: skip
    idx, ps = inputs["idx"], case.params["page"]
    valid = idx >= 0
    assert valid.sum(1).tolist() == dsa_sparse._valid(case)
    owner = {}
    for t, (seq, _) in enumerate(dsa_sparse.visible(case)):
        row = idx[t][valid[t]]
        assert row.unique().numel() == row.numel()
        for page in (row // ps).tolist():
            assert owner.setdefault(page, seq) == seq
        if case.params["pad"] == "end":
            assert torch.all(valid[t, : row.numel()])


@pytest.mark.parametrize("case", dsa_sparse.CHECK_CASES, ids=lambda c: c.name)
def test_suite_check_passes_on_the_algorithm(sparse_kernels, case):
    """The suite's own check (`bench.check.verify`: NaN-poisoned outputs, 2x the
    rounding yardstick + atol, -inf LSEs reproduced) with the kernel's algorithm standing in."""
    suite = dsa_sparse.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def _fake_inputs(combined=False):
    """(q_nope, q_pe, ckv, kpe or None, sparse_indices), CUDA; combined "fp8": FlashMLA's FP8
    cache."""
    cuda = {"device": "cuda", "dtype": torch.bfloat16}
    qn, qp = torch.empty(5, 16, 512, **cuda), torch.empty(5, 16, 64, **cuda)
    if combined == "fp8":
        ckv = torch.empty(10, 64, 1, FP8_ROW_BYTES, device="cuda", dtype=torch.float8_e4m3fn)
        kpe = None
    elif combined:
        ckv, kpe = torch.empty(10, 64, 1, 576, **cuda), None
    else:
        ckv, kpe = torch.empty(10, 64, 512, **cuda), torch.empty(10, 64, 64, **cuda)
    return qn, qp, ckv, kpe, torch.empty(5, 2048, device="cuda", dtype=torch.int32)


@pytest.mark.parametrize("combined", [False, True, "fp8"])
def test_fake_implementation_under_make_fx(combined):
    """torch.compile / CUDA-graph support: on fake CUDA tensors the custom op's fake gives the
    shapes, nothing runs, and make_fx records the op."""

    def call(*x, **kwargs):
        return op.dsa_sparse_attention(*x, softmax_scale=SCALE, **kwargs)

    with FakeTensorMode():
        o, lse = call(*_fake_inputs(combined), return_lse=True)
        assert o.shape == (5, 16, 512) and o.dtype == torch.bfloat16
        assert lse.shape == (5, 16) and lse.dtype == torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(lambda *x: call(*x) * 2, tracing_mode="fake")(*_fake_inputs(combined))
    assert "forgekernel.dsa_sparse_attention" in str(graph.graph)


def test_suite_plan_forms_are_fp8_bench_cases():
    """The bench's launcher-only plans (dsa_sparse PLAN_FORMS) name FP8 bench cases, one
    variant a form; other cases have none."""
    from forgekernel.bench.suites import dsa_sparse as suite

    cases = {c.name: c for c in suite.BENCH_CASES}
    assert set(suite.PLAN_FORMS) <= set(cases)
    for name, forms in suite.PLAN_FORMS.items():
        assert cases[name].group == "fp8" and set(suite.variants(cases[name])) == set(forms)
    assert suite.variants(suite.BENCH_CASES[0]) == {}
