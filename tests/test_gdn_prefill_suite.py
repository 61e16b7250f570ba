"""The pending gdn_prefill suite on the CPU: its own check (`bench.check.verify`) passes on every
check case with the chunked algorithm standing in for the kernel (tests/test_gdn_prefill.py),
its cases are well formed, and it is registered as pending only."""

from __future__ import annotations

import pytest
import torch
from test_gdn_prefill import cpu_kernel  # noqa: F401  (the fixture; tests/ is on sys.path)

from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gdn_prefill


@pytest.mark.parametrize("case", gdn_prefill.CHECK_CASES, ids=lambda c: c.name)
def test_check_passes_on_the_algorithm(cpu_kernel, case):  # noqa: F811
    suite = gdn_prefill.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert cmps and all(c.ok for c in cmps), [c.message for c in cmps]


def test_cases_are_well_formed():
    names = [c.name for c in (*gdn_prefill.BENCH_CASES, *gdn_prefill.CHECK_CASES)]
    assert len(names) == len(set(names))
    for case in gdn_prefill.BENCH_CASES:
        lens = case.params["lens"]
        assert all(n > 0 for n in lens) and 2048 <= sum(lens) <= 8 * 32768, case.name  # issue 20
        assert case.params["hv"] % case.params["h"] == 0
        assert gdn_prefill.flops(case) > 0 and gdn_prefill.nbytes(case, torch.bfloat16) > 0
    assert {(c.params["h"], c.params["hv"]) for c in gdn_prefill.BENCH_CASES} >= {(16, 32), (4, 8)}


def test_registered_since_its_first_gpu_check():
    """Registered since its first GPU check passed (2026-12-01)."""
    assert suites.SUITE_MODULES["gdn_prefill"] == "forgekernel.bench.suites.gdn_prefill"
    assert "gdn_prefill" not in suites.PENDING_SUITE_MODULES


