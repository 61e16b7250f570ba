"""The fused DSA prefill (`forgekernel.dsa_fused_prefill`, issue 22) on the CPU (the GPU's
checks: tests/gpu/test_dsa_fused_prefill_gpu.py): its compile keys; the fused pass replayed in
Python through the real launcher and op (q_pe rotated in fp32 and rounded to q's dtype, the
sparse pass's one split as tests/test_dsa_sparse.py replays it, then decode.py's fused
epilogue on fragment-ordered registers: the sink weight, the conjugate RoPE on warpgroup 1's
last 16 registers of a row, each group's amax over a thread's 8 registers and its quad, the
UE8M0 scale and its inverse by their bits, the e4m3 cast) against `dsa_fused_prefill_ref`;
the epilogue's bit-level arithmetic against `quantize_fp8_groups` over values on and around
every scale boundary; argument errors; the custom op's fake under make_fx."""

from __future__ import annotations

import importlib
import math
import os

import pytest
import torch
from test_dsa_sparse import _sparse_partial
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import (
    FUSED_HEADS,
    heads_per_cta,
    params_for,
)
from forgekernel.reference.dsa import (
    apply_rope,
    dequantize_fp8_groups,
    dsa_fused_prefill_ref,
    quantize_fp8_groups,
    rope_cos_sin,
)

op = importlib.import_module("forgekernel.ops.dsa_fused")
SCALE = 0.1352
LATENT, ROPE, WIDTH = 512, 64, 576
E4M3 = torch.float8_e4m3fn


# ---------------------------------------------------------------- compile keys


def test_fused_compile_keys():
    """Keyed only when on (`sink`, `fused` with the cache's and the positions' dtypes, `neox`),
    forms of the sparse direct pass only; prebuilt: 16 / 64 heads a CTA, both dtypes, with and
    without a sink, an fp32 cache, int32 and int64 positions."""
    key = dict(params_for("sparse", "bfloat16", 16, direct=True, sink=True, fused=True,
                          rope="float32", positions="int64"))  # fmt: skip
    assert key == {"kind": "sparse", "dtype": "bfloat16", "heads": 16, "direct": True,
                   "sink": True, "fused": True, "rope": "float32",
                   "positions": "int64"}  # fmt: skip
    assert "neox" in dict(params_for("sparse", "float16", 64, direct=True, fused=True,
                                     rope="float16", positions="int32", neox=True))  # fmt: skip
    for bad, match in [
        ({"fused": True, "rope": "float32", "positions": "int32"}, "sparse direct"),
        ({"direct": True, "fused": True}, "rope and positions"),
        ({"direct": True, "fused": True, "rope": "float16", "positions": "int32"}, "rope"),
        ({"direct": True, "fused": True, "rope": "float32", "positions": "int16"}, "positions"),
        ({"direct": True, "neox": True}, "neox"),
    ]:  # fmt: skip
        with pytest.raises(ValueError, match=match):
            params_for("sparse", "bfloat16", 16, **bad)
    # over FlashMLA's FP8 cache: `fp8` beside `fused`, bf16 q only; the 16-bit keys unchanged
    key8 = dict(params_for("sparse", "bfloat16", 16, fp8=True, direct=True, fused=True,
                           rope="float32", positions="int32"))  # fmt: skip
    assert key8 == {"kind": "sparse", "dtype": "bfloat16", "heads": 16, "fp8": True,
                    "direct": True, "fused": True, "rope": "float32",
                    "positions": "int32"}  # fmt: skip
    with pytest.raises(ValueError, match="bfloat16 queries"):
        params_for("sparse", "float16", 16, fp8=True, direct=True, fused=True, rope="float32",
                   positions="int32")  # fmt: skip
    fused = {p for p in SPEC.standard_params() if dict(p).get("fused")}
    assert fused == {
        params_for("sparse", d, h, direct=True, sink=s, fused=True, rope="float32", positions=p)
        for d in ("float16", "bfloat16") for h in FUSED_HEADS for s in (False, True)
        for p in ("int32", "int64")
    } | {
        params_for("sparse", "bfloat16", h, fp8=True, direct=True, sink=s, fused=True,
                   rope="float32", positions=p)
        for h in FUSED_HEADS for s in (False, True) for p in ("int32", "int64")
    }  # fmt: skip
    assert {heads_per_cta(h) for h in (16, 64, 128)} == set(FUSED_HEADS)


# ---------------------------------------------------------------- the epilogue, replayed


def _fragments(row: torch.Tensor) -> torch.Tensor:
    """A row's 512 fp32 values as decode.py's registers: (warpgroup, quad lane l % 4, c) with
    c = 2 j + e holding column 256 wg + 8 j + 2 (l % 4) + e (`_write_fused`'s docstring)."""
    return row.view(2, 32, 4, 2).permute(0, 2, 1, 3).reshape(2, 4, 64)


def _unfragment(regs: torch.Tensor) -> torch.Tensor:
    return regs.view(2, 4, 32, 2).permute(0, 2, 1, 3).reshape(512)


