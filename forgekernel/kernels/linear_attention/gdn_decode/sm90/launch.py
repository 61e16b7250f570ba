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
    rows: torch.Tensor,
    out: torch.Tensor,
    intermediate: torch.Tensor | None,
    scale: float,
    *,
    k_last: bool,
    l2norm: bool,
    gates: tuple[torch.Tensor, torch.Tensor] | None = None,
    update_state: bool = True,
) -> None:
    """out (B, T, HV, V) and the state rows `rows` updated in place (every token's state into
    `intermediate` too when given; the state left as it is with update_state False). Last
    dims contiguous; g / beta fp32, or with `gates` = (A_log, dt_bias) fp32 (HV,) the
    projections a / b in q's dtype (the kernel computes the decay and beta)."""
    if q.shape[0] == 0:
        return
    params = params_for(
        dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), per_channel=g.dim() == 4,
        k_last=k_last, l2norm=l2norm, intermediate=intermediate is not None,
        gating=gates is not None, update_state=update_state,
    )  # fmt: skip
    fn = get_kernel(SPEC, params)
    a_log, dt_bias = gates if gates is not None else (None, None)
    with on_device(q.device):
        fn(q, k, v, g, beta, state, rows, out, intermediate, a_log, dt_bias, scale)
