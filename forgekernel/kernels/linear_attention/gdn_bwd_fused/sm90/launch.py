"""Host launcher of the Gated DeltaNet fused backward (kernel 1's reverse recurrence and kernel
2's chunk gradients in one kernel): torch only (no DSL). Its inputs are the device pass's
(ops/gated_delta_rule_bwd.py `_fused_pass`): kernel 0's P^T, T^T, W, u, G and kernel 1's
forward launch's U, h; its outputs are kernel 2's (WY, dv16, dqk16) and kernel 1's dh0. The
varlen slot layout (ops/_linattn_varlen.py): kernel 1's `check_varlen` and kernel 2's
`check_tables`, one mechanism each."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import check_tables
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import (
    CHUNK,
    PAIR,
    params_for,
)
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.launch import check_varlen
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

Outputs = tuple[torch.Tensor, ...]  # dq, dk, dg, dv, dbeta, dh0


def check_inputs(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                 states: int | None = None) -> tuple[int, int, int]:  # fmt: skip
    """(B, T, HV) of a valid call, else ValueError / TypeError saying what is off. q, k (B, T,
    H, K) with H dividing HV (value head hv reads head hv // (HV / H)); dht's leading size
    `states` where it is not B (varlen: N)."""
    if do.dim() != 4:
        raise ValueError(f"do must be (B, T, HV, V), got {tuple(do.shape)}")
    b, t, hv, vd = do.shape
    if do.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"do must be float16 or bfloat16, got {do.dtype}")
    kd = q.shape[-1]
    params_for(dtype_name(do.dtype), (kd, vd))  # K, V supported
    hq = q.shape[2] if q.dim() == 4 and q.shape[2] > 0 and hv % q.shape[2] == 0 else hv
    nc = -(-t // CHUNK)
    want = {"u": (b, t, hv, vd), "q": (b, t, hq, kd), "k": (b, t, hq, kd),
            "h": (b, nc, hv, kd, vd), "pt": (b, t, hv, CHUNK), "tt": (b, t, hv, CHUNK),
            "w": (b, t, hv, kd), "uw": (b, t, hv, vd), "v": (b, t, hv, vd)}  # fmt: skip
    if (w is None) != (uw is None):
        raise ValueError("w and uw come together (both None: `w_from_t`)")
    for name, x in zip(want, (u, q, k, h, pt, tt, w, uw, v)):
        if x is None and name in ("u", "w", "uw"):  # formed in the kernel (`u_from_h`, `w_from_t`)
            continue
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != do.dtype:
            raise TypeError(f"{name} must be {do.dtype} (do's dtype), got {x.dtype}")
    for name, x in (("G", big_g), ("beta", beta)):
        if tuple(x.shape) != (b, t, hv) or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {(b, t, hv)}, got {x.dtype} "
                             f"{tuple(x.shape)}")  # fmt: skip
    n = b if states is None else states
    if dht is not None and (tuple(dht.shape) != (n, hv, kd, vd) or dht.dtype != torch.float32):
        raise ValueError(f"dht must be float32 {(n, hv, kd, vd)}, got {dht.dtype} "
                         f"{tuple(dht.shape)}")  # fmt: skip
    return b, t, hv


def empty_outputs(do: torch.Tensor, k: int, tokens: int | None = None,
                  states: int | None = None, heads: int | None = None) -> Outputs:  # fmt: skip
    """(dq, dk (B, T, HV, K), dg (B, T, HV), dv (B, T, HV, V), dbeta (B, T, HV), dh0 (B, HV,
    K, V)): dq, dk, dv in do's dtype, the rest fp32, uninitialized; T = `tokens` and dh0's B =
    `states` where given (varlen: the token rows, N); dq, dk at `heads` heads where given
    (`group_sum`: H)."""
    b, t, hv, v = do.shape
    t = t if tokens is None else tokens
    n = b if states is None else states
    hq = hv if heads is None else heads
    f32 = {"dtype": torch.float32, "device": do.device}
    low = {"dtype": do.dtype, "device": do.device}
    return (torch.empty(b, t, hq, k, **low), torch.empty(b, t, hq, k, **low),
            torch.empty(b, t, hv, **f32), torch.empty(b, t, hv, v, **low),
            torch.empty(b, t, hv, **f32), torch.empty(n, hv, k, v, **f32))  # fmt: skip


def gdn_bwd_fused(
    do: torch.Tensor,
    u: torch.Tensor | None,
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor,
    big_g: torch.Tensor,
    pt: torch.Tensor,
    tt: torch.Tensor,
    w: torch.Tensor | None,
    uw: torch.Tensor | None,
    v: torch.Tensor,
    beta: torch.Tensor,
    dht: torch.Tensor | None,
    *,
    scale: float = 1.0,
    out: Outputs | None = None,
    cu_seqlens: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens: int | None = None,
    group_sum: bool = False,
    wg_split: bool = False,
) -> Outputs:
    """The reverse state recurrence and every chunk gradient, one CTA per (sequence, value
    head), chunks last first (kernels/linear_attention/gdn_bwd_fused/sm90/fused_bwd.py). do
    (B, T, HV, V), u = U (the forward's corrected values; None: the kernel forms U = uw - W h,
    the `u_from_h` key), q (scaled), k (B, T, H, K), h (B, NC,
    HV, K, V: the state at each chunk's start), pt, tt (B, T, HV, 64: row j of a chunk holds
    column j of P, of T = L^-1), w (B, T, HV, K), uw = the WY u, v (B, T, HV, V), all in one
    16-bit dtype; big_g (the within-chunk cumulative log decay), beta (B, T, HV) fp32; dht (B,
    HV, K, V) fp32 or None. Returns (dq (times `scale`), dk, dg (the reverse cumsum within the
    chunk done), dv, dbeta, dh0) in `empty_outputs`' dtypes, into `out` (contiguous) when
    given. The varlen slot layout (ops/_linattn_varlen.py `Slots`; all four or none): the
    tiles (1, S C, ...) over S slots, `cu_seqlens` int32 (N + 1,), `order` int32 (N,) (the
    sequences longest first), dht and dh0 (N, HV, K, V), `tables` (starts, lengths) int32
    (S,) and the token outputs (1, `tokens`, ...) at their token rows (the `varlen` key).
    `group_sum` (HV = 2 H): dq, dk (B, T, H, K) summed over each q / k head's two value heads
    in fp32 in the kernel (a cluster of two CTAs), the 16-bit sum written once (varlen: (1,
    `tokens`, H, K) at the token rows).
    `wg_split` (a candidate, next/gdn-bwd-wgsplit; with `group_sum` too): the same outputs
    from the 512-thread key (G's chain on two math warpgroups). w, uw None (with u None and
    `wg_split`: the `w_from_t` key, a candidate, next/gdn-w-from-t): W = T diag(beta e^G) K and
    u = T diag(beta) V formed in the kernel from T^T, k, v, beta, G (T's 16-bit rounding
    first: within a 16-bit rounding of kernel 0's W, u, not bit for bit)."""
    varlen = cu_seqlens is not None
    if varlen != (order is not None) or varlen != (tables is not None):
        raise ValueError("cu_seqlens, order, tables and tokens come together (varlen)")
    states = check_varlen(do, cu_seqlens, order) if varlen else None
    b, t, hv = check_inputs(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, states)
    check_tables(tables, tokens, b, t)
    heads = q.shape[2] if group_sum else hv  # dq, dk's
    if group_sum and hv != PAIR * heads:
        raise ValueError(f"group_sum needs HV = {PAIR} H (got HV {hv}, H {heads})")
    outs = empty_outputs(do, q.shape[-1], tokens, states, heads) if out is None else out
    for x, want in zip(outs, empty_outputs(do[:0], q.shape[-1])):
        if not x.is_contiguous() or x.dtype != want.dtype:
            raise ValueError("out must be contiguous tensors in `empty_outputs`' dtypes")
    rows, n = t if tokens is None else tokens, b if states is None else states
    if any(x.shape[:2] != (b, rows) for x in outs[:5]) or outs[5].shape[0] != n:
        raise ValueError(f"out must be {(b, rows)} token rows and {n} states")
    if any(x.shape[2] != heads for x in outs[:2]):
        raise ValueError(f"out's dq, dk must have {heads} heads")
    if b * hv * t == 0:
        return outs
    params = params_for(dtype_name(do.dtype), (q.shape[-1], do.shape[-1]),
                        d_final_state=dht is not None, grouped=q.shape[2] != hv,
                        u_from_h=u is None, varlen=varlen, group_sum=group_sum,
                        wg_split=wg_split, w_from_t=w is None)  # fmt: skip
    fn = get_kernel(SPEC, params)
    tiles = [None if x is None else as_tma_ready(x) for x in (do, u, q, k, h)]
    wy = [None if x is None else as_tma_ready(x) for x in (pt, tt, w, uw)]
    v = as_tma_ready(v) if w is None else v.contiguous()  # `w_from_t`: a TMA box too
    dq, dk, dg, dv, dbeta, dh0 = outs
    dst = None if dht is None else dht.contiguous()
    with on_device(do.device):
        fn(*tiles, big_g.contiguous(), *wy, v, beta.contiguous(), dst, dq, dk, dg,
           dv, dbeta, dh0, cu_seqlens, order, *(tables or (None, None)), float(scale))  # fmt: skip
    return outs
