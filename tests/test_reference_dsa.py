"""The DeepSeek Sparse Attention references (forgekernel/reference/dsa.py) against naive fp64
loops that gather key by key: sparse attention forward, its gradients (autograd of the chunked
form, the written-out backward, finite differences), the sink, the score recompute, the
indexer's scores / top-k / loss gradients, the paged forms, RoPE, the FP8 cast and the fused
prefill; and, where the FlashInfer-Bench definitions are present, ours through
reference/dsa_flashinfer.py against each definition's own reference."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference import dsa
from forgekernel.reference import dsa_flashinfer as fi
from forgekernel.reference.flashinfer_paged import csr_to_page_table, page_table_to_csr

F64 = torch.float64
NEG_INF = float("-inf")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_indices(s, s_kv, topk, gen, counts=None):
    """(S, topk) int32: row t lists counts[t] distinct keys (default topk) at random positions,
    -1 elsewhere."""
    idx = torch.full((s, topk), -1, dtype=torch.int32)
    for t in range(s):
        n = topk if counts is None else counts[t]
        where = torch.randperm(topk, generator=gen)[:n]
        idx[t, where] = torch.randperm(s_kv, generator=gen)[:n].int()
    return idx


def make_case(s, h, s_kv, topk, seed, counts=None, d=576, sink=True):
    gen = _gen(seed)
    q = torch.randn(s, h, d, generator=gen, dtype=F64)
    kv = torch.randn(s_kv, d, generator=gen, dtype=F64)
    idx = make_indices(s, s_kv, topk, gen, counts)
    attn_sink = torch.randn(h, generator=gen, dtype=F64) * 2 if sink else None
    return q, kv, idx, attn_sink


def naive_sparse(q, kv, idx, scale, sink=None, d_v=512, topk_length=None):
    """fp64 loop, one (token, head) at a time: dense softmax over the gathered keys, the sink in
    the denominator. Differentiable. Returns out (S, H, d_v), lse (S, H)."""
    outs, lses = [], []
    for t in range(q.shape[0]):
        n = idx.shape[1] if topk_length is None else int(topk_length[t])
        keys = [int(j) for j in idx[t, :n] if j >= 0]
        row_out, row_lse = [], []
        for h in range(q.shape[1]):
            if not keys:
                row_out.append(q.new_zeros(d_v))
                row_lse.append(q.new_tensor(NEG_INF))
                continue
            k = torch.stack([kv[j] for j in keys])
            s = (k @ q[t, h]) * scale
            lse = torch.logsumexp(s, 0)
            full = lse if sink is None else torch.logaddexp(lse, sink[h])
            row_out.append(torch.exp(s - full) @ k[:, :d_v])
            row_lse.append(lse)
        outs.append(torch.stack(row_out))
        lses.append(torch.stack(row_lse))
    return torch.stack(outs), torch.stack(lses)


def assert_lse_equal(ours, ref, atol):
    assert torch.equal(torch.isneginf(ours), torch.isneginf(ref))
    fin = torch.isfinite(ref)
    torch.testing.assert_close(ours[fin].double(), ref[fin].double(), atol=atol, rtol=0)


# ---------------------------------------------------------------- sparse attention forward

CASES = [
    # (S, H, S_kv, topk, counts): counts None = every entry valid
    pytest.param(7, 16, 37, 16, [16, 5, 0, 16, 1, 9, 16], id="h16-pad"),
    pytest.param(5, 20, 101, 64, None, id="h20-full"),
    pytest.param(6, 20, 53, 33, [33, 0, 2, 33, 17, 30], id="h20-pad"),
]


@pytest.mark.parametrize("s,h,s_kv,topk,counts", CASES)
@pytest.mark.parametrize("sink", [True, False])
def test_sparse_attention_equals_dense_over_gathered_keys(s, h, s_kv, topk, counts, sink):
    q, kv, idx, attn_sink = make_case(s, h, s_kv, topk, seed=s + topk, counts=counts, sink=sink)
    scale = 576**-0.5
    ref_out, ref_lse = naive_sparse(q, kv, idx, scale, attn_sink)
    out, lse = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=attn_sink, dtype=F64)
    torch.testing.assert_close(out, ref_out, atol=1e-12, rtol=0)
    assert_lse_equal(lse, ref_lse, 1e-12)
    # The fp32 spec from bf16 inputs: within fp32 rounding of the fp64 answer on those inputs.
    qb, kvb = q.bfloat16(), kv.bfloat16()
    ref_out, ref_lse = naive_sparse(qb.double(), kvb.double(), idx, scale, attn_sink)
    out32, lse32 = dsa.dsa_sparse_attention_ref(qb, kvb, idx, scale, attn_sink=attn_sink)
    assert out32.dtype == torch.float32 and lse32.shape == (s, h)
    torch.testing.assert_close(out32.double(), ref_out, atol=2e-6, rtol=0)
    assert_lse_equal(lse32, ref_lse, 2e-5)


def test_chunking_and_topk_length(monkeypatch):
    q, kv, idx, sink = make_case(6, 16, 45, 24, seed=3)
    lengths = torch.tensor([24, 0, 7, 13, 24, 1], dtype=torch.int32)
    scale = 0.07
    whole = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=sink, topk_length=lengths)
    monkeypatch.setattr(dsa, "CHUNK_BUDGET", 1)  # one row per chunk
    chunked = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=sink, topk_length=lengths)
    ref_out, ref_lse = naive_sparse(q, kv, idx, scale, sink, topk_length=lengths)
    for ours in (whole, chunked):
        torch.testing.assert_close(ours[0].double(), ref_out, atol=1e-5, rtol=0)
        assert_lse_equal(ours[1], ref_lse, 2e-5)
    assert torch.equal(whole[0], chunked[0])


def test_low_precision_yardstick_is_worse_than_fp32():
    q, kv, idx, sink = make_case(4, 16, 60, 48, seed=9)
    qb, kvb = q.bfloat16(), kv.bfloat16()
    exact, _ = dsa.dsa_sparse_attention_ref(qb, kvb, idx, 0.05, attn_sink=sink, dtype=F64)
    err = {
        dt: (dsa.dsa_sparse_attention_ref(qb, kvb, idx, 0.05, attn_sink=sink, dtype=dt)[0] - exact)
        .abs()
        .max()
        for dt in (torch.float32, torch.bfloat16)
    }
    assert err[torch.float32] < 1e-5 < err[torch.bfloat16] < 0.05


# ---------------------------------------------------------------- sink


def test_sink_conventions():
    q, kv, idx, sink = make_case(5, 16, 40, 20, seed=11, counts=[20, 0, 3, 20, 20])
    scale = 0.06
    plain, lse = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, dtype=F64)
    # -inf: no sink, bit for bit; the LSE never includes the sink.
    none, lse_none = dsa.dsa_sparse_attention_ref(
        q, kv, idx, scale, attn_sink=torch.full((16,), NEG_INF, dtype=F64), dtype=F64
    )
    assert torch.equal(none, plain) and torch.equal(lse_none, lse)
    # FlashMLA's statement: out * exp(lse) / (exp(lse) + exp(sink)), lse unchanged.
    with_sink, lse_sink = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=sink, dtype=F64)
    factor = torch.sigmoid(lse - sink[None, :]).nan_to_num(0.0)  # exp(l) / (exp(l) + exp(s))
    torch.testing.assert_close(with_sink, plain * factor[..., None], atol=1e-13, rtol=0)
    assert torch.equal(lse_sink, lse)
    # +inf: output 0. An empty row: output 0, LSE -inf, with or without a sink.
    inf_sink, _ = dsa.dsa_sparse_attention_ref(
        q, kv, idx, scale, attn_sink=torch.full((16,), math.inf, dtype=F64), dtype=F64
    )
    assert torch.equal(inf_sink, torch.zeros_like(inf_sink))
    assert torch.isneginf(lse_sink[1]).all() and torch.equal(
        with_sink[1], torch.zeros_like(plain[1])
    )


# ---------------------------------------------------------------- sparse attention backward


@pytest.mark.parametrize("s,h,s_kv,topk,counts", CASES[:1] + CASES[2:])
def test_gradients_autograd_bwd_and_naive_agree(s, h, s_kv, topk, counts, monkeypatch):
    q, kv, idx, sink = make_case(s, h, s_kv, topk, seed=20 + s, counts=counts)
    scale = 576**-0.5
    dout = torch.randn(s, h, 512, generator=_gen(5), dtype=F64)

    def grads(fn):
        leaves = [x.clone().requires_grad_(True) for x in (q, kv, sink)]
        out = fn(*leaves)
        return torch.autograd.grad((out * dout).sum(), leaves)

    monkeypatch.setattr(dsa, "CHUNK_BUDGET", 3 * topk * (576 + 3 * h))  # three rows a chunk
    chunked = grads(
        lambda a, b, c: dsa.dsa_sparse_attention_ref(
            a, b, idx, scale, attn_sink=c, return_lse=False, dtype=F64
        )
    )
    naive = grads(lambda a, b, c: naive_sparse(a, b, idx, scale, c)[0])
    written = dsa.dsa_sparse_attention_bwd_ref(q, kv, idx, scale, dout, attn_sink=sink, dtype=F64)
    for name, a, b, c in zip(("dq", "dkv", "d_sink"), chunked, naive, written):
        assert torch.isfinite(a).all(), name
        torch.testing.assert_close(a, b, atol=1e-11, rtol=0, msg=name)
        torch.testing.assert_close(c, b, atol=1e-11, rtol=0, msg=name)
    # No sink: d_sink is None and dq, dkv match the no-sink autograd.
    dq, dkv, d_sink = dsa.dsa_sparse_attention_bwd_ref(q, kv, idx, scale, dout, dtype=F64)
    leaves = [x.clone().requires_grad_(True) for x in (q, kv)]
    out = dsa.dsa_sparse_attention_ref(*leaves, idx, scale, return_lse=False, dtype=F64)
    ref = torch.autograd.grad((out * dout).sum(), leaves)
    assert d_sink is None
    torch.testing.assert_close(dq, ref[0], atol=1e-11, rtol=0)
    torch.testing.assert_close(dkv, ref[1], atol=1e-11, rtol=0)


def test_gradients_match_finite_differences():
    gen = _gen(31)
    q = torch.randn(3, 2, 12, generator=gen, dtype=F64, requires_grad=True)
    kv = torch.randn(9, 12, generator=gen, dtype=F64, requires_grad=True)
    sink = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)
    idx = make_indices(3, 9, 5, gen, counts=[5, 2, 0])

    def fn(a, b, c):
        return dsa.dsa_sparse_attention_ref(a, b, idx, 0.4, attn_sink=c, d_v=8, dtype=F64)[0]

    assert torch.autograd.gradcheck(fn, (q, kv, sink), eps=1e-6, atol=1e-7)


@pytest.mark.parametrize("sink_kind", ["random", "none", "-inf", "+inf"])
def test_backward_from_saved_out_and_lse_with_lse_gradient(sink_kind, monkeypatch):
    """The kernel's contract: P from the forward's KV-only LSE (and the sink), Delta from its
    output, dLSE folded in; against autograd of sum(out dout) + sum(lse dlse) in fp64 (1e-10).
    Rows of -1 only (out 0, LSE -inf) get zero dq; a duplicate entry (outside the indexers'
    contract) is one more term, as in the forward's gather."""
    s, h, s_kv, topk = 6, 16, 29, 12
    q, kv, idx, sink = make_case(s, h, s_kv, topk, seed=41, counts=[12, 0, 5, 12, 1, 0])
    idx[3, 1] = idx[3, 0]  # a duplicate
    sink = {"random": sink, "none": None, "-inf": torch.full((h,), NEG_INF, dtype=F64),
            "+inf": torch.full((h,), math.inf, dtype=F64)}[sink_kind]  # fmt: skip
    gen = _gen(7)
    dout = torch.randn(s, h, 512, generator=gen, dtype=F64)
    dlse = torch.randn(s, h, generator=gen, dtype=F64)
    leaves = [x.clone().requires_grad_(True) for x in (q, kv)]
    if sink is not None:
        leaves.append(sink.clone().requires_grad_(True))
    out, lse = dsa.dsa_sparse_attention_ref(
        *leaves[:2], idx, 0.05, attn_sink=None if sink is None else leaves[2], dtype=F64
    )
    loss = (out * dout).sum() + torch.where(torch.isfinite(lse), lse * dlse, 0.0).sum()
    want = torch.autograd.grad(loss, leaves)
    monkeypatch.setattr(dsa, "CHUNK_BUDGET", 2 * topk * (576 + 5 * h))  # two rows a chunk
    saved = {"out": out.detach(), "lse": lse.detach()}
    for kwargs in ({}, saved):
        dq, dkv, d_sink = dsa.dsa_sparse_attention_bwd_ref(
            q, kv, idx, 0.05, dout, attn_sink=sink, dlse=dlse, dtype=F64, **kwargs
        )
        torch.testing.assert_close(dq, want[0], atol=1e-10, rtol=0)
        torch.testing.assert_close(dkv, want[1], atol=1e-10, rtol=0)
        assert (d_sink is None) == (sink is None)
        if sink is not None:
            assert torch.isfinite(d_sink).all()
            torch.testing.assert_close(d_sink, want[2].nan_to_num(0.0), atol=1e-10, rtol=0)
        assert torch.equal(dq[[1, 5]], torch.zeros_like(dq[[1, 5]]))
    # dq written in a 16-bit dtype chunk by chunk: the fp64 answer rounded once.
    dq16, _, _ = dsa.dsa_sparse_attention_bwd_ref(
        q, kv, idx, 0.05, dout, attn_sink=sink, dlse=dlse, dtype=F64, dq_dtype=torch.bfloat16
    )
    assert dq16.dtype == torch.bfloat16 and torch.equal(dq16, want[0].bfloat16())


