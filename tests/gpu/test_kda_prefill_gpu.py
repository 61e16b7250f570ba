"""Kimi Delta Attention forward (`forgekernel.ops.kda_chunked.kimi_delta_attention`, issue 20)
on the GPU against the fp64 recurrence: varlen with empty, single-token, sub-chunk and odd
sequences, a long sequence, with and without an initial state, l2norm on unnormalized keys,
grouped value heads, fp16 and bf16, strong per-channel decays (g in [-5, -4] per step: the
case the sub-chunk references exist for), g in q's dtype; `out=`; fla's
chunk_kda where installed; the recurrence kernel against its CPU replay (tests/
kda_prefill_replay.py) on the same first-pass operands; the op captured in a CUDA graph and
replayed on new inputs (new offsets too) against eager calls, and no synchronizing op in an
eager call (torch's sync debug mode). The op runs the first pass on its kernel (`intra.py`;
against its torch model `operands.py` output by output below) and the recurrence on the WGMMA
kernel (kernels/linear_attention/kda_prefill/sm90).

Tolerances: o within 2e-2 of max |o|, the final state within 2e-2 of max |S| (the kernel's
16-bit operands; the CPU model sits below 7e-3 at g down to -5)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.kda_chunked")
TOL = 2e-2


def _inputs(lens, h, hv, dtype, seed=0, knorm=1.0, strong=False):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, total, h, 128).to(dtype)
    k = (F.normalize(rnd(1, total, h, 128), dim=-1) * knorm).to(dtype)
    v = rnd(1, total, hv, 128).to(dtype)
    if strong:
        g = -4.0 - torch.rand(1, total, hv, 128, device="cuda", generator=gen)
    else:
        g = F.logsigmoid(rnd(1, total, hv, 128) + 2.0)
    beta = torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, v, g, beta, state, cu


def _close(got, want, rel):
    assert got.shape == want.shape
    if want.numel() == 0:
        return
    assert torch.isfinite(got).all()
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, err


def _check(lens, h, hv, dtype, *, state=True, l2norm=False, strong=False, knorm=1.0, seed=0):
    q, k, v, g, beta, h0, cu = _inputs(lens, h, hv, dtype, seed, knorm, strong)
    init = h0 if state else None
    o, s = op.kimi_delta_attention(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                   cu_seqlens=cu.to(torch.int32),
                                   use_qk_l2norm_in_kernel=l2norm)  # fmt: skip
    o_ref, s_ref = kimi_delta_attention_recurrent(q, k, v, g, beta, initial_state=init,
                                                  output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm=l2norm)  # fmt: skip
    assert o.dtype == dtype and s.dtype == torch.float32
    _close(o, o_ref, TOL)
    _close(s, s_ref, TOL)
    return o, s


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("state", [True, False])
def test_varlen_edges(dtype, state):
    _check([1, 0, 63, 64, 65, 16, 17, 130], 2, 2, dtype, state=state)


def test_grouped_value_heads_and_l2norm():
    _check([200, 37], 4, 8, torch.bfloat16, l2norm=True, knorm=3.0)


@pytest.mark.parametrize("lens", [[1500], [700, 5, 801]])
def test_strong_per_channel_decay(lens):
    _check(lens, 2, 2, torch.bfloat16, strong=True)


def test_long_sequence():
    _check([4100], 1, 2, torch.bfloat16, seed=3)


def test_batch_without_offsets_equals_varlen():
    q, k, v, g, beta, h0, _ = _inputs([96, 96], 2, 2, torch.bfloat16, seed=4)
    as_batch = (x.view(2, 96, *x.shape[2:]) for x in (q, k, v, g, beta))
    o_b, s_b = op.kimi_delta_attention(*as_batch, initial_state=h0, output_final_state=True)
    cu = torch.tensor([0, 96, 192], device="cuda", dtype=torch.int32)
    o_v, s_v = op.kimi_delta_attention(q, k, v, g, beta, initial_state=h0,
                                       output_final_state=True, cu_seqlens=cu)  # fmt: skip
    torch.testing.assert_close(o_b.view(1, 192, 2, 128), o_v, rtol=0, atol=0)
    torch.testing.assert_close(s_b, s_v, rtol=0, atol=0)


def test_gate_in_q_dtype_and_out():
    q, k, v, g, beta, h0, cu = _inputs([77], 2, 2, torch.bfloat16, seed=5)
    out = torch.empty_like(v)
    o, _ = op.kimi_delta_attention(q, k, v, g.to(q.dtype), beta.to(q.dtype), out=out)
    assert o.data_ptr() == out.data_ptr()
    o_ref, _ = kimi_delta_attention_recurrent(q, k, v, g.to(q.dtype), beta.to(q.dtype))
    _close(out, o_ref, TOL)


def test_against_fla():
    fla_kda = pytest.importorskip("fla.ops.kda")
    q, k, v, g, beta, h0, cu = _inputs([300, 1000, 5], 4, 4, torch.bfloat16, seed=7)
    o, s = op.kimi_delta_attention(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                   cu_seqlens=cu)  # fmt: skip
    o_f, s_f = fla_kda.chunk_kda(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                 cu_seqlens=cu)  # fmt: skip
    _close(o, o_f.to(o.dtype), 3 * TOL)
    _close(s, s_f.float(), 3 * TOL)


@pytest.mark.parametrize("split", [False, True], ids=["one-cta", "value-split"])
def test_kernel_equals_its_replay(split):
    """The recurrence kernel and tests/kda_prefill_replay.py on the same operands (the torch
    first pass): equal up to fp32 summation order and 16-bit roundings of the output."""
    import kda_prefill_replay as replay

    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import SPEC, launch, operands
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import params_for
    from forgekernel.runtime.cache import get_kernel

    q, k, v, g, beta, h0, cu = _inputs([1, 63, 64, 65, 300], 2, 4, torch.bfloat16, seed=11)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    ops = operands.kda_chunk_operands(q, k, g, beta, cu.to(torch.int32), 128**-0.5, False)
    args = (ops["q_g"], ops["k_g"], ops["k_d"], ops["t_beta"], ops["p"], ops["decay"], v, h0,
            cu.to(torch.int32), ops["first"])  # fmt: skip
    outs = []
    params = params_for("bfloat16", initial_state=True, value_split=split)
    for fn in (get_kernel(SPEC, params),
               replay.kernel({"initial_state": True})):  # fmt: skip
        o, s = torch.zeros_like(v), torch.empty_like(h0)
        fn(*args, o, s, None)  # mWarm: the warm-up form off (its key's `warmup`)
        torch.cuda.synchronize()
        outs.append((o, s))
    (o, s), (o_r, s_r) = outs
    _close(o, o_r, 1e-2)
    _close(s, s_r, 1e-3)
    assert launch.ALIGN == 16


def test_first_pass_kernel_equals_torch_first_pass():
    """intra.py against operands.py on the same inputs, output by output: the bf16 operand
    tiles within a few bf16 roundings of their largest entry, D to fp32 exp2, over the real
    chunks. Both lay out `chunk_bound` chunks, min(T, (T + 63 N) // 64) = 12 for T = 493,
    N = 5: 2 past the 10 real ones, of length 0 (the kernel leaves their rows unwritten; the
    recurrence never reads them). The CPU twin with the kernel's replay:
    tests/test_kda_op.py::test_first_pass_kernel_layout_is_the_torch_first_pass_layout."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    q, k, v, g, beta, _, cu = _inputs([1, 63, 64, 65, 300], 2, 4, torch.bfloat16, seed=13,
                                      strong=True)  # fmt: skip
    q, k, g, beta = (x[0] for x in (q, k, g, beta))
    cu = cu.to(torch.int32)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False)
    got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    assert torch.equal(got["first"], want["first"])
    real = 1 + 1 + 1 + 2 + 5  # ceil(len / 64) of [1, 63, 64, 65, 300]
    bound = operands.chunk_bound(493, 5)
    assert bound == (493 + 63 * 5) // 64 == real + 2
    assert got["decay"].shape[0] == want["decay"].shape[0] == bound
    assert got["q_g"].shape[0] == want["q_g"].shape[0] == 64 * bound
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        cut = real if name == "decay" else 64 * real
        _close(got[name][:cut].float(), want[name][:cut].float(), 3e-2)


