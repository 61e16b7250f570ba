"""The fused data gradient's walk over its phases, device side (DSL): which phase, part and M
tile a schedule row names, each k-tile's A and B coordinates, and where a row of the result
lies in dX. The host side of the same arithmetic is geometry.py (`FusedDgrad`, the packed
codes) and config.py (`fused_layout`); emulate.py replays it in torch.

The schedule's M axis, slot by slot (phase by phase, in the order code's order): slot p of
k_p = c_blocks x taps_p k-tiles runs in parts_p = max(1, ceil(k_p / per_split)) parts, each
over `slot_tiles` M tiles of the walk (padded to whole clusters), part after part. A row u of
the axis lies in the last slot whose first row is <= u; part and M tile are (u - first) divmod
slot_tiles. A phase of no tap (k_p = 0) is one part of no k-tile: its tiles are zeros.

K-tile kt of a unit (channel block fastest, then the phase's taps along W, H, D, W's memory
order): channel block cb of the phase's tap (it, ir, is); A (the walk's im2col) reads walk tap
offset + i x offset_step per dim, B (W, whole) W's tap w_tap - i x w_step per dim.

Walk row m (N, Jd, Jh, Jw order; J = ceil(I / stride) per dim, the longest phase's extents) of
phase (ad, ah, aw) is dX[n, ad + sd jd, ah + sh jh, aw + sw jw]: stored when n < N and each
coordinate lies inside dX (a phase one shorter computes one more output per row, never stored).
"""

from __future__ import annotations

import copy

import cutlass
import cutlass.cute as cute
from cutlass import Int32
from cutlass.cutlass_dsl import extract_mlir_values, new_from_mlir_values

MAX_SLOTS = 8  # phases: strides of 1 or 2 along three dims
UNREACHED = 2**30  # the first row of a slot past the last: no row reaches it


def _field(code, shift, bits: int):
    return (code >> shift) & ((1 << bits) - 1)


