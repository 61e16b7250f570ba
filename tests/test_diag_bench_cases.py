"""scripts/diag_bench_cases.py (the bench's candidates one process each) on the CPU: its
verdicts from a child's exit and output (a device fault named with its stage and call site, a
hang with the stage it was in), the (case, candidate) picks, and one child on kda_prefill's
smallest bench case through the real op and launcher with the kernels' torch replays
(tests/kda_prefill_replay.py), at the bench's shape."""

from __future__ import annotations

import kda_prefill_replay
import pytest
from script_modules import load_script  # tests/ is on the path

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch as kda_launch
from forgekernel.ops import kda_chunked as kda_op

diag = load_script("diag_bench_cases", register=True)

IMA = "torch.AcceleratorError: CUDA error: an illegal memory access was encountered"


def test_a_fault_is_a_crash_in_its_stage_with_its_call_site():
    out = "STAGE call start\nSTAGE call done\nSTAGE repeat start\n"
    err = (
        "Traceback (most recent call last):\n"
        '  File "x/launch.py", line 73, in first_pass_kernel\n'
        f"    fn(...)\n{IMA}\n"
    )
    verdict, detail = diag.classify(3, out, err, timed_out=False)
    assert verdict == "CRASH"
    assert "stage repeat" in detail and "illegal memory access" in detail
    assert "launch.py" in detail


def test_other_verdicts():
    ok = 'STAGE call start\nSTAGE call done\n{"call": {"finite": true}}\n'
    assert diag.classify(0, ok, "", False)[0] == "PASS"
    assert diag.classify(0, '{"missing": true}\n', "", False)[0] == "MISSING"
    assert diag.classify(None, "STAGE graph start\n", "", True) == ("HANG", "in stage graph")
    assert diag.classify(-11, "STAGE call start\n", "", False)[0] == "CRASH"
    error = diag.classify(3, "", "NotImplementedError: initial-state case", False)
    assert error[0] == "ERROR" and "NotImplementedError" in error[1]


def test_picks_every_candidate_of_the_chosen_cases():
    suite = diag._suite("kda_prefill")
    picks = diag.pick(suite, ["1x2048"], None, harness=True)
    names = [n for _, _, n in picks]
    assert {case for _, case, _ in picks} == {"1x2048-h16-hv16"}
    # ours first, then its variants on the case (pieces_8 on the single sequences)
    assert names[0] == "ours" and "ours[pieces_8]" in names
    assert {"fla", "cudnn", diag.HARNESS} <= set(names)
    assert [n for *_, n in diag.pick(suite, ["mix64"], ["ours"], False)] == ["ours", "ours"]


@pytest.fixture
def replays(monkeypatch):
    def kernel(spec, params):
        if spec.name == "kda_intra_sm90":
            return kda_prefill_replay.intra_kernel(dict(params))
        return kda_prefill_replay.kernel(dict(params))

    monkeypatch.setattr(kda_launch, "get_kernel", kernel)
    monkeypatch.setattr(kda_op, "check_cuda", lambda name, t: None)


def test_child_runs_the_smallest_bench_case_on_the_replays(replays):
    r = diag.run_child("kda_prefill", 0, "ours", ["call"], seed=3, device="cpu")
    assert r["call"]["finite"], r