def test_lse_gradient_matches_finite_differences():
    gen = _gen(32)
    q = torch.randn(3, 2, 12, generator=gen, dtype=F64, requires_grad=True)
    kv = torch.randn(9, 12, generator=gen, dtype=F64, requires_grad=True)
    sink = torch.randn(2, generator=gen, dtype=F64, requires_grad=True)
    idx = make_indices(3, 9, 5, gen, counts=[5, 3, 1])
    w = torch.randn(3, 2, generator=gen, dtype=F64)

    def fn(a, b, c):
        out, lse = dsa.dsa_sparse_attention_ref(a, b, idx, 0.4, attn_sink=c, d_v=8, dtype=F64)
        return out, lse * w

    assert torch.autograd.gradcheck(fn, (q, kv, sink), eps=1e-6, atol=1e-7)
    dout = torch.randn(3, 2, 8, generator=gen, dtype=F64)
    out, lse = fn(q, kv, sink)
    want = torch.autograd.grad((out * dout).sum() + lse.sum(), (q, kv, sink))
    got = dsa.dsa_sparse_attention_bwd_ref(
        q.detach(), kv.detach(), idx, 0.4, dout, attn_sink=sink.detach(), dlse=w, d_v=8,
        dtype=F64,
    )  # fmt: skip
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=0)


