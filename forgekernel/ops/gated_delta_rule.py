"""`forgekernel.ops.gated_delta_rule.gated_delta_rule_step`: the decode / multi-token-
prediction step of Gated DeltaNet (g per value head) and Kimi Delta Attention (g per key
channel), fla's conventions, the state updated in place (kernel:
kernels/linear_attention/gdn_decode/sm90). The chunked prefill forward / backward are still to
come."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_decode.sm90 import launch as gdn_sm90
from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import HEAD_DIMS, MAX_TOKENS
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    check_bools,
    check_cuda,
    check_same_device,
    check_scale,
    check_shaped,
    check_tensor,
)

F32 = (torch.float32,)


def _contiguous_last(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


@torch.library.custom_op(
    "forgekernel::gated_delta_rule_step", mutates_args=("state", "intermediate_states")
)
def _step_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None,
    intermediate_states: torch.Tensor | None,
    a_log: torch.Tensor | None,
    dt_bias: torch.Tensor | None,
    scale: float,
    k_last: bool,
    l2norm: bool,
    update_state: bool,
) -> torch.Tensor:
    out = q.new_empty(*v.shape)
    gates = None if a_log is None else (a_log, dt_bias)
    gdn_sm90.gdn_step(
        *(x.contiguous() for x in (q, k, v, g, beta)), state,
        None if rows is None else rows.contiguous(), out,
        intermediate_states, scale, k_last=k_last, l2norm=l2norm, gates=gates,
        update_state=update_state,
    )  # fmt: skip
    return out


@_step_op.register_fake
def _(q, k, v, g, beta, state, rows, intermediate_states, a_log, dt_bias, scale, k_last,
      l2norm, update_state):  # fmt: skip
    return q.new_empty(*v.shape)


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
    out: torch.Tensor | None = None,
    _gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    _update_state: bool = True,
) -> torch.Tensor:
    """q, k (B, T, H, K) and v (B, T, HV, V) bf16 / fp16, T = 1..4 tokens; g fp32 (B, T, HV)
    log decay (or (B, T, HV, K) per key channel: KDA); beta fp32 (B, T, HV); state fp32
    (N, HV, K, V), or (N, HV, V, K) with k_last (FlashInfer's layout), row state_indices[b]
    (int32 (B,), distinct; default b) read and written for sequence b; intermediate_states
    fp32 (N, T, HV, ...) in the state's layout, if given, receives the state after every token.
    Returns o (B, T, HV, V) in q's dtype (written into `out` when given: a contiguous tensor
    of that shape). Value head hv reads q / k head hv // (HV / H)."""
    check_tensor("q", q, ndim=4, cuda=False)
    check_shaped("k", k, tuple(q.shape), (q.dtype,))
    b, t, h, dk = q.shape
    check_tensor("v", v, ndim=4, cuda=False)
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (b, t) or v.dtype != q.dtype or hv % h:
        raise ValueError(f"v must be (B, T, HV, V) in q's dtype with HV a multiple of H = {h}, "
                         f"got {tuple(v.shape)} {v.dtype}")  # fmt: skip
    if (dk, dv) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {(dk, dv)}")
    if not 1 <= t <= MAX_TOKENS:
        raise ValueError(f"T must be 1..{MAX_TOKENS} tokens per step, got {t}")
    per_channel = g.dim() == 4
    if _gates is None:  # (the FlashInfer adapters pass the projections a / b, checked there)
        check_shaped("g", g, (b, t, hv, dk) if per_channel else (b, t, hv), F32)
        check_shaped("beta", beta, (b, t, hv), F32)
    check_tensor("state", state, ndim=4, dtypes=F32, cuda=False)
    tail = (dv, dk) if k_last else (dk, dv)
    if state.shape[1] != hv or tuple(state.shape[2:]) != tail:
        raise ValueError(f"state must be (N, {hv}, {tail[0]}, {tail[1]}), got {tuple(state.shape)}")
    if state.stride(-1) != 1:
        raise ValueError("state must have a contiguous last dim (it is updated in place)")
    rows = state_indices  # None: rows 0 .. B - 1 (the kernel then loads no index)
    if rows is None:
        if state.shape[0] < b:
            raise ValueError(f"state has {state.shape[0]} rows for a batch of {b}")
    else:
        check_shaped("state_indices", rows, (b,), (torch.int32,))
    if intermediate_states is not None:
        want = (state.shape[0], t, hv, *tail)
        check_shaped("intermediate_states", intermediate_states, want, F32)
    check_cuda("q", q)
    extra = {n: x for n, x in (("state_indices", rows), ("intermediate_states",
             intermediate_states)) if x is not None}  # fmt: skip
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, **extra)
    if out is not None:
        check_shaped("out", out, (b, t, hv, dv), (q.dtype,))
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        check_same_device(q=q, out=out)
    args = (q, k, v, g, beta)
    check_bools(use_qk_l2norm=use_qk_l2norm, k_last=k_last)
    scale = check_scale("scale", scale, dk**-0.5)
    if _traced(*args, state, rows, intermediate_states, out):
        a_log, dt_bias = _gates if _gates is not None else (None, None)
        o = torch.ops.forgekernel.gated_delta_rule_step(
            *args, state, rows, intermediate_states, a_log, dt_bias, scale, k_last,
            use_qk_l2norm, _update_state,
        )  # fmt: skip
        return o if out is None else out.copy_(o)
    if out is None:
        out = torch.empty(b, t, hv, dv, dtype=q.dtype, device=q.device)
    gdn_sm90.gdn_step(
        *(_contiguous_last(x) for x in (q, k, v, g, beta)),
        state, None if rows is None else rows.contiguous(), out, intermediate_states, scale,
        k_last=k_last,
        l2norm=use_qk_l2norm,
        gates=_gates, update_state=_update_state,
    )  # fmt: skip
    return out


