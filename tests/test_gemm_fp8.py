"""forgekernel.gemm_fp8 on the CPU: argument errors, the configuration per M, the launcher's
arguments (a stand-in kernel computing the reference), the suite's quantized inputs against
their fp32 source, and the custom op's fake implementation."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.bench.suites import gemm_fp8 as suite_module
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_sm90
from forgekernel.kernels.gemm.fp8.sm90.config import DECODE, LARGE, MID, SKINNY, choose_config
from forgekernel.reference.gemm import gemm_fp8_ref

F8 = torch.float8_e4m3fn
op_module = importlib.import_module("forgekernel.ops.gemm_fp8")  # the module, not the function


def _operands(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    case = suite_module._case(m, n, k)
    inputs = suite_module.make_inputs(case, torch.bfloat16, torch.device("cpu"), gen)
    return inputs["a"], inputs["b"], inputs["sa"], inputs["sb"]


@pytest.mark.parametrize(
    ("m", "want"),
    [(1, DECODE[0]), (8, DECODE[0]), (9, DECODE[1]), (32, DECODE[2]), (33, SKINNY),
     (64, SKINNY), (65, MID), (128, MID), (129, LARGE)],
)  # fmt: skip
def test_config_by_m(m, want):
    assert choose_config(m, 7168, 2048) == want
    assert want.fits(m)


def test_standard_kernels_cover_both_outputs():
    params = [dict(p) for p in SPEC.standard_params()]
    assert {p["out"] for p in params} == {"bfloat16", "float16"}
    assert all(p["tile_k"] == 128 and p["tile_n"] in (128, 192) for p in params)


def test_quantized_inputs_follow_their_source():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(130, 256, generator=gen)
    q, s = suite_module._quantize(x, 128)
    assert q.dtype == F8 and s.shape == (2, 2)
    back = q.float() * s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    assert float((back - x).abs().max()) <= 0.07 * float(x.abs().max())  # e4m3: 3 bits
    assert float(q.float().abs().max()) <= 448


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"a": torch.zeros(4, 256)}, TypeError, "a must have dtype"),
        ({"b": torch.zeros(8, 128, dtype=F8)}, ValueError, "K mismatch"),
        ({"k": 200}, ValueError, "multiple of 128"),
        ({"sa": torch.zeros(4, 1)}, ValueError, "scale_a must have shape"),
        ({"sb": torch.zeros(1, 2, dtype=torch.float64)}, TypeError, "scale_b must have dtype"),
        ({"out_dtype": torch.float32}, TypeError, "out_dtype"),
        ({"out": torch.zeros(4, 9, dtype=torch.bfloat16)}, ValueError, "out must have shape"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, err, match):
    k = kwargs.pop("k", 256)
    args = {
        "a": torch.zeros(4, k, dtype=F8),
        "b": torch.zeros(8, k, dtype=F8),
        "sa": torch.ones(4, k // 128),
        "sb": torch.ones(1, k // 128),
        **kwargs,
    }
    with pytest.raises(err, match=match):
        op_module.gemm_fp8(
            args["a"], args["b"], args["sa"], args["sb"],
            out_dtype=kwargs.get("out_dtype", torch.bfloat16), out=kwargs.get("out"),
        )  # fmt: skip


@pytest.mark.parametrize(("m", "n", "k"), [(1, 128, 128), (33, 1001, 256), (130, 300, 384)])
def test_launcher_arguments(monkeypatch, m, n, k):
    """The stand-in kernel insists on what the compiled one assumes: TMA-ready operands, an
    output whose N is a multiple of 8, no stream-K workspace, and the scales as given."""
    calls = []

    def get_kernel(spec, params):
        def fn(a, b, c, work, flags, per, sa, sb, group, clusters):
            assert work is None and flags is None and per == 0
            assert c.shape[1] % 8 == 0 and a.is_contiguous() and b.is_contiguous()
            c[:, : b.shape[0]].copy_(gemm_fp8_ref(a, b, sa, sb).to(c.dtype))
            calls.append((dict(params), clusters))

        return fn

    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)
    a, b, sa, sb = _operands(m, n, k)
    c = op_module.gemm_fp8(a, b, sa, sb)
    want = gemm_fp8_ref(a, b, sa, sb).to(torch.bfloat16)
    assert c.shape == (m, n) and torch.equal(c, want)
    params, clusters = calls[-1]
    cfg = choose_config(m, n, k)
    assert params["tile_m"] == cfg.tile_m and clusters == 132 // (cfg.cluster_m * cfg.cluster_n)


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(5, 256, dtype=F8)
        b = torch.empty(300, 256, dtype=F8)
        c = torch.ops.forgekernel.gemm_fp8(
            a, b, torch.empty(5, 2), torch.empty(3, 2), torch.float16
        )
        assert c.shape == (5, 300) and c.dtype == torch.float16
