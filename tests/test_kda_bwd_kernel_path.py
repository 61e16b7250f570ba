"""Kimi Delta Attention's backward on kernels 1 and 2 (ops/kda_bwd.py `_backward_kernel`, the
default on CUDA tensors; `FORGEKERNEL_KDA_BWD_KERNEL=0` the interim path) on the CPU
(`KERNEL_DEVICES` widened to "cpu"), kernel 1 replaced by the tile emulation of
tests/test_gdn_bwd_state.py (`tile_model`: token-major tiles, transposed state, zero tail,
dS^T's columns scaled per key channel, the register operands rounded to the tiles' dtype) and
kernel 2 (`CHUNK_IN_KERNEL`) by `reference.kda_bwd_chunk.chunk_grads_model` (its on-chip block
operands rounded to bf16 for 16-bit tiles; CHUNK_IN_KERNEL = False: pass 3 in torch), the WY
kernel (`WY_IN_KERNEL`, on by default) by `reference.kda_bwd_wy.wy_grads_model`, the forward's
first pass (`FACTORS_FROM_FIRST_PASS`, on by default: with the WY kernel, bf16 tiles take the
device pass, `_device_pass`) by its torch model `operands.kda_chunk_operands`, and the
q / k epilogue (`_qk_grads`, Gated DeltaNet's gdn_bwd_norm kernel) by its model `qk_grad_model`
(tests/test_gdn_bwd_kernel_path.py's `emulated_norm_kernel`; NORM_IN_KERNEL = False: torch): the
kernel fed KDA's forward recurrence (`forward_state_tiles` on the sub-chunked factors) against
reference/kda_bwd.py's pass 1, the whole path against the interim backward to fp32 tolerance
(32-bit tiles: nothing rounded) on awkward sizes and strong per-channel decays (g in [-5, -4]
a step), and the op on the kernel path (bf16 tiles rounded) against autograd through the fp64
recurrence; the routing (no host read for equal lengths; varlen, the switch "0", `interim()`,
CPU tensors, other head dims: the interim path; a bad value raises). The GPU twin:
tests/gpu/test_kda_bwd_kernel_path_gpu.py."""

from __future__ import annotations

import importlib
import re
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from slots_alone import CPU_CASES, assert_sequence_alone
from test_gdn_bwd_kernel_path import (
    emulated_norm_kernel,
    forward_inputs_as_reverse,
    native_switch,
    written_to,
)
from test_gdn_bwd_state import tile_model
from test_kda_bwd_op import (
    _fp64_grads,
    cpu_forward,  # noqa: F401  (the fixture)
)
from test_kda_bwd_op import _inputs as op_inputs

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import operands
from forgekernel.reference.gdn_bwd_chunk import token_rows_model
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    chunk_factors,
    forward_state_tiles,
    forward_states,
    out16_forms,
    over_slots,
)
from forgekernel.reference.kda_bwd import _Factors, _states
from forgekernel.reference.kda_bwd_chunk import chunk_grads_model, first_pass_scan
from forgekernel.reference.kda_bwd_wy import wy_grads_model

bwd = importlib.import_module("forgekernel.ops.kda_bwd")
op = importlib.import_module("forgekernel.ops.kda_chunked")
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def emulated_kernel(calls=None, flags=None):
    """kernel 1's stand-in (its `channel_decay` variant): the tile emulation in fp64, the
    register operands rounded to the tiles' dtype where it is 16-bit, fp32 outputs (the
    launcher's); `out16` / `forward` (the device pass) as tests/test_gdn_bwd_kernel_path.py's:
    `out16_forms` of them, I and 0 built in (`flags` records (out16, forward) a launch); dh0:
    the caller's buffer for dS at the start (`written_to`); its varlen form (cu_seqlens,
    order: the slot layout) by `over_slots` on the batch form, one recorded call a launch."""
    batch, quiet = _batch_kernel(calls, flags), _batch_kernel()

    def run(do, pt, ke, qe, w, e_last, dht, dh0=None, out16=False, forward=False,
            cu_seqlens=None, order=None):  # fmt: skip
        if cu_seqlens is None:
            du, side, s0 = batch(do, pt, ke, qe, w, e_last, dht, out16, forward)
            return du, side, written_to(dh0, s0)
        assert out16 and dht is None or dht.shape[0] == cu_seqlens.shape[0] - 1
        if calls is not None:
            calls.append(do.dtype)
        if flags is not None:
            flags.append((out16, forward))
        du, side, s0 = over_slots(quiet, cu_seqlens, order, do, pt, ke, qe, w, e_last, dht,
                                  out16=out16, forward=forward)  # fmt: skip
        return du, side, written_to(dh0, s0)

    return run