def ue8m0_scale(amax: torch.Tensor) -> torch.Tensor:
    """fused.py's `ue8m0_scale`: max(amax, 1e-4) / 448 (fp32), its bits rounded up to the
    exponent."""
    s = torch.clamp(amax.float(), min=1e-4) / 448.0
    bits = (s.view(torch.int32) + 0x7FFFFF) & 0x7F800000
    return bits.view(torch.float32)


def pow2_inverse(scale: torch.Tensor) -> torch.Tensor:
    return (0x7F000000 - scale.view(torch.int32)).view(torch.float32)


def fused_epilogue(o: torch.Tensor, lse_log2: torch.Tensor, sink, cos, sin, neox: bool):
    """decode.py `_write_fused` on fp32 O / sum (tokens, H, 512), the log2 LSE (tokens, H),
    the sink (H,) or None, the token's cos / sin (tokens, 32): (e4m3 (tokens, H, 512), scales
    (tokens, H, 16)), each row through its registers as the kernel holds them."""
    tokens, hq, _ = o.shape
    out = torch.empty(tokens, hq, LATENT, dtype=E4M3)
    scales = torch.empty(tokens, hq, LATENT // 32)
    for t in range(tokens):
        for h in range(hq):
            w = 1.0
            if sink is not None and lse_log2[t, h] > -math.inf:
                w = torch.sigmoid(lse_log2[t, h].double() * math.log(2) - float(sink[h])).float()
            v = _fragments(o[t, h].float() * w)  # (wg, lane, c)
            x = v[1, :, 48:].clone()  # warpgroup 1's columns 448 ..: registers c >= 48
            if neox:  # pairs (c, c + 8): columns i, i + 32 of the RoPE block
                x0, x1 = x[:, :8], x[:, 8:]
                i = torch.tensor([[(_col(1, lq, 48 + k) - 448) for k in range(8)]
                                  for lq in range(4)])  # fmt: skip
            else:  # pairs (c, c + 1)
                x0, x1 = x[:, 0::2], x[:, 1::2]
                i = torch.tensor([[(_col(1, lq, 48 + 2 * k) - 448) // 2 for k in range(8)]
                                  for lq in range(4)])  # fmt: skip
            c, s = cos[t][i].float(), sin[t][i].float()
            y0, y1 = x0 * c + x1 * s, x1 * c - x0 * s
            if neox:
                v[1, :, 48:56], v[1, :, 56:64] = y0, y1
            else:
                v[1, :, 48::2], v[1, :, 49::2] = y0, y1
            amax = v.abs().view(2, 4, 8, 8).amax(-1).amax(1)  # (wg, group): thread, then quad
            scale = ue8m0_scale(amax)
            q = v.view(2, 4, 8, 8) * pow2_inverse(scale)[:, None, :, None]
            out[t, h] = _unfragment(q.clamp(-448, 448).reshape(2, 4, 64)).to(E4M3)
            scales[t, h] = scale.reshape(16)
    return out, scales


def _col(wg: int, lane: int, c: int) -> int:
    return 256 * wg + 8 * (c // 2) + 2 * lane + c % 2


def test_fragment_order_is_the_column_order():
    """`_fragments` inverts `_col`: a row's registers, thread by thread, are its columns."""
    row = torch.arange(512.0)
    regs = _fragments(row)
    for wg in range(2):
        for lane in range(4):
            assert [int(x) for x in regs[wg, lane]] == [_col(wg, lane, c) for c in range(64)]
    assert torch.equal(_unfragment(regs), row)
    groups = {(_col(wg, lane, c) // 32) for wg in (1,) for lane in range(4) for c in range(8)}
    assert groups == {8}  # registers 0 .. 7 of a warpgroup's quad: one 32-column group


def test_scale_and_cast_bit_for_bit():
    """The kernel's scale (bits) and cast (x scale's exact inverse, saturated RNE) against
    `quantize_fp8_groups` over amaxes on, just below and just above every power-of-two scale
    boundary (2^k x 448), the floor 1e-4, zeros, values past 448 x scale and ties."""
    amax = [0.0, 1e-4, 9.999e-5, 1.0001e-4]
    for k in range(-20, 20):
        edge = 448.0 * 2.0**k
        amax += [edge, math.nextafter(edge, 0), math.nextafter(edge, math.inf)]
    g = torch.Generator().manual_seed(0)
    rows = torch.rand(len(amax), 32, generator=g) * 2 - 1
    rows = rows * torch.tensor(amax)[:, None]
    rows[:, 0] = torch.tensor(amax)  # the amax itself, exactly
    rows[::3, 5] = rows[::3, 0] / 448 * 1.0625  # an e4m3 tie (1 + 1/16 between 1 and 1 + 1/8)
    want, want_scale = quantize_fp8_groups(rows)
    scale = ue8m0_scale(rows.abs().amax(-1))
    got = (rows * pow2_inverse(scale)[:, None]).clamp(-448, 448).to(E4M3)
    assert torch.equal(scale, want_scale.view(-1))
    assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))


def test_replay_is_the_kernels_epilogue():
    """`fused_epilogue` replays decode.py's `_write_fused` as written: O x 1 / sum x the sink
    weight, warpgroup 1's registers from cols - 16 the RoPE columns (pairs (c, c + 1), NeoX
    (c, c + 8)), per group 8 registers' amax then the quad's, the scale's helpers, the pair
    cast of (v[c], v[c + 1]) x the inverse, the scale at column // 32."""
    import inspect

    from forgekernel.kernels.attention.mla.sm90 import decode

    src = inspect.getsource(decode.MlaDecodeSm90._write_fused)
    for line in (
        "first_rope = cols - D_ROPE // 4",
        "inv = inv * fused_math.sink_weight(lse, mSink[head])",
        "v[c] = o[r, c] * inv",
        "c1 = c0 + 8",
        "v[c0] = x0 * cs[k] + x1 * sn[k]",
        "v[c1] = x1 * cs[k] - x0 * sn[k]",
        "amax = cute.arch.fmax(amax, cute.math.absf(v[8 * g + k]))",
        "amax = cute.arch.warp_reduction_max(amax, threads_in_group=4)",
        "scale = fused_math.ue8m0_scale(amax)",
        "mult = fused_math.pow2_inverse(scale)",
        "word = fused_math.e4m3x2(v[c] * mult, v[c + 1] * mult)",
        "group = o_crd[r, 8 * g][1] // fused_math.FP8_GROUP",
    ):
        assert line in src, line
    rope = inspect.getsource(decode.MlaDecodeSm90._rope_query)
    assert "(x0 * cs - x1 * sn).to(sQr.element_type)" in rope
    assert "(x0 * sn + x1 * cs).to(sQr.element_type)" in rope


# ---------------------------------------------------------------- the op, replayed


def row_scales(latent: torch.Tensor) -> torch.Tensor:
    """fp8.py `row_scales` in torch: the FP8 rows' fp32 scales (P, ps, 4) from their uint8
    latent view alone, bytes 512 .. 527 of the same rows (its strides, 512 bytes further)."""
    assert latent.dtype == torch.uint8 and latent.shape[-1] == LATENT
    raw = torch.as_strided(latent, (*latent.shape[:2], 16), latent.stride(),
                           latent.storage_offset() + LATENT)  # fmt: skip
    return raw.view(torch.float32)


def _fused_pass(args, p):
    """The fused pass's slots (decode.py `__call__`): q, cos_sin, ckv, kpe, out_scale, idx,
    sink, out (uint8), lse, scale_log2, per, page_size, positions, causal, q_blocks; an `fp8`
    key's ckv / kpe the FP8 rows' uint8 latent / bf16 RoPE views, the scales read through the
    latent's rows (`row_scales`) as the pass views them."""
    q, cs, ckv, kpe, osc, idx, sink, out_u8, lse, scale_log2, per, page_size, pos, causal, qb = args
    fp8 = p.get("fp8", False)
    assert (ckv.dtype == torch.uint8) == fp8 and (not fp8 or kpe.dtype == q.dtype)
    assert q.shape[-1] == WIDTH and q.dtype == getattr(torch, p["dtype"])
    assert cs.dtype == getattr(torch, p["rope"]) and pos.dtype == getattr(torch, p["positions"])
    assert (sink is not None) == p.get("sink", False) and out_u8.dtype == torch.uint8
    assert per == idx.shape[1] and causal == 0 and qb == 1 and osc.shape[-1] == 16
    cos, sin = rope_cos_sin(cs, pos)
    qp = apply_rope(q[..., LATENT:], cos, sin, interleaved=not p.get("neox", False)).to(q.dtype)
    tokens, hq, _ = q.shape
    o = torch.empty(1, tokens, hq, LATENT)
    lp = torch.empty(1, tokens, hq)
    _sparse_partial(q[..., :LATENT], qp, ckv, kpe, row_scales(ckv) if fp8 else None, idx,
                    None, o, lp, scale_log2, per, page_size, None, 0, 1)  # fmt: skip
    e4m3, scales = fused_epilogue(o[0], lp[0], sink, cos, sin, p.get("neox", False))
    out_u8.copy_(e4m3.view(torch.uint8))
    osc.copy_(scales)
    lse.copy_(lp[0] * math.log(2))


@pytest.fixture
def fused_kernels(monkeypatch):
    """The launcher's fused pass replaced by the replay; its calls' params."""
    calls = []

    def get_kernel(spec, params):
        assert spec is SPEC
        p = dict(params)
        assert p["kind"] == "sparse" and p["direct"] and p["fused"]

        def kernel(*args):
            assert len(args) == 15
            calls.append(p)
            _fused_pass(args, p)

        return kernel

    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    yield calls
    mla_launch._plans.clear()


def _problem(tokens, hq, slots, valid, topk, *, dtype=torch.bfloat16, rope=torch.float32,
             positions=torch.int64, sinks="finite", paged=None, seed=0):  # fmt: skip
    """q (S, H, 576), kv (slots, 576) (paged: (slots / paged, paged, 1, 576)), indices with
    valid[t] distinct slots scattered among -1s, a [cos | sin] cache of 300 positions, the
    positions, the sink (None, finite, or with -inf / +inf heads)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(tokens, hq, WIDTH, generator=g).to(dtype)
    kv = torch.randn(slots, WIDTH, generator=g).to(dtype)
    if paged:
        kv = kv.view(slots // paged, paged, 1, WIDTH)
    idx = torch.full((tokens, topk), -1, dtype=torch.int32)
    for t, n in enumerate(valid):
        where = torch.randperm(topk, generator=g)[:n]
        idx[t, where] = torch.randperm(slots, generator=g)[:n].int()
    angle = torch.arange(300)[:, None] * 10000.0 ** (-torch.arange(32) / 32)
    cache = torch.cat([angle.cos(), angle.sin()], -1).to(rope)
    pos = torch.randint(0, 300, (tokens,), generator=g).to(positions)
    sink = None
    if sinks != "none":
        sink = torch.randn(hq, generator=g)
        if sinks == "inf":
            sink[0], sink[-1] = -math.inf, math.inf
    return q, kv, idx, cache, pos, sink


def e4m3_step(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The e4m3 spacing (x scale) at |x| / scale: 2^(e - 3) in the binade [2^e, 2^(e + 1)),
    2^-9 among the subnormals (e < -6)."""
    mag = (x.abs() / scale).clamp(min=2.0**-6)
    return torch.exp2(torch.floor(torch.log2(mag)) - 3) * scale


def _check(got, want, valid):
    """out dequantized within one e4m3 step (at the reference's value, its own scale) plus the
    attention's atol (2e-2: P rounded to q's dtype in the pass, not in the fp32 reference) of
    the reference's fp32 out: ours rounds a value that differs from the reference's by the
    attention's error, so it may round to the neighbouring e4m3 value (half a step of rounding
    plus a straddled boundary); scales equal but where the group's amax sits on a power-of-two
    boundary (then one power of two apart, at most 1% of them), the LSE within 1e-4."""
    out, scale, lse = got
    assert out.dtype == E4M3 and scale.dtype == lse.dtype == torch.float32
    ref = want.out
    deq = dequantize_fp8_groups(out, scale)
    step = e4m3_step(ref, scale.repeat_interleave(32, -1))
    err = (deq - ref).abs()
    assert bool((err <= step + 2e-2).all()), float((err - step).max())
    ratio = scale / want.out_scale
    assert bool(((ratio == 1) | (ratio == 2) | (ratio == 0.5)).all())
    assert float((ratio != 1).float().mean()) < 0.01
    finite = torch.isfinite(want.lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float(torch.where(finite, lse - want.lse, 0.0).abs().max()) < 1e-4
    empty = torch.tensor([n == 0 for n in valid])
    assert torch.all(out[empty].float() == 0)  # (+-0: the RoPE of zeros keeps signs)
    assert torch.all(scale[empty] == 2.0**-22) and torch.all(torch.isneginf(lse[empty]))


FUSED_CASES = [
    # (tokens, hq, slots, valid, topk, dtype, rope, positions, sinks, interleaved, paged)
    (5, 16, 300, [64, 0, 17, 1, 64], 64, torch.bfloat16, torch.float32, torch.int64, "finite",
     True, None),
    (3, 24, 200, [100, 0, 7], 100, torch.float16, torch.float16, torch.int32, "inf", True, None),
    (2, 7, 130, [70, 3], 70, torch.bfloat16, torch.bfloat16, torch.int64, "none", False, None),
    (4, 64, 256, [129, 2, 0, 200], 200, torch.bfloat16, torch.float32, torch.int32, "finite",
     True, 64),
    (1, 128, 128, [1], 65, torch.float16, torch.float32, torch.int64, "none", True, 16),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "hq", "slots", "valid", "topk", "dtype", "rope", "positions", "sinks",
     "interleaved", "paged"), FUSED_CASES,
)  # fmt: skip
def test_fused_prefill_matches_the_reference(fused_kernels, tokens, hq, slots, valid, topk,
                                             dtype, rope, positions, sinks, interleaved,
                                             paged):  # fmt: skip
    q, kv, idx, cache, pos, sink = _problem(tokens, hq, slots, valid, topk, dtype=dtype,
                                            rope=rope, positions=positions, sinks=sinks,
                                            paged=paged)  # fmt: skip
    got = forgekernel.dsa_fused_prefill(q, kv, idx, SCALE, cache, pos, attn_sink=sink,
                                        interleaved=interleaved, return_lse=True)  # fmt: skip
    flat = kv.view(-1, WIDTH)
    want = dsa_fused_prefill_ref(q, flat, idx, SCALE, cache, pos, attn_sink=sink,
                                 interleaved=interleaved)  # fmt: skip
    _check(got, want, valid)
    (p,) = fused_kernels
    assert p["heads"] == heads_per_cta(hq) and p.get("sink", False) == (sink is not None)
    assert p.get("neox", False) == (not interleaved)
    if sinks == "inf":
        assert torch.all(got[0][:, -1].float() == 0)  # +inf sink: out 0


def test_out_and_out_scale_in_place(fused_kernels):
    q, kv, idx, cache, pos, sink = _problem(3, 16, 100, [5, 64, 0], 64)
    out = torch.full((3, 16, LATENT), float("nan")).to(E4M3)
    scale = torch.full((3, 16, 16), float("nan"))
    o, s = forgekernel.dsa_fused_prefill(q, kv, idx, SCALE, cache, pos, attn_sink=sink,
                                         out=out, out_scale=scale)  # fmt: skip
    assert o is out and s is scale and not torch.isnan(scale).any()
    want = dsa_fused_prefill_ref(q, kv, idx, SCALE, cache, pos, attn_sink=sink)
    _check((o, s, want.lse), want, [5, 64, 0])


def test_no_entries_or_no_tokens(fused_kernels):
    """topk 0: every row 0 with the floor's scale (2^-22) and LSE -inf, no launch; no tokens:
    empty outputs."""
    q, kv, idx, cache, pos, _ = _problem(2, 16, 10, [0, 0], 1)
    out, scale, lse = forgekernel.dsa_fused_prefill(q, kv, idx[:, :0], SCALE, cache, pos,
                                                    return_lse=True)  # fmt: skip
    _, floor = quantize_fp8_groups(torch.zeros(2, 16, LATENT))  # (the reference's gather
    assert torch.equal(scale, floor) and torch.all(out.view(torch.uint8) == 0)  # needs topk)
    assert torch.all(torch.isneginf(lse)) and not fused_kernels
    o, s = forgekernel.dsa_fused_prefill(q[:0], kv, idx[:0], SCALE, cache, pos[:0])
    assert o.shape == (0, 16, LATENT) and s.shape == (0, 16, 16) and not fused_kernels


# ---------------------------------------------------------------- arguments


def _args(**change):
    bf = torch.bfloat16
    args = {
        "q": torch.randn(2, 16, WIDTH).to(bf),
        "kv": torch.randn(10, WIDTH).to(bf),
        "topk_indices": torch.zeros(2, 64, dtype=torch.int32),
        "softmax_scale": SCALE,
        "cos_sin_cache": torch.randn(8, ROPE),
        "positions": torch.zeros(2, dtype=torch.int64),
    }
    kwargs = {}
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    return args, kwargs


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"q": torch.zeros(2, 16, 512, dtype=torch.bfloat16)}, ValueError, "576"),
        ({"q": torch.zeros(2, 16, 576)}, TypeError, "q must have dtype"),
        ({"q": torch.zeros(2, 1, 16, 576, dtype=torch.bfloat16)}, ValueError, "q must be 3-D"),
        ({"kv": torch.zeros(10, 576, dtype=torch.float16)}, TypeError, "kv"),
        ({"kv": torch.zeros(10, 512, dtype=torch.bfloat16)}, ValueError, "kv must be rows"),
        ({"kv": torch.zeros(10, 64, 2, 576, dtype=torch.bfloat16)}, ValueError, "combined"),
        ({"topk_indices": torch.zeros(2, 64, dtype=torch.int64)}, TypeError, "topk_indices"),
        ({"topk_indices": torch.zeros(3, 64, dtype=torch.int32)}, ValueError, "S = 2"),
        ({"softmax_scale": None}, TypeError, "no default"),
        ({"cos_sin_cache": torch.zeros(8, 32)}, ValueError, "cos_sin_cache must be"),
        ({"cos_sin_cache": torch.zeros(0, 64)}, ValueError, "positions >= 1"),
        ({"cos_sin_cache": torch.zeros(8, 64, dtype=torch.float16)}, TypeError, "cos_sin_cache"),
        ({"positions": torch.zeros(2, dtype=torch.int16)}, TypeError, "positions"),
        ({"positions": torch.zeros(3, dtype=torch.int32)}, ValueError, "positions must be"),
        ({"rope_dim": 32}, ValueError, "rope_dim must be 64"),
        ({"interleaved": 1}, TypeError, "interleaved"),
        ({"attn_sink": torch.zeros(8)}, ValueError, "attn_sink"),
        ({"attn_sink": torch.zeros(16, dtype=torch.bfloat16)}, TypeError, "attn_sink"),
        ({"out": torch.zeros(2, 16, 512, dtype=torch.bfloat16)}, TypeError, "out must have"),
        ({"out": torch.zeros(2, 16, 1024, dtype=E4M3)[..., 1:513]}, ValueError, "2-byte"),
        ({"out_scale": torch.zeros(2, 16, 32)}, ValueError, "out_scale must have"),
        ({"q_rms_norm_eps": 1e-6}, NotImplementedError, "RMSNorm"),
    ],
)  # fmt: skip
def test_bad_arguments(monkeypatch, change, err, match):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    args, kwargs = _args(**change)
    with pytest.raises(err, match=match):
        forgekernel.dsa_fused_prefill(*args.values(), **kwargs)


