"""CPU models of the MLA seesaw pass (forgekernel/kernels/attention/mla/sm90/seesaw.py).

`schedule(tiles, stale)`: the two warpgroups' operations per pair of tiles, in the order the
kernel issues them (named barriers, TMA refills per chunk, mbarrier waits, WGMMA issue / commit /
wait, shared-memory reads and writes; with `stale` the last tile's stale rows zeroed by its
scorer and that warpgroup's own barrier WG0 / WG1; the row sums' hand-over at the end, then the
partial O staged over the K buffers by both, a second __syncthreads and warp 0's bulk copies
reading it).
`simulate(tiles, first)` runs them against the hardware's rules (`run` any such programs): a
named barrier completes when its warpgroups arrived (both, or the one of WG0 / WG1; a second
arrival of one in the same generation is an error), an mbarrier phase completes when its TMA is
issued (a wait on parity p while two phases are ahead would alias), a WGMMA's reads last from
its issue to the `wait_group` that retires it, a TMA write from its issue to the mbarrier wait
that observes it. With vector clocks (one component per warpgroup, joined at barrier
completions and mbarrier waits) every write must come after the end of every earlier access to
the same bytes and every read after the end of the write it reads; S and P V must read the tile
the schedule says. `tool=True` also lists the pairs of plain accesses that the barrier-interval
rule takes for unordered (ordering by the count of barriers each warpgroup has passed, the rule
suspected of compute-sanitizer racecheck: scripts/diag_racecheck_arrive.py).

`warp_collective(reaches, threads)`: below the warpgroup, which warps issue a warp-collective
operation (a TMA copy) that the threads with reaches(t) reach: all 32 lanes of a warp or none,
else the warp deadlocks (the schedule's "tma" steps are issued by such a warp).

`seesaw_partial(...)`: the pass's arithmetic in fp64 with the kernel's roundings: per pair,
warpgroup 0's softmax of tile a against the running max, warpgroup 1's of tile c against a's,
O's left half += P_a V_L(a) (P_a rounded relative to a's max), then x c's rescale += P_c V_L(c);
the right half x both rescales += P_c V_R(c) + (P_a x c's rescale, rounded) V_R(a); each half's
row sums of its own tiles, added at the end. Tiles are whole 64-row boxes of one page, stale
rows (past the sequence) read as they are, masked in S and zeroed as V.

`line_schedule(kv_end, parts, fixed_cost)`: the persistent, balanced schedule's prologue (the
design in docs/attention/MLA_NOTES.md, "The persistent, balanced schedule"): the pieces each
part walks, their partial slots (or a direct write) and, `combine_slots`, what the combine
reads back from the prefix alone."""

from __future__ import annotations

import copy
import math
from collections import defaultdict
from dataclasses import dataclass

import torch

from forgekernel.kernels.attention.mla.sm90.config import MIN_TOKENS_PER_SPLIT

TILE = 64
CHUNKS = 9  # 8 latent chunks of 64 columns + the RoPE chunk
LEFT = (0, 1, 2, 3)  # V_L: latent columns 0 .. 255
RIGHT = (4, 5, 6, 7, 8)  # V_R and the RoPE chunk
V_HALF = ((0, 1, 2, 3), (4, 5, 6, 7))
LATENT = 512
LN2_FP32 = torch.tensor(math.log(2.0), dtype=torch.float32)  # the kernel's LN2, an fp32 immediate


# ---------------------------------------------------------------- the schedule


def _scores(tile, buf, chunks, use):
    """S over `chunks` of `buf` (the mbarrier's use-th phase), one commit group."""
    ops = []
    for c in chunks:
        ops += [("mbar_wait", buf, c, use), ("read_async", ("K", buf, c), tile)]
    return ops + [("commit",)]


Q_TILES = [("QR", 0), ("QR", 1)]  # Q's RoPE tile (sP1's bytes), in two halves


def _p(slot):
    """The bytes of P's shared-memory slot: sP0, or sP1 = Q's RoPE tile (written by Q's TMA
    boxes, `Q_TILES`)."""
    return [("P0",)] if slot == 0 else [("QR", 0), ("QR", 1)]


def _pv(buf, half, tile, p_slot=None):
    """P V over V half `half` of `buf` (tile `tile`), P from shared memory slot p_slot or
    registers; one commit group."""
    ops = [("read_async", ("K", buf, c), tile) for c in V_HALF[half]]
    if p_slot is not None:
        ops += [("read_async", res, None) for res in _p(p_slot)]
    return ops + [("commit",)]


def _zero_stale(buf, tile, wg):
    """The last tile's stale rows zeroed (latent chunks) by the warpgroup that scored it, then
    that warpgroup's own barrier (WG0 / WG1, 128 threads) before its P V."""
    return [("write", ("K", buf, c), tile) for c in range(8)] + [("sync", f"WG{wg}")]


