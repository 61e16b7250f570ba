"""The standard form's `o_warp` key (the t_pre form's state chain on the standard form: V^T by
transposed ldmatrix, O handed to warpgroup 0's O warp for a TMA store; T still formed by the
aux) on the CPU, through the launcher and the replay: the key only where it is defined (the
standard form; the t_pre form has the O warp already), named only when on, its shared memory
inside the budget, standard keys in every configuration of the standard form; the launcher's
standard form takes it unless forced off, forcing it with the t_pre form raises; the path bit
for bit the standard path's without it (the same products on the same 16-bit operands: only
how V^T is loaded and how O reaches global memory move) and the fp64 recurrence's to the op's
tolerances, segments included, and the bench's A/B `no_o_warp` on its two cases. The SASS in
tests/test_gdn_prefill_t_pre_compile.py; the GPU in tests/gpu/test_gdn_prefill_t_pre_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_gdn_prefill_t_pre import (  # noqa: F401  (the fixture; tests/ is on sys.path)
    STATE_TOL,
    _close,
    _inputs,
    cpu_kernels,
)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC, config
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import params_for
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent


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


def test_key_only_where_defined():
    key = dict(params_for("bfloat16", o_warp=True))
    assert key["o_warp"] and "t_pre" not in key
    assert "o_warp" not in dict(params_for("bfloat16"))  # the standard keys stay
    assert "o_warp" not in dict(params_for("bfloat16", t_pre=True))
    with pytest.raises(ValueError, match="o_warp"):
        params_for("bfloat16", t_pre=True, o_warp=True)
    for forced in (True, False):  # through the launcher: forced only with the standard form
        with pytest.raises(ValueError, match="o_warp"):
            _run(_inputs([70], 1, 2), t_pre=True, o_warp=forced)


@pytest.mark.parametrize("v_split", config.V_SPLITS)
def test_shared_memory_budget(v_split):
    """The O ring's barriers on top of the standard form's storage still fit one CTA an SM."""
    standard = config.smem_bytes(v_split=v_split)
    with_o = config.smem_bytes(v_split=v_split, o_warp=True)
    assert with_o == standard + config.o_ring_barriers(config.state_wgs(128, v_split)) * 8
    assert with_o <= SMEM_CAPACITY


def test_standard_keys_in_every_configuration():
    """`forgekernel build` builds the key wherever the standard form is (every dtype, state
    layout, l2norm, initial state and V split: the launcher's route and the bench's forced
    `standard`), beside the standard keys without it (the A/B `no_o_warp`); no candidate."""
    standard = [dict(p) for p in SPEC.standard_params()]
    plain = [p for p in standard if "t_pre" not in p and "o_warp" not in p]
    ours = [p for p in standard if p.get("o_warp")]
    assert len(plain) == 32 and ours == [p | {"o_warp": True} for p in plain]
    assert not [p for p in SPEC.candidate_params() if dict(p).get("o_warp")]


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "init", "k_last", "dtype", "v_split"),
    [
        ([1, 63, 0, 64, 65, 130, 200], 2, 2, False, True, False, torch.bfloat16, 1),  # HV = H
        ([200], 4, 8, True, True, True, torch.bfloat16, 1),
        ([3, 129, 7], 1, 2, True, False, False, torch.float16, 2),
        ([0, 0], 1, 1, False, True, False, torch.bfloat16, 1),  # no token: no launch
    ],
)
def test_forced_is_the_standard_bit_for_bit(
    cpu_kernels, lens, h, hv, l2norm, init, k_last, dtype, v_split  # noqa: F811
):  # fmt: skip
    inputs = _inputs(lens, h, hv, seed=len(lens), dtype=dtype, scale_k=16.0 if l2norm else 1.0)
    kw = dict(init=init, k_last=k_last, l2norm=l2norm, v_split=v_split, t_pre=False)
    o_std, s_std = _run(inputs, o_warp=False, **kw)
    o_ow, s_ow = _run(inputs, **kw)  # the launcher's standard form
    assert torch.equal(o_ow, o_std) and torch.equal(s_ow, s_std)
    if sum(lens) == 0:  # no launch
        return
    keys = [p for name, p in cpu_kernels if name == SPEC.name]
    assert "o_warp" not in keys[0] and keys[1]["o_warp"] and "t_pre" not in keys[1]
    q, k, v, g, beta, state, cu = inputs
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state if init else None,
        output_final_state=True, cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
    )  # fmt: skip
    _close(o_ow, want_o[0], 2e-2)
    _close(s_ow, want_s, STATE_TOL[dtype])


def test_route_takes_the_key(cpu_kernels):  # noqa: F811
    """The op's own route at HV = H unsplit (`launch.t_pre_for`: the standard form) asks for
    the o_warp key; the t_pre route names none."""
    for hv, t_pre in ((2, False), (4, True)):
        calls = len(cpu_kernels)
        _run(_inputs([130, 7] * 20, 2, hv, seed=4), v_split=None, segments=None)
        keys = [p for name, p in cpu_kernels[calls:] if name == SPEC.name]
        assert len(keys) == 1 and keys[0]["v_split"] == 1
        assert keys[0].get("t_pre", False) is t_pre and keys[0].get("o_warp", False) is not t_pre


def test_segments_carry_the_key(cpu_kernels):  # noqa: F811
    """The segmented path's passes (forced standard) take the key, bit for bit the same."""
    inputs = _inputs([700, 190], 2, 2, seed=3)
    o_std, s_std = _run(inputs, segments=3, t_pre=False, o_warp=False)
    calls = len(cpu_kernels)
    o_ow, s_ow = _run(inputs, segments=3, t_pre=False)
    passes = [p for name, p in cpu_kernels[calls:] if name == SPEC.name]
    assert len(passes) == 3 and all(p["o_warp"] for p in passes)
    assert torch.equal(o_ow, o_std) and torch.equal(s_ow, s_std)


def test_bench_variant_on_its_cases():
    from forgekernel.bench.suites import gdn_prefill

    by_name = {c.name: c for c in gdn_prefill.BENCH_CASES}
    assert set(gdn_prefill.STANDARD_CHAIN_AB) <= set(by_name)
    for case in gdn_prefill.BENCH_CASES:
        has = "no_o_warp" in gdn_prefill.variants(case)
        assert has == (case.name in gdn_prefill.STANDARD_CHAIN_AB), case.name
