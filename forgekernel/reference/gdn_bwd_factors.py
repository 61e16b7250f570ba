"""The CPU model of the Gated DeltaNet backward's kernel 0 (kernels/linear_attention/
gdn_bwd_factors/sm90): the chunk factors that kernel 1's two launches and kernel 2 read, in
their layouts, formed per (chunk, value head) from q, k, v, g, beta.

`factor_tiles` builds them from reference/delta_rule_bwd.py's `_Factors` (the torch pass the
kernel replaces, and its fallback); `factors_model` is the tile emulation of the kernel: every
chunk at once, the products in the kernel's order, its 16-bit operands rounded by `rounding`
(T diag(beta e^G) and T diag(beta), the A operands of W = . K and u = . V) and the outputs in
`dtype`. Per chunk of C = 64 tokens (q scaled and normalized, G = cumsum g within the chunk,
zero gates and rows past T):

    A   = beta_i k_i.k_j e^(G_i - G_j)  (j < i),   T = (I + A)^-1
    W   = T diag(beta e^G) K,   u = T diag(beta) V,   P = (Q K^T) o e^(G_i - G_j)  (j <= i)
    Ke  = K e^(G_C - G),   Qe = Q e^G,   e^(G_C)

Outputs (`NAMES`; token tiles (B, NC C, HV, D) in `dtype`, every chunk's 64 rows written,
the padded ones zero; vectors fp32):

    w, u, pt (row j: column j of P), ke, qe, tt (row j: column j of T)   chunks in order
    e_last (B, NC, HV) = e^(G_C),  big_g (B, NC C, HV) = G

Kernel 1's reverse launch reads pt, ke, qe, w (and e_last); its forward launch (`forward`
variant) u, w, ke as do, ke, w and e_last, as they are (chunk order, unnegated: its signs in
registers; `forward_launch_tiles`); kernel 2 reads w, u, tt and big_g cut to T tokens
(`wy_tiles`, `chunk_grad_tiles`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from forgekernel.reference.delta_rule_bwd import _Factors
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    cut,
    forward_launch_as_reverse,
    to_chunks,
    to_tokens,
)

NAMES = ("w", "u", "pt", "ke", "qe", "tt", "e_last", "big_g")
TOKEN_TILES = NAMES[:6]


def _tiles(w, u, p, ke, qe, inverse, e_last, big_g, dtype) -> dict[str, torch.Tensor]:
    """Chunk pieces (B, NC, HV, C, ...) -> the kernel's outputs (module docstring)."""

    def tok(x):
        return to_tokens(x.to(dtype))

    wide = torch.promote_types(e_last.dtype, torch.float32)  # fp64 stays (the exact checks)
    out = {"w": tok(w), "u": tok(u), "pt": tok(p.transpose(-1, -2)), "ke": tok(ke),
           "qe": tok(qe), "tt": tok(inverse.transpose(-1, -2))}  # fmt: skip
    out["e_last"] = e_last.to(wide).contiguous()
    out["big_g"] = to_tokens(big_g.to(wide))
    return out


def factor_tiles(f: _Factors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The kernel's outputs from the torch factors of every chunk (`chunk_factors`: pieces
    (B, NC, HV, C, ...)): what the op's kernel path formed before kernel 0."""
    c = f.lower.shape[-1]
    eye = torch.eye(c, dtype=f.lower.dtype, device=f.lower.device)
    inverse = torch.linalg.solve_triangular(f.lower, eye, upper=False, unitriangular=True)
    big_g = f.e_g.log()  # G itself: e^G > 0 on every row (zero gates past T)
    return _tiles(f.w, f.u, f.p, f.ke, f.qe, inverse, f.e_last[..., 0], big_g, dtype)


