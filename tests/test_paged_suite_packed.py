"""The attention_paged suite's packed cases on the CPU (speculative decoding: group "spec",
chunked prefill: group "prefill"): the bench cases asked for (serving shapes, parameters in the
names), the check cases (every mode, odd sizes, both dtypes), their inputs, the reference on them
against an independent fp64 computation per sequence, the FLOP and byte counts against direct
counts, the suite's own check through the paged kernel's replay (tests/test_attention_paged.py's
`cpu_kernels`) and the gather path (the varlen forward's reference standing in for its kernel),
and the FlashInfer comparators wired to a stand-in of FlashInfer 0.7.2.post1's prefill wrapper
that computes what its source computes (the fa2 kernel's causal mask condition verbatim, base-2
LSE (total_q, Hq), k_scale folded into sm_scale, out *= v_scale); the FA4 comparator's paged
varlen arguments through a stand-in of `flash_attn_varlen_func` that reads them as FA4's
interface documents them (pages by table row up to seqused_k, bottom-right causal)."""

from __future__ import annotations

import importlib
import math
import sys
import types

import pytest
import torch
from test_attention_paged import cpu_kernels  # noqa: F401  (the fixture, used by name)
from test_attention_paged_prefill import cpu_paged_kernel  # noqa: F401  (the fixture)
from test_paged_suite_fp8 import _DecodeWrapper

from forgekernel.bench import check
from forgekernel.bench.suites import attention_paged as paged
from forgekernel.reference.attention import attention_varlen_ref

CPU = torch.device("cpu")
SUITE = paged.suite()
SPEC = [c for c in paged.BENCH_CASES if c.group == "spec"]
PREFILL = [c for c in paged.BENCH_CASES if c.group == "prefill"]
PACKED_CHECKS = paged.SPEC_CHECK_CASES + paged.PREFILL_CHECK_CASES
# a chunked-prefill batch the size of a check case, built the way the bench's are
MINI_PREFILL = paged._prefill_case(8, 2, 16, (40, 70), (0, 130), (5, 33, 17), "mini")
LOG2E = 1.0 / math.log(2.0)
op_module = importlib.import_module("forgekernel.ops.attention_paged")


def _inputs(case, dtype=torch.bfloat16, seed=0):
    return paged.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(seed))


def _q_lens(case):
    return case.params.get("q_lens") or (1,) * case.params["b"]


# ----------------------------------------------------------------------------- cases


def test_spec_bench_cases_are_speculative_decoding_batches():
    assert len(SPEC) >= 6 and {max(_q_lens(c)) for c in SPEC} == {2, 4}
    for c in SPEC:
        p = c.params
        assert max(p["q_lens"]) <= op_module.MAX_QUERY_TOKENS and min(p["q_lens"]) >= 1
        assert (p["d"], p["page"], p["hkv"]) == (128, 16, 8) and p["hq"] in (32, 64)
        assert 32 <= p["b"] <= 64 and max(p["lens"]) <= 8192
        assert all(n >= q for n, q in zip(p["lens"], p["q_lens"]))  # the cache holds the drafts
    uniform = {(c.params["hq"], c.params["q_lens"][0]) for c in SPEC if "mixed" not in c.name}
    assert uniform == {(32, 2), (32, 4), (64, 2), (64, 4)}
    assert {c.params["lens"][0] for c in SPEC if c.params["hq"] == 32} >= {2048, 4096, 8192}
    assert any(len(set(c.params["q_lens"])) > 1 for c in SPEC)  # ragged drafts


def test_prefill_bench_cases_are_chunked_prefill_batches():
    assert len(PREFILL) >= 4 and {c.params["page"] for c in PREFILL} == {16, 64}
    for c in PREFILL:
        p = c.params
        q, kv = p["q_lens"], p["lens"]
        assert max(q) > op_module.MAX_QUERY_TOKENS  # the forward's paged mode
        assert q.count(1) >= 3 and all(n >= s for n, s in zip(kv, q))  # decode rows beside
        chunks = [(s, n - s) for s, n in zip(q, kv) if s > 1]
        assert all(s <= 4096 and cached <= 16384 for s, cached in chunks)
        assert p["d"] == 128 and "kv" not in p
    chunked = [c for c in PREFILL if "ragged" not in c.name]
    sizes = {s for c in chunked for s in c.params["q_lens"] if s > 1}
    cached = {n - s for c in chunked for s, n in zip(c.params["q_lens"], c.params["lens"]) if s > 1}
    assert min(sizes) == 512 and max(sizes) == 4096 and min(cached) == 0 and max(cached) == 16384
    assert {c.params["hq"] for c in PREFILL} == {32, 64}
    ragged = next(c for c in PREFILL if "ragged" in c.name)
    assert 0 in ragged.params["q_lens"] and any(n % 64 for n in ragged.params["lens"])


