"""Attention-backward configurations: tile sizes per head-dim pair and the compile keys of the
three kernels (preprocess, main, postprocess). DSL-free, so the launcher can pick kernels
without the compiler."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

DTYPES = ("float16", "bfloat16")
# (head_dim, head_dim_v) pairs with a default config.
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))
# (192, 128) uses the column-split layout (tile_n = 64, both consumer warpgroups share the keys
# and split dK / dV by head-dim columns): with the key-split layout its accumulators (dK 96 +
# dV 64 + S^T 32 + dP^T 32 per thread) do not fit, ptxas serializes the WGMMAs and spills
# (`_EXPERIMENTAL`, see BWD_NOTES.md).
SMEM_CAPACITY = 232448  # sm_90 per-block opt-in maximum (227 KiB)
# Query rows of the fp32 workspaces (LSE in log2 units, Dsum, dQ accumulator) are padded to a
# multiple of this, so that the main kernel's loads never leave the workspace.
ROW_PAD = 128
NUM_MMA_WG = 2
# Varlen: the fp32 workspaces are (Hq, rows) over all sequences; sequence b's rows start at
# `varlen_ws_row(cu_seqlens_q[b], b)` (a multiple of 4: 16-byte aligned bulk copies) and it owns
# at least ceil(Sq_b / ROW_PAD) * ROW_PAD rows before the next sequence's start:
# ceil4(cu[b + 1]) + (b + 1) * VARLEN_SEQ_PAD - ceil4(cu[b]) - b * VARLEN_SEQ_PAD
# >= Sq_b - 3 + ROW_PAD + 4 > Sq_b + ROW_PAD - 1.
VARLEN_SEQ_PAD = ROW_PAD + 4


def varlen_ws_row(q_off: int, seq: int) -> int:
    """First workspace row of sequence `seq` whose packed rows start at `q_off` (the kernels
    compute the same with DSL integers)."""
    return (q_off + 3) // 4 * 4 + seq * VARLEN_SEQ_PAD


def varlen_ws_rows(total_q: int, num_seqs: int) -> int:
    """Workspace rows (a multiple of 4) holding every sequence's padded region."""
    return varlen_ws_row(total_q, num_seqs)


