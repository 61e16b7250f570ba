"""The t_pre form's `state_order` key (the two state warpgroups' WGMMA batches in turns,
state_wg.py `_take_turn` / `_pass_turn`) on the CPU, through the launcher and the replay: the key
only where it is defined (unsplit t_pre with its O warp), the launcher's default
(`launch.STATE_ORDER`, off) and its switch, the forced path bit for bit the standard path's
(the same products on the same operands: only their issue order moves) and the fp64
recurrence's to the op's tolerances, segments included. The turn protocol itself is replayed in
tests/test_gdn_prefill_rings.py; the SASS in tests/test_gdn_prefill_t_pre_compile.py."""

from __future__ import annotations

import pytest
import torch
from test_gdn_prefill_t_pre import (  # noqa: F401  (the fixture; tests/ is on sys.path)
    STATE_TOL,
    _close,
    _inputs,
    cpu_kernels,
)

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC, T_PRE_SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import params_for
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

SWITCH = prefill_launch.STATE_ORDER_SWITCH


def _run(inputs, *, init=True, k_last=False, l2norm=False, v_split=1, segments=1, **kw):
    q, k, v, g, beta, state, cu = inputs
    n, hv = cu.shape[0] - 1, v.shape[1]
    start = None
    if init:
        start = state.transpose(-1, -2).contiguous() if k_last else state
    out = torch.full_like(v, float("nan"))
    final = torch.full((n, hv, 128, 128), float("nan"))
    prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, 128**-0.5,
                               k_last=k_last, l2norm=l2norm, v_split=v_split, segments=segments,
                               **kw)  # fmt: skip
    return out, (final.transpose(-1, -2) if k_last else final)


def _chunked_keys(calls):
    return [p for name, p in calls if name == SPEC.name]


def test_key_only_where_defined():
    key = dict(params_for("bfloat16", t_pre=True, state_order=True))
    assert key["state_order"] and key["t_pre"] and key["v_split"] == 1
    assert "state_order" not in dict(params_for("bfloat16", t_pre=True))  # standard keys stay
    for bad in (dict(t_pre=False), dict(t_pre=True, v_split=2),
                dict(t_pre=True, state_lds=True)):  # fmt: skip
        with pytest.raises(ValueError, match="state_order"):
            params_for("bfloat16", state_order=True, **bad)


def test_default_off_and_its_switch(monkeypatch):
    assert prefill_launch.STATE_ORDER is False
    monkeypatch.delenv(SWITCH, raising=False)
    assert not prefill_launch.state_order_for(1, True, False)
    monkeypatch.setenv(SWITCH, "1")
    assert prefill_launch.state_order_for(1, True, False)
    assert not prefill_launch.state_order_for(2, True, False)  # one state warpgroup
    assert not prefill_launch.state_order_for(1, False, False)  # the standard form
    assert not prefill_launch.state_order_for(1, True, True)  # state_lds
    monkeypatch.setenv(SWITCH, "yes")
    with pytest.raises(ValueError, match=SWITCH):
        prefill_launch.state_order_for(1, True, False)


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "init", "k_last", "dtype"),
    [
        ([1, 63, 0, 64, 65, 130, 200], 2, 4, False, True, False, torch.bfloat16),
        ([200], 4, 8, True, True, True, torch.bfloat16),
        ([3, 129, 7], 1, 2, True, False, False, torch.float16),
        ([0, 0], 1, 2, False, True, False, torch.bfloat16),  # no chunk at all: no turn taken
    ],
)
def test_forced_is_the_standard_bit_for_bit(
    cpu_kernels, lens, h, hv, l2norm, init, k_last, dtype  # noqa: F811
):  # fmt: skip
    inputs = _inputs(lens, h, hv, seed=len(lens), dtype=dtype, scale_k=16.0 if l2norm else 1.0)
    kw = dict(init=init, k_last=k_last, l2norm=l2norm)
    o_std, s_std = _run(inputs, **kw)
    o_t, s_t = _run(inputs, t_pre=True, state_order=True, **kw)
    assert torch.equal(o_t, o_std) and torch.equal(s_t, s_std)
    if sum(lens):
        assert _chunked_keys(cpu_kernels)[-1]["state_order"]
        q, k, v, g, beta, state, cu = inputs
        want_o, want_s = gated_delta_rule_recurrent(
            q[None], k[None], v[None], g[None], beta[None], initial_state=state if init else None,
            output_final_state=True, cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
        )  # fmt: skip
        _close(o_t, want_o[0], 2e-2)
        _close(s_t, want_s, STATE_TOL[dtype])


def test_switch_reaches_unsplit_t_pre_launches_only(cpu_kernels, monkeypatch):  # noqa: F811
    """With the switch on, the t_pre launches take the key where unsplit (the split one keeps
    t_pre's lockstep key), the standard launches never; forced False wins over the switch (the
    bench's `t_pre` beside `t_pre_state_order`)."""
    monkeypatch.setenv(SWITCH, "1")
    inputs = _inputs([70, 130], 2, 4, seed=2)
    o_std, _ = _run(inputs, t_pre=False)  # the standard form, forced (HV > H: t_pre by default)
    for split, want in ((1, True), (2, False)):
        o_t, _ = _run(inputs, t_pre=True, v_split=split)
        assert torch.equal(o_t, o_std)
        assert _chunked_keys(cpu_kernels)[-1].get("state_order", False) is want
    _run(inputs, t_pre=True, state_order=False)
    assert "state_order" not in _chunked_keys(cpu_kernels)[-1]
    assert "state_order" not in _chunked_keys(cpu_kernels)[0]  # the standard launch


def test_through_segments(cpu_kernels, monkeypatch):  # noqa: F811
    """Segments (three passes, unsplit on a device of 1 SM; T once): every pass on the key,
    the standard segmented path's result bit for bit. (Forced on a split pass, params_for
    refuses: the key needs two state warpgroups.)"""
    monkeypatch.setattr(prefill_launch, "_sms", lambda device: 1)
    inputs = _inputs([300, 1, 333], 2, 4, seed=7)
    o_std, s_std = _run(inputs, segments=4)
    calls = len(cpu_kernels)
    o_t, s_t = _run(inputs, segments=4, t_pre=True, state_order=True)
    assert torch.equal(o_t, o_std) and torch.equal(s_t, s_std)
    new = cpu_kernels[calls:]
    assert [name for name, _ in new].count(T_PRE_SPEC.name) == 1
    assert [p["state_order"] for p in _chunked_keys(new)] == [True] * 3
