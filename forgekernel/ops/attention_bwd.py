"""Attention backward: dQ, dK, dV from dO, O and LSE, and the autograd of the forward ops.

`forgekernel.attention` / `attention_varlen` are differentiable: their forward custom ops
(`forgekernel::attention_fwd`, `attention_varlen_fwd`) get a backward formula here
(`torch.library.register_autograd`) that saves q, k, v, o, lse (and the offsets) and nothing
else, and calls `forgekernel::attention_bwd` / `attention_varlen_bwd`. GQA is the kernel's:
dk and dv come back already summed over each kv head's query heads. The LSE output is not
differentiable (the kernel has no dLSE input): a loss that reads it gets no gradient through it.

Eager backward calls go straight to the leaf's host launcher
(`kernels/attention/bwd/sm90/launch.py`); under torch.compile the backward graph records
the custom ops, whose fake implementations give the shapes. `attention_backward` is the same
kernel for callers with their own autograd (and the bwd suite): it writes into `out=`.
"""

from __future__ import annotations

import torch

# (head_dim, head_dim_v) pairs the sm90 backward kernel is built for (a subset of the forward's).
from forgekernel.kernels.attention.bwd.sm90 import HEAD_DIMS as BWD_HEAD_DIMS
from forgekernel.kernels.attention.bwd.sm90 import launch as bwd_sm90
from forgekernel.ops._dispatch import plain, tracing
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    PassedChecks,
    arg_key,
    check_bool,
    check_cuda,
    check_same_device,
    check_shaped,
    on_one_device,
)
from forgekernel.ops.attention import _check_flags, _check_qkv, out_shapes
from forgekernel.ops.attention_varlen import _check_cu_seqlens, _offsets_on_device

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a varlen call, None otherwise.
Seqs = tuple[torch.Tensor, torch.Tensor, int, int] | None


def _check_head_dims(q: torch.Tensor, v: torch.Tensor) -> None:
    if (q.shape[-1], v.shape[-1]) not in BWD_HEAD_DIMS:
        raise ValueError(
            f"attention backward: head_dim = {q.shape[-1]} with head_dim_v = {v.shape[-1]} is "
            f"not supported; supported (head_dim, head_dim_v): "
            f"{', '.join(map(str, BWD_HEAD_DIMS))}"
        )


def _launch_kernel(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs) -> None:
    """The leaf's launcher (the one name the CPU tests replace with a reference): empty
    problems, TMA-ready copies and strided gradients are its business."""
    grads = (dq, dk, dv)
    if seqs is None:
        seqs = (None, None, None, None)
    bwd_sm90.attention_bwd(q, k, v, o, lse, do, *grads, scale, causal, deterministic, *seqs)


def _empty_grads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Grads:
    """Contiguous, q's / k's / v's shape, dtype and device (new_empty: half the host time of
    torch.empty with shape, dtype and device read out)."""
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


# ---- custom ops ------------------------------------------------------------------------------


@torch.library.custom_op("forgekernel::attention_bwd", mutates_args=())
def _attention_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _empty_grads(q, k, v)
    _launch_kernel(q, k, v, o, lse, do, *grads, softmax_scale, causal, deterministic, None)
    return grads


@_attention_bwd_op.register_fake
def _(q, k, v, o, lse, do, causal, softmax_scale, deterministic):
    return _empty_grads(q, k, v)


@torch.library.custom_op("forgekernel::attention_bwd_out", mutates_args=("dq", "dk", "dv"))
def _attention_bwd_out_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
) -> None:
    _launch_kernel(q, k, v, o, lse, do, dq, dk, dv, softmax_scale, causal, deterministic, None)


@_attention_bwd_out_op.register_fake
def _(q, k, v, o, lse, do, dq, dk, dv, causal, softmax_scale, deterministic):
    return None


@torch.library.custom_op("forgekernel::attention_varlen_bwd", mutates_args=())
def _attention_varlen_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    deterministic: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    grads = _empty_grads(q, k, v)
    seqs = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _launch_kernel(q, k, v, o, lse, do, *grads, softmax_scale, causal, deterministic, seqs)
    return grads


@_attention_varlen_bwd_op.register_fake
def _(q, k, v, o, lse, do, cu_q, cu_k, max_q, max_k, causal, softmax_scale, deterministic):
    return _empty_grads(q, k, v)


# ---- autograd of the forward ops ---------------------------------------------------------------


