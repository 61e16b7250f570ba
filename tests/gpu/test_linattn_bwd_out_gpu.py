"""out= and kernel 1's two launches side by side on the GPU (ops/gated_delta_rule_bwd.py,
ops/kda_bwd.py; `concurrent_state_launches`, runtime/device.py `side_by_side`): the backward
with NaN-poisoned out= buffers, with the launches side by side (B HV small: the default) and
one after the other (CONCURRENT_STATE off), eagerly and replayed from a CUDA graph, gives the
serial returned form's gradients bit for bit (the same kernels on the same inputs), every
element of every buffer written. bf16, K = V = 128, H 2, HV 4, T = 1, 200, 1000, B 1-2. CPU
twin: tests/test_linattn_bwd_out.py."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from graphs import captured, replay_poisoned

import forgekernel

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
kda = importlib.import_module("forgekernel.ops.kda_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _problem(b, t, h, hv, channel_decay, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = rnd(b, t, h, 128).bfloat16(), F.normalize(rnd(b, t, h, 128), dim=-1).bfloat16()
    v, do = rnd(b, t, hv, 128).bfloat16(), rnd(b, t, hv, 128).bfloat16()
    g = F.logsigmoid(rnd(b, t, hv, 128) if channel_decay else rnd(b, t, hv) + 2.0)
    beta = torch.sigmoid(rnd(b, t, hv))
    h0, dht = rnd(b, hv, 128, 128) * 0.1, rnd(b, hv, 128, 128) * 0.1
    return q, k, v, g, beta, do, h0, dht


def _backward(op, args, out=None):
    q, k, v, g, beta, do, h0, dht = args
    fn = (forgekernel.gated_delta_rule_backward if op == "gdn"
          else kda.kimi_delta_attention_backward)  # fmt: skip
    return fn(q, k, v, g, beta, do, initial_state=h0, d_final_state=dht, out=out)


def _poisoned(grads):
    return tuple(torch.full_like(x, float("nan")) for x in grads)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize(("b", "t"), [(1, 1), (1, 200), (2, 1000)])
def test_out_and_side_by_side_equal_the_serial_path(monkeypatch, op, b, t):
    args = _problem(b, t, 2, 4, channel_decay=op == "kda", seed=t)
    monkeypatch.setattr(bwd, "CONCURRENT_STATE", False)
    serial = _backward(op, args)
    assert all(torch.isfinite(x).all() for x in serial)
    out = _poisoned(serial)
    got = _backward(op, args, out)
    for name, a, o, r in zip(NAMES, got, out, serial):
        assert a is o and torch.equal(a, r), ("serial, out=", name)
    monkeypatch.setattr(bwd, "CONCURRENT_STATE", True)
    assert bwd.concurrent_state_launches(b, 4, bwd._device_sms(args[0].device))
    both = _backward(op, args)
    out = _poisoned(serial)
    both_out = _backward(op, args, out)
    torch.cuda.synchronize()
    for name, a, c, r in zip(NAMES, both, both_out, serial):
        assert torch.equal(a, r) and torch.equal(c, r), ("side by side", name)


@pytest.mark.parametrize("op", ["gdn", "kda"])
@pytest.mark.parametrize("concurrent", [True, False])
def test_captured_with_out(monkeypatch, op, concurrent):
    """A CUDA graph of the backward writing out= (both launch orders): replayed on new inputs
    into poisoned buffers, it gives the eager backward's gradients on those inputs."""
    monkeypatch.setattr(bwd, "CONCURRENT_STATE", concurrent)
    args = _problem(1, 200, 2, 4, channel_decay=op == "kda", seed=1)
    out = _poisoned(_backward(op, args))
    graph = captured(lambda: _backward(op, args, out))
    fresh = _problem(1, 200, 2, 4, channel_decay=op == "kda", seed=2)
    for x, y in zip(args, fresh):
        x.copy_(y)
    replay_poisoned(graph, out)
    want = _backward(op, fresh)
    for name, o, r in zip(NAMES, out, want):
        assert torch.equal(o, r), name
