"""The torch-facing API."""

from forgekernel.ops.gemm import gemm, tune_gemm

__all__ = ["gemm", "tune_gemm"]