# ---------------------------------------------------------------- score recompute


def test_score_recompute_is_the_softmax_at_the_selected_keys():
    q, kv, idx, sink = make_case(6, 16, 50, 24, seed=41, counts=[24, 0, 4, 24, 11, 24])
    scale = 0.05
    _, lse = dsa.dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=sink, dtype=F64)
    probs = dsa.dsa_score_recompute_ref(q, kv, lse, idx, scale, dtype=F64)
    expected = torch.zeros_like(probs)
    for t in range(6):
        keys = idx[t] >= 0
        if keys.any():
            s = torch.einsum("hd,kd->hk", q[t], kv[idx[t][keys].long()]) * scale
            expected[t][:, keys] = torch.softmax(s, -1)
    torch.testing.assert_close(probs, expected, atol=1e-13, rtol=0)
    sums = probs.sum(-1)
    has_keys = (idx >= 0).any(-1)
    torch.testing.assert_close(sums[has_keys], torch.ones_like(sums[has_keys]))
    assert torch.equal(sums[~has_keys], torch.zeros_like(sums[~has_keys]))
    # With the sink's LSE the rows sum to less than 1: 1 minus the sink's probability.
    full = dsa.lse_with_sink(lse, sink)
    sunk = dsa.dsa_score_recompute_ref(q, kv, full, idx, scale, dtype=F64).sum(-1)
    assert (sunk <= 1).all()
    torch.testing.assert_close(sunk[has_keys], (1 - torch.exp(sink - full))[has_keys])
    # The indexer's target: head sum, L1-normalized.
    target = dsa.dsa_attention_target_ref(probs)
    torch.testing.assert_close(target[has_keys].sum(-1), torch.ones(int(has_keys.sum()), dtype=F64))
    torch.testing.assert_close(target[2], probs[2].sum(0) / probs[2].sum())


