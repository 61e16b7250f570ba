"""The suites of shapes outside `gemm`'s and `attention`'s (bench/suites/gemm_outside.py,
attention_outside.py): fixed samples, disjoint from the suites they test, on the same kernel
and comparators, without variants; pending until a GPU runs them."""

from __future__ import annotations

import pytest

from forgekernel.bench.suites import PENDING_SUITE_MODULES, attention, gemm
from forgekernel.bench.suites import attention_outside as ao
from forgekernel.bench.suites import gemm_outside as go


@pytest.mark.parametrize(("outside", "base"), [(go, gemm), (ao, attention)])
def test_the_sample_is_outside_the_suite_and_fixed(outside, base):
    names = [c.name for c in outside.OUTSIDE_CASES]
    assert len(names) == len(set(names)) >= 15
    assert not set(names) & {c.name for c in base.BENCH_CASES}
    again = outside.suite()
    assert [c.name for c in again.bench_cases] == names  # no draw at call time
    ref = base.suite()
    assert again.name == f"{ref.name}_outside" and again.variants is None
    assert again.kernel_sources == ref.kernel_sources and again.run_ours is ref.run_ours
    assert again.check_cases == ref.check_cases and again.comparators is ref.comparators
    assert f"{ref.name}_outside" in PENDING_SUITE_MODULES


def test_gemm_sample_takes_the_left_out_projections_at_other_sizes():
    suite_rows = {(c.params["m"], c.group) for c in gemm.BENCH_CASES}
    sources = {c.params["source"] for c in go.OUTSIDE_CASES}
    assert len(sources) == len(gemm.projections())  # every projection once
    for c in go.OUTSIDE_CASES:
        m = c.params["m"]
        if c.group == "decode":
            assert m in go.OUTSIDE_DECODE_M and m not in gemm.DECODE_M
        elif c.group == "prefill":
            assert m in go.OUTSIDE_PREFILL_M and m not in gemm.PREFILL_M
        else:
            assert c.group == "ragged" and m % 8 and (m, "ragged") not in suite_rows


def test_attention_sample_covers_both_masks_and_every_form():
    groups = {c.group for c in ao.OUTSIDE_CASES}
    assert groups == {"llm", "diffusion", "chunked", "varlen"}
    assert all(not c.params["causal"] for c in ao.OUTSIDE_CASES if c.group == "diffusion")
    dims = {(c.params["d"], c.params["dv"]) for c in ao.OUTSIDE_CASES}
    assert {(64, 64), (96, 96), (128, 128), (192, 128), (256, 256)} <= dims
