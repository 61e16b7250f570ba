from __future__ import annotations

import json

import pytest

from forgekernel.bench import report


def _rec(case, ours_ms, comps, status="ok"):
    comparators = {}
    for name, ms in comps.items():
        if isinstance(ms, str):
            comparators[name] = {"missing": ms}
        else:
            comparators[name] = {"ms": ms, "tflops": 1.0, "gbps": 1.0, "ratio": ms / ours_ms}
    ours = {"ms": ours_ms, "tflops": 2.0, "gbps": 3.0} if status == "ok" else None
    return {
        "case": case,
        "dtype": "bf16",
        "status": status,
        "ours": ours,
        "comparators": comparators,
    }


RECORDS = [
    _rec("a", 1.0, {"cublas": 2.0, "fa4": "not available in this process"}),
    _rec("b", 2.0, {"cublas": 1.0, "fa4": "not available in this process"}),
    _rec("c", 1.0, {"cublas": 1.0, "fa4": "not available in this process"}),
    _rec("d", 1.0, {"cublas": 100.0}, status="wrong: error 3 > 2 x 1 + 0"),
]


def test_summary_math():
    s = report.summarize(RECORDS)
    assert s["cublas"]["median_ratio"] == pytest.approx(1.0)
    assert s["cublas"]["min_ratio"] == pytest.approx(0.5)
    assert s["cublas"]["cases"] == 3  # the wrong case never counts
    assert s["fa4"]["median_ratio"] is None and s["fa4"]["cases"] == 0
    assert s["fa4"]["missing_reasons"] == ["not available in this process"]


def test_even_count_median():
    s = report.summarize(RECORDS[:2])
    assert s["cublas"]["median_ratio"] == pytest.approx(1.25)


def test_write_reports(tmp_path):
    paths = report.write_reports("gemm", RECORDS, tmp_path / "r", env={"gpu": "H200"})
    doc = json.loads(paths["json"].read_text())
    assert doc["op"] == "gemm" and len(doc["cases"]) == 4
    assert doc["summary"]["cublas"]["min_ratio"] == pytest.approx(0.5)
    md = paths["md"].read_text()
    assert "| case | dtype | ours ms | ours TFLOP/s | cublas ms | cublas ratio |" in md
    assert "| a | bf16 | 1.0000 | 2.0 | 2.0000 | 2.000x | missing | - |" in md
    assert "wrong: error" in md
    assert "cublas: median ratio 1.000x, min 0.500x over 3 cases" in md
    assert "fa4: missing: not available in this process" in md
    pytest.importorskip("matplotlib")
    assert paths["png"].stat().st_size > 0


def test_console_table():
    text = report.console_table(RECORDS)
    assert text.splitlines()[0].startswith("graph: CUDA-graph replays")  # records before eager
    assert text.splitlines()[1].split()[:4] == ["case", "dtype", "ours", "ms"]
    assert "missing" in text and "min 0.500x" in text


def test_variant_figures_stay_apart_from_the_comparators():
    timed = {"status": "ok", "ms": 1.5, "tflops": 1.0, "time_ratio": 1.5}
    records = [
        {**_rec("a", 1.0, {"cublas": 2.0}), "variants": {"det": timed}},
        {**_rec("b", 1.0, {"cublas": 1.0}), "variants": {"det": {"status": "wrong: x"}}},
        {**_rec("c", 1.0, {}, status="error: y"), "variants": {"det": timed}},
    ]
    assert report.variant_ratios(records) == {"det": {"a bf16": 1.5}}
    assert report.summarize(records)["cublas"]["cases"] == 2
    rows = report.variant_rows(records)
    assert rows[:2] == [
        ["a", "bf16", "det", "1.5000", "1.0", "1.500x"],
        ["b", "bf16", "det", "wrong: x", "-", "-"],
    ]
    assert "variants of ours" in report.console_table(records)
    assert "variants of ours" not in report.console_table(RECORDS)