def scan_model(g: torch.Tensor) -> torch.Tensor:
    """G = cumsum(g) within each chunk as kernel 0's `_gates` adds it, in fp32: g (B, T, HV)
    -> G (B, NC C, HV) (zero gates past T). Lane l of the warp holds tokens 2 l, 2 l + 1; their
    pair sums are scanned over the 32 lanes in five shuffle steps (lane l adds lane l - 2^i's
    running sum: Kogge-Stone), G_(2l+1) = lane l's inclusive sum, G_(2l) = (that - the pair) +
    g_(2l). Not a sequential sum: past a chunk's last nonzero gate the rows need not repeat its
    G bit for bit (row 63, e^(G_C) and Ke's G_C, against row T - 1, kernel 2's G_C of a chunk
    cut by T: NOTES "Slots against each sequence alone")."""
    nc = -(-g.shape[1] // CHUNK)
    x = to_chunks(g.float(), nc).unflatten(-1, (CHUNK // 2, 2))  # (B, NC, HV, lanes, 2)
    pair = x[..., 0] + x[..., 1]
    incl = pair
    for i in range(5):
        step = 1 << i
        up = torch.zeros_like(incl)
        up[..., step:] = incl[..., :-step]
        incl = torch.where(torch.arange(CHUNK // 2) >= step, incl + up, incl)
    big = torch.stack(((incl - pair) + x[..., 0], incl), dim=-1).flatten(-2)
    return to_tokens(big)


def factors_model(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    dtype: torch.dtype,
    rounding: Callable[[torch.Tensor], torch.Tensor] | None = None,
    inverse: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """The kernel's outputs from its inputs: q (scaled, normalized), k (B, T, H, K), v (B, T,
    HV, V), g, beta (B, T, HV); value head hv reads q / k head hv // (HV / H). Computed in the
    inputs' float dtype (fp64 for the checks); `rounding`: the kernel's 16-bit A operands of W
    and u (None: none); `inverse`: (I + A) -> T (None: the exact triangular solve; the tests
    may pass the tf32 replay of the forward's blocked inverse)."""
    b, t, h, _ = q.shape
    hv = v.shape[2]
    nc = -(-t // CHUNK)
    f = torch.promote_types(q.dtype, torch.float32)
    group = hv // h
    qc, kc = (to_chunks(x.to(f).repeat_interleave(group, dim=2), nc) for x in (q, k))
    vc, gc, bc = (to_chunks(x.to(f), nc) for x in (v, g, beta))
    big_g = gc.cumsum(-1)
    e_g = big_g.exp()
    e_end = (big_g[..., -1:] - big_g).exp()
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=q.device).tril()
    strict = causal.tril(-1)
    diff = big_g.unsqueeze(-1) - big_g.unsqueeze(-2)
    decay = torch.where(causal, diff.masked_fill(~causal, 0).exp(), 0)
    a = bc.unsqueeze(-1) * (kc @ kc.transpose(-1, -2)) * decay * strict
    lower = torch.eye(CHUNK, dtype=f, device=q.device) + a
    eye = torch.eye(CHUNK, dtype=f, device=q.device)
    if inverse is None:
        tri = torch.linalg.solve_triangular(lower, eye, upper=False, unitriangular=True)
    else:
        tri = inverse(lower)
    rnd = rounding or (lambda x: x)
    w = rnd(tri * (bc * e_g).unsqueeze(-2)) @ kc
    u = rnd(tri * bc.unsqueeze(-2)) @ vc
    p = (qc @ kc.transpose(-1, -2)) * decay
    ke = kc * e_end.unsqueeze(-1)
    qe = qc * e_g.unsqueeze(-1)
    return _tiles(w, u, p, ke, qe, tri, e_g[..., -1], big_g, dtype)


def for_kernel2(tiles: dict[str, torch.Tensor], t: int) -> dict[str, torch.Tensor]:
    """Kernel 2's views of the outputs: w, u, tt and big_g cut to T tokens (views: strided
    when B > 1, which TMA reads in place); w, u only where written (kernel 0's `w_from_t` key
    has neither)."""
    return {n: cut(tiles[n], 1, slice(None, t)) for n in ("w", "u", "tt", "big_g") if n in tiles}


def forward_launch_tiles(
    tiles: dict[str, torch.Tensor],
    identity: bool = True,
    k: torch.Tensor | None = None,
    v: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Kernel 1's forward launch's inputs from the outputs. `identity` False (kernel 1's
    `forward` variant: chunks first to last, I and 0 built in, the signs in registers): the
    tiles as written, do = u, ke = w, w = ke, pt and qe None, e_last (fp32), no copy; with `k`
    (B, T, H, K) (its `fused` variant, on kernel 0's `fused` tiles: no Ke) w = k and big_g,
    kernel 0's G of every row, from which it forms Ke's decays; with `k`, `v` (B, T, HV, V)
    and `beta` (B, T, HV) (its `w_from_t` variant, on kernel 0's `w_from_t` tiles: no W, u)
    do = v, pt = T^T cut to T rows, ke None and beta: it forms u and W. `identity` True (the reverse
    variant run as the forward recurrence, the fp32-out path): torch makes
    `forward_state_tiles`' dict, do = u, pt = I, ke = -W, qe = 0, w = -Ke with the chunks
    reversed and e_last reversed (`reference.gdn_bwd_state.forward_launch_as_reverse`)."""
    if not identity:
        w = tiles["ke"] if k is None else k
        if v is None:
            out = {"do": tiles["u"], "pt": None, "ke": tiles["w"], "qe": None, "w": w}
        else:
            tt = cut(tiles["tt"], 1, slice(None, v.shape[1]))
            out = {"do": v, "pt": tt, "ke": None, "qe": None, "w": w, "beta": beta}
        out["e_last"] = tiles["e_last"].float()
        if k is not None:
            out["big_g"] = tiles["big_g"]
        return out
    return forward_launch_as_reverse(tiles["u"], tiles["w"], tiles["ke"], tiles["e_last"])


def rounding_to(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x rounded to `dtype`, kept in x's dtype (the kernel's 16-bit operands)."""
    return lambda x: x.to(dtype).to(x.dtype)


def w_u_from_t(
    tt: torch.Tensor, k: torch.Tensor, v: torch.Tensor, beta: torch.Tensor, big_g: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """W = T diag(beta e^G) K and u = T diag(beta) V as the fused backward's `w_from_t` key
    forms them from kernel 0's 16-bit T^T (kernel 2's views, cut to T tokens): tt (B, T, HV,
    C) (row j of a chunk: column j of T), k (B, T, H, K) (value head hv reads head hv // (HV
    / H)), v (B, T, HV, V) in one 16-bit dtype; beta, big_g (B, T, HV) fp32 -> (w, uw) in that
    dtype, (B, T, HV, K / V). The A operands T diag(.) rounded to 16 bits from the 16-bit T
    (kernel 0 rounds them from its fp32 T: one more rounding here), the products in fp64
    rounded once (the kernel's fp32 accumulator, up to its order of sums)."""
    t, hv = tt.shape[1], tt.shape[2]
    nc = -(-t // CHUNK)
    rnd = rounding_to(tt.dtype)
    tri = to_chunks(tt.double(), nc).transpose(-1, -2)  # (B, NC, HV, C, C): T
    kc = to_chunks(k.double().repeat_interleave(hv // k.shape[2], dim=2), nc)
    vc = to_chunks(v.double(), nc)
    bc = to_chunks(beta.double(), nc)  # zero past T
    e_g = to_chunks(big_g.double(), nc).exp()
    w = rnd(tri * (bc * e_g).unsqueeze(-2)) @ kc
    u = rnd(tri * bc.unsqueeze(-2)) @ vc
    return tuple(to_tokens(x)[:, :t].to(tt.dtype) for x in (w, u))
