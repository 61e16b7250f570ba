"""The fused KDA backward kernel's hand-overs replayed on the CPU (kda_bwd_fused/sm90/
fused_grads.py, kernel 2's `_math` and `_rowsum_hdh`, the WY kernel's `_math`): the TMA warp
(phase A's five groups, BAR_FREE_U_DH, phase B's early groups, BAR_FREE, its late ones), the
<h, dh> warps and the two math warpgroups, each a sequence of named-barrier arrivals / syncs
(their thread counts), mbarrier waits and the shared-memory reads and writes of each step (the
content each expects: phase A's tile, a tile formed on chip, phase B's box), run by a scheduler
that steps any agent not blocked and lands any box in flight at any step. Boxes fill their
places at landing; an mbarrier completes when the bytes it was armed with (`config.group_bytes`,
the kernel's own computation) have landed. For every interleaving tried: every agent finishes
(no barrier short of its threads, no wait without its arm), no mbarrier receives bytes past
its arm, and every read finds the content it expects (no phase-B box lands in bytes a later
phase-A step reads; no read before its box). With phase A's q + k group armed as next/kda-fuse-
wy did (k's bytes zeroed for both phases) the replay fails: the group completes on q alone."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.chunk_grads import (  # noqa: E402
    BAR_BOTH,
    BAR_HDH,
    BAR_WG,
    HDH_THREADS,
    MATH_THREADS,
)
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.fused_grads import (  # noqa: E402
    B_PLACES,
    BAR_FREE,
    BAR_FREE_U_DH,
    EARLY_B,
    LATE_B,
)
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.wy_grads import BAR_DOTS  # noqa: E402

TOKEN, STATE, TT = 64 * 128 * 2, 128 * 128 * 2, 64 * 64 * 2  # a tile's bytes (16-bit)
SIZES = {"h": STATE, "dh": STATE, "tt": TT}
WARP, WG = 32, 128
HALVES = (0, 1)
# phase A's boxes' places (kernel 2's fields; a state spans two 16 KB places), phase B's at
# B_PLACES (field, 16 KB tile within it)
A_PLACES = {"du": ["sDU"], "h": ["sH.0", "sH.1"], "do": ["sDO"], "u": ["sU"], "q": ["sQ"],
            "k": ["sK"], "dh": ["sDH.0", "sDH.1"]}  # fmt: skip


def _b_place(name):
    field, tile = B_PLACES[name]
    return f"{field}.{tile}" if field in ("sH", "sDH") else field


def _token(place):  # a token tile's two column halves (the warpgroups' channels)
    return [f"{place}/{h}" for h in HALVES]


def _units(place):
    return _token(place) if "." not in place else [place]


def producer(bytes_a, bytes_b):
    ops = []
    for i, g in enumerate(config.A_GROUPS):
        ops.append(("arm", ("A", i), bytes_a[i]))
        ops += [("box", ("A", i), p, n, SIZES.get(n, TOKEN) // len(A_PLACES[n]))
                for n in g for p in A_PLACES[n]]  # fmt: skip

    def b_groups(which):
        out = []
        for i in which:
            out.append(("arm", ("B", i), bytes_b[i]))
            for n in config.B_GROUPS[i]:
                if n not in config.ON_CHIP:
                    out.append(("box", ("B", i), _b_place(n), f"{n}_b", SIZES.get(n, TOKEN)))
        return out

    ops.append(("sync", BAR_FREE_U_DH, MATH_THREADS + WARP))
    ops += b_groups(EARLY_B)
    ops.append(("sync", BAR_FREE, MATH_THREADS + WARP))
    ops += b_groups(LATE_B)
    return ops


def hdh_warps():
    return [("wait", ("A", 0)), ("wait", ("A", 4)), ("read", "sH.0", "h"), ("read", "sH.1", "h"),
            ("read", "sDH.0", "dh"), ("read", "sDH.1", "dh"),
            ("arrive", BAR_HDH, MATH_THREADS + HDH_THREADS)]  # fmt: skip


def math_wg(kh):
    """One math warpgroup's steps (kh = its channel half), as kernel 2's `_math` then the WY
    kernel's `_math(staged=True)` run them in the fused kernel."""
    own = f"/{kh}"
    mine, both = ("sync", BAR_WG + kh, WG), ("sync", BAR_BOTH, MATH_THREADS)

    def rd(place, what, half=None):  # half None: both halves of a token tile
        units = _units(place) if half is None else [place + half]
        return [("read", u, what) for u in units]

    def wr(place, what, half):
        return [("write", place + half, what)]

    rows = [("write", u, "rows") for u in _token("sDU") + ["sH.0", "sH.1"]]  # dG's rows' bytes
    a = [mine, mine, ("wait", ("A", 0)), *rd("sDU", "du"), *rd("sH.0", "h"), *rd("sH.1", "h"),
         *wr("sDW", "dw", own), ("wait", ("A", 1)), *rd("sDO", "do"), ("wait", ("A", 2)),
         *rd("sU", "u")]  # fmt: skip
    if kh == 0:
        a += [("write", u, "dPT") for u in _token("sP")]
    a += [both, ("wait", ("A", 3)), *rd("sQ", "q", own), *rd("sK", "k", own),
          *wr("sDU", "ker", own), *wr("sDO", "qel", own), mine, *rd("sDU", "ker", own),
          ("sync", BAR_HDH, MATH_THREADS + HDH_THREADS), *rows, *rd("sQ", "q", own),
          *rd("sK", "k", own), ("wait", ("A", 4)), *rd("sU", "u"), *rd("sDH.0", "dh"),
          *rd("sDH.1", "dh"), ("arrive", BAR_FREE_U_DH, MATH_THREADS + WARP),
          *rd("sK", "k", own), *rd("sP", "dPT"), *rd("sDO", "qel", own), *rd("sK", "k", own),
          *rd("sQ", "q", own), mine, ("arrive", BAR_FREE, MATH_THREADS + WARP)]  # fmt: skip

    def dots(slot, reads):  # warpgroup 1's partials handed to warpgroup 2
        bar = (BAR_DOTS + slot, MATH_THREADS)
        return [("sync", *bar), *reads] if kh == 1 else [*reads, ("arrive", *bar)]

    tt, v = _b_place("tt"), _b_place("v")
    du, u, w = _b_place("du"), _b_place("u"), _b_place("w")
    b = [mine, ("wait", ("B", 0)), *rd(tt, "tt_b"), *rd(du, "du_b", own), mine,
         *wr(du, "dvb", own), ("wait", ("B", 2)), *dots(0, rd(v, "v_b")), ("wait", ("B", 3)),
         *rd(tt, "tt_b"), *rd("sDW", "dw", own), mine, *wr("sDW", "dkb", own),
         ("wait", ("B", 1)), ("wait", ("B", 4)), both, *rd(du, "dvb"), *rd(u, "u_b"),
         *rd("sDW", "dkb"), *rd(w, "w_b"), ("wait", ("B", 5)),
         *dots(1, [*rd("sK", "k", own), *rows])]  # fmt: skip
    if kh == 0:
        b += [("write", x, "bdAT") for x in _token("sP")]
    b += [both, *rd("sK", "k", own), *wr("sDW", "ker_b", own), *wr(du, "kel_b", own), mine,
          *rd("sDW", "ker_b", own), *dots(2, rd("sK", "k", own)), *rd("sP", "bdAT"),
          *rd(du, "kel_b", own), mine, mine]  # fmt: skip
    return a + b


