"""Host launcher of the Gated DeltaNet backward's kernel 2 (chunk-parallel output-side
gradients): torch only (no DSL). Its inputs are `forgekernel.reference.gdn_bwd_chunk`'s
`chunk_grad_tiles`; its outputs go through that module's `finish_output_grads`."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.config import CHUNK, params_for
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_inputs(do, u, du, q, k, h, dh, big_g) -> tuple[int, int, int, int]:
    """(B, T, HV, NC) of a valid call, else ValueError / TypeError saying what is off. q, k
    (B, T, H, K) with H dividing HV (grouped value heads: hv reads head hv // (HV / H))."""
    if do.dim() != 4:
        raise ValueError(f"do must be (B, T, HV, V), got {tuple(do.shape)}")
    b, t, hv, v = do.shape
    nc = -(-t // CHUNK)
    if do.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"do must be float16 or bfloat16, got {do.dtype}")
    kd = q.shape[-1]
    hq = q.shape[2] if q.dim() == 4 and q.shape[2] > 0 and hv % q.shape[2] == 0 else hv
    want = {"u": (b, t, hv, v), "du": (b, t, hv, v), "q": (b, t, hq, kd), "k": (b, t, hq, kd),
            "h": (b, nc, hv, kd, v), "dh": (b, nc, hv, kd, v)}  # fmt: skip
    for name, x in zip(want, (u, du, q, k, h, dh)):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != do.dtype:
            raise TypeError(f"{name} must be {do.dtype} (do's dtype), got {x.dtype}")
    _params(dtype_name(do.dtype), (kd, v))  # K, V supported
    if tuple(big_g.shape) != (b, t, hv) or big_g.dtype != torch.float32:
        raise ValueError(f"G must be float32 {(b, t, hv)}, got {big_g.dtype} "
                         f"{tuple(big_g.shape)}")  # fmt: skip
    return b, t, hv, nc


def empty_outputs(do: torch.Tensor, k: int) -> Outputs:
    """(dq, dk, dw (B, T, HV, K), dg (B, T, HV)) fp32, uninitialized."""
    b, t, hv, _ = do.shape
    f32 = {"dtype": torch.float32, "device": do.device}
    return (*(torch.empty(b, t, hv, k, **f32) for _ in range(3)),
            torch.empty(b, t, hv, **f32))  # fmt: skip


def gdn_bwd_chunk(
    do: torch.Tensor,
    u: torch.Tensor,
    du: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    big_g: torch.Tensor,
    *,
    out: Outputs | None = None,
) -> Outputs:
    """Per chunk of 64 tokens (every chunk at once): dq = (dO h^T) e^G + dPD k, dk = (U dh^T)
    e^(G_C - G) + dPD^T q, dw = -dU h^T, dPD = (dO U^T) o D, and dg, `_output_grads`' dG after
    the reverse cumsum within the chunk (rows dq.q - dk.k, the last position's te sum + e^(G_C)
    <dh, h>, te = (U dh^T).(k e^(G_C - G))). do, u, du (B, T, HV, V), q (scaled), k (B, T, HV,
    K) (or (B, T, H, K), H dividing HV: value head hv reads head hv // (HV / H), the `grouped`
    key), h, dh (B, NC, HV, K, V: the state at each chunk's start, its gradient at the chunk's
    end) in one 16-bit dtype; big_g (B, T, HV) fp32 the within-chunk cumulative log decay.
    Returns (dq, dk, dw, dg) fp32, written into `out` (contiguous) when given."""
    b, t, hv, _ = check_inputs(do, u, du, q, k, h, dh, big_g)
    outs = empty_outputs(do, q.shape[-1]) if out is None else out
    for x in outs:
        if not x.is_contiguous() or x.dtype != torch.float32:
            raise ValueError("out must be contiguous float32 tensors")
    if b * hv * t == 0:
        return outs
    grouped = q.shape[2] != hv  # H < HV: the grouped key (H = HV: the standard one)
    fn = get_kernel(SPEC, _params(dtype_name(do.dtype), (q.shape[-1], do.shape[-1]),
                                  grouped=grouped))  # fmt: skip
    tiles = [as_tma_ready(x) for x in (do, u, du, q, k, h, dh)]
    with on_device(do.device):
        fn(*tiles, big_g.contiguous(), *outs, *(None,) * 9, 1.0)
    return outs


WyOutputs = tuple[torch.Tensor, ...]


def check_tables(tables, tokens: int | None, b: int, t: int) -> None:
    """`gdn_bwd_chunk_wy`'s tables and tokens: both or neither; B = 1, (starts, lengths) int32
    (NC,) contiguous on the tiles' device, NC = ceil(T / C) (T the slot layout's rows)."""
    if (tables is None) != (tokens is None):
        raise ValueError("tables and tokens come together (the varlen slot layout's outputs)")
    if tables is None:
        return
    nc = -(-t // CHUNK)
    if b != 1:
        raise ValueError(f"tables take the slot layout: B = 1, got {b}")
    for x in tables:
        if x.dtype != torch.int32 or tuple(x.shape) != (nc,) or not x.is_contiguous():
            raise ValueError(f"tables must be contiguous int32 ({nc},), got {x.dtype} "
                             f"{tuple(x.shape)}")  # fmt: skip


def check_wy_inputs(do, q, tt, w, uw, v, beta) -> None:
    """The WY variant's extra inputs, else ValueError / TypeError."""
    b, t, hv, vd = do.shape
    kd = q.shape[-1]
    want = {"tt": (b, t, hv, CHUNK), "w": (b, t, hv, kd), "uw": (b, t, hv, vd),
            "v": (b, t, hv, vd)}  # fmt: skip
    for name, x in zip(want, (tt, w, uw, v)):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != do.dtype:
            raise TypeError(f"{name} must be {do.dtype} (do's dtype), got {x.dtype}")
    if tuple(beta.shape) != (b, t, hv) or beta.dtype != torch.float32:
        raise ValueError(f"beta must be float32 {(b, t, hv)}, got {beta.dtype} "
                         f"{tuple(beta.shape)}")  # fmt: skip


def wy_dtypes(do: torch.Tensor, dv16: bool = False, dqk16: bool = False) -> list[torch.dtype]:
    """The dtypes of the WY variant's (dq, dk, dg, dv, dbeta): fp32, `dv16`: dv in do's dtype,
    `dqk16`: dq, dk in do's dtype."""
    want = [torch.float32] * 5
    if dv16:
        want[3] = do.dtype
    if dqk16:
        want[0] = want[1] = do.dtype
    return want


def empty_wy_outputs(do: torch.Tensor, k: int, dv16: bool = False, dqk16: bool = False,
                     tokens: int | None = None) -> WyOutputs:  # fmt: skip
    """(dq, dk (B, T, HV, K), dg (B, T, HV), dv (B, T, HV, V), dbeta (B, T, HV)) in
    `wy_dtypes`; T = `tokens` where given (`gdn_bwd_chunk_wy`'s tables), else do's."""
    b, t, hv, v = do.shape
    t = t if tokens is None else tokens
    shapes = ((b, t, hv, k), (b, t, hv, k), (b, t, hv), (b, t, hv, v), (b, t, hv))
    return tuple(torch.empty(s, dtype=dt, device=do.device)
                 for s, dt in zip(shapes, wy_dtypes(do, dv16, dqk16)))  # fmt: skip


def gdn_bwd_chunk_wy(
    do: torch.Tensor,
    u: torch.Tensor,
    du: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    big_g: torch.Tensor,
    tt: torch.Tensor,
    w: torch.Tensor,
    uw: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: WyOutputs | None = None,
    dv16: bool = False,
    dqk16: bool = False,
    scale: float = 1.0,
    fsplit: bool = False,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens: int | None = None,
) -> WyOutputs:
    """All of pass 3 per chunk: `gdn_bwd_chunk`'s products, then the WY half from dw on chip
    ([dkb dvb] = T^T [dw du], dv = beta dvb, dA, M = beta (dA o D), dk += beta e^G dkb + M k +
    M^T k, dbeta, dG's WY rows). Extra inputs: tt (B, T, HV, 64) (row j of a chunk: column j
    of T = L^-1), w (B, T, HV, K), uw (B, T, HV, V) (the forward's w, u), v (B, T, HV, V) in
    do's dtype; beta (B, T, HV) fp32. Returns (dq, dk, dg (pass 3's dG, the reverse cumsum
    within the chunk done), dv, dbeta) fp32 (`dv16`: dv in do's dtype; `dqk16`: dq, dk in do's
    dtype, rounded once, dq times `scale`), into `out` (contiguous) when given. `fsplit`
    (dqk16 only): the two-math-warpgroup form of the same kernel (config.FSPLIT_*), the same
    outputs bit for bit. `tables` (B = 1, the inputs in the varlen slot layout,
    ops/_linattn_varlen.py `Slots`): (starts, lengths) int32 (NC,), the outputs (1, `tokens`,
    ...) token-major: chunk c's row r at token starts[c] + r for r < lengths[c] (the
    `token_rows` key), no other row written."""
    b, t, hv, _ = check_inputs(do, u, du, q, k, h, dh, big_g)
    check_wy_inputs(do, q, tt, w, uw, v, beta)
    if scale != 1.0 and not dqk16:
        raise ValueError("scale multiplies dqk16's 16-bit dq only")
    check_tables(tables, tokens, b, t)
    outs = empty_wy_outputs(do, q.shape[-1], dv16, dqk16, tokens) if out is None else out
    want = wy_dtypes(do, dv16, dqk16)
    rows = t if tokens is None else tokens
    for x, dt in zip(outs, want):
        if not x.is_contiguous() or x.dtype != dt or x.shape[:2] != (b, rows):
            raise ValueError(f"out must be contiguous (B, T, ...) {(b, rows)} tensors of dtypes "
                             f"{want}")  # fmt: skip
    if b * hv * t == 0:
        return outs
    params = _params(dtype_name(do.dtype), (q.shape[-1], do.shape[-1]), wy=True,
                     grouped=q.shape[2] != hv, dv16=dv16, dqk16=dqk16,
                     fsplit=fsplit, token_rows=tables is not None)  # fmt: skip
    fn = get_kernel(SPEC, params)
    tiles = [as_tma_ready(x) for x in (do, u, du, q, k, h, dh)]
    extra = [as_tma_ready(x) for x in (tt, w, uw)]
    dq, dk, dg, dv, dbeta = outs
    with on_device(do.device):
        fn(*tiles, big_g.contiguous(), dq, dk, None, dg, *extra, v.contiguous(),
           beta.contiguous(), dv, dbeta, *(tables or (None, None)), float(scale))  # fmt: skip
    return outs
