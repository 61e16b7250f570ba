"""The kda_prefill and kda_bwd suites' `cudnn` comparators on the CPU, against a fake
`cudnn.linear_attention.ops.kda` (injected through sys.modules) that checks what cuDNN's op
checks and more (THD shapes, dtypes, packed strides, the state as [N, HO, V, K]) and computes
the math with our fp32 recurrence in cuDNN's layouts: the forward's o equals the reference's,
the backward's gradients pass the suite's own judge (and fail it with the state read in the
wrong orientation), the state is converted once per input set, the record's `ran` names the
planner's engine and the sm90 engines' declines, a refusal is a NotImplementedError with those
reasons, and an absent or partial cudnn package gives None or a clear reason."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from forgekernel.bench import harness
from forgekernel.bench.suites import cudnn_kda, kda_bwd, kda_prefill
from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent

DECLINES = {
    "kda_hopper_cuda": "KdaHopperCudaEngine: the backward kernel needs equal head counts",
    "kda_hopper": "KdaHopperEngine: forward only; there is no Hopper KDA backward kernel yet",
    "kda_frost": "KdaFrostEngine: requires SM100",
}


class NotSupported(Exception):
    """Stands in for cudnn.cudnnGraphNotSupportedError (matched by name)."""


NotSupported.__name__ = "cudnnGraphNotSupportedError"


class FakeGraph:
    """What cudnn_kda reads of a planned pygraph."""

    def __init__(self, engines: list[str], declined: dict[str, str]):
        self.engines, self.declined = engines, declined
        self.plans = list(engines)
        self.selected_engine = types.SimpleNamespace(name=engines[0]) if engines else None

    def get_plan_name_at_index(self, i: int) -> str:
        return self.engines[i]

    def _candidate_engines(self):
        return [*self.engines, *self.declined]


def _packed(name: str, t: torch.Tensor, shape: tuple, dtype: torch.dtype) -> None:
    assert tuple(t.shape) == shape, (name, tuple(t.shape), shape)
    assert t.dtype == dtype, (name, t.dtype, dtype)
    assert t.is_contiguous(), (name, t.stride())


def _check_thd(q, k, v, g, beta, cu, scale, state, calls) -> tuple[int, int, int, int]:
    """cuDNN's contract on the forward's and backward's shared operands; (T, H, HV, N)."""
    total, h, d = q.shape
    hv, n = v.shape[1], cu.shape[0] - 1
    _packed("q", q, (total, h, 128), torch.bfloat16)
    _packed("k", k, (total, h, 128), torch.bfloat16)
    _packed("v", v, (total, hv, 128), torch.bfloat16)
    _packed("g", g, (total, hv, 128), torch.float32)  # HO = max(H, HV) = HV
    _packed("beta", beta, (total, hv), torch.float32)
    _packed("cu_seqlens", cu, (n + 1,), torch.int32)
    assert int(cu[0]) == 0 and int(cu[-1]) == total
    assert scale == pytest.approx(d**-0.5, abs=1e-12)
    if state is not None:
        _packed("initial_state", state, (n, hv, 128, 128), torch.float32)
    calls.append({"state": state, "n": n})
    return total, h, hv, n


def _ours(t: torch.Tensor | None) -> torch.Tensor | None:
    """A [N, HO, V, K] state (cuDNN's docstring) as the reference's (N, HV, K, V)."""
    return None if t is None else t.transpose(-1, -2)


def _recurrence(q, k, v, g, beta, cu, state, dtype):
    o, final = kimi_delta_attention_recurrent(
        q[None], k[None], v[None], g[None], beta[None], initial_state=_ours(state),
        output_final_state=True, cu_seqlens=cu.long(), dtype=dtype,
    )  # fmt: skip
    return o[0], final.transpose(-1, -2)  # the final state back as [N, HO, V, K]


