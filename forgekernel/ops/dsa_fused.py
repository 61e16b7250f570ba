"""`forgekernel.ops.dsa_fused.dsa_fused_prefill`: DeepSeek-V3.2's fused sparse-attention
prefill (issue 22) in one kernel: query RoPE + sparse MQA over the latent rows with an
attention sink + output RoPE + FP8 cast (kernel: the MLA decode leaf's sparse direct pass in
its `fused` form, kernels/attention/mla/sm90 decode.py; its epilogue arithmetic fused.py).

Math: `reference.dsa.dsa_fused_prefill_ref` (its module docstring has the conventions), for
query token t at position p = positions[t], cos_i / sin_i = cos_sin_cache[p, i] / [p, 32 + i]:

    q'[t, h]  = [q_nope ; rope(q_pe, +angle)] (fp32 rotation, rounded to q's dtype)
    o[t, h]   = sparse attention of q' over kv[topk_indices[t]] (dsa_sparse_attention_rows),
                x sigmoid(lse - attn_sink[h]) (the sink in the denominator only), fp32
    o[..., 448:512] rotated by -angle (the conjugate) in fp32
    out_fp8, out_scale = e4m3 per 32 channels, scale = max(amax, 1e-4) / 448 rounded up to a
                power of two (UE8M0), values clamped to +-448, round to nearest even
    lse[t, h] = the KV-only LSE (natural log, sink excluded), -inf for a row with no entry

RoPE pairs: interleaved (2i, 2i + 1) (DeepSeek's MLA, the default) or half-split (i, i + 32)
(interleaved=False, NeoX: its own compile). rope_dim 64 only (MLA's). kv is taken as already
rotated (the cache stores rotated keys). The weightless Q RMSNorm of FlashMLA's fused kernel
(q_rms_norm_eps) is not implemented (NotImplementedError): it scales q by the rsqrt of its
576-wide mean square, a row reduction the pass's cp.async Q load does not do.

Layouts: q (S, H, 576) bf16 / fp16 (rows 16-byte aligned; copied once otherwise); kv (S_kv,
576) rows in q's dtype (`dsa_sparse_attention_rows`' layout), or FlashMLA's combined paged cache
(num_pages, page_size, 1, 576) (topk_indices then slots page * page_size + offset), read in
place (rows 16-byte aligned); or FlashMLA's FP8 cache (num_pages, page_size, 1, 656)
float8_e4m3fn / uint8, DeepSeek-V3.2's serving format (ops.mla's module docstring: per token the
latent in e4m3, four fp32 power-of-two scales, one per 128 columns, the RoPE columns in bf16),
or its rows (S_kv, 656) (the same cache with page size 1), with bf16 q only (e4m3 x its scale
is exact in bf16), read in place as `dsa_sparse_attention` reads it (row and page strides
multiples of 16 bytes): the same fused pass over the FP8 form's mainloop (656 bytes a key
against 1152); topk_indices int32 (S, topk), -1 padding anywhere;
cos_sin_cache (P, 64) fp32 or q's dtype (rows contiguous); positions int32 / int64 (S,).
Outputs: out_fp8 (S, H, 512) float8_e4m3fn, out_scale (S, H, 16) fp32, lse (S, H) fp32;
`out` / `out_scale` written in place when given (out's rows contiguous and 2-byte aligned).

Always one split: every row's O complete in one CTA (the epilogue rotates and casts it), the
pass's grid tokens x head blocks whatever `sparse_split_plan` would give a short prefill (a
few tokens with long lists run fewer CTAs than the split plan would; prefills are the use).

Not checked (each needs a device read, and the op reads none: CUDA-graph capturable):
topk_indices' entries must be negative or below S_kv (num_pages x page_size), positions in
[0, P); a larger index or position reads outside kv / the cache. No backward (FP8 output):
a call that would record autograd raises NotImplementedError. FP8 caches with a per-tensor
scale (576 e4m3 bytes a token): NotImplementedError (as `dsa_sparse_attention`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.mla.sm90 import launch as mla_sm90
from forgekernel.kernels.attention.mla.sm90.config import D_LATENT, D_ROPE, FP8_ROW_BYTES
from forgekernel.ops._dispatch import traced, wants_grad
from forgekernel.ops._validate import check_cuda, check_same_device, check_shaped, check_tensor
from forgekernel.ops.dsa import MAX_SLOTS, check_sink
from forgekernel.ops.mla import (
    FP8_CACHES,
    FP8_QUERY,
    INDEX,
    check_caches_in_place,
    check_softmax_scale,
    fp8_cache_views,
)

WIDTH = D_LATENT + D_ROPE  # q's and kv's row: [latent ; RoPE]
FP8_GROUP = 32  # output channels per scale
FP8 = torch.float8_e4m3fn
FLOAT16 = (torch.bfloat16, torch.float16)
POSITIONS = (torch.int32, torch.int64)


def _fp8(kv: object) -> bool:
    """kv is an 8-bit cache (FlashMLA's FP8 rows, or a form of it the checks name)."""
    return getattr(kv, "dtype", None) in FP8_CACHES


def _kv_views(kv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(latent (num_pages, page_size, 512), RoPE (num_pages, page_size, 64), scales or None)
    views of kv rows (S_kv, 576) (page size 1) or of FlashMLA's combined cache (num_pages,
    page_size, 1, 576); of FlashMLA's FP8 cache (num_pages, page_size, 1, 656) or its rows
    (S_kv, 656): `fp8_cache_views`' uint8 latent, bf16 RoPE and fp32 scales (the pass reads
    the scales through the latent's rows: they are those rows' bytes 512 .. 527)."""
    if kv.dim() == 2:  # (views whatever the row stride; traceable on fake CUDA tensors)
        kv = kv.unsqueeze(1).unsqueeze(1)
    if _fp8(kv):
        return fp8_cache_views(kv)
    rows = kv[:, :, 0]
    return rows[..., :D_LATENT], rows[..., D_LATENT:], None


def _validate_kv(q, kv) -> int:
    """kv's form against q (module docstring); its row width (576, or 656 for the FP8 cache)."""
    if not _fp8(kv):
        check_tensor("kv", kv, ndim=kv.dim() if isinstance(kv, torch.Tensor) else 2,
                     dtypes=(q.dtype,), cuda=False)  # fmt: skip
        if not ((kv.dim() == 2 or (kv.dim() == 4 and kv.shape[2] == 1))
                and kv.shape[-1] == WIDTH):  # fmt: skip
            raise ValueError(
                f"kv must be rows (S_kv, {WIDTH}) or FlashMLA's combined cache (num_pages,"
                f" page_size, 1, {WIDTH}) in q's dtype, or FlashMLA's FP8 cache (num_pages,"
                f" page_size, 1, {FP8_ROW_BYTES}) / its rows (S_kv, {FP8_ROW_BYTES}) with bf16"
                f" q, got {tuple(kv.shape)} {kv.dtype}"
            )
        return WIDTH
    if q.dtype != FP8_QUERY:
        raise TypeError(
            f"an FP8 kv cache takes bf16 q (e4m3 x its power-of-two scale is exact in bf16), got"
            f" q {q.dtype}"
        )
    if kv.dim() not in (2, 4):
        raise ValueError(
            f"an FP8 kv must be FlashMLA's cache (num_pages, page_size, 1, {FP8_ROW_BYTES}) or"
            f" its rows (S_kv, {FP8_ROW_BYTES}), got {tuple(kv.shape)}"
        )
    try:  # fp8_cache_views' checks: e4m3 / uint8, 656 bytes a row, 16-byte strides
        _kv_views(kv)
    except (TypeError, ValueError, NotImplementedError) as e:  # (its words name ckv_cache)
        raise type(e)(f"kv (dsa_sparse_attention's ckv_cache): {e}") from None
    return FP8_ROW_BYTES


