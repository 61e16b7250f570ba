"""The Gated DeltaNet backward's q / k epilogue compiled for sm_90a on the CPU (the DSL compiles,
ptxas assembles, cuobjdump reads the cubin): 128 threads, few registers, nothing spilled, no
shared memory; 16-byte loads and stores only (per thread and 8-row pass: two of each value
head's fp32 row in the group loop, one of x with l2norm; one 16-bit store), the two row dots
reduced by 4 shuffles each over the row's 16 threads."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from dsl_toolchain import dsl_toolchain  # noqa: E402
from sweeps import slow_past  # noqa: E402  (tests/ is on the path)

from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.compile import (  # noqa: E402
    compile_gdn_bwd_norm,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

PASSES = config.ROWS // (config.THREADS // (128 // config.VEC))  # 8 row passes a CTA


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, l2norm, d16=False):
        if (dtype, l2norm, d16) not in cache:
            params = dict(config.params_for(dtype, l2norm=l2norm, d16=d16))
            with tempfile.TemporaryDirectory() as d:
                fn = compile_gdn_bwd_norm(params, "sm_90a", f"--keep-cubin --dump-dir {d}")
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                cache[dtype, l2norm, d16] = (inspect_cubin(cubin),
                                             sass_instructions(sass_text(cubin)))  # fmt: skip
        return cache[dtype, l2norm, d16]

    return get


# CI: the first dtype, both forms; the second dtype's (the same code) are slow (~3 s, 2026-12-07)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_resources_and_memory_ops(compiled, dtype, l2norm):
    res, instrs = compiled(dtype, l2norm)
    ops = [op for op, _ in instrs]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert res["registers"] <= 40  # 30 / 33 under cu13 (2026-12-05)
    assert res["smem_bytes"] == 0
    loads = [op for op in ops if op.startswith("LDG")]
    stores = [op for op in ops if op.startswith("STG")]
    assert set(loads) == {"LDG.E.128"} and set(stores) == {"STG.E.128"}
    if dsl_toolchain() == "cu13":  # the counts as cu13's ptxas schedules them
        assert len(loads) == PASSES * (2 + l2norm) and len(stores) == PASSES
        assert ops.count("SHFL.BFLY") == PASSES * 2 * 4 * l2norm
    else:
        assert (ops.count("SHFL.BFLY") > 0) == l2norm


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
@pytest.mark.parametrize("l2norm", [False, True])
def test_d16_reads_half_the_gradient_bytes(compiled, dtype, l2norm):
    """`d16` (the chunk kernel's dqk16 gradients, 16-bit): one 16-byte load a value head and
    row instead of two (8 columns of 16 bits), summed in fp32; registers within the fp32 key's
    bound, nothing spilled, no shared memory, one 16-byte store a row as before."""
    res, instrs = compiled(dtype, l2norm, True)
    ops = [op for op, _ in instrs]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert res["registers"] <= 40 and res["smem_bytes"] == 0
    loads = [op for op in ops if op.startswith("LDG")]
    stores = [op for op in ops if op.startswith("STG")]
    assert set(loads) == {"LDG.E.128"} and set(stores) == {"STG.E.128"}
    if dsl_toolchain() == "cu13":
        assert len(loads) == PASSES * (1 + l2norm) and len(stores) == PASSES
