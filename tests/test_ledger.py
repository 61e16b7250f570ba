from __future__ import annotations

import json

import pytest

from forgekernel.bench import ledger
from forgekernel.runtime.hashing import source_hash

ENV = {
    "gpu": "NVIDIA H200",
    "driver": "580.1",
    "cuda": "13.0",
    "torch": "2.11",
    "dsl_version": "4.8.1",
    "date": "2026-11-30T00:00:00+00:00",
}


def _write(suite, section, data, results):
    return ledger.write_section(suite, section, data, arch="sm_90a", results_dir=results, env=ENV)


def test_round_trip(tmp_path, sources, fake_suite):
    suite, results = fake_suite(sources), tmp_path / "results"
    path = _write(suite, "check", {"passed": True, "cases": [{"case": "c"}]}, results)
    _write(suite, "bench", {"cases": [], "median_ratio": {"cublas": 1.1}}, results)
    assert path == results / "sm_90a" / "fake.json"
    doc = json.loads(path.read_text())
    assert doc["source_hash"] == source_hash(sources)
    assert doc["check"]["passed"] and doc["check"]["cases"] == [{"case": "c"}]
    assert doc["bench"]["median_ratio"] == {"cublas": 1.1}
    assert doc["check"]["gpu"] == "NVIDIA H200"
    ok, reason = ledger.ledger_status(suite, results)
    assert ok, reason
    assert ledger.ledger_status(suite, results, arch="sm_90a")[0]


def test_changed_source_byte_is_not_ok(tmp_path, sources, fake_suite):
    suite, results = fake_suite(sources), tmp_path / "results"
    _write(suite, "check", {"passed": True, "cases": []}, results)
    sources[1].write_text("TILE = 256\n")
    ok, reason = ledger.ledger_status(suite, results)
    assert not ok and "current" in reason


def test_failed_or_missing_check_is_not_ok(tmp_path, sources, fake_suite):
    suite, results = fake_suite(sources), tmp_path / "results"
    assert not ledger.ledger_status(suite, results)[0]
    _write(suite, "bench", {"cases": []}, results)
    assert "no check section" in ledger.ledger_status(suite, results)[1]
    _write(suite, "check", {"passed": False, "cases": []}, results)
    assert "failed" in ledger.ledger_status(suite, results)[1]
    assert not ledger.ledger_status(fake_suite([]), results)[0]


def test_stale_section_dropped(tmp_path, sources, fake_suite):
    suite, results = fake_suite(sources), tmp_path / "results"
    _write(suite, "check", {"passed": True, "cases": []}, results)
    sources[0].write_text("KERNEL = 2\n")
    path = _write(suite, "bench", {"cases": [], "median_ratio": {"cublas": 0.9}}, results)
    doc = json.loads(path.read_text())
    assert "check" not in doc and doc["bench"]["source_hash"] == source_hash(sources)
    # a current section is kept
    _write(suite, "check", {"passed": True, "cases": []}, results)
    assert "bench" in json.loads(path.read_text())


def test_readme_table_only_from_ledgers(tmp_path, sources, fake_suite):
    results = tmp_path / "results"
    assert "No GPU results" in ledger.readme_table(results)
    suite = fake_suite(sources, name="gemm")
    _write(suite, "check", {"passed": True, "cases": []}, results)
    data = {"cases": [], "median_ratio": {"cublas": 1.234}, "min_ratio": {"cublas": 0.987}}
    _write(suite, "bench", data, results)
    (results / "sm_90a" / "notes.txt").write_text("not a ledger")
    table = ledger.readme_table(results)
    rows = [line for line in table.splitlines() if line.startswith("| gemm")]
    assert rows == [
        f"| gemm | NVIDIA H200 | cublas | +23.4% (1.234x) | -1.3% (0.987x) | passed | 2026-11-30 "
        f"| {source_hash(sources)} | forgekernel/kernels/gemm/dense/sm90 |"
    ]


def test_update_readme(tmp_path, sources, fake_suite):
    results, readme = tmp_path / "results", tmp_path / "README.md"
    readme.write_text("# x\n<!-- results:begin -->\nold\n<!-- results:end -->\ntail\n")
    _write(fake_suite(sources, name="gemm"), "check", {"passed": True, "cases": []}, results)
    assert ledger.update_readme(readme, results)
    text = readme.read_text()
    assert "old" not in text and "| gemm |" in text and text.endswith("tail\n")
    assert not ledger.update_readme(readme, results)


