"""`forgekernel.attention`: O = softmax(scale * Q K^T + mask) V on Hopper.

FlashAttention layout (batch, seqlen, heads, head_dim), GQA/MQA, bottom-right causal mask,
LSE fp32 (batch, heads, seqlen_q). Eager calls go straight to the kernel; under `torch.compile`
the same work runs through the custom ops `forgekernel::attention_fwd` (and `_out`,
`attention_varlen_fwd`), whose fake implementations give the compiler shapes. Calls with no
input requiring grad keep no autograd bookkeeping; the others take `attention_fwd`, whose
backward (`ops/attention_bwd.py`) saves q, k, v, o, lse.
"""

from __future__ import annotations

import math
from numbers import Real

import torch

from forgekernel.ops._dispatch import num_sms, wants_grad
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    DTYPE_NAMES,
    as_tma_ready,
    check_bool,
    check_cuda,
    check_same_device,
    check_same_dtype,
    check_shaped,
    check_tensor,
    tma_ready,
)
from forgekernel.runtime.cache import get_kernel

# (head_dim, head_dim_v) the sm90 kernel is built for: equal dims, plus DeepSeek's 192/128
# prefill (OPS.md's list).
SUPPORTED_HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))
LOG2E = math.log2(math.e)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ndim: int) -> None:
    """Ranks, dtypes, heads and head dims; the seqlen/heads/dim axes are the last three."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim=ndim, cuda=False)
    check_same_dtype(q=q, k=k, v=v)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(
            f"k and v must agree in every dim but head_dim (same seqlen and kv heads), "
            f"got k {tuple(k.shape)} and v {tuple(v.shape)}"
        )
    hq, hkv = q.shape[-2], k.shape[-2]
    if hkv == 0 or hq % hkv:
        raise ValueError(
            f"the number of query heads Hq = {hq} (q) must be a multiple of the number of "
            f"kv heads Hkv = {hkv} (k, v)"
        )
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"k head_dim = {k.shape[-1]} must equal q head_dim = {q.shape[-1]}")
    if (q.shape[-1], v.shape[-1]) not in SUPPORTED_HEAD_DIMS:
        raise ValueError(
            f"head_dim = {q.shape[-1]} with head_dim_v = {v.shape[-1]} is not supported; "
            f"supported (head_dim, head_dim_v): {', '.join(map(str, SUPPORTED_HEAD_DIMS))}"
        )


def _check_flags(causal: object, softmax_scale: object, head_dim: int) -> float:
    """The softmax scale to use (default 1/sqrt(head_dim))."""
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, Real):
        raise TypeError(f"softmax_scale must be a float or None, got {softmax_scale!r}")
    if not math.isfinite(softmax_scale) or softmax_scale < 0:
        raise ValueError(f"softmax_scale must be finite and >= 0, got {softmax_scale}")
    return float(softmax_scale)


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
    for name, t in (("k", k), ("v", v)):
        if t.shape[0] != q.shape[0]:
            raise ValueError(f"{name} has batch size {t.shape[0]} but q has {q.shape[0]}")
    scale = _check_flags(causal, softmax_scale, q.shape[-1])
    if out is not None:
        _check_out(out, q, v)
    check_cuda("q", q)
    check_same_device(q=q, k=k, v=v, **({} if out is None else {"o": out[0], "lse": out[1]}))
    return scale


# Pack-GQA below this many query rows: a short query's tile of one head would be mostly empty
# rows, and every head of a group would stream the same K/V.
PACK_GQA_MAX_SQ = 128


def pack_gqa_q(q: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Sq, Hkv * G, D) -> (B, Sq * G, Hkv, D): query head h * G + g of position s becomes
    row s * G + g of head h (a contiguous copy)."""
    b, sq, hq, d = q.shape
    return q.view(b, sq, hq // group, group, d).transpose(2, 3).reshape(b, sq * group, -1, d)


def unpack_gqa(o: torch.Tensor, lse: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed outputs back: o (B, Sq * G, Hkv, Dv) -> (B, Sq, Hq, Dv) and lse
    (B, Hkv, Sq * G) -> (B, Hq, Sq), as views."""
    b, rows, hkv, dv = o.shape
    sq = rows // group
    o = o.view(b, sq, group, hkv, dv).transpose(2, 3).reshape(b, sq, hkv * group, dv)
    lse = lse.view(b, hkv, sq, group).transpose(2, 3).reshape(b, hkv * group, sq)
    return o, lse


def _launch_fwd(q, k, v, o, lse, scale: float, causal: bool) -> None:
    """The kernel call and nothing else: inputs and outputs are TMA-ready, sizes non-zero.
    Short queries with GQA run packed: the G query heads of a kv head become G rows per
    position of one head (qgroup = G tells the kernel's causal mask)."""
    from forgekernel.kernels.attention.fwd import sm90

    # params_for without a config takes the leaf's analytical default for the head dims.
    params = sm90.params_for(DTYPE_NAMES[q.dtype], q.shape[-1], v.shape[-1], causal)
    fn = get_kernel(sm90.SPEC, params)
    group = q.shape[2] // k.shape[2]
    with torch.cuda.device(q.device):
        if group > 1 and q.shape[1] < PACK_GQA_MAX_SQ:
            qp = pack_gqa_q(q, group)
            b, rows, hkv, _ = qp.shape
            op = q.new_empty(b, rows, hkv, v.shape[-1])
            lsep = q.new_empty(b, hkv, rows, dtype=torch.float32)
            fn(qp, k, v, op, lsep, None, None, scale * LOG2E, 0, group, num_sms(q.device.index))
            op, lsep = unpack_gqa(op, lsep, group)
            o.copy_(op)
            lse.copy_(lsep)
        else:
            fn(q, k, v, o, lse, None, None, scale * LOG2E, 0, 1, num_sms(q.device.index))


def _launch(q, k, v, o, lse, scale: float, causal: bool) -> None:
    if o.numel() == 0:  # no batch, query rows or heads
        return
    if k.shape[1] == 0:  # every row sees no key
        o.zero_()
        lse.fill_(float("-inf"))
        return
    q, k, v = as_tma_ready(q), as_tma_ready(k), as_tma_ready(v)
    o_dst = o if tma_ready(o) else torch.empty(o.shape, dtype=o.dtype, device=o.device)
    lse_dst = lse if lse.is_contiguous() else torch.empty(lse.shape, device=lse.device)
    _launch_fwd(q, k, v, o_dst, lse_dst, scale, causal)
    if o_dst is not o:
        o.copy_(o_dst)
    if lse_dst is not lse:
        lse.copy_(lse_dst)


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
    _launch(q, k, v, o, lse, softmax_scale, causal)
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
    _launch(q, k, v, o, lse, softmax_scale, causal)


@_attention_fwd_out_op.register_fake
def _(q, k, v, o, lse, causal, softmax_scale):
    return None


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
    check_bool("deterministic", deterministic)
    scale = _validate(q, k, v, causal, softmax_scale, out)
    if wants_grad(q, k, v):
        o, lse = torch.ops.forgekernel.attention_fwd(q, k, v, causal, scale, deterministic)
        if out is not None:
            out[0].copy_(o)
            out[1].copy_(lse)
            o, lse = out
    elif _traced(q, k, v, *(out or ())):
        if out is None:
            o, lse = torch.ops.forgekernel.attention_fwd(q, k, v, causal, scale)
        else:
            torch.ops.forgekernel.attention_fwd_out(q, k, v, out[0], out[1], causal, scale)
            o, lse = out
    else:
        o, lse = out if out is not None else _empty_outputs(q, v)
        _launch(q, k, v, o, lse, scale, causal)
    return (o, lse) if return_lse else o
