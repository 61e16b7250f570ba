"""torch.compile / tracing support of the attention ops, shown on the CPU with fake CUDA
tensors: the custom ops' fake implementations give shapes and nothing runs."""

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel


def _fake_qkv(b=2, sq=100, sk=300, hq=8, hkv=2, d=192, dv=128, dtype=torch.float16):
    q = torch.empty(b, sq, hq, d, device="cuda", dtype=dtype)
    k = torch.empty(b, sk, hkv, d, device="cuda", dtype=dtype)
    v = torch.empty(b, sk, hkv, dv, device="cuda", dtype=dtype)
    return q, k, v


def test_fake_tensors_take_the_custom_op():
    with FakeTensorMode():
        q, k, v = _fake_qkv()
        o, lse = forgekernel.attention(q, k, v, causal=True, return_lse=True)
        assert o.shape == (2, 100, 8, 128) and o.dtype == torch.float16 and o.device.type == "cuda"
        assert lse.shape == (2, 8, 100) and lse.dtype == torch.float32
        assert forgekernel.attention(q, k, v).shape == (2, 100, 8, 128)


def test_make_fx_records_the_op_with_the_resolved_scale():
    def f(q, k, v):
        return forgekernel.attention(q, k, v, causal=True) * 2

    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(f, tracing_mode="fake")(*_fake_qkv())
    text = str(graph.graph)
    assert "forgekernel.attention_fwd.default" in text and "True" in text
    assert repr(192**-0.5) in text


def test_fake_out_variant_mutates_out():
    def f(q, k, v, o, lse):
        return forgekernel.attention(q, k, v, return_lse=True, out=(o, lse))

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, k, v = _fake_qkv()
        o = torch.empty(2, 100, 8, 128, device="cuda", dtype=torch.float16)
        lse = torch.empty(2, 8, 100, device="cuda")
        graph = make_fx(f, tracing_mode="fake")(q, k, v, o, lse)
    assert "forgekernel.attention_fwd_out" in str(graph.graph)


def test_varlen_traces_through_its_custom_op():
    def f(q, k, v, cu_q, cu_k):
        return forgekernel.attention_varlen(q, k, v, cu_q, cu_k, 70, 200, True, None, True)

    with FakeTensorMode(allow_non_fake_inputs=True):
        q = torch.empty(100, 8, 128, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(300, 2, 128, device="cuda", dtype=torch.bfloat16)
        cu_q = torch.tensor([0, 30, 100], dtype=torch.int32, device="cuda")
        cu_k = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
        graph = make_fx(f, tracing_mode="fake")(q, k, k, cu_q, cu_k)
        o, lse = f(q, k, k, cu_q, cu_k)
    assert "forgekernel.attention_varlen_fwd" in str(graph.graph)
    assert o.shape == (100, 8, 128) and lse.shape == (8, 100) and lse.dtype == torch.float32
