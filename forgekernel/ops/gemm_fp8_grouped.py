"""`forgekernel.gemm_fp8_grouped`: the grouped (MoE, contiguous layout) block-scaled FP8 GEMM on
Hopper, DeepGEMM's `m_grouped_fp8_gemm_nt_contiguous`. Row r of A is multiplied by expert
e = m_indices[r] of B: C[r] = (A[r] x scale_a[r]) @ (B[e] x scale_b[e])^T, A and B
float8_e4m3fn, fp32 scales per 1x128 group of A and per 128x128 block of each expert's B, fp32
accumulation promoted every 128 of K, bf16 / fp16 out.

Layout (the kernel reads one expert per 128-row tile, from the tile's first row): every
expert's rows contiguous and padded to a multiple of 128; padding rows carry a negative index
(-1 by convention) and their output rows are not the caller's (computed with some expert).

Eager calls go straight to the leaf's launcher (`kernels/gemm/fp8/sm90/launch.py`); under
`torch.compile` (or when autograd would record the call) the custom op
`forgekernel::gemm_fp8_grouped` runs instead (no backward: it fails loudly).
"""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_sm90
from forgekernel.ops._dispatch import plain, tracing, wants_grad
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    PassedChecks,
    check_cuda,
    check_same_device,
    check_shaped,
    check_tensor,
    on_one_device,
    tensor_key,
)
from forgekernel.runtime.device import tma_target

FP8 = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16)
SCALE = (torch.float32,)
INDEX = (torch.int32,)
BLOCK = 128  # the scale block, and the row alignment of each expert's segment (the tile)


def _multiple(name: str, value: int, what: str, positive: bool = False) -> None:
    if value % BLOCK or (positive and value == 0):
        sign = "positive " if positive else ""
        raise ValueError(f"{name} must be a {sign}multiple of {BLOCK} ({what}), got {value}")


def _validate(a, b, scale_a, scale_b, m_indices, out_dtype, out) -> tuple[int, int]:
    check_tensor("a", a, ndim=2, dtypes=FP8, cuda=False)
    check_tensor("b", b, ndim=3, dtypes=FP8, cuda=False)
    m, k = a.shape
    experts, n, kb = b.shape
    if kb != k:
        raise ValueError(f"a is (M, K) = {tuple(a.shape)} and b (E, N, K) is {tuple(b.shape)}: "
                         f"K mismatch ({k} vs {kb})")  # fmt: skip
    if experts == 0:
        raise ValueError("b must hold at least one expert (E >= 1)")
    _multiple("K", k, "the scale block", positive=True)
    _multiple("N", n, "whole scale blocks per expert")
    _multiple("M", m, "every expert's rows padded to whole 128-row tiles")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    check_shaped("scale_a", scale_a, (m, k // BLOCK), SCALE)
    check_shaped("scale_b", scale_b, (experts, n // BLOCK, k // BLOCK), SCALE)
    check_shaped("m_indices", m_indices, (m,), INDEX)
    if out is not None:
        check_shaped("out", out, (m, n), (out_dtype,))
    check_cuda("a", a)
    extra = {} if out is None else {"out": out}
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, m_indices=m_indices, **extra)
    return m, n


# The named checks' (M, N) per plain eager call's key (issue 17/21: the checks were ~9 of the
# ~23 us per call on the CPU with a kernel stub): `_validate` depends on the shapes and dtypes
# alone but for its device checks, which `_seen` makes per call.
_PASSED = PassedChecks()


def _seen(a, b, scale_a, scale_b, m_indices, out_dtype, out) -> tuple:
    """(key, (M, N)) of a call: key None when it is traced or an argument is not a plain
    tensor (the named checks, then `traced` decides), (M, N) None when the named checks must
    decide."""
    if tracing() or not plain(a, b, scale_a, scale_b, m_indices, optional=(out,)):
        return None, None
    if type(out_dtype) is not torch.dtype:
        return None, None
    key = (a.shape, a.dtype, b.shape, b.dtype, scale_a.shape, scale_a.dtype, scale_b.shape,
           scale_b.dtype, m_indices.shape, m_indices.dtype, out_dtype, tensor_key(out))  # fmt: skip
    passed = _PASSED.get(key)
    if passed is None:
        return key, None
    check_cuda("a", a)
    # a tensor on another device: the named checks name it
    return key, passed if on_one_device(a, b, scale_a, scale_b, m_indices, out) else None


def _launch(a, b, scale_a, scale_b, m_indices, out) -> None:
    """The launcher writes `out` in place (TMA store): a view it cannot address goes through a
    compact buffer; the kernel reads the indices with unit stride."""
    target = tma_target(out)
    fp8_sm90.gemm_fp8_grouped(a, b, scale_a, scale_b, m_indices.contiguous(), target)
    if target is not out:
        out.copy_(target)


@torch.library.custom_op("forgekernel::gemm_fp8_grouped", mutates_args=())
def _gemm_fp8_grouped_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(a, b, scale_a, scale_b, m_indices, out)
    return out


@_gemm_fp8_grouped_op.register_fake
def _(a, b, scale_a, scale_b, m_indices, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


def gemm_fp8_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[r] = (a[r] x scale_a[r]) @ (b[e] x scale_b[e])^T with e = m_indices[r].

    a (M, K) float8_e4m3fn, every expert's rows contiguous and padded to a multiple of 128
    (M, the sum, too); b (E, N, K) float8_e4m3fn (K-major, as DeepGEMM's
    `m_grouped_fp8_gemm_nt_contiguous`); scale_a (M, K/128) fp32, one per 1x128 group of a;
    scale_b (E, N/128, K/128) fp32, one per 128x128 block of each expert; m_indices int32 (M,)
    on a's device: each row's expert, negative (-1) for padding rows, whose output rows are
    not the caller's. N and K multiples of 128; out (M, N) out_dtype (bf16 or fp16).

    m_indices is not read on the host (that would cost a device sync): an index >= E reads
    past b and scale_b, as in DeepGEMM, and a segment that is not 128-aligned takes the
    expert of its tile's first row. Scales are not checked for non-finite values either.
    """
    key, passed = _seen(a, b, scale_a, scale_b, m_indices, out_dtype, out)
    if passed is None:
        passed = _validate(a, b, scale_a, scale_b, m_indices, out_dtype, out)
        if key is not None:
            _PASSED.remember(key, passed)
    m, n = passed
    args = (a, b, scale_a, scale_b, m_indices)
    # a key: plain tensors, no mode
    if (key is None and _traced(*args, out)) or wants_grad(a, b, scale_a, scale_b):
        result = torch.ops.forgekernel.gemm_fp8_grouped(*args, out_dtype)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    _launch(*args, out)
    return out


grouped_gemm_fp8 = gemm_fp8_grouped  # issue 21's name (the masked layout: gemm_fp8_grouped_masked)
