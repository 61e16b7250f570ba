"""DeepSeek MLA paged decode on the CPU (the GPU's checks: tests/gpu/test_mla_gpu.py): heads per
CTA, compile keys and the split plan; the kernels' algorithm (split ranges, 64-key tiles scored
over the 576 latent + RoPE columns with one running max per row per tile, P rounded to q's dtype
before P V, the split's normalized O and log2 LSE, the paged leaf's combine) replayed in Python
through the real launcher and op against reference.mla: decode, MTP (s_q 2 / 4), the packed
form, FlashMLA's combined cache, FlashInfer-Bench's adapter; FlashMLA's FP8 cache (the replay
dequantizes by `dequantize_like_the_kernel`, a bit-level torch model of fp8.py's instruction
sequence, itself checked bit for bit against e4m3 x scale over all 256 codes and the scales
2^-124 .. 2^7) through decode, MTP, the packed form and prefill; argument errors; the suite's
own check; the custom op's fake implementation under make_fx."""

from __future__ import annotations

import functools
import importlib
import itertools
import math

import pytest
import torch
from mla_seesaw import seesaw_partial, unit_per
from split_combine import combine_splits
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.bench.check import verify
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES, mla_decode
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import (
    DTYPES,
    E4M3_TO_BF16_EXPONENT,
    FP8_ROW_BYTES,
    HEADS,
    MIN_TOKENS_PER_SPLIT,
    OSTORE_BLOCKS,
    QTOKENS,
    ROWS,
    SPLIT_OVERHEAD_TILES,
    TILE,
    direct_blocks,
    heads_per_cta,
    params_for,
    split_plan,
    tile_split_plan,
)
from forgekernel.kernels.attention.paged.sm90 import config as paged_config
from forgekernel.reference.flashinfer_paged import page_table_to_csr
from forgekernel.reference.mla import (
    flashmla_fp8_views,
    mla_decode_ref,
    mla_prefill_ref,
    quantize_flashmla_fp8,
)
from forgekernel.reference.mla_flashinfer import mla_flashinfer_decode, mla_flashinfer_prefill

op = importlib.import_module("forgekernel.ops.mla")
SCALE = mla_decode.SOFTMAX_SCALE
LATENT = 512


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("hq", "qtokens", "want"),
    [(16, 1, 16), (128, 1, 64), (128, 2, 32), (128, 4, 16), (16, 2, 16), (16, 4, 16),
     (8, 1, 8), (24, 1, 8), (3, 1, 1), (6, 4, 2), (32, 2, 32), (96, 1, 32)],
)  # fmt: skip
def test_heads_per_cta(hq, qtokens, want):
    h = heads_per_cta(hq, qtokens)
    assert h == want and hq % h == 0 and h in HEADS and h * qtokens <= ROWS


def test_compile_keys():
    """The combine is the paged leaf's kernel at head dim 512 under the key it would have
    there; every standard partial fits the MMA's rows."""
    for dtype in ("float16", "bfloat16"):
        assert params_for("combine", dtype) == paged_config.params_for("combine", dtype, 512)
    assert dict(params_for("partial", "bfloat16", 16)) == {
        "kind": "partial", "dtype": "bfloat16", "heads": 16,
    }  # fmt: skip
    assert dict(params_for("partial", "float16", 4, 4))["qtokens"] == 4
    assert dict(params_for("partial", "bfloat16", 16, 2, fp8=True)) == {
        "kind": "partial", "dtype": "bfloat16", "heads": 16, "qtokens": 2, "fp8": True,
    }  # fmt: skip
    assert dict(params_for("partial", "float16", 16, tma=True)) == {
        "kind": "partial", "dtype": "float16", "heads": 16, "tma": True,
    }  # fmt: skip
    for bad in ({"kind": "sparse", "dtype": "bfloat16"}, {"kind": "partial", "fp8": True}):
        with pytest.raises(ValueError, match="16-bit paged"):
            params_for(**{"dtype": "bfloat16", "heads": 16, **bad}, tma=True)
    every = [dict(p) for p in SPEC.standard_params() if dict(p)["kind"] == "partial"]
    partial = [p for p in every if not p.get("gather")]
    per_pass = sum(1 for h in HEADS for t in QTOKENS if h * t <= ROWS)
    # the seesaw pass's gather form (16-bit page 1, "gather adopted"): each seesaw key of the
    # width plan (partial, direct, direct ostore; not the schedule's ranges) with `gather`
    gathered = sorted(sorted(p.items()) for p in every if p.get("gather"))
    seesaw = [p for p in partial if p.get("tma") and not p.get("ranges")]
    assert gathered == sorted(sorted((p | {"gather": True}).items()) for p in seesaw)
    assert len(gathered) == 2 * (per_pass + len(direct_blocks()) + len(OSTORE_BLOCKS)) == 54
    # fp16 and bf16 (the seesaw pass and decode.py's), FP8 cache with bf16 queries (one form:
    # the bytes staged in their stage), each pass's direct form of the served head blocks (the
    # seesaw's and decode.py's in both dtypes, decode.py's over FP8)
    direct = [p for p in partial if p.get("direct") and not p.get("pair") and not p.get("ostore")]
    assert len(direct) == 5 * len(direct_blocks()) == 30
    assert sorted((p["dtype"], p.get("tma", False), p.get("fp8", False)) for p in direct) == sorted(
        (d, tma, fp8) for d, tma, fp8 in [(d, t, False) for d in DTYPES for t in (True, False)]
        + [("bfloat16", False, True)] for _ in direct_blocks()
    )  # fmt: skip
    # the pair form (measured slower, dropped): not prebuilt
    assert not any(p.get("pair") for p in partial)
    # the direct form's O store through shared memory (OSTORE_BLOCKS' default): both dtypes
    ostore = [p for p in partial if p.get("ostore")]
    assert sorted((p["dtype"], p["heads"], p.get("qtokens", 1)) for p in ostore) == sorted(
        (d, h, t) for d in DTYPES for h, t in OSTORE_BLOCKS
    ) and all(p["direct"] and not p.get("pair") for p in ostore)  # fmt: skip
    # a decode step's schedule: the ranges pass at every seesaw block, both dtypes
    ranged = [p for p in partial if p.get("ranges")]
    assert len(ranged) == 2 * per_pass and all(p["worklist"] and p["tma"] for p in ranged)
    assert len(partial) == 5 * per_pass + len(direct) + len(ostore) + len(ranged)
    fp8 = [p for p in partial if p.get("fp8") and not p.get("direct")]
    assert sorted((p["heads"], p.get("qtokens", 1)) for p in fp8) == sorted(
        (h, t) for h in HEADS for t in QTOKENS if h * t <= ROWS
    )
    assert all(set(p) <= {"kind", "dtype", "heads", "qtokens", "fp8"} for p in fp8)
    assert (
        sum(1 for p in partial if p.get("tma") and not p.get("direct") and not p.get("ranges"))
        == 2 * per_pass
    )
    assert all(p["dtype"] == "bfloat16" for p in partial if p.get("fp8"))
    assert dict(params_for("partial", "bfloat16", 16, fp8=True, direct=True)) == {
        "kind": "partial", "dtype": "bfloat16", "heads": 16, "fp8": True, "direct": True,
    }  # fmt: skip
    with pytest.raises(ValueError, match="ostore"):
        params_for("partial", "bfloat16", 16, direct=True, ostore=True)
    assert all(p["heads"] * p.get("qtokens", 1) <= ROWS for p in partial)
    with pytest.raises(ValueError, match="kind"):
        params_for("decode", "bfloat16")
    with pytest.raises(ValueError, match="bfloat16 queries"):
        params_for("partial", "float16", 16, fp8=True)


@pytest.mark.parametrize(("b", "blocks", "tokens"), [(1, 1, 65536), (64, 1, 4096), (1, 8, 16384),
                                                     (128, 8, 8192), (3, 1, 17)])  # fmt: skip
