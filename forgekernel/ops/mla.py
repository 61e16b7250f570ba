"""`forgekernel.ops.mla.mla_decode` / `mla_prefill`: DeepSeek Multi-head Latent Attention decode
and (chunked) prefill over a paged latent cache, absorbed form (kernels:
kernels/attention/mla/sm90, issue 19); and `mla_paged_decode_flashinfer` /
`mla_paged_prefill_flashinfer`, FlashInfer-Bench's `mla_paged_{decode,prefill_causal}_*`
definitions as they are.

Math (reference/mla.py): the cache holds one row [c_j (512) ; r_j (64)] per token, shared by
every head; query head h of token i scores s_j = softmax_scale (q_nope . c_j + q_pe . r_j)
(q_nope already absorbed: W_UK^T q, 512 wide) and outputs sum_j softmax(s)_j c_j (512 wide; the
caller applies W_UV). softmax_scale has no default: DeepSeek-V3's is the un-absorbed
1 / sqrt(192) times its YaRN mscale^2, never 1 / sqrt(576).

Layouts (reference.mla's decode conventions, which are also FlashMLA's):
    q_nope (batch, s_q, H, 512), q_pe (batch, s_q, H, 64), 1 <= s_q <= 4 (MTP / speculative
        tokens, causal among themselves: query i sees key j <= i + seqlens_k - s_q) -> out
        (batch, s_q, H, 512) in q's dtype, lse (batch, H, s_q) fp32 natural log;
    packed (cu_seqlens_q int32 (batch + 1,), max_seqlen_q <= 4): q (total_q, H, *) -> out
        (total_q, H, 512), lse (H, total_q) (OPS.md's varlen layout);
    caches ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages, page_size, 64) in q's
        dtype (FlashInfer's), or FlashMLA's combined (num_pages, page_size, 1, 576) as ckv_cache
        with kpe_cache None (read in place through two views); page_table int32 (batch,
        max_pages), seqlens_k int32 (batch,) counting the new tokens. A sequence of length 0
        (or a query that sees no key) gives 0 and LSE -inf.
    FP8: FlashMLA's FP8 cache (num_pages, page_size, 1, 656) float8_e4m3fn or uint8 (the
        format DeepSeek serving uses) as ckv_cache with kpe_cache None, bf16 queries: per token
        [0, 512) the latent in e4m3, [512, 528) four fp32 scales (one per 128 latent columns,
        powers of two), [528, 656) the 64 RoPE columns in bf16; the latent reads as e4m3 x its
        scale, exact in bf16 (kernels/attention/mla/sm90/fp8.py). Read in place through three
        views (rows 16-byte aligned: row and page strides multiples of 16 bytes). FlashInfer's
        split form stays 16-bit, and FP8 with a per-tensor scale (576 e4m3 bytes a token) is
        not read: NotImplementedError.
More than 4 query tokens per sequence: `mla_prefill` (the packed form, the same kernel over
blocks of 64 // H query tokens).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from forgekernel.kernels.attention.mla.sm90 import launch as mla_sm90
from forgekernel.kernels.attention.mla.sm90.config import (
    D_LATENT,
    D_ROPE,
    FP8_ROW_BYTES,
    FP8_SCALE_COLUMNS,
)
from forgekernel.ops._dispatch import into_buffers, plain, tracing
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    FLOAT16_TYPES,
    check_bool,
    check_cuda,
    check_rows_in_place,
    check_same_device,
    check_schedule_problem,
    check_shaped,
    check_tensor,
    on_one_device,
)
from forgekernel.ops.attention_paged import csr_page_table

INDEX = (torch.int32,)
MAX_QUERY_TOKENS = 4  # per sequence (the kernel's QTOKENS)
# 8-bit caches: FlashMLA's FP8 rows come as e4m3 or as raw bytes; the others are named in errors
FP8_CACHES = (torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8, torch.int8)
FLASHMLA_FP8 = (torch.float8_e4m3fn, torch.uint8)
FP8_SCALES = D_LATENT // FP8_SCALE_COLUMNS  # 4 fp32 per token
FP8_QUERY = torch.bfloat16
LOG2E = math.log2(math.e)
_COMBINED = (1, D_LATENT + D_ROPE)  # FlashMLA's combined cache's last dims
_FP8_FORM = (
    f"FlashMLA's (num_pages, page_size, 1, {FP8_ROW_BYTES}) rows as ckv_cache, kpe_cache None"
)


def reject_fp8_cache(name: str, cache: object) -> None:
    """FlashInfer's split ckv / kpe form is 16-bit only: a clear error for an 8-bit one."""
    if getattr(cache, "dtype", None) in FP8_CACHES:
        raise NotImplementedError(
            f"{name} is {cache.dtype}: FlashInfer's split ckv_cache / kpe_cache are 16-bit only;"
            f" an FP8 latent cache is {_FP8_FORM}"
        )


