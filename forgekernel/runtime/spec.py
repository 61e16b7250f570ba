"""What a kernel leaf declares, and where the leaves are found; importable without the DSL.

A leaf is a package under `forgekernel/kernels/` whose `__init__.py` (DSL-free) binds `SPEC`
(one KernelSpec) or `SPECS` (a list), or that holds the default device-code entry `compile.py`.
`all_specs()` finds them by walking the folders, so this module names no kernel.
"""

from __future__ import annotations

import ast
import functools
import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from forgekernel.runtime.hashing import source_hash
from forgekernel.runtime.sources import KERNELS_PACKAGE, import_closure

Params = tuple[tuple[str, Any], ...]
DECLARED = ("SPEC", "SPECS")


@dataclass(frozen=True)
class KernelSpec:
    """One kernel of a leaf: `kernels/<family>/<operator>/<arch>/`.

    name: unique, used in file and symbol names.
    directory: the leaf.
    compile: (params, extra_options) -> a `cute.compile`d TVM-FFI function for `arch`; imports
        the DSL lazily; extra_options are DSL compile flags (e.g. --keep-cubin --dump-dir D).
    standard_params: the configurations `forgekernel build` compiles ahead of time.
    candidate_params: further configurations for tuning sweeps (`build --candidates`).
    mma: the kernel's work is matrix multiplies, so its SASS must use HGMMA (False for
        element-wise helpers such as the attention backward's pre- and postprocessing).
    entry: the module `compile` imports the device code from (default: `directory/compile.py`);
        it and the kernel modules it imports are the sources (hash = cache and ledger key).
    representative: the one configuration the tests build to prove the kernel (default: the
        first standard one).
    """

    name: str
    arch: str
    directory: Path
    compile: Callable[[Params, str], Any]
    standard_params: Callable[[], Sequence[Params]]
    candidate_params: Callable[[], Sequence[Params]] = tuple
    mma: bool = True
    entry: Path | None = None
    representative: Callable[[], Params] | None = None

    @property
    def entry_module(self) -> Path:
        return self.entry or self.directory / "compile.py"

    @functools.cached_property
    def sources(self) -> tuple[Path, ...]:
        """The device code: the entry module and the kernel modules it imports, transitively."""
        return tuple(import_closure(self.entry_module))

    @functools.cached_property
    def source_hash(self) -> str:
        return source_hash(self.sources)

    def representative_params(self) -> Params:
        return self.representative() if self.representative else self.standard_params()[0]


def all_specs(package: str = KERNELS_PACKAGE) -> list[KernelSpec]:
    """Every kernel of every leaf under `package`, in the leaves' path order (each leaf's own
    order within it). A leaf that fails to import raises; so do two kernels of one name."""
    specs = [spec for leaf in leaf_packages(package) for spec in _declared(leaf)]
    names = [spec.name for spec in specs]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"kernel names declared more than once: {', '.join(dupes)}")
    return specs


def leaf_packages(package: str = KERNELS_PACKAGE) -> list[ModuleType]:
    """The leaf packages under `package`, imported (only the leaves: the other packages, such as
    the shared toolkit, are read, never imported)."""
    root = importlib.import_module(package)
    return [importlib.import_module(name) for name in _leaf_names(root.__path__, package)]


def _leaf_names(paths: Sequence[str], prefix: str) -> list[str]:
    """Module names of the leaves under the folders `paths`, walked on disk: a folder that lacks
    its `__init__.py` is still walked, so a leaf there fails to import instead of going unseen."""
    names = []
    for folder in sorted(p for path in paths for p in Path(path).iterdir() if _is_package(p)):
        name = f"{prefix}.{folder.name}"
        init = folder / "__init__.py"
        if (init.is_file() and _declares_specs(init)) or (folder / "compile.py").is_file():
            names.append(name)
        names += _leaf_names([str(folder)], name)
    return names


def _is_package(folder: Path) -> bool:
    return folder.is_dir() and folder.name.isidentifier() and folder.name != "__pycache__"


def _declares_specs(init: Path) -> bool:
    """Whether the package's `__init__.py` binds SPEC or SPECS at module level."""
    for node in ast.parse(init.read_bytes(), filename=str(init)).body:
        if isinstance(node, ast.Assign):
            bound = [t.id for t in node.targets if isinstance(t, ast.Name)]
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            bound = [node.target.id]
        elif isinstance(node, ast.ImportFrom):
            bound = [alias.asname or alias.name for alias in node.names]
        else:
            continue
        if any(name in DECLARED for name in bound):
            return True
    return False


def _declared(leaf: ModuleType) -> list[KernelSpec]:
    if hasattr(leaf, "SPECS"):
        return list(leaf.SPECS)
    if hasattr(leaf, "SPEC"):
        return [leaf.SPEC]
    raise LookupError(f"{leaf.__name__}: a kernel leaf declares SPEC or SPECS in its __init__.py")
