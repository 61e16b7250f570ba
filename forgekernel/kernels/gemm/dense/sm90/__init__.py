"""Dense 16-bit GEMM, sm_90a, and on the same kernel the masked grouped FP8 GEMM (MoE decode,
`masked_config.py`, launcher `launch.gemm_fp8_masked`). DSL-free declaration; the kernel itself is
`kernel.py`."""

from __future__ import annotations

from pathlib import Path

from forgekernel.kernels.gemm.dense.sm90 import masked_config
from forgekernel.kernels.gemm.dense.sm90.config import (
    CANDIDATES,
    DTYPES,
    NUM_SMS_H100_H200,
    STANDARD_CONFIGS,
    GemmConfig,
    choose_config,
    fewest_ctas,
    max_ctas,
    params_for,
    takes_kn,
)
from forgekernel.runtime import pdl
from forgekernel.runtime.spec import KernelSpec, Params


def _compile(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.dense.sm90.compile import compile_gemm

    return compile_gemm(dict(params), "sm_90a", extra_options)


def _standard_params() -> list[Params]:
    """Every standard config for each dtype and B layout (the PDL builds, trigger at the top),
    and with a partial-wave rule adopted (runtime/pdl.py `PARTIAL_WAVE`) the rule's form of
    each one whose grids the band reaches (`band_configs`)."""
    builds = [
        (dtype, b_kn, cfg)
        for dtype in DTYPES
        for b_kn in (False, True)
        for cfg in STANDARD_CONFIGS
        if not b_kn or takes_kn(cfg)  # the swap and TALL_72 take B "nk" only
    ]
    top = [params_for(*b) for b in builds]
    form = pdl.band_form()
    if form is None:
        return top
    band = band_configs()
    return top + [pdl.key_for(params_for(*b), form) for b in builds if b[2] in band]


def band_configs(num_sms: int = NUM_SMS_H100_H200) -> tuple[GemmConfig, ...]:
    """The standard configs whose grids on a `num_sms`-SM chip the partial-wave rule's band
    reaches: the chooser launches each on one cluster (`fewest_ctas`) up to a whole wave, so
    every one whose cluster size steps into the band (docs/gemm/NOTES.md "Adopting a
    partial-wave rule": a sweep of 152k problems found 25 of the 27 chosen on a band grid)."""
    return tuple(
        cfg
        for cfg in STANDARD_CONFIGS
        if pdl.reaches(fewest_ctas(cfg), max_ctas(cfg, num_sms), fewest_ctas(cfg), num_sms)
    )


def _candidate_params() -> list[Params]:
    return [params_for("bfloat16", False, cfg) for cfg in CANDIDATES]


def _compile_masked(params: Params, extra_options: str = ""):
    from forgekernel.kernels.gemm.dense.sm90.compile import compile_gemm_fp8_masked

    return compile_gemm_fp8_masked(dict(params), "sm_90a", extra_options)


def _masked_params() -> list[Params]:
    return [
        masked_config.params_for(out, cfg)
        for out in masked_config.OUT_DTYPES
        for cfg in masked_config.STANDARD_CONFIGS
    ]


SPEC = KernelSpec(
    name="gemm_dense_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile,
    standard_params=_standard_params,
    candidate_params=_candidate_params,
)

# The masked grouped FP8 GEMM (`forgekernel.ops.gemm_fp8_grouped_masked`): the same kernel
# with `masked=True`, compiled for its (rows, cols, experts) operands.
MASKED_SPEC = KernelSpec(
    name="gemm_fp8_masked_sm90",
    arch="sm_90a",
    directory=Path(__file__).parent,
    compile=_compile_masked,
    standard_params=_masked_params,
)
SPECS = [SPEC, MASKED_SPEC]

__all__ = ["MASKED_SPEC", "SPEC", "SPECS", "GemmConfig", "choose_config", "params_for"]
