"""The attention forward's fixed-length rules (config.FIXED_RULES, docs/attention/NOTES.md
"192/128 and the L2 rules adopted", "Rule 8: D = 128 non-causal MHA in sections": L2 sections
at every size, with the tile counter where the rule takes it), on the GPU. Each rule's config
forced through the launcher on awkward shapes (lengths off the tiles, GQA 4, Sq < Sk, Sq > Sk:
rows that see no key, many tiles a CTA), bf16 and fp16; then each rule's class at its smallest
corner through the op, as users reach it. Against the suite's reference and tolerance, every
element written (NaN-poisoned out), bitwise the same on a second call and as the plan before's
output (`was`: only the tile order and the deal move, each tile's math is the same)."""

from __future__ import annotations

import pytest
import torch
from attention_configs import SUITE, check_run, forced

from forgekernel.bench.suites import attention as suite_module
from forgekernel.kernels.attention.fwd.sm90.config import FIXED_RULES, fixed_rule

pytestmark = pytest.mark.gpu

# (b, hq, sq, sk, group)
SHAPES = [(2, 4, 1000, 1003, 1), (2, 8, 1000, 1003, 4), (1, 8, 300, 2100, 1),
          (1, 4, 700, 250, 1), (2, 16, 2048, 2048, 1)]  # fmt: skip
CASES = [
    pytest.param(i, shape, dtype, id=f"rule{i}-{'x'.join(map(str, shape))}-{str(dtype)[6:]}")
    for i in range(1, len(FIXED_RULES) + 1)
    for shape in SHAPES
    for dtype in (torch.bfloat16, torch.float16)
    if dtype == torch.bfloat16 or shape == SHAPES[1]
]  # fmt: skip


@pytest.mark.parametrize(("i", "shape", "dtype"), CASES)
def test_rule_config_matches_the_reference_and_was(i, shape, dtype):
    rule = FIXED_RULES[i - 1]
    (d, dv), knobs = rule.head_dims, dict(rule.knobs)
    b, hq, sq, sk, group = shape
    case = suite_module._case(b, hq, hq // group, sq, d, rule.causal, sk=sk, dv=dv)
    gen = torch.Generator(device="cuda").manual_seed(sum(shape) + d)
    inputs = SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)
    check_run(inputs, forced(knobs), as_default=True)


# each rule's class at its smallest corner (lo seqlens, the fewest batches x kv heads, its
# largest GQA ratio): the op's own choice
CORNERS = [
    pytest.param(i, id=f"rule{i}-d{r.head_dims[0]}-{'causal' if r.causal else 'full'}")
    for i, r in enumerate(FIXED_RULES, 1)
]


@pytest.mark.parametrize("i", CORNERS)
def test_the_op_runs_the_rule_in_its_class(i):
    rule = FIXED_RULES[i - 1]
    (d, dv), s, g = rule.head_dims, rule.seqlens[0], max(rule.groups)
    hkv = 8 if g > 1 else min(rule.min_kv_heads, 32)
    b = -(-rule.min_kv_heads // hkv)
    assert fixed_rule(d, dv, rule.causal, b, s, s, g * hkv, hkv) == i
    case = suite_module._case(b, g * hkv, hkv, s, d, rule.causal, dv=dv)
    gen = torch.Generator(device="cuda").manual_seed(i)
    inputs = SUITE.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
    check_run(inputs, suite_module.run_ours, as_default=True)
