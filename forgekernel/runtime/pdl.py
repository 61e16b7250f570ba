"""Programmatic dependent launch, the host side (the device convention: kernels/common/sm90/pdl.py).

The decode ops' launchers, and those of the GEMM family (dense, FP8, masked) and the
convolutions (forward, fused data gradient, weight gradient), build their kernels with PDL
(launched with the programmatic-stream-serialization attribute, `griddepcontrol.wait` before
their first global access) unless
FORGEKERNEL_PDL=0, read when a problem's plan is first built, or inside `off()` (the bench's
variant `no_pdl`: both in one process, their plans keyed apart by `forced()`). The compile key
of a kernel built without it carries ("pdl", "off") (`key`); the PDL builds keep the key they
had, so the standard builds are the PDL ones. Without PDL only the decode bench variant's
kernels are prebuilt (`build --candidates`: the leaves' `no_pdl_params`); FORGEKERNEL_PDL=0
elsewhere (the GEMM family and the convolutions included) compiles its kernels at first call
(the DSL needed).

Where the trigger (`launch_dependents`) sits is a compile option of the dense and FP8 GEMMs'
kernel (GemmSm90, `TRIGGERS`) and of the convolutions' (forward, fused data gradient, weight
gradient): "top", every standard build (after the wait, before the role split), or "late",
opt-in (after each CTA's last mainloop; key ("pdl", "late"), built at first use): inside
`late()` their launchers (dense `_choose`, FP8 `_plan`, conv `_choose`, `_choose_fused`,
`_wgrad_plan`) build that form, every other launcher its standard one (docs/gemm/NOTES.md "PDL's
trigger and the partial wave", docs/conv/NOTES.md "The late trigger")."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from forgekernel.runtime.plans import overriding
from forgekernel.runtime.spec import Params

# `off()`'s False or `late()`'s "late" while inside it, else None (the environment decides): in
# the launchers' plan keys
_forced: list[bool | str | None] = [None]
# where a PDL build issues launch_dependents (kernels/gemm/dense/sm90/kernel.py `trigger`)
TRIGGERS = ("top", "late")


def enabled() -> bool:
    """Whether plans built now launch their kernels with PDL: False inside `off()`, True
    inside `late()`, else FORGEKERNEL_PDL ("0" or "1", default "1")."""
    if _forced[0] is not None:
        return _forced[0] is not False
    flag = os.environ.get("FORGEKERNEL_PDL", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"FORGEKERNEL_PDL must be '0' or '1', got {flag!r}")
    return flag == "1"


def forced() -> bool | str | None:
    """`off()`'s or `late()`'s state, for plan keys (a dict lookup a call; the environment is
    read by `enabled` only when a plan is built)."""
    return _forced[0]


@contextmanager
def off() -> Iterator[None]:
    """The calls inside build their plans without PDL (keyed apart from the default ones)."""
    with overriding(_forced, False):
        yield


@contextmanager
def late() -> Iterator[None]:
    """The calls inside build their plans with PDL and, where the kernel takes it (the GEMMs'
    and the convolutions' launchers pass `trigger()` to `key`), the trigger after the mainloop
    (keyed apart)."""
    with overriding(_forced, "late"):
        yield


def trigger() -> str:
    """Where kernels of plans built now trigger their dependents: "late" inside `late()`, else
    "top"."""
    return "late" if _forced[0] == "late" else "top"


def key(params: Params, on: bool, at: str = "top") -> Params:
    """A PDL-capable kernel's compile key: `params` as they are with PDL (`on`) and the trigger
    at the top, with ("pdl", "off") added without PDL, ("pdl", "late") with the trigger `at`
    "late"."""
    if at not in TRIGGERS:
        raise ValueError(f"PDL trigger must be one of {TRIGGERS}, got {at!r}")
    if not on:
        return tuple(sorted((*params, ("pdl", "off"))))
    return params if at == "top" else tuple(sorted((*params, ("pdl", at))))


def built_on(params: dict) -> bool:
    """Whether a compile key (as a dict) builds its kernel for PDL: every key but the ones
    `key` marks ("pdl", "off")."""
    return params.get("pdl") != "off"


def trigger_of(params: dict) -> str:
    """Where a compile key (as a dict) builds its kernel's trigger: "late" for ("pdl", "late"),
    else "top" (a build without PDL has none)."""
    return "late" if params.get("pdl") == "late" else "top"
