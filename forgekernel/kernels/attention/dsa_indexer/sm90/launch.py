"""Host launchers of the lightning indexer (logits, then top-k): torch only (no DSL), the kernels
through the compile cache. Callers validate first (`forgekernel.ops.dsa_indexer`); nothing here
reads device data (CUDA-graph capturable): plans depend on shapes only."""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.dsa_indexer.sm90 import SPEC, config
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import num_sms, on_device
from forgekernel.runtime.plans import PlanCache

_plans = PlanCache()
SCALE_OFFSET = config.PAGE * config.HEAD_DIM  # bytes of a page before its scales


def paged_cache_views(cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """deep_gemm's int8 / uint8 (pages, 64, 1, 132) cache (a page's 64 x 128 fp8 bytes, then its
    64 fp32 scales; page stride S bytes, a multiple of 16) as k float8_e4m3fn (64, 128, pages)
    strides (128, 1, S) and k_scale fp32 (64, pages) strides (1, S / 4): views, no copy."""
    pages, page_stride = cache.shape[0], cache.stride(0)
    flat = cache.view(torch.uint8)
    base = flat.as_strided((pages * page_stride,), (1,), flat.storage_offset()) if pages else flat
    k = base.as_strided(
        (config.PAGE, config.HEAD_DIM, pages), (config.HEAD_DIM, 1, page_stride)
    ).view(torch.float8_e4m3fn)
    scale = base.view(torch.float32).as_strided(
        (config.PAGE, pages), (1, page_stride // 4), base.view(torch.float32).storage_offset()
        + SCALE_OFFSET // 4,
    )  # fmt: skip
    return k, scale


def logits_width(keys: int) -> int:
    """Columns of a logits buffer for windows within `keys` (rows 16-byte aligned)."""
    return max(config.ALIGN, -(-keys // config.ALIGN) * config.ALIGN)


def _logits_plan(qtokens, paged, groups, max_tiles, device_index):
    splits, per = config.split_plan(groups, max_tiles, qtokens, num_sms(device_index))
    return get_kernel(SPEC, config.logits_params(qtokens, paged)), splits, per


def _topk_plan(paged, rows, width, device_index):
    cluster = config.topk_cluster(rows, width, num_sms(device_index))
    return get_kernel(SPEC, config.topk_params(cluster, paged))


def logits_paged(
    q: torch.Tensor,
    weights: torch.Tensor,
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    logits: torch.Tensor,
    next_n: int,
) -> None:
    """logits (B x next_n, >= max_pages x 64) fp32 of q (B x next_n x 64, 128) fp8 rows and
    weights (B x next_n, 64) fp32 against the paged cache; columns are sequence positions."""
    b, max_pages = block_table.shape
    if b == 0 or max_pages == 0:
        return
    k, scale = paged_cache_views(cache)
    key = (next_n, True, b, max_pages, q.device.index)
    fn, splits, per = _plans.get_or_build(key, _logits_plan)
    with on_device(q.device):
        fn(q, weights, k, scale, block_table, seq_lens, None, None, logits, per, splits)


def logits_contiguous(
    q: torch.Tensor,
    weights: torch.Tensor,
    k: torch.Tensor,
    k_scale: torch.Tensor,
    k_start: torch.Tensor,
    k_end: torch.Tensor,
    logits: torch.Tensor,
) -> None:
    """logits (rows, >= keys) fp32 of q (rows x 64, 128) fp8 and weights (rows, 64) against k
    (keys, 128) fp8 / k_scale (keys,) within each row's [k_start, k_end); columns are key ids."""
    rows = weights.shape[0]
    if rows == 0 or k.shape[0] == 0:
        return
    qtokens = config.logits_qtokens(None)
    groups = -(-rows // qtokens)
    key = (qtokens, False, groups, -(-k.shape[0] // config.TILE) + 1, q.device.index)
    fn, splits, per = _plans.get_or_build(key, _logits_plan)
    with on_device(q.device):
        fn(q, weights, k, k_scale, None, None, k_start, k_end, logits, per, splits)


def topk_paged(
    logits: torch.Tensor,
    block_table: torch.Tensor,
    seq_lens: torch.Tensor,
    next_n: int,
    out: torch.Tensor,
) -> None:
    """out (B x next_n, topk) int32: cache slots of each row's top-k positions (ascending), -1
    padded; row r sees positions < seq_lens[r // next_n] - next_n + 1 + r % next_n."""
    rows = out.shape[0]
    if rows == 0 or out.shape[1] == 0:
        return
    fn = _plans.get_or_build(
        ("topk", True, rows, block_table.shape[1] * config.PAGE, logits.device.index),
        lambda _, paged, r, w, d: _topk_plan(paged, r, w, d),
    )
    with on_device(logits.device):
        fn(logits, block_table, seq_lens, None, None, out, next_n)


def topk_windows(
    logits: torch.Tensor, k_start: torch.Tensor, k_end: torch.Tensor, width: int, out: torch.Tensor
) -> None:
    """out (rows, topk) int32: the columns of each row's top-k in [k_start, k_end) (ascending),
    -1 padded; `width` bounds every window (the plan's cluster size)."""
    rows = out.shape[0]
    if rows == 0 or out.shape[1] == 0:
        return
    fn = _plans.get_or_build(
        ("topk", False, rows, width, logits.device.index),
        lambda _, paged, r, w, d: _topk_plan(paged, r, w, d),
    )
    with on_device(logits.device):
        fn(logits, None, None, k_start, k_end, out, 1)
