"""The gdn_bwd suite on the CPU: its judge passes on every check case with the op's interim
backward (CPU tensors take it; the forward kernel is not run: the suite times the backward
alone), the `interim` variant (the two smallest bench cases) takes the interim path, the
switch A/B variants (`no_fused_slots`, `no_groupsum` on 4x8192-h16-hv32) run ours with their
switch off, the fp64 reference switches to the chunked backward above RECURRENT_UP_TO tokens,
its cases are well formed, and it is registered."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gdn_bwd
from forgekernel.ops import gated_delta_rule_bwd as bwd_op


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(bwd_op, "check_cuda", lambda name, t: None)


def _inputs(case, seed=0):
    return gdn_bwd.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(seed))  # fmt: skip


@pytest.mark.parametrize("case", gdn_bwd.CHECK_CASES[:3], ids=lambda c: c.name)
def test_check_passes_with_the_interim_backward(cpu, case):
    suite = gdn_bwd.suite()
    out, cmps = verify(suite, _inputs(case), torch.device("cpu"))
    want = 6 if case.params["state"] else 5
    assert len(out) == len(cmps) == want
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def test_judge_refuses_a_wrong_gradient(cpu):
    case = gdn_bwd.CHECK_CASES[0]
    inputs = _inputs(case, seed=1)
    outs = list(gdn_bwd.run_ours(inputs, None))
    outs[3] = outs[3] * 1.1  # dg 10% off
    verdicts = gdn_bwd.judge(inputs, tuple(outs))
    assert [v["ok"] for v in verdicts] == [True, True, True, False, True, True]
    assert "dg" in verdicts[3]["message"]


def test_long_cases_take_the_chunked_reference(cpu, monkeypatch):
    case = gdn_bwd._case([70, 5], 1, 2)
    inputs = _inputs(case, seed=2)
    short = gdn_bwd.reference(inputs)
    monkeypatch.setattr(gdn_bwd, "RECURRENT_UP_TO", 10)
    long = gdn_bwd.reference(inputs)
    for a, b in zip(short, long):
        torch.testing.assert_close(a, b, rtol=1e-9, atol=1e-9)


def test_cases_are_well_formed():
    names = [c.name for c in (*gdn_bwd.BENCH_CASES, *gdn_bwd.CHECK_CASES)]
    assert len(names) == len(set(names))
    for case in gdn_bwd.BENCH_CASES:
        assert all(n > 0 for n in case.params["lens"]), case.name
        assert case.params["hv"] % case.params["h"] == 0
        assert gdn_bwd.flops(case) > 0 and gdn_bwd.nbytes(case, torch.bfloat16) > 0
    assert {(c.params["h"], c.params["hv"]) for c in gdn_bwd.BENCH_CASES} >= {(16, 32), (16, 16)}
    assert all(p.is_file() for p in gdn_bwd.kernel_sources())


def test_registered_since_its_gpu_check():
    assert suites.SUITE_MODULES["gdn_bwd"] == "forgekernel.bench.suites.gdn_bwd"
    assert "gdn_bwd" not in suites.PENDING_SUITE_MODULES


def test_autograd_backward_gives_a_chunked_forwards_gradients_in_the_suites_order():
    """The comparators' backward runner (fla's, FlashQLA's, in this process or a sidecar) on a
    stand-in forward of fla's signature (the fp64 recurrence): the judge passes on its outputs,
    and the forward is recorded once per input set, never again."""
    from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

    calls = []

    def chunk(*args, **kw):
        calls.append(1)
        return gated_delta_rule_recurrent(*args, **kw)

    case = gdn_bwd.CHECK_CASES[0]  # varlen, with an initial state: six gradients
    inputs = _inputs(case, seed=3)
    run = gdn_bwd.autograd_backward(chunk)
    grads = run(inputs)
    assert len(grads) == 6 and torch.equal(run(inputs)[0], grads[0]) and len(calls) == 1
    verdicts = gdn_bwd.judge(inputs, grads)
    assert all(v["ok"] for v in verdicts), [v["message"] for v in verdicts]


def interim_variant_cases(suite_mod) -> None:
    """`interim` on the two bench cases of fewest tokens (the interim path is slow), not on
    the others or the check cases (shared with tests/test_kda_bwd_suite.py)."""
    smallest = sorted(suite_mod.BENCH_CASES, key=lambda c: sum(c.params["lens"]))[:2]
    for case in (*suite_mod.BENCH_CASES, *suite_mod.CHECK_CASES):
        assert ("interim" in suite_mod.suite().variants_for(case)) == (case in smallest), case.name


def interim_variant_path(suite_mod, op, inputs, monkeypatch) -> None:
    """With the kernel path open to these CPU tensors (the switch unset, `KERNEL_DEVICES`
    widened), ours reaches it and the `interim` variant does not: the interim path, within the
    suite's judge; the switch is the default again after it (shared with
    tests/test_kda_bwd_suite.py)."""
    monkeypatch.delenv(op.KERNEL_SWITCH, raising=False)
    monkeypatch.setattr(op, "KERNEL_DEVICES", ("cuda", "cpu"))
    taken = []

    def kernel(*args):
        taken.append(1)
        raise RuntimeError("kernel path")

    monkeypatch.setattr(op, "_backward_kernel", kernel)
    with pytest.raises(RuntimeError, match="kernel path"):
        suite_mod.run_ours(inputs, None)
    assert taken == [1]
    out, cmps = verify(suite_mod.suite(), inputs, torch.device("cpu"), run=suite_mod.run_interim)
    assert taken == [1] and all(c.ok for c in cmps), [c.message for c in cmps]
    assert op.kernel_selected()


def test_interim_variant_on_the_two_smallest_cases_only():
    interim_variant_cases(gdn_bwd)


def test_switch_variants(monkeypatch):
    """`no_fused_slots` and `no_groupsum` on 4x8192-h16-hv32 only (no other bench or check
    case): ours with FUSED_SLOTS / FUSED_GROUPSUM False during the call (a graph capture inside
    it records that route), the other switch and both afterwards as they were."""
    seen = []

    def ours(inputs, out):
        seen.append((bwd_op.FUSED_SLOTS, bwd_op.FUSED_GROUPSUM))
        return "grads"

    monkeypatch.setattr(gdn_bwd, "run_ours", ours)
    suite = gdn_bwd.suite()
    for case in (*gdn_bwd.BENCH_CASES, *gdn_bwd.CHECK_CASES):
        names = [n for n in suite.variants_for(case) if n != "interim"]
        want = ["no_fused_slots", "no_groupsum"] if case.name == "4x8192-h16-hv32" else []
        assert names == want, case.name
    runs = suite.variants_for(gdn_bwd.BENCH_CASES[2])
    assert runs["no_fused_slots"]({}, None) == runs["no_groupsum"]({}, None) == "grads"
    assert seen == [(False, True), (True, False)]
    assert bwd_op.FUSED_SLOTS is True and bwd_op.FUSED_GROUPSUM is True


def test_interim_variant_takes_the_interim_path(cpu, monkeypatch):
    # one sequence: the kernel path without a host read
    interim_variant_path(gdn_bwd, bwd_op, _inputs(gdn_bwd.CHECK_CASES[1]), monkeypatch)


@pytest.mark.parametrize(
    ("version", "major", "refused"),
    [
        ("3.6.0", 9, True),
        ("3.4.0", 9, True),
        ("3.7.1", 9, False),
        ("3.6.0", 8, False),
        ("3.3.1", 9, False),
    ],
)
def test_fla_refusal_known_before_its_first_call(monkeypatch, version, major, refused):
    """In this process fla's gated backward refuses triton >= 3.4.0, < 3.7.1 on Hopper: the
    comparator says so at its first call, without running (and autotuning) fla's forward."""
    import sys
    from types import SimpleNamespace

    monkeypatch.setitem(sys.modules, "triton", SimpleNamespace(__version__=version))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: (major, 0))
    monkeypatch.delenv(gdn_bwd.TRITON_SITE_ENV, raising=False)
    why = gdn_bwd.fla_refusal()
    assert (why is not None) == refused
    ran = []
    monkeypatch.setattr(gdn_bwd, "fla_backward", lambda: lambda inputs: ran.append(1))
    comp = gdn_bwd._fla()
    if refused:
        assert "fla #640" in why and gdn_bwd.TRITON_SITE_ENV in why
        with pytest.raises(RuntimeError, match="refuses its gated backward"):
            comp({})
        assert ran == []
    else:
        comp({})
        assert ran == [1]
    monkeypatch.setattr(gdn_bwd, "fla_backward", lambda: None)
    assert gdn_bwd._fla() is None  # fla not installed: missing, whatever triton says