def _batch_kernel(calls=None, flags=None):
    """`emulated_kernel`'s batch form (B sequences of T tokens)."""

    def run(do, pt, ke, qe, w, e_last, dht, out16=False, forward=False):
        assert out16 or not forward
        assert (pt is None and qe is None) == forward  # the forward variant builds I and 0 in
        rows = do.shape[1]
        if forward:  # chunks first to last on u, W, Ke as written: the reverse model's
            # inputs by flipping and negating (exact), the outputs flipped back below
            do, pt, ke, qe, w, e_last = forward_inputs_as_reverse(do, ke, w, e_last)
        # the default path hands contiguous tiles; the device pass strided views (head slices,
        # the first pass's rows cut to T: TMA reads them in place, `as_tma_ready`)
        for x in (do, pt, ke, qe, w):
            assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == do.shape[:3]
            assert out16 or x.is_contiguous()
        b, t, hv = do.shape[:3]
        assert e_last.dtype == torch.float32 and e_last.stride(-1) == 1
        assert e_last.shape == (b, -(-t // CHUNK), hv, ke.shape[-1])  # per key channel
        if calls is not None:
            calls.append(do.dtype)
        if flags is not None:
            flags.append((out16, forward))
        low = do.dtype in (torch.float16, torch.bfloat16)

        def rounding(x):
            return x.to(do.dtype).to(x.dtype) if low else x

        factors = {n: x.double() for n, x in zip(("pt", "ke", "qe", "w"), (pt, ke, qe, w))}
        factors["e_last"] = e_last.double()
        dst = None if dht is None else dht.double()
        du, dh, dh0 = (x.float() for x in tile_model(factors, do.double(), dst, rounding))
        if out16:  # the kernel's 16-bit forms (fp32 where the test runs fp32 tiles)
            du, dh = out16_forms(du, dh, do.dtype, forward)
        return du[:, :rows], dh, dh0

    return run


TOKEN_ROWS: list = []  # the emulated kernels' `token_rows` launches: (kernel, tokens)


def emulated_chunk_kernel(calls=None):
    """kernel 2's stand-in: `chunk_grads_model` in fp64 on the launcher's inputs (checked as the
    launcher checks them), the block operands rounded to bf16 for 16-bit tiles, fp32 outputs."""

    def run(do, u, du, q, k, h, dh, big_g, dw16=False, dg=None, dq16=False, scale=1.0, dq=None,
            tables=None, tokens=None):  # fmt: skip
        b, t, hv = do.shape[:3]
        assert dq16 or (scale == 1.0 and dq is None)
        for x in (do, u, du, q, k, h, dh):  # strided views allowed (TMA: `as_tma_ready`)
            assert x.stride(-1) == 1 and x.dtype == do.dtype
        assert big_g.dtype == torch.float32 and big_g.shape == (b, t, hv, q.shape[-1])
        assert h.shape == dh.shape == (b, -(-t // CHUNK), hv, q.shape[-1], do.shape[-1])
        if calls is not None:
            calls.append(do.dtype)
        low = do.dtype in (torch.float16, torch.bfloat16)

        def rounding(x):
            return x.to(torch.bfloat16).to(x.dtype)

        # dq16: q unscaled, the scale on its products in registers (the model on q scale)
        tiles = [x.double() for x in (do, u, du, q, k, h, dh, big_g)]
        if dq16:
            tiles[3] = tiles[3] * scale
        outs = [x.float() for x in chunk_grads_model(*tiles, rounding if low else None)]
        if dw16:  # dw in the tiles' dtype, rounded once from the fp32 product (`_store_rows`)
            outs[2] = outs[2].to(do.dtype)
        if dq16:  # the op's dq: dL/d(q scale) times the scale, rounded once to the tiles' dtype
            outs[0] = (outs[0] * scale).to(do.dtype)
        if tables is not None:  # `token_rows`: dq, dk, dG at the token rows, dw at the slots
            TOKEN_ROWS.append(("chunk", tokens))
            for i in (0, 1, 3):
                outs[i] = token_rows_model(outs[i], *tables, tokens)
        if dq16:
            if dq is not None:
                assert dq.dtype == do.dtype and dq.is_contiguous() and dq.shape == outs[0].shape
                outs[0] = dq.copy_(outs[0])
        if dg is not None:  # dG written into the caller's buffer (the op's `out=` dg)
            assert dg.dtype == torch.float32 and dg.is_contiguous() and dg.shape == outs[3].shape
            outs[3] = dg.copy_(outs[3])
        return tuple(outs)

    return run


def emulated_wy_kernel(calls=None):
    """the WY kernel's stand-in: `wy_grads_model` in fp64 on the launcher's inputs (checked as
    the launcher checks them), the on-chip operands rounded for 16-bit tiles (dvb, dkb to the
    tiles' dtype, the score-gradient blocks' to bf16), fp32 outputs; its dk, dG added in place
    onto kernel 2's (the kernel's read-modify-write)."""

    def run(dw, du, tt, w, k, u, v, beta, big_g, dk, dg, dv16=False, dk16=False, dk_out=None,
            dv=None, dbeta=None, tables=None, tokens=None):  # fmt: skip
        b, t, hv, kd = dw.shape
        for x in (dw, du, tt, w, k, u, v):  # strided views allowed (TMA: `as_tma_ready`)
            assert x.stride(-1) == 1 and x.dtype == dw.dtype and x.shape[:3] == (b, t, hv)
        assert tt.shape[-1] == CHUNK and w.shape == k.shape == dw.shape
        assert beta.dtype == big_g.dtype == torch.float32
        assert beta.shape == (b, t, hv) and big_g.shape == (b, t, hv, kd)
        if calls is not None:
            calls.append(dw.dtype)
        low = dw.dtype in (torch.float16, torch.bfloat16)
        rows = (b, t if tokens is None else tokens, hv, kd)  # `token_rows`: the token rows
        for x in (dk, dg):  # kernel 2's dk, dG: the WY half added onto them in place
            assert x.dtype == torch.float32 and x.is_contiguous() and x.shape == rows
        assert dk.data_ptr() != dg.data_ptr()
        tiles = (x.double() for x in (dw, du, tt, w, k, u, v, beta, big_g))
        m_dk, m_dv, m_dg, m_db = (x.float() for x in wy_grads_model(*tiles, dw.dtype if low
                                                                     else None))  # fmt: skip
        if tables is not None:  # every token row written once: onto zeros, then added
            TOKEN_ROWS.append(("wy", tokens))
            zeros = (torch.zeros((b, tokens, *x.shape[2:]), dtype=x.dtype)
                     for x in (m_dk, m_dv, m_dg, m_db))  # fmt: skip
            m_dk, m_dv, m_dg, m_db = (token_rows_model(x, *tables, tokens, z)
                                      for x, z in zip((m_dk, m_dv, m_dg, m_db), zeros))  # fmt: skip
        if dv16:  # dv in the tiles' dtype, rounded once from the fp32 rows (`_store_rows`)
            m_dv = m_dv.to(dw.dtype)
        for buf, x in ((dv, m_dv), (dbeta, m_db)):  # the caller's buffers (the op's out=)
            assert buf is None or (buf.is_contiguous() and buf.dtype == x.dtype
                                   and buf.shape == x.shape)  # fmt: skip
        dv = m_dv if dv is None else dv.copy_(m_dv)
        dbeta = m_db if dbeta is None else dbeta.copy_(m_db)
        dk.add_(m_dk)
        if dk16:  # the final dk rounded once to the tiles' dtype (dk: scratch)
            assert dk_out is None or (dk_out.dtype == dw.dtype and dk_out.is_contiguous())
            final = dk.to(dw.dtype)
            dk = final if dk_out is None else dk_out.copy_(final)
        else:
            assert dk_out is None
        return dk, dv, dg.add_(m_dg), dbeta

    return run


def emulated_first_pass(calls=None):
    """The first pass's stand-in: its torch model on the launcher's arguments (l2norm off: the
    backward hands it unit rows), B equal lengths known on the host."""

    def run(q, k, g, beta, cu_seqlens, scale, seq_len, bwd=False, v=None):
        assert q.dtype == k.dtype and g.dtype == beta.dtype == torch.float32
        assert cu_seqlens.dtype == torch.int32 and seq_len > 0
        assert v is None or v.dtype == q.dtype
        if calls is not None:
            calls.append((q.dtype, tuple(q.shape), g.shape[1]) + (("bwd",) if bwd else ()))
        return operands.kda_chunk_operands(q, k, g, beta, cu_seqlens, scale, False, seq_len,
                                           bwd=bwd, v=v)  # fmt: skip

    return run


def _all_emulated(monkeypatch, calls=None, chunk_calls=None, norm_calls=None, first_calls=None):
    """Kernel 1, kernel 2, the WY kernel (WY_IN_KERNEL, on by default), the forward's first pass
    (FACTORS_FROM_FIRST_PASS, on by default: bf16 tiles, FIRST_PASS_DTYPES) and the q / k
    epilogue replaced by their emulations (the first pass by its torch model)."""
    monkeypatch.setattr(bwd, "_state_recurrence", emulated_kernel(calls))
    monkeypatch.setattr(bwd, "_chunk_grads", emulated_chunk_kernel(chunk_calls))
    monkeypatch.setattr(bwd, "_wy_kernel", emulated_wy_kernel())
    monkeypatch.setattr(bwd, "_first_pass", emulated_first_pass(first_calls))
    monkeypatch.setattr(bwd, "_qk_grads", emulated_norm_kernel(norm_calls))


def _inputs(b, t, h, hv=None, dk=16, dv=8, seed=0, strong=False, dtype=torch.float64):
    """g (B, T, HV, K) per key channel: in [-5, -4] when `strong`, else in [-1, 0]."""
    hv = hv or h
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    q, k = rnd(b, t, h, dk), F.normalize(rnd(b, t, h, dk), dim=-1)
    v, do = rnd(b, t, hv, dv), rnd(b, t, hv, dv)
    lo = -5.0 if strong else -1.0
    g = lo + torch.rand(b, t, hv, dk, generator=gen, dtype=dtype)
    beta = torch.rand(b, t, hv, generator=gen, dtype=dtype)
    return q, k, v, g, beta, do, rnd(b, hv, dk, dv) * 0.5, rnd(b, hv, dk, dv) * 0.5


@pytest.mark.parametrize("t", [1, 65, 200])
@pytest.mark.parametrize("b", [1, 3])
@pytest.mark.parametrize("with_h0", [False, True])
def test_forward_recurrence_on_the_reverse_kernel(t, b, with_h0):
    """Kernel 1 fed KDA's `forward_state_tiles` (e^(G_C) per key channel, chunks reversed)
    runs pass 1: h and U equal reference/kda_bwd.py's `_states` (fp64, exact emulation)."""
    q, k, v, g, beta, _, h0, _ = _inputs(b, t, 2, seed=t, strong=t == 200)
    h0 = h0 if with_h0 else None
    f = chunk_factors(q, k, v, g, beta, _Factors)
    fw = forward_state_tiles(f, torch.float64)
    assert fw["e_last"].shape == (b, f.w.shape[1], 2, 16)
    tiles = {n: fw[n] for n in ("pt", "ke", "qe", "w", "e_last")}
    du, dh, _ = tile_model(tiles, fw["do"], h0, rounding=lambda x: x)
    h, big_u = forward_states(du, dh)
    nc = f.w.shape[1]

    def steps(x):  # (B, NC, ...) -> the reference's step-major (NC B, ...)
        return x.transpose(0, 1).flatten(0, 1)

    ref = SimpleNamespace(q=steps(f.q), u=steps(f.u), w=steps(f.w), ke=steps(f.ke),
                          e_last=steps(f.e_last))  # fmt: skip
    start = torch.zeros(b, 2, 16, 8, dtype=torch.float64) if h0 is None else h0
    want_h, want_u = _states(ref, start, [(j * b, b) for j in range(nc)])
    torch.testing.assert_close(h, want_h.unflatten(0, (nc, b)).transpose(0, 1), rtol=1e-10,
                               atol=1e-10)  # fmt: skip
    torch.testing.assert_close(big_u, want_u.unflatten(0, (nc, b)).transpose(0, 1), rtol=1e-10,
                               atol=1e-10)  # fmt: skip


def _flat(x, b, t):
    return x.reshape(b * t, *x.shape[2:])


def _interim_and_kernel(b, t, h, hv, *, l2norm, with_h0, with_dht, strong, seed=0):
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, h, hv, seed=seed, strong=strong,
                                            dtype=torch.float32)  # fmt: skip
    if l2norm:
        k = k * 2.0
    h0, dht = (h0 if with_h0 else None), (dht if with_dht else None)
    flat = [_flat(x, b, t) for x in (q, k, v, g, beta, do)]
    cu = torch.arange(b + 1, dtype=torch.int32) * t
    scale = 16**-0.5
    want = bwd._backward_interim(*flat[:5], h0, cu, flat[5], dht, scale, l2norm)
    got = bwd._backward_kernel(*flat[:5], h0, flat[5], dht, scale, l2norm, b)
    return got, want


def _close(name, got, want, tol):
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), name
    err = float((got.double() - want.double()).abs().max())
    assert err <= tol * float(want.abs().max()) + 1e-6, (name, err, float(want.abs().max()))


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht", "strong"),
    [
        (1, 1, 1, 1, False, True, True, False),
        (2, 63, 2, 2, True, False, True, False),
        (1, 64, 1, 2, False, True, False, True),
        (3, 65, 2, 4, True, True, True, True),
        (2, 200, 1, 2, True, True, True, False),
        (1, 200, 2, 2, False, False, False, True),
    ],
)
@pytest.mark.parametrize("chunk_in_kernel", [True, False])
def test_kernel_path_equals_the_interim_path(monkeypatch, b, t, h, hv, l2norm, with_h0,
                                             with_dht, strong, chunk_in_kernel):  # fmt: skip
    """fp32 tiles and the exact emulations: every gradient within 1e-4 of its max of the
    interim path's (T = 1, 63, 64, 65, 200; grouped heads; l2norm; g in [-5, -4] a step), pass
    3's output side on kernel 2 or in torch; the WY half in torch (WY_IN_KERNEL pinned off: on,
    the default, in the next test)."""
    calls, chunk_calls, norm_calls = [], [], []
    _all_emulated(monkeypatch, calls, chunk_calls, norm_calls)
    monkeypatch.setattr(bwd, "CHUNK_IN_KERNEL", chunk_in_kernel)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", False)
    got, want = _interim_and_kernel(b, t, h, hv, l2norm=l2norm, with_h0=with_h0,
                                    with_dht=with_dht, strong=strong, seed=t)  # fmt: skip
    assert calls == [torch.float32, torch.float32]  # the forward states, the reverse pass
    assert chunk_calls == [torch.float32] * chunk_in_kernel
    assert norm_calls == [(h, hv, l2norm)] * 2  # the epilogue: dq, then dk
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm", "with_h0", "with_dht", "strong"),
    [
        (1, 1, 1, 1, False, True, True, False),
        (2, 63, 2, 2, True, False, True, False),
        (1, 64, 1, 2, False, True, False, True),
        (3, 65, 2, 4, True, True, True, True),
        (1, 200, 2, 2, False, False, False, True),
    ],
)
def test_wy_kernel_path_equals_the_interim_path(monkeypatch, b, t, h, hv, l2norm, with_h0,
                                                with_dht, strong):  # fmt: skip
    """WY_IN_KERNEL (the default, set here; the WY half on its kernel, emulated by
    `wy_grads_model`), fp32 tiles: every gradient within 1e-4 of its max of the interim path's
    (T = 1, 63, 64, 65, 200; grouped heads; g in [-5, -4] a step); the WY kernel called once a
    pass, with the tiles' dtype."""
    wy_calls = []
    _all_emulated(monkeypatch)
    monkeypatch.setattr(bwd, "_wy_kernel", emulated_wy_kernel(wy_calls))
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    got, want = _interim_and_kernel(b, t, h, hv, l2norm=l2norm, with_h0=with_h0,
                                    with_dht=with_dht, strong=strong, seed=t)  # fmt: skip
    assert wy_calls == [torch.float32]
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)


