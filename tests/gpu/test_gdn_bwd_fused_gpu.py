"""The Gated DeltaNet fused backward (kernels/linear_attention/gdn_bwd_fused/sm90, behind
ops/gated_delta_rule_bwd.py FUSED: kernel 1's reverse launch and kernel 2 in one kernel, one
CTA per (sequence, value head)) on the GPU, with FUSED on and its dispatch rule forced
(`fused_fits` patched: the small shapes below fall under the wave rule): against the fp64
chunked backward (reference/delta_rule_bwd.py) and against today's path (FUSED off) on the
same 16-bit inputs, the fused kernel's outputs NaN-poisoned before every launch (a row it
leaves unwritten fails); bf16 and fp16; T = 1, 63, 64, 65, 1000; B 1-3; H = HV and HV = 2H
(q / k read at their own heads); with / without a final-state gradient; l2norm on / off (the q /
k epilogue after the fused kernel); varlen (equal lengths on the fused kernel, unequal ones in
the slot layout on today's path). The times printed (`-s`) at 4 x 8192 h16 hv32 (the rule's own
choice: 128 CTAs, fused) and, rule forced, at 1 x 2048 and 1 x 8192 hv32 (32 CTAs: the rule
keeps today's path there), each next to today's path. Tolerance: 2e-2 of each gradient's max
(the suite's rule, tests/gpu/test_gdn_bwd_kernel_path_gpu.py's). FUSED_DIET (next/gdn-fused-diet,
the default: kernel 0's `fused` key, the forward launch's `fused`, the fused kernel's
`u_from_h`) is what the tests above run; `test_diet_*` set it against the route of before,
kernel by kernel and through the op, and time the two. CPU twins:
tests/test_gdn_bwd_fused_dispatch.py (the path on an emulation), tests/
test_gdn_bwd_fused_compile.py (the build)."""

from __future__ import annotations

import importlib
import inspect

import pytest
import torch
from graphs import captured, replay_poisoned
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import launch as factors_launch
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.launch import gdn_bwd_state
from forgekernel.reference.gdn_bwd_factors import for_kernel2, forward_launch_tiles
from forgekernel.reference.gdn_bwd_state import u_from_states
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")


@pytest.fixture
def fused(monkeypatch):
    """FUSED on, the rule forced, the fused kernel's outputs NaN-poisoned before each launch;
    its launches recorded (do's shape). The op's flags passed on: at HV = 2 H its `group_sum`
    key (FUSED_GROUPSUM, the default since 2026-12-07: dq, dk at the H heads)."""
    calls = []

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, scale=1.0,
            group_sum=False):  # fmt: skip
        if out is None:
            out = fused_launch.empty_outputs(do, q.shape[-1],
                                             heads=q.shape[2] if group_sum else None)  # fmt: skip
        for x in out:
            x.fill_(float("nan"))
        calls.append(tuple(do.shape))
        return fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                                          scale=scale, out=out, group_sum=group_sum)  # fmt: skip

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls


def _run(inputs, *, h0, dht, l2norm, cu=None):
    q, k, v, g, beta, do = inputs
    return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                 d_final_state=dht, cu_seqlens=cu,
                                                 use_qk_l2norm_in_kernel=l2norm)  # fmt: skip


def _poisoned(do, u, q, rest, **kw):
    """The fused launcher with its outputs NaN-filled first (`group_sum` kw: dq, dk at H)."""
    heads = q.shape[2] if kw.get("group_sum") else None
    out = fused_launch.empty_outputs(do, q.shape[-1], heads=heads)
    for x in out:
        x.fill_(float("nan"))
    return fused_launch.gdn_bwd_fused(do, u, q, *rest, out=out, **kw)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 1000])
@pytest.mark.parametrize(
    ("b", "h", "hv", "l2norm", "with_h0", "with_dht"),
    [(1, 2, 2, False, True, True), (2, 2, 4, True, False, True), (3, 1, 2, True, True, False),
     (2, 4, 4, False, False, False)],
)  # fmt: skip
def test_matches_the_fp64_backward_and_todays_path(fused, monkeypatch, dtype, t, b, h, hv,
                                                   l2norm, with_h0, with_dht):  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)
    inputs = (q, k, v, g, beta, do)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert fused == [(b, t, hv, 128)], "the fused kernel was not taken"
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    monkeypatch.setattr(bwd, "FUSED", False)
    today = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r, o in zip(NAMES, got, want, today):
        _close(name, a, r)
        _close(name + " vs today's path", a, o.double())


