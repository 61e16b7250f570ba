"""The h64 kernels of the DSA sparse backward (kernels/attention/dsa_sparse_bwd/sm90/
kernel_h64f.py, the launcher's default at H a multiple of 64, and kernel_h64.py's two-kernel
form before it) on the CPU: their compile keys
(standard builds, so that no default call compiles) and budgets (shared memory, the setmaxnreg
split, the work split), the default's choice of path, and the launcher's launches replayed
through torch stand-ins that follow the kernels' stated contracts (`kv`: dkv and dS of every
position of whole tiles into the (tokens, rows, H) workspace, 0 past topk and at invalid
entries; `dq`: dq = dS K over the workspace's rows; `fused`: both in one launch, no
workspace), against the fp64 reference on awkward
sizes: 64 / 128 heads, topk not a multiple of 64, -1 and past-the-cache entries, a row without
entries, a sink and a loss on the LSE; one chunk or several (the workspace's cap,
config.H64_WS_CAP_BYTES, or a smaller h64_ws), and through the op. The kernels' numbers on a
GPU: tests/gpu/test_dsa_sparse_bwd_kernel_gpu.py -k h64; their SASS:
tests/test_dsa_sparse_bwd_kernel_compile.py."""

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
    with pytest.raises(ValueError, match="kv and fused parts only"):
        config.params_h64("bfloat16", "dq", reduce=False)
    assert dict(config.params_h64("bfloat16", "fused")) == {
        "dtype": "bfloat16", "block": 64, "h64": "fused"}  # fmt: skip
    assert dict(config.params_h64("bfloat16", "fused", reduce=False))["noreduce"] is True
    with pytest.raises(ValueError, match="kv part only"):
        config.params_h64("bfloat16", "fused", shfl4=False)
    with pytest.raises(ValueError, match="kv part only"):
        config.params_h64("bfloat16", "dq", shfl4=False)
    assert dict(config.params_h64("bfloat16", "kv", shfl4=False))["v2"] is True
    with pytest.raises(ValueError, match="dtype"):
        config.params_h64("float32", "kv")
    assert dict(config.params_h64("bfloat16", "dq", dq_heads=128))["dq_heads"] == 128
    with pytest.raises(ValueError, match="dq_heads"):
        config.params_h64("bfloat16", "kv", dq_heads=128)
    with pytest.raises(ValueError, match="dq_heads"):
        config.params_h64("bfloat16", "dq", dq_heads=96)


def test_h64_builds_standard_and_candidates():
    """The default's h64 builds are standard (`forgekernel build` prebuilds them): the fused
    kernel, both dtypes; the candidates hold the two-kernel form (the kv part and the dq part at
    64 and 128 heads a CTA, both dtypes: the bench variant `split`) and the probe's builds (fused
    and kv without reductions, kv with v2 reductions), none of them twice."""
    std = [p for p in SPEC.standard_params() if "h64" in dict(p)]
    cands = [p for p in SPEC.candidate_params() if "h64" in dict(p)]
    assert std == [config.params_h64(d, "fused") for d in config.DTYPES]
    assert len(SPEC.standard_params()) == 6
    assert len(cands) == len(set(cands)) == 9
    assert {(dict(p)["dtype"], dict(p)["h64"], dict(p).get("dq_heads", 64)) for p in cands[:6]} == {
        *((d, part, 64) for d in config.DTYPES for part in ("kv", "dq")),
        *((d, "dq", 128) for d in config.DTYPES)}  # fmt: skip
    assert cands[6:] == [config.params_h64("bfloat16", "fused", reduce=False),
                         config.params_h64("bfloat16", "kv", reduce=False),
                         config.params_h64("bfloat16", "kv", shfl4=False)]  # fmt: skip
    assert not set(std) & set(SPEC.candidate_params())


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


