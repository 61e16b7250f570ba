"""Host launcher of Kimi Delta Attention's fused backward kernel (kernel 2 + the WY kernel, one
launch): torch only (no DSL). Its inputs are kernel 2's (`reference.kda_bwd_chunk`'s
`chunk_grad_tiles`) and the WY kernel's but dw (`reference.kda_bwd_wy`'s `wy_tiles`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import check_tables
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90 import SPEC
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.config import params_for
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch as wy_launch
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

# (dq, dk, dv, dg, dbeta)
Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def empty_outputs(do: torch.Tensor, k: int, dq16: bool = False, dv16: bool = False,
                  tokens: int | None = None) -> Outputs:  # fmt: skip
    """(dq, dk, dv, dg, dbeta) uninitialized (the kernel writes every entry; dk and dg are
    written by phase A before phase B adds onto them): dq (B, T, HV, K) fp32 or do's dtype
    (dq16), dk, dg fp32, dv (B, T, HV, V) fp32 or do's dtype (dv16), dbeta (B, T, HV) fp32; T =
    `tokens` where given (`token_rows`)."""
    b, t, hv, v = do.shape
    t = t if tokens is None else tokens

    def empty(*shape, low=False):
        return torch.empty(*shape, dtype=do.dtype if low else torch.float32, device=do.device)

    return (empty(b, t, hv, k, low=dq16), empty(b, t, hv, k), empty(b, t, hv, v, low=dv16),
            empty(b, t, hv, k), empty(b, t, hv))  # fmt: skip


def check_outputs(outs, do: torch.Tensor, k: torch.Tensor, dq16: bool = False,
                  dv16: bool = False, tokens: int | None = None) -> None:  # fmt: skip
    """`out` as `empty_outputs` would make it: the WY kernel's checks on (dk, dv, dg, dbeta)
    (contiguous, fp32 dk / dg distinct and 16-byte aligned: bulk copies' addresses), dq as
    kernel 2 writes it; else ValueError."""
    if len(outs) != 5:
        raise ValueError(f"out must be 5 tensors (dq, dk, dv, dg, dbeta), got {len(outs)}")
    dq, dk, dv, dg, dbeta = outs
    wy_launch.check_outputs((dk, dv, dg, dbeta), k, do.shape[-1], dv16, tokens)
    want = do.dtype if dq16 else torch.float32
    if dq.shape != dk.shape or dq.dtype != want or dq.device != do.device:
        raise ValueError(f"out's dq must be contiguous {want} {tuple(dk.shape)} on {do.device}, "
                         f"got {dq.dtype} {tuple(dq.shape)} on {dq.device}")  # fmt: skip
    if not dq.is_contiguous():
        raise ValueError("out's dq must be contiguous")


def kda_bwd_fused(
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
    dq16: bool = False,
    scale: float = 1.0,
    dv16: bool = False,
    dk16: bool = False,
    out: Outputs | None = None,
    dk_out: torch.Tensor | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens: int | None = None,
) -> Outputs:
    """`kda_bwd_chunk` (dw16) then `kda_bwd_wy` on its dw, as one launch: the same outputs bit
    for bit. Kernel 2's inputs (do, u (kernel 1's U), du, q, k, h, dh, big_g) and the WY
    kernel's others (tt, w, uw (its u), v, beta), their shapes and dtypes. Returns (dq, dk, dv,
    dg, dbeta): dq as kernel 2's (`dq16`, `scale`), dk fp32 kernel 2's plus the WY half (with
    `dk16` the final dk in do's dtype, into `dk_out` when given, the fp32 dk then scratch), dv
    (`dv16`), dg (kernel 2's plus the WY half's, the reverse cumsum within the chunk done),
    dbeta; into `out` (dq, dk, dv, dg, dbeta; contiguous) when given. `tables`, `tokens`: both
    kernels' `token_rows` (B = 1, the varlen slot layout: the outputs at their token rows)."""
    b, t, hv, _ = chunk_launch.check_inputs(do, u, du, q, k, h, dh, big_g)
    wy_launch.check_inputs(k, du, tt, w, k, uw, v, beta, big_g)  # k in dw's place: its shape
    if scale != 1.0 and not dq16:
        raise ValueError("scale applies to dq16's unscaled q only (else q comes scaled)")
    if dk_out is not None and not dk16:
        raise ValueError("dk_out is dk16's 16-bit final dk (pass dk16=True)")
    check_tables(tables, tokens, b, t)
    kd = q.shape[-1]
    outs = empty_outputs(do, kd, dq16, dv16, tokens) if out is None else out
    if b * hv * t:  # (empty tensors share address 0: the distinct dk / dg check would refuse)
        check_outputs(outs, do, k, dq16, dv16, tokens)
    dq, dk, dv, dg, dbeta = outs
    dk_final = dk
    if dk16:
        rows = (b, t if tokens is None else tokens, hv, kd)
        dk_final = k.new_empty(rows) if dk_out is None else dk_out
        ok = (dk_final.shape == rows and dk_final.dtype == k.dtype
              and dk_final.device == k.device and dk_final.is_contiguous())  # fmt: skip
        if not ok:
            raise ValueError(f"dk_out must be contiguous {k.dtype} {rows} on {k.device}, got "
                             f"{dk_final.dtype} {tuple(dk_final.shape)}")  # fmt: skip
    result = (dq, dk_final, dv, dg, dbeta)
    if b * hv * t == 0:
        return result
    key = _params(dtype_name(do.dtype), (kd, do.shape[-1]), dq16=dq16, dv16=dv16, dk16=dk16,
                  token_rows=tables is not None)  # fmt: skip
    fn = get_kernel(SPEC, key)
    tiles = [as_tma_ready(x) for x in (do, u, du, q, k, h, dh)]
    wy_tiles = [as_tma_ready(x) for x in (tt, w, uw, v)]
    with on_device(do.device):
        fn(*tiles, big_g.contiguous(), *wy_tiles, beta.contiguous(), dq, dk, dg, dv, dbeta,
           dk_final, *(tables or (None, None)), float(scale))  # fmt: skip
    return result
