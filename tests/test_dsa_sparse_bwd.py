"""Autograd of `forgekernel.dsa_sparse_attention` on the CPU (the GPU's checks:
tests/gpu/test_dsa_sparse_bwd_gpu.py): the forward kernel replaced by the fp32 reference (out
rounded to q's dtype, lse fp32, as the kernel writes them), the backward the op's own interim
torch path, against torch.autograd through the fp64 reference on the same 16-bit inputs: split
and combined (FlashMLA) caches, page sizes 1 and 16, -1 padding at the end and scattered, rows
with no entry, 16 / 24 heads, with and without a sink, a loss on the LSE; the explicit
`dsa_sparse_attention_backward`; argument errors; torch.compile(fullgraph=True) recording the
forward and backward custom ops; fake tensors; opcheck.

Tolerance: 2e-2 of the largest gradient entry (dq, dkv come back in bf16: ~4e-3; the forward's
out is rounded to bf16 before Delta, as a kernel's; the inputs' 16-bit rounding is shared with
the fp64 yardstick)."""

from __future__ import annotations

import importlib

import pytest
import torch
from compile_graphs import assert_compiled_grads_match_eager
from compile_graphs import leaves as _leaves
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.reference.dsa import dsa_sparse_attention_ref

fwd = importlib.import_module("forgekernel.ops.dsa")
bwd = importlib.import_module("forgekernel.ops.dsa_bwd")
LATENT, ROPE = 512, 64
SCALE = 0.1352
TOL = 2e-2


@pytest.fixture
def cpu_forward(monkeypatch):
    """The sparse forward's launcher as the fp32 reference (out in q's dtype, lse fp32; the
    sink applied as a direct plan's kernel does)."""
    calls = []

    def launch(q_nope, q_pe, ckv, kpe, idx, scale, o, lse, ckv_scale, attn_sink=None):
        calls.append(tuple(q_nope.shape))
        q = torch.cat((q_nope, q_pe), -1)
        kv = torch.cat((ckv, kpe), -1).flatten(0, 1)
        want, want_lse = dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=attn_sink)
        o.copy_(want)
        lse.copy_(want_lse)
        return True

    monkeypatch.setattr(fwd.mla_sm90, "dsa_sparse_attention", launch)
    monkeypatch.setattr(fwd, "check_cuda", lambda name, t: None)
    return calls


