"""run_bench on the CPU with the timer replaced: verification gate, missing comparators, ratios."""

from __future__ import annotations

import json

import pytest
import torch

from forgekernel.bench import harness
from forgekernel.bench.suite import Case
from forgekernel.runtime.timing import HostTimes, Samples


class Calls(list):
    graph_lost_work = False


GRAPH_MS = {"ours": 1.0, "good": 2.0, "slow": 4.0, "ours[det]": 1.5, "ours[bad]": 9.0, "copy": 1e-3}
EAGER_MS = {"ours": 2.0, "good": 3.0, "slow": 1.0, "ours[det]": 4.0, "copy": 2e-3}
HOST_US = {"ours": 50.0, "good": 20.0, "slow": 25.0, "torch": 10.0}


def _fake(calls: Calls, method: str, table: dict[str, float]):
    def timer(fns, *, rotate, warmup, reps):
        calls.append((list(fns), len(rotate), method))
        for args in rotate:  # every candidate must run on every input set
            for fn in fns.values():
                fn(*args)

        def rerun(fn):
            return lambda: None if calls.graph_lost_work else [fn(*a) for a in rotate]

        return {
            k: Samples([table[k]] * 3, method=method, launches=4, rerun=rerun(fn))
            for k, fn in fns.items()
        }

    return timer


@pytest.fixture
def fake_timer(monkeypatch):
    """Both timing methods and the host loop replaced; `calls` lists (candidates, input sets,
    method) per timed case and ("host", candidates, calls) per host loop."""
    calls = Calls()

    def host(fns, **kw):
        for fn in fns.values():
            fn()
        kw["sync"]()
        calls.append(("host", list(fns), kw["calls"]))
        # "slow" waited for the device: issued at 5 us per call, 25 us to the sync
        issued = {k: 5.0 if k == "slow" else v for k, v in HOST_US.items()}
        return {k: HostTimes([HOST_US[k]] * kw["rounds"], [issued[k]] * kw["rounds"]) for k in fns}

    monkeypatch.setattr(harness, "time_interleaved", _fake(calls, "cuda-graph", GRAPH_MS))
    monkeypatch.setattr(harness, "time_eager_flushed", _fake(calls, "eager-flushed", EAGER_MS))
    monkeypatch.setattr(harness, "host_us_per_call", host)
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1000)
    monkeypatch.setattr(harness, "device_contention", lambda: dict(PROBE))
    return calls


PROBE = {"alone_ms": 0.17, "burst_ms": 0.16, "ratio": 0.94, "contended": False, "other_pids": []}


def timed(calls: Calls, method: str) -> list:
    return [c[:2] for c in calls if c[-1] == method]


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
    graph = timed(fake_timer, "cuda-graph")
    assert graph[0][0] == ["ours", "good", "slow"]
    assert graph[0][1] > 1  # tiny case with a 1000-byte "L2": inputs rotated
    doc = json.loads((tmp_path / "res" / "sm_90a" / "fake.json").read_text())
    assert doc["bench"]["median_ratio"] == {
        "good": 2.0,
        "absent": None,
        "broken": None,
        "slow": 4.0,
    }
    assert (tmp_path / "rep" / "fake.md").exists() and (tmp_path / "rep" / "fake.json").exists()
    assert "missing" in capsys.readouterr().out


def test_a_shared_device_is_shouted_and_recorded(
    tmp_path, sources, fake_suite, fake_timer, monkeypatch, capsys
):
    """The device check runs before and after a suite's timing; a contended probe (the H200's
    call 4 of 2026-12-01 23:00: every 10 ms replay ~2x the lone launch) is printed as such and
    kept in the ledger's bench section."""
    probes = iter([dict(PROBE), {**PROBE, "burst_ms": 0.35, "ratio": 2.06, "contended": True}])
    monkeypatch.setattr(harness, "device_contention", lambda: next(probes))
    suite = fake_suite(sources, comparators=_comparators, dtypes=(torch.bfloat16,))
    harness.run_bench([suite], results_dir=tmp_path, report_dir=tmp_path, arch="sm_90a",
                      device="cpu")  # fmt: skip
    out = capsys.readouterr().out
    assert "device check before" in out and "DEVICE SHARED" in out.split("device check after")[1]
    check = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())["bench"]["device_check"]
    assert not check["before"]["contended"] and check["after"]["contended"]