@pytest.mark.parametrize("cpu_kernel", [1], indirect=True)  # the test forces each split itself
def test_variants_force_the_other_form_and_v_split(cpu_kernel):  # noqa: F811
    """The bench times the form the launcher does not take on every case (`standard` beside the
    t_pre form, `t_pre` beside the standard one), the other V split beside the launcher's
    choice (at most two waves of split CTAs), and the direct launch beside the segmented one
    (or the segments where the launcher might have segmented), those in the case's form; each
    variant is the kernel so forced, as the check sees it."""
    by_name = {c.name: c for c in gdn_prefill.BENCH_CASES}
    std = "standard"  # where the launcher takes the t_pre form: all but 8x32768-h16-hv16
    assert set(gdn_prefill.variants(by_name["1x65536-h16-hv32"])) == {
        "v_split_1", "segments_5", std, "segments_5_b_with_o"
    }  # fmt: skip
    with_o = "b_with_o"  # pass B with o, where the launcher segments (t_pre; ours without)
    assert set(gdn_prefill.variants(by_name["1x131072-h16-hv16"])) == {"segments_1", std, with_o}
    ab = "t_pre_state_lds"  # STATE_CHAIN_AB
    chain = "no_o_warp"  # STANDARD_CHAIN_AB
    assert set(gdn_prefill.variants(by_name["4x8192-h16-hv32"])) == {"v_split_2", std, ab, chain}
    assert set(gdn_prefill.variants(by_name["1x4096-h16-hv32"])) == {"v_split_1", std, ab}
    assert set(gdn_prefill.variants(by_name["mix64-t32768-h16-hv32"])) == {std}
    assert set(gdn_prefill.variants(by_name["8x32768-h16-hv16"])) == {"v_split_2", "t_pre",
                                                                       chain}  # fmt: skip
    assert [c.name for c in gdn_prefill.BENCH_CASES if not gdn_prefill.uses_t_pre(c)] == [
        "8x32768-h16-hv16"
    ]
    # the check and the sanitizers cover both forms (the last case the standard one, o_warp)
    assert [gdn_prefill.uses_t_pre(c) for c in gdn_prefill.CHECK_CASES] == [True] * 4 + [False]
    assert [gdn_prefill.uses_t_pre(c) for c in gdn_prefill.SANITIZE_CASES] == [True] * 3 + [False]
    suite = gdn_prefill.suite()
    case = gdn_prefill.CHECK_CASES[0]  # h 2, hv 4: the launcher's form is t_pre
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(1))  # fmt: skip
    want = suite.reference(inputs)
    for split in (1, 2):
        out = gdn_prefill.alloc_out(inputs)
        got = gdn_prefill._run_forced(v_split=split, t_pre=True)(inputs, out)
        assert got is out and float((got.float() - want).abs().max()) < 2e-2
        assert cpu_kernel[-2]["v_split"] == split and cpu_kernel[-2]["t_pre"]
    calls = len(cpu_kernel)
    out = gdn_prefill.alloc_out(inputs)
    got = gdn_prefill._run_forced(segments=4, t_pre=True)(inputs, out)
    assert got is out and float((got.float() - want).abs().max()) < 2e-2
    assert len(cpu_kernel) == calls + 4  # T once, passes A, B, C
    assert [p.get("no_o", False) for p in cpu_kernel[calls:] if "v" in p] == [False, True, False]
    standard = gdn_prefill._run_forced(t_pre=False)(inputs, gdn_prefill.alloc_out(inputs))
    assert "t_pre" not in cpu_kernel[-1] and cpu_kernel[-1]["o_warp"]  # the standard form's
    got = gdn_prefill._run_forced(t_pre=True)(inputs, gdn_prefill.alloc_out(inputs))
    assert torch.equal(got, standard)  # the replay's T is the aux's, bit for bit
    assert cpu_kernel[-2]["t_pre"] and set(cpu_kernel[-1]) == {"dtype", "k", "l2norm"}
    assert "state_lds" not in cpu_kernel[-2]
    got = gdn_prefill._run_forced(t_pre=True, state_lds=True)(inputs, gdn_prefill.alloc_out(inputs))
    assert torch.equal(got, standard) and cpu_kernel[-2]["state_lds"]
    got = gdn_prefill._run_forced(t_pre=False, o_warp=False)(inputs, gdn_prefill.alloc_out(inputs))
    assert torch.equal(got, standard) and "o_warp" not in cpu_kernel[-1]  # same products
    calls = len(cpu_kernel)
    with_o = gdn_prefill._run_forced(segments=4, t_pre=True, b_no_o=False)
    got = with_o(inputs, gdn_prefill.alloc_out(inputs))
    assert float((got.float() - want).abs().max()) < 2e-2
    assert len(cpu_kernel) == calls + 4 and not [p for p in cpu_kernel[calls:] if p.get("no_o")]


@pytest.mark.parametrize("module", ["gdn_prefill", "kda_prefill"])
def test_one_fp64_pass_gives_both_yardsticks(monkeypatch, module):
    """check.expected's reference and low_precision share one fp64 pass (the fp64 output
    handed over through the inputs and taken back out); low_precision alone still runs one."""
    import importlib

    from forgekernel.bench.check import expected

    mod = importlib.import_module(f"forgekernel.bench.suites.{module}")
    suite = mod.suite()
    inputs = suite.make_inputs(mod.CHECK_CASES[1], torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(2))  # fmt: skip
    real, runs = mod._reference, []
    monkeypatch.setattr(mod, "_reference", lambda i: runs.append(1) or real(i))
    (ref,), (low,) = expected(suite, inputs)
    assert len(runs) == 1 and mod.FP64_KEY not in inputs
    assert ref.dtype == torch.float32 and low.dtype == torch.bfloat16
    assert torch.allclose(low.float(), ref, rtol=1e-2, atol=1e-2)  # its bf16 rounding
    assert torch.equal(suite.low_precision(inputs), low) and len(runs) == 2


def test_flashqla_is_a_sidecar_reported_missing_without_its_site():
    """FlashQLA, the issue's comparator: listed (no runner without a GPU); on the GPU a sidecar
    (bench/sidecar.py) whose unset site is the missing reason the bench records."""
    assert gdn_prefill.comparators()["flashqla"] is None  # no GPU here
    why = gdn_prefill._flashqla().unavailable({})
    assert why.startswith("FlashQLA 0.1.3 runs in a sidecar process: FK_SIDE_SITE_FLASHQLA")
