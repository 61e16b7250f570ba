"""Attention-forward configurations: the frozen config, the per-head-dim defaults and the
standard set built ahead of time. DSL-free, so the torch layer can pick a kernel without the
compiler."""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields, replace
from typing import NamedTuple

from forgekernel.kernels.common.sm90.constants import DTYPE_NAMES, SMEM_CAPACITY

DTYPES = DTYPE_NAMES
# (head_dim, head_dim_v) pairs with a default config; others raise in `default_config`.
HEAD_DIMS = ((64, 64), (96, 96), (128, 128), (256, 256), (192, 128))


@dataclass(frozen=True)
class AttnConfig:
    """Everything baked into one compiled attention forward besides dtype, head dims, causal.

    tile_m: query rows per tile (one consumer warpgroup per 64 rows: 128 or 192); tile_n: keys
    per K/V tile; stages: K and V tiles in flight (one ring each).

    late_rescale: without ping-pong (D > 128), O's rescale runs after the next S GEMM is
    issued (under it, right before the P V that accumulates onto O: FA3's
    RescaleOBeforeGemm) instead of before that issue. H200, FA4 time / ours: D = 256 (128x80
    tiles) 0.896 late against 0.865 before; 192/128 0.876 late against 0.923 before, so it is
    off there. Ignored with ping-pong (D <= 128), where it would hold the GEMM turn.

    snake: the persistent CTAs take the longest-first tiles in snake order (odd full rounds of
    one tile a CTA reversed: `LongestFirst.snake`), so the CTA that took a round's longest
    tile takes the next one's shortest; fixed length outside L2 sections only (ignored for
    varlen and paged). A load-balance model puts the busiest CTA of D=256 b4 hq16 s4096
    causal at 6.2% over the mean plain, 0.8% snaked (FA4, not persistent, gets the
    hardware's dynamic dispatch). H200 2026-12-03, FA4 time / ours on that case: 128x80
    0.903 plain, 0.990 snaked; 128x64 0.912 plain, 0.929 snaked; D=128 and D=64 gain under
    the rule's 1% in one of their two cases, so it stays off there.

    l2_kv_mib: the K and V MiB of one L2 section of heads, where the tile order uses sections
    (`scheduler.longest_first`, L2_KV_BUDGET = 24 MiB: 4 heads at 192/128 s8192; FA4 takes
    8, 40 MiB here). H200 2026-12-03, 192/128 b2 hq128 s8192 causal: 0.977 of FA4 at 40 MiB
    against 0.922 at 24.

    dynamic: the persistent CTAs take their tiles from a global counter (the backward's
    `scheduler.atomic`: CTA c starts on tile c, then grid + the counter's old value, bumped by
    the producer once a tile's loads are issued and handed to the consumer warps through a
    shared-memory ring), in the same tile order; the launcher passes a zeroed int32 (1,) in
    the page-table slot (not with paged; snake ignored) and launches one CTA a SM. On for the
    D = 128 varlen default (`_VARLEN_DEFAULTS`): H200 2026-12-04 00:46, 0.935 of the static
    deal's time (4 CTAs a SM) on chunked prefill, 0.963 / 0.989 on the two dense varlen
    cases; fixed length GQA D = 128 lost (0.984 / 1.011), so it stays off there. In sections,
    the tiles of one section run together only with the counter (the static deal scatters
    them): on with `wave_kv_mib` 0 in the fixed-length rules of 192/128, D = 256 causal and
    D = 128 causal (`FIXED_RULES`; H100 2026-12-05 16:50: 192/128 0.875-0.931 of the static
    deal's time, D = 256 causal 0.908 / 0.920, D = 128 causal 0.650 with the sections).

    k_ahead: the producer loads K of the next key block before V of the current one (FA4's
    and FA3's order with the S / P V overlap: K of block n_max - 1, then Q, then (K_{n-1},
    V_n) pairs, V of the last block last), instead of K and V of one block together after Q's
    turn. The consumers need K one step before V (S_j and P_{j-1} V_{j-1} issue together), so
    K's lead over its S GEMM grows from about 1.5 steps to 2 (K's stage frees as soon as its
    S is done, V's only when its P V is, and ours issues K behind the V before it), and Q no
    longer queues behind the first V. Not with paged. Candidate (192/128): with the counter
    0.979 / 0.957 / 0.998 of the counter alone on the three long cases (H100 2026-12-05, a
    noisy run: undecided, docs/attention/NOTES.md "192/128 and the L2 rules adopted").

    wave_kv_mib: the tile order goes in L2 sections when one wave of longest-first tiles
    would read more K and V than this (`scheduler.longest_first`, WAVE_KV_LIMIT_KIB = 320
    MiB); 0: in sections whenever a head's K and V reach 1 KiB (always on real shapes: FA4's
    and FA3's rule). 192/128 b8 hq128 s2048 (a 166 MiB wave: the global order) reads every
    K / V block from HBM once per tile (12.7 GB in 3.13 ms, 4.1 TB/s on the H200:
    memory-bound, 0.854 of FA4, which sections 32 heads there). 0 in the fixed-length rules
    (`FIXED_RULES`: 192/128 causal, D = 96 and D = 256 both masks, D = 128 both masks, D = 64
    non-causal): the MHA / GQA-2 waves of 17-256 MiB re-read K / V from HBM every tile
    (0.605-0.953 of the global order's time, H100 2026-12-05).

    Variants measured and dropped from the kernel are listed in docs/attention/NOTES.md."""

    tile_m: int = 128
    tile_n: int = 128
    stages: int = 2
    late_rescale: bool = True
    snake: bool = False
    l2_kv_mib: int = 24
    dynamic: bool = False
    k_ahead: bool = False
    wave_kv_mib: int = 320

    def tag(self) -> str:
        """Short name for tables: 128x128_s2 (plus _early without the late rescale, _snake
        with the snake order, _secN with N MiB L2 sections, _dyn with the tile counter,
        _kahead with K loaded a block ahead of V, _waveN with sections past an N MiB wave)."""
        tag = f"{self.tile_m}x{self.tile_n}_s{self.stages}"
        tag = tag if self.late_rescale else tag + "_early"
        tag = tag + "_snake" if self.snake else tag
        tag = tag if self.l2_kv_mib == 24 else tag + f"_sec{self.l2_kv_mib}"
        tag = tag + "_dyn" if self.dynamic else tag
        tag = tag + "_kahead" if self.k_ahead else tag
        return tag if self.wave_kv_mib == 320 else tag + f"_wave{self.wave_kv_mib}"

    @classmethod
    def from_params(cls, params: dict) -> AttnConfig:
        """The config of a compile key (`params_for`; a knob absent from the key: its
        default)."""
        return cls(**{f.name: params[f.name] for f in fields(cls) if f.name in params})


