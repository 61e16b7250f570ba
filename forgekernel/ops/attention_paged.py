"""`forgekernel.ops.attention_paged.attention_paged`: attention over a paged KV cache (vLLM /
FlashAttention layout), GQA decode and speculative decoding / MTP (up to 4 query tokens per
sequence), 16-bit or FP8 (e4m3) caches, FlashInfer's CSR page lists (kernels:
kernels/attention/paged/sm90).

Chunked prefill (more than 4 query tokens in some sequence) runs the whole batch, decode rows
beside the chunks included, in one launch of the attention forward's paged mode
(kernels/attention/fwd/sm90, page_box > 0) on GQA-packed views of q, out and lse (FA4's form,
no copy: `prefill_form("packed_views")`, the default where the G = Hq / Hkv query heads a kv
head have a packed compile, `launch.view_group`: G 1, 2, 4, 8, 16). Other G, and
`prefill_form("split")`, split the batch on the device: the sequences of up to 4 query tokens
run the decode kernel, the others the paged mode, each kernel skipping the other's sequences,
both writing their rows of the same out and lse (`_split_prefill`). The paged mode reads
the pages in place, one TMA box per page of a key tile, for 16-bit caches whose page size it
covers (a multiple of 8 rows that divides the key tile or that the tile divides: 8 to 128 and
beyond, `launch.paged_box`). The rest, FP8 caches
and pages of 1 (or of a size like 24), gather the sequences' pages into packed K / V (FP8
dequantized) and run the varlen forward (`ops.attention_varlen`) on the whole batch: correct,
paying one copy of the keys and values the batch's table spans."""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_sm90
from forgekernel.kernels.attention.fwd.sm90.config import PAGED_MIN_SEQLEN_Q
from forgekernel.kernels.attention.paged.sm90 import launch as paged_sm90
from forgekernel.kernels.attention.paged.sm90.config import HEAD_DIMS
from forgekernel.ops._dispatch import into_buffers, plain, refuse_capture, tracing
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    FLOAT16_TYPES,
    check_bool,
    check_cuda,
    check_offsets,
    check_page_values,
    check_rows_in_place,
    check_same_device,
    check_same_dtype,
    check_scale,
    check_schedule_problem,
    check_shaped,
    check_tensor,
    on_one_device,
)
from forgekernel.ops.attention_varlen import attention_varlen as _attention_varlen
from forgekernel.runtime.device import on_device
from forgekernel.runtime.plans import overriding
from forgekernel.runtime.scratch import scratch

INDEX = (torch.int32,)
MAX_QUERY_TOKENS = 4  # per sequence in the decode kernel; more: the forward's paged mode
assert PAGED_MIN_SEQLEN_Q == MAX_QUERY_TOKENS + 1  # the two kernels' sequences partition a batch
CACHE_DTYPES = (torch.float16, torch.bfloat16, torch.float8_e4m3fn)


def _split_cache(k_cache, v_cache):
    """(k, v): a combined (num_pages, 2, page_size, Hkv, D) cache passed as k_cache with
    v_cache None gives its two halves (views)."""
    if v_cache is None:
        check_tensor("k_cache", k_cache, ndim=5, cuda=False)
        if k_cache.shape[1] != 2:
            raise ValueError(
                f"a combined cache is (num_pages, 2, page_size, Hkv, D), got {tuple(k_cache.shape)}"
            )
        return k_cache[:, 0], k_cache[:, 1]
    return k_cache, v_cache


def _scale_tensor(name: str, scale, hkv: int, device) -> torch.Tensor:
    """An FP8 cache's dequantization scale as fp32 (Hkv,): a python float or 0-d tensor per
    tensor, or a (Hkv,) tensor per KV head."""
    if scale is None:
        raise ValueError(f"an FP8 cache needs {name} (a float, or a float32 tensor (Hkv,))")
    if isinstance(scale, torch.Tensor):
        if scale.dim() == 0 or scale.shape == (1,):
            return scale.reshape(1).to(torch.float32).expand(hkv).contiguous()
        check_shaped(name, scale, (hkv,), (torch.float32,))
        return scale.contiguous()
    return _constant_scale(float(scale), hkv, torch.device(device))


_CONSTANT_SCALES: dict[tuple, torch.Tensor] = {}


def _unit_scale(value: object) -> bool:
    """None or the python number 1.0: a scale that leaves a 16-bit cache's result unchanged."""
    return value is None or (
        isinstance(value, numbers.Real) and not isinstance(value, bool) and float(value) == 1.0
    )


