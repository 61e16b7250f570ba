"""Paged GQA decode on the GPU against the fp32 reference (issue 18): page sizes 1 / 16 / 32 /
64 / 128, GQA 1 / 4 / 8 / 3, head dims 64 / 128 / 256, empty and long sequences, the combined cache
view, fp16 and bf16, NaN-poisoned outputs; FP8 (e4m3) caches over the same shapes, e4m3
subnormals, speculative decoding. Chunked prefill on the attention forward's paged mode: page
sizes 8 to 256, D 64 / 128 / 256, GQA 1 / 3 / 4 / 8, odd lengths, sequences without queries or
keys, more queries than keys, NaN in every cache slot no sequence owns and garbage table entries
past each sequence's pages, the combined view, both dtypes and masks."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from graphs import assert_pdl_chain_is_serialized, captured

from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_launch
from forgekernel.reference.paged_attention import paged_attention_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.attention_paged")

CASES = [
    # b, hq, hkv, d, page_size, lens, combined
    (4, 32, 8, 128, 16, [1, 17, 300, 0], False),
    (2, 32, 4, 128, 1, [64, 1000], False),
    (1, 32, 8, 128, 64, [16384], False),
    (3, 8, 8, 64, 16, [5, 0, 513], True),
    (2, 16, 2, 256, 64, [129, 2048], False),
    (2, 24, 8, 128, 32, [77, 700], False),
    (64, 32, 8, 128, 16, [4096] * 64, False),
    # page 128 (the largest): lengths off the page, an empty one, the combined view
    (3, 32, 8, 128, 128, [1, 300, 0], False),
    (2, 16, 4, 64, 128, [129, 5000], True),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_{c[2]}_d{c[3]}_p{c[4]}")
def test_paged_decode_matches_the_reference(case, dtype):
    b, hq, hkv, d, ps, lens, combined = case
    g = torch.Generator(device="cuda").manual_seed(0)
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 5
    shape = (pages, 2, ps, hkv, d) if combined else (pages, ps, hkv, d)
    k = torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    v = None if combined else torch.randn(*shape, device="cuda", dtype=dtype, generator=g)
    table = torch.randperm(pages, device="cuda", generator=g)[: b * max_pages].view(b, -1)
    table = table.to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    out = torch.full_like(q, float("nan"))
    _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out)
    kk, vv = (k[:, 0], k[:, 1]) if combined else (k, v)
    want, want_lse = paged_attention_ref(q, kk, vv, table, seq)
    low, _ = paged_attention_ref(q, kk, vv, table, seq, upcast=False)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


@pytest.mark.parametrize("per_head", [False, True])
def test_paged_decode_fp8_cache(per_head):
    g = torch.Generator(device="cuda").manual_seed(1)
    b, hq, hkv, d, ps = 3, 32, 8, 128, 16
    lens = [1, 200, 3000]
    max_pages = -(-max(lens) // ps)
    pages = b * max_pages + 2
    k = torch.randn(pages, ps, hkv, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    v = torch.randn(pages, ps, hkv, d, device="cuda", generator=g).to(torch.float8_e4m3fn)
    table = torch.randperm(pages, device="cuda", generator=g)[: b * max_pages].view(b, -1)
    table = table.to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    ks = torch.rand(hkv, device="cuda", generator=g) + 0.5 if per_head else 0.7
    vs = torch.rand(hkv, device="cuda", generator=g) + 0.5 if per_head else 1.3
    out, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, k_scale=ks, v_scale=vs)
    want, want_lse = paged_attention_ref(q, k, v, table, seq, k_scale=ks, v_scale=vs)
    assert float((out.float() - want).abs().max()) < 2e-2
    assert float((lse - want_lse).abs().max()) < 1e-3


FP8_CASES = [
    # b, hq, hkv, d, page_size, lens, combined: every FP8 leaf shape (D 64 / 128 / 256, padding
    # rows (G <= 8) and full rows (G 16), MHA), page sizes 1 / 16 / 64, empty and odd lengths
    (4, 32, 8, 128, 16, [1, 17, 300, 0], False),
    (2, 32, 4, 128, 1, [64, 1000], False),
    (1, 32, 8, 128, 64, [16384], False),
    (3, 8, 8, 64, 16, [5, 0, 513], True),
    (2, 16, 2, 256, 64, [129, 2048], False),
    (2, 64, 4, 64, 16, [77, 3000], False),
    (2, 24, 8, 256, 32, [77, 700], False),
    (64, 32, 8, 128, 16, [4096] * 64, False),
]


def _fp8_problem(case, dtype, seed, subnormal=False):
    """Random e4m3 caches (N(0, 1) draws, or with `subnormal` only e4m3's subnormal codes, made
    O(1) by scales of 2^9: a flushed subnormal would zero whole keys), per-head scales, q."""
    b, hq, hkv, d, ps, lens, combined = case
    g = torch.Generator(device="cuda").manual_seed(seed)
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 5
    shape = (pages, 2, ps, hkv, d) if combined else (pages, ps, hkv, d)
    if subnormal:
        codes = torch.randint(1, 8, shape, device="cuda", generator=g, dtype=torch.uint8)
        sign = torch.randint(0, 2, shape, device="cuda", generator=g, dtype=torch.uint8) << 7
        kv = (codes | sign).view(torch.float8_e4m3fn)
        scales = torch.full((2, hkv), 2.0**9, device="cuda")
    else:
        kv = torch.randn(*shape, device="cuda", generator=g).to(torch.float8_e4m3fn)
        scales = torch.rand(2, hkv, device="cuda", generator=g) + 0.5
    k = kv[:, 0] if combined else kv
    v = kv[:, 1] if combined else kv.flip(0)
    table = torch.randperm(pages, device="cuda", generator=g)[: b * max_pages].view(b, -1)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, table.to(torch.int32), seq, scales[0], scales[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_{c[2]}_d{c[3]}_p{c[4]}")
def test_paged_decode_fp8_cache_shapes(case, dtype):
    q, k, v, table, seq, ks, vs = _fp8_problem(case, dtype, seed=2)
    out = torch.full_like(q, float("nan"))
    _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out, k_scale=ks,
                                v_scale=vs)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, seq, k_scale=ks, v_scale=vs)
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3
    assert torch.all(out[~finite] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
def test_paged_decode_fp8_subnormal_cache(d, dtype):
    """K and V of e4m3 subnormals only: widened exactly (the bf16 path multiplies bf16
    subnormals by 2^120), not flushed."""
    case = (3, 16, 4, d, 16, [40, 700, 2000], False)
    q, k, v, table, seq, ks, vs = _fp8_problem(case, dtype, seed=4, subnormal=True)
    out, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, k_scale=ks, v_scale=vs)
    want, want_lse = paged_attention_ref(q, k, v, table, seq, k_scale=ks, v_scale=vs)
    assert float((out.float() - want).abs().max()) < 2e-2 * float(want.abs().max())
    assert float((lse - want_lse).abs().max()) < 1e-3 * float(want_lse.abs().max())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("q_lens", "k_lens", "hq", "hkv", "d"),
    [
        ([1, 3, 2, 4], [40, 3, 700, 4096], 32, 8, 128),
        ([2, 2], [0, 129], 16, 2, 256),
        ([4] * 8, [999] * 8, 64, 8, 64),
    ],
)
def test_paged_speculative_decoding_fp8_cache(q_lens, k_lens, hq, hkv, d, dtype):
    case = (len(q_lens), hq, hkv, d, 16, k_lens, False)
    _, k, v, table, seq, ks, vs = _fp8_problem(case, dtype, seed=5)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(6)
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype, generator=g)
    out, lse = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                                  return_lse=True, k_scale=ks, v_scale=vs)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu, k_scale=ks,
                                         v_scale=vs)  # fmt: skip
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


def _spec_batch(q_lens, k_lens, hq, hkv, d, seed):
    """A speculative-decoding batch, bf16, page size 16: q packed by cu (q_lens tokens a
    sequence), k / v caches with 3 pages no sequence owns, a shuffled table, k_lens keys."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b, ps = len(q_lens), 16
    max_pages = max(1, max(-(-n // ps) for n in k_lens))
    pages = b * max_pages + 3
    k = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    v = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
    table = torch.randperm(pages, device="cuda", generator=g)[: b * max_pages].view(b, -1)
    table = table.to(torch.int32)
    seq = torch.tensor(k_lens, dtype=torch.int32, device="cuda")
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
    return q, k, v, table, seq, cu


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("q_lens", "k_lens", "hq", "hkv", "d"),
    [([1, 3, 2, 4], [40, 3, 700, 4096], 32, 8, 128), ([2, 2], [0, 129], 16, 2, 256),
     ([4] * 16, [2048] * 16, 64, 8, 128),
     # 32 rows a CTA (GQA 8 x 4 tokens, GQA 16 x 2): split plans of many splits and of one
     ([4, 1, 3, 2], [700, 5, 64, 4096], 16, 2, 64), ([2, 1, 2], [33, 0, 3000], 32, 2, 128),
     ([4] * 32, [300] * 32, 64, 8, 128)],
)  # fmt: skip
def test_paged_speculative_decoding(causal, q_lens, k_lens, hq, hkv, d):
    q, k, v, table, seq, cu = _spec_batch(q_lens, k_lens, hq, hkv, d, seed=3)
    out, lse = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu,
                                  max_seqlen_q=max(q_lens), causal=causal,
                                  return_lse=True)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu, causal=causal)
    low, _ = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu, causal=causal,
                                 upcast=False)  # fmt: skip
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


