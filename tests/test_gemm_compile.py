"""torch.compile / tracing support of the GEMM op, shown on the CPU with fake CUDA tensors:
the custom op's fake implementation gives shapes and nothing runs."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel


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
