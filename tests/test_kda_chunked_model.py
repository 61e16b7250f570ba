"""The kernel's factorized chunked KDA (reference/kda_chunked.py: sub-chunk reference points,
every product a plain GEMM) against the fp64 token recurrence: exact in fp64, fp32-close in
fp32, within a few bf16 roundings with the tensor cores' 16-bit operands; with per-step log
decays down to -5 over long sequences, where the naive split exp(G) / exp(-G) overflows."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
from forgekernel.reference.kda_chunked import (
    kimi_delta_attention_segmented,
    kimi_delta_attention_subchunked,
    naive_factor_overflows,
)

FP64_TOL = 1e-11
FP32_TOL = 2e-5
BF16_TOL = 2e-2  # ~5 bf16 roundings of max |o| / max |S| (GDN's kernel model: ~2.5)


def make_inputs(b, t, h, hv, d, seed, decay=(-1.0, 0.0), n=None, l2norm=False):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(b, t, h, d), rand(b, t, h, d)
    k = k if l2norm else F.normalize(k, dim=-1)
    lo, hi = decay
    g = lo + (hi - lo) * torch.rand(b, t, hv, d, generator=gen)
    beta = torch.sigmoid(rand(b, t, hv))
    state = 0.5 * rand(b if n is None else n, hv, d, d)
    return q, k, rand(b, t, hv, d), g, beta, state


def rel_err(got, want) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def check(inputs, tols=((torch.float64, None, FP64_TOL), (torch.float32, None, FP32_TOL)), **kw):
    q, k, v, g, beta, h0 = inputs
    args = dict(initial_state=h0, output_final_state=True, **kw)
    o_ref, s_ref = kimi_delta_attention_recurrent(q, k, v, g, beta, **args)
    for dtype, operand, tol in tols:
        o, s = kimi_delta_attention_subchunked(
            q, k, v, g, beta, dtype=dtype, operand_dtype=operand, **args
        )
        assert o.shape == v.shape and s.shape == s_ref.shape
        errs = rel_err(o, o_ref), rel_err(s, s_ref)
        assert max(errs) < tol, (dtype, operand, errs, kw)
    return o_ref, s_ref


@pytest.mark.parametrize(
    "b, t, h, hv, d, l2norm",
    [
        (2, 1, 2, 2, 64, False),
        (1, 63, 2, 4, 64, True),
        (2, 65, 1, 1, 128, False),
        (1, 131, 2, 2, 128, True),
        (1, 16, 1, 1, 32, False),
    ],
)
def test_matches_recurrence(b, t, h, hv, d, l2norm):
    inputs = make_inputs(b, t, h, hv, d, seed=b * 1000 + t, l2norm=l2norm)
    check(inputs, use_qk_l2norm=l2norm, scale=0.3 if l2norm else None)


def test_strong_decay_over_a_long_sequence():
    """g in [-5, -4] per step and channel over 1537 tokens: the naive split overflows fp32 in
    every chunk (the cumulative decay reaches -88 by the 18th token); the sub-chunk form is
    exact in fp64, fp32-close in fp32 and finite and bf16-close with 16-bit operands."""
    inputs = make_inputs(1, 1537, 1, 2, 128, seed=3, decay=(-5.0, -4.0))
    assert naive_factor_overflows(inputs[3])
    check(
        inputs,
        tols=(
            (torch.float64, None, FP64_TOL),
            (torch.float32, None, FP32_TOL),
            (torch.float32, torch.bfloat16, BF16_TOL),
        ),
    )


def test_mixed_decays_with_bf16_operands():
    """Per-channel decays from -5 to 0 (some channels keep their memory over the whole
    sequence, some forget at once), l2norm, GQA, varlen with initial states."""
    lengths = [1, 64, 200, 17, 129]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = make_inputs(1, sum(lengths), 2, 4, 128, seed=5, decay=(-5.0, 0.0), n=5, l2norm=True)
    tols = ((torch.float64, None, FP64_TOL), (torch.float32, torch.bfloat16, BF16_TOL))
    check(inputs, cu_seqlens=cu, use_qk_l2norm=True, tols=tols)


def test_varlen_equals_sequences_run_alone():
    lengths = [37, 93, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int64)
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 2, 2, 32, seed=7, n=3, decay=(-3, 0))
    args = dict(output_final_state=True, dtype=torch.float64)
    o, s = kimi_delta_attention_subchunked(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, **args
    )
    for i, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = (x[:, t0:t1] for x in (q, k, v, g, beta))
        o_i, s_i = kimi_delta_attention_subchunked(*one, initial_state=h0[i : i + 1], **args)
        torch.testing.assert_close(o[:, t0:t1], o_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(s[i : i + 1], s_i, rtol=0, atol=1e-12)


def test_every_operand_is_bounded():
    """The factors the kernel forms (exp(+-a) over at most 8 steps, E <= 1, the state side's
    products <= 1) stay finite in fp32 at the strongest decay of the suite, and the naive one
    does not: the point of the sub-chunk references."""
    g = torch.full((1, 64, 1, 8), -5.0)
    assert naive_factor_overflows(g)
    big = g[0, :, 0].cumsum(0)
    ref = big[8]  # sub-chunk 0's reference
    assert torch.isfinite((big[:16] - ref).exp()).all() and (big[:16] - ref).abs().max() <= 40


def test_bad_chunk_size():
    inputs = make_inputs(1, 8, 1, 1, 16, seed=1)
    with pytest.raises(ValueError, match="multiple of 16"):
        kimi_delta_attention_subchunked(*inputs[:5], chunk_size=24)


def test_segments_hand_the_state_on():
    """The segmented form (the interim op's and the suite's long-sequence reference): segments
    of 50 tokens (chunks restarting mid-sequence), varlen with an empty sequence."""
    lengths = [120, 0, 77]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])
    q, k, v, g, beta, h0 = make_inputs(1, sum(lengths), 1, 2, 32, seed=9, n=3, decay=(-5, 0))
    o, s = kimi_delta_attention_segmented(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, segment=50, dtype=torch.float64
    )
    o_ref, s_ref = kimi_delta_attention_recurrent(
        q, k, v, g, beta, initial_state=h0, cu_seqlens=cu, output_final_state=True
    )
    assert rel_err(o, o_ref) < FP64_TOL and rel_err(s, s_ref) < FP64_TOL
