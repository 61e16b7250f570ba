"""Host launcher of the sm90 convolution: torch only (no DSL), the forward kernel through the
compile cache. Callers validate first (`forgekernel.ops.conv`) and hand over channels-last 5-D
views: x (N, D, H, W, C), w (K, T, R, S, C), y (N, Z, P, Q, K) (a 2-D convolution has D = Z =
T = 1).

- `fprop`: one launch of the forward kernel, its tile and split (the reduction cut into parts
  for problems of few tiles) from `config.choose_plan` (the K = 128 conv3d layers' 256x128
  tile where `config.takes_tall`). At stride 1 the output tiles may be
  rectangles (`geometry.rect_width`), but a 1x1 filter's walk im2col rows unless the caller
  asks for rectangles (`_launch`'s `rect_1x1`; the H200's 1x1 layers lost up to half their rate
  on rectangles: docs/conv/NOTES.md, "Measured: rectangles"). C or K not a multiple of 8
  (16-byte rows) run zero-padded (zero channels add nothing; extra output channels are
  dropped), and an output the kernel cannot write in place (not compact, or padded) goes
  through a scratch buffer. A split's fp32 partials and per-tile flags are the stream's
  stream-K workspace. A 2-D convolution of few channels (`few_channels`): the stem (C <= 8,
  stride 2) as the stride-1 convolution of its space-to-depth fold (stem.py, the fold kernel),
  the others as a 1x1 one over its im2col, in the forward (rectangles allowed) and the weight
  gradient.
- `dgrad`: the data gradient as stride-1 forward convolutions of dy, one per output phase
  (`geometry.dgrad_phases`). Stride 1: one launch of the kernel's data-gradient mode, which
  reads W (K, T, R, S, C) itself (N-major, taps reversed in the kernel); a 1x1 filter's on the
  im2col walk, as in the forward. Strides 1 or 2 per dim (not all 1): one launch of the fused
  kernel (dgrad_kernel.py) over every phase and its tiles, on one im2col walk of dy
  (`geometry.fused_dgrad`), W whole, each phase's rows stored straight into their strided view
  of dx and the phases no tap reaches zero-filled by the same launch.
  Other strides (3 and up): a launch of the data-gradient mode per phase on a strided view of
  its taps, on rectangles (a 1x1 phase's too, where the chooser takes them) written straight
  into its strided view of dx, else through a scratch buffer (phases no tap reaches are zero:
  one fill of dx where two or more are).
- `wgrad`: one launch of the weight-gradient kernel (wgrad.py: the dense GEMM's kernel with
  dY^T and the im2col of x as operands, the N x Z x P x Q reduction split over CTAs and summed
  in split order by the last part). Stride 1: the reduction's k-tiles are rectangles of output
  pixels (`geometry.rect_width`), dY and x through tiled TMAs (no im2col rate), unless the
  chooser prefers the im2col walk (`_wgrad_im2col`: zero-filled rectangles of small maps);
  other strides: the im2col walk. Tile and split from `wgrad_config.choose_wgrad`, the fp32
  partials and per-tile flags in the stream's stream-K workspace (the dense GEMM launcher's:
  reused across calls, a capture's own when it needs a bigger one). The reduce split
  (`choose_wgrad_reduce`: the parts bulk-reduce-added into one fp32 slot a tile, kept zero
  like the flags, runtime/scratch.py `flags`) where `reduce=True` on the rectangles, and by
  itself on the unpadded 1x1s of long reductions that the model prefers it on
  (`wgrad_prefers_reduce`; `takes_reduce`: from REDUCE_FROM_K_TILES pixel k-tiles, below
  REDUCE_ANY_FROM_K_TILES only where its plan cuts K into at most REDUCE_MAX_K_STRIPES tile
  rows), unless torch's deterministic algorithms are on (its parts add in arrival order).
- `as_gemm`: an unpadded stride-1 1x1 convolution without bias as one launch of the dense GEMM
  on views of the same tensors (forward y = x w^T, data gradient dx = dy w); taken by `fprop` /
  `dgrad` where `ONE_BY_ONE_AS_GEMM` says so (the forward from 256 input and 128 output
  channels, the data gradient never: measured; the bench's `as_gemm` variant runs it).
"""

from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn.functional as F

from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, SPEC, WGRAD_SPEC
from forgekernel.kernels.conv.sm90.config import (
    CHANNEL_ALIGN,
    K_TILE,
    NUM_SMS_H100_H200,
    ConvConfig,
    SplitPlan,
    choose_plan,
    params_for,
    split_tiles,
)
from forgekernel.kernels.conv.sm90.dgrad_config import (
    FusedPlan,
    choose_fused,
    fused_config,
    fused_params,
    fused_plan,
)
from forgekernel.kernels.conv.sm90.geometry import (
    FusedDgrad,
    Geometry,
    Phase,
    dgrad_phases,
    fused_dgrad,
    fused_dgrad_problem,
    rect_k_tiles,
    rect_width,
)
from forgekernel.kernels.conv.sm90.wgrad_config import (
    WgradPlan,
    choose_wgrad,
    choose_wgrad_reduce,
    wgrad_params,
    wgrad_prefers_im2col,
    wgrad_prefers_reduce,
    wgrad_tiles,
)
from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_launch
from forgekernel.kernels.gemm.dense.sm90.launch import stream_k_workspace
from forgekernel.runtime import pdl
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, num_sms, on_device, tma_ready
from forgekernel.runtime.plans import PlanCache
from forgekernel.runtime.scratch import flags as zero_flags


