"""The MLA reference against a naive fp64 loop that gathers the latent token by token; combined
vs split cache views; FlashMLA's FP8 cache format and a per-tensor FP8 cache; the absorbed form
against the un-absorbed attention it comes from (W_UK / W_UV built here); and, where the
FlashInfer-Bench definitions are present, their own references against ours through
mla_flashinfer. The latent is always DeepSeek's 512 + 64."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference.flashinfer_paged import lse_to_base2, page_table_to_csr
from forgekernel.reference.mla import (
    FLASHMLA_FP8_BYTES,
    absorb_query,
    expand_latent,
    flashmla_fp8_views,
    flashmla_scale,
    mla_decode_ref,
    mla_prefill_ref,
    mla_unabsorbed_prefill_ref,
    project_output,
    quantize_flashmla_fp8,
    split_latent_cache,
)
from forgekernel.reference.mla_flashinfer import (
    decode_outputs_to_flashinfer,
    mla_flashinfer_decode,
    mla_flashinfer_prefill,
    page_table_from_flashinfer,
    prefill_outputs_to_flashinfer,
)

FP8 = torch.float8_e4m3fn
LATENT, ROPE, NOPE, DV = 512, 64, 128, 128
# DeepSeek-V3: 1 / sqrt(192) times the YaRN mscale^2 (rope factor 40).
SCALE = 192**-0.5 * (0.1 * math.log(40.0) + 1.0) ** 2


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _cu(lengths) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32)


def make_latent_cache(seqlens_k, page_size, gen, spare_pages=2, extra_cols=2):
    """ckv (P, ps, 512), kpe (P, ps, 64) fp32 on distinct random pages; table entries past a
    sequence's pages hold an out-of-range id that must never be read."""
    counts = [-(-s // page_size) for s in seqlens_k]
    num_pages = sum(counts) + spare_pages
    ckv = torch.randn(num_pages, page_size, LATENT, generator=gen)
    kpe = torch.randn(num_pages, page_size, ROPE, generator=gen)
    ids = torch.randperm(num_pages, generator=gen).tolist()
    table = torch.full((len(seqlens_k), max(counts) + extra_cols), 10**6, dtype=torch.int32)
    for b, n in enumerate(counts):
        table[b, :n] = torch.tensor(ids[:n], dtype=torch.int32)
        ids = ids[n:]
    return ckv, kpe, table, torch.tensor(seqlens_k, dtype=torch.int32)


def naive_mla(q_nope, q_pe, ckv, kpe, table, seqlens_k, q_lens, causal, scale):
    """fp64; each key row looked up by (page, slot) one token at a time; per query token all
    heads at once, the softmax written out (max, exp, sum). q packed (total_q, H, *); ckv, kpe
    already dequantized. Returns out (total_q, H, 512), lse (total_q, H)."""
    page_size = ckv.shape[1]
    out = torch.zeros(*q_nope.shape[:2], ckv.shape[-1], dtype=torch.float64)
    lse = torch.full(q_nope.shape[:2], -math.inf, dtype=torch.float64)
    row = 0
    for b, sq in enumerate(q_lens):
        sk = int(seqlens_k[b])
        slots = [(int(table[b, t // page_size]), t % page_size) for t in range(sk)]
        c = [ckv[p, s].double() for p, s in slots]
        r = [kpe[p, s].double() for p, s in slots]
        for i in range(sq):
            seen = sk if not causal else max(0, min(sk, i + sk - sq + 1))
            if seen == 0:
                continue
            cs, rs = torch.stack(c[:seen]), torch.stack(r[:seen])
            s = (q_nope[row + i].double() @ cs.T + q_pe[row + i].double() @ rs.T) * scale
            m = s.max(-1, keepdim=True).values
            e = torch.exp(s - m)
            z = e.sum(-1, keepdim=True)
            out[row + i] = (e @ cs) / z
            lse[row + i] = (m + torch.log(z))[:, 0]
        row += sq
    return out, lse


def assert_matches(out, ref, lse, ref_lse, atol=2e-5):
    assert out.shape == ref.shape and lse.shape == ref_lse.shape
    torch.testing.assert_close(out.double(), ref, atol=atol, rtol=1e-5)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse))
    finite = torch.isfinite(ref_lse)
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=atol, rtol=1e-5)
    return float((out.double() - ref).abs().max())


def _decode_vs_naive(q_nope, q_pe, caches, exact, table, sk, causal=True, **scales):
    """Ours on `caches` (as the reference takes them, with `scales`) against the naive loop on
    `exact` (the same caches dequantized), decode-shaped q (batch, s_q, H, *); the tolerance
    is relative to the output's largest magnitude. Returns (out, lse, max out error)."""
    batch, s_q, heads, _ = q_nope.shape
    out, lse = mla_decode_ref(q_nope, q_pe, *caches, table, sk, SCALE, causal=causal, **scales)
    packed_q = (q_nope.flatten(0, 1), q_pe.flatten(0, 1))
    ref, ref_lse = naive_mla(*packed_q, *exact, table, sk, [s_q] * batch, causal, SCALE)
    assert out.dtype == torch.float32 and lse.shape == (batch, heads, s_q)
    ref_lse = ref_lse.view(batch, s_q, heads).transpose(1, 2)
    atol = 2e-5 * max(1.0, float(ref.abs().max()))
    return out, lse, assert_matches(out, ref.view(out.shape), lse, ref_lse, atol)


# ---------------------------------------------------------------- ours vs the naive loop


@pytest.mark.parametrize("page_size", [1, 64])
@pytest.mark.parametrize("heads", [16, 128])
@pytest.mark.parametrize("s_q", [1, 2, 3, 4])
def test_decode(page_size, heads, s_q):
    gen = _gen(page_size * 1000 + heads * 10 + s_q)
    seqlens = [0, 1, 3, 70, page_size, page_size + 1]
    ckv, kpe, table, sk = make_latent_cache(seqlens, page_size, gen)
    q_nope = torch.randn(len(seqlens), s_q, heads, LATENT, generator=gen)
    q_pe = torch.randn(len(seqlens), s_q, heads, ROPE, generator=gen)
    out, lse, _ = _decode_vs_naive(q_nope, q_pe, (ckv, kpe), (ckv, kpe), table, sk)
    # empty sequence; with s_q > seqlen the first MTP tokens see nothing either
    assert torch.all(out[0] == 0) and torch.all(torch.isneginf(lse[0]))
    assert torch.all(torch.isneginf(lse[1, :, : s_q - 1])) and torch.isfinite(lse[1, :, -1]).all()


def test_decode_not_causal():
    gen = _gen(1)
    ckv, kpe, table, sk = make_latent_cache([2, 65, 0], 64, gen)
    q_nope = torch.randn(3, 3, 16, LATENT, generator=gen)
    q_pe = torch.randn(3, 3, 16, ROPE, generator=gen)
    _, lse, _ = _decode_vs_naive(q_nope, q_pe, (ckv, kpe), (ckv, kpe), table, sk, False)
    assert torch.isfinite(lse[0]).all()  # 3 queries over 2 keys: every row sees both


# (s_q, sk) per sequence: chunked prefill, a whole prompt, empty KV with queries, a sequence
# with no queries, more queries than keys (the first rows see nothing), a long-ish chunk.
CHUNKED = [(5, 37), (1, 1), (3, 0), (0, 12), (7, 7), (6, 2), (16, 80)]


@pytest.mark.parametrize("page_size, heads", [(1, 16), (64, 16), (64, 128)])
def test_prefill_varlen(page_size, heads):
    gen = _gen(page_size + heads)
    q_lens, seqlens = zip(*CHUNKED)
    ckv, kpe, table, sk = make_latent_cache(seqlens, page_size, gen)
    q_nope = torch.randn(sum(q_lens), heads, LATENT, generator=gen)
    q_pe = torch.randn(sum(q_lens), heads, ROPE, generator=gen)
    out, lse = mla_prefill_ref(q_nope, q_pe, ckv, kpe, table, sk, _cu(q_lens), SCALE)
    ref, ref_lse = naive_mla(q_nope, q_pe, ckv, kpe, table, sk, q_lens, True, SCALE)
    assert lse.shape == (heads, sum(q_lens))  # OPS.md varlen: (heads, total_tokens)
    assert_matches(out, ref, lse.transpose(0, 1), ref_lse)


def test_combined_cache_is_split_into_views():
    gen = _gen(2)
    ckv, kpe, table, sk = make_latent_cache([9, 0, 130], 64, gen)
    combined = torch.cat([ckv, kpe], -1)[:, :, None].bfloat16()  # FlashMLA (P, ps, 1, 576)
    ckv_view, kpe_view = split_latent_cache(combined)
    storage = combined.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (ckv_view, kpe_view))
    assert torch.equal(ckv_view, ckv.bfloat16()) and torch.equal(kpe_view, kpe.bfloat16())
    q_nope = torch.randn(3, 2, 16, LATENT, generator=gen).bfloat16()
    q_pe = torch.randn(3, 2, 16, ROPE, generator=gen).bfloat16()
    combined_out = mla_decode_ref(q_nope, q_pe, combined, None, table, sk, SCALE)
    split_out = mla_decode_ref(q_nope, q_pe, ckv.bfloat16(), kpe.bfloat16(), table, sk, SCALE)
    assert all(torch.equal(a, b) for a, b in zip(combined_out, split_out))
    _decode_vs_naive(q_nope, q_pe, (combined, None), (ckv_view, kpe_view), table, sk)


# ---------------------------------------------------------------- FP8 caches


def _varied_latent(num_pages, page_size, gen):
    """bf16 latent whose tokens and 128-column tiles span magnitudes 2^-12 .. 2^6 (so the tile
    scales differ, some clamp at FlashMLA's 1e-4 floor) and one all-zero tile."""
    ckv = torch.randn(num_pages, page_size, 4, 128, generator=gen)
    ckv *= torch.exp2(torch.randint(-12, 7, (num_pages, page_size, 4, 1), generator=gen))
    ckv[0, 0, 1] = 0.0
    return ckv.flatten(-2).bfloat16()


def test_flashmla_fp8_format_layout_and_rounding():
    gen = _gen(3)
    ckv = _varied_latent(5, 64, gen)
    kpe = torch.randn(5, 64, ROPE, generator=gen).bfloat16()
    packed = quantize_flashmla_fp8(ckv, kpe)
    assert packed.shape == (5, 64, 1, 656) == (5, 64, 1, FLASHMLA_FP8_BYTES)
    q8, scale, rope = flashmla_fp8_views(packed)
    storage = packed.untyped_storage().data_ptr()
    assert all(t.untyped_storage().data_ptr() == storage for t in (q8, scale, rope))
    # the bytes, assembled independently: 512 e4m3 | 4 little-endian fp32 | 64 bf16
    parts = [q8.contiguous(), scale.contiguous(), rope.contiguous()]
    expected = torch.cat([t.view(torch.uint8) for t in parts], -1)
    assert torch.equal(packed.view(torch.uint8)[:, :, 0], expected)
    assert torch.equal(rope, kpe)
    # scales: powers of two, the smallest >= max(amax / 448, 1e-4)
    amax = ckv.float().unflatten(-1, (4, 128)).abs().amax(-1)
    floor = (amax / 448).clamp_min(1e-4)
    assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)
    assert torch.all(scale >= floor) and torch.all(scale < 2 * floor)
    assert float(flashmla_scale(torch.tensor(448.0 * 2**-3))) == 2**-3  # exact power: no bump
    # dequantized: e4m3 rounding only (half an ulp: 2^-4 relative, 2^-10 scale when subnormal)
    tile_scale = scale.repeat_interleave(128, -1)
    err = (q8.float() * tile_scale - ckv.float()).abs()
    assert torch.all(err <= torch.maximum(ckv.float().abs() * 2**-4, tile_scale * 2**-10))
    assert torch.all(q8.float().abs() <= 448)


def test_flashmla_fp8_cache_decode_and_strided_pages():
    """The reference reads the FP8 format through its views (ckv_scale per token tile); the
    packed cache may be a slice with padded pages, as FlashMLA's own test builds it."""
    gen = _gen(4)
    seqlens = [70, 0, 5, 128]
    _, _, table, sk = make_latent_cache(seqlens, 64, gen)
    num_pages = int(table[table < 10**6].max()) + 3
    ckv = _varied_latent(num_pages, 64, gen)
    kpe = torch.randn(num_pages, 64, ROPE, generator=gen).bfloat16()
    padded = torch.zeros(num_pages, 65, 1, FLASHMLA_FP8_BYTES, dtype=FP8)[:, :64]
    padded.copy_(quantize_flashmla_fp8(ckv, kpe))
    q8, scale, rope = flashmla_fp8_views(padded)
    assert q8.stride(0) == 65 * FLASHMLA_FP8_BYTES and scale.stride(0) == 65 * 164
    # scores of a few units against latent tiles up to 2^6
    q_nope = torch.randn(4, 2, 16, LATENT, generator=gen) * 0.02
    q_pe = torch.randn(4, 2, 16, ROPE, generator=gen)
    dequant = q8.double() * scale.double().repeat_interleave(128, -1)
    _decode_vs_naive(q_nope, q_pe, (q8, rope), (dequant, rope), table, sk, ckv_scale=scale)


def test_fp8_per_tensor_scale_on_the_whole_row():
    """The community FP8 dense decode's cache: all 576 columns e4m3, one scale per tensor."""
    gen = _gen(5)
    ckv, kpe, table, sk = make_latent_cache([33, 64, 1], 64, gen)
    combined = (torch.cat([ckv, kpe], -1)[:, :, None] * 20).to(FP8)
    ckv8, kpe8 = split_latent_cache(combined)
    scale = torch.tensor([0.05])  # one-element tensor, as a descale_k
    q_nope = torch.randn(3, 1, 128, LATENT, generator=gen)
    q_pe = torch.randn(3, 1, 128, ROPE, generator=gen)
    deq = [t.double() * 0.05 for t in (ckv8, kpe8)]
    _decode_vs_naive(q_nope, q_pe, (ckv8, kpe8), deq, table, sk, ckv_scale=scale, kpe_scale=0.05)


# ---------------------------------------------------------------- absorbed == un-absorbed


@pytest.mark.parametrize("heads", [16, 128])
def test_absorbed_equals_unabsorbed_attention(heads):
    """Projecting the latent into per-head K (128 + shared RoPE 64) and V (128) and running
    plain attention gives the absorbed form's output projected by W_UV, and the same LSE
    (fp64: upcast=False on fp64 inputs keeps every step in fp64)."""
    gen = _gen(6 + heads)
    lengths = [(4, 40), (1, 1), (3, 0), (6, 3), (1, 65)]
    q_lens, seqlens = zip(*lengths)
    ckv, kpe, table, sk = make_latent_cache(seqlens, 64, gen)
    ckv, kpe = ckv.double(), kpe.double()
    w_uk = torch.randn(heads, NOPE, LATENT, generator=gen, dtype=torch.float64) / LATENT**0.5
    w_uv = torch.randn(heads, DV, LATENT, generator=gen, dtype=torch.float64) / LATENT**0.5
    q_nope = torch.randn(sum(q_lens), heads, NOPE, generator=gen, dtype=torch.float64)
    q_pe = torch.randn(sum(q_lens), heads, ROPE, generator=gen, dtype=torch.float64)
    # contiguous keys of every sequence, gathered through the page table
    rows = [(int(table[b, t // 64]), t % 64) for b, n in enumerate(seqlens) for t in range(n)]
    c = torch.stack([ckv[p, s] for p, s in rows])
    r = torch.stack([kpe[p, s] for p, s in rows])
    k_nope, v = expand_latent(c, w_uk, w_uv)
    cu_q, cu_k = _cu(q_lens), _cu(seqlens)
    plain, plain_lse = mla_unabsorbed_prefill_ref(
        q_nope, q_pe, k_nope, r, v, cu_q, cu_k, SCALE, upcast=False
    )
    latent_out, lse = mla_prefill_ref(
        absorb_query(q_nope, w_uk), q_pe, ckv, kpe, table, sk, cu_q, SCALE, upcast=False
    )
    absorbed = project_output(latent_out, w_uv)
    assert absorbed.shape == plain.shape == (sum(q_lens), heads, DV)
    torch.testing.assert_close(absorbed, plain, atol=1e-12, rtol=1e-10)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(plain_lse))
    torch.testing.assert_close(lse, plain_lse, atol=1e-5, rtol=1e-6)  # LSE is stored fp32


def test_low_precision_yardstick():
    """upcast=False: the cache and the math in q's dtype (bf16), lse fp32."""
    gen = _gen(7)
    ckv, kpe, table, sk = make_latent_cache([300, 5], 64, gen)
    ckv, kpe = ckv.bfloat16(), kpe.bfloat16()
    q_nope = torch.randn(2, 2, 16, LATENT, generator=gen).bfloat16()
    q_pe = torch.randn(2, 2, 16, ROPE, generator=gen).bfloat16()
    rough, lse = mla_decode_ref(q_nope, q_pe, ckv, kpe, table, sk, SCALE, upcast=False)
    exact, exact_lse = mla_decode_ref(q_nope, q_pe, ckv, kpe, table, sk, SCALE)
    assert rough.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert 0 < (rough.float() - exact).abs().max() < 2e-2 * exact.abs().max()
    assert (lse - exact_lse).abs().max() < 0.1


def test_bad_inputs_raise_naming_the_argument():
    gen = _gen(8)
    ckv, kpe, table, sk = make_latent_cache([20, 3], 64, gen)
    q_nope, q_pe = torch.randn(2, 1, 16, LATENT), torch.randn(2, 1, 16, ROPE)
    with pytest.raises(ValueError, match="seqlens_k"):
        mla_decode_ref(q_nope, q_pe, ckv, kpe, table, torch.tensor([20, 64 * 4]), SCALE)
    bad = table.clone()
    bad[0, 0] = ckv.shape[0]
    with pytest.raises(ValueError, match="page_table"):
        mla_decode_ref(q_nope, q_pe, ckv, kpe, bad, sk, SCALE)
    with pytest.raises(ValueError, match="q_nope"):
        mla_decode_ref(q_nope[..., :448], q_pe, ckv, kpe, table, sk, SCALE)
    with pytest.raises(ValueError, match="kpe_cache"):
        mla_decode_ref(q_nope, q_pe, ckv, kpe[:-1], table, sk, SCALE)
    with pytest.raises(ValueError, match="ckv_scale"):
        mla_decode_ref(q_nope, q_pe, ckv, kpe, table, sk, SCALE, ckv_scale=torch.ones(3, 64, 3))
    with pytest.raises(ValueError, match="kv_cache"):
        split_latent_cache(torch.zeros(2, 64, 2, 576))
    with pytest.raises(ValueError, match="packed"):
        flashmla_fp8_views(torch.zeros(2, 64, 1, 576, dtype=FP8))


# ---------------------------------------------------------------- FlashInfer adapter


def test_page_table_from_kv_len_or_last_page_len():
    gen = _gen(9)
    seqlens = [0, 1, 64, 65, 191]
    _, _, table, sk = make_latent_cache(seqlens, 64, gen, extra_cols=0)
    indptr, indices, last = page_table_to_csr(table, sk, 64)
    by_last = page_table_from_flashinfer(indptr, indices, 64, kv_last_page_len=last)
    by_len = page_table_from_flashinfer(indptr, indices, 64, kv_len=sk)
    assert all(torch.equal(a, b) for a, b in zip(by_last, by_len))
    assert torch.equal(by_len[1], sk)
    with pytest.raises(ValueError, match="kv_len"):
        page_table_from_flashinfer(indptr, indices, 64, kv_len=sk + 64)


def test_outputs_to_flashinfer_layouts():
    out, lse = torch.randn(3, 1, 16, LATENT), torch.randn(3, 16, 1)
    theirs_out, theirs_lse = decode_outputs_to_flashinfer(out, lse)
    assert torch.equal(theirs_out, out[:, 0])
    assert torch.equal(theirs_lse, lse_to_base2(lse[..., 0]))
    out, lse = torch.randn(7, 16, LATENT), torch.randn(16, 7)
    _, theirs_lse = prefill_outputs_to_flashinfer(out, lse)
    assert torch.equal(theirs_lse, lse_to_base2(lse).T)


MLA_DECODE = tuple(f"mla_paged_decode_h16_ckv512_kpe64_ps{ps}" for ps in (1, 64))
MLA_PREFILL = tuple(f"mla_paged_prefill_causal_h16_ckv512_kpe64_ps{ps}" for ps in (1, 64))


def _definition(name):
    reason = defs.missing(name)
    if reason:
        pytest.skip(reason)
    return defs.load_definition(name)


def mla_inputs(defn, seqlens_k, q_lens=None, seed=0, spare_pages=3):
    """Random inputs of an MLA definition: sequence b on distinct random pages holding
    seqlens_k[b] tokens; prefill packs q_lens[b] queries for it."""
    gen = _gen(seed)
    heads, ps = defn.const("num_qo_heads"), defn.const("page_size")
    counts = [-(-s // ps) for s in seqlens_k]
    num_pages = sum(counts) + spare_pages
    rows = len(seqlens_k) if defn.stage == "decode" else sum(q_lens)
    inputs = {
        "q_nope": torch.randn(rows, heads, LATENT, generator=gen).bfloat16(),
        "q_pe": torch.randn(rows, heads, ROPE, generator=gen).bfloat16(),
        "ckv_cache": torch.randn(num_pages, ps, LATENT, generator=gen).bfloat16(),
        "kpe_cache": torch.randn(num_pages, ps, ROPE, generator=gen).bfloat16(),
        "kv_indptr": _cu(counts),
        "kv_indices": torch.randperm(num_pages, generator=gen)[: sum(counts)].int(),
        "kv_last_page_len": torch.tensor(
            [s - (n - 1) * ps if n else 0 for s, n in zip(seqlens_k, counts)], dtype=torch.int32
        ),
        "sm_scale": SCALE,
    }
    if q_lens is not None:
        inputs["qo_indptr"] = _cu(q_lens)
    inputs = {name: inputs[name] for name in defn.inputs}
    defs.check_inputs(defn, inputs)
    return inputs


def _against_definition(defn, inputs):
    """Theirs vs ours: theirs is the same fp32 math rounded to bf16 (out within half a bf16
    ulp of ours, plus fp32 noise where a sum cancels to near 0), lse base 2; returns (max out
    error, max lse error, their NaN rows)."""
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    run = mla_flashinfer_decode if defn.stage == "decode" else mla_flashinfer_prefill
    ours_out, ours_lse = run(**inputs)
    assert ours_out.shape == theirs_out.shape and ours_lse.shape == theirs_lse.shape
    nan = theirs_out.isnan().any(-1)
    assert torch.all(ours_out[nan] == 0)
    err = (ours_out - theirs_out.float()).abs()[~nan]
    assert torch.all(err <= theirs_out.float().abs()[~nan] * 2**-8 + 1e-5)
    assert torch.equal(torch.isneginf(ours_lse), torch.isneginf(theirs_lse))
    finite = torch.isfinite(theirs_lse)
    lse_err = (ours_lse - theirs_lse).abs()[finite]
    assert lse_err.max() <= 2e-5
    return float(err.max()), float(lse_err.max()), int(nan.sum())


@pytest.mark.parametrize("name", MLA_DECODE)
def test_decode_definition(name):
    defn = _definition(name)
    ps = defn.const("page_size")
    inputs = mla_inputs(defn, [0, 1, 23, ps, ps + 1, 2 * ps + 5, 0], seed=10)
    _, _, nan_rows = _against_definition(defn, inputs)
    assert nan_rows == 0


@pytest.mark.parametrize("name", MLA_PREFILL)
def test_prefill_definition(name):
    defn = _definition(name)
    ps = defn.const("page_size")
    lengths = [(5, 37), (1, ps + 1), (3, 0), (0, 9), (6, 6), (2, 70)]
    q_lens, seqlens = zip(*lengths)
    _, _, nan_rows = _against_definition(defn, mla_inputs(defn, seqlens, q_lens, seed=11))
    assert nan_rows == 0


def test_prefill_definition_leaves_rows_without_keys_nan():
    """Their prefill softmax over a row that sees no key (q_len > kv_len) gives NaN; ours 0."""
    defn = _definition(MLA_PREFILL[-1])
    inputs = mla_inputs(defn, [3, 40], [5, 2], seed=12)
    _, _, nan_rows = _against_definition(defn, inputs)
    assert nan_rows == 2 * defn.const("num_qo_heads")
