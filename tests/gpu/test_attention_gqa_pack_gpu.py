"""GQA packed in the fixed-length mode (`attention_fwd(pack_gqa=True)`, the suite's `gqa_pack`;
docs/attention/NOTES.md "next/attn-gqa-pack (2026-12-07)"), forced through the launcher before
the bench times it: the G query heads of a kv head as G * Sq rows of one head, read and written
through (B, Sq, Hkv, G, D) views of q / o and (B, Hkv, G, Sq) of lse, the causal mask on row //
G. G 2 / 4 / 8 at D = 64 (192-row tiles: G * Sq rows cut at 192 / G positions) and D = 128
(128-row tiles), both masks, both dtypes, on awkward shapes: one query position (G rows), Sq <
128 (the copy pack's range), lengths off both tiles (1000 x 1003), Sq < Sk (chunked), Sq > Sk
(rows that see no key, tiles with no key block), the bench case's heads (2 x 8 kv heads x 4096
rows: 352 tiles on 132 CTAs); against the suite's reference (fp32) and tolerance, every element
written (NaN-poisoned out), bitwise the same on a second call. G 16 at D = 64 (the standard
keys of PACK_CLASSES, both masks) on the off-tile and Sq > Sk shapes."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.check import poison, verify
from forgekernel.bench.suites import attention as suite_module

pytestmark = pytest.mark.gpu

SUITE = suite_module.suite()
# (b, hkv, sq, sk): one position; Sq < 128; off the tiles; chunked; rows with no key; the
# bench case's heads (G = 4: hq 32)
SHAPES = [(1, 2, 1, 77), (2, 2, 100, 100), (2, 2, 1000, 1003), (1, 2, 300, 2100),
          (1, 2, 700, 250), (2, 8, 1024, 1024)]  # fmt: skip
# every shape on the bf16 G = 4 builds (PACK_CANDIDATES' group: D = 64 causal, D = 128 both);
# the off-tile and Sq > Sk shapes on the others (compiled on first use where not prebuilt)
KEYS = [(64, g, dtype) for g in (2, 4, 8) for dtype in (torch.bfloat16, torch.float16)]
KEYS += [(64, 16, torch.bfloat16)]  # PACK_CLASSES' widest group (standard, both masks)
KEYS += [(128, 4, torch.bfloat16), (128, 8, torch.bfloat16)]
CASES = [
    pytest.param(d, g, dtype, causal, shape, id=f"d{d}-g{g}-{str(dtype)[6:]}-"
                 f"{'causal' if causal else 'full'}-{'x'.join(map(str, shape))}")
    for d, g, dtype in KEYS
    for causal in (False, True)
    for shape in (SHAPES if g == 4 and dtype == torch.bfloat16 else [SHAPES[2], SHAPES[4]])
]  # fmt: skip


@pytest.mark.parametrize(("d", "g", "dtype", "causal", "shape"), CASES)
def test_gqa_pack_matches_the_reference(d, g, dtype, causal, shape):
    b, hkv, sq, sk = shape
    case = suite_module._case(b, hkv * g, hkv, sq, d, causal, sk=sk)
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + d + g)
    inputs = SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)
    run = suite_module.run_packed
    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first, again = (run(inputs, poison(SUITE.alloc_out(inputs))) for _ in range(2))
    torch.cuda.synchronize()
    assert not first[0].isnan().any() and not first[1].isnan().any()
    for got, again_ in zip(first, again):
        assert torch.equal(got, again_)
