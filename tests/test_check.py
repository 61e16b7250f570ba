"""run_check on the CPU with a torch 'kernel': the criterion, poisoning, and per-case FAIL."""

from __future__ import annotations

import json

import torch

from forgekernel.bench import check


def test_compare_criterion():
    ref = torch.tensor([1.0, 2.0, 3.0])
    low = torch.tensor([1.0, 2.0, 3.1])
    assert check.compare(ref + 0.15, ref, low, atol=0.0).ok
    bad = check.compare(ref + 0.25, ref, low, atol=0.0)
    assert not bad.ok and "error" in bad.message
    nan = check.compare(torch.tensor([1.0, float("nan"), 3.0]), ref, low, atol=1.0)
    assert not nan.ok and "NaN" in nan.message
    inf = check.compare(torch.tensor([1.0, float("inf"), 3.0]), ref, low, atol=1.0)
    assert not inf.ok and "inf" in inf.message
    assert not check.compare(ref[:2], ref, low, atol=1.0).ok
    ref_inf = torch.tensor([1.0, float("inf")])
    assert check.compare(ref_inf.clone(), ref_inf, ref_inf, atol=0.0).ok
    assert not check.compare(torch.tensor([1.0, 5.0]), ref_inf, ref_inf, atol=0.0).ok


def test_rel_err():
    ref = torch.tensor([3.0, 4.0])
    c = check.compare(torch.tensor([3.0, 4.5]), ref, ref, atol=1.0)
    assert abs(c.rel_err - 0.1) < 1e-6


def test_run_check_passes_and_records(tmp_path, sources, fake_suite, capsys):
    ok = check.run_check(
        [fake_suite(sources)], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu"
    )
    out = capsys.readouterr().out
    assert ok, out
    assert "PASS" in out and "our err" in out
    doc = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())
    assert doc["check"]["passed"] and len(doc["check"]["cases"]) == 4
    assert doc["check"]["seed"] == 1


def test_unwritten_element_fails(tmp_path, sources, fake_suite, capsys):
    def skips_last_column(inputs, out):
        full = inputs["a"].float() @ inputs["b"].float().T
        out[:, :-1] = full[:, :-1]
        return out

    suite = fake_suite(sources, run_ours=skips_last_column)
    assert not check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")
    assert "NaN where the reference is finite" in capsys.readouterr().out


def test_low_precision_accumulation_fails(tmp_path, sources, fake_suite):
    def sloppy(inputs, out):  # ~1% error: far beyond torch's own rounding
        return out.copy_((inputs["a"].float() @ inputs["b"].float().T) * 1.01)

    suite = fake_suite(sources, run_ours=sloppy)
    assert not check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")


def test_exception_is_a_fail_not_an_abort(tmp_path, sources, fake_suite, capsys):
    def raises_on_small(inputs, out):
        if inputs["a"].shape[0] == 1:
            raise ValueError("M = 1 not supported")
        return out.copy_(inputs["a"].float() @ inputs["b"].float().T)

    suite = fake_suite(sources, run_ours=raises_on_small)
    assert not check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")
    out = capsys.readouterr().out
    assert "ValueError: M = 1 not supported" in out
    doc = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())
    assert [c["passed"] for c in doc["check"]["cases"]] == [False, False, True, True]


def test_returning_a_fresh_tensor_fails(tmp_path, sources, fake_suite):
    suite = fake_suite(sources, run_ours=lambda i, out: i["a"].float() @ i["b"].float().T)
    assert not check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")


def test_repeatable_case_must_give_the_same_bits(tmp_path, sources, fake_suite, capsys):
    """check runs a repeatable case REPEATS times: a kernel whose last bits wander fails even
    though each run is accurate; a fixed-order kernel passes and records the repeat."""
    calls = []

    def wandering(inputs, out):
        calls.append(1)
        exact = inputs["a"].float() @ inputs["b"].float().T
        return out.copy_(exact + len(calls) % 2 * 1e-6 * exact.abs().max())

    def repeat_big(case):
        return case.params["m"] == 7

    suite = fake_suite(sources, run_ours=wandering, repeatable=repeat_big, dtypes=(torch.float32,))
    assert not check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")
    assert "not repeatable: run 2: out0 differs from run 1" in capsys.readouterr().out
    cases = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())["check"]["cases"]
    assert [c.get("repeat") for c in cases] == [None, {"runs": 3, "bitwise_identical": False}]
    assert [c["passed"] for c in cases] == [True, False] and len(calls) == 1 + check.REPEATS

    suite = fake_suite(sources, repeatable=repeat_big)
    assert check.run_check([suite], seed=1, results_dir=tmp_path, arch="sm_90a", device="cpu")
    assert "bitwise identical over 3 runs" in capsys.readouterr().out


def test_bitwise_means_bits():
    """-0.0 == 0.0 and NaN != NaN as numbers; as bits the first differ and the second agree."""
    a = torch.tensor([0.0, float("nan")], dtype=torch.bfloat16)
    b = torch.tensor([-0.0, float("nan")], dtype=torch.bfloat16)
    assert (check._bits(a) != check._bits(b)).tolist() == [True, False]
