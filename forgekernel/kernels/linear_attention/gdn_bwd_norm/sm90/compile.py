"""Compile the Gated DeltaNet backward's q / k epilogue against fake tensors: B, T, H, HV and
every outer stride dynamic; K, the dtype and `l2norm` baked in; the scale a runtime fp32. The
fp32 (`d16`: 16-bit) gradients (B, T, HV, K) and the 16-bit x, dx (B, T, H, K): unit last
strides, the others 16-byte multiples, 16-byte aligned (the vector loads and stores)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.norm_bwd import GdnBwdNormSm90


def kernel_for(params: dict) -> GdnBwdNormSm90:
    return GdnBwdNormSm90(params["k"], l2norm=params["l2norm"])


def compile_gdn_bwd_norm(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    dtype = fake.dtype_of(params["dtype"])
    kd = params["k"]
    b, t, h, hv = (cute.sym_int32() for _ in range(4))
    kernel = kernel_for(params) if kernel is None else kernel
    d16 = params.get("d16", False)
    grads = (dtype, 8) if d16 else (cutlass.Float32, 4)  # 16-byte aligned rows
    return cute.compile(
        kernel,
        fake.rowmajor(grads[0], (b, t, hv, kd), divisibility=grads[1]),
        fake.rowmajor(dtype, (b, t, h, kd)),
        fake.rowmajor(dtype, (b, t, h, kd)),
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