def _prefill_problem(hq, hkv, d, ps, q_lens, k_lens, dtype, combined, seed):
    """NaN in every slot no sequence owns (pages of no sequence, the last page's slots past the
    length); the table exactly as wide as the longest sequence, its entries past a sequence's
    pages garbage (NaN pages, ids past the cache, -1); packed queries."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    b = len(k_lens)
    width = max(1, max(-(-n // ps) for n in k_lens))
    pages = b * width + 3
    if combined:
        k = torch.full((pages, 2, ps, hkv, d), float("nan"), device="cuda", dtype=dtype)
        v, views = None, (k[:, 0], k[:, 1])
    else:
        k, v = (torch.full((pages, ps, hkv, d), float("nan"), device="cuda", dtype=dtype)
                for _ in "kv")  # fmt: skip
        views = (k, v)
    perm = torch.randperm(pages, device="cuda", generator=g)[: b * width].view(b, width)
    pick = torch.randint(0, 3, (b, width), device="cuda", generator=g)
    table = torch.where(pick == 0, perm, torch.where(pick == 1, pages + 7, -1))
    for s_, n in enumerate(k_lens):
        owned = -(-n // ps)
        table[s_, :owned] = perm[s_, :owned]
        for i in range(owned):
            rows = min(ps, n - i * ps)
            for view in views:
                view[perm[s_, i], :rows] = torch.randn(rows, hkv, d, device="cuda", dtype=dtype,
                                                       generator=g)  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    q = torch.randn(int(cu[-1]), hq, d, device="cuda", dtype=dtype, generator=g)
    seq = torch.tensor(k_lens, dtype=torch.int32, device="cuda")
    return q, k, v, table.to(torch.int32), seq, cu


def record_kernel_lookups(monkeypatch) -> list[dict]:
    """The forward's kernel lookups of one test, as params dicts. A plan cache of the test's
    own: the launcher's plans are keyed (dtype, D, causal, varlen, box, device), so a case whose
    box another case already planned (page 128 and page 256 at D 128: box 128) looks nothing up
    through the shared cache (2026-12-02 10:20: the h64_8 p128 case's 4 failures)."""
    looked_up = []
    real = fwd_launch.get_kernel
    monkeypatch.setattr(
        fwd_launch,
        "get_kernel",
        lambda spec, params: looked_up.append(dict(params)) or real(spec, params),
    )
    monkeypatch.setattr(fwd_launch, "_plans", type(fwd_launch._plans)())
    return looked_up


PREFILL_CASES = [
    # hq, hkv, d, page_size, q_lens, k_lens, combined
    (32, 8, 128, 16, [5, 0, 130, 1, 7], [40, 9, 257, 300, 7], False),
    (32, 8, 128, 64, [2048, 1, 1, 513], [16384, 4000, 77, 513], False),
    (8, 8, 64, 32, [200, 17, 5, 300], [250, 17, 385, 1000], False),  # MHA, 192-row tiles
    (16, 2, 256, 128, [70, 6, 129], [190, 6, 4096], False),  # 64-row boxes of 128-row pages
    (12, 4, 128, 8, [12, 40, 100], [21, 40, 1001], True),  # GQA 3, page 8, combined view
    (32, 8, 128, 256, [7, 140, 1000], [300, 140, 2000], False),  # 2 tiles a page
    (32, 4, 64, 16, [40, 6, 9], [20, 3, 0], False),  # more queries than keys, no keys
    (32, 8, 256, 16, [33, 600], [33, 601], False),
    (64, 8, 128, 128, [4096, 1024] + [1] * 16, [4096, 17408] + [3000] * 16, True),
]


def check_prefill(out, lse, q, k, v, table, seq, cu, causal, combined):
    """A chunked-prefill call's out / lse against the fp32 reference: O within 2x the
    low-precision error + 1e-3, the LSE to 1e-3 where finite, -inf (never NaN; O 0) exactly
    where no key is seen."""
    kk, vv = (k[:, 0], k[:, 1]) if combined else (k, v)
    args = (q, kk, vv, table, seq)
    want, want_lse = paged_attention_ref(*args, cu_seqlens_q=cu, causal=causal)
    low, _ = paged_attention_ref(*args, cu_seqlens_q=cu, causal=causal, upcast=False)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert torch.isfinite(out).all()
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and not lse.isnan().any()
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3
    assert not out[~finite.T].any()


@pytest.mark.parametrize("form", op.PREFILL_FORMS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", PREFILL_CASES, ids=lambda c: f"h{c[0]}_{c[1]}_d{c[2]}_p{c[3]}_q{max(c[4])}"
)
def test_paged_prefill_matches_the_reference(monkeypatch, case, dtype, causal, form):
    """Both prefill forms (the packed default, on views where the batch's G has a compile,
    else the split; the split): one lookup of the paged mode, the reference's numbers."""
    hq, hkv, d, ps, q_lens, k_lens, combined = case
    q, k, v, table, seq, cu = _prefill_problem(hq, hkv, d, ps, q_lens, k_lens, dtype, combined,
                                               seed=len(q_lens) + ps)  # fmt: skip
    looked_up = record_kernel_lookups(monkeypatch)
    out = torch.full_like(q, float("nan"))
    with op.prefill_form(form):
        _, lse = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu,
                                    max_seqlen_q=max(q_lens), causal=causal, return_lse=True,
                                    out=out)  # fmt: skip
    assert [p["page_box"] for p in looked_up] == [fwd_launch.paged_box(ps, d)]  # the paged mode
    packed = form == "packed_views" and fwd_launch.view_group(hq // hkv, d) > 0
    assert [p.get("view_group", 0) for p in looked_up] == [hq // hkv if packed else 0]
    check_prefill(out, lse, q, k, v, table, seq, cu, causal, combined)


@pytest.fixture
def split_form():
    """The op's chunked prefill in its split form (the default: the packed form)."""
    with op.prefill_form("split"):
        yield


GRAPH_Q_LENS, GRAPH_K_LENS = [300, 1, 0, 2000, 1, 3], [800, 12345, 5000, 3000, 78, 40]


def graph_problem():
    """The graph tests' batch: a 12k-key decode row, a sequence without queries, one of 3
    tokens last (NaN-free caches)."""
    q, k, v, table, seq, cu = _prefill_problem(32, 8, 128, 64, GRAPH_Q_LENS, GRAPH_K_LENS,
                                               torch.bfloat16, False, seed=3)  # fmt: skip
    return q, k.nan_to_num(), v.nan_to_num(), table, seq, cu


def check_graph_replay_and_compile(q, k, v, table, seq, cu):
    """A chunked-prefill call (in the prefill form in force) captured in a CUDA graph on one
    batch replays on new queries, lengths and query splits of the same shapes as the eager
    call gives them (NaN-poisoned outputs), near the reference; torch.compile (the registered
    op) matches eager."""

    def call(out, lse):
        return op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=2000,
                                  out=out, lse=lse, return_lse=True)  # fmt: skip

    out, lse = torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], device="cuda")
    call(out, lse)  # plans and compiles outside the capture
    want, _ = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu)
    assert float((out.float() - want).abs().max()) < 2e-2
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call(out, lse)
    # new values of the same shapes: the chunk one token shorter, the 1-token row 2 tokens
    q.copy_(torch.randn_like(q))
    cu.copy_(torch.tensor([0, 300, 301, 301, 2300, 2302, 2305], dtype=torch.int32))
    seq.copy_(torch.tensor([800, 9000, 5000, 3000, 78, 40], dtype=torch.int32))
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    eager, eager_lse = torch.empty_like(out), torch.empty_like(lse)
    call(eager, eager_lse)
    assert torch.equal(out, eager) and torch.equal(lse, eager_lse)
    want, _ = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu)
    assert float((out.float() - want).abs().max()) < 2e-2
    compiled = torch.compile(
        lambda q, k, v, t, s, c: op.attention_paged(q, k, v, t, s, cu_seqlens_q=c,
                                                    max_seqlen_q=2000),
        fullgraph=True,
    )  # fmt: skip
    got = compiled(q, k, v, table, seq, cu)
    assert float((got.float() - eager.float()).abs().max()) < 1e-2