def latent_cache_views(ckv_cache, kpe_cache):
    """(ckv, kpe, ckv_scale): the split form as it is (scale None); FlashMLA's combined
    (num_pages, page_size, 1, 576) cache passed as ckv_cache with kpe_cache None gives its two
    views (no copy); FlashMLA's FP8 (num_pages, page_size, 1, 656) cache its three views (uint8
    latent, bf16 RoPE, fp32 scales; `fp8_cache_views`)."""
    if kpe_cache is not None:
        reject_fp8_cache("ckv_cache", ckv_cache)
        reject_fp8_cache("kpe_cache", kpe_cache)
        return ckv_cache, kpe_cache, None
    if (
        type(ckv_cache) is torch.Tensor
        and ckv_cache.dtype in FLOAT16_TYPES
        and ckv_cache.dim() == 4
        and ckv_cache.shape[2:] == _COMBINED
    ):  # the combined 16-bit cache: the general path's checks below in one (0.6 us less a call)
        ckv, kpe = ckv_cache.squeeze(2).split_with_sizes((D_LATENT, D_ROPE), -1)
        return ckv, kpe, None
    if getattr(ckv_cache, "dtype", None) in FP8_CACHES or (
        getattr(ckv_cache, "ndim", 0) == 4 and ckv_cache.shape[-1] == FP8_ROW_BYTES
    ):
        return fp8_cache_views(ckv_cache)
    check_tensor("ckv_cache", ckv_cache, ndim=4, cuda=False)
    if ckv_cache.shape[2:] != _COMBINED:
        raise ValueError(
            "with kpe_cache None, ckv_cache is FlashMLA's combined cache (num_pages, page_size,"
            f" 1, {D_LATENT + D_ROPE}), got {tuple(ckv_cache.shape)}"
        )
    # aten views, not indexing: traceable on fake CUDA tensors; one split, not two narrows
    # (2.0 us a call on the CPU against 3.6)
    ckv, kpe = ckv_cache.squeeze(2).split_with_sizes((D_LATENT, D_ROPE), -1)
    return ckv, kpe, None


def fp8_cache_views(packed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(latent uint8 (P, ps, 512), RoPE bf16 (P, ps, 64), scales fp32 (P, ps, 4)): views of
    FlashMLA's FP8 cache (P, ps, 1, 656) float8_e4m3fn / uint8, bytes [0, 512) e4m3 latent,
    [512, 528) scales, [528, 656) RoPE; the kernel reads every row 16 bytes at a time, so the
    row and page strides must be multiples of 16 bytes (the data pointer's alignment is checked
    with the real tensor, `check_fp8_rows`)."""
    if packed.dtype not in FLASHMLA_FP8:
        raise TypeError(
            f"ckv_cache: FlashMLA's FP8 cache is float8_e4m3fn or uint8 bytes, got {packed.dtype}"
        )
    if packed.ndim != 4 or packed.shape[2:] != (1, FP8_ROW_BYTES):
        width = packed.shape[-1] if packed.ndim else None
        if packed.ndim == 4 and width == D_LATENT + D_ROPE and packed.shape[2] == 1:
            raise NotImplementedError(
                f"ckv_cache {tuple(packed.shape)} {packed.dtype}: FP8 with a per-tensor scale"
                f" (576 e4m3 bytes a token) is not read; FP8 caches are {_FP8_FORM}"
            )
        raise ValueError(f"an FP8 ckv_cache must be {_FP8_FORM}, got {tuple(packed.shape)}")
    strides = packed.stride()
    if (
        packed.shape[1] < 1
        or strides[3] != 1
        or (strides[0] | strides[1]) % 16
        or (packed.storage_offset() % 16)
    ):
        raise ValueError(
            "ckv_cache: FlashMLA's FP8 rows must be contiguous and 16-byte aligned, row and page"
            f" strides multiples of 16 bytes (page_size >= 1), got shape {tuple(packed.shape)},"
            f" strides {strides}, storage offset {packed.storage_offset()}"
        )
    rows = packed.view(torch.uint8).squeeze(2)
    latent, scale, rope = rows.split_with_sizes((D_LATENT, 4 * FP8_SCALES, 2 * D_ROPE), -1)
    return latent, rope.view(torch.bfloat16), scale.view(torch.float32)


def check_fp8_rows(ckv: torch.Tensor, kpe: torch.Tensor, ckv_scale: torch.Tensor) -> None:
    """FlashMLA's FP8 views read in place, 16 bytes at a time (real tensors: data pointers)."""
    check_rows_in_place("ckv_cache", ckv, stride_multiple=16)
    check_rows_in_place("ckv_cache's RoPE columns", kpe)
    check_rows_in_place("ckv_cache's scales", ckv_scale, stride_multiple=4)


def check_caches_in_place(ckv, kpe, ckv_scale, combined: bool = False) -> None:
    """The caches' rows, read in place (real tensors only). combined: ckv and kpe are the views
    of FlashMLA's combined 16-bit cache (`latent_cache_views`): kpe's rows are ckv's strides
    from 1024 bytes further, so ckv's check is both's (0.5 us a call on the CPU)."""
    if ckv_scale is not None:
        check_fp8_rows(ckv, kpe, ckv_scale)
        return
    check_rows_in_place("ckv_cache", ckv)
    if not combined:
        check_rows_in_place("kpe_cache", kpe)


def check_softmax_scale(scale: object) -> float:
    if type(scale) is float and 0.0 < scale < math.inf:  # the common call, in 0.1 us
        return scale
    if scale is None:
        raise TypeError(
            "softmax_scale has no default: DeepSeek-V3's is 1 / sqrt(192) x mscale^2 (about "
            "0.1352), never 1 / sqrt(576)"
        )
    if isinstance(scale, bool) or not isinstance(scale, (numbers.Real, torch.Tensor)):
        raise TypeError(f"softmax_scale must be a float, got {type(scale).__name__}")
    value = float(scale)
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"softmax_scale must be finite and > 0, got {value}")
    return value


