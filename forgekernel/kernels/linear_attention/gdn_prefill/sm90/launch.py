"""Host launcher of the chunked Gated DeltaNet forward: torch only (no DSL). Callers validate
first (`forgekernel.ops.gated_delta_rule_chunked.gated_delta_rule`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import params_for, v_split_for
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import dtype_name, num_sms, on_device

ALIGN = 16  # bytes: TMA boxes (q, k, v), 16-byte O stores, the state's vector accesses
MAX_SEQUENCES = 65535  # the grid is (HV x V split, N): N is gridDim.y, at most 65535


def _aligned(x: torch.Tensor) -> torch.Tensor:
    """x itself when its base is 16-byte aligned, else a fresh (aligned) copy: a contiguous
    view at an odd offset of a larger buffer would otherwise be refused at the call."""
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


def _sms(device: torch.device) -> int:
    """The device's SM count (132 for a CPU tensor: the tests' stand-in for the H200)."""
    return num_sms(device.index) if device.type == "cuda" else 132


def gdn_prefill(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    out: torch.Tensor,
    final_state: torch.Tensor,
    scale: float,
    *,
    k_last: bool,
    l2norm: bool,
    v_split: int | None = None,
) -> None:
    """Varlen form: q, k (T, H, K), v (T, HV, V) 16-bit, g (log decay) and beta fp32 (T, HV),
    cu_seqlens int32 (N + 1,); initial_state (N, HV, K, V) fp32, or (N, HV, V, K) with k_last,
    or None (zeros). Writes out (T, HV, V) in q's dtype and final_state (N, HV, ...) in the
    initial state's layout. Last dims contiguous, token strides multiples of 8 elements. Problems
    of N x HV <= SMs / 2 CTAs split each state's value rows over two CTAs (`v_split_for`; or
    as `v_split` says: the bench's variants time both on a case)."""
    if final_state.shape[0] == 0:
        return
    if q.shape[0] == 0:  # every sequence empty: no TMA descriptor over zero tokens
        final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
        return
    split = v_split or v_split_for(final_state.shape[0], v.shape[1], _sms(q.device))
    params = params_for(
        dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), k_last=k_last, l2norm=l2norm,
        initial_state=initial_state is not None, v_split=split,
    )  # fmt: skip
    fn = get_kernel(SPEC, params)
    q, k, v = (_aligned(x) for x in (q, k, v))
    init = None if initial_state is None else _aligned(initial_state)
    dst = out if out.data_ptr() % ALIGN == 0 else torch.empty_like(out)
    with on_device(q.device):
        fn(q, k, v, g, beta, init, cu_seqlens, dst, final_state, scale)
    if dst is not out:
        out.copy_(dst)
