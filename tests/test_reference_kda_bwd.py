"""The chunked Kimi Delta Attention backward (reference/kda_bwd.py) against torch.autograd
through the fp64 token-by-token recurrence: every gradient (q, k, v, g per channel, beta,
initial state) with a gradient on o and on the final state; lengths 1, 15, 16, 17, 63, 64,
65, 200 (around the sub-chunk and the chunk), varlen with an empty sequence, grouped value
heads, l2norm on unnormalized keys, strong per-channel decays (g down to -5 a step: the
sub-chunk references keep every factor finite), no initial state; fp64 to 1e-10, fp32 at
K = V = 128 loosely; torch.autograd.gradcheck (finite differences) of the sub-chunked forward
with this backward."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
from forgekernel.reference.kda_bwd import kimi_delta_attention_chunked_backward
from forgekernel.reference.kda_chunked import kimi_delta_attention_subchunked

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def make_inputs(lens, h, hv, dk, dv, *, l2norm=False, decay=(-1.0, 0.0), varlen=True, b=1,
                seed=0):  # fmt: skip
    """fp64 q, k, v, g (uniform in `decay` per channel), beta, initial state, cu_seqlens."""
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens) if varlen else lens[0]
    b = 1 if varlen else b

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = rand(b, t, h, dk), rand(b, t, h, dk)
    k = k * 3.0 if l2norm else F.normalize(k, dim=-1)
    lo, hi = decay
    g = lo + (hi - lo) * torch.rand(b, t, hv, dk, generator=gen, dtype=torch.float64)
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    state = 0.5 * rand(len(lens) if varlen else b, hv, dk, dv)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]) if varlen else None
    return (q, k, rand(b, t, hv, dv), g, beta, state), cu


def autograd_grads(inputs, cu, *, scale, l2norm, with_state, with_dfinal, seed=1):
    """(do, d_final or None, the gradients) by autograd through the fp64 recurrence."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, final = kimi_delta_attention_recurrent(*leaves[:5], scale=scale,
                                              initial_state=leaves[5] if with_state else None,
                                              output_final_state=True, cu_seqlens=cu,
                                              use_qk_l2norm=l2norm)  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=torch.float64)
    d_final = torch.randn(final.shape, generator=gen, dtype=torch.float64)
    loss = (o * do).sum() + ((final * d_final).sum() if with_dfinal else 0.0)
    grads = torch.autograd.grad(loss, leaves if with_state else leaves[:5])
    return do, (d_final if with_dfinal else None), grads


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert got.shape == want.shape and torch.isfinite(got).all()
    return float((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30))


CASES = [
    # lens, h, hv, l2norm, decay, with_state, with_dfinal
    ([1, 15, 16, 0, 17, 63, 64, 65, 200], 1, 2, False, (-1.0, 0.0), True, True),
    ([200], 2, 4, True, (-5.0, 0.0), True, True),
    ([65, 1], 1, 3, False, (-5.0, -4.0), False, True),
    ([63, 130], 2, 2, True, (-0.1, 0.0), True, False),
    ([64], 1, 1, False, (0.0, 0.0), False, False),
]


@pytest.mark.parametrize(("lens", "h", "hv", "l2norm", "decay", "with_state", "with_dfinal"),
                         CASES)  # fmt: skip
def test_fp64_matches_autograd_of_the_recurrence(lens, h, hv, l2norm, decay, with_state,
                                                 with_dfinal):  # fmt: skip
    inputs, cu = make_inputs(lens, h, hv, 16, 12, l2norm=l2norm, decay=decay)
    do, d_final, want = autograd_grads(inputs, cu, scale=0.4, l2norm=l2norm,
                                       with_state=with_state, with_dfinal=with_dfinal)  # fmt: skip
    got = kimi_delta_attention_chunked_backward(
        *inputs[:5], do, scale=0.4, initial_state=inputs[5] if with_state else None,
        d_final_state=d_final, cu_seqlens=cu, use_qk_l2norm=l2norm, dtype=torch.float64,
    )  # fmt: skip
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.float64
        assert rel_err(a, b) < 1e-10, name


def test_fixed_batch_and_default_scale():
    inputs, _ = make_inputs([70], 2, 4, 16, 8, varlen=False, b=3, decay=(-2.0, 0.0), seed=3)
    do, d_final, want = autograd_grads(inputs, None, scale=None, l2norm=False,
                                       with_state=True, with_dfinal=True)  # fmt: skip
    got = kimi_delta_attention_chunked_backward(*inputs[:5], do, initial_state=inputs[5],
                                                d_final_state=d_final,
                                                dtype=torch.float64)  # fmt: skip
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < 1e-10, name


@pytest.mark.parametrize("chunk", [16, 32, 64])
def test_chunk_sizes(chunk):
    inputs, cu = make_inputs([9, 40], 1, 2, 8, 8, decay=(-3.0, 0.0), seed=4)
    do, d_final, want = autograd_grads(inputs, cu, scale=0.5, l2norm=False,
                                       with_state=True, with_dfinal=True)  # fmt: skip
    got = kimi_delta_attention_chunked_backward(*inputs[:5], do, scale=0.5,
                                                initial_state=inputs[5], d_final_state=d_final,
                                                cu_seqlens=cu, chunk_size=chunk,
                                                dtype=torch.float64)  # fmt: skip
    for name, a, b in zip(NAMES, got, want):
        assert rel_err(a, b) < 1e-10, name


