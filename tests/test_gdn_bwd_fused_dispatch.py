"""The fused backward's dispatch on the op's device pass (ops/gated_delta_rule_bwd.py FUSED,
`_fused_pass`; kernels/linear_attention/gdn_bwd_fused/sm90) on the CPU: the rule (B x HV at
least three quarters of a wave, `config.fused_fits`), the switches on by default, and the path
with the switch on, the fused kernel replaced by an emulation built from the two kernels it
fuses (tests/test_gdn_bwd_kernel_path.py's tile emulations of kernel 1's reverse launch and
kernel 2's WY variant, fed Ke = k e^(G_C - G), Qe = q e^G and e^(G_C) formed from the fused
kernel's own inputs: what the kernel folds in registers; with FUSED_DIET, U = u - W h as its
`u_from_h` key forms it, `reference.gdn_bwd_state.u_from_states`). Checked: the inputs it is handed
(shapes, dtypes, strided views as TMA reads them), one launch in place of the reverse launch
and kernel 2, and the gradients against today's path and autograd through the fp64
recurrence (2e-2 of each gradient's max). FUSED_GROUPSUM (next/gdn-bwd-groupsum, the `group_sum`
key: dq, dk summed over the two value heads of a head in the kernel): on by default, its rule,
its route (no norm epilogue without l2norm; the epilogue on the H-head sums with it) and the
launcher's checks. The GPU twins: tests/gpu/test_gdn_bwd_fused_gpu.py,
tests/gpu/test_gdn_bwd_groupsum_gpu.py. FUSED_SLOTS_GROUPSUM (next/gdn-bwd-slots-groupsum, the
`varlen, group_sum` key, off): its rule and its route in the slot layout (GPU twin:
tests/gpu/test_gdn_bwd_slots_groupsum_gpu.py)."""

from __future__ import annotations

import importlib
from types import SimpleNamespace

import pytest
import torch
from test_gdn_bwd_kernel_path import (  # noqa: F401  (kernel_path: a fixture)
    CHUNK_CALLS,
    FLAGS,
    _bf16_problem,
    emulated_chunk_wy_kernel,
    emulated_kernel,
    kernel_path,
    written_to,
)

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import config
from forgekernel.reference.gdn_bwd_chunk import token_rows_model
from forgekernel.reference.gdn_bwd_factors import w_u_from_t
from forgekernel.reference.gdn_bwd_state import u_from_states

bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def emulated_fused_kernel(calls):
    """The fused kernel's stand-in: kernel 1's reverse emulation and kernel 2's WY emulation on
    the factors the kernel forms from its inputs (Ke, Qe, e^(G_C) from k, q and G; u None:
    U = uw - W h, the `u_from_h` key); its `varlen` key (cu_seqlens, order, tables, tokens: the
    slot layout) by their varlen forms (kernel 1's walk, kernel 2's `token_rows`); its
    `group_sum` key by kernel 2's fp32 dq, dk summed over each q / k head's two value heads in
    fp32, dq times the scale, rounded once at the H heads (with `varlen`: then at the token
    rows, `token_rows_model`); w, uw None (`wg_split, w_from_t`): W, u formed from T^T, k, v
    by `w_u_from_t`. Calls recorded as (do's shape, q's heads, dht given, scale, U formed in
    the kernel), `tokens` appended with varlen, "group_sum" with that key, "w_from_t" with
    that one."""
    reverse, chunk = emulated_kernel(), emulated_chunk_wy_kernel()

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, scale=1.0, out=None,
            cu_seqlens=None, order=None, tables=None, tokens=None, group_sum=False,
            wg_split=False):  # fmt: skip
        walk = {} if cu_seqlens is None else {"cu_seqlens": cu_seqlens, "order": order}
        rows = {} if tables is None else {"tables": tables, "tokens": tokens, "fsplit": True}
        assert (cu_seqlens is None) == (order is None) == (tables is None) == (tokens is None)
        b, t, hv, _ = do.shape
        nc = -(-t // 64)
        w_from_t = w is None
        assert (uw is None) == w_from_t and (not w_from_t or (wg_split and u is None))
        if w_from_t:  # `wg_split, w_from_t`: W, u formed in the kernel
            w, uw = w_u_from_t(tt, k, v, beta, big_g)
        for x in (do, pt, tt, w, uw, v) if u is None else (do, u, pt, tt, w, uw, v):
            assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == (b, t, hv)
        assert q.shape == k.shape and q.shape[:2] == (b, t) and hv % q.shape[2] == 0
        assert h.shape == (b, nc, hv, q.shape[-1], do.shape[-1]) and h.dtype == do.dtype
        assert big_g.dtype == beta.dtype == torch.float32 and big_g.shape == beta.shape
        calls.append((tuple(do.shape), q.shape[2], dht is not None, scale, u is None)
                     + (() if tokens is None else (tokens,))
                     + (("group_sum",) if group_sum else ())
                     + (("w_from_t",) if w_from_t else ()))  # fmt: skip
        if u is None:  # `u_from_h`
            u = u_from_states(uw, w, h)
        group = hv // q.shape[2]
        qh, kh = (x.double().repeat_interleave(group, dim=2) for x in (q, k))
        last = torch.clamp(torch.arange(nc) * 64 + 63, max=t - 1)
        g_last = big_g.double()[:, last]  # (B, NC, HV): G at each chunk's last token
        g_c = g_last.repeat_interleave(64, dim=1)[:, :t]
        ke = (kh * (g_c - big_g.double()).exp().unsqueeze(-1)).to(do.dtype)
        qe = (qh * big_g.double().exp().unsqueeze(-1)).to(do.dtype)
        du, dh, dh0 = reverse(do, pt, ke, qe, w, g_last.exp().float().contiguous(), dht,
                              out16=True, **walk)  # fmt: skip
        if group_sum:  # fp32 dq, dk at the value heads, summed in pairs, rounded once
            assert hv == config.PAIR * q.shape[2]
            got = chunk(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, dv16=True)
            dq, dk = (x.unflatten(2, (q.shape[2], config.PAIR)).sum(3) for x in got[:2])
            got = ((dq * scale).to(do.dtype), dk.to(do.dtype), *got[2:])
            if rows:  # `varlen, group_sum`: the slot rows' sums at their token rows
                outs = (None,) * 5 if out is None else out[:5]
                got = tuple(token_rows_model(x, *tables, tokens, o) for x, o in zip(got, outs))
            elif out is not None:
                got = tuple(written_to(o, x) for o, x in zip(out[:5], got))
        else:
            got = chunk(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, dv16=True,
                        dqk16=True, scale=scale, out=None if out is None else out[:5],
                        **rows)  # fmt: skip
        return (*got, dh0 if out is None else written_to(out[5], dh0))

    return run


@pytest.mark.parametrize(
    ("b", "hv", "sms", "fused"),
    [(4, 32, 132, True), (1, 32, 132, False), (1, 128, 132, True), (3, 32, 132, False),
     (3, 33, 132, True), (4, 32, 0, False), (0, 32, 132, False)],
)  # fmt: skip
def test_the_rule(b, hv, sms, fused):
    """B x HV >= 3/4 of the SMs (99 of the H100's 132: 4 x 8192 hv32's 128 CTAs fused, 1 x
    2048 / 1 x 8192 hv32's 32 today's path); no SM count (CPU tensors): never."""
    assert config.fused_fits(b, hv, sms) == fused


def test_on_by_default():
    """FUSED, FUSED_DIET; FUSED_SLOTS and FUSED_GROUPSUM since the H100 A/Bs of 2026-12-07
    (NOTES "next/gdn-bwd-adopt"); FUSED_SLOTS_GROUPSUM and FUSED_WFROMT off until their device
    A/Bs (NOTES "next/gdn-bwd-slots-groupsum", "next/gdn-w-from-t")."""
    assert bwd.FUSED is True and bwd.FUSED_DIET is True
    assert bwd.FUSED_SLOTS is True and bwd.FUSED_GROUPSUM is True
    assert bwd.FUSED_SLOTS_GROUPSUM is False and bwd.FUSED_WFROMT is False


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm"), [(1, 130, 2, 2, False),
                                                            (2, 65, 1, 2, True)])  # fmt: skip
