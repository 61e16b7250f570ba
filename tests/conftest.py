"""Fakes shared by the CPU tests (an OpSuite whose 'kernel' is plain torch on the CPU), and the
`gpu` marker's skip: tests marked `gpu` need an sm90 GPU (H100 / H200) and are skipped elsewhere,
so CI on a CPU passes; on the H200 `python -m pytest -m gpu` runs them. Without one, tests/gpu/
(every test there is `gpu`) is not even collected."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from forgekernel.bench.suite import Case, OpSuite

CASES = (Case("1x8x8", {"m": 1, "n": 8, "k": 8}), Case("7x24x40", {"m": 7, "n": 24, "k": 40}))


def _inputs(case, dtype, device, gen):
    p = case.params
    a = torch.randn(p["m"], p["k"], dtype=dtype, device=device, generator=gen)
    b = torch.randn(p["n"], p["k"], dtype=dtype, device=device, generator=gen)
    return {"a": a, "b": b}


def _alloc(inputs):
    return inputs["a"].new_empty(inputs["a"].shape[0], inputs["b"].shape[0])


def good_kernel(inputs, out):
    """Accumulate in fp32, round once: what a correct kernel does."""
    return out.copy_(inputs["a"].float() @ inputs["b"].float().T)


def make_suite(
    sources: list[Path], name: str = "fake", run_ours: Callable = good_kernel, **kw
) -> OpSuite:
    return OpSuite(
        name=name,
        kernel_sources=sources,
        dtypes=kw.pop("dtypes", (torch.bfloat16, torch.float16)),
        check_cases=kw.pop("check_cases", CASES),
        bench_cases=kw.pop("bench_cases", CASES),
        make_inputs=_inputs,
        alloc_out=_alloc,
        run_ours=run_ours,
        reference=lambda i: i["a"].float() @ i["b"].float().T,
        low_precision=lambda i: i["a"] @ i["b"].T,
        comparators=kw.pop("comparators", lambda: {}),
        flops=lambda c: 2.0 * c.params["m"] * c.params["n"] * c.params["k"],
        bytes=lambda c, d: 2.0 * (c.params["m"] + c.params["n"]) * c.params["k"],
        **kw,
    )


@pytest.fixture
def sources(tmp_path: Path) -> list[Path]:
    """Two stand-in kernel source files."""
    paths = [tmp_path / "src" / "kernel.py", tmp_path / "src" / "config.py"]
    paths[0].parent.mkdir()
    paths[0].write_text("KERNEL = 1\n")
    paths[1].write_text("TILE = 128\n")
    return paths


@pytest.fixture
def fake_suite() -> Callable[..., OpSuite]:
    """Factory: fake_suite(sources, name=..., run_ours=..., **OpSuite fields)."""
    return make_suite


@pytest.fixture
def conv_models(monkeypatch):
    """The conv launcher's compiled functions replaced by the CPU models (CTAs in a fresh
    random order each launch); yields the list of every key asked for, (spec name, params); the
    plan caches cleared before and after."""
    from forgekernel.kernels.conv.sm90 import emulate, launch

    keys = []
    seeds = iter(range(10_000))

    def stand_in(spec, params):
        keys.append((spec.name, dict(params)))
        return emulate.stand_in(spec, params, next(seeds))

    monkeypatch.setattr(launch, "get_kernel", stand_in)
    launch.clear_plans()
    yield keys
    launch.clear_plans()


@pytest.fixture
def conv_wgrad_models(monkeypatch):
    """Factory: conv_wgrad_models(record) replaces the conv leaf's compiled functions by their
    CPU models (the weight gradient's running its CTAs in a random order, seeded by its launch
    count) and returns the list that gets record(params, dy, work, flags, per_split) of each
    weight-gradient launch; the plan cache and the scratch are cleared before and after."""
    from forgekernel.kernels.conv.sm90 import emulate, launch
    from forgekernel.runtime import scratch

    def install(record):
        launches = []

        def get_kernel(spec, params):
            fn = emulate.stand_in(spec, params)
            if spec.name != "conv_wgrad_sm90":
                return fn
            model = emulate.compiled_wgrad(params, order_seed=len(launches))

            def recorded(dy, x, dw, work, flags, *args):
                launches.append(record(params, dy, work, flags, args[-1]))
                return model(dy, x, dw, work, flags, *args)

            return recorded

        launch._wgrad_plans.clear()
        scratch.release()
        monkeypatch.setattr(launch, "get_kernel", get_kernel)
        return launches

    yield install
    launch._wgrad_plans.clear()
    scratch.release()


def pytest_configure(config: pytest.Config) -> None:
    """One torch thread on a machine without a GPU (CI: 2 cores, shared with other work). The CPU
    tests run thousands of small ops (fp64 recurrences token by token, kernel replays tile by
    tile) on which torch's second intra-op thread synchronizes every op: with any other load on
    the cores the waiting threads take turns with the working ones. Measured on the 2-core
    machine, back to back: the GDN / KDA test files 838 s with 2 threads, 143 s with one (user
    393 s / 93 s) under the usual load; test_kda_bwd_op + test_kda_bwd_suite 185 s / 24 s beside
    busy processes, 6.6 s / 7.4 s on an idle machine (the one case where 2 threads win)."""
    if not torch.cuda.is_available():
        torch.set_num_threads(1)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False  # RUN_FIRST's order, not xdist's by test count


def sm90_missing() -> str | None:
    """Why the gpu tests cannot run here, or None when an sm90 device is present."""
    if not torch.cuda.is_available():
        return "needs an sm90 GPU: no CUDA device"
    major, minor = torch.cuda.get_device_capability()
    if (major, minor) != (9, 0):
        return f"needs an sm90 GPU: the device is sm_{major}{minor}"
    return None


def pytest_ignore_collect(collection_path: Path, config: pytest.Config) -> bool | None:
    """tests/gpu/ without an sm90 GPU: not collected. Its ~5,300 tests would only be skipped,
    after ~5 s of collection a worker and their setup (CI, 2026-12-07: 26.5 s to collect the
    suite, 21.4 s without tests/gpu; the CPU-side checks of those files are
    tests/test_gpu_tests_static.py's, which loads them itself)."""
    if collection_path == _GPU_TESTS and sm90_missing() is not None:
        return True
    return None


_GPU_TESTS = Path(__file__).parent / "gpu"


# The longest test files on CI's CPU, longest first (sm_90a compiles; seconds each on the 2-core
# machine, both workers busy, 2026-12-04). xdist's loadfile hands out files in the collection's
# order (its own reorder, by test count, is turned off in pytest_configure: it put these few-test
# files last, one worker left alone with a 40 s file at the end: 22 s idle in one measured run).
RUN_FIRST = (
    # SHARED_COMPILES' MLA files, one scope with test_paged_spec.py (about 115 s of a worker,
    # 2026-12-04; test_paged_spec ~7 s more): placed first, they are the first worker's first work
    "test_mla_schedule.py",
    "test_mla_worklist.py",
    "test_mla_seesaw_compile.py",
    "test_pdl.py",
    "test_paged_schedule.py",
    "test_attention_build.py",  # 89 (2026-12-05 18:37, next/integration34, idle machine)
    "test_conv_compile.py",  # 60
    "test_build_sm90.py",  # 59, two compile processes of its own
    "test_gemm_fp8_mainloop.py",  # 54
    "test_dsa_fused_prefill_compile.py",  # 49
    "test_dsa_sparse_bwd_kernel_compile.py",  # ~48 (65 before its h64 builds compiled once)
    "test_dsa_fp8_lean.py",  # 46
    "test_dsa_sparse.py",  # 30, test_dsa_fp8_lean's scope (SHARED_COMPILES)
    "test_mla_ostore.py",  # 39
    "test_gdn_bwd_chunk_compile.py",  # 29
    "test_conv_tall.py",  # ~25 (125 before its thread sample)
    "test_paged_spec.py",  # 25
    "test_mla_worklist.py",  # 20
    "test_mla_gather_compile.py",  # 19
    "test_mla_seesaw_compile.py",  # 18
    "test_gemm_stream_k_clusters.py",  # 14
    "test_gdn_prefill_compile.py",  # 13
    "test_kda_prefill_compile.py",  # 13
    "test_kda_intra_loop_compile.py",  # 13
    "test_mla_pair.py",  # 10
    "test_attention_paged.py",  # 10
)


# Test files that read the SASS of the same builds through tests/cubins.py `build` (one compile a
# process), each group one scope: the MLA pass's standard build (seesaw, schedule and PDL tests),
# its ranges build (schedule and PDL tests: the schedule compares it with the standard one; the
# candidate work-list pass, compiled for the work-list tests' compare alone, is slow), the paged
# pass (PDL, paged schedule and paged spec tests: test_paged_spec's early-ids build, ~2.4 s of CI's
# CPU); about 17 s a MLA compile on CI's CPU. The DSA decode's sparse keys: test_dsa_sparse's
# direct-form compares and test_dsa_fp8_lean's lean / wide ones share three (the FP8 16-head sparse
# pass, direct and not, and the 16-bit 64-head direct one: ~9 s; under -m slow: since 2026-12-07
# CI's run compiles only test_dsa_fp8_lean's 16-head lean compare of them). The FP8 GEMM's:
# test_gemm_fp8_tiles' twins of the tiled pick (LARGE with its scale warp, and LARGE's one-warp
# form) and of the 64x48 narrow pick are test_gemm_fp8_mainloop's scale-warp and schedule builds
# (~5 s of CI's CPU, 2026-12-07; under -m slow since the twins moved there). And the
# MLA pass's P V coordinates (tests/mla_seesaw_probe.py `output_coords`: one ~5 s host trace a
# process) that test_mla_seesaw's direct epilogue and test_mla_ostore's replays read. xdist's
# loadfile keeps a file on one worker, not files: a group is one scope
# (`pytest_xdist_make_scheduler`), so each of those builds compiles once in a run.
SHARED_COMPILES = {
    "test_mla_seesaw_compile.py": "mla",
    "test_mla_worklist.py": "mla",
    "test_mla_schedule.py": "mla",
    "test_pdl.py": "mla",
    "test_paged_schedule.py": "mla",
    "test_paged_spec.py": "mla",
    "test_dsa_fp8_lean.py": "dsa_sparse",
    "test_dsa_sparse.py": "dsa_sparse",
    "test_gemm_fp8_mainloop.py": "gemm_fp8",
    "test_gemm_fp8_tiles.py": "gemm_fp8",
    "test_mla_ostore.py": "mla_probe",
    "test_mla_seesaw.py": "mla_probe",
}


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """`--dist loadfile` with each SHARED_COMPILES group's files as one scope (one worker);
    other modes as xdist has them."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class SharedCompiles(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            group = SHARED_COMPILES.get(Path(scope).name)
            return f"SHARED_COMPILES:{group}" if group else scope

    return SharedCompiles(config, log)


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(RUN_FIRST)}
    # the other files after every RUN_FIRST one: len(RUN_FIRST), not len(rank) (names listed
    # twice make rank shorter than the last index: that put test_attention_paged last of all)
    items.sort(key=lambda item: rank.get(item.path.name, len(RUN_FIRST)))  # files stay whole
    reason = sm90_missing()
    if reason is None:
        return
    for item in items:
        if item.get_closest_marker("gpu") is not None:
            item.add_marker(pytest.mark.skip(reason=reason))
