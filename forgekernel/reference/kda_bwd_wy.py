"""The CPU model of Kimi Delta Attention's backward WY kernel (kernels/linear_attention/
kda_bwd_wy/sm90): its inputs (`wy_tiles`: token-major tiles built from the chunk factors the
op's kernel path holds) and the kernel's per-chunk products as it forms them (`wy_grads_model`,
batched over every (sequence, chunk, value head), the 16-bit operands the kernel forms on chip
rounded as it rounds them), equal to reference/kda_bwd.py's `_wy_grads` with its dG
reverse-cumsummed within the chunk.

Per chunk (C = 64 rows; T = L^-1, L = I + diag(beta) M(k, k) strictly lower; four sub-chunks of
16 with reference points r_I = G at row 16 I + 8 clamped to the chunk's last row inside T,
a = G - r_I(row), el = e^a, er = e^(-a), zero past T; reference/kda_bwd_chunk.py's scheme):

    dvb = T^T du,  dkb = T^T dw            (C x V x C), (C x K x C): A = T^T (the input tile),
                                           B = du, dw MN-major, tile dtype
    dv  = beta o dvb                       out
    z   = dkb o k o e^G                    (C, K) fp32
    dA  = -(dkb w^T + dvb u^T), j < i      (C x C x K), (C x C x V): A = dkb, dvb rounded to the
                                           tile dtype (register operands), rows inside T
    dx  = sum_(J <= I(i)) e^(G_i - r_J) o (dA[:, J] (k er)[J])      dA unscaled, bf16 A operand
    dy  = sum_(I >= J(j)) e^(r_I - G_j) o ((beta dA)[I, :]^T (k el)[I])    (beta dA)^T bf16
    dbeta = rowsum(dvb o v) + rowsum(z) + rowsum(k o dx)
    dk  = beta o e^G o dkb + beta o dx + dy
    dG  = reverse cumsum over the chunk's rows of beta o z + k o (beta o dx - dy)

`_wy_grads`' rowsum(dA o M(k, k)) is rowsum(k o dx) with dx from the unscaled dA (dx_ic =
sum_j dA_ij k_jc e^(G_ic - G_jc)): no (C, C) product of k with itself. Its score gradients of
beta dA are (beta o dx, dy): beta scales dA's rows, so dx's rows after the blocks and dy's A
operand before them. dA has no diagonal (A is strictly lower): nothing cancels as kernel 2's dP_ii
terms do. The block products run in bf16 for either tile dtype (er reaches e^(8 max|g|), past
fp16's range, as in the forward's first pass).
"""

from __future__ import annotations

import torch

from forgekernel.reference.delta_rule_bwd import _solve_lower
from forgekernel.reference.gdn_bwd_state import CHUNK, to_chunks, to_tokens
from forgekernel.reference.kda_bwd_chunk import NS, sub_chunk_decays
from forgekernel.reference.kda_chunked import SUB_CHUNK


def wy_tiles(f, dw, d_u, big_g, dtype) -> tuple[torch.Tensor, ...]:
    """The WY kernel's inputs: f reference/kda_bwd.py's `_Factors` of every chunk (B, NC, HV,
    C, ...), dw (B, T, HV, K) token-major (kernel 2's output), d_u (B, NC, HV, C, V) chunked
    (kernel 1's), big_g (B, T, HV, K) `kda_bwd_chunk.cumulative_decay`'s G (kernel 2's input)
    -> (dw, du, tt (B, T, HV, C): row j of a chunk is column j of T = L^-1 (the first pass's
    `tt` where f carries it as `tt_tokens`, else solved here), w, k (B, T, HV, K), u, v (B, T,
    HV, V)) in `dtype`, contiguous; beta (B, T, HV) in G's dtype, G itself."""
    t = big_g.shape[1]

    def tok(x):
        return to_tokens(x.to(dtype))[:, :t].contiguous()

    tt_tokens = getattr(f, "tt_tokens", None)  # the first pass's `bwd` key wrote T^T
    if tt_tokens is not None:
        tt = tt_tokens[:, :t].to(dtype).contiguous()
    else:
        eye = torch.eye(CHUNK, dtype=f.lower.dtype, device=f.lower.device)
        tt = tok(_solve_lower(f.lower, eye.expand_as(f.lower)).transpose(-1, -2))
    du, w, k, u, v = (tok(x) for x in (d_u, f.w, f.k, f.u, f.v))
    beta = to_tokens(f.beta.to(big_g.dtype).unsqueeze(-1))[:, :t, :, 0].contiguous()
    return (dw.to(dtype).contiguous(), du, tt, w, k, u, v, beta, big_g)