def test_wrong_kernel_is_never_timed(tmp_path, sources, fake_suite, fake_timer):
    def wrong(inputs, out):
        return out.copy_(inputs["a"].float() @ inputs["b"].float().T + 1.0)

    suite = fake_suite(sources, run_ours=wrong, comparators=_comparators)
    records = harness.run_bench(
        [suite], results_dir=tmp_path, report_dir=tmp_path, arch="sm_90a", device="cpu"
    )
    assert all(r["status"].startswith("wrong") and r["ours"] is None for r in records)
    assert [c for c in fake_timer if c[0] != "host"] == []


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
    assert timed(fake_timer, "cuda-graph")[1][0] == ["ours", "ours[det]", "good", "slow"]
    assert records[1]["comparators"]["good"]["ratio"] == pytest.approx(2.0)  # still vs ours
    doc = json.loads((tmp_path / "sm_90a" / "fake.json").read_text())
    assert doc["bench"]["variant_ratio"] == {"det": {"7x24x40 bf16": 1.5}}
    assert set(doc["bench"]["median_ratio"]) == {"good", "absent", "broken", "slow"}
    out = capsys.readouterr().out
    assert "variants of ours" in out and "1.500x" in out
    assert "| 7x24x40 | bf16 | det | 1.5000 |" in (tmp_path / "rep" / "fake.md").read_text()


def _bench(suite, tmp_path, **timing):
    return harness.run_bench(
        [suite],
        results_dir=tmp_path / "res",
        report_dir=tmp_path / "rep",
        arch="sm_90a",
        device="cpu",
        timing=harness.BenchTiming(**timing),
    )


def _ledger(tmp_path, name="fake"):
    return json.loads((tmp_path / "res" / "sm_90a" / f"{name}.json").read_text())["bench"]


GROUPED = (
    Case("1x8x8", {"m": 1, "n": 8, "k": 8}, group="decode"),
    Case("4x8x8", {"m": 4, "n": 8, "k": 8}, group="decode"),
    Case("7x24x40", {"m": 7, "n": 24, "k": 40}, group="prefill"),
    Case("9x8x16", {"m": 9, "n": 8, "k": 16}),
)


def test_both_methods_per_case_and_per_group(tmp_path, sources, fake_suite, fake_timer, capsys):
    suite = fake_suite(
        sources, comparators=_comparators, bench_cases=GROUPED, dtypes=(torch.bfloat16,)
    )
    records = _bench(suite, tmp_path)
    rec = records[2]
    assert rec["group"] == "prefill" and rec["timing"] == ["graph", "eager"]
    assert rec["comparators"]["good"]["ratio"] == pytest.approx(2.0)  # graph: top level
    eager = rec["eager"]
    assert eager["ours"]["ms"] == pytest.approx(2.0) and eager["ours"]["method"] == "eager-flushed"
    assert eager["comparators"]["good"]["ratio"] == pytest.approx(1.5)
    assert eager["comparators"]["slow"]["ratio"] == pytest.approx(0.5)
    assert eager["comparators"]["absent"] == {"missing": "not available in this process"}
    assert "cuBLAS says no" in eager["comparators"]["broken"]["missing"]
    # eager launches flush L2: one input set, no rotation
    assert all(n == 1 for _, n in timed(fake_timer, "eager-flushed"))
    bench = _ledger(tmp_path)
    assert bench["timing"] == ["graph", "eager"]
    assert bench["median_ratio"]["good"] == pytest.approx(2.0)  # the README's: graph
    methods = bench["methods"]
    assert methods["graph"]["median_ratio"]["slow"] == pytest.approx(4.0)
    assert methods["eager"]["median_ratio"]["slow"] == pytest.approx(0.5)
    assert methods["eager"]["min_ratio"]["good"] == pytest.approx(1.5)
    assert methods["eager"]["group_median_ratio"]["good"] == {
        "": pytest.approx(1.5),
        "decode": pytest.approx(1.5),
        "prefill": pytest.approx(1.5),
    }
    assert methods["eager"]["group_median_ratio"]["absent"] == {}
    md = (tmp_path / "rep" / "fake.md").read_text()
    assert "## graph: CUDA-graph replays" in md and "## eager: eager launches, L2 flushed" in md
    assert "| 7x24x40 | prefill | bf16 | 2.0000 |" in md  # the eager table's row
    assert "good by group (median, cases): ungrouped 1.500x (1), decode 1.500x (2)" in md
    out = capsys.readouterr().out
    assert "graph 1.0000 ms eager 2.0000 ms" in out