def _constant_scale(value: float, hkv: int, device: torch.device) -> torch.Tensor:
    """A python-float scale as fp32 (Hkv,), made once per (value, Hkv, device) so that a decode
    step does not launch a fill per call; made afresh (a captured fill) inside a CUDA-graph
    capture, whose allocations must not outlive their graph in a cache, and in a traced call,
    whose tensor is fake (cached, the 2026-12-05 audit found it handed to later eager calls)."""
    if tracing() or (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
        return torch.full((hkv,), value, dtype=torch.float32, device=device)
    key = (value, hkv, device)
    t = _CONSTANT_SCALES.get(key)
    if t is None:
        if len(_CONSTANT_SCALES) >= 64:
            _CONSTANT_SCALES.clear()
        t = _CONSTANT_SCALES[key] = torch.full((hkv,), value, dtype=torch.float32, device=device)
    return t


def lse_shape(q, cu_seqlens_q) -> tuple[int, int]:
    """The LSE's shape (OPS.md): (batch, Hq) for decode, (Hq, total_q) packed."""
    rows, hq = q.shape[0], q.shape[1]
    return (rows, hq) if cu_seqlens_q is None else (hq, rows)


def _validate(q, k, v, page_table, seqlens_k, out, cu_seqlens_q=None, lse=None):
    check_tensor("q", q, ndim=3, cuda=False)
    check_tensor("k_cache", k, ndim=4, dtypes=CACHE_DTYPES, cuda=False)
    check_tensor("v_cache", v, ndim=4, dtypes=CACHE_DTYPES, cuda=False)
    check_same_dtype(k_cache=k, v_cache=v)
    if k.dtype != torch.float8_e4m3fn and k.dtype != q.dtype:
        raise TypeError(f"a 16-bit cache must have q's dtype ({q.dtype}), got {k.dtype}")
    rows, hq, d = q.shape
    b = rows if cu_seqlens_q is None else cu_seqlens_q.shape[0] - 1
    if cu_seqlens_q is not None:
        check_tensor("cu_seqlens_q", cu_seqlens_q, ndim=1, dtypes=INDEX, cuda=False)
    pages, page_size, hkv, dk = k.shape
    if dk != d or tuple(v.shape) != tuple(k.shape):
        raise ValueError(
            f"k_cache {tuple(k.shape)} and v_cache {tuple(v.shape)} must both be "
            f"(num_pages, page_size, Hkv, {d}) for q {tuple(q.shape)}"
        )
    if d not in HEAD_DIMS:
        raise ValueError(f"head dim must be one of {HEAD_DIMS}, got {d}")
    if hq % hkv:
        raise ValueError(f"query heads ({hq}) must be a multiple of KV heads ({hkv})")
    check_tensor("page_table", page_table, ndim=2, dtypes=INDEX, cuda=False)
    if page_table.shape[0] != b:
        raise ValueError(f"page_table has {page_table.shape[0]} rows for a batch of {b}")
    check_shaped("seqlens_k", seqlens_k, (b,), INDEX)
    if out is not None:
        check_shaped("out", out, (rows, hq, d), (q.dtype,))
    if lse is not None:
        check_shaped("lse", lse, lse_shape(q, cu_seqlens_q), (torch.float32,))
    check_cuda("q", q)
    extra = {} if out is None else {"out": out}
    if lse is not None:
        extra["lse"] = lse
    check_same_device(q=q, k_cache=k, v_cache=v, page_table=page_table, seqlens_k=seqlens_k,
                      **extra)  # fmt: skip
    return rows, hq, d


def _check_values(q, k, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q) -> None:
    """validate=True: what the shapes cannot say (pages in the cache, lengths within the
    table, the query offsets), read back on the host."""
    refuse_capture("attention_paged(validate=True) reads its index tensors back", q)
    check_page_values(page_table, seqlens_k, k.shape[0], k.shape[1])
    if cu_seqlens_q is None:
        return
    check_offsets("cu_seqlens_q", cu_seqlens_q, q.shape[0], "q's rows")
    counts = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).cpu()
    if counts.numel() and int(counts.max()) > max_seqlen_q:
        b = int(counts.argmax())
        raise ValueError(
            f"cu_seqlens_q gives sequence {b} {int(counts[b])} query tokens, more than"
            f" max_seqlen_q = {max_seqlen_q}"
        )


def _valid_at_a_glance(q, k, v, page_table, seqlens_k, out, cu_seqlens_q, lse=None) -> bool:
    """`_validate`'s checks in one pass over plain tensors (the common eager call): True when
    every check passes (check_cuda, which raises, last as in `_validate`); False sends the call
    through `_validate`, whose named checks raise (issue 17)."""
    if not plain(q, k, v, page_table, seqlens_k, optional=(out, cu_seqlens_q, lse)):
        return False
    dtype, shape, kv_dtype, kv = q.dtype, q.shape, k.dtype, k.shape
    if cu_seqlens_q is None:
        b = shape[0] if len(shape) == 3 else -1
    elif cu_seqlens_q.dtype != torch.int32 or cu_seqlens_q.dim() != 1:
        return False
    else:
        b = cu_seqlens_q.shape[0] - 1
    if not (
        dtype in FLOAT16_TYPES and len(shape) == 3 and b >= 0
        and (kv_dtype == dtype or kv_dtype == torch.float8_e4m3fn) and v.dtype == kv_dtype
        and len(kv) == 4 and v.shape == kv and kv[3] == shape[2] and shape[2] in HEAD_DIMS
        and kv[2] > 0 and shape[1] % kv[2] == 0
        and page_table.dtype == torch.int32 and page_table.dim() == 2
        and page_table.shape[0] == b
        and seqlens_k.dtype == torch.int32 and seqlens_k.shape == (b,)
        and (out is None or (out.dtype == dtype and out.shape == shape))
        and (lse is None or (lse.dtype == torch.float32
                             and lse.shape == lse_shape(q, cu_seqlens_q)))
    ):  # fmt: skip
        return False
    check_cuda("q", q)
    return on_one_device(q, k, v, page_table, seqlens_k, out, lse)


