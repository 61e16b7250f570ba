"""The layers, read from the source like an import linter (nothing is imported): every import
of every module under forgekernel/, function-local ones included, and module names passed as
strings to importlib.

    ops      torch API: validation, custom ops, autograd   -> kernels, runtime
    bench    check / bench / ledger                        -> ops, kernels, runtime
    kernels  leaves (device code, config, launch.py)       -> runtime, the toolkit
    runtime  compile cache, build, timing, device          -> no leaf by name

Nothing under kernels/ imports ops or bench; nothing under ops/ imports bench; runtime imports
neither, and names no kernel leaf (the leaves are found on disk). The public API imports no
DSL module at import time, so `import forgekernel` works where the DSL is not installed.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path

import pytest

import forgekernel
from forgekernel.runtime.spec import leaf_packages

PACKAGE_DIR = Path(forgekernel.__file__).resolve().parent
ROOT = PACKAGE_DIR.parent
# Calls whose first argument, a string constant, names a module.
IMPORTING_CALLS = {"import_module", "find_spec", "__import__"}
TOOLKIT = "forgekernel.kernels.common"


@dataclass(frozen=True)
class Import:
    module: str  # the importing module
    target: str  # the imported module, absolute
    line: int
    lazy: bool  # inside a function body (runs on call, not at import)

    def __str__(self) -> str:
        return f"{self.module}:{self.line} imports {self.target}"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    base = ROOT.joinpath(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _from_target(base: str, name: str) -> str:
    """`from base import name`: the submodule when `name` is one; from the root package any
    other name is its public API, which is `forgekernel.ops`."""
    if is_module(f"{base}.{name}"):
        return f"{base}.{name}"
    return "forgekernel.ops" if base == "forgekernel" else base


def imports_of(source: str, module: str, is_package: bool = False) -> list[Import]:
    """Every module `source` (the text of `module`) imports, with the line and whether the
    import runs only when a function is called."""
    package = module if is_package else module.rpartition(".")[0]
    found: list[Import] = []

    def visit(node: ast.AST, lazy: bool) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = "forgekernel.ops" if alias.name == "forgekernel" else alias.name
                found.append(Import(module, target, node.lineno, lazy))
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(parts + ([node.module] if node.module else []))
            for alias in node.names:
                found.append(Import(module, _from_target(base, alias.name), node.lineno, lazy))
        elif isinstance(node, ast.Call) and _called_name(node.func) in IMPORTING_CALLS:
            arg = node.args[0] if node.args else None
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                found.append(Import(module, arg.value, node.lineno, lazy))
        inner = lazy or isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
        for child in ast.iter_child_nodes(node):
            visit(child, inner)

    visit(ast.parse(source), False)
    return found


def _called_name(func: ast.expr) -> str:
    if isinstance(func, ast.Attribute):
        return func.attr
    return func.id if isinstance(func, ast.Name) else ""


@functools.cache
def package_imports() -> tuple[Import, ...]:
    """Every import of the package's modules (parsed once a process, when a test first asks:
    ~1.7 s of CI's CPU that each worker paid collecting this module)."""
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        found += imports_of(path.read_text(), module_name(path), path.name == "__init__.py")
    return tuple(found)


def under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def violations(importer: str, forbidden: tuple[str, ...]) -> list[str]:
    return sorted(
        {
            str(i)
            for i in package_imports()
            if under(i.module, importer) and any(under(i.target, f) for f in forbidden)
        }
    )


@pytest.mark.parametrize(
    "importer, forbidden",
    [
        ("forgekernel.kernels", ("forgekernel.ops", "forgekernel.bench", "forgekernel.cli")),
        ("forgekernel.ops", ("forgekernel.bench", "forgekernel.cli")),
        ("forgekernel.runtime", ("forgekernel.ops", "forgekernel.bench", "forgekernel.cli")),
    ],
)
def test_no_layer_imports_one_above_it(importer, forbidden):
    assert violations(importer, forbidden) == []


def test_runtime_names_no_kernel_leaf():
    """Imports and module names in strings alike: runtime finds the leaves on disk."""
    named = [
        str(i)
        for i in package_imports()
        if under(i.module, "forgekernel.runtime")
        and under(i.target, "forgekernel.kernels")
        and i.target != "forgekernel.kernels"
        and not under(i.target, TOOLKIT)
    ]
    for path in sorted((PACKAGE_DIR / "runtime").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                name = node.value
                if under(name, "forgekernel.kernels") and name != "forgekernel.kernels":
                    named += [] if under(name, TOOLKIT) else [f"{path.name}: {name!r}"]
    assert named == []


def test_every_leaf_launches_from_its_launch_py():
    """One kind of place for every host launcher: each leaf (as runtime finds them) has
    launch.py, and ops reaches a leaf only through it, its DSL-free declaration and config."""
    leaves = [Path(leaf.__file__).parent for leaf in leaf_packages()]
    assert len(leaves) >= 3
    assert [leaf for leaf in leaves if not (leaf / "launch.py").is_file()] == []
    leaf_names = [module_name(leaf / "__init__.py") for leaf in leaves]
    allowed = ("", ".launch", ".config")
    reached = [
        str(i)
        for i in package_imports()
        if under(i.module, "forgekernel.ops")
        for leaf in leaf_names
        if under(i.target, leaf) and i.target not in {leaf + a for a in allowed}
    ]
    assert reached == []


def test_import_forgekernel_needs_no_dsl():
    """The modules `import forgekernel` runs (imports at module level, transitively) import no
    DSL module: kernels compile lazily, launchers are torch only."""
    top_level: dict[str, list[Import]] = {}
    for i in package_imports():
        if not i.lazy:
            top_level.setdefault(i.module, []).append(i)
    seen, todo, dsl = set(), ["forgekernel"], []
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        for i in top_level.get(module, []):
            if under(i.target, "cutlass"):
                dsl.append(str(i))
            elif under(i.target, "forgekernel"):
                # importing a submodule runs its parent packages' __init__ too
                parts = i.target.split(".")
                todo += [".".join(parts[:n]) for n in range(1, len(parts) + 1)]
    assert "forgekernel.ops" in seen and "forgekernel.runtime.device" in seen
    assert dsl == []


def test_the_reader_sees_every_kind_of_import():
    source = """
import forgekernel.bench.harness as h
from forgekernel import ops, gemm
from ...ops import _validate
from . import config
import importlib

def lazy():
    from forgekernel.bench.timing import median
    importlib.import_module("forgekernel.bench.report")
"""
    got = imports_of(source, "forgekernel.kernels.gemm.dense.sm90.launch")
    assert [(i.target, i.lazy) for i in got] == [
        ("forgekernel.bench.harness", False),
        ("forgekernel.ops", False),
        ("forgekernel.ops", False),  # the root package's public API is ops
        ("forgekernel.kernels.gemm.ops", False),  # three dots: gemm.dense.sm90 -> gemm
        ("forgekernel.kernels.gemm.dense.sm90.config", False),
        ("importlib", False),
        ("forgekernel.bench.timing", True),
        ("forgekernel.bench.report", True),
    ]