class PhaseWalk:
    """The fused kernel's tables (geometry.FusedDgrad.kernel_args: per dim the walk code and
    the taps code, the order code) with the problem's counts: `c_blocks` channel blocks of the
    reduction per tap, `per_split` k-tiles per part, `slot_tiles` M tiles per slot and part,
    W's filter (T, R, S) and the walk's. A DSL value (its run-time attributes travel through
    the loops that use it, as the static scheduler's do)."""

    _dynamic = ("codes", "taps", "order", "c_blocks", "per_split", "slot_tiles", "w_trs",
                "walk_trs", "slot_k_tiles", "slot_parts", "slot_first", "slot_div",
                "row_div")  # fmt: skip

    def __extract_mlir_values__(self) -> list:
        return extract_mlir_values(tuple(getattr(self, name) for name in self._dynamic))

    def __new_from_mlir_values__(self, values: list):
        rebuilt = copy.copy(self)
        old = tuple(getattr(self, name) for name in self._dynamic)
        for name, value in zip(self._dynamic, new_from_mlir_values(old, values)):
            setattr(rebuilt, name, value)
        return rebuilt

    def __init__(
        self, codes, taps, order, c_blocks, per_split, slot_tiles, w_trs, walk_trs, dx_dhw
    ):
        self.codes = tuple(Int32(c) for c in codes)
        self.taps = tuple(Int32(t) for t in taps)
        self.order = Int32(order)
        self.c_blocks = Int32(c_blocks)
        self.per_split = Int32(per_split)
        self.slot_tiles = Int32(slot_tiles)
        self.w_trs = tuple(Int32(t) for t in w_trs)
        self.walk_trs = tuple(Int32(t) for t in walk_trs)
        # per slot, computed once on the host (kernel parameters, not registers: the consumers
        # hold a 128 x 256 accumulator): k-tiles, parts, first row of the M axis (past the
        # last slot: never reached)
        self.slot_k_tiles, self.slot_parts, self.slot_first = self._slots()
        # divisors of the per-unit and per-row divisions (multiply-shift, made once on the host)
        self.slot_div = cute.fast_divmod_create_divisor_v2(self.slot_tiles)
        j = tuple((size + self.stride(i) - 1) // self.stride(i) for i, size in enumerate(dx_dhw))
        self.row_div = tuple(
            cute.fast_divmod_create_divisor_v2(Int32(x))
            for x in (j[2], j[2] * j[1], j[2] * j[1] * j[0])
        )

    def _slots(self) -> tuple:
        k_tiles, parts, first = [], [], []
        start = Int32(0)
        for p in range(MAX_SLOTS):
            _, counts, _, _ = self.phase(Int32(p))
            k = self.k_tiles(counts)
            k_tiles.append(k)
            parts.append(self.parts(k))
            used = self.slots() > p
            first.append(Int32(cutlass.select_(used, start, Int32(UNREACHED))))
            start = start + Int32(cutlass.select_(used, parts[-1] * self.slot_tiles, Int32(0)))
        self.total = start
        return tuple(k_tiles), tuple(parts), tuple(first)

    # ------------------------------------------------------------ per dim
    def stride(self, dim: int):
        return _field(self.codes[dim], 0, 4)

    def w_step(self, dim: int):
        return _field(self.codes[dim], 4, 4)

    def offset_step(self, dim: int):
        return _field(self.codes[dim], 8, 8)

    def slots(self):
        """The phases: stride_d x stride_h x stride_w."""
        return self.stride(0) * self.stride(1) * self.stride(2)

    # ------------------------------------------------------------ per phase
    def phase(self, slot) -> tuple:
        """Slot `slot`'s phase (ad, ah, aw) and per dim its taps (count, walk offset, W's
        tap), the taps reversed."""
        code = _field(self.order, slot * 4, 4)
        a = (_field(code, 2, 1), _field(code, 1, 1), _field(code, 0, 1))
        per_dim = tuple(_field(self.taps[i], a[i] * 16, 16) for i in range(3))
        counts = tuple(_field(c, 0, 4) for c in per_dim)
        offsets = tuple(_field(c, 8, 8) for c in per_dim)
        w_taps = tuple(_field(c, 4, 4) for c in per_dim)
        return a, counts, offsets, w_taps

    def k_tiles(self, counts):
        return self.c_blocks * counts[0] * counts[1] * counts[2]

    def parts(self, k_tiles):
        return cutlass.max(Int32(1), (k_tiles + self.per_split - 1) // self.per_split)

    def units_m(self) -> Int32:
        """The schedule's M tiles: every slot's parts x slot_tiles (host side)."""
        return self.total

    @cute.jit
    def unit(self, u: Int32) -> tuple:
        """Schedule row u's (slot, part, M tile, the slot's first row, its parts, first k-tile,
        k-tiles)."""
        slot = Int32(0)
        first = Int32(0)
        k = Int32(0)
        parts = Int32(1)
        for p in cutlass.range_constexpr(MAX_SLOTS):
            if u >= self.slot_first[p]:  # the last slot starting at or before u holds it
                slot = Int32(p)
                first = self.slot_first[p]
                k = self.slot_k_tiles[p]
                parts = self.slot_parts[p]
        part, local = divmod(u - first, self.slot_div)
        k0 = part * self.per_split
        count = cutlass.max(cutlass.min(self.per_split, k - k0), Int32(0))
        return slot, part, local, first, parts, k0, count

    def tap_of(self, kt, counts) -> tuple:
        """K-tile kt of a phase with tap `counts` per dim as (channel block, (it, ir, is))."""
        cb = kt % self.c_blocks
        tap = kt // self.c_blocks
        n_s = cutlass.max(counts[2], Int32(1))  # a phase of no tap walks no k-tile
        n_r = cutlass.max(counts[1], Int32(1))
        return cb, (tap // (n_s * n_r), tap // n_s % n_r, tap % n_s)

    def tiles_of(self, cb, i, offsets, w_taps) -> tuple:
        """(A's k-tile in the walk's (C blocks, S, R, T), B's in W's), each as that mode's
        coordinate (cb, s, r, t), of channel block cb of the phase's tap i = (it, ir, is): a
        coordinate, not a flat k-tile index, so that the producer's TMA coordinates take no
        run-time division per k-tile (kernel.py `_produce`)."""
        walk = tuple(offsets[d] + i[d] * self.offset_step(d) for d in range(3))
        w = tuple(w_taps[d] - i[d] * self.w_step(d) for d in range(3))
        return (cb, walk[2], walk[1], walk[0]), (cb, w[2], w[1], w[0])

    # ------------------------------------------------------------ the result's rows
    def row(self, m, a, mDx):
        """(element offset of dX's row for walk row m of phase a, whether it exists)."""
        n_img, d, h, w, _ = mDx.shape
        per_row, per_plane, per_image = self.row_div
        n, rest = divmod(m, per_image)
        jd, rest = divmod(rest, per_plane)
        jh, jw = divmod(rest, per_row)
        crd = (a[0] + self.stride(0) * jd, a[1] + self.stride(1) * jh, a[2] + self.stride(2) * jw)
        inside = (n < n_img) & (crd[0] < d) & (crd[1] < h) & (crd[2] < w)
        s_n, s_d, s_h, s_w, _ = mDx.layout.stride
        offset = n * s_n + crd[0] * s_d + crd[1] * s_h + crd[2] * s_w
        return offset, inside