class Replay:
    """The agents' steps interleaved by `rng`; boxes in flight land at random steps."""

    def __init__(self, agents, rng):
        self.agents, self.rng = agents, rng
        self.pc = {name: 0 for name in agents}
        self.content: dict[str, str] = {}
        self.armed: dict[tuple, int] = {}
        self.landed: dict[tuple, int] = {}
        self.done: set[tuple] = set()
        self.flight: list[tuple] = []
        self.count: dict[int, int] = {}  # named barrier: threads arrived this generation
        self.gen: dict[int, int] = {}
        self.waiting: dict[str, tuple[int, int]] = {}  # agent -> (barrier, generation)

    def _threads(self, name):
        return {"producer": WARP, "hdh": HDH_THREADS}.get(name, WG)

    def _arrive(self, bar, count, name):
        self.count[bar] = self.count.get(bar, 0) + self._threads(name)
        assert self.count[bar] <= count, f"barrier {bar}: more than {count} threads"
        gen = self.gen.get(bar, 0)
        if self.count[bar] == count:
            self.count[bar], self.gen[bar] = 0, gen + 1
        return gen

    def _land(self, box):
        group, place, what, nbytes = box
        for unit in _units(place):
            self.content[unit] = what
        self.landed[group] = self.landed.get(group, 0) + nbytes
        assert group not in self.done, f"group {group}: bytes landed past its arm"
        if self.landed[group] == self.armed[group]:
            self.done.add(group)

    def _step(self, name):
        """Runs agent `name`'s next step if it is not blocked; True if it ran."""
        if name in self.waiting:
            bar, gen = self.waiting[name]
            if self.gen.get(bar, 0) <= gen:
                return False
            del self.waiting[name]
            self.pc[name] += 1
            return True
        op = self.agents[name][self.pc[name]]
        kind = op[0]
        if kind == "wait" and op[1] not in self.done:
            return False
        if kind == "arm":
            self.armed[op[1]], self.landed[op[1]] = op[2], 0
            if op[2] == 0:
                self.done.add(op[1])
        elif kind == "box":
            self.flight.append(op[1:])
        elif kind == "read":
            got = self.content.get(op[1])
            assert got == op[2], f"{name} reads {op[1]} for {op[2]}, finds {got}"
        elif kind == "write":
            self.content[op[1]] = op[2]
        elif kind == "arrive":
            self._arrive(op[1], op[2], name)
        elif kind == "sync":
            self.waiting[name] = (op[1], self._arrive(op[1], op[2], name))
            return True
        self.pc[name] += 1
        return True

    def run(self):
        while True:
            live = [n for n in self.agents if self.pc[n] < len(self.agents[n])]
            if self.flight and (not live or self.rng.random() < 0.3):
                self._land(self.flight.pop(self.rng.randrange(len(self.flight))))
                continue
            if not live:
                return
            self.rng.shuffle(live)
            if any(self._step(n) for n in live):
                continue
            if not self.flight:
                blocked = {n: self.agents[n][self.pc[n]] for n in live}
                raise AssertionError(f"deadlock: {blocked}")
            self._land(self.flight.pop(self.rng.randrange(len(self.flight))))


