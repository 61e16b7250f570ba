"""The fused backward's `group_sum` key (kernels/linear_attention/gdn_bwd_fused/sm90, behind
ops/gated_delta_rule_bwd.py FUSED_GROUPSUM, next/gdn-bwd-groupsum) on the GPU: at HV = 2 H the
two value heads of a q / k head run as one cluster of two CTAs and sum dq, dk in fp32 through
distributed shared memory, one 16-bit store at the H head (no norm epilogue without l2norm).

- The key against the same kernel without it, on the same inputs (NaN-poisoned outputs): dv,
  dg, dbeta, dh0 bit for bit (the code on their paths is the key's without it); dq, dk within
  one 16-bit ulp of each value head's part of the sum of the other key's two rounded value
  heads (the key rounds once, after the fp32 sum).
- The op with FUSED_GROUPSUM on (the fused rule forced, the fused kernel's outputs NaN-poisoned
  before each launch): against the fp64 chunked backward and against FUSED_GROUPSUM off, bf16
  and fp16, T = 1, 63, 64, 65, 1000, HV = 2 H (the key) and HV = 4 H (the switch without
  effect: the epilogue's group sum), l2norm on / off (on: the epilogue on the H-head sums),
  with / without h0 and dht; equal-length cu_seqlens (a reshape: the key) and unequal ones
  (the slot layout: today's path).
- The rule's own choice at 4 x 200 h16 hv32 (128 CTAs) with out= (NaN-filled: written in place
  by the kernel, no epilogue) and a CUDA graph's replay equal to the eager call.
- Printed (`-s`): 4 x 8192 h16 hv32 bf16, the call with FUSED_GROUPSUM off / on and the fused
  kernel alone both ways. Predicted (NOTES "next/gdn-bwd-groupsum"): call 3.615 -> 3.35-3.45
  ms (the two norm launches, ~0.20-0.27 ms, gone; the kernel +0 to +0.06 ms).

Tolerance: 2e-2 of each gradient's max (the suite's rule). CPU twins:
tests/test_gdn_bwd_fused_dispatch.py (`groupsum`: the route on an emulation),
tests/test_gdn_bwd_fused_compile.py (`group_sum`: the build, its SASS)."""

from __future__ import annotations

import importlib

import pytest
import torch
from graphs import captured, replay_poisoned
from test_gdn_bwd_fused_gpu import _fused_kernel_args, _poisoned, _route, _run, _varlen_problem
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h"), [(1, 1, 1), (2, 63, 2), (1, 65, 1), (3, 1000, 2),
                                           (2, 130, 4)])  # fmt: skip
def test_key_against_the_value_heads(dtype, b, t, h):
    """`group_sum` against the key without it (both `u_from_h`, the route's inputs, dq scaled):
    dv, dg, dbeta, dh0 equal; dq, dk within one 16-bit ulp a part of the pairwise sum of the
    other key's value heads (fp32 sum, rounded once there; each part rounded first here)."""
    problem, tiles, states, _ = _route(b, t, h, 2 * h, dtype, seed=t + 5 * h)
    do = problem[5]
    u16, h16, _ = states[False]
    q, *rest = _fused_kernel_args(problem, tiles, h16)
    scale = 128**-0.5
    heads = _poisoned(do, None, q, rest, scale=scale)
    pair = _poisoned(do, None, q, rest, scale=scale, group_sum=True)
    for name, a, o in zip(("dg", "dv", "dbeta", "dh0"), pair[2:], heads[2:]):
        assert torch.equal(a, o), name
    eps = torch.finfo(dtype).eps
    for name, a, o in zip(("dq", "dk"), pair[:2], heads[:2]):
        assert a.shape == (b, t, h, 128) and torch.isfinite(a).all(), name
        parts = o.double().unflatten(2, (h, 2))
        want = parts.sum(3)
        bound = eps * (parts.abs().sum(3) + want.abs()) + 1e-6
        assert bool(((a.double() - want).abs() <= bound).all()), (
            name,
            float((a.double() - want).abs().max()),
        )


@pytest.fixture
def pair(monkeypatch):
    """FUSED and FUSED_GROUPSUM on, the fused rule forced, the fused kernel's outputs
    NaN-poisoned before each launch; its launches recorded (do's shape, `group_sum`)."""
    calls = []

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, scale=1.0,
            group_sum=False):  # fmt: skip
        if out is None:
            out = fused_launch.empty_outputs(do, q.shape[-1],
                                             heads=q.shape[2] if group_sum else None)  # fmt: skip
        for x in out:
            x.fill_(float("nan"))
        calls.append((tuple(do.shape), group_sum))
        return fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                                          scale=scale, out=out, group_sum=group_sum)  # fmt: skip

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", True)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize(
    ("b", "h", "hv", "l2norm", "with_h0", "with_dht"),
    [(1, 1, 2, False, True, True), (2, 2, 4, True, False, True), (3, 1, 2, True, True, False),
     (2, 4, 8, False, False, False), (2, 1, 4, False, True, True)],
)  # fmt: skip
def test_matches_the_fp64_backward_and_the_switch_off(pair, monkeypatch, dtype, t, b, h, hv,
                                                      l2norm, with_h0, with_dht):  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)
    inputs = (q, k, v, g, beta, do)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert pair == [((b, t, hv, 128), hv == 2 * h)], pair
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    off = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert pair[1:] == [((b, t, hv, 128), False)]
    for name, a, r, o in zip(NAMES, got, want, off):
        _close(name, a, r)
        _close(name + " vs FUSED_GROUPSUM off", a, o.double())


