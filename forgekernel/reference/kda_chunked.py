"""Kimi Delta Attention, chunked as the tensor-core kernel computes it: the per-channel decay
factored into GEMM operands around reference points inside the chunk, so that every product
is a plain matrix product (WGMMA) and no factor overflows.

Conventions, the recurrence and the direct chunked form: `reference/delta_rule.py`
(`kimi_delta_attention_recurrent` is the yardstick). Per value head, chunk of C = 64 tokens,
state S0 (K, V) at its start, G = cumsum(g) inside the chunk, per key channel (C, K).

Why the naive factorization fails. With a scalar decay (Gated DeltaNet) the intra-chunk
decay exp(G_i - G_j) is a (C, C) mask applied after one GEMM. Per channel it sits inside the
sum over K: A_ij = sum_c k_ic k_jc exp(G_ic - G_jc). Splitting it as (K * exp(G)) (K *
exp(-G))^T makes exp(-G) overflow once a chunk's decay passes ~88 (fp32) or ~11 (fp16): at
g = -5 per step that is the 3rd (fp16) or 18th (fp32) token of a chunk.

The remedy (fla's sub-chunks, with the reference inside the sub-chunk): split the chunk into
NS = C / 16 sub-chunks; sub-chunk I has a reference r_I = G at its token 16 I + 8 (per
channel). With a_i = G_i - r_I(i) (|a| spans at most 8 steps of decay):

    Kl = K * exp(a)      Ql = scale Q * exp(a)      Kr = K * exp(-a)
    E_IJ = exp(r_I - r_J)                                  I >= J: <= 1
    A[I, J]  = (Kl_I * E_IJ) Kr_J^T      Akk: j < i, times beta_i;  Aqk (P): j <= i

exp(a), exp(-a) <= exp(8 max|g|): 2^58 at g = -5, far inside bf16 / fp32 (not fp16: the
kernel takes bf16 only). In the kernel the column block J of A is one 64 x 16 x K WGMMA whose
register A operand is Kl * E_{I(i) J} (rows I < J zeroed: they are above the diagonal), the
B operand Kr's rows 16 J .. 16 J + 15 in shared memory. The state side's operands, each a
product of bounded fp32 factors (<= 1 at the end):

    Kg = K * exp(a) exp(r_I)          (= K exp(G), X = Kg S0)
    Qg = scale Q * exp(a) exp(r_I)     (= Q exp(G), O's inter-chunk part Qg S0)
    Kd = K * exp(-a) exp(G_C - r_I)    (= K exp(G_C - G), the state update)

so one exp2 (and one reciprocal) per (token, channel) plus multiplies by per-sub-chunk
tables. Then, as Gated DeltaNet's chunk: T = (I + Akk)^-1 (fp32), U = T diag(beta) (V - X),
O = Qg S0 + P U, S_C = diag(exp(G_C)) S0 + Kd^T U.

When a product underflows it is one the result does not see: an operand below bf16's
smallest normal (2^-126) times a partner of at most 2^58 (g >= -5) is < 2^-68 of |k|^2. The
factors stay finite for any g (exp of a bounded span); accuracy holds while 8 max|g| stays
well below ~87 / 2 (bf16 / fp32 range): per-step log decays down to about -5 (the suite's
strongest; Kimi Linear's gate, -exp(A) softplus(.), sits mostly in [-1, 0]).

`operand_dtype` rounds exactly the values the kernel feeds the tensor cores as 16-bit
operands (Kl * E, Kr, Ql * E, Kg, Qg, Kd, T diag(beta), S0, V - X, U), so the model's error
is the kernel's; None keeps everything in `dtype`.
"""

from __future__ import annotations

import torch

from forgekernel.reference.delta_rule import _check, _run, _split_chunks, _unit_lower_inverse

SUB_CHUNK = 16  # tokens per sub-chunk (one reference point each); 4 per 64-token chunk


