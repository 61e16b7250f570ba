"""Gated DeltaNet fused backward (kernel 1's reverse recurrence + kernel 2's chunk gradients,
one CTA per (sequence, value head)) configurations and fixed geometry (DSL-free: the launcher,
the op's dispatch and the tests read it). Design: docs/linear_attention/
gdn_bwd_fused_design_2026-12-06.md."""

from __future__ import annotations

from forgekernel.kernels.common.sm90.constants import (
    NUM_SMS_H100_H200,
    REGISTERS_PER_SM,
    THREADS_PER_WG,
)

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = ((128, 128),)  # (K, V)
CHUNK = 64  # tokens per chunk: the forward's
# warpgroup 0: the TMA warp (warp 0) and dG's finish (warps 1, 2); warpgroup 1 ("S"): dS^T (V,
# K) fp32, the whole state (two 64-row accumulators, 128 registers a thread), its update, and
# K K^T and dPD = (dO U^T) o D for G; warpgroup 2 ("G"): dU = Ke dS + P^T dO, then every other
# chunk gradient (kernel 2's WY form)
THREADS = 3 * THREADS_PER_WG
# setmaxnreg: the producer warpgroup (TMA + the finish loops), S, G (kernel 2's single math
# warpgroup body: 254 registers in the chunk kernel's WY + dqk16 key)
# (compiled 2026-12-06, bf16: G R0-R179, S R0-R221, warpgroup 0 R0-R24, nothing spilled)
# setmaxnreg.inc takes registers only from the CTA's pool, which holds what the launch
# allocated (LAUNCH_REGS a thread) less what the others keep: the three counts sum to at most
# 3 x 168 = 504. At 32 / 224 / 256 (512) the second warpgroup's USETMAXREG.TRY_ALLOC spun
# forever (a hang on the first launch); G's body needs 180 of its 248.
LAUNCH_REGS = REGISTERS_PER_SM // THREADS // 8 * 8  # ptxas' count for 384 threads: 168
REGS = (32, 224, 248)
assert sum(REGS) * THREADS_PER_WG <= LAUNCH_REGS * THREADS
# The chunk's TMA boxes, one mbarrier a group, in the order G consumes them (S waits on the
# first two only: dO, then q and W): dU (k, P^T, dO); q + W (S's update, dq's B, dw's slot);
# h (dqe = dO h^T, the finish's <dh, h>); U (S = dO U^T, dke); the WY tiles T^T, u.
LOAD_GROUPS = (("k", "pt", "do"), ("q", "w"), ("h",), ("u",), ("tt", "uw"))
# `u_from_h` (U = u - W h formed by the state warpgroup into the U box): the WY u in U's slot,
# where S waits for it (with h) before dPD; G's later wait on the slot finds it landed
U_FROM_H_LOAD_GROUPS = (("k", "pt", "do"), ("q", "w"), ("h",), ("uw",), ("tt",))
# `w_from_t` (with `wg_split` and `u_from_h`): W and u not loaded; G2 forms W = T diag(beta e^G)
# K from T^T (with q: G2 waits that group anyway) and k, and u = T diag(beta) V from v, loaded
# into the WY u's box and overwritten there by u; one group fewer (v where u was)
W_FROM_T_LOAD_GROUPS = (("k", "pt", "do"), ("q", "tt"), ("h",), ("uw",))
S_GROUPS = (0, 1)  # the groups the state warpgroup reads (dO; q, W)
H_GROUP = 2  # the finish warps' <dh, h>
U_GROUP = 3  # U (`u_from_h`: the WY u, U's operand)
TOKEN_TILES = ("do", "u", "q", "k", "w", "uw")  # (C, 128) 16-bit
# One stage (no double buffering: 2 x 144 KB do not fit): the next chunk's boxes are issued
# once every reader has released this one (S after its update, G after the WY half, the finish
# warps after <dh, h>). On chip beside the stage: dS (K, V) 16-bit (S -> G, the finish), dU
# (C, V) 16-bit (G -> S and G's WY half), K K^T fp32 and dPD 16-bit (S -> G); dPD^T and M^T
# live in the spent P^T box, dw in the spent q box, dk's fp32 stash over the spent dO and U
# boxes.
STAGES = 1
# the consumers releasing a stage: S and G whole, the two finish warps (one arrival a thread)
RELEASE_ARRIVALS = 2 * THREADS_PER_WG + 64

