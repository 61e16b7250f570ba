"""CPU models of kernel.py (torch only, no DSL) for the tests.

`run_protocol` replays the ring walk with the mbarriers' parity semantics (a wait for parity p
passes while the barrier's completed-phase count n has n % 2 != p): the producer issues tile i
into stage i % STAGES after waiting for its release, commits a cp.async group a tile (empty
groups past the last tile) and signals tile i - LAG once its group has landed; consumer
warpgroup w takes tiles w, w + 2, ... . In random interleavings it raises on a deadlock, on a
consumer that passes its wait before its tile is signalled, or on a stage overwritten before its
consumer released it.

`dk_reduction_map` lists what each lane of a warp adds by `red.global.add.v4.f32` in
`_reduce_dk` (the accumulator's (row, column) of each of its four values), from the WGMMA
accumulator layout and the lane-pair swap.

`emulate_backward` computes the op's gradients the kernel's way: the prologue (g, its row sum,
G, flat ids, the tiles through the last valid slot), TILE-slot tiles taken by the two consumer
warpgroups alternately (each its own dq / dw partials, added at the end), dS rounded to the
input dtype (both GEMMs read the rounded dS), dK rows added tile by tile.
"""

from __future__ import annotations

import random

import torch

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.config import (
    CLIP_PROB_MIN,
    CONSUMERS,
    LAG,
    STAGES,
    TILE,
)


class Deadlock(RuntimeError):
    pass


class _Barrier:
    def __init__(self):
        self.phases = 0

    def complete(self) -> None:
        self.phases += 1

    def passes(self, parity: int) -> bool:
        return self.phases % 2 != parity


