"""Which CUDA the DSL compiles with in this environment: the GPU host builds what runs with the
cu13 libs (the `cu13` extra, ../shared/gpu-host/wheels.sh --dsl); a plain install (CI, the
README's set-up) gets cu12's, whose ptxas differs in a few SASS details the compile tests pin."""

from __future__ import annotations

import importlib.metadata


def dsl_toolchain() -> str:
    try:
        importlib.metadata.version("nvidia-cutlass-dsl-libs-cu13")
        return "cu13"
    except importlib.metadata.PackageNotFoundError:
        return "cu12"
