"""Gated DeltaNet backward, kernel 1: the reverse state recurrence for Hopper (sm_90a). TMA +
WGMMA, one CTA per (sequence, value head), chunks in reverse, the state gradient on chip for the
whole sequence (the forward's `gdn_prefill/sm90/chunked_fwd.py` structure, run backwards).

Per chunk of C = 64 tokens (reference/delta_rule_bwd.py's pass 2; dS the gradient of the state
at the chunk's end, starting from the final state's gradient):

    dU  = P^T dO + (K e^(G_C - G)) dS
    dS <- e^(G_C) dS + (Q e^G)^T dO - W^T dU

computed transposed, value rows on the MMA's M as the forward's state: each state warpgroup
keeps 64 rows of dS^T (V, K) as an fp32 WGMMA accumulator and feeds it to the next product as
a 16-bit register A operand. Per chunk and state warpgroup (B operands from shared memory):

    dU^T  = dS^T Ke^T + dO^T P          (64 x 64 x K, then 64 x 64 x 64; B K-major: Ke, P^T)
    dS^T <- e^(G_C) dS^T + dO^T Qe - dU^T W     (64 x K x 64 twice; B MN-major: Qe, W)

dO^T is read from the dO tile's transposed view into registers (as the forward reads V^T).

FIRST VERSION (2026-12-03), simplified against docs/linear_attention/NOTES.md's plan:
- the chunk factors are inputs, not formed in the kernel: P^T (stored token-major: row j of a
  chunk holds column j of P), Ke = K e^(G_C - G), Qe = Q e^G (q scaled), W = T diag(beta e^G) K
  in 16 bits and e^(G_C) per chunk in fp32, all from `reference/gdn_bwd_state.py` (the plan's
  aux warpgroup that forms them a chunk behind is not built);
- fixed length (B, T, ...) tensors, TMA zero-filling the tail chunk (so the factors' padded rows
  are zero, as the reference's padding makes them); no varlen, no grouped heads (one CTA reads
  its own head of every tile);
- outputs dU (B, T, HV, V) fp32, dh = dS^T at every chunk's end (B, NC, HV, V, K) fp32, and
  the initial state's gradient (B, HV, K, V) fp32; the state-side gradients (dO h^T, -dU h^T,
  U dS^T) are not formed here (they need h: the plan's next step).

Warp roles (3 warpgroups, 384 threads, setmaxnreg split in config.py):
- warpgroup 0, warp 0 (producer): per chunk, last first (forward: first first), one (C, D)
  TMA box of each of dO, P^T, Ke, Qe, W into one STAGES-deep ring;
- warpgroups 1, 2 (state): value rows [64 w, 64 w + 64) of dS^T; the products above; dU^T and
  dS^T to global memory.

Variant `channel_decay` (compile flag; Kimi Delta Attention, 2026-12-05): e^(G_C) is a (K,)
vector per chunk, dS <- diag(e^(G_C)) dS + ..., i.e. dS^T's column k scales by e^(G_C)_k. The
vector (B, NC, HV, K) fp32 rides the ring as a sixth TMA box (1, K) (512 B a stage) and each
thread reads its accumulator fragment's columns from shared memory (as the KDA forward's
`recurrence.py` decays S^T); every other factor tile carries its per-channel decays already.

Variant `out16` (compile flag; 2026-12-05): dU and the per-chunk state in kernel 2's 16-bit
forms instead of fp32: dU (B, T, HV, V) in the tiles' dtype and dS itself (not dS^T) at every
chunk's end (B, NC, HV, K, V), each thread's fragment converted in registers and stored through
the transposed view (the torch conversions and transposes of 1.5 KB a token-head of fp32 go).
Variant `forward` (compile flag, with out16; the op's forward launch, which runs the FORWARD
recurrence through this one: `reference.gdn_bwd_state.forward_launch_as_reverse` its model): the
chunks walked FIRST to last (the producer's and the outputs' chunk index c = i, not NC - 1 - i),
the tiles as the factors wrote them: dO = u, Ke = W, W = Ke, e^(G_C), all in chunk order and
unnegated; P^T = I and Qe = 0 are compile-time forms, neither read (two boxes of five, 24 of 72
KB a chunk) nor multiplied, and the two signs live in registers:
dU^T = dO^T - dS^T Ke^T (the product's fp32 accumulator subtracted from the dO^T registers:
U^T = u^T - S^T W^T), dS^T <- e^(G_C) dS^T + dU^T W (dU^T fed unnegated: S^T += U^T Ke). Bit
for bit the recurrence the reverse variant ran on u, -W, -Ke in reversed chunk order (a sign
flip is exact in the product, the 16-bit rounding and x - y = x + (-y)). U and h land in chunk
order. Neither flag is in Gated DeltaNet's or KDA's standard keys unless set. Variant `fused`
(compile flag, with forward, not varlen; the op's fused route, ops/gated_delta_rule_bwd.py
`_fused_pass`, FUSED_DIET): U not stored (mDU None; the fused kernel forms U = u - W h from the
h written here); the W-slot tile is k at its own H heads (value head hv reads hv // (HV / H))
instead of Ke = k e^(G_C - G), and mG (B, NC C, HV) fp32, kernel 0's G of every row, scales
U^T's token columns by e^(G_C - G) before they become the update's A operand (S^T += (U^T
diag(e^(G_C - G))) k). Kernel 0 then writes no Ke and this launch no U (32 KB a chunk-head) and
it reads k, shared by a group's value heads in L2, in place of Ke. h differs from the forward
key's by the 16-bit rounding of the scaled U^T in place of Ke's. Variant `w_from_t` (compile
flag, with fused; ops/gated_delta_rule_bwd.py FUSED_WFROMT, off): W and u not read but formed
here from kernel 0's T^T, v, k, beta and G (kernel 0's `w_from_t` key writes neither: 32 KB a
chunk-head): the ring holds v (dO's slot), T^T (P^T's, (C, C)) and k (W's), 40 KB a stage.
Per chunk each state warpgroup w forms

    u^T[rows of w] = (V^T diag(beta)) T^T   (64 x 64 x 64 into dU^T's accumulator, A = v's
                                              transposed view scaled by column, B = T^T MN-major)
    -W[:, columns of w] = -T diag(beta e^G) K[:, columns of w]   (64 x 64 x 64, A = T from T^T's
                                              transposed view scaled by column, B = k MN-major)

-W's half rounded to 16 bits into the W buffer of the stage (Ke's slot, written by the
warpgroups, not by TMA); both halves in place at a named barrier (Bar.STATE), then dU^T += S^T
(-W)^T, so U^T = u^T - S^T W^T with u^T never rounded (the `fused` key rounds kernel 0's u to
16 bits). The buffer of stage s is rewritten two chunks later, after the other warpgroup's
product on it has completed (waited before its release) and it has passed the next chunk's
barrier: one barrier a chunk. beta fp32 (B, T, HV), read per token column (0 past T).

Variant `varlen` (compile flag, 2026-12-06; ops/_linattn_varlen.py): the tiles hold N sequences
in the forward's chunk slots (`gdn_prefill/sm90/config.py` `first_slot`): (1, S C, HV, D) with
S = T // C + N, chunk c of sequence n at slot bos_n // C + n + c, e^(G_C) (1, S, HV[, K]) and
the per-chunk outputs at the same slots, the states (N, HV, K, V). One CTA per (value head,
sequence), the sequence taken longest first from an order table (N,) int32 (the long chains
start in the first wave); it reads bos, eos from cu_seqlens (N + 1,) and walks the slots it
owns, [bos // C + n, eos // C + n + 1): its ceil(len / C) chunks and at most one zero chunk
after them (zero tiles and e^(G_C) = 1: the state passes unchanged, exactly; dU = 0), so every
slot of the outputs is written and every row stored (the zero rows' dU is 0). Batch index 0 for
the tiles, n for the states. Not in any key unless set.

Constraints: K = V = 128, 16-bit tiles with unit last strides and 16-byte aligned token strides
(TMA); e^(G_C) and the states fp32, unit last strides (channel_decay: e^(G_C) 16-byte aligned
outer strides, TMA).
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
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.common.sm90 import softmax
from forgekernel.kernels.common.sm90.barriers import FIRST_FREE, named_barrier
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE
from forgekernel.kernels.common.sm90.layout import (
    acc_as_operand_a,
    acc_to_operand_a,
    rows_cols,
    select,
    transposed,
)
from forgekernel.kernels.common.sm90.mma import gemm
from forgekernel.kernels.common.sm90.pipeline import (
    consumer_state,
    init_arrive,
    init_wait,
    producer_state,
    smem_tensor,
    tma_pipeline,
)
from forgekernel.kernels.common.sm90.ptx import opaque_tid_x
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import GdnBwdChunkSm90
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.config import (
    CHUNK,
    PRODUCER_REGS,
    ROWS_PER_STATE_WG,
    STAGES,
    STATE_REGS,
    STATE_WGS,
    THREADS,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import first_slot

ROWS = ROWS_PER_STATE_WG
PRODUCER_WARP = 0


class Bar(IntEnum):
    """Named barriers (id 0 is __syncthreads)."""

    STATE = FIRST_FREE  # both state warpgroups: dS (dke) or -W's halves (w_from_t) in place


def _tdhb(t: cute.Tensor) -> cute.Tensor:
    """(B, T, H, D) as (T, D, H, B): the TMA view, the chunk's tokens and columns leading."""
    return select(t, [1, 3, 2, 0])