def test_fused_path_equals_todays(kernel_path, monkeypatch, b, t, h, hv, l2norm):  # noqa: F811
    """FUSED on and the rule met (the SM count patched to B x HV): one fused launch after
    kernel 1's forward launch, no reverse launch, no kernel 2 (at HV = 2 H its `group_sum` key:
    FUSED_GROUPSUM, the default); the gradients those of today's path (FUSED off) and of
    autograd through the fp64 recurrence within 2e-2 of their max."""
    from test_gdn_bwd_op import _fp64_grads

    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=t + hv)
    if not l2norm:  # unit keys (the recurrence stays bounded without the op's normalization)
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()

    def run():
        return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                     d_final_state=dht,
                                                     use_qk_l2norm_in_kernel=l2norm)  # fmt: skip

    today = run()
    calls = []
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: b * hv)
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    FLAGS.clear()
    CHUNK_CALLS.clear()
    got = run()
    fold = not l2norm and h == hv
    pair = ("group_sum",) if hv == config.PAIR * h else ()
    assert calls == [((b, t, hv, 128), h, True, 128**-0.5 if fold else 1.0, True, *pair)]
    assert FLAGS == [(True, True)] and CHUNK_CALLS == []  # the forward launch only
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=l2norm, with_state=True)
    for name, a, r, o in zip(NAMES, got, want, today):
        assert a.dtype == o.dtype and a.shape == o.shape, name
        scale = float(r.abs().max())
        assert float((a.double() - r).abs().max()) <= 2e-2 * scale, name
        assert float((a.double() - o.double()).abs().max()) <= 2e-2 * scale, name


@pytest.mark.parametrize("passes", [1, 2])
def test_fused_out_and_passes(kernel_path, monkeypatch, passes):  # noqa: F811
    """FUSED's route with the op's out= (NaN-filled: every gradient written in place) and in
    value-head passes (TOKEN_HEADS_PER_PASS cut: one fused launch a pass on strided head
    slices, joined into out=): within 2e-2 of today's path. The glue of the GPU test
    `test_the_default_rule_with_out_and_a_graph` on the emulation (next/int45-review)."""
    b, t, h, hv = 2, 65, 2, 4
    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=11)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    kw = {"initial_state": h0, "d_final_state": dht}
    if passes > 1:  # h / passes q heads a pass
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", b * t * (hv // h) * (h // passes))
    today = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, **kw)
    calls = []
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: b * hv // passes)
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    out = tuple(torch.full_like(x, float("nan")) for x in today)
    got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, out=out, **kw)
    assert [c[0] for c in calls] == [(b, t, hv // passes, 128)] * passes
    for name, a, o, r in zip(NAMES, got, out, today):
        assert a.data_ptr() == o.data_ptr() and torch.isfinite(o).all(), name
        err = float((o.double() - r.double()).abs().max())
        assert err <= 2e-2 * float(r.abs().max()), (name, err)


def test_small_grids_keep_todays_path(kernel_path, monkeypatch):  # noqa: F811
    """FUSED on but B x HV below the rule: today's reverse launch and kernel 2."""
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 65, 2, 2, seed=3)
    calls = []
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 132)
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    FLAGS.clear()
    CHUNK_CALLS.clear()
    forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                          d_final_state=dht)  # fmt: skip
    assert calls == [] and FLAGS == [(True, True), (True, False)]
    assert CHUNK_CALLS == [torch.bfloat16]