def _fake_ops(engines_fwd, engines_bwd, declined_bwd):
    """The fake module: kimi_delta_attention, kda_bwd and the two graph caches."""
    ops = types.ModuleType(cudnn_kda.OPS_MODULE)
    ops.fprop_cache, ops.bprop_cache, ops.calls = {}, {}, []

    def plan(cache, tag, q, k, v, cu, state, engines, declined):
        key = [tag, q.shape[0], cu.shape[0] - 1, q.shape[1], k.shape[1], v.shape[1], 128, 128]
        key += ["dtypes"] * (16 - len(key) if tag == "fprop" else 17 - len(key))
        key += [None if state is None else state.dtype, "flags"]
        cache[tuple(key)] = (FakeGraph(engines, declined), {})
        if not engines:
            raise NotSupported("no engine -- python or backend -- proposed a plan (kda_frost: ...")

    def kimi_delta_attention(q, k, v, g, beta, cu_seqlens, scale=None, initial_state=None,
                             output_final_state=False):  # fmt: skip
        _check_thd(q, k, v, g, beta, cu_seqlens, scale, initial_state, ops.calls)
        plan(ops.fprop_cache, "fprop", q, k, v, cu_seqlens, initial_state, engines_fwd, {})
        o, final = _recurrence(q, k, v, g, beta, cu_seqlens, initial_state, torch.float32)
        return o.to(q.dtype), final if output_final_state else final.new_empty(0)

    def kda_bwd(do, q, k, v, g, beta, cu_seqlens, scale, initial_state=None,
                d_final_state=None):  # fmt: skip
        total, h, hv, n = _check_thd(q, k, v, g, beta, cu_seqlens, scale, initial_state,
                                     ops.calls)  # fmt: skip
        _packed("dO", do, (total, hv, 128), q.dtype)
        _packed("d_final_state", d_final_state, (n, hv, 128, 128), torch.float32)
        plan(ops.bprop_cache, "bprop", q, k, v, cu_seqlens, initial_state, engines_bwd,
             declined_bwd)  # fmt: skip
        leaves = [x.double().requires_grad_() for x in (q, k, v, g, beta)]
        s0 = None if initial_state is None else initial_state.double().requires_grad_()
        o, final = _recurrence(*leaves, cu_seqlens, s0, torch.float64)
        loss = (o * do.double()).sum() + (final * d_final_state.double()).sum()
        grads = torch.autograd.grad(loss, leaves + ([s0] if s0 is not None else []))
        dq, dk, dv = (x.to(q.dtype) for x in grads[:3])
        dg, dbeta = grads[3].float(), grads[4].float()
        ds0 = grads[5].float() if s0 is not None else torch.empty(0)
        return dq, dk, dv, dg, dbeta, ds0, torch.empty(0), torch.empty(0)

    ops.kimi_delta_attention, ops.kda_bwd = kimi_delta_attention, kda_bwd
    return ops


def _install(monkeypatch, ops, *, heuristics=True):
    cudnn = types.ModuleType("cudnn")
    cudnn.__version__ = "1.32.0-fake"
    monkeypatch.setitem(sys.modules, "cudnn", cudnn)
    if ops is not None:
        monkeypatch.setitem(sys.modules, cudnn_kda.OPS_MODULE, ops)
    if heuristics:
        mod = types.ModuleType("cudnn.engines.heuristics")

        def decline_reasons(engines, graph):
            return dict(graph.declined), [e for e in engines if e not in graph.declined]

        mod.decline_reasons = decline_reasons
        monkeypatch.setitem(sys.modules, "cudnn.engines.heuristics", mod)


@pytest.fixture
def fake_cudnn(monkeypatch):
    """kda_hopper_cuda both ways where H = HV; the backward of H != HV on kda_cutile."""

    def install(engines_bwd=("kda_cutile",), declined_bwd=None):
        ops = _fake_ops(["kda_hopper_cuda", "kda_hopper", "kda_cutile"], list(engines_bwd),
                        DECLINES if declined_bwd is None else declined_bwd)  # fmt: skip
        _install(monkeypatch, ops)
        return ops

    return install


def _inputs(mod, case, seed=0):
    return mod.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                           torch.Generator().manual_seed(seed))  # fmt: skip


@pytest.mark.parametrize("case", kda_prefill.CHECK_CASES[:4], ids=lambda c: c.name)
def test_forward_gives_the_reference_output(fake_cudnn, case):
    ops = fake_cudnn()
    inputs = _inputs(kda_prefill, case)
    want = kda_prefill.reference(inputs)
    run = kda_prefill._cudnn()
    o = run(inputs)
    assert o.shape == inputs["v"].shape and o.dtype == torch.bfloat16
    torch.testing.assert_close(o.float(), want, atol=2e-2, rtol=2e-2)
    assert run(inputs) is not None and len(ops.calls) == 2
    if case.params["state"]:  # converted once per input set, ours left as it was
        first, second = (c["state"] for c in ops.calls)
        assert second is first and torch.equal(first, inputs["state"].transpose(-1, -2))
    assert run.ran(inputs).startswith("kda_hopper_cuda (plans kda_hopper_cuda > kda_hopper")


