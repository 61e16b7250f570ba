"""`forgekernel.gemm_fp8`: block-scaled FP8 GEMM on Hopper (DeepSeek-V3's recipe), C =
(A x scale_a) @ (B x scale_b)^T with A, B float8_e4m3fn, fp32 scales per 1x128 group of A and
per 128x128 block of B, fp32 accumulation promoted every 128 of K, bf16 / fp16 out.

Eager calls go straight to the leaf's launcher (`kernels/gemm/fp8/sm90/launch.py`); under
`torch.compile` (or when autograd would record the call) the custom op `forgekernel::gemm_fp8`
runs instead (no backward: it fails loudly).
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

FP8 = (torch.float8_e4m3fn,)
OUT_DTYPES = (torch.bfloat16, torch.float16)
SCALE = (torch.float32,)
BLOCK = 128


def _validate(a, b, scale_a, scale_b, out_dtype, out) -> tuple[int, int, int]:
    check_tensor("a", a, ndim=2, dtypes=FP8, cuda=False)
    check_tensor("b", b, ndim=2, dtypes=FP8, cuda=False)
    m, k = a.shape
    n, kb = b.shape
    if kb != k:
        raise ValueError(f"a is (M, K) = {tuple(a.shape)} and b (N, K) is {tuple(b.shape)}: "
                         f"K mismatch ({k} vs {kb})")  # fmt: skip
    if k == 0 or k % BLOCK:
        raise ValueError(f"K must be a positive multiple of {BLOCK} (the scale block), got {k}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    check_shaped("scale_a", scale_a, (m, k // BLOCK), SCALE)
    check_shaped("scale_b", scale_b, (-(-n // BLOCK), k // BLOCK), SCALE)
    if out is not None:
        check_shaped("out", out, (m, n), (out_dtype,))
    check_cuda("a", a)
    extra = {} if out is None else {"out": out}
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, **extra)
    return m, n, k


# The named checks' (M, N, K) per plain eager call's key (issue 17): `_validate` depends on the
# shapes and dtypes alone but for its device checks, which `_seen` makes per call.
_PASSED = PassedChecks()


def _seen(a, b, scale_a, scale_b, out_dtype, out) -> tuple:
    """(key, (M, N, K)) of a call: key None when it is traced or an argument is not a plain
    tensor (the named checks, then `traced` decides), (M, N, K) None when the named checks
    must decide."""
    if tracing() or not plain(a, b, scale_a, scale_b, optional=(out,)):
        return None, None
    if type(out_dtype) is not torch.dtype:
        return None, None
    key = (a.shape, a.dtype, b.shape, b.dtype, scale_a.shape, scale_a.dtype, scale_b.shape,
           scale_b.dtype, out_dtype, tensor_key(out))  # fmt: skip
    passed = _PASSED.get(key)
    if passed is None:
        return key, None
    check_cuda("a", a)
    # a tensor on another device: the named checks name it
    return key, passed if on_one_device(a, b, scale_a, scale_b, out) else None


@torch.library.custom_op("forgekernel::gemm_fp8", mutates_args=())
def _gemm_fp8_op(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
) -> torch.Tensor:
    out = torch.empty(a.shape[0], b.shape[0], dtype=out_dtype, device=a.device)
    fp8_sm90.gemm_fp8(a, b, scale_a, scale_b, out)
    return out


@_gemm_fp8_op.register_fake
def _(a, b, scale_a, scale_b, out_dtype):
    return a.new_empty(a.shape[0], b.shape[0], dtype=out_dtype)


def gemm_fp8(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """C = (a x scale_a) @ (b x scale_b)^T.

    a (M, K) and b (N, K) float8_e4m3fn (K-major, as DeepGEMM's `fp8_gemm_nt`); scale_a
    (M, K/128) fp32, one per 1x128 group of a; scale_b (ceil(N/128), K/128) fp32, one per
    128x128 block of b; either scale tensor row- or column-major (power-of-two scales are
    fp32 values like any other). Any M and N, K a multiple of 128; out (M, N) out_dtype
    (bf16 or fp16). The tensor cores' FP8 accumulation is promoted into fp32 registers every
    128 of K. Scales are not checked for non-finite values (that would cost a device sync).
    """
    key, passed = _seen(a, b, scale_a, scale_b, out_dtype, out)
    if passed is None:
        passed = _validate(a, b, scale_a, scale_b, out_dtype, out)
        if key is not None:
            _PASSED.remember(key, passed)
    m, n, _ = passed
    # a key: plain tensors, no mode
    if (key is None and _traced(a, b, scale_a, scale_b, out)) or wants_grad(a, b, scale_a, scale_b):
        result = torch.ops.forgekernel.gemm_fp8(a, b, scale_a, scale_b, out_dtype)
        if out is None:
            return result
        out.copy_(result)
        return out
    if out is None:
        out = torch.empty(m, n, dtype=out_dtype, device=a.device)
    fp8_sm90.gemm_fp8(a, b, scale_a, scale_b, out)
    return out
