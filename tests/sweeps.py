"""The `slow` marker on a sweep's parametrization (pyproject.toml's markers): the representative
case stays in CI's run, the family's further configurations are marked slow (CI runs
`-m "not slow"`; `-m slow` runs them before landing a kernel change)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import pytest


def slow_past(cases: Iterable, keep=None, *, unpack: bool = False, ids: Sequence | None = None):
    """`cases` for parametrize: `keep` (the first case when None) as it is, every other one a
    pytest.param marked slow; `unpack` for several argnames (each case a tuple of values),
    `ids` the cases' ids in order."""
    cases = list(cases)
    keep = cases[0] if keep is None else keep
    assert keep in cases, keep
    out = []
    for i, case in enumerate(cases):
        values = tuple(case) if unpack else (case,)
        marks = () if case == keep else (pytest.mark.slow,)
        out.append(pytest.param(*values, marks=marks, id=None if ids is None else ids[i]))
    return out
