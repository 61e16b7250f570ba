"""The gated delta rule step's op and launcher on the CPU (the GPU's checks:
tests/gpu/test_gdn_step_gpu.py; the compiled kernels' structure: tests/test_gdn_compile.py):
the kernels' algorithms replayed through the real launcher against the fp64 reference: k-last
states on the row-streaming kernel (lane by lane, tests/test_gdn_rows.py), k-first ones on the
staged kernel (the tokens' q / k rows staged with the scale and l2norm folded in, per column of
the state the two dot products (D S)^T k and (D S)^T q over the old state, the delta update,
the output expanded as o = (D S)^T q + (k.q) u; l2norm with fla's eps); GDN and KDA decays, a
state pool, intermediate states, decays from none to total; and argument errors."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.bench.check import verify
from forgekernel.bench.suites import gdn_decode
from forgekernel.kernels.linear_attention.gdn_decode.sm90 import launch as gdn_launch
from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import L2NORM_EPS
from forgekernel.reference.delta_rule import gated_delta_rule_step as step_ref

op = importlib.import_module("forgekernel.ops.gated_delta_rule")


def _kernel(params):
    """The kernel the compile key names, on the CPU: the row-streaming kernel (step_rows.py,
    replayed lane by lane: tests/test_gdn_rows.py) when it carries `tokens`, else the staged
    kernel (step.py)."""
    from test_gdn_rows import rows_kernel

    return rows_kernel(params) if "tokens" in params else _staged_kernel(params)


def _staged_kernel(params):
    """The staged kernel's math in fp32, as step.py does it: each token's rows staged once (q
    with the scale and l2norm folded in, k with its l2norm, their dot product k.q, the decay
    d = exp(g) and beta; KDA: the rows d k and d q), then per token the two dot products over
    the old state p = (D S)^T k, r = (D S)^T q, u = beta (v - p), o = r + (k.q) u, and the
    update S <- D S + k u^T."""

    def fn(q, k, v, g, beta, state, rows, out, inter, a_log, dt_bias, scale):
        group = v.shape[2] // q.shape[2]
        if params.get("gating"):  # the projections a, b -> log decay, beta (step.py _gates)
            g = -a_log.exp() * torch.nn.functional.softplus(g.float() + dt_bias)
            beta = torch.sigmoid(beta.float())
        for b in range(q.shape[0]):
            for hv in range(v.shape[2]):
                r = int(rows[b])
                s = state[r, hv].clone()
                s = s.t() if params["k_last"] else s  # (K, V)
                for t in range(q.shape[1]):
                    qf = q[b, t, hv // group].float()
                    kf = k[b, t, hv // group].float()
                    if params["l2norm"]:
                        qf = qf * torch.rsqrt((qf * qf).sum() + L2NORM_EPS)
                        kf = kf * torch.rsqrt((kf * kf).sum() + L2NORM_EPS)
                    qf = qf * scale
                    kq = kf @ qf
                    d = g[b, t, hv].float().exp()
                    if params["per_channel"]:
                        p, rr = s.t() @ (d * kf), s.t() @ (d * qf)
                        decayed = s * d[:, None]
                    else:
                        p, rr = d * (s.t() @ kf), d * (s.t() @ qf)
                        decayed = s * d
                    u = beta[b, t, hv] * (v[b, t, hv].float() - p)
                    out[b, t, hv] = (rr + kq * u).to(out.dtype)
                    s = decayed + kf[:, None] * u[None, :]
                    if inter is not None:
                        inter[r, t, hv] = s.t() if params["k_last"] else s
                if params.get("update_state", True):
                    state[r, hv] = s.t() if params["k_last"] else s

    return fn


@pytest.fixture
def cpu_kernel(monkeypatch):
    monkeypatch.setattr(gdn_launch, "get_kernel", lambda spec, params: _kernel(dict(params)))
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)


def _inputs(b, t, h, hv, per_channel, k_last, n=None, seed=0):
    gen = torch.Generator().manual_seed(seed)
    dk = dv = 128
    q = torch.randn(b, t, h, dk, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, t, h, dk, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, t, hv, dv, generator=gen).to(torch.bfloat16)
    g_shape = (b, t, hv, dk) if per_channel else (b, t, hv)
    g = -torch.rand(*g_shape, generator=gen) * 0.5
    beta = torch.rand(b, t, hv, generator=gen)
    n = n or b
    state = torch.randn(n, hv, *((dv, dk) if k_last else (dk, dv)), generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("k_last", [True, False])
@pytest.mark.parametrize(("t", "l2norm", "pool"), [(1, False, False), (3, True, True),
                                                   (4, False, True)])  # fmt: skip
def test_step_matches_the_reference(cpu_kernel, per_channel, k_last, t, l2norm, pool):
    b, h, hv = 3, 2, 4
    q, k, v, g, beta, state = _inputs(b, t, h, hv, per_channel, k_last, n=5 if pool else None)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32) if pool else None
    inter = torch.zeros(state.shape[0], t, *state.shape[1:]) if pool else None
    want_state = state.clone()
    want_inter = None if inter is None else inter.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=l2norm, state_indices=rows,
                    k_last=k_last, intermediate_states=want_inter)  # fmt: skip
    got = op.gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=l2norm,
                                   state_indices=rows, k_last=k_last,
                                   intermediate_states=inter)  # fmt: skip
    assert got.dtype == torch.bfloat16
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    tol = 1e-5 * float(want_state.abs().max()) + 1e-6  # fp32 state against fp64
    assert float((state - want_state).abs().max()) <= tol
    if inter is not None:
        assert float((inter - want_inter).abs().max()) <= tol


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("g_value", [0.0, -30.0, None])  # none, total (e^-30), mixed per token
def test_expanded_output_is_fp32_exact_at_extreme_decays(per_channel, g_value):
    """o = (D S)^T q + (k.q) u against o = S_new^T q in fp64: the kernel's expansion loses
    nothing beyond fp32 rounding, whether the decay keeps the state, wipes it, or both."""
    b, t, h, hv = 2, 4, 2, 4
    q, k, v, g, beta, state = _inputs(b, t, h, hv, per_channel, True, seed=3)
    if g_value is None:
        g = g * 0 + torch.tensor([0.0, -30.0, -0.1, -5.0]).view(1, t, 1, *([1] * per_channel))
    else:
        g = torch.full_like(g, g_value)
    beta[0] = 1.0
    rows = torch.arange(b, dtype=torch.int32)
    params = {"k_last": True, "l2norm": True, "per_channel": per_channel}
    out = torch.empty(b, t, hv, 128)
    got_state = state.clone()
    _kernel(params)(q, k, v, g, beta, got_state, rows, out, None, None, None, 128**-0.5)
    want_state = state.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=True, k_last=True)
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert float((got_state - want_state).abs().max()) <= 1e-5 * float(want_state.abs().max())


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"t": 5}, ValueError, "T must be"),
        ({"g": torch.zeros(2, 1, 4, dtype=torch.bfloat16)}, TypeError, "g must have dtype"),
        ({"state": torch.zeros(2, 4, 64, 128)}, ValueError, "state must be"),
        ({"v": torch.zeros(2, 1, 3, 128, dtype=torch.bfloat16)}, ValueError, "HV a multiple"),
    ],
)
def test_bad_arguments(change, err, match):
    t = change.pop("t", 1)
    q, k, v, g, beta, state = _inputs(2, t, 2, 4, False, False)
    args = {"q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state, **change}
    with pytest.raises(err, match=match):
        op.gated_delta_rule_step(args["q"], args["k"], args["v"], args["g"], args["beta"],
                                 args["state"])  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"scale": float("inf")}, ValueError, "scale must be finite and >= 0"),
        ({"scale": "0.1"}, TypeError, "scale must be a float or None"),
        ({"use_qk_l2norm": "yes"}, TypeError, "use_qk_l2norm must be a bool"),
        ({"k_last": 1}, TypeError, "k_last must be a bool"),
    ],
)
def test_bad_scalars(cpu_kernel, kwargs, err, match):
    """The 2026-12-05 audit: scales and flags reached float() or the custom op's schema."""
    q, k, v, g, beta, state = _inputs(2, 1, 2, 4, False, False)
    before = state.clone()
    with pytest.raises(err, match=match):
        op.gated_delta_rule_step(q, k, v, g, beta, state, **kwargs)
    assert torch.equal(state, before)


