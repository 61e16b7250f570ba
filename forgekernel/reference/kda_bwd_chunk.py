"""The CPU model of Kimi Delta Attention's backward kernel 2, output side
(kernels/linear_attention/kda_bwd_chunk/sm90): its inputs (token-major tiles built from the
chunk tensors the op's kernel path holds) and the kernel's per-chunk products as it forms them
(`chunk_grads_model`: batched over every (sequence, chunk, value head), the 16-bit operands the
kernel forms on chip rounded by `rounding`: bf16 for both tile dtypes), equal to
reference/kda_bwd.py's `_output_grads` with its dG reverse-cumsummed within the chunk.

Per chunk (C = 64 rows, four sub-chunks of 16 with reference points r_I = G at row 16 I + 8,
clamped to the chunk's last row inside T; a = G - r_I(row), el = e^a, er = e^(-a), zero past T):

    dq  = (dO h^T) o e^G + sum_(J <= I(i)) e^(G_i - r_J) o (dP[:, J] (k er)[J])
          + dP_ii k_i
    dk  = (U dh^T) o e^(G_C - G) + sum_(I >= J(j)) e^(r_I - G_j) o (dP[I, :]^T (q el)[I])
          + dP_jj q_j
    dw  = -dU h^T,   dP = dO U^T (j < i in the block products, rows inside T; its diagonal
          dP_ii kept in fp32)
    dG  = reverse cumsum over the chunk's rows of (q o dq - k o dk) without the diagonal's
          terms, plus on every row sum_i (k o (U dh^T) o e^(G_C - G))_i + e^(G_C) o
          rowsum(h o dh)

per key channel. Each column block J of dq's sum is one 64 x 128 x 16 WGMMA (A = dP's k-block J
from registers, B = (k er) in shared memory) scaled elementwise by e^(G_i - r_J) (<= 1 for
J < I, <= e^(8 max|g|) for J = I) before it is added: no factor is e^(-G). dk's sum goes by row
blocks I of dP (A = dP^T's k-block I from shared memory, B = (q el)). The fold of dG:
q o dq = (q e^G) o dqe + q o dq_P and k o dk = k o dk_P + (k e^(G_C - G)) o dke, so
`_output_grads`' rows are q o dq - k o dk (no (C, C) product for dG); its last-row term reaches
every row through the reverse cumsum. The diagonal's terms (q_i dP_ii k_i in both) cancel
exactly and are left out of dG: with 16-bit block operands they would not cancel (dq's goes
through (k er), dk's through (q el), each rounded), and under strong decay (g in [-5, -4]) they
dominate the rows while dG is small (0.33 of dG's max off with bf16 operands when kept; the
diagonal in fp32 outside the WGMMAs: within 2e-2). The WY half (`_wy_grads`) stays in torch:
its dG adds after its own reverse cumsum (the cumsum is linear).
"""

from __future__ import annotations

import torch

from forgekernel.kernels.common.sm90.constants import LN2, LOG2E
from forgekernel.reference.gdn_bwd_state import CHUNK, to_chunks, to_tokens
from forgekernel.reference.kda_chunked import SUB_CHUNK

NS = CHUNK // SUB_CHUNK


def chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype) -> tuple[torch.Tensor, ...]:
    """Kernel 2's inputs: qs (scaled), ks (B, T, HV, K), do (B, T, HV, V) token-major; big_u,
    d_u (B, NC, HV, C, V) and h, dh (B, NC, HV, K, V) chunked, any dtype; g (B, T, HV, K) ->
    (do, u, du (B, T, HV, V), q, k (B, T, HV, K), h, dh (B, NC, HV, K, V)) in `dtype`,
    contiguous, and G (B, T, HV, K) fp32 (fp64 for fp64 g), the within-chunk cumulative log
    decay per key channel."""
    t, nc = qs.shape[1], h.shape[1]

    def tok(x):
        return to_tokens(x.to(dtype))[:, :t].contiguous()

    def tile(x):
        return x.to(dtype).contiguous()

    big_g = cumulative_decay(g, nc)
    return (tile(do), tok(big_u), tok(d_u), tile(qs), tile(ks), tile(h), tile(dh), big_g)


def cumulative_decay(g: torch.Tensor, nc: int) -> torch.Tensor:
    """G (B, T, HV, K) of g (B, T, HV, K): the within-chunk cumulative log decay per key
    channel, fp32 (fp64 for fp64 g: the exact checks), contiguous."""
    wide = g.to(torch.promote_types(g.dtype, torch.float32))
    return to_tokens(to_chunks(wide, nc).cumsum(-2))[:, : g.shape[1]].contiguous()


