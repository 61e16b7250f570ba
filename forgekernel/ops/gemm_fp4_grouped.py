"""`forgekernel.ops.gemm_fp4_grouped`: the grouped (MoE, contiguous layout) GEMM with FP8
activations and FP4 weights on Hopper, DeepGEMM's `m_grouped_fp8_fp4_gemm_nt_contiguous` with
packed e2m1 weights. Row r of A is multiplied by expert e = m_indices[r]:
C[r] = (A[r] x scale_a[r]) @ dequant(B[e], scale_b[e])^T; the tensors as
`gemm_fp4_grouped_masked` (`fp4_pack.py` has the weights' format) and `gemm_fp8_grouped` (the
layout: every expert's rows contiguous and padded to a multiple of 128, padding rows' index
negative). Padding rows of the output are not written.

Built for decode-sized segments (the kernel cuts each segment into tiles of h tokens, weights
as WGMMA's M: docs/gemm/NOTES.md "FP4 weights"); `expected_m`, a host-side hint of the tokens
an expert holds, picks h (8, 16 or 32; default 32). Eager calls go straight to the leaf's
launcher (`kernels/gemm/fp4/sm90/launch.py`); under `torch.compile` (or when autograd would
record the call) the custom op `forgekernel::gemm_fp4_grouped` / `..._out` runs instead.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.fp4.sm90 import launch as fp4_launch
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._dispatch import wants_grad
from forgekernel.ops._validate import check_cuda, check_same_device, check_shaped, check_tensor
from forgekernel.ops.gemm_fp4_grouped_masked import (
    BLOCK,
    FP8,
    OUT_DTYPES,
    PACKED,
    check_weight_scales,
    weight_words,
)
from forgekernel.runtime.device import copy_back, tma_target


def _validate(a, b, scale_a, scale_b, m_indices, expected_m, out_dtype, out) -> None:
    check_tensor("a", a, ndim=2, dtypes=FP8, cuda=False)
    check_tensor("b", b, ndim=3, dtypes=PACKED, cuda=False)
    m, k = a.shape
    experts, n, half_k = b.shape
    if 2 * half_k != k:
        raise ValueError(f"a is (M, K) = {tuple(a.shape)} and b (E, N, K/2) packed e2m1 is "
                         f"{tuple(b.shape)}: K mismatch")  # fmt: skip
    if experts == 0:
        raise ValueError("b must hold at least one expert (E >= 1)")
    for name, value, what in (("K", k, "the scale block"), ("N", n, "the 128-row weight tile")):
        if value % BLOCK or value == 0:
            raise ValueError(f"{name} must be a positive multiple of {BLOCK} ({what}), got {value}")
    if m % BLOCK:
        raise ValueError(f"M must be a multiple of {BLOCK} (each expert's segment padded), got {m}")
    if expected_m is not None and (
        isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 1
    ):
        raise TypeError(f"expected_m must be None or a positive int, got {expected_m!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    check_shaped("scale_a", scale_a, (m, k // BLOCK), (torch.float32,))
    check_weight_scales(scale_b, experts, n, k)
    check_shaped("m_indices", m_indices, (m,), (torch.int32,))
    if out is not None:
        check_shaped("out", out, (m, n), (out_dtype,))
    check_cuda("a", a)
    extra = {} if out is None else {"out": out}
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, m_indices=m_indices, **extra)


def _launch(a, b, scale_a, scale_b, m_indices, expected_m, out) -> None:
    target = tma_target(out, keep=True)
    fp4_launch.gemm_fp4_contiguous(
        a, b, weight_words(scale_b), scale_a, m_indices.contiguous(), target, expected_m
    )
    copy_back((out,), (target,))


@torch.library.custom_op("forgekernel::gemm_fp4_grouped", mutates_args=())
def _grouped_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
    expected_m: int | None,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(a, b, scale_a, scale_b, m_indices, expected_m, out)
    return out


@_grouped_op.register_fake
def _(a, b, scale_a, scale_b, m_indices, expected_m, out_dtype):
    return a.new_empty(a.shape[0], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("forgekernel::gemm_fp4_grouped_out", mutates_args=("out",))
def _grouped_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
    expected_m: int | None,
    out: torch.Tensor,
) -> None:
    _launch(a, b, scale_a, scale_b, m_indices, expected_m, out)


@_grouped_out_op.register_fake
def _(a, b, scale_a, scale_b, m_indices, expected_m, out) -> None:
    return None


def gemm_fp4_grouped(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
    *,
    expected_m: int | None = None,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C[r] = (a[r] x scale_a[r]) @ dequant(b[e], scale_b[e])^T with e = m_indices[r] >= 0.

    a (M, K) float8_e4m3fn, every expert's rows contiguous and padded to a multiple of 128 (M
    too); scale_a (M, K/128) fp32 per 1x128 group, any strides; b (E, N, K/2) int8 / uint8
    packed e2m1 and scale_b the UE8M0 1x32 scales, int32 (E, N, K/128) words or fp32
    (E, N, K/32), as `gemm_fp4_grouped_masked`; m_indices int32 (M,) on a's device, each row's
    expert, negative for padding (not read on the host: an index >= E reads past b, a segment
    that is not 128-aligned takes its tile's first row's expert). N and K positive multiples
    of 128; out (M, N) out_dtype (bf16 or fp16), any view: padding rows keep what they held
    (a fresh out: uninitialized there). `expected_m`: tokens an expert is expected to hold
    (picks the tile), None for the default.
    """
    _validate(a, b, scale_a, scale_b, m_indices, expected_m, out_dtype, out)
    args = (a, b, scale_a, scale_b, m_indices)
    if _traced(*args, out) or wants_grad(a, scale_a):
        if out is None:
            return torch.ops.forgekernel.gemm_fp4_grouped(*args, expected_m, out_dtype)
        torch.ops.forgekernel.gemm_fp4_grouped_out(*args, expected_m, out)
        return out
    if out is None:
        out = torch.empty(a.shape[0], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(*args, expected_m, out)
    return out
