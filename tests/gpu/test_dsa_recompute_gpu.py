"""The DSA score recompute on the GPU (issue 22): the suite's check cases through the harness's
comparison, the fp64 reference on odd shapes (every compiled H, topk 1 / 63 / 64 / 65 / 2048,
S_kv < topk, rows of -1, heads whose lse is -inf, entries past S_kv, topk_length, many tiles
around the ring), the batched form with per-batch and global indices, strided inputs and a
strided out, CUDA-graph capture, the kernel's CPU model, and cuDNN-frontend's
sparse_attn_score_recompute_wrapper (where installed) on the same tensors."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.bench import check
from forgekernel.bench.suites import dsa_recompute as S
from forgekernel.kernels.attention.dsa_recompute.sm90.emulate import emulate_target
from forgekernel.ops.dsa_recompute import dsa_score_recompute
from forgekernel.reference import dsa

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
SCALE = S.SOFTMAX_SCALE
F64 = torch.float64


def _suite_inputs(case, dtype=torch.bfloat16, seed=0):
    return S.make_inputs(case, dtype, CUDA, torch.Generator(CUDA).manual_seed(seed))


@pytest.mark.parametrize("case", S.CHECK_CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_check_cases(case, dtype):
    inputs = _suite_inputs(case, dtype)
    out = torch.full_like(S.alloc_out(inputs), float("nan"))
    S.run_ours(inputs, out)
    verdict = check.compare(out, S.reference(inputs), S.low_precision(inputs), atol=S.suite().atol)
    assert verdict.ok, verdict.message


def _problem(s, h, s_kv, topk, *, pad=0.2, seed=0, dtype=torch.bfloat16):
    gen = torch.Generator(CUDA).manual_seed(seed)
    q = torch.randn(s, h, 576, device=CUDA, generator=gen).to(dtype)
    kv = torch.randn(s_kv, 576, device=CUDA, generator=gen).to(dtype)
    width = max(topk, s_kv)
    pos = torch.rand(s, width, device=CUDA, generator=gen).argsort(1)[:, :topk]
    pos = pos.masked_fill(pos >= s_kv, -1)
    drop = torch.rand(s, topk, device=CUDA, generator=gen) < pad
    idx = pos.masked_fill(drop, -1).to(torch.int32)
    lse = S.forward_lse(q, kv, idx, SCALE)
    return q, kv, lse, idx


def _ref(q, kv, lse, idx, length=None):
    return dsa.dsa_score_target_ref(q, kv, lse, idx, SCALE, topk_length=length, dtype=F64)


def _close(got, want):
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=1e-4, atol=2e-7)


@pytest.mark.parametrize("h", [16, 32, 64, 128])
@pytest.mark.parametrize("topk", [1, 63, 64, 65, 2048])
def test_odd_topk_every_heads(h, topk):
    q, kv, lse, idx = _problem(5, h, 3000, topk, seed=h + topk)
    _close(dsa_score_recompute(q, kv, lse, idx, SCALE), _ref(q, kv, lse, idx))


def test_short_kv_empty_rows_dead_heads_and_out_of_range_entries():
    q, kv, lse, idx = _problem(6, 128, 90, 256, pad=0.0, seed=3)
    idx[2] = -1  # a row of -1
    lse[3, 5] = -math.inf  # a head that saw nothing adds 0
    got = dsa_score_recompute(q, kv, lse, idx, SCALE)
    assert (got[2] == 0).all()
    _close(got, _ref(q, kv, lse, idx))
    past = idx.clone()
    past[0, :7] = 90 + torch.arange(7, device=CUDA, dtype=torch.int32)  # >= S_kv: padding
    want = _ref(q, kv, lse, torch.where(past >= 90, -1, past))
    _close(dsa_score_recompute(q, kv, lse, past, SCALE), want)


def test_topk_length_and_many_tiles_around_the_ring():
    q, kv, lse, idx = _problem(3, 16, 20000, 64 * 40 + 5, pad=0.1, seed=4)  # 41 tiles
    length = torch.tensor([0, 1000, 64 * 40 + 5], device=CUDA, dtype=torch.int32)
    got = dsa_score_recompute(q, kv, lse, idx, SCALE, topk_length=length)
    _close(got, _ref(q, kv, lse, idx, length))
    assert (got[0] == 0).all() and (got[1, 1000:] == 0).all()


def test_batched_local_and_global_indices():
    parts = [_problem(4, 64, 500, 192, seed=10 + b) for b in range(3)]
    q, kv, lse, idx = (torch.stack([p[i] for p in parts]) for i in range(4))
    want = torch.stack([_ref(*p) for p in parts])
    _close(dsa_score_recompute(q, kv, lse, idx, SCALE), want)
    base = (torch.arange(3, device=CUDA, dtype=torch.int32) * 500)[:, None, None]
    glob = torch.where(idx >= 0, idx + base, -1)
    _close(dsa_score_recompute(q, kv, lse, glob, SCALE, indices_global=True), want)


def test_strided_inputs_and_out():
    q, kv, lse, idx = _problem(7, 32, 800, 130, seed=5)
    wide_q = torch.zeros(7, 32, 640, device=CUDA, dtype=q.dtype)
    wide_q[..., :576] = q
    wide_kv = torch.zeros(800, 600, device=CUDA, dtype=kv.dtype)
    wide_kv[:, :576] = kv
    lse_t = lse.t().contiguous().t()  # (S, H) with strides (1, S)
    out = torch.full((130, 7), float("nan"), device=CUDA).t()  # non-contiguous
    res = dsa_score_recompute(wide_q[..., :576], wide_kv[:, :576], lse_t, idx, SCALE, out=out)
    assert res is out
    _close(out, _ref(q, kv, lse, idx))


def test_matches_the_cpu_model():
    q, kv, lse, idx = _problem(4, 16, 700, 200, seed=6)
    got = dsa_score_recompute(q, kv, lse, idx, SCALE).cpu()
    model = emulate_target(q.cpu(), kv.cpu(), lse.cpu(), idx.cpu(), SCALE)
    torch.testing.assert_close(got, model, rtol=1e-4, atol=1e-9)


def test_cuda_graph_capture():
    q, kv, lse, idx = _problem(64, 16, 8192, 2048, seed=7)
    out = torch.empty(64, 2048, device=CUDA)
    dsa_score_recompute(q, kv, lse, idx, SCALE, out=out)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dsa_score_recompute(q, kv, lse, idx, SCALE, out=out)
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    _close(out, _ref(q, kv, lse, idx))


def test_deepseek_shape_against_the_reference():
    inputs = _suite_inputs(S.BENCH_CASES[0])  # 4096 x top-2048 over 8192 keys, 16 heads
    got = S.run_ours(inputs, None)
    verdict = check.compare(got, S.reference(inputs), S.low_precision(inputs), atol=S.suite().atol)
    assert verdict.ok, verdict.message
    rows = (inputs["idx"] >= 0).any(1)
    torch.testing.assert_close(got.sum(1)[rows], torch.ones(int(rows.sum()), device=CUDA))


@pytest.mark.parametrize(
    "case",
    [S.CHECK_CASES[0], S.CHECK_CASES[1], S.CHECK_CASES[4], S.CHECK_CASES[5], S.BENCH_CASES[4]],
    ids=lambda c: c.name,
)
def test_same_result_as_cudnn(case):
    """The semantics pin: cuDNN-frontend 1.32's target on the same tensors (bf16)."""
    run = S.comparators()["cudnn"]
    if run is None:
        pytest.skip("cudnn.deepseek_sparse_attention not installed")
    inputs = _suite_inputs(case)
    theirs = run(inputs)
    ours = S.run_ours(inputs, None)
    torch.testing.assert_close(ours, theirs, rtol=2e-3, atol=1e-6)
