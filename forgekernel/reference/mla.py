"""DeepSeek Multi-head Latent Attention (MLA) reference: absorbed decode and prefill over a paged
latent cache, in fp32, and the un-absorbed prefill form it comes from.

The math (DeepSeek-V2/V3; per head h, latent c_j (512) and RoPE key r_j (64) of token j):

    un-absorbed  k_j,h = [W_UK[h] c_j ; r_j] (128 + 64 = 192),  v_j,h = W_UV[h] c_j (128)
                 q_i,h = [q_nope_i,h (128) ; q_pe_i,h (64)],  o_i,h = softmax_j(scale q . k) v
    absorbed     q_lat_i,h = W_UK[h]^T q_nope_i,h (512)                       (`absorb_query`)
                 s_ij,h = scale (q_lat_i,h . c_j + q_pe_i,h . r_j)
                 out_i,h = sum_j softmax_j(s) c_j (512)
                 o_i,h = W_UV[h] out_i,h                                    (`project_output`)

so the cache holds one 576-wide row [c_j ; r_j] per token, shared by all heads, that is both the
key (all 576 columns) and the value (the first 512): MQA with head dims 576 / 512. W_UK, W_UV
are (H, 128, 512): DeepSeek's wkv_b.weight (H * 256, 512) viewed as (H, 256, 512), rows 0..127
of each head W_UK, rows 128..255 W_UV.

softmax_scale has no default: it is the un-absorbed one, 1 / sqrt(192) times DeepSeek-V3's YaRN
factor mscale^2 (0.1 ln 40 + 1)^2 (about 0.1352 in all), never 1 / sqrt(576), which is what
FlashMLA falls back to when given none.

Caches: FlashInfer's split layout ckv_cache (num_pages, page_size, 512) and kpe_cache
(num_pages, page_size, 64), or FlashMLA's combined (num_pages, page_size, 1, 576), which
`split_latent_cache` turns into those two views (no copy; kpe_cache=None does it). Token t of
sequence b lives at page page_table[b, t // page_size], slot t % page_size (paged_attention.py's
convention: int32 page_table (batch, max_pages), seqlens_k int32 (batch,), entries past a
sequence's pages never read).

Queries: decode q_nope (batch, s_q, H, 512), q_pe (batch, s_q, H, 64), s_q = 1 plus MTP /
speculative tokens; seqlens_k counts the new tokens, already in the cache, so the causal mask is
bottom-right aligned: query i of s_q sees key j iff j <= i + seqlens_k - s_q (the s_q tokens are
causal among themselves). Prefill packs q (total_q, H, *) by cu_seqlens_q int32 (batch + 1,),
same mask per sequence. Rows that see no key (empty sequence, i + sk - s_q < 0) give out 0, LSE
-inf.

Outputs: out fp32 (batch, s_q, H, 512) (prefill (total_q, H, 512)); LSE natural log, fp32,
(batch, H, s_q) (prefill (H, total_q)): OPS.md's layout, which is also FlashMLA's; FlashInfer's
(batch or total_q, H) base 2 is mla_flashinfer.py's job.

FP8 (float8_e4m3fn) caches are dequantized as cache * scale, per cache (ckv_scale, kpe_scale):
  - per tensor: a float, a 0-d or one-element tensor: the whole 576-wide row in e4m3 with one
    scale (FlashMLA pull request #54's dense FP8 decode, carried by sglang / vLLM builds as
    descale_k; there q is e4m3 too, with descale_q: give this reference q * descale_q);
  - per token tile: fp32 (num_pages, page_size, n_tiles), tile = D / n_tiles consecutive
    columns of one token sharing a scale. FlashMLA's "FP8 with scale" format (its V3.2 sparse
    decode) is 656 bytes per token: 512 e4m3 latent, 4 fp32 scales (one per 128 columns,
    powers of two), 64 bf16 RoPE (not quantized); `flashmla_fp8_views` reads it as
    (ckv e4m3, ckv_scale (.., 4), kpe bf16) without copying, `quantize_flashmla_fp8` writes it.
Any cache dtype is multiplied by its scale when one is given.

Memory: one sequence's latent rows are gathered (fp32, 576 wide: 150 MB at 64k tokens) and the
scores are computed SCORE_BUDGET elements at a time over (query token, head) rows.
"""

