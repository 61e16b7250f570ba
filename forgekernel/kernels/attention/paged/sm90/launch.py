"""Host launcher of the paged GQA decode: torch only (no DSL), the two kernels through the
compile cache. Callers validate first (`forgekernel.ops.attention_paged`). Both kernels launch
with programmatic dependent launch (runtime/pdl.py: the pass waits at its top for the kernel
before it, the combine for the pass) unless FORGEKERNEL_PDL=0 or inside `pdl.off()`, read when
a problem's plan is first built.

A decode step's schedule (`make_schedule`, `forgekernel.attention_paged_schedule`; 16-bit
caches, one query token a sequence): MLA's scheduling kernel in its ranges form (mla/sm90/
worklist.py, schedule.py `ranged_plan`: the keys per split chosen over the whole batch's real
lengths, each sequence cut into items of that many keys, a long one among short ones into many),
launched once a step and read by every layer's call; the pass's `ranges` compile takes item x
of the list and writes its partial by item, the combine's reduces each sequence's item range.
Where a call brings a schedule it always splits by it (the width plan's direct form of one
split, no combine, is not taken: a batch whose rows fill the GPU pays the combine)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch

from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
from forgekernel.kernels.attention.mla.sm90 import schedule as mla_schedule
from forgekernel.kernels.attention.paged.sm90 import (
    SPEC,
    combine_form,
    config,
    merge_rows,
    serial_ramp_key,
)
from forgekernel.kernels.attention.paged.sm90.combine_form import forced_key
from forgekernel.kernels.attention.paged.sm90.rows import heads_for
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime import pdl
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device
from forgekernel.runtime.plans import PlanCache, overriding
from forgekernel.runtime.scratch import scratch

_plans = PlanCache()
# `serial_ramp()`'s True while inside it (in the plans' keys)
_serial: list[bool] = [False]


@contextmanager
def serial_ramp() -> Iterator[None]:
    """The calls inside take the pass and CTA combine built as before the early page ids and
    the held partial rows (compile key ramp "serial", `sm90.serial_ramp_key`): the bench's
    variant `serial_ramp`, its kernels `sm90.serial_ramp_params` (PAGED_NOTES.md "Small-batch
    decode")."""
    with overriding(_serial, True):
        yield


def _combine(name: str, d: int, on: bool, units: int, ranges: bool = False,
             serial: bool = False):  # fmt: skip
    """The combine kernel for `units` (rows x heads, a bound): its warp form where
    `combine_form.takes_warps` says, else its CTA form (both called alike); serial: the CTA
    form's `serial_ramp_key` build."""
    warps = combine_form.takes_warps(units, d)
    params = config.params_for("combine", name, d, ranges=ranges, warps=warps)
    if serial and not warps:
        params = serial_ramp_key(params)
    return get_kernel(SPEC, pdl.key(params, on))


def _plan(dtype, kv_dtype, batch, hq, hkv, d, max_tokens, qtokens, device_index, one_split,
          merge=None, forced=None, scheduled=False, serial=False):  # fmt: skip
    """(partial kernel, combine kernel or None, splits, the pass's per_split: the least
    tokens a split takes, or with one split the table's width). One split: the
    partial pass writes out and lse itself, and no combine runs. The kernels are looked up
    here, once per problem (two compile-cache lookups cost 0.8 us a call on the CPU). merge
    (`merge_params`): None the leaf's default (`sm90.merge_rows`: "rows" on the bf16 D 128
    speculative leaves, else ""), "rows" the warps' merge weights computed once a row, "" the
    per-element merge. forced: `forced_key()`, in the key only (`pdl.enabled()` decides).
    scheduled (a call with a step's schedule): the ranges pass and combine, splits None (the
    list's), per 0 (the list's keys per split). serial (`serial_ramp`): the pass and the CTA
    combine built with compile key ramp "serial"."""
    name = dtype_name(dtype)
    kv = "float8_e4m3fn" if kv_dtype == torch.float8_e4m3fn else ""
    heads = heads_for(hq // hkv, qtokens, d, kv)
    resident = (config.RESIDENT_FP8 if kv else config.RESIDENT)[d]
    if one_split:
        splits, per = 1, max(max_tokens, 1)
    else:
        splits, per = config.split_plan(
            batch, hq // heads, max_tokens, num_sms(device_index), resident
        )
    if merge is None:
        merge = "rows" if merge_rows(name, d, kv, qtokens) else ""
    on = pdl.enabled()
    ramp = serial_ramp_key if serial else (lambda p: p)
    if scheduled:
        params = ramp(config.params_for("partial", name, d, heads, ranges=True))
        partial = get_kernel(SPEC, pdl.key(params, on))
        return partial, _combine(name, d, on, batch * hq, True, serial), None, 0
    params = merge_params(config.params_for("partial", name, d, heads, kv, qtokens), merge)
    partial = get_kernel(SPEC, pdl.key(ramp(params), on))
    combine = None
    if splits > 1:
        combine = _combine(name, d, on, batch * qtokens * hq, serial=serial)
        # the pass spreads each sequence's own keys over the splits, at least this many a
        # split: the width's per would leave a short sequence in a table sized for a long
        # context (a serving engine's captured graph) in one split
        per = config.MIN_TOKENS_PER_SPLIT
    return partial, combine, splits, per


def schedule_shapes(
    batch: int, hq: int, hkv: int, d: int, max_pages: int, page_size: int, device_index: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """The shapes of `make_schedule`'s (work list, row ranges), from the shapes alone (its
    fake, for tracing): capacity + HEADER list rows (a wave's slots plus one a sequence), one
    range a sequence. No list (the call keeps the width plan) for one sequence: the width
    plan already spreads its keys over every split, and the list's ranges pass and combine
    cost 1.106x / 1.004x of its time at b1 x 16k / 64k (H200, 2026-12-04 15:45)."""
    del max_pages, page_size  # the capacity does not depend on the lengths' bound
    if batch <= 1 or hq == 0:
        return (0, 2), (0, 3)
    slots = num_sms(device_index) * config.RESIDENT[d]
    return (mla_schedule.ranged_capacity(batch, slots) + mla_schedule.HEADER, 2), (batch, 3)


def make_schedule(seqlens_k: torch.Tensor, hq: int, hkv: int, d: int, max_pages: int,
                  page_size: int) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """The work list of a decode step (`forgekernel.attention_paged_schedule`): one launch of
    MLA's scheduling kernel in its ranges form on the current stream, no host read: (list
    int32 (capacity + HEADER, 2), each sequence's (first item, items, 0) int32 (batch, 3)),
    tensors of its own (every layer's call reads them). Units: the sequences; head blocks: the
    pass's CTAs a sequence's item launches; keys per split a multiple of 64 (MLA's tile, the
    pass's TILE), at least MIN_TOKENS_PER_SPLIT where a sequence has that many."""
    device = seqlens_k.device
    b = seqlens_k.shape[0]
    work_shape, rows_shape = schedule_shapes(b, hq, hkv, d, max_pages, page_size, device.index)
    work = torch.empty(work_shape, dtype=torch.int32, device=device)
    rows = torch.empty(rows_shape, dtype=torch.int32, device=device)
    if work_shape[0] == 0:
        return work, rows
    assert config.TILE == mla_schedule.TILE  # the list's keys per split: whole pass tiles
    heads = heads_for(hq // hkv, 1, d, "")
    width = max(1, -(-max_pages * page_size // config.TILE))
    fewest = min(width, max(1, config.MIN_TOKENS_PER_SPLIT // config.TILE))
    slots = num_sms(device.index) * config.RESIDENT[d]
    sched = get_kernel(MLA_SPEC, pdl.key(mla_params("worklist", "bfloat16", qtokens=1,
                                                    ranges=True), pdl.enabled()))  # fmt: skip
    with on_device(device):
        sched(seqlens_k.contiguous(), None, 1, 1, hq // heads, width, fewest, slots, width, work,
              rows)  # fmt: skip
    return work, rows


def merge_params(params: tuple, merge: str = "") -> tuple:
    """A partial pass's compile key with the warps' merge `merge` ("": the per-element
    `combine.write_split`; "rows": `PagedDecodeSm90.merge_rows`, built for the bf16 D 128
    speculative leaves, `sm90.merge_rows_params`)."""
    if not merge:
        return params
    if merge != "rows":
        raise ValueError(f"merge is '' or 'rows', got {merge!r}")
    return tuple(sorted((*params, ("merge", merge))))


def _plan_for(q, k_cache, page_table, batch, packed, max_seqlen_q, one_split, merge=None):
    """`_plan`'s (partial, combine, splits, tokens per split) for the call, cached. The packed
    form takes a kernel built for cu_seqlens_q (2 or more tokens) even when every sequence
    brings one query token."""
    qtokens = 1 if not packed else next(t for t in config.QTOKENS if t >= max(max_seqlen_q, 2))
    _, page_size, hkv, _ = k_cache.shape
    _, hq, d = q.shape
    key = (q.dtype, k_cache.dtype, batch, hq, hkv, d, page_table.shape[1] * page_size, qtokens,
           q.device.index, one_split, merge, forced_key(), False, _serial[0])  # fmt: skip
    return _plans.get_or_build(key, _plan)


def packed_splits(q, k_cache, page_table, batch: int, max_seqlen_q: int,
                  merge: str | None = None) -> int:  # fmt: skip
    """The split plan's number of splits for `batch` sequences of the packed form at up to
    max_seqlen_q tokens each (what `paged_decode` runs on them without one_split, `merge` as
    its): host only, the plan cached with the call's."""
    return _plan_for(q, k_cache, page_table, batch, True, max_seqlen_q, False, merge)[2]


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    softmax_scale: float,
    out: torch.Tensor,
    lse: torch.Tensor,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    cu_seqlens_q: torch.Tensor | None = None,
    max_seqlen_q: int = 1,
    causal: bool = True,
    one_split: bool = False,
    merge: str | None = None,
    scheduled: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> None:
    """out (B, Hq, D) and lse (B, Hq) fp32 (natural log) of one query per sequence against its
    pages: q (B, Hq, D); k_cache, v_cache (num_pages, page_size, Hkv, D) views whose rows are
    contiguous and 16-byte aligned (the combined cache's halves qualify); page_table int32
    (B, max_pages); seqlens_k int32 (B,); an FP8 (e4m3) cache with fp32 (Hkv,) k_scale and
    v_scale. Speculative decoding / MTP: q (total_q, Hq, D) packed by cu_seqlens_q int32
    (B + 1,), at most max_seqlen_q <= 4 tokens per sequence (causal: bottom-right), out
    (total_q, Hq, D), lse any (total_q, Hq) view (OPS.md's (Hq, total_q) storage transposed).
    The split plan sizes the number of splits by the table's width (no device read); each
    sequence's keys are spread over them by its own length (the kernel). one_split: no
    split-KV, the pass writes out and lse itself, each sequence's first rows only (up to the
    kernel's query tokens), where a combine writes every row (the chunked-prefill call takes
    one: the forward writes the longer sequences' rows after it). merge: None the leaf's
    default (`sm90.merge_rows`: "rows", each row's merge weights computed once, on the bf16
    D 128 speculative leaves; measured 2026-12-04 04:39), "" the per-element merge (the
    bench's variant `merge_elems`; the op's chunked-prefill decode rows), "rows"
    (`merge_params`). scheduled: a step's (work list, row ranges) from `make_schedule` (16-bit
    cache, one query token a sequence, the caller checks): the ranges pass and combine."""
    rows, hq, d = q.shape
    b = seqlens_k.shape[0]
    if rows == 0 or b == 0:
        return
    _, page_size, hkv, _ = k_cache.shape
    device = q.device
    if scheduled is not None and scheduled[0].shape[0] > 0:
        _ranged(q, k_cache, v_cache, page_table, seqlens_k, softmax_scale, out, lse, scheduled)
        return
    partial, combine, splits, per = _plan_for(q, k_cache, page_table, b, cu_seqlens_q is not None,
                                              max_seqlen_q, one_split, merge)  # fmt: skip
    # one split: the partials are placeholders giving the grid its one split
    direct = combine is None
    shape = (1, 1, 1) if direct else (splits, rows, hq)
    cu = None if cu_seqlens_q is None else cu_seqlens_q.contiguous()
    with on_device(device):  # the current stream's scratch (runtime/scratch.py)
        partial_o = scratch("paged.partial_o", (*shape, 1 if direct else d), torch.float32, device)
        partial_lse = scratch("paged.partial_lse", shape, torch.float32, device)
        partial(
            as_tma_ready(q), k_cache, v_cache, page_table.contiguous(), seqlens_k.contiguous(),
            partial_o, partial_lse, out, lse, int(direct), softmax_scale * LOG2E, per, page_size,
            hq // hkv, k_scale, v_scale, cu, int(causal),
        )  # fmt: skip
        if not direct:
            combine(partial_o, partial_lse, out, lse)


def _ranged(q, k_cache, v_cache, page_table, seqlens_k, softmax_scale, out, lse, scheduled):
    """`paged_decode` with a step's schedule: the ranges pass over the list's items (partials
    (items, 1, Hq, D) of the stream's scratch, each written by its item's CTA) and the ranges
    combine over each sequence's item range."""
    work, rows = scheduled
    _, hq, d = q.shape
    _, page_size, hkv, _ = k_cache.shape
    device = q.device
    key = (q.dtype, k_cache.dtype, seqlens_k.shape[0], hq, hkv, d, 0, 1, device.index, False,
           None, forced_key(), True, _serial[0])  # fmt: skip
    partial, combine, _, _ = _plans.get_or_build(key, _plan)
    items = work.shape[0] - mla_schedule.HEADER
    with on_device(device):
        partial_o = scratch("paged.partial_o", (items, 1, hq, d), torch.float32, device)
        partial_lse = scratch("paged.partial_lse", (items, 1, hq), torch.float32, device)
        partial(
            as_tma_ready(q), k_cache, v_cache, page_table.contiguous(), seqlens_k.contiguous(),
            partial_o, partial_lse, out, lse, 0, softmax_scale * LOG2E, 0, page_size,
            hq // hkv, work, None, None, 1,
        )  # fmt: skip
        combine(partial_o, partial_lse, out, lse, rows)
