"""Which tiles and steps a main-kernel CTA walks; every role derives the same sequence.

A tile is (key block, kv head, batch) (head_split: a query head); its steps are its query
heads x the query blocks [m_begin, m_end) that see one of its keys (causal: from the
diagonal), head by head, the query blocks ascending (walk_order 0) or descending (2). The
launch order (grid index or, persistent, the tile counter's id) maps to a tile directly or,
with l2_swizzle, through `config.swizzled_block`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from forgekernel.kernels.attention.bwd.sm90.config import swizzled_block


class Walk:
    """The CTA's tiles and steps (mixed into AttentionBwdSm90)."""

    @cute.jit
    def _tile_work(self, tile, mK: cute.Tensor, group, seqlen_q, seqlen_k):
        """A persistent tile's (key block, kv head, batch, m_begin, m_end, m_unmasked, steps):
        its kv head's whole query-head group over its query blocks (_query_blocks)."""
        n_block, head_kv, batch = self._tile_coords(tile, mK)
        m_begin, m_end, m_unmasked = self._query_blocks(n_block, seqlen_q, seqlen_k)
        m_begin = cute.arch.make_warp_uniform(m_begin)
        m_end = cute.arch.make_warp_uniform(m_end)
        m_unmasked = cute.arch.make_warp_uniform(m_unmasked)
        return n_block, head_kv, batch, m_begin, m_end, m_unmasked, group * (m_end - m_begin)

    @cute.jit
    def _tile_coords(self, tile, mK: cute.Tensor, heads=None):
        """(key block, head, batch) of tile `tile` in the launch order (l2_swizzle: the
        config.swizzled_block order) over `heads` heads (default the kv heads)."""
        num_n = (mK.shape[0] + self.tile_n - 1) // self.tile_n
        hkv = mK.shape[2] if const_expr(heads is None) else heads
        if const_expr(self.l2_swizzle):
            n_block, pair = swizzled_block(
                tile, num_n, hkv * mK.shape[3], self.l2_swizzle, cutlass.min
            )
        else:
            pair = tile // num_n
            n_block = tile - pair * num_n
        batch = pair // hkv
        return n_block, pair - batch * hkv, batch

    @cute.jit
    def _query_blocks(self, n_block: Int32, seqlen_q: Int32, seqlen_k: Int32):
        """(m_begin, m_end, m_unmasked): query blocks [m_begin, m_end) hold a row that sees a
        key of this key block; from m_unmasked on (causal) every row sees every key of it."""
        m_end = (seqlen_q + self.tile_m - 1) // self.tile_m
        m_begin = Int32(0)
        m_unmasked = Int32(0)
        if const_expr(self.causal):
            offset = seqlen_k - seqlen_q
            n0 = n_block * self.tile_n
            # Query i sees key j iff i >= j - offset: the block's first key n0 from row
            # n0 - offset on, its last key n0 + tile_n - 1 from row n0 + tile_n - 1 - offset.
            first_row = cutlass.max(n0 - offset, 0)
            m_begin = cutlass.min(first_row // self.tile_m, m_end)
            full_row = cutlass.max(n0 + self.tile_n - 1 - offset, 0)
            m_unmasked = (full_row + self.tile_m - 1) // self.tile_m
        return m_begin, m_end, m_unmasked

    def _step_coords(self, step, hq0, m_begin, num_m):
        """(query head, query block) of a step: the heads one after another, each over the
        CTA's query blocks ascending (walk_order 0) or descending (2)."""
        if const_expr(self.walk_order == 2):
            return hq0 + step // num_m, m_begin + num_m - 1 - step % num_m
        return hq0 + step // num_m, m_begin + step % num_m

    def _first_m(self, m_begin, m_end):
        """The query block of a tile's first step (walk_order)."""
        return m_end - 1 if const_expr(self.walk_order == 2) else m_begin

    @cute.jit
    def _next_m(self, m, m_begin, m_end):
        """The query block of the step after one at m (walk_order; the next head starts over)."""
        if const_expr(self.walk_order == 2):
            m -= 1
            if m < m_begin:
                m = m_end - 1
        else:
            m += 1
            if m == m_end:
                m = m_begin
        return m

    def _seq(self, t: cute.Tensor, off) -> cute.Tensor:
        """A (S, D) view shifted to its sequence's first row (varlen; identity otherwise)."""
        if const_expr(self.varlen):
            return cute.domain_offset((off, 0), t)
        return t