def test_h64f_budgets():
    """The fused kernel: the kv part's shared memory (lse2 / Delta' of the 64 heads in the
    barrier block's spare bytes); the setmaxnreg split 24 / 240 gives out exactly the launch
    allocation (3 x 168: setmaxnreg.inc takes only what .dec released); its dq^T blocks
    cover the nine 64-column blocks once, 128 / 160 accumulator registers a consumer thread (4 /
    5 blocks of 64 x 64 fp32), the second warpgroup's beside one dkv accumulator (32)."""
    assert config.h64f_bytes() == config.h64_kv_bytes() <= SMEM_CAPACITY
    launch_regs = REGISTERS_PER_SM // config.THREADS // 8 * 8  # 168
    assert config.H64F_PRODUCER_REGS + 2 * config.H64F_CONSUMER_REGS == 3 * launch_regs
    blocks = [b for wg in config.H64F_DQ_BLOCKS for b in wg]
    assert sorted(blocks) == list(range(config.NCHUNK))
    per_block = config.CHUNK * config.H64_BLOCK // THREADS_PER_WG
    regs = [len(wg) * per_block + config.H64F_KV_ACCS[w] * per_block
            for w, wg in enumerate(config.H64F_DQ_BLOCKS)]  # fmt: skip
    assert regs == [128 + 64, 160 + 32] and max(regs) < config.H64F_CONSUMER_REGS


def test_h64_chunk_tokens():
    """The workspace's cap (1 GiB): the suite's H 64 cases in one chunk (exactly 1 GiB), its H 128
    ones in 2 / 4 chunks of 2048 tokens; at least one token a chunk, at most all of them."""
    assert config.H64_WS_CAP_BYTES == 1 << 30

    def chunks(tokens, heads, topk):
        rows = config.h64_workspace_rows(topk)
        chunk = config.h64_chunk_tokens(tokens, rows, heads)
        assert chunk * rows * heads * 2 <= config.H64_WS_CAP_BYTES or chunk == 1
        return chunk, -(-tokens // chunk)

    assert chunks(4096, 64, 2048) == (4096, 1)
    assert chunks(16384, 64, 512) == (16384, 1)
    assert chunks(4096, 128, 2048) == (2048, 2)
    assert chunks(8192, 128, 2048) == (2048, 4)
    assert chunks(32768, 128, 2048) == (2048, 16)
    assert chunks(7, 64, 100) == (7, 1)
    assert config.h64_chunk_tokens(5, 1 << 22, 256) == 1  # one token's 2 GiB: one a chunk
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


def _fused_part(q, kv, dout, lse2, delta, idx, dq, dkv, scale_log2, scale):
    """The fused kernel's contract: the kv part's dkv and dS (rounded to q's dtype, as in its
    shared memory) and the dq part's dq = dS K, no workspace in its interface."""
    ws = torch.empty(idx.shape[0], config.h64_workspace_rows(idx.shape[1]), q.shape[1],
                     dtype=q.dtype)  # fmt: skip
    _kv_part(q, kv, dout, lse2, delta, idx, ws, dkv, scale_log2, scale)
    _dq_part(kv, idx, ws, dq)


def _fake_kernels(monkeypatch):
    """The kernels replaced by their contracts (v1's keys, without `h64`, by the fused one's:
    the same operands and outputs); the (key, args) of every launch."""
    calls = []
    parts = {"kv": _kv_part, "dq": _dq_part, "fused": _fused_part}

    def get_kernel(spec, params):
        fn = parts[dict(params).get("h64", "fused")]
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


def _reference_problem(tokens, heads, topk, dtype, seed, slots=300):
    """_problem with the fp64 forward's out (rounded to dtype) and fp32 LSE, the indices with
    the past-the-cache entries as -1 (`clean`: what the reference and the op take)."""
    q, kv, idx, dout, sink, dlse = _problem(tokens, heads, topk, slots, dtype, seed)
    clean = torch.where(idx < slots, idx, -1)
    out, lse = dsa_sparse_attention_ref(q, kv, clean, WIDTH**-0.5, attn_sink=sink,
                                        dtype=torch.float64)  # fmt: skip
    return q, kv, idx, clean, dout, out.to(dtype), lse.float(), sink, dlse


def _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse):
    """(dq, dkv, d_sink) within 2e-2 of the fp64 reference's largest entry and 2x the error of
    the reference in q's dtype plus 1e-3 of it (the GPU tests' bounds); rows without entries 0."""
    kw = {"attn_sink": sink, "out": out, "lse": lse, "dlse": dlse}
    scale = WIDTH**-0.5
    want = dsa_sparse_attention_bwd_ref(q, kv, clean, scale, dout, dtype=torch.float64, **kw)
    low = dsa_sparse_attention_bwd_ref(q, kv, clean, scale, dout, dtype=q.dtype, **kw)
    for a, b, lp in zip(got, want, low):
        assert torch.isfinite(a).all()
        top = float(b.abs().max())
        err = float((a.double() - b).abs().max())
        assert err <= 2e-2 * top
        assert err <= 2 * float((lp.double() - b).abs().max()) + 1e-3 * top
    assert (got[0][(clean < 0).all(1)] == 0).all()


