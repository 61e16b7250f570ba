"""DeepSeek sparse attention's lightning indexer (DSA, issue 22), sm_90a: the FP8 logits kernel
(`logits.py`) and the top-k kernel (`topk.py`), one leaf, one source hash. DSL-free
declaration; the op is `forgekernel.ops.dsa_indexer`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    CLUSTERS,
    QTOKENS,
    logits_params,
    topk_params,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.dsa_indexer.sm90.compile import compile_indexer

    return compile_indexer(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    logits = [logits_params(qt, paged) for paged in (True, False) for qt in QTOKENS]
    return logits + [topk_params(c, paged) for paged in (True, False) for c in CLUSTERS]


SPEC = KernelSpec(
    name="dsa_indexer_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    representative=lambda: logits_params(1, True),
)

__all__ = ["SPEC", "logits_params", "topk_params"]
