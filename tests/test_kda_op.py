"""`forgekernel.ops.kda_chunked.kimi_delta_attention` on the CPU: argument validation (clear
messages); the real launcher with its torch first pass and a torch replay of the recurrence
kernel (tests/kda_prefill_replay.py: the kernel's reads, roundings and stores) against the fp64
recurrence (batches, varlen with empty / single-token / odd sequences, initial states, GQA,
l2norm, strong per-channel decays, fp16); a call autograd records goes through the custom op
and back (the backward itself: tests/test_kda_bwd_op.py)."""

from __future__ import annotations

import kda_prefill_replay as replay
import pytest
import torch
import torch.nn.functional as F

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


def test_not_exported_until_checked_on_a_gpu():
    """docs/PENDING.md: a pending op stays out of the public API until its GPU check."""
    assert not hasattr(forgekernel, "kimi_delta_attention")
    assert op.chunk_kda is op.kimi_delta_attention


@pytest.mark.parametrize("l2norm", [False, True])
def test_batch_with_strong_decay(cpu_kernel, monkeypatch, l2norm):
    monkeypatch.setattr(operands, "CHUNKS_PER_GROUP", 2)  # the first pass in three groups
    x = make(b=2, t=150, h=1, hv=2, seed=1, decay=(-5.0, 0.0))
    o, s = run_op(x, l2norm=l2norm)
    o_ref, s_ref = reference(x, l2norm=l2norm)
    assert o.dtype == torch.bfloat16 and s.dtype == torch.float32
    close(o, o_ref, 2e-2)
    close(s, s_ref, 2e-2)
    # 2 sequences x 2 heads leave SMs idle: each (sequence, head) split over two CTAs
    want = {"dtype": "bfloat16", "k": 128, "v": 128, "initial_state": True, "value_split": True}
    assert cpu_kernel == [want]


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
    assert cpu_kernel[0]["dtype"] == "float16"


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
def test_first_pass_on_its_kernel(cpu_kernel, l2norm):
    """The launcher's tables for the first-pass kernel (chunk starts and lengths, the chunk
    layout) with a replay of its math: the same result as the torch first pass, both close to
    the fp64 recurrence."""
    lens = [5, 0, 64, 71, 1, 130]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x = make(t=sum(lens), h=2, hv=4, n=len(lens), seed=12, decay=(-5.0, 0.0))
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 0.1, x["state"], cu, l2norm)
    o_k, s_k = op._forward(*args, first_pass="kernel")
    o_t, s_t = op._forward(*args, first_pass="torch")
    o_ref, s_ref = kimi_delta_attention_recurrent(
        x["q"], x["k"], x["v"], x["g"], x["beta"], scale=0.1, initial_state=x["state"],
        output_final_state=True, cu_seqlens=cu, use_qk_l2norm=l2norm,
    )  # fmt: skip
    close(o_k, o_ref, 2e-2)
    close(s_k, s_ref, 2e-2)
    close(o_k, o_t.double(), 2e-2)
    assert {"dtype": "bfloat16", "k": 128} in cpu_kernel  # the first-pass kernel was asked for


def test_unknown_first_pass():
    x = {key: val[0] for key, val in make(t=8).items()}
    cu = torch.tensor([0, 8], dtype=torch.int32)
    final = torch.empty(1, 2, 128, 128)
    with pytest.raises(ValueError, match="first_pass must be one of"):
        launch.kda_prefill(
            x["q"],
            x["k"],
            x["v"],
            x["g"],
            x["beta"],
            None,
            cu,
            torch.empty_like(x["v"]),
            final,
            0.1,
            l2norm=False,
            first_pass="cuda",
        )


def _loop_layout(edges):
    """The per-sequence chunk layout as the launcher built it before (the yardstick)."""
    first, rows, start = [], [], 0
    for a, z in zip(edges[:-1], edges[1:]):
        nc = -(-(z - a) // 64)
        first.append(start)
        start += nc
        t = torch.arange(nc * 64)
        rows.append(torch.where(t < z - a, t + a, torch.full_like(t, -1)))
    return torch.tensor(first, dtype=torch.int32), torch.cat(rows)


@pytest.mark.parametrize(
    "lens", [[5, 0, 64, 71, 1, 130], [2048], [64, 0, 128], [0, 0, 3], [63, 65, 64 * 7 + 1]]
)
def test_chunk_tables_match_the_per_sequence_loop(lens):
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    first, token = operands.chunk_layout(edges, "cpu")
    want_first, want_token = _loop_layout(edges)
    assert torch.equal(first, want_first)
    if token is None:  # every length a multiple of 64: the identity
        assert torch.equal(want_token, torch.arange(edges[-1]))
    else:
        assert torch.equal(token, want_token)
    starts, lengths = operands.chunk_table(edges, "cpu")
    chunks = want_token.view(-1, 64)
    assert torch.equal(starts, chunks[:, 0].to(torch.int32))
    assert torch.equal(lengths, (chunks >= 0).sum(1).to(torch.int32))


@pytest.mark.parametrize("hv", [2, 4])
def test_first_pass_without_a_gather_is_the_gathered_one(monkeypatch, hv):
    """Lengths that are multiples of 64 skip the row gather (and H = HV the head gather): the
    operands are bitwise those of the gathered path."""
    x = {key: val[0] for key, val in make(t=192, h=2, hv=hv, seed=5, decay=(-5.0, 0.0)).items()}
    edges = [0, 64, 192]
    args = (x["q"], x["k"], x["g"], x["beta"], edges, 0.1, False)
    fast = operands.kda_chunk_operands(*args)
    first, token = _loop_layout(edges)
    monkeypatch.setattr(operands, "chunk_layout", lambda e, d: (first, token))
    slow = operands.kda_chunk_operands(*args)
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay", "first"):
        assert torch.equal(fast[name], slow[name]), name


def test_capture_is_refused_before_any_work(cpu_kernel, monkeypatch):
    """Inside a CUDA-graph capture the op raises before its host read of the offsets (which
    the driver would reject, invalidating the capture: launch.refuse_capture)."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    x = make(t=70)
    with pytest.raises(RuntimeError, match="cannot be captured"):
        run_op(x)
    assert cpu_kernel == []  # no kernel asked for
