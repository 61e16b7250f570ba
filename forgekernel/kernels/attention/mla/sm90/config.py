"""DeepSeek MLA paged decode configurations (DSL-free): the compiled variants and the split-KV
plan (the paged GQA leaf's `split_plan`, with one resident CTA per SM).

The latent cache row of a token is [c (D_LATENT) ; r (D_ROPE)]: the key is all 576 columns, the
value the first 512 (MQA with one KV head shared by every query head). A CTA takes `heads`
query heads x `qtokens` query tokens (rows <= ROWS of the MMA) of one sequence and one split of
its keys; shared memory holds STAGES tiles of TILE latent rows (2 x 64 x 576 x 2 bytes = 144 KB
with 16-bit caches), so one CTA fits an SM (RESIDENT)."""

from __future__ import annotations

# the split plan is the paged leaf's (re-exported for the launcher and the tests)
from forgekernel.kernels.attention.paged.sm90.config import split_plan  # noqa: F401

DTYPES = ("float16", "bfloat16")
HEADS = (1, 2, 4, 8, 16)  # query heads per CTA (a divisor of Hq)
QTOKENS = (1, 2, 4)  # query tokens per sequence (decode; speculative decoding / MTP)
ROWS = 16  # (query token, head) rows of one CTA: the MMA's M
THREADS = 128
WARPS = THREADS // 32
TILE = 64  # keys per pipeline stage
STAGES = 2
RESIDENT = 1  # CTAs per SM
D_LATENT = 512  # kv_lora_rank: the value and the first key columns
D_ROPE = 64  # qk_rope_head_dim: the key's last columns


def heads_per_cta(hq: int, qtokens: int = 1) -> int:
    """The largest compiled heads-per-CTA dividing Hq with heads x tokens <= ROWS: the cache is
    read once per head block, so as few blocks as the MMA's rows allow (16 heads at TP8)."""
    return max(h for h in HEADS if hq % h == 0 and h * qtokens <= ROWS)


def params_for(kind: str, dtype: str, heads: int = 1, qtokens: int = 1) -> tuple:
    """Compile key: kind "partial" (one split of `heads` query heads x `qtokens` tokens, fp32
    out; qtokens > 1 the packed form with cu_seqlens_q) or "combine" (the paged leaf's
    `PagedCombineSm90` at head dim D_LATENT, under the key the paged leaf would give it)."""
    if kind == "combine":
        return tuple(sorted({"kind": kind, "dtype": dtype, "head_dim": D_LATENT}.items()))
    if kind != "partial":
        raise ValueError(f"kind must be 'partial' or 'combine', got {kind!r}")
    keys = {"kind": kind, "dtype": dtype, "heads": heads}
    return tuple(sorted({**keys, **({"qtokens": qtokens} if qtokens > 1 else {})}.items()))
