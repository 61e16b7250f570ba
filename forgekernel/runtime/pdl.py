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
opt-in (after each CTA's last mainloop; key ("pdl", "late"), built at first use unless a rule
below makes it standard): inside `late()` their launchers (dense `_choose`, FP8 `_plan`, conv
`_choose`, `_choose_fused`, `_wgrad_plan`) build that form, every other launcher its standard
one (docs/gemm/NOTES.md "PDL's trigger and the partial wave", docs/conv/NOTES.md "The late
trigger"); inside `top()` they build the top form whatever the rule.

The partial-wave rule (`PARTIAL_WAVE`, docs/gemm/NOTES.md "Adopting a partial-wave rule"): the
dense and FP8 launchers count the CTAs of the grid they launch and take `form(ctas, sms)`: "top",
"late" or "off" for a grid in the rule's band. With a rule adopted, the band forms of every
standard config the band can reach are standard builds (the specs' `standard_params`, through
`band_form` and `reaches`); with none (`PARTIAL_WAVE` None, the default) every grid is "top" and
the standard builds are today's. The convolutions take no rule (their own kernels' losses need
the late trigger in the kernel)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

from forgekernel.runtime.plans import overriding
from forgekernel.runtime.spec import Params

# `off()`'s False, `late()`'s "late" or `top()`'s "top" while inside it, else None (the
# environment and the partial-wave rule decide): in the launchers' plan keys
_forced: list[bool | str | None] = [None]
# where a PDL build issues launch_dependents (kernels/gemm/dense/sm90/kernel.py `trigger`)
TRIGGERS = ("top", "late")
FORMS = (*TRIGGERS, "off")
# The adopted partial-wave rule: None (every grid "top": rule 4, today's), or (form, low, high):
# the dense and FP8 GEMMs' grids of low < CTAs <= high on a `BAND_SMS`-SM chip (scaled to the
# chip's SMs) built in `form`: ("late", 66, 104) is the NOTES' rule 2, ("off", 66, 104) rule 3
# (the upper edge the probe's); ("late", 0, BAND_SMS) the late trigger on every grid (rule 1
# without the kernel's default moved: every config's late build standard). Adopted: rule 2 up
# to 112 CTAs, the wave probe's verdict for bf16 and FP8 on the H100 2026-12-05 14:24
# (scripts/pdl_apply_rule.py; docs/gemm/NOTES.md "Measured 2026-12-05 14:23-14:44").
PARTIAL_WAVE: tuple[str, int, int] | None = ("late", 66, 112)
BAND_SMS = 132  # the H200 / H100 SXM, where the band was measured


def enabled() -> bool:
    """Whether plans built now launch their kernels with PDL: False inside `off()`, True
    inside `late()` and `top()`, else FORGEKERNEL_PDL ("0" or "1", default "1")."""
    if _forced[0] is not None:
        return _forced[0] is not False
    flag = os.environ.get("FORGEKERNEL_PDL", "1")
    if flag not in ("0", "1"):
        raise ValueError(f"FORGEKERNEL_PDL must be '0' or '1', got {flag!r}")
    return flag == "1"


def forced() -> bool | str | None:
    """`off()`'s, `late()`'s or `top()`'s state, for plan keys (a dict lookup a call; the
    environment is read by `enabled` only when a plan is built)."""
    return _forced[0]


@contextmanager
def off() -> Iterator[None]:
    """The calls inside build their plans without PDL (keyed apart from the default ones)."""
    with overriding(_forced, False):
        yield


@contextmanager
def top() -> Iterator[None]:
    """The calls inside build their plans with PDL and the trigger at the top on every grid,
    whatever the partial-wave rule says (keyed apart): the probe's "top" form once a rule is
    adopted (scripts/pdl_wave_probe.py)."""
    with overriding(_forced, "top"):
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


def form_for(ctas: int, sms: int) -> str:
    """The rule's form of a grid of `ctas` CTAs on `sms` SMs: `PARTIAL_WAVE`'s form where
    low < ctas <= high (the edges scaled from `BAND_SMS` SMs to `sms`, in integers), else
    "top"."""
    if PARTIAL_WAVE is None:
        return "top"
    form_, low, high = PARTIAL_WAVE
    if form_ not in FORMS[1:]:
        raise ValueError(f"PARTIAL_WAVE's form must be 'late' or 'off', got {form_!r}")
    inside = low * sms < ctas * BAND_SMS <= high * sms
    return form_ if inside else "top"


def form(ctas: int, sms: int) -> str:
    """The form of a dense or FP8 GEMM kernel built now for a grid of `ctas` CTAs on `sms`
    SMs: "off" where PDL is off (`enabled()` False: FORGEKERNEL_PDL=0, `off()`), "late"
    inside `late()`, "top" inside `top()`, else the rule's (`form_for`)."""
    if not enabled():
        return "off"
    return _forced[0] if _forced[0] in TRIGGERS else form_for(ctas, sms)


def key_for(params: Params, form_: str) -> Params:
    """`key` of a kernel built in `form_` ("top", "late" or "off")."""
    if form_ not in FORMS:
        raise ValueError(f"PDL form must be one of {FORMS}, got {form_!r}")
    return key(params, form_ != "off", "top" if form_ == "off" else form_)


def band_form() -> str | None:
    """The adopted rule's form ("late" or "off"), None without a rule: what the specs' standard
    builds add for the configs whose grids the band `reaches`."""
    return PARTIAL_WAVE[0] if PARTIAL_WAVE else None


def reaches(fewest: int, most: int, step: int, sms: int = BAND_SMS) -> bool:
    """Whether a kernel launched on fewest, fewest + step, ..., most CTAs (its cluster's size
    the step) has a grid that the rule builds in its band form on `sms` SMs."""
    return any(form_for(c, sms) != "top" for c in range(fewest, most + 1, step))
