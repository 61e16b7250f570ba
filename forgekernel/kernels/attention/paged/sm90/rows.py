"""The partial pass's (token, head) rows a CTA, DSL-free: one m16 MMA row block (`config.ROWS`)
or two. Apart from config.py, whose every change retires the MLA and DSA leaves' GPU records
(their combine imports it).

16-bit caches at D 64 / 128 take up to two row blocks (32 rows) a warp, so that the H x Q rows
of a KV head at GQA 8 x 4 tokens or GQA 16 x 2 share one K / V stream (with 16 rows two CTAs
streamed every KV head: 0.53x FlashInfer at 64 / 8 heads x 4 tokens, 2026-12-02). O is then
32 x D / 32 fp32 registers a thread, 128 at D 128; D 256 (256) and the FP8 pass (registers
capped for RESIDENT_FP8 CTAs, its merge over the byte tiles) keep one row block."""

from __future__ import annotations

from forgekernel.kernels.attention.paged.sm90.config import HEADS, ROWS

MAX_ROWS = 2 * ROWS


def row_cap(head_dim: int, kv: str = "") -> int:
    """The most (token, head) rows a CTA of the partial pass takes: `MAX_ROWS` on a 16-bit
    cache (kv "") at D <= 128, else one MMA row block (`ROWS`)."""
    return MAX_ROWS if not kv and head_dim <= 128 else ROWS


def heads_for(group: int, qtokens: int, head_dim: int, kv: str = "") -> int:
    """`config.heads_per_cta` under `row_cap`'s rows: the largest compiled heads-per-CTA that
    divides the group with heads x tokens <= the cap (one CTA per KV head up to a group of
    cap / tokens, 16 heads at most)."""
    cap = row_cap(head_dim, kv)
    return max(h for h in HEADS if group % h == 0 and h * qtokens <= cap)