@pytest.mark.parametrize("dtype,heads,topk", [(torch.bfloat16, 64, 100), (torch.float16, 64, 64),
                                              (torch.bfloat16, 128, 130)])  # fmt: skip
def test_h64_launches_replayed_give_the_reference(monkeypatch, dtype, heads, topk):
    calls = _fake_kernels(monkeypatch)
    tokens, scale = 5, WIDTH**-0.5
    q, kv, idx, clean, dout, out, lse, sink, dlse = _reference_problem(tokens, heads, topk, dtype,
                                                                       heads + topk)  # fmt: skip
    dq = torch.full_like(q, float("nan"))
    got = launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, sink, idx, scale, dq=dq, h64=True,
                                h64_fused=False)  # fmt: skip
    # two launches, kv then dq, on one workspace of whole tiles (one chunk: 5 tokens' is 80 KiB)
    name = dtype_name(dtype)
    assert [c[0] for c in calls] == [dict(config.params_h64(name, "kv")), dict(
        config.params_h64(name, "dq", dq_heads=config.h64_dq_heads(heads)))]  # fmt: skip
    ws = calls[0][1][6]
    assert ws is calls[1][1][2]
    assert ws.shape == (tokens, config.h64_workspace_rows(topk), heads) and ws.dtype == dtype
    assert math.isclose(calls[0][1][8], scale * math.log2(math.e))
    assert calls[0][1][0] is q and calls[1][1][3] is dq is got[0]
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


@pytest.mark.parametrize("dtype,heads,topk", [(torch.bfloat16, 64, 100), (torch.float16, 64, 64),
                                              (torch.bfloat16, 128, 130),
                                              (torch.bfloat16, 192, 1)])  # fmt: skip
@pytest.mark.parametrize("offset", [0, 1])
def test_h64f_launch_replayed_gives_the_reference(monkeypatch, dtype, heads, topk, offset):
    """The default at H a multiple of 64: one launch of the fused kernel on the tensors
    themselves (no workspace, no chunks), dq written in place when its rows are 16-byte aligned
    (offset 0), through an aligned copy otherwise (a view one element in); the fp64
    reference's gradients."""
    calls = _fake_kernels(monkeypatch)
    tokens, scale = 5, WIDTH**-0.5
    q, kv, idx, clean, dout, out, lse, sink, dlse = _reference_problem(tokens, heads, topk, dtype,
                                                                       heads + topk)  # fmt: skip
    flat = torch.full((q.numel() + 1,), float("nan"), dtype=dtype)
    dq = flat[offset : offset + q.numel()].view(q.shape)
    got = launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, sink, idx, scale, dq=dq)
    assert [c[0] for c in calls] == [dict(config.params_h64(dtype_name(dtype), "fused"))]
    args = calls[0][1]
    assert args[0] is q and args[1] is kv and args[5] is idx and args[7] is got[1]
    assert (args[6] is dq) == (offset == 0) and got[0] is dq
    assert args[6].data_ptr() % 16 == 0 and args[6].shape == q.shape
    assert math.isclose(args[8], scale * math.log2(math.e)) and args[9] == scale
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


