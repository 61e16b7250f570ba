"""Compile the block-scaled FP8 GEMM against fake tensors: M, N, K and every stride dynamic
(the scales' too: row- or column-major alike; A's with unit stride along M where the config
reads them M-major, `scale_mn_major`); stream-K configurations with the fp32
workspace and the int32 tile flags (as the dense GEMM's)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig
from forgekernel.runtime.pdl import built_on, trigger_of


def compile_gemm_fp8(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    """The FP8 GEMM of `params` (a compile key: out dtype and the GemmConfig fields)."""
    fp8 = cutlass.Float8E4M3FN
    m = cute.sym_int32()
    n = cute.sym_int32(divisibility=8)  # C's columns: N rounded up to 8 by the launcher
    k = cute.sym_int32(divisibility=128)
    a = fake.rowmajor(fp8, (m, k), divisibility=16)
    b = fake.rowmajor(fp8, (cute.sym_int32(), k), divisibility=16)  # B's rows: N itself
    c = fake.rowmajor(fake.dtype_of(params["out"]), (m, n))

    def scales():
        shape = (cute.sym_int32(), cute.sym_int32())
        stride = (cute.sym_int64(), cute.sym_int64())
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=4)

    def scales_mn_major():
        # `scale_mn_major`: A's (M, K/128) with unit stride along M, the K/128 stride a
        # multiple of 4 and the base 16-byte aligned (launch.py `mn_major_scales`)
        shape = (cute.sym_int32(), cute.sym_int32())
        stride = (1, cute.sym_int64(divisibility=4))
        return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=16)

    cfg = GemmConfig.from_params(
        {k_: v for k_, v in params.items() if k_ not in ("out", "grouped", "pdl")}
    )
    if cfg.stream_k:
        work = make_fake_tensor(cutlass.Float32, (cute.sym_int32(),), stride=(1,), assumed_align=16)
        flags = fake.offsets()
    else:
        work = flags = None
    return cute.compile(
        GemmSm90(cfg, pdl=built_on(params), trigger=trigger_of(params)),
        a,
        b,
        c,
        work,
        flags,
        cutlass.Int32(0),
        scales_mn_major() if cfg.scale_mn_major else scales(),
        scales(),
        make_fake_tensor(cutlass.Int32, (m,), stride=(1,)) if params.get("grouped") else None,
        cutlass.Int32(1),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