@pytest.mark.parametrize(
    ("lens", "with_h0"), [([1, 63, 0, 64, 65, 130], True), ([3, 129, 7], False), ([0, 5], True)]
)
@pytest.mark.parametrize("wy_in_kernel", [False, True])
def test_varlen_buckets_equal_the_interim_path(monkeypatch, lens, with_h0, wy_in_kernel):
    """Unequal sequences behind cu_seqlens on the kernel path (`_backward_varlen`: buckets of
    sequences padded at their ends, one kernel-path call a bucket; fp32 tiles, the exact
    emulations) equal the interim path, empty sequences included (the state gradient passes
    through their padding); the WY half in torch or on its kernel (WY_IN_KERNEL)."""
    calls, chunk_calls, norm_calls = [], [], []
    _all_emulated(monkeypatch, calls, chunk_calls, norm_calls)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", wy_in_kernel)
    n, t = len(lens), sum(lens)
    q, k, v, g, beta, do, _, _ = _inputs(1, t, 2, 4, seed=n, dtype=torch.float32)
    *_, h0, dht = _inputs(n, 1, 2, 4, seed=9, dtype=torch.float32)
    flat = [x[0] for x in (q, k, v, g, beta, do)]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    h0 = h0 if with_h0 else None
    want = bwd._backward_interim(*flat[:5], h0, cu, flat[5], dht, 0.25, True)
    got = bwd._backward_varlen(*flat[:5], h0, flat[5], dht, 0.25, True, cu)
    buckets = len(varlen.buckets(lens))
    assert buckets > 1 or n == 2
    assert len(calls) == 2 * buckets and len(chunk_calls) == buckets
    assert len(norm_calls) == 2 * buckets  # the q / k epilogue: dq, dk a bucket
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)


