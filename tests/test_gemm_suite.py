"""The GEMM suite on the CPU: bench cases sample every shape class of real models (projection
shapes derived here from the models' configs), the sample is fixed, work counts are exact, the
odd-N / odd-K check cases enter only when forgekernel.gemm takes them, and the harness's
comparison accepts a correct GEMM and rejects a wrong one on small cases of every class."""

import collections
import dataclasses
import importlib

import pytest
import torch

from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as suite_module

gemm_module = importlib.import_module("forgekernel.ops.gemm")
SUITE = suite_module.suite()
CPU = torch.device("cpu")

# (hidden, intermediate, query heads, kv heads, head_dim) from each model's config.json.
CONFIGS = {
    "llama3-8b": (4096, 14336, 32, 8, 128),
    "llama3-70b": (8192, 28672, 64, 8, 128),
    "qwen2.5-7b": (3584, 18944, 28, 4, 128),
    "qwen2.5-32b": (5120, 27648, 40, 8, 128),
    "qwen3-8b": (4096, 12288, 32, 8, 128),
    "qwen3-32b": (5120, 25600, 64, 8, 128),
}


@pytest.mark.parametrize("model", sorted(CONFIGS))
def test_projection_shapes_follow_the_model_configs(model):
    hidden, inter, hq, hkv, d = CONFIGS[model]
    expected = {
        "qkv": ((hq + 2 * hkv) * d, hidden),
        "o": (hidden, hq * d),
        "gate_up": (2 * inter, hidden),
        "down": (hidden, inter),
    }
    assert suite_module.MODEL_PROJECTIONS[model] == expected


def test_deepseek_and_mixtral_projections():
    ds = suite_module.MODEL_PROJECTIONS["deepseek-v3"]
    hidden, heads, q_rank, kv_rank, rope, nope, dv = 7168, 128, 1536, 512, 64, 128, 128
    assert ds["q_a"] == (q_rank, hidden) and ds["q_b"] == (heads * (nope + rope), q_rank)
    assert ds["kv_a"] == (kv_rank + rope, hidden) and ds["kv_b"] == (heads * (nope + dv), kv_rank)
    assert ds["o"] == (hidden, heads * dv)
    assert ds["gate_up"] == (2 * 18432, hidden) and ds["down"] == (hidden, 18432)
    assert suite_module.MODEL_PROJECTIONS["mixtral-8x7b-expert"] == {
        "w1": (14336, 4096),
        "w2": (4096, 14336),
    }


def test_bench_samples_every_class_and_size():
    cases = SUITE.bench_cases
    assert len({c.name for c in cases}) == len(cases)
    assert 40 <= len(cases) <= 60
    groups = collections.Counter(c.group for c in cases)
    assert set(groups) == {"square", "llm", "decode", "prefill", "ragged"}
    assert groups["decode"] >= 15 and groups["prefill"] >= 15 and groups["ragged"] >= 5
    by_group = collections.defaultdict(set)
    for c in cases:
        by_group[c.group].add(c.params["m"])
    assert set(suite_module.DECODE_M) <= by_group["decode"] and max(by_group["decode"]) <= 64
    assert set(suite_module.PREFILL_M) == by_group["prefill"]
    # every distinct projection appears at decode or prefill size, every model contributes
    sampled = {(c.params["n"], c.params["k"]) for c in cases if c.group in ("decode", "prefill")}
    assert {(n, k) for _, n, k in suite_module.projections()} <= sampled
    sources = {c.params.get("source", "").rsplit(".", 1)[0] for c in cases}
    assert set(suite_module.MODEL_PROJECTIONS) <= sources
    # ragged: row counts off every tile size, small N against large M and K
    ragged = [c.params for c in cases if c.group == "ragged"]
    assert all(p["m"] % 64 for p in ragged)
    assert any(p["n"] < 1024 and p["m"] >= 1000 and p["k"] >= 4096 for p in ragged)
    assert list(SUITE.dtypes_for_bench()) == [torch.bfloat16]


def test_bench_keeps_the_legacy_suite_and_is_fixed():
    names = [c.name for c in SUITE.bench_cases]
    legacy = ["4096x4096x4096", "8192x8192x8192", "8192x28672x8192", "8192x8192x28672"]
    legacy += ["8192x10240x8192", "64x8192x8192", "128x8192x8192", "256x8192x8192"]
    legacy += ["1000x3000x4104", "8192x8192x8192-kn"]
    assert names[: len(legacy)] == legacy
    again = importlib.reload(suite_module).suite()
    assert [(c.name, c.group) for c in again.bench_cases] == [
        (c.name, c.group) for c in SUITE.bench_cases
    ]


