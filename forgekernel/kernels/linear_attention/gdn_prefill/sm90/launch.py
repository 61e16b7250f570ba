"""Host launcher of the chunked Gated DeltaNet forward: torch only (no DSL). Callers validate
first (`forgekernel.ops.gated_delta_rule_chunked.gated_delta_rule`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC, T_PRE_SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    params_for,
    t_pre_params_for,
    t_slots,
    v_split_for,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import dtype_name, num_sms, on_device

# Pass B's initial state c I: a power of 2 (exact scaling), large enough that the local state L
# (entries ~1) is ~1/c of what pass B's 16-bit products round, small enough that fp16's U and o
# (|c M k| <= c) stay far from 65504.
SEGMENT_SCALE = 64.0
ALIGN = 16  # bytes: TMA boxes (q, k, v), 16-byte O stores, the state's vector accesses
MAX_SEQUENCES = 65535  # the grid is (HV x V split, N): N is gridDim.y, at most 65535


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself when its base is 16-byte aligned, else a fresh (aligned) copy: a contiguous
    view at an odd offset of a larger buffer would otherwise be refused at the call."""
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


# Sequence segments (`_segmented`: three launches over N P segments, a scan between). Host-only
# (not in config.py, which the kernels' source hashes cover). Three times the chunk work of the
# direct launch; an unsplit CTA among 128 runs a chunk in ~4.5 us (8x32768 hv16: 2.303 ms / 512
# chunks), a split CTA among 32 in ~2.43 us (1x131072 hv16: 4.984 ms / 2048), so segments pay
# where 3 x 4.5 N HV / 128 < 2.43 us, N HV < ~23 (docs/linear_attention/NOTES.md, "Few long
# sequences: segments").
SEGMENT_HEADS_DIV = 8  # segment when N HV <= SMs / 8 (16 on 132 SMs) ...
SEGMENT_MIN_TOKENS = 16384  # ... and sequences average >= 256 chunks (launches, scan amortized)
MAX_SEGMENTS = 16  # the scan's serial batched products (P - 2), a few us each


