"""Compile the indexer's kernels against fake tensors: rows, keys, pages, the logits' width and
every outer stride dynamic; qtokens, paged and the top-k cluster baked in.

Paged caches are deep_gemm's int8 (pages, 64, 1, 132) seen through two views (launch.py): k
(64, 128, pages) float8_e4m3fn with strides (128, 1, page stride) and k_scale (64, pages) fp32
with strides (1, page stride / 4), the page stride a dynamic multiple of 16 bytes."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.dsa_indexer.sm90.config import ALIGN, HEAD_DIM, HEADS, PAGE
from forgekernel.kernels.attention.dsa_indexer.sm90.logits import IndexerLogitsSm90
from forgekernel.kernels.attention.dsa_indexer.sm90.topk import IndexerTopkSm90
from forgekernel.kernels.common.sm90 import fake

FP8 = cutlass.Float8E4M3FN


def _vector(dtype=cutlass.Int32) -> cute.Tensor:
    return make_fake_tensor(dtype, (cute.sym_int32(),), stride=(1,), assumed_align=4)


def _table() -> cute.Tensor:
    shape = (cute.sym_int32(), cute.sym_int32())
    return make_fake_tensor(cutlass.Int32, shape, stride=(cute.sym_int64(), 1), assumed_align=4)


def _logits(rows) -> cute.Tensor:
    """(rows, width) fp32, rows 16-byte aligned (the top-k's bulk copies)."""
    return fake.rowmajor(cutlass.Float32, (rows, cute.sym_int32()), divisibility=ALIGN)


def _paged_cache() -> tuple[cute.Tensor, cute.Tensor]:
    pages, stride = cute.sym_int32(), cute.sym_int64(divisibility=16)
    k = make_fake_tensor(FP8, (PAGE, HEAD_DIM, pages), stride=(HEAD_DIM, 1, stride),
                         assumed_align=16)  # fmt: skip
    scale_stride = (1, cute.sym_int64(divisibility=4))
    scale = make_fake_tensor(cutlass.Float32, (PAGE, pages), stride=scale_stride, assumed_align=16)
    return k, scale


def _compile_logits(qtokens: int, paged: bool, opts: str):
    rows = cute.sym_int32()
    q = fake.rowmajor(FP8, (cute.sym_int32(), HEAD_DIM), divisibility=16)
    w = fake.rowmajor(cutlass.Float32, (rows, HEADS), divisibility=4)
    if paged:
        k, scale = _paged_cache()
        where = (_table(), _vector(), None, None)
    else:
        k = fake.rowmajor(FP8, (cute.sym_int32(), HEAD_DIM), divisibility=16)
        scale = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,),
                                 assumed_align=16)  # fmt: skip
        where = (None, None, _vector(), _vector())
    return cute.compile(
        IndexerLogitsSm90(qtokens, paged), q, w, k, scale, *where, _logits(rows),
        cutlass.Int32(1), cutlass.Int32(1), fake.stream(), options=opts,
    )  # fmt: skip


def _compile_topk(cluster: int, paged: bool, opts: str):
    rows = cute.sym_int32()
    where = (_table(), _vector(), None, None) if paged else (None, None, _vector(), _vector())
    out = fake.rowmajor(cutlass.Int32, (rows, cute.sym_int32()), divisibility=1, align=4)
    return cute.compile(
        IndexerTopkSm90(cluster, paged), _logits(rows), *where, out, cutlass.Int32(1),
        fake.stream(), options=opts,
    )  # fmt: skip


def compile_indexer(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    opts = fake.options(arch, extra_options)
    if params["kind"] == "logits":
        return _compile_logits(params["qtokens"], params["paged"], opts)
    return _compile_topk(params["cluster"], params["paged"], opts)
