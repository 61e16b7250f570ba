"""The one content hash: compile-cache keys and ledger records both use it.

A Python source is hashed by its syntax tree with the docstrings removed, so an edit to a comment
or a docstring keeps the key (and the GPU record behind it) while any code change moves it. The
tree is written out field by field, leaving out empty fields and the empty string parts of
f-strings (`ast.dump` differs between Python versions: 3.12 adds `type_params=[]` and a trailing
'' to nested format specs, 3.13 drops empty fields), so that CI's Python and the GPU host's give
the same hash (checked on 3.10 to 3.13). Other files are hashed by their bytes.
"""

from __future__ import annotations

import ast
import hashlib
from collections.abc import Iterable
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1]
_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def source_hash(paths: Iterable[Path], root: Path = PACKAGE_ROOT) -> str:
    """sha256 (16 hex digits) over the files' `root`-relative names and code, order-free."""
    h = hashlib.sha256()
    for p in sorted(Path(p).resolve() for p in paths):
        try:
            name = p.relative_to(root).as_posix()
        except ValueError:
            name = p.name
        h.update(name.encode())
        h.update(b"\0")
        h.update(code_fingerprint(p))
        h.update(b"\0")
    return h.hexdigest()[:16]


def code_fingerprint(path: Path) -> bytes:
    """What of a file decides the compiled code: a .py file's docstring-free syntax tree, any
    other file's bytes."""
    if path.suffix != ".py":
        return path.read_bytes()
    tree = ast.parse(path.read_bytes(), filename=str(path))
    return _canonical(_normalize(tree)).encode()


def _normalize(tree: ast.AST) -> ast.AST:
    """Docstrings out; f-strings without their empty parts (present or not by Python version)."""
    for node in ast.walk(tree):
        if isinstance(node, _DOCUMENTED) and _is_docstring(node.body[0] if node.body else None):
            node.body = node.body[1:] or [ast.Pass()]
        elif isinstance(node, ast.JoinedStr):
            node.values = [v for v in node.values if not _is_empty_str(v)]
    return tree


def _is_empty_str(node: ast.AST) -> bool:
    return isinstance(node, ast.Constant) and node.value == ""


def _is_docstring(stmt: ast.stmt | None) -> bool:
    return (
        isinstance(stmt, ast.Expr)
        and isinstance(stmt.value, ast.Constant)
        and isinstance(stmt.value.value, str)
    )


def _canonical(node: object) -> str:
    """Node type and non-empty fields, recursively; positions (line numbers) never enter."""
    if isinstance(node, ast.AST):
        fields = []
        for name in node._fields:
            value = getattr(node, name, None)
            if value is None or (isinstance(value, list) and not value):
                continue
            fields.append(f"{name}={_canonical(value)}")
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(x) for x in node) + "]"
    return repr(node)


def key_hash(*parts: object) -> str:
    """Short stable hash of a compile key's printable parts."""
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