def _scale_of(scale, head_dim: int) -> float:
    """FlashInfer-Bench's scale: None or 0 means 1 / sqrt(K)."""
    return head_dim**-0.5 if scale is None or float(scale) == 0.0 else float(scale)


def _check_gates(q, v, A_log, a, dt_bias, b) -> None:
    bsz, t, hv = v.shape[:3]
    check_shaped("a", a, (bsz, t, hv), (q.dtype,))
    check_shaped("b", b, (bsz, t, hv), (q.dtype,))
    check_shaped("A_log", A_log, (hv,), F32)
    check_shaped("dt_bias", dt_bias, (hv,), F32)


def gdn_decode_flashinfer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `gdn_decode_qk4_v8_d128_k_last` as it is: q, k (B, 1, H, K), v (B, 1,
    HV, V) bf16, state (B, HV, V, K) fp32 k-last or None (zeros), A_log / dt_bias fp32 (HV,),
    a / b (B, 1, HV) bf16, decay exp(-exp(A_log) softplus(a + dt_bias)) and beta sigmoid(b)
    computed in the kernel -> (output (B, 1, HV, V), new_state (B, HV, V, K)); their state is
    not modified (the step updates a copy)."""
    return _flashinfer_step(q, k, v, state, None, A_log, a, dt_bias, b, scale, None, True)


def gdn_mtp_flashinfer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    initial_state: torch.Tensor,
    initial_state_indices: torch.Tensor,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    scale: float | None = None,
    intermediate_states_buffer: torch.Tensor | None = None,
    disable_state_update: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `gdn_mtp_qk4_v8_d128_k_last`: T tokens per sequence against a state
    pool (P, HV, V, K) at rows initial_state_indices; every token's state into
    intermediate_states_buffer (P, T, HV, V, K) when given; the pool updated in place unless
    disable_state_update (their default) -> (output (B, T, HV, V), the pool)."""
    return _flashinfer_step(
        q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale,
        intermediate_states_buffer, not disable_state_update, copy_state=False,
    )  # fmt: skip


def _flashinfer_step(q, k, v, state, rows, A_log, a, dt_bias, b, scale, inter, update, *,
                     copy_state: bool = True):  # fmt: skip
    check_tensor("q", q, ndim=4, cuda=False)
    check_tensor("v", v, ndim=4, cuda=False)
    _check_gates(q, v, A_log, a, dt_bias, b)
    bsz, hv, dv, dk = q.shape[0], v.shape[2], v.shape[3], q.shape[3]
    if state is None:
        state = torch.zeros(bsz, hv, dv, dk, dtype=torch.float32, device=q.device)
    elif copy_state:
        state = state.clone()
    out = gated_delta_rule_step(
        q, k, v, a, b, state, scale=_scale_of(scale, dk), state_indices=rows, k_last=True,
        intermediate_states=inter, _gates=(A_log.contiguous(), dt_bias.contiguous()),
        _update_state=update,
    )  # fmt: skip
    return out, state