@torch.library.custom_op("forgekernel::attention_paged_decode", mutates_args=())
def _decode_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    max_seqlen_q: int,
    causal: bool,
    schedule_work: torch.Tensor | None = None,
    schedule_rows: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows_in_place("k_cache", k_cache, 16)
    check_rows_in_place("v_cache", v_cache, 16)
    out, lse = _outputs(q, cu_seqlens_q, None)
    scheduled = None if schedule_work is None else (schedule_work, schedule_rows)
    paged_sm90.paged_decode(
        q, k_cache, v_cache, page_table, seqlens_k, softmax_scale, out,
        lse if cu_seqlens_q is None else lse.t(), k_scale, v_scale, cu_seqlens_q,
        max_seqlen_q, causal, scheduled=scheduled,
    )  # fmt: skip
    return out, lse


@_decode_op.register_fake
def _(q, k_cache, v_cache, page_table, seqlens_k, softmax_scale, k_scale, v_scale, cu_seqlens_q,
      max_seqlen_q, causal, schedule_work=None, schedule_rows=None):  # fmt: skip
    return _outputs(q, cu_seqlens_q, None)


class AttentionPagedSchedule:
    """A decode step's work list (`attention_paged_schedule`): `work` the scheduling kernel's
    int32 list on the device, `rows` each sequence's item range (int32 (batch, 3)), and the
    problem it was made for, which every `attention_paged(..., schedule=)` call checks (its
    lengths are the caller's to keep: the list was made from seqlens_k as it was then)."""

    def __init__(self, work, rows, batch, num_heads, num_kv_heads, head_dim, max_pages,
                 page_size, dtype):  # fmt: skip
        self.work, self.rows = work, rows
        self.problem = (batch, num_heads, num_kv_heads, head_dim, max_pages, page_size, dtype)

    def __repr__(self) -> str:
        pairs = ", ".join(f"{n}={v}" for n, v in zip(_SCHEDULE_NAMES, self.problem))
        return f"AttentionPagedSchedule({pairs})"


_SCHEDULE_NAMES = ("batch", "num_heads", "num_kv_heads", "head_dim", "max_pages", "page_size",
                   "dtype")  # fmt: skip


