"""tests/gpu/: tests that need an sm90 GPU (H100 / H200) and its kernels, marked `gpu`.

Elsewhere they are skipped, so CI on a CPU passes; on the H200 `python -m pytest -m gpu tests/gpu`
runs them (kernels from a bundle, $FORGEKERNEL_KERNEL_DIR, or compiled on first use; naming the
folder keeps a host without the DSL from collecting the CPU tests that import it).
"""

from __future__ import annotations

import pytest
import torch


def sm90_missing() -> str | None:
    """Why the gpu tests cannot run here, or None when an sm90 device is present."""
    if not torch.cuda.is_available():
        return "needs an sm90 GPU: no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an sm90 GPU: the device is sm_{major}{minor}"
    return None


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    reason = sm90_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
