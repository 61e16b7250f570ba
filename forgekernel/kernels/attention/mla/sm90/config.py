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
`heads` query heads), merged by the same combine."""

from __future__ import annotations

# the split plan is the paged leaf's (re-exported for the launcher and the tests)
from forgekernel.kernels.attention.paged.sm90.config import split_plan  # noqa: F401

DTYPES = ("float16", "bfloat16")
HEADS = (1, 2, 4, 8, 16, 32, 64)  # query heads per CTA (a divisor of Hq)
QTOKENS = (1, 2, 4)  # query tokens per sequence (decode; speculative decoding / MTP)
ROWS = 64  # (query token, head) rows of one CTA: the WGMMA's M
WARPGROUPS = 2  # side by side: S along the keys, P V along the output columns
THREADS = 128 * WARPGROUPS
TILE = 64  # keys per pipeline stage
STAGES = 2
RESIDENT = 1  # CTAs per SM
D_LATENT = 512  # kv_lora_rank: the value and the first key columns
D_ROPE = 64  # qk_rope_head_dim: the key's last columns
SPARSE_HQ = (16, 128)  # DeepSeek-V3.2's query heads per GPU at TP8 and TP1 (the prebuilt DSA)


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


def params_for(kind: str, dtype: str, heads: int = 1, qtokens: int = 1) -> tuple:
    """Compile key: kind "partial" (one split of `heads` query heads x `qtokens` tokens, fp32
    out; qtokens > 1 the packed form with cu_seqlens_q), "sparse" (DSA: one split of one query
    token's top-k list, `heads` query heads; qtokens 1) or "combine" (the paged leaf's
    `PagedCombineSm90` at head dim D_LATENT, under the key the paged leaf would give it)."""
    if kind == "combine":
        return tuple(sorted({"kind": kind, "dtype": dtype, "head_dim": D_LATENT}.items()))
    if kind == "sparse":
        if qtokens != 1:
            raise ValueError(f"sparse attention takes one query token per CTA, got {qtokens}")
        return tuple(sorted({"kind": kind, "dtype": dtype, "heads": heads}.items()))
    if kind != "partial":
        raise ValueError(f"kind must be 'partial', 'sparse' or 'combine', got {kind!r}")
    keys = {"kind": kind, "dtype": dtype, "heads": heads}
    return tuple(sorted({**keys, **({"qtokens": qtokens} if qtokens > 1 else {})}.items()))
