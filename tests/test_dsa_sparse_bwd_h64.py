"""The h64 variant of the DSA sparse backward (kernels/attention/dsa_sparse_bwd/sm90/
kernel_h64.py) on the CPU: its compile keys and budgets (shared memory, the setmaxnreg split,
the work split), and the launcher's two launches replayed through torch stand-ins that follow
the kernels' stated contracts (`kv`: dkv and dS of every position of whole tiles into the
(tokens, rows, H) workspace, 0 past topk and at invalid entries; `dq`: dq = dS K over the
workspace's rows), against the fp64 reference on awkward sizes: 64 / 128 heads, topk not a
multiple of 64, -1 and past-the-cache entries, a row without entries, a sink and a loss on the
LSE. The kernels' numbers on a GPU: tests/gpu/test_dsa_sparse_bwd_kernel_gpu.py -k h64; their
SASS: tests/test_dsa_sparse_bwd_kernel_compile.py."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC, config, launch
from forgekernel.kernels.common.sm90.constants import (
    REGISTERS_PER_SM,
    SMEM_CAPACITY,
    THREADS_PER_WG,
)
from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref, dsa_sparse_attention_ref
from forgekernel.runtime.device import dtype_name

WIDTH, LATENT, TILE = config.WIDTH, config.D_V, config.TILE


def test_params_h64():
    assert dict(config.params_h64("bfloat16", "kv")) == {
        "dtype": "bfloat16", "block": 64, "h64": "kv"}  # fmt: skip
    assert dict(config.params_h64("float16", "kv", reduce=False))["noreduce"] is True
    with pytest.raises(ValueError, match="part"):
        config.params_h64("bfloat16", "dkv")
    with pytest.raises(ValueError, match="kv part only"):
        config.params_h64("bfloat16", "dq", reduce=False)
    with pytest.raises(ValueError, match="kv part only"):
        config.params_h64("bfloat16", "dq", shfl4=False)
    assert dict(config.params_h64("bfloat16", "kv", shfl4=False))["v2"] is True
    with pytest.raises(ValueError, match="dtype"):
        config.params_h64("float32", "kv")
    cands = [p for p in SPEC.candidate_params() if "h64" in dict(p)]
    assert len(cands) == len(set(cands)) == 8
    assert dict(config.params_h64("bfloat16", "dq", dq_heads=128))["dq_heads"] == 128
    with pytest.raises(ValueError, match="dq_heads"):
        config.params_h64("bfloat16", "kv", dq_heads=128)
    with pytest.raises(ValueError, match="dq_heads"):
        config.params_h64("bfloat16", "dq", dq_heads=96)
    assert {(dict(p)["dtype"], dict(p)["h64"], dict(p).get("dq_heads", 64)) for p in cands} == {
        *((d, part, 64) for d in config.DTYPES for part in config.H64_PARTS),
        *((d, "dq", 128) for d in config.DTYPES)}  # fmt: skip
    assert not {dict(p).get("h64") for p in SPEC.standard_params()} - {None}


def test_h64_budgets():
    """Shared memory: kv 230,400 B (q 72 KB, dO 64 KB, one 72 KB stage, P^T / dS^T 16 KB) of
    232,448 (a second stage would need 302 KB); dq two stages of rows + dS. Registers: the dq
    part's 3 x 128 consumers at 152 beside the producer's 56 fill the file; its accumulators
    (three 64 x 64 fp32 blocks: 96 a thread) leave 56 for the rest. The dq blocks cover the
    nine 64-column blocks once."""
    assert config.h64_kv_bytes() == 73728 + 65536 + 73728 + 16384 + 1024 <= SMEM_CAPACITY
    assert config.h64_kv_bytes() + config.stage_bytes() > SMEM_CAPACITY
    assert config.h64_dq_bytes() == 2 * (73728 + 8192) + 1024 <= SMEM_CAPACITY
    assert config.h64_dq_bytes(128) == 2 * (24576 + 16384) + 1024
    assert (config.PRODUCER_REGS * THREADS_PER_WG
            + config.H64_DQ_CONSUMER_REGS * config.H64_DQ_CONSUMERS * THREADS_PER_WG
            <= REGISTERS_PER_SM)  # fmt: skip
    for heads, regs in ((64, 96), (128, 64)):  # fp32 accumulators a consumer thread
        per_wg = config.H64_DQ_CHUNKS_PER_WG[heads]
        assert per_wg * config.CHUNK * heads // THREADS_PER_WG == regs
        # the column groups of one head block tile the nine 64-column blocks
        assert config.NCHUNK % config.h64_dq_chunks(heads) == 0
    assert [config.h64_dq_heads(h) for h in (64, 128, 192, 256)] == [64, 128, 64, 128]
    assert config.H64_DQ_THREADS == 512
    assert [config.h64_workspace_rows(k) for k in (1, 64, 65, 100, 2048)] == [64, 64, 128, 128,
                                                                               2048]  # fmt: skip
    assert config.h64_supported(64) and config.h64_supported(128)
    assert not any(config.h64_supported(h) for h in (0, 16, 32, 96))


def _valid(idx: torch.Tensor, slots: int) -> torch.Tensor:
    return (idx >= 0) & (idx < slots)


def _kv_part(q, kv, dout, lse2, delta, idx, ws, dkv, scale_log2, scale):
    """The kv kernel's contract in torch, with its roundings (P^T, dS^T to q's dtype before
    their MMAs): dS of every position of whole tiles into ws (0 past topk and at invalid
    entries), dkv[row] += dS^T q + P^T dO over the valid rows."""
    dt, slots = q.dtype, kv.shape[0]
    tokens, topk = idx.shape
    valid = _valid(idx, slots)
    rows = kv.float()[torch.where(valid, idx, 0).long()] * valid[..., None]
    s = torch.einsum("thd,tkd->thk", q.float(), rows)
    p = torch.exp2(s * scale_log2 - lse2[..., None])
    p = torch.where(valid[:, None, :], p, 0.0)
    dp = torch.einsum("thv,tkv->thk", dout.float(), rows[..., :LATENT])
    ds = (p * (dp - delta[..., None]) * scale).to(dt)
    ws.zero_()
    ws[:, :topk] = ds.transpose(1, 2)
    d_rows = torch.einsum("thk,thd->tkd", ds.float(), q.float())
    d_rows[..., :LATENT] += torch.einsum("thk,thv->tkv", p.to(dt).float(), dout.float())
    dkv.index_add_(0, torch.where(valid, idx, 0).long().flatten(),
                   (d_rows * valid[..., None]).flatten(0, 1))  # fmt: skip


def _dq_part(kv, idx, ws, dq):
    """The dq kernel's contract: dq = dS K over the workspace's rows, the listed rows gathered
    (invalid and past-topk rows 0), written in dq's dtype."""
    tokens, rows_ws, _ = ws.shape
    pos = torch.arange(rows_ws)
    entry = idx[:, pos.clamp(max=idx.shape[1] - 1)]
    valid = _valid(entry, kv.shape[0]) & (pos < idx.shape[1])
    rows = kv.float()[torch.where(valid, entry, 0).long()] * valid[..., None]
    dq.copy_(torch.einsum("tkh,tkd->thd", ws.float(), rows).to(dq.dtype))


