"""The GPU tests (tests/gpu/, skipped on CPU machines) read their suites' fields right: every
`NAME.attr` where NAME is bound to an `OpSuite` (`... = x.suite()` in the module, or imported
from a tests/gpu helper that binds it so) names a field or method of OpSuite. A misspelt
attribute otherwise surfaces only on the GPU host (2026-12-07 14:47: `makeinputs_for`, three
grouped FP8 cases lost for a device session)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from forgekernel.bench.suite import OpSuite

GPU_TESTS = Path(__file__).parent / "gpu"


def _suite_names(tree: ast.Module) -> set[str]:
    """Module-level names bound to a `.suite()` / `suite()` call."""
    found = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and isinstance(node.value, ast.Call):
            func = node.value.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
            if name == "suite":
                found |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    return found


def _trees() -> dict[str, ast.Module]:
    return {p.stem: ast.parse(p.read_text(), filename=str(p)) for p in GPU_TESTS.glob("*.py")}


TREES = _trees()


@pytest.mark.parametrize("module", sorted(TREES))
def test_suite_attributes_exist(module):
    tree = TREES[module]
    names = _suite_names(tree)
    for node in tree.body:  # names imported from a tests/gpu helper module
        if isinstance(node, ast.ImportFrom) and node.module in TREES and node.level == 0:
            helper = _suite_names(TREES[node.module])
            names |= {a.asname or a.name for a in node.names if a.name in helper}
    fields = set(OpSuite.__dataclass_fields__) | set(dir(OpSuite))
    bad = [
        f"{node.value.id}.{node.attr} (line {node.lineno})"
        for node in ast.walk(tree)
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id in names
        and node.attr not in fields
    ]
    assert not bad, bad
