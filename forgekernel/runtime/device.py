"""What every host launcher needs of the device and of its tensors, torch only (no DSL): the
SM count (persistent grids), the dtype names compile keys use, and the one TMA-ready path
(inputs TMA can read in place, outputs it can write in place, else compact copies)."""

from __future__ import annotations

import functools

import torch


@functools.cache
def num_sms(device_index: int | None) -> int:
    """Multiprocessors of the device (132 on H100 SXM and H200, 114 on H100 PCIe): the
    persistent kernels' grid."""
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def dtype_name(dtype: torch.dtype) -> str:
    """The name compile keys use for a 16-bit dtype ("float16", "bfloat16")."""
    return str(dtype).removeprefix("torch.")


def tma_ready(t: torch.Tensor) -> bool:
    """Last dim contiguous, a 16-byte-aligned base and every other stride a 16-byte multiple,
    size-1 dims included (what TMA can address, and what the compiled kernels assume)."""
    elems16 = 16 // t.element_size()
    return (
        t.stride(-1) == 1
        and all(s % elems16 == 0 for s in t.stride()[:-1])
        and t.data_ptr() % 16 == 0
    )


def as_tma_ready(t: torch.Tensor) -> torch.Tensor:
    """An input: `t` itself when TMA can read it in place, else a compact aligned copy (never
    misread)."""
    return t if tma_ready(t) else t.clone(memory_format=torch.contiguous_format)


def tma_target(t: torch.Tensor, *, contiguous: bool = False) -> torch.Tensor:
    """An output: `t` itself when the kernel can write it in place (TMA-ready, and contiguous
    when asked), else a compact buffer whose result the launcher copies into `t`."""
    if tma_ready(t) and (t.is_contiguous() or not contiguous):
        return t
    return torch.empty(t.shape, dtype=t.dtype, device=t.device)


def copy_back(outputs: tuple[torch.Tensor, ...], targets: tuple[torch.Tensor, ...]) -> None:
    """What the kernel wrote into `tma_target` buffers, into the caller's outputs."""
    for out, dst in zip(outputs, targets):
        if dst is not out:
            out.copy_(dst)
