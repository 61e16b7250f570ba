"""The Gated DeltaNet fused backward on the varlen slot layout (its `varlen` key; ops/
gated_delta_rule_bwd.py FUSED_SLOTS, on since the H100 A/B of 2026-12-07; docs/
linear_attention/NOTES.md "next/fused-slots", "next/gdn-bwd-adopt") on the GPU: the slot
layout's device pass (unequal lengths eagerly, every varlen call under a CUDA-graph capture) on
kernel 1's forward launch and ONE fused launch walking each sequence's slots, its token
gradients at their token rows (NaN-poisoned before every launch: a row left unwritten fails).

Checked: each sequence against its own call on the fused kernel's batch key (B = 1, rule
forced) bit for bit where its length is a multiple of 64 (the slot walk's extra zero slot
passes dS exactly: e^0 = 1, zero products), within 2e-2 of the max otherwise (the fused kernel
takes e^(G_C) from G's row 63 in the slots, row len % 64 - 1 alone: kernel 0's warp scan may
differ there in the last bits, and dS carries it to every earlier chunk; tests/slots_alone.py);
the call against the two-launch slot path (FUSED_SLOTS off) and the fp64 varlen backward
within 2e-2; a graph captured with the route on at equal lengths, replayed with cu_seqlens
rewritten in place, bit for bit the eager call at each replay's lengths where the eager call
takes the same route (unequal lengths), within 2e-2 at equal ones (eager: the batch path); the
4 x 8192 and the suites' mixes' graph times (FUSED_SLOTS off, on as shipped, on forced)
printed (`-s`), the
graph's gradients bit for bit the eager fused batch call's (8192 = 128 x 64).

FUSED_DIET on and off (the `fused` fixture's `diet_on` / `diet_off` ids; NOTES
"next/fused-slots-on46"): on, the fused kernel's `varlen, u_from_h` key (U formed from the WY
u, W and h) in the slot layout, while the batch key's call also runs kernel 0's and the forward
launch's `fused` keys (h from k and G): the comparisons against the batch key are then within
2e-2, bit for bit only with the diet off. FUSED_GROUPSUM off throughout: the yardstick is the
batch key without `group_sum` (with it the batch call's dq, dk are summed in fp32 before their
one rounding, not bit for bit the epilogue's sum); off, the slot layout takes no pair either
(its `varlen, group_sum` form, FUSED_SLOTS_GROUPSUM: test_gdn_bwd_slots_groupsum_gpu.py)."""

from __future__ import annotations

import importlib

import pytest
import torch
from graphs import replay_poisoned
from slots_alone import CHUNK
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
LENS = ([1, 63, 0, 64, 65, 130], [6148, 301, 0, 295], [128, 0, 192, 64], [1000, 70])


@pytest.fixture(params=[True, False], ids=["diet_on", "diet_off"])
def fused(request, monkeypatch):
    """FUSED and FUSED_SLOTS on, both rules forced, FUSED_DIET the param, FUSED_GROUPSUM off
    (the module docstring), the fused kernel's outputs NaN-poisoned before each launch, handed U
    only with the diet off; its launches recorded: (do's shape, tokens) (tokens None: the batch
    key)."""
    calls = []

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, scale=1.0, **walk):
        assert (u is None) == request.param  # `u_from_h` with the diet
        if out is None:
            states = None if "cu_seqlens" not in walk else walk["cu_seqlens"].shape[0] - 1
            out = fused_launch.empty_outputs(do, q.shape[-1], walk.get("tokens"), states)
        for x in out:
            x.fill_(float("nan"))
        calls.append((tuple(do.shape), walk.get("tokens")))
        return fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                                          scale=scale, out=out, **walk)  # fmt: skip

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    monkeypatch.delenv(bwd.FUSED_SLOTS_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
    monkeypatch.setattr(bwd, "FUSED_DIET", request.param)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "slots_fit", lambda *a: True)
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")  # fmt: skip


def _states(n, h, hv, seed):
    *_, h0, dht = _problem(n, 1, h, hv, torch.bfloat16, seed=seed)
    return h0, dht


def _call(inputs, h0, dht, cu=None, l2norm=True, out=None):
    q, k, v, g, beta, do = inputs
    return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                 d_final_state=dht, cu_seqlens=cu, out=out,
                                                 use_qk_l2norm_in_kernel=l2norm)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("lens", LENS)
