"""Host launchers of the MLA paged decode and of DeepSeek sparse attention (DSA, the partial
pass's sparse mode): torch only (no DSL), the partial pass and the paged leaf's combine
(compiled under this leaf's SPEC) through the compile cache. Callers validate first
(`forgekernel.ops.mla`, `forgekernel.ops.dsa`). FlashMLA's FP8 cache comes as its three views
(`ckv_cache` uint8 latent bytes, `kpe_cache` bf16 RoPE, `ckv_scale` fp32 (num_pages, page_size,
4)) and runs the `fp8` compile of the partial pass; 16-bit caches pass ckv_scale None.

16-bit paged caches whose page size is a multiple of TILE run the seesaw pass (`tma` compile keys,
seesaw.py); FORGEKERNEL_MLA_SCHEDULE=roles (read when a problem's plan is first built) keeps them
on decode.py's role-split pass, the design the seesaw replaces, for side-by-side timing.
16-bit caches of page size 1 (`GATHER_PAGES`: SGLang's FlashInfer MLA backend's, FlashInfer-Bench's
page-1 cases) run the seesaw pass too, in its `gather` form (each chunk's rows gathered by cp.async
onto the chunk mbarriers, a proxy fence after each wait: MLA_NOTES.md, "The seesaw over gathered
rows", "gather adopted"; 0.959 / 0.640 of decode.py's role-split pass's time at b64-h16 / b16-h128
x 4k, H100 2026-12-05 16:44), without the work list (no list is made for them). Other page sizes
off the tile (16, 32, ...; not measured) keep decode.py's role-split pass unless
FORGEKERNEL_MLA_GATHER=1 or `plan_form(gather=True)`; FORGEKERNEL_MLA_GATHER=0 or
`plan_form(gather=False)` keeps page 1 on decode.py's pass too (read when a problem's plan is
first built; the bench's `was`). Without PDL (FORGEKERNEL_PDL=0, `pdl.off()`) the rule keeps
page 1 on decode.py's pass as well (its keys prebuilt; the gather keys are PDL builds only),
unless the switch or plan_form asks for gather. FP8 caches keep decode.py's pass at every page
size.

A plan of one split (`config.runs_direct`: every (sequence, head block) in one CTA; the
serving batches of 128+ head blocks, short sequences; DSA from 128 tokens at 16 heads, 64 at
128, every prefill) runs its pass's direct form: one launch writing out and lse itself, no fp32
partials allocated, no combine: the seesaw pass's, decode.py's paged pass's (pages of partial
tiles, FP8 caches) and DSA's sparse pass's (decode.py). FORGEKERNEL_MLA_DIRECT=0 (read when a
problem's plan is first built) keeps such plans on the partial pass and the combine, for
side-by-side timing and the GPU tests' comparison (the same bits).

FP8 caches' bytes go by cp.async into their own stage and are dequantized there in place a turn
later (decode.py; 0.873-0.943x the register form's time on dsa_sparse's FP8 cases, H200
2026-12-03 06:21, which was then dropped: MLA_NOTES.md). DSA's sparse pass over an FP8 cache
takes its `lean` compile (the tile's issue first after the stage's release, the L2 prefetch by
per-thread lines behind it) on the plans measured, `config.takes_lean`: 16 heads a CTA split and
one-split, 64 one-split (direct) only; and its direct plans
at config.WIDE_HEADS (64) the `wide` compile with it (O staged, 16-byte stores) where out's rows
are 16-byte aligned (the scalar stores elsewhere): 0.78-0.87x the form before's time, 0.776x at
t64-h128 with wide (H100 2026-12-05; MLA_NOTES.md, "lean and lean_wide adopted").
FORGEKERNEL_MLA_LEAN=0 (read when a problem's plan is first built) or `plan_form(lean=False)`
keeps the form before (neither), for side-by-side timing (the bench's `was`) and the GPU tests'
comparison (the same bits).

`plan_form` fixes a plan's tiles per split and / or heads per CTA for the calls inside, or keeps
a one-split plan off the direct form (keyed apart): launcher-only candidates, timed by the
bench's variants beside the standard plan (MLA_NOTES.md, "Measured 2026-12-03 16:40"). (The
`pair` form, clusters of 2 head blocks sharing each tile's loads by TMA multicast, was measured
2.4-8.8% slower on every case it ran and lost its knob; its compile path stays in seesaw.py /
config.py, the kernel sources, until their next edit.)

Direct plans of `config.OSTORE_BLOCKS` (16 x 1; 64 x 1, 32 x 2: the 128-head blocks) run their
`ostore` compile, O staged in bf16 / fp16 over the K buffers and sent by bulk copies, a row each
(MLA_NOTES.md, "The direct form's O store"; 0.888-0.948x the scalar stores' time on the H200's
128-head direct cases, "ostore adopted", then by 16-byte stores; the bulk copies and the 16 x 1
block: "next/mla-ur"), where out's rows are 16-byte aligned (checked per call on those plans
only; others take the direct form's scalar stores). FORGEKERNEL_MLA_OSTORE=0 (read
when a problem's plan is first built) keeps them on the scalar stores, for side-by-side timing and
the GPU tests' comparison (the same bits).

FORGEKERNEL_MLA_WORKLIST=1 (read when a problem's plan is first built) or
`plan_form(worklist=True)` (candidate): seesaw plans of more than one split take a device-side
work list: the scheduling kernel (worklist.py, one CTA) reads seqlens_k on the device, sizes the
tiles per split by the lengths (schedule.py) and lists the (unit, split) items with keys, within
the width plan's splits and grid; the pass's `worklist` compile takes its item from the list,
the combine is unchanged (the list's kernel fills the partial LSEs with -inf first). One launch
more, no host read: graph-safe (MLA_NOTES.md, "A device-side work list for ragged batches").

Programmatic dependent launch (runtime/pdl.py; unless FORGEKERNEL_PDL=0 or inside `pdl.off()`,
read when a problem's plan is first built): the seesaw pass (every form), the scheduling kernel
and the combine launch as dependents of the kernel before them, each waiting for it before its
first global access (common/sm90/pdl.py); decode.py's passes (FP8 caches, pages of partial
tiles, DSA) launch as before, their combine still a dependent.

A decode step's schedule (`make_schedule`, `forgekernel.mla_decode_schedule`): the scheduling
kernel's `ranges` form, launched once a step, its list read by every layer's call (form
SCHEDULED, keyed apart; no scheduling kernel in the call): no bound from the width plan's splits
(the per over the whole batch's tiles, the list's capacity slots + units items), the pass's
`ranges` compile writing its partial at its item ((items, qtokens, Hq, 512) scratch), the
combine's `ranges` compile reducing each query row's item range. Taken where the width plan
splits (a plan of one split keeps its direct form; the list is then empty). MLA_NOTES.md, "A
decode step's schedule, built"."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from forgekernel.kernels.attention.mla.sm90 import SPEC, config, schedule
from forgekernel.kernels.attention.paged.sm90 import combine_form
from forgekernel.kernels.attention.paged.sm90.combine_form import forced_key
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime import pdl
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device
from forgekernel.runtime.plans import PlanCache, overriding
from forgekernel.runtime.scratch import scratch, scratches

_plans = PlanCache()
# `plan_form`'s (tiles per split or None, heads per CTA or None, work list, direct form, gather
# form or None, lean, wide), else None (in plan keys)
_Form = tuple[int | None, int | None, bool, bool, bool | None, bool | None, bool | None]
_plan_form: list[_Form | None] = [None]


def _flag(env: str, default: str) -> bool:
    """A launcher switch: the environment variable `env`, "0" or "1" (`default` when unset)."""
    flag = os.environ.get(env, default)
    if flag not in ("0", "1"):
        raise ValueError(f"{env} must be '0' or '1', got {flag!r}")
    return flag == "1"


def seesaw_enabled() -> bool:
    """The seesaw pass serves 16-bit paged caches of whole-tile pages (unless
    FORGEKERNEL_MLA_SCHEDULE=roles)."""
    schedule = os.environ.get("FORGEKERNEL_MLA_SCHEDULE", "seesaw")
    if schedule not in ("seesaw", "roles"):
        raise ValueError(f"FORGEKERNEL_MLA_SCHEDULE must be 'seesaw' or 'roles', got {schedule!r}")
    return schedule == "seesaw"


def direct_enabled() -> bool:
    """Plans of one split run their pass's direct form (unless FORGEKERNEL_MLA_DIRECT=0)."""
    return _flag("FORGEKERNEL_MLA_DIRECT", "1")


