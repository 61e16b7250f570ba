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
    batched_state_pass_factors,
    corrected_values,
    cut,
    reverse_state_pass,
    state_pass_factors,
)
from forgekernel.reference.kda_bwd import _Factors as KdaFactors
from forgekernel.reference.kda_bwd import kimi_delta_attention_chunked_backward

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
    dS^T Ke^T + dO^T P, dS^T <- e^(G_C) dS^T + dO^T Qe - dU^T W (per key channel: dS^T's
    columns scaled, the `channel_decay` variant, e_last (B, NC, HV, K)), the register A operands
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
        el = factors["e_last"][:, c]  # (B, HV) or per key channel (B, HV, K): dS^T's columns
        el = el[..., None, None] if el.dim() == 2 else el[:, :, None, :]
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
    None, e^(G_C), dS_T or None, dU, dh or None, dke or None, dh0, cu_seqlens and the order or
    None: the varlen form's, G or None: the fused form's, beta or None: the w_from_t form's),
    under the compile key of the inputs (a recorder stands in for the kernel)."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(2, 130, 3)
    u = torch.zeros_like(do) if dke else None
    dht = torch.zeros(2, 3, 128, 128) if with_dht else None
    du, side, dh0 = launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, dht, u)
    ((params, args),) = calls
    assert dict(params) == {"dtype": "bfloat16", "k": 128, "v": 128, "d_final_state": with_dht,
                            "dke": dke}  # fmt: skip
    assert side.shape == ((2, 130, 3, 128) if dke else (2, 3, 3, 128, 128))
    want = (do, pt, ke, qe, w, u, e_last, dht, du, None if dke else side,
            side if dke else None, dh0, None, None, None, None)  # fmt: skip
    assert len(args) == len(want)
    for got, ref in zip(args, want):
        assert got is ref or (got is not None and ref is not None and torch.equal(got, ref))


