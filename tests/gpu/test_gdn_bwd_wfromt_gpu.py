"""The fused backward's `wg_split, w_from_t` key (kernels/linear_attention/gdn_bwd_fused/sm90, a
candidate: next/gdn-w-from-t; ops/gated_delta_rule_bwd.py FUSED_WFROMT, off) on the GPU: W = T
diag(beta e^G) K and u = T diag(beta) V formed in the kernel (its G2) from kernel 0's T^T, k, v,
beta and G, not read; v loaded into the WY u's box and overwritten there.

- The launcher, the fused route's inputs (`_route`): every output of the key (NaN-poisoned
  first: a row left unwritten fails) against the `wg_split` key fed (a) the model's W, u
  (`reference.gdn_bwd_factors.w_u_from_t`: the same 16-bit T, the products in fp64 rounded
  once; the kernel's differ by its fp32 order of sums, an ulp of W or u at most) and (b) kernel
  0's W, u (from its fp32 T: one 16-bit rounding of T apart); each within 1e-2 of the output's
  max (the diet tests' bound for U's rounding); the errors printed. bf16 and fp16, with / without
  dht, H = HV and HV = 2 H, T = 1, 63, 65, 130, 1000; `group_sum` at HV = 2 H.
- Through the op (FUSED_WFROMT on, the fused rules forced): the fused launch handed no W, no u
  and `wg_split` (at HV = 2 H its `group_sum` key, FUSED_GROUPSUM's default), outputs
  NaN-poisoned; the gradients against the fp64 backward (the suite's 2e-2) and within 1e-2 of
  FUSED_WFROMT off; B sequences and the varlen slot layout (FUSED_SLOTS, `varlen` keys).
- Printed (`-s`): 4 x 8192 h16 hv32 bf16 (`u_from_h`, with and without `group_sum`), the fused
  kernel's `wg_split` key on kernel 0's W, u against `wg_split, w_from_t`. Predicted (NOTES
  "next/gdn-w-from-t"): the same to +3% (2 x 0.52 MMAC more on G2's chain, 16 KB a chunk-head
  less read).
CPU twins: tests/test_gdn_bwd_fused_compile.py `test_wg_split_w_from_t` (the build),
tests/test_gdn_bwd_fused_dispatch.py `test_w_from_t_route` (the op's route on an emulation).

Kernel 0's and the forward launch's `w_from_t` keys (next/gdn-w-from-t2; with FUSED_WFROMT on B
equal sequences, so that W, u never reach HBM):
- `test_t_only_factors_key`: kernel 0's T-only key (no W, u, v not read): P^T, T^T, e^(G_C), G
  bit for bit the `fused` key's (the same code for them), NaN-poisoned first.
- `test_forward_launch_w_from_t`: the forward launch's key (u^T, -W's halves formed by its state
  warpgroups from T^T, v, k, beta, G), h and the final state NaN-poisoned, against the `fused`
  key fed the model's W, u (16-bit u: 1e-2 of each max) and against the fp64 recurrence on the
  model's products from the same 16-bit T^T (`_forward_fp64`: 1e-2 of each max).
- `test_through_the_op` also checks the route's keys: kernel 0 T-only and the forward launch
  handed beta on B sequences; the slot layout their standard keys (`test_varlen_slots`).
- `test_call_time` (printed, `-s`): the op's eager call with FUSED_WFROMT off / on at 4 x 8192
  h16 hv32 and 1 x 8192 h16 hv32 bf16 (the fused rules as they are: 1 x 8192 is not on the
  fused route, so on = off there up to noise), the gradients compared first. Predicted (NOTES
  "next/gdn-w-from-t2"): 4 x 8192 -0.05 to -0.2 ms (kernel 0 -48 KB a chunk-head of its ~80,
  the forward launch -8 KB and +1.05 MMAC a step, the fused kernel's `wg_split, w_from_t`)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_gdn_bwd_fused_gpu import _fused_kernel_args, _poisoned, _route, _run, _varlen_problem
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import launch as factors_launch
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import launch as state_launch
from forgekernel.reference.gdn_bwd_factors import for_kernel2, forward_launch_tiles, w_u_from_t
from forgekernel.reference.gdn_bwd_state import CHUNK, decayed_keys, to_chunks
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
OUTS = ("dq", "dk", "dg", "dv", "dbeta", "dh0")
W, UW = 5, 6  # w, uw in `_fused_kernel_args`' list after q (k, h, G, P^T, T^T, w, uw, v, ...)


def _near(name, a, o, bound=1e-2) -> float:
    """a within `bound` of o's max (finite: a NaN is a value the key left unwritten); returns
    the error relative to that max."""
    assert a.shape == o.shape and torch.isfinite(a).all(), name
    top = float(o.double().abs().max())
    err = float((a.double() - o.double()).abs().max())
    assert err <= bound * top + 1e-5, (name, err, top)
    return err / max(top, 1e-30)


def _wy_args(rest, w, uw):
    """`_fused_kernel_args`' list after q with W, u replaced (None, None: `w_from_t`)."""
    out = list(rest)
    out[W], out[UW] = w, uw
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
@pytest.mark.parametrize(("b", "t", "h", "hv", "pair"),
                         [(1, 1, 1, 1, False), (2, 63, 2, 4, False), (1, 65, 1, 2, True),
                          (3, 1000, 2, 2, False), (2, 130, 4, 8, True),
                          (2, 63, 2, 4, True)])  # fmt: skip
