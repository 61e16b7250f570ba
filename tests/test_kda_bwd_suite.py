"""The kda_bwd suite on the CPU: its judge passes on the sanitize cases with the op's interim
backward (CPU tensors take it; the forward kernel is not run: the suite times the backward
alone), refuses a wrong gradient, the `interim` variant (the two smallest bench cases) takes
the interim path, the fp64 reference switches to the chunked backward above RECURRENT_UP_TO
tokens, its cases are well formed (unique names, >= 3 sanitize cases), and it is registered."""

from __future__ import annotations

import pytest
import torch
from test_gdn_bwd_suite import interim_variant_cases, interim_variant_path

from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import kda_bwd
from forgekernel.ops import kda_bwd as bwd_op


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(bwd_op, "check_cuda", lambda name, t: None)


def _inputs(case, seed=0):
    return kda_bwd.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(seed))  # fmt: skip


@pytest.mark.parametrize("case", kda_bwd.SANITIZE_CASES, ids=lambda c: c.name)
def test_check_passes_with_the_interim_backward(cpu, case):
    suite = kda_bwd.suite()
    out, cmps = verify(suite, _inputs(case), torch.device("cpu"))
    want = 6 if case.params["state"] else 5
    assert len(out) == len(cmps) == want
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def test_judge_refuses_a_wrong_gradient(cpu):
    case = kda_bwd._case([40, 3], 1, 2)
    inputs = _inputs(case, seed=1)
    outs = list(kda_bwd.run_ours(inputs, None))
    outs[3] = outs[3] * 1.1  # dg 10% off
    verdicts = kda_bwd.judge(inputs, tuple(outs))
    assert [v["ok"] for v in verdicts] == [True, True, True, False, True, True]
    assert "dg" in verdicts[3]["message"]


def test_long_cases_take_the_chunked_reference(cpu, monkeypatch):
    case = kda_bwd._case([70, 5], 1, 2, strong=True)
    inputs = _inputs(case, seed=2)
    short = kda_bwd.reference(inputs)
    monkeypatch.setattr(kda_bwd, "RECURRENT_UP_TO", 10)
    long = kda_bwd.reference(inputs)
    for a, b in zip(short, long):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cases_are_well_formed():
    names = [c.name for c in (*kda_bwd.BENCH_CASES, *kda_bwd.CHECK_CASES)]
    assert len(names) == len(set(names))
    assert len(kda_bwd.SANITIZE_CASES) >= 3
    assert any(0 in c.params["lens"] for c in kda_bwd.SANITIZE_CASES)
    assert any(c.params["strong"] for c in kda_bwd.SANITIZE_CASES)
    for case in kda_bwd.BENCH_CASES:
        assert all(n > 0 for n in case.params["lens"]), case.name
        assert case.params["hv"] % case.params["h"] == 0
        assert kda_bwd.flops(case) > 0 and kda_bwd.nbytes(case, torch.bfloat16) > 0
    sources = kda_bwd.kernel_sources()
    assert all(p.is_file() for p in sources)
    names = {p.as_posix() for p in sources}
    wy = ("kda_bwd_wy/sm90/wy_grads.py", "reference/kda_bwd_wy.py")  # WY_IN_KERNEL's
    for tail in wy:
        assert any(n.endswith(tail) for n in names), tail


def test_registered():
    assert suites.SUITE_MODULES["kda_bwd"] == "forgekernel.bench.suites.kda_bwd"


def test_interim_variant_on_the_two_smallest_cases_only():
    interim_variant_cases(kda_bwd)


def test_interim_variant_takes_the_interim_path(cpu, monkeypatch):
    # one sequence: the kernel path without a host read
    interim_variant_path(kda_bwd, bwd_op, _inputs(kda_bwd.CHECK_CASES[1]), monkeypatch)
