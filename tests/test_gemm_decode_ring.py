"""A's compact shared-memory ring of the decode configurations (kernel.py `_compact_ring`),
on the CPU: the kernel's own layouts (its `_setup` traced on the host) evaluated for every
row, column and stage. The rows TMA writes (a_rows per stage) are where WGMMA reads them, no
two stages' loaded rows share an address, every stage starts on a whole 1 KB swizzle atom,
WGMMA's tile_m rows from the last stage stay inside the buffer, and the ring with B's and the
epilogue's fits in shared memory with more stages than the full-height ring had."""

from __future__ import annotations

import itertools

import pytest

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
from forgekernel.kernels.gemm.dense.sm90 import config as dense
from forgekernel.kernels.gemm.dense.sm90 import masked_config
from forgekernel.kernels.gemm.fp8.sm90 import config as fp8

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass.tensor_utils import LayoutEnum  # noqa: E402

from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90  # noqa: E402

CASES = [
    *((c, "bf16") for c in (*dense.DECODE, *dense.DECODE_STREAM, dense.SKINNY_64)),
    *((c, "fp8") for c in (*fp8.DECODE, *fp8.STREAM_DECODE)),
    *((c, "fp8") for c in masked_config.DECODE),
]


def _flat(t):
    return (
        tuple(itertools.chain.from_iterable(_flat(x) for x in t)) if isinstance(t, tuple) else (t,)
    )


def _offset(layout, coord):
    """Offset (elements, before the swizzle) of `coord` (one int per top mode) in a layout
    given as (shape, stride) nested tuples: each top mode's index spread colexicographically
    over its sub-modes."""
    shape, stride = layout
    off = 0
    for idx, sh, st in zip(coord, shape, stride, strict=True):
        for s, d in zip(_flat(sh), _flat(st), strict=True):
            off += (idx % s) * d
            idx //= s
    return off


def _kernel_layouts(cfg, kind):
    """(stages, A's ring, A's load layout, cosizes of A and B, element bytes) as `_setup`
    builds them for a bf16 or FP8 problem, B K-major."""
    got = {}

    @cute.jit
    def trace():
        g = GemmSm90(cfg)
        g.a_dtype = g.b_dtype = cutlass.BFloat16 if kind == "bf16" else cutlass.Float8E4M3FN
        g.c_dtype = cutlass.BFloat16
        g.a_major = g.b_major = g.c_major = LayoutEnum.ROW_MAJOR
        g._setup()
        got["stages"] = g.stages
        got["ring"] = (g.sA_layout.outer.shape, g.sA_layout.outer.stride)
        got["load"] = (g.sA_load_layout.outer.shape, g.sA_load_layout.outer.stride)
        got["cosize_a"] = cute.cosize(g.sA_layout)
        got["cosize_b"] = cute.cosize(g.sB_layout)
        got["cosize_c"] = cute.cosize(g.sC_layout)

    trace()
    return got, 2 if kind == "bf16" else 1


@pytest.mark.parametrize(("cfg", "kind"), CASES, ids=[f"{c.tag()}-{k}" for c, k in CASES])
def test_compact_ring(cfg, kind):
    got, width = _kernel_layouts(cfg, kind)
    stages, ring, load = got["stages"], got["ring"], got["load"]
    rows, tile_m, tile_k = cfg.a_rows or cfg.tile_m, cfg.tile_m, cfg.tile_k
    assert tile_k * width == 128  # 128-byte rows: 8 rows make one 1 KB swizzle atom
    loaded = set()
    for s in range(stages):
        assert _offset(ring, (0, 0, s)) * width % 1024 == 0
        for r, k in itertools.product(range(rows), range(tile_k)):
            off = _offset(ring, (r, k, s))
            assert _offset(load, (r, k, s)) == off  # TMA writes where WGMMA reads
            loaded.add(off)
    assert len(loaded) == stages * rows * tile_k  # no two stages' loaded rows overlap
    top = max(_offset(ring, (r, tile_k - 1, stages - 1)) for r in range(tile_m))
    assert top < got["cosize_a"] == (stages - 1) * rows * tile_k + tile_m * tile_k
    used = 1024 + (got["cosize_a"] + got["cosize_b"]) * width + got["cosize_c"] * 2
    assert used <= SMEM_CAPACITY
    full_height = (SMEM_CAPACITY - 1024 - got["cosize_c"] * 2) // ((tile_m + cfg.tile_n) * 128)
    if cfg.stages:  # a count set in config.py (the tiled decode tiles: 13, measured faster)
        assert stages == cfg.stages
    else:
        assert stages >= full_height + (rows < tile_m)  # the short box buys stages