@pytest.mark.parametrize("decay", ["strong", "none"])
def test_first_pass_tensor_core_inverse(decay):
    """The first pass's inverse merges on the tensor cores (GDN's inverse_mma, mma.sync tf32:
    the standard form since 2026-12-03; checked against the FFMA form on the H200 then) against
    the torch first pass's fp32 solve: T diag(beta) within 1e-2 of its largest entry (tf32: a
    few bf16 roundings), with g in [-5, -4] and with no decay (T's largest entries); the op's o
    and state against the fp64 recurrence. A wrong fragment map fails by far, not by a
    tolerance."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    lens = [1, 63, 64, 65, 300, 1000]
    q, k, v, g, beta, state, cu = _inputs(lens, 2, 4, torch.bfloat16, seed=14,
                                          strong=decay == "strong")  # fmt: skip
    if decay == "none":
        g = torch.zeros_like(g)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    cu = cu.to(torch.int32)
    real = sum(-(-n // 64) for n in lens)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False)
    got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    _close(got["t_beta"][: 64 * real].float(), want["t_beta"][: 64 * real].float(), 1e-2)
    o = torch.empty_like(v)
    final = torch.empty_like(state)
    launch.kda_prefill(q, k, v, g, beta, state, cu, o, final, 128**-0.5, l2norm=False)
    o_ref, s_ref = kimi_delta_attention_recurrent(q[None], k[None], v[None], g[None],
                                                  beta[None], initial_state=state,
                                                  output_final_state=True,
                                                  cu_seqlens=cu.long())  # fmt: skip
    _close(o[None], o_ref, TOL)
    _close(final, s_ref, TOL)


@pytest.mark.parametrize("l2norm", [False, True])
def test_strong_decay_with_l2norm_and_empty_sequences(l2norm):
    q, k, v, g, beta, h0, cu = _inputs([1, 0, 64, 65, 700], 2, 4, torch.bfloat16, seed=14,
                                       strong=True, knorm=2.0 if l2norm else 1.0)  # fmt: skip
    o, s = op._forward(q, k, v, g, beta, 128**-0.5, h0, cu.to(torch.int32), l2norm)
    o_ref, s_ref = kimi_delta_attention_recurrent(q, k, v, g, beta, initial_state=h0,
                                                  output_final_state=True, cu_seqlens=cu,
                                                  use_qk_l2norm=l2norm)  # fmt: skip
    _close(o, o_ref, TOL)
    _close(s, s_ref, TOL)


# ------------------------------------------------------------------------- CUDA-graph capture


def _static(lens, h, hv, seed, state=True):
    q, k, v, g, beta, h0, cu = _inputs(lens, h, hv, torch.bfloat16, seed=seed, strong=True)
    return {"q": q, "k": k, "v": v, "g": g, "beta": beta, "initial_state": h0 if state else None,
            "cu_seqlens": cu.to(torch.int32)}  # fmt: skip


def _call(x):
    return op.kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                   initial_state=x["initial_state"], output_final_state=True,
                                   cu_seqlens=x["cu_seqlens"])  # fmt: skip


def _capture(x):
    """The op captured in a CUDA graph on x's tensors (warmed up on a side stream first:
    kernels compiled, allocator pools filled), -> (graph, (o, final))."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(2):
            _call(x)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = _call(x)
    return graph, outs