def test_head_passes_are_the_one_pass(monkeypatch):
    """Value heads in passes (one q head's group a pass; their outputs concatenated) give the
    one pass's gradients (no concatenation); the epilogue runs once for dq, once for dk either
    way, on every value head."""
    chunk_calls, norm_calls = [], []
    _all_emulated(monkeypatch, chunk_calls=chunk_calls, norm_calls=norm_calls)
    one, _ = _interim_and_kernel(2, 70, 2, 4, l2norm=True, with_h0=True, with_dht=True,
                                 strong=False)  # fmt: skip
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 140 * 2)
    calls = []
    monkeypatch.setattr(bwd, "_state_recurrence", emulated_kernel(calls))
    passes, _ = _interim_and_kernel(2, 70, 2, 4, l2norm=True, with_h0=True, with_dht=True,
                                    strong=False)  # fmt: skip
    assert len(calls) == 4 and len(chunk_calls) == 1 + 2  # kernel 2 once a pass
    assert norm_calls == [(2, 4, True)] * 4  # dq, dk: after the one pass, after the two
    for name, a, r in zip(NAMES, passes, one):
        torch.testing.assert_close(a, r, rtol=1e-6, atol=1e-6, msg=name)


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm"),
    [(1, 65, 1, 1, True), (2, 63, 2, 4, True), (1, 200, 2, 2, False), (3, 65, 1, 2, False)],
)
def test_qk_epilogue_is_the_torch_one(monkeypatch, b, t, h, hv, l2norm):
    """The q / k epilogue (`_qk_grads`, emulated: `qk_grad_model`) runs once for dq, once for
    dk, at H heads from HV, on the op's q / k, and gives NORM_IN_KERNEL = False's torch
    epilogue's gradients (dq, dk to 1e-5 of their max; the rest identical); both within 1e-4
    of the interim path's."""
    grads = {}
    for on in (True, False):
        norm_calls = []
        _all_emulated(monkeypatch, norm_calls=norm_calls)
        monkeypatch.setattr(bwd, "NORM_IN_KERNEL", on)
        grads[on], want = _interim_and_kernel(b, t, h, hv, l2norm=l2norm, with_h0=True,
                                              with_dht=True, strong=True, seed=t + 5)  # fmt: skip
        assert norm_calls == ([(h, hv, l2norm)] * 2 if on else [])
        for name, a, r in zip(NAMES, grads[on], want):
            _close(name, a, r, 1e-4)
    for i, (name, a, r) in enumerate(zip(NAMES, grads[True], grads[False])):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        if i < 2:
            _close(name, a, r, 1e-5)
        else:
            assert torch.equal(a, r), name


# ---- the op with the switch on (bf16, the forward launcher stubbed as tests/test_kda_bwd_op);
# the module's defaults: bf16 takes the device pass (FACTORS_FROM_FIRST_PASS and WY_IN_KERNEL),
# the first pass on its torch model


