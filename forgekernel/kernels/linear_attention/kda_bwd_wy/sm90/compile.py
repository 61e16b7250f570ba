"""Compile Kimi Delta Attention's backward WY kernel against fake tensors: B, T, HV, and every
outer stride dynamic; K, V and the dtype baked in. The 16-bit tiles: unit last strides, the
others multiples of 8 elements, 16-byte aligned (TMA); beta (B, T, HV), G and the fp32 outputs
unit last strides; dv 16-bit (as the tiles) with `dv16`; the final dk 16-bit with `dk16`."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.wy_grads import KdaBwdWySm90


def kernel_for(params: dict) -> KdaBwdWySm90:
    return KdaBwdWySm90(params["k"], params["v"], token_rows=params.get("token_rows", False))


def compile_kda_bwd_wy(params: dict, arch: str = "sm_90a", extra_options: str = "",
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

    # token_rows: the outputs at their own token count T' and the per-slot tables int32 (NC,)
    token_rows = params.get("token_rows", False)
    t_out = cute.sym_int32() if token_rows else t
    tables = (fake.rowmajor(cutlass.Int32, (nc,), divisibility=1, align=4),) * 2

    def out(d, rows=t_out):
        return fake.rowmajor(f32, (b, rows, hv, d), divisibility=4)

    def vec(rows=t):
        return fake.rowmajor(f32, (b, rows, hv), divisibility=1, align=4)

    return cute.compile(
        kernel,
        tok(kd), tok(vd), tok(CHUNK), tok(kd), tok(kd), tok(vd), tok(vd), vec(),
        out(kd, t),  # G (the first pass's, at the slots)
        out(kd),
        fake.rowmajor(dtype, (b, t_out, hv, vd)) if params.get("dv16") else out(vd),
        out(kd), vec(t_out),
        # the final dk (dk16), else unused
        fake.rowmajor(dtype, (b, t_out, hv, kd)) if params.get("dk16") else out(kd),
        *(tables if token_rows else (None, None)),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )  # fmt: skip
