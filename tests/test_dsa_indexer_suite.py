"""The dsa_indexer suite on the CPU (pending its GPU check): inputs that satisfy each case, the
order-free judge accepting the exact selection (the kernels' CPU model) and near-ties within
its tolerance, and refusing duplicates, missing ids, hidden keys and a wrong pick; the work
counts; the harness calling the judge instead of an element-wise reference."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from forgekernel.bench import check
from forgekernel.bench.suites import SUITE_MODULES
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
    assert S.in_position_order(inputs, ids)


def test_paged_order_is_by_position_not_by_slot():
    """The kernels' paged rows ascend in sequence position; their slot ids follow the shuffled
    pages (the 2026-12-02 GPU test asserted ascending slots and failed every decode case)."""
    inputs = _inputs(S.CHECK_CASES[0])
    ids = _model_ids(inputs)
    slots = torch.where(ids >= 0, ids, torch.iinfo(torch.int32).max)
    assert not bool((slots[:, 1:] >= slots[:, :-1]).all())
    assert S.in_position_order(inputs, ids)
    swapped = ids.clone()
    swapped[6, [0, 1]] = ids[6, [1, 0]]
    assert not S.in_position_order(inputs, swapped)
    padded_first = ids.clone()
    padded_first[1] = ids[1].roll(1)  # 70 keys of 2048: -1 before them
    assert not S.in_position_order(inputs, padded_first)


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


def test_deep_gemm_context_lens_are_each_rows_visible_keys():
    for case in S.CHECK_CASES[:5]:
        p = case.params
        lens = S.deep_gemm_context_lens(torch.tensor(p["lens"], dtype=torch.int32), p["next_n"])
        assert lens.dtype == torch.int32 and lens.is_contiguous()
        assert lens.shape == (len(p["lens"]), p["next_n"])
        assert lens.flatten().tolist() == [seen for _, seen in S._visible(case)], case.name


def _fake_deep_gemm(inputs) -> types.ModuleType:
    """sgl-deep-gemm 0.1.4's calling contract on the CPU: 2-D context_lens (its
    `context_lens.dim() == 2`), no clean_logits with them, and logits past each row's length
    left as garbage (huge, so that an unmasked one would be picked)."""
    fake = types.ModuleType("deep_gemm")
    sms = 7

    def metadata(context_lens, block_kv, num_sms, indices=None):
        assert context_lens.dim() == 2 and context_lens.dtype == torch.int32
        assert context_lens.is_contiguous() and block_kv == 64 and num_sms == sms
        return torch.zeros(num_sms + 1, 2, dtype=torch.int32)

    def paged(q, kv_cache, weights, context_lens, block_table, schedule_meta, max_context_len,
              clean_logits=False, indices=None):  # fmt: skip
        b, next_n = q.shape[:2]
        assert q.dim() == 4 and q.is_contiguous() and kv_cache.dtype == torch.uint8
        assert context_lens.shape == (b, next_n) and not clean_logits
        assert schedule_meta.shape == (sms + 1, 2) and weights.shape == (b * next_n, 64)
        assert max_context_len == block_table.shape[1] * 64
        real = S._scores(inputs).float()
        cols = torch.arange(max_context_len)
        return torch.where(cols[None, :] < context_lens.reshape(-1, 1), real, 1e30)

    def contiguous(q, kv, weights, ks, ke, clean_logits=False, max_seqlen_k=0):
        assert clean_logits and kv[0].shape[0] == kv[1].shape[0]
        return S._scores(inputs).float()

    fake.get_num_sms = lambda: sms
    fake.get_paged_mqa_logits_metadata = metadata
    fake.fp8_paged_mqa_logits = paged
    fake.fp8_mqa_logits = contiguous
    return fake


@pytest.mark.parametrize("case", [S.CHECK_CASES[0], S.CHECK_CASES[1], S.CHECK_CASES[6]],
                         ids=lambda c: c.name)  # fmt: skip
def test_deep_gemm_comparator_calls_the_2d_context_lens_api(case, monkeypatch):
    inputs = _inputs(case, seed=3)
    monkeypatch.setitem(sys.modules, "deep_gemm", _fake_deep_gemm(inputs))
    run = S._deep_gemm()
    ids = run(inputs)
    (verdict,) = S.judge(inputs, (ids,))
    assert verdict["ok"], verdict["message"]


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


def test_the_suite_is_registered():
    assert SUITE_MODULES["dsa_indexer"] == "forgekernel.bench.suites.dsa_indexer"
    assert len(S.SANITIZE_CASES) >= 3 and all(c in S.CHECK_CASES for c in S.SANITIZE_CASES)