def check_caches(q_nope, ckv, kpe, ckv_scale) -> None:
    """The (views of the) caches against q: 16-bit in q's dtype, or FlashMLA's FP8 views
    (ckv_scale given: `fp8_cache_views`' uint8 / bf16 / fp32, q bf16)."""
    if ckv_scale is None:
        check_tensor("ckv_cache", ckv, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
        check_tensor("kpe_cache", kpe, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
    else:
        if q_nope.dtype != FP8_QUERY:
            raise TypeError(
                f"an FP8 ckv_cache takes bf16 queries (e4m3 x its power-of-two scale is exact in"
                f" bf16), got q_nope {q_nope.dtype}"
            )
        check_tensor("ckv_cache", ckv, ndim=3, dtypes=(torch.uint8,), cuda=False)
        check_tensor("kpe_cache", kpe, ndim=3, dtypes=(FP8_QUERY,), cuda=False)
        check_shaped("ckv_scale", ckv_scale, (*ckv.shape[:2], FP8_SCALES), (torch.float32,))
    pages, page_size, _ = ckv.shape
    if ckv.shape[2] != D_LATENT or kpe.shape != (pages, page_size, D_ROPE) or page_size < 1:
        raise ValueError(
            f"ckv_cache {tuple(ckv.shape)} and kpe_cache {tuple(kpe.shape)} must be (num_pages,"
            f" page_size >= 1, {D_LATENT}) and (num_pages, page_size, {D_ROPE})"
        )


def lse_shape(q_nope, cu_seqlens_q) -> tuple[int, ...]:
    """The LSE's shape (OPS.md): (batch, H, s_q), packed (H, total_q)."""
    shape = q_nope.shape
    if cu_seqlens_q is not None:
        return (shape[1], shape[0])
    return (shape[0], shape[2], shape[1])


def _validate(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, out,
              ckv_scale=None, lse=None) -> None:  # fmt: skip
    packed = cu_seqlens_q is not None
    ndim = 3 if packed else 4
    form = "(total_q, H, D) packed by cu_seqlens_q" if packed else "(batch, s_q, H, D)"
    for name, t, d in (("q_nope", q_nope, D_LATENT), ("q_pe", q_pe, D_ROPE)):
        if isinstance(t, torch.Tensor) and t.dim() != ndim:
            raise ValueError(f"{name} must be {form} with D = {d}, got {tuple(t.shape)}")
    check_tensor("q_nope", q_nope, ndim=ndim, cuda=False)
    check_tensor("q_pe", q_pe, ndim=ndim, dtypes=(q_nope.dtype,), cuda=False)
    if q_nope.shape[-1] != D_LATENT or q_pe.shape != (*q_nope.shape[:-1], D_ROPE):
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be {form} with D"
            f" = {D_LATENT} and {D_ROPE}"
        )
    check_caches(q_nope, ckv, kpe, ckv_scale)
    if packed:
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX, cuda=False)
        b = cu_seqlens_q.shape[0] - 1
    else:
        b = q_nope.shape[0]
        if not 1 <= q_nope.shape[1] <= MAX_QUERY_TOKENS:
            raise ValueError(f"s_q must be 1..{MAX_QUERY_TOKENS}, got {q_nope.shape[1]}")
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, cuda=False)
    if page_table.shape[0] != b:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for a batch of {b}")
    check_shaped("seqlens_k", seqlens_k, (b,), INDEX)
    if out is not None:
        check_shaped("out", out, tuple(q_nope.shape), (q_nope.dtype,))
    if lse is not None:
        check_shaped("lse", lse, lse_shape(q_nope, cu_seqlens_q), (torch.float32,))
    check_cuda("q_nope", q_nope)
    extra = {"out": out} if out is not None else {}
    if lse is not None:
        extra["lse"] = lse
    if packed:
        extra["cu_seqlens_q"] = cu_seqlens_q
    check_same_device(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe,
                      page_table=page_table, seqlens_k=seqlens_k, **extra)  # fmt: skip


