"""The fused backward's `wg_split` key (kernels/linear_attention/gdn_bwd_fused/sm90, a candidate:
next/gdn-bwd-wgsplit) on the GPU: 512 threads, G's chain on two math warpgroups (G1: dU, dw, the
WY half, dk; G2: U, dPD, dq, K K^T, dk's inter-chunk half), S the state only, with the same code
and sums per accumulator. Nothing in the op uses the key yet: these tests compare it with the
key without it, launch against launch, on the same inputs.

- The launcher, the fused route's inputs (`_route`): every output of the key (NaN-poisoned
  first: a row left unwritten fails) against the key without it: bit for bit expected (each
  accumulator sees the same products in the same order, only on other threads), one ulp
  of each value tolerated (`_same`: where ptxas contracts a multiply-add differently at the
  other register budget; dq's dPD product takes dPD from registers, not shared memory, the same
  16-bit values); bf16 and fp16, U read and `u_from_h`, with / without dht, H = HV
  and HV = 2 H, T = 1, 63, 65, 130, 1000.
- Through the op (FUSED on, the fused rule forced, FUSED_GROUPSUM off: the key is not built
  with `group_sum`): each fused launch run twice, the key without `wg_split` then with it, the
  two compared as above, the op going on with the key's outputs (then against the fp64
  backward); B equal sequences and the varlen slot layout (FUSED_SLOTS, `slots_fit` forced:
  the `varlen, wg_split` keys).
- Printed (`-s`): 4 x 8192 h16 hv32 bf16 (128 CTAs), the fused kernel alone without / with the
  key (`u_from_h`, no `group_sum`), the route's inputs. Predicted (NOTES
  "next/gdn-bwd-wgsplit"): ~2.04 -> ~1.35-1.6 ms (10.5-12.5 us a chunk step, from ~15.9).
CPU twin: tests/test_gdn_bwd_fused_compile.py `test_wg_split` (the build, its SASS)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_gdn_bwd_fused_gpu import _fused_kernel_args, _poisoned, _route, _run, _varlen_problem
from test_gdn_bwd_kernel_path_gpu import NAMES, _close, _problem, _reference

from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
OUTS = ("dq", "dk", "dg", "dv", "dbeta", "dh0")


def _same(name, a, o):
    """a (the key's) equal to o, or within one ulp of o's dtype at each value; a NaN (a value
    the key left unwritten) fails either way. Returns whether bit for bit."""
    assert a.shape == o.shape and torch.isfinite(a).all(), name
    if torch.equal(a, o):
        return True
    ulp = torch.finfo(o.dtype).eps * o.double().abs() + torch.finfo(o.dtype).tiny
    err = (a.double() - o.double()).abs()
    assert bool((err <= ulp).all()), (name, float(err.max()), float((err / ulp).max()))
    return False


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("u_from_h", [True, False], ids=["u_from_h", "u_read"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
@pytest.mark.parametrize(("b", "t", "h", "hv"), [(1, 1, 1, 1), (2, 63, 2, 4), (1, 65, 1, 2),
                                                 (3, 1000, 2, 2), (2, 130, 4, 8)])  # fmt: skip
def test_key_against_the_standard_key(dtype, u_from_h, with_dht, b, t, h, hv):
    problem, tiles, states, _ = _route(b, t, h, hv, dtype, seed=t + 3 * hv)
    do = problem[5]
    u16, h16, _ = states[False]
    q, *rest = _fused_kernel_args(problem, tiles, h16)
    if not with_dht:
        rest[-1] = None
    u = None if u_from_h else u16[:, :t]
    scale = 128**-0.5
    base = _poisoned(do, u, q, rest, scale=scale)
    split = _poisoned(do, u, q, rest, scale=scale, wg_split=True)
    exact = [_same(name, a, o) for name, a, o in zip(OUTS, split, base)]
    if not all(exact):
        print(f"\nwg_split {dtype} {(b, t, h, hv)}: within one ulp, not equal: "
              f"{[n for n, e in zip(OUTS, exact) if not e]}")  # fmt: skip


def _split_route(monkeypatch, pairs):
    """FUSED (and FUSED_SLOTS) on, both rules forced, FUSED_GROUPSUM and FUSED_SLOTS_GROUPSUM
    as `pairs`; each fused launch run without and with `wg_split` (outputs NaN-poisoned,
    compared by `_same`); the op gets the key's outputs. Records (do's shape, tokens) a
    launch (`pairs`: every launch must carry `group_sum`)."""
    calls = []

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, out=None, **flags):
        assert flags.get("group_sum", False) == pairs
        states = None if "cu_seqlens" not in flags else flags["cu_seqlens"].shape[0] - 1
        heads = q.shape[2] if pairs else None
        got = {}
        for key in (False, True):
            buf = out if key and out is not None else None
            if buf is None:
                buf = fused_launch.empty_outputs(do, q.shape[-1], flags.get("tokens"), states,
                                                 heads)  # fmt: skip
            for x in buf:
                x.fill_(float("nan"))
            got[key] = fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v,
                                                  beta, dht, out=buf, wg_split=key,
                                                  **flags)  # fmt: skip
        for name, a, o in zip(OUTS, got[True], got[False]):
            _same(name, a, o)
        calls.append((tuple(do.shape), flags.get("tokens")))
        return got[True]

    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    monkeypatch.delenv(bwd.FUSED_SLOTS_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", pairs)
    monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", pairs)
    monkeypatch.setattr(bwd, "fused_fits", lambda *a: True)
    monkeypatch.setattr(bwd, "slots_fit", lambda *a: True)
    monkeypatch.setattr(bwd, "_fused_bwd", run)
    return calls


@pytest.fixture
def split(monkeypatch):
    """`_split_route` without the pair (FUSED_GROUPSUM off)."""
    return _split_route(monkeypatch, False)


@pytest.fixture
def split_pairs(monkeypatch):
    """`_split_route` with the pair (FUSED_GROUPSUM, FUSED_SLOTS_GROUPSUM on): the `wg_split,
    group_sum` keys against the `group_sum` keys."""
    return _split_route(monkeypatch, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm"), [(1, 1, 1, 2, False),
                                                           (2, 65, 2, 4, True),
                                                           (3, 1000, 1, 2, False),
                                                           (2, 64, 4, 4, False)])  # fmt: skip
def test_through_the_op(split, dtype, b, t, h, hv, l2norm):
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    inputs = (q, k, v, g, beta, do)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert split == [((b, t, hv, 128), None)], split
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [1000, 70]])
def test_varlen_slots(split, lens):
    """Unequal lengths: the slot layout's fused launch (`varlen, wg_split`), token rows."""
    inputs, h0, dht, cu = _varlen_problem(lens, seed=len(lens))
    got = _run(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    assert len(split) == 1 and split[0][1] is not None, split
    want = _reference(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


# ---- `wg_split, group_sum` (next/wgsplit-groupsum): dq's exchange in G2, dk's in G1


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("u_from_h", [True, False], ids=["u_from_h", "u_read"])
@pytest.mark.parametrize("with_dht", [True, False], ids=["dht", "no_dht"])
@pytest.mark.parametrize(("b", "t", "h"), [(1, 1, 1), (2, 63, 2), (1, 65, 1), (3, 1000, 2),
                                           (2, 130, 4)])  # fmt: skip
def test_pair_key_against_the_group_sum_key(dtype, u_from_h, with_dht, b, t, h):
    """`wg_split, group_sum` against `group_sum` alone (HV = 2 H, outputs NaN-poisoned: a row
    of dq / dk never received or never stored fails): every output bit for bit expected (the
    same fp32 own + peer sums, each accumulator's products in the same order), one ulp
    tolerated (printed)."""
    problem, tiles, states, _ = _route(b, t, h, 2 * h, dtype, seed=t + 7 * h)
    do = problem[5]
    u16, h16, _ = states[False]
    q, *rest = _fused_kernel_args(problem, tiles, h16)
    if not with_dht:
        rest[-1] = None
    u = None if u_from_h else u16[:, :t]
    scale = 128**-0.5
    base = _poisoned(do, u, q, rest, scale=scale, group_sum=True)
    split = _poisoned(do, u, q, rest, scale=scale, group_sum=True, wg_split=True)
    assert split[0].shape == (b, t, h, 128)
    exact = [_same(name, a, o) for name, a, o in zip(OUTS, split, base)]
    if not all(exact):
        print(f"\nwg_split, group_sum {dtype} {(b, t, h)}: within one ulp, not equal: "
              f"{[n for n, e in zip(OUTS, exact) if not e]}")  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "l2norm"), [(1, 1, 1, False), (2, 65, 2, True),
                                                     (3, 1000, 1, False)])  # fmt: skip
