"""FlashInfer-Bench's DeepSeek Sparse Attention definitions run through our DSA references, and
random inputs that satisfy them.

Definitions (shared/external/flashinfer-bench, captured from DeepSeek-V3.2 at TP 8):

    dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{1,64}
        q_nope (T, 16, 512), q_pe (T, 16, 64) bf16; ckv_cache (num_pages, ps, 512), kpe_cache
        (num_pages, ps, 64) bf16; sparse_indices int32 (T, 2048), -1 padded, each entry a slot
        page * ps + offset of the flattened cache (for ps = 1 the page id); sm_scale a float.
        Outputs: output bf16 (T, 16, 512), lse fp32 (T, 16) in base 2, -inf for a row with no
        index. No sink; V is ckv (the first 512 of our 576-wide kv = [ckv | kpe]).
    dsa_topk_indexer_fp8_h64_d128_topk2048_ps64
        q_index_fp8 float8_e4m3fn (B, 64, 128), no q scale (SGLang folds it into the weights:
        weights = weights_proj(x) * 64^-0.5 * q_scale * 128^-0.5); weights fp32 (B, 64);
        k_index_cache_fp8 int8 (num_pages, 64, 1, 132) in deep_gemm's paged layout, per page
        the 64 x 128 fp8 bytes first, then 64 fp32 scales (so the (64, 1, 132) view does not
        hold one token per row); seq_lens (B,), block_table int32 (B, max_num_pages) with
        max_num_pages * 64 >= 2048. One query per sequence, seeing all its keys. Output:
        topk_indices int32 (B, 2048), slots page * 64 + offset, -1 padded, by descending score
        (their torch.topk; ties in any order).

Quirks: topk is const 2048, so small tests are mostly -1 padding (every key of a sequence
shorter than 2048 is selected; only longer ones test the selection). Their references are
@no_grad loops, bf16 output rounded from fp32. The sparse-attention description's sm_scale,
1/sqrt(192), omits the YaRN mscale^2 factor DeepSeek's model multiplies in at 128k context.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from forgekernel.reference.dsa import (
    dsa_indexer_paged_ref,
    dsa_sparse_attention_paged_ref,
    quantize_fp8_groups,
)
from forgekernel.reference.flashinfer_paged import lse_to_base2

SPARSE_ATTENTION = tuple(f"dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{ps}" for ps in (1, 64))
TOPK_INDEXER = "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64"
INDEX_HEAD_DIM = 128
SCALE_BYTES = 4


# ---------------------------------------------------------------- indexer K cache packing


def unpack_indexer_k_cache(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(k float8_e4m3fn (num_pages, page_size, 128), k_scale fp32 (num_pages, page_size)) of
    deep_gemm's packed int8 / uint8 (num_pages, page_size, 1, 132) cache."""
    if cache.dim() != 4 or cache.shape[2:] != (1, INDEX_HEAD_DIM + SCALE_BYTES):
        raise ValueError(
            f"cache: expected (num_pages, page_size, 1, 132), got {tuple(cache.shape)}"
        )
    pages, page_size = cache.shape[:2]
    flat = cache.view(torch.uint8).reshape(pages, -1)
    split = page_size * INDEX_HEAD_DIM
    k = flat[:, :split].contiguous().view(torch.float8_e4m3fn).view(pages, page_size, -1)
    scale = flat[:, split:].contiguous().view(torch.float32).view(pages, page_size)
    return k, scale


def pack_indexer_k_cache(k: torch.Tensor, k_scale: torch.Tensor) -> torch.Tensor:
    """The inverse of `unpack_indexer_k_cache`: int8 (num_pages, page_size, 1, 132)."""
    pages, page_size, dim = k.shape
    if dim != INDEX_HEAD_DIM or k.dtype != torch.float8_e4m3fn:
        raise ValueError(f"k: expected float8_e4m3fn (pages, page_size, 128), got {k.dtype}")
    if k_scale.shape != (pages, page_size):
        raise ValueError(f"k_scale: expected {(pages, page_size)}, got {tuple(k_scale.shape)}")
    data = k.reshape(pages, -1).view(torch.uint8)
    scales = k_scale.float().contiguous().view(torch.uint8).reshape(pages, -1)
    packed = torch.cat((data, scales), dim=1)
    return packed.view(torch.int8).view(pages, page_size, 1, INDEX_HEAD_DIM + SCALE_BYTES)


