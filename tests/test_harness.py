"""run_bench on the CPU with the timer replaced: verification gate, missing comparators, ratios."""

from __future__ import annotations

import json

import pytest
import torch

from forgekernel.bench import harness
from forgekernel.runtime.timing import Samples


class Calls(list):
    graph_lost_work = False


@pytest.fixture
def fake_timer(monkeypatch):
    calls = Calls()

    def timer(fns, *, rotate, warmup, reps):
        calls.append((list(fns), len(rotate)))
        for args in rotate:  # every candidate must run on every input set
            for fn in fns.values():
                fn(*args)
        ms = {"ours": 1.0, "good": 2.0, "slow": 4.0, "ours[det]": 1.5, "ours[bad]": 9.0}

        def rerun(fn):
            return lambda: None if calls.graph_lost_work else [fn(*a) for a in rotate]

        return {
            k: Samples([ms[k]] * 3, method="cuda-graph", launches=4, rerun=rerun(fn))
            for k, fn in fns.items()
        }

    monkeypatch.setattr(harness, "time_interleaved", timer)
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1000)
    return calls


def _comparators():
    def broken(inputs):
        raise RuntimeError("cuBLAS says no")

    def good(inputs):
        return inputs["a"] @ inputs["b"].T

    return {"good": good, "absent": None, "broken": broken, "slow": good}


def test_bench_records(tmp_path, sources, fake_suite, fake_timer, capsys):
    suite = fake_suite(sources, comparators=_comparators, dtypes=(torch.bfloat16,))
    records = harness.run_bench(
        [suite],
        results_dir=tmp_path / "res",
        report_dir=tmp_path / "rep",
        arch="sm_90a",
        device="cpu",
    )
    assert [r["status"] for r in records] == ["ok", "ok"]
    comps = records[0]["comparators"]
    assert comps["good"]["ratio"] == pytest.approx(2.0)
    assert comps["slow"]["ratio"] == pytest.approx(4.0)
    assert comps["absent"] == {"missing": "not available in this process"}
    assert "cuBLAS says no" in comps["broken"]["missing"]
    assert records[0]["ours"]["tflops"] == pytest.approx(2 * 8 * 8 / 1.0 / 1e9)
    assert fake_timer[0][0] == ["ours", "good", "slow"]
    assert fake_timer[0][1] > 1  # tiny case with a 1000-byte "L2": inputs rotated
    doc = json.loads((tmp_path / "res" / "sm_90a" / "fake.json").read_text())
    assert doc["bench"]["median_ratio"] == {
        "good": 2.0,
        "absent": None,
        "broken": None,
        "slow": 4.0,
    }
    assert (tmp_path / "rep" / "fake.md").exists() and (tmp_path / "rep" / "fake.json").exists()
    assert "missing" in capsys.readouterr().out


def test_wrong_kernel_is_never_timed(tmp_path, sources, fake_suite, fake_timer):
    def wrong(inputs, out):
        return out.copy_(inputs["a"].float() @ inputs["b"].float().T + 1.0)

    suite = fake_suite(sources, run_ours=wrong, comparators=_comparators)
    records = harness.run_bench(
        [suite], results_dir=tmp_path, report_dir=tmp_path, arch="sm_90a", device="cpu"
    )
    assert all(r["status"].startswith("wrong") and r["ours"] is None for r in records)
    assert fake_timer == []


def test_error_is_recorded(tmp_path, sources, fake_suite, fake_timer):
    def boom(inputs, out):
        raise RuntimeError("illegal instruction")

    suite = fake_suite(sources, run_ours=boom)
    records = harness.run_bench(
        [suite], results_dir=tmp_path, report_dir=tmp_path, arch="sm_90a", device="cpu"
    )
    assert all("illegal instruction" in r["status"] for r in records)


def test_timed_work_must_write_outputs(tmp_path, sources, fake_suite, fake_timer):
    fake_timer.graph_lost_work = True  # e.g. a launch that escaped the captured stream
    records = harness.run_bench(
        [fake_suite(sources)],
        results_dir=tmp_path,
        report_dir=tmp_path,
        arch="sm_90a",
        device="cpu",
    )
    assert all("unwritten" in r["status"] and r["ours"] is None for r in records)


def _variants(case):
    """Another mode of ours on the 7x24x40 case only: a correct one and a wrong one."""

    def det(inputs, out):
        return out.copy_(inputs["a"].float() @ inputs["b"].float().T)

    def bad(inputs, out):
        return out.fill_(0.0)

    return {"det": det, "bad": bad} if case.params["m"] == 7 else {}


def test_variants_of_ours_are_timed_apart(tmp_path, sources, fake_suite, fake_timer, capsys):
    suite = fake_suite(
        sources, comparators=_comparators, variants=_variants, dtypes=(torch.bfloat16,)
    )
    records = harness.run_bench(
        [suite], results_dir=tmp_path, report_dir=tmp_path / "rep", arch="sm_90a", device="cpu"
    )
    assert [r["variants"] for r in records][0] == {}
    det, bad = records[1]["variants"]["det"], records[1]["variants"]["bad"]
    assert det["status"] == "ok" and det["time_ratio"] == pytest.approx(1.5)
    assert bad["status"].startswith("wrong") and "ms" not in bad  # verified first, never timed
    assert fake_timer[1][0] == ["ours", "ours[det]", "good", "slow"]
    assert records[1]["comparators"]["good"]["ratio"] == pytest.approx(2.0)  # still vs ours
    doc = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())
    assert doc["bench"]["variant_ratio"] == {"det": {"7x24x40 bf16": 1.5}}
    assert set(doc["bench"]["median_ratio"]) == {"good", "absent", "broken", "slow"}
    out = capsys.readouterr().out
    assert "variants of ours" in out and "1.500x" in out
    assert "| 7x24x40 | bf16 | det | 1.5000 |" in (tmp_path / "rep" / "fake.md").read_text()
