"""Host launcher of the DSA sparse backward preprocess: torch only (no DSL), the kernel through
the compile cache. One launch gives lse2 and Delta' (tokens, H) fp32 and, with a sink, the
per-(token, head) d_sink terms that one torch sum over the tokens turns into d_sink (H,).
Callers validate first (`forgekernel.ops.dsa_bwd`); nothing here reads device data
(CUDA-graph capturable)."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import SPEC, config
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def unsupported(out: torch.Tensor, dout: torch.Tensor) -> str | None:
    """Why the kernel cannot take these inputs (None: it can): out / dout (tokens, H, 512) in
    one 16-bit dtype on a CUDA device."""
    if out.dtype not in KERNEL_DTYPES or dout.dtype != out.dtype:
        return f"dtypes {out.dtype} / {dout.dtype}: the kernel takes one 16-bit dtype"
    if out.dim() != 3 or out.shape[-1] != config.D_V or dout.shape != out.shape:
        return f"out / dout must be (tokens, H, {config.D_V})"
    if not out.is_cuda:
        return "out is not on a CUDA device"
    return None


def preprocess(
    out: torch.Tensor,
    dout: torch.Tensor,
    lse: torch.Tensor,
    dlse: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
    outs: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse2, Delta', d_sink) in fp32 as kernels/attention/dsa_sparse_bwd/sm90/launch.py
    `preprocess` states them (its torch form): lse2 / Delta' (tokens, H), d_sink (H,) (zeros
    without a sink). out / dout (tokens, H, 512) 16-bit, lse / dlse (tokens, H) fp32, attn_sink
    (H,) or None; outs: (lse2, Delta', terms) (tokens, H) fp32 buffers to write (tests poison
    them; terms unused without a sink), None: fresh ones. `unsupported` must be None."""
    tokens, heads, _ = out.shape
    f32 = {"dtype": torch.float32, "device": out.device}
    sink = None if attn_sink is None else attn_sink.float()
    if outs is None:
        outs = [torch.empty(tokens, heads, **f32) for _ in range(2 if sink is None else 3)]
    lse2, delta = outs[:2]
    terms = None if sink is None else outs[2]
    if tokens and heads:
        dlse32 = None if dlse is None else dlse.float()
        params = config.params_for(dtype_name(out.dtype), sink is not None, dlse is not None)
        kernel = get_kernel(SPEC, params)
        with on_device(out.device):
            kernel(as_tma_ready(out), as_tma_ready(dout), lse.float(), dlse32, sink, lse2,
                   delta, terms)  # fmt: skip
    d_sink = torch.zeros(heads, **f32) if terms is None else terms.sum(0)
    return lse2, delta, d_sink
