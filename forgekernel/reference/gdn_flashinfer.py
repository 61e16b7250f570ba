"""FlashInfer-Bench's Gated DeltaNet definitions run through our delta-rule reference.

Definitions: `gdn_prefill_qk4_v8_d128_k_last`, `gdn_decode_qk4_v8_d128_k_last`,
`gdn_mtp_qk4_v8_d128_k_last` (shared/external/flashinfer-bench). Their conventions, and ours:

    gating   their decay is linear, g = exp(-exp(A_log) * softplus(a + dt_bias)), beta =
             sigmoid(b); ours is the log decay, so g_log = -exp(A_log) * softplus(a + dt_bias),
             computed in fp32 from bf16 a and fp32 A_log / dt_bias as theirs is
    state    k-last (N, HV, V, K) fp32; ours is (N, HV, K, V): a transpose of the last two dims
    heads    q, k 4 heads, v 8: value head j reads q/k head j // 2, as ours
    scale    None or 0.0 means 1 / sqrt(K)
    outputs  bf16 output, fp32 state

Behaviours of their references kept here: prefill gives a zero new_state row to an empty
sequence (even with an initial state); MTP returns the pool unchanged (their
disable_state_update=True) and writes the state after every token into
intermediate_states_buffer[initial_state_indices[b], t] when the buffer is given.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_step,
)


def flashinfer_gating(
    A_log: torch.Tensor, a: torch.Tensor, dt_bias: torch.Tensor, b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(g, beta) in our conventions: the log decay -exp(A_log) softplus(a + dt_bias) and
    sigmoid(b), fp32, shaped like a and b (heads last)."""
    g = -torch.exp(A_log.float()) * F.softplus(a.float() + dt_bias.float())
    return g, torch.sigmoid(b.float())


def k_last_to_ours(state: torch.Tensor) -> torch.Tensor:
    """(N, HV, V, K) -> (N, HV, K, V), contiguous."""
    return state.transpose(-1, -2).contiguous()


def ours_to_k_last(state: torch.Tensor) -> torch.Tensor:
    """(N, HV, K, V) -> (N, HV, V, K), contiguous."""
    return state.transpose(-1, -2).contiguous()


def _scale(scale: float | torch.Tensor | None) -> float | None:
    if scale is None or float(scale) == 0.0:
        return None  # ours then defaults to head_dim ** -0.5, as theirs does
    return float(scale)


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None,
    *,
    chunked: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Their prefill inputs (q, k (T, 4, K), v (T, 8, V), state (N, 8, V, K) or None) ->
    (output (T, 8, V) in q's dtype, new_state (N, 8, V, K) fp32). chunked=False runs the fp64
    recurrence, chunked=True the fp32 chunked form."""
    g, beta = flashinfer_gating(A_log, a, dt_bias, b)
    initial = None if state is None else k_last_to_ours(state.float())
    run = gated_delta_rule_chunked if chunked else gated_delta_rule_recurrent
    out, final = run(
        q.unsqueeze(0),
        k.unsqueeze(0),
        v.unsqueeze(0),
        g.unsqueeze(0),
        beta.unsqueeze(0),
        scale=_scale(scale),
        initial_state=initial,
        output_final_state=True,
        cu_seqlens=cu_seqlens,
    )
    empty = (cu_seqlens[1:] - cu_seqlens[:-1]) <= 0
    final[empty.to(final.device)] = 0  # their reference leaves an empty sequence's row zero
    return out[0].to(q.dtype), ours_to_k_last(final.float())


def gdn_decode(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Their decode inputs (q, k (B, 1, 4, K), v (B, 1, 8, V), state (B, 8, V, K) or None) ->
    (output (B, 1, 8, V) in q's dtype, new_state (B, 8, V, K) fp32). Their state is not
    modified: the step updates a copy, in the k-last layout itself."""
    g, beta = flashinfer_gating(A_log, a, dt_bias, b)
    bsz, hv, dv, dk = q.shape[0], v.shape[2], v.shape[3], q.shape[3]
    new_state = (
        torch.zeros(bsz, hv, dv, dk, dtype=torch.float32, device=q.device)
        if state is None
        else state.float().clone()
    )
    out = gated_delta_rule_step(q, k, v, g, beta, new_state, scale=_scale(scale), k_last=True)
    return out.to(q.dtype), new_state


def gdn_mtp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor,
    initial_state_indices: torch.Tensor,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float | None,
    intermediate_states_buffer: torch.Tensor | None = None,
    *,
    disable_state_update: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Their MTP inputs (q, k (B, T, 4, K), v (B, T, 8, V), pool (P, 8, V, K), indices (B,)) ->
    (output (B, T, 8, V) in q's dtype, final pool (P, 8, V, K) fp32). As their reference, the
    returned pool is the input pool unchanged unless disable_state_update=False;
    intermediate_states_buffer (P, T, 8, V, K), when given, is written in place."""
    g, beta = flashinfer_gating(A_log, a, dt_bias, b)
    pool = initial_state.float().clone()
    out = gated_delta_rule_step(
        q,
        k,
        v,
        g,
        beta,
        pool,
        scale=_scale(scale),
        state_indices=initial_state_indices,
        k_last=True,
        intermediate_states=intermediate_states_buffer,
    )
    final = initial_state.clone() if disable_state_update else pool
    return out.to(q.dtype), final
