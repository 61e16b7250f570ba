"""Kimi Delta Attention's backward on kernels 1 and 2 (selected explicitly here:
`FORGEKERNEL_KDA_BWD_KERNEL=1`; the default since 2026-12-06, which
`test_the_default_is_the_kernel_path` checks with the variable unset; ops/kda_bwd.py
`_backward_kernel`: both recurrences on Gated DeltaNet's kernel 1 in its
`channel_decay` variant, e^(G_C) per key channel; pass 3's output side on KDA's kernel 2
(`CHUNK_IN_KERNEL`, its outputs NaN-poisoned too); the factors and the WY half batched torch)
on the GPU; `CHUNK_IN_KERNEL = False` (pass 3 in torch) against it.

First the kernel alone (the `channel_decay` variant against its fp64 model,
reference/gdn_bwd_state.py's `reverse_state_pass`, on the same 16-bit sub-chunked KDA factors;
outputs NaN-poisoned: a row the kernel leaves unwritten fails), then the path: against the
fp64 chunked backward (reference/kda_bwd.py, itself checked against autograd) on the same
16-bit inputs and against the interim path, kernel outputs NaN-poisoned before every launch;
bf16 and fp16; T = 1, 63, 64, 65, 200, 1000; B 1-3; H = HV and HV = 2H; with / without initial
state and final-state gradient; l2norm on / off; g per channel in [-1, 0] and [-5, -4];
equal lengths behind cu_seqlens (the suite's batch form); autograd through the forward
kernels (no host read); a CUDA-graph capture; the 4 x 8192 H16 HV16 / HV32 times printed
(`-s`: the path, kernel 1's two launches, the interim path, peak memory; the prediction:
NOTES.md "KDA backward on kernel 1").

Tolerance: the kernel alone within 1e-2 of each output's max (tests/test_gdn_bwd_state.py's
rounded emulation of the channel variant stays within it at T = 1000, K = V = 128); the path
within 2e-2 of each gradient's max (the suite's rule). CPU twin: tests/
test_kda_bwd_kernel_path.py (the kernel replaced by the tile emulation); this file passes on
the CPU with "cuda" -> "cpu", `bwd.KERNEL_DEVICES` widened to "cpu", `launch.gdn_bwd_state`
replaced by the emulation and the forward launcher by the sub-chunked reference (the graph
capture and the timings left out)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from slots_alone import assert_sequence_alone

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import launch
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.reference.gdn_bwd_state import batched_state_pass_factors, reverse_state_pass
from forgekernel.reference.kda_bwd import _Factors, kimi_delta_attention_chunked_backward
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.kda_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
TILES = ("pt", "ke", "qe", "w")
TOL = 2e-2
KERNEL_TOL = 1e-2


def _close(name, got, want, tol=TOL):
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: NaN / inf (an unwritten kernel row?)"
    if want.numel() == 0:
        return
    err = float((got.double() - want.double()).abs().max())
    assert err <= tol * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


def _problem(b, t, h, hv, dtype, *, seed=0, l2norm=False, decay=(-1.0, 0.0)):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(b, t, h, 128).to(dtype)
    k = rnd(b, t, h, 128)
    k = (k * 2.0 if l2norm else F.normalize(k, dim=-1)).to(dtype)
    v = rnd(b, t, hv, 128).to(dtype)
    lo, hi = decay
    g = lo + (hi - lo) * torch.rand(b, t, hv, 128, device="cuda", generator=gen)
    beta = torch.rand(b, t, hv, device="cuda", generator=gen)
    do = rnd(b, t, hv, 128).to(dtype)
    return q, k, v, g, beta, do, rnd(b, hv, 128, 128) * 0.1, rnd(b, hv, 128, 128) * 0.1


# ---- kernel 1, channel_decay, alone ----------------------------------------------------------


def _kernel_check(b, t, h, dtype, *, seed, with_dht=True, decay=(-1.0, 0.0)):
    q, k, v, g, beta, do, _, dht = _problem(b, t, h, h, torch.float32, seed=seed, decay=decay)
    factors = batched_state_pass_factors(q, k, v, g, beta, factors=_Factors)  # fp32
    tiles = {n: factors[n].to(dtype) for n in TILES}
    e_last = factors["e_last"]
    assert e_last.shape == (b, -(-t // 64), h, 128)
    do, dht = do.to(dtype), dht if with_dht else None
    out = tuple(x.fill_(float("nan")) for x in launch.empty_outputs(do, 128))
    got = launch.gdn_bwd_state(do, *(tiles[n] for n in TILES), e_last, dht, out=out)
    torch.cuda.synchronize()
    ref = {n: x.double() for n, x in tiles.items()} | {"e_last": e_last.double()}
    want = reverse_state_pass(ref, do.double(), None if dht is None else dht.double())
    for name, a, r in zip(("dU", "dh", "dh0"), got, want):
        _close(name, a, r, KERNEL_TOL)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "h"), [(1, 2), (2, 3), (3, 4)])
@pytest.mark.parametrize("with_dht", [False, True])
def test_kernel_matches_the_model(t, b, h, with_dht):
    _kernel_check(b, t, h, torch.bfloat16, seed=t + b, with_dht=with_dht)


@pytest.mark.parametrize("t", [65, 1000])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_kernel_strong_decay(t, dtype):
    """g in [-5, -4] per channel: e^(G_C) down to e^-320 (zero in fp32) on some columns."""
    _kernel_check(2, t, 2, dtype, seed=t, decay=(-5.0, -4.0))


def test_kernel_one_long_sequence():
    """128 chunks on one CTA per head: the per-column decay through every chunk."""
    _kernel_check(1, 8192, 2, torch.bfloat16, seed=5, decay=(-0.05, 0.0))


def test_kernel_more_ctas_than_sms():
    _kernel_check(5, 130, 32, torch.bfloat16, seed=6)


# ---- the path --------------------------------------------------------------------------------


def _poisoned_kernel(calls):
    def run(do, pt, ke, qe, w, e_last, dht, dh0=None, **flags):  # flags: out16 / forward
        cu = flags.get("cu_seqlens")  # varlen: the states (N, ...)
        empty = launch.empty_outputs(do, ke.shape[-1], out16=flags.get("out16", False),
                                     states=None if cu is None else cu.shape[0] - 1)  # fmt: skip
        if dh0 is not None:  # the op's out= d_initial_state, written into (next/kda-glue3)
            empty = (*empty[:2], dh0)
        out = tuple(x.fill_(float("nan")) for x in empty)
        calls.append(tuple(do.shape))
        return launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, dht, out=out, **flags)

    return run


def _poisoned_chunk_kernel(calls):
    """Kernel 2 with NaN-poisoned outputs (an entry it leaves unwritten reaches the gradients);
    the varlen slot layout's `tables`, `tokens` (the op's NATIVE_STORES) passed on."""

    def run(do, u, du, q, k, h, dh, big_g, dw16=False, dg=None, dq16=False, scale=1.0,
            dq=None, tables=None, tokens=None):  # fmt: skip
        # dg / dq: the op's out= buffers, written into (as bwd._chunk_grads does)
        empty = chunk_launch.empty_outputs(do, q.shape[-1], dw16, dq16, tokens)
        out = [x.fill_(float("nan")) for x in empty]
        for i, given_out in ((0, dq), (3, dg)):
            if given_out is not None:
                out[i] = given_out.fill_(float("nan"))
        calls.append(tuple(do.shape))
        flags = {"dw16": dw16, **({"dq16": True, "scale": scale} if dq16 else {})}
        return chunk_launch.kda_bwd_chunk(do, u, du, q, k, h, dh, big_g, **flags, out=tuple(out),
                                          tables=tables, tokens=tokens)  # fmt: skip

    return run


@pytest.fixture
def kernel_path(monkeypatch):
    """Kernel 1's launches of the path (twice a pass), outputs NaN-poisoned first; kernel 2's
    (once a pass) likewise, counted in `bwd.chunk_calls`."""
    calls = []
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "_state_recurrence", _poisoned_kernel(calls))
    chunk_calls = []
    monkeypatch.setattr(bwd, "_chunk_grads", _poisoned_chunk_kernel(chunk_calls))
    monkeypatch.setattr(bwd, "chunk_calls", chunk_calls, raising=False)
    return calls


def _run(inputs, *, h0, dht, l2norm):
    return forgekernel.kimi_delta_attention_backward(
        *inputs, initial_state=h0, d_final_state=dht, use_qk_l2norm_in_kernel=l2norm
    )


def _reference(inputs, *, h0, dht, l2norm):
    return kimi_delta_attention_chunked_backward(*inputs, initial_state=h0, d_final_state=dht,
                                                 use_qk_l2norm=l2norm,
                                                 dtype=torch.float64)  # fmt: skip


def _check(kernel_path, monkeypatch, inputs, *, h0, dht, l2norm=False):
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    assert len(kernel_path) == 2, "the kernel path was not taken"
    assert len(bwd.chunk_calls) == 1, "kernel 2 was not launched"
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm)
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")  # the interim path (unset: the kernel path)
    interim = _run(inputs, h0=h0, dht=dht, l2norm=l2norm)
    for name, a, r, i in zip(NAMES, got, want, interim):
        _close(name, a, r)
        _close(name + " vs interim", a, i.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(
    ("b", "h", "hv", "l2norm", "with_h0", "with_dht", "decay"),
    [
        (1, 2, 2, False, True, True, (-1.0, 0.0)),
        (2, 2, 4, True, False, True, (-5.0, -4.0)),
        (3, 1, 2, True, True, False, (-5.0, 0.0)),
        (2, 4, 4, False, False, False, (-1.0, 0.0)),
    ],
)
def test_matches_the_fp64_backward_and_the_interim(kernel_path, monkeypatch, dtype, t, b, h,
                                                   hv, l2norm, with_h0, with_dht,
                                                   decay):  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm,
                                             decay=decay)  # fmt: skip
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0 if with_h0 else None,
           dht=dht if with_dht else None, l2norm=l2norm)  # fmt: skip


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", [(-5.0, 0.0), (-5.0, -4.0)])
def test_kernel_2_against_its_fallback(kernel_path, monkeypatch, dtype, decay):
    """Pass 3's output side on kernel 2 and in torch (`CHUNK_IN_KERNEL = False`): both within
    2e-2 of the fp64 backward, within 1e-2 of each other."""
    q, k, v, g, beta, do, h0, dht = _problem(2, 333, 2, 4, dtype, seed=31, l2norm=True,
                                             decay=decay)  # fmt: skip
    inputs = (q, k, v, g, beta, do)
    on_chip = _run(inputs, h0=h0, dht=dht, l2norm=True)
    assert len(bwd.chunk_calls) == 1
    monkeypatch.setattr(bwd, "CHUNK_IN_KERNEL", False)
    in_torch = _run(inputs, h0=h0, dht=dht, l2norm=True)
    assert len(bwd.chunk_calls) == 1 and len(kernel_path) == 4
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True)
    for name, a, b, r in zip(NAMES, on_chip, in_torch, want):
        _close(name, a, r)
        _close(name + " vs torch pass 3", a, b.double(), KERNEL_TOL)


def test_equal_varlen_is_the_batch(kernel_path):
    """The suite's batch form (B = 1 + cu_seqlens of equal lengths, the offsets read on the
    host) takes the kernel path and gives the (B, T) call's gradients bitwise."""
    q, k, v, g, beta, do, h0, dht = _problem(3, 200, 2, 4, torch.bfloat16, seed=21, l2norm=True)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    batch = forgekernel.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    flat = [x.flatten(0, 1).unsqueeze(0) for x in (q, k, v, g, beta, do)]
    cu = torch.arange(4, dtype=torch.int32, device="cuda") * 200
    varlen = forgekernel.kimi_delta_attention_backward(*flat, cu_seqlens=cu, **kw)
    assert len(kernel_path) == 4
    for name, a, r in zip(NAMES, varlen, batch):
        assert torch.isfinite(r).all(), name
        torch.testing.assert_close(a.reshape(r.shape), r, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [6148, 301, 0, 295]])
