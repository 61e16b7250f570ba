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
) -> None:
    """out (B, T, HV, V) and the state rows `rows` updated in place (every token's state into
    `intermediate` too when given). Last dims contiguous, fp32 g / beta / state."""
    params = params_for(
        dtype_name(q.dtype), (q.shape[-1], v.shape[-1]), per_channel=g.dim() == 4,
        k_last=k_last, l2norm=l2norm, intermediate=intermediate is not None,
    )  # fmt: skip
    fn = get_kernel(SPEC, params)
    with on_device(q.device):
        fn(q, k, v, g, beta, state, rows, out, intermediate, scale)
