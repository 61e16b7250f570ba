"""The Gated DeltaNet backward on kernels 0, 1 and 2 (selected explicitly here:
`FORGEKERNEL_GDN_BWD_KERNEL=1`; the default since 2026-12-06, which
`test_the_default_is_the_kernel_path` checks with the variable unset;
ops/gated_delta_rule_bwd.py `_backward_kernel`: the chunk factors on kernel 0, both recurrences
on kernel 1, pass 3 on kernel 2, the rest batched torch; FACTORS_IN_KERNEL off: the torch
factors) on the GPU: against the fp64 chunked backward
(reference/delta_rule_bwd.py, itself checked against autograd) on the same 16-bit inputs and
against the interim path, kernel outputs NaN-poisoned before every launch (a row the kernel
leaves unwritten fails); bf16 and fp16; T = 1, 63, 64, 65, 200, 1000; B 1-3; H = HV and HV = 2H;
with / without initial state and final-state gradient; l2norm on / off; both state layouts;
varlen through cu_seqlens (padded, empty sequences); autograd through the forward kernel; a
CUDA-graph capture of the equal-length path; the 4 x 8192 h16 hv32 time printed (`-s`: the path,
the kernel's two launches, peak memory; kernel 2's launch, kernel 0's, the q / k epilogue's
two), in both the
equal-length and the suite's varlen form.

Tolerance: each gradient within 2e-2 of its reference's largest entry (the suite's rule): the
kernel's tiles and its register operands are 16-bit (tests/test_gdn_bwd_state.py's emulation:
~1.4e-3 of max on dU); the interim path is fp32 throughout. CPU twin: tests/
test_gdn_bwd_kernel_path.py (the kernel replaced by the tile emulation)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from slots_alone import assert_sequence_alone

import forgekernel
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import launch as factors_launch
from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import launch as norm_launch
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.launch import (
    empty_outputs,
    gdn_bwd_state,
)
from forgekernel.reference.delta_rule_bwd import gated_delta_rule_chunked_backward
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
TOL = 2e-2
FLAGS: list = []  # kernel 1's (out16, forward) a launch


def _poisoned_kernel(calls):
    """Kernel 1 with its outputs (fp32, or 16-bit with out16) NaN-poisoned first."""

    def run(do, pt, ke, qe, w, e_last, dht, out=None, **flags):
        out16 = flags.get("out16", False)
        cu = flags.get("cu_seqlens")  # varlen: the states (N, ...)
        if out is None:  # the segmented pass gives its views (`_segmented_states`)
            out = empty_outputs(do, ke.shape[-1], out16=out16,
                                states=None if cu is None else cu.shape[0] - 1,
                                fused="big_g" in flags)  # fmt: skip
        out = tuple(None if x is None else x.fill_(float("nan")) for x in out)
        calls.append(tuple(do.shape))
        FLAGS.append((out16, flags.get("forward", False)))
        return gdn_bwd_state(do, pt, ke, qe, w, e_last, dht, out=out, **flags)

    return run


def _poisoned_chunk_kernel(calls):
    """Kernel 2 with its outputs NaN-poisoned first; its calls recorded as ("k2", shape)."""

    def run(do, u, du, q, k, h, dh, big_g):
        out = tuple(x.fill_(float("nan")) for x in chunk_launch.empty_outputs(do, q.shape[-1]))
        calls.append(("k2", tuple(do.shape)))
        return chunk_launch.gdn_bwd_chunk(do, u, du, q, k, h, dh, big_g, out=out)

    return run


QK16_CALLS: list = []  # kernel 2's (dqk16, scale) a WY launch


def _poisoned_chunk_wy_kernel(calls):
    """Kernel 2's WY variant with its outputs NaN-poisoned first (the op's own `out` buffers
    where it passes them, else fresh ones); calls as ("k2wy", shape); `fsplit` (the op's
    FSPLIT) and the varlen slot layout's `tables`, `tokens` (the op's NATIVE_STORES) passed on."""

    def run(do, u, du, q, k, h, dh, big_g, *wy, dv16=False, dqk16=False, scale=1.0,
            fsplit=False, tables=None, tokens=None, out=None):  # fmt: skip
        if out is None:
            out = chunk_launch.empty_wy_outputs(do, q.shape[-1], dv16, dqk16, tokens)
        out = tuple(x.fill_(float("nan")) for x in out)
        calls.append(("k2wy", tuple(do.shape)))
        QK16_CALLS.append((dqk16, scale))
        return chunk_launch.gdn_bwd_chunk_wy(do, u, du, q, k, h, dh, big_g, *wy, out=out,
                                             dv16=dv16, dqk16=dqk16, scale=scale,
                                             fsplit=fsplit, tables=tables,
                                             tokens=tokens)  # fmt: skip

    return run


def _poisoned_factors_kernel(calls):
    """Kernel 0 with its outputs NaN-poisoned first; calls as ("k0", v's shape)."""

    def run(q, k, v, g, beta, fused=False):
        out = factors_launch.empty_outputs(q, v, fused)
        for x in out.values():
            x.fill_(float("nan"))
        calls.append(("k0", tuple(v.shape)))
        return factors_launch.gdn_bwd_factors(q, k, v, g, beta, out=out, fused=fused)

    return run


def _poisoned_norm_kernel(calls):
    """The q / k epilogue with its output NaN-poisoned first; calls as ("qk", x's shape)."""

    def run(dxs, x, scale, l2norm):
        out = torch.full(x.shape, float("nan"), dtype=x.dtype, device=x.device)
        calls.append(("qk", tuple(x.shape)))
        return norm_launch.gdn_bwd_norm(dxs, x, scale, l2norm, out=out)

    return run


def _launches(fold: bool = False) -> int:
    """Launches of a one-pass call: kernel 0's (when on), kernel 1's two, kernel 2's, and the
    q / k epilogue's two on the 16-bit device path (STATES16, NORM_IN_KERNEL) unless kernel 2
    wrote the op's dq, dk itself (`fold`: bwd._folds, no l2norm at HV = H)."""
    on_device = bwd.FACTORS_IN_KERNEL and bwd.WY_IN_KERNEL
    epilogue = on_device and bwd.STATES16 and bwd.NORM_IN_KERNEL and not fold
    return 3 + on_device + 2 * epilogue


@pytest.fixture
def kernel_path(monkeypatch):
    """Kernel launches of the path: kernel 0's once a pass (unless bwd.FACTORS_IN_KERNEL or
    bwd.WY_IN_KERNEL is off), kernel 1's twice, kernel 2's once (its WY variant unless
    bwd.WY_IN_KERNEL is off)."""
    calls = []
    FLAGS.clear()
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "_factors", _poisoned_factors_kernel(calls))
    monkeypatch.setattr(bwd, "_state_recurrence", _poisoned_kernel(calls))
    monkeypatch.setattr(bwd, "_chunk_grads", _poisoned_chunk_kernel(calls))
    monkeypatch.setattr(bwd, "_chunk_grads_wy", _poisoned_chunk_wy_kernel(calls))
    monkeypatch.setattr(bwd, "_qk_grads", _poisoned_norm_kernel(calls))
    return calls


