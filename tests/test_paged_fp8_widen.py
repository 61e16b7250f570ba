"""The paged decode's FP8 (e4m3) operands widened in registers (kernels/attention/paged/sm90/
fp8.py), replayed on the CPU at the bit and register level: the byte permutes and the bf16
widening exact on every e4m3 value (subnormals and signed zeros included), and one warp's
S = Q K^T and O = P V through the hardware's fragment layouts (ldmatrix words, mma.sync
m16n8k16 A / B / C registers) with the query columns stored permuted (config.FP8_Q_SLOT) and
O's columns read back through config.FP8_O_COLUMN: equal to the plain products."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.attention.paged.sm90.config import FP8_O_COLUMN, FP8_Q_SLOT

fp8 = pytest.importorskip("forgekernel.kernels.attention.paged.sm90.fp8")
E4M3 = torch.float8_e4m3fn
LANES = [(lane // 4, lane % 4) for lane in range(32)]  # (g, t): groupID, thread in group


def _prmt(word: int, select: int) -> int:
    """prmt.b32 d, word, 0, select: result byte i is byte (nibble i & 7) of (0 << 32 | word),
    its sign repeated over the byte when nibble i & 8."""
    src = word.to_bytes(4, "little") + bytes(4)
    out = 0
    for i in range(4):
        nib = (select >> 4 * i) & 0xF
        byte = src[nib & 7]
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0
        out |= byte << 8 * i
    return out


def _halves(word: int, dtype: torch.dtype) -> list[float]:
    """The two 16-bit halves of `word` (low first) as values of `dtype`."""
    bits = torch.tensor([word & 0xFFFF, word >> 16], dtype=torch.int32).to(torch.int16)
    return bits.view(dtype).double().tolist()


def _e4m3(byte: int) -> float:
    return float(torch.tensor([byte], dtype=torch.uint8).view(E4M3).double())


def _widen_bf16(word: int, high: bool) -> list[float]:
    """`fp8.e4m3_pair_bf16`: permute, shift, mask, times 2^120 (exact in bf16)."""
    t = (_prmt(word, fp8.BF16_SELECT[int(high)]) << fp8.BF16_SHIFT) & 0xFFFFFFFF
    bias = _halves(fp8.BF16_E4M3_BIAS, torch.bfloat16)
    return [v * b for v, b in zip(_halves(t & fp8.BF16_MASK, torch.bfloat16), bias)]


def _widen_f16(word: int, high: bool) -> list[float]:
    """`fp8.e4m3_pair_f16`: cvt.rn.f16x2.e4m3x2 of half 0 / 1 (its low byte to the low half)."""
    pair = (word >> 16) if high else word & 0xFFFF
    return [_e4m3(pair & 0xFF), _e4m3(pair >> 8)]


def _keys_f16(word: int, odd: bool) -> list[float]:
    """`fp8.e4m3_keys_f16`: bytes 0, 2 (odd: 1, 3) after the KEY_PAIRS permute, widened."""
    return _widen_f16(_prmt(word, fp8.KEY_PAIRS), odd)


def _word(b: list[int]) -> int:
    return b[0] | b[1] << 8 | b[2] << 16 | b[3] << 24


def test_bf16_widening_is_exact_on_every_e4m3_value():
    values = [b for b in range(256) if b & 0x7F != 0x7F]  # all but the two NaNs
    for lo in values:
        for hi in (values[(lo * 37) % len(values)], values[(lo * 101 + 7) % len(values)]):
            w = _word([lo, hi, hi ^ 0x80, lo ^ 0x80])
            want = [_e4m3(x) for x in (lo, hi, hi ^ 0x80, lo ^ 0x80)]
            got = _widen_bf16(w, False) + _widen_bf16(w, True)
            assert got == want, (hex(w), got, want)
            # signed zeros keep their sign
            assert [str(x)[0] == "-" for x in got] == [str(x)[0] == "-" for x in want]


def test_byte_permutes():
    w = _word([0x01, 0x82, 0x03, 0xF4])
    assert _prmt(w, fp8.BF16_SELECT[0]) == _word([0x01, 0x00, 0x82, 0xFF])
    assert _prmt(w, fp8.BF16_SELECT[1]) == _word([0x03, 0x00, 0xF4, 0xFF])
    assert _prmt(w, fp8.KEY_PAIRS) == _word([0x01, 0x03, 0x82, 0xF4])


def _q_slot(d: int) -> int:
    """Where dim d of a query row sits in shared memory (config.FP8_Q_SLOT per 16 dims)."""
    (sj, si, st), (tj, ti, tt) = FP8_Q_SLOT
    r = d % 16
    j, i, t = r % sj, (r // sj) % si, r // (sj * si)
    assert t < st
    return d - r + j * tj + i * ti + t * tt


def _o_dim(v: int) -> int:
    """O's dim of virtual column v = 8 * block + n (config.FP8_O_COLUMN per 16 columns)."""
    (sn, se), (tn, te) = FP8_O_COLUMN
    r = v % 16
    return v - r + (r % sn) * tn + (r // sn) * te


def test_query_slots_are_the_kernels_pair_slots():
    """Slots permute each 16 dims, keep pairs (2c, 2c + 1) together (4-byte copies), and
    pair c goes where `fp8.q_pair_slots` says (its strides: (i, t, segment))."""
    d = 128
    slots = [_q_slot(x) for x in range(d)]
    assert sorted(slots) == list(range(d)) and all(s // 16 == x // 16 for x, s in enumerate(slots))
    (_, si, st), (_, ti, tt) = FP8_Q_SLOT
    for c in range(d // 2):
        assert slots[2 * c + 1] == slots[2 * c] + 1
        i, t, seg = c % si, (c // si) % st, c // (si * st)
        assert slots[2 * c] == 2 * (i * (ti // 2) + t * (tt // 2) + 8 * seg)


def _mma(a_regs, b_regs) -> torch.Tensor:
    """One m16n8k16 from the 32 lanes' registers: a_regs[lane] = 4 pairs (a0 .. a3),
    b_regs[lane] = 2 pairs (b0, b1); returns C (16, 8) = A B in fp64."""
    a = torch.zeros(16, 16, dtype=torch.float64)
    b = torch.zeros(16, 8, dtype=torch.float64)
    for lane, (g, t) in enumerate(LANES):
        for reg, (row, col) in enumerate([(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8),
                                          (g + 8, 2 * t + 8)]):  # fmt: skip
            a[row, col : col + 2] = torch.tensor(a_regs[lane][reg], dtype=torch.float64)
        for reg in range(2):
            b[2 * t + 8 * reg : 2 * t + 8 * reg + 2, g] = torch.tensor(b_regs[lane][reg])
    return a @ b


def _bytes(shape, seed):
    """e4m3 bytes of N(0, 1) draws times 4^U(-4, 4): normals, subnormals, zeros, both signs."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) * 4.0 ** (torch.rand(*shape, generator=g) * 8 - 4)
    x = x.to(E4M3)
    return x.view(torch.uint8).long(), x.double()


@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scores_through_k_words_and_permuted_queries(d, dtype):
    """S = Q K^T of a warp's 16 keys: K's B operand from non-transposed ldmatrix words of the
    byte tile (lane (g, t) of block nb, segment s: key 8nb + g, bytes 16s + 4t .. + 3), each
    widened into b0 = bytes 0, 1 and b1 = bytes 2, 3; Q's A operand from its shared-memory
    tile, columns stored at `_q_slot`."""
    kb, kv = _bytes((16, d), seed=d)
    q = torch.randn(16, d, generator=torch.Generator().manual_seed(1)).to(dtype).double()
    sq = torch.zeros_like(q)
    sq[:, [_q_slot(x) for x in range(d)]] = q
    widen = _widen_bf16 if dtype is torch.bfloat16 else _widen_f16
    s = torch.zeros(16, 16, dtype=torch.float64)
    for nb in range(2):
        for seg in range(d // 16):
            a_regs, b_regs = [], []
            for g, t in LANES:
                rows = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
                a_regs.append([sq[r, 16 * seg + c : 16 * seg + c + 2].tolist() for r, c in rows])
                w = _word(kb[8 * nb + g, 16 * seg + 4 * t : 16 * seg + 4 * t + 4].tolist())
                b_regs.append([widen(w, False), widen(w, True)])
            s[:, 8 * nb : 8 * nb + 8] += _mma(a_regs, b_regs)
    torch.testing.assert_close(s, q @ kv.T, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("d", [64, 128, 256])
def test_output_through_transposed_v_words_and_permuted_columns(d):
    """O = P V of a warp's 16 keys: V's B operand from transposed ldmatrix words (lane (g, t)
    of key half kh, segment s: bytes 16s + 2g, + 1 of keys 8kh + 2t, + 1), block 2s + e's b_kh
    the keys of byte e (`e4m3_keys_f16`); O's virtual column 8 * block + n is dim `_o_dim`."""
    vb, vv = _bytes((16, d), seed=d + 1)
    vb = vb.tolist()
    p = torch.rand(16, 16, generator=torch.Generator().manual_seed(2)).half().double()
    o = torch.zeros(16, d, dtype=torch.float64)
    for seg in range(d // 16):
        words = {}
        for lane, (g, t) in enumerate(LANES):
            for kh in range(2):
                k0, c0 = 8 * kh + 2 * t, 16 * seg + 2 * g
                words[lane, kh] = _word([vb[k0][c0], vb[k0][c0 + 1], vb[k0 + 1][c0],
                                         vb[k0 + 1][c0 + 1]])  # fmt: skip
        for e in range(2):
            a_regs, b_regs = [], []
            for lane, (g, t) in enumerate(LANES):
                rows = [(g, 2 * t), (g + 8, 2 * t), (g, 2 * t + 8), (g + 8, 2 * t + 8)]
                a_regs.append([p[r, c : c + 2].tolist() for r, c in rows])
                b_regs.append([_keys_f16(words[lane, kh], e == 1) for kh in range(2)])
            block = 2 * seg + e
            c = _mma(a_regs, b_regs)
            for n in range(8):
                o[:, _o_dim(8 * block + n)] = c[:, n]
    torch.testing.assert_close(o, p @ vv, rtol=1e-12, atol=1e-12)
