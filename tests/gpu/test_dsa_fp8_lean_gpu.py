"""DSA's sparse pass over FlashMLA's FP8 cache in its adopted forms (MLA_NOTES.md "lean and
lean_wide adopted"): `lean` (compile key `lean`) the default at 16 heads a CTA (split and
one-split plans) and on 64-head one-split plans (64-head split plans: the form before), `wide`
with it on 64-head direct plans; `launch.plan_form(lean=False)` / FORGEKERNEL_MLA_LEAN=0 the form
before (the bench's `was`). On the GPU: every FP8 case of test_dsa_gpu.py and awkward ones (topk 1
and 65, one token, rows of -1 only, page size 1, 24 heads in blocks of 8, the bench's three
shapes cut in length) against the fp32 reference on the dequantized latent (the suite's
criterion), with NaN-poisoned outputs, and bit for bit the form before's out and LSE (the forms
move loads, prefetches and stores, not arithmetic); the plan's pick; -1 padding never reading a
cache row (a page of NaN bytes in front); a CUDA graph replayed on new lists. `wide`: one-split
plans at 16 (plan_form(wide=True)) / 64 (the default) / 8 heads a CTA, FP8 and 16-bit caches,
a sink, bit for bit the scalar direct form, and the scalar form taken for an out whose rows are
not 16-byte aligned."""

from __future__ import annotations

import pytest
import torch
from graphs import captured
from test_dsa_gpu import FP8_CASES, SCALE, _case, _check, _inputs, _run, op

from forgekernel.bench.suites import dsa_sparse
from forgekernel.kernels.attention.mla.sm90 import launch

pytestmark = pytest.mark.gpu

AWKWARD = [
    _case(1, 16, 64, (1,), topk=1, cache="fp8"),
    _case(3, 16, 16, (65, 0, 7), topk=65, pad="scattered", cache="fp8"),
    _case(7, 16, 1, (0, 0, 0, 0, 0, 0, 0), topk=64, cache="fp8"),
    _case(9, 24, 1, tuple(range(1, 900, 100)), topk=333, pad="scattered", cache="fp8"),
    _case(2, 128, 16, (1000, 3), topk=1000, pad="scattered", cache="fp8"),
    # the bench's shapes, shorter contexts: one split at 16 and 128 heads, two splits at t64
    _case(128, 16, 64, 4096, cache="fp8"),
    _case(64, 128, 64, 4096, cache="fp8"),
    _case(64, 16, 64, 4096, pad="scattered", cache="fp8"),
    # one tile a token at 128 heads: the check case of the 64-head lean + wide direct compile
    _case(3, 128, 16, (40, 0, 64), topk=64, pad="scattered", cache="fp8"),
]


def _default_beside_the_form_before(inputs):
    """(the default's out, lse), after checking it against the reference and the form before's
    bits."""
    with launch.plan_form(lean=False):
        base = _run(inputs)
    out, lse = _run(inputs)
    _check(inputs, out, lse)
    assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    return out, lse


@pytest.mark.parametrize("case", FP8_CASES + AWKWARD, ids=lambda c: c.name)
def test_the_default_matches_the_reference_and_the_form_before(case):
    inputs = _inputs(case, torch.bfloat16, seed=7)
    _default_beside_the_form_before(inputs)


@pytest.mark.parametrize("case", [AWKWARD[1], AWKWARD[6]], ids=lambda c: c.name)
def test_the_call_picks(case, monkeypatch):
    """The default's plan takes `lean` (and at 64 heads a CTA on a one-split plan `wide`),
    plan_form(lean=False) its own plan with neither (both in one process, as the bench's `was`)."""
    inputs = _inputs(case, torch.bfloat16)
    picked = []
    real = launch.get_kernel

    def get_kernel(spec, params):
        picked.append(dict(params))
        return real(spec, params)

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    launch._plans.clear()
    _run(inputs)
    with launch.plan_form(lean=False):
        _run(inputs)
    _run(inputs)
    sparse = [(bool(k.get("lean")), bool(k.get("wide"))) for k in picked if k["kind"] == "sparse"]
    assert sparse == [(True, case.params["hq"] == 128), (False, False)]
    launch._plans.clear()


