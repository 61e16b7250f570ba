"""scripts/comparator_caches.sh on the CPU: a fake nvidia-smi names the GPU, a fake nvcc the CUDA
release, fake Triton, TileLang and FlashInfer caches stand for the device host's, a fake flashinfer
package for its wheel. pack keeps the autotuning results, TileLang's compiled kernels and
FlashInfer's modules (each kind newest first, up to its cap) and the GPU's name, gzipped, take
keeps them per GPU model (a union over calls, cut back to the cap), restore copies the
matching model's back (the compiled ones only under the nvcc release that built them; FlashInfer's
nvcc modules as its prebuilt ones, only under the same FlashInfer version)."""

from __future__ import annotations

import gzip
import os
import subprocess
import tarfile
import time
from pathlib import Path

from forgekernel.bench.sidecar import Sidecar, child_env

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "comparator_caches.sh"
H100 = "NVIDIA H100 80GB HBM3"


def _run(
    tmp: Path,
    gpu: str,
    *args: str,
    cache: Path,
    store: Path,
    tl: Path | None = None,
    fi: Path | None = None,
    site: Path | None = None,
    cuda: str = "12.8",
    cap_mb: int | None = None,
    fi_cap_mb: int | None = None,
) -> str:
    bin_dir = tmp / f"bin-{gpu.replace(' ', '_')}-{cuda}"
    bin_dir.mkdir(exist_ok=True)
    nvcc = f"Cuda compilation tools, release {cuda}, V{cuda}.93"
    for tool, line in (("nvidia-smi", gpu), ("nvcc", nvcc)):
        (bin_dir / tool).write_text(f"#!/bin/sh\necho '{line}'\n")
        (bin_dir / tool).chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k not in ("CUDA_HOME", "CUDA_PATH")}
    env.update(
        PATH=f"{bin_dir}:{os.environ['PATH']}",
        TRITON_CACHE_DIR=str(cache),
        FK_DEVICE_CACHE=str(store),
        TILELANG_CACHE_DIR=str(tl or tmp / "no-tilelang"),
        FLASHINFER_WORKSPACE_BASE=str(fi or tmp / "no-flashinfer"),
        PYTHONPATH=str(site or tmp / "no-site"),  # where python3 finds the flashinfer package
    )
    if cap_mb is not None:
        env["FK_COMPARATOR_CACHE_MB"] = str(cap_mb)
    if fi_cap_mb is not None:
        env["FK_FLASHINFER_CACHE_MB"] = str(fi_cap_mb)
    done = subprocess.run(["bash", str(SCRIPT), *args], env=env, capture_output=True,
                          text=True, check=True)  # fmt: skip
    return done.stdout + done.stderr


def _pack(tmp: Path, **kw) -> tuple[str, Path, Path]:
    """`pack` on the H100 into a fresh out/, beside a fresh store/: (what it said, out, store)."""
    out = tmp / "out"
    out.mkdir()
    store = tmp / "store"
    return _run(tmp, H100, "pack", str(out), store=store, **kw), out, store


def _members(out: Path) -> dict[str, bytes | None]:
    """The packed tar's members: name -> contents (None for a non-file)."""
    with tarfile.open(out / "comparator-caches.tar.gz") as t:
        return {m.name: t.extractfile(m).read() if m.isfile() else None for m in t.getmembers()}


def _host_cache(path: Path, names: dict[str, str]) -> Path:
    for rel, text in names.items():
        (path / rel).parent.mkdir(parents=True, exist_ok=True)
        (path / rel).write_text(text)
    return path


def test_pack_take_restore_round_trip(tmp_path):
    host = _host_cache(tmp_path / "host", {"k1/chunk_fwd.autotune.json": '{"a": 1}',
                                           "k1/chunk_fwd.cubin": "binary",
                                           "k2/bwd.autotune.json": '{"b": 2}'})  # fmt: skip
    said, out, store = _pack(tmp_path, cache=host)
    assert "packed 2 autotuning results" in said
    names = sorted(_members(out))
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
    assert not (out / "comparator-caches.tar.gz").exists()
    assert _run(tmp_path, H100, "take", str(out), cache=empty, store=store) == ""
    assert _run(tmp_path, H100, "restore", cache=tmp_path / "none", store=store) == ""


