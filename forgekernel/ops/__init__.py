"""The torch-facing API."""

from forgekernel.ops.attention import attention
from forgekernel.ops.attention_bwd import attention_backward, attention_varlen_backward
from forgekernel.ops.attention_varlen import attention_varlen
from forgekernel.ops.gemm import gemm, tune_gemm

__all__ = [
    "attention",
    "attention_backward",
    "attention_varlen",
    "attention_varlen_backward",
    "gemm",
    "tune_gemm",
]
