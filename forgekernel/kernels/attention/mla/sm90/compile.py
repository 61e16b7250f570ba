"""Compile the MLA decode kernels against fake tensors: batch, query rows, heads, pages, splits,
the page size and every outer stride dynamic (FlashMLA's combined (pages, page_size, 1, 576)
cache's two views included: rows 16-byte aligned); heads per CTA, query tokens and dtype baked
in. The combine is the paged leaf's, at head dim 512. The sparse (DSA) partial takes the
(tokens, topk) int32 top-k lists in place of the page table, tokens and topk dynamic, and None
for seqlens_k and cu_seqlens_q. An `fp8` key's caches are the three views of FlashMLA's FP8
rows (uint8 latent, fp32 scales, bf16 RoPE; rows 656 bytes apart, 16-byte aligned); a 16-bit
key's scales None. A `direct` key (a pass of a plan of one split, paged or sparse) takes the op's
out (rows, Hq, 512) in q's dtype and natural LSE (rows, Hq) in place of the partials: the
combine's own output contract (rows of 512 contiguous, the LSE any (rows, Hq) view); an `ostore`
key's out has rows 16-byte aligned (base and strides)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.mla.sm90.config import D_LATENT, D_ROPE, FP8_SCALE_COLUMNS
from forgekernel.kernels.attention.mla.sm90.decode import MlaDecodeSm90
from forgekernel.kernels.attention.mla.sm90.seesaw import MlaSeesawSm90
from forgekernel.kernels.attention.mla.sm90.worklist import MlaWorklistSm90
from forgekernel.kernels.attention.paged.sm90.combine import (
    PagedCombineRangesSm90,
    PagedCombineSm90,
    PagedCombineWarpsRangesSm90,
    PagedCombineWarpsSm90,
    partials_o,
)
from forgekernel.kernels.common.sm90 import fake


def _dense(dtype, rank: int) -> cute.Tensor:
    """Any tensor of `rank` dynamic dims whose last one is contiguous."""
    shape = tuple(cute.sym_int32() for _ in range(rank))
    return fake.rowmajor(dtype, shape, divisibility=1, align=4)


def _outputs(dtype, rows, hq, wide: bool = False) -> tuple:
    """The op's out (rows, Hq, 512) and LSE (rows, Hq) fp32, any view of it (the combine's
    outputs, and the direct pass's); wide (`ostore`): out's rows 16-byte aligned."""
    if wide:
        o = fake.rowmajor(dtype, (rows, hq, D_LATENT))
    else:
        o = fake.rowmajor(dtype, (rows, hq, D_LATENT), divisibility=1, align=None)
    lse_strides = (cute.sym_int64(), cute.sym_int64())  # any (rows, Hq) view
    return o, make_fake_tensor(cutlass.Float32, (rows, hq), stride=lse_strides, assumed_align=4)


def _partials() -> tuple:
    """The partial O (splits, rows, Hq, 512) and log2 LSE (splits, rows, Hq), fp32."""
    return _dense(cutlass.Float32, 4), _dense(cutlass.Float32, 3)


def _combine(dtype, opts: str, pdl: bool, ranges: bool = False, warps: bool = False):
    o, lse = _outputs(dtype, cute.sym_int32(), cute.sym_int32())
    if ranges:  # item-indexed partials and each row's (first item, items, query token)
        return cute.compile(
            (PagedCombineWarpsRangesSm90 if warps else PagedCombineRangesSm90)(D_LATENT, pdl),
            partials_o(),
            _dense(cutlass.Float32, 3),
            o,
            lse,
            _row_ranges(),
            fake.stream(),
            options=opts,
        )
    return cute.compile(
        (PagedCombineWarpsSm90 if warps else PagedCombineSm90)(D_LATENT, pdl),
        partials_o(),
        _dense(cutlass.Float32, 3),
        o,
        lse,
        fake.stream(),
        options=opts,
    )


def _row_ranges() -> cute.Tensor:
    """Each query row's (first item, items, query token) int32 (rows', 3), rows contiguous."""
    return make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 3), stride=(3, 1), assumed_align=4)


def _caches(dtype, fp8: bool, pages, page_size) -> tuple:
    """(latent, RoPE, scales) of a cache of `pages` x `page_size` rows (created in the call's
    argument list, after q's: the 16-bit compile's symbols in their original order)."""
    if not fp8:
        return (
            fake.rowmajor(dtype, (pages, page_size, D_LATENT)),
            fake.rowmajor(dtype, (pages, page_size, D_ROPE)),
            None,
        )
    scales = D_LATENT // FP8_SCALE_COLUMNS
    return (
        fake.rowmajor(cutlass.Uint8, (pages, page_size, D_LATENT), divisibility=16),
        fake.rowmajor(dtype, (pages, page_size, D_ROPE)),
        fake.rowmajor(cutlass.Float32, (pages, page_size, scales), divisibility=4),
    )


def _sparse(dtype, params: dict, opts: str):
    heads, fp8 = params["heads"], params.get("fp8", False)
    direct, sink, fused = (params.get(k, False) for k in ("direct", "sink", "fused"))
    tokens, hq = cute.sym_int32(), cute.sym_int32()
    pages, page_size = cute.sym_int32(), cute.sym_int32()
    top_k = make_fake_tensor(
        cutlass.Int32, (tokens, cute.sym_int32()), stride=(cute.sym_int64(), 1), assumed_align=4
    )
    kernel = MlaDecodeSm90(heads, sparse=True, fp8=fp8, direct=direct, sink=sink, fused=fused,
                           neox=params.get("neox", False), lean=params.get("lean", False),
                           wide=params.get("wide", False))  # fmt: skip
    # seqlens_k's slot: the sink (H,) fp32 or None (the lists' width is every token's keys)
    seq = make_fake_tensor(cutlass.Float32, (hq,), stride=(1,), assumed_align=4) if sink else None
    if fused:  # decode.py's fused slots (`_fused_args`)
        q, caches, outs, positions = _fused_args(dtype, params, tokens, hq, pages, page_size)
    else:
        q = (
            fake.rowmajor(dtype, (tokens, hq, D_LATENT)),
            fake.rowmajor(dtype, (tokens, hq, D_ROPE)),
        )
        caches = _caches(dtype, fp8, pages, page_size)
        outs = _outputs(dtype, tokens, hq, params.get("wide", False)) if direct else _partials()
        positions = None  # cu_seqlens_q: one query token per CTA
    return cute.compile(
        kernel,
        *q,
        *caches,
        top_k,
        seq,
        *outs,
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        positions,
        cutlass.Int32(0),  # causal: unused
        cutlass.Int32(1),  # q_blocks: unused
        fake.stream(),
        options=opts,
    )


def _fused_args(dtype, params: dict, tokens, hq, pages, page_size) -> tuple:
    """The fused form's arguments in the sparse pass's slots (decode.py `__call__`): (q whole
    (tokens, Hq, 576) and the [cos | sin] cache (positions, 64)), the caches with out_scale fp32
    (tokens, Hq, 16) in the scales' slot (an `fp8` key's caches: the FP8 rows' uint8 latent and
    bf16 RoPE views, their scales viewed in the pass from the latent's rows), (out_fp8 as uint8
    (tokens, Hq, 512) rows 2-byte aligned, lse), the positions (tokens,)."""
    q = fake.rowmajor(dtype, (tokens, hq, D_LATENT + D_ROPE))
    rope_dtype = cutlass.Float32 if params["rope"] == "float32" else dtype
    cos_sin = fake.rowmajor(rope_dtype, (cute.sym_int32(), D_ROPE), divisibility=1, align=4)
    latent, kpe, _ = _caches(dtype, params.get("fp8", False), pages, page_size)
    scales = fake.rowmajor(cutlass.Float32, (tokens, hq, D_LATENT // 32), divisibility=1, align=4)
    out = fake.rowmajor(cutlass.Uint8, (tokens, hq, D_LATENT), divisibility=2, align=2)
    _, lse = _outputs(dtype, tokens, hq)
    pos_dtype = cutlass.Int32 if params["positions"] == "int32" else cutlass.Int64
    align = 4 if params["positions"] == "int32" else 8
    positions = make_fake_tensor(pos_dtype, (tokens,), stride=(cute.sym_int64(),),
                                 assumed_align=align)  # fmt: skip
    return (q, cos_sin), (latent, kpe, scales), (out, lse), positions


def _work_list() -> cute.Tensor:
    """The work list int32 (capacity + HEADER, 2), rows contiguous (schedule.py)."""
    return make_fake_tensor(cutlass.Int32, (cute.sym_int32(), 2), stride=(2, 1), assumed_align=8)


def _worklist(qtokens: int, opts: str, pdl: bool, ranges: bool = False):
    """The scheduling kernel (worklist.py): seqlens_k (B,), cu_seqlens_q (qtokens > 1), the
    list, the partial LSEs flat (ranges: each row's item range)."""
    seqlens_k = make_fake_tensor(cutlass.Int32, (cute.sym_int32(),), stride=(1,))
    lse = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=4)
    if ranges:
        lse = _row_ranges()
    return cute.compile(
        MlaWorklistSm90(qtokens, ranges, pdl),
        seqlens_k,
        fake.offsets() if qtokens > 1 else None,
        cutlass.Int32(1),  # causal
        cutlass.Int32(1),  # q_blocks
        cutlass.Int32(1),  # head blocks
        cutlass.Int32(1),  # splits
        cutlass.Int32(1),  # fewest
        cutlass.Int32(1),  # slots
        cutlass.Int32(1),  # width
        _work_list(),
        lse,
        fake.stream(),
        options=opts,
    )


