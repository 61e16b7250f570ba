"""The Gated DeltaNet backward's q / k epilogue (kernels/linear_attention/gdn_bwd_norm/sm90) on
the CPU: its model (`reference.gdn_bwd_norm.qk_grad_model`) is the gradient of x -> x scale /
sqrt(x.x + eps) (or x scale) repeated to the value heads, by autograd in fp64 (T = 1, 63, 65,
200; H = HV and HV = 2H, 3H; l2norm on / off) and the reference's `_l2norm_backward`; the
launcher's checks and the call it makes (the compiled signature; a recorder stands in for the
kernel). The GPU twin: tests/gpu/test_gdn_bwd_norm_gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.reference.delta_rule import L2NORM_EPS
from forgekernel.reference.delta_rule_bwd import _l2norm, _l2norm_backward
from forgekernel.reference.gdn_bwd_norm import qk_grad_model

launch = importlib.import_module("forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.launch")


def _problem(b, t, h, hv, k=16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(b, t, h, k, generator=gen, dtype=torch.float64) * 2.0
    dxs = torch.randn(b, t, hv, k, generator=gen, dtype=torch.float64)
    return x, dxs


@pytest.mark.parametrize("t", [1, 63, 65, 200])
@pytest.mark.parametrize(("h", "hv"), [(2, 2), (2, 4), (1, 3)])
@pytest.mark.parametrize("l2norm", [False, True])
def test_model_is_the_autograd_gradient(t, h, hv, l2norm):
    x, dxs = _problem(2, t, h, hv, seed=t + hv)
    leaf = x.clone().requires_grad_()
    y = leaf / torch.sqrt((leaf * leaf).sum(-1, keepdim=True) + L2NORM_EPS) if l2norm else leaf
    ys = (y * 0.3).repeat_interleave(hv // h, dim=2)
    (want,) = torch.autograd.grad((ys * dxs).sum(), leaf)
    got = qk_grad_model(dxs, x, 0.3, l2norm)
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)
    if l2norm:  # the reference's own form
        yn, norm = _l2norm(x)
        d = dxs.unflatten(2, (h, hv // h)).sum(3) * 0.3
        torch.testing.assert_close(got, _l2norm_backward(yn, norm, d), rtol=1e-10, atol=1e-12)


def test_model_rounds_once_to_the_dtype():
    x, dxs = _problem(1, 70, 2, 4, k=128, seed=5)
    x16 = x.bfloat16()
    got = qk_grad_model(dxs.float(), x16, 0.1, True)
    assert got.dtype == torch.bfloat16
    want = qk_grad_model(dxs, x16.double(), 0.1, True)
    err = float((got.double() - want).abs().max())
    assert err <= 2**-8 * float(want.abs().max())


def test_launcher_checks():
    x, dxs = _problem(2, 5, 2, 4, k=128)
    x16, d32 = x.bfloat16(), dxs.float()
    launch.check_inputs(d32, x16)
    with pytest.raises(TypeError, match="x must be"):
        launch.check_inputs(d32, x.float())
    with pytest.raises(ValueError, match="dxs must be"):
        launch.check_inputs(d32.double(), x16)
    with pytest.raises(ValueError, match="dxs must be"):
        launch.check_inputs(d32[:, :, :3], x16)  # 3 value heads: 2 does not divide
    with pytest.raises(ValueError, match="dxs must be"):
        launch.check_inputs(d32[:, :4], x16)
    with pytest.raises(ValueError, match="K must be"):
        launch.check_inputs(d32[..., :64], x16[..., :64])
    launch.check_inputs(dxs.bfloat16(), x16)  # 16-bit gradients: x's dtype (the d16 key)
    with pytest.raises(ValueError, match="dxs must be"):
        launch.check_inputs(dxs.half(), x16)


@pytest.mark.parametrize("l2norm", [False, True])
def test_launcher_passes_the_compiled_signature(monkeypatch, l2norm):
    """(dxs, x, out, scale) under the key (dtype, K, l2norm); empty inputs launch nothing."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    x, dxs = _problem(2, 70, 2, 6, k=128)
    x16, d32 = x.half(), dxs.float()
    out = launch.gdn_bwd_norm(d32, x16, 0.25, l2norm)
    ((params, args),) = calls
    assert dict(params) == {"dtype": "float16", "k": 128, "l2norm": l2norm}
    assert args[0] is d32 and args[1] is x16 and args[2] is out and args[3] == 0.25
    assert out.shape == x16.shape and out.dtype == torch.float16
    launch.gdn_bwd_norm(d32[:, :0], x16[:, :0], 0.25, l2norm)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="out must be"):
        launch.gdn_bwd_norm(d32, x16, 0.25, l2norm, out=torch.empty_like(x16, dtype=torch.bfloat16))


def test_launcher_d16_key(monkeypatch):
    """16-bit value-head gradients (the chunk kernel's dqk16) take the `d16` key."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    x, dxs = _problem(2, 70, 2, 6, k=128)
    x16, d16 = x.bfloat16(), dxs.bfloat16()
    launch.gdn_bwd_norm(d16, x16, 0.5, True)
    ((params, args),) = calls
    assert dict(params) == {"dtype": "bfloat16", "k": 128, "l2norm": True, "d16": True}
    assert args[0] is d16 and args[3] == 0.5
