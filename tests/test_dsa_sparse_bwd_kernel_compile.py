"""The v1 sparse backward kernel compiled for sm_90a on the CPU (the DSL compiles, ptxas
assembles, cuobjdump reads the cubin), its structure as kernel.py states it: no spills under
the setmaxnreg split, the WGMMAs of both consumer warpgroups' tiles (S^T / dP^T over 576 / 512
columns, dq^T blocks over 64 rows, dkv blocks over BLOCK heads), the gather by cp.async, the dkv
reductions as `red.global.add.v2.f32` and the WGMMAs pipelined (not serialized one by one)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC, config  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9x.]+)?)")


def _compiled(params) -> tuple[dict, Counter]:
    with tempfile.TemporaryDirectory() as d:
        compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {d}")
        cubin = compiled.artifacts.CUBIN
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = str(path)
        res = inspect_cubin(cubin)
        sass = subprocess.run([find_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    ops = Counter(op.split(".")[0] for op in _OP.findall(sass))
    ops["RED_V2"] = sass.count("REDG.E.ADD.F32x2")
    ops["DEPBAR0"] = sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    return res, ops


@pytest.mark.parametrize("block", config.BLOCKS)
def test_sparse_bwd_kernel(block):
    res, ops = _compiled(config.params_for("bfloat16", block))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    k = block // 16  # k-steps of a dkv block
    n_dq = [len(b) for b in config.DQ_BLOCKS]
    n_dkv = [sum(2 if c < config.D_V // config.CHUNK else 1 for c in b) for b in config.DKV_BLOCKS]
    per_wg = [36 + 32 + 4 * q + k * v for q, v in zip(n_dq, n_dkv)]  # S + dP + dq + dkv
    assert ops["HGMMA"] == sum(per_wg)
    q_rows = block // 16  # 16 rows a pass of 128 threads, 8 a row
    assert ops["LDGSTS"] == config.NCHUNK * (q_rows + 4) + 8 * q_rows
    acc_pairs = config.TILE * config.CHUNK // 128 // 2  # v2 reductions a thread, a dkv block
    assert ops["RED_V2"] == ops["REDG"] == acc_pairs * config.NCHUNK
    assert ops["DEPBAR0"] <= 8  # the tiles' waits, not one per WGMMA