def test_buffers_elsewhere_raise(cpu_kernel):
    """The 2026-12-05 audit: out and intermediate_states were not device-checked."""
    q, k, v, g, beta, state = _inputs(2, 1, 2, 4, False, False)
    with pytest.raises(ValueError, match="out is on meta but q is on cpu"):
        op.gated_delta_rule_step(q, k, v, g, beta, state, out=torch.empty_like(v, device="meta"))
    inter = torch.empty(2, 1, 4, 128, 128, device="meta")
    with pytest.raises(ValueError, match="intermediate_states is on meta"):
        op.gated_delta_rule_step(q, k, v, g, beta, state, intermediate_states=inter)


def _flashinfer_inputs(b, t, pool=None, seed=1):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, 4, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, t, 4, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, t, 8, 128, generator=gen).to(torch.bfloat16)
    a = torch.randn(b, t, 8, generator=gen).to(torch.bfloat16)
    bb = torch.randn(b, t, 8, generator=gen).to(torch.bfloat16)
    a_log = torch.randn(8, generator=gen) * 0.5
    dt_bias = torch.randn(8, generator=gen) * 0.5
    state = torch.randn(pool or b, 8, 128, 128, generator=gen) * 0.1
    return q, k, v, state, a_log, a, dt_bias, bb


