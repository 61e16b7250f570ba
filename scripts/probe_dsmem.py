"""Stage 0 of the fused KDA design (docs/linear_attention/NOTES.md, "A fused KDA forward:
design", section 5): can 64 2-CTA clusters of the fused kernel's shape (~225 KB of shared memory,
384 threads a CTA) be resident at once, and how fast do the CTAs of a pair write into each
other's shared memory?

One launch of `--clusters` clusters of (2, 1, 1) CTAs, each with `--smem` bytes of shared
memory. Every CTA records its SM, its globaltimer at start and end and its cycles (clock64) for
`--iters` rounds of writing `--copy` bytes into the peer's shared memory (mapa +
st.shared::cluster.v4, 16 B a thread a store, both CTAs of a pair at once: each direction
loaded), closed by a cluster barrier (release / acquire: the stores landed). A CTA also spins
`--spin-us` after its copies so that the residency count sees every co-resident cluster.

Printed: the clusters resident at once (the largest overlap of their [start, end] intervals;
kill criterion: < 64 at 4 x 8192), the distinct SMs, and the DSMEM bytes a cycle a CTA each way
(min / median / max over the CTAs; kill criterion: < ~8 B a cycle sustained). The design's
other copy form (cp.async.bulk shared::cluster, one elected thread) is not probed here.

    python scripts/probe_dsmem.py                      # 132 clusters, 225,792 B, 384 threads
    python scripts/probe_dsmem.py --clusters 64 --copy 66048
    python scripts/probe_dsmem.py --compile-only       # the CPU check: compiles for sm_90a
"""

# no `from __future__ import annotations`: the kernel's shared-memory struct is built in a
# closure (its size a CLI argument), and string annotations would not see the closure's names
import argparse

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64
from cutlass._mlir.dialects import llvm
from cutlass.cutlass_dsl import T, dsl_user_op
from cutlass.memory import SmemAllocator

FUSED_SMEM = 225_792  # the design's shared memory total (section 2)
THREADS = 384  # form A: producer, aux, state warpgroups
RING_BYTES = 66_048  # ring A + ring B one stage (Kg, Qg, Kd, Tb, P, e^G_C): a chunk's DSMEM copy


def build(smem: int, threads: int, copy: int):
    """The probe kernel class for a static shape (its shared memory and stores are baked in)."""
    if copy % (16 * threads) or copy > smem - 1024:
        raise ValueError(f"--copy must be a multiple of 16 x {threads} B and fit in --smem")
    words = (smem - 1024) // 4  # the DSL's static and alignment slack kept out
    per_thread = copy // (16 * threads)

    @dsl_user_op
    def store_peer_v4(addr, rank, v, *, loc=None, ip=None) -> None:
        llvm.inline_asm(
            None,
            [Int32(addr).ir_value(loc=loc, ip=ip), Int32(rank).ir_value(loc=loc, ip=ip),
             Int32(v).ir_value(loc=loc, ip=ip)],
            "{\n .reg .b32 p;\n mapa.shared::cluster.u32 p, $0, $1;\n"
            " st.shared::cluster.v4.u32 [p], {$2, $2, $2, $2};\n}",
            "r,r,r",
            has_side_effects=True,
            is_align_stack=False,
            asm_dialect=llvm.AsmDialect.AD_ATT,
        )  # fmt: skip

    def _reg64(ptx: str, loc=None, ip=None) -> Int64:
        v = llvm.inline_asm(T.i64(), [], ptx, "=l", has_side_effects=True,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)  # fmt: skip
        return Int64(v)

    @dsl_user_op
    def globaltimer(*, loc=None, ip=None) -> Int64:
        return _reg64("mov.u64 $0, %globaltimer;", loc, ip)

    @dsl_user_op
    def clock64(*, loc=None, ip=None) -> Int64:
        return _reg64("mov.u64 $0, %clock64;", loc, ip)

    @dsl_user_op
    def smid(*, loc=None, ip=None) -> Int32:
        v = llvm.inline_asm(T.i32(), [], "mov.u32 $0, %smid;", "=r", has_side_effects=True,
                            is_align_stack=False, asm_dialect=llvm.AsmDialect.AD_ATT)  # fmt: skip
        return Int32(v)

    class DsmemProbe:
        @cute.jit
        def __call__(self, out: cute.Tensor, iters: Int32, spin_ns: Int32, stream):
            @cute.struct
            class Shared:
                buf: cute.struct.Align[cute.struct.MemRange[Int32, words], 128]

            self.shared = Shared
            self.kernel(out, iters, spin_ns).launch(
                grid=[out.shape[0], 1, 1], block=[threads, 1, 1], cluster=[2, 1, 1],
                stream=stream,
            )  # fmt: skip

        @cute.kernel
        def kernel(self, out: cute.Tensor, iters: Int32, spin_ns: Int32):
            tid, _, _ = cute.arch.thread_idx()
            bx, _, _ = cute.arch.block_idx()
            storage = SmemAllocator().allocate(self.shared)
            buf = storage.buf.get_tensor(cute.make_layout(words))
            rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
            t0 = globaltimer()
            cute.arch.cluster_arrive()
            cute.arch.cluster_wait()  # both CTAs of the pair running: the copies may start
            c0 = clock64()
            base = buf.iterator.toint() + 16 * tid
            for it in cutlass.range(iters, unroll=1):
                for u in cutlass.range_constexpr(per_thread):
                    store_peer_v4(base + 16 * threads * u, 1 - rank, it + u)
            cute.arch.cluster_arrive()  # release: the peer's acquire sees every store
            cute.arch.cluster_wait()
            c1 = clock64()
            while globaltimer() - t0 < Int64(spin_ns):
                pass
            t1 = globaltimer()
            if tid == 0:
                out[bx, 0] = Int64(smid())
                out[bx, 1] = t0
                out[bx, 2] = t1
                out[bx, 3] = c1 - c0

    return DsmemProbe


