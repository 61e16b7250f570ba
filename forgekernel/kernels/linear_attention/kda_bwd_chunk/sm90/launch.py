"""Host launcher of Kimi Delta Attention's backward kernel 2 (the chunk-parallel output-side
gradients): torch only (no DSL). Its inputs are `forgekernel.reference.kda_bwd_chunk`'s
`chunk_grad_tiles`."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import check_tables
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import SPEC
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.config import CHUNK, params_for
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def check_inputs(do, u, du, q, k, h, dh, big_g) -> tuple[int, int, int, int]:
    """(B, T, HV, NC) of a valid call, else ValueError / TypeError saying what is off."""
    if do.dim() != 4:
        raise ValueError(f"do must be (B, T, HV, V), got {tuple(do.shape)}")
    b, t, hv, v = do.shape
    nc = -(-t // CHUNK)
    if do.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"do must be float16 or bfloat16, got {do.dtype}")
    kd = q.shape[-1]
    want = {"u": (b, t, hv, v), "du": (b, t, hv, v), "q": (b, t, hv, kd), "k": (b, t, hv, kd),
            "h": (b, nc, hv, kd, v), "dh": (b, nc, hv, kd, v)}  # fmt: skip
    for name, x in zip(want, (u, du, q, k, h, dh)):
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != do.dtype:
            raise TypeError(f"{name} must be {do.dtype} (do's dtype), got {x.dtype}")
    _params(dtype_name(do.dtype), (kd, v))  # K, V supported
    if tuple(big_g.shape) != (b, t, hv, kd) or big_g.dtype != torch.float32:
        raise ValueError(f"G must be float32 {(b, t, hv, kd)}, got {big_g.dtype} "
                         f"{tuple(big_g.shape)}")  # fmt: skip
    return b, t, hv, nc


def empty_outputs(do: torch.Tensor, k: int, dw16: bool = False, dq16: bool = False,
                  tokens: int | None = None) -> Outputs:  # fmt: skip
    """(dq, dk, dw, dg) (B, T, HV, K), uninitialized: fp32, dw / dq in do's 16-bit dtype with
    dw16 / dq16; dq, dk, dg at `tokens` rows where given (the `token_rows` key), dw at T."""
    b, t, hv, _ = do.shape

    def empty(low=False, rows=t):
        return torch.empty(b, rows, hv, k, dtype=do.dtype if low else torch.float32,
                           device=do.device)  # fmt: skip

    rows = t if tokens is None else tokens
    return empty(dq16, rows), empty(rows=rows), empty(dw16), empty(rows=rows)


def check_outputs(outs, do: torch.Tensor, k: int, dw16: bool = False, dq16: bool = False,
                  tokens: int | None = None) -> None:  # fmt: skip
    """`out` as `empty_outputs(do, k, dw16, dq16, tokens)` would make it (the kernel writes
    every entry of those shapes: a smaller tensor would be written past its end), else
    ValueError."""
    if len(outs) != 4:
        raise ValueError(f"out must be 4 tensors (dq, dk, dw, dg), got {len(outs)}")
    shape = (*do.shape[:3], k)
    rows = shape if tokens is None else (shape[0], tokens, *shape[2:])
    low = {"dq": dq16, "dw": dw16}
    for name, x in zip(("dq", "dk", "dw", "dg"), outs):
        want = do.dtype if low.get(name) else torch.float32
        at = shape if name == "dw" else rows
        ok = tuple(x.shape) == at and x.dtype == want and x.device == do.device
        if not ok or not x.is_contiguous():
            raise ValueError(
                f"out's {name} must be contiguous {want} {at} on {do.device}"
                + (f" ({name}16: {name} in do's dtype)" if low.get(name) else "")
                + f", got {x.dtype} {tuple(x.shape)} on {x.device}"
            )


def kda_bwd_chunk(
    do: torch.Tensor,
    u: torch.Tensor,
    du: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    h: torch.Tensor,
    dh: torch.Tensor,
    big_g: torch.Tensor,
    *,
    dw16: bool = False,
    dq16: bool = False,
    scale: float = 1.0,
    out: Outputs | None = None,
    tables: tuple[torch.Tensor, torch.Tensor] | None = None,
    tokens: int | None = None,
) -> Outputs:
    """Per chunk of 64 tokens (every chunk at once), reference/kda_bwd.py's `_output_grads`:
    dq, dk, dw and dg (its per-channel dG after the reverse cumsum within the chunk); the
    products as `reference.kda_bwd_chunk.chunk_grads_model` forms them. do, u, du (B, T, HV,
    V), q (scaled), k (B, T, HV, K), h, dh (B, NC, HV, K, V: the state at each chunk's start,
    its gradient at the chunk's end) in one 16-bit dtype; big_g (B, T, HV, K) fp32 the
    within-chunk cumulative log decay per key channel. Returns (dq, dk, dw, dg) (B, T, HV, K)
    fp32 (dw in do's 16-bit dtype with `dw16`: the WY kernel's operand), written into `out`
    (contiguous, as `empty_outputs` makes them) when given. `dq16`: q UNscaled, `scale` (the
    op's q scale) applied in the kernel to every product of q, dq written times it in do's
    16-bit dtype (the op's dq where no l2norm or group sum follows); else q scaled and
    `scale` must be 1. `tables`, `tokens` (B = 1, the varlen slot layout): Gated DeltaNet
    kernel 2's (`check_tables`): dq, dk, dg (1, tokens, HV, K) at their token rows, dw at the
    slots (the WY kernel's operand)."""
    b, t, hv, _ = check_inputs(do, u, du, q, k, h, dh, big_g)
    if scale != 1.0 and not dq16:
        raise ValueError("scale applies to dq16's unscaled q only (else q comes scaled)")
    check_tables(tables, tokens, b, t)
    outs = empty_outputs(do, q.shape[-1], dw16, dq16, tokens) if out is None else out
    check_outputs(outs, do, q.shape[-1], dw16, dq16, tokens)
    if b * hv * t == 0:
        return outs
    key = _params(dtype_name(do.dtype), (q.shape[-1], do.shape[-1]), dw16=dw16, dq16=dq16,
                  token_rows=tables is not None)  # fmt: skip
    fn = get_kernel(SPEC, key)
    tiles = [as_tma_ready(x) for x in (do, u, du, q, k, h, dh)]
    with on_device(do.device):
        fn(*tiles, big_g.contiguous(), *outs, *(tables or (None, None)), float(scale))
    return outs