@pytest.mark.parametrize("dtype,heads,topk,step,offset", [
    (torch.bfloat16, 128, 130, 2, 0),
    (torch.float16, 64, 100, 3, 1),
    (torch.bfloat16, 192, 64, 1, 0),
])  # fmt: skip
def test_h64f_past_the_grid_limit_launches_row_slices(monkeypatch, dtype, heads, topk, step,
                                                      offset):  # fmt: skip
    """The fused kernel's grid is (H / 64, tokens): past config.H64F_GRID_TOKENS tokens (lowered
    here to `step`) the launcher runs it on row slices of q, dout, lse2, Delta', the indices and
    dq (views of the same memory with the parent's strides; dq the aligned copy when the
    caller's is off 16 bytes), kv and one dkv accumulator shared; the fp64 reference's
    gradients."""
    calls = _fake_kernels(monkeypatch)
    monkeypatch.setattr(config, "H64F_GRID_TOKENS", step)
    tokens = 7
    q, kv, idx, clean, dout, out, lse, sink, dlse = _reference_problem(tokens, heads, topk, dtype,
                                                                       heads + step)  # fmt: skip
    flat = torch.full((q.numel() + 1,), float("nan"), dtype=dtype)
    dq = flat[offset : offset + q.numel()].view(q.shape)
    got = launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, sink, idx, WIDTH**-0.5, dq=dq)
    spans = [(t0, min(t0 + step, tokens)) for t0 in range(0, tokens, step)]
    assert [c[0]["h64"] for c in calls] == ["fused"] * len(spans) and len(spans) >= 3
    written = calls[0][1][6] if offset == 0 else None
    for (t0, t1), (_, a) in zip(spans, calls):
        n = t1 - t0
        for arg, whole in ((a[0], q), (a[2], dout), (a[5], idx)):
            assert arg.shape[0] == n and arg.data_ptr() == whole[t0].data_ptr()
            assert arg.stride() == whole.stride()
        assert a[3].shape == a[4].shape == (n, heads)
        assert a[6].shape == (n, heads, WIDTH) and a[6].data_ptr() % 16 == 0
        assert (a[6].data_ptr() == dq[t0].data_ptr()) == (offset == 0)
        assert a[1] is kv and a[7] is got[1]
    assert written is None or written.data_ptr() == dq.data_ptr()
    assert got[0] is dq
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


@pytest.mark.parametrize("heads,sms,by", [(128, 5, "forced"), (64, 3, "default"),
                                           (192, 7, "default"), (16, 3, "forced"),
                                           (32, 4, "default")])  # fmt: skip
