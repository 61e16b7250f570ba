"""Host launcher of the KDA forward: the first pass (`operands.py`, torch for now), then the
recurrence kernel. Torch only (no DSL). Callers validate first
(`forgekernel.ops.kda_chunked.kimi_delta_attention`)."""

from __future__ import annotations

import functools

import torch

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import (
    INTRA_SPEC,
    SPEC,
    intra_params_for,
)
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK, params_for
from forgekernel.kernels.linear_attention.kda_prefill.sm90.operands import (
    L2NORM_EPS,
    OPERAND_DTYPE,
    chunk_layout,
    chunk_table,
    kda_chunk_operands,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import dtype_name, on_device

ALIGN = 16  # bytes: TMA boxes, 16-byte O stores
MAX_SEQUENCES = 65535  # the grid is (HV, N): N is gridDim.y


@functools.cache
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def value_split(sequences: int, heads: int, device: torch.device) -> bool:
    """Two CTAs per (sequence, head) (one state warpgroup each) where the split grid still fits
    one wave: the recurrence is one CTA's sequential walk, so CTAs are its parallelism; past one
    wave two warpgroups sharing a CTA's loads and tensor cores (filling each other's bubbles)
    are the better use of an SM."""
    sms = _sm_count(device.index or 0) if device.type == "cuda" else 132
    return 2 * sequences * heads <= sms


def refuse_capture() -> None:
    """Raise before any CUDA work inside a CUDA-graph capture: the launcher reads cu_seqlens on
    the host, a device-to-host copy the driver rejects while the stream captures. Rejected
    there, it invalidates the capture, and torch before 2.12 (pytorch#180395) then skips
    `endAllocateToPool`, leaving its caching allocator routing to the dead graph's pool for the
    rest of the process (and `empty_cache` failing); raised here, the capture ends cleanly
    (empty) and the caller (the bench's timing) falls back to eager launches."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "kimi_delta_attention reads cu_seqlens on the host (one sync a call): it cannot be "
            "captured in a CUDA graph"
        )


def _aligned(x: torch.Tensor) -> torch.Tensor:
    return x if x.data_ptr() % ALIGN == 0 else x.clone()


FIRST_PASSES = ("torch", "kernel")


def _unit_rows(x: torch.Tensor) -> torch.Tensor:
    f = x.float()
    return (f / torch.sqrt((f * f).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


def first_pass_kernel(q, k, g, beta, edges: list[int], scale: float, l2norm: bool) -> dict:
    """The first pass on `intra.py` (one CTA per chunk and value head): the same outputs as
    `operands.kda_chunk_operands`. Compiled, not yet run on a GPU."""
    if l2norm:  # the kernel reads unit rows: normalized here, in fp32, back in q's dtype
        q, k = (_unit_rows(x) for x in (q, k))
    first, _ = chunk_layout(edges, q.device)
    starts, lengths = chunk_table(edges, q.device)
    rows, hv, dk = starts.numel() * CHUNK, g.shape[1], q.shape[2]
    out = {
        name: q.new_empty(rows, hv, width, dtype=OPERAND_DTYPE)
        for name, width in (("q_g", dk), ("k_g", dk), ("k_d", dk), ("t_beta", CHUNK),
                            ("p", CHUNK))
    }  # fmt: skip
    out["decay"] = q.new_empty(rows // CHUNK, hv, dk, dtype=torch.float32)
    out["first"] = first
    fn = get_kernel(INTRA_SPEC, intra_params_for(dtype_name(q.dtype), dk))
    with on_device(q.device):
        fn(_aligned(q), _aligned(k), _aligned(g.float().contiguous()), beta.float().contiguous(),
           starts, lengths, out["q_g"], out["k_g"], out["k_d"], out["t_beta"], out["p"],
           out["decay"], scale)  # fmt: skip
    return out


def kda_prefill(
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
    l2norm: bool,
    first_pass: str = "torch",
) -> None:
    """Varlen form: q, k (T, H, K), v (T, HV, V) 16-bit, g (T, HV, K) and beta (T, HV),
    cu_seqlens int32 (N + 1,); initial_state fp32 (N, HV, K, V) or None (zeros). Writes out
    (T, HV, V) in v's dtype and final_state (N, HV, K, V) fp32. Contiguous tensors. Reads the
    offsets on the host (the first pass lays its chunks out from them: one sync). first_pass:
    "torch" (`operands.py`, checked) or "kernel" (`intra.py`, compiled, not yet run)."""
    refuse_capture()
    if first_pass not in FIRST_PASSES:
        raise ValueError(f"first_pass must be one of {FIRST_PASSES}, got {first_pass!r}")
    if final_state.shape[0] == 0:
        return
    edges = [int(x) for x in cu_seqlens.tolist()]
    if edges[-1] == edges[0]:  # every sequence empty: no TMA descriptor over zero rows
        final_state.copy_(initial_state) if initial_state is not None else final_state.zero_()
        return
    make = kda_chunk_operands if first_pass == "torch" else first_pass_kernel
    ops = make(q, k, g, beta, edges, scale, l2norm)
    split = value_split(final_state.shape[0], v.shape[1], v.device)
    params = params_for(dtype_name(v.dtype), (q.shape[-1], v.shape[-1]),
                        initial_state=initial_state is not None, value_split=split)  # fmt: skip
    fn = get_kernel(SPEC, params)
    v = _aligned(v)
    init = None if initial_state is None else _aligned(initial_state)
    dst = out if out.data_ptr() % ALIGN == 0 else torch.empty_like(out)
    with on_device(v.device):
        fn(ops["q_g"], ops["k_g"], ops["k_d"], ops["t_beta"], ops["p"], ops["decay"], v, init,
           cu_seqlens, ops["first"], dst, final_state)  # fmt: skip
    if dst is not out:
        out.copy_(dst)
