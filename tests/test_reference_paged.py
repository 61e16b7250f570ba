"""The paged attention reference against a naive fp64 loop that gathers token by token; the
FlashInfer CSR adapter; and, where the FlashInfer-Bench definitions are present, our reference
against each definition's own reference on inputs generated for it."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference.attention import attention_ref
from forgekernel.reference.flashinfer_paged import (
    PAD_PAGE,
    csr_to_page_table,
    lse_to_base2,
    lse_to_natural,
    page_table_to_csr,
)
from forgekernel.reference.paged_attention import paged_attention_ref, split_kv_cache

FP8 = torch.float8_e4m3fn


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def make_paged(seqlens_k, page_size, hkv, d, gen, spare_pages=2, extra_cols=2, dtype=None):
    """Caches on distinct random pages; table entries past a sequence's pages hold garbage
    ids (out of range) that must never be read."""
    counts = [-(-s // page_size) for s in seqlens_k]
    num_pages = sum(counts) + spare_pages
    k = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    v = torch.randn(num_pages, page_size, hkv, d, generator=gen)
    if dtype is not None:
        k, v = (t.mul(4).to(dtype) for t in (k, v))
    ids = torch.randperm(num_pages, generator=gen).tolist()
    width = max(counts) + extra_cols
    table = torch.full((len(seqlens_k), width), 10**6, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return k, v, table, torch.tensor(seqlens_k, dtype=torch.int32)


def naive_paged(q, k, v, table, seqlens_k, q_lens, causal, scale, k_scale=None, v_scale=None):
    """fp64, one token and one query row at a time; q packed (sum(q_lens), Hq, D).
    Returns out (total_q, Hq, D) and lse (total_q, Hq)."""
    page_size, hkv = k.shape[1], k.shape[2]
    hq = q.shape[1]
    ks = torch.ones(hkv, dtype=torch.float64) if k_scale is None else torch.as_tensor(k_scale)
    vs = torch.ones(hkv, dtype=torch.float64) if v_scale is None else torch.as_tensor(v_scale)
    ks, vs = (s.double().expand(hkv) for s in (ks, vs))
    out = torch.zeros(q.shape, dtype=torch.float64)
    lse = torch.full((q.shape[0], hq), -math.inf, dtype=torch.float64)
    row = 0
    for b, sq in enumerate(q_lens):
        sk = int(seqlens_k[b])
        slots = [(int(table[b, t // page_size]), t % page_size) for t in range(sk)]
        kb = [k[p, s].double() * ks[:, None] for p, s in slots]
        vb = [v[p, s].double() * vs[:, None] for p, s in slots]
        for i in range(sq):
            seen = sk if not causal else max(0, min(sk, i + sk - sq + 1))
            for h in range(hq):
                g = h // (hq // hkv)
                if seen == 0:
                    continue
                s = torch.stack([q[row + i, h].double() @ kb[j][g] for j in range(seen)]) * scale
                p = torch.softmax(s, 0)
                out[row + i, h] = sum(p[j] * vb[j][g] for j in range(seen))
                lse[row + i, h] = torch.logsumexp(s, 0)
        row += sq
    return out, lse


def assert_matches(ours, ref, lse_ours, lse_ref, atol=2e-5):
    assert ours.shape == ref.shape and lse_ours.shape == lse_ref.shape
    torch.testing.assert_close(ours.double(), ref, atol=atol, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse_ours), torch.isneginf(lse_ref))
    finite = torch.isfinite(lse_ref)
    torch.testing.assert_close(lse_ours.double()[finite], lse_ref[finite], atol=atol, rtol=1e-5)


# ---------------------------------------------------------------- ours vs the naive loop


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group, d", [(1, 64), (4, 128), (8, 64)])
def test_decode(page_size, group, d):
    gen = _gen(page_size * 100 + group)
    hkv = 2
    seqlens = [0, 1, 17, 70, page_size, page_size + 1]
    k, v, table, sk = make_paged(seqlens, page_size, hkv, d, gen)
    q = torch.randn(len(seqlens), hkv * group, d, generator=gen)
    out, lse = paged_attention_ref(q, k, v, table, sk)
    ref_out, ref_lse = naive_paged(q, k, v, table, sk, [1] * len(seqlens), True, d**-0.5)
    assert lse.shape == (len(seqlens), hkv * group) and lse.dtype == torch.float32
    assert_matches(out, ref_out, lse, ref_lse)
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))


# (sq, sk) per sequence: chunked prefill (sq < sk), a whole prompt (sq = sk), empty KV with
# queries, a sequence with no queries, more queries than keys (the first rows see nothing).
CHUNKED = [(5, 37), (1, 1), (3, 0), (0, 12), (7, 7), (6, 2), (16, 80)]
SPECULATIVE = [(2, 33), (3, 65), (4, 17), (2, 2), (4, 130)]


@pytest.mark.parametrize("page_size", [1, 16, 64])
@pytest.mark.parametrize("group", [1, 4, 8])
@pytest.mark.parametrize("lengths", [CHUNKED, SPECULATIVE], ids=["chunked", "speculative"])
def test_varlen_causal(page_size, group, lengths):
    gen = _gen(page_size + 7 * group + len(lengths))
    hkv, d = 2, 64
    q_lens, seqlens = zip(*lengths)
    k, v, table, sk = make_paged(seqlens, page_size, hkv, d, gen)
    q = torch.randn(sum(q_lens), hkv * group, d, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = paged_attention_ref(q, k, v, table, sk, cu_seqlens_q=cu, softmax_scale=0.3)
    ref_out, ref_lse = naive_paged(q, k, v, table, sk, q_lens, True, 0.3)
    assert lse.shape == (hkv * group, sum(q_lens))  # OPS.md varlen: (heads, total_tokens)
    assert_matches(out, ref_out, lse.transpose(0, 1), ref_lse)


def test_varlen_not_causal_d128():
    gen = _gen(3)
    q_lens, seqlens = zip(*CHUNKED)
    k, v, table, sk = make_paged(seqlens, 16, 1, 128, gen)
    q = torch.randn(sum(q_lens), 3, 128, generator=gen)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    out, lse = paged_attention_ref(q, k, v, table, sk, cu_seqlens_q=cu, causal=False)
    ref_out, ref_lse = naive_paged(q, k, v, table, sk, q_lens, False, 128**-0.5)
    assert_matches(out, ref_out, lse.transpose(0, 1), ref_lse)


def test_combined_cache_is_split_into_views():
    gen = _gen(4)
    seqlens = [9, 0, 40]
    k, v, table, sk = make_paged(seqlens, 16, 2, 64, gen)
    kv = torch.stack([k, v], dim=1)  # (num_pages, 2, page_size, Hkv, D)
    k_view, v_view = split_kv_cache(kv)
    storage = kv.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (k_view, v_view))
    assert torch.equal(k_view, k) and torch.equal(v_view, v)
    q = torch.randn(3, 8, 64, generator=gen)
    out, lse = paged_attention_ref(q, kv, None, table, sk)
    ref_out, ref_lse = naive_paged(q, k, v, table, sk, [1, 1, 1], True, 0.125)
    assert_matches(out, ref_out, lse, ref_lse)


@pytest.mark.parametrize("per_head", [False, True], ids=["per_tensor", "per_head"])
def test_fp8_cache_dequantized_with_scales(per_head):
    gen = _gen(5 + per_head)
    hkv, q_lens, seqlens = 4, [1, 3, 2], [50, 17, 0]
    k, v, table, sk = make_paged(seqlens, 16, hkv, 64, gen, dtype=FP8)
    if per_head:
        k_scale, v_scale = torch.rand(hkv, generator=gen) + 0.05, torch.rand(hkv, generator=gen)
    else:
        k_scale, v_scale = 0.07, 0.3
    q = torch.randn(sum(q_lens), 8, 64, generator=gen)
    cu = torch.tensor([0, 1, 4, 6], dtype=torch.int32)
    out, lse = paged_attention_ref(
        q, k, v, table, sk, cu_seqlens_q=cu, k_scale=k_scale, v_scale=v_scale
    )
    ref = naive_paged(q, k, v, table, sk, q_lens, True, 0.125, k_scale, v_scale)
    assert_matches(out, ref[0], lse.transpose(0, 1), ref[1])


def test_low_precision_yardstick_is_attention_ref_in_bf16():
    """upcast=False is attention_ref's input-dtype math on the gathered sequence."""
    gen = _gen(6)
    seqlens = [300, 5]
    k, v, table, sk = make_paged(seqlens, 16, 2, 64, gen, dtype=torch.bfloat16)
    q = torch.randn(2, 8, 64, generator=gen).bfloat16()
    rough, lse = paged_attention_ref(q, k, v, table, sk, upcast=False)
    assert rough.dtype == torch.bfloat16 and lse.dtype == torch.float32
    for b, n in enumerate(seqlens):
        dense_k, dense_v = (
            c[table[b, : -(-n // 16)].long()].flatten(0, 1)[None, :n] for c in (k, v)
        )
        o, seq_lse = attention_ref(q[None, b : b + 1], dense_k, dense_v, True, upcast=False)
        assert torch.equal(rough[b], o[0, 0]) and torch.equal(lse[b], seq_lse[0, :, 0])
    exact, _ = paged_attention_ref(q, k, v, table, sk)
    assert 0 < (rough.float() - exact).abs().max() < 2e-2 * exact.abs().max()


def test_bad_inputs_raise_naming_the_argument():
    gen = _gen(7)
    k, v, table, sk = make_paged([20, 3], 16, 2, 64, gen)
    q = torch.randn(2, 4, 64, generator=gen)
    with pytest.raises(ValueError, match="seqlens_k"):
        paged_attention_ref(q, k, v, table, torch.tensor([20, 16 * table.shape[1] + 1]))
    bad = table.clone()
    bad[0, 1] = k.shape[0]
    with pytest.raises(ValueError, match="page_table"):
        paged_attention_ref(q, k, v, bad, sk)
    with pytest.raises(ValueError, match="q"):
        paged_attention_ref(torch.randn(2, 3, 64), k, v, table, sk)
    with pytest.raises(ValueError, match="k_scale"):
        paged_attention_ref(q, k, v, table, sk, k_scale=torch.ones(3))


# ---------------------------------------------------------------- the CSR adapter


@pytest.mark.parametrize("page_size", [1, 16, 64])
def test_csr_round_trip(page_size):
    gen = _gen(page_size)
    seqlens = [0, 1, page_size, page_size + 1, 3 * page_size - 1, 0]
    _, _, table, sk = make_paged(seqlens, page_size, 1, 8, gen, extra_cols=0)
    indptr, indices, last = page_table_to_csr(table, sk, page_size)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    counts = [-(-s // page_size) for s in seqlens]
    assert indptr.tolist() == [0, *torch.tensor(counts).cumsum(0).tolist()]
    assert last.tolist() == [s - (n - 1) * page_size if n else 0 for s, n in zip(seqlens, counts)]
    table2, sk2 = csr_to_page_table(indptr, indices, last, page_size)
    assert torch.equal(sk2, sk) and table2.shape == table.shape
    used = torch.arange(table.shape[1])[None, :] < torch.tensor(counts)[:, None]
    assert torch.equal(table2[used], table[used]) and torch.all(table2[~used] == PAD_PAGE)
    again = page_table_to_csr(table2, sk2, page_size)
    assert all(torch.equal(a, b) for a, b in zip(again, (indptr, indices, last)))


def test_csr_without_last_page_len_and_checks():
    indptr = torch.tensor([0, 3, 3, 4], dtype=torch.int32)
    indices = torch.tensor([7, 2, 5, 0], dtype=torch.int32)
    table, sk = csr_to_page_table(indptr, indices, None, 1, max_pages=5)
    assert sk.tolist() == [3, 0, 1] and table.shape == (3, 5)
    assert table.tolist() == [[7, 2, 5, 0, 0], [0] * 5, [0, 0, 0, 0, 0]]
    with pytest.raises(ValueError, match="kv_last_page_len"):
        csr_to_page_table(indptr, indices, torch.tensor([0, 0, 1]), 16)
    with pytest.raises(ValueError, match="max_pages"):
        csr_to_page_table(indptr, indices, None, 1, max_pages=2)


def test_lse_base_conversions():
    lse = torch.tensor([-math.inf, -3.0, 0.0, 11.5])
    lse2 = lse_to_base2(lse)
    torch.testing.assert_close(torch.exp2(lse2[1:]), torch.exp(lse[1:]))
    torch.testing.assert_close(lse_to_natural(lse2), lse)
    assert torch.isneginf(lse2[0])


# ---------------------------------------------------------------- FlashInfer-Bench definitions


def test_missing_definitions_directory_is_reported(monkeypatch, tmp_path):
    monkeypatch.setenv(defs.DEFS_ENV, str(tmp_path / "absent"))
    assert "no FlashInfer-Bench definitions" in defs.missing()
    with pytest.raises(FileNotFoundError):
        defs.load_definition(defs.PAGED_GQA_DECODE[0])


def _definition(name):
    reason = defs.missing(name)
    if reason:
        pytest.skip(reason)
    return defs.load_definition(name)


def _check_against_definition(defn, seqlens_k, seqlens_q=None, seed=0):
    inputs = defs.paged_gqa_inputs(defn, seqlens_k, seqlens_q, generator=_gen(seed))
    result = defs.compare_paged_gqa(defn, inputs)
    # theirs is the same fp32 math with the output rounded to bf16
    assert result["out_rounding"] <= 1.01, result
    assert result["lse_err"] <= 1e-5, result
    assert result["nan_rows_ours_max"] == 0.0, result
    return result


@pytest.mark.parametrize("name", defs.PAGED_GQA_DECODE)
def test_decode_definition(name):
    defn = _definition(name)
    ps = defn.const("page_size")
    result = _check_against_definition(defn, [0, 1, 23, ps, ps + 1, 2 * ps + 5, 0], seed=1)
    assert result["nan_rows"] == 0


@pytest.mark.parametrize("name", defs.PAGED_GQA_PREFILL)
def test_prefill_definition(name):
    defn = _definition(name)
    ps = defn.const("page_size")
    lengths = [(5, 37), (1, ps + 1), (3, 0), (0, 9), (6, 6), (2, 70)]
    q_lens, seqlens = zip(*lengths)
    _check_against_definition(defn, seqlens, q_lens, seed=2)


def test_prefill_definition_leaves_fully_masked_rows_nan():
    """Their prefill softmax over a row that sees no key (sq > sk) gives NaN; ours gives 0."""
    defn = _definition(defs.PAGED_GQA_PREFILL[-1])
    result = _check_against_definition(defn, [3, 40], [5, 2], seed=3)
    assert result["nan_rows"] == 2 * defn.const("num_qo_heads")


def test_definition_constraints_are_enforced():
    defn = _definition(defs.PAGED_GQA_DECODE[-1])
    inputs = defs.paged_gqa_inputs(defn, [4, 9], generator=_gen(4))
    inputs["kv_indices"] = inputs["kv_indices"][:-1]
    with pytest.raises(ValueError, match="constraint"):
        defs.check_inputs(defn, inputs)