def test_split_plan_is_the_paged_leafs(b, blocks, tokens):
    """One resident CTA per SM: the plan's last wave filled to 90% where splits allow."""
    assert split_plan is paged_config.split_plan
    splits, per = split_plan(b, blocks, tokens, 132, 1)
    assert splits * per >= tokens and (splits - 1) * per < tokens
    if splits < -(-tokens // paged_config.MIN_TOKENS_PER_SPLIT):
        ctas = b * blocks * splits
        assert ctas / 132 / -(-ctas // 132) >= paged_config.WAVE_FILL


@pytest.mark.parametrize(("b", "blocks", "tokens"), [(1, 1, 65536), (64, 1, 4096), (1, 2, 16384),
                                                     (128, 2, 8192), (48, 1, 4096), (3, 1, 17),
                                                     (1, 1, 1), (200, 1, 300)])  # fmt: skip
def test_tile_split_plan(b, blocks, tokens):
    """The seesaw pass's plan: whole tiles per split, covering the keys, at least 256 a split
    (or all of them), and no other tile count with a smaller makespan (waves x (tiles +
    overhead)) or an equal one with fewer splits."""
    splits, per = tile_split_plan(b, blocks, tokens, 132, 1)
    tiles = -(-tokens // TILE)
    assert per % TILE == 0 and splits == -(-tiles // (per // TILE))
    assert splits * per >= tokens and (splits - 1) * per < tokens
    assert per >= min(256, tiles * TILE)

    def cost(n):
        s = -(-tiles // n)
        return -(-b * blocks * s // 132) * (n + SPLIT_OVERHEAD_TILES), s

    assert all(cost(per // TILE) <= cost(n) for n in range(min(4, tiles), tiles + 1))


def test_tile_split_plan_fills_the_wave():
    """One long sequence: 128 CTAs of 8 tiles (the paged plan rounded to tiles gave 114 of
    9); 128 sequences at 128 heads: one split each, not 32 of 4 tiles."""
    assert tile_split_plan(1, 1, 65536, 132, 1) == (128, 512)
    assert tile_split_plan(128, 2, 8192, 132, 1) == (1, 8192)


# ---------------------------------------------------------------- the direct form


def test_direct_blocks_are_the_served_head_blocks():
    """128 heads over TP 8 / 4 / 2 / 1 at 1, 2 and 4 query tokens."""
    assert direct_blocks() == ((16, 1), (32, 1), (64, 1), (16, 2), (32, 2), (16, 4))


DIRECT_PLANS = [
    # (kind, units, hq, max tokens, qtokens, fp8, page size), direct: the suite's and serving's
    (("partial", 128, 16, 8192, 1, False, 64), True),  # b128 h16: 128 CTAs, one split
    (("partial", 64, 16, 4096, 1, False, 64), False),  # b64 h16: two splits fill the wave
    (("partial", 64, 128, 4096, 1, False, 64), True),  # b64 h128: 128 CTAs
    (("partial", 128, 128, 65536, 1, False, 64), True),  # b128 h128 x 64k: 256 CTAs
    (("partial", 32, 128, 65536, 1, False, 64), False),  # b32 h128: 64 CTAs, 2 splits
    (("partial", 64, 128, 8192, 2, False, 64), True),  # MTP 2 at 128 heads: 256 CTAs
    (("partial", 256, 16, 8192, 4, False, 64), True),  # prefill b1 x 1024 tokens, h16
    (("partial", 3, 16, 128, 1, False, 64), True),  # short sequences: one split whatever B
    (("partial", 3, 16, 320, 4, False, 64), False),  # MTP 4 over 320 keys: 2 splits
    (("partial", 3, 24, 128, 1, False, 64), False),  # 8-head blocks: not prebuilt direct
    (("partial", 3, 16, 128, 1, False, 16), True),  # page 16: decode.py's direct form
    (("partial", 128, 16, 8192, 1, True, 64), True),  # FP8 b128-h16: decode.py's direct form
    (("partial", 200, 16, 8192, 1, True, 64), False),  # FP8 b200: 3 splits (the paged plan)
    (("partial", 16, 128, 8192, 1, True, 64), False),  # FP8 b16-h128: 4 splits
    (("partial", 64, 16, 4096, 1, False, 1), False),  # page 1 b64-h16: 2 splits (gather)
    (("partial", 3, 16, 128, 1, False, 1), True),  # page 1: the gather form's direct form
    (("partial", 3, 16, 128, 1, True, 1), True),  # FP8 page 1: decode.py's direct form
    (("sparse", 200, 16, 2048, 1, False, 1), False),  # DSA t200-h16: 3 splits of 11 tiles
    (("sparse", 1024, 16, 2048, 1, False, 1), True),  # DSA prefill: the sparse direct form
    (("sparse", 128, 16, 2048, 1, True, 64), True),  # DSA t128-h16 (FP8)
    (("sparse", 64, 128, 2048, 1, True, 64), True),  # DSA t64-h128: 64-head blocks
    (("sparse", 64, 16, 2048, 1, True, 64), False),  # DSA t64-h16: 2 splits
    (("sparse", 512, 24, 2048, 1, False, 64), True),  # a prefill's 8-head blocks
    (("sparse", 512, 32, 2048, 1, False, 64), False),  # 32-head blocks: not prebuilt sparse
]


@pytest.mark.parametrize(("key", "direct"), DIRECT_PLANS)
def test_launcher_takes_the_direct_form_for_one_split(monkeypatch, key, direct):
    """Direct exactly when the plan gives one split and the head block is prebuilt direct
    (the seesaw pass's, decode.py's paged pass's over pages of partial tiles or FP8, DSA's
    sparse pass's); then no combine. plan_form(direct=False) and FORGEKERNEL_MLA_DIRECT=0 keep
    the combine."""
    monkeypatch.setattr(mla_launch, "get_kernel", lambda spec, params: dict(params))
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    kind, units, hq, tokens, qtokens, fp8, ps = key
    kernel, combine, splits, per, _, _ = mla_launch._plan(
        kind, torch.bfloat16, units, hq, tokens, qtokens, 0, fp8, ps
    )
    assert kernel.get("direct", False) == direct and (combine is None) == direct
    seesaw = kind == "partial" and not fp8 and (ps % TILE == 0 or ps == 1)  # page 1: gather
    assert kernel["kind"] == kind and kernel.get("tma", False) == seesaw
    assert kernel.get("gather", False) == (seesaw and ps % TILE != 0)
    assert kernel.get("fp8", False) == fp8 and "pdl" not in kernel
    if direct:
        assert splits == 1 and per >= tokens
        kernel, combine, splits, _, _, _ = mla_launch._plan(
            kind, torch.bfloat16, units, hq, tokens, qtokens, 0, fp8, ps,
            form=(None, None, False, False, None),
        )  # fmt: skip
        # (plan_form(direct=False))
        assert "direct" not in kernel and combine["kind"] == "combine" and splits == 1
        monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", "0")
        kernel, combine, splits, _, _, _ = mla_launch._plan(
            kind, torch.bfloat16, units, hq, tokens, qtokens, 0, fp8, ps
        )
        assert "direct" not in kernel and combine["kind"] == "combine" and splits == 1
    monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", "yes")
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_DIRECT"):
        mla_launch.direct_enabled()


@pytest.mark.parametrize(
    ("b", "hq", "lens", "s_q", "dtype"),
    [
        (3, 16, [37, 0, 100], 1, torch.bfloat16),
        (3, 16, [37, 0, 100], 1, torch.float16),
        (4, 128, [1, 63, 65, 200], 1, torch.bfloat16),
        (3, 16, [5, 0, 130], 2, torch.float16),
        (2, 32, [3, 90], 3, torch.bfloat16),
        (3, 16, [4, 0, 129], 4, torch.bfloat16),
    ],
)
def test_direct_form_is_the_split_path_of_one_split(cpu_kernels, monkeypatch, b, hq, lens, s_q,
                                                     dtype):  # fmt: skip
    """Plans of one split (short sequences, page 64): the direct form's one launch (no partials
    allocated, no combine) gives the reference, and the same O bits as the partial pass + the
    combine of that plan (FORGEKERNEL_MLA_DIRECT=0); sequences of 0 keys 0 / -inf."""
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, 64, lens, s_q, True, dtype, seed=b + s_q)

    def no_partials(*args):
        raise AssertionError("the direct form allocates no partials")

    with monkeypatch.context() as m:
        m.setattr(mla_launch, "_partials", no_partials)
        out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    assert [c[0].get("direct", False) for c in cpu_kernels] == [True]
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    _assert_close(out, lse, want, want_lse)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    mla_launch._plans.clear()
    monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", "0")
    split_out, split_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                         return_lse=True)  # fmt: skip
    assert "direct" not in cpu_kernels[-1][0]
    assert torch.equal(out, split_out)
    assert torch.equal(torch.isneginf(lse), torch.isneginf(split_lse))
    finite = torch.isfinite(lse)
    assert torch.allclose(lse[finite], split_lse[finite], rtol=1e-6, atol=1e-6)


def direct_then_split(monkeypatch, call) -> list:
    """call() with FORGEKERNEL_MLA_DIRECT=1 (plans rebuilt; allocating partials fails: the
    direct form has none), then =0 (the partial pass + combine of the same plan): their
    results in that order."""

    def no_partials(*args):
        raise AssertionError("the direct form allocates no partials")

    results = []
    for flag in ("1", "0"):
        monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", flag)
        mla_launch._plans.clear()
        with monkeypatch.context() as m:
            if flag == "1":
                m.setattr(mla_launch, "_partials", no_partials)
            results.append(call())
    return results


@pytest.mark.parametrize(
    ("b", "hq", "page_size", "lens", "s_q", "fp8"),
    [
        (3, 16, 16, [37, 0, 100], 1, False),  # 16 x 1, page 16
        (4, 128, 1, [1, 63, 65, 200], 1, False),  # 64 x 1, page 1
        (3, 16, 16, [5, 0, 130], 2, True),  # 16 x 2, FP8
        (2, 32, 64, [3, 90], 3, True),  # 16 x 4 (3 tokens), FP8 on page 64
        (2, 32, 1, [0, 250], 1, True),  # 32 x 1, FP8 on page 1
    ],
)
def test_roles_direct_form_is_the_split_path_of_one_split(cpu_kernels, monkeypatch, b, hq,
                                                           page_size, lens, s_q, fp8):  # fmt: skip
    """decode.py's paged pass (pages of partial tiles, FP8 caches) on plans of one split: its
    direct form's one launch (no partials, no combine) gives the reference and the same bits
    as its partial form + the combine of that plan (FORGEKERNEL_MLA_DIRECT=0). (16-bit page 1
    takes the seesaw's gather form by default: FORGEKERNEL_MLA_GATHER=0 keeps it here.)"""
    monkeypatch.setenv("FORGEKERNEL_MLA_GATHER", "0")
    if fp8:
        qn, qp, ckv, table, seq = _fp8_problem(b, hq, page_size, lens, s_q, seed=b + s_q)
        kpe = None
        want, want_lse = _fp8_reference(qn, qp, ckv, table, seq)
    else:
        qn, qp, ckv, kpe, table, seq = _problem(b, hq, page_size, lens, s_q, seed=b + s_q)
        want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)

    results = direct_then_split(
        monkeypatch,
        lambda: op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True),
    )
    (direct, _, _), (split, _, _) = cpu_kernels
    assert direct["direct"] and "tma" not in direct and direct.get("fp8", False) == fp8
    assert "direct" not in split and split.get("fp8", False) == fp8
    (out, lse), (split_out, split_lse) = results
    if fp8:
        _assert_close_fp8(out, lse, want, want_lse)
    else:
        _assert_close(out, lse, want, want_lse)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    assert torch.equal(out, split_out) and torch.equal(lse, split_lse)


# ---------------------------------------------------------------- FP8 dequantization


def _prmt(words: torch.Tensor, selector: int) -> torch.Tensor:
    """PTX prmt.b32 d, a, 0, selector on int64-held 32-bit words: target byte n takes source
    byte (selector >> 4n) & 7 of {0, a} (bytes 4-7 zero), its sign replicated when bit 3 of
    the nibble is set."""
    out = torch.zeros_like(words)
    for n in range(4):
        sel = (selector >> (4 * n)) & 0xF
        byte = (words >> (8 * (sel & 7))) & 0xFF if sel & 7 < 4 else torch.zeros_like(words)
        if sel & 8:
            byte = torch.where(byte & 0x80 != 0, 0xFF, 0)
        out |= byte << (8 * n)
    return out


def _bf16_bits(bits16: torch.Tensor) -> torch.Tensor:
    """int64-held 16-bit patterns as bf16."""
    return bits16.to(torch.int32).to(torch.int16).view(torch.bfloat16)


def dequantize_like_the_kernel(codes: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp8.py's sequence, bit for bit: codes uint8 (..., 4k) e4m3 bytes, scale fp32 (...,) one
    per row -> bf16 (..., 4k). Per 32-bit word (bytes 0..3 little-endian): prmt 0x9180 / 0xB3A2
    (two bytes, each sign-extended to 16 bits), shl 4, and 0x87F087F0, then mul.rn.bf16x2 by
    bf16(2^120 x scale) (the fp32 product of two bf16 is exact; one rounding into bf16)."""
    words = codes.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    mult = (scale.float() * 2.0**E4M3_TO_BF16_EXPONENT).to(torch.bfloat16).float()[..., None]
    halves = []
    for selector in (0x9180, 0xB3A2):
        t = ((_prmt(words, selector) << 4) & 0xFFFFFFFF) & 0x87F087F0
        for bits in (t & 0xFFFF, t >> 16):
            halves.append((_bf16_bits(bits).float() * mult).to(torch.bfloat16))
    # word w -> elements 4w .. 4w + 3 = (low, high) of the first register, then of the second
    return torch.stack(halves, -1).flatten(-2)


def _dequantize_rows(ckv: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(..., 512) uint8 rows with their (..., 4) scales, as the kernel stores them (bf16)."""
    tiles = ckv.view(torch.uint8).unflatten(-1, (scale.shape[-1], -1))
    return dequantize_like_the_kernel(tiles, scale).flatten(-2)


def test_fp8_dequantization_is_exact_on_every_code():
    """All 256 e4m3 codes times 2^k, k = -124 .. 7 (where the products are bf16 values and the
    multiplier 2^(120 + k) is finite): the kernel's bits equal e4m3 x scale rounded to bf16,
    which is exact, subnormals included. The NaN codes 0x7F / 0xFF read as +-480 x scale."""
    codes = torch.arange(256, dtype=torch.uint8).repeat(132, 1)
    scale = torch.exp2(torch.arange(-124, 8, dtype=torch.float32))
    got = dequantize_like_the_kernel(codes, scale)
    value = codes.view(torch.float8_e4m3fn).float() * scale[:, None]  # exact in fp32
    want = value.to(torch.bfloat16)
    finite = ~value.isnan()
    assert finite.sum() == 254 * 132 and torch.equal(want.float()[finite], value[finite])
    assert torch.equal(got.view(torch.int16)[finite], want.view(torch.int16)[finite])
    assert torch.equal(got[:, [0x7F, 0xFF]].float(), scale[:, None] * torch.tensor([480.0, -480]))
    assert int((got.view(torch.int16) == 0).sum()) == 132  # +0 once per row (-0 is 0x8000)
    tiny = got[0, 1:8].float()  # the subnormal codes at 2^-124: bf16 subnormals m x 2^-133
    assert torch.equal(tiny, torch.arange(1, 8) * 2.0**-133)
    # 2^8 leaves the range: 2^128 is no bf16, the multiplier is inf
    over = dequantize_like_the_kernel(codes[:1], torch.tensor([2.0**8]))
    assert torch.isinf(over[0, 1:0x7F].float()).all()


# ---------------------------------------------------------------- the kernels, replayed


def _partial(qn, qp, ckv, kpe, ckv_scale, pt, seq, op_, lp, scale_log2, per, page_size, cu,
             causal, q_blocks, *, heads, qtokens, direct=False):  # fmt: skip
    """The partial pass (decode.py) of CTA (split, head block, sequence x query block): rows
    (token i, head h) of `heads` x `qtokens`, block k of a sequence's query tokens starting at
    token k qtokens; the split's keys in tiles of TILE, each tile's scores over all its keys at
    once (one running max per row), keys clamped to the split's last and masked past it / past
    the causal limit; P in q's dtype before P V. FP8 (ckv_scale given): the latent rows
    dequantized into bf16 as the kernel does. The split's O x 1 / sum and log2 LSE in fp32:
    the partials op_ / lp, or in the direct form (op_ out (rows, Hq, 512) in q's dtype, lp the
    natural lse; one split) O rounded to q's dtype and the LSE x ln 2 (`_write_split`)."""
    _, hq, _ = qn.shape
    if direct:
        assert op_.dtype == qn.dtype and op_.shape == (*qn.shape[:2], LATENT)
    assert hq % heads == 0 and heads * qtokens <= ROWS and (cu is None) == (qtokens == 1)
    assert cu is not None or q_blocks == 1
    rows = [(i, h) for i in range(qtokens) for h in range(heads)]
    for b, blk in itertools.product(range(seq.shape[0]), range(q_blocks)):
        sk = int(seq[b])
        if cu is None:
            q_off, sq, kv_end = b, 1, sk
        else:
            q_all, token0 = int(cu[b + 1] - cu[b]), blk * qtokens
            q_off, sq = int(cu[b]) + token0, max(min(q_all - token0, qtokens), 0)
            kv_end = (sk - q_all + token0 + sq if causal else sk) if sq > 0 else 0
        for h0 in range(0, hq, heads):
            zero = torch.zeros(LATENT + 64, dtype=torch.float64)
            q = torch.stack([
                torch.cat([qn[q_off + i, h0 + h], qp[q_off + i, h0 + h]]).double()
                if i < sq else zero for i, h in rows
            ])  # fmt: skip
            splits = 1 if direct else op_.shape[0]
            per_u = unit_per(per, kv_end, splits)
            for s in range(splits):
                t0, t1 = s * per_u, min(s * per_u + per_u, kv_end)
                limit = torch.tensor([
                    (min(t1, kv_end - sq + i + 1) if causal else t1) if i < sq else 0
                    for i, _ in rows
                ])  # fmt: skip
                m = torch.full((len(rows),), -math.inf, dtype=torch.float64)
                lsum = torch.zeros(len(rows), dtype=torch.float64)
                o = torch.zeros(len(rows), LATENT, dtype=torch.float64)
                for first in range(t0, t1, TILE):
                    t = torch.arange(first, first + TILE).clamp(max=t1 - 1)
                    # the kernel reads only the sequence's keys (its page-table entries)
                    assert 0 <= first and t1 <= sk, (b, blk, s, t0, t1, sk)
                    pages, slots = pt[b, t // page_size].long(), t % page_size
                    latent = ckv[pages, slots]
                    if ckv_scale is not None:
                        latent = _dequantize_rows(latent, ckv_scale[pages, slots])
                    keys = torch.cat([latent, kpe[pages, slots]], -1).double()
                    sc = q @ keys.T
                    key = torch.arange(first, first + TILE)
                    sc = torch.where(key[None, :] < limit[:, None], sc, -math.inf)
                    m_new = torch.maximum(m, sc.max(1).values)
                    base = torch.where(m_new > -math.inf, m_new * scale_log2, 0.0)
                    corr = torch.exp2(m * scale_log2 - base)
                    p = torch.exp2(sc * scale_log2 - base[:, None])
                    lsum = lsum * corr + p.sum(1)
                    o = o * corr[:, None] + p.to(qn.dtype).double() @ keys[:, :LATENT]
                    m = m_new
                for r, (i, h) in enumerate(rows):
                    if i < sq:
                        seen = bool(lsum[r] > 0)
                        o_r = (o[r] / lsum[r] if seen else torch.zeros(LATENT)).float()
                        lse_r = (m[r] * scale_log2 + torch.log2(lsum[r])).float()
                        if not seen:
                            lse_r = torch.tensor(-math.inf)
                        if direct:
                            op_[q_off + i, h0 + h] = o_r.to(op_.dtype)
                            lp[q_off + i, h0 + h] = lse_r * math.log(2)
                        else:
                            op_[s, q_off + i, h0 + h] = o_r
                            lp[s, q_off + i, h0 + h] = lse_r


def _ranged_replay(p: dict):
    """A decode step's schedule's kernels (the ranges forms) as test_mla_worklist replays them."""
    worklist = importlib.import_module("test_mla_worklist")
    if p["kind"] == "combine":
        return worklist.combine_ranges
    if p["kind"] == "worklist":
        return functools.partial(worklist.ranged_schedule, {"sched": []}, p["qtokens"])
    kw = {"heads": p["heads"], "qtokens": p.get("qtokens", 1)}
    return lambda *args: worklist.ranged_partial(args, kw)


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The launcher's kernels replaced by the replay; the calls' (params, scalar args)."""
    calls = []

    def get_kernel(spec, params):
        assert spec is SPEC
        p = dict(params)
        if p.get("ranges", False):  # a decode step's schedule (the bench's `ours` takes one)
            return _ranged_replay(p)
        if p["kind"] == "combine":  # the CTA or the warp form (called alike)
            assert params == params_for("combine", p["dtype"], warps=p.get("form") == "warps")
            return combine_splits

        def partial(*args):
            assert args[0].dtype == getattr(torch, p["dtype"]) and len(args) == 15
            fp8 = p.get("fp8", False)
            assert (args[4] is not None) == fp8 and (args[2].dtype == torch.uint8) == fp8
            calls.append((p, args[9:12], args[12] is not None))
            kw = {"heads": p["heads"], "qtokens": p.get("qtokens", 1)}
            if p.get("gather", False):
                kw["gather"] = True
            if p.get("direct", False):
                assert args[7].dtype == args[0].dtype and args[8].dtype == torch.float32
                assert not p.get("ostore", False) or mla_launch._wide_rows(args[7])
                if p.get("tma", False):
                    seesaw_partial(*args, **kw, direct=True)
                else:
                    _partial(*args, **kw, direct=True)
            elif p.get("tma", False):
                seesaw_partial(*args, **kw)
            else:
                _partial(*args, **kw)

        return partial

    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    yield calls
    mla_launch._plans.clear()


def _problem(b, hq, page_size, lens, s_q=1, combined=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(-(-n // page_size) for n in lens))
    pages = b * max_pages + 3
    if combined:
        ckv, kpe = torch.randn(pages, page_size, 1, LATENT + 64, generator=g).to(dtype), None
    else:
        ckv = torch.randn(pages, page_size, LATENT, generator=g).to(dtype)
        kpe = torch.randn(pages, page_size, 64, generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: b * max_pages].view(b, max_pages).int()
    for i, n in enumerate(lens):  # the slots past each sequence: stale (NaN: never read as keys)
        for j in range(max_pages):
            stale = slice(max(n - j * page_size, 0), page_size)
            ckv[table[i, j], stale] = float("nan")
            if kpe is not None:
                kpe[table[i, j], stale] = float("nan")
    qn = torch.randn(b, s_q, hq, LATENT, generator=g).to(dtype)
    qp = torch.randn(b, s_q, hq, 64, generator=g).to(dtype)
    return qn, qp, ckv, kpe, table, torch.tensor(lens, dtype=torch.int32)


def _assert_close(out, lse, want, want_lse, atol=2e-2):
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert float((out.float() - want).abs().max()) < atol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4


@pytest.mark.parametrize(
    ("b", "hq", "page_size", "lens", "s_q", "combined", "dtype"),
    [
        (3, 16, 64, [37, 0, 100], 1, True, torch.bfloat16),
        (2, 16, 1, [1, 70], 1, False, torch.float16),
        (1, 16, 16, [300], 1, False, torch.bfloat16),
        (2, 128, 16, [65, 200], 1, True, torch.bfloat16),
        (2, 24, 16, [40, 3], 1, False, torch.float16),
        (3, 16, 16, [40, 1, 130], 2, False, torch.bfloat16),
        (2, 16, 64, [4, 300], 4, True, torch.float16),
        (2, 32, 16, [3, 90], 3, False, torch.bfloat16),
    ],
)
def test_decode_matches_the_reference(cpu_kernels, b, hq, page_size, lens, s_q, combined, dtype):
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, page_size, lens, s_q, combined, dtype)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    assert out.dtype == dtype and lse.is_contiguous()
    _assert_close(out, lse, want, want_lse)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    params, (scale_log2, per, ps), packed = cpu_kernels[-1]
    qtokens = next(t for t in QTOKENS if t >= s_q)
    assert params.get("qtokens", 1) == qtokens and packed == (s_q > 1)
    assert params["heads"] == heads_per_cta(hq, qtokens) and ps == page_size
    assert abs(scale_log2 - SCALE * math.log2(math.e)) < 1e-9
    max_tokens = table.shape[1] * page_size
    seesaw = page_size % TILE == 0 or page_size == 1  # page 1: the seesaw's gather form
    plan = tile_split_plan if seesaw else split_plan
    assert params.get("tma", False) == seesaw and params.get("gather", False) == (page_size == 1)
    per_plan = plan(b, hq // params["heads"], max_tokens, 132, 1)[1]
    assert per == (per_plan if params.get("direct") else min(per_plan, MIN_TOKENS_PER_SPLIT))


@pytest.mark.parametrize(("page_size", "s_q"), [(64, 1), (16, 1), (64, 2)])
def test_a_wide_table_spreads_each_sequence_over_the_splits(cpu_kernels, page_size, s_q):
    """A table sized for a long context (65536 tokens) around short sequences (a serving
    engine's captured graph): the plan's splits come from the width, the pass spreads each
    unit's own keys over them in whole tiles (at least MIN_TOKENS_PER_SPLIT a split), so the
    1300-key sequence takes 6 splits, not one of the width's thousands of keys."""
    b, hq, lens = 3, 16, [700, 0, 1300]
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, page_size, lens, s_q)
    wide = table[:, :1].expand(b, 65536 // page_size).contiguous()
    wide[:, : table.shape[1]] = table
    out, lse = op.mla_decode(qn, qp, ckv, kpe, wide, seq, softmax_scale=SCALE, return_lse=True)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    _assert_close(out, lse, want, want_lse)
    params, (_, per, _), _ = cpu_kernels[-1]
    plan = tile_split_plan if page_size % TILE == 0 else split_plan
    splits, per_plan = plan(b, hq // params["heads"], 65536, 132, 1)
    assert not params.get("direct") and per == MIN_TOKENS_PER_SPLIT < per_plan
    keys = -(-1300 // splits)
    share = max(per, -(-keys // TILE) * TILE)
    assert -(-1300 // share) == -(-1300 // MIN_TOKENS_PER_SPLIT)


def _fp8_cache(pages, page_size, gen, *, padded=False, as_bytes=False):
    """FlashMLA's FP8 cache of random latent rows (each 128-column tile scaled by 2^-6 .. 2^3,
    one tile of zeros) and RoPE rows; padded: each page one row longer in memory (a slice, as
    FlashMLA's tests build it); as_bytes: the uint8 view."""
    ckv = torch.randn(pages, page_size, 4, 128, generator=gen)
    ckv *= torch.exp2(torch.randint(-6, 4, (pages, page_size, 4, 1), generator=gen).float())
    ckv[0, 0, 1] = 0.0
    kpe = torch.randn(pages, page_size, 64, generator=gen).bfloat16()
    packed = quantize_flashmla_fp8(ckv.flatten(-2).bfloat16(), kpe)
    if padded:
        wide = torch.zeros(pages, page_size + 1, 1, FP8_ROW_BYTES, dtype=packed.dtype)
        wide[:, :page_size] = packed
        packed = wide[:, :page_size]
    return packed.view(torch.uint8) if as_bytes else packed


def _fp8_problem(b, hq, page_size, lens, s_q=1, seed=0, **form):
    """(q_nope, q_pe, FP8 cache, page_table, seqlens_k), bf16 queries."""
    qn, qp, _, _, table, seq = _problem(b, hq, page_size, lens, s_q, seed=seed)
    pages = b * table.shape[1] + 3
    return qn, qp, _fp8_cache(pages, page_size, torch.Generator().manual_seed(seed + 1), **form), (
        table), seq  # fmt: skip


def _assert_close_fp8(out, lse, want, want_lse):
    """`_assert_close` with the bf16 rounding of latents up to 2^3 x 448 (2^-8 of the largest)."""
    _assert_close(out, lse, want, want_lse, atol=2e-2 + float(want.abs().max()) * 2**-8)


def _fp8_reference(qn, qp, packed, table, seq, cu=None, causal=True):
    """reference.mla on the FP8 cache's views: the latent e4m3 x its tile scales, in fp32."""
    q8, scale, rope = flashmla_fp8_views(packed)
    if cu is None:
        return mla_decode_ref(qn, qp, q8, rope, table, seq, SCALE, causal=causal, ckv_scale=scale)
    return mla_prefill_ref(qn, qp, q8, rope, table, seq, cu, SCALE, causal, ckv_scale=scale)


@pytest.mark.parametrize(
    ("b", "hq", "page_size", "lens", "s_q", "form"),
    [
        (3, 16, 64, [37, 0, 100], 1, {}),
        (2, 16, 1, [1, 70], 1, {"as_bytes": True}),
        (1, 16, 16, [300], 1, {"padded": True}),
        (2, 128, 16, [65, 200], 1, {}),
        (2, 24, 16, [40, 3], 1, {"as_bytes": True, "padded": True}),
        (3, 16, 16, [40, 1, 130], 2, {}),
        (2, 16, 64, [4, 300], 4, {"padded": True}),
        (2, 32, 16, [3, 90], 3, {}),
    ],
)
def test_fp8_decode_matches_the_reference(cpu_kernels, b, hq, page_size, lens, s_q, form):
    """FlashMLA's FP8 cache (e4m3 or bytes, pages packed or padded), decode and MTP: the fp8
    compile of the partial pass, its views of the cache, against the reference's dequantized
    (fp32) latent."""
    qn, qp, packed, table, seq = _fp8_problem(b, hq, page_size, lens, s_q, **form)
    out, lse = op.mla_decode(qn, qp, packed, None, table, seq, softmax_scale=SCALE,
                             return_lse=True)  # fmt: skip
    want, want_lse = _fp8_reference(qn, qp, packed, table, seq)
    assert out.dtype == torch.bfloat16
    _assert_close_fp8(out, lse, want, want_lse)
    params, _, packed_form = cpu_kernels[-1]
    assert params["fp8"] and params["dtype"] == "bfloat16" and packed_form == (s_q > 1)


def test_fp8_latent_reads_as_the_kernel_stores_it(cpu_kernels):
    """One key per sequence: out is that key's latent (softmax 1), the dequantized bf16 row
    exactly, and equal to e4m3 x scale."""
    qn, qp, packed, table, seq = _fp8_problem(4, 16, 16, [1, 1, 1, 1])
    out = op.mla_decode(qn, qp, packed, None, table, seq, softmax_scale=SCALE)
    q8, scale, _ = flashmla_fp8_views(packed)
    rows = table[:, 0].long()
    exact = (q8[rows, 0].float() * scale[rows, 0].repeat_interleave(128, -1)).bfloat16()
    assert torch.equal(out[:, 0], exact[:, None].expand(-1, 16, -1))
    assert torch.equal(_dequantize_rows(q8[rows, 0], scale[rows, 0]), exact)


@pytest.mark.parametrize("causal", [True, False])
def test_fp8_packed_and_prefill(cpu_kernels, causal):
    """The packed form (<= 4 tokens) and mla_prefill (blocks of query tokens per CTA) over the
    FP8 cache."""
    k_lens = [40, 300, 10, 90]
    _, _, packed, table, seq = _fp8_problem(4, 16, 64, k_lens, seed=8)
    g = torch.Generator().manual_seed(9)
    for q_lens, run in (([1, 3, 0, 2], op.mla_decode), ([9, 33, 0, 5], op.mla_prefill)):
        cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        qn = torch.randn(int(cu[-1]), 16, LATENT, generator=g).bfloat16()
        qp = torch.randn(int(cu[-1]), 16, 64, generator=g).bfloat16()
        packed_args = (cu, max(q_lens)) if run is op.mla_prefill else ()
        kwargs = {} if packed_args else {"cu_seqlens_q": cu, "max_seqlen_q": max(q_lens)}
        out, lse = run(qn, qp, packed, None, table, seq, *packed_args, softmax_scale=SCALE,
                       causal=causal, return_lse=True, **kwargs)  # fmt: skip
        _assert_close_fp8(out, lse, *_fp8_reference(qn, qp, packed, table, seq, cu, causal))
        params, _, packed_form = cpu_kernels[-1]
        assert params["fp8"] and packed_form


def test_mtp_without_causal_mask(cpu_kernels):
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [2, 50, 1], s_q=2)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, causal=False,
                             return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, causal=False)
    _assert_close(out, lse, want, want_lse)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("q_lens", "k_lens"), [([1, 3, 0, 2], [40, 3, 10, 0]), ([4, 4], [4, 130]),
                                                ([1, 0, 1], [17, 5, 0])])  # fmt: skip
def test_packed_form(cpu_kernels, causal, q_lens, k_lens):
    """cu_seqlens_q: q (total_q, H, *), LSE (H, total_q); max_seqlen_q 1 still runs the packed
    kernel (a sequence may bring no token)."""
    b = len(q_lens)
    _, _, ckv, kpe, table, seq = _problem(b, 16, 16, k_lens)
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qn = torch.randn(int(cu[-1]), 16, LATENT, generator=g).to(torch.bfloat16)
    qp = torch.randn(int(cu[-1]), 16, 64, generator=g).to(torch.bfloat16)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, cu_seqlens_q=cu,
                             max_seqlen_q=max(q_lens), causal=causal,
                             return_lse=True)  # fmt: skip
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
    _assert_close(out, lse, want, want_lse)
    params, _, packed = cpu_kernels[-1]
    assert packed and params["qtokens"] == next(t for t in QTOKENS if t >= max(2, max(q_lens)))


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    ("hq", "q_lens", "k_lens"),
    [(16, [9, 1, 0, 13], [40, 3, 10, 13]), (128, [6, 2], [70, 2]), (32, [5, 7], [4, 150])],
)
@pytest.mark.parametrize("page_size", [16, 64])  # decode.py's pass, the seesaw pass's model
def test_prefill(cpu_kernels, causal, hq, q_lens, k_lens, page_size):
    """mla_prefill: more than 4 query tokens per sequence, in blocks of query tokens per CTA
    (the block count from max_seqlen_q; blocks past a sequence's tokens write nothing); more
    queries than keys (sq > sk) see none of the first ones' keys under the causal mask."""
    b = len(q_lens)
    _, _, ckv, kpe, table, seq = _problem(b, hq, page_size, k_lens)
    g = torch.Generator().manual_seed(5)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qn = torch.randn(int(cu[-1]), hq, LATENT, generator=g).to(torch.bfloat16)
    qp = torch.randn(int(cu[-1]), hq, 64, generator=g).to(torch.bfloat16)
    out = torch.full_like(qn, float("nan"))
    got, lse = op.mla_prefill(qn, qp, ckv, kpe, table, seq, cu, max(q_lens), softmax_scale=SCALE,
                              causal=causal, return_lse=True, out=out)  # fmt: skip
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
    assert got is out
    _assert_close(out, lse, want, want_lse)
    params, _, packed = cpu_kernels[-1]
    rows = params["heads"] * params["qtokens"]
    assert packed and rows == min(64, hq * 4) and params["qtokens"] in QTOKENS
    assert params.get("tma", False) == (page_size % TILE == 0)


def test_prefill_wants_the_packed_form(cpu_kernels):
    qn, qp, ckv, kpe, table, seq = _problem(2, 16, 16, [5, 9], s_q=1)
    with pytest.raises(ValueError, match="packed form"):
        op.mla_prefill(qn[:, 0], qp[:, 0], ckv, kpe, table, seq, None, None, softmax_scale=SCALE)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    qn, qp = qn.new_zeros(8, 16, LATENT), qp.new_zeros(8, 16, 64)
    with pytest.raises(ValueError, match="mla_prefill takes more"):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, cu_seqlens_q=cu,
                      max_seqlen_q=5)  # fmt: skip


def test_softmax_scale_positional_as_the_issue_writes_it(cpu_kernels):
    """Issue 19's call: softmax_scale the argument after seqlens_k (mla_prefill: after
    max_seqlen_q); the keyword form gives the same numbers, and both forms the reference's."""
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [7, 1, 41], s_q=2)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, SCALE, return_lse=True)
    kw_out, kw_lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                   return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    _assert_close(out, lse, want, want_lse)
    assert torch.equal(out, kw_out) and torch.equal(lse, kw_lse)
    cu = torch.tensor([0, 5, 6, 13], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    qn = torch.randn(13, 16, LATENT, generator=g).to(torch.bfloat16)
    qp = torch.randn(13, 16, 64, generator=g).to(torch.bfloat16)
    out, lse = op.mla_prefill(qn, qp, ckv, kpe, table, seq, cu, 7, SCALE, return_lse=True)
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, True)
    _assert_close(out, lse, want, want_lse)
    with pytest.raises(TypeError, match="softmax_scale"):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, SCALE, softmax_scale=SCALE)


@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_bench_prefill_adapter(cpu_kernels, page_size):
    """FlashInfer-Bench's causal MLA prefill definition's inputs as they are: against
    reference.mla's run of them, and the definition's own reference by its criterion."""
    name = f"mla_paged_prefill_causal_h16_ckv512_kpe64_ps{page_size}"
    _, _, ckv, kpe, table, seq = _problem(3, 16, page_size, [9, 70, 5], seed=6)
    indptr, indices, last = page_table_to_csr(table, seq, page_size)
    q_lens = [9, 6, 0]
    qo = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    g = torch.Generator().manual_seed(7)
    inputs = {
        "q_nope": torch.randn(int(qo[-1]), 16, LATENT, generator=g).to(torch.bfloat16),
        "q_pe": torch.randn(int(qo[-1]), 16, 64, generator=g).to(torch.bfloat16),
        "ckv_cache": ckv, "kpe_cache": kpe, "qo_indptr": qo, "kv_indptr": indptr,
        "kv_indices": indices, "sm_scale": 1 / math.sqrt(192),
    }  # fmt: skip
    if page_size > 1:
        inputs["kv_last_page_len"] = last
    out, lse = op.mla_paged_prefill_flashinfer(**inputs)
    want, want_lse = mla_flashinfer_prefill(**inputs)
    _assert_close(out, lse, want, want_lse)
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    defs.check_inputs(defn, inputs)
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(lse, theirs_lse) == 0
    ours_out, ours_lse = defs.run_kernel(defn, inputs)  # by op_type: the same adapter
    assert torch.equal(ours_out, out) and torch.equal(ours_lse, lse)


@pytest.mark.parametrize("s_q", [1, 2])
def test_out_is_written_in_place(cpu_kernels, s_q):
    """A NaN-poisoned out is the result, every element written; an out whose rows are not
    contiguous (or whose (batch, s_q) cannot be one dim) gets the result copied in."""
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [5, 0, 70], s_q=s_q, combined=True)
    want, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    out = torch.full_like(qn, float("nan"))
    got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out)
    assert got is out and float((out.float() - want).abs().max()) < 2e-2
    strided = torch.full((3, 16, s_q, LATENT * 2), float("nan"), dtype=qn.dtype)
    for view in (strided.transpose(1, 2)[..., :LATENT], strided.transpose(1, 2)[..., ::2]):
        got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=view)
        assert got is view and float((view.float() - want).abs().max()) < 2e-2


