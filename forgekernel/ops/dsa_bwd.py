"""The backward of `forgekernel.dsa_sparse_attention` (DeepSeek sparse attention, issue 22) and
its autograd, built as Gated DeltaNet's (ops/gated_delta_rule_bwd.py).

`forgekernel::dsa_sparse_attention` (ops/dsa.py, the forward on the MLA leaf's sparse mode)
gets a backward formula here (`torch.library.register_autograd`): it saves q_nope, q_pe, the
caches' 16-bit views, the indices, the sink and the forward's out and lse (what a kernel reads:
cuDNN's `sparse_attention_backward_wrapper` takes the same), and calls
`forgekernel::dsa_sparse_attention_bwd`, which returns (dq_nope, dq_pe, dckv, dkpe, d_sink).

Math (reference/dsa.py `dsa_sparse_attention_bwd_ref`; K = [c ; r] the 576-wide latent rows,
V = c): lse_all = logaddexp(lse, sink), P = exp(scale q K^T - lse_all) over the listed rows,
Delta = rowsum(dO * O) - dLSE exp(lse_all - lse) (the LSE's own gradient folded in),
dS = P (dO V^T - Delta), dq = scale dS K, dkv[idx] += scale dS^T q + P^T dO (first 512),
d_sink = -sum_t P_sink Delta with P_sink = exp(sink - lse_all). dkv sums over every head and
every query that listed the row; -1 entries add nothing; a row with no entry has zero
gradients. dq, dkv come back in q's dtype (fp32 accumulation), d_sink fp32 (zeros when no sink).

THE KERNEL (kernels/attention/dsa_sparse_bwd/sm90, v1: dq and the fp32 dkv accumulator, after
the preprocess kernel kernels/attention/dsa_sparse_bwd_pre/sm90: lse2, Delta' and the d_sink
terms in one pass over out / dO; the dkv cast in torch) runs wherever it takes the inputs
(`launch.unsupported`: CUDA, 16-bit, H 16 or a multiple of 32); at H a multiple of 64 the
launcher's default runs its fused h64 kernel (kernel_h64f.py: one CTA a (token, 64 heads), dkv
and dq in one tile loop; before it the two-kernel h64 form, kernel_h64.py, 0.64-0.84 of v1's
time on the H100 2026-12-06, which the launcher keeps as h64_fused=False); over a cache larger
than the L2 the launcher sorts the index rows and launches one wave of CTAs at a time (its
`sweep`; DSA_BWD_NOTES.md "Long caches"). It reads q and the cache as (S, H, 576) /
(slots, 576) rows: read in place where q_nope / q_pe (ckv / kpe) are cut from one buffer (a q
split after its projection, FlashMLA's combined cache), else concatenated (`_rows`). The eager
call's gradients are views of the kernel's dq buffer and of the one cast dkv buffer (no split or
join copies; the combined cache's gradient is that buffer); the custom op (torch.compile,
export) returns contiguous copies, its outputs not aliasing one another.
Checked on the H200 2026-12-03 (check, memcheck, racecheck clean), 0.57x cuDNN's backward at
the suite's median then (docs/attention/DSA_BWD_NOTES.md; "Torch around the kernel": this
form, CPU only so far).
Elsewhere, or with FORGEKERNEL_DSA_BWD_KERNEL=0, the INTERIM PATH: the reference's chunked
backward in fp32 on the GPU with torch ops (`_backward_interim`: chunks of queries whose
gathered rows and scores fit INTERIM_CHUNK_ELEMENTS, dkv by index_add). Indices: the kernel
path reads none on the host (no sync a call, as the forward): its kernels skip an entry past the
cache's slots as they skip -1 padding (the forward's contract: entries below the slots). The
interim path reads the largest on the host (one sync) and raises ValueError for one past the
slots; under CUDA-graph capture that check is skipped and nothing is read back.
The kernel's dkv sums by fp32 atomics: not bitwise repeatable.

`dsa_sparse_attention_backward` is the same backward for callers with their own autograd (the
forward's out / lse in hand) and for the suite's timing.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch as kernel_launch
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import launch as pre_launch
from forgekernel.kernels.attention.mla.sm90.config import D_LATENT, D_ROPE
from forgekernel.ops import dsa as fwd
from forgekernel.ops._dispatch import capturing as _capturing
from forgekernel.ops._dispatch import switch_on
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import check_same_device, check_shaped
from forgekernel.ops.mla import check_softmax_scale, latent_cache_views
from forgekernel.reference import dsa as ref

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
Full = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # dq (S, H, 576), dkv (slots, 576), d_sink
F32 = (torch.float32,)
# Elements of one chunk's intermediates (gathered rows + scores), fp32: 512 MiB. 4096 queries x
# 16 heads x top-2048 run as ~40 chunks of ~100 queries.
INTERIM_CHUNK_ELEMENTS = 1 << 27
# "0": the interim path everywhere; unset or "1": the kernel where it takes the inputs.
KERNEL_ENV = "FORGEKERNEL_DSA_BWD_KERNEL"


def kernel_selected() -> bool:
    return switch_on(KERNEL_ENV)


def _joined(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor | None:
    """a (..., n) and b (..., m) as one (..., n + m) view where b's rows follow a's in one
    buffer (q_nope / q_pe cut from one q, a combined cache's two views, the gradients' views of
    one buffer): same storage and strides, unit column stride, b at a's offset + n; else None
    (torch.as_strided refuses a view past the storage)."""
    if a.dtype != b.dtype or a.device != b.device or a.shape[:-1] != b.shape[:-1]:
        return None
    if not a.numel() or not b.numel() or a.stride() != b.stride() or a.stride(-1) != 1:
        return None
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return None
    if b.storage_offset() != a.storage_offset() + a.shape[-1]:
        return None
    try:
        return a.as_strided((*a.shape[:-1], a.shape[-1] + b.shape[-1]), a.stride(),
                            a.storage_offset())  # fmt: skip
    except RuntimeError:
        return None


def _cat(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """torch.cat((a, b), -1), without the copy where `_joined` finds one view."""
    joined = _joined(a, b)
    return torch.cat((a, b), -1) if joined is None else joined


def _rows(q_nope, q_pe, ckv, kpe) -> tuple[torch.Tensor, torch.Tensor]:
    """q (S, H, 576) and kv (slots, 576) rows as the kernel and the interim read them: views
    where the inputs are cut from one buffer (the suite's q and combined cache), else copies
    (the v1 kernel reads one row each: two-tensor rows are its next interface)."""
    return _cat(q_nope, q_pe), _cat(ckv.flatten(0, 1), kpe.flatten(0, 1))


def _backward_interim(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                      attn_sink) -> Full:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). q and the cache
    as (S, H, 576) / (slots, 576) rows (`_rows`); dkv fp32 over every slot. Under CUDA-graph
    capture nothing is read back: the eager call's check of the largest index (a host read) is
    skipped, an index past the cache is the caller's error (as the forward's)."""
    q, kv = _rows(q_nope, q_pe, ckv, kpe)
    dq, dkv, d_sink = ref.dsa_sparse_attention_bwd_ref(
        q, kv, sparse_indices, scale, dout, attn_sink=attn_sink, out=out, lse=lse, dlse=dlse,
        d_v=D_LATENT, dtype=torch.float32, dq_dtype=q.dtype,
        chunk_elements=INTERIM_CHUNK_ELEMENTS if q.is_cuda else None, check_range=not _capturing(q),
    )  # fmt: skip
    if d_sink is None:
        d_sink = q.new_zeros(q.shape[1], dtype=torch.float32)
    return dq, dkv.to(q.dtype), d_sink


def _backward_kernel(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                     attn_sink) -> Full | None:  # fmt: skip
    """The v1 kernel's backward, None where `launch.unsupported` declines the inputs. q and
    the cache as (S, H, 576) / (slots, 576) rows (`_rows`: v1 reads one row each); the
    preprocess by its kernel (kernels/attention/dsa_sparse_bwd_pre/sm90) where it takes out /
    dO, else in torch (the launcher's); dkv cast to q's dtype once. No index is read on the
    host (no sync a call; before 2026-12-06 the largest entry was, to raise on one >= the
    cache's slots): the kernels skip such an entry as they skip -1 padding."""
    q, kv = _rows(q_nope, q_pe, ckv, kpe)
    idx = sparse_indices
    if kernel_launch.unsupported(q, kv, idx) is not None:
        return None
    pre = None
    if pre_launch.unsupported(out, dout) is None:
        pre = pre_launch.preprocess(out, dout, lse, dlse, attn_sink)
    dq, dkv, d_sink = kernel_launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, attn_sink, idx,
                                                   scale, pre=pre)  # fmt: skip
    return dq, dkv.to(q.dtype), d_sink


