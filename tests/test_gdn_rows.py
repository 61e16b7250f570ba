"""The row-streaming gated delta rule step (gdn_decode/sm90/step_rows.py) replayed lane by lane
on the CPU (the kernel itself runs on the GPU: tests/gpu/test_gdn_step_gpu.py; its compiled
structure: tests/test_gdn_compile.py): every warp holds 8 rows of a head's (V, K) state, lane l
entries 4l .. 4l + 3 of each; raw q / k with the norms and the scale applied to the sums; the
reduce-scatter across the warp that leaves row j's sums on lanes 4j .. 4j + 3; one token's
scalars per lane (v, decay, beta, the gating computed there) shuffled to the others; the update
with the gathered u. Checked against the fp64 reference through the real op and launcher: T = 1
to 4, per head and per key channel decays, l2norm, a pool or none, intermediate states,
FlashInfer-Bench's gating; and the launcher's choice of kernel and compile key."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.kernels.linear_attention.gdn_decode.sm90 import launch as gdn_launch
from forgekernel.kernels.linear_attention.gdn_decode.sm90.config import L2NORM_EPS, ROWS_PER_WARP
from forgekernel.reference.delta_rule import gated_delta_rule_step as step_ref

op = importlib.import_module("forgekernel.ops.gated_delta_rule")
LANES = torch.arange(32)
ENTRIES = 4  # K entries per lane and row


def reduce_scatter(x: torch.Tensor) -> torch.Tensor:
    """step_rows.py `_row_sums`'s reduction: x (..., 32 lanes, R rows) per-lane partial sums
    -> (..., 32): lane l holds the warp's total of row l // (32 / R)."""
    n, level = x.shape[-1], 0
    while n > 1:
        offset, half = 16 >> level, n // 2
        upper = ((LANES & offset) != 0)[:, None]
        lo, hi = x[..., :half], x[..., half:n]
        send = torch.where(upper, lo, hi)
        keep = torch.where(upper, hi, lo)
        x = keep + send[..., LANES ^ offset, :]
        n, level = half, level + 1
    x = x[..., 0]
    for lvl in range(level, 5):  # the lanes that share a row
        x = x + x[..., LANES ^ (16 >> lvl)]
    return x


def _gates(a, b, a_log, dt_bias):
    """step_rows.py `_gates`: softplus linear past 20, sigmoid as a reciprocal."""
    x = a + dt_bias
    soft = torch.where(x > 20.0, x, torch.log1p(torch.exp(x)))
    return -torch.exp(a_log) * soft, 1.0 / (1.0 + torch.exp(-b))


