"""Autograd of `forgekernel.gated_delta_rule` on the GPU (the forward on the chunked WGMMA
kernel, the backward the default path of ops/gated_delta_rule_bwd.py: since 2026-12-06 the
kernel path on these 16-bit CUDA inputs, `FORGEKERNEL_GDN_BWD_KERNEL=0` the interim) against
torch.autograd through the fp64 recurrence: varlen with empty, single-token, sub-chunk and odd
sequences, grouped value heads, l2norm on unnormalized keys, both state layouts, gradients on
o and on the final state, no initial state, strong decay (g down to -5 a token), fp16 and bf16;
one long sequence against the fp64 chunked form; torch.compile of forward and backward; the
explicit `gated_delta_rule_backward`; fla's chunk_gated_delta_rule backward where it runs (its
gated backward needs triton >= 3.7.1 on Hopper: skipped with its error otherwise); the bench
shape 4 x 8192 H16 HV32 finite and timed (printed; `-s` shows it).

Tolerance: every gradient within 2e-2 of its largest entry (dq, dk, dv are returned in 16-bit:
~4e-3; the forward's own 16-bit operands do not enter: the backward recomputes from the
inputs); against fla 5e-2 (fla keeps the chunk states in 16-bit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import forgekernel
from forgekernel.reference.delta_rule import gated_delta_rule_chunked, gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu
NAMES = ("q", "k", "v", "g", "beta", "initial_state")


def _inputs(lens, h, hv, dtype, *, seed=0, l2norm=False, decay=None):
    """q, k, v, g, beta, state (fp32 leaves' values; cast by the caller), cu_seqlens."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, total, h, 128).to(dtype)
    k = rnd(1, total, h, 128)
    k = (k * 2.0 if l2norm else F.normalize(k, dim=-1)).to(dtype)
    v = rnd(1, total, hv, 128).to(dtype)
    if decay is None:
        g = F.logsigmoid(rnd(1, total, hv) + 2.0)
    else:
        g = decay * torch.rand(1, total, hv, device="cuda", generator=gen)
    beta = torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return [q, k, v, g, beta, state], cu


def _cotangents(o_shape, s_shape, dtype, seed=7):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    do = torch.randn(*o_shape, device="cuda", generator=gen).to(dtype)
    return do, torch.randn(*s_shape, device="cuda", generator=gen)


def _ours(inputs, cu, *, l2norm=False, k_last=False, with_state=True, d_final=True, seed=7):
    """Our gradients (None for the state without one) and the cotangents used."""
    leaves = [x.clone().requires_grad_() for x in inputs]
    state = leaves[5].transpose(-1, -2) if k_last else leaves[5]
    o, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=state if with_state
                                            else None, output_final_state=True,
                                            cu_seqlens=cu.int(), use_qk_l2norm_in_kernel=l2norm,
                                            k_last=k_last)  # fmt: skip
    do, ds = _cotangents(o.shape, final.shape, o.dtype, seed)
    loss = (o.float() * do.float()).sum() + ((final * ds).sum() if d_final else 0.0)
    loss.backward()
    ds_kv = ds.transpose(-1, -2) if k_last else ds
    return [x.grad for x in leaves], do, (ds_kv if d_final else None)


def _fp64(inputs, cu, do, ds, *, l2norm=False, with_state=True, chunked=False):
    leaves = [x.double().requires_grad_() for x in inputs]
    run = gated_delta_rule_chunked if chunked else gated_delta_rule_recurrent
    o, final = run(*leaves[:5], initial_state=leaves[5] if with_state else None,
                   output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2norm,
                   dtype=torch.float64)  # fmt: skip
    loss = (o * do.double()).sum() + (0.0 if ds is None else (final * ds.double()).sum())
    loss.backward()
    return [x.grad for x in leaves]


def _close(got, want, rel, name):
    assert got is not None and got.shape == want.shape, name
    assert torch.isfinite(got).all(), name
    if want.numel() == 0:
        return
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


def _check(inputs, cu, *, l2norm=False, k_last=False, with_state=True, d_final=True):
    got, do, ds = _ours(inputs, cu, l2norm=l2norm, k_last=k_last, with_state=with_state,
                        d_final=d_final)  # fmt: skip
    want = _fp64(inputs, cu, do, ds, l2norm=l2norm, with_state=with_state)
    for name, x, w, leaf in zip(NAMES, got, want, inputs):
        if name == "initial_state" and not with_state:
            assert x is None
            continue
        assert x.dtype == leaf.dtype, name
        _close(x, w, 2e-2, name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "k_last", "l2norm", "with_state", "d_final"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True, True),
        ([200], 4, 8, True, True, True, True),
        ([3, 129, 7], 16, 32, False, True, False, True),
        ([300, 301], 16, 16, True, False, True, False),
        ([1], 1, 1, False, False, True, True),
    ],
)
def test_gradients_match_the_fp64_recurrence(dtype, lens, h, hv, k_last, l2norm, with_state,
                                             d_final):  # fmt: skip
    inputs, cu = _inputs(lens, h, hv, dtype, l2norm=l2norm)
    _check(inputs, cu, l2norm=l2norm, k_last=k_last, with_state=with_state, d_final=d_final)