def _problem(tokens, hq, page_size, counts, topk, *, scattered=False, combined=False,
             sink=True, seed=0):  # fmt: skip
    """bf16 q_nope, q_pe, caches (split or combined), int32 indices (row t lists counts[t]
    distinct slots), fp32 sink or None."""
    g = torch.Generator().manual_seed(seed)
    pages = -(-max(max(counts), 1) // page_size) + 2
    slots = pages * page_size
    if combined:
        ckv = torch.randn(pages, page_size, 1, LATENT + ROPE, generator=g).bfloat16()
        kpe = None
    else:
        ckv = torch.randn(pages, page_size, LATENT, generator=g).bfloat16()
        kpe = torch.randn(pages, page_size, ROPE, generator=g).bfloat16()
    idx = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t, n in enumerate(counts):
        where = torch.randperm(topk, generator=g)[:n] if scattered else torch.arange(n)
        idx[t, where] = torch.randperm(slots, generator=g)[:n].int()
    qn = torch.randn(tokens, hq, LATENT, generator=g).bfloat16()
    qp = torch.randn(tokens, hq, ROPE, generator=g).bfloat16()
    attn_sink = torch.randn(hq, generator=g) if sink else None
    return [qn, qp, ckv, kpe, attn_sink], idx


def _flat_kv(ckv, kpe):
    return (ckv.squeeze(2) if kpe is None else torch.cat((ckv, kpe), -1)).flatten(0, 1)


def _fp64_grads(inputs, idx, dout, dlse):
    """Autograd through the fp64 reference: (dq_nope, dq_pe, dckv, dkpe or None, d_sink)."""
    qn, qp, ckv, kpe, sink = [None if x is None else x.double().requires_grad_() for x in inputs]
    q = torch.cat((qn, qp), -1)
    kv = _flat_kv(ckv, kpe)
    out, lse = dsa_sparse_attention_ref(q, kv, idx, SCALE, attn_sink=sink, dtype=torch.float64)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + torch.where(torch.isfinite(lse), lse * dlse.double(), 0.0).sum()
    leaves = [x for x in (qn, qp, ckv, kpe, sink) if x is not None]
    grads = iter(torch.autograd.grad(loss, leaves))
    return [None if x is None else next(grads) for x in (qn, qp, ckv, kpe, sink)]


def _assert_grads(got, want):
    for name, a, b in zip(("dq_nope", "dq_pe", "dckv", "dkpe", "d_sink"), got, want):
        assert (a is None) == (b is None), name
        if b is None:
            continue
        assert a.shape == b.shape and torch.isfinite(a).all(), name
        scale = float(b.abs().max())
        err = float((a.double() - b).abs().max())
        assert err <= TOL * scale + 1e-6, f"{name}: {err:.3g} against {scale:.3g}"


CASES = [
    # (tokens, hq, page_size, counts, topk, scattered, combined, sink, lse_loss)
    pytest.param(4, 16, 1, [40, 0, 17, 40], 40, False, False, True, False, id="h16-split-sink"),
    pytest.param(3, 16, 16, [64, 5, 0], 64, True, True, False, True, id="h16-combined-lse"),
    pytest.param(5, 24, 16, [1, 30, 0, 30, 12], 30, True, False, True, True, id="h24-scatter"),
]


@pytest.mark.parametrize("tokens,hq,page,counts,topk,scattered,combined,sink,lse_loss", CASES)
def test_autograd_matches_the_fp64_reference(cpu_forward, tokens, hq, page, counts, topk,
                                             scattered, combined, sink, lse_loss):  # fmt: skip
    inputs, idx = _problem(tokens, hq, page, counts, topk, scattered=scattered,
                           combined=combined, sink=sink, seed=tokens + topk)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    dout = torch.randn(tokens, hq, LATENT, generator=g).bfloat16()
    dlse = torch.randn(tokens, hq, generator=g) if lse_loss else None
    leaves = _leaves(inputs)
    out, lse = fwd.dsa_sparse_attention(*leaves[:4], idx, softmax_scale=SCALE,
                                        attn_sink=leaves[4], return_lse=True)  # fmt: skip
    assert out.dtype == torch.bfloat16 and cpu_forward
    loss = (out.float() * dout.float()).sum()
    if lse_loss:
        loss = loss + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    loss.backward()
    got = [None if x is None else x.grad for x in leaves]
    want = _fp64_grads(inputs, idx, dout, dlse)
    _assert_grads(got, want)
    empty = [t for t, n in enumerate(counts) if n == 0]
    assert torch.equal(leaves[0].grad[empty], torch.zeros_like(leaves[0].grad[empty]))


@pytest.mark.parametrize("sink", [True, False])
def test_rows_form_is_views_onto_the_op(cpu_forward, monkeypatch, sink):
    """Issue 22's dsa_sparse_attention(q (S, H, 576), kv (S_kv, 576), topk_indices, scale):
    the kernel reads q's and kv's own memory (no copy), out / lse and the gradients in q, kv
    and the sink match the fp64 reference written in that form."""
    g = torch.Generator().manual_seed(9)
    tokens, hq, slots, topk = 5, 16, 70, 24
    q = torch.randn(tokens, hq, LATENT + ROPE, generator=g).bfloat16().requires_grad_()
    kv = torch.randn(slots, LATENT + ROPE, generator=g).bfloat16().requires_grad_()
    idx = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t, n in enumerate([24, 0, 7, 1, 24]):
        idx[t, torch.randperm(topk, generator=g)[:n]] = torch.randperm(slots, generator=g)[:n].int()
    attn_sink = torch.randn(hq, generator=g).requires_grad_() if sink else None
    ptrs = []
    launch = fwd.mla_sm90.dsa_sparse_attention

    def spy(q_nope, q_pe, ckv, kpe, *args):
        ptrs.append((q_nope.data_ptr(), q_pe.data_ptr(), ckv.data_ptr(), kpe.data_ptr()))
        return launch(q_nope, q_pe, ckv, kpe, *args)

    monkeypatch.setattr(fwd.mla_sm90, "dsa_sparse_attention", spy)
    out, lse = forgekernel.dsa_sparse_attention_rows(q, kv, idx, SCALE, attn_sink=attn_sink,
                                                     return_lse=True)  # fmt: skip
    assert ptrs == [(q.data_ptr(), q.data_ptr() + 2 * LATENT, kv.data_ptr(),
                     kv.data_ptr() + 2 * LATENT)]  # fmt: skip
    leaves = [x.detach().double().requires_grad_() for x in (q, kv)]
    ref_sink = None if attn_sink is None else attn_sink.detach().double().requires_grad_()
    want, want_lse = dsa_sparse_attention_ref(*leaves, idx, SCALE, attn_sink=ref_sink,
                                              dtype=torch.float64)  # fmt: skip
    assert out.shape == (tokens, hq, LATENT) and out.dtype == torch.bfloat16
    err = (out.detach().double() - want.detach()).abs().max()
    assert float(err) <= TOL * float(want.detach().abs().max())
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and not finite[1].any()
    assert float((lse.detach().double() - want_lse.detach())[finite].abs().max()) < 1e-4
    dout = torch.randn(out.shape, generator=g).bfloat16()
    (out.float() * dout.float()).sum().backward()
    (want * dout.double()).sum().backward()
    got = [q.grad, None, kv.grad, None, None if attn_sink is None else attn_sink.grad]
    ref = [leaves[0].grad, None, leaves[1].grad, None, None if ref_sink is None else ref_sink.grad]
    _assert_grads(got, ref)
    assert forgekernel.dsa_sparse_attention_rows(q.detach(), kv.detach(), idx, SCALE).shape == (
        tokens, hq, LATENT)  # fmt: skip
    with pytest.raises(ValueError, match="q and kv must be"):
        forgekernel.dsa_sparse_attention_rows(q[..., :LATENT], kv, idx, SCALE)
    with pytest.raises(TypeError, match="kv must have dtype"):
        forgekernel.dsa_sparse_attention_rows(q, kv.half(), idx, SCALE)
    # the 2026-12-05 audit: these named sparse_indices / q_nope, arguments of the other form
    with pytest.raises(TypeError, match="topk_indices must have dtype"):
        forgekernel.dsa_sparse_attention_rows(q, kv, idx.long(), SCALE)
    with pytest.raises(ValueError, match=r"topk_indices must be \(S, topk\) with S = "):
        forgekernel.dsa_sparse_attention_rows(q, kv, idx[1:], SCALE)
    with pytest.raises(ValueError, match="topk_indices is on meta but q is on cpu"):
        forgekernel.dsa_sparse_attention_rows(q, kv, idx.to("meta"), SCALE)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        forgekernel.dsa_sparse_attention_rows(q, kv, idx, SCALE)


def test_sink_in_the_forward_is_flashmla_statement(cpu_forward):
    inputs, idx = _problem(3, 16, 1, [20, 0, 7], 20, sink=True, seed=3)
    out, lse = fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE,
                                        attn_sink=inputs[4], return_lse=True)  # fmt: skip
    q = torch.cat(inputs[:2], -1)
    want, want_lse = dsa_sparse_attention_ref(q, _flat_kv(*inputs[2:4]), idx, SCALE,
                                              attn_sink=inputs[4])  # fmt: skip
    # two bf16 roundings (the kernel's out, the interim sink scaling): within 2 ulps
    torch.testing.assert_close(out.float(), want, atol=1e-3, rtol=2 * 2**-8)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(want_lse))
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    none = torch.full((16,), float("-inf"))
    plain = fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE)
    assert torch.equal(fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE,
                                                attn_sink=none), plain)  # fmt: skip