def _valid_at_a_glance(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, out,
                       ckv_scale=None, lse=None, combined=False) -> bool:  # fmt: skip
    """`_validate`'s checks in one pass over plain tensors (the common eager call): True when
    every check passes (check_cuda, which raises, last as in `_validate`); False sends the call
    through `_validate`, whose named checks raise. 2.9 us against 4.9 on the CPU (issue 17).
    combined: ckv / kpe are `latent_cache_views`' of FlashMLA's combined 16-bit cache, whose
    shapes and dtype (16-bit, (pages, page_size, 1, 576)) it checked: of `caches_at_a_glance`
    only q's dtype and a page size >= 1 are left (0.6 us a call less on the CPU)."""
    if not plain(q_nope, q_pe, ckv, kpe, page_table, seqlens_k,
                 optional=(cu_seqlens_q, out, lse)):  # fmt: skip
        return False
    if combined:
        if ckv.dtype != q_nope.dtype or ckv.shape[1] < 1:
            return False
    elif not caches_at_a_glance(q_nope, ckv, kpe, ckv_scale):
        return False
    dtype, shape = q_nope.dtype, q_nope.shape
    if cu_seqlens_q is None:
        if len(shape) != 4 or not 1 <= shape[1] <= MAX_QUERY_TOKENS:
            return False
        b = shape[0]
    elif len(shape) != 3 or cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1:
        return False
    else:
        b = cu_seqlens_q.shape[0] - 1
    pe = q_pe.shape
    if not (
        q_pe.dtype == dtype
        and shape[-1] == D_LATENT and len(pe) == len(shape) and pe[-1] == D_ROPE
        and pe[:-1] == shape[:-1]
        and page_table.dtype == torch.int32 and page_table.dim() == 2
        and page_table.shape[0] == b
        and seqlens_k.dtype == torch.int32 and seqlens_k.shape == (b,)
        and (out is None or (out.dtype == dtype and out.shape == shape))
        and (lse is None or (lse.dtype == torch.float32
                             and lse.shape == lse_shape(q_nope, cu_seqlens_q)))
    ):  # fmt: skip
        return False
    check_cuda("q_nope", q_nope)
    return on_one_device(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, out, lse)


def caches_at_a_glance(q_nope, ckv, kpe, ckv_scale) -> bool:
    """`check_caches`' conditions (q's dtype, the latent / RoPE caches, FlashMLA's FP8 views) in
    one pass, for the one-pass checks of mla_decode and dsa_sparse_attention."""
    dtype, latent, rope = q_nope.dtype, ckv.shape, kpe.shape
    if ckv_scale is not None and not (
        type(ckv_scale) is torch.Tensor
        and dtype == FP8_QUERY
        and ckv_scale.dtype == torch.float32
        and ckv_scale.shape == (*latent[:2], FP8_SCALES)
    ):  # fmt: skip
        return False
    return (
        dtype in FLOAT16_TYPES
        and kpe.dtype == dtype
        and ckv.dtype == (dtype if ckv_scale is None else torch.uint8)
        and len(latent) == 3 and latent[2] == D_LATENT and latent[1] >= 1
        and len(rope) == 3 and rope[2] == D_ROPE and rope[:2] == latent[:2]
    )  # fmt: skip


def _outputs(q_nope, cu_seqlens_q, out, lse=None):
    """(out, lse): lse (batch, H, s_q) for the decode form, (H, total_q) packed (OPS.md); the
    caller's where given."""
    o = out if out is not None else q_nope.new_empty(q_nope.shape)
    if lse is not None:
        return o, lse
    if cu_seqlens_q is not None:
        rows, hq, _ = q_nope.shape
        return o, q_nope.new_empty((hq, rows), dtype=torch.float32)
    b, s_q, hq, _ = q_nope.shape
    return o, q_nope.new_empty((b, hq, s_q), dtype=torch.float32)


def _flat_rows(t: torch.Tensor) -> torch.Tensor | None:
    """(batch, s_q, ...) seen as (batch x s_q, ...) without a copy, or None where it cannot be."""
    if t.shape[0] <= 1 or t.stride(0) == t.shape[1] * t.stride(1):
        return t.flatten(0, 1)
    return None


