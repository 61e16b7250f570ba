"""The fused KDA kernel's data flow (reference/kda_fused.py: the parity-split aux of a 2-CTA
cluster, rings A / B, the value halves, the segment scan on the augmented state [S | I])
against the fp64 token recurrence; and the rings refusing a stage rewritten before release."""

from __future__ import annotations

import pytest
import torch

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
from forgekernel.reference.kda_fused import _Ring, kimi_delta_attention_fused

FP64_TOL = 1e-10
BF16_TOL = 2e-2  # as tests/test_kda_chunked_model.py: a few bf16 roundings of max |o|


def make_inputs(b, t, h, hv, d, seed, decay=(-1.0, 0.0), n=None):
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q, k = rand(b, t, h, d), torch.nn.functional.normalize(rand(b, t, h, d), dim=-1)
    lo, hi = decay
    g = lo + (hi - lo) * torch.rand(b, t, hv, d, generator=gen, dtype=torch.float64)
    beta = torch.sigmoid(rand(b, t, hv))
    state = 0.5 * rand(b if n is None else n, hv, d, d)
    return q, k, rand(b, t, hv, d), g, beta, state


def rel_err(got, want) -> float:
    assert torch.isfinite(got).all()
    return ((got - want).abs().max() / want.abs().max()).item()


def both(q, k, v, g, beta, state, cu=None, **kw):
    args = dict(initial_state=state, output_final_state=True, cu_seqlens=cu)
    want = kimi_delta_attention_recurrent(q, k, v, g, beta, **args)
    got = kimi_delta_attention_fused(q, k, v, g, beta, **args, **kw)
    return got, want


@pytest.mark.parametrize("t", [1, 7, 64, 65, 200])
@pytest.mark.parametrize("segments", [1, 3])
def test_fused_flow_matches_recurrence(t, segments):
    q, k, v, g, beta, state = make_inputs(2, t, 2, 4, 32, seed=t, decay=(-5.0, -0.05))
    (o, s), (o_ref, s_ref) = both(q, k, v, g, beta, state, segments=segments)
    assert rel_err(o, o_ref) < FP64_TOL
    assert rel_err(s, s_ref) < FP64_TOL


def test_segment_scan_long_varlen():
    """Several chunks a segment, a sequence shorter than one segment, one of two chunks; mild
    decays, so that a segment's transition A_s carries its initial state (~40 % over 6 chunks:
    a wrong composition fails by far)."""
    q, k, v, g, beta, state = make_inputs(1, 1000, 1, 2, 32, seed=5, decay=(-0.01, 0.0), n=3)
    cu = torch.tensor([0, 700, 760, 1000])
    (o, s), (o_ref, s_ref) = both(q, k, v, g, beta, state, cu, segments=4, chunk_size=32)
    assert rel_err(o, o_ref) < FP64_TOL
    assert rel_err(s, s_ref) < FP64_TOL


@pytest.mark.parametrize("decay", [(-5.0, -4.0), (-0.05, 0.0)])
def test_bf16_operands_stay_within_rounding(decay):
    """E on the B fragments (Kr, E and their product each rounded) keeps rows8's error class:
    o within 5.3e-3 of max |o| at g in [-0.05, 0] (kda_chunked's roundings 3.6e-3), 4.4e-3 at
    [-5, -4] (the same: the off-diagonal blocks vanish there)."""
    q, k, v, g, beta, state = make_inputs(1, 300, 2, 2, 64, seed=11, decay=decay)
    (o, s), (o_ref, s_ref) = both(q, k, v, g, beta, state, operand_dtype=torch.bfloat16)
    assert rel_err(o, o_ref) < BF16_TOL
    assert rel_err(s, s_ref) < BF16_TOL


def test_ring_refuses_a_stage_still_held():
    ring = _Ring("B", stages=2, ctas=2)
    ring.write(0, 0, {})
    ring.read(0, 0)
    ring.release(0, 0)
    with pytest.raises(RuntimeError, match="before CTAs \\[1\\] released"):
        ring.write(0, 2, {})
    with pytest.raises(RuntimeError, match="waits for chunk 1"):
        ring.read(1, 1)