def test_forward_state_unset_raises_on_state_cases(fake_cudnn, monkeypatch):
    ops = fake_cudnn()
    monkeypatch.setattr(kda_prefill, "CUDNN_STATE_LAYOUT", None)
    run = kda_prefill._cudnn()
    state_case = next(c for c in kda_prefill.CHECK_CASES if c.params["state"])
    with pytest.raises(NotImplementedError, match="state layout unconfirmed"):
        run(_inputs(kda_prefill, state_case))
    nostate = next(c for c in kda_prefill.CHECK_CASES if not c.params["state"])
    assert run(_inputs(kda_prefill, nostate)).shape[2] == nostate.params["hv"]
    assert [c["state"] for c in ops.calls] == [None]


@pytest.mark.parametrize("case", kda_bwd.SANITIZE_CASES, ids=lambda c: c.name)
def test_backward_passes_the_suites_judge(fake_cudnn, case):
    fake_cudnn()
    inputs = _inputs(kda_bwd, case)
    outs = kda_bwd._cudnn()(inputs)
    assert len(outs) == (6 if case.params["state"] else 5)
    for got, want in zip(outs, kda_bwd._likes(inputs)):
        assert got.shape == want.shape, (got.shape, want.shape)
    verdicts = kda_bwd.judge(inputs, outs)
    assert all(v["ok"] for v in verdicts), [v["message"] for v in verdicts]


def test_backward_with_the_state_turned_fails_the_judge(fake_cudnn, monkeypatch):
    """The test can tell: our (K, V) state handed over as is is cuDNN's (V, K) transposed."""
    fake_cudnn()
    monkeypatch.setattr(kda_prefill, "CUDNN_STATE_LAYOUT", "kv")
    case = kda_bwd._case([40, 3], 1, 2)
    inputs = _inputs(kda_bwd, case, seed=1)
    inputs["state"] = inputs["state"] * 10  # a state that moves the result
    verdicts = kda_bwd.judge(inputs, kda_bwd._cudnn()(inputs))
    assert not all(v["ok"] for v in verdicts)


def test_backward_engine_and_declines_are_recorded(fake_cudnn):
    fake_cudnn()
    run = kda_bwd._cudnn()
    grouped = _inputs(kda_bwd, kda_bwd._case([30, 7], 2, 4))
    run(grouped)
    ran = harness._what_ran(run, grouped)
    assert ran.startswith("kda_cutile (plans kda_cutile; kda_hopper_cuda: KdaHopperCudaEngine:")
    assert "needs equal head counts" in ran and "kda_hopper: KdaHopperEngine: forward" in ran
    assert "kda_frost" not in ran and len(ran) <= 300


def test_a_refused_backward_is_missing_with_the_sm90_reasons(fake_cudnn):
    fake_cudnn(engines_bwd=())
    run = kda_bwd._cudnn()
    with pytest.raises(NotImplementedError, match="bprop refused: kda_hopper_cuda: .*equal head"):
        run(_inputs(kda_bwd, kda_bwd._case([30, 7], 2, 4)))


def test_an_error_that_is_no_refusal_is_not_reworded(fake_cudnn):
    ops = fake_cudnn()
    ops.kimi_delta_attention = lambda *a, **kw: 1 / 0
    with pytest.raises(ZeroDivisionError):
        kda_prefill._cudnn()(_inputs(kda_prefill, kda_prefill.CHECK_CASES[1]))


def test_ran_without_a_cached_graph_says_so(fake_cudnn):
    ops = fake_cudnn()
    run = kda_prefill._cudnn()
    inputs = _inputs(kda_prefill, kda_prefill.CHECK_CASES[1])
    run(inputs)
    ops.fprop_cache.clear()
    assert run.ran(inputs).startswith("unknown (no cached cuDNN graph")


def test_absent_or_partial_cudnn(monkeypatch):
    monkeypatch.setitem(sys.modules, "cudnn", None)  # not installed
    assert kda_prefill._cudnn() is None and kda_bwd._cudnn() is None
    _install(monkeypatch, None, heuristics=False)  # installed without the KDA op
    monkeypatch.setitem(sys.modules, cudnn_kda.OPS_MODULE, None)
    run = kda_bwd._cudnn()
    with pytest.raises(NotImplementedError, match="cudnn-frontend 1.32.0-fake: no cudnn"):
        run({})


def test_no_comparators_without_a_gpu():
    if not torch.cuda.is_available():
        assert kda_bwd.comparators() == {"fla": None, "cudnn": None}
