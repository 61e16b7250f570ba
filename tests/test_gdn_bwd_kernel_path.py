"""The Gated DeltaNet backward's kernel path (ops/gated_delta_rule_bwd.py `_backward_kernel`,
the default on CUDA tensors; `FORGEKERNEL_GDN_BWD_KERNEL=0` the interim path) on the CPU
(`KERNEL_DEVICES` widened to "cpu"), kernel 1 replaced by the tile emulation of
tests/test_gdn_bwd_state.py (`tile_model`: token-major tiles, transposed state, zero tail, the
register operands rounded to the tiles' dtype) and kernel 2 by its tile emulation
(`reference.gdn_bwd_chunk.chunk_grads_model`, dPD rounded likewise) and kernel 0 by its
(`reference.gdn_bwd_factors.factors_model`, T diag(.) rounded likewise): the batched factor helpers
against their chunk-layout forms (reference/gdn_bwd_state.py), the kernel fed the forward's
recurrence (`forward_state_tiles`) against the reference's pass 1, the whole path against the
interim backward to fp32 tolerance (32-bit tiles: nothing rounded) on awkward sizes, the op
on the kernel path (bf16 tiles rounded) against autograd through the fp64 recurrence, and the
switch (default on CUDA tensors, "0", `interim()`, CPU tensors, a bad value). The GPU twin:
tests/gpu/test_gdn_bwd_kernel_path_gpu.py."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from slots_alone import CPU_CASES, assert_sequence_alone
from test_gdn_bwd_state import tile_model

import forgekernel
from forgekernel.reference.delta_rule_bwd import _Factors, _states
from forgekernel.reference.gdn_bwd_chunk import (
    chunk_grads_model,
    kernel_dg,
    token_rows_model,
    wy_grads_model,
)
from forgekernel.reference.gdn_bwd_factors import (
    factors_model,
    rounding_to,
    scan_model,
    w_u_from_t,
)
from forgekernel.reference.gdn_bwd_norm import qk_grad_model
from forgekernel.reference.gdn_bwd_state import (
    _layout,
    _per_chunk,
    batched_state_pass_factors,
    chunk_factors,
    corrected_values,
    decayed_keys,
    forward_launch_as_reverse,
    forward_state_tiles,
    forward_states,
    out16_forms,
    over_slots,
    reverse_state_pass,
    state_pass_factors,
)

bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
fwd = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
TILES = ("pt", "ke", "qe", "w")


def _inputs(b, t, h, hv=None, dk=16, dv=8, seed=0, dtype=torch.float64):
    hv = hv or h
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rnd(b, t, h, dk), F.normalize(rnd(b, t, h, dk), dim=-1)
    v, do = rnd(b, t, hv, dv), rnd(b, t, hv, dv)
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    return q, k, v, g, beta, do, rnd(b, hv, dk, dv) * 0.5, rnd(b, hv, dk, dv) * 0.5


def forward_inputs_as_reverse(do, ke, w, e_last):
    """Kernel 1's `forward` launch inputs (u, W, Ke as written: contiguous rows in do's dtype) as
    the reverse model's (do, pt, ke, qe, w, e_last), `forward_launch_as_reverse`'s."""
    for x in (do, ke, w):
        assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == do.shape[:3]
    rev = forward_launch_as_reverse(do, ke, w, e_last)
    return tuple(rev[n] for n in ("do", "pt", "ke", "qe", "w", "e_last"))


def emulated_kernel(calls=None):
    """kernel 1's stand-in: the tile emulation in fp64, the register operands rounded to the
    tiles' dtype where it is 16-bit, fp32 outputs (the launcher's); its varlen form (cu_seqlens,
    order: the slot layout) by `over_slots` on the batch form, one recorded call a launch."""
    batch, quiet = _batch_kernel(calls), _batch_kernel()

    def run(do, pt, ke, qe, w, e_last, dht, dh0=None, out16=False, forward=False,
            cu_seqlens=None, order=None, big_g=None, beta=None, out=None):  # fmt: skip
        if cu_seqlens is None:
            return batch(do, pt, ke, qe, w, e_last, dht, dh0, out16, forward, big_g, out, beta)
        assert out16 and dht is None or dht.shape[0] == cu_seqlens.shape[0] - 1
        assert cu_seqlens.dtype == order.dtype == torch.int32
        if calls is not None:
            calls.append(do.dtype)
            FLAGS.append((out16, forward))
        du, side, s0 = over_slots(quiet, cu_seqlens, order, do, pt, ke, qe, w, e_last, dht,
                                  out16=out16, forward=forward)  # fmt: skip
        return du, side, written_to(dh0, s0)

    return run


def _batch_kernel(calls=None):
    """`emulated_kernel`'s batch form (B sequences of T tokens)."""

    def run(do, pt, ke, qe, w, e_last, dht, dh0=None, out16=False, forward=False, big_g=None,
            out=None, beta=None):  # fmt: skip
        assert out16 or not forward
        fused = big_g is not None  # the `fused` forward launch: w = k, Ke's decays from G, no U
        assert forward or not fused
        if beta is not None:  # `w_from_t`: do = v, pt = T^T (T rows); W, u formed from them
            # (u rounded to 16 bits here, fp32 in the kernel: within that rounding)
            assert fused and ke is None and pt.shape[:3] == beta.shape == do.shape[:3]
            t = do.shape[1]
            w_t, u_t = w_u_from_t(pt, w, do, beta.float(), big_g[:, :t])
            do, ke = (big_g.new_zeros(*big_g.shape, x.shape[-1], dtype=x.dtype) for x in (u_t, w_t))
            do[:, :t], ke[:, :t], pt = u_t, w_t, None
        if fused:
            assert w.dtype == do.dtype and big_g.shape == do.shape[:3] and w.shape[1] <= do.shape[1]
            w = decayed_keys(w, big_g).to(do.dtype)
        assert (pt is None and qe is None) == forward  # the forward variant builds I and 0 in
        rows = do.shape[1]
        if forward:  # chunks first to last on u, W, Ke as written: the reverse model's
            # inputs by flipping and negating (exact), the outputs flipped back below
            do, pt, ke, qe, w, e_last = forward_inputs_as_reverse(do, ke, w, e_last)
        if calls is not None:
            calls.append(do.dtype)
            FLAGS.append((out16, forward))
        # strided views allowed (TMA reads them in place): head slices, kernel 0's tiles cut to T
        for x in (do, pt, ke, qe, w):
            assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == do.shape[:3]
        assert e_last.dtype == torch.float32 and e_last.shape == (do.shape[0], -(-do.shape[1]
                                                                  // 64), do.shape[2])  # fmt: skip
        low = do.dtype in (torch.float16, torch.bfloat16)

        def rounding(x):
            return x.to(do.dtype).to(x.dtype) if low else x

        factors = {n: x.double() for n, x in zip(TILES, (pt, ke, qe, w))}
        factors["e_last"] = e_last.double()
        dst = None if dht is None else dht.double()
        out_dh0 = dh0
        du, dh, dh0 = (x.float() for x in tile_model(factors, do.double(), dst, rounding))
        if out16:  # the kernel's 16-bit forms (fp32 where the test runs fp32 tiles)
            du, dh = out16_forms(du, dh, do.dtype, forward)
        du = None if fused else du[:, :rows]
        if out is not None:  # the launcher's out=: all written (views of larger buffers)
            return tuple(None if x is None else written_to(o, x)
                         for o, x in zip(out, (du, dh, dh0)))  # fmt: skip
        return du, dh, written_to(out_dh0, dh0)

    return run


def written_to(out, x):
    """x, or written into `out` as the launcher's out= (an indexed store: no Python-level
    `copy_`, which the no-copy tests count)."""
    if out is None:
        return x
    assert out.is_contiguous() and out.dtype == x.dtype and out.shape == x.shape
    out[...] = x
    return out


def emulated_chunk_kernel(calls=None):
    """kernel 2's stand-in: its tile emulation (`chunk_grads_model`, `kernel_dg`) in fp64, dPD
    rounded to the tiles' dtype where it is 16-bit, fp32 outputs (the launcher's: dq, dk, dw,
    dG); raw: the model's (dq, dk, dw, dg rows, te) in fp64 (the WY variant's first half)."""

    def run(do, u, du, q, k, h, dh, big_g, raw=False):
        for x in (do, u, du, q, k, h, dh):  # strided views allowed (TMA)
            assert x.stride(-1) == 1 and x.dtype == do.dtype
        assert big_g.dtype == torch.float32 and big_g.shape == do.shape[:3]
        nc = -(-do.shape[1] // 64)
        assert h.shape == dh.shape == (do.shape[0], nc, do.shape[2], q.shape[-1], do.shape[-1])
        if calls is not None:
            calls.append(do.dtype)
        low = do.dtype in (torch.float16, torch.bfloat16)

        def rounding(x):
            return x.to(do.dtype).to(x.dtype)

        wide = [x.double() for x in (do, u, du, q, k, h, dh, big_g)]
        dq, dk, dw, dg, te = chunk_grads_model(*wide, rounding if low else None)
        if raw:
            return dq, dk, dw, dg, te
        return tuple(x.float() for x in (dq, dk, dw, kernel_dg(dg, te, *wide[5:])))

    return run


def emulated_chunk_wy_kernel(calls=None):
    """kernel 2's WY variant's stand-in: `chunk_grads_model` then `wy_grads_model` in fp64,
    dPD, dw, dkb, dvb and M rounded to the tiles' dtype where it is 16-bit, fp32 outputs (dv16:
    dv, dqk16: dq times scale and dk, rounded once to the tiles' dtype)."""
    first = emulated_chunk_kernel(calls)

    def run(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, dv16=False, out=None,
            dqk16=False, scale=1.0, fsplit=False, tables=None, tokens=None):  # fmt: skip
        if fsplit:  # the two-warpgroup form (the same outputs bit for bit): dqk16 only
            assert dqk16
            FSPLIT.append(do.dtype)
        for x in (tt, w, uw, v):  # kernel 0's outputs cut to T tokens: strided views (TMA)
            assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == do.shape[:3]
        assert beta.dtype == torch.float32 and beta.shape == do.shape[:3]
        assert tt.shape[-1] == 64 and w.shape[-1] == q.shape[-1] and uw.shape == v.shape
        low = do.dtype in (torch.float16, torch.bfloat16)

        def rounding(x):
            return x.to(do.dtype).to(x.dtype)

        r = rounding if low else None
        outs = first(do, u, du, q, k, h, dh, big_g, raw=True)
        wide = [x.double() for x in (du, k, h, big_g, tt, w, uw, v, beta)]
        dq, dk, dg, te, dv, dbeta = wy_grads_model(outs, *wide, r, r)
        dg = kernel_dg(dg, te, h.double(), dh.double(), big_g.double())
        dq, dk, dg, dv, dbeta = (x.float() for x in (dq, dk, dg, dv, dbeta))
        if dv16:  # the kernel's 16-bit dv
            DV16.append(do.dtype)
            dv = dv.to(do.dtype)
        if dqk16:  # the kernel's 16-bit dq (times scale), dk: rounded once from fp32
            DQK16.append((do.dtype, scale))
            dq, dk = (dq * scale).to(do.dtype), dk.to(do.dtype)
        else:
            assert scale == 1.0
        got = (dq, dk, dg, dv, dbeta)
        if tables is not None:  # the `token_rows` key (fsplit's): the rows below valid stored
            assert fsplit and do.shape[0] == 1
            TOKEN_ROWS.append(tokens)
            if out is None:
                return tuple(token_rows_model(x, *tables, tokens) for x in got)
            return tuple(token_rows_model(x, *tables, tokens, o) for x, o in zip(got, out))
        return got if out is None else tuple(written_to(o, x) for o, x in zip(out, got))

    return run


def emulated_factors_kernel(calls=None):
    """kernel 0's stand-in: its tile emulation (`factors_model`) in fp64 from the kernel's
    inputs, T diag(.) rounded to the tiles' dtype where it is 16-bit, the outputs in the
    launcher's dtypes (tiles in q's dtype, e_last and G fp32)."""

    def run(q, k, v, g, beta, fused=False, w_from_t=False):
        assert q.dtype == k.dtype == v.dtype and q.shape == k.shape and q.shape[:2] == v.shape[:2]
        assert g.shape == beta.shape == v.shape[:3]
        if calls is not None:
            calls.append(q.dtype)
        low = q.dtype in (torch.float16, torch.bfloat16)
        wide = [x.double() for x in (q, k, v, g, beta)]
        out = factors_model(*wide, q.dtype, rounding_to(q.dtype) if low else None)
        out["e_last"], out["big_g"] = out["e_last"].float(), out["big_g"].float()
        if fused:  # the fused route's key: no Ke, Qe
            del out["ke"], out["qe"]
        if w_from_t:  # its T-only key: no W, u either
            assert fused
            del out["w"], out["u"]
        return out

    return run


def emulated_norm_kernel(calls=None):
    """The q / k epilogue's stand-in: its model (`qk_grad_model`) in fp64 (dxs fp32 or 16-bit:
    kernel 2's dqk16, the group sum of the rounded partials), the output in x's dtype; calls
    recorded as (x's heads, dxs's heads, l2norm)."""

    def run(dxs, x, scale, l2norm, out=None):
        assert dxs.dtype in (torch.float32, x.dtype) and dxs.shape[:2] == x.shape[:2]
        assert dxs.shape[2] % x.shape[2] == 0
        if calls is not None:
            calls.append((x.shape[2], dxs.shape[2], l2norm))
        return written_to(out, qk_grad_model(dxs.double(), x.double(), scale, l2norm, x.dtype))

    return run


def _both_emulated(monkeypatch, calls=None, chunk_calls=None, factor_calls=None, norm_calls=None):
    monkeypatch.setattr(bwd, "_qk_grads", emulated_norm_kernel(norm_calls))
    monkeypatch.setattr(bwd, "_factors", emulated_factors_kernel(factor_calls))
    monkeypatch.setattr(bwd, "_state_recurrence", emulated_kernel(calls))
    monkeypatch.setattr(bwd, "_chunk_grads", emulated_chunk_kernel(chunk_calls))
    monkeypatch.setattr(bwd, "_chunk_grads_wy", emulated_chunk_wy_kernel(chunk_calls))


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 3])
def test_batched_factors_match_the_layout_forms(t, b):
    q, k, v, g, beta, *_ = _inputs(b, t, 2)
    got = batched_state_pass_factors(q, k, v, g, beta, scale=0.3, dtype=torch.float64)
    want = state_pass_factors(q, k, v, g, beta, scale=0.3, dtype=torch.float64)
    assert got.keys() == want.keys()
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("with_h0", [False, True])
def test_forward_recurrence_on_the_reverse_kernel(t, b, with_h0):
    """Kernel 1's model (`reverse_state_pass`) and its tile emulation fed `forward_state_tiles`
    give the forward's chunk states h and U = u - W h (reference pass 1, `_states`; U also
    against `corrected_values`) and the final state (to e^(G_C)'s fp32 rounding)."""
    q, k, v, g, beta, _, h0, _ = _inputs(b, t, 2)
    h0 = h0 if with_h0 else None
    f = chunk_factors(q * 0.25, k, v, g, beta)
    tiles = forward_state_tiles(f, torch.float64)
    factors = {n: tiles[n] for n in (*TILES, "e_last")}
    layout = _layout(b, t, q.device)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q * 0.25, k, v, g, beta)]
    fl = _Factors(*(layout.gather(x) for x in flat))
    start = torch.zeros(b, 2, 16, 8, dtype=torch.float64) if h0 is None else h0
    h_ref, u_ref = _states(fl, start, layout.steps)
    h_ref = _per_chunk(h_ref, b)
    u_tok = corrected_values(q, k, v, g, beta, h0, scale=0.25, dtype=torch.float64)
    for run in (lambda: reverse_state_pass(factors, tiles["do"], h0),
                lambda: emulated_kernel()(tiles["do"], *(tiles[n] for n in TILES),
                                          tiles["e_last"].float(), h0)):  # fmt: skip
        du, dh, final = run()
        h, big_u = forward_states(du, dh)
        tol = 1e-5  # e^(G_C) goes to the kernel in fp32
        torch.testing.assert_close(h.to(h_ref.dtype), h_ref, rtol=tol, atol=tol)
        got_u = big_u.transpose(2, 3).flatten(1, 2)[:, :t].to(u_tok.dtype)
        torch.testing.assert_close(got_u, u_tok, rtol=tol, atol=tol)
        s_end = f.e_last[:, -1, :, :, None] * h[:, -1] + f.ke[:, -1].transpose(-1, -2) @ (
            big_u[:, -1].to(f.ke.dtype)
        )
        torch.testing.assert_close(final.to(s_end.dtype), s_end, rtol=tol, atol=tol)


