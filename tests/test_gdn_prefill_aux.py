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