def _forward(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, scale, max_seqlen_q,
             causal, out, ckv_scale=None, lse=None, work=None, rows_cu=None):  # fmt: skip
    """The kernels on validated arguments: the decode form becomes the kernel's (rows, H, D) by
    views; s_q > 1 runs as the packed form (cu_seqlens_q = 0, s_q, 2 s_q, ...: rows_cu, the
    schedule's, else made here), its LSE rows transposed into (batch, H, s_q) after. ckv_scale:
    FlashMLA's FP8 views. out / lse: the caller's (written in place: no allocation, no copy) or
    None. work: a schedule's (list, row ranges)."""
    o, lse = _outputs(q_nope, cu_seqlens_q, out, lse)
    launch = mla_sm90.mla_decode
    if cu_seqlens_q is not None:
        launch(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, scale, o, lse.t(), cu_seqlens_q,
               max_seqlen_q, causal, ckv_scale, work)  # fmt: skip
        return o, lse
    b, s_q, hq, d = q_nope.shape
    if s_q == 1:  # squeeze: the cheapest view (0.8 us on the CPU against 1.05 for o[:, 0])
        launch(q_nope.squeeze(1), q_pe.squeeze(1), ckv, kpe, page_table, seqlens_k, scale,
               o.squeeze(1), lse.squeeze(2), None, 1, causal, ckv_scale, work)  # fmt: skip
        return o, lse
    o_rows = _flat_rows(o)
    target = o_rows if o_rows is not None else o.new_empty((b * s_q, hq, d))
    lse_rows = lse.new_empty((b * s_q, hq))
    cu = rows_cu
    if cu is None:  # (a kernel launch of its own: the schedule's is made once a step)
        cu = torch.arange(0, (b + 1) * s_q, s_q, dtype=torch.int32, device=q_nope.device)
    launch(q_nope.reshape(b * s_q, hq, d), q_pe.reshape(b * s_q, hq, D_ROPE), ckv, kpe,
           page_table, seqlens_k, scale, target, lse_rows, cu, s_q, causal, ckv_scale,
           work)  # fmt: skip
    if o_rows is None:
        o.copy_(target.view(b, s_q, hq, d))
    lse.copy_(lse_rows.view(b, s_q, hq).transpose(1, 2))
    return o, lse


@dataclass(frozen=True, eq=False)
class MlaDecodeSchedule:
    """A decode step's work list (`mla_decode_schedule`): `work` the scheduling kernel's int32
    list on the device ((0, 2): the problem's plan takes no list, one split or not the seesaw
    pass), `rows` each query row's item range (int32 (rows, 3)), and the problem it was made
    for, which every `mla_decode(..., schedule=)` call checks (its lengths are the caller's to
    keep: the list was made from seqlens_k and cu_seqlens_q as they were then, on the
    device)."""

    work: torch.Tensor
    rows: torch.Tensor
    batch: int
    num_heads: int
    max_pages: int
    page_size: int
    s_q: int  # the decode form's s_q, or the packed form's max_seqlen_q
    packed: bool
    causal: bool
    dtype: torch.dtype
    # the decode form's rows as the packed form's (0, s_q, 2 s_q, ..., int32 (batch + 1,)) where
    # s_q > 1: made with the list, so that a call does not launch a torch.arange of its own
    rows_cu: torch.Tensor | None = None


def _schedule_problem(schedule: object) -> tuple:
    return (schedule.batch, schedule.num_heads, schedule.max_pages, schedule.page_size,
            schedule.s_q, schedule.packed, schedule.dtype)  # fmt: skip


def schedule_work(schedule, q_nope, page_table, ckv, cu_seqlens_q, mq, causal, fp8):
    """The (list, row ranges) `schedule` brings to this call (None without one), or ValueError
    when it was made for another problem (batch, heads, table width, page size, query tokens,
    form, dtype, causal where query tokens see each other, a 16-bit cache, the device)."""
    if schedule is None:
        return None
    if not isinstance(schedule, MlaDecodeSchedule):
        raise TypeError(f"schedule must be an MlaDecodeSchedule, got {type(schedule).__name__}")
    packed = cu_seqlens_q is not None
    b = cu_seqlens_q.shape[0] - 1 if packed else q_nope.shape[0]
    hq = q_nope.shape[-2]
    here = (b, hq, page_table.shape[1], ckv.shape[1], mq, packed, q_nope.dtype)
    names = ("batch", "num_heads", "max_pages", "page_size", "s_q", "packed", "dtype")
    check_schedule_problem(names, here, _schedule_problem(schedule))
    if (packed or mq > 1) and bool(causal) != schedule.causal:
        raise ValueError(f"schedule was made for causal={schedule.causal}, got causal={causal}")
    if fp8 is not None:
        raise ValueError("a schedule serves 16-bit caches (an FP8 cache's plan takes no list)")
    if schedule.work.device != q_nope.device:
        raise ValueError(f"schedule is on {schedule.work.device}, q_nope on {q_nope.device}")
    return schedule.work, schedule.rows