NS = "0.1.15/linux-x86_64"  # tilelang's namespace: its version, the host's os and machine
ENTRY = ("device_kernel.cu", "host_kernel.cu", "executable.so", "params.json", "manifest.json")


def _tl_cache(path: Path, keys: dict[str, int], age: float = 0.0) -> Path:
    """A fake TileLang cache: per key an entry of `size` bytes in executable.so, the entries
    older in the order given (the first newest), plus a staging leftover."""
    now = time.time() - age
    for i, (key, size) in enumerate(keys.items()):
        entry = path / NS / "kernels" / key
        entry.mkdir(parents=True)
        for name in ENTRY:
            data = b"x" * size if name == "executable.so" else f"{key} {name}".encode()
            (entry / name).write_bytes(data)
        os.utime(entry, (now - 60 * i, now - 60 * i))
    (path / NS / ".staging" / "half_written").mkdir(parents=True, exist_ok=True)
    return path


def test_tilelang_kernels_round_trip(tmp_path):
    host = _host_cache(tmp_path / "host", {"k1/f.autotune.json": "{}"})
    tl = _tl_cache(tmp_path / "tl", {"aa11": 1000, "bb22": 2000})
    said, out, store = _pack(tmp_path, cache=host, tl=tl)
    assert "packed 1 autotuning results, 2 compiled TileLang kernels" in said
    members = _members(out)
    names = set(members)
    assert members["tilelang/cuda.txt"] == b"release 12.8\n"
    assert {f"tilelang/{NS}/kernels/aa11/{n}" for n in ENTRY} <= names
    assert not any(".staging" in n for n in names)  # a crashed writer's leftovers stay behind
    said = _run(tmp_path, H100, "take", str(out), cache=host, store=store, tl=tl)
    assert "2 compiled TileLang kernels (3 KB), 0 FlashInfer modules (0 KB) kept" in said
    # a fresh host with the same nvcc loads them (the child's TILELANG_CACHE_DIR, below)
    fresh = tmp_path / "fresh-tl"
    said = _run(tmp_path, H100, "restore", cache=tmp_path / "fresh", store=store, tl=fresh)
    assert "restored 2 compiled TileLang kernels" in said and "nvcc release 12.8" in said
    so = fresh / NS / "kernels" / "bb22" / "executable.so"
    assert so.read_bytes() == b"x" * 2000
    old = tl / NS / "kernels" / "bb22"
    assert abs(so.parent.stat().st_mtime - old.stat().st_mtime) < 2  # newest-first survives
    # another nvcc: its cubins may not load, tilelang compiles for itself
    other = tmp_path / "other-tl"
    said = _run(tmp_path, H100, "restore", cache=tmp_path / "o", store=store, tl=other, cuda="13.0")
    assert "not restored" in said and not other.exists()
    # another GPU model: nothing
    assert _run(tmp_path, "NVIDIA H200", "restore", cache=tmp_path / "h200", store=store,
                tl=tmp_path / "h200-tl") == ""  # fmt: skip


def test_tilelang_cap_newest_first(tmp_path):
    kb = 1024
    tl = _tl_cache(tmp_path / "tl", {"new1": 400 * kb, "mid2": 400 * kb, "old3": 400 * kb})
    said, out, store = _pack(tmp_path, cache=tmp_path / "none", tl=tl, cap_mb=1)
    assert "2 compiled TileLang kernels" in said and "dropped tilelang old3" in said
    keys = {n.split("/")[4] for n in _members(out) if n.count("/") >= 5}
    assert keys == {"new1", "mid2"}
    _run(tmp_path, H100, "take", str(out), cache=tmp_path / "none", store=store, cap_mb=1)
    # a later host's newer kernel joins; the union is cut back to the cap, oldest out
    later = _tl_cache(tmp_path / "later", {"newer4": 400 * kb}, age=-60)
    out2 = tmp_path / "out2"
    out2.mkdir()
    _run(tmp_path, H100, "pack", str(out2), cache=tmp_path / "none", store=store, tl=later,
         cap_mb=1)  # fmt: skip
    said = _run(tmp_path, H100, "take", str(out2), cache=tmp_path / "none", store=store, cap_mb=1)
    assert "dropped tilelang mid2" in said and "2 compiled TileLang kernels" in said
    kept = store / "NVIDIA_H100_80GB_HBM3" / "tilelang" / NS / "kernels"
    assert sorted(p.name for p in kept.iterdir()) == ["new1", "newer4"]


