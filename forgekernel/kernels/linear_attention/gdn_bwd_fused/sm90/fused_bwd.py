"""Gated DeltaNet backward, fused: kernel 1's reverse state recurrence and kernel 2's chunk
gradients (its WY form: all of pass 3) in one kernel for Hopper (sm_90a). One CTA per
(sequence, value head) walks the chunks last first; the state gradient dS stays on chip for
the whole sequence (fp32 in the state warpgroup's registers, a 16-bit copy in shared memory
each chunk) and dU never leaves the SM: no dU, dS, Ke or Qe tile reaches HBM (design and byte
accounting: docs/linear_attention/gdn_bwd_fused_design_2026-12-06.md).

Per chunk c (C = 64 tokens; q scaled; G the within-chunk cumulative log decay; dS the state
gradient at the chunk's end, from the final state's gradient; h the forward's state at the
chunk's start, U its corrected values, both from kernel 1's forward launch):

    G:  dU  = (k dS) o e^(G_C - G) (rows) + P^T dO       (C x V x K, then C x V x C)
    S:  K K^T, dPD = (dO U^T) o D                          (C x C x K, C x C x V)
    S:  dS <- e^(G_C) dS + q^T (e^G o dO) - W^T dU        (as dS^T: V x K x C twice)
    G:  kernel 2's other products on dO, U, dU, q, k, h, dS, dPD and T^T, W, u
        (`GdnBwdChunkSm90._math`'s order, then `_wy` with K K^T from S): dq, dk, dv (16-bit),
        dbeta, dG's rows
    finish warps: dG's last-token term (te's sum + e^(G_C) <dS, h>) and the reverse cumsum

Ke = k e^(G_C - G) and Qe = q e^G are not read: the first scales dU's rows after the product,
the second scales the state warpgroup's dO^T A operand (built in registers anyway) by column.

Variant `u_from_h` (compile flag; ops/gated_delta_rule_bwd.py FUSED_DIET): U is not read. The
state warpgroup forms it in the U box, once its q half of the update is issued and h and the
WY u have landed: U = u - W h (C x V x K, one (C, V) fp32 accumulator, the WY u subtracted from
shared memory, rounded once to 16 bits: kernel 1's forward launch's U^T = u^T - S^T W^T on the
same 16-bit u, W and h, up to the order of the tensor core's sums), then dPD as before; G reads
it after S_DONE as it read the loaded U. 16 KB a chunk-head less read here and written by the
forward launch (its `fused` key).

Warp roles (3 warpgroups, 384 threads, setmaxnreg config.REGS):
- warpgroup 0: warp 0 the TMA producer (per chunk, last first, config.LOAD_GROUPS on one
  mbarrier each, after the stage's release: one stage, see config.STAGES); warps 1, 2 dG's
  finish (one token a thread);
- warpgroup 1 ("S", `_state`): dS^T (V, K) fp32 as two 64-row accumulators (kernel 1's two
  state warpgroups' halves in one); per chunk it writes dS (K, V) 16-bit into sDH (transposed
  stmatrix), K K^T (fp32, G's accumulator order) into sKK, then the update, its A operands
  (e^G o dO)^T and -dU^T built in registers from shared memory, B = q, W (MN-major views),
  and between its two halves dPD (sPD) and dPD^T (over the spent P^T box): S is idle while G
  works, and G's registers were full (its first build spilled 400 bytes);
- warpgroup 2 ("G", `_grads`): dU into sDU, then kernel 2's chunk gradients, its helpers
  inherited (`GdnBwdChunkSm90`: `_row_decays`, `_row_dots`, `_store_tile`, `_store_rows`,
  `_stash_rows`; `_wy` overridden: K K^T from sKK, the row sums into shared memory as formed).

Hand-overs (named barriers, `Bar`): S -> G, finish: dS in sDH (DS_READY); G -> S: dU in sDU,
P^T read (DU_READY); S -> G: K K^T, dPD, dPD^T written and the stage's dO, q, U read (S_DONE:
G's fp32 dk stash goes over dO, U and dw over q); G, finish -> S: sDH read (DH_FREE: the
next chunk's dS may be written); G -> finish: dG's rows (FINISH). The stage's release is an
mbarrier (RELEASE_ARRIVALS).

Variant `varlen` (compile flag, 2026-12-06; ops/gated_delta_rule_bwd.py FUSED_SLOTS): the tiles
in the varlen slot layout (ops/_linattn_varlen.py), one CTA a (value head, sequence) taken
longest first, walking the slots it owns as kernel 1's varlen form does (`_slot`), the token
outputs at their token rows through kernel 2's `token_rows` tables (`_token_rows` at each store
group); masks, loads and intermediates at the slot as in kernel 2's slot-layout run. With
`u_from_h` U is formed from the slot's W, h and WY u boxes as on the batch key (a pad slot's or
a cut chunk's zero rows of u and W give U's zero rows, as the forward launch writes them).

Variant `group_sum` (compile flag, next/gdn-bwd-groupsum; ops/gated_delta_rule_bwd.py
FUSED_GROUPSUM): HV = 2 H, the two value heads of a q / k head as one cluster of config.PAIR
CTAs (grid x, ranks 0, 1), dq and dk summed in fp32 through distributed shared memory and
written once in 16 bits at the H head (the norm epilogue's group sum gone; more precise than
rounding each value head's first). Per chunk and exchange (dq, then dk) G's rows are split by
warp: rank r's warps 2 r, 2 r + 1 own rows 32 r .. 32 r + 31; the other two warps push their
rows to the peer (`_pair_store`). Receive buffers: dq's the spent dO box (free after S_DONE:
`_pair_free`), dk's the K K^T buffer (free after `_wy`'s masking); each a "free" mbarrier (the
peer's arrival) and a "landed" one (this CTA's expect_tx, the peer's st.async bytes). Every
remote operation is waited on by its target before that CTA goes on (no exit barrier needed).
With `varlen` (next/gdn-bwd-slots-groupsum) the same: the cluster is still the grid's x pair
(value heads 2 h, 2 h + 1 of one sequence: grid y is the sequence, so both CTAs read the same
mOrder entry and walk the same slots, the same number of chunks); each chunk exchanges all C
rows whatever the slot holds (a pad slot, a tail chunk: both ranks see the same table row) and
the owners store the sums at the slot's token rows (`_token_rows`), as the key without it does.

Variant `wg_split` (compile flag, a candidate; next/gdn-bwd-wgsplit):
G's chain on two math warpgroups, 4 warpgroups, 512 threads, setmaxnreg config.SPLIT_REGS,
every accumulator's products and sums in the order of the other keys (only the warpgroup
running them changes). S keeps the state: dS's store, e^G, the update's two halves (it arrives
on S_DONE once its q half has read dO and q). Warpgroup 2 ("G1", `_grads` then `_dw_and_wy`):
dU, dw = -dU h^T over the spent h box (after H_FREE: G2's and the finish warps' h reads), then
`_wy` (dv, dbeta, dA, M, dk) with K K^T after KK and dk's stash and dG's row terms after ROWS.
Warpgroup 3 ("G2", `_products`): `u_from_h`'s U, dPD (dPD^T into sPD; dPD into dq's product
from registers), dqe and dq, K K^T, dke + dPD^T q into dk's fp32 stash over dO and U (after
S_DONE and DU_READY, which S and G2 both wait), dG's rows' init. No new shared memory. With
`group_sum` (next/wgsplit-groupsum; setmaxnreg config.SPLIT_PAIR_REGS) dq's exchange is G2's
(its S_DONE wait moved before it: the receive buffer over dO is free once S, G1 (DU_READY) and
G2 have read dO; the owners' reads come before the stash through PRODUCTS), dk's G1's at
`_wy`'s end (over K K^T, which only G1 reads and G2 writes again after the stage's release).

Variant `w_from_t` (compile flag, a candidate, with `wg_split` and `u_from_h`; next/gdn-w-from-t,
ops/gated_delta_rule_bwd.py FUSED_WFROMT): W and the WY u are not read. G2 forms them at the
chunk's start (`_w_and_u`), before U: W = [T diag(beta e^G)] K into the W box, u = [T
diag(beta)] V into the WY u's box, over v, which the TMA loads there (config.
W_FROM_T_LOAD_GROUPS: T^T rides with q, v where u was; four groups). T comes from kernel 0's
16-bit T^T (kernel 0 rounds the A operands from its fp32 T: W, u differ from its by that
rounding, not bit for bit), beta and beta e^G staged by G2 (sBw, 512 bytes). Its readers:
G2's U (its own barrier), S's W half (after DU_READY, where G2 arrives after forming them),
G1's dA (after H_FREE, which G2 arrives on after them). G2 writes the W box of chunk i + 1
only after that chunk's loads landed, so after the stage's release by chunk i's readers (as
its U box writes). 2 x 0.52 MMAC more on G2 a chunk; W's and u's 32 KB a chunk-head not
read, v's 16 KB read by TMA (dbeta's row dots still read v from global).

Constraints: K = V = 128, 16-bit tiles with unit last strides and 16-byte aligned outer strides
(TMA); G, beta fp32 (B, T, HV) unit last stride; dq, dk, dv 16-bit, dG, dbeta, dh0 fp32.
"""

from __future__ import annotations

from enum import IntEnum

