"""The CPU tests' compile of one kernel configuration to the cubin and PTX they read (SASS,
resources), once a process."""

from __future__ import annotations

import copy
import re
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from forgekernel.runtime.spec import KernelSpec, Params


class Build(NamedTuple):
    """What the SASS tests read of one compile: inspect_cubin's resources, cuobjdump's listing
    and the PTX."""

    resources: dict
    sass: str
    ptx: str


# (kernel name, arch, source hash, params) -> its Build: runtime/cache.py's in-process key (that
# cache holds loaded .so functions, not the cubin and PTX read here). Several tests read one
# build: within a file (the paged merge test's standard leaves are the main-loop test's; the DSA
# indexer's and recompute's SASS and PTX tests) and across files (the MLA pass's standard build
# is read by the seesaw, work-list and PDL tests, its work-list builds by the work-list, schedule
# and PDL ones: about 17 s a compile on CI), which conftest's SHARED_COMPILES groups keep in one
# process. Memory only: nothing is written beside the compile cache.
_BUILDS: dict[tuple, Build] = {}


def build(spec: KernelSpec, params: Params) -> Build:
    """`spec`'s compile of `params` (cubin and PTX kept: --keep-ptx leaves the SASS as it is),
    once a process; each call gets its own copy of the resources."""
    key = (spec.name, spec.arch, spec.source_hash, params)
    if key not in _BUILDS:
        from forgekernel.runtime.resources import inspect_cubin, sass_text

        with tempfile.TemporaryDirectory() as d:
            compiled = spec.compile(params, f"--keep-cubin --keep-ptx --dump-dir {d}")
            cubin = compiled.artifacts.CUBIN
            if isinstance(cubin, bytes):
                (Path(d) / "k.cubin").write_bytes(cubin)
                cubin = str(Path(d) / "k.cubin")
            ptx = "".join(p.read_text() for p in sorted(Path(d).glob("*.ptx")))
            _BUILDS[key] = Build(inspect_cubin(cubin), sass_text(cubin), ptx)
    found = _BUILDS[key]
    return found._replace(resources=copy.deepcopy(found.resources))


# a SASS line's global-memory access (loads, stores, TMA, bulk copies, reductions, atomics), and
# an instruction line of cuobjdump's listing (group 1: the instruction)
GLOBAL = re.compile(r"\b(LDG|STG|LDGSTS|UTMALDG|UTMASTG|UBLKCP|UBLKRED|RED|ATOM)\b")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*)$")


def sass_builder() -> Callable[[KernelSpec, Params], tuple[dict, list[str]]]:
    """build(spec, params) -> (inspect_cubin's resources, the SASS instructions in order), each
    configuration compiled once a process (`build`); skips without the DSL or the CUDA tools."""
    import pytest

    pytest.importorskip("cutlass")
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not found")

    def sass_of(spec: KernelSpec, params: Params) -> tuple[dict, list[str]]:
        found = build(spec, params)
        lines = [m.group(1) for m in map(INSTRUCTION.match, found.sass.splitlines()) if m]
        return found.resources, lines

    return sass_of