# ---------------------------------------------------------------- indexer


def naive_index_scores(q, k, w, q_scale=None, k_scale=None):
    """fp64 loop over (t, s, h): sum_h w relu(q . k), scales applied to q and k first."""
    q, k = q.double(), k.double()
    if q_scale is not None:
        q = q * q_scale.double()[..., None]
    if k_scale is not None:
        k = k * k_scale.double()[:, None]
    out = torch.zeros(q.shape[0], k.shape[0], dtype=F64)
    for t in range(q.shape[0]):
        for s in range(k.shape[0]):
            out[t, s] = sum(
                w[t, h].double() * torch.relu(q[t, h] @ k[s]) for h in range(q.shape[1])
            )
    return out


def indexer_case(s, s_kv, h, d, seed, fp8=False):
    gen = _gen(seed)
    q = torch.randn(s, h, d, generator=gen)
    k = torch.randn(s_kv, d, generator=gen)
    w = torch.randn(s, h, generator=gen)
    if not fp8:
        return q.double(), k.double(), w.double(), None, None
    q8, q_scale = dsa.quantize_fp8_groups(q, d)
    k8, k_scale = dsa.quantize_fp8_groups(k, d)
    return q8, k8, w, q_scale[..., 0], k_scale[..., 0]


@pytest.mark.parametrize("fp8", [False, True])
def test_indexer_scores_and_topk(fp8):
    s, s_kv, topk = 9, 23, 10
    q, k, w, qs, ks = indexer_case(s, s_kv, 6, 16, seed=50 + fp8, fp8=fp8)
    ref = naive_index_scores(q, k, w, qs, ks)
    visible = dsa.causal_visible(s, s_kv)
    scores = dsa.dsa_indexer_scores_ref(q, k, w, q_scale=qs, k_scale=ks, dtype=F64)
    torch.testing.assert_close(scores[visible], ref[visible], atol=1e-12, rtol=0)
    assert torch.isneginf(scores[~visible]).all()
    idx = dsa.dsa_indexer_ref(q, k, w, q_scale=qs, k_scale=ks, topk=topk, dtype=F64)
    assert idx.dtype == torch.int32 and idx.shape == (s, topk)
    for t in range(s):
        seen = t + s_kv - s + 1
        n = min(topk, seen)
        picked = idx[t, :n].long()
        assert (idx[t, n:] == -1).all() and (picked < seen).all()
        assert len(set(picked.tolist())) == n
        # Exactly the n largest visible scores, in descending order.
        torch.testing.assert_close(ref[t, picked], ref[t, :seen].sort(descending=True).values[:n])
    assert dsa.topk_selection_error(ref.masked_fill(~visible, NEG_INF), idx, topk) == 0.0
    # Square (prefill from position 0): row t sees keys 0..t, so early rows are mostly -1.
    ks_square = None if ks is None else ks[:s]
    square = dsa.dsa_indexer_ref(q, k[:s], w, q_scale=qs, k_scale=ks_square, topk=topk)
    for t in range(s):  # s < topk here: every visible key is selected
        assert sorted(square[t, : t + 1].tolist()) == list(range(t + 1))
        assert (square[t, t + 1 :] == -1).all()


