"""The CPU tests' compile of one kernel configuration to a cubin they read (SASS, resources)."""

from __future__ import annotations

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
