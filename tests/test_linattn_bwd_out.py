"""out= on the linear-attention backwards (ops/gated_delta_rule_bwd.py, ops/kda_bwd.py), the
bench's pass-through (bench/suites/gdn_bwd.py `run_backward`) and kernel 1's two launches side
by side (`concurrent_state_launches`, runtime/device.py `side_by_side`), on the CPU: the GDN
kernel path with its kernels replaced by the emulations of tests/test_gdn_bwd_kernel_path.py
(the stand-ins write their out= buffers by an indexed store, so a Python-level `copy_` is a
copy the path made), the interim paths as they are. Values with out= are the returned form's
bit for bit; the buffers come back NaN-free (every element written); a bad out is refused with
its name. The GPU twin: tests/gpu/test_linattn_bwd_out_gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_gdn_bwd_kernel_path import (
    _bf16_problem,
    kernel_path,  # noqa: F401  (the fixture)
)
from torch.utils._python_dispatch import TorchDispatchMode

import forgekernel
from forgekernel.bench.suites import gdn_bwd as suite

bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
kda = importlib.import_module("forgekernel.ops.kda_bwd")


def _poisoned_like(grads):
    return tuple(None if x is None else torch.full_like(x, float("nan")) for x in grads)


class _Copies:
    """Python-level `torch.Tensor.copy_` calls while active (the path's own copies)."""

    def __init__(self, monkeypatch):
        self.n = 0
        real = torch.Tensor.copy_

        def copy_(t, *a, **kw):
            self.n += 1
            return real(t, *a, **kw)

        monkeypatch.setattr(torch.Tensor, "copy_", copy_)


def _gdn(q, k, v, g, beta, do, h0, dht, **kw):
    kw.setdefault("use_qk_l2norm_in_kernel", True)  # the problem's keys are not unit rows
    return forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, initial_state=h0,
                                                 d_final_state=dht, **kw)  # fmt: skip


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm"),
    [(2, 65, 1, 2, True), (1, 130, 2, 2, False), (1, 7, 2, 4, False)],
)
@pytest.mark.usefixtures("kernel_path")
def test_gdn_out_is_the_returned_form_with_no_copy(monkeypatch, b, t, h, hv, l2norm):
    """Kernel path (one pass): every gradient written by its last kernel, none copied."""
    q, k, v, g, beta, do, h0, dht = _bf16_problem(b, t, h, hv, seed=t)
    if not l2norm:  # unit keys: the recurrence stays bounded
        k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    want = _gdn(q, k, v, g, beta, do, h0, dht, use_qk_l2norm_in_kernel=l2norm)
    assert all(torch.isfinite(x).all() for x in want)
    out = _poisoned_like(want)
    copies = _Copies(monkeypatch)
    got = _gdn(q, k, v, g, beta, do, h0, dht, use_qk_l2norm_in_kernel=l2norm, out=out)
    assert copies.n == 0
    for name, a, o, r in zip(bwd.GRAD_NAMES, got, out, want):
        assert a is o, name
        assert torch.equal(a, r), name


@pytest.mark.usefixtures("kernel_path")
def test_gdn_out_state_none_bf16_beta_k_last_and_passes(monkeypatch):
    """d_initial_state None (allocated), a 16-bit beta (copied: kernel 2 writes fp32), k_last
    (copied: the kernel's layout is (K, V)) and several head passes (concatenated into out)."""
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 70, 2, 4, seed=3)
    beta = beta.bfloat16()
    h0, dht = h0.transpose(-1, -2).contiguous(), dht.transpose(-1, -2).contiguous()
    for passes in (False, True):
        if passes:
            monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 70 * 2)
        want = _gdn(q, k, v, g, beta, do, h0, dht, k_last=True)
        out = (*_poisoned_like(want[:5]), None)
        got = _gdn(q, k, v, g, beta, do, h0, dht, k_last=True, out=out)
        assert all(a is o for a, o in zip(got[:5], out[:5]))
        for name, a, r in zip(bwd.GRAD_NAMES, got, want):
            assert torch.equal(a, r), (passes, name)
        out = _poisoned_like(want)
        got = _gdn(q, k, v, g, beta, do, h0, dht, k_last=True, out=out)
        assert got[5] is out[5] and torch.equal(got[5], want[5])


@pytest.mark.parametrize("lens", [[70, 70], [3, 129, 7]])
@pytest.mark.usefixtures("kernel_path")
def test_gdn_out_varlen_and_interim(monkeypatch, lens):
    """Varlen (equal lengths: the one call; unequal: buckets scattered into out) and the
    interim path (`interim()`): out holds the returned form."""
    monkeypatch.setattr(bwd, "TILE_DTYPES", (torch.float32, torch.bfloat16))
    q, k, v, g, beta, do, h0, dht = _bf16_problem(len(lens), max(lens), 1, 2, seed=1)
    cat = [torch.cat([x[i, :n] for i, n in enumerate(lens)])[None] for x in (q, k, v, g, beta,
                                                                             do)]  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for ctx in (torch.no_grad(), bwd.interim()):
        with ctx:
            want = _gdn(*cat, h0, dht, cu_seqlens=cu)
            out = _poisoned_like(want)
            got = _gdn(*cat, h0, dht, cu_seqlens=cu, out=out)
        for name, a, o, r in zip(bwd.GRAD_NAMES, got, out, want):
            assert a is o and torch.equal(a, r), name