def separate_o(cfg: AttnConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> bool:
    """Whether O gets its own shared-memory buffer (else it reuses Q's, and the next tile's Q
    load waits for the O store)."""
    return _smem(cfg, head_dim, head_dim_v, elem_bytes, True) <= SMEM_CAPACITY


def _smem(cfg, head_dim, head_dim_v, elem_bytes, own_o: bool) -> int:
    q = cfg.tile_m * head_dim * elem_bytes
    o = cfg.tile_m * head_dim_v * elem_bytes
    kv = cfg.stages * cfg.tile_n * (head_dim + head_dim_v) * elem_bytes
    return (q + o if own_o else max(q, o)) + kv + 1024


def smem_bytes(cfg: AttnConfig, head_dim: int, head_dim_v: int, elem_bytes: int = 2) -> int:
    """Shared memory of one CTA: Q, O (its own buffer when it fits, else Q's), the K and V
    rings, mbarriers."""
    own_o = separate_o(cfg, head_dim, head_dim_v, elem_bytes)
    return _smem(cfg, head_dim, head_dim_v, elem_bytes, own_o)


# The head dims' defaults (fixed-length problems outside every FIXED_RULES class; the plan
# before the rules, the bench's `was`). One CTA per SM (the consumer warpgroups take the whole
# register file), so shared memory only bounds stages. D=64: three consumer warpgroups (192-row
# tiles, FA3's choice), 3 stages (1.022 of FA4 against 0.932 for 128x128); D=96 and D=128: two,
# 2 stages, O in its own buffer; D=256: 80-key tiles in snake order (0.990 of FA4 against 0.912
# for 64-key tiles in tile order); D=192/Dv=128: O shares Q's buffer, O rescaled before the S
# GEMM issue (after it: 5% slower), L2 sections of 40 MiB (0.977 against 0.922 at 24). H200
# figures: docs/attention/NOTES.md.
_DEFAULTS = {
    (64, 64): AttnConfig(tile_m=192, tile_n=128, stages=3),
    (96, 96): AttnConfig(tile_n=128, stages=2),
    (128, 128): AttnConfig(tile_n=128, stages=2),
    (256, 256): AttnConfig(tile_n=80, stages=2, snake=True),
    (192, 128): AttnConfig(tile_n=128, stages=2, late_rescale=False, l2_kv_mib=40),
}
# The varlen launch's, where they differ: D = 128 takes its tiles from a counter (`dynamic`,
# one CTA a SM), measured 0.935 / 0.963 / 0.989 of the static deal's time on the chunked and
# the two dense varlen cases (docs/attention/NOTES.md, "Measured 2026-12-04 00:40-00:50").
_VARLEN_DEFAULTS = {
    (128, 128): AttnConfig(tile_n=128, stages=2, dynamic=True),
}
# The paged mode's, where they differ: its K / V tiles load one TMA box a page, and a box
# must divide both the tile and the page (`page_box_for`); 80-key tiles would gather pages of
# 32 to 128 rows, so D=256 keeps 64-key tiles there (snake is off in the paged mode anyway).
_PAGED_DEFAULTS = {
    (256, 256): AttnConfig(tile_n=64, stages=2),
}


class FixedRule(NamedTuple):
    """A fixed-length class that takes other knobs than its head dims' default: (head_dim,
    head_dim_v) and the mask as given, the query heads a kv head in `groups`, lo <= Sq <= Sk
    <= hi (`seqlens`; Sq > Sk never measured) and batch x kv heads >= `min_kv_heads` (at
    fewer, one wave holds fewer heads: a smaller K / V footprint than measured; at more, the
    wave is the same 132-tile one)."""

    head_dims: tuple[int, int]
    causal: bool
    groups: tuple[int, ...]
    seqlens: tuple[int, int]
    min_kv_heads: int
    knobs: tuple[tuple[str, object], ...]


_SECTIONS = (("wave_kv_mib", 0),)
_SECTIONS_COUNTER = (("dynamic", True), ("wave_kv_mib", 0))
# The classes the 2026-12-05 16:50 H100 timing moved (rules 1-7) and its 19:56 repeat moved
# (rule 8), each restricted to its measured cases (variant / the default's time;
# docs/attention/NOTES.md "192/128 and the L2 rules adopted", "Rule 8: D = 128 non-causal MHA in
# sections"): L2 sections at every size (`wave_kv_mib` 0) where the global order's MHA / GQA-2
# waves re-read their K / V from HBM every tile, with the tile counter (`dynamic`) where the
# static deal's long-to-short section saw lost (D = 256 causal: sections alone 1.108 / 1.110) or
# the counter gained on top (192/128, D = 128 causal). Unchanged: D = 64 causal (sections 1.100,
# with the counter 0.994: a tie), D = 128 GQA 4 and beyond, both masks (the controls:
# 0.998-1.017), varlen and paged.
FIXED_RULES = (
    # b8 hq128 s2048 0.605; b2 s8192 0.931, b1 s16384 0.919, b1 sq2048 sk16384 0.875 (the counter
    # alone there: those already run in sections)
    FixedRule((192, 128), True, (1,), (2048, 16384), 128, _SECTIONS_COUNTER),
    FixedRule((96, 96), True, (1,), (2048, 2048), 256, _SECTIONS),  # b8 hq32 s2048 0.709
    FixedRule((96, 96), False, (1,), (1024, 1024), 512, _SECTIONS),  # b16 hq32 s1024 0.666
    # b4 hq16 s4096 0.920, b8 hq16 hkv8 s2048 0.908
    FixedRule((256, 256), True, (1, 2), (2048, 4096), 64, _SECTIONS_COUNTER),
    FixedRule((256, 256), False, (2,), (1024, 1024), 64, _SECTIONS),  # b16 hq8 hkv4 s1024 0.913
    FixedRule((128, 128), True, (1,), (1024, 1024), 512, _SECTIONS_COUNTER),  # b16 hq32 0.650
    FixedRule((64, 64), False, (1,), (512, 512), 512, _SECTIONS),  # b32 hq16 s512 0.953
    # b8 hq32 s2048 0.647 (eager, L2 flushed: 0.628; 12 MiB sections the same, 0.647 / 0.628),
    # H100 2026-12-05 19:56 on next/integration34, repeating 16:50's 0.645; ours 1.497 ms
    # against FA4's 0.957 (0.640x, the suite's slowest case). MHA only: the GQA-4 controls
    # b4 hq32 hkv8 s8192 and b1 hq32 hkv8 s32768 1.014 / 1.015 (eager 1.002 / 1.007; 16:50 1.016)
    FixedRule((128, 128), False, (1,), (2048, 2048), 256, _SECTIONS),
)


def _by_class(rules: tuple[FixedRule, ...]) -> dict[tuple[int, int, bool], tuple]:
    """(head_dim, head_dim_v, causal) -> its rules as (1 + index, rule), in order."""
    found: dict[tuple[int, int, bool], tuple] = {}
    for i, rule in enumerate(rules, 1):
        key = (*rule.head_dims, rule.causal)
        found[key] = (*found.get(key, ()), (i, rule))
    return found


_RULES_BY_CLASS = _by_class(FIXED_RULES)


def fixed_rule(
    head_dim: int, head_dim_v: int, causal: bool, batch: int, seqlen_q: int, seqlen_k: int,
    heads_q: int, heads_kv: int,
) -> int:  # fmt: skip
    """The fixed-length problem's rule: 1 + its index in FIXED_RULES, 0 where none applies
    (the head dims' default, `default_config`). One dict probe on the launch path."""
    for i, rule in _RULES_BY_CLASS.get((head_dim, head_dim_v, bool(causal)), ()):
        lo, hi = rule.seqlens
        if (
            lo <= seqlen_q <= seqlen_k <= hi
            and heads_q // heads_kv in rule.groups
            and batch * heads_kv >= rule.min_kv_heads
        ):
            return i
    return 0


def rule_config(head_dim: int, head_dim_v: int, rule: int) -> AttnConfig:
    """The config of `fixed_rule`'s answer: the head dims' default with the rule's knobs."""
    cfg = default_config(head_dim, head_dim_v)
    return replace(cfg, **dict(FIXED_RULES[rule - 1].knobs)) if rule else cfg


def choose_config(
    head_dim: int, head_dim_v: int, causal: bool, batch: int, seqlen_q: int, seqlen_k: int,
    heads_q: int, heads_kv: int,
) -> AttnConfig:  # fmt: skip
    """The config a fixed-length problem runs (`fixed_rule`, else the head dims' default)."""
    rule = fixed_rule(head_dim, head_dim_v, causal, batch, seqlen_q, seqlen_k, heads_q, heads_kv)
    return rule_config(head_dim, head_dim_v, rule)


def rule_params(dtype: str, rule: int) -> tuple:
    """The compile key of FIXED_RULES[rule - 1]'s config (a standard build)."""
    r = FIXED_RULES[rule - 1]
    return params_for(dtype, *r.head_dims, r.causal, rule_config(*r.head_dims, rule))


# Head dims of the paged mode (the paged op's) and the page boxes built ahead of time: pages
# of 8 to 128 rows (a page longer than the tile: boxes of tile_n rows).
PAGED_HEAD_DIMS = (64, 128, 256)
PAGE_BOXES = (8, 16, 32, 64, 128)
# The paged mode runs the sequences of at least this many query tokens; those of fewer (decode
# rows beside the chunks of a chunked-prefill batch, speculative tokens) are the paged decode
# kernel's, whose limit is 4 (ops.attention_paged's split form runs it first): the mode's tiles
# skip them, leaving their rows of O and LSE as they are. The packed compiles (params `packed`
# with `view_group`: the whole batch GQA-packed in one launch on views of q / o / lse,
# `launch.attention_paged_fwd(packed=True)`) skip none.
PAGED_MIN_SEQLEN_Q = 5
# The query heads a kv head (G) the packed paged form is built for, where G divides the tile's
# rows (`launch.view_group`). G is baked in: the kernel's TMA views tile the packed rows ((G,
# Tq)) in boxes of (G, tile_m / G) tokens, and the DSL's TMA atom needs that box static (a
# sym_int G fails in make_tiled_tma_atom: "expected ... the CTA V-map to be static", CPU
# 2026-12-04). Other G (3, 5, 6, 7, 12, 32, ...) run the split form, never a compile outside
# the standard set.
VIEW_GROUPS = (1, 2, 4, 8, 16)


# The grid of a static-deal varlen launch, in CTAs a SM (one runs on an SM at a time: the consumers
# take the register file). The kernel deals its tiles statically (CTA c takes tiles c, c + grid,
# ...), longest first by row block, which balances when a row block's tiles cost alike; a chunked
# prefill batch's do not (a tile's key blocks follow its sequence's cached prefix): varlen8 hq32
# chunk256to2048 ran 1.25x the mean load on its busiest SM in a model (blocks + a per-tile cost),
# 0.765x FA4 on the H200. With 4 CTAs a SM the hardware hands the later CTAs to the SMs that free
# first: 1.09 over the mean in the model, and 0.98-1.03 of the one-a-SM time on the dense varlen
# cases. 0: one CTA a tile (FA4's grid, no persistent walk). Fixed length keeps one a SM
# (FIXED_CTAS_PER_SM), and so do dynamic configs (DYNAMIC_CTAS_PER_SM: the counter balances;
# `default_ctas_per_sm`). docs/attention/NOTES.md, "The chunked varlen case at 0.765x".
VARLEN_CTAS_PER_SM = 4
FIXED_CTAS_PER_SM = 1
DYNAMIC_CTAS_PER_SM = 1


def default_ctas_per_sm(cfg: AttnConfig, varlen: bool) -> int:
    """The default grid of a launch of `cfg`, in CTAs a SM (`grid_ctas`)."""
    if cfg.dynamic:
        return DYNAMIC_CTAS_PER_SM
    return VARLEN_CTAS_PER_SM if varlen else FIXED_CTAS_PER_SM


def grid_ctas(num_sms: int, ctas_per_sm: int) -> int:
    """The num_ctas argument of a launch: ctas_per_sm CTAs a SM, or (0) one a tile (the kernel
    launches min(num_ctas, tiles))."""
    if ctas_per_sm < 0:
        raise ValueError(f"ctas_per_sm must be >= 0, got {ctas_per_sm}")
    return num_sms * ctas_per_sm if ctas_per_sm else 2**31 - 1


def page_box_for(page_size: int, tile_n: int) -> int:
    """The TMA box rows for a paged cache of `page_size` rows under key tiles of `tile_n`: the
    page (it divides the tile) or the tile (it divides the page); 0 where neither holds or
    the page is shorter than a swizzle atom's 8 rows (those caches are gathered instead)."""
    box = min(page_size, tile_n)
    if box % 8 or tile_n % box or page_size % box:
        return 0
    return box


def default_config(
    head_dim: int, head_dim_v: int, paged: bool = False, varlen: bool = False
) -> AttnConfig:
    """The default for a head-dim pair (no tuning at call time); `paged`: the paged mode's,
    `varlen` (not paged): the varlen launch's."""
    if paged and (head_dim, head_dim_v) in _PAGED_DEFAULTS:
        return _PAGED_DEFAULTS[(head_dim, head_dim_v)]
    if varlen and not paged and (head_dim, head_dim_v) in _VARLEN_DEFAULTS:
        return _VARLEN_DEFAULTS[(head_dim, head_dim_v)]
    try:
        return _DEFAULTS[(head_dim, head_dim_v)]
    except KeyError:
        raise ValueError(
            f"head dims (D={head_dim}, Dv={head_dim_v}) unsupported; supported: {HEAD_DIMS}"
        ) from None


def params_for(
    dtype: str,
    head_dim: int,
    head_dim_v: int,
    causal: bool,
    cfg: AttnConfig | None = None,
    varlen: bool = False,
    page_box: int = 0,
    packed: bool = False,
    view_group: int = 0,
) -> tuple:
    """The compile key's baked-in part, as a sorted tuple of (name, value). page_box > 0: K
    and V from a paged cache, one TMA box of page_box rows per page of a tile (varlen
    queries; `page_box_for`). packed (paged only, with view_group): the tiles skip no sequence
    (every sequence's GQA group as rows, decode rows included: no PAGED_MIN_SEQLEN_Q);
    a key only when on, so every other key (and its cache entry and SASS) is as before.
    view_group G > 0 (packed or fixed length, G dividing tile_m): q / o / lse read and written
    in place through views of G query heads a kv head (the packed form has no other: its
    compiles are packed with a view_group, VIEW_GROUPS standard; fixed length: the GQA-packed
    candidate, `launch.attention_fwd(pack_gqa=True)`; standard in PACK_CLASSES)."""
    cfg = cfg or default_config(head_dim, head_dim_v, paged=page_box > 0, varlen=varlen)
    if cfg.dynamic and page_box:
        raise ValueError("dynamic tiles are not for the paged mode (its own walk)")
    if packed and not page_box:
        raise ValueError("packed is a form of the paged mode (page_box > 0)")
    key = {
        "dtype": dtype,
        "head_dim": head_dim,
        "head_dim_v": head_dim_v,
        "causal": bool(causal),
        "varlen": bool(varlen) or page_box > 0,
        "page_box": int(page_box),
        **asdict(cfg),
    }
    # The keys (and cache entries) of every config before these knobs: each is in a key only
    # when it is not its default.
    for name, off in (("dynamic", False), ("k_ahead", False), ("wave_kv_mib", 320)):
        if key[name] == off:
            del key[name]
    if cfg.k_ahead and page_box:
        raise ValueError("k_ahead is not for the paged mode (its page boxes)")
    if view_group and (key["varlen"] != packed or cfg.tile_m % view_group):
        raise ValueError(
            f"view_group {view_group}: packed or fixed length, dividing tile_m ({cfg.tile_m})"
        )
    if packed and not view_group:  # the copy form: measured slower, dropped (PAGED_NOTES.md)
        raise ValueError("packed needs a view_group (the packed form runs on views)")
    if packed:
        key["packed"] = True
    if view_group:
        key["view_group"] = int(view_group)
    return tuple(sorted(key.items()))
