"""Gated delta rule references (Gated DeltaNet, Kimi Delta Attention): the recurrence as the
definition, the chunked WY / UT-transform form the kernels compute, and the decode step.

Conventions are fla's (flash-linear-attention, `fla/ops/gated_delta_rule/fused_recurrent.py`,
`fla/ops/kda/naive.py`):

    q, k   (B, T, H, K)        value head j reads q/k head j // (HV // H)  (grouped value heads)
    v      (B, T, HV, V)
    g      (B, T, HV)          log decay per head and token (Gated DeltaNet)
           (B, T, HV, K)       log decay per key channel (Kimi Delta Attention)
    beta   (B, T, HV)
    state  (N, HV, K, V)       fp32 in the kernels; N = B, or the number of sequences (varlen)

One token, per value head, state S (K, V), decay a_t = exp(g_t) (a scalar, or diag over K):

    S'  = a_t * S_{t-1}                    decay first
    u_t = beta_t (v_t - S'^T k_t)          delta-rule correction, read from the decayed state
    S_t = S' + k_t u_t^T
    o_t = S_t^T (scale q_t)                output after the update; scale defaults to K**-0.5

use_qk_l2norm divides q and k by sqrt(sum(x^2) + 1e-6) (fla's l2norm) before anything else.
Varlen: B = 1 and cu_seqlens (N + 1,); every sequence starts from its own initial state row.

Chunked form (chunk of C tokens, state S0 at its start, G_i = g_1 + ... + g_i inside the chunk):

    A_ij  = beta_i k_i^T diag(exp(G_i - G_j)) k_j       j < i   (strictly lower)
    T     = (I + A)^-1                                   UT transform, forward substitution
    w     = T diag(beta) (k * exp(G))                    u = T diag(beta) v
    U     = u - w S0                                     the corrected values of the chunk
    o_i   = scale [ (q_i * exp(G_i))^T S0 + sum_{j<=i} q_i^T diag(exp(G_i - G_j)) k_j U_j ]
    S_C   = exp(G_C) S0 + sum_j diag(exp(G_C - G_j)) k_j U_j^T

Every exponent is G_i - G_j with j <= i, G_i, or G_C - G_j: never positive when g <= 0, so no
exp overflows however long the sequence or strong the decay (a factorized exp(G_i) exp(-G_j)
would overflow fp32 once a chunk's decay passes ~88). Masked entries get exponent -inf before
the exp, never inf * 0. The tail chunk is zero-padded with g = 0, which changes nothing.

Outputs come back in the computation dtype (`dtype`): fp64 is the yardstick, fp32 the error a
kernel computing the same chunked math in fp32 should be compared with. Both forms are plain
differentiable torch: autograd through the fp64 recurrence gives the backward's reference
gradients in q, k, v, g, beta and the initial state.
"""

from __future__ import annotations

import torch

L2NORM_EPS = 1e-6


# ----------------------------------------------------------------------------- public API


def gated_delta_rule_recurrent(
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
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o (B, T, HV, V), final state (N, HV, K, V) or None): the recurrence, token by token."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=False)
    return _run(
        _recurrent_sequence,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        dtype,
    )


def gated_delta_rule_chunked(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The same outputs computed chunk by chunk (WY / UT transform, inter-chunk state passing)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=False)
    return _run(
        _chunked_runner(chunk_size),
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        dtype,
    )


def kimi_delta_attention_recurrent(
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
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention (g (B, T, HV, K): per-channel log decay), token by token."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    return _run(
        _recurrent_sequence,
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        dtype,
    )


def kimi_delta_attention_chunked(
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
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Kimi Delta Attention, chunked: the decays of A and of q.k are per channel (C, C, K)."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    return _run(
        _chunked_runner(chunk_size),
        q,
        k,
        v,
        g,
        beta,
        scale,
        initial_state,
        output_final_state,
        cu_seqlens,
        use_qk_l2norm,
        dtype,
    )


def gated_delta_rule_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    *,
    scale: float | None = None,
    use_qk_l2norm: bool = False,
    state_indices: torch.Tensor | None = None,
    k_last: bool = False,
    intermediate_states: torch.Tensor | None = None,
) -> torch.Tensor:
    """Decode / multi-token prediction: T (1..4) tokens of B sequences, state updated in place.

    q, k (B, T, H, K), v (B, T, HV, V), g (B, T, HV) or (B, T, HV, K), beta (B, T, HV).
    state (N, HV, K, V), or (N, HV, V, K) with k_last (FlashInfer's layout); sequence b reads and
    writes row state_indices[b] (default b; indices must be distinct). intermediate_states
    (N, T, HV, ...) in the state's layout, if given, receives the state after every token (for
    rolling back rejected draft tokens). Math in fp64, stored in the state's dtype; returns o
    (B, T, HV, V) in the state's dtype.
    """
    b, t = q.shape[:2]
    _check(q, k, v, g, beta, None, None, per_channel=g.dim() == 4)
    rows = torch.arange(b, device=state.device) if state_indices is None else state_indices.long()
    if state.dim() != 4 or rows.numel() != b:
        raise ValueError(
            f"state must be (N, HV, K, V) with one row per sequence, got {state.shape}"
        )
    q, k, v, g, beta = _to_head_first(q, k, v, g, beta, torch.float64, use_qk_l2norm)
    q = q * _scale(scale, q.shape[-1])
    s = state[rows].to(torch.float64)
    s = s.transpose(-1, -2) if k_last else s
    out = []
    for i in range(t):
        s, o = _token_update(s, q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i])
        out.append(o)
        if intermediate_states is not None:
            intermediate_states[rows, i] = (s.transpose(-1, -2) if k_last else s).to(
                intermediate_states.dtype
            )
    state[rows] = (s.transpose(-1, -2) if k_last else s).to(state.dtype)
    return torch.stack(out, dim=1).to(state.dtype)