def test_topk_ties_go_to_the_lower_index_and_selection_judge():
    scores = torch.tensor([[1.0, 3.0, 3.0, NEG_INF, 2.0, 3.0], [NEG_INF] * 6, [0.0] * 6])
    idx = dsa.dsa_topk_ref(scores, 4)
    assert idx.tolist() == [[1, 2, 5, 4], [-1] * 4, [0, 1, 2, 3]]
    assert dsa.topk_selection_error(scores, idx, 4) == 0.0
    other = torch.tensor([[5, 4, 2, 1], [-1] * 4, [5, -1, 3, 4]], dtype=torch.int32)
    with pytest.raises(ValueError, match="count"):
        dsa.topk_selection_error(scores, other, 4)
    other[2] = torch.tensor([5, 0, 3, 4])  # another tie choice, another order: exact
    assert dsa.topk_selection_error(scores, other, 4) == 0.0
    worse = torch.tensor([[1, 2, 5, 0], [-1] * 4, [0, 1, 2, 3]], dtype=torch.int32)
    assert dsa.topk_selection_error(scores, worse, 4) == 1.0  # 1.0 picked instead of 2.0
    for bad, what in (([1, 1, 5, 4], "twice"), ([1, 2, 5, 3], "hidden")):
        with pytest.raises(ValueError, match=what):
            dsa.topk_selection_error(scores, torch.tensor([bad, [-1] * 4, [0, 1, 2, 3]]), 4)