def test_tilelang_other_nvcc_replaces_the_store(tmp_path):
    store = tmp_path / "store"
    for i, (cuda, key) in enumerate((("12.8", "k128"), ("13.0", "k130"))):
        out = tmp_path / f"out{i}"
        out.mkdir()
        tl = _tl_cache(tmp_path / f"tl{i}", {key: 100})
        _run(tmp_path, H100, "pack", str(out), cache=tmp_path / "none", store=store, tl=tl,
             cuda=cuda)  # fmt: skip
        _run(tmp_path, H100, "take", str(out), cache=tmp_path / "none", store=store)
    kept = store / "NVIDIA_H100_80GB_HBM3" / "tilelang"
    assert (kept / "cuda.txt").read_text() == "release 13.0\n"
    assert [p.name for p in (kept / NS / "kernels").iterdir()] == ["k130"]


FI_OPS = "0.7.2.post1/90a/cached_ops"  # FlashInfer's JIT folder: its version, the card's arch
PREFILL = "batch_prefill_with_kv_cache_dtype_q_bf16_head_dim_qk_128"  # an nvcc module
DECODE = "gdn_decode_pretranspose_sm90a_cute_dsl"  # a CuTe DSL module


def _fi_cache(base: Path, modules: dict[str, int], age: float = 0.0) -> Path:
    """A fake FlashInfer JIT cache under base/.cache/flashinfer: per nvcc module its linked .so
    of `size` bytes beside an object file and ninja's files, per CuTe DSL module (a name ending
    in _cute_dsl) a kernel .o of `size` bytes, its meta.json and a crashed export's leftover; the
    modules older in the order given; plus a module whose link never ran and the lock folder."""
    ops = base / ".cache" / "flashinfer" / FI_OPS
    now = time.time() - age
    for i, (name, size) in enumerate(modules.items()):
        module = ops / name
        module.mkdir(parents=True)
        if name.endswith("_cute_dsl"):
            files = {"decode_b1.o": b"k" * size, "meta.json": b'{"arch": "sm90a"}',
                     "decode_b1.o.tmp.77": b"half"}  # fmt: skip
        else:
            files = {f"{name}.so": b"x" * size, "batch_prefill.cuda.o": b"o" * 5000,
                     "build.ninja": b"rule", ".ninja_log": b"# ninja log v7"}  # fmt: skip
        for file, data in files.items():
            (module / file).write_bytes(data)
            os.utime(module / file, (now - 60 * i, now - 60 * i))
    (ops / "unlinked").mkdir(parents=True, exist_ok=True)
    (ops / "unlinked" / "unlinked.cuda.o").write_bytes(b"o")
    (ops / "tmp").mkdir(exist_ok=True)
    (ops / "tmp" / f"{PREFILL}.lock").write_bytes(b"")
    return base


def _fi_site(path: Path, version: str = "0.7.2.post1") -> Path:
    """A fake flashinfer wheel's package: what restore reads (its folder and _build_meta.py)."""
    (path / "flashinfer").mkdir(parents=True)
    (path / "flashinfer" / "__init__.py").write_text("raise ImportError('not to be imported')\n")
    (path / "flashinfer" / "_build_meta.py").write_text(f'__version__ = "{version}"\n')
    return path


