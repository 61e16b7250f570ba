"""DeepSeek sparse attention on the GPU (issue 22) against the fp32 reference (reference.dsa):
16 / 24 / 32 / 128 heads, page sizes 1 / 16 / 64, topk 64-2048 (200: not a multiple of the
kernel's 64-position tiles), -1 padding at the end and scattered, rows of -1 only, decode
batches of 1-128 tokens and a 1024-token prefill, FlashMLA's combined cache read through its
views and FlashInfer's split caches, fp16 and bf16, NaN-poisoned outputs (criterion: 2x the
same math in the input dtype + 1e-3, the suite's); query views the kernel cannot read in place
and a transposed index tensor; a CUDA graph replayed on new queries and lists; FlashInfer-Bench's
dsa_sparse_attention definitions through the adapter, by their own criterion (|ours - theirs|
<= 1e-2 or relative 1e-2 per element, bench/flashinfer_defs.py). FlashMLA's FP8 cache (bf16
queries): decode batches, padding, 16 / 128 heads, page sizes 1 / 64, a prefill, against the
reference on the dequantized latent (same criterion), in a CUDA graph, and beside FlashMLA's own
sparse decode (the suite's comparator) where sgl-flash-mla is installed. Plans of one split (the
bench's t128-h16 and t64-h128, a prefill; FP8 and 16-bit): the sparse pass's direct form, bit
for bit the partial pass + combine of the same plan (FORGEKERNEL_MLA_DIRECT=0), and beside a
plan forced to two splits (launch.plan_form)."""

from __future__ import annotations

import importlib

import pytest
import torch
from graphs import captured

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.bench.suites import dsa_sparse
from forgekernel.reference.dsa_flashinfer import SPARSE_ATTENTION, sparse_attention_inputs

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.dsa")
SCALE = dsa_sparse.SOFTMAX_SCALE
_case = dsa_sparse._case

CASES = [
    _case(1, 16, 64, (3000,)),
    _case(5, 16, 1, (1, 70, 0, 64, 200), topk=64, cache="split"),
    _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered"),
    _case(33, 16, 16, tuple(range(0, 33 * 97, 97)), pad="scattered"),
    _case(3, 128, 64, (700, 5, 1000), topk=512, pad="scattered"),
    _case(2, 24, 16, (50, 4000), topk=1024, cache="split"),
    _case(2, 32, 64, (0, 4096)),
    _case(128, 16, 64, 8192),
    _case(64, 128, 1, 4096, cache="split"),
    _case(1024, 16, 64, 8192, prefill=True, pad="scattered"),
]


FP8_CASES = [
    _case(1, 16, 64, (3000,), cache="fp8"),
    _case(5, 16, 1, (1, 70, 0, 64, 200), topk=64, cache="fp8"),
    _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered", cache="fp8"),
    _case(33, 16, 16, tuple(range(0, 33 * 97, 97)), pad="scattered", cache="fp8"),
    _case(3, 128, 64, (700, 5, 1000), topk=512, pad="scattered", cache="fp8"),
    _case(2, 24, 16, (50, 4000), topk=1024, cache="fp8"),
    _case(128, 16, 64, 8192, cache="fp8"),
    _case(64, 128, 64, 4096, cache="fp8"),
    _case(1024, 16, 64, 8192, prefill=True, pad="scattered", cache="fp8"),
]


