"""The dsa_indexer suite on the CPU (pending its GPU check): inputs that satisfy each case, the
order-free judge accepting the exact selection (the kernels' CPU model) and near-ties within
its tolerance, and refusing duplicates, missing ids, hidden keys and a wrong pick; the work
counts; the harness calling the judge instead of an element-wise reference."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench import check
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
from forgekernel.bench.suites import dsa_indexer as S
from forgekernel.kernels.attention.dsa_indexer.sm90 import emulate as em
from forgekernel.kernels.attention.dsa_indexer.sm90.launch import paged_cache_views

CPU = torch.device("cpu")


def _inputs(case, seed=0):
    return S.make_inputs(case, torch.float8_e4m3fn, CPU, torch.Generator().manual_seed(seed))


def _model_ids(inputs) -> torch.Tensor:
    """What the kernels compute, by their CPU model."""
    p = inputs["case"]
    if p["mode"] == "prefill":
        logits = em.logits_model(inputs["q"], inputs["weights"], inputs["k"], inputs["k_scale"])
        return em.topk_model(logits, inputs["starts"], inputs["ends"], p["topk"])
    k, scale = paged_cache_views(inputs["cache"])
    table, next_n = inputs["table"], p["next_n"]
    width = table.shape[1] * 64
    q = inputs["q"].flatten(0, 1)
    logits = torch.zeros(q.shape[0], width)
    for b in range(table.shape[0]):
        pages = table[b].long()
        keys = k.view(torch.uint8)[:, :, pages].permute(2, 0, 1).reshape(width, 128)
        ks = scale[:, pages].t().reshape(width)
        rows = slice(b * next_n, (b + 1) * next_n)
        logits[rows] = em.logits_model(q[rows], inputs["weights"][rows],
                                       keys.view(torch.float8_e4m3fn), ks)  # fmt: skip
    lens = inputs["seq_lens"].repeat_interleave(next_n)
    ends = lens - (next_n - 1 - torch.arange(q.shape[0]) % next_n)
    return em.topk_model(logits, torch.zeros_like(ends), ends, p["topk"], table=table,
                         next_n=next_n)  # fmt: skip


SMALL = [c for c in S.CHECK_CASES if max(S._visible(c), key=lambda v: v[1])[1] <= 6000]


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
def test_the_judge_passes_the_kernels_model(case):
    inputs = _inputs(case)
    ids = _model_ids(inputs)
    (verdict,) = S.judge(inputs, (ids,))
    assert verdict["ok"], verdict["message"]
    assert verdict["err"] <= 1.0


def test_the_judge_refuses_wrong_selections():
    case = S.CHECK_CASES[0]
    inputs = _inputs(case, seed=1)
    ids = _model_ids(inputs)
    row = 6  # 5000 keys: a real selection
    bad = ids.clone()
    bad[row, 1] = bad[row, 0]
    assert "twice" in S.judge(inputs, (bad,))[0]["message"]
    bad = ids.clone()
    bad[row, 5] = -1
    assert "count" in S.judge(inputs, (bad,))[0]["message"]
    bad = ids.clone()
    bad[1, 69] = -1  # 70 keys, all selected
    bad[1, 70] = ids[1, 0] + 1 if int(ids[1, 0]) % 64 < 63 else ids[1, 0] - 1
    assert not S.judge(inputs, (bad,))[0]["ok"]
    # the worst key instead of a selected one: far below the k-th
    scores = S._scores(inputs)
    positions = S._positions(inputs, ids)
    worst = int(scores[row, :5000].argmin())
    assert worst not in positions[row].tolist()
    slot = int(inputs["table"][row, worst // 64]) * 64 + worst % 64
    bad = ids.clone()
    bad[row, 0] = slot
    verdict = S.judge(inputs, (bad,))[0]
    assert not verdict["ok"] and verdict["err"] > 1.0


def test_work_counts():
    case = S._paged([100, 3000], next_n=2, topk=512)
    assert S.flops(case) == 2 * 64 * 128 * (99 + 100 + 2999 + 3000)
    pre = S._prefill([3], [5])
    assert S.flops(pre) == 2 * 64 * 128 * (3 + 4 + 5)
    assert S.nbytes(case, torch.float8_e4m3fn) > 3100 * 132


def test_check_calls_the_judge_and_poisons_integer_outputs():
    suite = S.suite()
    case = SMALL[0]
    inputs = _inputs(case)
    assert check.expected(suite, inputs) == ((), ())
    out = check.poison(suite.alloc_out(inputs))
    assert check.unwritten(out) == out.numel()
    ids = _model_ids(inputs)
    fake = S.suite().__class__(**{**S.suite().__dict__, "run_ours": lambda i, o: o.copy_(ids)})
    _, cmps = check.verify(fake, inputs, CPU)
    assert len(cmps) == 1 and cmps[0].ok, cmps[0].message


def test_the_suite_waits_in_pending():
    assert "dsa_indexer" in PENDING_SUITE_MODULES
    assert "dsa_indexer" not in SUITE_MODULES or PENDING_SUITE_MODULES["dsa_indexer"]
    assert len(S.SANITIZE_CASES) >= 3 and all(c in S.CHECK_CASES for c in S.SANITIZE_CASES)