def test_flashinfer_modules_round_trip(tmp_path):
    fi = _fi_cache(tmp_path / "fi", {PREFILL: 1000, DECODE: 300})
    none = tmp_path / "none"
    said, out, store = _pack(tmp_path, cache=none, fi=fi)
    assert "packed 0 autotuning results, 0 compiled TileLang kernels, 2 FlashInfer modules" in said
    members = _members(out)
    names = set(members)
    assert members["flashinfer/cuda.txt"] == b"release 12.8\n"
    # the linked module alone, the DSL kernels with their meta.json: no objects, ninja files,
    # locks, half-written exports or unlinked modules
    assert names == {"gpu.txt", "flashinfer/cuda.txt",
                     f"flashinfer/{FI_OPS}/{PREFILL}/{PREFILL}.so",
                     f"flashinfer/{FI_OPS}/{DECODE}/decode_b1.o",
                     f"flashinfer/{FI_OPS}/{DECODE}/meta.json"}  # fmt: skip
    said = _run(tmp_path, H100, "take", str(out), cache=none, store=store)
    assert "0 compiled TileLang kernels (0 KB), 2 FlashInfer modules (1 KB) kept" in said
    # a fresh host with the same nvcc and FlashInfer: the nvcc module as FlashInfer's prebuilt
    # one (loaded without ninja), the DSL module where FlashInfer's JIT looks for it
    site = _fi_site(tmp_path / "site")
    fresh = tmp_path / "fresh-fi"
    said = _run(tmp_path, H100, "restore", cache=none, store=store, fi=fresh, site=site)
    assert f"restored 2 FlashInfer 0.7.2.post1 modules ({H100}, nvcc release 12.8)" in said
    aot = site / "flashinfer" / "data" / "aot" / PREFILL / f"{PREFILL}.so"
    assert aot.read_bytes() == b"x" * 1000
    ops = fresh / ".cache" / "flashinfer" / FI_OPS
    assert (ops / DECODE / "decode_b1.o").read_bytes() == b"k" * 300
    assert (ops / DECODE / "meta.json").is_file() and not (ops / PREFILL).exists()
    old = fi / ".cache" / "flashinfer" / FI_OPS / DECODE / "decode_b1.o"
    assert abs((ops / DECODE / "decode_b1.o").stat().st_mtime - old.stat().st_mtime) < 2
    # another FlashInfer version: its modules are not this one's
    other_site = _fi_site(tmp_path / "site-0.7.3", "0.7.3")
    said = _run(tmp_path, H100, "restore", cache=none, store=store, fi=tmp_path / "f2",
                site=other_site)  # fmt: skip
    assert "restored 0 FlashInfer 0.7.3 modules" in said
    assert not (other_site / "flashinfer" / "data").exists() and not (tmp_path / "f2").exists()
    # another nvcc: its .so may link another libcudart; FlashInfer compiles for itself
    other_nvcc = _fi_site(tmp_path / "site-13")
    said = _run(tmp_path, H100, "restore", cache=none, store=store, fi=tmp_path / "f3",
                site=other_nvcc, cuda="13.0")  # fmt: skip
    assert "FlashInfer modules built with nvcc release 12.8, this host has release 13.0" in said
    assert not (other_nvcc / "flashinfer" / "data").exists()
    # no FlashInfer wheel installed: said, nothing written
    said = _run(tmp_path, H100, "restore", cache=none, store=store, fi=tmp_path / "f4")
    assert "no FlashInfer wheel installed here" in said and not (tmp_path / "f4").exists()


def test_flashinfer_cap_apart_from_tilelang(tmp_path):
    kb = 1024
    store = tmp_path / "store"
    none = tmp_path / "none"
    tl = _tl_cache(tmp_path / "tl", {"new1": 400 * kb, "old3": 400 * kb})  # now, a minute ago
    modules = {f"{PREFILL}_new": 400 * kb, f"{PREFILL}_mid": 400 * kb, f"{PREFILL}_old": 400 * kb}
    fi = _fi_cache(tmp_path / "fi", modules, age=-30)  # newer than TileLang's, one by one older
    out = tmp_path / "out"
    out.mkdir()
    said = _run(tmp_path, H100, "pack", str(out), cache=none, store=store, tl=tl, fi=fi,
                cap_mb=1, fi_cap_mb=1)  # fmt: skip
    # FlashInfer's newer modules do not push TileLang's kernels out: each kind its own cap
    assert f"dropped flashinfer {PREFILL}_old (400 KB, over 1048576 bytes)" in said
    assert "2 compiled TileLang kernels, 2 FlashInfer modules" in said and "tilelang" not in said
    assert os.path.getsize(out / "comparator-caches.tar.gz") < 64 * kb  # 1.6 MB of x, gzipped
    _run(tmp_path, H100, "take", str(out), cache=none, store=store, cap_mb=1, fi_cap_mb=1)
    # the store's union cut back to the cap: a later host's newer module pushes out the oldest
    later = tmp_path / "later"
    later.mkdir()
    _run(tmp_path, H100, "pack", str(later), cache=none, store=store, cap_mb=1, fi_cap_mb=1,
         fi=_fi_cache(tmp_path / "fi-later", {DECODE: 400 * kb}, age=-90))  # fmt: skip
    said = _run(tmp_path, H100, "take", str(later), cache=none, store=store, cap_mb=1, fi_cap_mb=1)
    assert f"dropped flashinfer {PREFILL}_mid" in said
    assert "2 compiled TileLang kernels (800 KB), 2 FlashInfer modules (800 KB) kept" in said
    kept = store / "NVIDIA_H100_80GB_HBM3" / "flashinfer" / FI_OPS
    assert sorted(p.name for p in kept.iterdir()) == sorted([DECODE, f"{PREFILL}_new"])