def _round_up(x: int) -> int:
    return -(-x // CHANNEL_ALIGN) * CHANNEL_ALIGN


def _choose(
    dtype, bias, m, k, c, taps, device_index, config, dgrad, pixels, rows, strided, _pdl=None
):
    """(the compiled function, clusters of the persistent grid, the SplitPlan) of one launch.
    `config`: None (chosen), a ConvConfig (a split one cut into FORCED_PARTS parts; at stride
    1 on rectangles of `rect_width`) or a SplitPlan (its own walk). `pixels`: (N, Z, P, Q) of a
    stride-1 forward whose output tiles may be rectangles (`_launch`), else None; `rows`:
    whether the chooser may take the im2col walk there (False: y is a view its (M, K) rows would
    reach only through a scratch copy); `strided`: a strided forward (the chooser's strided
    rows, config.STRIDED_ROWS_128). The function is looked up here, once per problem, not per
    launch."""
    sms = num_sms(device_index) if device_index is not None else NUM_SMS_H100_H200
    if config is None:
        plan = choose_plan(
            m, k, c, taps, sms, pixels, im2col=rows, strided=strided, forward=not dgrad
        )
    else:
        rect = config.rect if isinstance(config, SplitPlan) else 0
        if pixels is not None and not isinstance(config, SplitPlan):
            rect = rect_width(*pixels[2:], config.tile_m)
        if rect and pixels is None:
            raise ValueError("a plan of output rectangles for a strided or dgrad launch")
        given = config.per_split if isinstance(config, SplitPlan) else None
        config = config.config if isinstance(config, SplitPlan) else config
        k_tiles = -(-c // K_TILE) * taps
        per = k_tiles
        if config.split:
            per = given or -(-k_tiles // min(FORCED_PARTS, k_tiles))
        # parts and tiles as the kernel counts them for this problem: the workspace and flags
        # are sized by them (a plan made for another problem, e.g. one SplitPlan for every
        # phase of a data gradient, would have the kernel write past its workspace)
        tiles = split_tiles(config, m, k, pixels, rect)
        plan = SplitPlan(config, per, -(-k_tiles // per), tiles, rect)
    cfg = plan.config
    params = params_for(dtype_name(dtype), bias, cfg, dgrad=dgrad, rect=plan.rect)
    # one CTA per SM (the pipeline takes nearly all shared memory)
    return (
        get_kernel(SPEC, pdl.key(params, pdl.enabled(), pdl.trigger())),
        sms // (cfg.cluster_m * cfg.cluster_n),
        plan,
    )


FORCED_PARTS = 3  # a split configuration asked for by name cuts its reduction this many ways


_plans = PlanCache()


def _channels_padded(t: torch.Tensor, channels: int) -> torch.Tensor:
    """t (..., c) with zero channels up to `channels` (a fresh buffer), or t TMA-ready."""
    if t.shape[-1] == channels:
        return as_tma_ready(t)
    p = t.new_zeros(*t.shape[:-1], channels)
    p[..., : t.shape[-1]].copy_(t)
    return p


def _rows_padded(t: torch.Tensor, rows: int) -> torch.Tensor:
    """t (k, ...) with zero rows up to `rows`, or t itself."""
    if t.shape[0] == rows:
        return t
    p = t.new_zeros(rows, *t.shape[1:])
    p[: t.shape[0]].copy_(t)
    return p


def _cropped(x: torch.Tensor, geometry: Geometry) -> tuple[torch.Tensor, Geometry]:
    """x and the geometry with negative padding (a data-gradient phase's: its windows start
    inside the input, or stop short of its end) turned into a crop of x: the kernel and its
    descriptor only ever see padding >= 0. The cropped view keeps x's strides (TMA-ready)."""
    if min(geometry.pad_lo) >= 0 and min(geometry.pad_hi) >= 0:  # every forward convolution
        return x, geometry
    lo, hi = list(geometry.pad_lo), list(geometry.pad_hi)
    for i in range(3):
        if lo[i] < 0:
            x = x.narrow(1 + i, -lo[i], x.shape[1 + i] + lo[i])
            lo[i] = 0
        if hi[i] < 0:
            x = x.narrow(1 + i, 0, x.shape[1 + i] + hi[i])
            hi[i] = 0
    if lo == list(geometry.pad_lo) and hi == list(geometry.pad_hi):
        return x, geometry
    return x, dataclasses.replace(geometry, pad_lo=tuple(lo), pad_hi=tuple(hi))


def fprop(
    x: torch.Tensor,
    w: torch.Tensor,
    bias: torch.Tensor | None,
    y: torch.Tensor,
    geometry: Geometry,
    config: ConvConfig | SplitPlan | None = None,
) -> None:
    """y = conv(x, w) (+ bias) written into y (any (N, Z, P, Q, K) view); x, w, bias (K,) alike
    16-bit on one device; the geometry's descriptor problem checked by the caller. `config`:
    the tile (and split) to use, chosen when None. A 2-D convolution of few input channels and
    several taps (`few_channels`): the stem (C <= 8, stride 2; ResNet's C = 3 7x7) by its fold
    where no config is given (`_stem`), the rest as a 1x1 one over its explicit im2col
    (`fprop_im2col`); an unpadded 1x1 without bias, the dense GEMM where `ONE_BY_ONE_AS_GEMM`
    takes it (`as_gemm`)."""
    if config is None and bias is None and _takes_gemm("fwd", x.shape[-1], y.shape[-1]):
        if as_gemm(x, w, y, geometry, dgrad=False):
            return
    if few_channels(x, w, geometry):
        if config is None and _stem().fits(x, w, geometry):
            _stem().fprop(x, w, bias, y, geometry, kernel=True)
        else:
            fprop_im2col(x, w, bias, y, geometry, config)
        return
    _launch(x, w, bias, y, geometry, config, dgrad=False, rect_1x1=False)


def fprop_im2col(x, w, bias, y, geometry: Geometry, config=None) -> None:
    """`fprop` of a few-channel convolution as a 1x1 one over its explicit im2col: C 9-16, a
    given config, and the bench's `im2col` variant on the stem."""
    cols, one = _im2col(x, geometry, tuple(y.shape[1:4]))
    w_cols = _taps_as_channels(w, cols.shape[-1])
    _launch(cols, w_cols, bias, y, one, config, dgrad=False, rect_1x1=True)


# The stem (stem.py `fits`: 2-D, C <= 8, stride 2, several taps; ResNet's C = 3 7x7) runs as
# the stride-1 convolution of its space-to-depth fold, written by the fold kernel, where no
# tile or plan is asked for; the im2col where one is, and for C 9-16. H200 2026-12-03 (graph /
# eager, n32-c3-224x224-k64-7x7-s2, the fold as the variant `stem_fold` against the im2col
# path): forward 0.186x / 0.206x the im2col path's time, weight gradient 0.239x / 0.257x.
def _stem():
    from forgekernel.kernels.conv.sm90 import stem  # stem.py imports this module

    return stem


# A 2-D convolution with at most this many input channels (padded to 8) and at least
# FEW_CHANNELS_TAPS taps runs on its im2col: each k-tile of 64 channels of one tap would carry
# 8 (C = 3) useful ones, 49 k-tiles for the stem's 7x7 where its im2col has 3.
FEW_CHANNELS = 16
FEW_CHANNELS_TAPS = 4


def few_channels(x: torch.Tensor, w: torch.Tensor, geometry: Geometry) -> bool:
    """Whether the convolution of x (N, D, H, W, C) with w (K, T, R, S, C) takes the explicit
    im2col (2-D only: D = T = 1 and one output plane; a conv3d of one input plane padded in
    depth has Z > 1 output planes, which the 2-D im2col does not make)."""
    # the channel count first: it rules out nearly every call for the price of one compare
    if _round_up(x.shape[-1]) > FEW_CHANNELS:
        return False
    if x.numel() == 0 or w.numel() == 0:  # nothing to unfold (the launchers' empty cases)
        return False
    taps = w.shape[1] * w.shape[2] * w.shape[3]
    flat = x.shape[1] == 1 and w.shape[1] == 1 and geometry.output((1, 1, 1))[0] == 1
    return flat and taps >= FEW_CHANNELS_TAPS


def _im2col(x: torch.Tensor, geometry: Geometry, out_dhw) -> tuple[torch.Tensor, Geometry]:
    """x (N, 1, H, W, C) as its windows (N, 1, P, Q, R x S x C rounded up to 8), taps in (r, s)
    order with the channels fastest (W's (K, T, R, S, C) order), zero padding and zero tail
    channels, and the 1x1 geometry that convolves them. One strided copy: the windows are a
    view (N, P, Q, R, S, C) of x (of x padded spatially once, channels-last, where the geometry
    pads), copied into the buffer's first R x S x C channels; the tail's fill. Two to four
    launches (pad: fill and copy), no host sync, no data-dependent shape (capture-safe).
    docs/conv/NOTES.md, "The stem's im2col as one strided copy"."""
    x, geometry = _cropped(x, geometry)  # negative padding (none from the ops) as a crop
    n, c = x.shape[0], x.shape[-1]
    _, p, q = out_dhw
    (_, r, s_), lo, hi = geometry.filter, geometry.pad_lo, geometry.pad_hi
    planes = x[:, 0]  # (N, H, W, C), a view
    if any(lo[1:] + hi[1:]):
        planes = F.pad(planes, (0, 0, lo[2], hi[2], lo[1], hi[1]))  # a fresh contiguous copy
    sn, sh, sw, sc = planes.stride()
    (_, uh, uw), (_, dh, dw) = geometry.stride, geometry.dilation
    windows = planes.as_strided(
        (n, p, q, r, s_, c),
        (sn, uh * sh, uw * sw, dh * sh, dw * sw, sc),
        planes.storage_offset(),
    )
    width = r * s_ * c
    cols = x.new_empty(n, 1, p, q, _round_up(width))
    cols[..., :width].view(n, p, q, r, s_, c).copy_(windows)
    if cols.shape[-1] > width:
        cols[..., width:].zero_()
    one = Geometry((1, 1, 1), (0, 0, 0), (0, 0, 0))
    return cols, one


def _taps_as_channels(w: torch.Tensor, channels: int) -> torch.Tensor:
    """w (K, 1, R, S, C) as the 1x1 filter (K, 1, 1, 1, `channels`) of its im2col: R x S x C
    channels in memory order, zero past them."""
    k = w.shape[0]
    flat = w.reshape(k, -1)
    out = w.new_zeros(k, 1, 1, 1, channels)
    out.view(k, channels)[:, : flat.shape[1]].copy_(flat)
    return out


def _launch(x, w, bias, y, geometry: Geometry, config, dgrad: bool, rect_1x1: bool) -> None:
    """One launch of the kernel: y = conv(x, W) (+ bias) into y (any (N, Z, P, Q, K') view).
    W is w (K', T, R, S, C), or in the data-gradient mode w (C, T, R, S, K') read N-major with
    its taps reversed (C: x's channels, the reduction's; K': y's). At stride 1 the output tiles
    may be rectangles; a 1x1 filter's only where `rect_1x1` (the stem's im2col; a strided data
    gradient's phases, whose rectangles write dx's strided views in place) or where `config` is
    a SplitPlan of rectangles: a user's 1x1 walks im2col rows."""
    c = x.shape[-1]
    k = w.shape[-1] if dgrad else w.shape[0]
    m = y.numel() // max(k, 1)
    if m == 0 or k == 0:
        return
    if c == 0:  # no reduction: the bias alone
        y.copy_(bias.expand_as(y) if bias is not None else torch.zeros_like(y))
        return
    cp, kp = _round_up(c), _round_up(k)
    x, geometry = _cropped(_channels_padded(x, cp), geometry)
    if dgrad:
        w = _channels_padded(_rows_padded(w, cp), kp)
    else:
        w = _rows_padded(_channels_padded(w, cp), kp)
    if bias is not None:
        # the compiled function takes bias 16-byte aligned (it checks: "Misaligned Tensor
        # data"), which a view such as b[1:] is not: a copy then
        bias = _channels_padded(bias, kp)
    _, t, r, s, _ = w.shape  # one shape read (each costs 0.1-0.2 us on every launch)
    pixels = None
    one = t * r * s == 1
    strided = geometry.stride != (1, 1, 1)
    if one and not rect_1x1:  # a plan of rectangles asked for by name still gets them
        rect_1x1 = isinstance(config, SplitPlan) and config.rect > 0
    if not strided and (rect_1x1 or not one):  # output tiles may be rectangles
        pixels = tuple(y.shape[:4])
        if one and m % 8 == 0 and not any(geometry.pad_lo + geometry.pad_hi):
            # an unpadded 1x1: x's pixels are y's, both seen as one plane 8 pixels wide (the
            # rectangles then tile_m consecutive pixels: no zero fill on small maps)
            flat = _one_plane(x, m), _one_plane(y, m)
            if flat[0] is not None and flat[1] is not None:
                (x, y), pixels = flat, (1, 1, m // 8, 8)
    # the im2col walk writes y as (M, K) rows: a y not contiguous (a strided data gradient's
    # phase, a channel slice) would go through a scratch buffer and a copy, the rectangles
    # write it in place
    rows = pixels is None or y.is_contiguous()
    device = x.device
    key = (x.dtype, bias is not None, m, kp, cp, t * r * s, device.index, config, dgrad)
    fn, max_clusters, plan = _plans.get_or_build(
        (*key, pixels, rows, strided, pdl.forced()), _choose
    )
    if plan.rect:  # y (N, Z, P, Q, K), any TMA-ready view
        in_place = kp == k and tma_ready(y)
        y2 = y if in_place else y.new_empty(*y.shape[:4], kp)
    else:
        in_place = kp == k and y.is_contiguous() and tma_ready(y)
        y2 = y.view(m, k) if in_place else y.new_empty(m, kp)
    work = flags = None
    if plan.config.split:
        work, flags = stream_k_workspace(device, plan.tiles, plan.workspace_floats)
    with on_device(device):
        fn(x, w, y2, bias, work, flags, *geometry.kernel_args(), plan.per_split, max_clusters)
    if not in_place:
        y.copy_(y2[..., :k].reshape(y.shape))


# 1x1 convolutions as the dense GEMM (docs/conv/NOTES.md, "1x1 convolutions as GEMMs"), per
# op: None (never), or the least (reduction, output) channels from which the op takes the GEMM.
# Adoption rule: the bench variant `as_gemm` runs faster than the standard path (variant time /
# our time < 1) in both timings, graph and eager, on every bench case the entry covers, and
# >= 3% faster on most. H200 2026-12-03 (graph / eager, n32 ResNet 1x1s): forward, C >= 256 and
# K >= 128: 0.973 / 0.974 (c256-56x56-k128), 0.875 / 0.911 (c256-14x14-k1024), 0.945 / 0.944
# (c1024-k256), 0.964 / 0.969 (c1024-k512); left on the conv kernel: K = 64 (1.40 / 1.27 at
# C = 64, 1.15 / 1.11 at C = 256), c64-k256 (0.975 / 0.983, under 3%). Data gradient (reduction
# K, output C): 0.974 / 0.984 and 0.982 / 0.985 at C = 256, 1.42 / 1.27 and 1.14 / 1.11 at C =
# 64: under the 3% everywhere, off.
ONE_BY_ONE_AS_GEMM: dict[str, tuple[int, int] | None] = {"fwd": (256, 128), "dgrad": None}


def _takes_gemm(kind: str, reduction: int, channels: int) -> bool:
    """Whether `kind`'s unpadded 1x1 of `reduction` input and `channels` output channels goes to
    the dense GEMM (`ONE_BY_ONE_AS_GEMM`)."""
    least = ONE_BY_ONE_AS_GEMM[kind]
    return least is not None and reduction >= least[0] and channels >= least[1]


def as_gemm(
    a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, geometry: Geometry, dgrad: bool
) -> bool:
    """An unpadded stride-1 1x1 convolution as one launch of the dense GEMM on views (no copy):
    the forward y (M, K) = x (M, C) w (K, C)^T (a = x, out = y) or, `dgrad`, dx (M, C) = dy
    (M, K) w (K, C) (a = dy, out = dx; B "kn"), M = N x D x H x W pixels. False, nothing run,
    where the problem is not one (`gemm_views`): the caller takes the convolution's path."""
    views = gemm_views(a, w, out, geometry)
    if views is None:
        return False
    gemm_launch.gemm(*views, b_kn=dgrad)
    return True


def gemm_views(a: torch.Tensor, w: torch.Tensor, out: torch.Tensor, geometry: Geometry):
    """(a (M, reduction), w (K, C), out (M, channels)) as 2-D views of a (N, D, H, W, .), w (K,
    1, 1, 1, C) and out (N, D, H, W, .), or None: a filter other than 1x1x1, a stride or a
    padding, pixels other than the output's, channels not multiples of 8 (what the bench
    measures: the GEMM would pad them through copies), or pixels whose strides do not merge."""
    one = geometry.filter == (1, 1, 1) and geometry.stride == (1, 1, 1)
    if not one or any(geometry.pad_lo + geometry.pad_hi) or w.shape[1:4] != (1, 1, 1):
        return None
    n, d, h, wd, reduction = a.shape
    aligned = reduction % CHANNEL_ALIGN == 0 and out.shape[-1] % CHANNEL_ALIGN == 0
    if out.shape[:4] != (n, d, h, wd) or not aligned:
        return None
    m = n * d * h * wd
    try:
        return a.view(m, reduction), w.view(w.shape[0], -1), out.view(m, out.shape[-1])
    except RuntimeError:  # strides that do not merge: the convolution's path copies
        return None


def phase_taps(w: torch.Tensor, phase: Phase) -> torch.Tensor:
    """w (K, T, R, S, C) restricted to the taps that reach a data-gradient phase, in their
    own (ascending) order: an arithmetic progression per dim, so a strided view (no copy, no
    index tensor: CUDA graph capture sees no host-to-device copy). The kernel's data-gradient
    mode reads it N-major with the taps reversed."""
    for dim, taps in zip((1, 2, 3), phase.taps):
        if len(taps) == w.shape[dim]:  # every tap (a stride-1 gradient): w itself
            continue
        step = taps[1] - taps[0] if len(taps) > 1 else 1
        span = w.narrow(dim, taps[0], taps[-1] - taps[0] + 1)
        w = span[(slice(None),) * dim + (slice(None, None, step),)]
    return w


def phase_filter(w: torch.Tensor, phase: Phase) -> torch.Tensor:
    """The forward filter (C, T', R', S', K) of a data-gradient phase: `phase_taps` reversed,
    input and output channels swapped (a copy; what the data-gradient mode reads in place)."""
    return phase_taps(w, phase).flip(1, 2, 3).permute(4, 1, 2, 3, 0).contiguous()


def dgrad(
    dy: torch.Tensor,
    w: torch.Tensor,
    dx: torch.Tensor,
    geometry: Geometry,
    config: ConvConfig | SplitPlan | FusedPlan | None = None,
) -> None:
    """dx (N, D, H, W, C) = the data gradient at dy (N, Z, P, Q, K) of the convolution with w
    (K, T, R, S, C) and `geometry`, one stride-1 forward convolution per output phase: with
    strides 1 or 2 (not all 1) every phase in one launch of the fused kernel, otherwise a
    launch of the kernel's data-gradient mode per phase on w's phase taps (no copy of w).
    `config`: a forward configuration (the fused kernel takes its `fused_config` variant), a
    SplitPlan (per phase) or a FusedPlan (fused), or None (chosen). An unpadded stride-1 1x1:
    the dense GEMM where `ONE_BY_ONE_AS_GEMM` takes it (`as_gemm`)."""
    if config is None and _takes_gemm("dgrad", dy.shape[-1], dx.shape[-1]):
        if as_gemm(dy, w, dx, geometry, True):
            return
    input_dhw, output_dhw = tuple(dx.shape[1:4]), tuple(dy.shape[1:4])
    fuses = _fuses(geometry, input_dhw, output_dhw)
    if fuses and not isinstance(config, SplitPlan):
        _fused(dy, w, dx, fused_dgrad(geometry, input_dhw, output_dhw), config)
        return
    if isinstance(config, FusedPlan):
        problem = fused_dgrad_problem(geometry, input_dhw, output_dhw)
        raise ValueError(f"a FusedPlan for a data gradient that does not fuse: {problem}")
    phases, empties = _phases(geometry, input_dhw, output_dhw)
    sd, sh, sw = geometry.stride
    empty, phased = sum(empties), len(phases) > 1
    if empty > 1:  # one fill of dx rather than one strided fill per empty phase
        dx.zero_()
    for phase, phase_empty in zip(phases, empties):
        ad, ah, aw = phase.offset
        view = dx[:, ad::sd, ah::sh, aw::sw] if phased else dx
        if phase_empty:
            if empty == 1:
                view.zero_()
            continue
        # a strided gradient's phases (1x1 ones too) write dx's strided views in place on
        # rectangles; a stride-1 gradient (one phase) of a 1x1 filter walks im2col rows
        w_phase = phase_taps(w, phase)
        _launch(dy, w_phase, None, view, phase.fprop, config, dgrad=True, rect_1x1=phased)


@functools.lru_cache(maxsize=1024)
def _phases(geometry: Geometry, input_dhw, output_dhw) -> tuple[tuple[Phase, ...], tuple]:
    """The data gradient's phases and whether each is empty: the same on every call."""
    phases = dgrad_phases(geometry, input_dhw, output_dhw)
    return phases, tuple(phase.empty() for phase in phases)


@functools.lru_cache(maxsize=1024)
def _fuses(geometry: Geometry, input_dhw, output_dhw) -> bool:
    """Whether the data gradient runs as one fused launch (`fused_dgrad_problem`)."""
    return fused_dgrad_problem(geometry, input_dhw, output_dhw) is None


def _fused(dy, w, dx, fused: FusedDgrad, config) -> None:
    """One launch of the fused data-gradient kernel: dx = every phase of the gradient at dy
    of the convolution with w. K or C not a multiple of 8 run zero-padded (a dx of padded
    channels through a scratch buffer); dy cropped where the walk's padding is negative."""
    k, c = dy.shape[-1], dx.shape[-1]
    if dx.numel() == 0:
        return
    if k == 0 or dy.numel() == 0 or w.numel() == 0:  # no reduction: every entry is zero
        dx.zero_()
        return
    kp, cp = _round_up(k), _round_up(c)
    dy, walk = _cropped(_channels_padded(dy, kp), fused.walk)
    w = _channels_padded(_rows_padded(w, kp), cp)
    in_place = cp == c and tma_ready(dx)
    dx2 = dx if in_place else dx.new_empty(*dx.shape[:4], cp)
    device = dy.device
    fn, max_clusters, plan, args = _plans.get_or_build(
        (dy.dtype, tuple(dx.shape[:4]), kp, cp, fused, walk, device.index, config, pdl.forced()),
        _choose_fused,
    )
    work = flags = None
    if plan.config.split:
        work, flags = stream_k_workspace(device, plan.tiles, plan.workspace_floats)
    with on_device(device):
        fn(dy, w, dx2, work, flags, *args, plan.per_split, max_clusters)
    if not in_place:
        dx.copy_(dx2[..., :c])


def _choose_fused(dtype, dx_ndhw, kp, cp, fused: FusedDgrad, walk, device_index, config, _pdl=None):
    """(the compiled function, clusters of the persistent grid, the FusedPlan, the geometry
    arguments) of one fused launch. `config`: None (chosen), a forward ConvConfig (its fused
    variant, a split one cut into FORCED_PARTS parts per phase) or a FusedPlan (its tile and
    k-tiles per part, recounted for this problem)."""
    sms = num_sms(device_index) if device_index is not None else NUM_SMS_H100_H200
    n_img, *input_dhw = dx_ndhw
    m = n_img
    for size, s in zip(input_dhw, fused.stride):
        m *= -(-size // s)
    c_blocks = -(-kp // K_TILE)
    k_tiles = tuple(c_blocks * fused.tap_count(phase) for phase in fused.order)
    if config is None:
        plan = choose_fused(m, cp, k_tiles, sms)
    else:
        given = config.per_split if isinstance(config, FusedPlan) else None
        cfg = fused_config(config.config if isinstance(config, FusedPlan) else config)
        most = max(k_tiles)
        per = given or (-(-most // min(FORCED_PARTS, most)) if cfg.split and most else most)
        plan = fused_plan(cfg, m, cp, k_tiles, max(per, 1))
        if plan.split and not cfg.split:
            raise ValueError(f"{cfg.tag()} does not split, but {per} k-tiles a part does")
    params = fused_params(dtype_name(dtype), plan.config)
    fn = get_kernel(DGRAD_SPEC, pdl.key(params, pdl.enabled(), pdl.trigger()))
    cfg = plan.config
    return fn, sms // (cfg.cluster_m * cfg.cluster_n), plan, fused.kernel_args(walk)


_wgrad_plans = PlanCache()


def clear_plans() -> None:
    """Forget every plan (each holds the compiled function it looked up: tests that swap
    `get_kernel` start from none)."""
    _plans.clear()
    _wgrad_plans.clear()
    _phases.cache_clear()
    _wgrad_walk.cache_clear()
    _wgrad_im2col.cache_clear()
    _fuses.cache_clear()


# The reduce split by itself on the unpadded 1x1s of REDUCE_FROM_K_TILES pixel k-tiles or more
# where the model prefers it (`wgrad_prefers_reduce`), below REDUCE_ANY_FROM_K_TILES only where
# its plan cuts dY's K channels into at most REDUCE_MAX_K_STRIPES tile rows (A's box then covers
# half of each dY pixel row or more). Reduce / parked time on the H200 (graph replays, the
# bench's `reduce` variant; 14:19 / 18:58): the n32 56x56 1x1s (1568 k-tiles, 1-2 stripes)
# 0.745-0.923x at 14:19; at 28x28 (392) c512-k128 0.973 / 0.920x and c512-k256 0.921 / 0.817x
# (1 and 2 stripes), c128-k512 1.057 / 1.134x (4); c1024-14x14-k512 (98, 4) 1.070 / 0.996x.
# The model prices c128-k512 and c512-k128 alike (transposes: the same tiles, parts and bytes);
# the stripes part winners from losers on all 10 rows (so does "the tile holds min(C, K)
# whole": the bench's `reduce_64x128` tells the two apart). No 4-stripe case of 1024 k-tiles
# or more was timed: those keep the 14:19 rule (docs/conv/NOTES.md, "The reduce split refit
# from 18:58").
REDUCE_FROM_K_TILES = 384
REDUCE_ANY_FROM_K_TILES = 1024
REDUCE_MAX_K_STRIPES = 2


def takes_reduce(k: int, c: int, k_tiles: int, sms: int) -> WgradPlan | None:
    """The reduce plan the launcher takes by itself on an unpadded 1x1 of K output and C input
    channels over `k_tiles` pixel k-tiles (the rectangles' walk), else None."""
    if k_tiles < REDUCE_FROM_K_TILES:
        return None
    plan = wgrad_prefers_reduce(k, c, 1, k_tiles, sms)
    if plan is None or k_tiles >= REDUCE_ANY_FROM_K_TILES:
        return plan
    stripes = wgrad_tiles(plan.config, k, 1, 1)  # its K tiles: one C tile of one tap
    return plan if stripes <= REDUCE_MAX_K_STRIPES else None


def _wgrad_plan(
    dtype, k, c, taps, walk, device_index, plan, reduce=False, auto=False, _pdl_forced=None
) -> tuple[object, WgradPlan]:
    """(the compiled function, the WgradPlan) of one problem: looked up once, not per call.
    `walk`: (the compile key's rect, pixel k-tiles); `reduce` (no plan given, the rectangles'
    walk): the reduce split's plan (`wgrad_config.choose_wgrad_reduce`); `auto`: that plan
    where `takes_reduce` takes it (a 1x1 without padding)."""
    rect, k_tiles = walk
    sms = num_sms(device_index) if device_index is not None else NUM_SMS_H100_H200
    taken = None  # the reduce plan the launcher takes by itself on a 1x1 (`auto`)
    if plan is None and rect and not reduce and auto and taps == 1:
        taken = takes_reduce(k, c, k_tiles, sms)
    if taken is not None:
        plan = taken
    elif plan is None and reduce and rect:
        plan = choose_wgrad_reduce(k, c, taps, k_tiles, sms)
    elif plan is None:
        plan = choose_wgrad(k, c, taps, k_tiles, sms, tiled=rect > 0)
    else:  # its splits and tiles as the kernel counts them (the workspace's size)
        splits = -(-k_tiles // plan.per_split)
        tiles = wgrad_tiles(plan.config, k, c, taps)
        reduced = getattr(plan, "reduce", False) and splits > 1
        plan = WgradPlan(plan.config, plan.per_split, splits, tiles, reduce=reduced)
    params = wgrad_params(dtype_name(dtype), plan.config, rect, plan.reduce and plan.parts > 1)
    return get_kernel(WGRAD_SPEC, pdl.key(params, pdl.enabled(), pdl.trigger())), plan


def wgrad(
    dy: torch.Tensor,
    x: torch.Tensor,
    dw: torch.Tensor,
    geometry: Geometry,
    plan: WgradPlan | None = None,
    reduce: bool = False,
) -> None:
    """dw (K, T, R, S, C) = the weight gradient at dy (N, Z, P, Q, K) of the convolution of x
    (N, D, H, W, C) with `geometry`: one launch of the weight-gradient kernel (`plan`: its
    tile and split, chosen when None; `reduce`, no plan and the rectangles' walk: the reduce
    split's plan, its parts added in arrival order: not bitwise repeatable; taken by itself on
    long 1x1s, `takes_reduce`, unless torch's deterministic algorithms are on). C or K not a
    multiple of 8 run zero-padded; a dw the kernel cannot write in place goes through a
    scratch buffer."""
    k = dw.shape[0]
    m = dy.numel() // max(k, 1)
    if m == 0 or dw.numel() == 0:
        dw.zero_()
        return
    if few_channels(x, dw, geometry):  # the stem: its fold (`_stem`), else the im2col
        if plan is None and not reduce and _stem().fits(x, dw, geometry):
            _stem().wgrad(dy, x, dw, geometry, kernel=True)
        else:
            wgrad_im2col(dy, x, dw, geometry, plan, reduce)
        return
    _wgrad_launch(dy, x, dw, geometry, plan, reduce)


def wgrad_im2col(dy, x, dw, geometry: Geometry, plan=None, reduce: bool = False) -> None:
    """`wgrad` of a few-channel convolution as the 1x1 weight gradient over its im2col (C 9-16,
    a given plan, the bench's `im2col` variant on the stem)."""
    k, c = dw.shape[0], dw.shape[-1]
    cols, one = _im2col(x, geometry, tuple(dy.shape[1:4]))
    dw_cols = dw.new_empty(k, 1, 1, 1, cols.shape[-1])
    _wgrad_launch(dy, cols, dw_cols, one, plan, reduce, auto=False)  # reduce unmeasured
    width = dw.shape[2] * dw.shape[3] * c
    dw.copy_(dw_cols.view(k, -1)[:, :width].view(dw.shape))


def _one_plane(t: torch.Tensor, m: int) -> torch.Tensor | None:
    """t (N, D, H, W, C) of m pixels viewed as (1, 1, m / 8, 8, C), or None where its pixel
    strides do not merge (no copy)."""
    try:
        return t.view(1, 1, m // 8, 8, t.shape[-1])
    except RuntimeError:
        return None


@functools.lru_cache(maxsize=256)
def _wgrad_walk(stride1: bool, n: int, z: int, p: int, q: int) -> tuple[int, int]:
    """(the compile key's rect, pixel k-tiles) of the weight gradient's reduction over N x Z x P
    x Q outputs: stride 1, rectangles (geometry.rect_width); else the im2col walk's 64 pixels."""
    if stride1:
        rect = rect_width(p, q)
        return rect, rect_k_tiles(n, z, p, q, rect)
    return 0, -(-(n * z * p * q) // K_TILE)


@functools.lru_cache(maxsize=256)
def _wgrad_im2col(k: int, c: int, taps: int, walk: tuple[int, int], m: int, device_index) -> bool:
    """Whether the stride-1 weight gradient of `walk` (its rectangles) over m pixels takes the
    im2col walk instead (`wgrad_config.wgrad_prefers_im2col`: the 7x7 / 14x14 maps' 23%
    zero-filled rectangles)."""
    sms = num_sms(device_index) if device_index is not None else NUM_SMS_H100_H200
    return wgrad_prefers_im2col(k, c, taps, walk[1], -(-m // K_TILE), sms)


def _wgrad_launch(dy, x, dw, geometry: Geometry, plan, reduce=False, auto=True) -> None:
    """One launch of the weight-gradient kernel (`wgrad`'s arguments, dw not empty; `auto`:
    the reduce split by itself where `_wgrad_plan` takes it)."""
    k, t, r, s, c = dw.shape  # one shape read (each costs 0.1-0.2 us on every launch)
    n, z, p, q, _ = dy.shape
    m = n * z * p * q
    cp, kp = _round_up(c), _round_up(k)
    x = _channels_padded(x, cp)
    stride1 = geometry.stride == (1, 1, 1)
    one_by_one = t * r * s == 1 and not any(geometry.pad_lo + geometry.pad_hi)
    if stride1 and one_by_one and m % 8 == 0:
        # a 1x1 without padding reads x's pixels as dy's: both as one plane of 8-pixel rows,
        # the rectangles then 64 consecutive pixels (no zero fill on small maps)
        flat = _one_plane(dy, m), _one_plane(x, m)
        if flat[0] is not None and flat[1] is not None:
            (dy, x), (n, z, p, q) = flat, (1, 1, m // 8, 8)
    device = dy.device
    walk = _wgrad_walk(stride1, n, z, p, q)
    if walk[0] and _wgrad_im2col(kp, cp, t * r * s, walk, m, device.index):
        walk = (0, -(-m // K_TILE))
    if walk[0]:  # rectangles of output pixels, dy (N, Z, P, Q, K)
        dy2 = _channels_padded(dy, kp)
    else:  # the im2col walk, dy (M, K)
        dy2 = _channels_padded(dy.reshape(m, k), kp)
    in_place = kp == k and cp == c and dw.is_contiguous() and tma_ready(dw)
    dw2 = dw if in_place else dw.new_empty(kp, t, r, s, cp)
    auto = auto and one_by_one and plan is None and not torch.are_deterministic_algorithms_enabled()
    fn, plan = _wgrad_plans.get_or_build(
        (dy.dtype, kp, cp, t * r * s, walk, device.index, plan, reduce, auto, pdl.forced()),
        _wgrad_plan,
    )
    reduced = plan.reduce and plan.parts > 1
    work, flags = stream_k_workspace(device, plan.tiles, 4 if reduced else plan.workspace_floats)
    if reduced:  # one sum slot a tile, zero (every launch leaves it zero, as the flags)
        with on_device(device):
            work = zero_flags("conv_wgrad.sums", plan.workspace_floats, device).view(torch.float32)
    with on_device(device):
        fn(dy2, x, dw2, work, flags, *geometry.kernel_args(), plan.per_split)
    if not in_place:
        dw.copy_(dw2[:k, ..., :c])
