"""The fused backward's `varlen, group_sum` key (kernels/linear_attention/gdn_bwd_fused/sm90,
behind ops/gated_delta_rule_bwd.py FUSED_SLOTS_GROUPSUM, off; next/gdn-bwd-slots-groupsum) on
the GPU: in the varlen slot layout (unequal lengths eagerly, every varlen call under a CUDA-graph
capture) the two value heads of a q / k head run as one 2-CTA cluster walking one sequence's
slots, dq and dk summed in fp32 through distributed shared memory, one 16-bit store at the H
head at each token row (no norm epilogue without l2norm).

- The key against the `varlen` key without it, on the op's own slot-layout inputs (the launcher
  intercepted, both keys' outputs NaN-poisoned): dv, dg, dbeta, dh0 bit for bit (their code is
  the key's without it); dq, dk within one 16-bit ulp of each value head's part of the sum of
  the other key's two rounded value heads (the key rounds once, after the fp32 sum); odd
  lengths, empty sequences (first, middle, last), lengths that straddle slots and ones that
  fill them, fp16 and bf16, l2norm on (the epilogue on the H-head sums) and off (the kernel's
  sums the op's, dq times the scale).
- The op with the switch on against the fp64 varlen backward and against the switch off (2e-2
  of each gradient's max, the suite's rule), with / without h0 and dht.
- out= (NaN-filled) written in place by the kernel (no epilogue launch), bit for bit the call
  without it; value heads in passes keep the epilogue (no pair: `_pair_sums` wants one pass).
- A graph captured with the key at equal lengths, replayed with cu_seqlens rewritten in place
  (out= NaN-filled before each replay): bit for bit the eager call at each replay's lengths
  where that is the slot route (unequal lengths, an empty sequence), within 2e-2 at equal ones
  (eager: the batch path's `group_sum` key).
- Printed (`-s`): 4 x 8192 h16 hv32 bf16 cu_seqlens (the bench's graph column), graph replay
  with FUSED_SLOTS_GROUPSUM off / on, the rule not forced. Predicted (NOTES
  "next/gdn-bwd-slots-groupsum"): 4.676 -> ~4.45 ms (the two GdnBwdNorm launches, 280 us, gone;
  the fused kernel +0.13 ms as on the batch key).

CPU twins: tests/test_gdn_bwd_fused_dispatch.py (`slots_groupsum`: the rule, the route on an
emulation), tests/test_gdn_bwd_fused_compile.py (`varlen_group_sum`: the build, its SASS)."""

from __future__ import annotations

import importlib

import pytest
import torch
from graphs import captured, replay_poisoned
from slots_alone import CHUNK
from test_gdn_bwd_fused_slots_gpu import _call, _cu, _states
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
# odd lengths, empty sequences (middle; first and last), straddling and slot-filling lengths
LENS = ([1, 63, 0, 64, 65, 130], [6148, 301, 0, 295], [128, 0, 192, 64], [1000, 70],
        [0, 130, 1, 64, 0])  # fmt: skip


def _poisoned(do, q, args, kw, group_sum):
    """The fused launcher, its outputs NaN-filled first (`group_sum`: dq, dk at the H heads);
    kw: the op's (scale; the slot layout's cu_seqlens, order, tables, tokens)."""
    states = kw["cu_seqlens"].shape[0] - 1
    heads = q.shape[2] if group_sum else None
    out = fused_launch.empty_outputs(do, q.shape[-1], kw["tokens"], states, heads)
    for x in out:
        x.fill_(float("nan"))
    return fused_launch.gdn_bwd_fused(do, *args[:1], q, *args[1:], out=out, group_sum=group_sum,
                                      **kw)  # fmt: skip


def _against_the_value_heads(pair, heads, dtype):
    """dv, dg, dbeta, dh0 equal; dq, dk (1, T', H, K) within one 16-bit ulp a part of the
    pairwise sum of the value-head key's (1, T', 2 H, K)."""
    for name, a, o in zip(("dg", "dv", "dbeta", "dh0"), pair[2:], heads[2:]):
        assert torch.equal(a, o), name
    eps = torch.finfo(dtype).eps
    for name, a, o in zip(("dq", "dk"), pair[:2], heads[:2]):
        assert torch.isfinite(a).all(), f"{name}: a row never received or stored"
        parts = o.double().unflatten(2, (a.shape[2], 2))
        want = parts.sum(3)
        bound = eps * (parts.abs().sum(3) + want.abs()) + 1e-6
        err = (a.double() - want).abs()
        assert bool((err <= bound).all()), (name, float(err.max()))


class _Calls(list):
    """The fixture's launch records, and how many `varlen, group_sum` launches were checked."""

    compared = 0


