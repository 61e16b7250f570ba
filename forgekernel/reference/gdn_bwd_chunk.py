"""The CPU model of the Gated DeltaNet backward's kernel 2 (kernels/linear_attention/
gdn_bwd_chunk/sm90): its inputs (token-major tiles built from the chunk tensors the op's kernel
path holds), the kernel's per-chunk products as it forms them (`chunk_grads_model`, the tile
emulation: batched over every (sequence, chunk, head), dPD rounded to the tiles' dtype before
its two products as the kernel's 16-bit operands are; `wy_grads_model` its WY half), and its
dG finish (`kernel_dg`: the last position's term and the reverse cumsum within the chunk).

dG folded: `_output_grads`' dG of row i is

    (dqe o qe)_i. + rowsum(dPD o QK^T)_i - colsum(dPD o QK^T)_i - to_end_i,
    to_end_i = (dke o ke)_i.

With dq = dqe e^G + dPD k and dk = dPD^T q + dke e^(G_C - G): (dq . q)_i = (dqe o qe)_i. +
rowsum(dPD o QK^T)_i and (dk . k)_i = colsum(dPD o QK^T)_i + to_end_i, so dG_i = dq_i . q_i -
dk_i . k_i, two row dots of the kernel's own outputs (QK^T never formed). The last position of
each chunk also takes sum_i to_end_i + e^(G_C) (dh . h) (the kernel's finish warps: te's
chunk sum, (dh . h) from its 16-bit state tiles), then dG is reverse-cumsummed within the chunk.
"""

from __future__ import annotations

import torch

from forgekernel.reference.gdn_bwd_state import CHUNK, to_chunks, to_tokens


def chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype) -> tuple[torch.Tensor, ...]:
    """Kernel 2's inputs: qs (scaled), ks (B, T, HV, K), do (B, T, HV, V) token-major; big_u,
    d_u (B, NC, HV, C, V) and h, dh (B, NC, HV, K, V) chunked, any dtype; g (B, T, HV) ->
    (do, u, du (B, T, HV, V), q, k (B, T, HV, K), h, dh (B, NC, HV, K, V)) in `dtype`,
    contiguous, and G (B, T, HV) fp32 (fp64 for fp64 g), the within-chunk cumulative log
    decay."""
    t, nc = qs.shape[1], h.shape[1]

    def tok(x):
        return to_tokens(x.to(dtype))[:, :t].contiguous()

    def tile(x):
        return x.to(dtype).contiguous()

    wide = g.to(torch.promote_types(g.dtype, torch.float32))  # fp64 stays (the exact checks)
    big_g = to_tokens(to_chunks(wide, nc).cumsum(-1))[:, :t].contiguous()
    return (tile(do), tok(big_u), tok(d_u), tile(qs), tile(ks), tile(h), tile(dh), big_g)


def chunk_grads_model(do, u, du, q, k, h, dh, big_g, rounding=None):
    """The kernel's outputs from its inputs (`chunk_grad_tiles`' layouts), every chunk at once:
    (dq, dk, dw (B, T, HV, K), dg (the row dots dq.q - dk.k), te (to_end) (B, T, HV)) in the
    inputs' float dtype (fp64 for the checks). `rounding`: the kernel's rounding of dPD to the
    tiles' 16-bit dtype before its two products (None: none). q, k may hold H < HV heads (the
    `grouped` key): value head hv reads head hv // (HV / H)."""
    t = do.shape[1]
    nc = h.shape[1]
    q, k = (_to_value_heads(x, do.shape[2]) for x in (q, k))
    f = h.dtype if h.dtype in (torch.float32, torch.float64) else torch.float32
    do_c, u_c, du_c, q_c, k_c = (to_chunks(x.to(f), nc) for x in (do, u, du, q, k))
    h, dh = h.to(f), dh.to(f)
    gc = to_chunks(big_g.to(f), nc)  # zero past T
    valid = to_chunks(torch.ones_like(big_g, dtype=torch.bool), nc)
    g_last = _chunk_last(big_g.to(f), nc)  # G at each chunk's last token inside T
    e_g = torch.where(valid, gc.exp(), 0)
    e_end = torch.where(valid, (g_last.unsqueeze(-1) - gc).exp(), 0)
    causal = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=do.device).tril()
    mask = causal & valid.unsqueeze(-1)
    diff = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~mask, 0)
    decay = torch.where(mask, diff.exp(), 0)
    dpd = (do_c @ u_c.transpose(-1, -2)) * decay
    if rounding is not None:
        dpd = rounding(dpd)
    dq = (do_c @ h.transpose(-1, -2)) * e_g.unsqueeze(-1) + dpd @ k_c
    dke = (u_c @ dh.transpose(-1, -2)) * e_end.unsqueeze(-1)
    te = (dke * k_c).sum(-1)
    dk = dke + dpd.transpose(-1, -2) @ q_c
    dg = (dq * q_c).sum(-1) - (dk * k_c).sum(-1)
    dw = -(du_c @ h.transpose(-1, -2))
    return (*(to_tokens(x)[:, :t] for x in (dq, dk, dw, dg, te)),)


def wy_tiles(f, v, beta, dtype) -> tuple[torch.Tensor, ...]:
    """The WY variant's extra inputs from the chunk factors `f` ((B, NC, HV, C, ...)), v
    (B, T, HV, V), beta (B, T, HV): (tt (B, T, HV, C): row j of a chunk holds column j of
    T = L^-1, w (B, T, HV, K), u (B, T, HV, V), v in `dtype`; beta fp32 (fp64 for fp64))."""
    t = v.shape[1]
    c = f.lower.shape[-1]
    eye = torch.eye(c, dtype=f.lower.dtype, device=f.lower.device)
    inverse = torch.linalg.solve_triangular(f.lower, eye, upper=False, unitriangular=True)

    def tok(x):
        return to_tokens(x.to(dtype))[:, :t].contiguous()

    wide = beta.to(torch.promote_types(beta.dtype, torch.float32)).contiguous()
    return (tok(inverse.transpose(-1, -2)), tok(f.w), tok(f.u), v.to(dtype).contiguous(), wide)


