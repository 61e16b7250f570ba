"""DeepSeek MLA paged decode on the GPU (issue 19) against the fp32 reference (reference.mla):
16 / 32 / 128 heads, page sizes 1 / 16 / 64, empty and long sequences, FlashMLA's combined cache
read through its views, MTP s_q 2 and 4, the packed form, fp16 and bf16, NaN-poisoned outputs
(criterion: 2x the same math in the input dtype + 1e-3); a CUDA graph replayed on new inputs;
mla_prefill (blocks of query tokens per CTA); the seesaw pass (page sizes multiples of 64) with
NaN in every stale page slot, beside decode.py's pass on the same inputs; FlashInfer-Bench's
mla_paged_decode definitions through the adapter, by their own criterion (|ours - theirs| <=
1e-2 or relative 1e-2 per element, bench/flashinfer_defs.py). FlashMLA's FP8 cache (bf16
queries; e4m3 or uint8, pages packed or padded): decode, MTP, the packed form and mla_prefill
against the reference on the latent e4m3 x its scales (same criterion), in a CUDA graph, and
the dequantization bit for bit on the device: with one key per sequence the output is that
key's latent, e4m3 x scale exactly, over all 254 finite codes and the scales 2^-117 .. 2^7
(fp32 normals all the way through the combine). The direct forms (plans of one split): the
seesaw pass's and decode.py's (pages 1 / 16, FP8), each bit for bit its partial form + the
combine of the same plan."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from graphs import assert_pdl_chain_is_serialized, captured

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference.mla import (
    flashmla_fp8_views,
    mla_decode_ref,
    mla_prefill_ref,
    quantize_flashmla_fp8,
)
from forgekernel.runtime import pdl

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.mla")
SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)  # DeepSeek-V3's

CASES = [
    # b, hq, page_size, lens, s_q, combined
    (4, 16, 64, [1, 17, 300, 0], 1, True),
    (2, 16, 1, [64, 1000], 1, False),
    (1, 16, 64, [16384], 1, False),
    (3, 128, 64, [5, 0, 513], 1, True),
    (2, 32, 16, [129, 2048], 1, False),
    (64, 16, 64, [4096] * 64, 1, True),
    (4, 16, 64, [1, 40, 700, 4096], 2, True),
    (3, 128, 1, [4, 129, 2000], 4, False),
]


def _problem(b, hq, ps, lens, s_q, combined, dtype, seed=0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rand = {"device": "cuda", "dtype": dtype, "generator": g}
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 5
    if combined:
        ckv, kpe = torch.randn(pages, ps, 1, 576, **rand), None
    else:
        ckv, kpe = torch.randn(pages, ps, 512, **rand), torch.randn(pages, ps, 64, **rand)
    table = torch.randperm(pages, device="cuda", generator=g)[: b * max_pages].view(b, -1)
    q = torch.randn(b, s_q, hq, 576, **rand)  # FlashMLA's q: ours reads its two views
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    return q[..., :512], q[..., 512:], ckv, kpe, table.to(torch.int32), seq


def _check(out, lse, want, want_lse, low):
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    if finite.any():  # an all-empty batch has no finite LSE to compare
        assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-3


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}" + ("_comb" if c[5] else "")
)
def test_mla_decode_matches_the_reference(case, dtype):
    qn, qp, ckv, kpe, table, seq = _problem(*case, dtype)
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
    got, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                             return_lse=True)  # fmt: skip
    assert got is out
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    _check(out, lse, want, want_lse, low)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)


def _packed_matches_the_reference(causal, after_call=lambda: None, page_size=64, hq=16):
    """Five sequences of 1, 3, 0, 2, 4 query tokens over 40, 3, 10, 0, 700 keys (packed,
    cu_seqlens_q; NaN in every stale page slot) against the prefill reference; after_call runs
    between the op and the check."""
    q_lens, k_lens = [1, 3, 0, 2, 4], [40, 3, 10, 0, 700]
    _, _, ckv, kpe, table, seq = _problem(5, hq, page_size, k_lens, 1, False, torch.bfloat16)
    _poison_stale(ckv, kpe, table, k_lens, page_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(1)
    q = torch.randn(int(cu[-1]), hq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    qn, qp = q[..., :512], q[..., 512:]
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, cu_seqlens_q=cu,
                             max_seqlen_q=4, causal=causal, return_lse=True)  # fmt: skip
    after_call()
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
    low, _ = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal, upcast=False)
    _check(out, lse, want, want_lse, low)


def _fresh_keys(launch, monkeypatch) -> list[dict]:
    """The compile keys of the calls from now on, their plans built afresh under the launcher's
    rule (FORGEKERNEL_MLA_GATHER unset), for `_assert_gather`."""
    launch._plans.clear()
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER", raising=False)
    return _recorded_keys(launch, monkeypatch)


def _assert_gather(keys, page_size):
    """The call's pass: the seesaw's gather form at 16-bit page 1 with PDL (the rule,
    `launch.takes_gather`), not at page 64."""
    partial = [k for k in keys if k["kind"] == "partial"][-1]
    assert partial.get("gather", False) == (page_size == 1 and pdl.enabled())


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("page_size", "hq"), [(64, 16), (1, 16), (1, 8)])
def test_mla_decode_packed(causal, page_size, hq, monkeypatch):
    """Packed queries at page 64 (the seesaw) and page 1 (its gather form by the rule; 8 heads:
    an 8 x 2 block, fewer heads than the bench's)."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    keys = _fresh_keys(launch, monkeypatch)
    _packed_matches_the_reference(causal, page_size=page_size, hq=hq)
    _assert_gather(keys, page_size)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("page_size", [64, 1])
@pytest.mark.parametrize(
    ("hq", "q_lens", "k_lens"),
    [(16, [1, 300, 0, 77], [40, 300, 10, 2000]), (128, [129, 5], [129, 700]),
     (32, [9, 33], [4, 1024]), (8, [17, 2, 200], [17, 900, 260])],
)  # fmt: skip
def test_mla_prefill(causal, page_size, hq, q_lens, k_lens, monkeypatch):
    """mla_prefill: blocks of query tokens per CTA over long query runs (sq = sk, sq > sk,
    a chunk after a cached prefix), 8 / 16 / 32 / 128 heads; NaN-poisoned out and stale page
    slots (page 64: the seesaw pass, every causal block but the last bounded below the
    sequence; page 1: its gather form, the rule's since 2026-12-05, the table's entries past
    each sequence on NaN rows)."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    keys = _fresh_keys(launch, monkeypatch)
    b = len(q_lens)
    _, _, ckv, kpe, table, seq = _problem(b, hq, page_size, k_lens, 1, True, torch.bfloat16)
    _poison_stale(ckv, kpe, table, k_lens, page_size)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(2)
    q = torch.randn(int(cu[-1]), hq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    qn, qp = q[..., :512], q[..., 512:]
    out = torch.full((int(cu[-1]), hq, 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    _, lse = op.mla_prefill(qn, qp, ckv, None, table, seq, cu, max(q_lens), softmax_scale=SCALE,
                            causal=causal, return_lse=True, out=out)  # fmt: skip
    _assert_gather(keys, page_size)
    want, want_lse = mla_prefill_ref(qn, qp, ckv, None, table, seq, cu, SCALE, causal)
    low, _ = mla_prefill_ref(qn, qp, ckv, None, table, seq, cu, SCALE, causal, upcast=False)
    _check(out, lse, want, want_lse, low)


def test_mla_decode_in_a_cuda_graph():
    """Captured once, replayed on new query values and lengths: no host read in the op."""
    qn, qp, ckv, kpe, table, seq = _problem(8, 16, 64, [4096] * 8, 1, True, torch.bfloat16)
    out = torch.empty(*qn.shape[:-1], 512, device="cuda", dtype=torch.bfloat16)
    graph = captured(
        lambda: op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out)
    )
    qn.copy_(torch.randn_like(qn))
    seq.copy_(torch.tensor([1, 4096, 0, 77, 2048, 3000, 65, 64], device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound


SEESAW_CASES = [
    # b, hq, page_size, lens, s_q: the seesaw pass (16-bit, page_size % 64 == 0)
    (6, 16, 64, [1, 63, 64, 65, 190, 450], 1),  # 1 .. 8 tiles, odd and even, partial last
    (3, 16, 128, [100, 128, 700], 1),  # page 128: row blocks 0 and 1 of a page
    (2, 16, 256, [300, 5000], 1),
    (2, 128, 64, [130, 9000], 1),  # two head blocks, splits
    (3, 16, 64, [3, 200, 4100], 2),  # MTP, causal
    (2, 32, 64, [5, 3000], 4),
    (1, 16, 64, [65536], 1),  # 128 splits of 8 tiles
    # fewer than 8 heads a CTA: Q's TMA boxes take 8 (pitch), token t at rows 8 t
    (3, 1, 64, [1, 130, 700], 1),
    (2, 12, 64, [70, 3000], 1),  # 3 head blocks of 4: boxes reach the next block / past Hq
    (2, 2, 64, [5, 300], 4),  # 4 tokens at pitch 8, causal
]


def _recorded_keys(launch, monkeypatch) -> list[dict]:
    """The compile keys the launcher asks for from now on, in order."""
    keys = []
    real = launch.get_kernel
    monkeypatch.setattr(launch, "get_kernel", lambda spec, p: keys.append(dict(p)) or real(spec, p))
    return keys


def _poisoned_case(case, dtype):
    """A decode case's inputs with NaN in every stale page slot, and its references: fp64
    (out, lse) and the one in the inputs' precision."""
    b, hq, ps, lens, s_q = case
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, ps, lens, s_q, False, dtype)
    _poison_stale(ckv, kpe, table, lens, ps)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    return (qn, qp, ckv, kpe, table, seq), (want, want_lse, low)


