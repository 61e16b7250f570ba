"""Kernel 1 of the Gated DeltaNet backward over segments of each sequence (ops/
gated_delta_rule_bwd.py `_segmented_states`, FORGEKERNEL_GDN_BWD_SEGMENTS: "0" off, "1" the
rule, an integer the count forced) on the GPU: segmented against unsegmented and both against
the fp64 chunked backward on the same 16-bit inputs, kernel 1's outputs NaN-poisoned before
every launch (a row no run writes fails); bf16 and fp16; S = 2, 3, 4, 8; B 1-3; T with a tail
chunk (1000, 4089, 190); H = HV and HV = 2H; with / without h0, dht; l2norm on / off; the
rule's own choice at 1 x 8192 h16 hv16 (S = 4 on 132 SMs); a CUDA-graph capture (three side
streams) replaying the eager result; the times printed (`-s`): 1 x 2048 and 1 x 8192 h16 hv32
(S = 2 and 4 forced; the rule declines there) and 1 x 8192 / 1 x 32768 h16 hv16 (the rule's S =
4), each next to the unsegmented call, eager and graph replays. Tolerance: 2e-2 of each
gradient's max (tests/gpu/test_gdn_bwd_kernel_path_gpu.py's). CPU twin:
tests/test_gdn_bwd_segments.py. Predictions: docs/linear_attention/NOTES.md
"next/gdn-bwd-segments"."""

from __future__ import annotations

import importlib

import pytest
import torch
from graphs import captured, replay_poisoned
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _poisoned_kernel, _problem, _reference

import forgekernel
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")


def _call(inputs, h0, dht, l2norm, **kw):
    return forgekernel.gated_delta_rule_backward(*inputs, initial_state=h0, d_final_state=dht,
                                                 use_qk_l2norm_in_kernel=l2norm, **kw)  # fmt: skip


@pytest.fixture
def poisoned(monkeypatch):
    """The kernel path, FUSED off (the two-launch path, as below the fused rule), kernel 1's
    outputs NaN-poisoned before each launch; its launches recorded (do's shape)."""
    calls = []
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setenv(bwd.FUSED_SWITCH, "0")
    monkeypatch.setattr(bwd, "_state_recurrence", _poisoned_kernel(calls))
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "parts", "l2norm", "with_h0", "with_dht"),
    [
        (1, 1000, 2, 4, 2, False, True, True),
        (1, 1000, 2, 4, 4, True, True, False),
        (2, 4089, 1, 2, 4, True, False, True),
        (1, 4089, 2, 2, 8, False, False, False),
        (3, 190, 1, 2, 3, True, True, True),
        (2, 2048, 4, 8, 4, False, True, True),
    ],
)  # fmt: skip
def test_segments_equal_the_unsegmented_pass(poisoned, monkeypatch, dtype, b, t, h, hv, parts,
                                             l2norm, with_h0, with_dht):  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + parts, l2norm=l2norm)
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)
    inputs = (q, k, v, g, beta, do)
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "0")
    today = _call(inputs, h0, dht, l2norm)
    assert len(poisoned) == 2
    poisoned.clear()
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, str(parts))
    got = _call(inputs, h0, dht, l2norm)
    assert len(poisoned) == (5 if parts > 2 else 4), "the segmented pass was not taken"
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r, o in zip(NAMES, got, want, today):
        _close(name, a, r)
        _close(name + " vs unsegmented", a, o.double())


def test_the_rule_segments_one_long_sequence(poisoned, monkeypatch):
    """SEGMENTS on (switch "1"): 1 x 8192 h16 hv16 takes S = 4 on 132 SMs (five kernel-1
    launches), 1 x 8192 h16 hv32 none (two); both within tolerance of the fp64 backward."""
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "1")
    for hv, launches in ((16, 5 if bwd._device_sms(torch.device("cuda")) >= 128 else 2),
                         (32, 2)):  # fmt: skip
        poisoned.clear()
        q, k, v, g, beta, do, h0, dht = _problem(1, 8192, 16, hv, torch.bfloat16, seed=hv)
        inputs = (q, k, v, g, beta, do)
        got = _call(inputs, h0, dht, False)
        assert len(poisoned) == launches, (hv, len(poisoned))
        want = _reference(inputs, h0=h0, dht=dht, l2norm=False)
        for name, a, r in zip(NAMES, got, want):
            _close(f"{name} hv{hv}", a, r)


def test_in_a_cuda_graph(monkeypatch):
    """S = 4 forced, out= given: a captured call (the summary phase on three streams, the scans,
    the full runs on two) replays to the eager gradients."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setenv(bwd.FUSED_SWITCH, "0")
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "4")
    q, k, v, g, beta, do, h0, dht = _problem(2, 1024, 2, 4, torch.bfloat16, seed=7)
    inputs = (q, k, v, g, beta, do)
    eager = _call(inputs, h0, dht, True)
    out = tuple(torch.full_like(x, float("nan")) for x in eager)
    graph = captured(lambda: _call(inputs, h0, dht, True, out=out))
    replay_poisoned(graph, out)
    for name, a, e in zip(NAMES, out, eager):
        _close(name + " graph replay", a, e.double())


def _times(fn) -> tuple[float, float]:
    """(eager, graph replay) median ms of fn()."""
    eager = median(time_ms(fn, reps=10))
    graph = captured(fn)
    return eager, median(time_ms(graph.replay, reps=10))


@pytest.mark.parametrize(
    ("t", "hv", "modes"),
    [(2048, 32, ("2", "4")), (8192, 32, ("2", "4")), (8192, 16, ("1",)), (32768, 16, ("1",))],
)
def test_time_next_to_unsegmented(monkeypatch, t, hv, modes):
    """1 x T h16 bf16, h0 and dht given, FUSED as shipped (below its rule: the two-launch path):
    the unsegmented call and each mode of the switch (a count forced, or "1" the rule), eager
    and graph replays, printed; gradients finite."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    q, k, v, g, beta, do, h0, dht = _problem(1, t, 16, hv, torch.bfloat16, seed=13)
    inputs = (q, k, v, g, beta, do)
    out = tuple(torch.empty_like(x) for x in _call(inputs, h0, dht, False))

    def fn():
        return _call(inputs, h0, dht, False, out=out)

    line = []
    for mode in ("0", *modes):
        monkeypatch.setenv(bwd.SEGMENTS_SWITCH, mode)
        for name, x in zip(NAMES, fn()):
            assert torch.isfinite(x).all(), (mode, name)
        nc = -(-t // 64)
        parts = bwd._segments_selected(1, hv, nc, q.device)
        eager, graph = _times(fn)
        line.append(f"S={parts} ({mode}) eager {eager:.3f} graph {graph:.3f} ms")
    print(f"\nGDN backward 1 x {t} h16 hv{hv} bf16: " + "; ".join(line))