def test_sweep_launches_waves_of_sorted_rows(monkeypatch, heads, sms, by):
    """The sweep (the fused kernel at H 64 / 128 / 192, v1 at H 16 / 32): the index rows sorted
    by slot (every row's entries, -1 and past-the-cache ones included, ascending), the tokens in
    launches of one wave (sms // CTAs a token, at least 1) on row slices; the default sweeps
    exactly where the cache's rows and dkv rows exceed the L2 (lowered here around the
    problem's size) and a wave visits a row at least SWEEP_MIN_VISITS times (set around the
    problem's); the fp64 reference's gradients."""
    calls = _fake_kernels(monkeypatch)
    monkeypatch.setattr(launch, "num_sms", lambda index: sms)
    tokens, topk, slots = 7, 100, 120
    problem = _reference_problem(tokens, heads, topk, torch.bfloat16, sms, slots)
    q, kv, idx, clean, dout, out, lse, sink, dlse = problem
    args = (q, kv, dout, out, lse, dlse, sink, idx, WIDTH**-0.5)
    part = "fused" if heads % 64 == 0 else None
    ctas = heads // (64 if part else config.block_heads(heads))
    assert ctas == launch.ctas_per_token(heads)
    step = max(1, sms // ctas)
    assert step == config.sweep_tokens(sms, ctas)
    if by == "default":
        visits = step * topk / slots  # a row's visits a wave
        full = slots * config.SWEEP_ROW_BYTES
        for l2, least in ((full, visits), (full - 1, visits + 0.01)):  # not far; too few visits
            monkeypatch.setattr(config, "SWEEP_L2_BYTES", l2)
            monkeypatch.setattr(config, "SWEEP_MIN_VISITS", least)
            assert not launch.sweeps_by_default(slots, topk, ctas, None)
            launch.dsa_sparse_bwd(*args)
            assert len(calls) == 1 and calls.pop()[1][5] is idx  # one launch, the rows as given
        monkeypatch.setattr(config, "SWEEP_MIN_VISITS", visits)
        assert launch.sweeps_by_default(slots, topk, ctas, None)
    got = launch.dsa_sparse_bwd(*args, sweep=True if by == "forced" else None)
    spans = [(t0, min(t0 + step, tokens)) for t0 in range(0, tokens, step)]
    assert [c[0].get("h64") for c in calls] == [part] * len(spans) and len(spans) >= 2
    for (t0, t1), (_, a) in zip(spans, calls):
        assert a[0].shape[0] == t1 - t0 and a[0].data_ptr() == q[t0].data_ptr()
        assert a[6].data_ptr() == got[0][t0].data_ptr()
        assert torch.equal(a[5], idx[t0:t1].sort(dim=1).values)
        assert a[7] is got[1]
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


def test_sweeps_by_default_at_the_suite_shapes(monkeypatch):
    """On 132 SMs (H100 SXM / H200) the default sweeps every suite case over the L2:
    t8192-h16-kv32768, t32768-h16-kv65536, t8192-h128-kv65536 (a row visited 8.3 / 4.1 / 2.1
    times a wave), t4096-h64-kv16384 (the cache 1.1x the L2, 16.5 visits) and
    t16384-h64-kv65536-k512 (1.03 visits); nothing at kv 8192 (under the L2); on 114 (H100
    PCIe) t8192-h128-kv65536 still (1.8 visits), not t16384-h64-kv65536-k512 (0.89)."""
    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    shapes = {(16, 32768, 2048): True, (16, 65536, 2048): True, (128, 65536, 2048): True,
              (64, 16384, 2048): True, (64, 65536, 512): True, (16, 8192, 2048): False,
              (128, 8192, 2048): False}  # fmt: skip
    for (heads, slots, topk), want in shapes.items():
        assert launch.sweeps_by_default(slots, topk, launch.ctas_per_token(heads), 0) is want
    monkeypatch.setattr(launch, "num_sms", lambda index: 114)
    assert launch.sweeps_by_default(65536, 2048, 2, 0)
    assert not launch.sweeps_by_default(65536, 512, 1, 0)


@pytest.mark.parametrize("by", ["cap", "ws"])
@pytest.mark.parametrize("dtype,heads,topk,chunk", [(torch.bfloat16, 64, 100, 3),
                                                    (torch.float16, 128, 130, 2),
                                                    (torch.bfloat16, 192, 64, 1)])  # fmt: skip
def test_chunked_h64_launches_give_the_reference(monkeypatch, dtype, heads, topk, chunk, by):
    """The two-kernel h64 form in chunks of `chunk` tokens, by the workspace's cap (a fresh
    (chunk, rows, H) workspace) or by a smaller h64_ws (NaN-poisoned): kv then dq a chunk on
    row slices of q, dout, lse2, Delta', the indices and dq (the same memory, not copies), one
    workspace reused, one dkv accumulator; the gradients the fp64 reference's."""
    calls = _fake_kernels(monkeypatch)
    tokens = 8
    q, kv, idx, clean, dout, out, lse, sink, dlse = _reference_problem(tokens, heads, topk, dtype,
                                                                       heads + chunk)  # fmt: skip
    rows = config.h64_workspace_rows(topk)
    per_token = rows * heads * q.element_size()
    forms = {}
    if by == "cap":
        monkeypatch.setattr(config, "H64_WS_CAP_BYTES", (chunk + 1) * per_token - 1)
        forms["h64_fused"] = False  # the two-kernel form (h64_ws names it by itself)
    else:
        forms["h64_ws"] = torch.full((chunk, rows, heads), float("nan"), dtype=dtype)
    dq = torch.full_like(q, float("nan"))
    got = launch.dsa_sparse_bwd(q, kv, dout, out, lse, dlse, sink, idx, WIDTH**-0.5, dq=dq,
                                **forms)  # fmt: skip
    spans = [(t0, min(t0 + chunk, tokens)) for t0 in range(0, tokens, chunk)]
    assert len(spans) >= 3
    assert [c[0]["h64"] for c in calls] == ["kv", "dq"] * len(spans)
    ws_ptr = calls[0][1][6].data_ptr()
    if by == "ws":
        assert ws_ptr == forms["h64_ws"].data_ptr()
    for (t0, t1), (kv_call, dq_call) in zip(spans, zip(calls[::2], calls[1::2])):
        a, d = kv_call[1], dq_call[1]
        n = t1 - t0
        for arg, whole in ((a[0], q), (a[2], dout), (a[5], idx), (d[1], idx), (d[3], dq)):
            assert arg.shape[0] == n and arg.data_ptr() == whole[t0].data_ptr()
            assert arg.stride() == whole.stride()
        assert a[3].shape == a[4].shape == (n, heads)
        assert a[1] is d[0] is kv and a[7] is got[1]
        assert a[6] is d[2] and a[6].shape == (n, rows, heads) and a[6].data_ptr() == ws_ptr
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


@pytest.mark.parametrize("heads", [64, 128])
def test_op_default_runs_h64f(monkeypatch, heads):
    """The op (explicit backward; the kernel's `unsupported` and the preprocess kernel's faked
    on the CPU) runs the launcher's default: the fused kernel, one launch whatever the
    workspace's cap (it has none), its gradients (dq split, dkv cast to q's dtype) the fp64
    reference's."""
    from forgekernel.ops import dsa as fwd
    from forgekernel.ops import dsa_bwd

    calls = _fake_kernels(monkeypatch)
    monkeypatch.setattr(dsa_bwd.kernel_launch, "unsupported", lambda *a: None)
    monkeypatch.setattr(dsa_bwd.pre_launch, "unsupported", lambda *a: "the CPU")
    monkeypatch.setattr(fwd, "check_cuda", lambda name, t: None)
    tokens, topk, dtype = 7, 100, torch.bfloat16
    q, kv, _, clean, dout, out, lse, sink, dlse = _reference_problem(tokens, heads, topk, dtype,
                                                                     heads)  # fmt: skip
    per_token = config.h64_workspace_rows(topk) * heads * 2
    monkeypatch.setattr(config, "H64_WS_CAP_BYTES", 3 * per_token)
    dq_nope, dq_pe, dkv, dkpe, d_sink = dsa_bwd.dsa_sparse_attention_backward(
        q[..., :LATENT], q[..., LATENT:], kv.view(-1, 1, 1, WIDTH), None, clean, dout,
        softmax_scale=WIDTH**-0.5, out=out, lse=lse, attn_sink=sink, dlse=dlse,
    )  # fmt: skip
    assert [c[0]["h64"] for c in calls] == ["fused"]
    assert dkpe is None and dkv.shape == (kv.shape[0], 1, 1, WIDTH) and dkv.dtype == dtype
    got = (torch.cat((dq_nope, dq_pe), -1), dkv.view(-1, WIDTH), d_sink)
    _assert_reference(got, q, kv, clean, dout, out, lse, sink, dlse)


def test_chunked_h64_launches_read_nothing_back(monkeypatch):
    """The chunk loops (the split form's, the fused kernel's row slices, the sweep's sort and
    waves, v1's too) run on shapes only: on meta tensors (the kernels no-ops) nothing is read
    back or copied from the host (tests/capture_safety.py), so CUDA-graph capture holds."""
    from capture_safety import assert_capturable, meta

    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: lambda *a: None)
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    q, kv, idx, dout, sink, dlse = _problem(8, 128, 100, 300, torch.bfloat16, 3)
    lse = torch.randn(q.shape[:2])
    monkeypatch.setattr(config, "H64_WS_CAP_BYTES", 3 * 128 * 128 * 2)
    args = meta(q, kv, dout, dout, lse, dlse, sink, idx)
    assert_capturable(launch.dsa_sparse_bwd, *args, WIDTH**-0.5, h64_fused=False)
    assert_capturable(launch.dsa_sparse_bwd, *args, WIDTH**-0.5)  # the fused default
    monkeypatch.setattr(config, "H64F_GRID_TOKENS", 3)  # the fused default in row slices
    assert_capturable(launch.dsa_sparse_bwd, *args, WIDTH**-0.5)
    monkeypatch.setattr(launch, "num_sms", lambda index: 6)  # the sweep: 3 tokens a wave
    assert_capturable(launch.dsa_sparse_bwd, *args, WIDTH**-0.5, sweep=True)
    assert_capturable(launch.dsa_sparse_bwd, *args, WIDTH**-0.5, sweep=True, h64=False)  # v1


