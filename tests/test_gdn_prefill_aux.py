"""The chunked Gated DeltaNet prefill's aux-warpgroup math on the CPU (kernel: forgekernel/
kernels/linear_attention/gdn_prefill/sm90/aux_wy.py, inverse.py; model: tests/
gdn_prefill_replay.py), on the L the kernel builds from the suite's gates (g = logsigmoid of a
normal, down to strong decays; beta in (0, 1); unit keys, independent or correlated):

- phase 0 of the inverse down the columns (no shuffles) is bitwise the row form it replaced
  (the same FFMA sequence per element; the row form's other terms are exact no-ops);
- against fp64, the substitution and the doubling form of phase 0, (I + N)^-1 = (I - N)
  (I + N^2)(I + N^4)(I + N^8) for the nilpotent 16 x 16 N (the measured alternative; the
  kernel does not use it: ~100x less accurate without decay, and its six 16 x 16 products,
  four dependent, are more instructions and a longer chain than the 15-FFMA substitution).
"""

from __future__ import annotations

import gdn_prefill_replay as replay
import pytest
import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import BLOCK, CHUNK

CASES = [  # (mean log decay per token, correlated keys)
    (None, False),  # the suite's g = logsigmoid(N(0, 1))
    (None, True),
    (0.0, True),  # no decay, keys alike: the largest entries of T
    (-0.05, False),
    (-3.0, False),
    (-30.0, False),  # decays that underflow inside a block
]


def _chunk_lower(decay, correlated, seed):
    """L = beta_i 2^(G2_i - G2_j) (K K^T)_ij, j < i, of one chunk (fp32), as the aux builds it."""
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(CHUNK, 128, generator=gen)
    if correlated:
        k = torch.randn(1, 128, generator=gen) + 0.3 * k
    k = torch.nn.functional.normalize(k, dim=-1)
    beta = torch.sigmoid(torch.randn(CHUNK, generator=gen))
    if decay is None:
        g = torch.nn.functional.logsigmoid(torch.randn(CHUNK, generator=gen))
    else:
        g = decay + 0.01 * torch.randn(CHUNK, generator=gen).clamp(max=0)
    g2 = replay.gates(g)
    rows = torch.arange(CHUNK)
    below = rows[None, :] < rows[:, None]
    power = torch.exp2(g2[:, None] - g2[None, :])
    return (k @ k.t()) * torch.where(below, power, torch.zeros(())) * beta[:, None]


def _diagonal_blocks(lower):
    return [lower[BLOCK * w : BLOCK * (w + 1), BLOCK * w : BLOCK * (w + 1)] for w in range(4)]


def _rows_by_shuffles(lower):
    """The row form phase 0 had (15 shuffle steps): lane (r, h) starts from e_r; at step s
    every row subtracts L_rs times row s (lane s's registers, final)."""
    acc = torch.eye(BLOCK)
    for s in range(BLOCK - 1):
        row_s = acc[s].clone()
        acc -= lower[:, s : s + 1] * row_s[None, :]
    return acc


def _by_doubling(lower):
    """(I + N)^-1 = (I - N)(I + N^2)(I + N^4)(I + N^8), N^16 = 0 (fp32)."""
    eye = torch.eye(BLOCK)
    n2 = lower @ lower
    n4 = n2 @ n2
    n8 = n4 @ n4
    return (eye - lower) @ (eye + n2) @ (eye + n4) @ (eye + n8)


@pytest.mark.parametrize(("decay", "correlated"), CASES)
def test_phase0_by_columns_is_bitwise_the_row_form(decay, correlated):
    for seed in range(3):
        for blk in _diagonal_blocks(_chunk_lower(decay, correlated, seed)):
            assert torch.equal(replay.diagonal_inverse(blk), _rows_by_shuffles(blk))


@pytest.mark.parametrize(("decay", "correlated"), CASES)
def test_phase0_against_fp64(decay, correlated):
    """Relative to max |T_ww| (1: its diagonal), the substitution within 1e-7 of the fp64
    inverse on every case (measured <= 8e-8); the doubling form as close on decaying chunks but
    ~1e-5 on the undecayed correlated one (the powers N^2 .. N^8 grow and cancel in fp32),
    which is one reason the kernel does not use it."""
    worst = 0.0
    for seed in range(3):
        for blk in _diagonal_blocks(_chunk_lower(decay, correlated, seed)):
            want = torch.linalg.inv(torch.eye(BLOCK, dtype=torch.float64) + blk.double())
            top = float(want.abs().max())
            got = replay.diagonal_inverse(blk)
            assert torch.equal(got.triu(1), torch.zeros_like(got))
            assert float((got.double() - want).abs().max()) <= 1e-7 * top
            doubled = _by_doubling(blk).double()
            worst = max(worst, float((doubled - want).abs().max()) / top)
    assert worst <= (2e-5 if decay == 0.0 else 1e-7)


