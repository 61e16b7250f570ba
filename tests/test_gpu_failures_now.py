"""tests/gpu/conftest.py's report of each failure as it happens: a run killed before pytest's
summary (the device call's time limit) still names every failure it saw, with its reason and the
end of its traceback."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

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
