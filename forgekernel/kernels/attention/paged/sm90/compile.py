"""Compile the paged decode kernels against fake tensors: batch, heads, pages, splits, the page
size, the group and every outer stride dynamic (a combined (pages, 2, page_size, Hkv, D)
cache's K and V views included); head dim, heads per CTA and dtype baked in."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.paged.sm90.combine import (
    PagedCombineRangesSm90,
    PagedCombineSm90,
    PagedCombineWarpsRangesSm90,
    PagedCombineWarpsSm90,
    partials_o,
)
from forgekernel.kernels.attention.paged.sm90.decode import PagedDecodeSm90
from forgekernel.kernels.common.sm90 import fake


def _dense(dtype, rank: int) -> cute.Tensor:
    """A contiguous tensor of `rank` dynamic dims."""
    shape = tuple(cute.sym_int32() for _ in range(rank))
    stride = tuple(cute.sym_int64() for _ in range(rank - 1))
    return make_fake_tensor(dtype, shape, stride=(*stride, 1), assumed_align=4)


def _int32_rows(cols: int) -> cute.Tensor:
    """An int32 (rows, cols) table, rows contiguous: the work list (cols 2) or the row ranges
    (cols 3)."""
    return make_fake_tensor(cutlass.Int32, (cute.sym_int32(), cols), stride=(cols, 1),
                            assumed_align=4)  # fmt: skip


def compile_paged(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    d = params["head_dim"]
    opts = fake.options(arch, extra_options)
    b, hq, hkv = (cute.sym_int32() for _ in range(3))

    def final(rows):
        """The output (rows, Hq, D) and its LSE (rows, Hq), any strides ((Hq, rows) storage
        seen transposed)."""
        o = fake.rowmajor(dtype, (rows, hq, d), divisibility=1, align=None)
        lse_strides = (cute.sym_int64(), cute.sym_int64())
        return o, make_fake_tensor(cutlass.Float32, (rows, hq), stride=lse_strides, assumed_align=4)

    on = params.get("pdl") != "off"  # the key runtime/pdl.py gives a build without PDL
    # ramp "serial" (candidates: the bench's variant serial_ramp): the pass's page ids read
    # after the sequence length, tile by tile, and the CTA combine's partial rows loaded after
    # its reductions, as before 2026-12-04 20:40 (PAGED_NOTES.md "Small-batch decode")
    early = params.get("ramp") != "serial"
    ranges = params.get("ranges", False)
    if params["kind"] == "combine":
        o, lse = final(b)
        warps = params.get("form") == "warps"  # one warp a (row, head)
        if ranges:  # item-indexed partials and each sequence's (first item, items, token 0);
            # a one-item sequence's row the pass's own (decode.py, `singles`)
            form = PagedCombineWarpsRangesSm90 if warps else PagedCombineRangesSm90
            return cute.compile(
                form(d, on, singles=True, held=early),
                partials_o(),
                _dense(cutlass.Float32, 3),
                o,
                lse,
                _int32_rows(3),
                fake.stream(),
                options=opts,
            )
        return cute.compile(
            PagedCombineWarpsSm90(d, on) if warps else PagedCombineSm90(d, on, held=early),
            partials_o(),
            _dense(cutlass.Float32, 3),
            o,
            lse,
            fake.stream(),
            options=opts,
        )
    qtokens = params.get("qtokens", 1)
    rows = cute.sym_int32() if qtokens > 1 else b
    q = fake.rowmajor(dtype, (rows, hq, d))
    pages, page_size = cute.sym_int32(), cute.sym_int32()
    fp8 = params.get("kv") == "float8_e4m3fn"
    kv_dtype = cutlass.Float8E4M3FN if fp8 else dtype
    k = fake.rowmajor(kv_dtype, (pages, page_size, hkv, d), divisibility=16)
    v = fake.rowmajor(kv_dtype, (pages, page_size, hkv, d), divisibility=16)
    scales = (_dense(cutlass.Float32, 1), _dense(cutlass.Float32, 1)) if fp8 else (None, None)
    if ranges:  # the step's work list in the K scales' slot (mla/sm90/schedule.py's layout)
        scales = (_int32_rows(2), None)
    return cute.compile(
        PagedDecodeSm90(
            d,
            params["heads"],
            qtokens,
            fp8,
            params.get("page_ids") != "inline",
            params.get("merge") == "rows",
            on,
            ranges,
            early,
        ),
        q,
        k,
        v,
        _dense(cutlass.Int32, 2),
        make_fake_tensor(cutlass.Int32, (b,), stride=(1,)),  # seqlens_k: the batch
        _dense(cutlass.Float32, 4),
        _dense(cutlass.Float32, 3),
        *final(rows),
        cutlass.Int32(0),
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        cutlass.Int32(1),
        *scales,
        make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), stride=(1,)) if qtokens > 1 else None,
        cutlass.Int32(1),
        fake.stream(),
        options=opts,
    )
