"""Compile the Gated DeltaNet backward's kernel 0 (the chunk factors) against fake tensors: B,
T, H, HV, the chunk count and every outer stride dynamic; K, V and the dtype baked in. q, k, v
16-bit with unit last strides, the others multiples of 8 elements, 16-byte aligned (TMA), as
are the 16-bit output tiles (B, NC C, HV, D); g, beta fp32 (B, T, HV) and the fp32 outputs
e^(G_C) (B, NC, HV), G (B, NC C, HV) unit last strides."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.config import (
    CHUNK,
    OUT_TILES,
    out_tiles,
)
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.factors import GdnBwdFactorsSm90


def kernel_for(params: dict) -> GdnBwdFactorsSm90:
    return GdnBwdFactorsSm90(params["k"], params["v"], params.get("fused", False),
                             params.get("w_from_t", False))  # fmt: skip


def compile_gdn_bwd_factors(params: dict, arch: str = "sm_90a", extra_options: str = "",
                            kernel=None):  # fmt: skip
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, h, hv, rows, nc = (cute.sym_int32() for _ in range(6))
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel
    width = {"w": kd, "u": vd, "pt": CHUNK, "ke": kd, "qe": kd, "tt": CHUNK}
    written = out_tiles(params.get("fused", False), params.get("w_from_t", False))
    outs = [fake.rowmajor(dtype, (b, rows, hv, width[n])) if n in written else None
            for n in OUT_TILES]  # fmt: skip
    return cute.compile(
        kernel,
        fake.rowmajor(dtype, (b, t, h, kd)),
        fake.rowmajor(dtype, (b, t, h, kd)),
        fake.rowmajor(dtype, (b, t, hv, vd)),
        fake.rowmajor(f32, (b, t, hv), divisibility=1, align=4),
        fake.rowmajor(f32, (b, t, hv), divisibility=1, align=4),
        *outs,
        fake.rowmajor(f32, (b, nc, hv), divisibility=1, align=4),
        fake.rowmajor(f32, (b, rows, hv), divisibility=1, align=4),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
