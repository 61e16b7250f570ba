"""`forgekernel.ops.dsa_indexer`: DeepSeek sparse attention's FP8 lightning indexer (DSA,
DeepSeek-V3.2, issue 22) with its top-k, for prefill (`dsa_indexer`, contiguous keys, causal)
and decode over deep_gemm's paged cache (`dsa_indexer_paged`); `dsa_topk_indexer_flashinfer`
serves FlashInfer-Bench's `dsa_topk_indexer_fp8_h64_d128_topk2048_ps64` as it is;
`dsa_indexer_backward` (ops/dsa_indexer_bwd.py) is the training backward (cuDNN's semantics).

Math (reference/dsa.py, lightning indexer): for query row t and key s,

    I[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])      (q, k float8_e4m3fn)

and each row selects the min(topk, visible) keys of largest I among those it sees (-1 padding).
Selection is exact over the fp32 logits the kernel computes (ties: the lower key first),
order-free by contract; the kernel returns ascending key order. Logits that are -inf or NaN are
never selected.

Kernels (kernels/attention/dsa_indexer/sm90): the logits into an fp32 (rows, keys) buffer, FP8
WGMMA with the keys as M, then the top-k of each row's window, exact radix select in shared
memory (a cluster of CTAs per row beyond 16384 keys). At most MAX_KEYS (131072) keys per row.

Layouts:
    dsa_indexer: q (S, 64, 128) fp8, k (S_kv, 128) fp8, k_scale (S_kv,) fp32, weights (S, 64)
        fp32, optional q_scale (S, 64) fp32 (> 0: folded into the weights, exact in real
        arithmetic since relu(a x) = a relu(x) for a > 0). Causal is bottom-right (query t of
        S sees key s iff s <= t + S_kv - S); packed sequences with cu_seqlens_q / _k int32
        (B + 1,), each sequence its own alignment. Output int32 (S, topk): key rows of k.
    dsa_indexer_paged: q (B, 64, 128) or (B, next_n, 64, 128) fp8 (next_n 1, 2, 4: token i of
        next_n sees positions < seq_lens[b] - next_n + 1 + i), weights (B [x next_n], 64) fp32,
        k_cache deep_gemm's int8 / uint8 (pages, 64, 1, 132) (per page 64 x 128 fp8 bytes, then
        64 fp32 scales; pages 16-byte aligned), seq_lens int32 (B,), block_table int32 (B,
        max_pages). Output int32 (B x next_n, topk): slots page * 64 + offset.
No device data is read on the host: CUDA-graph capturable (FlashInfer's adapter included).
Entries of block_table must be valid pages for every position < seq_lens (the kernel reads no
bounds it is not given); seq_lens past max_pages x 64 are clipped there.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_indexer.sm90 import launch as indexer_sm90
from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    HEAD_DIM,
    HEADS,
    MAX_GRID_Y,
    MAX_KEYS,
    PAGE,
    QTOKENS,
    prefill_chunk_rows,
)
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import check_cuda, check_same_device, check_shaped, check_tensor

# the training backward (ops/dsa_indexer_bwd.py), re-exported here
from forgekernel.ops.dsa_indexer_bwd import dsa_indexer_backward as dsa_indexer_backward

FP8 = (torch.float8_e4m3fn,)
F32 = (torch.float32,)
INDEX = (torch.int32,)
CACHE_DTYPES = (torch.int8, torch.uint8)
PAGE_BYTES = PAGE * (HEAD_DIM + 4)
LOGITS_BUDGET = 1 << 28  # fp32 logits held at once (1 GiB): prefill runs in row chunks
TOPK = 2048


def _check_topk(topk: object) -> int:
    if not isinstance(topk, int) or isinstance(topk, bool) or topk < 1:
        raise ValueError(f"topk must be a positive int, got {topk!r}")
    return topk


# ---------------------------------------------------------------- prefill (contiguous keys)


def _validate(q, k, k_scale, weights, q_scale, cu_q, cu_k, out, topk) -> None:
    check_tensor("q", q, ndim=3, dtypes=FP8, cuda=False)
    if q.shape[1:] != (HEADS, HEAD_DIM):
        raise ValueError(f"q must be (S, {HEADS}, {HEAD_DIM}), got {tuple(q.shape)}")
    check_tensor("k", k, ndim=2, dtypes=FP8, cuda=False)
    if k.shape[1] != HEAD_DIM:
        raise ValueError(f"k must be (S_kv, {HEAD_DIM}), got {tuple(k.shape)}")
    check_shaped("k_scale", k_scale, (k.shape[0],), F32)
    check_shaped("weights", weights, (q.shape[0], HEADS), F32)
    if q_scale is not None:
        check_shaped("q_scale", q_scale, (q.shape[0], HEADS), F32)
    if k.shape[0] > MAX_KEYS:
        raise ValueError(f"k has {k.shape[0]} keys: at most {MAX_KEYS} per row are supported")
    if (cu_q is None) != (cu_k is None):
        raise ValueError("cu_seqlens_q, cu_seqlens_k: give both or neither")
    if cu_q is not None:
        check_tensor("cu_seqlens_q", cu_q, ndim=1, dtypes=INDEX, cuda=False)
        check_shaped("cu_seqlens_k", cu_k, tuple(cu_q.shape), INDEX)
        if cu_q.shape[0] < 2:
            raise ValueError(f"cu_seqlens_q must be (B + 1,) with B >= 1, got {tuple(cu_q.shape)}")
    if out is not None:
        check_shaped("out", out, (q.shape[0], topk), INDEX)
    check_cuda("q", q)
    extra = {n: t for n, t in (("q_scale", q_scale), ("cu_seqlens_q", cu_q),
                               ("cu_seqlens_k", cu_k), ("out", out)) if t is not None}  # fmt: skip
    check_same_device(q=q, k=k, k_scale=k_scale, weights=weights, **extra)


def key_windows(
    rows: int,
    keys: int,
    causal: bool,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_start, k_end) int32 (rows,): the keys row t sees, [k_start, k_end) of k, computed on
    the device (no host read): bottom-right causal within each packed sequence."""
    t = torch.arange(rows, device=device, dtype=torch.int32)
    if cu_seqlens_q is None:
        start = torch.zeros_like(t)
        end = (t + (keys - rows + 1)).clamp(0, keys) if causal else torch.full_like(t, keys)
        return start, end
    seq = torch.searchsorted(cu_seqlens_q[1:].contiguous(), t, right=True).clamp(
        max=cu_seqlens_q.shape[0] - 2
    )
    q0, q1 = cu_seqlens_q[seq], cu_seqlens_q[seq + 1]
    k0, k1 = cu_seqlens_k[seq], cu_seqlens_k[seq + 1]
    if not causal:
        return k0.int(), k1.int()
    end = k0 + (t - q0) + (k1 - k0) - (q1 - q0) + 1
    return k0.int(), torch.minimum(torch.maximum(end, k0), k1).int()


