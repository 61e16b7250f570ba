"""Attention-backward configurations: tile sizes per head-dim pair and the compile keys of the
three kernels (preprocess, main, postprocess). DSL-free, so the launcher can pick kernels
without the compiler."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY

DTYPES = ("float16", "bfloat16")
# (head_dim, head_dim_v) pairs with a default config.
HEAD_DIMS = ((64, 64), (128, 128), (192, 128))
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


def varlen_ws_row(q_off, seq):
    """First workspace row of sequence `seq` whose packed rows start at `q_off` (Python ints
    on the host, DSL integers in the kernels)."""
    return (q_off + 3) // 4 * 4 + seq * VARLEN_SEQ_PAD


def varlen_ws_rows(total_q: int, num_seqs: int) -> int:
    """Workspace rows (a multiple of 4) holding every sequence's padded region."""
    return varlen_ws_row(total_q, num_seqs)


@dataclass(frozen=True)
class BwdConfig:
    """What one compiled backward main kernel bakes in besides dtype, head dims and flags.

    Layout. tile_n keys per CTA: 128 = key split (each consumer warpgroup holds 64 keys, whole
    dK / dV rows); 64 = column split (both warpgroups see the 64 keys, S^T / dP^T split by
    query columns, dK / dV / dQ by head-dim columns, P^T and dS^T through shared memory;
    tile_m 64, dq_split and stats_early only; the varlen D = 192 layout). tile_m query rows
    per step (64 or 128), `stages` of the Q and dO rings. One fp32 dQ staging buffer.

    Knobs (static; each one's default is left out of the compile key, see `key_fields`; every
    value here is used by a standard configuration; measured with scripts/bwd_variants.py,
    figures and the knobs measured and dropped in docs/attention/BWD_NOTES.md):
    static_stage (key split; the column split's loop is always rolled): the step loop unrolled
      by the ring depth, so each step's ring stage (and every shared-memory operand
      descriptor) is a compile-time constant: 1.02-1.08x at D = 128. D = 64 and q_halves keep
      the rolled loop (unrolled they spill).
    stats_early: read the step's LSE while S^T is on the tensor cores and its Dsum before the
      dP^T wait (else after each wait, where the shared-memory latency stalls the exp2 / dS
      math: 11% of the D = 128 stall samples on those FFMAs). D = 64: 1.017, noise; off.
    dsum_early (needs stats_early): Dsum read right after the dP^T GEMM is issued (its loads
      otherwise queue behind the exp2s): 1.005-1.026 at D = 128 (varlen spills 16 bytes with
      it: off there); q_halves needs it (each half's LSE and Dsum right after its GEMMs).
    dq_split: each consumer warpgroup hands its half of the dQ staging buffer to the writer on
      its own named barriers (the warpgroups are not brought into step there), with two dS
      buffers (column split: two dS / P pairs); FA3 / FA4's sm90 arrangement: 1.045-1.078x at
      D = 128.
    ds_store_first (key split): dS^T stored to shared memory before the dV GEMM is issued, so
      the fence before the dS barrier finds the stores landed: 1.14x at D = 64 (8 stmatrix per
      thread), 0.99 at D = 128.
    p_early (key split): P^T converted to the dV GEMM's 16-bit operand right after the exp2,
      before the dP^T wait (FA4's order), with inline-PTX converts.
    dv_before_ds (key split, not q_halves / ds_store_first): dV += P^T dO issued right after
      the exp2s, before the dP^T wait (fp32 P^T kept for dS), so it runs under the dS math:
      1.001-1.016x at D = 128 (with p_early).
    q_halves (key split, tile_m 64, joint dQ hand-over, rolled loop, dsum_early): S^T / dP^T,
      dV and dK in two 32-query halves per step, dQ after both (D = 192: dK 96 + dV 64
      registers resident): 1.17x the column split.
    l2_swizzle (applies to causal fixed length only; no effect otherwise): 0 launches (key
      block, kv head, batch) with the key block fastest; k > 0 takes the (kv head, batch)
      pairs in sections of k and launches each section's CTAs with the key block slowest
      (`swizzled_block`): every section starts on its longest key blocks and the grid ends on
      short ones, while a section's Q / dO / dQ rows are shared in L2. k = 4: 1.01-1.07x.
    persistent (fixed length, not deterministic, rolled loop): one CTA per multiprocessor,
      each taking (key block, kv head, batch) tiles in the launch order from a global counter
      (`scheduler.atomic`), so a tile's K / V load and first Q / dO stages overlap the
      previous tile's last steps and its dK / dV stores: 1.032-1.040x at D = 64 (0.96-1.00 at
      D = 128). The launcher passes the CTA count and a zeroed counter (mSem[0, 0, 0]).
    head_split (0 or 2; D = 128 GQA, fixed length, not deterministic / persistent): one CTA
      per (key block, query head, batch), the grid's heads interleaved over the kv heads (so
      CTAs launched together add into different dK / dV tiles); dK / dV added in fp32 with
      `red.global.add`: 1.07-1.36x for GQA problems under two waves of kv tiles.
    walk_order (0 or 2; 0 when deterministic): a CTA's steps over its query heads and query
      blocks. 0: head by head, query blocks ascending; 2: head by head, query blocks
      descending (long causal GQA: 1.024-1.034x with l2_swizzle 8).
    exp_groups (g > 0): the exp2s in g column groups, each group's scale taken as
      scale + 0 x the previous group's first exp2 (one FFMA per group), so that the assembler
      starts the MUFUs after the first group's FFMAs instead of after all of them: g = 8 at
      D = 128 1.008-1.015x."""

    tile_m: int = 64
    tile_n: int = 128
    stages: int = 2
    static_stage: bool = True
    stats_early: bool = True
    dq_split: bool = False
    ds_store_first: bool = False
    p_early: bool = False
    q_halves: bool = False
    l2_swizzle: int = 0
    dsum_early: bool = False
    persistent: bool = False
    head_split: int = 0
    dv_before_ds: bool = False
    walk_order: int = 0
    exp_groups: int = 0

    def tag(self) -> str:
        t = f"{self.tile_m}x{self.tile_n}_s{self.stages}"
        t += "" if self.stats_early else "_statslate"
        t += "_dqsplit" if self.dq_split else ""
        t += "_dsfirst" if self.ds_store_first else ""
        t += "_pearly" if self.p_early else ""
        t += "_qhalves" if self.q_halves else ""
        t += f"_sw{self.l2_swizzle}" if self.l2_swizzle else ""
        t += "_dsumearly" if self.dsum_early else ""
        t += "_persist" if self.persistent else ""
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


