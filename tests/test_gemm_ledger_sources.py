"""The GEMM ledger's key covers the chooser: a change to the configuration tables, the plan, the
launcher or the op moves it, as a kernel change does."""

from forgekernel.bench.suites import gemm
from forgekernel.kernels.gemm.dense.sm90 import SPEC


def test_the_ledger_hashes_the_kernel_and_its_chooser():
    sources = gemm.suite().kernel_sources
    names = {(p.parent.name, p.name) for p in sources}
    assert {("sm90", "config.py"), ("sm90", "plan.py"), ("sm90", "launch.py"),
            ("ops", "gemm.py")} <= names  # fmt: skip
    assert set(SPEC.sources) <= set(sources) and len(set(sources)) == len(sources)