def worklist_enabled() -> bool:
    """Seesaw plans of more than one split take the device-side work list (candidate, only with
    FORGEKERNEL_MLA_WORKLIST=1, read when a problem's plan is first built)."""
    return _flag("FORGEKERNEL_MLA_WORKLIST", "0")


# page sizes whose 16-bit caches take the seesaw pass's gather form by default: the measured ones
# (MLA_NOTES.md, "gather adopted"); FORGEKERNEL_MLA_GATHER / plan_form(gather=) override
GATHER_PAGES = (1,)
GATHER_MODES = {"0": False, "1": True}


def gather_mode() -> bool | None:
    """FORGEKERNEL_MLA_GATHER, read when a problem's plan is first built: "1" every 16-bit page
    size off the tile takes the seesaw pass's `gather` form, "0" none does (decode.py's pass);
    unset None: `GATHER_PAGES` do (with PDL, `takes_gather`)."""
    flag = os.environ.get("FORGEKERNEL_MLA_GATHER")
    if flag is None:
        return None
    if flag == "unfenced":  # valid until 2026-12-05: say so rather than only what is valid
        raise ValueError(
            "FORGEKERNEL_MLA_GATHER=unfenced was removed on 2026-12-05; use 0 or 1 (the build "
            "without the proxy fences was dropped: MLA_NOTES.md, 'gather adopted')"
        )
    if flag not in GATHER_MODES:
        raise ValueError(f"FORGEKERNEL_MLA_GATHER must be '0' or '1', got {flag!r}")
    return GATHER_MODES[flag]


