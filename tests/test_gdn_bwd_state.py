"""The Gated DeltaNet backward's kernel 1 (reverse state recurrence) on the CPU: its model
(reference/gdn_bwd_state.py) against the full chunked backward and against a tile-level
emulation of the kernel (token-major tiles, dS^T with value rows leading, the 16-bit operands
rounded where the kernel rounds them), the launcher's input checks. The compile and its
resources: tests/test_gdn_bwd_state_compile.py; the kernel on the GPU:
tests/gpu/test_gdn_bwd_state_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule_bwd import gated_delta_rule_chunked_backward
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    corrected_values,
    reverse_state_pass,
    state_pass_factors,
)

launch = pytest.importorskip("forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.launch")


def _inputs(b, t, h, dk=16, dv=8, seed=0, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rnd(b, t, h, dk), F.normalize(rnd(b, t, h, dk), dim=-1)
    v, do = rnd(b, t, h, dv), rnd(b, t, h, dv)
    g, beta = F.logsigmoid(rnd(b, t, h) + 2.0), torch.sigmoid(rnd(b, t, h))
    return q, k, v, g, beta, do, rnd(b, h, dk, dv)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("with_dht", [False, True])
def test_model_matches_the_chunked_backward(t, b, with_dht):
    """dh0 of the model's pass is the full reference's initial-state gradient; dh's last chunk
    is the final state's gradient (transposed), every chunk's dh finite."""
    q, k, v, g, beta, do, dht = _inputs(b, t, 2)
    dht = dht if with_dht else None
    factors = state_pass_factors(q, k, v, g, beta, dtype=torch.float64)
    du, dh, dh0 = reverse_state_pass(factors, do, dht)
    *_, want = gated_delta_rule_chunked_backward(q, k, v, g, beta, do, d_final_state=dht,
                                                 dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(dh0, want, rtol=1e-10, atol=1e-10)
    last = torch.zeros_like(dh0) if dht is None else dht
    torch.testing.assert_close(dh[:, -1], last.transpose(-1, -2), rtol=0, atol=0)
    assert du.shape == do.shape and dh.shape == (b, -(-t // CHUNK), 2, 8, 16)
    assert torch.isfinite(du).all() and torch.isfinite(dh).all()


def test_dke_is_the_reference_pass_3_term():
    """The dke variant's output is pass 3's d(k e^(G_C - G)) = U dh^T (`_output_grads`'s
    `dke`) from the dh variant's chunk-end gradients: one sequence of 130 tokens (a tail
    chunk), an initial state."""
    q, k, v, g, beta, do, dht = _inputs(1, 130, 2)
    factors = state_pass_factors(q, k, v, g, beta, dtype=torch.float64)
    u = corrected_values(q, k, v, g, beta, dht, dtype=torch.float64)
    _, dke, _ = reverse_state_pass(factors, do, dht, u)
    _, dh, _ = reverse_state_pass(factors, do, dht)
    nc = dh.shape[1]
    ut = _tiles(u, nc)[0]  # (HV, NC, C, V)
    want = (ut @ dh[0].transpose(0, 1)).flatten(1, 2)[:, :130].transpose(0, 1)
    torch.testing.assert_close(dke[0], want, rtol=1e-12, atol=1e-12)


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(torch.bfloat16).to(x.dtype)


def _tiles(x: torch.Tensor, nc: int) -> torch.Tensor:
    """(B, T, HV, D) -> (B, HV, NC, C, D), zero rows past T (the kernel's TMA zero fill)."""
    pad = nc * CHUNK - x.shape[1]
    return F.pad(x, (0, 0, 0, 0, 0, pad)).transpose(1, 2).unflatten(2, (nc, CHUNK))


def tile_model(factors, do, dht, rounding=_bf16, u=None):
    """The kernel's per-(sequence, head) loop on token-major tiles, last chunk first: dU^T =
    dS^T Ke^T + dO^T P, dS^T <- e^(G_C) dS^T + dO^T Qe - dU^T W, the register A operands
    (dS^T, -dU^T) rounded by `rounding` as the kernel rounds them to 16 bits; given U, dke =
    U dS^T (dS^T rounded: it goes through shared memory in 16 bits) in dh's place."""
    b, t, hv, dv = do.shape
    dk = factors["ke"].shape[-1]
    nc = -(-t // CHUNK)
    ke, qe, w, pt, dot = (_tiles(x, nc) for x in (factors["ke"], factors["qe"], factors["w"],
                                                  factors["pt"], do))  # fmt: skip
    dst = do.new_zeros(b, hv, dv, dk) if dht is None else dht.transpose(-1, -2).clone()
    du = do.new_zeros(b, hv, nc, CHUNK, dv)
    dh = do.new_zeros(b, nc, hv, dv, dk)
    ut = None if u is None else _tiles(u, nc)
    dke = do.new_zeros(b, hv, nc, CHUNK, dk)
    for c in reversed(range(nc)):
        dh[:, c] = dst
        if ut is not None:
            dke[:, :, c] = ut[:, :, c] @ rounding(dst)
        do_t = dot[:, :, c].transpose(-1, -2)  # (B, HV, V, C)
        du_t = rounding(dst) @ ke[:, :, c].transpose(-1, -2) + do_t @ pt[:, :, c].transpose(-1, -2)
        du[:, :, c] = du_t.transpose(-1, -2)
        el = factors["e_last"][:, c, :, None, None]
        dst = el * dst + do_t @ qe[:, :, c] + rounding(-du_t) @ w[:, :, c]
    du = du.flatten(2, 3)[:, :, :t].transpose(1, 2)
    if ut is not None:
        dh = dke.flatten(2, 3)[:, :, :t].transpose(1, 2)
    return du, dh, dst.transpose(-1, -2)


@pytest.mark.parametrize("t", [1, 65, 200])
@pytest.mark.parametrize("with_dht", [False, True])
@pytest.mark.parametrize("dke", [False, True])
def test_tile_model_matches_the_model(t, with_dht, dke):
    """Unrounded, the kernel's token-major transposed form is the reference's pass exactly
    (the factors' layouts: P^T rows, e^(G_C) per chunk, the zero tail; dke per token from the
    dS of its chunk's end); with bf16 operands the error stays within the GPU test's
    tolerance."""
    q, k, v, g, beta, do, dht = _inputs(2, t, 3)
    dht = dht if with_dht else None
    factors = state_pass_factors(q, k, v, g, beta, dtype=torch.float64)
    u = corrected_values(q, k, v, g, beta, dht, dtype=torch.float64) if dke else None
    want = reverse_state_pass(factors, do, dht, u)
    exact = tile_model(factors, do, dht, rounding=lambda x: x, u=u)
    for got, ref in zip(exact, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for got, ref in zip(tile_model(factors, do, dht, u=u), want):
        assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max()) + 1e-6


def _bf16_inputs(b=1, t=65, hv=2):
    do = torch.zeros(b, t, hv, 128, dtype=torch.bfloat16)
    k128 = torch.zeros(b, t, hv, 128, dtype=torch.bfloat16)
    pt = torch.zeros(b, t, hv, CHUNK, dtype=torch.bfloat16)
    e_last = torch.ones(b, -(-t // CHUNK), hv)
    return do, pt, k128, k128.clone(), k128.clone(), e_last


def test_launcher_checks_inputs():
    do, pt, ke, qe, w, e_last = _bf16_inputs()
    assert launch.check_inputs(do, pt, ke, qe, w, e_last, None) == (1, 65, 2, 2)
    with pytest.raises(ValueError, match="pt must be"):
        launch.check_inputs(do, pt[:, :64], ke, qe, w, e_last, None)
    with pytest.raises(TypeError, match="qe must be"):
        launch.check_inputs(do, pt, ke, qe.half(), w, e_last, None)
    with pytest.raises(ValueError, match="e_last must be"):
        launch.check_inputs(do, pt, ke, qe, w, e_last[:, :1], None)
    with pytest.raises(ValueError, match="d_final_state must be"):
        launch.check_inputs(do, pt, ke, qe, w, e_last, torch.zeros(1, 2, 128, 64))
    with pytest.raises(ValueError, match=r"\(K, V\)"):
        launch.check_inputs(do[..., :64], pt, ke, qe, w, e_last, None)


def test_launcher_empty_sequences_pass_the_state_gradient():
    """T = 0 launches nothing: the initial state's gradient is the final state's."""
    do, pt, ke, qe, w, _ = (x[:, :0] for x in _bf16_inputs())
    dht = torch.randn(1, 2, 128, 128)
    du, dh, dh0 = launch.gdn_bwd_state(do, pt, ke, qe, w, torch.ones(1, 0, 2), dht)
    assert du.shape == (1, 0, 2, 128) and dh.shape == (1, 0, 2, 128, 128)
    torch.testing.assert_close(dh0, dht, rtol=0, atol=0)


@pytest.mark.parametrize("dke", [False, True])
@pytest.mark.parametrize("with_dht", [False, True])
def test_launcher_passes_the_compiled_signature(monkeypatch, dke, with_dht):
    """The call the launcher makes is the one compile.py declares: (dO, P^T, Ke, Qe, W, U or
    None, e^(G_C), dS_T or None, dU, dh or None, dke or None, dh0), under the compile key of
    the inputs (a recorder stands in for the kernel)."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(2, 130, 3)
    u = torch.zeros_like(do) if dke else None
    dht = torch.zeros(2, 3, 128, 128) if with_dht else None
    du, side, dh0 = launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, dht, u)
    (params, args), = calls
    assert dict(params) == {"dtype": "bfloat16", "k": 128, "v": 128, "d_final_state": with_dht,
                            "dke": dke}  # fmt: skip
    assert side.shape == ((2, 130, 3, 128) if dke else (2, 3, 3, 128, 128))
    want = (do, pt, ke, qe, w, u, e_last, dht, du, None if dke else side,
            side if dke else None, dh0)  # fmt: skip
    assert len(args) == len(want)
    for got, ref in zip(args, want):
        assert got is ref or (got is not None and ref is not None and torch.equal(got, ref))