def _prefill(q, k, k_scale, weights, starts, ends, out) -> torch.Tensor:
    """Logits then top-k, in row chunks of at most LOGITS_BUDGET logits."""
    rows, width = q.shape[0], indexer_sm90.logits_width(k.shape[0])
    chunk = prefill_chunk_rows(rows, width, LOGITS_BUDGET)
    q2d = q.reshape(rows * HEADS, HEAD_DIM)
    logits = torch.empty(min(rows, chunk), width, dtype=torch.float32, device=q.device)
    for r0 in range(0, rows, chunk):
        r1 = min(rows, r0 + chunk)
        part = logits[: r1 - r0]
        indexer_sm90.logits_contiguous(q2d[r0 * HEADS : r1 * HEADS], weights[r0:r1], k, k_scale,
                                       starts[r0:r1], ends[r0:r1], part)  # fmt: skip
        indexer_sm90.topk_windows(part, starts[r0:r1], ends[r0:r1], k.shape[0], out[r0:r1])
    return out


def _run_prefill(q, k, k_scale, weights, q_scale, cu_q, cu_k, causal, topk) -> torch.Tensor:
    out = torch.empty(q.shape[0], topk, dtype=torch.int32, device=q.device)
    if q_scale is not None:
        weights = weights * q_scale
    starts, ends = key_windows(q.shape[0], k.shape[0], causal, cu_q, cu_k, q.device)
    return _prefill(q.contiguous(), k.contiguous(), k_scale.contiguous(), weights.contiguous(),
                    starts, ends, out)  # fmt: skip


