"""Sidecar comparators (bench/sidecar.py) through the real child process on the CPU: the child's
timer is a fake module in the sidecar's site (timing needs CUDA), everything else is real: the
inputs saved and loaded bit-identically, the site first on the child's PYTHONPATH and the
dropped entries gone, an unset site or a failing child reported missing with the reason, the
child's samples recorded in the case's comparator slot like an in-process comparator's, and the
child's import path free of the CuTe DSL."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from forgekernel.bench import harness, report, sidecar
from forgekernel.bench.harness import BenchTiming
from forgekernel.bench.sidecar import MAIN_SITE, REPO_ROOT, Sidecar, SidecarMissing
from forgekernel.bench.suite import Case
from forgekernel.bench.suites import gdn_bwd, gdn_prefill, kda_bwd
from forgekernel.runtime.timing import Samples

ENV = "FK_SIDE_SITE_TEST"
EAGER_BASE = 100.0  # the fake timer: graph ms = input sets, eager ms = this + 1

FAKE_TIMER = f"""
from forgekernel.runtime.timing import Samples


def _time(fns, rotate, reps, method, base):
    for args in rotate:  # every set, as the real timer's warm-up
        for fn in fns.values():
            fn(*args)
    return {{k: Samples([base + len(rotate)] * reps, method=method, launches=len(rotate),
                        note="fake timer") for k in fns}}


def time_interleaved(fns, *, rotate, warmup, reps):
    return _time(fns, rotate, reps, "cuda-graph", 0.0)


def time_eager_flushed(fns, *, rotate, warmup, reps):
    return _time(fns, rotate, reps, "eager-flushed", {EAGER_BASE})
"""

FAKE_COMPARATORS = """
import torch

import fk_probe


def matmul():
    return lambda inputs: inputs["a"] @ inputs["b"].T


def echo():
    return lambda inputs: tuple(inputs[k] for k in ("x", "y", "z"))


def where():
    try:
        import fk_main_only  # noqa: F401

        main = 1.0
    except ImportError:
        main = 0.0
    return lambda inputs: torch.tensor([float(fk_probe.WHERE == "side"), main])


def absent():
    return None


def boom():
    def run(inputs):
        raise RuntimeError("kaboom in the child")

    return run


def dies():
    def run(inputs):
        import os
        import sys

        print("dying words", file=sys.stderr, flush=True)
        os._exit(3)

    return run
