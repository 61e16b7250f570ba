"""`forgekernel.ops.dsa.dsa_sparse_attention`: DeepSeek sparse attention (DSA, DeepSeek-V3.2),
the sparse MLA forward over a paged latent cache, absorbed form (kernel: the MLA decode leaf's
sparse mode, kernels/attention/mla/sm90, issue 22); `dsa_sparse_attention_rows`, issue 22's
(and cuDNN's / FlashMLA's sparse prefill's) form with whole rows q (S, H, 576) / kv (S_kv,
576), as views onto the same op; and `dsa_sparse_attention_flashinfer`, FlashInfer-Bench's
`dsa_sparse_attention_*` definitions as they are.

Math (reference/dsa.py, `dsa_sparse_attention_ref`): query token t attends to the cache rows
its top-k list names, MQA over one latent row [c_j (512) ; r_j (64)] per cache slot shared by
every head. For head h, over the valid entries j of row t (idx[t, j] >= 0):

    s[t, h, j] = softmax_scale (q_nope[t, h] . c_idx[t, j] + q_pe[t, h] . r_idx[t, j])
    lse[t, h]  = logsumexp_j s[t, h, j]                  (natural log)
    out[t, h]  = sum_j softmax(s[t, h])_j c_idx[t, j]     (512 wide; the caller applies W_UV)

Each listed entry is one term (an indexer never lists a slot twice). A row with no valid entry
gives out 0 and lse -inf. No topk_length (pad with -1 instead).

Attention sink (attn_sink (H,) fp32, optional): a per-head logit in the softmax denominator
only, out * exp(lse) / (exp(lse) + exp(sink[h])), lse unchanged (the KV-only LSE: FlashMLA's
statement, cuDNN's backward input). A plan of one split (every prefill, DSA from 128 tokens at
16 heads) applies it in the kernel's epilogue (the direct pass's `sink` compile: O x 1 / sum x
sigmoid(lse - sink) in fp32, rounded once); a plan of several splits (few tokens) applies it
after the combine in fp32 torch (`apply_sink`, one elementwise pass over out: the shared
combine, which paged decode uses too, stays as it is).

Differentiable (ops/dsa_bwd.py registers the backward of the custom op, issue 22) in q_nope,
q_pe, the 16-bit caches (or the combined cache they view) and attn_sink, through out and lse:
a call that autograd records goes through the custom op; FP8 caches have no backward.

Layouts:
    q_nope (tokens, H, 512), q_pe (tokens, H, 64), bf16 / fp16 (tokens: a decode batch, one
        token per sequence, or the packed tokens of a prefill: the lists carry the positions);
    caches ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages, page_size, 64) in
        q's dtype (FlashInfer's), or FlashMLA's combined (num_pages, page_size, 1, 576) as
        ckv_cache with kpe_cache None (read in place through two views), or FlashMLA's FP8
        cache (num_pages, page_size, 1, 656) float8_e4m3fn / uint8 as ckv_cache with kpe_cache
        None and bf16 q (DeepSeek-V3.2's serving format: per token the latent in e4m3, four
        fp32 power-of-two scales, one per 128 columns, the RoPE columns in bf16; ops.mla's
        module docstring);
    sparse_indices int32 (tokens, topk): slot page * page_size + offset of the flattened cache
        (FlashMLA's and FlashInfer's index space), -1 padding anywhere in a row;
    out (tokens, H, 512) in q's dtype; lse (tokens, H) fp32 natural log, token-major as
        reference.dsa's (and FlashMLA's sparse prefill, cuDNN's DSA backward, FlashInfer's
        definitions): the kernel computes all heads of a token from one gather of its rows,
        and OPS.md's varlen (heads, tokens) would be a transpose in every caller.
Entries must be negative (padding) or below num_pages * page_size: the op reads no index on the
host (CUDA-graph capturable), so a larger one reads outside the cache. softmax_scale has no
default (DeepSeek-V3.2's is 1 / sqrt(192) x its YaRN mscale^2; FlashInfer-Bench's definitions
give 1 / sqrt(192)). FlashInfer's split caches are 16-bit only (NotImplementedError for FP8).
"""