CASES = [
    # (b, t, h, hv, l2norm, with_h0, with_dht)
    (1, 1, 2, 2, False, False, False),
    (2, 63, 2, 4, True, True, True),
    (3, 64, 1, 2, False, True, False),
    (1, 65, 2, 2, True, False, True),
    (2, 200, 2, 4, False, True, True),
    (3, 65, 2, 2, False, False, True),
    (1, 200, 1, 1, True, True, False),
    (2, 1, 1, 2, True, True, True),
]


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht"), CASES)
@pytest.mark.parametrize("k_last", [False, True])
@pytest.mark.parametrize("wy", [True, False])
def test_kernel_path_equals_the_interim_path(monkeypatch, b, t, h, hv, l2norm, with_h0,
                                              with_dht, k_last, wy):  # fmt: skip
    """fp32 inputs (so fp32 tiles, nothing rounded): `_backward_kernel` is the interim
    backward to fp32 tolerance, every gradient, grouped heads, both state layouts; kernel 2 as
    all of pass 3 (`wy`) or `_output_grads` only (the WY half in torch)."""
    _both_emulated(monkeypatch)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", wy)
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, h, hv, dk=32, dv=16, seed=t + b,
                                           dtype=torch.float32)  # fmt: skip
    if l2norm:
        q, k = q * 3.0, k * 2.0
    h0 = h0 if with_h0 else None
    dht = dht if with_dht else None
    if k_last:
        h0, dht = (None if x is None else x.transpose(-1, -2).contiguous() for x in (h0, dht))
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    cu = torch.arange(b + 1, dtype=torch.int32) * t
    want = bwd._backward_interim(*flat[:5], h0, cu, flat[5], dht, 0.2, k_last, l2norm)
    got = bwd._backward_kernel(*flat[:5], h0, flat[5], dht, 0.2, k_last, l2norm, b)
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        err = float((a - r).abs().max())
        assert err <= 1e-4 * float(r.abs().max()) + 1e-6, (name, err, float(r.abs().max()))


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht"), CASES[:4])
def test_factors_on_kernel_0_are_the_torch_factors(monkeypatch, b, t, h, hv, l2norm, with_h0,
                                                   with_dht):  # fmt: skip
    """Kernel 0 (emulated) forms the factors once a pass; the path's gradients are the torch
    factors' (FACTORS_IN_KERNEL = False, kernel 0 never called) to fp32 tolerance."""
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, h, hv, dk=32, dv=16, seed=t + 7,
                                           dtype=torch.float32)  # fmt: skip
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    args = (h0 if with_h0 else None, flat[5], dht if with_dht else None, 0.2, False, l2norm, b)
    grads = {}
    for on in (True, False):
        calls = []
        _both_emulated(monkeypatch, factor_calls=calls)
        monkeypatch.setattr(bwd, "FACTORS_IN_KERNEL", on)
        grads[on] = bwd._backward_kernel(*flat[:5], *args)
        assert calls == ([torch.float32] if on else [])
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[True], grads[False]):
        err = float((a - r).abs().max())
        assert err <= 1e-5 * float(r.abs().max()) + 1e-7, (name, err)


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht"), CASES[:4])
def test_states16_are_the_fp32_states(monkeypatch, b, t, h, hv, l2norm, with_h0, with_dht):
    """Kernel 1 writing kernel 2's forms (`out16`; the forward launch with I and 0 built in,
    `forward`) and the 16-bit glue (`_backward_device`) give the fp32-out path's gradients
    (STATES16 = False: torch flips, transposes and converts) to fp32 tolerance (32-bit tiles:
    nothing rounded); the launches carry the flags."""
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, h, hv, dk=32, dv=16, seed=t + 11,
                                           dtype=torch.float32)  # fmt: skip
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    args = (h0 if with_h0 else None, flat[5], dht if with_dht else None, 0.2, False, l2norm, b)
    grads = {}
    for on in (True, False):
        FLAGS.clear()
        _both_emulated(monkeypatch, calls=[])
        monkeypatch.setattr(bwd, "STATES16", on)
        grads[on] = bwd._backward_kernel(*flat[:5], *args)
        assert FLAGS == ([(True, True), (True, False)] if on else [(False, False)] * 2)
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[True], grads[False]):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        err = float((a - r).abs().max())
        assert err <= 1e-5 * float(r.abs().max()) + 1e-7, (name, err)


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht"), CASES[:4])
def test_norm_epilogue_is_the_torch_one(monkeypatch, b, t, h, hv, l2norm, with_h0, with_dht):
    """The q / k epilogue (emulated: `qk_grad_model`) once for q, once for k, at H heads from
    HV, gives the torch group sum and l2norm backward's gradients (NORM_IN_KERNEL off) to fp32
    tolerance; without l2norm at HV = H kernel 2 writes dq, dk itself (no epilogue call)."""
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, h, hv, dk=32, dv=16, seed=t + 13,
                                           dtype=torch.float32)  # fmt: skip
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    args = (h0 if with_h0 else None, flat[5], dht if with_dht else None, 0.2, False, l2norm, b)
    grads = {}
    for on in (True, False):
        calls = []
        _both_emulated(monkeypatch, norm_calls=calls)
        monkeypatch.setattr(bwd, "NORM_IN_KERNEL", on)
        grads[on] = bwd._backward_kernel(*flat[:5], *args)
        fold = not l2norm and h == hv  # kernel 2 writes dq, dk (QK16, `_folds`): no epilogue
        assert calls == ([(h, hv, l2norm)] * 2 if on and not fold else [])
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads[True], grads[False]):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        err = float((a - r).abs().max())
        assert err <= 1e-5 * float(r.abs().max()) + 1e-7, (name, err)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_out16_forms(t, dtype):
    """`out16_forms`: dU converted, dS = dh^T; with `forward` (on the forward launch's outputs)
    exactly `forward_states`' h and U back in token order, converted."""
    gen = torch.Generator().manual_seed(t)
    nc = -(-t // 64)
    du = torch.randn(2, nc * 64, 3, 8, generator=gen, dtype=torch.float64)
    dh = torch.randn(2, nc, 3, 8, 16, generator=gen, dtype=torch.float64)
    u16, ds16 = out16_forms(du[:, :t], dh, dtype)
    assert u16.dtype == ds16.dtype == dtype and ds16.shape == (2, nc, 3, 16, 8)
    assert torch.equal(u16, du[:, :t].to(dtype))
    assert torch.equal(ds16, dh.transpose(-1, -2).to(dtype))
    u_f, h_f = out16_forms(du, dh, dtype, forward=True)
    h, big_u = forward_states(du, dh)
    assert torch.equal(h_f, h.to(dtype))
    assert torch.equal(u_f, big_u.transpose(2, 3).flatten(1, 2).to(dtype))
    u_t, _ = out16_forms(du[:, :t], dh, dtype, forward=True)  # T rows: the padding's zeros
    padded = du.clone()
    padded[:, t:] = 0
    want = out16_forms(padded, dh, dtype, forward=True)[0][:, :t]
    assert torch.equal(u_t, want)


def test_head_passes_are_the_one_pass(monkeypatch):
    """Value heads in several passes (the memory bound) give the one pass's gradients."""
    _both_emulated(monkeypatch)
    q, k, v, g, beta, do, h0, dht = _inputs(2, 70, 4, 8, dk=16, dv=8, dtype=torch.float32)
    flat = [x.reshape(140, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    one = bwd._backward_kernel(*flat[:5], h0, flat[5], dht, 0.2, False, True, 2)
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 140 * 2)  # one q head (2 value heads)
    split = bwd._backward_kernel(*flat[:5], h0, flat[5], dht, 0.2, False, True, 2)
    for a, r in zip(split, one):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6)


# ---- the op with the switch on (bf16, the forward launcher stubbed as tests/test_gdn_bwd_op)


@pytest.fixture
def kernel_path(monkeypatch):
    calls = []
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "KERNEL_DEVICES", ("cuda", "cpu"))
    _both_emulated(monkeypatch, calls, CHUNK_CALLS, FACTOR_CALLS)
    CHUNK_CALLS.clear()
    FACTOR_CALLS.clear()
    FLAGS.clear()
    DV16.clear()
    DQK16.clear()
    TOKEN_ROWS.clear()
    monkeypatch.setattr(bwd, "check_cuda", lambda name, t: None)
    return calls


