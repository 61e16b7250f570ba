"""The one-wave tiles of issue 17 (config.py FIT: 128x224, 128x160, and 128x144 / 128x112 with
16-column epilogue sub-tiles, in 2x1 clusters; 192x80 and 192x96, three consumer warpgroups at
152 registers, in 1x2 clusters; 192x72, B "nk" only: B's ring of 80 rows, 8-column sub-tiles)
forced through the op on awkward shapes: M 129 / 300 / 777 (one
row past a tile, a few hundred rows, the last tile row moved back), N 576 / 3584 (whole tiles
of 144 / 96 and of 224 / 112, a ragged last tile column for the others), K 3584, both B layouts
and both 16-bit dtypes. With them the twins config.walked puts in (LARGE in bands of 6 N blocks:
N 3584 in bands of 6, 6 and 2; 128x144 with A multicast over 1x2 clusters: N 3584's 25 tile
columns leave a cluster's second CTA past N). Each against the fp64 reference with the suite's
tolerance, every output element written (NaN-poisoned out) and bitwise the same on a second
call."""

from __future__ import annotations

import pytest
import torch

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import FIT, FIT_144_A, LARGE_BAND, takes_kn

pytestmark = pytest.mark.gpu

SUITE = gemm_suite.suite()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("n", [576, 3584])
@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize(
    ("cfg", "layout"),
    [
        (c, layout)
        for c in (*FIT, LARGE_BAND, FIT_144_A)
        for layout in ("nk", "kn")
        if layout == "nk" or takes_kn(c)
    ],
    ids=lambda x: getattr(x, "tag", lambda: x)(),
)
def test_forced_fit_tile_matches_the_reference(cfg, layout, m, n, dtype):
    k = 3584
    case = gemm_suite._case(m, n, k, layout)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    inputs = SUITE.make_inputs(case, dtype, torch.device("cuda"), gen)

    def run(inputs, out):
        b_layout = inputs["b_layout"]
        return forgekernel.gemm(inputs["a"], inputs["b"], out=out, b_layout=b_layout, config=cfg)

    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first = run(inputs, torch.full((m, n), float("nan"), device="cuda", dtype=dtype))
    again = run(inputs, torch.full((m, n), float("nan"), device="cuda", dtype=dtype))
    torch.cuda.synchronize()
    assert not first.isnan().any() and torch.equal(first, again)