def test_eager_only(tmp_path, sources, fake_suite, fake_timer):
    suite = fake_suite(sources, comparators=_comparators, dtypes=(torch.bfloat16,))
    records = _bench(suite, tmp_path, methods=("eager",))
    assert [r["status"] for r in records] == ["ok", "ok"]
    assert records[0]["ours"] is None and records[0]["eager"]["ours"]["ms"] == 2.0
    assert timed(fake_timer, "cuda-graph") == []
    bench = _ledger(tmp_path)
    assert bench["timing"] == ["eager"] and "median_ratio" not in bench
    assert bench["methods"]["eager"]["median_ratio"]["good"] == pytest.approx(1.5)
    md = (tmp_path / "rep" / "fake.md").read_text()
    assert "## eager" in md and "## graph" not in md


def test_eager_launches_must_write_outputs(tmp_path, sources, fake_suite, fake_timer):
    fake_timer.graph_lost_work = True
    records = _bench(fake_suite(sources), tmp_path, methods=("eager",))
    assert all("timed eager launches of ours" in r["status"] for r in records)


def _torch_matmul():
    def broken(inputs):
        raise RuntimeError("no SDPA here")

    return {"torch": lambda i: i["a"] @ i["b"].T, "absent_host": None, "broken_host": broken}


def test_host_time_per_call(tmp_path, sources, fake_suite, fake_timer, capsys):
    suite = fake_suite(
        sources,
        comparators=_comparators,
        host_comparators=_torch_matmul,
        dtypes=(torch.bfloat16, torch.float16),
    )
    _bench(suite, tmp_path, host_calls=7)
    ((_, names, calls),) = [c for c in fake_timer if c[0] == "host"]
    assert names == ["ours", "good", "slow", "torch"] and calls == 7
    host = _ledger(tmp_path)["host"]
    assert host["case"] == "1x8x8" and host["dtype"] == "bf16"  # fewest flops, first dtype
    assert host["status"] == "ok" and host["calls"] == 7
    assert host["us_per_call"] == {"ours": 50.0, "good": 20.0, "slow": 25.0, "torch": 10.0}
    assert host["rounds_us"]["torch"] == [10.0] * harness.HOST_ROUNDS
    assert host["issue_us_per_call"]["slow"] == 5.0 and host["device_bound"] == ["slow"]
    assert host["missing"]["absent_host"] == "not available in this process"
    assert "no SDPA here" in host["missing"]["broken_host"]
    assert "cuBLAS says no" in host["missing"]["broken"]
    line = "ours 50.0 us, good 20.0 us (0.400x), slow 25.0 us (0.500x), torch 10.0 us (0.200x)"
    md = (tmp_path / "rep" / "fake.md").read_text()
    assert line in md and line in capsys.readouterr().out
    assert "host: slow: device-bound loop (5.0 us per call issued, 25.0 us to the sync)" in md


def test_host_time_with_the_real_loop(tmp_path, sources, fake_suite, fake_timer, monkeypatch):
    """The real host loop on the CPU fakes: figures from time.perf_counter, every round."""
    from forgekernel.runtime import timing

    monkeypatch.setattr(harness, "host_us_per_call", timing.host_us_per_call)
    _bench(fake_suite(sources, comparators=_comparators), tmp_path, host_calls=5)
    host = _ledger(tmp_path)["host"]
    assert host["status"] == "ok" and set(host["us_per_call"]) == {"ours", "good", "slow"}
    assert all(len(r) == harness.HOST_ROUNDS for r in host["rounds_us"].values())
    assert all(0 < us < 1e5 for us in host["us_per_call"].values())


