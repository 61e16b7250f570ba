"""The gdn_decode suite's FlashInfer comparator and its definition-form cases (issue 20), on the
CPU: the comparators dict without fla / flashinfer installed (None entries, a broken import
included), distinct case names, our run on the definition form (the step kernel's algorithm
standing in, tests/test_gdn_step.py) equal to op.gdn_mtp_flashinfer's, the suite's own check
on the new cases in both dtypes, and the comparator wired to a stand-in of FlashInfer 0.7.2.post1
(`flashinfer.gdn_decode`, the signatures and in-place semantics read in its source, computed by
our fp64 reference): same output as the reference within the check's criterion, its own state
copy updated like ours. The `gpu` test runs the real FlashInfer the same way."""

from __future__ import annotations

import importlib
import sys
import types

import pytest
import torch
from test_gdn_step import _kernel as step_kernel  # the step kernel's algorithm on the CPU

from forgekernel.bench import check
from forgekernel.bench.suites import gdn_decode
from forgekernel.kernels.linear_attention.gdn_decode.sm90 import launch as gdn_launch
from forgekernel.reference.delta_rule import gated_delta_rule_step as step_ref
from forgekernel.reference.gdn_flashinfer import flashinfer_gating

op = importlib.import_module("forgekernel.ops.gated_delta_rule")
DEF_CHECK = [c for c in gdn_decode.CHECK_CASES if c.params.get("gates")]
FLA_CHECK = [c for c in gdn_decode.CHECK_CASES if not c.params.get("gates")]


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(gdn_launch, "get_kernel", lambda spec, params: step_kernel(dict(params)))
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)


