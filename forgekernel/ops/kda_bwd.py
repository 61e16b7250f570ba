"""The backward of `forgekernel.ops.kda_chunked.kimi_delta_attention` (issue 20) and its
autograd, built as Gated DeltaNet's (ops/gated_delta_rule_bwd.py).

`forgekernel::kda_chunked` (ops/kda_chunked.py, the forward: the first-pass kernel + the WGMMA
recurrence kernel) gets a backward formula here (`torch.library.register_autograd`): it saves
the forward's inputs (q, k, v, g, beta in their flat (T, heads, ...) form, the initial state,
the offsets) and nothing the kernel produced, and calls `forgekernel::kda_chunked_bwd`, which
returns the gradients in q, k, v, g (per key channel), beta and the initial state (grouped
value heads: dq, dk summed over the value heads sharing a q / k head; l2norm's backward
included), each in its input's dtype (the initial state's fp32).

INTERIM PATH: the backward op runs `reference.kda_bwd.kimi_delta_attention_chunked_backward`
in fp32 on the GPU with torch ops (`_backward_interim`: recompute of the chunk states, the
reverse state recurrence as one batched GEMM step per chunk, every chunk's gradients batched,
the per-channel decays factored around sub-chunk reference points; it reads the offsets on
the host, one sync a call: a CUDA-graph capture is refused before any work,
`ops._dispatch.refuse_capture`). Correct, not fast: a backward kernel replaces
`_backward_interim` and nothing else (docs/linear_attention/NOTES.md "Kimi Delta Attention
backward").

`kimi_delta_attention_backward` is the same backward for callers with their own autograd and
for the suite's backward timing.
"""

from __future__ import annotations

import torch

from forgekernel.ops import kda_chunked as fwd
from forgekernel.ops._dispatch import refuse_capture
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import check_cuda, check_shaped
from forgekernel.reference.kda_bwd import kimi_delta_attention_chunked_backward

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
NOT_CAPTURABLE = (
    "kimi_delta_attention's interim backward reads the offsets on the host (its chunk layout, "
    "one sync a call) and builds its tables there"
)


def _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                      l2norm) -> Grads:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). Flat tensors:
    q, k (T, H, K), v, do (T, HV, V), g (T, HV, K), beta (T, HV); states (N, HV, K, V)."""
    refuse_capture(NOT_CAPTURABLE, q)
    grads = kimi_delta_attention_chunked_backward(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta, do)), scale=scale,
        initial_state=initial_state, d_final_state=d_final, cu_seqlens=cu_seqlens,
        use_qk_l2norm=l2norm, dtype=torch.float32,
    )  # fmt: skip
    flat = (x[0].to(like.dtype) for x, like in zip(grads[:5], (q, k, v, g, beta)))
    return (*flat, grads[5].contiguous())


def _empty_grads(q, k, v, g, beta, cu_seqlens) -> Grads:
    n = cu_seqlens.shape[0] - 1
    state = q.new_empty(n, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), state)


@torch.library.custom_op("forgekernel::kda_chunked_bwd", mutates_args=())
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
    l2norm: bool,
) -> Grads:
    return _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                             l2norm)  # fmt: skip


@_chunked_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm):
    return _empty_grads(q, k, v, g, beta, cu_seqlens)


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
              l2norm) -> Grads:  # fmt: skip
    """Eager: the interim path directly; traced: the custom op."""
    args = (q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm)
    if _traced(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final):
        return torch.ops.forgekernel.kda_chunked_bwd(*args)
    return _backward_interim(*args)


# ---- autograd of the forward op --------------------------------------------------------------


def _setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.flags = (scale, l2norm)
    ctx.has_state = initial_state is not None


def _grad(ctx, do, d_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    grads = _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *ctx.flags)
    dh0 = grads[5] if ctx.has_state else None
    return (*grads[:5], dh0, None, None, None)


torch.library.register_autograd("forgekernel::kda_chunked", _grad, setup_context=_setup)


# ---- explicit backward ---------------------------------------------------------------------


def kimi_delta_attention_backward(
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
) -> Grads:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of `kimi_delta_attention(q, k, v, g, beta,
    ...)` given do (B, T, HV, V) in q's dtype and d_final_state (N, HV, K, V) fp32 or None.
    Arguments as `kimi_delta_attention`'s; the gradients come back shaped and typed as their
    inputs, d_initial_state fp32 (N, HV, K, V) (the zero state's when initial_state is None)."""
    fwd._validate(q, k, v, g, beta, initial_state, cu_seqlens, device_check=False)
    b, t, hv, dv = v.shape
    check_shaped("do", do, (b, t, hv, dv), (q.dtype,))
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if d_final_state is not None:
        check_shaped("d_final_state", d_final_state, (n, hv, q.shape[3], dv), fwd.F32)
    check_cuda("q", q)
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    scale = float(q.shape[3] ** -0.5 if scale is None else scale)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    grads = _backward(*flat[:5], initial_state, cu_seqlens.to(torch.int32), flat[5],
                      d_final_state, scale, use_qk_l2norm_in_kernel)  # fmt: skip
    shaped = (x.reshape(b, t, *x.shape[1:]) for x in grads[:5])
    return (*shaped, grads[5])


__all__ = ["kimi_delta_attention_backward"]
