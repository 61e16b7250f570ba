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

THE KERNEL (kernels/attention/dsa_sparse_bwd/sm90, v1: dq and the fp32 dkv accumulator; the
preprocess and the dkv cast in torch) runs wherever it takes the inputs (`launch.unsupported`:
CUDA, 16-bit, H 16 or a multiple of 32); checked on the H200 2026-12-03 (check, memcheck,
racecheck clean), 0.57x cuDNN's backward at the suite's median (docs/attention/DSA_BWD_NOTES.md).
Elsewhere, or with FORGEKERNEL_DSA_BWD_KERNEL=0, the INTERIM PATH: the reference's chunked
backward in fp32 on the GPU with torch ops (`_backward_interim`: chunks of queries whose
gathered rows and scores fit INTERIM_CHUNK_ELEMENTS, dkv by index_add). Both paths: an eager
call reads the indices' max on the host, one sync, and raises the same ValueError for an index
past the cache's slots; under CUDA-graph capture that check is skipped and nothing is read back.
The kernel's dkv sums by fp32 atomics: not bitwise repeatable.

`dsa_sparse_attention_backward` is the same backward for callers with their own autograd (the
forward's out / lse in hand) and for the suite's timing.
"""

from __future__ import annotations

import os

import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch as kernel_launch
from forgekernel.kernels.attention.mla.sm90.config import D_LATENT, D_ROPE
from forgekernel.ops import dsa as fwd
from forgekernel.ops._dispatch import capturing as _capturing
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import check_same_device, check_shaped
from forgekernel.ops.mla import check_softmax_scale, latent_cache_views
from forgekernel.reference import dsa as ref

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
F32 = (torch.float32,)
# Elements of one chunk's intermediates (gathered rows + scores), fp32: 512 MiB. 4096 queries x
# 16 heads x top-2048 run as ~40 chunks of ~100 queries.
INTERIM_CHUNK_ELEMENTS = 1 << 27
# "0": the interim path everywhere; unset or "1": the kernel where it takes the inputs.
KERNEL_ENV = "FORGEKERNEL_DSA_BWD_KERNEL"


def kernel_selected() -> bool:
    env = os.environ.get(KERNEL_ENV, "")
    if env not in ("", "0", "1"):
        raise ValueError(f"{KERNEL_ENV} must be '0' or '1', got {env!r}")
    return env != "0"


def _backward_interim(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                      attn_sink) -> Grads:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). One copy of q and
    of the cache as (S, H, 576) / (slots, 576) in q's dtype; dkv fp32 over every slot. Under
    CUDA-graph capture nothing is read back: the eager call's check of the largest index (a
    host read) is skipped, an index past the cache is the caller's error (as the forward's)."""
    q = torch.cat((q_nope, q_pe), -1)
    kv = torch.cat((ckv.flatten(0, 1), kpe.flatten(0, 1)), -1)
    dq, dkv, d_sink = ref.dsa_sparse_attention_bwd_ref(
        q, kv, sparse_indices, scale, dout, attn_sink=attn_sink, out=out, lse=lse, dlse=dlse,
        d_v=D_LATENT, dtype=torch.float32, dq_dtype=q.dtype,
        chunk_elements=INTERIM_CHUNK_ELEMENTS if q.is_cuda else None, check_range=not _capturing(q),
    )  # fmt: skip
    dq_nope, dq_pe = dq.split_with_sizes((D_LATENT, D_ROPE), -1)
    dkv = dkv.to(q.dtype).view(*ckv.shape[:2], D_LATENT + D_ROPE)
    dckv, dkpe = dkv.split_with_sizes((D_LATENT, D_ROPE), -1)
    if d_sink is None:
        d_sink = q.new_zeros(q.shape[1], dtype=torch.float32)
    return dq_nope.contiguous(), dq_pe.contiguous(), dckv.contiguous(), dkpe.contiguous(), d_sink


def _backward_kernel(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                     attn_sink) -> Grads | None:  # fmt: skip
    """The v1 kernel's backward, None where `launch.unsupported` declines the inputs. Copies q
    and the cache into (S, H, 576) / (slots, 576) rows (v1: the kernel reads one row each)."""
    q = torch.cat((q_nope, q_pe), -1)
    kv = torch.cat((ckv.flatten(0, 1), kpe.flatten(0, 1)), -1)
    idx = sparse_indices
    if kernel_launch.unsupported(q, kv, idx) is not None:
        return None
    if not _capturing(q) and idx.numel() and int(idx.max()) >= kv.shape[0]:
        raise ValueError(f"sparse_indices: an entry is >= the cache's {kv.shape[0]} slots")
    dq, dkv, d_sink = kernel_launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, attn_sink, idx,
                                                   scale)  # fmt: skip
    dq_nope, dq_pe = dq.split_with_sizes((D_LATENT, D_ROPE), -1)
    dkv = dkv.to(q.dtype).view(*ckv.shape[:2], D_LATENT + D_ROPE)
    dckv, dkpe = dkv.split_with_sizes((D_LATENT, D_ROPE), -1)
    return dq_nope.contiguous(), dq_pe.contiguous(), dckv.contiguous(), dkpe.contiguous(), d_sink


def _backward_impl(*args) -> Grads:
    """The kernel where it takes the inputs (unless FORGEKERNEL_DSA_BWD_KERNEL=0), else the
    interim path."""
    if kernel_selected():
        grads = _backward_kernel(*args)
        if grads is not None:
            return grads
    return _backward_interim(*args)


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
    """Eager: the implementation directly; traced: the custom op."""
    if _traced(*(a for a in args if isinstance(a, torch.Tensor))):
        return torch.ops.forgekernel.dsa_sparse_attention_bwd(*args)
    return _backward_impl(*args)


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
    None without a sink."""
    scale = check_softmax_scale(softmax_scale)
    ckv, kpe, fp8 = latent_cache_views(ckv_cache, kpe_cache)
    _validate(q_nope, q_pe, ckv, kpe, sparse_indices, out, lse, dout, dlse, attn_sink, fp8)
    grads = _backward(q_nope, q_pe, ckv, kpe, sparse_indices, scale, out, lse, dout, dlse,
                      attn_sink)  # fmt: skip
    dq_nope, dq_pe, dckv, dkpe, d_sink = grads
    if kpe_cache is None:  # the combined cache: one gradient shaped as it
        dckv, dkpe = torch.cat((dckv, dkpe), -1).view(ckv_cache.shape), None
    return dq_nope, dq_pe, dckv, dkpe, (d_sink if attn_sink is not None else None)


__all__ = ["dsa_sparse_attention_backward"]
