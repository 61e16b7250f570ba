"""The chunked Gated DeltaNet prefill kernel compiled for sm_90a on the CPU (the DSL compiles,
ptxas assembles, cuobjdump reads the cubin), its resources as config.py and the kernel state:

- 512 threads, 128 registers at launch (one CTA per SM), split by setmaxnreg 24 / 104 / 192
  (producer / aux / state warpgroups), nothing spilled (no local memory);
- shared memory (the kernel's SharedStorage) within the 227 KB opt-in, under config's bound;
- the WGMMAs: K K^T, Q K^T (64x64x16, 8 each) in the aux warpgroup; X^T, O^T (8 each), U^T,
  O^T += U^T P^T (4 each, 64x64x16) and the state update (4 x 64x128x16, B transposed) in a
  state warpgroup, each product one commit group and none serialized (a wait per group, not
  per instruction: ptxas serializes when registers run short);
- three TMA boxes of two 64-column halves per chunk, the P / T tiles by stmatrix, O^T by the
  transposed stmatrix."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.compile import (  # noqa: E402
    compile_gdn_prefill,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")

CONFIGS = {
    "bf16": {"dtype": "bfloat16"},
    "bf16_l2norm_klast_state": {
        "dtype": "bfloat16",
        "l2norm": True,
        "k_last": True,
        "initial_state": True,
    },  # fmt: skip
    "fp16_l2norm_state": {"dtype": "float16", "l2norm": True, "initial_state": True},
}


def _compile(dtype: str, **kw) -> tuple[dict, list[tuple[str, str]], int]:
    """(resources, SASS (opcode, operands) in program order, shared memory bytes)."""
    params = dict(config.params_for(dtype, **kw))
    kernel = kernel_for(params)
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_gdn_prefill(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                       kernel=kernel)  # fmt: skip
        cubin = getattr(compiled.artifacts, "CUBIN", None)
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = path
        res = inspect_cubin(cubin)
        sass = subprocess.run([find_tool("cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return res, _INSTR.findall(sass), kernel.shared_storage.size_in_bytes()


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            kw = dict(CONFIGS[name])
            cache[name] = _compile(kw.pop("dtype"), **kw)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_registers_and_no_spills(compiled, name):
    res, instrs, _ = compiled(name)
    ops = [op for op, _ in instrs]
    assert res["registers"] <= 65536 // config.THREADS
    assert res["spill_bytes"] == 0
    assert not [op for op in ops if op.startswith(("LDL", "STL"))]
    maxreg = [int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG")]
    assert sorted(maxreg) == sorted([config.PRODUCER_REGS, config.AUX_REGS, config.STATE_REGS])
    assert max(maxreg) <= 255


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shared_memory_fits(compiled, name):
    _, _, smem = compiled(name)
    assert smem <= config.smem_bytes() <= SMEM_CAPACITY


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wgmma_groups_are_not_serialized(compiled, name):
    _, instrs, _ = compiled(name)
    hgmma = [a for op, a in instrs if op.startswith("HGMMA")]
    shapes = [op for op, _ in instrs if op.startswith("HGMMA")]
    assert sum(s.startswith("HGMMA.64x64x16") for s in shapes) == 16 + 24
    assert sum(s.startswith("HGMMA.64x128x16") for s in shapes) == 4
    assert all("tnspB" in a for s, a in zip(shapes, hgmma) if s.startswith("HGMMA.64x128x16"))
    groups = sum("gsb0" in a for a in hgmma)
    assert groups == 2 + 5  # K K^T, Q K^T; X^T, O^T, U^T, U^T P^T, the state update
    waits = sum(op == "WARPGROUP.DEPBAR.LE" for op, _ in instrs)
    assert waits <= groups


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tma_loads_and_matrix_stores(compiled, name):
    _, instrs, _ = compiled(name)
    ops = [op for op, _ in instrs]
    assert ops.count("UTMALDG.3D") == 6  # q, k, v: two 64-column boxes each
    assert ops.count("STSM.16.M88.4") == 8  # P, T diag(beta): 4 each per aux thread
    assert ops.count("STSM.16.MT88.4") == 4  # O^T, transposed into the token-major tile
