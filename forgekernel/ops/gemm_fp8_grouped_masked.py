"""`forgekernel.ops.gemm_fp8_grouped_masked`: the grouped (MoE, masked layout) block-scaled FP8
GEMM on Hopper for decode, DeepGEMM's `m_grouped_fp8_fp4_gemm_nt_masked` with FP8 weights.
Expert e multiplies the first masked_m[e] rows of its slice of A:
out[e, r] = (A[e, r] x scale_a[e, r]) @ (B[e] x scale_b[e])^T for r < masked_m[e], A and B
float8_e4m3fn, fp32 scales per 1x128 group of A and per 128x128 block of each expert's B, fp32
accumulation promoted every 128 of K, bf16 / fp16 out.

masked_m is read on the device only (no host sync: a CUDA graph captured once serves any
counts); rows r >= masked_m[e] are neither computed nor written (an `out` keeps what it held
there; a fresh one holds whatever torch.empty gave). `expected_m`, a host-side hint (typically
the routed tokens x top-k / experts), picks the tile: rows per tile as few as cover twice it
(the counts spread around the mean), so an expert with many more rows takes several tiles
(correct, slower).

Eager calls go straight to the leaf's launcher (`kernels/gemm/dense/sm90/launch.py`);
under `torch.compile` (or when autograd would record the call) the custom op
`forgekernel::gemm_fp8_grouped_masked` (a new output) or `..._masked_out` (writes `out`) runs
instead (no backward: it fails loudly).
"""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.dense.sm90 import launch as dense_launch
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._dispatch import wants_grad
from forgekernel.ops._validate import (
    check_cuda,
    check_same_device,
    check_shaped,
    check_tensor,
)
from forgekernel.runtime.device import copy_back, tma_target

FP8 = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16)
SCALE = (torch.float32,)
COUNTS = (torch.int32,)
BLOCK = 128  # the scale block


def _multiple(name: str, value: int, what: str) -> None:
    if value % BLOCK or value == 0:
        raise ValueError(f"{name} must be a positive multiple of {BLOCK} ({what}), got {value}")


def _validate(a, b, scale_a, scale_b, masked_m, expected_m, out_dtype, out) -> None:
    check_tensor("a", a, ndim=3, dtypes=FP8, cuda=False)
    check_tensor("b", b, ndim=3, dtypes=FP8, cuda=False)
    experts, max_m, k = a.shape
    eb, n, kb = b.shape
    if (eb, kb) != (experts, k):
        raise ValueError(f"a is (E, max_m, K) = {tuple(a.shape)} and b (E, N, K) is "
                         f"{tuple(b.shape)}: E or K mismatch")  # fmt: skip
    if experts == 0:
        raise ValueError("a and b must hold at least one expert (E >= 1)")
    _multiple("K", k, "the scale block")
    _multiple("N", n, "whole scale blocks per expert")
    if isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 1:
        raise TypeError(f"expected_m must be a positive int (a host-side hint), got {expected_m!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    check_shaped("scale_a", scale_a, (experts, max_m, k // BLOCK), SCALE)
    check_shaped("scale_b", scale_b, (experts, n // BLOCK, k // BLOCK), SCALE)
    check_shaped("masked_m", masked_m, (experts,), COUNTS)
    if out is not None:
        check_shaped("out", out, (experts, max_m, n), (out_dtype,))
    check_cuda("a", a)
    extra = {} if out is None else {"out": out}
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, masked_m=masked_m, **extra)


def _launch(a, b, scale_a, scale_b, masked_m, expected_m, out) -> None:
    """The kernel writes `out` in place (rows past the counts left alone): a view TMA cannot
    address goes through a copy of it (the rows left alone come back unchanged)."""
    target = tma_target(out, keep=True)
    dense_launch.gemm_fp8_masked(a, b, scale_a, scale_b, masked_m.contiguous(), expected_m, target)
    copy_back((out,), (target,))


@torch.library.custom_op("forgekernel::gemm_fp8_grouped_masked", mutates_args=())
def _masked_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(*a.shape[:2], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(a, b, scale_a, scale_b, masked_m, expected_m, out)
    return out


@_masked_op.register_fake
def _(a, b, scale_a, scale_b, masked_m, expected_m, out_dtype):
    return a.new_empty(*a.shape[:2], b.shape[1], dtype=out_dtype)


@torch.library.custom_op("forgekernel::gemm_fp8_grouped_masked_out", mutates_args=("out",))
def _masked_out_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    out: torch.Tensor,
) -> None:
    _launch(a, b, scale_a, scale_b, masked_m, expected_m, out)


@_masked_out_op.register_fake
def _(a, b, scale_a, scale_b, masked_m, expected_m, out) -> None:
    return None


def gemm_fp8_grouped_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """out[e, r] = (a[e, r] x scale_a[e, r]) @ (b[e] x scale_b[e])^T for r < masked_m[e].

    a (E, max_m, K) float8_e4m3fn, each expert's tokens in its first rows; b (E, N, K)
    float8_e4m3fn (K-major, as DeepGEMM's masked GEMM); scale_a (E, max_m, K/128) fp32, one
    per 1x128 group of a; scale_b (E, N/128, K/128) fp32, one per 128x128 block of each
    expert; either scale tensor with any strides (DeepGEMM's M-major, TMA-aligned scale_a
    included); masked_m int32 (E,) on a's device: each expert's row count, read on the device
    only (a count outside [0, max_m] is read as the nearest end); expected_m a positive int,
    the rows an expert is expected to hold (picks the tile, never read as a bound). N and K
    positive multiples of 128; out (E, max_m, N) out_dtype (bf16 or fp16), any view: rows
    r >= masked_m[e] keep what they held. Returns out (a new tensor when None: its rows past
    the counts are uninitialized). Scales are not checked for non-finite values (a device
    sync).
    """
    _validate(a, b, scale_a, scale_b, masked_m, expected_m, out_dtype, out)
    args = (a, b, scale_a, scale_b, masked_m)
    if _traced(*args, out) or wants_grad(a, b, scale_a, scale_b):
        if out is None:
            return torch.ops.forgekernel.gemm_fp8_grouped_masked(*args, expected_m, out_dtype)
        torch.ops.forgekernel.gemm_fp8_grouped_masked_out(*args, expected_m, out)
        return out
    if out is None:
        out = torch.empty(*a.shape[:2], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(*args, expected_m, out)
    return out