def test_dsl_version_from_bundle_manifest(tmp_path, monkeypatch):
    def missing(name):
        raise ledger.importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(ledger.importlib.metadata, "version", missing)
    monkeypatch.delenv(ledger.KERNEL_DIR_ENV, raising=False)
    assert ledger.dsl_version() == "unknown"
    (tmp_path / "manifest.json").write_text(json.dumps({"dsl_version": "4.8.1"}))
    monkeypatch.setenv(ledger.KERNEL_DIR_ENV, str(tmp_path))
    assert ledger.dsl_version().startswith("4.8.1")


def test_default_results_dir_env(tmp_path, monkeypatch):
    monkeypatch.setenv(ledger.RESULTS_ENV, str(tmp_path))
    assert ledger.default_results_dir() == tmp_path
    monkeypatch.delenv(ledger.RESULTS_ENV)
    assert ledger.default_results_dir().parts[-2:] == ("benchmarks", "results")


SANITIZE = {
    "passed": True,
    "tools": {
        "memcheck": {"status": "ok", "count": 0, "unit": "errors", "cases": {}},
        "racecheck": {
            "status": "ok",
            "count": 512,
            "unit": "hazards",
            "explained": True,
            "cases": {"c": {"count": 512, "explanation": "mbarrier orders it", "explained": True}},
        },
    },
}


def test_sanitize_section_lives_and_dies_with_its_source(tmp_path, sources, fake_suite):
    suite, results = fake_suite(sources), tmp_path / "results"
    _write(suite, "sanitize", SANITIZE, results)
    path = _write(suite, "check", {"passed": True, "cases": []}, results)
    doc = json.loads(path.read_text())
    assert doc["sanitize"]["tools"]["racecheck"]["count"] == 512
    assert doc["sanitize"]["source_hash"] == source_hash(sources)
    sources[0].write_text("KERNEL = 3\n")
    assert "sanitize" not in json.loads(_write(suite, "check", {}, results).read_text())


def test_readme_lists_variants_and_sanitizers(tmp_path, sources, fake_suite):
    results = tmp_path / "results"
    suite = fake_suite(sources, name="attention_bwd")
    bench = {"cases": [], "median_ratio": {"fa4": 1.0}, "variant_ratio": {"deterministic": {}}}
    bench["variant_ratio"]["deterministic"] = {"b4-s8192 bf16": 1.333, "b2-d192 bf16": 1.04}
    _write(suite, "bench", bench, results)
    _write(suite, "sanitize", SANITIZE, results)
    table = ledger.readme_table(results)
    assert "- attention_bwd, deterministic: 1.333x (b4-s8192 bf16), 1.040x (b2-d192 bf16)" in table
    assert (
        "- attention_bwd: clean: memcheck 0 errors, racecheck 512 hazards (explained in the "
        "ledger) (2026-11-30)" in table
    )


def test_readme_adds_eager_and_host_lines(tmp_path, sources, fake_suite):
    results = tmp_path / "results"
    eager = {"median_ratio": {"cublas": 1.012, "none": None}, "min_ratio": {"cublas": 0.97}}
    host = {
        "case": "1x8x8",
        "dtype": "bf16",
        "status": "ok",
        "us_per_call": {"ours": 55.14, "cublas": 21.0, "torch.matmul": 19.96},
    }
    bench = {
        "cases": [],
        "timing": ["graph", "eager"],
        "median_ratio": {"cublas": 1.025},
        "min_ratio": {"cublas": 0.99},
        "methods": {"graph": {"median_ratio": {"cublas": 1.025}}, "eager": eager},
        "host": host,
    }
    _write(fake_suite(sources, name="gemm"), "bench", bench, results)
    failed = {"case": "c", "dtype": "bf16", "status": "error: RuntimeError: boom"}
    _write(fake_suite(sources, name="attention"), "bench", {"cases": [], "host": failed}, results)
    _write(fake_suite(sources, name="old"), "bench", {"cases": [], "median_ratio": {}}, results)
    table = ledger.readme_table(results)
    rows = [line for line in table.splitlines() if line.startswith("| gemm")]
    assert len(rows) == 1 and "+2.5% (1.025x)" in rows[0]  # the table keeps the graph medians
    assert (
        "- gemm: eager, L2 flushed: cublas +1.2% (1.012x), slowest -3.0% (0.970x); host per "
        "eager call (1x8x8 bf16): ours 55.1 us, cublas 21.0 us, torch.matmul 20.0 us"
    ) in table
    assert "- attention: host per eager call (c bf16): error: RuntimeError: boom" in table
    assert "- old:" not in table
    assert "Second timing method and host time" in table


