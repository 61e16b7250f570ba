"""The open 192/128 schedule candidates (D192_CANDIDATES, the suite's CONFIG_CANDIDATES;
docs/attention/NOTES.md "192/128 against FA4's schedule", "192/128 and the L2 rules adopted"),
forced through the launcher before the bench times them: `k_ahead` changes the producer's
load order (K of the next key block before V of the current, Q right after the first K) on top
of `dynamic` (the deal: a tile counter), `l2_kv_mib` 12 the section size. Each on awkward
shapes: one key block (n_block_max 1: the order's first K and last V are the same block),
lengths off the 128-row tiles, Sq < Sk (chunked), Sq > Sk (rows that see no key, tiles with no
key block: Q alone), several tiles a CTA (the load order across the tile boundary: 132 CTAs,
2 x 16 x 16 tiles); against the suite's reference and tolerance, every element written
(NaN-poisoned out), bitwise the same on a second call and as the default config's output (same
tiles, same math: only the load order, the deal and the tile order move)."""

from __future__ import annotations

import pytest
import torch
from attention_configs import SUITE, check_run, forced

from forgekernel.bench.suites import attention as suite_module
from forgekernel.kernels.attention.fwd.sm90 import D192_CANDIDATES, L2_CANDIDATES

pytestmark = pytest.mark.gpu

# (b, hq, sq, sk): one key block; off the tiles; chunked; rows with no key; many tiles a CTA
SHAPES = [(1, 4, 100, 100), (2, 4, 1000, 1003), (1, 8, 300, 2100), (1, 4, 700, 250),
          (2, 16, 2048, 2048)]  # fmt: skip
# bf16 causal: every candidate (its builds); bf16 non-causal for those with k_ahead and fp16
# causal for k_ahead with the counter (compiled on first use: 4 keys)
CASES = [
    pytest.param(knobs, shape, dtype, causal, id=f"{i}-{'x'.join(map(str, shape))}-"
                 f"{str(dtype)[6:]}-{'causal' if causal else 'full'}")
    for i, knobs in enumerate(D192_CANDIDATES)
    for shape in SHAPES
    for dtype, causal in [(torch.bfloat16, True)]
    + ([(torch.bfloat16, False)] if knobs.get("k_ahead") else [])
    + ([(torch.float16, True)] if knobs == {"dynamic": True, "k_ahead": True} else [])
]  # fmt: skip


@pytest.mark.parametrize(("knobs", "shape", "dtype", "causal"), CASES)
def test_candidate_matches_the_reference_and_the_default(knobs, shape, dtype, causal):
    b, hq, sq, sk = shape
    case = suite_module._case(b, hq, hq, sq, 192, causal, sk=sk, dv=128)
    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    inputs = SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)
    check_run(inputs, forced(knobs), as_default=True)


# The L2 candidates still open (L2_CANDIDATES: D = 64 causal in sections, alone and with the
# counter; the adopted ones are test_attention_fixed_rules_gpu.py's), bf16, on the shapes above
# but the first and GQA 4 on the off-tile one: only the tile order and the deal move, so the
# output is the default config's, bit for bit.
L2_SHAPES = [(2, 4, 1000, 1003, 1), (2, 8, 1000, 1003, 4), (1, 8, 300, 2100, 1),
             (1, 4, 700, 250, 1), (2, 16, 2048, 2048, 1)]  # fmt: skip
L2_CASES = [
    pytest.param(d, causal, knobs, shape, id=f"d{d}-{'causal' if causal else 'full'}-"
                 f"{'-'.join(knobs)}-{'x'.join(map(str, shape))}")
    for d, causal, knobs in L2_CANDIDATES
    for shape in L2_SHAPES
]  # fmt: skip


@pytest.mark.parametrize(("d", "causal", "knobs", "shape"), L2_CASES)
def test_l2_candidate_matches_the_reference_and_the_default(d, causal, knobs, shape):
    b, hq, sq, sk, group = shape
    case = suite_module._case(b, hq, hq // group, sq, d, causal, sk=sk)
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + d)
    inputs = SUITE.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
    check_run(inputs, forced(knobs), as_default=True)
