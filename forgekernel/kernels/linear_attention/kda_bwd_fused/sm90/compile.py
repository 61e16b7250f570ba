"""Compile Kimi Delta Attention's fused backward kernel (kernel 2 + the WY kernel) against fake
tensors: B, T, HV and every outer stride dynamic; K, V, the dtype and the key's flags baked in.
The two kernels' argument forms (their compile.py): 16-bit tiles with unit last strides, the
others multiples of 8 elements, 16-byte aligned (TMA); G, beta and the fp32 outputs unit last
strides; dq 16-bit with `dq16`, dv with `dv16`, the final dk with `dk16`."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.fused_grads import KdaBwdFusedSm90


def kernel_for(params: dict) -> KdaBwdFusedSm90:
    return KdaBwdFusedSm90(params["k"], params["v"], token_rows=params.get("token_rows", False))


def compile_kda_bwd_fused(params: dict, arch: str = "sm_90a", extra_options: str = "",
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

    def out(d, rows=t_out, low=False):
        if low:
            return fake.rowmajor(dtype, (b, rows, hv, d))
        return fake.rowmajor(f32, (b, rows, hv, d), divisibility=4)

    def vec(rows=t):
        return fake.rowmajor(f32, (b, rows, hv), divisibility=1, align=4)

    state = fake.rowmajor(dtype, (b, nc, hv, kd, vd))
    return cute.compile(
        kernel,
        tok(vd), tok(vd), tok(vd), tok(kd), tok(kd), state, state,
        out(kd, t),  # G (the first pass's, at the slots)
        tok(CHUNK), tok(kd), tok(vd), tok(vd), vec(),
        out(kd, low=params.get("dq16", False)), out(kd), out(kd),
        out(vd, low=params.get("dv16", False)), vec(t_out),
        out(kd, low=params.get("dk16", False)),  # the final dk (dk16), else unused
        *(tables if token_rows else (None, None)),
        f32(1.0),  # scale: dq16's (q unscaled)
        fake.stream(),
        options=fake.options(arch, extra_options),
    )  # fmt: skip