def test_forward_only_calls_skip_the_custom_op(cpu_forward, monkeypatch):
    inputs, idx = _problem(2, 16, 1, [8, 3], 8, seed=4)

    def refuse(*args):
        raise AssertionError("the custom op was called")

    monkeypatch.setattr(torch.ops.forgekernel, "dsa_sparse_attention", refuse, raising=False)
    fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE, attn_sink=inputs[4])
    with pytest.raises(AssertionError, match="custom op"):
        fwd.dsa_sparse_attention(*_leaves(inputs)[:4], idx, softmax_scale=SCALE)


@pytest.mark.parametrize("combined", [False, True])
def test_explicit_backward_equals_autograd(cpu_forward, combined):
    inputs, idx = _problem(4, 16, 16, [33, 0, 9, 33], 33, scattered=True, combined=combined,
                           seed=5)  # fmt: skip
    g = torch.Generator().manual_seed(6)
    dout = torch.randn(4, 16, LATENT, generator=g).bfloat16()
    dlse = torch.randn(4, 16, generator=g)
    leaves = _leaves(inputs)
    out, lse = fwd.dsa_sparse_attention(*leaves[:4], idx, softmax_scale=SCALE,
                                        attn_sink=leaves[4], return_lse=True)  # fmt: skip
    torch.autograd.backward((out, lse), (dout, dlse))
    grads = bwd.dsa_sparse_attention_backward(
        *inputs[:4], idx, dout, softmax_scale=SCALE, out=out.detach(), lse=lse.detach(),
        attn_sink=inputs[4], dlse=dlse,
    )  # fmt: skip
    for got, leaf in zip(grads, leaves):
        assert (got is None) == (leaf is None)
        if leaf is not None:
            assert got.shape == leaf.shape and got.dtype == leaf.dtype
            torch.testing.assert_close(got, leaf.grad, rtol=0, atol=0)


