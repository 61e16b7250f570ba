"""The attention forward's fixed-length rules (config.FIXED_RULES, docs/attention/NOTES.md
"192/128 and the L2 rules adopted", "Rule 8: D = 128 non-causal MHA in sections"): each takes
exactly its measured class, at the class's edges and no further, and the bench shows `was`
beside ours on every case a rule moved."""

import pytest

from forgekernel.bench.suites import attention as suite
from forgekernel.kernels.attention.fwd.sm90.config import (
    FIXED_RULES,
    choose_config,
    default_config,
    fixed_rule,
    rule_config,
)

# (b, sq, sk, hq, hkv) of every case the 2026-12-05 16:50 timing moved (rule 8: its 19:56
# repeat)
MEASURED = {
    1: [(8, 2048, 2048, 128, 128), (2, 8192, 8192, 128, 128), (1, 16384, 16384, 128, 128),
        (1, 2048, 16384, 128, 128)],
    2: [(8, 2048, 2048, 32, 32)],
    3: [(16, 1024, 1024, 32, 32)],
    4: [(4, 4096, 4096, 16, 16), (8, 2048, 2048, 16, 8)],
    5: [(16, 1024, 1024, 8, 4)],
    6: [(16, 1024, 1024, 32, 32)],
    7: [(32, 512, 512, 16, 16)],
    8: [(8, 2048, 2048, 32, 32)],
}  # fmt: skip


def _rule(i: int, b: int, sq: int, sk: int, hq: int, hkv: int, causal: bool | None = None) -> int:
    r = FIXED_RULES[i - 1]
    return fixed_rule(*r.head_dims, r.causal if causal is None else causal, b, sq, sk, hq, hkv)


@pytest.mark.parametrize("i", range(1, len(FIXED_RULES) + 1))
def test_each_rule_takes_its_measured_cases_and_stops_at_their_edges(i):
    rule = FIXED_RULES[i - 1]
    lo, hi = rule.seqlens
    for shape in MEASURED[i]:
        assert _rule(i, *shape) == i, shape
    g = max(rule.groups)
    hkv = 8
    assert rule.min_kv_heads % hkv == 0  # so b x 8 meets the minimum exactly
    b = rule.min_kv_heads // hkv  # the fewest batches reaching min_kv_heads
    assert _rule(i, b, lo, lo, g * hkv, hkv) == i  # the class's smallest corner
    assert _rule(i, b, hi, hi, g * hkv, hkv) == i
    assert _rule(i, b - 1, lo, lo, g * hkv, hkv) == 0  # one batch short of min_kv_heads
    assert _rule(i, b, lo - 1, lo - 1, g * hkv, hkv) == 0  # shorter than measured
    assert _rule(i, b, hi + 1, hi + 1, g * hkv, hkv) == 0  # longer
    if lo < hi:  # Sq > Sk, both lengths inside [lo, hi]: never measured
        assert _rule(i, b, hi - 1, hi, g * hkv, hkv) == i
        assert _rule(i, b, hi, hi - 1, g * hkv, hkv) == 0
    # the other mask: no rule of it covers this corner (the D = 96 / 128 / 256 pairs differ in
    # length), so a rule that ignored the mask would answer here
    assert _rule(i, b, lo, lo, g * hkv, hkv, causal=not rule.causal) == 0
    for other in (3, 4, 8):  # a GQA ratio not measured in the class
        if other not in rule.groups:
            assert _rule(i, b * other, lo, lo, other * hkv, hkv) == 0, other
    # the head dims' default outside, the rule's config inside
    d, dv = rule.head_dims
    assert choose_config(d, dv, rule.causal, b, lo, lo, g * hkv, hkv) == rule_config(d, dv, i)
    assert choose_config(d, dv, rule.causal, b, hi + 1, hi + 1, g * hkv, hkv) == default_config(
        d, dv
    )


def test_the_other_mask_has_its_own_rule_or_none():
    """D = 96, D = 128 and D = 256 have a rule per mask (measured each), the others one mask
    only: D = 64 causal (sections 1.100, with the counter 0.994) keeps the default, as 192/128
    non-causal (not measured); D = 128's GQA-4 controls (both masks) stay outside its rules."""
    classes = {(r.head_dims, r.causal) for r in FIXED_RULES}
    assert ((64, 64), True) not in classes and ((192, 128), False) not in classes
    assert {((96, 96), c) for c in (True, False)} <= classes
    assert {((128, 128), c) for c in (True, False)} <= classes
    assert {((256, 256), c) for c in (True, False)} <= classes
    assert fixed_rule(64, 64, True, 8, 4096, 4096, 32, 32) == 0  # the D = 64 causal bench case
    assert fixed_rule(128, 128, False, 8, 2048, 2048, 32, 32) == 8  # D = 128 non-causal MHA
    assert fixed_rule(128, 128, True, 8, 2048, 2048, 32, 32) == 0  # causal: rule 6 is s1024
    assert fixed_rule(128, 128, False, 16, 1024, 1024, 32, 32) == 0  # non-causal at rule 6's s
    assert fixed_rule(128, 128, True, 1, 32768, 32768, 32, 8) == 0  # the GQA-4 controls
    assert fixed_rule(128, 128, False, 1, 32768, 32768, 32, 8) == 0
    assert fixed_rule(128, 128, False, 4, 8192, 8192, 32, 8) == 0
    assert fixed_rule(128, 128, False, 32, 2048, 2048, 32, 8) == 0  # GQA 4 at rule 8's length


def _moved(cases) -> dict[str, int]:
    """The fixed-length cases a rule moves: name -> rule."""
    moved = {}
    for case in cases:
        p = case.params
        if not p.get("varlen"):
            rule = fixed_rule(p["d"], p["dv"], p["causal"], p["b"], p["sq"], p["sk"], p["hq"],
                              p["hkv"])  # fmt: skip
            if rule:
                moved[case.name] = rule
    return moved


def test_the_rules_move_exactly_the_bench_cases_that_show_was():
    """Of the suite's bench cases, the rules move the measured ones only, and each of those
    carries `was` (the plan before); of the check and sanitize cases, RULE_CASE only (rule 7 at
    its class's smallest batch x kv heads), so `check` and the sanitizers run a rule's config."""
    moved = set(_moved(suite.BENCH_CASES))
    shown = {n for n, kind in suite.CONFIG_TIMED.items() if "was" in suite.CONFIG_CANDIDATES[kind]}
    assert moved == shown and len(moved) == sum(len(v) for v in MEASURED.values()) == 12
    assert suite.CONFIG_CANDIDATES["moved"] == {"was": {}}
    rule_case = {suite.RULE_CASE.name: 7}
    assert _moved(suite.CHECK_CASES) == _moved(suite.SANITIZE_CASES) == rule_case
    p = suite.RULE_CASE.params
    assert p["b"] * p["hkv"] == FIXED_RULES[6].min_kv_heads  # the class's fewest
