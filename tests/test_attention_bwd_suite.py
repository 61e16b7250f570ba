"""The attention backward suite on the CPU: cases cover what OPS.md asks, work counts are 2.5x the
forward's, the harness's comparison accepts a correct backward (zero dq on rows that see no key,
GQA-summed dk/dv) and rejects wrong ones, run_ours goes through the public op, the ledger key is
the bwd kernel leaf's sources, and the CLI knows the operator."""

import collections
import dataclasses
import importlib
import sys
import types

import pytest
import torch

from forgekernel import cli
from forgekernel.bench.check import verify
from forgekernel.bench.suites import SUITE_MODULES, get_suite
from forgekernel.bench.suites import attention as fwd_suite_module
from forgekernel.bench.suites import attention_bwd as suite_module
from forgekernel.reference.attention import attention_bwd_ref, attention_varlen_bwd_ref

bwd_module = importlib.import_module("forgekernel.ops.attention_bwd")
SUITE = suite_module.suite()
CPU = torch.device("cpu")


def test_registered_and_named():
    assert SUITE_MODULES["attention_bwd"] == "forgekernel.bench.suites.attention_bwd"
    assert get_suite("attention_bwd").name == "attention_bwd"


# OPS.md's head-dim pairs for the backward; the kernel offers a subset (BWD_HEAD_DIMS), and the
# suite runs the cases it offers.
OPS_HEAD_DIMS = ((64, 64), (128, 128), (192, 128))


def test_bench_cases_are_the_ops_md_suite():
    names = {c.name for c in suite_module.BENCH_CASES}
    for b, s in ((8, 4096), (4, 8192), (2, 16384)):
        assert f"b{b}-hq32-hkv32-s{s}-d128-causal" in names
        assert f"b{b}-hq64-hkv8-s{s}-d128-causal" in names
    assert "b2-hq32-hkv32-s8192-d64-causal" in names
    assert "b2-hq128-hkv128-s8192-d192-dv128-causal" in names
    legacy = suite_module.LEGACY_BENCH_CASES
    assert all(c.params["causal"] and c.params["sq"] == c.params["sk"] for c in legacy)
    assert [c.name for c in suite_module.BENCH_CASES[: len(legacy)]] == [c.name for c in legacy]
    assert list(SUITE.dtypes_for_bench()) == [torch.bfloat16]
    cases = suite_module.BENCH_CASES + suite_module.VARLEN_BENCH_CASES
    offered = [c for c in cases if (c.params["d"], c.params["dv"]) in DIMS]
    assert list(SUITE.bench_cases) == offered and len(offered) >= 8


BWD_CLASSES = {"causal-d128", "gqa16", "gqa-short", "non-causal", "d64", "d192-128", "chunked"}


def test_bench_samples_every_class_the_backward_offers():
    cases = suite_module.BENCH_CASES + suite_module.VARLEN_BENCH_CASES
    # 27: the two GQA 16:1 neighbours of b8-hq32-hkv2-s4096 (issue 17, BWD_NOTES.md "GQA 16 at
    # 4096")
    assert 20 <= len(cases) <= 27 and len({c.name for c in cases}) == len(cases)
    groups = collections.Counter(c.group for c in cases)
    assert set(groups) == BWD_CLASSES | {"varlen"}
    assert all(groups[g] >= 2 for g in BWD_CLASSES)
    assert {(c.params["d"], c.params["dv"]) for c in cases} == set(OPS_HEAD_DIMS)
    for c in cases:
        p, ratio = c.params, c.params["hq"] // c.params["hkv"]
        if c.group == "gqa16":
            assert ratio == 16 and p["causal"], c.name
        elif c.group == "gqa-short":
            assert ratio > 1 and p["sq"] <= 1024 and p["causal"], c.name
        elif c.group == "non-causal":
            assert not p["causal"] and p["d"] == 128, c.name
        elif c.group == "chunked":
            assert p["causal"] and 512 <= p["sq"] <= 2048 and 8192 <= p["sk"] <= 32768, c.name
        elif c.group == "d64":
            assert p["d"] == 64, c.name
        elif c.group == "d192-128":
            assert (p["d"], p["dv"]) == (192, 128), c.name
    assert {4, 8, 16} <= {c.params["hq"] // c.params["hkv"] for c in cases}
    assert {c.group for c in suite_module.CHECK_CASES if c.group} == BWD_CLASSES
    assert [c.group for c in suite_module.VARLEN_CHECK_CASES if c.group] == ["varlen"]


def test_bench_varlen_only_once_the_kernel_takes_it(monkeypatch):
    monkeypatch.setattr(bwd_module, "BWD_HEAD_DIMS", OPS_HEAD_DIMS)
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: False)
    assert suite_module.bench_cases() == suite_module.BENCH_CASES
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: True)
    n = len(suite_module.VARLEN_BENCH_CASES)
    assert suite_module.bench_cases()[-n:] == suite_module.VARLEN_BENCH_CASES