@pytest.mark.usefixtures("split_form")
def test_prefill_decode_slots_replay_in_a_graph_and_compile():
    """The decode rows (split form) on the split plan over the compact slots (`ops.attention_paged.
    _decode_part`: device index ops, no host read): `check_graph_replay_and_compile` on a batch
    whose 12k-key decode row takes several splits."""
    q, k, v, table, seq, cu = graph_problem()
    assert op.paged_sm90.packed_splits(q, k, table, len(GRAPH_Q_LENS), op.MAX_QUERY_TOKENS) > 1
    check_graph_replay_and_compile(q, k, v, table, seq, cu)


def test_paged_prefill_agrees_with_the_gather_path():
    """The paged mode and the gather + varlen forward on one batch (a NaN-free cache: the
    gather reads every slot of a page): the same attention, to rounding."""
    q, k, v, table, seq, cu = _prefill_problem(32, 8, 128, 16, [300, 1, 77], [1000, 50, 77],
                                               torch.bfloat16, False, seed=5)  # fmt: skip
    k, v = k.nan_to_num(), v.nan_to_num()
    got = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=300)
    ref, _ = op._prefill_by_gather(q, k, v, table.clamp(0, k.shape[0] - 1), seq, cu, 300, True,
                                   128**-0.5, None, None, None)  # fmt: skip
    assert float((got.float() - ref.float()).abs().max()) < 2e-2


