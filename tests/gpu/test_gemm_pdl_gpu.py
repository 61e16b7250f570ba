"""Programmatic dependent launch of the dense GEMM and the convolutions (runtime/pdl.py,
docs/gemm/NOTES.md "Programmatic dependent launch for the GEMM family"), as the decode ops'
tests check theirs (graphs.assert_pdl_chain_is_serialized): chains of back-to-back calls, call
i + 1's input call i's output, with PDL, eager and replayed in a CUDA graph, end bit for bit
where the chain without PDL, synchronized after every call, ends. Each kernel triggers its
dependents at its top, so the next call's CTAs may be resident under it: a read of the input,
a write of the output or of stream K's / the split's flags and partials (one scratch for every
call of a stream) before its griddepcontrol.wait would show here. The weight gradient has no
chain of one shape (its split with the reduce sums atomically: not bit for bit either); its
wait is checked in the SASS only (tests/test_pdl.py). The builds without PDL compile on first
use (no prebuilt ones: about 5 kernels, the DSL needed), the late-trigger builds too (2, and 3
for the convolutions' chains)."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch
from graphs import assert_pdl_chain_is_serialized

from forgekernel.kernels.gemm.dense.sm90.config import DECODE_STREAM

pytestmark = pytest.mark.gpu
gemm_op = importlib.import_module("forgekernel.ops.gemm")
conv_op = importlib.import_module("forgekernel.ops.conv")

GEMMS = [  # (M, K = N, a forced configuration or None: the chooser's)
    (8, 4096, None),  # the tiled decode configuration (8-row A boxes)
    (8, 4096, DECODE_STREAM[0]),  # stream K: every call's flags and partials in one scratch
    (300, 4096, None),  # the swap (C^T = B A^T)
]


@pytest.mark.parametrize("m, k, config", GEMMS)
def test_gemm_chain_is_the_serialized_chain(m, k, config):
    g = torch.Generator(device="cuda").manual_seed(5)
    rand = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    w = torch.randn(k, k, **rand) / k**0.5  # keeps the chain's values near 1
    x0 = torch.randn(m, k, **rand)
    assert_pdl_chain_is_serialized(lambda x, out, _: gemm_op.gemm(x, w, out=out, config=config), x0)


@pytest.mark.parametrize("m, k, config", GEMMS[:2])
def test_late_trigger_chain_is_the_serialized_chain(m, k, config):
    """The opt-in late trigger (`pdl.late()`: launch_dependents after each CTA's last
    mainloop, docs/gemm/NOTES.md "PDL's trigger and the partial wave"), tiled and stream K;
    the serialized chain runs inside `pdl.off()`, the off builds."""
    pdl = importlib.import_module("forgekernel.runtime.pdl")
    g = torch.Generator(device="cuda").manual_seed(8)
    rand = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    w = torch.randn(k, k, **rand) / k**0.5
    x0 = torch.randn(m, k, **rand)

    def call(x, out, _):
        with pdl.late() if pdl.enabled() else contextlib.nullcontext():
            gemm_op.gemm(x, w, out=out, config=config)

    assert_pdl_chain_is_serialized(call, x0)


CONVS = [  # (N, C = K, H = W): 3x3, padding 1, stride 1 (the forward kernel, split or not)
    (32, 512, 7),  # the suite's n32-c512-7x7-k512-3x3 (a no_pdl case)
]


def _late(late: bool):
    """Inside `pdl.late()` where `late` and PDL is on (the serialized chain runs inside
    `pdl.off()`: its off builds), else nothing."""
    pdl = importlib.import_module("forgekernel.runtime.pdl")
    return pdl.late() if late and pdl.enabled() else contextlib.nullcontext()


@pytest.mark.parametrize("late", [False, True], ids=["top", "late"])
@pytest.mark.parametrize("n, c, hw", CONVS)
def test_conv_forward_chain_is_the_serialized_chain(n, c, hw, late):
    """Late: the convolutions' opt-in late trigger (docs/conv/NOTES.md "The late trigger")."""
    g = torch.Generator(device="cuda").manual_seed(6)
    rand = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    w = torch.randn(c, c, 3, 3, **rand) / (9 * c) ** 0.5
    x0 = torch.randn(n, c, hw, hw, **rand).to(memory_format=torch.channels_last)

    def call(x, out, _):
        with _late(late):
            conv_op.conv2d(x, w, padding=1, out=out)

    assert_pdl_chain_is_serialized(call, x0)


@pytest.mark.parametrize("late", [False, True], ids=["top", "late"])
def test_strided_dgrad_then_forward_chain_is_the_serialized_chain(late):
    """Each call: the fused data gradient (stride 2, 3x3, the suite's n8-c640-32x32-k640-3x3-s2
    shape) into one buffer every call shares, then the stride-2 forward of it back to dy's
    shape: the data gradient of call i + 1 overwrites what the forward of call i reads."""
    g = torch.Generator(device="cuda").manual_seed(7)
    rand = {"device": "cuda", "dtype": torch.bfloat16, "generator": g}
    n, c = 8, 640
    w = torch.randn(c, c, 3, 3, **rand) / (9 * c) ** 0.5
    dy0 = torch.randn(n, c, 16, 16, **rand).to(memory_format=torch.channels_last)
    dx = torch.empty(n, c, 32, 32, **{k: rand[k] for k in ("device", "dtype")})
    dx = dx.to(memory_format=torch.channels_last)
    x_shape = (n, c, 32, 32)

    def call(dy, out, _):
        with _late(late):
            conv_op.conv2d_dgrad(dy, w, x_shape, stride=2, padding=1, out=dx)
            conv_op.conv2d(dx, w, stride=2, padding=1, out=out)

    assert_pdl_chain_is_serialized(call, dy0)