def test_flashinfer_decode_form(cpu_kernel):
    from forgekernel.reference.gdn_flashinfer import gdn_decode

    q, k, v, state, a_log, a, dt_bias, bb = _flashinfer_inputs(5, 1)
    before = state.clone()
    out, new = op.gdn_decode_flashinfer(q, k, v, state, a_log, a, dt_bias, bb, 0.0)
    want, want_new = gdn_decode(q, k, v, state, a_log, a, dt_bias, bb, 0.0)
    assert torch.equal(state, before)  # theirs is not modified
    assert float((out.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    assert float((new - want_new).abs().max()) <= 1e-5 * float(want_new.abs().max()) + 1e-6


@pytest.mark.parametrize("disable", [True, False])
def test_flashinfer_mtp_form(cpu_kernel, disable):
    from forgekernel.reference.gdn_flashinfer import gdn_mtp

    q, k, v, pool, a_log, a, dt_bias, bb = _flashinfer_inputs(3, 4, pool=6)
    rows = torch.tensor([5, 1, 3], dtype=torch.int32)
    inter = torch.zeros(6, 4, 8, 128, 128)
    want_inter = inter.clone()
    want, want_pool = gdn_mtp(q, k, v, pool.clone(), rows, a_log, a, dt_bias, bb, None,
                              want_inter, disable_state_update=disable)  # fmt: skip
    out, got_pool = op.gdn_mtp_flashinfer(q, k, v, pool, rows, a_log, a, dt_bias, bb, None,
                                          inter, disable_state_update=disable)  # fmt: skip
    tol = 1e-5 * float(want_pool.abs().max()) + 1e-6
    assert float((out.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    assert float((got_pool - want_pool).abs().max()) <= tol
    assert float((inter - want_inter).abs().max()) <= 1e-5 * float(want_inter.abs().max()) + 1e-6


@pytest.mark.parametrize("stage", ["decode", "mtp"])
def test_flashinfer_definitions_through_run_kernel(cpu_kernel, stage):
    """`bench.flashinfer_defs.run_kernel` on the gdn decode / mtp definitions' inputs as they
    are (by op_type "gdn"): the definition's own reference by its benchmark's criterion, their
    state / pool left as it was (decode: a copy stepped; mtp: disable_state_update)."""
    from forgekernel.bench import flashinfer_defs as defs

    name = f"gdn_{stage}_qk4_v8_d128_k_last"
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    b, t = (5, 1) if stage == "decode" else (3, 4)
    q, k, v, state, a_log, a, dt_bias, bb = _flashinfer_inputs(b, t, pool=None if t == 1 else 6)
    gates = {"A_log": a_log, "a": a, "dt_bias": dt_bias, "b": bb, "scale": 0.125}
    inputs = {"q": q, "k": k, "v": v, **gates}
    if stage == "decode":
        inputs["state"] = state
    else:
        inputs |= {
            "initial_state": state, "initial_state_indices": torch.tensor([5, 1, 3]).int(),
            "intermediate_states_buffer": torch.zeros(6, t, 8, 128, 128),
        }  # fmt: skip
    inputs = {n: inputs[n] for n in defn.inputs}
    defs.check_inputs(defn, inputs)
    before = state.clone()
    theirs_inputs = {n: x.clone() if n.startswith("intermediate") else x for n, x in inputs.items()}
    theirs = defs.run_definition(defn, theirs_inputs)
    ours = defs.run_kernel(defn, inputs)
    assert torch.equal(state, before)
    assert [o.shape for o in ours] == [o.shape for o in theirs]
    assert defs.benchmark_failures(ours[0], theirs[0]) == 0
    assert defs.benchmark_failures(ours[1], theirs[1], atol=1e-4, rtol=1e-4) == 0
    if stage == "mtp":
        key = "intermediate_states_buffer"
        got, want = inputs[key], theirs_inputs[key]
        assert float(want.abs().max()) > 0
        assert defs.benchmark_failures(got, want, atol=1e-4, rtol=1e-4) == 0


@pytest.mark.parametrize("case", gdn_decode.CHECK_CASES, ids=lambda c: c.name)
def test_pending_suite_check_passes_on_the_algorithm(cpu_kernel, case):
    """The pending gdn_decode suite's own check (`bench.check.verify`: NaN-poisoned output,
    2x the rounding yardstick + atol) with the kernel's algorithm standing in."""
    suite = gdn_decode.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
