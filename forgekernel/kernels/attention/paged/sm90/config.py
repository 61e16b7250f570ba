"""Paged GQA decode configurations (DSL-free): the compiled variants and the split-KV plan."""

from __future__ import annotations

DTYPES = ("float16", "bfloat16")
HEAD_DIMS = (64, 128, 256)
HEADS = (1, 2, 4, 8, 16)  # query heads per CTA (a divisor of the group Hq / Hkv)
THREADS = 128
WARPS = THREADS // 32
# CTAs the split plan aims for: a few per SM, so that enough loads are in flight to stream the
# cache (one CTA keeps 4 warps x UNROLL tokens of K and V in flight).
CTAS_PER_SM = 4
MIN_TOKENS_PER_SPLIT = 256


QTOKENS = (1, 2, 4)  # query tokens per sequence (decode; speculative decoding / MTP)

# The tensor-core partial pass (decode_mma.py, 16-bit caches): keys per pipeline stage (16 per
# warp) and stages per head dim (K and V tiles of MMA_TILE x D, 16-bit: 16 / 32 / 64 KB a
# stage; two CTAs per SM at D <= 128).
MMA_TILE = 64
MMA_STAGES = {64: 4, 128: 3, 256: 3}
MMA_ROWS = 16
MMA_RESIDENT = {64: 3, 128: 2, 256: 1}  # CTAs per SM, by shared memory (66 / 100 / 201 KB)


def heads_per_cta_mma(group: int, qtokens: int = 1) -> int:
    """The largest compiled heads-per-CTA that divides the group with heads x tokens <= 16
    (the MMA's rows): one CTA per KV head up to a group of 16 / tokens."""
    return max(h for h in HEADS if group % h == 0 and h * qtokens <= MMA_ROWS)


def max_heads(head_dim: int, qtokens: int = 1) -> int:
    """The most query heads one CTA holds in registers (heads x tokens x D <= 2048)."""
    return min(16, 2048 // (head_dim * qtokens))


def heads_per_cta(group: int, head_dim: int, qtokens: int = 1) -> int:
    """The largest compiled heads-per-CTA that divides the group and fits the registers."""
    return max(h for h in HEADS if group % h == 0 and h <= max_heads(head_dim, qtokens))


def params_for(
    kind: str,
    dtype: str,
    head_dim: int,
    heads: int = 1,
    kv: str = "",
    qtokens: int = 1,
) -> tuple:
    """Compile key: kind "mma" (the tensor-core partial pass of a 16-bit cache), "partial"
    (the CUDA-core partial pass; `kv` "float8_e4m3fn" for an FP8 cache) - both one split's
    attention of `heads` query heads, fp32 out, `qtokens` > 1 the speculative form with
    cu_seqlens_q - or "combine" (the splits merged into the output; no heads)."""
    if kind == "combine":
        return tuple(sorted({"kind": kind, "dtype": dtype, "head_dim": head_dim}.items()))
    keys = {"kind": kind, "dtype": dtype, "head_dim": head_dim, "heads": heads}
    extra = {
        **({"kv": kv} if kv else {}),
        **({"qtokens": qtokens} if qtokens > 1 else {}),
    }
    return tuple(sorted({**keys, **extra}.items()))


def split_plan(
    batch: int, head_blocks: int, max_tokens: int, num_sms: int, resident: int | None = None
) -> tuple[int, int]:
    """(splits, tokens per split), none shorter than `MIN_TOKENS_PER_SPLIT` tokens (a split
    costs a partial output and its share of the combine). `resident` (CTAs of the partial
    pass an SM holds at once): as many splits as fill one wave of num_sms x resident CTAs
    without starting another (a second wave of a few CTAs left most SMs idle: 2.06 waves ran
    at 0.77x FlashInfer, b4 x 32k, 2026-12-01); None: `CTAS_PER_SM` CTAs per SM or more
    (the CUDA-core pass). `max_tokens`: an upper bound of the KV lengths (the page table
    width times the page size: no device read)."""
    units = max(1, batch * head_blocks)
    if resident is None:
        want = -(-CTAS_PER_SM * num_sms // units)
    else:
        want = num_sms * resident // units
    cap = max(1, -(-max_tokens // MIN_TOKENS_PER_SPLIT))
    splits = max(1, min(want, cap))
    per = -(-max(max_tokens, 1) // splits)
    return -(-max(max_tokens, 1) // per), per
