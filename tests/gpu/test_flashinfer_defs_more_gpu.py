"""FlashInfer-Bench's gqa_ragged causal prefill and gemm definitions run as they are through
ForgeKernel's attention_varlen and gemm (bench/flashinfer_defs.run_kernel), with the
definitions' own input shapes at several variable-axis values, judged by that benchmark's
criterion: an element fails when |ours - theirs| > 1e-2 and |ours - theirs| / (|theirs| +
1e-8) > 1e-2; no NaN or Inf in ours. Skipped where the definitions directory is absent."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs

pytestmark = pytest.mark.gpu
_fails = defs.benchmark_failures


def _definition(name: str) -> defs.Definition:
    why = defs.missing(name)
    if why:
        pytest.skip(why)
    return defs.load_definition(name)


def _cuda(inputs: dict) -> dict:
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.parametrize(
    "q_lens, k_lens",
    [
        ([1, 3, 2, 4, 1, 2], [1, 17, 300, 0, 4096, 65]),  # decode-like, one empty kv
        ([1, 17, 300, 1000, 65, 0, 7, 5], [1, 17, 301, 1700, 129, 9, 3, 0]),  # odd, q > kv
        ([2048, 1, 777], [2048, 4096, 777]),
    ],
)
def test_ragged_prefill_definition_through_attention_varlen(q_lens, k_lens):
    """Rows that see no key (more queries than keys) are NaN in their reference (softmax over
    an empty row): left out of the output comparison, ours must be 0 there."""
    defn = _definition(defs.RAGGED_GQA_PREFILL[0])
    gen = torch.Generator().manual_seed(0)
    inputs = _cuda(defs.ragged_gqa_inputs(defn, q_lens, k_lens, generator=gen))
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    ours_out, ours_lse = defs.run_kernel(defn, inputs)
    assert ours_out.shape == theirs_out.shape and ours_out.dtype == theirs_out.dtype
    assert ours_lse.shape == theirs_lse.shape and ours_lse.dtype == theirs_lse.dtype
    assert torch.isfinite(ours_out).all()
    nan = theirs_out.isnan().any(-1)
    assert torch.all(ours_out[nan] == 0)
    assert _fails(ours_out[~nan], theirs_out[~nan]) == 0
    assert _fails(ours_lse, theirs_lse) == 0


@pytest.mark.parametrize("m", [1, 7, 128, 1000, 4097])
def test_gemm_definition_through_gemm(m):
    defn = _definition(defs.GEMM[0])
    inputs = _cuda(defs.gemm_inputs(defn, m, generator=torch.Generator().manual_seed(m)))
    (theirs,) = defs.run_definition(defn, inputs)
    (ours,) = defs.run_kernel(defn, inputs)
    assert ours.shape == theirs.shape and ours.dtype == theirs.dtype == torch.float16
    assert torch.isfinite(ours).all()
    assert _fails(ours, theirs) == 0
