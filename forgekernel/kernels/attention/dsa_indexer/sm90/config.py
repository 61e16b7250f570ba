"""DeepSeek sparse attention's lightning indexer (DSA, issue 22), sm_90a: configurations and
launch plans of its two kernels (DSL-free).

Phase 1, the logits (`logits.py`): per query row t and key s,
    logits[t, s] = k_scale[s] * sum_h w[t, h] * relu(q[t, h] . k[s])
with q (rows, HEADS, HEAD_DIM) and k (keys, HEAD_DIM) float8_e4m3fn. A CTA takes `qtokens`
query rows (decode: the next_n tokens of one sequence; prefill: consecutive packed rows) and
one split of their key tiles (TILE keys, one page of deep_gemm's paged cache); its two consumer
warpgroups take alternate tiles.

Phase 2, the top-k (`topk.py`): per row, the `topk` largest logits of its window of columns, as
column ids (paged: cache slots page * PAGE + offset) in ascending column order, -1 padded. A
row runs on a cluster of `cluster` CTAs, each holding up to CACHE of the row's values in shared
memory.
"""

from __future__ import annotations

HEADS = 64  # DeepSeek-V3.2's indexer heads (deep_gemm and FlashInfer-Bench require 64)
HEAD_DIM = 128  # one FP8 row of 128 bytes: one 128-byte swizzle atom, one scale per key
PAGE = 64  # deep_gemm's paged cache: 64 keys a page, then their 64 fp32 scales
PAGE_BYTES = PAGE * (HEAD_DIM + 4)  # 8448: a page's fp8 rows and its scales
TILE = PAGE  # keys per pipeline stage: one page (M of one warpgroup's WGMMA)
QTOKENS = (1, 2, 4)  # query rows per CTA: N = 64, 128, 256 of the WGMMA
LOGITS_THREADS = 3 * 128  # a producer warpgroup (one warp issues TMA), two consumers
# Key tiles in flight per CTA, by qtokens: one CTA per SM (setmaxnreg 232 for the consumers
# takes the register file), so decode keeps 20 x 8.4 KB = 169 KB of the cache in flight.
STAGES = {1: 20, 2: 20, 4: 20}
CTAS_PER_SM = {1: 1, 2: 1, 4: 1}
FLOPS_PER_PAIR = 2 * HEADS * HEAD_DIM  # per (query row, key)
SMEM_PER_SM = 228 * 1024 - 1024  # less the 1 KB the system reserves per CTA

TOPK_THREADS = 512
HIST_BITS = 11  # radix digit: 2048 bins, three rounds resolve 32-bit keys
CACHE = 16384  # row values a top-k CTA holds (64 KB; 2 CTAs per SM)
CLUSTERS = (1, 2, 4, 8)  # CTAs per row (portable cluster sizes)
MAX_KEYS = CACHE * CLUSTERS[-1]  # 131072: the longest window a row may have
ALIGN = 4  # logits row stride multiple (16-byte rows for the bulk copies)
MAX_GRID_Y = 65535  # the logits' grid y (row groups; decode: sequences) stops here
# A TMA box's start along its innermost (contiguous) dimension must be 16-byte aligned, or the
# load raises "illegal instruction" (Triton's TMA sanitizer checks the same rule). The prefill
# scales (keys,) fp32 are a 1-D box starting at the CTA's first key: a multiple of 4 keys.
SCALE_ALIGN = 16 // 4


def logits_smem_bytes(qtokens: int) -> int:
    """Shared memory of a logits CTA: Q, the K ring with its scales, barriers, alignment."""
    ring = STAGES[qtokens] * (TILE * HEAD_DIM + TILE * 4)
    return qtokens * HEADS * HEAD_DIM + ring + 16 * (STAGES[qtokens] + 1) + 2048


def topk_smem_bytes() -> int:
    """Shared memory of a top-k CTA: the cached part, two histograms, counters."""
    return 4 * (CACHE + 8) + 2 * 4 * (1 << HIST_BITS) + 512


def logits_params(qtokens: int, paged: bool) -> tuple:
    if qtokens not in QTOKENS:
        raise ValueError(f"qtokens must be one of {QTOKENS}, got {qtokens}")
    return tuple(sorted({"kind": "logits", "qtokens": qtokens, "paged": paged}.items()))


def topk_params(cluster: int, paged: bool) -> tuple:
    if cluster not in CLUSTERS:
        raise ValueError(f"cluster must be one of {CLUSTERS}, got {cluster}")
    return tuple(sorted({"kind": "topk", "cluster": cluster, "paged": paged}.items()))


def prefill_chunk_rows(rows: int, width: int, budget: int) -> int:
    """Rows of one prefill chunk: within the logits budget and the logits' grid y (groups of
    QTOKENS[-1] rows)."""
    return max(1, min(rows, budget // max(1, width), MAX_GRID_Y * QTOKENS[-1]))


def key_origin(lo):
    """The first key of a prefill logits CTA's tiles: its rows' smallest window start (>= 0)
    rounded down to SCALE_ALIGN, so that every scale box (key_origin + TILE j) starts 16-byte
    aligned. Python int or DSL Int32 (the kernel calls it)."""
    return lo // SCALE_ALIGN * SCALE_ALIGN


def logits_qtokens(next_n: int | None) -> int:
    """Query rows per CTA: decode takes a sequence's next_n rows together (they share its keys);
    prefill the most (4: each key tile read from L2 serves 4 x 64 heads)."""
    if next_n is None:
        return QTOKENS[-1]
    if next_n not in QTOKENS:
        raise ValueError(f"next_n must be one of {QTOKENS}, got {next_n}")
    return next_n


def split_plan(groups: int, max_tiles: int, qtokens: int, num_sms: int) -> tuple[int, int]:
    """(splits, tiles per split) over key tiles: enough CTAs for two waves of the resident
    ones, each at least one tile; bounded by shapes only (max_tiles: the widest window)."""
    max_tiles = max(1, max_tiles)
    target = CTAS_PER_SM[qtokens] * num_sms
    splits = max(1, min(max_tiles, -(-target // max(1, groups))))
    per = -(-max_tiles // splits)
    return -(-max_tiles // per), per


def topk_cluster(rows: int, width: int, num_sms: int) -> int:
    """CTAs per row: the fewest whose caches hold `width` values, doubled while the rows leave
    SMs idle and each CTA keeps at least 4096 values (decode at small batch)."""
    if width > MAX_KEYS:
        raise ValueError(f"a window of {width} keys is more than the {MAX_KEYS} supported")
    cluster = next(c for c in CLUSTERS if c * CACHE >= width)
    while cluster < CLUSTERS[-1] and rows * cluster * 2 <= num_sms and width >= 2 * cluster * 4096:
        cluster *= 2
    return cluster
