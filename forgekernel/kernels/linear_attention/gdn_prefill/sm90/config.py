"""Chunked Gated DeltaNet forward (prefill) configurations and the kernel's fixed geometry
(DSL-free: the launcher, the tests and the CPU replay read it)."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V): Qwen3-Next, Kimi Linear
CHUNK = 64  # tokens per chunk: the WY system is CHUNK x CHUNK, lower-triangular
BLOCK = 16  # the triangular inverse's diagonal blocks (4 per chunk, one per aux warp)
L2NORM_EPS = 1e-6  # fla's l2norm: x / sqrt(sum x^2 + eps)

# Warpgroups: 0 producer (warp 0 TMA, warp 1 gates), 1 aux (scores, masks, inverse),
# 2 .. state (64 value rows of the state each). V split: the value rows of one (sequence, head)
# spread over V_SPLIT CTAs (adjacent in the grid), each with V / (64 V_SPLIT) state warpgroups
# and its own copy of the aux work (which depends on q, k, g, beta only; two aux warpgroups in a
# split CTA, `aux_wgs`): 2 doubles the CTAs of a problem too small to fill the GPU (1 x 65536
# tokens x 32 heads: 32 CTAs on 132 SMs).
ROWS_PER_STATE_WG = 64
V_SPLITS = (1, 2)
STATE_WGS = 2  # at V = 128 without a split
# setmaxnreg split, multiples of 8, summing to at most the register file per CTA thread slot
PRODUCER_REGS = 24
AUX_REGS = 104
STATE_REGS = 192


def state_wgs(v: int = 128, v_split: int = 1) -> int:
    """State warpgroups of a CTA: its V / v_split value rows, 64 each."""
    return v // (ROWS_PER_STATE_WG * v_split)


def aux_wgs(v_split: int = 1) -> int:
    """Aux warpgroups of a CTA: two in a split CTA, taking alternate chunks (its one state
    warpgroup leaves the registers: 24 + 2 x 104 + 192 of 512 a thread slot), so that the aux
    chain (the inverse above all, ~2 k instructions a warp and chunk against a state warp's
    ~750) has two chunks' time; one in an unsplit CTA (no registers left: 24 + 104 + 2 x 192)."""
    return 2 if v_split == 2 else 1


def threads(v: int = 128, v_split: int = 1) -> int:
    return (1 + aux_wgs(v_split) + state_wgs(v, v_split)) * THREADS_PER_WG


def value_row_block(part, w, wgs):
    """The 64-row block of S^T (V, K) (and of the o columns) that state warpgroup w of the CTA
    taking part `part` of a V split holds (DSL integers or ints)."""
    return part * wgs + w


def v_split_for(sequences: int, value_heads: int, sms: int) -> int:
    """2 when the CTAs of an unsplit launch (one per sequence and value head) would leave half
    the SMs idle even doubled (2 N HV <= SMs), else 1: splitting pays where it adds SMs; beyond
    one wave it would add a wave (unless a split CTA's chunk, with its two aux warpgroups,
    takes under half an unsplit one's: to be measured, docs/linear_attention/NOTES.md)."""
    return 2 if 2 * sequences * value_heads <= sms else 1


for _s in V_SPLITS:
    _regs = PRODUCER_REGS + aux_wgs(_s) * AUX_REGS + state_wgs(128, _s) * STATE_REGS
    assert _regs * THREADS_PER_WG <= REGISTERS_PER_SM
THREADS = threads()  # the unsplit CTA's

# Ring depths (chunks in flight). q / k: 3, so that the aux warpgroup can load and work on
# chunk c + 2 while the state warpgroups are on chunk c (with 2 it could start chunk c + 1 only
# a TMA latency after they released chunk c - 1: its ~2000 cycles then barely fit); v: 2 (the
# state warpgroups' alone); the gate and aux rings: 2.
QK_STAGES = 3
V_STAGES = 2
STAGES = 2
W_STRIDE = CHUNK + 8  # fp32 words per row of the inverse's scratch (8-byte stores: 2 wavefronts)
X_STRIDE = 2 * BLOCK + 8  # the 32 x 32 scratch of the 32 -> 64 merge