@torch.library.custom_op("forgekernel::dsa_indexer", mutates_args=())
def _indexer_op(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    q_scale: torch.Tensor | None,
    cu_seqlens_q: torch.Tensor | None,
    cu_seqlens_k: torch.Tensor | None,
    causal: bool,
    topk: int,
) -> torch.Tensor:
    return _run_prefill(q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, causal, topk)


@_indexer_op.register_fake
def _(q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, causal, topk):
    return q.new_empty(q.shape[0], topk, dtype=torch.int32)


def dsa_indexer(
    q: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    weights: torch.Tensor,
    *,
    topk: int = TOPK,
    causal: bool = True,
    q_scale: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k key rows int32 (S, topk) per query row (module docstring: prefill layouts), -1
    padded, ascending. out: written in place when given."""
    topk = _check_topk(topk)
    _validate(q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, out, topk)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if _traced(q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, out):
        result = torch.ops.forgekernel.dsa_indexer(
            q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, causal, topk
        )
        return result if out is None else out.copy_(result)
    result = _run_prefill(q, k, k_scale, weights, q_scale, cu_seqlens_q, cu_seqlens_k, causal,
                          topk)  # fmt: skip
    return result if out is None else out.copy_(result)


# ---------------------------------------------------------------- decode (paged cache)


def _validate_paged(q, cache, weights, seq_lens, table, out, topk,
                    names=("q", "k_cache")) -> int:  # fmt: skip
    """next_n, after the checks; names: q's and the cache's in the caller's signature."""
    q_name, cache_name = names
    if isinstance(q, torch.Tensor) and q.dim() == 3:
        q = q.unsqueeze(1)
    check_tensor(q_name, q, ndim=4, dtypes=FP8, cuda=False)
    b, next_n = q.shape[:2]
    if q.shape[2:] != (HEADS, HEAD_DIM) or next_n not in QTOKENS:
        raise ValueError(f"{q_name} must be (B, {HEADS}, {HEAD_DIM}) or (B, next_n, {HEADS}, "
                         f"{HEAD_DIM}) with next_n in {QTOKENS}, got {tuple(q.shape)}")  # fmt: skip
    if not isinstance(weights, torch.Tensor) or weights.numel() != b * next_n * HEADS:
        got = tuple(weights.shape) if isinstance(weights, torch.Tensor) else type(weights)
        raise ValueError(f"weights must hold (B x next_n, {HEADS}) = {(b * next_n, HEADS)}, "
                         f"got {got}")  # fmt: skip
    check_tensor("weights", weights, ndim=weights.dim(), dtypes=F32, cuda=False)
    check_tensor(cache_name, cache, ndim=4, dtypes=CACHE_DTYPES, cuda=False)
    if cache.shape[1:] != (PAGE, 1, HEAD_DIM + 4) or cache.shape[0] == 0:
        raise ValueError(f"{cache_name} must be deep_gemm's (num_pages >= 1, {PAGE}, 1, "
                         f"{HEAD_DIM + 4}), got {tuple(cache.shape)}")  # fmt: skip
    if cache.stride()[1:] != ((HEAD_DIM + 4), HEAD_DIM + 4, 1) or cache.stride(0) % 16:
        raise ValueError(f"{cache_name} pages must be packed rows, 16-byte strided: strides "
                         f"{tuple(cache.stride())}")  # fmt: skip
    check_shaped("seq_lens", seq_lens, (b,), INDEX)
    check_tensor("block_table", table, ndim=2, dtypes=INDEX, cuda=False)
    if table.shape[0] != b:
        raise ValueError(f"block_table must be (B = {b}, max_pages), got {tuple(table.shape)}")
    if b > MAX_GRID_Y:  # the logits' grid y: one sequence a row of CTAs
        raise ValueError(f"B = {b} sequences: at most {MAX_GRID_Y} are supported")
    if table.shape[1] * PAGE > MAX_KEYS:
        raise ValueError(f"block_table's {table.shape[1]} pages exceed {MAX_KEYS} keys a row")
    if out is not None:
        check_shaped("out", out, (b * next_n, topk), INDEX)
    check_cuda(q_name, q)
    extra = {} if out is None else {"out": out}
    check_same_device(**{q_name: q, cache_name: cache}, weights=weights, seq_lens=seq_lens,
                      block_table=table, **extra)  # fmt: skip
    return next_n


def _run_paged(q, cache, weights, seq_lens, table, next_n, topk) -> torch.Tensor:
    rows = weights.numel() // HEADS
    out = torch.empty(rows, topk, dtype=torch.int32, device=q.device)
    logits = torch.empty(rows, table.shape[1] * PAGE, dtype=torch.float32, device=q.device)
    q2d = q.reshape(rows * HEADS, HEAD_DIM).contiguous()
    w = weights.reshape(rows, HEADS).contiguous()
    table, seq_lens = table.contiguous(), seq_lens.contiguous()
    indexer_sm90.logits_paged(q2d, w, cache, table, seq_lens, logits, next_n)
    indexer_sm90.topk_paged(logits, table, seq_lens, next_n, out)
    return out


@torch.library.custom_op("forgekernel::dsa_indexer_paged", mutates_args=())
def _paged_op(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    next_n: int,
    topk: int,
) -> torch.Tensor:
    return _run_paged(q, k_cache, weights, seq_lens, block_table, next_n, topk)


@_paged_op.register_fake
def _(q, k_cache, weights, seq_lens, block_table, next_n, topk):
    return q.new_empty(weights.numel() // HEADS, topk, dtype=torch.int32)


def dsa_indexer_paged(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    *,
    topk: int = TOPK,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Top-k cache slots int32 (B x next_n, topk) per query row (module docstring: decode
    layouts), -1 padded, ascending position. out: written in place when given."""
    return _indexer_paged(q, k_cache, weights, seq_lens, block_table, topk, out)


def _indexer_paged(q, k_cache, weights, seq_lens, block_table, topk, out,
                   names=("q", "k_cache")):  # fmt: skip
    """`dsa_indexer_paged`, its errors naming q and the cache as `names` (an adapter's)."""
    topk = _check_topk(topk)
    next_n = _validate_paged(q, k_cache, weights, seq_lens, block_table, out, topk, names)
    if _traced(q, k_cache, weights, seq_lens, block_table, out):
        result = torch.ops.forgekernel.dsa_indexer_paged(
            q, k_cache, weights, seq_lens, block_table, next_n, topk
        )
    else:
        if k_cache.data_ptr() % 16:  # TMA reads the pages in place
            raise ValueError(f"{names[1]} must be 16-byte aligned")
        result = _run_paged(q, k_cache, weights, seq_lens, block_table, next_n, topk)
    return result if out is None else out.copy_(result)


def dsa_topk_indexer_flashinfer(
    q_index_fp8: torch.Tensor,
    k_index_cache_fp8: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
) -> tuple[torch.Tensor]:
    """FlashInfer-Bench's `dsa_topk_indexer_fp8_h64_d128_topk2048_ps64` as it is (keyword names
    theirs, so `(**inputs)` works): q_index_fp8 (B, 64, 128) fp8, k_index_cache_fp8 int8
    (pages, 64, 1, 132), weights (B, 64) fp32, seq_lens int32 (B,), block_table int32 (B,
    max_pages) -> (topk_indices int32 (B, 2048),): slots page * 64 + offset, -1 padded, in
    ascending position (theirs: by descending score; the definition's selection is
    order-free)."""
    return (_indexer_paged(q_index_fp8, k_index_cache_fp8, weights, seq_lens, block_table, TOPK,
                           None, names=("q_index_fp8", "k_index_cache_fp8")),)  # fmt: skip