CHUNK_CALLS: list = []  # kernel 2's launches under the kernel_path fixture (their dtypes)
FLAGS: list = []  # kernel 1's (out16, forward) a launch, whenever its emulation records calls
DV16: list = []  # kernel 2's dv16 launches (their dtypes)
DQK16: list = []  # kernel 2's dqk16 launches (their dtypes, dq scales)
FSPLIT: list = []  # kernel 2's fsplit launches (their dtypes)
TOKEN_ROWS: list = []  # kernel 2's token_rows launches (their token counts)
FACTOR_CALLS: list = []  # kernel 0's, likewise


def _bf16_problem(b, t, h, hv, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, 128, generator=gen).bfloat16()
    k = (torch.randn(b, t, h, 128, generator=gen) * 2.0).bfloat16()
    v = torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    g = -torch.rand(b, t, hv, generator=gen)
    beta = torch.rand(b, t, hv, generator=gen)
    do = torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    h0 = torch.randn(b, hv, 128, 128, generator=gen) * 0.1
    dht = torch.randn(b, hv, 128, 128, generator=gen) * 0.1
    return q, k, v, g, beta, do, h0, dht


@pytest.mark.parametrize(("b", "t", "h", "hv"), [(2, 65, 1, 2), (1, 130, 2, 2)])
def test_explicit_backward_on_the_kernel_path(kernel_path, b, t, h, hv):
    """`gated_delta_rule_backward` with the switch on takes the kernel path (two launches:
    the forward states, the reverse pass) and matches autograd through the fp64 recurrence
    within 2e-2 of each gradient's max (bf16 tiles, the emulation's bf16 operands)."""
    from test_gdn_bwd_op import _fp64_grads

    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=t)
    got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                d_final_state=dht,
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert kernel_path == [torch.bfloat16, torch.bfloat16] and CHUNK_CALLS == [torch.bfloat16]
    assert FACTOR_CALLS == [torch.bfloat16]
    assert FLAGS == [(True, True), (True, False)]  # 16-bit outputs; the forward variant first
    assert DV16 == [torch.bfloat16]  # dv in 16 bits from kernel 2
    assert DQK16 == [(torch.bfloat16, 1.0)]  # dq, dk in 16 bits, the epilogue after (l2norm)
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True, with_state=True)
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        err = float((a.double() - r).abs().max())
        assert err <= 2e-2 * float(r.abs().max()), (name, err, float(r.abs().max()))