def _refill(x, new):
    for name, t in x.items():
        if t is not None:
            t.copy_(new[name])


@pytest.mark.parametrize(
    "lens, lens_next, hv",
    [
        ([1, 0, 63, 64, 65, 300], [100, 64, 0, 1, 200, 128], 2),  # same T and N, new offsets
        ([700, 5, 801], [64, 1378, 64], 4),
        ([2048], [2048], 2),  # one sequence: the exact layout, no row gather
    ],
)
def test_captured_in_a_cuda_graph_and_replayed_with_new_inputs(lens, lens_next, hv):
    """The op (offsets never read on the host) captured once, then replayed on new values of
    every input, new offsets included (same T and N): o and the final state equal the eager
    call on those inputs (the same kernels on the same shapes: bitwise expected; asserted to
    1e-6 of the largest entry), and both within TOL of the fp64 recurrence."""
    x = _static(lens, 2, hv, seed=21)
    graph, (o_g, s_g) = _capture(x)
    for seed, new_lens in ((22, lens_next), (23, lens)):
        new = _static(new_lens, 2, hv, seed=seed)
        _refill(x, new)
        graph.replay()
        torch.cuda.synchronize()
        o_e, s_e = _call(new)
        _close(o_g, o_e, 1e-6)
        _close(s_g, s_e, 1e-6)
        cu = new["cu_seqlens"].long()
        o_ref, s_ref = kimi_delta_attention_recurrent(
            new["q"], new["k"], new["v"], new["g"], new["beta"],
            initial_state=new["initial_state"], output_final_state=True, cu_seqlens=cu,
        )  # fmt: skip
        _close(o_g, o_ref, TOL)
        _close(s_g, s_ref, TOL)