@pytest.mark.parametrize("s_q", [1, 2, "packed"])
def test_lse_is_written_in_place(cpu_kernels, s_q):
    """A NaN-poisoned lse= is the returned LSE, every element written; a strided one (a
    column of a wider tensor) gets the result copied in."""
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [5, 0, 70], s_q=2 if s_q == 2 else 1)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    kw = {}
    if s_q == "packed":  # one token per sequence: (H, total_q)
        qn, qp, want = qn[:, 0], qp[:, 0], want[:, 0]
        want_lse = want_lse[..., 0].t()
        kw = {"cu_seqlens_q": torch.tensor([0, 1, 2, 3], dtype=torch.int32), "max_seqlen_q": 1}
    lse = torch.full_like(want_lse, float("nan"))
    out, got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, lse=lse,
                             return_lse=True, **kw)  # fmt: skip
    assert got is lse
    _assert_close(out, lse, want, want_lse)
    wide = torch.full((*want_lse.shape, 2), float("nan"))
    out, got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                             lse=wide[..., 1], return_lse=True, **kw)  # fmt: skip
    assert got.data_ptr() == wide[..., 1].data_ptr() and torch.isnan(wide[..., 0]).all()
    _assert_close(out, wide[..., 1], want, want_lse)


@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_bench_adapter(cpu_kernels, page_size):
    """FlashInfer-Bench's decode definition's inputs as they are: against reference.mla's run
    of them, and the definition's own reference by its benchmark's criterion."""
    name = f"mla_paged_decode_h16_ckv512_kpe64_ps{page_size}"
    _, _, ckv, kpe, table, seq = _problem(4, 16, page_size, [1, 0, 300, 65], seed=2)
    indptr, indices, last = page_table_to_csr(table, seq, page_size)
    g = torch.Generator().manual_seed(4)
    inputs = {
        "q_nope": torch.randn(4, 16, LATENT, generator=g).to(torch.bfloat16),
        "q_pe": torch.randn(4, 16, 64, generator=g).to(torch.bfloat16),
        "ckv_cache": ckv, "kpe_cache": kpe, "kv_indptr": indptr, "kv_indices": indices,
        "sm_scale": 1 / math.sqrt(192),
    }  # fmt: skip
    if page_size > 1:
        inputs["kv_last_page_len"] = last
    out, lse = op.mla_paged_decode_flashinfer(**inputs)
    want, want_lse = mla_flashinfer_decode(**inputs)
    _assert_close(out, lse, want, want_lse)
    # a wider table (another split plan): the same result up to rounding
    _assert_close(*op.mla_paged_decode_flashinfer(**inputs, max_pages=table.shape[1] + 9), want,
                  want_lse)  # fmt: skip
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    defs.check_inputs(defn, inputs)
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(lse, theirs_lse) == 0
    ours_out, ours_lse = defs.run_kernel(defn, inputs)  # by op_type: the same adapter
    assert torch.equal(ours_out, out) and torch.equal(ours_lse, lse)


