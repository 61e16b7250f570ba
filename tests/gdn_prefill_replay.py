"""A torch replay of the chunked prefill kernel's tile math (forgekernel/kernels/linear_attention/
gdn_prefill/sm90): the same per-chunk schedule, factor tables, masks and 16-bit roundings of
the WGMMA operands, the blocked inverse phase by phase with the lanes' data movement (the
merges' block products in tf32 as each lane's mma.sync fragments hold them), and
the transposed state S^T; the tests run it behind the real launcher and compare with the fp64
recurrence. Not a test module (imported by tests/test_gdn_prefill.py)."""

from __future__ import annotations

import math

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    BLOCK,
    CHUNK,
    L2NORM_EPS,
    ROWS_PER_STATE_WG,
    first_slot,
    state_wgs,
    value_row_block,
)

HALF = BLOCK // 2
LOG2E = math.log2(math.e)


# ----------------------------------------------------------------------------- the inverse


class Scratch:
    """The aux warpgroup's fp32 scratch (W 64 x 64, X 32 x 32) with the phase each block was
    last written in, so that a read of a block another warp writes in the same phase (a
    missing barrier) fails."""

    def __init__(self, lower: torch.Tensor):
        self.w = lower.clone()
        self.x = torch.zeros(2 * BLOCK, 2 * BLOCK)
        self.owner: dict[tuple[str, int, int], tuple[int, int]] = {}  # block -> (phase, warp)
        self.readers: dict[tuple[str, int, int], set[int]] = {}  # this phase's readers
        self.phase = 0

    def _view(self, name: str, i: int, j: int) -> torch.Tensor:
        t = self.w if name == "w" else self.x
        return t[BLOCK * i : BLOCK * (i + 1), BLOCK * j : BLOCK * (j + 1)]

    def read(self, name: str, i: int, j: int, warp: int) -> torch.Tensor:
        phase, writer = self.owner.get((name, i, j), (-1, warp))
        assert phase < self.phase or writer == warp, (
            f"warp {warp} reads {name}{i}{j}, written by warp {writer} in this phase"
        )
        self.readers.setdefault((name, i, j), set()).add(warp)
        return self._view(name, i, j).clone()

    def write(self, name: str, i: int, j: int, warp: int, value: torch.Tensor) -> None:
        others = self.readers.get((name, i, j), set()) - {warp}
        assert not others, f"warp {warp} overwrites {name}{i}{j}, read by {others} in this phase"
        self._view(name, i, j).copy_(value)
        self.owner[(name, i, j)] = (self.phase, warp)

    def barrier(self) -> None:
        self.phase += 1
        self.readers.clear()


def diagonal_inverse(lower: torch.Tensor) -> torch.Tensor:
    """Phase 0 of one warp: lane c solves (I + L) x = e_c down the column, x_i = [i = c] -
    sum_{j < i} L_ij x_j in ascending j (every lane reads row i of L, none another lane's
    registers); the columns side by side."""
    x: list[torch.Tensor] = []
    eye = torch.eye(BLOCK)
    for i in range(BLOCK):
        acc = eye[i].clone()
        for j in range(i):
            acc = acc - lower[i, j] * x[j]
        x.append(acc)
    return torch.stack(x)


MMA_K = 8  # mma.sync m16n8k8 (inverse_mma.py)
A_OFFSETS = ((0, 0), (8, 0), (0, 4), (8, 4))  # a lane's a-fragment (row, column) from (g, t)


def _fragments(offsets) -> tuple[torch.Tensor, torch.Tensor]:
    """Every lane's fragment elements (row, column) of one m16n8k8 operand, lane 4 g + t."""
    rows, cols = zip(*[f(g, t) for g, t in (divmod(lane, 4) for lane in range(32))
                       for f in offsets])  # fmt: skip
    return torch.tensor(rows), torch.tensor(cols)