@pytest.mark.parametrize("lens", [[65, 65, 65], [1000, 1000], [1000, 70], [1, 63, 0, 64, 130]])
@pytest.mark.parametrize("l2norm", [False, True])
def test_varlen(pair, lens, l2norm):
    """cu_seqlens: equal lengths are B sequences (a reshape) on the key; unequal ones run in
    the slot layout (today's path there: no fused launch). Against the fp64 varlen backward."""
    n = len(lens)
    inputs, h0, dht, cu = _varlen_problem(lens, seed=n, l2norm=l2norm)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm, cu=cu)
    equal = len(set(lens)) == 1
    assert pair == ([((n, lens[0], 4, 128), True)] if equal else []), pair
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm, cu=cu)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


def test_the_rule_with_out_and_a_graph(monkeypatch):
    """FUSED_GROUPSUM on, the fused rule not forced: 4 x 200 h16 hv32 bf16 (128 CTAs, 64
    clusters) takes the key; the op's out= (NaN-filled) written in place, dq and dk by the
    kernel (no epilogue launch); close to FUSED_GROUPSUM off and the fp64 backward; the call
    captured in a CUDA graph, its replay (out= NaN-filled again) equal to the eager call."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    launches, epilogue = [], []
    real, real_qk = bwd._fused_bwd, bwd._qk_grads
    monkeypatch.setattr(bwd, "_fused_bwd",
                        lambda *a, **kw: launches.append(kw.get("group_sum", False))
                        or real(*a, **kw))  # fmt: skip
    monkeypatch.setattr(bwd, "_qk_grads",
                        lambda *a, **kw: epilogue.append(1) or real_qk(*a, **kw))  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(4, 200, 16, 32, torch.bfloat16, seed=17)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    want = _reference(tuple(args), h0=h0, dht=dht, l2norm=False)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    off = forgekernel.gated_delta_rule_backward(*args, **kw)
    assert launches == [False] and len(epilogue) == 2
    launches.clear()
    epilogue.clear()
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", True)
    out = tuple(torch.full_like(x, float("nan")) for x in off)

    def call():
        return forgekernel.gated_delta_rule_backward(*args, out=out, **kw)

    got = call()
    assert launches == [True] and epilogue == []
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    for name, a, r, o in zip(NAMES, out, want, off):
        _close(name, a, r)
        _close(name + " vs FUSED_GROUPSUM off", a, o.double())
    eager = [x.clone() for x in out]
    graph = captured(call)
    replay_poisoned(graph, out)
    for name, a, e in zip(NAMES, out, eager):
        _close(name + " graph replay", a, e.double())


def _time(fn) -> float:
    return median(time_ms(fn, reps=10))


def test_time(monkeypatch):
    """4 x 8192 h16 hv32 bf16 (the fused rule's own choice): the call with FUSED_GROUPSUM off and
    on and the fused kernel alone both ways (`u_from_h`, the route's inputs), printed;
    gradients finite."""
    q, k, v, g, beta, do, h0, dht = _problem(4, 8192, 16, 32, torch.bfloat16, seed=13)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    call = {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "FUSED_GROUPSUM", on)
        grads = forgekernel.gated_delta_rule_backward(*args, **kw)
        for name, x in zip(NAMES, grads):
            assert torch.isfinite(x).all(), (on, name)
        call[on] = _time(lambda: forgekernel.gated_delta_rule_backward(*args, **kw))
    problem, tiles, states, _ = _route(4, 8192, 16, 32, torch.bfloat16, seed=13)
    qs, *rest = _fused_kernel_args(problem, tiles, states[False][1])
    kern = {on: _time(lambda on=on: fused_launch.gdn_bwd_fused(problem[5], None, qs, *rest,
                                                                group_sum=on))
            for on in (False, True)}  # fmt: skip
    print(
        f"\nGDN backward 4 x 8192 h16 hv32 bf16, FUSED_GROUPSUM off / on: call {call[False]:.3f}"
        f" / {call[True]:.3f} ms; fused kernel {kern[False]:.3f} / {kern[True]:.3f} ms"
    )