@torch.library.custom_op("forgekernel::attention_paged_schedule", mutates_args=())
def _schedule_op(
    seqlens_k: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    max_pages: int,
    page_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    return paged_sm90.make_schedule(seqlens_k, num_heads, num_kv_heads, head_dim, max_pages,
                                    page_size)  # fmt: skip


@_schedule_op.register_fake
def _(seqlens_k, num_heads, num_kv_heads, head_dim, max_pages, page_size):
    shapes = paged_sm90.schedule_shapes(seqlens_k.shape[0], num_heads, num_kv_heads, head_dim,
                                        max_pages, page_size, seqlens_k.device.index)  # fmt: skip
    return seqlens_k.new_empty(shapes[0]), seqlens_k.new_empty(shapes[1])


def attention_paged_schedule(
    seqlens_k: torch.Tensor,
    page_table: torch.Tensor,
    *,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    dtype: torch.dtype = torch.bfloat16,
) -> AttentionPagedSchedule:
    """The work list of one decode step, made once and read by every layer's
    `attention_paged(..., schedule=)` (FlashInfer's plan, on the device: one launch, no host
    read, graph-capturable): the keys per split chosen over the batch's real lengths, a long
    sequence among short ones cut into many splits. seqlens_k int32 (batch,) and page_table
    int32 (batch, max_pages) as the calls' (only the table's shape is read); num_heads /
    num_kv_heads the query / KV heads, head_dim (64, 128, 256), page_size the cache's, dtype q's
    (16-bit caches, one query token a sequence: the decode form). The lengths must stay what
    they were when the schedule was made. A batch of one sequence gets an empty list: its call
    keeps the width plan, which spreads that sequence's keys over every split already."""
    check_tensor("seqlens_k", seqlens_k, ndim=1, dtypes=INDEX, cuda=False)
    check_cuda("seqlens_k", seqlens_k)
    b = seqlens_k.shape[0]
    check_shaped("page_table", page_table, (b, page_table.shape[-1]), INDEX)
    for name, value in (("num_heads", num_heads), ("num_kv_heads", num_kv_heads),
                        ("page_size", page_size)):  # fmt: skip
        if not isinstance(value, numbers.Integral) or value < 1:
            raise ValueError(f"{name} must be an int >= 1, got {value!r}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads ({num_heads}) must be a multiple of num_kv_heads "
                         f"({num_kv_heads})")  # fmt: skip
    if head_dim not in HEAD_DIMS:
        raise ValueError(f"head_dim must be one of {HEAD_DIMS}, got {head_dim!r}")
    if dtype not in FLOAT16_TYPES:
        raise ValueError(f"dtype must be float16 or bfloat16, got {dtype}")
    check_same_device(seqlens_k=seqlens_k, page_table=page_table)
    args = (num_heads, num_kv_heads, head_dim, page_table.shape[1], page_size)
    if _traced(seqlens_k, page_table):
        work, rows = torch.ops.forgekernel.attention_paged_schedule(seqlens_k, *args)
    else:
        work, rows = paged_sm90.make_schedule(seqlens_k, *args)
    return AttentionPagedSchedule(work, rows, b, *args[:4], page_size, dtype)


def _schedule_tensors(schedule, q, k, page_table, cu_seqlens_q):
    """The (list, row ranges) `schedule` brings to this call (None without one), or ValueError
    when it was made for another problem or this call cannot take one."""
    if schedule is None:
        return None
    if not isinstance(schedule, AttentionPagedSchedule):
        raise TypeError(f"schedule must be an AttentionPagedSchedule, got "
                        f"{type(schedule).__name__}")  # fmt: skip
    if cu_seqlens_q is not None:
        raise ValueError("a schedule serves the decode form (one query token a sequence, "
                         "no cu_seqlens_q)")  # fmt: skip
    if k.dtype == torch.float8_e4m3fn:
        raise ValueError("a schedule serves 16-bit caches")
    here = (q.shape[0], q.shape[1], k.shape[2], q.shape[2], page_table.shape[1], k.shape[1],
            q.dtype)  # fmt: skip
    check_schedule_problem(_SCHEDULE_NAMES, here, schedule.problem)
    if schedule.work.device != q.device:
        raise ValueError(f"schedule is on {schedule.work.device}, q on {q.device}")
    return schedule.work, schedule.rows


@torch.library.custom_op("forgekernel::attention_paged_prefill", mutates_args=())
def _prefill_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_rows_in_place("k_cache", k_cache, 16)
    check_rows_in_place("v_cache", v_cache, 16)
    out, lse = _outputs(q, cu_seqlens_q, None)
    _run_prefill(q, k_cache, v_cache, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q,
                 softmax_scale, causal, out, lse)  # fmt: skip
    return out, lse


@_prefill_op.register_fake
def _(q, k_cache, v_cache, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, softmax_scale,
      causal):  # fmt: skip
    return _outputs(q, cu_seqlens_q, None)


def _outputs(q, cu_seqlens_q, out, lse=None):
    """(out, lse): lse (rows, Hq) for decode, (Hq, total_q) for the packed form (OPS.md); the
    caller's where given."""
    o = out if out is not None else torch.empty_like(q)
    if lse is not None:
        return o, lse
    return o, q.new_empty(lse_shape(q, cu_seqlens_q), dtype=torch.float32)


def attention_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    validate: bool = False,
    schedule: AttentionPagedSchedule | None = None,
):
    """Decode: q (batch, Hq, D), one query per sequence, against caches (num_pages,
    page_size, Hkv, D) (or one combined (num_pages, 2, page_size, Hkv, D) cache as k_cache with
    v_cache None), page_table int32 (batch, max_pages), seqlens_k int32 (batch,). Returns out
    (batch, Hq, D) and, with return_lse, the natural-log LSE (batch, Hq) fp32; a sequence of
    length 0 gives 0 and -inf. Speculative decoding / MTP and chunked prefill: q (total_q, Hq,
    D) packed by cu_seqlens_q int32 (batch + 1,) with max_seqlen_q (a host int) at least the
    longest, each sequence's queries its last tokens (causal: bottom-right), out (total_q, Hq,
    D), LSE (Hq, total_q); up to 4 query tokens per sequence run the decode kernel, more the
    forward's paged mode (the whole batch, or split: module docstring; or the gather path).
    GQA: query head h reads KV head h // (Hq / Hkv). An FP8 (e4m3) cache holds K / k_scale and
    V / v_scale: each scale a float (per tensor) or a float32 tensor (Hkv,) (per KV head).
    out / lse: buffers of the outputs' shapes (out in q's dtype, lse fp32) written in place
    (the bench's call: no allocation, no copy; lse is returned with return_lse).
    validate=True (eager calls; off by default: it syncs and cannot be captured) also checks
    the values: every page a sequence reads within [0, num_pages), seqlens_k within [0,
    page_table's width x page_size], cu_seqlens_q from 0 to total_q, non-decreasing, no
    sequence above max_seqlen_q; ValueError naming the entry. Unchecked, such values read
    outside the cache or misread the batch.
    schedule: a decode step's `attention_paged_schedule` (decode form, 16-bit caches): the
    splits by the batch's real lengths instead of the table's width."""
    if (cu_seqlens_q is None) != (max_seqlen_q is None):
        raise ValueError("cu_seqlens_q and max_seqlen_q come together")
    if max_seqlen_q is not None and max_seqlen_q < 1:
        raise ValueError(f"max_seqlen_q must be >= 1, got {max_seqlen_q}")
    k, v = _split_cache(k_cache, v_cache)
    if _valid_at_a_glance(q, k, v, page_table, seqlens_k, out, cu_seqlens_q, lse):
        d, traced = q.shape[2], tracing()  # the tensors are plain: only a mode can trace
    else:
        _, _, d = _validate(q, k, v, page_table, seqlens_k, out, cu_seqlens_q, lse)
        traced = _traced(q, k, v, page_table, seqlens_k, out, cu_seqlens_q, lse)
    if validate and not traced:
        _check_values(q, k, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q)
    if lse is not None and not lse.is_contiguous():  # in place only where it is compact
        o, fresh = attention_paged(
            q, k, v, page_table, seqlens_k, cu_seqlens_q=cu_seqlens_q, max_seqlen_q=max_seqlen_q,
            causal=causal, softmax_scale=softmax_scale, return_lse=True, out=out,
            k_scale=k_scale, v_scale=v_scale, schedule=schedule,
        )  # fmt: skip
        lse.copy_(fresh)
        return (o, lse) if return_lse else o
    check_bool("causal", causal)
    scale = check_scale("softmax_scale", softmax_scale, d**-0.5)
    ks = vs = None
    if k.dtype == torch.float8_e4m3fn:
        ks = _scale_tensor("k_scale", k_scale, k.shape[2], q.device)
        vs = _scale_tensor("v_scale", v_scale, k.shape[2], q.device)
    elif not (_unit_scale(k_scale) and _unit_scale(v_scale)):
        # FlashInfer applies k_scale / v_scale to any cache (the reference does too): ignored
        # here they would change the result silently. 1.0 changes nothing (serving engines
        # pass their layers' unit scales with 16-bit caches): accepted.
        raise ValueError(
            f"k_scale / v_scale dequantize an FP8 cache; this cache is {k.dtype} (fold a scale"
            " into softmax_scale, or scale the output)"
        )
    mq = 1 if max_seqlen_q is None else int(max_seqlen_q)
    scheduled = _schedule_tensors(schedule, q, k, page_table, cu_seqlens_q)
    if mq > MAX_QUERY_TOKENS:
        if ks is None and fwd_sm90.paged_box(k.shape[1], d):
            o, lse = _prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, mq, bool(causal),
                              scale, out, traced, lse)  # fmt: skip
        else:
            o, lse = _prefill_by_gather(q, k, v, page_table, seqlens_k, cu_seqlens_q, mq,
                                        causal, scale, ks, vs, out, lse)  # fmt: skip
        return (o, lse) if return_lse else o
    if traced:
        o, fresh = torch.ops.forgekernel.attention_paged_decode(
            q, k, v, page_table, seqlens_k, scale, ks, vs, cu_seqlens_q, mq, bool(causal),
            *(scheduled or ()),
        )  # fmt: skip
        o, lse = into_buffers(o, fresh, out, lse)
    else:
        check_rows_in_place("k_cache", k, 16)  # (a data pointer: real tensors only)
        check_rows_in_place("v_cache", v, 16)
        o, lse = _outputs(q, cu_seqlens_q, out, lse)
        paged_sm90.paged_decode(
            q, k, v, page_table, seqlens_k, scale, o, lse if cu_seqlens_q is None else lse.t(),
            ks, vs, cu_seqlens_q, mq, bool(causal), scheduled=scheduled,
        )  # fmt: skip
    return (o, lse) if return_lse else o