def _poison_stale(ckv, kpe, table, lens, ps):
    """The slots of each sequence's pages past its length: NaN (stale slots; the seesaw pass
    reads whole 64-row boxes of a page and must mask them in S and zero them before P V)."""
    for i, n in enumerate(lens):
        for j in range(table.shape[1]):
            stale = slice(max(n - j * ps, 0), ps)
            ckv[table[i, j], stale] = float("nan")
            if kpe is not None:
                kpe[table[i, j], stale] = float("nan")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", SEESAW_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}_n{max(c[3])}"
)
def test_seesaw_matches_the_reference_and_the_roles_pass(case, dtype, monkeypatch):
    """The seesaw pass (tma compile keys) against the reference with NaN in every stale page
    slot, and decode.py's role-split pass (FORGEKERNEL_MLA_SCHEDULE=roles) on the same inputs
    by the same criterion."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    (qn, qp, ckv, kpe, table, seq), (want, want_lse, low) = _poisoned_case(case, dtype)
    keys = _recorded_keys(launch, monkeypatch)
    for schedule, tma in (("seesaw", True), ("roles", False)):
        monkeypatch.setenv("FORGEKERNEL_MLA_SCHEDULE", schedule)
        launch._plans.clear()
        out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True)  # fmt: skip
        torch.cuda.synchronize()
        assert [k.get("tma", False) for k in keys if k["kind"] == "partial"][-1] == tma
        _check(out, lse, want, want_lse, low)
    launch._plans.clear()


def _definition_inputs(defn, seqlens_k, seed=0):
    """Random inputs of an mla_paged_decode definition: sequence b holds seqlens_k[b] tokens
    (0: empty) on distinct random pages of a cache with 3 spare pages."""
    g = torch.Generator().manual_seed(seed)
    hq, ps = defn.const("num_qo_heads"), defn.const("page_size")
    counts = torch.tensor([-(-s // ps) for s in seqlens_k])
    pages = int(counts.sum()) + 3
    last = [s - (n - 1) * ps if n else 0 for s, n in zip(seqlens_k, counts.tolist())]
    b = len(seqlens_k)
    inputs = {
        "q_nope": torch.randn(b, hq, 512, generator=g).bfloat16(),
        "q_pe": torch.randn(b, hq, 64, generator=g).bfloat16(),
        "ckv_cache": torch.randn(pages, ps, 512, generator=g).bfloat16(),
        "kpe_cache": torch.randn(pages, ps, 64, generator=g).bfloat16(),
        "kv_indptr": torch.cat([torch.zeros(1), counts.cumsum(0)]).int(),
        "kv_indices": torch.randperm(pages, generator=g)[: int(counts.sum())].int(),
        "kv_last_page_len": torch.tensor(last).int(),
        "sm_scale": 1 / math.sqrt(192),
    }
    inputs = {name: inputs[name] for name in defn.inputs}
    defs.check_inputs(defn, inputs)
    return {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}


@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_bench_definition_through_the_kernel(page_size):
    name = f"mla_paged_decode_h16_ckv512_kpe64_ps{page_size}"
    why = defs.missing(name)
    if why:
        pytest.skip(why)
    defn = defs.load_definition(name)
    inputs = _definition_inputs(defn, [1, 17, 300, 0, 4096, 65])
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    ours_out, ours_lse = op.mla_paged_decode_flashinfer(**inputs)
    assert ours_out.shape == theirs_out.shape and ours_lse.shape == theirs_lse.shape
    assert ours_out.dtype == theirs_out.dtype and torch.isfinite(ours_out).all()
    assert defs.benchmark_failures(ours_out, theirs_out) == 0
    assert defs.benchmark_failures(ours_lse, theirs_lse) == 0


# ---------------------------------------------------------------- FlashMLA's FP8 cache


def _fp8_cache(pages, ps, g, *, padded=False, as_bytes=False):
    """FlashMLA's FP8 cache of random rows, each 128-column tile scaled by 2^-6 .. 2^3."""
    rand = {"device": "cuda", "generator": g}
    ckv = torch.randn(pages, ps, 4, 128, **rand)
    ckv *= torch.exp2(torch.randint(-6, 4, (pages, ps, 4, 1), **rand).float())
    kpe = torch.randn(pages, ps, 64, **rand).bfloat16()
    packed = quantize_flashmla_fp8(ckv.flatten(-2).bfloat16(), kpe)
    if padded:  # a page one row longer in memory, as FlashMLA's tests build the cache
        wide = torch.zeros(pages, ps + 1, 1, 656, device="cuda", dtype=packed.dtype)
        wide[:, :ps] = packed
        packed = wide[:, :ps]
    return packed.view(torch.uint8) if as_bytes else packed