def test_captured_batch_without_offsets():
    """B = 3, T = 70 each, no cu_seqlens, no initial state: the op builds the offsets on the
    device; the graph replays new values."""
    x = _static([70, 70, 70], 2, 2, seed=24, state=False)
    as_batch = {n: None if t is None else t.view(3, 70, *t.shape[2:])
                for n, t in x.items() if n != "cu_seqlens"}  # fmt: skip

    def call(b):
        return op.kimi_delta_attention(b["q"], b["k"], b["v"], b["g"], b["beta"],
                                       output_final_state=True)  # fmt: skip

    call(as_batch)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, s_g = call(as_batch)
    new = _static([70, 70, 70], 2, 2, seed=25, state=False)
    for name in ("q", "k", "v", "g", "beta"):
        as_batch[name].copy_(new[name].view(3, 70, *new[name].shape[2:]))
    graph.replay()
    torch.cuda.synchronize()
    o_e, s_e = call(as_batch)
    _close(o_g, o_e, 1e-6)
    _close(s_g, s_e, 1e-6)


def test_no_synchronizing_op_in_an_eager_call():
    """torch's sync debug mode "error" raises on any op that synchronizes with the host (an
    .item(), a nonzero, a device-to-host copy): none in a (warmed-up) eager call."""
    x = _static([1, 0, 63, 64, 65, 300], 2, 4, seed=26)
    _call(x)  # compiled, warmed up
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        _call(x)
    finally:
        torch.cuda.set_sync_debug_mode("default")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens, h, hv, strong",
    [
        ([1, 63, 64, 65, 300], 2, 4, True),
        ([100, 0, 37, 0, 1000], 4, 4, False),
        ([129], 1, 2, False),
    ],
)
def test_first_pass_awkward_sizes(dtype, lens, h, hv, strong):
    """The first pass (`intra.py`, the "rows8" layout: a thread on 8 tokens x 8 channels,
    16-byte accesses, L and P by mma.sync m16n8k16) against the torch first pass, output by
    output over the real chunks (empty sequences, lengths off the chunk, GQA, fp16; g in
    [-5, -4] or fla's gate): within a few bf16 roundings (the bound the WGMMA kernel before it
    was held to, 3e-2; its G2 sums and E's placement differ from the torch pass's); a wrong
    fragment or swizzle map fails by far. Then the op against the fp64 recurrence."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype, seed=21, strong=strong)
    q, k, v, g, beta = (x[0] for x in (q, k, v, g, beta))
    cu = cu.to(torch.int32)
    real = sum(-(-n // 64) for n in lens)
    got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False)
    assert torch.equal(got["first"], want["first"])
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        cut = real if name == "decay" else 64 * real
        _close(got[name][:cut].float(), want[name][:cut].float(), 3e-2)
    o, final = torch.empty_like(v), torch.empty_like(state)
    launch.kda_prefill(q, k, v, g, beta, state, cu, o, final, 128**-0.5, l2norm=False)
    o_ref, s_ref = kimi_delta_attention_recurrent(q[None], k[None], v[None], g[None],
                                                  beta[None], initial_state=state,
                                                  output_final_state=True,
                                                  cu_seqlens=cu.long())  # fmt: skip
    _close(o[None], o_ref, TOL)
    _close(final, s_ref, TOL)


def test_first_pass_rows_past_the_end_are_zero():
    """Rows past a sequence's end (inside its last chunk) are exact zeros in every operand of
    the first pass, and so are T's and P's columns past it (the recurrence relies on it)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch

    lens = [5, 70]
    q, k, _, g, beta, _, cu = _inputs(lens, 2, 2, torch.bfloat16, seed=22)
    q, k, g, beta = (x[0] for x in (q, k, g, beta))
    got = launch.first_pass_kernel(q, k, g, beta, cu.to(torch.int32), 0.1, False)
    for name in ("q_g", "k_g", "k_d", "t_beta", "p"):
        x = got[name]
        assert not x[5:64].any() and not x[64 + 64 + 6 : 64 * 3].any(), name
        if name in ("t_beta", "p"):  # columns past the end too
            assert not x[:5, :, 5:].any(), name


