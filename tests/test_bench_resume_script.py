"""scripts/device_jit_run.sh and a bench cut by BENCH_TIMEOUT: the bench is asked to --resume,
and the partial ledger it wrote before the kill is packed with the call's ledgers."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# The fake python3: `forgekernel bench` writes a ledger holding a partial bench section the way
# the ledger does (temp file, rename), then outlives BENCH_TIMEOUT; anything else succeeds.
FAKE_PYTHON = """#!/bin/bash
case "$*" in
  *" bench "*)
    echo "$*" >> "$CALLS"
    d=$FORGEKERNEL_RESULTS_DIR/sm_90a
    mkdir -p "$d"
    echo '{"op": "fake", "bench_partial": {"cases": [{"case": "a"}]}}' > "$d/fake.json.tmp"
    mv "$d/fake.json.tmp" "$d/fake.json"
    exec sleep 60 ;;
esac
exit 0
"""


def test_a_bench_cut_by_its_limit_resumes_and_keeps_its_partial(tmp_path):
    fake = tmp_path / "bin" / "python3"
    fake.parent.mkdir()
    fake.write_text(FAKE_PYTHON)
    fake.chmod(0o755)
    results = tmp_path / "results"
    results.mkdir()
    (results / "kept.json").write_text("{}")  # not empty: the committed ledgers not copied in
    stamp = tmp_path / "stamp"  # device_streams.sh's, made before the call's streams
    stamp.touch()
    env = {
        **os.environ,
        "PATH": f"{fake.parent}{os.pathsep}/usr/bin:/bin",
        "CALLS": str(tmp_path / "calls"),
        "OUT": str(tmp_path / "out"),
        "LOGS": str(tmp_path / "logs"),
        "REPORTS": str(tmp_path / "reports"),
        "RESULTS": str(results),
        "CHECK": "0",
        "BENCH_TIMEOUT": "2",
    }
    run = subprocess.run(["bash", "scripts/device_jit_run.sh", "fake"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=60)  # fmt: skip
    assert "fake: check rc=skipped bench rc=124" in run.stdout
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith("-m forgekernel bench --resume ") and call.endswith(" fake")
    for ledger in (results / "sm_90a" / "fake.json", tmp_path / "out/results/sm_90a/fake.json"):
        assert json.loads(ledger.read_text())["bench_partial"]["cases"] == [{"case": "a"}]
    # scripts/device_streams.sh packs the ledgers newer than its call's stamp: this one is
    found = subprocess.run(["find", ".", "-name", "*.json", "-newer", str(stamp)], cwd=results,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert "./sm_90a/fake.json" in found