def _prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, causal, scale, out,
             traced, lse=None):  # fmt: skip
    """Chunked prefill on the forward's paged mode alone (the packed form) or on the decode
    kernel and the paged mode (`_split_prefill`): `_run_prefill`. The caches read in place
    (rows contiguous and 16-byte aligned, outer strides multiples of 16 elements, the
    decode's)."""
    if traced:
        o, fresh = torch.ops.forgekernel.attention_paged_prefill(
            q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, scale, causal
        )
        return into_buffers(o, fresh, out, lse)
    check_rows_in_place("k_cache", k, 16)  # (a data pointer: real tensors only)
    check_rows_in_place("v_cache", v, 16)
    o, lse = _outputs(q, cu_seqlens_q, out, lse)
    _run_prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, scale, causal, o,
                 lse)  # fmt: skip
    return o, lse


def decode_lengths(seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor) -> torch.Tensor:
    """The key lengths the decode kernel sees in a chunked-prefill batch: the sequence's own
    where it has at most MAX_QUERY_TOKENS query tokens, else 0 (the forward's sequence: the
    decode reads none of its keys and writes only 0 / -inf into its first rows, which the
    forward, running after it, overwrites). On the device: no host read."""
    q_lens = cu_seqlens_q[1:] - cu_seqlens_q[:-1]
    return seqlens_k.masked_fill(q_lens > MAX_QUERY_TOKENS, 0)


