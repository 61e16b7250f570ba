"""Host launcher of the DSA sparse backward kernel: torch only (no DSL), the kernel through the
compile cache. The preprocess (lse2, Delta', d_sink: (tokens, H) fp32 work, one pass over out
and dO) comes from the caller (the op runs its kernel, kernels/attention/dsa_sparse_bwd_pre)
or, without one, from `preprocess` here (its torch statement: the CPU tests' and the probe's
reference); the dkv cast is the caller's. Callers validate first
(`forgekernel.ops.dsa_bwd`); nothing here reads device data (CUDA-graph capturable)."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC, config
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def unsupported(q: torch.Tensor, kv: torch.Tensor, topk_indices: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (None: it can). q (tokens, H, 576), kv
    (slots, 576), topk_indices (tokens, topk) int32."""
    if q.dtype not in KERNEL_DTYPES or kv.dtype != q.dtype:
        return f"dtypes {q.dtype} / {kv.dtype}: the kernel takes one 16-bit dtype"
    if q.dim() != 3 or q.shape[-1] != config.WIDTH or kv.shape[-1] != config.WIDTH:
        return f"rows must be {config.WIDTH} wide"
    try:
        config.block_heads(q.shape[1])
    except ValueError as e:
        return str(e)
    if topk_indices.dtype != torch.int32:
        return f"topk_indices must be int32, got {topk_indices.dtype}"
    if not q.is_cuda:
        return "q is not on a CUDA device"
    return None


