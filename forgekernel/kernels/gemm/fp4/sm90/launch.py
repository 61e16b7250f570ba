"""Host launchers of the FP4-weight grouped GEMM, masked and contiguous layouts: torch only (no
DSL), the kernel through the compile cache. Callers validate first (`forgekernel.ops.
gemm_fp4_grouped_masked` / `gemm_fp4_grouped`) and hand the weights' exponent words N-major
(`n_major_words`)."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.fp4.sm90 import SPEC
from forgekernel.kernels.gemm.fp4.sm90.config import (
    CONTIGUOUS_TOKENS,
    TILE_W,
    choose_tokens,
    params_for,
)
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device


def _batched(t: torch.Tensor) -> torch.Tensor:
    """(E, rows, cols) seen as (rows, cols, E)."""
    return t.permute(1, 2, 0)


def _one_batch(t: torch.Tensor) -> torch.Tensor:
    """(rows, cols) seen as (rows, cols, 1), the unit batch's stride a 16-byte multiple (the
    kernel's operands are compiled batched; a size-1 mode is never stepped over)."""
    per16 = max(1, 16 // t.element_size())
    stride = -(-max(t.shape[0] * t.stride(0), 1) // per16) * per16
    return t.as_strided((*t.shape, 1), (*t.stride(), stride))


def scale_words_ready(words: torch.Tensor) -> bool:
    """int32 (E, N, K/128) exponent words as the kernel's TMA reads them: stride 1 along N,
    the other strides 16-byte multiples, a 16-byte-aligned base."""
    _, sn, sk = words.stride()
    se = words.stride(0)
    return sn == 1 and sk % 4 == 0 and se % 4 == 0 and words.data_ptr() % 16 == 0


def n_major_words(words: torch.Tensor) -> torch.Tensor:
    """(E, N, K/128) int32 with stride 1 along N (DeepGEMM's MN-major layout): `words` itself
    when it already is (`scale_words_ready`), else an N-major copy. The copy goes into a fresh
    (E, K/128, N) buffer: `.contiguous()` would keep a size-1 dim's stride (K = 128 leaves 4
    bytes on K/128), which the compiled kernel rejects and TMA cannot take."""
    if scale_words_ready(words):
        return words
    experts, n, blocks = words.shape
    out = torch.empty(experts, blocks, n, dtype=words.dtype, device=words.device)
    return out.transpose(1, 2).copy_(words)


def gemm_fp4_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    words: torch.Tensor,
    scale_a: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    out: torch.Tensor,
    tokens: int | None = None,
    staged_sa: bool = False,
    converter: bool | int = False,
) -> None:
    """out[e, t] = (a[e, t] x scale_a[e, t]) @ dequant(b[e], words[e])^T for t < masked_m[e];
    the other rows of out are not written. a (E, max_m, K) float8_e4m3fn, b (E, N, K/2) int8
    or uint8 (packed e2m1), words (E, N, K/128) int32 N-major (`scale_words_ready`), scale_a
    (E, max_m, K/128) fp32 any strides, masked_m int32 (E,) contiguous, out (E, max_m, N)
    16-bit TMA-ready. `tokens`: force the tokens per tile (tuning), else by `expected_m`;
    `staged_sa` / `converter`: the opt-in forms staging the activation scales in the ring /
    widening in a converter warpgroup (tuning, the bench's `staged*` / `convert*` variants;
    docs/gemm/NOTES.md "FP4 at 16-96 tokens")."""
    experts, max_m, _ = a.shape
    n = b.shape[1]
    if max_m == 0 or experts == 0:
        return
    h = tokens or choose_tokens(expected_m)
    fn = get_kernel(
        SPEC, params_for(dtype_name(out.dtype), h, staged_sa=staged_sa, converter=converter)
    )
    tiles = experts * -(-max_m // h) * (n // TILE_W)  # the walk's upper bound
    ctas = max(1, min(num_sms(a.device.index), tiles))
    with on_device(a.device):
        fn(
            _batched(as_tma_ready(a)),
            _batched(as_tma_ready(b.view(torch.uint8))),
            _batched(words),
            _batched(out),
            _batched(scale_a),
            masked_m,
            ctas,
        )


def gemm_fp4_contiguous(
    a: torch.Tensor,
    b: torch.Tensor,
    words: torch.Tensor,
    scale_a: torch.Tensor,
    m_indices: torch.Tensor,
    out: torch.Tensor,
    tokens: int | None = None,
    staged_sa: bool = False,
    converter: bool | int = False,
) -> None:
    """out[r] = (a[r] x scale_a[r]) @ dequant(b[e], words[e])^T, e = m_indices[r] >= 0; rows
    with a negative index (padding) are not written. a (M, K) float8_e4m3fn with every
    expert's rows contiguous and padded to a multiple of 128, b (E, N, K/2) int8 / uint8,
    words (E, N, K/128) int32 N-major, scale_a (M, K/128) fp32 any strides, m_indices int32
    (M,) contiguous, out (M, N) 16-bit TMA-ready. `tokens`: the tokens per tile (a hint: the
    tokens an expert is expected to hold), else CONTIGUOUS_TOKENS. `staged_sa` / `converter`:
    the opt-in forms, as `gemm_fp4_masked`'s."""
    m = a.shape[0]
    n = b.shape[1]
    if m == 0:
        return
    h = choose_tokens(tokens, contiguous=True) if tokens else CONTIGUOUS_TOKENS
    params = params_for(
        dtype_name(out.dtype), h, contiguous=True, staged_sa=staged_sa, converter=converter
    )
    fn = get_kernel(SPEC, params)
    ctas = max(1, min(num_sms(a.device.index), -(-m // h) * (n // TILE_W)))
    with on_device(a.device):
        fn(
            _one_batch(as_tma_ready(a)),
            _batched(as_tma_ready(b.view(torch.uint8))),
            _batched(words),
            _one_batch(out),
            _one_batch(scale_a),
            m_indices,
            ctas,
        )