_A_FRAGMENTS = _fragments([lambda g, t, dr=dr, dc=dc: (g + dr, t + dc) for dr, dc in A_OFFSETS])
_B_FRAGMENTS = _fragments([lambda g, t, dk=dk: (t + dk, g) for dk in (0, 4)])


def tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> tf32 values: + half a tf32 ulp, low 13 bits cleared (inverse_mma's rounding)."""
    bits = x.contiguous().view(torch.int32) + 0x1000
    return (bits & ~0x1FFF).view(torch.float32)


def mma_product(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """A 16 x 16 block product as `inverse_mma.mma_block_product` forms it: lane 4 g + t reads
    its a / b fragment elements from x and y, each m16n8k8 step multiplies the assembled
    (16 x 8) (8 x 8) operands, rounded to tf32, into the C fragments (fp32 sums; the hardware's
    summation order is not modelled)."""
    acc = torch.zeros(BLOCK, BLOCK)
    ar, ac = _A_FRAGMENTS
    br, bc = _B_FRAGMENTS
    for s in range(BLOCK // MMA_K):
        a = torch.zeros(BLOCK, MMA_K)
        a[ar, ac] = x[ar, MMA_K * s + ac]
        for n in range(BLOCK // MMA_K):
            b = torch.zeros(MMA_K, MMA_K)
            b[br, bc] = y[MMA_K * s + br, MMA_K * n + bc]
            acc[:, MMA_K * n : MMA_K * (n + 1)] += tf32(a) @ tf32(b)
    return acc


def blocked_inverse(lower: torch.Tensor) -> torch.Tensor:
    """T = (I + L)^-1 of a strictly lower 64 x 64 fp32 L by the kernel's schedule
    (inverse.invert_diagonal, inverse_mma.invert_merge_mma): phase 0 the diagonal blocks in
    fp32, phase 1 T_10, T_32, X_21, X_31 (X_20, X_30 kept in registers), phase 2a X_20, X_30,
    phase 2b T_20, T_21, T_30, T_31, each block product in tf32 (`mma_product`)."""
    mul = mma_product

    sc = Scratch(lower)
    for w in range(4):
        sc.write("w", w, w, w, diagonal_inverse(sc.read("w", w, w, w)))
    sc.barrier()
    kept = {}
    for w in range(4):
        if w >= 2:
            sc.write("x", w - 2, 1, w, mul(sc.read("w", w, 1, w), sc.read("w", 1, 1, w)))
            kept[w] = mul(sc.read("w", w, 0, w), sc.read("w", 0, 0, w))
        else:
            b = 2 * w
            z = mul(sc.read("w", b + 1, b, w), sc.read("w", b, b, w))
            sc.write("w", b + 1, b, w, z)
            sc.write("w", b + 1, b, w, -mul(sc.read("w", b + 1, b + 1, w), z))
    sc.barrier()
    for w in (2, 3):
        kept[w] = kept[w] + mul(sc.read("w", w, 1, w), sc.read("w", 1, 0, w))
        sc.write("x", w - 2, 0, w, kept[w])
    sc.barrier()
    for w in range(4):
        i, j = 2 + w // 2, w % 2
        acc = mul(sc.read("w", i, 2, w), sc.read("x", 0, j, w))
        if w >= 2:
            acc = acc + mul(sc.read("w", 3, 3, w), sc.read("x", 1, j, w))
        sc.write("w", i, j, w, -acc)
    sc.barrier()
    return sc.w


# ----------------------------------------------------------------------------- one chunk


def _round(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A 16-bit WGMMA operand (or the stored output): rounded, computed on in fp32."""
    return x.to(dtype).float()


def gates(g: torch.Tensor) -> torch.Tensor:
    """The gate warp: G2 = log2(e) cumsum(g) over the chunk (lane l: tokens 2 l, 2 l + 1, an
    inclusive warp scan of the pair sums)."""
    pairs = g.view(-1, 2)
    incl = pairs.sum(1).cumsum(0)
    before = incl - pairs.sum(1)
    return torch.stack([before + pairs[:, 0], incl], 1).reshape(-1) * LOG2E


WARP_ROWS = 16  # accumulator rows per aux warp (aux_wy.WARP_ROWS)


def decay_form(i: int, j: int) -> str:
    """How the kernel's masks form d_ij = 2^(G2_i - h_j) (aux_wy._decay_mask): by the 8-column
    group n = j // 8 against the warp w = i // 16, the row i0 = i - 8 of the same thread for
    the second row band: 'factored' (2^(G2_i - G2_i0) d_i0j), 'direct', or 'zero' (none)."""
    w, n, second = i // WARP_ROWS, j // 8, i % WARP_ROWS >= 8
    if n < 2 * w:
        return "factored" if second else "direct"
    if n == 2 * w:
        return "direct"
    if n == 2 * w + 1:
        return "direct" if second else "zero"
    return "zero"


_NAMES = ("direct", "factored", "zero")
_FORM_IDS = torch.tensor(
    [[_NAMES.index(decay_form(i, j)) for j in range(CHUNK)] for i in range(CHUNK)]
)


def form_mask(name: str) -> torch.Tensor:
    """The (C, C) elements whose power the kernel forms as `name` (decay_form)."""
    return _FORM_IDS == _NAMES.index(name)


def decay_powers(g2: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """d (C x C) as the kernel forms it (decay_form); 0 where it forms none (every such (i, j)
    has j > i: masked in both L and P)."""
    direct = torch.exp2(g2[:, None] - h[None, :])
    rows = torch.arange(CHUNK)
    i0 = (rows - 8).clamp(min=0)
    factored = torch.exp2(g2 - g2[i0])[:, None] * torch.exp2(g2[i0][:, None] - h[None, :])
    d = torch.where(form_mask("factored"), factored, direct)
    return torch.where(form_mask("zero"), torch.zeros(()), d)


def _norms(x, l2norm):
    return torch.rsqrt((x * x).sum(1) + L2NORM_EPS) if l2norm else torch.ones(CHUNK)


def t_chunk(k, g, beta, dtype, l2norm):
    """T diag(beta) of one chunk, rounded to 16 bits: the aux warpgroup's L, inverse and
    scaling, which the T precompute (`t_pre.py`) runs as they are (k the 16-bit tile as fp32,
    g and beta 0 past the sequence)."""
    g2 = gates(g)
    rows = torch.arange(CHUNK)
    rk = _norms(k, l2norm)
    h = g2 - torch.log2(rk) if l2norm else g2  # rk_j 2^-G2_j as one exponent
    below = rows[None, :] < rows[:, None]  # j < i
    d_l = torch.where(below, decay_powers(g2, h), torch.zeros(()))
    lower = (k @ k.t()) * d_l * (beta * rk)[:, None]
    t = blocked_inverse(lower)
    return _round(t * beta[None, :], dtype)


def aux_chunk(q, k, g, beta, scale, dtype, l2norm, tb=None):
    """The aux warpgroup: (P, T diag(beta), tables fK, fQ, fU, 2^G2_C) of one chunk (C rows;
    q, k the 16-bit tiles as fp32, g and beta 0 past the sequence). tb: T diag(beta) as the
    `t_pre` form reads it from the precompute's buffer (then not formed here)."""
    g2 = gates(g)
    rows = torch.arange(CHUNK)
    rq, rk = _norms(q, l2norm), _norms(k, l2norm)
    h = g2 - torch.log2(rk) if l2norm else g2
    seen = rows[None, :] <= rows[:, None]  # j <= i
    d_p = torch.where(seen, decay_powers(g2, h), torch.zeros(()))
    p = _round((q @ k.t()) * d_p * (scale * rq)[:, None], dtype)
    if tb is None:
        tb = t_chunk(k, g, beta, dtype, l2norm)
    gc = g2[-1]
    tables = (rk * torch.exp2(g2), scale * rq * torch.exp2(g2), rk * torch.exp2(gc - g2))
    return p, tb, tables, torch.exp2(gc)


def state_chunk(st, q, k, v, aux, dtype):
    """The state warpgroups (value rows split 64 / 64, each row independent): S^T (V, K) fp32
    -> (O^T (V, C) rounded, the next S^T)."""
    p, tb, (fk, fq, fu), gcp = aux
    sb = _round(st, dtype)  # the accumulator as a 16-bit A operand
    x = sb @ k.t()
    o = sb @ q.t()
    x = v.t() - x * fk[None, :]
    o = o * fq[None, :]
    u = _round(x, dtype) @ tb.t()
    o = o + _round(u, dtype) @ p.t()
    st = st * gcp + _round(u * fu[None, :], dtype) @ k
    return _round(o, dtype), st


def _tile(x, pad, c0, c1):
    """Rows c0 .. c1 of x padded to a chunk with the rows TMA would read past the end (pad, then
    zeros)."""
    rest = CHUNK - (c1 - c0)
    fill = torch.zeros(rest, x.shape[1])
    if pad is not None:
        fill[: min(rest, pad.shape[0])] = pad[:rest]
    return torch.cat([x[c0:c1], fill])


def sequence(q, k, v, g, beta, st, scale, dtype, l2norm, tail_rows=None, t_tiles=None):
    """One (sequence, value head): q, k (L, K), v (L, V) 16-bit values as fp32, g, beta (L,),
    st = S^T (V, K) fp32 -> (o (L, V), S^T). Chunks past the end are padded with tail_rows
    (the rows TMA would load there: the next sequence's, or zeros past T), gates with 0.
    t_tiles: the `t_pre` form's T diag(beta) tiles, chunk by chunk (fp32 views of the
    precompute's buffer), or None (formed by the aux)."""
    n = q.shape[0]
    out = torch.empty(n, v.shape[1])
    for c0 in range(0, n, CHUNK):
        c1 = min(c0 + CHUNK, n)

        pads = (None, None, None) if tail_rows is None else tail_rows
        qt, kt, vt = (_tile(x, pad, c0, c1) for x, pad in zip((q, k, v), pads))
        gt = torch.cat([g[c0:c1], torch.zeros(CHUNK - (c1 - c0))])
        bt = torch.cat([beta[c0:c1], torch.zeros(CHUNK - (c1 - c0))])
        tb = None if t_tiles is None else t_tiles[c0 // CHUNK]
        aux = aux_chunk(qt, kt, gt, bt, scale, dtype, l2norm, tb)
        halves = []
        for w in range(v.shape[1] // ROWS_PER_STATE_WG):
            rows = slice(ROWS_PER_STATE_WG * w, ROWS_PER_STATE_WG * (w + 1))
            o_w, st_w = state_chunk(st[rows], qt, kt, vt[:, rows], aux, dtype)
            halves.append((o_w, st_w))
        out[c0:c1] = torch.cat([o for o, _ in halves]).t()[: c1 - c0]
        st = torch.cat([s for _, s in halves])
    return out, st


def split_parts(v_dim: int, v_split: int) -> list[slice]:
    """The value rows each CTA of a V split holds: part p's state warpgroups w take the 64-row
    blocks `value_row_block(p, w, wgs)` (the kernel's own helper), which must tile [0, V)."""
    wgs = state_wgs(v_dim, v_split)
    parts = []
    for p in range(v_split):
        blocks = [value_row_block(p, w, wgs) for w in range(wgs)]
        assert blocks == list(range(blocks[0], blocks[0] + wgs))  # contiguous in the v tile
        parts.append(slice(ROWS_PER_STATE_WG * blocks[0], ROWS_PER_STATE_WG * (blocks[-1] + 1)))
    return parts


def _tail(x, t0, t1):
    """Chunk rows past a sequence ending at t1 as a TMA box from t0 reads them (the next
    sequence's rows, zeros past T): the rows after t1."""
    return x[t1 : t1 + CHUNK].float()


def t_pre_kernel(params: dict):
    """The T precompute's compiled-function stand-in: fn(k, g, beta, cu_seqlens, t) writes
    T diag(beta) of chunk c of sequence n, value head hv, to rows [C s, C s + C) of t[:, hv]
    with s = first_slot(bos_n, n) + c, as `t_pre.py` does (its k box from the sequence's first
    token, rows past the end the next sequence's); the other slots untouched."""
    dtype = torch.float16 if params["dtype"] == "float16" else torch.bfloat16

    def fn(k, g, beta, cu_seqlens, t):
        assert t.shape[0] % CHUNK == 0 and t.shape[2] == CHUNK and t.dtype == k.dtype
        group = g.shape[1] // k.shape[1]
        edges = cu_seqlens.tolist()
        for n, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
            for hv in range(g.shape[1]):
                ks, tail = k[t0:t1, hv // group].float(), _tail(k[:, hv // group], t0, t1)
                for c0 in range(0, t1 - t0, CHUNK):
                    c1 = min(c0 + CHUNK, t1 - t0)
                    pad = CHUNK - (c1 - c0)
                    gt = torch.cat([g[t0 + c0 : t0 + c1, hv], torch.zeros(pad)])
                    bt = torch.cat([beta[t0 + c0 : t0 + c1, hv].float(), torch.zeros(pad)])
                    tb = t_chunk(_tile(ks, tail, c0, c1), gt, bt, dtype, params["l2norm"])
                    s = first_slot(t0, n) + c0 // CHUNK
                    t[CHUNK * s : CHUNK * (s + 1), hv] = tb.to(dtype)

    return fn


def kernel(params: dict):
    """The launcher's compiled-function stand-in: fn(q, k, v, g, beta, init, cu_seqlens, out,
    final, scale, t_pre) over varlen tensors, as the kernel computes it (a tail chunk sees the
    next sequence's rows, as its TMA boxes do; with a V split each CTA's value rows on their
    own, the aux work recomputed per CTA; with the `t_pre` key T diag(beta) read from the
    precompute's buffer `t_pre` at the chunk's slot; with `no_o` the final state only)."""
    dtype = torch.float16 if params["dtype"] == "float16" else torch.bfloat16
    parts = split_parts(params["v"], params.get("v_split", 1))
    reads_t = params.get("t_pre", False)

    def fn(q, k, v, g, beta, init, cu_seqlens, out, final, scale, t_pre=None):
        assert (t_pre is not None) == reads_t
        group = v.shape[1] // q.shape[1]
        edges = cu_seqlens.tolist()
        for n, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
            for hv in range(v.shape[1]):
                if init is None:
                    st = torch.zeros(params["v"], params["k"])
                else:
                    st = init[n, hv].float() if params["k_last"] else init[n, hv].t().float()
                h = hv // group
                qs, ks = (x[t0:t1, h].float() for x in (q, k))
                tiles = None
                if reads_t:
                    s0 = first_slot(t0, n)
                    nc = (t1 - t0 + CHUNK - 1) // CHUNK
                    tiles = [t_pre[CHUNK * s : CHUNK * (s + 1), hv].float()
                             for s in range(s0, s0 + nc)]  # fmt: skip
                for cols in parts:  # one CTA each
                    vs = v[t0:t1, hv, cols].float()
                    tail = tuple(x[t1 : t1 + CHUNK].float()
                                 for x in (q[:, h], k[:, h], v[:, hv, cols]))  # fmt: skip
                    o, st_p = sequence(qs, ks, vs, g[t0:t1, hv], beta[t0:t1, hv], st[cols],
                                       scale, dtype, params["l2norm"], tail, tiles)  # fmt: skip
                    if not params.get("no_o", False):  # the `no_o` key writes no o
                        out[t0:t1, hv, cols] = o.to(out.dtype)
                    if params["k_last"]:
                        final[n, hv, cols] = st_p
                    else:
                        final[n, hv, :, cols] = st_p.t()

    return fn
