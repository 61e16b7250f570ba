"""The attention backward reference is the spec for dQ, dK, dV: checked against float64 autograd of
a softmax written out naively, on GQA, both causal alignments, rows that see no key, forced
chunking, the low-precision variant and packed sequences."""

import math

import pytest
import torch

from forgekernel.reference import attention as ref_module
from forgekernel.reference.attention import attention_bwd_ref, attention_varlen_bwd_ref


def naive_out(q, k, v, causal, scale):
    """float64 O; rows that see no key are 0 (and pass no gradient)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    k, v = k.repeat_interleave(hq // hkv, 2), v.repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    seen = torch.ones(sq, sk, dtype=torch.bool)
    if causal:
        seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
    alive = seen.any(-1, keepdim=True)
    s = s.masked_fill(~seen, -math.inf).masked_fill(~alive, 0.0)
    p = torch.softmax(s, -1) * alive
    return torch.einsum("bhij,bjhd->bihd", p, v)


@pytest.fixture(autouse=True)
def seed():
    torch.manual_seed(0)


def float64_grads(q, k, v, do, causal, scale):
    leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
    naive_out(*leaves, causal, scale).backward(do.double())
    return [t.grad for t in leaves]


SHAPES = [
    # b, sq, sk, hq, hkv, d, dv
    (2, 7, 7, 4, 4, 16, 16),
    (1, 17, 17, 8, 2, 32, 32),
    (2, 5, 13, 4, 1, 16, 16),  # Sq < Sk
    (1, 13, 5, 2, 2, 16, 8),  # Sq > Sk: the first 8 rows see nothing; Dv != D
    (1, 1, 1, 16, 1, 8, 8),
    (1, 1, 9, 8, 2, 24, 16),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64_autograd(shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = torch.randn(b, sq, hq, d), torch.randn(b, sk, hkv, d), torch.randn(b, sk, hkv, dv)
    do = torch.randn(b, sq, hq, dv)
    grads = attention_bwd_ref(q, k, v, do, causal, 0.7)
    for got, want, like in zip(grads, float64_grads(q, k, v, do, causal, 0.7), (q, k, v)):
        assert got.dtype == torch.float32 and got.shape == like.shape
        # fp32 rounding: at most 5e-6 of the largest gradient over 30 seeds of these shapes
        torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=5e-5)


def test_rows_that_see_no_key_get_zero_dq():
    q, k, v = torch.randn(1, 13, 2, 16), torch.randn(1, 5, 2, 16), torch.randn(1, 5, 2, 8)
    do = torch.randn(1, 13, 2, 8)
    dq, dk, dv = attention_bwd_ref(q, k, v, do, causal=True)
    assert torch.all(dq[:, :8] == 0) and torch.all(torch.isfinite(dk)) and torch.all(dv != 0)


def test_forced_chunking_gives_the_same_gradients(monkeypatch):
    q, k, v = torch.randn(2, 37, 8, 16), torch.randn(2, 41, 2, 16), torch.randn(2, 41, 2, 16)
    do = torch.randn(2, 37, 8, 16)
    whole = attention_bwd_ref(q, k, v, do, causal=True)
    monkeypatch.setattr(ref_module, "SCORE_BUDGET", 3 * 41)  # 1 head, a few rows per chunk
    for a, b in zip(whole, attention_bwd_ref(q, k, v, do, causal=True)):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_in_the_input_dtype_and_close(dtype):
    q, k, v = (torch.randn(1, 33, 4, 32).to(dtype) for _ in range(3))
    k, v = k[:, :, :2], v[:, :, :2]
    do = torch.randn(1, 33, 4, 32).to(dtype)
    exact = attention_bwd_ref(q, k, v, do, True)
    low = attention_bwd_ref(q, k, v, do, True, upcast=False)
    for e, lp in zip(exact, low):
        assert lp.dtype == dtype
        err = (lp.float() - e).abs().max()
        # rounded like a 16-bit kernel: not exact, but within a few ulps of the gradient's size
        assert 0 < err < 0.05 * e.abs().max()


def test_varlen_is_each_sequence_alone():
    lens_q, lens_k = [3, 0, 9, 1], [5, 4, 9, 0]
    cu_q, cu_k = (
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        for n in (lens_q, lens_k)
    )
    q, k, v = torch.randn(13, 4, 16), torch.randn(18, 2, 16), torch.randn(18, 2, 8)
    do = torch.randn(13, 4, 8)
    dq, dk, dv = attention_varlen_bwd_ref(q, k, v, do, cu_q, cu_k, causal=True)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    for i in range(4):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        want = attention_bwd_ref(q[None, qs], k[None, ks], v[None, ks], do[None, qs], True)
        for got, w in zip((dq[qs], dk[ks], dv[ks]), want):
            torch.testing.assert_close(got, w[0], rtol=0, atol=0)
    assert torch.all(dq[12] == 0)  # sequence 3: one query, no key
    assert torch.all(dk[5:9] == 0) and torch.all(dv[5:9] == 0)  # sequence 1: keys, no query
