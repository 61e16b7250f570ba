"""A tail chunk's token tile as the varlen-native backward's kernels would load it (NOTES
"next/varlen-native-plan"): the chunk's `valid` rows, then the rows a TMA box at the chunk's
first token reads past the sequence's end (the next sequence's: `fill`), or the zeros the
slot layout's packed rows hold there. Used by the kernels' model tests of that plan."""

from __future__ import annotations

import math

import torch

CHUNK = 64


def past_valid(x: torch.Tensor, fill: float | None, gen: torch.Generator) -> torch.Tensor:
    """x (1, valid, ...) grown to (1, CHUNK, ...): rows past valid zero (fill None: the packed
    slot layout), NaN (fill NaN) or `fill`-scale normal noise (finite neighbour rows)."""
    shape = (1, CHUNK - x.shape[1], *x.shape[2:])
    if fill is None:
        pad = torch.zeros(shape, dtype=x.dtype)
    elif math.isnan(fill):
        pad = torch.full(shape, fill, dtype=x.dtype)
    else:
        pad = fill * torch.randn(shape, generator=gen, dtype=x.dtype)
    return torch.cat([x, pad], 1)
