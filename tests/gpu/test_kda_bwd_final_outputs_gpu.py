"""KDA backward's final-form dq / dk (next/kda-final-outputs, 2026-12-06) on the GPU: without
l2norm at HV = H the device pass runs kernel 2 with dq16 (q unscaled, the scale in registers)
and the WY kernel with dk16, no epilogue; against FINAL_QK = False (fp32 dq / dk and the
gdn_bwd_norm epilogue) on the same inputs: dq, dk within one bf16 rounding step of the fp32
path's rounded results (plus a small absolute floor for the changed q x scale rounding), the
other gradients equal to fp32 summation order."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

bwd = importlib.import_module("forgekernel.ops.kda_bwd")


def _problem(b, t, h, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, device="cuda")

    q, k = (F.normalize(rnd(b, t, h, 128), dim=-1).bfloat16() for _ in range(2))
    v, do = rnd(b, t, h, 128).bfloat16(), rnd(b, t, h, 128).bfloat16()
    g = -torch.rand(b, t, h, 128, generator=gen, device="cuda")
    beta = torch.rand(b, t, h, generator=gen, device="cuda")
    h0, dht = rnd(b, h, 128, 128) * 0.1, rnd(b, h, 128, 128) * 0.1
    return q, k, v, g, beta, do, h0, dht


@pytest.mark.parametrize(("b", "t", "h", "with_out"),
                         [(1, 64, 1, False), (2, 130, 2, True), (1, 2048, 4, True)])  # fmt: skip
def test_final_outputs_match_the_epilogue_path(monkeypatch, b, t, h, with_out):
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, seed=t)
    got = {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "FINAL_QK", on)
        out = None
        if with_out:
            out = tuple(torch.empty_like(x) for x in (q, k, v, g, beta)) + (None,)
        got[on] = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht, out=out)  # fmt: skip
        if with_out:
            assert all(a is o for a, o in zip(got[on][:5], out[:5]))
    for i, name in enumerate(("dq", "dk")):
        a, r = got[True][i].float(), got[False][i].float()
        assert a.dtype == r.dtype and torch.isfinite(a).all(), name
        step = r.abs() * 2.0**-7  # one bf16 rounding step
        assert ((a - r).abs() <= 2 * step + 2e-3 * r.abs().max()).all(), name
    for i, name in enumerate(("dv", "dg", "dbeta", "dh0"), start=2):
        a, r = got[True][i].float(), got[False][i].float()
        torch.testing.assert_close(a, r, atol=2e-2 * r.abs().max().item(), rtol=2e-2, msg=name)


@pytest.mark.parametrize(("b", "t", "h"), [(1, 64, 1), (2, 130, 2), (4, 2048, 4)])
def test_wy_final_dk_is_the_epilogues_bit_for_bit(monkeypatch, b, t, h):
    """next/kda-glue3: with FINAL_QK off the WY kernel still writes the op's dk (dk16,
    `_writes_dk`) instead of the epilogue casting its fp32 dk: every gradient bit for bit the
    path's with dk16 off (the same fp32 sum rounded once to bf16, RNE both), one epilogue
    launch instead of two. Falsifier: any dk bit differs (then the WY kernel's sum order or
    rounding is not the epilogue's: `_writes_dk` back behind a switch)."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, seed=t + 1)
    assert not bwd.FINAL_QK
    got = {}
    for on in (True, False):
        monkeypatch.setattr(bwd, "_writes_dk", lambda *a, on=on: on and bwd._on_device(a[-1]))
        got[on] = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht)  # fmt: skip
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got[True], got[False]):
        assert a.dtype == r.dtype and torch.equal(a, r), name


@pytest.mark.parametrize("varlen", [False, True])
def test_out_written_in_place_with_no_copy(monkeypatch, varlen):
    """next/kda-glue3: with out= (the bench's call: fp32 g / beta, B equal lengths behind
    cu_seqlens with `varlen`) every gradient is written by its kernel into the buffer: no
    Python-level `copy_` in the call (`written`'s; before: dv, dbeta, dh0's three DtoD
    copies), and the results bit for bit the call's without out=."""
    b, t, h = 2, 256, 2
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, seed=7)
    kw = {"initial_state": h0, "d_final_state": dht}
    args = [q, k, v, g, beta, do]
    if varlen:
        args = [x.flatten(0, 1).unsqueeze(0) for x in args]
        kw["cu_seqlens"] = torch.arange(b + 1, dtype=torch.int32, device="cuda") * t
    want = bwd.kimi_delta_attention_backward(*args, **kw)
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    copies = []
    real = torch.Tensor.copy_

    def copy_(self, *a, **k):
        copies.append(tuple(self.shape))
        return real(self, *a, **k)

    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    got = bwd.kimi_delta_attention_backward(*args, **kw, out=out)
    monkeypatch.undo()
    assert copies == []
    for name, a, o, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, out, want):
        assert a is o and torch.equal(a, r), name
