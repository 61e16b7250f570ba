"""Every operator on the GPU, quickly: each suite's sanitize cases (small, odd-sized, one per
kernel variant: gemm's configurations and B layouts; attention fixed and varlen, GQA, causal, every
head dim; the backward's head dims, varlen and deterministic mode) in fp16 and bf16 against the
fp32 reference, with `forgekernel check`'s own criterion and NaN-poisoned outputs
(`check.check_case`); deterministic cases must also give the same bits over `check.REPEATS` runs.
"""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.check import REPEATS, check_case
from forgekernel.bench.report import dtype_name
from forgekernel.bench.suites import all_suites

pytestmark = pytest.mark.gpu

SUITES = all_suites()
CASES = [
    pytest.param(op, case, dtype, id=f"{op}-{case.name}-{dtype_name(dtype)}")
    for op, suite in SUITES.items()
    for case in suite.sanitize_cases
    for dtype in suite.dtypes
]


@pytest.mark.parametrize("op, case, dtype", CASES)
def test_matches_the_fp32_reference(op, case, dtype):
    suite = SUITES[op]
    rec = check_case(suite, case, dtype, torch.device("cuda"), seed=0)
    assert rec["passed"], rec["message"]
    if suite.is_repeatable(case):
        assert rec["repeat"] == {"runs": REPEATS, "bitwise_identical": True}