class GdnBwdStateSm90:
    """Warp-specialized reverse state recurrence of the Gated DeltaNet backward; see the module
    docstring. Kernel 2's shared-memory tile store (`_store_tile`: w_from_t's -W halves)."""

    _store_tile = GdnBwdChunkSm90._store_tile

    def __init__(
        self,
        k: int,
        v: int,
        *,
        d_final_state: bool,
        dke: bool = False,
        channel_decay: bool = False,
        out16: bool = False,
        forward: bool = False,
        varlen: bool = False,
        fused: bool = False,
        w_from_t: bool = False,
    ):
        if (k, v) != (128, 128):
            raise ValueError(f"(K, V) must be (128, 128), got {(k, v)}")
        if out16 and dke:
            raise ValueError("out16 writes dh: not with dke")
        if forward and not out16:
            raise ValueError("forward needs out16")
        if fused and (not forward or varlen):
            raise ValueError("fused is the batch forward launch's")
        if w_from_t and not fused:
            raise ValueError("w_from_t needs fused")
        self.k, self.v = k, v
        self.d_final_state = d_final_state
        self.dke = dke
        self.channel_decay = channel_decay
        self.out16 = out16
        self.forward = forward
        self.varlen = varlen
        self.fused = fused  # forward: U not stored, k and G in place of Ke
        self.w_from_t = w_from_t  # fused: W, u formed from T^T, v, k, beta, G (not read)

    def _setup(self):
        dt = self.dtype
        k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
        rmem = warpgroup.OperandSource.RMEM
        # dU^T: (64 value rows, C tokens), A from registers, B K-major (Ke, P^T)
        self.mma_ks = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (ROWS, CHUNK), a_source=rmem
        )
        # dS^T update: (64 value rows, K), B the Qe / W tiles' transposed (MN-major) views
        self.mma_st = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, mn_major, Float32, (1, 1, 1), (ROWS, self.k), a_source=rmem
        )
        # dke[:, K half w] = U dS^T: (C tokens, 64 k), both operands K-major in shared memory
        self.mma_dke = sm90_utils.make_trivial_tiled_mma(
            dt, dt, k_major, k_major, Float32, (1, 1, 1), (CHUNK, ROWS)
        )
        # w_from_t: u^T's rows (64 value rows, C tokens, B = T^T) and W's column half (C tokens,
        # 64 k, B = k's half), both over the chunk, A from registers, B MN-major
        self.mma_half = None
        if self.w_from_t:
            self.mma_half = sm90_utils.make_trivial_tiled_mma(
                dt, dt, k_major, mn_major, Float32, (1, 1, 1), (ROWS, CHUNK), a_source=rmem
            )
        row = LayoutEnum.ROW_MAJOR
        # dS (K, V) row-major: the K-major B of dke (n = k, reduced over v)
        self.sS_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, self.k, self.v), dt, 1)
        self.sD_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, self.k), dt, STAGES)
        self.sP_layout = sm90_utils.make_smem_layout_b(row, (CHUNK, CHUNK, CHUNK), dt, STAGES)
        # e^(G_C) (1, K) fp32 a stage (channel_decay)
        self.sE_layout = cute.make_layout((1, self.k, STAGES), stride=(self.k, 1, self.k))

    @cute.jit
    def __call__(
        self,
        mDO: cute.Tensor,
        mPT: cute.Tensor | None,
        mKe: cute.Tensor,
        mQe: cute.Tensor | None,
        mW: cute.Tensor,
        mU: cute.Tensor | None,
        mEl: cute.Tensor,
        mDht: cute.Tensor | None,
        mDU: cute.Tensor | None,
        mDh: cute.Tensor | None,
        mDke: cute.Tensor | None,
        mDh0: cute.Tensor,
        mCu: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mG: cute.Tensor | None,
        mBeta: cute.Tensor | None,
        stream: cuda.CUstream,
    ):
        """mDO (B, T, HV, V), mPT (B, T, HV, C), mKe, mQe, mW (B, T, HV, K) 16-bit; mEl fp32
        (B, NC, HV), with channel_decay (B, NC, HV, K); mDht (or None) and mDh0 fp32 (B, HV,
        K, V); mDU fp32 (B, T, HV, V) (out16: 16-bit). With dke: mU (B, T, HV, V) 16-bit,
        mDke fp32 (B, T, HV, K), mDh None; else mU and mDke None, mDh fp32 (B, NC, HV, V, K)
        (out16: 16-bit (B, NC, HV, K, V)). With forward: mPT and mQe None (I and 0). With varlen:
        B = 1 and NC = S slots for the tiles and per-chunk outputs, mDht and mDh0 (N, HV, K, V),
        mCu int32 (N + 1,), mOrder int32 (N,) (the sequences longest first); else both None.
        With fused: mDU None (U not stored), mW k (B, T', H, K) and mG fp32 (B, NC C, HV);
        else mG None. With w_from_t: mDO v (B, T, HV, V), mPT T^T (B, T, HV, C), mKe None (W
        formed) and mBeta fp32 (B, T, HV); else mBeta None."""
        self.dtype = mDO.element_type
        inputs = (mKe, mW) if const_expr(self.forward) else (mPT, mKe, mQe, mW)
        if const_expr(self.w_from_t):
            inputs = (mPT, mW)
        for t in inputs + ((mU,) if const_expr(self.dke) else ()):
            if const_expr(t.element_type != self.dtype):
                raise TypeError(f"the 16-bit tiles must share one dtype, got {t.element_type}")
        if const_expr(self.out16):
            for t in (mDh,) if const_expr(self.fused) else (mDU, mDh):
                if const_expr(t.element_type != self.dtype):
                    raise TypeError(f"out16: dU, dh in the tiles' dtype, got {t.element_type}")
        self._setup()
        g2s = cpasync.CopyBulkTensorTileG2SOp()
        sD_tile = cute.slice_(self.sD_layout, (None, None, 0))
        sP_tile = cute.slice_(self.sP_layout, (None, None, 0))
        tmas = []
        for m, tile, d in ((mDO, sD_tile, self.v), (mPT, sP_tile, CHUNK), (mKe, sD_tile, self.k),
                           (mQe, sD_tile, self.k), (mW, sD_tile, self.k)):  # fmt: skip
            if const_expr(m is None):  # forward: P^T, Qe compile-time forms
                tmas.append((None, None))
            else:
                tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(m), tile, (CHUNK, d)))
        if const_expr(self.dke):
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(mU), sD_tile, (CHUNK, self.v)))
        else:
            tmas.append((None, None))
        d_tiles = 5 if const_expr(self.dke) else 4
        if const_expr(self.w_from_t):  # v, T^T, k
            self.tx_bytes = 2 * cute.size_in_bytes(self.dtype, sD_tile) + cute.size_in_bytes(
                self.dtype, sP_tile
            )
        elif const_expr(self.forward):
            self.tx_bytes = 3 * cute.size_in_bytes(self.dtype, sD_tile)  # dO, Ke, W
        else:
            self.tx_bytes = d_tiles * cute.size_in_bytes(self.dtype, sD_tile) + cute.size_in_bytes(
                self.dtype, sP_tile
            )
        e_elems = 0
        if const_expr(self.channel_decay):
            e_tile = cute.slice_(self.sE_layout, (None, None, 0))
            tmas.append(cpasync.make_tiled_tma_atom(g2s, _tdhb(mEl), e_tile, (1, self.k)))
            self.tx_bytes += cute.size_in_bytes(Float32, e_tile)
            e_elems = cute.cosize(self.sE_layout)
            mEl = None  # read through the ring, not from global memory
        else:
            tmas.append((None, None))
        u_elems = cute.cosize(self.sD_layout) if const_expr(self.dke) else 0
        s_elems = cute.cosize(self.sS_layout) if const_expr(self.dke) else 0
        p_elems = cute.cosize(self.sP_layout)  # w_from_t: T^T
        if const_expr(self.forward and not self.w_from_t):
            p_elems = 0
        qe_elems = 0 if const_expr(self.forward) else cute.cosize(self.sD_layout)

        @cute.struct
        class SharedStorage:
            barriers: cute.struct.MemRange[cutlass.Int64, 2 * STAGES]
            sDO: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sD_layout)], 1024
            ]
            sPT: cute.struct.Align[cute.struct.MemRange[self.dtype, p_elems], 1024]
            sKe: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sD_layout)], 1024
            ]
            sQe: cute.struct.Align[cute.struct.MemRange[self.dtype, qe_elems], 1024]
            sW: cute.struct.Align[
                cute.struct.MemRange[self.dtype, cute.cosize(self.sD_layout)], 1024
            ]
            sU: cute.struct.Align[cute.struct.MemRange[self.dtype, u_elems], 1024]
            sS: cute.struct.Align[cute.struct.MemRange[self.dtype, s_elems], 1024]
            sE: cute.struct.Align[cute.struct.MemRange[Float32, e_elems], 128]

        self.shared_storage = SharedStorage
        atoms_and_views = [x for atom_view in tmas for x in atom_view]
        self.kernel(
            *atoms_and_views,
            mEl,
            mDht,
            mDU,
            mDh,
            mDke,
            mDh0,
            mCu,
            mOrder,
            mG,
            mBeta,
            self.mma_ks,
            self.mma_st,
            self.mma_dke,
            self.mma_half,
            self.sD_layout,
            self.sP_layout,
            self.sS_layout,
            self.sE_layout,
        ).launch(  # fmt: skip
            grid=(mDO.shape[2], mDh0.shape[0] if const_expr(self.varlen) else mDO.shape[0], 1),
            block=[THREADS, 1, 1],
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.kernel
    def kernel(
        self,
        tma_do: cute.CopyAtom,
        mDO4: cute.Tensor,
        tma_pt: cute.CopyAtom,
        mPT4: cute.Tensor,
        tma_ke: cute.CopyAtom,
        mKe4: cute.Tensor,
        tma_qe: cute.CopyAtom,
        mQe4: cute.Tensor,
        tma_w: cute.CopyAtom,
        mW4: cute.Tensor,
        tma_u: cute.CopyAtom | None,
        mU4: cute.Tensor | None,
        tma_e: cute.CopyAtom | None,
        mE4: cute.Tensor | None,
        mEl: cute.Tensor | None,
        mDht: cute.Tensor | None,
        mDU: cute.Tensor | None,
        mDh: cute.Tensor | None,
        mDke: cute.Tensor | None,
        mDh0: cute.Tensor,
        mCu: cute.Tensor | None,
        mOrder: cute.Tensor | None,
        mG: cute.Tensor | None,
        mBeta: cute.Tensor | None,
        mma_ks: cute.TiledMma,
        mma_st: cute.TiledMma,
        mma_dke: cute.TiledMma,
        mma_half: cute.TiledMma | None,
        sD_layout: cute.ComposedLayout,
        sP_layout: cute.ComposedLayout,
        sS_layout: cute.ComposedLayout,
        sE_layout: cute.Layout,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        atoms = (tma_do, tma_pt, tma_ke, tma_qe, tma_w)
        if const_expr(self.forward):
            atoms = (tma_do, tma_ke, tma_w)
        if const_expr(self.w_from_t):  # v, T^T, k
            atoms = (tma_do, tma_pt, tma_w)
        if const_expr(self.dke):
            atoms = atoms + (tma_u,)
        if const_expr(self.channel_decay):
            atoms = atoms + (tma_e,)
        if warp_idx == PRODUCER_WARP:
            for atom in atoms:
                cpasync.prefetch_descriptor(atom)
        storage = SmemAllocator().allocate(self.shared_storage)
        ring = tma_pipeline(
            storage.barriers, STAGES, self.tx_bytes, STATE_WGS * THREADS_PER_WG // WARP_SIZE
        )
        init_arrive()
        sPT, sQe = None, None  # forward: I and 0, not in shared memory
        sDO = smem_tensor(storage.sDO, sD_layout)
        if const_expr(not self.forward or self.w_from_t):
            sPT = smem_tensor(storage.sPT, sP_layout)
        sKe = smem_tensor(storage.sKe, sD_layout)
        if const_expr(not self.forward):
            sQe = smem_tensor(storage.sQe, sD_layout)
        sW = smem_tensor(storage.sW, sD_layout)
        sU, sS, sE = None, None, None
        if const_expr(self.dke):
            sU = smem_tensor(storage.sU, sD_layout)
            sS = smem_tensor(storage.sS, sS_layout)
        if const_expr(self.channel_decay):
            sE = storage.sE.get_tensor(sE_layout)
        init_wait()

        hv, b, _ = cute.arch.block_idx()
        seqlen = mDO4.shape[0]
        nchunks = (seqlen + CHUNK - 1) // CHUNK
        n, first = b, None  # the state's sequence, its first chunk slot (varlen)
        if const_expr(self.varlen):
            n = mOrder[b]
            bos, eos = mCu[n], mCu[n + 1]
            first = first_slot(bos, n)
            nchunks = first_slot(eos, n + 1) - first
            b = 0
        wg = cute.arch.make_warp_uniform(tidx // THREADS_PER_WG)
        if wg == 0:
            cute.arch.setmaxregister_decrease(PRODUCER_REGS)
            if warp_idx == PRODUCER_WARP:
                srcs = ((mDO4, sDO, (CHUNK, self.v)), (mPT4, sPT, (CHUNK, CHUNK)),
                        (mKe4, sKe, (CHUNK, self.k)), (mQe4, sQe, (CHUNK, self.k)),
                        (mW4, sW, (CHUNK, self.k)))  # fmt: skip
                if const_expr(self.w_from_t):  # W formed: T^T in its place
                    srcs = (srcs[0], srcs[1], srcs[4])
                elif const_expr(self.forward):
                    srcs = (srcs[0], srcs[2], srcs[4])
                if const_expr(self.dke):
                    srcs = srcs + ((mU4, sU, (CHUNK, self.v)),)
                if const_expr(self.channel_decay):
                    srcs = srcs + ((mE4, sE, (1, self.k)),)  # row c: chunk c's e^(G_C)
                heads = None  # every tile at head hv
                if const_expr(self.fused):  # k at its own head
                    heads = (hv, hv, hv // (mDO4.shape[2] // mW4.shape[2]))
                self._produce(atoms, srcs, ring, hv, b, nchunks, first, heads)
        else:
            cute.arch.setmaxregister_increase(STATE_REGS)
            self._state(
                wg - 1, tidx - wg * THREADS_PER_WG, mma_ks, mma_st, mma_dke, sDO, sPT, sKe, sQe,
                sW, sU, sS, sE, mEl, mDht, mDU, mDh, mDke, mDh0, ring, hv, b, seqlen, nchunks, n,
                first, mG, mBeta, mma_half,
            )  # fmt: skip

    @cute.jit
    def _produce(self, atoms, srcs, ring, hv, b, nchunks, first, heads=None):
        """TMA: per chunk, last first (forward: first first), one (C, D) box of each tile
        (head hv, or heads[i] for tile i where given, sequence b) into the ring (and the (1, K)
        box of e^(G_C) with channel_decay); boxes past T are zero-filled. varlen: chunk c at
        slot first + c."""
        one = cute.make_layout(1)
        loads = []
        for i in cutlass.range_constexpr(len(srcs)):
            atom, (m, s, box) = atoms[i], srcs[i]
            head = hv if const_expr(heads is None) else heads[i]
            g = cute.local_tile(m[None, None, head, b], box, (None, 0))
            ts, tg = cpasync.tma_partition(
                atom, 0, one, cute.group_modes(s, 0, 2), cute.group_modes(g, 0, 2)
            )
            loads.append((atom, ts, tg))
        st = producer_state(STAGES)
        for i in cutlass.range(nchunks, unroll=1):
            c = i if const_expr(self.forward) else nchunks - 1 - i  # forward: in order
            if const_expr(self.varlen):
                c = first + c
            ring.producer_acquire(st)
            bar = ring.producer_get_barrier(st)
            for atom, ts, tg in loads:
                cute.copy(atom, tg[(None, c)], ts[(None, st.index)], tma_bar_ptr=bar)
            st.advance()

    @cute.jit
    def _state(
        self, w, stid, mma_ks, mma_st, mma_dke, sDO, sPT, sKe, sQe, sW, sU, sS, sE, mEl, mDht,
        mDU, mDh, mDke, mDh0, ring, hv, b, seqlen, nchunks, n, first, mG, mBeta=None,
        mma_half=None,
    ):  # fmt: skip
        """b: the tiles' batch index; n: the states' (both the sequence but with varlen, where
        b = 0 and chunk i of the walk is slot first + i)."""
        thr_st = mma_st.get_slice(stid)
        acc_ds = cute.make_rmem_tensor(thr_st.partition_shape_C((ROWS, self.k)), Float32)
        if const_expr(self.d_final_state):
            self._state_io(mDht[n, hv, None, None], acc_ds, thr_st, w, True, True)
        else:
            acc_ds.fill(0.0)
        wg_ks = mma_ks.get_slice(0)
        wg_st = mma_st.get_slice(0)
        acc_shape = wg_ks.partition_shape_C((ROWS, CHUNK))
        tDSrDS = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, self.k)))
        tDOrDO = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tDUrDU = wg_ks.make_fragment_A(wg_ks.partition_shape_A((ROWS, CHUNK)))
        tBrPT, tBrQe = None, None  # forward: I and 0
        tBrKe = wg_ks.make_fragment_B(wg_ks.partition_B(sKe))
        if const_expr(not self.forward):
            tBrPT = wg_ks.make_fragment_B(wg_ks.partition_B(sPT))
            tBrQe = wg_st.make_fragment_B(wg_st.partition_B(transposed(sQe)))
        tBrW = wg_st.make_fragment_B(wg_st.partition_B(transposed(sW)))
        sDOt = transposed(sDO)  # (V, C, stages)
        if const_expr(self.dke):
            wg_dke = mma_dke.get_slice(0)
            tArU = wg_dke.make_fragment_A(wg_dke.partition_A(sU))
            sS_w = cute.local_tile(sS[None, None, 0], (ROWS, self.v), (w, 0))  # k rows of w
            tBrS = wg_dke.make_fragment_B(wg_dke.partition_B(sS_w))
            both = named_barrier(Bar.STATE, STATE_WGS * THREADS_PER_WG)
        if const_expr(self.w_from_t):
            both = named_barrier(Bar.STATE, STATE_WGS * THREADS_PER_WG)
        st = consumer_state(STAGES)
        for i in cutlass.range(nchunks, unroll=1):
            c = i if const_expr(self.forward) else nchunks - 1 - i  # inputs and outputs alike
            if const_expr(self.varlen):
                c = first + c
            acc_du = cute.make_rmem_tensor(acc_shape, Float32)
            g_tok = None
            if const_expr(self.fused):  # loaded here, used after the first product
                g_tok = self._token_gates(acc_du, mma_ks, mG, b, c, hv)
            e_tok = None  # w_from_t: loaded here too (under the ring's wait), used first
            if const_expr(self.w_from_t):
                e_tok = self._token_betas(mma_ks, mBeta, g_tok[1], b, c, hv, seqlen)
            if const_expr(self.w_from_t):
                # S^T's A operand and 16-bit h before the ring's wait and the formation: after
                # the formation ptxas serialized every HGMMA of the key without dht (C7520,
                # "compiler-inserted WG.AR in divergent path": 20 of 20 waited, R229; here 3
                # of 20, R222 with and without dht; cu13, 2026-12-07)
                acc_to_operand_a(acc_ds, tDSrDS)
                self._store_state16(tDSrDS, thr_st, mDh[b, c, hv, None, None], w)
            ring.consumer_wait(st)
            if const_expr(self.w_from_t):  # u^T into acc_du, -W's half into sKe
                self._w_and_u(mma_ks, mma_half, acc_du, tDOrDO, e_tok, sDOt, sPT, sW, sKe, w,
                              st.index)  # fmt: skip
            else:
                acc_to_operand_a(acc_ds, tDSrDS)
                if const_expr(self.out16):  # dS, 16-bit: the A operand's registers, no 2nd copy
                    self._store_state16(tDSrDS, thr_st, mDh[b, c, hv, None, None], w)
            if const_expr(self.w_from_t):  # both halves of -W in place: U^T = u^T - S^T W^T
                both.arrive_and_wait()
                gemm(mma_ks, acc_du, tDSrDS, tBrKe[None, None, None, st.index], False, -1)
            else:
                gemm(mma_ks, acc_du, tDSrDS, tBrKe[None, None, None, st.index], True, -1)
            if const_expr(self.dke):
                acc_dke = cute.make_rmem_tensor(wg_dke.partition_shape_C((CHUNK, ROWS)), Float32)
                both.arrive_and_wait()  # the other warpgroup's previous dke has read sS
                self._store_ds(acc_ds, mma_st, sS, w)
                both.arrive_and_wait()
                gemm(mma_dke, acc_dke, tArU[None, None, None, st.index], tBrS, True, -1)
            # thread-dependent views rebuilt each chunk (the forward's reason: hoisted, they
            # stay live across the loop)
            tid = opaque_tid_x() % THREADS_PER_WG
            r_do = None  # w_from_t: u^T in acc_du already
            if const_expr(not self.w_from_t):
                r_do = cute.make_rmem_tensor(acc_shape, Float32)
                dot = cute.local_tile(sDOt[None, None, st.index], (ROWS, CHUNK), (w, 0))
                r_do.store(mma_ks.get_slice(tid).partition_C(dot).load().to(Float32))
            if const_expr(not self.forward):
                acc_to_operand_a(r_do, tDOrDO)
                gemm(mma_ks, acc_du, tDOrDO, tBrPT[None, None, None, st.index], False, -1)
            if const_expr(not self.dke and not self.out16):
                self._state_io(mDh[b, c, hv, None, None], acc_ds, thr_st, w, False, False)
            warpgroup.wait_group(0)
            if const_expr(self.forward and not self.w_from_t):
                acc_du.store(r_do.load() - acc_du.load())  # U^T = u^T - S^T W^T (exact sign)
            if const_expr(self.channel_decay):
                self._decay_columns(acc_ds, mma_st, sE, st.index)
            else:
                acc_ds.store(acc_ds.load() * mEl[b, c, hv])
            if const_expr(not self.forward):  # forward: Qe = 0
                gemm(mma_st, acc_ds, tDOrDO, tBrQe[None, None, None, st.index], False, -1)
            if const_expr(self.fused):  # W = k: S^T += (U^T diag(e^(G_C - G))) k
                g_c, g_j = g_tok
                a = rows_cols(acc_du)
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    e = cute.math.exp(g_c - g_j[j], fastmath=True)
                    for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                        a[r, j] = a[r, j] * e
            if const_expr(self.forward):  # W = Ke: S^T += U^T Ke, U^T fed as it is
                acc_to_operand_a(acc_du, tDUrDU)
            else:
                r_neg = cute.make_rmem_tensor(acc_shape, Float32)
                r_neg.store(-acc_du.load())
                acc_to_operand_a(r_neg, tDUrDU)
            gemm(mma_st, acc_ds, tDUrDU, tBrW[None, None, None, st.index], False, -1)
            if const_expr(not self.fused):
                self._store_du(acc_du, mma_ks, mDU, tid, w, hv, b, c, seqlen)
            if const_expr(self.dke):
                self._store_dke(acc_dke, mma_dke, mDke, tid, w, hv, b, c, seqlen)
            warpgroup.wait_group(0)
            ring.consumer_release(st)
            st.advance()
        self._state_io(mDh0[n, hv, None, None], acc_ds, thr_st, w, False, True)

    @cute.jit
    def _token_gates(self, acc_du, mma_ks, mG, b, c, hv) -> tuple:
        """fused: (G_C, [G_j]) for the token columns j of this thread's U^T fragment
        (`acc_du`'s), from kernel 0's G rows of chunk c (G_C its last row's: past T, G stays
        the last token's, as kernel 0's scan leaves it); e^(G_C - G_j) is formed where U^T is
        scaled, after the first product (the loads' latency under it)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        t0, _, col_base = softmax.acc_coords(mma_ks, tid, (ROWS, CHUNK))
        first = c * CHUNK
        g_j = []
        for j in cutlass.range_constexpr(cute.size(rows_cols(acc_du), mode=[1])):
            g_j.append(mG[b, first + col_base + t0[0, j][1], hv])
        return mG[b, first + CHUNK - 1, hv], g_j

    @cute.jit
    def _token_betas(self, mma_ks, mBeta, g_j, b, c, hv, seqlen) -> tuple:
        """w_from_t: ([beta_j], [beta_j e^(G_j)]) for the token columns j of this thread's
        (C, C) fragments (`_token_gates`' columns, g_j their G), beta 0 past T (the v and k
        rows there are TMA's zeros: any finite beta would do)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        t0, _, col_base = softmax.acc_coords(mma_ks, tid, (ROWS, CHUNK))
        beta, beta_eg = [], []
        for j in cutlass.range_constexpr(len(g_j)):
            t = c * CHUNK + col_base + t0[0, j][1]
            inside = t < seqlen
            b_j = cutlass.select_(inside, Float32(mBeta[b, cutlass.min(t, seqlen - 1), hv]),
                                  Float32(0.0))  # fmt: skip
            beta.append(b_j)
            beta_eg.append(b_j * cute.math.exp(g_j[j], fastmath=True))
        return beta, beta_eg

    @cute.jit
    def _w_and_u(self, mma_ks, mma_half, acc_du, tA_u, e_tok, sDOt, sPT, sW, sKe, w, s):
        """w_from_t, state warpgroup w at ring stage s: u^T's value rows of w into acc_du (A =
        V^T diag(beta) from v's transposed view, B = T^T: acc_du = u^T, fp32, never rounded) and
        -W's columns [64 w, 64 w + 64) (A = T diag(beta e^G) from T^T's transposed view, B =
        k's column half) rounded to 16 bits into sKe's stage s (fenced; the caller's barrier
        puts both halves in place). The A operands scaled by column in fp32 and rounded once,
        as kernel 0 rounds its T's (here from its 16-bit T)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        thr = mma_ks.get_slice(tid)
        wg_h = mma_half.get_slice(0)
        sTt = transposed(sPT[None, None, s])  # (i, j): T
        r_a = cute.make_rmem_tensor(acc_du.shape, Float32)
        vt = cute.local_tile(sDOt[None, None, s], (ROWS, CHUNK), (w, 0))
        r_a.store(thr.partition_C(vt).load().to(Float32))
        self._scale_columns(r_a, e_tok[0])
        acc_to_operand_a(r_a, tA_u)
        tBt = wg_h.make_fragment_B(wg_h.partition_B(sTt))
        gemm(mma_half, acc_du, tA_u, tBt, True, -1)
        r_t = cute.make_rmem_tensor(acc_du.shape, Float32)
        r_t.store(thr.partition_C(sTt).load().to(Float32))
        self._scale_columns(r_t, e_tok[1])
        tA_w = wg_h.make_fragment_A(wg_h.partition_shape_A((CHUNK, CHUNK)))
        acc_to_operand_a(r_t, tA_w)
        k_half = cute.local_tile(transposed(sW[None, None, s]), (ROWS, CHUNK), (w, 0))
        tBk = wg_h.make_fragment_B(wg_h.partition_B(k_half))
        acc_w = cute.make_rmem_tensor(acc_du.shape, Float32)
        gemm(mma_half, acc_w, tA_w, tBk, True, 0)
        acc_w.store(-acc_w.load())
        self._store_tile(acc_w, mma_half, cute.local_tile(sKe, (CHUNK, ROWS, 1), (0, w, s)),
                         False)  # fmt: skip

    @cute.jit
    def _scale_columns(self, x, scales):
        """x's column j (this thread's j-th accumulator column) times scales[j]."""
        a = rows_cols(x)
        for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, j] = a[r, j] * scales[j]

    @cute.jit
    def _decay_columns(self, acc_ds, mma_st, sE, s):
        """dS^T <- dS^T diag(e^(G_C)): column j (key channel j) of the accumulator times
        e^(G_C)_j, read from ring stage s."""
        tid = opaque_tid_x() % THREADS_PER_WG
        t0, _, col_base = softmax.acc_coords(mma_st, tid, (ROWS, self.k))
        a = rows_cols(acc_ds)
        for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
            e = sE[0, col_base + t0[0, j][1], s]
            for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                a[r, j] = a[r, j] * e

    @cute.jit
    def _store_du(self, acc_du, mma_ks, mDU, tid, w, hv, b, c, seqlen):
        """dU^T to dU[b, tokens of chunk c, hv, value rows of w], the rows inside T (out16:
        each element converted to the tiles' dtype)."""
        coords = softmax.acc_coords(mma_ks, tid, (ROWS, CHUNK))
        t0, _, col_base = coords
        dst_t = transposed(mDU[b, None, hv, None])  # (V, T)
        tile = cute.local_tile(dst_t, (ROWS, CHUNK), (w, c))
        g = rows_cols(mma_ks.get_slice(tid).partition_C(tile))
        a = rows_cols(acc_du)
        for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
            if c * CHUNK + col_base + t0[0, j][1] < seqlen:
                for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
                    if const_expr(self.out16):  # element by element: no 16-bit copy held
                        g[r, j] = a[r, j].to(self.dtype)
                    else:
                        g[r, j] = a[r, j]

    @cute.jit
    def _store_ds(self, acc_ds, mma_st, sS, w):
        """This warpgroup's value rows of dS^T, 16-bit, into the (K, V) tile by the transposed
        stmatrix (value columns [64 w, 64 w + 64)), fenced for the WGMMAs (async proxy)."""
        tid = opaque_tid_x() % THREADS_PER_WG
        r2s = cute.make_tiled_copy_C(
            cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(True, 4), self.dtype), mma_st
        )
        thr = r2s.get_slice(tid)
        r_ds = cute.make_rmem_tensor(acc_ds.shape, self.dtype)
        r_ds.store(acc_ds.load().to(self.dtype))
        dst = cute.local_tile(transposed(sS[None, None, 0]), (ROWS, self.k), (w, 0))
        cute.copy(r2s, thr.retile(r_ds), thr.partition_D(dst))
        cute.arch.fence_view_async_shared()

    @cute.jit
    def _store_dke(self, acc, mma_dke, mDke, tid, w, hv, b, c, seqlen):
        """dke (C tokens, 64 k) to dke[b, tokens of chunk c, hv, k columns of w], rows inside
        T."""
        t0, row_base, _ = softmax.acc_coords(mma_dke, tid, (CHUNK, ROWS))
        tile = cute.local_tile(mDke[b, None, hv, None], (CHUNK, ROWS), (c, w))
        g = rows_cols(mma_dke.get_slice(tid).partition_C(tile))
        a = rows_cols(acc)
        for r in cutlass.range_constexpr(cute.size(a, mode=[0])):
            if c * CHUNK + row_base + t0[r, 0][0] < seqlen:
                for j in cutlass.range_constexpr(cute.size(a, mode=[1])):
                    g[r, j] = a[r, j]

    @cute.jit
    def _store_state16(self, tDSrDS, thr_st, head, w):
        """out16: value rows [64 w, 64 w + 64) of dS^T from the 16-bit A operand the next
        product reads (`acc_to_operand_a`'s rounding of the accumulator) to `head` (K, V)
        transposed: the global partition seen in the operand's register order."""
        part = thr_st.partition_C(cute.local_tile(transposed(head), (ROWS, self.k), (w, 0)))
        g = acc_as_operand_a(part)
        for e in cutlass.range_constexpr(cute.size(g)):
            g[e] = tDSrDS[e]

    @cute.jit
    def _state_io(
        self, head, acc, thr_st, w, load: cutlass.Constexpr[bool], kv: cutlass.Constexpr[bool]
    ):
        """Value rows [64 w, 64 w + 64) of one state gradient, seen as dS^T (V, K): `head` in
        fla's (K, V) layout (kv; transposed here) or already (V, K); to or from the
        accumulator."""
        st = transposed(head) if const_expr(kv) else head
        part = thr_st.partition_C(cute.local_tile(st, (ROWS, self.k), (w, 0)))
        if const_expr(load):
            acc.store(part.load())
        else:
            part.store(acc.load())