def _inputs(case, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    return dsa_sparse.make_inputs(case, dtype, torch.device("cuda"), gen)


def _run(inputs, q=None, idx=None):
    q = inputs["q"] if q is None else q
    out = torch.full((*q.shape[:2], 512), float("nan"), device="cuda", dtype=q.dtype)
    got, lse = op.dsa_sparse_attention(
        q[..., :512], q[..., 512:], inputs["ckv"], inputs["kpe"],
        inputs["idx"] if idx is None else idx, softmax_scale=SCALE, out=out, return_lse=True,
    )  # fmt: skip
    assert got is out
    return out, lse


def _check(inputs, out, lse):
    want, want_lse = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float(torch.where(finite, lse - want_lse, 0.0).abs().max()) < 1e-3
    assert torch.all(out[~finite] == 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_dsa_sparse_matches_the_reference(case, dtype):
    inputs = _inputs(case, dtype)
    _check(inputs, *_run(inputs))


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: c.name)
def test_dsa_sparse_fp8_matches_the_reference(case):
    """FlashMLA's FP8 cache: the fp8 compile of the sparse pass (e4m3 latent dequantized into
    bf16, exact: tile 0 from registers, later tiles in place in their stage) against
    reference.dsa on the latent e4m3 x its scales."""
    inputs = _inputs(case, torch.bfloat16)
    assert inputs["ckv"].dtype == torch.float8_e4m3fn and inputs["kpe"] is None
    _check(inputs, *_run(inputs))
    as_bytes = dict(inputs, ckv=inputs["ckv"].view(torch.uint8))  # the same cache as bytes
    _check(as_bytes, *_run(as_bytes))


@pytest.mark.parametrize("cache", ["combined", "split", "fp8"])
def test_padding_never_reads_a_cache_row(cache):
    """-1 entries load zeros (16-bit) or a zero scale (FP8), not cache row 0: with a page 0 of
    NaNs that no valid entry names (every entry moved one page up), the outputs are those of
    the cache without it."""
    case = _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered", cache=cache)
    inputs = _inputs(case, torch.bfloat16)
    ps = case.params["page"]
    moved = dict(inputs, idx=torch.where(inputs["idx"] >= 0, inputs["idx"] + ps, -1))
    for name in ("ckv", "kpe"):
        t = inputs[name]
        if t is None:
            continue
        nan_page = torch.full_like(t[:1], float("nan")) if t.element_size() > 1 else (
            torch.full_like(t[:1].view(torch.uint8), 0xFF).view(t.dtype)  # NaN bytes / scales
        )  # fmt: skip
        moved[name] = torch.cat([nan_page, t])
    out, lse = _run(moved)
    assert torch.isfinite(out).all()
    _check(inputs, out, lse)


def test_dsa_sparse_fp8_beside_flashmla():
    """The suite's FP8 comparator (FlashMLA's sm90 sparse decode, sgl-flash-mla 1.0.0, called
    as read from its wheel) on the same cache and lists: its output close to ours."""
    flash_mla = pytest.importorskip("flash_mla")
    inputs = _inputs(_case(16, 16, 64, (3000,) * 8 + (100,) * 8, pad="scattered",
                           cache="fp8"), torch.bfloat16)  # fmt: skip
    out, _ = _run(inputs)
    call = dsa_sparse.flashmla_fp8_decode(flash_mla, inputs["q"][:, None], inputs["ckv"],
                                          inputs["idx"][:, None])  # fmt: skip
    theirs, _ = call()
    want, _ = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((theirs[:, 0].float() - want).abs().max()) <= 2 * bound
    assert float((out.float() - theirs[:, 0].float()).abs().max()) <= 2 * bound


def test_views_the_kernel_cannot_read_in_place():
    """q rows 2 bytes off 16 (copied by the launcher), a transposed index tensor (made
    contiguous): the same result."""
    inputs = _inputs(_case(6, 16, 64, (10, 2048, 0, 700, 3000, 64), pad="scattered"),
                     torch.bfloat16)  # fmt: skip
    q = inputs["q"]
    shifted = torch.empty(*q.shape[:2], 577, device="cuda", dtype=q.dtype)[..., 1:]
    shifted.copy_(q)
    idx_t = inputs["idx"].t().contiguous().t()
    out, lse = _run(inputs, q=shifted, idx=idx_t)
    _check(inputs, out, lse)


@pytest.mark.parametrize("cache", ["combined", "fp8"])
def test_dsa_sparse_in_a_cuda_graph(cache):
    """Captured once, replayed on new queries and top-k lists: no host read in the op."""
    case = _case(16, 16, 64, 8192, cache=cache)
    inputs = _inputs(case, torch.bfloat16)
    q, idx = inputs["q"], inputs["idx"]
    out = torch.empty(*q.shape[:2], 512, device="cuda", dtype=q.dtype)

    def call():
        op.dsa_sparse_attention(q[..., :512], q[..., 512:], inputs["ckv"], inputs["kpe"], idx,
                                softmax_scale=SCALE, out=out)  # fmt: skip

    graph = captured(call)
    fresh = _inputs(_case(16, 16, 64, (0, 1, 5000, 2047, *([8192] * 12)), pad="scattered",
                          cache=cache), torch.bfloat16, seed=1)  # fmt: skip
    assert int(fresh["idx"].max()) < inputs["ckv"].shape[0] * 64  # fewer pages: in this cache
    q.copy_(torch.randn_like(q))
    idx.copy_(fresh["idx"])
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    want, _ = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - want).abs().max()) <= bound


