"""ForgeKernel: CuTe DSL kernels for NVIDIA Hopper (sm_90a)."""

from forgekernel.ops import (
    attention,
    attention_backward,
    attention_paged,
    attention_paged_csr,
    attention_varlen,
    attention_varlen_backward,
    dsa_sparse_attention,
    gated_delta_rule_step,
    gemm,
    gemm_fp8,
    mla_decode,
    tune_gemm,
)

__version__ = "0.1.0"
__all__ = [
    "attention",
    "attention_backward",
    "attention_paged",
    "attention_paged_csr",
    "attention_varlen",
    "attention_varlen_backward",
    "dsa_sparse_attention",
    "gated_delta_rule_step",
    "gemm",
    "gemm_fp8",
    "mla_decode",
    "tune_gemm",
]
