"""D = 96 on 192-row tiles (WG3_CANDIDATES, the suite's `wg3` / `wg3_s3` / `wg3_n96s3` /
`wg3_wave0`; docs/attention/NOTES.md "next/attn-fwd-gap (2026-12-07)"), forced through the
launcher before the bench times them: three consumer warpgroups with 112- or 96-key tiles, 2 or
3 stages, where D = 96's standard runs two with 128. Each on awkward shapes: one key block,
lengths off both tiles (1000 rows: 5 full 192-row tiles and a 40-row one; 1003 keys: 8 full
112-key blocks and an 11-key one), GQA 4, Sq < Sk (chunked), Sq > Sk (rows that see no key,
tiles with no key block: Q alone), several tiles a CTA (2 x 16 heads x 11 row blocks on 132
CTAs); against the suite's reference (fp32) and tolerance, every element written (NaN-poisoned
out), bitwise the same on a second call. Not bitwise the default config's: another key tile
changes the online softmax's order of accumulation."""

from __future__ import annotations

import pytest
import torch
from attention_configs import SUITE, check_run, forced

from forgekernel.bench.suites import attention as suite_module
from forgekernel.kernels.attention.fwd.sm90 import WG3_CANDIDATES

pytestmark = pytest.mark.gpu

# (b, hq, hkv, sq, sk): one key block; off the tiles; GQA 4; chunked; rows with no key; many
# tiles a CTA
SHAPES = [(1, 4, 4, 100, 100), (2, 4, 4, 1000, 1003), (2, 8, 2, 1000, 1003),
          (1, 8, 8, 300, 2100), (1, 4, 4, 700, 250), (2, 16, 16, 2048, 2048)]  # fmt: skip
# bf16 on every candidate and shape (its builds: SPEC.candidate_params); fp16 on the first
# causal and the non-causal candidate at the off-tile GQA shape (compiled on first use: 2 keys)
CASES = [
    pytest.param(causal, knobs, shape, dtype, id=f"{i}-{'causal' if causal else 'full'}-"
                 f"{'x'.join(map(str, shape))}-{str(dtype)[6:]}")
    for i, (_, causal, knobs) in enumerate(WG3_CANDIDATES)
    for shape in SHAPES
    for dtype in [torch.bfloat16]
    + ([torch.float16] if i in (0, 4) and shape == SHAPES[2] else [])
]  # fmt: skip


@pytest.mark.parametrize(("causal", "knobs", "shape", "dtype"), CASES)
def test_wg3_candidate_matches_the_reference(causal, knobs, shape, dtype):
    b, hq, hkv, sq, sk = shape
    case = suite_module._case(b, hq, hkv, sq, 96, causal, sk=sk)
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + 96)
    inputs = SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)
    check_run(inputs, forced(knobs), as_default=False)