def _two_methods(case, group, graph, eager, status="ok"):
    """A record timed both ways: {comparator: (ours ms, comparator ms)} per method."""
    rec = {**_rec(case, graph[0], graph[1], status), "group": group, "timing": ["graph", "eager"]}
    rec["eager"] = {
        k: v
        for k, v in _rec(case, eager[0], eager[1], status).items()
        if k in ("ours", "comparators")
    }
    rec["eager"]["variants"] = {}
    return rec


GROUPED = [
    _two_methods("d1", "decode", (1.0, {"cublas": 0.5}), (1.0, {"cublas": 0.7})),
    _two_methods("d2", "decode", (1.0, {"cublas": 0.9}), (1.0, {"cublas": 0.8})),
    _two_methods("p1", "prefill", (1.0, {"cublas": 1.1}), (2.0, {"cublas": 2.4})),
    _two_methods("u1", "", (1.0, {"cublas": 1.0}), (1.0, {"cublas": 1.3})),
    _two_methods("w", "decode", (1.0, {"cublas": 9.0}), (1.0, {"cublas": 9.0}), "wrong: x"),
]


def test_per_method_and_per_group_medians():
    assert report.timed_methods(GROUPED) == ["graph", "eager"]
    assert report.timed_methods(RECORDS) == ["graph"]  # records before the field: graph only
    graph, eager = report.summarize(GROUPED), report.summarize(GROUPED, "eager")
    assert graph["cublas"]["median_ratio"] == pytest.approx(0.95)
    assert eager["cublas"]["median_ratio"] == pytest.approx(1.0)
    assert eager["cublas"]["min_ratio"] == pytest.approx(0.7)
    assert eager["cublas"]["group_median_ratio"] == {
        "": pytest.approx(1.3),
        "decode": pytest.approx(0.75),  # the wrong case never counts
        "prefill": pytest.approx(1.2),
    }
    assert eager["cublas"]["group_cases"] == {"": 1, "decode": 2, "prefill": 1}
    kept = report.method_summary(GROUPED, "eager")
    assert kept["median_ratio"] == {"cublas": pytest.approx(1.0)}
    assert kept["group_median_ratio"]["cublas"]["decode"] == pytest.approx(0.75)
    assert kept["variant_ratio"] == {}


def test_reports_of_both_methods(tmp_path):
    host = {
        "case": "d1",
        "dtype": "bf16",
        "calls": 200,
        "status": "ok",
        "us_per_call": {"ours": 40.0, "cublas": 20.0},
        "missing": {"sdpa": "not available in this process"},
    }
    paths = report.write_reports("gemm", GROUPED, tmp_path, host=host)
    md = paths["md"].read_text()
    graph_part, eager_part = md.split("## eager")
    assert "| case | group | dtype | ours ms |" in graph_part
    assert "| p1 | prefill | bf16 | 1.0000 | 2.0 | 1.1000 | 1.100x |" in graph_part
    assert "| p1 | prefill | bf16 | 2.0000 | 2.0 | 2.4000 | 1.200x |" in eager_part
    assert "cublas by group (median, cases): ungrouped 1.300x (1), decode 0.750x (2)" in md
    assert "ours 40.0 us, cublas 20.0 us (0.500x)" in md
    assert "host: sdpa: missing: not available in this process" in md
    doc = json.loads(paths["json"].read_text())
    assert doc["methods"]["eager"]["cublas"]["median_ratio"] == pytest.approx(1.0)
    assert doc["host"]["us_per_call"]["ours"] == 40.0
    text = report.console_table(GROUPED, host)
    assert "eager: eager launches, L2 flushed" in text and "ours 40.0 us" in text
    pytest.importorskip("matplotlib")
    assert paths["png-eager"].stat().st_size > 0 and paths["png"].stat().st_size > 0


def test_host_lines_of_a_failed_host_run():
    host = {"case": "c", "dtype": "bf16", "calls": 200, "status": "wrong: error 3 > 2"}
    assert report.host_lines(host) == [
        "host time per eager call (c bf16, 200 back-to-back calls): wrong: error 3 > 2"
    ]
    assert report.host_lines(None) == []
