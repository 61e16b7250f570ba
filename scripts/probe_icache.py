"""Does a long straight-line loop body starve one warp a scheduler of instructions on the H200?
The fused KDA design's stage 1 loop (docs/linear_attention/NOTES.md, "Stage 1 measured
2026-12-03 16:55") runs a 66 KB body with one warp a scheduler and measures ~2x what its SASS
schedule explains; instruction fetch is one candidate. This measures it alone.

One CTA an SM (`--ctas`, default 132) of `--threads` (default 128: one warp a scheduler, as the
loop). Each thread runs `--iters` passes of a body of N FFMA over 16 independent accumulators
(a stall of 1 cycle each in ptxas's schedule: the body's ideal is N cycles a pass) and records
clock64 around the passes. Printed per N (16 B of code an instruction: N = 4096 is 64 KB,
about the KDA loop's 66 KB): the median cycles an instruction over the CTAs. Flat near 1 up to
the largest N: fetch keeps up, and the KDA loop's missing half is elsewhere; rising past some N:
that N x 16 B is the instruction cache the scheduler streams from, and the loop's code size is
the lever.

    python scripts/probe_icache.py                  # N = 512 .. 8192
    python scripts/probe_icache.py --compile-only   # the CPU check: compiles for sm_90a
"""

import argparse

import cutlass
import cutlass.cute as cute
from cutlass import Float32, Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op

SIZES = (512, 1024, 2048, 3072, 4096, 6144, 8192)
CHAINS = 16  # independent FFMA chains: more than FFMA's latency, so each issues back to back


@dsl_user_op
def clock64(*, loc=None, ip=None) -> Int64:
    v = llvm.inline_asm(T.i64(), [], "mov.u64 $0, %clock64;", "=l", has_side_effects=True,
                        is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)  # fmt: skip
    return Int64(v)


def build(n: int, threads: int):
    """The probe class for a body of n FFMA (unrolled: n is baked into the code)."""

    class IcacheProbe:
        @cute.jit
        def __call__(self, out: cute.Tensor, acc: cute.Tensor, iters: Int32, b: Float32,
                     stream):  # fmt: skip
            self.kernel(out, acc, iters, b).launch(
                grid=[out.shape[0], 1, 1], block=[threads, 1, 1], stream=stream
            )

        @cute.kernel
        def kernel(self, out: cute.Tensor, acc: cute.Tensor, iters: Int32, b: Float32):
            tid, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            a = [Float32(tid + j) for j in range(CHAINS)]
            c0 = clock64()
            for _ in cutlass.range(iters, unroll=1):
                for i in cutlass.range_constexpr(n):
                    a[i % CHAINS] = a[i % CHAINS] * b + b
            c1 = clock64()
            s = a[0]
            for j in cutlass.range_constexpr(1, CHAINS):
                s = s + a[j]
            acc[bx * threads + tid] = s  # keeps the chains live
            if tid == 0:
                out[bx] = c1 - c0

    return IcacheProbe


def compile_probe(n: int, threads: int, arch: str = "sm_90a"):
    """TVM-FFI: called with a torch (ctas,) int64 tensor, a (ctas x threads,) fp32 tensor, iters,
    a multiplier."""
    from forgekernel.kernels.common.sm90 import fake

    out = fake.rowmajor(cutlass.Int64, (cute.sym_int32(),), divisibility=1, align=8)
    acc = fake.rowmajor(cutlass.Float32, (cute.sym_int32(),), divisibility=1, align=4)
    return cute.compile(build(n, threads)(), out, acc, Int32(1), Float32(1.0), fake.stream(),
                        options=fake.options(arch))  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--ctas", type=int, default=132, help="CTAs (one an SM)")
    parser.add_argument("--threads", type=int, default=128, help="threads a CTA")
    parser.add_argument("--iters", type=int, default=200, help="passes over the body")
    parser.add_argument("--sizes", type=int, nargs="+", default=list(SIZES), help="body FFMAs")
    parser.add_argument("--compile-only", action="store_true", help="compile, do not launch")
    args = parser.parse_args()
    probes = {n: compile_probe(n, args.threads) for n in args.sizes}
    if args.compile_only:
        print(f"compiled: bodies of {args.sizes} FFMA, {args.threads} threads")
        return 0
    import torch

    out = torch.zeros(args.ctas, dtype=torch.int64, device="cuda")
    acc = torch.zeros(args.ctas * args.threads, dtype=torch.float32, device="cuda")
    for n, probe in probes.items():
        probe(out, acc, 1, 0.999)  # warm-up (module load)
        probe(out, acc, args.iters, 0.999)
        torch.cuda.synchronize()
        cpi = (out.double() / (args.iters * n)).sort().values
        print(f"body {n:5d} FFMA ({n * 16 // 1024:4d} KB): cycles an instruction median "
              f"{cpi[len(cpi) // 2]:.2f} (min {cpi[0]:.2f}, max {cpi[-1]:.2f})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
