"""ForgeKernel: CuTe DSL kernels for NVIDIA Hopper (sm_90a)."""

from forgekernel.ops import gemm, tune_gemm

__version__ = "0.1.0"
__all__ = ["gemm", "tune_gemm"]
