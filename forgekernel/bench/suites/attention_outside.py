"""Attention forward on shapes outside its suite (the brief: a figure that holds only on the
suite it was tuned on does not stand): the `attention` suite's kernel, comparators, checks and
timing on a fixed list of model shapes it does not bench, and no variants.

Models and sequence lengths the suite leaves out: LLMs at lengths off the suite's powers of two
(3072, 6000, 12288, 24576) and head counts it lacks (Qwen3-30B-A3B 32:4, Qwen3-32B 64:8,
Llama-3.2 3B 24:8, Gemma-2 27B 32:16 at D 128, Phi-3 medium 40:10), and the non-causal attention
of image and video diffusion transformers at their token counts: Flux (24 heads, D 128, 4096
image + 512 text tokens), Stable Diffusion 3 (24 heads, D 64, 4096 + 333 at 1024^2), Wan 2.1
14B (40 heads, D 128, 32760: 480p, 81 frames) and HunyuanVideo's heads (24, D 128) at that
count, CogVideoX-5B (48 heads, D 64, 17550 + 226 text); chunked prefill and a varlen batch at
other draws. No tuning reads these
cases: a choice made for them would make them a suite.
"""

from __future__ import annotations

from dataclasses import replace

from forgekernel.bench.suite import OpSuite
from forgekernel.bench.suites import attention
from forgekernel.bench.suites.attention import (
    _case,
    _chunked_lengths,
    _varlen_case,
    _varlen_lengths,
)

OUTSIDE_CASES = (
    # LLM prefill, causal, lengths and head counts the suite does not bench
    _case(4, 32, 8, 3072, 128, group="llm"),  # Llama-3 8B / Mistral at 3k
    _case(2, 64, 8, 6000, 128, group="llm"),  # Llama-3 70B, off every tile size
    _case(2, 24, 8, 12288, 128, group="llm"),  # Llama-3.2 3B
    _case(1, 64, 8, 24576, 128, group="llm"),  # Qwen3 32B
    _case(8, 32, 4, 2048, 128, group="llm"),  # Qwen3-30B-A3B, GQA 8
    _case(2, 40, 10, 6144, 128, group="llm"),  # Phi-3 medium, GQA 4
    _case(4, 32, 16, 4096, 128, group="llm"),  # Gemma-2 27B at D 128, GQA 2
    _case(4, 32, 32, 3072, 96, group="llm"),  # Phi-3 mini at 3k
    _case(2, 16, 8, 6000, 256, group="llm"),  # Gemma-2 9B, off the tiles
    _case(2, 128, 128, 3072, 192, dv=128, group="llm"),  # DeepSeek-V3 MLA prefill at 3k
    # diffusion / video transformers: non-causal, MHA, their token counts
    _case(2, 24, 24, 4608, 128, causal=False, group="diffusion"),  # Flux
    _case(4, 24, 24, 4429, 64, causal=False, group="diffusion"),  # SD3 at 1024^2
    _case(1, 24, 24, 32760, 128, causal=False, group="diffusion"),  # HunyuanVideo's heads
    _case(1, 40, 40, 32760, 128, causal=False, group="diffusion"),  # Wan 2.1 14B
    _case(1, 48, 48, 17776, 64, causal=False, group="diffusion"),  # CogVideoX-5B
    # chunked prefill and a varlen batch at draws the suite does not use
    _case(1, 32, 8, 1536, 128, sk=9000, group="chunked"),
    _case(1, 40, 8, 700, 128, sk=20000, group="chunked"),
    _varlen_case(
        _varlen_lengths(24, 100, 6000, seed=7), hq=32, hkv=8, tag="s100to6000", group="varlen"
    ),  # fmt: skip
    _varlen_case(*_chunked_lengths(6, seed=11), hq=64, hkv=8, tag="chunk-seed11", group="varlen"),
)


def suite() -> OpSuite:
    return replace(
        attention.suite(), name="attention_outside", bench_cases=OUTSIDE_CASES, variants=None
    )
