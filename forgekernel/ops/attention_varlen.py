"""`forgekernel.attention_varlen`: attention over packed variable-length sequences.

Tokens of all sequences packed as (total_tokens, heads, head_dim); sequence i spans
cu_seqlens[i]:cu_seqlens[i + 1]. Same math, dtypes and head dims as `forgekernel.attention`.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_sm90
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._dispatch import wants_grad
from forgekernel.ops._validate import check_bool, check_cuda, check_same_device, check_tensor
from forgekernel.ops.attention import _autograd_of_fwd, _check_flags, _check_out, _check_qkv


def _check_max_seqlen(name: str, value: object, tokens: int, owner: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {value!r}")
    if value < 0:
        raise ValueError(f"{name} must be >= 0, got {value}")
    # 0 with tokens: the launcher would return at once and leave o unwritten (device offsets
    # are not read, so nothing else would catch it).
    if value == 0 and tokens > 0:
        raise ValueError(f"{name} = 0 but {owner} holds {tokens} tokens: it must be >= 1")


def _check_offsets(name: str, cu: torch.Tensor, total: int, owner: str, max_name: str, mx: int):
    """Values of a CPU cu_seqlens: 0 first, non-decreasing, `total` last, no length > max."""
    offsets = cu.tolist()
    if offsets[0] != 0:
        raise ValueError(f"{name}[0] must be 0, got {offsets[0]}")
    lengths = [b - a for a, b in zip(offsets, offsets[1:])]
    if min(lengths) < 0:
        raise ValueError(f"{name} must be non-decreasing, got {offsets}")
    if offsets[-1] != total:
        raise ValueError(
            f"{name}[-1] = {offsets[-1]} must equal the number of tokens of {owner} ({total})"
        )
    if max(lengths) > mx:
        raise ValueError(f"{max_name} = {mx} is less than the longest sequence ({max(lengths)})")


def _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) -> None:
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        check_tensor(name, cu, ndim=1, dtypes=(torch.int32,), cuda=False)
        if cu.shape[0] < 2:
            raise ValueError(f"{name} must hold batch + 1 >= 2 offsets, got {cu.shape[0]}")
    if cu_seqlens_q.shape != cu_seqlens_k.shape:
        raise ValueError(
            f"cu_seqlens_q has {cu_seqlens_q.shape[0]} entries but cu_seqlens_k has "
            f"{cu_seqlens_k.shape[0]}; both must be batch + 1"
        )
    _check_max_seqlen("max_seqlen_q", max_seqlen_q, q.shape[0], "q")
    _check_max_seqlen("max_seqlen_k", max_seqlen_k, k.shape[0], "k")
    for name, cu, total, owner, max_name, mx in (
        ("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q", "max_seqlen_q", max_seqlen_q),
        ("cu_seqlens_k", cu_seqlens_k, k.shape[0], "k, v", "max_seqlen_k", max_seqlen_k),
    ):
        # Reading CUDA offsets would cost a device sync per call; only host tensors are read.
        if cu.device.type == "cpu" and not _traced(cu):
            _check_offsets(name, cu, total, owner, max_name, mx)


def _offsets_on_device(q, cu_seqlens_q, cu_seqlens_k) -> tuple[torch.Tensor, torch.Tensor]:
    """Host offsets travel to q's device; device offsets must already be on it."""
    cu_q, cu_k = (
        cu.to(q.device) if cu.device.type == "cpu" else cu for cu in (cu_seqlens_q, cu_seqlens_k)
    )
    check_same_device(q=q, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    return cu_q, cu_k


def _launch_varlen_fwd(q, k, v, o, lse, seqs: tuple, scale: float, causal: bool) -> None:
    """The leaf's launcher (the one name the CPU tests replace with a reference); seqs =
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), the offsets on q's device."""
    cu_q, cu_k, max_seqlen_q, _ = seqs
    fwd_sm90.attention_varlen_fwd(q, k, v, o, lse, cu_q, cu_k, max_seqlen_q, scale, causal)


def _empty_outputs(q: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    total, hq, _ = q.shape
    return q.new_empty(total, hq, v.shape[-1]), q.new_empty(hq, total, dtype=torch.float32)


@torch.library.custom_op("forgekernel::attention_varlen_fwd", mutates_args=())
def _attention_varlen_fwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool,
    softmax_scale: float,
    deterministic: bool = False,  # for the backward registered in ops/attention_bwd.py
) -> tuple[torch.Tensor, torch.Tensor]:
    o, lse = _empty_outputs(q, v)
    seqs = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    _launch_varlen_fwd(q, k, v, o, lse, seqs, softmax_scale, causal)
    return o, lse


@_attention_varlen_fwd_op.register_fake
def _(q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, softmax_scale, deterministic=False):
    return _empty_outputs(q, v)


class _EagerVarlenFwd(torch.autograd.Function):
    """An eager varlen call that autograd records, without the dispatcher: the custom op's
    autograd formula (ops/attention_bwd.py), as `ops.attention._EagerAttentionFwd` (no
    materialized zero gradients: dLSE None)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic):
        ctx.set_materialize_grads(False)
        o, lse = _empty_outputs(q, v)
        _launch_varlen_fwd(q, k, v, o, lse, (cu_q, cu_k, max_q, max_k), scale, causal)
        inputs = (q, k, v, cu_q, cu_k, max_q, max_k, causal, scale, deterministic)
        _autograd_of_fwd()._setup_varlen_fwd(ctx, inputs, (o, lse))
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        return _autograd_of_fwd()._grad_varlen_fwd(ctx, do, dlse)


def attention_varlen(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    max_seqlen_k: int,
    causal: bool = False,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    *,
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
    deterministic: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`attention` per sequence for q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv).

    cu_seqlens_q / cu_seqlens_k: int32 (batch + 1,) offsets starting at 0, on the CPU or on q's
    device; max_seqlen_q / max_seqlen_k: the longest sequence of each. `out=(o, lse)` writes
    into given buffers (o (total_q, Hq, Dv) in q's dtype, lse (Hq, total_q) fp32; any views).
    Offsets on the CPU are checked on the host (first 0, non-decreasing, last = total tokens,
    no length above max_seqlen) and copied to q's device; offsets already on the GPU are
    checked for dtype and shape only (reading them would sync the device each call). Returns
    o (total_q, Hq, Dv) and, with `return_lse`, lse (Hq, total_q) fp32. Differentiable in q,
    k, v like `attention` (`deterministic` reaches the backward).

    max_seqlen_q must be at least the longest query sequence (checked for host offsets only):
    the kernel covers max_seqlen_q rows per sequence. Rows of a sequence with no keys (or, under
    the causal mask, rows that see none) give 0 and LSE -inf.
    """
    _check_qkv(q, k, v, ndim=3)
    _check_cu_seqlens(q, k, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
    scale = _check_flags(causal, softmax_scale, q.shape[-1])
    if out is not None:
        _check_out(out, q, v)
    check_bool("deterministic", deterministic)
    check_cuda("q", q)
    check_same_device(q=q, k=k, v=v, **({} if out is None else {"o": out[0], "lse": out[1]}))
    cu_q, cu_k = _offsets_on_device(q, cu_seqlens_q, cu_seqlens_k)
    traced = _traced(q, k, v, cu_q, cu_k, *(out or ()))
    if traced or wants_grad(q, k, v):
        args = (q, k, v, cu_q, cu_k, max_seqlen_q, max_seqlen_k, causal, scale, deterministic)
        if traced or torch._C._are_functorch_transforms_active():
            o, lse = torch.ops.forgekernel.attention_varlen_fwd(*args)
        else:
            o, lse = _EagerVarlenFwd.apply(*args)
        if out is not None:
            out[0].copy_(o)
            out[1].copy_(lse)
            o, lse = out
    else:
        o, lse = out if out is not None else _empty_outputs(q, v)
        seqs = (cu_q, cu_k, max_seqlen_q, max_seqlen_k)
        _launch_varlen_fwd(q, k, v, o, lse, seqs, scale, causal)
    return (o, lse) if return_lse else o
