"""The stem's fold kernel (kernels/conv/sm90/fold.py, spec conv_stem_fold_sm90) compiles for
sm_90a on a CPU machine: per thread 4C 16-bit loads (the 2x2 block's pixels, predicated), the
folded pixel out as 16-byte stores (2 for 8-channel block rows, 4 for 16), no local memory, no
shared memory. Measured (bf16): C = 3 216 SASS instructions, 19 registers; C = 8 248, 29."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from forgekernel.kernels.conv.sm90 import STEM_FOLD_SPEC, fold_params  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text  # noqa: E402


@pytest.mark.parametrize(
    "dtype, channels", [("bfloat16", 3), ("float16", 1), ("bfloat16", 8), ("float16", 5)]
)
def test_the_fold_builds_with_wide_stores_and_no_local_memory(dtype, channels, tmp_path):
    params = fold_params(dtype, channels)
    compiled = STEM_FOLD_SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    cubin = compiled.artifacts.CUBIN
    path = Path(tmp_path) / "fold.cubin"
    path.write_bytes(cubin if isinstance(cubin, bytes) else Path(cubin).read_bytes())
    found = inspect_cubin(path)
    if found["registers"] is None:
        pytest.skip("cuobjdump not installed")
    if find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not installed")
    sass = sass_text(path)
    assert found["spill_bytes"] == 0 and found["smem_bytes"] == 0
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert len(re.findall(r"\bLDG\.E\.U16\b", sass)) == 4 * channels
    half = dict(params)["half"]
    assert len(re.findall(r"\bSTG\.E\.128\b", sass)) == half // 4  # 2 half x 2 bytes / 16
    assert found["registers"] <= 40


def test_the_fold_keys_are_standard():
    """`forgekernel build` (every spec of kernels/conv/sm90 `SPECS`) prebuilds channels 1-8 in
    both dtypes: 16 small builds."""
    keys = STEM_FOLD_SPEC.standard_params()
    assert len(keys) == 16 and fold_params("bfloat16", 3) in keys
    assert STEM_FOLD_SPEC.representative_params() == fold_params("bfloat16", 3)
