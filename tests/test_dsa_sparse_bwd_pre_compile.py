"""The DSA sparse backward preprocess compiled for sm_90a on the CPU (the DSL compiles, ptxas
assembles, cuobjdump reads the cubin), its structure as kernel.py states it: every standard
build without spills or local memory, few registers, no shared memory, no HGMMA; out and dO
read by 128-bit loads (LOADS a lane of each), one shuffle-sum tree, the d_sink term stored only
where the key has a sink."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("cutlass")

from cubins import build  # noqa: E402  (tests/ is on the path)

from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import SPEC, config  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

MAX_REGISTERS = 48  # 16 CTAs of 128 threads an SM (the launch's residency) need <= 128


def _compiled(params) -> tuple[dict, str]:
    found = build(SPEC, params)  # tests/cubins.py: once a process
    return found.resources, found.sass


# CI: two of the eight standard builds, between them each knob (dlse, dtype, sink) both ways: the
# representative (bf16, dlse, sink; test_build_sm90 builds it too) and fp16 with neither; the
# other six (the same kernel, one or two knobs moved) are slow (~4 s of CI's CPU, 2026-12-07)
CI_KEYS = ({"dlse": True, "dtype": "bfloat16", "sink": True},
           {"dlse": False, "dtype": "float16", "sink": False})  # fmt: skip
PARAMS = [p if dict(p) in CI_KEYS else pytest.param(p, marks=pytest.mark.slow)
          for p in SPEC.standard_params()]  # fmt: skip


@pytest.mark.parametrize("params", PARAMS, ids=str)
def test_pre_kernel(params):
    res, sass = _compiled(params)
    key = dict(params)
    assert res["spill_bytes"] == 0, res
    assert res["registers"] is not None and res["registers"] <= MAX_REGISTERS, res
    assert not res["smem_bytes"], res
    assert "HGMMA" not in sass and "LDL" not in sass and "STL" not in sass
    loads = len(re.findall(r"LDG\.E\.128", sass))
    assert loads == 2 * config.LOADS, loads  # out and dO, LOADS vectors a lane each
    assert len(re.findall(r"SHFL\.BFLY", sass)) == 5  # the warp's sum: log2(32) steps
    stores = len(re.findall(r"STG\.E ", sass))
    assert stores == 2 + key["sink"], stores  # lse2, Delta' (and the sink term)
