"""Paged attention reference: attention over a KV cache stored in pages, in fp32.

Cache layout (vLLM / FlashAttention): k_cache, v_cache (num_pages, page_size, Hkv, D), or one
combined (num_pages, 2, page_size, Hkv, D) tensor split into two views by `split_kv_cache`.
Sequence b owns the first ceil(seqlens_k[b] / page_size) entries of page_table[b] (int32,
(batch, max_pages)); its token t lives in page page_table[b, t // page_size] at slot
t % page_size. Entries past a sequence's pages are never read (their value does not matter).

    K_b = concat of its pages, first seqlens_k[b] tokens    (seqlens_k int32 (batch,))
    out, lse = softmax(scale * Q_b K_b^T + mask) V_b,  logsumexp of the masked scores

Decode: q (batch, Hq, D), one query per sequence, out (batch, Hq, Dv), lse (batch, Hq).
Prefill / chunked prefill / speculative decoding: q (total_q, Hq, D) packed by cu_seqlens_q
int32 (batch + 1,); the queries of sequence b are its last sq = cu[b+1] - cu[b] tokens, so the
causal mask is bottom-right aligned to its KV length sk: query i sees key j iff
j <= i + sk - sq. out (total_q, Hq, Dv), lse (Hq, total_q) (OPS.md's varlen layout).

GQA: query head h reads KV head h // (Hq // Hkv). Rows that see no key (sk = 0, or causal rows
with i + sk - sq < 0) give out 0 and LSE -inf. LSE is natural log, fp32.

FP8 caches (float8_e4m3fn): K = k_cache * k_scale, V = v_cache * v_scale, with a scale per
tensor (a python float or a 0-d tensor) or per KV head (fp32 tensor (Hkv,)); any cache dtype is
multiplied by its scale when one is given, none means 1.

Memory: one sequence's K and V are gathered (fp32) at a time and `attention_ref` chunks the
scores, so a 64k-token sequence with 8 KV heads of 128 costs about 0.5 GB.
"""

from __future__ import annotations

import torch

from .attention import attention_ref

Scale = float | torch.Tensor | None


def split_kv_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k_cache, v_cache) views of a combined (num_pages, 2, page_size, Hkv, D) cache."""
    if kv_cache.dim() != 5 or kv_cache.shape[1] != 2:
        raise ValueError(
            f"kv_cache: expected (num_pages, 2, page_size, Hkv, D), got {tuple(kv_cache.shape)}"
        )
    return kv_cache[:, 0], kv_cache[:, 1]


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
    causal: bool = True,
    softmax_scale: float | None = None,
    k_scale: Scale = None,
    v_scale: Scale = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) of paged attention; see the module docstring for shapes and conventions.

    v_cache=None takes k_cache as the combined (num_pages, 2, page_size, Hkv, D) cache.
    upcast=True (the spec): every step in fp32, out fp32. upcast=False: K and V dequantized
    into q's dtype and the math done by PyTorch in it (`attention_ref`'s yardstick for a
    kernel's error); lse fp32 either way.
    """
    if v_cache is None:
        k_cache, v_cache = split_kv_cache(k_cache)
    _check(q, k_cache, v_cache, page_table, seqlens_k, cu_seqlens_q)
    dtype = torch.float32 if upcast else q.dtype
    scales = (_head_scale(k_scale, k_cache, "k_scale"), _head_scale(v_scale, v_cache, "v_scale"))
    decode = cu_seqlens_q is None
    bounds = _query_bounds(q, cu_seqlens_q)
    out = torch.zeros(*q.shape[:2], v_cache.shape[-1], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[0], q.shape[1]), float("-inf"), device=q.device)  # (rows, Hq)
    for b, (q0, q1) in enumerate(bounds):
        if q1 == q0:
            continue
        k, v = gather_sequence(k_cache, v_cache, page_table[b], int(seqlens_k[b]), scales, dtype)
        o, seq_lse = attention_ref(q[None, q0:q1], k[None], v[None], causal, softmax_scale, upcast)
        out[q0:q1], lse[q0:q1] = o[0], seq_lse[0].transpose(0, 1)
    return out, (lse if decode else lse.transpose(0, 1).contiguous())