def kimi_delta_attention_subchunked(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.float32,
    operand_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o (B, T, HV, V), final state (N, HV, K, V) or None) by the kernel's factorized chunked
    algorithm (module docstring); arguments as `kimi_delta_attention_recurrent`."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")

    def run(q_, k_, v_, g_, beta_, s_):
        return _sequence(q_, k_, v_, g_, beta_, s_, chunk_size, operand_dtype)

    return _run(
        run, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm, dtype,
    )  # fmt: skip


def kimi_delta_attention_segmented(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    segment: int = 8192,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`kimi_delta_attention_subchunked` over at most `segment` tokens at a time, the state
    handed from segment to segment (and every varlen sequence run alone): the same result with
    its (.., C, K) temporaries bounded, for long sequences on a device. Returns (o (B, T, HV,
    V) in `dtype`, the final state (N, HV, K, V) in `dtype`)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    b, t, hv, dv = v.shape
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    state = initial_state
    if state is None:
        state = torch.zeros(n, hv, q.shape[3], dv, dtype=dtype, device=q.device)
    args = dict(scale=scale, use_qk_l2norm=use_qk_l2norm, dtype=dtype, output_final_state=True)
    spans = [(slice(None), 0, t)] if cu_seqlens is None else [
        (slice(i, i + 1), a, z) for i, (a, z) in enumerate(_edges(cu_seqlens))
    ]  # fmt: skip
    out = torch.zeros(b, t, hv, dv, dtype=dtype, device=q.device)
    finals = []
    for rows, a, z in spans:
        s = state[rows].to(dtype)
        for lo in range(a, z, segment):
            hi = min(lo + segment, z)
            part = (x[:, lo:hi] for x in (q, k, v, g, beta))
            out[:, lo:hi], s = kimi_delta_attention_subchunked(*part, initial_state=s, **args)
        finals.append(s)
    return out, torch.cat(finals)


def _edges(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    edges = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(edges[:-1], edges[1:]))


def naive_factor_overflows(g: torch.Tensor, chunk_size: int = 64) -> bool:
    """Whether the naive split K exp(G), K exp(-G) of a chunk overflows fp32 for these log
    decays (B, T, H, K) (the situation the sub-chunk references exist for)."""
    big_g = _split_chunks(g.transpose(1, 2).float(), chunk_size).cumsum(dim=3)
    return not torch.isfinite((-big_g).exp()).all().item()


# ----------------------------------------------------------------------------- the chunk


def _round(x: torch.Tensor, operand_dtype: torch.dtype | None) -> torch.Tensor:
    return x if operand_dtype is None else x.to(operand_dtype).to(x.dtype)


def _sub_chunk_factors(big_g: torch.Tensor):
    """From G (..., C, K): exp(a) and exp(-a) per token (a = G - r of its sub-chunk), the
    per-row reference r (..., C, K), E (..., NS, NS, K) = exp(r_I - r_J) for I >= J (0 above),
    and the row -> sub-chunk map."""
    c = big_g.shape[-2]
    ns = c // SUB_CHUNK
    ref_rows = torch.arange(ns, device=big_g.device) * SUB_CHUNK + SUB_CHUNK // 2
    refs = big_g[..., ref_rows, :]  # (..., NS, K)
    block = torch.arange(c, device=big_g.device) // SUB_CHUNK
    r_row = refs[..., block, :]
    a = big_g - r_row
    lower = torch.ones(ns, ns, dtype=torch.bool, device=big_g.device).tril()
    diff = refs.unsqueeze(-2) - refs.unsqueeze(-3)  # (..., NS_I, NS_J, K): r_I - r_J
    e = diff.masked_fill(~lower.unsqueeze(-1), float("-inf")).exp()
    return a.exp(), (-a).exp(), r_row, e, block


def _block_scores(left, right, e, block, strict: bool, operand_dtype) -> torch.Tensor:
    """M_ij = sum_c left_ic E[I(i), J(j), c] right_jc, one column block J at a time (the
    kernel's 64 x 16 x K WGMMAs), masked to j < i (strict) or j <= i."""
    c = left.shape[-2]
    ns = c // SUB_CHUNK
    cols = []
    for j in range(ns):
        scaled = _round(left * e[..., block, j, :], operand_dtype)  # rows I < J: zero
        rhs = _round(right[..., j * SUB_CHUNK : (j + 1) * SUB_CHUNK, :], operand_dtype)
        cols.append(scaled @ rhs.transpose(-1, -2))
    scores = torch.cat(cols, dim=-1)
    keep = torch.ones(c, c, dtype=torch.bool, device=left.device).tril(-1 if strict else 0)
    return scores.masked_fill(~keep, 0.0)


def chunk_operands(q, k, g, beta, operand_dtype=None, inverse=None,
                   bwd: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """Everything of a chunk that does not depend on the state, for chunks (..., C, K): q
    (already scaled), k, g (log decay per channel; 0 on padding), beta (..., C) (0 on
    padding). Returns k_g (K exp(G)), q_g (Q exp(G)), k_d (K exp(G_C - G)) (..., C, K), t_beta
    (T diag(beta)) and p (the masked decayed Q K^T) (..., C, C), each rounded to
    `operand_dtype` as the tensor cores take them, and decay (exp(G_C), (..., K)). The state
    pass is then O = q_g S + p U, U = t_beta (V - k_g S), S <- diag(decay) S + k_d^T U.
    bwd: also the KDA backward's tt (T^T, T = (I + diag(beta) M(k, k))^-1 unscaled, rounded as
    t_beta) and big_g (G, unrounded)."""
    big_g = g.cumsum(dim=-2)
    ea, eb, r_row, e, block = _sub_chunk_factors(big_g)
    k_left, k_right, q_left = k * ea, k * eb, q * ea
    akk = beta.unsqueeze(-1) * _block_scores(k_left, k_right, e, block, True, operand_dtype)
    g_last = big_g[..., -1:, :]
    big_t = (inverse or _unit_lower_inverse)(akk)
    out = {
        "k_g": _round(k_left * r_row.exp(), operand_dtype),
        "q_g": _round(q_left * r_row.exp(), operand_dtype),
        "k_d": _round(k_right * (g_last - r_row).exp(), operand_dtype),
        "t_beta": _round(big_t * beta.unsqueeze(-2), operand_dtype),
        "p": _round(_block_scores(q_left, k_right, e, block, False, operand_dtype), operand_dtype),
        "decay": g_last.squeeze(-2).exp(),
    }
    if bwd:
        out["tt"] = _round(big_t.transpose(-1, -2), operand_dtype)
        out["big_g"] = big_g
    return out


def _sequence(q, k, v, g, beta, s, c: int, operand_dtype):
    """q (scaled), k (B, HV, L, K), v (B, HV, L, V), g (B, HV, L, K), beta (B, HV, L), s (B, HV,
    K, V): intra-chunk work batched over the chunks, the state passed sequentially."""
    length = q.shape[2]
    if length == 0:
        return v.clone(), s
    q, k, v, g, beta = (_split_chunks(x, c) for x in (q, k, v, g, beta))
    ops = chunk_operands(q, k, g, beta, operand_dtype)
    out = torch.empty_like(v)
    for n in range(q.shape[2]):
        s_op = _round(s, operand_dtype)
        x = ops["k_g"][:, :, n] @ s_op
        u = _round(ops["t_beta"][:, :, n] @ _round(v[:, :, n] - x, operand_dtype), operand_dtype)
        out[:, :, n] = ops["q_g"][:, :, n] @ s_op + ops["p"][:, :, n] @ u
        s = s * ops["decay"][:, :, n].unsqueeze(-1) + ops["k_d"][:, :, n].transpose(-1, -2) @ u
    return out.flatten(2, 3)[:, :, :length], s
