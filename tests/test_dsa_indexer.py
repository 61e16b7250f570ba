"""The lightning indexer (DSA, issue 22) on the CPU: the kernels' CPU model (emulate.py: the
epilogue's fp32 head sum, the exact radix top-k) against the fp64 references, the op's
decomposition (key windows, paged cache views, slot ids) replayed in torch, the launch plans,
validation and torch.compile tracing (fake CUDA tensors)."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.kernels.attention.dsa_indexer.sm90 import config
from forgekernel.kernels.attention.dsa_indexer.sm90 import emulate as em
from forgekernel.kernels.attention.dsa_indexer.sm90.launch import logits_width, paged_cache_views
from forgekernel.reference import dsa
from forgekernel.reference.dsa_flashinfer import indexer_inputs, unpack_indexer_k_cache

# the module (forgekernel.ops exports its function dsa_indexer under the same name)
op = importlib.import_module("forgekernel.ops.dsa_indexer")

GEN = torch.Generator().manual_seed(22)


def _rand(*shape) -> torch.Tensor:
    return torch.randn(*shape, generator=GEN)


def _set(idx: torch.Tensor) -> list[int]:
    return sorted(int(i) for i in idx if i >= 0)


# ---------------------------------------------------------------- keys and the top-k model


def test_keys_order_floats_and_hide_neg_inf_and_nan():
    tiny = torch.finfo(torch.float32).tiny
    values = torch.tensor([float("-inf"), -3e38, -2.5, -tiny, -1e-45, -0.0, 0.0, 1e-45, tiny,
                           1.0, 2.5, 3e38, float("inf"), float("nan")])  # fmt: skip
    keys = em.order_keys(values)
    assert keys[0] == em.HIDDEN and keys[-1] == em.HIDDEN
    finite = keys[1:-1]
    assert finite[4] == finite[5] == 0  # -0 is +0
    assert bool((finite[1:] >= finite[:-1]).all()) and len(set(finite.tolist())) == 11
    assert int(finite.min()) > em.HIDDEN and int(finite.max()) < 2**31


@pytest.mark.parametrize("n, topk", [(1, 5), (7, 5), (1000, 64), (2049, 2048), (5000, 2048),
                                     (16385, 2048), (40000, 2048)])  # fmt: skip
def test_topk_model_is_exact_on_distinct_values(n, topk):
    values = _rand(n)
    ref = dsa.dsa_topk_ref(values[None], topk)[0]
    for cluster in config.CLUSTERS:
        if -(-n // cluster) > config.CACHE:
            continue
        ours = em.topk_row_model(values, topk, cluster)
        picked = ours[ours >= 0]
        assert bool((picked[1:] > picked[:-1]).all())  # ascending, no duplicate
        assert picked.tolist() == _set(ref), cluster
        assert int((ours < 0).sum()) == max(0, topk - n)


def test_topk_model_breaks_ties_to_the_lower_column():
    values = torch.randint(0, 5, (9000,), generator=GEN).float()
    values[3::7] = 0.0
    values[5::11] = -0.0
    for cluster in (1, 2, 4):
        ours = em.topk_row_model(values, 2048, cluster)
        assert ours.tolist() == _set(dsa.dsa_topk_ref(values[None], 2048)[0])


def test_topk_model_all_equal_and_narrow_ranges_run_every_round():
    assert em.topk_row_model(torch.full((5000,), 0.25), 2048).tolist() == list(range(2048))
    # values a few ulps apart with far outliers: round 1 leaves one coarse bin, rounds 2 and 3
    # resolve it
    base = torch.full((6000,), 1.0) + torch.arange(6000) * 2.0**-23
    base[::1000] = torch.tensor([-1e30, 1e30, -5.0, 7.0, 1e-30, -1e-30])
    keys = em.order_keys(base[torch.randperm(6000, generator=GEN)])
    lo, hi, need, selected = em.select_state(keys, 2048)
    assert selected == 2048 and 0 < need and lo == hi
    perm = torch.randperm(6000, generator=GEN)
    values = base[perm]
    assert em.topk_row_model(values, 2048).tolist() == _set(dsa.dsa_topk_ref(values[None], 2048)[0])


def test_topk_model_hides_neg_inf_and_nan_and_pads():
    values = _rand(3000)
    values[::3] = float("-inf")
    values[1::5] = float("nan")
    ours = em.topk_row_model(values, 2048, 2)
    picked = ours[ours >= 0]
    assert not torch.isnan(values[picked]).any() and torch.isfinite(values[picked]).all()
    visible = torch.isfinite(values)
    assert picked.numel() == min(2048, int(visible.sum()))
    cut = torch.where(visible, values, float("-inf"))
    assert picked.tolist() == _set(dsa.dsa_topk_ref(cut[None], 2048)[0])
    assert (ours[picked.numel() :] == -1).all()


def test_topk_model_windows_and_slots():
    logits = _rand(5, 300)
    starts = torch.tensor([0, 10, 5, 299, 7])
    ends = torch.tensor([300, 20, 5, 300, 500])  # empty, one column, past the width
    out = em.topk_model(logits, starts, ends, 16)
    for r in range(5):
        s, e = int(starts[r]), min(int(ends[r]), 300)
        want = _set(dsa.dsa_topk_ref(logits[r : r + 1, s:e], 16)[0]) if e > s else []
        assert _set(out[r]) == [w + s for w in want]
    table = torch.randperm(40, generator=GEN)[:10].int().view(2, 5)
    paged = em.topk_model(logits[:4], torch.zeros(4), torch.full((4,), 300), 8, table=table,
                          next_n=2)  # fmt: skip
    cols = em.topk_model(logits[:4], torch.zeros(4), torch.full((4,), 300), 8)
    for r in range(4):
        want = [int(table[r // 2, c // 64]) * 64 + c % 64 for c in cols[r].tolist()]
        assert paged[r].tolist() == want


H200_SMS = 132


@pytest.mark.parametrize("rows, width, topk", [(3, 5000, 2048), (2, 70001, 2048), (5, 300, 7)])
def test_gpu_topk_test_replays_on_the_model_at_the_launchers_cluster(rows, width, topk):
    """tests/gpu's top-k-versus-model shapes at the cluster the launcher plans on an H200: the
    model at its default cluster 1 refused the 70001-key row ("a part larger than the cache",
    2026-12-02); the selection does not depend on the cluster (every one that holds the row)."""
    logits = _rand(rows, logits_width(width))
    logits[:, ::97] = float("-inf")
    logits[0, 5:900] = 0.5  # ties
    starts = torch.tensor([0, 3, 0, 11, 0][:rows])
    ends = torch.tensor([width, width - 1, 1, width, 0][:rows])
    cluster = config.topk_cluster(rows, width, H200_SMS)
    if width > config.CACHE:
        with pytest.raises(AssertionError, match="larger than the cache"):
            em.topk_model(logits, starts, ends, topk)
    want = em.topk_model(logits, starts, ends, topk, cluster)
    for other in config.CLUSTERS:
        if other != cluster and other * config.CACHE >= width:
            assert torch.equal(em.topk_model(logits, starts, ends, topk, other), want), other


# ---------------------------------------------------------------- logits decomposition


def _fp8(*shape, scale=1.0) -> torch.Tensor:
    return (_rand(*shape) * scale).to(torch.float8_e4m3fn)


def test_logits_model_matches_the_fp64_reference():
    q, k = _fp8(7, 64, 128), _fp8(333, 128)
    w, ks = _rand(7, 64) * 0.125, _rand(333).abs() * 0.01 + 1e-3
    ours = em.logits_model(q, w, k, ks)
    ref = dsa.dsa_indexer_scores_ref(q, k, w, k_scale=ks, causal=False, dtype=torch.float64)
    scale = ref.abs().amax(-1, keepdim=True) + 1e-30
    assert float(((ours.double() - ref) / scale).abs().max()) < 1e-5


def test_prefill_decomposition_selects_the_reference_top_k():
    """Key windows (the op's, on the device in practice) + model logits + model top-k vs
    dsa_indexer_ref on packed causal sequences: the selection is exact up to near-ties."""
    lens_q, lens_k = [5, 0, 37, 300], [9, 4, 37, 2100]
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    s, skv = sum(lens_q), sum(lens_k)
    q, k = _fp8(s, 64, 128), _fp8(skv, 128)
    w, ks = _rand(s, 64) * 0.125, _rand(skv).abs() + 0.5
    starts, ends = op.key_windows(s, skv, True, cu_q, cu_k, torch.device("cpu"))
    logits = em.logits_model(q, w, k, ks)
    ours = em.topk_model(logits, starts, ends, 256)
    ref = dsa.dsa_indexer_ref(q, k, w, k_scale=ks, topk=256, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
    assert (ours >= 0).sum(-1).tolist() == (ref >= 0).sum(-1).tolist()
    scores = torch.full((s, skv), float("-inf"), dtype=torch.float64)
    for b in range(len(lens_q)):
        q0, q1, k0, k1 = cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]
        scores[q0:q1, k0:k1] = dsa.dsa_indexer_scores_ref(
            q[q0:q1], k[k0:k1], w[q0:q1], k_scale=ks[k0:k1], dtype=torch.float64
        )
    assert dsa.topk_selection_error(scores, ours, 256) <= 1e-5 * float(
        scores[scores.isfinite()].abs().max()
    )


def test_key_windows_are_bottom_right_causal_per_sequence():
    cu_q = torch.tensor([0, 3, 3, 10], dtype=torch.int32)
    cu_k = torch.tensor([0, 8, 12, 14], dtype=torch.int32)
    starts, ends = op.key_windows(10, 14, True, cu_q, cu_k, torch.device("cpu"))
    for b in range(3):
        q0, q1, k0, k1 = (int(x) for x in (cu_q[b], cu_q[b + 1], cu_k[b], cu_k[b + 1]))
        seen = dsa.causal_visible(q1 - q0, k1 - k0)
        for i in range(q1 - q0):
            cols = seen[i].nonzero().flatten() + k0
            lo, hi = int(starts[q0 + i]), int(ends[q0 + i])
            assert list(range(lo, max(lo, hi))) == cols.tolist()
    starts, ends = op.key_windows(4, 6, True, None, None, torch.device("cpu"))
    assert starts.tolist() == [0] * 4 and ends.tolist() == [3, 4, 5, 6]
    starts, ends = op.key_windows(4, 6, False, cu_q[:2], cu_k[:2], torch.device("cpu"))
    assert ends.tolist() == [8, 8, 8, 8]


def _packed_windows(lens_q, lens_k, causal=True):
    cu = [torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
          for n in (lens_q, lens_k)]  # fmt: skip
    packed = cu if len(lens_q) > 1 else (None, None)
    return op.key_windows(sum(lens_q), sum(lens_k), causal, *packed, torch.device("cpu"))


PREFILL_SHAPES = [  # the check's prefill cases (q342: the first H200 run's illegal instruction)
    ([300], [300], True), ([5, 0, 37, 300], [9, 4, 37, 2100], True), ([17], [20000], True),
    ([7, 9], [5000, 1], False), ([3, 1, 6], [13, 6, 70], True), ([2, 5], [1, 33], False),
]  # fmt: skip


@pytest.mark.parametrize("lens_q, lens_k, causal", PREFILL_SHAPES)
def test_prefill_logits_ctas_start_scale_boxes_16_byte_aligned(lens_q, lens_k, causal):
    """TMA raises "illegal instruction" for a box whose innermost start is not 16-byte aligned:
    the prefill scales (keys,) fp32 are a 1-D box at key0 + 64 j, so key0 (the group's smallest
    window start, 13 and 50 in the q342 case) is rounded down to 4 keys; the CTAs' tiles still
    cover every row's window, and every split's tiles lie in its group's range."""
    starts, ends = _packed_windows(lens_q, lens_k, causal)
    keys = sum(lens_k)
    width = logits_width(keys)
    groups = -(-starts.shape[0] // 4)
    splits, per = config.split_plan(groups, -(-keys // config.TILE) + 1, 4, 132)
    ctas = em.logits_ctas(starts, ends, width, 4, per, splits)
    assert all(box % config.SCALE_ALIGN == 0 for c in ctas for box in c["scale_box"])
    for group in range(groups):
        tiles = sorted(box for c in ctas if c["group"] == group for box in c["scale_box"])
        covered = {k for box in tiles for k in range(box, box + config.TILE)}
        for r in {r for c in ctas if c["group"] == group for r in c["rows"]}:
            assert set(range(int(starts[r]), int(ends[r]))) <= covered, (group, r)
        assert len(tiles) == len(set(tiles))  # each tile by one split


def test_key_origin_rounds_down_to_16_bytes_of_scales():
    assert config.SCALE_ALIGN * 4 == 16
    assert [config.key_origin(x) for x in (0, 1, 3, 4, 13, 50, 5000)] == [0, 0, 0, 4, 12, 48, 5000]
    starts, _ = _packed_windows([5, 0, 37, 300], [9, 4, 37, 2100])
    assert {int(s) % 4 for s in starts} == {0, 1, 2}  # the failing case's unaligned starts


def test_paged_cache_views_read_deep_gemms_layout():
    inputs = indexer_inputs([70, 1, 130], generator=GEN)
    cache = inputs["k_index_cache_fp8"]
    k, scale = paged_cache_views(cache)
    want_k, want_scale = unpack_indexer_k_cache(cache)
    assert k.shape == (64, 128, cache.shape[0]) and k.stride() == (128, 1, 8448)
    assert scale.shape == (64, cache.shape[0]) and scale.stride() == (1, 2112)
    assert torch.equal(k.permute(2, 0, 1).view(torch.uint8), want_k.view(torch.uint8))
    assert torch.equal(scale.t(), want_scale)


def test_paged_decomposition_matches_the_definitions_reference():
    """The paged form as the op runs it (views, per-sequence logits over position columns,
    top-k windows from seq_lens, slots through the block table) against FlashInfer-Bench's
    reference math (reference.dsa_flashinfer): the same slots up to near-ties."""
    lens = [1, 2047, 2048, 2049, 3000, 0]
    inputs = indexer_inputs(lens, generator=GEN)
    table, seq_lens = inputs["block_table"], inputs["seq_lens"]
    k, scale = paged_cache_views(inputs["k_index_cache_fp8"])
    width = table.shape[1] * 64
    logits = torch.zeros(len(lens), width)
    for b in range(len(lens)):
        pages = table[b].long()
        keys = k[:, :, pages].permute(2, 0, 1).reshape(width, 128)
        ks = scale[:, pages].t().reshape(width)
        logits[b] = em.logits_model(inputs["q_index_fp8"][b : b + 1], inputs["weights"][b : b + 1],
                                    keys, ks)[0]  # fmt: skip
    ours = em.topk_model(logits, torch.zeros(len(lens)), seq_lens, 2048, table=table)
    ref = dsa.dsa_indexer_paged_ref(
        inputs["q_index_fp8"], *unpack_indexer_k_cache(inputs["k_index_cache_fp8"])[:1],
        inputs["weights"], table, seq_lens,
        k_scale_cache=unpack_indexer_k_cache(inputs["k_index_cache_fp8"])[1],
    )  # fmt: skip
    for b, n in enumerate(lens):
        assert (ours[b] >= 0).sum() == (ref[b] >= 0).sum() == min(n, 2048)
        agree = len(set(_set(ours[b])) & set(_set(ref[b])))
        assert agree >= min(n, 2048) - 2  # at most a near-tie at the boundary differs


# ---------------------------------------------------------------- plans and shared memory


def test_plans_cover_every_tile_and_fit_the_chip():
    for groups, tiles, qt in [(1, 1024, 1), (128, 1024, 1), (4096, 257, 4), (3, 1, 2)]:
        splits, per = config.split_plan(groups, tiles, qt, 132)
        assert splits * per >= tiles and (splits - 1) * per < tiles
    for rows, width in [(1, 65536), (128, 65536), (16384, 16384), (1, 131072), (7, 100)]:
        c = config.topk_cluster(rows, width, 132)
        assert c in config.CLUSTERS and c * config.CACHE >= width
    with pytest.raises(ValueError, match="131072"):
        config.topk_cluster(1, config.MAX_KEYS + 1, 132)
    for qt in config.QTOKENS:
        assert config.logits_smem_bytes(qt) * config.CTAS_PER_SM[qt] <= config.SMEM_PER_SM
    assert config.topk_smem_bytes() * 2 <= config.SMEM_PER_SM
    assert logits_width(5) == 8 and logits_width(0) == 4


def test_prefill_chunks_fit_the_logits_grid_y():
    """A chunk's row groups (QTOKENS[-1] rows each) are the logits' grid y (at most 65535):
    many queries against few keys would otherwise pass the budget alone."""
    top = config.MAX_GRID_Y * config.QTOKENS[-1]
    assert config.prefill_chunk_rows(300_000, 8, 1 << 28) == top
    assert config.prefill_chunk_rows(1000, 131072, 1 << 28) == 1000
    assert config.prefill_chunk_rows(5000, 131072, 1 << 28) == 2048
    assert config.prefill_chunk_rows(3, 1 << 30, 1 << 28) == 1


def test_paged_batch_fits_the_logits_grid_y():
    q, cache, w, seq_lens, table = _paged_inputs("cpu")
    b = config.MAX_GRID_Y + 1
    q = q[:1].expand(b, *q.shape[1:])
    w = torch.empty(1, 64).expand(b, 64)
    seq_lens = torch.empty(1, dtype=torch.int32).expand(b)
    table = table[:1].expand(b, table.shape[1])
    with pytest.raises(ValueError, match="65535"):
        op.dsa_indexer_paged(q, cache, w, seq_lens, table)


# ---------------------------------------------------------------- validation and tracing


def _paged_inputs(device="cuda", next_n=1):
    q = torch.empty(3, next_n, 64, 128, dtype=torch.float8_e4m3fn, device=device)
    cache = torch.empty(10, 64, 1, 132, dtype=torch.int8, device=device)
    w = torch.empty(3 * next_n, 64, device=device)
    return (
        q,
        cache,
        w,
        torch.empty(3, dtype=torch.int32, device=device),
        torch.empty(3, 4, dtype=torch.int32, device=device),
    )


def _prefill_inputs(device="cuda"):
    q = torch.empty(5, 64, 128, dtype=torch.float8_e4m3fn, device=device)
    k = torch.empty(300, 128, dtype=torch.float8_e4m3fn, device=device)
    return q, k, torch.empty(300, device=device), torch.empty(5, 64, device=device)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: (a[0].float(),) + a[1:], TypeError, "q must have dtype"),
        (lambda a: (a[0][:, :, :32],) + a[1:], ValueError, r"q must be \(B, 64, 128\)"),
        (lambda a: a[:1] + (a[1][:, :32],) + a[2:], ValueError, "k_cache must be deep_gemm"),
        (lambda a: a[:2] + (a[2][:2],) + a[3:], ValueError, "weights must hold"),
        (lambda a: a[:3] + (a[3].long(),) + a[4:], TypeError, "seq_lens must have dtype"),
        (lambda a: a[:4] + (a[4][:2],), ValueError, "block_table must be"),
        (lambda a: a[:4] + (torch.empty(3, 3000, dtype=torch.int32),), ValueError, "131072"),
        (lambda a: a, ValueError, "must be a CUDA tensor"),
    ],
)
def test_paged_validation_names_the_argument(change, error, match):
    with pytest.raises(error, match=match):
        op.dsa_indexer_paged(*change(_paged_inputs("cpu")))


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda a: (a[0].float(),) + a[1:], TypeError, "q_index_fp8 must have dtype"),
        (lambda a: a[:1] + (a[1][:, :32],) + a[2:], ValueError, "k_index_cache_fp8 must be"),
        (lambda a: a, ValueError, "q_index_fp8 must be a CUDA tensor"),
    ],
)
def test_flashinfer_adapter_names_its_own_arguments(change, error, match):
    """The 2026-12-05 audit: the adapter's errors named q and k_cache, dsa_indexer_paged's."""
    with pytest.raises(error, match=match):
        op.dsa_topk_indexer_flashinfer(*change(_paged_inputs("cpu")))


