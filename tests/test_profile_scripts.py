"""The ncu gap targets on the CPU (scripts/profile_gemm_fp8.py, profile_mla.py, profile_gemm.py,
profile_conv.py, their shared scripts/profile_suite.py, scripts/ncu_gap_summary.py and the shell
wrappers): the argument parsing, the cases (the suites' own, by name), the order of warm-ups,
markers and profiled calls (torch.cuda faked), the summary's attribution of kernels to (case,
side) on a synthetic ncu raw page, and the shell scripts' syntax and dry run. The GPU part runs
in the device call (scripts/device_profile_gaps.sh)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"


def _load(name: str):
    return load_script(name)


fp8 = _load("profile_gemm_fp8")
dense = _load("profile_gemm")
conv = _load("profile_conv")
mla = _load("profile_mla")
summary = _load("ncu_gap_summary")
ps = fp8.profile_suite
TARGETS = (fp8, mla, dense, conv)


def _cases(module, *argv):
    target = module.TARGET
    return ps.resolve_cases(target, ps.parse_args(target, list(argv)))


@pytest.mark.parametrize("module", TARGETS, ids=lambda m: m.TARGET.name)
def test_help_exits_cleanly(module, capsys):
    with pytest.raises(SystemExit) as e:
        ps.main(module.TARGET, ["--help"])
    assert e.value.code == 0
    assert "--which" in capsys.readouterr().out


@pytest.mark.parametrize("module", TARGETS, ids=lambda m: m.TARGET.name)
def test_defaults_are_the_suites_bench_cases(module):
    args = ps.parse_args(module.TARGET, [])
    assert (args.which, args.warmup, args.calls) == ("both", 2, 1)
    for suite_name, case in ps.resolve_cases(module.TARGET, args):
        suite = ps.load_suite(suite_name)
        assert case in suite.bench_cases and suite.dtypes_for_bench()[0] == torch.bfloat16
        assert module.TARGET.comparator[suite_name] in suite.comparators()


def test_gemm_fp8_cases_and_chooser():
    from forgekernel.kernels.gemm.fp8.sm90.config import LARGE, LARGE_MCAST_A

    got = {c.name: (c.params, fp8.describe("gemm_fp8", c)) for _, c in _cases(fp8)}
    assert list(got) == ["16384x7168x18432", "4096x7168x2048"]
    assert got["16384x7168x18432"][1] == LARGE_MCAST_A.tag()  # M >= 8192
    assert got["4096x7168x2048"][1] == LARGE.tag()
    assert ps.parse_args(fp8.TARGET, []).comparator is None
    assert fp8.TARGET.comparator == {"gemm_fp8": "deepgemm"}


def test_mla_cases_are_the_largest_flashmla_gaps():
    assert [c.name for _, c in _cases(mla)] == [
        "b1-h16-p64-L65536", "b48-h16-p64-mixed", "b16-h128-p64-L4096"]  # fmt: skip
    assert mla.TARGET.comparator == {"mla_decode": "flashmla"}


def test_gemm_cases_keep_the_suites_layout():
    cases = _cases(dense)
    assert [c.name for _, c in cases] == ["129x10240x8192", "4096x576x7168", "512x10240x5120"]
    assert {c.params["b_layout"] for _, c in cases} == {"nk"}
    assert "rivals" in dense.describe("gemm", cases[0][1])  # M > 128: the rivals weighed


def test_conv_suite_filter_and_explicit_cases():
    wgrad = _cases(conv, "--suite", "conv_wgrad")
    assert {s for s, _ in wgrad} == {"conv_wgrad"} and len(wgrad) == 3
    assert {c.params["op"] for _, c in wgrad} == {"wgrad"}
    fwd = _cases(conv, "--suite", "conv_fwd")
    assert {c.params["op"] for _, c in fwd} == {"fwd"} and len(fwd) == 3
    assert [c.name for _, c in fwd][0] == conv.STEM
    one = _cases(conv, "--case", "conv_fwd:n32-c64-56x56-k64-3x3")
    assert [(s, c.name) for s, c in one] == [("conv_fwd", "n32-c64-56x56-k64-3x3")]


def test_unknown_and_ambiguous_cases_are_refused():
    with pytest.raises(SystemExit, match="bench cases"):
        _cases(dense, "--case", "7x7x7")
    with pytest.raises(SystemExit, match="SUITE:CASE"):
        _cases(conv, "--case", conv.STEM)  # two suites: the suite must be named
    with pytest.raises(SystemExit):
        ps.parse_args(dense.TARGET, ["--which", "theirs"])
    with pytest.raises(SystemExit):
        ps.parse_args(dense.TARGET, ["--calls", "0"])


def test_list_prints_cases_without_a_gpu(capsys):
    assert ps.main(fp8.TARGET, ["--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[0] for ln in lines] == [
        "gemm_fp8:16384x7168x18432",
        "gemm_fp8:4096x7168x2048",
    ]


def test_segments_follow_the_launch_order():
    target = conv.TARGET
    args = ps.parse_args(target, ["--suite", "conv_fwd", "--comparator", "cudnn", "--calls", "2"])
    segs = ps.segments(target, ps.resolve_cases(target, args), args)
    assert [(s["case"], s["side"]) for s in segs[:2]] == [(conv.STEM, "ours"),
                                                           (conv.STEM, "comparator")]  # fmt: skip
    assert len(segs) == 6 and {s["calls"] for s in segs} == {2}
    assert [s["impl"] for s in segs[:2]] == ["ours", "cudnn"]
    only = ps.parse_args(target, ["--suite", "conv_fwd", "--which", "comparator"])
    assert {s["side"] for s in ps.segments(target, ps.resolve_cases(target, only), only)} == {
        "comparator"
    }


def test_warmups_stay_outside_the_profiled_range(monkeypatch, tmp_path):
    """Fake torch.cuda: every event in order; the plan file written at the end."""
    events: list[str] = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: events.append("sync"))
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(torch.cuda.profiler, "start", lambda: events.append("start"))
    monkeypatch.setattr(torch.cuda.profiler, "stop", lambda: events.append("stop"))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda c: events.append("marker"), raising=False)
    monkeypatch.setattr(torch.cuda.nvtx, "range_push", lambda n: events.append(f"push {n}"))
    monkeypatch.setattr(torch.cuda.nvtx, "range_pop", lambda: events.append("pop"))

    def fake_calls(target, args, index, suite_name, case):
        return {s: (lambda s=s: events.append(f"{case.name[:3]} {s}")) for s in ps.SIDES}

    monkeypatch.setattr(ps, "_calls", fake_calls)
    plan = tmp_path / "plan.json"
    argv = ["--warmup", "1", "--calls", "2", "--plan", str(plan), "--case", "4096x576x7168"]
    assert ps.main(dense.TARGET, argv) == 0
    assert events == [
        "409 ours", "409 comparator", "sync", "start",
        "marker", "push 4096x576x7168/ours", "409 ours", "409 ours", "pop",
        "marker", "push 4096x576x7168/comparator", "409 comparator", "409 comparator", "pop",
        "sync", "stop",
    ]  # fmt: skip
    doc = json.loads(plan.read_text())
    assert doc["marker"] == ps.MARKER and doc["target"] == "gemm"
    assert [s["side"] for s in doc["segments"]] == ["ours", "comparator"]


# ------------------------------------------------------------------- the summary, on a fake page
COLUMNS = [
    "ID", "Process ID", "Kernel Name", "Block Size", "Grid Size", "gpu__time_duration.sum",
    "sm__throughput.avg.pct_of_peak_sustained_elapsed", "dram__bytes_read.sum",
    "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
    "smsp__average_warps_issue_stalled_long_scoreboard_per_issue_active.ratio",
    "smsp__average_warps_issue_stalled_barrier_per_issue_active.ratio",
]  # fmt: skip
UNITS = ["", "", "", "", "", "nsecond", "%", "byte", "%", "inst", "inst"]
OURS = "kernel_cutlass_kernel_forgekernelkernelsgemmdensesm90kernelGemmSm90_object_at__x"


def _raw(path: Path, kernels: list[tuple[str, float]], duration_unit: str = "nsecond") -> Path:
    import csv

    with path.open("w", newline="") as f:
        w = csv.writer(f, quoting=csv.QUOTE_ALL)
        w.writerow(COLUMNS)
        w.writerow([duration_unit if u == "nsecond" else u for u in UNITS])
        for i, (name, ns) in enumerate(kernels):
            w.writerow([i, 7, name, "(384, 1, 1)", "(132, 1, 1)", ns, 61.5, 3.2e9, 70.25,
                        1.5 + i, 0.25])  # fmt: skip
    return path


def _plan(markers: bool = True) -> dict:
    segs = [
        {"suite": "gemm", "case": c, "side": s, "impl": "ours" if s == "ours" else "cublas",
         "calls": 1}
        for c in ("129x10240x8192", "4096x576x7168") for s in ps.SIDES
    ]  # fmt: skip
    return {"target": "gemm", "marker": ps.MARKER if markers else None, "segments": segs}


SEQUENCE = [
    ("spin_kernel", 3000.0), (OURS, 75000.0),
    ("spin_kernel", 3000.0), ("nvjet_hsh_256x128_2x1_v_bz", 50000.0), ("splitKreduce", 1000.0),
    ("spin_kernel", 3000.0), (OURS, 70000.0),
    ("spin_kernel", 3000.0), ("nvjet_hsh_128x192", 52000.0),
]  # fmt: skip


def test_summary_splits_kernels_at_the_markers(tmp_path):
    _, _, rows = summary.read_raw(_raw(tmp_path / "raw.csv", SEQUENCE))
    groups = summary.segment_rows(rows, _plan())
    got = [(s["case"], s["side"], [k["Kernel Name"][:5] for k in ks]) for s, ks in groups]
    assert got == [
        ("129x10240x8192", "ours", ["kerne"]),
        ("129x10240x8192", "comparator", ["nvjet", "split"]),
        ("4096x576x7168", "ours", ["kerne"]),
        ("4096x576x7168", "comparator", ["nvjet"]),
    ]


def test_summary_table_ratio_and_metrics(tmp_path):
    text = summary.summarize(_raw(tmp_path / "raw.csv", SEQUENCE), None, _plan(), "gemm")
    first = text.split("--- gemm:129x10240x8192 ---")[1].split("--- gemm:4096")[0]
    assert "per call: ours 75.0 us, comparator 51.0 us: comparator / ours 0.680x" in first
    assert "fk:gemmdensesm90kernelGemmSm90" in first and "spin_kernel" not in first
    assert "75.0 us" in first and "3.20 GB" in first and "70.25" in first
    lines = first.splitlines()
    stalls = [ln.split()[1] for ln in lines if ln.strip().startswith("stall")]
    assert stalls[0] == "long_scoreboard"  # the larger stall first


def test_summary_per_call_in_microseconds_from_ns(tmp_path):
    """Later ncu versions name the base unit "ns": a 4.10 ms kernel read as 4,098,912 s once
    printed "per call: ours 4098912000000.0 us" (and "4.10M" in the table)."""
    sequence = [("spin_kernel", 3000.0), (OURS, 4098912.0),
                ("spin_kernel", 3000.0), ("nvjet_hsh_256x128_2x1_v_bz", 3085696.0)]  # fmt: skip
    plan = _plan()
    plan["segments"] = plan["segments"][:2]
    for unit, scale in (("ns", 1.0), ("nsecond", 1.0), ("us", 1e-3), ("ms", 1e-6)):
        raw = _raw(tmp_path / f"{unit}.csv", [(n, t * scale) for n, t in sequence], unit)
        text = summary.summarize(raw, None, plan, "gemm")
        assert "per call: ours 4098.9 us, comparator 3085.7 us: comparator / ours 0.753x" in text
        duration = next(ln for ln in text.splitlines() if ln.strip().startswith("duration"))
        assert duration.split()[1:] == ["4098.9", "us", "3085.7", "us"]


def test_summary_of_a_duration_unit_not_understood_gives_no_figure(tmp_path):
    raw = _raw(tmp_path / "raw.csv", SEQUENCE, "fortnight")
    text = summary.summarize(raw, None, _plan(), "gemm")
    assert "the duration's unit 'fortnight' not understood" in text and " us, comp" not in text


def test_summary_without_markers_tells_ours_by_name(tmp_path):
    raw = _raw(tmp_path / "raw.csv", [k for k in SEQUENCE if k[0] != "spin_kernel"])
    groups = summary.segment_rows(summary.read_raw(raw)[2], _plan(markers=False))
    assert [(s["side"], len(ks)) for s, ks in groups] == [("ours", 2), ("comparator", 3)]


def test_summary_without_a_plan_still_drops_the_markers(tmp_path):
    raw = _raw(tmp_path / "raw.csv", SEQUENCE)
    groups = summary.segment_rows(summary.read_raw(raw)[2], {"segments": []})
    names = [k["Kernel Name"] for _, ks in groups for k in ks]
    assert len(names) == 5 and ps.MARKER not in "".join(names)


def test_tensor_rows_skip_other_pipes_and_idle_ones():
    cols = [
        "sm__pipe_tensor_cycles_active.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_gmma.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_dmma.avg.pct_of_peak_sustained_active",
        "sm__inst_executed_pipe_tensor_op_gmma.max.pct_of_peak_sustained_active",
    ]
    kernels = [{cols[0]: "81.5", cols[1]: "9.1", cols[2]: "0", cols[3]: "3", cols[4]: "12"}]
    shown = [col for _, col in summary.metric_rows(cols, kernels)]
    assert shown == cols[:2]


def test_units_in_base_and_auto_forms():
    assert summary.fmt("75000", "nsecond") == summary.fmt("75", "usecond") == "75.0 us"
    assert summary.fmt("75000", "ns") == summary.fmt("75", "us") == "75.0 us"
    assert summary.fmt("4.1", "ms") == summary.fmt("0.0041", "s") == "4100.0 us"
    assert summary.fmt("1980000000", "hz") == summary.fmt("1.98", "cycle/ns") == "1.98 GHz"
    assert summary.fmt("3.2", "Gbyte") == summary.fmt("3200000000", "byte") == "3.20 GB"
    assert summary.fmt("1.98", "cycle/nsecond") == summary.fmt("1.98", "Ghz") == "1.98 GHz"
    assert summary.fmt("1,024", "") == "1024" and summary.fmt("(132, 1, 1)", "") == "(132, 1, 1)"


def test_summary_of_a_missing_page_says_so(tmp_path):
    text = summary.summarize(tmp_path / "none.csv", None, _plan(), "gemm")
    assert "no raw page" in text


DETAILS = """[4242] python3@127.0.0.1
  spin_kernel(long) (1, 1, 1)x(1, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    Duration                         nsecond        3,000
  {ours}(int) (132, 1, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Section: GPU Speed Of Light Throughput
    DRAM Frequency                       hz    3.2e+09
    Elapsed Cycles                    cycle    131,000
    Duration                        nsecond     75,000
    OPT   Est. Speedup: 20%
          The kernel is limited by long scoreboard stalls
          on shared memory.
    Section: Warp State Statistics
    Stall Long Scoreboard              inst       1.50
  nvjet_hsh_256x128_2x1_v_bz (66, 2, 1)x(384, 1, 1), Context 1, Stream 7, Device 0, CC 9.0
    Duration                        nsecond     50,000
"""


def test_details_are_filtered_and_labelled(tmp_path):
    raw = _raw(tmp_path / "raw.csv", SEQUENCE[:5])
    page = tmp_path / "details.txt"
    page.write_text(DETAILS.format(ours=OURS))
    blocks = summary.detail_blocks(page.read_text())
    assert [name[:5] for name, _ in blocks] == ["spin_", "kerne", "nvjet"]
    kept = "\n".join(blocks[1][1])
    assert "Duration" in kept and "Elapsed Cycles" not in kept
    assert "long scoreboard stalls" in kept and "Stall Long Scoreboard" in kept
    text = summary.summarize(raw, page, _plan(), "gemm")
    details = text.split("details page, filtered")[1]
    assert "129x10240x8192 ours: fk:" in details
    assert "129x10240x8192 comparator: nvjet" in details and "spin_kernel" not in details


# ------------------------------------------------------------------------------- shell scripts
SHELL = ("device_profile.sh", "device_profile_gaps.sh")


@pytest.mark.parametrize("name", SHELL)
def test_shell_syntax(name):
    subprocess.run(["bash", "-n", str(SCRIPTS / name)], check=True)
    checker = shutil.which("shellcheck")
    if checker:
        subprocess.run([checker, str(SCRIPTS / name)], check=True)


def test_gaps_dry_run_prints_the_ncu_commands(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GAPS_WORK": str(tmp_path / "work"),
           "KERNELS": "/root/fk-kernels", "PYTHONPATH": str(ROOT)}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"  # this python3
    run = subprocess.run(
        ["bash", "scripts/device_profile_gaps.sh", "--dry-run", "gemm", "conv_fwd"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    out = run.stdout
    ncu = [ln for ln in out.splitlines() if " ncu " in ln or ln.startswith("timeout")]
    assert len(ncu) == 2
    assert all("--profile-from-start off" in ln and "-k regex:. " in ln for ln in ncu)
    assert "scripts/profile_conv.py --suite conv_fwd --plan" in ncu[1]
    assert "gemm:129x10240x8192" in out and f"conv_fwd:{conv.STEM}" in out
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def test_device_profile_stops_without_the_dsl(tmp_path):
    """No install of its own: without `import cutlass` it names device_setup.sh and stops."""
    fake = tmp_path / "python3"
    fake.write_text("#!/bin/sh\nexit 1\n")
    fake.chmod(0o755)
    env = {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PATH": f"{tmp_path}{os.pathsep}/usr/bin:/bin",
    }
    run = subprocess.run(["bash", "scripts/device_profile.sh"], cwd=ROOT, env=env,
                         capture_output=True, text=True)  # fmt: skip
    assert run.returncode == 1 and "source scripts/device_setup.sh" in run.stderr


linattn = _load("profile_linattn_bwd")


def test_linattn_target_cases_and_timeline_flag():
    """The linear-attention backwards' target: its default cases are the suites' bench cases,
    its comparators theirs; --timeline and --top parse."""
    target = linattn.TARGET
    args = ps.parse_args(target, ["--timeline", "--top", "5", "--which", "ours"])
    assert args.timeline and args.top == 5
    for suite_name, case in ps.resolve_cases(target, args):
        suite = ps.load_suite(suite_name)
        assert case in suite.bench_cases
        assert target.comparator[suite_name] in suite.comparators()
    assert not ps.parse_args(target, []).timeline


def test_kernel_table_per_call():
    """Two calls' kernel records: totals per call, sorted by time, shares, `top` rows."""
    records = [("k2", 30.0), ("k1", 10.0), ("k2", 30.0), ("k1", 10.0), ("tiny", 1.0)]
    lines = ps.kernel_table(records, calls=2, top=2)
    assert lines[0] == "  kernels 2 a call, 40.5 us a call"
    assert "k2" in lines[1] and "30.0 us" in lines[1] and "1.0x" in lines[1]
    assert "k1" in lines[2] and len(lines) == 3


def test_kda_paths_probe_lists_without_a_gpu(capsys):
    """scripts/probe_kda_bwd_paths.py --list: its paths and the suite's cases, no GPU; the
    switches restored after a path's call; an unknown case named."""
    probe = _load("probe_kda_bwd_paths")
    assert probe.main(["--list"]) == 0
    assert "device_pass (True, True)" in capsys.readouterr().out
    from forgekernel.ops import kda_bwd

    with probe.path_flags(kda_bwd, False, False):
        assert not kda_bwd.FACTORS_FROM_FIRST_PASS and not kda_bwd.WY_IN_KERNEL
    assert kda_bwd.FACTORS_FROM_FIRST_PASS and kda_bwd.WY_IN_KERNEL  # the defaults, restored
    with pytest.raises(SystemExit, match="no kda_bwd bench case"):
        probe.main(["--case", "nope", "--list"])


def test_set_parses_and_applies_a_module_switch(monkeypatch, capsys):
    """--set MODULE.NAME=VALUE: a Python literal onto an existing module constant (the temporary
    A/B switches); a malformed spec or an unknown name is an error, not a silent default run."""
    import forgekernel.ops.kda_bwd as kda

    target = fp8.TARGET
    args = ps.parse_args(target, ["--set", "forgekernel.ops.kda_bwd.FINAL_QK=True"])
    assert args.set == [("forgekernel.ops.kda_bwd", "FINAL_QK", True)]
    monkeypatch.setattr(kda, "FINAL_QK", False)
    ps.apply_settings(args.set)
    assert kda.FINAL_QK is True
    assert "set forgekernel.ops.kda_bwd.FINAL_QK = True" in capsys.readouterr().out
    for bad in ("FINAL_QK=True", "forgekernel.ops.kda_bwd.FINAL_QK", "a.b=not literal"):
        with pytest.raises(SystemExit):
            ps.parse_args(target, ["--set", bad])
    with pytest.raises(SystemExit, match="has no"):
        ps.apply_settings([("forgekernel.ops.kda_bwd", "NO_SUCH_SWITCH", 1)])


def test_sidecar_here_makes_the_runner_in_this_process(monkeypatch, tmp_path):
    """--sidecar-here: a sidecar comparator's runner ("module:factory") made and called in the
    profiled process (run under the sidecar's site: device_profile.sh SITE=); without it the
    sidecar object is handed on (it refuses calls); a factory returning None (its packages
    missing) stops the target with the runner named."""
    from forgekernel.bench import harness, sidecar

    (tmp_path / "fake_runner_mod.py").write_text(
        "def make():\n    return lambda inputs: ('theirs', inputs)\n\n\n"
        "def missing():\n    return None\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    side = sidecar.Sidecar("Fake 1.0", "fake_runner_mod:make", "FK_FAKE_SITE", ("q",))
    gone = sidecar.Sidecar("Gone 1.0", "fake_runner_mod:missing", "FK_FAKE_SITE", ("q",))
    comps = {"fake": side, "gone": gone, "plain": len}
    monkeypatch.setattr(harness, "resolve_comparators", lambda suite: (comps, {}))

    class Suite:
        name = "gdn_bwd"

    assert ps._comparator(Suite, "fake") is side
    assert ps._comparator(Suite, "fake", here=True)({"q": 1}) == ("theirs", {"q": 1})
    assert ps._comparator(Suite, "plain", here=True) is len  # in-process comparators as before
    with pytest.raises(SystemExit, match="fake_runner_mod:missing"):
        ps._comparator(Suite, "gone", here=True)
    args = ps.parse_args(linattn.TARGET, ["--which", "comparator", "--sidecar-here"])
    assert args.sidecar_here and not ps.parse_args(linattn.TARGET, []).sidecar_here


def test_gaps_dry_run_names_the_gdn_bwd_targets(tmp_path):
    """gdn_bwd / gdn_bwd_qla (named only): one 4x8192-h16-hv32 call of ours, of FlashQLA's
    backward in its site (SITE: the sidecar child's PYTHONPATH), SECTIONS' short list; GAPS_ARGS'
    cases after the target's own, in each ncu command and each target's listing (one dry run of
    both targets: a second run of gdn_bwd alone for GAPS_ARGS was ~1.5 s more, 2026-12-07)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "GAPS_WORK": str(tmp_path / "work"),
           "KERNELS": "/root/fk-kernels", "PYTHONPATH": str(ROOT),
           "SECTIONS": "SpeedOfLight WarpStateStats",
           "GAPS_ARGS": "--case gdn_bwd:1x8192-h16-hv32"}  # fmt: skip
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env['PATH']}"
    run = subprocess.run(
        ["bash", "scripts/device_profile_gaps.sh", "--dry-run", "gdn_bwd", "gdn_bwd_qla"],
        cwd=ROOT, env=env, capture_output=True, text=True, check=True,
    )  # fmt: skip
    ncu = [ln for ln in run.stdout.splitlines() if ln.startswith("timeout")]
    assert len(ncu) == 2
    assert all("--section SpeedOfLight --section WarpStateStats -o" in ln for ln in ncu)
    assert all("--case gdn_bwd:4x8192-h16-hv32" in ln for ln in ncu)
    assert all(ln.rstrip().endswith("--case gdn_bwd:1x8192-h16-hv32") for ln in ncu)
    assert "--which ours" in ncu[0] and "--comparator flashqla --sidecar-here" in ncu[1]
    # GAPS_ARGS' cases in the dry run's listing as in its ncu command
    listed = [ln.split()[0] for ln in run.stdout.splitlines() if ln.startswith("gdn_bwd:")]
    assert listed == ["gdn_bwd:4x8192-h16-hv32", "gdn_bwd:1x8192-h16-hv32"] * 2
