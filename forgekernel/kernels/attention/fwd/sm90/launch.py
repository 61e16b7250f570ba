"""Host launcher of the sm90 attention forward: torch only (no DSL), the kernel through the
compile cache. Callers validate first (`forgekernel.attention` / `attention_varlen` /
`attention_paged`); the launcher skips empty problems, makes the tensors TMA-ready, packs short
GQA queries and calls the compiled function in its argument order (see the leaf's
`__init__`)."""

from __future__ import annotations

import functools

import torch

from forgekernel.kernels.attention.fwd.sm90 import SPEC, pack_groups
from forgekernel.kernels.attention.fwd.sm90.config import (
    PAGED_MIN_SEQLEN_Q,
    VIEW_GROUPS,
    AttnConfig,
    default_config,
    default_ctas_per_sm,
    fixed_rule,
    grid_ctas,
    page_box_for,
    params_for,
    rule_config,
)
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import (
    as_tma_ready,
    copy_back,
    dtype_name,
    num_sms,
    on_device,
    tma_target,
)
from forgekernel.runtime.plans import PlanCache

# Pack-GQA below this many query rows: a short query's tile of one head would be mostly empty
# rows, and every head of a group would stream the same K/V.
PACK_GQA_MAX_SQ = 128


def pack_gqa_q(q: torch.Tensor, group: int) -> torch.Tensor:
    """(B, Sq, Hkv * G, D) -> (B, Sq * G, Hkv, D): query head h * G + g of position s becomes
    row s * G + g of head h (a contiguous copy)."""
    b, sq, hq, d = q.shape
    return q.view(b, sq, hq // group, group, d).transpose(2, 3).reshape(b, sq * group, -1, d)


def unpack_gqa(o: torch.Tensor, lse: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed outputs back: o (B, Sq * G, Hkv, Dv) -> (B, Sq, Hq, Dv) and lse
    (B, Hkv, Sq * G) -> (B, Hq, Sq), as views."""
    b, rows, hkv, dv = o.shape
    sq = rows // group
    o = o.view(b, sq, group, hkv, dv).transpose(2, 3).reshape(b, sq, hkv * group, dv)
    lse = lse.view(b, hkv, sq, group).transpose(2, 3).reshape(b, hkv * group, sq)
    return o, lse


def _kernel(
    dtype: torch.dtype, head_dim: int, head_dim_v: int, causal: bool, varlen: bool, box: int,
    device_index: int | None, packed: bool = False, view_group: int = 0, rule: int = 0,
) -> tuple:  # fmt: skip
    """(the compiled function of the head dims' analytical default, or of fixed-length rule
    `rule` (`config.fixed_rule`), the device's SM count, the config's CTAs a SM, whether it
    takes a tile counter): a plan, built once per key (params_for's dataclass walk cost 4.4 us
    per call on the CPU, the kernel lookup and the SM count 1-2 more). packed with view_group
    G: the paged mode's packed compile (no sequence skipped) on views of G query heads a kv
    head; view_group G without packed (fixed length): the GQA-packed candidate's compile."""
    if rule:
        cfg = rule_config(head_dim, head_dim_v, rule)
    else:
        cfg = default_config(head_dim, head_dim_v, paged=box > 0, varlen=varlen)
    params = params_for(dtype_name(dtype), head_dim, head_dim_v, causal, cfg, varlen=varlen,
                        page_box=box, packed=packed, view_group=view_group)  # fmt: skip
    fn = get_kernel(SPEC, params)
    return fn, num_sms(device_index), default_ctas_per_sm(cfg, varlen), cfg.dynamic


_plans = PlanCache()


def _plan(
    dtype, head_dim, head_dim_v, causal, varlen, device, box=0, packed=False, view_group=0,
    rule=0,
) -> tuple:  # fmt: skip
    return _plans.get_or_build(
        (dtype, head_dim, head_dim_v, causal, varlen, box, device.index, packed, view_group,
         rule),
        _kernel,
    )  # fmt: skip


def _config_kernel(
    q, v, causal: bool, varlen: bool, config: AttnConfig, view_group: int = 0
) -> tuple:
    """(the compiled function of `config`, the SM count, its CTAs a SM, whether it takes a
    tile counter): a variant's kernel (bench), looked up per call."""
    params = params_for(dtype_name(q.dtype), q.shape[-1], v.shape[-1], causal, config,
                        varlen=varlen, view_group=view_group)  # fmt: skip
    fn = get_kernel(SPEC, params)
    return fn, num_sms(q.device.index), default_ctas_per_sm(config, varlen), config.dynamic


def _counter(q: torch.Tensor, dynamic: bool) -> torch.Tensor | None:
    """A dynamic kernel's tile counter: a zeroed int32 (1,) (one memset a launch; captured in
    a CUDA graph as a memset node), else None."""
    return torch.zeros(1, dtype=torch.int32, device=q.device) if dynamic else None


def clear_plans() -> None:
    """Every plan (they hold the functions they looked up)."""
    _plans.clear()


@functools.cache
def paged_box(page_size: int, head_dim: int) -> int:
    """The TMA box rows the paged mode loads a cache of `page_size` rows with, under the head
    dim's key tiles; 0: not a paged-kernel page size (config.page_box_for)."""
    return page_box_for(page_size, default_config(head_dim, head_dim, paged=True).tile_n)


def _no_keys(o: torch.Tensor, lse: torch.Tensor) -> None:
    """Every row sees no key: o 0, lse -inf."""
    o.zero_()
    lse.fill_(float("-inf"))


def _no_keys_paged(o: torch.Tensor, lse: torch.Tensor, cu_seqlens_q: torch.Tensor) -> None:
    """The paged mode's rows when the cache has no pages: o 0, lse -inf on the rows of the
    sequences it runs (no host read: a row mask from cu_seqlens_q)."""
    cu = cu_seqlens_q.long()
    rows = torch.arange(o.shape[0], device=o.device)
    seq = torch.searchsorted(cu[1:], rows, right=True).clamp(max=cu.shape[0] - 2)
    mine = (cu[seq + 1] - cu[seq]) >= PAGED_MIN_SEQLEN_Q
    o.masked_fill_(mine[:, None, None], 0)
    lse.masked_fill_(mine[None, :], float("-inf"))


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    softmax_scale: float,
    causal: bool,
    ctas_per_sm: int | None = None,
    config: AttnConfig | None = None,
    pack_gqa: bool | None = None,
) -> None:
    """o (B, Sq, Hq, Dv) and lse (B, Hq, Sq) fp32, any views, for validated q (B, Sq, Hq, D),
    k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv). ctas_per_sm: the grid (`config.grid_ctas`; None:
    the config's, `config.default_ctas_per_sm`); config: a variant's kernel in place of the
    default (bench). pack_gqa: with GQA (G = Hq / Hkv > 1) every Sq runs GQA-packed through
    views of q / o / lse (no copy), the G query heads of a kv head as G * Sq rows of one head.
    None (the default): where `pack_group` says so (PACK_CLASSES); True: at any head dim, G
    dividing the config's tile_m (else ValueError; docs/attention/NOTES.md
    "next/attn-gqa-pack"); False: never (short queries still packed by a copy)."""
    if o.numel() == 0:  # no batch, query rows or heads
        return
    if k.shape[1] == 0:
        _no_keys(o, lse)
        return
    q, k, v = as_tma_ready(q), as_tma_ready(k), as_tma_ready(v)
    o_dst = tma_target(o)
    lse_dst = lse if lse.is_contiguous() else torch.empty(lse.shape, device=lse.device)
    _launch(q, k, v, o_dst, lse_dst, softmax_scale, causal, ctas_per_sm, config, pack_gqa)
    copy_back((o, lse), (o_dst, lse_dst))


def pack_group(head_dim: int, head_dim_v: int, causal: bool, group: int, rule: int) -> int:
    """The view_group a fixed-length call runs by default: G where (head_dim = head_dim_v,
    causal) is one of PACK_CLASSES, no FIXED_RULES rule took the problem and G is one of
    `pack_groups`; else 0 (unpacked, or packed by a copy below PACK_GQA_MAX_SQ)."""
    if rule or head_dim != head_dim_v:
        return 0
    return group if group in pack_groups(head_dim, causal) else 0


def _launch(
    q, k, v, o, lse, scale: float, causal: bool, ctas_per_sm: int | None = None,
    config: AttnConfig | None = None, pack_gqa: bool | None = None,
) -> None:  # fmt: skip
    """The kernel call: inputs and outputs TMA-ready, sizes non-zero. The config: the
    problem's fixed-length rule (`config.fixed_rule`) or the head dims' default. GQA runs
    packed, the G query heads of a kv head as G rows per position of one head (qgroup = G
    tells the kernel's causal mask): through the view_group compile's views at any Sq where
    `pack_group` (pack_gqa None) or pack_gqa=True says so, else by a copy for short queries."""
    device = q.device
    group = q.shape[2] // k.shape[2]
    views = group if pack_gqa and group > 1 else 0
    if config is None:
        (b, sq, hq, d), (sk, hkv), dv = q.shape, k.shape[1:3], v.shape[-1]
        rule = fixed_rule(d, dv, causal, b, sq, sk, hq, hkv)
        if pack_gqa is None and group > 1:
            views = pack_group(d, dv, causal, group, rule)
        fn, sms, per_sm, dynamic = _plan(q.dtype, d, dv, causal, False, device, rule=rule,
                                         view_group=views)  # fmt: skip
    else:
        fn, sms, per_sm, dynamic = _config_kernel(q, v, causal, False, config, views)
    ctas = grid_ctas(sms, per_sm if ctas_per_sm is None else ctas_per_sm)
    counter = _counter(q, dynamic)
    with on_device(device):
        if views:
            hkv = k.shape[2]
            fn(q.unflatten(2, (hkv, group)), k, v, o.unflatten(2, (hkv, group)),
               lse.unflatten(1, (hkv, group)), None, None, scale * LOG2E, 0, group, ctas,
               counter)  # fmt: skip
        elif group > 1 and q.shape[1] < PACK_GQA_MAX_SQ:
            qp = pack_gqa_q(q, group)
            b, rows, hkv, _ = qp.shape
            op = q.new_empty(b, rows, hkv, v.shape[-1])
            lsep = q.new_empty(b, hkv, rows, dtype=torch.float32)
            fn(qp, k, v, op, lsep, None, None, scale * LOG2E, 0, group, ctas, counter)
            op, lsep = unpack_gqa(op, lsep, group)
            o.copy_(op)
            lse.copy_(lsep)
        else:
            fn(q, k, v, o, lse, None, None, scale * LOG2E, 0, 1, ctas, counter)


def attention_varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    ctas_per_sm: int | None = None,
    config: AttnConfig | None = None,
) -> None:
    """o (Tq, Hq, Dv) and lse (Hq, Tq) fp32, any views, for validated packed q (Tq, Hq, D),
    k (Tk, Hkv, D), v (Tk, Hkv, Dv); int32 offsets (B + 1,) on q's device. ctas_per_sm: the
    grid (`config.grid_ctas`; None: the config's, `config.default_ctas_per_sm`); config: a
    variant's kernel in place of the default (bench)."""
    if o.numel() == 0 or max_seqlen_q == 0:
        return
    if k.shape[0] == 0:  # no keys at all
        _no_keys(o, lse)
        return
    q, k, v = as_tma_ready(q), as_tma_ready(k), as_tma_ready(v)
    cu_q, cu_k = cu_seqlens_q.contiguous(), cu_seqlens_k.contiguous()
    o_dst = tma_target(o)
    lse_dst = lse if lse.stride(-1) == 1 else torch.empty(lse.shape, device=lse.device)
    if config is None:
        fn, sms, per_sm, dynamic = _plan(q.dtype, q.shape[-1], v.shape[-1], causal, True, q.device)
    else:
        fn, sms, per_sm, dynamic = _config_kernel(q, v, causal, True, config)
    ctas = grid_ctas(sms, per_sm if ctas_per_sm is None else ctas_per_sm)
    counter = _counter(q, dynamic)
    with on_device(q.device):
        fn(q, k, v, o_dst, lse_dst, cu_q, cu_k, softmax_scale * LOG2E, max_seqlen_q, 1, ctas,
           counter)  # fmt: skip
    copy_back((o, lse), (o_dst, lse_dst))


