"""The compile-cache / ledger key (CPU only): which files it covers, what moves it, and how the
kernel leaves are found."""

from __future__ import annotations

import shutil
import sys
import textwrap
from pathlib import Path

import pytest

from forgekernel.runtime import build, hashing
from forgekernel.runtime.hashing import PACKAGE_ROOT, source_hash
from forgekernel.runtime.sources import import_closure
from forgekernel.runtime.spec import all_specs

CODE = '''
"""Module docstring."""
import math


class Tile:
    """Class docstring."""

    size = 128  # a comment

    def area(self):
        """Method docstring."""
        return self.size * f"{math.pi:{self.size}}"
'''


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text))
    return path


def test_docstring_and_comment_edits_keep_the_hash(tmp_path):
    path = _write(tmp_path / "kernel.py", CODE)
    before = source_hash([path])
    edited = CODE.replace("Class docstring.", "Reworded, with a figure: 612 TFLOP/s.")
    edited = edited.replace("# a comment", "# another comment\n    # and one more line")
    _write(path, edited.replace('"""Module docstring."""', "# header\n\n"))
    assert source_hash([path]) == before
    _write(path, CODE.replace("size = 128", "size = 64"))
    assert source_hash([path]) != before
    _write(path, CODE.replace('f"{math.pi:', 'f"{math.e:'))
    assert source_hash([path]) != before


def _tree(root: Path) -> dict[str, Path]:
    """Two leaves under root/forgekernel/kernels: `a` imports the shared module `common.shared`
    (absolute, from its kernel.py), `b` imports `common.other` (relative, function-local); `a`'s
    host launcher imports `common.other` too."""
    k = root / "forgekernel" / "kernels"
    for pkg in ("", "common", "fam", "fam/a", "fam/b"):
        _write(k / pkg / "__init__.py", "")
    files = {
        "shared": _write(k / "common/shared.py", '"""Shared."""\nSCALE = 2\n'),
        "other": _write(k / "common/other.py", "OFFSET = 1\n"),
        "a_init": _write(k / "fam/a/__init__.py", "SPEC = None\n"),
        "a_compile": _write(
            k / "fam/a/compile.py",
            "import torch\nimport forgekernel.runtime.cache\nfrom .kernel import Kernel\n",
        ),
        "a_kernel": _write(
            k / "fam/a/kernel.py",
            "from forgekernel.kernels.common import shared\n\nclass Kernel:\n    s = shared\n",
        ),
        "a_launch": _write(
            k / "fam/a/launch.py", "from forgekernel.kernels.common.other import *\n"
        ),
        "b_compile": _write(
            k / "fam/b/compile.py", "def compile():\n    from ...common.other import OFFSET\n"
        ),
    }
    return files


def _hashes(root: Path, entries: dict[str, Path]) -> dict[str, str]:
    closures = {leaf: import_closure(entry, root) for leaf, entry in entries.items()}
    return _hash_closures(root, closures)


def _hash_closures(root: Path, closures: dict[str, list[Path]]) -> dict[str, str]:
    by_files = {tuple(files): "" for files in closures.values()}  # kernels of one leaf share
    for files in by_files:
        by_files[files] = source_hash(files, root / "forgekernel")
    return {leaf: by_files[tuple(files)] for leaf, files in closures.items()}


def test_closure_follows_the_device_code_only(tmp_path):
    f = _tree(tmp_path)
    assert import_closure(f["a_compile"], tmp_path) == sorted(
        [f["a_compile"], f["a_kernel"], f["shared"]]
    )
    assert import_closure(f["b_compile"], tmp_path) == sorted([f["b_compile"], f["other"]])


def test_a_common_edit_moves_exactly_the_leaves_that_import_it(tmp_path):
    f = _tree(tmp_path)
    entries = {"a": f["a_compile"], "b": f["b_compile"]}
    before = _hashes(tmp_path, entries)
    f["shared"].write_text('"""Shared, reworded."""\n# a note\nSCALE = 2\n')
    f["a_launch"].write_text("X = 1\n")  # host-only code is not in the key
    assert _hashes(tmp_path, entries) == before
    f["shared"].write_text("SCALE = 3\n")
    after = _hashes(tmp_path, entries)
    assert after["a"] != before["a"] and after["b"] == before["b"]


def test_an_import_of_a_missing_kernel_module_raises(tmp_path):
    f = _tree(tmp_path)
    f["a_kernel"].write_text("from forgekernel.kernels.common.gone import X\n")
    with pytest.raises(ImportError, match="common.gone"):
        import_closure(f["a_compile"], tmp_path)


