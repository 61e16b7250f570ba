"""The swap of issue 17 (config.py SWAP: C^T = B A^T, the weight's N rows as the kernel's M,
the tokens as its N, C written through the output's M-major (N, M) view in 64 x 16 boxes; 128x80
and 128x208 on two consumer warpgroups, 192x80 on three, 1x2 clusters sharing the weight's tile)
forced through the op: M 129 / 300 / 777 (the token tiles' last one moved back), N 576 / 3584
and 3581 (N padded to 3584: the weight copied with zero rows, C a scratch copied back), K 3584,
B "nk" (the swap's only layout), both 16-bit dtypes. Each against the fp64 reference with the
suite's tolerance, every output element written (NaN-poisoned out), bitwise the same on a second
call, and against the same tile unswapped (the kernel on A, B, C as given): whether WGMMA sums a
product the same way with the operands' roles exchanged is what the last test measures (a
failure there alone is a finding for docs/gemm/NOTES.md "The swap", not a wrong result)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import SWAP, SWAP_TALL_80, GemmConfig

pytestmark = pytest.mark.gpu

SUITE = gemm_suite.suite()
K = 3584


def _inputs(m, n, dtype, k=K):
    case = gemm_suite._case(m, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    return SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)


def _run(cfg):
    def run(inputs, out):
        return forgekernel.gemm(inputs["a"], inputs["b"], out=out, config=cfg)

    return run


def _poisoned(m, n, dtype):
    return torch.full((m, n), float("nan"), device="cuda", dtype=dtype)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [576, 3584, 3581])
@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize("cfg", SWAP, ids=lambda c: c.tag())
def test_forced_swap_matches_the_reference(cfg, m, n, dtype):
    inputs = _inputs(m, n, dtype)
    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=_run(cfg))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first = _run(cfg)(inputs, _poisoned(m, n, dtype))
    again = _run(cfg)(inputs, _poisoned(m, n, dtype))
    torch.cuda.synchronize()
    assert not first.isnan().any() and torch.equal(first, again)


# Swapped stream K (wrong on the H200, 2026-12-02 18:47: splitk.sum_parts dropped the last
# floats of fragments that are no multiple of 16, 72 at tile_n 144 and 40 at 80): the tokens in
# one 144-wide tile, the weight's tiles over all SMs; 192x80 on 1x2 clusters.
SWAP_STREAM = (
    GemmConfig(tile_n=144, cluster_m=1, epi_n=16, swap=True, stream_k=True),
    dataclasses.replace(SWAP_TALL_80, stream_k=True),
)


@pytest.mark.parametrize("k", [3584, 8192])
@pytest.mark.parametrize("n", [3584, 3581, 10240])
@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize("cfg", SWAP_STREAM, ids=lambda c: c.tag())
def test_forced_swapped_stream_k_matches_the_reference(cfg, m, n, k):
    """Stream K on the swapped problem (the launcher's plan over (N, M)), bf16, against the
    fp64 reference, every element written, bitwise the same on a second call (the parts are
    summed in k order)."""
    inputs = _inputs(m, n, torch.bfloat16, k)
    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=_run(cfg))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first = _run(cfg)(inputs, _poisoned(m, n, torch.bfloat16))
    again = _run(cfg)(inputs, _poisoned(m, n, torch.bfloat16))
    torch.cuda.synchronize()
    assert not first.isnan().any() and torch.equal(first, again)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize("cfg", SWAP, ids=lambda c: c.tag())
def test_swap_is_bitwise_the_unswapped_tile(cfg, m, dtype):
    """The same tile and k order on C = A B^T as given (compiled on first use where it is not
    standard): each fp32 sum is over the same products in the same k-tiles."""
    n = 3584
    inputs = _inputs(m, n, dtype)
    swapped = _run(cfg)(inputs, _poisoned(m, n, dtype))
    plain = _run(dataclasses.replace(cfg, swap=False))(inputs, _poisoned(m, n, dtype))
    torch.cuda.synchronize()
    assert not swapped.isnan().any() and not plain.isnan().any()
    assert torch.equal(swapped, plain), (swapped.float() - plain.float()).abs().max()


@pytest.mark.parametrize("m, n, k", [(300, 28672, 4096), (777, 4096, 14336), (129, 10240, 8192)])
def test_the_chooser_swaps_the_issue_17_shapes(m, n, k):
    """The bench's shapes go through the swapped kernel by default (bf16, B "nk")."""
    from forgekernel.kernels.gemm.dense.sm90.config import choose_config

    assert choose_config(m, n, k) in SWAP
    a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
    out = forgekernel.gemm(a, b, out=_poisoned(m, n, torch.bfloat16))
    want = (a.double() @ b.double().t()).float()
    torch.cuda.synchronize()
    assert not out.isnan().any()
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-1)
