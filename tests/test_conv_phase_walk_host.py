"""The fused data gradient's device-side walk (kernels/conv/sm90/phase_walk.py `PhaseWalk`)
executed as DSL code on the host, against the CPU model (emulate.py) that the other fused tests
check against autograd.

test_conv_dgrad_fused.py checks emulate.py's torch re-statement of the walk; the kernel runs
phase_walk.py's DSL code instead (the packed-table decode, the per-slot tables made once, the
multiply-shift divisions, the (slot, part, M tile) lookup, the k-tile coordinates and the row
addresses). A `@cute.jit` function without a kernel launch runs on the CPU, so here that code
itself computes, for every schedule row u: `PhaseWalk.unit(u)`, each k-tile's (A, B)
coordinates walked with the producer's odometer (dgrad_kernel.py `_produce`, restated below),
and `PhaseWalk.row` for every row of the unit's M tile into a channel slice of a wider dX; the
model's unit table, k-tiles and row coordinates must match exactly, and the schedule's length
must be the host plan's (the split workspace is sized by it)."""

from __future__ import annotations

import math
import os
import random

import pytest
import torch

pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from forgekernel.kernels.conv.sm90 import emulate  # noqa: E402
from forgekernel.kernels.conv.sm90.config import K_TILE, ConvConfig  # noqa: E402
from forgekernel.kernels.conv.sm90.dgrad_config import fused_plan  # noqa: E402
from forgekernel.kernels.conv.sm90.geometry import Geometry, fused_dgrad  # noqa: E402
from forgekernel.kernels.conv.sm90.phase_walk import PhaseWalk  # noqa: E402

UNIT_FIELDS = 7  # slot, part, M tile, the slot's first row, its parts, first k-tile, k-tiles


@cute.jit
def _walk_tables(
    mDx: cute.Tensor,
    units_out: cute.Tensor,
    k_out: cute.Tensor,
    rows_out: cute.Tensor,
    codes: tuple,
    taps: tuple,
    order: Int32,
    counts: tuple,
    w_trs: tuple,
    tile_m: cutlass.Constexpr,
):
    """Host-side run of the kernel's walk: units_out[u] the unit (and units_out[0, 7] the
    schedule's M rows), k_out[u, i] the (A, B) k-tile of the unit's i-th k-tile, rows_out[u, r]
    (dX element offset, inside) of the unit's tile row r. `counts`: (channel blocks, k-tiles a
    part, M tiles a slot)."""
    c_blocks, per_split, slot_tiles = counts
    walk_trs = tuple((c >> 16) & 0xFF for c in codes)
    dx_dhw = (mDx.shape[1], mDx.shape[2], mDx.shape[3])
    walk = PhaseWalk(codes, taps, order, c_blocks, per_split, slot_tiles, w_trs, walk_trs, dx_dhw)
    units_out[0, UNIT_FIELDS] = walk.units_m()
    for u in range(walk.units_m()):
        unit = walk.unit(u)
        for f in cutlass.range_constexpr(UNIT_FIELDS):
            units_out[u, f] = unit[f]
        slot, _, local, _, _, k0, count = unit
        a, tap_counts, offsets, w_taps = walk.phase(slot)
        # dgrad_kernel.py `_produce`: channel block fastest, then the taps along W, H, D
        cb, tap = walk.tap_of(k0, tap_counts)
        it, ir, is_ = tap
        for i in range(count):
            crd_a, crd_b = walk.tiles_of(cb, (it, ir, is_), offsets, w_taps)
            # the coordinates (cb, s, r, t) as flat k-tiles of (C blocks, S, R, T)
            for side, (cb_, s_, r_, t_), trs in ((0, crd_a, walk.walk_trs), (1, crd_b, walk.w_trs)):
                k_out[u, i, side] = cb_ + walk.c_blocks * (s_ + trs[2] * (r_ + trs[1] * t_))
            cb += 1
            if cb == walk.c_blocks:
                cb = Int32(0)
                is_ += 1
                if is_ == tap_counts[2]:
                    is_ = Int32(0)
                    ir += 1
                    if ir == tap_counts[1]:
                        ir = Int32(0)
                        it += 1
        for r in range(tile_m):
            offset, inside = walk.row(local * tile_m + r, a, mDx)
            rows_out[u, r, 0] = offset
            rows_out[u, r, 1] = cutlass.Int64(inside)


def _dynamic(t: torch.Tensor):
    return from_dlpack(t).mark_layout_dynamic()


