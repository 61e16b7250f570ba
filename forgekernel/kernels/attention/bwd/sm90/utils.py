"""What only the backward needs besides the Hopper toolkit (`kernels/common/sm90`): the dQ tiled
MMA, whose accumulator order is the dQ workspace's order, the offset of each accumulator
element in that order (the main kernel stages dQ in it, the postprocess reads it back), and
the views of the backward's tensors and workspaces that its kernels share."""

from __future__ import annotations

import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, Int32
from cutlass.cute.nvgpu import OperandMajorMode

from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.layout import select


def make_dq_mma(dtype, tile_m: int, head_dim: int) -> cute.TiledMma:
    """dQ (tile_m, D) = dS (tile_m, tile_n) K (tile_n, D), both operands MN-major in shared
    memory, over two warpgroups: split along rows for tile_m = 128, along D for tile_m = 64.
    The postprocess kernel rebuilds it to read the workspace in the same order."""
    mn = OperandMajorMode.MN
    if tile_m == 128:
        atoms, inst_n = (2, 1, 1), head_dim
    elif tile_m == 64:
        atoms, inst_n = (1, 2, 1), head_dim // 2
    else:
        raise ValueError(f"tile_m must be 64 or 128, got {tile_m}")
    return sm90_utils.make_trivial_tiled_mma(dtype, dtype, mn, mn, Float32, atoms, (64, inst_n))


DQ_VEC = 4  # fp32 dQ elements a thread stages with one (16-byte) shared-memory store


def dq_frag_offset(thread: Int32, i: int, per_thread: int, halves: bool) -> Int32:
    """Word offset inside one (tile_m, D) fp32 dQ tile of element i of consumer thread
    `thread`'s accumulator (per_thread elements each, 256 threads): runs of DQ_VEC consecutive
    elements of all threads, so that 16-byte shared-memory stores are conflict-free and the
    postprocess reads coalesced. `halves` (the dq_split main kernels): each warpgroup's
    elements fill one contiguous half of the tile instead (reduced into global memory on
    its own), inside it runs of DQ_VEC elements of the warpgroup's threads."""
    if not halves:
        return ((i // DQ_VEC) * 2 * THREADS_PER_WG + thread) * DQ_VEC + (i % DQ_VEC)
    wg, lane = thread // THREADS_PER_WG, thread % THREADS_PER_WG
    return (
        wg * (THREADS_PER_WG * per_thread)
        + ((i // DQ_VEC) * THREADS_PER_WG + lane) * DQ_VEC
        + (i % DQ_VEC)
    )


def s_d_h_b(t: cute.Tensor) -> cute.Tensor:
    """(B, S, H, D) as (S, D, H, B): TMA boxes over (S, D), coordinates for head and batch."""
    return select(t, [1, 3, 2, 0])


def unit_batch(t: cute.Tensor) -> cute.Tensor:
    """A varlen (H, rows) workspace as (1, H, rows): the fixed-length (B, H, rows) view with one
    batch (sequences are row offsets into it)."""
    return cute.make_tensor(
        t.iterator,
        cute.make_layout((1, t.shape[0], t.shape[1]), stride=(0, t.stride[0], t.stride[1])),
    )