def _bad_outs(grads):
    dq = grads[0]
    yield grads[:5], TypeError, r"out must be a tuple \(dq, dk, dv, dg, dbeta, d_initial_state\)"
    yield (dq[:, :1], *grads[1:]), ValueError, r"out\[0\] \(dq\) must have shape"
    bf16_dg = (*grads[:3], grads[3].bfloat16(), *grads[4:])
    yield bf16_dg, TypeError, r"out\[3\] \(dg\) must have dtype"
    wide = torch.empty(*dq.shape[:-1], 2 * dq.shape[-1], dtype=dq.dtype)[..., ::2]
    yield (wide, *grads[1:]), ValueError, r"out\[0\] \(dq\) must be contiguous"
    yield (*grads[:5], grads[5][:, :1]), ValueError, r"out\[5\] \(d_initial_state\) must have shape"
    yield (*grads[:2], "dv", *grads[3:]), TypeError, r"out\[2\] \(dv\) must be a torch.Tensor"


@pytest.mark.usefixtures("kernel_path")
def test_gdn_bad_out_is_refused():
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 65, 1, 2)
    grads = _gdn(q, k, v, g, beta, do, h0, dht)
    for out, error, message in _bad_outs(list(grads)):
        with pytest.raises(error, match=message):
            _gdn(q, k, v, g, beta, do, h0, dht, out=tuple(out))


def _aliased_outs(grads, v, h0):
    """out= buffers overlapping an input or one another: refused (the kernels write dv, dh0
    and others into out= while they still read the inputs; next/int44-review-ops)."""
    yield (*grads[:2], v, *grads[3:]), r"out\[2\] \(dv\) overlaps v"
    yield (*grads[:5], h0), r"out\[5\] \(d_initial_state\) overlaps initial_state"
    yield (grads[0], grads[0], *grads[2:]), r"out\[1\] \(dk\) overlaps out\[0\]"
    nq, nv = grads[0].numel(), grads[2].numel()
    flat = torch.empty(nq + nv, dtype=grads[0].dtype)  # dq, then dv: one buffer, side by side
    dq, dv = flat[:nq].view_as(grads[0]), flat[nq:].view_as(grads[2])
    yield (dq, grads[1], dv, *grads[3:]), None  # adjacent, not overlapping: accepted
    dv = flat[nq - 1 : nq - 1 + nv].view_as(grads[2])  # one element shared with dq
    yield (dq, grads[1], dv, *grads[3:]), r"out\[2\] \(dv\) overlaps out\[0\]"


@pytest.mark.usefixtures("kernel_path")
def test_gdn_out_overlapping_the_inputs_is_refused():
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 65, 2, 2)
    grads = [torch.empty_like(x) for x in _gdn(q, k, v, g, beta, do, h0, dht)]
    for out, message in _aliased_outs(grads, v, h0):
        if message is None:
            _gdn(q, k, v, g, beta, do, h0, dht, out=tuple(out))
            continue
        with pytest.raises(ValueError, match=message):
            _gdn(q, k, v, g, beta, do, h0, dht, out=tuple(out))


def _kda_problem(t=70, h=1, hv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(1, t, h, 128, generator=gen).bfloat16() for _ in range(2))
    v, do = (torch.randn(1, t, hv, 128, generator=gen).bfloat16() for _ in range(2))
    g = -torch.rand(1, t, hv, 128, generator=gen)
    beta = torch.rand(1, t, hv, generator=gen)
    h0, dht = (torch.randn(1, hv, 128, 128, generator=gen) * 0.1 for _ in range(2))
    return q, k, v, g, beta, do, h0, dht


def test_kda_out_is_the_returned_form(monkeypatch):
    """Kimi Delta Attention's backward on the CPU (its interim path) with out=; a bad out is
    refused by the shared check."""
    monkeypatch.setattr(kda, "check_cuda", lambda name, t: None)
    q, k, v, g, beta, do, h0, dht = _kda_problem()

    def run(**kw):
        return forgekernel.ops.kda_bwd.kimi_delta_attention_backward(
            q, k, v, g, beta, do, initial_state=h0, d_final_state=dht, use_qk_l2norm_in_kernel=True,
            **kw)  # fmt: skip

    want = run()
    out = _poisoned_like(want)
    got = run(out=out)
    for name, a, o, r in zip(bwd.GRAD_NAMES, got, out, want):
        assert a is o and torch.equal(a, r), name
    for bad, error, message in _bad_outs(list(want)):
        with pytest.raises(error, match=message):
            run(out=tuple(bad))
    for bad, message in _aliased_outs([torch.empty_like(x) for x in want], v, h0):
        if message is None:
            run(out=tuple(bad))
            continue
        with pytest.raises(ValueError, match=message):
            run(out=tuple(bad))