@pytest.mark.parametrize(("h", "hv", "l2norm"), [(2, 2, False), (1, 2, False), (2, 2, True),
                                                  (1, 4, True)])  # fmt: skip
def test_qk16_within_the_check_tolerance(kernel_path, monkeypatch, h, hv, l2norm):
    """QK16 (kernel 2's dq, dk rounded once to bf16, then the group sum of the rounded partials
    in the epilogue, or, without l2norm at HV = H, dq x scale and dk written by kernel 2 with no
    epilogue) against autograd through the fp64 recurrence: within 2e-2 of each gradient's max
    as with fp32 dq, dk (QK16 = False), dq / dk's error within 1.5x the fp32 path's + a bf16
    ulp of the max."""
    from test_gdn_bwd_op import _fp64_grads

    q, k, v, g, beta, do, h0, dht = _bf16_problem(2, 130, h, hv, seed=11 + hv)
    if not l2norm:  # unit keys (the recurrence stays bounded without the op's normalization)
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=l2norm, with_state=True)
    errs = {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "QK16", on)
        norm_calls = []
        monkeypatch.setattr(bwd, "_qk_grads", emulated_norm_kernel(norm_calls))
        DQK16.clear()
        got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht,
                                                    use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
        fold = on and not l2norm and h == hv
        assert len(norm_calls) == (0 if fold else 2)
        assert DQK16 == ([(torch.bfloat16, 128**-0.5 if fold else 1.0)] if on else [])
        for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
            assert name not in ("dq", "dk") or a.dtype == q.dtype
            errs[on, name] = float((a.double() - r).abs().max())
            assert errs[on, name] <= 2e-2 * float(r.abs().max()), (on, name, errs[on, name])
    for i, name in enumerate(("dq", "dk")):
        ulp = float(want[i].abs().max()) * 2**-8
        assert errs[True, name] <= 1.5 * errs[False, name] + ulp, (name, errs)