def _pair0(k, tiles, has_c, more, stale=True, balanced=True):
    a = 2 * k
    ops = []
    if not has_c and stale:  # a is the last tile, partly past the sequence
        ops += _zero_stale(0, a, 0)
    if has_c and not more and stale and balanced:  # c is: warpgroup 1's zeroing matched
        ops += [("sync", "WG0")]
    ops += [("read", ("M",)), ("write", ("M",), None), ("write", ("SCALE", 0), None)]
    ops += [("arrive", "SCALE0")]
    ops += _pv(0, 0, a) + [("wait_group", 0)]
    ops += [("sync", "SCALE1"), ("sync", "WG0")]  # (WG0: `_own_barrier`, racecheck's count)
    if more:
        ops += [("tma", 0, c, a + 2) for c in LEFT]
    ops += [("read", ("SCALE", 1))] + [("write", res, None) for res in _p(0)] + [("arrive", "P0")]
    if has_c:
        ops += [("sync", "P1")] + _pv(1, 0, a + 1, p_slot=1)
    if more:
        ops += _scores(a + 2, 0, LEFT, k + 1)
        if a + 3 < tiles:
            ops += [("wait_group", 1)] + [("tma", 1, c, a + 3) for c in LEFT]
        ops += _scores(a + 2, 0, RIGHT, k + 1)
    return ops + [("wait_group", 0)]


def _pair1(k, has_c, more_a, more_c, stale=True, balanced=True):
    a, c = 2 * k, 2 * k + 1
    ops = []
    if has_c and not more_a and stale:  # c is the last tile, partly past the sequence
        ops += _zero_stale(1, c, 1)
    if not has_c and stale and balanced:  # a is: warpgroup 0's zeroing matched
        ops += [("sync", "WG1")]
    ops += [("sync", "SCALE0"), ("read", ("M",)), ("write", ("M",), None)]
    ops += [("write", ("SCALE", 1), None), ("arrive", "SCALE1"), ("read", ("SCALE", 0))]
    if has_c:
        ops += [("write", res, None) for res in _p(1)] + _pv(1, 1, c)
    ops += [("sync", "P0")] + _pv(0, 1, a, p_slot=0)
    if has_c:
        ops += [("sync", "P1")]  # (a wait, not an arrive: `_own_barrier`, racecheck's count)
    if more_c:
        ops += [("wait_group", 1)] + [("tma", 1, ch, c + 2) for ch in RIGHT]
    if more_a:
        ops += [("wait_group", 0)] + [("tma", 0, ch, a + 2) for ch in RIGHT]
    if more_c:
        ops += _scores(c + 2, 1, RIGHT + LEFT, k + 1)
    return ops + [("wait_group", 0)]


# the K buffers' chunks the staged partial O (64 rows of 520 fp32 from kl's start) overwrites:
# all of kl (both buffers' latent chunks) and the first 2 KB of kr, in buffer 0's RoPE chunk
STAGED = [("K", buf, c) for buf in range(2) for c in range(CHUNKS - 1)] + [("K", 0, CHUNKS - 1)]


