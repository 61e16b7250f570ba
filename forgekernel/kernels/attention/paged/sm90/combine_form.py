"""Which form of the split-KV combine a launch takes (DSL-free: the paged, MLA and DSA
launchers read it). The CTA form (`combine.PagedCombineSm90`, one CTA a (row, head), its
threads spread over the splits and columns) for few rows; the warp form
(`combine.PagedCombineWarpsSm90`, one warp a (row, head)) where the rows x heads fill the GPU
with warps alone: b16-h128 at D 512 is 2048 units, whose CTA-form combine (three CTA-wide
reductions and two barriers a column chunk, for 4 splits) took the MLA call from 49.0 to 55.8 us
when it replaced the per-row loop (2026-12-03 18:45; MLA_NOTES "The combine's warp form")."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from forgekernel.runtime import pdl
from forgekernel.runtime.plans import overriding

WARPS_FORM_UNITS = 1024  # rows x heads: 8 warps an SM's worth over 132 SMs
WARP_COLS = 128  # columns a warp covers with one 16-byte vector a lane
# Head dims of the CTA form's few-splits path (combine.py `_few`: D >= WARPS x COLS, MLA's and
# DSA's 512) take the warp form from FEW_FORM_UNITS: with that path the CTA form ran faster
# than the warp form below 2048-4096 units at 2-8 splits (scripts/probe_combine_forms.py, H200
# 2026-12-04 17:22) and the bench's combine_cta / ours was 0.973 at b64-h16-L4096 (1024 units),
# 0.996 / 0.995 at b16-h128 L4096 / L8192 (2048; 20:21); at 32+ splits it wins at any count
FEW_PATH_DIM = 512
FEW_FORM_UNITS = 4096

# combine_form's override ("cta" / "warps"), None: `takes_warps`' rule; read when a problem's
# plan is built and in the plans' keys (the launchers' `forced`)
_forced: list[str | None] = [None]


@contextmanager
def combine_form(form: str | None) -> Iterator[None]:
    """The calls inside take the combine's `form` ("cta" or "warps"; None: the rule) where it
    applies (the warp form: head dims that are multiples of 128): the bench's variants."""
    if form not in (None, "cta", "warps"):
        raise ValueError(f"form must be 'cta', 'warps' or None, got {form!r}")
    with overriding(_forced, form):
        yield


def forced() -> str | None:
    """combine_form's override now (for the plans' keys)."""
    return _forced[0]


def takes_warps(units: int, head_dim: int) -> bool:
    """Whether a combine of `units` (rows x heads, a bound) at `head_dim` takes the warp form."""
    if head_dim % WARP_COLS:
        return False
    if _forced[0] is not None:
        return _forced[0] == "warps"
    return units >= (FEW_FORM_UNITS if head_dim >= FEW_PATH_DIM else WARPS_FORM_UNITS)


def forced_key() -> tuple:
    """What forces a decode plan's kernels beside its shape, for the plans' keys (the paged and
    MLA launchers' `forced`): `pdl.forced()` and combine_form's override."""
    return pdl.forced(), _forced[0]
