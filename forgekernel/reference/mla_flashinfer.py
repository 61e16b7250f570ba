"""FlashInfer-Bench's MLA definitions run through our MLA reference, and our outputs put back in
their form.

Definitions: `mla_paged_decode_h16_ckv512_kpe64_ps{1,64}` and
`mla_paged_prefill_causal_h16_ckv512_kpe64_ps{1,64}` (shared/external/flashinfer-bench,
`fi_api: flashinfer.mla.BatchMLAPagedAttentionWrapper`). Their conventions, and ours:

    queries   decode q_nope (batch, 16, 512), q_pe (batch, 16, 64): one token per sequence,
              ours is (batch, s_q = 1, H, *); prefill (total_q, 16, *) packed by qo_indptr,
              as our cu_seqlens_q
    cache     ckv_cache (num_pages, page_size, 512), kpe_cache (num_pages, page_size, 64) bf16:
              our split layout as it is
    pages     CSR kv_indptr / kv_indices, plus kv_last_page_len (batch,) for page size 64;
              page size 1 has none (a sequence's KV length is its page count). FlashInfer's
              wrapper itself plans with kv_len (batch,) instead: `page_table_from_flashinfer`
              takes either. -> our page_table / seqlens_k (flashinfer_paged.csr_to_page_table)
    scale     sm_scale, a float32 scalar input: the un-absorbed 1 / sqrt(128 + 64) by their
              description (DeepSeek-V3 multiplies it by the YaRN mscale^2); passed through
    mask      prefill is causal, bottom-right aligned (query i of q_len sees key j iff
              j <= kv_len - q_len + i): ours
    outputs   output bf16 (batch or total_q, 16, 512); lse fp32 base 2, (batch or total_q, 16).
              Ours: fp32, natural log, (batch, H, s_q) / (H, total_q): `*_outputs_to_flashinfer`

Behaviours of their references: an empty sequence gives output 0 and lse -inf (ours too); their
prefill leaves a row that sees no key (q_len > kv_len) NaN (softmax of all -inf) with lse -inf,
ours gives 0; their ps64 references would take a kv_last_page_len of 0 on a non-empty sequence
as a shorter sequence, csr_to_page_table rejects it (FlashInfer requires 1..page_size).
"""

from __future__ import annotations

import torch

from .flashinfer_paged import csr_to_page_table, lse_to_base2
from .mla import mla_decode_ref, mla_prefill_ref

Scalar = float | torch.Tensor


def page_table_from_flashinfer(
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    page_size: int,
    *,
    kv_last_page_len: torch.Tensor | None = None,
    kv_len: torch.Tensor | None = None,
    max_pages: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(page_table int32 (batch, max_pages), seqlens_k int32 (batch,)) of FlashInfer's CSR page
    lists with either kv_last_page_len (the definitions) or kv_len (the wrapper's plan);
    neither: every page full (page size 1). kv_len must need exactly the listed page count."""
    if kv_len is not None:
        if kv_last_page_len is not None:
            raise ValueError("kv_len, kv_last_page_len: give one of the two")
        counts = (kv_indptr[1:] - kv_indptr[:-1]).long()
        if not torch.equal(-(-kv_len.long() // page_size), counts):
            raise ValueError(f"kv_len: expected ceil(kv_len / {page_size}) pages per sequence")
        kv_last_page_len = torch.where(counts > 0, kv_len.long() - (counts - 1) * page_size, 0)
    return csr_to_page_table(
        kv_indptr, kv_indices, kv_last_page_len, page_size, max_pages=max_pages
    )


def decode_outputs_to_flashinfer(
    out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours (batch, 1, H, 512), natural lse (batch, H, 1) -> theirs (batch, H, 512), base-2
    lse (batch, H); out keeps its dtype (theirs is bf16: round it to compare bit for bit)."""
    if out.dim() != 4 or out.shape[1] != 1 or lse.shape != (out.shape[0], out.shape[2], 1):
        raise ValueError(
            f"out (batch, 1, H, D), lse (batch, H, 1): got {tuple(out.shape)}, {tuple(lse.shape)}"
        )
    return out[:, 0], lse_to_base2(lse[..., 0])


def prefill_outputs_to_flashinfer(
    out: torch.Tensor, lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Ours (total_q, H, 512), natural lse (H, total_q) -> theirs: the same output, base-2 lse
    (total_q, H)."""
    if lse.shape != (out.shape[1], out.shape[0]):
        raise ValueError(f"lse: expected (H, total_q) {tuple(out.shape[1::-1])}")
    return out, lse_to_base2(lse).transpose(0, 1).contiguous()


def mla_flashinfer_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: Scalar,
    kv_last_page_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our reference on a decode definition's inputs (its keyword names, so `(**inputs)` works
    for both page sizes): (output fp32 (batch, H, 512), lse base 2 (batch, H))."""
    table, seqlens = page_table_from_flashinfer(
        kv_indptr, kv_indices, ckv_cache.shape[1], kv_last_page_len=kv_last_page_len
    )
    out, lse = mla_decode_ref(
        q_nope[:, None], q_pe[:, None], ckv_cache, kpe_cache, table, seqlens, float(sm_scale)
    )
    return decode_outputs_to_flashinfer(out, lse)


def mla_flashinfer_prefill(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_indices: torch.Tensor,
    sm_scale: Scalar,
    kv_last_page_len: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our reference on a causal prefill definition's inputs: (output fp32 (total_q, H, 512),
    lse base 2 (total_q, H))."""
    table, seqlens = page_table_from_flashinfer(
        kv_indptr, kv_indices, ckv_cache.shape[1], kv_last_page_len=kv_last_page_len
    )
    out, lse = mla_prefill_ref(
        q_nope, q_pe, ckv_cache, kpe_cache, table, seqlens, qo_indptr, float(sm_scale), True
    )
    return prefill_outputs_to_flashinfer(out, lse)
