"""Autograd of `forgekernel.gated_delta_rule` on the CPU (the GPU's checks:
tests/gpu/test_gdn_bwd_gpu.py): the forward kernel replaced by the fp32 chunked reference, the
backward the op's own interim torch path, against torch.autograd through the fp64 recurrence on
the same 16-bit inputs: varlen with empty and odd sequences, grouped value heads, l2norm, both
state layouts, gradients on o and on the final state, no initial state, a loss on the final
state alone; the explicit `gated_delta_rule_backward`; torch.compile(fullgraph=True) recording
the forward and backward custom ops; fake tensors; opcheck.

Tolerance: 2e-2 of the largest gradient entry (dq, dk, dv come back in bf16: ~4e-3; the inputs'
16-bit rounding is shared with the fp64 yardstick)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from compile_graphs import assert_compiled_grads_match_eager
from compile_graphs import leaves as _leaves
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.reference.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent

op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
TOL = 2e-2


@pytest.fixture
def cpu_forward(monkeypatch):
    """The forward kernel's launcher as the fp32 chunked reference (the backward under test
    never reads the forward's outputs, only its inputs)."""
    calls = []

    def launch(q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm, out=None):
        calls.append(k_last)
        init = initial_state
        if init is not None and k_last:
            init = init.transpose(-1, -2)
        o, final = gated_delta_rule_chunked(
            *(x.unsqueeze(0) for x in (q, k, v, g, beta)), scale=scale, initial_state=init,
            output_final_state=True, cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm,
        )  # fmt: skip
        o = o[0].to(q.dtype).contiguous()
        if out is not None:
            out.copy_(o)
            o = out
        return o, (final.transpose(-1, -2) if k_last else final).contiguous()

    monkeypatch.setattr(op, "_launch", launch)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(bwd, "check_cuda", lambda name, t: None)
    return calls


def _inputs(lens, h, hv, *, l2norm=False, decay=-1.0, seed=0, beta_dtype=torch.float32, b=1):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    n = len(lens) if b == 1 else b
    q = torch.randn(b, t, h, 128, generator=gen).bfloat16()
    k = torch.randn(b, t, h, 128, generator=gen)
    k = (k * 2.0 if l2norm else F.normalize(k, dim=-1)).bfloat16()
    v = torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    g = decay * torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen).to(beta_dtype)
    state = torch.randn(n, hv, 128, 128, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return [q, k, v, g, beta, state], (cu if b == 1 else None)


def _fp64_grads(inputs, cu, do, d_final, *, l2norm, with_state):
    leaves = [x.double().requires_grad_() for x in inputs]
    o, final = gated_delta_rule_recurrent(*leaves[:5], initial_state=leaves[5] if with_state
                                          else None, output_final_state=True, cu_seqlens=cu,
                                          use_qk_l2norm=l2norm)  # fmt: skip
    loss = (o * do.double()).sum() + (0.0 if d_final is None else (final * d_final).sum())
    return torch.autograd.grad(loss, leaves if with_state else leaves[:5])


def _close(got, want, name):
    assert got is not None and got.shape == want.shape, name
    err = float((got.double() - want).abs().max())
    assert err <= TOL * float(want.abs().max()) + 1e-6, (name, err)


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "k_last", "beta_dtype"),
    [
        ([1, 63, 0, 64, 65, 130], 1, 2, False, False, torch.float32),
        ([200], 2, 4, True, True, torch.bfloat16),
        ([64, 7], 2, 2, True, False, torch.float32),
    ],
)
def test_autograd_matches_the_fp64_recurrence(cpu_forward, lens, h, hv, l2norm, k_last,
                                              beta_dtype):  # fmt: skip
    inputs, cu = _inputs(lens, h, hv, l2norm=l2norm, decay=-5.0, beta_dtype=beta_dtype)
    leaves = _leaves(inputs)
    state = leaves[5].transpose(-1, -2) if k_last else leaves[5]
    o, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=state,
                                            output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=l2norm,
                                            k_last=k_last)  # fmt: skip
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(o.shape, generator=gen).bfloat16()
    d_final = torch.randn(final.shape, generator=gen)
    (o.float() * do.float()).sum().add((final * d_final).sum()).backward()
    d_final_kv = d_final.transpose(-1, -2) if k_last else d_final
    want = _fp64_grads(inputs, cu, do, d_final_kv, l2norm=l2norm, with_state=True)
    for name, leaf, w in zip(("q", "k", "v", "g", "beta", "state"), leaves, want):
        assert leaf.grad.dtype == leaf.dtype, name
        _close(leaf.grad, w, name)
    assert cpu_forward == [k_last]