def test_flashinfer_adapter_with_no_pages(cpu_kernels):
    _, _, ckv, kpe, _, _ = _problem(2, 16, 64, [1])
    q = torch.randn(2, 16, LATENT).bfloat16()
    empty = torch.zeros(0, dtype=torch.int32)
    out, lse = op.mla_paged_decode_flashinfer(q, q[..., :64], ckv, kpe, torch.zeros(3).int(),
                                              empty, 0.1, torch.zeros(2).int())  # fmt: skip
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# ---------------------------------------------------------------- arguments


def _args(**change):
    bf = torch.bfloat16
    args = {
        "q_nope": torch.randn(2, 1, 16, LATENT).to(bf),
        "q_pe": torch.randn(2, 1, 16, 64).to(bf),
        "ckv_cache": torch.randn(10, 16, LATENT).to(bf),
        "kpe_cache": torch.randn(10, 16, 64).to(bf),
        "page_table": torch.zeros(2, 4, dtype=torch.int32),
        "seqlens_k": torch.ones(2, dtype=torch.int32),
    }
    kwargs = {"softmax_scale": SCALE}
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    return args, kwargs


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"q_nope": torch.zeros(2, 1, 16, 256, dtype=torch.bfloat16)}, ValueError, "D = 512"),
        ({"q_nope": torch.zeros(2, 16, 512, dtype=torch.bfloat16)}, ValueError, "batch, s_q"),
        ({"q_pe": torch.zeros(2, 1, 16, 64)}, TypeError, "q_pe must have dtype"),
        ({"q_nope": torch.zeros(2, 5, 16, 512, dtype=torch.bfloat16),
          "q_pe": torch.zeros(2, 5, 16, 64, dtype=torch.bfloat16)}, ValueError, "s_q must be"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float16)}, TypeError, "ckv_cache"),
        ({"kpe_cache": torch.zeros(10, 8, 64, dtype=torch.bfloat16)}, ValueError, "kpe_cache"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float8_e4m3fn)}, NotImplementedError,
         "split ckv_cache / kpe_cache are 16-bit only"),
        ({"kpe_cache": torch.zeros(10, 16, 64, dtype=torch.uint8)}, NotImplementedError,
         "16-bit only"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 576, dtype=torch.float8_e4m3fn), "kpe_cache": None},
         NotImplementedError, "per-tensor scale"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 600, dtype=torch.uint8), "kpe_cache": None},
         ValueError, "1, 656"),
        ({"ckv_cache": torch.zeros(10, 64, 656, dtype=torch.uint8), "kpe_cache": None},
         ValueError, "1, 656"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.bfloat16), "kpe_cache": None},
         TypeError, "float8_e4m3fn or uint8"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.float8_e5m2), "kpe_cache": None},
         TypeError, "float8_e4m3fn or uint8"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 664, dtype=torch.uint8)[..., :656],
          "kpe_cache": None}, ValueError, "multiples of 16 bytes"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 1312, dtype=torch.uint8)[..., ::2],
          "kpe_cache": None}, ValueError, "contiguous"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 672, dtype=torch.uint8)[..., 8:664],
          "kpe_cache": None}, ValueError, "storage offset 8"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.uint8), "kpe_cache": None,
          "q_nope": torch.zeros(2, 1, 16, 512, dtype=torch.float16),
          "q_pe": torch.zeros(2, 1, 16, 64, dtype=torch.float16)}, TypeError, "bf16 queries"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 512, dtype=torch.bfloat16), "kpe_cache": None},
         ValueError, "combined"),
        ({"page_table": torch.zeros(2, 4, dtype=torch.int64)}, TypeError, "page_table must"),
        ({"page_table": torch.zeros(3, 4, dtype=torch.int32)}, ValueError, "batch of 2"),
        ({"seqlens_k": torch.zeros(3, dtype=torch.int32)}, ValueError, "seqlens_k must"),
        ({"cu_seqlens_q": torch.zeros(3, dtype=torch.int32)}, ValueError, "come together"),
        ({"softmax_scale": None}, TypeError, "no default"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ({"out": torch.zeros(2, 1, 16, 512)}, TypeError, "out must have dtype"),
        ({"lse": torch.zeros(2, 16, 1, dtype=torch.bfloat16)}, TypeError, "lse must have dtype"),
        ({"lse": torch.zeros(2, 1, 16)}, ValueError, r"lse must have shape \(2, 16, 1\)"),
        # the 2026-12-05 audit: causal was read by truthiness, int() took 2.5 as 2
        ({"causal": "no"}, TypeError, "causal must be a bool"),
        ({"q_nope": torch.zeros(3, 16, 512).bfloat16(), "q_pe": torch.zeros(3, 16, 64).bfloat16(),
          "cu_seqlens_q": torch.tensor([0, 1, 3], dtype=torch.int32), "max_seqlen_q": 2.5},
         TypeError, "max_seqlen_q must be an int"),
    ],
)  # fmt: skip
def test_bad_arguments(monkeypatch, change, err, match):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    args, kwargs = _args(**change)
    with pytest.raises(err, match=match):
        op.mla_decode(*args.values(), **kwargs)


