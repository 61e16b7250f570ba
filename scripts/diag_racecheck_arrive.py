"""Which rule does compute-sanitizer racecheck apply to named barriers? (the MLA seesaw's report)

The seesaw pass (seesaw.py) hands shared-memory rows from one warpgroup to the other through
named barriers: a store, `bar.arrive ID, 256`; the other side `bar.sync ID, 256`, then the load.
Racecheck (H200, 2026-12-02) reported RAW hazards on two of those hand-overs, in the CTAs whose
last tile reaches past the sequence and only there (SASS offsets mapped in
docs/attention/MLA_NOTES.md): sScale[:, 1] (warpgroup 1 stores, SCALE1 = id 2, warpgroup 0
loads) when the tile count is even, sM (warpgroup 0 stores, SCALE0 = id 1, warpgroup 1 loads)
when it is odd. Those are the CTAs where the storing warpgroup first zeroed the tile's stale rows
and passed a barrier of its own (`_zero_stale`: bar.sync WG0 = 5 / WG1 = 6, 128 threads).

1. Does a non-completing bar.arrive lose its release? No: `early` reported 0 hazards on the
   H200 (2026-12-02 04:10; late 0, sync 0, none 512), so racecheck follows bar.arrive -> bar.sync.
2. The hypothesis now (the barrier-interval rule, tests/mla_seesaw.py `_interval_hazard`):
   racecheck orders two accesses of different threads by how many barriers each thread has
   passed, not by which barrier instance they met at. A private barrier puts the storing
   warpgroup one interval ahead, so the load after the hand-over looks unordered. In `early`
   both sides pass the same number of barriers: clean.

3. The H200's verdicts (2026-12-02 06:40): private 512, balanced 0, even 256, even-full 256,
   odd 512, odd-full 256. The -full twins refute rule 2 as first written (arrives counted);
   every verdict fits it when only a thread's bar.sync waits count (bar.arrive none) and bar 0
   (__syncthreads) separates epochs: the replicas then flag sScale[:, 1] (even, even-full,
   odd-full: 64 rows x 4 bytes = 256) and sM + sScale[:, 0] (odd: 512). The kernel's answer
   (seesaw.py `_own_barrier`) and the model (tests/mla_seesaw.py `_interval_hazard`) follow it.

Variants (one CTA of 256 threads; warpgroup 1 = threads 128..255 stores, warpgroup 0 loads
after the hand-over and writes what it read out; `spin` busy-waits about 2 ms (an FMA chain) to
fix who reaches a barrier first):

    early     1 stores, arrives (bar.arrive 2); 0 spins, bar.sync 2, loads     (H200: 0)
    late      0 bar.sync 2 at once; 1 spins, stores, arrives                  (H200: 0)
    sync      1 stores, bar.sync 2; 0 spins, bar.sync 2, loads                (H200: 0)
    none      1 stores; 0 spins, loads, no barrier at all                     (H200: 512)
    private   `early`, warpgroup 1 first passing bar.sync 6, 128 alone        (rule: 512)
    balanced  `private`, warpgroup 0 also passing bar.sync 5, 128 alone       (rule: 0)
    even      one seesaw CTA of 2 tiles, the last partial: both warpgroups' barriers (ids,
              counts, order) and plain sM / sScale / sTotal stores and loads exactly as the
              kernel issues them (their thread -> row map included), spins where it waits
              for WGMMAs                                  (rule: sScale[:, 1], sTotal[:, 1] RAW)
    even-full the same CTA with a whole last tile (no private barrier)        (rule: 0)
    odd       one tile, partial                 (rule: sM RAW, WAR, WAW; sTotal[:, 0] RAW)
    odd-full  one whole tile                                                  (rule: 0)

The replicas' tables are the projection of the CPU model's schedule (tests/test_mla_seesaw.py
checks that they are, and what the interval rule flags in them). Run each variant under the tool
(one launch each; the summary's count is the answer; `--racecheck-report analysis` groups the
hazards by instruction pair):

    compute-sanitizer --tool racecheck --racecheck-report hazard \\
        python3 scripts/diag_racecheck_arrive.py VARIANT

Reading: private > 0 and balanced 0 (and even / odd > 0, their -full twins 0): the interval rule
holds, the seesaw's reports are its artifact (the suite may carry an Explained entry, or the
kernel may balance the barrier counts). private 0 but even / odd > 0: something else in the
sequence (compare the flagged buffers with the rule's). All 0: the tool sees more in the kernel
than its barriers and plain accesses (look again at the kernel). Every variant prints "values
ok" when warpgroup 0 read what the barriers promise (in `none` the spin makes the race benign)."""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

import cutlass  # noqa: E402
import cutlass.cute as cute  # noqa: E402
from cutlass import Float32, Int32, const_expr  # noqa: E402

