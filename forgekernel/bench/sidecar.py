"""Sidecar comparators: a comparator timed in a Python process of its own, with a site
directory of its own, on the case's own inputs (issue 20). FlashQLA's TileLang pins
apache-tvm-ffi < 0.1.13 where the CuTe DSL runs on 0.1.15; fla 0.6.0's gated backward needs
triton >= 3.7.1 on Hopper where torch 2.11 pins 3.6. Neither can share our process.

Parent (`harness._time_case`, after ours is timed): `run` saves the tensors the comparator reads
(`Sidecar.keys`) of the case's first input set with torch.save into a job folder (/dev/shm
where it has room), writes job.json (the runner, the timing methods and counts of
`BenchTiming`, the number of input sets the case's graph timing rotated through, the device)
and hands the folder to the sidecar's child: `python -m forgekernel.bench.sidecar`, started on
the suite's first case with PYTHONPATH = the site first, this tree, then the parent's entries
less `Sidecar.drop` and what lies under them, and kept for the suite's other cases (its imports,
CUDA context and the comparator's compiled kernels paid once; `close_all` ends it before the
suite's closing device check). A failed job ends the child; the next case starts a fresh one.

Child (`serve`, `child`): imports torch, the timer (`bench.methods`, `runtime.timing`) and the
runner's module, never the CuTe DSL (tests/test_bench_sidecar.py runs it with cutlass and
tvm_ffi unimportable). Per job it loads the inputs onto the device (the saved bytes:
bit-identical), makes the runner (its factory, once per child; None: its packages are missing,
reported so), makes the first call (compiles, autotuning) and saves its outputs, clones the
loaded tensors into as many input sets as the parent's graph timing rotated (same bytes, own
memory: what a comparator caches per set is cached per clone), times each method with
`methods.time_method` as the harness does, and writes result.json: per method the samples, how
they were measured, launches and note.

The parent records each method's samples in the comparator's slot of the case record as it
records an in-process comparator's (figures, ratio to ours), the note saying it was timed in
its own process after ours, not interleaved, plus `vs_ours`: per output, max |theirs - ours| /
max |ours| of the first call (a layout mistake shows as ~1), and `versions`: the VERSIONS the
child imported (the ledger's environment is the parent's). A sidecar whose variable is unset,
whose site is missing, whose runner finds no packages, or whose child fails or runs past
FK_SIDECAR_TIMEOUT (default 300 s) on a job is reported missing with the reason (the child's
stderr tail), never raised.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import importlib
import importlib.metadata
import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.methods import time_method
from forgekernel.runtime.timing import Samples

MAIN_SITE = "/root/wheels-site"  # the GPU host's main wheel set (../shared/gpu-host/wheels.sh)
REPO_ROOT = Path(__file__).resolve().parents[2]
JOB, INPUTS, OUTPUTS, RESULT = "job.json", "inputs.pt", "outputs.pt", "result.json"
# seconds a job may take: under BENCH_TIMEOUT (540 s), so a stuck child costs its case, not the
# suite; a cold TileLang compile of every FlashQLA kernel may need more (warm_comparators first)
TIMEOUT_ENV, TIMEOUT_S = "FK_SIDECAR_TIMEOUT", 300.0
SCRATCH_ENV = "FK_SIDECAR_TMP"  # the job folder's parent (default: /dev/shm where it has room)
STDERR_TAIL = 800  # characters of a failed child's stderr kept in the record
CANDIDATE = "sidecar"
DONE = "FK-SIDECAR-DONE"  # the child's line after each job (stdout also carries its prints)
# distributions whose versions, as the child imports them, go into the comparator's record
VERSIONS = ("torch", "triton", "fla-core", "flash-qla", "tilelang", "apache-tvm-ffi")


class SidecarMissing(Exception):
    """The sidecar could not be timed; the message is the record's missing reason."""