BAD = [
    ("dout", lambda a: a.update(dout=a["dout"][:, :, :256]), ValueError, "dout"),
    ("dout dtype", lambda a: a.update(dout=a["dout"].half()), TypeError, "dout"),
    ("lse dtype", lambda a: a.update(lse=a["lse"].bfloat16()), TypeError, "lse"),
    ("out", lambda a: a.update(out=a["out"][:1]), ValueError, "out"),
    ("dlse", lambda a: a.update(dlse=a["lse"][:, :3]), ValueError, "dlse"),
    ("sink shape", lambda a: a.update(attn_sink=torch.zeros(8)), ValueError, "attn_sink"),
    ("sink dtype", lambda a: a.update(attn_sink=torch.zeros(16).bfloat16()), TypeError, "sink"),
    ("scale", lambda a: a.update(softmax_scale=None), TypeError, "softmax_scale"),
    ("indices", lambda a: a.update(idx=a["idx"].long()), TypeError, "sparse_indices"),
]


@pytest.mark.parametrize("name,change,err,match", BAD, ids=[b[0] for b in BAD])
def test_explicit_backward_refuses_bad_arguments(cpu_forward, name, change, err, match):
    inputs, idx = _problem(2, 16, 1, [8, 3], 8, seed=7)
    out, lse = fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE, return_lse=True)
    args = {"dout": torch.randn_like(out.float()).bfloat16(), "out": out, "lse": lse,
            "dlse": None, "attn_sink": inputs[4], "softmax_scale": SCALE, "idx": idx}  # fmt: skip
    change(args)
    idx = args.pop("idx")
    dout = args.pop("dout")
    with pytest.raises(err, match=match):
        bwd.dsa_sparse_attention_backward(*inputs[:4], idx, dout, **args)


def test_forward_refuses_a_bad_sink_and_fp8_training(cpu_forward):
    inputs, idx = _problem(2, 16, 1, [8, 3], 8, seed=8)
    with pytest.raises(ValueError, match="attn_sink"):
        fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE, attn_sink=torch.zeros(3))
    fp8 = torch.zeros(4, 1, 1, 656, dtype=torch.uint8)
    q = inputs[0].requires_grad_()
    with pytest.raises(NotImplementedError, match="FP8"):
        fwd.dsa_sparse_attention(q, inputs[1], fp8, None, idx.clamp(max=3), softmax_scale=SCALE)


def test_index_past_the_cache_raises_in_the_interim(cpu_forward):
    inputs, idx = _problem(2, 16, 1, [8, 3], 8, sink=False, seed=9)
    out, lse = fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE, return_lse=True)
    idx[0, 0] = inputs[2].shape[0] * inputs[2].shape[1]
    with pytest.raises(ValueError, match="topk_indices"):
        bwd.dsa_sparse_attention_backward(*inputs[:4], idx, out, softmax_scale=SCALE, out=out,
                                          lse=lse)  # fmt: skip


def test_compile_fullgraph_records_forward_and_backward_ops(cpu_forward):
    inputs, idx = _problem(3, 16, 16, [20, 4, 0], 20, combined=True, seed=10)

    def loss(qn, qp, cache, sink):
        out, lse = fwd.dsa_sparse_attention(qn, qp, cache, None, idx, softmax_scale=SCALE,
                                            attn_sink=sink, return_lse=True)  # fmt: skip
        return out.float().square().sum() + torch.where(torch.isfinite(lse), lse, 0.0).sum()

    args = [inputs[0], inputs[1], inputs[2], inputs[4]]
    assert_compiled_grads_match_eager(
        loss,
        args,
        "forgekernel.dsa_sparse_attention.default",
        "forgekernel.dsa_sparse_attention_bwd.default",
    )