# ----------------------------------------------------------------------------- layout


def _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel: bool) -> None:
    """ValueError naming the argument when a shape does not follow the conventions above."""
    if q.dim() != 4 or k.shape != q.shape:
        raise ValueError(f"q and k must both be (B, T, H, K), got {q.shape} and {k.shape}")
    b, t, h, dk = q.shape
    if v.dim() != 4 or v.shape[:2] != (b, t) or v.shape[2] % h:
        raise ValueError(f"v must be (B, T, HV, V) with HV a multiple of H={h}, got {v.shape}")
    hv = v.shape[2]
    want_g = (b, t, hv, dk) if per_channel else (b, t, hv)
    if g.shape != want_g:
        raise ValueError(f"g must be {want_g}, got {tuple(g.shape)}")
    if beta.shape != (b, t, hv):
        raise ValueError(f"beta must be {(b, t, hv)}, got {tuple(beta.shape)}")
    if cu_seqlens is not None and b != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B = 1, got B = {b}")
    n = b if cu_seqlens is None else cu_seqlens.numel() - 1
    if initial_state is not None and initial_state.shape != (n, hv, dk, v.shape[3]):
        raise ValueError(
            f"initial_state must be {(n, hv, dk, v.shape[3])}, got {tuple(initial_state.shape)}"
        )


def _scale(scale: float | None, head_dim: int) -> float:
    return head_dim**-0.5 if scale is None else scale


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _to_head_first(q, k, v, g, beta, dtype: torch.dtype, use_qk_l2norm: bool):
    """Cast, optionally l2-normalize, give q and k one head per value head, and move heads
    before time: q, k (B, HV, T, K), v (B, HV, T, V), g (B, HV, T, 1 or K), beta (B, HV, T)."""
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    group = v.shape[2] // q.shape[2]
    q, k = (x.repeat_interleave(group, dim=2) for x in (q, k))
    g = g.unsqueeze(-1) if g.dim() == 3 else g
    return (x.transpose(1, 2) for x in (q, k, v, g, beta))


def _run(
    sequence_fn,
    q,
    k,
    v,
    g,
    beta,
    scale,
    initial_state,
    output_final_state,
    cu_seqlens,
    use_qk_l2norm,
    dtype,
):
    """Apply `sequence_fn(q, k, v, g, beta, state) -> (o, state)` to the whole batch, or to each
    varlen sequence from its own initial state; assemble o (B, T, HV, V) and the final states."""
    b, t, _, dk = q.shape
    hv, dv = v.shape[2], v.shape[3]
    q, k, v, g, beta = _to_head_first(q, k, v, g, beta, dtype, use_qk_l2norm)
    q = q * _scale(scale, dk)
    bounds = [(0, t)] if cu_seqlens is None else _bounds(cu_seqlens)
    n = b if cu_seqlens is None else len(bounds)
    state0 = torch.zeros(n, hv, dk, dv, dtype=dtype, device=q.device)
    if initial_state is not None:
        state0 = initial_state.to(dtype)
    out = torch.zeros(b, hv, t, dv, dtype=dtype, device=q.device)
    finals = []
    for i, (t0, t1) in enumerate(bounds):
        rows = slice(None) if cu_seqlens is None else slice(i, i + 1)
        span = (slice(None), slice(None), slice(t0, t1))
        o, s = sequence_fn(q[span], k[span], v[span], g[span], beta[span], state0[rows])
        out[span] = o
        finals.append(s)
    final = torch.cat(finals) if output_final_state else None
    return out.transpose(1, 2), final


def _bounds(cu_seqlens: torch.Tensor) -> list[tuple[int, int]]:
    edges = [int(x) for x in cu_seqlens.tolist()]
    return list(zip(edges[:-1], edges[1:]))


# ----------------------------------------------------------------------------- recurrence


def _token_update(s, q_t, k_t, v_t, g_t, beta_t):
    """One token for every (sequence, head): s (B, HV, K, V), q_t (scaled) and k_t (B, HV, K),
    v_t (B, HV, V), g_t (B, HV, 1 or K), beta_t (B, HV) -> (new s, o_t (B, HV, V))."""
    s = s * g_t.exp().unsqueeze(-1)
    predicted = torch.einsum("bhk,bhkv->bhv", k_t, s)
    u = beta_t.unsqueeze(-1) * (v_t - predicted)
    s = s + k_t.unsqueeze(-1) * u.unsqueeze(-2)
    return s, torch.einsum("bhk,bhkv->bhv", q_t, s)


