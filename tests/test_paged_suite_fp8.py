"""The attention_paged suite's FP8 (e4m3) cache cases on the CPU: the bench cases asked for
(group "fp8", parameters in the names), their inputs (cache dtype, scales per tensor / per KV
head, the e4m3 range used), bytes at 1 byte per cached element, the suite's own check on the
FP8 check cases through the paged kernel's algorithm replayed in Python (tests/
test_attention_paged.py's `cpu_kernels`) with the dequantized 16-bit computation as its
yardstick (and a kernel that misreads per-head scales failing it), the comparators dict without
FlashInfer, and the FlashInfer comparator wired to a stand-in of FlashInfer 0.7.2.post1's decode
wrapper (plan's kv_data_type, run's float k_scale / v_scale with the semantics read in its
source: k_scale folded into sm_scale, out *= v_scale), per-head scales refused with the reason."""

from __future__ import annotations

import sys
import types

import pytest
import torch
from test_attention_paged import cpu_kernels  # noqa: F401  (the fixture, used by name)

from forgekernel.bench import check
from forgekernel.bench.suites import attention_paged as paged
from forgekernel.reference.paged_attention import paged_attention_ref

CPU = torch.device("cpu")
SUITE = paged.suite()
FP8_BENCH = [c for c in paged.BENCH_CASES if c.group == "fp8"]
E4M3 = torch.float8_e4m3fn


def _inputs(case, dtype=torch.bfloat16, seed=0):
    return paged.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(seed))


def _twin(case):
    """The same problem with a cache in q's dtype."""
    p = {k: v for k, v in case.params.items() if k not in ("kv", "scale")}
    return paged._case(p["b"], p["hq"], p["hkv"], p["d"], p["page"], p["lens"])


# ----------------------------------------------------------------------------- cases


def test_fp8_bench_cases_are_the_serving_points():
    shapes = {(c.params["b"], c.params["hq"], c.params["hkv"], c.params["lens"][0],
               c.params["scale"]) for c in FP8_BENCH}  # fmt: skip
    assert shapes == {(64, 32, 8, 4096, "tensor"), (1, 32, 8, 32768, "tensor"),
                      (32, 64, 8, 4096, "tensor"), (64, 32, 8, 4096, "head")}  # fmt: skip
    for c in FP8_BENCH:
        assert c.params["kv"] == paged.FP8 and c.params["d"] == 128 and c.params["page"] == 16
        assert c.name == f"{_twin(c).name}-kv_e4m3-per_{c.params['scale']}"
    for cases in (paged.BENCH_CASES, paged.CHECK_CASES):
        assert len({c.name for c in cases}) == len(cases)
    assert {c.params["scale"] for c in paged.FP8_CHECK_CASES} == set(paged.SCALES)
    assert paged.FP8_CHECK_CASES[0] in SUITE.sanitize_cases


def test_fp8_needs_a_known_scale_granularity():
    with pytest.raises(ValueError, match="fp8 scales"):
        paged._case(1, 8, 2, 128, 16, 64, fp8="block")


