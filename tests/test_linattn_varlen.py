"""The varlen buckets of the linear-attention backwards' kernel paths (ops/_linattn_varlen.py):
the grouping's invariants and the padding / scatter round trip."""

from __future__ import annotations

import random

import pytest
import torch

from forgekernel.ops import _linattn_varlen as varlen


def _check(lens, groups, waste=varlen.WASTE):
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        widths = [varlen.chunks(lens[i]) for i in g]
        assert widths == sorted(widths, reverse=True)
        assert len(g) * widths[0] <= waste * sum(widths)
        assert widths[-1] * varlen.SPREAD >= widths[0]


@pytest.mark.parametrize("seed", range(6))
def test_buckets_hold_their_waste(seed):
    rnd = random.Random(seed)
    lens = [rnd.choice([0, 1, 7, 63, 64, 65, 300, 2048, 9000]) for _ in range(rnd.randint(1, 70))]
    _check(lens, varlen.buckets(lens))


def test_buckets_of_the_suites_forms():
    assert varlen.buckets([70, 70, 70]) == [[0, 1, 2]]
    assert varlen.buckets([600] + [1] * 10) == [[0], list(range(1, 11))]  # one long, many short
    assert len(varlen.buckets([64 * 2**i for i in range(9)])) == 5  # doublings: in pairs
    assert len(varlen.buckets([0, 0, 1])) == 1  # empty sequences pad to one chunk
    # two long sequences' slack does not take a short one (the suites' mix64 before SPREAD)
    assert varlen.buckets([12297, 12296, 141, 130]) == [[0, 1], [2, 3]]


def test_padding_round_trip():
    """A `run` that hands back its padded inputs and states: every caller's row and sequence
    comes back in place; the padding rows are zero."""
    lens = [5, 0, 130, 64, 1, 66]
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    x = torch.randn(edges[-1], 3)
    y = torch.randn(edges[-1], 2).bfloat16()
    do = torch.randn(edges[-1], 3)
    state = torch.randn(len(lens), 4)
    seen = []

    def run(x, y, do, state, n):
        seen.append(n)
        assert x.shape[0] % n == 0 and state.shape[0] == n
        t = x.shape[0] // n
        pad = x.reshape(n, t, 3)
        # the padding: exactly the rows past each sequence's length are zero
        assert int((pad.abs().sum(-1) == 0).sum()) >= n * t - int(do.abs().sum(-1).ne(0).sum())
        return x, y, state * 2

    gx, gy, gs = varlen.run_in_buckets(run, (x, y, do), (state,), edges)
    assert sum(seen) == len(lens) and len(seen) == len(varlen.buckets(lens))
    assert torch.equal(gx, x) and torch.equal(gy, y) and gy.dtype == y.dtype
    assert torch.equal(gs, state * 2)


def test_a_missing_state_stays_none():
    edges = [0, 3, 10]
    x = torch.randn(10, 2)

    def run(x, do, state, n, out=None):
        assert state is None
        return x, torch.zeros(n, 1)

    gx, gs = varlen.run_in_buckets(run, (x, x), (None,), edges)
    assert torch.equal(gx, x) and gs.shape == (2, 1)


def test_backward_varlen_routes():
    """Equal lengths: one call on the tokens as they are (no copy); no token: None (the
    caller's interim path); unequal: the buckets."""
    x = torch.randn(12, 2)
    calls = []

    def run(x, do, state, n, out=None):
        calls.append((x.data_ptr(), n))
        return x, torch.zeros(n, 1)

    equal = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    gx, gs = varlen.backward_varlen(run, (x, x), (None,), equal)
    assert calls == [(x.data_ptr(), 3)] and gx is x and gs.shape == (3, 1)
    assert varlen.backward_varlen(run, (x[:0], x[:0]), (None,), torch.zeros(3)) is None
    calls.clear()
    gx, _ = varlen.backward_varlen(run, (x, x), (None,), torch.tensor([0, 1, 12]))
    assert torch.equal(gx, x) and len(calls) == len(varlen.buckets([1, 11]))
