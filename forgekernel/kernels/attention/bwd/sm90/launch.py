"""Host launcher of the sm90 attention backward: torch only (no DSL), the three kernels
(preprocess, main, postprocess) through the compile cache. Callers validate first
(`forgekernel.attention_backward`, the autograd of `forgekernel.attention`); the launcher
zeroes the gradients of empty problems, makes the tensors TMA-ready, picks the main kernel's
config, allocates the fp32 workspaces and launches."""

from __future__ import annotations

from dataclasses import replace

import torch

from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN, SPEC_POST, SPEC_PRE
from forgekernel.kernels.attention.bwd.sm90.config import (
    ROW_PAD,
    BwdConfig,
    choose_config,
    default_config,
    main_params,
    post_params,
    pre_params,
    varlen_ws_rows,
)
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, copy_back, dtype_name, num_sms, tma_target

# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a varlen call, None otherwise.
Seqs = tuple[torch.Tensor, torch.Tensor, int, int] | None


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
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: BwdConfig | None = None,
) -> None:
    """dq, dk, dv (written in place, any views shaped and typed as q, k, v) of
    o = softmax(scale q k^T + mask) v, given o, lse (B, Hq, Sq) fp32 (natural log, -inf for rows
    that see no key) and do. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), bf16 or
    fp16, Hq % Hkv == 0, (D, Dv) in HEAD_DIMS; causal is bottom-right aligned. With
    `deterministic`, dq is bitwise reproducible (dk, dv always are). `config` (optional)
    replaces the main kernel's default BwdConfig for these head dims (variants, benchmarks).

    Varlen (cu_seqlens_q / cu_seqlens_k int32 (B + 1,) on q's device, max_seqlen_q /
    max_seqlen_k >= every sequence's length): q, o, do (Tq, Hq, *), k, v (Tk, Hkv, *), lse
    (Hq, Tq); each sequence its own causal alignment; sequences with no queries or no keys
    give zero gradients."""
    seqs = None
    if cu_seqlens_q is not None:
        seqs = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    grads = (dq, dk, dv)
    if _nothing_to_compute(q, k, seqs):
        for g in grads:
            g.zero_()
        return
    q, k, v, o, do = (as_tma_ready(t) for t in (q, k, v, o, do))
    lse = lse.contiguous()
    dst = tuple(tma_target(g, contiguous=True) for g in grads)
    flags = (float(softmax_scale), causal, deterministic, seqs, config)
    _launch_kernels(q, k, v, o, lse, do, *dst, *flags)
    copy_back(grads, dst)


def _nothing_to_compute(q: torch.Tensor, k: torch.Tensor, seqs: Seqs) -> bool:
    """No query rows or no keys (varlen: also no sequence, or zero maximum lengths): every
    gradient is 0 and no kernel runs."""
    if q.numel() == 0 or k.numel() == 0:
        return True
    return seqs is not None and (seqs[0].numel() < 2 or seqs[2] <= 0 or seqs[3] <= 0)


def _launch_kernels(
    q, k, v, o, lse, do, dq, dk, dv, scale: float, causal: bool, deterministic: bool,
    seqs: Seqs, config: BwdConfig | None = None,
) -> None:  # fmt: skip
    """The kernels: tensors TMA-ready, lse and the gradients contiguous, sizes non-zero."""
    with torch.cuda.device(q.device):
        if seqs is None:
            _fixed_length(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, config)
        else:
            _varlen(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, config)


def _fixed_length(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, config) -> None:
    b, sq, hq, d = q.shape
    sk, hkv, dv_dim = k.shape[1], k.shape[2], v.shape[-1]
    dtype, dev = dtype_name(q.dtype), q.device
    if config is not None:
        cfg = config
    else:
        sms = num_sms(dev.index)
        cfg = choose_config(d, dv_dim, deterministic, b, sk, hq, hkv, sms, causal)
    if deterministic and cfg.persistent:
        cfg = replace(cfg, persistent=False)
    if cfg.head_split and (deterministic or hq == hkv):
        cfg = replace(cfg, head_split=0)  # atomic dK / dV order; nothing to split

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
        ctas = min(tiles, num_sms(dev.index))

    # head_split: the main kernel adds dK * scale and dV into fp32 accumulators
    dk_main, dv_main = dk, dv
    if cfg.head_split:
        dk_main = torch.zeros(b, sk, hkv, d, dtype=f32, device=dev)
        dv_main = torch.zeros(b, sk, hkv, dv_dim, dtype=f32, device=dev)
    pre = get_kernel(SPEC_PRE, pre_params(dtype, dv_dim))
    main = get_kernel(SPEC_MAIN, main_params(dtype, d, dv_dim, causal, deterministic, cfg))
    post = get_kernel(SPEC_POST, post_params(dtype, d, cfg.tile_m, dq_split=cfg.dq_split))
    pre(o, do, lse, lse2, dsum, None, dq_acc, 0)
    main(
        q, k, v, do, lse2, dsum, dq_acc, dk_main, dv_main, sem, None, None, ctas, scale,
        scale * LOG2E,
    )  # fmt: skip
    post(dq_acc, dq, None, 0, scale)
    if cfg.head_split:
        dk.copy_(dk_main)
        dv.copy_(dv_main)


def _varlen(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, config) -> None:
    cu_q, cu_k, mq, mk = seqs
    tq, hq, d = q.shape
    dv_dim = v.shape[-1]
    num_seqs = cu_q.numel() - 1
    dtype, dev = dtype_name(q.dtype), q.device
    cfg = config if config is not None else default_config(d, dv_dim, deterministic, True)
    if cfg.persistent:
        cfg = replace(cfg, persistent=False)  # varlen keeps its per-sequence grid
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
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
    pre(o, do, lse, lse2, dsum, cu_q, None, mq)
    main(
        q, k, v, do, lse2, dsum, dq_acc, dk, dv, sem, cu_q, cu_k, mk, scale, scale * LOG2E,
    )  # fmt: skip
    post(dq_acc, dq, cu_q, mq, scale)
