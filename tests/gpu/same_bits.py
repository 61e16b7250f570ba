"""The two-math-warpgroup (`wg2`) builds' agreement tests: every output of the build under test
written (no NaN left in a NaN-poisoned buffer) and bit for bit the 256-thread kernel's
(tests/gpu/test_gdn_bwd_factors_gpu.py; the KDA kernel 2 and WY kernel ones went with their
256-thread kernels, 2026-12-06, NOTES "next/lin-losers")."""

from __future__ import annotations

import torch


def assert_same_bits(name: str, got: torch.Tensor, want: torch.Tensor) -> None:
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
    err = float((got.double() - want.double()).abs().max()) if got.numel() else 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=0, equal_nan=True,
                               msg=f"{name}: max |wg2 - 256-thread| {err:.3e}")  # fmt: skip