from forgekernel.kernels.attention.mla.sm90.seesaw import Bar  # noqa: E402
from forgekernel.kernels.common.sm90 import fake  # noqa: E402
from forgekernel.kernels.common.sm90.barriers import named_barrier  # noqa: E402

THREADS = 256
HALF = 128
ROWS = 64
HANDOVER = Bar.SCALE1  # id 2
SIMPLE = ("early", "late", "sync", "none", "private", "balanced")

# The seesaw replicas: per warpgroup, the kernel's named-barrier steps ("sync" = bar.sync /
# arrive_and_wait, "arrive" = bar.arrive; ALL = bar.sync 0, __syncthreads) and its plain
# shared-memory accesses of sM (M), sScale[:, i] (SCALEi) and sTotal[:, i] (TOTALi), with a spin
# where the warpgroup waits for its WGMMAs; prologue (sM's -inf, Q, bar 0, S), pairs, epilogue.
_PRO0 = [("write", "M"), ("sync", "ALL"), ("spin",)]
_END = [("sync", "ALL"), ("read", "M"), ("read", "TOTAL0"), ("read", "TOTAL1")]
_SOFTMAX0 = [("read", "M"), ("write", "M"), ("write", "SCALE0"), ("arrive", "SCALE0")]
_SOFTMAX1 = [("sync", "SCALE0"), ("read", "M"), ("write", "M"), ("write", "SCALE1")]
_SOFTMAX1 += [("arrive", "SCALE1"), ("read", "SCALE0")]
_HANDS0 = [("spin",), ("sync", "SCALE1"), ("read", "SCALE1"), ("arrive", "P0")]


def _even(stale: bool) -> tuple[list, list]:
    wg0 = _PRO0 + _SOFTMAX0 + _HANDS0 + [("sync", "P1"), ("spin",), ("write", "TOTAL0")]
    wg1 = [("sync", "ALL"), ("spin",)] + ([("sync", "WG1")] if stale else []) + _SOFTMAX1
    wg1 += [("sync", "P0"), ("arrive", "P1"), ("spin",), ("write", "TOTAL1")]
    return wg0 + _END, wg1 + _END


def _odd(stale: bool) -> tuple[list, list]:
    wg0 = _PRO0 + ([("sync", "WG0")] if stale else []) + _SOFTMAX0 + _HANDS0
    wg0 += [("spin",), ("write", "TOTAL0")]
    wg1 = [("sync", "ALL")] + _SOFTMAX1 + [("sync", "P0"), ("spin",), ("write", "TOTAL1")]
    return wg0 + _END, wg1 + _END


TABLES = {
    "even": _even(True),
    "even-full": _even(False),
    "odd": _odd(True),
    "odd-full": _odd(False),
}
VARIANTS = SIMPLE + tuple(TABLES)
BARRIERS = {  # name -> (id, threads): the kernel's own
    "SCALE0": (Bar.SCALE0, THREADS),
    "SCALE1": (Bar.SCALE1, THREADS),
    "P0": (Bar.P0, THREADS),
    "P1": (Bar.P1, THREADS),
    "WG0": (Bar.WG0, HALF),
    "WG1": (Bar.WG1, HALF),
}
BUFFERS = ("M", "SCALE0", "SCALE1", "TOTAL0", "TOTAL1")  # the kernel's order in shared memory


def row_of(tid: int, r: int) -> int:
    """The row a thread of a warpgroup holds in its r-th register row (the WGMMA accumulator's
    map: warp w rows 16 w .. 16 w + 15, a quad per row, rows r and r + 8)."""
    return 16 * (tid // 32) + (tid % 32) // 4 + 8 * r


def value_of(wg: int, buf: str, row: int) -> float:
    return float(1000 * wg + 100 * BUFFERS.index(buf) + row + 1)


def expected_sums(progs) -> list[float]:
    """What each thread of the CTA adds up over its loads: the tables replayed one step at a
    time (a sync waits for the other warpgroup's arrival of the same generation; the private
    ones and ALL as the kernel has them); stores by quad leaders, loads by every thread."""
    mem: dict[tuple[str, int], float] = {}
    sums = [0.0] * THREADS
    uses = [defaultdict(int), defaultdict(int)]
    arrived = [False, False]
    pcs = [0, 0]
    while pcs[0] < len(progs[0]) or pcs[1] < len(progs[1]):
        moved = False
        for wg in (0, 1):
            while pcs[wg] < len(progs[wg]):
                op = progs[wg][pcs[wg]]
                if op[0] in ("sync", "arrive"):
                    if not arrived[wg]:
                        uses[wg][op[1]] += 1
                        arrived[wg] = True
                    shared = op[1] not in ("WG0", "WG1")
                    if op[0] == "sync" and shared and uses[1 - wg][op[1]] < uses[wg][op[1]]:
                        break
                    arrived[wg] = False
                for tid in range(HALF) if op[0] in ("read", "write") else ():
                    for r in (0, 1):
                        key = (op[1], row_of(tid, r))
                        if op[0] == "write" and tid % 4 == 0:
                            mem[key] = value_of(wg, op[1], key[1])
                        if op[0] == "read":
                            sums[wg * HALF + tid] += mem[key]
                pcs[wg] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"the tables deadlock at {pcs}")
    return sums