def test_h64_launcher_rejects_and_keys(monkeypatch):
    calls = _fake_kernels(monkeypatch)
    q, kv, idx, dout, _, _ = _problem(3, 32, 64, 50, torch.bfloat16, 0)
    lse = torch.zeros(q.shape[:2])
    args = (q, kv, dout, dout, lse, None, None, idx, 0.1)
    with pytest.raises(ValueError, match="multiple of 64"):
        launch.dsa_sparse_bwd(*args, h64=True)
    assert launch.h64_unsupported(q) is not None
    for bad in ({"h64_v2": True}, {"h64_ws": torch.empty(3, 64, 32, dtype=q.dtype)}):
        with pytest.raises(ValueError, match="apply to the h64 kernels"):
            launch.dsa_sparse_bwd(*args, **bad)  # H 32: the default is v1
    q, kv, idx, dout, _, _ = _problem(3, 64, 64, 50, torch.bfloat16, 0)
    assert launch.h64_unsupported(q) is None
    lse = torch.zeros(q.shape[:2])
    args = (q, kv, dout, dout, lse, None, None, idx, 0.1)
    for bad in ({"xchg": False}, {"red4s": True}, {"h64": True, "xchg": True}):
        with pytest.raises(ValueError, match="pass h64=False"):
            launch.dsa_sparse_bwd(*args, **bad)
    with pytest.raises(ValueError, match="apply to the h64 kernels"):
        launch.dsa_sparse_bwd(*args, h64=False, h64_v2=True)
    for shape, dtype in (((3, 64, 64), torch.float16), ((3, 128, 64), torch.bfloat16),
                         ((0, 64, 64), torch.bfloat16), ((64, 64), torch.bfloat16)):  # fmt: skip
        with pytest.raises(ValueError, match="h64_ws must be"):
            launch.dsa_sparse_bwd(*args, h64_ws=torch.empty(shape, dtype=dtype))
    with pytest.raises(ValueError, match="h64_fused=False"):
        launch.dsa_sparse_bwd(*args, h64_fused=True, h64_v2=True)
    with pytest.raises(ValueError, match="h64_fused applies"):
        launch.dsa_sparse_bwd(*args, h64=False, h64_fused=True)
    with pytest.raises(ValueError, match="sweep applies"):
        launch.dsa_sparse_bwd(*args, sweep=True, h64_fused=False)
    assert not calls
    launch.dsa_sparse_bwd(*args, h64=True, reduce=False)
    launch.dsa_sparse_bwd(*args, h64_fused=False, reduce=False)
    launch.dsa_sparse_bwd(*args, h64_v2=True)
    keys = [tuple(sorted(c[0].items())) for c in calls]
    assert keys == [config.params_h64("bfloat16", "fused", reduce=False),
                    config.params_h64("bfloat16", "kv", reduce=False),
                    config.params_h64("bfloat16", "dq"),
                    config.params_h64("bfloat16", "kv", shfl4=False),
                    config.params_h64("bfloat16", "dq")]  # fmt: skip
    assert set(keys) <= {*SPEC.standard_params(), *SPEC.candidate_params()}


