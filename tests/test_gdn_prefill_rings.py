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