def test_readme_adds_percent_of_a_device_copy(tmp_path, sources, fake_suite):
    """A memory-bound operator's line adds ours as a % of a device copy (suite median, per
    method); the block's head says what it is only when some operator has one."""
    results = tmp_path / "results"
    fraction = {"ours": {"median": 0.8123, "min": 0.5, "cases": 3}, "fi": {"median": 0.9}}
    methods = {
        "graph": {"median_ratio": {"fi": 1.1}, "copy_fraction": fraction},
        "eager": {"median_ratio": {"fi": 1.0}, "copy_fraction": {"ours": {"median": 0.78}}},
    }
    bench = {"cases": [], "median_ratio": {"fi": 1.1}, "methods": methods}
    _write(fake_suite(sources, name="mla_decode"), "bench", bench, results)
    table = ledger.readme_table(results)
    assert (
        "- mla_decode: eager, L2 flushed: fi +0.0% (1.000x), slowest -; "
        "ours 81.2% (graph), 78.0% (eager) of a device copy (median)"
    ) in table
    assert "; memory-bound operators: our GB/s as a % of a device copy's" in table
    del methods["graph"]["copy_fraction"], methods["eager"]["copy_fraction"]
    _write(fake_suite(sources, name="mla_decode"), "bench", bench, results)
    table = ledger.readme_table(results)
    assert "device copy" not in table and "ours and each comparator:" in table


def test_readme_without_eager_or_host_has_no_such_block(tmp_path, sources, fake_suite):
    results = tmp_path / "results"
    _write(fake_suite(sources, name="gemm"), "bench", {"cases": [], "median_ratio": {}}, results)
    assert "Second timing method" not in ledger.readme_table(results)


def test_take_keeps_an_earlier_calls_sections_on_the_same_sources(tmp_path, sources, fake_suite):
    """scripts/take_results.sh: a later call's ledger (bench only: its fresh host started from
    the committed ledgers) does not drop the check an earlier call wrote on the same sources;
    a section on other sources is not kept, and a ledger with nothing to keep is copied as is."""
    suite = fake_suite(sources)
    first, second, repo = tmp_path / "a", tmp_path / "b", tmp_path / "repo"
    ledger.write_section(suite, "check", {"passed": True}, arch="sm_90a", results_dir=first)
    ledger.write_section(
        suite, "bench", {"median_ratio": {"x": 1.0}}, arch="sm_90a", results_dir=second
    )
    dst = ledger.ledger_path(repo, "sm_90a", suite.name)
    ledger.take(ledger.ledger_path(first, "sm_90a", suite.name), dst)
    ledger.take(ledger.ledger_path(second, "sm_90a", suite.name), dst)
    doc = json.loads(dst.read_text())
    assert doc["check"]["passed"] is True and doc["bench"]["median_ratio"] == {"x": 1.0}
    assert ledger.ledger_status(suite, repo, "sm_90a")[0]
    sources[0].write_text("KERNEL = 2\n")
    ledger.write_section(
        suite, "bench", {"median_ratio": {"x": 2.0}}, arch="sm_90a", results_dir=second
    )
    src = ledger.ledger_path(second, "sm_90a", suite.name)
    ledger.take(src, dst)
    assert "check" not in json.loads(dst.read_text()) and dst.read_bytes() == src.read_bytes()