@pytest.fixture
def kernel_path(monkeypatch, request):
    request.getfixturevalue("cpu_forward")  # the forward launcher stubbed
    calls = []
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "KERNEL_DEVICES", ("cuda", "cpu"))
    _all_emulated(monkeypatch, calls)
    TOKEN_ROWS.clear()
    return calls


def _bf16_problem(b, t, h, hv, *, decay=(-1.0, 0.0), seed=0):
    inputs, _ = op_inputs([t], h, hv, l2norm=True, decay=decay, seed=seed, b=b)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(*inputs[2].shape, generator=gen).bfloat16()
    dht = torch.randn(*inputs[5].shape, generator=gen) * 0.1
    return inputs, do, dht


def test_first_pass_offsets_are_cached_per_shape(kernel_path, monkeypatch):
    """The device pass hands the first pass `equal_offsets`' tensor (next/linattn-bwd-host: no
    arange a call): a repeated call the same tensor and the same gradients bit for bit, a new
    length its own offsets 0, T, ..., B T."""
    seen, model = [], emulated_first_pass()

    def first_pass(*args, **kw):
        seen.append(args[4])
        return model(*args, **kw)

    monkeypatch.setattr(bwd, "_first_pass", first_pass)
    monkeypatch.setattr(bwd.first_pass_launch, "_OFFSETS", {})
    grads = []
    for t in (65, 65, 130):
        (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, t, 1, 2, seed=3)
        grads.append(bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                       d_final_state=dht,
                                                       use_qk_l2norm_in_kernel=True))  # fmt: skip
    assert seen[0] is seen[1] and seen[0].tolist() == [0, 65, 130]
    assert seen[2] is not seen[0] and seen[2].tolist() == [0, 130, 260]
    assert all(torch.equal(a, b) for a, b in zip(*grads[:2]))


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "decay"),
    [(2, 65, 1, 2, (-1.0, 0.0)), (1, 130, 2, 2, (-5.0, -4.0)), (2, 64, 1, 1, (-5.0, 0.0))],
)
def test_explicit_backward_on_the_kernel_path(kernel_path, monkeypatch, b, t, h, hv, decay):
    """`kimi_delta_attention_backward` with the switch on takes the kernel path (the device pass
    by default; two launches: the forward states, the reverse pass) and matches autograd
    through the fp64 recurrence within 2e-2 of each gradient's max (bf16 tiles, the emulation's
    bf16 operands), g in [-5, -4] per channel included."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, hv, decay=decay, seed=t)
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    got = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                            d_final_state=dht,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    assert kernel_path == [torch.bfloat16, torch.bfloat16]
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True)
    for name, a, r in zip(NAMES, got, want):
        like = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta}.get(name, dht)
        assert a.dtype == like.dtype, name
        _close(name, a, r, 2e-2)


def test_equal_varlen_equals_the_batch(kernel_path):
    """B equal sequences behind cu_seqlens (B = 1 + offsets: the suite's batch form) give the
    (B, T) call's gradients."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, 70, 1, 2, seed=4)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    batch = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta, do)]
    cu = torch.tensor([0, 70, 140], dtype=torch.int32)
    varlen = bwd.kimi_delta_attention_backward(*flat, cu_seqlens=cu, **kw)
    assert len(kernel_path) == 4
    for name, a, r in zip(NAMES, varlen, batch):
        assert torch.isfinite(r).all(), name
        torch.testing.assert_close(a.reshape(r.shape), r, rtol=0, atol=0, msg=name)


def scanned_first_pass():
    """The first pass's stand-in with G (`big_g`, what kernel 2 and the WY kernel read) as the
    kernel sums it in fp32 (`first_pass_scan`), the rest as `emulated_first_pass`' (its
    torch cumsum: the same G on every row past a chunk's last gate). B equal sequences of
    seq_len, as the backward calls it: each sequence's chunks in order, rows past it zero."""
    exact = emulated_first_pass()

    def run(q, k, g, beta, cu_seqlens, scale, seq_len, bwd=False, v=None):
        out = exact(q, k, g, beta, cu_seqlens, scale, seq_len, bwd=bwd, v=v)
        b, nc = cu_seqlens.shape[0] - 1, -(-seq_len // CHUNK)
        padded = g.new_zeros(b, nc * CHUNK, *g.shape[1:])
        padded[:, :seq_len] = g.unflatten(0, (b, seq_len))
        chunks = padded.unflatten(1, (nc, CHUNK)).transpose(2, 3)  # (B, NC, HV, C, K)
        big_g = first_pass_scan(chunks).transpose(2, 3).flatten(0, 2)
        inside = (torch.arange(nc * CHUNK) < seq_len).repeat(b).view(-1, 1, 1)
        out["big_g"] = big_g * inside
        return out

    return run


@pytest.mark.parametrize(("lens", "scan"), CPU_CASES)
def test_varlen_in_slots_is_each_sequence_alone(kernel_path, monkeypatch, lens, scan):
    """bf16 on the device pass (the default; every kernel emulated, the first pass on its torch
    model): unequal sequences in the slot layout (ops/_linattn_varlen.py), one launch each,
    against each sequence's own batch-path call, as tests/slots_alone.py states it (an empty
    sequence's state gradient is d_final_state's). With G summed sequentially (`scan` False:
    the torch model) bit for bit everywhere; with the first pass's sums (`scan`,
    `first_pass_scan`) dk and dg of the last chunk of sequence 1 (301 % 64 = 45 rows: G_C
    at row 44 in warp 2's upper half alone, row 63 in the slots; the H100's failing case of
    2026-12-06 13:38) differ in their last bits, within the tolerance; sequences 0 (2 rows) and
    3 (39 rows: a lower half, whose later rows repeat its G exactly) bit for bit."""
    if scan:
        monkeypatch.setattr(bwd, "_first_pass", scanned_first_pass())
    n, t = len(lens), sum(lens)
    (q, k, v, g, beta, _), do, _ = _bf16_problem(1, t, 1, 2, seed=t)
    (*_, h0), _, dht = _bf16_problem(n, 1, 1, 2, seed=n)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"use_qk_l2norm_in_kernel": True}
    got = bwd.kimi_delta_attention_backward(
        q, k, v, g, beta, do, cu_seqlens=cu, initial_state=h0, d_final_state=dht, **kw
    )
    assert len(kernel_path) == 2
    equal = []
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            assert torch.equal(got[5][i], dht[i])
            continue
        one = bwd.kimi_delta_attention_backward(
            *(x[:, a:z] for x in (q, k, v, g, beta, do)), initial_state=h0[i : i + 1],
            d_final_state=dht[i : i + 1], **kw)  # fmt: skip
        assert_sequence_alone(NAMES[:5], got, one, a, z, i)
        assert torch.equal(got[5][i : i + 1], one[5]), i
        equal.append(all(torch.equal(x[:, a:z], r) for x, r in zip(got[:5], one)))
    # the sequential G: every sequence bit for bit; the sums': sequence 1 not (the H100's)
    assert equal == ([True] * len(equal) if not scan else [True, False, True])


def test_equal_varlen_in_slots_is_the_batch(kernel_path):
    """Equal lengths in the slot layout (as a CUDA-graph capture runs them: no host read) give
    the (B, T) call's gradients bit for bit."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, 70, 1, 2, seed=4)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    batch = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    flat = [x.flatten(0, 1) for x in (q, k, v, g, beta, do)]
    cu = torch.tensor([0, 70, 140], dtype=torch.int32)

    def run(q, k, v, g, beta, do, h0, dht, slots):
        return bwd._backward_kernel(q, k, v, g, beta, h0, do, dht, 128**-0.5, True, 1,
                                    slots=slots)  # fmt: skip

    got = varlen.run_in_slots(run, flat, (h0, dht), cu)
    assert len(kernel_path) == 4
    for name, a, r in zip(NAMES, got, batch):
        assert torch.isfinite(r).all(), name
        assert torch.equal(a.reshape(r.shape), r), name


def test_varlen_capture_takes_the_slot_layout(kernel_path, monkeypatch):
    """Under a CUDA-graph capture (emulated: `capturing` true) every call runs once in the slot
    layout, equal lengths too (NOTES "next/capture-drop"), as Gated DeltaNet's: unequal
    lengths bit for bit their eager call (the same path), equal ones within 2e-2 of eager's
    batch path, with as many kernel-1 launches."""
    (q, k, v, g, beta, _), do, _ = _bf16_problem(1, 140, 1, 2, seed=3)
    (*_, h0), _, dht = _bf16_problem(2, 1, 1, 2, seed=2)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    slots = []
    real = varlen.run_in_slots
    monkeypatch.setattr(varlen, "run_in_slots", lambda *a: slots.append(1) or real(*a))
    for lens in ([70, 70], [64, 76]):
        cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
        want = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, cu_seqlens=cu, **kw)
        slots.clear()
        with monkeypatch.context() as m:
            m.setattr(varlen, "capturing", lambda t: True)
            kernel_path.clear()
            got = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, cu_seqlens=cu, **kw)
        assert slots == [1] and len(kernel_path) == 2  # kernel 1's two launches
        for name, a, r in zip(NAMES, got, want):
            if lens[0] != lens[1]:
                assert torch.equal(a, r), (lens, name)
            else:
                err = float((a.double() - r.double()).abs().max())
                assert err <= 2e-2 * float(r.abs().max()) + 1e-6, (lens, name, err)


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "capture"),
    [
        ([1, 0, 65, 64, 200, 0, 7], 1, 1, False, False),  # the WY kernel writes the op's dk
        ([1, 0, 65, 64, 200, 0, 7], 1, 2, True, True),  # the epilogue on the callers' q, k
        ([60, 70], 2, 2, True, False),
        ([65, 65], 1, 2, False, True),  # equal lengths: the slot layout under a capture only
    ],
)
def test_native_stores_are_the_slot_path(kernel_path, monkeypatch, lens, h, hv, l2norm,
                                         capture):  # fmt: skip
    """NATIVE_STORES on (ops/_linattn_varlen.py): kernel 2's and the WY kernel's `token_rows`
    forms (emulated: `token_rows_model`, kernel 2's dq, dk, dG and the WY kernel's dv, dbeta and
    its dk, dG added at the callers' token rows) write every token gradient there, nothing
    unpacked; every gradient bit for bit the slot path's (switch off), eager and under a
    capture (emulated); into the op's out= buffers in place, also with value heads in two
    passes (Gated DeltaNet's test of the name)."""
    n, t = len(lens), sum(lens)
    (q, k, v, g, beta, _), _ = op_inputs([t], h, hv, l2norm=l2norm, seed=t)
    gen = torch.Generator().manual_seed(t + 1)
    do = torch.randn(*v.shape, generator=gen).bfloat16()
    h0 = torch.randn(n, hv, 128, 128, generator=gen) * 0.1
    dht = torch.randn(n, hv, 128, 128, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "initial_state": h0, "d_final_state": dht,
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
    call, unpacked = native_switch(monkeypatch, bwd.kimi_delta_attention_backward,
                                   (q, k, v, g, beta, do), kw, capture, TOKEN_ROWS)  # fmt: skip
    want = call(False)
    assert TOKEN_ROWS == [] and len(unpacked) == 5
    got = call(True)
    assert TOKEN_ROWS == [("chunk", t), ("wy", t)] and unpacked == []
    for name, a, r in zip(NAMES, got, want):
        assert torch.isfinite(r).all(), name
        assert a.shape == r.shape and a.dtype == r.dtype and torch.equal(a, r), name
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    got = call(True, out)
    for name, a, o, r in zip(NAMES, got, out, want):
        assert a.data_ptr() == o.data_ptr() and torch.equal(o, r), name
    if h > 1:
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", t * (hv // h))  # one q head a pass
        got = call(True)
        assert TOKEN_ROWS == [("chunk", t), ("wy", t)] * h and unpacked == []
        for name, a, r in zip(NAMES, got, want):
            assert torch.equal(a, r), name


@pytest.mark.parametrize("b", [1, 2])
def test_autograd_on_the_kernel_path(kernel_path, monkeypatch, b):
    """Autograd of `kimi_delta_attention` without cu_seqlens (B = 1, and B = 2: the offsets the
    wrapper made, the forward op's `batch`) takes the kernel path with no host read and matches
    autograd through the fp64 recurrence."""
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    inputs, do, dht = _bf16_problem(b, 100, 2, 4, decay=(-5.0, 0.0), seed=b)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, final = op.kimi_delta_attention(*leaves[:5], initial_state=leaves[5],
                                       output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), leaves)
    assert kernel_path == [torch.bfloat16, torch.bfloat16]
    want = _fp64_grads(inputs, None, do, dht, l2norm=True)
    for name, a, r in zip(NAMES, grads, want):
        _close(name, a, r, 2e-2)


def test_autograd_equal_batch_compiled_reads_no_offsets(kernel_path, monkeypatch):
    """Autograd of `kimi_delta_attention` at B = 3 equal lengths, eager and under torch.compile
    (fullgraph): the forward op's `batch` reaches the backward (autograd's setup saves it; the
    compiled backward graph passes 3 to the backward op), which takes the kernel path without
    reading the offsets on the host; the compiled gradients equal the eager ones."""
    from compile_graphs import graphs_backend

    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    inputs, do, dht = _bf16_problem(3, 70, 1, 2, seed=7)

    def loss(q, k, v, g, beta, h0):
        o, final = op.kimi_delta_attention(q, k, v, g, beta, initial_state=h0,
                                           output_final_state=True,
                                           use_qk_l2norm_in_kernel=True)  # fmt: skip
        return (o.float() * do.float()).sum() + (final * dht).sum()

    leaves = [x.clone().requires_grad_() for x in inputs]
    eager = torch.autograd.grad(loss(*leaves), leaves)
    assert len(kernel_path) == 2
    graphs: list[str] = []
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=graphs_backend(graphs))
    leaves = [x.clone().requires_grad_() for x in inputs]
    got = torch.autograd.grad(compiled(*leaves), leaves)
    assert len(kernel_path) == 4 and len(graphs) == 2
    assert re.search(r"kda_chunked_bwd\.default\]\(args = \(.*, 3\), kw", graphs[1])
    for name, a, r in zip(NAMES, got, eager):
        assert torch.isfinite(r).all(), name
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


@pytest.mark.usefixtures("cpu_forward")  # the forward launcher stubbed
def test_the_wrapper_passes_its_equal_batch(monkeypatch):
    """The wrapper gives the forward op `batch` = B for the offsets it makes for a (B, T) batch,
    0 for a caller's cu_seqlens; the op refuses a count other than 0 or the sequences'."""
    (q, k, v, g, beta, _), _, _ = _bf16_problem(3, 20, 1, 1)
    seen = []
    real = torch.ops.forgekernel.kda_chunked
    monkeypatch.setattr(torch.ops.forgekernel, "kda_chunked",
                        lambda *a: seen.append((a[6].tolist(), a[-1])) or real(*a))  # fmt: skip
    op.kimi_delta_attention(q, k, v, g.requires_grad_(), beta)
    assert seen == [([0, 20, 40, 60], 3)]
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta)]
    cu = torch.tensor([0, 20, 40, 60], dtype=torch.int32)
    op.kimi_delta_attention(*flat, cu_seqlens=cu)
    assert seen[1:] == [([0, 20, 40, 60], 0)]
    args = (*(x[0].detach() for x in flat), None, cu, 0.1, False)
    with pytest.raises(ValueError, match="batch must be 0 or the number of sequences 3"):
        real(*args, 2)