def test_each_sequence_alone(fused, monkeypatch, lens, dtype):
    """Eager unequal lengths (the slot layout) on the fused kernel's varlen key: one launch over
    the callers' tokens; each sequence bit for bit its own call on the batch key where len % 64
    == 0 and the diet is off, within 2e-2 otherwise (the module docstring), an empty one's state
    gradient
    d_final_state's; the whole call within 2e-2 of the two-launch slot path and the fp64
    backward."""
    n, total = len(lens), sum(lens)
    inputs = _problem(1, total, 2, 4, dtype, seed=n, l2norm=True)[:6]
    h0, dht = _states(n, 2, 4, seed=97)
    cu = _cu(lens)
    got = _call(inputs, h0, dht, cu)
    rows = CHUNK * (total // CHUNK + n)
    assert fused == [((1, rows, 4, 128), total)], fused
    bitwise = []
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            assert torch.equal(got[5][i], dht[i]), i
            continue
        one = _call(tuple(x[:, a:z] for x in inputs), h0[i : i + 1], dht[i : i + 1])
        assert fused[-1] == ((1, z - a, 4, 128), None)
        pairs = [(x[:, a:z], r) for x, r in zip(got[:5], one[:5])] + [(got[5][i : i + 1], one[5])]
        same = all(torch.equal(x, r) for x, r in pairs)
        if (z - a) % CHUNK == 0 and not bwd.FUSED_DIET:
            assert same, (lens, i)
        else:
            for name, (x, r) in zip(NAMES, pairs):
                _close(f"sequence {i} {name}", x, r.double())
        bitwise.append(same)
    print(f"\n{lens} {dtype}: bit for bit alone {bitwise}")
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True, cu=cu)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", False)
    fused.clear()
    today = _call(inputs, h0, dht, cu)
    assert fused == []
    for name, a, r, o in zip(NAMES, got, want, today):
        _close(name, a, r)
        _close(name + " vs the two-launch slot path", a, o.double())


def test_in_passes_with_out(fused, monkeypatch):
    """Value heads in passes (TOKEN_HEADS_PER_PASS cut to one q head a pass: a fused launch
    each on strided head slices, their token-row outputs joined), empty first and last
    sequences, HV = H without l2norm (the kernel's dq, dk the op's, times the scale): bit for
    bit the one-pass call, within 2e-2 of the two-launch slot path; out= NaN-filled, written in
    place."""
    lens = [0, 130, 1, 64, 0]
    inputs = _problem(1, sum(lens), 2, 2, torch.bfloat16, seed=5)[:6]
    h0, dht = _states(len(lens), 2, 2, seed=6)
    cu = _cu(lens)
    one = _call(inputs, h0, dht, cu, l2norm=False)
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 1)
    fused.clear()
    out = tuple(torch.full_like(x, float("nan")) for x in one)
    got = _call(inputs, h0, dht, cu, l2norm=False, out=out)
    assert [c[1] for c in fused] == [sum(lens)] * 2, fused
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    for name, a, r in zip(NAMES, out, one):
        assert torch.equal(a, r), name
    monkeypatch.setattr(bwd, "FUSED_SLOTS", False)
    today = _call(inputs, h0, dht, cu, l2norm=False)
    for name, a, o in zip(NAMES, out, today):
        _close(name + " vs the two-launch slot path", a, o.double())


