"""Host launcher of the gated delta rule step: torch only (no DSL). Callers validate first
(`forgekernel.ops.gated_delta_rule.gated_delta_rule_step`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_decode.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import params_for
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import dtype_name, on_device


def gdn_step(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    rows: torch.Tensor | None,
    out: torch.Tensor,
    intermediate: torch.Tensor | None,
    scale: float,
    *,
    k_last: bool,
    l2norm: bool,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    update_state: bool = True,
) -> None:
    """out (B, T, HV, V) and the state rows `rows` (None: rows 0 .. B - 1) updated in place
    (every token's state into `intermediate` too when given; the state left as it is with
    update_state False). Last dims contiguous; g / beta fp32, or with `gates` = (A_log, dt_bias)
    fp32 (HV,) the projections a / b in q's dtype (the kernel computes the decay and beta).
    A k-last state whose (HV, V, K) heads are compact (and the intermediate states' too) runs
    the row-streaming kernel (T baked in); any other the staged kernel (which reads its rows
    from an index tensor)."""
    if q.shape[0] == 0:
        return
    streaming = (
        k_last and _compact_heads(state) and (intermediate is None or _compact_heads(intermediate))
    )
    if rows is None and not streaming:
        rows = torch.arange(q.shape[0], dtype=torch.int32, device=q.device)
    per_channel = g.dim() == 4
    if streaming and per_channel and g.data_ptr() % 16:
        g = g.clone()  # a lane's 4 decays are one 16-byte load
    params = params_for(
        dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), per_channel=per_channel,
        k_last=k_last, l2norm=l2norm, intermediate=intermediate is not None,
        gating=gates is not None, update_state=update_state,
        tokens=q.shape[1] if streaming else None, pool=rows is not None,
    )  # fmt: skip
    fn = get_kernel(SPEC, params)
    a_log, dt_bias = gates if gates is not None else (None, None)
    with on_device(q.device):
        fn(q, k, v, g, beta, state, rows, out, intermediate, a_log, dt_bias, scale)


def _compact_heads(t: torch.Tensor) -> bool:
    """Whether the last three dims (HV, V, K) of t are contiguous (the rows kernel bakes their
    strides in)."""
    vd, kd = t.shape[-2:]
    return t.stride(-1) == 1 and t.stride(-2) == kd and t.stride(-3) == vd * kd