def _recurrent_sequence(q, k, v, g, beta, s):
    out = torch.empty(*v.shape, dtype=v.dtype, device=v.device)
    for i in range(q.shape[2]):
        s, out[:, :, i] = _token_update(
            s, q[:, :, i], k[:, :, i], v[:, :, i], g[:, :, i], beta[:, :, i]
        )
    return out, s


# ----------------------------------------------------------------------------- chunked


def _chunked_runner(chunk_size: int):
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")

    def run(q, k, v, g, beta, s):
        return _chunked_sequence(q, k, v, g, beta, s, chunk_size)

    return run


def _chunked_sequence(q, k, v, g, beta, s, c: int):
    """q, k (B, HV, L, K), v (B, HV, L, V), g (B, HV, L, 1 or K), beta (B, HV, L), s (B, HV, K, V).
    Intra-chunk work is batched over all chunks at once; only the state passing is sequential."""
    length = q.shape[2]
    if length == 0:
        return v.clone(), s
    q, k, v, g, beta = (_split_chunks(x, c) for x in (q, k, v, g, beta))
    big_g = g.cumsum(dim=3)  # (B, HV, NC, C, 1 or K): log decay from the chunk start
    w, u = _wy_representation(k, v, beta, big_g)
    qk = _decayed_scores(q, k, big_g, strict=False)  # (B, HV, NC, C, C)
    q_decayed = q * big_g.exp()
    g_last = big_g[..., -1:, :]
    k_to_end = k * (g_last - big_g).exp()
    out = torch.empty_like(u)
    for n in range(q.shape[2]):
        new_v = u[:, :, n] - w[:, :, n] @ s
        out[:, :, n] = q_decayed[:, :, n] @ s + qk[:, :, n] @ new_v
        s = (
            s * g_last[:, :, n].exp().transpose(-1, -2)
            + k_to_end[:, :, n].transpose(-1, -2) @ new_v
        )
    return out.flatten(2, 3)[:, :, :length], s


def _split_chunks(x: torch.Tensor, c: int) -> torch.Tensor:
    """(B, HV, L, ...) -> (B, HV, NC, C, ...), the tail zero-padded: padded tokens have k = v = 0,
    beta = 0 and g = 0 (no decay), so they change neither outputs nor the final state."""
    length = x.shape[2]
    pad = -length % c
    if pad:
        x = torch.cat([x, x.new_zeros(*x.shape[:2], pad, *x.shape[3:])], dim=2)
    return x.unflatten(2, (x.shape[2] // c, c))


def _decayed_scores(a, b, big_g, strict: bool) -> torch.Tensor:
    """M_ij = a_i^T diag(exp(G_i - G_j)) b_j for j < i (strict) or j <= i, else 0; (..., C, C).
    The exponent is masked to -inf before the exp: masked entries would be exp(positive)."""
    c = a.shape[-2]
    keep = torch.ones(c, c, dtype=torch.bool, device=a.device).tril(-1 if strict else 0)
    diff = big_g.unsqueeze(-2) - big_g.unsqueeze(-3)  # (..., C_i, C_j, 1 or K)
    decay = diff.masked_fill(~keep.unsqueeze(-1), float("-inf")).exp()
    if big_g.shape[-1] == 1:  # scalar decay: one GEMM, then the (C, C) decay mask
        return (a @ b.transpose(-1, -2)) * decay.squeeze(-1)
    return torch.einsum("...ik,...jk,...ijk->...ij", a, b, decay)


def _wy_representation(k, v, beta, big_g):
    """(w, u) of every chunk: T = (I + A)^-1 by forward substitution, w = T diag(beta) (k exp(G)),
    u = T diag(beta) v; A_ij = beta_i k_i^T diag(exp(G_i - G_j)) k_j for j < i."""
    a = beta.unsqueeze(-1) * _decayed_scores(k, k, big_g, strict=True)
    t = _unit_lower_inverse(a)
    w = t @ (beta.unsqueeze(-1) * k * big_g.exp())
    u = t @ (beta.unsqueeze(-1) * v)
    return w, u


def _unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A (..., C, C), row by row:
    T_i = e_i - sum_{m<i} A_im T_m (forward substitution; T is unit lower-triangular). Rows are
    stacked rather than written in place, so autograd can differentiate through it."""
    c = a.shape[-1]
    eye = torch.eye(c, dtype=a.dtype, device=a.device).expand_as(a)
    rows = [eye[..., 0, :]]
    for i in range(1, c):
        done = torch.stack(rows, dim=-2)  # (..., i, C)
        rows.append(eye[..., i, :] - (a[..., i : i + 1, :i] @ done).squeeze(-2))
    return torch.stack(rows, dim=-2)
