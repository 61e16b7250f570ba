"""The convolution suites (conv_fwd, conv_dgrad, conv_wgrad) on the CPU: registered as pending
only, the issue's cases present, every case a valid problem for the op (its validation reaches
the device check), work counts, channels-last random inputs, and the suites' own `check` on
their odd-sized check cases with the kernel model standing in for the compiled kernel
(kernels/conv/sm90/emulate.py) and PyTorch's CPU convolution as the low-precision yardstick."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from forgekernel.bench import check
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import emulate, launch

op = importlib.import_module("forgekernel.ops.conv")
NAMES = ("conv_fwd", "conv_dgrad", "conv_wgrad")
SUITES = {
    name: importlib.import_module(f"forgekernel.bench.suites.{name}").suite() for name in NAMES
}
CPU = torch.device("cpu")


def test_registered_since_their_first_gpu_check():
    """Registered since their first GPU check passed (2026-12-01)."""
    for name in NAMES:
        assert SUITE_MODULES[name] == f"forgekernel.bench.suites.{name}"
        assert name not in PENDING_SUITE_MODULES
        assert SUITES[name].name == name


def test_the_issues_points_are_bench_cases():
    want = {
        "conv_wgrad": ("n32-c256-56x56-k256-3x3", "wgrad"),
        "conv_dgrad": ("n32-c256-112x112-k512-3x3-s2", "dgrad"),
        "conv_fwd": ("n4-c128-16x64x64-k128-3x3x3", "fwd"),
    }
    for name, (case, kind) in want.items():
        cases = {c.name: c for c in SUITES[name].bench_cases}
        assert cases[case].params["op"] == kind


def test_cases_sample_the_layers_asked_for():
    fwd = {c.group for c in SUITES["conv_fwd"].bench_cases}
    assert fwd == {"conv3d", "conv2d"}
    conv3d = [c for c in SUITES["conv_fwd"].bench_cases if c.group == "conv3d"]
    assert {c.params["kernel"] for c in conv3d} == {(3, 3, 3), (1, 3, 3)}
    assert {c.params["spatial"][0] for c in conv3d} == {4, 8, 16}
    assert {c.params["c"] for c in conv3d} == {128, 256, 512}
    dgrad = SUITES["conv_dgrad"].bench_cases
    stride2 = [c for c in dgrad if c.group == "stride2"]
    assert all(c.params["stride"] == (2, 2) for c in stride2)
    assert {c.params["kernel"] for c in stride2} == {(3, 3), (1, 1), (2, 2)}
    sources = {c.params["source"].split(".")[0] for c in SUITES["conv_wgrad"].bench_cases}
    assert sources == {"issue23", "resnet50", "convnext_t", "sd_unet", "sd_vae"}
    batches = {c.params["n"] for s in SUITES.values() for c in s.bench_cases}
    assert min(batches) >= 1 and {8, 32, 64} <= batches


@pytest.mark.parametrize("name", NAMES)
def test_every_case_is_a_valid_problem(name):
    """Names unique; on meta tensors every case's validation passes up to the device check."""
    suite = SUITES[name]
    for cases in (suite.bench_cases, suite.check_cases):
        assert len({c.name for c in cases}) == len(cases)
    assert {c.name for c in suite.sanitize_cases} <= {c.name for c in suite.check_cases}
    for case in (*suite.bench_cases, *suite.check_cases):
        p = case.params
        s = L.shapes(p)
        meta = {k: torch.empty(v, dtype=torch.bfloat16, device="meta") for k, v in s.items()}
        d = len(p["spatial"])
        geometry = {"stride": p["stride"], "padding": p["padding"], "dilation": p["dilation"]}
        with pytest.raises(ValueError, match="must be a CUDA tensor"):
            if p["op"] == "fwd":
                bias = torch.empty(p["k"], dtype=torch.bfloat16, device="meta")
                (op.conv2d if d == 2 else op.conv3d)(
                    meta["x"], meta["w"], bias if p["bias"] else None, **geometry
                )
            elif p["op"] == "dgrad":
                (op.conv2d_dgrad if d == 2 else op.conv3d_dgrad)(
                    meta["y"], meta["w"], s["x"], **geometry
                )
            else:
                (op.conv2d_wgrad if d == 2 else op.conv3d_wgrad)(
                    meta["y"], meta["x"], s["w"], **geometry
                )


