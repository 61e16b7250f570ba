"""GEMM on shapes outside its suite (the brief: a figure that holds only on the suite it was
tuned on does not stand): the `gemm` suite's kernel, comparators, checks and timing on a fixed
sample of model projections at row counts the suite does not bench, and no variants.

The suite's sample leaves each projection out of one phase (`gemm._sampled`: projection i out of
decode when i % 3 == 0, out of prefill when i % 3 == 1); this one takes exactly those at other
sizes: the decode-left-out third at M = 2, 8, 24, 48 (batch sizes between the suite's 1, 4, 16,
32, 64), the prefill-left-out third at M = 768 ... 12288 (between its powers of two), and the
third the suite times in both phases at ragged M drawn once (seed 17, no multiple of 8). No
tuning reads these cases: a choice made for them would make them a suite.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from forgekernel.bench.suite import Case, OpSuite
from forgekernel.bench.suites import gemm

OUTSIDE_DECODE_M = (2, 8, 24, 48)
OUTSIDE_PREFILL_M = (768, 1536, 3072, 6144, 12288)
RAGGED_SEED = 17


def _ragged_m(n: int) -> list[int]:
    """n row counts in [100, 10000], none a multiple of 8 (a fixed draw)."""
    gen = torch.Generator().manual_seed(RAGGED_SEED)
    draws = torch.randint(100, 10001, (4 * n,), generator=gen).tolist()
    return [m for m in draws if m % 8][:n]


def outside_cases() -> tuple[Case, ...]:
    """The sample, in projection order per phase; none of it in `gemm.BENCH_CASES`."""
    projections = gemm.projections()
    decode = [p for i, p in enumerate(projections) if i % 3 == 0]
    prefill = [p for i, p in enumerate(projections) if i % 3 == 1]
    both = [p for i, p in enumerate(projections) if i % 3 == 2]
    ragged_m = _ragged_m(len(both))
    cases = [
        *(gemm._case(OUTSIDE_DECODE_M[j % len(OUTSIDE_DECODE_M)], n, k, group="decode",
                     source=src) for j, (src, n, k) in enumerate(decode)),
        *(gemm._case(OUTSIDE_PREFILL_M[j % len(OUTSIDE_PREFILL_M)], n, k, group="prefill",
                     source=src) for j, (src, n, k) in enumerate(prefill)),
        *(gemm._case(m, n, k, group="ragged", source=src)
          for m, (src, n, k) in zip(ragged_m, both)),
    ]  # fmt: skip
    suite_names = {c.name for c in gemm.BENCH_CASES}
    return tuple(c for c in gemm._unique(tuple(cases)) if c.name not in suite_names)


OUTSIDE_CASES = outside_cases()


def suite() -> OpSuite:
    return replace(gemm.suite(), name="gemm_outside", bench_cases=OUTSIDE_CASES, variants=None)