# `wg_split` (next/gdn-bwd-wgsplit; NOTES "next/gdn-bwd-wgsplit"): G's chain on two math
# warpgroups (FlashQLA's S / K / A roles): G1 (warpgroup 2) dU, dw and the WY half (dv, dbeta,
# dk), G2 (warpgroup 3) U, dPD, dq, K K^T and dk's inter-chunk half; S the state and its update
# only. 512 threads: 128 registers a thread at the launch, so the four counts sum to at most
# 4 x 128 = 512 (cu13, bf16, 2026-12-07: warpgroup 0 R0-R18, S R0-R167, G1 R0-R165, G2
# R0-R120). With `group_sum`: SPLIT_PAIR_REGS.
SPLIT_THREADS = 4 * THREADS_PER_WG
SPLIT_LAUNCH_REGS = REGISTERS_PER_SM // SPLIT_THREADS // 8 * 8  # 128
# G2's 136 (and SPLIT_PAIR_REGS' 152) is above the launch's 128: a setmaxnreg.inc, as S's and
# G1's; the .dec it was (USETMAXREG.DEALLOC 0x88 from 128) is an illegal instruction (CUDA error
# 715 on the H100, warpgroup 3's threads at that instruction; NOTES "next/ws-illegal")
SPLIT_REGS = (32, 176, 168, 136)
assert sum(SPLIT_REGS) * THREADS_PER_WG <= SPLIT_LAUNCH_REGS * SPLIT_THREADS
SPLIT_RELEASE_ARRIVALS = RELEASE_ARRIVALS + THREADS_PER_WG  # G2's release too
# With `group_sum` (next/wgsplit-groupsum): dq's exchange is G2's, dk's G1's. G2's owners hold
# their 64 sums and the peer's 64 loaded values at once (ptxas issues the 16 LDS.128 before the
# first add): at 136 it spilled (40 bytes; at 144, 16). Warpgroup 0 (R0-R19) gives 8 and G1
# (R0-R156 with the key: its exchange is at `_wy`'s end, below its peak) 8 to G2 (cu13, bf16
# grouped `u_from_h`, 2026-12-07: R0-R16, S R0-R167, G1 R0-R156, G2 R0-R144, nothing spilled).
SPLIT_PAIR_REGS = (24, 176, 160, 152)
assert sum(SPLIT_PAIR_REGS) * THREADS_PER_WG <= SPLIT_LAUNCH_REGS * SPLIT_THREADS


# `group_sum` (next/gdn-bwd-groupsum): the PAIR value heads of one q / k head (HV = 2 H) as one
# cluster of PAIR CTAs along grid x (value heads 2 h, 2 h + 1: ranks 0, 1), dq and dk summed in
# fp32 through distributed shared memory and stored once at the H head (16-bit). Each CTA owns
# the rows of two of G's four warps (a (C, K) accumulator: warp w holds rows 16 w .. 16 w + 15,
# rank r rows 32 r .. 32 r + 31); the other two warps push their rows, fp32, into the peer's
# receive buffer (st.async, 16 bytes a store, completing on the peer's mbarrier), a thread to
# the thread of the same index there (the same accumulator coordinates). Receive buffers (no
# shared memory is free: 225,280 of 232,448 bytes in use): dq's over the spent dO box (after
# S_DONE; dk's fp32 stash goes there after the rows are read), dk's over K K^T (after `_wy`'s
# masking read it; S writes the next chunk's only after the stage's release).
PAIR = 2
PAIR_THREADS = THREADS_PER_WG // PAIR  # G's threads owning this CTA's rows (two warps)
EXCHANGE_BYTES = CHUNK // PAIR * 128 * 4  # the peer's (C / 2, K) fp32 rows: 16 KB
# mbarriers after the load groups' (in `full`): per exchange (dq, dk), "the peer's buffer is
# free" (the peer's arrival, by `arrive_peer`) and "the peer's rows landed" (armed here with
# EXCHANGE_BYTES, completed by the peer's stores); one phase each a chunk
EXCHANGES = ("dq", "dk")
PAIR_BARRIERS = 2 * len(EXCHANGES)


def smem_bytes(k: int = 128, v: int = 128, elem_bytes: int = 2, group_sum: bool = False,
               w_from_t: bool = False) -> int:  # fmt: skip
    """Shared memory of one CTA (the kernel's SharedStorage, alignment padding included): the
    stage (dO, U, u (C, V); q, k, W (C, K); P^T, T^T (C, C); h (K, V)), dS (K, V) and dU (C, V)
    on chip, K K^T (C, C) fp32 and dPD (C, C) 16-bit (the state warpgroup's products for G),
    the mbarriers (`group_sum`: PAIR_BARRIERS more; `w_from_t`: one load group fewer), G (G's
    and S's) and e^G (fp32, two chunks' worth: the finish warps read one while G stages the
    next) and the dG rows (two chunks' worth); `w_from_t`: beta and beta e^G (fp32, G2's
    columns scales); 2 KB of alignment padding."""
    stage = CHUNK * (3 * v + 3 * k + 2 * CHUNK) * elem_bytes + k * v * elem_bytes
    on_chip = (k * v + CHUNK * v + CHUNK * CHUNK) * elem_bytes + CHUNK * CHUNK * 4
    groups = W_FROM_T_LOAD_GROUPS if w_from_t else LOAD_GROUPS
    bars = len(groups) + 1 + (PAIR_BARRIERS if group_sum else 0)
    head = 8 * bars + 3 * 2 * CHUNK * 4 + 2 * (2 * CHUNK + 4) * 4
    scales = 2 * CHUNK * 4 if w_from_t else 0
    return STAGES * stage + on_chip + head + scales + 2048


