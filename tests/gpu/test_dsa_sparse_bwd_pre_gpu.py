"""The DSA sparse backward preprocess kernel (kernels/attention/dsa_sparse_bwd_pre/sm90) on the
GPU against an fp64 torch reference of kernels/attention/dsa_sparse_bwd/sm90/launch.py
`preprocess` (the torch form it replaces): awkward token counts (1, 7, 130), H 16 / 64 / 128,
with and without a sink (a -inf and a +inf entry among finite ones) and a loss on the LSE (dLSE),
rows whose LSE is -inf (nothing listed) and +inf, bf16 and fp16, out / dO / lse / dlse
non-contiguous on some cases; lse2, Delta' and the d_sink terms NaN-poisoned before the launch
(every row written). Tolerance: the torch fp32 form's own error against fp64, doubled, plus
1e-6 of the row's magnitude (sum |dO O|); lse2 to 2 ulp-ish (1e-6 relative), +inf exactly.
Then the op around the kernels: q / the cache cut from one buffer (views, no copy) and as
separate tensors give the same gradients, and a CUDA-graph replay of the op equals its eager
call."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch as bwd_launch
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import launch

pytestmark = pytest.mark.gpu
LATENT, WIDTH = 512, 576
LOG2E = math.log2(math.e)


def _reference(out, dout, lse, dlse, sink):
    """launch.py `preprocess`'s math in fp64: (lse2, Delta', per-(token, head) d_sink terms,
    the row magnitudes sum |dO O| + |the dLSE term|)."""
    o, do = out.double(), dout.double()
    delta = (o * do).sum(-1)
    mag = (o * do).abs().sum(-1)
    lse = lse.double()
    lse_all = lse if sink is None else torch.logaddexp(lse, sink.double()[None, :])
    lse_all = lse_all.masked_fill(torch.isneginf(lse_all), math.inf)
    terms = None
    if sink is not None:
        s = sink.double()[None, :]
        p_sink = torch.where(torch.isposinf(s), 1.0, torch.exp(s - lse_all))
        terms = -p_sink * delta
    delta_k = delta
    if dlse is not None:
        finite = torch.isfinite(lse_all) & torch.isfinite(lse)
        ratio = torch.exp(torch.where(finite, lse_all - lse, 0.0))
        term = torch.where(finite, dlse.double() * ratio, 0.0)
        delta_k, mag = delta - term, mag + term.abs()
    return lse_all * LOG2E, delta_k, terms, mag


def _inputs(tokens, heads, dtype, *, sink, dlse, strided, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = {"device": "cuda", "generator": g}
    width = 2 * LATENT if strided else LATENT  # rows of a wider buffer: row stride 1024
    out = torch.randn(tokens, heads, width, **rnd).to(dtype)[..., :LATENT]
    dout = (3 * torch.randn(tokens, heads, width, **rnd)).to(dtype)[..., :LATENT]
    lse = 4 * torch.randn(tokens, heads, **rnd) + 8
    if strided:  # (H, tokens) storage: strides (1, tokens)
        lse = lse.t().contiguous().t()
    lse[tokens // 2, : heads // 2] = -math.inf  # rows that listed nothing
    if tokens > 2:
        lse[2, 1] = math.inf
    s = None
    if sink:
        s = torch.randn(heads, **rnd) * 4 + 6
        s[0], s[3] = -math.inf, math.inf
    d = torch.randn(tokens, heads, **rnd) if dlse else None
    if d is not None and strided:
        d = d.t().contiguous().t()
    return out, dout, lse, d, s


CASES = [  # tokens, heads, dtype, strided
    (1, 16, torch.bfloat16, False),
    (7, 16, torch.float16, True),
    (130, 16, torch.bfloat16, False),
    (1, 64, torch.float16, False),
    (7, 64, torch.bfloat16, True),
    (130, 64, torch.bfloat16, False),
    (1, 128, torch.bfloat16, True),
    (7, 128, torch.float16, False),
    (130, 128, torch.bfloat16, True),
]


@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("dlse", [False, True], ids=["nodlse", "dlse"])
@pytest.mark.parametrize("tokens,heads,dtype,strided", CASES)
def test_pre_matches_fp64(tokens, heads, dtype, strided, sink, dlse):
    out, dout, lse, d, s = _inputs(tokens, heads, dtype, sink=sink, dlse=dlse, strided=strided,
                                   seed=tokens * 1000 + heads)  # fmt: skip
    assert launch.unsupported(out, dout) is None
    bufs = [torch.full((tokens, heads), math.nan, device="cuda") for _ in range(3)]
    lse2, delta, d_sink = launch.preprocess(out, dout, lse, d, s, outs=bufs)
    assert lse2 is bufs[0] and delta is bufs[1]
    want_lse2, want_delta, want_terms, mag = _reference(out, dout, lse, d, s)
    torch_lse2, torch_delta, torch_sink = bwd_launch.preprocess(out, dout, lse, d, s)
    # lse2: +inf exactly where the reference has it, finite rows to 1e-6 relative
    inf = torch.isposinf(want_lse2)
    assert torch.equal(torch.isposinf(lse2), inf) and torch.isfinite(lse2[~inf]).all()
    torch.testing.assert_close(lse2[~inf].double(), want_lse2[~inf], rtol=1e-6, atol=1e-6)
    # Delta': every row written (no NaN left), within twice torch fp32's own error
    assert torch.isfinite(delta).all()
    err = (delta.double() - want_delta).abs()
    torch_err = (torch_delta.double() - want_delta).abs()
    assert (err <= 2 * torch_err + 1e-6 * mag + 1e-6).all(), float((err - 2 * torch_err).max())
    if not sink:
        assert torch.equal(d_sink, torch.zeros(heads, device="cuda"))
        return
    terms = bufs[2]
    assert torch.isfinite(terms).all()
    torch.testing.assert_close(terms.double(), want_terms, rtol=1e-5,
                               atol=1e-6 * float(mag.max()))  # fmt: skip
    want_sink = want_terms.sum(0)
    top = float(want_terms.abs().sum(0).max()) + 1e-6
    assert (
        float((d_sink.double() - want_sink).abs().max())
        <= 2 * float((torch_sink.double() - want_sink).abs().max()) + 1e-6 * top
    )


def test_empty_rows():
    out = torch.empty(0, 16, LATENT, device="cuda", dtype=torch.bfloat16)
    lse2, delta, d_sink = launch.preprocess(out, out, torch.empty(0, 16, device="cuda"), None,
                                            torch.zeros(16, device="cuda"))  # fmt: skip
    assert lse2.shape == delta.shape == (0, 16) and torch.equal(d_sink, torch.zeros_like(d_sink))


def _op_problem(tokens, heads, slots, topk, seed):
    from forgekernel.reference.dsa import dsa_sparse_attention_ref

    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = {"device": "cuda", "generator": g}
    q = torch.randn(tokens, heads, WIDTH, **rnd).bfloat16()
    kv = torch.randn(slots, WIDTH, **rnd).bfloat16()
    idx = torch.randint(0, slots, (tokens, topk), **rnd).int()
    idx[1, topk // 2 :] = -1
    sink = torch.randn(heads, **rnd)
    out, lse = dsa_sparse_attention_ref(q, kv, idx, WIDTH**-0.5, attn_sink=sink)
    dout = torch.randn(tokens, heads, LATENT, **rnd).bfloat16()
    return q, kv, idx, sink, out.bfloat16(), lse.float(), dout


def test_op_views_equal_copies_and_graph_replay():
    """The op on q / a combined cache cut from one buffer (the rows read in place) and on
    separate tensors (concatenated) gives one answer; a CUDA-graph replay of it the same."""
    from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward

    q, kv, idx, sink, out, lse, dout = _op_problem(130, 16, 700, 128, seed=5)
    kw = {"softmax_scale": WIDTH**-0.5, "out": out, "lse": lse, "attn_sink": sink}

    def run(qn, qp, c, k):
        return dsa_sparse_attention_backward(qn, qp, c, k, idx, dout, **kw)

    views = run(q[..., :LATENT], q[..., LATENT:], kv.view(-1, 1, 1, WIDTH), None)
    apart = run(q[..., :LATENT].contiguous(), q[..., LATENT:].contiguous(),
                kv[:, :LATENT].contiguous().view(-1, 1, LATENT),
                kv[:, LATENT:].contiguous().view(-1, 1, WIDTH - LATENT))  # fmt: skip
    dkv_apart = torch.cat((apart[2], apart[3]), -1).view(-1, 1, 1, WIDTH)
    for a, b in zip((*views[:3], views[4]), (*apart[:2], dkv_apart, apart[4])):
        assert a.shape == b.shape
        top = float(b.abs().max()) + 1e-6
        assert float((a.double() - b.double()).abs().max()) <= 1e-2 * top  # atomics' order
    qn, qp, cache = q[..., :LATENT], q[..., LATENT:], kv.view(-1, 1, 1, WIDTH)
    run(qn, qp, cache, None)  # warm: compile-cache loads outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = run(qn, qp, cache, None)
    graph.replay()
    torch.cuda.synchronize()
    for a, b in zip(captured, views):
        if b is None:
            assert a is None
            continue
        top = float(b.abs().max()) + 1e-6
        assert float((a.double() - b.double()).abs().max()) <= 1e-2 * top