def test_chunk_size_must_hold_sub_chunks():
    inputs, cu = make_inputs([5], 1, 1, 4, 4)
    with pytest.raises(ValueError, match="multiple of 16"):
        kimi_delta_attention_chunked_backward(*inputs[:5], torch.ones_like(inputs[2]),
                                              cu_seqlens=cu, chunk_size=24)  # fmt: skip


@pytest.mark.parametrize(("decay", "l2norm"), [((-5.0, 0.0), True), ((-5.0, -4.0), False)])
def test_fp32_close_to_fp64(decay, l2norm):
    """fp32 at the kernel's head dims: K = V = 128, a 200-token sequence (4 chunks); at g in
    [-5, -4] a chunk's decay is e^-300 per channel: the naive split would overflow."""
    inputs, cu = make_inputs([200, 1, 65], 1, 1, 128, 128, l2norm=l2norm, decay=decay, seed=5)
    do, d_final, want = autograd_grads(inputs, cu, scale=None, l2norm=l2norm,
                                       with_state=True, with_dfinal=True)  # fmt: skip
    got = kimi_delta_attention_chunked_backward(
        *(x.float() for x in inputs[:5]), do.float(), initial_state=inputs[5].float(),
        d_final_state=d_final.float(), cu_seqlens=cu, use_qk_l2norm=l2norm,
    )  # fmt: skip
    for name, a, b in zip(NAMES, got, want):
        assert a.dtype == torch.float32
        assert rel_err(a, b) < 2e-4, name


class _SubchunkedWithOurBackward(torch.autograd.Function):
    """The sub-chunked forward with the backward under test, for gradcheck's finite
    differences."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, state, cu):
        ctx.save_for_backward(q, k, v, g, beta, state)
        ctx.cu = cu
        return kimi_delta_attention_subchunked(q, k, v, g, beta, scale=0.7,
                                               initial_state=state, output_final_state=True,
                                               cu_seqlens=cu, use_qk_l2norm=True,
                                               chunk_size=16, dtype=torch.float64)  # fmt: skip

    @staticmethod
    def backward(ctx, do, d_final):
        q, k, v, g, beta, state = ctx.saved_tensors
        grads = kimi_delta_attention_chunked_backward(q, k, v, g, beta, do, scale=0.7,
                                                      initial_state=state,
                                                      d_final_state=d_final, cu_seqlens=ctx.cu,
                                                      use_qk_l2norm=True, chunk_size=16,
                                                      dtype=torch.float64)  # fmt: skip
        return (*grads, None)


def test_gradcheck_finite_differences():
    inputs, cu = make_inputs([3, 0, 18], 1, 1, 2, 2, l2norm=True, decay=(-2.0, 0.0), seed=6)
    leaves = tuple(x.clone().requires_grad_() for x in inputs)
    assert torch.autograd.gradcheck(lambda *xs: _SubchunkedWithOurBackward.apply(*xs, cu), leaves)


def test_bad_shapes_raise():
    inputs, cu = make_inputs([5, 3], 1, 2, 4, 4)
    do = torch.zeros(1, 8, 2, 3, dtype=torch.float64)
    with pytest.raises(ValueError, match="do must be"):
        kimi_delta_attention_chunked_backward(*inputs[:5], do, cu_seqlens=cu)
    with pytest.raises(ValueError, match="g must be"):
        q, k, v, g, beta, _ = inputs
        kimi_delta_attention_chunked_backward(q, k, v, g[..., 0], beta, torch.ones_like(v),
                                              cu_seqlens=cu)  # fmt: skip


def test_head_passes_change_nothing():
    """Heads in passes (bounded temporaries) give the one-pass result exactly."""
    inputs, cu = make_inputs([30, 0, 70], 3, 6, 8, 8, l2norm=True, decay=(-2.0, 0.0), seed=7)
    do = torch.randn(inputs[2].shape, dtype=torch.float64)
    kwargs = {"initial_state": inputs[5], "cu_seqlens": cu, "use_qk_l2norm": True}
    whole = kimi_delta_attention_chunked_backward(*inputs[:5], do, **kwargs)
    passes = kimi_delta_attention_chunked_backward(*inputs[:5], do, heads_per_pass=1, **kwargs)
    for name, a, b in zip(NAMES, whole, passes):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("varlen", [True, False])
def test_no_tokens(varlen):
    """T = 0: no chunk at all; the initial state's gradient is the final state's."""
    inputs, cu = make_inputs([0, 0], 1, 2, 4, 4, varlen=varlen, b=2)
    d_final = torch.randn(inputs[5].shape, dtype=torch.float64)
    got = kimi_delta_attention_chunked_backward(*inputs[:5], torch.zeros_like(inputs[2]),
                                                initial_state=inputs[5], d_final_state=d_final,
                                                cu_seqlens=cu)  # fmt: skip
    assert all(x.numel() == 0 for x in got[:5])
    assert torch.equal(got[5], d_final.float())
