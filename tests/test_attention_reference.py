"""The attention reference is the spec: checked against a float64 softmax written out naively,
on GQA, both causal alignments, rows that see no key, forced chunking and packed sequences."""

import math

import pytest
import torch

from forgekernel.reference import attention as ref_module
from forgekernel.reference.attention import attention_ref, attention_varlen_ref


def naive(q, k, v, causal, scale=None):
    """float64, one (batch, head) at a time, the mask written as in OPS.md."""
    b, sq, hq, d = q.shape
    sk, hkv, dv = k.shape[1], k.shape[2], v.shape[3]
    scale = 1 / math.sqrt(d) if scale is None else scale
    out = torch.zeros(b, sq, hq, dv, dtype=torch.float64)
    lse = torch.full((b, hq, sq), -math.inf, dtype=torch.float64)
    for bi in range(b):
        for h in range(hq):
            kh, vh = k[bi, :, h // (hq // hkv)].double(), v[bi, :, h // (hq // hkv)].double()
            for i in range(sq):
                seen = [j for j in range(sk) if not causal or j <= i + sk - sq]
                if not seen:
                    continue
                s = (kh[seen] @ q[bi, i, h].double()) * scale
                lse[bi, h, i] = torch.logsumexp(s, 0)
                out[bi, i, h] = torch.softmax(s, 0) @ vh[seen]
    return out, lse


def rand(*shape, dtype=torch.bfloat16):
    return torch.randn(*shape).to(dtype)


SHAPES = [
    # b, sq, sk, hq, hkv, d, dv
    (2, 7, 7, 4, 4, 16, 16),
    (1, 17, 17, 8, 2, 32, 32),
    (2, 5, 13, 4, 1, 16, 16),  # Sq < Sk: every row sees Sk - Sq + i + 1 keys
    (1, 13, 5, 2, 2, 16, 8),  # Sq > Sk: the first 8 rows see nothing; Dv != D
    (1, 1, 1, 16, 1, 8, 8),
]


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_float64(shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = rand(b, sq, hq, d), rand(b, sk, hkv, d), rand(b, sk, hkv, dv)
    out, lse = attention_ref(q, k, v, causal=causal)
    want_out, want_lse = naive(q, k, v, causal)
    assert out.dtype == lse.dtype == torch.float32
    assert out.shape == (b, sq, hq, dv) and lse.shape == (b, hq, sq)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


def test_rows_that_see_no_key():
    q, k, v = rand(1, 13, 2, 16), rand(1, 5, 2, 16), rand(1, 5, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True)
    assert torch.all(lse[:, :, :8] == -math.inf) and torch.isfinite(lse[:, :, 8:]).all()
    assert torch.all(out[:, :8] == 0) and out[:, 8:].abs().sum() > 0


def test_no_keys_at_all():
    out, lse = attention_ref(rand(1, 3, 2, 16), rand(1, 0, 2, 16), rand(1, 0, 2, 16))
    assert torch.all(out == 0) and torch.all(lse == -math.inf)


def test_softmax_scale():
    q, k, v = rand(1, 9, 4, 16), rand(1, 11, 2, 16), rand(1, 11, 2, 16)
    out, lse = attention_ref(q, k, v, causal=True, softmax_scale=0.3)
    want_out, want_lse = naive(q, k, v, True, 0.3)
    torch.testing.assert_close(out.double(), want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("budget", [1, 40, 100])
def test_chunking_changes_nothing(monkeypatch, budget):
    """A budget below one head's scores splits heads to 1 and query rows into chunks."""
    q, k, v = rand(2, 23, 8, 16), rand(2, 31, 2, 16), rand(2, 31, 2, 8)
    want = attention_ref(q, k, v, causal=True)
    monkeypatch.setattr(ref_module, "SCORE_BUDGET", budget)
    got = attention_ref(q, k, v, causal=True)
    torch.testing.assert_close(got[0], want[0], rtol=0, atol=1e-6)
    torch.testing.assert_close(got[1], want[1], rtol=0, atol=1e-6)


def test_low_precision_is_the_same_math_in_the_input_dtype():
    q, k, v = rand(1, 64, 4, 32), rand(1, 64, 2, 32), rand(1, 64, 2, 32)
    low_out, low_lse = attention_ref(q, k, v, causal=True, upcast=False)
    out, lse = attention_ref(q, k, v, causal=True)
    assert low_out.dtype == torch.bfloat16 and low_lse.dtype == torch.float32
    err = (low_out.float() - out).abs().max()
    assert 0 < err < 0.05
    assert (low_lse - lse).abs().max() < 0.1


def test_varlen_equals_per_sequence():
    lens_q, lens_k = [5, 1, 17, 0, 9], [5, 12, 3, 4, 9]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    q, k, v = rand(sum(lens_q), 4, 16), rand(sum(lens_k), 2, 16), rand(sum(lens_k), 2, 8)
    out, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=True)
    assert out.shape == (sum(lens_q), 4, 8) and lse.shape == (4, sum(lens_q))
    for i in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[i], cu_q[i + 1], cu_k[i], cu_k[i + 1]
        want_out, want_lse = naive(q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], True)
        torch.testing.assert_close(out[q0:q1].double(), want_out[0], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(lse[:, q0:q1].double(), want_lse[0], rtol=1e-5, atol=1e-5)
