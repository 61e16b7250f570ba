"""The dense FP8 GEMM's config checks on the GPU (the narrow tiles', the scale warp's tests): the
suite's inputs for an (M, N, K) and the launcher with a config forced."""

from __future__ import annotations

import torch

from forgekernel.bench.suites import gemm_fp8 as suite_module
from forgekernel.kernels.gemm.fp8.sm90 import launch

CUDA = torch.device("cuda")
FP8 = suite_module.suite()


def inputs_for(m: int, n: int, k: int, seed: int) -> dict:
    """The suite's bf16-out inputs of an (M, N, K) case, from `seed`."""
    gen = torch.Generator(device=CUDA).manual_seed(seed)
    return FP8.make_inputs(suite_module._case(m, n, k), torch.bfloat16, CUDA, gen)


def forced(cfg):
    """The launcher with `cfg` forced (a `run(inputs, out)`)."""

    def run(inputs, out):
        launch.gemm_fp8(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out, config=cfg)
        return out

    return run
