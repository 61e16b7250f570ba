"""The backward of `forgekernel.gated_delta_rule` (issue 20) and its autograd.

`forgekernel::gated_delta_rule_chunked` (ops/gated_delta_rule_chunked.py, the forward on the
chunked WGMMA kernel) gets a backward formula here (`torch.library.register_autograd`): it
saves the forward's inputs (q, k, v, g, beta in their flat (T, heads, dim) form, the initial
state, the offsets) and nothing the kernel produced, and calls
`forgekernel::gated_delta_rule_chunked_bwd`, which returns the gradients in q, k, v, g, beta
and the initial state (grouped value heads: dq, dk summed over the value heads that share a
q / k head; l2norm's backward included; k_last: the state gradients in FlashInfer's layout).

INTERIM PATH: the backward op runs `reference.delta_rule_bwd.gated_delta_rule_chunked_backward`
in fp32 on the GPU with torch ops (`_backward_interim`: recompute of the chunk states, the
reverse state recurrence as one batched GEMM step per chunk, every chunk's gradients batched;
it reads the offsets on the host, one sync a call: a CUDA-graph capture is refused before any
work, `ops._dispatch.refuse_capture`). Correct, not fast: a backward kernel replaces
`_backward_interim` and nothing else (docs/linear_attention/NOTES.md "Backward").

Eager calls take the custom op when autograd records them (the dispatcher's ~30 us are nothing
beside this backward); under torch.compile the backward graph records the backward custom op,
whose fake implementation gives the shapes. `gated_delta_rule_backward` is the same backward for
callers with their own autograd and for the suite's backward timing.
"""

from __future__ import annotations

import torch

from forgekernel.ops import gated_delta_rule_chunked as fwd
from forgekernel.ops._dispatch import refuse_capture
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import check_cuda, check_shaped
from forgekernel.reference.delta_rule_bwd import gated_delta_rule_chunked_backward

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
NOT_CAPTURABLE = (
    "gated_delta_rule's interim backward reads the offsets on the host (its chunk layout, "
    "one sync a call) and builds its tables there"
)


def _to_kv(state: torch.Tensor | None, k_last: bool) -> torch.Tensor | None:
    """A state (or its gradient) in the reference's (N, HV, K, V) layout."""
    return state.transpose(-1, -2) if state is not None and k_last else state


def _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last,
                      l2norm) -> Grads:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). Flat tensors:
    q, k (T, H, K), v, do (T, HV, V), g, beta (T, HV); states in the op's layout."""
    refuse_capture(NOT_CAPTURABLE, q)
    grads = gated_delta_rule_chunked_backward(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta, do)), scale=scale,
        initial_state=_to_kv(initial_state, k_last), d_final_state=_to_kv(d_final, k_last),
        cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm, dtype=torch.float32,
    )  # fmt: skip
    flat = (x[0].to(like.dtype) for x, like in zip(grads[:5], (q, k, v, g, beta)))
    dh0 = _to_kv(grads[5], k_last).contiguous()
    return (*flat, dh0)


def _empty_grads(q, k, v, g, beta, cu_seqlens, k_last) -> Grads:
    n = cu_seqlens.shape[0] - 1
    shape = fwd._state_shape(n, v.shape[1], q.shape[2], v.shape[2], k_last)
    like = (q, k, v, g, beta)
    return (*(x.new_empty(x.shape) for x in like), q.new_empty(shape, dtype=torch.float32))


@torch.library.custom_op("forgekernel::gated_delta_rule_chunked_bwd", mutates_args=())
def _chunked_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    scale: float,
    k_last: bool,
    l2norm: bool,
) -> Grads:
    return _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                             k_last, l2norm)  # fmt: skip


@_chunked_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last, l2norm):
    return _empty_grads(q, k, v, g, beta, cu_seqlens, k_last)


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last,
              l2norm) -> Grads:  # fmt: skip
    """Eager: the interim path directly; traced: the custom op."""
    args = (q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last, l2norm)
    if _traced(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final):
        return torch.ops.forgekernel.gated_delta_rule_chunked_bwd(*args)
    return _backward_interim(*args)


# ---- autograd of the forward op --------------------------------------------------------------


def _setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.flags = (scale, k_last, l2norm)
    ctx.has_state = initial_state is not None


def _grad(ctx, do, d_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    grads = _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *ctx.flags)
    dh0 = grads[5] if ctx.has_state else None
    return (*grads[:5], dh0, None, None, None, None)


torch.library.register_autograd(
    "forgekernel::gated_delta_rule_chunked", _grad, setup_context=_setup
)


# ---- explicit backward ---------------------------------------------------------------------


def gated_delta_rule_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    k_last: bool = False,
) -> Grads:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of `gated_delta_rule(q, k, v, g, beta, ...)`
    given do (B, T, HV, V) in q's dtype and d_final_state (the final state's gradient, in the
    initial state's layout) or None. Arguments as `gated_delta_rule`'s; the gradients come
    back shaped and typed as their inputs, d_initial_state fp32 (N, HV, ...) (the zero
    state's when initial_state is None)."""
    b, t, _, hv, dk, dv = fwd._check_heads(q, k, v)
    check_shaped("g", g, (b, t, hv), fwd.F32)
    check_shaped("beta", beta, (b, t, hv), (torch.float32, q.dtype))
    check_shaped("do", do, (b, t, hv, dv), (q.dtype,))
    n = b if cu_seqlens is None else fwd._check_offsets(cu_seqlens, b, t)
    state_shape = fwd._state_shape(n, hv, dk, dv, k_last)
    if initial_state is not None:
        check_shaped("initial_state", initial_state, state_shape, fwd.F32)
    if d_final_state is not None:
        check_shaped("d_final_state", d_final_state, state_shape, fwd.F32)
    check_cuda("q", q)
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    scale = float(dk**-0.5 if scale is None else scale)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    grads = _backward(*flat[:5], initial_state, cu_seqlens.to(torch.int32), flat[5],
                      d_final_state, scale, k_last, use_qk_l2norm_in_kernel)  # fmt: skip
    shaped = (x.reshape(b, t, *x.shape[1:]) for x in grads[:5])
    return (*shaped, grads[5])


__all__ = ["gated_delta_rule_backward"]