def _problem(b, t, h, hv, dtype, *, seed=0, l2norm=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(b, t, h, 128).to(dtype)
    k = rnd(b, t, h, 128)
    k = (k * 2.0 if l2norm else F.normalize(k, dim=-1)).to(dtype)
    v = rnd(b, t, hv, 128).to(dtype)
    g = F.logsigmoid(rnd(b, t, hv) + 2.0)
    beta = torch.sigmoid(rnd(b, t, hv))
    do = rnd(b, t, hv, 128).to(dtype)
    return q, k, v, g, beta, do, rnd(b, hv, 128, 128) * 0.1, rnd(b, hv, 128, 128) * 0.1


def _close(name, got, want):
    assert got.shape == want.shape, name
    assert torch.isfinite(got).all(), f"{name}: NaN / inf (an unwritten kernel row?)"
    if want.numel() == 0:
        return
    err = float((got.double() - want.double()).abs().max())
    assert err <= TOL * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


def _run(inputs, *, h0, dht, l2norm, k_last, cu=None):
    q, k, v, g, beta, do = inputs
    states = [None if x is None else (x.transpose(-1, -2).contiguous() if k_last else x)
              for x in (h0, dht)]  # fmt: skip
    return forgekernel.gated_delta_rule_backward(
        q, k, v, g, beta, do, initial_state=states[0], d_final_state=states[1], cu_seqlens=cu,
        use_qk_l2norm_in_kernel=l2norm, k_last=k_last,
    )  # fmt: skip


def _reference(inputs, *, h0, dht, l2norm, cu=None):
    return gated_delta_rule_chunked_backward(*inputs, initial_state=h0, d_final_state=dht,
                                             cu_seqlens=cu, use_qk_l2norm=l2norm,
                                             dtype=torch.float64)  # fmt: skip


def _check(kernel_path, monkeypatch, inputs, *, h0, dht, l2norm=False, k_last=False, cu=None):
    got = _run(inputs, h0=h0, dht=dht, l2norm=l2norm, k_last=k_last, cu=cu)
    q, k, v, do = inputs[0], inputs[1], inputs[2], inputs[5]
    fold = bwd._folds(l2norm, v.shape[-2] // q.shape[-2], q, k, do.dtype)
    passes = sum(c[0] in ("k2", "k2wy") for c in kernel_path)  # varlen: one a bucket
    assert passes and len(kernel_path) == passes * _launches(fold), "the kernel path was not taken"
    want = _reference(inputs, h0=h0, dht=dht, l2norm=l2norm, cu=cu)
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "0")  # the interim path (unset: the kernel path)
    interim = _run(inputs, h0=h0, dht=dht, l2norm=l2norm, k_last=k_last, cu=cu)
    for name, a, r, i in zip(NAMES, got, want, interim):
        if name == "dh0" and k_last:
            a, i = a.transpose(-1, -2), i.transpose(-1, -2)
        _close(name, a, r)
        _close(name + " vs interim", a, i.double())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(
    ("b", "h", "hv", "l2norm", "with_h0", "with_dht", "k_last"),
    [
        (1, 2, 2, False, True, True, False),
        (2, 2, 4, True, False, True, True),
        (3, 1, 2, True, True, False, False),
        (2, 4, 4, False, False, False, False),
    ],
)
def test_matches_the_fp64_backward_and_the_interim(kernel_path, monkeypatch, dtype, t, b, h,
                                                   hv, l2norm, with_h0, with_dht,
                                                   k_last):  # fmt: skip
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t + b, l2norm=l2norm)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0 if with_h0 else None,
           dht=dht if with_dht else None, l2norm=l2norm, k_last=k_last)  # fmt: skip


