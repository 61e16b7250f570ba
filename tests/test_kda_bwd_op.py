"""Autograd of `forgekernel.ops.kda_chunked.kimi_delta_attention` on the CPU (the GPU's
checks: tests/gpu/test_kda_bwd_gpu.py): the forward kernel replaced by the fp32 sub-chunked
reference, the backward the op's own interim torch path (ops/kda_bwd.py), against
torch.autograd through the fp64 recurrence on the same 16-bit inputs: varlen with empty and
odd sequences, grouped value heads, l2norm, strong per-channel decays, gradients on o and on
the final state, no initial state, a loss on the final state alone, g and beta in q's dtype;
the explicit `kimi_delta_attention_backward`; torch.compile(fullgraph=True) recording the
forward and backward custom ops; fake tensors; opcheck.

Tolerance: 2e-2 of the largest gradient entry (dq, dk, dv come back in 16-bit: ~4e-3; the
inputs' 16-bit rounding is shared with the fp64 yardstick)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from compile_graphs import assert_compiled_grads_match_eager
from compile_graphs import leaves as _leaves
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
from forgekernel.reference.kda_chunked import kimi_delta_attention_subchunked

op = importlib.import_module("forgekernel.ops.kda_chunked")
bwd = importlib.import_module("forgekernel.ops.kda_bwd")
TOL = 2e-2
NAMES = ("q", "k", "v", "g", "beta", "state")


@pytest.fixture
def cpu_forward(monkeypatch):
    """The forward's launcher as the fp32 sub-chunked reference (the backward under test
    never reads the forward's outputs, only its inputs)."""
    calls = []

    def launch(q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, out=None,
               seq_len=None):  # fmt: skip
        calls.append(l2norm)
        o, final = kimi_delta_attention_subchunked(
            *(x.unsqueeze(0) for x in (q, k, v, g, beta)), scale=scale,
            initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm=l2norm,
        )  # fmt: skip
        o = o[0].to(q.dtype).contiguous()
        if out is not None:
            out.copy_(o)
            o = out
        return o, final.contiguous()

    monkeypatch.setattr(op, "_launch", launch)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(bwd, "check_cuda", lambda name, t: None)
    return calls


def _inputs(lens, h, hv, *, l2norm=False, decay=(-1.0, 0.0), seed=0, gate_dtype=torch.float32,
            b=1):  # fmt: skip
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    n = len(lens) if b == 1 else b
    q = torch.randn(b, t, h, 128, generator=gen).bfloat16()
    k = torch.randn(b, t, h, 128, generator=gen)
    k = (k * 2.0 if l2norm else F.normalize(k, dim=-1)).bfloat16()
    v = torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    lo, hi = decay
    g = (lo + (hi - lo) * torch.rand(b, t, hv, 128, generator=gen)).to(gate_dtype)
    beta = torch.rand(b, t, hv, generator=gen).to(gate_dtype)
    state = torch.randn(n, hv, 128, 128, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, g, beta, state], (cu if b == 1 else None)


def _fp64_grads(inputs, cu, do, d_final, *, l2norm=False, with_state=True):
    leaves = [x.double().requires_grad_() for x in inputs]
    o, final = kimi_delta_attention_recurrent(*leaves[:5], initial_state=leaves[5] if with_state
                                              else None, output_final_state=True,
                                              cu_seqlens=cu, use_qk_l2norm=l2norm)  # fmt: skip
    loss = (o * do.double()).sum() + (0.0 if d_final is None else (final * d_final).sum())
    return torch.autograd.grad(loss, leaves if with_state else leaves[:5])


def _close(got, want, name):
    assert got is not None and got.shape == want.shape, name
    err = float((got.double() - want).abs().max())
    assert err <= TOL * float(want.abs().max()) + 1e-6, (name, err)


def _kda(leaves, cu=None, l2norm=False, with_state=True, **kw):
    return op.kimi_delta_attention(*leaves[:5], initial_state=leaves[5] if with_state else None,
                                   output_final_state=True, cu_seqlens=cu,
                                   use_qk_l2norm_in_kernel=l2norm, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "decay", "gate_dtype"),
    [
        ([1, 17, 0, 64, 65], 1, 2, False, (-5.0, 0.0), torch.float32),
        ([100], 2, 4, True, (-5.0, -4.0), torch.bfloat16),
    ],
)
def test_autograd_matches_the_fp64_recurrence(cpu_forward, lens, h, hv, l2norm, decay,
                                              gate_dtype):  # fmt: skip
    inputs, cu = _inputs(lens, h, hv, l2norm=l2norm, decay=decay, gate_dtype=gate_dtype)
    leaves = _leaves(inputs)
    o, final = _kda(leaves, cu, l2norm)
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(o.shape, generator=gen).bfloat16()
    d_final = torch.randn(final.shape, generator=gen)
    (o.float() * do.float()).sum().add((final * d_final).sum()).backward()
    want = _fp64_grads(inputs, cu, do, d_final, l2norm=l2norm)
    for name, leaf, w in zip(NAMES, leaves, want):
        assert leaf.grad.dtype == leaf.dtype, name
        _close(leaf.grad, w, name)
    assert cpu_forward == [l2norm]


