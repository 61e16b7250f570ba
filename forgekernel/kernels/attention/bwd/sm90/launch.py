"""Host launcher of the sm90 attention backward: torch only (no DSL), the three kernels
(preprocess, main, postprocess) through the compile cache. Callers validate first
(`forgekernel.attention_backward`, the autograd of `forgekernel.attention`); the launcher
zeroes the gradients of empty problems, makes the tensors TMA-ready, picks the main kernel's
config, allocates the fp32 workspaces and launches."""

from __future__ import annotations

import math
from dataclasses import replace

import torch

from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN, SPEC_POST, SPEC_PRE
from forgekernel.kernels.attention.bwd.sm90.config import (
    ROW_PAD,
    BwdConfig,
    choose_config,
    default_config,
    main_params,
    post_params,
    pre_params,
    varlen_ws_rows,
)
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import (
    as_tma_ready,
    copy_back,
    dtype_name,
    num_sms,
    on_device,
    tma_ready,
    tma_target,
)
from forgekernel.runtime.plans import PlanCache
from forgekernel.runtime.scratch import scratch_views

# (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k) of a varlen call, None otherwise.
Seqs = tuple[torch.Tensor, torch.Tensor, int, int] | None


def attention_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    do: torch.Tensor,
    dq: torch.Tensor,
    dk: torch.Tensor,
    dv: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    deterministic: bool = False,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    config: BwdConfig | None = None,
) -> None:
    """dq, dk, dv (written in place, any views shaped and typed as q, k, v) of
    o = softmax(scale q k^T + mask) v, given o, lse (B, Hq, Sq) fp32 (natural log, -inf for rows
    that see no key) and do. q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), bf16 or
    fp16, Hq % Hkv == 0, (D, Dv) in HEAD_DIMS; causal is bottom-right aligned. With
    `deterministic`, dq is bitwise reproducible (dk, dv always are). `config` (optional)
    replaces the main kernel's default BwdConfig for these head dims (variants, benchmarks).

    Varlen (cu_seqlens_q / cu_seqlens_k int32 (B + 1,) on q's device, max_seqlen_q /
    max_seqlen_k >= every sequence's length): q, o, do (Tq, Hq, *), k, v (Tk, Hkv, *), lse
    (Hq, Tq); each sequence its own causal alignment; sequences with no queries or no keys
    give zero gradients."""
    seqs = None
    if cu_seqlens_q is not None:
        seqs = (cu_seqlens_q, cu_seqlens_k, int(max_seqlen_q), int(max_seqlen_k))
    if _nothing_to_compute(q, k, seqs):
        for g in (dq, dk, dv):
            g.zero_()
        return
    flags = (float(softmax_scale), causal, deterministic, seqs, config)
    if _in_place(q, k, v, o, lse, do, dq, dk, dv):
        _launch_kernels(q, k, v, o, lse, do, dq, dk, dv, *flags)
        return
    # one call per tensor, no generators
    q, k, v, do = as_tma_ready(q), as_tma_ready(k), as_tma_ready(v), as_tma_ready(do)
    o, lse = as_tma_ready(o), lse.contiguous()
    dst = (
        tma_target(dq, contiguous=True),
        tma_target(dk, contiguous=True),
        tma_target(dv, contiguous=True),
    )
    _launch_kernels(q, k, v, o, lse, do, *dst, *flags)
    copy_back((dq, dk, dv), dst)


# Whether a call's tensors are laid out as the kernels take them (q, k, v, o, do TMA-ready, lse
# and the gradients compact too: what the copies below would leave as they are), per (q, k, v
# shapes, the nine tensors' strides): the other shapes follow from q, k, v's, the base addresses
# are checked per call. Every tensor of every backward (saved-tensor hooks may hand back any
# strides or address: offloading, compression); the bench's host case on meta tensors, no-op
# kernels: 17.6 -> 15.0 us per call against tma_ready / tma_target on each.
_layouts = PlanCache()


def _in_place(q, k, v, o, lse, do, dq, dk, dv) -> bool:
    key = [q.shape, k.shape, v.shape]
    for t in (q, k, v, o, lse, do, dq, dk, dv):
        if t.data_ptr() % 16:
            return False
        key.append(t.stride())
    key = tuple(key)
    fits = _layouts.get(key)
    if fits is None:
        fits = _layouts.get_or_build(key, lambda *_: _fits(q, k, v, o, lse, do, dq, dk, dv))
    return fits


