"""Host launcher of the Gated DeltaNet backward's kernel 0 (the chunk factors): torch only (no
DSL). Its outputs are `forgekernel.reference.gdn_bwd_factors`' (`NAMES`, the layouts kernel 1's
two launches and kernel 2 read; `for_kernel2` cuts kernel 2's views)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.config import (
    CHUNK,
    OUT_TILES,
    out_tiles,
    params_for,
)
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

DTYPES = (torch.float16, torch.bfloat16)


def check_inputs(q, k, v, g, beta) -> tuple[int, int, int, int]:
    """(B, T, H, HV) of a valid call, else ValueError / TypeError saying what is off."""
    if q.dim() != 4:
        raise ValueError(f"q must be (B, T, H, K), got {tuple(q.shape)}")
    if q.dtype not in DTYPES:
        raise TypeError(f"q must be float16 or bfloat16, got {q.dtype}")
    b, t, h, kd = q.shape
    if tuple(k.shape) != (b, t, h, kd):
        raise ValueError(f"k must be {(b, t, h, kd)}, got {tuple(k.shape)}")
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % max(h, 1) or v.shape[2] < h:
        raise ValueError(f"v must be (B, T, HV, V) with HV a multiple of H = {h}, "
                         f"got {tuple(v.shape)}")  # fmt: skip
    for name, x in (("k", k), ("v", v)):
        if x.dtype != q.dtype:
            raise TypeError(f"{name} must be {q.dtype} (q's dtype), got {x.dtype}")
    hv = v.shape[2]
    for name, x in (("g", g), ("beta", beta)):
        if tuple(x.shape) != (b, t, hv):
            raise ValueError(f"{name} must be {(b, t, hv)}, got {tuple(x.shape)}")
        if x.dtype not in (torch.float32, q.dtype):
            raise TypeError(f"{name} must be float32 or {q.dtype}, got {x.dtype}")
    _params(dtype_name(q.dtype), (kd, v.shape[3]))  # K, V supported
    return b, t, h, hv


def empty_outputs(q: torch.Tensor, v: torch.Tensor, fused: bool = False,
                  w_from_t: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """The outputs, uninitialized: token tiles (B, NC C, HV, D) in q's dtype (`fused`: no Ke, Qe;
    `w_from_t`: no W, u either), e_last (B, NC, HV) and big_g (B, NC C, HV) fp32."""
    b, t, _, kd = q.shape
    hv, vd = v.shape[2], v.shape[3]
    nc = -(-t // CHUNK)
    width = {"w": kd, "u": vd, "pt": CHUNK, "ke": kd, "qe": kd, "tt": CHUNK}
    like = {"dtype": q.dtype, "device": q.device}
    out = {n: torch.empty(b, nc * CHUNK, hv, width[n], **like) for n in out_tiles(fused, w_from_t)}
    f32 = {"dtype": torch.float32, "device": q.device}
    out["e_last"] = torch.empty(b, nc, hv, **f32)
    out["big_g"] = torch.empty(b, nc * CHUNK, hv, **f32)
    return out


def gdn_bwd_factors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    out: dict[str, torch.Tensor] | None = None,
    fused: bool = False,
    w_from_t: bool = False,
) -> dict[str, torch.Tensor]:
    """Per chunk of 64 tokens and value head (every chunk at once): A = beta_i k_i.k_j
    e^(G_i - G_j) (j < i), T = (I + A)^-1 (the forward's tf32 blocked inverse), W = T diag(beta
    e^G) K, u = T diag(beta) V, P = (Q K^T) o e^(G_i - G_j) (j <= i), Ke = K e^(G_C - G),
    Qe = Q e^G, e^(G_C) and G = cumsum g within the chunk. q (scaled, normalized), k (B, T, H,
    K), v (B, T, HV, V) in one 16-bit dtype (value head hv reads q / k head hv // (HV / H));
    g, beta (B, T, HV) fp32 or that dtype. Returns `reference.gdn_bwd_factors.NAMES`' dict
    (`empty_outputs`' shapes), written into `out` (contiguous, those shapes) when given.
    `fused`: the op's fused route's key, no Ke, Qe (not in the dict; the others bit for bit);
    `w_from_t` (with fused): no W, u either (v not read: the T-only form)."""
    b, t, h, hv = check_inputs(q, k, v, g, beta)
    if w_from_t and not fused:
        raise ValueError("w_from_t needs fused")
    outs = empty_outputs(q, v, fused, w_from_t)
    if out is not None:
        for name, x in outs.items():
            y = out[name]
            if y.shape != x.shape or y.dtype != x.dtype or not y.is_contiguous():
                raise ValueError(f"out[{name!r}] must be contiguous {x.dtype} "
                                 f"{tuple(x.shape)}")  # fmt: skip
        outs = {n: out[n] for n in outs}
    if b * hv * t == 0:
        return outs
    key = _params(dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), fused=fused, w_from_t=w_from_t)
    fn = get_kernel(SPEC, key)
    tiles = [as_tma_ready(x) for x in (q, k, v)]
    gates = [x.float().contiguous() for x in (g, beta)]
    with on_device(q.device):
        fn(*tiles, *gates, *(outs.get(n) for n in OUT_TILES), outs["e_last"], outs["big_g"])
    return outs
