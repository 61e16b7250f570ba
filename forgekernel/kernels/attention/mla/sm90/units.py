"""A unit of the MLA passes and of the work list's scheduling kernel (DSL, one function): one
sequence (decode: one query a sequence), or a block of `qtokens` of a sequence's query tokens
(the packed form, cu_seqlens_q), and the keys it sees. seesaw.py `_unit`, decode.py's prologue
and worklist.py `_tiles` read it; schedule.py `kv_ends` is its Python form (the CPU replays)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr


@cute.jit
def unit_bounds(mSeq, mCuQ, causal, q_blocks, qtokens: cutlass.Constexpr[int], unit):
    """(batch b, first query row, query tokens sq, keys sk, key bound kv_end) of `unit`: one
    sequence (mCuQ None: rows = units, sq 1, kv_end sk), or block `unit % q_blocks` of sequence
    `unit // q_blocks`'s query tokens, `qtokens` each (sq <= qtokens, none past the sequence's
    end; causal, they see keys < kv_end, bottom-right; a block past the end has sq 0 and kv_end
    0: its causal bound sk - q_all + token0 would pass sk, page-table entries past the
    sequence's)."""
    if const_expr(mCuQ is None):
        sk = mSeq[unit]
        return unit, unit, Int32(1), sk, sk
    b = unit // q_blocks
    token0 = (unit - b * q_blocks) * qtokens
    sk = mSeq[b]
    q_all = mCuQ[b + 1] - mCuQ[b]
    sq = cutlass.max(cutlass.min(q_all - token0, qtokens), 0)
    kv_end = Int32(cutlass.select_(causal != 0, sk - q_all + token0 + sq, sk))
    kv_end = Int32(cutlass.select_(sq > 0, kv_end, 0))
    return b, mCuQ[b] + token0, sq, sk, kv_end