@pytest.mark.parametrize("with_max", [False, True])
def test_fa4_gets_the_packed_batch_it_takes(monkeypatch, with_max):
    """FA4's backward takes cu_seqlens (and max_seqlen where its signature has them)."""
    seen = []

    def bwd(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
    ):
        seen.append({"cu_q": cu_seqlens_q, "cu_k": cu_seqlens_k})

    def bwd_max(
        q,
        k,
        v,
        out,
        dout,
        lse,
        softmax_scale=None,
        causal=False,
        cu_seqlens_q=None,
        cu_seqlens_k=None,
        max_seqlen_q=None,
        max_seqlen_k=None,
    ):
        seen.append({"cu_q": cu_seqlens_q, "max_q": max_seqlen_q, "max_k": max_seqlen_k})

    interface = types.ModuleType("flash_attn.cute.interface")
    interface._flash_attn_bwd = bwd_max if with_max else bwd
    for name, mod in (
        ("flash_attn", types.ModuleType("flash_attn")),
        ("flash_attn.cute", types.ModuleType("flash_attn.cute")),
        ("flash_attn.cute.interface", interface),
    ):
        monkeypatch.setitem(sys.modules, name, mod)
    fa4 = suite_module._fa4()
    gen = torch.Generator().manual_seed(0)
    fa4(SUITE.make_inputs(VARLEN, torch.bfloat16, CPU, gen))
    fa4(SUITE.make_inputs(DEAD_ROWS, torch.bfloat16, CPU, gen))
    assert seen[0]["cu_q"].tolist() == [0, 5, 5, 22]
    assert seen[1]["cu_q"] is None
    if with_max:
        assert (seen[0]["max_q"], seen[0]["max_k"]) == (17, 17) and seen[1]["max_q"] is None


def test_cudnn_is_not_timed_on_other_semantics():
    """SDPA's causal mask is top-left aligned: chunked (causal Sq != Sk) and packed batches
    get no cuDNN figure."""
    gen = torch.Generator().manual_seed(0)
    for case in (VARLEN, suite_module._case(1, 4, 2, 5, 64, sk=13)):
        inputs = SUITE.make_inputs(case, torch.bfloat16, CPU, gen)
        with pytest.raises(NotImplementedError):
            suite_module.refuse_other_semantics(inputs)
    same = suite_module._case(1, 4, 2, 5, 64, sk=13, causal=False)
    suite_module.refuse_other_semantics(SUITE.make_inputs(same, torch.bfloat16, CPU, gen))


DIMS = bwd_module.BWD_HEAD_DIMS


def test_check_cases_cover_dims_ratios_lengths_and_flags():
    cases = suite_module.CHECK_CASES + suite_module.VARLEN_CHECK_CASES
    for group in (SUITE.check_cases, suite_module.BENCH_CASES, cases):
        assert len({c.name for c in group}) == len(group)
    for c in cases:
        p = c.params
        assert (p["d"], p["dv"]) in OPS_HEAD_DIMS, c.name
        assert p["hq"] % p["hkv"] == 0 and min(p["b"], p["sq"], p["sk"]) >= 1, c.name
    fixed = suite_module.CHECK_CASES
    assert {(c.params["d"], c.params["dv"]) for c in fixed} == set(OPS_HEAD_DIMS)
    assert {(c.params["d"], c.params["dv"]) for c in SUITE.check_cases} == set(DIMS)
    assert {1, 4, 8} <= {c.params["hq"] // c.params["hkv"] for c in fixed}
    assert {1, 17, 1000, 4097} <= {c.params["sq"] for c in fixed}
    assert any(c.params["sq"] > c.params["sk"] for c in fixed if c.params["causal"])
    assert any(c.params["sq"] < c.params["sk"] for c in fixed)
    assert {c.params["causal"] for c in fixed} == {True, False}
    assert any(c.params["deterministic"] for c in fixed)
    assert list(SUITE.dtypes) == [torch.bfloat16, torch.float16]


def test_varlen_cases_only_once_the_kernel_takes_them(monkeypatch):
    monkeypatch.setattr(bwd_module, "BWD_HEAD_DIMS", OPS_HEAD_DIMS)
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: False)
    assert suite_module.check_cases() == suite_module.CHECK_CASES
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: True)
    n = len(suite_module.VARLEN_CHECK_CASES)
    assert suite_module.check_cases()[-n:] == suite_module.VARLEN_CHECK_CASES