def test_prefill_validation_names_the_argument():
    q, k, ks, w = _prefill_inputs("cpu")
    with pytest.raises(ValueError, match="k_scale must have shape"):
        op.dsa_indexer(q, k, ks[:7], w)
    with pytest.raises(ValueError, match="give both or neither"):
        op.dsa_indexer(q, k, ks, w, cu_seqlens_q=torch.tensor([0, 5], dtype=torch.int32))
    with pytest.raises(ValueError, match="topk must be a positive int"):
        op.dsa_indexer(q, k, ks, w, topk=0)
    with pytest.raises(ValueError, match="must be a CUDA tensor"):
        op.dsa_indexer(q, k, ks, w)


def _graph(f, make_inputs) -> str:
    with FakeTensorMode(allow_non_fake_inputs=True):
        return str(make_fx(f, tracing_mode="fake")(*make_inputs()).graph)


def test_paged_indexer_records_its_op():
    with FakeTensorMode():
        out = op.dsa_indexer_paged(*_paged_inputs(next_n=2))
        assert out.shape == (6, 2048) and out.dtype == torch.int32
        q, cache, w, lens, table = _paged_inputs()
        q3 = torch.empty(3, 64, 128, dtype=torch.float8_e4m3fn, device="cuda")
        (fi,) = op.dsa_topk_indexer_flashinfer(q3, cache, w, lens, table)
        assert fi.shape == (3, 2048)
    graph = _graph(lambda *x: op.dsa_indexer_paged(*x) + 1, _paged_inputs)
    assert "forgekernel.dsa_indexer_paged" in graph


def test_prefill_indexer_records_its_op():
    with FakeTensorMode():
        assert op.dsa_indexer(*_prefill_inputs(), topk=100).shape == (5, 100)
    graph = _graph(lambda *x: op.dsa_indexer(*x, topk=64) + 1, _prefill_inputs)
    assert "forgekernel.dsa_indexer" in graph


def test_flops_per_pair():
    assert 2 * 64 * 128 == config.FLOPS_PER_PAIR and math.isclose(config.PAGE_BYTES, 8448)
