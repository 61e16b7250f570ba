"""The dsa_recompute suite on the CPU (pending its GPU check): inputs that satisfy each case
(the forward's LSE, rows of -1, S_kv < topk, topk_length), the kernel's CPU model passing the
harness's comparison against the reference with the suite's tolerance, the work counts, and
the suite registered as pending."""

from __future__ import annotations

import pytest
import torch

from forgekernel.bench import check
from forgekernel.bench.suites import SUITE_MODULES
from forgekernel.bench.suites import dsa_recompute as S
from forgekernel.kernels.attention.dsa_recompute.sm90.emulate import emulate_target

CPU = torch.device("cpu")


def _inputs(case, dtype=torch.bfloat16, seed=0):
    return S.make_inputs(case, dtype, CPU, torch.Generator().manual_seed(seed))


def _model(inputs):
    q, kv, lse, idx, length = (inputs[k] for k in ("q", "kv", "lse", "idx", "length"))
    if q.dim() == 3:
        return emulate_target(q, kv, lse, idx, S.SOFTMAX_SCALE, length=length)
    b, s = q.shape[:2]
    got = emulate_target(q.flatten(0, 1), kv.flatten(0, 1), lse.flatten(0, 1),
                         idx.flatten(0, 1), S.SOFTMAX_SCALE,
                         length=None if length is None else length.flatten(),
                         s_q=s, s_kv=kv.shape[1])  # fmt: skip
    return got.view(b, s, -1)


SMALL = [c for c in S.CHECK_CASES if c.params["ctx"] <= 1000]


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_kernel_model_passes_the_check(case, dtype):
    inputs = _inputs(case, dtype)
    ref = S.reference(inputs)
    low = S.low_precision(inputs)
    verdict = check.compare(_model(inputs), ref, low, atol=S.suite().atol)
    assert verdict.ok, verdict.message
    assert torch.isfinite(ref).all()
    valid = inputs["idx"] >= 0  # (rows past topk_length hold -1: "end" padding)
    rows = valid.any(-1)
    torch.testing.assert_close(ref.sum(-1)[rows], torch.ones_like(ref.sum(-1)[rows]))
    assert (ref[~valid] == 0).all()


def test_odd_cases_are_what_they_say():
    by = {c.name: _inputs(c) for c in SMALL}
    short = next(v for k, v in by.items() if k.startswith("t4-h128-kv90"))
    assert (short["idx"][:, 90:] == -1).all()  # S_kv < topk
    empty = next(v for k, v in by.items() if "empty2" in k)
    assert (empty["idx"][:2] == -1).all() and torch.isneginf(empty["lse"][:2]).all()
    lens = next(v for k, v in by.items() if k.endswith("-len"))
    assert lens["length"] is not None
    assert (lens["length"] == (lens["idx"] >= 0).sum(1)).all()
    batched = next(v for k, v in by.items() if "-b2" in k)
    assert batched["q"].dim() == 4 and batched["idx"].max() < batched["kv"].shape[1]


def test_work_counts():
    for case in S.BENCH_CASES + S.CHECK_CASES:
        assert S.flops(case) > 0 and S.nbytes(case, torch.bfloat16) > S.flops(case) / 128
    big = S.BENCH_CASES[0]  # 4096 x top-2048 over 8192 keys, 16 heads
    assert S.flops(big) == 2 * 576 * 16 * sum(min(v, 2048) for v in S.visible(big))


def test_registered():
    assert SUITE_MODULES["dsa_recompute"] == "forgekernel.bench.suites.dsa_recompute"
    assert set(S.comparators()) == {"cudnn"}
