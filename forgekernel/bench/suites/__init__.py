"""The operator suites, one module per operator, each exposing `suite() -> OpSuite`.

Modules are imported only when asked for, so listing suites needs neither the DSL nor a GPU.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Iterable

from forgekernel.bench.suite import OpSuite

# Suites whose kernels have not yet passed a GPU check (docs/PENDING.md): registered only where
# FORGEKERNEL_PENDING_SUITES is set (a device run that checks and benches them first), so that
# tests/test_ledger_gate.py does not ask CI for a ledger that no GPU has written yet.
PENDING_SUITE_MODULES: dict[str, str] = {
    # issue 22: the fused DSA prefill (q RoPE + sparse MQA with sink + out RoPE + FP8 cast)
    "dsa_fused_prefill": "forgekernel.bench.suites.dsa_fused_prefill",
    # the brief's shapes outside the suites (2026-12-06): gemm's and attention's kernels on
    # fixed samples of model shapes their suites do not bench
    "gemm_outside": "forgekernel.bench.suites.gemm_outside",
    "attention_outside": "forgekernel.bench.suites.attention_outside",
}
SUITE_MODULES = {
    "gemm": "forgekernel.bench.suites.gemm",
    "attention": "forgekernel.bench.suites.attention",
    # Registered: tests/test_ledger_gate.py fails until a GPU `forgekernel check attention_bwd`
    # has passed on the current bwd kernel sources (benchmarks/results/<arch>/attention_bwd.json).
    "attention_bwd": "forgekernel.bench.suites.attention_bwd",
    "gemm_fp8": "forgekernel.bench.suites.gemm_fp8",  # issue 21
    "attention_paged": "forgekernel.bench.suites.attention_paged",  # issue 18
    "gdn_decode": "forgekernel.bench.suites.gdn_decode",  # issue 20
    "mla_decode": "forgekernel.bench.suites.mla_decode",  # issue 19
    "dsa_sparse": "forgekernel.bench.suites.dsa_sparse",  # issue 22
    "gemm_fp8_grouped": "forgekernel.bench.suites.gemm_fp8_grouped",  # issue 21
    "gemm_fp8_masked": "forgekernel.bench.suites.gemm_fp8_masked",  # issue 21
    # issue 23: the implicit-GEMM convolution (forward; data gradient by output phase on the
    # forward kernel; weight gradient interim on the dense GEMM)
    "conv_fwd": "forgekernel.bench.suites.conv_fwd",
    "conv_dgrad": "forgekernel.bench.suites.conv_dgrad",
    "conv_wgrad": "forgekernel.bench.suites.conv_wgrad",
    "gdn_prefill": "forgekernel.bench.suites.gdn_prefill",  # issue 20
    # issue 21: FP4 (e2m1) weights, masked and contiguous grouped (checked 2026-12-02)
    "gemm_fp4_masked": "forgekernel.bench.suites.gemm_fp4_masked",
    "gemm_fp4_grouped": "forgekernel.bench.suites.gemm_fp4_grouped",
    # issue 20: Gated DeltaNet backward (the kernel path by default since 2026-12-06)
    "gdn_bwd": "forgekernel.bench.suites.gdn_bwd",
    # checked on the H200 2026-12-02 (next/integration3):
    "dsa_indexer": "forgekernel.bench.suites.dsa_indexer",  # issue 22: the FP8 lightning indexer
    # issue 20: Kimi Delta Attention forward (first-pass kernel + recurrence kernel)
    "kda_prefill": "forgekernel.bench.suites.kda_prefill",
    "dsa_recompute": "forgekernel.bench.suites.dsa_recompute",  # issue 22: the score recompute
    # issue 20: Kimi Delta Attention backward (the kernel path by default since 2026-12-06)
    "kda_bwd": "forgekernel.bench.suites.kda_bwd",
    # issue 22: the indexer's training backward, its kernel (built on the CPU 2026-12-04; held:
    # the ledger gate waits for its first GPU check)
    "dsa_indexer_bwd": "forgekernel.bench.suites.dsa_indexer_bwd",
    # issue 22: DSA sparse attention backward, the v1 kernel (checked on the H200 2026-12-03)
    "dsa_sparse_bwd": "forgekernel.bench.suites.dsa_sparse_bwd",
}
if os.environ.get("FORGEKERNEL_PENDING_SUITES"):
    SUITE_MODULES.update(PENDING_SUITE_MODULES)


def get_suite(name: str) -> OpSuite:
    if name not in SUITE_MODULES:
        raise ValueError(f"unknown operator {name!r}; known: {', '.join(SUITE_MODULES)}")
    return importlib.import_module(SUITE_MODULES[name]).suite()


def all_suites() -> dict[str, OpSuite]:
    return {name: get_suite(name) for name in SUITE_MODULES}


def select_suites(names: Iterable[str] = ()) -> list[OpSuite]:
    """The named suites (all of them when none is named); unknown names raise ValueError."""
    return [get_suite(n) for n in (list(names) or SUITE_MODULES)]