def _split(full: Full, ckv: torch.Tensor, copy: bool) -> Grads:
    """(dq_nope, dq_pe, dckv, dkpe, d_sink) from the (S, H, 576) / (slots, 576) gradients:
    views of them (copy False: the eager call; `_cat` joins them again without a copy) or
    contiguous copies (the custom op, whose outputs may not alias one another)."""
    dq, dkv, d_sink = full
    dq_nope, dq_pe = dq.split_with_sizes((D_LATENT, D_ROPE), -1)
    dkv = dkv.view(*ckv.shape[:2], D_LATENT + D_ROPE)
    dckv, dkpe = dkv.split_with_sizes((D_LATENT, D_ROPE), -1)
    grads = (dq_nope, dq_pe, dckv, dkpe)
    if copy:
        grads = tuple(g.contiguous() for g in grads)
    return (*grads, d_sink)


def _backward_full(*args) -> Full:
    """The kernel where it takes the inputs (unless FORGEKERNEL_DSA_BWD_KERNEL=0), else the
    interim path: (dq (S, H, 576), dkv (slots, 576) in q's dtype, d_sink (H,) fp32)."""
    if kernel_selected():
        full = _backward_kernel(*args)
        if full is not None:
            return full
    return _backward_interim(*args)


def _backward_impl(*args) -> Grads:
    """The custom op's implementation: `_backward_full`, each gradient its own tensor."""
    return _split(_backward_full(*args), args[2], copy=True)