@pytest.mark.parametrize("sq, sk", [(1, 1), (7, 7), (5, 13), (13, 5)])
@pytest.mark.parametrize("causal", [False, True])
def test_flops_are_two_and_a_half_forwards(sq, sk, causal):
    bwd = suite_module._case(2, 8, 2, sq, 192, causal, sk=sk, dv=128)
    fwd = fwd_suite_module._case(2, 8, 2, sq, 192, causal, sk=sk, dv=128)
    assert SUITE.flops(bwd) == 2.5 * fwd_suite_module.suite().flops(fwd)


def test_flops_causal_square_and_varlen():
    case = suite_module._case(4, 32, 32, 8192, 128)
    assert SUITE.flops(case) == 2.5 * 4 * 4 * 32 * 128 * 8192 * 8193 / 2
    varlen = suite_module._varlen_case((3, 5), (3, 9), 4, 2, 64, True)
    pairs = (1 + 2 + 3) + sum(min(i + 9 - 5 + 1, 9) for i in range(5))
    assert SUITE.flops(varlen) == 2.5 * 4 * 4 * 128 / 2 * pairs


def test_bytes_are_inputs_read_and_gradients_written():
    case = suite_module._case(2, 8, 2, 10, 192, sk=30, dv=128)
    elems = 10 * 8 * (192 + 192 + 128 + 128) + 30 * 2 * 2 * (192 + 128)
    assert SUITE.bytes(case, torch.bfloat16) == 2 * (2 * elems + 4 * 8 * 10)


def test_comparators_resolve_without_a_gpu():
    assert set(SUITE.comparators()) == {"fa4", "cudnn"}


def test_ledger_key_is_the_bwd_leaf():
    sources = suite_module.kernel_sources()
    try:
        from forgekernel.kernels.attention.bwd.sm90 import SPECS
    except ImportError:
        assert sources == []  # no leaf yet: the ledger gate fails for this suite
        return
    assert sources == sorted({p for s in SPECS for p in s.sources}) and sources
    leaf = [p for p in sources if "kernels/attention/bwd/sm90" in p.as_posix()]
    shared = [p for p in sources if "kernels/common/" in p.as_posix()]
    assert leaf and len(leaf) + len(shared) == len(sources)  # the leaf and the shared toolkit


def correct_backward(inputs, out):
    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    flags = (inputs["causal"], inputs["softmax_scale"])
    if "varlen" in inputs:
        grads = attention_varlen_bwd_ref(q, k, v, do, *inputs["varlen"][:2], *flags)
    else:
        grads = attention_bwd_ref(q, k, v, do, *flags)
    for o, g in zip(out, grads):
        o.copy_(g)
    return out


# Sq > Sk causal: rows 0..8 see no key (dq = 0); GQA 4, DeepSeek dims; then MHA with a scale.
DEAD_ROWS = suite_module._case(2, 8, 2, 13, 192, sk=4, dv=128)
SMALL = (DEAD_ROWS, suite_module._case(1, 4, 4, 17, 64, False, scale=0.3, deterministic=True))
VARLEN = suite_module._varlen_case((5, 0, 17), (9, 3, 17), 4, 2, 64, True)