def _varlen_problem(lens, seed, **kw):
    """(inputs, h0, dht, cu): `_problem`'s bf16 inputs over one row of sum(lens) tokens (H 2,
    HV 4), cut by cu_seqlens = lens' offsets, h0 / dht one per sequence (the varlen tests')."""
    n = len(lens)
    q, k, v, g, beta, do, h0, dht = _problem(1, sum(lens), 2, 4, torch.bfloat16, seed=seed, **kw)
    h0, dht = h0.expand(n, -1, -1, -1).contiguous(), dht.expand(n, -1, -1, -1).contiguous()
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)  # fmt: skip
    return (q, k, v, g, beta, do), h0, dht, cu


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [1000, 70], [65, 65, 65]])
def test_varlen(fused, monkeypatch, lens):
    """cu_seqlens (ops/_linattn_varlen.py `backward_varlen`): equal lengths are B sequences (a
    reshape), on the fused kernel; unequal ones run once in the varlen slot layout
    (`_slots_path`, the default), whose device pass takes the fused kernel only within
    `config.slots_fit`'s wave (FUSED_SLOTS; not patched here: N x HV = 24 or 8 CTAs, the
    two-launch slot path; tests/gpu/test_gdn_bwd_fused_slots_gpu.py forces it): the fused kernel
    not launched. Both against the fp64 varlen backward."""
    inputs, h0, dht, cu = _varlen_problem(lens, seed=len(lens))
    in_slots = []
    real = bwd._device_pass

    def device_pass(*a, **kw):
        in_slots.append(inspect.signature(real).bind(*a, **kw).arguments.get("slots") is not None)
        return real(*a, **kw)

    monkeypatch.setattr(bwd, "_device_pass", device_pass)
    got = _run(inputs, h0=h0, dht=dht, l2norm=True, cu=cu)
    equal = len(set(lens)) == 1
    assert in_slots == [not equal], in_slots  # one device pass, in the slot layout if unequal
    assert fused == ([(len(lens), lens[0], 4, 128)] if equal else []), fused
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True, cu=cu)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


