"""DeepSeek MLA paged decode, sm_90a (absorbed: 576-wide keys, 512-wide values, one latent row
per token shared by every head; split-KV partial pass + the paged leaf's combine). DSL-free
declaration; the kernels are `decode.py` (the partial pass) and the paged leaf's `combine.py`
(`PagedCombineSm90` at head dim 512); the op is `forgekernel.ops.mla.mla_decode` (issue 19).
The partial pass's sparse mode (kind "sparse") is DeepSeek sparse attention's kernel, op
`forgekernel.ops.dsa.dsa_sparse_attention` (issue 22). `fp8` keys read FlashMLA's FP8 cache
(fp8.py: its bytes by cp.async into their own stage, dequantized there); `tma` keys are
seesaw.py's partial pass (16-bit pages of whole 64-key tiles); `direct` keys a pass's form for a
plan of one split (O and LSE written in place, no combine: the seesaw pass's, decode.py's paged
and sparse ones), `ostore` direct seesaw ones their O through shared memory and bulk copies
(the direct plans of config.OSTORE_BLOCKS where out's rows are 16-byte aligned;
FORGEKERNEL_MLA_OSTORE=0 keeps the scalar stores). (`pair` keys, the head blocks as
clusters of 2 sharing each tile's loads by TMA multicast, still compile but are neither prebuilt
nor launched: measured 2.4-8.8% slower, MLA_NOTES.md.) `worklist` keys (candidates): the seesaw
partial pass reading its (unit, split) from the device-side work list that kind "worklist", the
scheduling kernel (worklist.py; schedule.py its reference), writes. `gather` keys: the seesaw
pass over 16-bit pages that are not whole tiles, each chunk's rows gathered by cp.async onto the
chunk mbarriers (seesaw.py); the launcher's default at page size 1 (prebuilt),
FORGEKERNEL_MLA_GATHER=1 at the other page sizes off the tile. `lean` keys: DSA's
sparse pass over an FP8 cache at 16 heads a CTA (split and one-split plans) and 64 (one-split
plans: the direct pass) (the tile's issue first after the stage's release, per-thread L2
prefetches), `wide` keys its 64-head direct plans' O by 16-byte stores with it: the defaults
there (FORGEKERNEL_MLA_LEAN=0 the form before, `was_params` its keys at the bench's blocks)."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.attention.mla.sm90.config import (
    DTYPES,
    FP8_DTYPE,
    FUSED_HEADS,
    HEADS,
    OSTORE_BLOCKS,
    QTOKENS,
    ROWS,
    direct_blocks,
    heads_per_cta,
    params_for,
    sparse_heads,
    takes_lean,
    takes_wide,
)
from forgekernel.runtime import pdl
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.attention.mla.sm90.compile import compile_mla

    return compile_mla(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every 16-bit partial pass (seesaw.py's for whole-tile pages and, in its gather form, page
    size 1; decode.py's for the others),
    the same heads x tokens over FlashMLA's FP8 cache (bf16 queries), each of these passes'
    direct form for the served head blocks (`config.direct_blocks`), the sparse passes and
    their direct forms (`sparse_keys`), and the combines."""
    passes = [(d, False, tma) for d in DTYPES for tma in (True, False)] + [(FP8_DTYPE, True, False)]
    partial = [
        params_for("partial", dtype, h, qt, fp8, tma)
        for dtype, fp8, tma in passes
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= ROWS
    ]
    direct = [
        params_for("partial", dtype, h, qt, fp8, tma, direct=True)
        for dtype, fp8, tma in passes
        for h, qt in direct_blocks()
    ]
    sparse = [
        key
        for d, fp8, tma in passes
        if not tma
        for h in sparse_heads()
        for direct in (False, True)
        for key in sparse_keys(d, h, fp8, direct)
    ]
    ostore = [
        params_for("partial", dtype, h, qt, tma=True, direct=True, ostore=True)
        for dtype in DTYPES
        for h, qt in OSTORE_BLOCKS
    ]
    combine = [params_for("combine", d, warps=w) for d in DTYPES for w in (False, True)]
    return (partial + direct + sparse + ostore + gather_params() + combine + _schedule_params()
            + _dsa_params())  # fmt: skip


