"""Kernel 0 of the Gated DeltaNet backward (kernels/linear_attention/gdn_bwd_factors/sm90) on
the CPU: its tile emulation (`reference.gdn_bwd_factors.factors_model`) against the torch
factors it replaces (`_Factors` through `factor_tiles`) in fp64 unrounded, and within the GPU
tolerance with the kernel's 16-bit operands and outputs (and the forward's tf32 blocked
inverse, replayed); the layouts kernel 1 and kernel 2 read; the launcher's checks; which outputs
a tail chunk's rows past its sequence reach (next/varlen-native-plan's mask list)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gdn_prefill_replay import blocked_inverse

from forgekernel.reference.gdn_bwd_factors import (
    NAMES,
    factor_tiles,
    factors_model,
    for_kernel2,
    forward_launch_tiles,
    rounding_to,
)
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    batched_state_pass_factors,
    chunk_factors,
    forward_state_tiles,
)

TOL = 1e-2  # of each output's largest entry: the GPU tests' bound


def problem(b, t, h, hv, dk=32, dv=16, seed=0, dtype=torch.float64):
    """q (scaled, normalized), k (B, T, H, K), v (B, T, HV, V), g, beta (B, T, HV)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    q = F.normalize(rnd(b, t, h, dk), dim=-1) * dk**-0.5
    k = F.normalize(rnd(b, t, h, dk), dim=-1)
    v = rnd(b, t, hv, dv)
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    return tuple(x.to(dtype) for x in (q, k, v)) + (g, beta)


def expected(q, k, v, g, beta, dtype):
    """`factor_tiles` of the torch factors, q / k repeated to the value heads."""
    group = v.shape[2] // q.shape[2]
    qs, ks = (x.double().repeat_interleave(group, dim=2) for x in (q, k))
    return factor_tiles(chunk_factors(qs, ks, v.double(), g.double(), beta.double()), dtype)


SIZES = [(1, 1, 1, 1), (1, 63, 2, 2), (2, 64, 1, 3), (1, 65, 2, 4), (2, 200, 2, 4)]


@pytest.mark.parametrize(("b", "t", "h", "hv"), SIZES)
def test_model_is_the_torch_factors_unrounded(b, t, h, hv):
    q, k, v, g, beta = problem(b, t, h, hv, seed=t + hv)
    got = factors_model(q, k, v, g, beta, torch.float64)
    want = expected(q, k, v, g, beta, torch.float64)
    assert tuple(got) == NAMES == tuple(want)
    nc = -(-t // CHUNK)
    for name in NAMES:
        a, r = got[name], want[name]
        assert a.shape == r.shape and a.dtype == r.dtype, name
        rows = nc * CHUNK
        assert a.shape[:3] == ((b, nc, hv) if name == "e_last" else (b, rows, hv)), name
        err = float((a - r).abs().max())
        assert err <= 1e-9 * max(1.0, float(r.abs().max())), (name, err)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "h", "hv"), [(1, 65, 2, 4), (2, 200, 1, 2)])
def test_rounded_model_within_the_gpu_tolerance(b, t, h, hv, dtype):
    """16-bit q, k, v in, 16-bit tiles out, T diag(.) rounded as the kernel's A operands,
    T by the forward's tf32 blocked inverse: every tile within TOL of its max of the fp64
    factors of the same 16-bit inputs."""
    q, k, v, g, beta = problem(b, t, h, hv, dk=128, dv=128, seed=t, dtype=dtype)
    g, beta = g.float(), beta.float()

    def tf32_inverse(lower):
        strict = (lower - torch.eye(CHUNK, dtype=lower.dtype)).float()
        flat = strict.reshape(-1, CHUNK, CHUNK)
        out = torch.stack([blocked_inverse(x.clone()) for x in flat])
        return out.reshape(strict.shape).to(lower.dtype)

    got = factors_model(q, k, v, g, beta, dtype, rounding_to(dtype), tf32_inverse)
    want = expected(q, k, v, g, beta, torch.float64)
    for name in NAMES:
        a, r = got[name].double(), want[name]
        assert got[name].dtype == (torch.float32 if name in ("e_last", "big_g") else dtype)
        err = float((a - r).abs().max())
        assert err <= TOL * float(r.abs().max()) + 1e-6, (name, err, float(r.abs().max()))