def _fp8_refs(qn, qp, packed, table, seq, cu=None, causal=True):
    """(fp32 reference, its LSE, the same math in bf16) on the latent e4m3 x its scales."""
    q8, scale, rope = flashmla_fp8_views(packed)
    caches = (q8, rope, table, seq)
    outs = []
    for upcast in (True, False):
        kwargs = {"ckv_scale": scale, "upcast": upcast}
        if cu is None:
            outs.append(mla_decode_ref(qn, qp, *caches, SCALE, causal=causal, **kwargs))
        else:
            outs.append(mla_prefill_ref(qn, qp, *caches, cu, SCALE, causal, **kwargs))
    return outs[0][0], outs[0][1], outs[1][0]


FP8_CASES = [
    # b, hq, page_size, lens, s_q, form
    (4, 16, 64, [1, 17, 300, 0], 1, {}),
    (2, 16, 1, [64, 1000], 1, {"as_bytes": True}),
    (1, 16, 64, [16384], 1, {"padded": True}),
    (3, 128, 64, [5, 0, 513], 1, {}),
    (2, 32, 16, [129, 2048], 1, {"as_bytes": True, "padded": True}),
    (64, 16, 64, [4096] * 64, 1, {}),
    (4, 16, 64, [1, 40, 700, 4096], 2, {}),
    (3, 128, 1, [4, 129, 2000], 4, {"padded": True}),
]


@pytest.mark.parametrize(
    "case", FP8_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}" + "".join(c[5])
)
def test_mla_decode_fp8_matches_the_reference(case):
    b, hq, ps, lens, s_q, form = case
    qn, qp, _, _, table, seq = _problem(b, hq, ps, lens, s_q, True, torch.bfloat16)
    packed = _fp8_cache(b * table.shape[1] + 5, ps, torch.Generator(device="cuda").manual_seed(3),
                        **form)  # fmt: skip
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    got, lse = op.mla_decode(qn, qp, packed, None, table, seq, softmax_scale=SCALE, out=out,
                             return_lse=True)  # fmt: skip
    assert got is out
    want, want_lse, low = _fp8_refs(qn, qp, packed, table, seq)
    _check(out, lse, want, want_lse, low)


@pytest.mark.parametrize("causal", [True, False])
def test_mla_fp8_packed_and_prefill(causal):
    """The packed form (<= 4 tokens) and mla_prefill over the FP8 cache, 16 and 128 heads."""
    g = torch.Generator(device="cuda").manual_seed(4)
    for hq, q_lens, k_lens in ((16, [1, 3, 0, 2, 4], [40, 3, 10, 0, 700]),
                               (16, [1, 300, 0, 77], [40, 300, 10, 2000]),
                               (128, [129, 5], [129, 700])):  # fmt: skip
        b = len(q_lens)
        _, _, _, _, table, seq = _problem(b, hq, 64, k_lens, 1, True, torch.bfloat16)
        packed = _fp8_cache(b * table.shape[1] + 5, 64, g)
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                          device="cuda")  # fmt: skip
        q = torch.randn(int(cu[-1]), hq, 576, device="cuda", generator=g).bfloat16()
        qn, qp = q[..., :512], q[..., 512:]
        if max(q_lens) <= 4:
            out, lse = op.mla_decode(qn, qp, packed, None, table, seq, softmax_scale=SCALE,
                                     cu_seqlens_q=cu, max_seqlen_q=4, causal=causal,
                                     return_lse=True)  # fmt: skip
        else:
            out, lse = op.mla_prefill(qn, qp, packed, None, table, seq, cu, max(q_lens),
                                      softmax_scale=SCALE, causal=causal,
                                      return_lse=True)  # fmt: skip
        _check(out, lse, *_fp8_refs(qn, qp, packed, table, seq, cu, causal))