class ArriveProbe:
    """One CTA: warpgroup 1 stores, warpgroup 0 loads after the variant's hand-over (SIMPLE),
    or both run a seesaw replica (TABLES)."""

    def __init__(self, variant: str):
        if variant not in VARIANTS:
            raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
        self.variant = variant

    @cute.jit
    def __call__(self, out: cute.Tensor, spin: Int32, stream):
        @cute.struct
        class Shared:
            buf: cute.struct.MemRange[Float32, HALF]
            rows: cute.struct.MemRange[Float32, ROWS * len(BUFFERS)]

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
        if const_expr(self.variant in SIMPLE):
            self._simple(out, spin, storage.buf.get_tensor(cute.make_layout(HALF)), tidx)
        else:
            rows = storage.rows.get_tensor(cute.make_layout(ROWS * len(BUFFERS)))
            progs = TABLES[self.variant]
            if tidx < HALF:
                self._replica(out, spin, rows, progs[0], 0, tidx)
            else:
                self._replica(out, spin, rows, progs[1], 1, tidx)

    @cute.jit
    def _simple(self, out: cute.Tensor, spin: Int32, buf: cute.Tensor, tidx):
        bar = named_barrier(HANDOVER, THREADS)
        v = self.variant
        burn = Float32(0.0)
        if tidx >= HALF:  # warpgroup 1: the producer
            if const_expr(v in ("private", "balanced")):  # the seesaw's `_zero_stale` barrier
                named_barrier(Bar.WG1, HALF).arrive_and_wait()
            if const_expr(v == "late"):
                burn = self._spin(spin, Float32(tidx))
            buf[tidx - HALF] = Float32(tidx) + Float32(0.5)
            if const_expr(v in ("early", "late", "private", "balanced")):
                bar.arrive()
            if const_expr(v == "sync"):
                bar.arrive_and_wait()
            out[1, tidx] = burn
        else:  # warpgroup 0: the consumer
            if const_expr(v == "balanced"):
                named_barrier(Bar.WG0, HALF).arrive_and_wait()
            if const_expr(v != "late"):
                burn = self._spin(spin, Float32(tidx))
            if const_expr(v != "none"):
                bar.arrive_and_wait()
            out[0, tidx] = buf[tidx]
            out[1, tidx] = burn
        cute.arch.sync_threads()  # (no warp exits before the other's hand-over, as in the pass)

    @cute.jit
    def _replica(
        self, out: cute.Tensor, spin: Int32, rows: cute.Tensor, prog, wg: cutlass.Constexpr, tidx
    ):
        """One warpgroup's table, unrolled at trace time."""
        tid = tidx % HALF
        acc = Float32(0.0)
        burn = Float32(0.0)
        row = [16 * (tid // 32) + (tid % 32) // 4 + 8 * r for r in range(2)]  # row_of
        for i in cutlass.range_constexpr(len(prog)):
            op = prog[i]
            if const_expr(op[0] == "spin"):
                burn = burn + self._spin(spin, Float32(tidx))
            elif const_expr(op[0] in ("sync", "arrive") and op[1] == "ALL"):
                cute.arch.sync_threads()
            elif const_expr(op[0] == "sync"):
                named_barrier(*BARRIERS[op[1]]).arrive_and_wait()
            elif const_expr(op[0] == "arrive"):
                named_barrier(*BARRIERS[op[1]]).arrive()
            else:
                base = ROWS * BUFFERS.index(op[1])
                if const_expr(op[0] == "write"):
                    cute.arch.sync_warp()  # (the kernel's: the quad's loads, then its leader's)
                    if tid % 4 == 0:  # value_of(wg, buffer, row)
                        for r in cutlass.range_constexpr(2):
                            rows[base + row[r]] = Float32(1000 * wg + 100 * BUFFERS.index(op[1]))
                            rows[base + row[r]] += Float32(row[r] + 1)
                else:
                    for r in cutlass.range_constexpr(2):
                        acc = acc + rows[base + row[r]]
        out[0, tidx] = acc
        out[1, tidx] = burn


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
    if args.variant in SIMPLE:
        want = torch.arange(HALF, THREADS, device="cuda", dtype=torch.float32) + 0.5
        ok = torch.equal(out[0, :HALF], want)
    else:
        want = torch.tensor(expected_sums(TABLES[args.variant]), device="cuda")
        ok = torch.equal(out[0], want)
    print(f"diag_racecheck_arrive {args.variant}: values {'ok' if ok else 'WRONG'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
