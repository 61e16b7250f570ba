"""The Gated DeltaNet backward's q / k epilogue (the group sum over value heads, l2norm's
backward, the scale; kernels/linear_attention/gdn_bwd_norm/sm90) on the GPU against its model
in fp64 (`reference.gdn_bwd_norm.qk_grad_model`, itself checked against autograd on the CPU):
output NaN-poisoned before the call (a row the kernel does not write fails); T = 1, 63, 64, 65,
200, 1000 (the last CTA's rows past T masked); B 1-3; (H, HV) = (1, 1), (2, 4), (3, 9), (16,
32); l2norm on / off; bf16 and fp16; misaligned x (the launcher's copy); the time at 4 x 8192
H16 HV32 printed (`-s`).

Tolerance: within 1e-2 of the reference's largest entry (one 16-bit rounding of the output;
fp32 sums in a fixed order)."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.launch import gdn_bwd_norm
from forgekernel.reference.gdn_bwd_norm import qk_grad_model
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
TOL = 1e-2


def _problem(b, t, h, hv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = (torch.randn(b, t, h, 128, device="cuda", generator=gen) * 3.0).to(dtype)
    dxs = torch.randn(b, t, hv, 128, device="cuda", generator=gen)
    return dxs, x


def _check(dxs, x, scale, l2norm):
    out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
    got = gdn_bwd_norm(dxs, x, scale, l2norm, out=out)
    torch.cuda.synchronize()
    want = qk_grad_model(dxs.double(), x.double(), scale, l2norm, torch.float64)
    assert got is out and not torch.isnan(got).any(), "unwritten (NaN) entries"
    if want.numel():
        err = float((got.double() - want).abs().max())
        assert err <= TOL * float(want.abs().max()) + 1e-6, (err, float(want.abs().max()))


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "h", "hv"), [(1, 1, 1), (2, 2, 4), (3, 3, 9), (1, 16, 32)])
@pytest.mark.parametrize("l2norm", [False, True])
def test_matches_the_model(t, b, h, hv, l2norm):
    _check(*_problem(b, t, h, hv, torch.bfloat16, seed=t + hv), 0.088, l2norm)


@pytest.mark.parametrize("l2norm", [False, True])
def test_fp16(l2norm):
    _check(*_problem(2, 130, 2, 6, torch.float16, seed=3), 1.0, l2norm)


def test_misaligned_x():
    dxs, x = _problem(2, 70, 2, 4, torch.bfloat16, seed=4)
    shifted = torch.empty(x.numel() + 1, dtype=x.dtype, device="cuda")[1:].view(x.shape)
    shifted.copy_(x)
    _check(dxs, shifted, 0.5, True)


def test_time_at_bench_size():
    """4 x 8192 tokens, H 16, HV 32 (one of the op's two calls: q's): the prediction ~0.2-0.25
    ms (0.8 GB moved: dxs fp32 0.54 GB read, x 0.13 GB read, dx 0.13 GB written; NOTES.md "GDN
    backward: the torch glue"); one sequence's first 1000 tokens checked."""
    dxs, x = _problem(4, 8192, 16, 32, torch.bfloat16, seed=5)
    out = torch.empty_like(x)
    ms = median(time_ms(lambda: gdn_bwd_norm(dxs, x, 0.088, True, out=out)))
    print(f"\ngdn_bwd_norm 4 x 8192 H16 HV32 bf16 l2norm: {ms:.3f} ms a call")
    _check(dxs[:1, :1000], x[:1, :1000], 0.088, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("h", "hv"), [(1, 1), (2, 4), (16, 32)])
@pytest.mark.parametrize("l2norm", [False, True])
def test_d16_gradients(dtype, h, hv, l2norm):
    """16-bit value-head gradients (the `d16` key, the chunk kernel's dqk16): against the model
    on the same 16-bit partials (summed in fp64 there, fp32 here)."""
    dxs, x = _problem(2, 200, h, hv, dtype, seed=h + hv)
    _check(dxs.to(dtype), x, 0.25, l2norm)