@pytest.mark.parametrize(("b", "t", "passes"), [(4, 200, 1), (8, 130, 2)])
def test_the_default_rule_with_out_and_a_graph(monkeypatch, b, t, passes):
    """FUSED as shipped (the rule not forced, the switch unset): h16 hv32 bf16 with B x HV (a
    pass's) at 128 CTAs takes the fused kernel, in one pass or in two of eight heads
    (TOKEN_HEADS_PER_PASS cut: strided head slices, the passes joined into out=); the op's
    out= (NaN-filled) written in place and close to today's path (FUSED off) and the fp64
    backward; the same call captured in a CUDA graph, its replay (out= NaN-filled again)
    equal to the eager call (next/int45-review: FUSED's default route beyond the tests above)."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    if passes > 1:
        # step = TOKEN_HEADS_PER_PASS // (B T group) q heads a pass: 16 / passes
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", b * t * 2 * (16 // passes))
    launches = []
    real = bwd._fused_bwd
    monkeypatch.setattr(bwd, "_fused_bwd", lambda *a, **kw: launches.append(1) or real(*a, **kw))
    q, k, v, g, beta, do, h0, dht = _problem(b, t, 16, 32, torch.bfloat16, seed=b + t)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    want = _reference(tuple(args), h0=h0, dht=dht, l2norm=False)
    monkeypatch.setattr(bwd, "FUSED", False)
    today = forgekernel.gated_delta_rule_backward(*args, **kw)
    assert launches == []
    monkeypatch.setattr(bwd, "FUSED", True)
    out = tuple(torch.full_like(x, float("nan")) for x in today)

    def call():
        return forgekernel.gated_delta_rule_backward(*args, out=out, **kw)

    got = call()
    assert launches == [1] * passes, launches
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    for name, a, r, o in zip(NAMES, out, want, today):
        _close(name, a, r)
        _close(name + " vs today's path", a, o.double())
    eager = [x.clone() for x in out]
    graph = captured(call)
    replay_poisoned(graph, out)
    for name, a, e in zip(NAMES, out, eager):
        _close(name + " graph replay", a, e.double())


def _time(args, kw) -> float:
    return median(time_ms(lambda: forgekernel.gated_delta_rule_backward(*args, **kw), reps=10))


@pytest.mark.parametrize(("b", "t", "forced"), [(4, 8192, False), (1, 2048, True),
                                                (1, 8192, True)])  # fmt: skip
def test_time_next_to_todays_path(monkeypatch, b, t, forced):
    """h16 hv32 bf16: the call with FUSED off and on (at 4 x 8192 the rule's own choice; at 1 x
    2048 and 1 x 8192 forced: the rule keeps today's path there) and the fused kernel alone,
    printed; gradients finite. Predictions: NOTES.md "GDN fused backward"."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, 16, 32, torch.bfloat16, seed=13)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "FUSED", False)
    today = _time(args, kw)
    monkeypatch.setattr(bwd, "FUSED", True)
    if forced:
        monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    launches = []
    real = bwd._fused_bwd
    monkeypatch.setattr(
        bwd, "_fused_bwd", lambda *a, **k2: launches.append((a, k2)) or real(*a, **k2)
    )
    grads = forgekernel.gated_delta_rule_backward(*args, **kw)
    assert launches, "the fused kernel was not taken"
    for name, x in zip(NAMES, grads):
        assert torch.isfinite(x).all(), name
    ours = _time(args, kw)
    a, k2 = launches[0]
    kernel = median(time_ms(lambda: real(*a, **k2), reps=10))
    print(
        f"\nGDN backward {b} x {t} h16 hv32 bf16: today's path {today:.3f} ms, FUSED "
        f"{ours:.3f} ms (the fused kernel {kernel:.3f} ms)"
    )


# ---- FUSED_DIET (next/gdn-fused-diet): the fused route's keys against the route of before


def _route(b, t, h, hv, dtype, seed):
    """`_problem`'s inputs and the fused route's first two kernels on them as `_fused_pass` runs
    them, both ways: kernel 0's standard and `fused` dicts; the forward launch's `forward` key on
    the standard dict (Ke) and its `fused` key on the `fused` dict (k and G); each launch's
    arguments (q taken as scaled, k unit rows)."""
    problem = _problem(b, t, h, hv, dtype, seed=seed)
    q, k, v, g, beta, do, h0, dht = problem
    tiles = {f: factors_launch.gdn_bwd_factors(q, k, v, g, beta, fused=f) for f in (False, True)}
    launch, states = {}, {}
    for f in (False, True):
        fw = forward_launch_tiles(tiles[f], identity=False, k=k if f else None)
        args = (*(fw[n] for n in ("do", "pt", "ke", "qe", "w")), fw["e_last"], h0)
        launch[f] = (
            args,
            {"out16": True, "forward": True, **({"big_g": fw["big_g"]} if f else {})},
        )
        states[f] = gdn_bwd_state(*launch[f][0], **launch[f][1])
    return problem, tiles, states, launch


def _fused_kernel_args(problem, tiles, h16):
    """The fused kernel's arguments after U (`gdn_bwd_fused(do, U, *these)`)."""
    q, k, v, g, beta, do, h0, dht = problem
    t = q.shape[1]
    k2 = for_kernel2(tiles[False], t)
    return (q, k, h16, k2["big_g"], tiles[False]["pt"][:, :t], k2["tt"], k2["w"], k2["u"], v,
            beta.float().contiguous(), dht)  # fmt: skip


DIET_CASES = [(1, 1, 2, 2), (2, 63, 2, 4), (1, 65, 1, 2), (3, 1000, 2, 2), (2, 130, 4, 4)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv"), DIET_CASES)
def test_diet_keys_against_the_standard_ones(dtype, b, t, h, hv):
    """Kernel 0's `fused` key: every tile but Ke, Qe bit for bit the standard key's, Ke and Qe
    not written. The forward launch's `fused` key (k at its H heads and G in place of Ke): no
    U; h and the final state within 1e-2 of the `forward` key's max (the 16-bit rounding of
    U^T e^(G_C - G) in place of Ke's). The fused kernel's `u_from_h` (U = u - W h formed in the
    kernel) against the same kernel reading the `forward` launch's U, on the same inputs
    (NaN-poisoned outputs): every gradient within 1e-2 of its max (U's 16-bit rounding in
    another order of sums is all that differs), and u_from_states (fp64, rounded once) within
    two 16-bit ulps of that U."""
    problem, tiles, states, _ = _route(b, t, h, hv, dtype, seed=t + 7 * hv)
    do = problem[5]
    assert set(tiles[True]) == set(tiles[False]) - {"ke", "qe"}
    for name, x in tiles[True].items():
        assert torch.equal(x, tiles[False][name]), name
    (u16, h16, s16), (none, h_fused, s_fused) = states[False], states[True]
    assert none is None
    for name, a, r in (("h", h_fused, h16), ("final state", s_fused, s16)):
        assert torch.isfinite(a).all(), name
        err = float((a.double() - r.double()).abs().max())
        assert err <= 1e-2 * float(r.double().abs().max()) + 1e-5, (name, err)
    rest = _fused_kernel_args(problem, tiles, h16)
    big_u = u16[:, :t]
    # two ulps (+ slack where U cancels): fp32 sums in two orders, each rounded once
    ulp = 2 * torch.finfo(dtype).eps * big_u.double().abs() + 1e-5
    model = u_from_states(rest[7], rest[6], h16)  # the WY u, W
    assert bool(((model.double() - big_u.double()).abs() <= ulp).all())
    got = {}
    for u in (big_u, None):
        out = fused_launch.empty_outputs(do, rest[0].shape[-1])
        for x in out:
            x.fill_(float("nan"))
        got[u is None] = fused_launch.gdn_bwd_fused(do, u, *rest, out=out)
    for name, a, o in zip(("dq", "dk", "dg", "dv", "dbeta", "dh0"), got[True], got[False]):
        assert torch.isfinite(a).all(), name
        err = float((a.double() - o.double()).abs().max())
        assert err <= 1e-2 * float(o.double().abs().max()) + 1e-5, (name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm"), [(2, 65, 2, 4, True),
                                                           (1, 1000, 2, 2, False)])  # fmt: skip
def test_diet_through_the_op(fused, monkeypatch, dtype, b, t, h, hv, l2norm):
    """The op on the fused route with FUSED_DIET on (kernel 0 asked for `fused`, the forward
    launch handed k and G, the fused kernel no U) and off (none of them): both within the
    suite's tolerance of the fp64 backward, and of each other within 1e-2 of each max."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    inputs = (q, k, v, g, beta, do)
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    seen = []
    factors, state = bwd._factors, bwd._state_recurrence
    monkeypatch.setattr(
        bwd, "_factors", lambda *a, **kw: seen.append(("k0", kw)) or factors(*a, **kw)
    )
    monkeypatch.setattr(bwd, "_state_recurrence",
                        lambda *a, **kw: seen.append(("k1", kw)) or state(*a, **kw))  # fmt: skip
    grads = {}
    for diet in (True, False):
        monkeypatch.setattr(bwd, "FUSED_DIET", diet)
        seen.clear()
        fused.clear()
        grads[diet] = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
        assert fused == [(b, t, hv, 128)]
        on = [(n, kw.get("fused", "big_g" in kw)) for n, kw in seen]
        assert on == [("k0", diet), ("k1", diet)], on
        for name, a, r in zip(NAMES, grads[diet], want):
            _close(f"{name} (diet {diet})", a, r)
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        err = float((a.double() - o.double()).abs().max())
        assert err <= 1e-2 * float(o.double().abs().max()) + 1e-5, (name, err)


def test_diet_time(monkeypatch):
    """4 x 8192 h16 hv32 bf16 (the rule's own choice: fused): the call with FUSED_DIET off and
    on, and each changed kernel alone, both keys (kernel 0 standard / `fused`, the forward
    launch `forward` / `fused`, the fused kernel U read / `u_from_h`), printed. Predictions:
    NOTES.md "next/gdn-fused-diet"."""
    problem, tiles, states, launch = _route(4, 8192, 16, 32, torch.bfloat16, seed=13)
    q, k, v, g, beta, do, h0, dht = problem
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    call = {}
    for diet in (False, True):
        monkeypatch.setattr(bwd, "FUSED_DIET", diet)
        call[diet] = _time(args, kw)

    def timed(fn):
        return median(time_ms(fn, reps=10))

    k0 = {f: timed(lambda f=f: factors_launch.gdn_bwd_factors(q, k, v, g, beta, fused=f))
          for f in (False, True)}  # fmt: skip
    k1 = {x: timed(lambda x=x: gdn_bwd_state(*launch[x][0], **launch[x][1]))
          for x in (False, True)}  # fmt: skip
    u16, h16, _ = states[False]
    rest = _fused_kernel_args(problem, tiles, h16)
    u_in = {False: u16[:, : q.shape[1]], True: None}
    kf = {x: timed(lambda x=x: fused_launch.gdn_bwd_fused(do, u_in[x], *rest))
          for x in (False, True)}  # fmt: skip
    print(
        f"\nGDN backward 4 x 8192 h16 hv32 bf16, FUSED_DIET off / on: call {call[False]:.3f} / "
        f"{call[True]:.3f} ms; kernel 0 {k0[False]:.3f} / {k0[True]:.3f}, forward launch "
        f"{k1[False]:.3f} / {k1[True]:.3f}, fused kernel {kf[False]:.3f} / {kf[True]:.3f}"
    )
