"""A kernel's device code: its entry module and, transitively, every `forgekernel.kernels`
module it imports. This list is what the compile-cache and ledger key hash, the same way for
every leaf; host-only files (the leaf's `__init__.py`, its launcher) stay out unless the device
code imports them, and `runtime`, `ops` and `bench` are never followed.

Imports are read with `ast`, nothing is imported: absolute and relative imports, anywhere in the
module (function-local ones too), and `from package import name` where `name` may be a
submodule. Importing a submodule runs its parents' `__init__.py`, but those are declarations
(the leaf's SPEC) or docstrings; one that holds device code is hashed once something imports
a name from it.
"""

from __future__ import annotations

import ast
from pathlib import Path

from forgekernel.runtime.hashing import PACKAGE_ROOT

KERNELS_PACKAGE = "forgekernel.kernels"


def import_closure(entry: Path, root: Path = PACKAGE_ROOT.parent) -> list[Path]:
    """`entry` and the kernel modules it imports, transitively, sorted; `root` holds the
    `forgekernel` package."""
    root = root.resolve()
    seen: set[Path] = set()
    todo = [Path(entry).resolve()]
    while todo:
        path = todo.pop()
        if path not in seen:
            seen.add(path)
            todo += imported_kernel_modules(path, root)
    return sorted(seen)


def imported_kernel_modules(path: Path, root: Path = PACKAGE_ROOT.parent) -> list[Path]:
    """The files of the `forgekernel.kernels` modules that `path` imports (one level)."""
    module = module_name(path, root)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_bytes(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if _is_kernel_module(alias.name)]
            found += [_require(name, root, path) for name in names]
        elif isinstance(node, ast.ImportFrom):
            base = _absolute(node, package)
            if _is_kernel_module(base):
                found += _from_import(base, [alias.name for alias in node.names], root, path)
    return found


def module_name(path: Path, root: Path) -> str:
    parts = list(path.resolve().relative_to(root).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _is_kernel_module(name: str) -> bool:
    return name == KERNELS_PACKAGE or name.startswith(KERNELS_PACKAGE + ".")


def _absolute(node: ast.ImportFrom, package: str) -> str:
    if node.level == 0:
        return node.module or ""
    parts = package.split(".")
    base = ".".join(parts[: len(parts) - (node.level - 1)])
    return f"{base}.{node.module}" if node.module else base


def _from_import(base: str, names: list[str], root: Path, importer: Path) -> list[Path]:
    """`from base import a, b`: each name that is a submodule is that module, any other name
    (or `*`) comes from `base` itself."""
    found = []
    for name in names:
        sub = _module_file(f"{base}.{name}", root) if name != "*" else None
        found.append(sub or _require(base, root, importer))
    return found


def _require(name: str, root: Path, importer: Path) -> Path:
    path = _module_file(name, root)
    if path is None:
        raise ImportError(f"{importer}: imports {name}, which is not a module under {root}")
    return path


def _module_file(name: str, root: Path) -> Path | None:
    base = root.joinpath(*name.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None