def test_cuda_kv_rows_and_grad(monkeypatch):
    args, _ = _args()
    with pytest.raises(ValueError, match="CUDA tensor"):
        forgekernel.dsa_fused_prefill(*args.values())
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    wide = torch.zeros(10, 577, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        forgekernel.dsa_fused_prefill(*_args(kv=wide[:, 1:])[0].values())
    q = args["q"].clone().requires_grad_()
    with pytest.raises(NotImplementedError, match="no backward"):
        forgekernel.dsa_fused_prefill(*_args(q=q)[0].values())


def test_out_rows_checked_on_the_eager_path_only(monkeypatch):
    """An eager call's out is written in place (rows contiguous, e4m3 pairs aligned); a traced
    call copies into out, and reads no fake data pointer (the 2026-12-05 audit: torch warned of
    the read on every traced call with out=, an error to come)."""
    import warnings

    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    odd = torch.zeros(2, 16, 513, dtype=torch.uint8).view(E4M3)[..., 1:]
    with pytest.raises(ValueError, match="out's rows must be contiguous and 2-byte aligned"):
        forgekernel.dsa_fused_prefill(*_args()[0].values(), out=odd)
    with FakeTensorMode(), warnings.catch_warnings():  # (the copy into out: a CUDA torch's)
        warnings.simplefilter("error")
        q, kv, idx, _, cache, pos = _fake_inputs()
        op._validate(q, kv, idx, cache, pos, None, ROPE,
                     torch.empty(5, 16, 512, device="cuda", dtype=E4M3), None)  # fmt: skip


def _fake_inputs():
    cuda = {"device": "cuda", "dtype": torch.bfloat16}
    return (torch.empty(5, 16, WIDTH, **cuda), torch.empty(40, WIDTH, **cuda),
            torch.empty(5, 2048, device="cuda", dtype=torch.int32), SCALE,
            torch.empty(100, ROPE, device="cuda"),
            torch.empty(5, device="cuda", dtype=torch.int64))  # fmt: skip


def test_fake_implementation_under_make_fx():
    """torch.compile / CUDA-graph support: on fake CUDA tensors the custom op's fake gives the
    shapes and dtypes, nothing runs, and make_fx records the op."""
    with FakeTensorMode():
        o, s, lse = forgekernel.dsa_fused_prefill(*_fake_inputs(), return_lse=True)
        assert o.shape == (5, 16, 512) and o.dtype == E4M3
        assert s.shape == (5, 16, 16) and s.dtype == torch.float32
        assert lse.shape == (5, 16) and lse.dtype == torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(lambda *x: forgekernel.dsa_fused_prefill(*x)[1] * 2,
                        tracing_mode="fake")(*_fake_inputs())  # fmt: skip
    assert "forgekernel.dsa_fused_prefill" in str(graph.graph)


# ---------------------------------------------------------------- the suite


def test_suite_is_pending():
    """Pending (no GPU check yet): registered only with FORGEKERNEL_PENDING_SUITES; the bench
    cases are dsa_sparse's prefill group from 4k queries, the checks awkward sizes."""
    from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES, dsa_sparse

    module = PENDING_SUITE_MODULES["dsa_fused_prefill"]
    assert module == "forgekernel.bench.suites.dsa_fused_prefill"
    assert "dsa_fused_prefill" not in SUITE_MODULES or os.environ.get("FORGEKERNEL_PENDING_SUITES")
    s = suite_module.suite()
    names = {c.name for c in s.bench_cases + s.check_cases}
    assert len(names) == len(s.bench_cases) + len(s.check_cases)
    prefill = {c.name for c in dsa_sparse.BENCH_CASES
               if c.params["prefill"] and c.params["tokens"] >= 4096}  # fmt: skip
    # each over the 16-bit cache (the names before the FP8 cases) and over the FP8 cache (the
    # bar's group, like for like with flashmla_fp8_unfused)
    groups = {g: {c.name for c in s.bench_cases if c.group == g} for g in ("prefill", "fp8")}
    assert groups["prefill"] == prefill and len(s.bench_cases) == 2 * len(prefill)
    assert groups["fp8"] == {f"{n}-fp8" for n in prefill}
    assert all(c.params["cache"] == "fp8" for c in s.bench_cases if c.group == "fp8")
    fp8_checks = [c for c in s.check_cases if c.params["cache"] == "fp8"]
    assert {c.params["hq"] for c in fp8_checks} == {16, 64, 128}
    assert any(c.params["cache"] == "fp8" for c in s.sanitize_cases)
    assert {c.params["sink"] for c in s.check_cases} == {"finite", "inf", "none"}
    assert not all(c.params["interleaved"] for c in s.check_cases)
    assert s.judge is not None and s.sanitize_cases
    assert set(suite_module.comparators()) == {"flashmla_fp8_unfused", "ours_unfused"}


suite_module = importlib.import_module("forgekernel.bench.suites.dsa_fused_prefill")


@pytest.mark.parametrize("case", suite_module.CHECK_CASES, ids=lambda c: c.name)
def test_suite_check_passes_on_the_algorithm(fused_kernels, case):
    """The suite's own check (`bench.check.verify`: NaN-poisoned outputs, the judge's three
    verdicts) with the fused pass's replay standing in; a NaN scale fails the scales' and the
    dequantized out's verdicts."""
    from forgekernel.bench.check import verify

    suite = suite_module.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    out, cmps = verify(suite, inputs, torch.device("cpu"))
    assert [c.ok for c in cmps] == [True] * 3, [c.message for c in cmps]
    out[1][0, 0, 3] = float("nan")
    low, _ = suite_module.low_precision_out(inputs)
    verdicts = suite_module.verdicts(out, suite_module.reference(inputs), low)
    assert [v["ok"] for v in verdicts] == [False, False, True]  # (out dequantizes by it)
    if case.params["cache"] == "fp8":  # ours and FlashMLA read the case's own FP8 cache
        assert inputs["fp8_ckv"] is inputs["ckv"] and inputs["ckv"].shape[-1] == 656
        assert inputs["q"].dtype == torch.bfloat16


@pytest.mark.parametrize("which", [1, 8], ids=["bf16", "fp8"])
def test_suite_unfused_chain_is_the_reference(which):
    """The comparators' torch tail (sink, conjugate RoPE, cast) on the reference's attention is
    the reference bit for bit (over the 16-bit and the dequantized FP8 cache); `ours_unfused`
    applies no second sink."""
    case = suite_module.CHECK_CASES[which]
    assert (case.params["cache"] == "fp8") == (which == 8)
    inputs = suite_module.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                      torch.Generator().manual_seed(0))  # fmt: skip
    want = suite_module.reference(inputs)
    from forgekernel.reference.dsa import dsa_sparse_attention_paged_ref

    cos, sin = suite_module._cos_sin(inputs)
    q = suite_module._rope_q(inputs, cos, sin)
    kv = suite_module.dsa_sparse._kv(inputs)
    out, lse = dsa_sparse_attention_paged_ref(q, kv, inputs["idx"], SCALE_SUITE)
    o8, scale, _ = suite_module._finish(out, lse, inputs["sink"], cos, sin, True)
    assert torch.equal(scale, want.out_scale)
    assert float((o8.float() - want.out_fp8.float()).abs().max()) <= float(
        (scale.repeat_interleave(32, -1) * 32).max()
    )