def _fits(q, k, v, o, lse, do, dq, dk, dv) -> bool:
    for t in (q, k, v, o, do):
        if not tma_ready(t):
            return False
    for t in (dq, dk, dv):
        if not (tma_ready(t) and t.is_contiguous()):
            return False
    return lse.is_contiguous()


def _nothing_to_compute(q: torch.Tensor, k: torch.Tensor, seqs: Seqs) -> bool:
    """No query rows or no keys (varlen: also no sequence, or zero maximum lengths): every
    gradient is 0 and no kernel runs."""
    if q.numel() == 0 or k.numel() == 0:
        return True
    return seqs is not None and (seqs[0].numel() < 2 or seqs[2] <= 0 or seqs[3] <= 0)


def _launch_kernels(
    q, k, v, o, lse, do, dq, dk, dv, scale: float, causal: bool, deterministic: bool,
    seqs: Seqs, config: BwdConfig | None = None,
) -> None:  # fmt: skip
    """The kernels: tensors TMA-ready, lse and the gradients contiguous, sizes non-zero."""
    with on_device(q.device):
        if seqs is None:
            _fixed_length(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, config)
        else:
            _varlen(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, config)


class _Plan:
    """What a launch needs that depends only on the problem, chosen once per problem: the
    three compiled kernels (one lookup per problem), the persistent CTA count, whether dK / dV
    go through fp32 accumulators (head_split), and the workspace layout (fixed length;
    varlen's is keyed by its token count apart)."""

    __slots__ = ("pre", "main", "post", "ctas", "head_split", "workspace")

    def __init__(self, pre, main, post, ctas: int, head_split: bool, workspace: _Workspace | None):
        self.pre = get_kernel(SPEC_PRE, pre)
        self.main = get_kernel(SPEC_MAIN, main)
        self.post = get_kernel(SPEC_POST, post)
        self.ctas, self.head_split, self.workspace = ctas, head_split, workspace


_plans = PlanCache()
_varlen_workspaces = PlanCache()


def clear_plans() -> None:
    """Every plan (they hold the kernels they looked up), varlen workspace layout and layout
    check."""
    _plans.clear()
    _varlen_workspaces.clear()
    _layouts.clear()


def _fixed_length(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, config) -> None:
    b, sq, hq, d = q.shape
    _, sk, hkv, _ = k.shape
    key = (q.dtype, b, sq, sk, hq, hkv, d, v.shape[-1], causal, deterministic, q.device.index,
           config)  # fmt: skip
    plan = _plans.get_or_build(key, _fixed_plan)
    lse2, dsum, dq_acc, sem, *acc, pre_dq, fill = plan.workspace.allocate(q.device)
    if fill is not None:
        fill.zero_()
    dk_main, dv_main = acc if plan.head_split else (dk, dv)
    plan.pre(o, do, lse, lse2, dsum, None, pre_dq, 0)
    plan.main(
        q, k, v, do, lse2, dsum, dq_acc, dk_main, dv_main, sem, None, None, plan.ctas, scale,
        scale * LOG2E,
    )  # fmt: skip
    plan.post(dq_acc, dq, None, 0, scale)
    if plan.head_split:
        # one multi-tensor cast kernel for both (CUDA's fast path: both sources fp32, both
        # targets q's dtype, pairwise the same sizes and strides), not a copy_ each: the same
        # rounding, one launch and one dispatcher call fewer per backward
        torch._foreach_copy_((dk, dv), (dk_main, dv_main))