@dataclass(frozen=True)
class Sidecar:
    """A comparator timed by `python -m forgekernel.bench.sidecar` in a process of its own.

    label: what it is, for messages ("FlashQLA 0.1.3"). runner: "module:factory", the factory
    returning fn(inputs) -> output(s), or None where its packages do not import. site_env: the
    variable naming its site directory. keys: the input names the runner reads. drop:
    PYTHONPATH entries the child leaves out, with what lies under them (MAIN_SITE where its
    packages would shadow the site's). timer: the module whose time_interleaved and
    time_eager_flushed the child times with (a CPU test's fake; never changed otherwise).
    """

    label: str
    runner: str
    site_env: str
    keys: tuple[str, ...]
    drop: tuple[str, ...] = ()
    timer: str = "forgekernel.runtime.timing"

    def unavailable(self, environ: Mapping[str, str] = os.environ) -> str | None:
        """Why this sidecar cannot run here (None: it can be tried)."""
        site = environ.get(self.site_env)
        if not site:
            return (f"{self.label} runs in a sidecar process: {self.site_env} is not set "
                    "(its wheels: scripts/side_wheels.sh; docs/linear_attention/NOTES.md, "
                    "'Sidecar comparators')")  # fmt: skip
        if not Path(site).is_dir():
            return f"{self.label}: {self.site_env}={site} is not a directory"
        return None

    def __call__(self, inputs: Any) -> Any:
        raise NotImplementedError(
            f"{self.label} is timed by the bench in a sidecar process, not called in this one"
        )


def child_env(side: Sidecar, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """The child's environment: PYTHONPATH = the site, this tree, then the parent's entries
    except `side.drop` and what lies under them; the rest as the parent's, so the child reads the
    caches scripts/comparator_caches.sh restored (TILELANG_CACHE_DIR, TRITON_CACHE_AUTOTUNING,
    exported by scripts/device_setup.sh)."""
    drop = [os.path.normpath(d) for d in side.drop]

    def kept(entry: str) -> bool:
        entry = os.path.normpath(entry)
        return not any(entry == d or entry.startswith(d + os.sep) for d in drop)

    head = [os.path.normpath(environ[side.site_env]), str(REPO_ROOT)]
    rest = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) if p and kept(p)]
    paths = head + [p for p in dict.fromkeys(map(os.path.normpath, rest)) if p not in head]
    return {**environ, "PYTHONPATH": os.pathsep.join(paths)}


def _scratch(nbytes: int) -> str | None:
    """Where the job folder goes: FK_SIDECAR_TMP, else /dev/shm with room for the inputs and
    the outputs twice over, else the default temporary folder."""
    if os.environ.get(SCRATCH_ENV):
        return os.environ[SCRATCH_ENV]
    shm = Path("/dev/shm")
    if shm.is_dir() and os.access(shm, os.W_OK) and shutil.disk_usage(shm).free > 4 * nbytes:
        return str(shm)
    return None


def _tail(text: str) -> str:
    text = text.strip()
    return text if len(text) <= STDERR_TAIL else "..." + text[-STDERR_TAIL:]


def _job(side: Sidecar, sets: int, timing: Any, device: torch.device) -> dict[str, Any]:
    return {
        "runner": side.runner,
        "timer": side.timer,
        "device": str(device),
        "sets": sets,
        "methods": list(timing.methods),
        "warmup": timing.warmup,
        "reps": timing.reps,
        "eager_reps": timing.eager_reps,
    }


def _samples(side: Sidecar, entry: dict[str, Any]) -> Samples:
    note = f"timed in a sidecar process ({side.site_env}) after ours, not interleaved"
    if entry.get("note"):
        note += f"; {entry['note']}"
    return Samples(entry["samples"], method=entry["method"], launches=entry["launches"],
                   note=note)  # fmt: skip