def test_varlen_in_slots_is_each_sequence_alone(kernel_path, lens):
    """Unequal lengths in the slot layout (ops/_linattn_varlen.py: one launch of each kernel,
    kernel 1's varlen form) against each sequence's own call, as tests/slots_alone.py states
    it: dq, dv, dbeta and the state gradient bit for bit, dk and dg bit for bit but on the last
    chunk T cuts, where kernel 2's per-channel G_C (row T - 1 alone, row 63 in the slots: two
    associations of the first pass's sums) moves them in the last bits (H100 2026-12-06 13:38:
    sequence 1, 301 % 64 = 45 rows, dk); an empty sequence's state gradient is
    d_final_state's."""
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _problem(1, total, 2, 2, torch.bfloat16, seed=n, l2norm=True)
    *_, h0, dht = _problem(n, 1, 2, 2, torch.bfloat16, seed=97)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda").int()
    kw = {"use_qk_l2norm_in_kernel": True}
    got = forgekernel.kimi_delta_attention_backward(
        q, k, v, g, beta, do, cu_seqlens=cu, initial_state=h0, d_final_state=dht, **kw
    )
    assert len(kernel_path) == 2
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            assert torch.equal(got[5][i], dht[i])
            continue
        one = forgekernel.kimi_delta_attention_backward(
            *(x[:, a:z] for x in (q, k, v, g, beta, do)), initial_state=h0[i : i + 1],
            d_final_state=dht[i : i + 1], **kw)  # fmt: skip
        assert_sequence_alone(NAMES[:5], got, one, a, z, i)
        assert torch.equal(got[5][i : i + 1], one[5]), i