def test_work_counts():
    case = L.conv_case("dgrad", 32, 256, 512, (112, 112), 3, 2)
    assert L.output_spatial(case.params) == (56, 56)
    assert L.flops(case) == 2 * 32 * 512 * 256 * 56 * 56 * 9
    elems = 32 * 256 * 112 * 112 + 512 * 256 * 9 + 32 * 512 * 56 * 56
    assert L.nbytes(case, torch.bfloat16) == 2 * elems
    case = L.conv_case("fwd", 2, 8, 16, (5, 7, 6), (3, 1, 3), (2, 1, 1), (1, 0, 2), (1, 1, 2))
    assert case.name == "n2-c8-5x7x6-k16-3x1x3-s2x1x1-d1x1x2"  # the padding is the default
    assert L.conv_case("fwd", 2, 8, 8, (15, 15), 3, 3, 0).name == "n2-c8-15x15-k8-3x3-s3-p0"
    assert L.output_spatial(case.params) == (3, 7, 6)


def test_inputs_are_random_and_channels_last():
    case = L.conv_case("fwd", 2, 8, 16, (5, 6), 3, bias=True)
    inputs = L.make_inputs(case, torch.bfloat16, CPU, torch.Generator().manual_seed(0))
    assert inputs["x"].is_contiguous(memory_format=torch.channels_last)
    assert inputs["w"].is_contiguous(memory_format=torch.channels_last)
    for t in (inputs["x"], inputs["w"], inputs["bias"]):
        assert t.dtype == torch.bfloat16 and bool((t != 0).all())
    out = L.alloc_out(inputs)
    assert out.shape == (2, 16, 5, 6) and out.is_contiguous(memory_format=torch.channels_last)
    case = L.conv_case("wgrad", 1, 8, 16, (4, 5, 6), 3)
    inputs = L.make_inputs(case, torch.float16, CPU, torch.Generator().manual_seed(0))
    assert set(inputs) == {"params", "x", "dy"}
    assert inputs["dy"].is_contiguous(memory_format=torch.channels_last_3d)


def test_no_cudnn_without_a_gpu():
    for suite in SUITES.values():
        assert suite.comparators() == {"cudnn": None}


@pytest.fixture
def model_kernel(monkeypatch):
    launch.clear_plans()  # plans hold the function they looked up
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(launch, "get_kernel", emulate.stand_in)
    yield
    launch.clear_plans()


# the odd check cases (the moderate per-class ones take the kernel model too long on a CPU)
ODD = [(name, c) for name in NAMES for c in SUITES[name].check_cases if not c.group]


@pytest.mark.parametrize("name, case", ODD, ids=[f"{n}-{c.name}" for n, c in ODD])
def test_check_passes_on_the_odd_cases(model_kernel, name, case):
    dtype = torch.float16 if len(case.name) % 2 else torch.bfloat16
    rec = check.check_case(SUITES[name], case, dtype, CPU, seed=1)
    assert rec["passed"], rec["message"]


def test_check_catches_a_skipped_phase(model_kernel, monkeypatch):
    """A data gradient that leaves its last phase unwritten fails the suite's check: the fused
    launch's order naming its first phase again in the last slot, and the launch per phase
    (stride 3) one launch short."""
    suite = SUITES["conv_dgrad"]
    real_fused = launch.fused_dgrad

    def fused(*args):
        plan = real_fused(*args)
        return dataclasses.replace(plan, order=(*plan.order[:-1], plan.order[0]))

    monkeypatch.setattr(launch, "fused_dgrad", fused)
    real = launch.dgrad_phases
    monkeypatch.setattr(launch, "dgrad_phases", lambda *args: real(*args)[:-1])
    stride3 = next(c for c in suite.check_cases if c.params["stride"] == (3, 3))
    for case in (suite.check_cases[0], stride3):
        rec = check.check_case(suite, case, torch.bfloat16, CPU, seed=1)
        assert not rec["passed"] and "NaN where the reference is finite" in rec["message"]