@pytest.fixture
def pair(monkeypatch):
    """FUSED, FUSED_SLOTS, FUSED_GROUPSUM and FUSED_SLOTS_GROUPSUM on, both fused rules forced,
    the fused kernel's outputs NaN-poisoned before each launch; its launches recorded: (do's
    shape, tokens (None: the batch key), group_sum). Outside a capture each `varlen,
    group_sum` launch is checked against the `varlen` key on the same inputs
    (`_against_the_value_heads`); `pair.compared` counts them."""
    calls = _Calls()

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, scale=1.0,
            group_sum=False, **walk):  # fmt: skip
        rest = (u, k, h, big_g, pt, tt, w, uw, v, beta, dht)
        kw = {"scale": scale, **walk}
        if out is None:
            states = None if "cu_seqlens" not in walk else walk["cu_seqlens"].shape[0] - 1
            heads = q.shape[2] if group_sum else None
            out = fused_launch.empty_outputs(do, q.shape[-1], walk.get("tokens"), states, heads)
        for x in out:
            x.fill_(float("nan"))
        calls.append((tuple(do.shape), walk.get("tokens"), group_sum))
        got = fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                                         out=out, group_sum=group_sum, **kw)  # fmt: skip
        if group_sum and walk and not torch.cuda.is_current_stream_capturing():
            heads = _poisoned(do, q, rest, kw, False)
            _against_the_value_heads(got, heads, do.dtype)
            calls.compared += 1
        return got

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    for name in (bwd.FUSED_SWITCH, bwd.FUSED_SLOTS_SWITCH):
        monkeypatch.delenv(name, raising=False)
    for name in ("FUSED", "FUSED_SLOTS", "FUSED_GROUPSUM", "FUSED_SLOTS_GROUPSUM"):
        monkeypatch.setattr(bwd, name, True)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "slots_fit", lambda *a: True)
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lens", LENS, ids=[f"lens{i}" for i in range(len(LENS))])
@pytest.mark.parametrize(("h", "l2norm"), [(1, True), (2, False)], ids=["h1l2", "h2"])
def test_key_against_the_value_heads(pair, monkeypatch, dtype, lens, h, l2norm):
    """Eager unequal lengths (the slot layout) with the switch on: one fused launch, the
    `varlen, group_sum` key, checked against the `varlen` key on its own inputs (the fixture);
    the call within 2e-2 of the fp64 varlen backward and of the switch off (the `varlen` key
    and the epilogue's group sum)."""
    n, total, hv = len(lens), sum(lens), 2 * h
    inputs = _problem(1, total, h, hv, dtype, seed=n + h, l2norm=l2norm)[:6]
    h0, dht = _states(n, h, hv, seed=41)
    cu = _cu(lens)
    got = _call(inputs, h0, dht, cu, l2norm)
    rows = CHUNK * (total // CHUNK + n)
    assert pair == [((1, rows, hv, 128), total, True)] and pair.compared == 1, pair
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm, cu=cu)
    monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", False)
    off = _call(inputs, h0, dht, cu, l2norm)
    assert pair[1:] == [((1, rows, hv, 128), total, False)]
    for name, a, r, o in zip(NAMES, got, want, off):
        _close(name, a, r)
        _close(name + " vs FUSED_SLOTS_GROUPSUM off", a, o.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(("with_h0", "with_dht"), [(False, True), (True, False), (False, False)])
def test_states(pair, monkeypatch, dtype, with_h0, with_dht):
    """Without h0 and / or dht (the `varlen, group_sum` keys without a final-state gradient),
    l2norm off: against the fp64 backward and the switch off; the key checked (the fixture)."""
    lens = [65, 0, 200, 1]
    inputs = _problem(1, sum(lens), 2, 4, dtype, seed=7)[:6]
    h0, dht = _states(len(lens), 2, 4, seed=8)
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)
    cu = _cu(lens)
    got = _call(inputs, h0, dht, cu, l2norm=False)
    assert [c[2] for c in pair] == [True] and pair.compared == 1
    want = _reference(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", False)
    off = _call(inputs, h0, dht, cu, l2norm=False)
    for name, a, r, o in zip(NAMES, got, want, off):
        _close(name, a, r)
        _close(name + " vs FUSED_SLOTS_GROUPSUM off", a, o.double())


def test_out_and_passes(pair, monkeypatch):
    """out= NaN-filled, l2norm off: dq, dk written in place by the kernel at the H heads (no
    epilogue launch), bit for bit the call without out=; value heads in passes (one q head a
    pass) take no pair (`_pair_sums`: one pass only) and the epilogue, within 2e-2."""
    lens = [0, 130, 1, 64, 0]
    inputs = _problem(1, sum(lens), 2, 4, torch.bfloat16, seed=5)[:6]
    h0, dht = _states(len(lens), 2, 4, seed=6)
    cu = _cu(lens)
    one = _call(inputs, h0, dht, cu, l2norm=False)
    epilogue = []
    real_qk = bwd._qk_grads
    monkeypatch.setattr(bwd, "_qk_grads",
                        lambda *a, **kw: epilogue.append(1) or real_qk(*a, **kw))  # fmt: skip
    out = tuple(torch.full_like(x, float("nan")) for x in one)
    got = _call(inputs, h0, dht, cu, l2norm=False, out=out)
    assert [c[2] for c in pair] == [True, True] and epilogue == []
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    for name, a, r in zip(NAMES, out, one):
        assert torch.equal(a, r), name
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 1)
    pair.clear()
    passes = _call(inputs, h0, dht, cu, l2norm=False)
    assert [c[2] for c in pair] == [False, False] and len(epilogue) == 2, pair
    for name, a, r in zip(NAMES, passes, one):
        _close(name + " in passes", a, r.double())


