"""The split-K helpers' sum (kernels/common/sm90/splitk.py `sum_parts`) run on the host (a
`cute.jit` function runs on the CPU with CPU tensors): every thread's fragment is the sum of its
parked parts, in the slot layout `park` writes, whatever the fragment's size. Fragments that
are no multiple of `CHUNK` (tile_n 144: 72 floats a thread, 80: 40; the swapped stream-K
tiles) lost their last floats of every part after the first: the wrong output of swapped
stream K on the H200 (2026-12-02 18:47)."""

from __future__ import annotations

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

from forgekernel.kernels.common.sm90 import splitk  # noqa: E402

THREADS = 8  # consumer threads of the host run (the layout is the same for 128 or 256)


def _slot_index(frag: int, slot: int, thread: int, value: int) -> int:
    """Where `park` puts value 4i + j of `thread`'s fragment: [slot][i][thread][j]."""
    i, j = divmod(value, 4)
    return slot * frag * THREADS + i * THREADS * 4 + thread * 4 + j


def _summed(frag: int, slots: int, first: int, step: int, parts: int, head: int | None):
    work = torch.randn(slots * frag * THREADS, generator=torch.Generator().manual_seed(frag))
    out = torch.full((THREADS, frag), float("nan"))

    @cute.jit
    def run(mWork: cute.Tensor, out: cute.Tensor, first: Int32, step: Int32, parts: Int32,
            head: Int32):  # fmt: skip
        for t in cutlass.range(THREADS):
            acc = cute.make_rmem_tensor((frag,), Float32)
            acc.fill(float("nan"))
            where = (first, step, parts)
            if cutlass.const_expr(with_head):
                splitk.sum_parts(acc, mWork, where, THREADS, t, head=head)
            else:
                splitk.sum_parts(acc, mWork, where, THREADS, t)
            for v in cutlass.range_constexpr(frag):
                out[t, v] = acc[v]

    with_head = head is not None
    run(from_dlpack(work), from_dlpack(out), first, step, parts, head if with_head else 0)
    order = [head if with_head else first] + [first + p * step for p in range(1, parts)]
    want = torch.zeros(THREADS, frag)
    for slot in order:  # part 0 first, as the kernel sums (fp32)
        for t in range(THREADS):
            idx = [_slot_index(frag, slot, t, v) for v in range(frag)]
            want[t] += work[idx]
    return out, want


@pytest.mark.parametrize("frag", [32, 40, 72, 128])  # 64x64, 192x80, 128x144, 128x256 tiles
@pytest.mark.parametrize(("first", "step", "parts", "head"), [(0, 1, 3, None), (2, 2, 3, 1)])
def test_sum_parts_adds_every_float_of_every_part(frag, first, step, parts, head):
    out, want = _summed(frag, 8, first, step, parts, head)
    torch.testing.assert_close(out, want, rtol=0, atol=0)
