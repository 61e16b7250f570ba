"""torch.compile / tracing support of the FP8 GEMM, paged decode / prefill and GDN step ops, on
the CPU with fake CUDA tensors: each custom op's fake implementation gives shapes, nothing runs,
and make_fx records the op (the GDN step's state mutation too)."""

from __future__ import annotations

import importlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

fp8 = importlib.import_module("forgekernel.ops.gemm_fp8")
paged = importlib.import_module("forgekernel.ops.attention_paged")
gdn = importlib.import_module("forgekernel.ops.gated_delta_rule")
CUDA = {"device": "cuda"}


def _graph(f, make_inputs) -> str:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return str(make_fx(f, tracing_mode="fake")(*make_inputs()).graph)


def _fp8_inputs():
    a = torch.empty(5, 256, dtype=torch.float8_e4m3fn, **CUDA)
    b = torch.empty(300, 256, dtype=torch.float8_e4m3fn, **CUDA)
    return a, b, torch.empty(5, 2, **CUDA), torch.empty(3, 2, **CUDA)


def _paged_inputs():
    q = torch.empty(3, 8, 128, dtype=torch.bfloat16, **CUDA)
    k = torch.empty(10, 16, 2, 128, dtype=torch.bfloat16, **CUDA)
    table = torch.empty(3, 4, dtype=torch.int32, **CUDA)
    return q, k, k, table, torch.empty(3, dtype=torch.int32, **CUDA)


def _gdn_inputs():
    q = torch.empty(2, 1, 2, 128, dtype=torch.bfloat16, **CUDA)
    v = torch.empty(2, 1, 4, 128, dtype=torch.bfloat16, **CUDA)
    g, beta = torch.empty(2, 1, 4, **CUDA), torch.empty(2, 1, 4, **CUDA)
    return q, q, v, g, beta, torch.empty(2, 4, 128, 128, **CUDA)


def test_gemm_fp8_records_its_op():
    with FakeTensorMode():
        c = fp8.gemm_fp8(*_fp8_inputs())
        assert c.shape == (5, 300) and c.dtype == torch.bfloat16
    assert "forgekernel.gemm_fp8" in _graph(lambda *x: fp8.gemm_fp8(*x) * 2, _fp8_inputs)


def test_paged_decode_records_its_op():
    with FakeTensorMode():
        o, lse = paged.attention_paged(*_paged_inputs(), return_lse=True)
        assert o.shape == (3, 8, 128) and lse.shape == (3, 8) and lse.dtype == torch.float32
    graph = _graph(lambda *x: paged.attention_paged(*x) + 1, _paged_inputs)
    assert "forgekernel.attention_paged_decode" in graph


def _paged_prefill_inputs():
    q, k, _, table, lens = _paged_inputs()
    q = torch.empty(40, 8, 128, dtype=torch.bfloat16, **CUDA)
    return q, k, k, table, lens, torch.tensor([0, 5, 5, 40], dtype=torch.int32, **CUDA)


def test_paged_prefill_records_its_op():
    """More than 4 query tokens on a 16-bit cache: the forward's paged mode, its own op."""

    def f(q, k, v, table, lens, cu):
        return paged.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=35,
                                     return_lse=True)  # fmt: skip

    with FakeTensorMode(allow_non_fake_inputs=True):
        o, lse = f(*_paged_prefill_inputs())
        assert o.shape == (40, 8, 128) and lse.shape == (8, 40) and lse.dtype == torch.float32
    graph = _graph(lambda *x: f(*x)[0] + 1, _paged_prefill_inputs)
    assert "forgekernel.attention_paged_prefill" in graph


def test_gdn_step_records_its_op_and_the_state_mutation():
    with FakeTensorMode():
        o = gdn.gated_delta_rule_step(*_gdn_inputs())
        assert o.shape == (2, 1, 4, 128) and o.dtype == torch.bfloat16
    graph = _graph(lambda *x: gdn.gated_delta_rule_step(*x) * 2, _gdn_inputs)
    assert "forgekernel.gated_delta_rule_step" in graph