SCALE_SUITE = suite_module.SOFTMAX_SCALE


# ---------------------------------------------------------------- over FlashMLA's FP8 cache


def _fp8_cache(slots: int, paged: int | None, seed: int = 1, row_bytes: int = 656):
    """FlashMLA's FP8 cache of `slots` random rows (reference.mla.quantize_flashmla_fp8): (slots
    / paged, paged, 1, 656) float8_e4m3fn, or (paged None) its rows (slots, 656) as uint8;
    row_bytes > 656: the rows `row_bytes` apart (a padded cache), the same 656 bytes each. With
    the dequantized rows (slots, 576) fp32 the reference reads (dsa_sparse's `_kv`)."""
    from forgekernel.reference.mla import flashmla_fp8_views, quantize_flashmla_fp8

    g = torch.Generator().manual_seed(seed)
    ps = paged or 1
    latent = torch.randn(slots // ps, ps, LATENT, generator=g).to(torch.bfloat16)
    rope = torch.randn(slots // ps, ps, ROPE, generator=g).to(torch.bfloat16)
    packed = quantize_flashmla_fp8(latent, rope)
    if row_bytes != 656:
        wide = torch.zeros(*packed.shape[:3], row_bytes, dtype=E4M3)
        wide[..., :656] = packed
        packed = wide[..., :656]
    e4m3, scale, kpe = flashmla_fp8_views(packed)
    deq = e4m3.float() * scale.repeat_interleave(128, -1)
    kv_ref = torch.cat([deq, kpe.float()], -1).reshape(-1, WIDTH)
    kv = packed if paged else packed[:, 0, 0].view(torch.uint8)
    return kv, kv_ref


FP8_CASES = [
    # (tokens, hq, slots, valid, topk, positions, sinks, interleaved, paged, row_bytes)
    (5, 16, 256, [64, 0, 17, 1, 64], 64, torch.int64, "finite", True, 64, 656),
    (3, 64, 200, [100, 0, 7], 100, torch.int32, "inf", False, None, 656),
    (2, 128, 128, [70, 3], 70, torch.int64, "none", True, 16, 672),
    (4, 7, 130, [129, 2, 0, 65], 130, torch.int32, "finite", True, None, 688),
]  # fmt: skip


@pytest.mark.parametrize(
    ("tokens", "hq", "slots", "valid", "topk", "positions", "sinks", "interleaved", "paged",
     "row_bytes"), FP8_CASES,
)  # fmt: skip
def test_fused_prefill_fp8_cache_matches_the_reference(fused_kernels, tokens, hq, slots, valid,
                                                       topk, positions, sinks, interleaved,
                                                       paged, row_bytes):  # fmt: skip
    """Over FlashMLA's FP8 cache (paged (P, ps, 1, 656) e4m3, or its rows (S_kv, 656) uint8;
    rows 656 or more bytes apart): the `fp8` fused key, its pass replayed with the latent
    dequantized as the kernel does and the scales read through the latent view's rows, against
    the reference over the dequantized cache."""
    q, _, idx, cache, pos, sink = _problem(tokens, hq, slots, valid, topk,
                                           positions=positions, sinks=sinks)  # fmt: skip
    kv, kv_ref = _fp8_cache(slots, paged, row_bytes=row_bytes)
    got = forgekernel.dsa_fused_prefill(q, kv, idx, SCALE, cache, pos, attn_sink=sink,
                                        interleaved=interleaved, return_lse=True)  # fmt: skip
    want = dsa_fused_prefill_ref(q, kv_ref, idx, SCALE, cache, pos, attn_sink=sink,
                                 interleaved=interleaved)  # fmt: skip
    _check(got, want, valid)
    (p,) = fused_kernels
    assert p["fp8"] and p["heads"] == heads_per_cta(hq) and p["dtype"] == "bfloat16"
    assert p.get("sink", False) == (sink is not None) and p.get("neox", False) != interleaved


def test_fp8_scales_through_the_latent_rows():
    """The pass's scales view (fp8.py `row_scales`, replayed by `row_scales` here) is the
    op's scales view (`fp8_cache_views`) for packed, padded and page-strided caches."""
    from forgekernel.ops.mla import fp8_cache_views

    for paged, row_bytes in ((64, 656), (16, 672), (None, 688)):
        kv, _ = _fp8_cache(128, paged, row_bytes=row_bytes)
        latent, _, scale = op._kv_views(kv)
        assert torch.equal(row_scales(latent), scale)
        if kv.dim() == 4:
            assert torch.equal(fp8_cache_views(kv)[2], scale)


def test_fp8_out_in_place(fused_kernels):
    q, _, idx, cache, pos, sink = _problem(3, 16, 64, [5, 64, 0], 64)
    kv, kv_ref = _fp8_cache(64, 64)
    out = torch.full((3, 16, LATENT), float("nan")).to(E4M3)
    scale = torch.full((3, 16, 16), float("nan"))
    o, s = forgekernel.dsa_fused_prefill(q, kv, idx, SCALE, cache, pos, attn_sink=sink,
                                         out=out, out_scale=scale)  # fmt: skip
    assert o is out and s is scale and not torch.isnan(scale).any()
    want = dsa_fused_prefill_ref(q, kv_ref, idx, SCALE, cache, pos, attn_sink=sink)
    _check((o, s, want.lse), want, [5, 64, 0])


def _fp8_kv(shape=(10, 1, 1, 656), dtype=E4M3):
    return torch.zeros(shape, dtype=torch.uint8).view(dtype)


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"kv": _fp8_kv(), "q": torch.zeros(2, 16, WIDTH, dtype=torch.float16)}, TypeError,
         "bf16 q"),
        ({"kv": _fp8_kv(dtype=torch.float8_e5m2)}, TypeError, "float8_e4m3fn or uint8"),
        ({"kv": _fp8_kv(dtype=torch.int8)}, TypeError, "float8_e4m3fn or uint8"),
        ({"kv": _fp8_kv((10, 1, 1, 576))}, NotImplementedError, "per-tensor"),
        ({"kv": _fp8_kv((10, 64, 2, 656))}, ValueError, "FP8 ckv_cache must be"),
        ({"kv": _fp8_kv((10, 576))}, NotImplementedError, "per-tensor"),
        ({"kv": _fp8_kv((10, 600))}, ValueError, "FP8 ckv_cache must be"),
        ({"kv": _fp8_kv((10, 16, 656))}, ValueError, "its rows"),
        ({"kv": _fp8_kv((10, 672))[:, 8:664]}, ValueError, "16-byte aligned"),
        ({"kv": _fp8_kv((10, 664))[:, :656]}, ValueError, "16-byte aligned"),
    ],
)  # fmt: skip
def test_fp8_bad_arguments(monkeypatch, change, err, match):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    args, kwargs = _args(**change)
    with pytest.raises(err, match=match):
        forgekernel.dsa_fused_prefill(*args.values(), **kwargs)


def test_fp8_fake_implementation_under_make_fx():
    """The FP8 cache through the custom op on fake CUDA tensors: the same outputs' shapes."""
    with FakeTensorMode():
        inputs = list(_fake_inputs())
        inputs[1] = torch.empty(40, 64, 1, 656, device="cuda", dtype=E4M3)
        o, s, lse = forgekernel.dsa_fused_prefill(*inputs, return_lse=True)
        assert o.shape == (5, 16, 512) and o.dtype == E4M3 and s.shape == (5, 16, 16)
        assert lse.shape == (5, 16)
    with FakeTensorMode(allow_non_fake_inputs=True):
        inputs = list(_fake_inputs())
        inputs[1] = torch.empty(40, 656, device="cuda", dtype=torch.uint8)
        graph = make_fx(lambda *x: forgekernel.dsa_fused_prefill(*x)[1] * 2,
                        tracing_mode="fake")(*inputs)  # fmt: skip
    assert "forgekernel.dsa_fused_prefill" in str(graph.graph)
