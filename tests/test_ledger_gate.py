"""No kernel lands without GPU evidence.

For every operator suite, a ledger under benchmarks/results/ must hold a passed `check` run on
the current kernel sources (`forgekernel check <op>` on a GPU writes it). Edit a kernel and this
fails until the check is rerun on a GPU.
"""

from __future__ import annotations

import pytest

from forgekernel.bench.ledger import ledger_status
from forgekernel.bench.suites import SUITE_MODULES, get_suite


@pytest.mark.parametrize("op", sorted(SUITE_MODULES))
def test_kernel_has_gpu_evidence(op):
    ok, reason = ledger_status(get_suite(op))
    assert ok, reason