def _empty_grads(q_nope, q_pe, ckv, kpe) -> Grads:
    like = (q_nope, q_pe, ckv, kpe)
    sink = q_nope.new_empty(q_nope.shape[1], dtype=torch.float32)
    return (*(x.new_empty(x.shape) for x in like), sink)


@torch.library.custom_op("forgekernel::dsa_sparse_attention_bwd", mutates_args=())
def _bwd_op(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv: torch.Tensor,
    kpe: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    dlse: torch.Tensor | None,
    attn_sink: torch.Tensor | None,
) -> Grads:
    return _backward_impl(q_nope, q_pe, ckv, kpe, sparse_indices, softmax_scale, out, lse, dout,
                          dlse, attn_sink)  # fmt: skip


@_bwd_op.register_fake
def _(q_nope, q_pe, ckv, kpe, sparse_indices, softmax_scale, out, lse, dout, dlse, attn_sink):
    return _empty_grads(q_nope, q_pe, ckv, kpe)


def _backward(*args) -> Grads:
    """Eager: the implementation directly, the gradients views of its (S, H, 576) /
    (slots, 576) buffers (no split copies); traced: the custom op (contiguous gradients)."""
    if _traced(*(a for a in args if isinstance(a, torch.Tensor))):
        return torch.ops.forgekernel.dsa_sparse_attention_bwd(*args)
    return _split(_backward_full(*args), args[2], copy=False)


# ---- autograd of the forward op --------------------------------------------------------------


