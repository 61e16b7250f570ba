"""DeepSeek MLA paged decode configurations (DSL-free): the compiled variants and the split-KV
plan (the paged GQA leaf's `split_plan`, with one resident CTA per SM).

The latent cache row of a token is [c (D_LATENT) ; r (D_ROPE)]: the key is all 576 columns, the
value the first 512 (MQA with one KV head shared by every query head). A CTA takes `heads`
query heads x `qtokens` query tokens (rows <= ROWS of the WGMMA) of one sequence and one split of
its keys; shared memory holds the query rows (64 x 576 x 2 bytes), STAGES tiles of TILE latent
rows (2 x 64 x 576 x 2 bytes) and P (64 x 64 x 2): 224 KB with 16-bit caches, so one CTA fits an
SM (RESIDENT).

DeepSeek sparse attention (DSA, issue 22) runs the same partial pass in its `sparse` mode: a
CTA's keys are one split of a query token's top-k list (kind "sparse": one token per CTA,
`heads` query heads), merged by the same combine.

FP8 caches (`fp8` compile keys, bf16 queries only): FlashMLA's packed rows of FP8_ROW_BYTES per
token, [0, 512) the latent in e4m3, [512, 528) four fp32 scales (one per FP8_SCALE_COLUMNS latent
columns, powers of two), [528, 656) the RoPE columns in bf16 (fp8.py has the dequantization)."""

from __future__ import annotations

# the split plan is the paged leaf's (re-exported for the launcher and the tests)
from forgekernel.kernels.attention.paged.sm90.config import (  # noqa: F401
    MIN_TOKENS_PER_SPLIT,
    split_plan,
)

