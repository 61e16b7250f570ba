"""A chunk's gates as the gate warp forms them: shared by the chunked kernel's gate warp
(`chunked_fwd.py`) and the T precompute (`t_pre.py`), so that both see the same G2 bits."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import CHUNK


@cute.jit
def chunk_gates(mG, mBeta, hv, bos, seqlen, c, lane):
    """Lane l's tokens 2 l and 2 l + 1 of chunk c (g and beta 0 past the sequence): the
    inclusive cumulative sum of g over the chunk by a warp scan. Returns (before, incl,
    vals): g's sum up to token 2 l - 1, up to 2 l + 1, and ((g, beta) of 2 l, of 2 l + 1);
    the caller scales by log2(e) (token 2 l: before + g_2l)."""
    t0 = c * CHUNK + 2 * lane
    vals = []
    for e in cutlass.range_constexpr(2):
        t = cutlass.min(t0 + e, seqlen - 1)  # in bounds; masked below
        inside = t0 + e < seqlen
        g = cutlass.select_(inside, Float32(mG[bos + t, hv]), Float32(0.0))
        b = cutlass.select_(inside, Float32(mBeta[bos + t, hv]), Float32(0.0))
        vals.append((g, b))
    pair = vals[0][0] + vals[1][0]
    incl = pair
    for i in cutlass.range_constexpr(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << i)
        incl = cutlass.select_(lane >= (1 << i), incl + up, incl)
    return incl - pair, incl, vals
