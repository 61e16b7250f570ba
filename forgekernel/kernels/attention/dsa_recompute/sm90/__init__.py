"""DeepSeek sparse attention's score recompute (DSA, issue 22), sm_90a: the indexer's training
target from q, kv, the forward's LSE and the top-k lists (kernel.py). DSL-free declaration; the
op is `forgekernel.ops.dsa_recompute.dsa_score_recompute`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_recompute.sm90.config import DTYPES, HEADS, params_for
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_recompute.sm90.compile import compile_recompute

    return compile_recompute(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every dtype x heads, without topk_length; bf16 with it at 16 and 128 heads."""
    plain = [params_for(d, h) for d in DTYPES for h in HEADS]
    return plain + [params_for("bfloat16", h, length=True) for h in (16, 128)]


SPEC = KernelSpec(
    name="dsa_recompute_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    representative=lambda: params_for("bfloat16", 16),
)

__all__ = ["SPEC", "params_for"]
