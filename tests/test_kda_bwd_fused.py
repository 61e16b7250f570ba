"""Kimi Delta Attention's fused backward kernel (kernels/linear_attention/kda_bwd_fused/sm90:
kernel 2's products, then the WY kernel's, one launch) on the CPU: its model is kernel 2's and
the WY kernel's chained (`reference.kda_bwd_fused`); the op's switch (ops/kda_bwd.py FUSED, off;
FUSED_SWITCH for the GPU checks) sends the device pass to `_fused_grads`, and with the two
kernels' emulations chained there every gradient is the two-launch path's bit for bit (the
arguments, dtypes and out= buffers the fused entry gets are the ones the two launches get):
the bench's form (no l2norm, H = HV: dk16, out=), grouped heads with l2norm, FINAL_QK's dq16,
the varlen slot layout with its token rows; the launcher's checks."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from test_kda_bwd_kernel_path import (
    TOKEN_ROWS,
    _bf16_problem,
    emulated_chunk_kernel,
    emulated_wy_kernel,
    kernel_path,  # noqa: F401  (the fixture)
)
from test_kda_bwd_op import cpu_forward  # noqa: F401  (the fixture kernel_path asks for)

from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90 import launch
from forgekernel.reference.kda_bwd_chunk import chunk_grads_model
from forgekernel.reference.kda_bwd_fused import fused_grads_model
from forgekernel.reference.kda_bwd_wy import wy_grads_model

bwd = importlib.import_module("forgekernel.ops.kda_bwd")
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def emulated_fused_kernel(calls):
    """The fused kernel's stand-in: kernel 2's emulation (dw16), then the WY kernel's on its dw
    and onto its dk, dG (tests/test_kda_bwd_kernel_path.py's), as the kernel runs the two."""
    chunk, wy = emulated_chunk_kernel(), emulated_wy_kernel()

    def run(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, dg=None, dq16=False, scale=1.0,
            dq=None, dv16=False, dk16=False, dk_out=None, dv=None, dbeta=None, tables=None,
            tokens=None):  # fmt: skip
        calls.append(("fused", dq16, dv16, dk16, tables is not None))
        rows = {"tables": tables, "tokens": tokens}
        fold = {"dq16": True, "scale": scale, "dq": dq} if dq16 else {}
        dq, dk, dw, dg = chunk(do, u, du, q, k, h, dh, big_g, dw16=True, dg=dg, **fold, **rows)
        dk, dv, dg, dbeta = wy(dw, du, tt, w, k, uw, v, beta, big_g, dk, dg, dv16=dv16,
                               dk16=dk16, dk_out=dk_out, dv=dv, dbeta=dbeta, **rows)  # fmt: skip
        return dq, dk, dv, dg, dbeta

    return run


def _counting(fn, calls, name):
    def run(*args, **kwargs):
        calls.append(name)
        return fn(*args, **kwargs)

    return run


def test_the_switch(monkeypatch):
    """Off by default (FUSED False, FUSED_SWITCH unset); "1" on, "0" off, whatever FUSED says."""
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    assert bwd.FUSED is False and not bwd._fused_on()
    monkeypatch.setenv(bwd.FUSED_SWITCH, "1")
    assert bwd._fused_on()
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setenv(bwd.FUSED_SWITCH, "0")
    assert not bwd._fused_on()
    monkeypatch.delenv(bwd.FUSED_SWITCH)
    assert bwd._fused_on()


def _both_paths(monkeypatch, call):
    """call() with the switch off, then on (the fused stand-in); the launches each made."""
    calls = {}
    for mode in ("0", "1"):
        seen = []
        monkeypatch.setenv(bwd.FUSED_SWITCH, mode)
        monkeypatch.setattr(bwd, "_fused_grads", emulated_fused_kernel(seen))
        monkeypatch.setattr(bwd, "_chunk_grads",
                            _counting(emulated_chunk_kernel(), seen, "chunk"))  # fmt: skip
        monkeypatch.setattr(bwd, "_wy_kernel", _counting(emulated_wy_kernel(), seen, "wy"))
        calls[mode] = (call(), seen)
    return calls


def _same(got, want):
    for name, a, r in zip(NAMES, got, want):
        assert torch.isfinite(r).all(), name
        assert a.shape == r.shape and a.dtype == r.dtype and torch.equal(a, r), name


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm", "final_qk", "decay"), [
    (2, 65, 2, 2, False, False, (-1.0, 0.0)),  # the bench's form: dk16, dv16, into out=
    (1, 130, 1, 2, True, False, (-5.0, -4.0)),  # grouped, l2norm: the epilogue, fp32 dk
    (2, 64, 1, 1, False, True, (-1.0, 0.0)),  # FINAL_QK: dq16 too
])  # fmt: skip
@pytest.mark.usefixtures("kernel_path")
def test_the_fused_path_is_the_two_kernel_path(monkeypatch, b, t, h, hv, l2norm, final_qk,
                                               decay):  # fmt: skip
    """The op with the switch on takes one fused launch a pass (no kernel 2, no WY kernel)
    with the flags the two launches get, and returns their gradients bit for bit, written
    into the op's out= buffers in place."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, hv, decay=decay, seed=t)
    if not l2norm:
        q, k = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))  # unit rows
    monkeypatch.setattr(bwd, "FINAL_QK", final_qk)
    outs = []

    def call():
        out = tuple(torch.full_like(x, float("nan")) for x in (q, k, v, g, beta)) + (None,)
        outs.append(out)
        return bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                 d_final_state=dht, out=out,
                                                 use_qk_l2norm_in_kernel=l2norm)  # fmt: skip

    calls = _both_paths(monkeypatch, call)
    (want, off), (got, on) = calls["0"], calls["1"]
    assert off == ["chunk", "wy"]
    dk16 = not l2norm and h == hv
    assert on == [("fused", final_qk, True, dk16, False)]
    _same(got, want)
    for a, o in zip(got[:5], outs[1][:5]):
        assert a is o


@pytest.mark.usefixtures("kernel_path")
def test_the_slot_layout_with_token_rows(monkeypatch):
    """Varlen with NATIVE_STORES (the slot layout's gradients at their token rows: both
    kernels' `token_rows`): the fused launch gets the tables, and the gradients are the two
    launches' bit for bit."""
    lens = [1, 0, 65, 7]
    n, t, hv = len(lens), sum(lens), 2
    (q, k, v, g, beta, _), do, _ = _bf16_problem(1, t, 1, hv, seed=5)
    gen = torch.Generator().manual_seed(6)
    h0, dht = (torch.randn(n, hv, 128, 128, generator=gen) * 0.1 for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    monkeypatch.setattr(varlen, "NATIVE_STORES", True)

    def call():
        TOKEN_ROWS.clear()
        return bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, cu_seqlens=cu,
                                                 initial_state=h0, d_final_state=dht,
                                                 use_qk_l2norm_in_kernel=True)  # fmt: skip

    calls = _both_paths(monkeypatch, call)
    (want, off), (got, on) = calls["0"], calls["1"]
    assert off == ["chunk", "wy"] and on == [("fused", False, True, False, True)]
    _same(got, want)


@pytest.mark.parametrize("operands", [None, torch.bfloat16, torch.float16])
def test_model_is_kernel_2s_then_the_wy_kernels(operands):
    """`fused_grads_model`: kernel 2's model, dw rounded to the tiles' dtype (none without
    `operands`), the WY kernel's model on it, dk and dG summed; awkward T (70: a tail chunk)."""
    gen = torch.Generator().manual_seed(1)
    b, t, hv, kd, vd, nc = 2, 70, 3, 16, 8, 2

    def rnd(*shape, s=1.0):
        return torch.randn(*shape, generator=gen, dtype=torch.float64) * s

    do, u, du, uw, v = (rnd(b, t, hv, vd) for _ in range(5))
    q, k, w = (rnd(b, t, hv, kd, s=0.25) for _ in range(3))
    h, dh = (rnd(b, nc, hv, kd, vd, s=0.1) for _ in range(2))
    g = -torch.rand(b, nc * 64, hv, kd, generator=gen, dtype=torch.float64)
    big_g = g.view(b, nc, 64, hv, kd).cumsum(2).view(b, nc * 64, hv, kd)[:, :t]
    tt, beta = rnd(b, t, hv, 64, s=0.1), torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    got = fused_grads_model(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, operands)
    rounding = None if operands is None else (lambda x: x.to(torch.bfloat16).to(x.dtype))
    dq, dk, dw, dg = chunk_grads_model(do, u, du, q, k, h, dh, big_g, rounding)
    if operands is not None:
        assert not torch.equal(dw.to(operands).double(), dw)  # the rounding matters here
        dw = dw.to(operands).double()
    dk2, dv, dg2, dbeta = wy_grads_model(dw, du, tt, w, k, uw, v, beta, big_g, operands)
    for name, a, r in zip(NAMES, got, (dq, dk + dk2, dv, dg + dg2, dbeta)):
        assert torch.equal(a, r), name


def test_launcher_checks():
    """The two launchers' input checks, dk_out only with dk16, scale only with dq16, and an
    empty call (T = 0) returns its outputs without compiling."""
    b, t, hv = 1, 5, 2
    tok = [torch.zeros(b, t, hv, 128, dtype=torch.bfloat16) for _ in range(5)]
    states = [torch.zeros(b, 1, hv, 128, 128, dtype=torch.bfloat16) for _ in range(2)]
    big_g = torch.zeros(b, t, hv, 128)
    wy = (torch.zeros(b, t, hv, 64, dtype=torch.bfloat16), tok[0], tok[1], tok[2],
          torch.zeros(b, t, hv))  # fmt: skip
    with pytest.raises(ValueError, match="h must be"):
        launch.kda_bwd_fused(*tok, states[0][:, :, :1], states[1], big_g, *wy)
    with pytest.raises(ValueError, match="tt must be"):
        launch.kda_bwd_fused(*tok, *states, big_g, wy[0][..., :32], *wy[1:])
    with pytest.raises(ValueError, match="dk_out"):
        launch.kda_bwd_fused(*tok, *states, big_g, *wy, dk_out=tok[3])
    with pytest.raises(ValueError, match="scale"):
        launch.kda_bwd_fused(*tok, *states, big_g, *wy, scale=0.5)
    with pytest.raises(ValueError, match="5 tensors"):
        launch.kda_bwd_fused(*tok, *states, big_g, *wy, out=(tok[0],))
    empty = [x[:, :0] for x in tok]
    e_wy = [x[:, :0] for x in wy]
    outs = launch.kda_bwd_fused(*empty, states[0][:, :0], states[1][:, :0], big_g[:, :0], *e_wy,
                                dv16=True, dk16=True)  # fmt: skip
    shapes = [(1, 0, 2, 128), (1, 0, 2, 128), (1, 0, 2, 128), (1, 0, 2, 128), (1, 0, 2)]
    assert [tuple(x.shape) for x in outs] == shapes
    assert [x.dtype for x in outs] == [torch.float32, torch.bfloat16, torch.bfloat16,
                                       torch.float32, torch.float32]  # fmt: skip
