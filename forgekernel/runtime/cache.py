"""The one compile cache: memory, then prebuilt/disk directories, then compile (DSL needed).

Key = kernel name, arch, the baked-in params (dtypes, static dims, config) and the hash of the
kernel's sources; dynamic dims are `cute.sym_int()` and never enter the key. Several processes
compiling the same key serialize on a lock file and the loser loads the winner's .so.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from forgekernel.runtime.arch import resolve_arch
from forgekernel.runtime.hashing import PACKAGE_ROOT, key_hash
from forgekernel.runtime.loader import load_function
from forgekernel.runtime.spec import KernelSpec, Params

_LOADED: dict[str, Any] = {}
# get_kernel's fast path: (name, arch, source hash, params) -> the loaded function, so that a
# launch does not rebuild the stem (repr + sha256 of the key: 3.8 us per call on the CPU).
_BY_KEY: dict[tuple, Any] = {}


def artifact_stem(spec: KernelSpec, params: Params) -> str:
    return f"{spec.name}-{key_hash(spec.name, spec.arch, params, spec.source_hash)}"


def symbol_of(stem: str) -> str:
    return "fk_" + stem.replace("-", "_")


def user_cache_dir(arch: str) -> Path:
    root = os.environ.get("FORGEKERNEL_CACHE_DIR") or Path.home() / ".cache" / "forgekernel"
    return Path(root) / arch


def package_prebuilt_dir(arch: str) -> Path:
    """Kernels built into the package itself (`forgekernel build --package` before building a
    wheel), so that an installed wheel never compiles at call time."""
    return PACKAGE_ROOT / "_prebuilt" / arch


def search_dirs(arch: str) -> list[Path]:
    """$FORGEKERNEL_KERNEL_DIR (a bundle), the package's prebuilt kernels, the user cache."""
    env = os.environ.get("FORGEKERNEL_KERNEL_DIR", "")
    dirs = [Path(d) for d in env.split(os.pathsep) if d]
    return dirs + [package_prebuilt_dir(arch), user_cache_dir(arch)]


def cached_params(params_for: Callable[..., Params]) -> Callable[..., Params]:
    """A leaf's `params_for` memoized (at most 256 keys): a launcher builds its compile key on
    every call (a dict and a sort; twice a launch where the support check builds it too), while
    the keys a process uses are few."""
    return functools.lru_cache(maxsize=256)(params_for)


def get_kernel(spec: KernelSpec, params: Params) -> Any:
    """The loaded callable for (spec, params); compiles once, only when nothing prebuilt fits."""
    key = (spec.name, spec.arch, spec.source_hash, params)
    fn = _BY_KEY.get(key)
    if fn is None:
        fn = _BY_KEY[key] = _load(spec, params)
    return fn


# Where `_load` appends each (kernel, params) it loads, one JSON line each (prebuilt or
# compiled), when set: the device calls' record of the keys their suites and tests launch
# (scripts/device_setup.sh), from which `forgekernel build --keys` builds only those next time.
KEYLOG_ENV = "FORGEKERNEL_KEYLOG"


def _log_key(spec: KernelSpec, params: Params) -> None:
    path = os.environ.get(KEYLOG_ENV)
    if not path:
        return
    line = json.dumps({"name": spec.name, "params": [list(kv) for kv in params]})
    with open(path, "a") as f:  # one short write a line: appends from processes stay whole
        f.write(line + "\n")


def read_keylog(path: Path) -> list[tuple[str, Params]]:
    """The distinct (kernel name, params) of a key log, in first-seen order."""
    keys: dict[tuple[str, Params], None] = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            keys[(rec["name"], tuple((k, v) for k, v in rec["params"]))] = None
    return list(keys)


def _load(spec: KernelSpec, params: Params) -> Any:
    stem = artifact_stem(spec, params)
    fn = _LOADED.get(stem)
    if fn is not None:
        return fn
    _log_key(spec, params)
    if resolve_arch(None) != spec.arch:
        raise RuntimeError(f"{spec.name} is built for {spec.arch}, this device is not")
    for d in search_dirs(spec.arch):
        so = d / f"{stem}.so"
        if so.is_file():
            fn = _LOADED[stem] = load_function(so, symbol_of(stem))
            return fn
    print(
        f"forgekernel: compiling {spec.name} {dict(params)} (one-time; "
        "`forgekernel build` prebuilds the standard configurations)",
        file=sys.stderr,
    )
    record = compile_to(spec, params, user_cache_dir(spec.arch))
    fn = _LOADED[stem] = load_function(Path(record["path"]), symbol_of(stem))
    return fn


def compile_to(
    spec: KernelSpec, params: Params, out_dir: Path, keep_dir: Path | None = None
) -> dict[str, Any]:
    """Compile and export one kernel to `out_dir/<stem>.so` (atomic, lock-serialized).
    With `keep_dir`, the cubin is kept there and its path returned as record["cubin"]."""
    out_dir.mkdir(parents=True, exist_ok=True)
    stem = artifact_stem(spec, params)
    so = out_dir / f"{stem}.so"
    record: dict[str, Any] = {"name": spec.name, "params": dict(params), "path": str(so)}
    with open(out_dir / f"{stem}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if so.is_file():
            record["compile_s"] = 0.0
            return record
        t0 = time.perf_counter()
        keep = f"--keep-cubin --dump-dir {keep_dir}" if keep_dir else ""
        compiled = spec.compile(params, keep)
        record["compile_s"] = round(time.perf_counter() - t0, 2)
        record["cubin"] = getattr(compiled.artifacts, "CUBIN", None)
        _export(compiled, symbol_of(stem), so)
    return record


def _export(compiled: Any, symbol: str, so: Path) -> None:
    import cutlass.cute as cute

    with tempfile.TemporaryDirectory(dir=so.parent) as tmp:
        obj = Path(tmp) / "kernel.o"
        compiled.export_to_c(str(obj), function_name=symbol)
        tmp_so = Path(tmp) / "kernel.so"
        libs = cute.runtime.find_runtime_libraries(enable_tvm_ffi=True)
        subprocess.run(["gcc", "-shared", "-o", str(tmp_so), str(obj), *libs], check=True)
        os.replace(tmp_so, so)