def test_key_against_the_split_key(dtype, with_dht, b, t, h, hv, pair):
    problem, tiles, states, _ = _route(b, t, h, hv, dtype, seed=t + 5 * hv)
    do = problem[5]
    q, *rest = _fused_kernel_args(problem, tiles, states[False][1])
    if not with_dht:
        rest[-1] = None
    kw = {"scale": 128**-0.5, "group_sum": pair, "wg_split": True}
    k, big_g, tt, v, beta = rest[0], rest[2], rest[4], rest[7], rest[8]
    model = w_u_from_t(tt, k, v, beta, big_g)
    got = _poisoned(do, None, q, _wy_args(rest, None, None), **kw)
    fed = _poisoned(do, None, q, _wy_args(rest, *model), **kw)
    kernel0 = _poisoned(do, None, q, rest, **kw)
    errs = {name: (_near(name, a, m), _near(name + " vs kernel 0's W, u", a, o))
            for name, a, m, o in zip(OUTS, got, fed, kernel0)}  # fmt: skip
    shown = {n: f"{e[0]:.1e} / {e[1]:.1e}" for n, e in errs.items()}
    print(f"\nw_from_t {dtype} {(b, t, h, hv)} pair={pair}, max err / max against the model's "
          f"W, u / kernel 0's: {shown}")  # fmt: skip


def _w_from_t_route(monkeypatch, keys=None):
    """FUSED, FUSED_SLOTS and FUSED_WFROMT on, both fused rules forced; each fused launch
    checked for its `wg_split, w_from_t` form (no W, no u) and run with its outputs
    NaN-poisoned. Records (do's shape, tokens, group_sum) a launch; `keys` (a list): kernel 0's
    and the forward launch's forms, ("factors", w_from_t, W / u written) and ("state", beta
    handed, W read) a launch."""
    calls = []
    if keys is not None:
        factors, state = bwd._factors, bwd._state_recurrence

        def factors_seen(*a, **kw):
            out = factors(*a, **kw)
            keys.append(("factors", kw.get("w_from_t", False), "w" in out or "u" in out))
            return out

        def state_seen(*a, **kw):
            keys.append(("state", kw.get("beta") is not None, a[2] is not None))
            return state(*a, **kw)

        monkeypatch.setattr(bwd, "_factors", factors_seen)
        monkeypatch.setattr(bwd, "_state_recurrence", state_seen)

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, **flags):
        assert u is None and w is None and uw is None and flags.get("wg_split"), flags
        if out is None:
            states = None if "cu_seqlens" not in flags else flags["cu_seqlens"].shape[0] - 1
            heads = q.shape[2] if flags.get("group_sum") else None
            out = fused_launch.empty_outputs(do, q.shape[-1], flags.get("tokens"), states,
                                             heads)  # fmt: skip
        for x in out:
            x.fill_(float("nan"))
        calls.append((tuple(do.shape), flags.get("tokens"), flags.get("group_sum", False)))
        return fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht,
                                          out=out, **flags)  # fmt: skip

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    monkeypatch.delenv(bwd.FUSED_SLOTS_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
    monkeypatch.setattr(bwd, "FUSED_WFROMT", True)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "slots_fit", lambda *a: True)
    real = bwd._fused_bwd
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls, real


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm"), [(1, 1, 1, 2, False),
                                                           (2, 65, 2, 4, True),
                                                           (3, 1000, 1, 2, False),
                                                           (2, 64, 4, 4, False)])  # fmt: skip