def smem_bytes(
    k: int = 128,
    v: int = 128,
    elem_bytes: int = 2,
    v_split: int = 1,
    t_pre: bool = False,
    o_warp: bool = False,
) -> int:
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included).
    t_pre: the form reading T diag(beta) (`t_pre.py`): no inverse scratch, a T ring's barriers.
    o_warp (the standard form's key): the O ring's barriers (the t_pre form counts them)."""
    wgs = state_wgs(v, v_split)
    v_cols = wgs * ROWS_PER_STATE_WG  # the CTA's value columns
    tiles = CHUNK * (QK_STAGES * 2 * k + V_STAGES * v_cols) * elem_bytes  # q, k, v rings
    aux = 2 * STAGES * CHUNK * CHUNK * elem_bytes  # P and T diag(beta) rings
    out = wgs * 2 * CHUNK * ROWS_PER_STATE_WG * elem_bytes  # O tiles, double-buffered
    scratch = aux_wgs(v_split) * (CHUNK * W_STRIDE + 2 * BLOCK * X_STRIDE) * 4
    if t_pre:
        scratch = 2 * SCRATCH_STUB * 4
    tables = (2 * STAGES * CHUNK + STAGES * 4 * CHUNK + STAGES * 3 * CHUNK) * 4
    barriers = 2 * (QK_STAGES + V_STAGES + (3 if t_pre else 2) * STAGES) * 8
    if t_pre or o_warp:
        barriers += o_ring_barriers(wgs) * 8
    return tiles + aux + out + scratch + tables + barriers + 1024 * 4


# T precomputed (`t_pre.py`, the chunked kernel's `t_pre` form): T diag(beta) of every (chunk,
# value head) in a 16-bit buffer (slots x C, HV, C), chunk c of sequence n at slot
# bos_n // C + n + c. Slots never overlap (floor(b / C) + ceil(l / C) <= floor((b + l) / C) + 1)
# and need no table: both kernels compute them from cu_seqlens; T // C + N slots in all, the
# ones between sequences unwritten and unread.
SCRATCH_STUB = 4  # fp32 words of the t_pre form's unused inverse scratch fields


def o_ring_barriers(wgs: int) -> int:
    """The t_pre form's O hand-off (state warpgroup -> the O store warp): a full and an empty
    mbarrier for each of a state warpgroup's two O tiles."""
    return 2 * 2 * wgs


def first_slot(bos, n):
    """T's slot of chunk 0 of sequence n starting at token bos (ints or DSL integers)."""
    return bos // CHUNK + n


def t_slots(tokens: int, sequences: int) -> int:
    """Slots of the T buffer: T // C + N."""
    return tokens // CHUNK + sequences


def t_pre_params_for(dtype: str, k: int = 128, *, l2norm: bool = False) -> tuple:
    """The T precompute's compile key: the k dtype, K, and whether k is l2-normalized in the
    kernel (rk_i rk_j folded into L, as the chunked kernel's aux does)."""
    return tuple(sorted({"dtype": dtype, "k": k, "l2norm": l2norm}.items()))


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    k_last: bool = False,
    l2norm: bool = False,
    initial_state: bool = False,
    v_split: int = 1,
    t_pre: bool = False,
    state_lds: bool = False,
    o_warp: bool = False,
    no_o: bool = False,
) -> tuple:
    """Compile key: the q / k / v dtype, (K, V), the state's layout (k_last: (N, HV, V, K),
    FlashInfer's; else (N, HV, K, V), fla's), the q / k l2norm in the kernel, whether an
    initial state is read (without one every sequence starts from zero), and the V split
    (CTAs per sequence and head, `v_split_for`). The final state is always written: 64 KB per
    (sequence, head), against the 64 KB per 128 tokens the inputs read, it is not worth a
    variant. t_pre: the form that reads T diag(beta) from the precompute (`t_pre.py`) instead
    of forming it in the aux warpgroup; named in the key only when on (the standard keys, and
    so their cache entries, unchanged). state_lds (t_pre only): the state chain of next/gdn-tpre
    (V^T by 16-bit loads, O stored by the state warps), kept as the bench's A/B of the t_pre
    form's O warp and ldmatrix V^T; named only when on. o_warp (the standard form only; the
    t_pre form has it unless state_lds): the standard form with the t_pre form's state chain
    (V^T by transposed ldmatrix, O handed to warpgroup 0's O warp for a TMA store); named only
    when on. no_o (the t_pre form with its O warp): no o at all (no q loads or q norms, no
    Q K^T, P, O^T or O stores): the segmented path's pass B, whose o pass C overwrites; named
    only when on."""
    if v_split not in V_SPLITS:
        raise ValueError(f"v_split must be one of {V_SPLITS}, got {v_split}")
    if state_lds and not t_pre:
        raise ValueError("state_lds is a form of t_pre (the standard form has no O warp)")
    if o_warp and t_pre:
        raise ValueError("o_warp names the O warp on the standard form; the t_pre form has it")
    if no_o and (not t_pre or state_lds):
        raise ValueError("no_o is a form of t_pre with its O warp")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "k_last": k_last, "l2norm": l2norm,
           "initial_state": initial_state, "v_split": v_split}  # fmt: skip
    if t_pre:
        key["t_pre"] = True
        if state_lds:
            key["state_lds"] = True
    if o_warp:
        key["o_warp"] = True
    if no_o:
        key["no_o"] = True
    return tuple(sorted(key.items()))
