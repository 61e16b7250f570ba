"""The one content hash: compile-cache keys and ledger records both use it."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]


def source_hash(paths: Iterable[Path]) -> str:
    """sha256 (16 hex digits) over the files' package-relative names and bytes, order-free."""
    h = hashlib.sha256()
    for p in sorted(Path(p).resolve() for p in paths):
        try:
            name = p.relative_to(PACKAGE_ROOT).as_posix()
        except ValueError:
            name = p.name
        h.update(name.encode())
        h.update(b"\0")
        h.update(p.read_bytes())
        h.update(b"\0")
    return h.hexdigest()[:16]


def key_hash(*parts: object) -> str:
    """Short stable hash of a compile key's printable parts."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