def lean_enabled() -> bool:
    """DSA's sparse FP8 plans take the adopted forms, `lean` where `config.takes_lean` and `wide`
    with it at config.WIDE_HEADS' direct plans (unless FORGEKERNEL_MLA_LEAN=0: the form before),
    read when a problem's plan is first built."""
    return _flag("FORGEKERNEL_MLA_LEAN", "1")


def _form_field(form, i: int) -> bool | None:
    """`plan_form`'s field i, None where it is unset (no form; SCHEDULED, a paged form, has
    five fields)."""
    return form[i] if form is not None and len(form) > i else None


def _lean(kind: str, fp8: bool, heads: int, form, direct: bool) -> bool:
    """Whether a plan's pass is the `lean` compile: the sparse pass over an FP8 cache where
    `config.takes_lean` (its blocks; `direct`: a one-split plan's direct pass, else a split
    plan's partial pass; unless FORGEKERNEL_MLA_LEAN=0), or as `plan_form(lean=...)` says (True:
    any block and plan, compiled at the call off the prebuilt ones; False: the form before)."""
    if not (kind == "sparse" and fp8):
        return False
    wanted = _form_field(form, 5)
    if wanted is not None:
        return wanted
    return lean_enabled() and config.takes_lean(heads, direct)


def _wide(kind: str, fp8: bool, heads: int, form) -> bool:
    """Whether a sparse direct plan takes the `wide` compile (O staged, 16-byte stores; out's
    rows 16-byte aligned: the caller checks, `_wide_rows`): with `lean` over an FP8 cache at
    `config.takes_wide`'s blocks, or as `plan_form(wide=...)` says (True: any sparse direct plan,
    16-bit caches too; over an FP8 cache with lean off, FORGEKERNEL_MLA_LEAN=0 or
    plan_form(lean=False), the wide key without lean: a candidate at the bench's direct blocks,
    `wide_params`)."""
    if kind != "sparse":
        return False
    wanted = _form_field(form, 6)
    if wanted is not None:
        return wanted
    return _lean(kind, fp8, heads, form, True) and config.takes_wide(heads)


def takes_gather(page_size: int, wanted: bool | None, on: bool = True) -> bool:
    """Whether a 16-bit cache of `page_size` (not a multiple of TILE) takes the gather form:
    `wanted` (plan_form's, else FORGEKERNEL_MLA_GATHER's), else the rule: `GATHER_PAGES` with
    PDL on (`on`). Without PDL the rule keeps decode.py's pass, whose keys are prebuilt: the
    gather keys are built with PDL only (a `pdl: off` one would compile at the first call)."""
    if wanted is not None:
        return wanted
    return on and page_size in GATHER_PAGES


def ostore_enabled() -> bool:
    """Direct plans of the OSTORE_BLOCKS take the `ostore` compile where out's rows are 16-byte
    aligned (unless FORGEKERNEL_MLA_OSTORE=0)."""
    return _flag("FORGEKERNEL_MLA_OSTORE", "1")


@contextmanager
def plan_form(
    per_tiles: int | None = None,
    heads: int | None = None,
    worklist: bool = False,
    direct: bool = True,
    gather: bool | None = None,
    lean: bool | None = None,
    wide: bool | None = None,
) -> Iterator[None]:
    """The calls inside take `per_tiles` tiles per split (seesaw plans: 16-bit caches of
    whole-tile pages; DSA's sparse plans: TILE top-k positions a tile) and / or `heads` query
    heads per CTA (a compiled HEADS dividing Hq with
    heads x tokens <= ROWS) instead of the plan's choice, their plans keyed apart: the bench's
    launcher-only variants, timed beside the standard plan in one process. worklist: seesaw
    plans of more than one split take the device-side work list (as FORGEKERNEL_MLA_WORKLIST=1;
    not with per_tiles: the list sizes its splits itself). direct False: a plan of one split
    keeps the partial pass and the combine (as FORGEKERNEL_MLA_DIRECT=0, keyed apart: the
    bench's A/B of the direct forms in one process). gather: 16-bit caches whose pages are not
    whole tiles take the seesaw pass's `gather` form at every such page size (True, as
    FORGEKERNEL_MLA_GATHER=1) or at none (False, decode.py's pass: the bench's `was`); None
    the environment's, else the rule's (`takes_gather`). lean (None: the default, `_lean`):
    DSA's sparse pass over an FP8 cache takes its `lean` compile at every block (True) or at
    none (False: the form before, as FORGEKERNEL_MLA_LEAN=0, with no `wide` unless asked; the
    bench's `was`); other calls ignore it. wide (None: the default, `_wide`): DSA's sparse direct
    plans take the `wide` compile (O staged in shared memory, 16-byte stores) where out's rows
    are 16-byte aligned (the scalar stores elsewhere; True), or never (False)."""
    if lean not in (None, False, True):
        raise ValueError(f"lean must be None, False or True, got {lean!r}")
    if wide not in (None, False, True):
        raise ValueError(f"wide must be None, False or True, got {wide!r}")
    if gather not in (None, False, True):
        raise ValueError(f"gather must be None, False or True, got {gather!r}")
    if worklist and per_tiles is not None:
        raise ValueError("the work list sizes its splits itself: no per_tiles with worklist")
    if heads is not None and heads not in config.HEADS:
        raise ValueError(f"heads must be one of {config.HEADS}, got {heads}")
    if per_tiles is not None and per_tiles < 1:
        raise ValueError(f"per_tiles must be >= 1, got {per_tiles}")
    with overriding(_plan_form, (per_tiles, heads, worklist, direct, gather, lean, wide)):
        yield


