"""Decode time with the page table sized to the batch against one sized for a long context (a
probe, GPU). Serving engines capture a decode step's graph with a table as wide as the longest
context they admit; the split plans size their splits by the table's width, the passes spread
each sequence's own keys over them (2026-12-04). Prints ms (graph replays, inputs rotated past
L2) of the narrow and the wide table and wide / narrow; attention_paged and mla_decode.

    python3 scripts/probe_wide_tables.py
"""

from __future__ import annotations

import math

import torch

import forgekernel
from forgekernel.runtime.timing import l2_bytes, median, rotation_sets, time_interleaved

PAGED = [(1, 16384), (8, 4096), (64, 4096)]  # (batch, keys): hq 32, hkv 8, D 128, page 16
MLA = [(1, 16384), (16, 4096), (64, 4096)]  # (batch, keys): 16 heads, page 64
WIDE = 131072  # tokens a table holds


def _tables(b: int, n: int, ps: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(narrow, wide) tables over the same b x ceil(n / ps) pages; the wide one's extra entries
    are page 0 (never read: past every sequence)."""
    per = -(-n // ps)
    narrow = torch.randperm(b * per, device="cuda", generator=g).view(b, per).to(torch.int32)
    wide = torch.zeros(b, WIDE // ps, dtype=torch.int32, device="cuda")
    wide[:, :per] = narrow
    return narrow, wide


def _time(call, sets) -> float:
    return median(time_interleaved({"x": call}, rotate=sets, warmup=5, reps=20)["x"])


def paged(b: int, n: int, g: torch.Generator) -> tuple[float, float]:
    hq, hkv, d, ps = 32, 8, 128, 16
    narrow, wide = _tables(b, n, ps, g)
    pages = narrow.numel()
    nbytes = 2 * pages * ps * hkv * d * 2
    sets = []
    for _ in range(rotation_sets(nbytes, l2=l2_bytes())):
        k = torch.randn(pages, ps, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn_like(k)
        q = torch.randn(b, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        sets.append((q, k, v))
    seq = torch.full((b,), n, dtype=torch.int32, device="cuda")
    out = [
        _time(lambda q, k, v, t=t: forgekernel.attention_paged(q, k, v, t, seq), sets)
        for t in (narrow, wide)
    ]
    return out[0], out[1]


def mla(b: int, n: int, g: torch.Generator) -> tuple[float, float]:
    hq, ps = 16, 64
    narrow, wide = _tables(b, n, ps, g)
    pages = narrow.numel()
    sets = []
    for _ in range(rotation_sets(pages * ps * 576 * 2, l2=l2_bytes())):
        ckv = torch.randn(pages, ps, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        kpe = torch.randn(pages, ps, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        qn = torch.randn(b, 1, hq, 512, device="cuda", dtype=torch.bfloat16, generator=g)
        qp = torch.randn(b, 1, hq, 64, device="cuda", dtype=torch.bfloat16, generator=g)
        sets.append((qn, qp, ckv, kpe))
    seq = torch.full((b,), n, dtype=torch.int32, device="cuda")
    scale = 1.0 / math.sqrt(192.0)

    def call(t):
        return lambda qn, qp, ckv, kpe: forgekernel.mla_decode(qn, qp, ckv, kpe, t, seq, scale)

    return _time(call(narrow), sets), _time(call(wide), sets)


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    for name, fn, cases in (("attention_paged", paged, PAGED), ("mla_decode", mla, MLA)):
        for b, n in cases:
            narrow, wide = fn(b, n, g)
            print(f"{name} b{b} L{n}: narrow {narrow * 1e3:.1f} us, {WIDE}-token table "
                  f"{wide * 1e3:.1f} us, wide / narrow {wide / narrow:.3f}")  # fmt: skip


if __name__ == "__main__":
    main()
