"""Whether a call could be captured in a CUDA graph, told on the CPU: the call runs on meta
tensors (shapes without data: a `.item()`, `.tolist()`, `bool()`, `nonzero`, boolean-mask
indexing, `repeat_interleave` without an output size or `torch.unique` raises there), under the
recorders of scripts/kda_host_ops.py: the aten ops that read a device value back or size their
output by device values, the `Tensor.tolist` / `item` / `__bool__` calls, and the ops that touch
a CPU tensor of one or more dimensions (a host-built table copied to the device, which a
capture rejects as well)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from script_modules import load_script  # tests/ is on the path


def _host_ops():
    return load_script("kda_host_ops")


def meta(*tensors: torch.Tensor | None) -> tuple:
    """The tensors as meta tensors of the same shapes and dtypes (None stays None)."""
    return tuple(None if t is None else t.to("meta") for t in tensors)


def host_traffic(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> dict[str, list[str]]:
    """fn(*args, **kwargs) on meta tensors, recorded: {"syncs": aten ops that read back or size
    by values, "host_reads": tolist / item / __bool__ calls, "on_host": ops on CPU tensors}.
    Anything that needs a device value raises on the meta tensors (the traceback names it)."""
    host = _host_ops()
    reads: list[str] = []
    with host._host_reads(reads), host.HostOps("meta") as mode:
        fn(*args, **kwargs)
    return {"syncs": mode.syncs(), "host_reads": reads, "on_host": mode.on_host}


def assert_capturable(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> None:
    """fn on meta tensors reads nothing back and copies no host table (`host_traffic`)."""
    got = host_traffic(fn, *args, **kwargs)
    assert got == {"syncs": [], "host_reads": [], "on_host": []}, got
