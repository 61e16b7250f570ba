"""`forgekernel build`: compile every kernel's standard configurations ahead of time (no GPU
needed), in parallel processes, and report each one's resources from the compiler's own output."""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import os
import tempfile
from concurrent.futures import Future, ProcessPoolExecutor
from pathlib import Path
from typing import Any

from forgekernel.runtime.cache import artifact_stem, compile_to, user_cache_dir
from forgekernel.runtime.resources import inspect_cubin
from forgekernel.runtime.spec import KernelSpec, Params, all_specs

Task = tuple[str, Params]  # (KernelSpec.name, params): what a worker process can look up


def build_all(
    arch: str = "sm_90a",
    out_dir: Path | None = None,
    candidates: bool = False,
    only: list[str] | None = None,
    jobs: int | None = None,
    representatives: bool = False,
    keys: list[Task] | None = None,
) -> list[dict[str, Any]]:
    """Compile all standard (spec, params) for `arch` into `out_dir` (default: user cache), one
    record per configuration in the specs' order; with `candidates`, also the configurations a
    tuning sweep times; `only`: kernel names (KernelSpec.name) to restrict to; `jobs`: processes
    (default: all cores); `representatives`: only each kernel's representative configuration
    (what the tests build); `keys` (a key log's, cache.read_keylog): only those of the
    configurations chosen above."""
    target = Path(out_dir) if out_dir else user_cache_dir(arch)
    tasks = build_tasks(arch, candidates, only, representatives)
    if keys is not None:
        wanted = set(keys)
        tasks = [t for t in tasks if t in wanted]
    unique = list(dict.fromkeys(tasks))
    done = dict(zip(unique, _run(unique, target, jobs or os.cpu_count() or 1), strict=True))
    records, seen = [], set()
    for task in tasks:
        # a configuration listed twice (a candidate that is also standard) compiles once; the
        # repeat is reported as a sequential build reports it: found, 0 s
        records.append(done[task] | ({"compile_s": 0.0} if task in seen else {}))
        seen.add(task)
    return records


def build_tasks(
    arch: str,
    candidates: bool = False,
    only: list[str] | None = None,
    representatives: bool = False,
) -> list[Task]:
    """(kernel name, params) to build, in the specs' order."""
    tasks = []
    for spec in all_specs():
        if spec.arch != arch or (only and spec.name not in only):
            continue
        if representatives:
            tasks.append((spec.name, spec.representative_params()))
            continue
        extra = list(spec.candidate_params()) if candidates else []
        tasks += [(spec.name, params) for params in list(spec.standard_params()) + extra]
    return tasks


def _run(tasks: list[Task], target: Path, jobs: int) -> list[dict[str, Any]]:
    """One record per task, in order; kernels already in `target` are read here, the others
    compiled by `jobs` processes."""
    missing = [t for t in tasks if not _built(t, target)]
    if missing and importlib.util.find_spec("cutlass") is None:  # say so before any process starts
        raise ImportError("No module named 'cutlass'")
    if jobs <= 1 or len(missing) <= 1:
        return [build_one(name, params, target) for name, params in tasks]
    # spawn: each worker starts clean and imports the DSL itself (no forked compiler state)
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(min(jobs, len(missing)), mp_context=context) as pool:
        futures = {t: pool.submit(build_one, *t, target) for t in missing}
        return [_result(futures[t], pool) if t in futures else build_one(*t, target) for t in tasks]


def _result(future: Future, pool: ProcessPoolExecutor) -> dict[str, Any]:
    try:
        return future.result()
    except BaseException:
        pool.shutdown(wait=False, cancel_futures=True)  # the first failure stops the build
        raise


def build_one(name: str, params: Params, target: Path) -> dict[str, Any]:
    """Compile (or find) one configuration of the kernel `name` and read its resources."""
    spec = _spec_named(name)
    with tempfile.TemporaryDirectory(prefix="forgekernel-cubin-") as keep:
        # A fresh folder per kernel: the DSL names dumps by signature, not config.
        rec = compile_to(spec, params, target, keep_dir=Path(keep))
        rec.update(_resources(Path(rec["path"]), rec.pop("cubin", None)))
    rec["config"] = _short(rec["params"])
    return rec


def _built(task: Task, target: Path) -> bool:
    name, params = task
    return (target / f"{artifact_stem(_spec_named(name), params)}.so").is_file()


def _spec_named(name: str) -> KernelSpec:
    return next(spec for spec in all_specs() if spec.name == name)


def _resources(so: Path, cubin: Any) -> dict[str, Any]:
    """Read off the fresh cubin and kept beside the .so, or, for a kernel built earlier (no
    cubin this time), what was kept then."""
    sidecar = so.with_suffix(".resources.json")
    if cubin is None and sidecar.is_file():
        return json.loads(sidecar.read_text())
    found = inspect_cubin(cubin)
    if cubin is not None:
        tmp = sidecar.with_suffix(f".{os.getpid()}.tmp")  # readers never see half a file
        tmp.write_text(json.dumps(found))
        os.replace(tmp, sidecar)
    return found


def _short(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