def test_routing_to_the_interim_path(kernel_path, monkeypatch):
    """The switch "0", `interim()`, and head dims other than kernel 1's take the interim path;
    unequal sequences behind cu_seqlens (in the slot layout), equal ones (the offsets read on
    the host) and one sequence take the kernel path."""
    seen = []
    interim = bwd._backward_interim
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: seen.append(1) or interim(*a))
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(1, 130, 1, 2, seed=3)
    cu = torch.tensor([0, 60, 130], dtype=torch.int32)
    h0 = h0.expand(2, -1, -1, -1).contiguous()
    bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0, cu_seqlens=cu)
    assert seen == [] and kernel_path == [torch.bfloat16, torch.bfloat16]  # one launch
    one = torch.tensor([0, 130], dtype=torch.int32)  # one sequence: the kernel path
    bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0[:1], cu_seqlens=one)
    assert seen == [] and len(kernel_path) == 4
    equal = torch.tensor([0, 65, 130], dtype=torch.int32)  # read on the host: equal lengths
    bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0, cu_seqlens=equal)
    assert seen == [] and len(kernel_path) == 6
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")
    bwd.kimi_delta_attention_backward(q, k, v, g, beta, do)
    assert seen == [1] and len(kernel_path) == 6
    monkeypatch.delenv(bwd.KERNEL_SWITCH)  # the default: the kernel path
    with bwd.interim():
        bwd.kimi_delta_attention_backward(q, k, v, g, beta, do)
    assert seen == [1, 1] and len(kernel_path) == 6
    bwd.kimi_delta_attention_backward(q, k, v, g, beta, do)
    assert seen == [1, 1] and len(kernel_path) == 8
    assert bwd._kernel_path(q.flatten(0, 1), v.flatten(0, 1))
    assert not bwd._kernel_path(q.flatten(0, 1)[..., :64], v.flatten(0, 1))  # (K, V) (64, 128)
    assert not bwd._kernel_path(q.flatten(0, 1).float(), v.flatten(0, 1))  # 32-bit
    assert not bwd._kernel_path(q.flatten(0, 1)[:0], v.flatten(0, 1)[:0])  # T = 0


