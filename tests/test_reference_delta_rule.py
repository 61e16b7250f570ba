"""The delta-rule references: the chunked WY / UT form against the token-by-token recurrence
(fp64 tight, fp32 loose) on odd lengths, grouped heads, varlen with per-sequence states, qk
l2norm, a long sequence with strong decay; the decode step against the recurrence; and
FlashInfer-Bench's own GDN reference code (their specification) against ours via the adapter."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference import gdn_flashinfer
from forgekernel.reference.delta_rule import (
    gated_delta_rule_chunked,
    gated_delta_rule_recurrent,
    gated_delta_rule_step,
    kimi_delta_attention_chunked,
    kimi_delta_attention_recurrent,
)

FP64_TOL = 1e-12  # relative to the largest reference value
FP32_TOL = 2e-5
# bench/flashinfer_defs' convention: $FORGEKERNEL_FLASHINFER_DEFS, else beside the repository.
FLASHINFER = Path(
    os.environ.get(
        "FORGEKERNEL_FLASHINFER_DEFS",
        Path(__file__).resolve().parents[2] / "shared" / "external" / "flashinfer-bench",
    )
)

RECURRENT = {False: gated_delta_rule_recurrent, True: kimi_delta_attention_recurrent}
CHUNKED = {False: gated_delta_rule_chunked, True: kimi_delta_attention_chunked}


def make_inputs(b, t, h, hv, dk, dv, per_channel, seed, l2norm=False, decay=(-1.0, 0.0), n=None):
    """Random q, k, v, g, beta and initial state. Without l2norm k is unit-norm (the delta rule
    is stable only for beta |k|^2 < 2); g is uniform in `decay` (log space)."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q, k = rand(b, t, h, dk), rand(b, t, h, dk)
    k = k if l2norm else F.normalize(k, dim=-1)
    g_shape = (b, t, hv, dk) if per_channel else (b, t, hv)
    lo, hi = decay
    g = lo + (hi - lo) * torch.rand(*g_shape, generator=gen)
    beta = torch.sigmoid(rand(b, t, hv))
    state = 0.5 * rand(b if n is None else n, hv, dk, dv)
    return q, k, rand(b, t, hv, dv), g, beta, state


def rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    assert torch.isfinite(got).all()
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)).item()


def check_chunked(per_channel, inputs, **kw):
    """Chunked fp64 and fp32 against the fp64 recurrence, outputs and final states."""
    q, k, v, g, beta, h0 = inputs
    args = dict(initial_state=h0, output_final_state=True, **kw)
    o_ref, s_ref = RECURRENT[per_channel](q, k, v, g, beta, **args)
    assert o_ref.dtype == torch.float64 and o_ref.shape == v.shape
    for dtype, tol in ((torch.float64, FP64_TOL), (torch.float32, FP32_TOL)):
        o, s = CHUNKED[per_channel](q, k, v, g, beta, dtype=dtype, **args)
        assert o.dtype == s.dtype == dtype
        assert rel_err(o, o_ref) < tol and rel_err(s, s_ref) < tol, (dtype, kw)
    return o_ref, s_ref