def compile_mla(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    opts = fake.options(arch, extra_options)
    pdl = params.get("pdl") != "off"  # the key runtime/pdl.py gives a build without PDL
    if params["kind"] == "worklist":
        return _worklist(params["qtokens"], opts, pdl, params.get("ranges", False))
    dtype = fake.dtype_of(params["dtype"])
    if params["kind"] == "combine":
        return _combine(dtype, opts, pdl, params.get("ranges", False),
                        params.get("form") == "warps")  # fmt: skip
    fp8 = params.get("fp8", False)
    if params["kind"] == "sparse":
        return _sparse(dtype, params, opts)
    qtokens = params.get("qtokens", 1)
    b, hq = cute.sym_int32(), cute.sym_int32()
    rows = cute.sym_int32() if qtokens > 1 else b  # total_q packed by cu_seqlens_q, else B
    pages, page_size = cute.sym_int32(), cute.sym_int32()
    direct = params.get("direct", False)
    worklist = params.get("worklist", False)
    if params.get("tma", False):
        kernel = MlaSeesawSm90(
            params["heads"],
            qtokens,
            direct,
            params.get("pair", False),
            params.get("ostore", False),
            worklist,
            params.get("ranges", False),
            pdl,
            params.get("gather", False),
        )
    else:
        kernel = MlaDecodeSm90(params["heads"], qtokens, fp8=fp8, direct=direct)
    q_nope = fake.rowmajor(dtype, (rows, hq, D_LATENT))
    q_pe = fake.rowmajor(dtype, (rows, hq, D_ROPE))
    caches = _caches(dtype, fp8, pages, page_size)
    if worklist:  # the work list in the (16-bit caches') scales' slot
        caches = (*caches[:2], _work_list())
    page_table = _dense(cutlass.Int32, 2)
    seqlens_k = make_fake_tensor(cutlass.Int32, (b,), stride=(1,))  # the batch
    if direct:
        outs = _outputs(dtype, rows, hq, params.get("ostore", False))
    else:
        outs = _partials()
    return cute.compile(
        kernel,
        q_nope,
        q_pe,
        *caches,
        page_table,
        seqlens_k,
        *outs,
        cutlass.Float32(1.0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        fake.offsets() if qtokens > 1 else None,
        cutlass.Int32(1),
        cutlass.Int32(1),  # q_blocks (dynamic)
        fake.stream(),
        options=opts,
    )