def _inputs(case, dtype=torch.bfloat16, device="cpu", seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    return gdn_decode.make_inputs(case, dtype, torch.device(device), gen)


# ----------------------------------------------------------------------------- the suite


def test_comparators_are_none_without_a_gpu():
    assert gdn_decode.comparators() == {"fla": None, "flashinfer": None}


def _broken(name):
    mod = types.ModuleType(name)

    def fail(attr):
        raise RuntimeError("libcuda.so: cannot open shared object file")

    mod.__getattr__ = fail
    return mod


@pytest.mark.parametrize("broken", [False, True])
def test_comparators_are_none_when_not_importable(monkeypatch, broken):
    """A GPU process without fla / flashinfer (or with a flashinfer whose import fails)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setitem(sys.modules, "fla", None)
    if broken:
        monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
        monkeypatch.setitem(sys.modules, "flashinfer.gdn_decode", _broken("flashinfer.gdn_decode"))
    else:
        monkeypatch.setitem(sys.modules, "flashinfer", None)
    assert gdn_decode.comparators() == {"fla": None, "flashinfer": None}


def test_case_names_are_distinct_and_forms_tagged():
    for cases in (gdn_decode.BENCH_CASES, gdn_decode.CHECK_CASES):
        names = [c.name for c in cases]
        assert len(set(names)) == len(names), names
    defs = [c for c in gdn_decode.BENCH_CASES if c.params.get("gates")]
    assert {c.group for c in defs} == {"def-decode", "def-mtp"}
    assert all("-gates" in c.name for c in defs)
    assert any(c.params["verify"] for c in defs) and any(c.params["t"] == 1 for c in defs)
    assert all(c.params["k_last"] and not c.params["l2norm"] for c in defs)
    sanitized = {c.name for c in gdn_decode.SANITIZE_CASES}
    assert any(c.name in sanitized for c in DEF_CHECK if c.params["verify"])
    with pytest.raises(ValueError, match="T > 1"):
        gdn_decode._def_case(4, 1, 4, 8, verify=True)


def test_bytes_count_the_per_token_states_of_verify_cases():
    state = 8 * 128 * 128 * 4.0
    upd, ver = gdn_decode._def_case(2, 4, 4, 8), gdn_decode._def_case(2, 4, 4, 8, verify=True)
    assert gdn_decode.nbytes(upd, torch.bfloat16) == 2 * 2 * state
    assert gdn_decode.nbytes(ver, torch.bfloat16) == 2 * 5 * state


def test_definition_inputs_mean_their_gating():
    i = _inputs(DEF_CHECK[0])
    g, beta = flashinfer_gating(i["A_log"], i["a"], i["dt_bias"], i["b"])
    assert torch.equal(i["g"], g) and torch.equal(i["beta"], beta)
    assert i["a"].dtype == i["b"].dtype == i["q"].dtype == torch.bfloat16
    norms = i["k"].float().norm(dim=-1)
    assert float((norms - 1).abs().max()) < 1e-2  # unit-norm k: no l2norm in the kernel
    assert torch.equal(i["rows"], torch.arange(i["q"].shape[0], dtype=torch.int32))
    assert torch.equal(i["state"], i["state_work"]) and i["state"] is not i["state_work"]


@pytest.mark.parametrize("case", DEF_CHECK, ids=lambda c: c.name)
def test_run_ours_is_the_mtp_adapter_with_out(cpu_kernel, case):
    i = _inputs(case)
    pool, inter = i["state"].clone(), None if i["inter"] is None else torch.zeros_like(i["inter"])
    want, _ = op.gdn_mtp_flashinfer(i["q"], i["k"], i["v"], pool, i["rows"], i["A_log"], i["a"],
                                    i["dt_bias"], i["b"], None, inter,
                                    disable_state_update=i["verify"])  # fmt: skip
    out = check.poison(gdn_decode.alloc_out(i))
    assert gdn_decode.run_ours(i, out) is out
    assert torch.equal(out, want)
    assert torch.equal(i["state_work"], pool)
    assert torch.equal(i["state_work"], i["state"]) == i["verify"]  # verify keeps the state
    if inter is not None:
        assert torch.equal(i["inter"], inter)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DEF_CHECK, ids=lambda c: c.name)
def test_suite_check_passes_on_definition_cases(cpu_kernel, case, dtype):
    suite = gdn_decode.suite()
    _, cmps = check.verify(suite, _inputs(case, dtype), torch.device("cpu"))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


# ----------------------------------------------------------------------------- the comparator


def _fake_flashinfer(calls: list):
    """flashinfer.gdn_decode 0.7.2.post1's two entry points as read in its source (parameter
    names and order, the k-last fp32 state / pool updated in place, the per-batch-row buffer),
    computed by the fp64 reference; `calls` records the keyword arguments."""

    def gated_delta_rule_decode_pretranspose(
        q, k, v, state, A_log, a, dt_bias, b, scale=None, output=None, use_qk_l2norm=True,
        initial_state=None, initial_state_indices=None, output_state_indices=None,
        intermediate_states_buffer=None, disable_state_update=False, backend="auto",
    ):  # fmt: skip
        calls.append({"fn": "decode", "use_qk_l2norm": use_qk_l2norm, "scale": scale})
        bsz, t, _, dk = q.shape
        assert t == 1 and initial_state is None and state.dtype == torch.float32
        assert state.shape == (bsz, v.shape[2], v.shape[3], dk)
        g, beta = flashinfer_gating(A_log, a, dt_bias, b)
        o = step_ref(q, k, v, g, beta, state, scale=scale, use_qk_l2norm=use_qk_l2norm,
                     k_last=True)  # fmt: skip
        return output.copy_(o), state

    def gated_delta_rule_mtp(
        q, k, v, initial_state, initial_state_indices, A_log, a, dt_bias, b, scale=None,
        output=None, intermediate_states_buffer=None, ssm_state_indices=None,
        disable_state_update=None, use_qk_l2norm=True, output_state_indices=None,
        cache_replayssm=False, replayssm_rawv=None, replayssm_rawk=None, replayssm_g=None,
        replayssm_beta=None,
    ):  # fmt: skip
        calls.append({"fn": "mtp", "use_qk_l2norm": use_qk_l2norm, "scale": scale,
                      "disable_state_update": disable_state_update})  # fmt: skip
        assert initial_state_indices.dtype == torch.int32 and q.shape[1] > 1
        rows, buf = initial_state_indices, intermediate_states_buffer
        pool = initial_state.clone() if disable_state_update else initial_state
        per_row = None if buf is None else torch.zeros(pool.shape[0], *buf.shape[1:])
        g, beta = flashinfer_gating(A_log, a, dt_bias, b)
        o = step_ref(q, k, v, g, beta, pool, scale=scale, use_qk_l2norm=use_qk_l2norm,
                     state_indices=rows, k_last=True, intermediate_states=per_row)  # fmt: skip
        if buf is not None:
            buf[: q.shape[0]] = per_row[rows.long()]  # theirs is indexed by batch row
        return output.copy_(o), initial_state

    mod = types.ModuleType("flashinfer.gdn_decode")
    mod.gated_delta_rule_decode_pretranspose = gated_delta_rule_decode_pretranspose
    mod.gated_delta_rule_mtp = gated_delta_rule_mtp
    return mod


@pytest.fixture
def fake_flashinfer(monkeypatch):
    calls: list = []
    monkeypatch.setitem(sys.modules, "flashinfer", types.ModuleType("flashinfer"))
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_decode", _fake_flashinfer(calls))
    run = gdn_decode._flashinfer()
    assert run is not None
    return run, calls


def _close(x, y, rel=1e-5):
    return float((x - y).abs().max()) <= rel * float(y.abs().max()) + 1e-6


@pytest.mark.parametrize("case", DEF_CHECK, ids=lambda c: c.name)
def test_flashinfer_comparator_computes_ours(cpu_kernel, fake_flashinfer, case):
    run, calls = fake_flashinfer
    suite = gdn_decode.suite()
    i = _inputs(case)
    state0 = i["state"].clone()
    ref, low = check.expected(suite, i)
    for step in range(2):  # the check's first call, then a timed call continuing the state
        out = gdn_decode.run_ours(i, check.poison(gdn_decode.alloc_out(i)))
        theirs = run(i)
        if step == 0:
            cmp = check.compare(theirs, ref[0], low[0], atol=suite.atol)
            assert cmp.ok, cmp.message
        assert _close(theirs.float(), out.float(), 1e-2)
        state, _, inter = i["flashinfer"]
        assert _close(state, i["state_work"])
        if inter is not None:
            assert _close(inter, i["inter"])
    assert torch.equal(i["state"], state0)  # the set's own state is never touched
    assert torch.equal(state, state0) == i["verify"]
    fn = "decode" if case.params["t"] == 1 else "mtp"
    assert calls[-1]["fn"] == fn and calls[-1]["use_qk_l2norm"] is False
    assert calls[-1]["scale"] is None
    if fn == "mtp":
        assert calls[-1]["disable_state_update"] is i["verify"]  # explicit: no deprecation


def test_each_comparator_refuses_the_other_form(fake_flashinfer, monkeypatch):
    run, _ = fake_flashinfer
    with pytest.raises(NotImplementedError, match="projections"):
        run(_inputs(FLA_CHECK[0]))
    fla_mod = types.ModuleType("fla.ops.gated_delta_rule")
    fla_mod.fused_recurrent_gated_delta_rule = lambda *a, **kw: pytest.fail("fla was called")
    monkeypatch.setitem(sys.modules, "fla", types.ModuleType("fla"))
    monkeypatch.setitem(sys.modules, "fla.ops", types.ModuleType("fla.ops"))
    monkeypatch.setitem(sys.modules, "fla.ops.gated_delta_rule", fla_mod)
    with pytest.raises(NotImplementedError, match="g / beta"):
        gdn_decode._fla()(_inputs(DEF_CHECK[0]))


@pytest.mark.gpu
@pytest.mark.parametrize(
    "case",
    [*DEF_CHECK, *(c for c in gdn_decode.BENCH_CASES if c.params.get("gates"))],
    ids=lambda c: c.name,
)
def test_real_flashinfer_matches_the_reference_and_ours(case):
    """On the H200: FlashInfer's output within the check's criterion of the reference on the
    first call, and its state copy (or per-token states) equal to ours after two calls."""
    pytest.importorskip("flashinfer.gdn_decode")
    run = gdn_decode._flashinfer()
    suite = gdn_decode.suite()
    i = _inputs(case, device="cuda")
    ref, low = check.expected(suite, i)
    theirs = run(i).clone()
    torch.cuda.synchronize()
    cmp = check.compare(theirs, ref[0], low[0], atol=suite.atol)
    assert cmp.ok, cmp.message
    for _ in range(2):
        gdn_decode.run_ours(i, gdn_decode.alloc_out(i))
    run(i)
    torch.cuda.synchronize()
    state, _, inter = i["flashinfer"]
    assert _close(state, i["state_work"], 1e-4)
    if inter is not None:
        assert _close(inter, i["inter"], 1e-4)