def test_packed_limits_and_cache_rows(monkeypatch):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    cu = torch.tensor([0, 5, 6], dtype=torch.int32)
    q = {"q_nope": torch.zeros(6, 16, 512).bfloat16(), "q_pe": torch.zeros(6, 16, 64).bfloat16()}
    args, kwargs = _args(**q, cu_seqlens_q=cu, max_seqlen_q=5)
    with pytest.raises(ValueError, match="max_seqlen_q must be 1..4"):
        op.mla_decode(*args.values(), **kwargs)
    wide = torch.zeros(10, 16, 65, dtype=torch.bfloat16)
    args, kwargs = _args(kpe_cache=wide[..., 1:])  # rows 2 bytes off 16
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        op.mla_decode(*args.values(), **kwargs)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="CUDA tensor"):
        op.mla_decode(*_args()[0].values(), softmax_scale=SCALE)


# ---------------------------------------------------------------- suite and tracing


def test_suite_is_registered():
    """Registered since its first GPU check passed (2026-12-01)."""
    assert SUITE_MODULES["mla_decode"] == "forgekernel.bench.suites.mla_decode"
    assert "mla_decode" not in PENDING_SUITE_MODULES
    s = mla_decode.suite()
    assert s.sanitize_cases and all(c.name for c in s.bench_cases)
    assert len({c.name for c in s.bench_cases + s.check_cases}) == len(s.bench_cases) + len(
        s.check_cases
    )