"""


@pytest.fixture
def site(tmp_path, monkeypatch) -> Path:
    """A sidecar site (the fake timer, the fake comparators, fk_probe saying "side") named by
    FK_SIDE_SITE_TEST; first on the parent's PYTHONPATH a "main" site holding fk_main_only,
    then an "other" one holding fk_probe saying "other"."""
    side, main, other = tmp_path / "side", tmp_path / "main", tmp_path / "other"
    for folder in (side, main, other):
        folder.mkdir()
    (side / "fk_fake_timer.py").write_text(FAKE_TIMER)
    (side / "fk_side_cmp.py").write_text(FAKE_COMPARATORS)
    (side / "fk_probe.py").write_text('WHERE = "side"\n')
    (other / "fk_probe.py").write_text('WHERE = "other"\n')
    (main / "fk_main_only.py").write_text("")
    path = [str(main), str(other), os.environ.get("PYTHONPATH", "")]
    monkeypatch.setenv(ENV, str(side))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(path))
    monkeypatch.setenv(sidecar.SCRATCH_ENV, str(tmp_path))
    return side


@pytest.fixture(autouse=True)
def _no_child_left():
    yield
    sidecar.close_all()


def _side(runner: str, keys=("a", "b"), **kw) -> Sidecar:
    return Sidecar("Fake", f"fk_side_cmp:{runner}", kw.pop("site_env", ENV), keys,
                   timer="fk_fake_timer", **kw)  # fmt: skip


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_inputs_reach_the_child_bit_identical_and_samples_come_back(site, tmp_path):
    """bf16 with NaN, -0.0, inf and fp32 subnormals go through torch.save / load and back
    through the child's outputs bit for bit; graph samples over `sets` clones, eager over one;
    the job folder is removed."""
    x = torch.randn(5, 7, dtype=torch.bfloat16)
    x[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), -float("inf")])
    y = torch.randn(1000) * 1e-40  # fp32 subnormals
    z = torch.arange(-3, 4, dtype=torch.int32)
    inputs = {"x": x, "y": y, "z": z, "not_sent": object()}
    samples, outs, versions = sidecar.run(_side("echo", ("x", "y", "z")), inputs, sets=3,
                                timing=BenchTiming(reps=4), device=torch.device("cpu"))  # fmt: skip
    for got, want in zip(outs, (x, y, z), strict=True):
        assert got.dtype == want.dtype and torch.equal(_bits(got), _bits(want))
    graph, eager = samples["graph"], samples["eager"]
    assert list(graph) == [3.0] * 4 and graph.method == "cuda-graph" and graph.launches == 3
    assert list(eager) == [EAGER_BASE + 1] * BenchTiming().eager_reps
    assert eager.note.startswith("timed in a sidecar process (FK_SIDE_SITE_TEST) after ours")
    assert not list(tmp_path.glob("fk-sidecar-*"))
    assert versions["torch"] == torch.__version__
    (child,) = sidecar._children.values()  # kept for the suite's next case
    again, _, _ = sidecar.run(_side("echo", ("x", "y", "z")), inputs, sets=2,
                           timing=BenchTiming(reps=4), device=torch.device("cpu"))  # fmt: skip
    assert list(again["graph"]) == [2.0] * 4 and list(sidecar._children.values()) == [child]
    first_call = SimpleNamespace(methods=(), warmup=0, reps=0, eager_reps=0)  # warm_comparators
    none, (x2, _, _), _ = sidecar.run(_side("echo", ("x", "y", "z")), inputs, sets=1,
                                   timing=first_call, device=torch.device("cpu"))  # fmt: skip
    assert none == {} and torch.equal(_bits(x2), _bits(x))
    sidecar.close_all()
    assert child.proc.returncode == 0 and not sidecar._children


def test_child_env_puts_the_site_first_and_drops_the_main_set():
    environ = {ENV: "/root/side-sites/qla", "PYTHONPATH": os.pathsep.join([
        "/root/wheels-site", "/root/wheels-site/nvidia_cutlass_dsl/dsl_packages",
        str(REPO_ROOT), "/opt/other", "/root/wheels-site-old"])}  # fmt: skip
    dropped = sidecar.child_env(_side("matmul", drop=(MAIN_SITE,)), environ)["PYTHONPATH"]
    want = ["/root/side-sites/qla", str(REPO_ROOT), "/opt/other", "/root/wheels-site-old"]
    assert dropped.split(os.pathsep) == want
    kept = sidecar.child_env(_side("matmul"), environ)["PYTHONPATH"].split(os.pathsep)
    assert kept[:3] == ["/root/side-sites/qla", str(REPO_ROOT), "/root/wheels-site"]


def test_the_site_shadows_the_parents_path_and_a_dropped_entry_is_gone(site):
    """fk_probe comes from the site although "other", still on the path, holds one; "main",
    dropped, is not on the child's path; a runner that finds no packages is missing."""
    cpu, timing = torch.device("cpu"), BenchTiming(methods=("eager",), eager_reps=2)
    main = os.environ["PYTHONPATH"].split(os.pathsep)[0]
    side = _side("where", (), drop=(main,))
    _, (where,), _ = sidecar.run(side, {}, sets=1, timing=timing, device=cpu)
    assert where.tolist() == [1.0, 0.0]


def test_a_runner_without_its_packages_is_reported_missing(site, tmp_path, monkeypatch):
    """The child itself, in this process: a factory returning None writes the missing reason."""
    monkeypatch.syspath_prepend(str(site))
    job = tmp_path / "job"
    job.mkdir()
    torch.save({}, job / sidecar.INPUTS)
    spec = sidecar._job(_side("absent"), 1, BenchTiming(), torch.device("cpu"))
    (job / sidecar.JOB).write_text(json.dumps(spec))
    sidecar.child(job)
    missing = json.loads((job / sidecar.RESULT).read_text())["missing"]
    assert missing.startswith("fk_side_cmp:absent found no packages in the sidecar")


