"""GPU tests that name their failures even when the run is killed: tests/gpu/conftest.py reports
each failure as it happens (a run killed before pytest's summary still names every failure it
saw, with its reason and the end of its traceback), and scripts/device_jit_run.sh runs them one
file per pytest process, each under its share of GPU_TESTS_TIMEOUT (python3 faked)."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

from jit_run_fake import run_jit_run  # tests/ is on the path

ROOT = Path(__file__).resolve().parents[1]
NO_DEVICE = "RuntimeError: no device here"

TINY = """
import os
import signal

import pytest


def test_passes():
    assert 2 + 2 == 4


def test_fails():
    assert [1, 2, 3] == [1, 2, 4], "the third element differs"


@pytest.fixture
def broken():
    raise RuntimeError("no device here")


def test_setup_fails(broken):
    pass


def test_killed():  # what the device call's `timeout -k` does to a run past its limit
    os.kill(os.getpid(), signal.SIGKILL)
"""


def test_failures_are_named_before_the_run_is_killed(tmp_path):
    shutil.copy(ROOT / "tests" / "gpu" / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "test_tiny.py").write_text(TINY)
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_tiny.py"],
        cwd=tmp_path, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    out = run.stdout + run.stderr
    assert run.returncode == -9 and "short test summary" not in out  # killed: no summary
    lines = out.splitlines()
    fail = lines.index("FAILED test_tiny.py::test_fails: AssertionError: the third element differs")
    excerpt = []
    for line in lines[fail + 1 :]:
        if not line.startswith("    | "):
            break
        excerpt.append(line)
    assert 3 <= len(excerpt) <= 15 and "test_tiny.py:13: AssertionError" in excerpt[-1]
    assert any("assert [1, 2, 3] == [1, 2, 4]" in ln for ln in excerpt)
    setup = [ln for ln in lines if ln.startswith("FAILED test_tiny.py::test_setup_fails: ")]
    assert setup == [f"FAILED test_tiny.py::test_setup_fails: (in setup) {NO_DEVICE}"]
    assert not any("test_passes" in ln for ln in lines)


# The fake python3 of scripts/device_jit_run.sh: pytest over a file named *slow* outlives its
# share, over *bad* fails one test; every other call (selftest) succeeds; each pytest call's
# arguments are appended to $CALLS.
FAKE_PYTHON = """#!/bin/bash
case "$*" in *pytest*) echo "$*" >> "$CALLS" ;; *) exit 0 ;; esac
case "$*" in
  *slow*) exec sleep 60 ;;
  *bad*) echo ".F"; echo "FAILED ${@: -1}::test_two: assert 1 == 2"
         echo "FAILED ${@: -1}::test_two - assert 1 == 2"; echo "1 failed, 1 passed in 0.01s"
         exit 1 ;;
esac
echo "2 passed in 0.01s"
"""


def test_device_jit_run_runs_gpu_tests_one_file_a_process(tmp_path):
    """Files in order, a folder's sorted, node ids of one file in one process; a file past its
    share is cut and the rest still run; the failures and summaries shown, the log packed."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    for name in ("test_c_bad.py", "test_a.py", "test_b_slow.py"):
        (gpu / name).write_text("")
    (tmp_path / "test_d.py").write_text("")
    d = tmp_path / "test_d.py"
    run = run_jit_run(tmp_path, FAKE_PYTHON, [], GPU_TESTS="1", GPU_TESTS_TIMEOUT="6",
                      GPU_TESTS_PATHS=f"{gpu} {d}::test_one {d}::test_two")  # fmt: skip
    calls = (tmp_path / "calls").read_text().splitlines()
    assert [c.split(" -m gpu ")[1] for c in calls] == [
        f"{gpu}/test_a.py", f"{gpu}/test_b_slow.py", f"{gpu}/test_c_bad.py",
        f"{d}::test_one {d}::test_two",
    ]  # fmt: skip
    assert all(c.startswith("-u -m pytest -q") for c in calls)
    out = run.stdout
    assert f"{gpu}/test_a.py: pytest rc=0" in out
    cut = re.search(
        rf"{re.escape(str(gpu))}/test_b_slow.py: cut by its limit \((\d) s\), rc=124", out
    )
    assert cut and int(cut.group(1)) <= 2  # a share of the 6 s (floored), not all of it
    assert f"FAILED {gpu}/test_c_bad.py::test_two: assert 1 == 2" in out
    assert " - assert 1 == 2" not in out  # the summary's repeat stays in the log
    assert f"{gpu}/test_c_bad.py: pytest rc=1" in out and "1 failed, 1 passed in 0.01s" in out
    assert f"{d}: pytest rc=0" in out
    log = subprocess.run(["tar", "-xOf", str(tmp_path / "out" / "logs.tar"), "./pytest-gpu.log"],
                         capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert " - assert 1 == 2" in log and log.count("=== ") == 4