def _merge_ref(op: torch.Tensor, lp: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The combine's merge in fp64: (O, natural LSE); splits of no keys (LSE -inf) add nothing
    whatever their partial rows hold, rows of no keys 0 / -inf."""
    op, lp = op.double(), lp.double()
    top = lp.max(0).values
    finite = top > -math.inf
    w = torch.where(finite, torch.exp2(lp - torch.where(finite, top, 0.0)), 0.0)
    total = w.sum(0)
    o = (w[..., None] * torch.where((w > 0)[..., None], op, 0.0)).sum(0)
    o = torch.where(finite[..., None], o / torch.where(finite, total, 1.0)[..., None], 0.0)
    return o, torch.where(finite, (top + torch.log2(total)) * math.log(2), -math.inf)


@pytest.mark.parametrize("form", ["cta", "warps"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256, 512])
# 8 | 9: a second round of the few path, 16 | 17: its bound (combine.FEW x FEW_ROUNDS)
@pytest.mark.parametrize("splits", [1, 2, 7, 8, 9, 16, 17, 128, 300])
@pytest.mark.parametrize("rows, heads", [(1, 16), (3, 100), (40, 32)])
def test_combine_kernel_matches_the_merge(rows, heads, splits, d, dtype, form):
    """The combine alone (D 512 under mla_decode's key, the others attention_paged's): 1 .. 300
    splits (300: two chunks of SPLIT_CAP weights), splits 1, 4, 7, ... of row 0 and every split
    of the last (row, head) without keys (LSE -inf, partial rows NaN), LSEs over 2^+-40; rows x
    heads of 16, 300 and 1280 (a row's column chunks over 4, 3 and 1 CTAs at D 512); out
    NaN-poisoned, the LSE a transposed view. One split: the partial row bit for bit. form: the
    CTA form, or the warp form (combine_form.py; head dims that are multiples of 128)."""
    from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
    from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
    from forgekernel.kernels.attention.paged.sm90 import SPEC, params_for
    from forgekernel.runtime.cache import get_kernel

    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    warps = form == "warps"
    if warps and d % 128:
        pytest.skip("the warp form takes head dims that are multiples of 128")
    if d == 512:
        combine = get_kernel(MLA_SPEC, mla_params("combine", name, warps=warps))
    else:
        combine = get_kernel(SPEC, params_for("combine", name, d, warps=warps))
    g = torch.Generator(device="cuda").manual_seed(splits + d)
    op = torch.randn(splits, rows, heads, d, device="cuda", generator=g)
    lp = torch.randn(splits, rows, heads, device="cuda", generator=g) * 12.0
    lp[1::3, 0] = -math.inf
    lp[:, -1, -1] = -math.inf  # the last (row, head): no keys at all
    op[lp == -math.inf] = math.nan
    out = torch.full((rows, heads, d), math.nan, device="cuda", dtype=dtype)
    lse = torch.full((heads, rows), math.nan, device="cuda").t()
    combine(op, lp, out, lse)
    want, want_lse = _merge_ref(op, lp)
    assert not out.isnan().any() and not lse.isnan().any()
    assert torch.equal(out[-1, -1].float(), torch.zeros(d, device="cuda"))
    assert lse[-1, -1] == -math.inf
    err = float((out.double() - want).abs().max())
    assert err <= 2**-7 * float(want.abs().max()) + 1e-5, err
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse.double()[finite] - want_lse[finite]).abs().max()) < 1e-4
    if splits == 1:
        ok = lp[0] > -math.inf
        assert torch.equal(out[ok], op[0][ok].to(dtype))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("splits", [1, 2, 4, 7, 8, 9, 13, 16])
@pytest.mark.parametrize("rows, heads", [(1, 16), (3, 100), (40, 32), (64, 64)])
def test_few_path_is_the_warp_form_bit_for_bit(rows, heads, splits, dtype):
    """D 512 (MLA's, DSA's) at most combine.FEW x FEW_ROUNDS splits: the CTA form's few-splits
    path (its first round of O loads issued beside the LSE's, a second round past FEW splits,
    2026-12-04 next/mla-combine3) and the warp form add the same
    splits in the same order and reduce the weights by the same shuffles: the same bits, out and
    LSE, on rows x heads of 16, 300, 1280 and 4096 (a row's chunks over 4, 3, 1 and 1 CTAs), with
    splits of no keys (NaN partial rows) and a (row, head) of none; both against the merge."""
    from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
    from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
    from forgekernel.runtime.cache import get_kernel

    name = "bfloat16" if dtype == torch.bfloat16 else "float16"
    g = torch.Generator(device="cuda").manual_seed(splits + rows)
    op = torch.randn(splits, rows, heads, 512, device="cuda", generator=g)
    lp = torch.randn(splits, rows, heads, device="cuda", generator=g) * 12.0
    lp[1::3, 0] = -math.inf
    lp[:, -1, -1] = -math.inf
    op[lp == -math.inf] = math.nan
    got = []
    for warps in (False, True):
        combine = get_kernel(MLA_SPEC, mla_params("combine", name, warps=warps))
        out = torch.full((rows, heads, 512), math.nan, device="cuda", dtype=dtype)
        lse = torch.full((heads, rows), math.nan, device="cuda").t()
        combine(op, lp, out, lse)
        got.append((out, lse))
    (cta, cta_lse), (warp, warp_lse) = got
    assert torch.equal(cta, warp) and torch.equal(cta_lse, warp_lse)
    want, _ = _merge_ref(op, lp)
    assert not cta.isnan().any() and lse[-1, -1] == -math.inf
    err = float((cta.double() - want).abs().max())
    assert err <= 2**-7 * float(want.abs().max()) + 1e-5, err


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("q_lens", "k_lens", "hq", "hkv"),
    [([1, 3, 2, 4], [40, 3, 700, 4096], 32, 8), ([4] * 16, [2048] * 16, 64, 8),
     ([2, 1, 2], [33, 0, 3000], 32, 2), ([2] * 64, [4096] * 64, 32, 8),
     ([2] * 32, [1000] * 32, 64, 8)],
    ids=["h4x4-splits", "h8x4-32rows", "h16x2-32rows", "h4x2-direct", "h8x2-direct"],
)  # fmt: skip
def test_paged_speculative_merge_rows_candidate(causal, q_lens, k_lens, hq, hkv):
    """The merge "rows" (launch.merge_params: each row's merge weights computed once,
    PAGED_NOTES.md "Speculative decoding: the same kernel"; the spec leaves' default since
    2026-12-04 04:39) against the reference and the per-element merge (merge "", the bench's
    variant `merge_elems`), bf16 D 128: 16- and 32-row leaves, split plans with a combine
    (partials) and of one split (direct out / lse), a sequence without keys, NaN-poisoned
    outputs."""
    from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch

    d = 128
    q, k, v, table, seq, cu = _spec_batch(q_lens, k_lens, hq, hkv, d, seed=7)
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    paged_launch.paged_decode(q, k, v, table, seq, d**-0.5, out, lse.t(), cu_seqlens_q=cu,
                              max_seqlen_q=max(q_lens), causal=causal, merge="rows")  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu, causal=causal)
    low, _ = paged_attention_ref(q, k, v, table, seq, cu_seqlens_q=cu, causal=causal,
                                 upcast=False)  # fmt: skip
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3
    std, std_lse = torch.full_like(q, float("nan")), torch.full_like(lse, float("nan"))
    paged_launch.paged_decode(q, k, v, table, seq, d**-0.5, std, std_lse.t(), cu_seqlens_q=cu,
                              max_seqlen_q=max(q_lens), causal=causal, merge="")  # fmt: skip
    assert float((out.float() - std.float()).abs().max()) <= bound
    assert torch.equal(torch.isfinite(std_lse), finite)
    assert float((std_lse[finite] - lse[finite]).abs().max()) < 1e-3
    # the op's default on these leaves is merge "rows": the same kernel, the same bits
    got = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                             causal=causal)  # fmt: skip
    assert torch.equal(got, out)


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("qtokens", [1, 2])
def test_a_wide_table_around_short_sequences(fp8, qtokens):
    """A serving engine's captured graph passes a table sized for its longest context (131072
    tokens here) around short sequences: the splits come from the width, each sequence's keys
    spread over them by its own length; garbage page ids past each sequence's pages."""
    g = torch.Generator(device="cuda").manual_seed(7)
    b, hq, hkv, d, ps, width = 8, 32, 8, 128, 16, 131072
    lens = [700, 1, 4096, 0, 300, 2500, 129, 1000]
    pages = sum(-(-n // ps) for n in lens) + 3
    dtype = torch.bfloat16
    k = torch.randn(pages, ps, hkv, d, device="cuda", dtype=dtype, generator=g)
    v = torch.randn(pages, ps, hkv, d, device="cuda", dtype=dtype, generator=g)
    scales = {}
    if fp8:
        k, v = k.to(torch.float8_e4m3fn), v.to(torch.float8_e4m3fn)
        scales = {"k_scale": 0.7, "v_scale": 1.3}
    table = torch.randint(0, pages, (b, width // ps), device="cuda", generator=g)
    perm = torch.randperm(pages, device="cuda", generator=g)
    start = 0
    for i, n in enumerate(lens):
        n_pages = -(-n // ps)
        table[i, :n_pages] = perm[start : start + n_pages]
        start += n_pages
    table = table.to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    kw = {}
    if qtokens > 1:
        total = b * qtokens
        q = torch.randn(total, hq, d, device="cuda", dtype=dtype, generator=g)
        cu = torch.arange(0, total + 1, qtokens, dtype=torch.int32, device="cuda")
        kw = {"cu_seqlens_q": cu, "max_seqlen_q": qtokens}
    else:
        q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    out = torch.full_like(q, float("nan"))
    _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out, **scales, **kw)
    cu_q = {"cu_seqlens_q": kw["cu_seqlens_q"]} if kw else {}
    want, want_lse = paged_attention_ref(q, k, v, table, seq, **scales, **cu_q)
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


def test_pdl_chain_is_the_serialized_chain():
    """graphs.assert_pdl_chain_is_serialized: call i + 1's q call i's out, every call's partials
    in the same scratch (b1 x 16k: pass and combine; a pass reading q, or writing the partials,
    before its griddepcontrol.wait, or a combine reading partials before its own, would show)."""
    g = torch.Generator(device="cuda").manual_seed(3)
    rand = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    hq, hkv, d, ps, n = 32, 8, 128, 16, 16384
    k = torch.randn(n // ps + 3, ps, hkv, d, **rand)
    v = torch.randn(n // ps + 3, ps, hkv, d, **rand)
    table = torch.randperm(n // ps + 3, device="cuda", generator=g)[: n // ps].view(1, -1)
    table = table.to(torch.int32)
    seq = torch.tensor([n], dtype=torch.int32, device="cuda")
    q0 = torch.randn(1, hq, d, **rand)
    assert_pdl_chain_is_serialized(
        lambda q, out, _: op.attention_paged(q, k, v, table, seq, out=out), q0
    )


# ---------------------------------------------------------------- a decode step's schedule
# (forgekernel.attention_paged_schedule; PAGED_NOTES.md, "A decode step's schedule"). The CPU
# side (tests/test_paged_schedule.py) replays the algorithms; here the kernels.

SCHEDULE_CASES = [  # b, hq, hkv, d, page_size, lens, table width in pages (None: the longest's)
    (4, 32, 8, 128, 16, [1, 17, 300, 0], None),
    (32, 32, 8, 128, 16, list(range(100, 32 * 170, 170)), 8192),  # the bench's serving mixed
    (32, 32, 8, 128, 16, [64] * 31 + [32768], None),  # a long sequence among short ones
    (3, 8, 8, 64, 16, [5, 0, 513], None),
    (2, 16, 2, 256, 64, [129, 2048], None),
    (2, 24, 8, 128, 32, [77, 700], None),
    (2, 32, 4, 128, 1, [64, 1000], None),
]


def _schedule_problem(case, dtype, seed):
    """Caches with NaN in every slot no sequence owns, a table of `width` pages (-1 past a
    sequence's; the same for every seed: a step's layers share it), queries; the values from
    `seed`."""
    b, hq, hkv, d, ps, lens, width = case
    own = max(1, max(-(-n // ps) for n in lens))
    width = width or own
    pages = b * own + 5
    layout = torch.Generator(device="cuda").manual_seed(1234)
    perm = torch.randperm(pages, device="cuda", generator=layout)[: b * own].view(b, own)
    g = torch.Generator(device="cuda").manual_seed(seed)
    k = torch.randn(pages, ps, hkv, d, device="cuda", generator=g).to(dtype)
    v = torch.randn(pages, ps, hkv, d, device="cuda", generator=g).to(dtype)
    table = torch.full((b, width), -1, dtype=torch.int32, device="cuda")
    owned = torch.zeros(pages, dtype=torch.int64, device="cuda")  # a page's rows of keys
    for s, n in enumerate(lens):
        mine = -(-n // ps)
        table[s, :mine] = perm[s, :mine].int()
        firsts = torch.arange(mine, device="cuda") * ps
        owned[perm[s, :mine]] = (n - firsts).clamp(max=ps)
    stale = torch.arange(ps, device="cuda")[None, :] >= owned[:, None]  # (pages, ps)
    k[stale], v[stale] = float("nan"), float("nan")
    q = torch.randn(b, hq, d, device="cuda", dtype=dtype, generator=g)
    return q, k, v, table, torch.tensor(lens, dtype=torch.int32, device="cuda")


def _check_against_reference(q, k, v, table, seq, out, lse):
    want, want_lse = paged_attention_ref(q, k, v, table.clamp(min=0), seq)
    low, _ = paged_attention_ref(q, k, v, table.clamp(min=0), seq, upcast=False)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=lambda c: f"b{c[0]}_d{c[3]}_L{max(c[5])}")
def test_one_schedule_serves_three_layers(case, dtype):
    """One schedule, three layers' queries and caches (NaN in every slot no sequence owns), NaN
    in out and in the partial scratch before every call: each layer's output the reference's."""
    b, hq, hkv, d, ps, _, _ = case
    _, _, _, table, seq = _schedule_problem(case, dtype, 0)
    schedule = op.attention_paged_schedule(seq, table, num_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, page_size=ps, dtype=dtype)  # fmt: skip
    for layer in range(3):
        q, k, v, _, _ = _schedule_problem(case, dtype, layer)
        items = schedule.work.shape[0] - 1  # the stream's partials scratch (launch._ranged): NaN
        scratch_of = importlib.import_module("forgekernel.runtime.scratch").scratch
        scratch_of("paged.partial_o", (items, 1, hq, d), torch.float32, q.device).fill_(math.nan)
        scratch_of("paged.partial_lse", (items, 1, hq), torch.float32, q.device).fill_(math.nan)
        out = torch.full_like(q, float("nan"))
        _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out,
                                    schedule=schedule)  # fmt: skip
        _check_against_reference(q, k, v, table, seq, out, lse)


def test_schedule_in_a_cuda_graph():
    """A step captured once (the schedule, then two layers' calls), replayed on the serving
    mixed lengths and on two thirds of them empty: the list is remade on the device each replay."""
    case = SCHEDULE_CASES[1]
    b, hq, hkv, d, ps, lens, _ = case
    q, k, v, table, seq = _schedule_problem(case, torch.bfloat16, 0)
    out = torch.empty(2, *q.shape, device="cuda", dtype=q.dtype)
    lse = torch.empty(2, b, hq, device="cuda")

    def step():
        schedule = op.attention_paged_schedule(seq, table, num_heads=hq, num_kv_heads=hkv,
                                               head_dim=d, page_size=ps)  # fmt: skip
        for layer in range(2):
            op.attention_paged(q, k, v, table, seq, out=out[layer], lse=lse[layer],
                               schedule=schedule)  # fmt: skip

    graph = captured(step)
    for now in (lens, [0 if i % 3 else n for i, n in enumerate(lens)]):
        q.copy_(torch.randn_like(q))
        seq.copy_(torch.tensor(now, device="cuda"))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for layer in range(2):
            _check_against_reference(q, k, v, table, seq, out[layer], lse[layer])


def test_pdl_scheduled_chain_is_the_serialized_chain():
    """graphs.assert_pdl_chain_is_serialized with a step's schedule (the serving mixed batch):
    the scheduling kernel, then every call's ranges pass and combine."""
    case = SCHEDULE_CASES[1]
    b, hq, hkv, d, ps, _, _ = case
    q0, k, v, table, seq = _schedule_problem(case, torch.bfloat16, 3)
    assert_pdl_chain_is_serialized(
        lambda q, out, schedule: op.attention_paged(
            q, k, v, table, seq, out=out, schedule=schedule
        ),  # fmt: skip
        q0,
        prologue=lambda: op.attention_paged_schedule(
            seq, table, num_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=ps
        ),  # fmt: skip
    )


@pytest.mark.parametrize("d", [64, 128, 256])
def test_one_item_sequences_are_the_width_plan_bit_for_bit(d):
    """A uniform batch the list gives one item a sequence: the ranges pass writes each final O
    and LSE itself (decode.py `single`) and the ranges combine leaves those rows, so the
    scheduled call is the width plan's one split bit for bit; NaN in the partial scratch (never
    read) and in out."""
    b, hq, hkv = 64, 32, 8
    case = (b, hq, hkv, d, 16, [4096 - 37 * (i % 3) for i in range(b)], None)  # b64 x 4k
    q, k, v, table, seq = _schedule_problem(case, torch.bfloat16, 5)
    plain_out, plain_lse = op.attention_paged(q, k, v, table, seq, return_lse=True)
    schedule = op.attention_paged_schedule(seq, table, num_heads=hq, num_kv_heads=hkv,
                                           head_dim=d, page_size=16)  # fmt: skip
    items = schedule.work.shape[0] - 1
    scratch_of = importlib.import_module("forgekernel.runtime.scratch").scratch
    scratch_of("paged.partial_o", (items, 1, hq, d), torch.float32, q.device).fill_(math.nan)
    scratch_of("paged.partial_lse", (items, 1, hq), torch.float32, q.device).fill_(math.nan)
    out = torch.full_like(q, float("nan"))
    _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out, schedule=schedule)
    rows = schedule.rows.cpu()
    if not bool((rows[:, 1] == 1).all()):
        pytest.skip("the list split a sequence of this batch: not the one-item case")
    assert torch.equal(out, plain_out) and torch.equal(lse, plain_lse)


RAMP_CASES = [  # the b1 bench case's shape, a ragged batch behind a wide table, a few splits
    (1, 32, 8, 128, 16, [16384], None),
    SCHEDULE_CASES[1],
    SCHEDULE_CASES[0],
    (4, 32, 8, 128, 16, [32768, 32768, 32768, 32767], None),
    (3, 8, 8, 64, 16, [5, 0, 513], 4096),
]


@pytest.mark.parametrize("case", RAMP_CASES, ids=lambda c: f"b{c[0]}_d{c[3]}_L{max(c[5])}")
@pytest.mark.parametrize("scheduled", [False, True])
def test_serial_ramp_is_the_same_bits(case, scheduled):
    """`launch.serial_ramp()` (the bench's variant: the pass's page ids read after the length,
    no L2 prefetch before the PDL wait, the CTA combine's rows loaded after its reductions)
    gives the default call's bits: the early reads move when bytes arrive, not what is added
    (the held combine adds each group's splits in the walk's order, + 0 past the last with
    keys). NaN in every stale slot, -1 past each sequence's pages (the guess's clamped
    prefetches, its ids kept only for a split of the sequence's own); the reference too."""
    from forgekernel.kernels.attention.paged.sm90 import launch

    b, hq, hkv, d, ps, _, _ = case
    q, k, v, table, seq = _schedule_problem(case, torch.bfloat16, 5)
    kw = {}
    if scheduled:
        kw["schedule"] = op.attention_paged_schedule(seq, table, num_heads=hq, num_kv_heads=hkv,
                                                     head_dim=d, page_size=ps)  # fmt: skip
    outs = []
    for serial in (False, True):
        out = torch.full_like(q, float("nan"))
        if serial:
            with launch.serial_ramp():
                _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out, **kw)
        else:
            _, lse = op.attention_paged(q, k, v, table, seq, return_lse=True, out=out, **kw)
        outs.append((out, lse))
    _check_against_reference(q, k, v, table, seq, *outs[0])
    assert torch.equal(outs[0][0], outs[1][0])
    assert torch.equal(outs[0][1], outs[1][1])
