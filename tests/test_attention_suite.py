"""The attention suite on the CPU: cases well-formed, work counts exact, and the harness's
comparison accepts a correct kernel (including LSE = -inf rows) and rejects a wrong one."""

import dataclasses
import importlib
import math

import pytest
import torch

from forgekernel.bench.check import verify
from forgekernel.bench.suites import attention as suite_module
from forgekernel.reference.attention import attention_ref

attention_module = importlib.import_module("forgekernel.ops.attention")
SUITE = suite_module.suite()
CPU = torch.device("cpu")


def test_cases_are_well_formed():
    for cases in (SUITE.check_cases, SUITE.bench_cases):
        assert len({c.name for c in cases}) == len(cases)
        for c in cases:
            p = c.params
            assert (p["d"], p["dv"]) in attention_module.SUPPORTED_HEAD_DIMS, c.name
            assert p["hq"] % p["hkv"] == 0 and min(p["b"], p["sq"], p["sk"]) >= 1, c.name
    assert "b4-hq32-hkv2-s8192-d128-causal" in {c.name for c in SUITE.bench_cases}
    assert all(c.params["sq"] == c.params["sk"] for c in SUITE.bench_cases)
    ratios = {c.params["hq"] // c.params["hkv"] for c in SUITE.check_cases}
    assert {1, 4, 16} <= ratios
    assert {c.params["sq"] for c in SUITE.check_cases} >= {1, 17, 1000, 4097}
    assert list(SUITE.dtypes_for_bench()) == [torch.bfloat16]


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


def test_comparators_resolve_without_a_gpu():
    assert set(SUITE.comparators()) == {"fa4", "cudnn"}


def correct_kernel(inputs, out):
    o, lse = attention_ref(
        inputs["q"], inputs["k"], inputs["v"], inputs["causal"], inputs["softmax_scale"]
    )
    out[0].copy_(o)
    out[1].copy_(lse)
    return out


# Sq > Sk causal: rows 0..8 see no key (LSE = -inf, O = 0); plus GQA, Dv != D and a scale.
DEAD_ROWS = suite_module._case(2, 4, 1, 13, 192, sk=4, dv=128)
SMALL = (DEAD_ROWS, suite_module._case(1, 4, 4, 17, 64, False, scale=0.3))


def _verify(run_ours, case, dtype=torch.bfloat16):
    suite = dataclasses.replace(SUITE, run_ours=run_ours)
    inputs = suite.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(0))
    return verify(suite, inputs, CPU)[1]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_a_correct_kernel_passes(case, dtype):
    cmps = _verify(correct_kernel, case, dtype)
    assert len(cmps) == 2 and all(c.ok for c in cmps), [c.message for c in cmps]


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
    for case in SMALL:
        assert all(c.ok for c in _verify(suite_module.run_ours, case))
