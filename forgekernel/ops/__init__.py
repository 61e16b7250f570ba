"""The torch-facing API."""

from forgekernel.ops.attention import attention
from forgekernel.ops.attention_bwd import attention_backward, attention_varlen_backward
from forgekernel.ops.attention_paged import (
    AttentionPagedSchedule,
    attention_paged,
    attention_paged_csr,
    attention_paged_schedule,
)
from forgekernel.ops.attention_varlen import attention_varlen
from forgekernel.ops.conv import (
    conv2d,
    conv2d_dgrad,
    conv2d_wgrad,
    conv3d,
    conv3d_dgrad,
    conv3d_wgrad,
)
from forgekernel.ops.dsa import dsa_sparse_attention, dsa_sparse_attention_rows
from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward
from forgekernel.ops.dsa_fused import dsa_fused_prefill
from forgekernel.ops.dsa_indexer import dsa_indexer, dsa_indexer_paged, dsa_topk_indexer_flashinfer
from forgekernel.ops.dsa_indexer_bwd import dsa_indexer_backward
from forgekernel.ops.dsa_recompute import dsa_score_recompute
from forgekernel.ops.fp4_pack import quantize_fp4_weights
from forgekernel.ops.gated_delta_rule import gated_delta_rule_step
from forgekernel.ops.gated_delta_rule_bwd import gated_delta_rule_backward
from forgekernel.ops.gated_delta_rule_chunked import gated_delta_rule
from forgekernel.ops.gemm import gemm, tune_gemm
from forgekernel.ops.gemm_fp4_grouped import gemm_fp4_grouped
from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked
from forgekernel.ops.gemm_fp8 import gemm_fp8
from forgekernel.ops.gemm_fp8_grouped import gemm_fp8_grouped, grouped_gemm_fp8
from forgekernel.ops.gemm_fp8_grouped_masked import gemm_fp8_grouped_masked
from forgekernel.ops.kda_bwd import kimi_delta_attention_backward
from forgekernel.ops.kda_chunked import kimi_delta_attention
from forgekernel.ops.mla import MlaDecodeSchedule, mla_decode, mla_decode_schedule, mla_prefill

__all__ = [
    "attention",
    "attention_backward",
    "attention_paged",
    "attention_paged_csr",
    "attention_paged_schedule",
    "AttentionPagedSchedule",
    "attention_varlen",
    "attention_varlen_backward",
    "conv2d",
    "conv2d_dgrad",
    "conv2d_wgrad",
    "conv3d",
    "conv3d_dgrad",
    "conv3d_wgrad",
    "dsa_fused_prefill",
    "dsa_indexer",
    "dsa_indexer_backward",
    "dsa_indexer_paged",
    "dsa_score_recompute",
    "dsa_sparse_attention",
    "dsa_sparse_attention_backward",
    "dsa_sparse_attention_rows",
    "dsa_topk_indexer_flashinfer",
    "gated_delta_rule",
    "gated_delta_rule_backward",
    "gated_delta_rule_step",
    "gemm",
    "gemm_fp4_grouped",
    "gemm_fp4_grouped_masked",
    "gemm_fp8",
    "gemm_fp8_grouped",
    "gemm_fp8_grouped_masked",
    "grouped_gemm_fp8",
    "kimi_delta_attention",
    "kimi_delta_attention_backward",
    "MlaDecodeSchedule",
    "mla_decode",
    "mla_decode_schedule",
    "mla_prefill",
    "quantize_fp4_weights",
    "tune_gemm",
]