def preprocess(
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse2, Delta', d_sink) in fp32 (reference.dsa's math, kernel.py's contract): lse2 =
    log2(e) logaddexp(lse, sink), +inf where nothing is in the denominator (P = 0);
    Delta' = rowsum(dO O) - dlse exp(lse_all - lse) (0 where either LSE is infinite: P or
    the KV-only softmax is 0 there); d_sink = -sum_t P_sink rowsum(dO O), P_sink 1 for a +inf
    sink; zeros (H,) without a sink."""
    delta = (dout.float() * out.float()).sum(-1)
    lse = lse.float()
    lse_all = lse if attn_sink is None else torch.logaddexp(lse, attn_sink.float()[None, :])
    lse_all = lse_all.masked_fill(torch.isneginf(lse_all), float("inf"))
    lse2 = lse_all * LOG2E
    if attn_sink is None:
        d_sink = torch.zeros(lse.shape[1], dtype=torch.float32, device=lse.device)
    else:
        sink = attn_sink.float()
        p_sink = torch.exp(sink[None, :] - lse_all)
        p_sink = torch.where(torch.isposinf(sink)[None, :], 1.0, p_sink)
        d_sink = -(p_sink * delta).sum(0)
    delta_k = delta
    if dlse is not None:
        finite = torch.isfinite(lse_all) & torch.isfinite(lse)
        ratio = torch.exp(torch.where(finite, lse_all - lse, 0.0))
        delta_k = delta - torch.where(finite, dlse.float() * ratio, 0.0)
    return lse2, delta_k, d_sink


def dsa_sparse_bwd(
    q: torch.Tensor,
    kv: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    dq: torch.Tensor | None = None,
    reduce: bool = True,
    xchg: bool | None = None,
    red4s: bool | None = None,
    pre: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    h64: bool | None = None,
    h64_v2: bool = False,
    h64_ws: torch.Tensor | None = None,
    h64_fused: bool | None = None,
    sweep: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq (tokens, H, 576) in q's dtype, dkv (slots, 576) fp32, d_sink (H,) fp32): q
    (tokens, H, 576), kv (slots, 576) in one 16-bit dtype, dout / out (tokens, H, 512), lse /
    dlse (tokens, H) fp32 (the forward's KV-only natural LSE), attn_sink (H,) or None,
    topk_indices int32 (tokens, topk) of slots, -1 (or any entry outside [0, slots)) adding
    nothing; dq: a contiguous (tokens, H, 576) buffer in q's dtype to write (tests poison it).
    pre: (lse2, Delta', d_sink) as `preprocess` gives them, computed by the caller (the op: the
    preprocess kernel, kernels/attention/dsa_sparse_bwd_pre/sm90), None: `preprocess` here
    (torch). reduce False: the timing probe's builds (dkv stays 0).

    h64 None (the default): the h64 kernels where H is a multiple of 64 (`config.h64_supported`,
    measured 2026-12-06 01:37: 0.64-0.84 of the standard kernel's time at H 64 / 128), the
    standard kernel elsewhere; True: h64 (ValueError unless H is a multiple of 64); False: the
    standard kernel (the bench variant `was`).

    The standard kernel (kernel.py, CTAs of 16 / 32 heads): xchg True: S^T and dP^T one
    warpgroup's each, False: split over the heads, None: the standard form
    (`config.standard_xchg`: xchg at every H, the split form under reduce False); red4s True:
    dkv by red.global.add.v4.f32 from a staging in the tile's stage, False: the fragments'
    red.global.add.v2, None: the standard form (`config.standard_red4s`: red4s at every H, v2
    under reduce False). The defaults run xchg4s (xchg with red4s); xchg=False the candidate
    red4s (the standard form before 2026-12-04 04:23). xchg / red4s name forms of this kernel
    only: with the h64 path they raise ValueError (pass h64=False).

    h64 (kernel_h64.py: 64 heads a CTA, dkv and a dS workspace, then dq = dS K in a second
    kernel; `_launch_h64`): the tokens run in chunks whose workspace stays within
    `config.H64_WS_CAP_BYTES`; h64_v2 True: its kv part with the fragments' red.global.add.v2,
    the probe's comparison; h64_ws: the dS workspace to use, contiguous (n,
    `config.h64_workspace_rows(topk)`, H) in q's dtype for any n >= 1 (the tokens then run in
    chunks of n; n >= tokens: one launch of each part, as before chunking), None: a fresh one
    within the cap; the GPU tests poison it with NaN so that a cell the kv part leaves
    unwritten shows in dq. h64_v2 / h64_ws with the standard kernel raise ValueError.

    h64_fused (the h64 path only): None (the default) runs the one-kernel form (kernel_h64f.py:
    dq^T in the kv part's tile loop, no workspace, no second gather; docs/attention/
    DSA_BWD_NOTES.md "H >= 64: dq back in the tile loop") unless h64_v2 / h64_ws name the
    two-kernel form's options; False: the two kernels (the bench variant `split`); True: fused
    (ValueError with h64_v2 / h64_ws). The fused kernel's grid is (H / 64, tokens), so more than
    `config.H64F_GRID_TOKENS` tokens run in launches of row slices (one launch below it).

    sweep (v1 and the fused kernel; ValueError with the two-kernel h64 form): the index rows
    sorted by slot, the tokens in launches of one wave (`config.sweep_tokens`; docs/attention/
    DSA_BWD_NOTES.md "Long caches"); None (the default) where `sweeps_by_default` (a cache far
    over the L2, a row visited >= 1.5 times a wave), True / False forced. `unsupported` must be
    None for these inputs."""
    use_h64 = config.h64_supported(q.shape[1]) if h64 is None else h64
    _check_forms(q, use_h64, xchg, red4s, h64_v2, h64_ws)
    if h64_fused and not use_h64:
        raise ValueError("h64_fused applies to the h64 path (H a multiple of 64, h64 not False)")
    fused = use_h64 and _fused(h64_fused, h64_v2, h64_ws)
    if sweep and use_h64 and not fused:
        raise ValueError("sweep applies to v1 and the fused h64 kernel, not the two-kernel form")
    lse2, delta, d_sink = preprocess(out, dout, lse, dlse, attn_sink) if pre is None else pre
    tokens, heads, _ = q.shape
    if dq is None:
        dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    dkv = torch.zeros(kv.shape[0], config.WIDTH, dtype=torch.float32, device=q.device)
    if tokens == 0 or topk_indices.shape[1] == 0:
        return dq.zero_(), dkv, d_sink
    idx = topk_indices if topk_indices.stride(-1) == 1 else topk_indices.contiguous()
    if use_h64 and not fused:
        _launch_h64(
            q, kv, dout, lse2, delta, idx, dq, dkv, softmax_scale, reduce, not h64_v2, h64_ws
        )
        return dq, dkv, d_sink
    if fused:
        kernel = get_kernel(SPEC, config.params_h64(dtype_name(q.dtype), "fused", reduce))
        ctas, step = ctas_per_token(heads), config.H64F_GRID_TOKENS
    else:
        block = config.block_heads(heads)
        if xchg is None:
            xchg = config.standard_xchg(block, reduce)
        if red4s is None:
            red4s = config.standard_red4s(block, reduce)
        kernel = get_kernel(SPEC, config.params_for(dtype_name(q.dtype), block, reduce, xchg,
                                                    red4s))  # fmt: skip
        ctas, step = heads // block, tokens  # v1's grid.x holds the tokens: one launch
    if sweep is None:
        sweep = sweeps_by_default(kv.shape[0], idx.shape[1], ctas, q.device.index)
    if sweep:
        idx = torch.sort(idx, dim=1).values
        step = config.sweep_tokens(num_sms(q.device.index), ctas)
    # the fused kernel's dq stores are 16-byte rows: a caller's dq off that alignment gets a copy
    out_dq = dq
    if fused and (dq.data_ptr() % 16 or not dq.is_contiguous()):
        out_dq = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    _launch_rows(kernel, q, kv, dout, lse2, delta, idx, out_dq, dkv, softmax_scale, step)
    if out_dq is not dq:
        dq.copy_(out_dq)
    return dq, dkv, d_sink


