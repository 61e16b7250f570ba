"""`forgekernel.ops.kda_chunked.kimi_delta_attention` on the CPU: argument validation (clear
messages); the real launcher with torch replays of its two kernels, the first pass and the
recurrence (tests/kda_prefill_replay.py: the kernels' reads, roundings and stores) against the fp64
recurrence (batches, varlen with empty / single-token / odd sequences, initial states, GQA,
l2norm, strong per-channel decays, fp16); a call autograd records goes through the custom op
and back (the backward itself: tests/test_kda_bwd_op.py)."""

from __future__ import annotations

import itertools
import random

import kda_prefill_replay as replay
import pytest
import torch
import torch.nn.functional as F
from script_modules import load_script  # tests/ is on the path
from sweeps import slow_past

import forgekernel
import forgekernel.ops.kda_chunked as op
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands
from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent

D = 128


def make(b=1, t=70, h=2, hv=2, dtype=torch.bfloat16, n=None, seed=0, decay=(-2.0, 0.0)):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*s):
        return torch.randn(*s, generator=gen)

    lo, hi = decay
    return {
        "q": rnd(b, t, h, D).to(dtype),
        "k": F.normalize(rnd(b, t, h, D), dim=-1).to(dtype),
        "v": rnd(b, t, hv, D).to(dtype),
        "g": lo + (hi - lo) * torch.rand(b, t, hv, D, generator=gen),
        "beta": torch.sigmoid(rnd(b, t, hv)),
        "state": 0.1 * rnd(b if n is None else n, hv, D, D),
    }


@pytest.fixture
def cpu_kernel(monkeypatch):
    calls = []

    def get(spec, params):
        calls.append(dict(params))
        if spec.name == "kda_intra_sm90":
            return replay.intra_kernel(dict(params))
        return replay.kernel(dict(params))

    monkeypatch.setattr(launch, "get_kernel", get)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    return calls


def run_op(x, cu=None, l2norm=False, state=True):
    return op.kimi_delta_attention(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["state"] if state else None,
        output_final_state=True, cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
    )  # fmt: skip


def reference(x, cu=None, l2norm=False, state=True):
    return kimi_delta_attention_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["state"] if state else None,
        output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2norm,
    )  # fmt: skip


def close(got, want, tol):
    err = (got.double() - want).abs().max() / want.abs().max().clamp_min(1.0)
    assert err < tol, err.item()


def test_use_qk_l2norm_is_issue_20s_name_of_the_fla_keyword(cpu_kernel):
    """use_qk_l2norm= (issue 20) and use_qk_l2norm_in_kernel= (fla): one argument; both given
    and different is an error."""
    x = make(b=2, t=37, h=2, hv=2, seed=5)
    kw = {"initial_state": x["state"], "output_final_state": True}
    plain_o, plain_s = op.kimi_delta_attention(*(x[n] for n in "q k v g beta".split()),
                                               use_qk_l2norm=False, **kw)  # fmt: skip
    close(plain_o, reference(x)[0], 2e-2)
    assert torch.equal(plain_o, run_op(x)[0]) and torch.equal(plain_s, run_op(x)[1])
    x["k"] = x["k"] * 4  # unnormalized keys: only the l2norm keeps the recurrence stable
    args = tuple(x[n] for n in "q k v g beta".split())
    o, final = op.kimi_delta_attention(*args, use_qk_l2norm=True, **kw)
    want_o, want_s = reference(x, l2norm=True)
    close(o, want_o, 2e-2)
    close(final, want_s, 2e-2)
    fla_o, fla_final = run_op(x, l2norm=True)
    assert torch.equal(o, fla_o) and torch.equal(final, fla_final)
    with pytest.raises(ValueError, match="name the same argument"):
        op.kimi_delta_attention(*args, use_qk_l2norm_in_kernel=False, use_qk_l2norm=True)


def test_exported_since_its_gpu_check():
    """docs/PENDING.md: a pending op stays out of the public API until its GPU check, which
    kda_prefill passed on the H200 on 2026-12-02 (exported by de8331c)."""
    assert forgekernel.kimi_delta_attention is op.kimi_delta_attention
    assert op.chunk_kda is op.kimi_delta_attention