def test_fsplit_switch(kernel_path, monkeypatch):
    """FSPLIT (on by default since the H100 A/B, 2026-12-06: 1.18x): kernel 2's `fsplit` key
    with QK16 (the same outputs: the stand-in ignores it), never without QK16."""
    assert bwd.FSPLIT
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 65, 2, 2, seed=5)
    outs = {}
    for fs, qk16 in ((False, True), (True, True), (True, False)):
        monkeypatch.setattr(bwd, "FSPLIT", fs)
        monkeypatch.setattr(bwd, "QK16", qk16)
        FSPLIT.clear()
        outs[fs, qk16] = forgekernel.gated_delta_rule_backward(
            q, k, v, g, beta, do, initial_state=h0, d_final_state=dht,
            use_qk_l2norm_in_kernel=True,
        )  # fmt: skip
        assert FSPLIT == ([torch.bfloat16] if fs and qk16 else [])
    for a, r in zip(outs[True, True], outs[False, True]):
        assert torch.isfinite(a).all()
        torch.testing.assert_close(a, r, rtol=0, atol=0)


@pytest.mark.parametrize(
    ("lens", "h0_too"),
    [
        ([1, 63, 0, 64, 65, 130], True),
        ([70, 70, 70], False),
        ([3, 129, 7], True),
        ([0, 5], True),
        ([128, 64, 0], False),
    ],
)
@pytest.mark.parametrize("in_slots", [True, False])
def test_varlen_equals_the_interim_path(monkeypatch, lens, h0_too, in_slots):
    """Several sequences behind cu_seqlens (fp32 tiles, exact emulation) equal the interim path,
    empty sequences included: unequal lengths in the slot layout, one launch of each kernel
    (the device pass, the default: ops/_linattn_varlen.py `run_in_slots`), or in buckets, one
    kernel-path call a bucket (`in_slots` False: the fallback forms, STATES16 off); equal
    lengths one call on the tokens as they are either way."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bwd, "TILE_DTYPES", (torch.float32,))
    monkeypatch.setattr(bwd, "STATES16", in_slots)
    calls, chunk_calls = [], []
    _both_emulated(monkeypatch, calls, chunk_calls)
    n, t = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _inputs(1, t, 2, 4, dk=32, dv=16, seed=n, dtype=torch.float32)
    _, _, _, _, _, _, h0, dht = _inputs(n, 1, 2, 4, dk=32, dv=16, seed=9, dtype=torch.float32)
    flat = [x[0] for x in (q, k, v, g, beta, do)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    h0 = h0 if h0_too else None
    want = bwd._backward_interim(*flat[:5], h0, cu, flat[5], dht, 0.2, False, True)
    got = bwd._backward_eager(*flat[:5], h0, cu, flat[5], dht, 0.2, False, True, 0)
    calls_each = 1 if len(set(lens)) == 1 or in_slots else len(varlen.buckets(lens))
    assert len(calls) == 2 * calls_each and len(chunk_calls) == calls_each
    for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        assert a.shape == r.shape, name
        err = float((a - r).abs().max())
        assert err <= 1e-4 * float(r.abs().max()) + 1e-6, (name, err, float(r.abs().max()))


def test_varlen_in_slots_is_the_batch_path(monkeypatch):
    """Equal lengths in the slot layout (as a CUDA-graph capture runs them: no host read) give
    the batch path's gradients bit for bit (fp32 tiles, exact emulation; lengths 64 and 70: no
    tail and a tail chunk, one zero slot a sequence)."""
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bwd, "TILE_DTYPES", (torch.float32,))
    _both_emulated(monkeypatch)
    for b, t in ((3, 64), (2, 70)):
        q, k, v, g, beta, do, h0, dht = _inputs(b, t, 2, 4, dk=32, dv=16, seed=t,
                                                dtype=torch.float32)  # fmt: skip
        flat = [x.flatten(0, 1) for x in (q, k, v, g, beta, do)]
        cu = torch.arange(b + 1, dtype=torch.int32) * t
        args = (*flat[:5], h0, flat[5], dht, 0.2, False, True)
        want = bwd._backward_kernel(*args, b)

        def run(q, k, v, g, beta, do, h0, dht, slots):
            return bwd._backward_kernel(q, k, v, g, beta, h0, do, dht, 0.2, False, True, 1,
                                        slots=slots)  # fmt: skip

        got = varlen.run_in_slots(run, flat, (h0, dht), cu)
        for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
            assert torch.equal(a, r), name


def test_varlen_routing(kernel_path, monkeypatch):
    """Varlen reads the offsets once (eager) and runs unequal lengths once in the slot layout
    (one long sequence among many short ones: two kernel-1 launches, as equal lengths; buckets
    before, the interim path before those); one sequence: no host read."""
    seen = []
    interim = bwd._backward_interim
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: seen.append(1) or interim(*a))
    q, k, v, g, beta, do, h0, _ = _bf16_problem(1, 610, 1, 2)
    for lens in ([300, 310], [600] + [1] * 10, [305, 305]):
        kernel_path.clear()
        seen.clear()
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu,
                                              use_qk_l2norm_in_kernel=True)  # fmt: skip
        assert (len(kernel_path), seen) == (2, [])
    kernel_path.clear()
    cu = torch.tensor([0, 610], dtype=torch.int32)
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0[:1],
                                          cu_seqlens=cu)  # fmt: skip
    assert len(kernel_path) == 2


def scanned_factors_kernel():
    """kernel 0's stand-in with G (`big_g`, what kernel 2 reads) as the kernel's warp scan adds
    it in fp32 (`scan_model`), the rest as `emulated_factors_kernel`'s (its sequential fp64
    cumsum: the same G on every row past a chunk's last gate)."""
    exact = emulated_factors_kernel()

    def run(q, k, v, g, beta, fused=False, w_from_t=False):
        out = exact(q, k, v, g, beta, fused, w_from_t)
        out["big_g"] = scan_model(g)
        return out

    return run