# How a chunked-prefill batch on the paged mode runs (`prefill_form`): "packed_views" (the
# default: one launch of the whole batch on GQA-packed views, where `launch.view_group` has a
# compile for the batch's G, else the split) or "split" (`_split_prefill`). H200 2026-12-04
# 20:10, time / split on the five prefill bench cases (bf16 D 128 causal, G 4 and 8): graph
# 0.976, 1.013, 0.965, 0.947, 0.907 (median 0.965), eager flushed 0.989, 1.023, 1.021, 0.938,
# 0.869; the packed form with copies 1.02-1.09 graph (dropped). docs/attention/PAGED_NOTES.md.
PREFILL_FORMS = ("packed_views", "split")
_prefill_form = ["packed_views"]


@contextmanager
def prefill_form(form: str) -> Iterator[None]:
    """The chunked-prefill calls inside (16-bit caches on the paged mode) run as `form`:
    "packed_views" (the default: the forward's paged mode alone on the whole batch, the G query
    heads a kv head read as G rows a token through views of q / out / lse,
    `launch.attention_paged_fwd(packed=True)`, FA4's form; no decode part, no slot glue, no
    copy; the split where the batch's G has no packed compile, `launch.view_group`) or "split"
    (`_split_prefill`: the decode kernel on the sequences of up to MAX_QUERY_TOKENS query
    tokens, then the forward's paged mode on the others; the bench's `split` variant)."""
    if form not in PREFILL_FORMS:
        raise ValueError(f"prefill form must be one of {PREFILL_FORMS}, got {form!r}")
    with overriding(_prefill_form, form):
        yield


def _run_prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, scale, causal, o,
                 lse):  # fmt: skip
    """A chunked-prefill batch into o / lse in the `prefill_form` in force: packed where the
    batch's G has a packed compile (`launch.view_group`), else split."""
    packed = _prefill_form[0] == "packed_views"
    if packed and fwd_sm90.view_group(q.shape[1] // k.shape[2], q.shape[2]):
        fwd_sm90.attention_paged_fwd(q, k, v, o, lse, page_table, seqlens_k, cu_seqlens_q,
                                     max_seqlen_q, scale, causal, packed=True)  # fmt: skip
    else:
        _split_prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, scale,
                       causal, o, lse)  # fmt: skip


def _split_prefill(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, scale, causal, o,
                   lse):  # fmt: skip
    """A chunked-prefill batch in two parts on the current stream, in this order (the decode
    part writes rows of the longer sequences too, which the forward overwrites): the decode
    kernel on the sequences of up to MAX_QUERY_TOKENS query tokens (`_decode_part`), then the
    forward's paged mode, whose tiles skip those sequences (config.PAGED_MIN_SEQLEN_Q) and which
    writes every row of the others. Before the split the forward ran the whole batch: each
    decode row a 128-row query tile a head over all its keys."""
    _decode_part(q, k, v, page_table, seqlens_k, cu_seqlens_q, scale, causal, o, lse)
    fwd_sm90.attention_paged_fwd(q, k, v, o, lse, page_table, seqlens_k, cu_seqlens_q,
                                 max_seqlen_q, scale, causal)  # fmt: skip


def _decode_part(q, k, v, page_table, seqlens_k, cu_seqlens_q, scale, causal, o, lse):
    """The decode rows of a chunked-prefill batch (sequences of 1 .. MAX_QUERY_TOKENS query
    tokens) into o / lse (Hq, total_q), no host read. Where the decode's split plan for the
    batch has one split (the batch's CTAs fill the GPU: host-known), the whole batch in its
    packed form at one split, the forward's sequences given no keys (`decode_lengths`; the
    pass writes only each sequence's first rows). Else the split plan over a compact batch of
    MAX_QUERY_TOKENS slots a sequence (`decode_slots`), whose combine writes only its slots'
    rows (a combine over the packed batch would write every row of it: 7696 rows x 32 heads
    at c512-4096), then its rows copied into o / lse: the ragged bench case's 12,345-key
    decode row at one split was 8 CTAs streaming it (0.27 ms against 0.04 with the plan). The
    per-element merge (merge ""): merge "rows", the spec leaves' default since 2026-12-04
    04:39, was not timed on these calls (docs/attention/PAGED_NOTES.md)."""
    b, rows = seqlens_k.shape[0], q.shape[0]
    if rows == 0 or b == 0:
        return
    t = MAX_QUERY_TOKENS
    if paged_sm90.packed_splits(q, k, page_table, b, t, merge="") == 1:
        paged_sm90.paged_decode(
            q, k, v, page_table, decode_lengths(seqlens_k, cu_seqlens_q), scale, o, lse.t(),
            None, None, cu_seqlens_q, t, causal, one_split=True, merge="",
        )  # fmt: skip
        return
    keys, dst, src = decode_slots(seqlens_k, cu_seqlens_q, rows)
    hq, d = q.shape[1], q.shape[2]
    with on_device(q.device):  # the current stream's scratch: read only by this call
        q_c = torch.index_select(q, 0, dst, out=scratch("paged.slots_q", (b * t, hq, d),
                                                             q.dtype, q.device))  # fmt: skip
        o_c = scratch("paged.slots_o", (b * t, hq, d), q.dtype, q.device)
        lse_c = scratch("paged.slots_lse", (b * t, hq), torch.float32, q.device)
    cu_c = torch.arange(0, b * t + 1, t, dtype=torch.int32, device=q.device)
    paged_sm90.paged_decode(q_c, k, v, page_table, keys, scale, o_c, lse_c, None, None, cu_c, t,
                            causal, merge="")  # fmt: skip
    o.index_copy_(0, dst, o_c.index_select(0, src))
    lse.t().index_copy_(0, dst, lse_c.index_select(0, src))


