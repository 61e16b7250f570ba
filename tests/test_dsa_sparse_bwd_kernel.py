"""The v1 DSA sparse backward kernel's plumbing on the CPU (its numbers on the GPU:
tests/gpu/test_dsa_sparse_bwd_kernel_gpu.py): compile keys and the shared-memory plan, the
launcher's input checks, its preprocess against the reference (the kernel's math emulated in
torch from lse2 / Delta' gives the fp64 reference's gradients, awkward rows included), and the
op's switch (FORGEKERNEL_DSA_BWD_KERNEL, the pending suite's preference, the interim fallback)."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC, config, launch
from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
from forgekernel.ops import dsa_bwd
from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref, dsa_sparse_attention_ref

WIDTH, LATENT = config.WIDTH, config.D_V


def test_params_and_blocks():
    assert config.params_for("bfloat16", 16) == (("block", 16), ("dtype", "bfloat16"))
    with pytest.raises(ValueError, match="dtype"):
        config.params_for("float32", 16)
    with pytest.raises(ValueError, match="block"):
        config.params_for("bfloat16", 64)
    assert [config.block_heads(h) for h in (16, 32, 64, 128)] == [16, 32, 32, 32]
    for h in (0, 8, 24, 48):
        with pytest.raises(ValueError, match="16 heads or a multiple of 32"):
            config.block_heads(h)
    # v1's standard builds (the h64 kernels': tests/test_dsa_sparse_bwd_h64.py)
    v1 = [p for p in SPEC.standard_params() if "h64" not in dict(p)]
    assert len(v1) == len(config.DTYPES) * len(config.BLOCKS)
    # the standard form: xchg4s (red4s under xchg) at both blocks (2026-12-04 04:23)
    standard = {
        dict(p)["block"]: (dict(p).get("xchg", False), dict(p).get("red4s", False)) for p in v1
    }
    assert standard == {16: (True, True), 32: (True, True)}
    assert all(config.standard_red4s(b) and config.standard_xchg(b) for b in config.BLOCKS)
    for b in config.BLOCKS:  # the no-reduction builds keep the split form and the fragments' v2
        assert not config.standard_red4s(b, False) and not config.standard_xchg(b, False)
    assert SPEC.name == "dsa_sparse_bwd_sm90" and SPEC.representative_params() in [
        *SPEC.standard_params()
    ]


def test_smem_plan_fits():
    for b in config.BLOCKS:
        assert config.stages(b) == 2
        assert config.smem_bytes(b) <= SMEM_CAPACITY
    assert config.smem_bytes(16) == 18432 + 16384 + 4096 + 1024 + 2 * 73728


def test_candidate_params():
    """The probe's and the bench variant's builds at both blocks: red4s (the standard form
    before xchg4s) and v2, each with and without reductions, xchg4s (the standard form) and
    xchg (v2) without reductions; xchg with v2 reductions and the measured-and-dropped forms
    (bulk, red4, red4p and its diagnostics) are gone. The h64 variant's builds:
    tests/test_dsa_sparse_bwd_h64.py."""
    cands = [dict(p) for p in SPEC.candidate_params() if "h64" not in dict(p)]
    assert len(cands) == len({tuple(sorted(c.items())) for c in cands}) == 12
    for b in config.BLOCKS:
        forms = sorted(
            (not c.get("noreduce", False), c.get("xchg", False), c.get("red4s", False))
            for c in cands
            if c["block"] == b
        )
        assert forms == sorted([(True, False, True), (False, False, True), (True, False, False),
                                (False, False, False), (False, True, True),
                                (False, True, False)])  # fmt: skip
    assert all(c["dtype"] == "bfloat16" for c in cands)
    assert not set().union(*cands) - {"dtype", "block", "noreduce", "xchg", "red4s"}
    std = {tuple(sorted(dict(p).items())) for p in SPEC.standard_params()}
    assert not std & {tuple(sorted(c.items())) for c in cands}
    for gone in ("bulk", "red4", "red4p", "gather64", "handshake"):
        with pytest.raises(TypeError):
            config.params_for("bfloat16", 16, **{gone: True})
    for name in ("BULK_WARPS", "RED4P_GATHER", "RED4P_REDUCERS", "RED4_BLOCKS", "bulk_bytes"):
        assert not hasattr(config, name)


def test_launcher_compile_keys(monkeypatch):
    """The launcher's candidate keywords reach the compile key of v1 (h64=False; the kernel call
    faked on the CPU): every H takes xchg4s (xchg with red4s) unless a form is named;
    xchg=False the candidate red4s; reduce=False the split form and the fragments' v2. (The
    default at H a multiple of 64, the h64 kernels: tests/test_dsa_sparse_bwd_h64.py.)"""
    seen = []
    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: seen.append(dict(params))
                        or (lambda *a: None))  # fmt: skip
    for heads in (16, 64):
        q, kv, idx = _rows(heads=heads)
        out = torch.randn(q.shape[0], q.shape[1], LATENT).to(q.dtype)
        lse = torch.zeros(q.shape[:2])
        args = (q, kv, out, out, lse, None, None, idx, 0.1)
        v1 = {"h64": False}
        launch.dsa_sparse_bwd(*args, **v1)
        launch.dsa_sparse_bwd(*args, xchg=True, red4s=True, **v1)
        launch.dsa_sparse_bwd(*args, xchg=False, **v1)
        launch.dsa_sparse_bwd(*args, xchg=False, red4s=False, **v1)
        launch.dsa_sparse_bwd(*args, reduce=False, **v1)
        launch.dsa_sparse_bwd(*args, reduce=False, red4s=True, **v1)
        launch.dsa_sparse_bwd(*args, reduce=False, xchg=True, **v1)
        launch.dsa_sparse_bwd(*args, reduce=False, xchg=True, red4s=True, **v1)
    for b, keys in ((16, seen[:8]), (32, seen[8:])):
        base = {"dtype": "bfloat16", "block": b}
        assert keys == [
            base | {"xchg": True, "red4s": True},
            base | {"xchg": True, "red4s": True},
            base | {"red4s": True},
            base,
            base | {"noreduce": True},
            base | {"noreduce": True, "red4s": True},
            base | {"noreduce": True, "xchg": True},
            base | {"noreduce": True, "xchg": True, "red4s": True},
        ]
    # every key the launcher reaches is a standard or candidate build (built before a probe)
    built = {tuple(sorted(dict(p).items())) for p in [*SPEC.standard_params(),
                                                        *SPEC.candidate_params()]}  # fmt: skip
    assert {tuple(sorted(k.items())) for k in seen} <= built
    for b in config.BLOCKS:
        assert dict(config.params_for("bfloat16", b, xchg=True, red4s=True)) == {
            "dtype": "bfloat16", "block": b, "xchg": True, "red4s": True}  # fmt: skip


def test_red4s_staging_fits_in_the_dead_dq_blocks():
    """red4s stages warpgroup w's four (16, 72) fp32 buffers in the stage's dq^T column blocks
    of w (8 KB each, contiguous, config.RED4S_OFFSET), nothing of the other warpgroup's."""
    assert config.STAGE_CHUNK_FLOATS * 4 == config.TILE * config.CHUNK * config.BYTES
    spans = []
    for w, blocks in enumerate(config.DQ_BLOCKS):
        staging, dead = config.red4s_room(w)
        assert staging == 4 * 16 * 72 <= dead == len(blocks) * config.STAGE_CHUNK_FLOATS
        start = config.RED4S_OFFSET[w]
        assert start == blocks[0] * config.STAGE_CHUNK_FLOATS and start * 4 % 16 == 0
        spans.append((start, start + staging))
        # the staging lies in w's own dq blocks only (the other warpgroup's dq MMAs read theirs)
        touched = set(range(start // config.STAGE_CHUNK_FLOATS,
                            (start + staging - 1) // config.STAGE_CHUNK_FLOATS + 1))  # fmt: skip
        assert touched <= set(blocks)
        assert not touched & set(config.DQ_BLOCKS[1 - w])
    assert spans[0][1] <= spans[1][0]


def test_xchg4s_staging_is_dead_under_xchg():
    """xchg4s (red4s under xchg, config.py's RED4S_OFFSET comment): the stage's readers by
    phase. Before PDS (both warpgroups waited for their WGMMAs before FREE): S^T in warpgroup 0
    reads all nine column blocks, dP^T in warpgroup 1 blocks 0 .. 7; after PDS, as in the split
    form, only dq^T MMAs read the stage, warpgroup w blocks DQ_BLOCKS[w]. So the blocks that
    hold w's staging after w's DQ_DONE barrier are read by nobody later in the tile: not the
    other warpgroup's dq^T, and the next tile's S^T / dP^T read the other stage (two stages)."""
    vchunk = config.D_V // config.CHUNK
    before_pds = (set(range(config.NCHUNK)), set(range(vchunk)))  # S^T, dP^T: stage blocks
    after_pds = [set(b) for b in config.DQ_BLOCKS]  # the only stage readers after PDS
    assert before_pds[0] | before_pds[1] == set(range(config.NCHUNK))
    for b in config.BLOCKS:
        assert config.stages(b) == 2  # tile i + 1 reads the other stage
    for w in range(config.CONSUMERS):
        staging, _ = config.red4s_room(w)
        start = config.RED4S_OFFSET[w]
        held = set(range(start // config.STAGE_CHUNK_FLOATS,
                         (start + staging - 1) // config.STAGE_CHUNK_FLOATS + 1))  # fmt: skip
        assert held <= after_pds[w]  # dead once w's own dq^T MMAs are done
        assert not held & after_pds[1 - w]  # the other warpgroup's dq^T never reads them
    # the standard form is this one: xchg with red4s at both blocks
    assert all(config.standard_xchg(b) and config.standard_red4s(b) for b in config.BLOCKS)


def test_work_split_covers_every_block_once():
    dkv = sorted(c for blocks in config.DKV_BLOCKS for c in blocks)
    dq = sorted(c for blocks in config.DQ_BLOCKS for c in blocks)
    assert dkv == dq == list(range(config.NCHUNK))
    # 64 x 64 x BLOCK units a warpgroup issues per tile: dkv blocks < 8 are two MMAs
    units = [sum(2 if c < 8 else 1 for c in k) + len(q)
             for k, q in zip(config.DKV_BLOCKS, config.DQ_BLOCKS)]  # fmt: skip
    assert units == [13, 13]


def _rows(tokens=3, heads=16, slots=40, dtype=torch.bfloat16):
    q = torch.randn(tokens, heads, WIDTH).to(dtype)
    kv = torch.randn(slots, WIDTH).to(dtype)
    idx = torch.randint(0, slots, (tokens, 5), dtype=torch.int32)
    return q, kv, idx


def test_unsupported_names_the_reason():
    q, kv, idx = _rows()
    assert "CUDA" in launch.unsupported(q, kv, idx)
    assert "16-bit" in launch.unsupported(q.float(), kv.float(), idx)
    assert "16-bit" in launch.unsupported(q, kv.half(), idx)
    assert "int32" in launch.unsupported(q, kv, idx.long())
    assert "multiple of 32" in launch.unsupported(*_rows(heads=8)[:2], idx)
    assert "multiple of 32" in launch.unsupported(*_rows(heads=48)[:2], idx)
    assert "wide" in launch.unsupported(q[..., :512], kv, idx)


def _emulate(q, kv, idx, scale, dout, lse2, delta):
    """kernel.py's math in fp64 from the preprocess's lse2 / Delta' (P, dS from the rows)."""
    slots = kv.shape[0]
    valid = (idx >= 0) & (idx < slots)
    rows = kv.double()[torch.where(valid, idx, 0).long()]  # (S, K, 576)
    s = torch.einsum("thd,tkd->thk", q.double(), rows)
    p = torch.exp2(s * scale * math.log2(math.e) - lse2.double()[..., None])
    p = torch.where(valid[:, None, :], p, 0.0)
    dp = torch.einsum("thv,tkv->thk", dout.double(), rows[..., :LATENT])
    ds = scale * p * (dp - delta.double()[..., None])
    dq = torch.einsum("thk,tkd->thd", ds, rows)
    d_rows = torch.einsum("thk,thd->tkd", ds, q.double())
    d_rows[..., :LATENT] += torch.einsum("thk,thv->tkv", p, dout.double())
    dkv = torch.zeros(slots, WIDTH, dtype=torch.float64)
    dkv.index_add_(0, torch.where(valid, idx, 0).long().flatten(), (d_rows * valid[..., None])
                   .flatten(0, 1))  # fmt: skip
    return dq, dkv


@pytest.mark.parametrize("sink", ["none", "finite", "with_inf"])
@pytest.mark.parametrize("dlse", [False, True])
def test_preprocess_contract_gives_the_reference(sink, dlse):
    """The launcher's lse2 / Delta' / d_sink with the kernel's math = the fp64 reference, with a
    row without entries, padding and an entry past the cache."""
    torch.manual_seed(0)
    tokens, heads, slots, scale = 5, 16, 30, WIDTH**-0.5
    q = torch.randn(tokens, heads, WIDTH).double()
    kv = torch.randn(slots, WIDTH).double()
    idx = torch.randint(0, slots, (tokens, 9), dtype=torch.int32)
    idx[1] = -1  # no entry
    idx[2, 5:] = -1
    idx[3, 0] = slots + 3  # past the cache: nothing
    attn_sink = None if sink == "none" else torch.randn(heads).double()
    if sink == "with_inf":
        attn_sink[3] = float("-inf")
    clean = torch.where(idx < slots, idx, -1)
    out, lse = dsa_sparse_attention_ref(q, kv, clean, scale, attn_sink=attn_sink,
                                        dtype=torch.float64)  # fmt: skip
    dout = torch.randn(tokens, heads, LATENT).double()
    d = torch.randn(tokens, heads).double() if dlse else None
    lse2, delta, d_sink = launch.preprocess(out, dout, lse, d, attn_sink)
    assert lse2.dtype == delta.dtype == d_sink.dtype == torch.float32
    assert torch.isposinf(lse2[1]).all() == (attn_sink is None)
    dq, dkv = _emulate(q, kv, idx, scale, dout, lse2, delta)
    want = dsa_sparse_attention_bwd_ref(q, kv, clean, scale, dout, attn_sink=attn_sink, out=out,
                                        lse=lse, dlse=d, dtype=torch.float64)  # fmt: skip
    for name, got, ref in (("dq", dq, want[0]), ("dkv", dkv, want[1])):
        err = float((got - ref).abs().max())
        assert err <= 1e-5 * float(ref.abs().max()) + 1e-9, (name, err)
    assert (dq[1] == 0).all()
    if attn_sink is None:
        assert (d_sink == 0).all()
    else:
        torch.testing.assert_close(d_sink.double(), want[2], rtol=1e-5, atol=1e-6)


def test_switch(monkeypatch):
    """The kernel by default; FORGEKERNEL_DSA_BWD_KERNEL=0 the interim path; other values
    raise."""
    monkeypatch.delenv(dsa_bwd.KERNEL_ENV, raising=False)
    assert dsa_bwd.kernel_selected()
    monkeypatch.setenv(dsa_bwd.KERNEL_ENV, "0")
    assert not dsa_bwd.kernel_selected()
    monkeypatch.setenv(dsa_bwd.KERNEL_ENV, "1")
    assert dsa_bwd.kernel_selected()
    monkeypatch.setenv(dsa_bwd.KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match="must be '0' or '1'"):
        dsa_bwd.kernel_selected()


def test_selected_kernel_falls_back_where_it_cannot_run(monkeypatch):
    """On the CPU the kernel declines (`unsupported`): the selected path gives the interim's
    gradients, shapes and dtypes."""
    torch.manual_seed(1)
    tokens, heads, pages, page = 3, 16, 2, 8
    qn = torch.randn(tokens, heads, LATENT).bfloat16()
    qp = torch.randn(tokens, heads, WIDTH - LATENT).bfloat16()
    ckv = torch.randn(pages, page, LATENT).bfloat16()
    kpe = torch.randn(pages, page, WIDTH - LATENT).bfloat16()
    idx = torch.randint(0, pages * page, (tokens, 4), dtype=torch.int32)
    out = torch.randn(tokens, heads, LATENT).bfloat16()
    lse = torch.randn(tokens, heads)
    dout = torch.randn(tokens, heads, LATENT).bfloat16()
    args = (qn, qp, ckv, kpe, idx, 0.05, out, lse, dout, None, None)
    monkeypatch.setenv(dsa_bwd.KERNEL_ENV, "1")
    assert dsa_bwd._backward_kernel(*args) is None
    got = dsa_bwd._backward_full(*args)
    want = dsa_bwd._backward_interim(*args)
    for a, b in zip(got, want):
        assert a.shape == b.shape and a.dtype == b.dtype
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    shapes = [t.shape for t in (qn, qp, ckv, kpe)] + [torch.Size([heads])]
    for copy, grads in ((True, dsa_bwd._backward_impl(*args)),
                        (False, dsa_bwd._backward(*args))):  # fmt: skip
        assert [g.shape for g in grads] == shapes
        assert all(g.is_contiguous() for g in grads) == copy  # eager: views of two buffers
        assert [g.dtype for g in grads] == [torch.bfloat16] * 4 + [torch.float32]
        torch.testing.assert_close(torch.cat(grads[:2], -1), want[0], rtol=0, atol=0)
        torch.testing.assert_close(torch.cat(grads[2:4], -1).flatten(0, 1), want[1], rtol=0,
                                   atol=0)  # fmt: skip


def test_kernel_path_reads_no_index_on_the_host(monkeypatch):
    """The kernel path hands every index, one past the cache's slots included, to the kernels
    (which skip it as -1 padding) without reading any on the host: no sync a call."""
    tokens, heads, pages, page = 3, 16, 2, 8
    qn, out, dout = (torch.randn(tokens, heads, LATENT).bfloat16() for _ in range(3))
    qp = torch.randn(tokens, heads, WIDTH - LATENT).bfloat16()
    ckv = torch.randn(pages, page, LATENT).bfloat16()
    kpe = torch.randn(pages, page, WIDTH - LATENT).bfloat16()
    idx = torch.randint(0, pages * page, (tokens, 4), dtype=torch.int32)
    idx[0, 0] = pages * page  # past the slots
    seen = []

    def kernel(q, kv, dout, out, lse, dlse, sink, indices, scale, pre=None):
        seen.append(indices)
        return torch.zeros_like(q), torch.zeros(kv.shape, dtype=torch.float32), None

    monkeypatch.setattr(launch, "unsupported", lambda *a: None)
    monkeypatch.setattr(dsa_bwd.pre_launch, "unsupported", lambda *a: "stubbed")
    monkeypatch.setattr(launch, "dsa_sparse_bwd", kernel)
    for name in ("max", "tolist", "item", "__int__"):
        monkeypatch.setattr(torch.Tensor, name, lambda *a, **k: pytest.fail("host read"))
    args = (qn, qp, ckv, kpe, idx, 0.05, out, torch.randn(tokens, heads), dout, None, None)
    dq, dkv, _ = dsa_bwd._backward_kernel(*args)
    assert len(seen) == 1 and seen[0] is idx
    assert dq.shape == (tokens, heads, WIDTH) and dkv.dtype == torch.bfloat16


def _emulate_rounded(q, kv, idx, dout, lse2, delta, scale, dtype):
    """kernel.py's rounding: fp32 S / dP, P^T and scale dS^T rounded to `dtype` as the MMAs'
    operands, fp32 accumulation, dq rounded to `dtype`, dkv left fp32 (the accumulator)."""
    slots = kv.shape[0]
    valid = (idx >= 0) & (idx < slots)
    rows = kv.float()[torch.where(valid, idx, 0).long()]
    s = torch.einsum("thd,tkd->thk", q.float(), rows)
    p = torch.exp2(s * scale * math.log2(math.e) - lse2[..., None])
    p = torch.where(valid[:, None, :], p, 0.0)
    dp = torch.einsum("thv,tkv->thk", dout.float(), rows[..., :LATENT])
    ds = (p * (dp - delta[..., None]) * scale).to(dtype).float()
    dq = torch.einsum("thk,tkd->thd", ds, rows).to(dtype)
    d_rows = torch.einsum("thk,thd->tkd", ds, q.float())
    d_rows[..., :LATENT] += torch.einsum("thk,thv->tkv", p.to(dtype).float(), dout.float())
    dkv = torch.zeros(slots, WIDTH)
    dkv.index_add_(0, torch.where(valid, idx, 0).long().flatten(), (d_rows * valid[..., None])
                   .flatten(0, 1))  # fmt: skip
    return dq, dkv


@pytest.mark.parametrize("dtype,heads", [(torch.bfloat16, 16), (torch.float16, 16),
                                         (torch.bfloat16, 64)])  # fmt: skip
def test_kernel_rounding_meets_the_gpu_bounds(dtype, heads):
    """The bounds of tests/gpu/test_dsa_sparse_bwd_kernel_gpu.py hold for the kernel's rounding
    emulated on the CPU (2026-12-03: at most 0.4 of the 2x-low-precision bound, 0.004 of the
    largest entry against 2e-2)."""
    g = torch.Generator().manual_seed(heads)
    tokens, topk, slots, scale = 7, 64, 300, WIDTH**-0.5
    q = torch.randn(tokens, heads, WIDTH, generator=g).to(dtype)
    kv = torch.randn(slots, WIDTH, generator=g).to(dtype)
    idx = torch.randint(0, slots, (tokens, topk), generator=g, dtype=torch.int32)
    idx[3] = -1
    idx[1, 40:] = -1
    dout = torch.randn(tokens, heads, LATENT, generator=g).to(dtype)
    sink, dlse = torch.randn(heads, generator=g), torch.randn(tokens, heads, generator=g)
    out, lse = dsa_sparse_attention_ref(q, kv, idx, scale, attn_sink=sink, dtype=torch.float64)
    out, lse = out.to(dtype), lse.float()
    lse2, delta, _ = launch.preprocess(out, dout, lse, dlse, sink)
    got = _emulate_rounded(q, kv, idx, dout, lse2, delta, scale, dtype)
    kw = {"attn_sink": sink, "out": out, "lse": lse, "dlse": dlse}
    want = dsa_sparse_attention_bwd_ref(q, kv, idx, scale, dout, dtype=torch.float64, **kw)
    low = dsa_sparse_attention_bwd_ref(q, kv, idx, scale, dout, dtype=torch.float32, **kw)
    low_dq = dsa_sparse_attention_bwd_ref(q, kv, idx, scale, dout, dtype=dtype, **kw)[0]
    for a, b, lp in zip(got, want, (low_dq, low[1].to(dtype))):
        top = float(b.abs().max())
        err = float((a.double() - b).abs().max())
        assert err <= 2e-2 * top
        assert err <= 2 * float((lp.double() - b).abs().max()) + 1e-3 * top
