"""GEMM torch layer on the CPU: every bad input raises a clear error before any kernel runs,
and the reference is the spec."""

import pytest
import torch

import forgekernel
from forgekernel.reference.gemm import gemm_ref


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize(
    "a, b, kwargs, exc, words",
    [
        (torch.randn(16, 32), torch.randn(24, 32), {}, TypeError, "a must have dtype"),
        (bf16(16, 32), torch.randn(24, 32).half(), {}, TypeError, "b has dtype"),
        (bf16(2, 16, 32), bf16(24, 32), {}, ValueError, "a must be 2-D"),
        (bf16(16, 36), bf16(24, 36), {}, ValueError, "K = 36 must be a multiple of 8"),
        (bf16(16, 32), bf16(24, 40), {}, ValueError, "K mismatch (32 vs 40)"),
        (bf16(16, 32), bf16(20, 32), {}, ValueError, "N = 20 must be a multiple of 8"),
        (bf16(16, 32), bf16(24, 32), {"b_layout": "t"}, ValueError, "b_layout must be"),
        (bf16(16, 32), bf16(24, 32), {"out": bf16(16, 16)}, ValueError, "out must have shape"),
        (bf16(16, 32), bf16(24, 32), {}, ValueError, "a must be a CUDA tensor"),
        ([[1.0]], bf16(24, 32), {}, TypeError, "a must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise(a, b, kwargs, exc, words):
    with pytest.raises(exc) as info:
        forgekernel.gemm(a, b, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("m, n, k", [(1, 8, 8), (7, 24, 40), (129, 264, 520)])
def test_reference_matches_float64(m, n, k):
    a, b = bf16(m, k), bf16(n, k)
    want = a.double() @ b.double().t()
    assert torch.allclose(gemm_ref(a, b).double(), want, rtol=1e-5, atol=1e-4)
    assert torch.allclose(
        gemm_ref(a, b.t().contiguous(), "kn").double(), want, rtol=1e-5, atol=1e-4
    )
