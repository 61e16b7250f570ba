"""`forgekernel.attention`: O = softmax(scale * Q K^T + mask) V on Hopper.

FlashAttention layout (batch, seqlen, heads, head_dim), GQA/MQA, bottom-right causal mask,
LSE fp32 (batch, heads, seqlen_q). This module validates; eager calls then go straight to the
leaf's host launcher (`kernels/attention/fwd/sm90/launch.py`: empty problems, TMA-ready
copies, pack-GQA, the compiled function's argument order); under `torch.compile` the same work
runs through the custom ops `forgekernel::attention_fwd` (and `_out`, `attention_varlen_fwd`),
whose fake implementations give the compiler shapes. Calls with no input requiring grad keep
no autograd bookkeeping; the others record the backward of `attention_fwd`
(`ops/attention_bwd.py`: saves q, k, v, o, lse), in eager mode through `_EagerAttentionFwd`
(no dispatcher), traced through the custom op.
"""

from __future__ import annotations

import functools
import importlib

import torch

from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_sm90

# (head_dim, head_dim_v) the sm90 kernel is built for: equal dims, plus DeepSeek's 192/128
# prefill (OPS.md's list).
from forgekernel.kernels.attention.fwd.sm90.config import HEAD_DIMS as SUPPORTED_HEAD_DIMS
from forgekernel.ops._dispatch import plain, tracing, wants_grad
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    PassedChecks,
    arg_key,
    check_bool,
    check_cuda,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_shaped,
    check_tensor,
    on_one_device,
)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int) -> None:
    """Ranks, dtypes, heads and head dims; the seqlen/heads/dim axes are the last three."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=ndim, cuda=False)
    check_same_dtype(q=q, k=k, v=v)
    # Each shape read once (every call runs this: 2.5 us on the CPU read per check, 2.0 so).
    qs, ks, vs = q.shape, k.shape, v.shape
    if ks[:-1] != vs[:-1]:
        raise ValueError(
            f"k and v must agree in every dim but head_dim (same seqlen and kv heads), "
            f"got k {tuple(ks)} and v {tuple(vs)}"
        )
    hq, hkv = qs[-2], ks[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"the number of query heads Hq = {hq} (q) must be a multiple of the number of "
            f"kv heads Hkv = {hkv} (k, v)"
        )
    if ks[-1] != qs[-1]:
        raise ValueError(f"k head_dim = {ks[-1]} must equal q head_dim = {qs[-1]}")
    if (qs[-1], vs[-1]) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim = {qs[-1]} with head_dim_v = {vs[-1]} is not supported; "
            f"supported (head_dim, head_dim_v): {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )


def _check_flags(causal: object, softmax_scale: object, head_dim: int) -> float:
    """The softmax scale to use (default 1/sqrt(head_dim))."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    return check_scale("softmax_scale", softmax_scale, head_dim**-0.5)


