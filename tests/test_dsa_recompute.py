"""DSA score recompute (issue 22) on the CPU: the reference's semantics (cuDNN-frontend 1.32's
sparse_attn_score_recompute: head sum, L1 over the selected keys with eps 1e-10), the kernel's
ring protocol replayed with the mbarriers' parity semantics (config's slot counts; the aliasing
that fewer slots would allow), the kernel's math (emulate.py: tiles, chunks, fp32, exp2, stale
rows, in-place rescale) against the fp64 reference on odd cases, and the op's errors."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.kernels.attention.dsa_recompute.sm90 import config
from forgekernel.kernels.attention.dsa_recompute.sm90.emulate import (
    Deadlock,
    emulate_target,
    run_protocol,
)
from forgekernel.reference import dsa

F64 = torch.float64
SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


def _problem(s, h, s_kv, topk, gen, *, pad=0.2, dtype=torch.bfloat16):
    q = torch.randn(s, h, config.WIDTH, generator=gen).to(dtype)
    kv = torch.randn(s_kv, config.WIDTH, generator=gen).to(dtype)
    width = max(topk, s_kv)
    pos = torch.rand(s, width, generator=gen).argsort(1)[:, :topk]
    pos = pos.masked_fill(pos >= s_kv, -1)
    pos = pos.masked_fill(torch.rand(s, topk, generator=gen) < pad, -1).to(torch.int32)
    # the forward's LSE over the same keys (fp64)
    probs = dsa.dsa_score_recompute_ref(q, kv, torch.zeros(s, h), pos, SCALE, dtype=F64)
    lse = torch.log(probs.sum(-1)).float()
    return q, kv, lse, pos


def test_target_is_the_head_sum_l1_normalized():
    gen = torch.Generator().manual_seed(1)
    q, kv, lse, idx = _problem(7, 16, 300, 96, gen)
    target = dsa.dsa_score_target_ref(q, kv, lse, idx, SCALE, dtype=F64)
    probs = dsa.dsa_score_recompute_ref(q, kv, lse, idx, SCALE, dtype=F64)
    torch.testing.assert_close(target, dsa.dsa_attention_target_ref(probs), rtol=1e-9, atol=0)
    has = (idx >= 0).any(1)
    torch.testing.assert_close(target.sum(1)[has], torch.ones(int(has.sum()), dtype=F64))
    assert (target[idx < 0] == 0).all()


def test_rows_without_entries_and_dead_heads_give_zero():
    gen = torch.Generator().manual_seed(2)
    q, kv, lse, idx = _problem(4, 16, 100, 64, gen)
    idx[1] = -1
    lse[2, 3] = -math.inf
    target = dsa.dsa_score_target_ref(q, kv, lse, idx, SCALE, dtype=F64)
    assert (target[1] == 0).all() and torch.isfinite(target).all()


@pytest.mark.parametrize("heads", config.HEADS)
def test_ring_plan_fits_and_holds_min_slots(heads):
    slots = config.ring_slots(heads)
    assert config.MIN_SLOTS <= slots <= config.MAX_SLOTS
    assert 1 <= config.lag(heads) <= slots - 2
    assert config.resident(heads) * config.smem_bytes(heads) <= 233472 - 1024 * config.resident(
        heads
    )


@pytest.mark.parametrize("heads", config.HEADS)
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 7, 32])
def test_protocol_replays_without_deadlock_or_early_reads(heads, tiles):
    for seed in range(20):
        run_protocol(tiles, config.ring_slots(heads), config.lag(heads), seed=seed)


@pytest.mark.parametrize("slots", [10, 11, 16])
def test_protocol_deadlocks_only_with_lag_past_the_ring(slots):
    """lag <= slots - 2 walks through (any interleaving); lag = slots - 1 deadlocks: a consumer
    releases a chunk's slot only once the next chunk's MMA is issued, so the producer, waiting
    for that slot, holds the next chunk unsignalled (config.lag's bound)."""
    for lag in range(slots - 1):
        run_protocol(9, slots, lag, seed=lag)
    with pytest.raises(Deadlock):
        run_protocol(9, slots, slots - 1)


def test_protocol_catches_parity_aliasing_below_min_slots():
    """With fewer slots than MIN_SLOTS a consumer's first wait of a tile can pass on the slot's
    older phase (the other warpgroup's chunk not yet committed): the model sees it."""
    with pytest.raises(AssertionError, match="too early"):
        for seed in range(400):
            run_protocol(8, config.MIN_SLOTS - 1, (config.MIN_SLOTS - 1) // 2, seed=seed)


CASES = [
    # (S, H, S_kv, topk, pad, length)
    (3, 16, 400, 128, 0.1, False),
    (2, 16, 200, 100, 0.3, False),  # topk not a multiple of 64
    (2, 128, 90, 150, 0.0, False),  # S_kv < topk: the tail is -1
    (3, 32, 300, 64, 0.2, True),  # topk_length
    (2, 64, 500, 70, 0.5, True),
]


@pytest.mark.parametrize("s, h, s_kv, topk, pad, length", CASES)
def test_emulated_kernel_matches_the_reference(s, h, s_kv, topk, pad, length):
    gen = torch.Generator().manual_seed(s * 1000 + h + topk)
    q, kv, lse, idx = _problem(s, h, s_kv, topk, gen, pad=pad)
    idx[-1, :] = -1 if s > 2 else idx[-1, :]  # a row of -1 (some cases)
    lengths = None
    if length:
        lengths = torch.randint(0, topk + 1, (s,), generator=gen, dtype=torch.int32)
    got = emulate_target(q, kv, lse, idx, SCALE, length=lengths)
    want = dsa.dsa_score_target_ref(q, kv, lse, idx, SCALE, topk_length=lengths, dtype=F64)
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=1e-7)


def test_emulated_batches_local_and_global_indices():
    gen = torch.Generator().manual_seed(9)
    b, s, h, s_kv, topk = 2, 3, 16, 120, 64
    parts = [_problem(s, h, s_kv, topk, gen) for _ in range(b)]
    q = torch.cat([p[0] for p in parts])
    kv = torch.cat([p[1] for p in parts])
    lse = torch.cat([p[2] for p in parts])
    idx = torch.cat([p[3] for p in parts])
    want = torch.cat([dsa.dsa_score_target_ref(*p, SCALE, dtype=F64) for p in parts])
    local = emulate_target(q, kv, lse, idx, SCALE, s_q=s, s_kv=s_kv)
    torch.testing.assert_close(local.double(), want, rtol=2e-5, atol=1e-7)
    base = (torch.arange(b * s) // s * s_kv)[:, None].to(torch.int32)
    glob = torch.where(idx >= 0, idx + base, -1)
    got = emulate_target(q, kv, lse, glob, SCALE, s_q=s, s_kv=s_kv, indices_global=True)
    torch.testing.assert_close(got, local, rtol=0, atol=0)


def test_op_errors_name_the_argument():
    from forgekernel.ops.dsa_recompute import dsa_score_recompute

    q = torch.randn(2, 16, 576, dtype=torch.bfloat16)
    kv = torch.randn(10, 576, dtype=torch.bfloat16)
    lse = torch.zeros(2, 16)
    idx = torch.zeros(2, 8, dtype=torch.int32)
    with pytest.raises(TypeError, match="softmax_scale"):
        dsa_score_recompute(q, kv, lse, idx, None)
    with pytest.raises(NotImplementedError, match="H must be one of"):
        dsa_score_recompute(q[:, :12], kv, lse[:, :12], idx, SCALE)
    with pytest.raises(ValueError, match="576"):
        dsa_score_recompute(q[..., :512], kv, lse, idx, SCALE)
    with pytest.raises(TypeError, match="kv"):
        dsa_score_recompute(q, kv.half(), lse, idx, SCALE)
    with pytest.raises(TypeError, match="lse"):
        dsa_score_recompute(q, kv, lse.double(), idx, SCALE)
    with pytest.raises(TypeError, match="topk_indices"):
        dsa_score_recompute(q, kv, lse, idx.long(), SCALE)
    with pytest.raises(ValueError, match="topk_indices"):
        dsa_score_recompute(q, kv, lse, idx[:1], SCALE)
    with pytest.raises(ValueError, match="topk_length"):
        dsa_score_recompute(q, kv, lse, idx, SCALE, topk_length=torch.zeros(3, dtype=torch.int32))
    with pytest.raises(ValueError, match="kv"):
        dsa_score_recompute(q[None], kv, lse[None], idx[None], SCALE)
    with pytest.raises(ValueError, match="CUDA"):
        dsa_score_recompute(q, kv, lse, idx, SCALE)


def _recompute_inputs(batched=False):
    lead = (3, 5) if batched else (5,)
    cuda = {"device": "cuda"}
    q = torch.empty(*lead, 16, 576, dtype=torch.bfloat16, **cuda)
    kv = torch.empty(*lead[:-1], 40, 576, dtype=torch.bfloat16, **cuda)
    lse = torch.empty(*lead, 16, **cuda)
    return q, kv, lse, torch.empty(*lead, 24, dtype=torch.int32, **cuda)


@pytest.mark.parametrize("batched", [False, True])
def test_traced_call_records_its_op(batched):
    """torch.compile / make_fx (the 2026-12-05 audit: the op had no custom op, so a traced call
    reached the launcher, compiling and launching on fake tensors): the fake implementation
    gives the target's shape (out= takes a copy of it: a copy_ a CPU-only torch cannot fake)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from forgekernel.ops.dsa_recompute import dsa_score_recompute

    with FakeTensorMode(allow_non_fake_inputs=True):
        q, kv, lse, idx = _recompute_inputs(batched)
        got = dsa_score_recompute(q, kv, lse, idx, SCALE)
        assert got.shape == idx.shape and got.dtype == torch.float32
        graph = make_fx(lambda *x: dsa_score_recompute(*x, SCALE) * 2, tracing_mode="fake")(
            *_recompute_inputs(batched)
        ).graph
    assert "forgekernel.dsa_score_recompute" in str(graph)