from __future__ import annotations

import torch

from .attention import attention_varlen_ref
from .paged_attention import Scale, _check_pages

LATENT_DIM = 512  # kv_lora_rank
ROPE_DIM = 64  # qk_rope_head_dim
NOPE_HEAD_DIM = 128  # qk_nope_head_dim: un-absorbed q/k is 128 + 64 = 192 wide
V_HEAD_DIM = 128
# Score elements per chunk (256 MB fp32); softmax takes about 3x that at peak.
SCORE_BUDGET = 1 << 26

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
FLASHMLA_FP8_TILE = 128
FLASHMLA_FP8_TILES = LATENT_DIM // FLASHMLA_FP8_TILE
# 512 e4m3 + 4 fp32 scales + 64 bf16 RoPE.
FLASHMLA_FP8_BYTES = LATENT_DIM + 4 * FLASHMLA_FP8_TILES + 2 * ROPE_DIM  # 656
# FlashMLA's quantizer clamps amax / 448 to this before rounding the scale up to a power of two.
FLASHMLA_MIN_SCALE = 1e-4


# ---------------------------------------------------------------- cache layouts


def split_latent_cache(kv_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(ckv (num_pages, page_size, D - 64), kpe (num_pages, page_size, 64)) views of FlashMLA's
    combined (num_pages, page_size, 1, D) cache (D = 576): no copy, strides kept."""
    if kv_cache.dim() != 4 or kv_cache.shape[2] != 1 or kv_cache.shape[3] <= ROPE_DIM:
        raise ValueError(
            "kv_cache: expected (num_pages, page_size, 1, latent + 64), got"
            f" {tuple(kv_cache.shape)}"
        )
    return kv_cache[:, :, 0, :-ROPE_DIM], kv_cache[:, :, 0, -ROPE_DIM:]


def flashmla_fp8_views(
    packed: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(ckv e4m3 (P, ps, 512), ckv_scale fp32 (P, ps, 4), kpe bf16 (P, ps, 64)): views of
    FlashMLA's FP8 cache (P, ps, 1, 656), dtype float8_e4m3fn or uint8, bytes
    [0, 512) latent, [512, 528) scales, [528, 656) RoPE. No copy; page strides kept."""
    if packed.dim() != 4 or packed.shape[2:] != (1, FLASHMLA_FP8_BYTES):
        raise ValueError(
            f"packed: expected (num_pages, page_size, 1, {FLASHMLA_FP8_BYTES}), got"
            f" {tuple(packed.shape)}"
        )
    if packed.element_size() != 1 or packed.stride(-1) != 1:
        raise ValueError(f"packed: expected a byte tensor with unit column stride, {packed.dtype}")
    row = packed[:, :, 0]
    scale_end = LATENT_DIM + 4 * FLASHMLA_FP8_TILES
    ckv = row[..., :LATENT_DIM].view(FP8)
    scale = row[..., LATENT_DIM:scale_end].view(torch.float32)
    kpe = row[..., scale_end:].view(torch.bfloat16)
    return ckv, scale, kpe


def flashmla_scale(amax: torch.Tensor) -> torch.Tensor:
    """FlashMLA's tile scale for a tile of largest magnitude amax: the power of two at or above
    max(amax / 448, 1e-4) (a UE8M0 value kept in fp32), so |tile / scale| <= 448."""
    mantissa, exponent = torch.frexp((amax.float() / FP8_MAX).clamp_min(FLASHMLA_MIN_SCALE))
    # x = m 2^e with m in [0.5, 1): ceil(log2 x) is e - 1 when m is exactly 0.5, else e.
    exponent = exponent - (mantissa == 0.5).to(exponent.dtype)
    return torch.ldexp(torch.ones_like(mantissa), exponent)


def quantize_flashmla_fp8(ckv: torch.Tensor, kpe: torch.Tensor) -> torch.Tensor:
    """FlashMLA's FP8 cache (P, ps, 1, 656) float8_e4m3fn of a latent ckv (P, ps, 512) and RoPE
    kpe (P, ps, 64): each 128-column tile of a token divided by `flashmla_scale` of its amax
    and rounded to e4m3 (nearest even), the scale stored as fp32, kpe stored as bf16."""
    if ckv.dim() != 3 or ckv.shape[-1] != LATENT_DIM or kpe.shape != (*ckv.shape[:2], ROPE_DIM):
        raise ValueError(
            f"ckv (P, ps, {LATENT_DIM}), kpe (P, ps, {ROPE_DIM}): got {tuple(ckv.shape)} and"
            f" {tuple(kpe.shape)}"
        )
    packed = torch.empty(*ckv.shape[:2], 1, FLASHMLA_FP8_BYTES, dtype=FP8, device=ckv.device)
    q_view, scale_view, kpe_view = flashmla_fp8_views(packed)
    tiles = ckv.float().unflatten(-1, (FLASHMLA_FP8_TILES, FLASHMLA_FP8_TILE))
    scale = flashmla_scale(tiles.abs().amax(-1))
    # Dividing by a power of two is exact: e4m3 rounding is the only error.
    q_view.copy_((tiles / scale[..., None]).flatten(-2).to(FP8))
    scale_view.copy_(scale)
    kpe_view.copy_(kpe.to(torch.bfloat16))
    return packed


# ---------------------------------------------------------------- absorption


def absorb_query(q_nope: torch.Tensor, w_uk: torch.Tensor) -> torch.Tensor:
    """q_lat = W_UK[h]^T q_nope: (..., H, 128) with W_UK (H, 128, 512) -> (..., H, 512)."""
    return torch.einsum("...hd,hdc->...hc", q_nope, w_uk)


def project_output(out_latent: torch.Tensor, w_uv: torch.Tensor) -> torch.Tensor:
    """o = W_UV[h] out_latent: (..., H, 512) with W_UV (H, 128, 512) -> (..., H, 128)."""
    return torch.einsum("...hc,hdc->...hd", out_latent, w_uv)


def expand_latent(
    ckv: torch.Tensor, w_uk: torch.Tensor, w_uv: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-head (k_nope, v) (..., H, 128) of latent rows ckv (..., 512): W_UK[h] c, W_UV[h] c."""
    return torch.einsum("...c,hdc->...hd", ckv, w_uk), torch.einsum("...c,hdc->...hd", ckv, w_uv)


# ---------------------------------------------------------------- references


def mla_decode_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    *,
    causal: bool = True,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (batch, s_q, H, 512), lse (batch, H, s_q)) of absorbed MLA decode; see the module
    docstring. kpe_cache=None takes ckv_cache as FlashMLA's combined (P, ps, 1, 576) cache.

    upcast=True (the spec): every step in fp32, out fp32. upcast=False: the cache dequantized
    into q's dtype and the math done by PyTorch in it (the yardstick for a kernel's error);
    lse fp32 either way.
    """
    if q_nope.dim() != 4 or q_pe.shape[:3] != q_nope.shape[:3]:
        raise ValueError(
            "q_nope, q_pe: expected (batch, s_q, H, 512) and (batch, s_q, H, 64), got"
            f" {tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    batch, s_q, heads, _ = q_nope.shape
    if page_table.dim() != 2 or page_table.shape[0] != batch:
        raise ValueError(
            f"page_table: expected ({batch}, max_pages) (q's batch), got {tuple(page_table.shape)}"
        )
    cu_seqlens_q = torch.arange(batch + 1, dtype=torch.int32, device=q_nope.device) * s_q
    out, lse = mla_prefill_ref(
        q_nope.flatten(0, 1),
        q_pe.flatten(0, 1),
        ckv_cache,
        kpe_cache,
        page_table,
        seqlens_k,
        cu_seqlens_q,
        softmax_scale,
        causal,
        ckv_scale=ckv_scale,
        kpe_scale=kpe_scale,
        upcast=upcast,
    )
    lse = lse.view(heads, batch, s_q).permute(1, 0, 2).contiguous()
    return out.view(batch, s_q, heads, -1), lse


def mla_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    *,
    ckv_scale: Scale = None,
    kpe_scale: Scale = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (total_q, H, 512), lse (H, total_q)) of absorbed MLA over a paged latent cache, q
    packed by cu_seqlens_q: varlen / chunked prefill, and decode with any number of new tokens.
    The queries of sequence b are its last cu[b+1] - cu[b] tokens (bottom-right causal mask).
    Arguments as `mla_decode_ref`'s."""
    if kpe_cache is None:
        ckv_cache, kpe_cache = split_latent_cache(ckv_cache)
    _check(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, cu_seqlens_q)
    dtype = torch.float32 if upcast else q_nope.dtype
    scales = (
        _cache_scale(ckv_scale, ckv_cache, "ckv_scale"),
        _cache_scale(kpe_scale, kpe_cache, "kpe_scale"),
    )
    total_q, heads, latent = q_nope.shape
    out = torch.zeros(total_q, heads, latent, dtype=dtype, device=q_nope.device)
    lse = torch.full((total_q, heads), float("-inf"), device=q_nope.device)
    cu = cu_seqlens_q.tolist()
    for b, (q0, q1) in enumerate(zip(cu[:-1], cu[1:])):
        sk = int(seqlens_k[b])
        if q1 == q0 or sk == 0:
            continue
        keys = gather_latent(ckv_cache, kpe_cache, page_table[b], sk, scales, dtype)
        visible = _visible_keys(q1 - q0, sk, causal, q_nope.device).repeat_interleave(heads)
        query = torch.cat([q_nope[q0:q1], q_pe[q0:q1]], -1).flatten(0, 1)  # (s_q * H, 576)
        o, row_lse = _latent_attention(query, keys, latent, visible, softmax_scale, dtype)
        out[q0:q1], lse[q0:q1] = o.view(q1 - q0, heads, latent), row_lse.view(q1 - q0, heads)
    return out, lse.transpose(0, 1).contiguous()


def mla_unabsorbed_prefill_ref(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    softmax_scale: float,
    causal: bool = True,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The un-absorbed ("MHA mode") prefill: plain attention with q/k 192 = 128 + 64, v 128.

    q_nope (total_q, H, 128), q_pe (total_q, H, 64); k_nope, v (total_k, H, 128) expanded from
    the latent (`expand_latent`) over all of a sequence's keys, cached and new; k_pe
    (total_k, 64) is one RoPE key per token, shared by every head. q = [q_nope ; q_pe] and
    k = [k_nope ; k_pe] go to `attention_varlen_ref` as they are: (out (total_q, H, 128),
    lse (H, total_q)), equal to `project_output` of the absorbed form's output with the same
    softmax_scale and the same LSE.
    """
    heads = q_nope.shape[1]
    if k_pe.dim() != 2 or k_pe.shape[0] != k_nope.shape[0]:
        raise ValueError(
            f"k_pe: expected (total_k, rope) shared by all heads, got {tuple(k_pe.shape)}"
        )
    q = torch.cat([q_nope, q_pe], -1)
    k = torch.cat([k_nope, k_pe[:, None, :].expand(-1, heads, -1).to(k_nope.dtype)], -1)
    return attention_varlen_ref(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, softmax_scale, upcast)


# ---------------------------------------------------------------- pieces


def gather_latent(
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    pages: torch.Tensor,
    seqlen: int,
    scales: tuple[torch.Tensor | None, torch.Tensor | None] = (None, None),
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """(seqlen, 512 + 64) rows [c_j ; r_j] of one sequence, dequantized into `dtype`; scales as
    `_cache_scale` returns them (None, a 0-d tensor, or per token tile (P, ps, n_tiles))."""
    page_size = ckv_cache.shape[1]
    used = pages[: -(-seqlen // page_size)].long()
    parts = []
    for cache, scale in zip((ckv_cache, kpe_cache), scales):
        tokens = cache.index_select(0, used).flatten(0, 1)[:seqlen]
        if scale is None:
            parts.append(tokens.to(dtype))
            continue
        # fp8 has no arithmetic: convert first; the product is rounded once, into `dtype`.
        tokens = tokens.float()
        if scale.dim():
            tile_scale = scale.index_select(0, used).flatten(0, 1)[:seqlen]
            tokens = tokens.unflatten(-1, (tile_scale.shape[-1], -1)) * tile_scale[..., None]
            tokens = tokens.flatten(-2)
        else:
            tokens = tokens * scale
        parts.append(tokens.to(dtype))
    return torch.cat(parts, -1)


def _visible_keys(s_q: int, sk: int, causal: bool, device: torch.device) -> torch.Tensor:
    """Keys seen by each of a sequence's s_q queries (its last s_q tokens): a prefix of length
    clamp(i + sk - s_q + 1, 0, sk) when causal, all sk otherwise."""
    if not causal:
        return torch.full((s_q,), sk, device=device)
    return (torch.arange(s_q, device=device) + (sk - s_q + 1)).clamp(0, sk)


def _latent_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    latent: int,
    visible: torch.Tensor,
    scale: float,
    dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out (rows, latent), lse (rows,)) for query rows (rows, 576) against keys (sk, 576),
    values keys[:, :latent]; row r sees the first visible[r] keys."""
    rows, sk = query.shape[0], keys.shape[0]
    out = torch.empty(rows, latent, dtype=dtype, device=query.device)
    lse = torch.empty(rows, device=query.device)
    key_index = torch.arange(sk, device=query.device)
    step = max(1, SCORE_BUDGET // sk)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        s = (query[r0:r1].to(dtype) @ keys.T).mul_(scale)
        s.masked_fill_(key_index[None, :] >= visible[r0:r1, None], float("-inf"))
        lse[r0:r1] = torch.logsumexp(s.float(), dim=-1)
        p = torch.softmax(s, dim=-1)
        # A row that sees no key is NaN after softmax (0/0); the spec says out = 0 there.
        p.masked_fill_(torch.isneginf(lse[r0:r1])[:, None], 0.0)
        out[r0:r1] = p @ keys[:, :latent]
    return out, lse


def _cache_scale(scale: Scale, cache: torch.Tensor, name: str) -> torch.Tensor | None:
    """The dequantization scale as an fp32 0-d tensor (per tensor) or (P, ps, n_tiles) tensor
    (per token tile, n_tiles dividing the cache's width); None: no scale."""
    if scale is None:
        return None
    scale = torch.as_tensor(scale, dtype=torch.float32, device=cache.device)
    if scale.numel() == 1:
        return scale.reshape(())
    pages, page_size, width = cache.shape
    if scale.dim() != 3 or scale.shape[:2] != (pages, page_size) or width % scale.shape[2]:
        raise ValueError(
            f"{name}: expected a float, a one-element tensor or ({pages}, {page_size}, n_tiles)"
            f" with n_tiles dividing {width}, got {tuple(scale.shape)}"
        )
    return scale.float()


def _check(q_nope, q_pe, ckv_cache, kpe_cache, page_table, seqlens_k, cu_seqlens_q) -> None:
    """ValueError naming the argument for shapes the reference would silently misread."""
    if q_nope.dim() != 3 or q_pe.dim() != 3 or q_pe.shape[:2] != q_nope.shape[:2]:
        raise ValueError(
            "q_nope, q_pe: expected (total_q, H, 512) and (total_q, H, 64), got"
            f" {tuple(q_nope.shape)} and {tuple(q_pe.shape)}"
        )
    if ckv_cache.dim() != 3 or kpe_cache.dim() != 3 or kpe_cache.shape[:2] != ckv_cache.shape[:2]:
        raise ValueError(
            "ckv_cache, kpe_cache: expected (num_pages, page_size, 512) and (num_pages,"
            f" page_size, 64), got {tuple(ckv_cache.shape)} and {tuple(kpe_cache.shape)}"
        )
    if q_nope.shape[2] != ckv_cache.shape[2] or q_pe.shape[2] != kpe_cache.shape[2]:
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} / q_pe {tuple(q_pe.shape)}: last dims must match"
            f" ckv_cache's {ckv_cache.shape[2]} and kpe_cache's {kpe_cache.shape[2]}"
        )
    batch = page_table.shape[0]
    if page_table.dim() != 2 or seqlens_k.shape != (batch,):
        raise ValueError(
            f"page_table (batch, max_pages) and seqlens_k (batch,): got {tuple(page_table.shape)}"
            f" and {tuple(seqlens_k.shape)}"
        )
    if cu_seqlens_q.shape != (batch + 1,) or int(cu_seqlens_q[-1]) != q_nope.shape[0]:
        raise ValueError(
            f"cu_seqlens_q: expected ({batch + 1},) ending at q's {q_nope.shape[0]} rows, got"
            f" {tuple(cu_seqlens_q.shape)}"
        )
    _check_pages(ckv_cache, page_table, seqlens_k)