def wy_grads_model(outputs, du, k, h, big_g, tt, w, uw, v, beta, dw_rounding=None, rounding=None):
    """The WY variant's outputs from `chunk_grads_model`'s (dq, dk, dw, dg, te) and the
    extra inputs (`wy_tiles`' layouts): (dq, dk, dg, te (dk, dg with the WY half's terms), dv
    (B, T, HV, V), dbeta (B, T, HV)), as the kernel forms them: dw rounded to the tiles' dtype
    (`dw_rounding`, a shared-memory operand), dkb, dvb and M rounded (`rounding`, register A
    operands) before their products."""
    dq, dk, dw, dg, te = outputs
    t, nc = du.shape[1], h.shape[1]
    k = _to_value_heads(k, du.shape[2])
    f = dw.dtype

    def ident(x):
        return x

    dw_r = (dw_rounding or ident)(dw)
    rnd = rounding or ident
    du_c, k_c, w_c, uw_c, v_c, dw_c, tt_c = (to_chunks(x.to(f), nc)
                                             for x in (du, k, w, uw, v, dw_r, tt))  # fmt: skip
    gc = to_chunks(big_g.to(f), nc)
    beta_c = to_chunks(beta.to(f), nc)  # zero past T
    valid = to_chunks(torch.ones_like(big_g, dtype=torch.bool), nc)
    e_g = torch.where(valid, gc.exp(), 0)
    dkb, dvb = tt_c @ dw_c, tt_c @ du_c
    dv = beta_c.unsqueeze(-1) * dvb
    x = (dkb * k_c).sum(-1)
    dbeta = (dvb * v_c).sum(-1) + e_g * x
    da = rnd(dkb) @ w_c.transpose(-1, -2) + rnd(dvb) @ uw_c.transpose(-1, -2)
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=du.device).tril(-1)
    mask = strict & valid.unsqueeze(-1)
    diff = (gc.unsqueeze(-1) - gc.unsqueeze(-2)).masked_fill(~mask, 0)
    dae = -da * torch.where(mask, diff.exp(), 0)
    rkk = (dae * (k_c @ k_c.transpose(-1, -2))).sum(-1)
    m = beta_c.unsqueeze(-1) * dae
    dk2 = (beta_c * e_g).unsqueeze(-1) * dkb + rnd(m) @ k_c
    before = (dk2 * k_c).sum(-1)
    dk2 = dk2 + rnd(m).transpose(-1, -2) @ k_c
    after = (dk2 * k_c).sum(-1)
    dbeta = dbeta + rkk
    dg2 = beta_c * e_g * x + beta_c * rkk - (after - before)
    dk = dk + to_tokens(dk2)[:, :t]
    dg = dg + to_tokens(dg2)[:, :t]
    return dq, dk, dg, te, to_tokens(dv)[:, :t], to_tokens(dbeta)[:, :t]


def kernel_dg(dg, te, h, dh, big_g):
    """The kernel's dG finish (its warps 1, 2): per chunk, the last position's term sum(te) +
    e^(G_C) <dh, h> (h, dh as the kernel reads them: its 16-bit tiles) and the reverse
    cumulative sum of the rows dg (B, T, HV) -> dG (B, T, HV) (G = cumsum(g) within the
    chunk; the last position's term reaches every row, the padded ones carry nothing else)."""
    t, nc = dg.shape[1], h.shape[1]
    f = dg.dtype
    d = to_chunks(dg, nc)
    g_last = _chunk_last(big_g.to(f), nc)
    last = to_chunks(te, nc).sum(-1) + g_last.exp() * (dh.to(f) * h.to(f)).sum((-1, -2))
    cum = d.flip(-1).cumsum(-1).flip(-1) + last.unsqueeze(-1)
    return to_tokens(cum)[:, :t]


def token_rows_model(
    x: torch.Tensor,
    starts: torch.Tensor,
    lengths: torch.Tensor,
    tokens: int,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The `token_rows` key's stores: x (1, S C, ...) in the slot layout -> (1, `tokens`, ...),
    row r of slot s at token starts[s] + r for r < lengths[s] (the per-slot tables,
    ops/_linattn_varlen.py `slot_tables`), no other row written: into `out` where given, else
    a NaN-filled tensor (a row no slot writes stays NaN)."""
    if out is None:
        out = x.new_full((x.shape[0], tokens, *x.shape[2:]), float("nan"))
    r = torch.arange(CHUNK)
    inside = r < lengths.long().unsqueeze(1)  # (S, C)
    src = (torch.arange(starts.shape[0]).unsqueeze(1) * CHUNK + r)[inside]
    dst = (starts.long().unsqueeze(1) + r)[inside]
    out[:, dst] = x[:, src].to(out.dtype)
    return out


def _to_value_heads(x: torch.Tensor, hv: int) -> torch.Tensor:
    """q or k (B, T, H, K) -> (B, T, HV, K): head hv // (HV / H) for value head hv."""
    return x if x.shape[2] == hv else x.repeat_interleave(hv // x.shape[2], dim=2)


def _chunk_last(big_g: torch.Tensor, nc: int) -> torch.Tensor:
    """(B, T, HV) -> (B, NC, HV): G at each chunk's last token inside T."""
    t = big_g.shape[1]
    last = torch.clamp(torch.arange(nc, device=big_g.device) * CHUNK + CHUNK - 1, max=t - 1)
    return big_g[:, last]
