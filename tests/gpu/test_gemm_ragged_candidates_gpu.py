"""The candidates for the slowest bench cases (config.py `RAGGED_CANDIDATES`, docs/gemm/NOTES.md
"Ragged candidates") forced through the op before the bench times them: each on its bench case
and on an awkward shape of the same kind (M and N off the tiles, N padded to 8, a K that is no
multiple of a stream-K range), bf16, B "nk", against the fp64 reference with the suite's
tolerance, every element written (NaN-poisoned out) and bitwise the same on a second call.
New here: swapped stream K over 2x1 clusters, the swapped 128x208 on a 2x1 cluster, swapped
192x144, 192x80 over a 1x4 cluster, 128x240, and the stage / epilogue variants."""

from __future__ import annotations

import pytest
import torch

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import RAGGED_CANDIDATES

pytestmark = pytest.mark.gpu

SUITE = gemm_suite.suite()
# per bench case, a smaller one whose edges the candidates cut differently
AWKWARD = {
    (129, 10240, 8192): (131, 10232, 4104),
    (3000, 576, 7168): (2999, 1000, 4104),  # 1x4 clusters: 13 column tiles, 3 CTAs past N
    (777, 4096, 14336): (771, 4100, 4104),
    (5000, 6144, 4096): (1333, 6152, 1032),
}
CASES = [
    pytest.param(cfg, *shape, id=f"{kind}-{'x'.join(map(str, shape))}")
    for mnk, group in RAGGED_CANDIDATES.items()
    for kind, cfg in group.items()
    for shape in (mnk, AWKWARD[mnk])
]


def _run(cfg):
    def run(inputs, out):
        return forgekernel.gemm(inputs["a"], inputs["b"], out=out, config=cfg)

    return run


@pytest.mark.parametrize(("cfg", "m", "n", "k"), CASES)
def test_forced_candidate_matches_the_reference(cfg, m, n, k):
    case = gemm_suite._case(m, n, k)
    gen = torch.Generator(device="cuda").manual_seed(m + n + k)
    inputs = SUITE.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=_run(cfg))
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    poisoned = [torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
                for _ in range(2)]  # fmt: skip
    first, again = (_run(cfg)(inputs, out) for out in poisoned)
    torch.cuda.synchronize()
    assert not first.isnan().any() and torch.equal(first, again)
