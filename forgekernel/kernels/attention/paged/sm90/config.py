"""Paged GQA decode configurations (DSL-free): the compiled variants and the split-KV plan."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
HEADS = (1, 2, 4, 8, 16)  # query heads per CTA (a divisor of the group Hq / Hkv)
QTOKENS = (1, 2, 4)  # query tokens per sequence (decode; speculative decoding / MTP)
KV_DTYPES = ("", "float8_e4m3fn")  # "": the cache has q's dtype
THREADS = 128
WARPS = THREADS // 32
MIN_TOKENS_PER_SPLIT = 256
WAVE_FILL = 0.9  # how full the split plan's last wave of CTAs must be
# The partial pass (decode.py): keys per pipeline stage (16 per warp), the MMA's rows (query
# (token, head) pairs), stages per head dim and CTAs an SM holds, by shared memory (16-bit
# K and V tiles of 16 / 32 / 64 KB a stage: 66 / 100 / 201 KB; FP8 less).
TILE = 64
ROWS = 16
STAGES = {64: 4, 128: 3, 256: 3}
RESIDENT = {64: 3, 128: 2, 256: 1}
# FP8 (e4m3) caches: byte tiles (8 / 16 / 32 KB of K and V a stage), widened in registers
# (fp8.py), so more stages and CTAs fit: at least the 16-bit cache's bytes in flight per SM
# ((STAGES - 1) x tile x RESIDENT: 160 / 144 / 128 KB against 144 / 128 / 128 KB), the
# registers capped for RESIDENT CTAs of THREADS threads.
STAGES_FP8 = {64: 6, 128: 4, 256: 3}
RESIDENT_FP8 = {64: 4, 128: 3, 256: 2}
# The FP8 operands' register orders (fp8.py): a query dim 4t + 2i + j of a 16-dim segment sits
# at 8i + 2t + j in shared memory ((j, i, t) shapes, strides), and column n of O's 8-column MMA
# block 2s + e is dim 16s + 2n + e ((n, e) shapes, strides).
FP8_Q_SLOT = ((2, 2, 4), (1, 8, 2))
FP8_O_COLUMN = ((8, 2), (2, 1))


def heads_per_cta(group: int, qtokens: int = 1) -> int:
    """The largest compiled heads-per-CTA that divides the group with heads x tokens <= ROWS:
    one CTA per KV head up to a group of 16 / tokens."""
    return max(h for h in HEADS if group % h == 0 and h * qtokens <= ROWS)


def params_for(
    kind: str,
    dtype: str,
    head_dim: int,
    heads: int = 1,
    kv: str = "",
    qtokens: int = 1,
    ranges: bool = False,
    warps: bool = False,
) -> tuple:
    """Compile key: kind "partial" (one split's attention of `heads` query heads, fp32 out;
    `kv` "float8_e4m3fn" for an FP8 cache, else the cache has q's dtype; `qtokens` > 1 the
    speculative form, cu_seqlens_q) or "combine" (the splits merged into the output; no
    heads). ranges (a decode step's schedule, `forgekernel.attention_paged_schedule`): the
    pass reading its (sequence, split) from the step's work list and writing its partial by
    item (16-bit decode only), the combine reducing each sequence's item range. warps
    (combine only): the warp form, one warp a (row, head) (combine.PagedCombineWarpsSm90,
    `combine.takes_warps`)."""
    if warps and (kind != "combine" or head_dim % 128):
        raise ValueError("warps: the combine's form at head dims that are multiples of 128")
    if ranges and (kv or qtokens > 1):
        raise ValueError("ranges: 16-bit caches and one query token only")
    if kind == "combine":
        keys = {"kind": kind, "dtype": dtype, "head_dim": head_dim}
        keys |= {"ranges": True} if ranges else {}
        keys |= {"form": "warps"} if warps else {}
        return tuple(sorted(keys.items()))
    keys = {"kind": kind, "dtype": dtype, "head_dim": head_dim, "heads": heads}
    extra = {
        **({"kv": kv} if kv else {}),
        **({"qtokens": qtokens} if qtokens > 1 else {}),
        **({"ranges": True} if ranges else {}),
    }
    return tuple(sorted({**keys, **extra}.items()))


def split_plan(
    batch: int, head_blocks: int, max_tokens: int, num_sms: int, resident: int
) -> tuple[int, int]:
    """(splits, tokens per split), none shorter than `MIN_TOKENS_PER_SPLIT` tokens (a split
    costs a partial output and its share of the combine): the fewest splits whose CTAs fill
    their last wave of num_sms x `resident` (CTAs per SM) to WAVE_FILL, else the best filled
    (a last wave of a few CTAs leaves most SMs idle: 2.06 waves ran at 0.77x FlashInfer at
    b4 x 32k, 1.29 waves at 0.76x at b32 x 16 heads, D 64, 2026-12-01). `max_tokens`: an upper
    bound of the KV lengths (the page table width times the page size: no device read)."""
    units = max(1, batch * head_blocks)
    cap = max(1, -(-max_tokens // MIN_TOKENS_PER_SPLIT))
    slots = num_sms * resident

    def fill(s: int) -> float:
        return units * s / slots / -(-units * s // slots)

    splits = next((s for s in range(1, cap + 1) if fill(s) >= WAVE_FILL), None)
    splits = splits or max(range(1, cap + 1), key=fill)
    per = -(-max(max_tokens, 1) // splits)
    return -(-max(max_tokens, 1) // per), per
