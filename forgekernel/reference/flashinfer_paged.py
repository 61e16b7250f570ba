"""FlashInfer's paged-KV form (CSR) <-> ForgeKernel's page table, and base-2 <-> natural LSE.

FlashInfer lists the pages of sequence b as kv_indices[kv_indptr[b]:kv_indptr[b + 1]] and the
tokens filled in its last page as kv_last_page_len[b] (1..page_size), so its KV length is

    n_b = kv_indptr[b + 1] - kv_indptr[b],   sk_b = (n_b - 1) * page_size + last_b  (n_b > 0)
    sk_b = 0                                                                          (n_b = 0)

ForgeKernel (vLLM / FA4) keeps a dense page_table int32 (batch, max_pages) whose row b starts
with those n_b page ids, and seqlens_k int32 (batch,). Table entries past a sequence's pages
are padding: PAD_PAGE (0), a page id that is in range whenever the cache has a page, so a
kernel that prefetches one entry too many still reads inside the cache (it must not use it).

FlashInfer's lse is base 2 (log2 sum 2^(scores * log2 e)); ForgeKernel's is natural log.
The definitions whose page_size is 1 have no kv_last_page_len: pass None (every page full).

Plain torch indexing, no host loop; the table width (max_pages) is a host value, taken from
the data unless given.
"""

from __future__ import annotations

import math

import torch

PAD_PAGE = 0


def csr_to_page_table(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    kv_last_page_len: torch.Tensor | None,
    page_size: int,
    *,
    max_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_table int32 (batch, max_pages), seqlens_k int32 (batch,)) of a CSR paged cache.

    max_pages defaults to the longest sequence's page count (at least 1); padding is PAD_PAGE.
    A non-empty sequence's kv_last_page_len must lie in 1..page_size (ValueError otherwise);
    an empty one's is ignored.
    """
    indptr = kv_indptr.long()
    counts = indptr[1:] - indptr[:-1]
    if counts.numel() and counts.min() < 0:
        raise ValueError("kv_indptr: must be non-decreasing")
    if kv_last_page_len is None:
        last = torch.full_like(counts, page_size)
    else:
        last = kv_last_page_len.long()
        bad = (counts > 0) & ((last < 1) | (last > page_size))
        if bad.any():
            raise ValueError(f"kv_last_page_len: expected 1..{page_size} for non-empty sequences")
    seqlens = torch.where(counts > 0, (counts - 1) * page_size + last, 0)
    longest = int(counts.max()) if counts.numel() else 0
    width = max(1, longest) if max_pages is None else max_pages
    if longest > width:
        raise ValueError(f"max_pages={width}: a sequence has {longest} pages")
    col = torch.arange(width, device=indptr.device)
    used = col[None, :] < counts[:, None]
    flat = (indptr[:-1, None] + col[None, :]).clamp(max=max(kv_indices.numel() - 1, 0))
    table = torch.full(used.shape, PAD_PAGE, dtype=torch.int32, device=indptr.device)
    table[used] = kv_indices.long()[flat[used]].int()
    return table, seqlens.int()


def page_table_to_csr(
    page_table: torch.Tensor, seqlens_k: torch.Tensor, page_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr int32 (batch + 1,), kv_indices int32, kv_last_page_len int32 (batch,)):
    the inverse of `csr_to_page_table`; an empty sequence gets no pages and last_page_len 0."""
    seqlens = seqlens_k.long()
    counts = -(-seqlens // page_size)
    indptr = torch.zeros(counts.numel() + 1, dtype=torch.long, device=page_table.device)
    indptr[1:] = counts.cumsum(0)
    used = torch.arange(page_table.shape[1], device=page_table.device)[None, :] < counts[:, None]
    last = torch.where(counts > 0, seqlens - (counts - 1) * page_size, 0)
    return indptr.int(), page_table[used].int(), last.int()


def lse_to_base2(lse: torch.Tensor) -> torch.Tensor:
    """Natural-log LSE -> FlashInfer's base-2 LSE (-inf stays -inf)."""
    return lse * (1.0 / math.log(2.0))


def lse_to_natural(lse_base2: torch.Tensor) -> torch.Tensor:
    """FlashInfer's base-2 LSE -> natural log (-inf stays -inf)."""
    return lse_base2 * math.log(2.0)
