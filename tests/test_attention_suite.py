"""The attention suite on the CPU: cases well-formed, work counts exact, and the harness's
comparison accepts a correct kernel (including LSE = -inf rows) and rejects a wrong one."""

import collections
import dataclasses
import importlib
import math

import pytest
import torch

from forgekernel.bench.check import verify
from forgekernel.bench.suites import attention as suite_module
from forgekernel.reference.attention import attention_ref, attention_varlen_ref

attention_module = importlib.import_module("forgekernel.ops.attention")
SUITE = suite_module.suite()
CPU = torch.device("cpu")


def test_cases_are_well_formed():
    for cases in (SUITE.check_cases, SUITE.bench_cases):
        assert len({c.name for c in cases}) == len(cases)
        for c in cases:
            p = c.params
            assert (p["d"], p["dv"]) in attention_module.SUPPORTED_HEAD_DIMS, c.name
            assert p["hq"] % p["hkv"] == 0, c.name
            if p.get("varlen"):
                assert len(p["lens_q"]) == len(p["lens_k"]) and max(p["lens_q"]) >= 1, c.name
            else:
                assert min(p["b"], p["sq"], p["sk"]) >= 1, c.name
    assert "b4-hq32-hkv2-s8192-d128-causal" in {c.name for c in SUITE.bench_cases}
    varlen = suite_module.LEGACY_BENCH_CASES[-1].params
    assert len(varlen["lens_q"]) == 16 and 256 <= min(varlen["lens_q"]) <= max(varlen["lens_q"])
    assert max(varlen["lens_q"]) <= 8192 and varlen["lens_q"] == varlen["lens_k"]
    ratios = {c.params["hq"] // c.params["hkv"] for c in SUITE.check_cases}
    assert {1, 4, 16} <= ratios
    lengths = {c.params.get("sq") for c in SUITE.check_cases}
    lengths |= {n for c in SUITE.check_cases for n in c.params.get("lens_q", ())}
    assert lengths >= {1, 17, 1000, 4097}
    dims = {(c.params["d"], c.params["dv"]) for c in SUITE.check_cases}
    assert dims == set(attention_module.SUPPORTED_HEAD_DIMS)
    assert any(c.params.get("varlen") for c in SUITE.check_cases)
    assert list(SUITE.dtypes_for_bench()) == [torch.bfloat16]


CLASSES = {"causal-d128", "gqa16", "non-causal", "d64", "d96", "d256", "d192-128", "chunked"}
CLASSES |= {"varlen"}


def _ratio(p):
    return p["hq"] // p["hkv"]


def test_bench_samples_every_class():
    cases = SUITE.bench_cases
    assert 30 <= len(cases) <= 42  # one bench call; 41 since Llama-3.2 1B's D = 64 GQA rows
    groups = collections.Counter(c.group for c in cases)
    assert set(groups) == CLASSES and min(groups.values()) >= 3
    dims = {(c.params["d"], c.params["dv"]) for c in cases}
    assert dims == set(attention_module.SUPPORTED_HEAD_DIMS)
    assert {1, 4, 8, 16} <= {_ratio(c.params) for c in cases}
    fixed = [c for c in cases if not c.params.get("varlen")]
    lengths = {c.params["sk"] for c in fixed}
    assert min(lengths) == 512 and max(lengths) == 32768
    assert {c.params["causal"] for c in fixed} == {True, False}
    for c in fixed:
        p = c.params
        by_dim = {64: "d64", 96: "d96", 256: "d256", 192: "d192-128"}
        if c.group in by_dim.values():
            assert by_dim[p["d"]] == c.group, c.name
        elif c.group == "chunked":
            assert p["causal"] and 512 <= p["sq"] <= 2048 and 8192 <= p["sk"] <= 32768, c.name
        else:
            assert p["d"] == 128 and p["sq"] == p["sk"], c.name
            assert (c.group == "non-causal") == (not p["causal"]), c.name
            if p["causal"]:
                assert (c.group == "gqa16") == (_ratio(p) == 16), c.name
    varlen = [c.params for c in cases if c.params.get("varlen")]
    assert all(c.group == "varlen" for c in cases if c.params.get("varlen"))
    assert any(p["lens_q"] != p["lens_k"] for p in varlen)  # chunked prefill, per sequence
    assert list(SUITE.dtypes_for_bench()) == [torch.bfloat16]


def test_bench_keeps_the_legacy_suite():
    names = [c.name for c in SUITE.bench_cases]
    legacy = [c.name for c in suite_module.LEGACY_BENCH_CASES]
    assert names[: len(legacy)] == legacy and len(legacy) == 11
    for b, s in ((16, 2048), (8, 4096), (4, 8192), (2, 16384), (1, 32768)):
        assert f"b{b}-hq64-hkv4-s{s}-d128-causal" in legacy
    assert "b2-hq128-hkv128-s8192-d192-dv128-causal" in legacy


def test_check_cases_sample_every_bench_class():
    groups = {c.group for c in SUITE.check_cases if c.group}
    assert groups == CLASSES
    small = [c for c in SUITE.check_cases if c.group and not c.params.get("varlen")]
    assert all(c.params["b"] * c.params["sq"] * c.params["sk"] <= 2**23 for c in small)


def test_sanitize_cases_cover_every_head_dim_small_and_odd():
    cases = SUITE.sanitize_cases
    assert len({c.name for c in cases}) == len(cases)
    dims = {(c.params["d"], c.params["dv"]) for c in cases}
    assert dims == set(attention_module.SUPPORTED_HEAD_DIMS)
    fixed = [c.params for c in cases if not c.params.get("varlen")]
    assert {p["causal"] for p in fixed} == {True, False}
    assert any(p["hq"] > p["hkv"] and p["sq"] < 64 for p in fixed)  # packed GQA
    assert any(p["sq"] > p["sk"] for p in fixed if p["causal"])  # rows that see no key
    assert any(p["sq"] < p["sk"] for p in fixed)
    varlen = [c.params for c in cases if c.params.get("varlen")]
    assert varlen and any(0 in p["lens_q"] for p in varlen)
    assert all(p["sq"] <= 1000 for p in fixed)  # the sanitizers slow a kernel down 10-100x


def brute_pairs(sq, sk, causal):
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    return int((j <= i + sk - sq).sum()) if causal else sq * sk


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 7), (5, 13), (13, 5), (1, 9), (9, 1)])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_count_unmasked_pairs(sq, sk, causal):
    case = suite_module._case(2, 4, 2, sq, 192, causal, sk=sk, dv=128)
    assert SUITE.flops(case) == 4 * 2 * 4 * (192 + 128) / 2 * brute_pairs(sq, sk, causal)


