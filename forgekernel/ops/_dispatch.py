"""Eager calls skip the dispatcher; traced calls go through the op's custom op."""

from __future__ import annotations

import torch
from torch.utils._python_dispatch import _get_current_dispatch_mode as _current_dispatch_mode


def traced(*tensors: torch.Tensor | None) -> bool:
    """Under torch.compile, a dispatch mode (make_fx, export) or tensor subclasses (fake,
    functional), go through the custom op; plain eager tensors skip the dispatcher."""
    return (
        torch.compiler.is_compiling()
        or _current_dispatch_mode() is not None
        or any(t is not None and type(t) is not torch.Tensor for t in tensors)
    )


def wants_grad(*tensors: torch.Tensor | None) -> bool:
    """Autograd would record this call: such calls go through the custom op, so that a
    backward without a registered formula fails loudly instead of silently stopping."""
    return torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