def sweeps_by_default(slots: int, topk: int, ctas: int, device_index: int | None) -> bool:
    """Whether the default sweeps (config.py's SWEEP_ROW_BYTES comment) for `ctas` CTAs a token
    on the device: the cache far over the L2, then (only then the SM count is read) a wave's
    visits of a row."""
    if not config.sweep_far(slots):
        return False
    wave = config.sweep_tokens(num_sms(device_index), ctas)
    return config.sweep_reuses(slots, topk, wave)


def ctas_per_token(heads: int) -> int:
    """CTAs a token of the default's kernel: H / 64 (the fused kernel) or H / block (v1)."""
    if config.h64_supported(heads):
        return heads // config.H64_BLOCK
    return heads // config.block_heads(heads)


def h64_unsupported(q: torch.Tensor) -> str | None:
    """Why the h64 kernels cannot take q (None: they can): H a multiple of 64."""
    if not config.h64_supported(q.shape[1]):
        return f"h64 takes a multiple of {config.H64_BLOCK} heads, got {q.shape[1]}"
    return None


def _fused(h64_fused: bool | None, h64_v2: bool, h64_ws) -> bool:
    """Whether the h64 path runs its one-kernel form (launcher docstring, `h64_fused`)."""
    split_options = h64_v2 or h64_ws is not None
    if h64_fused is None:
        return not split_options
    if h64_fused and split_options:
        raise ValueError("h64_v2 / h64_ws name options of the two-kernel h64 form: pass "
                         "h64_fused=False (or None) with them")  # fmt: skip
    return h64_fused


def _check_forms(q, use_h64: bool, xchg, red4s, h64_v2: bool, h64_ws) -> None:
    """The launcher's form keywords against the path they would run on (ValueError)."""
    if use_h64:
        if h64_unsupported(q) is not None:
            raise ValueError(h64_unsupported(q))
        if xchg is not None or red4s is not None:
            raise ValueError("xchg / red4s name forms of the standard kernel, not of h64: pass "
                             "h64=False with them")  # fmt: skip
    elif h64_v2 or h64_ws is not None:
        raise ValueError("h64_v2 / h64_ws apply to the h64 kernels (H a multiple of 64, h64 not "
                         "False)")  # fmt: skip