def gather_sequence(
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    pages: torch.Tensor,
    seqlen: int,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor]:
    """K, V (seqlen, Hkv, D) of one sequence, dequantized into `dtype`: its first seqlen
    tokens across the pages listed in `pages`; scales are (Hkv,) tensors or None."""
    page_size = k_cache.shape[1]
    used = pages[: -(-seqlen // page_size)].long()
    kv = []
    for cache, scale in zip((k_cache, v_cache), scales):
        tokens = cache.index_select(0, used).flatten(0, 1)[:seqlen]
        # fp8 has no arithmetic: convert first; the product is rounded once, into `dtype`.
        tokens = tokens.float() if scale is not None else tokens.to(dtype)
        kv.append(tokens if scale is None else (tokens * scale[:, None]).to(dtype))
    return kv[0], kv[1]


def _head_scale(scale: Scale, cache: torch.Tensor, name: str) -> torch.Tensor | None:
    """The dequantization scale as an fp32 (Hkv,) tensor (None: no scale)."""
    if scale is None:
        return None
    hkv = cache.shape[2]
    scale = torch.as_tensor(scale, dtype=torch.float32, device=cache.device)
    if scale.dim() == 0:
        return scale.expand(hkv)
    if scale.shape != (hkv,):
        raise ValueError(f"{name}: expected a float or a tensor ({hkv},), got {tuple(scale.shape)}")
    return scale.float()


def _query_bounds(q: torch.Tensor, cu_seqlens_q: torch.Tensor | None) -> list[tuple[int, int]]:
    """(first, last + 1) query row of each sequence."""
    if cu_seqlens_q is None:
        return [(b, b + 1) for b in range(q.shape[0])]
    cu = cu_seqlens_q.tolist()
    return list(zip(cu[:-1], cu[1:]))


def _check(q, k_cache, v_cache, page_table, seqlens_k, cu_seqlens_q) -> None:
    """ValueError naming the argument for shapes the reference would silently misread."""
    if q.dim() != 3:
        raise ValueError(f"q: expected (batch or total_q, Hq, D), got {tuple(q.shape)}")
    if k_cache.dim() != 4 or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(
            "k_cache, v_cache: expected (num_pages, page_size, Hkv, D) with the same first three"
            f" dims, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}"
        )
    if k_cache.shape[3] != q.shape[2] or q.shape[1] % k_cache.shape[2]:
        raise ValueError(
            f"q {tuple(q.shape)} and k_cache {tuple(k_cache.shape)}: head dims must match and Hq"
            " be a multiple of Hkv"
        )
    batch = page_table.shape[0]
    if page_table.dim() != 2 or seqlens_k.shape != (batch,):
        raise ValueError(
            f"page_table (batch, max_pages) and seqlens_k (batch,): got {tuple(page_table.shape)}"
            f" and {tuple(seqlens_k.shape)}"
        )
    if cu_seqlens_q is not None and cu_seqlens_q.shape != (batch + 1,):
        raise ValueError(f"cu_seqlens_q: expected ({batch + 1},), got {tuple(cu_seqlens_q.shape)}")
    expected_q = batch if cu_seqlens_q is None else int(cu_seqlens_q[-1])
    if q.shape[0] != expected_q:
        raise ValueError(
            f"q: expected {expected_q} rows (batch or cu_seqlens_q[-1]), got {q.shape[0]}"
        )
    _check_pages(k_cache, page_table, seqlens_k)


def _check_pages(k_cache, page_table, seqlens_k) -> None:
    """ValueError for a length past the table's capacity or a used page id outside the cache."""
    capacity = page_table.shape[1] * k_cache.shape[1]
    batch = page_table.shape[0]
    if batch and (seqlens_k.min() < 0 or seqlens_k.max() > capacity):
        raise ValueError(f"seqlens_k: expected 0..{capacity} (max_pages x page_size)")
    pages = -(-seqlens_k.long() // k_cache.shape[1])
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < pages[:, None]
    ids = page_table[used]
    if ids.numel() and (ids.min() < 0 or ids.max() >= k_cache.shape[0]):
        raise ValueError(f"page_table: a used entry is outside 0..{k_cache.shape[0] - 1}")
