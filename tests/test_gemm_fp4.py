"""The FP4-weight masked grouped GEMM on a machine without a GPU: the widening (PRMT tables and
sign trick of widen.py) modelled bit for bit in torch against the exact dequantization, the
exponent fold, the consumer's shared-memory reads against the 64B swizzle TMA writes (every
fragment register reads its own four codes; no bank conflicts), the whole tile's arithmetic
(widened e4m3 x folded scales, promoted per k-tile) against the fp64 reference, the pack
helpers, the op's validation, the chooser, and the kernel compiled for sm_90a (no spills)."""

from __future__ import annotations

import pytest
import torch
from sweeps import slow_past  # tests/ is on the path

from forgekernel.kernels.gemm.fp4.sm90 import config
from forgekernel.kernels.gemm.fp4.sm90 import widen as W
from forgekernel.ops.fp4_pack import (
    n_major,
    pack_scale_words,
    quantize_fp4_weights,
    unpack_scale_words,
)
from forgekernel.reference.gemm import E2M1_VALUES, dequantize_fp4, gemm_fp4_masked_ref

U32 = 0xFFFFFFFF


# ---------------------------------------------------------------- bit-level models
def prmt(a: int, b: int, sel: int) -> int:
    """PTX prmt.b32, default mode: result byte i from nibble i of sel (bits 0..2 pick a byte of
    {b, a}, bit 3 replicates that byte's sign)."""
    pool = ((b & U32) << 32) | (a & U32)
    out = 0
    for i in range(4):
        nib = (sel >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        out |= byte << (8 * i)
    return out


def table(e: int, s: int) -> tuple[int, int, int]:
    """widen.py `fold`'s (t0, t1, keep) of a sub-block with exponent e in a k-tile at s, its
    arithmetic (32-bit wrap-around) replayed."""
    base_lo, base_hi = W.TABLE_LO - s * W.STEP_LO, W.TABLE_HI - s * W.STEP_HI
    keep = W.KEEP if e >= s + W.SHIFT_MIN else 0
    return (base_lo + e * W.STEP_LO) & U32, (base_hi + e * W.STEP_HI) & U32, keep


def widen4(codes: int, tab: tuple[int, int, int]) -> int:
    t0, t1, keep = tab
    mag = prmt(t0, t1, codes & keep)
    neg = prmt((codes << 4) & U32, codes, W.SIGN_SELECT)
    return mag | (neg & 0x80808080)


def e4m3(word: int) -> list[float]:
    raw = torch.tensor([(word >> (8 * i)) & 0xFF for i in range(4)], dtype=torch.uint8)
    return raw.view(torch.float8_e4m3fn).float().tolist()


def e2m1(code: int) -> float:
    v = E2M1_VALUES[code & 7]
    return -v if code & 8 else v


@pytest.mark.parametrize("shift", list(range(-12, 7)))
def test_widening_is_exact_for_every_code_and_shift(shift):
    """Every 16-bit pattern of four codes, each shift: the e4m3 bytes are the e2m1 values x
    2^shift exactly (-0 kept as -0), or zero where the shift flushes the sub-block (whatever
    the wrapped-around table holds then)."""
    s = 100
    tab = table(s + shift, s)
    for codes in range(0, 1 << 16, 7):  # every nibble value in every position, 9363 patterns
        # the kernel's 16-bit load sign-extends: the upper half is 0 or all ones
        got = e4m3(widen4(codes | (0xFFFF0000 if codes & 0x8000 else 0), tab))
        for i in range(4):
            code = (codes >> (4 * i)) & 0xF
            want = e2m1(code) * 2.0**shift if shift >= W.SHIFT_MIN else 0.0
            assert got[i] == want, (hex(codes), i, shift)
    assert W.SHIFT_MAX == 6 and 6 * 2.0**W.SHIFT_MAX < 448


def widen8(word: int, tab: tuple[int, int, int]) -> tuple[int, int]:
    """widen.py `widen8` (the converter's): one mask, one shift, both halves."""
    t0, t1, keep = tab
    sel, up = word & keep, (word << 4) & U32
    lo = prmt(t0, t1, sel) | (prmt(up, word, W.SIGN_SELECT) & 0x80808080)
    hi = prmt(t0, t1, sel >> 16) | (prmt(up, word, W.SIGN_SELECT_HI) & 0x80808080)
    return lo, hi


@pytest.mark.parametrize("shift", [-12, -6, -5, -1, 0, 3, 6])
def test_widen8_gives_widen4s_bytes_for_both_halves(shift):
    """The converter's eight-code widening (keep KEEP8 or 0 from `fold(..., eight=True)`)
    equals `widen4` on the word's low and high 16 bits: the standard's e4m3 bytes, so the
    converter form multiplies the same values."""
    s = 100
    t0, t1, keep = table(s + shift, s)
    tab8 = (t0, t1, W.KEEP8 if keep else 0)
    gen = torch.Generator().manual_seed(shift + 20)
    highs = torch.randint(0, 1 << 16, (64,), generator=gen).tolist() + [0, 0x8888, 0xFFFF]
    for low in range(0, 1 << 16, 97):
        for high in highs[low % 7 :: 7]:
            word = (high << 16) | low
            assert widen8(word, tab8) == (widen4(low, (t0, t1, keep)), widen4(high, (t0, t1, keep)))
    assert W.KEEP8 == W.KEEP | W.KEEP << 16 and W.SIGN_SELECT_HI == W.SIGN_SELECT + 0x2222


def fold(word: int) -> tuple[float, list[tuple[int, int, int]], list[int]]:
    exps = [(word >> (8 * i)) & 0xFF for i in range(4)]
    s = max(max(exps) - W.HEADROOM, 1)
    shifts = [e - s for e in exps]
    return 2.0 ** (s - 127), [table(e, s) for e in exps], shifts


def test_fold_scales_times_shifts_are_the_sub_block_scales():
    gen = torch.Generator().manual_seed(1)
    for _ in range(2000):
        top = int(torch.randint(1, 255, (1,), generator=gen))
        exps = [max(0, top - int(torch.randint(0, 14, (1,), generator=gen))) for _ in range(4)]
        exps[int(torch.randint(0, 4, (1,), generator=gen))] = top
        word = sum(e << (8 * i) for i, e in enumerate(exps))
        scale, _, shifts = fold(word)
        for e, d in zip(exps, shifts):
            assert d <= W.SHIFT_MAX
            if d >= W.SHIFT_MIN:  # kept: exact
                assert scale * 2.0**d == 2.0 ** (e - 127)
            else:  # flushed: more than 2^11 below the largest
                assert max(exps) - e > 11


# ---------------------------------------------------------------- shared-memory reads
def swizzle64(offset: int) -> int:
    """TMA's 64B swizzle on byte offsets (Swizzle<2,4,3>): bits 4..5 ^= bits 7..8."""
    return offset ^ (((offset >> 7) & 3) << 4)


def fragment(t: int) -> list[tuple[int, int]]:
    """Consumer thread t (0..255): (row, first K) of each of its 16 A registers per k-tile,
    register j + 4 step: the PTX wgmma 8-bit A fragment (kernel.py's module docstring)."""
    lane = t % 32
    row0 = t // 32 * 16 + lane // 4
    quad = lane % 4
    return [
        (row0 + 8 * (j % 2), 32 * step + 16 * (j // 2) + 4 * quad)
        for step in range(4)
        for j in range(4)
    ]


def word_index(t: int, stage: int) -> list[int]:
    """kernel.py `_issue`'s 16-bit word index of each register (its arithmetic, replayed)."""
    lane = t % 32
    row0 = t // 32 * 16 + lane // 4
    quad = lane % 4
    base = (stage * 128 * 64 + row0 * 64) // 2 + quad
    swz = (row0 >> 1) & 3
    out = []
    for step in range(4):
        chunk = base + ((step ^ swz) << 3)
        for j in range(4):
            out.append(chunk + (j % 2) * (8 * 64 // 2) + (j // 2) * 4)
    return out


def test_each_register_reads_its_own_codes_from_the_swizzled_tile():
    """Packed tile bytes placed where TMA's 64B swizzle puts them; every thread's 16 words are
    the 4 codes of its fragment registers' (row, K .. K + 3)."""
    stages = 3
    tile = torch.randint(0, 256, (stages, 128, 64), dtype=torch.int64)
    smem = torch.zeros(stages * 128 * 64, dtype=torch.int64)
    for s in range(stages):
        for r in range(128):
            for c in range(64):
                smem[s * 8192 + swizzle64(r * 64 + c)] = tile[s, r, c]
    words = smem[0::2] | (smem[1::2] << 8)
    for s in range(stages):
        for t in range(256):
            for (row, k), w in zip(fragment(t), word_index(t, s)):
                want = int(tile[s, row, k // 2]) | (int(tile[s, row, k // 2 + 1]) << 8)
                assert int(words[w]) == want, (s, t, row, k)


def test_fragment_reads_are_free_of_bank_conflicts():
    """Each 16-bit load instruction of a warp touches 32 lanes' words: no two distinct 4-byte
    words in one bank (distinct words per bank = wavefronts)."""
    for warp in range(8):
        per_lane = [word_index(32 * warp + lane, 1) for lane in range(32)]
        for reg in range(16):
            banks: dict[int, set[int]] = {}
            for lane in range(32):
                word32 = per_lane[lane][reg] // 2
                banks.setdefault(word32 % 32, set()).add(word32)
            assert max(len(v) for v in banks.values()) == 1, (warp, reg)


def test_fragment_covers_the_tile_once():
    seen = sorted((row, k + i) for t in range(256) for row, k in fragment(t) for i in range(4))
    assert seen == [(r, k) for r in range(128) for k in range(128)]


# ---------------------------------------------------------------- the tile's arithmetic
def kernel_model(a, sa, packed, words):
    """One expert's tile in the kernel's arithmetic: weights widened to e4m3 through the folded
    tables (values exact in fp32), each k-tile's dot product in fp32, promoted with the row's
    k-tile scale x the token's activation scale. a (T, K) e4m3, sa (T, K/128), packed (N, K/2),
    words (N, K/128). Returns (T, N) fp32."""
    n, half_k = packed.shape
    k_tiles = 2 * half_k // 128
    p = packed.view(torch.uint8).long()
    w8 = torch.zeros(n, 2 * half_k, dtype=torch.float32)
    row_scale = torch.zeros(n, k_tiles, dtype=torch.float32)
    for r in range(n):
        for kt in range(k_tiles):
            scale, tabs, _ = fold(int(words[r, kt]) & U32)
            row_scale[r, kt] = scale
            for step in range(4):
                for q in range(8):  # 8 registers of 4 codes per 32-wide sub-block
                    byte0 = kt * 64 + step * 16 + 2 * q
                    codes = int(p[r, byte0]) | (int(p[r, byte0 + 1]) << 8)
                    k0 = kt * 128 + step * 32 + 4 * q
                    w8[r, k0 : k0 + 4] = torch.tensor(e4m3(widen4(codes, tabs[step])))
    acc = torch.zeros(a.shape[0], n, dtype=torch.float32)
    af = a.float()
    for kt in range(k_tiles):
        ks = slice(128 * kt, 128 * (kt + 1))
        frag = af[:, ks] @ w8[:, ks].t()
        acc += frag * row_scale[:, kt][None, :] * sa[:, kt][:, None]
    return acc


def _inputs(tokens, n, k, seed, spread=False):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen)
    if spread:  # sub-blocks up to 2^14 apart inside a row's k-tile: some flushed
        w = w * torch.exp2(torch.randint(-14, 1, (n, k // 32), generator=gen)).repeat_interleave(
            32, 1
        )
    packed, words = quantize_fp4_weights(w)
    x = torch.randn(tokens, k, generator=gen)
    amax = x.view(tokens, k // 128, 128).abs().amax(-1).clamp_min(1e-4)
    sa = amax / 448
    a = (x / sa.repeat_interleave(128, 1)).to(torch.float8_e4m3fn)
    return a, sa, packed, words


@pytest.mark.parametrize("tokens, n, k", [(3, 128, 128), (8, 256, 384)])
def test_tile_arithmetic_matches_the_fp64_reference(tokens, n, k):
    a, sa, packed, words = _inputs(tokens, n, k, seed=tokens)
    got = kernel_model(a, sa, packed, words)
    ref = gemm_fp4_masked_ref(a[None], packed[None], sa[None], words[None], torch.tensor([tokens]))[
        0
    ]
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-4 * ref.abs().max().item())


def test_flushed_sub_blocks_stay_below_e4m3_rounding():
    """Sub-blocks far below their k-tile's largest are flushed: the error against the exact
    dequantization stays a tiny fraction of the result's scale."""
    a, sa, packed, words = _inputs(4, 128, 256, seed=7, spread=True)
    exps = unpack_scale_words(words).log2().view(128, 2, 4)
    assert ((exps.amax(-1, keepdim=True) - exps) > 11).any()  # the case flushes something
    got = kernel_model(a, sa, packed, words)
    ref = gemm_fp4_masked_ref(a[None], packed[None], sa[None], words[None], torch.tensor([4]))[0]
    assert (got - ref).abs().max() <= 2**-10 * ref.abs().max()


# ---------------------------------------------------------------- pack helpers, reference
def test_quantize_round_trip_and_formats():
    gen = torch.Generator().manual_seed(3)
    w = torch.randn(2, 128, 256, generator=gen)
    packed, words = quantize_fp4_weights(w)
    assert packed.dtype == torch.int8 and packed.shape == (2, 128, 128)
    assert words.dtype == torch.int32 and words.shape == (2, 128, 2) and words.stride(1) == 1
    scales = unpack_scale_words(words)
    assert torch.equal(pack_scale_words(scales), words)
    deq = dequantize_fp4(packed, words)
    assert torch.equal(deq, dequantize_fp4(packed, scales))
    # within half an e2m1 step of the largest magnitude's scale: |err| <= 1 x scale
    err = (deq - w.double()).abs().view(2, 128, 8, 32)
    assert (err <= scales.double().view(2, 128, 8, 1) + 1e-12).all()
    assert (scales.log2() == scales.log2().round()).all()


def test_dequantize_nibble_order_and_codes():
    """The even K element in the low nibble; codes 0..15 with sign bit 3 (DeepGEMM's test: a
    row 0x21, 0x43 at scale 1 is 0.5, 1, 1.5, 2)."""
    packed = torch.tensor([[0x21, 0x43, 0xA9 - 256, 0x0F]], dtype=torch.int8)
    packed = torch.cat([packed, torch.zeros(1, 60, dtype=torch.int8)], 1)
    one = torch.tensor([[127 | 127 << 8 | 127 << 16 | 127 << 24]], dtype=torch.int32)
    got = dequantize_fp4(packed, one)[0, :8].tolist()
    assert got == [0.5, 1.0, 1.5, 2.0, -0.5, -1.0, -6.0, 0.0]


def test_n_major_words_in_place_or_copied():
    words = torch.randint(0, 2**31, (2, 256, 3), dtype=torch.int32)
    nm = n_major(words)
    assert torch.equal(nm, words) and nm.stride(1) == 1
    assert n_major(nm).data_ptr() == nm.data_ptr()


@pytest.mark.parametrize(
    ("w", "error", "match"),
    [
        (torch.zeros(128, 128, dtype=torch.int32), TypeError, "w must be a floating tensor"),
        (torch.zeros(128), TypeError, r"w must be a floating tensor \(\.\.\., N, K\)"),
        ([[0.0] * 128], TypeError, "got list"),
        (torch.zeros(4, 100), ValueError, "K must be a multiple of 128"),
    ],
)
def test_quantize_names_bad_weights(w, error, match):
    """The 2026-12-05 audit: integer weights were quantized as they were, a 1-D one failed in
    the shape unpacking."""
    with pytest.raises(error, match=match):
        quantize_fp4_weights(w)


def test_word_readers_take_n_major_words_at_k128():
    """K = 128: one word per row, and N-major words (the kernel's layout, the suites' inputs:
    an (E, K/128, N) buffer transposed) have stride N on their size-1 K/128 dim, which
    `.contiguous()` keeps; the reference and the unpacker read them as the K-major ones."""
    packed, words = quantize_fp4_weights(torch.randn(2, 128, 128))
    nm = torch.empty(2, 1, 128, dtype=torch.int32).transpose(1, 2).copy_(words)
    assert nm.stride(-1) == 128 and nm.is_contiguous()
    assert torch.equal(unpack_scale_words(nm), unpack_scale_words(words.contiguous()))
    assert torch.equal(dequantize_fp4(packed, nm), dequantize_fp4(packed, words.contiguous()))


# ---------------------------------------------------------------- op validation, chooser
def _op_args(e=2, m=8, n=128, k=256):
    a = torch.randn(e, m, k).to(torch.float8_e4m3fn)
    b, words = quantize_fp4_weights(torch.randn(e, n, k))
    sa = torch.rand(e, m, k // 128)
    return a, b, sa, words, torch.full((e,), m, dtype=torch.int32)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda x: {**x, "b": x["b"].float()}, TypeError, "b"),
        (lambda x: {**x, "b": x["b"][:, :, :64]}, ValueError, "K mismatch"),
        (lambda x: {**x, "b": x["b"][:, :64]}, ValueError, "N must be"),
        (lambda x: {**x, "scale_b": x["scale_b"].float()}, ValueError, "scale_b"),
        (lambda x: {**x, "scale_b": x["scale_b"].long()}, TypeError, "UE8M0"),
        (lambda x: {**x, "scale_a": x["scale_a"][:, :, :1]}, ValueError, "scale_a"),
        (lambda x: {**x, "masked_m": x["masked_m"].long()}, TypeError, "masked_m"),
        (lambda x: {**x, "expected_m": 0}, TypeError, "expected_m"),
        (lambda x: x, ValueError, "CUDA"),
    ],
)
def test_op_rejects_bad_inputs(change, error, match):
    from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked

    a, b, sa, words, counts = _op_args()
    args = {"a": a, "b": b, "scale_a": sa, "scale_b": words, "masked_m": counts, "expected_m": 8}
    with pytest.raises(error, match=match):
        gemm_fp4_grouped_masked(**change(args))


def test_op_takes_fp32_scales_of_the_right_shape():
    """fp32 (E, N, K/32) scales pass validation (then only the device is missing)."""
    from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked

    a, b, sa, words, counts = _op_args()
    with pytest.raises(ValueError, match="CUDA"):
        gemm_fp4_grouped_masked(a, b, sa, unpack_scale_words(words), counts, 8)


def test_chooser_and_stages():
    assert [config.choose_tokens(m) for m in (1, 4, 5, 8, 9, 16, 17, 33, 64, 65, 300)] == [
        8, 8, 16, 16, 32, 32, 32, 64, 64, 64, 64,
    ]  # fmt: skip
    for h in config.TOKENS:
        assert config.choose_tokens(config.expected_for(h)) == h
    for h in config.TOKENS:
        assert config.stage_bytes(h) == 8192 + 512 + 128 * h
    with pytest.raises(ValueError):
        config.params_for("bfloat16", 128)
    with pytest.raises(ValueError):
        config.params_for("bfloat16", 64, contiguous=True)
    assert config.choose_tokens(65, contiguous=True) == 32


# ---------------------------------------------------------------- the compiled kernel
# the compiles below: CI builds each test's first configuration, the others are slow
@pytest.mark.parametrize("tokens", slow_past([8, 64]))
def test_kernel_compiles_for_sm90a_without_spills(tokens, tmp_path):
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    compiled = SPEC.compile(
        config.params_for("bfloat16", tokens), f"--keep-cubin --dump-dir {tmp_path}"
    )
    info = inspect_cubin(compiled.artifacts.CUBIN)
    sass = info["sass"]
    assert info["spill_bytes"] == 0 and sass.get("LDL", 0) == sass.get("STL", 0) == 0
    assert sass["QGMMA"] == 16  # 4 issue sites x 4 k32 steps, A from registers
    assert info["registers"] == 168  # the entry cap of 3 warpgroups (setmaxnreg 232 inside)
    _assert_warp_collectives_converged(compiled.artifacts.CUBIN)


def _assert_warp_collectives_converged(cubin) -> None:
    """No divergent-path fallbacks (BRA.DIV / WARPSYNC: the DSL's TMA copy elects a lane over
    the whole warp, so issuing it from one lane hangs; the producer must be the whole warp 0)
    and no wgmma serialization (one WARPGROUP.ARRIVE per issue site, one DEPBAR per retire
    site: ptxas adds more where it cannot keep in-flight A registers apart)."""

    from forgekernel.runtime.resources import sass_text

    sass = sass_text(cubin)
    assert sass.count("QGMMA") == 16
    assert "BRA.DIV" not in sass and "WARPSYNC" not in sass
    assert sass.count("WARPGROUP.ARRIVE") == 4 and sass.count("WARPGROUP.DEPBAR") == 5


# ---------------------------------------------------------------- staged_sa (opt-in)
def test_staged_sa_is_keyed_only_when_on():
    """The opt-in form's key field exists only when on: every standard key (and so every
    ledger row and standard cubin) is the one before it."""
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC

    assert config.params_for("bfloat16", 32) == (("out", "bfloat16"), ("tokens", 32))
    assert config.params_for("bfloat16", 32, staged_sa=True) == (
        ("out", "bfloat16"), ("tokens", 32), ("staged_sa", True),
    )  # fmt: skip
    assert config.params_for("float16", 16, contiguous=True, staged_sa=True)[2:] == (
        ("contiguous", True), ("staged_sa", True),
    )  # fmt: skip
    assert not any("staged_sa" in dict(p) for p in SPEC.standard_params())
    for h in config.TOKENS:
        assert config.ring_bytes(h) == config.stage_bytes(h)
        assert config.ring_bytes(h, staged_sa=True) == config.stage_bytes(h) + 4 * h


def _schedule(sass: str) -> str:
    """The consumers' schedule in SASS: A = WARPGROUP.ARRIVE, Q = QGMMA, Dn = WARPGROUP.DEPBAR
    .LE gsb0, n, Fk = k FFMAs (runs merged across a stage release), G = a global load (LDG,
    not LDGSTS); other instructions left out."""
    import re

    out = []
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(?:@!?U?P\w+\s+)?(\S+)(.*?);", line)
        if not match:
            continue
        op = match.group(1)
        if op.startswith("QGMMA"):
            out.append("Q")
        elif op == "WARPGROUP.ARRIVE":
            out.append("A")
        elif op == "WARPGROUP.DEPBAR.LE":
            out.append("D" + match.group(2).strip()[-1])
        elif op == "FFMA":
            out.append("F")
        elif op.startswith("LDG") and not op.startswith("LDGSTS"):
            out.append("G")
    return re.sub(r"F+", lambda m: f"F{len(m.group())}", "".join(out))


def _predicates(sass: str, prefix: str) -> list[str]:
    """The predicate ("" when none) of each instruction whose opcode starts with `prefix`."""
    import re

    found = []
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?(\S+)", line)
        if match and match.group(2).startswith(prefix):
            found.append((match.group(1) or "").strip())
    return found


def _producer_max_register(sass: str) -> int:
    """The highest R register the code between setmaxnreg's DEALLOC (the producer's 40) and
    the consumers' TRY_ALLOC names."""
    import re

    body = sass.split("SETMAXREG.DEALLOC", 1)[1].split("SETMAXREG.TRY_ALLOC", 1)[0]
    return max(int(r) for r in re.findall(r"\bR(\d+)\b", body))


# slow, every case: `staged_sa` and `converter` are opt-in tuning forms (launch.py: the bench's
# `staged*` / `convert*` variants), in no standard or candidate build; CI's first cases of the
# three compile tests took ~3.2 s of an idle CPU (2026-12-07) for forms no default runs
@pytest.mark.slow
@pytest.mark.parametrize("tokens", [16, 32, 64])
def test_staged_sa_takes_the_scales_off_the_consumers_path(tokens, tmp_path):
    """Compiled for sm_90a with `staged_sa`: no spills, 168 registers at entry, the producer
    inside its 40; per k-tile the producer lanes' ceil(h / 32) LDGSTS (4 bytes: one token's
    scale each) then each lane's unpredicated ARRIVES.LDGSTSBAR on the stage's full barrier;
    the consumers' mainloop with no global load at all (the standard's h / 4 LDG a k-tile and
    thread held every other promotion for their round trip: docs/gemm/NOTES.md "FP4 at 16-96
    tokens"), its batches kept in flight as the standard's (issue, issue, then per k-tile wait
    for one, promote h / 2 FFMAs, issue), each consumer thread releasing its stage itself."""
    pytest.importorskip("cutlass")
    import re

    from dsl_toolchain import dsl_toolchain

    from forgekernel.kernels.gemm.fp4.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    params = config.params_for("bfloat16", tokens, staged_sa=True)
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    assert info["registers"] == 168
    _assert_warp_collectives_converged(compiled.artifacts.CUBIN)
    sass = sass_text(compiled.artifacts.CUBIN)
    assert _producer_max_register(sass) < 40
    arrivals = _predicates(sass, "ARRIVES.LDGSTSBAR")
    copies = _predicates(sass, "LDGSTS")
    assert arrivals and set(arrivals) == {""}
    assert len(copies) == len(arrivals) * -(-tokens // 32)
    releases = _predicates(sass, "SYNCS.ARRIVE.TRANS64.A")  # ART0 (cu12) / A1T0 (cu13)
    assert releases and set(releases) == {""}
    seq = _schedule(sass)
    body = seq[seq.index("A") : seq.rindex("D0") + 2]
    assert "G" not in body
    assert re.sub(r"F\d+", "F", body) == "AQQQQ" + "AQQQQD1F" * 3 + "D0FD0"
    assert info["sass"]["FFMA"] == 5 * tokens // 2  # 5 promotion sites
    if dsl_toolchain() == "cu13":  # each promotion in one run; the walks' 6 LDG.E in all
        f = f"F{tokens // 2}"
        assert body == "AQQQQ" + f"AQQQQD1{f}" * 3 + f"D0{f}D0"
        assert seq.count("G") == 6


# ---------------------------------------------------------------- converter (opt-in)
def test_converter_is_keyed_only_when_on():
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC

    assert config.params_for("bfloat16", 96, converter=True) == (
        ("out", "bfloat16"), ("tokens", 96), ("converter", True),
    )  # fmt: skip
    # the converter stages the scales itself: one field, whatever staged_sa says
    assert config.params_for("bfloat16", 32, staged_sa=True, converter=True)[-1] == (
        "converter", True,
    )  # fmt: skip
    with pytest.raises(ValueError):
        config.params_for("bfloat16", 96)
    assert config.params_for("bfloat16", 64, converter=2)[2:] == (
        ("converter", True), ("converters", 2),
    )  # fmt: skip
    with pytest.raises(ValueError):
        config.params_for("bfloat16", 96, converter=2)  # 160 MMA registers: at most 64
    with pytest.raises(ValueError):
        config.params_for("bfloat16", 32, converter=3)
    assert not any("converter" in dict(p) for p in SPEC.standard_params())


def _region_max_registers(sass: str) -> dict[str, int]:
    """The highest R register each role's code names: the producer (from setmaxnreg's DEALLOC
    to 40 up to the next setmaxnreg), the MMA warpgroups (TRY_ALLOC to their EXIT), the
    converter (DEALLOC to 56 to its EXIT)."""
    import re

    lines = [ln.split(";")[0] for ln in sass.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
    out = {}
    for name, kind, value in (("producer", "DEALLOC", "0x28"), ("mma", "TRY_ALLOC", ""),
                              ("converter", "DEALLOC", "0x38")):  # fmt: skip
        first = next(i for i, ln in enumerate(lines)
                     if f"SETMAXREG.{kind}" in ln and ln.rstrip().endswith(value))  # fmt: skip
        regs = set()
        for ln in lines[first + 1 :]:
            if name == "producer" and "SETMAXREG" in ln:
                break
            regs |= {int(r) for r in re.findall(r"\bR(\d+)\b", ln)}
            if re.search(r"\*/\s+EXIT", ln):
                break
        out[name] = max(regs)
    return out


# slow, every case (test_staged_sa_takes_the_scales_off_the_consumers_path's note)
@pytest.mark.slow
@pytest.mark.parametrize(
    "tokens, converters", [(16, 1), (32, 1), (64, 1), (96, 1), (32, 2), (64, 2)]
)
def test_converter_compiles_with_the_widening_out_of_the_mma_warpgroups(
    tokens, converters, tmp_path
):
    """Compiled for sm_90a with `converter`: 4 warpgroups (128 registers at entry; setmaxnreg
    40 / 56 / 208: producer, converter, MMA, each role within its own) or with two converter
    warpgroups 5 (96 at entry; 40 / 56 / 160), 0 spills; 16 QGMMA with A from shared memory
    (a descriptor, no A registers), the standard's batch schedule with no global load in the
    MMA loop; a converter's k-tile its packed chunks loaded before any store (LDS.128), its
    e4m3 rows stored by STS.128 (one store shared by the two converters' paths: 7), one proxy
    fence; every lane's cp.async arrival, every thread's release."""
    pytest.importorskip("cutlass")
    import re

    from dsl_toolchain import dsl_toolchain

    from forgekernel.kernels.gemm.fp4.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    params = config.params_for("bfloat16", tokens, converter=converters)
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    mma_regs = {1: 208, 2: 160}[converters]
    assert info["registers"] == {1: 128, 2: 96}[converters]
    sass = sass_text(compiled.artifacts.CUBIN)
    assert sorted(re.findall(r"USETMAXREG\.([A-Z_]+)\S*\s+(?:UP\d, )?(0x[0-9a-f]+)", sass)) == [
        ("DEALLOC", "0x28"), ("DEALLOC", "0x38"), ("TRY_ALLOC", hex(mma_regs)),
    ]  # fmt: skip
    regs = _region_max_registers(sass)
    assert regs["producer"] < 40 and regs["converter"] < 56 and regs["mma"] < mma_regs, regs
    qgmma = re.findall(r"QGMMA\.64x(\d+)x32\.F32\.E4M3\.E4M3 R\d+, (\S+)", sass)
    assert len(qgmma) == 16 and all(n == str(tokens) and a.startswith("gdesc") for n, a in qgmma)
    assert "BRA.DIV" not in sass and "WARPSYNC" not in sass
    assert sass.count("WARPGROUP.ARRIVE") == 4 and sass.count("WARPGROUP.DEPBAR") == 5
    assert sass.count("LDS.128") == 4 and sass.count("STS.128") in (7, 8)
    if dsl_toolchain() == "cu13":  # ptxas's layout of the two paths (a shared last store)
        loads = [ln for ln in sass.splitlines() if "LDS.128" in ln or "STS.128" in ln]
        # each path's loads before its stores: LLLL S x8 (one converter), LLSSS LLSSSS (two)
        order = "".join("L" if "LDS" in ln else "S" for ln in loads)
        assert order == {1: "LLLL" + "S" * 8, 2: "LLSSSLLSSSS"}[converters]
    assert sass.count("FENCE.VIEW.ASYNC.S") >= 1
    if dsl_toolchain() == "cu13":  # the converter's fence.proxy.async: one MEMBAR + FENCE
        assert sass.count("MEMBAR.ALL.CTA ;") == 1
    assert info["sass"]["FFMA"] == 5 * tokens // 2  # 5 promotion sites
    seq = _schedule(sass)
    body = seq[seq.index("A") : seq.rindex("D0") + 2]
    assert "G" not in body
    assert re.sub(r"F\d+", "F", body) == "AQQQQ" + "AQQQQD1F" * 3 + "D0FD0"
    assert set(_predicates(sass, "ARRIVES.LDGSTSBAR")) == {""}
    assert set(_predicates(sass, "SYNCS.ARRIVE.TRANS64.A")) == {""}


@pytest.mark.parametrize("tokens", [8, 32])
def test_tiled_mma_fragments_are_the_maps_the_kernel_assumes(tokens):
    """The DSL's own partition of the (A from registers) tiled MMA, traced on the host: A
    register r's first value at `fragment`'s (row, K), its 4 values consecutive in K; C value
    4i + j at row row0 + 8 (j / 2), token 8i + 2 quad + j % 2."""
    pytest.importorskip("cutlass")
    from fp4_fragment_probe import fragment_maps

    threads = (0, 1, 6, 37, 100, 129, 255)
    maps = fragment_maps(tokens, threads)
    assert maps["regs"] == 16
    for t in threads:
        assert maps[("a", t)] == [(row, k + i) for row, k in fragment(t) for i in range(4)]
        lane = t % 32
        row0, quad = t // 32 * 16 + lane // 4, lane % 4
        want = [
            (row0 + 8 * (j // 2), 8 * i + 2 * quad + j % 2)
            for i in range(tokens // 8)
            for j in range(4)
        ]
        assert maps[("c", t)] == want


# ---------------------------------------------------------------- the suite
def test_suite_is_registered_and_its_cases_are_valid():
    from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
    from forgekernel.bench.suites import gemm_fp4_masked as mod

    assert "gemm_fp4_masked" in SUITE_MODULES and "gemm_fp4_masked" not in PENDING_SUITE_MODULES
    suite = mod.suite()
    cases = (*suite.check_cases, *suite.bench_cases, *suite.sanitize_cases)
    assert len({c.name for c in cases}) == len(cases)
    for c in cases:
        p = c.params
        assert p["n"] % 128 == 0 and p["k"] % 128 == 0
        assert all(0 <= x <= mod.max_rows(p) for x in mod.expert_counts(p))
    tiles = {config.choose_tokens(mod.expected_rows(c.params)) for c in suite.check_cases}
    assert tiles == set(config.TOKENS)
    k_tiles = {c.params["k"] // 128 % 2 for c in suite.check_cases}
    assert k_tiles == {0, 1} and any(c.params["k"] == 128 for c in suite.check_cases)
    assert any(c.params.get("spread") for c in suite.check_cases)
    assert {c.group for c in suite.bench_cases} == {"e32", "e256"}
    dsv3 = suite.bench_cases[0].params
    weights = 32 * 4096 * 7168 // 2 + 32 * 4096 * 56 * 4
    assert mod.nbytes(suite.bench_cases[0], torch.bfloat16) > weights * 0.99
    assert dsv3["n"] == 4096 and dsv3["k"] == 7168
    assert set(mod.variants(suite.check_cases[0])) == {
        "tokens16", "tokens32", "tokens64", "convert",
    }  # fmt: skip
    by_mean = {c.params["tokens"]: c for c in suite.bench_cases}
    assert set(mod.variants(by_mean[96])) == {
        "tokens8", "tokens16", "tokens32", "convert", "staged", "convert2", "convert96",
    }  # fmt: skip
    assert {"staged", "staged64", "convert2", "convert64"} <= set(mod.variants(by_mean[32]))
    assert set(mod.variants(by_mean[2])) == {"tokens16", "tokens32", "tokens64", "convert"}


def test_suite_inputs_reference_and_fp8_weights_on_the_host():
    from forgekernel.bench.suites import gemm_fp4_masked as mod

    case = mod._case(3, 256, 640, counts=(5, 0, 9), max_m=12, expected_m=8, spread=True)
    gen = torch.Generator().manual_seed(5)
    inputs = mod.make_inputs(case, torch.bfloat16, torch.device("cpu"), gen)
    assert inputs["b"].dtype == torch.int8 and inputs["sb"].stride(1) == 1
    ref = mod.reference(inputs)
    low = mod.low_precision(inputs)
    for r, lo, c in zip(ref, low, inputs["counts"]):
        assert r.shape == (c, 256) and not r.isnan().any()
        if c:
            assert torch.allclose(lo.float(), r, rtol=0.05, atol=0.05 * r.abs().max().item() + 1e-6)
    b8, s8 = mod.fp8_weights(inputs)
    deq = dequantize_fp4(inputs["b"], inputs["sb"]).float()
    fp8 = b8.float() * s8.repeat_interleave(128, 1).repeat_interleave(128, 2)
    assert (fp8 - deq).abs().max() <= 2**-3 * deq.abs().amax()


def test_fake_tensors_take_the_custom_op_and_make_fx_records_it():
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.proxy_tensor import make_fx

    from forgekernel.ops.gemm_fp4_grouped_masked import gemm_fp4_grouped_masked

    def inputs():
        cuda = {"device": "cuda"}
        a = torch.empty(3, 16, 256, dtype=torch.float8_e4m3fn, **cuda)
        b = torch.empty(3, 384, 128, dtype=torch.int8, **cuda)
        sa = torch.empty(3, 16, 2, **cuda)
        words = torch.empty(3, 384, 2, dtype=torch.int32, **cuda)
        return a, b, sa, words, torch.empty(3, dtype=torch.int32, **cuda)

    with FakeTensorMode():
        out = gemm_fp4_grouped_masked(*inputs(), 8, out_dtype=torch.float16)
        assert out.shape == (3, 16, 384) and out.dtype == torch.float16
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(lambda *x: gemm_fp4_grouped_masked(*x, 8) * 2, tracing_mode="fake")(
            *inputs()
        ).graph
    assert "forgekernel.gemm_fp4_grouped_masked" in str(graph)


# ---------------------------------------------------------------- the contiguous layout
def _contiguous_args(e=2, m=256, n=128, k=256):
    a = torch.randn(m, k).to(torch.float8_e4m3fn)
    b, words = quantize_fp4_weights(torch.randn(e, n, k))
    idx = torch.cat([torch.full((100,), 0), torch.full((28,), -1), torch.full((128,), 1)])
    return a, b, torch.rand(m, k // 128), words, idx.to(torch.int32)


@pytest.mark.parametrize(
    "change, error, match",
    [
        (lambda x: {**x, "a": x["a"][:200]}, ValueError, "M must be"),
        (lambda x: {**x, "b": x["b"][:, :, :64]}, ValueError, "K mismatch"),
        (lambda x: {**x, "scale_b": x["scale_b"][:1]}, ValueError, "scale_b"),
        (lambda x: {**x, "m_indices": x["m_indices"][:128]}, ValueError, "m_indices"),
        (lambda x: {**x, "expected_m": -1}, TypeError, "expected_m"),
        (lambda x: x, ValueError, "CUDA"),
    ],
)
def test_contiguous_op_rejects_bad_inputs(change, error, match):
    from forgekernel.ops.gemm_fp4_grouped import gemm_fp4_grouped

    a, b, sa, words, idx = _contiguous_args()
    args = {"a": a, "b": b, "scale_a": sa, "scale_b": words, "m_indices": idx}
    with pytest.raises(error, match=match):
        gemm_fp4_grouped(**change(args))


def test_contiguous_reference_zeroes_padding_and_matches_masked():
    from forgekernel.reference.gemm import gemm_fp4_grouped_ref

    a, b, sa, words, idx = _contiguous_args()
    ref = gemm_fp4_grouped_ref(a, b, sa, words, idx)
    assert bool((ref[100:128] == 0).all())
    masked = gemm_fp4_masked_ref(
        torch.stack([a[:128], a[128:]]), b, torch.stack([sa[:128], sa[128:]]), words,
        torch.tensor([100, 128]),
    )  # fmt: skip
    assert torch.equal(ref[:100], masked[0, :100]) and torch.equal(ref[128:], masked[1])


def test_contiguous_kernel_compiles_without_spills(tmp_path):
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    params = config.params_for("float16", config.CONTIGUOUS_TOKENS, contiguous=True)
    assert params in SPEC.standard_params()
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["sass"]["QGMMA"] == 16
    _assert_warp_collectives_converged(compiled.artifacts.CUBIN)


def test_contiguous_suite_on_the_host():
    from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
    from forgekernel.bench.suites import gemm_fp4_grouped as mod

    assert "gemm_fp4_grouped" in SUITE_MODULES and "gemm_fp4_grouped" not in PENDING_SUITE_MODULES
    suite = mod.suite()
    cases = (*suite.check_cases, *suite.bench_cases, *suite.sanitize_cases)
    assert len({c.name for c in cases}) == len(cases)
    assert all(max(mod.expert_counts(c.params)) <= 128 for c in suite.bench_cases)
    case = mod._case(3, 256, 384, counts=(5, 0, 128), tail=128)
    inputs = mod.make_inputs(case, torch.float16, torch.device("cpu"), torch.Generator())
    assert inputs["a"].shape == (384, 384) and inputs["segments"] == [(0, 5), (128, 0), (128, 128)]
    out = mod.alloc_out(inputs)
    assert [o.shape[0] for o in out] == [5, 0, 128]
    assert mod.full_output(out).shape == (384, 256)
    ref, low = mod.reference(inputs), mod.low_precision(inputs)
    for r, lo in zip(ref, low):
        if r.numel():
            assert torch.allclose(lo.float(), r, rtol=0.05, atol=0.05 * r.abs().max().item())
    assert set(mod.variants(case)) == {"tokens8", "tokens16", "staged", "convert"}


def test_launcher_views_meet_the_compiled_assumptions():
    """What the launchers hand the kernel has the strides its fake tensors were compiled for
    (compile.py): unit inner strides, 16-byte multiples (A, W), 8 elements (C), N-major words
    with 4-int strides, a unit batch whose stride is a 16-byte multiple."""
    from forgekernel.kernels.gemm.fp4.sm90.launch import (
        _batched,
        _one_batch,
        n_major_words,
        scale_words_ready,
    )

    e, m, n, k = 3, 40, 384, 640
    a = torch.zeros(e, m, k, dtype=torch.float8_e4m3fn)
    b = torch.zeros(e, n, k // 2, dtype=torch.int8).view(torch.uint8)
    c = torch.zeros(e, m, n, dtype=torch.bfloat16)
    for t, div in ((a, 16), (b, 16), (c, 8)):
        rs, unit, es = _batched(t).stride()
        assert unit == 1 and rs % div == 0 and es % div == 0
    words = torch.zeros(e, n, k // 128, dtype=torch.int32)
    assert not scale_words_ready(words)
    nm = n_major_words(words)
    assert scale_words_ready(nm) and _batched(nm).stride()[0] == 1
    assert n_major_words(nm) is nm
    for t in (a[0], c[0], torch.zeros(m, k // 128)):
        one = _one_batch(t)
        assert one.shape == (*t.shape, 1) and one.stride()[:2] == t.stride()
        assert one.stride(2) % (16 // t.element_size()) == 0 and one.stride(2) > 0


@pytest.mark.parametrize("e, n, k", [(2, 128, 128), (1, 256, 128), (1, 128, 512), (3, 384, 256)])
def test_every_scale_form_reaches_the_kernel_with_its_compiled_strides(e, n, k):
    """The words each scale form hands the kernel (the ops' `weight_words`): quantize's own
    words, K-major words and fp32 scales, at K = 128 too (one word per row: torch calls a
    size-1 dim contiguous whatever its stride, and `.contiguous()` keeps a 4-byte one there)
    and one expert. compile.py declares the K/128 and E strides multiples of 4 ints (TVM-FFI
    rejects the call otherwise; TMA needs 16-byte strides): every form must meet it, same
    values."""
    from forgekernel.kernels.gemm.fp4.sm90.launch import _batched, scale_words_ready
    from forgekernel.ops.gemm_fp4_grouped_masked import weight_words

    _, words = quantize_fp4_weights(torch.randn(e, n, k))
    for form in (words, words.contiguous(), unpack_scale_words(words)):
        got = weight_words(form)
        assert scale_words_ready(got), (tuple(form.shape), form.stride(), got.stride())
        rows, blocks, experts = _batched(got).stride()
        assert rows == 1 and blocks % 4 == 0 and experts % 4 == 0
        assert torch.equal(got, words)


@pytest.mark.parametrize("tokens", config.TOKENS)
def test_shared_memory_budget(tokens):
    """The stages the kernel takes, laid out as its SharedStorage (barriers, then the packed
    weights, exponent words and tokens rings at 1024 / 128 / 1024-byte alignment), plus the 1 KB
    of static shared memory the compiled kernel reports, fit in the 227 KB a CTA may opt into,
    with at least 1 KB to spare."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
    from forgekernel.kernels.gemm.fp4.sm90.kernel import GemmFp4GroupedSm90

    def up(x, a):
        return -(-x // a) * a

    s = GemmFp4GroupedSm90(tokens).stages
    used = up(16 * s, 1024) + 8192 * s
    used = up(used, 128) + 512 * s
    used = up(used, 1024) + 128 * tokens * s
    assert s >= 12 and used + 1024 + 1024 <= SMEM_CAPACITY
    assert s == {8: 23, 16: 21, 32: 17, 64: 13}[tokens]


@pytest.mark.parametrize("tokens", config.CONVERTER_TOKENS)
def test_shared_memory_budget_of_the_opt_in_forms(tokens):
    """As above for the opt-in forms' storage: `staged_sa` adds the tokens' scales (4h bytes a
    stage, 128-byte aligned after the words); the converter also its barriers and WIDE_SLOTS
    widened buffers (128 x 128 e4m3 bytes, 1024-aligned) with their rows' k-tile scales."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY
    from forgekernel.kernels.gemm.fp4.sm90.convert import WIDE_SLOTS, GemmFp4ConvertSm90
    from forgekernel.kernels.gemm.fp4.sm90.kernel import GemmFp4GroupedSm90

    def up(x, a):
        return -(-x // a) * a

    if tokens in config.TOKENS:
        s = GemmFp4GroupedSm90(tokens, staged_sa=True).stages
        used = up(16 * s, 1024) + 8192 * s
        used = up(used, 128) + 512 * s
        used = up(used, 128) + 4 * tokens * s
        used = up(used, 1024) + 128 * tokens * s
        assert used + 1024 + 1024 <= SMEM_CAPACITY
        assert s == GemmFp4GroupedSm90(tokens).stages  # the scales cost no stage
    s = GemmFp4ConvertSm90(tokens).stages
    used = up(16 * s + 16 * WIDE_SLOTS, 1024) + 8192 * s
    used = up(used, 128) + 512 * s
    used = up(used, 128) + 4 * tokens * s
    used = up(used, 128) + 4 * 128 * WIDE_SLOTS
    used = up(used, 1024) + 128 * tokens * s
    used = up(used, 1024) + 128 * 128 * WIDE_SLOTS
    assert used + 1024 + 1024 <= SMEM_CAPACITY
    assert s == {8: 18, 16: 16, 32: 13, 64: 10, 96: 8}[tokens]


# slow, every case (test_staged_sa_takes_the_scales_off_the_consumers_path's note)
@pytest.mark.slow
@pytest.mark.parametrize("form", [{"staged_sa": True}, {"converter": 1}, {"converter": 2}])
def test_contiguous_opt_in_forms_compile_without_spills(form, tmp_path):
    """The contiguous layout's default tile (32 tokens) in each opt-in form: 0 spills, 16
    QGMMA, no divergent fallbacks, the MMA loop free of global loads."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp4.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    params = config.params_for("bfloat16", 32, contiguous=True, **form)
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    assert info["sass"]["QGMMA"] == 16
    sass = sass_text(compiled.artifacts.CUBIN)
    assert "BRA.DIV" not in sass and "WARPSYNC" not in sass
    seq = _schedule(sass)
    assert "G" not in seq[seq.index("A") : seq.rindex("D0") + 2]
