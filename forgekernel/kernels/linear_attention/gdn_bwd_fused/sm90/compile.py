"""Compile the Gated DeltaNet fused backward (reverse recurrence + chunk gradients) against
fake tensors: B, T, HV (and H when grouped), the chunk count and every outer stride dynamic;
K, V, the dtype, whether a final-state gradient is read and `grouped` baked in (`group_sum`:
dq, dk at the H heads). The 16-bit
tiles: unit last strides, the others multiples of 8 elements, 16-byte aligned (TMA); G, beta
fp32 (B, T, HV) unit last stride; dq, dk, dv 16-bit, dG, dbeta, dh0 fp32; the scale a runtime
fp32."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.fused_bwd import GdnBwdFusedSm90


def kernel_for(params: dict) -> GdnBwdFusedSm90:
    return GdnBwdFusedSm90(params["k"], params["v"], d_final_state=params["d_final_state"],
                           grouped=params.get("grouped", False),
                           u_from_h=params.get("u_from_h", False),
                           varlen=params.get("varlen", False),
                           group_sum=params.get("group_sum", False),
                           wg_split=params.get("wg_split", False),
                           w_from_t=params.get("w_from_t", False))  # fmt: skip


def compile_gdn_bwd_fused(params: dict, arch: str = "sm_90a", extra_options: str = "",
                          kernel=None):  # fmt: skip
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, hv, nc = (cute.sym_int32() for _ in range(4))
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel
    h = cute.sym_int32() if params.get("grouped", False) else hv
    # varlen: the states' N sequences, the token outputs' own T' rows, the slot tables (S,)
    varlen = params.get("varlen", False)
    n = cute.sym_int32() if varlen else b
    t_out = cute.sym_int32() if varlen else t
    qk_out = h if params.get("group_sum", False) else hv  # dq, dk's heads: summed at H
    w_from_t = params.get("w_from_t", False)  # W, the WY u formed in the kernel: not read

    def tok(d, heads=hv, rows=t):
        return fake.rowmajor(dtype, (b, rows, heads, d))

    def vec(rows=t):
        return fake.rowmajor(f32, (b, rows, hv), divisibility=1, align=4)

    def state():
        return fake.rowmajor(f32, (n, hv, kd, vd), divisibility=4)

    def table(size):
        return fake.rowmajor(cutlass.Int32, (size,), divisibility=1, align=4)

    tables = (fake.offsets(), table(n), table(nc), table(nc)) if varlen else (None,) * 4

    return cute.compile(
        kernel,
        tok(vd), None if params.get("u_from_h", False) else tok(vd), tok(kd, h), tok(kd, h),
        fake.rowmajor(dtype, (b, nc, hv, kd, vd)),
        vec(), tok(CHUNK), tok(CHUNK), *((None, None) if w_from_t else (tok(kd), tok(vd))),
        tok(vd), vec(),
        state() if params["d_final_state"] else None,
        tok(kd, qk_out, t_out), tok(kd, qk_out, t_out), vec(t_out), tok(vd, rows=t_out),
        vec(t_out),
        state(),
        *tables,
        f32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )  # fmt: skip