def test_through_the_op(monkeypatch, dtype, b, t, h, hv, l2norm):
    keys = []
    calls, real = _w_from_t_route(monkeypatch, keys)
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    inputs = (q, k, v, g, beta, do)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert calls == [((b, t, hv, 128), None, hv == 2 * h)], calls
    assert keys == [("factors", True, False), ("state", True, False)], keys  # W, u nowhere
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    monkeypatch.setattr(bwd, "FUSED_WFROMT", False)
    monkeypatch.setattr(bwd, "_fused_bwd", real)
    off = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r, o in zip(NAMES, got, want, off):
        _close(name, a, r)
        _near(name + " vs FUSED_WFROMT off", a, o)


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [1000, 70]])
def test_varlen_slots(monkeypatch, lens):
    """Unequal lengths: the slot layout's fused launch (`varlen, wg_split, w_from_t`, v and
    T^T at the slots), token rows."""
    keys = []
    calls, _ = _w_from_t_route(monkeypatch, keys)
    inputs, h0, dht, cu = _varlen_problem(lens, seed=len(lens))
    got = _run(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    assert len(calls) == 1 and calls[0][1] is not None, calls
    assert keys == [("factors", False, True), ("state", False, True)], keys  # no varlen form
    want = _reference(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


@pytest.mark.parametrize("pair", [True, False], ids=["group_sum", "no_group_sum"])
def test_time(pair):
    """4 x 8192 h16 hv32 bf16 (`u_from_h`; `group_sum`: the default route's key): the fused
    kernel's `wg_split` key on kernel 0's W, u against `wg_split, w_from_t`, printed; the
    outputs compared first (1e-2 of each max)."""
    problem, tiles, states, _ = _route(4, 8192, 16, 32, torch.bfloat16, seed=13)
    do = problem[5]
    q, *rest = _fused_kernel_args(problem, tiles, states[False][1])
    kw = {"group_sum": pair, "wg_split": True}
    wfromt = _wy_args(rest, None, None)
    base = _poisoned(do, None, q, rest, **kw)
    for name, a, o in zip(OUTS, _poisoned(do, None, q, wfromt, **kw), base):
        _near(name, a, o)
    ms = {key: median(time_ms(lambda args=args: fused_launch.gdn_bwd_fused(do, None, q, *args,
                                                                            **kw),
                              reps=10))
          for key, args in (("read", rest), ("formed", wfromt))}  # fmt: skip
    print(f"\nGDN fused backward 4 x 8192 h16 hv32 bf16 (u_from_h, wg_split, group_sum={pair}),"
          f" W, u read / formed (w_from_t): {ms['read']:.3f} / {ms['formed']:.3f} ms "
          f"({ms['read'] / ms['formed']:.3f}x)")  # fmt: skip


# ---- kernel 0's and the forward launch's `w_from_t` keys (next/gdn-w-from-t2)

T_ONLY_CASES = [(1, 1, 1, 1), (2, 63, 2, 4), (1, 65, 1, 2), (3, 1000, 2, 2), (2, 130, 4, 8)]


def _t_only(problem):
    """Kernel 0's `fused, w_from_t` key on `problem`, its outputs NaN-poisoned first."""
    q, k, v, g, beta = problem[:5]
    out = factors_launch.empty_outputs(q, v, fused=True, w_from_t=True)
    for x in out.values():
        x.fill_(float("nan"))
    return factors_launch.gdn_bwd_factors(q, k, v, g, beta, fused=True, w_from_t=True, out=out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv"), T_ONLY_CASES)
def test_t_only_factors_key(dtype, b, t, h, hv):
    problem, tiles, _, _ = _route(b, t, h, hv, dtype, seed=t + 11 * hv)
    got = _t_only(problem)
    assert set(got) == set(tiles[True]) - {"w", "u"}
    for name, x in got.items():
        assert torch.equal(x, tiles[True][name]), name


def _forward_fp64(tt, k, v, beta, big_g, h0):
    """The forward recurrence in fp64 on the model's W, u from the 16-bit T^T (unrounded A
    operands): S = h0, per chunk h = S, U = u - W S, S <- e^(G_C) S + (K e^(G_C - G))^T U.
    Returns (h (B, NC, HV, K, V), the final state)."""
    t = v.shape[1]
    nc = -(-t // CHUNK)
    w, u = w_u_from_t(tt.double(), k.double(), v.double(), beta, big_g[:, :t])
    wc, uc = (to_chunks(x, nc) for x in (w, u))
    kc = decayed_keys(k, big_g).unflatten(1, (nc, CHUNK)).transpose(2, 3)
    e_c = big_g.double().unflatten(1, (nc, CHUNK))[:, :, -1].exp()  # (B, NC, HV)
    s = h0.double()
    hs = []
    for c in range(nc):
        hs.append(s)
        big_u = uc[:, c] - wc[:, c] @ s
        s = e_c[:, c, :, None, None] * s + kc[:, c].transpose(-1, -2) @ big_u
    return torch.stack(hs, 1), s


# no_h0: the keys without an initial state (d_final_state False), which the op takes when h0 is
# None and no other GPU test runs (the form whose HGMMAs ptxas had serialized: next/wft-review)
@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv"), T_ONLY_CASES)
def test_forward_launch_w_from_t(dtype, b, t, h, hv, with_h0):
    problem, tiles, _, launch = _route(b, t, h, hv, dtype, seed=t + 13 * hv)
    q, k, v, g, beta, do, h0, dht = problem
    if not with_h0:
        h0 = None
    t_only = _t_only(problem)
    wide = beta.float().contiguous()
    fw = forward_launch_tiles(t_only, identity=False, k=k, v=v, beta=wide)
    out = state_launch.empty_outputs(v, k.shape[-1], out16=True, fused=True)
    for x in out[1:]:
        x.fill_(float("nan"))
    _, h16, final = state_launch.gdn_bwd_state(
        *(fw[n] for n in ("do", "pt", "ke", "qe", "w")), fw["e_last"], h0, out=out, out16=True,
        forward=True, big_g=t_only["big_g"], beta=fw["beta"],
    )  # fmt: skip
    # the `fused` key fed the model's W, u (16-bit; zero rows past T, as kernel 0 writes them)
    k2 = for_kernel2(t_only, t)
    model = w_u_from_t(k2["tt"], k, v, wide, k2["big_g"])
    fed_tiles = dict(t_only)
    for name, x in zip(("w", "u"), model):
        fed_tiles[name] = x.new_zeros(b, t_only["big_g"].shape[1], hv, x.shape[-1])
        fed_tiles[name][:, :t] = x
    fed = forward_launch_tiles(fed_tiles, identity=False, k=k)
    _, h_fed, final_fed = state_launch.gdn_bwd_state(
        *(fed[n] for n in ("do", "pt", "ke", "qe", "w")), fed["e_last"], h0, out16=True,
        forward=True, big_g=fed["big_g"],
    )  # fmt: skip
    start = torch.zeros_like(final_fed) if h0 is None else h0
    h64, final64 = _forward_fp64(k2["tt"], k, v, wide, t_only["big_g"], start)
    # bf16: twice the error of a CPU emulation of the key's roundings (fp64 sums; up to 6.5e-3 of
    # the max at (2, 130, 4, 8), 6e-3 against fp64: next/wft-review); fp16's was 7e-4
    bound = 2e-2 if dtype == torch.bfloat16 else 1e-2
    errs = {"h": (_near("h", h16, h_fed, bound), _near("h vs fp64", h16, h64, bound)),
            "final": (_near("final", final, final_fed, bound),
                      _near("final vs fp64", final, final64, bound))}  # fmt: skip
    shown = {n: f"{e[0]:.1e} / {e[1]:.1e}" for n, e in errs.items()}
    print(f"\nforward launch w_from_t {dtype} {(b, t, h, hv)} h0={with_h0}, max err / max against "
          f"the `fused` key fed the model's W, u / fp64: {shown}")  # fmt: skip


@pytest.mark.parametrize("with_h0", [True, False], ids=["h0", "no_h0"])
def test_forward_launch_time(with_h0):
    """4 x 8192 h16 hv32 bf16: the forward launch's `fused` key (kernel 0's W, u read) against
    its `w_from_t` key (formed), with and without an initial state (no_h0: the keys whose
    HGMMAs ptxas serialized before next/wft-review; `test_call_time` runs the h0 keys only),
    printed; h compared first (1e-2 of its max)."""
    problem, tiles, _, _ = _route(4, 8192, 16, 32, torch.bfloat16, seed=19)
    q, k, v, g, beta, do, h0, dht = problem
    h0 = h0 if with_h0 else None
    t_only = _t_only(problem)
    formed = forward_launch_tiles(t_only, identity=False, k=k, v=v,
                                  beta=beta.float().contiguous())  # fmt: skip
    read = forward_launch_tiles(tiles[True], identity=False, k=k)
    names = ("do", "pt", "ke", "qe", "w")
    runs = {
        "read": lambda: state_launch.gdn_bwd_state(
            *(read[n] for n in names), read["e_last"], h0, out16=True, forward=True,
            big_g=read["big_g"]),
        "formed": lambda: state_launch.gdn_bwd_state(
            *(formed[n] for n in names), formed["e_last"], h0, out16=True, forward=True,
            big_g=t_only["big_g"], beta=formed["beta"]),
    }  # fmt: skip
    h = {key: run()[1] for key, run in runs.items()}
    _near("h", h["formed"], h["read"], 2e-2)  # bf16: `test_forward_launch_w_from_t`'s bound
    ms = {key: median(time_ms(run, reps=10)) for key, run in runs.items()}
    print(f"\nGDN forward launch 4 x 8192 h16 hv32 bf16 h0={with_h0}, W, u read (`fused`) / "
          f"formed (`w_from_t`): {ms['read']:.3f} / {ms['formed']:.3f} ms "
          f"({ms['read'] / ms['formed']:.3f}x)")  # fmt: skip


@pytest.mark.parametrize(("b", "t"), [(4, 8192), (1, 8192)])
def test_call_time(monkeypatch, b, t):
    """The op's eager backward call (l2norm off, h0 and dht given) at B x 8192 h16 hv32 bf16,
    FUSED_WFROMT off / on, the fused rules as they are (4 x 8192: the fused route, `wg_split,
    w_from_t, group_sum` with the T-only kernel 0 and the `w_from_t` forward launch on; 1 x
    8192: not the fused route, the switch changes nothing); the gradients compared first (1e-2
    of each max); printed."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    q, k, v, g, beta, do, h0, dht = _problem(b, t, 16, 32, torch.bfloat16, seed=17)
    inputs = (q, k, v, g, beta, do)
    grads, ms = {}, {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "FUSED_WFROMT", on)
        grads[on] = _run(inputs, h0=h0, dht=dht, l2norm=False)
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        _near(name + " on vs off", a, o)
    del grads
    for on in (False, True, False, True):  # interleaved: drift shows as off != off
        monkeypatch.setattr(bwd, "FUSED_WFROMT", on)
        ms.setdefault(on, []).append(median(time_ms(
            lambda: _run(inputs, h0=h0, dht=dht, l2norm=False), reps=10)))  # fmt: skip
    off, on = min(ms[False]), min(ms[True])
    print(f"\nGDN backward call {b} x {t} h16 hv32 bf16 eager, FUSED_WFROMT off / on: "
          f"{off:.3f} / {on:.3f} ms ({on - off:+.3f} ms, {off / on:.3f}x); each of two runs: "
          f"off {ms[False]}, on {ms[True]}")  # fmt: skip
