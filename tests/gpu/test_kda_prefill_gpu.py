"""Kimi Delta Attention forward (`forgekernel.ops.kda_chunked.kimi_delta_attention`, issue 20)
on the GPU against the fp64 recurrence: varlen with empty, single-token, sub-chunk and odd
sequences, a long sequence, with and without an initial state, l2norm on unnormalized keys,
grouped value heads, fp16 and bf16, strong per-channel decays (g in [-5, -4] per step: the
case the sub-chunk references exist for), g in q's dtype; `out=`; fla's
chunk_kda where installed; the recurrence kernel against its CPU replay (tests/
kda_prefill_replay.py) on the same first-pass operands. The op runs the first pass in torch
and the recurrence on the WGMMA kernel (kernels/linear_attention/kda_prefill/sm90).

Tolerances: o within 2e-2 of max |o|, the final state within 2e-2 of max |S| (the kernel's
16-bit operands; the CPU model sits below 7e-3 at g down to -5)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.kda_chunked")
TOL = 2e-2


def _inputs(lens, h, hv, dtype, seed=0, knorm=1.0, strong=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, total, h, 128).to(dtype)
    k = (F.normalize(rnd(1, total, h, 128), dim=-1) * knorm).to(dtype)
    v = rnd(1, total, hv, 128).to(dtype)
    if strong:
        g = -4.0 - torch.rand(1, total, hv, 128, device="cuda", generator=gen)
    else:
        g = F.logsigmoid(rnd(1, total, hv, 128) + 2.0)
    beta = torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, v, g, beta, state, cu


def _close(got, want, rel):
    assert got.shape == want.shape
    if want.numel() == 0:
        return
    assert torch.isfinite(got).all()
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, err


def _check(lens, h, hv, dtype, *, state=True, l2norm=False, strong=False, knorm=1.0, seed=0):
    q, k, v, g, beta, h0, cu = _inputs(lens, h, hv, dtype, seed, knorm, strong)
    init = h0 if state else None
    o, s = op.kimi_delta_attention(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                   cu_seqlens=cu.to(torch.int32),
                                   use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
    o_ref, s_ref = kimi_delta_attention_recurrent(q, k, v, g, beta, initial_state=init,
                                                  output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm=l2norm)  # fmt: skip
    assert o.dtype == dtype and s.dtype == torch.float32
    _close(o, o_ref, TOL)
    _close(s, s_ref, TOL)
    return o, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state", [True, False])
def test_varlen_edges(dtype, state):
    _check([1, 0, 63, 64, 65, 16, 17, 130], 2, 2, dtype, state=state)


def test_grouped_value_heads_and_l2norm():
    _check([200, 37], 4, 8, torch.bfloat16, l2norm=True, knorm=3.0)


@pytest.mark.parametrize("lens", [[1500], [700, 5, 801]])
def test_strong_per_channel_decay(lens):
    _check(lens, 2, 2, torch.bfloat16, strong=True)


def test_long_sequence():
    _check([4100], 1, 2, torch.bfloat16, seed=3)


def test_batch_without_offsets_equals_varlen():
    q, k, v, g, beta, h0, _ = _inputs([96, 96], 2, 2, torch.bfloat16, seed=4)
    as_batch = (x.view(2, 96, *x.shape[2:]) for x in (q, k, v, g, beta))
    o_b, s_b = op.kimi_delta_attention(*as_batch, initial_state=h0, output_final_state=True)
    cu = torch.tensor([0, 96, 192], device="cuda", dtype=torch.int32)
    o_v, s_v = op.kimi_delta_attention(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu)  # fmt: skip
    torch.testing.assert_close(o_b.view(1, 192, 2, 128), o_v, rtol=0, atol=0)
    torch.testing.assert_close(s_b, s_v, rtol=0, atol=0)


def test_gate_in_q_dtype_and_out():
    q, k, v, g, beta, h0, cu = _inputs([77], 2, 2, torch.bfloat16, seed=5)
    out = torch.empty_like(v)
    o, _ = op.kimi_delta_attention(q, k, v, g.to(q.dtype), beta.to(q.dtype), out=out)
    assert o.data_ptr() == out.data_ptr()
    o_ref, _ = kimi_delta_attention_recurrent(q, k, v, g.to(q.dtype), beta.to(q.dtype))
    _close(out, o_ref, TOL)


def test_against_fla():
    fla_kda = pytest.importorskip("fla.ops.kda")
    q, k, v, g, beta, h0, cu = _inputs([300, 1000, 5], 4, 4, torch.bfloat16, seed=7)
    o, s = op.kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu)  # fmt: skip
    o_f, s_f = fla_kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 cu_seqlens=cu)  # fmt: skip
    _close(o, o_f.to(o.dtype), 3 * TOL)
    _close(s, s_f.float(), 3 * TOL)


@pytest.mark.parametrize("split", [False, True], ids=["one-cta", "value-split"])
def test_kernel_equals_its_replay(split):
    """The recurrence kernel and tests/kda_prefill_replay.py on the same operands (the torch
    first pass): equal up to fp32 summation order and 16-bit roundings of the output."""
    import kda_prefill_replay as replay

    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import SPEC, launch, operands
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import params_for
    from forgekernel.runtime.cache import get_kernel

    q, k, v, g, beta, h0, cu = _inputs([1, 63, 64, 65, 300], 2, 4, torch.bfloat16, seed=11)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    edges = cu.tolist()
    ops = operands.kda_chunk_operands(q, k, g, beta, edges, 128**-0.5, False)
    args = (ops["q_g"], ops["k_g"], ops["k_d"], ops["t_beta"], ops["p"], ops["decay"], v, h0,
            cu.to(torch.int32), ops["first"])  # fmt: skip
    outs = []
    params = params_for("bfloat16", initial_state=True, value_split=split)
    for fn in (get_kernel(SPEC, params),
               replay.kernel({"initial_state": True})):  # fmt: skip
        o, s = torch.zeros_like(v), torch.empty_like(h0)
        fn(*args, o, s)
        torch.cuda.synchronize()
        outs.append((o, s))
    (o, s), (o_r, s_r) = outs
    _close(o, o_r, 1e-2)
    _close(s, s_r, 1e-3)
    assert launch.ALIGN == 16


def test_first_pass_kernel_equals_torch_first_pass():
    """intra.py (first GPU run) against operands.py on the same inputs, output by output: the
    bf16 operand tiles within a few bf16 roundings of their largest entry, D to fp32 exp2."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    q, k, v, g, beta, _, cu = _inputs([1, 63, 64, 65, 300], 2, 4, torch.bfloat16, seed=13,
                                      strong=True)  # fmt: skip
    q, k, g, beta = (x[0] for x in (q, k, g, beta))
    edges = cu.tolist()
    want = operands.kda_chunk_operands(q, k, g, beta, edges, 0.1, False)
    got = launch.first_pass_kernel(q, k, g, beta, edges, 0.1, False)
    assert torch.equal(got["first"], want["first"])
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        _close(got[name].float(), want[name].float(), 3e-2)


@pytest.mark.parametrize("l2norm", [False, True])
def test_op_with_the_first_pass_kernel(l2norm):
    q, k, v, g, beta, h0, cu = _inputs([1, 0, 64, 65, 700], 2, 4, torch.bfloat16, seed=14,
                                       strong=True, knorm=2.0 if l2norm else 1.0)  # fmt: skip
    o, s = op._forward(q, k, v, g, beta, 128**-0.5, h0, cu.to(torch.int32), l2norm,
                       first_pass="kernel")  # fmt: skip
    o_ref, s_ref = kimi_delta_attention_recurrent(q, k, v, g, beta, initial_state=h0,
                                                  output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm=l2norm)  # fmt: skip
    _close(o, o_ref, TOL)
    _close(s, s_ref, TOL)
