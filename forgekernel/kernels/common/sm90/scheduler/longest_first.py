"""Longest-first tile order for a persistent attention kernel: tiles are (query-row block,
query head, batch), numbered t = 0, 1, ...; CTA c takes t = c, c + grid, c + 2 grid, ...
(or, with `snake`, odd full rounds of `grid` tiles dealt to the CTAs in reverse).

The row block is the slowest index over every batch and head, so with a causal mask the
longest row blocks (the last ones, which see the most keys) run first everywhere
(longest-processing-time first: the short ones fill the tail), and the CTAs running at one
time share whole GQA groups' K and V through L2. When one wave of such tiles would touch far
more K and V than L2 holds (long sequences with few query heads per kv head: MHA 192/128 at
8192 reads ~130 kv heads of 5 MB a wave, 0.73 of FA4 against 0.83-0.93 in sections, H200),
fixed-length tiles go instead batch by batch, in sections of heads whose K and V fit in L2
together, the row block slowest within a section. The paged mode (chunked prefill beside
decode rows) goes sequence by sequence, the row block slowest within a sequence (`tile`).
"""

from __future__ import annotations

from typing import NamedTuple

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

# K and V bytes the concurrently running tiles may share from L2 (50 MiB on H100 / H200).
L2_KV_BUDGET = 24 * 2**20
# K/V footprint (KiB) of one wave of longest-first tiles above which sections are used:
# 160 MiB kept D=256 b4 hq16 s4096 (a 256 MiB wave) in sections, 1.084 ms against 1.057 ms.
WAVE_KV_LIMIT_KIB = 320 * 2**10


class TileGrid(NamedTuple):
    """The problem the order walks. The tensors are in (S, D, H, B) order (varlen: packed, a
    unit batch mode); their sizes are read where `tile` uses them, inside the tile loop."""

    num_m_blocks: Int32  # row blocks of the longest query sequence
    mQ: cute.Tensor  # queries: heads, batch, fixed-length Sq (packed: (G, Sq) rows)
    mK: cute.Tensor  # keys: kv heads, fixed-length Sk
    cu_seqlens_q: cute.Tensor | None  # varlen: int32 (B + 1,) offsets; else None
    cu_seqlens_k: cute.Tensor | None  # varlen: offsets (B + 1,); paged: lengths (B,)


class WorkTile(NamedTuple):
    """One tile: `valid` is false for a varlen row block past its sequence's end; batch indexes
    the tensors (0 for varlen, whose sequences are row offsets q_off / k_off); seq is the
    sequence (its page-table row when the keys are paged)."""

    valid: cutlass.Boolean
    m_block: Int32
    head: Int32
    batch: Int32
    q_off: Int32
    k_off: Int32
    seqlen_q: Int32
    seqlen_k: Int32
    seq: Int32