@pytest.mark.parametrize("case", paged.FP8_CHECK_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_fp8_inputs(case, dtype):
    i = _inputs(case, dtype)
    hkv = case.params["hkv"]
    assert i["q"].dtype == dtype and i["k"].dtype == i["v"].dtype == E4M3
    assert i["k"].shape == i["v"].shape and i["k"].shape[1:] == (case.params["page"], hkv,
                                                                 case.params["d"])  # fmt: skip
    for name in ("k", "v"):
        x = i[name].float()
        assert torch.isfinite(x).all() and 150 < x.abs().max() <= paged.FP8_MAX  # e4m3's range
        assert 50 < x.std() < 80  # N(0, 64^2) draws
    if case.params["scale"] == "tensor":
        for name in ("k_scale", "v_scale"):
            s = i[name]
            assert isinstance(s, float) and 0.5 <= s * paged.FP8_SPREAD <= 2.0
            heads = i[f"{name}_heads"]
            assert heads.dtype == torch.float32 and torch.equal(heads, torch.full((hkv,), s))
        assert i["k_scale"] != i["v_scale"]
    else:
        for name in ("k_scale", "v_scale"):
            s = i[name]
            assert s.dtype == torch.float32 and s.shape == (hkv,) and s.is_contiguous()
            spread = s * paged.FP8_SPREAD
            assert ((spread >= 0.25) & (spread <= 2.0)).all() and len(set(s.tolist())) == hkv
        assert "k_scale_heads" not in i


def test_16bit_cases_keep_their_inputs():
    i = _inputs(paged.CHECK_CASES[0], torch.float16)
    assert i["k"].dtype == i["v"].dtype == i["q"].dtype == torch.float16
    assert i["k_scale"] is None and i["v_scale"] is None
    assert all("kv" not in c.params for c in paged.BENCH_CASES if c.group != "fp8")


def test_bytes_count_one_byte_per_cached_element():
    for c in FP8_BENCH:
        p = c.params
        want = 2.0 * sum(p["lens"]) * p["hkv"] * p["d"]
        assert paged.nbytes(c, torch.bfloat16) == want
        assert paged.nbytes(_twin(c), torch.bfloat16) == 2 * want
    long = next(c for c in FP8_BENCH if c.params["b"] == 1)  # 32k tokens: the real tensors
    i = _inputs(long)
    rows = int(i["seqlens"].sum()) * i["k"].shape[2] * i["k"].shape[3]
    assert paged.nbytes(long, torch.bfloat16) == 2 * rows * i["k"].element_size()


# ----------------------------------------------------------------------------- the check


@pytest.mark.usefixtures("cpu_kernels")
@pytest.mark.parametrize("case", paged.FP8_CHECK_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_passes_on_the_kernel_replay(case, dtype):
    rec = check.check_case(SUITE, case, dtype, CPU, seed=11)
    assert rec["passed"], rec["message"]
    out, lse = rec["outputs"]
    assert out["lowprec_err"] > 0 and out["err"] <= out["bound"]  # the 16-bit dequantization
    for name, run in SUITE.variants_for(case).items():
        cmps = check.verify(SUITE, _inputs(case, dtype, seed=3), CPU, run=run)[1]
        assert all(c.ok for c in cmps), (name, [c.message for c in cmps])


def test_low_precision_is_the_dequantized_16bit_computation():
    case = paged.FP8_CHECK_CASES[1]
    i = _inputs(case)
    ks, vs = i["k_scale"], i["v_scale"]
    k = (i["k"].float() * ks[:, None]).bfloat16()
    v = (i["v"].float() * vs[:, None]).bfloat16()
    want, want_lse = paged_attention_ref(i["q"], k, v, i["table"], i["seqlens"], upcast=False)
    got, got_lse = paged.low_precision(i)
    assert got.dtype == torch.bfloat16 and torch.equal(got, want)
    assert torch.equal(got_lse, want_lse)


def test_check_fails_a_kernel_that_reads_per_head_scales_as_one():
    case = next(c for c in paged.FP8_CHECK_CASES if c.params["scale"] == "head")
    i = _inputs(case)

    def per_tensor_kernel(inputs, out):
        o, lse = paged_attention_ref(inputs["q"], inputs["k"], inputs["v"], inputs["table"],
                                     inputs["seqlens"], k_scale=float(inputs["k_scale"][0]),
                                     v_scale=float(inputs["v_scale"][0]))  # fmt: skip
        out[0].copy_(o), out[1].copy_(lse)
        return out

    cmps = check.verify(SUITE, i, CPU, run=per_tensor_kernel)[1]
    assert not cmps[0].ok and not cmps[1].ok


# ----------------------------------------------------------------------------- FlashInfer


def test_comparators_without_flashinfer(monkeypatch):
    none = {"flashinfer": None, "flashinfer_cc": None, "flashinfer_fa3": None, "fa4": None}
    assert paged.comparators() == none  # no GPU here
    monkeypatch.setitem(sys.modules, "flashinfer", None)  # import flashinfer: ImportError
    monkeypatch.setitem(sys.modules, "flash_attn.cute", None)  # FA4 absent too
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert paged._flashinfer() is None and paged._flashinfer_fa3() is None
    assert paged._flashinfer_cc() is None
    assert paged._fa4() is None
    assert paged.comparators() == none


class _DecodeWrapper:
    """FlashInfer 0.7.2.post1's BatchDecodeWithPagedKVCacheWrapper as far as the comparator
    uses it, computing what its source computes for an FP8 cache: the raw e4m3 values with
    k_scale folded into sm_scale, the output times v_scale after the kernel (LSE base 2)."""

    made: list[_DecodeWrapper] = []

    def __init__(self, workspace, layout, use_tensor_cores=False, backend="auto"):
        assert layout == "NHD" and backend == "fa2"
        self.tensor_cores = use_tensor_cores
        self.plans, self.runs = [], []
        _DecodeWrapper.made.append(self)

    def plan(self, indptr, indices, last, hq, hkv, d, page_size, *, q_data_type, kv_data_type):
        self.plans.append({"q": q_data_type, "kv": kv_data_type, "page_size": page_size})
        self.lists = indptr, indices, last

    def run(self, q, cache, *, k_scale=None, v_scale=None, return_lse=False):
        k, v = cache
        self.runs.append({"k": k, "v": v, "k_scale": k_scale, "v_scale": v_scale})
        assert k.dtype == self.plans[-1]["kv"] and q.dtype == self.plans[-1]["q"]
        assert k_scale is None or isinstance(k_scale, float)
        indptr, indices, last = self.lists
        ps = self.plans[-1]["page_size"]
        counts = (indptr[1:] - indptr[:-1]).tolist()
        table = torch.zeros(len(counts), max(1, max(counts)), dtype=torch.int32)
        for b, n in enumerate(counts):
            table[b, :n] = indices[indptr[b] : indptr[b] + n]
        seq = torch.tensor([(n - 1) * ps + int(lp) if n else 0 for n, lp in zip(counts, last)])
        sm_scale = q.shape[-1] ** -0.5 * (1.0 if k_scale is None else k_scale)
        o, lse = paged_attention_ref(q, k, v, table, seq.int(), softmax_scale=sm_scale,
                                     k_scale=1.0, v_scale=1.0)  # fmt: skip
        o = o.to(q.dtype)
        if v_scale is not None:
            o *= v_scale
        return o, lse * 1.4426950408889634


@pytest.fixture
def fake_flashinfer(monkeypatch):
    mod = types.ModuleType("flashinfer")
    mod.BatchDecodeWithPagedKVCacheWrapper = _DecodeWrapper
    monkeypatch.setitem(sys.modules, "flashinfer", mod)
    _DecodeWrapper.made.clear()
    return _DecodeWrapper.made


def test_flashinfer_gets_the_fp8_cache_and_per_tensor_scales(fake_flashinfer):
    case = next(c for c in paged.FP8_CHECK_CASES if c.params["scale"] == "tensor")
    i = _inputs(case)
    run = paged._flashinfer()
    o, lse = run(i)
    run(i)  # planned once per input set
    (w,) = fake_flashinfer
    assert w.tensor_cores
    assert w.plans == [{"q": torch.bfloat16, "kv": E4M3, "page_size": case.params["page"]}]
    for r in w.runs:
        assert r["k"] is i["k"] and r["v"] is i["v"]
        assert (r["k_scale"], r["v_scale"]) == (i["k_scale"], i["v_scale"])
    want, want_lse = paged.reference(i)
    low, _ = paged.low_precision(i)
    err, low_err = (o.float() - want).abs().max(), (low.float() - want).abs().max()
    assert err <= 2 * low_err + SUITE.atol  # the same problem as ours
    finite = torch.isfinite(want_lse)
    assert torch.allclose(lse[finite] / 1.4426950408889634, want_lse[finite], atol=1e-4)


def test_flashinfer_refuses_per_head_scales_with_the_reason(fake_flashinfer):
    case = next(c for c in FP8_BENCH if c.params["scale"] == "head")
    small = paged._case(2, 32, 8, 128, 16, (40, 90), fp8="head")
    assert small.params["scale"] == case.params["scale"]
    with pytest.raises(NotImplementedError, match="not per KV head"):
        paged._flashinfer()(_inputs(small))
    assert not fake_flashinfer  # refused before any plan


def test_flashinfer_16bit_cache_unchanged(fake_flashinfer):
    i = _inputs(paged.CHECK_CASES[0])
    paged._flashinfer()(i)
    (w,) = fake_flashinfer
    assert w.plans[0]["kv"] == torch.bfloat16 and w.runs[0]["k_scale"] is None


def test_flashinfer_cc_is_the_cuda_core_decode_on_16bit_d128(fake_flashinfer):
    """flashinfer_cc: the decode wrapper without tensor cores, planned once per input set, on
    16-bit D 128 decode cases; packed cases, FP8 caches and other head dims are refused with
    the reason before any plan."""
    i = _inputs(paged._case(3, 32, 4, 128, 16, (40, 0, 300)))
    run = paged._flashinfer_cc()
    o, lse = run(i)
    run(i)
    (w,) = fake_flashinfer
    assert not w.tensor_cores and len(w.plans) == 1 and len(w.runs) == 2
    want, _ = paged.reference(i)
    low, _ = paged.low_precision(i)
    assert (o.float() - want).abs().max() <= 2 * (low.float() - want).abs().max() + SUITE.atol
    refused = (
        paged.CHECK_CASES[0],  # D 64
        paged.FP8_CHECK_CASES[0],  # FP8 cache, D 128
        paged.SPEC_CHECK_CASES[4],  # packed, 16-bit, D 128
    )
    for case in refused:
        with pytest.raises(NotImplementedError, match="16-bit D 128 decode"):
            run(_inputs(case))
    assert len(fake_flashinfer) == 1  # refused before any plan