@torch.library.custom_op("forgekernel::mla_decode_schedule", mutates_args=())
def _schedule_op(
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    num_heads: int,
    max_pages: int,
    page_size: int,
    max_seqlen_q: int,
    causal: bool,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    return mla_sm90.make_schedule(seqlens_k, num_heads, max_pages, page_size, dtype,
                                  cu_seqlens_q, max_seqlen_q, causal)  # fmt: skip


@_schedule_op.register_fake
def _(seqlens_k, cu_seqlens_q, num_heads, max_pages, page_size, max_seqlen_q, causal, dtype):
    shapes = mla_sm90.schedule_shapes(seqlens_k.shape[0], num_heads, max_pages, page_size,
                                      max_seqlen_q, cu_seqlens_q is not None,
                                      seqlens_k.device.index)  # fmt: skip
    return seqlens_k.new_empty(shapes[0]), seqlens_k.new_empty(shapes[1])


def mla_decode_schedule(
    seqlens_k: torch.Tensor,
    num_heads: int,
    page_table: torch.Tensor,
    *,
    page_size: int,
    dtype: torch.dtype = torch.bfloat16,
    s_q: int = 1,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    causal: bool = True,
) -> MlaDecodeSchedule:
    """The work list of one decode step, made once and read by every layer's `mla_decode(...,
    schedule=)` (FlashMLA's get_mla_metadata, FlashInfer's plan): the scheduling kernel sizes
    the tiles per split by seqlens_k on the device (one launch, no host read: graph-capturable).
    seqlens_k int32 (batch,) and page_table int32 (batch, max_pages) as the calls' (only the
    table's shape is read); num_heads the query heads; page_size the cache's; dtype q's; s_q
    the decode form's query tokens, or the packed form's cu_seqlens_q int32 (batch + 1,) with
    max_seqlen_q (<= 4). The lengths must stay what they were when the schedule was made. One
    sequence whose query tokens fit one row block gets no list: its call keeps the width plan,
    which spreads its keys over every split already."""
    check_tensor("seqlens_k", seqlens_k, ndim=1, dtypes=INDEX, cuda=False)
    check_cuda("seqlens_k", seqlens_k)
    b = seqlens_k.shape[0]
    check_shaped("page_table", page_table, (b, page_table.shape[-1]), INDEX)
    if (cu_seqlens_q is None) != (max_seqlen_q is None):
        raise ValueError("cu_seqlens_q and max_seqlen_q come together")
    for name, value, low in (("num_heads", num_heads, 1), ("page_size", page_size, 1)):
        if not isinstance(value, numbers.Integral) or value < low:
            raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
    if dtype not in FLOAT16_TYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    packed = cu_seqlens_q is not None
    mq = int(max_seqlen_q) if packed else int(s_q)
    if packed and s_q != 1:
        raise ValueError("the packed form's query tokens come by cu_seqlens_q: s_q must be 1")
    if not 1 <= mq <= MAX_QUERY_TOKENS:
        raise ValueError(f"s_q / max_seqlen_q must be 1..{MAX_QUERY_TOKENS}, got {mq}")
    cu = cu_seqlens_q
    if packed:
        check_shaped("cu_seqlens_q", cu, (b + 1,), INDEX)
    elif mq > 1:  # the launcher's packed form of the decode form (`_forward`)
        cu = torch.arange(0, (b + 1) * mq, mq, dtype=torch.int32, device=seqlens_k.device)
    check_same_device(seqlens_k=seqlens_k, page_table=page_table,
                      **({"cu_seqlens_q": cu} if cu is not None else {}))  # fmt: skip
    if _traced(seqlens_k, page_table, cu):
        work, rows = torch.ops.forgekernel.mla_decode_schedule(
            seqlens_k, cu, num_heads, page_table.shape[1], page_size, mq, bool(causal), dtype
        )
    else:
        work, rows = mla_sm90.make_schedule(seqlens_k, num_heads, page_table.shape[1], page_size,
                                      dtype, cu, mq, bool(causal))  # fmt: skip
    return MlaDecodeSchedule(work, rows, b, num_heads, page_table.shape[1], page_size, mq, packed,
                             bool(causal), dtype, None if packed else cu)  # fmt: skip


@torch.library.custom_op("forgekernel::mla_decode", mutates_args=())
def _decode_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None,
    softmax_scale: float,
    max_seqlen_q: int,
    causal: bool,
    ckv_scale: torch.Tensor | None = None,
    schedule_work: torch.Tensor | None = None,
    schedule_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_caches_in_place(ckv_cache, kpe_cache, ckv_scale)
    work = None if schedule_work is None else (schedule_work, schedule_rows)
    return _forward(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, cu_seqlens_q,
                    softmax_scale, max_seqlen_q, causal, None, ckv_scale, None, work)  # fmt: skip


@_decode_op.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, cu_seqlens_q, softmax_scale,
      max_seqlen_q, causal, ckv_scale=None, schedule_work=None, schedule_rows=None):  # fmt: skip
    return _outputs(q_nope, cu_seqlens_q, None)


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    schedule: MlaDecodeSchedule | None = None,
):
    """Absorbed MLA decode (module docstring): q_nope (batch, s_q, H, 512), q_pe (batch, s_q,
    H, 64), s_q <= 4, against ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages,
    page_size, 64) (or FlashMLA's combined (num_pages, page_size, 1, 576), or its FP8 (num_pages,
    page_size, 1, 656) float8_e4m3fn / uint8 with bf16 q, as ckv_cache with kpe_cache None),
    page_table int32 (batch, max_pages), seqlens_k int32 (batch,). Returns out
    (batch, s_q, H, 512) in q's dtype and, with return_lse, the natural-log LSE (batch, H, s_q)
    fp32. Packed form: q (total_q, H, *) by cu_seqlens_q int32 (batch + 1,) with max_seqlen_q
    (a host int, <= 4) at least the longest, out (total_q, H, 512), LSE (H, total_q).
    softmax_scale (required; positional, as issue 19 writes the call, or keyword): the
    un-absorbed scale. The split plan bounds the KV lengths by the page table's width (no device
    read: CUDA-graph capturable). out / lse: buffers of the outputs' shapes (out in q's dtype,
    lse fp32) written in place (the bench's call: no allocation, no copy; lse is returned with
    return_lse). schedule: `mla_decode_schedule`'s for this problem and these lengths (the
    pass takes its items from the step's list: no scheduling in this call), None the width plan
    (no list); a schedule made for another problem raises ValueError before any launch."""
    if (cu_seqlens_q is None) != (max_seqlen_q is None):
        raise ValueError("cu_seqlens_q and max_seqlen_q come together")
    return _attend(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, softmax_scale,
                   cu_seqlens_q, max_seqlen_q, causal, return_lse, out, lse,
                   MAX_QUERY_TOKENS, schedule)  # fmt: skip