def first_pass_scan(g: torch.Tensor) -> torch.Tensor:
    """G = cumsum(g) within the chunk as the forward's first pass (kernels/linear_attention/
    kda_prefill/sm90/intra.py, its bwd key) sums the big_g this kernel reads, in fp32: g (...,
    C, K) (zero past the sequence) -> G = ln 2 G2, G2 from g log2(e): 8-token running sums
    (each thread's), the lower half-warp's total added to the upper's (warp w: tokens 16 w ..
    16 w + 15), the warps' totals summed in order for each warp's base: G2 = (base_w + the
    lower total or 0) + run. Not a sequential sum: past a chunk's last gate in an upper half of
    warps 0-2, row 63 need not repeat its G bit for bit (G_C alone against in the slot layout:
    tests/slots_alone.py)."""
    run = (g.float() * LOG2E).unflatten(-2, (CHUNK // 8, 8)).clone()  # (..., 8 runs, 8, K)
    for s in range(1, 8):
        run[..., s, :] = run[..., s - 1, :] + run[..., s, :]
    lower, upper = run[..., 0::2, 7, :], run[..., 1::2, 7, :]  # (..., 4 warps, K)
    total = lower + upper
    base = [torch.zeros_like(total[..., 0, :])]
    for w in range(1, total.shape[-2]):
        base.append(total[..., 0, :] if w == 1 else base[-1] + total[..., w - 1, :])
    base = torch.stack(base, dim=-2)
    start = torch.stack((base, base + lower), dim=-2).flatten(-3, -2)  # (..., 8 runs, K)
    return ((start.unsqueeze(-2) + run) * LN2).flatten(-3, -2)


def _ident(x: torch.Tensor) -> torch.Tensor:
    return x


def sub_chunk_decays(gc: torch.Tensor, t: int):
    """The kernel's decay pieces of chunked G (B, NC, HV, C, K) (zero past T): (valid (NC, 1, C,
    1) rows inside T, r (B, NC, HV, NS, K) the references, el, er (..., C, K) zero past T,
    G_C (B, NC, HV, K) at each chunk's last row inside T)."""
    nc = gc.shape[1]
    rows = torch.arange(nc * CHUNK, device=gc.device).view(nc, CHUNK)
    valid = (rows < t).view(nc, 1, CHUNK, 1)
    last = torch.clamp(t - 1 - rows[:, 0], max=CHUNK - 1)  # (NC,) the last row inside T
    ref = torch.minimum(torch.arange(NS, device=gc.device) * SUB_CHUNK + SUB_CHUNK // 2,
                        last.unsqueeze(-1))  # (NC, NS)  # fmt: skip
    b, _, hv, _, kd = gc.shape
    r = gc.gather(-2, ref.view(1, nc, 1, NS, 1).expand(b, nc, hv, NS, kd))  # (B, NC, HV, NS, K)
    g_last = gc.gather(-2, last.view(1, nc, 1, 1, 1).expand(b, nc, hv, 1, kd))[..., 0, :]
    a = gc - r.repeat_interleave(SUB_CHUNK, dim=-2)
    el = torch.where(valid, a.exp(), 0)
    er = torch.where(valid, (-a).exp(), 0)
    return valid, r, el, er, g_last


def chunk_grads_model(do, u, du, q, k, h, dh, big_g, rounding=None):
    """The kernel's outputs from its inputs (`chunk_grad_tiles`' layouts), every chunk at once:
    (dq, dk, dw, dg (B, T, HV, K): dg is `_output_grads`' dG reverse-cumsummed within the chunk)
    in the inputs' float dtype (fp64 for the checks). `rounding`: the kernel's rounding of the
    block products' operands formed on chip (dP without its diagonal: register and shared-memory
    A operands; (k er), (q el): shared-memory B operands) to bf16 for either tile dtype (e^(+-a)
    reaches e^(8 max|g|), past fp16's range, as in the forward's first pass); None: none."""
    t, nc = do.shape[1], h.shape[1]
    f = h.dtype if h.dtype in (torch.float32, torch.float64) else torch.float32
    rnd = rounding or _ident
    do_c, u_c, du_c, q_c, k_c = (to_chunks(x.to(f), nc) for x in (do, u, du, q, k))
    h, dh = h.to(f), dh.to(f)
    gc = to_chunks(big_g.to(f), nc)
    valid, r, el, er, g_last = sub_chunk_decays(gc, t)
    e_g = torch.where(valid, gc.exp(), 0)
    e_end = torch.where(valid, (g_last.unsqueeze(-2) - gc).exp(), 0)
    strict = torch.ones(CHUNK, CHUNK, dtype=torch.bool, device=do.device).tril(-1)
    s = torch.where(valid, do_c @ u_c.transpose(-1, -2), 0)
    diag = s.diagonal(dim1=-2, dim2=-1).unsqueeze(-1)  # dP_ii, fp32 (the accumulator's)
    dp = rnd(torch.where(strict, s, 0))
    kr, ql = rnd(k_c * er), rnd(q_c * el)
    dq = (do_c @ h.transpose(-1, -2)) * e_g
    dk = (u_c @ dh.transpose(-1, -2)) * e_end
    te = (dk * k_c).sum(-2)  # sum_i (k e^(G_C - G)) o dke, (B, NC, HV, K)
    blocks = torch.arange(CHUNK, device=do.device) // SUB_CHUNK
    for j in range(NS):
        cols = slice(j * SUB_CHUNK, (j + 1) * SUB_CHUNK)
        keep = valid & (blocks >= j).view(CHUNK, 1)  # rows of blocks I >= J
        rj = r[..., j : j + 1, :]
        left = torch.where(keep, (gc - rj).masked_fill(~keep, 0).exp(), 0)  # e^(G_i - r_J)
        dq = dq + left * (dp[..., cols] @ kr[..., cols, :])
        keep_k = valid & (blocks <= j).view(CHUNK, 1)  # rows of blocks J <= I
        right = torch.where(keep_k, (rj - gc).masked_fill(~keep_k, 0).exp(), 0)  # e^(r_I - G_j)
        dk = dk + right * (dp[..., cols, :].transpose(-1, -2) @ ql[..., cols, :])
    dw = -(du_c @ h.transpose(-1, -2))
    rows = q_c * dq - k_c * dk  # the diagonal's terms q_i dP_ii k_i cancel: left out
    dq, dk = dq + diag * k_c, dk + diag * q_c
    last = te + g_last.exp() * (h * dh).sum(-1)
    dg = rows.flip(-2).cumsum(-2).flip(-2) + last.unsqueeze(-2)
    return (*(to_tokens(x)[:, :t] for x in (dq, dk, dw, dg)),)