def test_fake_tensors_take_the_backward_op():
    def f(qn, qp, cache, idx, dout, out, lse, sink):
        return bwd.dsa_sparse_attention_backward(qn, qp, cache, None, idx, dout,
                                                 softmax_scale=SCALE, out=out, lse=lse,
                                                 attn_sink=sink)  # fmt: skip

    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = {"device": "cuda", "dtype": torch.bfloat16}
        qn, qp = torch.empty(5, 16, LATENT, **cuda), torch.empty(5, 16, ROPE, **cuda)
        cache = torch.empty(10, 64, 1, LATENT + ROPE, **cuda)
        idx = torch.empty(5, 2048, device="cuda", dtype=torch.int32)
        dout, out = torch.empty(5, 16, LATENT, **cuda), torch.empty(5, 16, LATENT, **cuda)
        lse, sink = torch.empty(5, 16, device="cuda"), torch.empty(16, device="cuda")
        args = (qn, qp, cache, idx, dout, out, lse, sink)
        graph = make_fx(f, tracing_mode="fake")(*args)
        grads = f(*args)
    assert "forgekernel.dsa_sparse_attention_bwd.default" in str(graph.graph)
    assert grads[3] is None and grads[4].shape == (16,) and grads[4].dtype == torch.float32
    for grad, like in zip(grads[:3], (qn, qp, cache)):
        assert grad.shape == like.shape and grad.dtype == like.dtype
        assert grad.device.type == "cuda"


def test_opcheck_of_the_backward_op(cpu_forward):
    inputs, idx = _problem(3, 16, 16, [20, 4, 0], 20, seed=11)
    out, lse = fwd.dsa_sparse_attention(*inputs[:4], idx, softmax_scale=SCALE,
                                        attn_sink=inputs[4], return_lse=True)  # fmt: skip
    g = torch.Generator().manual_seed(12)
    dout = torch.randn(out.shape, generator=g).bfloat16()
    args = (*inputs[:4], idx, SCALE, out, lse, dout, torch.randn(lse.shape, generator=g),
            inputs[4])  # fmt: skip
    torch.library.opcheck(torch.ops.forgekernel.dsa_sparse_attention_bwd.default, args)


def test_opcheck_of_the_differentiable_forward_op(cpu_forward):
    inputs, idx = _problem(3, 16, 16, [20, 4, 0], 20, seed=13)
    leaves = _leaves(inputs)
    args = (*leaves[:4], idx, SCALE, None, leaves[4])
    torch.library.opcheck(torch.ops.forgekernel.dsa_sparse_attention.default, args)


@pytest.mark.parametrize("combined", [False, True])
def test_interim_reads_nothing_on_the_host_under_capture(monkeypatch, combined):
    """Under CUDA-graph capture (simulated) the interim backward on meta tensors
    (tests/capture_safety.py): no host read (the eager check of the largest index skipped), no
    data-sized op, no host table; eagerly the check still raises (the test above)."""
    from capture_safety import assert_capturable, meta

    from forgekernel.ops.mla import latent_cache_views

    inputs, idx = _problem(4, 16, 16, [33, 0, 9, 33], 33, scattered=True, combined=combined,
                           seed=11)  # fmt: skip
    ckv, kpe, _ = latent_cache_views(inputs[2], inputs[3])
    g = torch.Generator().manual_seed(12)
    out = torch.randn(4, 16, LATENT, generator=g).bfloat16()
    lse, dlse = torch.randn(4, 16, generator=g), torch.randn(4, 16, generator=g)
    monkeypatch.setattr(bwd, "_capturing", lambda t: True)
    args = meta(inputs[0], inputs[1], ckv, kpe, idx)
    assert_capturable(bwd._backward_interim, *args, SCALE,
                      *meta(out, lse, out, dlse, inputs[4]))  # fmt: skip


def test_the_suites_call_reads_nothing_on_the_host_under_capture(monkeypatch):
    """The suite's run_ours (the explicit backward, validation included) on meta tensors
    under a simulated capture, every check case: nothing read back."""
    from capture_safety import assert_capturable

    from forgekernel.bench.suites import dsa_sparse_bwd as suite

    monkeypatch.setattr(bwd, "_capturing", lambda t: True)
    monkeypatch.setattr(bwd, "_traced", lambda *t: False)  # the eager path, as on the GPU
    monkeypatch.setattr(fwd, "check_cuda", lambda name, t: None)
    for case in suite.CHECK_CASES:
        i = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                              torch.Generator().manual_seed(8))  # fmt: skip
        i = {k: x.to("meta") if isinstance(x, torch.Tensor) else x for k, x in i.items()}
        assert_capturable(suite.run_ours, i, None)