_TILE_FIELDS = ("tile_m", "tile_n", "stages")


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
    dq = tm * head_dim * 4  # the dQ staging buffer
    stats = 2 * cfg.stages * tm * 4  # LSE and Dsum rings
    return q + kv + ds + dq + stats + 1024  # + barriers and alignment


def check_fits(cfg: BwdConfig, head_dim: int, head_dim_v: int) -> None:
    """ValueError unless one CTA's shared memory fits the per-block opt-in maximum."""
    need = smem_bytes(cfg, head_dim, head_dim_v)
    if need > SMEM_CAPACITY:
        raise ValueError(f"{cfg} needs {need} B of shared memory, > {SMEM_CAPACITY}")


# Registers bound the tiles (dK and dV accumulators of 64 keys per warpgroup stay resident):
# D = 128: 64 query rows per step (S^T and dP^T 64 x 64 per warpgroup); D = 64: 128.
_DEFAULTS = {
    # 128 query rows per step, the rolled step loop (unrolled by the ring it spills), dQ
    # first with the per-warpgroup hand-over and the dS stores before the dV GEMM (1.20x the
    # joint hand-over with dK first); persistent 1.032x (spills at 192/128, 0.96-1.00 at
    # D = 128); exp_groups 16 (four exp2s per group as D = 128's 8: the first MUFU after 4
    # FFMAs instead of ~45).
    (64, 64): BwdConfig(
        tile_m=128,
        tile_n=128,
        stages=2,
        static_stage=False,
        stats_early=False,
        dq_split=True,
        ds_store_first=True,
        l2_swizzle=4,
        persistent=True,
        exp_groups=16,
    ),
    # l2_swizzle 4: MHA 1.01-1.02x, GQA 1.02-1.07x. exp_groups 8: 1.008-1.015x (4 groups
    # 0.993-1.003). dv_before_ds with p_early: 1.001-1.016x against neither.
    (128, 128): BwdConfig(
        tile_m=64,
        tile_n=128,
        stages=2,
        dq_split=True,
        l2_swizzle=4,
        dsum_early=True,
        dv_before_ds=True,
        p_early=True,
        exp_groups=8,
    ),
    # Key split in 32-query halves (q_halves): dK 96 + dV 64 fp32 registers resident per
    # consumer thread, S^T / dP^T 16 + 16 per half, dQ 48 after both halves; two Q / dO
    # stages, one dS buffer, joint dQ hand-over: 226 KiB; 1.17x the column split (still
    # _VARLEN_192). The key split without halves spills and serializes the WGMMAs.
    # l2_swizzle 4: 1.025x (2: 1.010x).
    (192, 128): BwdConfig(
        tile_m=64,
        tile_n=128,
        stages=2,
        static_stage=False,
        q_halves=True,
        dsum_early=True,
        l2_swizzle=4,
    ),
}
_DETERMINISTIC_VARLEN_128 = BwdConfig(tile_m=64, tile_n=128, stages=3)
# the column split (64 keys, dK / dV split by head-dim columns); static_stage left at its
# default (no effect in the column split) so the kernel keeps its compile key
_VARLEN_192 = BwdConfig(tile_m=64, tile_n=64, stages=2, dq_split=True)


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
        # the key-block-fastest order: the swizzled one lengthens the GQA dQ chain (1.40x ->
        # 1.67x the non-deterministic time at hq32 / hkv4)
        cfg = replace(cfg, l2_swizzle=0)
    return cfg


