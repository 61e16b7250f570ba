"""The convolution forward kernel compiles for sm_90a on a CPU machine: the activations load
through the im2col TMA (UTMALDG.5D.IM2COL), the multiply-adds are HGMMA, nothing spills (no
local memory). Three builds: the representative (bias, 128x128, weight multicast over a 2x1
cluster), the largest accumulator (128x256), the data-gradient mode (W N-major: `.tnspB`)."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from forgekernel.kernels.conv.sm90 import SPEC  # noqa: E402
from forgekernel.kernels.conv.sm90.config import LARGE, SQUARE, params_for  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin  # noqa: E402


@pytest.mark.parametrize(
    "params",
    [
        SPEC.representative_params(),
        params_for("float16", False, LARGE),
        params_for("bfloat16", False, SQUARE, dgrad=True),
    ],
    ids=["representative", "128x256", "dgrad"],
)
def test_builds_with_im2col_tma_hgmma_and_no_spills(params, tmp_path):
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    cubin = compiled.artifacts.CUBIN
    path = Path(tmp_path) / "conv.cubin"
    path.write_bytes(cubin if isinstance(cubin, bytes) else Path(cubin).read_bytes())
    found = inspect_cubin(path)
    if found["registers"] is None:
        pytest.skip("cuobjdump not installed")
    assert found["spill_bytes"] == 0
    nvdisasm = find_tool("nvdisasm")
    if nvdisasm is None:
        pytest.skip("nvdisasm not installed")
    sass = subprocess.run([nvdisasm, "-c", str(path)], capture_output=True, text=True).stdout
    assert re.search(r"UTMALDG\.5D\.IM2COL", sass)
    assert "HGMMA" in sass and "UTMASTG" in sass
    assert not re.search(r"\b(LDL|STL)\b", sass)
    # the data-gradient mode reads W N-major: WGMMA's transposed B
    assert ("tnspB" in sass) == dict(params)["dgrad"]