def test_no_initial_state_fixed_batch_and_o_only(cpu_forward):
    inputs, _ = _inputs([40], 1, 2, b=2, seed=1)
    leaves = _leaves(inputs[:5])
    o, final = op.kimi_delta_attention(*leaves)
    assert final is None
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    o.backward(do)
    want = _fp64_grads(inputs, None, do, None, with_state=False)
    for name, leaf, w in zip(NAMES, leaves, want):
        _close(leaf.grad, w, name)


def test_loss_on_the_final_state_alone(cpu_forward):
    """No gradient reaches o: the backward gets dO as zeros and still gives every input's
    gradient through the final state."""
    inputs, cu = _inputs([65, 3], 1, 1, seed=3)
    leaves = _leaves(inputs)
    _, final = _kda(leaves, cu)
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(4))
    (final * d_final).sum().backward()
    zeros = torch.zeros(inputs[2].shape, dtype=torch.bfloat16)
    want = _fp64_grads(inputs, cu, zeros, d_final)
    for name, leaf, w in zip(NAMES, leaves, want):
        _close(leaf.grad, w, name)


def test_out_with_grad_is_written_and_differentiable(cpu_forward):
    inputs, cu = _inputs([20], 1, 1, seed=15)
    leaves = _leaves(inputs)
    out = torch.empty_like(inputs[2])
    o, _ = _kda(leaves, cu, out=out)
    assert o.data_ptr() == out.data_ptr() and o.requires_grad
    o.float().sum().backward()
    assert all(x.grad is not None for x in leaves)


def test_forward_only_calls_skip_the_custom_op(cpu_forward, monkeypatch):
    inputs, cu = _inputs([10], 1, 1, seed=5)
    monkeypatch.setattr(torch.ops.forgekernel, "kda_chunked", None, raising=False)
    with torch.no_grad():
        o, _ = op.kimi_delta_attention(*_leaves(inputs[:5]), cu_seqlens=cu)
    assert not o.requires_grad


def test_explicit_backward_equals_autograd(cpu_forward):
    inputs, cu = _inputs([5, 40, 0], 2, 4, l2norm=True, seed=6)
    leaves = _leaves(inputs)
    o, final = _kda(leaves, cu, l2norm=True)
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(8))
    torch.autograd.backward((o, final), (do, d_final))
    got = bwd.kimi_delta_attention_backward(*inputs[:5], do, initial_state=inputs[5],
                                            d_final_state=d_final, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    for name, leaf, x in zip(NAMES, leaves, got):
        assert torch.equal(leaf.grad, x), name


def test_explicit_backward_refuses_bad_arguments(cpu_forward):
    inputs, cu = _inputs([5, 3], 1, 2, seed=9)
    do = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="do must have dtype"):
        bwd.kimi_delta_attention_backward(*inputs[:5], do.float(), cu_seqlens=cu)
    with pytest.raises(ValueError, match="d_final_state"):
        bwd.kimi_delta_attention_backward(*inputs[:5], do, cu_seqlens=cu,
                                          d_final_state=inputs[5][:1])  # fmt: skip
    with pytest.raises(ValueError, match="g must have shape"):
        bwd.kimi_delta_attention_backward(*inputs[:3], inputs[3][..., :64], inputs[4], do,
                                          cu_seqlens=cu)  # fmt: skip
    # the 2026-12-05 audit: do's device was not checked, nor the scale
    with pytest.raises(ValueError, match="do is on meta but q is on cpu"):
        bwd.kimi_delta_attention_backward(*inputs[:5], do.to("meta"), cu_seqlens=cu)
    with pytest.raises(TypeError, match="use_qk_l2norm_in_kernel must be a bool"):
        bwd.kimi_delta_attention_backward(*inputs[:5], do, cu_seqlens=cu,
                                          use_qk_l2norm_in_kernel="yes")  # fmt: skip
    with pytest.raises(ValueError, match="scale must be finite"):
        bwd.kimi_delta_attention_backward(*inputs[:5], do, cu_seqlens=cu, scale=-1.0)