def test_cases_fit_the_aligned_path_and_check_covers_each_class():
    for c in tuple(SUITE.bench_cases) + suite_module.CHECK_CASES:
        p = c.params
        assert p["n"] % 8 == 0 and p["k"] % 8 == 0 and min(p["m"], p["n"], p["k"]) >= 1, c.name
        assert p["b_layout"] in ("nk", "kn"), c.name
    check = suite_module.CHECK_CASES
    assert len({c.name for c in check}) == len(check)
    assert {c.group for c in SUITE.bench_cases} <= {c.group for c in check}
    names = {c.name for c in check}
    assert {c.name for c in suite_module.EDGE_CASES} <= names
    assert {c.name for c in suite_module.LEGACY_BENCH_CASES} <= names
    assert all(
        2 * c.params["m"] * c.params["n"] * c.params["k"] < 1e11
        for c in suite_module.CLASS_CHECK_CASES
    )


def test_odd_cases_have_odd_n_or_k():
    odd = suite_module.ODD_CASES
    assert len({c.name for c in odd}) == len(odd)
    assert all(c.params["n"] % 8 or c.params["k"] % 8 for c in odd)
    assert {c.params["b_layout"] for c in odd} == {"nk", "kn"}
    assert any(c.params["n"] % 8 for c in odd) and any(c.params["k"] % 8 for c in odd)
    assert not {c.name for c in odd} & {c.name for c in suite_module.CHECK_CASES}


@pytest.mark.parametrize("accepted", [False, True])
def test_odd_cases_only_when_the_op_takes_them(monkeypatch, accepted):
    def gemm(a, b, out=None, b_layout="nk", config=None):
        if not accepted:
            raise ValueError("K = 4097 must be a multiple of 8 (rows of A and B)")
        raise ValueError(f"a must be a CUDA tensor, got device {a.device}")

    monkeypatch.setattr(gemm_module, "gemm", gemm)
    assert suite_module.odd_sizes_accepted() is accepted
    odd = {c.name for c in suite_module.ODD_CASES}
    suite = suite_module.suite()
    assert (odd <= {c.name for c in suite.check_cases}) is accepted
    assert not odd & {c.name for c in suite.bench_cases}


def test_the_probe_reads_the_real_op():
    """On meta tensors: no kernel, no device; True or False with the op as it is."""
    assert isinstance(suite_module.odd_sizes_accepted(), bool)


def test_flops_and_bytes_are_exact():
    case = suite_module._case(7, 24, 40, "kn")
    assert SUITE.flops(case) == 2 * 7 * 24 * 40
    assert SUITE.bytes(case, torch.bfloat16) == 2 * (7 * 40 + 24 * 40 + 7 * 24)
    assert SUITE.bytes(case, torch.float32) == 4 * (7 * 40 + 24 * 40 + 7 * 24)


def test_comparators_resolve_without_a_gpu():
    assert set(SUITE.comparators()) == {"cublas"}


def matmul_kernel(inputs, out):
    b = inputs["b"].T if inputs["b_layout"] == "nk" else inputs["b"]
    out.copy_((inputs["a"].float() @ b.float()).to(out.dtype))
    return out


SMALL = (
    suite_module._case(1, 24, 40, group="decode"),
    suite_module._case(16, 136, 72, "kn", group="decode"),
    suite_module._case(65, 48, 520, group="prefill"),
    suite_module._case(7, 24, 40, "kn", group="ragged"),
    suite_module._case(5, 13, 7, group="odd"),
)


def _verify(run_ours, case, dtype=torch.bfloat16):
    suite = dataclasses.replace(SUITE, run_ours=run_ours)
    inputs = suite.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(0))
    return verify(suite, inputs, CPU)[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_a_correct_gemm_passes(case, dtype):
    (cmp,) = _verify(matmul_kernel, case, dtype)
    assert cmp.ok, cmp.message


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_a_wrong_gemm_fails(case):
    def kernel(inputs, out):
        matmul_kernel(inputs, out)
        out[-1, -1] += 1.0
        return out

    (cmp,) = _verify(kernel, case)
    assert not cmp.ok


def test_inputs_follow_the_b_layout():
    gen = torch.Generator().manual_seed(0)
    inputs = SUITE.make_inputs(suite_module._case(3, 16, 24, "kn"), torch.float16, CPU, gen)
    assert inputs["a"].shape == (3, 24) and inputs["b"].shape == (24, 16)
    assert SUITE.alloc_out(inputs).shape == (3, 16)


def test_host_case_is_tiny():
    case = SUITE.host_case
    assert case.group == "host" and SUITE.flops(case) < 1e8
    assert case.name not in {c.name for c in SUITE.bench_cases}