def decode_slots(seqlens_k: torch.Tensor, cu_seqlens_q: torch.Tensor, rows: int):
    """The compact decode batch of a chunked-prefill batch of `rows` query rows, on the device
    (no host read; static shapes: CUDA graphs, torch.compile). Sequence b gets T =
    MAX_QUERY_TOKENS slots, slot j on its packed row cu[b + 1] - T + j: a sequence of sq <= T
    tokens has them in its last sq slots, where the bottom-right causal mask of T tokens gives
    each token its own keys; the first T - sq slots are padding. Returns (keys, rows_of,
    src): keys int32 (B,), each sequence's key length where it has 1 .. T query tokens, else
    0 (the forward's sequences and those without queries load no key); rows_of int64 (B T,),
    a slot's packed row, where it reads its query and which `o[rows_of] = o_slots[src]`
    writes; src int64 (B T,). A slot on a row of its own sequence reads and writes that row
    (the forward's sequences' last rows too: the forward, running after, overwrites them); a
    padding slot, or one of a sequence without queries, takes row rows - 1 and src the slot
    that computes that row (the batch's last row: some sequence's), so that row is written
    twice with one value and no copy races another of a different value."""
    t = MAX_QUERY_TOKENS
    start = cu_seqlens_q[:-1]
    row = cu_seqlens_q[1:, None] + torch.arange(-t, 0, device=cu_seqlens_q.device)  # int64
    valid = row >= start[:, None]  # the slot's row is its sequence's
    keys = torch.where((row[:, 0] <= start) & valid[:, -1], seqlens_k, 0)  # 1 .. T tokens
    flat, ok = torch.where(valid, row, -1).flatten(), valid.flatten()
    last = flat.argmax()  # the first slot on row rows - 1 (some sequence's last row)
    src = torch.where(ok, torch.arange(flat.numel(), device=row.device), last)
    dst = torch.where(ok, flat, rows - 1)
    return keys, dst, src


def _prefill_by_gather(q, k, v, page_table, seqlens_k, cu_seqlens_q, max_seqlen_q, causal,
                       scale, ks, vs, out, lse=None):  # fmt: skip
    """Chunked prefill where the paged mode does not reach (FP8 caches, pages of 1 or of a
    size that neither divides the key tile nor is divided by it): every sequence's keys and
    values gathered from their pages into packed (total_k, Hkv, D) tensors (room for the page
    table's full width per sequence: no device read), FP8 dequantized, then the varlen
    forward."""
    b, max_pages = page_table.shape
    page_size, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    width = max_pages * page_size
    t = torch.arange(width, device=q.device)
    pages = page_table.long()[:, t // page_size]  # (B, width)
    slots = (t % page_size).expand(b, width)
    lens = seqlens_k.long()
    cu_k = torch.zeros(b + 1, dtype=torch.long, device=q.device)
    cu_k[1:] = torch.cumsum(lens, 0)
    room = b * width
    dst = torch.where(t[None, :] < lens[:, None], cu_k[:-1, None] + t[None, :], room)

    def packed(cache, scale):
        rows = cache[pages, slots]  # (B, width, Hkv, D)
        if scale is not None:
            rows = (rows.float() * scale[:, None]).to(q.dtype)
        buf = torch.zeros(room + 1, hkv, d, dtype=q.dtype, device=q.device)
        buf[dst.flatten()] = rows.reshape(-1, hkv, d)
        # the slots past the sequences landed in row `room`, which the last sequence's tail
        # tile may read (masked): whatever they held, no NaN there may reach O through P = 0
        buf[room] = 0
        return buf

    o_out = None
    if out is not None or lse is not None:  # the caller's buffers, written by the forward
        o_out = (
            torch.empty_like(q) if out is None else out,
            q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32) if lse is None else lse,
        )
    o, lse = _attention_varlen(
        # max(width, 1): a table of no columns still packs one (zero) key row, and the
        # forward reads no max_seqlen_k (the varlen checks want >= 1 wherever k has a row)
        q, packed(k, ks), packed(v, vs), cu_seqlens_q, cu_k.int(), max_seqlen_q, max(width, 1),
        causal=causal, softmax_scale=scale, return_lse=True, out=o_out,
    )  # fmt: skip
    return o, lse