def schedule(
    tiles: int,
    stale: bool = True,
    balanced: bool = True,
    staged: bool = True,
    counted: bool = True,
    gather: bool = False,
) -> tuple[list, list]:
    """(warpgroup 0's operations, warpgroup 1's) of a split of `tiles` tiles, the prologue
    (warp 0's TMA of Q on its own mbarrier and of tiles 0 and 1, __syncthreads, every thread's
    wait for Q, Q's RoPE tile to registers)
    and the epilogue (the row sums' hand-over through sTotal, __syncthreads, the final max and
    row sums read) included. stale: the last tile reaches past the sequence (its scorer zeroes
    the stale rows and passes its own barrier, `_zero_stale`; with `balanced` the other
    warpgroup passes its own too, `_match_stale`, as the kernel does since the 2026-12-02
    racecheck reports; False: the kernel those reports are of); else it is whole. staged: the
    partial O's epilogue through shared memory (each warpgroup's O written over STAGED, bar 0
    again, warp 0's bulk copies read it; False: the scalar global stores before it). counted:
    warpgroup 0 passes its own barrier after SCALE1 and warpgroup 1 waits at P1 (`_own_barrier`,
    for racecheck's count of waits; False: the kernel of the 2026-12-02 racecheck reports).
    gather (the `gather` form): every K load a "gather" (the refilling warpgroup's cp.async
    onto the chunk's mbarrier: the same ordering as a TMA box, but plain stores to a checker),
    tiles 0 and 1 by warpgroups 0 and 1 (each its own tile's chunks) before the prologue's
    __syncthreads, Q's boxes by warp 0 as before; no stale rows (the rows past the split repeat
    its last key: nothing zeroed, no WG0 / WG1 barrier of `_zero_stale` / `_match_stale`)."""
    stale = stale and not gather

    def pro(wg):
        q = [("sync", "ALL")] + ([("mbar_wait", "Q", 0, 0)] if tiles > 0 else [])
        return q + [("read", ("QR", 0)), ("read", ("QR", 1))]

    loads = [("tma", "Q", 0, None)] if tiles > 0 else []  # (no key: no Q, no wait)
    own = [[], []]  # gather: each warpgroup's tile of the prologue
    if gather:
        own = [[("gather", j, c, j) for c in range(CHUNKS)] if j < tiles else [] for j in (0, 1)]
    else:
        loads += [("tma", j, c, j) for j in range(min(tiles, 2)) for c in range(CHUNKS)]
    wg0 = loads + own[0] + [("write", ("M",), None)] + pro(0)
    wg1 = own[1] + pro(1)
    if tiles > 0:
        wg0 += _scores(0, 0, LEFT + RIGHT, 0) + [("wait_group", 0)]
    steady = max((tiles - 1) // 2, 0)
    for k in range(steady):
        wg0 += _pair0(k, tiles, True, True)
    a = 2 * steady
    if a + 1 < tiles:
        wg0 += _pair0(steady, tiles, True, False, stale, balanced)
    elif a < tiles:
        wg0 += _pair0(steady, tiles, False, False, stale)
    if tiles > 1:
        wg1 += _scores(1, 1, RIGHT + LEFT, 0) + [("wait_group", 0)]
    steady = max((tiles - 2) // 2, 0)
    for k in range(steady):
        wg1 += _pair1(k, True, True, True)
    a = 2 * steady
    if a + 2 < tiles:
        wg1 += _pair1(steady, True, True, False)
        wg1 += _pair1(steady + 1, False, False, False, stale, balanced)
    elif a + 1 < tiles:
        wg1 += _pair1(steady, True, False, False, stale)
    elif a < tiles:
        wg1 += _pair1(steady, False, False, False, stale, balanced)
    if not counted:  # the kernel before `_own_barrier`
        own = [i for i, op in enumerate(wg0) if op == ("sync", "WG0") and wg0[i - 1:i] == [
            ("sync", "SCALE1")]]  # fmt: skip
        wg0 = [op for i, op in enumerate(wg0) if i not in own]
        wg1 = [("arrive", "P1") if op == ("sync", "P1") else op for op in wg1]

    if gather:  # the refills too
        wg0, wg1 = ([("gather", *op[1:]) if op[0] == "tma" and op[1] != "Q" else op for op in p]
                    for p in (wg0, wg1))  # fmt: skip

    def end(wg):
        ops = [("write", ("TOTAL", wg), None), ("sync", "END"), ("read", ("M",))]
        ops += [("read", ("TOTAL", 0)), ("read", ("TOTAL", 1))]
        if staged:
            # (each warpgroup its half of every row's columns: the halves do not conflict)
            ops += [("write_part", res, wg) for res in STAGED] + [("sync", "STAGED")]
            ops += [("read", res) for res in STAGED] if wg == 0 else []
        return ops

    return wg0 + end(0), wg1 + end(1)


# ---------------------------------------------------------------- the hardware's rules


class ScheduleError(AssertionError):
    pass


def _leq(a, b):
    return all(x <= y for x, y in zip(a, b, strict=True))


def _join(*vcs):
    return tuple(max(xs) for xs in zip(*vcs, strict=True))


PRIVATE = ("WG0", "WG1")  # one warpgroup's own barriers (128 threads); the others take both
FULL = ("ALL", "END", "STAGED")  # bar 0, __syncthreads: racecheck's epochs


class _Machine:
    """Named barriers, mbarriers, WGMMA groups and the access log; see the module docstring."""

    def __init__(self, tool: bool = False):
        self.tool = tool  # also apply the barrier-interval rule (see simulate)
        self.races = []  # (resource, earlier record, later record) that rule flags
        self.passed = [0, 0]  # wg -> named-barrier waits (bar.sync, any id but 0) it has passed
        self.epoch = [0, 0]  # wg -> __syncthreads (bar 0) it has passed
        self.vc = [(1, 0), (0, 1)]
        self.arrived = defaultdict(dict)  # barrier -> {wg: vc at arrival}
        self.done = defaultdict(list)  # barrier -> [join of the arrivals] per generation
        self.gen = defaultdict(lambda: [0, 0])  # barrier -> generation each wg is at
        self.phases = defaultdict(list)  # (buf, chunk) -> [(tile, issuer vc, writes)] a phase
        self.groups = [[], []]  # wg -> committed groups (lists of access records)
        self.open = [[], []]  # wg -> accesses of the group not yet committed
        self.log = defaultdict(list)  # resource -> access records
        self.content = {}  # resource -> tile it holds
        self.observed = {}  # (buf, chunk, phase) -> vc of the wait that first saw it

    def barrier_copy(self) -> _Machine:
        """A copy whose barrier state (all that a sync reads or writes) is its own, the rest
        shared: what `_blocked` probes a sync on (a deep copy of the access log cost most of the
        simulations' time)."""
        c = copy.copy(self)
        c.vc, c.passed, c.epoch = list(self.vc), list(self.passed), list(self.epoch)
        c.arrived = defaultdict(dict, {b: dict(a) for b, a in self.arrived.items()})
        c.done = defaultdict(list, {b: list(d) for b, d in self.done.items()})
        c.gen = defaultdict(lambda: [0, 0], {b: list(g) for b, g in self.gen.items()})
        return c

    def tick(self, wg):
        v = list(self.vc[wg])
        v[wg] += 1
        self.vc[wg] = tuple(v)

    def access(self, wg, kind, res, tile=None, end=True, generic=False, part=None):
        """Record an access starting now; check it against earlier conflicting ones. generic:
        a plain load / store (not a WGMMA's or TMA's); part: of the resource's bytes, those of
        one part only (accesses of two different parts do not conflict; None: all of them)."""
        rec = {"wg": wg, "kind": kind, "start": self.vc[wg], "end": self.vc[wg] if end else None}
        rec["generic"], rec["interval"], rec["part"] = generic, self.passed[wg], part
        rec["epoch"] = self.epoch[wg]
        for old in self.log[res]:
            if old["kind"] == "read" and kind == "read":
                continue
            if None not in (old.get("part"), part) and old["part"] != part:
                continue
            # (a TMA write is ordered before what each waiter on its mbarrier does next)
            acquired = any(_leq(vc, rec["start"]) for vc in old.get("acquired", ()))
            if not acquired and (old["end"] is None or not _leq(old["end"], rec["start"])):
                raise ScheduleError(f"race on {res}: {old} then {rec}")
            if self.tool and self._interval_hazard(old, rec):
                self.races.append((res, old, rec))
        if kind == "read" and res[0] == "K" and tile is not None and self.content.get(res) != tile:
            raise ScheduleError(f"{res} holds tile {self.content.get(res)}, read as {tile}")
        self.log[res].append(rec)
        return rec

    @staticmethod
    def _interval_hazard(old, new) -> bool:
        """The barrier-interval rule: two plain accesses of different warpgroups between the
        same two __syncthreads count as ordered only if the later one's warpgroup has waited at
        more named barriers (bar.sync, any id and count) than the earlier one's had; a
        bar.arrive counts for nothing (which barriers, and with whom, not considered). The one
        rule of those tried that gives every verdict of the racecheck probe on the H200
        (2026-12-02 04:10 and 06:40, scripts/diag_racecheck_arrive.py)."""
        both = old["generic"] and new["generic"] and old["wg"] != new["wg"]
        return both and old["epoch"] == new["epoch"] and new["interval"] <= old["interval"]


def _step(m, wg, op):
    """Run one operation; False if it blocks."""
    kind = op[0]
    if kind in ("arrive", "sync"):
        bar = op[1]
        gen = m.gen[bar][wg]
        if len(m.done[bar]) < gen:
            raise ScheduleError(f"{bar}: warpgroup {wg} arrives twice in one generation")
        if len(m.done[bar]) == gen:  # this generation still open
            if wg not in m.arrived[bar]:
                m.arrived[bar][wg] = m.vc[wg]
                if len(m.arrived[bar]) == (1 if bar in PRIVATE else 2):
                    vcs = list(m.arrived[bar].values())
                    m.done[bar].append(_join(*vcs))
                    m.arrived[bar] = {}
            if len(m.done[bar]) <= gen:
                if kind == "arrive":  # (no interval: racecheck counts a thread's waits)
                    m.gen[bar][wg] += 1
                    return True
                return False  # sync: wait for the other warpgroup
        m.gen[bar][wg] += 1
        if kind == "sync":
            m.vc[wg] = _join(m.vc[wg], m.done[bar][gen])
            if bar in FULL:
                m.epoch[wg] += 1
            else:
                m.passed[wg] += 1
        return True
    if kind in ("tma", "gather"):  # K chunk (buf, chunk), or Q's boxes (buf "Q") on their own
        _, buf, chunk, tile = op  # mbarrier; gather: cp.async, plain stores to racecheck
        resources = Q_TILES if buf == "Q" else [("K", buf, chunk)]
        generic = kind == "gather"
        writes = [m.access(wg, "write", res, end=False, generic=generic) for res in resources]
        if buf != "Q":
            m.content[resources[0]] = tile
        m.phases[(buf, chunk)].append((tile, m.vc[wg], writes))
        return True
    if kind == "mbar_wait":
        if _mbar_pending(m, op):
            return False
        _, buf, chunk, use = op
        done = m.phases[(buf, chunk)]
        if len(done) > use + 1:
            raise ScheduleError(f"mbarrier {(buf, chunk)}: phase {use} waited, {len(done)} done")
        _, issuer_vc, writes = done[use]
        m.vc[wg] = _join(m.vc[wg], issuer_vc)
        for write in writes:
            if write["end"] is None:
                write["end"] = m.vc[wg]
            write.setdefault("acquired", []).append(m.vc[wg])
        return True
    if kind == "read_async":
        _, res, tile = op
        m.open[wg].append(m.access(wg, "read", res, tile, end=False))
        return True
    if kind == "commit":
        m.groups[wg].append(m.open[wg])
        m.open[wg] = []
        return True
    if kind == "wait_group":
        keep = op[1]
        while len(m.groups[wg]) > keep:
            for rec in m.groups[wg].pop(0):
                rec["end"] = m.vc[wg]
        return True
    if kind in ("read", "write"):
        res, tile = op[1], (op[2] if len(op) > 2 else None)
        m.access(wg, kind, res, tile, generic=True)
        if kind == "write" and res[0] == "K":
            m.content[res] = tile
        return True
    if kind == "write_part":  # a store of part op[2] of the resource (the staged O's halves)
        m.access(wg, "write", op[1], generic=True, part=op[2])
        m.content[op[1]] = None
        return True
    if kind == "spin":  # a delay (the racecheck probe's): no access
        return True
    raise ValueError(op)


def simulate(
    tiles: int,
    first: int = 0,
    switch_every: int | tuple = 1,
    tool: bool = False,
    stale: bool = True,
    balanced: bool = True,
    staged: bool = True,
    counted: bool = True,
    gather: bool = False,
) -> _Machine:
    """Run `schedule(tiles, stale, balanced, staged, counted, gather)` (see `run`)."""
    progs = schedule(tiles, stale, balanced, staged, counted, gather)
    return run(progs, first, switch_every, tool)


def run(progs, first: int = 0, switch_every: int | tuple = 1, tool: bool = False) -> _Machine:
    """Run the two warpgroups' programs with warpgroup `first` starting, switching to the other
    one after `switch_every` operations (per warpgroup if a pair) or when blocked; ScheduleError
    on a deadlock or a broken hardware rule. tool: also collect in `races` the pairs of plain
    accesses that the barrier-interval rule (`_Machine._interval_hazard`) takes for unordered,
    the rule suspected of compute-sanitizer racecheck after the 2026-12-02 H200 runs (see
    scripts/diag_racecheck_arrive.py)."""
    pcs = [0, 0]
    m = _Machine(tool)
    every = switch_every if isinstance(switch_every, tuple) else (switch_every, switch_every)
    wg = first
    while pcs[0] < len(progs[0]) or pcs[1] < len(progs[1]):
        ran = 0
        while pcs[wg] < len(progs[wg]) and ran < every[wg]:
            if not _step(m, wg, progs[wg][pcs[wg]]):
                break
            m.tick(wg)
            pcs[wg] += 1
            ran += 1
        other = 1 - wg
        if ran == 0 and (pcs[other] >= len(progs[other]) or _blocked(m, other, progs, pcs)):
            raise ScheduleError(f"deadlock at {pcs}: {progs[0][pcs[0]:pcs[0] + 1]}, "
                                f"{progs[1][pcs[1]:pcs[1] + 1]}")  # fmt: skip
        wg = other
    for w in (0, 1):
        if m.open[w] or m.groups[w]:
            raise ScheduleError(f"warpgroup {w} ends with WGMMAs in flight")
    return m


def _mbar_pending(m, op) -> bool:
    """Whether an mbar_wait's phase is not complete yet (the wait blocks)."""
    _, buf, chunk, use = op
    return len(m.phases.get((buf, chunk), ())) <= use


def _blocked(m, wg, progs, pcs) -> bool:
    """Whether warpgroup wg's next operation blocks: only a sync or an mbarrier wait can
    (`_step`); a sync is probed on a copy of the barrier state. (An operation that would raise
    raises at its real step, which comes next on the same state.)"""
    if pcs[wg] >= len(progs[wg]):
        return True
    op = progs[wg][pcs[wg]]
    if op[0] == "mbar_wait":
        return _mbar_pending(m, op)
    if op[0] != "sync":
        return False
    return not _step(m.barrier_copy(), wg, op)


# ---------------------------------------------------------------- warp convergence

WARP = 32


def warp_collective(reaches, threads: int) -> list[int]:
    """The warps that run a warp-collective operation (the DSL's TMA copy: elect.sync over all
    32 lanes picks the issuing lane; elect_one likewise) reached by the threads t < `threads`
    with reaches(t). A warp runs it only if all 32 lanes reach it: a lane that reaches it
    alone waits for the other 31 at the elect while they wait for it where the branch
    reconverges (ptxas: BRA.DIV to a WARPSYNC.COLLECTIVE of all 32 lanes), so the CTA never
    finishes: ScheduleError."""
    warps = []
    for w in range(threads // WARP):
        lanes = sum(bool(reaches(w * WARP + lane)) for lane in range(WARP))
        if 0 < lanes < WARP:
            raise ScheduleError(
                f"deadlock: warp {w} reaches a warp-collective operation with {lanes} of its "
                f"{WARP} lanes (elect.sync waits for the others, parked at the reconvergence)"
            )
        if lanes:
            warps.append(w)
    return warps


# ---------------------------------------------------------------- the arithmetic


def _base(m: torch.Tensor) -> torch.Tensor:
    return torch.where(m > -math.inf, m, 0.0)


def seesaw_split(q, keys, values, key_index, limit, mask_from, scale_log2, dtype):
    """One split of one CTA: q (rows, 576) fp64; keys (tiles, 64, 576) and values (tiles, 64,
    512) fp64 as the buffers hold them (stale rows included: values zeroed there by the
    caller); key_index (tiles, 64) the keys' positions; limit (rows,) the first position a row
    may not see, applied to the tiles reaching past mask_from (the kernel's `_mask_from`: rows
    not written may see more). Returns (O (rows, 512) normalized, LSE (rows,) log2; 0 / -inf
    without keys)."""
    rows = q.shape[0]
    tiles = keys.shape[0]
    m = torch.full((rows,), -math.inf, dtype=torch.float64)
    sums = [torch.zeros(rows, dtype=torch.float64) for _ in range(2)]
    o = [torch.zeros(rows, LATENT // 2, dtype=torch.float64) for _ in range(2)]
    halves = (slice(0, LATENT // 2), slice(LATENT // 2, LATENT))

    def softmax(tile):
        if tile >= tiles:  # no tile c: every key masked
            s = torch.full((rows, TILE), -math.inf, dtype=torch.float64)
        else:
            s = q @ keys[tile].T
            if int(key_index[tile][-1]) >= mask_from:
                s = torch.where(key_index[tile][None, :] < limit[:, None], s, -math.inf)
        top = s.max(1).values * scale_log2
        m_new = torch.maximum(m, top)
        corr = torch.exp2(m - _base(m_new))
        return torch.exp2(s * scale_log2 - _base(m_new)[:, None]), corr, m_new

    def rounded(p):
        return p.to(dtype).double()

    for a in range(0, tiles, 2):
        c = a + 1
        p_a, corr0, m = softmax(a)
        sums[0] = sums[0] * corr0 + p_a.sum(1)
        o[0] = o[0] * corr0[:, None] + rounded(p_a) @ values[a][:, halves[0]]
        p_c, corr1, m = softmax(c)
        both = corr0 * corr1
        sums[1] = sums[1] * both + p_c.sum(1)
        o[1] = o[1] * both[:, None]
        if c < tiles:
            o[1] += rounded(p_c) @ values[c][:, halves[1]]
        o[1] += rounded(p_a * corr1[:, None]) @ values[a][:, halves[1]]
        if c < tiles:
            o[0] = o[0] * corr1[:, None] + rounded(p_c) @ values[c][:, halves[0]]
            sums[0] = sums[0] * corr1
    total = sums[0] + sums[1]
    seen = total > 0
    out = torch.cat(o, 1) / torch.where(seen, total, 1.0)[:, None]
    lse = torch.where(seen, m + torch.log2(torch.where(seen, total, 1.0)), -math.inf)
    return torch.where(seen[:, None], out, 0.0), lse


def unit_per(per: int, kv_end: int, splits: int) -> int:
    """The keys one split of a unit takes (decode.py, seesaw.py): the unit's own keys over the
    grid's splits in whole tiles, at least `per` (the launcher's per_split)."""
    keys = -(-kv_end // splits)
    return max(per, -(-keys // TILE) * TILE)


def seesaw_partial(qn, qp, ckv, kpe, ckv_scale, pt, seq, op_, lp, scale_log2, per, page_size,
                   cu, causal, q_blocks, *, heads, qtokens, direct=False,
                   listed=False, gather=False):  # fmt: skip
    """The seesaw pass (seesaw.py) with the partial pass's arguments (test_mla_decode's
    `_partial`): CTA (sequence x query block, head block, split) reads its split's tiles as
    whole 64-row boxes of one page each (the launcher's contract: per and page_size multiples
    of 64), the rows past the sequence as stale slots (masked in S, zeroed as V), and runs
    `seesaw_split`. Only pages of the sequence are read. direct (the direct form): one split,
    op_ / lp the op's out (rows, Hq, 512) in q's dtype and natural LSE (rows, Hq), written as
    `_write_split` does (O rounded to out's dtype, log2 LSE x ln 2). A split takes the unit's
    own keys over the splits in whole tiles, at least `per` (the work list's form, `listed`:
    exactly `per`, the list's keys per split). gather (the `gather` form, any page size): each
    tile's 64 rows gathered one by one, key min(t0 + 64 j + row, t1 - 1) (`_gather_rows`: no
    page-table entry past the split is read), masked in S as above but not zeroed as V (no
    stale slot is read: the kernel zeroes nothing)."""
    splits = 1 if direct else op_.shape[0]
    if direct:
        assert op_.dtype == qn.dtype and lp.dtype == torch.float32
    assert ckv_scale is None and per % TILE == 0 and (gather or page_size % TILE == 0)
    _, hq, _ = qn.shape
    rows = [(i, h) for i in range(qtokens) for h in range(heads)]
    for b, blk in ((b, blk) for b in range(seq.shape[0]) for blk in range(q_blocks)):
        sk = int(seq[b])
        if cu is None:
            q_off, sq, kv_end = b, 1, sk
        else:
            q_all, token0 = int(cu[b + 1] - cu[b]), blk * qtokens
            q_off, sq = int(cu[b]) + token0, max(min(q_all - token0, qtokens), 0)
            kv_end = (sk - q_all + token0 + sq if causal else sk) if sq > 0 else 0
        for h0 in range(0, hq, heads):
            zero = torch.zeros(LATENT + 64, dtype=torch.float64)
            q = torch.stack([
                torch.cat([qn[q_off + i, h0 + h], qp[q_off + i, h0 + h]]).double()
                if i < sq else zero for i, h in rows
            ])  # fmt: skip
            per_u = per if listed else unit_per(per, kv_end, splits)
            for s in range(splits):
                t0, t1 = s * per_u, min(s * per_u + per_u, kv_end)
                if direct:
                    assert t1 == kv_end, "the direct form's one split covers every key"
                tiles = max(-(-(t1 - t0) // TILE), 0)
                limit = torch.tensor([
                    (min(t1, kv_end - sq + i + 1) if causal else t1) if i < sq else 0
                    for i, _ in rows
                ])  # fmt: skip
                mask_from = min(t1, kv_end - sq + 1) if causal and qtokens > 1 else t1
                keys, values, index = [], [], []
                for j in range(tiles):
                    first = t0 + j * TILE
                    pos = torch.arange(first, first + TILE)
                    if gather:
                        token = pos.clamp(max=t1 - 1)
                        held = token // page_size  # the table's entries read
                        assert int(held.max()) < -(-sk // page_size), (b, s, j, sk)
                        row, slots = pt[b, held].long(), token % page_size
                    else:
                        page = first // page_size
                        assert page < -(-sk // page_size), (b, s, j, sk)  # a page of the seq.
                        start = first - page * page_size
                        slots = torch.arange(start, start + TILE)
                        row = pt[b, page].long()
                    k = torch.cat([ckv[row, slots], kpe[row, slots]], -1).double()
                    keys.append(k)
                    # (gather: no stale slot read, nothing zeroed: the rows past the split
                    # repeat its last key, masked)
                    live = (pos < sk) | gather
                    values.append(torch.where(live[:, None], k[:, :LATENT], 0.0))
                    index.append(pos)
                if tiles:
                    stacked = [torch.stack(t) for t in (keys, values, index)]
                    o, lse = seesaw_split(q, *stacked, limit, mask_from, scale_log2, qn.dtype)
                else:
                    o = torch.zeros(len(rows), LATENT, dtype=torch.float64)
                    lse = torch.full((len(rows),), -math.inf, dtype=torch.float64)
                for r, (i, h) in enumerate(rows):
                    if i < sq and direct:
                        op_[q_off + i, h0 + h] = o[r].float().to(op_.dtype)
                        lp[q_off + i, h0 + h] = lse[r].float() * LN2_FP32
                    elif i < sq:
                        op_[s, q_off + i, h0 + h] = o[r]
                        lp[s, q_off + i, h0 + h] = lse[r]


# ---------------------------------------------------------------- the persistent, balanced schedule

MIN_PART_TILES = MIN_TOKENS_PER_SPLIT // TILE  # P's floor: the tile plan's shortest split


@dataclass(frozen=True)
class Piece:
    """Tiles [k0, k1) of sequence `seq`, walked by one part; slot (part, 0 / 1) of the partials,
    or None: the sequence's only piece, written final (bf16 O and the natural LSE)."""

    seq: int
    k0: int
    k1: int
    slot: tuple[int, int] | None


@dataclass(frozen=True)
class LineSchedule:
    prefix: tuple[int, ...]  # W: the exclusive prefix of the weights (B + 1), CTA 0's scratch
    per: int  # P: the line's tiles per part
    fixed_cost: int  # F: a piece's fixed cost in tiles
    parts: tuple[tuple[Piece, ...], ...]  # the pieces each part walks, in order

    def load(self, part: int) -> int:
        """The part's tiles plus F a piece."""
        return sum(p.k1 - p.k0 + self.fixed_cost for p in self.parts[part])


def _lower_bound(n: int, pred) -> int:
    """The least i in [0, n] with pred(i) (pred false then true over 0 .. n - 1): the prologue's
    binary search, one pred (two reads of W) a step."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if pred(mid):
            hi = mid
        else:
            lo = mid + 1
    return lo


def line_per(total: int, parts: int, min_part_tiles: int = MIN_PART_TILES) -> int:
    """P = max(ceil(W_B / parts), the floor)."""
    return max(-(-total // parts), min_part_tiles)


def first_part(prefix, b: int, fixed_cost: int, per: int) -> int:
    """The part of sequence b's first piece: its tile 0's at W_b + F; a sequence of 0 keys
    (w_b = F) has one piece of 0 tiles, at its last unit W_b + F - 1 (0 if that is -1: F = 0
    at the line's start)."""
    empty = prefix[b + 1] - prefix[b] == fixed_cost
    return max(prefix[b] + fixed_cost - empty, 0) // per


def last_part(prefix, b: int, per: int) -> int:
    """The part of sequence b's last piece: its last unit's, W_{b+1} - 1 (0 keys included)."""
    return max(prefix[b + 1] - 1, 0) // per


def line_schedule(
    kv_end, parts: int, fixed_cost: int, min_part_tiles: int = MIN_PART_TILES
) -> LineSchedule:
    """What every CTA's prologue computes from the key bounds kv_end (B,) (a sequence's keys,
    0 where it has no query): w_b = ceil(kv_end_b / 64) + F, W their exclusive prefix, P =
    `line_per(W_B)`; tile k of b at W_b + F + k on a line cut every P; part p binary-searches
    its first sequence (the first whose last piece is at p or later) and its last (the last
    whose first piece is at p or earlier), then walks tiles [max(pP - W_b - F, 0), min((p + 1)P
    - W_b - F, t_b)) of each. Slots: a sequence of one piece none (written final); else its
    first piece (the last item of its part) (p, 1), the others (the first item of theirs)
    (p, 0)."""
    tiles = [-(-max(int(k), 0) // TILE) for k in kv_end]
    prefix = [0]
    for t in tiles:
        prefix.append(prefix[-1] + t + fixed_cost)
    n = len(tiles)
    per = line_per(prefix[-1], parts, min_part_tiles)
    walks = []
    for p in range(parts):
        first = _lower_bound(n, lambda b, p=p: last_part(prefix, b, per) >= p)
        last = _lower_bound(n, lambda b, p=p: first_part(prefix, b, fixed_cost, per) > p) - 1
        pieces = []
        for b in range(first, last + 1):
            start = prefix[b] + fixed_cost  # tile 0's place on the line
            t = prefix[b + 1] - start
            k0, k1 = min(max(p * per - start, 0), t), min((p + 1) * per - start, t)
            lo, hi = first_part(prefix, b, fixed_cost, per), last_part(prefix, b, per)
            slot = None if lo == hi else (p, 1 if p == lo else 0)
            pieces.append(Piece(b, k0, k1, slot))
        walks.append(tuple(pieces))
    return LineSchedule(tuple(prefix), per, fixed_cost, tuple(walks))


def combine_slots(prefix, parts: int, fixed_cost: int, min_part_tiles: int = MIN_PART_TILES):
    """Per sequence, the slots the combine reduces, found from W (CTA 0's scratch) alone: None
    for a sequence of one piece (the pass wrote it final: the combine returns), else (first, 1),
    (first + 1, 0) .. (last, 0)."""
    per = line_per(prefix[-1], parts, min_part_tiles)
    out = []
    for b in range(len(prefix) - 1):
        lo, hi = first_part(prefix, b, fixed_cost, per), last_part(prefix, b, per)
        out.append(None if lo == hi else [(lo, 1)] + [(p, 0) for p in range(lo + 1, hi + 1)])
    return out


def grid_makespan(costs, slots: int) -> int:
    """The makespan of CTAs of these costs launched in order onto `slots` SMs, each taking the
    next CTA when it frees (greedy list scheduling)."""
    import heapq

    free = [0] * slots
    for c in costs:
        heapq.heappush(free, heapq.heappop(free) + c)
    return max(free)