SHAPES = [
    # b, t, h, hv, k, v
    (2, 1, 2, 4, 64, 64),
    (2, 63, 2, 4, 64, 64),
    (1, 65, 2, 2, 64, 64),
    (1, 130, 2, 4, 128, 128),
    (2, 65, 1, 1, 128, 64),
]


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("l2norm", [False, True], ids=["raw", "l2norm"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_chunked_matches_recurrence(shape, l2norm, per_channel):
    b, t, h, hv, dk, dv = shape
    inputs = make_inputs(b, t, h, hv, dk, dv, per_channel, seed=sum(shape), l2norm=l2norm)
    check_chunked(per_channel, inputs, use_qk_l2norm=l2norm, scale=0.3 if l2norm else None)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_varlen_sequences_start_from_their_own_states(per_channel):
    lengths = [37, 93, 5]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)
    inputs = make_inputs(1, sum(lengths), 2, 4, 32, 16, per_channel, seed=7, n=3)
    o, s = check_chunked(per_channel, inputs, cu_seqlens=cu)
    q, k, v, g, beta, h0 = inputs
    for i, (t0, t1) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        one = (x[:, t0:t1] for x in (q, k, v, g, beta))
        o_i, s_i = RECURRENT[per_channel](
            *one, initial_state=h0[i : i + 1], output_final_state=True
        )
        torch.testing.assert_close(o[:, t0:t1], o_i, rtol=0, atol=1e-12)
        torch.testing.assert_close(s[i : i + 1], s_i, rtol=0, atol=1e-12)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_strong_decay_over_a_long_sequence(per_channel):
    """g ~ -5 over T = 2049: the log decay crosses -88 inside every chunk, where a factorized
    exp(G_i) * exp(-G_j) would overflow fp32; the chunked form must stay finite and exact."""
    inputs = make_inputs(1, 2049, 1, 2, 16, 16, per_channel, seed=3, decay=(-6.0, -4.0))
    g = inputs[3]
    assert -g[:, :64].sum(1).min() > 88  # the case is the one that would overflow
    check_chunked(per_channel, inputs)


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
def test_gradients_of_both_forms_agree(per_channel):
    """The backward's reference: autograd through either form, fp64, varlen with initial states."""
    cu = torch.tensor([0, 30, 97])
    inputs = [
        x.double().requires_grad_() for x in make_inputs(1, 97, 1, 2, 16, 8, per_channel, 9, n=2)
    ]
    grads = []
    for fn in (RECURRENT[per_channel], CHUNKED[per_channel]):
        o, s = fn(
            *inputs[:5],
            initial_state=inputs[5],
            output_final_state=True,
            cu_seqlens=cu,
            dtype=torch.float64,
        )
        grads.append(torch.autograd.grad((o * o.detach()).sum() + (s * s.detach()).sum(), inputs))
    for want, got in zip(*grads):
        assert rel_err(got, want) < FP64_TOL


def test_chunk_size_does_not_change_the_result():
    q, k, v, g, beta, h0 = make_inputs(1, 77, 2, 4, 32, 32, True, seed=11)
    args = dict(initial_state=h0, output_final_state=True, dtype=torch.float64)
    o64, s64 = kimi_delta_attention_chunked(q, k, v, g, beta, **args)
    for c in (1, 16, 128):
        o, s = kimi_delta_attention_chunked(q, k, v, g, beta, chunk_size=c, **args)
        assert rel_err(o, o64) < FP64_TOL and rel_err(s, s64) < FP64_TOL


def test_one_token_by_hand():
    """fla's order: decay, delta read from the decayed state, update, then o = S^T (scale q)."""
    q, k, v, g, beta, h0 = (x.double() for x in make_inputs(1, 1, 1, 1, 8, 5, False, seed=5))
    o, s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=h0, output_final_state=True)
    a, b_, qv, kv, vv = g.exp().item(), beta.item(), q[0, 0, 0], k[0, 0, 0], v[0, 0, 0]
    decayed = a * h0[0, 0]
    want_s = decayed + b_ * torch.outer(kv, vv - decayed.T @ kv)
    torch.testing.assert_close(s[0, 0], want_s)
    torch.testing.assert_close(o[0, 0, 0], want_s.T @ qv / math.sqrt(8))


@pytest.mark.parametrize("per_channel", [False, True], ids=["gdn", "kda"])
@pytest.mark.parametrize("tokens", [1, 2, 4])
def test_decode_step_equals_recurrence(tokens, per_channel):
    b, h, hv, dk, dv, pool = 3, 2, 4, 32, 16, 5
    q, k, v, g, beta, h0 = make_inputs(b, tokens, h, hv, dk, dv, per_channel, seed=tokens)
    o_ref, s_ref = RECURRENT[per_channel](
        q, k, v, g, beta, initial_state=h0, output_final_state=True
    )
    rows = torch.tensor([4, 0, 2])
    for k_last in (False, True):
        states = torch.randn(pool, hv, dk, dv, dtype=torch.float64)
        states[rows] = h0.double()
        untouched = states[[1, 3]].clone()
        states = states.transpose(-1, -2).contiguous() if k_last else states
        inter = torch.zeros(pool, tokens, *states.shape[1:], dtype=torch.float64)
        o = gated_delta_rule_step(
            q, k, v, g, beta, states, state_indices=rows, k_last=k_last, intermediate_states=inter
        )
        states = states.transpose(-1, -2) if k_last else states
        torch.testing.assert_close(o, o_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(states[rows], s_ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(states[[1, 3]], untouched, rtol=0, atol=0)
        last = inter[rows, -1].transpose(-1, -2) if k_last else inter[rows, -1]
        torch.testing.assert_close(last, s_ref, rtol=0, atol=1e-12)
    # one token at a time, fp32 state: the decode kernel's loop
    states = h0.clone()
    o = torch.cat(
        [
            gated_delta_rule_step(*(x[:, i : i + 1] for x in (q, k, v, g, beta)), states)
            for i in range(tokens)
        ],
        dim=1,
    )
    assert o.dtype == torch.float32
    assert rel_err(o, o_ref) < FP32_TOL and rel_err(states, s_ref) < FP32_TOL


def test_bad_shapes_are_named():
    q, k, v, g, beta, h0 = make_inputs(2, 9, 2, 4, 8, 8, False, seed=1)
    with pytest.raises(ValueError, match="g must be"):
        gated_delta_rule_recurrent(q, k, v, g.unsqueeze(-1).expand(-1, -1, -1, 8), beta)
    with pytest.raises(ValueError, match="v must be"):
        gated_delta_rule_chunked(q, k, v[:, :, :3], g[:, :, :3], beta[:, :, :3])
    with pytest.raises(ValueError, match="B = 1"):
        gated_delta_rule_chunked(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 9]))
    cu = torch.tensor([0, 4, 9])
    with pytest.raises(ValueError, match="initial_state"):
        one = (x[:1] for x in (q, k, v, g, beta))
        gated_delta_rule_recurrent(*one, initial_state=h0[:, :2], cu_seqlens=cu)