@pytest.mark.parametrize("decay", [(-5.0, 0.0), (-5.0, -4.0)])
def test_kernel_2_on_the_path_and_its_fallback(kernel_path, monkeypatch, decay):
    """bf16 with the switch on: kernel 2 (emulated, bf16 block operands) once, fed the tiles'
    dtype (on the device pass, the default); CHUNK_IN_KERNEL = False runs pass 3 in torch
    instead (the torch factors, the WY half in torch: both switches need kernel 2); both within
    2e-2 of autograd through the fp64 recurrence, and within 1e-2 of each other."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, 130, 1, 2, decay=decay, seed=9)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    chunk_calls = []
    monkeypatch.setattr(bwd, "_chunk_grads", emulated_chunk_kernel(chunk_calls))
    on_chip = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert chunk_calls == [torch.bfloat16]
    monkeypatch.setattr(bwd, "CHUNK_IN_KERNEL", False)
    in_torch = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert chunk_calls == [torch.bfloat16]
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True)
    for name, a, b, r in zip(NAMES, on_chip, in_torch, want):
        _close(name, a, r, 2e-2)
        _close(name, a, b, 1e-2)


@pytest.mark.parametrize("decay", [(-5.0, 0.0), (-5.0, -4.0)])
def test_wy_kernel_on_the_path_and_off(kernel_path, monkeypatch, decay):
    """bf16 with the switch on, the torch factors (FACTORS_FROM_FIRST_PASS pinned off; both
    on, the default, is the device pass: tests/test_kda_bwd_first_pass_factors.py):
    WY_IN_KERNEL pinned off (the WY half in torch, the WY kernel never called); on, the WY
    kernel (emulated, its on-chip operands rounded) once, fed the tiles' dtype; both within 2e-2
    of autograd through the fp64 recurrence and within 1e-2 of each other."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, 130, 1, 2, decay=decay, seed=9)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    wy_calls = []
    monkeypatch.setattr(bwd, "_wy_kernel", emulated_wy_kernel(wy_calls))
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", False)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", False)
    in_torch = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert wy_calls == []
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    on_chip = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert wy_calls == [torch.bfloat16]
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True)
    for name, a, b, r in zip(NAMES, on_chip, in_torch, want):
        assert a.dtype == b.dtype, name
        _close(name, a, r, 2e-2)
        _close(name, a, b, 1e-2)