def _heads(hq: int, qtokens: int, form) -> int:
    """Heads per CTA: `plan_form`'s where it gives a block that fits, else the plan's."""
    heads = config.heads_per_cta(hq, qtokens)
    if form is not None and form[1] is not None:
        if hq % form[1] or form[1] * qtokens > config.ROWS:
            raise ValueError(f"plan_form heads {form[1]}: not a block of {hq} x {qtokens} rows")
        heads = form[1]
    return heads


def _wide_rows(out: torch.Tensor) -> bool:
    """out's rows of 512 start 16-byte aligned (base and both outer strides): the `ostore`
    compile's contract (its bulk copies), and the sparse `wide` one's (its 16-byte stores)."""
    vec = 16 // out.element_size()
    return out.data_ptr() % 16 == 0 and out.stride(0) % vec == 0 and out.stride(1) % vec == 0


def _combine(name: str, on: bool, units: int, ranges: bool = False):
    """The combine kernel for `units` (rows x heads, a bound): its warp form where
    `combine_form.takes_warps` says, else its CTA form (both called alike)."""
    warps = combine_form.takes_warps(units, config.D_LATENT)
    return get_kernel(SPEC, pdl.key(config.params_for("combine", name, ranges=ranges, warps=warps),
                                    on))  # fmt: skip


def sparse_split_plan(
    tokens: int, head_blocks: int, topk: int, sms: int, resident: int
) -> tuple[int, int]:
    """DSA's split plan (kind "sparse"): (splits, top-k positions a split) in whole tiles, by
    `config.tile_split_plan`'s makespan (waves x (tiles + SPLIT_OVERHEAD_TILES), ties to fewer
    splits) but with splits as short as one tile: a sparse split gathers its rows one by one
    whatever its length, so the paged bound (MIN_TOKENS_PER_SPLIT) only costs parallelism. One
    token ran 8 splits of 4 tiles (the paged bound: 8 CTAs for the whole call) in 24.6 us, 16
    of 2 in 16.1, 32 of 1 in 13.1 (FlashMLA FP8 18.0; H200 2026-12-04 17:35), as the model has
    it (6 : 4 : 3). From 16 tokens at 16 heads the plan is the bound's (t16 8 splits, t64 2,
    t128 1; 2 tiles a split at t16 ran 1.121x the time, 2 splits at t128 1.038x)."""
    return config.tile_split_plan(tokens, head_blocks, topk, sms, resident, least=config.TILE)