def test_mask_forms_every_power_it_keeps():
    """The masks' plan (aux_wy._decay_mask, modelled by replay.decay_form): a power is formed
    for every j <= i, none is needed above the diagonal, the factored form only where row
    i - 8 of the same thread is below the diagonal too (so its own power is finite), and warp
    w forms 7 + 4 w powers a thread (32 before)."""
    rows = torch.arange(CHUNK)
    seen = rows[None, :] <= rows[:, None]
    zero = replay.form_mask("zero")
    factored = replay.form_mask("factored")
    assert not (zero & seen).any()
    i, j = factored.nonzero().unbind(1)
    assert (j < i - 8).all() and (i % 16 >= 8).all()
    for w in range(4):
        # thread (t, q) of warp w: rows 16 w + t, + 8; columns 8 n + 2 q + e
        t, q = 0, 0
        cols = [8 * n + 2 * q + e for n in range(8) for e in range(2)]
        formed = 1  # the row ratio
        for jj in cols:
            forms = [replay.decay_form(16 * w + t + 8 * r, jj) for r in range(2)]
            formed += sum(f == "direct" for f in forms)  # a factored one reuses row 0's
        assert formed == 7 + 4 * w


@pytest.mark.parametrize("decay", [None, 0.0, -3.0, -30.0])
@pytest.mark.parametrize("l2norm", [False, True])
def test_factored_powers_are_the_direct_ones(decay, l2norm):
    """Where the kernel forms d_ij = 2^(G2_i - G2_i0) 2^(G2_i0 - h_j) instead of 2^(G2_i - h_j):
    against the fp64 power on and below the diagonal, within twice the direct fp32 power's
    error (its exponent's rounding) and a few roundings (relative; where fp32 underflows, at
    most 2^-119), finite there (above it the masks select 0)."""
    gen = torch.Generator().manual_seed(11)
    if decay is None:
        g = torch.nn.functional.logsigmoid(torch.randn(CHUNK, generator=gen))
    else:
        g = decay + 0.01 * torch.randn(CHUNK, generator=gen).clamp(max=0)
    g2 = replay.gates(g)
    h = g2
    if l2norm:  # 1 / |k_j| from 1e-3 to 1e3: log2 rk_j within +-10
        h = g2 - torch.empty(CHUNK).uniform_(-10, 10, generator=gen)
    got = replay.decay_powers(g2, h).tril()
    assert torch.isfinite(got).all()
    rows = torch.arange(CHUNK)
    want = torch.exp2(g2.double()[:, None] - h.double()[None, :]).tril()
    direct = torch.exp2(g2[:, None] - h[None, :]).tril()  # every power formed directly
    normal = want >= 2.0**-120

    def rel(x):
        return float(((x.double() - want).abs() / want.clamp(min=1e-300))[normal].max())

    # the direct power's own error is its fp32 exponent's rounding (|G2| up to ~100 here)
    assert rel(got) <= 2 * rel(direct) + 4 * 2.0**-24
    assert (got.double()[~normal & (rows[None, :] <= rows[:, None])] <= 2.0**-119).all()


@pytest.mark.parametrize(("decay", "correlated"), CASES)
def test_tensor_core_merges_against_fp64(decay, correlated):
    """The merges of `inverse_mma` (the kernels' form), modelled lane by lane (replay.mma_product:
    the fragments each lane reads, tf32 rounding), relative to max |T| against fp64. Measured
    <= 6.6e-4 (no decay, keys alike; the suite's gates <= 9.3e-5): under a third of the bf16
    rounding of T diag(beta) the state warpgroups read (2^-9 of an entry). The forms measured
    and dropped 2026-12-03: FFMA <= 1.7e-7, 3xTF32 <= 2.9e-7."""
    worst = 0.0
    for seed in range(2):
        lower = _chunk_lower(decay, correlated, seed)
        want = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + lower.double())
        got = replay.blocked_inverse(lower).double()
        assert torch.equal(got.triu(1), torch.zeros_like(got))
        worst = max(worst, float((got - want).abs().max()) / float(want.abs().max()))
    assert worst <= (1e-3 if decay == 0.0 else 2e-4)


def test_mma_fragments_cover_the_block():
    """replay.mma_product (the kernel's lane -> fragment element map) is the block product: with
    operands exact in tf32 (integers below 2^10) it gives x y exactly."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randint(-8, 8, (BLOCK, BLOCK), generator=gen).float()
    y = torch.randint(-8, 8, (BLOCK, BLOCK), generator=gen).float()
    assert torch.equal(replay.mma_product(x, y), x @ y)


def test_kernel_fragment_map_is_the_replays():
    """The kernel's fragment offsets (inverse_mma.py) are the replay's."""
    mma = pytest.importorskip(
        "forgekernel.kernels.linear_attention.gdn_prefill.sm90.inverse_mma"
    )  # the DSL
    assert mma.A_OFFSETS == replay.A_OFFSETS and mma.MMA_K == replay.MMA_K