def csr_page_table(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor | None,
    page_size: int,
    max_pages: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's page lists as (page_table int32 (batch, max_pages), seqlens_k int32):
    sequence b's pages are kv_indices[kv_indptr[b]:kv_indptr[b + 1]], its last page holds
    kv_last_page_len[b] tokens (None: every page full, FlashInfer's page size 1). No host read
    (CUDA-graph capturable): `max_pages` bounds every sequence's page count; unused table
    entries are page 0 (never read). Values are not checked."""
    indptr = kv_indptr.long()
    counts = indptr[1:] - indptr[:-1]
    last = counts.new_full(counts.shape, page_size) if kv_last_page_len is None else (
        kv_last_page_len.long()
    )  # fmt: skip
    seqlens = torch.where(counts > 0, (counts - 1) * page_size + last, 0).int()
    col = torch.arange(max_pages, device=indptr.device)
    flat = (indptr[:-1, None] + col[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
    used = col[None, :] < counts[:, None]
    if kv_indices.numel() == 0:  # every sequence empty: nothing to index
        return torch.zeros_like(flat, dtype=torch.int32), seqlens
    table = torch.where(used, kv_indices.long()[flat], 0).int()
    return table, seqlens


def attention_paged_csr(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor | None,
    *,
    max_pages: int,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    k_scale: float | torch.Tensor | None = None,
    v_scale: float | torch.Tensor | None = None,
    validate: bool = False,
):
    """`attention_paged` with FlashInfer's CSR page lists (`csr_page_table`; FlashInfer's
    qo_indptr is cu_seqlens_q); the LSE stays natural log (FlashInfer's is base 2: multiply by
    log2 e). validate=True (a sync, as `attention_paged`'s) first checks the lists: kv_indptr
    from 0, non-decreasing, within kv_indices; no sequence above max_pages pages; its pages
    within [0, num_pages); kv_last_page_len within [1, page_size] for a non-empty sequence."""
    k = k_cache if v_cache is not None else _split_cache(k_cache, None)[0]
    _check_csr_lists(kv_indptr, kv_indices, kv_last_page_len, max_pages)
    if validate and not _traced(q, k, kv_indptr, kv_indices, kv_last_page_len):
        _check_csr(kv_indptr, kv_indices, kv_last_page_len, k.shape[0], k.shape[1], max_pages)
    table, seqlens = csr_page_table(kv_indptr, kv_indices, kv_last_page_len, k.shape[1], max_pages)
    return attention_paged(
        q, k_cache, v_cache, table, seqlens, cu_seqlens_q=cu_seqlens_q,
        max_seqlen_q=max_seqlen_q, causal=causal, softmax_scale=softmax_scale,
        return_lse=return_lse, out=out, k_scale=k_scale, v_scale=v_scale, validate=validate,
    )  # fmt: skip


def _check_csr_lists(kv_indptr, kv_indices, kv_last_page_len, max_pages) -> None:
    """Every call: the page lists' dtypes, ranks and lengths and max_pages (no value read;
    a float or 2-D list was otherwise cast or sliced into a wrong table)."""
    check_tensor("kv_indptr", kv_indptr, ndim=1, dtypes=INDEX, cuda=False)
    if kv_indptr.shape[0] < 1:
        raise ValueError("kv_indptr must hold batch + 1 >= 1 offsets, got 0")
    check_tensor("kv_indices", kv_indices, ndim=1, dtypes=INDEX, cuda=False)
    if kv_last_page_len is not None:
        check_shaped("kv_last_page_len", kv_last_page_len, (kv_indptr.shape[0] - 1,), INDEX)
    if isinstance(max_pages, bool) or not isinstance(max_pages, numbers.Integral):
        raise TypeError(f"max_pages must be an int, got {max_pages!r}")
    if max_pages < 0:
        raise ValueError(f"max_pages must be >= 0, got {max_pages}")


def _check_csr(kv_indptr, kv_indices, kv_last_page_len, num_pages, page_size, max_pages):
    """attention_paged_csr(validate=True): the page lists' values, read back on the host."""
    refuse_capture("attention_paged_csr(validate=True) reads its page lists back", kv_indices)
    check_offsets("kv_indptr", kv_indptr, kv_indices.numel(), "kv_indices' length", exact=False)
    indptr = kv_indptr.long().cpu()
    counts = indptr[1:] - indptr[:-1]
    if counts.numel() and int(counts.max()) > max_pages:
        b = int(counts.argmax())
        raise ValueError(
            f"kv_indptr gives sequence {b} {int(counts[b])} pages, more than max_pages ="
            f" {max_pages}"
        )
    ids = kv_indices.long().cpu()[: int(indptr[-1]) if indptr.numel() else 0]
    bad = torch.nonzero((ids < 0) | (ids >= num_pages))
    if bad.numel():
        i = int(bad[0])
        raise ValueError(
            f"kv_indices[{i}] = {int(ids[i])} is outside [0, {num_pages}) (the cache's pages)"
        )
    if kv_last_page_len is not None:
        last = kv_last_page_len.long().cpu()
        bad = torch.nonzero((counts > 0) & ((last < 1) | (last > page_size)))
        if bad.numel():
            b = int(bad[0])
            raise ValueError(
                f"kv_last_page_len[{b}] = {int(last[b])} is outside [1, {page_size}] (page_size)"
                f" for a sequence of {int(counts[b])} pages"
            )
