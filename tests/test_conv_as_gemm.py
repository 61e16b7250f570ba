"""1x1 convolutions as the dense GEMM (kernels/conv/sm90/launch.py `as_gemm`, the suites'
`as_gemm` variant; docs/conv/NOTES.md, "1x1 convolutions as GEMMs"), on the CPU: the route is
off by default, its views of x / dy, w and y / dx give the reference (the GEMM's compiled
function replaced by an fp64 product that insists on what the compiled one does), it refuses
every problem that is not an unpadded stride-1 1x1 without bias on channels of 8, the variant
covers exactly the suites' forward and data-gradient 1x1 stride-1 cases, and every GEMM it
asks for there is a standard build."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from forgekernel.bench.suites import conv_dgrad, conv_fwd, conv_wgrad
from forgekernel.bench.suites import conv_layers as L
from forgekernel.kernels.conv.sm90 import emulate, launch
from forgekernel.kernels.conv.sm90.geometry import Geometry
from forgekernel.kernels.gemm.dense.sm90 import SPEC as GEMM_SPEC
from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_launch
from forgekernel.kernels.gemm.dense.sm90.config import params_for
from forgekernel.runtime.device import tma_ready

op = importlib.import_module("forgekernel.ops.conv")
F64 = torch.float64
BF16 = torch.bfloat16
ONE = Geometry((1, 1, 1), (0, 0, 0), (0, 0, 0))


@pytest.fixture
def kernels(monkeypatch, tmp_path):
    """Both launchers on the CPU: the convolution's compiled functions its CPU models, the
    GEMM's an fp64 product that asserts TMA-ready operands and N, K multiples of 8; the spec
    name and compile key of every function asked for, in order."""
    keys = []

    def conv_kernel(spec, params):
        keys.append((spec.name, dict(params)))
        return emulate.stand_in(spec, params)

    def gemm_kernel(spec, params):
        keys.append((spec.name, dict(params)))
        b_kn = dict(params)["b_kn"]

        def fn(a, b, c, work, flags, per_cta, sfa, sfb, group, max_clusters):
            assert all(tma_ready(t) for t in (a, b, c))
            assert a.shape[1] % 8 == 0 and c.shape[1] % 8 == 0
            c.copy_(a.double() @ (b.double() if b_kn else b.double().t()))

        return fn

    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    gemm_launch.tuning.load.cache_clear()
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(launch, "get_kernel", conv_kernel)
    monkeypatch.setattr(gemm_launch, "get_kernel", gemm_kernel)
    monkeypatch.setattr(gemm_launch, "_plans", gemm_launch._Plans())
    monkeypatch.setattr(gemm_launch, "num_sms", lambda device: 132)
    launch.clear_plans()
    yield keys
    launch.clear_plans()
    gemm_launch.tuning.load.cache_clear()


def _inputs(kind: str, n, c, k, spatial, dtype=F64):
    case = L.conv_case(kind, n, c, k, spatial, 1)
    return L.make_inputs(case, dtype, torch.device("cpu"), torch.Generator().manual_seed(0))


def _nan_out(inputs):
    out = L.alloc_out(inputs)
    return out.fill_(float("nan"))


# awkward sizes: one pixel, 7x7 (M = 49: the GEMM's decode tiles), 13x11 x 3 images (M = 429,
# no multiple of the tiles), channels 8 / 72 / 136, a 3-D map
SIZES = [(1, 8, 16, (1, 1)), (1, 72, 136, (7, 7)), (3, 24, 40, (13, 11)), (2, 16, 8, (3, 5, 4))]


@pytest.mark.parametrize("kind", ["fwd", "dgrad"])
@pytest.mark.parametrize("n, c, k, spatial", SIZES)
def test_the_variant_gives_the_reference(kernels, kind, n, c, k, spatial):
    """The bench's `as_gemm` runner writes the reference into the suite's output, through one
    GEMM launch ("kn" for the data gradient) and no convolution kernel."""
    inputs = _inputs(kind, n, c, k, spatial)
    out = _nan_out(inputs)
    got = L.run_as_gemm(inputs, out)
    assert got is out
    torch.testing.assert_close(got, L.reference(inputs).to(F64), rtol=1e-5, atol=1e-4)
    assert [name for name, _ in kernels] == ["gemm_dense_sm90"]
    assert kernels[0][1]["b_kn"] is (kind == "dgrad")


def test_the_measured_rule(kernels):
    """The forward takes the GEMM from 256 input and 128 output channels (measured, launch.py
    `ONE_BY_ONE_AS_GEMM`), the data gradient never: a small 1x1 of either op and a forward of
    K = 64 run the convolution kernel, a C = 256 K = 128 forward the GEMM."""
    assert launch.ONE_BY_ONE_AS_GEMM == {"fwd": (256, 128), "dgrad": None}
    fwd, dgrad = (_inputs(kind, 2, 16, 24, (6, 6), BF16) for kind in ("fwd", "dgrad"))
    op.conv2d(fwd["x"], fwd["w"])
    op.conv2d_dgrad(dgrad["dy"], dgrad["w"], (2, 16, 6, 6))
    narrow = _inputs("fwd", 1, 256, 64, (4, 4), BF16)
    op.conv2d(narrow["x"], narrow["w"])
    big = _inputs("dgrad", 1, 256, 128, (4, 4), BF16)
    op.conv2d_dgrad(big["dy"], big["w"], (1, 256, 4, 4))
    assert {name for name, _ in kernels} == {"conv_fprop_sm90"}
    kernels.clear()
    wide = _inputs("fwd", 1, 256, 128, (4, 4), BF16)
    got = op.conv2d(wide["x"], wide["w"])
    torch.testing.assert_close(got.float(), L.reference(wide), rtol=8e-3, atol=1e-2)
    assert [name for name, _ in kernels] == ["gemm_dense_sm90"]


@pytest.mark.parametrize("kind", ["fwd", "dgrad"])
def test_the_route_when_on(kernels, monkeypatch, kind):
    """With its entry on for every size, an op's 1x1 goes to the GEMM through the public API (the
    result the reference), the other op (off) stays on the convolution kernel; a forward with
    bias stays too."""
    monkeypatch.setitem(launch.ONE_BY_ONE_AS_GEMM, kind, (0, 0))
    monkeypatch.setitem(launch.ONE_BY_ONE_AS_GEMM, "dgrad" if kind == "fwd" else "fwd", None)
    inputs = _inputs(kind, 3, 24, 40, (13, 11), BF16)
    if kind == "fwd":
        got = op.conv2d(inputs["x"], inputs["w"])
    else:
        got = op.conv2d_dgrad(inputs["dy"], inputs["w"], (3, 24, 13, 11))
    # the fp64 product rounded once to bf16
    torch.testing.assert_close(got.float(), L.reference(inputs), rtol=8e-3, atol=1e-2)
    assert [name for name, _ in kernels] == ["gemm_dense_sm90"]
    kernels.clear()
    other = _inputs("dgrad" if kind == "fwd" else "fwd", 1, 8, 16, (4, 4), BF16)
    if kind == "fwd":
        op.conv2d_dgrad(other["dy"], other["w"], (1, 8, 4, 4))
        bias = torch.randn(40, dtype=BF16)
        op.conv2d(inputs["x"], inputs["w"], bias)
    else:
        op.conv2d(other["x"], other["w"])
    assert {name for name, _ in kernels} == {"conv_fprop_sm90"}


def _operands(c=16, k=24, hw=(5, 6), f=1, stride=1, pad=0):
    g = Geometry((1, f, f), (0, pad, pad), (0, pad, pad), (1, stride, stride))
    out_hw = g.output((1, *hw))[1:]
    x = torch.randn(2, 1, *hw, c, dtype=F64)
    w = torch.randn(k, 1, f, f, c, dtype=F64)
    y = torch.empty(2, 1, *out_hw, k, dtype=F64)
    return x, w, y, g


@pytest.mark.parametrize(
    "kwargs",
    [{"f": 3, "pad": 1}, {"stride": 2}, {"pad": 1}, {"c": 12}, {"k": 20}],
    ids=["3x3", "stride2", "padded", "c12", "k20"],
)
def test_the_route_refuses_what_is_no_plain_gemm(kernels, kwargs):
    """A filter other than 1x1, a stride, padding, channels off 8: no views, nothing run."""
    x, w, y, g = _operands(**kwargs)
    assert launch.gemm_views(x, w, y, g) is None
    assert launch.as_gemm(x, w, y, g, dgrad=False) is False
    assert kernels == []


def test_the_route_refuses_pixels_that_do_not_merge(kernels):
    """An output whose pixels are no (M, K) view (part of a wider map: rows 13 pixels apart,
    every pixel or every other) and an input of other pixels than the output's: the
    convolution's path."""
    x, w, _, g = _operands(hw=(5, 6))
    wide = torch.empty(2, 1, 5, 13, 24, dtype=F64)
    assert launch.gemm_views(x, w, wide[:, :, :, :12:2], g) is None
    assert launch.gemm_views(x, w, wide[:, :, :, :6], g) is None
    assert launch.gemm_views(x, w, torch.empty(2, 1, 6, 5, 24, dtype=F64), g) is None
    assert kernels == []


