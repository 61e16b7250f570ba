"""Recorded tuning winners: one JSON table per kernel, consulted before the analytical default.

Tuning is opt-in (`forgekernel.tune_gemm`); a call never tunes on its own. The table lives at
$FORGEKERNEL_TUNING_DIR/<kernel>.json (default: the user cache), keyed by the problem's
baked-in and shape parts, and can be committed or shipped like any other data file.
"""

from __future__ import annotations

import functools
import json
import os
from pathlib import Path
from typing import Any


def tuning_dir() -> Path:
    env = os.environ.get("FORGEKERNEL_TUNING_DIR")
    return Path(env) if env else Path.home() / ".cache" / "forgekernel" / "tuning"


@functools.cache
def load(kernel: str) -> dict[str, Any]:
    path = tuning_dir() / f"{kernel}.json"
    return json.loads(path.read_text()) if path.is_file() else {}


def record(kernel: str, key: str, value: dict[str, Any]) -> Path:
    """Store a winner (atomically) and make later lookups in this process see it."""
    table = dict(load(kernel))
    table[key] = value
    path = tuning_dir() / f"{kernel}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True))
    os.replace(tmp, path)
    load.cache_clear()
    return path