import cuda.bindings.driver as cuda
import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Float32, const_expr
from cutlass.cute.nvgpu import OperandMajorMode, cpasync, warpgroup
from cutlass.memory import SmemAllocator

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.cluster import peer_address, store_peer_f32x4
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import acc_to_operand_a, rows_cols, transposed
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.opaque import opaque_i32
from forgekernel.kernels.common.sm90.pipeline import init_arrive, init_wait, smem_tensor
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.common.sm90.registers import set_max_registers
from forgekernel.kernels.common.sm90.unaligned_barrier import unaligned_barrier
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import (
    STASH_COLS,
    GdnBwdChunkSm90,
    _kvchb,
    _tdhb,
    _token_rows,
)
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import (
    CHUNK,
    EXCHANGE_BYTES,
    EXCHANGES,
    H_GROUP,
    LAUNCH_REGS,
    LOAD_GROUPS,
    PAIR,
    PAIR_BARRIERS,
    PAIR_THREADS,
    REGS,
    RELEASE_ARRIVALS,
    S_GROUPS,
    SPLIT_LAUNCH_REGS,
    SPLIT_PAIR_REGS,
    SPLIT_REGS,
    SPLIT_RELEASE_ARRIVALS,
    SPLIT_THREADS,
    THREADS,
    U_FROM_H_LOAD_GROUPS,
    U_GROUP,
    W_FROM_T_LOAD_GROUPS,
)
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.reverse_state import (
    GdnBwdStateSm90,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import first_slot

ROWS = 64  # value rows of one dS^T accumulator (the state warpgroup holds two)
PRODUCER_WARP = 0
FINISH_WARPS = 2
FINISH_THREADS = FINISH_WARPS * WARP_SIZE
WG = THREADS_PER_WG
KK_REGS = CHUNK * CHUNK // THREADS_PER_WG  # a (C, C) fp32 accumulator's values a thread
# `group_sum`'s receive buffer (fp32, EXCHANGE_BYTES): value e of owner thread t (t < PAIR_THREADS,
# 64 values a thread) at float 4 t + e % 4 + (e // 4) 4 PAIR_THREADS: each 16-byte store and load
# of a warp covers 512 contiguous bytes (no bank conflict)
RECV_SHAPE = (PAIR_THREADS, (4, CHUNK * 128 // THREADS_PER_WG // 4))
RECV_STRIDE = (4, (1, 4 * PAIR_THREADS))
FREE, LANDED = 0, len(EXCHANGES)  # `group_sum`'s mbarriers: FREE + x, LANDED + x (x: EXCHANGES)


class Bar(IntEnum):
    """Named barriers (id 0 is __syncthreads). DS_READY and FINISH are waited on in two roles'
    code (G's and the finish warps' own waits, one phase): `unaligned_barrier` at every site of
    theirs (synccheck aborted the kernel on the aligned form: unaligned_barrier.py); with
    `wg_split` DU_READY too (S's and G2's waits)."""

    MATH = FIRST_FREE  # G alone (`_wy`'s too): its shared-memory tiles written
    FINISH = FIRST_FREE + 1  # G -> the finish warps (both wait): dG's rows stashed
    FINISH_WARPS = FIRST_FREE + 2  # the finish warps: <dS, h>'s partials
    DS_READY = FIRST_FREE + 3  # S arrives, G and the finish warps wait: dS in sDH
    DU_READY = FIRST_FREE + 4  # G (G1) arrives, S (and G2, unaligned) waits: dU in sDU
    DH_FREE = FIRST_FREE + 5  # G and the finish warps arrive, S waits: sDH read
    S_DONE = FIRST_FREE + 6  # S arrives, G (G2) waits: the stage's dO, q, W read by S
    STATE = FIRST_FREE + 7  # S alone: e^G staged
    PRODUCTS = FIRST_FREE + 8  # `wg_split`: G2 alone (its G staged, U in the U box, dPD^T)
    H_FREE = FIRST_FREE + 9  # `wg_split`: G2 and the finish warps arrive, G1 waits: h read
    KK = FIRST_FREE + 10  # `wg_split`: G2 arrives, G1 waits: K K^T in sKK
    ROWS = FIRST_FREE + 11  # `wg_split`: G2 arrives, G1 waits: dk's stash, dG's rows' init


class GdnBwdFusedSm90(GdnBwdChunkSm90):
    """Warp-specialized fused Gated DeltaNet backward (reverse recurrence + chunk gradients);
    see the module docstring. Subclasses kernel 2's class for its per-chunk helpers."""

    load_groups = LOAD_GROUPS

    def __init__(self, k: int, v: int, *, d_final_state: bool, grouped: bool = False,
                 u_from_h: bool = False, varlen: bool = False,
                 group_sum: bool = False, wg_split: bool = False,
                 w_from_t: bool = False):  # fmt: skip
        if group_sum and not grouped:
            raise ValueError("group_sum needs grouped")
        if w_from_t and not (wg_split and u_from_h):
            raise ValueError("w_from_t needs wg_split and u_from_h")
        super().__init__(k, v, wy=True, grouped=grouped)
        self.group_sum = group_sum  # dq, dk summed over the cluster's value heads (docstring)
        self.d_final_state = d_final_state
        self.dqk16 = True
        self.u_from_h = u_from_h  # U = u - W h formed by S (the module docstring)
        if u_from_h:
            self.load_groups = U_FROM_H_LOAD_GROUPS
        # W, u formed by G2 from T^T, k, v (`_w_and_u`; the module docstring)
        self.w_from_t = w_from_t
        if w_from_t:
            self.load_groups = W_FROM_T_LOAD_GROUPS
        self.varlen = varlen
        # `wg_split`: G1 (warpgroup 2) and G2 (warpgroup 3) share G's chain (module docstring)
        self.wg_split = wg_split
        self.threads = SPLIT_THREADS if wg_split else THREADS
        self.regs = REGS
        # ptxas' count at the launch: each warpgroup's setmaxnreg goes from it (`.inc` above,
        # `.dec` below: G2's 136 is above the split's 128, next/ws-illegal)
        self.launch_regs = LAUNCH_REGS
        if wg_split:
            self.regs = SPLIT_PAIR_REGS if group_sum else SPLIT_REGS
            self.launch_regs = SPLIT_LAUNCH_REGS
        self.release_arrivals = SPLIT_RELEASE_ARRIVALS if wg_split else RELEASE_ARRIVALS
        # DU_READY (G arrives, S waits; with `wg_split` G1 arrives, S and G2 wait) and DH_FREE
        # (S, G and the finish warps; G1 and G2 with `wg_split`)
        self.handover_threads = (3 if wg_split else 2) * WG
        self.dh_free_threads = self.handover_threads + FINISH_THREADS

    def _setup(self):
        super()._setup()
        dt = self.dtype
        rmem = warpgroup.OperandSource.RMEM
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        # kernel 1's: the (64 value rows, C tokens) register tiles of dO^T, dU^T (C layout)
        self.mma_ks = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (ROWS, CHUNK), a_source=rmem
        )
        # the dS^T update: (64 value rows, K), A from registers, B q / W's transposed views
        self.mma_st = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (ROWS, self.k), a_source=rmem
        )

    @cute.jit
    def __call__(
        self,
        mDO: cute.Tensor,
        mU: cute.Tensor | None,
        mQ: cute.Tensor,
        mK: cute.Tensor,
        mH: cute.Tensor,
        mG: cute.Tensor,
        mPT: cute.Tensor,
        mTt: cute.Tensor,
        mW: cute.Tensor | None,
        mUw: cute.Tensor | None,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mDht: cute.Tensor | None,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDG: cute.Tensor,
        mDV: cute.Tensor,
        mDB: cute.Tensor,
        mDh0: cute.Tensor,
        mCu: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        scale: Float32,
        stream: cuda.CUstream,
    ):
        """mDO, mU (B, T, HV, V), mQ (scaled), mK (B, T, H, K), mH (B, NC, HV, K, V), mPT, mTt
        (B, T, HV, C), mW (B, T, HV, K), mUw, mV (B, T, HV, V) 16-bit; mG, mBeta fp32 (B, T,
        HV); mDht (or None) fp32 (B, HV, K, V). Outputs: mDQ (times `scale`), mDK (B, T, HV, K)
        and mDV (B, T, HV, V) in the tiles' dtype, mDG, mDB fp32 (B, T, HV), mDh0 fp32 (B, HV,
        K, V). `u_from_h`: mU None (U formed in the kernel); `w_from_t`: mW, mUw None (formed
        in the kernel, mV read by TMA too). `varlen`: the tiles (1, S C, ...)
        in the varlen slot layout (ops/_linattn_varlen.py: S = T // C + N slots, chunk c of
        sequence n at slot bos_n // C + n + c; mH (1, S, ...)), mCu int32 (N + 1,), mOrder int32
        (N,) (the sequences, longest first): one CTA a (value head, sequence) walks the slots the
        sequence owns, kernel 1's varlen walk; mDht, mDh0 (N, HV, K, V); the token outputs (1,
        T', ...) at their token rows, slot s's first mLens[s] rows from token mStarts[s] (int32
        (S,): kernel 2's `token_rows`). Else the four None. `group_sum`: mDQ, mDK (B, T, H, K)
        with HV = PAIR H (the caller's check), the launch a cluster of PAIR CTAs (with
        `varlen`: (1, T', H, K) at the token rows)."""
        self.dtype = mDO.element_type
        for t in (mQ, mK, mH, mPT, mTt, mW, mUw, mV, mDQ, mDK, mDV):
            if const_expr(t is not None and t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        if const_expr(self.varlen != (mCu is not None)):
            raise TypeError("mCu, mOrder, mStarts, mLens: given with varlen, and only then")
        if const_expr(self.w_from_t != (mW is None) or self.w_from_t != (mUw is None)):
            raise TypeError("mW, mUw: None with w_from_t, and only then")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sT_tile = cute.slice_(self.sT_layout, (None, None, 0))
        sH_tile = cute.slice_(self.sH_layout, (None, None, 0))
        sP_tile = cute.slice_(self.sP_layout, (None, None, 0))
        tma = {"u": (None, None), "w": (None, None)}  # u_from_h: U, w_from_t: W not loaded
        uw = mV if const_expr(self.w_from_t) else mUw  # w_from_t: v into the WY u's box
        for name, m, d in (("do", mDO, self.v), ("u", mU, self.v), ("q", mQ, self.k),
                           ("k", mK, self.k), ("w", mW, self.k), ("uw", uw, self.v)):  # fmt: skip
            if const_expr(m is not None):
                tma[name] = cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sT_tile, (CHUNK, d))
        for name, m in (("pt", mPT), ("tt", mTt)):
            tma[name] = cpasync.make_tiled_tma_atom(g2s, _tdhb(m), sP_tile, (CHUNK, CHUNK))
        tma["h"] = cpasync.make_tiled_tma_atom(g2s, _kvchb(mH), sH_tile, (self.k, self.v))
        t_bytes = cute.size_in_bytes(self.dtype, sT_tile)
        tile_bytes = {n: t_bytes for n in ("do", "u", "q", "k", "w", "uw")}
        tile_bytes.update({n: cute.size_in_bytes(self.dtype, sP_tile) for n in ("pt", "tt")})
        tile_bytes["h"] = cute.size_in_bytes(self.dtype, sH_tile)
        self.group_bytes = tuple(sum(tile_bytes[n] for n in g) for g in self.load_groups)
        t_elems = cute.cosize(self.sT_layout)
        h_elems = cute.cosize(self.sH_layout)
        p_elems = cute.cosize(self.sP_layout)
        scale_elems = 2 * CHUNK if const_expr(self.w_from_t) else 0

        @cute.struct
        class SharedStorage:
            # `group_sum`: its PAIR_BARRIERS after the load groups'
            full: cute.struct.MemRange[cutlass.Int64, len(self.load_groups) + self._pair_barriers()]
            empty: cute.struct.MemRange[cutlass.Int64, 1]
            sG: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK], 16]
            sE: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK], 16]
            sRed: cute.struct.Align[cute.struct.MemRange[Float32, 2 * (3 * CHUNK + 4)], 16]
            sDO: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sQ: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sK: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sW: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sUw: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sPT: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sTt: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sDH: cute.struct.Align[cute.struct.MemRange[self.dtype, h_elems], 1024]
            sDU: cute.struct.Align[cute.struct.MemRange[self.dtype, t_elems], 1024]
            sKK: cute.struct.Align[cute.struct.MemRange[Float32, CHUNK * CHUNK], 1024]
            sPD: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sGs: cute.struct.Align[cute.struct.MemRange[Float32, 2 * CHUNK], 16]
            # `w_from_t`: beta, beta e^G of the chunk's tokens (G2's column scales)
            sBw: cute.struct.Align[cute.struct.MemRange[Float32, scale_elems], 16]

        self.shared_storage = SharedStorage
        order = ("do", "u", "q", "k", "w", "uw", "pt", "tt", "h")
        atoms_and_views = [x for n in order for x in tma[n]]
        # the chunk count a kernel parameter (constant bank): the loops' bound takes no register
        nchunks = (mDO.shape[1] + CHUNK - 1) // CHUNK
        self.kernel(
            *atoms_and_views,
            mG,
            mV,
            mBeta,
            mDht,
            mDQ,
            mDK,
            mDG,
            mDV,
            mDB,
            mDh0,
            mCu,
            mOrder,
            mStarts,
            mLens,
            nchunks,
            scale,
            self.mma_w,
            self.mma_s,
            self.mma_q,
            self.mma_k,
            self.mma_da,
            self.mma_ks,
            self.mma_st,
            self.sT_layout,
            self.sH_layout,
            self.sP_layout,
        ).launch(  # fmt: skip
            grid=(mDO.shape[2], mDh0.shape[0] if const_expr(self.varlen) else mDO.shape[0], 1),
            block=[self.threads, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
            **({"cluster": [PAIR, 1, 1]} if self.group_sum else {}),
        )

    def _du_ready(self):
        """DU_READY (G arrives: dU in sDU, P^T read): waited by S, and by G2 with `wg_split`,
        each at its own instruction (the unaligned form, `unaligned_barrier`'s docstring)."""
        if self.wg_split:
            return unaligned_barrier(Bar.DU_READY, self.handover_threads)
        return named_barrier(Bar.DU_READY, self.handover_threads)

    def _pair_barriers(self) -> int:
        return PAIR_BARRIERS if self.group_sum else 0

    def _cluster_mn(self) -> tuple[int, int]:
        """The cluster's shape for the barrier inits' visibility (init_arrive / init_wait)."""
        return (PAIR, 1) if self.group_sum else (1, 1)

    @cute.kernel
    def kernel(
        self,
        tma_do: cute.CopyAtom,
        mDO4: cute.Tensor,
        tma_u: cute.CopyAtom | None,
        mU4: cute.Tensor | None,
        tma_q: cute.CopyAtom,
        mQ4: cute.Tensor,
        tma_k: cute.CopyAtom,
        mK4: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW4: cute.Tensor,
        tma_uw: cute.CopyAtom,
        mUw4: cute.Tensor,
        tma_pt: cute.CopyAtom,
        mPT4: cute.Tensor,
        tma_tt: cute.CopyAtom,
        mTt4: cute.Tensor,
        tma_h: cute.CopyAtom,
        mH5: cute.Tensor,
        mG: cute.Tensor,
        mV: cute.Tensor,
        mBeta: cute.Tensor,
        mDht: cute.Tensor | None,
        mDQ: cute.Tensor,
        mDK: cute.Tensor,
        mDG: cute.Tensor,
        mDV: cute.Tensor,
        mDB: cute.Tensor,
        mDh0: cute.Tensor,
        mCu: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mStarts: cute.Tensor | None,
        mLens: cute.Tensor | None,
        nchunks: cutlass.Int32,
        scale: Float32,
        mma_w: cute.TiledMma,
        mma_s: cute.TiledMma,
        mma_q: cute.TiledMma,
        mma_k: cute.TiledMma,
        mma_da: cute.TiledMma,
        mma_ks: cute.TiledMma,
        mma_st: cute.TiledMma,
        sT_layout: cute.ComposedLayout,
        sH_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == PRODUCER_WARP:
            for atom in (tma_do, tma_u, tma_q, tma_k, tma_w, tma_uw, tma_pt, tma_tt, tma_h):
                if const_expr(atom is not None):
                    cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        full = storage.full.data_ptr()  # one mbarrier a load group, a phase a chunk
        empty = storage.empty.data_ptr()  # the stage released by all its readers
        if warp_idx == PRODUCER_WARP:
            with cute.arch.elect_one():
                for i in cutlass.range_constexpr(len(self.load_groups) + self._pair_barriers()):
                    cute.arch.mbarrier_init(full + i, 1)  # `group_sum`'s: one arrival each
                cute.arch.mbarrier_init(empty, self.release_arrivals)
        init_arrive(self._cluster_mn())
        sDO = smem_tensor(storage.sDO, sT_layout)
        sU = smem_tensor(storage.sU, sT_layout)
        sQ = smem_tensor(storage.sQ, sT_layout)
        sK = smem_tensor(storage.sK, sT_layout)
        sW = smem_tensor(storage.sW, sT_layout)
        sUw = smem_tensor(storage.sUw, sT_layout)
        sPT = smem_tensor(storage.sPT, sP_layout)
        sTt = smem_tensor(storage.sTt, sP_layout)
        sH = smem_tensor(storage.sH, sH_layout)
        sDH = smem_tensor(storage.sDH, sH_layout)
        sDU = smem_tensor(storage.sDU, sT_layout)
        sPD = smem_tensor(storage.sPD, sP_layout)  # dPD (C, C) 16-bit: S -> G (dq's A)
        # two chunks' worth (index i % 2): the finish warps read chunk i's while G stages i + 1
        sG2 = storage.sG.get_tensor(cute.make_layout((CHUNK, 2)))
        sE2 = storage.sE.get_tensor(cute.make_layout((CHUNK, 2)))
        sGs2 = storage.sGs.get_tensor(cute.make_layout((CHUNK, 2)))  # S's own G
        # [0, C) dG rows, [C, 2C) te, [2C, 2C + 2) <dS, h>'s partials, [2C + 4, 3C + 4) dbeta
        sRed2 = storage.sRed.get_tensor(cute.make_layout((3 * CHUNK + 4, 2)))
        # dk's first half in fp32 over the spent dO, U boxes (kernel 2's dqk16 stash)
        stash = tuple(
            cute.make_tensor(cute.recast_ptr(x.data_ptr(), dtype=Float32),
                             cute.make_layout((WG, STASH_COLS), stride=(1, WG)))
            for x in (storage.sDO, storage.sU)
        )  # fmt: skip
        # K K^T (C, C) fp32 in the accumulator's thread order: S computes it, G's `_wy` reads
        sKK = storage.sKK.get_tensor(cute.make_layout((WG, KK_REGS), stride=(1, WG)))
        # `group_sum`: the exchanges' barriers and receive buffers (dq's over dO, dk's over K K^T)
        pair = None
        if const_expr(self.group_sum):
            recv = tuple(cute.make_tensor(cute.recast_ptr(x.data_ptr(), dtype=Float32),
                                          cute.make_layout(RECV_SHAPE, stride=RECV_STRIDE))
                         for x in (storage.sDO, storage.sKK))  # fmt: skip
            pair = (full + len(self.load_groups), recv)
        init_wait(self._cluster_mn())

        hv, b, _ = cute.arch.block_idx()
        seqlen = mDO4.shape[0]
        # varlen: the tiles' batch index 0, the states' n, the walk's first slot and length
        n, first, tables = b, None, None
        if const_expr(self.varlen):
            n = mOrder[b]
            bos, eos = mCu[n], mCu[n + 1]
            first = first_slot(bos, n)
            nchunks = first_slot(eos, n + 1) - first
            b = 0
            tables = (mStarts, mLens)
        wg = cute.arch.make_warp_uniform(tidx // WG)
        if wg == 0:
            set_max_registers(self.regs[0], self.launch_regs)
            if warp_idx == PRODUCER_WARP:
                hq = hv  # q / k head: hv // (HV / H) when grouped
                if const_expr(self.grouped):
                    hq = hv // (mDO4.shape[2] // mQ4.shape[2])
                tiles = {"do": (tma_do, mDO4, sDO, self.v, hv), "u": (tma_u, mU4, sU, self.v, hv),
                         "q": (tma_q, mQ4, sQ, self.k, hq), "k": (tma_k, mK4, sK, self.k, hq),
                         "w": (tma_w, mW4, sW, self.k, hv), "uw": (tma_uw, mUw4, sUw, self.v, hv),
                         "pt": (tma_pt, mPT4, sPT, CHUNK, hv), "tt": (tma_tt, mTt4, sTt, CHUNK, hv),
                         "h": (tma_h, mH5, sH)}  # fmt: skip
                if const_expr(self.u_from_h):
                    del tiles["u"]
                if const_expr(self.w_from_t):  # "uw": v (`__call__`)
                    del tiles["w"]
                self._produce(tiles, full, empty, hv, b, nchunks, first)
            elif warp_idx <= FINISH_WARPS:
                self._finish(sH, sDH, sRed2, sG2, mDG, full, empty, b, hv, seqlen, nchunks,
                             first, tables)  # fmt: skip
        elif wg == 1:
            set_max_registers(self.regs[1], self.launch_regs)
            self._state(mma_ks, mma_st, mma_s, mma_k, sDO, sU, sQ, sK, sW, sUw, sH, sPT, sPD,
                        sDU, sDH, sE2, sGs2, sKK, mG, mDht, mDh0, full, empty, hv, b, seqlen,
                        nchunks, n, first)  # fmt: skip
        else:
            grads = (mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sQ, sK, sW, sUw, sPT, sTt, sH,
                     sDH, sDU, sG2, sRed2, mG, mV, mBeta, mDQ, mDK, mDG, mDV, mDB, full, empty,
                     hv, b, seqlen, nchunks, scale, stash, sKK, sPD, first, tables,
                     pair)  # fmt: skip
            # `wg_split`: G1's dw over the spent h box (a (C, K) tile in its first half)
            sDW = smem_tensor(storage.sH, sT_layout) if const_expr(self.wg_split) else None
            if const_expr(self.wg_split):
                if wg == 3:
                    set_max_registers(self.regs[3], self.launch_regs)
                    wy = None  # `w_from_t`'s (`_w_and_u`)
                    if const_expr(self.w_from_t):
                        sBw = storage.sBw.get_tensor(cute.make_layout((CHUNK, 2)))
                        wy = (mma_ks, mma_st, sTt, sBw, mBeta)
                    self._products(mma_w, mma_s, mma_q, mma_k, sDO, sU, sQ, sK, sW, sUw, sH, sDH,
                                   sPD, sGs2, sRed2, sKK, stash, mG, mDQ, full, empty, b, hv,
                                   seqlen, nchunks, scale, first, tables, pair, wy)  # fmt: skip
                else:
                    set_max_registers(self.regs[2], self.launch_regs)
                    self._grads(*grads, sDW)
            else:
                set_max_registers(self.regs[2], self.launch_regs)
                self._grads(*grads)

    @staticmethod
    def _slot(c, slot0):
        """Chunk c of the walk as the tiles' chunk index: c, or (varlen, slot0 the sequence's
        first slot) slot slot0 + c."""
        return c if slot0 is None else slot0 + c

    @cute.jit
    def _produce(self, tiles, full, empty, hv, b, nchunks, slot0=None):
        """The TMA warp: per chunk, last first, once the stage is released (the previous
        chunk's readers all arrived on `empty`), kernel 2's `_load_groups` of the chunk."""
        for i in cutlass.range(nchunks, unroll=1):
            if i > 0:
                cute.arch.mbarrier_wait(empty, (i - 1) % 2)
            self._load_groups(tiles, full, self._slot(nchunks - 1 - i, slot0), hv, b)

    @cute.jit
    def _state(self, mma_ks, mma_st, mma_s, mma_k, sDO, sU, sQ, sK, sW, sUw, sH, sPT, sPD, sDU,
               sDH, sE2, sGs2, sKK, mG, mDht, mDh0, full, empty, hv, b, seqlen, nchunks, n,
               slot0):  # fmt: skip
        """Warpgroup 1: dS^T (V, K) fp32 in two 64-row accumulators for the whole sequence;
        per chunk: dS (16-bit) into sDH for G and the finish warps, then dS^T <- e^(G_C) dS^T
        + (e^G o dO)^T q - dU^T W (kernel 1's update with Qe = q e^G folded into the A
        operand's columns); `u_from_h`: U = u - W h into the U box before dPD. n: the states'
        sequence (b but with varlen); slot0: `_slot`'s."""
        stid = opaque_tid_x() % WG
        thr_st = mma_st.get_slice(stid)
        acc_shape_st = thr_st.partition_shape_C((ROWS, self.k))
        acc0 = cute.make_rmem_tensor(acc_shape_st, Float32)
        acc1 = cute.make_rmem_tensor(acc_shape_st, Float32)
        accs = (acc0, acc1)
        for w in cutlass.range_constexpr(2):
            if const_expr(self.d_final_state):
                GdnBwdStateSm90._state_io(self, mDht[n, hv, None, None], accs[w], thr_st, w,
                                          True, True)  # fmt: skip
            else:
                accs[w].fill(0.0)
        wg_ks = mma_ks.get_slice(0)
        wg_st = mma_st.get_slice(0)
        acc_shape = wg_ks.partition_shape_C((ROWS, CHUNK))
        tA = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tBrQ = wg_st.make_fragment_B(wg_st.partition_B(transposed(sQ)))
        tBrW = wg_st.make_fragment_B(wg_st.partition_B(transposed(sW)))
        ready = unaligned_barrier(Bar.DS_READY, 2 * WG + FINISH_THREADS)
        du_ready = self._du_ready()
        dh_free = named_barrier(Bar.DH_FREE, self.dh_free_threads)
        s_done = named_barrier(Bar.S_DONE, 2 * WG)
        own = named_barrier(Bar.STATE, WG)
        for i in cutlass.range(nchunks, unroll=1):
            c = self._slot(nchunks - 1 - i, slot0)
            par = i % 2
            first = c * CHUNK
            sE = sE2[None, par]
            sG = sGs2[None, par]
            if stid < CHUNK:  # G and e^G of the chunk's tokens (zero past T)
                g_t, e = Float32(0.0), Float32(0.0)
                if first + stid < seqlen:
                    g_t = mG[b, first + stid, hv]
                    e = cute.math.exp(g_t, fastmath=True)
                if const_expr(not self.wg_split):  # else P stages its own G
                    sG[stid] = g_t
                sE[stid] = e
            if i > 0:
                dh_free.arrive_and_wait()  # G and the finish warps have read the last dS
            for w in cutlass.range_constexpr(2):
                GdnBwdStateSm90._store_ds(self, accs[w], mma_st, sDH, w)
            ready.arrive()
            own.arrive_and_wait()
            e_c = sE[cutlass.min(first + CHUNK, seqlen) - 1 - first]
            for g in cutlass.range_constexpr(len(S_GROUPS)):
                cute.arch.mbarrier_wait(full + S_GROUPS[g], par)
            tid = opaque_tid_x() % WG
            if const_expr(not self.wg_split):  # else G2's
                self._kk(mma_s, sK, sKK, tid)
            t0, _, col_base = softmax.acc_coords(mma_ks, tid, (ROWS, CHUNK))
            for w in cutlass.range_constexpr(2):
                accs[w].store(accs[w].load() * e_c)
                r_do = cute.make_rmem_tensor(acc_shape, Float32)
                dot = cute.local_tile(transposed(sDO)[None, None, 0], (ROWS, CHUNK), (w, 0))
                r_do.store(mma_ks.get_slice(tid).partition_C(dot).load().to(Float32))
                a = rows_cols(r_do)
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    e_j = sE[col_base + t0[0, j][1]]
                    for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                        a[r, j] = a[r, j] * e_j
                acc_to_operand_a(r_do, tA)
                gemm(mma_st, accs[w], tA, tBrQ[None, None, None, 0], False, 0)
            if const_expr(self.wg_split):  # K K^T, U, dPD are G2's
                s_done.arrive()  # dO, q read
                du_ready.arrive_and_wait()  # G's dU (16-bit) in sDU
            else:
                acc_p = self._dpd(mma_s, mma_k, sDO, sU, sW, sH, sUw, sG, full, par, first,
                                  seqlen, own)  # fmt: skip
                du_ready.arrive_and_wait()  # G's dU (16-bit) in sDU; P^T read
                self._store_tile(acc_p, mma_s, sPD, False)
                self._store_tile(acc_p, mma_s, sPT, True)
                s_done.arrive()  # dPD, dPD^T written; dO, q, U read
            for w in cutlass.range_constexpr(2):
                r_du = cute.make_rmem_tensor(acc_shape, Float32)
                dut = cute.local_tile(transposed(sDU)[None, None, 0], (ROWS, CHUNK), (w, 0))
                r_du.store(-mma_ks.get_slice(tid).partition_C(dut).load().to(Float32))
                acc_to_operand_a(r_du, tA)
                gemm(mma_st, accs[w], tA, tBrW[None, None, None, 0], False, 0)
            cute.arch.mbarrier_arrive(empty)
        for w in cutlass.range_constexpr(2):
            GdnBwdStateSm90._state_io(self, mDh0[n, hv, None, None], accs[w], thr_st, w, False,
                                      True)  # fmt: skip

    @cute.jit
    def _products(self, mma_w, mma_s, mma_q, mma_k, sDO, sU, sQ, sK, sW, sUw, sH, sDH, sPD, sGs2,
                  sRed2, sKK, stash, mG, mDQ, full, empty, b, hv, seqlen, nchunks, scale, slot0,
                  tables, pair=None, wy=None):  # fmt: skip
        """`wg_split`: warpgroup 3 ("G2"), per chunk, with the code and sums of the other keys
        (S's `_dpd`, `_kk`; G's `_chunk_grads`): `u_from_h`'s U, dPD (its transpose into sPD;
        dPD itself into dq's product from registers, the same 16-bit rounding), dqe = dO h^T,
        dq (stored, dg's rows), K K^T (KK), dke = U dS^T, dPD^T q, dk's fp32 stash over dO and
        U (after S_DONE: S's dO, q read; DU_READY: G1's dO read), dG's rows' init (ROWS). G1
        waits H_FREE (this h read) before its dw goes over h. wy (`w_from_t`): `_w_and_u`'s
        (mma_ks, mma_st, sTt, sBw, mBeta): W and u formed first, before U (H_FREE, after them,
        tells G1 they are in place; DU_READY tells S)."""
        du_ready = self._du_ready()
        dh_free = named_barrier(Bar.DH_FREE, self.dh_free_threads)
        s_done = named_barrier(Bar.S_DONE, 2 * WG)
        own = named_barrier(Bar.PRODUCTS, WG)
        h_free = named_barrier(Bar.H_FREE, 2 * WG + FINISH_THREADS)
        kk = named_barrier(Bar.KK, 2 * WG)
        rows = named_barrier(Bar.ROWS, 2 * WG)
        wg_w = mma_w.get_slice(0)
        wg_k = mma_k.get_slice(0)
        wg_q = mma_q.get_slice(0)
        for i in cutlass.range(nchunks, unroll=1):
            c = self._slot(nchunks - 1 - i, slot0)
            par = i % 2
            first = c * CHUNK
            sG = sGs2[None, par]
            sRed = sRed2[None, par]
            tid = opaque_tid_x() % WG
            if tid < CHUNK:  # the chunk's G (zero past T): the decays
                g_t = Float32(0.0)
                if first + tid < seqlen:
                    g_t = mG[b, first + tid, hv]
                sG[tid] = g_t
                if const_expr(wy is not None):  # beta, beta e^G (kernel 0's `_gates`' form)
                    beta = Float32(0.0)
                    if first + tid < seqlen:
                        beta = wy[4][b, first + tid, hv]
                    wy[3][tid, 0] = beta
                    wy[3][tid, 1] = beta * cute.math.exp(g_t, fastmath=True)
            own.arrive_and_wait()
            cute.arch.mbarrier_wait(full + S_GROUPS[0], par)  # k, dO
            cute.arch.mbarrier_wait(full + S_GROUPS[1], par)  # q, W (w_from_t: T^T)
            if const_expr(wy is not None):
                self._w_and_u(wy, sK, sW, sUw, full, par, own)
            acc_p = self._dpd(mma_s, mma_k, sDO, sU, sW, sH, sUw, sG, full, par, first, seqlen,
                              own)  # fmt: skip
            self._store_tile(acc_p, mma_s, sPD, True)  # dPD^T for dke's second product
            tQrP = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
            acc_to_operand_a(acc_p, tQrP)
            # dq = (dO h^T) o e^G + dPD k (`_chunk_grads`' first half)
            acc_q = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
            cute.arch.mbarrier_wait(full + H_GROUP, par)  # h
            tArDO = wg_w.make_fragment_A(wg_w.partition_A(sDO))
            tBrH = wg_w.make_fragment_B(wg_w.partition_B(sH))
            gemm(mma_w, acc_q, tArDO[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
            h_free.arrive()  # h read here (U's W h, dqe)
            # G1's dU written (so dS too: G1 waited DS_READY before it) and dO read by G1; S
            # waits here too: not a phase of DS_READY (G1 and the finish warps would wait for
            # this warpgroup's later arrival there)
            du_ready.arrive_and_wait()
            tid, t0, row_w, e_g, e_end = self._decayed_rows(
                mma_w, acc_q, mG, sG, first, seqlen, b, hv
            )
            tQrK = wg_q.make_fragment_B(wg_q.partition_B(transposed(sK)))
            gemm(mma_q, acc_q, tQrP, tQrK[None, None, None, 0], False, 0)
            dg = self._row_dots(acc_q, mma_w, sQ, tid)
            if const_expr(pair is not None):
                # dO read by S (S_DONE), G1 (DU_READY) and here (dPD, dqe waited): the peer may
                # write its dq rows there (the owners' reads come before the stash: PRODUCTS)
                s_done.arrive_and_wait()
                self._pair_free(pair[0], 0)
                self._pair_store(acc_q, mma_w, mDQ, pair, 0, par, b, c, seqlen, scale, tables)
            else:
                self._store_rows(acc_q, mma_w, mDQ, tid, b, hv, c, seqlen, scale,
                                 _token_rows(tables, c))  # fmt: skip
            self._kk(mma_s, sK, sKK, tid)
            kk.arrive()
            # dk's inter-chunk half: (U dS^T) o e^(G_C - G) + dPD^T q (`_chunk_grads`' second)
            own.arrive_and_wait()  # every thread's dPD^T in sPD
            acc_k = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
            tArU = wg_w.make_fragment_A(wg_w.partition_A(sU))
            tBrDH = wg_w.make_fragment_B(wg_w.partition_B(sDH))
            gemm(mma_w, acc_k, tArU[None, None, None, 0], tBrDH[None, None, None, 0], True, 0)
            more = c > 0  # not the walk's last chunk: S writes another dS
            if const_expr(tables is not None):
                more = i < nchunks - 1
            if more:
                dh_free.arrive()
            ka = rows_cols(acc_k)
            for r in cutlass.range_constexpr(cute.size(ka, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(ka, mode=[1])):
                    ka[r, j] = ka[r, j] * e_end[r]
            te = self._row_dots(acc_k, mma_w, sK, tid)
            tKrP = wg_k.make_fragment_A(wg_k.partition_A(sPD))
            tKrQ = wg_k.make_fragment_B(wg_k.partition_B(transposed(sQ)))
            gemm(mma_k, acc_k, tKrP[None, None, None, 0], tKrQ[None, None, None, 0], False, 0)
            dk_k = self._row_dots(acc_k, mma_w, sK, tid)
            if const_expr(pair is None):  # else waited before dq's exchange
                s_done.arrive_and_wait()  # S has read dO, q (G1's dO read: DU_READY)
            for e in cutlass.range_constexpr(cute.size(acc_k)):
                stash[e // STASH_COLS][tid, e % STASH_COLS] = acc_k[e]
            for r in cutlass.range_constexpr(2):
                dg[r] = dg[r] - dk_k[r]
            self._stash_rows(dg, te, sRed, t0, row_w, tid, first, seqlen)
            rows.arrive()  # the stash and the rows' init for G1
            cute.arch.fence_view_async_shared()  # sPD, the stash over dO, U: before the TMA
            cute.arch.mbarrier_arrive(empty)

    @cute.jit
    def _decayed_rows(self, mma_w, acc_q, mG, sG, first, seqlen, b, hv):
        """dqe's start, S's and G2's alike: this thread's (tid, t0, row_w) of the (CHUNK, K)
        accumulator, its rows' decays (e_g, e_end: `_row_decays`) in the chunk at `first`, and
        acc_q's rows (dO h) scaled by e_g in place."""
        tid = opaque_tid_x() % WG
        t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
        last = cutlass.min(first + CHUNK, seqlen) - 1
        e_g, e_end = self._row_decays(mG, t0, row_w, first, seqlen, b, hv, sG[last - first])
        qa = rows_cols(acc_q)
        for r in cutlass.range_constexpr(cute.size(qa, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(qa, mode=[1])):
                qa[r, j] = qa[r, j] * e_g[r]
        return tid, t0, row_w, e_g, e_end

    @cute.jit
    def _w_and_u(self, wy, sK, sW, sUw, full, par, own):
        """`w_from_t`, G2: W = [T diag(beta e^G)] K into the W box and u = [T diag(beta)] V
        over v in the WY u's box (kernel 0's products: T read from the T^T box (16-bit, kernel
        0's rounding of its fp32 T) and scaled by column in fp32, then rounded to the A operand
        as kernel 0 rounds its fp32 T's), each (C, V) fp32 accumulator rounded once to 16 bits,
        fenced; on return every thread's W and u are in place (`own`). K and the scales
        (`sBw`: beta, beta e^G) are this chunk's (group 0 and the staging waited by the
        caller)."""
        mma_ks, mma_st, sTt, sBw, _ = wy
        tid = opaque_tid_x() % WG
        wg_ks = mma_ks.get_slice(0)
        wg_st = mma_st.get_slice(0)
        t_view = mma_ks.get_slice(tid).partition_C(transposed(sTt)[None, None, 0])
        t0, _, col_base = softmax.acc_coords(mma_ks, tid, (CHUNK, CHUNK))
        acc = cute.make_rmem_tensor(wg_st.partition_shape_C((CHUNK, self.v)), Float32)
        tA = wg_ks.make_fragment_A(wg_ks.partition_shape_A((CHUNK, CHUNK)))
        for x in cutlass.range_constexpr(2):  # W (B = k, scale beta e^G), u (v, beta)
            r_t = cute.make_rmem_tensor(wg_ks.partition_shape_C((CHUNK, CHUNK)), Float32)
            r_t.store(t_view.load().to(Float32))
            a = rows_cols(r_t)
            for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                s_j = sBw[col_base + t0[0, j][1], 1 - x]
                for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                    a[r, j] = a[r, j] * s_j
            acc_to_operand_a(r_t, tA)
            if const_expr(x == 1):
                cute.arch.mbarrier_wait(full + U_GROUP, par)  # v
            tB = wg_st.make_fragment_B(wg_st.partition_B(transposed((sK, sUw)[x])))
            gemm(mma_st, acc, tA, tB[None, None, None, 0], True, 0)
            if const_expr(x == 1):
                own.arrive_and_wait()  # every thread's product has read v: u may go over it
            self._store_tile(acc, mma_st, (sW, sUw)[x], False)
        own.arrive_and_wait()  # W, u in place (fenced) for U's product

    @cute.jit
    def _kk(self, mma_s, sK, sKK, tid):
        """K K^T (C, C) fp32 into sKK in the accumulator's thread order, for G's WY half (S's,
        or G2's: G's `_wy` spilled holding it)."""
        wg_s = mma_s.get_slice(0)
        acc_kk = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(
            mma_s,
            acc_kk,
            wg_s.make_fragment_A(wg_s.partition_A(sK))[None, None, None, 0],
            wg_s.make_fragment_B(wg_s.partition_B(sK))[None, None, None, 0],
            True,
            0,
        )
        for e in cutlass.range_constexpr(KK_REGS):
            sKK[tid, e] = acc_kk[e]

    @cute.jit
    def _dpd(self, mma_s, mma_k, sDO, sU, sW, sH, sUw, sG, full, par, first, seqlen, own):
        """dPD = (dO U^T) o D (kernel 2's first product, for dq and dk; the (C, C) fp32
        accumulator, returned); `u_from_h`: U formed first (W, h landed; `own` the forming
        warpgroup's barrier)."""
        wg_s = mma_s.get_slice(0)
        cute.arch.mbarrier_wait(full + U_GROUP, par)  # U (u_from_h: the WY u; w_from_t: G2's)
        if const_expr(self.u_from_h):
            cute.arch.mbarrier_wait(full + H_GROUP, par)
            self._u_from_h(mma_k, sW, sH, sUw, sU)
            own.arrive_and_wait()  # every thread's U in sU (fenced) before dPD reads it
        acc_p = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(
            mma_s,
            acc_p,
            wg_s.make_fragment_A(wg_s.partition_A(sDO))[None, None, None, 0],
            wg_s.make_fragment_B(wg_s.partition_B(sU))[None, None, None, 0],
            True,
            0,
        )
        self._decay_pd(acc_p, mma_s, sG, first, seqlen)
        return acc_p

    @cute.jit
    def _u_from_h(self, mma_k, sW, sH, sUw, sU):
        """`u_from_h`: U = u - W h (C, V) into the U box, 16-bit, fenced: the product on W and
        h's transposed (MN-major) view in fp32, the WY u read from shared memory in the
        accumulator's order and the difference rounded once (G's dU on k and dS likewise)."""
        wg_k = mma_k.get_slice(0)
        acc = cute.make_rmem_tensor(wg_k.partition_shape_C((CHUNK, self.v)), Float32)
        gemm(
            mma_k,
            acc,
            wg_k.make_fragment_A(wg_k.partition_A(sW))[None, None, None, 0],
            wg_k.make_fragment_B(wg_k.partition_B(transposed(sH)))[None, None, None, 0],
            True,
            0,
        )
        tid = opaque_tid_x() % WG
        u = mma_k.get_slice(tid).partition_C(sUw[None, None, 0])
        for e in cutlass.range_constexpr(cute.size(acc)):
            acc[e] = u[e].to(Float32) - acc[e]
        self._store_tile(acc, mma_k, sU, False)

    @cute.jit
    def _decay_pd(self, acc_p, mma_s, sG, first, seqlen):
        """dO U^T o D in place: D_ij = e^(G_i - G_j) for j <= i, rows inside T, else 0
        (kernel 2's, from the G staged in `sG`)."""
        tid = opaque_tid_x() % WG
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        p = rows_cols(acc_p)
        for r in cutlass.range_constexpr(cute.size(p, mode=[0])):
            ri = row_s + t0s[r, 0][0]
            g_i = sG[ri]
            for j in cutlass.range_constexpr(cute.size(p, mode=[1])):
                col = col_s + t0s[0, j][1]
                d = Float32(0.0)
                if col <= ri and first + ri < seqlen:
                    d = cute.math.exp(g_i - sG[col], fastmath=True)
                p[r, j] = p[r, j] * d

    @cute.jit
    def _grads(
        self, mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sQ, sK, sW, sUw, sPT, sTt, sH, sDH,
        sDU, sG2, sRed2, mG, mV, mBeta, mDQ, mDK, mDG, mDV, mDB, full, empty, hv, b, seqlen,
        nchunks, scale, stash, sKK, sPD, slot0=None, tables=None, pair=None, sDW=None,
    ):  # fmt: skip
        """Warpgroup 2, per chunk: dU = (k dS) o e^(G_C - G) + P^T dO into sDU (S's, and the
        chunk's), then kernel 2's `_math` (WY, dqk16) on the stage: dPD^T in the spent P^T
        box, dw in the spent q box (after S_DONE), M^T in the P^T box again (`_wy`). slot0,
        tables (varlen): `_slot`'s, kernel 2's `token_rows` tables; pair (`group_sum`): the
        exchanges' mbarriers and receive buffers."""
        math = named_barrier(Bar.MATH, WG)
        ready = unaligned_barrier(Bar.DS_READY, 2 * WG + FINISH_THREADS)
        du_ready = self._du_ready()
        dh_free = named_barrier(Bar.DH_FREE, self.dh_free_threads)
        s_done = named_barrier(Bar.S_DONE, 2 * WG)
        finish = unaligned_barrier(Bar.FINISH, WG + FINISH_THREADS)
        wy_smem = (sTt, sW, sUw, sQ, sPT)  # T^T, w, u, dw (over q), M^T (over P^T)
        for cc in cutlass.range(nchunks - 1, -1, -1, unroll=1):
            # opaque: no induction variable derived from c lives across the loop (they spilled)
            c = opaque_i32(cc)
            i = nchunks - 1 - c
            hv, b, _ = cute.arch.block_idx()  # re-read each chunk: not live across `_wy`
            hv, b = opaque_i32(hv), opaque_i32(b)
            if const_expr(slot0 is not None):  # varlen: the tiles' slot, batch index 0
                c = opaque_i32(slot0 + cc)
                b = 0
            par = i % 2
            first = c * CHUNK
            sG = sG2[None, par]
            sRed = sRed2[None, par]
            gtid = opaque_tid_x() % WG
            if gtid < CHUNK:  # the chunk's G in shared memory (the decay loops' column reads)
                g_t = Float32(0.0)
                if first + gtid < seqlen:
                    g_t = mG[b, first + gtid, hv]
                sG[gtid] = g_t
            math.arrive_and_wait()
            # dU = (k dS) o e^(G_C - G) + P^T dO
            wg_k = mma_k.get_slice(0)
            tArK = wg_k.make_fragment_A(wg_k.partition_A(sK))
            tArPT = wg_k.make_fragment_A(wg_k.partition_A(sPT))
            tBrDS = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDH)))
            tBrDO = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDO)))
            tid = opaque_tid_x() % WG
            t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
            last = cutlass.min(first + CHUNK, seqlen) - 1
            _, e_end = self._row_decays(mG, t0, row_w, first, seqlen, b, hv, sG[last - first])
            acc_u = cute.make_rmem_tensor(wg_k.partition_shape_C((CHUNK, self.v)), Float32)
            cute.arch.mbarrier_wait(full + 0, par)  # k, P^T, dO
            ready.arrive_and_wait()  # dS in sDH
            gemm(mma_k, acc_u, tArK[None, None, None, 0], tBrDS[None, None, None, 0], True, 0)
            ua = rows_cols(acc_u)
            for r in cutlass.range_constexpr(cute.size(ua, mode=[0])):
                for j in cutlass.range_constexpr(cute.size(ua, mode=[1])):
                    ua[r, j] = ua[r, j] * e_end[r]
            gemm(mma_k, acc_u, tArPT[None, None, None, 0], tBrDO[None, None, None, 0], False, 0)
            self._store_tile(acc_u, mma_k, sDU, False)
            math.arrive_and_wait()  # every thread's dU in sDU (and done with P^T)
            du_ready.arrive()
            if const_expr(self.wg_split):  # dq, dk's inter-chunk half: G2's (`_products`)
                self._dw_and_wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, sH, sDW, sTt, sW,
                                sUw, sPT, sG, sRed, mG, mV, mBeta, mDK, mDV, mDB, full, math,
                                dh_free, i, c, hv, b, seqlen, nchunks, stash, sKK,
                                tables, pair)  # fmt: skip
            else:
                self._chunk_grads(mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sQ, sK, sH, sDH,
                                  sPT, sDU, wy_smem, sG, sRed, mG, mV, mBeta, mDQ, mDK, mDV,
                                  mDB, full, math, dh_free, s_done, i, c, hv, b, seqlen,
                                  nchunks, scale, stash, sKK, sPD, tables, pair)  # fmt: skip
            # G wrote into spent boxes (dk's stash, dPD^T, dw, M^T): ordered before the next
            # chunk's TMA writes there (async proxy)
            cute.arch.fence_view_async_shared()
            cute.arch.mbarrier_arrive(empty)
            finish.arrive_and_wait()  # the rows stashed: a wait on both sides (kernel 2's)

    @cute.jit
    def _chunk_grads(
        self, mma_w, mma_s, mma_q, mma_k, mma_da, sDO, sU, sQ, sK, sH, sDH, sP, sDU, wy_smem,
        sG, sRed, mG, mV, mBeta, mDQ, mDK, mDV, mDB, full, math, dh_free, s_done, i, c, hv, b,
        seqlen, nchunks, scale, stash, sKK, sPD, tables=None, pair=None,
    ):  # fmt: skip
        """Kernel 2's `_math` (WY, dqk16, one math warpgroup) on this chunk's stage, its load
        groups waited at this chunk's phase, dPD and dPD^T the state warpgroup's (S_DONE: in
        shared memory, and dO, q, U read by S, so that dk's stash and dw may go over them),
        DH_FREE arrived once sDH is read (dke) but at the walk's last chunk (i = nchunks - 1; c
        the tiles' chunk, a slot with varlen). tables: the outputs' token rows (varlen); pair
        (`group_sum`): dq's exchange here (dO's box free at S_DONE), dk's in `_wy`."""
        par = i % 2
        first = c * CHUNK
        wg_w = mma_w.get_slice(0)
        wg_k = mma_k.get_slice(0)
        tArDO = wg_w.make_fragment_A(wg_w.partition_A(sDO))
        tArU = wg_w.make_fragment_A(wg_w.partition_A(sU))
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sH))
        tBrDH = wg_w.make_fragment_B(wg_w.partition_B(sDH))
        tQrP = wg_k.make_fragment_A(wg_k.partition_A(sPD))
        tQrK = wg_k.make_fragment_B(wg_k.partition_B(transposed(sK)))
        tKrP = wg_k.make_fragment_A(wg_k.partition_A(sP))
        tKrQ = wg_k.make_fragment_B(wg_k.partition_B(transposed(sQ)))
        acc_q = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        cute.arch.mbarrier_wait(full + 2, par)  # h
        gemm(mma_w, acc_q, tArDO[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
        tid, t0, row_w, e_g, e_end = self._decayed_rows(mma_w, acc_q, mG, sG, first, seqlen, b, hv)
        # S's dPD, dPD^T in shared memory; S has read dO, q, U: dk's stash and dw may go there
        s_done.arrive_and_wait()
        if const_expr(pair is not None):  # dO read by S and G (dqe waited): the peer may write
            self._pair_free(pair[0], 0)
        cute.arch.mbarrier_wait(full + 1, par)  # q, W
        gemm(mma_k, acc_q, tQrP[None, None, None, 0], tQrK[None, None, None, 0], False, 0)
        dg = self._row_dots(acc_q, mma_w, sQ, tid)
        if const_expr(pair is not None):
            self._pair_store(acc_q, mma_w, mDQ, pair, 0, par, b, c, seqlen, scale, tables)
        else:
            self._store_rows(acc_q, mma_w, mDQ, tid, b, hv, c, seqlen, scale,
                             _token_rows(tables, c))  # fmt: skip

        acc_k = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        cute.arch.mbarrier_wait(full + U_GROUP, par)  # U (u_from_h: the WY u; U is S's, S_DONE)
        gemm(mma_w, acc_k, tArU[None, None, None, 0], tBrDH[None, None, None, 0], True, 0)
        more = c > 0  # not the walk's last chunk: S writes another dS
        if const_expr(tables is not None):
            more = i < nchunks - 1
        if more:
            dh_free.arrive()  # sDH read: S may write the next chunk's dS
        ka = rows_cols(acc_k)
        for r in cutlass.range_constexpr(cute.size(ka, mode=[0])):
            for j in cutlass.range_constexpr(cute.size(ka, mode=[1])):
                ka[r, j] = ka[r, j] * e_end[r]
        te = self._row_dots(acc_k, mma_w, sK, tid)
        gemm(mma_k, acc_k, tKrP[None, None, None, 0], tKrQ[None, None, None, 0], False, 0)
        dk_k = self._row_dots(acc_k, mma_w, sK, tid)
        if const_expr(pair is not None):
            math.arrive_and_wait()  # the owners' reads of the peer's dq rows (over dO) first
        for e in cutlass.range_constexpr(cute.size(acc_k)):
            stash[e // STASH_COLS][tid, e % STASH_COLS] = acc_k[e]
        for r in cutlass.range_constexpr(2):
            dg[r] = dg[r] - dk_k[r]
        self._stash_rows(dg, te, sRed, t0, row_w, tid, first, seqlen)
        cute.arch.mbarrier_wait(full + 4, par)  # T^T, u
        gemm(mma_w, acc_k, tArDU[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
        acc_k.store(-acc_k.load())
        self._store_tile(acc_k, mma_w, wy_smem[3], False)  # dw, 16-bit, over q
        math.arrive_and_wait()
        self._wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, wy_smem, sG, sRed, mDK, mV, mBeta,
                 mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c, stash, sKK,
                 tables, pair, par)  # fmt: skip

    @cute.jit
    def _dw_and_wy(self, mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, sH, sDW, sTt, sW, sUw, sPT,
                   sG, sRed, mG, mV, mBeta, mDK, mDV, mDB, full, math, dh_free, i, c, hv, b,
                   seqlen, nchunks, stash, sKK, tables, pair=None):  # fmt: skip
        """`wg_split`, G1 after dU: sDH released (dU's k dS was G1's last read of it), dw =
        -dU h^T (`_chunk_grads`' last product) into the spent h box once G2 and the finish
        warps have read h (H_FREE), then `_wy` (K K^T after KK, dk's stash and dG's rows after
        ROWS: G2's)."""
        par = i % 2
        first = c * CHUNK
        more = c > 0  # not the walk's last chunk: S writes another dS
        if const_expr(tables is not None):
            more = i < nchunks - 1
        if more:
            dh_free.arrive()
        wg_w = mma_w.get_slice(0)
        tid = opaque_tid_x() % WG
        t0, row_w, _ = softmax.acc_coords(mma_w, tid, (CHUNK, self.k))
        last = cutlass.min(first + CHUNK, seqlen) - 1
        e_g, _ = self._row_decays(mG, t0, row_w, first, seqlen, b, hv, sG[last - first])
        acc_k = cute.make_rmem_tensor(wg_w.partition_shape_C((CHUNK, self.k)), Float32)
        cute.arch.mbarrier_wait(full + H_GROUP, par)  # h
        if const_expr(not self.w_from_t):  # else T^T with q (group 1), u G2's (H_FREE)
            cute.arch.mbarrier_wait(full + 4, par)  # T^T, u
        tArDU = wg_w.make_fragment_A(wg_w.partition_A(sDU))
        tBrH = wg_w.make_fragment_B(wg_w.partition_B(sH))
        gemm(mma_w, acc_k, tArDU[None, None, None, 0], tBrH[None, None, None, 0], True, 0)
        acc_k.store(-acc_k.load())
        # h read by G2 (`w_from_t`: after it formed W and u) and the finish warps
        named_barrier(Bar.H_FREE, 2 * WG + FINISH_THREADS).arrive_and_wait()
        self._store_tile(acc_k, mma_w, sDW, False)  # dw, 16-bit
        cute.arch.mbarrier_wait(full + 1, par)  # W (`w_from_t`: T^T)
        if const_expr(not self.w_from_t):
            cute.arch.mbarrier_wait(full + U_GROUP, par)  # the WY u (`u_from_h`'s group)
        math.arrive_and_wait()
        self._wy(mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, (sTt, sW, sUw, sDW, sPT), sG,
                 sRed, mDK, mV, mBeta, mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c,
                 stash, sKK, tables, pair, par)  # fmt: skip

    @cute.jit
    def _wy(self, mma_w, mma_s, mma_q, mma_k, mma_da, sDU, sK, wy_smem, sG, sRed, mDK, mV,
            mBeta, mDV, mDB, math, e_g, t0, row_w, first, seqlen, b, hv, c, stash,
            sKK, tables=None, pair=None, par=None):  # fmt: skip
        """Kernel 2's `_wy` (dqk16, one math warpgroup) with K K^T read from shared memory
        (`sKK`: the state warpgroup's fp32 accumulator, stored in the same thread order)
        instead of a product held in 32 registers across dA's masking: at kernel 2's 254 registers
        plus this loop's own values, that peak spilled (368 bytes). The same sums in the same
        order otherwise; `tables`: dv, dk, dbeta at their token rows (varlen); `pair`, `par`
        (`group_sum`): dk's exchange (K K^T's buffer free after the masking). TODO(merge): a
        K K^T hook in `GdnBwdChunkSm90._wy` instead of this copy, once the fsplit edits there
        have landed."""
        sTt, sW, sUw, sDW, sM = wy_smem
        sDB = cute.make_tensor(sRed.iterator + 2 * CHUNK + 4, cute.make_layout(CHUNK))
        tid = opaque_tid_x() % WG
        wg_k = mma_k.get_slice(0)
        wg_q = mma_q.get_slice(0)
        wg_da = mma_da.get_slice(0)
        wg_s = mma_s.get_slice(0)
        tArT = wg_k.make_fragment_A(wg_k.partition_A(sTt))
        tBrDW = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDW)))
        tBrDU = wg_k.make_fragment_B(wg_k.partition_B(transposed(sDU)))
        shape = wg_k.partition_shape_C((CHUNK, self.k))
        beta = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(2):
            i = first + row_w + t0[r, 0][0]
            if i < seqlen:
                beta[r] = mBeta[b, i, hv]
        acc_v = cute.make_rmem_tensor(shape, Float32)
        gemm(mma_k, acc_v, tArT[None, None, None, 0], tBrDU[None, None, None, 0], True, 0)
        # dvb.v and dv = beta dvb before dA's product (kernel 2 overlaps them with it): acc_v
        # dies at its 16-bit copy, not held beside dA's accumulator
        dbeta = self._row_dots_global(acc_v, mma_k, mV, tid, b, hv, c, seqlen)
        tDArV = wg_da.make_fragment_A(wg_da.partition_shape_A((CHUNK, self.v)))
        acc_to_operand_a(acc_v, tDArV)
        va = rows_cols(acc_v)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(cute.size(va, mode=[1])):
                va[r, j] = va[r, j] * beta[r]
        self._store_rows(acc_v, mma_k, mDV, tid, b, hv, c, seqlen, at=_token_rows(tables, c))
        tBrW = wg_da.make_fragment_B(wg_da.partition_B(sW))
        tBrUw = wg_da.make_fragment_B(wg_da.partition_B(sUw))
        acc_a = cute.make_rmem_tensor(wg_s.partition_shape_C((CHUNK, CHUNK)), Float32)
        gemm(mma_da, acc_a, tDArV, tBrUw[None, None, None, 0], True, -1)
        acc_b = cute.make_rmem_tensor(shape, Float32)
        gemm(mma_k, acc_b, tArT[None, None, None, 0], tBrDW[None, None, None, 0], True, 0)
        tDArB = wg_da.make_fragment_A(wg_da.partition_shape_A((CHUNK, self.k)))
        acc_to_operand_a(acc_b, tDArB)
        gemm(mma_da, acc_a, tDArB, tBrW[None, None, None, 0], False, 0)
        x = self._row_dots(acc_b, mma_k, sK, tid)  # dkb.k
        # each row's dbeta and dG terms go to shared memory as they are formed (by the quad's
        # first thread, which reads them back): none is held across the masking and M's
        # products (at 256 registers they spilled)
        self._add_rows(sDB, dbeta, e_g, x, t0, row_w, tid, first, seqlen, True)
        bx = [beta[r] * e_g[r] * x[r] for r in range(2)]
        if const_expr(not self.wg_split):  # else after ROWS (G2 initializes the rows)
            self._add_rows(sRed, bx, None, None, t0, row_w, tid, first, seqlen)
        ba = rows_cols(acc_b)
        for r in cutlass.range_constexpr(2):
            for j in cutlass.range_constexpr(cute.size(ba, mode=[1])):
                ba[r, j] = ba[r, j] * (beta[r] * e_g[r])
        warpgroup.wait_group(0)
        if const_expr(self.wg_split):
            named_barrier(Bar.KK, 2 * WG).arrive_and_wait()  # G2's K K^T in sKK
        # dA strictly lower, D, rows inside T; rowsum(dAe o KK^T); M = beta dAe. The thread's
        # coordinates afresh: the output half's (same values) held 16 sG addresses across
        tid = opaque_tid_x() % WG
        t0s, row_s, col_s = softmax.acc_coords(mma_s, tid, (CHUNK, CHUNK))
        s = rows_cols(acc_a)
        # sKK[tid, e] holds register e of this thread's K K^T accumulator (S's, same layout)
        kk_layout = cute.composition(cute.make_layout(cute.size(acc_a), stride=WG), acc_a.layout)
        kk = rows_cols(cute.make_tensor(sKK.iterator + tid, kk_layout))
        rkk = [Float32(0.0), Float32(0.0)]
        rmk = [Float32(0.0), Float32(0.0)]
        for r in cutlass.range_constexpr(cute.size(s, mode=[0])):
            i = row_s + t0s[r, 0][0]
            g_i = sG[i]
            beta_i = Float32(0.0)
            if first + i < seqlen:
                beta_i = mBeta[b, first + i, hv]
            part = Float32(0.0)
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                col = col_s + t0s[0, j][1]
                d = Float32(0.0)
                if col < i and first + i < seqlen:
                    d = -cute.math.exp(g_i - sG[col], fastmath=True)
                s[r, j] = s[r, j] * d
                part = part + s[r, j] * kk[r, j]
            rkk[r] = cute.arch.warp_reduction_sum(part, threads_in_group=4)
            rmk[r] = beta_i * rkk[r]
            for j in cutlass.range_constexpr(cute.size(s, mode=[1])):
                s[r, j] = s[r, j] * beta_i
        self._add_rows(sDB, rkk, None, None, t0s, row_s, tid, first, seqlen)
        if const_expr(not self.wg_split):
            self._add_rows(sRed, rmk, None, None, t0s, row_s, tid, first, seqlen)
        self._store_tile(acc_a, mma_s, sM, True)  # M^T for M^T k
        tQrM = wg_q.make_fragment_A(wg_q.partition_shape_A((CHUNK, CHUNK)))
        acc_to_operand_a(acc_a, tQrM)
        tQrK = wg_q.make_fragment_B(wg_q.partition_B(transposed(sK)))
        gemm(mma_q, acc_b, tQrM, tQrK[None, None, None, 0], False, 0)
        before = self._row_dots(acc_b, mma_k, sK, tid)
        if const_expr(not self.wg_split):
            self._add_rows(sRed, before, None, None, t0, row_w, tid, first, seqlen)
        math.arrive_and_wait()  # every thread's M^T in shared memory
        if const_expr(pair is not None):  # K K^T read: the peer may write its dk rows there
            self._pair_free(pair[0], 1)
        tKrM = wg_k.make_fragment_A(wg_k.partition_A(sM))
        tKrK = wg_k.make_fragment_B(wg_k.partition_B(transposed(sK)))
        gemm(mma_k, acc_b, tKrM[None, None, None, 0], tKrK[None, None, None, 0], False, 0)
        after = self._row_dots(acc_b, mma_k, sK, tid)
        if const_expr(self.wg_split):
            # G2's stash and rows' init (ROWS), then G1's four row terms in the order above
            named_barrier(Bar.ROWS, 2 * WG).arrive_and_wait()
            self._add_rows(sRed, bx, None, None, t0, row_w, tid, first, seqlen)
            self._add_rows(sRed, rmk, None, None, t0s, row_s, tid, first, seqlen)
            self._add_rows(sRed, before, None, None, t0, row_w, tid, first, seqlen)
        self._add_rows(sRed, [-after[0], -after[1]], None, None, t0, row_w, tid, first, seqlen)
        tid = opaque_tid_x() % WG
        c = opaque_i32(c)  # dk's row addresses afresh: dq's (same rows) were held across
        for e in cutlass.range_constexpr(cute.size(acc_b)):
            acc_b[e] = acc_b[e] + stash[e // STASH_COLS][tid, e % STASH_COLS]
        if const_expr(pair is not None):
            self._pair_store(acc_b, mma_k, mDK, pair, 1, par, b, c, seqlen, tables=tables)
        else:
            self._store_rows(acc_b, mma_k, mDK, tid, b, hv, c, seqlen,
                             at=_token_rows(tables, c))  # fmt: skip
        if tid % 4 == 0:  # dbeta from its rows' sums
            at = _token_rows(tables, c)
            for r in cutlass.range_constexpr(2):
                i = row_w + t0[r, 0][0]
                if const_expr(at is None):
                    if first + i < seqlen:
                        mDB[b, first + i, hv] = sDB[i]
                elif i < at[1]:
                    mDB[b, at[0] + i, hv] = sDB[i]

    @cute.jit
    def _pair_free(self, bars, x):
        """`group_sum`, exchange x (EXCHANGES' index), once every reader of its receive buffer
        has passed a barrier: one thread arms the buffer's "landed" mbarrier with the peer's
        bytes (EXCHANGE_BYTES) and arrives on the peer's "free" one. CTA scope, as CUTLASS's
        consumer release of a multicast stage: every read of the buffer has returned (its
        values consumed, WGMMAs waited) before that barrier; the release at cluster scope
        compiled to a MEMBAR.ALL.GPU in front of the arrive (2026-12-07)."""
        if opaque_tid_x() % WG == 0:
            cute.arch.mbarrier_arrive_and_expect_tx(bars + LANDED + x, EXCHANGE_BYTES)
            peer = cute.arch.block_idx_in_cluster() ^ 1
            cute.arch.mbarrier_arrive(bars + FREE + x, peer_cta_rank_in_cluster=peer)

    @cute.jit
    def _pair_store(self, acc, mma, mOut, pair, x, par, b, c, seqlen, scale=None, tables=None):
        """`group_sum`, exchange x at this chunk's phase `par`: G's (C, K) fp32 accumulator of
        this value head summed with the peer's and stored (16-bit, times `scale` when given) at
        the q / k head, out[b, tokens of chunk c, hv // PAIR, :] (`tables`, varlen: at the
        slot's token rows, `_token_rows`): the warps owning this rank's rows wait for the
        peer's rows (RECV_SHAPE, the same thread index) and add them to their own (own + peer:
        the same sum on both ranks), the other two push theirs to the peer once its buffer is
        free (16 stores of 16 bytes a thread). Unconditional: every chunk of the walk
        exchanges all C rows (rows past T, or past a slot's length, are zeros or unused and
        masked at the store only), so both ranks, which walk the same chunks, meet equally
        often."""
        bars, recv = pair[0], pair[1][x]
        tid = opaque_tid_x() % WG
        rank = cute.arch.block_idx_in_cluster()
        owner = tid % PAIR_THREADS
        if cute.arch.make_warp_uniform(tid // PAIR_THREADS) == rank:
            cute.arch.mbarrier_wait(bars + LANDED + x, par)
            for e in cutlass.range_constexpr(cute.size(acc)):
                acc[e] = acc[e] + recv[owner, e]
            hv, _, _ = cute.arch.block_idx()
            self._store_rows(acc, mma, mOut, tid, b, hv // PAIR, c, seqlen, scale,
                             _token_rows(tables, c))  # fmt: skip
        else:
            cute.arch.mbarrier_wait(bars + FREE + x, par)
            peer = rank ^ 1
            dst = peer_address(recv.iterator + 4 * owner, peer)
            landed = peer_address(bars + LANDED + x, peer)
            step = 4 * 4 * PAIR_THREADS  # bytes between a thread's 16-byte groups
            for v in cutlass.range_constexpr(cute.size(acc) // 4):
                store_peer_f32x4(dst + v * step, [acc[4 * v + j] for j in range(4)], landed)

    @cute.jit
    def _add_rows(self, dst, vals, e, x, t0, row_base, tid, first, seqlen,
                  init: cutlass.Constexpr[bool] = False):  # fmt: skip
        """dst[row] += vals[r] (`init`: dst[row] = vals[r] + e[r] x[r]) for this thread's two
        rows, by the quad's first thread, rows inside T (the stashed dG rows' rule)."""
        if tid % 4 == 0:
            for r in cutlass.range_constexpr(2):
                i = row_base + t0[r, 0][0]
                if first + i < seqlen:
                    if const_expr(init):
                        dst[i] = vals[r] + e[r] * x[r]
                    else:
                        dst[i] = dst[i] + vals[r]

    @cute.jit
    def _finish(self, sH, sDH, sRed2, sG2, mDG, full, empty, b, hv, seqlen, nchunks, slot0=None,
                tables=None):  # fmt: skip
        """Warps 1, 2 of warpgroup 0, per chunk: <dS, h> as soon as both are on chip (then
        sDH and the stage's h released), then, once G has stashed the rows, dG of every token
        (one a thread): the rows' dg, the last position's te sum + e^(G_C) <dS, h>, and the
        reverse cumulative sum within the chunk (kernel 2's `_finish_dg`). slot0, tables:
        `_grads`'."""
        ready = unaligned_barrier(Bar.DS_READY, 2 * WG + FINISH_THREADS)
        dh_free = named_barrier(Bar.DH_FREE, self.dh_free_threads)
        finish = unaligned_barrier(Bar.FINISH, WG + FINISH_THREADS)
        own = named_barrier(Bar.FINISH_WARPS, FINISH_THREADS)
        for i in cutlass.range(nchunks, unroll=1):
            c = self._slot(nchunks - 1 - i, slot0)
            par = i % 2
            first = c * CHUNK
            sRed = sRed2[None, par]
            tid = opaque_tid_x() - WARP_SIZE
            ready.arrive_and_wait()
            cute.arch.mbarrier_wait(full + H_GROUP, par)
            part = self._h_dh_part(sH, sDH, tid)
            if const_expr(self.wg_split):  # h read: G1's dw may go over it
                named_barrier(Bar.H_FREE, 2 * WG + FINISH_THREADS).arrive()
            if i < nchunks - 1:
                dh_free.arrive()
            cute.arch.mbarrier_arrive(empty)
            self._stash_h_dh(part, sRed, tid)
            own.arrive_and_wait()
            finish.arrive_and_wait()
            sG = sG2[None, par]
            self._dg_rows(sRed, sG, mDG, b, hv, first, seqlen, tid, _token_rows(tables, c))
