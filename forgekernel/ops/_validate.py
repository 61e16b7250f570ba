"""The one input-validation helper: every op checks its arguments here, before any kernel."""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from numbers import Real

import torch

from forgekernel.runtime.plans import PlanCache

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
    """`check_tensor` (any device) and then the exact shape. Runs on every call: the common
    case is one pass of plain comparisons, the named checks run only to raise their message."""
    shape = tuple(shape)
    if isinstance(t, torch.Tensor) and t.dtype in dtypes and t.shape == shape:
        return
    check_tensor(name, t, ndim=len(shape), dtypes=dtypes, cuda=False)
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def check_cuda(name: str, t: torch.Tensor) -> None:
    if t.device.type != "cuda":
        raise ValueError(f"{name} must be a CUDA tensor, got device {t.device}")


def check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_bools(**flags: object) -> None:
    """`check_bool` of each keyword: a string or an int otherwise reached a custom op's schema,
    or was read by its truthiness."""
    for name, value in flags.items():
        check_bool(name, value)


def check_scale(name: str, value: object, default: float) -> float:
    """A softmax / query scale: None gives `default`; else a real number (not a bool),
    finite and >= 0, as a float."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Real):
        raise TypeError(f"{name} must be a float or None, got {value!r}")
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{name} must be finite and >= 0, got {value}")
    return float(value)


def one_of_two_names(name: str, value: object, alias: str, alias_value: object, default: object):
    """One argument under two keywords (None: not given): the one given, else `default`;
    ValueError when both are given and differ."""
    if value is None:
        return default if alias_value is None else alias_value
    if alias_value is not None and alias_value != value:
        raise ValueError(
            f"{name}={value!r} and {alias}={alias_value!r} name the same argument: give one"
        )
    return value


# Value checks: they read tensors back to the host (a device sync; not under CUDA-graph
# capture), so an op runs them only when its caller asks (`validate=True`).
def check_offsets(name: str, offsets: torch.Tensor, total: int, total_name: str,
                  exact: bool = True) -> None:  # fmt: skip
    """Offsets (n + 1,): start at 0, non-decreasing, end at `total` (exact) or within it."""
    o = offsets.long().cpu()
    if o.numel() and int(o[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {int(o[0])}")
    down = torch.nonzero(o[1:] < o[:-1])
    if down.numel():
        i = int(down[0]) + 1
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {int(o[i])} after {int(o[i - 1])}"
        )
    end = int(o[-1]) if o.numel() else 0
    if end > total or (exact and end != total):
        bound = "at" if exact else "at most"
        raise ValueError(f"{name} must end {bound} {total} ({total_name}), got {end}")


def check_page_values(page_table: torch.Tensor, seqlens_k: torch.Tensor, num_pages: int,
                      page_size: int) -> None:  # fmt: skip
    """Every sequence's length within [0, the table's width x page_size] and every page it
    reads (its first ceil(len / page_size) entries) within [0, num_pages)."""
    table, lens = page_table.long().cpu(), seqlens_k.long().cpu()
    cap = table.shape[1] * page_size
    bad = torch.nonzero((lens < 0) | (lens > cap))
    if bad.numel():
        b = int(bad[0])
        raise ValueError(
            f"seqlens_k[{b}] = {int(lens[b])} is outside [0, {cap}] (page_table's {table.shape[1]}"
            f" pages of {page_size} tokens)"
        )
    used = torch.arange(table.shape[1])[None, :] < (lens[:, None] + page_size - 1) // page_size
    bad = torch.nonzero(used & ((table < 0) | (table >= num_pages)))
    if bad.numel():
        b, j = (int(x) for x in bad[0])
        raise ValueError(
            f"page_table[{b}, {j}] = {int(table[b, j])} is outside [0, {num_pages}) (the cache's"
            f" pages), read by sequence {b} of {int(lens[b])} tokens"
        )


# The two checks below run on every call: each dtype / device read once (0.35 us for three
# tensors on the CPU against 0.51 when read per comparison).
def check_same_dtype(**tensors: torch.Tensor) -> None:
    items = iter(tensors.items())
    first_name, first = next(items)
    dtype = first.dtype
    for n, t in items:
        if t.dtype != dtype:
            raise TypeError(f"{n} has dtype {t.dtype} but {first_name} has {dtype}")


def check_same_device(**tensors: torch.Tensor) -> None:
    items = iter(tensors.items())
    first_name, first = next(items)
    device = first.device
    for n, t in items:
        if t.device != device:
            raise ValueError(f"{n} is on {t.device} but {first_name} is on {device}")


def on_one_device(first: torch.Tensor, *others: torch.Tensor | None) -> bool:
    """Whether every tensor of `others` (None skipped) is on `first`'s device: the one-pass
    form of `check_same_device` (a False goes on to its message)."""
    device = first.device
    for t in others:
        if t is not None and t.device != device:
            return False
    return True


def check_schedule_problem(names: tuple[str, ...], here: tuple, made: tuple) -> None:
    """ValueError naming each of `names` whose value in this call (`here`) differs from the one
    a decode step's schedule was made for (`made`)."""
    if here != made:
        diff = [f"{n} {a} (schedule {w})" for n, a, w in zip(names, here, made) if a != w]
        raise ValueError(f"schedule was made for another problem: {', '.join(diff)}")