def test_flops_causal_square_is_half_plus_diagonal():
    case = suite_module._case(4, 32, 2, 8192, 128)
    assert SUITE.flops(case) == 4 * 4 * 32 * 128 * 8192 * 8193 / 2


def test_bytes_are_q_k_v_o():
    case = suite_module._case(2, 8, 2, 10, 192, sk=30, dv=128)
    elems = 2 * (10 * 8 * 192 + 30 * 2 * 192 + 30 * 2 * 128 + 10 * 8 * 128)
    assert SUITE.bytes(case, torch.bfloat16) == 2 * elems


def closed_form_pairs(sq, sk):
    """Bottom-right causal: Sq <= Sk: every row sees the Sk - Sq prefix and a triangle;
    Sq > Sk: the last Sk rows see a triangle, the first Sq - Sk rows nothing."""
    if sq <= sk:
        return sq * (sk - sq) + sq * (sq + 1) // 2
    return sk * (sk + 1) // 2


@pytest.mark.parametrize("sq, sk", [(1, 1), (5, 13), (13, 5), (300, 4097), (4097, 300)])
def test_closed_form_is_the_brute_count(sq, sk):
    assert closed_form_pairs(sq, sk) == brute_pairs(sq, sk, True)


def test_flops_of_every_bench_case_are_exact():
    for c in SUITE.bench_cases:
        p = c.params
        seqs = zip(p["lens_q"], p["lens_k"]) if p.get("varlen") else [(p["sq"], p["sk"])] * p["b"]
        pairs = [closed_form_pairs(q, k) if p["causal"] else q * k for q, k in seqs]
        assert SUITE.flops(c) == 2 * p["hq"] * (p["d"] + p["dv"]) * sum(pairs), c.name


def test_chunked_prefill_flops():
    """b1 hq32 Sq 2048 against Sk 8192, causal bottom-right: 6144 cached keys per row plus a
    2048 x 2049 / 2 triangle."""
    case = suite_module._case(1, 32, 8, 2048, 128, sk=8192)
    pairs = 2048 * 6144 + 2048 * 2049 // 2
    assert SUITE.flops(case) == 4 * 32 * 128 * pairs


def test_varlen_flops_sum_the_sequences():
    case = suite_module._varlen_case((5, 13, 1), (13, 5, 9), hq=4, hkv=2, d=192, dv=128)
    pairs = sum(brute_pairs(sq, sk, True) for sq, sk in ((5, 13), (13, 5), (1, 9)))
    assert SUITE.flops(case) == 4 * 4 * (192 + 128) / 2 * pairs


def test_comparators_resolve_without_a_gpu():
    assert set(SUITE.comparators()) == {"fa4", "cudnn"}


@pytest.mark.parametrize(
    "case, same",
    [
        (suite_module._case(1, 4, 2, 5, 64), True),
        (suite_module._case(1, 4, 2, 5, 64, sk=13, causal=False), True),
        (suite_module._case(1, 4, 2, 5, 64, sk=13), False),
        (suite_module._case(1, 4, 2, 13, 64, sk=5), False),
        (suite_module._varlen_case((3, 5), hq=4, hkv=2, d=64, causal=False), False),
    ],
    ids=lambda x: getattr(x, "name", str(x)),
)
def test_cudnn_refuses_other_semantics(case, same):
    """SDPA's causal mask is top-left aligned: cuDNN is timed only where it computes ours."""
    inputs = SUITE.make_inputs(case, torch.bfloat16, CPU, torch.Generator().manual_seed(0))
    if same:
        suite_module.refuse_other_semantics(inputs)
    else:
        with pytest.raises(NotImplementedError):
            suite_module.refuse_other_semantics(inputs)


