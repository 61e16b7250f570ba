"""The chunked backward of Kimi Delta Attention (fla's `chunk_kda` conventions, see
reference/delta_rule.py): gradients in q, k, v, g (per key channel), beta and the initial
state from dO and the final state's gradient, in batched torch (CPU or GPU; fp32 for the op's
interim backward, ops/kda_bwd.py, fp64 for the check against autograd). Gated DeltaNet's
backward (reference/delta_rule_bwd.py) with the scalar decay made a per-channel one; it
shares that module's driver (layout, head passes, scale, l2norm, group sum).

Per chunk (C tokens, per value head; q scaled and l2-normalized; G = cumsum(g) (C, K) within
the chunk, G_C its last row; S0 the state at the chunk start, dS the gradient at its end),
the forward (reference/kda_chunked.py):

    M(x, y)_ij = sum_c x_ic y_jc e^(G_ic - G_jc)           (the per-channel decayed product)
    L   = I + A,  A = diag(beta) M(k, k)  (j < i)
    [w u] = L^-1 [diag(beta) (k o e^G),  diag(beta) v]
    U   = u - w S0
    o   = (q o e^G) S0 + P U,   P = M(q, k)  (j <= i)
    S_C = diag(e^(G_C)) S0 + (k o e^(G_C - G))^T U

Backward, the same three passes as Gated DeltaNet's (recompute h and U; the reverse state
recurrence dS <- diag(e^(G_C)) dS + (q e^G)^T dO - w^T dU, dU = P^T dO + (k e^(G_C - G)) dS;
every chunk's gradients at once). What per-channel changes:

  * the decayed products: for M = M(x, y) with cotangent dM (masked like M)
        dx_ic = sum_j dM_ij y_jc e^(G_ic - G_jc),   dy_jc = sum_i dM_ij x_ic e^(G_ic - G_jc)
    and the log-decay gradient of the product is x o dx - y o dy (each e^(+G_ic) factor's
    derivative is the entry itself; rows get +, columns -). Every factor of the form
    z o e^(+-G) contributes z-with-factor o its gradient in the same way: dG = (q e^G) o dqe
    + q o dq_P - k o dk_P + kb o dkb + k o (dx - dy)_A - (k e^(G_C - G)) o dke, and G_C's row
    gets sum_i (k e^(G_C - G)) o dke + e^(G_C) o rowsum(S0 o dS). dg = reverse cumsum of dG.
  * no factor may overflow: M and its gradients never form e^(-G). They go by sub-chunks of
    16 with a reference point r_I inside each (reference/kda_chunked.py's scheme, for g down to
    about -5 a step): a = G - r_I(row), el = e^a, er = e^(-a), E_IJ = e^(r_I - r_J) (I >= J),
    and per column block J
        M[:, J]  = (x el E_(I,J)) (y er)[J]^T
        dx      += (dM[:, J] (y er)[J]) o el E_(I,J)
        dy[J]    = er[J] o (dM[:, J]^T (x el E_(I,J)))
    el E_(I,J) = e^(G_i - r_J) <= 1 off the diagonal block, e^a, er <= e^(8 max|g|) on it:
    the backward kernel's WGMMA shapes are those of the forward's first pass.
  * e^G, e^(G_C - G), e^(G_C) are formed directly (all <= 1 for g <= 0).

Padded tail rows (k = v = q = beta = g = 0) change nothing, as in Gated DeltaNet's backward.
"""

from __future__ import annotations

import functools

import torch

from forgekernel.reference.delta_rule_bwd import (
    Grads,
    _solve_lower,
    _solve_lower_transposed,
    chunked_backward_driver,
)
from forgekernel.reference.kda_chunked import SUB_CHUNK, _block_scores, _sub_chunk_factors

# Half Gated DeltaNet's token-heads a pass: g, its cumulative sums and the sub-chunk factors
# are (C, K) per chunk here, not (C,).
TOKEN_HEADS_PER_PASS = 2**20


def kimi_delta_attention_chunked_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    dtype: torch.dtype = torch.float32,
    heads_per_pass: int | None = None,
) -> Grads:
    """(dq, dk (B, T, H, K), dv (B, T, HV, V), dg (B, T, HV, K), dbeta (B, T, HV),
    d_initial_state (N, HV, K, V)) of `kimi_delta_attention_recurrent(...)`'s (o, final
    state) given do (B, T, HV, V) and d_final_state (N, HV, K, V) or None (zero), in `dtype`.
    chunk_size a multiple of 16 (the sub-chunk); the rest as
    `gated_delta_rule_chunked_backward`."""
    if chunk_size % SUB_CHUNK:
        raise ValueError(f"chunk_size must be a multiple of {SUB_CHUNK}, got {chunk_size}")
    return chunked_backward_driver(
        _chunked_backward, q, k, v, g, beta, do, scale=scale, initial_state=initial_state,
        d_final_state=d_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size, dtype=dtype, heads_per_pass=heads_per_pass, per_channel=True,
        token_heads=TOKEN_HEADS_PER_PASS,
    )  # fmt: skip