def _setup(ctx, inputs, output) -> None:
    q_nope, q_pe, ckv, kpe, sparse_indices, scale, ckv_scale, attn_sink = inputs
    if ckv_scale is not None:
        raise NotImplementedError("the FP8 cache has no backward: pass 16-bit caches to train")
    out, lse = output
    ctx.save_for_backward(q_nope, q_pe, ckv, kpe, sparse_indices, attn_sink, out, lse)
    ctx.scale = scale


def _grad(ctx, dout, dlse):
    q_nope, q_pe, ckv, kpe, sparse_indices, attn_sink, out, lse = ctx.saved_tensors
    dout = torch.zeros_like(out) if dout is None else dout
    grads = _backward(q_nope, q_pe, ckv, kpe, sparse_indices, ctx.scale, out, lse, dout, dlse,
                      attn_sink)  # fmt: skip
    d_sink = grads[4] if attn_sink is not None else None
    return (*grads[:4], None, None, None, d_sink)


torch.library.register_autograd("forgekernel::dsa_sparse_attention", _grad, setup_context=_setup)


# ---- explicit backward ---------------------------------------------------------------------


def _validate(q_nope, q_pe, ckv, kpe, sparse_indices, out, lse, dout, dlse, attn_sink,
              fp8) -> None:  # fmt: skip
    """The forward's checks, then the saved tensors' and the gradients', each by name."""
    if fp8 is not None:
        raise NotImplementedError("the FP8 cache has no backward: pass 16-bit caches")
    fwd._validate(q_nope, q_pe, ckv, kpe, sparse_indices, None)
    rows = (*q_nope.shape[:2], D_LATENT)
    check_shaped("out", out, rows, (q_nope.dtype,))
    check_shaped("dout", dout, rows, (q_nope.dtype,))
    check_shaped("lse", lse, rows[:2], F32)
    if dlse is not None:
        check_shaped("dlse", dlse, rows[:2], F32)
    fwd.check_sink(attn_sink, q_nope)
    extra = {"dlse": dlse} if dlse is not None else {}
    check_same_device(q_nope=q_nope, out=out, lse=lse, dout=dout, **extra)


def dsa_sparse_attention_backward(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor | None,
    sparse_indices: torch.Tensor,
    dout: torch.Tensor,
    *,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(dq_nope, dq_pe, dckv_cache, dkpe_cache, d_sink) of `dsa_sparse_attention(q_nope, q_pe,
    ckv_cache, kpe_cache, sparse_indices, softmax_scale=..., attn_sink=...)` given its out
    (tokens, H, 512) and lse (tokens, H) fp32 (return_lse=True), dout (tokens, H, 512) in q's
    dtype and dlse (tokens, H) fp32 or None. Caches as the forward takes them (16-bit): the
    gradients come back shaped as their inputs in q's dtype (FlashMLA's combined cache: one
    (num_pages, page_size, 1, 576) gradient as dckv_cache, dkpe_cache None); d_sink (H,) fp32,
    None without a sink. sparse_indices as the forward takes them: -1 padding or an entry below
    the cache's slots; the kernel path reads none on the host (no sync) and skips an entry past
    the slots as padding, the interim path raises ValueError for one."""
    scale = check_softmax_scale(softmax_scale)
    ckv, kpe, fp8 = latent_cache_views(ckv_cache, kpe_cache)
    _validate(q_nope, q_pe, ckv, kpe, sparse_indices, out, lse, dout, dlse, attn_sink, fp8)
    grads = _backward(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                      attn_sink)  # fmt: skip
    dq_nope, dq_pe, dckv, dkpe, d_sink = grads
    if kpe_cache is None:  # the combined cache: one gradient shaped as it (eager: the view)
        traced = _traced(dckv, dkpe)
        both = torch.cat((dckv, dkpe), -1) if traced else _cat(dckv, dkpe)
        dckv, dkpe = both.view(ckv_cache.shape), None
    return dq_nope, dq_pe, dckv, dkpe, (d_sink if attn_sink is not None else None)


__all__ = ["dsa_sparse_attention_backward"]
