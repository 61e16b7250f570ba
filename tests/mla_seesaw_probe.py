"""The seesaw pass's P V accumulator partition (seesaw.py `_setup`'s `mma_pv`, 64 x 256 per
warpgroup) traced on the host: each thread's (row, column) coordinates in `rows_cols` order, as
`MlaSeesawSm90.kernel` builds `o_crd` for `_write_split` (tests/test_mla_seesaw.py replays the
direct epilogue on them). A module of its own: `cute.jit` needs the source."""

from __future__ import annotations

import functools

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.attention.mla.sm90.config import ROWS
from forgekernel.kernels.attention.mla.sm90.seesaw import COLS, MlaSeesawSm90
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import rows_cols


def _collect(found: dict, heads: int, qtokens: int) -> None:
    """(Plain Python, called at trace time: the preprocessor leaves it alone.)"""
    kernel = MlaSeesawSm90(heads, qtokens, direct=True)
    kernel._setup(cutlass.BFloat16)
    for tid in range(THREADS_PER_WG):
        ident = cute.make_identity_tensor((ROWS, COLS))
        crd = rows_cols(kernel.mma_pv.get_slice(tid).partition_C(ident))
        cols = cute.size(crd, mode=[1])
        found[tid] = [[tuple(crd[r, c]) for c in range(cols)] for r in range(2)]


@functools.cache
def output_coords(heads: int, qtokens: int) -> dict[int, list[list[tuple[int, int]]]]:
    """Thread (0 .. 127 of a warpgroup) -> its two rows' [(row, column)] of O's 64 x 256 half.
    Traced once per (heads, qtokens) in a session (~5 s each on CI's CPU; the direct and the
    staged epilogue tests share their configurations): callers only read it."""
    found: dict = {}

    @cute.jit
    def probe():
        _collect(found, heads, qtokens)

    probe()
    return found