def _agents(bytes_a, bytes_b):
    return {"producer": producer(bytes_a, bytes_b), "hdh": hdh_warps(), "wg1": math_wg(0),
            "wg2": math_wg(1)}  # fmt: skip


def _kernel_bytes():
    return (config.group_bytes(config.A_GROUPS, SIZES, TOKEN),
            config.group_bytes(config.B_GROUPS, SIZES, TOKEN, config.ON_CHIP))  # fmt: skip


@pytest.mark.parametrize("seed", range(200))
def test_replay_finishes_and_every_read_finds_its_tile(seed):
    Replay(_agents(*_kernel_bytes()), random.Random(seed)).run()


def test_the_groups_bytes_are_their_boxes():
    """The kernel's arms (config.group_bytes as fused_grads calls it): phase A kernel 2's
    groups whole (48, 16, 16, 32, 32 KB), phase B the WY kernel's without dw's and k's."""
    bytes_a, bytes_b = _kernel_bytes()
    assert [x // 1024 for x in bytes_a] == [48, 16, 16, 32, 32]
    assert [x // 1024 for x in bytes_b] == [24, 16, 16, 0, 16, 0]


def test_next_kda_fuse_wy_arms_fail_the_replay():
    """k's bytes zeroed in both phases (next/kda-fuse-wy's one table): phase A's q + k group
    completes on q's box, and k's lands past the arm (or the math reads k first)."""
    on_chip_both = config.group_bytes(config.A_GROUPS, SIZES, TOKEN, config.ON_CHIP)
    assert on_chip_both[3] == TOKEN
    failed = 0
    for seed in range(50):
        try:
            Replay(_agents(on_chip_both, _kernel_bytes()[1]), random.Random(seed)).run()
        except AssertionError:
            failed += 1
    assert failed == 50
