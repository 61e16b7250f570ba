"""The FP4 kernel's tiled MMA (A from registers) traced on the host: each probed thread's A and
C fragment coordinates, collected at trace time (tests/test_gemm_fp4.py compares them with the
maps kernel.py's index arithmetic assumes). A module of its own: `cute.jit` needs the source."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import OperandMajorMode, warpgroup


def fragment_maps(tokens: int, threads: tuple[int, ...]) -> dict:
    found: dict = {}

    @cute.jit
    def probe():
        fp8 = cutlass.Float8E4M3FN
        k = OperandMajorMode.K
        mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k, k, cutlass.Float32, (2, 1, 1), (64, tokens),
            a_source=warpgroup.OperandSource.RMEM,
        )  # fmt: skip
        frag = mma.make_fragment_A(mma.get_slice(0).partition_shape_A((128, 128)))
        regs = cute.recast_tensor(frag, cutlass.Int32)
        found["regs"] = cute.size(regs)
        for t in threads:
            thr = mma.get_slice(t)
            a = thr.partition_A(cute.make_identity_tensor((128, 128)))
            c = thr.partition_C(cute.make_identity_tensor((128, tokens)))
            found[("a", t)] = [tuple(a[v]) for v in range(cute.size(a))]  # flat order
            found[("c", t)] = [tuple(c[v]) for v in range(cute.size(c))]

    probe()
    return found
