"""The one input-validation helper: every op checks its arguments here, before any kernel."""

from __future__ import annotations

from collections.abc import Sequence

import torch

FLOAT16_TYPES = (torch.float16, torch.bfloat16)


def check_tensor(
    name: str,
    t: object,
    *,
    ndim: int,
    dtypes: Sequence[torch.dtype] = FLOAT16_TYPES,
    cuda: bool = True,
) -> torch.Tensor:
    """Type, dtype, device and rank of one tensor argument, with a message naming it."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in dtypes:
        allowed = ", ".join(str(d).removeprefix("torch.") for d in dtypes)
        raise TypeError(f"{name} must have dtype in ({allowed}), got {t.dtype}")
    if cuda:
        check_cuda(name, t)
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D, got {t.dim()}-D with shape {tuple(t.shape)}")
    return t


def check_shaped(
    name: str, t: object, shape: Sequence[int], dtypes: Sequence[torch.dtype] = FLOAT16_TYPES
) -> None:
    """`check_tensor` (any device) and then the exact shape."""
    shape = tuple(shape)
    check_tensor(name, t, ndim=len(shape), dtypes=dtypes, cuda=False)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_same_dtype(**tensors: torch.Tensor) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for n in names[1:]:
        if tensors[n].dtype != first.dtype:
            raise TypeError(f"{n} has dtype {tensors[n].dtype} but {names[0]} has {first.dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    names = list(tensors)
    first = tensors[names[0]]
    for n in names[1:]:
        if tensors[n].device != first.device:
            raise ValueError(f"{n} is on {tensors[n].device} but {names[0]} is on {first.device}")


def check_multiple(name: str, value: int, multiple: int, why: str) -> None:
    if value % multiple:
        raise ValueError(f"{name} = {value} must be a multiple of {multiple} ({why})")