def _walk_matches_the_model(size, g: Geometry, cfg: ConvConfig, per_split, n_img=2, k_red=136):
    """Run the kernel's walk for dX (n_img, size, 24 of 32 channels) and compare it with the
    model unit by unit."""
    out = g.output(size)
    fused = fused_dgrad(g, size, out)
    args = fused.kernel_args()
    t = emulate.unpack_fused(args)
    c_blocks = -(-k_red // K_TILE)
    j = tuple(-(-s // st) for s, st in zip(size, fused.stride))
    m_rows = n_img * math.prod(j)
    slot_tiles, slots = emulate.fused_units(cfg, m_rows, c_blocks, per_split, t)
    units_m = sum(parts * slot_tiles for _, _, parts, _ in slots)
    k_tiles = tuple(k for _, k, _, _ in slots)
    assert units_m == fused_plan(cfg, m_rows, 24, k_tiles, per_split).units_m
    wide = torch.zeros(n_img, *size, 32, dtype=torch.float16)
    dx = wide[..., :24]
    units = torch.full((units_m, UNIT_FIELDS + 1), -1, dtype=torch.int32)
    kts = torch.full((units_m, max(max(k_tiles), 1), 2), -1, dtype=torch.int32)
    rows = torch.full((units_m, cfg.tile_m, 2), -1, dtype=torch.int64)
    counts = (c_blocks, per_split, slot_tiles)
    tables = (_dynamic(dx), _dynamic(units), _dynamic(kts), _dynamic(rows))
    _walk_tables(*tables, args[6:9], args[9:12], args[12], counts, g.filter, cfg.tile_m)

    assert int(units[0, UNIT_FIELDS]) == units_m
    strides = torch.tensor(dx.stride()[:4])
    walk = t["walk"]
    for u in range(units_m):
        slot = max(i for i, s in enumerate(slots) if s[3] <= u)
        phase, k, parts, first = slots[slot]
        part, local = divmod(u - first, slot_tiles)
        k0 = part * per_split
        count = max(min(per_split, k - k0), 0)
        assert units[u, :UNIT_FIELDS].tolist() == [slot, part, local, first, parts, k0, count]
        (nt, ot, ft), (nr, orr, fr), (ns, os_, fs) = t["taps"][phase]
        steps, w_steps = t["offset_step"], t["w_step"]
        for i, kt in enumerate(range(k0, k0 + count)):
            cb, (it, ir, is_) = emulate.k_tile_coords(kt, c_blocks, (nt, nr, ns))
            tap = (ot + it * steps[0], orr + ir * steps[1], os_ + is_ * steps[2])
            w_tap = (ft - it * w_steps[0], fr - ir * w_steps[1], fs - is_ * w_steps[2])
            a = cb + c_blocks * (tap[2] + walk.filter[2] * (tap[1] + walk.filter[1] * tap[0]))
            b = cb + c_blocks * (w_tap[2] + g.filter[2] * (w_tap[1] + g.filter[1] * w_tap[0]))
            assert kts[u, i].tolist() == [a, b], (u, i)
        coords, valid = emulate._phase_rows(
            dx.shape, local * cfg.tile_m, cfg.tile_m, j, phase, t["stride"]
        )
        offsets = sum(crd * s for crd, s in zip(coords, strides))
        assert torch.equal(rows[u, :, 1].bool(), valid), u
        assert torch.equal(rows[u, :, 0][valid], offsets[valid]), u


def _geometry(f, pad, stride, dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), tuple(stride), tuple(dil))


TILES_64 = ConvConfig(tile_m=64, tile_n=64)
TILES_128 = ConvConfig(tile_n=128)
CASES = [
    ((1, 13, 11), _geometry((1, 3, 3), (0, 1, 1), (1, 2, 2))),  # odd: phases one row short
    ((1, 10, 9), _geometry((1, 2, 2), (0, 0, 0), (1, 2, 2))),  # the walk's upper corner 1
    ((1, 11, 12), _geometry((1, 5, 5), (0, 2, 2), (1, 2, 2))),  # the walk's lower corner -1
    ((1, 13, 11), _geometry((1, 7, 7), (0, 3, 3), (1, 2, 2), (1, 2, 1))),  # dilation
    ((1, 9, 8), _geometry((1, 3, 3), (0, 1, 1), (1, 2, 1))),  # stride 2 along H only
    ((5, 7, 6), _geometry((3, 3, 3), (1, 1, 1), (2, 2, 2))),  # eight phases
    ((5, 7, 6), _geometry((1, 1, 1), (0, 0, 0), (2, 2, 2))),  # seven phases of no tap
    ((4, 9, 8), _geometry((2, 4, 3), (0, 1, 1), (2, 2, 2), (1, 1, 2))),
]


@pytest.mark.parametrize("per_split", [1, 3, 1000])
@pytest.mark.parametrize("cfg", [TILES_64, ConvConfig(tile_m=64, tile_n=64, cluster_m=2)])
@pytest.mark.parametrize("case", range(len(CASES)), ids=lambda i: "x".join(map(str, CASES[i][0])))
def test_the_kernels_walk_is_the_models(case, cfg, per_split):
    """Every unit, k-tile and row of the kernel's walk as the model has them; 64-row tiles,
    alone and in 2x1 clusters (a padded tile past the batch), unsplit and split phases."""
    size, g = CASES[case]
    _walk_matches_the_model(size, g, cfg, per_split)


def _random_strided(count: int, seed: int):
    """(input DHW, Geometry) with strides 1 or 2 (not all 1), kernels 1..7, dilation 1..3,
    padding 0..4 below and above (negative walk padding: dY cropped by the launcher)."""
    rng = random.Random(seed)
    out = []
    while len(out) < count:
        flat = rng.random() < 0.5
        f = [1 if flat and i == 0 else rng.randint(1, 7 if i else 3) for i in range(3)]
        dil = [1 if f[i] == 1 else rng.randint(1, 3) for i in range(3)]
        lo = [0 if flat and i == 0 else rng.randint(0, 4) for i in range(3)]
        hi = [0 if flat and i == 0 else rng.randint(0, 4) for i in range(3)]
        stride = [1 if flat and i == 0 else rng.randint(1, 2) for i in range(3)]
        size = tuple(1 if flat and i == 0 else rng.randint(1, 12) for i in range(3))
        g = _geometry(f, lo, stride, dil, hi)
        if min(g.output(size)) > 0 and max(stride) == 2 and g.descriptor_problem() is None:
            if fused_dgrad(g, size, g.output(size)).walk.descriptor_problem() is None:
                out.append((size, g))
    return out


@pytest.mark.parametrize("size, g", _random_strided(12, seed=7))
def test_random_walks(size, g):
    """Random strided geometries, 128-row tiles, the phases split in parts of 2 k-tiles."""
    _walk_matches_the_model(size, g, TILES_128, 2, n_img=3, k_red=72)
