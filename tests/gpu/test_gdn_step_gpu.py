"""The gated delta rule step on the GPU against the fp64 reference (issue 20; its public op
and suite come once this passes): GDN and KDA decays, both state layouts, l2norm, a state
pool, MTP with intermediate states, fp16 and bf16, the flashinfer-bench batch sizes."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.reference.delta_rule import gated_delta_rule_step as step_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.gated_delta_rule")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "per_channel", "k_last", "l2norm", "pool"),
    [
        (1, 1, 4, 8, False, True, True, False),
        (64, 1, 4, 8, False, True, True, True),
        (7, 4, 2, 4, False, True, False, True),
        (5, 2, 16, 32, True, False, True, False),
        (3, 3, 4, 4, True, True, False, True),
    ],
)
def test_step_matches_the_reference(dtype, b, t, h, hv, per_channel, k_last, l2norm, pool):
    gen = torch.Generator(device="cuda").manual_seed(0)
    dev = "cuda"
    q = torch.randn(b, t, h, 128, device=dev, dtype=dtype, generator=gen)
    k = torch.randn(b, t, h, 128, device=dev, dtype=dtype, generator=gen)
    v = torch.randn(b, t, hv, 128, device=dev, dtype=dtype, generator=gen)
    g = -torch.rand(*((b, t, hv, 128) if per_channel else (b, t, hv)), device=dev,
                    generator=gen) * 0.5  # fmt: skip
    beta = torch.rand(b, t, hv, device=dev, generator=gen)
    n = b + 3 if pool else b
    state = torch.randn(n, hv, 128, 128, device=dev, generator=gen) * 0.1
    rows = torch.randperm(n, device=dev, generator=gen)[:b].to(torch.int32) if pool else None
    inter = torch.zeros(n, t, hv, 128, 128, device=dev) if pool else None
    want_state, want_inter = state.clone(), None if inter is None else inter.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=l2norm, state_indices=rows,
                    k_last=k_last, intermediate_states=want_inter)  # fmt: skip
    got = op.gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=l2norm,
                                   state_indices=rows, k_last=k_last,
                                   intermediate_states=inter)  # fmt: skip
    torch.cuda.synchronize()
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    tol = 1e-5 * float(want_state.abs().max()) + 1e-6  # fp32 state against fp64
    assert float((state - want_state).abs().max()) <= tol
    if inter is not None:
        assert float((inter - want_inter).abs().max()) <= tol
