"""`forgekernel bundle DIR`: everything a bare GPU host with torch needs to check and bench the
library without package access and without the DSL: prebuilt kernels, the DSL runtime library
(xz), the apache-tvm-ffi and forgekernel wheels, and `run.sh`."""

from __future__ import annotations

import datetime as dt
import json
import lzma
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

from forgekernel.runtime.build import build_all
from forgekernel.runtime.loader import RUNTIME_LIB

REPO = Path(__file__).resolve().parents[2]
PY_TAG = "3.12"  # the GPU host's python

RUN_SH = """#!/usr/bin/env bash
# Run ForgeKernel from this bundle: bash run.sh [forgekernel args...]  (default: check + bench)
#   bash run.sh python SCRIPT [args...] runs a script with the bundle's packages and kernels.
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
site=${FORGEKERNEL_SITE:-/tmp/forgekernel-site}
if [ ! -f "$site/.ok" ]; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \\
    --target "$site" "$here"/wheels/*.whl
  xz -dc "$here/lib/libcute_dsl_runtime.so.xz" > "$site/libcute_dsl_runtime.so"
  touch "$site/.ok"
fi
export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
export FORGEKERNEL_KERNEL_DIR="$here/kernels"
export FORGEKERNEL_RUNTIME_LIB="$site/libcute_dsl_runtime.so"
export PYTHONUNBUFFERED=1
if [ $# -eq 0 ]; then
  python3 -m forgekernel check && python3 -m forgekernel bench
elif [ "$1" = python ]; then
  shift; python3 "$@"
else
  python3 -m forgekernel "$@"
fi
"""


def make_bundle(
    out: Path, arch: str = "sm_90a", candidates: bool = False, jobs: int | None = None
) -> Path:
    out = Path(out)
    if out.exists():
        shutil.rmtree(out)
    (out / "wheels").mkdir(parents=True)
    (out / "lib").mkdir()
    records = build_all(arch, out / "kernels", candidates=candidates, jobs=jobs)
    for lock in (out / "kernels").glob("*.lock"):
        lock.unlink()
    manifest = {
        "arch": arch,
        "dsl_version": metadata.version("nvidia-cutlass-dsl"),
        "built": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "kernels": [
            {k: v for k, v in r.items() if k != "path"} | {"file": Path(r["path"]).name}
            for r in records
        ],
    }
    (out / "kernels" / "manifest.json").write_text(json.dumps(manifest, indent=1, default=str))
    _pack_runtime(out / "lib")
    _wheels(out / "wheels")
    (out / "run.sh").write_text(RUN_SH)
    (out / "run.sh").chmod(0o755)
    size = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    print(f"bundle {out}: {len(records)} kernels, {size / 2**20:.1f} MiB")
    return out


def _pack_runtime(lib_dir: Path) -> None:
    import cutlass.cute as cute

    src = next(p for p in cute.runtime.find_runtime_libraries() if p.endswith(RUNTIME_LIB))
    with open(src, "rb") as f, lzma.open(lib_dir / f"{RUNTIME_LIB}.xz", "wb", preset=6) as g:
        shutil.copyfileobj(f, g)


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def _wheels(dest: Path) -> None:
    _pip("wheel", "--no-deps", "--no-build-isolation", "-w", str(dest), str(REPO))
    tvm = metadata.version("apache-tvm-ffi")
    platforms = []
    for p in (
        "manylinux_2_28_x86_64",
        "manylinux_2_24_x86_64",
        "manylinux_2_17_x86_64",
        "manylinux2014_x86_64",
    ):
        platforms += ["--platform", p]
    _pip(
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "--python-version",
        PY_TAG,
        "--implementation",
        "cp",
        *platforms,
        "-d",
        str(dest),
        f"apache-tvm-ffi=={tvm}",
    )