def test_compile_fullgraph_records_forward_and_backward_ops(cpu_forward):
    def loss(q, k, v, g, beta, state):
        o, final = op.kimi_delta_attention(q, k, v, g, beta, initial_state=state,
                                           output_final_state=True)  # fmt: skip
        return o.float().square().sum() + final.sum()

    inputs, _ = _inputs([21], 1, 2, b=2, seed=10)
    assert_compiled_grads_match_eager(
        loss, inputs, "forgekernel.kda_chunked.default", "forgekernel.kda_chunked_bwd.default"
    )


def test_fake_tensors_take_the_backward_op():
    def f(q, k, v, g, beta, do, state, cu):
        return bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=state,
                                                 cu_seqlens=cu)  # fmt: skip

    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = {"device": "cuda", "dtype": torch.bfloat16}
        q, k = (torch.empty(1, 100, 2, 128, **cuda) for _ in range(2))
        v, do = (torch.empty(1, 100, 4, 128, **cuda) for _ in range(2))
        g = torch.empty(1, 100, 4, 128, device="cuda")
        beta = torch.empty(1, 100, 4, device="cuda")
        state = torch.empty(3, 4, 128, 128, device="cuda")
        cu = torch.tensor([0, 10, 60, 100], dtype=torch.int32, device="cuda")
        graph = make_fx(f, tracing_mode="fake")(q, k, v, g, beta, do, state, cu)
        grads = f(q, k, v, g, beta, do, state, cu)
    assert "forgekernel.kda_chunked_bwd.default" in str(graph.graph)
    for grad, like in zip(grads, (q, k, v, g, beta, state)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device.type == "cuda"


def test_opcheck_of_the_backward_op(cpu_forward):
    inputs, cu = _inputs([5, 30], 1, 2, seed=11)
    flat = [x[0] for x in inputs[:5]]
    do = torch.randn(35, 2, 128).bfloat16()
    args = (*flat, inputs[5], cu, do, torch.randn(2, 2, 128, 128), 0.1, True)
    torch.library.opcheck(torch.ops.forgekernel.kda_chunked_bwd.default, args)


@pytest.mark.parametrize(("lens", "batch"), [([5, 30], 0), ([20, 20], 2)])
def test_opcheck_of_the_differentiable_forward_op(cpu_forward, lens, batch):
    """`batch`: 0, or the number of equal-length sequences (the wrapper's (B, T) batch)."""
    inputs, cu = _inputs(lens, 1, 2, seed=12)
    flat = _leaves([x[0] for x in inputs[:5]])
    args = (*flat, inputs[5].requires_grad_(), cu, 0.1, False, batch)
    torch.library.opcheck(torch.ops.forgekernel.kda_chunked.default, args)


def test_no_tokens_passes_the_state_gradient_through(cpu_forward):
    inputs, cu = _inputs([0, 0], 1, 2, seed=13)
    leaves = _leaves(inputs)
    _, final = _kda(leaves, cu)
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(14))
    (final * d_final).sum().backward()
    assert torch.equal(leaves[5].grad, d_final)
    assert all(x.grad.numel() == 0 for x in leaves[:5])


def test_interim_refuses_a_capture_before_any_work(monkeypatch):
    """Under a CUDA-graph capture (simulated) the interim backward, which reads the offsets on
    the host, raises before its first op (an invalidated capture would leave torch < 2.12's
    allocator routing to the dead graph's pool), and runs eagerly otherwise."""
    from capture_safety import _host_ops

    dispatch = importlib.import_module("forgekernel.ops._dispatch")
    (q, k, v, g, beta, state), cu = _inputs([70, 3], 2, 4, seed=31)
    flat = [x[0] for x in (q, k, v, g, beta)]
    do = torch.randn_like(flat[2])
    args = (*flat, state, cu, do, None, 128**-0.5)
    extra = (False,)  # l2norm
    monkeypatch.setattr(dispatch, "capturing", lambda t: True)
    mode = _host_ops().HostOps("cpu")
    with mode, pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        bwd._backward_interim(*args, *extra)
    assert mode.names == []
    monkeypatch.setattr(dispatch, "capturing", lambda t: False)
    grads = bwd._backward_interim(*args, *extra)
    assert [x.shape for x in grads] == [*(x.shape for x in flat), state.shape]