def test_suite_work_counts():
    case = mla_decode._case(2, 16, 64, (10, 3), s_q=4)
    # visible pairs: sk 10 -> 7 + 8 + 9 + 10, sk 3 -> 0 + 1 + 2 + 3
    assert mla_decode.flops(case) == 2 * (576 + 512) * 16 * (34 + 6)
    assert mla_decode.nbytes(case, torch.bfloat16) == 13 * 1152 + 8 * 16 * (1088 * 2 + 4)
    fp8 = mla_decode._case(2, 16, 64, (10, 3), cache="fp8")  # 656 bytes a token, bf16 q / out
    assert fp8.name == "b2-h16-p64-L3-10-fp8" and mla_decode.fp8(fp8)
    assert mla_decode.nbytes(fp8, torch.float16) == 13 * 656 + 2 * 16 * (1088 * 2 + 4)


def test_suite_fp8_cases():
    """Group fp8 in the bench; check cases over every form; bf16 queries whatever the dtype,
    the cache FlashMLA's FP8 rows; the dense-as-sparse indices of FlashMLA's comparator."""
    bench = [c for c in mla_decode.BENCH_CASES if mla_decode.fp8(c)]
    assert {c.name for c in bench} == {"b64-h16-p64-L4096-fp8", "b1-h16-p64-L32768-fp8",
                                       "b16-h128-p64-L8192-fp8"}  # fmt: skip
    assert all(c.group == "fp8" for c in bench)
    check = [c for c in mla_decode.CHECK_CASES if mla_decode.fp8(c)]
    assert {c.params["s_q"] for c in check} == {1, 2, 4} and any(
        "q_lens" in c.params for c in check
    )
    assert any(mla_decode.fp8(c) for c in mla_decode.SANITIZE_CASES)
    inputs = mla_decode.make_inputs(check[0], torch.float16, torch.device("cpu"),
                                    torch.Generator().manual_seed(0))  # fmt: skip
    assert inputs["q"].dtype == torch.bfloat16 and inputs["kpe"] is None
    assert inputs["ckv"].dtype == torch.float8_e4m3fn and inputs["ckv"].shape[2:] == (1, 656)
    table = torch.tensor([[3, 1], [0, 2]], dtype=torch.int32)
    idx = mla_decode.dense_indices(table, torch.tensor([20, 3]), 16)
    assert idx.shape == (2, 1, 64) and idx.dtype == torch.int32
    assert idx[0, 0, :20].tolist() == [*range(48, 64), *range(16, 20)]
    assert idx[1, 0, :3].tolist() == [0, 1, 2]
    assert torch.all(idx[0, 0, 20:] == -1) and torch.all(idx[1, 0, 3:] == -1)