def sparse_keys(
    dtype: str, heads: int, fp8: bool, direct: bool, sink: bool = False
) -> list[Params]:
    """The prebuilt compiles of DSA's sparse pass at one block: over an FP8 cache where
    `takes_lean` (16 heads, split and direct; 64 direct) the `lean` form, its direct plans at
    `takes_wide`'s blocks (64) also `wide` (out's rows 16-byte aligned) beside the scalar stores
    (other outs); elsewhere (the 64-head partial pass too) the plain form."""
    lean = fp8 and takes_lean(heads, direct)
    keys = [params_for("sparse", dtype, heads, fp8=fp8, direct=direct, sink=sink, lean=lean)]
    if lean and direct and takes_wide(heads):
        keys.append(params_for("sparse", dtype, heads, fp8=True, direct=True, sink=sink,
                               lean=True, wide=True))  # fmt: skip
    return keys


def _dsa_params() -> list[Params]:
    """The sparse direct pass's sink form (`sink`: every block and cache of the sparse direct
    forms) and the fused DSA prefill's (`fused`: the blocks of SPARSE_HQ and of 64 heads
    (FUSED_HEADS: 16 / 64 / 128 heads), with and without a sink, fp32 [cos | sin] caches, int32
    and int64 positions, over 16-bit kv in both dtypes and over FlashMLA's FP8 cache with bf16
    q (`fp8` too: keys of their own, the 16-bit ones unchanged); a cache in q's dtype or NeoX
    pairs compile at their first call)."""
    passes = [(d, False) for d in DTYPES] + [(FP8_DTYPE, True)]
    sink = [key for d, fp8 in passes for h in sparse_heads()
            for key in sparse_keys(d, h, fp8, True, sink=True)]  # fmt: skip
    fused = [
        params_for(
            "sparse", d, h, fp8=fp8, direct=True, sink=s, fused=True, rope="float32", positions=p
        )  # fmt: skip
        for d, fp8 in passes
        for h in FUSED_HEADS
        for s in (False, True)
        for p in ("int32", "int64")
    ]
    return sink + fused


def _schedule_params() -> list[Params]:
    """A decode step's schedule (`forgekernel.mla_decode_schedule`, launch.make_schedule): the
    scheduling kernel's ranges form at every query-token block, the ranges pass at every seesaw
    block, the ranges combine (prebuilt: a schedule's first call compiles nothing)."""
    passes = [
        params_for("partial", dtype, h, qt, tma=True, worklist=True, ranges=True)
        for dtype in DTYPES
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= ROWS
    ]
    lists = [params_for("worklist", "bfloat16", qtokens=qt, ranges=True) for qt in QTOKENS]
    combines = [
        params_for("combine", d, ranges=True, warps=w) for d in DTYPES for w in (False, True)
    ]
    return passes + lists + combines


# The device-side work list (candidate, FORGEKERNEL_MLA_WORKLIST=1; schedule.py, worklist.py): its
# pass at the bench's and the GPU tests' blocks (16 / 128 heads, MTP 2, 4), its scheduling kernels
WORKLIST_BLOCKS = ((16, 1), (64, 1), (16, 2), (32, 2), (16, 4))


