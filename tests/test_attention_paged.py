"""Paged GQA decode on the CPU (the GPU's checks: tests/gpu/test_paged_gpu.py): the split
plan and heads per CTA; the kernels' algorithm (split ranges, the warps' quarters, the online
softmax in log2 units, the warp merge and the split combine) replayed in Python through the
real launcher and op against the fp32 reference; argument errors."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from split_combine import combine_splits

from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
from forgekernel.kernels.attention.paged.sm90.config import (
    HEADS,
    MIN_TOKENS_PER_SPLIT,
    RESIDENT,
    RESIDENT_FP8,
    ROWS,
    TILE,
    WARPS,
    heads_per_cta,
    split_plan,
)
from forgekernel.kernels.attention.paged.sm90.rows import MAX_ROWS, heads_for, row_cap
from forgekernel.reference.paged_attention import paged_attention_ref

op_module = importlib.import_module("forgekernel.ops.attention_paged")
UNROLL = 4


@pytest.mark.parametrize(
    ("group", "qtokens", "want"),
    [(4, 1, 4), (8, 1, 8), (16, 1, 16), (16, 2, 8), (3, 1, 1), (6, 1, 2), (32, 1, 16), (8, 4, 4)],
)
def test_heads_per_cta(group, qtokens, want):
    h = heads_per_cta(group, qtokens)
    assert h == want and group % h == 0 and h in HEADS and h * qtokens <= ROWS


@pytest.mark.parametrize(
    ("group", "qtokens", "want"),
    [(8, 4, 8), (16, 2, 16), (16, 4, 8), (8, 2, 8), (4, 4, 4), (16, 1, 16), (32, 1, 16),
     (3, 4, 1), (6, 4, 2)],
)  # fmt: skip
def test_heads_per_cta_with_two_row_blocks(group, qtokens, want):
    """Up to 32 (token, head) rows a CTA: every head of a KV head in one CTA at GQA 8 x 4
    tokens and GQA 16 x 2 (one K / V stream a KV head, not two)."""
    h = heads_for(group, qtokens, 128)
    assert h == want and group % h == 0 and h in HEADS and h * qtokens <= MAX_ROWS


def test_row_cap():
    """Two row blocks on 16-bit caches at D 64 / 128 only: O at D 256 would be 256 registers a
    thread; the FP8 pass's registers are capped for RESIDENT_FP8 CTAs."""
    assert [row_cap(d) for d in (64, 128, 256)] == [MAX_ROWS, MAX_ROWS, ROWS]
    assert {row_cap(d, "float8_e4m3fn") for d in (64, 128, 256)} == {ROWS}


@pytest.mark.parametrize(("b", "blocks", "tokens"), [(1, 8, 16384), (64, 8, 4096), (3, 1, 17),
                                                     (1, 1, 1), (256, 32, 65536)])  # fmt: skip