def _chunked_backward(q, k, v, g, beta, do, h0, dht, steps):
    """Chunks: q (scaled), k (NC, HV, C, K), v, do (NC, HV, C, V), g (NC, HV, C, K), beta (NC,
    HV, C); h0, dht (N, HV, K, V) in layout order -> (dq, dk, dv, dg, dbeta, dh0)."""
    f = _Factors(q, k, v, g, beta)
    h, big_u = _states(f, h0, steps)
    dh, d_u, dh0 = _reverse_states(f, do, dht, steps)
    dq, dk, dw, d_g = _output_grads(f, do, h, dh, big_u, d_u)
    dk_wy, dv, dbeta, dg_wy = _wy_grads(f, dw, d_u)
    dg = (d_g + dg_wy).flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g) within the chunk
    return dq, dk + dk_wy, dv, dg, dbeta, dh0


class _Decay:
    """The sub-chunk factors of one batch of chunks' G (..., C, K) (module docstring)."""

    def __init__(self, big_g: torch.Tensor) -> None:
        self.el, self.er, _, self.e, self.block = _sub_chunk_factors(big_g)
        self.ns = big_g.shape[-2] // SUB_CHUNK

    def scores(self, x: torch.Tensor, y: torch.Tensor, strict: bool) -> torch.Tensor:
        """M(x, y), masked to j < i (strict) or j <= i."""
        return _block_scores(x * self.el, y * self.er, self.e, self.block, strict, None)

    def score_grads(self, x, y, dm) -> tuple[torch.Tensor, torch.Tensor]:
        """(dx, dy) of M(x, y) for a masked cotangent dm (..., C, C)."""
        right = y * self.er
        dx, dy = torch.zeros_like(x), torch.empty_like(y)
        for j in range(self.ns):
            cols = slice(j * SUB_CHUNK, (j + 1) * SUB_CHUNK)
            left = self.el * self.e[..., self.block, j, :]  # e^(G_i - r_J), rows I < J zero
            dm_j = dm[..., cols]
            dx = dx + (dm_j @ right[..., cols, :]) * left
            dy[..., cols, :] = self.er[..., cols, :] * (dm_j.transpose(-1, -2) @ (x * left))
        return dx, dy


class _Factors:
    """Every chunk's state-independent pieces of the forward (pass 1, batched)."""

    def __init__(self, q, k, v, g, beta):
        c = q.shape[-2]
        self.q, self.k, self.v, self.beta = q, k, v, beta
        big_g = g.cumsum(-2)
        self.decay = _Decay(big_g)
        self.e_g = big_g.exp()  # (NC, HV, C, K), <= 1
        self.e_last = self.e_g[..., -1, :]  # e^(G_C), (NC, HV, K)
        self.e_to_end = (big_g[..., -1:, :] - big_g).exp()  # e^(G_C - G)
        self.strict = torch.ones(c, c, dtype=torch.bool, device=q.device).tril(-1)
        self.p = self.decay.scores(q, k, strict=False)
        self.kk = self.decay.scores(k, k, strict=True)
        self.a = beta.unsqueeze(-1) * self.kk
        self.lower = torch.eye(c, dtype=q.dtype, device=q.device) + self.a  # L = I + A
        self.kb = beta.unsqueeze(-1) * k * self.e_g
        wu = _solve_lower(self.lower, torch.cat([self.kb, beta.unsqueeze(-1) * v], -1))
        self.w, self.u = wu.split([k.shape[-1], v.shape[-1]], -1)
        self.qe = q * self.e_g
        self.ke = k * self.e_to_end