def attention_paged_fwd(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    o: torch.Tensor,
    lse: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    max_seqlen_q: int,
    softmax_scale: float,
    causal: bool,
    packed: bool = False,
) -> None:
    """o (Tq, Hq, D) and lse (Hq, Tq) fp32, any views, for validated packed q (Tq, Hq, D)
    against 16-bit caches (num_pages, page_size, Hkv, D) read in place (rows contiguous and
    16-byte aligned, outer strides multiples of 8 elements: a combined cache's halves qualify;
    `paged_box(page_size, D)` > 0), page_table int32 (B, max_pages), seqlens_k int32 (B,),
    cu_seqlens_q int32 (B + 1,), all on q's device. Causal: bottom-right aligned to each
    sequence's key length. Sequences of fewer than PAGED_MIN_SEQLEN_Q query tokens are
    skipped (the paged decode's: their rows of o and lse are left as they are). packed: the
    whole batch, none skipped, in one launch of the packed compile on GQA-packed views of q, o
    and lse (`_paged_packed`); only where `view_group(Hq / Hkv, D)` > 0 (else ValueError: the
    op runs the split there)."""
    if packed:
        _paged_packed(q, k_cache, v_cache, o, lse, page_table, seqlens_k, cu_seqlens_q,
                      max_seqlen_q, softmax_scale, causal)  # fmt: skip
        return
    if o.numel() == 0 or max_seqlen_q < PAGED_MIN_SEQLEN_Q:
        return
    if k_cache.shape[0] == 0:  # no pages: every length is 0
        _no_keys_paged(o, lse, cu_seqlens_q)
        return
    d = q.shape[-1]
    box = paged_box(k_cache.shape[1], d)
    q = as_tma_ready(q)
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    cu_q, lens = cu_seqlens_q.contiguous(), seqlens_k.contiguous()
    # buffers start as o and lse: the rows of the skipped sequences come back unchanged
    o_dst = tma_target(o, keep=True)
    lse_dst = lse if lse.stride(-1) == 1 else lse.contiguous()
    fn, ctas, _, _ = _plan(q.dtype, d, d, causal, True, q.device, box)
    with on_device(q.device):
        fn(q, k_cache, v_cache, o_dst, lse_dst, cu_q, lens, softmax_scale * LOG2E, max_seqlen_q,
           1, ctas, table)  # fmt: skip
    copy_back((o, lse), (o_dst, lse_dst))


