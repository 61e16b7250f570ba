"""The FP8 128x256 tile (`WIDE`, kernel.py `_mainloop_halves`) forced on the shapes its suite
cases leave out, with operands whose block scales differ 4x between neighbouring 128-column
blocks of B and 2x between k-tiles (a half promoted with the other half's block, or a k-tile
with its neighbour's scales, is off by 2x or more, not by the ~10% of random amax scales):
one k-tile (the ring's first stage only), fewer k-tiles than stages with several tiles per CTA
(the ring's phase carried across tiles), an odd number of tile rows (a 2x1 cluster's second
CTA wholly past M), N under 256 (the second half 2 columns), N off 8 (the launcher's scratch),
M under one tile; bf16 and fp16 out."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm_fp8 as fp8_suite_module
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_launch
from forgekernel.kernels.gemm.fp8.sm90.config import WIDE

pytestmark = pytest.mark.gpu

FP8 = fp8_suite_module.suite()


def _graded_inputs(m: int, n: int, k: int, dtype: torch.dtype, seed: int) -> dict:
    """The suite's inputs (`make_inputs`'s keys and quantization) for (m, n, k) from operands
    graded by powers of two: B's 128-row block j by 4^(j mod 3), A's and B's k-tile t by
    2^(t mod 2)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)
    blocks = torch.arange(n, device="cuda") // 128
    k_tiles = torch.arange(k, device="cuda") // 128
    b32 = torch.randn(n, k, device="cuda", generator=gen)
    b32 *= (4.0 ** (blocks % 3))[:, None] * (2.0 ** (k_tiles % 2))[None, :]
    a32 = torch.randn(m, k, device="cuda", generator=gen) * (2.0 ** (k_tiles % 2))[None, :]
    a, sa = fp8_suite_module._quantize(a32, 1)
    b, sb = fp8_suite_module._quantize(b32, 128)
    return {"a": a, "b": b, "sa": sa, "sb": sb, "out_dtype": dtype}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize(
    ("m", "n", "k"),
    [
        (1100, 2200, 128),  # one k-tile; 9 tile rows (odd); the last tile's 2nd half 152 cols
        (1300, 8200, 256),  # 2 k-tiles < 4 stages, ~3 tiles per CTA; 2nd half 8 columns
        (3000, 130, 384),  # N under 256: one tile column, the second half 2 columns
        (777, 4700, 640),  # N off 8 (scratch), second half wholly past N, ragged M
        (100, 1000, 512),  # M under one tile: rows clamped to M - 1, a dead cluster CTA
    ],
)  # fmt: skip
def test_wide_forced_matches_the_reference(m, n, k, dtype):
    inputs = _graded_inputs(m, n, k, dtype, seed=m + n + k)

    def run(inputs, out):
        fp8_launch.gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out, config=WIDE)
        return out

    _, cmps = verify(FP8, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
