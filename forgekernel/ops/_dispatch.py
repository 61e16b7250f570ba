"""Eager calls skip the dispatcher; traced calls go through the op's custom op."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode

# Tensor types an eager call hands to the kernel as they are: nn.Parameter is a plain tensor
# for every purpose here (no __torch_dispatch__, its __torch_function__ disabled). Counting it
# as traced sent every call with a weight through the dispatcher (62 us per gemm call on the
# CPU with a kernel stub, under no_grad).
_PLAIN = (torch.Tensor, torch.nn.Parameter)


def traced(*tensors: torch.Tensor | None) -> bool:
    """Under torch.compile, a dispatch mode (make_fx, export) or tensor subclasses (fake,
    functional), go through the custom op; plain eager tensors skip the dispatcher."""
    if torch.compiler.is_compiling() or _current_dispatch_mode() is not None:
        return True
    for t in tensors:
        if t is not None and type(t) not in _PLAIN:
            return True
    return False


def tracing() -> bool:
    """torch.compile or a dispatch mode (make_fx, export) is recording this call: `traced`
    for a call whose tensors `plain` has passed."""
    return torch.compiler.is_compiling() or _current_dispatch_mode() is not None


def plain(*tensors: object, optional: tuple = ()) -> bool:
    """Every argument a plain eager tensor (no subclass, no other type, no None), and each of
    `optional` one or None: what the ops' one-pass checks of the common eager call require
    before they read any metadata."""
    for t in tensors:
        if type(t) not in _PLAIN:
            return False
    for t in optional:
        if t is not None and type(t) not in _PLAIN:
            return False
    return True


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd would record this call: such calls go through the custom op, so that a
    backward without a registered formula fails loudly instead of silently stopping."""
    if not torch.is_grad_enabled():
        return False
    for t in tensors:
        if t is not None and t.requires_grad:
            return True
    return False


def into_buffers(o, lse, out, lse_out):
    """A custom op's fresh (o, lse) copied into the caller's out / lse buffers where given (the
    traced path of an op that writes them in place when eager)."""
    if out is not None:
        out.copy_(o)
        o = out
    if lse_out is not None:
        lse_out.copy_(lse)
        lse = lse_out
    return o, lse


def capturing(t: torch.Tensor) -> bool:
    """Whether t's device stream is capturing a CUDA graph (nothing may be read back)."""
    return t.is_cuda and torch.cuda.is_current_stream_capturing()


def refuse_capture(what: str, t: torch.Tensor) -> None:
    """Raise before any CUDA work when t's stream captures a CUDA graph, for a path that must
    read device data on the host (`what` says which). The driver rejects that read while the
    stream captures and the capture is then invalidated: torch before 2.12 (pytorch#180395)
    skips `endAllocateToPool` after it, leaving the caching allocator routing to the dead
    graph's pool for the rest of the process. Raised here, the capture ends cleanly (empty) and
    a caller such as the bench's timing falls back to eager launches."""
    if capturing(t):
        raise RuntimeError(f"{what}: it cannot be captured in a CUDA graph")


def switch_on(env: str) -> bool:
    """An op's on / off environment switch: unset, "" or "1" on, "0" off; any other value
    raises ValueError naming the variable."""
    value = os.environ.get(env, "")
    if value not in ("", "0", "1"):
        raise ValueError(f"{env} must be '0' or '1', got {value!r}")
    return value != "0"


class KernelSwitch:
    """An op's kernel path switch: the environment variable `env` (`switch_on`), and `off()`,
    a context inside which the op takes its other path whatever the variable says (the bench's
    variant of that path)."""

    def __init__(self, env: str) -> None:
        self.env = env
        self._off = False

    def selected(self) -> bool:
        return not self._off and switch_on(self.env)

    @contextmanager
    def off(self) -> Iterator[None]:
        saved, self._off = self._off, True
        try:
            yield
        finally:
            self._off = saved