@pytest.mark.parametrize("case", mla_decode.CHECK_CASES, ids=lambda c: c.name)
def test_suite_check_passes_on_the_algorithm(cpu_kernels, case):
    """The suite's own check (`bench.check.verify`: NaN-poisoned outputs, 2x the
    rounding yardstick + atol, -inf LSEs reproduced) with the kernels' algorithm standing in."""
    suite = mla_decode.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


# launch.plan_form: the bench's launcher-only candidates (suite CANDIDATES) on the replay: the
# plan it fixes (tiles per split: keys per split and the direct form at one split; heads per CTA)
# and the numbers against the reference
@pytest.mark.parametrize(
    ("hq", "lens", "s_q", "form", "heads", "per", "direct"),
    [
        (16, [37, 0, 100, 1000], 1, {"per_tiles": 2}, 16, 128, False),  # 16 tiles: 8 splits
        (16, [37, 0, 100, 1000], 1, {"per_tiles": 5}, 16, 320, False),  # 4 splits, last short
        (16, [37, 0, 100, 1000], 1, {"per_tiles": 32}, 16, 1024, True),  # one split: direct
        (128, [65, 513], 1, {"heads": 32}, 32, None, None),
        (128, [65, 513], 1, {"per_tiles": 3, "heads": 16}, 16, 192, False),
        (128, [70, 190], 2, {"per_tiles": 1}, 32, 64, False),
    ],
)
def test_plan_form_runs_the_candidate_plan(cpu_kernels, hq, lens, s_q, form, heads, per, direct):
    qn, qp, ckv, kpe, table, seq = _problem(len(lens), hq, 64, lens, s_q, combined=True)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    with mla_launch.plan_form(**form):
        out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 return_lse=True)  # fmt: skip
    _assert_close(out, lse, want, want_lse)
    params, (_, got_per, _), _ = cpu_kernels[-1]
    assert params["heads"] == heads and params["tma"]
    if per is not None:
        assert got_per == per and params.get("direct", False) == direct
    # keyed apart: the same problem outside the form takes the standard plan again
    op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE)
    standard = cpu_kernels[-1][0]
    assert standard["heads"] == heads_per_cta(hq, cpu_kernels[-1][0].get("qtokens", 1))


