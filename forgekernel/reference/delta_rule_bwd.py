"""The chunked backward of Gated DeltaNet (fla's `chunk_gated_delta_rule` conventions, see
reference/delta_rule.py): gradients in q, k, v, g, beta and the initial state from dO and the
final state's gradient, computed with the chunked (WY / UT) form in batched torch. Runs on the
CPU and the GPU alike; the op's interim backward (ops/gated_delta_rule_bwd.py) calls it in
fp32, and it is the CPU model a backward kernel replaces.

Per chunk (C tokens, per value head; q already scaled and l2-normalized, G the within-chunk
cumulative log decay, G_C its last entry, S0 the state at the chunk start, dS the gradient of
the state at its end), the forward is (reference/delta_rule.py):

    L   = I + A,  A_ij = beta_i k_i.k_j e^(G_i - G_j)  (j < i)
    [w u] = L^-1 [diag(beta e^G) k,  diag(beta) v]         (one unit-lower triangular solve)
    U   = u - w S0
    o   = (q e^G) S0 + P U,   P_ij = q_i.k_j e^(G_i - G_j)  (j <= i)
    S_C = e^(G_C) S0 + (k e^(G_C - G))^T U

Backward, in three passes (fla's chunk_gated_delta_rule_bwd has the same shape):

 1. recompute: the intra-chunk pieces (A, w, u, P) of every chunk at once, then the states S0
    of every chunk (h) and U, one chunk step at a time (the forward's recurrence);
 2. reverse recurrence over chunks, dS starting from the final state's gradient:
        dU  = P^T dO + (k e^(G_C - G)) dS
        dS <- e^(G_C) dS + (q e^G)^T dO - w^T dU           (dS0: the previous chunk's dS)
    the last dS is the initial state's gradient;
 3. every chunk at once, from h, dh (= dS at the chunk end), U, dU:
        dq  = (dO S0^T) e^G + (dO U^T o D) k               D_ij = e^(G_i - G_j), j <= i
        dk  = (dO U^T o D)^T q + (U dS^T) e^(G_C - G)
        dw  = -dU S0^T,   du = dU
        [dkb dvb] = L^-T [dw du]                           (the WY transform's transpose)
        dv  = beta dvb,   dk += beta e^G dkb
        dA  = -(dkb w^T + dvb u^T), strictly lower; dbeta, dk, dG from A's factors
        dG  = every e^(+-G) factor's log-derivative (rows and columns of P and A; e^G of q and
              of kb; e^(G_C - G) and e^(G_C) into position C)
        dg  = reverse cumulative sum of dG within the chunk (G = cumsum(g)).

Then scale, l2norm (dx = (dy - y (y.dy)) / sqrt(x.x + eps)) and the group sum of dq, dk over
the value heads that share a q / k head.

Layout: tokens go to chunks of C rows (varlen: each sequence's own chunks, the tail padded
with k = v = q = beta = g = 0, which leaves the state and every real gradient unchanged: the
padded rows' dG reaches the real ones only through G_C, which is theirs). Sequences are sorted
by chunk count, longest first, and the chunks laid out step-major (every sequence's chunk 0,
then every chunk 1, ...), so that chunk step j acts on a prefix of the state tensor and one
contiguous block of chunks: the recurrences are a loop over the longest sequence's chunk
count, each step one batched GEMM over (sequences, heads).
"""

from __future__ import annotations

import torch

from forgekernel.reference.delta_rule import L2NORM_EPS, _check, _scale

Grads = tuple[torch.Tensor, ...]
# Token x value-head count of one pass: ~20 GB of fp32 temporaries at K = V = 128 (the chunk
# states h and dh, the (C, C) and (C, K) pieces of every chunk).
TOKEN_HEADS_PER_PASS = 2**21