@pytest.mark.parametrize("t", [65, 1000])
def test_output_grads_variant(kernel_path, monkeypatch, t):
    """WY_IN_KERNEL off: kernel 2's `_output_grads` variant, the WY half in torch."""
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", False)
    q, k, v, g, beta, do, h0, dht = _problem(2, t, 2, 4, torch.bfloat16, seed=t, l2norm=True)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    assert kernel_path[-1][0] == "k2" and "k0" not in [c[0] for c in kernel_path]


@pytest.mark.parametrize("t", [65, 1000])
def test_torch_factors_fallback(kernel_path, monkeypatch, t):
    """FACTORS_IN_KERNEL off: the torch `_Factors` pass feeds kernels 1 and 2, no kernel 0."""
    monkeypatch.setattr(bwd, "FACTORS_IN_KERNEL", False)
    q, k, v, g, beta, do, h0, dht = _problem(2, t, 2, 4, torch.bfloat16, seed=t, l2norm=True)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    assert "k0" not in [c[0] for c in kernel_path]


@pytest.mark.parametrize("t", [65, 1000])
def test_fp32_states_fallback(kernel_path, monkeypatch, t):
    """STATES16 off: kernel 1 writes fp32 (no out16 / forward), torch converts for kernel 2,
    torch's l2norm backward; on (the default): 16-bit outputs, the forward launch with I and 0
    built in, the q / k epilogue."""
    q, k, v, g, beta, do, h0, dht = _problem(2, t, 2, 4, torch.bfloat16, seed=t, l2norm=True)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    assert FLAGS == [(True, True), (True, False)]
    FLAGS.clear()
    kernel_path.clear()
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "STATES16", False)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    assert FLAGS == [(False, False), (False, False)]
    assert "qk" not in [c[0] for c in kernel_path]


@pytest.mark.parametrize("t", [65, 1000])
def test_torch_norm_fallback(kernel_path, monkeypatch, t):
    """NORM_IN_KERNEL off: the group sum and l2norm's backward in torch, no epilogue launch."""
    monkeypatch.setattr(bwd, "NORM_IN_KERNEL", False)
    q, k, v, g, beta, do, h0, dht = _problem(2, t, 2, 4, torch.bfloat16, seed=t, l2norm=True)
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    assert "qk" not in [c[0] for c in kernel_path]


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [300, 300, 300], [1000, 700]])
def test_varlen_padded(kernel_path, monkeypatch, lens):
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _problem(1, total, 2, 4, torch.bfloat16, seed=n, l2norm=True)
    *_, h0, dht = _problem(n, 1, 2, 4, torch.bfloat16, seed=99)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda").int()
    _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True,
           cu=cu)  # fmt: skip


