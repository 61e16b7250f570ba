"""The FP4-weight masked grouped GEMM's configurations (`kernel.py`): tokens per tile h (WGMMA's
N, the weights being its A: 128 weight rows per tile, two consumer warpgroups), the standard set
and the chooser by the caller's expected tokens per expert (DeepGEMM's `expected_m`). DSL-free.
"""

from __future__ import annotations

OUT_DTYPES = ("bfloat16", "float16")
TOKENS = (8, 16, 32, 64)  # h: WGMMA n8 .. n64; fragment h / 2 fp32 per thread, three of them
TILE_W = 128  # weight rows per tile (N): two warpgroups of WGMMA's M = 64
TILE_K = 128  # one k-tile: one fp32 promotion, four 1x32 scale sub-blocks (one per k32 WGMMA)
SUB_K = 32  # the weights' scale granularity along K (UE8M0 per 1x32, DeepGEMM's recipe_b)
STANDARD_TOKENS = TOKENS
# The converter form (`convert.py`, opt-in) also takes 96 tokens a tile: no A register sets,
# the MMA warpgroups' 208 registers hold three 48-register fragments (compiled 2026-12-05:
# 0 spills, R201 the highest; the standard form spills 168 bytes at 96)
CONVERTER_TOKENS = (*TOKENS, 96)
# The contiguous layout has no expected_m: each expert's 128-row segment is cut into tiles of
# this many tokens unless the caller passes a hint (tiles of padding rows only are skipped).
CONTIGUOUS_TOKENS = 32
# ... and at most this many: at 64 the contiguous walk's few extra live values spill 16 bytes
# per tile (compiled 2026-12-01; the masked layout's 64 does not)
CONTIGUOUS_MAX_TOKENS = 32
CONTIGUOUS_STANDARD_TOKENS = tuple(h for h in TOKENS if h <= CONTIGUOUS_MAX_TOKENS)


# The chooser covers COVER x expected_m while that fits COVER_MAX tokens, else expected_m itself.
# expected_m is a mean: the counts spread around it, and an expert past its tile takes several
# token tiles, each streaming its weight tile again (the FP8 masked GEMM's double cover, 1.097x
# DeepGEMM at 2026-12-04 17:55). This GEMM's variants (H200 2026-12-02, graph, time / the
# single cover's tile): 8 expected rows ran 0.861-0.869x on 16 tokens (E256), 9 ran 0.913-0.947x
# on 32 (E32); but 29-32 ran 1.018-1.103x on 64 tokens (the 64-token fragment's cost): no
# doubled cover past 32.
COVER = 2
COVER_MAX = 32


def choose_tokens(expected_m: int, contiguous: bool = False) -> int:
    """The fewest tokens per tile that cover COVER x `expected_m` where that is at most
    COVER_MAX, else `expected_m` (experts with more take several token tiles, their weight
    tile re-read from L2 by CTAs running side by side)."""
    tiles = CONTIGUOUS_STANDARD_TOKENS if contiguous else TOKENS
    want = COVER * expected_m if COVER * expected_m <= COVER_MAX else expected_m
    return next((h for h in tiles if want <= h), tiles[-1])


def expected_for(tokens: int) -> int:
    """An expected_m `choose_tokens` maps to `tokens` (a tile of TOKENS): what forces a tile
    through the op's hint."""
    return tokens // COVER if tokens <= COVER_MAX else tokens


def stage_bytes(tokens: int) -> int:
    """One pipeline stage's TMA bytes: the packed weight tile, its exponent words, the tokens'
    e4m3 rows (the full barrier's expect-tx)."""
    return TILE_W * TILE_K // 2 + 4 * TILE_W + tokens * TILE_K


def ring_bytes(tokens: int, staged_sa: bool = False) -> int:
    """One stage's shared memory: its TMA bytes and, with `staged_sa`, the tokens' fp32
    activation scales of its k-tile (cp.async by the producer lanes, `kernel.py`)."""
    return stage_bytes(tokens) + (4 * tokens if staged_sa else 0)


def params_for(
    out_dtype: str,
    tokens: int,
    contiguous: bool = False,
    staged_sa: bool = False,
    converter: bool | int = False,
) -> tuple:
    """The compile key's baked-in part: the output dtype, the tokens per tile and, for the
    contiguous layout, contiguous=True (absent for the masked one). Opt-in forms, each keyed
    only when on (docs/gemm/NOTES.md "FP4 at 16-96 tokens"): `staged_sa` stages the tokens'
    activation scales in the ring; `converter` (which stages them too) widens in a converter
    warpgroup and runs the MMAs with A from shared memory (`convert.py`); converter=2 with two
    converter warpgroups (keyed ("converters", 2) besides; at most 64 tokens)."""
    tiles = CONTIGUOUS_STANDARD_TOKENS if contiguous else TOKENS
    if converter and not contiguous:
        tiles = CONVERTER_TOKENS if converter == 1 else TOKENS
    if tokens not in tiles:
        raise ValueError(f"tokens per tile must be one of {tiles}, got {tokens}")
    layout = (("contiguous", True),) if contiguous else ()
    staged = (("staged_sa", True),) if staged_sa and not converter else ()
    convert = (("converter", True),) if converter else ()
    if converter and converter != 1:
        if converter != 2:
            raise ValueError(f"1 or 2 converter warpgroups, got {converter}")
        convert = (*convert, ("converters", 2))
    return (("out", out_dtype), ("tokens", tokens), *layout, *staged, *convert)