def check_rows_in_place(name: str, t: torch.Tensor, stride_multiple: int = 8) -> None:
    """A tensor a kernel reads in place 16 bytes at a time (a cache, never copied): unit last
    stride, every outer stride a multiple of `stride_multiple` elements (what the kernel was
    compiled for), the data 16-byte aligned."""
    # Every call checks two caches: a plain loop, not any() over a generator (0.35 us per
    # tensor on the CPU against 0.6).
    *outer, last = t.stride()
    if last == 1 and t.data_ptr() % 16 == 0:
        for s in outer:
            if s % stride_multiple:
                break
        else:
            return
    raise ValueError(
        f"{name} must have contiguous, 16-byte-aligned rows (strides {tuple(t.stride())},"
        f" data pointer % 16 = {t.data_ptr() % 16})"
    )


# ---------------------------------------------------------------- the remembered checks
# Issue 17 (host time per eager call): a plain eager call (tensors of no subclass, no mode,
# `ops._dispatch.plain` / `tracing`) whose key (its tensors' shapes and dtypes, its other
# arguments with their exact types) passed an op's named checks before passes them again: one
# key and one dict lookup stand for them, the device checks made per call as they make them.
# Only calls that passed are remembered, so a key never stands for a rejected call, and every
# error message is the named checks' own (tests/test_host_overhead.py: one mutation per check).


class PassedChecks(PlanCache):
    """Key of a plain eager call -> what the named checks returned for it."""

    def remember(self, key: Hashable, passed: object) -> None:
        if len(self) >= self.max_entries:
            self.clear()
        self[key] = passed


def arg_key(value: object) -> object:
    """A scalar or shape argument (None, a bool, an int, a float, a str, or a tuple / list /
    torch.Size of ints) as part of a key, with its exact type: True and 1.0 compare equal to 1
    but named checks may reject them; a list and a tuple of ints the checks read alike. An
    unhashable or other argument gives _UNKEYED (the named checks decide every time)."""
    kind = type(value)
    if kind is int or kind is str or kind is bool or kind is float or value is None:
        return (kind, value)
    if kind is tuple or kind is list or kind is torch.Size:
        for v in value:
            if type(v) is not int:
                return _UNKEYED
        return tuple(value)
    return _UNKEYED


_UNKEYED = None


def tensor_key(t: torch.Tensor | None) -> tuple | None:
    """A plain tensor's part of a key (shape, dtype); None for None."""
    return None if t is None else (t.shape, t.dtype)