def _launch_h64(
    q, kv, dout, lse2, delta, idx, dq, dkv, softmax_scale: float, reduce: bool, shfl4: bool,
    ws: torch.Tensor | None = None,
):  # fmt: skip
    """The two h64 kernels a chunk of tokens: `kv` (dkv into the accumulator, dS into the
    chunk's (tokens, whole tiles, H) workspace in q's dtype), then `dq` (dq = dS K, every
    element of the chunk's dq written). The chunks are row slices of the per-token tensors (q,
    dout, lse2, delta, idx, dq: the kernels index them by token, grid.x = the slice's rows, and
    a slice keeps its parent's strides and 16-byte alignment: q's rows are 1,152 H bytes) on
    one workspace, reused chunk after chunk in stream order; kv and the fp32 dkv accumulator are
    shared (the reductions add each chunk's partials). Host-side loop over shapes only: nothing
    read back (CUDA-graph capturable)."""
    tokens, heads, _ = q.shape
    rows = config.h64_workspace_rows(idx.shape[1])
    if ws is None:
        chunk = config.h64_chunk_tokens(tokens, rows, heads, q.element_size())
        ws = torch.empty((chunk, rows, heads), dtype=q.dtype, device=q.device)
    elif (ws.dim() != 3 or ws.shape[0] < 1 or tuple(ws.shape[1:]) != (rows, heads)
          or ws.dtype != q.dtype or not ws.is_contiguous()):  # fmt: skip
        raise ValueError(f"h64_ws must be a contiguous (n >= 1, {rows}, {heads}) {q.dtype} "
                         f"tensor, got {tuple(ws.shape)} {ws.dtype}")  # fmt: skip
    chunk = min(ws.shape[0], tokens)
    name = dtype_name(q.dtype)
    kv_kernel = get_kernel(SPEC, config.params_h64(name, "kv", reduce, shfl4))
    dq_kernel = get_kernel(SPEC, config.params_h64(name, "dq", dq_heads=config.h64_dq_heads(heads)))
    q, kv, dout = as_tma_ready(q), as_tma_ready(kv), as_tma_ready(dout)
    with on_device(q.device):
        for t0 in range(0, tokens, chunk):
            t1 = min(t0 + chunk, tokens)
            q_t, dout_t, lse2_t, delta_t, idx_t, dq_t = (
                _rows(x, t0, t1) for x in (q, dout, lse2, delta, idx, dq)
            )
            w = _rows(ws, 0, t1 - t0)
            kv_kernel(q_t, kv, dout_t, lse2_t, delta_t, idx_t, w, dkv, softmax_scale * LOG2E,
                      softmax_scale)  # fmt: skip
            dq_kernel(kv, idx_t, w, dq_t)


def _launch_rows(kernel, q, kv, dout, lse2, delta, idx, dq, dkv, softmax_scale: float,
                 step: int):  # fmt: skip
    """v1's or the fused kernel on row slices of `step` tokens of the per-token tensors (q,
    dout, lse2, Delta', the indices, dq: the kernels index them by their grid's token, and a
    slice keeps its parent's strides), kv and the dkv accumulator shared; one launch on the
    tensors themselves when step covers them. Shapes only on the host (CUDA-graph
    capturable)."""
    tokens = q.shape[0]
    q, kv, dout = as_tma_ready(q), as_tma_ready(kv), as_tma_ready(dout)
    with on_device(q.device):
        for t0 in range(0, tokens, step):
            t1 = min(t0 + step, tokens)
            q_t, dout_t, lse2_t, delta_t, idx_t, dq_t = (
                _rows(x, t0, t1) for x in (q, dout, lse2, delta, idx, dq)
            )
            kernel(q_t, kv, dout_t, lse2_t, delta_t, idx_t, dq_t, dkv, softmax_scale * LOG2E,
                   softmax_scale)  # fmt: skip


def _rows(x: torch.Tensor, t0: int, t1: int) -> torch.Tensor:
    """x[t0:t1], x itself where that is all of it (one chunk: the launches as before chunking)."""
    return x if t0 == 0 and t1 == x.shape[0] else x[t0:t1]