@functools.cache
def view_group(group: int, head_dim: int) -> int:
    """The packed form's G for `group` query heads a kv head at `head_dim` (the paged
    default's tiles): G itself where it is one of config.VIEW_GROUPS (the standard compiles)
    and divides the tile's rows (a TMA box of (G, tile_m / G) tokens' rows), else 0 (the op
    runs the split form: G 3, 5, 6, 7, 12, 32, ...)."""
    tile_m = default_config(head_dim, head_dim, paged=True).tile_m
    return group if group in VIEW_GROUPS and tile_m % group == 0 else 0


def _paged_packed(q, k_cache, v_cache, o, lse, page_table, seqlens_k, cu_seqlens_q,
                  max_seqlen_q: int, softmax_scale: float, causal: bool) -> None:  # fmt: skip
    """`attention_paged_fwd(packed=True)`: every sequence of the batch (decode rows, chunks)
    in one launch, FA4's form of a chunked-prefill batch. The G = Hq / Hkv query heads of a kv
    head become G rows per token of one head without a copy: q and o handed over as their
    (Tq, Hkv, G, D) views and lse as its (Hkv, G, Tq) view, which the `view_group` compile
    sees as the packed rows ((G, Tq)) they hold (`views.grouped_rows_as_sdhb`), so a decode
    row of n tokens is a tile of n * G rows a kv head that streams its keys once for the group;
    each sequence's offsets and the longest length scale by G, the kernel's causal mask reads
    row r as token r // G (qgroup = G: each sequence's bottom-right offset is seqlen_k - rows
    // G); o and lse in place where TMA can write them (else through a buffer copied back).
    Rows past cu_seqlens_q[-1] (outside every sequence: an invalid input) get unspecified
    values. (The form with pack / unpack copies, for any G, measured slower than the split
    everywhere and was dropped: docs/attention/PAGED_NOTES.md.)"""
    tq, hq, d = q.shape
    hkv = k_cache.shape[2]
    group = view_group(hq // hkv, d)
    if not group:
        raise ValueError(f"no packed compile for G = {hq // hkv} at D = {d} (view_group)")
    if o.numel() == 0 or max_seqlen_q == 0:
        return
    if k_cache.shape[0] == 0:  # no pages: every length is 0, every row sees no key
        _no_keys(o, lse)
        return
    box = paged_box(k_cache.shape[1], d)
    qv = as_tma_ready(q).unflatten(1, (hkv, group))
    o_dst = tma_target(o)
    lse_dst = lse if lse.stride(-1) == 1 else torch.empty(lse.shape, device=lse.device)
    table = page_table if page_table.stride(-1) == 1 else page_table.contiguous()
    cu_p, lens = cu_seqlens_q * group, seqlens_k.contiguous()
    fn, ctas, _, _ = _plan(q.dtype, d, d, causal, True, q.device, box, packed=True,
                           view_group=group)  # fmt: skip
    with on_device(q.device):
        fn(qv, k_cache, v_cache, o_dst.unflatten(1, (hkv, group)),
           lse_dst.unflatten(0, (hkv, group)), cu_p, lens, softmax_scale * LOG2E,
           max_seqlen_q * group, group, ctas, table)  # fmt: skip
    copy_back((o, lse), (o_dst, lse_dst))