@pytest.mark.parametrize("b", [1, 2])
def test_autograd_through_the_forward_kernels(kernel_path, monkeypatch, b):
    """kimi_delta_attention's autograd (the forward on its kernels) with the switch on: the
    kernel path with no host read (one sequence; B = 2: the offsets the wrapper made) against
    the fp64 backward on the same inputs."""
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    q, k, v, g, beta, do, h0, dht = _problem(b, 333, 2, 4, torch.bfloat16, seed=b, l2norm=True,
                                             decay=(-5.0, 0.0))  # fmt: skip
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = forgekernel.kimi_delta_attention(*leaves[:5], initial_state=leaves[5],
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), leaves)
    assert len(kernel_path) == 2
    want = _reference((q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    for name, a, r in zip(NAMES, grads, want):
        _close(name, a, r)


def test_the_default_is_the_kernel_path(monkeypatch):
    """kimi_delta_attention's autograd with FORGEKERNEL_KDA_BWD_KERNEL unset (the default
    since 2026-12-06): the kernel path (`_backward_kernel`, no interim call), its gradients
    against the fp64 backward on the same inputs."""
    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    taken = []
    kernel = bwd._backward_kernel
    monkeypatch.setattr(bwd, "_backward_kernel", lambda *a: taken.append(1) or kernel(*a))
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    q, k, v, g, beta, do, h0, dht = _problem(2, 333, 2, 4, torch.bfloat16, seed=5, l2norm=True,
                                             decay=(-5.0, 0.0))  # fmt: skip
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = forgekernel.kimi_delta_attention(*leaves[:5], initial_state=leaves[5],
                                                output_final_state=True,
                                                use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), leaves)
    assert taken == [1]
    want = _reference((q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    for name, a, r in zip(NAMES, grads, want):
        _close(name, a, r)


def test_cuda_graph_capture(kernel_path):
    """The equal-length kernel path has no host read: it captures, and a replay on new inputs
    (copied into the captured ones) equals an eager call."""
    q, k, v, g, beta, do, h0, dht = _problem(2, 200, 2, 4, torch.bfloat16, seed=11)
    args = [q, k, v, g, beta, do]
    kw = {"initial_state": h0, "d_final_state": dht}

    def call():
        return forgekernel.kimi_delta_attention_backward(*args, **kw)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        call()  # compile and warm the allocator outside the capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = call()
    fresh = _problem(2, 200, 2, 4, torch.bfloat16, seed=12)
    for x, y in zip(args, fresh[:6]):
        x.copy_(y)
    graph.replay()
    torch.cuda.synchronize()
    for name, a, r in zip(NAMES, captured, call()):
        torch.testing.assert_close(a, r, rtol=1e-3, atol=1e-3, msg=name)


# the op's own kernel wrappers (the `kernel_path` fixture puts poisoned ones in their place)
OP_STATE_RECURRENCE = bwd._state_recurrence
OP_CHUNK_GRADS = bwd._chunk_grads


def _recorded(monkeypatch, name: str, real) -> list:
    """bwd.`name` replaced by `real` keeping each call's (arguments, keywords) in the list
    returned (a stub taking whatever the op passes: its keywords change as the path does)."""
    calls = []

    def run(*args, **kwargs):
        calls.append((args, kwargs))
        return real(*args, **kwargs)

    monkeypatch.setattr(bwd, name, run)
    return calls


@pytest.mark.parametrize("hv", [16, 32])
def test_time_at_bench_size(kernel_path, monkeypatch, hv):
    """4 x 8192 tokens, H 16, HV 16 / 32: the path's time, kernel 1's two launches, the interim
    path's time, peak memory (printed; NOTES.md "KDA backward on kernel 1" predicts them),
    gradients finite."""
    q, k, v, g, beta, do, h0, dht = _problem(4, 8192, 16, hv, torch.bfloat16, seed=13)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    grads = forgekernel.kimi_delta_attention_backward(*args, **kw)
    for name, x in zip(NAMES, grads):
        assert torch.isfinite(x).all(), name
    del grads
    torch.cuda.reset_peak_memory_stats()
    ms = median(time_ms(lambda: forgekernel.kimi_delta_attention_backward(*args, **kw), reps=5))
    peak = torch.cuda.max_memory_allocated() / 2**30
    # one list a kernel: the kernel 1 patch stays while kernel 2's arguments are taken; each
    # call's arguments and keywords (the device pass's out16 / forward / varlen; kernel 2's
    # dw16, dq16, scale and out= buffers) replayed through the op's own wrappers
    state_args = _recorded(monkeypatch, "_state_recurrence", OP_STATE_RECURRENCE)
    forgekernel.kimi_delta_attention_backward(*args, **kw)
    launches = [median(time_ms(lambda a=a, kws=kws: OP_STATE_RECURRENCE(*a, **kws), reps=10))
                for a, kws in state_args]  # fmt: skip
    chunk_args = _recorded(monkeypatch, "_chunk_grads", OP_CHUNK_GRADS)
    forgekernel.kimi_delta_attention_backward(*args, **kw)
    k2 = [median(time_ms(lambda a=a, kws=kws: OP_CHUNK_GRADS(*a, **kws), reps=10))
          for a, kws in chunk_args]  # fmt: skip
    monkeypatch.setattr(bwd, "CHUNK_IN_KERNEL", False)
    torch_p3 = median(time_ms(lambda: forgekernel.kimi_delta_attention_backward(*args, **kw),
                              reps=3))  # fmt: skip
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")  # the interim path
    interim = median(time_ms(lambda: forgekernel.kimi_delta_attention_backward(*args, **kw),
                             reps=3))  # fmt: skip
    print(f"\nKDA backward on kernels 1 + 2, 4 x 8192 h16 hv{hv} bf16: {ms:.2f} ms a call "
          f"(pass 3 in torch {torch_p3:.2f} ms, interim {interim:.2f} ms), kernel 1 "
          f"{' + '.join(f'{x:.3f}' for x in launches)} ms, kernel 2 "
          f"{' + '.join(f'{x:.3f}' for x in k2)} ms, peak {peak:.1f} GiB")  # fmt: skip


# ---- opt-in: the factors' P, Qe, Ke, e^(G_C), W, u from the forward's first pass -------------


@pytest.mark.parametrize("t", [1, 65, 1000])
@pytest.mark.parametrize(("b", "h", "hv", "decay"),
                         [(2, 2, 4, (-5.0, -4.0)), (3, 1, 2, (-5.0, 0.0))])  # fmt: skip
def test_first_pass_factors(kernel_path, monkeypatch, t, b, h, hv, decay):
    """`FACTORS_FROM_FIRST_PASS` (bf16; NOTES.md "KDA backward factors from the forward's first
    pass?"): the first pass launched once, every gradient within 2e-2 of the fp64 backward and
    1e-2 of the torch factors' path; the 1 x 2048 H16 times of both printed (`-s`)."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, torch.bfloat16, seed=t + 7,
                                             l2norm=True, decay=decay)  # fmt: skip
    inputs = (q, k, v, g, beta, do)
    torch_factors = _run(inputs, h0=h0, dht=dht, l2norm=True)
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    first = []
    real = bwd._first_pass
    # `_first_pass_ops` passes `bwd=` by keyword (WY_IN_KERNEL's T^T): the wrapper forwards it
    monkeypatch.setattr(bwd, "_first_pass", lambda *a, **kw: first.append(1) or real(*a, **kw))
    got = _run(inputs, h0=h0, dht=dht, l2norm=True)
    assert first == [1] and len(kernel_path) == 4
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True)
    for name, a, r, f in zip(NAMES, got, want, torch_factors):
        _close(name, a, r)
        _close(name + " vs torch factors", a, f.double(), KERNEL_TOL)
    if (t, b) != (1000, 2):
        return
    args = _problem(1, 2048, 16, 16, torch.bfloat16, seed=5, l2norm=True)
    kw = {"initial_state": args[6], "d_final_state": args[7], "use_qk_l2norm_in_kernel": True}
    monkeypatch.setattr(bwd, "_first_pass", real)
    times = {}
    for on in (False, True):
        monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", on)
        call = lambda: forgekernel.kimi_delta_attention_backward(*args[:6], **kw)  # noqa: E731
        call()
        times[on] = median(time_ms(call, reps=10))
    print(f"\nKDA backward 1 x 2048 h16 bf16: torch factors {times[False]:.3f} ms, first-pass "
          f"factors {times[True]:.3f} ms")  # fmt: skip


# ---- both opt-ins: the device pass (kernel 1's 16-bit forms; NOTES.md "KDA's device pass") ---


@pytest.mark.parametrize("t", [1, 65, 1000])
@pytest.mark.parametrize(("b", "h", "hv", "decay"),
                         [(2, 2, 4, (-5.0, -4.0)), (3, 1, 2, (-5.0, 0.0)),
                          (1, 2, 2, (-1.0, 0.0))])  # fmt: skip
def test_device_pass(kernel_path, monkeypatch, t, b, h, hv, decay):
    """FACTORS_FROM_FIRST_PASS and WY_IN_KERNEL (bf16): `_device_pass`, kernel 1's forward
    launch (channel_decay + out16 + forward) and reverse launch (channel_decay + out16), kernel
    2 and the WY kernel on their 16-bit forms, outputs NaN-poisoned: every gradient within
    2e-2 of the fp64 backward and 1e-2 of the default path; at 1 x 2048 H16 the two times
    printed (`-s`). (The fp32-out comparison, `_on_device` patched False under these opt-ins,
    went with next/kda-wu: the first pass takes v in q's dtype there, and no switch setting
    reaches that state: H100 2026-12-06 17:00, 9 failures of the patched state only.)"""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, torch.bfloat16, seed=t + 11,
                                             l2norm=True, decay=decay)  # fmt: skip
    inputs = (q, k, v, g, beta, do)
    default = _run(inputs, h0=h0, dht=dht, l2norm=True)
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    kernel_path.clear()
    got = _run(inputs, h0=h0, dht=dht, l2norm=True)
    assert len(kernel_path) == 2
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True)
    for name, a, r, d in zip(NAMES, got, want, default):
        _close(name, a, r)
        _close(name + " vs default", a, d.double(), KERNEL_TOL)
    if (t, b) != (1000, 3):
        return
    args = _problem(1, 2048, 16, 16, torch.bfloat16, seed=5, l2norm=True)
    kw = {"initial_state": args[6], "d_final_state": args[7], "use_qk_l2norm_in_kernel": True}
    times = {}
    for name, opt_ins in (("default", False), ("device pass", True)):
        monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", opt_ins)
        monkeypatch.setattr(bwd, "WY_IN_KERNEL", opt_ins)
        call = lambda: forgekernel.kimi_delta_attention_backward(*args[:6], **kw)  # noqa: E731
        call()
        times[name] = median(time_ms(call, reps=10))
    print(
        "\nKDA backward 1 x 2048 h16 bf16: "
        + ", ".join(f"{n} {ms:.3f} ms" for n, ms in times.items())
    )