# ----------------------------------------------------------------------------- FlashInfer-Bench


def flashinfer_run(name: str):
    """The `run` function of a definition's reference code (their specification, executed)."""
    path = FLASHINFER / f"{name}.json"
    if not path.is_file():
        pytest.skip(f"{path} not present")
    namespace: dict = {}
    exec(compile(json.loads(path.read_text())["reference"], str(path), "exec"), namespace)
    return namespace["run"]


def flashinfer_inputs(lead: tuple[int, ...], seed: int):
    """bf16 q, k (unit-norm before rounding), v, a, b and fp32 A_log, dt_bias; 4 q/k heads, 8
    value heads, head size 128 as the definitions require."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=gen)

    q = rand(*lead, 4, 128).bfloat16()
    k = F.normalize(rand(*lead, 4, 128), dim=-1).bfloat16()
    v = rand(*lead, 8, 128).bfloat16()
    gating = dict(
        A_log=0.5 * rand(8),
        a=rand(*lead, 8).bfloat16(),
        dt_bias=rand(8),
        b=rand(*lead, 8).bfloat16(),
    )
    return q, k, v, gating, gen


def assert_bf16_close(got: torch.Tensor, want: torch.Tensor):
    """fp64 vs fp32 math rounded to bf16: at most about one bf16 ulp apart."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-4)


@pytest.mark.parametrize("chunked", [False, True], ids=["recurrent", "chunked"])
def test_flashinfer_prefill(chunked):
    run = flashinfer_run("gdn_prefill_qk4_v8_d128_k_last")
    cu = torch.tensor([0, 7, 7, 19, 22], dtype=torch.int64)  # the second sequence is empty
    q, k, v, gating, gen = flashinfer_inputs((22,), seed=20)
    state = 0.3 * torch.randn(4, 8, 128, 128, generator=gen)
    for st, scale in ((state, 0.0), (None, 0.125)):
        want_o, want_s = run(q, k, v, st, cu_seqlens=cu, scale=scale, **gating)
        o, s = gdn_flashinfer.gdn_prefill(
            q, k, v, st, cu_seqlens=cu, scale=scale, chunked=chunked, **gating
        )
        assert_bf16_close(o, want_o)
        assert s.dtype == torch.float32 and s.shape == want_s.shape
        torch.testing.assert_close(s, want_s, rtol=1e-4, atol=2e-5 if chunked else 1e-5)


def test_flashinfer_decode():
    run = flashinfer_run("gdn_decode_qk4_v8_d128_k_last")
    q, k, v, gating, gen = flashinfer_inputs((3, 1), seed=21)
    state = 0.3 * torch.randn(3, 8, 128, 128, generator=gen)
    before = state.clone()
    for st in (state, None):
        want_o, want_s = run(q, k, v, st, scale=None, **gating)
        o, s = gdn_flashinfer.gdn_decode(q, k, v, st, scale=None, **gating)
        assert_bf16_close(o, want_o)
        torch.testing.assert_close(s, want_s, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(state, before, rtol=0, atol=0)


def test_flashinfer_mtp():
    run = flashinfer_run("gdn_mtp_qk4_v8_d128_k_last")
    q, k, v, gating, gen = flashinfer_inputs((2, 3), seed=22)
    pool = 0.3 * torch.randn(5, 8, 128, 128, generator=gen)
    rows = torch.tensor([3, 1], dtype=torch.int32)
    want_buf, buf = (torch.zeros(5, 3, 8, 128, 128) for _ in range(2))
    want_o, want_pool = run(
        q, k, v, pool, rows, scale=0.0, intermediate_states_buffer=want_buf, **gating
    )
    o, final = gdn_flashinfer.gdn_mtp(
        q, k, v, pool, rows, scale=0.0, intermediate_states_buffer=buf, **gating
    )
    assert_bf16_close(o, want_o)
    torch.testing.assert_close(final, want_pool, rtol=0, atol=0)
    torch.testing.assert_close(buf, want_buf, rtol=1e-5, atol=1e-5)
    # the updated pool, when asked for, is the last intermediate state of each used row
    _, updated = gdn_flashinfer.gdn_mtp(
        q, k, v, pool, rows, scale=0.0, disable_state_update=False, **gating
    )
    torch.testing.assert_close(updated[rows.long()], buf[rows.long(), -1], rtol=0, atol=1e-6)
    torch.testing.assert_close(updated[[0, 2, 4]], pool[[0, 2, 4]], rtol=0, atol=0)