@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [6148, 301, 0, 295]])
def test_varlen_in_slots_is_each_sequence_alone(kernel_path, lens):
    """Unequal lengths in the slot layout (ops/_linattn_varlen.py: one launch of each kernel,
    kernel 1's varlen form) against each sequence's own call, as tests/slots_alone.py states
    it: dq, dv, dbeta and the state gradient bit for bit (the chunk-local kernels see the same
    chunks; kernel 1's extra zero slot passes the state exactly), dk and dg bit for bit but on
    the last chunk T cuts, where kernel 2's G_C (row T - 1 alone, row 63 in the slots: two
    associations of kernel 0's warp scan) moves them in the last bits (H100 2026-12-06 13:38:
    sequence 1, 301 % 64 = 45 rows, dk); an empty sequence's state gradient is
    d_final_state's."""
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, do, *_ = _problem(1, total, 2, 4, torch.bfloat16, seed=n, l2norm=True)
    *_, h0, dht = _problem(n, 1, 2, 4, torch.bfloat16, seed=98)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda").int()
    got = _run((q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True, k_last=False, cu=cu)
    assert len(kernel_path) == _launches()
    for i, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        if a == z:
            assert torch.equal(got[5][i], dht[i])
            continue
        one = _run(tuple(x[:, a:z] for x in (q, k, v, g, beta, do)), h0=h0[i : i + 1],
                   dht=dht[i : i + 1], l2norm=True, k_last=False)  # fmt: skip
        assert_sequence_alone(NAMES[:5], got, one, a, z, i)
        assert torch.equal(got[5][i : i + 1], one[5]), i


@pytest.mark.parametrize("b", [1, 2])
def test_autograd_through_the_forward_kernel(kernel_path, monkeypatch, b):
    """gated_delta_rule's autograd (the forward on its kernel) with the switch on: the kernel
    path with no host read (one sequence; B = 2: the offsets the wrapper made) against the fp64
    backward on the same inputs."""
    monkeypatch.setattr(bwd, "_backward_varlen", lambda *a: pytest.fail("host read"))
    q, k, v, g, beta, do, h0, dht = _problem(b, 333, 2, 4, torch.bfloat16, seed=b, l2norm=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
                                            output_final_state=True,
                                            use_qk_l2norm_in_kernel=True)  # fmt: skip
    grads = torch.autograd.grad((o.float() * do.float()).sum() + (final * dht).sum(), leaves)
    assert len(kernel_path) == _launches()
    want = _reference((q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=True)
    for name, a, r in zip(NAMES, grads, want):
        _close(name, a, r)


def test_the_default_is_the_kernel_path(monkeypatch):
    """gated_delta_rule's autograd with FORGEKERNEL_GDN_BWD_KERNEL unset (the default since
    2026-12-06): the kernel path (`_backward_kernel`, no interim call), its gradients against
    the fp64 backward on the same inputs."""
    monkeypatch.delenv(bwd.KERNEL_SWITCH, raising=False)
    taken = []
    kernel = bwd._backward_kernel
    monkeypatch.setattr(bwd, "_backward_kernel", lambda *a: taken.append(1) or kernel(*a))
    monkeypatch.setattr(bwd, "_backward_interim", lambda *a: pytest.fail("interim path"))
    q, k, v, g, beta, do, h0, dht = _problem(2, 333, 2, 4, torch.bfloat16, seed=5, l2norm=True)
    leaves = [x.clone().requires_grad_() for x in (q, k, v, g, beta, h0)]
    o, final = forgekernel.gated_delta_rule(*leaves[:5], initial_state=leaves[5],
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
        return forgekernel.gated_delta_rule_backward(*args, **kw)

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


@pytest.mark.parametrize("varlen", [False, True])
def test_time_at_bench_size(kernel_path, monkeypatch, varlen):
    """4 x 8192 tokens, H 16, HV 32 (the gdn_bwd suite's batch case; `varlen`: its B = 1 +
    cu_seqlens form): the path's time, the kernel launches' times, peak memory (printed;
    the prediction: NOTES.md "Backward kernel 0"), gradients finite."""
    q, k, v, g, beta, do, h0, dht = _problem(4, 8192, 16, 32, torch.bfloat16, seed=13)
    args, kw = [q, k, v, g, beta, do], {"initial_state": h0, "d_final_state": dht}
    if varlen:
        args = [x.flatten(0, 1).unsqueeze(0) for x in args]
        kw["cu_seqlens"] = torch.arange(5, device="cuda", dtype=torch.int32) * 8192
    grads = forgekernel.gated_delta_rule_backward(*args, **kw)
    for name, x in zip(NAMES, grads):
        assert torch.isfinite(x).all(), name
    torch.cuda.reset_peak_memory_stats()
    ms = median(time_ms(lambda: forgekernel.gated_delta_rule_backward(*args, **kw), reps=10))
    peak = torch.cuda.max_memory_allocated() / 2**30
    kernel_args, chunk_args, factor_args, norm_args = [], [], [], []
    kn = norm_launch.gdn_bwd_norm
    monkeypatch.setattr(bwd, "_qk_grads", lambda *a: norm_args.append(a) or kn(*a))
    k0 = factors_launch.gdn_bwd_factors
    monkeypatch.setattr(
        bwd, "_factors", lambda *a, **kw: factor_args.append((a, kw)) or k0(*a, **kw)
    )

    def k1(*a, **kw):
        kernel_args.append((a, kw))
        return gdn_bwd_state(*a, **kw)

    monkeypatch.setattr(bwd, "_state_recurrence", k1)
    k2 = chunk_launch.gdn_bwd_chunk_wy
    monkeypatch.setattr(bwd, "_chunk_grads_wy",
                        lambda *a, **kw: chunk_args.append((a, kw)) or k2(*a, **kw))  # fmt: skip
    forgekernel.gated_delta_rule_backward(*args, **kw)
    launches = [median(time_ms(lambda a=a, kw=kw: gdn_bwd_state(*a, **kw), reps=10))
                for a, kw in kernel_args]  # fmt: skip
    chunk = [median(time_ms(lambda a=a, kw=kw: k2(*a, **kw), reps=10))
             for a, kw in chunk_args]  # fmt: skip
    factors = [median(time_ms(lambda a=a, kw=kw: k0(*a, **kw), reps=10)) for a, kw in factor_args]
    norms = [median(time_ms(lambda a=a: kn(*a), reps=10)) for a in norm_args]
    form = "varlen" if varlen else "B = 4"
    print(f"\nGDN backward on kernels 0-2, 4 x 8192 h16 hv32 bf16 ({form}): {ms:.2f} ms a "
          f"call, kernel 1 {' + '.join(f'{x:.3f}' for x in launches)} ms, kernel 2 "
          f"{' + '.join(f'{x:.3f}' for x in chunk)} ms, kernel 0 "
          f"{' + '.join(f'{x:.3f}' for x in factors)} ms, q / k epilogue "
          f"{' + '.join(f'{x:.3f}' for x in norms)} ms, peak {peak:.1f} GiB")  # fmt: skip


@pytest.mark.parametrize("t", [65, 1000])
@pytest.mark.parametrize(("h", "hv", "l2norm"), [(2, 2, False), (2, 4, False), (2, 4, True)])
def test_qk16_against_fp32_dq_dk(kernel_path, monkeypatch, t, h, hv, l2norm):
    """QK16 (the default: kernel 2's dq, dk in 16 bits, the epilogue's `d16` key; without
    l2norm at HV = H no epilogue, dq x scale in kernel 2) and QK16 off (fp32 dq, dk, the
    epilogue always): both against the fp64 backward and the interim path (`_check`), and dq,
    dk of the two within 1e-2 of the fp32 path's largest entry."""
    q, k, v, g, beta, do, h0, dht = _problem(2, t, h, hv, torch.bfloat16, seed=t + hv,
                                             l2norm=l2norm)  # fmt: skip
    got = {}
    for on in (True, False):
        monkeypatch.setattr(bwd, "QK16", on)
        monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")  # `_check` leaves it at "0"
        kernel_path.clear()
        QK16_CALLS.clear()
        _check(kernel_path, monkeypatch, (q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=l2norm)
        fold = on and not l2norm and h == hv
        assert ("qk" in [c[0] for c in kernel_path]) == (not fold)
        assert QK16_CALLS == [(on, 128**-0.5 if fold else 1.0)]
        monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
        got[on] = _run((q, k, v, g, beta, do), h0=h0, dht=dht, l2norm=l2norm, k_last=False)[:2]
    for name, a, r in zip(("dq", "dk"), got[True], got[False]):
        assert a.dtype == r.dtype == q.dtype, name
        err = float((a.double() - r.double()).abs().max())
        assert err <= 1e-2 * float(r.double().abs().max()) + 1e-6, (name, err)