def test_real_leaves_sources_and_common_edits(tmp_path, monkeypatch):
    """On a copy of the real tree: each kernel's sources are its device code, and a code edit in
    any shared module moves the hash of exactly the kernels whose device code imports it.
    (Each file's fingerprint is computed once per content: the edits rehash every kernel, and
    parsing the unchanged files again took 30 s of CI's CPU.)"""
    fingerprint, seen = hashing.code_fingerprint, {}

    def once_per_content(path: Path) -> bytes:
        key = (path.suffix, path.read_bytes())
        if key not in seen:
            seen[key] = fingerprint(path)
        return seen[key]

    monkeypatch.setattr(hashing, "code_fingerprint", once_per_content)
    specs = all_specs()
    kernels = PACKAGE_ROOT / "kernels"
    copy = tmp_path / "forgekernel" / "kernels"
    shutil.copytree(kernels, copy, ignore=shutil.ignore_patterns("__pycache__"))
    entries = {s.name: copy / s.entry_module.relative_to(kernels) for s in specs}
    for spec in specs:
        assert all(p.is_relative_to(kernels) and p.name != "launch.py" for p in spec.sources)
        assert (
            spec.entry_module in spec.sources and spec.directory / "__init__.py" not in spec.sources
        )
    closures = {leaf: import_closure(entry, tmp_path) for leaf, entry in entries.items()}
    before = _hash_closures(tmp_path, closures)
    assert before == {s.name: source_hash(s.sources) for s in specs}
    for module in sorted((copy / "common").rglob("*.py")):
        original = module.read_text()
        module.write_text(_reworded(original))
        assert _hash_closures(tmp_path, closures) == before, module
        module.write_text(f"{original}\n_EDITED = 1\n")
        moved = {n for n, h in _hash_closures(tmp_path, closures).items() if h != before[n]}
        importers = {s.name for s in specs if kernels / module.relative_to(copy) in s.sources}
        assert moved == importers, module
        module.write_text(original)


def _reworded(source: str) -> str:
    """The same code with its module docstring reworded and comments added."""
    if source.lstrip().startswith('"""'):
        source = source.replace('"""', '"""Reworded. ', 1)
    else:
        source = f'"""A new docstring."""\n{source}'
    return f"# a comment\n{source}\n# trailing note\n"


def test_all_specs_in_path_order_with_unique_names():
    specs = all_specs()
    names = [s.name for s in specs]
    assert len(set(names)) == len(names)
    assert [s.directory for s in specs] == sorted(s.directory for s in specs)
    assert {"gemm_dense_sm90", "attention_fwd_sm90", "attention_bwd_sm90"} <= set(names)
    for spec in specs:
        assert spec.representative_params() in spec.standard_params()


SPEC_INIT = """
from pathlib import Path
from forgekernel.runtime.spec import KernelSpec

SPEC = KernelSpec(name="{name}", arch="sm_90a", directory=Path(__file__).parent,
                  compile=None, standard_params=tuple)
"""


@pytest.fixture
def fake_kernels(tmp_path, monkeypatch):
    """A package `fake_kernels_<n>` on sys.path to lay leaves into; returns (name, folder)."""
    name = f"fake_kernels_{tmp_path.name.replace('-', '_')}"
    root = tmp_path / name
    _write(root / "__init__.py", "")
    _write(root / "common" / "__init__.py", "raise RuntimeError('never imported')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name, root
    for mod in [m for m in sys.modules if m.startswith(name)]:
        del sys.modules[mod]


def test_discovery_finds_leaves_and_imports_nothing_else(fake_kernels):
    name, root = fake_kernels
    _write(root / "y" / "sm90" / "__init__.py", SPEC_INIT.format(name="y_sm90"))
    _write(root / "x" / "__init__.py", "")
    _write(root / "x" / "sm90" / "__init__.py", SPEC_INIT.format(name="x_sm90"))
    assert [s.name for s in all_specs(name)] == ["x_sm90", "y_sm90"]


def test_a_leaf_that_fails_to_import_raises(fake_kernels):
    name, root = fake_kernels
    _write(root / "x" / "sm90" / "__init__.py", "SPEC = None\nraise ImportError('broken leaf')\n")
    with pytest.raises(ImportError, match="broken leaf"):
        all_specs(name)


def test_a_leaf_without_spec_or_a_duplicate_name_raises(fake_kernels):
    name, root = fake_kernels
    _write(root / "x" / "sm90" / "__init__.py", "")
    _write(root / "x" / "sm90" / "compile.py", "")
    with pytest.raises(LookupError, match="SPEC or SPECS"):
        all_specs(name)
    _write(root / "x" / "sm90" / "__init__.py", SPEC_INIT.format(name="same"))
    _write(root / "y" / "sm90" / "__init__.py", SPEC_INIT.format(name="same"))
    for mod in [m for m in sys.modules if m.startswith(name + ".")]:
        del sys.modules[mod]
    with pytest.raises(ValueError, match="same"):
        all_specs(name)


def test_a_repeated_configuration_compiles_once(monkeypatch, tmp_path):
    tasks = [("k", (("t", 1),)), ("k", (("t", 2),)), ("k", (("t", 1),))]
    compiled = []

    def fake_run(unique, target, jobs):
        compiled.extend(unique)
        return [{"name": n, "params": dict(p), "compile_s": 5.0} for n, p in unique]

    monkeypatch.setattr(build, "build_tasks", lambda *a: tasks)
    monkeypatch.setattr(build, "_run", fake_run)
    records = build.build_all("sm_90a", tmp_path, jobs=2)
    assert compiled == tasks[:2]
    assert [r["params"]["t"] for r in records] == [1, 2, 1]
    assert [r["compile_s"] for r in records] == [5.0, 5.0, 0.0]
