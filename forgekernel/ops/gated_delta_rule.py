"""`forgekernel.ops.gated_delta_rule.gated_delta_rule_step`: the decode / multi-token-
prediction step of Gated DeltaNet (g per value head) and Kimi Delta Attention (g per key
channel), fla's conventions, the state updated in place. Not exported from `forgekernel` yet:
its kernel (kernels/linear_attention/gdn_decode/sm90) has not passed a GPU check (issue 20).
The chunked prefill forward / backward are still to come."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_decode.sm90 import launch as gdn_sm90
from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import HEAD_DIMS
from forgekernel.ops._validate import check_cuda, check_same_device, check_shaped, check_tensor

F32 = (torch.float32,)
MAX_TOKENS = 4


def _contiguous_last(name: str, t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


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
    """q, k (B, T, H, K) and v (B, T, HV, V) bf16 / fp16, T = 1..4 tokens; g fp32 (B, T, HV)
    log decay (or (B, T, HV, K) per key channel: KDA); beta fp32 (B, T, HV); state fp32
    (N, HV, K, V), or (N, HV, V, K) with k_last (FlashInfer's layout), row state_indices[b]
    (int32 (B,), distinct; default b) read and written for sequence b; intermediate_states
    fp32 (N, T, HV, ...) in the state's layout, if given, receives the state after every token.
    Returns o (B, T, HV, V) in q's dtype. Value head hv reads q / k head hv // (HV / H)."""
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
    check_shaped("g", g, (b, t, hv, dk) if per_channel else (b, t, hv), F32)
    check_shaped("beta", beta, (b, t, hv), F32)
    check_tensor("state", state, ndim=4, dtypes=F32, cuda=False)
    tail = (dv, dk) if k_last else (dk, dv)
    if state.shape[1] != hv or tuple(state.shape[2:]) != tail:
        raise ValueError(f"state must be (N, {hv}, {tail[0]}, {tail[1]}), got {tuple(state.shape)}")
    if state.stride(-1) != 1:
        raise ValueError("state must have a contiguous last dim (it is updated in place)")
    rows = state_indices
    if rows is None:
        if state.shape[0] < b:
            raise ValueError(f"state has {state.shape[0]} rows for a batch of {b}")
        rows = torch.arange(b, dtype=torch.int32, device=q.device)
    else:
        check_shaped("state_indices", rows, (b,), (torch.int32,))
    if intermediate_states is not None:
        want = (state.shape[0], t, hv, *tail)
        check_shaped("intermediate_states", intermediate_states, want, F32)
    check_cuda("q", q)
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, state=state, state_indices=rows)
    out = torch.empty(b, t, hv, dv, dtype=q.dtype, device=q.device)
    gdn_sm90.gdn_step(
        *(_contiguous_last(n, x) for n, x in (("q", q), ("k", k), ("v", v), ("g", g),
                                              ("beta", beta))),
        state, rows.contiguous(), out, intermediate_states,
        float(dk**-0.5 if scale is None else scale), k_last=k_last, l2norm=use_qk_l2norm,
    )  # fmt: skip
    return out