@pytest.mark.parametrize("keys", [1, 128])
def test_fp8_dequantization_is_exact_on_the_device(keys):
    """`keys` keys per sequence, every one the same cache row (page size 1, the table's entries
    repeated), so out = that row's latent (every P 1, O = keys x V / keys: exact, keys a power
    of two; one split, the plan's 256-key minimum): the kernel's e4m3 -> bf16 conversion, seen
    through the whole pass, equals e4m3 x scale bit for bit, over every finite code and the
    scales 2^-117 .. 2^7 (the NaN codes 0x7F / 0xFF replaced by 0). keys 1: tile 0, dequantized
    from registers; 128: tile 1 too, by cp.async into its stage and dequantized in place."""
    scales = torch.exp2(torch.arange(-117, 8, dtype=torch.float32))
    tokens = -(-scales.numel() // 4)
    codes = torch.arange(256, dtype=torch.uint8).repeat(2)
    codes[(codes == 0x7F) | (codes == 0xFF)] = 0
    packed = torch.zeros(tokens, 1, 1, 656, dtype=torch.uint8)
    packed[:, 0, 0, :512] = codes
    tile_scales = torch.cat([scales, torch.ones(tokens * 4 - scales.numel())]).view(tokens, 4)
    packed[:, 0, 0, 512:528] = tile_scales.view(torch.uint8).view(tokens, 16)
    packed[:, 0, 0, 528:] = torch.randn(tokens, 64).bfloat16().view(torch.uint8)
    packed = packed.cuda()
    # q = 0: every score 0, so P = exp2(0 - 0) = 1 exactly and l = keys. With random q a key's
    # P is exp2 of an FFMA's rounding residue (s x scale - round(s x scale)), not 1, and out is
    # V x bf16(P) / P: not exact (the first run, 2026-12-02 18:47, failed so).
    q = torch.zeros(tokens, 1, 16, 576, device="cuda", dtype=torch.bfloat16)
    table = torch.arange(tokens, dtype=torch.int32, device="cuda")[:, None].repeat(1, keys)
    seq = torch.full((tokens,), keys, dtype=torch.int32, device="cuda")
    out = op.mla_decode(q[..., :512], q[..., 512:], packed, None, table, seq, softmax_scale=SCALE)
    q8, scale, _ = flashmla_fp8_views(packed)
    exact = (q8[:, 0].float() * scale[:, 0].repeat_interleave(128, -1)).bfloat16()
    # Values, not bits: the fp32 accumulator starts at +0, so a -0 latent (code 0x80) comes out +0.
    want = exact[:, None].expand(-1, 16, -1).float()
    bad = (out[:, 0].float() != want).nonzero()
    assert bad.numel() == 0, (
        f"{bad.shape[0]} of {want.numel()} differ; first (token, head, column): "
        f"{bad[:4].tolist()} got {out[:, 0].float()[tuple(bad[:4].T)].tolist()} "
        f"want {want[tuple(bad[:4].T)].tolist()}"
    )


def test_mla_decode_fp8_in_a_cuda_graph():
    """Captured once, replayed on new query values and lengths over the FP8 cache."""
    qn, qp, _, _, table, seq = _problem(8, 16, 64, [4096] * 8, 1, True, torch.bfloat16)
    packed = _fp8_cache(8 * table.shape[1] + 5, 64, torch.Generator(device="cuda").manual_seed(6))
    out = torch.empty(*qn.shape[:-1], 512, device="cuda", dtype=torch.bfloat16)
    graph = captured(
        lambda: op.mla_decode(qn, qp, packed, None, table, seq, softmax_scale=SCALE, out=out)
    )
    qn.copy_(torch.randn_like(qn))
    seq.copy_(torch.tensor([1, 4096, 0, 77, 2048, 3000, 65, 64], device="cuda"))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _, low = _fp8_refs(qn, qp, packed, table, seq)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound


DIRECT_CASES = [  # (b, hq, page, lens, s_q): plans of one split at every prebuilt direct block
    (3, 16, 64, [37, 0, 100], 1),  # 16 x 1
    (4, 128, 64, [1, 63, 65, 200], 1),  # 64 x 1
    (2, 32, 64, [0, 250], 1),  # 32 x 1
    (3, 16, 64, [5, 0, 130], 2),  # 16 x 2
    (2, 128, 64, [70, 190], 2),  # 32 x 2
    (3, 16, 64, [4, 0, 129], 4),  # 16 x 4
    (132, 16, 64, [(i * 7919) % 1000 for i in range(132)], 1),  # 132 CTAs, up to 16 tiles
]


def _direct_is_the_split(launch, monkeypatch, inputs, refs, dtype, no_tma=False):
    """mla_decode with FORGEKERNEL_MLA_DIRECT 1 then 0 (plans rebuilt for each): the recorded
    pass is direct only under 1 (and, no_tma, not the TMA pass), both against the reference
    with NaN-poisoned out, and bit for bit equal (O and LSE)."""
    qn, qp, ckv, kpe, table, seq = inputs
    keys = _recorded_keys(launch, monkeypatch)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", flag)
        launch._plans.clear()
        out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True)  # fmt: skip
        torch.cuda.synchronize()
        partial = [k for k in keys if k["kind"] == "partial"][-1]
        assert partial.get("direct", False) == (flag == "1")
        if no_tma:
            assert not partial.get("tma", False)
        _check(out, lse, *refs)
        results.append((out, lse))
    launch._plans.clear()
    (out, lse), (split_out, split_lse) = results
    assert torch.equal(out, split_out)
    assert torch.equal(lse, split_lse)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_sq{c[4]}")
