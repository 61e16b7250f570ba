"""The chunked prefill kernel's rings and roles replayed on the CPU (chunked_fwd.py, aux_wy.py,
state_wg.py): the producer warp (q / k then v per chunk), the gate warp, one or two aux
warpgroups (two alternate chunks: their ring states start at their index and step by two) and
the state warpgroups, each a sequence of waits and arrivals on the rings' stages, run by a
scheduler that steps any agent not blocked. For every chunk count every agent finishes (no wait
without its arrivals), each stage is filled for a chunk only after all its consumers released
the chunk one lap before, and the (stage, phase) an agent waits on for chunk c is the one the
ring's producer filled for c: the pipeline states' arithmetic (index = c % stages, phase = lap
parity) after `advance(a)` and `advance(aux_wgs)` per chunk."""

from __future__ import annotations

import pytest

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    QK_STAGES,
    STAGES,
    V_STAGES,
    aux_wgs,
    state_wgs,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import gate_warp_witnesses_qk


def advance(state: tuple[int, int], count: int, stages: int) -> tuple[int, int]:
    """cutlass.pipeline.PipelineState.advance on (index, phase): by one, a wrap flips the phase;
    by `count`, the index mod stages and the phase flipped by the laps' parity."""
    index, phase = state
    if count == 1:
        index += 1
        return (0, phase ^ 1) if index == stages else (index, phase)
    index += count
    return index % stages, phase ^ ((index // stages) % 2)


class Ring:
    """Stages holding the chunk last filled and the consumers that released it."""

    def __init__(self, stages: int, consumers: int):
        self.stages, self.consumers = stages, consumers
        self.filled = [None] * stages  # chunk in the stage
        self.released = [consumers] * stages  # consumers done with it

    def can_fill(self, c: int) -> bool:
        s = c % self.stages
        last = self.filled[s]
        return self.released[s] == self.consumers and (last is None or last == c - self.stages)

    def fill(self, c: int) -> None:
        s = c % self.stages
        self.filled[s], self.released[s] = c, 0

    def holds(self, c: int) -> bool:
        return self.filled[c % self.stages] == c

    def release(self, c: int) -> None:
        assert self.holds(c)
        self.released[c % self.stages] += 1


def _agents(nchunks: int, auxes: int, states: int, rings: dict):
    """Each agent: a generator of steps (a predicate to wait on, then an action)."""
    qk, v, gate, aux = rings["qk"], rings["v"], rings["gate"], rings["aux"]

    def producer():
        for c in range(nchunks):
            yield lambda c=c: qk.can_fill(c), lambda c=c: qk.fill(c)
            yield lambda c=c: v.can_fill(c), lambda c=c: v.fill(c)

    def gates():
        for c in range(nchunks):
            yield lambda c=c: gate.can_fill(c), lambda c=c: gate.fill(c)

    def aux_wg(a):
        state = {"qk": (0, 0), "gate": (0, 0), "aux": (0, 1)}  # consumers 0, producers 1
        stages = {"qk": QK_STAGES, "gate": STAGES, "aux": STAGES}
        state = {k: advance(st, a, stages[k]) if a else st for k, st in state.items()}
        for c in range(a, nchunks, auxes):
            assert state["qk"] == (c % QK_STAGES, (c // QK_STAGES) % 2)
            assert state["gate"] == (c % STAGES, (c // STAGES) % 2)
            assert state["aux"] == (c % STAGES, 1 ^ (c // STAGES) % 2)
            yield lambda c=c: qk.holds(c) and gate.holds(c), lambda: None
            yield lambda c=c: aux.can_fill(c), lambda c=c: (qk.release(c), aux.fill(c))
            yield lambda: True, lambda c=c: gate.release(c)
            state = {k: advance(st, auxes, stages[k]) for k, st in state.items()}

    def state_wg():
        for c in range(nchunks):
            yield lambda c=c: qk.holds(c), lambda: None
            yield lambda c=c: aux.holds(c) and v.holds(c), lambda c=c: v.release(c)
            yield lambda: True, lambda c=c: (qk.release(c), aux.release(c))

    return [producer(), gates(), *(aux_wg(a) for a in range(auxes)),
            *(state_wg() for _ in range(states))]  # fmt: skip


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("nchunks", range(10))
def test_every_role_finishes_every_chunk(v_split, nchunks):
    auxes, states = aux_wgs(v_split), state_wgs(128, v_split)
    rings = {
        "qk": Ring(QK_STAGES, 1 + states),  # the aux warpgroup of the chunk + each state one
        "v": Ring(V_STAGES, states),
        "gate": Ring(STAGES, 1),
        "aux": Ring(STAGES, states),
    }
    agents = [iter(a) for a in _agents(nchunks, auxes, states, rings)]
    pending = [next(a, None) for a in agents]
    while any(p is not None for p in pending):
        moved = False
        for i, step in enumerate(pending):
            if step is not None and step[0]():
                step[1]()
                pending[i] = next(agents[i], None)
                moved = True
        assert moved, f"deadlock at {nchunks} chunks, V split {v_split}"
    for ring in rings.values():  # everything filled was consumed
        assert all(r == ring.consumers for r in ring.released)


def test_pipeline_state_advance_by_two_matches_one_by_one():
    for stages in (2, 3):
        one, two = (0, 0), (0, 0)
        for _ in range(12):
            one = advance(advance(one, 1, stages), 1, stages)
            two = advance(two, 2, stages)
            assert one == two


# ---------------------------------------------------------------- mbarrier parities
# The replay above waits on "the stage holds chunk c". The hardware waits on a parity: a
# consumer's wait for chunk c of a `stages`-deep ring passes once the stage's full barrier has
# completed a number of phases of the other parity than c // stages; PTX defines it only for
# the current or the preceding phase. Below, the same roles on barrier phase counts, with TMA
# boxes landing whenever the scheduler chooses (out of issue order): a wait that passes while
# its stage does not hold its chunk (a stale parity) fails the test.


class Barriers:
    """A ring's full and empty mbarriers as completed-phase counts, and the stages' chunks."""

    def __init__(self, stages: int, consumers: int):
        self.stages, self.consumers = stages, consumers
        self.full = [0] * stages
        self.empty = [0] * stages
        self.arrived = [0] * stages
        self.holds = [None] * stages

    def can_acquire(self, c: int) -> bool:  # producer_state: phase 1 first, empty parity wait
        s, lap = c % self.stages, c // self.stages
        return self.empty[s] % 2 != (lap % 2) ^ 1

    def fill(self, c: int) -> None:  # a commit, or a TMA box landing
        s = c % self.stages
        self.full[s] += 1
        self.holds[s] = c

    def can_wait(self, c: int) -> bool:
        return self.full[c % self.stages] % 2 != (c // self.stages) % 2

    def check(self, c: int, who: str) -> None:
        assert self.holds[c % self.stages] == c, f"{who} passed its wait for chunk {c} stale"

    def release(self, c: int) -> None:
        s = c % self.stages
        self.arrived[s] += 1
        if self.arrived[s] == self.consumers:
            self.arrived[s] = 0
            self.empty[s] += 1


def _parity_agents(nchunks, auxes, states, rings, in_flight, witness):
    """The kernel's waits and arrivals in program order (chunked_fwd.py `_produce`, `_gates`;
    aux_wy.py `_aux`; state_wg.py `_state`), each wait checked when it passes."""
    qk, v, gate, aux = rings["qk"], rings["v"], rings["gate"], rings["aux"]

    def wait(ring, c, who):
        return lambda: ring.can_wait(c), lambda: ring.check(c, who)

    def producer():
        for c in range(nchunks):
            yield lambda c=c: qk.can_acquire(c), lambda c=c: in_flight.append((qk, c))
            yield lambda c=c: v.can_acquire(c), lambda c=c: in_flight.append((v, c))

    def gates():
        for c in range(nchunks):
            yield lambda c=c: gate.can_acquire(c), lambda: None
            if witness:
                yield wait(qk, c, "gate warp")
            yield lambda: True, lambda c=c: gate.fill(c)

    def aux_wg(a):
        for c in range(a, nchunks, auxes):
            who = f"aux warpgroup {a}"
            if witness:
                yield wait(gate, c, who)
            yield wait(qk, c, who)
            if not witness:
                yield wait(gate, c, who)
            yield lambda: True, lambda c=c: qk.release(c)
            yield lambda c=c: aux.can_acquire(c), lambda c=c: (aux.fill(c), gate.release(c))

    def state_wg(w):
        for c in range(nchunks):
            who = f"state warpgroup {w}"
            yield wait(qk, c, who)
            yield wait(aux, c, who)
            yield wait(v, c, who)
            yield lambda: True, lambda c=c: v.release(c)
            yield lambda: True, lambda c=c: (qk.release(c), aux.release(c))

    return [producer(), gates(), *(aux_wg(a) for a in range(auxes)),
            *(state_wg(w) for w in range(states))]  # fmt: skip


def _run_parities(nchunks: int, v_split: int, witness: bool, newest_first: bool) -> None:
    """Step every agent that can move; only when none can, land one TMA box in flight (the
    newest first: landings as far out of issue order as the roles allow, or the oldest)."""
    auxes, states = aux_wgs(v_split), state_wgs(128, v_split)
    rings = {
        "qk": Barriers(QK_STAGES, 1 + states),
        "v": Barriers(V_STAGES, states),
        "gate": Barriers(STAGES, 1),
        "aux": Barriers(STAGES, states),
    }
    in_flight = []
    agents = [iter(a) for a in _parity_agents(nchunks, auxes, states, rings, in_flight, witness)]
    pending = [next(a, None) for a in agents]
    while any(p is not None for p in pending) or in_flight:
        moved = False
        for i, step in enumerate(pending):
            if step is not None and step[0]():
                step[1]()
                pending[i] = next(agents[i], None)
                moved = True
        if not moved:
            assert in_flight, f"deadlock at {nchunks} chunks, V split {v_split}"
            ring, c = in_flight.pop(-1 if newest_first else 0)
            ring.fill(c)


@pytest.mark.parametrize("newest_first", [True, False])
@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("nchunks", range(12))
def test_parity_waits_never_pass_stale(v_split, nchunks, newest_first):
    """The kernel's protocol (the gate warp's witness where `gate_warp_witnesses_qk` says)."""
    witness = gate_warp_witnesses_qk(aux_wgs(v_split))
    _run_parities(nchunks, v_split, witness, newest_first)


def test_two_aux_warpgroups_without_the_witness_pass_a_stale_parity():
    """Why the witness: with two aux warpgroups and an odd q / k ring, a box that lands after
    the next one lets the other aux warpgroup's wait three chunks on pass on the old phase."""
    with pytest.raises(AssertionError, match="aux warpgroup 1 passed its wait for chunk 3 stale"):
        _run_parities(6, 2, witness=False, newest_first=True)
    _run_parities(6, 1, witness=False, newest_first=True)  # one aux warpgroup: in order


# ---------------------------------------------------------------- the t_pre form
# The `t_pre` form (chunked_fwd.py `_produce_t`, aux_p.py, state_wg.py `_hand_o` / `_drain_o`)
# adds the T ring (warp T_WARP's TMA -> the state warpgroups, released after U^T) and the O
# ring (per state warpgroup two O tiles: full once its threads wrote one, empty once the O
# warp's TMA store has read it), and two reads that finish after the instruction issuing them:
# the state's V^T ldmatrix (until U^T's operand is built from their registers) and the O
# warp's TMA store (until its `wait_group.read`). Below, those reads finish only when nothing
# else can move, after every TMA box in flight has landed: a v box landing on a stage whose
# V^T reads are pending, or a state warpgroup rewriting a tile the store still reads, fails.


def _t_pre_agents(nchunks, auxes, states, rings, land, reads, *, v_after_u, store_read_wait):
    """The t_pre form's waits and arrivals in program order. v_after_u: the state releases
    its v stage after U^T (state_wg.py, o_warp), else next to its ldmatrix (the form before
    the fix); store_read_wait: the O warp releases a tile after its store's read."""
    qk, v, gate, aux, t = (rings[k] for k in ("qk", "v", "gate", "aux", "t"))
    o_ring = rings["o"]

    def wait(ring, c, who):
        return lambda: ring.can_wait(c), lambda: ring.check(c, who)

    def landing(ring, c, stage_reads=None):
        def act():
            if stage_reads is not None:
                pending = [r for r in reads if r[0] == stage_reads and r[1] % ring.stages
                           == c % ring.stages]  # fmt: skip
                assert not pending, f"{stage_reads} stage refilled for chunk {c} under {pending}"
            ring.fill(c)

        return act

    def producer():
        for c in range(nchunks):
            yield lambda c=c: qk.can_acquire(c), lambda c=c: land.append(landing(qk, c))
            yield lambda c=c: v.can_acquire(c), lambda c=c: land.append(landing(v, c, "vt"))

    def t_warp():
        for c in range(nchunks):
            yield lambda c=c: t.can_acquire(c), lambda c=c: land.append(landing(t, c))

    def gates():
        for c in range(nchunks):
            yield lambda c=c: gate.can_acquire(c), lambda: None
            if auxes > 1:
                yield wait(qk, c, "gate warp")
            yield lambda: True, lambda c=c: gate.fill(c)

    def aux_wg(a):
        for c in range(a, nchunks, auxes):
            who = f"aux warpgroup {a}"
            if auxes > 1:
                yield wait(gate, c, who)
            yield wait(qk, c, who)
            if auxes == 1:
                yield wait(gate, c, who)
            yield lambda: True, lambda c=c: qk.release(c)  # right after Q K^T (aux_p.py)
            yield lambda c=c: aux.can_acquire(c), lambda c=c: (aux.fill(c), gate.release(c))

    def state_wg(w):
        for c in range(nchunks):
            who = f"state warpgroup {w}"
            yield wait(qk, c, who)
            yield wait(aux, c, who)
            yield wait(v, c, who)
            yield lambda: True, lambda c=c: reads.append(("vt", c, w))  # 4 ldmatrix issued
            if not v_after_u:
                yield lambda: True, lambda c=c: v.release(c)
            yield wait(t, c, who)
            yield lambda c=c: ("vt", c, w) not in reads, lambda: None  # U^T's operand built
            yield lambda: True, lambda c=c: t.release(c)
            if v_after_u:
                yield lambda: True, lambda c=c: v.release(c)
            yield lambda: True, lambda c=c: (qk.release(c), aux.release(c))
            tile = o_ring[w]

            def write(c=c, w=w, tile=tile):
                busy = [r for r in reads if r[0] == "store" and r[2] == w and r[1] % 2 == c % 2]
                assert not busy, f"O tile of chunk {c} rewritten while {busy} reads it"
                tile.fill(c)

            yield lambda c=c, tile=tile: tile.can_acquire(c), write

    def o_warp():
        for c in range(nchunks):
            for w in range(states):
                yield wait(o_ring[w], c, "O warp")
                yield lambda: True, lambda c=c, w=w: reads.append(("store", c, w))
                if store_read_wait:
                    yield lambda c=c, w=w: ("store", c, w) not in reads, lambda: None
                yield lambda: True, lambda c=c, w=w: o_ring[w].release(c)

    return [producer(), t_warp(), gates(), o_warp(), *(aux_wg(a) for a in range(auxes)),
            *(state_wg(w) for w in range(states))]  # fmt: skip


def _run_t_pre(nchunks, v_split, *, v_after_u=True, store_read_wait=True, newest_first=True):
    """Step every agent that can move; when none can, land a TMA box, and only when none is
    in flight, finish a pending read (each the newest first, or the oldest)."""
    auxes, states = aux_wgs(v_split), state_wgs(128, v_split)
    rings = {
        "qk": Barriers(QK_STAGES, 1 + states),
        "v": Barriers(V_STAGES, states),
        "gate": Barriers(STAGES, 1),
        "aux": Barriers(STAGES, states),
        "t": Barriers(STAGES, states),
        "o": [Barriers(2, 1) for _ in range(states)],
    }
    land, reads = [], []
    agents = [iter(a) for a in _t_pre_agents(nchunks, auxes, states, rings, land, reads,
                                             v_after_u=v_after_u,
                                             store_read_wait=store_read_wait)]  # fmt: skip
    pending = [next(a, None) for a in agents]
    while any(p is not None for p in pending) or land or reads:
        moved = False
        for i, step in enumerate(pending):
            if step is not None and step[0]():
                step[1]()
                pending[i] = next(agents[i], None)
                moved = True
        if moved:
            continue
        if land:
            land.pop(-1 if newest_first else 0)()
        else:
            assert reads, f"deadlock at {nchunks} chunks, V split {v_split}"
            reads.pop(-1 if newest_first else 0)


@pytest.mark.parametrize("newest_first", [True, False])
@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("nchunks", range(9))
def test_t_pre_form_waits_never_pass_stale_and_no_read_is_overtaken(v_split, nchunks,
                                                                     newest_first):  # fmt: skip
    """The t_pre form's protocol: every wait names its chunk, no v box lands on V^T reads in
    flight, no O tile is rewritten under its store's read."""
    _run_t_pre(nchunks, v_split, newest_first=newest_first)


@pytest.mark.parametrize("v_split", [1, 2])
def test_t_pre_form_v_released_at_its_ldmatrix_lets_a_box_land_under_the_reads(v_split):
    """Why state_wg.py releases the v stage after U^T in the t_pre form: released where the
    ldmatrix were issued (before the fix; ptxas put the arrive right behind them, 3 of 4 in
    flight), the producer's next box into the stage may land before they have read it,
    unless the hardware orders the two (the ordering this model does not assume)."""
    with pytest.raises(AssertionError, match="vt stage refilled"):
        _run_t_pre(4, v_split, v_after_u=False)


def test_t_pre_form_o_tile_released_before_its_store_read_is_rewritten_under_it():
    """The O warp's `wait_group.read` before the tile's empty arrive is what keeps the state
    warpgroup's next stmatrix off a tile the TMA store still reads."""
    with pytest.raises(AssertionError, match="rewritten while"):
        _run_t_pre(4, 2, store_read_wait=False)