def test_lean_padding_never_reads_a_cache_row():
    """-1 entries read a zero scale, not cache row 0 (nor its prefetch's effect): with a page 0 of
    NaN bytes that no valid entry names, the outputs are those of the cache without it."""
    case = _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered", cache="fp8")
    inputs = _inputs(case, torch.bfloat16)
    moved = dict(inputs, idx=torch.where(inputs["idx"] >= 0, inputs["idx"] + 64, -1))
    t = inputs["ckv"]
    nan_page = torch.full_like(t[:1].view(torch.uint8), 0xFF).view(t.dtype)
    moved["ckv"] = torch.cat([nan_page, t])
    out, lse = _run(moved)
    assert torch.isfinite(out).all()
    _check(inputs, out, lse)


@pytest.mark.parametrize("hq", [16, 128])
def test_lean_in_a_cuda_graph(hq):
    """The default captured once, replayed on new queries and lists (128 heads: lean + wide)."""
    tokens = 16 if hq == 16 else 64
    inputs = _inputs(_case(tokens, hq, 64, 8192, cache="fp8"), torch.bfloat16)
    q, idx = inputs["q"], inputs["idx"]
    out = torch.empty(*q.shape[:2], 512, device="cuda", dtype=q.dtype)

    def call():
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], None, idx,
                                softmax_scale=SCALE, out=out)  # fmt: skip

    graph = captured(call)
    lens = (0, 1, 5000, 2047, *([8192] * (tokens - 4)))
    fresh = _inputs(_case(tokens, hq, 64, lens, pad="scattered", cache="fp8"), torch.bfloat16,
                    seed=1)  # fmt: skip
    q.copy_(torch.randn_like(q))
    idx.copy_(fresh["idx"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _ = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound


# the sparse direct pass's `wide` form: one-split plans, FP8 and 16-bit, 16 / 64 / 8 heads a CTA
WIDE = [
    (_case(128, 16, 64, 4096, cache="fp8"), torch.bfloat16),
    (_case(64, 128, 64, 4096, pad="scattered", cache="fp8"), torch.bfloat16),
    (_case(64, 128, 64, 4096), torch.float16),
    (_case(128, 16, 1, 3000, cache="split"), torch.bfloat16),
    (_case(512, 24, 64, 4096, prefill=True, pad="scattered", cache="fp8"), torch.bfloat16),
]


@pytest.mark.parametrize("wide", [None, True])
@pytest.mark.parametrize(("case", "dtype"), WIDE, ids=lambda c: getattr(c, "name", str(c)))
def test_wide_is_the_direct_form_bit_for_bit(case, dtype, wide):
    """The default (wide None: the 16-byte stores at 64 heads over FP8) and plan_form(wide=True)
    (everywhere): the reference's result (NaN-poisoned out) and the scalar direct form's bits
    (the form before); an out whose rows are 2 bytes off 16 takes the scalar form (the same
    bits)."""
    inputs = _inputs(case, dtype, seed=3)
    with launch.plan_form(lean=False, wide=False):
        base = _run(inputs)
    with launch.plan_form(wide=wide):
        out, lse = _run(inputs)
        q = inputs["q"]
        odd = torch.full((*q.shape[:2], 513), float("nan"), device="cuda", dtype=q.dtype)[..., 1:]
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], inputs["kpe"],
                                inputs["idx"], softmax_scale=SCALE, out=odd)  # fmt: skip
    _check(inputs, out, lse)
    assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    assert torch.equal(odd, base[0])


@pytest.mark.parametrize(("hq", "wide"), [(16, None), (16, True), (128, None)])
def test_the_sink_forms(hq, wide):
    """The sink's lean compiles (16 heads; 64 with wide, prebuilt; 16 with wide compiled at the
    call): the form before's sink bits."""
    tokens = 128 if hq == 16 else 64
    inputs = _inputs(_case(tokens, hq, 64, 4096, cache="fp8"), torch.bfloat16, seed=5)
    q = inputs["q"]
    sink = torch.randn(hq, device="cuda", dtype=torch.float32)

    def call():
        out = torch.full((*q.shape[:2], 512), float("nan"), device="cuda", dtype=q.dtype)
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], None, inputs["idx"],
                                softmax_scale=SCALE, attn_sink=sink, out=out)  # fmt: skip
        return out

    with launch.plan_form(lean=False):
        base = call()
    with launch.plan_form(wide=wide):
        out = call()
    assert torch.isfinite(out).all() and torch.equal(out, base)
