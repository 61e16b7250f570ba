"""Host launcher of Kimi Delta Attention's backward WY kernel (the chunk-parallel WY half):
torch only (no DSL). Its inputs are `forgekernel.reference.kda_bwd_wy`'s `wy_tiles`."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import check_tables
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import SPEC
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import (
    BULK_ALIGN,
    CHUNK,
    params_for,
)
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_inputs(dw, du, tt, w, k, u, v, beta, big_g) -> tuple[int, int, int]:
    """(B, T, HV) of a valid call, else ValueError / TypeError saying what is off."""
    if dw.dim() != 4:
        raise ValueError(f"dw must be (B, T, HV, K), got {tuple(dw.shape)}")
    b, t, hv, kd = dw.shape
    if dw.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"dw must be float16 or bfloat16, got {dw.dtype}")
    vd = du.shape[-1]
    want = {"du": (b, t, hv, vd), "tt": (b, t, hv, CHUNK), "w": (b, t, hv, kd),
            "k": (b, t, hv, kd), "u": (b, t, hv, vd), "v": (b, t, hv, vd)}  # fmt: skip
    for name, x in zip(want, (du, tt, w, k, u, v)):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != dw.dtype:
            raise TypeError(f"{name} must be {dw.dtype} (dw's dtype), got {x.dtype}")
    _params(dtype_name(dw.dtype), (kd, vd))  # K, V supported
    for name, x, shape in (("beta", beta, (b, t, hv)), ("G", big_g, (b, t, hv, kd))):
        if tuple(x.shape) != shape or x.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 {shape}, got {x.dtype} "
                             f"{tuple(x.shape)}")  # fmt: skip
    return b, t, hv


def empty_outputs(dw: torch.Tensor, v: int, dv16: bool = False,
                  tokens: int | None = None) -> Outputs:  # fmt: skip
    """(dk (B, T, HV, K), dv (B, T, HV, V), dg (B, T, HV, K), dbeta (B, T, HV)) fp32 (dv in
    dw's 16-bit dtype with dv16): dk and dg zero (the kernel adds onto them: alone, the WY
    half's dk and dG), dv and dbeta uninitialized; T = `tokens` where given (`token_rows`)."""
    b, t, hv, kd = dw.shape
    t = t if tokens is None else tokens

    def empty(*shape, dtype=torch.float32):
        return torch.empty(*shape, dtype=dtype, device=dw.device)

    def zeros(*shape):
        return torch.zeros(*shape, dtype=torch.float32, device=dw.device)

    dv = empty(b, t, hv, v, dtype=dw.dtype if dv16 else torch.float32)
    return zeros(b, t, hv, kd), dv, zeros(b, t, hv, kd), empty(b, t, hv)


def check_outputs(outs, dw: torch.Tensor, v: int, dv16: bool = False,
                  tokens: int | None = None) -> None:  # fmt: skip
    """`out` as `empty_outputs(dw, v, dv16, tokens)` would make it (the kernel reads and writes
    every entry of dk and dg and writes every entry of dv and dbeta: a smaller tensor would be
    accessed past its end; dk and dg 16-byte aligned), else ValueError."""
    b, t, hv, kd = dw.shape
    t = t if tokens is None else tokens
    shapes = {"dk": (b, t, hv, kd), "dv": (b, t, hv, v), "dg": (b, t, hv, kd), "dbeta": (b, t, hv)}
    if len(outs) != len(shapes):
        raise ValueError(f"out must be 4 tensors (dk, dv, dg, dbeta), got {len(outs)}")
    for (name, shape), x in zip(shapes.items(), outs):
        want = dw.dtype if name == "dv" and dv16 else torch.float32
        ok = tuple(x.shape) == shape and x.dtype == want and x.device == dw.device
        if not ok or not x.is_contiguous():
            raise ValueError(
                f"out's {name} must be contiguous {str(want)[6:]} {shape} on {dw.device}"
                + (" (dv16: dv in dw's dtype)" if name == "dv" and dv16 else "")
                + f", got {x.dtype} {tuple(x.shape)} on {x.device}"
            )
    if outs[0].data_ptr() == outs[2].data_ptr():
        raise ValueError("out's dk and dg must be distinct tensors (both are accumulated)")
    for name, x in (("dk", outs[0]), ("dg", outs[2])):
        if x.data_ptr() % BULK_ALIGN:  # dG's rows: bulk reduce-adds; dk's: bulk L2 prefetches
            raise ValueError(f"out's {name} must start {BULK_ALIGN}-byte aligned (its rows are "
                             f"bulk copies' addresses), got address {x.data_ptr():#x}")  # fmt: skip


def kda_bwd_wy(
    dw: torch.Tensor,
    du: torch.Tensor,
    tt: torch.Tensor,
    w: torch.Tensor,
    k: torch.Tensor,
    u: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    big_g: torch.Tensor,
    *,
    dv16: bool = False,
    dk16: bool = False,
    out: Outputs | None = None,
    dk_out: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens: int | None = None,
) -> Outputs:
    """Per chunk of 64 tokens (every chunk at once), reference/kda_bwd.py's `_wy_grads`: the
    WY half's dk, dv, dg (its per-channel dG after the reverse cumsum within the chunk) and
    dbeta, the products as `reference.kda_bwd_wy.wy_grads_model` forms them. dw, w, k (B, T,
    HV, K), du, u, v (B, T, HV, V), tt (B, T, HV, 64: row j of a chunk is column j of T =
    L^-1) in one 16-bit dtype; beta (B, T, HV), big_g (B, T, HV, K) fp32. Returns (dk, dv,
    dg, dbeta) fp32, written into `out` (contiguous) when given: dk and dg ACCUMULATED (the
    WY half added onto what they hold: kernel 2's dk and dG on the backward's path; the
    kernel reads and writes each chunk's rows once, race-free on one stream), dv and dbeta
    overwritten. Without `out`, dk and dg start at zero (the WY half alone). `dv16`: dv in the
    tiles' 16-bit dtype (v's on the backward's path where the op's v is 16-bit). `dk16`: the
    final dk (out's fp32 dk + the WY half) in dw's 16-bit dtype, rounded once, into `dk_out`
    (contiguous (B, T, HV, K); a new tensor when None) and returned in dk's place; out's fp32
    dk is then scratch (it ends holding kernel 2's dk plus two of the WY half's three terms).
    `tables`, `tokens` (B = 1, the varlen slot layout; Gated DeltaNet kernel 2's
    `check_tables`): dk, dv, dg, dbeta (and dk_out) (1, tokens, ...) at their token rows (kernel
    2's `token_rows` dk, dG there), the inputs at the slots."""
    b, t, hv = check_inputs(dw, du, tt, w, k, u, v, beta, big_g)
    if dk_out is not None and not dk16:
        raise ValueError("dk_out is dk16's 16-bit final dk (pass dk16=True)")
    check_tables(tables, tokens, b, t)
    outs = empty_outputs(dw, du.shape[-1], dv16, tokens) if out is None else out
    check_outputs(outs, dw, du.shape[-1], dv16, tokens)
    dk_final = outs[0]
    if dk16:
        rows = (b, t if tokens is None else tokens, *dw.shape[2:])
        dk_final = dw.new_empty(rows) if dk_out is None else dk_out
        ok = (dk_final.shape == rows and dk_final.dtype == dw.dtype
              and dk_final.device == dw.device and dk_final.is_contiguous())  # fmt: skip
        if not ok:
            raise ValueError(f"dk_out must be contiguous {str(dw.dtype)[6:]} "
                             f"{rows} on {dw.device} (dk16: dk in dw's dtype), got "
                             f"{dk_final.dtype} {tuple(dk_final.shape)} on "
                             f"{dk_final.device}")  # fmt: skip
    result = (dk_final, *outs[1:])
    if b * hv * t == 0:
        return result
    key = _params(dtype_name(dw.dtype), (dw.shape[-1], du.shape[-1]), dv16=dv16, dk16=dk16,
                  token_rows=tables is not None)  # fmt: skip
    fn = get_kernel(SPEC, key)
    tiles = [as_tma_ready(x) for x in (dw, du, tt, w, k, u, v)]
    with on_device(dw.device):
        fn(*tiles, beta.contiguous(), big_g.contiguous(), *outs, dk_final,
           *(tables or (None, None)))  # fmt: skip
    return result