@pytest.mark.parametrize(("h", "hv", "l2norm"), [(2, 4, True), (4, 4, False)])
def test_one_graph_replayed(fused, h, hv, l2norm):
    """Captured with the route on at equal lengths (the slot layout: a capture reads no
    length), replayed with cu_seqlens rewritten in place; out= NaN-filled before each replay
    and written in place; each replay bit for bit the eager call where that is the slot route
    (unequal lengths, an empty first sequence), within 2e-2 at equal lengths (eager: the batch
    key; 200 % 64 > 0)."""
    inputs = _problem(1, 400, h, hv, torch.bfloat16, seed=31, l2norm=l2norm)[:6]
    h0, dht = _states(2, h, hv, seed=32)
    cu = _cu([200, 200])
    out = tuple(torch.empty_like(x) for x in (*inputs[:5], h0))

    def call():
        return _call(inputs, h0, dht, cu, l2norm, out)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    fused.clear()
    with torch.cuda.graph(graph):
        call()
    assert fused == [((1, 64 * (400 // 64 + 2), hv, 128), 400)], fused
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


@pytest.mark.parametrize(
    ("lens", "hv"),
    [([8192] * 4, 32), ([8192] * 4, 16), ("mix16", 32), ("mix64", 32)],
)  # fmt: skip
def test_time(monkeypatch, lens, hv):
    """H 16, l2norm off, cu_seqlens (the bench's cases): graph replays (the slot layout) with
    FUSED_SLOTS off, on as shipped (`slots_fit`: 4 x 8192 hv32 fused; hv16 and the mixes, more
    than a wave, not) and on with the rule forced, FUSED_DIET on (the default), then forced with
    the diet off (`varlen` with U read against `varlen, u_from_h`), printed (the eager column:
    the graph-vs-eager probe's). At equal lengths hv32 the fused graph's gradients bit for bit
    the eager call's (the batch path's fused kernel, FUSED_GROUPSUM off: the module docstring)
    with the diet off, within 2e-2 with it on (the batch call's h from the `fused` forward
    launch). Predicted (NOTES "next/fused-slots",
    "next/fused-slots-on46"): 4 x 8192 hv32 graph ~1.0 ms below off (5.52 -> ~4.5); hv16
    forced ~even; the mixes forced about even or slower; the diet off within -0.05 / +0.09 ms of
    on."""
    from forgekernel.bench.suites.gdn_prefill import _mix

    if isinstance(lens, str):
        lens = list(_mix(16, 16384) if lens == "mix16" else _mix(64, 32768))
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    for name in (bwd.FUSED_SWITCH, bwd.FUSED_SLOTS_SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _problem(1, total, 16, hv, torch.bfloat16, seed=13)
    h0, dht = _states(n, 16, hv, seed=14)
    args = [q, k, v, g, beta, do]
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": _cu(lens)}
    launches = []
    real = bwd._fused_bwd
    # the slot route's launches (`tokens`): eager equal lengths take the batch path's
    monkeypatch.setattr(
        bwd, "_fused_bwd", lambda *a, **k2: launches.append("tokens" in k2) or real(*a, **k2)
    )
    times = {}
    for label, on, forced, diet in (("off", False, False, True), ("on", True, False, True),
                                    ("forced", True, True, True),
                                    ("forced_nodiet", True, True, False)):  # fmt: skip
        monkeypatch.setattr(bwd, "FUSED_SLOTS", on)
        monkeypatch.setattr(bwd, "FUSED_DIET", diet)
        if forced:
            monkeypatch.setattr(bwd, "slots_fit", lambda *a: True)
        launches.clear()
        out = tuple(torch.empty_like(x) for x in (*args[:5], h0))
        grads = forgekernel.gated_delta_rule_backward(*args, out=out, **kw)
        for name, x in zip(NAMES, grads):
            assert torch.isfinite(x).all(), (label, name)
        times[label] = (_graph_ms(args, {**kw, "out": out}), any(launches))
    for diet in (False, True) if len(set(lens)) == 1 and hv == 32 else ():
        monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
        monkeypatch.setattr(bwd, "FUSED_DIET", diet)
        out = tuple(torch.empty_like(x) for x in (*args[:5], h0))
        graph = torch.cuda.CUDAGraph()
        forgekernel.gated_delta_rule_backward(*args, out=out, **kw)  # warm
        torch.cuda.synchronize()
        with torch.cuda.graph(graph):
            forgekernel.gated_delta_rule_backward(*args, out=out, **kw)
        graph.replay()
        torch.cuda.synchronize()
        want = forgekernel.gated_delta_rule_backward(*args, **kw)  # eager: the batch path
        for name, a, r in zip(NAMES, out, want):
            if diet:
                _close(f"diet {name}", a, r.double())
            else:
                assert torch.equal(a, r), name
    shape = f"{n} x {lens[0]}" if len(set(lens)) == 1 else f"mix{n}-t{total}"
    print(f"\nGDN backward {shape} h16 hv{hv} bf16 cu_seqlens: graph FUSED_SLOTS off "
          f"{times['off'][0]:.3f} ms, on {times['on'][0]:.3f} ms (fused: {times['on'][1]}), "
          f"forced {times['forced'][0]:.3f} ms (fused: {times['forced'][1]}), forced diet off "
          f"{times['forced_nodiet'][0]:.3f} ms")  # fmt: skip
