"""Host launcher of the sm90 attention backward: torch only (no DSL), kernels through
`forgekernel.runtime.cache.get_kernel`."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN, SPEC_POST, SPEC_PRE
from forgekernel.kernels.attention.bwd.sm90.config import (
    HEAD_DIMS,
    ROW_PAD,
    BwdConfig,
    choose_config,
    default_config,
    main_params,
    post_params,
    pre_params,
    varlen_ws_rows,
)
from forgekernel.ops._dispatch import num_sms
from forgekernel.runtime.cache import get_kernel

LOG2E = math.log2(math.e)
_DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16"}


def _tma_ready(t: torch.Tensor) -> bool:
    if t.stride(-1) != 1 or t.data_ptr() % 16:
        return False
    # every stride, size-1 dims included: the compiled kernels assume multiples of 8
    return all(s % 8 == 0 for s in t.stride()[:-1])


def _ready(t: torch.Tensor) -> torch.Tensor:
    return t if _tma_ready(t) else t.contiguous()


def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool = False,
    cu_seqlens_q=None,
    cu_seqlens_k=None,
    max_seqlen_q=None,
    max_seqlen_k=None,
    config: BwdConfig | None = None,
) -> None:
    """dq, dk, dv (written in place, same shapes and dtype as q, k, v) of
    o = softmax(scale q k^T + mask) v, given o, lse (B, Hq, Sq) fp32 (natural log, -inf for rows
    that see no key) and do. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), bf16 or
    fp16, Hq % Hkv == 0, (D, Dv) in HEAD_DIMS; causal is bottom-right aligned. With
    `deterministic`, dq is bitwise reproducible (dk, dv always are). `config` (optional)
    replaces the main kernel's default BwdConfig for these head dims (variants, benchmarks).

    Varlen (cu_seqlens_q / cu_seqlens_k int32 (B + 1,) on q's device, max_seqlen_q /
    max_seqlen_k >= every sequence's length): q, o, do (Tq, Hq, *), k, v (Tk, Hkv, *), lse
    (Hq, Tq); each sequence its own causal alignment; sequences with no queries or no keys
    give zero gradients."""
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        _attention_bwd_varlen(
            q, k, v, o, lse, do, dq, dk, dv, softmax_scale, causal, deterministic,
            cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, config,
        )  # fmt: skip
        return
    if q.dim() != 4:
        raise ValueError(f"q must be (B, Sq, Hq, D), got shape {tuple(q.shape)}")
    b, sq, hq, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    if (d, dv_dim) not in HEAD_DIMS:
        raise NotImplementedError(
            f"attention_bwd (sm90): head dims (D={d}, Dv={dv_dim}) not implemented; "
            f"supported: {HEAD_DIMS}"
        )
    if q.dtype not in _DTYPE_NAMES:
        raise TypeError(f"attention_bwd: dtype must be float16 or bfloat16, got {q.dtype}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq = {hq} must be a multiple of Hkv = {hkv}")
    if b == 0 or hq == 0:
        return
    if sq == 0 or sk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    dtype = _DTYPE_NAMES[q.dtype]
    if config is not None:
        cfg = config
    else:
        cfg = choose_config(
            d, dv_dim, deterministic, b, sk, hq, hkv, num_sms(q.device.index), causal
        )
    if deterministic and cfg.persistent:
        cfg = replace(cfg, persistent=False)
    if cfg.head_split and (deterministic or hq == hkv):
        cfg = replace(cfg, head_split=0)  # atomic dK / dV order; nothing to split
    dev = q.device
    q, k, v, o, do = (_ready(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    outs = [
        (t, t if _tma_ready(t) else torch.empty_like(t, memory_format=torch.contiguous_format))
        for t in (dq, dk, dv)
    ]
    dq_dst, dk_dst, dv_dst = (dst for _, dst in outs)

    sq_pad = -(-sq // ROW_PAD) * ROW_PAD
    f32 = torch.float32
    lse2 = torch.empty(b, hq, sq_pad, dtype=f32, device=dev)
    dsum = torch.empty(b, hq, sq_pad, dtype=f32, device=dev)
    dq_acc = torch.empty(b, hq, sq_pad * d, dtype=f32, device=dev)  # zeroed by the preprocess
    # The per-row-block dQ semaphores (deterministic order); the compiled kernel's batch and
    # head extents are shared with q, so the unread buffer keeps the shape too (uninitialized).
    # Persistent: sem[0, 0, 0] is the tile counter (zeroed), and the kernel's max_seqlen_k
    # slot carries its CTA count.
    n_sem = sq_pad // cfg.tile_m
    if deterministic or cfg.persistent:
        sem = torch.zeros(b, hq, n_sem, dtype=torch.int32, device=dev)
    else:
        sem = torch.empty(b, hq, n_sem, dtype=torch.int32, device=dev)
    ctas = 0
    if cfg.persistent:
        tiles = -(-sk // cfg.tile_n) * hkv * b
        ctas = min(tiles, num_sms(q.device.index))

    # head_split: the main kernel adds dK * scale and dV into fp32 accumulators
    dk_main, dv_main = dk_dst, dv_dst
    if cfg.head_split:
        dk_main = torch.zeros(b, sk, hkv, d, dtype=f32, device=dev)
        dv_main = torch.zeros(b, sk, hkv, dv_dim, dtype=f32, device=dev)
    pre = get_kernel(SPEC_PRE, pre_params(dtype, dv_dim))
    main = get_kernel(SPEC_MAIN, main_params(dtype, d, dv_dim, causal, deterministic, cfg))
    post = get_kernel(SPEC_POST, post_params(dtype, d, cfg.tile_m, dq_split=cfg.dq_split))
    scale = float(softmax_scale)
    with torch.cuda.device(dev):
        pre(o, do, lse, lse2, dsum, None, dq_acc, 0)
        main(
            q, k, v, do, lse2, dsum, dq_acc, dk_main, dv_main, sem, None, None, ctas, scale,
            scale * LOG2E,
        )  # fmt: skip
        post(dq_acc, dq_dst, None, 0, scale)
        if cfg.head_split:
            dk_dst.copy_(dk_main)
            dv_dst.copy_(dv_main)
    for t, dst in outs:
        if dst is not t:
            t.copy_(dst)


def _check_dims(d: int, dv_dim: int, dtype: torch.dtype, hq: int, hkv: int) -> None:
    if (d, dv_dim) not in HEAD_DIMS:
        raise NotImplementedError(
            f"attention_bwd (sm90): head dims (D={d}, Dv={dv_dim}) not implemented; "
            f"supported: {HEAD_DIMS}"
        )
    if dtype not in _DTYPE_NAMES:
        raise TypeError(f"attention_bwd: dtype must be float16 or bfloat16, got {dtype}")
    if hkv == 0 or hq % hkv:
        raise ValueError(f"Hq = {hq} must be a multiple of Hkv = {hkv}")


def _attention_bwd_varlen(
    q, k, v, o, lse, do, dq, dk, dv, softmax_scale, causal, deterministic,
    cu_q, cu_k, max_seqlen_q, max_seqlen_k, config,
) -> None:  # fmt: skip
    """attention_bwd over packed sequences (see there)."""
    if cu_q is None or cu_k is None or max_seqlen_q is None or max_seqlen_k is None:
        raise ValueError("varlen needs cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k")
    if q.dim() != 3:
        raise ValueError(f"varlen q must be (total_q, Hq, D), got shape {tuple(q.shape)}")
    tq, hq, d = q.shape
    tk, hkv, dv_dim = k.shape[0], k.shape[1], v.shape[-1]
    _check_dims(d, dv_dim, q.dtype, hq, hkv)
    num_seqs = cu_q.numel() - 1
    if cu_k.numel() != num_seqs + 1:
        raise ValueError("cu_seqlens_q and cu_seqlens_k must have the same length")
    if hq == 0 or num_seqs <= 0 or tq == 0 or tk == 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    if int(max_seqlen_q) <= 0 or int(max_seqlen_k) <= 0:
        dq.zero_()
        dk.zero_()
        dv.zero_()
        return
    dtype = _DTYPE_NAMES[q.dtype]
    cfg = config if config is not None else default_config(d, dv_dim, deterministic, True)
    if cfg.persistent:
        cfg = replace(cfg, persistent=False)  # varlen keeps its per-sequence grid
    dev = q.device
    q, k, v, o, do = (_ready(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    cu_q = cu_q.to(device=dev, dtype=torch.int32).contiguous()
    cu_k = cu_k.to(device=dev, dtype=torch.int32).contiguous()
    outs = [
        (t, t if _tma_ready(t) else torch.empty_like(t, memory_format=torch.contiguous_format))
        for t in (dq, dk, dv)
    ]
    dq_dst, dk_dst, dv_dst = (dst for _, dst in outs)
    # dK / dV rows of keys that belong to no sequence (none, with well-formed offsets) and of
    # empty-query sequences are written by the kernel (zeros); dQ rows by the postprocess.
    rows = varlen_ws_rows(tq, num_seqs)
    f32 = torch.float32
    lse2 = torch.empty(hq, rows, dtype=f32, device=dev)
    dsum = torch.empty(hq, rows, dtype=f32, device=dev)
    dq_acc = torch.zeros(hq, rows * d, dtype=f32, device=dev)
    if deterministic:
        sem = torch.zeros(hq, rows, dtype=torch.int32, device=dev)
    else:
        sem = torch.empty(hq, rows, dtype=torch.int32, device=dev)

    pre = get_kernel(SPEC_PRE, pre_params(dtype, dv_dim, varlen=True))
    main = get_kernel(
        SPEC_MAIN, main_params(dtype, d, dv_dim, causal, deterministic, cfg, varlen=True)
    )
    post = get_kernel(
        SPEC_POST, post_params(dtype, d, cfg.tile_m, varlen=True, dq_split=cfg.dq_split)
    )
    scale = float(softmax_scale)
    mq, mk = int(max_seqlen_q), int(max_seqlen_k)
    with torch.cuda.device(dev):
        pre(o, do, lse, lse2, dsum, cu_q, None, mq)
        main(
            q, k, v, do, lse2, dsum, dq_acc, dk_dst, dv_dst, sem, cu_q, cu_k, mk, scale,
            scale * LOG2E,
        )  # fmt: skip
        post(dq_acc, dq_dst, cu_q, mq, scale)
    for t, dst in outs:
        if dst is not t:
            t.copy_(dst)
