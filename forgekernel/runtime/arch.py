"""Which GPU architecture to build for: the CUDA device's, else an explicit or env choice."""

from __future__ import annotations

import os

SUPPORTED = ("sm_90a",)


def device_arch() -> str | None:
    """The arch of the current CUDA device, or None when there is none."""
    import torch

    if not torch.cuda.is_available():
        return None
    major, minor = torch.cuda.get_device_capability()
    # Hopper's wgmma/setmaxnreg need the arch-specific 'a' target.
    suffix = "a" if major >= 9 else ""
    return f"sm_{major}{minor}{suffix}"


def resolve_arch(explicit: str | None = None) -> str:
    """explicit > CUDA device > $CUTE_DSL_ARCH. Raises when none names a supported arch."""
    arch = explicit or device_arch() or os.environ.get("CUTE_DSL_ARCH")
    if arch is None:
        raise RuntimeError(
            "no CUDA device and no target arch: pass --arch sm_90a or set CUTE_DSL_ARCH=sm_90a"
        )
    if arch not in SUPPORTED:
        raise RuntimeError(f"arch {arch!r} is not supported; ForgeKernel builds for {SUPPORTED}")
    return arch