def gated_delta_rule_chunked_backward(
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
    """(dq, dk (B, T, H, K), dv (B, T, HV, V), dg, dbeta (B, T, HV), d_initial_state
    (N, HV, K, V)) of `gated_delta_rule_recurrent(...)`'s (o, final state) given do (B, T, HV, V)
    and d_final_state (N, HV, K, V) or None (zero); in `dtype` (fp32: the interim op path,
    fp64: the check against autograd). The initial state's gradient comes back even when
    initial_state is None (the zero state's). q / k heads go through in passes of
    `heads_per_pass` (default: TOKEN_HEADS_PER_PASS token-heads of value heads a pass), which
    bounds the fp32 temporaries (~10 KB a token and value head at K = V = 128)."""
    return chunked_backward_driver(
        _chunked_backward, q, k, v, g, beta, do, scale=scale, initial_state=initial_state,
        d_final_state=d_final_state, cu_seqlens=cu_seqlens, use_qk_l2norm=use_qk_l2norm,
        chunk_size=chunk_size, dtype=dtype, heads_per_pass=heads_per_pass, per_channel=False,
    )  # fmt: skip


def chunked_backward_driver(chunk_backward, q, k, v, g, beta, do, *, scale, initial_state,
                            d_final_state, cu_seqlens, use_qk_l2norm, chunk_size, dtype,
                            heads_per_pass, per_channel,
                            token_heads=TOKEN_HEADS_PER_PASS) -> Grads:  # fmt: skip
    """Everything around the chunk-level backward `chunk_backward` (shared with Kimi Delta
    Attention's, reference/kda_bwd.py): checks, the chunk layout, passes over q / k heads,
    scale, l2norm, the group sum. g is (B, T, HV) or, per_channel, (B, T, HV, K)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=per_channel)
    b, t, h, dk_dim = q.shape
    hv, dv_dim = v.shape[2], v.shape[3]
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    if do.shape != v.shape:
        raise ValueError(f"do must be {tuple(v.shape)}, got {tuple(do.shape)}")
    state_shape = (n, hv, dk_dim, dv_dim)
    if d_final_state is not None and d_final_state.shape != state_shape:
        raise ValueError(f"d_final_state must be {state_shape}, got {tuple(d_final_state.shape)}")
    edges = [i * t for i in range(b + 1)] if cu_seqlens is None else cu_seqlens.tolist()
    layout = ChunkLayout([int(e) for e in edges], chunk_size, q.device)
    # in their own dtype until a pass takes its heads (an fp64 reference at 8 x 32768 tokens
    # held ~26 GB of converted inputs, and the pass results twice over in the concatenation)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    zeros = torch.zeros(state_shape, dtype=dtype, device=q.device)
    h0 = zeros if initial_state is None else initial_state.to(dtype)
    dht = zeros if d_final_state is None else d_final_state.to(dtype)
    group = hv // h
    step = heads_per_pass or max(1, token_heads // max(1, b * t * group))
    grads = None
    for first in range(0, h, step):
        qh, vh = slice(first, first + step), slice(first * group, (first + step) * group)
        q_side = (x[:, qh].to(dtype) for x in flat[:2])
        v_side = (x[:, vh].to(dtype) for x in flat[2:])
        part = _flat_backward(*q_side, *v_side, h0[:, vh], dht[:, vh], layout=layout,
                              scale=_scale(scale, dk_dim), l2norm=use_qk_l2norm,
                              chunk_backward=chunk_backward)  # fmt: skip
        if grads is None:  # every head's gradients, each pass writing its own
            heads = (h, h, hv, hv, hv, hv)
            grads = [x.new_empty(x.shape[0], n, *x.shape[2:]) for x, n in zip(part, heads)]
        for whole, piece, rows in zip(grads, part, (qh, qh, vh, vh, vh, vh)):
            whole[:, rows] = piece
        del part
    dq, dk, dv, dg, dbeta, dh0 = grads
    shaped = (x.reshape(b, t, *x.shape[1:]) for x in (dq, dk, dv, dg, dbeta))
    return (*shaped, dh0)


# ----------------------------------------------------------------------------- token level


def _flat_backward(q, k, v, g, beta, do, h0, dht, *, layout, scale, l2norm, chunk_backward):
    """Tokens flat: q, k (T, H, K), v, do (T, HV, V), g (T, HV[, K]), beta (T, HV); h0, dht (N,
    HV, K, V)."""
    h, hv = q.shape[1], v.shape[1]
    group = hv // h
    qn, q_norm = _l2norm(q) if l2norm else (q, None)
    kn, k_norm = _l2norm(k) if l2norm else (k, None)
    qs = (qn * scale).repeat_interleave(group, dim=1)
    ks = kn.repeat_interleave(group, dim=1)
    pieces = [layout.gather(x) for x in (qs, ks, v, g, beta, do)]
    dqs, dks, dv, dg, dbeta, dh0 = chunk_backward(*pieces, layout.sort(h0), layout.sort(dht),
                                                  layout.steps)  # fmt: skip
    dqs, dks, dv, dg, dbeta = (layout.scatter(x, len(q)) for x in (dqs, dks, dv, dg, dbeta))
    dqn = dqs.unflatten(1, (h, group)).sum(2) * scale
    dkn = dks.unflatten(1, (h, group)).sum(2)
    dq = _l2norm_backward(qn, q_norm, dqn) if l2norm else dqn
    dk = _l2norm_backward(kn, k_norm, dkn) if l2norm else dkn
    return dq, dk, dv, dg, dbeta, layout.unsort(dh0)


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    norm = torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)
    return x / norm, norm


def _l2norm_backward(y: torch.Tensor, norm: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """y = x / sqrt(x.x + eps): dx = (dy - y (y.dy)) / sqrt(x.x + eps)."""
    return (dy - y * (y * dy).sum(-1, keepdim=True)) / norm


class ChunkLayout:
    """Tokens <-> chunks (NC, HV, C, ...), step-major over sequences sorted longest first.

    steps[j] = (first chunk, sequences with a chunk j): chunk step j's chunks are
    [first, first + count), sequence order[i]'s chunk j at first + i."""

    def __init__(self, edges: list[int], chunk: int, device: torch.device) -> None:
        counts = [-(-(z - a) // chunk) for a, z in zip(edges[:-1], edges[1:])]
        self.order = sorted(range(len(counts)), key=lambda s: -counts[s])
        self.steps: list[tuple[int, int]] = []
        starts, ends, first = [], [], 0
        for j in range(max(counts, default=0)):
            active = [s for s in self.order if counts[s] > j]
            self.steps.append((first, len(active)))
            first += len(active)
            starts += [edges[s] + j * chunk for s in active]
            ends += [edges[s + 1] for s in active]
        rows = torch.tensor(starts, dtype=torch.int64).unsqueeze(1) + torch.arange(chunk)
        valid = rows < torch.tensor(ends, dtype=torch.int64).unsqueeze(1)
        self.chunk = chunk
        self.count = first
        self.valid = valid.reshape(-1).to(device)
        self.tokens = rows.reshape(-1).to(device)[self.valid]
        self.perm = torch.tensor(self.order, dtype=torch.int64, device=device)

    def gather(self, x: torch.Tensor) -> torch.Tensor:
        """(T, HV, ...) -> (NC, HV, C, ...), padded rows zero."""
        padded = x.new_zeros(self.count * self.chunk, *x.shape[1:])
        padded[self.valid] = x[self.tokens]
        return padded.unflatten(0, (self.count, self.chunk)).transpose(1, 2)

    def scatter(self, x: torch.Tensor, total: int) -> torch.Tensor:
        """(NC, HV, C, ...) -> (T, HV, ...), padded rows dropped."""
        rows = x.transpose(1, 2).flatten(0, 1)
        out = x.new_zeros(total, *rows.shape[1:])
        out[self.tokens] = rows[self.valid]
        return out

    def sort(self, state: torch.Tensor) -> torch.Tensor:
        return state[self.perm].clone()

    def unsort(self, state: torch.Tensor) -> torch.Tensor:
        out = torch.empty_like(state)
        out[self.perm] = state
        return out


# ----------------------------------------------------------------------------- chunk level


def _chunked_backward(q, k, v, g, beta, do, h0, dht, steps):
    """Chunks: q, k (NC, HV, C, K) (q scaled), v, do (NC, HV, C, V), g, beta (NC, HV, C); h0,
    dht (N, HV, K, V) in layout order -> (dq, dk, dv, dg, dbeta, dh0) in the same layouts."""
    f = _Factors(q, k, v, g, beta)
    h, big_u = _states(f, h0, steps)
    dh, d_u, dh0 = _reverse_states(f, do, dht, steps)
    dq, dk, dw, d_g = _output_grads(f, do, h, dh, big_u, d_u)
    dk_wy, dv, dbeta, dg_wy = _wy_grads(f, dw, d_u)
    d_g = d_g + dg_wy
    dg = d_g.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g) within the chunk
    return dq, dk + dk_wy, dv, dg, dbeta, dh0


class _Factors:
    """Every chunk's state-independent pieces of the forward (pass 1, batched)."""

    def __init__(self, q, k, v, g, beta):
        c = q.shape[-2]
        self.q, self.k, self.v, self.beta = q, k, v, beta
        big_g = g.cumsum(-1)
        self.e_g = big_g.exp()  # (NC, HV, C)
        self.e_last = self.e_g[..., -1:]  # e^(G_C), (NC, HV, 1)
        self.e_to_end = (big_g[..., -1:] - big_g).exp()  # e^(G_C - G)
        causal = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
        diff = big_g.unsqueeze(-1) - big_g.unsqueeze(-2)  # G_i - G_j
        self.decay = diff.masked_fill(~causal, float("-inf")).exp()  # D, j <= i
        self.strict = torch.ones_like(causal).tril(-1)
        self.qk = q @ k.transpose(-1, -2)
        self.kk = k @ k.transpose(-1, -2)
        self.p = self.qk * self.decay
        self.a = beta.unsqueeze(-1) * self.kk * self.decay * self.strict
        eye = torch.eye(c, dtype=q.dtype, device=q.device)
        self.lower = eye + self.a  # L = I + A
        self.kb = (beta * self.e_g).unsqueeze(-1) * k
        wu = _solve_lower(self.lower, torch.cat([self.kb, beta.unsqueeze(-1) * v], -1))
        self.w, self.u = wu.split([k.shape[-1], v.shape[-1]], -1)
        self.qe = q * self.e_g.unsqueeze(-1)
        self.ke = k * self.e_to_end.unsqueeze(-1)


def _solve_lower(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)


def _solve_lower_transposed(lower: torch.Tensor, rhs: torch.Tensor) -> torch.Tensor:
    return torch.linalg.solve_triangular(
        lower.transpose(-1, -2), rhs, upper=True, unitriangular=True
    )


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


def _rows_minus_columns(r: torch.Tensor) -> torch.Tensor:
    """dG of entries r_ij carrying e^(G_i - G_j): + along row i, - along column j."""
    return r.sum(-1) - r.sum(-2)


def _output_grads(f: _Factors, do, h, dh, big_u, d_u):
    """Pass 3, the state and output side: dq, dk (outside the WY transform), dw, dG."""
    dqe = do @ h.transpose(-1, -2)  # d(q e^G)
    dpd = (do @ big_u.transpose(-1, -2)) * f.decay  # dP o D
    dke = big_u @ dh.transpose(-1, -2)  # d(k e^(G_C - G))
    dq = dqe * f.e_g.unsqueeze(-1) + dpd @ f.k
    dk = dpd.transpose(-1, -2) @ f.q + dke * f.e_to_end.unsqueeze(-1)
    dw = -(d_u @ h.transpose(-1, -2))
    to_end = (dke * f.ke).sum(-1)
    d_g = (dqe * f.qe).sum(-1) + _rows_minus_columns(dpd * f.qk) - to_end
    last = to_end.sum(-1) + f.e_last[..., 0] * (dh * h).sum((-1, -2))
    d_g[..., -1] += last
    return dq, dk, dw, d_g


def _wy_grads(f: _Factors, dw, du):
    """Pass 3, the WY transform: [w u] = L^-1 [kb vb] -> dk, dv, dbeta, dG."""
    dkv = _solve_lower_transposed(f.lower, torch.cat([dw, du], -1))
    dkb, dvb = dkv.split([dw.shape[-1], du.shape[-1]], -1)
    beta = f.beta.unsqueeze(-1)
    dv = beta * dvb
    dk = (f.beta * f.e_g).unsqueeze(-1) * dkb
    dbeta = (dvb * f.v).sum(-1) + (dkb * f.k * f.e_g.unsqueeze(-1)).sum(-1)
    d_g = (dkb * f.kb).sum(-1)
    da = -(dkb @ f.w.transpose(-1, -2) + dvb @ f.u.transpose(-1, -2)) * f.strict
    dae = da * f.decay  # d(kk) / beta, strictly lower
    dbeta = dbeta + (dae * f.kk).sum(-1)
    m = beta * dae
    dk = dk + m @ f.k + m.transpose(-1, -2) @ f.k
    d_g = d_g + _rows_minus_columns(da * f.a)
    return dk, dv, dbeta, d_g
