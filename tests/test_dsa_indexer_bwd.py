"""The indexer backward's references and interim op on the CPU: the closed form (cuDNN's
kernels 1 and 2) against autograd of the clipped-KL loss in fp64, gradcheck, the (p - target)
shortcut, padding and out-of-range ids, and the op's layouts (batched, global ids, grad_loss)
through its interim path."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.ops import dsa_indexer_bwd as op
from forgekernel.reference import dsa_indexer_bwd as ref

F64 = torch.float64


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _problem(seed=0, s=7, s_kv=23, h=5, d=12, topk=9, dtype=F64):
    """Random q, k, w, ids with padding (-1 scattered, a row of none, an id >= S_kv), the
    predict from the same inputs and a target on the valid slots (one valid slot at 0)."""
    gen = _gen(seed)
    q = torch.randn(s, h, d, generator=gen, dtype=dtype)
    k = torch.randn(s_kv, d, generator=gen, dtype=dtype)
    w = torch.randn(s, h, generator=gen, dtype=dtype)
    idx = torch.stack([torch.randperm(s_kv, generator=gen)[:topk] for _ in range(s)]).int()
    idx[1, 3] = -1
    idx[2, 5:] = -1
    idx[3] = -1  # no valid slot
    idx[4, 0] = s_kv + 2  # outside the keys: padding (cuDNN's rule)
    valid = ref.valid_slots(idx, s_kv)
    target = torch.rand(s, topk, generator=gen, dtype=F64).masked_fill(~valid, 0.0)
    target[0, 1] = 0.0
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
    return q, k, w, idx, target


@pytest.mark.parametrize("sm_scale", [1.0, 0.37, -0.8])
def test_closed_form_equals_autograd_of_the_loss(sm_scale):
    q, k, w, idx, target = _problem()
    scale = 0.29
    p = ref.dsa_indexer_predict_ref(q, k, w, idx, sm_scale=sm_scale, dtype=F64)
    got = ref.dsa_indexer_kl_backward_ref(q, k, w, idx, target, p, grad_scale=scale,
                                          sm_scale=sm_scale, dtype=F64)  # fmt: skip
    want = ref.dsa_indexer_kl_backward_autograd(q, k, w, idx, target, grad_scale=scale,
                                                sm_scale=sm_scale)  # fmt: skip
    for g, a in zip(got, want):
        torch.testing.assert_close(g, a, atol=1e-10, rtol=1e-10)
    dq, dw, dk = got
    assert torch.equal(dq[3], torch.zeros_like(dq[3])) and torch.equal(dw[3], 0 * dw[3])
    named = set(idx[ref.valid_slots(idx, k.shape[0])].tolist())
    for j in set(range(k.shape[0])) - named:
        assert torch.equal(dk[j], torch.zeros_like(dk[j]))


def test_gradcheck_of_the_loss():
    q, k, w, idx, target = _problem(seed=3, s=5, s_kv=11, h=3, d=5, topk=6)

    def loss(a, b, c):
        logits = ref.dsa_indexer_logits_ref(a, b, c, idx, sm_scale=0.6, dtype=F64)
        return ref.dsa_indexer_kl_loss_ref(logits, target, 0.5)

    leaves = tuple(x.clone().requires_grad_(True) for x in (q, k, w))
    assert torch.autograd.gradcheck(loss, leaves, eps=1e-6, atol=1e-7)


def test_grad_signal_is_p_minus_target_on_a_normalized_target():
    q, k, w, idx, target = _problem(seed=5)
    p = ref.dsa_indexer_predict_ref(q, k, w, idx, dtype=F64)
    grad = ref.dsa_indexer_grad_signal_ref(target, p, 0.7)
    torch.testing.assert_close(grad, 0.7 * (p - target), atol=1e-40, rtol=1e-12)
    valid = ref.valid_slots(idx, k.shape[0])
    assert (p[~valid] == 0).all() and (grad[~valid] == 0).all()


def test_clip_drops_slots_below_e_minus_100():
    """A slot whose predict is below e^-100 passes no gradient of its own (cuDNN's mask)."""
    target = torch.tensor([[0.5, 0.5, 0.0]], dtype=F64)
    p = torch.tensor([[0.75, 1e-50, 0.25]], dtype=F64)
    g = ref.dsa_indexer_grad_signal_ref(target, p, 1.0)
    gi = torch.tensor([-0.5, 0.0, -ref.CLIP_PROB_MIN], dtype=F64)
    torch.testing.assert_close(g[0], gi - p[0] * gi.sum(), atol=0, rtol=1e-15)


def test_dense_scores_and_topk_scores_agree():
    """The logits at the selected slots are the indexer's dense scores gathered (sm_scale 1)."""
    from forgekernel.reference.dsa import dsa_indexer_scores_ref

    q, k, w, idx, _ = _problem(seed=7)
    logits = ref.dsa_indexer_logits_ref(q, k, w, idx, dtype=F64)
    dense = dsa_indexer_scores_ref(q, k, w, causal=False, dtype=F64)
    valid = ref.valid_slots(idx, k.shape[0])
    picked = dense.gather(1, idx.clamp(0, k.shape[0] - 1).long())
    torch.testing.assert_close(logits[valid], picked[valid], atol=1e-12, rtol=0)
    assert torch.isneginf(logits[~valid]).all()


def _batched(seed=11, b=2, s=6, s_kv=19, h=4, d=8, topk=7, dtype=torch.float32):
    parts = [_problem(seed + i, s, s_kv, h, d, topk, dtype) for i in range(b)]
    q, k, w, idx, target = (torch.stack([p[j] for p in parts]) for j in range(5))
    p = torch.stack([ref.dsa_indexer_predict_ref(*x[:4], dtype=F64) for x in parts]).float()
    return q, k, w, idx, target.float(), p


@pytest.mark.parametrize("indices_global", [False, True])
def test_interim_batched_equals_the_reference_per_batch(indices_global):
    q, k, w, idx, target, p = _batched()
    b, s, s_kv = q.shape[0], q.shape[1], k.shape[1]
    ids = idx
    if indices_global:  # valid ids move to b * S_kv + e; padding stays padding
        base = torch.arange(b, dtype=torch.int32)[:, None, None] * s_kv
        ids = torch.where(ref.valid_slots(idx, s_kv), idx + base, -1)
    grad_loss = torch.tensor([1.7])
    dq, dw, dk = op._backward_interim(q, w, k, target, p, ids, grad_loss, 0.9, 2.0,
                                      indices_global)  # fmt: skip
    scale = 1.7 * 2.0 / (b * s)
    for i in range(b):
        inputs = (q[i], k[i], w[i], idx[i], target[i], p[i])
        want = ref.dsa_indexer_kl_backward_ref(*inputs, grad_scale=scale, sm_scale=0.9, dtype=F64)
        for g, a in zip((dq[i], dw[i], dk[i]), want):
            torch.testing.assert_close(g.double(), a, atol=1e-5, rtol=1e-5)


def test_global_ids_of_another_batch_are_padding():
    q, k, w, idx, target, p = _batched(seed=13)
    s_kv = k.shape[1]
    wrong = idx.clone()
    wrong[1, 0, 0] = 0  # a global id of batch 0 in batch 1's row: padding there (cuDNN)
    got = op.flat_indices(wrong, s_kv, True)
    assert got[1, 0, 0] == -1 and got[0, 0, 0] == (idx[0, 0, 0] if idx[0, 0, 0] >= 0 else -1)


def test_interim_three_dim_bf16_rounds_the_fp32_result():
    q, k, w, idx, target = _problem(seed=17, dtype=torch.float32)
    p = ref.dsa_indexer_predict_ref(q, k, w, idx, dtype=F64).float()
    bf = [x.bfloat16() for x in (q, w, k)]
    dq, dw, dk = op._backward_interim(bf[0], bf[1], bf[2], target.float(), p, idx, None, 1.0,
                                      1.0, False)  # fmt: skip
    assert (dq.dtype, dw.dtype, dk.dtype) == (torch.bfloat16,) * 3
    want = ref.dsa_indexer_kl_backward_ref(bf[0], bf[2], bf[1], idx, target, p,
                                           grad_scale=1.0 / q.shape[0], dtype=F64)  # fmt: skip
    for g, a in zip((dq, dw, dk), want):
        torch.testing.assert_close(g.double(), a, atol=1e-4, rtol=1.6e-2)


def test_the_op_validates_its_arguments():
    q, k, w, idx, target = _problem(seed=19, dtype=torch.float32)
    p = torch.zeros_like(target, dtype=torch.float32)
    t = target.float()
    with pytest.raises(ValueError, match="CUDA"):
        op.dsa_indexer_backward(q, w, k, t, p, idx)
    with pytest.raises(ValueError, match="target"):
        op.dsa_indexer_backward(q, w, k, t, p, idx[:, :3])
    with pytest.raises(ValueError, match="topk_indices"):
        op.dsa_indexer_backward(q, w, k, t, p, idx[:4])
    with pytest.raises(TypeError, match="k"):
        op.dsa_indexer_backward(q, w, k.double(), t, p, idx)
    with pytest.raises(ValueError, match="grad_loss"):
        op.dsa_indexer_backward(q, w, k, t, p, idx, torch.ones(2))
    with pytest.raises(TypeError, match="sm_scale"):
        op.dsa_indexer_backward(q, w, k, t, p, idx, sm_scale=None)
    with pytest.raises(ValueError, match="predict"):
        op.dsa_indexer_backward(q, w, k, t, p[:, :2], idx)


def test_exported_from_the_indexer_op():
    # the module by its path: `from forgekernel.ops import dsa_indexer` is the exported function
    dsa_indexer = importlib.import_module("forgekernel.ops.dsa_indexer")
    assert dsa_indexer.dsa_indexer_backward is op.dsa_indexer_backward


def _masked_scatter_backward(q, k, w, idx, target, p, grad_scale, sm_scale):
    """The closed form as it was before the capture fix: dk by a boolean mask over the slots
    (the yardstick of the sink-row scatter's bits)."""
    valid = ref.valid_slots(idx, k.shape[0])
    safe = torch.where(valid, idx, 0).long()
    grad = torch.where(valid, ref.dsa_indexer_grad_signal_ref(target, p, grad_scale), 0.0)
    s = sm_scale * torch.einsum("rhd,rkd->rhk", q, k[safe])
    ds = torch.where(s > 0, grad[:, None, :] * w[:, :, None], 0.0)
    rows_dk = sm_scale * torch.einsum("rhk,rhd->rkd", ds, q)
    keep = valid.reshape(-1)
    dk = torch.zeros_like(k)
    return dk.index_add_(0, safe.reshape(-1)[keep], rows_dk.reshape(-1, k.shape[1])[keep])


@pytest.mark.parametrize("dtype", [torch.float32, F64])
def test_sink_row_scatter_is_bitwise_the_masked_one(dtype):
    """dk with invalid slots sent to a scratch row past the keys equals, bit for bit, dk from
    the boolean mask it replaced (padding, an empty row, an id >= S_kv in the problem)."""
    q, k, w, idx, target = (x.to(dtype) if x.is_floating_point() else x for x in _problem(23))
    p = ref.dsa_indexer_predict_ref(q, k, w, idx, sm_scale=0.6, dtype=dtype)
    t = target.to(dtype)
    _, _, dk = ref.dsa_indexer_kl_backward_ref(q, k, w, idx, t, p, grad_scale=0.3,
                                               sm_scale=0.6, dtype=dtype)  # fmt: skip
    want = _masked_scatter_backward(q, k, w, idx, t, p, 0.3, 0.6)
    assert dk.shape == k.shape and torch.equal(dk, want)


@pytest.mark.parametrize("batched, indices_global", [(False, False), (True, False), (True, True)])
def test_interim_backward_reads_nothing_on_the_host(batched, indices_global):
    """The interim path on meta tensors (tests/capture_safety.py): no host read, no data-sized
    op, no host-built table: what a CUDA-graph capture needs (the H200's capture test failed
    on a boolean-mask index, 2026-12-02)."""
    from capture_safety import assert_capturable, meta

    if batched:
        q, k, w, idx, target, p = _batched()
    else:
        q, k, w, idx, target = _problem(seed=29, dtype=torch.float32)
        p = ref.dsa_indexer_predict_ref(q, k, w, idx, dtype=F64).float()
        target = target.float()
    grad_loss = torch.tensor([1.3])
    args = meta(q.bfloat16(), w.bfloat16(), k.bfloat16(), target, p, idx, grad_loss)
    assert_capturable(op._backward_interim, *args, 0.9, 2.0, indices_global)


def test_the_suites_call_reads_nothing_on_the_host(monkeypatch):
    """What tests/gpu's capture test captures (the suite's run_ours: the public op with
    grad_loss on the device) on meta tensors, every check case: nothing read back."""
    from capture_safety import assert_capturable

    from forgekernel.bench.suites import dsa_indexer_bwd as suite

    monkeypatch.setattr(op, "_traced", lambda *t: False)  # the eager path, as on the GPU
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    for case in suite.CHECK_CASES:
        i = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"), _gen(7))
        i = {k: x.to("meta") if isinstance(x, torch.Tensor) else x for k, x in i.items()}
        assert_capturable(suite.run_ours, i, None)
