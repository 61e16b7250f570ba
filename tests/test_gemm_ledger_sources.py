"""The GEMM and FP8 GEMM ledgers' keys cover the chooser: a change to the configuration tables,
the plan, the launcher or the op moves them, as a kernel change does."""

from forgekernel.bench.suites import gemm, gemm_fp8
from forgekernel.kernels.gemm.dense.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8_SPEC
from forgekernel.runtime.hashing import PACKAGE_ROOT


def _names(sources):
    return {p.resolve().relative_to(PACKAGE_ROOT).as_posix() for p in sources}


def test_the_ledger_hashes_the_kernel_and_its_chooser():
    sources = gemm.suite().kernel_sources
    names = _names(sources)
    assert {"kernels/gemm/dense/sm90/config.py", "kernels/gemm/dense/sm90/plan.py",
            "kernels/gemm/dense/sm90/launch.py", "ops/gemm.py"} <= names  # fmt: skip
    assert set(SPEC.sources) <= set(sources) and len(set(sources)) == len(sources)


def test_the_fp8_ledger_hashes_the_kernel_and_its_chooser():
    sources = gemm_fp8.suite().kernel_sources
    names = _names(sources)
    assert {"kernels/gemm/fp8/sm90/config.py", "kernels/gemm/fp8/sm90/launch.py",
            "ops/gemm_fp8.py"} <= names  # fmt: skip
    assert set(FP8_SPEC.sources) <= set(sources) and len(set(sources)) == len(sources)