from __future__ import annotations

import math

import torch

from forgekernel.kernels.attention.mla.sm90 import launch as mla_sm90
from forgekernel.kernels.attention.mla.sm90.config import D_LATENT, D_ROPE
from forgekernel.ops._dispatch import plain, tracing, wants_grad
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    check_cuda,
    check_same_device,
    check_shaped,
    check_tensor,
    on_one_device,
)
from forgekernel.ops.mla import (
    INDEX,
    caches_at_a_glance,
    check_caches,
    check_caches_in_place,
    check_softmax_scale,
    latent_cache_views,
)

LOG2E = math.log2(math.e)
MAX_SLOTS = 2**31  # int32 entries address at most this many cache slots


def _validate(q_nope, q_pe, ckv, kpe, sparse_indices, out, ckv_scale=None) -> None:
    for name, t, d in (("q_nope", q_nope, D_LATENT), ("q_pe", q_pe, D_ROPE)):
        if isinstance(t, torch.Tensor) and t.dim() != 3:
            raise ValueError(f"{name} must be (tokens, H, {d}), got {tuple(t.shape)}")
    check_tensor("q_nope", q_nope, ndim=3, cuda=False)
    check_tensor("q_pe", q_pe, ndim=3, dtypes=(q_nope.dtype,), cuda=False)
    if q_nope.shape[-1] != D_LATENT or q_pe.shape != (*q_nope.shape[:-1], D_ROPE):
        raise ValueError(
            f"q_nope {tuple(q_nope.shape)} and q_pe {tuple(q_pe.shape)} must be (tokens, H,"
            f" {D_LATENT}) and (tokens, H, {D_ROPE})"
        )
    check_caches(q_nope, ckv, kpe, ckv_scale)
    pages, page_size, _ = ckv.shape
    if pages * page_size > MAX_SLOTS:
        raise ValueError(f"the cache's {pages * page_size} slots are more than int32 addresses")
    check_tensor("sparse_indices", sparse_indices, ndim=2, dtypes=INDEX, cuda=False)
    if sparse_indices.shape[0] != q_nope.shape[0]:
        raise ValueError(
            f"sparse_indices must be (tokens, topk) with tokens = {q_nope.shape[0]}, got"
            f" {tuple(sparse_indices.shape)}"
        )
    if out is not None:
        check_shaped("out", out, (*q_nope.shape[:-1], D_LATENT), (q_nope.dtype,))
    check_cuda("q_nope", q_nope)
    extra = {"out": out} if out is not None else {}
    check_same_device(q_nope=q_nope, q_pe=q_pe, ckv_cache=ckv, kpe_cache=kpe,
                      sparse_indices=sparse_indices, **extra)  # fmt: skip


def _valid_at_a_glance(q_nope, q_pe, ckv, kpe, sparse_indices, out, ckv_scale=None) -> bool:
    """`_validate`'s checks in one pass over plain tensors (the common eager call): True when
    every check passes (check_cuda, which raises, last as in `_validate`); False sends the call
    through `_validate`, whose named checks raise (issue 17)."""
    if not plain(q_nope, q_pe, ckv, kpe, sparse_indices, optional=(out,)):
        return False
    if not caches_at_a_glance(q_nope, ckv, kpe, ckv_scale):
        return False
    dtype, shape = q_nope.dtype, q_nope.shape
    pe, latent, idx = q_pe.shape, ckv.shape, sparse_indices.shape
    if not (
        q_pe.dtype == dtype
        and len(shape) == 3 and shape[2] == D_LATENT
        and len(pe) == 3 and pe[2] == D_ROPE and pe[:2] == shape[:2]
        and latent[0] * latent[1] <= MAX_SLOTS
        and sparse_indices.dtype == torch.int32 and len(idx) == 2 and idx[0] == shape[0]
        and (out is None or (out.dtype == dtype and out.shape == shape))
    ):  # fmt: skip
        return False
    check_cuda("q_nope", q_nope)
    return on_one_device(q_nope, q_pe, ckv, kpe, sparse_indices, out)