def _like(device, dtype=torch.bfloat16, tokens=10, heads=2, dim=128):
    """A stand-in for a flat (T, heads, dim) tensor on `device` (CUDA without a GPU: the switch
    reads only the device, dtype and shape)."""
    return SimpleNamespace(device=torch.device(device), dtype=dtype, shape=(tokens, heads, dim))


def test_the_switch(monkeypatch):
    """Unset: the kernel path on CUDA tensors that fit (16-bit, (K, V) = (128, 128), a token, a
    value head), the interim path on CPU tensors; "1" likewise; "0" and `interim()`: the
    interim path everywhere; another value raises."""
    cuda, cpu = _like("cuda"), _like("cpu")
    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    assert bwd.kernel_selected() and bwd._kernel_path(cuda, cuda)
    assert not bwd._kernel_path(cpu, cpu)
    assert not bwd._kernel_path(_like("cuda", torch.float32), cuda)  # 32-bit
    assert not bwd._kernel_path(_like("cuda", dim=64), cuda)  # (K, V) (64, 128)
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


def test_cpu_tensors_take_the_interim_path_by_default(monkeypatch, request):
    """The switch unset, CPU tensors: autograd of `kimi_delta_attention` takes the interim
    path, whose gradients match autograd through the fp64 recurrence; no kernel entry is
    reached."""
    request.getfixturevalue("cpu_forward")  # the forward launcher stubbed
    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "_backward_kernel", lambda *a: pytest.fail("kernel path"))
    inputs, do, dht = _bf16_problem(1, 70, 1, 2, decay=(-5.0, 0.0), seed=6)
    leaves = [x.clone().requires_grad_() for x in inputs]
    o, final = op.kimi_delta_attention(*leaves[:5], initial_state=leaves[5],
                                       output_final_state=True,
                                       use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), leaves)
    want = _fp64_grads(inputs, None, do, dht, l2norm=True)
    for name, a, r in zip(NAMES, grads, want):
        _close(name, a, r, 2e-2)


@pytest.mark.parametrize(("b", "t", "h", "decay"),
                         [(2, 65, 2, (-1.0, 0.0)), (1, 130, 1, (-5.0, -4.0))])  # fmt: skip
def test_final_outputs_without_l2norm(kernel_path, monkeypatch, b, t, h, decay):
    """Without l2norm at HV = H (`_folds`, FINAL_QK): kernel 2 reads q unscaled (dq16, the
    scale in the emulation's products) and writes the op's dq, no epilogue, dv / dbeta / dq /
    dk written straight into `out=`; within 2e-2 of autograd through the fp64 recurrence, and
    dq within one bf16 rounding step of FINAL_QK = False's (the fp32 dq and its epilogue)
    results. The WY kernel writes the op's dk (dk16) with FINAL_QK either way (`_writes_dk`,
    next/kda-glue3)."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, h, decay=decay, seed=t)
    q, k = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))  # unit rows, no l2norm
    flags = []
    monkeypatch.setattr(bwd, "_chunk_grads", _recording(bwd._chunk_grads, flags))
    norm_calls = []
    monkeypatch.setattr(bwd, "_qk_grads", emulated_norm_kernel(norm_calls))
    got = {}
    for on in (True, False):
        monkeypatch.setattr(bwd, "FINAL_QK", on)
        out = tuple(torch.empty_like(x) for x in (q, k, v, g, beta)) + (None,)
        got[on] = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht, out=out)  # fmt: skip
        for a, o in zip(got[on][:5], out[:5]):
            assert a is o
    # the dq epilogue only when off; never dk's (the WY kernel writes it: `_writes_dk`)
    assert flags == [True, False] and len(norm_calls) == 1
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=False)
    for name, a, r in zip(NAMES, got[True], want):
        _close(name, a, r, 2e-2)
    for i, name in enumerate(("dq", "dk")):
        a, r = got[True][i].float(), got[False][i].float()
        step = r.abs().clamp_min(2.0**-126) * 2.0**-7  # one bf16 rounding step of the fp32 path
        assert ((a - r).abs() <= step * 2 + 1e-3 * r.abs().max()).all(), name


@pytest.mark.parametrize(("b", "t", "h"), [(2, 65, 2), (1, 130, 1), (1, 64, 3)])
def test_wy_final_dk_is_the_epilogues_bit_for_bit(kernel_path, monkeypatch, b, t, h):
    """Without l2norm at HV = H on the device pass the WY kernel writes the op's dk (dk16,
    `_writes_dk`, no switch since next/kda-glue3): no dk epilogue launch (the dq one stays,
    FINAL_QK off), and every gradient bit for bit the path's with dk16 off (kernel 2's fp32 dk
    plus the WY half, cast by the epilogue with scale 1: the same fp32 sum rounded once)."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, h, seed=t)
    q, k = (F.normalize(x.float(), dim=-1).bfloat16() for x in (q, k))  # unit rows, no l2norm
    assert not bwd.FINAL_QK
    got = {}
    for on in (True, False):
        norm_calls = []
        monkeypatch.setattr(bwd, "_qk_grads", emulated_norm_kernel(norm_calls))
        monkeypatch.setattr(bwd, "_writes_dk", lambda *a, on=on: on and bwd._on_device(a[-1]))
        got[on] = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht)  # fmt: skip
        assert len(norm_calls) == (1 if on else 2)
    for name, a, r in zip(NAMES, got[True], got[False]):
        assert a.dtype == r.dtype and torch.equal(a, r), name


def _recording(fn, flags):
    def run(*args, **kwargs):
        flags.append(bool(kwargs.get("dq16")))
        return fn(*args, **kwargs)

    return run