def _fixed_plan(
    dtype, b, sq, sk, hq, hkv, d, dv_dim, causal, deterministic, device_index, config
) -> _Plan:  # fmt: skip
    if config is not None:
        cfg = config
    else:
        sms = num_sms(device_index)
        cfg = choose_config(d, dv_dim, deterministic, b, sk, hq, hkv, sms, causal)
    if deterministic and cfg.persistent:
        cfg = replace(cfg, persistent=False)
    if cfg.head_split and (deterministic or hq == hkv):
        cfg = replace(cfg, head_split=0)  # atomic dK / dV order; nothing to split
    ctas = 0
    if cfg.persistent:
        tiles = -(-sk // cfg.tile_n) * hkv * b
        ctas = min(tiles, num_sms(device_index))
    sq_pad = -(-sq // ROW_PAD) * ROW_PAD
    parts = [
        ((b, hq, sq_pad), False, False),  # lse2
        ((b, hq, sq_pad), False, False),  # dsum
        ((b, hq, sq_pad * d), False, True),  # dq_acc: zeroed by the preprocess
        # The per-row-block dQ semaphores (deterministic order); the compiled kernel's batch
        # and head extents are shared with q, so the unread buffer keeps the shape too
        # (uninitialized). Persistent: sem[0, 0, 0] is the tile counter (zeroed), and the
        # kernel's max_seqlen_k slot carries its CTA count.
        ((b, hq, sq_pad // cfg.tile_m), True, deterministic or cfg.persistent),
    ]
    if cfg.head_split:
        # the main kernel adds dK * scale and dV into fp32 accumulators
        parts += [((b, sk, hkv, d), False, True), ((b, sk, hkv, dv_dim), False, True)]
    name = dtype_name(dtype)
    return _Plan(
        pre_params(name, dv_dim),
        main_params(name, d, dv_dim, causal, deterministic, cfg),
        post_params(name, d, cfg.tile_m, dq_split=cfg.dq_split),
        ctas,
        bool(cfg.head_split),
        _Workspace(parts, pre_rows=(b, hq, sq_pad)),
    )


def _varlen(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, config) -> None:
    cu_q, cu_k, mq, mk = seqs
    tq, hq, d = q.shape
    plan = _plans.get_or_build(
        (q.dtype, d, v.shape[-1], causal, deterministic, config), _varlen_plan
    )
    # the layout apart: packed batches change their token count more often than their kind
    rows = varlen_ws_rows(tq, cu_q.numel() - 1)
    workspace = _varlen_workspaces.get_or_build((hq, rows, d, deterministic), _varlen_workspace)
    cu_q, cu_k = cu_q.contiguous(), cu_k.contiguous()
    lse2, dsum, dq_acc, sem, _, fill = workspace.allocate(q.device)
    fill.zero_()
    plan.pre(o, do, lse, lse2, dsum, cu_q, None, mq)
    plan.main(
        q, k, v, do, lse2, dsum, dq_acc, dk, dv, sem, cu_q, cu_k, mk, scale, scale * LOG2E,
    )  # fmt: skip
    plan.post(dq_acc, dq, cu_q, mq, scale)


def _varlen_plan(dtype, d, dv_dim, causal, deterministic, config) -> _Plan:
    """The compile params; the workspace layout is `_varlen_workspace`'s."""
    cfg = config if config is not None else default_config(d, dv_dim, deterministic, True)
    if cfg.persistent:
        cfg = replace(cfg, persistent=False)  # varlen keeps its per-sequence grid
    name = dtype_name(dtype)
    return _Plan(
        pre_params(name, dv_dim, varlen=True),
        main_params(name, d, dv_dim, causal, deterministic, cfg, varlen=True),
        post_params(name, d, cfg.tile_m, varlen=True, dq_split=cfg.dq_split),
        0,
        False,
        None,
    )


def _varlen_workspace(hq: int, rows: int, d: int, deterministic: bool) -> _Workspace:
    # dK / dV rows of keys that belong to no sequence (none, with well-formed offsets) and of
    # empty-query sequences are written by the kernel (zeros); dQ rows by the postprocess.
    return _Workspace(
        (
            ((hq, rows), False, False),  # lse2
            ((hq, rows), False, False),  # dsum
            ((hq, rows * d), False, True),  # dq_acc
            ((hq, rows), True, deterministic),  # sem
        )
    )


# Workspace views start at multiples of 512 bytes, the CUDA caching allocator's alignment of
# the separate buffers they replace (TMA and the vector reductions need 16).
_ALIGN = 512 // 4
# Workspaces up to this size (b1 hq32 s1024 d128's is 17 MB) come from runtime/scratch.py, one
# buffer per stream whose views are made once; larger ones, whose kernels run long enough to
# hide an allocation, are allocated per call, so that a training step does not keep its largest
# backward's workspace for good.
SCRATCH_BYTES = 32 << 20


class _Workspace:
    """A launch's fp32 / int32 workspaces as views of one fp32 buffer: first those that must
    start zeroed (in the order given: the dQ accumulator first), then the others. parts:
    (shape, int32?, zeroed?) per buffer. `allocate` gives the parts' views (contiguous, in the
    order of `parts`), the preprocess's dQ-accumulator argument and the region the launcher
    must zero (None when there is none).

    Fixed length (`pre_rows` = (B, Hq, Sq_pad)): the preprocess zeroes its dQ-accumulator
    argument (B, Hq, W) row by row, W any multiple of 4 Sq_pad (preprocess.py `_zero_dq`), so
    it gets a row-major view over the accumulator and the zeroed buffers behind it (dK / dV
    accumulators, semaphores) instead of a fill kernel per launch, the same bytes zeroed; the
    main kernel and the postprocess get the accumulator's own (B, Hq, Sq_pad D) view. When W
    would exceed twice the accumulator's (few query rows for many keys: 128-thread blocks
    zeroing long runs), the launcher fills the rest. Varlen: the launcher zeroes them all."""

    __slots__ = ("numel", "parts", "pre", "fill", "has_int")

    def __init__(self, parts, pre_rows: tuple[int, int, int] | None = None) -> None:
        placed: list = [None] * len(parts)
        offset = 0
        for zeroed in (True, False):
            if not zeroed:  # the zeroed region ends here
                self.pre, self.fill = None, (0, offset) if offset else None
                if pre_rows is not None:
                    dq_shape = next(shape for shape, _, z in parts if z)
                    self.pre, self.fill = _pre_zeroing(dq_shape, offset, pre_rows)
                    offset = max(offset, math.prod(self.pre[0]))
            for i, (shape, is_int, z) in enumerate(parts):
                if z == zeroed:
                    placed[i] = (shape, _contiguous_strides(shape), offset, is_int)
                    offset += -(-math.prod(shape) // _ALIGN) * _ALIGN
        self.numel = offset
        self.parts = tuple(placed)
        self.has_int = any(view[3] for view in placed)

    def views(self, ws: torch.Tensor) -> tuple:
        """The views of a buffer of at least `numel` fp32 elements (scratch_views' layout)."""
        ints = ws.view(torch.int32) if self.has_int else ws
        base = ws.storage_offset()  # as_strided's offsets are the storage's
        out = [
            (ints if is_int else ws).as_strided(shape, strides, base + offset)
            for shape, strides, offset, is_int in self.parts
        ]
        if self.pre is None:
            out.append(None)
        else:
            shape, strides, offset = self.pre
            out.append(ws.as_strided(shape, strides, base + offset))
        out.append(None if self.fill is None else ws[self.fill[0] : self.fill[1]])
        return tuple(out)

    def allocate(self, device: torch.device) -> tuple:
        if self.numel * 4 <= SCRATCH_BYTES:
            return scratch_views("attention_bwd.workspace", self, torch.float32, device)
        return self.views(torch.empty(self.numel, dtype=torch.float32, device=device))


def _pre_zeroing(dq_shape, zeroed_end: int, pre_rows) -> tuple:
    """(the preprocess's dQ-accumulator view as (shape, strides, offset), the region left for
    the launcher to zero or None): the dQ accumulator (B, Hq, Sq_pad D) at offset 0 and other
    zeroed buffers up to `zeroed_end` (`_Workspace`)."""
    b, hq, sq_pad = pre_rows
    width = dq_shape[2]
    # the narrowest row width the preprocess takes (a multiple of 4 Sq_pad) whose B x Hq rows
    # reach zeroed_end
    quantum = 4 * sq_pad
    wide = -(-zeroed_end // (b * hq * quantum)) * quantum
    if wide <= 2 * width:
        return ((b, hq, wide), (hq * wide, wide, 1), 0), None
    tail = (b * hq * width, zeroed_end)
    return ((b, hq, width), (hq * width, width, 1), 0), tail


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """torch's strides of a contiguous tensor of `shape` (size-0 / 1 dims counted as 1)."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