def _outputs(q_nope, out):
    """(out (tokens, H, 512), lse (tokens, H) fp32)."""
    tokens, hq, _ = q_nope.shape
    o = out if out is not None else q_nope.new_empty((tokens, hq, D_LATENT))
    return o, q_nope.new_empty((tokens, hq), dtype=torch.float32)


def _forward(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, ckv_scale=None,
             attn_sink=None):  # fmt: skip
    o, lse = _outputs(q_nope, out)
    sink = None if attn_sink is None else attn_sink.detach().contiguous()
    if not mla_sm90.dsa_sparse_attention(q_nope, q_pe, ckv, kpe, sparse_indices, scale, o, lse,
                                         ckv_scale, sink):  # fmt: skip
        apply_sink(o, lse, sink)  # a split plan: after the combine
    return o, lse


def apply_sink(o: torch.Tensor, lse: torch.Tensor, attn_sink: torch.Tensor) -> None:
    """The sink of a split plan (the direct pass applies it in its epilogue): o *= exp(lse) /
    (exp(lse) + exp(sink)) = sigmoid(lse - sink) in fp32, rounded once, in place; a row of lse
    -inf stays 0 (its sigmoid is NaN against a -inf sink)."""
    w = torch.sigmoid(lse - attn_sink.float()[None, :])
    w = torch.where(torch.isneginf(lse), 0.0, w)
    o.copy_(o.float() * w[..., None])


def check_sink(attn_sink, q_nope) -> None:
    """attn_sink: (H,) fp32 on q's device, or None."""
    if attn_sink is None:
        return
    check_shaped("attn_sink", attn_sink, q_nope.shape[1:2], (torch.float32,))
    if attn_sink.device != q_nope.device:
        raise ValueError(f"attn_sink is on {attn_sink.device}, q_nope on {q_nope.device}")


@torch.library.custom_op("forgekernel::dsa_sparse_attention", mutates_args=())
def _sparse_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_scale: float,
    ckv_scale: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    check_caches_in_place(ckv_cache, kpe_cache, ckv_scale)
    return _forward(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, softmax_scale, None,
                    ckv_scale, attn_sink)  # fmt: skip


@_sparse_op.register_fake
def _(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices, softmax_scale, ckv_scale=None,
      attn_sink=None):  # fmt: skip
    return _outputs(q_nope, None)


def dsa_sparse_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    sparse_indices: torch.Tensor,
    *,
    softmax_scale: float,
    attn_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """DeepSeek sparse attention (module docstring): q_nope (tokens, H, 512), q_pe (tokens, H,
    64) against ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages, page_size, 64)
    (or FlashMLA's combined (num_pages, page_size, 1, 576), or its FP8 (num_pages, page_size,
    1, 656) float8_e4m3fn / uint8 with bf16 q, as ckv_cache with kpe_cache None),
    each token attending to the slots sparse_indices int32 (tokens, topk) lists (page *
    page_size + offset; -1 padding anywhere). Returns out (tokens, H, 512) in q's dtype and,
    with return_lse, the natural-log LSE (tokens, H) fp32 (0 / -inf where a row lists no slot).
    softmax_scale (required): the un-absorbed scale. attn_sink: (H,) fp32 logits or None
    (module docstring). out: written in place when given. No device read: CUDA-graph
    capturable. Differentiable (module docstring)."""
    scale = check_softmax_scale(softmax_scale)
    ckv, kpe, fp8 = latent_cache_views(ckv_cache, kpe_cache)
    if _valid_at_a_glance(q_nope, q_pe, ckv, kpe, sparse_indices, out, fp8):
        traced = tracing()  # the tensors are plain: only a mode can trace
    else:
        _validate(q_nope, q_pe, ckv, kpe, sparse_indices, out, fp8)
        traced = _traced(q_nope, q_pe, ckv, kpe, sparse_indices, out, attn_sink)
    if attn_sink is not None:
        check_sink(attn_sink, q_nope)
    grad = wants_grad(q_nope, q_pe, ckv, kpe, attn_sink)
    if grad and fp8 is not None:
        raise NotImplementedError("the FP8 cache has no backward: pass 16-bit caches to train")
    if out is not None and out.stride(-1) != 1:  # the combine writes rows of 512 contiguous
        o, lse = dsa_sparse_attention(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices,
                                      softmax_scale=scale, attn_sink=attn_sink,
                                      return_lse=True)  # fmt: skip
        out.copy_(o)
        return (out, lse) if return_lse else out
    if traced or grad:
        o, lse = torch.ops.forgekernel.dsa_sparse_attention(
            q_nope, q_pe, ckv, kpe, sparse_indices, scale, fp8, attn_sink
        )
        if out is not None:
            out.copy_(o)
            o = out
    else:
        check_caches_in_place(ckv, kpe, fp8)  # (a data pointer: real tensors only)
        o, lse = _forward(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, fp8, attn_sink)
    return (o, lse) if return_lse else o