@pytest.mark.parametrize("heads", [16, 32, 64, 96, 128, 192, 256])
def test_default_takes_h64_exactly_at_multiples_of_64(monkeypatch, heads):
    """h64=None (the default) runs the fused h64 kernel iff H % 64 == 0, v1's xchg4s otherwise;
    h64_fused=False there the two h64 launches (dq at 128 heads a CTA iff H % 128 == 0);
    h64=False v1 at every H; every key the default reaches a standard build (no user call
    compiles)."""
    seen = []
    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: seen.append(params)
                        or (lambda *a: None))  # fmt: skip
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    q, kv, idx, dout, _, _ = _problem(3, heads, 64, 50, torch.float16, heads)
    args = (q, kv, dout, dout, torch.zeros(q.shape[:2]), None, None, idx, 0.1)
    launch.dsa_sparse_bwd(*args)
    v1 = config.params_for("float16", config.block_heads(heads), xchg=True, red4s=True)
    if heads % 64 == 0:
        assert seen == [config.params_h64("float16", "fused")]
        seen.clear()
        launch.dsa_sparse_bwd(*args, h64_fused=False)
        dq_heads = 128 if heads % 128 == 0 else 64
        assert seen == [config.params_h64("float16", "kv"),
                        config.params_h64("float16", "dq", dq_heads=dq_heads)]  # fmt: skip
        assert set(seen) <= set(SPEC.candidate_params())
    else:
        assert seen == [v1]
        assert set(seen) <= set(SPEC.standard_params())
    seen.clear()
    launch.dsa_sparse_bwd(*args, h64=False)
    assert seen == [v1]