def rows_kernel(params: dict):
    """The row-streaming kernel's algorithm in fp32, lane by lane (warps of all heads and
    sequences at once: tensors (B, HV, W, 32 lanes, ...), W = V / 8 warps per head)."""
    tokens, rpw = params["tokens"], params.get("rows_per_warp", ROWS_PER_WARP)
    rl = 32 // rpw  # lanes per row after the reduction
    per_channel, l2norm = params["per_channel"], params["l2norm"]

    def fn(q, k, v, g, beta, state, rows, out, inter, a_log, dt_bias, scale):
        bsz, t_in, h, kd = q.shape
        hv, vd = v.shape[2], v.shape[3]
        assert t_in == tokens and kd == 32 * ENTRIES
        group, w = hv // h, vd // rpw
        idx = torch.arange(bsz) if rows is None else rows.long()
        # s[b, hv, w, lane, i, j] = state[row_b, hv, w rpw + j, 4 lane + i]
        s = state[idx].view(bsz, hv, w, rpw, 32, ENTRIES).permute(0, 1, 2, 4, 5, 3).clone()
        mine = torch.arange(w)[:, None] * rpw + LANES // rl  # (W, 32): the row of lane l
        own = (LANES % rl).clamp(max=tokens - 1)  # the token whose scalars lane l loads
        heads = torch.arange(hv) // group

        def lane_rows(x):  # (B, HV, K) -> (B, HV, 1, 32, 4)
            return x.float().reshape(bsz, hv, 1, 32, ENTRIES)

        v_own = v[:, own[None, :].expand(w, 32), :, mine].float()  # (W, 32, B, HV)
        v_own = v_own.permute(2, 3, 0, 1)  # (B, HV, W, 32)
        g_own = g[:, own].float() if not per_channel else torch.zeros(bsz, 32, hv)
        beta_own = beta[:, own].float()  # (B, 32, HV)
        decay_own = g_own.exp()
        if params.get("gating"):
            g_own, beta_own = _gates(g_own, beta_own, a_log, dt_bias)
            decay_own = g_own.exp()
        decay_own, beta_own = decay_own.transpose(1, 2), beta_own.transpose(1, 2)  # (B, HV, 32)
        for t in range(tokens):
            qx, kx = lane_rows(q[:, t, heads]), lane_rows(k[:, t, heads])
            kq = (qx * kx).sum((-1, -2), keepdim=True)[..., 0]  # (B, HV, 1, 1)
            q_factor = torch.full_like(kq, scale)
            k_factor = torch.ones_like(kq)
            if l2norm:
                q_factor = scale * torch.rsqrt((qx * qx).sum((-1, -2))[..., None] + L2NORM_EPS)
                k_factor = torch.rsqrt((kx * kx).sum((-1, -2))[..., None] + L2NORM_EPS)
            kq = kq * q_factor * k_factor
            v_mine = v_own[..., (LANES // rl) * rl + t]
            beta_t = beta_own[..., t][..., None, None]
            if per_channel:
                d = lane_rows(g[:, t].exp())  # (B, HV, 1, 32, 4)
                kd_, qd_ = d * kx, d * qx
                k_factor_d, q_factor_d = k_factor, q_factor
            else:
                d = decay_own[..., t][..., None, None]  # (B, HV, 1, 1)
                kd_, qd_ = kx, qx
                k_factor_d, q_factor_d = k_factor * d, q_factor * d
            p = reduce_scatter((s * kd_[..., None]).sum(-2))  # (B, HV, W, 32)
            r = reduce_scatter((s * qd_[..., None]).sum(-2))
            u = beta_t * (v_mine - p * k_factor_d)
            o = r * q_factor_d + kq * u
            heads_o = o[..., ::rl]  # lanes 0, rl, 2 rl, ...: rows 0 .. rpw - 1 of each warp
            out[:, t] = heads_o.reshape(bsz, hv, vd).to(out.dtype)
            wj = (u * k_factor)[..., ::rl]  # (B, HV, W, rpw): the gathered u / |k|
            dd = d[..., None] if per_channel else d[..., None, None]
            s = s * dd + kx[..., None] * wj[..., None, None, :]
            if inter is not None:
                inter[idx, t] = s.permute(0, 1, 2, 5, 3, 4).reshape(bsz, hv, vd, kd)
        if params.get("update_state", True):
            state[idx] = s.permute(0, 1, 2, 5, 3, 4).reshape(bsz, hv, vd, kd)

    return fn


@pytest.fixture
def routed(monkeypatch):
    """The launcher's compile keys, each run by the CPU replay of its kernel."""
    from test_gdn_step import _kernel

    keys = []

    def get_kernel(spec, params):
        keys.append(dict(params))
        return _kernel(dict(params))

    monkeypatch.setattr(gdn_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    return keys


@pytest.mark.parametrize("rpw", [2, 4, 8, 16])
def test_reduce_scatter_leaves_each_row_on_its_lanes(rpw):
    x = torch.randn(3, 32, rpw, dtype=torch.float64)
    want = x.sum(-2)[:, LANES // (32 // rpw)]
    assert torch.allclose(reduce_scatter(x), want)


def _inputs(b, t, h, hv, per_channel, n, seed):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, 128, generator=gen).to(torch.bfloat16)
    k = torch.randn(b, t, h, 128, generator=gen).to(torch.bfloat16)
    v = torch.randn(b, t, hv, 128, generator=gen).to(torch.bfloat16)
    g = -torch.rand(*((b, t, hv, 128) if per_channel else (b, t, hv)), generator=gen) * 0.5
    beta = torch.rand(b, t, hv, generator=gen)
    state = torch.randn(n, hv, 128, 128, generator=gen) * 0.1
    return q, k, v, g, beta, state


@pytest.mark.parametrize("t", [1, 2, 3, 4])
@pytest.mark.parametrize(
    ("per_channel", "l2norm", "pool", "inter"),
    [(False, True, False, False), (False, False, True, True), (True, True, True, False),
     (True, False, False, True)],
)  # fmt: skip
def test_rows_kernel_matches_the_reference(routed, t, per_channel, l2norm, pool, inter):
    b, h, hv = 3, 2, 6
    n = b + 2 if pool else b
    q, k, v, g, beta, state = _inputs(b, t, h, hv, per_channel, n, seed=t)
    rows = torch.tensor([4, 0, 2], dtype=torch.int32) if pool else None
    states = torch.zeros(n, t, hv, 128, 128) if inter else None
    want_state, want_states = state.clone(), None if states is None else states.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=l2norm, state_indices=rows,
                    k_last=True, intermediate_states=want_states)  # fmt: skip
    got = op.gated_delta_rule_step(q, k, v, g, beta, state, use_qk_l2norm=l2norm,
                                   state_indices=rows, k_last=True,
                                   intermediate_states=states)  # fmt: skip
    assert routed[-1]["tokens"] == t and routed[-1].get("pool", True) == pool
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    tol = 1e-5 * float(want_state.abs().max()) + 1e-6  # fp32 state against fp64
    assert float((state - want_state).abs().max()) <= tol
    if inter:
        assert float((states - want_states).abs().max()) <= tol


@pytest.mark.parametrize("t", [1, 3])
@pytest.mark.parametrize("update", [True, False])
def test_rows_kernel_gating_matches_the_reference(routed, t, update):
    from forgekernel.reference.gdn_flashinfer import flashinfer_gating

    gen = torch.Generator().manual_seed(7)
    b, pool = 4, 6
    q, k, v, _, _, state = _inputs(b, t, 4, 8, False, pool, seed=11)
    a = (torch.randn(b, t, 8, generator=gen) * 3).to(torch.bfloat16)  # softplus both sides of 20
    a[0, 0, :2] = 25.0
    bb = torch.randn(b, t, 8, generator=gen).to(torch.bfloat16)
    a_log, dt_bias = torch.randn(8, generator=gen) * 0.5, torch.randn(8, generator=gen) * 0.5
    rows = torch.tensor([5, 1, 3, 0], dtype=torch.int32)
    states = torch.zeros(pool, t, 8, 128, 128)
    gl, beta = flashinfer_gating(a_log, a, dt_bias, bb)
    want_state, want_states = state.clone(), states.clone()
    want = step_ref(q, k, v, gl, beta, want_state, state_indices=rows, k_last=True,
                    intermediate_states=want_states)  # fmt: skip
    if not update:
        want_state = state.clone()
    got = op.gated_delta_rule_step(q, k, v, a, bb, state, state_indices=rows, k_last=True,
                                   intermediate_states=states, _gates=(a_log, dt_bias),
                                   _update_state=update)  # fmt: skip
    key = routed[-1]
    assert key["gating"] and key["tokens"] == t and key.get("update_state", True) == update
    assert float((got.float() - want.float()).abs().max()) <= 0.02 * float(want.abs().max())
    tol = 1e-5 * float(want_states.abs().max()) + 1e-6  # fp32 states against fp64
    assert float((state - want_state).abs().max()) <= tol
    assert float((states - want_states).abs().max()) <= tol


def test_launcher_picks_the_kernel(routed):
    """k-last with compact heads: the row-streaming kernel, no index tensor without
    state_indices; a k-last state whose heads are not compact, or a k-first one: the staged
    kernel with rows 0 .. B - 1."""
    q, k, v, g, beta, state = _inputs(2, 2, 2, 4, False, 2, seed=5)
    op.gated_delta_rule_step(q, k, v, g, beta, state, k_last=True)
    assert routed[-1]["tokens"] == 2 and routed[-1]["pool"] is False
    wide = torch.randn(2, 4, 128, 256)[..., :128]  # rows 256 apart: not compact
    want = wide.clone()
    step_ref(q, k, v, g, beta, want, k_last=True)
    op.gated_delta_rule_step(q, k, v, g, beta, wide, k_last=True)
    assert "tokens" not in routed[-1] and "pool" not in routed[-1]
    assert float((wide - want).abs().max()) <= 1e-5 * float(want.abs().max())
    op.gated_delta_rule_step(q, k, v, g, beta, state.transpose(-1, -2).contiguous())
    assert "tokens" not in routed[-1] and not routed[-1]["k_last"]


@pytest.mark.parametrize("per_channel", [False, True])
@pytest.mark.parametrize("g_value", [0.0, -30.0, None])  # none, total (e^-30), mixed per token
def test_norms_on_the_sums_are_fp32_exact_at_extreme_decays(per_channel, g_value):
    """|k|^-1 and scale |q|^-1 applied to the row sums, o = r + (k.q) u, against the fp64
    recurrence on normalized rows: nothing lost beyond fp32 rounding, whether the decay keeps
    the state, wipes it, or both."""
    b, t, h, hv = 2, 4, 2, 4
    q, k, v, g, beta, state = _inputs(b, t, h, hv, per_channel, b, seed=3)
    if g_value is None:
        g = g * 0 + torch.tensor([0.0, -30.0, -0.1, -5.0]).view(1, t, 1, *([1] * per_channel))
    else:
        g = torch.full_like(g, g_value)
    beta[0] = 1.0
    params = {"tokens": t, "per_channel": per_channel, "l2norm": True}
    out = torch.empty(b, t, hv, 128)
    got_state = state.clone()
    rows_kernel(params)(q, k, v, g, beta, got_state, None, out, None, None, None, 128**-0.5)
    want_state = state.clone()
    want = step_ref(q, k, v, g, beta, want_state, use_qk_l2norm=True, k_last=True)
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max())
    assert float((got_state - want_state).abs().max()) <= 1e-5 * float(want_state.abs().max())