def _ident(x: torch.Tensor) -> torch.Tensor:
    return x


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def wy_grads_model(dw, du, tt, w, k, u, v, beta, big_g, operands=None):
    """The kernel's outputs from its inputs (`wy_tiles`' layouts), every chunk at once: (dk, dv
    (B, T, HV, K / V), dg (B, T, HV, K): `_wy_grads`' dG reverse-cumsummed within the chunk,
    dbeta (B, T, HV)) in the inputs' float dtype (fp64 for the checks). `operands`: the tile
    dtype whose on-chip rounding to emulate (dvb, dkb in it; dA, beta dA, (k er), (k el) in
    bf16), or None: nothing rounded."""
    t = dw.shape[1]
    nc = -(-t // CHUNK)
    f = big_g.dtype
    tile = _ident if operands is None else (lambda x: x.to(operands).to(x.dtype))
    rnd = _ident if operands is None else _bf16
    dw_c, du_c, tt_c, w_c, k_c, u_c, v_c = (to_chunks(x.to(f), nc) for x in
                                            (dw, du, tt, w, k, u, v))  # fmt: skip
    beta_c = to_chunks(beta.to(f), nc).unsqueeze(-1)  # (B, NC, HV, C, 1)
    gc = to_chunks(big_g, nc)
    valid, r, el, er, _ = sub_chunk_decays(gc, t)
    e_g = torch.where(valid, gc.exp(), 0)
    dvb, dkb = tt_c @ du_c, tt_c @ dw_c
    z = dkb * k_c * e_g
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=dw.device).tril(-1)
    da = -(tile(dkb) @ w_c.transpose(-1, -2) + tile(dvb) @ u_c.transpose(-1, -2))
    da = torch.where(strict & valid, da, 0)
    dx, dy = _score_grads(k_c, rnd(da), rnd(beta_c * da), gc, r, el, er, valid, rnd)
    dbeta = (dvb * v_c).sum(-1) + z.sum(-1) + (k_c * dx).sum(-1)
    dx = beta_c * dx
    dk = beta_c * e_g * dkb + dx + dy
    rows = beta_c * z + k_c * (dx - dy)
    dg = rows.flip(-2).cumsum(-2).flip(-2)
    grads = (to_tokens(x)[:, :t] for x in (dk, beta_c * dvb, dg))
    return (*grads, to_tokens(dbeta.unsqueeze(-1))[:, :t, :, 0])


def _score_grads(k, da_x, da_y, gc, r, el, er, valid, rnd):
    """(dx, dy) of M(k, k) by the kernel's sub-chunk blocks: dx for the cotangent da_x, dy for
    da_y (both masked, rounded as the A operands), the B operands (k er), (k el) rounded by
    `rnd`."""
    kr, kl = rnd(k * er), rnd(k * el)
    blocks = torch.arange(CHUNK, device=k.device) // SUB_CHUNK
    dx, dy = torch.zeros_like(k), torch.zeros_like(k)
    for j in range(NS):
        cols = slice(j * SUB_CHUNK, (j + 1) * SUB_CHUNK)
        rj = r[..., j : j + 1, :]
        keep = valid & (blocks >= j).view(CHUNK, 1)  # rows of blocks I >= J
        left = torch.where(keep, (gc - rj).masked_fill(~keep, 0).exp(), 0)  # e^(G_i - r_J)
        dx = dx + left * (da_x[..., cols] @ kr[..., cols, :])
        keep_y = valid & (blocks <= j).view(CHUNK, 1)  # rows of blocks J <= I
        right = torch.where(keep_y, (rj - gc).masked_fill(~keep_y, 0).exp(), 0)  # e^(r_I - G_j)
        dy = dy + right * (da_y[..., cols, :].transpose(-1, -2) @ kl[..., cols, :])
    return dx, dy
