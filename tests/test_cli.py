from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from forgekernel import cli


@pytest.fixture
def no_gpu(monkeypatch):
    monkeypatch.setattr(cli, "_cuda_available", lambda: False)


def test_check_without_gpu_exits_2(no_gpu, capsys):
    assert cli.main(["check"]) == 2
    assert cli.NO_GPU_CHECK in capsys.readouterr().err
    assert cli.main(["selftest"]) == 2
    assert "selftest needs a GPU" in capsys.readouterr().err


def test_python_m_forgekernel_without_gpu():
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""}
    root = Path(__file__).resolve().parents[1]
    p = subprocess.run(
        [sys.executable, "-m", "forgekernel", "check", "gemm"],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert "no CUDA device: check needs a GPU" in p.stderr


RECORD = {
    "name": "gemm_dense_sm90",
    "config": "tile_m=128",
    "registers": 168,
    "smem_bytes": 227000,
    "spill_bytes": 0,
    "hgmma": True,
    "compile_s": 3.21,
    "path": "/tmp/k.so",
}


def test_bench_without_gpu_builds(no_gpu, monkeypatch, capsys):
    import forgekernel.runtime.build as build

    seen = {}

    def fake_build_all(arch, out_dir=None, candidates=False, only=None, **kw):
        seen.update(arch=arch, out_dir=out_dir)
        return [RECORD]

    monkeypatch.setattr(build, "build_all", fake_build_all)
    monkeypatch.delenv("CUTE_DSL_ARCH", raising=False)
    assert cli.main(["bench", "gemm"]) == 2
    out, err = capsys.readouterr()
    assert "no CUDA device" in err
    assert seen == {"arch": "sm_90a", "out_dir": None}
    header, _, row = out.splitlines()[:3]
    assert header.split()[:4] == ["name", "config", "regs", "smem"]
    assert row.split() == [
        "gemm_dense_sm90",
        "tile_m=128",
        "168",
        "227000",
        "0",
        "True",
        "3.2",
        "/tmp/k.so",
    ]


def test_build_without_dsl(monkeypatch, capsys):
    import forgekernel.runtime.build as build

    def no_dsl(arch, out_dir=None, candidates=False, only=None, **kw):
        raise ImportError("No module named 'cutlass'")

    monkeypatch.setattr(build, "build_all", no_dsl)
    assert cli.main(["build", "--arch", "sm_90a", "--out", "x"]) == 1
    assert cli.NEED_DSL in capsys.readouterr().err


def test_build_jobs_and_wall_time(monkeypatch, capsys):
    import forgekernel.runtime.build as build

    seen = {}

    def fake_build_all(arch, out_dir=None, candidates=False, only=None, **kw):
        seen.update(kw, only=only)
        return [RECORD, RECORD]

    monkeypatch.setattr(build, "build_all", fake_build_all)
    argv = ["build", "--arch", "sm_90a", "--only", "gemm_dense_sm90", "-j", "3"]
    assert cli.main([*argv, "--representatives"]) == 0
    assert seen == {"jobs": 3, "representatives": True, "only": ["gemm_dense_sm90"], "keys": None}
    last = capsys.readouterr().out.splitlines()[-1]
    assert last.startswith("built 2 kernels in ") and last.endswith(" s with 2 processes")
    assert cli.main(["build", "--arch", "sm_90a"]) == 0
    assert seen["jobs"] == os.cpu_count() and seen["representatives"] is False


def test_bad_arch_is_one_line(capsys):
    assert cli.main(["build", "--arch", "sm_80"]) == 2
    assert "not supported" in capsys.readouterr().err


def test_parsing():
    p = cli.build_parser()
    a = p.parse_args(["bench", "gemm", "attention", "--report-dir", "r", "--results-dir", "d"])
    assert a.ops == ["gemm", "attention"] and a.report_dir == Path("r")
    assert a.results_dir == Path("d") and a.fn is cli.cmd_bench and a.reps == 30
    a = p.parse_args(["check", "--seed", "7", "--arch", "sm_90a"])
    assert a.ops == [] and a.seed == 7 and a.arch == "sm_90a"
    assert p.parse_args(["bundle", "out"]).dir == Path("out")
    assert p.parse_args(["build"]).out is None
    assert p.parse_args(["build"]).jobs is None
    assert p.parse_args(["bundle", "o", "-j", "2"]).jobs == 2
    with pytest.raises(SystemExit):
        p.parse_args([])


def test_bench_timing_options(monkeypatch, tmp_path):
    import forgekernel.bench.harness as harness

    p = cli.build_parser()
    a = p.parse_args(["bench"])
    assert a.timing == ("graph", "eager") and a.eager_reps == 100 and a.host_calls == 200
    assert p.parse_args(["bench", "--timing", "eager"]).timing == ("eager",)
    assert p.parse_args(["bench", "--timing", "eager, graph,eager"]).timing == ("eager", "graph")
    for bad in ("wall", "", "graph,wall"):
        with pytest.raises(SystemExit):
            p.parse_args(["bench", "--timing", bad])
    assert cli.TIMING_METHODS == harness.TIMING_METHODS
    seen = {}
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    monkeypatch.setattr(harness, "run_bench", lambda suites, **kw: seen.update(kw))
    argv = ["bench", "gemm", "--arch", "sm_90a", "--report-dir", str(tmp_path)]
    argv += ["--timing", "eager", "--eager-reps", "40", "--host-calls", "0", "--reps", "9"]
    assert cli.main(argv) == 0
    assert seen["timing"] == harness.BenchTiming(
        methods=("eager",), warmup=5, reps=9, eager_reps=40, host_calls=0
    )
    assert seen["report_dir"] == tmp_path and seen["arch"] == "sm_90a"
    assert not seen["variant_cases"] and seen["variant_names"] == () and not seen["resume"]
    assert cli.main(["bench", "--resume", "kda_bwd", "--arch", "sm_90a"]) == 0
    assert seen["resume"]
    assert cli.main(["bench", "gemm_fp8", "--arch", "sm_90a", "--variants", "k256,narrow"]) == 0
    assert seen["variant_cases"] and seen["variant_names"] == ("k256", "narrow")
    assert cli.main(["bench", "gemm_fp8", "--arch", "sm_90a", "--variant-cases"]) == 0
    assert seen["variant_cases"] and seen["variant_names"] == ()


def test_unknown_op(monkeypatch, capsys):
    monkeypatch.setattr(cli, "_cuda_available", lambda: True)
    assert cli.main(["check", "nope", "--arch", "sm_90a"]) == 2
    assert "unknown operator 'nope'" in capsys.readouterr().err


def test_readme(tmp_path, capsys):
    readme = tmp_path / "README.md"
    readme.write_text("<!-- results:begin -->\n<!-- results:end -->\n")
    assert cli.main(["readme", "--readme", str(readme), "--results-dir", str(tmp_path)]) == 0
    assert "No GPU results" in readme.read_text()
    (tmp_path / "NOBLOCK.md").write_text("nothing")
    assert cli.main(["readme", "--readme", str(tmp_path / "NOBLOCK.md")]) == 1


def test_build_package_targets_the_package_prebuilt_dir(monkeypatch):
    import forgekernel.runtime.build as build
    from forgekernel.runtime.cache import package_prebuilt_dir, search_dirs

    seen = {}

    def fake_build_all(arch, out_dir=None, candidates=False, only=None, **kw):
        seen["out"] = out_dir
        return []

    monkeypatch.setattr(build, "build_all", fake_build_all)
    assert cli.main(["build", "--arch", "sm_90a", "--package"]) == 0
    assert seen["out"] == package_prebuilt_dir("sm_90a")
    # the package's kernels come after an explicit bundle and before the user cache
    monkeypatch.setenv("FORGEKERNEL_KERNEL_DIR", "/bundle/kernels")
    dirs = search_dirs("sm_90a")
    assert dirs[0] == Path("/bundle/kernels") and dirs[1] == package_prebuilt_dir("sm_90a")