class _Child:
    """One sidecar's child process, serving jobs one at a time (`serve`) for as long as the
    parent's suite runs: the imports, the CUDA context and the comparator's in-memory caches are
    paid once per suite, not once per case. stderr goes to a temporary file (its tail is a failed
    job's reason); stdout carries the DONE lines among whatever the comparator prints."""

    def __init__(self, side: Sidecar, environ: Mapping[str, str]):
        self.err = tempfile.TemporaryFile()
        cmd = [sys.executable, "-m", "forgekernel.bench.sidecar"]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self.err, env=child_env(side, environ))  # fmt: skip
        self.pending = b""

    def ask(self, job: Path, timeout: float) -> None:
        """Hand the child `job` and wait for its DONE line; TimeoutError past `timeout` s,
        EOFError when the child exits first."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(f"{job}\n".encode())
        self.proc.stdin.flush()
        done, deadline = f"{DONE} {job}".encode(), time.monotonic() + timeout
        out = self.proc.stdout.fileno()
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError
            if not select.select([out], [], [], left)[0]:
                continue
            chunk = os.read(out, 1 << 16)
            if not chunk:
                raise EOFError
            *lines, self.pending = (self.pending + chunk).split(b"\n")
            if any(line.strip() == done for line in lines):
                return

    def stderr_tail(self) -> str:
        self.err.seek(0)
        return _tail(self.err.read().decode(errors="replace"))

    def close(self) -> None:
        with contextlib.suppress(OSError):
            if self.proc.stdin is not None:
                self.proc.stdin.close()  # the child's loop ends
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.err.close()


_children: dict[tuple, _Child] = {}


def _child_key(side: Sidecar, environ: Mapping[str, str]) -> tuple:
    return (side.site_env, environ.get(side.site_env), side.drop, side.timer)


def close_all() -> None:
    """End every sidecar child (the harness: after each suite, before its device check, which
    would count a live child as another process on the GPU)."""
    while _children:
        _children.popitem()[1].close()


atexit.register(close_all)


def _ask(side: Sidecar, job: Path, environ: Mapping[str, str]) -> None:
    """Run `job` in the sidecar's child (started on first use); SidecarMissing with the reason
    (the child's stderr tail) if it fails, after which the child is ended: a fault may have left
    its CUDA context unusable, the next job gets a fresh one."""
    key = _child_key(side, environ)
    child = _children.get(key)
    if child is None or child.proc.poll() is not None:
        child = _children[key] = _Child(side, environ)
    timeout = float(environ.get(TIMEOUT_ENV) or TIMEOUT_S)
    try:
        child.ask(job, timeout)
        if (job / RESULT).is_file():
            return
        why = f"no result: {child.stderr_tail()}"
    except TimeoutError:
        why = f"ran past {timeout:.0f} s ({TIMEOUT_ENV}): {child.stderr_tail()}"
    except (EOFError, OSError):
        child.proc.wait()
        why = f"exited with {child.proc.returncode}: {child.stderr_tail()}"
    child.proc.kill()
    child.close()
    _children.pop(key, None)
    raise SidecarMissing(f"{side.label}: the sidecar {why}")


def run(
    side: Sidecar,
    inputs: Mapping[str, Any],
    *,
    sets: int,
    timing: Any,
    device: torch.device,
    environ: Mapping[str, str] = os.environ,
) -> tuple[dict[str, Samples], tuple, dict[str, str]]:
    """Time `side` in its child on `inputs` with each of `timing.methods` (a BenchTiming);
    -> ({method: Samples}, the child's first-call outputs on `device`, the VERSIONS the child
    has). SidecarMissing with the reason when it cannot be timed."""
    reason = side.unavailable(environ)
    if reason:
        raise SidecarMissing(reason)
    saved = {k: inputs[k] for k in side.keys}
    nbytes = sum(t.numel() * t.element_size() for t in saved.values() if torch.is_tensor(t))
    job = Path(tempfile.mkdtemp(prefix="fk-sidecar-", dir=_scratch(nbytes)))
    try:
        torch.save(saved, job / INPUTS)
        (job / JOB).write_text(json.dumps(_job(side, sets, timing, device)))
        _ask(side, job, environ)
        result = json.loads((job / RESULT).read_text())
        if "missing" in result:
            raise SidecarMissing(f"{side.label}: {result['missing']}")
        outs = torch.load(job / OUTPUTS, map_location=device, weights_only=True)
        samples = {m: _samples(side, e) for m, e in result["methods"].items()}
        return samples, tuple(outs), result.get("versions", {})
    finally:
        shutil.rmtree(job, ignore_errors=True)


def _max_abs(x: torch.Tensor, y: torch.Tensor | None = None, piece: int = 1 << 26) -> float:
    """max |x| (or max |y - x|) in fp32, piece by piece: a backward's outputs run to GBs."""
    x = x.reshape(-1)
    y = y.reshape(-1).to(x.device) if y is not None else None
    most = 0.0
    for i in range(0, x.numel(), piece):
        xs = x[i : i + piece].float()
        d = xs if y is None else y[i : i + piece].float() - xs
        most = max(most, float(d.abs().max()))
    return most


def agreement(ours: Sequence[Any], theirs: Sequence[Any]) -> list[float | None]:
    """Per output, max |theirs - ours| / max |ours| (None where one is missing or the shapes
    differ): not a verdict, a check that the comparator computed the same thing."""
    out: list[float | None] = []
    for a, b in zip(ours, theirs):
        if not (torch.is_tensor(a) and torch.is_tensor(b)) or a.shape != b.shape:
            out.append(None)
        elif a.numel() == 0:
            out.append(0.0)
        else:
            out.append(_max_abs(a, b) / max(_max_abs(a), 1e-30))
    return out


# ---- the child ---------------------------------------------------------------------------


_runners: dict[str, Any] = {}  # the child's: runner spec -> what its factory returned


def runner(spec: str) -> Any:
    """The runner's callable (None: its packages are missing), made once per child (or per
    process: scripts/profile_suite.py --sidecar-here)."""
    if spec not in _runners:
        module, _, name = spec.partition(":")
        _runners[spec] = getattr(importlib.import_module(module), name)()
    return _runners[spec]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def installed_versions(names: Sequence[str] = VERSIONS) -> dict[str, str]:
    """{distribution: version} of those of `names` installed here (the child's record;
    ledger.comparator_versions in the parent)."""
    found = {}
    for name in names:
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            found[name] = importlib.metadata.version(name)
    return found


def _write(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data))