def test_host_case_of_the_suite_and_wrong_kernel(tmp_path, sources, fake_suite, fake_timer):
    mine = Case("3x16x8", {"m": 3, "n": 16, "k": 8})
    suite = fake_suite(sources, host_case=mine, dtypes=(torch.bfloat16,))
    _bench(suite, tmp_path, methods=("graph",))
    assert _ledger(tmp_path)["host"]["case"] == "3x16x8"

    def wrong(inputs, out):
        return out.copy_(inputs["a"].float() @ inputs["b"].float().T + 1.0)

    _bench(fake_suite(sources, run_ours=wrong), tmp_path)
    host = _ledger(tmp_path)["host"]
    assert host["status"].startswith("wrong") and host["us_per_call"] == {}
    assert sum(c[0] == "host" for c in fake_timer) == 1  # the first run's only


def test_no_host_time_when_asked(tmp_path, sources, fake_suite, fake_timer):
    _bench(fake_suite(sources), tmp_path, host_calls=0)
    assert "host" not in _ledger(tmp_path)
    assert not any(c[0] == "host" for c in fake_timer)


def test_timing_methods_are_checked():
    with pytest.raises(ValueError, match="timing methods"):
        harness.BenchTiming(methods=("graph", "wall"))
    with pytest.raises(ValueError, match="timing methods"):
        harness.BenchTiming(methods=())


def test_wall_seconds_per_phase_are_recorded_and_printed(
    tmp_path, sources, fake_suite, fake_timer, capsys
):
    """Each case records where its wall time went (the reference, verification, the
    comparators' first calls with their JIT / autotuning, each timing method) and prints it on
    its progress line; the host probe its own (a bench cut by its timeout then says why)."""
    suite = fake_suite(sources, comparators=_comparators, dtypes=(torch.bfloat16,))
    records = _bench(suite, tmp_path)
    phases = ["reference", "verify", "first calls", "graph", "eager"]
    for rec in records:
        assert list(rec["seconds"]) == phases and all(s >= 0 for s in rec["seconds"].values())
    assert list(_ledger(tmp_path)["host"]["seconds"]) == ["host probe"]
    out = capsys.readouterr().out
    progress = [ln for ln in out.splitlines() if ln.startswith("[1/")][0]
    assert " s: reference " in progress and ", first calls " in progress
    assert "(" in [ln for ln in out.splitlines() if " host: " in ln][0]
    assert harness._wall({"a": 1.0, "b": 2.5}) == "(3.5 s: a 1.0, b 2.5)"
    assert harness._wall({}) == ""