@pytest.mark.parametrize(("lens", "scan"), CPU_CASES)
def test_varlen_in_slots_is_each_sequence_alone(kernel_path, monkeypatch, lens, scan):
    """bf16 on the device pass (the default; every kernel emulated): unequal sequences in the
    slot layout, one launch each, against each sequence's own batch-path call, as
    tests/slots_alone.py states it (kernel 1's extra zero slot passes the state exactly; an
    empty sequence's state gradient is d_final_state's). With G summed sequentially (`scan`
    False: the fp64 emulation) bit for bit everywhere; with kernel 0's warp scan (`scan`,
    `scan_model`) dk and dg of the last chunks T cuts (301 % 64 = 45, 295 % 64 = 39 rows, the
    H100's failing case of 2026-12-06 13:38) differ in their last bits, within the tolerance:
    kernel 2's G_C there is G at row T - 1 alone, at row 63 in the slots; sequence 0's 2 rows
    (lane 0: no other association) bit for bit."""
    if scan:
        monkeypatch.setattr(bwd, "_factors", scanned_factors_kernel())
    n, t = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _bf16_problem(1, t, 2, 4, seed=t)
    *_, h0, dht = _bf16_problem(n, 1, 2, 4, seed=n)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"use_qk_l2norm_in_kernel": True}
    got = forgekernel.gated_delta_rule_backward(
        q, k, v, g, beta, do, cu_seqlens=cu, initial_state=h0, d_final_state=dht, **kw
    )
    assert len(kernel_path) == 2
    names = ("dq", "dk", "dv", "dg", "dbeta")
    equal = []
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            assert torch.equal(got[5][i], dht[i])
            continue
        one = forgekernel.gated_delta_rule_backward(
            *(x[:, a:z] for x in (q, k, v, g, beta, do)), initial_state=h0[i : i + 1],
            d_final_state=dht[i : i + 1], **kw)  # fmt: skip
        if not scan:
            for name, x, r in zip(names, got, one):
                assert torch.equal(x[:, a:z], r), (i, name)
        assert_sequence_alone(names, got, one, a, z, i)
        assert torch.equal(got[5][i : i + 1], one[5]), i
        equal.append(all(torch.equal(x[:, a:z], r) for x, r in zip(got[:5], one)))
    # the sequential G: every sequence bit for bit; the scan's: not sequences 1 and 3 (the H100's)
    assert equal == ([True] * len(equal) if not scan else [True, False, False])


def test_varlen_capture_takes_the_slot_layout(kernel_path, monkeypatch):
    """Under a CUDA-graph capture (emulated: `capturing` true) every call runs once in the slot
    layout (no host read of cu_seqlens), equal lengths too (their batch path behind
    conditional nodes was dropped: NOTES "next/capture-drop"): unequal lengths bit for bit
    their eager call (the same path), equal ones as many launches as eager's batch path and
    within 2e-2 of it (dk, dg of a cut last chunk sum G_C in another order: NOTES "Slots
    against each sequence alone"), k_last's transposed state gradient included."""
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 130, 2, 4)
    *_, h0, dht = _bf16_problem(2, 1, 2, 4, seed=1)
    kw = {"use_qk_l2norm_in_kernel": True, "k_last": True,
          "initial_state": h0.transpose(-1, -2).contiguous()}  # fmt: skip
    slots = []
    real = varlen.run_in_slots
    monkeypatch.setattr(varlen, "run_in_slots", lambda *a: slots.append(1) or real(*a))
    for lens in ([65, 65], [60, 70]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        want = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu, **kw)
        slots.clear()
        with monkeypatch.context() as m:
            m.setattr(varlen, "capturing", lambda t: True)
            kernel_path.clear()
            got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu,
                                                        **kw)  # fmt: skip
        assert slots == [1] and len(kernel_path) == 2  # one pass: two kernel-1 launches
        for name, a, r in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
            if lens[0] != lens[1]:
                assert torch.equal(a, r), (lens, name)
            else:
                err = float((a.double() - r.double()).abs().max())
                assert err <= 2e-2 * float(r.abs().max()) + 1e-6, (lens, name, err)


