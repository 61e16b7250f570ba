"""Load an exported kernel (.so) through TVM-FFI. Needs torch, apache-tvm-ffi and the CuTe DSL
runtime library (`libcute_dsl_runtime.so`), never the DSL itself."""

from __future__ import annotations

import ctypes
import functools
import os
import sys
from pathlib import Path
from typing import Any

RUNTIME_LIB = "libcute_dsl_runtime.so"


def _candidate_runtime_libs() -> list[Path]:
    env = os.environ.get("FORGEKERNEL_RUNTIME_LIB")
    found = [Path(env)] if env else []
    for entry in sys.path:
        root = Path(entry or ".") / "nvidia_cutlass_dsl"
        # cu13 first: the wheel that matches CUDA 13 drivers; cu12 runs on them too.
        found += [root / cu / "lib" / RUNTIME_LIB for cu in ("cu13", "cu12")]
    return found


@functools.cache
def ensure_runtime() -> str:
    """Load the DSL runtime library globally, so exported kernels resolve against it."""
    import tvm_ffi  # noqa: F401  (loads libtvm_ffi.so, which the kernels link to)

    for path in _candidate_runtime_libs():
        if path.is_file():
            ctypes.CDLL(str(path), mode=ctypes.RTLD_GLOBAL)
            return str(path)
    raise RuntimeError(
        f"{RUNTIME_LIB} not found: install nvidia-cutlass-dsl or set FORGEKERNEL_RUNTIME_LIB"
    )


def load_function(so_path: Path, symbol: str) -> Any:
    """The callable `symbol` exported in `so_path`; takes torch tensors and ints."""
    ensure_runtime()
    import tvm_ffi

    return tvm_ffi.load_module(str(so_path))[symbol]