def test_pack_says_a_tar_too_big_to_come_back(tmp_path):
    fi = _fi_cache(tmp_path / "fi", {PREFILL: 1})
    so = fi / ".cache" / "flashinfer" / FI_OPS / PREFILL / f"{PREFILL}.so"
    so.write_bytes(os.urandom(17 * 1024 * 1024))  # a cubin gzips to ~1/5; noise does not
    out = tmp_path / "out"
    out.mkdir()
    said = _run(tmp_path, H100, "pack", str(out), cache=tmp_path / "none", store=tmp_path / "s",
                fi=fi, fi_cap_mb=20)  # fmt: skip
    assert "over the 16 MiB a file that comes back: lower the caps" in said


def test_take_reads_an_earlier_calls_plain_tar(tmp_path):
    """A call packed by the scripts before 2026-12-07 left comparator-caches.tar, not gzipped."""
    out = tmp_path / "out"
    out.mkdir()
    host = _host_cache(tmp_path / "host", {"k1/f.autotune.json": "{}"})
    _run(tmp_path, H100, "pack", str(out), cache=host, store=tmp_path / "s0")
    with gzip.open(out / "comparator-caches.tar.gz") as z:
        (out / "comparator-caches.tar").write_bytes(z.read())
    (out / "comparator-caches.tar.gz").unlink()
    said = _run(tmp_path, H100, "take", str(out), cache=host, store=tmp_path / "store")
    assert "1 autotuning results" in said


def test_flashinfer_other_nvcc_replaces_the_store(tmp_path):
    store = tmp_path / "store"
    for i, cuda in enumerate(("12.8", "13.0")):
        out = tmp_path / f"out{i}"
        out.mkdir()
        fi = _fi_cache(tmp_path / f"fi{i}", {f"{PREFILL}_{i}": 100})
        _run(tmp_path, H100, "pack", str(out), cache=tmp_path / "none", store=store, fi=fi,
             cuda=cuda)  # fmt: skip
        _run(tmp_path, H100, "take", str(out), cache=tmp_path / "none", store=store)
    kept = store / "NVIDIA_H100_80GB_HBM3" / "flashinfer"
    assert (kept / "cuda.txt").read_text() == "release 13.0\n"
    assert [p.name for p in (kept / FI_OPS).iterdir()] == [f"{PREFILL}_1"]


def test_sidecar_child_sees_the_restored_caches():
    """device_setup.sh exports where restore put the caches; the sidecar's child inherits them."""
    setup = (ROOT / "scripts" / "device_setup.sh").read_text()
    assert "export TILELANG_CACHE_DIR=" in setup and "export TRITON_CACHE_AUTOTUNING=1" in setup
    assert setup.index("export TILELANG_CACHE_DIR=") < setup.index("comparator_caches.sh restore")
    side = Sidecar(label="x", runner="m:f", site_env="FK_SIDE_SITE_X", keys=())
    parent = {"FK_SIDE_SITE_X": "/site", "TILELANG_CACHE_DIR": "/root/.tilelang/cache",
              "TRITON_CACHE_AUTOTUNING": "1", "PYTHONPATH": ""}  # fmt: skip
    env = child_env(side, parent)
    assert env["TILELANG_CACHE_DIR"] == "/root/.tilelang/cache"
    assert env["TRITON_CACHE_AUTOTUNING"] == "1"