def _fake_kernels(monkeypatch):
    calls = []

    def get_kernel(spec, params):
        part = dict(params)["h64"]
        fn = _kv_part if part == "kv" else _dq_part
        return lambda *args: calls.append((dict(params), args)) or fn(*args)

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    return calls


def _problem(tokens, heads, topk, slots, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, heads, WIDTH, generator=g).to(dtype)
    kv = torch.randn(slots, WIDTH, generator=g).to(dtype)
    idx = torch.randint(0, slots, (tokens, topk), generator=g, dtype=torch.int32)
    idx[0, 3::7] = -1
    idx[1] = -1  # a row without entries: dq 0
    idx[2, -5:] = slots + 3  # past the cache: adds nothing
    dout = torch.randn(tokens, heads, LATENT, generator=g).to(dtype)
    sink, dlse = torch.randn(heads, generator=g), torch.randn(tokens, heads, generator=g)
    return q, kv, idx, dout, sink, dlse


@pytest.mark.parametrize("dtype,heads,topk", [(torch.bfloat16, 64, 100), (torch.float16, 64, 64),
                                              (torch.bfloat16, 128, 130)])  # fmt: skip
def test_h64_launches_replayed_give_the_reference(monkeypatch, dtype, heads, topk):
    calls = _fake_kernels(monkeypatch)
    tokens, slots, scale = 5, 300, WIDTH**-0.5
    q, kv, idx, dout, sink, dlse = _problem(tokens, heads, topk, slots, dtype, heads + topk)
    clean = torch.where(idx < slots, idx, -1)
    out, lse = dsa_sparse_attention_ref(q, kv, clean, scale, attn_sink=sink, dtype=torch.float64)
    out, lse = out.to(dtype), lse.float()
    dq = torch.full_like(q, float("nan"))
    got = launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, sink, idx, scale, dq=dq, h64=True)
    # two launches, kv then dq, on one workspace of whole tiles
    name = dtype_name(dtype)
    assert [c[0] for c in calls] == [dict(config.params_h64(name, "kv")), dict(
        config.params_h64(name, "dq", dq_heads=config.h64_dq_heads(heads)))]  # fmt: skip
    ws = calls[0][1][6]
    assert ws is calls[1][1][2]
    assert ws.shape == (tokens, config.h64_workspace_rows(topk), heads) and ws.dtype == dtype
    assert math.isclose(calls[0][1][8], scale * math.log2(math.e))
    assert calls[1][1][3] is dq is got[0]
    kw = {"attn_sink": sink, "out": out, "lse": lse, "dlse": dlse}
    want = dsa_sparse_attention_bwd_ref(q, kv, clean, scale, dout, dtype=torch.float64, **kw)
    low = dsa_sparse_attention_bwd_ref(q, kv, clean, scale, dout, dtype=dtype, **kw)
    for a, b, lp in zip(got, want, low):
        top = float(b.abs().max())
        err = float((a.double() - b).abs().max())
        assert err <= 2e-2 * top
        assert err <= 2 * float((lp.double() - b).abs().max()) + 1e-3 * top
    assert (got[0][1] == 0).all()