def test_pair_through_the_op(split_pairs, dtype, b, t, h, l2norm):
    """The op at HV = 2 H with FUSED_GROUPSUM on: its `group_sum` launch run both ways."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, 2 * h, dtype, seed=t + b, l2norm=l2norm)
    inputs = (q, k, v, g, beta, do)
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert split_pairs == [((b, t, 2 * h, 128), None)], split_pairs
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [1000, 70]])
def test_pair_varlen_slots(split_pairs, lens):
    """Unequal lengths, HV = 2 H, FUSED_SLOTS_GROUPSUM on: `varlen, group_sum, wg_split`
    against `varlen, group_sum` at the slots' token rows."""
    inputs, h0, dht, cu = _varlen_problem(lens, seed=len(lens) + 1)
    got = _run(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    assert len(split_pairs) == 1 and split_pairs[0][1] is not None, split_pairs
    want = _reference(inputs, h0=h0, dht=dht, l2norm=False, cu=cu)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r)


def test_pair_time():
    """4 x 8192 h16 hv32 bf16 (`u_from_h`, `group_sum`: the default route's key): the fused
    kernel without / with `wg_split`, printed; the key's outputs checked against the other's
    first."""
    problem, tiles, states, _ = _route(4, 8192, 16, 32, torch.bfloat16, seed=13)
    do = problem[5]
    q, *rest = _fused_kernel_args(problem, tiles, states[False][1])
    base = _poisoned(do, None, q, rest, group_sum=True)
    got = _poisoned(do, None, q, rest, group_sum=True, wg_split=True)
    for name, a, o in zip(OUTS, got, base):
        _same(name, a, o)
    ms = {key: median(time_ms(lambda key=key: fused_launch.gdn_bwd_fused(do, None, q, *rest,
                                                                          group_sum=True,
                                                                          wg_split=key),
                              reps=10))
          for key in (False, True)}  # fmt: skip
    print(f"\nGDN fused backward 4 x 8192 h16 hv32 bf16 (u_from_h, group_sum), wg_split off / "
          f"on: {ms[False]:.3f} / {ms[True]:.3f} ms ({ms[False] / ms[True]:.3f}x)")  # fmt: skip


def test_time():
    """4 x 8192 h16 hv32 bf16: the fused kernel without / with `wg_split` (`u_from_h`, no
    `group_sum`), printed; the key's outputs checked against the other's first."""
    problem, tiles, states, _ = _route(4, 8192, 16, 32, torch.bfloat16, seed=13)
    do = problem[5]
    q, *rest = _fused_kernel_args(problem, tiles, states[False][1])
    base = _poisoned(do, None, q, rest)
    for name, a, o in zip(OUTS, _poisoned(do, None, q, rest, wg_split=True), base):
        _same(name, a, o)
    ms = {key: median(time_ms(lambda key=key: fused_launch.gdn_bwd_fused(do, None, q, *rest,
                                                                          wg_split=key),
                              reps=10))
          for key in (False, True)}  # fmt: skip
    print(f"\nGDN fused backward 4 x 8192 h16 hv32 bf16 (u_from_h), wg_split off / on: "
          f"{ms[False]:.3f} / {ms[True]:.3f} ms ({ms[False] / ms[True]:.3f}x)")  # fmt: skip