def dsa_sparse_attention_rows(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    return_lse: bool = False,
    out: torch.Tensor | None = None,
):
    """Issue 22's form of `dsa_sparse_attention`: q (S, H, 576) = [q_nope ; q_pe] and kv
    (S_kv, 576) = [c ; r] rows (cuDNN's and FlashMLA's sparse prefill's layout), topk_indices
    int32 (S, topk) rows of kv, -1 padded -> out (S, H, 512) in q's dtype and, with
    return_lse, lse (S, H) fp32 natural log. No copy: q's two column ranges are q_nope / q_pe
    and kv is FlashMLA's combined cache with page size 1, read in place; the same kernel,
    sink, graph capture and autograd (dq, dkv, d_sink through the views) as
    `dsa_sparse_attention`."""
    width = D_LATENT + D_ROPE
    check_tensor("q", q, ndim=3, cuda=False)
    check_tensor("kv", kv, ndim=2, dtypes=(q.dtype,), cuda=False)
    if q.shape[-1] != width or kv.shape[-1] != width:
        raise ValueError(
            f"q and kv must be (S, H, {width}) and (S_kv, {width}), got {tuple(q.shape)} and"
            f" {tuple(kv.shape)}"
        )
    # Checked under this form's names (the 2026-12-05 audit: q's device and the index errors
    # named q_nope and sparse_indices, arguments this call does not have).
    check_tensor("topk_indices", topk_indices, ndim=2, dtypes=INDEX, cuda=False)
    if topk_indices.shape[0] != q.shape[0]:
        raise ValueError(
            f"topk_indices must be (S, topk) with S = {q.shape[0]} (q's rows), got"
            f" {tuple(topk_indices.shape)}"
        )
    check_cuda("q", q)
    check_same_device(q=q, kv=kv, topk_indices=topk_indices)
    q_nope, q_pe = q.split_with_sizes((D_LATENT, D_ROPE), -1)
    return dsa_sparse_attention(q_nope, q_pe, kv.view(kv.shape[0], 1, 1, width), None,
                                topk_indices, softmax_scale=softmax_scale, attn_sink=attn_sink,
                                return_lse=return_lse, out=out)  # fmt: skip


def dsa_sparse_attention_flashinfer(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    sm_scale: float | torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{1,64}` as it is
    (keyword names theirs, so `(**inputs)` works): q_nope (tokens, H, 512), q_pe (tokens, H,
    64), caches (num_pages, page_size, 512 / 64), sparse_indices int32 (tokens, topk) of
    flattened slots, -1 padded; sm_scale a float or 0-d tensor (a tensor on the GPU is read
    once: a device sync) -> (output (tokens, H, 512) in q's dtype, lse (tokens, H) fp32 base
    2, -inf for a row with no index)."""
    out, lse = dsa_sparse_attention(q_nope, q_pe, ckv_cache, kpe_cache, sparse_indices,
                                    softmax_scale=float(sm_scale), return_lse=True)  # fmt: skip
    return out, lse * LOG2E