@pytest.mark.parametrize(
    ("env", "fused", "b", "hv", "sms", "want"),
    [(None, False, 4, 32, 132, False), (None, True, 4, 32, 132, True),
     (None, True, 1, 32, 132, False), ("0", True, 4, 32, 132, False),
     ("1", False, 4, 32, 132, True), ("1", False, 1, 2, 132, False),
     ("all", False, 1, 2, 132, True), ("all", False, 1, 2, 0, True)],
)  # fmt: skip
def test_the_switch(monkeypatch, env, fused, b, hv, sms, want):
    """FUSED (the constant), FUSED_SWITCH overriding it ("1": the rule, "all": every device
    pass, for the GPU checks' small shapes; "0": off); never without QK16."""
    if env is None:
        monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    else:
        monkeypatch.setenv(bwd.FUSED_SWITCH, env)
    monkeypatch.setattr(bwd, "FUSED", fused)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: sms)
    assert bwd._fused_selected(b, hv, torch.device("cpu")) == want
    monkeypatch.setattr(bwd, "QK16", False)
    assert not bwd._fused_selected(b, hv, torch.device("cpu"))


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [65, 65]])
def test_varlen(kernel_path, monkeypatch, lens):  # noqa: F811
    """FUSED on and the rule met, cu_seqlens (ops/_linattn_varlen.py `backward_varlen`): equal
    lengths are B sequences (a reshape) on the fused kernel (HV = 2 H: its `group_sum` key);
    unequal ones run once in the slot layout (the default), today's reverse launch and kernel 2
    (the slot layout's fused route, FUSED_SLOTS, takes `config.slots_fit`: at most one wave, N x
    HV > 1 SM here): no fused launch and the gradients FUSED off's bit for bit. The GPU twin's
    test_varlen."""
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, total, 2, 4, seed=n)
    h0, dht = (x.expand(n, -1, -1, -1).contiguous() for x in (h0, dht))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)

    def run():
        return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                     d_final_state=dht, cu_seqlens=cu,
                                                     use_qk_l2norm_in_kernel=True)  # fmt: skip

    today = run()
    calls = []
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 1)  # the rule met at any B x HV
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    FLAGS.clear()
    CHUNK_CALLS.clear()
    got = run()
    if len(set(lens)) == 1:
        assert calls == [((n, lens[0], 4, 128), 2, True, 1.0, True, "group_sum")]
        assert CHUNK_CALLS == []
        for name, a, o in zip(NAMES, got, today):
            scale = float(o.abs().max())
            assert float((a.double() - o.double()).abs().max()) <= 2e-2 * scale, name
    else:
        assert calls == [] and CHUNK_CALLS == [torch.bfloat16]
        assert FLAGS == [(True, True), (True, False)]  # kernel 1's two launches, varlen form
        for name, a, o in zip(NAMES, got, today):
            assert torch.equal(a, o), name


@pytest.mark.parametrize(("t", "dtype"), [(1, torch.bfloat16), (65, torch.float16),
                                          (130, torch.bfloat16)])  # fmt: skip
def test_the_diet_keys_models(t, dtype):
    """FUSED_DIET's kernel models on one problem (grouped: H = 2, HV = 4): kernel 0's `fused`
    tiles are the standard ones less Ke, Qe; kernel 1's `fused` forward launch (k and G in place
    of Ke, `reference.gdn_bwd_state.decayed_keys`; no U) gives the `forward` key's h within the
    16-bit rounding of Ke; the fused kernel's `u_from_h` U (`u_from_states`: u - W h, rounded
    once) is the U the `forward` launch writes up to one rounding of the 16-bit result."""
    from test_gdn_bwd_kernel_path import emulated_factors_kernel

    from forgekernel.reference.gdn_bwd_factors import forward_launch_tiles

    q, k, v, g, beta, *_ = _bf16_problem(2, t, 2, 4, seed=t)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    q, k, v = (x.to(dtype) for x in (q, k, v))
    tiles = {f: emulated_factors_kernel()(q, k, v, g, beta, fused=f) for f in (False, True)}
    assert set(tiles[True]) == set(tiles[False]) - {"ke", "qe"}
    for name, x in tiles[True].items():
        assert torch.equal(x, tiles[False][name]), name
    h0 = torch.randn(2, 4, 128, 128, generator=torch.Generator().manual_seed(t)) * 0.1
    run = emulated_kernel()
    fw = forward_launch_tiles(tiles[False], identity=False)
    u16, h16, s16 = run(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")), fw["e_last"], h0,
                        out16=True, forward=True)  # fmt: skip
    fw = forward_launch_tiles(tiles[True], identity=False, k=k)
    assert fw["w"] is k and fw["big_g"] is tiles[True]["big_g"]
    none, h_fused, s_fused = run(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")), fw["e_last"],
                                 h0, out16=True, forward=True, big_g=fw["big_g"])  # fmt: skip
    assert none is None
    for a, r in ((h_fused, h16), (s_fused, s16)):
        err = float((a.double() - r.double()).abs().max())
        assert err <= 1e-2 * float(r.double().abs().max()), err
    got = u_from_states(tiles[False]["u"][:, :t], tiles[False]["w"][:, :t], h16)
    u16 = u16[:, :t]  # the launch's rows: every chunk's (the tiles as kernel 0 wrote them)
    assert got.dtype == dtype and got.shape == u16.shape
    ulp = torch.finfo(dtype).eps * u16.double().abs() + 1e-6
    assert bool(((got.double() - u16.double()).abs() <= ulp).all())


def test_diet_off_is_the_fused_route_of_before(kernel_path, monkeypatch):  # noqa: F811
    """FUSED_DIET (the default) against it off: on, kernel 0's `fused` key (no Ke, Qe), the
    forward launch's `fused` key (k and G in place of Ke, no U) and the fused kernel handed no
    U; off, kernel 0's standard key, Ke read, U written and read. The gradients within 1e-2 of
    each other's max (they differ by the 16-bit roundings of Ke and U only)."""
    b, t, h, hv = 2, 130, 2, 4
    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=5)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: b * hv)
    real = bwd._factors
    keys = []
    monkeypatch.setattr(
        bwd, "_factors", lambda *a, **kw: keys.append(kw.get("fused", False)) or real(*a, **kw)
    )
    state = bwd._state_recurrence
    forward = []  # the forward launch on k and G (its `fused` key): w is k (B, T, H, K)
    monkeypatch.setattr(bwd, "_state_recurrence",
                        lambda *a, **kw: forward.append(("big_g" in kw, a[4].shape == k.shape))
                        or state(*a, **kw))  # fmt: skip
    grads = {}
    for diet in (True, False):
        calls = []
        monkeypatch.setattr(bwd, "FUSED_DIET", diet)
        monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
        grads[diet] = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do,
                                                            initial_state=h0,
                                                            d_final_state=dht)  # fmt: skip
        assert [c[4] for c in calls] == [diet]  # U formed in the kernel
    assert keys == [True, False] and forward == [(True, True), (False, False)]
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        err = float((a.double() - o.double()).abs().max())
        assert err <= 1e-2 * float(o.abs().max()), (name, err)