@pytest.mark.parametrize("l2norm", [False, True])
def test_batch_with_strong_decay(cpu_kernel, l2norm):
    x = make(b=2, t=150, h=1, hv=2, seed=1, decay=(-5.0, 0.0))
    o, s = run_op(x, l2norm=l2norm)
    o_ref, s_ref = reference(x, l2norm=l2norm)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    close(o, o_ref, 2e-2)
    close(s, s_ref, 2e-2)
    # 2 sequences x 2 heads leave SMs idle: each (sequence, head) split over two CTAs
    want = {"dtype": "bfloat16", "k": 128, "v": 128, "initial_state": True, "value_split": True}
    assert cpu_kernel == [{"dtype": "bfloat16", "k": 128}, want]  # first pass, recurrence


def test_value_split_only_where_sms_would_idle():
    cpu = torch.device("cpu")  # counted as 132 SMs
    assert launch.value_split(4, 16, cpu) and launch.value_split(1, 66, cpu)
    assert not launch.value_split(1, 67, cpu) and not launch.value_split(8, 16, cpu)


@pytest.mark.parametrize("state", [True, False])
def test_varlen_with_empty_and_odd_sequences(cpu_kernel, state):
    lens = [5, 0, 64, 71, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = make(t=sum(lens), h=2, hv=4, n=len(lens), seed=2)
    o, s = run_op(x, cu=cu, state=state)
    o_ref, s_ref = reference(x, cu=cu, state=state)
    close(o, o_ref, 2e-2)
    close(s, s_ref, 2e-2)
    want = x["state"][1] if state else torch.zeros_like(s[1])
    assert torch.equal(s[1], want)  # an empty sequence keeps its state


def test_fp16_and_gates_in_q_dtype(cpu_kernel):
    x = make(t=90, h=2, hv=2, dtype=torch.float16, seed=8, decay=(-4.0, 0.0))
    x["g"], x["beta"] = x["g"].half(), x["beta"].half()
    o, s = run_op(x)
    o_ref, s_ref = reference(x)
    assert o.dtype == torch.float16
    close(o, o_ref, 2e-2)
    close(s, s_ref, 2e-2)
    assert [p["dtype"] for p in cpu_kernel] == ["float16", "float16"]


def test_out_is_written(cpu_kernel):
    x = make(t=33, seed=9)
    out = torch.empty_like(x["v"])
    o, s = op.kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], out=out)
    assert o.data_ptr() == out.data_ptr() and s is None
    close(out, reference(x, state=False)[0], 2e-2)


def test_all_sequences_empty(cpu_kernel):
    x = make(t=0, n=2, seed=10)
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    o, s = run_op(x, cu=cu)
    assert o.shape == x["v"].shape and torch.equal(s, x["state"])
    assert cpu_kernel == []  # nothing launched


def _call(x, **kw):
    return op.kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"], **kw)


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda x: x.update(k=x["k"][..., :64]), "k must have shape"),
        (lambda x: x.update(v=x["v"][:, :, :1]), "HV a multiple of H"),
        (lambda x: x.update(g=x["g"][..., 0]), "g must be 4-D"),
        (lambda x: x.update(g=x["g"].double()), "g must have dtype"),
        (lambda x: x.update(beta=x["beta"][..., None]), "beta must be 3-D"),
        (lambda x: x.update(q=x["q"].float(), k=x["k"].float()), "q must have dtype"),
        (lambda x: x.update(state=x["state"][:, :1]), "initial_state must have shape"),
        (lambda x: x.update(state=x["state"].half()), "initial_state must have dtype"),
    ],
)
def test_bad_arguments_are_named(change, message):
    x = make(b=1, t=8)
    change(x)
    with pytest.raises((ValueError, TypeError), match=message):
        _call(x, initial_state=x["state"])


