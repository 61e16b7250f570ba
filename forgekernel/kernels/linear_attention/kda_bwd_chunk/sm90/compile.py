"""Compile Kimi Delta Attention's backward kernel 2 against fake tensors: B, T, HV, the chunk
count and every outer stride dynamic; K, V and the dtype baked in. The 16-bit tiles: unit last
strides, the others multiples of 8 elements, 16-byte aligned (TMA); G and the fp32 outputs
(B, T, HV, K) unit last strides, the others multiples of 4 elements (dw16 / dq16: dw / dq as
the tiles); the scale a runtime fp32."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import KdaBwdChunkSm90


def kernel_for(params: dict) -> KdaBwdChunkSm90:
    return KdaBwdChunkSm90(params["k"], params["v"], token_rows=params.get("token_rows", False))


def compile_kda_bwd_chunk(params: dict, arch: str = "sm_90a", extra_options: str = "",
                          kernel=None):  # fmt: skip
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, hv, nc = (cute.sym_int32() for _ in range(4))
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel

    def tok(d):
        return fake.rowmajor(dtype, (b, t, hv, d))

    # token_rows: dq, dk, dG at their own token count T' and the per-slot tables int32 (NC,)
    token_rows = params.get("token_rows", False)
    t_out = cute.sym_int32() if token_rows else t
    tables = (fake.rowmajor(cutlass.Int32, (nc,), divisibility=1, align=4),) * 2

    def out(d, rows=t):
        return fake.rowmajor(f32, (b, rows, hv, d), divisibility=4)

    return cute.compile(
        kernel,
        tok(vd), tok(vd), tok(vd), tok(kd), tok(kd),
        fake.rowmajor(dtype, (b, nc, hv, kd, vd)),
        fake.rowmajor(dtype, (b, nc, hv, kd, vd)),
        out(kd),  # G
        fake.rowmajor(dtype, (b, t_out, hv, kd)) if params.get("dq16") else out(kd, t_out),
        out(kd, t_out),
        tok(kd) if params.get("dw16") else out(kd), out(kd, t_out),
        *(tables if token_rows else (None, None)),
        f32(1.0),  # scale: dq16's (q unscaled)
        fake.stream(),
        options=fake.options(arch, extra_options),
    )  # fmt: skip