def test_direct_form_is_the_combine_of_one_split(case, dtype, monkeypatch):
    """The seesaw pass's direct form (one launch writing out and lse) against the reference with
    NaN-poisoned outputs and stale slots, and bit for bit against the partial pass + combine of
    the same one-split plan (FORGEKERNEL_MLA_DIRECT=0): O equal, LSE equal (both x ln 2 of the
    same fp32 log2 value)."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    (qn, qp, ckv, kpe, table, seq), (want, want_lse, low) = _poisoned_case(case, dtype)
    _direct_is_the_split(launch, monkeypatch, (qn, qp, ckv, kpe, table, seq),
                         (want, want_lse, low), dtype)  # fmt: skip


ROLES_DIRECT_CASES = [  # (b, hq, page, lens, s_q, fp8): decode.py's pass on plans of one split
    (3, 16, 16, [37, 0, 100], 1, False),  # 16 x 1, page 16
    (4, 128, 1, [1, 63, 65, 200], 1, False),  # 64 x 1, page 1
    (128, 16, 1, [(i * 7919) % 4000 for i in range(128)], 1, False),  # b128-h16, page 1
    (3, 16, 64, [5, 0, 130], 2, True),  # 16 x 2, FP8
    (2, 128, 64, [70, 190], 2, True),  # 32 x 2, FP8
    (128, 16, 64, [(i * 7919) % 8192 for i in range(128)], 1, True),  # b128-h16 FP8: 1 split
    (3, 16, 1, [4, 0, 129], 4, True),  # 16 x 4, FP8 on page 1
]


@pytest.mark.parametrize(
    "case", ROLES_DIRECT_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}_fp8{c[5]:d}"
)
def test_roles_direct_form_is_the_combine_of_one_split(case, monkeypatch):
    """decode.py's paged pass (pages of partial tiles, FlashMLA's FP8 cache) in its direct form
    on plans of one split, NaN-poisoned out: the reference, and bit for bit its partial form +
    the combine of the same plan (FORGEKERNEL_MLA_DIRECT=0). (16-bit page 1 takes the seesaw's
    gather form by default: FORGEKERNEL_MLA_GATHER=0 keeps it on decode.py's pass here.)"""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "0")
    b, hq, ps, lens, s_q, fp8 = case
    dtype = torch.bfloat16
    if fp8:
        qn, qp, _, kpe, table, seq = _problem(b, hq, ps, lens, s_q, True, dtype)
        ckv = _fp8_cache(b * table.shape[1] + 5, ps, torch.Generator(device="cuda").manual_seed(4))
        want, want_lse, low = _fp8_refs(qn, qp, ckv, table, seq)
    else:
        (qn, qp, ckv, kpe, table, seq), (want, want_lse, low) = _poisoned_case(case[:5], dtype)
    _direct_is_the_split(launch, monkeypatch, (qn, qp, ckv, kpe, table, seq),
                         (want, want_lse, low), dtype, no_tma=True)  # fmt: skip


def _packed_problem(hq, q_lens, k_lens, seed):
    """Packed queries by cu_seqlens_q over a 16-bit page-64 cache with NaN-poisoned stale
    slots: (qn, qp, ckv, kpe, table, seq, cu)."""
    _, _, ckv, kpe, table, seq = _problem(len(q_lens), hq, 64, k_lens, 1, False, torch.bfloat16)
    _poison_stale(ckv, kpe, table, k_lens, 64)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(int(cu[-1]), hq, 576, device="cuda", dtype=torch.bfloat16, generator=g)
    return q[..., :512], q[..., 512:], ckv, kpe, table, seq, cu


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("max_q", [2, 4])
def test_direct_form_packed_into_a_strided_out(causal, max_q, monkeypatch):
    """The direct form through the user's cu_seqlens_q (the op's lse (H, total_q) reaches the
    pass transposed: strides (1, total_q)) into an out that is a window of a NaN buffer (head
    stride 640, rows offset by 8 heads): every window element written, nothing around it
    touched; a sequence of no query token, one of no key, and causal tokens that see no key
    (sq > sk) give O = +-0 exactly and LSE -inf; bit for bit the combine's of the same plan."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    hq = 128
    q_lens, k_lens = [max_q, 0, max_q - 1, 1], [1, 50, 130, 0]
    qn, qp, ckv, kpe, table, seq, cu = _packed_problem(hq, q_lens, k_lens, max_q)
    rows = int(cu[-1])
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
    low, _ = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal, upcast=False)
    keys = _recorded_keys(launch, monkeypatch)
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", flag)
        launch._plans.clear()
        buf = torch.full((rows + 1, hq + 16, 640), float("nan"), device="cuda",
                         dtype=torch.bfloat16)  # fmt: skip
        out = buf[:rows, 8 : 8 + hq, :512]
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, cu_seqlens_q=cu,
                               max_seqlen_q=max_q, causal=causal, out=out,
                               return_lse=True)  # fmt: skip
        torch.cuda.synchronize()
        assert [k for k in keys if k["kind"] == "partial"][-1].get("direct", False) == (flag == "1")
        _check(out, lse, want, want_lse, low)
        around = torch.ones_like(buf, dtype=torch.bool)
        around[:rows, 8 : 8 + hq, :512] = False
        assert buf[around].isnan().all()
        none = torch.isneginf(want_lse.t())  # (rows, H): tokens that see no key
        assert torch.isneginf(lse.t()[none]).all() and (out[none] == 0).all()
        results.append((out.clone(), lse))
    launch._plans.clear()
    (out, lse), (split_out, split_lse) = results
    assert torch.equal(out, split_out) and torch.equal(lse, split_lse)


# the direct cases of config.OSTORE_BLOCKS (16 x 1 twice, 64 x 1, 32 x 2)
OSTORE_CASES = [c for c in DIRECT_CASES if (c[1] == 16 and c[4] == 1) or c[1] == 128]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", OSTORE_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_sq{c[4]}")
def test_ostore_is_the_scalar_stores(case, dtype, monkeypatch):
    """The direct plans of the ostore blocks: the default (`ostore`, out's rows 16-byte
    aligned), an out 8 bytes off (the plan of the direct form's scalar stores) and
    FORGEKERNEL_MLA_OSTORE=0: each against the reference, bit for bit alike, every element of
    out written and nothing of the NaN buffer around it."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    (qn, qp, ckv, kpe, table, seq), (want, want_lse, low) = _poisoned_case(case, dtype)
    keys = _recorded_keys(launch, monkeypatch)
    numel = qn.numel() // qn.shape[-1] * 512
    results = []
    for flag, offset, ostore in (("1", 0, True), ("1", 4, False), ("0", 0, False)):
        monkeypatch.setenv("FORGEKERNEL_MLA_OSTORE", flag)
        launch._plans.clear()
        buf = torch.full((numel + 16,), float("nan"), device="cuda", dtype=dtype)
        out = buf[offset : offset + numel].view(*qn.shape[:-1], 512)
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True)  # fmt: skip
        torch.cuda.synchronize()
        partial = [k for k in keys if k["kind"] == "partial"][-1]
        assert partial["direct"] and partial.get("ostore", False) == ostore
        _check(out, lse, want, want_lse, low)
        assert buf[:offset].isnan().all() and buf[offset + numel :].isnan().all()
        results.append((out.clone(), lse))
    launch._plans.clear()
    for out, lse in results[1:]:
        assert torch.equal(out, results[0][0]) and torch.equal(lse, results[0][1])


def test_direct_form_in_a_cuda_graph(monkeypatch):
    """A plan of one split (132 sequences of at most 256 keys: one launch, no partials) captured
    once and replayed on new queries and lengths (0, 1, 64, 65, 256): out and lse in place."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    keys = _recorded_keys(launch, monkeypatch)
    launch._plans.clear()
    b = 132
    qn, qp, ckv, kpe, table, seq = _problem(b, 16, 64, [256] * b, 1, False, torch.bfloat16)
    out = torch.empty(*qn.shape[:-1], 512, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out)
    torch.cuda.current_stream().wait_stream(side)
    assert [k for k in keys if k["kind"] == "partial"][-1].get("direct", False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True)  # fmt: skip
    lens = [(0, 1, 64, 65, 256, 200, 130)[i % 7] for i in range(b)]
    qn.copy_(torch.randn_like(qn))
    seq.copy_(torch.tensor(lens, device="cuda"))
    _poison_stale(ckv, kpe, table, lens, 64)
    out.fill_(float("nan"))
    lse.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    launch._plans.clear()
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    _check(out, lse, want, want_lse, low)


# ---------------------------------------------------------------- the device-side work list
# (candidate, FORGEKERNEL_MLA_WORKLIST=1: schedule.py, worklist.py; MLA_NOTES.md, "A device-side
# work list for ragged batches"). The CPU side (tests/test_mla_worklist.py) replays the list
# from schedule.py; here the scheduling kernel itself and the worklist pass run.

WORKLIST_LENS = [  # (lens, width in pages or None): ragged, empty, length 1, uniform
    (list(range(100, 48 * 170, 170)), None),  # the bench's mixed batch
    ([0, 1, 64, 65, 4096], None),
    ([0, 0, 0], 8),
    ([1, 1], 8),
    ([4096] * 15 + [100], None),
    ([(i * 7919) % 9000 for i in range(200)], None),
    ([16384], None),
]


def _worklist_launch(monkeypatch):
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    monkeypatch.setenv("FORGEKERNEL_MLA_WORKLIST", "1")
    launch._plans.clear()
    return launch


@pytest.mark.parametrize("blocks", [1, 2])
@pytest.mark.parametrize("qtokens", [1, 2])
@pytest.mark.parametrize("case", WORKLIST_LENS, ids=lambda c: f"b{len(c[0])}_max{max(c[0])}")
def test_scheduling_kernel_writes_the_reference_list(case, qtokens, blocks):
    """The scheduling kernel against schedule.py: row 0, every item in order, the partial LSEs
    all -inf (NaN before), rows past the items untouched."""
    from forgekernel.kernels.attention.mla.sm90 import SPEC, config, schedule
    from forgekernel.runtime.cache import get_kernel

    lens, width = case
    width = width or max(1, max(-(-n // 64) for n in lens))
    b = len(lens)
    cu, cu_l, q_blocks = None, None, 1
    if qtokens > 1:  # 0 .. 4 query tokens a sequence, blocks of 2
        q_lens = [(i * 3) % 5 for i in range(b)]
        cu_l = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        cu = torch.tensor(cu_l, dtype=torch.int32, device="cuda")
        q_blocks = -(-max(max(q_lens), 1) // qtokens)
    units = b * q_blocks
    splits, _ = config.tile_split_plan(units, blocks, width * 64, 132, config.RESIDENT)
    fewest = min(width, max(1, config.MIN_TOKENS_PER_SPLIT // 64))
    sched = get_kernel(SPEC, config.params_for("worklist", "bfloat16", qtokens=qtokens))
    rows = schedule.capacity(units, splits) + schedule.HEADER
    work = torch.full((rows, 2), -7, dtype=torch.int32, device="cuda")
    lp = torch.full((splits * 37 + 5,), float("nan"), device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sched(seq, cu, 1, q_blocks, blocks, splits, fewest, 132, width, work, lp)
    torch.cuda.synchronize()
    tiles = schedule.unit_tiles(lens, width, cu_l, True, q_blocks, qtokens)
    per_keys, items = schedule.plan(tiles, blocks, splits, fewest, 132)
    got = work.cpu()
    assert got[0].tolist() == [per_keys, len(items)]
    assert [tuple(r) for r in got[1 : 1 + len(items)].tolist()] == items
    assert bool((got[1 + len(items) :] == -7).all())
    assert bool(torch.isneginf(lp).all())


WORKLIST_CASES = [  # (b, hq, lens, s_q, width in pages or None)
    (48, 16, list(range(100, 48 * 170, 170)), 1, None),
    (5, 16, [0, 1, 64, 65, 4096], 1, None),
    (3, 16, [0, 0, 0], 1, 8),
    (4, 128, [5, 0, 513, 2000], 1, None),
    (4, 16, [700, 3, 129, 0], 2, None),
    (3, 128, [4096, 100, 1], 2, None),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", WORKLIST_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_sq{c[3]}")
def test_worklist_matches_the_reference(case, dtype, monkeypatch):
    """Ragged, empty and MTP batches through the list (NaN in stale page slots and in out;
    the partial O scratch NaN from an earlier call's leftovers is never read)."""
    launch = _worklist_launch(monkeypatch)
    keys = _recorded_keys(launch, monkeypatch)
    b, hq, lens, s_q, width = case
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, 64, lens, s_q, False, dtype)
    if width is not None:  # a wider table than the lengths
        table = torch.cat([table, table.new_zeros(b, width - table.shape[1])], 1)
    _poison_stale(ckv, kpe, table[:, :1] if width else table, lens, 64)
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
    _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                           return_lse=True)  # fmt: skip
    launch._plans.clear()
    assert any(k["kind"] == "worklist" for k in keys)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    _check(out, lse, want, want_lse, low)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)


