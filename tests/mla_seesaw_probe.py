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


def _setup(heads: int, qtokens: int) -> MlaSeesawSm90:
    kernel = MlaSeesawSm90(heads, qtokens, direct=True)
    kernel._setup(cutlass.BFloat16)
    return kernel


def _collect(found: dict, heads: int, qtokens: int) -> None:
    """(Plain Python, called at trace time: the preprocessor leaves it alone.)"""
    mma_pv = _setup(heads, qtokens).mma_pv
    for tid in range(THREADS_PER_WG):
        ident = cute.make_identity_tensor((ROWS, COLS))
        crd = rows_cols(mma_pv.get_slice(tid).partition_C(ident))
        cols = cute.size(crd, mode=[1])
        found[tid] = [[tuple(crd[r, c]) for c in range(cols)] for r in range(2)]


def _trace(collect, *args) -> None:
    @cute.jit
    def probe():
        collect(*args)

    probe()


# The coordinates by the text of the tiled MMA they come from (thread layout, permutation, the
# atom's shape and TV layouts: all that `partition_C` reads).
_BY_MMA: dict[str, dict[int, list[list[tuple[int, int]]]]] = {}


@functools.cache
def output_coords(heads: int, qtokens: int) -> dict[int, list[list[tuple[int, int]]]]:
    """Thread (0 .. 127 of a warpgroup) -> its two rows' [(row, column)] of O's 64 x 256 half.
    Traced once per distinct P V tiled MMA in a process, not per (heads, qtokens): a trace is
    ~5 s on CI's CPU (16,384 coordinates), reading the MMA's text 0.1 s, and today every
    configuration shares one MMA (17 (heads, qtokens) uses in test_mla_seesaw / test_mla_ostore,
    9 distinct: 45 s of traces before). A configuration whose MMA differs is traced on its own.
    Callers only read it."""
    text: list[str] = []
    _trace(lambda: text.append(str(_setup(heads, qtokens).mma_pv)))
    found = _BY_MMA.get(text[0])
    if found is None:
        found = _BY_MMA[text[0]] = {}
        _trace(_collect, found, heads, qtokens)
    return found