def test_comparator_pins_are_the_bench_extras():
    """One list of comparator versions: the pyproject's `bench` extra pins exactly
    COMPARATOR_PINS but sgl-flash-mla (its metadata asks a newer torch: installed --no-deps)."""
    tomllib = pytest.importorskip("tomllib")  # Python >= 3.11 (the package allows 3.10)

    from forgekernel.bench.ledger import COMPARATOR_PINS, comparator_versions, repo_root

    extra = tomllib.loads((repo_root() / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]["bench"]
    pins = dict(spec.split("==") for spec in extra if "==" in spec)
    assert pins == {k: v for k, v in COMPARATOR_PINS.items() if k != "sgl-flash-mla"}
    found = comparator_versions()
    assert set(found) <= {*COMPARATOR_PINS, "triton", "cudnn"}
    assert all(isinstance(v, str) and v for v in found.values())


PARTIAL = {"cases": [{"case": "c", "comparators": {"x": {"ratio": 9.0}}}], "options": {"reps": 30}}


def test_partial_bench_section_lives_until_the_bench_section(tmp_path, sources, fake_suite):
    """A check written beside a partial bench keeps it (same sources); the bench section, the
    suite completed, drops it; new sources drop it like any section."""
    suite, results = fake_suite(sources), tmp_path / "results"
    _write(suite, ledger.PARTIAL, PARTIAL, results)
    path = _write(suite, "check", {"passed": True}, results)
    assert json.loads(path.read_text())[ledger.PARTIAL]["cases"] == PARTIAL["cases"]
    got = ledger.partial_cases(suite, {"gpu": ENV["gpu"]}, arch="sm_90a", results_dir=results)
    assert got == (PARTIAL["cases"], "")
    records, why = ledger.partial_cases(suite, {"options": {"reps": 7}}, arch="sm_90a",
                                        results_dir=results)  # fmt: skip
    assert records == [] and why.startswith("its options {'reps': 30} is not this run's")
    _write(suite, "bench", {"cases": []}, results)
    assert ledger.PARTIAL not in json.loads(path.read_text())
    _write(suite, ledger.PARTIAL, PARTIAL, results)
    sources[0].write_text("KERNEL = 2\n")
    assert ledger.partial_cases(suite, {}, arch="sm_90a", results_dir=results)[1].startswith(
        "its source_hash "
    )
    assert ledger.PARTIAL not in json.loads(_write(suite, "check", {}, results).read_text())


def test_readme_and_gate_ignore_a_partial_bench(tmp_path, sources, fake_suite):
    """No README figure and no gate pass from a partial suite."""
    results = tmp_path / "results"
    suite = fake_suite(sources, name="gemm")
    partial = {**PARTIAL, "median_ratio": {"cublas": 9.0}, "host": {"status": "ok"}}
    _write(suite, ledger.PARTIAL, {**partial, "passed": True}, results)
    assert ledger.ledger_status(suite, results)[1].endswith("no check section")
    _write(suite, "check", {"passed": True}, results)
    table = ledger.readme_table(results)
    assert "9.0" not in table and "cublas" not in table and "Second timing method" not in table
    assert "| gemm | NVIDIA H200 | - | - | - | passed |" in table
    assert ledger.ledger_status(suite, results)[0]


def test_take_carries_a_partial_bench_until_a_later_complete_one(tmp_path, sources, fake_suite):
    """scripts/take_results.sh: a call's partial bench comes into the repository's ledger and
    stays through a later call that did not bench (its check on the same sources), and through
    one whose bench section is older (the committed one it started from); a later call's
    complete bench section supersedes it."""
    suite, repo = fake_suite(sources), tmp_path / "repo"
    dst = ledger.ledger_path(repo, "sm_90a", suite.name)

    def call(name, section, data, date):
        results = tmp_path / name
        ledger.write_section(suite, section, data, arch="sm_90a", results_dir=results,
                             env={**ENV, "date": date})  # fmt: skip
        return ledger.ledger_path(results, "sm_90a", suite.name)

    old = call("old", "bench", {"cases": [], "median_ratio": {"x": 1.0}}, "2026-12-05T10:00:00")
    ledger.take(old, dst)
    cut = call("cut", ledger.PARTIAL, PARTIAL, "2026-12-06T04:00:00")
    ledger.take(cut, dst)
    doc = json.loads(dst.read_text())
    assert doc[ledger.PARTIAL]["cases"] == PARTIAL["cases"] and "bench" in doc
    ledger.take(call("chk", "check", {"passed": True}, "2026-12-06T04:10:00"), dst)
    ledger.take(old, dst)  # an older complete bench (a host that started from the commit)
    assert ledger.PARTIAL in json.loads(dst.read_text())
    done = call("done", "bench", {"cases": [{"case": "c"}]}, "2026-12-06T04:20:00")
    ledger.take(done, dst)
    doc = json.loads(dst.read_text())
    assert ledger.PARTIAL not in doc and doc["bench"]["cases"] == [{"case": "c"}]
    assert doc["check"]["passed"] is True
