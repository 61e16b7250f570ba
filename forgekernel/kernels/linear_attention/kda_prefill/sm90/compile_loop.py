"""Compile stage 1 of the fused KDA design (`intra_loop.py`, the aux role as a chunk loop)
against fake tensors, as `compile.compile_kda_intra` does the first pass: q, k (T, H, K) in the
io dtype, g fp32 (T, HV, K), beta fp32 (T, HV), the token offsets (N + 1,) and each sequence's
first global chunk (N,) int32; outputs as `operands.py`. Opt-in: `compile.py` does not import
this file, so the kernels' ledgered sources (their import closure) do not change."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK


def compile_kda_intra_loop(params: dict, arch: str = "sm_90a", extra_options: str = "",
                           kernel=None):  # fmt: skip
    """kernel: a `KdaIntraLoopSm90` to compile (the tests read its shared_storage after the
    compile), or None for a fresh one."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra_loop import (
        KdaIntraLoopSm90,
    )

    io = fake.dtype_of(params["dtype"])
    op = cutlass.BFloat16
    kd = params["k"]
    t, h, hv, r, nc, n = (cute.sym_int32() for _ in range(6))
    f32 = cutlass.Float32
    if kernel is None:
        kernel = KdaIntraLoopSm90(kd)
    return cute.compile(
        kernel,
        fake.rowmajor(io, (t, h, kd)),
        fake.rowmajor(io, (t, h, kd)),
        fake.rowmajor(f32, (t, hv, kd), divisibility=4),
        make_fake_tensor(f32, (t, hv), stride=(cute.sym_int64(), 1), assumed_align=4),
        fake.offsets(),
        make_fake_tensor(cutlass.Int32, (n,), stride=(1,)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, kd)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(op, (r, hv, CHUNK)),
        fake.rowmajor(f32, (nc, hv, kd), divisibility=4),
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
