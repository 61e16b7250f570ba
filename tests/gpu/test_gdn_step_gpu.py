"""The gated delta rule step on the GPU against the fp64 reference (issue 20; its public op
and suite come once this passes): GDN and KDA decays, both state layouts, l2norm, a state
pool or none, MTP with intermediate states, fp16 and bf16, the flashinfer-bench batch sizes;
k-last states run the row-streaming kernel (T = 1..4 baked in), k-first and k-last states whose
heads are not compact the staged kernel."""

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
        # the suite's MTP shapes (every warp stages a token / warps past T stage copies)
        (64, 4, 16, 32, False, True, True, True),
        (9, 2, 16, 32, False, True, False, False),
        (6, 4, 2, 8, True, True, True, True),
        # the row-streaming kernel: large decode batches without a pool, every T, KDA, a group
        # of 3 value heads per q / k head
        (130, 1, 16, 32, False, True, True, False),
        (257, 1, 4, 8, False, True, False, False),
        (33, 2, 4, 8, False, True, True, True),
        (5, 3, 4, 8, True, True, True, False),
        (4, 1, 3, 9, True, True, False, True),
        (2, 4, 3, 9, False, True, True, False),
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


@pytest.mark.parametrize("b", [1, 64])
def test_flashinfer_decode_and_mtp_forms(b):
    from forgekernel.reference.gdn_flashinfer import gdn_decode, gdn_mtp

    gen = torch.Generator(device="cuda").manual_seed(2)
    dev, bf = "cuda", torch.bfloat16

    def rnd(*shape, dtype=torch.float32, scale=1.0):
        return (torch.randn(*shape, device=dev, generator=gen) * scale).to(dtype)

    for t in (1, 2, 3, 4):
        q, k = rnd(b, t, 4, 128, dtype=bf), rnd(b, t, 4, 128, dtype=bf)
        v, a, bb = rnd(b, t, 8, 128, dtype=bf), rnd(b, t, 8, dtype=bf), rnd(b, t, 8, dtype=bf)
        a_log, dt_bias = rnd(8, scale=0.5), rnd(8, scale=0.5)
        state = rnd(b + 2, 8, 128, 128, scale=0.1)
        if t == 1:
            out, new = op.gdn_decode_flashinfer(q, k, v, state[:b], a_log, a, dt_bias, bb)
            want, want_new = gdn_decode(q, k, v, state[:b], a_log, a, dt_bias, bb, None)
        else:
            rows = torch.randperm(b + 2, device=dev, generator=gen)[:b].to(torch.int32)
            inter, want_inter = torch.zeros(b + 2, t, 8, 128, 128, device=dev), None
            want_inter = inter.clone()
            want, want_new = gdn_mtp(q, k, v, state.clone(), rows, a_log, a, dt_bias, bb, None,
                                     want_inter, disable_state_update=False)  # fmt: skip
            out, new = op.gdn_mtp_flashinfer(q, k, v, state, rows, a_log, a, dt_bias, bb, None,
                                             inter, disable_state_update=False)  # fmt: skip
            tol = 1e-5 * float(want_inter.abs().max()) + 1e-6
            assert float((inter - want_inter).abs().max()) <= tol
        torch.cuda.synchronize()
        assert float((out.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
        assert float((new - want_new).abs().max()) <= 1e-5 * float(want_new.abs().max()) + 1e-6


@pytest.mark.parametrize("t", [1, 3])
def test_k_last_state_with_spread_rows_runs_the_staged_kernel(t):
    """A k-last state whose rows are not adjacent (a view into a wider buffer) is updated in
    place by the staged kernel."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    dev, bf = "cuda", torch.bfloat16
    b, h, hv = 6, 2, 4
    q = torch.randn(b, t, h, 128, device=dev, dtype=bf, generator=gen)
    k = torch.randn(b, t, h, 128, device=dev, dtype=bf, generator=gen)
    v = torch.randn(b, t, hv, 128, device=dev, dtype=bf, generator=gen)
    g = -torch.rand(b, t, hv, device=dev, generator=gen) * 0.5
    beta = torch.rand(b, t, hv, device=dev, generator=gen)
    wide = torch.randn(b, hv, 128, 256, device=dev, generator=gen) * 0.1
    state = wide[..., 64:192]
    want_state = state.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=True, k_last=True)
    got = op.gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=True, k_last=True)
    torch.cuda.synchronize()
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    assert float((state - want_state).abs().max()) <= 1e-5 * float(want_state.abs().max()) + 1e-6