def test_device_copy_once_per_run_for_memory_bound_suites(
    tmp_path, sources, fake_suite, fake_timer, capsys
):
    """The first memory-bound suite of a run times a device copy with both methods (read +
    write bytes); every memory-bound suite's ledger and report carry it and its % of copy, a
    compute-bound suite's neither."""
    mem = [
        fake_suite(sources, name=n, comparators=_comparators, dtypes=(torch.bfloat16,),
                   memory_bound=True)
        for n in ("mem_a", "mem_b")
    ]  # fmt: skip
    suites = [fake_suite(sources, name="compute", dtypes=(torch.bfloat16,)), *mem]
    harness.run_bench(suites, results_dir=tmp_path / "res", report_dir=tmp_path / "rep",
                      arch="sm_90a", device="cpu",
                      timing=harness.BenchTiming(copy_bytes=1000))  # fmt: skip
    copies = [c for c in fake_timer if c[0] == ["copy"]]
    assert [c[2] for c in copies] == ["cuda-graph", "eager-flushed"]  # once per run
    assert copies[0][1] == 2 and copies[1][1] == 1  # 2 x 2000 bytes: 4 x a 1000-byte "L2"
    assert "device_copy" not in _ledger(tmp_path, "compute")
    assert "copy_fraction" not in _ledger(tmp_path, "compute")["methods"]["graph"]
    for name in ("mem_a", "mem_b"):
        bench = _ledger(tmp_path, name)
        copy = bench["device_copy"]
        assert copy["status"] == "ok" and copy["bytes"] == 2000
        assert copy["op"] == harness.COPY_OP == "torch.neg(src, out=dst)"  # an SM kernel
        assert copy["methods"]["graph"]["gbps"] == pytest.approx(2.0)
        assert copy["methods"]["eager"]["gbps"] == pytest.approx(1.0)
        ours = bench["cases"][0]["ours"]["gbps"]  # 1x8x8: 144 bytes in 1 ms
        fraction = bench["methods"]["graph"]["copy_fraction"]
        assert fraction["ours"]["min"] == pytest.approx(ours / 2.0)
        assert fraction["good"]["cases"] == 2 and fraction["absent"]["cases"] == 0
        assert "% of copy" in (tmp_path / "rep" / f"{name}.md").read_text()
        assert (
            "GB/s (torch.neg(src, out=dst) of 1000 bytes"
            in (tmp_path / "rep" / f"{name}.md").read_text()
        )
    assert "% of copy" not in (tmp_path / "rep" / "compute.md").read_text()
    out = capsys.readouterr().out
    assert out.count("device copy (1000 bytes, read + write): graph 2 GB/s, eager 1 GB/s") == 1