def _clone(inputs: dict[str, Any], keys: Sequence[str]) -> dict[str, Any]:
    """The loaded inputs in memory of their own (not what a comparator cached in the set)."""
    return {k: inputs[k].clone() if torch.is_tensor(inputs[k]) else inputs[k] for k in keys}


def _timed(job: dict[str, Any], comp: Callable[[Any], Any], inputs: dict[str, Any]) -> dict:
    """Per method: the samples of comp, the loaded inputs the first set, clones of them the
    others, timed by `methods.time_method` as the harness times a case."""
    timer = importlib.import_module(job["timer"])
    timers = (timer.time_interleaved, timer.time_eager_flushed)
    fns = {CANDIDATE: lambda inp, _out: comp(inp)}
    result = {}
    for method in job["methods"]:
        n = job["sets"] if method == "graph" else 1
        sets = [(inputs, None)] + [(_clone(inputs, job["keys"]), None) for _ in range(n - 1)]
        s = time_method(method, fns, sets, warmup=job["warmup"], reps=job["reps"],
                        eager_reps=job["eager_reps"], timers=timers)[CANDIDATE]  # fmt: skip
        result[method] = {"samples": list(s), "method": s.method, "launches": s.launches,
                          "note": s.note}  # fmt: skip
        del sets
    return result


def child(job_dir: Path) -> None:
    """The sidecar process: time the job's runner on its saved inputs (module docstring)."""
    job = json.loads((job_dir / JOB).read_text())
    device = torch.device(job["device"])
    if device.type == "cuda":
        torch.cuda.set_device(device)
    inputs = torch.load(job_dir / INPUTS, map_location=device, weights_only=True)
    job["keys"] = list(inputs)  # what a clone copies: not what the comparator caches in a set
    comp = runner(job["runner"])
    if comp is None:
        path = os.environ.get("PYTHONPATH", "")
        _write(job_dir / RESULT, {"missing": f"{job['runner']} found no packages in the "
                                             f"sidecar (PYTHONPATH={path})"})  # fmt: skip
        return
    try:
        outs = comp(inputs)
        _sync(device)
    except Exception as e:  # reported as an in-process comparator's raise
        _sync(device)  # after a fault this raises again and ends the child: its context is lost
        _write(job_dir / RESULT, {"missing": f"raised {type(e).__name__}: {e}"[:500]})
        return
    outs = outs if isinstance(outs, (tuple, list)) else (outs,)
    torch.save(tuple(t.detach() if torch.is_tensor(t) else t for t in outs), job_dir / OUTPUTS)
    result = {"methods": _timed(job, comp, inputs), "versions": installed_versions()}
    _write(job_dir / RESULT, result)


def serve() -> None:
    """The child's loop: one job folder a line on stdin, DONE and the folder on stdout when its
    result is written; an exception ends the process (its traceback on stderr)."""
    for line in sys.stdin:
        job = Path(line.strip())
        child(job)
        gc.collect()  # this job's inputs and sets, before the parent times its next case
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        print(f"{DONE} {job}", flush=True)


if __name__ == "__main__":
    serve()