@pytest.mark.parametrize("hq", [16, 128])
def test_worklist_uniform_is_the_standard_plan_bit_for_bit(hq, monkeypatch):
    """b16 x 4096 keys (8 x 8 tiles at 16 heads, 4 x 16 x 2 blocks at 128): the list's splits
    are the width plan's, so out and lse are the standard path's bits."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    launch._plans.clear()
    qn, qp, ckv, kpe, table, seq = _problem(16, hq, 64, [4096] * 16, 1, True, torch.bfloat16)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    _worklist_launch(monkeypatch)
    got, got_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    launch._plans.clear()
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


@pytest.mark.parametrize("causal", [True, False])
def test_worklist_packed(causal, monkeypatch):
    launch = _worklist_launch(monkeypatch)
    _packed_matches_the_reference(causal, after_call=launch._plans.clear)


def test_worklist_in_a_cuda_graph(monkeypatch):
    """Captured once on uniform lengths, replayed on ragged ones (the mixed batch's, then
    two thirds of them empty): the list is rebuilt on the device at every replay, no host read."""
    launch = _worklist_launch(monkeypatch)
    b = 48
    qn, qp, ckv, kpe, table, seq = _problem(b, 16, 64, [8128] * b, 1, True, torch.bfloat16)
    out = torch.empty(*qn.shape[:-1], 512, device="cuda", dtype=torch.bfloat16)
    made = {}

    def step():  # the captured call's lse is the graph's (the last call's)
        made["lse"] = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                                    return_lse=True)[1]  # fmt: skip

    graph = captured(step)
    lse = made["lse"]
    mixed = list(range(100, b * 170, 170))
    for lens in (mixed, [0 if i % 3 else n for i, n in enumerate(mixed)]):
        qn.copy_(torch.randn_like(qn))
        seq.copy_(torch.tensor(lens, device="cuda"))
        _poison_stale(ckv, None, table, lens, 64)
        out.fill_(float("nan"))
        lse.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
        low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
        _check(out, lse, want, want_lse, low)
    launch._plans.clear()


@pytest.mark.parametrize(("ps", "s_q", "hq"), [(64, 1, 16), (64, 2, 16), (64, 1, 128), (1, 1, 16)])
def test_a_wide_table_around_short_sequences(ps, s_q, hq):
    """A serving engine's captured graph passes a table sized for its longest context (163840
    tokens) around short sequences: the splits come from the width, each sequence's keys spread
    over them by its own length (whole tiles); garbage page ids past each sequence's pages."""
    b, width = 8, 163840
    lens = [700, 1, 4096, 0, 300, 2500, 129, 1000]
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, ps, lens, s_q, False, torch.bfloat16, seed=5)
    g = torch.Generator(device="cuda").manual_seed(6)
    wide = torch.randint(0, ckv.shape[0], (b, width // ps), device="cuda", generator=g)
    wide[:, : table.shape[1]] = table  # random page ids past the narrow table's width
    wide = wide.to(torch.int32)
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=torch.bfloat16)
    _, lse = op.mla_decode(qn, qp, ckv, kpe, wide, seq, softmax_scale=SCALE, out=out,
                           return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    _check(out, lse, want, want_lse, low)


@pytest.mark.parametrize("b, hq", [(1, 16), (1, 128), (132, 16)])
def test_pdl_chain_is_the_serialized_chain(b, hq):
    """graphs.assert_pdl_chain_is_serialized: call i + 1's q_nope call i's out, every call's
    partials in the same scratch (b1 x 4k at 16 / 128 heads: the seesaw pass and the combine;
    b132 at 16 heads: the direct form alone)."""
    _, qp, ckv, kpe, table, seq = _problem(b, hq, 64, [4096] * b, 1, True, torch.bfloat16, 5)
    q0 = torch.randn(b, 1, hq, 512, device="cuda", dtype=torch.bfloat16)
    assert_pdl_chain_is_serialized(
        lambda q, out, _: op.mla_decode(q, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out),
        q0,
    )


# ---------------------------------------------------------------- a decode step's schedule
# (forgekernel.mla_decode_schedule; MLA_NOTES.md, "A decode step's schedule, built"). The CPU
# side (tests/test_mla_schedule.py) replays the ranges form from schedule.py; here the
# scheduling kernel's ranges form, the pass writing by item and the combine over item ranges.

RAGGED_BENCH = [round(512 * 2 ** (i / 5)) for i in range(32)]  # the suite's b32 ragged


@pytest.mark.parametrize("qtokens", [1, 2])
@pytest.mark.parametrize("case", [*WORKLIST_LENS, (RAGGED_BENCH, None)],
                         ids=lambda c: f"b{len(c[0])}_max{max(c[0])}")  # fmt: skip
def test_schedule_kernel_writes_the_reference_ranges(case, qtokens):
    """The scheduling kernel's ranges form against schedule.py's ranged_plan: row 0, the items
    unit by unit, each row's (first item, items, token); rows past the items untouched."""
    from forgekernel.kernels.attention.mla.sm90 import SPEC, config, schedule
    from forgekernel.runtime.cache import get_kernel

    lens, width = case
    width = width or max(1, max(-(-n // 64) for n in lens))
    b = len(lens)
    cu, cu_l, q_blocks = None, None, 1
    if qtokens > 1:
        q_lens = [(i * 3) % 5 for i in range(b)]
        cu_l = [0, *torch.tensor(q_lens).cumsum(0).tolist()]
        cu = torch.tensor(cu_l, dtype=torch.int32, device="cuda")
        q_blocks = -(-max(max(q_lens), 1) // qtokens)
    units = b * q_blocks
    fewest = min(width, max(1, config.MIN_TOKENS_PER_SPLIT // 64))
    cap = schedule.ranged_capacity(units, 132)
    sched = get_kernel(SPEC, config.params_for("worklist", "bfloat16", qtokens=qtokens,
                                               ranges=True))  # fmt: skip
    work = torch.full((cap + schedule.HEADER, 2), -7, dtype=torch.int32, device="cuda")
    rows = torch.full((b * 4, 3), -7, dtype=torch.int32, device="cuda")
    seq = torch.tensor(lens, dtype=torch.int32, device="cuda")
    sched(seq, cu, 1, q_blocks, 1, 8, fewest, 132, width, work, rows)
    torch.cuda.synchronize()
    tiles = schedule.unit_tiles(lens, width, cu_l, True, q_blocks, qtokens)
    per_keys, items, ranges = schedule.ranged_plan(tiles, 1, fewest, 132, cap)
    got = work.cpu()
    assert got[0].tolist() == [per_keys, len(items)]
    assert [tuple(r) for r in got[1 : 1 + len(items)].tolist()] == items
    assert bool((got[1 + len(items) :] == -7).all())
    want_rows = schedule.row_ranges(ranges, b * 4, cu_l, q_blocks, qtokens)
    for r, row in enumerate(rows.cpu().tolist()):
        assert tuple(row) == (want_rows[r] if want_rows[r] is not None else (-7, -7, -7))


SCHEDULE_CASES = [  # (b, hq, lens, s_q)
    (32, 16, RAGGED_BENCH, 1),
    (48, 16, list(range(100, 48 * 170, 170)), 1),
    (5, 16, [0, 1, 64, 65, 4096], 1),
    (4, 128, [5, 0, 513, 2000], 1),
    (4, 16, [700, 3, 129, 0], 2),
    (3, 128, [4096, 100, 1], 2),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SCHEDULE_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_sq{c[3]}")
def test_one_schedule_serves_three_layers(case, dtype):
    """One schedule, three layers' queries and caches, NaN in stale page slots, in out and in
    the partial scratch before every call: each layer's output the reference's."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    b, hq, lens, s_q = case
    table, seq = _problem(b, hq, 64, lens, s_q, False, dtype)[4:]
    schedule = op.mla_decode_schedule(seq, hq, table, page_size=64, s_q=s_q, dtype=dtype)
    for layer in range(3):
        qn, qp, ckv, kpe, _, _ = _problem(b, hq, 64, lens, s_q, False, dtype, seed=layer)
        _poison_stale(ckv, kpe, table, lens, 64)
        items = schedule.work.shape[0] - 1
        qtokens = launch.query_tokens(s_q > 1, s_q, hq)
        for t in launch._partials(items, qtokens, hq, qn.device):
            t.fill_(float("nan"))
        out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True, schedule=schedule)  # fmt: skip
        want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
        low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
        _check(out, lse, want, want_lse, low)


@pytest.mark.parametrize("hq", [16, 128])
def test_schedule_uniform_is_the_default_bit_for_bit(hq):
    """b16 x 4096: the schedule's per and splits are the width plan's, the combine adds the
    same splits in the same order: the default path's bits."""
    qn, qp, ckv, kpe, table, seq = _problem(16, hq, 64, [4096] * 16, 1, True, torch.bfloat16)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    schedule = op.mla_decode_schedule(seq, hq, table, page_size=64)
    got, got_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True, schedule=schedule)  # fmt: skip
    assert torch.equal(got, out) and torch.equal(got_lse, lse)


def test_schedule_in_a_cuda_graph():
    """A step captured once (the schedule, then two layers' calls), replayed on the mixed
    lengths and on two thirds of them empty: the list is remade on the device every replay."""
    b = 48
    qn, qp, ckv, kpe, table, seq = _problem(b, 16, 64, [8128] * b, 1, True, torch.bfloat16)
    out = torch.empty(2, *qn.shape[:-1], 512, device="cuda", dtype=torch.bfloat16)
    lse = torch.empty(2, b, 16, 1, device="cuda")

    def step():
        schedule = op.mla_decode_schedule(seq, 16, table, page_size=64)
        for layer in range(2):
            op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out[layer],
                          lse=lse[layer], schedule=schedule)  # fmt: skip

    graph = captured(step)
    mixed = list(range(100, b * 170, 170))
    for lens in (mixed, [0 if i % 3 else n for i, n in enumerate(mixed)]):
        qn.copy_(torch.randn_like(qn))
        seq.copy_(torch.tensor(lens, device="cuda"))
        _poison_stale(ckv, None, table, lens, 64)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
        low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
        for layer in range(2):
            _check(out[layer], lse[layer], want, want_lse, low)


def test_pdl_scheduled_chain_is_the_serialized_chain():
    """The chain test's form with a decode step's schedule (b32 ragged, the bench's case): the
    scheduling kernel's ranges form, then the ranges pass and combine of every call (the
    combine reads each row's item range after its griddepcontrol.wait)."""
    b, hq = len(RAGGED_BENCH), 16
    _, qp, ckv, kpe, table, seq = _problem(b, hq, 64, RAGGED_BENCH, 1, True, torch.bfloat16, 5)
    q0 = torch.randn(b, 1, hq, 512, device="cuda", dtype=torch.bfloat16)
    assert_pdl_chain_is_serialized(
        lambda q, out, schedule: op.mla_decode(
            q, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out, schedule=schedule
        ),  # fmt: skip
        q0,
        prologue=lambda: op.mla_decode_schedule(seq, hq, table, page_size=64),
    )


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize(
    ("b", "hq", "n", "s_q"),
    [
        (64, 16, 4096, 1),
        (16, 128, 4096, 1),
        (64, 16, 4096, 2),
        (48, 16, 8128, 1),
        (8, 16, 16384, 1),
    ],
)
def test_combine_forms_agree_below_the_warp_bound(b, hq, n, s_q, scheduled):
    """The bench's combine cases that moved to the CTA form (combine_form.FEW_FORM_UNITS, D 512:
    1024-2048 rows x heads, 2-4 splits a row; the mixed batch's rows of a few items; b8 x 16k's
    16 splits, the few path's second round): its few-splits path gives the warp form's bits
    (tests/gpu/test_paged_gpu.py `test_few_path_is_the_warp_form_bit_for_bit`), through the
    plain and the scheduled calls, the MTP decode form's rows from its schedule (rows_cu); both
    the reference's."""
    combine_form = importlib.import_module("forgekernel.kernels.attention.paged.sm90.combine_form")
    lens = list(range(100, b * 170, 170)) if b == 48 else [n] * b
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, 64, lens, s_q, True, torch.bfloat16)
    schedule = None
    if scheduled:
        schedule = op.mla_decode_schedule(seq, hq, table, page_size=64, s_q=s_q)
        assert schedule.work.shape[0] > 1 and (schedule.rows_cu is not None) == (s_q > 1)
    got = []
    for form in ("cta", "warps"):
        with combine_form.combine_form(form):
            got.append(op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                     return_lse=True, schedule=schedule))  # fmt: skip
    (out, lse), (warp, warp_lse) = got
    assert torch.equal(out, warp) and torch.equal(lse, warp_lse)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    _check(out, lse, want, want_lse, low)
