"""scripts/device_jit_run.sh and a bench cut by BENCH_TIMEOUT: the bench is asked to --resume,
and the partial ledger it wrote before the kill is packed with the call's ledgers."""

from __future__ import annotations

import json
import subprocess

from jit_run_fake import run_jit_run  # tests/ is on the path

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
    stamp = tmp_path / "stamp"  # device_streams.sh's, made before the call's streams
    stamp.touch()
    run = run_jit_run(tmp_path, FAKE_PYTHON, ["fake"], CHECK="0", BENCH_TIMEOUT="2")
    results = tmp_path / "results"
    assert "fake: check rc=skipped bench rc=124" in run.stdout
    (call,) = (tmp_path / "calls").read_text().splitlines()
    assert call.startswith("-m forgekernel bench --resume ") and call.endswith(" fake")
    for ledger in (results / "sm_90a" / "fake.json", tmp_path / "out/results/sm_90a/fake.json"):
        assert json.loads(ledger.read_text())["bench_partial"]["cases"] == [{"case": "a"}]
    # scripts/device_streams.sh packs the ledgers newer than its call's stamp: this one is
    found = subprocess.run(["find", ".", "-name", "*.json", "-newer", str(stamp)], cwd=results,
                           capture_output=True, text=True, check=True).stdout.split()  # fmt: skip
    assert "./sm_90a/fake.json" in found
