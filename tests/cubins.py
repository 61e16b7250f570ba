"""The CPU tests' compile of one kernel configuration to a cubin they read (SASS, resources)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

from forgekernel.runtime.spec import KernelSpec, Params


def compile_cubin(spec: KernelSpec, params: Params, directory: Path) -> str:
    """`spec`'s compile of `params` with its cubin kept in `directory` (without --dump-dir the
    DSL drops it in the working directory): the cubin's path."""
    cubin = spec.compile(params, f"--keep-cubin --dump-dir {directory}").artifacts.CUBIN
    if isinstance(cubin, bytes):
        path = Path(directory) / "k.cubin"
        path.write_bytes(cubin)
        cubin = str(path)
    return cubin


# a SASS line's global-memory access (loads, stores, TMA, bulk copies, reductions, atomics), and
# an instruction line of cuobjdump's listing (group 1: the instruction)
GLOBAL = re.compile(r"\b(LDG|STG|LDGSTS|UTMALDG|UTMASTG|UBLKCP|UBLKRED|RED|ATOM)\b")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*)$")


def sass_builder(tmp_path_factory) -> Callable[[KernelSpec, Params], tuple[dict, list[str]]]:
    """build(spec, params) -> (inspect_cubin's resources, the SASS instructions in order), each
    compile in a fresh folder of `tmp_path_factory`; skips without the DSL or the CUDA tools."""
    import pytest

    pytest.importorskip("cutlass")
    from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text

    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not found")

    def build(spec: KernelSpec, params: Params) -> tuple[dict, list[str]]:
        cubin = compile_cubin(spec, params, tmp_path_factory.mktemp("cubin"))
        lines = [m.group(1) for m in map(INSTRUCTION.match, sass_text(cubin).splitlines()) if m]
        return inspect_cubin(cubin), lines

    return build