def test_an_unset_site_is_missing_with_the_reason(monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    with pytest.raises(SidecarMissing, match=f"{ENV} is not set"):
        sidecar.run(_side("matmul"), {}, sets=1, timing=BenchTiming(), device="cpu")
    assert "not a directory" in _side("matmul").unavailable({ENV: "/no/such/site"})
    with pytest.raises(NotImplementedError, match="timed by the bench in a sidecar process"):
        _side("matmul")({})


def test_a_child_past_its_time_is_ended_and_reported(site, monkeypatch):
    class Stuck:  # a child that never answers
        def __init__(self, side, environ):
            self.proc = subprocess.Popen(["sleep", "60"])

        def ask(self, job, timeout):
            raise TimeoutError

        def stderr_tail(self):
            return "still compiling"

        def close(self):
            self.proc.wait()

    monkeypatch.setattr(sidecar, "_Child", Stuck)
    monkeypatch.setenv(sidecar.TIMEOUT_ENV, "42")
    with pytest.raises(SidecarMissing, match=r"ran past 42 s \(FK_SIDECAR_TIMEOUT\): still comp"):
        sidecar.run(_side("matmul"), {"a": torch.ones(1), "b": torch.ones(1)}, sets=1,
                    timing=BenchTiming(), device=torch.device("cpu"))  # fmt: skip
    assert not sidecar._children


def _fake_parent_timer(monkeypatch) -> list:
    """The parent's timers replaced (CPU): ours 1 ms graph, 2 ms eager; the candidates named."""
    seen = []

    def fake(ms):
        def timer(fns, *, rotate, warmup, reps):
            seen.append(list(fns))
            for args in rotate:
                for fn in fns.values():
                    fn(*args)
            return {k: Samples([ms] * 3, method="fake", launches=1,
                               rerun=lambda fn=fn: [fn(*a) for a in rotate])
                    for k, fn in fns.items()}  # fmt: skip

        return timer

    monkeypatch.setattr(harness, "time_interleaved", fake(1.0))
    monkeypatch.setattr(harness, "time_eager_flushed", fake(2.0))
    monkeypatch.setattr(harness, "l2_bytes", lambda: 1000)
    return seen


def test_bench_records_a_sidecar_like_an_in_process_comparator(
    site, monkeypatch, sources, fake_suite
):
    seen = _fake_parent_timer(monkeypatch)
    sides = {"qla": _side("matmul"), "bad": _side("boom"), "dead": _side("dies"),
             "unset": _side("matmul", site_env="FK_SIDE_SITE_UNSET_TEST")}  # fmt: skip
    suite = fake_suite(sources, comparators=lambda: sides)
    comps, missing = harness.resolve_comparators(suite)
    assert set(comps) == {"qla", "bad", "dead"}
    assert "FK_SIDE_SITE_UNSET_TEST is not set" in missing["unset"]
    case, dtype = Case("7x24x40", {"m": 7, "n": 24, "k": 40}), torch.bfloat16
    rec = harness.bench_case(suite, case, dtype, comps=comps, missing=missing, seed=0,
                             device=torch.device("cpu"), timing=BenchTiming(reps=3))  # fmt: skip
    rec = json.loads(json.dumps(rec))  # what the ledger and the reports read
    assert rec["status"] == "ok" and all(names == ["ours"] for names in seen)
    sets = harness._set_count(suite, case, dtype)
    graph, eager = rec["comparators"]["qla"], rec["eager"]["comparators"]["qla"]
    assert graph["ms"] == sets and graph["ratio"] == pytest.approx(sets / 1.0)
    assert eager["ms"] == EAGER_BASE + 1 and eager["ratio"] == pytest.approx(101 / 2.0)
    assert graph["launches"] == sets and graph["method"] == "cuda-graph"
    assert graph["vs_ours"][0] < 2e-2  # the bf16 matmul against ours (fp32, rounded once)
    assert "torch" in graph["versions"] and "flash-qla" not in graph["versions"]
    for view in (rec, rec["eager"]):  # a raise leaves the child serving; an exit is its end
        assert view["comparators"]["bad"]["missing"] == (
            "Fake: raised RuntimeError: kaboom in the child")  # fmt: skip
        dead = view["comparators"]["dead"]["missing"]
        assert dead.startswith("Fake: the sidecar exited with 3: ") and "dying words" in dead
        assert "is not set" in view["comparators"]["unset"]["missing"]
    summary = report.summarize([rec])
    assert summary["qla"]["median_ratio"] == pytest.approx(sets)
    assert summary["bad"]["median_ratio"] is None and summary["bad"]["missing_reasons"]


BLOCKED = """
import runpy, sys

tried = []


class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("cutlass", "tvm_ffi"):
            tried.append(name)
            raise ImportError(f"blocked: {name}")


sys.meta_path.insert(0, Block())
from forgekernel.bench.suites import gdn_bwd, gdn_prefill, kda_bwd

runners = [gdn_prefill.flashqla_forward, gdn_bwd.flashqla_backward, gdn_bwd.fla_backward,
           kda_bwd.fla_backward]
print("runners", [r() is None for r in runners])
runpy.run_module("forgekernel.bench.sidecar", run_name="__main__", alter_sys=True)
loaded = [m for m in sys.modules if m.split(".")[0] in ("cutlass", "tvm_ffi")]
print("tried", tried, "loaded", loaded)
"""


def test_the_child_runs_with_the_dsl_unimportable(site, tmp_path):
    """The child entry and the suites' sidecar runners import with cutlass and tvm_ffi
    unimportable (FlashQLA's site brings a tvm-ffi the DSL must not meet), and nothing asks."""
    job = tmp_path / "job"
    job.mkdir()
    torch.save({"x": torch.ones(2), "y": torch.zeros(1), "z": torch.ones(1)}, job / sidecar.INPUTS)
    spec = sidecar._job(_side("echo"), 2, BenchTiming(reps=2), torch.device("cpu"))
    (job / sidecar.JOB).write_text(json.dumps(spec))
    env = sidecar.child_env(_side("echo"))
    done = subprocess.run([sys.executable, "-c", BLOCKED], env=env, text=True, input=f"{job}\n",
                          capture_output=True, timeout=120)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    assert f"{sidecar.DONE} {job}" in done.stdout
    assert "runners [True, True, True, True]" in done.stdout  # no flash_qla, no fla here
    assert "tried [] loaded []" in done.stdout
    result = json.loads((job / sidecar.RESULT).read_text())
    assert result["methods"]["graph"]["samples"] == [2.0, 2.0]


def test_the_suites_sidecars(monkeypatch):
    """FlashQLA in its sidecar without the main wheel set; fla's backwards in the triton
    sidecar only where its site is set (else in this process); the keys the children are sent
    are inputs the suites make."""
    keys = set(gdn_bwd.make_inputs(gdn_bwd.CHECK_CASES[0], torch.bfloat16, torch.device("cpu"),
                                   torch.Generator().manual_seed(0)))  # fmt: skip
    qla = gdn_prefill._flashqla()
    assert qla.site_env == "FK_SIDE_SITE_FLASHQLA" and qla.drop == (MAIN_SITE,)
    assert set(qla.keys) <= keys and set(gdn_bwd.INPUT_KEYS) <= keys
    assert qla.runner == "forgekernel.bench.suites.gdn_prefill:flashqla_forward"
    monkeypatch.delenv(gdn_bwd.TRITON_SITE_ENV, raising=False)
    assert gdn_bwd._fla() is None and kda_bwd._fla() is None  # no fla here: missing
    monkeypatch.setenv(gdn_bwd.TRITON_SITE_ENV, "/root/side-sites/tri")
    for mod in (gdn_bwd, kda_bwd):
        side = mod._fla()
        assert isinstance(side, Sidecar) and side.drop == () and side.keys == gdn_bwd.INPUT_KEYS
        assert side.runner == f"{mod.__name__}:fla_backward"
