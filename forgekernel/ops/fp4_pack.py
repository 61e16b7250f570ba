"""FP4 (e2m1) weights as DeepGEMM's FP8 x FP4 GEMMs take them: `b` int8 (..., N, K/2), two codes
per byte, the even K element in the low nibble (code = sign << 3 | magnitude index, magnitudes
0, 0.5, 1, 1.5, 2, 3, 4, 6); UE8M0 scales per 1x32 of K, packed four to an int32 word
(..., N, K/128) (byte i of word j, little-endian: sub-block 4j + i; scale = 2^(byte - 127)),
N-major as DeepGEMM's kernels read them (stride 1 along N). Torch only.

`quantize_fp4_weights` is DeepGEMM's `per_token_cast_to_fp4(use_ue8m0=True, gran_k=32)`
recipe: each 1x32 group's scale is its amax / 6 rounded up to a power of two (amax floored at
1e-4), each value divided by it and rounded to the nearest e2m1 value (ties to the smaller)."""

from __future__ import annotations

import torch

FP4_BLOCK = 32  # K values per scale
E2M1_MAX = 6.0
# midpoints between consecutive e2m1 magnitudes: bucketize gives the magnitude index
_BOUNDARIES = (0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0)


def n_major(t: torch.Tensor) -> torch.Tensor:
    """(..., N, C) with stride 1 along N and N along C (a copy unless it already is; C = 1
    included: a fresh buffer, as `.contiguous()` keeps a size-1 dim's unit stride)."""
    if t.stride(-2) == 1 and (t.shape[-1] > 1 or t.stride(-1) == t.shape[-2]):
        return t
    out = torch.empty(*t.shape[:-2], t.shape[-1], t.shape[-2], dtype=t.dtype, device=t.device)
    return out.transpose(-1, -2).copy_(t)


def pack_scale_words(scale: torch.Tensor) -> torch.Tensor:
    """fp32 (..., N, K/32) power-of-two scales -> int32 (..., N, K/128) UE8M0 words, N-major.
    The exponent is taken as it is (a mantissa is dropped: a scale that is no power of two is
    rounded down to one); K/32 must be a multiple of 4."""
    if scale.dtype != torch.float32 or scale.shape[-1] % 4:
        raise ValueError(
            f"scales must be fp32 (..., N, K/32) with K a multiple of 128, got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    exps = ((scale.contiguous().view(torch.int32) >> 23) & 0xFF).to(torch.uint8)
    return n_major(exps.view(torch.int32))


def unpack_scale_words(words: torch.Tensor) -> torch.Tensor:
    """int32 (..., N, K/128) UE8M0 words -> fp32 (..., N, K/32) scales."""
    # bytes by shifts (any strides: a uint8 view needs stride 1 on K/128, which N-major words
    # at K = 128 lack)
    w = words.to(torch.int64)
    exps = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
    return (exps.to(torch.int32) << 23).view(torch.float32)


def quantize_fp4_weights(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w (..., N, K) floating, K a multiple of 128 -> (packed int8 (..., N, K/2), int32 UE8M0
    words (..., N, K/128) N-major), the module's recipe."""
    if not isinstance(w, torch.Tensor) or not w.is_floating_point() or w.dim() < 2:
        got = f"{w.dtype} {tuple(w.shape)}" if isinstance(w, torch.Tensor) else type(w).__name__
        raise TypeError(f"w must be a floating tensor (..., N, K), got {got}")
    *lead, n, k = w.shape
    if k % 128:
        raise ValueError(f"K must be a multiple of 128 (four 1x32 scales per word), got {k}")
    groups = w.float().reshape(*lead, n, k // FP4_BLOCK, FP4_BLOCK)
    amax = groups.abs().amax(dim=-1).clamp_min(1e-4)
    scale = torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX)))
    x = groups / scale.unsqueeze(-1)
    bounds = torch.tensor(_BOUNDARIES, device=w.device, dtype=torch.float32)
    index = torch.bucketize(x.abs().clamp_max(E2M1_MAX), bounds, out_int32=True).to(torch.uint8)
    codes = index | (((x < 0) & (index != 0)).to(torch.uint8) << 3)
    codes = codes.reshape(*lead, n, k // 2, 2)
    packed = (codes[..., 0] | (codes[..., 1] << 4)).view(torch.int8)
    return packed.contiguous(), pack_scale_words(scale.float())