def test_indexer_packed_sequences_and_paged_cache():
    gen = _gen(61)
    q_lens, k_lens, topk = [3, 1, 4], [5, 9, 4], 6
    q, k, w, _, _ = indexer_case(sum(q_lens), sum(k_lens), 4, 8, seed=62)
    cu_q = torch.tensor([0, 3, 4, 8], dtype=torch.int32)
    cu_k = torch.tensor([0, 5, 14, 18], dtype=torch.int32)
    packed = dsa.dsa_indexer_ref(q, k, w, topk=topk, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    for b in range(3):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        alone = dsa.dsa_indexer_ref(q[q0:q1], k[k0:k1], w[q0:q1], topk=topk)
        assert torch.equal(packed[q0:q1], torch.where(alone >= 0, alone + k0, -1))
    # The same keys on random pages of size 2; slots map back to the sequence's tokens.
    page_size, pages = 2, 14
    ids = torch.randperm(pages, generator=gen)
    table = torch.full((3, 5), 0, dtype=torch.int32)
    cache = torch.zeros(pages, page_size, 8, dtype=F64)
    used = 0
    for b in range(3):
        n = -(-k_lens[b] // page_size)
        table[b, :n] = ids[used : used + n].int()
        used += n
        seq = k[int(cu_k[b]) : int(cu_k[b + 1])]
        for j in range(k_lens[b]):
            cache[table[b, j // page_size], j % page_size] = seq[j]
    slots = dsa.dsa_indexer_paged_ref(
        q, cache, w, table, torch.tensor(k_lens), cu_seqlens_q=cu_q, topk=topk
    )
    flat = dsa.flatten_kv_cache(cache)
    for row in range(q.shape[0]):
        for slot, ref in zip(slots[row].tolist(), packed[row].tolist()):
            assert (slot == -1) == (ref == -1)
            if slot >= 0:
                assert torch.equal(flat[slot], k[ref])


def test_indexer_loss_gradients():
    gen = _gen(71)
    s, s_kv, h, d, topk = 5, 14, 4, 8, 6
    q = torch.randn(s, h, d, generator=gen, dtype=F64)
    k = torch.randn(s_kv, d, generator=gen, dtype=F64)
    w = torch.randn(s, h, generator=gen, dtype=F64)
    idx = dsa.dsa_indexer_ref(q, k, w, topk=topk, dtype=F64)  # row t sees t + 10 keys
    idx[1, 2:] = -1
    idx[4] = -1  # a row with no key adds nothing
    target = dsa.dsa_attention_target_ref(torch.rand(s, 3, topk, generator=gen, dtype=F64))
    target = target.masked_fill(idx < 0, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
    dq, dk, dw = dsa.dsa_indexer_backward_ref(q, k, w, idx, target, grad_scale=0.5, dtype=F64)

    def loss(a, b, c):
        scores = dsa.dsa_indexer_topk_scores_ref(a, b, c, idx, dtype=F64)
        return 0.5 * dsa.dsa_indexer_loss_ref(scores, target)

    leaves = tuple(x.clone().requires_grad_(True) for x in (q, k, w))
    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7)
    # Closed form: dL/dI = 0.5 (softmax(I) - target) on the selected keys (target sums to 1).
    scores = dsa.dsa_indexer_topk_scores_ref(q, k, w, idx, dtype=F64)
    valid = idx >= 0
    pred = torch.softmax(torch.where(valid.any(-1, keepdim=True), scores, 0.0), -1)
    g = torch.where(valid, 0.5 * (pred - target), 0.0)
    relu = torch.einsum("thd,tkd->thk", q, k[idx.clamp(min=0).long()]).relu()
    torch.testing.assert_close(dw, torch.einsum("tk,thk->th", g, relu), atol=1e-13, rtol=0)
    assert (
        dq.shape == q.shape and dk.shape == k.shape and torch.equal(dq[4], torch.zeros_like(dq[4]))
    )
    # The topk scores equal the dense scores gathered at the indices.
    dense = dsa.dsa_indexer_scores_ref(q, k, w, dtype=F64)
    torch.testing.assert_close(scores[valid], dense.gather(1, idx.clamp(min=0).long())[valid])
    # KL is 0 when the indexer already predicts the target.
    assert abs(float(dsa.dsa_indexer_loss_ref(scores, torch.where(valid, pred, 0.0)))) < 1e-12


# ---------------------------------------------------------------- paged sparse attention


@pytest.mark.parametrize("page_size", [1, 64])
def test_paged_sparse_attention_page_table_and_slots(page_size):
    gen = _gen(80 + page_size)
    seqlens, q_lens, h, topk = [70, 5, 130], [2, 1, 3], 16, 12
    counts = [-(-n // page_size) for n in seqlens]
    num_pages = sum(counts) + 2
    cache = torch.randn(num_pages, page_size, 1, 576, generator=gen, dtype=F64)
    ids = torch.randperm(num_pages, generator=gen)
    table = torch.full((3, max(counts) + 1), 10**6, dtype=torch.int32)  # garbage past the pages
    start = 0
    for b, n in enumerate(counts):
        table[b, :n] = ids[start : start + n].int()
        start += n
    cu_q = torch.tensor([0, 2, 3, 6], dtype=torch.int32)
    q = torch.randn(6, h, 576, generator=gen, dtype=F64)
    logical = torch.cat(
        [make_indices(nq, n, topk, gen, [min(n, topk - 3)] * nq) for n, nq in zip(seqlens, q_lens)]
    )
    slots = dsa.page_table_to_slot_indices(logical, table, page_size, cu_seqlens_q=cu_q)
    # FlashInfer's CSR page lists give the same slots once turned into a page table.
    csr = page_table_to_csr(table, torch.tensor(seqlens), page_size)
    table_csr, _ = csr_to_page_table(*csr, page_size)
    assert torch.equal(
        dsa.page_table_to_slot_indices(logical, table_csr, page_size, cu_seqlens_q=cu_q), slots
    )
    out, lse = dsa.dsa_sparse_attention_paged_ref(q, cache, slots, 0.05, dtype=F64)
    for b in range(3):
        pages = table[b, : counts[b]].long()
        seq_kv = cache[pages, :, 0].reshape(-1, 576)[: seqlens[b]]
        rows = slice(int(cu_q[b]), int(cu_q[b + 1]))
        ref_out, ref_lse = dsa.dsa_sparse_attention_ref(
            q[rows], seq_kv, logical[rows], 0.05, dtype=F64
        )
        torch.testing.assert_close(out[rows], ref_out, atol=1e-13, rtol=0)
        assert_lse_equal(lse[rows], ref_lse, 1e-13)


# ---------------------------------------------------------------- RoPE, FP8 cast, fused prefill


def deepseek_rope(x, angles, interleaved):
    """DeepSeek inference/model.py's apply_rotary_emb, with complex numbers."""
    if not interleaved:  # pairs (i, i + half) -> adjacent, rotate, back
        x = x.unflatten(-1, (2, -1)).transpose(-1, -2).flatten(-2)
    z = torch.view_as_complex(x.double().unflatten(-1, (-1, 2)).contiguous())
    y = torch.view_as_real(z * torch.polar(torch.ones_like(angles), angles)[:, None]).flatten(-2)
    return torch.cat((y[..., 0::2], y[..., 1::2]), -1) if not interleaved else y


def cos_sin_cache(positions, rope_dim=64, base=10000.0):
    inv = 1.0 / base ** (torch.arange(0, rope_dim, 2, dtype=F64) / rope_dim)
    angles = torch.outer(torch.arange(positions, dtype=F64), inv)
    return torch.cat((angles.cos(), angles.sin()), -1), angles


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_conventions(interleaved):
    cache, angles = cos_sin_cache(50)
    pos = torch.tensor([0, 7, 49, 3])
    x = torch.randn(4, 3, 64, generator=_gen(90), dtype=F64)
    cos, sin = dsa.rope_cos_sin(cache, pos)
    y = dsa.apply_rope(x, cos, sin, interleaved=interleaved)
    torch.testing.assert_close(y, deepseek_rope(x, angles[pos], interleaved), atol=1e-13, rtol=0)
    back = dsa.apply_rope(y, cos, sin, interleaved=interleaved, conjugate=True)
    torch.testing.assert_close(back, x, atol=1e-13, rtol=0)


def test_fp8_group_cast():
    x = torch.randn(3, 5, 64, generator=_gen(91)) * torch.logspace(-3, 2, 64)
    x[0, 0, :32] = 0.0  # amax floor: scale 1e-4 / 448 rounded up to 2^-22
    x8, scale = dsa.quantize_fp8_groups(x, 32)
    assert x8.dtype == torch.float8_e4m3fn and scale.shape == (3, 5, 2)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)  # powers of two (UE8M0)
    amax = x.unflatten(-1, (2, 32)).abs().amax(-1).clamp(min=1e-4)
    assert ((amax / scale <= 448) & (amax / scale > 224)).all()
    assert scale[0, 0, 0] == 2.0**-22 and (x8[0, 0, :32].float() == 0).all()
    err = (dsa.dequantize_fp8_groups(x8, scale) - x).abs()
    bound = x.abs() * 2.0**-4 + scale.repeat_interleave(32, -1) * 2.0**-10  # half ulp, subnormals
    assert (err <= bound).all()
    plain, plain_scale = dsa.quantize_fp8_groups(x, 32, round_scale=False)
    torch.testing.assert_close(plain_scale, amax / 448)


@pytest.mark.parametrize("norm", [None, 1e-4])
def test_fused_prefill_is_the_unfused_chain(norm):
    q, kv, idx, sink = make_case(5, 16, 40, 16, seed=93, counts=[16, 3, 0, 16, 9])
    q = q.bfloat16()
    kv = kv.bfloat16()
    cache, angles = cos_sin_cache(64)
    pos = torch.tensor([3, 63, 0, 17, 8], dtype=torch.int32)
    scale = 576**-0.5
    got = dsa.dsa_fused_prefill_ref(
        q, kv, idx, scale, cache.float(), pos, attn_sink=sink.float(), q_rms_norm_eps=norm
    )
    q_rot = torch.cat(
        (q[..., :512], deepseek_rope(q[..., 512:], angles[pos.long()], True).bfloat16()), -1
    )
    q_att = q_rot.double()
    if norm is not None:  # FlashMLA scales the logits by rsqrt(mean(q^2) + eps) of the input q
        q_att = q_att * torch.rsqrt(q.double().square().mean(-1) + norm)[..., None]
    out, lse = naive_sparse(q_att, kv.double(), idx, scale, sink)
    out = torch.cat((out[..., :448], deepseek_rope(out[..., 448:], -angles[pos.long()], True)), -1)
    torch.testing.assert_close(got.out.double(), out, atol=3e-6, rtol=0)
    assert_lse_equal(got.lse, lse, 3e-5)
    assert got.out_fp8.shape == (5, 16, 512) and got.out_scale.shape == (5, 16, 16)
    dequant = dsa.dequantize_fp8_groups(got.out_fp8, got.out_scale)
    floor = got.out_scale.repeat_interleave(32, -1) * 2.0**-10  # half the smallest subnormal
    assert ((dequant - got.out).abs() <= got.out.abs() * 2.0**-4 + floor).all()
    assert torch.equal(got.out_fp8[2].float(), torch.zeros(16, 512))  # the row with no key


# ---------------------------------------------------------------- bad inputs


def test_bad_inputs_raise_naming_the_argument():
    q, kv, idx, sink = make_case(3, 16, 20, 8, seed=99)
    with pytest.raises(ValueError, match="topk_indices"):
        dsa.dsa_sparse_attention_ref(q, kv, torch.full_like(idx, 20), 0.1)
    with pytest.raises(ValueError, match="topk_indices"):
        dsa.dsa_sparse_attention_ref(q, kv, idx[:2], 0.1)
    with pytest.raises(TypeError, match="topk_indices"):
        dsa.dsa_sparse_attention_ref(q, kv, idx.float(), 0.1)
    with pytest.raises(ValueError, match="attn_sink"):
        dsa.dsa_sparse_attention_ref(q, kv, idx, 0.1, attn_sink=sink[:3])
    with pytest.raises(ValueError, match="kv"):
        dsa.dsa_sparse_attention_ref(q, kv[:, :512], idx, 0.1)
    with pytest.raises(ValueError, match="topk_length"):
        dsa.dsa_sparse_attention_ref(q, kv, idx, 0.1, topk_length=torch.ones(2, dtype=torch.int32))
    with pytest.raises(ValueError, match="lse"):
        dsa.dsa_score_recompute_ref(q, kv, torch.zeros(3, 15), idx, 0.1)
    with pytest.raises(ValueError, match="weights"):
        dsa.dsa_indexer_ref(q[:, :, :8], kv[:, :8], torch.ones(3, 4), topk=4)
    with pytest.raises(ValueError, match="k_scale"):
        dsa.dsa_indexer_ref(q[:, :, :8], kv[:, :8], torch.ones(3, 16), k_scale=torch.ones(3))


# ---------------------------------------------------------------- FlashInfer-Bench definitions


def _definition(name):
    reason = defs.missing(name)
    if reason:
        pytest.skip(reason)
    return defs.load_definition(name)


def test_indexer_cache_packing_round_trip():
    k8, scale = dsa.quantize_fp8_groups(torch.randn(3, 64, 128, generator=_gen(100)), 128)
    packed = fi.pack_indexer_k_cache(k8, scale[..., 0])
    assert packed.shape == (3, 64, 1, 132) and packed.dtype == torch.int8
    # deep_gemm's layout: all of a page's fp8 bytes, then its 64 fp32 scales.
    flat = packed.view(torch.uint8).reshape(3, -1)
    assert torch.equal(flat[:, : 64 * 128], k8.reshape(3, -1).view(torch.uint8))
    k_back, scale_back = fi.unpack_indexer_k_cache(packed)
    assert torch.equal(k_back.view(torch.uint8), k8.view(torch.uint8))
    assert torch.equal(scale_back, scale[..., 0])


@pytest.mark.parametrize("name", fi.SPARSE_ATTENTION)
def test_sparse_attention_definition(name):
    defn = _definition(name)
    page_size = defn.const("page_size")
    num_pages = 300 if page_size == 1 else 40
    full = 2048 if page_size == 64 else 299  # ps 1: 300 slots, most of the row is -1
    counts = [0, 1, 37, 300, full]
    inputs = fi.sparse_attention_inputs(page_size, num_pages, counts, generator=_gen(101))
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    ours_out, ours_lse = fi.dsa_sparse_attention_flashinfer(**inputs)
    err = (ours_out - theirs_out.float()).abs()
    # Theirs is fp32 math rounded to bf16: within half an ulp (2^-8 relative) of ours.
    assert (err <= theirs_out.float().abs() * 2.0**-8 + 1e-6).all()
    assert_lse_equal(ours_lse, theirs_lse, 1e-5)
    assert torch.isneginf(theirs_lse[0]).all() and (theirs_out[0] == 0).all()


def test_topk_indexer_definition():
    defn = _definition(fi.TOPK_INDEXER)
    # 2300 and 3000 keys exceed topk = 2048, so the selection itself is compared.
    seq_lens = [0, 5, 70, 2048, 2300, 3000]
    inputs = fi.indexer_inputs(seq_lens, generator=_gen(102))
    (theirs,) = defs.run_definition(defn, inputs)
    ours = fi.dsa_topk_indexer_flashinfer(**inputs)
    assert ours.shape == theirs.shape == (len(seq_lens), 2048) and ours.dtype == torch.int32
    for b in range(len(seq_lens)):
        assert set(ours[b].tolist()) == set(theirs[b].tolist()), b
    assert (ours[0] == -1).all() and (ours[1, 5:] == -1).all()