def compile_probe(smem: int, threads: int, copy: int, arch: str = "sm_90a"):
    """The probe compiled for `arch` (TVM-FFI: called with a torch (2 clusters, 4) int64
    tensor, iters, spin in ns)."""
    from forgekernel.kernels.common.sm90 import fake

    out = fake.rowmajor(cutlass.Int64, (cute.sym_int32(), 4), divisibility=1, align=8)
    probe = build(smem, threads, copy)()
    return cute.compile(probe, out, cutlass.Int32(1), cutlass.Int32(0), fake.stream(),
                        options=fake.options(arch))  # fmt: skip


def max_overlap(starts, ends) -> int:
    """The most intervals [start, end) open at one instant."""
    events = sorted([(s, 1) for s in starts] + [(e, -1) for e in ends])
    best = cur = 0
    for _, d in events:
        cur += d
        best = max(best, cur)
    return best


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--clusters", type=int, default=132, help="2-CTA clusters launched")
    parser.add_argument("--smem", type=int, default=FUSED_SMEM, help="shared memory a CTA (B)")
    parser.add_argument("--threads", type=int, default=THREADS, help="threads a CTA")
    parser.add_argument("--copy", type=int, default=RING_BYTES - RING_BYTES % (16 * THREADS),
                        help="bytes a CTA writes into its peer a round")  # fmt: skip
    parser.add_argument("--iters", type=int, default=200, help="rounds of copies")
    parser.add_argument("--spin-us", type=int, default=200, help="hold after the copies (us)")
    parser.add_argument("--compile-only", action="store_true", help="compile, do not launch")
    args = parser.parse_args()
    probe = compile_probe(args.smem, args.threads, args.copy)
    if args.compile_only:
        print(f"compiled: {args.smem} B, {args.threads} threads, {args.copy} B a round")
        return 0
    import torch

    out = torch.zeros((2 * args.clusters, 4), dtype=torch.int64, device="cuda")
    probe(out, 1, 0)  # warm-up (module load)
    torch.cuda.synchronize()
    out.zero_()
    probe(out, args.iters, args.spin_us * 1000)
    torch.cuda.synchronize()
    o = out.cpu()
    cl = o.view(args.clusters, 2, 4)
    starts = cl[:, :, 1].min(dim=1).values.tolist()
    ends = cl[:, :, 2].max(dim=1).values.tolist()
    resident = max_overlap(starts, ends)
    sms = len(set(o[:, 0].tolist()))
    rate = (args.copy * args.iters / o[:, 3].double()).sort().values
    print(f"clusters launched {args.clusters}, resident at once {resident}, SMs used {sms}")
    print(
        f"DSMEM B/cycle a CTA each way: min {rate[0]:.2f} median "
        f"{rate[len(rate) // 2]:.2f} max {rate[-1]:.2f} ({args.copy} B x {args.iters})"
    )
    print(
        f"verdict: residency {'ok' if resident >= 64 else 'KILL (< 64)'}, bandwidth "
        f"{'ok' if rate[len(rate) // 2] >= 8 else 'KILL (< 8 B/cycle)'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
