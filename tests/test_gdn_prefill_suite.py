"""The pending gdn_prefill suite on the CPU: its own check (`bench.check.verify`) passes on every
check case with the chunked algorithm standing in for the kernel (tests/test_gdn_prefill.py),
its cases are well formed, and it is registered as pending only."""

from __future__ import annotations

import pytest
import torch
from test_gdn_prefill import cpu_kernel  # noqa: F401  (the fixture; tests/ is on sys.path)

from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gdn_prefill


@pytest.mark.parametrize("case", gdn_prefill.CHECK_CASES, ids=lambda c: c.name)
def test_check_passes_on_the_algorithm(cpu_kernel, case):  # noqa: F811
    suite = gdn_prefill.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert cmps and all(c.ok for c in cmps), [c.message for c in cmps]


def test_cases_are_well_formed():
    names = [c.name for c in (*gdn_prefill.BENCH_CASES, *gdn_prefill.CHECK_CASES)]
    assert len(names) == len(set(names))
    for case in gdn_prefill.BENCH_CASES:
        lens = case.params["lens"]
        assert all(n > 0 for n in lens) and 4096 <= sum(lens) <= 65536, case.name
        assert case.params["hv"] % case.params["h"] == 0
        assert gdn_prefill.flops(case) > 0 and gdn_prefill.nbytes(case, torch.bfloat16) > 0
    assert {(c.params["h"], c.params["hv"]) for c in gdn_prefill.BENCH_CASES} >= {(16, 32), (4, 8)}


def test_registered_since_its_first_gpu_check():
    """Registered since its first GPU check passed (2026-12-01)."""
    assert suites.SUITE_MODULES["gdn_prefill"] == "forgekernel.bench.suites.gdn_prefill"
    assert "gdn_prefill" not in suites.PENDING_SUITE_MODULES
