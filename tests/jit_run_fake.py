"""scripts/device_jit_run.sh run here with python3 faked: the tests of what it asks of python3
and what it leaves in $RESULTS / $OUT (test_gpu_failures_now.py, test_bench_resume_script.py)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run_jit_run(
    tmp_path: Path, fake_python: str, args: list[str], **env: str
) -> subprocess.CompletedProcess:
    """device_jit_run.sh ARGS with `fake_python` first on PATH as python3 (its calls' arguments
    go to tmp_path/calls where it appends them), $OUT, $LOGS, $REPORTS under tmp_path and
    $RESULTS = tmp_path/results holding one ledger (not empty: the committed ledgers are not
    copied in); `env` on top."""
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(fake_python)
    fake.chmod(0o755)
    results = tmp_path / "results"
    results.mkdir(exist_ok=True)
    (results / "kept.json").write_text("{}")
    full = {
        **os.environ,
        "PATH": f"{fake.parent}{os.pathsep}/usr/bin:/bin",
        "CALLS": str(tmp_path / "calls"),
        "OUT": str(tmp_path / "out"),
        "LOGS": str(tmp_path / "logs"),
        "REPORTS": str(tmp_path / "reports"),
        "RESULTS": str(results),
        **env,
    }
    return subprocess.run(["bash", "scripts/device_jit_run.sh", *args], cwd=ROOT, env=full,
                          capture_output=True, text=True, timeout=60)  # fmt: skip