def test_plan_form_rejects_blocks_that_do_not_fit(cpu_kernels):
    qn, qp, ckv, kpe, table, seq = _problem(2, 16, 64, [65, 513], combined=True)
    with pytest.raises(ValueError, match="heads must be one of"):
        with mla_launch.plan_form(heads=3):
            pass
    with pytest.raises(ValueError, match="per_tiles"):
        with mla_launch.plan_form(per_tiles=0):
            pass
    with pytest.raises(ValueError, match="not a block"):
        with mla_launch.plan_form(heads=32):  # more heads than the 16 there are
            op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE)


def test_suite_candidates_are_bench_cases():
    """CANDIDATES, PLAIN_CASES (the `plain` variant: the call without the step's schedule) and
    NO_PDL_CASES (the variant `no_pdl`, tests/test_pdl.py) name bench cases of the seesaw pass
    (16-bit, page 64); GATHER_CASES (the variant `was`: decode.py's pass, the plan before the
    gather form's adoption) the 16-bit page-1 cases; every other case has no variant (the `pair`
    one and `gather_unfenced` are gone)."""
    names = {c.name: c for c in mla_decode.BENCH_CASES}
    assert set(mla_decode.CANDIDATES) | set(mla_decode.PLAIN_CASES) <= set(names)
    assert set(mla_decode.NO_PDL_CASES) | set(mla_decode.COMBINE_CASES) <= set(names)
    assert set(mla_decode.GATHER_CASES) <= set(names)
    for name, case in names.items():
        got = set(mla_decode.variants(case))
        plain = {"plain"} if name in mla_decode.PLAIN_CASES else set()
        no_pdl = {"no_pdl"} if name in mla_decode.NO_PDL_CASES else set()
        cta = {"combine_warps"} if name in mla_decode.COMBINE_CASES else set()
        gather = {"was"} if name in mla_decode.GATHER_CASES else set()
        assert got == set(mla_decode.CANDIDATES.get(name, {})) | plain | no_pdl | cta | gather
        if gather:
            assert case.params["page"] == 1 and case.params["cache"] == "split"
        elif got:
            assert case.params["page"] % TILE == 0 and case.params["cache"] == "combined"


def _fake_inputs(s_q=1, packed=False, combined=False, fp8=False):
    """(q_nope, q_pe, ckv, kpe or None, page_table, seqlens_k, cu_seqlens_q or None), CUDA."""
    cuda = {"device": "cuda", "dtype": torch.bfloat16}
    lead = (7,) if packed else (3, s_q)
    qn, qp = torch.empty(*lead, 16, 512, **cuda), torch.empty(*lead, 16, 64, **cuda)
    if fp8:
        ckv = torch.empty(10, 64, 1, FP8_ROW_BYTES, device="cuda", dtype=torch.float8_e4m3fn)
        kpe = None
    elif combined:
        ckv, kpe = torch.empty(10, 64, 1, 576, **cuda), None
    else:
        ckv, kpe = torch.empty(10, 64, 512, **cuda), torch.empty(10, 64, 64, **cuda)
    index = {"device": "cuda", "dtype": torch.int32}
    cu = torch.empty(4, **index) if packed else None
    return qn, qp, ckv, kpe, torch.empty(3, 4, **index), torch.empty(3, **index), cu


def _call(qn, qp, ckv, kpe, table, seq, cu, **kwargs):
    packed = {} if cu is None else {"cu_seqlens_q": cu, "max_seqlen_q": 4}
    return op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, **packed, **kwargs)


@pytest.mark.parametrize(
    ("form", "out_shape", "lse_shape"),
    [({}, (3, 1, 16, 512), (3, 16, 1)), ({"s_q": 3}, (3, 3, 16, 512), (3, 16, 3)),
     ({"packed": True}, (7, 16, 512), (16, 7)), ({"combined": True}, (3, 1, 16, 512), (3, 16, 1)),
     ({"fp8": True}, (3, 1, 16, 512), (3, 16, 1)),
     ({"fp8": True, "packed": True}, (7, 16, 512), (16, 7))],
)  # fmt: skip
def test_fake_implementation_under_make_fx(form, out_shape, lse_shape):
    """torch.compile / CUDA-graph support: on fake CUDA tensors the custom op's fake gives the
    shapes, nothing runs, and make_fx records the op."""
    with FakeTensorMode():
        o, lse = _call(*_fake_inputs(**form), return_lse=True)
        assert o.shape == out_shape and o.dtype == torch.bfloat16
        assert lse.shape == lse_shape and lse.dtype == torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(lambda *x: _call(*x) * 2, tracing_mode="fake")(*_fake_inputs(**form))
    assert "forgekernel.mla_decode" in str(graph.graph)


# ---------------------------------------------------------------- the seesaw diagnosis ladder


def _diag_script():
    from script_modules import load_script

    return load_script("diag_mla_seesaw")


@pytest.mark.parametrize("name", list(_diag_script().CASES))
def test_diag_ladder_on_the_replay(cpu_kernels, name):
    """scripts/diag_mla_seesaw.py's cases run in-process through the real launcher and op with
    the replay in place of the kernels (the seesaw model for `tma` keys): each passes its own
    criterion, takes the route it is meant to (the seesaw pass but for the control case) and
    the split counts it is meant to exercise (one split but for the split cases)."""
    diag = _diag_script()
    r = diag.run_one(name, device="cpu")
    assert r["ok"], r
    assert r["route"] == ("roles" if name.startswith("control") else "tma")
    assert [p["kind"] for p, *_ in cpu_kernels] == ["partial"]
    assert (r["splits"] > 1) == (
        name.startswith("split") or name in ("p128-L300", "h128-sq2-p128-L700-nan")
    )


@pytest.mark.parametrize("max_q", [2, 4])
def test_direct_form_packed_into_a_strided_out(cpu_kernels, monkeypatch, max_q):
    """The direct form through the user's cu_seqlens_q: the pass gets the caller's out window
    itself (no copy, no partials) and the op's lse (H, total_q) seen transposed; the window's
    surroundings untouched; causal tokens that see no key 0 / -inf; the split path's O."""
    q_lens, k_lens = [max_q, 0, max_q - 1, 1], [1, 50, 130, 0]
    _, _, ckv, kpe, table, seq = _problem(len(q_lens), 128, 64, k_lens, seed=max_q)
    g = torch.Generator().manual_seed(7)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    rows = int(cu[-1])
    qn = torch.randn(rows, 128, LATENT, generator=g).to(torch.bfloat16)
    qp = torch.randn(rows, 128, 64, generator=g).to(torch.bfloat16)
    buf = torch.full((rows + 1, 144, 640), float("nan"), dtype=torch.bfloat16)
    out = buf[:rows, 8:136, :LATENT]

    def no_partials(*args):
        raise AssertionError("the direct form allocates no partials")

    with monkeypatch.context() as m:
        m.setattr(mla_launch, "_partials", no_partials)
        got, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 cu_seqlens_q=cu, max_seqlen_q=max_q, out=out,
                                 return_lse=True)  # fmt: skip
    assert got is out and [c[0].get("direct", False) for c in cpu_kernels] == [True]
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE)
    _assert_close(out, lse, want, want_lse)
    around = torch.ones_like(buf, dtype=torch.bool)
    around[:rows, 8:136, :LATENT] = False
    assert buf[around].isnan().all()
    none = torch.isneginf(want_lse.t())
    assert none.any() and (out[none] == 0).all() and torch.isneginf(lse.t()[none]).all()
    mla_launch._plans.clear()
    monkeypatch.setenv("FORGEKERNEL_MLA_DIRECT", "0")
    split_out, _ = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE,
                                 cu_seqlens_q=cu, max_seqlen_q=max_q,
                                 return_lse=True)  # fmt: skip
    assert "direct" not in cpu_kernels[-1][0]
    assert torch.equal(out, split_out)