def test_case_names_and_order():
    for cases in (paged.BENCH_CASES, paged.CHECK_CASES):
        assert len({c.name for c in cases}) == len(cases)
    # the decode cases keep their place (bench seeds are the case's index) and names
    assert paged.BENCH_CASES[: len(paged.DECODE_BENCH_CASES)] == paged.DECODE_BENCH_CASES
    assert all("q_lens" not in c.params for c in paged.DECODE_BENCH_CASES)
    assert SPEC[0].name == "b64-hq32-hkv8-d128-p16-L4096-sq2"
    assert MINI_PREFILL.name == "b5-hq8-hkv2-d128-p16-mini-q113"
    assert MINI_PREFILL.params["lens"] == (5, 33, 17, 40, 200)
    with pytest.raises(ValueError, match="q_lens: 2 values for a batch of 3"):
        paged._case(3, 8, 2, 64, 16, 100, q_lens=(1, 2))


def test_check_cases_cover_every_mode():
    modes = {"decode": 0, "spec": 0, "prefill": 0}
    for c in paged.CHECK_CASES:
        q = c.params.get("q_lens")
        mode = "decode" if q is None else ("spec" if max(q) <= 4 else "prefill")
        modes[mode] += 1
    assert min(modes.values()) >= 4
    for cases in (paged.SPEC_CHECK_CASES, paged.PREFILL_CHECK_CASES):
        assert {c.params["d"] for c in cases} == {64, 128, 256}
        assert {c.params.get("scale") for c in cases} > {None}  # an FP8 cache among them
        assert any(0 in c.params["q_lens"] for c in cases[:2])  # a sequence without queries
    rows = [(s, n) for c in paged.SPEC_CHECK_CASES for s, n in zip(_q_lens(c), c.params["lens"])]
    assert any(s > n for s, n in rows)  # rows that see no key
    assert {c.params["scale"] for c in PACKED_CHECKS if "scale" in c.params} == set(paged.SCALES)
    assert paged.SPEC_CHECK_CASES[1] in SUITE.sanitize_cases
    # the forward's paged mode under the sanitizers: D 128 / page 16, D 256 / page 32
    sanitized = [c for c in SUITE.sanitize_cases if c in paged.PREFILL_CHECK_CASES]
    assert {(c.params["d"], c.params["page"]) for c in sanitized} == {(128, 16), (256, 32)}
    assert SUITE.dtypes == (torch.bfloat16, torch.float16)


# ----------------------------------------------------------------------------- inputs


