"""What the linear-attention backwards' varlen GPU tests share (the slot layout under a capture:
test_linattn_varlen_capture_gpu.py; its native stores: test_linattn_varlen_stores_gpu.py): the
ops' inputs as one row of tokens, and a capture that keeps the captured call's outputs."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from graphs import captured


def problem(op, t, h, hv, n, seed=0, unit_k=False):
    """One row of t tokens (B = 1, the suites' cu_seqlens form) of `op`'s inputs ("gdn": a
    scalar gate a value head, "kda": a gate a channel) and n sequences' states; `unit_k`: k unit
    rows (the suites' form where the op does not normalize them)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, t, h, 128).bfloat16()
    k = rnd(1, t, h, 128) * 2.0
    k = (F.normalize(k, dim=-1) if unit_k else k).bfloat16()
    v = rnd(1, t, hv, 128).bfloat16()
    if op == "gdn":
        g = F.logsigmoid(rnd(1, t, hv) + 2.0)
    else:
        g = -torch.rand(1, t, hv, 128, device="cuda", generator=gen)
    beta = torch.sigmoid(rnd(1, t, hv))
    do = rnd(1, t, hv, 128).bfloat16()
    return [q, k, v, g, beta, do], rnd(n, hv, 128, 128) * 0.1, rnd(n, hv, 128, 128) * 0.1


def captured_outputs(call: Callable[[], Any]) -> tuple[torch.cuda.CUDAGraph, Any]:
    """`graphs.captured(call)` and the captured call's outputs (what a replay writes)."""
    outs = []
    graph = captured(lambda: outs.append(call()))
    return graph, outs[-1]