DTYPES = ("float16", "bfloat16")
HEADS = (1, 2, 4, 8, 16, 32, 64)  # query heads per CTA (a divisor of Hq)
QTOKENS = (1, 2, 4)  # query tokens per sequence (decode; speculative decoding / MTP)
ROWS = 64  # (query token, head) rows of one CTA: the WGMMA's M
WARPGROUPS = 2  # side by side: S along the keys, P V along the output columns
THREADS = 128 * WARPGROUPS
TILE = 64  # keys per pipeline stage
STAGES = 2
# The seesaw pass's split plan: a split's fixed cost in tiles' time (Q's load and the first
# scores before the pipeline fills, the partial's write and its share of the combine)
SPLIT_OVERHEAD_TILES = 2
RESIDENT = 1  # CTAs per SM
D_LATENT = 512  # kv_lora_rank: the value and the first key columns
D_ROPE = 64  # qk_rope_head_dim: the key's last columns
# FlashMLA's FP8 cache row: e4m3 latent, fp32 scales, bf16 RoPE
FP8_SCALE_COLUMNS = 128  # latent columns per scale
FP8_ROW_BYTES = D_LATENT + 4 * (D_LATENT // FP8_SCALE_COLUMNS) + 2 * D_ROPE  # 656
FP8_CHUNK = 16  # e4m3 bytes per global load
E4M3_TO_BF16_EXPONENT = 120  # bf16's exponent bias 127 less e4m3's 7
FP8_DTYPE = "bfloat16"  # an FP8 cache's queries (e4m3 x a power-of-two scale is exact in bf16)
SPARSE_HQ = (16, 128)  # DeepSeek-V3.2's query heads per GPU at TP8 and TP1 (the prebuilt DSA)
# The fused DSA prefill's prebuilt head blocks (heads_per_cta of 16, 64 and 128 heads)
FUSED_HEADS = (16, 64)
# The direct form (compile key `direct`): a plan of one split writes O in q's dtype and the
# natural LSE itself, no partials and no combine. The paged passes' (seesaw.py; decode.py's over
# pages of partial tiles and FP8 caches) prebuilt for the head blocks of DeepSeek's 128 heads
# sharded over TP 8 / 4 / 2 / 1 (`direct_blocks`), DSA's sparse pass for its prebuilt blocks
# (`sparse_heads`); any other head block keeps the partial pass and the combine rather than
# compile at call time.
DIRECT_HQ = (16, 32, 64, 128)
# The seesaw pass's pair form (compile key `pair`, candidate behind FORGEKERNEL_MLA_PAIR): the
# head blocks of a unit as clusters of 2, each CTA loading half of every K box's rows by TMA
# multicast into both (MLA_NOTES.md, "The 128-head floor"). Prebuilt for DeepSeek's 128 heads at
# TP1 (64 x 1; 32 x 2 with MTP 2, four blocks, two pairs), partial and direct.
PAIR_BLOCKS = ((64, 1), (32, 2))


def runs_pair(hq: int, heads: int, qtokens: int, tma: bool) -> bool:
    """Whether a seesaw plan can take the pair form: a prebuilt pair block and an even number
    of head blocks (a cluster is two adjacent CTAs of one unit)."""
    return tma and (heads, qtokens) in PAIR_BLOCKS and (hq // heads) % 2 == 0


# The direct form's O through shared memory and bulk copies (compile key `ostore`, MLA_NOTES.md
# "The direct form's O store"): the 128-head blocks, whose 128 scalar stores a thread were the
# epilogue's cost (64 rows of O a CTA); their direct plans' default where out's rows are 16-byte
# aligned (0.888-0.948x the scalar stores' time, H200 2026-12-03 14:25: "ostore adopted"). And
# the 16-head block of the suite's one-split plans (b128 / b256 x 16 heads): with the rows sent
# by bulk copies its steady pair loops are the partial form's, 1013 / 830 instructions with 4
# R2UR each against the scalar stores' 1136 / 962 with 97 / 71 (cu13 ptxas; MLA_NOTES.md
# "next/mla-ur", not yet timed). The other direct blocks keep the scalar stores.
OSTORE_BLOCKS = ((16, 1), (64, 1), (32, 2))


def runs_ostore(heads: int, qtokens: int) -> bool:
    """Whether a direct plan's block is prebuilt in the `ostore` form."""
    return (heads, qtokens) in OSTORE_BLOCKS


# DSA's sparse pass over an FP8 cache in its `lean` form (compile key `lean`; decode.py: the
# tile's issue first after the stage's release, per-thread L2 line prefetches behind it): the
# default on the plans measured (H100 2026-12-05 16:44, lean / the form before: t64-h16 0.809
# (16 heads, 2 splits: the partial pass), t128-h16 0.783 (16, direct), t64-h128 0.866 (64,
# direct), the t1 control 1.001 (16, 32 splits); MLA_NOTES.md "lean and lean_wide adopted"),
# with or without a sink (a factor in the epilogue: the loop is the same). At 16 heads a CTA
# split and one-split plans (LEAN_SPLIT_HEADS); at 64 one-split (direct) plans only
# (LEAN_DIRECT_HEADS: no 64-head split plan was timed). The blocks of 1-8 heads keep the form
# before until a case measures them.
LEAN_SPLIT_HEADS = (16,)
LEAN_DIRECT_HEADS = (16, 64)
# With it, the sparse FP8 direct pass's `wide` form (O staged over the K stages, 16-byte stores)
# at 64 heads a CTA: lean_wide / the form before 0.776 at t64-h128 (wide alone 0.901); at 16
# heads a tie (wide 0.991, lean_wide 0.775 against lean's 0.783), so the scalar stores stay there
WIDE_HEADS = (64,)


def takes_lean(heads: int, direct: bool) -> bool:
    """Whether DSA's sparse pass over an FP8 cache with `heads` heads a CTA takes the `lean`
    compile by default: a one-split plan's direct pass (`direct`) at LEAN_DIRECT_HEADS, a split
    plan's partial pass at LEAN_SPLIT_HEADS (the plans measured)."""
    return heads in (LEAN_DIRECT_HEADS if direct else LEAN_SPLIT_HEADS)


def takes_wide(heads: int) -> bool:
    """Whether the lean sparse FP8 direct pass with `heads` heads a CTA takes the `wide` compile
    by default (out's rows 16-byte aligned: the launcher checks; WIDE_HEADS)."""
    return heads in WIDE_HEADS


def tile_split_plan(
    batch: int,
    head_blocks: int,
    max_tokens: int,
    num_sms: int,
    resident: int,
    least: int = MIN_TOKENS_PER_SPLIT,
) -> tuple[int, int]:
    """(splits, tokens per split) in whole TILE-key tiles (the seesaw pass loads 64-row TMA
    boxes of one page: a split starts on a tile boundary): the tiles per split minimizing the
    makespan waves x (tiles + SPLIT_OVERHEAD_TILES) over units of batch x head_blocks CTAs each
    ceil(tiles / per) splits, waves of num_sms x resident CTAs; ties to fewer splits. At least
    `least` keys a split (default MIN_TOKENS_PER_SPLIT, the paged leaf's bound) unless the
    sequence is shorter. (The paged leaf's plan rounded up to tiles loses CTAs: b1 x 65536 keys
    ran 114 CTAs of 9 tiles where 128 of 8 fit one wave.)"""
    units = max(1, batch * head_blocks)
    tiles = max(1, -(-max_tokens // TILE))
    slots = num_sms * resident
    fewest = min(tiles, max(1, least // TILE))

    def cost(per: int) -> tuple[int, int]:
        splits = -(-tiles // per)
        return -(-units * splits // slots) * (per + SPLIT_OVERHEAD_TILES), splits

    per = min(range(fewest, tiles + 1), key=cost)
    return -(-tiles // per), per * TILE


def heads_per_cta(hq: int, qtokens: int = 1) -> int:
    """The largest compiled heads-per-CTA dividing Hq with heads x tokens <= ROWS: the cache is
    read once per head block, so as few blocks as the MMA's rows allow (16 heads at TP8, 64 of
    128 at TP1)."""
    return max(h for h in HEADS if hq % h == 0 and h * qtokens <= ROWS)


def sparse_heads() -> tuple[int, ...]:
    """The heads per CTA prebuilt for DSA: those dividing every Hq of SPARSE_HQ, and each
    SPARSE_HQ's own block."""
    common = {h for h in HEADS if all(hq % h == 0 for hq in SPARSE_HQ)}
    return tuple(sorted(common | {heads_per_cta(hq) for hq in SPARSE_HQ}))


def direct_blocks() -> tuple[tuple[int, int], ...]:
    """The (heads per CTA, query tokens) of the paged passes prebuilt in the direct form (the
    seesaw pass's in both dtypes, decode.py's in both and over FP8): each DIRECT_HQ's block at
    every QTOKENS (16 x 1, 32 x 1, 64 x 1, 16 x 2, 32 x 2, 16 x 4). Any of them can get a plan
    of one split: `tile_split_plan` gives one for every batch x head blocks >= num_sms / 2 (two
    splits' waves then cost more than one's) and for every sequence of at most
    MIN_TOKENS_PER_SPLIT keys."""
    return tuple(
        sorted(
            {(heads_per_cta(hq, qt), qt) for qt in QTOKENS for hq in DIRECT_HQ},
            key=lambda x: x[::-1],
        )
    )


def runs_direct(splits: int, heads: int, qtokens: int, sparse: bool = False) -> bool:
    """Whether the launcher takes a pass's direct form: a plan of one split of a prebuilt direct
    block: `direct_blocks` for the paged passes (the seesaw pass's and decode.py's), every
    `sparse_heads` block for DSA's (a prefill's many tokens give one split at any of them)."""
    if splits != 1:
        return False
    return heads in sparse_heads() if sparse else (heads, qtokens) in direct_blocks()


def params_for(
    kind: str,
    dtype: str,
    heads: int = 1,
    qtokens: int = 1,
    fp8: bool = False,
    tma: bool = False,
    direct: bool = False,
    pair: bool = False,
    ostore: bool = False,
    worklist: bool = False,
    ranges: bool = False,
    warps: bool = False,
    sink: bool = False,
    fused: bool = False,
    rope: str | None = None,
    positions: str | None = None,
    neox: bool = False,
    gather: bool = False,
    lean: bool = False,
    wide: bool = False,
) -> tuple:
    """Compile key: kind "partial" (one split of `heads` query heads x `qtokens` tokens, fp32
    out; qtokens > 1 the packed form with cu_seqlens_q), "sparse" (DSA: one split of one query
    token's top-k list, `heads` query heads; qtokens 1) or "combine" (the paged leaf's
    `PagedCombineSm90` at head dim D_LATENT, under the key the paged leaf would give it). fp8:
    the partial / sparse pass over FlashMLA's FP8 cache (dtype FP8_DTYPE only; its bytes by
    cp.async into their own stage, dequantized there a turn later: decode.py). tma: the partial
    pass over a 16-bit cache whose pages are multiples of TILE rows (seesaw.py: TMA boxes of
    whole tiles, the seesaw schedule). direct: the pass of a plan of one split, writing O in q's
    dtype and the natural LSE into the op's outputs (no partials, no combine): the seesaw pass's
    (tma), decode.py's paged pass (16-bit pages of partial tiles, FP8 caches) or its sparse one
    (DSA). pair (tma only): the head blocks as clusters of 2 sharing each tile's loads by TMA
    multicast (seesaw.py). ostore (the seesaw pass's direct form only): O staged in shared
    memory and sent by 16-byte stores (out rows 16-byte aligned: the compile assumes it).
    worklist (candidate; tma partial only): the pass takes its (unit, split, keys per split)
    from the scheduling kernel's work list (schedule.py).
    Kind "worklist": that scheduling kernel (worklist.py; dtype ignored, qtokens > 1 the
    packed form). ranges (a decode step's schedule, `launch.make_schedule`): the list's
    item-indexed form: the scheduler's (kind "worklist") per over the whole batch, items unit
    by unit and each row's item range; the pass (worklist only) writing its partial at its
    item; the combine (`PagedCombineRangesSm90`) reducing a row's item range.
    gather (tma only, no pair or work list): the seesaw pass over pages that are not whole
    tiles (page_size % TILE != 0; the launcher's default at page size 1), each chunk's rows
    gathered by cp.async (seesaw.py).
    lean (the sparse pass over an FP8 cache; the default where `takes_lean`): warpgroup
    1's issue of a tile's bytes first after the stage's release, the L2 prefetch of the tile
    after it by per-thread line prefetches behind it (its list entry loaded a turn early), the
    RoPE rows' page / slot by the fast divisor (decode.py `_load_wg_staged`; MLA_NOTES.md, "DSA
    FP8: the issue's chain"). wide (the sparse direct pass, not fused; the default with lean at
    `takes_wide`'s blocks): O in q's dtype staged in shared memory over the K stages and stored
    by 16-byte vectors (the seesaw's `ostore`, for decode.py's pass; out's rows 16-byte aligned:
    the compile assumes it).
    sink (the sparse direct pass): out x sigmoid(lse - attn_sink[h]) in the epilogue. fused
    (the sparse direct pass, 16-bit or with fp8 over FlashMLA's FP8 cache, bf16 q; the fused
    DSA prefill): q_pe rotated at the token's
    position before the scores, the output's RoPE columns rotated back, out cast to e4m3 per
    32 channels with UE8M0 scales; rope the [cos | sin] cache's dtype ("float32" or dtype),
    positions theirs ("int32" / "int64"), neox the half-split pairs. Each keyed only when on:
    the other kernels' keys (and SASS) are those before them."""
    if kind == "combine":  # the paged leaf's key at head dim 512 (warps: its warp form)
        keys = {"kind": kind, "dtype": dtype, "head_dim": D_LATENT}
        keys |= {"ranges": True} if ranges else {}
        keys |= {"form": "warps"} if warps else {}
        return tuple(sorted(keys.items()))
    if warps:
        raise ValueError("warps is a form of the combine")
    if kind == "worklist":
        keys = {"kind": kind, "qtokens": qtokens}
        return tuple(sorted((keys | ({"ranges": True} if ranges else {})).items()))
    if kind not in ("partial", "sparse"):
        raise ValueError(f"kind must be 'partial', 'sparse', 'combine' or 'worklist', got {kind!r}")
    if fp8 and dtype != FP8_DTYPE:
        raise ValueError(f"an FP8 cache takes {FP8_DTYPE} queries, got {dtype}")
    if tma and (kind != "partial" or fp8):
        raise ValueError("the TMA (seesaw) pass is the 16-bit paged partial pass")
    if pair and not tma:
        raise ValueError("the pair form is the seesaw (tma) pass's")
    if ostore and not (direct and tma):
        raise ValueError("ostore is a form of the seesaw (tma) pass's direct form")
    if worklist and (not tma or direct or pair):
        raise ValueError("the work list is a form of the seesaw (tma) partial pass")
    if ranges and not worklist:
        raise ValueError("ranges is a form of the work list's pass")
    if gather and (not tma or pair or worklist):
        raise ValueError("gather is a form of the seesaw (tma) pass, without pair or work list")
    if wide and not (kind == "sparse" and direct and not fused):
        raise ValueError("wide is a form of the sparse direct pass (not the fused one)")
    if lean not in (False, True):
        raise ValueError(f"lean must be False or True, got {lean!r}")
    if lean and not (kind == "sparse" and fp8):
        raise ValueError("lean is a form of the sparse pass over an FP8 cache")
    if (sink or fused) and not (kind == "sparse" and direct):
        raise ValueError("sink and fused are forms of the sparse direct pass")
    if fused != (rope is not None and positions is not None):
        raise ValueError("the fused form takes rope and positions dtypes, and only it")
    if fused and (rope not in ("float32", dtype) or positions not in ("int32", "int64")):
        raise ValueError(f"rope float32 or {dtype}, positions int32 or int64: {rope} {positions}")
    if neox and not fused:
        raise ValueError("neox is a form of the fused pass")
    if kind == "sparse" and qtokens != 1:
        raise ValueError(f"sparse attention takes one query token per CTA, got {qtokens}")
    keys = {"kind": kind, "dtype": dtype, "heads": heads}
    if qtokens > 1:
        keys["qtokens"] = qtokens
    if fp8:
        keys["fp8"] = True
    if tma:
        keys["tma"] = True
    if direct:
        keys["direct"] = True
    if pair:
        keys["pair"] = True
    if ostore:
        keys["ostore"] = True
    if worklist:
        keys["worklist"] = True
    if ranges:
        keys["ranges"] = True
    if gather:
        keys["gather"] = True
    if lean:
        keys["lean"] = True
    if wide:
        keys["wide"] = True
    if sink:
        keys["sink"] = True
    if fused:
        keys |= {"fused": True, "rope": rope, "positions": positions}
    if neox:
        keys["neox"] = True
    return tuple(sorted(keys.items()))