class _FirstPassFactors:
    """`_Factors` (the fields kernel 1's two launches and `_wy_grads` read) with the pieces the
    KDA forward's first pass writes taken from it (kernels/linear_attention/kda_prefill/sm90
    `first_pass_kernel`, its torch model `operands.kda_chunk_operands`): P, Qe = q_g, Ke = k_d,
    e^(G_C) = decay, and W = (T diag(beta)) Kg, u = (T diag(beta)) V from its t_beta and k_g
    (two GEMMs for the triangular solve). Still in torch, for `_wy_grads`: G, the sub-chunk
    factors, e^G, kb and M(k, k) (the first pass keeps A and T unscaled on chip).
    `ops`: the first pass's outputs, token-major (B, NC C, HV, D) (its row layout for B equal
    lengths: rows are to_tokens' rows); k, v, g, beta in chunks (B, NC, HV, C, ...), fp32. The
    pieces only `_wy_grads` and the WY kernel's `wy_tiles` read (G's factors, e^G, M(k, k), L,
    kb) are formed on first use: with the WY kernel and the first pass's `bwd` key (ops["tt"],
    T^T token-major, kept as `tt_tokens`) none of them is."""

    per_channel = True  # e^(G_C) per key channel (`chunk_decay`), without forming e_g

    def __init__(self, ops, k, v, g, beta):
        b, nc, hv, c, dk = k.shape

        def chunks(x):  # token-major (B, NC C, HV, D) -> (B, NC, HV, C, D), a view
            return x.unflatten(1, (nc, c)).transpose(2, 3)

        self.k, self.v, self.beta, self._g = k, v, beta, g
        self.e_last = ops["decay"].to(k.dtype)  # (B, NC, HV, K)
        self.strict = torch.ones(c, c, dtype=torch.bool, device=k.device).tril(-1)
        self.tt_tokens = ops.get("tt")
        t_beta = chunks(ops["t_beta"]).to(k.dtype)
        self.w = t_beta @ chunks(ops["k_g"]).to(k.dtype)
        self.u = t_beta @ v
        # the first pass's dtype (the tiles'); its bwd key writes P^T ("pt") in P's place
        self.p = chunks(ops["p"]) if "p" in ops else chunks(ops["pt"]).transpose(-1, -2)
        self.ke, self.qe = chunks(ops["k_d"]), chunks(ops["q_g"])
        self.tokens = {"ke": ops["k_d"], "qe": ops["q_g"]}  # kernel 1's tiles as written

    @functools.cached_property
    def decay(self) -> _Decay:
        return _Decay(self._g.cumsum(-2))

    @functools.cached_property
    def e_g(self) -> torch.Tensor:
        return self._g.cumsum(-2).exp()

    @functools.cached_property
    def kk(self) -> torch.Tensor:
        return self.decay.scores(self.k, self.k, strict=True)

    @functools.cached_property
    def lower(self) -> torch.Tensor:
        c = self.k.shape[-2]
        eye = torch.eye(c, dtype=self.k.dtype, device=self.k.device)
        return eye + self.beta.unsqueeze(-1) * self.kk

    @functools.cached_property
    def kb(self) -> torch.Tensor:
        return self.beta.unsqueeze(-1) * self.k * self.e_g


def _states(f: _Factors, h0, steps):
    """Pass 1's recurrence: h (NC, HV, K, V) the state at every chunk's start, U (NC, HV, C, V)."""
    s = h0.clone()
    h = h0.new_empty(len(f.q), *h0.shape[1:])
    big_u = torch.empty_like(f.u)
    for first, count in steps:
        rows = slice(first, first + count)
        s0 = s[:count]
        h[rows] = s0
        u = f.u[rows] - f.w[rows] @ s0
        big_u[rows] = u
        s[:count] = f.e_last[rows].unsqueeze(-1) * s0 + f.ke[rows].transpose(-1, -2) @ u
    return h, big_u


def _reverse_states(f: _Factors, do, dht, steps):
    """Pass 2: dh (the state gradient at every chunk's end), dU, and the initial state's."""
    ds = dht.clone()
    dh = dht.new_empty(len(f.q), *dht.shape[1:])
    d_u = f.p.transpose(-1, -2) @ do  # the intra-chunk part, all chunks at once
    for first, count in reversed(steps):
        rows = slice(first, first + count)
        d_end = ds[:count]
        dh[rows] = d_end
        du = d_u[rows] + f.ke[rows] @ d_end
        d_u[rows] = du
        ds[:count] = (
            f.e_last[rows].unsqueeze(-1) * d_end
            + f.qe[rows].transpose(-1, -2) @ do[rows]
            - f.w[rows].transpose(-1, -2) @ du
        )
    return dh, d_u, ds


def _output_grads(f: _Factors, do, h, dh, big_u, d_u):
    """Pass 3, the state and output side: dq, dk (outside the WY transform), dw, dG (C, K)."""
    dqe = do @ h.transpose(-1, -2)  # d(q e^G)
    dp = (do @ big_u.transpose(-1, -2)).tril()  # dP, j <= i
    dq_p, dk_p = f.decay.score_grads(f.q, f.k, dp)
    dke = big_u @ dh.transpose(-1, -2)  # d(k e^(G_C - G))
    dq = dqe * f.e_g + dq_p
    dk = dk_p + dke * f.e_to_end
    dw = -(d_u @ h.transpose(-1, -2))
    to_end = dke * f.ke
    d_g = dqe * f.qe + f.q * dq_p - f.k * dk_p - to_end
    last = to_end.sum(-2) + f.e_last * (dh * h).sum(-1)  # into G_C, (NC, HV, K)
    d_g[..., -1, :] += last
    return dq, dk, dw, d_g


def _wy_grads(f: _Factors, dw, du):
    """Pass 3, the WY transform: [w u] = L^-1 [kb vb] -> dk, dv, dbeta, dG."""
    dkv = _solve_lower_transposed(f.lower, torch.cat([dw, du], -1))
    dkb, dvb = dkv.split([dw.shape[-1], du.shape[-1]], -1)
    beta = f.beta.unsqueeze(-1)
    dv = beta * dvb
    dk = beta * f.e_g * dkb
    dbeta = (dvb * f.v).sum(-1) + (dkb * f.k * f.e_g).sum(-1)
    d_g = dkb * f.kb
    da = -(dkb @ f.w.transpose(-1, -2) + dvb @ f.u.transpose(-1, -2)) * f.strict
    dbeta = dbeta + (da * f.kk).sum(-1)
    dx, dy = f.decay.score_grads(f.k, f.k, beta * da)
    return dk + dx + dy, dv, dbeta, d_g + f.k * (dx - dy)