def test_h64_launcher_rejects_and_keys(monkeypatch):
    calls = _fake_kernels(monkeypatch)
    q, kv, idx, dout, _, _ = _problem(3, 32, 64, 50, torch.bfloat16, 0)
    lse = torch.zeros(q.shape[:2])
    with pytest.raises(ValueError, match="multiple of 64"):
        launch.dsa_sparse_bwd(q, kv, dout, dout, lse, None, None, idx, 0.1, h64=True)
    assert launch.h64_unsupported(q) is not None
    q, kv, idx, dout, _, _ = _problem(3, 64, 64, 50, torch.bfloat16, 0)
    assert launch.h64_unsupported(q) is None
    lse = torch.zeros(q.shape[:2])
    launch.dsa_sparse_bwd(q, kv, dout, dout, lse, None, None, idx, 0.1, h64=True, reduce=False)
    launch.dsa_sparse_bwd(q, kv, dout, dout, lse, None, None, idx, 0.1, h64=True, h64_v2=True)
    keys = [tuple(sorted(c[0].items())) for c in calls]
    assert keys == [config.params_h64("bfloat16", "kv", reduce=False),
                    config.params_h64("bfloat16", "dq"),
                    config.params_h64("bfloat16", "kv", shfl4=False),
                    config.params_h64("bfloat16", "dq")]  # fmt: skip
    assert set(keys) <= set(SPEC.candidate_params())