def gather_params() -> list[Params]:
    """The seesaw pass's gather form (16-bit pages off the tile; the launcher's default at page
    size 1, `launch.GATHER_PAGES`): the seesaw keys' blocks with `gather`: every partial block,
    the direct blocks (`config.direct_blocks`), the `ostore` direct ones (OSTORE_BLOCKS), both
    dtypes (any of them can get a page-1 plan: prebuilt, a first call compiles nothing)."""
    partial = [
        params_for("partial", dtype, h, qt, tma=True, gather=True)
        for dtype in DTYPES
        for qt in QTOKENS
        for h in HEADS
        if h * qt <= ROWS
    ]
    direct = [
        params_for("partial", dtype, h, qt, tma=True, direct=True, gather=True)
        for dtype in DTYPES
        for h, qt in direct_blocks()
    ]
    ostore = [
        params_for("partial", dtype, h, qt, tma=True, direct=True, ostore=True, gather=True)
        for dtype in DTYPES
        for h, qt in OSTORE_BLOCKS
    ]
    return partial + direct + ostore


# The blocks the dsa_sparse bench's FP8 cases run (16 heads a CTA: t1 .. t64 split, t128 one
# split; 64: t64-h128, one split), (heads, direct)
WAS_BLOCKS = ((16, False), (16, True), (64, True))


def was_params() -> list[Params]:
    """The form before `lean` / `wide` at the bench's FP8 blocks (`build --candidates`): the
    bench's variant `was`, `plan_form(lean=False)`."""
    return [params_for("sparse", FP8_DTYPE, h, fp8=True, direct=d) for h, d in WAS_BLOCKS]


def wide_params() -> list[Params]:
    """The lean direct pass's `wide` form at 16 heads a CTA (not taken by default: a tie there,
    0.991), `plan_form(wide=True)`'s key at t128-h16 (the bench's variant `wide`); and `wide`
    without `lean` at the bench's direct blocks (16, 64), plan_form(wide=True)'s key with lean
    off (plan_form(lean=False) or FORGEKERNEL_MLA_LEAN=0), prebuilt rather than compiled at
    the call."""
    lean_wide = [params_for("sparse", FP8_DTYPE, 16, fp8=True, direct=True, lean=True, wide=True)]
    return lean_wide + [
        params_for("sparse", FP8_DTYPE, h, fp8=True, direct=True, wide=True)
        for h, direct in WAS_BLOCKS
        if direct
    ]


def _candidate_params() -> list[Params]:
    """The per-call work list's pass and scheduling kernels (`build --candidates`), the
    builds without PDL of the bench's variant `no_pdl` (`no_pdl_params`), DSA's FP8 form before
    `lean` (`was_params`) and its `wide` forms not taken by default (`wide_params`)."""
    passes = [
        params_for("partial", dtype, h, qt, tma=True, worklist=True)
        for dtype in DTYPES
        for h, qt in WORKLIST_BLOCKS
    ]
    lists = [params_for("worklist", "bfloat16", qtokens=qt) for qt in QTOKENS]
    return passes + lists + no_pdl_params() + was_params() + wide_params()


def no_pdl_params() -> list[Params]:
    """The kernels of the bench's variant `no_pdl` (bf16, one query token, 16 and 128 heads: the
    seesaw pass of 16 and 64 heads a CTA and the combine, each in its plain and its ranges form
    (the bench's calls take a decode step's schedule), the ranges scheduling kernel) built
    without PDL (compile key pdl "off", runtime/pdl.py)."""
    blocks = [heads_per_cta(hq) for hq in (16, 128)]
    passes = [params_for("partial", "bfloat16", h, tma=True) for h in blocks]
    ranged = [params_for("partial", "bfloat16", h, tma=True, worklist=True, ranges=True)
              for h in blocks]  # fmt: skip
    rest = [params_for("combine", "bfloat16", ranges=r) for r in (False, True)]
    rest.append(params_for("worklist", "bfloat16", qtokens=1, ranges=True))
    return [pdl.key(p, False) for p in (*passes, *ranged, *rest)]


SPEC = KernelSpec(
    name="mla_decode_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
    mma=False,  # as the paged leaf's; True once decode.py's MMAs are WGMMA (the build checks)
    representative=lambda: params_for("partial", "bfloat16", 16, tma=True),
)

__all__ = ["SPEC", "params_for"]