@pytest.mark.parametrize("forward", [False, True])
@pytest.mark.parametrize("with_dht", [False, True])
def test_launcher_out16_signature(monkeypatch, forward, with_dht):
    """`out16` (and `forward`): dU (B, T, HV, V) and dS (B, NC, HV, K, V) in do's dtype, dh0
    fp32, the key naming the flags (and nothing new without them), pt and qe None with
    `forward` (I and 0 built in); the flags' combinations checked."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(2, 130, 3)
    dht = torch.zeros(2, 3, 128, 128) if with_dht else None
    tiles = (None, ke, None, w) if forward else (pt, ke, qe, w)
    du, ds, dh0 = launch.gdn_bwd_state(do, *tiles, e_last, dht, out16=True, forward=forward)
    ((params, args),) = calls
    want_key = {"dtype": "bfloat16", "k": 128, "v": 128, "d_final_state": with_dht,
                "dke": False, "out16": True}  # fmt: skip
    if forward:
        want_key["forward"] = True
    assert dict(params) == want_key
    assert du.dtype == ds.dtype == torch.bfloat16 and dh0.dtype == torch.float32
    assert du.shape == (2, 130, 3, 128) and ds.shape == (2, 3, 3, 128, 128)
    want = (do, *tiles, None, e_last, dht, du, ds, None, dh0, None, None, None, None)
    assert len(args) == len(want)
    for got, ref in zip(args, want):
        assert got is ref or (got is not None and ref is not None and torch.equal(got, ref))
    with pytest.raises(ValueError, match="forward needs out16"):
        launch.gdn_bwd_state(do, None, ke, None, w, e_last, forward=True)
    with pytest.raises(ValueError, match="out16 excludes u"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, None, do, out16=True)
    with pytest.raises(ValueError, match="exactly when forward"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, out16=True, forward=True)
    with pytest.raises(ValueError, match="contiguous tensors of dtypes"):
        fp32 = launch.empty_outputs(do, 128)
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, out16=True, out=fp32)


@pytest.mark.parametrize("with_dht", [False, True])
def test_launcher_fused_signature(monkeypatch, with_dht):
    """The `fused` forward launch (ops/gated_delta_rule_bwd.py FUSED_DIET): big_g given, w is k
    at its own H heads and rows (T' <= T), G (B, T, HV) passed last, `fused` in the key, no dU
    allocated or passed (None returned in its place); the checks: forward only, k's shape and
    dtype, G's."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(2, 192, 4)
    k = torch.randn(2, 130, 2, 128).bfloat16()  # T' = 130 of 192 rows, H = 2 of HV = 4
    big_g = torch.randn(2, 192, 4)
    dht = torch.zeros(2, 4, 128, 128) if with_dht else None
    du, ds, dh0 = launch.gdn_bwd_state(do, None, ke, None, k, e_last, dht, out16=True,
                                       forward=True, big_g=big_g)  # fmt: skip
    ((params, args),) = calls
    assert dict(params)["fused"] is True and dict(params)["forward"] is True
    assert dict(params)["d_final_state"] is with_dht
    assert du is None and ds.shape == (2, 3, 4, 128, 128) and dh0.shape == (2, 4, 128, 128)
    assert args[4] is k and args[-2] is big_g and args[8] is None and args[9] is ds
    assert args[-1] is None  # beta: the w_from_t form's
    with pytest.raises(ValueError, match="batch forward launch's"):
        launch.gdn_bwd_state(do, pt, ke, qe, k, e_last, out16=True, big_g=big_g)
    with pytest.raises(ValueError, match="k must be"):
        launch.gdn_bwd_state(do, None, ke, None, k[:, :, :1].expand(-1, -1, 3, -1), e_last,
                             out16=True, forward=True, big_g=big_g)  # fmt: skip
    with pytest.raises(TypeError, match="k must be"):
        launch.gdn_bwd_state(do, None, ke, None, k.half(), e_last, out16=True, forward=True,
                             big_g=big_g)  # fmt: skip
    with pytest.raises(ValueError, match="big_g must be"):
        launch.gdn_bwd_state(do, None, ke, None, k, e_last, out16=True, forward=True,
                             big_g=big_g[:, :130])  # fmt: skip


@pytest.mark.parametrize("with_dht", [False, True])
def test_launcher_w_from_t_signature(monkeypatch, with_dht):
    """The `w_from_t` forward launch (ops/gated_delta_rule_bwd.py FUSED_WFROMT): beta given
    with big_g; do is v (T rows), pt kernel 0's T^T cut to T, ke None, w is k; G (B, NC C, HV)
    and beta (fp32, as the kernel reads it) passed last, `fused` and `w_from_t` in the key, no
    dU; the checks: big_g's rows (every chunk's), pt given and ke None, beta's shape."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    v, tt, _, _, _, e_last = _bf16_inputs(2, 130, 4)
    k = torch.randn(2, 130, 2, 128).bfloat16()  # H = 2 of HV = 4
    big_g = torch.randn(2, 192, 4)
    beta = torch.rand(2, 130, 4).bfloat16()
    dht = torch.zeros(2, 4, 128, 128) if with_dht else None
    du, ds, dh0 = launch.gdn_bwd_state(v, tt, None, None, k, e_last, dht, out16=True,
                                       forward=True, big_g=big_g, beta=beta)  # fmt: skip
    ((params, args),) = calls
    key = dict(params)
    assert key["fused"] is key["w_from_t"] is key["forward"] is True
    assert key["d_final_state"] is with_dht
    assert du is None and ds.shape == (2, 3, 4, 128, 128) and dh0.shape == (2, 4, 128, 128)
    assert args[0] is v and args[1] is tt and args[2] is None and args[4] is k
    assert args[-2] is big_g and args[-1].dtype == torch.float32
    assert torch.equal(args[-1], beta.float())
    with pytest.raises(ValueError, match="big_g must be"):
        launch.gdn_bwd_state(v, tt, None, None, k, e_last, out16=True, forward=True,
                             big_g=big_g[:, :130], beta=beta)  # fmt: skip
    with pytest.raises(ValueError, match="needs big_g and pt"):
        launch.gdn_bwd_state(v, None, None, None, k, e_last, out16=True, forward=True,
                             big_g=big_g, beta=beta)  # fmt: skip
    with pytest.raises(ValueError, match="beta must be"):
        launch.gdn_bwd_state(v, tt, None, None, k, e_last, out16=True, forward=True,
                             big_g=big_g, beta=beta[:, :64])  # fmt: skip
    with pytest.raises(ValueError, match="w_from_t needs fused"):
        launch.params_for("bfloat16", out16=True, forward=True, w_from_t=True)


@pytest.mark.parametrize("forward", [False, True])
def test_launcher_varlen_signature(monkeypatch, forward):
    """The varlen form (ops/_linattn_varlen.py's slot layout): tiles (1, 64 S, HV, ...), the
    states and dh0 (N, HV, K, V), cu_seqlens and the order passed last, `varlen` in the key; the
    checks: both tables or neither, out16 only, int32 of N + 1 and N, S >= N."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(1, 4 * 64, 3)
    cu = torch.tensor([0, 70, 70, 130], dtype=torch.int32)  # S = 130 // 64 + 3 = 5 > 4: fine
    order = torch.tensor([0, 2, 1], dtype=torch.int32)
    dht = torch.zeros(3, 3, 128, 128)
    tiles = (None, ke, None, w) if forward else (pt, ke, qe, w)
    du, ds, dh0 = launch.gdn_bwd_state(do, *tiles, e_last, dht, out16=True, forward=forward,
                                       cu_seqlens=cu, order=order)  # fmt: skip
    ((params, args),) = calls
    assert dict(params)["varlen"] is True and dict(params)["d_final_state"] is True
    assert du.shape == (1, 256, 3, 128) and ds.shape == (1, 4, 3, 128, 128)
    assert dh0.shape == (3, 3, 128, 128)
    assert args[-4] is cu and args[-3] is order and args[-5] is dh0 and args[7] is dht
    assert args[-2] is None and args[-1] is None  # G, beta: the fused forms
    with pytest.raises(ValueError, match="come together"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, out16=True, cu_seqlens=cu)
    with pytest.raises(ValueError, match="out16's"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, cu_seqlens=cu, order=order)
    with pytest.raises(ValueError, match="order must be a contiguous int32"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, out16=True, cu_seqlens=cu,
                             order=order.long())  # fmt: skip
    with pytest.raises(ValueError, match="d_final_state must be float32"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, dht[:1], out16=True, cu_seqlens=cu,
                             order=order)  # fmt: skip
    many = torch.arange(6, dtype=torch.int32)  # 5 sequences in 4 slots
    with pytest.raises(ValueError, match="cannot hold 5 sequences"):
        launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, out16=True, cu_seqlens=many,
                             order=many[:5])  # fmt: skip
    with pytest.raises(ValueError, match="varlen tiles must be"):
        launch.gdn_bwd_state(do[:, :200], pt[:, :200], ke[:, :200], qe[:, :200], w[:, :200],
                             e_last, out16=True, cu_seqlens=cu, order=order)  # fmt: skip


# ---- per key channel (Kimi Delta Attention: the `channel_decay` variant) ----------------------


def _kda_inputs(b, t, h, dk=16, dv=8, seed=0, strong=False):
    """KDA's inputs: g (B, T, HV, K) per key channel, in [-5, -4] when `strong` (where a naive
    e^(-G) split overflows), else logsigmoid(N(2, 1))."""
    q, k, v, _, beta, do, dht = _inputs(b, t, h, dk, dv, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    if strong:
        g = -4.0 - torch.rand(b, t, h, dk, generator=gen, dtype=torch.float64)
    else:
        g = F.logsigmoid(torch.randn(b, t, h, dk, generator=gen, dtype=torch.float64) + 2.0)
    return q, k, v, g, beta, do, dht


def _kda_factors(q, k, v, g, beta, dtype=torch.float64):
    return batched_state_pass_factors(q, k, v, g, beta, dtype=dtype, factors=KdaFactors)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize(("with_dht", "strong"), [(False, False), (True, False), (True, True)])
def test_channel_model_matches_the_kda_backward(t, b, with_dht, strong):
    """KDA's factors through the model's pass (e^(G_C) (B, NC, HV, K) scaling dS's rows): dh0
    is reference/kda_bwd.py's initial-state gradient to 1e-10 in fp64, g in [-5, -4] a step
    included; dh's last chunk is the final state's gradient."""
    q, k, v, g, beta, do, dht = _kda_inputs(b, t, 2, seed=t + b, strong=strong)
    dht = dht if with_dht else None
    factors = _kda_factors(q, k, v, g, beta)
    assert factors["e_last"].shape == (b, -(-t // CHUNK), 2, 16)
    du, dh, dh0 = reverse_state_pass(factors, do, dht)
    *_, want = kimi_delta_attention_chunked_backward(q, k, v, g, beta, do, d_final_state=dht,
                                                     dtype=torch.float64)  # fmt: skip
    torch.testing.assert_close(dh0, want, rtol=1e-10, atol=1e-10)
    last = torch.zeros_like(dh0) if dht is None else dht
    torch.testing.assert_close(dh[:, -1], last.transpose(-1, -2), rtol=0, atol=0)
    assert torch.isfinite(du).all() and torch.isfinite(dh).all()


def test_channel_model_is_the_scalar_one_for_equal_channels():
    """A per-channel e^(G_C) equal across channels is Gated DeltaNet's scalar one: the same
    outputs bitwise."""
    q, k, v, g, beta, do, dht = _inputs(2, 130, 3)
    factors = state_pass_factors(q, k, v, g, beta, dtype=torch.float64)
    wide = dict(factors, e_last=factors["e_last"].unsqueeze(-1).expand(-1, -1, -1, 16))
    for got, want in zip(reverse_state_pass(wide, do, dht), reverse_state_pass(factors, do, dht)):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("t", [1, 65, 200])
@pytest.mark.parametrize(("with_dht", "strong"), [(False, False), (True, False), (True, True)])
def test_channel_tile_model_matches_the_model(t, with_dht, strong):
    """The kernel's tile loop with dS^T's columns scaled per key channel equals the model
    exactly unrounded, and stays within the GPU test's tolerance with bf16 operands."""
    q, k, v, g, beta, do, dht = _kda_inputs(2, t, 3, seed=t, strong=strong)
    dht = dht if with_dht else None
    factors = _kda_factors(q, k, v, g, beta)
    want = reverse_state_pass(factors, do, dht)
    exact = tile_model(factors, do, dht, rounding=lambda x: x)
    for got, ref in zip(exact, want):
        torch.testing.assert_close(got, ref, rtol=1e-10, atol=1e-10)
    for got, ref in zip(tile_model(factors, do, dht), want):
        assert float((got - ref).abs().max()) <= 2e-2 * float(ref.abs().max()) + 1e-6


def test_channel_tile_model_rounded_at_the_kernel_size():
    """K = V = 128, T = 1000, the factor tiles in bf16 as the launcher takes them: the rounded
    emulation's error against the fp64 model on the same bf16 tiles (the GPU test's bound:
    1e-2 of each output's max)."""
    q, k, v, g, beta, do, dht = _kda_inputs(1, 1000, 2, dk=128, dv=128, seed=5)
    factors = _kda_factors(q, k, v, g, beta)
    tiles = {n: x if n == "e_last" else _bf16(x) for n, x in factors.items()}
    do = _bf16(do)
    want = reverse_state_pass(tiles, do, dht)
    for got, ref in zip(tile_model(tiles, do, dht), want):
        assert float((got - ref).abs().max()) <= 1e-2 * float(ref.abs().max())


def test_launcher_checks_the_channel_decay():
    do, pt, ke, qe, w, e_last = _bf16_inputs()
    wide = e_last.unsqueeze(-1).expand(-1, -1, -1, 128).contiguous()
    assert launch.check_inputs(do, pt, ke, qe, w, wide, None) == (1, 65, 2, 2)
    with pytest.raises(ValueError, match=r"e_last must be .*one a key channel"):
        launch.check_inputs(do, pt, ke, qe, w, wide[..., :64], None)
    with pytest.raises(ValueError, match="e_last must be"):
        launch.check_inputs(do, pt, ke, qe, w, wide.double(), None)


@pytest.mark.parametrize("with_dht", [False, True])
def test_launcher_passes_the_channel_decay_signature(monkeypatch, with_dht):
    """e^(G_C) (B, NC, HV, K) selects the `channel_decay` kernel (the key names it; Gated
    DeltaNet's keys do not) and goes to it in the scalar one's place."""
    calls = []
    monkeypatch.setattr(launch, "get_kernel",
                        lambda spec, params: lambda *a: calls.append((params, a)))  # fmt: skip
    do, pt, ke, qe, w, e_last = _bf16_inputs(2, 130, 3)
    wide = e_last.unsqueeze(-1).expand(-1, -1, -1, 128).contiguous()
    dht = torch.zeros(2, 3, 128, 128) if with_dht else None
    du, dh, dh0 = launch.gdn_bwd_state(do, pt, ke, qe, w, wide, dht)
    ((params, args),) = calls
    assert dict(params) == {"dtype": "bfloat16", "k": 128, "v": 128, "d_final_state": with_dht,
                            "dke": False, "channel_decay": True}  # fmt: skip
    assert args[6] is wide and dh.shape == (2, 3, 3, 128, 128)


@pytest.mark.parametrize("dim, part", [(1, slice(None, 7)), (1, slice(None, 64)),
                                       (1, slice(None, 100)), (2, slice(0, 3)), (2, slice(2, 3)),
                                       (2, slice(1, 9)), (2, slice(0, 2))])  # fmt: skip
def test_cut_is_the_slice_or_the_tensor_itself(dim, part):
    """`cut` (the ops' x[:, :t] / x[:, :, heads]): the slice's elements, sizes, strides and
    storage offset, and x itself (no view op) where the part is all of dim."""
    x = torch.randn(2, 64, 3, 5)[:, :, :, 1:]  # strided, as the ops' head slices are
    index = (slice(None),) * dim + (part,)
    got, want = cut(x, dim, part), x[index]
    assert got.shape == want.shape and got.stride() == want.stride()
    assert got.data_ptr() == want.data_ptr() and torch.equal(got, want)
    assert (got is x) == (want.shape == x.shape)
