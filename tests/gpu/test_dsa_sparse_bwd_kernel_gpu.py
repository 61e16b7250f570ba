"""The v1 DSA sparse backward kernel (kernels/attention/dsa_sparse_bwd/sm90) on the GPU against
the fp64 reference (reference.dsa `dsa_sparse_attention_bwd_ref`, given the fp64 forward's out
rounded to the input dtype and its fp32 LSE, as the op saves them): awkward token counts (1, 7,
130), 16 / 64 / 128 heads (blocks of 16 and 32), top-k 64 and 2048 with -1 padding at the end
and scattered, a row with no valid entry and entries past the cache (both add nothing), with and
without a sink and a loss on the LSE, bf16 (fp16 on the 7-token 16 / 64-head cases). dq is
NaN-poisoned before the launch (the kernel must write every element; rows without entries 0);
dkv is the kernel's fp32 accumulator (zeroed by the launcher by contract).

Tolerance: each gradient within 2e-2 of its reference's largest entry (the op's GPU tests'
bound: 16-bit P / dS operands, fp32 accumulation), and at most 2x the error of the same
reference run in the input dtype plus 1e-3 of the largest entry (FlashAttention's criterion).
v1 (kernel.py, launcher h64=False: at H 64 / 128 the default before 2026-12-06 and the bench
variant `was`): its standard build is xchg4s (S^T in one warpgroup, dP^T in the other; dkv by
red.global.add.v4.f32 from a staging in the tile's released stage) at both blocks; on every bf16
case also the candidate red4s (S^T / dP^T split over the heads: the standard form before
2026-12-04 04:23) and the fragments' red.global.add.v2 alone (the builds' test ids:
standard-bf16, standard-fp16, red4s, v2; e.g. `-k red4s`). The h64 kernels on their own cases
(`-k h64`): H 64 / 128 / 192 / 256, top-k 20, 64, 100, 1000 and 2048 (not multiples of 64 among
them), the suite's shapes cut to 64 / 32 tokens (the bench verifies the whole ones), bf16 and
fp16: the fused kernel (kernel_h64f.py, the launcher's default at H a multiple of 64; `-k h64f`,
also with dq one element off 16-byte alignment: the launcher's aligned copy, and in launches of
row slices past its grid's token limit, lowered); the sweep (`-k sweep`: the index rows sorted,
one wave a launch, the default over caches larger than the L2; v1 and the fused kernel); the
two-kernel form (kernel_h64.py's kv and dq parts, h64_fused=False) in one chunk (a poisoned
workspace of every token), in chunks of a smaller poisoned h64_ws and in chunks by a lowered
workspace cap (`-k h64_chunked`); the launcher's and the op's defaults at H 64 / 128 (`-k
h64_default`). Then the op with FORGEKERNEL_DSA_BWD_KERNEL=1 against its interim path."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import config, launch
from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref, dsa_sparse_attention_ref

pytestmark = pytest.mark.gpu
WIDTH, LATENT = 576, 512
SCALE = WIDTH**-0.5


def _problem(tokens, heads, topk, slots, dtype, *, sink, dlse, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    rnd = {"device": "cuda", "generator": g}
    q = torch.randn(tokens, heads, WIDTH, **rnd).to(dtype)
    kv = torch.randn(slots, WIDTH, **rnd).to(dtype)
    idx = torch.full((tokens, topk), -1, dtype=torch.int32, device="cuda")
    for t in range(tokens):
        n = 0 if t == tokens // 2 and tokens > 1 else int(torch.randint(1, topk + 1, (1,), **rnd))
        pos = torch.randperm(topk, **rnd)[:n] if t % 2 else torch.arange(n, device="cuda")
        idx[t, pos] = torch.randint(0, slots, (n,), **rnd).int()  # duplicates allowed
    if tokens > 2:  # an entry past the cache: not a row (the op's eager check rejects it)
        idx[2, 0] = slots + 5
    dout = torch.randn(tokens, heads, LATENT, **rnd).to(dtype)
    s = torch.randn(heads, **rnd) if sink else None
    d = torch.randn(tokens, heads, **rnd) if dlse else None
    return q, kv, idx, dout, s, d


def _forward(q, kv, idx, sink, dtype):
    # the reference masks past-the-cache entries only when it checks the range: clamp them to -1
    clean = torch.where(idx < kv.shape[0], idx, -1)
    out, lse = dsa_sparse_attention_ref(q, kv, clean, SCALE, attn_sink=sink, dtype=torch.float64)
    return clean, out.to(dtype), lse.float()


def _err(a, b) -> float:
    return float((a.double() - b.double()).abs().max())


CASES = [  # tokens, heads, topk, slots, sink, dlse
    (1, 16, 64, 100, False, False),
    (7, 16, 64, 300, True, True),
    (130, 16, 64, 1000, True, False),
    (7, 16, 2048, 5000, False, True),
    (7, 64, 64, 500, True, True),
    (130, 64, 2048, 4000, False, False),
    (1, 128, 2048, 3000, True, False),
    (7, 128, 64, 200, False, True),
]


BUILDS = [  # dtype, xchg, red4s of v1 (None: the standard form: xchg4s, xchg with red4s)
    pytest.param(torch.bfloat16, None, None, id="standard-bf16"),
    pytest.param(torch.float16, None, None, id="standard-fp16"),
    pytest.param(torch.bfloat16, False, None, id="red4s"),
    pytest.param(torch.bfloat16, False, False, id="v2"),
]


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse", CASES)
@pytest.mark.parametrize("dtype,xchg,red4s", BUILDS)
def test_kernel_matches_fp64(dtype, xchg, red4s, tokens, heads, topk, slots, sink, dlse):
    if dtype is torch.float16 and (tokens, heads) not in ((7, 16), (7, 64)):
        pytest.skip("fp16 on the 7-token 16 / 64-head cases")
    _check(dtype, tokens, heads, topk, slots, sink, dlse, h64=False, xchg=xchg, red4s=red4s)


H64_CASES = [  # tokens, heads, topk, slots, sink, dlse
    (1, 64, 64, 100, False, False),
    (7, 64, 100, 500, True, True),
    (130, 64, 2048, 4000, False, False),
    (7, 128, 64, 200, False, True),
    (1, 128, 2048, 3000, True, False),
    (5, 128, 1000, 3000, True, True),
    (64, 64, 2048, 16384, True, False),  # the suite's t4096-h64-kv16384-k2048, 64 tokens
    (32, 64, 512, 65536, True, False),  # t16384-h64-kv65536-k512
    (64, 128, 2048, 8192, True, False),  # t4096-h128-kv8192-k2048
    (3, 256, 100, 500, True, True),  # the dq part's second 128-head block (grid.y >= 3)
    (3, 192, 130, 500, False, True),  # the dq part at 64 heads, three head blocks
    (3, 64, 20, 100, True, False),  # topk < 64: one partial tile
]


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse", H64_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["h64f-bf16", "h64f-fp16"])
def test_h64f_matches_fp64(dtype, tokens, heads, topk, slots, sink, dlse):
    """The fused kernel (h64=True, the default form): dq NaN-poisoned (`_check`), every
    element written; one launch whatever the token count (no workspace)."""
    if dtype is torch.float16 and tokens > 7:
        pytest.skip("fp16 on the small cases")
    _check(dtype, tokens, heads, topk, slots, sink, dlse, h64=True, h64_fused=True)


@pytest.mark.parametrize(
    "tokens,heads,topk,slots,sink,dlse",
    [(7, 64, 100, 500, True, True), (3, 128, 64, 200, False, False)],
)
def test_h64f_unaligned_dq_matches_fp64(tokens, heads, topk, slots, sink, dlse):
    """dq one element off 16-byte alignment: the launcher runs the fused kernel on an aligned
    buffer and copies it in."""
    _check(torch.bfloat16, tokens, heads, topk, slots, sink, dlse, dq_offset=1)


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse,step,dq_offset", [
    (7, 128, 100, 500, True, True, 3, 0),
    (130, 64, 2048, 4000, False, False, 48, 1),
    (5, 192, 130, 500, False, True, 1, 0),
])  # fmt: skip
def test_h64f_row_slices_matches_fp64(monkeypatch, tokens, heads, topk, slots, sink, dlse, step,
                                      dq_offset):  # fmt: skip
    """Past the fused kernel's grid.y limit (config.H64F_GRID_TOKENS, lowered here to `step`)
    the launcher runs it on row slices of the per-token tensors (and of its aligned dq copy when
    dq is off 16 bytes), one dkv accumulator: `-k h64f`."""
    monkeypatch.setattr(config, "H64F_GRID_TOKENS", step)
    _check(torch.bfloat16, tokens, heads, topk, slots, sink, dlse, dq_offset=dq_offset)


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse,sweep", [
    (300, 64, 2048, 4000, True, True, True),  # the fused kernel: 3 waves of 132 tokens (H100)
    (140, 128, 1000, 3000, False, False, True),  # 3 waves of 66
    (7, 192, 130, 500, True, True, True),  # one wave of 44, rows with -1 and past the cache
    (140, 128, 2048, 40000, True, False, None),  # the default sweeps: 40000 slots, 2.6x the L2
    (140, 128, 2048, 40000, True, False, False),
    (300, 16, 2048, 4000, True, True, True),  # v1: 3 waves of 132
    (7, 32, 100, 500, False, True, True),
    (140, 16, 2048, 40000, True, False, None),
])  # fmt: skip
def test_sweep_matches_fp64(tokens, heads, topk, slots, sink, dlse, sweep):
    """The sweep (the index rows sorted by slot, launches of one wave; the default over the L2
    with a row visited >= SWEEP_MIN_VISITS times a wave) and its absence, the fused kernel at H a
    multiple of 64, v1 at H 16 / 32: `-k sweep`."""
    if sweep is None:
        ctas = launch.ctas_per_token(heads)
        assert launch.sweeps_by_default(slots, topk, ctas, torch.cuda.current_device())
    _check(torch.bfloat16, tokens, heads, topk, slots, sink, dlse, sweep=sweep)


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse", H64_CASES)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["h64-bf16", "h64-fp16"])
def test_h64_matches_fp64(dtype, tokens, heads, topk, slots, sink, dlse):
    """The two-kernel form (h64_ws names it)."""
    if dtype is torch.float16 and tokens > 7:
        pytest.skip("fp16 on the small cases")
    # the dS workspace poisoned: a cell the kv part leaves unwritten turns dq non-finite
    rows = config.h64_workspace_rows(topk)
    ws = torch.full((tokens, rows, heads), float("nan"), dtype=dtype, device="cuda")
    _check(dtype, tokens, heads, topk, slots, sink, dlse, h64=True, h64_ws=ws)


H64_CHUNKED = [  # tokens, heads, topk, slots, sink, dlse, chunk
    (7, 64, 100, 500, True, True, 3),
    (130, 64, 2048, 4000, False, False, 48),
    (7, 128, 64, 200, False, True, 2),
    (64, 128, 2048, 8192, True, False, 20),  # t4096-h128-kv8192-k2048 cut: chunks of 20, 4 left
    (5, 192, 130, 500, True, True, 1),
]


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse,chunk", H64_CHUNKED)
@pytest.mark.parametrize("by", ["ws", "cap"], ids=["h64_chunked-ws", "h64_chunked-cap"])
def test_h64_chunked_matches_fp64(monkeypatch, by, tokens, heads, topk, slots, sink, dlse, chunk):
    """The two-kernel h64 form in chunks of `chunk` tokens: by a NaN-poisoned h64_ws of `chunk`
    tokens (the first chunk's cells the kv part leaves unwritten turn dq non-finite), or by the
    workspace cap lowered to `chunk` tokens' workspace (a fresh one): row slices of the
    per-token tensors launched kv then dq a chunk, dkv summed over the chunks."""
    rows = config.h64_workspace_rows(topk)
    forms = {}
    if by == "ws":
        forms["h64_ws"] = torch.full((chunk, rows, heads), float("nan"), dtype=torch.bfloat16,
                                     device="cuda")  # fmt: skip
    else:
        monkeypatch.setattr(config, "H64_WS_CAP_BYTES", chunk * rows * heads * 2)
        forms["h64_fused"] = False
    _check(torch.bfloat16, tokens, heads, topk, slots, sink, dlse, **forms)


@pytest.mark.parametrize("tokens,heads,topk,slots,sink,dlse", [
    (7, 64, 100, 500, True, True),
    (64, 128, 2048, 8192, True, False),
])  # fmt: skip
def test_h64_default_matches_fp64(monkeypatch, tokens, heads, topk, slots, sink, dlse):
    """The launcher's default (no form named) takes the fused h64 kernel at H 64 / 128 and
    matches the fp64 reference; so does the op's explicit backward (its preprocess kernel, the
    fused kernel, the dkv cast)."""
    from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward

    ran = []
    get = launch.get_kernel
    monkeypatch.setattr(launch, "get_kernel", lambda spec, p: ran.append(dict(p)["h64"])
                        or get(spec, p))  # fmt: skip
    _check(torch.bfloat16, tokens, heads, topk, slots, sink, dlse)
    assert ran == ["fused"]
    q, kv, idx, dout, s, d = _problem(tokens, heads, topk, slots, torch.bfloat16, sink=sink,
                                      dlse=dlse, seed=tokens * heads + topk)  # fmt: skip
    clean, out, lse = _forward(q, kv, idx, s, torch.bfloat16)
    grads = dsa_sparse_attention_backward(
        q[..., :LATENT], q[..., LATENT:], kv.view(-1, 1, 1, WIDTH), None, clean, dout,
        softmax_scale=SCALE, out=out, lse=lse, attn_sink=s, dlse=d,
    )  # fmt: skip
    torch.cuda.synchronize()
    assert ran == ["fused", "fused"]
    assert (grads[4] is None) == (s is None)
    got = (torch.cat(grads[:2], -1), grads[2].view(-1, WIDTH), grads[4])
    _compare(got, q, kv, clean, dout, out, lse, s, d)


def _check(dtype, tokens, heads, topk, slots, sink, dlse, dq_offset=0, **forms):
    q, kv, idx, dout, s, d = _problem(tokens, heads, topk, slots, dtype, sink=sink, dlse=dlse,
                                      seed=tokens * heads + topk)  # fmt: skip
    clean, out, lse = _forward(q, kv, idx, s, dtype)
    assert launch.unsupported(q, kv, idx) is None
    flat = torch.full((q.numel() + dq_offset,), float("nan"), dtype=dtype, device="cuda")
    dq = flat[dq_offset:].view(q.shape)
    dq, dkv, d_sink = launch.dsa_sparse_bwd(q, kv, dout, out, lse, d, s, idx, SCALE, dq=dq,
                                            **forms)  # fmt: skip
    torch.cuda.synchronize()
    _compare((dq, dkv, d_sink if s is not None else None), q, kv, clean, dout, out, lse, s, d)


def _compare(got, q, kv, clean, dout, out, lse, s, d):
    """(dq, dkv, d_sink or None) against the fp64 reference: each within 2e-2 of its largest
    entry and 2x the error of the reference in q's dtype (dq) / fp32 rounded to q's dtype (dkv,
    d_sink) plus 1e-3 of it; finite (no poison left); rows without entries 0 in dq, slots no
    entry lists 0 in dkv."""
    dtype, slots = q.dtype, kv.shape[0]
    kw = {"attn_sink": s, "out": out, "lse": lse, "dlse": d}
    want = dsa_sparse_attention_bwd_ref(q, kv, clean, SCALE, dout, dtype=torch.float64, **kw)
    low = dsa_sparse_attention_bwd_ref(q, kv, clean, SCALE, dout, dtype=torch.float32, **kw)
    low_dq = dsa_sparse_attention_bwd_ref(q, kv, clean, SCALE, dout, dtype=dtype, **kw)[0]
    lows = (low_dq, low[1].to(dtype), low[2])
    for name, a, b, lp in zip(("dq", "dkv", "d_sink"), got, want, lows):
        if b is None:
            continue
        assert torch.isfinite(a).all(), f"{name}: non-finite (poison left?)"
        top = float(b.abs().max()) + 1e-6
        err = _err(a, b)
        assert err <= 2e-2 * top, f"{name}: {err:.3g} vs largest {top:.3g}"
        assert err <= 2 * _err(lp, b) + 1e-3 * top, f"{name}: {err:.3g}, low {_err(lp, b):.3g}"
    dq, dkv = got[0], got[1]
    empty = (clean < 0).all(1)
    assert (dq[empty] == 0).all()
    assert (dkv[~torch.isin(torch.arange(slots, device="cuda"), clean)] == 0).all()


def test_op_switch_matches_interim(monkeypatch):
    """forgekernel's explicit backward with the kernel selected against its interim path; an
    entry past the cache's slots: the kernel path skips it as -1 padding (no host read), the
    interim path raises."""
    from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward

    q, kv, idx, dout, s, d = _problem(7, 16, 64, 256, torch.bfloat16, sink=True, dlse=True,
                                      seed=11)  # fmt: skip
    idx = torch.where(idx < kv.shape[0], idx, -1)
    _, out, lse = _forward(q, kv, idx, s, torch.bfloat16)
    cache = kv.view(-1, 64, 1, WIDTH)
    args = (q[..., :LATENT], q[..., LATENT:], cache, None, idx, dout)
    kw = {"softmax_scale": SCALE, "out": out, "lse": lse, "attn_sink": s, "dlse": d}
    monkeypatch.setenv("FORGEKERNEL_DSA_BWD_KERNEL", "0")
    interim = dsa_sparse_attention_backward(*args, **kw)
    monkeypatch.setenv("FORGEKERNEL_DSA_BWD_KERNEL", "1")
    kernel = dsa_sparse_attention_backward(*args, **kw)
    for a, b in zip(kernel, interim):
        if b is None:
            assert a is None
            continue
        assert a.shape == b.shape and a.dtype == b.dtype
        assert _err(a, b) <= 2e-2 * float(b.abs().max()) + 1e-5
    bad, padded = idx.clone(), idx.clone()
    bad[0, 0], padded[0, 0] = kv.shape[0], -1
    skipped = dsa_sparse_attention_backward(*args[:4], bad, dout, **kw)
    want = dsa_sparse_attention_backward(*args[:4], padded, dout, **kw)
    for a, b in zip(skipped, want):
        if b is not None:  # dkv by fp32 atomics: equal up to the summation order
            assert _err(a, b) <= 1e-3 * float(b.abs().max()) + 1e-5
    monkeypatch.setenv("FORGEKERNEL_DSA_BWD_KERNEL", "0")
    with pytest.raises(ValueError, match="an entry is >="):
        dsa_sparse_attention_backward(*args[:4], bad, dout, **kw)