# Dispatch (ops/gated_delta_rule_bwd.py FUSED): one CTA per (sequence, value head) walks every
# chunk, so the grid is B x HV and the time is ~NC steps; today's path spreads its every-chunk
# kernels over NC x HV x B CTAs. The fused kernel wins only with about a wave of CTAs (the
# design note's table: 4 x 8192 hv32 = 128 CTAs, 1 x 2048 / 1 x 8192 hv32 = 32 CTAs lose).
# Three quarters of a wave: 99 CTAs on the H100's 132 SMs (4 x 8192 hv32: 128, fused; 1 x 2048
# and 1 x 8192 hv32: 32, today's path). No SM count (CPU tensors): never.
WAVE_FRACTION = (3, 4)


def fused_fits(b: int, hv: int, sms: int = NUM_SMS_H100_H200) -> bool:
    """Whether B x HV CTAs fill WAVE_FRACTION of a wave of `sms` SMs (the fused kernel's
    dispatch rule; `sms` 0, as off CUDA: False)."""
    num, den = WAVE_FRACTION
    return sms > 0 and b * hv * den >= sms * num


def slots_fit(n: int, hv: int, sms: int = NUM_SMS_H100_H200) -> bool:
    """The rule in the varlen slot layout (N sequences x HV value heads; a CUDA-graph capture
    cannot see the lengths): `fused_fits` and at most one wave. Within a wave every CTA is
    resident at once: the fused kernel takes its longest chain (~15 us a slot on the H100),
    the two-launch path kernel 1's (~5.6-7.8 us a slot) plus kernel 2's work, so at equal
    lengths the batch path's 1.21x holds (4 x 8192 hv32: 128 CTAs). Beyond a wave the time
    follows the length mix, which the rule cannot see (the suites' mixes, two sequences with
    3/4 of the tokens: modelled about even or worse; NOTES "next/fused-slots")."""
    return fused_fits(n, hv, sms) and n * hv <= sms


def params_for(
    dtype: str,
    head_dims: tuple[int, int] = (128, 128),
    *,
    d_final_state: bool = False,
    grouped: bool = False,
    u_from_h: bool = False,
    varlen: bool = False,
    group_sum: bool = False,
    wg_split: bool = False,
    w_from_t: bool = False,
) -> tuple:
    """Compile key: the 16-bit dtype of the tiles, (K, V), whether a final-state gradient is
    read (without one, dS starts from zero) and `grouped` (q, k at H < HV heads, value head hv
    reading head hv // (HV / H); in the key only when set). `u_from_h` (likewise): U not read,
    the state warpgroup forms U = u - W h (fp32, rounded once) from the WY u, W and h it loads
    anyway (kernel 1's forward launch then writes h only, its `fused` key). `varlen`
    (likewise): the varlen slot layout (ops/_linattn_varlen.py), one CTA a (value head,
    sequence) walking the slots it owns (kernel 1's varlen walk), the token outputs at their
    token rows (kernel 2's `token_rows`). The outputs are the op's device path's: dq, dk, dv in
    the tiles' dtype (dq times the runtime scale), dG, dbeta and dS at the start fp32.
    `group_sum` (likewise; needs `grouped`, HV = PAIR H at the launch; with `varlen` too: the
    pair walks one sequence's slots): dq, dk summed over each q / k head's PAIR value heads in
    fp32 inside the kernel (a cluster of PAIR CTAs, DSMEM) and written at the H heads.
    `wg_split` (likewise): 512 threads, G's chain on two math warpgroups (SPLIT_REGS; with
    `group_sum` SPLIT_PAIR_REGS), the same sums. `w_from_t` (likewise; needs `wg_split` and
    `u_from_h`): W and the WY u not read, G2 forms them from T^T, k, v, beta and G
    (`W_FROM_T_LOAD_GROUPS`)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype}")
    if tuple(head_dims) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {tuple(head_dims)}")
    if group_sum and not grouped:
        raise ValueError("group_sum needs grouped (HV = 2 H)")
    if w_from_t and not (wg_split and u_from_h):
        raise ValueError("w_from_t needs wg_split and u_from_h (G2 forms W, u, then U)")
    k, v = head_dims
    key = {"dtype": dtype, "k": k, "v": v, "d_final_state": d_final_state}
    flags = (("grouped", grouped), ("u_from_h", u_from_h), ("varlen", varlen),
             ("group_sum", group_sum), ("wg_split", wg_split),
             ("w_from_t", w_from_t))  # fmt: skip
    for name, on in flags:
        if on:
            key[name] = True
    return tuple(sorted(key.items()))