def test_no_initial_state_fixed_batch_and_o_only(cpu_forward):
    inputs, _ = _inputs([70], 2, 4, b=2, seed=1)
    leaves = _leaves(inputs[:5])
    o, final = forgekernel.gated_delta_rule(*leaves)
    assert final is None
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(2)).bfloat16()
    o.backward(do)
    want = _fp64_grads(inputs, None, do, None, l2norm=False, with_state=False)
    for name, leaf, w in zip("q k v g beta".split(), leaves, want):
        _close(leaf.grad, w, name)


def test_loss_on_the_final_state_alone(cpu_forward):
    """No gradient reaches o: the backward gets dO as zeros (or None) and still gives every
    input's gradient through the final state."""
    inputs, cu = _inputs([65, 3], 1, 2, seed=3)
    leaves = _leaves(inputs)
    _, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            output_final_state=True, cu_seqlens=cu)  # fmt: skip
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(4))
    (final * d_final).sum().backward()
    zeros = torch.zeros(inputs[2].shape, dtype=torch.bfloat16)
    want = _fp64_grads(inputs, cu, zeros, d_final, l2norm=False, with_state=True)
    for name, leaf, w in zip(("q", "k", "v", "g", "beta", "state"), leaves, want):
        _close(leaf.grad, w, name)


def test_forward_only_calls_skip_the_custom_op(cpu_forward, monkeypatch):
    inputs, cu = _inputs([10], 1, 1, seed=5)
    monkeypatch.setattr(torch.ops.forgekernel, "gated_delta_rule_chunked", None, raising=False)
    with torch.no_grad():
        o, _ = forgekernel.gated_delta_rule(*_leaves(inputs[:5]), cu_seqlens=cu)
    assert not o.requires_grad


def test_explicit_backward_equals_autograd(cpu_forward):
    inputs, cu = _inputs([5, 70, 0], 2, 4, l2norm=True, seed=6)
    leaves = _leaves(inputs)
    o, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            output_final_state=True, cu_seqlens=cu,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    do = torch.randn(o.shape, generator=torch.Generator().manual_seed(7)).bfloat16()
    d_final = torch.randn(final.shape, generator=torch.Generator().manual_seed(8))
    torch.autograd.backward((o, final), (do, d_final))
    got = forgekernel.gated_delta_rule_backward(*inputs[:5], do, initial_state=inputs[5],
                                                d_final_state=d_final, cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    for name, leaf, x in zip(("q", "k", "v", "g", "beta", "state"), leaves, got):
        assert torch.equal(leaf.grad, x), name


def test_explicit_backward_refuses_bad_arguments(cpu_forward):
    inputs, cu = _inputs([5, 3], 1, 2, seed=9)
    do = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="do must have dtype"):
        forgekernel.gated_delta_rule_backward(*inputs[:5], do.float(), cu_seqlens=cu)
    with pytest.raises(ValueError, match="d_final_state"):
        forgekernel.gated_delta_rule_backward(*inputs[:5], do, cu_seqlens=cu,
                                              d_final_state=inputs[5][:1])  # fmt: skip
    # the 2026-12-05 audit: no device check (a tensor elsewhere reached the torch backward)
    with pytest.raises(ValueError, match="do is on meta but q is on cpu"):
        forgekernel.gated_delta_rule_backward(*inputs[:5], do.to("meta"), cu_seqlens=cu)
    with pytest.raises(ValueError, match="scale must be finite"):
        forgekernel.gated_delta_rule_backward(*inputs[:5], do, cu_seqlens=cu, scale=float("nan"))


