"""The stem's fold (stem.py `fold_input`) as one kernel: x (N, H, W, C) 16-bit channels-last
into the folded image (N, Hs, Ws, 2 x half), zero fill included, one pass (read x once, write
the fold once: 23 MB at the ResNet stem, against torch's fill and strided copy).

One thread a folded pixel (i, j) of image n (flat index, j fastest: a warp writes 32 adjacent
pixels, 1-2 KB contiguous): channel a x half + b x C + c is padded x's (2i + a, 2j + b, c), x
row h = 2i + a - off_h, column w = 2j + b - off_w (off = padding below + shift, even), zero
outside x and past 2C in each block row. C and half are compile-time (the register indices of
the pixel's fragment are static: no local memory); the 4C loads are 16-bit, predicated on the
block row's bounds; the pixel goes out as 16-byte stores (the fold's rows are 32 or 64 bytes,
16-byte aligned)."""

from __future__ import annotations

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute

THREADS = 128


class StemFoldSm90:
    """The fold of `channels` (1-8) input channels into pixels of 2 x `half` channels (half 8
    for C <= 4, 16 for C <= 8); see the module docstring."""

    def __init__(self, channels: int, half: int):
        if not 1 <= channels <= half // 2:
            raise ValueError(f"{channels} channels do not fold into block rows of {half}")
        self.c = channels
        self.half = half

    @cute.jit
    def __call__(
        self,
        mX: cute.Tensor,
        mF: cute.Tensor,
        off_h: cutlass.Int32,
        off_w: cutlass.Int32,
        stream: cuda.CUstream,
    ):
        """mX (N, H, W, C), mF (N, Hs, Ws, 2 half) (its last mode compact, 16-byte aligned)."""
        pixels = mF.shape[0] * mF.shape[1] * mF.shape[2]
        blocks = (pixels + THREADS - 1) // THREADS
        self.kernel(mX, mF, off_h, off_w).launch(
            grid=[blocks, 1, 1], block=[THREADS, 1, 1], stream=stream
        )

    @cute.kernel
    def kernel(self, mX: cute.Tensor, mF: cute.Tensor, off_h: cutlass.Int32, off_w: cutlass.Int32):
        tidx, _, _ = cute.arch.thread_idx()
        bidx, _, _ = cute.arch.block_idx()
        ws, hs = mF.shape[2], mF.shape[1]
        h_x, w_x = mX.shape[1], mX.shape[2]
        index = bidx * THREADS + tidx
        if index < mF.shape[0] * hs * ws:
            j = index % ws
            rest = index // ws
            i = rest % hs
            n = rest // hs
            frag = cute.make_rmem_tensor(2 * self.half, mF.element_type)
            frag.fill(0.0)
            for a in cutlass.range_constexpr(2):
                h = 2 * i + a - off_h
                for b in cutlass.range_constexpr(2):
                    w = 2 * j + b - off_w
                    if h >= 0 and h < h_x and w >= 0 and w < w_x:
                        for c in cutlass.range_constexpr(self.c):
                            frag[a * self.half + b * self.c + c] = mX[n, h, w, c]
            cute.autovec_copy(frag, mF[n, i, j, None])
