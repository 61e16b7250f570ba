"""The launchers' per-problem plans (config, compile keys, workspace layout), chosen once."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from contextlib import contextmanager
from typing import Any


class PlanCache(dict):
    """Problem key -> plan, built by `build(*key)` on first use; a lookup costs 0.1 us where
    choosing a config and its compile keys costs ~10 us per call on the CPU. Cleared when it
    grows past `max_entries` (a server's ever-changing lengths)."""

    def __init__(self, max_entries: int = 4096):
        super().__init__()
        self.max_entries = max_entries

    def get_or_build(self, key: Hashable, build: Callable[..., Any]) -> Any:
        plan = self.get(key)
        if plan is None:
            if len(self) >= self.max_entries:
                self.clear()
            plan = self[key] = build(*key)
        return plan


@contextmanager
def overriding(slot: list, value: Any) -> Iterator[None]:
    """slot[0] is `value` inside, what it was after: the launchers' and ops' overrides of a
    plan choice (a one-item list their plan builders read, and their plans' keys: the bench's
    launcher-only variants)."""
    before, slot[0] = slot[0], value
    try:
        yield
    finally:
        slot[0] = before