# ---------------------------------------------------------------- ours on their inputs


def dsa_sparse_attention_flashinfer(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(output fp32 (T, H, 512), lse base 2 (T, H)): our sparse attention on a definition's
    inputs (q = [q_nope | q_pe], kv = [ckv | kpe])."""
    q = torch.cat((q_nope, q_pe), dim=-1)
    kv_cache = torch.cat((ckv_cache, kpe_cache), dim=-1)
    out, lse = dsa_sparse_attention_paged_ref(
        q, kv_cache, sparse_indices, float(sm_scale), d_v=ckv_cache.shape[-1]
    )
    return out, lse_to_base2(lse)


def dsa_topk_indexer_flashinfer(
    q_index_fp8: torch.Tensor,
    k_index_cache_fp8: torch.Tensor,
    weights: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    topk: int = 2048,
) -> torch.Tensor:
    """Slot indices int32 (B, topk): our paged indexer on a definition's inputs."""
    k, k_scale = unpack_indexer_k_cache(k_index_cache_fp8)
    return dsa_indexer_paged_ref(
        q_index_fp8, k, weights, block_table, seq_lens, k_scale_cache=k_scale, topk=topk
    )


# ---------------------------------------------------------------- inputs that satisfy them


def sparse_attention_inputs(
    page_size: int,
    num_pages: int,
    valid_counts: Sequence[int],
    *,
    heads: int = 16,
    d_ckv: int = 512,
    d_kpe: int = 64,
    topk: int = 2048,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor | float]:
    """Inputs of a dsa_sparse_attention definition: row t selects valid_counts[t] distinct
    random slots of a num_pages x page_size cache (0 is an empty row), the rest -1; the valid
    entries sit at random positions of the row, not only in front."""
    slots = num_pages * page_size
    rand = {"generator": generator}
    indices = torch.full((len(valid_counts), topk), -1, dtype=torch.int32)
    for t, count in enumerate(valid_counts):
        if count > min(slots, topk):
            raise ValueError(f"valid_counts[{t}] = {count}: more than {min(slots, topk)}")
        positions = torch.randperm(topk, **rand)[:count]
        indices[t, positions] = torch.randperm(slots, **rand)[:count].int()
    rows = len(valid_counts)
    return {
        "q_nope": torch.randn(rows, heads, d_ckv, **rand).bfloat16(),
        "q_pe": torch.randn(rows, heads, d_kpe, **rand).bfloat16(),
        "ckv_cache": torch.randn(num_pages, page_size, d_ckv, **rand).bfloat16(),
        "kpe_cache": torch.randn(num_pages, page_size, d_kpe, **rand).bfloat16(),
        "sparse_indices": indices,
        "sm_scale": 1.0 / math.sqrt(128 + d_kpe),
    }


def indexer_inputs(
    seq_lens: Sequence[int],
    *,
    page_size: int = 64,
    heads: int = 64,
    topk: int = 2048,
    spare_pages: int = 2,
    generator: torch.Generator | None = None,
) -> dict[str, torch.Tensor]:
    """Inputs of the topk indexer definition: sequence b holds seq_lens[b] keys on distinct
    random pages; keys quantized per token as DeepSeek's act_quant (ue8m0 scales), queries cast
    straight to fp8 (their scales are folded into the weights); block_table rows padded with
    page 0 to max(pages, ceil(topk / page_size)) columns, the definition's constraint."""
    rand = {"generator": generator}
    counts = [-(-s // page_size) for s in seq_lens]
    num_pages = sum(counts) + spare_pages
    keys = torch.randn(num_pages, page_size, INDEX_HEAD_DIM, **rand)
    k_fp8, k_scale = quantize_fp8_groups(keys, INDEX_HEAD_DIM)
    ids = torch.randperm(num_pages, **rand).tolist()
    width = max(max(counts, default=0), -(-topk // page_size))
    table = torch.zeros(len(seq_lens), width, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return {
        "q_index_fp8": torch.randn(len(seq_lens), heads, INDEX_HEAD_DIM, **rand).to(
            torch.float8_e4m3fn
        ),
        "k_index_cache_fp8": pack_indexer_k_cache(k_fp8, k_scale[..., 0]),
        "weights": torch.randn(len(seq_lens), heads, **rand) * heads**-0.5,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32),
        "block_table": table,
    }
