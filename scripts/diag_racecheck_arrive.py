"""Does compute-sanitizer racecheck see the ordering of a named barrier's non-blocking arrive?

The MLA seesaw pass (seesaw.py) hands warpgroup 1's rescale factor of tile c to warpgroup 0
through shared memory: warpgroup 1 stores sScale[:, 1], `bar.arrive SCALE1, 256`; warpgroup 0
`bar.sync SCALE1, 256`, then loads it. PTX orders the store before the load (a bar.arrive
synchronizes with the bar.sync that completes the same barrier generation), yet racecheck
(H200, 2026-12-02) reports RAW hazards on exactly those bytes, and on no other hand-over of the
kernel: the hypothesis is that racecheck drops the release of an arrive that does not complete
the barrier (warpgroup 1 arrives while warpgroup 0 is still in its P V WGMMA).

This kernel isolates the pattern, one CTA of 256 threads: warpgroup 1 (threads 128..255)
stores 128 floats, warpgroup 0 (threads 0..127) loads them after the hand-over and writes them
out. `spin` busy-waits about 2 ms (an FMA chain) to fix who reaches the barrier first:

    early  1 stores, arrives (bar.arrive); 0 spins, then bar.sync, loads  (the seesaw's case)
    late   0 bar.sync at once; 1 spins, stores, arrives                    (1 completes it)
    sync   1 stores, bar.sync; 0 spins, bar.sync, loads                    (both wait)
    none   1 stores; 0 spins, loads, no barrier at all                     (a real race)

Run each variant under the tool (one launch each; the summary's count is the answer):

    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python3 scripts/diag_racecheck_arrive.py VARIANT

Expected if the hypothesis holds: early > 0 hazards (RAW), late 0, sync 0, none > 0; every
variant prints "values ok" (the hardware ordered the stores in all but `none`, where the spin
makes the race benign). If `early` reports 0, the hypothesis is wrong and the seesaw hazard
needs another explanation (do not take the mla_decode suite's Explained entry then)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402

from forgekernel.kernels.common.sm90 import fake  # noqa: E402
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier  # noqa: E402

THREADS = 256
HALF = 128
VARIANTS = ("early", "late", "sync", "none")
HANDOVER = FIRST_FREE + 1  # id 2, SCALE1's in the seesaw pass


class ArriveProbe:
    """One CTA: warpgroup 1 stores, warpgroup 0 loads after the variant's hand-over."""

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant

    @cute.jit
    def __call__(self, out: cute.Tensor, spin: Int32, stream):
        @cute.struct
        class Shared:
            buf: cute.struct.MemRange[Float32, HALF]

        self.shared = Shared
        self.kernel(out, spin).launch(grid=(1, 1, 1), block=[THREADS, 1, 1], stream=stream)

    @cute.jit
    def _spin(self, spin: Int32, seed: Float32) -> Float32:
        """About 4 x spin cycles of dependent FMAs; the result is stored (kept alive)."""
        x = seed
        for _ in cutlass.range(spin, unroll=1):
            x = x * Float32(0.999999) + Float32(1e-6)
        return x

    @cute.kernel
    def kernel(self, out: cute.Tensor, spin: Int32):
        tidx, _, _ = cute.arch.thread_idx()
        storage = cutlass.utils.SmemAllocator().allocate(self.shared)
        buf = storage.buf.get_tensor(cute.make_layout(HALF))
        bar = named_barrier(HANDOVER, THREADS)
        v = self.variant
        burn = Float32(0.0)
        if tidx >= HALF:  # warpgroup 1: the producer
            if const_expr(v == "late"):
                burn = self._spin(spin, Float32(tidx))
            buf[tidx - HALF] = Float32(tidx) + Float32(0.5)
            if const_expr(v in ("early", "late")):
                bar.arrive()
            if const_expr(v == "sync"):
                bar.arrive_and_wait()
            out[1, tidx] = burn
        else:  # warpgroup 0: the consumer
            if const_expr(v != "late"):
                burn = self._spin(spin, Float32(tidx))
            if const_expr(v != "none"):
                bar.arrive_and_wait()
            out[0, tidx] = buf[tidx]
            out[1, tidx] = burn
        cute.arch.sync_threads()  # (no warp exits before the other's hand-over, as in the pass)


def compile_probe(variant: str, arch: str = "sm_90a"):
    """The probe compiled for `arch` (TVM-FFI: called with a torch (2, 256) fp32 tensor)."""
    rows = cute.sym_int32()
    out = fake.rowmajor(Float32, (rows, THREADS), divisibility=1, align=4)
    return cute.compile(
        ArriveProbe(variant), out, Int32(1), fake.stream(), options=fake.options(arch)
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("variant", choices=VARIANTS)
    parser.add_argument("--spin", type=int, default=500_000, help="FMA iterations of the wait")
    args = parser.parse_args()
    import torch

    probe = compile_probe(args.variant)
    out = torch.full((2, THREADS), float("nan"), device="cuda")
    probe(out, args.spin)
    torch.cuda.synchronize()
    want = torch.arange(HALF, THREADS, device="cuda", dtype=torch.float32) + 0.5
    ok = torch.equal(out[0, :HALF], want)
    print(f"diag_racecheck_arrive {args.variant}: values {'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