@pytest.mark.parametrize("name", SPARSE_ATTENTION)
def test_flashinfer_bench_definition_through_the_kernel(name):
    why = defs.missing(name)
    if why:
        pytest.skip(why)
    defn = defs.load_definition(name)
    ps = defn.const("page_size")
    g = torch.Generator().manual_seed(0)
    inputs = sparse_attention_inputs(ps, -(-6000 // ps), [2048, 1, 0, 700, 2048, 1500],
                                     generator=g)  # fmt: skip
    defs.check_inputs(defn, inputs)
    inputs = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in inputs.items()}
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    ours_out, ours_lse = op.dsa_sparse_attention_flashinfer(**inputs)
    assert ours_out.shape == theirs_out.shape and ours_lse.shape == theirs_lse.shape
    assert ours_out.dtype == theirs_out.dtype and torch.isfinite(ours_out).all()
    assert defs.benchmark_failures(ours_out, theirs_out) == 0
    assert defs.benchmark_failures(ours_lse, theirs_lse) == 0


# Plans of one split on the H200's 132 SMs (launch.sparse_split_plan): the direct form's cases.
# The bench's t128-h16 and t64-h128 (FP8 and bf16, page 1 and 64), rows listing no slot among
# them, a prefill of 24 heads (blocks of 8), and topk 200 (not a multiple of the 64-key tile).
DIRECT_CASES = [
    _case(128, 16, 64, 32768, cache="fp8"),
    _case(64, 128, 64, 8192, cache="fp8"),
    _case(128, 16, 64, tuple((0, 1, 5000, 2047) * 32), pad="scattered", cache="fp8"),
    _case(128, 16, 64, 8192),
    _case(128, 16, 1, 8192, cache="split"),
    _case(64, 128, 64, tuple((3000, 0) * 32), pad="scattered"),
    _case(512, 24, 64, 4096, prefill=True, pad="scattered"),
    _case(256, 16, 16, 600, topk=200, pad="scattered", cache="fp8"),
]


def _direct_dtypes(case):
    return [torch.bfloat16] if dsa_sparse.fp8(case) else [torch.bfloat16, torch.float16]


@pytest.mark.parametrize(
    ("case", "dtype"),
    [(c, d) for c in DIRECT_CASES for d in _direct_dtypes(c)],
    ids=lambda x: x.name if hasattr(x, "name") else str(x).removeprefix("torch."),
)
def test_direct_form_is_the_combine_of_one_split(case, dtype, monkeypatch):
    """The sparse pass's direct form (one launch writing the NaN-poisoned out and the lse, no
    combine) against the reference, and bit for bit against the partial pass + combine of the
    same one-split plan (FORGEKERNEL_MLA_DIRECT=0): O equal, LSE equal (both x ln 2 of the same
    fp32 log2 value)."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    from forgekernel.kernels.attention.mla.sm90.config import heads_per_cta
    from forgekernel.runtime.device import num_sms

    p = case.params
    blocks = p["hq"] // heads_per_cta(p["hq"])
    splits, _ = launch.sparse_split_plan(p["tokens"], blocks, p["topk"], num_sms(0), 1)
    assert splits == 1, "not a one-split plan on this GPU"
    inputs = _inputs(case, dtype)
    keys = []
    real = launch.get_kernel
    monkeypatch.setattr(launch, "get_kernel", lambda spec, k: keys.append(dict(k)) or real(spec, k))
    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", flag)
        launch._plans.clear()
        out, lse = _run(inputs)
        torch.cuda.synchronize()
        kinds = [k["kind"] for k in keys]
        assert kinds == (["sparse"] if flag == "1" else ["combine", "sparse"])
        assert keys[-1].get("direct", False) == (flag == "1")
        keys.clear()
        _check(inputs, out, lse)
        results.append((out, lse))
    launch._plans.clear()
    (out, lse), (split_out, split_lse) = results
    assert torch.equal(out, split_out)
    assert torch.equal(lse, split_lse)


@pytest.mark.parametrize("case", [c for c in DIRECT_CASES if c.params["topk"] == 2048][:2],
                         ids=lambda c: c.name)  # fmt: skip
def test_direct_form_beside_two_splits(case):
    """The bench's t128-h16 and t64-h128 (FP8): the direct form beside the plan forced to two
    splits of 16 tiles (the bench's variant per16: partial pass + combine), both within the
    criterion of the reference and of each other."""
    launch = importlib.import_module("forgekernel.kernels.attention.mla.sm90.launch")
    inputs = _inputs(case, torch.bfloat16)
    out, lse = _run(inputs)
    with launch.plan_form(per_tiles=16):
        split_out, split_lse = _run(inputs)
    _check(inputs, out, lse)
    _check(inputs, split_out, split_lse)
    want, _ = dsa_sparse.reference(inputs)
    low, _ = dsa_sparse.low_precision(inputs)
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    assert float((out.float() - split_out.float()).abs().max()) <= 2 * bound
    finite = torch.isfinite(lse)
    assert torch.equal(finite, torch.isfinite(split_lse))
    assert float((lse[finite] - split_lse[finite]).abs().max()) < 1e-4