def test_varlen_passes_count_the_tokens(kernel_path, monkeypatch):
    """The slot layout's passes over heads count the callers' tokens, not its zero rows
    (`pass_tokens`): 2 x 65 tokens in 4 slots (256 rows) at H = 2, HV = 4 stay one pass (two
    kernel-1 launches) under a bound of 2 x 130 token-heads a q head; 256 rows would be two."""
    q, k, v, g, beta, do, *_ = _bf16_problem(1, 130, 2, 4)
    cu = torch.tensor([0, 65, 130], dtype=torch.int32)
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 2 * 130 * 2)
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu)  # equal: reshape
    assert len(kernel_path) == 2
    cu = torch.tensor([0, 60, 130], dtype=torch.int32)
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu)  # in slots
    assert len(kernel_path) == 4
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 2 * 130 * 2 - 1)
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu)
    assert len(kernel_path) == 8  # two passes


def native_switch(monkeypatch, backward, args, kw, capture, token_rows):
    """`call(native, out=None)`: `backward(*args, out=out, **kw)` with ops/_linattn_varlen.py
    NATIVE_STORES = native (`token_rows`, the test's record of the token_rows launches, and the
    unpack count cleared first; `capture`: as under a CUDA-graph capture, the slot layout at any
    lengths), and the list each `unpack` of the op appends to (both ops' native-stores tests)."""
    unpacked = []
    real = varlen.unpack
    monkeypatch.setattr(varlen, "unpack", lambda *a: unpacked.append(1) or real(*a))

    def call(native, out=None):
        monkeypatch.setattr(varlen, "NATIVE_STORES", native)
        token_rows.clear()
        unpacked.clear()
        with monkeypatch.context() as m:
            if capture:
                m.setattr(varlen, "capturing", lambda t: True)
            return backward(*args, out=out, **kw)

    return call, unpacked


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "capture"),
    [
        ([1, 0, 65, 64, 200, 0, 7], 2, 2, False, False),  # kernel 2 writes the op's dq, dk
        ([1, 0, 65, 64, 200, 0, 7], 2, 4, False, True),  # the epilogue on the callers' q, k
        ([60, 70], 2, 2, True, False),
        ([65, 65], 2, 4, True, True),  # equal lengths: the slot layout under a capture only
        ([128, 64], 1, 2, False, True),  # no tail chunk, a zero slot each
    ],
)
def test_native_stores_are_the_slot_path(kernel_path, monkeypatch, lens, h, hv, l2norm,
                                         capture):  # fmt: skip
    """NATIVE_STORES on (ops/_linattn_varlen.py): kernel 2's `token_rows` form (emulated:
    `token_rows_model`, the rows below each slot's valid count at its first token + row, a row
    no slot writes left NaN) writes dq, dk, dv, dg, dbeta at the callers' token rows, nothing
    unpacked; every gradient bit for bit the slot path's (switch off), empty, one-token and
    tail-cut sequences, with and without the epilogue, eager and under a capture (emulated);
    into the op's out= buffers in place, also with value heads in two passes."""
    n, t = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _bf16_problem(1, t, h, hv, seed=t)
    if not l2norm:  # unit rows as the op expects them there (the recurrence stays bounded)
        k = F.normalize(k.float(), dim=-1).bfloat16()
    *_, h0, dht = _bf16_problem(n, 1, h, hv, seed=n)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "initial_state": h0, "d_final_state": dht,
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
    call, unpacked = native_switch(monkeypatch, forgekernel.gated_delta_rule_backward,
                                   (q, k, v, g, beta, do), kw, capture, TOKEN_ROWS)  # fmt: skip
    want = call(False)
    assert TOKEN_ROWS == [] and len(unpacked) == 5
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    got = call(True)
    assert TOKEN_ROWS == [t] and unpacked == []
    for name, a, r in zip(names, got, want):
        assert a.shape == r.shape and a.dtype == r.dtype and torch.equal(a, r), name
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    got = call(True, out)
    for name, a, o, r in zip(names, got, out, want):
        assert a.data_ptr() == o.data_ptr() and torch.equal(o, r), name
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", t * (hv // h))  # one q head a pass
    got = call(True)
    assert TOKEN_ROWS == [t] * h and unpacked == []
    for name, a, r in zip(names, got, want):
        assert torch.equal(a, r), name


def test_native_stores_need_fsplit(kernel_path, monkeypatch):
    """Kernel 2's `token_rows` key exists in the fsplit form only (the 256-thread one spills):
    with FSPLIT off, NATIVE_STORES on changes nothing (every gradient unpacked)."""
    q, k, v, g, beta, do, *_ = _bf16_problem(1, 130, 2, 2)
    k = F.normalize(k.float(), dim=-1).bfloat16()
    cu = torch.tensor([0, 60, 130], dtype=torch.int32)
    monkeypatch.setattr(bwd, "FSPLIT", False)
    want = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu)
    monkeypatch.setattr(varlen, "NATIVE_STORES", True)
    got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, cu_seqlens=cu)
    assert TOKEN_ROWS == []
    for a, r in zip(got, want):
        assert torch.equal(a, r)


def test_switch_off_is_the_interim_path(kernel_path, monkeypatch):
    """The switch "0" and `interim()`: the interim path; unset: the kernel path (the default)."""
    q, k, v, g, beta, do, *_ = _bf16_problem(1, 10, 1, 1)
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")
    want = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do)
    assert kernel_path == []
    monkeypatch.delenv(bwd.KERNEL_SWITCH)
    with bwd.interim():
        got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do)
    assert kernel_path == []
    for a, r in zip(got, want):
        assert torch.equal(a, r)
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do)
    assert len(kernel_path) == 2