@pytest.mark.parametrize("case", [*PACKED_CHECKS, MINI_PREFILL], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_packed_inputs(case, dtype):
    i = _inputs(case, dtype)
    p, q_lens = case.params, case.params["q_lens"]
    assert i["q"].dtype == dtype and i["q"].shape == (sum(q_lens), p["hq"], p["d"])
    assert i["cu_seqlens_q"].dtype == torch.int32
    assert i["cu_seqlens_q"].tolist() == [0, *torch.tensor(q_lens).cumsum(0).tolist()]
    assert i["max_seqlen_q"] == max(q_lens)
    assert i["seqlens"].tolist() == list(p["lens"]) and i["table"].shape[0] == p["b"]
    assert i["k"].dtype == (torch.float8_e4m3fn if "kv" in p else dtype)
    out, lse = paged.alloc_out(i)
    assert out.shape == i["q"].shape and out.dtype == dtype
    assert lse.shape == (p["hq"], sum(q_lens)) and lse.dtype == torch.float32


def test_decode_inputs_stay_unpacked():
    i = _inputs(paged.CHECK_CASES[0])
    assert "cu_seqlens_q" not in i and i["q"].shape[0] == 3
    assert paged.alloc_out(i)[1].shape == (3, 8)


def test_a_bench_prefill_case_builds_on_the_cpu():
    case = min(PREFILL, key=lambda c: paged.nbytes(c, torch.bfloat16))
    i = _inputs(case)
    q_lens, lens, ps = case.params["q_lens"], case.params["lens"], case.params["page"]
    assert i["q"].shape[0] == sum(q_lens) and i["cu_seqlens_q"][-1] == sum(q_lens)
    used = [-(-n // ps) for n in lens]
    pages = torch.cat([i["table"][b, :u] for b, u in enumerate(used)])
    assert pages.unique().numel() == sum(used) and int(pages.max()) < i["k"].shape[0]


# ----------------------------------------------------------------------------- reference


def _fp64_attention(inputs):
    """Each sequence on its own in fp64: its keys read page by page from the table, dequantized,
    query i of s_q seeing key j iff j <= i + kv_len - s_q; (out (rows, Hq, D), lse (rows, Hq))."""
    q, k, v, table, seq = (inputs[n] for n in ("q", "k", "v", "table", "seqlens"))
    rows, hq, d = q.shape
    ps, hkv = k.shape[1], k.shape[2]
    cu = inputs.get("cu_seqlens_q")
    cu = cu.tolist() if cu is not None else list(range(rows + 1))
    scales = []
    for s in (inputs["k_scale"], inputs["v_scale"]):
        s = torch.ones(hkv) if s is None else torch.as_tensor(s, dtype=torch.float64)
        scales.append(s.double().expand(hkv)[None, :, None])
    out = torch.zeros(rows, hq, d, dtype=torch.float64)
    lse = torch.full((rows, hq), -math.inf, dtype=torch.float64)
    heads = torch.arange(hq) // (hq // hkv)
    for b in range(table.shape[0]):
        q0, q1, n = cu[b], cu[b + 1], int(seq[b])
        if q1 == q0:
            continue
        slots = [(int(table[b, t // ps]), t % ps) for t in range(n)]
        kk, vv = (
            torch.stack([c[pg, sl].double() for pg, sl in slots])[:, heads] * s[:, heads]
            if n
            else torch.zeros(0, hq, d, dtype=torch.float64)
            for c, s in zip((k, v), scales)
        )
        scores = torch.einsum("ihd,jhd->hij", q[q0:q1].double(), kk) / math.sqrt(d)
        sq = q1 - q0
        seen = torch.arange(n)[None, :] <= torch.arange(sq)[:, None] + n - sq
        scores = scores.masked_fill(~seen, -math.inf)
        row_lse = torch.logsumexp(scores, -1)  # (Hq, sq), -inf where no key is seen
        p = torch.where(seen, torch.exp(scores - row_lse[..., None]), 0.0).nan_to_num(0.0)
        out[q0:q1] = torch.einsum("hij,jhd->ihd", p, vv)
        lse[q0:q1] = row_lse.t()
    return out, lse


@pytest.mark.parametrize("case", [*PACKED_CHECKS, MINI_PREFILL], ids=lambda c: c.name)
def test_reference_matches_an_fp64_computation(case):
    i = _inputs(case, seed=4)
    out, lse = paged.reference(i)
    want, want_lse = _fp64_attention(i)
    assert out.dtype == torch.float32 and lse.shape == (case.params["hq"], i["q"].shape[0])
    lse = lse.t().double()
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((out.double() - want).abs().max()) < 2e-5
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 2e-5
    assert torch.all(out[~finite] == 0)
    low, low_lse = paged.low_precision(i)
    assert low.dtype == torch.bfloat16 and low_lse.shape == lse.t().shape
    assert 0 < float((low.double() - want).abs().max()) < 0.1  # the bf16 yardstick


# ----------------------------------------------------------------------------- counts


def _visible_pairs(q_lens, lens):
    """Visible (query, key) pairs counted off an explicit bottom-right mask."""
    total = 0
    for sq, n in zip(q_lens, lens):
        i, j = torch.arange(sq)[:, None], torch.arange(n)[None, :]
        total += int((j <= i + n - sq).sum())
    return total


@pytest.mark.parametrize("case", [*PACKED_CHECKS, MINI_PREFILL], ids=lambda c: c.name)
def test_flops_count_the_visible_pairs(case):
    p = case.params
    pairs = _visible_pairs(p["q_lens"], p["lens"])
    assert paged.flops(case) == 4.0 * p["hq"] * p["d"] * pairs


def test_bench_flops_in_closed_form():
    """Every bench row has kv_len >= s_q: sum over i of (kv_len - s_q + i + 1) keys."""
    for c in paged.BENCH_CASES:
        p = c.params
        pairs = sum(s * (n - s) + s * (s + 1) // 2 for s, n in zip(_q_lens(c), p["lens"]))
        assert paged.flops(c) == 4.0 * p["hq"] * p["d"] * pairs, c.name
        if "q_lens" not in p:  # decode: the count before the packed modes
            assert paged.flops(c) == 4.0 * sum(p["lens"]) * p["hq"] * p["d"]
    big = next(c for c in PREFILL if c.params["q_lens"][-1] == 4096 and c.params["hq"] == 32)
    assert 1.3e12 < paged.flops(big) < 1.4e12  # 4096 new over 12288 alone: 58.7M pairs


@pytest.mark.parametrize("case", [*SPEC, *PREFILL, *PACKED_CHECKS], ids=lambda c: c.name)
def test_bytes_count_the_cache_once_and_the_query_rows(case):
    p = case.params
    kv_size = 1 if "kv" in p else 2
    kv = 2 * sum(p["lens"]) * p["hkv"] * p["d"] * kv_size
    q_o = 2 * sum(p["q_lens"]) * p["hq"] * p["d"] * 2
    assert paged.nbytes(case, torch.bfloat16) == kv + q_o
    assert paged.nbytes(case, torch.float32) == kv * (2 if kv_size == 2 else 1) + 2 * q_o


def test_decode_bytes_unchanged():
    for c in paged.DECODE_BENCH_CASES:
        p = c.params
        per = 1 if "kv" in p else 2
        assert paged.nbytes(c, torch.bfloat16) == 2.0 * sum(p["lens"]) * p["hkv"] * p["d"] * per


# ----------------------------------------------------------------------------- the check


def _varlen_stand_in(q, k, v, cu_q, cu_k, max_q, max_k, causal, softmax_scale, return_lse, out):
    """The varlen forward's reference in place of its kernel, writing into `out` as it does."""
    o, lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal=causal, softmax_scale=softmax_scale)
    if out is None:
        return o.to(q.dtype), lse
    out[0].copy_(o), out[1].copy_(lse)
    return out


@pytest.fixture
def cpu_paths(cpu_kernels, cpu_paged_kernel, monkeypatch):  # noqa: F811  (imported fixtures)
    monkeypatch.setattr(op_module, "_attention_varlen", _varlen_stand_in)
    return cpu_kernels, cpu_paged_kernel


@pytest.mark.parametrize("case", [*PACKED_CHECKS, MINI_PREFILL], ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_passes_on_the_cpu_paths(cpu_paths, case, dtype):
    rec = check.check_case(SUITE, case, dtype, CPU, seed=7)
    assert rec["passed"], rec["message"]
    # the decode stand-in's calls: cpu_paged_kernel installs its own (its .decode), after
    # cpu_kernels' (whose list then stays empty)
    prefill = cpu_paths[1]
    decode = prefill.decode
    spec = max(case.params["q_lens"]) <= op_module.MAX_QUERY_TOKENS
    # the forward's paged mode for the 16-bit prefill cases (pages 16 / 32 / 64), the gather
    # for the FP8 one at page 1
    assert bool(prefill) == (not spec and "kv" not in case.params)
    # the paged kernel's replay: the spec cases, and the decode rows of a prefill in the split
    # form (the packed default, where the batch's G has a compile, runs them in its one launch)
    packed = bool(prefill) and "view_group" in prefill[0]
    assert bool(decode) == (spec or (bool(prefill) and not packed))
    if spec:
        assert decode[-1][0].get("qtokens") == (2 if max(case.params["q_lens"]) <= 2 else 4)
    for name, run in SUITE.variants_for(case).items():
        cmps = check.verify(SUITE, _inputs(case, dtype, seed=3), CPU, run=run)[1]
        assert all(c.ok for c in cmps), (name, [c.message for c in cmps])


def test_check_fails_a_top_left_causal_mask():
    """A kernel aligning the mask top-left (query i sees keys 0 .. i: bottom-right attention
    over a sequence's first s_q keys) fails the check."""
    case = paged.PREFILL_CHECK_CASES[0]
    q_lens = torch.tensor(case.params["q_lens"], dtype=torch.int32)

    def top_left(inputs, out):
        o, lse = paged.reference({**inputs, "seqlens": torch.minimum(inputs["seqlens"], q_lens)})
        out[0].copy_(o), out[1].copy_(lse)
        return out

    cmps = check.verify(SUITE, _inputs(case), CPU, run=top_left)[1]
    assert not cmps[0].ok and not cmps[1].ok


# ----------------------------------------------------------------------------- FlashInfer


class _PrefillWrapper:
    """FlashInfer 0.7.2.post1's BatchPrefillWithPagedKVCacheWrapper as far as the comparators
    use it, computing what its source computes: per request of qo_indptr, the KV length from
    the page lists ((pages - 1) x page_size + last), the fa2 kernel's causal mask (prefill.cuh:
    masked where kv_idx + qo_len > kv_len + q_idx), sm_scale x k_scale, out *= v_scale after
    the kernel, LSE base 2 (total_q, Hq) written into the buffers run is given."""

    made: list[_PrefillWrapper] = []

    def __init__(self, workspace, layout, backend="auto"):
        assert layout == "NHD" and workspace.dtype == torch.uint8
        self.backend, self.plans, self.runs = backend, [], []
        _PrefillWrapper.made.append(self)

    def plan(self, qo_indptr, indptr, indices, last, hq, hkv, d, page_size, *, causal=False,
             q_data_type, kv_data_type):  # fmt: skip
        self.plans.append({"causal": causal, "q": q_data_type, "kv": kv_data_type,
                           "heads": (hq, hkv, d), "page_size": page_size})  # fmt: skip
        self.lists = qo_indptr.clone(), indptr.clone(), indices.clone(), last.clone()

    def run(self, q, cache, *, k_scale=None, v_scale=None, out=None, lse=None, return_lse=False):
        k, v = cache
        self.runs.append({"out": out, "lse": lse, "k_scale": k_scale, "v_scale": v_scale})
        assert k.dtype == self.plans[-1]["kv"] and q.dtype == self.plans[-1]["q"] and return_lse
        qo, indptr, indices, last = (t.tolist() for t in self.lists)
        ps, (hq, hkv, d) = self.plans[-1]["page_size"], self.plans[-1]["heads"]
        sm_scale = d**-0.5 * (1.0 if k_scale is None else k_scale)
        heads = torch.arange(hq) // (hq // hkv)
        for b in range(len(qo) - 1):
            pages = indices[indptr[b] : indptr[b + 1]]
            kv_len = (len(pages) - 1) * ps + last[b] if pages else 0
            qo_len = qo[b + 1] - qo[b]
            kk, vv = (c[pages].flatten(0, 1)[:kv_len, heads].float() for c in (k, v))
            s = torch.einsum("ihd,jhd->hij", q[qo[b] : qo[b + 1]].float(), kk) * sm_scale
            q_idx, kv_idx = torch.arange(qo_len)[:, None], torch.arange(kv_len)[None, :]
            if self.plans[-1]["causal"]:
                s = s.masked_fill(kv_idx + qo_len > kv_len + q_idx, -math.inf)
            row = torch.logsumexp(s, -1)
            p = torch.exp(s - row[..., None]).nan_to_num(0.0)
            out[qo[b] : qo[b + 1]] = torch.einsum("hij,jhd->ihd", p, vv).to(out.dtype)
            lse[qo[b] : qo[b + 1]] = row.t() * LOG2E
        if v_scale is not None:
            out *= v_scale
        return out, lse


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _DecodeWrapper
    mod.BatchPrefillWithPagedKVCacheWrapper = _PrefillWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _DecodeWrapper.made.clear(), _PrefillWrapper.made.clear()
    return _PrefillWrapper.made


def _agrees(inputs, o, lse_base2):
    """FlashInfer's (out, base-2 LSE (total_q, Hq)) is the problem ours solves."""
    want, want_lse = paged.reference(inputs)
    low, _ = paged.low_precision(inputs)
    err, low_err = (o.float() - want).abs().max(), (low.float() - want).abs().max()
    assert err <= 2 * low_err + SUITE.atol
    lse = lse_base2.t() / LOG2E
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-4)


@pytest.mark.parametrize("backend", ["fa2", "fa3"])
@pytest.mark.parametrize(
    "case", [paged.SPEC_CHECK_CASES[0], paged.PREFILL_CHECK_CASES[0], MINI_PREFILL],
    ids=lambda c: c.name,
)  # fmt: skip
def test_flashinfer_prefill_wrapper_on_packed_cases(fake_flashinfer, backend, case):
    i = _inputs(case)
    run = (paged._flashinfer if backend == "fa2" else paged._flashinfer_fa3)()
    o, lse = run(i)
    o2, lse2 = run(i)  # planned once per input set, writing the same buffers
    (w,) = fake_flashinfer
    assert w.backend == backend and not _DecodeWrapper.made
    assert w.plans == [{"causal": True, "q": torch.bfloat16, "kv": torch.bfloat16,
                        "heads": (case.params["hq"], case.params["hkv"], case.params["d"]),
                        "page_size": case.params["page"]}]  # fmt: skip
    qo, indptr, indices, last = w.lists
    assert torch.equal(qo, i["cu_seqlens_q"]) and qo.dtype == indptr.dtype == torch.int32
    lens = case.params["lens"]
    ps = case.params["page"]
    assert (indptr[1:] - indptr[:-1]).tolist() == [-(-n // ps) for n in lens]
    assert [((n - 1) % ps + 1) if n else 0 for n in lens] == last.tolist()
    assert o2 is o and lse2 is lse and all(r["out"] is o and r["lse"] is lse for r in w.runs)
    assert o.shape == i["q"].shape and lse.shape == (i["q"].shape[0], case.params["hq"])
    _agrees(i, o, lse)


def test_flashinfer_fp8_packed_case_gets_per_tensor_scales(fake_flashinfer):
    case = paged.PREFILL_CHECK_CASES[3]
    assert case.params["scale"] == "tensor"
    i = _inputs(case)
    o, lse = paged._flashinfer()(i)
    (w,) = fake_flashinfer
    assert w.plans[0]["kv"] == torch.float8_e4m3fn
    assert (w.runs[0]["k_scale"], w.runs[0]["v_scale"]) == (i["k_scale"], i["v_scale"])
    _agrees(i, o, lse)


@pytest.mark.parametrize(
    ("maker", "case", "match"),
    [
        ("_flashinfer_fa3", paged.CHECK_CASES[0], "decode cases"),
        ("_flashinfer_fa3", paged.PREFILL_CHECK_CASES[3], "FP8 queries"),
        ("_flashinfer", paged.SPEC_CHECK_CASES[3], "not per KV head"),
    ],
)
def test_flashinfer_refusals_say_why(fake_flashinfer, maker, case, match):
    with pytest.raises(NotImplementedError, match=match):
        getattr(paged, maker)()(_inputs(case))
    assert not fake_flashinfer and not _DecodeWrapper.made  # refused before any plan


def test_flashinfer_decode_cases_keep_the_decode_wrapper(fake_flashinfer):
    i = _inputs(paged.CHECK_CASES[4])
    o, lse = paged._flashinfer()(i)
    assert not fake_flashinfer and len(_DecodeWrapper.made) == 1
    want, want_lse = paged.reference(i)
    assert float((o.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite] / LOG2E, want_lse[finite], atol=1e-4)


# ----------------------------------------------------------------------------- FA4


def _fa4_varlen(q, k, v, *, cu_seqlens_q, max_seqlen_q, seqused_k, page_table, causal,
                softmax_scale, return_lse):  # fmt: skip
    """flash_attn.cute.flash_attn_varlen_func (flash-attn-4 4.0.0b36) as its interface
    documents the paged varlen call: sequence b's queries q[cu[b]:cu[b + 1]], its keys the first
    seqused_k[b] rows of its pages page_table[b] (k / v (num_pages, page_size, Hkv, D)), GQA
    head h on KV head h // (Hq / Hkv), causal bottom-right; (out, lse (Hq, total_q) natural)."""
    assert page_table.dtype == seqused_k.dtype == cu_seqlens_q.dtype == torch.int32
    assert page_table.stride(-1) == 1 and return_lse
    ps, hkv = k.shape[1], k.shape[2]
    group = q.shape[1] // hkv
    out = torch.zeros(q.shape, dtype=q.dtype)
    lse = torch.full((q.shape[1], q.shape[0]), -math.inf)
    for b in range(page_table.shape[0]):
        q0, q1, sk = int(cu_seqlens_q[b]), int(cu_seqlens_q[b + 1]), int(seqused_k[b])
        assert q1 - q0 <= max_seqlen_q
        if q1 == q0 or sk == 0:
            continue
        pages = page_table[b, : -(-sk // ps)].long()
        kk = k[pages].flatten(0, 1)[:sk].double().repeat_interleave(group, 1)
        vv = v[pages].flatten(0, 1)[:sk].double().repeat_interleave(group, 1)
        s = torch.einsum("qhd,khd->hqk", q[q0:q1].double(), kk) * softmax_scale
        if causal:
            i = torch.arange(q1 - q0)[:, None]
            s = s.masked_fill(torch.arange(sk)[None, :] > i + sk - (q1 - q0), -math.inf)
        top = s.amax(-1, keepdim=True).clamp_min(-1e300)
        e = torch.exp(s - top)
        total = e.sum(-1)
        o = torch.einsum("hqk,khd->qhd", e, vv) / total.T[..., None].clamp_min(1e-300)
        out[q0:q1] = o.to(q.dtype)
        lse[:, q0:q1] = torch.where(total > 0, top[..., 0] + torch.log(total), -math.inf).float()
    return out, lse


@pytest.fixture
def fake_fa4(monkeypatch):
    calls = []

    def flash_attn_varlen_func(q, k, v, **kw):
        calls.append(kw)
        return _fa4_varlen(q, k, v, **kw)

    mod = types.ModuleType("flash_attn.cute")
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    monkeypatch.setitem(sys.modules, "flash_attn.cute", mod)
    return calls


@pytest.mark.parametrize(
    "case",
    [paged.CHECK_CASES[0], paged.CHECK_CASES[1], paged.SPEC_CHECK_CASES[0],
     paged.PREFILL_CHECK_CASES[0], paged.PREFILL_CHECK_CASES[1], MINI_PREFILL],
    ids=lambda c: c.name,
)  # fmt: skip
def test_fa4_paged_varlen_arguments_compute_the_reference(fake_fa4, case):
    """FA4's arguments from the case (`fa4_args`): the packed form's cu_seqlens_q and
    max_seqlen_q (decode: 0 .. batch and 1), seqused_k the KV lengths, the suite's table (pages
    1 / 16 / 64, a sequence without keys, one without queries), built once per input set; read
    as FA4 reads them they give the suite's reference."""
    i = _inputs(case)
    run = paged._fa4()
    o, lse = run(i)
    o2, _ = run(i)
    (kw, kw2) = fake_fa4
    # built once per input set (the first call, outside any timed one)
    assert kw == kw2 == i["fa4"] and kw["cu_seqlens_q"] is kw2["cu_seqlens_q"]
    assert kw["seqused_k"] is i["seqlens"] and kw["page_table"] is i["table"]
    if "cu_seqlens_q" in i:
        assert kw["cu_seqlens_q"] is i["cu_seqlens_q"]
        assert kw["max_seqlen_q"] == i["max_seqlen_q"]
    else:
        assert kw["cu_seqlens_q"].tolist() == list(range(case.params["b"] + 1))
        assert kw["max_seqlen_q"] == 1
    assert kw["causal"] and kw["softmax_scale"] == case.params["d"] ** -0.5
    want, want_lse = paged.reference(i)
    want_lse = want_lse if "cu_seqlens_q" in i else want_lse.T  # decode's (batch, Hq)
    assert float((o.float() - want).abs().max()) < 2e-2 and torch.equal(o, o2)
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert torch.allclose(lse[finite], want_lse[finite], atol=1e-4)


def test_fa4_refuses_fp8_caches_with_the_reason(fake_fa4):
    for case in (paged.FP8_CHECK_CASES[0], paged.PREFILL_CHECK_CASES[3]):
        with pytest.raises(NotImplementedError, match="SM100"):
            paged._fa4()(_inputs(case))
    assert not fake_fa4


def test_fa4_runs_every_16bit_bench_group():
    """FA4 is a comparator of every group but the FP8 one's (refused there with the reason)."""
    groups = {c.group for c in paged.BENCH_CASES if "kv" not in c.params}
    assert {"prefill", "spec"} <= groups
    assert all("kv" in c.params for c in paged.BENCH_CASES if c.group == "fp8")