def mla_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    *,
    causal: bool = True,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
):
    """Absorbed MLA prefill against the paged latent cache (chunked prefill: each sequence's
    new tokens are the last of its seqlens_k cached ones, causal bottom-right): the packed
    form of `mla_decode` without its 4-token bound. q_nope (total_q, H, 512), q_pe (total_q,
    H, 64) by cu_seqlens_q int32 (batch + 1,), max_seqlen_q (a host int) at least the longest;
    caches (FP8 included), page_table, seqlens_k and softmax_scale (positional after
    max_seqlen_q, or keyword) as `mla_decode`'s. Returns out (total_q, H, 512) in q's dtype
    and, with return_lse, the natural-log LSE (H, total_q). A CTA takes 64 // H (at most 4)
    query tokens of H heads: every CTA reads the keys its tokens see. out / lse: as
    `mla_decode`'s."""
    if cu_seqlens_q is None or max_seqlen_q is None:
        raise ValueError("mla_prefill takes the packed form: cu_seqlens_q and max_seqlen_q")
    return _attend(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, softmax_scale,
                   cu_seqlens_q, max_seqlen_q, causal, return_lse, out, lse, None)  # fmt: skip


def _attend(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, softmax_scale,
            cu_seqlens_q, max_seqlen_q, causal, return_lse, out, lse, max_tokens,
            schedule=None):  # fmt: skip
    """mla_decode / mla_prefill after their form checks: validation, then the custom op
    (traced) or the kernels; max_tokens bounds the query tokens per sequence (None: any);
    schedule: mla_decode's."""
    scale = check_softmax_scale(softmax_scale)
    ckv, kpe, fp8 = latent_cache_views(ckv_cache, kpe_cache)
    combined = kpe_cache is None and fp8 is None  # FlashMLA's 16-bit cache, its views checked
    args = (q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, out, fp8, lse)
    if _valid_at_a_glance(*args, combined=combined):
        traced = tracing()  # the tensors are plain: only a mode can trace
    else:
        _validate(*args)
        traced = _traced(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, out, lse)
    check_bool("causal", causal)
    if cu_seqlens_q is not None and (
        isinstance(max_seqlen_q, bool) or not isinstance(max_seqlen_q, numbers.Integral)
    ):  # int() took 2.5 as 2
        raise TypeError(f"max_seqlen_q must be an int, got {max_seqlen_q!r}")
    mq = q_nope.shape[1] if cu_seqlens_q is None else int(max_seqlen_q)
    if mq < 1 or (max_tokens is not None and mq > max_tokens):
        bound = "" if max_tokens is None else f"..{max_tokens} (mla_prefill takes more)"
        raise ValueError(f"max_seqlen_q must be 1{bound}, got {mq}")
    work = schedule_work(schedule, q_nope, page_table, ckv, cu_seqlens_q, mq, causal, fp8)
    if out is not None and out.stride(-1) != 1:  # the kernel writes rows of 512 contiguous
        o, lse = _attend(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, scale,
                         cu_seqlens_q, max_seqlen_q, causal, True, None, lse,
                         max_tokens, schedule)  # fmt: skip
        out.copy_(o)
        return (out, lse) if return_lse else out
    if lse is not None and not lse.is_contiguous():  # in place only where it is compact
        o, fresh = _attend(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, scale,
                           cu_seqlens_q, max_seqlen_q, causal, True, out, None,
                           max_tokens, schedule)  # fmt: skip
        lse.copy_(fresh)
        return (o, lse) if return_lse else o
    if traced:
        o, fresh = torch.ops.forgekernel.mla_decode(
            q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, scale, mq, bool(causal),
            fp8, *(work or (None, None)),
        )  # fmt: skip
        o, lse = into_buffers(o, fresh, out, lse)
    else:
        check_caches_in_place(ckv, kpe, fp8, combined)  # (a data pointer: real tensors only)
        rows_cu = None if schedule is None else schedule.rows_cu
        o, lse = _forward(q_nope, q_pe, ckv, kpe, page_table, seqlens_k, cu_seqlens_q, scale,
                          mq, bool(causal), out, fp8, lse, work, rows_cu)  # fmt: skip
    return (o, lse) if return_lse else o