def _backward(q, k, v, o, lse, do, causal, scale, deterministic, seqs: Seqs) -> Grads:
    """Eager: the kernel directly (no dispatcher); traced: the custom op."""
    _check_head_dims(q, v)
    if _traced(q, k, v, o, lse, do):
        if seqs is None:
            return torch.ops.forgekernel.attention_bwd(
                q, k, v, o, lse, do, causal, scale, deterministic
            )
        return torch.ops.forgekernel.attention_varlen_bwd(
            q, k, v, o, lse, do, *seqs, causal, scale, deterministic
        )
    grads = _empty_grads(q, k, v)
    _launch_kernel(q, k, v, o, lse, do, *grads, scale, causal, deterministic, seqs)
    return grads


def _setup_fwd(ctx, inputs, output) -> None:
    q, k, v, causal, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse)
    ctx.flags = (causal, scale, deterministic)
    ctx.mark_non_differentiable(lse)


def _grad_output(do: torch.Tensor | None, o: torch.Tensor) -> torch.Tensor:
    """dO as autograd materializes a missing one (zeros shaped as o, contiguous), for the
    eager Functions, which ask autograd not to materialize (ops/attention.py
    `_EagerAttentionFwd`: dLSE is never read)."""
    return o.new_zeros(o.shape) if do is None else do


def _grad_fwd(ctx, do, dlse):
    q, k, v, o, lse = ctx.saved_tensors
    do = _grad_output(do, o)
    dq, dk, dv = _backward(q, k, v, o, lse, do, *ctx.flags, seqs=None)
    return dq, dk, dv, None, None, None


def _setup_varlen_fwd(ctx, inputs, output) -> None:
    q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic = inputs
    o, lse = output
    ctx.save_for_backward(q, k, v, o, lse, cu_q, cu_k)
    ctx.max_seqlens = (max_q, max_k)
    ctx.flags = (causal, scale, deterministic)
    ctx.mark_non_differentiable(lse)


def _grad_varlen_fwd(ctx, do, dlse):
    q, k, v, o, lse, cu_q, cu_k = ctx.saved_tensors
    do = _grad_output(do, o)
    seqs = (cu_q, cu_k, *ctx.max_seqlens)
    dq, dk, dv = _backward(q, k, v, o, lse, do, *ctx.flags, seqs=seqs)
    return dq, dk, dv, None, None, None, None, None, None, None


torch.library.register_autograd("forgekernel::attention_fwd", _grad_fwd, setup_context=_setup_fwd)
torch.library.register_autograd(
    "forgekernel::attention_varlen_fwd", _grad_varlen_fwd, setup_context=_setup_varlen_fwd
)


# ---- explicit backward -------------------------------------------------------------------------


def _check_bwd_tensors(q, k, v, o, lse, do, out) -> None:
    """o, do: q's shape with v's head dim, q's dtype; lse (B, Hq, Sq) or, varlen, (Hq, total_q)
    fp32; out: three tensors shaped and typed as q, k, v."""
    o_shape, lse_shape = out_shapes(q, v)
    want = [
        ("o", o, o_shape, (q.dtype,)),
        ("lse", lse, lse_shape, (torch.float32,)),
        ("do", do, o_shape, (q.dtype,)),
    ]
    if out is not None:
        if not isinstance(out, (tuple, list)) or len(out) != 3:
            raise TypeError("out must be a tuple (dq, dk, dv) of three tensors")
        for name, g, like in zip(("out[0] (dq)", "out[1] (dk)", "out[2] (dv)"), out, (q, k, v)):
            want.append((name, g, tuple(like.shape), (q.dtype,)))
    for name, t, shape, dtypes in want:
        check_shaped(name, t, shape, dtypes)


def _check_devices(q, k, v, o, lse, do, out) -> None:
    """Every tensor on q's device; `check_same_device` names the first that is not (its
    keyword arguments cost 2 us per call when built for nothing)."""
    device = q.device
    for t in (k, v, o, lse, do) if out is None else (k, v, o, lse, do, *out):
        if t.device != device:
            grads = {} if out is None else dict(zip(("dq", "dk", "dv"), out))
            check_same_device(q=q, k=k, v=v, o=o, lse=lse, do=do, **grads)


def _validate(q, k, v, o, lse, do, causal, softmax_scale, deterministic, out) -> float:
    """The named checks of `attention_backward`: the softmax scale to use."""
    _check_qkv(q, k, v, ndim=4)
    _check_head_dims(q, v)
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {t.shape[0]} but q has {q.shape[0]}")
    scale = _check_flags(causal, softmax_scale, q.shape[-1])
    check_bool("deterministic", deterministic)
    _check_bwd_tensors(q, k, v, o, lse, do, out)
    check_cuda("q", q)
    _check_devices(q, k, v, o, lse, do, out)
    return scale