# head_split for GQA at D = 128 when the kv tiles fill fewer than two waves (the head-group
# walk leaves multiprocessors idle there): 1.07-1.36x; at s4096 / s8192 0.94-0.97x (the fp32
# dK / dV additions cost more than the locality wins).
HEAD_SPLIT_WAVES = 2
# ... and for causal GQA of at least HEAD_SPLIT_GROUP query heads a kv head up to
# HEAD_SPLIT_SEQLEN_K keys, whatever the waves: measured 2026-12-03 21:50 (graph / eager, time
# of the split over the walk) 0.887 / 0.893 at b8-hq32-hkv2-s4096, 0.934 / 0.926 at
# b16-hq32-hkv2-s2048, 0.990 / 0.993 at b4-hq32-hkv2-s8192 (kept on the walk). The walk's dQ
# tiles miss the L2 and its coarse CTAs leave a tail there (BWD_NOTES.md "GQA 16 at 4096").
HEAD_SPLIT_GROUP = 16
HEAD_SPLIT_SEQLEN_K = 4096
# Causal GQA with long keys: each head's query blocks descending (walk_order 2) with
# l2_swizzle 8 (sections of eight (kv head, batch) pairs): 1.024-1.034x the ascending walk
# with swizzle 2 at hq64 / hkv8 s16384. Shorter GQA keeps the ascending walk with swizzle 4
# (the same order 0.96-1.01 there). BWD_NOTES.md "GQA walk order".
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
    head_split (interleaved) when the kv tiles fill less than HEAD_SPLIT_WAVES waves or (causal)
    a kv head has HEAD_SPLIT_GROUP query heads or more and at most HEAD_SPLIT_SEQLEN_K keys,
    else (causal, from LONG_GQA_SEQLEN_K keys on) walk_order LONG_GQA_WALK with l2_swizzle
    LONG_GQA_SWIZZLE."""
    cfg = default_config(head_dim, head_dim_v, deterministic)
    if deterministic or hq == hkv or (head_dim, head_dim_v) != (128, 128):
        return cfg
    kv_tiles = -(-seqlen_k // cfg.tile_n) * hkv * batch
    wide_short = causal and hq >= HEAD_SPLIT_GROUP * hkv and seqlen_k <= HEAD_SPLIT_SEQLEN_K
    if kv_tiles < HEAD_SPLIT_WAVES * num_sms or wide_short:
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