def test_a_failed_device_copy_is_recorded(tmp_path, sources, fake_suite, fake_timer, monkeypatch):
    def no_memory(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(harness.torch, "rand", no_memory)
    suite = fake_suite(sources, dtypes=(torch.bfloat16,), memory_bound=True)
    records = _bench(suite, tmp_path, copy_bytes=4000)
    assert [r["status"] for r in records] == ["ok", "ok"]
    copy = _ledger(tmp_path)["device_copy"]
    assert copy["status"] == "error: RuntimeError: CUDA out of memory"
    assert "copy_fraction" not in _ledger(tmp_path)["methods"]["graph"]
    assert "device copy (graph): error" in (tmp_path / "rep" / "fake.md").read_text()


def test_what_a_comparator_ran_is_recorded(tmp_path, sources, fake_suite, fake_timer, capsys):
    """A comparator's `ran(inputs)` (its engine choice) lands in its entry of each method's
    record and in the report's summary; a failing account is recorded as unknown."""

    def good(inputs):
        return inputs["a"] @ inputs["b"].T

    def slow(inputs):
        return good(inputs)

    good.ran = lambda inputs: f"engine_x at {inputs['a'].shape[0]} rows"
    slow.ran = lambda inputs: 1 / 0
    suite = fake_suite(sources, comparators=lambda: {"good": good, "slow": slow},
                       dtypes=(torch.bfloat16,))  # fmt: skip
    records = harness.run_bench([suite], results_dir=tmp_path / "res",
                                report_dir=tmp_path / "rep", arch="sm_90a",
                                device="cpu")  # fmt: skip
    rows = records[0]["ours"] and records[0]["comparators"]
    assert rows["good"]["ran"].startswith("engine_x at ")
    assert rows["good"]["ratio"] == pytest.approx(2.0)
    assert rows["slow"]["ran"].startswith("unknown (ZeroDivisionError")
    assert records[0]["eager"]["comparators"]["good"]["ran"] == rows["good"]["ran"]
    out = capsys.readouterr().out
    assert f"good: ran {rows['good']['ran']} (" in out


def test_variant_cases_time_only_the_candidates_and_leave_the_ledger(
    tmp_path, sources, fake_suite, fake_timer
):
    """`bench --variant-cases`: the cases with variants of ours alone (ours, the verified
    variants and the comparators, as in a full run), no ledger section (a partial suite),
    no host record, the reports under <op>-variants."""
    suite = fake_suite(
        sources, comparators=_comparators, variants=_variants, dtypes=(torch.bfloat16,)
    )
    records = harness.run_bench(
        [suite], results_dir=tmp_path / "res", report_dir=tmp_path / "rep", arch="sm_90a",
        device="cpu", variant_cases=True,
    )  # fmt: skip
    assert [r["case"] for r in records] == ["7x24x40"]
    assert records[0]["variants"]["det"]["time_ratio"] == pytest.approx(1.5)
    assert records[0]["comparators"]["good"]["ratio"] == pytest.approx(2.0)
    assert not (tmp_path / "res").exists()
    assert [c for c in fake_timer if c[0] == "host"] == []
    assert (tmp_path / "rep" / "fake-variants.md").exists()
    assert not (tmp_path / "rep" / "fake.md").exists()


def test_variant_cases_skip_a_suite_without_candidates(tmp_path, sources, fake_suite, fake_timer):
    records = harness.run_bench(
        [fake_suite(sources)], results_dir=tmp_path / "res", report_dir=tmp_path / "rep",
        arch="sm_90a", device="cpu", variant_cases=True,
    )  # fmt: skip
    assert records == [] and not (tmp_path / "rep").exists()


def test_named_variants_time_only_those(tmp_path, sources, fake_suite, fake_timer):
    """`bench --variants det`: the cases carrying `det`, and `det` alone of ours' variants."""
    suite = fake_suite(
        sources, comparators=_comparators, variants=_variants, dtypes=(torch.bfloat16,)
    )
    records = harness.run_bench(
        [suite], results_dir=tmp_path / "res", report_dir=tmp_path / "rep", arch="sm_90a",
        device="cpu", variant_cases=True, variant_names=("det",),
    )  # fmt: skip
    assert [r["case"] for r in records] == ["7x24x40"]
    assert set(records[0]["variants"]) == {"det"}  # `bad` neither verified nor timed
    none = harness.run_bench(
        [suite], results_dir=tmp_path / "res", report_dir=tmp_path / "rep2", arch="sm_90a",
        device="cpu", variant_cases=True, variant_names=("absent",),
    )  # fmt: skip
    assert none == []


class Killed(BaseException):
    """What a time limit's SIGKILL is to the run: nothing after it (not an Exception:
    bench_case's guard does not catch it)."""


def _cut_at(monkeypatch, tmp_path, stop: str | None):
    """bench_case wrapped: the cases it was called on, the partial section read back before
    each, and a kill at the case named `stop`."""
    real, seen = getattr(harness.bench_case, "real", harness.bench_case), []

    def wrapped(suite, case, dtype, **kw):
        path = tmp_path / "res" / "sm_90a" / f"{suite.name}.json"
        part = (json.loads(path.read_text()) if path.exists() else {}).get("bench_partial")
        seen.append((case.name, [r["case"] for r in (part or {}).get("cases", [])]))
        if case.name == stop:
            raise Killed
        return real(suite, case, dtype, **kw)

    wrapped.real = real
    monkeypatch.setattr(harness, "bench_case", wrapped)
    return seen


def _doc(tmp_path, name="fake"):
    return json.loads((tmp_path / "res" / "sm_90a" / f"{name}.json").read_text())


def test_a_killed_bench_leaves_its_cases_and_resume_completes_the_suite(
    tmp_path, sources, fake_suite, fake_timer, monkeypatch, capsys
):
    """After each case the cases so far are the ledger's partial bench section; a kill leaves
    it (and no bench section, no host time); `resume` times only the other cases and writes the
    suite's section from all of them in the suite's order, the earlier call's records as they
    were, the host time once, and drops the partial."""
    suite = fake_suite(
        sources, comparators=_comparators, bench_cases=GROUPED, dtypes=(torch.bfloat16,)
    )
    seen = _cut_at(monkeypatch, tmp_path, stop="7x24x40")
    with pytest.raises(Killed):
        _bench(suite, tmp_path, reps=7)
    assert seen == [("1x8x8", []), ("4x8x8", ["1x8x8"]), ("7x24x40", ["1x8x8", "4x8x8"])]
    doc = _doc(tmp_path)
    assert "bench" not in doc and not any(c[0] == "host" for c in fake_timer)
    part = doc["bench_partial"]
    assert [r["case"] for r in part["cases"]] == ["1x8x8", "4x8x8"]
    assert part["source_hash"] == doc["source_hash"] and part["gpu"] == doc["gpu"]
    assert part["options"] == {"timing": ["graph", "eager"], "warmup": 5, "reps": 7,
                               "eager_reps": 100, "seed": 0}  # fmt: skip
    assert part["comparator_versions"] == harness.ledger.comparator_versions()

    seen = _cut_at(monkeypatch, tmp_path, stop=None)
    records = harness.run_bench([suite], results_dir=tmp_path / "res", report_dir=tmp_path / "rep",
                                arch="sm_90a", device="cpu", resume=True,
                                timing=harness.BenchTiming(reps=7))  # fmt: skip
    assert [c for c, _ in seen] == ["7x24x40", "9x8x16"]
    assert seen[1][1] == ["1x8x8", "4x8x8", "7x24x40"]
    assert "resumed 2 of 4 cases" in capsys.readouterr().out
    doc = _doc(tmp_path)
    assert "bench_partial" not in doc
    bench = doc["bench"]
    assert [r["case"] for r in bench["cases"]] == [c.name for c in GROUPED]
    assert [r["case"] for r in records] == [c.name for c in GROUPED]
    assert bench["cases"][:2] == part["cases"]  # kept as they were
    assert [r["seed"] for r in bench["cases"]] == [0, 1, 2, 3]
    assert bench["median_ratio"]["good"] == pytest.approx(2.0)
    assert sum(c[0] == "host" for c in fake_timer) == 1 and bench["host"]["status"] == "ok"
    assert "| 9x8x16 |" in (tmp_path / "rep" / "fake.md").read_text()


@pytest.mark.parametrize("change", ["source", "gpu", "reps", "seed"])
def test_resume_ignores_a_partial_of_other_sources_gpu_or_options(
    tmp_path, sources, fake_suite, fake_timer, monkeypatch, capsys, change
):
    suite = fake_suite(sources, bench_cases=GROUPED, dtypes=(torch.bfloat16,))
    _cut_at(monkeypatch, tmp_path, stop="9x8x16")
    with pytest.raises(Killed):
        _bench(suite, tmp_path)
    assert len(_doc(tmp_path)["bench_partial"]["cases"]) == 3
    kw = {"reps": 3} if change == "reps" else {}
    if change == "source":
        sources[0].write_text("KERNEL = 2\n")
    if change == "gpu":
        env = harness.ledger.environment()
        monkeypatch.setattr(harness.ledger, "environment", lambda: {**env, "gpu": "NVIDIA H100"})
    seen = _cut_at(monkeypatch, tmp_path, stop=None)
    harness.run_bench([suite], results_dir=tmp_path / "res", report_dir=tmp_path / "rep",
                      arch="sm_90a", device="cpu", resume=True, seed=5 if change == "seed" else 0,
                      timing=harness.BenchTiming(**kw))  # fmt: skip
    assert [c for c, _ in seen] == [c.name for c in GROUPED]  # from the first case
    key = {"source": "source_hash", "gpu": "gpu"}.get(change, "options")
    assert f"no partial bench resumed (its {key} " in capsys.readouterr().err
    doc = _doc(tmp_path)
    assert "bench_partial" not in doc and len(doc["bench"]["cases"]) == 4


def test_without_resume_a_bench_starts_over(tmp_path, sources, fake_suite, fake_timer, monkeypatch):
    suite = fake_suite(sources, bench_cases=GROUPED, dtypes=(torch.bfloat16,))
    _cut_at(monkeypatch, tmp_path, stop="4x8x8")
    with pytest.raises(Killed):
        _bench(suite, tmp_path)
    seen = _cut_at(monkeypatch, tmp_path, stop=None)
    _bench(suite, tmp_path)
    assert [c for c, _ in seen] == [c.name for c in GROUPED]
    assert "bench_partial" not in _doc(tmp_path)