@pytest.mark.parametrize(
    "kwargs, err, message",
    [
        ({"scale": float("nan")}, ValueError, "scale must be finite"),
        ({"scale": [0.1]}, TypeError, "scale must be a float or None"),
        ({"output_final_state": "no"}, TypeError, "output_final_state must be a bool"),
        ({"use_qk_l2norm": 1}, TypeError, "use_qk_l2norm_in_kernel must be a bool"),
        ({"out": torch.empty(1, 8, 2, 128, device="meta", dtype=torch.bfloat16)}, ValueError,
         "out is on meta but q is on cpu"),
    ],
)
def test_bad_scalars_are_named(cpu_kernel, kwargs, err, message):
    x = make(b=1, t=8)
    with pytest.raises(err, match=message):
        _call(x, **kwargs)
    assert cpu_kernel == []


def test_bad_offsets_and_head_dims():
    x = make(b=2, t=8)
    with pytest.raises(ValueError, match="B = 1"):
        _call(x, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    x = make(b=1, t=8)
    with pytest.raises(ValueError, match="rise from 0 to T"):
        _call(x, cu_seqlens=torch.tensor([0, 9], dtype=torch.int32))
    with pytest.raises(TypeError, match="cu_seqlens must have dtype"):
        _call(x, cu_seqlens=torch.tensor([0.0, 8.0]))
    small = {key: val[..., :64] if key in "qkvg" else val for key, val in x.items()}
    with pytest.raises(ValueError, match=r"\(K, V\) must be one of"):
        _call(small)


def test_cpu_tensors_are_refused():
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        _call(make(t=8))


def test_grad_goes_through_the_custom_op(cpu_kernel, monkeypatch):
    monkeypatch.setattr("forgekernel.ops.kda_bwd.check_cuda", lambda name, t: None)
    x = make(t=20, seed=3)
    x["q"] = x["q"].requires_grad_()
    o, s = _call(x, initial_state=x["state"], output_final_state=True)
    assert o.requires_grad and s is not None
    o.float().sum().backward()
    assert x["q"].grad.shape == x["q"].shape and torch.isfinite(x["q"].grad).all()


@pytest.mark.parametrize("l2norm", [False, True])
def test_first_pass_kernel_with_l2norm_and_strong_decay(cpu_kernel, l2norm):
    """The launcher's tables for the first-pass kernel (chunk starts and lengths, the chunk
    layout; q and k normalized before it where asked) with a replay of its math, g down to -5
    per step: close to the fp64 recurrence."""
    lens = [5, 0, 64, 71, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = make(t=sum(lens), h=2, hv=4, n=len(lens), seed=12, decay=(-5.0, 0.0))
    if l2norm:
        x["q"], x["k"] = 3 * x["q"], 2 * x["k"]
    o, s = op._forward(x["q"], x["k"], x["v"], x["g"], x["beta"], 0.1, x["state"], cu, l2norm)
    o_ref, s_ref = kimi_delta_attention_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.1, initial_state=x["state"],
        output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2norm,
    )  # fmt: skip
    close(o, o_ref, 2e-2)
    close(s, s_ref, 2e-2)
    assert {"dtype": "bfloat16", "k": 128} in cpu_kernel  # the first-pass kernel was asked for


def _loop_layout(edges):
    """The per-sequence chunk layout as the launcher built it on the host (the yardstick)."""
    first, rows, start = [], [], 0
    for a, z in zip(edges[:-1], edges[1:]):
        nc = -(-(z - a) // 64)
        first.append(start)
        start += nc
        t = torch.arange(nc * 64)
        rows.append(torch.where(t < z - a, t + a, torch.full_like(t, -1)))
    return torch.tensor(first, dtype=torch.int32), torch.cat(rows)


def _random_lens(gen, n):
    """n lengths: empty, short, multiples of 64 and odd ones, mixed."""

    def draw(lo, hi):
        return int(torch.randint(lo, hi, (1,), generator=gen))

    return [(0, draw(1, 64), 64 * draw(1, 5), draw(1, 400))[draw(0, 4)] for _ in range(n)]


FIXED_LENS = [[5, 0, 64, 71, 1, 130], [2048], [64, 0, 128], [0, 0, 3], [63, 65, 64 * 7 + 1],
              [0], [1] * 9, [0, 64, 0]]  # fmt: skip


def _offset_lists():
    gen = torch.Generator().manual_seed(20)
    rand = [_random_lens(gen, int(torch.randint(1, 40, (1,), generator=gen)))
            for _ in range(200)]  # fmt: skip
    return FIXED_LENS + rand


def _edges(lens):
    return [0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()]


def test_chunk_tables_on_the_device_equal_the_host_loop():
    """operands.chunk_tables (torch ops on the offsets where they lie, no host read) against
    the per-sequence loop, for many offset lists (empty sequences, lengths below, at and past
    multiples of 64): first equal; starts / lengths equal over the real chunks, length 0 over
    the rest of the bound; the row tokens equal, -1 past them; the bound never short and tight
    where the lengths allow."""
    for lens in _offset_lists():
        edges = _edges(lens)
        t, n = edges[-1], len(lens)
        want_first, want_token = _loop_layout(edges)
        nc = want_token.numel() // 64
        bound = operands.chunk_bound(t, n)
        assert nc <= bound <= max(t, 0), (lens, bound)
        cu = torch.tensor(edges, dtype=torch.int32)
        first, starts, lengths = operands.chunk_tables(cu, bound)
        assert first.dtype == starts.dtype == lengths.dtype == torch.int32
        assert torch.equal(first, want_first), lens
        chunks = want_token.view(-1, 64)
        assert torch.equal(starts[:nc], chunks[:, 0].to(torch.int32)), lens
        assert torch.equal(lengths[:nc], (chunks >= 0).sum(1).to(torch.int32)), lens
        assert not lengths[nc:].any(), lens
        token = operands.row_tokens(starts, lengths)
        assert torch.equal(token[: 64 * nc], want_token), lens
        assert (token[64 * nc :] == -1).all(), lens
        first_l, token_l = operands.chunk_layout(cu, t)
        assert torch.equal(first_l, want_first) and torch.equal(token_l, token), lens


@pytest.mark.parametrize("n, seq_len", [(1, 2048), (3, 64), (4, 70), (2, 1), (5, 0)])
def test_chunk_layout_of_a_batch(n, seq_len):
    """Lengths known on the host (a batch): the exact bound, and no row table at all where the
    length is a multiple of 64 (rows are tokens)."""
    edges = [seq_len * i for i in range(n + 1)]
    cu = torch.tensor(edges, dtype=torch.int32)
    want_first, want_token = _loop_layout(edges)
    assert operands.chunk_bound(edges[-1], n, seq_len) == want_token.numel() // 64
    first, token = operands.chunk_layout(cu, edges[-1], seq_len)
    assert torch.equal(first, want_first)
    if seq_len % 64 == 0:
        assert token is None and torch.equal(want_token, torch.arange(edges[-1]))
    else:
        assert torch.equal(token, want_token)


def test_chunk_bound_is_tight():
    """N - 1 one-token sequences and a long one reach (T + 63 N) // 64; N > T reaches T."""
    for n, long in ((5, 1000), (2, 64), (30, 1)):
        edges = _edges([1] * (n - 1) + [long])
        nc = _loop_layout(edges)[1].numel() // 64
        assert operands.chunk_bound(edges[-1], n) == nc


def _host_layout(monkeypatch, edges):
    """The first pass on the host-built layout of before (the yardstick)."""
    first, token = _loop_layout(edges)
    token = None if torch.equal(token, torch.arange(edges[-1])) else token
    monkeypatch.setattr(operands, "chunk_layout", lambda cu, t, seq_len=None: (first, token))


@pytest.mark.parametrize("lens, hv", [([64, 128], 2), ([64, 128], 4), ([5, 0, 64, 71, 1, 130], 4),
                                      ([1, 1, 1, 200], 2)])  # fmt: skip
def test_first_pass_on_device_tables_is_bitwise_the_host_one(monkeypatch, lens, hv):
    """The device-built layout (padded to the bound of chunks; row gather always, offsets on
    the device) against the host-built one: the real chunks' operands bitwise equal (the same
    math on the same rows), the chunks past them exact zeros (decay 1), never read."""
    edges = _edges(lens)
    x = {key: val[0] for key, val in make(t=edges[-1], h=2, hv=hv, seed=5, decay=(-5.0, 0.0),
                                          n=len(lens)).items()}  # fmt: skip
    cu = torch.tensor(edges, dtype=torch.int32)
    args = (x["q"], x["k"], x["g"], x["beta"], cu, 0.1, False)
    got = operands.kda_chunk_operands(*args)
    with monkeypatch.context() as m:
        _host_layout(m, edges)
        want = operands.kda_chunk_operands(*args)
    rows = want["q_g"].shape[0]
    assert torch.equal(got["first"], want["first"])
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        cut = rows if name != "decay" else rows // 64
        assert torch.equal(got[name][:cut], want[name]), name
        rest = got[name][cut:]
        assert torch.equal(rest, torch.ones_like(rest) if name == "decay" else rest * 0), name


def test_first_pass_without_a_gather_is_the_gathered_one(monkeypatch):
    """A batch whose length is a multiple of 64 skips the row gather (and H = HV the head
    gather): the operands are bitwise those of the gathered path."""
    x = {key: val[0] for key, val in make(t=192, h=2, hv=2, seed=5, decay=(-5.0, 0.0)).items()}
    cu = torch.tensor([0, 64, 128, 192], dtype=torch.int32)
    args = (x["q"], x["k"], x["g"], x["beta"], cu, 0.1, False)
    fast = operands.kda_chunk_operands(*args, seq_len=64)
    slow = operands.kda_chunk_operands(*args)  # padded to the bound: 5 chunks, 3 real
    assert fast["q_g"].shape[0] == 192 and slow["q_g"].shape[0] == 5 * 64
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay", "first"):
        cut = fast[name].shape[0]
        assert torch.equal(fast[name], slow[name][:cut]), name


def test_first_pass_kernel_layout_is_the_torch_first_pass_layout(cpu_kernel):
    """The first-pass kernel's launcher (its replay) and the torch first pass lay out the same
    chunk_bound(T, N) chunks: 12 for [1, 63, 64, 65, 300] (T 493, N 5), 2 past the 10 real
    ones (the CPU twin of tests/gpu's test_first_pass_kernel_equals_torch_first_pass, which
    expected 5 past them); the real chunks' operands agree within a few bf16 roundings."""
    lens = [1, 63, 64, 65, 300]
    edges = _edges(lens)
    x = {key: val[0] for key, val in make(t=edges[-1], h=2, hv=4, seed=13, decay=(-5.0, -4.0),
                                          n=len(lens)).items()}  # fmt: skip
    cu = torch.tensor(edges, dtype=torch.int32)
    args = (x["q"], x["k"], x["g"], x["beta"], cu, 0.1, False)
    want = operands.kda_chunk_operands(*args)
    got = launch.first_pass_kernel(*args)
    real = sum(-(-n // 64) for n in lens)
    bound = operands.chunk_bound(edges[-1], len(lens))
    assert (real, bound) == (10, 12)
    assert got["decay"].shape[0] == want["decay"].shape[0] == bound
    assert got["q_g"].shape[0] == want["q_g"].shape[0] == 64 * bound
    assert torch.equal(got["first"], want["first"])
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        cut = real if name == "decay" else 64 * real
        g, w = got[name][:cut].float(), want[name][:cut].float()
        assert (g - w).abs().max() <= 2e-2 * w.abs().max(), name


def _host_ops():
    return load_script("kda_host_ops")


@pytest.mark.parametrize("lens", [[2048], [5, 0, 64, 71, 1, 130], [0, 0, 3], [64, 128]])
def test_launch_path_reads_nothing_on_the_host(lens):
    """The op's eager call on meta tensors (the device path with no data behind it: a
    .tolist() / .item() / bool() / nonzero / repeat_interleave without a size raises there)
    with no-op kernels: no op that reads back or sizes by device values, no CPU tensor of a
    dimension or more (a host-built table copied over), the kernels asked for: the call can
    be captured in a CUDA graph (no refusal left either)."""
    host = _host_ops()
    got = host.count(host.inputs(lens, h=2, hv=4, device="meta"))
    assert got["syncs"] == [] and got["host_reads"] == [] and got["on_host"] == []
    assert got["kernels"] == ["kda_intra_sm90", "kda_prefill_sm90"]
    assert not hasattr(launch, "refuse_capture")


@pytest.mark.parametrize("lens", [[2048], [5, 0, 64, 71, 1, 130]])
def test_host_ops_per_call(lens):
    """Around the two kernels only the chunk tables (`launch.device_tables`: 14 launching ops
    for a varlen mix, 21 in `operands.chunk_tables`' form; 102 at 1 x 2048 with the torch
    first pass, 111 with the host tables before that): no row gather, no fp32 temporaries.
    One sequence (every length known on the host): the exact tables built once per (device,
    N, length) and cached, no op after the first call (21 per call before, ~20 launches of
    host issue on a GPU)."""
    host = _host_ops()
    x = host.inputs(lens, device="meta")
    host.count(x)  # the first call may build the cached tables
    got = host.count(x)
    if len(lens) == 1:
        assert got["launching"] == 0, got["by_name"]
        return
    assert got["launching"] <= 14
    assert got["by_name"]["searchsorted"] == 1 and got["by_name"]["index"] == 2


def test_launcher_tables_are_the_model_tables_bitwise():
    """`launch.device_tables` (the launcher's 14-op form) against `operands.chunk_tables` (21
    ops) on random varlen mixes (empty sequences, chunk edges), int32 and int64 offsets, the
    bound and past it: equal bitwise, int32."""
    rng = random.Random(0)
    for _ in range(400):
        n = rng.randint(1, 9)
        lens = [rng.choice([0, 1, 63, 64, 65, 128, 129, rng.randint(0, 700)]) for _ in range(n)]
        dtype = rng.choice([torch.int32, torch.int64])
        cu = torch.tensor([0, *itertools.accumulate(lens)], dtype=dtype)
        bound = operands.chunk_bound(sum(lens), n)
        for nc in (bound, bound + rng.randint(1, 3)):
            got, want = launch.device_tables(cu, nc), operands.chunk_tables(cu, nc)
            for a, b in zip(got, want):
                assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b), (lens, nc)


@pytest.mark.parametrize("n, seq_len", [(1, 2048), (1, 1), (1, 130), (3, 64), (4, 100)])
def test_cached_tables_are_the_offsets_tables(n, seq_len):
    """The cached exact tables (seq_len known) are `chunk_tables` over the offsets 0, L, 2L...
    bitwise, with `chunk_bound`'s chunks; a second lookup is the same objects."""
    cu = torch.arange(n + 1, dtype=torch.int32) * seq_len
    got = launch._tables(cu, n * seq_len, seq_len)
    want = operands.chunk_tables(cu, operands.chunk_bound(n * seq_len, n, seq_len))
    for a, b in zip(got, want):
        assert a.dtype == b.dtype == torch.int32 and torch.equal(a, b)
    assert all(a is b for a, b in zip(launch._tables(cu, n * seq_len, seq_len), got))


def test_tables_cache_is_bypassed_while_capturing_and_never_evicts(monkeypatch):
    """A CUDA graph never holds a cached table (it keeps its own), and a full cache builds per
    call instead of freeing entries another stream or a graph may still read."""
    monkeypatch.setattr(launch, "_TABLES", {})
    cu = torch.tensor([0, 777], dtype=torch.int32)
    monkeypatch.setattr(launch, "_capturing", lambda device: True)
    first = launch._tables(cu, 777, 777)
    assert launch._TABLES == {} and first[1] is not launch._tables(cu, 777, 777)[1]
    monkeypatch.setattr(launch, "_capturing", lambda device: False)
    monkeypatch.setattr(launch, "MAX_TABLES", 1)
    kept = launch._tables(cu, 777, 777)
    other = torch.tensor([0, 500], dtype=torch.int32)
    launch._tables(other, 500, 500)
    assert list(launch._TABLES) == [(cu.device, 1, 777)]
    assert launch._tables(cu, 777, 777)[1] is kept[1]


def test_equal_offsets_are_cached_per_shape(monkeypatch):
    """The KDA backward's first-pass offsets (`launch.equal_offsets`, next/linattn-bwd-host):
    0, L, ..., N L int32; a repeated (device, N, L) hands the same tensor (no launch), a new N
    or L its own; built per call while a graph captures; at most MAX_TABLES kept (no eviction:
    a kernel on another stream may still read one)."""
    monkeypatch.setattr(launch, "_OFFSETS", {})
    cpu = torch.device("cpu")
    first = launch.equal_offsets(cpu, 2, 2048)
    assert first.dtype == torch.int32 and first.tolist() == [0, 2048, 4096]
    assert launch.equal_offsets(cpu, 2, 2048) is first
    for n, seq_len in ((3, 2048), (2, 100)):
        other = launch.equal_offsets(cpu, n, seq_len)
        assert other is not first and other.tolist() == list(range(0, (n + 1) * seq_len, seq_len))
    assert len(launch._OFFSETS) == 3
    monkeypatch.setattr(launch, "_capturing", lambda device: True)
    assert launch.equal_offsets(cpu, 2, 2048) is not first
    assert launch.equal_offsets(cpu, 5, 7).tolist() == [0, 7, 14, 21, 28, 35]
    assert len(launch._OFFSETS) == 3
    monkeypatch.setattr(launch, "_capturing", lambda device: False)
    monkeypatch.setattr(launch, "MAX_TABLES", 3)
    assert launch.equal_offsets(cpu, 9, 9) is not launch.equal_offsets(cpu, 9, 9)
    assert launch.equal_offsets(cpu, 2, 2048) is first and len(launch._OFFSETS) == 3


def _launch(x, cu, segments, state=True):
    """launch.kda_prefill on the varlen form (batch axis dropped), segments forced."""
    n, hv = cu.numel() - 1, x["v"].shape[2]
    out = torch.empty_like(x["v"][0])
    final = torch.empty(n, hv, D, D)
    init = x["state"] if state else None
    launch.kda_prefill(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], init, cu, out,
                       final, D**-0.5, l2norm=False, segments=segments)  # fmt: skip
    return out, final


# CI: 3 segments, with and without a state (the 70- and 1-token sequences have fewer chunks
# than segments: empty segments; 257 tokens end in a 1-token segment); 2 and 5 are slow (CPU
# replays, ~1 s each of an idle CPU, 2026-12-07)
@pytest.mark.parametrize("segments", slow_past([2, 3, 5], keep=3))
@pytest.mark.parametrize("state", [True, False])
def test_segments_match_the_direct_launch_and_fp64(cpu_kernel, segments, state):
    """The recurrence over segments (`launch._segmented`: passes A, B from 64 I, the scan, C)
    against the fp64 recurrence and the direct launch: partial chunks, an empty sequence, a
    sequence of fewer chunks than segments (empty segments), mild and strong decay."""
    lens = [300, 0, 70, 1, 257]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for decay in ((-1.0, 0.0), (-5.0, -4.0)):
        x = make(t=sum(lens), h=1, hv=2, n=len(lens), seed=segments, decay=decay)
        o, s = _launch(x, cu, segments, state)
        o1, s1 = _launch(x, cu, 1, state)
        o_ref, s_ref = reference(x, cu=cu, state=state)
        close(o[None], o_ref, 2e-2)
        close(s, s_ref, 2e-2)
        close(o[None], o1[None].double(), 2e-2)
        close(s, s1.double(), 2e-2)
        init = x["state"][1] if state else torch.zeros_like(s[1])
        assert torch.equal(s[1], init)  # the empty sequence keeps its state


def test_segment_first_chunks():
    """Each segment's first global chunk: its sequence's first chunk plus the whole chunks
    before it in the sequence (segments past a short sequence's end: its chunk count)."""
    lens = [300, 0, 70, 1]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    first = torch.tensor([0, 5, 5, 7], dtype=torch.int32)  # chunks 5, 0, 2, 1
    cu_seg = launch._segment_offsets(cu, 3)
    got = launch._segment_first(cu, first, cu_seg, 3).tolist()
    # 300 tokens: 5 chunks, 2 a segment; 70: 2 chunks, 1 a segment; 1: 1 chunk
    assert got == [0, 2, 4, 5, 5, 5, 5, 6, 7, 7, 8, 8]
    assert cu_seg.tolist()[:4] == [0, 128, 256, 300]


# CI: 3 pieces, with and without a state (pieces past the 70- and 1-token sequences' ends);
# 2 and 6 are slow (CPU replays, ~1.3 s each of an idle CPU, 2026-12-07)
@pytest.mark.parametrize("pieces", slow_past([2, 3, 6], keep=3))
@pytest.mark.parametrize("state", [True, False])
def test_pieces_after_warm_up_chunks(cpu_kernel, pieces, state):
    """Pieces after warm-up chunks from zero (`launch._pieces`, the `warmup` kernel) against the
    fp64 recurrence and the direct launch: decays that meet the bound in one chunk (g to -1 and
    to -5: approximate within 2^-16.5 max |S|) and weak ones that never do (g > -0.05: every
    piece falls back to its sequence's start, exact); partial chunks, an empty sequence, pieces
    past a short sequence's end."""
    lens = [300, 0, 70, 1, 257]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    for decay in ((-1.0, 0.0), (-5.0, -4.0), (-0.05, 0.0)):
        x = make(t=sum(lens), h=1, hv=2, n=len(lens), seed=pieces, decay=decay)
        n, hv = len(lens), 2
        out = torch.empty_like(x["v"][0])
        s = torch.empty(n, hv, D, D)
        init = x["state"] if state else None
        launch.kda_prefill(x["q"][0], x["k"][0], x["v"][0], x["g"][0], x["beta"][0], init, cu,
                           out, s, D**-0.5, l2norm=False, pieces=pieces)  # fmt: skip
        o1, s1 = _launch(x, cu, 1, state)
        o_ref, s_ref = reference(x, cu=cu, state=state)
        close(out[None], o_ref, 2e-2)
        close(s, s_ref, 2e-2)
        close(out[None], o1[None].double(), 2e-2)
        close(s, s1.double(), 2e-2)
        if decay[0] > -0.1:  # every warm-up falls back to the sequence's start: the same math
            assert torch.equal(out, o1) and torch.equal(s, s1)
    want = {"dtype": "bfloat16", "k": 128, "v": 128, "initial_state": state,
            "value_split": True, "warmup": True}  # fmt: skip
    assert want in cpu_kernel


def test_warm_up_chunks_from_the_decays():
    """One chunk where its largest decay is 2^-30, two where 2^-12 each (-24 + 3.5 <= -20),
    three over a chunk of 2^-1; the sequence's start where WARMUP_MAX chunks do not reach the
    bound or no more chunks lie before the piece."""
    first = torch.tensor([0, 10], dtype=torch.int32)
    decay = torch.full((20, 2, D), 2.0**-30)
    decay[10:] = 2.0**-12
    decay[15:, 1, 3] = 0.5  # the largest decay over heads and channels counts
    piece_first = torch.tensor([0, 1, 5, 10, 12, 16, 18], dtype=torch.int32)
    seq_first = torch.tensor([0, 0, 0, 10, 10, 10, 10], dtype=torch.int32)
    warm, start = launch._warmup_chunks(decay, seq_first, piece_first, 1)
    assert warm.tolist() == [0, 1, 1, 0, 2, 3, 8]  # 16: -1 - 12 - 12 + 3.5; 18: > 4 back
    assert start.tolist() == [True, True, False, True, True, False, True]  # 1, 12: back to 0
    assert not launch._warmup_chunks(decay, first, torch.tensor([5, 13]), 1)[1].any()
