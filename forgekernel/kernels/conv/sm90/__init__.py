"""Implicit-GEMM convolution forward (conv2d / conv3d, channels-last) and, in its data-gradient
mode, the stride-1 data gradient; the strided data gradient with every phase in one launch
(`dgrad_kernel.py`); the weight gradient (`wgrad.py`); the stem's fold of x (`fold.py`),
sm_90a. DSL-free declaration; the forward kernel is `kernel.py`, the geometry it is driven with
`geometry.py`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.conv.sm90.config import (
    CANDIDATES,
    DTYPES,
    STANDARD_CONFIGS,
    TALL,
    TALL_RECT,
    ConvConfig,
    choose_config,
    params_for,
)
from forgekernel.kernels.conv.sm90.dgrad_config import FUSED_CONFIGS, fused_params
from forgekernel.kernels.conv.sm90.geometry import (
    INT32_MAX,
    RECT_WIDTHS,
    Geometry,
    dgrad_geometry_problem,
)
from forgekernel.kernels.conv.sm90.wgrad_config import (
    WGRAD_CONFIGS,
    WGRAD_RECTS,
    WGRAD_REDUCE_CONFIGS,
    wgrad_params,
)
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.conv.sm90.compile import compile_conv_fprop

    return compile_conv_fprop(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    # each tile on the im2col walk (any stride) and on the stride-1 output rectangles
    forward = [
        params_for(dtype, bias, cfg, rect=rect)
        for dtype in DTYPES
        for bias in (False, True)
        for cfg in STANDARD_CONFIGS
        for rect in (0, *RECT_WIDTHS)
    ]
    # the K = 128 conv3d layers' tile on the one walk `choose_plan` takes it on (no split, no
    # data-gradient mode: config.takes_tall)
    forward += [
        params_for(dtype, bias, TALL, rect=TALL_RECT) for dtype in DTYPES for bias in (False, True)
    ]
    # the data-gradient mode (W read N-major, taps reversed; no bias)
    dgrad = [
        params_for(dtype, False, cfg, dgrad=True, rect=rect)
        for dtype in DTYPES
        for cfg in STANDARD_CONFIGS
        for rect in (0, *RECT_WIDTHS)
    ]
    return forward + dgrad


def _compile_wgrad(params: Params, extra_options: str = ""):
    from forgekernel.kernels.conv.sm90.wgrad_compile import compile_conv_wgrad

    return compile_conv_wgrad(dict(params), "sm_90a", extra_options)


def _wgrad_params() -> list[Params]:
    # the reduce split's tiles on the 8-wide rectangles: the walk of every unpadded 1x1 (one
    # plane of 8-pixel rows), the problems its bench variant times
    reduce = [
        wgrad_params(d, cfg, RECT_WIDTHS[0], True) for d in DTYPES for cfg in WGRAD_REDUCE_CONFIGS
    ]
    return [
        wgrad_params(dtype, cfg, rect)
        for dtype in DTYPES
        for cfg in WGRAD_CONFIGS
        for rect in WGRAD_RECTS
    ] + reduce


def _candidate_params() -> list[Params]:
    return [params_for("bfloat16", False, cfg) for cfg in CANDIDATES]


def _representative() -> Params:
    # the bias path and a multicast cluster: the most code in one build
    return params_for("bfloat16", True, STANDARD_CONFIGS[0])


SPEC = KernelSpec(
    name="conv_fprop_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
    representative=_representative,
)
# The weight gradient (wgrad.py): the dense GEMM's kernel with dY^T and im2col(X) as operands,
# split over the pixels; its own entry, so that its sources (and ledger) are its own.
WGRAD_SPEC = KernelSpec(
    name="conv_wgrad_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_wgrad,
    standard_params=_wgrad_params,
    entry=Path(__file__).parent / "wgrad_compile.py",
)


def _compile_dgrad(params: Params, extra_options: str = ""):
    from forgekernel.kernels.conv.sm90.dgrad_compile import compile_conv_dgrad

    return compile_conv_dgrad(dict(params), "sm_90a", extra_options)


def _dgrad_params() -> list[Params]:
    return [fused_params(dtype, cfg) for dtype in DTYPES for cfg in FUSED_CONFIGS]


def _dgrad_representative() -> Params:
    # a split over a 2x1 cluster: the most code in one build
    return fused_params("bfloat16", FUSED_CONFIGS[len(FUSED_CONFIGS) // 2])


# The strided data gradient, every phase in one launch (dgrad_kernel.py: the forward kernel's
# data-gradient mode with a phase walk and a row-addressed epilogue); its own entry and ledger.
DGRAD_SPEC = KernelSpec(
    name="conv_dgrad_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_dgrad,
    standard_params=_dgrad_params,
    entry=Path(__file__).parent / "dgrad_compile.py",
    representative=_dgrad_representative,
)


def _compile_fold(params: Params, extra_options: str = ""):
    from forgekernel.kernels.conv.sm90.fold_compile import compile_stem_fold

    return compile_stem_fold(dict(params), "sm_90a", extra_options)


def fold_params(dtype: str, channels: int) -> Params:
    """The stem fold's compile key: `channels` (1-8) folded into block rows of 8 (C <= 4) or 16
    16-bit elements (stem.py `Fold.pixel` // 2)."""
    return (("channels", channels), ("dtype", dtype), ("half", 8 if channels <= 4 else 16))


# The stem's fold of x (fold.py: stem.py's fill and strided copy as one pass); its own entry and
# ledger. In no suite's sources: the bench runs it only as conv_fwd / conv_wgrad's `stem_fold`.
STEM_FOLD_SPEC = KernelSpec(
    name="conv_stem_fold_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_fold,
    standard_params=lambda: [fold_params(d, c) for d in DTYPES for c in range(1, 9)],
    entry=Path(__file__).parent / "fold_compile.py",
    representative=lambda: fold_params("bfloat16", 3),
    mma=False,  # an elementwise pass: no HGMMA in its SASS
)
SPECS = [SPEC, WGRAD_SPEC, DGRAD_SPEC, STEM_FOLD_SPEC]

__all__ = [
    "DGRAD_SPEC",
    "INT32_MAX",
    "SPEC",
    "SPECS",
    "STEM_FOLD_SPEC",
    "WGRAD_SPEC",
    "ConvConfig",
    "Geometry",
    "choose_config",
    "dgrad_geometry_problem",
    "fold_params",
    "params_for",
]