def _producer(tiles: int, stages: int, lag: int):
    """The gather warpgroup as one thread, in kernel.py's order."""
    for i in range(tiles + lag):
        if i < tiles:
            yield ("wait_empty", i % stages, ((i // stages) & 1) ^ 1)
            yield ("issue", i)
        if i >= lag:
            yield ("signal", i - lag)


def _consumer(w: int, tiles: int, stages: int, consumers: int):
    for i in range(w, tiles, consumers):
        yield ("wait_full", i % stages, (i // stages) & 1)
        yield ("read", i)
        yield ("release", i)


def run_protocol(
    tiles: int, seed: int, stages: int = STAGES, lag: int = LAG, consumers: int = CONSUMERS
) -> None:
    """One random interleaving of the producer and the consumers over `tiles` tiles (the pair
    plan: one consumer, config.PAIR's stages)."""
    rng = random.Random(seed)
    full = [_Barrier() for _ in range(stages)]
    empty = [_Barrier() for _ in range(stages)]
    holder = [None] * stages  # the tile a stage holds, None once released
    signalled: set[int] = set()
    actors = [_producer(tiles, stages, lag)]
    actors += [_consumer(w, tiles, stages, consumers) for w in range(consumers)]
    pending = [next(a, None) for a in actors]
    while any(p is not None for p in pending):
        ready = []
        for n, p in enumerate(pending):
            if p is None:
                continue
            if p[0] == "wait_empty" and not empty[p[1]].passes(p[2]):
                continue
            if p[0] == "wait_full" and not full[p[1]].passes(p[2]):
                continue
            ready.append(n)
        if not ready:
            raise Deadlock(f"tiles {tiles}: {pending}")
        n = rng.choice(ready)
        op = pending[n]
        if op[0] == "issue":
            s = op[1] % stages
            if holder[s] is not None:
                raise AssertionError(f"tile {op[1]} overwrites stage {s} holding {holder[s]}")
            holder[s] = op[1]
        elif op[0] == "signal":
            signalled.add(op[1])
            full[op[1] % stages].complete()
        elif op[0] == "read":
            if op[1] not in signalled or holder[op[1] % stages] != op[1]:
                raise AssertionError(f"tile {op[1]} read before it was signalled")
        elif op[0] == "release":
            holder[op[1] % stages] = None
            empty[op[1] % stages].complete()
        pending[n] = next(actors[n], None)


def dk_reduction_map(chunk: int = 64) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """{(warp, lane, j): four (row, column) accumulator coordinates} of one warpgroup's 64 x
    `chunk` dK accumulator: WGMMA's layout (warp v rows 16 v .. 16 v + 15; lane l holds raw
    element 4 j + 2 h + e = (16 v + l // 4 + 8 h, 8 j + 2 (l % 4) + e)), then the swap of
    `_reduce_dk` (lane 2m keeps row r's pair and takes its partner's, lane 2m + 1 row r + 8's)."""

    def held(v, lane, j, h, e):
        return (16 * v + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e)

    out = {}
    for v in range(4):
        for lane in range(32):
            odd = lane % 2
            partner = lane ^ 1
            for j in range(chunk // 8):
                if odd:  # (partner's h = 1 pair, own h = 1 pair)
                    vals = [held(v, partner, j, 1, e) for e in range(2)]
                    vals += [held(v, lane, j, 1, e) for e in range(2)]
                else:  # (own h = 0 pair, partner's h = 0 pair)
                    vals = [held(v, lane, j, 0, e) for e in range(2)]
                    vals += [held(v, partner, j, 0, e) for e in range(2)]
                out[(v, lane, j)] = vals
    return out


def kernel_destination(v: int, lane: int, j: int) -> tuple[int, int]:
    """The (row, first column) `_reduce_dk` adds lane `lane` of warp v's j-th quad to:
    row dk_crd[0][0] + 8 (lane % 2), columns 8 j + 4 ((lane % 4) // 2) .. + 3."""
    return (16 * v + lane // 4 + 8 * (lane % 2), 8 * j + 4 * ((lane % 4) // 2))


def staged_round_trip(chunk: int = 64) -> dict[tuple[int, int], list[tuple[int, int]]]:
    """{(lane, k): the four (row, column) accumulator coordinates lane `lane` reads back by its
    k-th 128-bit load} in `_reduce_staged`: the warp's 16 x `chunk` fp32 rows stored at
    row x chunk + (piece ^ row % 8) x 4 + column % 4 (piece = column // 4) from the WGMMA
    fragment (rows lane // 4 + 8 h, columns 8 j + 2 (lane % 4) + e), read at row 2 k + lane // 16,
    piece lane % 16 through the same swizzle. Raises on two values stored at one offset."""
    store = {}
    for lane in range(32):
        quad = lane % 4
        for j in range(chunk // 8):
            for h in range(2):
                row = lane // 4 + 8 * h
                piece = (2 * j + quad // 2) ^ (row % 8)
                for e in range(2):
                    off = row * chunk + piece * 4 + 2 * (quad % 2) + e
                    if off in store:
                        raise AssertionError(f"offset {off} stored twice")
                    store[off] = (row, 8 * j + 2 * quad + e)
    out = {}
    for lane in range(32):
        for k in range(8):
            row = 2 * k + lane // 16
            off = row * chunk + ((lane % 16) ^ (row % 8)) * 4
            out[(lane, k)] = [store[off + e] for e in range(4)]
    return out


def _prologue(target, predict, idx, base, s_kv, indices_global, scale):
    """(G, flat ids (-1: padding), tiles) of one row, as the kernel's prologue."""
    local = idx.long() - (base if indices_global else 0)
    valid = (local >= 0) & (local < s_kv)
    g = torch.where(predict >= CLIP_PROB_MIN, -scale * target.clamp(min=CLIP_PROB_MIN), 0.0)
    total = g.sum()
    grad = torch.where(valid, g - predict * total, 0.0)
    ids = torch.where(valid, local + base, -1)
    pos = torch.nonzero(valid)
    last = int(pos.max()) if pos.numel() else -1
    return grad, ids, (last + TILE) // TILE


def emulate_backward(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    target: torch.Tensor,
    predict: torch.Tensor,
    topk_indices: torch.Tensor,
    grad_loss: float,
    sm_scale: float,
    loss_coeff: float,
    indices_global: bool,
    *,
    dtype: torch.dtype = torch.float64,
    ds_dtype: torch.dtype | None = None,
    consumers: int = CONSUMERS,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dw, dk) in `dtype` for the op's 3-D / 4-D layouts, the kernel's decomposition
    (module docstring); ds_dtype: dS rounded to it (the kernel: q's dtype), None: not rounded;
    consumers: the plan's consumer warpgroups (the pair plan: 1, one partial)."""
    four = q.dim() == 4
    q4, w3, k3, t3, p3, i3 = (x if four else x[None] for x in (q, weights, k, target, predict,
                                                                topk_indices))  # fmt: skip
    b, s_q, heads, dim = q4.shape
    s_kv = k3.shape[1]
    kf = k3.reshape(b * s_kv, dim).to(dtype)
    dq = torch.zeros(b * s_q, heads, dim, dtype=dtype)
    dw = torch.zeros(b * s_q, heads, dtype=dtype)
    dk = torch.zeros(b * s_kv, dim, dtype=dtype)
    scale = grad_loss * loss_coeff / (b * s_q)
    for t in range(b * s_q):
        bt, st = divmod(t, s_q)
        qt = q4[bt, st].to(dtype)
        ws = w3[bt, st].to(dtype) * sm_scale
        grad, ids, tiles = _prologue(t3[bt, st].to(dtype), p3[bt, st].to(dtype), i3[bt, st],
                                     bt * s_kv, s_kv, indices_global, scale)  # fmt: skip
        part_dq = torch.zeros(consumers, heads, dim, dtype=dtype)
        part_dw = torch.zeros(consumers, heads, dtype=dtype)
        for i in range(tiles):
            w = i % consumers
            tid = ids[i * TILE : (i + 1) * TILE]
            tg = grad[i * TILE : (i + 1) * TILE]
            n = tid.shape[0]
            ktile = torch.zeros(TILE, dim, dtype=dtype)  # zero-filled padding rows
            ok = tid >= 0
            ktile[:n][ok] = kf[tid[ok]]
            gt = torch.zeros(TILE, dtype=dtype)
            gt[:n] = tg
            s = (qt @ ktile.T) * sm_scale  # (heads, TILE)
            part_dw[w] += (gt[None, :] * s.clamp(min=0)).sum(-1)
            ds = torch.where(s > 0, gt[None, :] * ws[:, None], 0.0)
            if ds_dtype is not None:
                ds = ds.to(ds_dtype).to(dtype)
            part_dq[w] += ds @ ktile
            dk_tile = ds.T @ qt  # (TILE, dim)
            rows = torch.zeros(TILE, dtype=torch.long) - 1
            rows[:n] = tid
            keep = rows >= 0
            dk.index_add_(0, rows[keep], dk_tile[keep])
        dq[t] = part_dq.sum(0)
        dw[t] = part_dw.sum(0)
    return dq.view(q.shape), dw.view(weights.shape), dk.view(k.shape)