def _validate(q, kv, topk_indices, cos_sin_cache, positions, attn_sink, rope_dim, out,
              out_scale) -> None:  # fmt: skip
    check_tensor("q", q, ndim=3, dtypes=FLOAT16, cuda=False)
    if q.shape[-1] != WIDTH:
        raise ValueError(f"q must be (S, H, {WIDTH}) = [q_nope ; q_pe], got {tuple(q.shape)}")
    width = _validate_kv(q, kv)
    if kv.numel() // width > MAX_SLOTS:
        raise ValueError(f"kv's {kv.numel() // width} rows are more than int32 addresses")
    tokens, hq, _ = q.shape
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=INDEX, cuda=False)
    if topk_indices.shape[0] != tokens:
        raise ValueError(
            f"topk_indices must be (S, topk) with S = {tokens}, got {tuple(topk_indices.shape)}"
        )
    if rope_dim != D_ROPE:
        raise ValueError(f"rope_dim must be {D_ROPE} (MLA's RoPE columns), got {rope_dim}")
    check_tensor("cos_sin_cache", cos_sin_cache, ndim=2, dtypes=(torch.float32, q.dtype),
                 cuda=False)  # fmt: skip
    if cos_sin_cache.shape[1] != rope_dim or (tokens > 0 and cos_sin_cache.shape[0] == 0):
        raise ValueError(
            f"cos_sin_cache must be (positions >= 1, {rope_dim}) = [cos | sin], got"
            f" {tuple(cos_sin_cache.shape)}"
        )
    check_tensor("positions", positions, ndim=1, dtypes=POSITIONS, cuda=False)
    if positions.shape[0] != tokens:
        raise ValueError(f"positions must be (S,) = ({tokens},), got {tuple(positions.shape)}")
    if attn_sink is not None:
        check_sink(attn_sink, q)
    if out is not None:
        check_shaped("out", out, (tokens, hq, D_LATENT), (FP8,))
    if out_scale is not None:
        check_shaped("out_scale", out_scale, (tokens, hq, D_LATENT // FP8_GROUP),
                     (torch.float32,))  # fmt: skip
        if out_scale.stride(-1) != 1:
            raise ValueError(f"out_scale's last dim must be contiguous: {out_scale.stride()}")
    check_cuda("q", q)
    extra = {k: v for k, v in (("attn_sink", attn_sink), ("out", out), ("out_scale", out_scale))
             if v is not None}  # fmt: skip
    check_same_device(q=q, kv=kv, topk_indices=topk_indices, cos_sin_cache=cos_sin_cache,
                      positions=positions, **extra)  # fmt: skip


def _check_out_rows(out: torch.Tensor) -> None:
    """An eager call's out, which the kernel writes in place (a traced call copies into any
    view; reading a fake tensor's data pointer is an error to come in torch)."""
    if out.stride(-1) != 1 or out.data_ptr() % 2 or any(s % 2 for s in out.stride()[:-1]):
        raise ValueError(
            f"out's rows must be contiguous and 2-byte aligned (e4m3 pairs), strides"
            f" {tuple(out.stride())}"
        )


def _outputs(q, out=None, out_scale=None):
    """(out_fp8 (S, H, 512), out_scale (S, H, 16) fp32, lse (S, H) fp32)."""
    tokens, hq, _ = q.shape
    o = out if out is not None else q.new_empty((tokens, hq, D_LATENT), dtype=FP8)
    scale = out_scale
    if scale is None:
        scale = q.new_empty((tokens, hq, D_LATENT // FP8_GROUP), dtype=torch.float32)
    return o, scale, q.new_empty((tokens, hq), dtype=torch.float32)


def _rows_ready(t: torch.Tensor) -> torch.Tensor:
    """The [cos | sin] cache as the kernel reads it: rows contiguous, 4-byte aligned (a copy
    otherwise: an odd view of a 16-bit cache)."""
    if t.stride(-1) == 1 and t.data_ptr() % 4 == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)


def _forward(q, kv, topk_indices, scale, cos_sin_cache, positions, attn_sink, neox, out=None,
             out_scale=None):  # fmt: skip
    o, s, lse = _outputs(q, out, out_scale)
    ckv, kpe, fp8 = _kv_views(kv)
    sink = None if attn_sink is None else attn_sink.contiguous()
    mla_sm90.dsa_fused_prefill(q, ckv, kpe, topk_indices, scale, _rows_ready(cos_sin_cache),
                               positions, o, s, lse, sink, neox, fp8 is not None)  # fmt: skip
    return o, s, lse


@torch.library.custom_op("forgekernel::dsa_fused_prefill", mutates_args=())
def _fused_op(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    neox: bool = False,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    check_caches_in_place(*_kv_views(kv), combined=True)
    return _forward(q, kv, topk_indices, softmax_scale, cos_sin_cache, positions, attn_sink,
                    neox)  # fmt: skip


@_fused_op.register_fake
def _(q, kv, topk_indices, softmax_scale, cos_sin_cache, positions, attn_sink=None,
      neox=False):  # fmt: skip
    return _outputs(q)


def dsa_fused_prefill(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    attn_sink: torch.Tensor | None = None,
    rope_dim: int = D_ROPE,
    interleaved: bool = True,
    q_rms_norm_eps: float | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
    out_scale: torch.Tensor | None = None,
):
    """The fused DSA prefill (module docstring): q (S, H, 576), kv (S_kv, 576) rows or
    FlashMLA's combined (num_pages, page_size, 1, 576) cache in q's dtype, or FlashMLA's FP8
    cache (num_pages, page_size, 1, 656) float8_e4m3fn / uint8 or its rows (S_kv, 656) with
    bf16 q, topk_indices int32 (S, topk)
    (-1 padded), softmax_scale (required), cos_sin_cache (P, 64) [cos | sin], positions (S,)
    -> (out_fp8 (S, H, 512) float8_e4m3fn, out_scale (S, H, 16) fp32) and, with return_lse,
    lse (S, H) fp32 natural log (sink excluded). attn_sink: (H,) fp32 or None. interleaved
    False: NeoX half-split pairs. out / out_scale: written in place when given. One kernel, no
    device read (CUDA-graph capturable), no backward."""
    if q_rms_norm_eps is not None:
        raise NotImplementedError(
            "q_rms_norm_eps: the weightless Q RMSNorm is not fused (the pass loads q by cp.async "
            "without a row reduction); apply it to q before the call"
        )
    if not isinstance(interleaved, bool):
        raise TypeError(f"interleaved must be a bool, got {type(interleaved).__name__}")
    scale = check_softmax_scale(softmax_scale)
    _validate(q, kv, topk_indices, cos_sin_cache, positions, attn_sink, rope_dim, out, out_scale)
    if wants_grad(q, kv, attn_sink):
        raise NotImplementedError("dsa_fused_prefill has no backward (FP8 output): run it under "
                                  "torch.no_grad() or on detached inputs")  # fmt: skip
    neox = not interleaved
    if traced(q, kv, topk_indices, cos_sin_cache, positions, attn_sink, out, out_scale):
        o, s, lse = torch.ops.forgekernel.dsa_fused_prefill(
            q, kv, topk_indices, scale, cos_sin_cache, positions, attn_sink, neox
        )
        if out is not None:
            out.copy_(o)
            o = out
        if out_scale is not None:
            out_scale.copy_(s)
            s = out_scale
    else:
        if out is not None:
            _check_out_rows(out)
        check_caches_in_place(*_kv_views(kv), combined=True)
        o, s, lse = _forward(q, kv, topk_indices, scale, cos_sin_cache, positions, attn_sink,
                             neox, out, out_scale)  # fmt: skip
    return (o, s, lse) if return_lse else (o, s)
