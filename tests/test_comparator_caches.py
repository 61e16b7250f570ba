"""scripts/comparator_caches.sh on the CPU: a fake nvidia-smi names the GPU, fake Triton caches
stand for the device host's. pack keeps only the autotuning results and the GPU's name, take
keeps them per GPU model (a union over calls), restore copies the matching model's back."""

from __future__ import annotations

import os
import subprocess
import tarfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "comparator_caches.sh"
H100 = "NVIDIA H100 80GB HBM3"


def _run(tmp: Path, gpu: str, *args: str, cache: Path, store: Path) -> str:
    bin_dir = tmp / f"bin-{gpu.replace(' ', '_')}"
    bin_dir.mkdir(exist_ok=True)
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!/bin/sh\necho '{gpu}'\n")
    smi.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}",
           "TRITON_CACHE_DIR": str(cache), "FK_DEVICE_CACHE": str(store)}  # fmt: skip
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout


def _host_cache(path: Path, names: dict[str, str]) -> Path:
    for rel, text in names.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def test_pack_take_restore_round_trip(tmp_path):
    host = _host_cache(tmp_path / "host", {"k1/chunk_fwd.autotune.json": '{"a": 1}',
                                           "k1/chunk_fwd.cubin": "binary",
                                           "k2/bwd.autotune.json": '{"b": 2}'})  # fmt: skip
    out = tmp_path / "out"
    out.mkdir()
    store = tmp_path / "store"
    said = _run(tmp_path, H100, "pack", str(out), cache=host, store=store)
    assert "packed 2 autotuning results" in said
    with tarfile.open(out / "comparator-caches.tar") as t:
        names = sorted(t.getnames())
    assert names == ["gpu.txt", "triton/k1/chunk_fwd.autotune.json", "triton/k2/bwd.autotune.json"]
    said = _run(tmp_path, H100, "take", str(out), cache=host, store=store)
    kept = store / "NVIDIA_H100_80GB_HBM3" / "triton"
    assert (kept / "k1" / "chunk_fwd.autotune.json").read_text() == '{"a": 1}'
    assert not (kept / "k1" / "chunk_fwd.cubin").exists() and "2 autotuning results" in said
    # a later call's results join the earlier ones (a union)
    later = _host_cache(tmp_path / "later", {"k3/other.autotune.json": "{}"})
    out2 = tmp_path / "out2"
    out2.mkdir()
    _run(tmp_path, H100, "pack", str(out2), cache=later, store=store)
    assert "3 autotuning results" in _run(tmp_path, H100, "take", str(out2), cache=later,
                                          store=store)  # fmt: skip
    fresh = tmp_path / "fresh"
    assert "restored 3" in _run(tmp_path, H100, "restore", cache=fresh, store=store)
    assert (fresh / "k2" / "bwd.autotune.json").read_text() == '{"b": 2}'
    other = tmp_path / "other"
    assert _run(tmp_path, "NVIDIA H200", "restore", cache=other, store=store) == ""
    assert not other.exists()  # another GPU model: its comparators tune for themselves


def test_nothing_to_pack_or_take(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    store = tmp_path / "store"
    empty = _host_cache(tmp_path / "host", {"k1/x.cubin": "binary"})
    assert _run(tmp_path, H100, "pack", str(out), cache=empty, store=store) == ""
    assert not (out / "comparator-caches.tar").exists()
    assert _run(tmp_path, H100, "take", str(out), cache=empty, store=store) == ""
    assert _run(tmp_path, H100, "restore", cache=tmp_path / "none", store=store) == ""