def mla_paged_decode_flashinfer(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
    kv_last_page_len: torch.Tensor | None = None,
    *,
    max_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `mla_paged_decode_h16_ckv512_kpe64_ps{1,64}` as it is (keyword names
    theirs, so `(**inputs)` works for both page sizes): q_nope (batch, H, 512), q_pe (batch,
    H, 64), caches (num_pages, page_size, 512 / 64), CSR page lists kv_indptr int32 (batch +
    1,) / kv_indices int32, kv_last_page_len int32 (batch,) (None: every page full, their page
    size 1), sm_scale a float or 0-d tensor -> (output (batch, H, 512) in q's dtype, lse
    (batch, H) fp32 base 2). max_pages bounds every sequence's page count; None reads it from
    kv_indptr (a device sync: give it to capture a CUDA graph)."""
    check_tensor("q_nope", q_nope, ndim=3, cuda=False)
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
    check_tensor("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX, cuda=False)
    check_tensor("kv_indices", kv_indices, ndim=1, dtypes=INDEX, cuda=False)
    batch = kv_indptr.shape[0] - 1
    if q_nope.shape[0] != batch:
        raise ValueError(f"kv_indptr has {batch + 1} entries for a batch of {q_nope.shape[0]}")
    if kv_last_page_len is not None:
        check_shaped("kv_last_page_len", kv_last_page_len, (batch,), INDEX)
    reject_fp8_cache("ckv_cache", ckv_cache)
    check_tensor("ckv_cache", ckv_cache, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
    if max_pages is None:
        counts = kv_indptr[1:] - kv_indptr[:-1]
        max_pages = max(1, int(counts.max())) if batch > 0 else 1
    # csr_page_table gathers kv_indices at clamped positions: an empty list gets one dummy page
    indices = kv_indices if kv_indices.numel() else kv_indices.new_zeros(1)
    table, seqlens = csr_page_table(kv_indptr, indices, kv_last_page_len, ckv_cache.shape[1],
                                    max_pages)  # fmt: skip
    out, lse = mla_decode(
        q_nope[:, None], q_pe[:, None], ckv_cache, kpe_cache, table, seqlens,
        softmax_scale=float(sm_scale), return_lse=True,
    )  # fmt: skip
    return out[:, 0], lse[..., 0] * LOG2E


def mla_paged_prefill_flashinfer(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
    kv_last_page_len: torch.Tensor | None = None,
    *,
    max_seqlen_q: int | None = None,
    max_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `mla_paged_prefill_causal_h16_ckv512_kpe64_ps{1,64}` as it is
    (keyword names theirs): q_nope (total_q, H, 512), q_pe (total_q, H, 64) by qo_indptr int32
    (batch + 1,), caches (num_pages, page_size, 512 / 64), CSR page lists kv_indptr /
    kv_indices int32 (kv_last_page_len None: every page full), sm_scale a float or 0-d tensor
    -> (output (total_q, H, 512) in q's dtype, lse (total_q, H) fp32 base 2); causal, each
    sequence's queries its last tokens. max_seqlen_q / max_pages bound the sequences' query
    tokens and page counts; None reads them from the indptrs (a device sync: give both to
    capture a CUDA graph)."""
    check_tensor("q_nope", q_nope, ndim=3, cuda=False)
    check_tensor("qo_indptr", qo_indptr, ndim=1, dtypes=INDEX, cuda=False)
    check_tensor("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX, cuda=False)
    check_tensor("kv_indices", kv_indices, ndim=1, dtypes=INDEX, cuda=False)
    batch = kv_indptr.shape[0] - 1
    if qo_indptr.shape[0] != batch + 1:
        raise ValueError(f"qo_indptr has {qo_indptr.shape[0]} entries, kv_indptr {batch + 1}")
    reject_fp8_cache("ckv_cache", ckv_cache)
    check_tensor("ckv_cache", ckv_cache, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
    if max_pages is None:
        counts = kv_indptr[1:] - kv_indptr[:-1]
        max_pages = max(1, int(counts.max())) if batch > 0 else 1
    if max_seqlen_q is None:
        lens = qo_indptr[1:] - qo_indptr[:-1]
        max_seqlen_q = max(1, int(lens.max())) if batch > 0 else 1
    indices = kv_indices if kv_indices.numel() else kv_indices.new_zeros(1)
    table, seqlens = csr_page_table(kv_indptr, indices, kv_last_page_len, ckv_cache.shape[1],
                                    max_pages)  # fmt: skip
    out, lse = mla_prefill(
        q_nope, q_pe, ckv_cache, kpe_cache, table, seqlens, qo_indptr, max_seqlen_q,
        softmax_scale=float(sm_scale), return_lse=True,
    )  # fmt: skip
    return out, lse.t() * LOG2E