def test_compile_fullgraph_records_forward_and_backward_ops(cpu_forward):
    def loss(q, k, v, g, beta, state):
        o, final = forgekernel.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True)  # fmt: skip
        return o.float().square().sum() + final.sum()

    inputs, _ = _inputs([33], 1, 2, b=2, seed=10)
    assert_compiled_grads_match_eager(
        loss,
        inputs,
        "forgekernel.gated_delta_rule_chunked.default",
        "forgekernel.gated_delta_rule_chunked_bwd.default",
    )


def test_fake_tensors_take_the_backward_op():
    def f(q, k, v, g, beta, do, state, cu):
        return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=state,
                                                     cu_seqlens=cu, k_last=True)  # fmt: skip

    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = {"device": "cuda", "dtype": torch.bfloat16}
        q, k = (torch.empty(1, 100, 2, 128, **cuda) for _ in range(2))
        v, do = (torch.empty(1, 100, 4, 128, **cuda) for _ in range(2))
        g, beta = (torch.empty(1, 100, 4, device="cuda") for _ in range(2))
        state = torch.empty(3, 4, 128, 128, device="cuda")
        cu = torch.tensor([0, 10, 60, 100], dtype=torch.int32, device="cuda")
        graph = make_fx(f, tracing_mode="fake")(q, k, v, g, beta, do, state, cu)
        grads = f(q, k, v, g, beta, do, state, cu)
    assert "forgekernel.gated_delta_rule_chunked_bwd.default" in str(graph.graph)
    for grad, like in zip(grads, (q, k, v, g, beta, state)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device.type == "cuda"


def test_opcheck_of_the_backward_op(cpu_forward):
    inputs, cu = _inputs([5, 70], 1, 2, seed=11)
    flat = [x[0] for x in inputs[:5]]
    do = torch.randn(75, 2, 128).bfloat16()
    args = (*flat, inputs[5].transpose(-1, -2).contiguous(), cu, do,
            torch.randn(2, 2, 128, 128), 0.1, True, True)  # fmt: skip
    torch.library.opcheck(torch.ops.forgekernel.gated_delta_rule_chunked_bwd.default, args)


@pytest.mark.parametrize(("lens", "batch"), [([5, 70], 0), ([35, 35], 2)])
def test_opcheck_of_the_differentiable_forward_op(cpu_forward, lens, batch):
    """`batch`: 0, or the number of equal-length sequences (the wrapper's (B, T) batch)."""
    inputs, cu = _inputs(lens, 1, 2, seed=12)
    flat = _leaves([x[0] for x in inputs[:5]])
    args = (*flat, inputs[5].requires_grad_(), cu, 0.1, False, False, batch)
    torch.library.opcheck(torch.ops.forgekernel.gated_delta_rule_chunked.default, args)


def test_no_tokens_passes_the_state_gradient_through(cpu_forward):
    inputs, cu = _inputs([0, 0], 1, 2, seed=13)
    leaves = _leaves(inputs)
    _, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            output_final_state=True, cu_seqlens=cu)  # fmt: skip
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
    extra = (False, False)  # k_last, l2norm
    monkeypatch.setattr(dispatch, "capturing", lambda t: True)
    mode = _host_ops().HostOps("cpu")
    with mode, pytest.raises(RuntimeError, match="cannot be captured in a CUDA graph"):
        bwd._backward_interim(*args, *extra)
    assert mode.names == []
    monkeypatch.setattr(dispatch, "capturing", lambda t: False)
    grads = bwd._backward_interim(*args, *extra)
    assert [x.shape for x in grads] == [*(x.shape for x in flat), state.shape]