def _like(device, dtype=torch.bfloat16, tokens=10, heads=2):
    """A stand-in for a flat (T, heads, 128) tensor on `device` (CUDA without a GPU: the
    switch reads only the device, dtype and shape)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(tokens, heads, 128))


def test_the_switch(monkeypatch):
    """Unset: the kernel path on CUDA tensors that fit (16-bit, a token, a value head), the
    interim path on CPU tensors; "1" likewise; "0" and `interim()`: the interim path
    everywhere; another value raises."""
    cuda, cpu = _like("cuda"), _like("cpu")
    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    assert bwd.kernel_selected() and bwd._kernel_path(cuda, cuda)
    assert not bwd._kernel_path(cpu, cpu)
    assert not bwd._kernel_path(_like("cuda", torch.float32), cuda)  # 32-bit
    assert not bwd._kernel_path(_like("cuda", tokens=0), _like("cuda", tokens=0))  # T = 0
    assert not bwd._kernel_path(cuda, _like("cuda", heads=0))  # no value head
    with bwd.interim():
        assert not bwd.kernel_selected() and not bwd._kernel_path(cuda, cuda)
    assert bwd._kernel_path(cuda, cuda)  # `interim()` undone on exit
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    assert bwd._kernel_path(cuda, cuda) and not bwd._kernel_path(cpu, cpu)
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")
    assert not bwd.kernel_selected() and not bwd._kernel_path(cuda, cuda)
    for bad in ("2", "true", "on", " 1"):
        monkeypatch.setenv(bwd.KERNEL_SWITCH, bad)
        with pytest.raises(ValueError, match=bwd.KERNEL_SWITCH):
            bwd._kernel_path(cuda, cuda)


def test_cpu_tensors_take_the_interim_path_by_default(monkeypatch):
    """The switch unset, CPU tensors: the interim path, whose gradients match autograd through
    the fp64 recurrence; no kernel entry is reached."""
    from test_gdn_bwd_op import _fp64_grads

    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(bwd, "_backward_kernel", lambda *a: pytest.fail("kernel path"))
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 70, 1, 2, seed=5)
    got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0[:1],
                                                d_final_state=dht[:1],
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    want = _fp64_grads([q, k, v, g, beta, h0[:1]], None, do, dht[:1], l2norm=True,
                       with_state=True)  # fmt: skip
    for a, r in zip(got, want):
        assert float((a.double() - r).abs().max()) <= 2e-2 * float(r.abs().max())


def test_autograd_one_sequence_on_the_kernel_path(kernel_path, monkeypatch):
    """Autograd through `gated_delta_rule` (the forward launcher stubbed): one sequence and
    B = 2 (offsets the wrapper made: the forward op's `batch`) take the kernel path with no host
    read."""
    from test_gdn_bwd_op import _fp64_grads

    _stub_forward(monkeypatch)
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    for b, launches in ((1, 2), (2, 2)):
        kernel_path.clear()
        q, k, v, g, beta, do, h0, _ = _bf16_problem(b, 70, 1, 2, seed=b)
        leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
        o, _ = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
        got = torch.autograd.grad((o.float() * do.float()).sum(), leaves)
        assert len(kernel_path) == launches
        want = _fp64_grads([q, k, v, g, beta, h0], None, do, None, l2norm=True,
                           with_state=True)  # fmt: skip
        for a, r in zip(got, want):
            assert float((a.double() - r).abs().max()) <= 2e-2 * float(r.abs().max())


def _stub_forward(monkeypatch):
    """tests/test_gdn_bwd_op.py's forward stub: the fp32 chunked reference as the launcher."""
    from forgekernel.reference.delta_rule import gated_delta_rule_chunked

    def launch(q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm, out=None):
        o, final = gated_delta_rule_chunked(
            *(x.unsqueeze(0) for x in (q, k, v, g, beta)), scale=scale,
            initial_state=initial_state, output_final_state=True, cu_seqlens=cu_seqlens,
            use_qk_l2norm=l2norm,
        )  # fmt: skip
        return o[0].to(q.dtype).contiguous(), final.contiguous()

    monkeypatch.setattr(fwd, "_launch", launch)
    monkeypatch.setattr(fwd, "check_cuda", lambda name, t: None)


def test_the_wrapper_passes_its_equal_batch(monkeypatch):
    """The wrapper gives the forward op `batch` = B for the offsets it makes for a (B, T) batch
    (with grad, and traced), 0 for a caller's cu_seqlens; the op refuses a count other than 0
    or the number of sequences."""
    _stub_forward(monkeypatch)
    q, k, v, g, beta, *_ = _bf16_problem(3, 20, 1, 1)
    seen = []
    real = torch.ops.forgekernel.gated_delta_rule_chunked
    monkeypatch.setattr(torch.ops.forgekernel, "gated_delta_rule_chunked",
                        lambda *a: seen.append((a[6].tolist(), a[-1])) or real(*a))  # fmt: skip
    forgekernel.gated_delta_rule(q, k, v, g, beta)  # forward only: the launcher directly
    assert seen == []
    forgekernel.gated_delta_rule(q, k, v, g.requires_grad_(), beta)
    assert seen == [([0, 20, 40, 60], 3)]
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    forgekernel.gated_delta_rule(*flat, cu_seqlens=cu)
    assert seen[1:] == [([0, 20, 40, 60], 0)]
    monkeypatch.undo()
    args = (*(x[0].detach() for x in flat), None, cu, 0.1, False, False)
    with pytest.raises(ValueError, match="batch must be 0 or the number of sequences 3"):
        torch.ops.forgekernel.gated_delta_rule_chunked(*args, 2)


def test_autograd_equal_batch_compiled_reads_no_offsets(kernel_path, monkeypatch):
    """Autograd of `gated_delta_rule` at B = 3 equal lengths, eager and under torch.compile
    (fullgraph): the forward op's `batch` reaches the backward (autograd's setup saves it; the
    compiled backward graph passes 3 to the backward op), which takes the kernel path without
    reading the offsets on the host (`_backward_varlen` fails the test); the compiled gradients
    equal the eager ones."""
    from compile_graphs import graphs_backend

    _stub_forward(monkeypatch)
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    q, k, v, g, beta, do, h0, _ = _bf16_problem(3, 70, 1, 2, seed=7)

    def loss(q, k, v, g, beta, h0):
        o, _ = forgekernel.gated_delta_rule(q, k, v, g, beta, initial_state=h0,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
        return (o.float() * do.float()).sum()

    inputs = (q, k, v, g, beta, h0)
    leaves = [x.clone().requires_grad_() for x in inputs]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    assert len(kernel_path) == 2
    graphs: list[str] = []
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=graphs_backend(graphs))
    leaves = [x.clone().requires_grad_() for x in inputs]
    got = torch.autograd.grad(compiled(*leaves), leaves)
    assert len(kernel_path) == 4 and len(graphs) == 2
    assert re.search(r"gated_delta_rule_chunked_bwd\.default\]\(args = \(.*, 3\), kw", graphs[1])
    for a, r in zip(got, eager):
        assert torch.isfinite(r).all()
        torch.testing.assert_close(a, r, rtol=0, atol=0)