def correct_kernel(inputs, out):
    if "cu_seqlens_q" in inputs:
        o, lse = attention_varlen_ref(
            inputs["q"],
            inputs["k"],
            inputs["v"],
            inputs["cu_seqlens_q"],
            inputs["cu_seqlens_k"],
            inputs["causal"],
            inputs["softmax_scale"],
        )
    else:
        o, lse = attention_ref(
            inputs["q"], inputs["k"], inputs["v"], inputs["causal"], inputs["softmax_scale"]
        )
    out[0].copy_(o)
    out[1].copy_(lse)
    return out


# Sq > Sk causal: rows 0..8 see no key (LSE = -inf, O = 0); plus GQA, Dv != D and a scale.
DEAD_ROWS = suite_module._case(2, 4, 1, 13, 192, sk=4, dv=128)
SMALL = (
    DEAD_ROWS,
    suite_module._case(1, 4, 4, 17, 64, False, scale=0.3),
    suite_module._varlen_case((3, 0, 17), (5, 2, 0), hq=4, hkv=2, d=64),
)


def _verify(run_ours, case, dtype=torch.bfloat16):
    suite = dataclasses.replace(SUITE, run_ours=run_ours)
    inputs = suite.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(0))
    return verify(suite, inputs, CPU)[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_a_correct_kernel_passes(case, dtype):
    cmps = _verify(correct_kernel, case, dtype)
    assert len(cmps) == 2 and all(c.ok for c in cmps), [c.message for c in cmps]


def test_suite_runs_varlen_through_the_public_op_into_out(monkeypatch):
    varlen_module = importlib.import_module("forgekernel.ops.attention_varlen")
    monkeypatch.setattr(varlen_module, "check_cuda", lambda name, t: None)

    def launch(q, k, v, o, lse, seqs, scale, causal):
        inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": seqs[0], "cu_seqlens_k": seqs[1]}
        correct_kernel({**inputs, "causal": causal, "softmax_scale": scale}, (o, lse))

    monkeypatch.setattr(varlen_module, "_launch_varlen_fwd", launch)
    assert all(c.ok for c in _verify(suite_module.run_ours, SMALL[-1]))


@pytest.mark.parametrize("dead_lse", [math.nan, 0.0, math.inf])
def test_dead_rows_must_be_exactly_minus_inf(dead_lse):
    def kernel(inputs, out):
        correct_kernel(inputs, out)
        out[1][:, :, :9] = dead_lse
        return out

    o_cmp, lse_cmp = _verify(kernel, DEAD_ROWS)
    assert o_cmp.ok and not lse_cmp.ok


def test_a_wrong_kernel_fails():
    def kernel(inputs, out):
        correct_kernel(inputs, out)
        out[0][:, -1] += 0.05
        return out

    assert not _verify(kernel, DEAD_ROWS)[0].ok


def test_suite_runs_the_public_op_into_out(monkeypatch):
    """run_ours goes through `attention(..., out=)`, writing the harness's poisoned buffers."""
    monkeypatch.setattr(attention_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(
        attention_module,
        "_launch_fwd",
        lambda q, k, v, o, lse, scale, causal: correct_kernel(
            {"q": q, "k": k, "v": v, "causal": causal, "softmax_scale": scale}, (o, lse)
        ),
    )
    for case in SMALL[:2]:  # the fixed-length ones
        assert all(c.ok for c in _verify(suite_module.run_ours, case))


def test_host_case_is_tiny_and_sdpa_computes_the_same():
    """bench's host time per call runs on a problem the device finishes before the next call;
    the host comparator (SDPA, default backend) computes what ours does."""
    case = SUITE.host_case
    assert case.group == "host" and SUITE.flops(case) < 1e9
    assert set(suite_module.host_comparators()) == {"sdpa"}
    inputs = SUITE.make_inputs(case, torch.float32, CPU, torch.Generator().manual_seed(0))
    o_ref, _ = attention_ref(inputs["q"], inputs["k"], inputs["v"], True, None)
    o = suite_module.sdpa_default(inputs).transpose(1, 2)
    torch.testing.assert_close(o, o_ref.to(o.dtype), atol=1e-4, rtol=1e-4)


def test_the_ledger_hashes_the_kernel_and_its_dispatch():
    """The attention ledger's key covers the forward's import closure and its dispatch: the
    leaf's `__init__` (standard keys, PACK_CLASSES), the launcher and the two ops."""
    from forgekernel.kernels.attention.fwd.sm90 import SPEC
    from forgekernel.runtime.hashing import PACKAGE_ROOT

    sources = SUITE.kernel_sources
    names = {p.resolve().relative_to(PACKAGE_ROOT).as_posix() for p in sources}
    assert {"kernels/attention/fwd/sm90/__init__.py", "kernels/attention/fwd/sm90/launch.py",
            "ops/attention.py", "ops/attention_varlen.py"} <= names  # fmt: skip
    assert set(SPEC.sources) <= set(sources) and len(set(sources)) == len(sources)
