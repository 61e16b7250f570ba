"""Block-scaled FP8 GEMM, sm_90a: the dense GEMM's kernel (`kernels/gemm/dense/sm90/kernel.py`)
with float8_e4m3fn operands and fp32 block scales. DSL-free declaration."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.gemm.dense.sm90.config import NUM_SMS_H100_H200, GemmConfig, max_ctas
from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    GROUPED_F4_SW,
    NARROW_CONFIGS,
    OUT_DTYPES,
    STANDARD_CONFIGS,
    fewest_ctas,
    one_warp_scales,
    params_for,
)
from forgekernel.runtime import pdl
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8

    return compile_gemm_fp8(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every standard config for each output dtype, the grouped one, the narrow full-K tiles
    the chooser may pick (`NARROW_CONFIGS`) (the PDL builds, trigger at the top), and with a
    partial-wave rule adopted (runtime/pdl.py `PARTIAL_WAVE`) the rule's form of each dense one
    whose grids the band reaches (`band_configs`; the grouped plan is not per problem: always
    "top")."""
    dense = [params_for(out, cfg) for out in OUT_DTYPES for cfg in STANDARD_CONFIGS]
    grouped = [params_for(out, GROUPED, True) for out in OUT_DTYPES]
    narrow = [params_for(out, cfg) for out in OUT_DTYPES for cfg in NARROW_CONFIGS]
    form = pdl.band_form()
    if form is None:
        return dense + grouped + narrow
    band = [pdl.key_for(params_for(out, cfg), form) for out in OUT_DTYPES for cfg in band_configs()]
    return dense + grouped + narrow + band


def _candidate_params() -> list[Params]:
    """The one-warp scale loading (`one_warp_scales`: the standard before the scale warp, the
    bench's `one_warp_scales` variant) of every standard and narrow tile whose standard build
    has the scale warp, in the forms `_standard_params` builds; the grouped tile with the scale
    warp four ahead (GROUPED_F4_SW)."""
    every = (*STANDARD_CONFIGS, *NARROW_CONFIGS)
    cands = [one_warp_scales(cfg) for cfg in every if cfg.scale_warp]
    top = [params_for(out, cfg) for out in OUT_DTYPES for cfg in cands]
    # the grouped tile's scale warp four ahead (the grouped bench's `f4_sw`; always "top")
    grouped = [params_for(out, GROUPED_F4_SW, True) for out in OUT_DTYPES]
    form = pdl.band_form()
    if form is None:
        return top + grouped
    banded = [one_warp_scales(cfg) for cfg in band_configs() if cfg.scale_warp]
    band = [pdl.key_for(params_for(out, cfg), form) for out in OUT_DTYPES for cfg in banded]
    return top + grouped + band


def band_configs(num_sms: int = NUM_SMS_H100_H200) -> tuple[GemmConfig, ...]:
    """The standard and narrow configs whose grids on a `num_sms`-SM chip the partial-wave
    rule's band reaches, between their `fewest_ctas` and a whole wave (LARGE_MCAST_A: M >= 8192
    rows launch at least 128 CTAs, above a band of at most 112; a narrow tile: 1 CTA up)."""
    every = (*STANDARD_CONFIGS, *NARROW_CONFIGS)
    return tuple(
        cfg
        for cfg in every
        if pdl.reaches(
            fewest_ctas(cfg, num_sms), max_ctas(cfg, num_sms), cfg.cluster_m * cfg.cluster_n,
            num_sms,
        )
    )  # fmt: skip


SPEC = KernelSpec(
    name="gemm_fp8_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

__all__ = ["SPEC", "params_for"]