def _plan(
    kind, dtype, units, hq, max_tokens, qtokens, device_index, fp8, page_size, form=None,
    forced=None, narrow=False, sink=False,
):  # fmt: skip
    """(pass kernel, combine kernel or None, splits, keys per split (the pass's per_split: of
    a split plan the least keys a split takes), ostore, work list or None): kind "partial"
    (units = sequences, max_tokens their bound) or "sparse" (units = query tokens, max_tokens
    the top-k width), over an FP8 cache if fp8; the paged leaf's split plan over units x head
    blocks (the seesaw pass's in whole tiles). Combine None: the pass's direct form (one split,
    out and lse written by the pass; the seesaw pass's or decode.py's, paged or sparse). ostore:
    the pass is the `ostore` compile, whose out
    must have its rows 16-byte aligned (`_wide_rows`: the caller checks, and takes the plan
    built with narrow, the direct form's scalar stores, where they are not). The kernels are
    looked up here, once per problem (two compile-cache lookups cost 0.8 us a call on the CPU).
    form: `plan_form`'s (tiles per split, heads per CTA, work list, direct form), the first two
    None for the plan's.
    Work list (`plan_form(worklist=True)` or FORGEKERNEL_MLA_WORKLIST=1; seesaw plans of more
    than one split): (scheduling kernel, head blocks, fewest tiles a split, CTAs a wave, the
    table's width in tiles), the
    pass its `worklist` compile, splits the width plan's (the list's bound: schedule.py); form
    SCHEDULED (a schedule's call): the scheduler, the pass and the combine in their `ranges`
    compiles. sink (kind "sparse"): a direct plan takes the pass's `sink` compile (the caller
    passes attn_sink in seqlens_k's slot); other plans ignore it (the caller applies the sink
    after the combine). forced: `forced_key()`, in the key only (`pdl.enabled()` decides the seesaw,
    scheduling and combine kernels' compile keys, `pdl.key`; `combine_form.takes_warps` the
    combine's form over units x qtokens rows x Hq)."""
    name = dtype_name(dtype)
    on = pdl.enabled()
    heads = _heads(hq, qtokens, form)
    tma = kind == "partial" and not fp8 and page_size % config.TILE == 0 and seesaw_enabled()
    # the gather form: the seesaw over pages that are not whole tiles (page 1 by the rule)
    asked = gather_mode() if form is None or form[4] is None else form[4]
    gather = kind == "partial" and not fp8 and not tma and seesaw_enabled()
    gather = gather and takes_gather(page_size, asked, on)
    tma = tma or gather
    if (tma or kind == "sparse") and form is not None and form[0] is not None:
        tiles = max(1, -(-max_tokens // config.TILE))
        per_tiles = min(form[0], tiles)
        splits, per = -(-tiles // per_tiles), per_tiles * config.TILE
    else:
        if tma:
            plan = config.tile_split_plan
        else:
            plan = sparse_split_plan if kind == "sparse" else config.split_plan
        splits, per = plan(units, hq // heads, max_tokens, num_sms(device_index), config.RESIDENT)
    direct = direct_enabled() and (form is None or form[3])
    if config.runs_direct(splits, heads, qtokens, kind == "sparse") and direct:
        # (decode.py's passes have no PDL build: their key as the partial pass's)
        ostore = tma and not narrow and config.runs_ostore(heads, qtokens) and ostore_enabled()
        wide = not narrow and _wide(kind, fp8, heads, form)
        params = config.params_for(kind, name, heads, qtokens, fp8, tma, direct=True,
                                   ostore=ostore, sink=sink, gather=gather,
                                   lean=_lean(kind, fp8, heads, form, True), wide=wide)  # fmt: skip
        kernel = get_kernel(SPEC, pdl.key(params, on or not tma))
        return kernel, None, splits, per, ostore or wide, None
    if kind == "partial" and (form is None or form[0] is None):
        # the passes spread each unit's own keys over the splits (decode.py, seesaw.py), at
        # least this many a split: the width's per would leave a short sequence in a table
        # sized for a long context (a serving engine's captured graph) in one split
        per = min(per, config.MIN_TOKENS_PER_SPLIT)
    wanted = worklist_enabled() if form is None else form[2] or worklist_enabled()
    if tma and not gather and splits > 1 and wanted and (form is None or form[0] is None):
        sms = num_sms(device_index)
        tiles = max(1, -(-max_tokens // config.TILE))
        fewest = min(tiles, max(1, config.MIN_TOKENS_PER_SPLIT // config.TILE))
        ranges = form is not None and form[2] == RANGES  # a decode step's schedule
        params = config.params_for("worklist", name, qtokens=qtokens, ranges=ranges)
        sched = get_kernel(SPEC, pdl.key(params, on))
        params = config.params_for(kind, name, heads, qtokens, tma=tma, worklist=True,
                                   ranges=ranges)  # fmt: skip
        partial = get_kernel(SPEC, pdl.key(params, on))
        combine = _combine(name, on, units * qtokens * hq, ranges=ranges)
        worklist = (sched, hq // heads, fewest, sms * config.RESIDENT, tiles)
        return partial, combine, splits, per, False, worklist
    combine = _combine(name, on, units * qtokens * hq)
    params = config.params_for(kind, name, heads, qtokens, fp8, tma, gather=gather,
                               lean=_lean(kind, fp8, heads, form, False))  # fmt: skip
    partial = get_kernel(SPEC, pdl.key(params, on or not tma))  # decode.py's: no PDL build
    return partial, combine, splits, per, False, None


def _partials(splits: int, rows: int, hq: int, device: torch.device):
    """The partial pass's fp32 (splits, rows, Hq, 512) outputs and (splits, rows, Hq) LSEs,
    which the combine reduces into out / lse: the current stream's scratch (runtime/scratch.py;
    two CUDA allocations a call before), both from one lookup. Each contiguous from a 16-byte
    boundary: the seesaw pass sends each 2 KB row of O by one bulk copy, which needs its address
    16-byte aligned."""
    shapes = ((splits, rows, hq, config.D_LATENT), (splits, rows, hq))
    return scratches("mla.partials", shapes, torch.float32, device)


def _schedule(worklist, seq, cu, causal, units, q_blocks, splits, outs) -> torch.Tensor:
    """The scheduling kernel's launch (schedule.py, worklist.py): the work list of this call (the
    stream's scratch, capacity units x splits) from seqlens_k / cu_seqlens_q on the device, and
    the partial LSEs filled with -inf; returns the list for the pass."""
    sched, blocks, fewest, slots, width = worklist
    rows = schedule.capacity(units, splits) + schedule.HEADER
    work = scratch("mla.worklist", (rows, 2), torch.int32, seq.device)
    sched(seq, cu, int(causal), q_blocks, blocks, splits, fewest, slots, width, work,
          outs[1].view(-1))  # fmt: skip
    return work


# the plan form of a call that brings a schedule (`make_schedule`): the work list's ranges form
# (items with their own partials, no bound from the width plan's splits), keyed apart
RANGES = "ranges"
SCHEDULED = (None, None, RANGES, True, None)


def schedule_key(dtype, batch, hq, max_tokens, max_seqlen_q, packed, device_index, page_size):
    """The plan key of a scheduled problem (as `mla_decode` builds it, form SCHEDULED) and its
    (query tokens per CTA, query blocks)."""
    qtokens = query_tokens(packed, max_seqlen_q, hq)
    q_blocks = -(-max_seqlen_q // qtokens) if packed else 1
    key = ("partial", dtype, batch * q_blocks, hq, max_tokens, qtokens, device_index, False,
           page_size, SCHEDULED, forced_key())  # fmt: skip
    return key, qtokens, q_blocks


def schedule_shapes(batch, hq, max_pages, page_size, max_seqlen_q, packed, device_index):
    """The shapes of `make_schedule`'s (list, row ranges), from the shapes alone (its fake, for
    tracing): the list's rows where the plan takes one (the seesaw pass, a width plan of more
    than one split), else (0, 2) and (0, 3)."""
    qtokens = query_tokens(packed, max_seqlen_q, hq)
    units = batch * (-(-max_seqlen_q // qtokens) if packed else 1)
    heads = config.heads_per_cta(hq, qtokens) if hq else 1
    tma = page_size % config.TILE == 0 and seesaw_enabled()
    sms = num_sms(device_index)
    splits, _ = config.tile_split_plan(units, max(hq // heads, 1), max_pages * page_size, sms,
                                       config.RESIDENT)  # fmt: skip
    # one unit (b1, its query tokens in one row block): the width plan spreads its keys over
    # every split already, and the list's dependent reads cost (plain 0.956x of the scheduled
    # time at b1 x 16k, H200 2026-12-04 15:50): no list, the call keeps its plan
    if not tma or splits == 1 or units <= 1 or hq == 0:
        return (0, 2), (0, 3)
    cap = schedule.ranged_capacity(units, sms * config.RESIDENT)
    return (cap + schedule.HEADER, 2), (batch * (max_seqlen_q if packed else 1), 3)


def make_schedule(
    seqlens_k: torch.Tensor,
    hq: int,
    max_pages: int,
    page_size: int,
    dtype: torch.dtype,
    cu_seqlens_q: torch.Tensor | None,
    max_seqlen_q: int,
    causal: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The work list of a decode step (`forgekernel.mla_decode_schedule`): one launch of the
    scheduling kernel's `ranges` form (worklist.py, schedule.py's `ranged_plan`) on the current
    stream, no host read: (list int32 (capacity + HEADER, 2), each query row's (first item,
    items, query token) int32 (rows', 3)), tensors of its own (not the stream's scratch: every
    layer's call reads them). A plan that takes no list (one split, or not the seesaw pass)
    gives (0, 2) and (0, 3): the call keeps its plan."""
    device = seqlens_k.device
    b = seqlens_k.shape[0]
    packed = cu_seqlens_q is not None
    key, _, q_blocks = schedule_key(dtype, b, hq, max_pages * page_size, max_seqlen_q, packed,
                                    device.index, page_size)  # fmt: skip
    work_shape, rows_shape = schedule_shapes(b, hq, max_pages, page_size, max_seqlen_q, packed,
                                             device.index)  # fmt: skip
    work = torch.empty(work_shape, dtype=torch.int32, device=device)
    rows = torch.empty(rows_shape, dtype=torch.int32, device=device)
    if work_shape[0] == 0:
        return work, rows
    _, _, splits, _, _, worklist = _plans.get_or_build(key, _plan)
    sched, blocks, fewest, slots, width = worklist
    cu = None if cu_seqlens_q is None else cu_seqlens_q.contiguous()
    with on_device(device):
        sched(seqlens_k.contiguous(), cu, int(causal), q_blocks, blocks, splits, fewest, slots,
              width, work, rows)  # fmt: skip
    return work, rows


def query_tokens(packed: bool, max_seqlen_q: int, hq: int) -> int:
    """The compiled query tokens per CTA: 1 for one query per sequence (rows = B); else the
    fewest of QTOKENS >= max(max_seqlen_q, 2) (packed rows need cu_seqlens_q even when every
    sequence brings at most one: some may bring none), or, for longer sequences (prefill, in
    blocks of that many tokens), the most that fill the most of the CTA's rows."""
    if not packed:
        return 1
    if max_seqlen_q <= config.QTOKENS[-1]:
        return next(t for t in config.QTOKENS if t >= max(max_seqlen_q, 2))
    fill = {t: t * config.heads_per_cta(hq, t) for t in config.QTOKENS if t > 1}
    return max(fill, key=lambda t: (fill[t], t))


def mla_decode(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int = 1,
    causal: bool = True,
    ckv_scale: torch.Tensor | None = None,
    scheduled: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out (rows, Hq, 512) in q's dtype (rows of 512 contiguous) and lse (rows, Hq) fp32
    (natural log; any strides) of absorbed MLA: q_nope (rows, Hq, 512), q_pe (rows, Hq, 64);
    ckv_cache (num_pages, page_size, 512) and kpe_cache (num_pages, page_size, 64) in q's
    dtype, rows contiguous and
    16-byte aligned (views of FlashMLA's combined cache qualify); page_table int32 (B,
    max_pages); seqlens_k int32 (B,) counting the new tokens. rows = B (one query per
    sequence), or total_q packed by cu_seqlens_q int32 (B + 1,) with at most max_seqlen_q
    tokens per sequence (beyond QTOKENS: prefill, blocks of query tokens per CTA), token i of
    sq seeing keys j <= sk - sq + i when causal. The split plan bounds the lengths by the
    table's width (no device read). FP8 (ckv_scale given): the module docstring, q bf16.
    scheduled: `make_schedule`'s (list, row ranges) for this problem (the caller checked that it
    was made for it): the pass takes its items from the list and writes its partial at its item,
    the combine reduces each row's items; no scheduling kernel in this call."""
    rows, hq, _ = q_nope.shape
    b = seqlens_k.shape[0]
    if rows == 0 or b == 0 or hq == 0:
        return
    if scheduled is not None and scheduled[0].shape[0] == 0:
        scheduled = None  # a schedule without a list (`schedule_shapes`): the call's own plan
    qtokens = q_blocks = 1  # one query per sequence (query_tokens' first case, without a call)
    if cu_seqlens_q is not None:
        qtokens = query_tokens(True, max_seqlen_q, hq)
        q_blocks = -(-max_seqlen_q // qtokens)
    page_size = ckv_cache.shape[1]
    device = q_nope.device
    key = ("partial", q_nope.dtype, b * q_blocks, hq, page_table.shape[1] * page_size, qtokens,
           device.index, ckv_scale is not None, page_size,
           _plan_form[0] if scheduled is None else SCHEDULED, forced_key())  # fmt: skip
    plan = _plans.get_or_build(key, _plan)
    if plan[4] and not _wide_rows(out):  # the ostore compile's bulk copies: not this out
        plan = _plans.get_or_build((*key, True), _plan)
    partial, combine, splits, per, _, worklist = plan
    cu = None if cu_seqlens_q is None else cu_seqlens_q.contiguous()
    with on_device(device):  # (the scratch is the device's current stream's)
        seq = seqlens_k.contiguous()
        ranges = ()
        if worklist is not None and scheduled is not None:
            # the step's list (in the scales' slot): partials by item, every one written by its
            # CTA; each row's item range for the combine
            ckv_scale, row_ranges = scheduled
            items = ckv_scale.shape[0] - schedule.HEADER
            outs, ranges = _partials(items, qtokens, hq, device), (row_ranges,)
        else:  # the direct form (combine None) writes out and lse itself
            outs = (out, lse) if combine is None else _partials(splits, rows, hq, device)
        if worklist is not None and scheduled is None:  # the list in the scales' slot
            ckv_scale = _schedule(worklist, seq, cu, causal, b * q_blocks, q_blocks, splits, outs)
        partial(as_tma_ready(q_nope), as_tma_ready(q_pe), ckv_cache, kpe_cache, ckv_scale,
                page_table.contiguous(), seq, *outs,
                softmax_scale * LOG2E, per, page_size, cu, int(causal), q_blocks)  # fmt: skip
        if combine is not None:
            combine(*outs, out, lse, *ranges)


def dsa_sparse_attention(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    ckv_scale: torch.Tensor | None = None,
    attn_sink: torch.Tensor | None = None,
) -> bool:
    """out (tokens, Hq, 512) in q's dtype (rows of 512 contiguous) and lse (tokens, Hq) fp32
    (natural log; any strides) of DSA: q_nope (tokens, Hq, 512), q_pe (tokens, Hq, 64); caches
    as `mla_decode`'s; sparse_indices int32 (tokens, topk), entries page * page_size + slot,
    negative = padding. Split s covers list positions [s * per, (s + 1) * per) of every token;
    the plan depends on shapes only (no device read). topk 0: every row 0 / -inf. FP8
    (ckv_scale given): the module docstring, q bf16. attn_sink (Hq,) fp32 contiguous or None:
    a direct plan's pass applies it (its `sink` compile). Returns whether out has the sink in
    (False: a sink with a split plan, which the caller applies after the combine)."""
    tokens, hq, _ = q_nope.shape
    topk = sparse_indices.shape[1]
    if tokens == 0 or hq == 0:
        return True
    if topk == 0:  # every row 0 whatever the sink
        out.zero_()
        lse.fill_(float("-inf"))
        return True
    device = q_nope.device
    sink = attn_sink is not None
    key = ("sparse", q_nope.dtype, tokens, hq, topk, 1, device.index, ckv_scale is not None, 1,
           _plan_form[0], forced_key(), False, sink)  # fmt: skip
    plan = _plans.get_or_build(key, _plan)
    if plan[4] and not _wide_rows(out):  # the `wide` compile's 16-byte stores: not this out
        plan = _plans.get_or_build((*key[:11], True, sink), _plan)
    partial, combine, splits, per, _, _ = plan
    with on_device(device):
        # the direct form (combine None, a plan of one split) writes out and lse itself, and
        # takes a sink in seqlens_k's slot
        outs = (out, lse) if combine is None else _partials(splits, tokens, hq, device)
        partial(as_tma_ready(q_nope), as_tma_ready(q_pe), ckv_cache, kpe_cache, ckv_scale,
                sparse_indices.contiguous(), attn_sink if combine is None else None, *outs,
                softmax_scale * LOG2E, per, ckv_cache.shape[1], None, 0, 1)  # fmt: skip
        if combine is not None:
            combine(*outs, out, lse)
    return combine is None or not sink


def _fused_plan(_, dtype, hq, rope, positions, sink, neox, device_index, fp8=False):
    """(A plan key's builder.) The fused DSA prefill's pass (decode.py's sparse direct pass,
    `fused` compile; `fp8` too over FlashMLA's FP8 cache) for Hq heads: `config.heads_per_cta`'s
    block, always one split (the fused epilogue needs a row's whole O: no split plan, whatever
    `sparse_split_plan` would give)."""
    heads = config.heads_per_cta(hq)
    params = config.params_for("sparse", dtype_name(dtype), heads, fp8=fp8, direct=True,
                               sink=sink, fused=True, rope=dtype_name(rope),
                               positions=dtype_name(positions), neox=neox)  # fmt: skip
    return get_kernel(SPEC, params)


def dsa_fused_prefill(
    q: torch.Tensor,
    ckv_cache: torch.Tensor,
    kpe_cache: torch.Tensor,
    sparse_indices: torch.Tensor,
    softmax_scale: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    out_fp8: torch.Tensor,
    out_scale: torch.Tensor,
    lse: torch.Tensor,
    attn_sink: torch.Tensor | None = None,
    neox: bool = False,
    fp8: bool = False,
) -> None:
    """The fused DSA prefill (`forgekernel.ops.dsa_fused.dsa_fused_prefill` validates): q
    (tokens, Hq, 576) whole rows (16-byte aligned), the combined cache's two views ckv_cache
    (num_pages, page_size, 512) / kpe_cache (num_pages, page_size, 64) in q's dtype (fp8:
    FlashMLA's FP8 cache's uint8 latent and bf16 RoPE views, `ops.mla.fp8_cache_views`', q
    bf16; the pass views the scales from the latent's rows, 512 bytes in),
    sparse_indices int32 (tokens, topk) slots, cos_sin_cache (positions, 64) fp32 or q's
    dtype, positions int32 / int64 (tokens,), attn_sink fp32 (Hq,) or None -> out_fp8
    (tokens, Hq, 512) float8_e4m3fn (rows 2-byte aligned, written as uint8), out_scale fp32
    (tokens, Hq, 16), lse fp32 (tokens, Hq) natural log. One launch of one split (the pass's
    grid: tokens x head blocks); topk 0: every row 0 with the floor's scale, LSE -inf, no
    launch. No device read."""
    tokens, hq, _ = q.shape
    if tokens == 0 or hq == 0:
        return
    if sparse_indices.shape[1] == 0:  # what the pass writes for a row that saw no key
        out_fp8.view(torch.uint8).zero_()
        out_scale.fill_(FP8_FLOOR_SCALE)
        lse.fill_(float("-inf"))
        return
    device = q.device
    key = ("fused", q.dtype, hq, cos_sin_cache.dtype, positions.dtype, attn_sink is not None,
           neox, device.index, fp8)  # fmt: skip
    kernel = _plans.get_or_build(key, _fused_plan)
    with on_device(device):
        kernel(as_tma_ready(q), cos_sin_cache, ckv_cache, kpe_cache, out_scale,
               sparse_indices.contiguous(), attn_sink, out_fp8.view(torch.uint8), lse,
               softmax_scale * LOG2E, sparse_indices.shape[1], ckv_cache.shape[1], positions, 0,
               1)  # fmt: skip


# the e4m3 scale of a row that saw no key: max(0, 1e-4) / 448 rounded up to a power of two
# (reference.dsa `quantize_fp8_groups`: 2.23e-7 -> 2^-22)
FP8_FLOOR_SCALE = 2.0**-22
