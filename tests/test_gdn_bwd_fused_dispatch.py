"""The fused backward's dispatch on the op's device pass (ops/gated_delta_rule_bwd.py FUSED,
`_fused_pass`; kernels/linear_attention/gdn_bwd_fused/sm90) on the CPU: the rule (B x HV at
least three quarters of a wave, `config.fused_fits`), the switch off by default, and the path
with the switch on, the fused kernel replaced by an emulation built from the two kernels it
fuses (tests/test_gdn_bwd_kernel_path.py's tile emulations of kernel 1's reverse launch and
kernel 2's WY variant, fed Ke = k e^(G_C - G), Qe = q e^G and e^(G_C) formed from the fused
kernel's own inputs: what the kernel folds in registers). Checked: the inputs it is handed
(shapes, dtypes, strided views as TMA reads them), one launch in place of the reverse launch
and kernel 2, and the gradients against today's path and autograd through the fp64
recurrence (2e-2 of each gradient's max). The GPU twin: tests/gpu/test_gdn_bwd_fused_gpu.py."""

from __future__ import annotations

import importlib

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

bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def emulated_fused_kernel(calls):
    """The fused kernel's stand-in: kernel 1's reverse emulation and kernel 2's WY emulation on
    the factors the kernel forms from its inputs (Ke, Qe, e^(G_C) from k, q and G)."""
    reverse, chunk = emulated_kernel(), emulated_chunk_wy_kernel()

    def run(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, scale=1.0, out=None):
        b, t, hv, _ = do.shape
        nc = -(-t // 64)
        for x in (do, u, pt, tt, w, uw, v):  # strided views allowed (TMA)
            assert x.stride(-1) == 1 and x.dtype == do.dtype and x.shape[:3] == (b, t, hv)
        assert q.shape == k.shape and q.shape[:2] == (b, t) and hv % q.shape[2] == 0
        assert h.shape == (b, nc, hv, q.shape[-1], do.shape[-1]) and h.dtype == do.dtype
        assert big_g.dtype == beta.dtype == torch.float32 and big_g.shape == beta.shape
        calls.append((tuple(do.shape), q.shape[2], dht is not None, scale))
        group = hv // q.shape[2]
        qh, kh = (x.double().repeat_interleave(group, dim=2) for x in (q, k))
        last = torch.clamp(torch.arange(nc) * 64 + 63, max=t - 1)
        g_last = big_g.double()[:, last]  # (B, NC, HV): G at each chunk's last token
        g_c = g_last.repeat_interleave(64, dim=1)[:, :t]
        ke = (kh * (g_c - big_g.double()).exp().unsqueeze(-1)).to(do.dtype)
        qe = (qh * big_g.double().exp().unsqueeze(-1)).to(do.dtype)
        du, dh, dh0 = reverse(do, pt, ke, qe, w, g_last.exp().float().contiguous(), dht,
                              out16=True)  # fmt: skip
        dq, dk, dg, dv, dbeta = chunk(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta,
                                      dv16=True, dqk16=True, scale=scale)  # fmt: skip
        got = (dq, dk, dg, dv, dbeta, dh0)
        return got if out is None else tuple(written_to(o, x) for o, x in zip(out, got))

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
    assert bwd.FUSED is True


@pytest.mark.parametrize(("b", "t", "h", "hv", "l2norm"), [(1, 130, 2, 2, False),
                                                            (2, 65, 1, 2, True)])  # fmt: skip
def test_fused_path_equals_todays(kernel_path, monkeypatch, b, t, h, hv, l2norm):  # noqa: F811
    """FUSED on and the rule met (the SM count patched to B x HV): one fused launch after
    kernel 1's forward launch, no reverse launch, no kernel 2; the gradients those of today's
    path (FUSED off) and of autograd through the fp64 recurrence within 2e-2 of their max."""
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
    assert calls == [((b, t, hv, 128), h, True, 128**-0.5 if fold else 1.0)]
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
    lengths are B sequences (a reshape) on the fused kernel; unequal ones run once in the slot
    layout (the default), today's reverse launch and kernel 2 (`_device_pass` takes the fused
    kernel only without slots): no fused launch and the gradients FUSED off's bit for bit. The
    GPU twin's test_varlen."""
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
        assert calls == [((n, lens[0], 4, 128), 2, True, 1.0)] and CHUNK_CALLS == []
        for name, a, o in zip(NAMES, got, today):
            scale = float(o.abs().max())
            assert float((a.double() - o.double()).abs().max()) <= 2e-2 * scale, name
    else:
        assert calls == [] and CHUNK_CALLS == [torch.bfloat16]
        assert FLAGS == [(True, True), (True, False)]  # kernel 1's two launches, varlen form
        for name, a, o in zip(NAMES, got, today):
            assert torch.equal(a, o), name
