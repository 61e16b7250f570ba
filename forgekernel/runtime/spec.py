"""What a kernel leaf declares, importable without the DSL."""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from forgekernel.runtime.hashing import source_hash

Params = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class KernelSpec:
    """One kernel leaf: `kernels/<family>/<operator>/<arch>/`.

    name: unique, used in file and symbol names.
    directory: the leaf; every .py file in it is the kernel's source (hash = cache/ledger key).
    compile: (params, extra_options) -> a `cute.compile`d TVM-FFI function for `arch`; imports
        the DSL lazily; extra_options are DSL compile flags (e.g. --keep-cubin --dump-dir D).
    standard_params: the configurations `forgekernel build` compiles ahead of time.
    candidate_params: further configurations for tuning sweeps (`build --candidates`).
    mma: the kernel's work is matrix multiplies, so its SASS must use HGMMA (False for
        element-wise helpers such as the attention backward's pre- and postprocessing).
    """

    name: str
    arch: str
    directory: Path
    compile: Callable[[Params, str], Any]
    standard_params: Callable[[], Sequence[Params]]
    candidate_params: Callable[[], Sequence[Params]] = tuple
    mma: bool = True

    @property
    def sources(self) -> list[Path]:
        return sorted(self.directory.glob("*.py"))

    @functools.cached_property
    def source_hash(self) -> str:
        return source_hash(self.sources)


def all_specs() -> list[KernelSpec]:
    """Every kernel leaf of the library."""
    from forgekernel.kernels.attention.fwd.sm90 import SPEC as attention_fwd_sm90
    from forgekernel.kernels.gemm.dense.sm90 import SPEC as gemm_dense_sm90

    return [gemm_dense_sm90, attention_fwd_sm90, *_attention_bwd_specs()]


def _attention_bwd_specs() -> list[KernelSpec]:
    """The attention backward leaf's kernels, once the leaf exists (a leaf that exists but
    fails to import raises)."""
    found = importlib.util.find_spec("forgekernel.kernels.attention.bwd.sm90")
    if found is None or found.origin is None:  # no leaf, or a folder without its __init__.py
        return []
    from forgekernel.kernels.attention.bwd.sm90 import SPECS

    return list(SPECS)
