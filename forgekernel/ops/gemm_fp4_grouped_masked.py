"""`forgekernel.ops.gemm_fp4_grouped_masked`: the grouped (MoE, masked layout) GEMM with FP8
activations and FP4 weights on Hopper for decode: DeepGEMM's `m_grouped_fp8_fp4_gemm_nt_masked`
with packed e2m1 weights. Expert e multiplies the first masked_m[e] rows of its slice of A:
out[e, r] = (A[e, r] x scale_a[e, r]) @ dequant(B[e], scale_b[e])^T for r < masked_m[e], A
float8_e4m3fn with fp32 scales per 1x128 group, B packed e2m1 with UE8M0 scales per 1x32 of K
(`fp4_pack.py` has the format), fp32 accumulation promoted every 128 of K, bf16 / fp16 out.
Hopper has no FP4 MMA: the kernel widens the weights to e4m3 in registers, exactly (a 1x32
sub-block more than 2^11 below the largest of its row's 128-wide K tile is flushed to zero;
docs/gemm/NOTES.md "FP4 weights").

masked_m and expected_m as `gemm_fp8_grouped_masked` (counts read on the device only; rows past
them neither computed nor written). Eager calls go straight to the leaf's launcher
(`kernels/gemm/fp4/sm90/launch.py`); under `torch.compile` (or when autograd would record the
call) the custom op `forgekernel::gemm_fp4_grouped_masked` / `..._out` runs instead.
"""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.fp4.sm90 import launch as fp4_launch
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._dispatch import wants_grad
from forgekernel.ops._validate import check_cuda, check_same_device, check_shaped, check_tensor
from forgekernel.ops.fp4_pack import pack_scale_words
from forgekernel.runtime.device import copy_back, tma_target

FP8 = (torch.float8_e4m3fn,)
PACKED = (torch.int8, torch.uint8)
OUT_DTYPES = (torch.bfloat16, torch.float16)
BLOCK = 128  # the activations' scale block, the promotion interval, four weight sub-blocks
SUB = 32  # the weights' scale block


def _multiple(name: str, value: int, what: str) -> None:
    if value % BLOCK or value == 0:
        raise ValueError(f"{name} must be a positive multiple of {BLOCK} ({what}), got {value}")


def check_weight_scales(scale_b, experts: int, n: int, k: int) -> None:
    """int32 (E, N, K/128) UE8M0 words or fp32 (E, N, K/32) scales."""
    if not isinstance(scale_b, torch.Tensor) or scale_b.dtype not in (torch.int32, torch.float32):
        raise TypeError(
            "scale_b must be int32 (E, N, K/128) packed UE8M0 words or fp32 (E, N, K/32) "
            f"powers of two, got {getattr(scale_b, 'dtype', type(scale_b).__name__)}"
        )
    per = k // BLOCK if scale_b.dtype == torch.int32 else k // SUB
    check_shaped("scale_b", scale_b, (experts, n, per), (scale_b.dtype,))


def _validate(a, b, scale_a, scale_b, masked_m, expected_m, out_dtype, out) -> None:
    check_tensor("a", a, ndim=3, dtypes=FP8, cuda=False)
    check_tensor("b", b, ndim=3, dtypes=PACKED, cuda=False)
    experts, max_m, k = a.shape
    eb, n, half_k = b.shape
    if (eb, 2 * half_k) != (experts, k):
        raise ValueError(f"a is (E, max_m, K) = {tuple(a.shape)} and b (E, N, K/2) packed e2m1 "
                         f"is {tuple(b.shape)}: E or K mismatch")  # fmt: skip
    if experts == 0:
        raise ValueError("a and b must hold at least one expert (E >= 1)")
    _multiple("K", k, "the activations' scale block")
    _multiple("N", n, "the kernel's 128-row weight tile")
    if isinstance(expected_m, bool) or not isinstance(expected_m, int) or expected_m < 1:
        raise TypeError(f"expected_m must be a positive int (a host-side hint), got {expected_m!r}")
    if out_dtype not in OUT_DTYPES:
        raise TypeError(f"out_dtype must be torch.bfloat16 or torch.float16, got {out_dtype}")
    check_shaped("scale_a", scale_a, (experts, max_m, k // BLOCK), (torch.float32,))
    check_weight_scales(scale_b, experts, n, k)
    check_shaped("masked_m", masked_m, (experts,), (torch.int32,))
    if out is not None:
        check_shaped("out", out, (experts, max_m, n), (out_dtype,))
    check_cuda("a", a)
    extra = {} if out is None else {"out": out}
    check_same_device(a=a, b=b, scale_a=scale_a, scale_b=scale_b, masked_m=masked_m, **extra)


def weight_words(scale_b: torch.Tensor) -> torch.Tensor:
    """The exponent words N-major: fp32 scales packed (a copy per call: keep the packed form),
    int32 words re-laid where their strides are not the kernel's."""
    if scale_b.dtype == torch.float32:
        scale_b = pack_scale_words(scale_b)
    return fp4_launch.n_major_words(scale_b)


def _launch(a, b, scale_a, scale_b, masked_m, expected_m, out) -> None:
    """The kernel writes `out` in place (rows past the counts left alone): a view it cannot
    address goes through a copy of it."""
    target = tma_target(out, keep=True)
    fp4_launch.gemm_fp4_masked(
        a, b, weight_words(scale_b), scale_a, masked_m.contiguous(), expected_m, target
    )
    copy_back((out,), (target,))


@torch.library.custom_op("forgekernel::gemm_fp4_grouped_masked", mutates_args=())
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


@torch.library.custom_op("forgekernel::gemm_fp4_grouped_masked_out", mutates_args=("out",))
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


def gemm_fp4_grouped_masked(
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
    """out[e, r] = (a[e, r] x scale_a[e, r]) @ dequant(b[e], scale_b[e])^T for r < masked_m[e].

    a (E, max_m, K) float8_e4m3fn, each expert's tokens in its first rows; scale_a (E, max_m,
    K/128) fp32 per 1x128 group, any strides; b (E, N, K/2) int8 or uint8, two e2m1 codes per
    byte (the even K element in the low nibble: DeepGEMM's packed FP4); scale_b the weights'
    UE8M0 scales per 1x32 of K, either int32 (E, N, K/128) four exponents per word (byte i of
    word j: sub-block 4j + i; read in place when N-major as DeepGEMM keeps them, else re-laid
    per call) or fp32 (E, N, K/32) powers of two (packed per call; a mantissa is dropped);
    masked_m int32 (E,) on a's device, read on the device only; expected_m a positive int, the
    tokens an expert is expected to hold (picks the tile). N and K positive multiples of 128;
    out (E, max_m, N) out_dtype (bf16 or fp16), any view: rows r >= masked_m[e] keep what they
    held. Returns out (a new tensor when None: its rows past the counts are uninitialized).
    `forgekernel.ops.fp4_pack.quantize_fp4_weights` makes b and scale_b from bf16 / fp32 weights.
    """
    _validate(a, b, scale_a, scale_b, masked_m, expected_m, out_dtype, out)
    args = (a, b, scale_a, scale_b, masked_m)
    if _traced(*args, out) or wants_grad(a, scale_a):
        if out is None:
            return torch.ops.forgekernel.gemm_fp4_grouped_masked(*args, expected_m, out_dtype)
        torch.ops.forgekernel.gemm_fp4_grouped_masked_out(*args, expected_m, out)
        return out
    if out is None:
        out = torch.empty(*a.shape[:2], b.shape[1], dtype=out_dtype, device=a.device)
    _launch(*args, expected_m, out)
    return out
