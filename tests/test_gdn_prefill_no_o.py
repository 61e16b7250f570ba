"""The t_pre form's `no_o` key (no o: no q boxes or q norms, no Q K^T or P, no O^T, U^T P^T or O
tiles) and the segmented path's pass B on it (`b_no_o`, the launcher's default: B's o is
overwritten by pass C) on the CPU, through the launcher and the replay: the key only where it is
defined, named only when on, its standard keys; a direct launch on it writes the final state bit
for bit the t_pre form's and not one element of o; the segmented path (B on the key) bit for bit
the segmented path with B forced to keep o (o and the final states), only pass B on the key, T
once; b_no_o forced where there is no such pass B raises; the bench's A/B `b_with_o`. The SASS in
tests/test_gdn_prefill_t_pre_compile.py; the GPU in tests/gpu/test_gdn_prefill_t_pre_gpu.py."""

from __future__ import annotations

import pytest
import torch
from test_gdn_prefill_t_pre import (  # noqa: F401  (the fixture; tests/ is on sys.path)
    _inputs,
    cpu_kernels,
)

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC, T_PRE_SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import params_for


def _chunked_keys(calls):
    return [p for name, p in calls if name == SPEC.name]


def test_key_only_where_defined():
    key = dict(params_for("bfloat16", t_pre=True, no_o=True))
    assert key["no_o"] and key["t_pre"]
    assert "no_o" not in dict(params_for("bfloat16", t_pre=True))  # the t_pre keys stay
    for bad in (dict(), dict(t_pre=True, state_lds=True)):
        with pytest.raises(ValueError, match="no_o"):
            params_for("bfloat16", no_o=True, **bad)
    # standard: pass B's every configuration (from c I: always an initial state); no candidate
    standard = [dict(p) for p in SPEC.standard_params()]
    t_pre = [p for p in standard if p.get("t_pre") and p["initial_state"] and "no_o" not in p]
    assert [p for p in standard if p.get("no_o")] == [p | {"no_o": True} for p in t_pre]
    assert len(t_pre) == 16
    assert not [p for p in SPEC.candidate_params() if dict(p).get("no_o")]


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "init", "v_split", "dtype"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, True, 1, torch.bfloat16),
        ([200, 7], 2, 2, True, False, 2, torch.float16),
    ],
)
def test_direct_writes_the_state_and_no_o(
    cpu_kernels, lens, h, hv, l2norm, init, v_split, dtype  # noqa: F811
):  # fmt: skip
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype=dtype, seed=21)
    start = state if init else None
    got = {}
    for no_o in (False, True):
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), hv, 128, 128), float("nan"))
        prefill_launch._direct(q, k, v, g, beta, start, cu, out, final, 128**-0.5, k_last=False,
                               l2norm=l2norm, v_split=v_split, t_pre=True, no_o=no_o)  # fmt: skip
        got[no_o] = (out, final)
    assert got[True][0].isnan().all() and not got[False][0].isnan().any()
    assert torch.equal(got[True][1], got[False][1])
    assert _chunked_keys(cpu_kernels)[-1]["no_o"] and "no_o" not in _chunked_keys(cpu_kernels)[0]


@pytest.mark.parametrize(("lens", "parts", "l2norm"), [([900], 4, False), ([700, 3, 420], 3, True)])
def test_segments_with_b_no_o_are_the_segments(cpu_kernels, lens, parts, l2norm):  # noqa: F811
    """Pass B's o is pass C's to overwrite: with B on the key (the launcher's own choice), o
    and the final states bit for bit the segmented t_pre path's with B forced to keep o; A and
    C keep o, T is made once."""
    q, k, v, g, beta, state, cu = _inputs(lens, 2, 2, seed=22)
    got = {}
    for b_no_o in (False, None):
        calls = len(cpu_kernels)
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), 2, 128, 128), float("nan"))
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, 128**-0.5,
                                   k_last=False, l2norm=l2norm, segments=parts, t_pre=True,
                                   b_no_o=b_no_o)  # fmt: skip
        got[b_no_o] = (out, final)
        new = cpu_kernels[calls:]
        assert [name for name, _ in new].count(T_PRE_SPEC.name) == 1
        on = b_no_o is None
        assert [p.get("no_o", False) for p in _chunked_keys(new)] == [False, on, False]
    assert not got[None][0].isnan().any()
    assert torch.equal(got[None][0], got[False][0]) and torch.equal(got[None][1], got[False][1])


@pytest.mark.parametrize(
    ("lens", "segments", "t_pre", "state_lds"),
    [
        ([500], 4, False, False),  # the standard form
        ([500], 1, True, False),  # a direct launch: no pass B
        ([500], 2, True, False),  # N P = 2: passes A and C only
        ([500], 4, True, True),  # state_lds has no O warp
    ],
)
def test_b_no_o_forced_only_on_a_pass_b(cpu_kernels, lens, segments, t_pre, state_lds):  # noqa: F811
    """b_no_o=True where no pass B runs in the t_pre form raises before any launch (it was
    ignored on direct launches); the launcher's own choice there keeps o."""
    q, k, v, g, beta, state, cu = _inputs(lens, 1, 2, seed=23)
    final = torch.empty(len(lens), 2, 128, 128)
    calls = len(cpu_kernels)
    kw = dict(k_last=False, l2norm=False, segments=segments, t_pre=t_pre, state_lds=state_lds)
    with pytest.raises(ValueError, match="b_no_o"):
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, torch.empty_like(v), final,
                                   128**-0.5, b_no_o=True, **kw)  # fmt: skip
    assert len(cpu_kernels) == calls
    prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, torch.empty_like(v), final,
                               128**-0.5, **kw)  # fmt: skip
    assert not [p for p in _chunked_keys(cpu_kernels[calls:]) if p.get("no_o")]


def test_bench_variants_where_segments_run():
    """`b_with_o` (pass B with o) where the launcher segments (t_pre), `segments_<P>_b_with_o`
    beside the `segments_<P>` variant (the single hv32 cases the launcher leaves direct)."""
    from forgekernel.bench.suites import gdn_prefill

    found = {c.name: sorted(v for v in gdn_prefill.variants(c) if "with_o" in v)
             for c in gdn_prefill.BENCH_CASES}  # fmt: skip
    found = {name: v for name, v in found.items() if v}
    assert found == {
        "1x131072-h16-hv16": ["b_with_o"],
        "1x16384-h16-hv32": ["segments_5_b_with_o"],
        "1x65536-h16-hv32": ["segments_5_b_with_o"],
        "1x16384-h16-hv32-nostate": ["segments_5_b_with_o"],
    }