@pytest.mark.parametrize(
    ("env", "fused_env", "on", "tables", "n", "hv", "want"),
    [(None, None, False, True, 4, 32, False), (None, None, True, True, 4, 32, True),
     (None, None, True, True, 4, 16, False), (None, None, True, False, 4, 32, False),
     ("0", None, True, True, 4, 32, False), ("1", None, False, True, 4, 32, True),
     ("1", "0", False, True, 4, 32, False), ("1", "all", False, True, 1, 2, True),
     ("1", "all", False, False, 1, 2, False), (None, None, True, True, 4, 33, True),
     (None, None, True, True, 5, 32, False), (None, None, True, True, 16, 32, False)],
)  # fmt: skip
def test_fused_slots_rule(monkeypatch, env, fused_env, on, tables, n, hv, want):
    """The slot layout's fused route: FUSED_SLOTS (FUSED_SLOTS_SWITCH overriding it), the
    per-slot tables present (`native`: the kernel writes token rows only), then N x HV from
    3/4 of a wave to one wave (`config.slots_fit`: 4 x 8192 hv32's 128 CTAs of 132 SMs fused,
    hv16's 64 not, 4 x 33 = 132 fused, 5 x 32 = 160 and the suites' mix16 hv32 512 not);
    FUSED_SWITCH "0" off, "all" every shape."""
    for name, value in ((bwd.FUSED_SLOTS_SWITCH, env), (bwd.FUSED_SWITCH, fused_env)):
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", on)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 132)
    table = torch.zeros(n + 8, dtype=torch.int32)
    slots = SimpleNamespace(cu_seqlens=torch.zeros(n + 1, dtype=torch.int32),
                            starts=table if tables else None, lengths=table)  # fmt: skip
    assert bwd._fused_slots_selected(slots, hv, torch.device("cpu")) == want


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "capture"),
    [
        ([1, 0, 65, 64, 200, 0, 7], 2, 2, False, False),  # the fused kernel writes dq, dk
        ([1, 0, 65, 64, 200, 0, 7], 2, 4, False, True),  # the epilogue on the callers' q, k
        ([60, 70], 2, 2, True, False),
        ([65, 65], 2, 4, True, True),  # equal lengths: the slot layout under a capture only
        ([128, 64], 1, 2, False, True),  # no tail chunk, a zero slot each
        ([0, 0], 2, 2, False, True),  # T = 0: no token, not the kernel path
    ],
)
@pytest.mark.parametrize("diet", [True, False])
def test_fused_slots_are_the_slot_path(kernel_path, monkeypatch, lens, h, hv, l2norm,  # noqa: F811
                                       capture, diet):  # fmt: skip
    """FUSED_SLOTS on and the rule met: the slot layout's device pass runs kernel 1's forward
    launch (varlen) and ONE fused launch (emulated: kernel 1's varlen walk + kernel 2's
    `token_rows`, `emulated_fused_kernel`) on the slot tiles with the tables and the callers'
    token count, no reverse launch, no kernel 2, nothing unpacked. FUSED_DIET on or off, kernel
    0's and the forward launch's standard keys (their `fused` keys are batch-only: Ke read, U
    written); on, the fused kernel handed no U (`varlen, u_from_h`). Every gradient within 2e-2
    of its max of the two-launch slot path's (FUSED_SLOTS off: Ke, Qe formed from k, q, G
    instead of kernel 0's, as on the batch path); empty, one-token, tail-cut and
    slot-aligned sequences, eager and under a capture (emulated); into NaN-filled out= in
    place; value heads in passes (one q head a pass: a fused launch each, joined) bit for bit
    the one pass."""
    n, t = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _bf16_problem(1, t, h, hv, seed=t)
    if not l2norm:  # unit rows as the op expects them there (the recurrence stays bounded)
        k = (k.float() / k.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).bfloat16()
    *_, h0, dht = _bf16_problem(n, 1, h, hv, seed=n)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "initial_state": h0, "d_final_state": dht,
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
    unpacked, calls = [], []
    real = varlen.unpack
    monkeypatch.setattr(varlen, "unpack", lambda *a: unpacked.append(1) or real(*a))
    monkeypatch.setattr(bwd, "_device_sms", lambda device: n * hv)
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    monkeypatch.setattr(bwd, "FUSED_DIET", diet)
    keys = []  # kernel 0's `fused` asked for, the forward launch handed G (its `fused` key)
    factors, state = bwd._factors, bwd._state_recurrence
    monkeypatch.setattr(
        bwd, "_factors", lambda *a, **kw: keys.append(kw.get("fused")) or factors(*a, **kw)
    )
    monkeypatch.setattr(bwd, "_state_recurrence",
                        lambda *a, **kw: keys.append("big_g" in kw) or state(*a, **kw))  # fmt: skip

    def call(fused, out=None):
        monkeypatch.setattr(bwd, "FUSED_SLOTS", fused)
        keys.clear()
        FLAGS.clear()
        CHUNK_CALLS.clear()
        unpacked.clear()
        calls.clear()
        with monkeypatch.context() as m:
            if capture:
                m.setattr(varlen, "capturing", lambda t: True)
            return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, out=out, **kw)

    want = call(False)
    assert calls == [] and unpacked == []
    got = call(True)
    if t == 0:
        assert calls == []
        for name, a, r in zip(NAMES, got, want):
            assert torch.equal(a, r), name
        return
    rows = 64 * (t // 64 + n)  # the slot layout's S C
    fold = not l2norm and h == hv
    assert calls == [((1, rows, hv, 128), h, True, 128**-0.5 if fold else 1.0, diet, t)]
    assert FLAGS == [(True, True)] and CHUNK_CALLS == [] and unpacked == []
    assert keys == [False, False]
    for name, a, r in zip(NAMES, got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        err = float((a.double() - r.double()).abs().max())
        assert err <= 2e-2 * float(r.abs().max()) + 1e-6, (name, err)
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    again = call(True, out)
    for name, a, o, r in zip(NAMES, again, out, got):
        assert a.data_ptr() == o.data_ptr() and torch.equal(o, r), name
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", t * (hv // h))  # one q head a pass
    monkeypatch.setattr(bwd, "_device_sms", lambda device: n * (hv // h))  # a pass's CTAs
    again = call(True)
    assert [c[0][2] for c in calls] == [hv // h] * h and unpacked == []
    for name, a, r in zip(NAMES, again, got):
        assert torch.equal(a, r), name


def _launcher_inputs(t, n=None):
    """The fused launcher's inputs (B = 1, HV 2, CPU: only the checks run), T rows; with n the
    slot layout's (N + 1,) offsets of n sequences of t // n tokens, order and tables."""
    bf = {"dtype": torch.bfloat16}
    do, u, v, uw = (torch.zeros(1, t, 2, 128, **bf) for _ in range(4))
    q, k, w = (torch.zeros(1, t, 2, 128, **bf) for _ in range(3))
    pt, tt = (torch.zeros(1, t, 2, 64, **bf) for _ in range(2))
    h = torch.zeros(1, -(-t // 64), 2, 128, 128, **bf)
    big_g, beta = torch.zeros(1, t, 2), torch.zeros(1, t, 2)
    args = [do, u, q, k, h, big_g, pt, tt, w, uw, v, beta]
    if n is None:
        return args, {}
    i32 = {"dtype": torch.int32}
    walk = {
        "cu_seqlens": torch.arange(n + 1, **i32) * 8,
        "order": torch.arange(n, **i32),
        "tables": (torch.zeros(t // 64, **i32), torch.zeros(t // 64, **i32)),
        "tokens": 8 * n,
    }
    return args, walk


def test_launcher_varlen_checks():
    """`gdn_bwd_fused`'s slot layout: cu_seqlens, order, tables, tokens all or none (kernel 1's
    `check_varlen`, kernel 2's `check_tables`), dht at N sequences, out= at T' rows and N
    states; `empty_outputs` at the callers' T' rows and N states."""
    from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch

    args, walk = _launcher_inputs(64 * 5, n=3)
    for drop in walk:
        with pytest.raises(ValueError):
            launch.gdn_bwd_fused(*args, None, **{k: x for k, x in walk.items() if k != drop})
    with pytest.raises(ValueError, match="dht"):
        launch.gdn_bwd_fused(*args, torch.zeros(1, 2, 128, 128), **walk)
    bad = {**walk, "tables": (walk["tables"][0][:-1], walk["tables"][1])}
    with pytest.raises(ValueError, match="tables"):
        launch.gdn_bwd_fused(*args, None, **bad)
    outs = launch.empty_outputs(args[0], 128, 24, 3)
    with pytest.raises(ValueError, match="token rows"):
        launch.gdn_bwd_fused(*args, None, out=launch.empty_outputs(args[0], 128), **walk)
    shapes = [tuple(x.shape) for x in outs]
    assert shapes == [(1, 24, 2, 128), (1, 24, 2, 128), (1, 24, 2), (1, 24, 2, 128), (1, 24, 2),
                      (3, 2, 128, 128)]  # fmt: skip


# ---- FUSED_GROUPSUM (next/gdn-bwd-groupsum): dq, dk summed over a cluster's two value heads


@pytest.mark.parametrize(
    ("on", "h", "hv", "one", "slots", "sms", "want"),
    [(True, 16, 32, True, None, 128, True), (False, 16, 32, True, None, 128, False),
     (True, 16, 16, True, None, 64, False), (True, 8, 32, True, None, 128, False),
     (True, 16, 32, False, None, 128, False), (True, 16, 32, True, "slots", 128, False),
     (True, 16, 32, True, None, 1000, False)],
)  # fmt: skip
def test_groupsum_rule(monkeypatch, on, h, hv, one, slots, sms, want):
    """`_pair_sums`: FUSED_GROUPSUM, HV = 2 H (hv16 and hv = 4 H keep the epilogue), one pass of
    heads, no slot layout, and the fused route's own rule (B x HV against the SM count: 4 x
    32 fills 3/4 of 128 SMs, not of 1000)."""
    monkeypatch.delenv(bwd.FUSED_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", on)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: sms)
    assert bwd._pair_sums(4, h, hv, torch.device("cpu"), one, slots) == want


@pytest.mark.parametrize(("b", "t", "h", "l2norm", "with_out"),
                         [(1, 130, 2, False, False), (2, 65, 1, True, False),
                          (2, 63, 2, False, True), (1, 1, 1, True, True)])  # fmt: skip
def test_groupsum_route(kernel_path, monkeypatch, b, t, h, l2norm, with_out):  # noqa: F811
    """FUSED_GROUPSUM on, HV = 2 H and the fused rule met: one fused launch with `group_sum`,
    dq / dk handed back at the H heads; without l2norm with the op's scale and no epilogue
    launch (the op's out= buffers written by the kernel itself), with l2norm at scale 1 and the
    epilogue once each for dq and dk on the H-head sums (group 1); the gradients within 2e-2
    of today's path (FUSED_GROUPSUM off: the epilogue's group sum) and of autograd through the
    fp64 recurrence."""
    from test_gdn_bwd_op import _fp64_grads

    hv = config.PAIR * h
    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=t + 3 * h)
    if not l2norm:
        k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: b * hv)
    calls = []
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    epilogue = []
    real_qk = bwd._qk_grads
    monkeypatch.setattr(bwd, "_qk_grads", lambda dxs, x, *a, **kw: epilogue.append(
        (dxs.shape[2], x.shape[2])) or real_qk(dxs, x, *a, **kw))  # fmt: skip

    def run():
        out = None
        if with_out:
            likes = (q, k, v, g, beta)
            out = (*(torch.full_like(x, float("nan")) for x in likes),
                   torch.full_like(h0, float("nan")))  # fmt: skip
        got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                    d_final_state=dht, out=out,
                                                    use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
        if with_out:
            assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
        return got

    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    today = run()
    assert epilogue == [(hv, h), (hv, h)]
    calls.clear()
    epilogue.clear()
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", True)
    got = run()
    scale = 1.0 if l2norm else 128**-0.5
    assert calls == [((b, t, hv, 128), h, True, scale, True, "group_sum")]
    assert epilogue == ([(h, h), (h, h)] if l2norm else [])
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=l2norm, with_state=True)
    for name, a, r, o in zip(NAMES, got, want, today):
        assert a.dtype == o.dtype and a.shape == o.shape and torch.isfinite(a).all(), name
        bound = 2e-2 * float(r.abs().max())
        assert float((a.double() - r).abs().max()) <= bound, name
        assert float((a.double() - o.double()).abs().max()) <= bound, name


@pytest.mark.parametrize(
    ("on", "slots_on", "h", "hv", "tables", "n", "want"),
    [(True, True, 16, 32, True, 4, True),  # 4 x 8192 h16 hv32 under a capture: the key
     (False, True, 16, 32, True, 4, False),  # FUSED_SLOTS_GROUPSUM off (the default)
     (True, False, 16, 32, True, 4, False),  # FUSED_SLOTS off: the two-launch slot path
     (True, True, 16, 32, False, 4, False),  # no tables (not `native`): no fused slot route
     (True, True, 8, 32, True, 4, False),  # HV = 4 H: the epilogue's group sum
     (True, True, 8, 16, True, 4, False),  # 64 CTAs: below `slots_fit`'s 3/4 of a wave
     (True, True, 16, 32, True, 5, False)],  # 160 CTAs: beyond one wave
)  # fmt: skip
def test_slots_groupsum_rule(monkeypatch, on, slots_on, h, hv, tables, n, want):
    """`_pair_sums` in the varlen slot layout (next/gdn-bwd-slots-groupsum): FUSED_GROUPSUM,
    FUSED_SLOTS_GROUPSUM, HV = 2 H, one pass of heads and the fused slot route
    (`_fused_slots_selected`: FUSED_SLOTS, the tables, `slots_fit` on 132 SMs)."""
    for name in (bwd.FUSED_SWITCH, bwd.FUSED_SLOTS_SWITCH):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", True)
    monkeypatch.setattr(bwd, "FUSED_SLOTS", slots_on)
    monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", on)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 132)
    table = torch.zeros(n + 8, dtype=torch.int32)
    slots = SimpleNamespace(cu_seqlens=torch.zeros(n + 1, dtype=torch.int32),
                            starts=table if tables else None, lengths=table)  # fmt: skip
    cpu = torch.device("cpu")
    assert bwd._pair_sums(1, h, hv, cpu, True, slots) == want
    assert not bwd._pair_sums(1, h, hv, cpu, False, slots)  # head passes
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", False)
    assert not bwd._pair_sums(1, h, hv, cpu, True, slots)


@pytest.mark.parametrize(
    ("lens", "h", "l2norm", "capture"),
    [([1, 0, 65, 64, 200, 0, 7], 2, False, False),  # the kernel's sums are the op's dq, dk
     ([1, 0, 65, 64, 200, 0, 7], 1, True, True),  # the epilogue on the H-head sums
     ([65, 65], 2, False, True),  # equal lengths: the slot layout under a capture only
     ([128, 64], 1, True, False),  # no tail chunk, a zero slot each
     ([0, 0], 2, False, True)],  # T = 0: no token, not the kernel path
)  # fmt: skip
def test_slots_groupsum_route(kernel_path, monkeypatch, lens, h, l2norm, capture):  # noqa: F811
    """FUSED_SLOTS_GROUPSUM forced on (FUSED_SLOTS, FUSED_GROUPSUM on, the slot rule met), HV =
    2 H: the slot layout's one fused launch carries `group_sum` (the `varlen, group_sum` key,
    emulated: kernel 2's fp32 dq, dk summed in pairs at the slot rows, rounded once, then at
    their token rows), dq / dk handed back at the H heads; without l2norm with the op's scale
    and no epilogue launch, with l2norm at scale 1 and the epilogue once each on the H-head
    sums (group 1) at the callers' rows; every gradient within 2e-2 of its max of the switch
    off (the `varlen` key, the epilogue's group sum); empty, one-token, tail-cut and
    slot-aligned sequences, eager and under a capture (emulated); out= NaN-filled, written in
    place, bit for bit the call without it."""
    n, t, hv = len(lens), sum(lens), config.PAIR * h
    q, k, v, g, beta, do, *_ = _bf16_problem(1, t, h, hv, seed=t + h)
    if not l2norm:  # unit rows as the op expects them there (the recurrence stays bounded)
        k = (k.float() / k.float().norm(dim=-1, keepdim=True).clamp_min(1e-6)).bfloat16()
    *_, h0, dht = _bf16_problem(n, 1, h, hv, seed=n)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    kw = {"cu_seqlens": cu, "initial_state": h0, "d_final_state": dht,
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
    calls, epilogue = [], []
    monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
    monkeypatch.setattr(bwd, "FUSED_GROUPSUM", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: n * hv)
    monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
    real_qk = bwd._qk_grads
    monkeypatch.setattr(bwd, "_qk_grads", lambda dxs, x, *a, **k2: epilogue.append(
        (dxs.shape[2], x.shape[2])) or real_qk(dxs, x, *a, **k2))  # fmt: skip

    def call(on, out=None):
        monkeypatch.setattr(bwd, "FUSED_SLOTS_GROUPSUM", on)
        calls.clear()
        epilogue.clear()
        with monkeypatch.context() as m:
            if capture:
                m.setattr(varlen, "capturing", lambda t: True)
            return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, out=out, **kw)

    want = call(False)
    if t == 0:
        assert calls == [] and epilogue == []
        for name, a, r in zip(NAMES, call(True), want):
            assert torch.equal(a, r), name
        return
    rows = 64 * (t // 64 + n)  # the slot layout's S C
    assert calls == [((1, rows, hv, 128), h, True, 1.0, True, t)]
    assert epilogue == [(hv, h), (hv, h)]
    got = call(True)
    scale = 1.0 if l2norm else 128**-0.5
    assert calls == [((1, rows, hv, 128), h, True, scale, True, t, "group_sum")]
    assert epilogue == ([(h, h), (h, h)] if l2norm else [])
    for name, a, r in zip(NAMES, got, want):
        assert a.shape == r.shape and a.dtype == r.dtype and torch.isfinite(a).all(), name
        err = float((a.double() - r.double()).abs().max())
        assert err <= 2e-2 * float(r.abs().max()) + 1e-6, (name, err)
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    again = call(True, out)
    assert calls[-1][-1] == "group_sum"
    for name, a, o, r in zip(NAMES, again, out, got):
        assert a.data_ptr() == o.data_ptr() and torch.equal(o, r), name


def test_launcher_groupsum_checks():
    """`gdn_bwd_fused(..., group_sum=True)`: HV = 2 H only (in the slot layout too), out='s dq,
    dk at the H heads (an HV-head buffer refused, at the token rows too); `empty_outputs` with
    `heads`; the key with and without `varlen`, always `grouped`."""
    from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch

    args, walk = _launcher_inputs(64 * 5, n=3)
    with pytest.raises(ValueError, match="group_sum"):  # H = HV there
        launch.gdn_bwd_fused(*args, None, group_sum=True)
    do, q = args[0], args[2]
    b, t, hv, _ = do.shape
    half = [x[:, :, : hv // 2] if x is q or x is args[3] else x for x in args]
    with pytest.raises(ValueError, match="group_sum"):  # H = HV, the slot layout
        launch.gdn_bwd_fused(*args, None, group_sum=True, **walk)
    outs = launch.empty_outputs(do, 128)  # dq, dk at HV heads
    with pytest.raises(ValueError, match="heads"):
        launch.gdn_bwd_fused(*half, None, group_sum=True, out=outs)
    rows = launch.empty_outputs(do, 128, walk["tokens"], 3)  # the slot layout's, at HV heads
    with pytest.raises(ValueError, match="heads"):
        launch.gdn_bwd_fused(*half, None, group_sum=True, out=rows, **walk)
    shapes = [tuple(x.shape) for x in launch.empty_outputs(do, 128, heads=hv // 2)[:2]]
    assert shapes == [(b, t, hv // 2, 128)] * 2
    with pytest.raises(ValueError, match="group_sum"):
        config.params_for("bfloat16", group_sum=True)  # not grouped
    with pytest.raises(ValueError, match="group_sum"):
        config.params_for("bfloat16", varlen=True, group_sum=True)
    both = dict(config.params_for("bfloat16", grouped=True, varlen=True, group_sum=True))
    assert both["varlen"] and both["group_sum"]  # `varlen, group_sum` (slots_groupsum)


def test_w_u_from_t_model():
    """`w_u_from_t` (the `w_from_t` key's model: T from kernel 0's 16-bit T^T) against kernel
    0's model on its exact T (`factors_model`, its A operands rounded to bf16): W and u within
    two bf16 ulps of each value plus 2e-3 of the tile's max (T's one more rounding)."""
    from forgekernel.reference.gdn_bwd_factors import factors_model, for_kernel2, rounding_to

    b, t, h, hv = 2, 130, 2, 4
    q, k, v, g, beta, *_ = _bf16_problem(b, t, h, hv, seed=9)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    tiles = factors_model(*(x.double() for x in (q, k, v, g, beta)), torch.bfloat16,
                          rounding=rounding_to(torch.bfloat16))  # fmt: skip
    k2 = for_kernel2(tiles, t)
    got = w_u_from_t(k2["tt"], k, v, beta.float(), k2["big_g"].float())
    for name, a, r in zip(("w", "u"), got, (k2["w"], k2["u"])):
        assert a.dtype == r.dtype == torch.bfloat16 and a.shape == r.shape, name
        err = (a.double() - r.double()).abs()
        ulp = 2 * torch.finfo(torch.bfloat16).eps * r.double().abs()
        assert bool((err <= ulp + 2e-3 * float(r.double().abs().max())).all()), name


def _forward_rounded(tt, k, v, beta, big_g, h0, rnd):
    """The forward launch's `w_from_t` recurrence at its rounding points (`rnd`: to the 16-bit
    dtype; the identity: tests/gpu/test_gdn_bwd_wfromt_gpu.py `_forward_fp64`), fp64 sums: u
    = T rnd(diag(beta) V) (u^T's A, V^T diag beta), -W = rnd(-(rnd(T diag(beta e^G)) K)), S's
    operand and h rnd(S), U's decayed columns rounded -> (h (B, NC, HV, K, V), final)."""
    from forgekernel.reference.gdn_bwd_state import CHUNK, to_chunks

    t, hv = v.shape[1], v.shape[2]
    nc = -(-t // CHUNK)
    tri = to_chunks(tt.double(), nc).transpose(-1, -2)  # T
    kc = to_chunks(k.double().repeat_interleave(hv // k.shape[2], dim=2), nc)
    vc, bc = to_chunks(v.double(), nc), to_chunks(beta.double(), nc)
    gc = big_g.double().unflatten(1, (nc, CHUNK)).permute(0, 1, 3, 2)  # (B, NC, HV, C)
    s, hs = h0.double(), []
    for c in range(nc):
        u = tri[:, c] @ rnd(bc[:, c].unsqueeze(-1) * vc[:, c])
        w_neg = rnd(-(rnd(tri[:, c] * (bc[:, c] * gc[:, c].exp()).unsqueeze(-2)) @ kc[:, c]))
        hs.append(rnd(s))
        decay = (gc[:, c, :, -1:] - gc[:, c]).exp().unsqueeze(-1)
        big_u = rnd((u + w_neg @ hs[-1]) * decay)
        s = gc[:, c, :, -1].exp()[..., None, None] * s + kc[:, c].transpose(-1, -2) @ big_u
    return torch.stack(hs, 1), s


@pytest.mark.parametrize(("b", "t", "h", "hv"), [(2, 130, 4, 8), (1, 1000, 1, 2)])
def test_w_from_t_forward_rounding(b, t, h, hv):
    """The forward launch's `w_from_t` key's roundings (bf16) against fp64 on the GPU test's
    problem form (unit keys, log-sigmoid gates): h and the final state within half the GPU
    test's bf16 bound (2e-2 of each max; measured 4.8e-3 / 4.1e-3 and 4.3e-3 / 3.2e-3 here,
    2026-12-07): the bound's margin, next/wft-review."""
    from forgekernel.reference.gdn_bwd_factors import factors_model, for_kernel2, rounding_to

    gen = torch.Generator().manual_seed(t + hv)
    q = torch.randn(b, t, h, 128, generator=gen).bfloat16()
    k = torch.nn.functional.normalize(torch.randn(b, t, h, 128, generator=gen), dim=-1)
    k, v = k.bfloat16(), torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, hv, generator=gen) + 2.0)
    beta = torch.sigmoid(torch.randn(b, t, hv, generator=gen))
    h0 = torch.randn(b, hv, 128, 128, generator=gen) * 0.1
    tiles = factors_model(*(x.double() for x in (q, k, v, g, beta)), torch.bfloat16,
                          rounding=rounding_to(torch.bfloat16))  # fmt: skip
    tt, big_g = for_kernel2(tiles, t)["tt"], tiles["big_g"].float()
    got = _forward_rounded(tt, k, v, beta, big_g, h0, rounding_to(torch.bfloat16))
    want = _forward_rounded(tt, k, v, beta, big_g, h0, lambda x: x)
    for name, a, r in zip(("h", "final"), got, want):
        err = float((a - r).abs().max()) / float(r.abs().max())
        assert err < 1e-2, (name, err)


def _w_from_t_problem(monkeypatch, b, h, hv, lens, seed):
    """The FUSED_WFROMT tests' bf16 problem (k unit rows) and call keywords on the fused route:
    B equal sequences, or several `lens` behind cu_seqlens on the slot layout (FUSED_SLOTS
    selected); the device's SMs set so the fused route takes it. -> (q, k, v, g, beta, do, the
    call's keywords)."""
    t, n = sum(lens), (b if len(lens) == 1 else len(lens))
    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=seed)
    k = (k.float() / k.float().norm(dim=-1, keepdim=True)).bfloat16()
    kw = {"initial_state": h0, "d_final_state": dht}
    if len(lens) > 1:
        kw = {"initial_state": h0.expand(n, -1, -1, -1).contiguous(),
              "d_final_state": dht.expand(n, -1, -1, -1).contiguous(),
              "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                         dtype=torch.int32)}  # fmt: skip
        monkeypatch.setattr(bwd, "FUSED_SLOTS", True)
        monkeypatch.setattr(bwd, "_fused_slots_selected", lambda *a: True)
    monkeypatch.setattr(bwd, "FUSED", True)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: n * hv)
    return q, k, v, g, beta, do, kw


@pytest.mark.parametrize(("b", "h", "hv", "lens"), [(2, 2, 4, [130]), (1, 1, 2, [65]),
                                                    (1, 2, 4, [1, 63, 64, 65])])  # fmt: skip
def test_w_from_t_route(kernel_path, monkeypatch, b, h, hv, lens):  # noqa: F811
    """FUSED_WFROMT on (with FUSED_DIET): the fused launch handed no W, no u and `wg_split`
    (its `wg_split, w_from_t` key; at HV = 2 H with `group_sum`; several `lens`: the slot
    layout, FUSED_SLOTS); the gradients within 1e-2 of FUSED_WFROMT off (W, u differ by T's
    16-bit rounding)."""
    q, k, v, g, beta, do, kw = _w_from_t_problem(monkeypatch, b, h, hv, lens, seed=sum(lens) + hv)
    grads = {}
    for on in (False, True):
        calls = []
        monkeypatch.setattr(bwd, "FUSED_WFROMT", on)
        monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel(calls))
        grads[on] = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, **kw)
        assert len(calls) == 1 and (calls[0][-1] == "w_from_t") == on, calls
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        assert a.shape == o.shape and torch.isfinite(a).all(), name
        err = float((a.double() - o.double()).abs().max())
        assert err <= 1e-2 * float(o.double().abs().max()) + 1e-5, (name, err)


@pytest.mark.parametrize(("b", "h", "hv", "lens"), [(2, 2, 4, [130]), (1, 1, 2, [65]),
                                                    (1, 2, 4, [1, 63, 64, 65])])  # fmt: skip
def test_w_from_t_t_only_keys(kernel_path, monkeypatch, b, h, hv, lens):  # noqa: F811
    """FUSED_WFROMT on, B equal sequences: kernel 0's T-only key (`fused, w_from_t`: no W, u in
    its dict) and the forward launch's `w_from_t` key (handed v in u's place, T^T cut to T in
    P^T's, no W, k, G and beta), so no W, u reach any launch; the slot layout (several `lens`)
    keeps kernel 0's and the forward launch's standard keys (no varlen form) with W, u; off,
    neither. The gradients within 1e-2 of the switch off (`test_w_from_t_route`'s bound: W, u
    differ by T's 16-bit rounding; the emulated launch rounds u too)."""
    q, k, v, g, beta, do, kw = _w_from_t_problem(
        monkeypatch, b, h, hv, lens, seed=sum(lens) + 3 * hv
    )
    slots = len(lens) > 1
    factors, state = bwd._factors, bwd._state_recurrence
    seen = []

    def factors_seen(*a, **kw):
        out = factors(*a, **kw)
        seen.append(("factors", kw.get("w_from_t", False), "w" in out or "u" in out))
        return out

    def state_seen(do_, pt, ke, qe, w, *a, **kw):
        t_only = kw.get("beta") is not None
        if t_only:  # v itself, kernel 0's T^T at T rows, k at its heads, beta as the op's
            assert do_.data_ptr() == v.data_ptr() and ke is None and w.shape == k.shape
            assert pt.shape == (*do_.shape[:3], 64) and kw["beta"].shape == beta.shape
        seen.append(("state", t_only, ke is not None))
        return state(do_, pt, ke, qe, w, *a, **kw)

    monkeypatch.setattr(bwd, "_factors", factors_seen)
    monkeypatch.setattr(bwd, "_state_recurrence", state_seen)
    grads = {}
    for on in (False, True):
        seen.clear()
        monkeypatch.setattr(bwd, "FUSED_WFROMT", on)
        monkeypatch.setattr(bwd, "_fused_bwd", emulated_fused_kernel([]))
        grads[on] = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, **kw)
        t_only = on and not slots
        assert seen == [("factors", t_only, not t_only), ("state", t_only, not t_only)], seen
    for name, a, o in zip(NAMES, grads[True], grads[False]):
        assert a.shape == o.shape and torch.isfinite(a).all(), name
        err = float((a.double() - o.double()).abs().max())
        assert err <= 1e-2 * float(o.double().abs().max()) + 1e-5, (name, err)