# The named checks' softmax scale per plain eager call's key, as `forgekernel.attention`'s
# (`ops/attention.py` _PASSED): they depend on the shapes, dtypes and the flags' exact types and
# values alone but for the device checks, which `_seen` makes per call (the bench's host case
# on meta tensors, no-op kernels: 23.0 -> 17.5 us per call on the project's CPU).
_PASSED = PassedChecks()


def _seen(q, k, v, o, lse, do, causal, softmax_scale, deterministic, out) -> tuple:
    """(key, scale) of a call: key None when it is traced or its tensors are not plain (the
    named checks, then `traced` decides), scale None when the named checks must decide."""
    if tracing() or not plain(q, k, v, o, lse, do):
        return None, None
    if out is None:
        outs = ()
    elif (type(out) is tuple or type(out) is list) and len(out) == 3 and plain(*out):
        dq, dk, dv = out
        outs = (dq.shape, dq.dtype, dk.shape, dk.dtype, dv.shape, dv.dtype)
    else:
        return None, None
    flags = (arg_key(causal), arg_key(softmax_scale), arg_key(deterministic))
    key = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, o.shape, o.dtype, lse.shape,
           lse.dtype, do.shape, do.dtype, outs, flags)  # fmt: skip
    scale = _PASSED.get(key)
    if scale is None:
        return (None if None in flags else key), None
    check_cuda("q", q)
    # a tensor on another device: the named checks name it
    return key, scale if on_one_device(q, k, v, o, lse, do, *(out or ())) else None


def attention_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    deterministic: bool = False,
    out: Grads | None = None,
) -> Grads:
    """(dq, dk, dv) of `attention(q, k, v, causal, softmax_scale)` given its o and lse and dO.

    q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv) as for `attention`; o and do
    (B, Sq, Hq, Dv) in q's dtype; lse (B, Hq, Sq) fp32 as `attention(..., return_lse=True)`
    returns it. dk, dv are summed over each kv head's query heads (GQA). `deterministic=True`:
    bitwise-repeatable gradients (no atomic accumulation order). `out=(dq, dk, dv)` writes into
    given buffers (any views); strided inputs are copied first.
    """
    flags = (causal, softmax_scale, deterministic, out)
    key, scale = _seen(q, k, v, o, lse, do, *flags)
    if scale is None:
        scale = _validate(q, k, v, o, lse, do, *flags)
        if key is not None:
            _PASSED.remember(key, scale)
    # a key: plain tensors, no mode
    if key is None and _traced(q, k, v, o, lse, do, *(out or ())):
        if out is None:
            return torch.ops.forgekernel.attention_bwd(
                q, k, v, o, lse, do, causal, scale, deterministic
            )
        torch.ops.forgekernel.attention_bwd_out(
            q, k, v, o, lse, do, *out, causal, scale, deterministic
        )
        return tuple(out)
    out = tuple(out) if out is not None else _empty_grads(q, k, v)
    _launch_kernel(q, k, v, o, lse, do, *out, scale, causal, deterministic, None)
    return out


def attention_varlen_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    *,
    deterministic: bool = False,
    out: Grads | None = None,
) -> Grads:
    """`attention_backward` of `attention_varlen`: q, o, do (total_q, Hq, *), k, v
    (total_k, Hkv, *), lse (Hq, total_q); offsets as `attention_varlen` takes them."""
    _check_qkv(q, k, v, ndim=3)
    _check_head_dims(q, v)
    _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = _check_flags(causal, softmax_scale, q.shape[-1])
    check_bool("deterministic", deterministic)
    _check_bwd_tensors(q, k, v, o, lse, do, out)
    check_cuda("q", q)
    _check_devices(q, k, v, o, lse, do, out)
    cu_q, cu_k = _offsets_on_device(q, cu_seqlens_q, cu_seqlens_k)
    seqs = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
    if _traced(q, k, v, o, lse, do, cu_q, cu_k, *(out or ())):
        grads = torch.ops.forgekernel.attention_varlen_bwd(
            q, k, v, o, lse, do, *seqs, causal, scale, deterministic
        )
        if out is None:
            return grads
        for g, r in zip(out, grads):
            g.copy_(r)
        return tuple(out)
    out = tuple(out) if out is not None else _empty_grads(q, k, v)
    _launch_kernel(q, k, v, o, lse, do, *out, scale, causal, deterministic, seqs)
    return out


__all__ = ["attention_backward", "attention_varlen_backward"]
