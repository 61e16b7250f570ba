"""The MLA seesaw pass's `creduce` form (candidate: launch.plan_form(creduce=True) or
FORGEKERNEL_MLA_CREDUCE=1; seesaw.py `_reduce_cluster`, MLA_NOTES.md "The mid cases' fixed
cost") on the GPU: a plan of 2, 4 or 8 splits runs each unit's splits as one cluster that reduces
them over its shared memory into out and lse (one launch, no combine). Page 64 (and 128), FlashMLA's
combined cache and the split caches, 16 and 128 heads, s_q 1 and 2, ragged lengths with 0 and 1
keys, NaN in every stale page slot and in out before the call: against the fp64 reference (2x
the same math in the input dtype + 1e-3); bit for bit the same plan through the fp32 partials
and the combine (the same staged values, the combine's few-path arithmetic in its order); a
PDL chain of calls bit for bit the serialized one."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_mla_gpu import SCALE, _check, _poison_stale, _problem, _recorded_keys

from forgekernel.reference.mla import mla_decode_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.mla")
launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")

CASES = [
    # b, hq, page_size, lens, s_q, combined, the plan's splits (the cluster's size)
    (16, 16, 64, [4096] * 16, 1, True, 8),  # the suite's b16-h16-p64-L4096
    (32, 16, 64, [2048] * 32, 1, True, 4),  # b32-h16-p64-L2048
    (64, 16, 64, [4096] * 64, 2, True, 2),  # b64-h16-p64-L4096-sq2
    (6, 16, 64, [2048, 2047, 0, 1, 1500, 64], 1, False, 8),
    (4, 16, 64, [1024, 0, 1, 700], 1, True, 4),
    (4, 16, 128, [1024, 0, 1, 700], 1, False, 4),  # pages of two tiles
    (4, 16, 64, [1000, 64, 0, 1], 2, False, 4),
    (16, 128, 64, [4096] * 16, 1, True, 4),  # b16-h128-p64-L4096: 64-head blocks
    (4, 128, 64, [1024, 65, 1, 0], 1, False, 4),
]


def _ids(c) -> str:
    return f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}_s{c[6]}" + ("_comb" if c[5] else "")


def _call(inputs, dtype, creduce: bool):
    qn, qp, ckv, kpe, table, seq = inputs
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
    lse = torch.full((qn.shape[0], qn.shape[2], qn.shape[1]), float("nan"), device="cuda")
    launch._plans.clear()
    with launch.plan_form(creduce=creduce):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out, lse=lse,
                      return_lse=True)  # fmt: skip
    torch.cuda.synchronize()
    launch._plans.clear()
    return out, lse


def _inputs(case, dtype):
    b, hq, ps, lens, s_q, combined, _ = case
    inputs = _problem(b, hq, ps, lens, s_q, combined, dtype)
    _poison_stale(inputs[2], inputs[3], inputs[4], lens, ps)
    return inputs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_creduce_matches_the_reference(case, dtype, monkeypatch):
    inputs = _inputs(case, dtype)
    want, want_lse = mla_decode_ref(*inputs, SCALE)
    low, _ = mla_decode_ref(*inputs, SCALE, upcast=False)
    keys = _recorded_keys(launch, monkeypatch)
    out, lse = _call(inputs, dtype, True)
    assert [k["kind"] for k in keys] == ["partial"]  # one launch: no combine
    assert keys[0]["creduce"] == case[6] and keys[0]["tma"]
    _check(out, lse, want, want_lse, low)
    assert not torch.isnan(out).any()
    assert not torch.isnan(lse).any()  # (_check's isfinite would pass a NaN where -inf is due)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES[3:], ids=_ids)
def test_creduce_is_the_combine_bit_for_bit(case, dtype, monkeypatch):
    """The same plan through the fp32 partials and the combine (its CTA form's few path at
    these sizes): the same staged values, max, weights, butterfly sum, split-order FMAs and
    division. A mismatch in the last bits is an arithmetic-order difference (ptxas contracting
    differently), not a fault: the reference test decides correctness."""
    inputs = _inputs(case, dtype)
    keys = _recorded_keys(launch, monkeypatch)
    out, lse = _call(inputs, dtype, True)
    out_s, lse_s = _call(inputs, dtype, False)
    assert keys[0].get("creduce") and not any("creduce" in k for k in keys[1:])
    assert sorted(k["kind"] for k in keys[1:]) == ["combine", "partial"]
    assert torch.equal(out, out_s)
    assert torch.equal(lse, lse_s)


def test_creduce_pdl_chain_is_the_serialized_chain(monkeypatch):
    """Eight chained calls, q_nope of each the previous out (as a layer's input is the last
    one's output), launched back to back (PDL: the next pass's CTAs start under this one's
    cluster tail) against the same chain synchronized after every call: bit for bit."""
    case = CASES[0]
    qn, qp, ckv, kpe, table, seq = _inputs(case, torch.bfloat16)

    def chain(sync: bool):
        q = qn.clone()
        launch._plans.clear()
        with launch.plan_form(creduce=True):
            for _ in range(8):
                out = op.mla_decode(q, qp, ckv, kpe, table, seq, softmax_scale=SCALE)
                if sync:
                    torch.cuda.synchronize()
                q = out.contiguous()
        torch.cuda.synchronize()
        launch._plans.clear()
        return q

    assert torch.equal(chain(False), chain(True))


def test_creduce_is_off_by_default(monkeypatch):
    monkeypatch.delenv("FORGEKERNEL_MLA_CREDUCE", raising=False)
    inputs = _inputs(CASES[4], torch.bfloat16)
    keys = _recorded_keys(launch, monkeypatch)
    launch._plans.clear()
    op.mla_decode(*inputs, softmax_scale=SCALE)
    torch.cuda.synchronize()
    launch._plans.clear()
    assert sorted(k["kind"] for k in keys) == ["combine", "partial"]
    assert not any("creduce" in k for k in keys)