@dataclass(frozen=True)
class BwdConfig:
    """What one compiled backward main kernel bakes in besides dtype, head dims and flags.

    tile_n keys per CTA: 128 = key split (the two consumer warpgroups hold 64 keys each, whole
    dK / dV rows); 64 = column split (both warpgroups see the 64 keys, S^T / dP^T split by
    query columns, dK / dV / dQ by head-dim columns, P^T and dS^T through shared memory;
    tile_m 64 only; the D = 192 layout),
    tile_m query rows per step, stages of the Q and dO rings, dq_stages fp32 dQ staging
    buffers in shared memory (the reduction into global memory drains one while the other
    fills).

    Performance knobs (static; their defaults are the kernel's standard behaviour and are left
    out of the compile key, see `main_params`; measured by scripts/bwd_variants.py):
    early_dv: -1 automatic (on iff tile_m = 128), 0 off, 1 on. On: P^T is rounded to the
      input dtype right after the exp2 and dV += P^T dO is issued before the dP^T wait, so the
      dV WGMMA runs under the dS math (which then reads the rounded P).
    consumer_regs / producer_regs: setmaxnreg of the consumer warpgroups / the producer and
      dQ-writer warpgroup (consumer_regs * 256 + producer_regs * 128 <= 64 K).
    dq_first: issue dQ = dS K before dK += dS^T Q and stage the dQ tile while dK runs (else
      dK is issued first and both are waited for before the staging; the layout before
      2026-11-30). Column split (with dq_split): dQ before dV and dK, staged under both.
    kb_slowest: launch order with the key block slowest (all first key blocks, the longest
      under causal, before any second one) instead of fastest.
    static_stage (key split): the step loop unrolled by the ring depth, so each step's ring
      stage (and with it every shared-memory operand descriptor) is a compile-time constant.
    stats_early: read the step's LSE while S^T is still on the tensor cores and its Dsum
      before the dP^T wait (else after each wait, where the shared-memory latency stalls the
      exp2 / dS math: ncu 2026-11-30, 11% of the kernel's stall samples on those FFMAs).
    dq_split (key split: with dq_first): each consumer warpgroup hands its half of the dQ
      staging buffer to the writer on its own named barriers (the warpgroups are not brought
      into step there), with two dS buffers (column split: two dS / P pairs); FA3 / FA4's
      sm90 arrangement.
    ds_store_first (key split, without early_dv): dS^T is stored to shared memory before the
      dV GEMM is issued, so the fence before the dS barrier finds the stores landed (ncu
      2026-11-30: ~4% of stall samples on that fence).
    p_early (key split, without early_dv): P^T converted to the dV GEMM's 16-bit operand
      right after the exp2, before the dP^T wait (FA4's order), with inline-PTX converts.
    q_halves (key split, tile_m 64, joint dQ hand-over, rolled loop): S^T / dP^T, dV and dK
      in two 32-query halves per step, dQ after both (the D = 192 key split: dK 96 + dV 64
      registers resident).
    l2_swizzle (causal, fixed length): 0 launches (key block, kv head, batch) with the key
      block fastest; k > 0 takes the (kv head, batch) pairs in sections of k and launches each
      section's CTAs with the key block slowest (`swizzled_block`): every section starts on
      its longest key blocks and the grid ends on short ones, so no long CTA is left running
      alone at the end (a GQA CTA walks its whole query-head group: up to 2048 steps), while
      a section's Q / dO / dQ rows are shared in L2.
      (Measured and dropped, 2026-11-30 13:02 UTC: the steps query block by query block over
      the group's heads, 0.77-0.98x for GQA; k from the L2 size, no better than k = 4.)
    dsum_early (with stats_early, key split): Dsum read right after the dP^T GEMM is issued
      (with LSE, before any wait) instead of after the exp2s (q_halves: each half's LSE and
      Dsum right after its GEMMs are issued).
    persistent (fixed length, not deterministic): one CTA per multiprocessor, each taking
      (key block, kv head, batch) tiles in the launch order from a counter (the first from
      its CTA index), so a tile's K / V load and first Q / dO stages overlap the previous
      tile's last steps and its dK / dV (stored from registers) instead of a CTA exit and
      launch per tile. The launcher passes the CTA count and a zeroed counter (mSem[0, 0, 0]).
    exp_groups (key split): g > 0 computes the exp2s in g column groups, each group's scale
      taken as scale + 0 x the previous group's first exp2 (one FFMA per group), so that the
      assembler starts the MUFUs after the first group's FFMAs instead of after all 32 (the
      MUFU queue of the two warpgroups then starts ~30 issue slots earlier).
    walk_order (not deterministic): the order of a CTA's steps over its query blocks and (GQA)
      its query heads. 0: head by head, query blocks ascending; 1: query blocks descending,
      the heads inner (every CTA of a kv head that started together is on the same (head,
      query block) at the same time: its Q / dO rows are read, and its dQ tile added, by all
      of them while in L2); 2: head by head, query blocks descending.
    dkv_direct (fixed length): dK / dV stored from registers (4-byte stores) instead of
      stmatrix into the K / V buffers and two TMA stores (persistent: K / V then released
      right after the last step's GEMMs, not after the stores have read them).
    (Measured and dropped, BWD_NOTES.md: s_ahead, the next step's S^T issued by the step
    before, 0.95-1.00; dq_claim, no zeroed dQ workspace, the first key block to reach a
    query block storing its tile, 0.96-1.01; exp_emu, part of the exp2s from a polynomial on
    the FMA pipes instead of the MUFU, 0.93-0.98.)"""

    tile_m: int = 64
    tile_n: int = 128
    stages: int = 2
    dq_stages: int = 2
    early_dv: int = -1
    consumer_regs: int = 240
    producer_regs: int = 24
    dq_first: bool = True
    kb_slowest: bool = False
    static_stage: bool = True
    stats_early: bool = True
    dq_split: bool = False
    ds_store_first: bool = False
    p_early: bool = False
    q_halves: bool = False
    l2_swizzle: int = 0
    dsum_early: bool = False
    persistent: bool = False
    dkv_direct: bool = False
    head_split: int = 0
    dv_before_ds: bool = False
    walk_order: int = 0
    exp_groups: int = 0

    def tag(self) -> str:
        t = f"{self.tile_m}x{self.tile_n}_s{self.stages}_dq{self.dq_stages}"
        if self.early_dv >= 0:
            t += f"_edv{self.early_dv}"
        if (self.consumer_regs, self.producer_regs) != (240, 24):
            t += f"_r{self.consumer_regs}-{self.producer_regs}"
        t += "" if self.dq_first else "_dqlast"
        t += "_kbs" if self.kb_slowest else ""
        t += "" if self.stats_early else "_statslate"
        t += "_dqsplit" if self.dq_split else ""
        t += "_dsfirst" if self.ds_store_first else ""
        t += "_pearly" if self.p_early else ""
        t += "_qhalves" if self.q_halves else ""
        t += f"_sw{self.l2_swizzle}" if self.l2_swizzle else ""
        t += "_dsumearly" if self.dsum_early else ""
        t += "_persist" if self.persistent else ""
        t += "_dkvdirect" if self.dkv_direct else ""
        t += f"_hsplit{self.head_split}" if self.head_split else ""
        t += "_dvbeforeds" if self.dv_before_ds else ""
        t += f"_walk{self.walk_order}" if self.walk_order else ""
        t += f"_expg{self.exp_groups}" if self.exp_groups else ""
        return t + ("" if self.static_stage else "_dynstage")

    @classmethod
    def from_params(cls, params: dict) -> BwdConfig:
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})

    def key_fields(self) -> dict:
        """The compile-key fields: the tiles always, a knob only when it is not its default
        (so the standard kernels keep their keys)."""
        out = {}
        for f in fields(self):
            v = getattr(self, f.name)
            if f.name in _TILE_FIELDS or v != f.default:
                out[f.name] = v
        return out


