"""torch.compile / tracing support of the GEMM op, shown on the CPU with fake CUDA tensors:
the custom op's fake implementation gives shapes and nothing runs; and the kernel's own
compile-time guarantees (no deprecated DSL API, tuning records of dropped variants)."""

import warnings
from dataclasses import asdict

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.kernels.gemm.dense.sm90 import SPEC
from forgekernel.kernels.gemm.dense.sm90.config import WIDE, GemmConfig, params_for


def _fake_inputs(m=100, n=48, k=64, dtype=torch.bfloat16):
    a = torch.empty(m, k, device="cuda", dtype=dtype)
    b = torch.empty(n, k, device="cuda", dtype=dtype)
    return a, b


def test_fake_tensors_take_the_custom_op():
    with FakeTensorMode():
        a, b = _fake_inputs()
        c = forgekernel.gemm(a, b)
        assert c.shape == (100, 48) and c.dtype == torch.bfloat16 and c.device.type == "cuda"
        c = forgekernel.gemm(a, b.t(), b_layout="kn")
        assert c.shape == (100, 48)


def test_make_fx_records_the_op():
    def f(a, b):
        return forgekernel.gemm(a, b) * 2

    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b = _fake_inputs()
        graph = make_fx(f, tracing_mode="fake")(a, b)
    assert "forgekernel.gemm" in str(graph.graph)


def test_fake_out_variant_mutates_out():
    def f(a, b, out):
        return forgekernel.gemm(a, b, out=out)

    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b = _fake_inputs()
        out = torch.empty(100, 48, device="cuda", dtype=torch.bfloat16)
        graph = make_fx(f, tracing_mode="fake")(a, b, out)
    assert "forgekernel.gemm_out" in str(graph.graph)


def test_tuning_records_of_dropped_variants_give_no_config():
    record = asdict(WIDE)
    assert GemmConfig.from_record(record) == WIDE
    assert GemmConfig.from_record({**record, "split_k": 1, "pingpong": False}) == WIDE
    assert GemmConfig.from_record({**record, "split_k": 2}) is None
    assert GemmConfig.from_record({**record, "tile_m": 64, "pingpong": True}) is None


def test_swizzled_raster_compiles_without_deprecated_dsl_apis():
    """The own static scheduler's swizzled, N-major walk (no standard kernel uses it) builds,
    and nothing the GEMM calls is deprecated in the DSL."""
    pytest.importorskip("cutlass")
    cfg = GemmConfig(tile_n=128, cluster_m=1, cluster_n=2, swizzle=3, raster_along_m=False)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)
        SPEC.compile(params_for("bfloat16", True, cfg))
