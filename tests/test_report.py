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


def _mem(case, ours_gbps, comps, status="ok"):
    """A memory-bound record timed both ways alike: GB/s of ours and of each comparator (a
    string: missing), the same bytes for all (so comparator ms = ours ms x ours / its GB/s)."""
    ms = {n: g if isinstance(g, str) else ours_gbps / g for n, g in comps.items()}
    rec = {**_rec(case, 1.0, ms, status), "timing": ["graph", "eager"]}
    if rec["ours"]:
        rec["ours"]["gbps"] = ours_gbps
    for name, g in comps.items():
        if not isinstance(g, str):
            rec["comparators"][name]["gbps"] = g
    rec["eager"] = {"ours": rec["ours"], "comparators": rec["comparators"], "variants": {}}
    return rec


MEMORY_BOUND = [
    _mem("L4096", 3000.0, {"flashinfer": 2000.0, "flashmla": "not available in this process"}),
    _mem("L8192", 3600.0, {"flashinfer": 3800.0, "flashmla": "not available in this process"}),
    _mem("L16384", 2000.0, {"flashinfer": 1000.0}),
    _mem("bad", 9000.0, {"flashinfer": 1.0}, status="wrong: x"),
]
COPY = {
    "op": "torch.neg(src, out=dst)",
    "buffer_bytes": 2**30,
    "bytes": 2**31,
    "status": "ok",
    "methods": {"graph": {"ms": 0.5, "gbps": 4000.0}, "eager": {"ms": 0.7, "gbps": 3000.0}},
}


def test_percent_of_a_device_copy():
    """ours / comparator GB/s over the copy's GB/s of the same timing method; the wrong case and
    the missing comparator never count."""
    graph = report.copy_summary(MEMORY_BOUND, COPY)
    assert list(graph) == ["ours", "flashinfer", "flashmla"]
    assert graph["ours"] == {"median": pytest.approx(0.75), "min": pytest.approx(0.5), "cases": 3}
    assert graph["flashinfer"]["median"] == pytest.approx(0.5)
    assert graph["flashinfer"]["min"] == pytest.approx(0.25)
    assert graph["flashmla"] == {"median": None, "min": None, "cases": 0}
    assert report.copy_summary(MEMORY_BOUND, COPY, "eager")["ours"]["median"] == pytest.approx(1.0)
    kept = report.method_summary(MEMORY_BOUND, "graph", COPY)
    assert kept["copy_fraction"]["ours"]["min"] == pytest.approx(0.5)
    assert "copy_fraction" not in report.method_summary(MEMORY_BOUND, "graph")
    memcpy = {k: v for k, v in COPY.items() if k != "op"}  # `dst.copy_(src)`: a graph memcpy node
    assert report.copy_summary(MEMORY_BOUND, memcpy) == {}
    assert report.copy_summary(MEMORY_BOUND, memcpy, "eager")["ours"]["cases"] == 3
    failed = {**COPY, "status": "error: OutOfMemoryError: no"}
    assert report.copy_summary(MEMORY_BOUND, failed) == {}
    assert report.copy_lines(MEMORY_BOUND, failed) == [
        "device copy (graph): error: OutOfMemoryError: no"
    ]


def test_reports_of_a_memory_bound_suite(tmp_path):
    paths = report.write_reports("mla_decode", MEMORY_BOUND, tmp_path, copy=COPY)
    graph, eager = paths["md"].read_text().split("## eager")
    assert (
        "| case | dtype | ours ms | ours TFLOP/s | ours GB/s | % of copy | flashinfer ms |"
    ) in graph
    assert "| L4096 | bf16 | 1.0000 | 2.0 | 3000 | 75.0% | 1.5000 | 1.500x | missing | - |" in graph
    assert "| bad | bf16 | wrong: x | - | - | - | - | - | - | - |" in graph
    assert (
        "- device copy: 4000 GB/s (torch.neg(src, out=dst) of 1 GiB, read + write counted); "
        "% of copy, "
        "median / min (cases): ours 75.0% / 50.0% (3), flashinfer 50.0% / 25.0% (3)"
    ) in graph
    assert "| L4096 | bf16 | 1.0000 | 2.0 | 3000 | 100.0% |" in eager  # the eager copy's
    assert "- device copy: 3000 GB/s" in eager
    doc = json.loads(paths["json"].read_text())
    assert doc["device_copy"]["methods"]["graph"]["gbps"] == 4000.0
    assert doc["copy_fraction"]["eager"]["ours"]["median"] == pytest.approx(1.0)
    assert "% of copy" in report.console_table(MEMORY_BOUND, copy=COPY)


def test_no_copy_figure_no_column():
    """Records without a device copy (compute-bound suites, ledgers written before it) render
    as before: no GB/s column, no copy line."""
    md = report.markdown("mla_decode", MEMORY_BOUND)
    assert "GB/s" not in md and "device copy" not in md
    assert "| L4096 | bf16 | 1.0000 | 2.0 | 1.5000 | 1.500x | missing | - |" in md
    assert md == report.markdown("mla_decode", MEMORY_BOUND, copy=None)


def test_a_committed_ledger_without_the_copy_renders_as_before():
    """A memory-bound ledger's bench section as written before the device copy (the committed
    mla_decode one without its copy) loads and renders without the column or copy figures."""
    from forgekernel.bench import ledger

    doc = ledger.load(ledger.default_results_dir() / "sm_90a" / "mla_decode.json")
    if doc is None or "bench" not in doc:
        pytest.skip("no committed mla_decode ledger")
    bench = {k: v for k, v in doc["bench"].items() if k != "device_copy"}
    md = report.markdown("mla_decode", bench["cases"], host=bench.get("host"),
                         copy=bench.get("device_copy"))  # fmt: skip
    assert "% of copy" not in md and "device copy" not in md
    assert report.copy_summary(bench["cases"], bench.get("device_copy")) == {}