def test_the_views_are_the_tensors_themselves():
    """x, w and y seen as (M, C), (K, C) and (M, K) in place, a channel slice of y too."""
    x, w, y, g = _operands()
    a, b, c = launch.gemm_views(x, w, y, g)
    assert (a.shape, b.shape, c.shape) == ((60, 16), (24, 16), (60, 24))
    assert [t.data_ptr() for t in (a, b, c)] == [t.data_ptr() for t in (x, w, y)]
    wider = torch.empty(2, 1, 5, 6, 32, dtype=F64)
    c = launch.gemm_views(x, w, wider[..., :24], g)[2]
    assert c.shape == (60, 24) and c.stride() == (32, 1)


def _one_by_one(case) -> bool:
    p = case.params
    return all(v == 1 for v in (*p["kernel"], *p["stride"])) and not any(p["padding"])


def test_the_variant_covers_the_suites_1x1_stride1_cases():
    """`as_gemm` on every forward and data-gradient bench case of an unpadded stride-1 1x1
    (none with bias), on no other case and on no weight-gradient case."""
    for suite in (conv_fwd, conv_dgrad):
        for case in (*suite.BENCH_CASES, *suite.CHECK_CASES):
            want = _one_by_one(case) and not case.params["bias"]
            assert ("as_gemm" in suite.variants(case)) is want, case.name
    assert sum("as_gemm" in conv_fwd.variants(c) for c in conv_fwd.BENCH_CASES) == 7
    assert sum("as_gemm" in conv_dgrad.variants(c) for c in conv_dgrad.BENCH_CASES) == 4
    assert not any("as_gemm" in conv_wgrad.variants(c) for c in conv_wgrad.BENCH_CASES)


def test_the_gemms_of_the_bench_cases_are_standard_builds(monkeypatch, tmp_path):
    """The configuration the GEMM launcher takes for each covered bench case (no tuning
    record) is built by `forgekernel build` (gemm_dense_sm90's standard params, bf16)."""
    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    gemm_launch.tuning.load.cache_clear()
    standard = set(GEMM_SPEC.standard_params())
    for suite in (conv_fwd, conv_dgrad):
        for case in suite.BENCH_CASES:
            if "as_gemm" not in suite.variants(case):
                continue
            p = case.params
            m = p["n"] * math.prod(L.output_spatial(p))
            b_kn = p["op"] == "dgrad"
            n, k = (p["c"], p["k"]) if b_kn else (p["k"], p["c"])
            cfg = gemm_launch.config_for(torch.bfloat16, b_kn, m, n, k, 132)
            assert params_for("bfloat16", b_kn, cfg) in standard, (case.name, cfg.tag())
    gemm_launch.tuning.load.cache_clear()