@pytest.mark.parametrize("resident", [1, 2, 3])
def test_split_plan_covers_every_token(b, blocks, tokens, resident):
    splits, per = split_plan(b, blocks, tokens, 132, resident)
    assert splits >= 1 and per >= 1 and splits * per >= tokens and (splits - 1) * per < tokens
    if splits < -(-tokens // 256):
        ctas, slots = b * blocks * splits, 132 * resident
        assert ctas / slots / -(-ctas // slots) >= 0.9  # the last wave filled


def _partial(q, k, v, pt, seq, op, lp, scale_log2, per, page_size, group, ks, vs, cu, causal,
             heads, qtokens=1):  # fmt: skip
    """The partial kernel's algorithm (decode.py): the split's keys in tiles of TILE, warp w
    taking keys 16w .. 16w + 15 of every tile with its own online softmax (a tile's 16 scores
    at once, scaled inside the exponent, an FP8 cache's K scale with it), P rounded to q's
    dtype (an FP8 cache: f16, its P V runs in f16), the warps merged at the end (V's scale on
    O first)."""
    _, hq, d = q.shape
    keys = TILE // WARPS
    for b in range(seq.shape[0]):
        q_off, sq = (b, 1) if cu is None else (int(cu[b]), int(cu[b + 1] - cu[b]))
        sk = int(seq[b])
        for hb in range(hq // heads):
            h0 = hb * heads
            kvh = h0 // group
            rows = [(i, h) for i in range(qtokens) for h in range(heads)]
            qs = torch.stack([q[q_off + min(i, sq - 1), h0 + h] for i, h in rows]).double()
            exp_scale = scale_log2 * (1.0 if ks is None else float(ks[kvh]))
            p_type = q.dtype if ks is None else torch.float16
            per_b = max(per, -(-sk // op.shape[0]))  # the sequence's keys over the splits
            for s in range(op.shape[0]):
                t0 = s * per_b
                t1 = min(t0 + per_b, sk)
                limit = torch.tensor(
                    [(min(t1, sk - sq + i + 1) if causal else t1) if i < sq else 0 for i, _ in rows]
                )
                ms, ls, os_ = [], [], []
                for w in range(WARPS):
                    m = torch.full((len(rows),), -math.inf, dtype=torch.float64)
                    lsum = torch.zeros(len(rows), dtype=torch.float64)
                    o = torch.zeros(len(rows), d, dtype=torch.float64)
                    for first in range(t0 + w * keys, max(t1, t0), TILE):
                        ts = [min(t, t1 - 1) for t in range(first, first + keys)]
                        pages = [int(pt[b, t // page_size]) for t in ts]
                        kt = torch.stack([k[pg, t % page_size, kvh] for pg, t in zip(pages, ts)])
                        vt = torch.stack([v[pg, t % page_size, kvh] for pg, t in zip(pages, ts)])
                        sc = qs @ kt.double().T
                        key = torch.arange(first, first + keys)
                        sc = torch.where(key[None, :] < limit[:, None], sc, -math.inf)
                        m_new = torch.maximum(m, sc.max(1).values)
                        base = torch.where(m_new > -math.inf, m_new * exp_scale, 0.0)
                        corr = torch.exp2(m * exp_scale - base)
                        p = torch.exp2(sc * exp_scale - base[:, None])
                        lsum = lsum * corr + p.sum(1)
                        o = o * corr[:, None] + p.to(p_type).double() @ vt.double()
                        m = m_new
                    if vs is not None:
                        o = o * float(vs[kvh])
                    ms.append(torch.where(m > -math.inf, m * exp_scale, -math.inf))
                    ls.append(lsum), os_.append(o)
                top = torch.stack(ms).max(0).values
                c = torch.where(top > -math.inf, torch.exp2(torch.stack(ms) - top), 0.0)
                total = (torch.stack(ls) * c).sum(0)
                acc = (torch.stack(os_) * c[..., None]).sum(0)
                for r, (i, h) in enumerate(rows):
                    if i < sq:
                        ok = bool(total[r] > 0)
                        op[s, q_off + i, h0 + h] = acc[r] / total[r] if ok else 0.0
                        lp[s, q_off + i, h0 + h] = top[r] + torch.log2(total[r]) if ok else (
                            -math.inf
                        )  # fmt: skip


def _written_rows(seq, cu, qtokens) -> list[int]:
    """The rows a pass writes (combine.write_split): each sequence's tokens below both its
    query length and the kernel's query tokens."""
    if cu is None:
        return list(range(seq.shape[0]))
    return [int(cu[b]) + i for b in range(seq.shape[0])
            for i in range(min(int(cu[b + 1] - cu[b]), qtokens))]  # fmt: skip


def install_cpu_decode(monkeypatch) -> list:
    """The paged decode's kernels replaced by their CPU stand-ins (`_partial`, the combine);
    returns the list the partial pass's calls are recorded in. One split (direct) writes only
    the rows the pass writes (`_written_rows`), as the kernel; a combine writes every row."""
    calls = []

    def get_kernel(spec, params):
        p = dict(params)
        if p["kind"] == "combine":  # the CTA or the warp form (called alike)
            return lambda *a: combine_splits(*a)

        def partial(*args):
            q, k, v, pt, seq, op, lp, out, lse, direct, *rest = args
            calls.append((p, tuple(rest[:4]), direct))
            qtokens = p.get("qtokens", 1)
            if direct:  # one split: the pass writes out and lse itself
                op = torch.empty(1, *out.shape, dtype=torch.float32)
                lp = torch.empty(1, *out.shape[:2], dtype=torch.float32)
            _partial(q, k, v, pt, seq, op, lp, *rest, heads=p["heads"], qtokens=qtokens)
            if direct:
                o, ls = torch.empty_like(out), torch.empty(out.shape[:2])
                combine_splits(op, lp, o, ls)
                rows = _written_rows(seq, rest[-2], qtokens)
                out[rows], lse[rows] = o[rows], ls[rows]

        return partial

    paged_launch._plans.clear()  # plans hold the kernels they looked up
    monkeypatch.setattr(paged_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(paged_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    return calls


@pytest.fixture
def cpu_kernels(monkeypatch):
    yield install_cpu_decode(monkeypatch)
    paged_launch._plans.clear()


def _problem(b, hq, hkv, d, page_size, lens, pages_extra=3, seed=0, combined=False, fp8=False):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(-(-n // page_size) for n in lens))
    pages = b * max_pages + pages_extra
    shape = (pages, 2, page_size, hkv, d) if combined else (pages, page_size, hkv, d)
    cache = torch.float8_e4m3fn if fp8 else torch.bfloat16
    k = torch.randn(*shape, generator=g).to(cache)
    v = None if combined else torch.randn(*shape, generator=g).to(cache)
    perm = torch.randperm(pages, generator=g)[: b * max_pages].view(b, max_pages)
    q = torch.randn(b, hq, d, generator=g).to(torch.bfloat16)
    seq = torch.tensor(lens, dtype=torch.int32)
    return q, k, v, perm.to(torch.int32), seq


@pytest.mark.parametrize(
    ("b", "hq", "hkv", "d", "page_size", "lens", "combined"),
    [
        (3, 8, 2, 64, 16, [37, 0, 100], False),
        (2, 12, 4, 128, 1, [5, 70], False),
        (1, 16, 2, 256, 64, [300], True),
        (2, 4, 4, 128, 32, [1, 33], False),
    ],
)
def test_decode_algorithm_matches_the_reference(cpu_kernels, b, hq, hkv, d, page_size, lens,
                                                combined):  # fmt: skip
    q, k, v, pt, seq = _problem(b, hq, hkv, d, page_size, lens, combined=combined)
    out, lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True)
    kk, vv = (k[:, 0], k[:, 1]) if combined else (k, v)
    want, want_lse = paged_attention_ref(q, kk, vv, pt, seq)
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    assert torch.all(out[~finite] == 0)
    (params, (scale_log2, per, ps, group), _) = cpu_kernels[-1]
    assert (
        ps == page_size
        and group == hq // hkv
        and abs(scale_log2 - d**-0.5 * math.log2(math.e)) < 1e-6
    )


@pytest.mark.parametrize("packed", [False, True])
def test_lse_is_written_in_place(cpu_kernels, packed):
    """A NaN-poisoned lse= is the returned LSE ((batch, Hq); packed (Hq, total_q)); a strided
    one gets the result copied in."""
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    want, want_lse = paged_attention_ref(q, k, v, pt, seq)
    kw = {}
    if packed:
        want_lse = want_lse.t()
        kw = {"cu_seqlens_q": torch.tensor([0, 1, 2, 3], dtype=torch.int32), "max_seqlen_q": 1}
    finite = torch.isfinite(want_lse)
    for lse in (torch.full_like(want_lse, float("nan")),
                torch.full((*want_lse.shape, 2), float("nan"))[..., 1]):  # fmt: skip
        out, got = op_module.attention_paged(q, k, v, pt, seq, return_lse=True, lse=lse, **kw)
        assert got is lse and float((out.float() - want).abs().max()) < 2e-2
        assert torch.equal(finite, torch.isfinite(lse))
        assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4


@pytest.mark.parametrize("per_head", [False, True])
def test_fp8_cache_scales(cpu_kernels, per_head):
    q, k, v, pt, seq = _problem(2, 8, 2, 128, 16, [40, 90], fp8=True)
    ks = torch.tensor([0.5, 2.0]) if per_head else 0.75
    vs = torch.tensor([1.5, 0.25]) if per_head else 1.25
    out, lse = op_module.attention_paged(q, k, v, pt, seq, return_lse=True, k_scale=ks,
                                         v_scale=vs)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, pt, seq, k_scale=ks, v_scale=vs)
    assert float((out.float() - want).abs().max()) < 2e-2
    assert float((lse - want_lse).abs().max()) < 1e-4
    with pytest.raises(ValueError, match="needs k_scale"):
        op_module.attention_paged(q, k, v, pt, seq)


@pytest.mark.parametrize("lens", [[700] * 16, [3000, 40, 0, 700] * 4])
def test_a_wide_table_spreads_each_sequence_over_the_splits(cpu_kernels, lens):
    """A table sized for a long context (serving engines capture graphs so: 65536 tokens here)
    around short sequences: the plan's splits come from the width (per: thousands of keys a
    split), each sequence's keys are spread over them by its own length, never under
    MIN_TOKENS_PER_SPLIT a split: a 700-key sequence takes 3 splits, not 1."""
    b, hq, hkv, d, ps, width = len(lens), 8, 2, 64, 16, 65536
    q, k, v, pt, seq = _problem(b, hq, hkv, d, ps, lens)
    wide = pt[:, :1].expand(b, width // ps).contiguous()
    wide[:, : pt.shape[1]] = pt
    out, lse = op_module.attention_paged(q, k, v, wide, seq, return_lse=True)
    want, want_lse = paged_attention_ref(q, k, v, pt, seq)
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    params, (_, least, _, _), direct = cpu_kernels[-1]
    splits, per = split_plan(b, hq // params["heads"], width, 132, RESIDENT[d])
    assert not direct and least == MIN_TOKENS_PER_SPLIT and per > 700
    per_b = max(least, -(-700 // splits))
    assert -(-700 // per_b) == 3  # the width's per would give it 1 split


@pytest.mark.parametrize(("b", "d", "tokens"), [(64, 128, 4096), (1, 128, 32768), (4, 64, 9000),
                                                 (2, 256, 3000)])  # fmt: skip
def test_fp8_plan_fills_the_fp8_residency(cpu_kernels, b, d, tokens):
    """An FP8 cache's CTAs are smaller (byte tiles): its split plan fills RESIDENT_FP8 CTAs
    per SM, a 16-bit cache's RESIDENT."""
    hq, hkv, ps = 8, 2, 16
    for fp8 in (False, True):
        q, k, v, pt, seq = _problem(b, hq, hkv, d, ps, [5] * b, fp8=fp8)
        pt = pt[:, :1].expand(b, -(-tokens // ps))  # the plan bounds lengths by the table
        scales = {"k_scale": 0.5, "v_scale": 2.0} if fp8 else {}
        op_module.attention_paged(q, k, v, pt, seq, **scales)
        params, (_, per, _, _), direct = cpu_kernels[-1]
        resident = (RESIDENT_FP8 if fp8 else RESIDENT)[d]
        splits, want_per = split_plan(b, hq // params["heads"], pt.shape[1] * ps, 132, resident)
        want_least = want_per if splits == 1 else MIN_TOKENS_PER_SPLIT
        assert per == want_least and bool(direct) == (splits == 1)
        assert (params.get("kv") == "float8_e4m3fn") == fp8


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"q": torch.zeros(2, 8, 96, dtype=torch.bfloat16)}, ValueError, "k_cache .* must both"),
        ({"page_table": torch.zeros(2, 4, dtype=torch.int64)}, TypeError, "page_table must have"),
        ({"seqlens_k": torch.zeros(3, dtype=torch.int32)}, ValueError, "seqlens_k must have"),
        ({"cu_seqlens_q": torch.zeros(3, dtype=torch.int32)}, ValueError, "come together"),
        ({"q": torch.zeros(2, 6, 128, dtype=torch.bfloat16)}, ValueError, "multiple of KV"),
        ({"lse": torch.zeros(8, 2)}, ValueError, r"lse must have shape \(2, 8\)"),
        ({"lse": torch.zeros(2, 8, dtype=torch.float16)}, TypeError, "lse must have dtype"),
    ],
)
def test_bad_arguments(kwargs, err, match):
    args = {
        "q": torch.zeros(2, 8, 128, dtype=torch.bfloat16),
        "k": torch.zeros(10, 16, 4, 128, dtype=torch.bfloat16),
        "v": torch.zeros(10, 16, 4, 128, dtype=torch.bfloat16),
        "page_table": torch.zeros(2, 4, dtype=torch.int32),
        "seqlens_k": torch.zeros(2, dtype=torch.int32),
    }
    extra = {k_: kwargs.pop(k_) for k_ in ("cu_seqlens_q", "lse") if k_ in kwargs}
    args.update(kwargs)
    with pytest.raises(err, match=match):
        op_module.attention_paged(args["q"], args["k"], args["v"], args["page_table"],
                                  args["seqlens_k"], **extra)  # fmt: skip


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"softmax_scale": float("nan")}, ValueError, "softmax_scale must be finite and >= 0"),
        ({"softmax_scale": -0.1}, ValueError, "softmax_scale must be finite and >= 0"),
        ({"softmax_scale": "0.1"}, TypeError, "softmax_scale must be a float or None"),
        ({"causal": 1}, TypeError, "causal must be a bool"),
        ({"k_scale": 0.5}, ValueError, "k_scale / v_scale dequantize an FP8 cache"),
        ({"v_scale": torch.ones(2)}, ValueError, "this cache is torch.bfloat16"),
        ({"k_scale": 1.0, "v_scale": 2}, ValueError, "k_scale / v_scale dequantize"),
    ],
)
def test_bad_scalars_raise_before_any_kernel(cpu_kernels, kwargs, err, match):
    """The audit of 2026-12-05: a NaN / negative / string scale reached the kernel (or float()'s
    message), and k_scale / v_scale on a 16-bit cache were ignored where the reference (and
    FlashInfer) apply them."""
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    with pytest.raises(err, match=match):
        op_module.attention_paged(q, k, v, pt, seq, **kwargs)
    assert not cpu_kernels


def test_unit_scales_on_a_16_bit_cache_run(cpu_kernels):
    """k_scale = v_scale = 1.0 on a 16-bit cache (what a serving engine's layer passes by
    default) changes nothing: accepted, the result the unscaled call's."""
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    want = op_module.attention_paged(q, k, v, pt, seq)
    got = op_module.attention_paged(q, k, v, pt, seq, k_scale=1.0, v_scale=1)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        (lambda c: c.update(indptr=c["indptr"].long()), TypeError, "kv_indptr must have dtype"),
        (lambda c: c.update(indices=c["indices"].float()), TypeError, "kv_indices must have"),
        (lambda c: c.update(indptr=c["indptr"][None]), ValueError, "kv_indptr must be 1-D"),
        (lambda c: c.update(last=c["last"][:2]), ValueError, "kv_last_page_len must have shape"),
        (lambda c: c.update(max_pages=7.0), TypeError, "max_pages must be an int"),
        (lambda c: c.update(max_pages=-1), ValueError, "max_pages must be >= 0"),
    ],
)
def test_csr_lists_are_checked_without_validate(cpu_kernels, change, err, match):
    """The lists' dtypes, ranks and lengths cost no device read: checked on every call (a
    float or 2-D kv_indptr was cast or sliced into a wrong page table before)."""
    from forgekernel.reference.flashinfer_paged import page_table_to_csr

    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    indptr, indices, last = page_table_to_csr(pt, seq, 16)
    c = {"indptr": indptr, "indices": indices, "last": last, "max_pages": pt.shape[1]}
    change(c)
    with pytest.raises(err, match=match):
        op_module.attention_paged_csr(q, k, v, c["indptr"], c["indices"], c["last"],
                                      max_pages=c["max_pages"])  # fmt: skip
    assert not cpu_kernels


@pytest.mark.parametrize("hq", [8, 16, 32])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("q_lens", "k_lens"), [([1, 3, 2], [40, 3, 70]), ([4, 4], [4, 130]),
                                                ([2, 1, 4], [0, 17, 2]),
                                                ([1, 1, 1], [9, 0, 300])])  # fmt: skip
def test_speculative_decoding(cpu_kernels, causal, q_lens, k_lens, hq):
    """GQA 4 / 8 / 16 (two KV heads): at 8 x 4 tokens and 16 x 2 the CTA takes 32 rows."""
    b = len(q_lens)
    q, k, v, pt, seq = _problem(b, hq, 2, 64, 16, k_lens)
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qq = torch.randn(int(cu[-1]), hq, 64, generator=g).to(torch.bfloat16)
    out, lse = op_module.attention_paged(qq, k, v, pt, seq, cu_seqlens_q=cu,
                                         max_seqlen_q=max(q_lens), causal=causal,
                                         return_lse=True)  # fmt: skip
    want, want_lse = paged_attention_ref(qq, k, v, pt, seq, cu_seqlens_q=cu, causal=causal)
    assert out.shape == qq.shape and lse.shape == (hq, qq.shape[0])
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    params = cpu_kernels[-1][0]
    # the packed form takes a kernel built for cu_seqlens_q: 2 tokens or more
    qtokens = next(t for t in (2, 4) if t >= max(q_lens))
    assert params.get("qtokens", 1) == qtokens
    # one CTA a KV head while its heads x tokens fit two row blocks
    assert params["heads"] == min(hq // 2, MAX_ROWS // qtokens, max(HEADS))


@pytest.mark.parametrize(("fp8", "page_size"), [(True, 16), (False, 1)])
def test_chunked_prefill_gathers_into_the_varlen_forward(monkeypatch, fp8, page_size):
    """More than 4 query tokens where the forward's paged mode does not reach (an FP8 cache,
    pages of 1; the paged mode: tests/test_attention_paged_prefill.py): the pages gathered
    into packed K / V and the varlen forward (here its reference, standing in for the GPU
    kernel)."""
    from forgekernel.reference.attention import attention_varlen_ref

    def varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse, out):
        o, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal,
                                      softmax_scale=softmax_scale)  # fmt: skip
        return o.to(q.dtype), lse

    monkeypatch.setattr(op_module, "_attention_varlen", varlen)
    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    q_lens, k_lens = [5, 0, 9, 1], [40, 0, 9, 70]
    _, k, v, pt, seq = _problem(4, 8, 2, 64, page_size, k_lens, fp8=fp8)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qq = torch.randn(int(cu[-1]), 8, 64, generator=torch.Generator().manual_seed(5))
    qq = qq.to(torch.bfloat16)
    scales = {"k_scale": 0.5, "v_scale": 1.5} if fp8 else {}
    out, lse = op_module.attention_paged(qq, k, v, pt, seq, cu_seqlens_q=cu, max_seqlen_q=9,
                                         return_lse=True, **scales)  # fmt: skip
    want, want_lse = paged_attention_ref(qq, k, v, pt, seq, cu_seqlens_q=cu, **scales)
    assert out.shape == qq.shape and lse.shape == (8, qq.shape[0])
    assert float((out.float() - want).abs().max()) < 3e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


@pytest.mark.parametrize("page_size", [1, 16])
def test_flashinfer_csr_form(cpu_kernels, page_size):
    from forgekernel.reference.flashinfer_paged import page_table_to_csr

    q, k, v, pt, seq = _problem(3, 8, 2, 64, page_size, [37, 0, 100])
    indptr, indices, last = page_table_to_csr(pt, seq, page_size)
    table, lens = op_module.csr_page_table(
        indptr, indices, None if page_size == 1 else last, page_size, pt.shape[1]
    )
    assert torch.equal(lens, seq)
    for b, n in enumerate(seq.tolist()):
        pages = -(-n // page_size)
        assert torch.equal(table[b, :pages], pt[b, :pages])
    out = op_module.attention_paged_csr(q, k, v, indptr, indices,
                                        None if page_size == 1 else last,
                                        max_pages=pt.shape[1])  # fmt: skip
    want, _ = paged_attention_ref(q, k, v, pt, seq)
    assert float((out.float() - want).abs().max()) < 2e-2


def _bad_values(kind):
    """A valid batch (lengths [37, 0, 100], pages of 16) with one value broken by `kind`."""
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    cu = None
    if kind == "page":
        pt[2, 6] = k.shape[0]  # the last page of sequence 2 (100 tokens: 7 pages)
    elif kind == "negative page":
        pt[0, 1] = -1
    elif kind == "length":
        seq[1] = pt.shape[1] * 16 + 1
    elif kind == "negative length":
        seq[0] = -3
    elif kind.startswith("cu"):
        q = torch.randn(9, 8, 64).to(torch.bfloat16)
        cu = {"cu start": [1, 2, 5, 9], "cu order": [0, 4, 2, 9], "cu end": [0, 2, 5, 8],
              "cu long": [0, 1, 2, 9]}[kind]  # fmt: skip
        cu = torch.tensor(cu, dtype=torch.int32)
    return q, k, v, pt, seq, cu


@pytest.mark.parametrize(
    ("kind", "match"),
    [
        ("page", r"page_table\[2, 6\] = 24 is outside \[0, 24\)"),
        ("negative page", r"page_table\[0, 1\] = -1 is outside"),
        ("length", r"seqlens_k\[1\] = 113 is outside \[0, 112\]"),
        ("negative length", r"seqlens_k\[0\] = -3"),
        ("cu start", "cu_seqlens_q must start at 0"),
        ("cu order", r"cu_seqlens_q must be non-decreasing, got cu_seqlens_q\[2\] = 2 after 4"),
        ("cu end", r"cu_seqlens_q must end at 9 \(q's rows\), got 8"),
        ("cu long", "sequence 2 7 query tokens, more than max_seqlen_q = 4"),
    ],
)
def test_validate_names_the_bad_value(cpu_kernels, kind, match):
    """validate=True (issue 18): values that would read outside the cache or misread the
    batch raise before any kernel; off by default (the values are not read)."""
    q, k, v, pt, seq, cu = _bad_values(kind)
    packed = {} if cu is None else {"cu_seqlens_q": cu, "max_seqlen_q": 4}
    with pytest.raises(ValueError, match=match):
        op_module.attention_paged(q, k, v, pt, seq, validate=True, **packed)
    assert not cpu_kernels


def test_validate_passes_a_good_batch_unchanged(cpu_kernels):
    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    pt[1] = -1  # an empty sequence's entries are never read
    pt[0, 3:] = 10**6  # nor those past a sequence's pages
    out = op_module.attention_paged(q, k, v, pt, seq, validate=True)
    assert torch.equal(out, op_module.attention_paged(q, k, v, pt, seq))
    want, _ = paged_attention_ref(q, k, v, pt.clamp(0, k.shape[0] - 1), seq)
    assert float((out.float() - want).abs().max()) < 2e-2


@pytest.mark.parametrize(
    ("change", "match"),
    [
        (lambda c: c["indptr"].__setitem__(0, 1), "kv_indptr must start at 0"),
        (lambda c: c["indptr"].__setitem__(2, 0), "kv_indptr must be non-decreasing"),
        (lambda c: c.update(indices=c["indices"][:-1]), "kv_indptr must end at most 9 .*got 10"),
        (lambda c: c["indices"].__setitem__(4, 24), r"kv_indices\[4\] = 24 is outside \[0, 24\)"),
        (lambda c: c.update(max_pages=6), "sequence 2 7 pages, more than max_pages = 6"),
        (lambda c: c["last"].__setitem__(2, 17), r"kv_last_page_len\[2\] = 17 is outside"),
        (lambda c: c["last"].__setitem__(0, 0), r"kv_last_page_len\[0\] = 0"),
        (lambda c: c.update(last=c["last"][:2]), "kv_last_page_len must have shape"),
    ],
)
def test_csr_validate_names_the_bad_value(cpu_kernels, change, match):
    from forgekernel.reference.flashinfer_paged import page_table_to_csr

    q, k, v, pt, seq = _problem(3, 8, 2, 64, 16, [37, 0, 100])
    indptr, indices, last = page_table_to_csr(pt, seq, 16)
    c = {"indptr": indptr, "indices": indices, "last": last, "max_pages": pt.shape[1]}
    out = op_module.attention_paged_csr(q, k, v, indptr, indices, last, max_pages=pt.shape[1],
                                        validate=True)  # fmt: skip
    want, _ = paged_attention_ref(q, k, v, pt, seq)
    assert float((out.float() - want).abs().max()) < 2e-2
    change(c)
    calls = len(cpu_kernels)
    with pytest.raises(ValueError, match=match):
        op_module.attention_paged_csr(q, k, v, c["indptr"], c["indices"], c["last"],
                                      max_pages=c["max_pages"], validate=True)  # fmt: skip
    assert len(cpu_kernels) == calls


def test_csr_page_table_with_no_pages():
    indptr = torch.zeros(4, dtype=torch.int32)
    table, lens = op_module.csr_page_table(indptr, torch.zeros(0, dtype=torch.int32), None, 16, 2)
    assert table.shape == (3, 2) and not table.any() and not lens.any()


def test_float_scales_are_made_once():
    """A python-float FP8 scale becomes a (Hkv,) tensor once per value, not a fill per call."""
    a = op_module._scale_tensor("k_scale", 0.75, 8, "cpu")
    b = op_module._scale_tensor("k_scale", 0.75, 8, "cpu")
    assert a is b and a.shape == (8,) and torch.all(a == 0.75)
    assert op_module._scale_tensor("k_scale", 0.5, 8, "cpu") is not a


def test_float_scales_of_a_traced_call_are_not_cached():
    """The 2026-12-05 audit: a traced call (fake tensors: torch.compile, make_fx) cached its
    fake (Hkv,) scale, which the next eager call of that scale then took."""
    from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode

    op_module._CONSTANT_SCALES.clear()
    with FakeTensorMode():
        fake = op_module._scale_tensor("k_scale", 0.625, 4, "cpu")
    assert isinstance(fake, FakeTensor) and not op_module._CONSTANT_SCALES
    real = op_module._scale_tensor("k_scale", 0.625, 4, "cpu")
    assert not isinstance(real, FakeTensor) and torch.all(real == 0.625)


@pytest.mark.parametrize("d", [64, 128])
def test_two_row_blocks_fragments(d):
    """The 32-row pass's register facts, traced through the DSL's mma.sync m16n8k16 partitions
    for every lane: a thread's score rows are r, r + 8, r + 16, r + 24 (4 row statistics), P's
    registers are the A operand's (row, key) of both row blocks, and `_pv_in_pieces`' views of
    piece j (V_COLS columns), O's accumulator and V's B operand, are the whole tile's registers
    j x piece .. (j + 1) x piece - 1 holding the same rows and columns shifted by j x V_COLS."""
    cute = pytest.importorskip("cutlass.cute")
    import cutlass
    from cutlass.cute.nvgpu import warp

    from forgekernel.kernels.attention.paged.sm90.decode import KEYS, V_COLS
    from forgekernel.kernels.common.sm90.layout import acc_as_operand_a, rows_cols
    from forgekernel.kernels.common.sm90.warp_mma import as_wide_acc

    got = {}

    @cute.jit
    def trace():
        op = warp.MmaF16BF16Op(cutlass.BFloat16, cutlass.Float32, (16, 8, 16))
        mma = cute.make_tiled_mma(op, (1, 1, 1))
        for lane in cutlass.range_constexpr(32):
            thr = mma.get_slice(lane)
            full = thr.partition_C(cute.make_identity_tensor((MAX_ROWS, d)))
            piece = thr.partition_C(cute.make_identity_tensor((MAX_ROWS, V_COLS)))
            scores = cute.make_identity_tensor((MAX_ROWS, KEYS))
            s = rows_cols(as_wide_acc(thr.partition_C(scores)))
            # P as the A operand (`acc_to_operand_a`: element i of this view into A's i)
            p_src = acc_as_operand_a(as_wide_acc(thr.partition_C(scores)))
            a = thr.partition_A(scores)
            o, p, rows = [], [], []
            for i in cutlass.range_constexpr(cute.size(full)):
                o.append(full[i])
            for i in cutlass.range_constexpr(cute.size(piece)):
                p.append(piece[i])
            for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
                rows.append(s[r, 0][0])
            pa = [(p_src[i], a[i]) for i in range(cute.size(a))]
            # V's B operand: the whole tile's registers, piece j's view j x 16 .. (`tOrV_j`)
            v_full = thr.partition_B(cute.make_identity_tensor((d, KEYS)))
            v_piece = thr.partition_B(cute.make_identity_tensor((V_COLS, KEYS)))
            vs = ([v_full[i] for i in range(cute.size(v_full))],
                  [v_piece[i] for i in range(cute.size(v_piece))])  # fmt: skip
            got[lane] = (o, p, rows, pa, vs)

    cute.compile(trace)
    assert len(got) == 32
    for lane, (o, p, rows, pa, (v_full, v_piece)) in got.items():
        assert rows == [lane // 4 + 8 * i for i in range(MAX_ROWS // 8)]
        # each P register lands where the MMA reads that (row, key), both row blocks
        assert len(pa) == MAX_ROWS * KEYS // 32 and all(s == a for s, a in pa)
        nv = len(v_piece)
        assert len(v_full) == nv * (d // V_COLS)
        for j in range(d // V_COLS):
            assert v_full[j * nv : (j + 1) * nv] == [(c + j * V_COLS, k) for c, k in v_piece]
        n = len(o) // (d // V_COLS)  # `_pv_in_pieces`' piece size
        assert len(p) == n and len(o) == MAX_ROWS * d // 32
        for j in range(d // V_COLS):
            assert o[j * n : (j + 1) * n] == [(r, c + j * V_COLS) for r, c in p]


# CI: 32 rows at both head dims (the two row blocks the failures were in) and 16 at D 64; 16 rows
# at D 128 is slow (a compile, ~2 s of an idle CPU, 2026-12-07)
@pytest.mark.parametrize(
    ("d", "heads", "qtokens"),
    [(64, 8, 4), (128, 16, 2), (64, 4, 4), pytest.param(128, 4, 4, marks=pytest.mark.slow)],
)
def test_shared_addresses_in_the_ptx(tmp_path, d, heads, qtokens):
    """Every lane's V ldmatrix (transposed, one per 8 columns of O) reads key row lane % 16 of
    its warp's slice, 16-byte chunk n XOR-swizzled by the row; Q's ldmatrix its rows of each
    16-row block; the merge's O stores its rows: off the compiled PTX, 32 rows as 16. The
    2026-12-02 13:49 GPU failures of 32 rows: pieces cut by `local_tile` of the swizzled view
    read every piece past the first 64 bytes off (the DSL put the piece's offset in the pointer
    and inside the swizzle), which no layout trace shows."""
    pytest.importorskip("cutlass.cute")
    from paged_ptx import shared_addresses

    from forgekernel.kernels.attention.paged.sm90.compile import compile_paged

    params = {"kind": "partial", "dtype": "bfloat16", "head_dim": d, "heads": heads,
              "qtokens": qtokens}  # fmt: skip
    compile_paged(params, extra_options=f"--keep-ptx --dump-dir {tmp_path}")
    (ptx,) = [p.read_text() for p in tmp_path.glob("*.ptx")]
    trans = "ldmatrix.sync.aligned.m8n8.x4.trans"
    got = [shared_addresses(ptx, lane, trans) for lane in range(32)]
    origin = got[0][0]
    for lane, addrs in enumerate(got):
        row = lane % 16
        want = [2 * (row * d + _chunk(n, row)) for n in range(d // 8)]
        assert [a - origin for a in addrs] == want, lane
    # Q's (A operand) of every 16-row block: rows 16 m + lane % 16, chunk 2 k + lane // 16, k
    # outer, m inner (the shared memory past the K / V buffers: the largest addresses)
    blocks = -(-heads * qtokens // 16)
    plain = [shared_addresses(ptx, lane, "ldmatrix.sync.aligned.m8n8.x4.shared") for lane in
             range(32)]  # fmt: skip
    q0 = plain[0][0]
    for lane, addrs in enumerate(plain):
        want = [2 * ((16 * m + lane % 16) * d + _chunk(2 * k + lane // 16, lane % 16))
                for k in range(d // 16) for m in range(blocks)]  # fmt: skip
        assert [a - q0 for a in addrs if a >= q0] == want, lane
    # the warps' O for the merge (warp 0): fp32 (rows, D) from the K buffer's start, over V's
    # past it at 32 rows, D 128; a lane's rows lane // 4 + 8 i, column pairs 2 (lane % 4) + 8 n
    for lane in range(32):
        got = shared_addresses(ptx, lane, "st.shared.v2.b32")
        want = [4 * ((lane // 4 + 8 * i) * d + 2 * (lane % 4) + 8 * n)
                for i in range(2 * blocks) for n in range(d // 8)]  # fmt: skip
        assert sorted(got) == want, lane


def _chunk(n: int, row: int) -> int:
    """The element offset in its row of 8-element chunk n of a `swizzled_rows` tile row."""
    return 8 * ((n & ~7) | ((n ^ row) & 7))