@pytest.mark.parametrize("t", [1, 64, 130])
def test_layouts_are_what_kernels_1_and_2_read(t):
    """The outputs are the existing torch path's tiles: kernel 1's reverse launch
    (`batched_state_pass_factors`), its forward launch (`forward_state_tiles`), kernel 2's WY
    tiles (w, u, T^T cut to T tokens) and G."""
    b, h, hv = 2, 1, 2
    q, k, v, g, beta = problem(b, t, h, hv, seed=3)
    got = factors_model(q, k, v, g, beta, torch.float64)
    qs, ks = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
    rev = batched_state_pass_factors(qs, ks, v, g, beta, scale=1.0, dtype=torch.float64)
    for name in ("pt", "ke", "qe", "w"):
        torch.testing.assert_close(got[name][:, :t], rev[name], rtol=1e-10, atol=1e-12)
        assert not got[name][:, t:].any(), name  # padded rows zero
    torch.testing.assert_close(got["e_last"], rev["e_last"], rtol=1e-10, atol=1e-12)
    fw = forward_state_tiles(chunk_factors(qs, ks, v, g, beta), torch.float64)
    launch = forward_launch_tiles(got)  # the reverse variant's: u, I, -W, 0, -Ke reversed
    assert tuple(launch) == ("do", "pt", "ke", "qe", "w", "e_last")
    for name in launch:
        want = fw[name].float() if name == "e_last" else fw[name]
        torch.testing.assert_close(launch[name], want, rtol=1e-6, atol=1e-12)
        assert launch[name].is_contiguous(), name
    # the `forward` variant's: kernel 0's tiles as written (no copy), I and 0 built in
    direct = forward_launch_tiles(got, identity=False)
    for name, key in (("do", "u"), ("ke", "w"), ("w", "ke")):
        assert direct[name].data_ptr() == got[key].data_ptr(), name
    assert direct["pt"] is None and direct["qe"] is None
    assert torch.equal(direct["e_last"], got["e_last"].float())  # fp32 (the kernel's: as is)
    nc = -(-t // CHUNK)
    wide_g = torch.zeros(b, nc * CHUNK, hv, dtype=torch.float64)
    wide_g[:, :t] = g
    chunk_g = wide_g.unflatten(1, (nc, CHUNK)).cumsum(2).flatten(1, 2)
    k2 = for_kernel2(got, t)
    torch.testing.assert_close(k2["big_g"], chunk_g[:, :t], rtol=1e-12, atol=1e-12)
    assert k2["w"].shape == (b, t, hv, q.shape[-1]) and k2["tt"].shape == (b, t, hv, CHUNK)


def test_launcher_checks():
    from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.launch import check_inputs

    q, k, v = (torch.zeros(1, 70, 2, 128, dtype=torch.bfloat16) for _ in range(3))
    g, beta = torch.zeros(1, 70, 2), torch.zeros(1, 70, 2)
    assert check_inputs(q, k, v, g, beta) == (1, 70, 2, 2)
    with pytest.raises(TypeError, match="k must be"):
        check_inputs(q, k.half(), v, g, beta)
    with pytest.raises(ValueError, match="v must be"):
        check_inputs(q, k, v[:, :, :1].repeat(1, 1, 3, 1), g, beta)
    with pytest.raises(ValueError, match="g must be"):
        check_inputs(q, k, v, g[:, :5], beta)
    with pytest.raises(TypeError, match="beta must be"):
        check_inputs(q, k, v, g, beta.double())
    with pytest.raises(ValueError, match="K, V"):
        check_inputs(q[..., :64], k[..., :64], v, g, beta)


@pytest.mark.parametrize("valid", [0, 1, 37, 63])
def test_rows_past_valid_reach_only_pt_ke_qe(valid):
    """The mask list of the varlen-native plan's kernel 0 (NOTES "next/varlen-native-plan"
    section 2, GDN kernel 0): a chunk whose TMA box reads the next sequence's rows past `valid`
    (finite garbage, here 1e4-scale; the gate warp's g = beta = 0 there) gives bit for bit the
    zero-padded chunk's W, u, T^T, e^(G_C) and G; only P^T (P's rows past valid), Ke and Qe
    (their rows past valid) differ, and equal it once those are zeroed."""
    b, t, h, hv = 1, CHUNK, 2, 4
    q, k, v, g, beta = problem(b, t, h, hv, dk=128, dv=128, seed=3, dtype=torch.float32)
    g, beta = g.clone(), beta.clone()
    g[:, valid:] = 0
    beta[:, valid:] = 0
    gen = torch.Generator().manual_seed(4)
    padded, garbage = [], []
    for x in (q, k, v):
        z, y = x.clone(), x.clone()
        z[:, valid:] = 0
        y[:, valid:] = 1e4 * torch.randn(y[:, valid:].shape, generator=gen, dtype=y.dtype)
        padded.append(z)
        garbage.append(y)
    want = factors_model(*padded, g, beta, torch.float32)
    got = factors_model(*garbage, g, beta, torch.float32)
    for name in NAMES:
        if name not in ("pt", "ke", "qe"):
            assert torch.equal(got[name], want[name]), name
    masked = {n: got[n].clone() for n in ("pt", "ke", "qe")}
    masked["pt"][..., valid:] = 0  # row j of pt is column j of P
    masked["ke"][:, valid:] = 0
    masked["qe"][:, valid:] = 0
    for name, x in masked.items():
        assert torch.equal(x, want[name]), name
        assert valid == CHUNK or not torch.equal(got[name], want[name]), name
