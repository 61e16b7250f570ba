"""Compile the KDA recurrence pass against fake tensors: T, R (padded rows), NC, HV, N and
every outer stride dynamic; K, V, the v / o dtype and the initial state baked in; the chunk
operands bf16. 16-bit tensors: unit last strides, outer strides multiples of 8 elements,
16-byte aligned (TMA boxes, 16-byte O stores); D fp32 with unit last stride, 16-byte rows."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.kda_prefill.sm90.recurrence import KdaRecurrenceSm90


def kernel_for(params: dict) -> KdaRecurrenceSm90:
    return KdaRecurrenceSm90(params["k"], params["v"], initial_state=params["initial_state"],
                             value_split=params["value_split"],
                             warmup=params.get("warmup", False))  # fmt: skip


def compile_kda_recurrence(params: dict, arch: str = "sm_90a", extra_options: str = "",
                           kernel=None):  # fmt: skip
    """kernel: a `kernel_for(params)` object to compile (the tests read its shared_storage
    after the compile), or None for a fresh one."""
    io = fake.dtype_of(params["dtype"])
    op = cutlass.BFloat16
    kd, vd = params["k"], params["v"]
    t, r, nc, hv, n = (cute.sym_int32() for _ in range(5))
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel
    return cute.compile(
        kernel,
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(f32, (nc, hv, kd), divisibility=4),
        fake.rowmajor(io, (t, hv, vd)),
        fake.rowmajor(f32, (n, hv, kd, vd), divisibility=4) if params["initial_state"] else None,
        fake.offsets(),
        fake.offsets(),
        fake.rowmajor(io, (t, hv, vd)),
        fake.rowmajor(f32, (n, hv, kd, vd), divisibility=4),
        fake.offsets() if params.get("warmup", False) else None,
        fake.stream(),
        options=fake.options(arch, extra_options),
    )


def compile_kda_intra(params: dict, arch: str = "sm_90a", extra_options: str = "",
                      kernel=None):  # fmt: skip
    """The first pass (`intra.py`): q, k (T, H, K) in the io dtype, g fp32 (T, HV, K), beta fp32
    (T, HV), per-chunk first tokens and lengths (NC,) int32; outputs as `operands.py` (with
    `bwd` in the key also tt bf16 (R, HV, 64) and big_g fp32 (R, HV, K), the input v (T, HV, V =
    K) in the io dtype and W, u bf16 (R, HV, K)). kernel: a
    `KdaIntraSm90` to compile (the tests read its shared_storage after the compile), or None for
    a fresh one."""
    from cutlass.cute.runtime import make_fake_tensor

    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra import KdaIntraSm90

    io = fake.dtype_of(params["dtype"])
    op = cutlass.BFloat16
    kd = params["k"]
    bwd = params.get("bwd", False)
    t, h, hv, r, nc = (cute.sym_int32() for _ in range(5))
    f32 = cutlass.Float32
    if kernel is None:
        kernel = KdaIntraSm90(kd, bwd=bwd)

    def per_chunk():
        return make_fake_tensor(cutlass.Int32, (nc,), stride=(1,))

    return cute.compile(
        kernel,
        fake.rowmajor(io, (t, h, kd)),
        fake.rowmajor(io, (t, h, kd)),
        fake.rowmajor(f32, (t, hv, kd), divisibility=4),
        make_fake_tensor(f32, (t, hv), stride=(cute.sym_int64(), 1), assumed_align=4),
        per_chunk(),
        per_chunk(),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(f32, (nc, hv, kd), divisibility=4),
        fake.rowmajor(op, (r, hv, CHUNK)) if bwd else None,
        fake.rowmajor(f32, (r, hv, kd), divisibility=4) if bwd else None,
        fake.rowmajor(io, (t, hv, kd)) if bwd else None,
        fake.rowmajor(op, (r, hv, kd)) if bwd else None,
        fake.rowmajor(op, (r, hv, kd)) if bwd else None,
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