# ---- the bench: ours timed writing `out`, as the comparators return their own tensors


class _CopyOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.copies = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.copy_, torch.ops.aten._to_copy):
            self.copies += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("state", [True, False])
def test_run_backward_passes_out_through(state):
    """`run_backward` hands `out` (the sixth entry None without an initial state) to the
    backward and copies nothing; without out the backward's gradients come back."""
    gen = torch.Generator().manual_seed(0)
    inputs = {"q": torch.randn(1, 5, 1, 4, generator=gen), "g": torch.randn(1, 5, 2),
              "k": torch.randn(1, 5, 1, 4), "v": torch.randn(1, 5, 2, 4),
              "beta": torch.rand(1, 5, 2), "do": torch.randn(1, 5, 2, 4),
              "state": torch.randn(1, 2, 4, 4) if state else None,
              "d_final": torch.randn(1, 2, 4, 4), "cu_seqlens": None}  # fmt: skip
    seen = []

    def backward(q, k, v, g, beta, do, *, initial_state, d_final_state, cu_seqlens, out=None):
        seen.append(out)
        likes = (q, k, v, g, beta, d_final_state)
        bufs = [torch.empty_like(x) for x in likes] if out is None else list(out)
        bufs[5] = torch.empty_like(d_final_state) if bufs[5] is None else bufs[5]
        for i, (o, x) in enumerate(zip(bufs, likes)):
            torch.mul(x, i + 1, out=o)  # a kernel writing its output
        return tuple(bufs)

    out = suite.alloc_out(inputs)
    with _CopyOps() as mode:
        got = suite.run_backward(backward, inputs, out)
    assert mode.copies == 0
    assert got == tuple(out) and seen[0][: len(out)] == tuple(out)
    assert len(seen[0]) == 6 and (seen[0][5] is not None) == state
    torch.testing.assert_close(got[2], inputs["v"] * 3)
    plain = suite.run_backward(backward, inputs, None)
    assert seen[1] is None and len(plain) == len(out)


# ---- kernel 1's two launches side by side


def test_concurrent_state_launches_decision():
    """Both launches in one wave: 2 B HV CTAs (one an SM: the register file) within the SMs."""
    assert bwd.STATE_CTAS_PER_SM == 1
    assert bwd.concurrent_state_launches(1, 32, 132)  # 1 x 8192 hv32 on the H100
    assert bwd.concurrent_state_launches(2, 33, 132)
    assert not bwd.concurrent_state_launches(1, 67, 132)
    assert not bwd.concurrent_state_launches(4, 32, 132)  # 4 x 8192 hv32: 128 a launch
    assert not bwd.concurrent_state_launches(1, 32, 0)  # off CUDA
    assert not bwd.concurrent_state_launches(0, 32, 132)
    assert bwd._device_sms(torch.device("cpu")) == 0


@pytest.mark.usefixtures("kernel_path")
def test_concurrent_state_launches_on_the_path(monkeypatch):
    """The device pass through `side_by_side` (on the CPU: the forward launch, then the
    reverse one) gives the serial pass's gradients bit for bit; serial when declined."""
    q, k, v, g, beta, do, h0, dht = _bf16_problem(2, 65, 1, 2, seed=5)
    serial = _gdn(q, k, v, g, beta, do, h0, dht)
    pairs = []
    real = bwd.side_by_side

    def spy(device, first, second):
        pairs.append(device.type)
        return real(device, first, second)

    monkeypatch.setattr(bwd, "side_by_side", spy)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 132)
    both = _gdn(q, k, v, g, beta, do, h0, dht)
    assert pairs == ["cpu"]
    for name, a, r in zip(bwd.GRAD_NAMES, both, serial):
        assert torch.equal(a, r), name
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 2 * 2 * 2 - 1)
    _gdn(q, k, v, g, beta, do, h0, dht)
    assert pairs == ["cpu"]


def test_side_by_side_off_cuda_runs_first_then_second():
    order = []
    got = bwd.side_by_side(torch.device("cpu"), lambda: order.append(1) or "a",
                           lambda: order.append(2) or "b")  # fmt: skip
    assert got == ("a", "b") and order == [1, 2]


def test_k_without_l2norm_is_not_copied():
    """`_normalized`: k (scale 1, no l2norm, already the tiles' dtype) passed as it is; q x
    scale still written once."""
    x = torch.randn(1, 3, 2, 8).bfloat16()
    assert bwd._normalized(x, 1.0, False, torch.bfloat16) is x
    scaled = bwd._normalized(x, 0.5, False, torch.bfloat16)
    assert scaled is not x and torch.equal(scaled, x * 0.5)
    assert bwd._normalized(x, 1.0, False, torch.float32).dtype == torch.float32
    assert bwd._normalized(x, 1.0, True, torch.bfloat16) is not x