@pytest.mark.parametrize("decay", [-5.0, 0.0])
def test_strong_and_no_decay(decay):
    """g uniform in [-5, 0] (e^-320 over a chunk: every exponent formed is <= 0) and g = 0."""
    inputs, cu = _inputs([65, 200], 2, 4, torch.bfloat16, seed=3, decay=decay)
    _check(inputs, cu)


def test_one_long_sequence_against_the_fp64_chunked_form():
    """32 chunks: the reverse state recurrence carried through all of them."""
    inputs, cu = _inputs([2048], 2, 4, torch.bfloat16, seed=4)
    got, do, ds = _ours(inputs, cu)
    want = _fp64(inputs, cu, do, ds, chunked=True)
    for name, x, w in zip(NAMES, got, want):
        _close(x, w, 2e-2, name)


def test_explicit_backward_equals_autograd():
    inputs, cu = _inputs([5, 70, 0, 130], 2, 4, torch.bfloat16, seed=5, l2norm=True)
    got, do, ds = _ours(inputs, cu, l2norm=True)
    grads = forgekernel.gated_delta_rule_backward(*inputs[:5], do, initial_state=inputs[5],
                                                  d_final_state=ds, cu_seqlens=cu.int(),
                                                  use_qk_l2norm_in_kernel=True)  # fmt: skip
    for name, a, b in zip(NAMES, got, grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=name)


def test_torch_compile_forward_and_backward():
    inputs, _ = _inputs([2 * 333], 2, 4, torch.bfloat16, seed=6)
    state = inputs[5].expand(2, -1, -1, -1).clone()
    inputs = [x.view(2, 333, *x.shape[2:]) for x in inputs[:5]] + [state]

    def loss(q, k, v, g, beta, state):
        o, final = forgekernel.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True)  # fmt: skip
        return o.float().square().sum() + final.square().sum()

    eager = [x.clone().requires_grad_() for x in inputs]
    loss(*eager).backward()
    compiled = [x.clone().requires_grad_() for x in inputs]
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True)(*compiled).backward()
    for name, a, b in zip(NAMES, eager, compiled):
        torch.testing.assert_close(a.grad, b.grad, rtol=1e-4, atol=1e-4, msg=name)


def test_fla_backward_agrees():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    inputs, cu = _inputs([100, 1000, 33], 4, 8, torch.bfloat16, seed=8)
    got, do, ds = _ours(inputs, cu)
    leaves = [x.clone().requires_grad_() for x in inputs]
    try:
        o, final = fla.chunk_gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                              output_final_state=True, cu_seqlens=cu)  # fmt: skip
        ((o.float() * do.float()).sum() + (final * ds).sum()).backward()
    except Exception as err:  # its gated backward refuses Hopper with triton < 3.7.1
        pytest.skip(f"fla's backward does not run here: {type(err).__name__}: {err}")
    for name, a, leaf in zip(NAMES, got, leaves):
        _close(a, leaf.grad, 5e-2, name)


def test_bench_shape_runs_and_is_timed():
    """4 x 8192 tokens, H 16, HV 32 (the suite's batch case): finite gradients, the default
    backward's time printed (the kernel path since 2026-12-06)."""
    inputs, cu = _inputs([8192] * 4, 16, 32, torch.bfloat16, seed=9)
    do, ds = _cotangents(inputs[2].shape, inputs[5].shape, torch.bfloat16)
    args = (*inputs[:5], do)
    kwargs = {"initial_state": inputs[5], "d_final_state": ds, "cu_seqlens": cu.int()}
    times = []
    for _ in range(3):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        grads = forgekernel.gated_delta_rule_backward(*args, **kwargs)
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    peak = torch.cuda.max_memory_allocated() / 2**30
    print(f"\nGDN backward (default path) 4x8192 h16 hv32: {min(times):.1f} ms, "
          f"peak {peak:.1f} GiB")  # fmt: skip
    for name, x in zip(NAMES, grads):
        assert torch.isfinite(x).all(), name