_TILE_FIELDS = ("tile_m", "tile_n", "stages", "dq_stages")


def swizzled_block(idx, num_n, pairs, sw, minimum=min):
    """(key block, pair) of CTA `idx` in the l2_swizzle order over num_n key blocks and `pairs`
    (kv head, batch) pairs (pair = batch * Hkv + head): sections of `sw` pairs one after
    another, each section key block by key block over its pairs. Within a pair the key blocks
    come in ascending order (deterministic causal reverses them: a CTA then waits only for
    higher key blocks, dispatched before it). `minimum`: the kernel passes the DSL's."""
    sw = minimum(sw, pairs)
    first = idx // (sw * num_n) * sw
    r = idx - first * num_n
    width = minimum(sw, pairs - first)
    n = r // width
    return n, first + r - n * width


def smem_bytes(cfg: BwdConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory of one main-kernel CTA."""
    tm, tn = cfg.tile_m, cfg.tile_n
    q = cfg.stages * tm * (head_dim + head_dim_v) * elem_bytes  # Q and dO rings
    kv = tn * (head_dim + head_dim_v) * elem_bytes  # K, V (reused for dK, dV)
    # column split: dS and P; dq_split: two of them
    ds = tm * tn * elem_bytes * (2 if tn == 64 else 1) * (2 if cfg.dq_split else 1)
    dq = cfg.dq_stages * tm * head_dim * 4
    stats = 2 * cfg.stages * tm * 4  # LSE and Dsum rings
    return q + kv + ds + dq + stats + 1024  # + barriers and alignment


# Registers bound the tiles (dK and dV accumulators of 64 keys per warpgroup stay resident):
# D=128: 64 query rows per step (S^T and dP^T 64x64 per warpgroup); D=64: 128 query rows.
# Measured on the H200 (scripts/bwd_variants.py, 2026-11-30, bf16 causal s8192): D=64 without
# the early dV GEMM 423.6 against 376.0 TFLOP/s; D=128 with a 3-deep Q/dO ring and one dQ
# staging buffer 496.0 against 486.0 (GQA 64:8; MHA 32 heads: 517.3 against 519.2, noise).
_DEFAULTS = {
    # D=64: 128 query rows per step, the rolled step loop (unrolled by the ring it spilled),
    # dQ first with the per-warpgroup hand-over and the dS stores before the dV GEMM (H200
    # 2026-11-30 11:23 UTC: 1.20x the previous default, dK before dQ with the joint hand-over).
    # Persistent (H200 2026-11-30 16:23 UTC, bf16 causal b2 hq32 s8192: 1.032x; at D = 128
    # 0.983-0.995x, not taken there; 192/128 spills with it).
    # exp_groups 16 (four exp2s per group, as the D = 128 default's 8; the first MUFU after 4
    # FFMAs instead of ~45): H200 2026-11-30, see BWD_NOTES.md "exp_groups".
    (64, 64): BwdConfig(
        tile_m=128,
        tile_n=128,
        stages=2,
        dq_stages=1,
        early_dv=0,
        static_stage=False,
        stats_early=False,
        dq_split=True,
        ds_store_first=True,
        l2_swizzle=4,
        persistent=True,
        exp_groups=16,
    ),
    # l2_swizzle 4 (H200 2026-11-30 12:57 / 13:02 UTC, bf16 causal): MHA 1.01-1.02x, GQA
    # 1.02-1.07x, D=64 1.03x; 192/128 0.98x then (see below).
    # exp_groups 8 (H200 2026-11-30 20:18 UTC, bf16 causal, three runs each against the
    # ungrouped exp2s: b4 hq32 s8192 1.011 / 1.012 / 1.012, hq16 1.008 / 1.010 / 1.015, b8
    # s4096 1.008 / 1.013 / 1.012; 4 groups 0.993-1.003; the same kernel timed last
    # 0.991-1.003).
    # dv_before_ds with p_early (H200 2026-11-30 18:55 / 19:04 UTC, bf16 causal, against
    # neither: b8 s4096 1.008 / 1.001x, b4 s8192 1.005 / 1.013x, s16384 0.998 / 1.010x, GQA
    # s8192 1.016 / 1.015x, hq16 1.005 / 1.009x).
    (128, 128): BwdConfig(
        tile_m=64,
        tile_n=128,
        stages=2,
        dq_stages=1,
        dq_split=True,
        l2_swizzle=4,
        dsum_early=True,
        dv_before_ds=True,
        p_early=True,
        exp_groups=8,
    ),
    # Key split in 32-query halves (q_halves, BWD_NOTES.md): dK 96 + dV 64 fp32 registers
    # resident per consumer thread, S^T / dP^T 16 + 16 per half, dQ 48 after both halves; two
    # Q / dO stages, one dS buffer, one dQ staging buffer (joint hand-over): 226 KiB. H200
    # 2026-11-30 12:08 UTC: 1.17x the column split (_VARLEN_192, still used for varlen).
    # l2_swizzle 4 since 2026-11-30 17:12 UTC (H200, b2 hq128 s8192 causal: 1.025x, 2: 1.010x).
    (192, 128): BwdConfig(
        tile_m=64,
        tile_n=128,
        stages=2,
        dq_stages=1,
        static_stage=False,
        q_halves=True,
        dsum_early=True,
        l2_swizzle=4,
    ),
}
_EXPERIMENTAL = {
    # D=192/Dv=128 with the key-split layout: one dQ staging buffer (48 KiB) to fit 226 KiB.
    # Spills and serializes the WGMMAs (see BWD_NOTES.md); kept as a variant for comparison.
    (192, 128): BwdConfig(tile_m=64, tile_n=128, stages=2, dq_stages=1),
}


_DETERMINISTIC_VARLEN_128 = BwdConfig(tile_m=64, tile_n=128, stages=3, dq_stages=1)
# the column split (64 keys, dK / dV split by head-dim columns)
_VARLEN_192 = BwdConfig(tile_m=64, tile_n=64, stages=2, dq_stages=1, dq_split=True, dq_first=False)


def default_config(
    head_dim: int, head_dim_v: int, deterministic: bool = False, varlen: bool = False
) -> BwdConfig:
    try:
        cfg = _DEFAULTS[(head_dim, head_dim_v)]
    except KeyError:
        raise ValueError(
            f"attention backward: head dims (D={head_dim}, Dv={head_dim_v}) unsupported on "
            f"sm90; supported: {HEAD_DIMS}"
        ) from None
    if varlen and (head_dim, head_dim_v) == (192, 128):
        # q_halves spills 40 bytes with the varlen scalars (causal); the column split does not
        cfg = _VARLEN_192
    elif deterministic and varlen and (head_dim, head_dim_v) == (128, 128):
        # dq_split spills 24 bytes there (non-causal); the joint hand-over does not
        cfg = _DETERMINISTIC_VARLEN_128
    elif varlen and (head_dim, head_dim_v) == (128, 128):
        # dsum_early spills 16 bytes with the varlen scalars (causal)
        cfg = replace(cfg, dsum_early=False)
    if (deterministic or varlen) and cfg.persistent:
        # deterministic: a CTA may wait for a tile not yet taken; varlen: per-sequence grid
        cfg = replace(cfg, persistent=False)
    if deterministic and cfg.l2_swizzle:
        # the key-block-fastest order: the swizzled one lengthens the GQA dQ chain (H200
        # 2026-11-30: 1.40x -> 1.67x the non-deterministic time at hq32 / hkv4)
        cfg = replace(cfg, l2_swizzle=0)
    return cfg


# head_split for GQA at D = 128 (H200 2026-11-30 16:45 / 16:50 UTC, bf16, against the
# head-group walk): small problems (fewer kv tiles than two waves: the walk leaves SMs idle)
# 1.07-1.36x; s8192 0.96-0.97x, s4096 0.94x (the fp32 dK / dV additions cost more than the
# locality wins there).
HEAD_SPLIT_WAVES = 2
# Causal GQA with long keys: each head's query blocks descending (walk_order 2) with
# l2_swizzle 8 (sections of eight (kv head, batch) pairs). hq64 / hkv8 s16384 on the H200
# (2026-11-30, bwd_variants, bf16): against the walk with swizzle 2 (the rule until 19:56 UTC)
# 1.009 / 1.034 (19:48), 1.034 / 1.024 (20:06, also with each sample after its own replay);
# bench 19:56 UTC 0.981 of FA4 (0.959 at 19:04). Shorter GQA keeps the ascending walk with
# swizzle 4: the same order measured 0.96-1.01 of it there (hq32 / hkv4 0.96-0.99), and the
# harness moves an identical kernel by up to 5% with its position in the rotation (20:06).
# BWD_NOTES.md "GQA walk order".
LONG_GQA_SEQLEN_K = 16384
LONG_GQA_WALK = 2
LONG_GQA_SWIZZLE = 8


def choose_config(
    head_dim: int,
    head_dim_v: int,
    deterministic: bool,
    batch: int,
    seqlen_k: int,
    hq: int,
    hkv: int,
    num_sms: int,
    causal: bool = True,
) -> BwdConfig:
    """The fixed-length main kernel's config for a problem: default_config; for D = 128 GQA
    head_split (interleaved) when the kv tiles fill less than HEAD_SPLIT_WAVES waves, else
    (causal, from LONG_GQA_SEQLEN_K keys on) walk_order LONG_GQA_WALK with l2_swizzle
    LONG_GQA_SWIZZLE."""
    cfg = default_config(head_dim, head_dim_v, deterministic)
    if deterministic or hq == hkv or (head_dim, head_dim_v) != (128, 128):
        return cfg
    kv_tiles = -(-seqlen_k // cfg.tile_n) * hkv * batch
    if kv_tiles < HEAD_SPLIT_WAVES * num_sms:
        cfg = replace(cfg, head_split=2)
    elif causal and seqlen_k >= LONG_GQA_SEQLEN_K:
        cfg = replace(cfg, walk_order=LONG_GQA_WALK, l2_swizzle=LONG_GQA_SWIZZLE)
    return cfg


def _key(**kw) -> tuple:
    return tuple(sorted(kw.items()))


def main_params(
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    deterministic: bool,
    cfg: BwdConfig | None = None,
    varlen: bool = False,
) -> tuple:
    cfg = cfg or default_config(head_dim, head_dim_v, deterministic, varlen)
    return _key(
        dtype=dtype,
        head_dim=head_dim,
        head_dim_v=head_dim_v,
        causal=bool(causal),
        deterministic=bool(deterministic),
        **cfg.key_fields(),
        **_varlen_field(varlen),
    )


def _varlen_field(varlen: bool) -> dict:
    # Left out of the key when False, so the fixed-length kernels keep their keys.
    return {"varlen": True} if varlen else {}


def pre_params(dtype: str, head_dim_v: int, varlen: bool = False) -> tuple:
    return _key(dtype=dtype, head_dim_v=head_dim_v, **_varlen_field(varlen))


def post_params(
    dtype: str, head_dim: int, tile_m: int, varlen: bool = False, dq_split: bool = False
) -> tuple:
    """dq_split: the main kernel's dQ workspace order (utils.dq_frag_offset `halves`); in the
    key only when set."""
    split = {"dq_split": True} if dq_split else {}
    return _key(dtype=dtype, head_dim=head_dim, tile_m=tile_m, **_varlen_field(varlen), **split)
