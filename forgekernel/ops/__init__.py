"""The torch-facing API."""

from forgekernel.ops.gemm import gemm

__all__ = ["gemm"]
