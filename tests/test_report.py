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
    assert text.splitlines()[0].split()[:4] == ["case", "dtype", "ours", "ms"]
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