def segments_for(sequences: int, value_heads: int, tokens: int, sms: int) -> int:
    """Segments per sequence: 1 (the direct launch) unless N HV <= SMs / 8 and the sequences
    are long; then the most, at most MAX_SEGMENTS, whose passes fill one wave: a pass runs
    N P - 1 segments (`_segmented`), (N P - 1) HV <= SMs unsplit CTAs (2 x that > SMs, so
    `v_split_for` keeps them unsplit: at 128 CTAs an unsplit chunk is cheaper per head)."""
    heads = sequences * value_heads
    if heads * SEGMENT_HEADS_DIV > sms or tokens < SEGMENT_MIN_TOKENS * sequences:
        return 1
    return max(1, min(MAX_SEGMENTS, (sms // value_heads + 1) // sequences))


def t_pre_for(heads: int, value_heads: int, v_split: int, segments: int) -> bool:
    """Whether T diag(beta) is precomputed (`t_diag_beta`, then the chunked kernel's t_pre
    form): everywhere but the direct unsplit launch over ungrouped heads (HV = H). The t_pre
    path moves ~1.5x the standard's HBM bytes (T written and read back, k read again by the
    precompute) for a shorter chunk. Unsplit with HV = H each CTA streams its own q and k
    (64 KB a chunk): the standard form already draws ~1.9 TB/s there and the t_pre form's
    ~6.5 GB at 8 x 32768 h16 hv16 sit at the H100's HBM (2.44 vs 2.23 ms, 1.096x; eager
    1.155x). Grouped heads (HV > H: q, k shared through L2), split CTAs (a chunk half the
    rows) and segments (T once for three passes) win: 0.53-0.93x on the other 15 suite cases
    (H100 2026-12-06, docs/linear_attention/NOTES.md "next/gdn-tpre-rule")."""
    return segments > 1 or v_split > 1 or value_heads > heads


def b_no_o_for(sequences: int, segments: int, t_pre: bool, state_lds: bool) -> bool:
    """Whether the segmented path's pass B runs on the `no_o` key (no q, no
    P, O^T or o: its o is pass C's to overwrite): wherever there is a pass B (segments, N P > 2:
    `_segmented`) in the t_pre form with its O warp (the key is that form's). H100
    2026-12-07: 1 x 131072 h16 hv16 (P = 9) 2.6932 -> 2.3830 ms (0.885x), bit for bit,
    racecheck clean (docs/linear_attention/NOTES.md "next/gdn-prefill-adopt")."""
    return segments > 1 and sequences * segments > 2 and t_pre and not state_lds


def _sms(device: torch.device) -> int:
    """The device's SM count (132 for a CPU tensor: the tests' stand-in for the H200)."""
    return num_sms(device.index) if device.type == "cuda" else 132


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    final_state: torch.Tensor,
    scale: float,
    *,
    k_last: bool,
    l2norm: bool,
    v_split: int | None = None,
    segments: int | None = None,
    t_pre: bool | None = None,
    state_lds: bool = False,
    o_warp: bool | None = None,
    b_no_o: bool | None = None,
) -> None:
    """Varlen form: q, k (T, H, K), v (T, HV, V) 16-bit, g (log decay) and beta fp32 (T, HV),
    cu_seqlens int32 (N + 1,); initial_state (N, HV, K, V) fp32, or (N, HV, V, K) with k_last,
    or None (zeros). Writes out (T, HV, V) in q's dtype and final_state (N, HV, ...) in the
    initial state's layout. Last dims contiguous, token strides multiples of 8 elements. Problems
    of N x HV <= SMs / 2 CTAs split each state's value rows over two CTAs (`v_split_for`; or
    as `v_split` says: the bench's variants time both on a case). Problems of N x HV <= SMs / 8
    long sequences cut each sequence into `segments_for` pieces run in parallel
    (`_segmented`; `segments` forces a count, 1 the direct launch). t_pre: T diag(beta) of
    every chunk by the precompute kernel first, read by the chunked kernel's `t_pre` form; None:
    as `t_pre_for` says (True / False forced: the bench's variants `t_pre` / `standard`);
    state_lds (with t_pre=True): that form with next/gdn-tpre's state chain (the bench's A/B
    `t_pre_state_lds`). o_warp: the standard form's O warp (the t_pre form's state chain:
    V^T by ldmatrix, O stored by warpgroup 0's O warp); None: on wherever the standard form
    runs; True / False forced, with the standard form only (False: the bench's
    A/B `no_o_warp`). b_no_o: the segmented path's pass B on the t_pre form's `no_o` key (its
    o, which pass C overwrites, neither formed nor stored); None: wherever that pass runs in
    the t_pre form (`b_no_o_for`); True forced only there, False: pass B with o (the bench's
    A/B `b_with_o`)."""
    if final_state.shape[0] == 0:
        return
    if q.shape[0] == 0:  # every sequence empty: no TMA descriptor over zero tokens
        final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
        return
    n, hv = final_state.shape[0], v.shape[1]
    sms = _sms(q.device)
    parts = segments or segments_for(n, hv, q.shape[0], sms)
    split = v_split or v_split_for(n, hv, sms)  # the direct launch's (segments: each pass's own)
    if t_pre is None:
        t_pre = t_pre_for(q.shape[1], hv, split, parts)
    if o_warp is None:  # H100 2026-12-07: 0.943-0.986x the standard form without it
        o_warp = not t_pre  # (NOTES "next/gdn-prefill-adopt"); the t_pre form has it already
    elif t_pre:
        raise ValueError("o_warp is forced with the standard form only (t_pre=False); the t_pre "
                         "form has its O warp")  # fmt: skip
    if b_no_o is None:
        b_no_o = b_no_o_for(n, parts, t_pre, state_lds)
    elif b_no_o and not b_no_o_for(n, parts, t_pre, state_lds):
        raise ValueError("b_no_o names pass B of the segmented t_pre path (N x segments > 2, "
                         f"t_pre without state_lds); got N {n}, segments {parts}, t_pre {t_pre}, "
                         f"state_lds {state_lds}")  # fmt: skip
    if parts > 1:
        _segmented(q, k, v, g, beta, initial_state, cu_seqlens, out, final_state, scale, parts,
                   k_last=k_last, l2norm=l2norm, t_pre=t_pre, state_lds=state_lds,
                   o_warp=o_warp, b_no_o=b_no_o)  # fmt: skip
        return
    _direct(q, k, v, g, beta, initial_state, cu_seqlens, out, final_state, scale,
            k_last=k_last, l2norm=l2norm, v_split=split, t_pre=t_pre,
            state_lds=state_lds, o_warp=o_warp)  # fmt: skip


def t_diag_beta(
    k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens: torch.Tensor, *,
    l2norm: bool, out: torch.Tensor | None = None,
) -> torch.Tensor:  # fmt: skip
    """T diag(beta) of every (chunk, value head) by the precompute kernel (`t_pre.py`):
    (slots x C, HV, C) in k's dtype, chunk c of sequence n at slot bos_n // C + n + c
    (`config.first_slot`; the slots between sequences left unwritten). k (T, H, K) 16-bit,
    g and beta fp32 (T, HV), cu_seqlens int32 (N + 1,); out: the buffer (contiguous, 16-byte
    aligned), or None for a fresh one."""
    hv = g.shape[1]
    slots = t_slots(k.shape[0], cu_seqlens.shape[0] - 1)
    shape = (slots * CHUNK, hv, CHUNK)
    t = torch.empty(shape, dtype=k.dtype, device=k.device) if out is None else out
    if t.shape != shape or t.dtype != k.dtype:
        raise ValueError(f"out must be {shape} {k.dtype}, got {tuple(t.shape)} {t.dtype}")
    if not t.is_contiguous() or t.data_ptr() % 16:
        raise ValueError("out must be contiguous and 16-byte aligned (the TMA store's buffer)")
    fn = get_kernel(T_PRE_SPEC, t_pre_params_for(dtype_name(k.dtype), k.shape[-1], l2norm=l2norm))
    with on_device(k.device):
        fn(_aligned(k), g, beta, cu_seqlens, t)
    return t


def _direct(
    q, k, v, g, beta, initial_state, cu_seqlens, out, final_state, scale, *, k_last, l2norm,
    v_split, t_pre=False, t_buf=None, state_lds=False, o_warp=False, no_o=False,
):  # fmt: skip
    """One launch: a CTA (or a V split's CTAs) per sequence and value head (t_pre: after the
    T precompute's, or on t_buf, T of these sequences at their `first_slot`s)."""
    split = v_split or v_split_for(final_state.shape[0], v.shape[1], _sms(q.device))
    params = params_for(
        dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), k_last=k_last, l2norm=l2norm,
        initial_state=initial_state is not None, v_split=split, t_pre=t_pre,
        state_lds=state_lds, o_warp=o_warp, no_o=no_o,
    )  # fmt: skip
    fn = get_kernel(SPEC, params)
    q, k, v = (_aligned(x) for x in (q, k, v))
    init = None if initial_state is None else _aligned(initial_state)
    dst = out if out.data_ptr() % ALIGN == 0 else torch.empty_like(out)
    tb = t_buf
    if t_pre and tb is None:
        tb = t_diag_beta(k, g, beta, cu_seqlens, l2norm=l2norm)
    with on_device(q.device):
        fn(q, k, v, g, beta, init, cu_seqlens, dst, final_state, scale, tb)
    if dst is not out:
        out.copy_(dst)


def _segment_offsets(cu_seqlens: torch.Tensor, parts: int) -> torch.Tensor:
    """(N P + 1,) offsets cutting sequence n into `parts` pieces of ceil(chunks_n / parts)
    whole chunks (the last piece takes the rest, pieces past the end are empty), computed on
    the device (no host sync: CUDA-graph capturable)."""
    cu = cu_seqlens.long()
    lens = cu[1:] - cu[:-1]
    piece = (lens + CHUNK * parts - 1) // (CHUNK * parts) * CHUNK  # tokens a piece
    p = torch.arange(parts, device=cu.device)
    starts = cu[:-1, None] + torch.minimum(p[None, :] * piece[:, None], lens[:, None])
    return torch.cat([starts.flatten(), cu[-1:]]).to(cu_seqlens.dtype)


def _segmented(
    q, k, v, g, beta, initial_state, cu_seqlens, out, final_state, scale, parts, *, k_last, l2norm,
    t_pre=False, state_lds=False, o_warp=False, b_no_o=False,
):  # fmt: skip
    """Each sequence cut into `parts` segments run in parallel (up to N P HV CTAs instead of
    N HV): the recurrence is affine in the state, S_end = M S_start + L per segment (M the
    segment's K x K transition: decays and I - beta k k^T; with K = V it is a state itself).
    Segments in flat order i = n P + p, each pass a contiguous run of them:
    A (0 .. NP - 2): from zero (segment (n, 0) from the initial state): L, and segment 0's o;
    B (1 .. NP - 2): from SEGMENT_SCALE x I: c M + L, so M = (B - A) / c;
    the scan: S_(p + 1) = M_p S_p + L_p (P - 2 batched 128^3 products), S_1 = A's (n, 0);
    C (1 .. NP - 1): from those starts: o (every row but segment 0's) and the final states.
    A and B write o too (C overwrites it). Three passes' work for P times the CTAs: pays where
    the direct launch leaves most SMs idle (`segments_for`; docs/linear_attention/NOTES.md).
    t_pre: T once, over all N P segments (whole chunks of the sequences: the same tiles); a
    pass whose run starts at segment r reads it from slot r on (its run-local index j = i - r
    puts segment i's chunk c at slot first_slot(bos_i, i) - r + c). b_no_o: pass B on the
    t_pre form's `no_o` key: its o, which C overwrites, neither formed nor stored, and no q
    read: ~40 of the 72 KB a chunk and head at HV = H."""
    n, hv = final_state.shape[:2]
    dk, dv = q.shape[-1], v.shape[-1]
    if dk != dv:
        raise ValueError(f"the segmented path needs K = V (M is K x K as a state), got {dk}, {dv}")
    q, k, v = (_aligned(x) for x in (q, k, v))  # once, not in each pass
    # one o buffer for all passes: _direct's own copy-back would also copy the rows C skips
    dst = out if out.data_ptr() % ALIGN == 0 else torch.empty_like(out)
    cu = _segment_offsets(cu_seqlens, parts)
    runs = [cu[:-1], cu[1:-1].clone(), cu[1:].clone()]  # A, B, C; own bases (aligned like cu)
    total = n * parts
    flat = (total, *final_state.shape[1:])
    run = dict(k_last=k_last, l2norm=l2norm, v_split=None, t_pre=t_pre, state_lds=state_lds,
               o_warp=o_warp)  # fmt: skip
    t_all = t_diag_beta(k, g, beta, cu, l2norm=l2norm) if t_pre else None

    def from_segment(r):  # T as a pass starting at segment r indexes it
        return None if t_all is None else t_all[CHUNK * r :]

    starts = torch.zeros(flat, dtype=torch.float32, device=q.device)
    if initial_state is not None:
        starts[::parts] = initial_state
    local = torch.empty_like(starts)
    _direct(q, k, v, g, beta, starts[:-1], runs[0], dst, local[:-1], scale, **run,
            t_buf=from_segment(0))  # fmt: skip
    shifted = torch.empty_like(starts)
    if total > 2:
        eye = torch.eye(dk, dtype=torch.float32, device=q.device) * SEGMENT_SCALE
        init = eye.expand(total - 2, *final_state.shape[1:]).contiguous()
        _direct(q, k, v, g, beta, init, runs[1], dst, shifted[1:-1], scale, **run,
                no_o=b_no_o, t_buf=from_segment(1))  # fmt: skip
    shape = (n, parts, *final_state.shape[1:])
    local, shifted, by_seq = local.view(shape), shifted.view(shape), starts.view(shape)
    s = local[:, 0]
    for p in range(1, parts):
        by_seq[:, p] = s
        if p + 1 < parts:  # M ((K, V) layout) or M^T (k_last: S^T_end = S^T_start M^T + L^T)
            trans = (shifted[:, p] - local[:, p]) * (1.0 / SEGMENT_SCALE)
            s = (s @ trans if k_last else trans @ s) + local[:, p]
    last = torch.empty_like(starts)
    _direct(q, k, v, g, beta, starts[1:], runs[2], dst, last[1:], scale, **run,
            t_buf=from_segment(1))  # fmt: skip
    final_state.copy_(last.view(shape)[:, -1])
    if dst is not out:
        out.copy_(dst)