class LongestFirst:
    """The order of tiles of `tile_m` query rows. kv_row_bytes: K + V bytes of one key row
    (decides the L2 sections of fixed-length problems). paged (with varlen): the keys live in
    pages, cu_seqlens_k holds each sequence's length (no key offsets), and the tiles go
    sequence by sequence (`tile`); min_seqlen_q (paged): the tiles of sequences with fewer
    query tokens are not valid (another kernel's rows); l2_kv_budget: the K and V bytes of
    one L2 section (L2_KV_BUDGET; FA4 sections 8 heads, up to 50 MB); wave_kv_limit_kib: the
    wave footprint above which fixed-length tiles go in sections (WAVE_KV_LIMIT_KIB; 0:
    whenever a head's K and V reach 1 KiB, i.e. always on real shapes: FA4's rule)."""

    def __init__(
        self, tile_m: int, causal: bool, varlen: bool, kv_row_bytes: int, paged: bool = False,
        min_seqlen_q: int = 0, l2_kv_budget: int = L2_KV_BUDGET,
        wave_kv_limit_kib: int = WAVE_KV_LIMIT_KIB,
    ):  # fmt: skip
        self.tile_m = tile_m
        self.causal = causal
        self.varlen = varlen
        self.kv_row_bytes = kv_row_bytes
        self.paged = paged
        self.min_seqlen_q = min_seqlen_q
        self.l2_kv_budget = l2_kv_budget
        self.wave_kv_limit_kib = wave_kv_limit_kib

    @cute.jit
    def tile(self, t: Int32, grid: TileGrid) -> WorkTile:
        """Tile t of the order."""
        num_m_blocks, mQ, mK, cu_q, cu_k = grid
        num_heads = mQ.shape[2]
        group = num_heads // mK.shape[2]
        num_batch = mQ.shape[3] if const_expr(not self.varlen) else cu_q.shape[0] - 1
        per_m = num_heads * num_batch
        m_rev = t // per_m
        rest = t - m_rev * per_m
        batch = rest // num_heads
        head = rest - batch * num_heads
        if const_expr(self.paged):
            # Sequence by sequence (its row blocks longest first, heads fastest): the valid
            # tiles of a batch's long sequences are contiguous in t, dealt round-robin over
            # every CTA. Row block slowest, a slice of tiles (heads x batch) that the grid
            # divides put a sequence's tiles of every row block on the same CTAs: the 2048-row
            # chunk beside 32 decode rows (33 x 32 tiles a block, 8 x 132) ran its 512 tiles
            # on 32 of 132 SMs (4.07 ms against FlashInfer's 1.57, H200).
            per_seq = num_heads * num_m_blocks
            batch = t // per_seq
            in_seq = t - batch * per_seq
            m_rev = in_seq // num_heads
            head = in_seq - m_rev * num_heads
        if const_expr(not self.varlen):
            kv_bytes = cutlass.max(mK.shape[0] * self.kv_row_bytes, 1)
            if self._in_sections(grid):
                per_batch = num_heads * num_m_blocks
                batch = t // per_batch
                r = t - batch * per_batch
                section = cutlass.min(
                    cutlass.max(self.l2_kv_budget // kv_bytes, 1) * group, num_heads
                )
                first_head = (r // (section * num_m_blocks)) * section
                heads_here = cutlass.min(section, num_heads - first_head)
                idx = r - first_head * num_m_blocks
                m_rev = idx // heads_here
                head = first_head + idx - m_rev * heads_here
        q_off = Int32(0)
        k_off = Int32(0)
        seqlen_q = cute.size(mQ, mode=[0])  # fixed-length GQA-packed: (G, Sq) rows
        seqlen_k = mK.shape[0]
        m_blocks = num_m_blocks
        seq = batch
        if const_expr(self.varlen):
            q_off = cu_q[batch]
            k_off = cu_k[batch]
            seqlen_q = cu_q[batch + 1] - q_off
            if const_expr(self.paged):
                seqlen_k = k_off  # a length (the keys are in pages: no offset)
                k_off = Int32(0)
            else:
                seqlen_k = cu_k[batch + 1] - k_off
            m_blocks = (seqlen_q + self.tile_m - 1) // self.tile_m
            if const_expr(self.paged and self.min_seqlen_q > 1):
                m_blocks = Int32(cutlass.select_(seqlen_q < self.min_seqlen_q, 0, m_blocks))
            batch = Int32(0)  # the packed tensors' unit batch mode; the sequence is an offset
        m_block = m_rev
        if const_expr(self.causal):
            m_block = m_blocks - 1 - m_rev
        return WorkTile(
            m_rev < m_blocks, m_block, head, batch, q_off, k_off, seqlen_q, seqlen_k, seq
        )

    @cute.jit
    def _in_sections(self, grid: TileGrid) -> cutlass.Boolean:
        """Fixed length: whether one wave of longest-first tiles would read more K and V than
        wave_kv_limit_kib (WAVE_KV_LIMIT_KIB; then the tiles go in L2 sections)."""
        _, mQ, mK, _, _ = grid
        group = mQ.shape[2] // mK.shape[2]
        kv_bytes = cutlass.max(mK.shape[0] * self.kv_row_bytes, 1)
        wave_kv_heads = cutlass.min(cute.arch.grid_dim()[0] // group + 1, mQ.shape[3] * mK.shape[2])
        return wave_kv_heads * (kv_bytes // 1024) > self.wave_kv_limit_kib

    @cute.jit
    def snake(self, s: Int32, step: Int32, num_tiles: Int32, grid: TileGrid) -> Int32:
        """The tile that CTA s % step runs as its (s // step)-th: s itself in even rounds (a
        round: `step` consecutive tiles, one a CTA), step - 1 - (s % step) of the round in
        odd full rounds (a partial last round keeps s, so a slot below num_tiles is a tile
        below it). In the longest-first order the CTA that took a round's longest tile takes
        the next round's shortest: D=256 b4 hq16 s4096 causal (2048 tiles of 2 to 64 key
        blocks, 132 CTAs), the busiest CTA runs 544 blocks plain, 516 snaked (the mean: 512;
        a model: blocks, no per-tile cost). Not in L2 sections (each a saw of tiles long to
        short: 192/128 b2 hq128 s8192, 256 tiles a section, 1.5% over the mean plain, 3.0%
        snaked) nor varlen (per-sequence lengths: the order is not longest-first)."""
        first = s // step * step
        t = s
        if const_expr(not self.varlen):
            if (s // step) % 2 == 1 and first + step <= num_tiles:
                mirrored = first + step - 1 - (s - first)
                t = Int32(cutlass.select_(self._in_sections(grid), s, mirrored))
        return t

    @cute.jit
    def next_tile(self, t: Int32, step: Int32, work: WorkTile, grid: TileGrid) -> Int32:
        """The CTA's tile after t = `work`'s: t + step; paged, past an invalid tile (its
        sequence has none valid later in t: its row blocks ran out, or it is skipped), the
        CTA's first t in the next sequence (a decode row's 512 slots at 16 row blocks x 32
        heads were 3-4 empty iterations of every CTA, 124 of its 128 at c2048of16k+32dec).
        The paged kernel computes it at the tile's start (one register live through the tile,
        not work's: at the end, D 256's consumers spilled 16 bytes)."""
        nxt = t + step
        if const_expr(self.paged):
            end = (work.seq + 1) * (grid.mQ.shape[2] * grid.num_m_blocks)
            ahead = (end - nxt + step - 1) // step * step
            nxt = Int32(cutlass.select_(work.valid, nxt, cutlass.max(nxt, nxt + ahead)))
        return nxt