@pytest.mark.parametrize(("h", "l2norm"), [(1, True), (2, False)], ids=["h1l2", "h2"])
def test_one_graph_replayed(pair, h, l2norm):
    """Captured with the key at equal lengths (the slot layout: a capture reads no length),
    replayed with cu_seqlens rewritten in place, out= NaN-filled before each replay; each
    replay bit for bit the eager call where that is the slot route (unequal lengths, an empty
    first sequence), within 2e-2 at equal lengths (eager: the batch `group_sum` key; 200 % 64
    > 0)."""
    hv = 2 * h
    inputs = _problem(1, 400, h, hv, torch.bfloat16, seed=31, l2norm=l2norm)[:6]
    h0, dht = _states(2, h, hv, seed=32)
    cu = _cu([200, 200])
    out = tuple(torch.empty_like(x) for x in (*inputs[:5], h0))

    def call():
        return _call(inputs, h0, dht, cu, l2norm, out)

    graph = captured(call)
    assert pair[-1] == ((1, 64 * (400 // 64 + 2), hv, 128), 400, True), pair
    for edges in ([0, 200, 400], [0, 137, 400], [0, 64, 400], [0, 0, 400], [0, 200, 400]):
        cu.copy_(torch.tensor(edges))
        replay_poisoned(graph, out)
        got = [x.clone() for x in out]
        want = _call(inputs, h0, dht, cu, l2norm)
        for name, a, r in zip(NAMES, got, want):
            if edges[1] == 200:
                _close(f"{edges} {name}", a, r.double())
            else:
                assert torch.equal(a, r), (edges, name)


def _graph_ms(args, kw) -> float:
    samples = time_ms(lambda: forgekernel.gated_delta_rule_backward(*args, **kw), reps=10)
    assert samples.method == "cuda-graph", samples.note
    return median(samples)


def test_time(monkeypatch):
    """4 x 8192 h16 hv32 bf16 cu_seqlens, l2norm off (the bench's graph column), the rules not
    forced (`slots_fit`: 128 CTAs, the fused slot route): graph replays with
    FUSED_SLOTS_GROUPSUM off and on, printed; the key taken with it on; the two graphs'
    gradients within 2e-2 of each other."""
    lens = [8192] * 4
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    for name in (bwd.FUSED_SWITCH, bwd.FUSED_SLOTS_SWITCH):
        monkeypatch.delenv(name, raising=False)
    q, k, v, g, beta, do, *_ = _problem(1, sum(lens), 16, 32, torch.bfloat16, seed=13)
    h0, dht = _states(len(lens), 16, 32, seed=14)
    args = [q, k, v, g, beta, do]
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": _cu(lens)}
    launches = []
    real = bwd._fused_bwd
    monkeypatch.setattr(bwd, "_fused_bwd", lambda *a, **k2: launches.append(
        ("tokens" in k2, k2.get("group_sum", False))) or real(*a, **k2))  # fmt: skip
    times, grads = {}, {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", on)
        out = tuple(torch.empty_like(x) for x in (*args[:5], h0))

        def call(out=out):
            return forgekernel.gated_delta_rule_backward(*args, out=out, **kw)

        launches.clear()
        graph = captured(call)
        # the eager warm-up: the batch path's `group_sum` key; the capture: the slot route's
        assert launches == [(False, True), (True, on)], launches
        replay_poisoned(graph, out)
        grads[on] = [x.clone() for x in out]
        for name, x in zip(NAMES, grads[on]):
            assert torch.isfinite(x).all(), (on, name)
        times[on] = _graph_ms(args, {**kw, "out": out})
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        _close(f"on vs off {name}", a, o.double())
    print(f"\nGDN backward 4 x 8192 h16 hv32 bf16 cu_seqlens: graph FUSED_SLOTS_GROUPSUM off "
          f"{times[False]:.3f} ms, on {times[True]:.3f} ms "
          f"({times[True] - times[False]:+.3f})")  # fmt: skip