def out_shapes(q: torch.Tensor, v: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Shapes of o and lse for q (..., S, Hq, D) and v's head dim: o q's with Dv, lse
    (..., Hq, S) (fixed length (B, Hq, Sq); varlen, q (total, Hq, D): (Hq, total))."""
    return (*q.shape[:-1], v.shape[-1]), (*q.shape[:-3], q.shape[-2], q.shape[-3])


def _check_out(out: object, q: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(out, (tuple, list)) or len(out) != 2:
        raise TypeError("out must be a tuple (o, lse) of two tensors")
    o_shape, lse_shape = out_shapes(q, v)
    check_shaped("out[0] (o)", out[0], o_shape, (q.dtype,))
    check_shaped("out[1] (lse)", out[1], lse_shape, (torch.float32,))


def _validate(q, k, v, causal, softmax_scale, out) -> float:
    # Device checks come last so that every shape error is reported the same on any device.
    _check_qkv(q, k, v, ndim=4)
    batch = q.shape[0]
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != batch:
            raise ValueError(f"{name} has batch size {t.shape[0]} but q has {batch}")
    scale = _check_flags(causal, softmax_scale, q.shape[-1])
    if out is not None:
        _check_out(out, q, v)
    check_cuda("q", q)
    check_same_device(q=q, k=k, v=v, **({} if out is None else {"o": out[0], "lse": out[1]}))
    return scale


# The named checks' softmax scale per plain eager call's key (issue 17: ~4 us per call on the
# CPU with a kernel stub): `_validate` and the deterministic flag's check depend on the shapes,
# dtypes and the flags' exact types and values alone but for the device checks, which
# `_seen` makes per call.
_PASSED = PassedChecks()


def out_key(out: object) -> tuple | None:
    """`out=`'s part of a key: () for None, the shapes and dtypes of a pair of plain tensors,
    None (no key: the named checks decide) for anything else."""
    if out is None:
        return ()
    if (type(out) is tuple or type(out) is list) and len(out) == 2 and plain(*out):
        o, lse = out
        return (o.shape, o.dtype, lse.shape, lse.dtype)
    return None


def _seen(q, k, v, causal, softmax_scale, out, deterministic) -> tuple:
    """(key, scale) of a call: key None when it is traced or its tensors are not plain (the
    named checks, then `traced` decides), scale None when the named checks must decide."""
    if tracing() or not plain(q, k, v):
        return None, None
    outs = out_key(out)
    if outs is None:
        return None, None
    flags = (arg_key(causal), arg_key(softmax_scale), arg_key(deterministic))
    key = (q.shape, q.dtype, k.shape, k.dtype, v.shape, v.dtype, outs, flags)
    scale = _PASSED.get(key)
    if scale is None:
        return (None if None in flags else key), None
    check_cuda("q", q)
    # a tensor on another device: the named checks name it
    return key, scale if on_one_device(q, k, v, *(out or ())) else None


# The leaf's launcher, under the one name the CPU tests replace with a reference.
_launch_fwd = fwd_sm90.attention_fwd


def _empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    b, sq, hq, _ = q.shape
    return q.new_empty(b, sq, hq, v.shape[-1]), q.new_empty(b, hq, sq, dtype=torch.float32)


# `deterministic` does nothing forward; it is here so that the backward (registered on this op
# in ops/attention_bwd.py) receives it.
@torch.library.custom_op("forgekernel::attention_fwd", mutates_args=())
def _attention_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _empty_outputs(q, v)
    _launch_fwd(q, k, v, o, lse, softmax_scale, causal)
    return o, lse


@_attention_fwd_op.register_fake
def _(q, k, v, causal, softmax_scale, deterministic=False):
    return _empty_outputs(q, v)


@torch.library.custom_op("forgekernel::attention_fwd_out", mutates_args=("o", "lse"))
def _attention_fwd_out_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    softmax_scale: float,
) -> None:
    _launch_fwd(q, k, v, o, lse, softmax_scale, causal)


@_attention_fwd_out_op.register_fake
def _(q, k, v, o, lse, causal, softmax_scale):
    return None


@functools.cache
def _autograd_of_fwd():
    """ops/attention_bwd.py, which imports this module: the forward op's autograd formula."""
    return importlib.import_module("forgekernel.ops.attention_bwd")


class _EagerAttentionFwd(torch.autograd.Function):
    """An eager call that autograd records: the custom op's own autograd formula (setup and
    backward from ops/attention_bwd.py, the same saved tensors, the same backward launch)
    without the dispatcher. 31 us per call on the CPU through the custom op, 12 us here (a
    kernel stub); old-style forward(ctx, ...) on purpose: a Function with `setup_context`
    binds its arguments through inspect.signature on every call, which cost as much as the
    dispatcher. Functorch transforms need `setup_context`: they take the custom op.

    No materialized zero gradients: the backward gets None for dLSE (never read: the LSE is
    not differentiable) instead of a zero (B, Hq, Sq) fp32 tensor per backward (an allocation
    and a fill kernel on the GPU); a missing dO becomes those zeros in the backward
    (`_grad_output`)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, deterministic):
        ctx.set_materialize_grads(False)
        o, lse = _empty_outputs(q, v)
        _launch_fwd(q, k, v, o, lse, scale, causal)
        _autograd_of_fwd()._setup_fwd(ctx, (q, k, v, causal, scale, deterministic), (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        return _autograd_of_fwd()._grad_fwd(ctx, do, dlse)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """softmax(scale * Q K^T + mask) V for q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    fp16 or bf16 (all alike), fp32 accumulation, CUDA. Hq must be a multiple of Hkv (query head
    h reads kv head h // (Hq // Hkv)). (D, Dv) in SUPPORTED_HEAD_DIMS. `causal` masks key j
    from query i when j > i + Sk - Sq (bottom-right); a row that sees no key gives 0 and
    LSE -inf. Scale defaults to 1/sqrt(D). Returns o (B, Sq, Hq, Dv), and with `return_lse`
    also lse (B, Hq, Sq) fp32 (natural log). `out=(o, lse)` writes into given buffers (any
    views). Inputs whose last dim is strided or whose strides/base are not 16-byte aligned are
    copied first. Differentiable in q, k, v (not through lse): when one of them requires grad,
    q, k, v, o, lse are saved and backward computes dq, dk, dv (GQA: dk, dv summed over each
    group); `deterministic=True` makes that backward bitwise-repeatable. With `out=` and grad,
    o and lse are computed first and copied into out (autograd records the copy).
    """
    key, scale = _seen(q, k, v, causal, softmax_scale, out, deterministic)
    if scale is None:
        check_bool("deterministic", deterministic)
        scale = _validate(q, k, v, causal, softmax_scale, out)
        if key is not None:
            _PASSED.remember(key, scale)
    # a key: plain tensors, no mode
    traced = key is None and _traced(q, k, v, *(out or ()))
    if wants_grad(q, k, v):
        if traced or torch._C._are_functorch_transforms_active():
            o, lse = torch.ops.forgekernel.attention_fwd(q, k, v, causal, scale, deterministic)
        else:
            o, lse = _EagerAttentionFwd.apply(q, k, v, causal, scale, deterministic)
        if out is not None:
            out[0].copy_(o)
            out[1].copy_(lse)
            o, lse = out
    elif traced:
        if out is None:
            o, lse = torch.ops.forgekernel.attention_fwd(q, k, v, causal, scale)
        else:
            torch.ops.forgekernel.attention_fwd_out(q, k, v, out[0], out[1], causal, scale)
            o, lse = out
    else:
        o, lse = out if out is not None else _empty_outputs(q, v)
        _launch_fwd(q, k, v, o, lse, scale, causal)
    return (o, lse) if return_lse else o
