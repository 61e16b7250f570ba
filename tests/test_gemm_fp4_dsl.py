"""The FP4-weight grouped GEMM's device logic run on the host (a `cute.jit` function runs on the
CPU with CPU tensors; make_warp_uniform, a device hint, replaced by the identity): the contiguous
layout's tile walk against its model, and the register store writing each accumulator value at
its coordinate for the kept tokens only."""

from __future__ import annotations

import random

import pytest
import torch

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402


@pytest.fixture
def host_dsl(monkeypatch):
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)


def contiguous_walk(indices: list[int], tiles_n: int, h: int, ctas: int) -> list[list[tuple]]:
    """Per CTA: (expert, token tile, weight tile, rows inside M) of its tiles, the model."""
    m = len(indices)
    tiles_t = -(-m // h)
    order = [[] for _ in range(ctas)]
    for cta in range(ctas):
        for w in range(cta, tiles_t * tiles_n, ctas):
            t, n = w % tiles_t, w // tiles_t
            if indices[t * h] >= 0:
                order[cta].append((indices[t * h], t, n, min(m - t * h, h)))
    return order


def test_contiguous_walk_matches_its_model(host_dsl):
    from forgekernel.kernels.gemm.fp4.sm90.contiguous import ContiguousWalk

    @cute.jit
    def walk_all(idx: cute.Tensor, out: cute.Tensor, tiles_n: Int32, ctas: Int32,
                 h: cutlass.Constexpr):  # fmt: skip
        for cta in cutlass.range(ctas):
            walk = ContiguousWalk(idx, tiles_n, h, cta, ctas)
            work, expert, before, rows = walk.first()
            i = Int32(0)
            while walk.valid(expert):
                t, n, r = walk.tile(work, before, rows)
                out[cta, i, 0], out[cta, i, 1], out[cta, i, 2], out[cta, i, 3] = expert, t, n, r
                i = i + 1
                work, expert, before, rows = walk.next(work, expert, before, rows)

    rng = random.Random(11)
    for h in (8, 32, 64):
        for _ in range(3):
            counts = [
                rng.choice((0, 1, rng.randint(1, 300), 128)) for _ in range(rng.randint(1, 6))
            ]
            indices = []
            for e, c in enumerate(counts):
                padded = -(-c // 128) * 128
                indices += [e] * c + [-1] * (padded - c)
            indices += [-1] * rng.choice((0, 128))
            if not indices:
                indices = [-1] * 128
            tiles_n, ctas = rng.randint(1, 4), rng.choice((1, 3, 16))
            order = contiguous_walk(indices, tiles_n, h, ctas)
            out = torch.full((ctas, max(map(len, order)) + 1, 4), -7, dtype=torch.int32)
            idx = torch.tensor(indices, dtype=torch.int32)
            walk_all(from_dlpack(idx), from_dlpack(out), tiles_n, ctas, h)
            for cta, tiles in enumerate(order):
                assert out[cta, : len(tiles)].tolist() == [list(t) for t in tiles]
                assert bool((out[cta, len(tiles) :] == -7).all())


@pytest.mark.parametrize("tokens, count", [(8, 5), (32, 32), (64, 17)])
def test_store_writes_each_value_at_its_coordinate_for_kept_tokens(host_dsl, tokens, count):
    """kernel.py `_store` for all 256 consumer threads on the host: accumulator value v of
    thread t (the C fragment map) lands at C[first + token, tile_n x 128 + row], only for the
    kept tokens (the first `count`); everything else untouched."""
    from forgekernel.kernels.gemm.fp4.sm90.kernel import GemmFp4GroupedSm90

    gemm = GemmFp4GroupedSm90(tokens)

    @cute.jit
    def store_all(mC: cute.Tensor, first: Int32, tile_n: Int32, count: Int32):
        gemm.c_dtype = mC.element_type
        for t in cutlass.range(256):
            lane = t % 32
            row0, quad = t // 32 * 16 + lane // 4, lane % 4
            acc = cute.make_rmem_tensor((tokens // 2,), cutlass.Float32)
            for i in cutlass.range_constexpr(tokens // 8):
                for j in cutlass.range_constexpr(4):
                    row = row0 + 8 * (j // 2)
                    col = 8 * i + 2 * quad + j % 2
                    acc[4 * i + j] = cutlass.Float32(row * 1000 + col)
            keep = Int32(0)
            for i in cutlass.range_constexpr(tokens // 4):
                keep = keep | (Int32(8 * (i // 2) + 2 * quad + i % 2 < count) << i)
            gemm._store(acc, mC, (first, keep), tile_n, row0, quad)

    first, tile_n = 3, 1
    c = torch.full((first + tokens + 2, 384), -1.0)
    store_all(from_dlpack(c), first, tile_n, count)
    want = torch.full_like(c, -1.0)
    rows = torch.arange(128)
    for col in range(count):
        want[first + col, 128 * tile_n + rows] = (rows * 1000 + col).float()
    assert torch.equal(c, want)


def test_converter_offsets_follow_the_swizzled_layouts(host_dsl):
    """convert.py hoists each row's chunk offsets out of its loop and adds a stage's / buffer's
    base: the layouts' offsets (crd2idx of the composed swizzle layouts, evaluated by the DSL on
    the host) must be row r's chunk c at r x 128 + 16 (c ^ r % 8) of the widened buffer (the
    128B swizzle WGMMA reads) and r x 64 + 16 (q ^ (r >> 1) % 4) of the packed stage (the 64B
    swizzle TMA writes), each further buffer / stage exactly 16384 / 8192 bytes on."""
    from forgekernel.kernels.gemm.fp4.sm90.convert import GemmFp4ConvertSm90

    gemm = GemmFp4ConvertSm90(32)
    rows = 128

    @cute.jit
    def offsets(out_a: cute.Tensor, out_w: cute.Tensor):
        gemm._setup()  # the kernel's own layouts (built under the DSL)
        a_layout, w_layout = gemm.sA_layout, gemm.sW_layout
        for r in cutlass.range(rows):
            for s in cutlass.range_constexpr(3):
                for c in cutlass.range_constexpr(8):
                    out_a[r, c, s] = cute.crd2idx((r, 16 * c, s), a_layout)
                for q in cutlass.range_constexpr(4):
                    out_w[r, q, s] = cute.crd2idx((r, 16 * q, s), w_layout)

    out_a = torch.zeros(rows, 8, 3, dtype=torch.int32)
    out_w = torch.zeros(rows, 4, 3, dtype=torch.int32)
    offsets(from_dlpack(out_a), from_dlpack(out_w))
    r = torch.arange(rows)[:, None, None]
    s = torch.arange(3)[None, None, :]
    c = torch.arange(8)[None, :, None]
    q = torch.arange(4)[None, :, None]
    want_a = r * 128 + 16 * (c ^ (r % 8)) + 16384 * s
    want_w = r * 64 + 16 * (q ^ ((r >> 1) % 4)) + 8192 * s
    assert torch.equal(out_a, want_a.to(torch.int32))
    assert torch.equal(out_w, want_w.to(torch.int32))
