"""CPU models of kernel.py (torch only, no DSL): the ring protocol and the math, for the tests.

`run_protocol` replays the gather / consume walk with the mbarriers' parity semantics (a wait
for parity p passes while the barrier's completed-phase count n has n % 2 != p, so it also
passes on an older phase), one thread of each role, in random interleavings: it raises on a
deadlock, on a consumer that passes its wait before its chunk is committed, or on a slot
overwritten before its consumer released it.

`emulate_target` computes the kernel's result its way: key tiles of TILE list positions, the
fp32 product of 16-bit q and kv rows chunk by chunk, stale (NaN) rows where an entry is not read,
exp2 with the log2 scale and lse, the head sum, the unnormalized row, its total, the in-place
rescale by 1 / (total + L1_EPS)."""

from __future__ import annotations

import math
import random

import torch

from forgekernel.kernels.attention.dsa_recompute.sm90.config import (
    CHUNK,
    CONSUMERS,
    L1_EPS,
    NCHUNK,
    TILE,
)


class Deadlock(RuntimeError):
    pass


class _Barrier:
    def __init__(self, count: int):
        self.count, self.arrived, self.phases = count, 0, 0

    def arrive(self) -> None:
        self.arrived += 1
        if self.arrived == self.count:
            self.arrived, self.phases = 0, self.phases + 1

    def passes(self, parity: int) -> bool:
        return self.phases % 2 != parity


def _producer(tiles: int, slots: int, lag: int):
    """The gather warpgroup as one thread: yields ("wait_empty", slot, parity), then ("issue",
    chunk), ("commit", chunk) in kernel.py's order."""
    chunks = tiles * NCHUNK
    for c in range(chunks):
        yield ("wait_empty", c % slots, ((c // slots) & 1) ^ 1)
        yield ("issue", c)
        if c >= lag:
            yield ("commit", c - lag)
    for c in range(max(chunks - lag, 0), chunks):
        yield ("commit", c)


def _consumer(w: int, tiles: int, slots: int):
    for i in range(w, tiles, CONSUMERS):
        for k in range(NCHUNK):
            c = i * NCHUNK + k
            yield ("wait_full", c % slots, (c // slots) & 1, c)
            if k > 0:
                yield ("release", c - 1)
        yield ("release", i * NCHUNK + NCHUNK - 1)


def run_protocol(tiles: int, slots: int, lag: int, seed: int = 0) -> int:
    """Replays the walk in a random interleaving; returns the steps taken."""
    rng = random.Random(seed)
    full = [_Barrier(1) for _ in range(slots)]
    empty = [_Barrier(1) for _ in range(slots)]
    ring: list[int | None] = [None] * slots  # the chunk a slot holds
    landed, committed, released = set(), set(), set()
    roles = [_producer(tiles, slots, lag)] + [_consumer(w, tiles, slots) for w in range(CONSUMERS)]
    pending = [next(r, None) for r in roles]
    steps = 0
    while any(p is not None for p in pending):
        ready = []
        for n, op in enumerate(pending):
            if op is None:
                continue
            if op[0] == "wait_empty" and not empty[op[1]].passes(op[2]):
                continue
            if op[0] == "wait_full" and not full[op[1]].passes(op[2]):
                continue
            ready.append(n)
        if not ready:
            raise Deadlock(f"tiles {tiles}, slots {slots}, lag {lag}: {pending}")
        n = rng.choice(ready)
        op = pending[n]
        if op[0] == "issue":
            old = ring[op[1] % slots]
            if old is not None and old not in released:
                raise AssertionError(f"chunk {op[1]} overwrites chunk {old} before its release")
            ring[op[1] % slots] = op[1]
            landed.add(op[1])
        elif op[0] == "commit":
            assert op[1] in landed
            committed.add(op[1])
            full[op[1] % slots].arrive()
        elif op[0] == "wait_full":
            c = op[3]
            if c not in committed or ring[op[1]] != c:
                raise AssertionError(f"a consumer passed its wait for chunk {c} too early")
        elif op[0] == "release":
            released.add(op[1])
            empty[op[1] % slots].arrive()
        pending[n] = next(roles[n], None)
        steps += 1
    return steps


def _entries(idx: torch.Tensor, length, s_q: int, s_kv: int, indices_global: bool):
    """(rows (tokens, topk) int64 into the flat kv, valid (tokens, topk) bool)."""
    tokens, topk = idx.shape
    batch = torch.arange(tokens) // s_q
    base = batch * s_kv
    entry = idx.long() - (base[:, None] if indices_global else 0)
    limit = torch.full((tokens,), topk) if length is None else length.long().clamp(0, topk)
    pos = torch.arange(topk)[None, :]
    valid = (pos < limit[:, None]) & (entry >= 0) & (entry < s_kv)
    return torch.where(valid, base[:, None] + entry, 0), valid, limit


def emulate_target(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    idx: torch.Tensor,
    scale: float,
    *,
    length: torch.Tensor | None = None,
    s_q: int | None = None,
    s_kv: int | None = None,
    indices_global: bool = False,
) -> torch.Tensor:
    """kernel.py's out (tokens, topk) fp32 for q (tokens, H, 576), kv (rows, 576) 16-bit, lse
    (tokens, H) fp32, idx int32 (tokens, topk) (launch's flat arguments)."""
    tokens, heads, width = q.shape
    topk = idx.shape[1]
    s_q = tokens if s_q is None else s_q
    s_kv = kv.shape[0] if s_kv is None else s_kv
    rows, valid, limit = _entries(idx, length, s_q, s_kv, indices_global)
    log2e = math.log2(math.e)
    lse2 = torch.where(torch.isneginf(lse), math.inf, lse.float() * log2e)
    out = torch.full((tokens, topk), float("nan"))
    scale_log2 = torch.tensor(scale * log2e, dtype=torch.float32)
    for t in range(tokens):
        n = int(limit[t])
        total = torch.zeros((), dtype=torch.float32)
        for i in range(-(-n // TILE)):
            pos = torch.arange(i * TILE, (i + 1) * TILE)
            inside = pos < n
            keys = torch.full((TILE, width), float("nan"))  # stale: never read
            ok = inside.clone()
            ok[inside] = valid[t, pos[inside]]
            keys[ok] = kv[rows[t, pos[ok]]].float()
            acc = torch.zeros(TILE, heads, dtype=torch.float32)
            for k in range(NCHUNK):  # K-chunk by K-chunk, fp32 accumulation
                cols = slice(k * CHUNK, (k + 1) * CHUNK)
                acc += keys[:, cols] @ q[t, :, cols].float().T
            p = torch.exp2(acc * scale_log2 - lse2[t][None, :])
            score = p.sum(1)
            for r in range(TILE):
                if inside[r]:
                    val = score[r] if ok[r] else torch.zeros(())
                    out[t, pos[r]] = val
                    total = total + val
        inv = 1.0 / (total + torch.tensor(L1_EPS, dtype=torch.float32))
        out[t, :n] = out[t, :n] * inv
        out[t, n:] = 0.0
    return out
