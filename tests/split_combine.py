"""The paged decode's combine pass (kernels/attention/paged/sm90/combine.py) in torch, for the
CPU replays of the split-KV kernels (paged GQA, MLA, DSA): O = sum_s 2^(lse_s - lse) O_s,
lse = log2 sum_s 2^lse_s returned natural; O 0 and LSE -inf where no split saw a key."""

from __future__ import annotations

import math

import torch


def combine_splits(op: torch.Tensor, lp: torch.Tensor, out: torch.Tensor, lse: torch.Tensor):
    """op (splits, rows, H, D) normalized partial O, lp (splits, rows, H) log2 LSE -> out, lse."""
    top = lp.max(0).values
    w = torch.where(top > -math.inf, torch.exp2(lp - top), 0.0)
    total = w.sum(0)
    o = (w[..., None] * op).sum(0) / torch.where(total > 0, total, 1.0)[..., None]
    out.copy_(torch.where((total > 0)[..., None], o, 0.0).to(out.dtype))
    lse.copy_(torch.where(total > 0, (top + torch.log2(total)) * math.log(2), -math.inf))
