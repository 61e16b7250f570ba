"""dK / dV out of the consumers' registers at the end of a tile.

Standard: dK * scale and dV converted to the input dtype, stmatrix into the K / V buffers
(every GEMM reading them is complete: a consumer barrier before the stores), fence, a second
consumer barrier, two TMA stores by the first consumer warp (rows past Sk clipped). Varlen
key blocks that end inside their sequence: stored from registers, rows < Sk only. head_split:
added into fp32 workspaces with `red.global.add.v2.f32`.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Float32
from cutlass.cute.nvgpu import cpasync

from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x


class Epilogue:
    """dK / dV stores (mixed into AttentionBwdSm90)."""

    @cute.jit
    def _store_dkv(
        self, tidx, warp_idx, mma_dk, mma_dv, acc_dK, acc_dV, sK, sV, tma_dk, mdK, tma_dv, mdV,
        scale, n_block, head_kv, batch, consumer_bar, k_off,
    ):  # fmt: skip
        """dK * scale, dV -> input dtype -> stmatrix into the K, V buffers -> TMA stores."""
        tn, d, dv = self.tile_n, self.head_dim, self.head_dim_v
        rdK = cute.make_rmem_tensor(acc_dK.shape, self.dtype)
        rdK.store((acc_dK.load() * scale).to(self.dtype))
        rdV = cute.make_rmem_tensor(acc_dV.shape, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        atom = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), self.dtype)
        r2s_k = cute.make_tiled_copy_C(atom, mma_dk).get_slice(tidx)
        r2s_v = cute.make_tiled_copy_C(atom, mma_dv).get_slice(tidx)
        # Every WGMMA reading K or V (both warpgroups) is complete: each waited for its last.
        consumer_bar.arrive_and_wait()
        cute.copy(r2s_k, r2s_k.retile(rdK), r2s_k.partition_D(sK[None, None, 0]))
        cute.copy(r2s_v, r2s_v.retile(rdV), r2s_v.partition_D(sV[None, None, 0]))
        cute.arch.fence_view_async_shared()
        consumer_bar.arrive_and_wait()
        if warp_idx == THREADS_PER_WG // 32:  # first consumer warp
            one = cute.make_layout(1)
            gdK = cute.local_tile(
                self._seq(mdK[None, None, head_kv, batch], k_off), (tn, d), (None, 0)
            )
            gdV = cute.local_tile(
                self._seq(mdV[None, None, head_kv, batch], k_off), (tn, dv), (None, 0)
            )
            tdKsK, tdKgdK = cpasync.tma_partition(
                tma_dk, 0, one, cute.group_modes(sK, 0, 2), cute.group_modes(gdK, 0, 2)
            )
            tdVsV, tdVgdV = cpasync.tma_partition(
                tma_dv, 0, one, cute.group_modes(sV, 0, 2), cute.group_modes(gdV, 0, 2)
            )
            cute.copy(tma_dk, tdKsK[(None, 0)], tdKgdK[(None, n_block)])
            cute.copy(tma_dv, tdVsV[(None, 0)], tdVgdV[(None, n_block)])
            cute.arch.cp_async_bulk_commit_group()
            cute.arch.cp_async_bulk_wait_group(0, read=True)

    @cute.jit
    def _store_dkv_rows(
        self, tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK, mdV, scale, n_block, head_kv,
        seqlen_k, k_off,
    ):  # fmt: skip
        """Varlen key block that ends inside its sequence: dK * scale and dV stored from
        registers, rows < Sk only (a TMA box would overwrite the next sequence's rows)."""
        # one at a time: the converted copy of dK is dead before dV's is made
        rdK = cute.make_rmem_tensor(acc_dK.shape, self.dtype)
        rdK.store((acc_dK.load() * scale).to(self.dtype))
        self._store_rows(tidx, mma_dk, rdK, mdK, self.head_dim, n_block, head_kv, k_off, seqlen_k)
        rdV = cute.make_rmem_tensor(acc_dV.shape, self.dtype)
        rdV.store(acc_dV.load().to(self.dtype))
        self._store_rows(tidx, mma_dv, rdV, mdV, self.head_dim_v, n_block, head_kv, k_off, seqlen_k)

    @cute.jit
    def _reduce_dkv(
        self, tidx, mma_dk, mma_dv, acc_dK, acc_dV, mdK, mdV, scale, n_block, head_kv, batch,
        seqlen_k,
    ):  # fmt: skip
        """head_split: dK * scale and dV added to the fp32 (S, D, H, B) accumulators, two
        adjacent columns per `red.global.add.v2.f32`, rows < Sk only."""
        tn = self.tile_n
        n0 = n_block * tn
        # the thread's coordinates re-derived here: computed before the step loop they stayed
        # live through it and spilled
        tidx = opaque_tid_x() - THREADS_PER_WG
        for k in cutlass.range_constexpr(cute.size(acc_dK)):
            acc_dK[k] = acc_dK[k] * scale
        for mma, r, m, width in (
            (mma_dk, acc_dK, mdK, self.head_dim),
            (mma_dv, acc_dV, mdV, self.head_dim_v),
        ):
            g = cute.local_tile(m[None, None, head_kv, batch], (tn, width), (n_block, 0))
            thr = mma.get_slice(tidx)
            tg = thr.partition_C(g)
            tc = thr.partition_C(cute.make_identity_tensor((tn, width)))
            for i in cutlass.range_constexpr(0, cute.size(r), 2):
                if n0 + tc[i][0] < seqlen_k:
                    pair = cute.make_tensor(r.iterator + i, cute.make_layout(2)).load()
                    cute.arch.red(
                        tg.iterator + tg.layout(i),
                        pair,
                        op="add",
                        dtype=Float32,
                        sem="relaxed",
                        scope="gpu",
                    )

    @cute.jit
    def _store_rows(self, tidx, mma, r, m, width: int, n_block, head_kv, k_off, seqlen_k):
        """r (this thread's fragment of a (tile_n, width) accumulator of `mma`) -> key block
        n_block of the packed (T, D, H, 1) view m from row k_off, rows < seqlen_k only."""
        tn = self.tile_n
        n0 = n_block * tn
        g = cute.local_tile(
            cute.domain_offset((k_off, 0), m[None, None, head_kv, 0]), (tn, width), (n_block, 0)
        )
        thr = mma.get_slice(tidx)
        tg = thr.partition_C(g)
        tc = thr.partition_C(cute.make_identity_tensor((tn, width)))
        for i in cutlass.range_constexpr(cute.size(r)):
            if n0 + tc[i][0] < seqlen_k:
                tg[i] = r[i]
