"""GEMM references: C = A @ B^T in fp32 (B given as (N, K) or, with b_layout="kn", (K, N)), and
the block-scaled FP8 GEMMs in fp64 (dense, grouped contiguous, grouped masked), and the masked
grouped GEMM with FP4 weights (e2m1 with UE8M0 scales per 1x32 of K) dequantized exactly, in
fp64."""

from __future__ import annotations

import torch


def gemm_ref(a: torch.Tensor, b: torch.Tensor, b_layout: str = "nk") -> torch.Tensor:
    b_nk = b if b_layout == "nk" else b.t()
    return a.float() @ b_nk.float().t()


def gemm_fp8_ref(
    a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor
) -> torch.Tensor:
    """Block-scaled FP8 GEMM in fp64, returned as fp32: a (M, K) times scale_a (M, K/128) per
    1x128 group, b (N, K) times scale_b (ceil(N/128), K/128) per 128x128 block, C = A B^T."""
    n = b.shape[0]
    sa = scale_a.double().repeat_interleave(128, dim=1)
    sb = scale_b.double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, dim=1)
    return ((a.double() * sa) @ (b.double() * sb).t()).float()


def gemm_fp8_grouped_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """Grouped (MoE) block-scaled FP8 GEMM in fp64, returned as fp32: row r of a (M, K), times
    scale_a (M, K/128) per 1x128 group, against expert e = m_indices[r] of b (E, N, K) times
    scale_b (E, ceil(N/128), K/128) per 128x128 block: C[r] = A[r] B[e]^T. Rows whose index is
    negative (padding) are 0; any row order (contiguity is the kernel's constraint, not the
    math's). An index >= E raises ValueError."""
    m = a.shape[0]
    experts, n, _ = b.shape
    idx = m_indices.long()
    if m and int(idx.max()) >= experts:
        raise ValueError(f"m_indices holds {int(idx.max())}, but b has {experts} experts")
    a64 = a.double() * scale_a.double().repeat_interleave(128, dim=1)
    out = torch.zeros(m, n, dtype=torch.float64, device=a.device)
    for e in range(experts):
        rows = (idx == e).nonzero().squeeze(1)
        if rows.numel():
            sb = scale_b[e].double().repeat_interleave(128, dim=0)[:n].repeat_interleave(128, 1)
            out[rows] = a64[rows] @ (b[e].double() * sb).t()
    return out.float()


def gemm_fp8_masked_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    unwritten: float = float("nan"),
) -> torch.Tensor:
    """Grouped (MoE, masked layout) block-scaled FP8 GEMM in fp64, returned as fp32 (E, max_m,
    N): expert e's first masked_m[e] rows of a (E, max_m, K), times scale_a (E, max_m, K/128)
    per 1x128 group, against b[e] (E, N, K) times scale_b (E, ceil(N/128), K/128) per 128x128
    block. The rows past each count are not the product's: they hold `unwritten` (NaN by
    default: a check that poisons the output with NaN then requires them left alone). A count
    outside [0, max_m] raises ValueError."""
    experts, max_m, _ = a.shape
    counts = masked_m.tolist()
    if any(c < 0 or c > max_m for c in counts):
        raise ValueError(f"masked_m holds counts outside [0, {max_m}]: {counts}")
    out = torch.full((experts, max_m, b.shape[1]), unwritten, dtype=torch.float32, device=a.device)
    for e, c in enumerate(counts):
        if c:
            out[e, :c] = gemm_fp8_ref(a[e, :c], b[e], scale_a[e, :c], scale_b[e])
    return out


# e2m1 magnitudes by code & 7 (code = sign << 3 | index)
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_BLOCK = 32  # the weights' scale granularity along K


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP4 weights in fp64 (exact): packed (..., N, K/2) int8 / uint8, two e2m1 codes per byte
    (the even K element in the low nibble); scale per 1x32 of K either fp32 (..., N, K/32) or
    int32 (..., N, K/128), four UE8M0 exponents per word (byte i, little-endian, of word j:
    sub-block 4j + i; scale 2^(byte - 127)). Returns (..., N, K)."""
    p = packed.view(torch.uint8).long()
    codes = torch.stack((p & 0xF, p >> 4), dim=-1).flatten(-2)
    table = torch.tensor(E2M1_VALUES, dtype=torch.float64, device=packed.device)
    vals = table[codes & 7]
    vals = torch.where((codes & 8) != 0, -vals, vals)
    if scale.dtype == torch.int32:
        # bytes by shifts, not a uint8 view: a view needs stride 1 on K/128, and N-major words
        # at K = 128 have a size-1 K/128 dim whose stride is N (.contiguous() keeps it)
        w = scale.long()
        exps = torch.stack([(w >> (8 * i)) & 0xFF for i in range(4)], dim=-1).flatten(-2)
        sub = torch.exp2((exps - 127).double())
    else:
        sub = scale.double()
    return vals * sub.repeat_interleave(FP4_BLOCK, dim=-1)


def gemm_fp4_masked_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    unwritten: float = float("nan"),
) -> torch.Tensor:
    """Masked grouped GEMM with FP4 weights in fp64, returned as fp32 (E, max_m, N): expert e's
    first masked_m[e] rows of a (E, max_m, K) float8_e4m3fn times scale_a (E, max_m, K/128) per
    1x128 group, against b[e] dequantized (`dequantize_fp4`: b (E, N, K/2) packed e2m1,
    scale_b fp32 (E, N, K/32) or packed int32 (E, N, K/128)). Rows past each count hold
    `unwritten`; a count outside [0, max_m] raises ValueError."""
    experts, max_m, _ = a.shape
    counts = masked_m.tolist()
    if any(c < 0 or c > max_m for c in counts):
        raise ValueError(f"masked_m holds counts outside [0, {max_m}]: {counts}")
    out = torch.full((experts, max_m, b.shape[1]), unwritten, dtype=torch.float32, device=a.device)
    for e, c in enumerate(counts):
        if c:
            a64 = a[e, :c].double() * scale_a[e, :c].double().repeat_interleave(128, dim=1)
            out[e, :c] = (a64 @ dequantize_fp4(b[e], scale_b[e]).t()).float()
    return out


def gemm_fp4_grouped_ref(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    m_indices: torch.Tensor,
) -> torch.Tensor:
    """Grouped (MoE, contiguous layout) GEMM with FP4 weights in fp64, returned as fp32 (M, N):
    row r of a (M, K) float8_e4m3fn times scale_a (M, K/128) per 1x128 group, against expert
    e = m_indices[r] of b (E, N, K/2) packed e2m1 dequantized with scale_b (`dequantize_fp4`).
    Rows with a negative index (padding) are 0; an index >= E raises ValueError."""
    m = a.shape[0]
    experts, n, _ = b.shape
    idx = m_indices.long()
    if m and int(idx.max()) >= experts:
        raise ValueError(f"m_indices holds {int(idx.max())}, but b has {experts} experts")
    a64 = a.double() * scale_a.double().repeat_interleave(128, dim=1)
    out = torch.zeros(m, n, dtype=torch.float64, device=a.device)
    for e in range(experts):
        rows = (idx == e).nonzero().squeeze(1)
        if rows.numel():
            out[rows] = a64[rows] @ dequantize_fp4(b[e], scale_b[e]).t()
    return out.float()
