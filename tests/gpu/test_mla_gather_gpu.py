"""The MLA seesaw pass's gather form (seesaw.py, MLA_NOTES.md "The seesaw over gathered rows",
"gather adopted": the default at page size 1, FORGEKERNEL_MLA_GATHER=1 at the other page sizes
off the tile) on the GPU: pages of 1 and 16 rows, 16 and 128 heads, s_q 1 and 2, ragged lengths
with 0 and 1 keys, FlashInfer's split caches and FlashMLA's combined one, NaN in every stale page
slot and in out before the call, against the fp64 reference (2x the same math in the input dtype
+ 1e-3), and bit for bit against the page-64 seesaw (TMA boxes) on the same keys laid out in
64-row pages (the same plan: the table's width gives the same tiles; the same arithmetic on the
same keys, the stale rows masked and zeroed in both). The direct form (a plan of one split) bit
for bit its partial form + the combine. The rule: page 1 takes the form unasked, page 16 does
not, FORGEKERNEL_MLA_GATHER=0 keeps page 1 on decode.py's pass (the bench's `was`)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_mla_gpu import (
    SCALE,
    _check,
    _direct_is_the_split,
    _poison_stale,
    _problem,
    _recorded_keys,
)

from forgekernel.reference.mla import mla_decode_ref

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.mla")
launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")

RAGGED = [(i * 7919) % 1000 for i in range(40)] + [0, 1]
GATHER_CASES = [
    # b, hq, page_size, lens, s_q, combined
    (4, 16, 1, [1, 0, 300, 4096], 1, False),
    (3, 128, 1, [0, 1, 2000], 1, False),
    (3, 16, 16, [17, 0, 1000], 2, False),
    (2, 128, 16, [1, 700], 2, True),
    (3, 16, 1, [65, 129, 64], 2, True),
    (64, 16, 1, [4096] * 64, 1, False),  # the suite's b64-h16-p1-L4096: splits of whole tiles
    (16, 128, 1, [4096] * 16, 1, False),  # b16-h128-p1-L4096
    (42, 16, 16, RAGGED, 1, False),
    (42, 128, 1, RAGGED, 1, False),
]


def _ids(c) -> str:
    return f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}" + ("_comb" if c[5] else "")


def _as_64_pages(ckv, kpe, table, lens, ps):
    """The same keys in 64-row pages (sequence i's keys 0 .. n - 1 in order, NaN past n), the
    table of the same width in tokens rounded up to 64: the page-64 seesaw's inputs."""
    width = -(-table.shape[1] * ps // 64)
    b = len(lens)

    def rows(cache):
        flat = cache[table.long()].flatten(1, 2)  # (b, width_ps x ps, ...)
        out = torch.full((b, width * 64, *cache.shape[2:]), float("nan"), dtype=cache.dtype,
                         device=cache.device)  # fmt: skip
        for i, n in enumerate(lens):
            out[i, :n] = flat[i, :n]
        return out.view(b * width, 64, *cache.shape[2:])

    table64 = torch.arange(b * width, dtype=torch.int32, device=table.device).view(b, width)
    return rows(ckv), None if kpe is None else rows(kpe), table64


def _call(inputs, dtype):
    qn, qp, ckv, kpe, table, seq = inputs
    out = torch.full((*qn.shape[:-1], 512), float("nan"), device="cuda", dtype=dtype)
    _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                           return_lse=True)  # fmt: skip
    torch.cuda.synchronize()
    return out, lse


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", GATHER_CASES, ids=_ids)
def test_gather_matches_the_reference_and_the_page64_seesaw(case, dtype, monkeypatch):
    b, hq, ps, lens, s_q, combined = case
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, ps, lens, s_q, combined, dtype)
    _poison_stale(ckv, kpe, table, lens, ps)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    keys = _recorded_keys(launch, monkeypatch)
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER", raising=False)
    if ps != 1:  # page 1 by the rule, the others by the switch
        monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "1")
    launch._plans.clear()
    out, lse = _call((qn, qp, ckv, kpe, table, seq), dtype)
    partial = [k for k in keys if k["kind"] == "partial"][-1]
    assert partial.get("gather", False) and partial.get("tma", False)
    _check(out, lse, want, want_lse, low)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    ckv64, kpe64, table64 = _as_64_pages(ckv, kpe, table, lens, ps)
    launch._plans.clear()
    out64, lse64 = _call((qn, qp, ckv64, kpe64, table64, seq), dtype)
    partial = [k for k in keys if k["kind"] == "partial"][-1]
    assert partial.get("tma", False) and not partial.get("gather", False)
    launch._plans.clear()
    assert torch.equal(out, out64)
    assert torch.equal(lse, lse64)


DIRECT_CASES = [
    (132, 16, 1, [(i * 7919) % 1000 for i in range(132)], 1),  # 16 x 1
    (132, 128, 16, [(i * 7919) % 700 for i in range(132)], 1),  # 64 x 1 (ostore)
    (66, 128, 1, [(i * 7919) % 300 for i in range(66)], 2),  # 32 x 2 (ostore)
    (132, 16, 16, [(i * 7919) % 500 for i in range(132)], 2),  # 16 x 2
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", DIRECT_CASES, ids=lambda c: f"b{c[0]}_h{c[1]}_p{c[2]}_sq{c[4]}")
def test_gather_direct_form_is_the_combine_of_one_split(case, dtype, monkeypatch):
    b, hq, ps, lens, s_q = case
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, ps, lens, s_q, False, dtype)
    _poison_stale(ckv, kpe, table, lens, ps)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "1")
    keys = _recorded_keys(launch, monkeypatch)
    _direct_is_the_split(launch, monkeypatch, (qn, qp, ckv, kpe, table, seq),
                         (want, want_lse, low), dtype)  # fmt: skip
    partials = [k for k in keys if k["kind"] == "partial"]
    assert len(partials) == 2 and all(k.get("gather", False) for k in partials)
    assert partials[0].get("ostore", False) == (hq == 128)  # (out's rows 16-byte aligned)


@pytest.mark.parametrize(("ps", "flag"), [(1, None), (1, "0"), (16, None), (16, "0")])
def test_the_rule_page1_only_and_the_plan_before(ps, flag, monkeypatch):
    """Unasked, page 1 runs the gather form and page 16 decode.py's role-split pass;
    FORGEKERNEL_MLA_GATHER=0 keeps page 1 on decode.py's pass (the plan before, the bench's
    `was`); each against the reference."""
    monkeypatch.delenv("FORGEKERNEL_MLA_GATHER", raising=False)
    if flag is not None:
        monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", flag)
    lens = [5, 0, 300, 1]
    qn, qp, ckv, kpe, table, seq = _problem(4, 16, ps, lens, 1, False, torch.bfloat16)
    _poison_stale(ckv, kpe, table, lens, ps)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    keys = _recorded_keys(launch, monkeypatch)
    launch._plans.clear()
    out, lse = _call((qn, qp, ckv, kpe, table, seq), torch.bfloat16)
    launch._plans.clear()
    partial = [k for k in keys if k["kind"] == "partial"][-1]
    gather = ps == 1 and flag is None
    assert partial.get("gather", False) == gather and partial.get("tma", False) == gather
    _check(out, lse, want, want_lse, low)
