"""DSA's sparse pass over FlashMLA's FP8 cache in its `lean` form (candidate: compile key `lean`,
`launch.plan_form(lean=True)` / FORGEKERNEL_MLA_LEAN=1; MLA_NOTES.md "DSA FP8: the issue's
chain") on the GPU: every FP8 case of test_dsa_gpu.py and awkward ones (topk 1 and 65, one
token, rows of -1 only, page size 1, 24 heads in blocks of 8, the bench's three shapes cut in
length) against the fp32 reference on the dequantized latent (the suite's criterion), with
NaN-poisoned outputs; bit for bit the standard compile's out and LSE (the form moves loads and
prefetches, not arithmetic); -1 padding never reading a cache row (a page of NaN bytes in front);
a CUDA graph replayed on new lists. The sparse direct pass's `wide` form (plan_form(wide=True):
O staged in shared memory, 16-byte stores), alone and with `lean`: one-split plans at 16 / 64 / 8
heads a CTA, FP8 and 16-bit caches, a sink, bit for bit the scalar direct form, and the scalar
form taken for an out whose rows are not 16-byte aligned."""

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
]


def _lean_beside_standard(inputs):
    """(lean out, lse), after checking both forms against the reference and each other."""
    base = _run(inputs)
    with launch.plan_form(lean=True):
        out, lse = _run(inputs)
    _check(inputs, out, lse)
    assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    return out, lse


@pytest.mark.parametrize("case", FP8_CASES + AWKWARD, ids=lambda c: c.name)
def test_lean_matches_the_reference_and_the_standard(case):
    inputs = _inputs(case, torch.bfloat16, seed=7)
    _lean_beside_standard(inputs)


def test_lean_is_the_call_pick(monkeypatch):
    """plan_form(lean=True) builds its own plan with the `lean` key; the standard plan stays
    the standard compile's (both in one process, as the bench's variant)."""
    inputs = _inputs(AWKWARD[1], torch.bfloat16)
    picked = []
    real = launch.get_kernel

    def get_kernel(spec, params):
        picked.append(dict(params))
        return real(spec, params)

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    launch._plans.clear()
    _run(inputs)
    with launch.plan_form(lean=True):
        _run(inputs)
    _run(inputs)
    sparse = [k for k in picked if k["kind"] == "sparse"]
    assert [bool(k.get("lean")) for k in sparse] == [False, True]
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
    with launch.plan_form(lean=True):
        out, lse = _run(moved)
    assert torch.isfinite(out).all()
    _check(inputs, out, lse)


def test_lean_in_a_cuda_graph():
    """Captured once under the lean form, replayed on new queries and lists."""
    inputs = _inputs(_case(16, 16, 64, 8192, cache="fp8"), torch.bfloat16)
    q, idx = inputs["q"], inputs["idx"]
    out = torch.empty(*q.shape[:2], 512, device="cuda", dtype=q.dtype)

    def call():
        with launch.plan_form(lean=True):
            op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], None, idx,
                                    softmax_scale=SCALE, out=out)  # fmt: skip

    graph = captured(call)
    fresh = _inputs(_case(16, 16, 64, (0, 1, 5000, 2047, *([8192] * 12)), pad="scattered",
                          cache="fp8"), torch.bfloat16, seed=1)  # fmt: skip
    q.copy_(torch.randn_like(q))
    idx.copy_(fresh["idx"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _ = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound


# the sparse direct pass's `wide` form (plan_form(wide=True)): one-split plans, FP8 and 16-bit,
# 16 / 64 / 8 heads a CTA
WIDE = [
    (_case(128, 16, 64, 4096, cache="fp8"), torch.bfloat16),
    (_case(64, 128, 64, 4096, pad="scattered", cache="fp8"), torch.bfloat16),
    (_case(64, 128, 64, 4096), torch.float16),
    (_case(128, 16, 1, 3000, cache="split"), torch.bfloat16),
    (_case(512, 24, 64, 4096, prefill=True, pad="scattered", cache="fp8"), torch.bfloat16),
]


@pytest.mark.parametrize("lean", [False, True])
@pytest.mark.parametrize(("case", "dtype"), WIDE, ids=lambda c: getattr(c, "name", str(c)))
def test_wide_is_the_direct_form_bit_for_bit(case, dtype, lean):
    """O staged and stored by 16-byte vectors: the reference's result (NaN-poisoned out) and
    the scalar direct form's bits; an out whose rows are 2 bytes off 16 takes the scalar form
    (the same bits)."""
    if lean and case.params["cache"] != "fp8":
        pytest.skip("lean: FP8 caches only")
    inputs = _inputs(case, dtype, seed=3)
    base = _run(inputs)
    with launch.plan_form(wide=True, lean=lean):
        out, lse = _run(inputs)
        q = inputs["q"]
        odd = torch.full((*q.shape[:2], 513), float("nan"), device="cuda", dtype=q.dtype)[..., 1:]
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], inputs["kpe"],
                                inputs["idx"], softmax_scale=SCALE, out=odd)  # fmt: skip
    _check(inputs, out, lse)
    assert torch.equal(out, base[0]) and torch.equal(lse, base[1])
    assert torch.equal(odd, base[0])


def test_wide_with_a_sink():
    """The sink form's wide compile (compiled at the call): the scalar sink form's bits."""
    inputs = _inputs(_case(128, 16, 64, 4096, cache="fp8"), torch.bfloat16, seed=5)
    q = inputs["q"]
    sink = torch.randn(16, device="cuda", dtype=torch.float32)

    def call():
        out = torch.full((*q.shape[:2], 512), float("nan"), device="cuda", dtype=q.dtype)
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], None, inputs["idx"],
                                softmax_scale=SCALE, attn_sink=sink, out=out)  # fmt: skip
        return out

    base = call()
    with launch.plan_form(wide=True):
        out = call()
    assert torch.isfinite(out).all() and torch.equal(out, base)