def _verify(run_ours, case, dtype=torch.bfloat16):
    suite = dataclasses.replace(SUITE, run_ours=run_ours)
    inputs = suite.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(0))
    return verify(suite, inputs, CPU)[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", (*SMALL, VARLEN), ids=lambda c: c.name)
def test_a_correct_backward_passes(case, dtype):
    cmps = _verify(correct_backward, case, dtype)
    assert len(cmps) == 3 and all(c.ok for c in cmps), [c.message for c in cmps]


@pytest.mark.parametrize(
    "spoil, which",
    [
        (lambda out: out[0][:, :3].add_(0.05), 0),  # dq of rows that see no key
        (lambda out: out[1][:, -1].mul_(1.1), 1),  # one key's dk
        (lambda out: out[2].copy_(out[2].roll(1, dims=2)), 2),  # dv summed into the wrong head
    ],
)
def test_a_wrong_backward_fails(spoil, which):
    def kernel(inputs, out):
        correct_backward(inputs, out)
        spoil(out)
        return out

    oks = [c.ok for c in _verify(kernel, DEAD_ROWS)]
    assert not oks[which] and sum(oks) == 2


def test_unwritten_gradient_fails():
    def kernel(inputs, out):
        return correct_backward(inputs, out[:2]) + (out[2],)

    cmps = _verify(kernel, DEAD_ROWS)
    assert not cmps[2].ok and "NaN" in cmps[2].message


@pytest.fixture
def cpu_backward(monkeypatch):
    """The public op's eager path on the CPU, with the reference as the kernel."""
    calls = []

    def launch(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, compact=False):
        inputs = {"q": q, "k": k, "v": v, "do": do, "causal": causal, "softmax_scale": scale}
        if seqs is not None:
            inputs["varlen"] = seqs
        correct_backward(inputs, (dq, dk, dv))
        calls.append(deterministic)

    monkeypatch.setattr(bwd_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(bwd_module, "_launch_kernel", launch)
    monkeypatch.setattr(bwd_module, "BWD_HEAD_DIMS", OPS_HEAD_DIMS)  # the stand-in has them all
    return calls


def test_suite_runs_the_public_op_into_out(cpu_backward):
    for case in (*SMALL, VARLEN):
        assert all(c.ok for c in _verify(suite_module.run_ours, case))
    assert cpu_backward == [False, True, False]


def test_cli_lists_the_operator(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)
    assert cli.main(["check", "attention_bwd"]) == 2
    assert cli.NO_GPU_CHECK in capsys.readouterr().err
    assert [s.name for s in cli._suites(["attention_bwd"])] == ["attention_bwd"]


def test_sanitize_cases_cover_every_kernel_variant():
    fixed, varlen = suite_module.SANITIZE_CASES, suite_module.SANITIZE_VARLEN_CASES
    names = [c.name for c in fixed + varlen]
    assert len(set(names)) == len(names)
    assert {(c.params["d"], c.params["dv"]) for c in fixed} == set(OPS_HEAD_DIMS)
    assert {(c.params["d"], c.params["dv"]) for c in varlen} >= {(128, 128), (192, 128)}
    det_dims = {(c.params["d"], c.params["dv"]) for c in fixed if c.params["deterministic"]}
    assert det_dims == set(OPS_HEAD_DIMS)
    assert any(c.params["deterministic"] for c in varlen)
    assert {c.params["causal"] for c in fixed} == {True, False}
    assert any(c.params["hq"] > c.params["hkv"] for c in fixed if c.params["d"] == 128)
    assert any(c.params["sq"] != c.params["sk"] for c in fixed)
    # small and odd: the sanitizers slow a kernel down 10-100x
    assert all(c.params["sq"] <= 1000 and c.params["sq"] % 64 for c in fixed)


def test_sanitize_varlen_cases_only_once_the_kernel_takes_them(monkeypatch):
    monkeypatch.setattr(bwd_module, "BWD_HEAD_DIMS", OPS_HEAD_DIMS)
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: False)
    assert suite_module.sanitize_cases() == suite_module.SANITIZE_CASES
    monkeypatch.setattr(suite_module, "varlen_supported", lambda: True)
    n = len(suite_module.SANITIZE_VARLEN_CASES)
    assert suite_module.sanitize_cases()[-n:] == suite_module.SANITIZE_VARLEN_CASES


def test_deterministic_cases_are_repeatable_and_timed_beside_the_default():
    det = [c for c in SUITE.check_cases if SUITE.is_repeatable(c)]
    assert det and all(c.params["deterministic"] for c in det)
    assert {(c.params["d"], c.params["dv"]) for c in det} == set(DIMS)
    assert any(c.params["hq"] > c.params["hkv"] for c in det)
    timed = [c for c in SUITE.bench_cases if "deterministic" in SUITE.variants_for(c)]
    assert {c.name for c in timed} == {
        "b4-hq16-hkv16-s8192-d128-causal",
        "b4-hq32-hkv4-s8192-d128-causal",
        "b2-hq128-hkv128-s8192-d192-dv128-causal",
    } & {c.name for c in SUITE.bench_cases}
    assert all(set(SUITE.variants_for(c)) == {"deterministic"} for c in timed)


def test_gqa16_candidates_are_timed_on_the_gqa16_bench_cases():
    timed = [c for c in SUITE.bench_cases if c.name in {t.name for t in suite_module.GQA16_TIMED}]
    assert [c.name for c in timed] == [c.name for c in suite_module.GQA16_TIMED]
    for c in timed:
        assert c.group == "gqa16" and c.params["hq"] == 16 * c.params["hkv"]
        assert set(SUITE.variants_for(c)) == set(suite_module.GQA16_CANDIDATES)
    assert len(suite_module.GQA16_CANDIDATES) <= 3


def test_chunked_candidates_are_timed_on_the_chunked_gqa_case():
    """The L2 model's chunked candidates (sections of two pairs) on the chunked GQA 8 case that
    the long-key rule (LONG_GQA_SWIZZLE) puts in sections of eight."""
    from forgekernel.kernels.attention.bwd.sm90.config import LONG_GQA_SEQLEN_K, choose_config

    timed = [c for c in SUITE.bench_cases if c.name in {t.name for t in suite_module.CHUNKED_TIMED}]
    assert [c.name for c in timed] == [c.name for c in suite_module.CHUNKED_TIMED]
    for c in timed:
        p = c.params
        assert c.group == "chunked" and p["sq"] < p["sk"] >= LONG_GQA_SEQLEN_K
        assert set(SUITE.variants_for(c)) == set(suite_module.CHUNKED_CANDIDATES)
        cfg = choose_config(p["d"], p["dv"], False, p["b"], p["sk"], p["hq"], p["hkv"], 132)
        assert cfg.l2_swizzle == 8 and cfg.walk_order == 2  # what the candidates replace
    assert all(k["l2_swizzle"] == 2 for k in suite_module.CHUNKED_CANDIDATES.values())
    # their kernels are the main kernel's candidate keys (built ahead with --candidates)
    from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN
    from forgekernel.kernels.attention.bwd.sm90.config import default_config, main_params

    keys = [main_params("bfloat16", 128, 128, True, False,
                        dataclasses.replace(default_config(128, 128), **knobs))
            for knobs in suite_module.CHUNKED_CANDIDATES.values()]  # fmt: skip
    assert keys == SPEC_MAIN.candidate_params()
    assert not set(keys) & set(SPEC_MAIN.standard_params())


def test_gqa16_candidate_runs_the_launcher_with_its_config(monkeypatch):
    """run_config hands the leaf's launcher the D = 128 default with the candidate's knobs, the
    default softmax scale, deterministic off; the gradients are the launcher's (here the
    reference's)."""
    from forgekernel.kernels.attention.bwd.sm90 import launch
    from forgekernel.kernels.attention.bwd.sm90.config import default_config

    seen = []

    def fake(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, config=None):
        inputs = {"q": q, "k": k, "v": v, "do": do, "causal": causal, "softmax_scale": scale}
        correct_backward(inputs, (dq, dk, dv))
        seen.append((scale, deterministic, config))

    monkeypatch.setattr(launch, "attention_bwd", fake)
    case = suite_module._case(1, 16, 1, 300, 128)
    runs = [(suite_module.GQA16_TIMED[0], n, k) for n, k in suite_module.GQA16_CANDIDATES.items()]
    runs += [(suite_module.CHUNKED_TIMED[0], n, k)
             for n, k in suite_module.CHUNKED_CANDIDATES.items()]  # fmt: skip
    for timed, name, knobs in runs:
        run = suite_module.variants(timed)[name]
        assert all(c.ok for c in _verify(run, case)), name
        scale, det, cfg = seen[-1]
        assert scale == 128**-0.5 and det is False
        assert cfg == dataclasses.replace(default_config(128, 128), **knobs)


def test_the_deterministic_variant_runs_the_op_with_deterministic(cpu_backward):
    case = SMALL[0]
    assert not case.params["deterministic"]
    run = suite_module.variants(suite_module.DETERMINISTIC_TIMED[0])["deterministic"]
    assert all(c.ok for c in _verify(run, case))
    assert all(c.ok for c in _verify(suite_module.run_ours, case))
    assert cpu_backward == [True, False]


def test_host_case_is_the_forward_suites_and_tiny():
    assert SUITE.host_case.params["sq"] == fwd_suite_module.HOST_CASE.params["sq"] == 128
    assert SUITE.host_case.group == "host" and SUITE.flops(SUITE.host_case) < 2.5e9
