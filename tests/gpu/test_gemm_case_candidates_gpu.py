"""The candidates timed as bench variants of one case (config.py `CASE_CANDIDATES`,
docs/gemm/NOTES.md "256 tokens: candidates") forced through the op before the bench times them:
each on its bench case and on an awkward shape of the same kind (M and N off the tiles, an odd
count of tile columns, K no multiple of 64), bf16, B "nk", against the fp64 reference with the
suite's tolerance, every element written (NaN-poisoned out) and bitwise the same on a second
call. New here: 128x128 over a 1x2 cluster (in no pick before) and SMALL walked N-first; the
80-column tiles the 72-column picks replace, and 64x112 a8 on three decode cases."""

from __future__ import annotations

import pytest
import torch

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import gemm as gemm_suite
from forgekernel.kernels.gemm.dense.sm90.config import CASE_CANDIDATES

pytestmark = pytest.mark.gpu

SUITE = gemm_suite.suite()
# per bench case, a smaller one whose edges the candidates cut differently
AWKWARD = {
    (256, 8192, 8192): (255, 8200, 4104),  # 65 tile columns: a 1x2 cluster's second CTA past N
    (3000, 576, 7168): (3001, 584, 1000),  # 8 tile columns of 80, the last moved back
    (129, 10240, 8192): (131, 10248, 4104),  # 54 weight tiles, the last moved back
    # 64x112 a8 decode: N off the 112-column tiles (an odd count: a 1x2 cluster's CTA past N)
    (4, 28672, 4096): (5, 28680, 1000),
    (4, 37888, 3584): (7, 37896, 3592),
    (1, 24576, 4096): (1, 24584, 4104),
}
CASES = [
    pytest.param(cfg, *shape, id=f"{kind}-{'x'.join(map(str, shape))}")
    for mnk, group in CASE_CANDIDATES.items()
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