def _segmented(q, k, v, g, beta, init, cu, parts, kind="segments"):
    """The launcher with the recurrence over `parts` segments (or pieces) a sequence (opt-in)."""
    launch = importlib.import_module("forgekernel.kernels.linear_attention.kda_prefill.sm90.launch")
    n, hv = cu.numel() - 1, v.shape[2]
    out = torch.empty_like(v[0])
    final = torch.empty(n, hv, 128, 128, device="cuda")
    launch.kda_prefill(q[0], k[0], v[0], g[0], beta[0], init, cu.to(torch.int32), out, final,
                       128**-0.5, l2norm=False, **{kind: parts})  # fmt: skip
    return out[None], final


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("strong", [False, True])
@pytest.mark.parametrize("state", [True, False])
def test_segments_match_the_recurrence(dtype, strong, state):
    """The recurrence over segments (launch._segmented: A, B from 64 I, the scan, C; the first
    pass once): o and the final state against the fp64 recurrence, partial chunks, an empty
    sequence, a sequence shorter than its segments; fp16 too (pass B's 64 I in range)."""
    lens = [1000, 0, 70, 3000]
    q, k, v, g, beta, h0, cu = _inputs(lens, 2, 4, dtype, seed=41, strong=strong)
    init = h0 if state else None
    o_ref, s_ref = kimi_delta_attention_recurrent(
        q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu
    )
    for parts in (3, 9):
        o, s = _segmented(q, k, v, g, beta, init, cu, parts)
        _close(o, o_ref, TOL)
        _close(s, s_ref, TOL)


def test_segments_in_a_cuda_graph():
    """The suite's 1 x 32768 hv16 variant (segments_9) at 8192 tokens: captured in a CUDA graph
    (offsets and segment tables on the device, no host sync), the replay equals the eager
    call."""
    q, k, v, g, beta, h0, cu = _inputs([8192], 16, 16, torch.bfloat16, seed=42)
    o, s = _segmented(q, k, v, g, beta, h0, cu, 9)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_o, got_s = _segmented(q, k, v, g, beta, h0, cu, 9)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_o, o) and torch.equal(got_s, s)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("decay", ["mild", "strong", "weak"])
@pytest.mark.parametrize("state", [True, False])
def test_pieces_match_the_recurrence(dtype, decay, state):
    """Pieces after warm-up chunks (launch._pieces, the `warmup` kernel): o and the final state
    against the fp64 recurrence; weak decays (g ~ -0.01: every piece falls back to its
    sequence's start) as the direct launch."""
    lens = [1000, 0, 70, 3000]
    q, k, v, g, beta, h0, cu = _inputs(lens, 2, 4, dtype, seed=43, strong=decay == "strong")
    if decay == "weak":
        g = torch.full_like(g, -0.01)
    init = h0 if state else None
    o_ref, s_ref = kimi_delta_attention_recurrent(
        q, k, v, g, beta, initial_state=init, output_final_state=True, cu_seqlens=cu
    )
    o1, s1 = _segmented(q, k, v, g, beta, init, cu, 1)
    for parts in (3, 8):
        o, s = _segmented(q, k, v, g, beta, init, cu, parts, "pieces")
        _close(o, o_ref, TOL)
        _close(s, s_ref, TOL)
        if decay == "weak":  # the same math (the V split may differ: not asked bitwise)
            _close(o, o1, 1e-3)
            _close(s, s1, 1e-3)


def test_pieces_in_a_cuda_graph():
    """pieces_8 at 1 x 8192 hv16 captured in a CUDA graph (warm-up chosen on the device: no
    host sync): the replay equals the eager call."""
    q, k, v, g, beta, h0, cu = _inputs([8192], 16, 16, torch.bfloat16, seed=44)
    o, s = _segmented(q, k, v, g, beta, h0, cu, 8, "pieces")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_o, got_s = _segmented(q, k, v, g, beta, h0, cu, 8, "pieces")
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_o, o) and torch.equal(got_s, s)
