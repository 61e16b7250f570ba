"""Kimi Delta Attention's backward WY kernel compiled for sm_90a on the CPU (the DSL compiles,
ptxas assembles, cuobjdump reads the cubin), both dtypes: 256 threads, nothing spilled, 255
registers (cu13 ptxas; Gated DeltaNet's kernel 2 with `wy` holds 255 too); 196,608 bytes of
shared memory (within config's bound); per CTA the WGMMAs T^T du, T^T dw (4 x 64x128x16 each,
the tiles' dtype, B transposed), dvb u^T, dkb w^T (8 x 64x64x16 each, A from registers), and
the eight sub-chunk blocks of dx and dy (one 64x128x16 each, bf16 for both dtypes, B
transposed), twelve commit groups; seven TMA tiles (thirteen 64-column boxes); (beta dA)^T by
four transposed stmatrix a thread; three quad row dots (12 butterfly shuffles)."""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import pytest
from sweeps import slow_past  # tests/ is on the path

pytest.importorskip("cutlass")

sys.path.insert(0, str(Path(__file__).parent))
from dsl_toolchain import dsl_toolchain  # noqa: E402

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import SPEC, config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.compile import (  # noqa: E402
    compile_kda_bwd_wy,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

REGISTERS = 255  # compiled figure under cu13 (2026-12-06): at the cap, no spill; watch it
SMEM = 196608


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype):
        if dtype not in cache:
            params = dict(config.params_for(dtype))
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_kda_bwd_wy(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                        kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
            cache[dtype] = (res, sass_instructions(sass), kernel.shared_storage.size_in_bytes())
        return cache[dtype]

    return get


def test_standard_params():
    assert SPEC.name == "kda_bwd_wy_sm90"
    assert [dict(p)["dtype"] for p in SPEC.standard_params()] == list(config.DTYPES)


# CI: the first dtype's compile (~6 s of a CPU, 2026-12-06), read by this test and the next two;
# the other's is slow
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_registers_and_no_spills(compiled, dtype):
    res, instrs, _ = compiled(dtype)
    assert res["registers"] <= 65536 // config.THREADS
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_shared_memory_fits(compiled, dtype):
    res, _, smem = compiled(dtype)
    assert smem == SMEM <= config.smem_bytes() <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_wgmmas_and_tma(compiled, dtype):
    _, instrs, _ = compiled(dtype)
    ops = [op for op, _ in instrs]
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    tile = "BF16" if dtype == "bfloat16" else "F32"
    square = [op for op, _ in shapes if op.startswith("HGMMA.64x64x16")]  # dA's two products
    assert len(square) == 16 and all(op.endswith(tile) for op in square)
    wide = [(op, a) for op, a in shapes if op.startswith("HGMMA.64x128x16")]
    assert len(wide) == 2 * 4 + 2 * 4 and all("tnspB" in a for _, a in wide)
    blocks = [op for op in (op for op, _ in wide) if op.endswith(".BF16")]
    assert len(blocks) == (16 if dtype == "bfloat16" else 8)  # T^T's in the tiles' dtype
    assert sum("gsb0" in a for _, a in shapes) == 4 + 8  # one commit group a product
    assert ops.count("UTMALDG.4D") == 6 * 2 + 1
    assert ops.count("STSM.16.MT88.4") == 4
    assert ops.count("SHFL.BFLY") == 12
