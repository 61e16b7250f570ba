"""The convolution kernels compile for sm_90a on a CPU machine, nothing spills (no local memory)
and their shared memory fits.

Forward (five builds): the activations load through the im2col TMA (UTMALDG.5D.IM2COL), the
multiply-adds are HGMMA; the representative (bias, 128x128, weight multicast over a 2x1
cluster), the largest accumulator (128x256), the data-gradient mode (W N-major: `.tnspB`), a
split reduction with the largest accumulator and bias, the data-gradient mode split (the
parts counted with a global atomic).
Fused data gradient (every tile, plain and split): the same im2col TMA and transposed-B HGMMA,
no TMA store: the rows go out as 16-byte st.global (STG.E.128) after 16-byte shared loads of the
staged sub-tile; a split counts its parts with a global atomic.
Weight gradient (every standard tile, each pixel walk): A = dY^T through a tiled TMA, B = the
im2col boxes (or, the stride-1 rectangles, A and B both 5-D tiled boxes), both read transposed
by WGMMA (`.tnspA.tnspB`), the split's flag counted with a global atomic; the reduce split
(every reduce tile, 8-wide rectangles) adds each part with one bulk reduce (UBLKRED) and its
last part loads, zeroes and stores the tile's one slot.

CI builds each test's first configuration (the forward's representative); the others are
marked `slow` (tests/sweeps.py): they run before landing a kernel change."""

from __future__ import annotations

import os
import re
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("cutlass")
os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")

from sweeps import slow_past  # noqa: E402  (tests/ is on the path)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.conv.sm90 import (  # noqa: E402
    DGRAD_SPEC,
    SPEC,
    WGRAD_SPEC,
    dgrad_compile,
    wgrad_compile,
)
from forgekernel.kernels.conv.sm90 import compile as fprop_compile  # noqa: E402
from forgekernel.kernels.conv.sm90.config import LARGE, NARROW, SQUARE, params_for  # noqa: E402
from forgekernel.kernels.conv.sm90.dgrad_config import FUSED_CONFIGS, fused_params  # noqa: E402
from forgekernel.kernels.conv.sm90.geometry import RECT_WIDTHS  # noqa: E402
from forgekernel.kernels.conv.sm90.wgrad_config import (  # noqa: E402
    WGRAD_CONFIGS,
    WGRAD_RECTS,
    WGRAD_REDUCE_CONFIGS,
    wgrad_params,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text  # noqa: E402


def _build(spec, params, module, kernel_class: str, tmp_path, monkeypatch):
    """(SASS, resources, the kernel object: its shared storage) of one build."""
    made = []
    real = getattr(module, kernel_class)

    def keep(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(module, kernel_class, keep)
    compiled = spec.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    cubin = compiled.artifacts.CUBIN
    path = Path(tmp_path) / "conv.cubin"
    path.write_bytes(cubin if isinstance(cubin, bytes) else Path(cubin).read_bytes())
    found = inspect_cubin(path)
    if found["registers"] is None:
        pytest.skip("cuobjdump not installed")
    if find_tool("nvdisasm") is None:
        pytest.skip("nvdisasm not installed")
    sass = sass_text(path)  # the listing inspect_cubin just read: not disassembled again
    return sass, found, made[-1]


def _no_spills_and_fits(sass, found, kernel):
    assert found["spill_bytes"] == 0
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert kernel.shared_storage.size_in_bytes() <= SMEM_CAPACITY


@pytest.mark.parametrize(
    "params",
    slow_past(
        [
            SPEC.representative_params(),
            params_for("float16", False, LARGE),
            params_for("bfloat16", False, SQUARE, dgrad=True),
            params_for("bfloat16", True, replace(LARGE, split=True)),
            params_for("float16", False, replace(NARROW, split=True), dgrad=True),
        ]
    ),
    ids=["representative", "128x256", "dgrad", "128x256-split-bias", "dgrad-128x64-split"],
)
def test_forward_builds_with_im2col_tma_hgmma_and_no_spills(params, tmp_path, monkeypatch):
    sass, found, kernel = _build(
        SPEC, params, fprop_compile, "ConvFpropSm90", tmp_path, monkeypatch
    )
    _no_spills_and_fits(sass, found, kernel)
    assert re.search(r"UTMALDG\.5D\.IM2COL", sass)
    assert "HGMMA" in sass and "UTMASTG" in sass
    # the data-gradient mode reads W N-major: WGMMA's transposed B
    assert ("tnspB" in sass) == dict(params)["dgrad"]
    # a split counts its parts in the tile's flag
    assert bool(re.search(r"\bATOMG?\.E\.ADD", sass)) == dict(params)["split"]


@pytest.mark.parametrize(
    "params",
    slow_past(
        [
            params_for("bfloat16", True, SQUARE, rect=8),
            params_for("float16", False, LARGE, rect=16),
            params_for("bfloat16", True, replace(LARGE, split=True), rect=8),
            params_for("bfloat16", False, replace(NARROW, split=True), rect=16),
            params_for("bfloat16", False, SQUARE, dgrad=True, rect=8),
            params_for("float16", False, replace(LARGE, split=True), dgrad=True, rect=16),
        ]
    ),
    ids=[
        "128x128c2x1-bias-r8",
        "128x256-r16",
        "128x256-split-bias-r8",
        "128x64-split-r16",
        "dgrad-128x128c2x1-r8",
        "dgrad-128x256-split-r16",
    ],
)
def test_forward_rectangles_build_tiled_5d_and_no_spills(params, tmp_path, monkeypatch):
    """Stride 1: A a 5-D tiled box of X (no IM2COL), Y stored as 5-D rectangles."""
    sass, found, kernel = _build(
        SPEC, params, fprop_compile, "ConvFpropSm90", tmp_path, monkeypatch
    )
    _no_spills_and_fits(sass, found, kernel)
    assert "IM2COL" not in sass and re.search(r"UTMALDG\.5D\b", sass)
    assert re.search(r"UTMASTG\.5D\b", sass) and "HGMMA" in sass
    assert bool(re.search(r"\bATOMG?\.E\.ADD", sass)) == dict(params)["split"]
    assert ("tnspB" in sass) == dict(params)["dgrad"]  # the dgrad mode reads W N-major
    print(dict(params)["rect"], kernel.cfg.tag(), found)


@pytest.mark.parametrize("cfg", slow_past(FUSED_CONFIGS), ids=lambda c: c.tag())
def test_fused_dgrad_builds_every_tile_without_spills(cfg, tmp_path, monkeypatch):
    params = fused_params("bfloat16", cfg)
    sass, found, kernel = _build(
        DGRAD_SPEC, params, dgrad_compile, "ConvDgradSm90", tmp_path, monkeypatch
    )
    _no_spills_and_fits(sass, found, kernel)
    assert re.search(r"UTMALDG\.5D\.IM2COL", sass) and "tnspB" in sass
    assert "UTMASTG" not in sass  # the rows are stored by the threads
    assert "STG.E.128" in sass and "LDS.128" in sass
    assert bool(re.search(r"\bATOMG?\.E\.ADD", sass)) == cfg.split


# Every tile on the im2col walk (rect 0) and the 8-wide rectangles; the other widths (16x4: the
# same 5-D boxes, another extent) on the 128x256 tiles alone, with and without the cluster (the
# most registers): 16 compiles, not 21 (~1.3 s each on CI's CPU).
WGRAD_BUILDS = [(cfg, rect) for cfg in WGRAD_CONFIGS for rect in (0, RECT_WIDTHS[0])] + [
    (cfg, rect) for rect in RECT_WIDTHS[1:] for cfg in WGRAD_CONFIGS if cfg.tile_n == 256
]
assert {rect for _, rect in WGRAD_BUILDS} == set(WGRAD_RECTS)


@pytest.mark.parametrize(
    ("cfg", "rect"), slow_past(WGRAD_BUILDS, unpack=True),
    ids=[f"{c.tile_m}x{c.tile_n}c{c.cluster_m}-{r}" for c, r in WGRAD_BUILDS],
)  # fmt: skip
def test_wgrad_builds_every_tile_without_spills(cfg, rect, tmp_path, monkeypatch):
    params = wgrad_params("bfloat16", cfg, rect)
    sass, found, kernel = _build(
        WGRAD_SPEC, params, wgrad_compile, "ConvWgradSm90", tmp_path, monkeypatch
    )
    _no_spills_and_fits(sass, found, kernel)
    if rect:  # the stride-1 rectangles: A and B both 5-D tiled boxes, B multicast by a cluster
        assert "IM2COL" not in sass and not re.search(r"UTMALDG\.2D", sass)
        assert re.search(r"UTMALDG\.5D\b", sass)
        assert bool(re.search(r"UTMALDG\.5D\.MULTICAST", sass)) == (cfg.cluster_m > 1)
    else:
        assert re.search(r"UTMALDG\.5D\.IM2COL", sass) and re.search(r"UTMALDG\.2D", sass)
    assert re.search(r"HGMMA\.64x\d+x16\.F32\.BF16 \S+, gdesc\[\w+\]\.tnspA\.tnspB", sass)
    assert "UTMASTG" in sass and re.search(r"\bATOMG?\.E\.ADD", sass)


@pytest.mark.parametrize(
    "cfg", slow_past(WGRAD_REDUCE_CONFIGS), ids=lambda c: f"{c.tile_m}x{c.tile_n}"
)
def test_wgrad_reduce_builds_every_tile_without_spills(cfg, tmp_path, monkeypatch):
    params = wgrad_params("bfloat16", cfg, 8, reduce=True)
    sass, found, kernel = _build(
        WGRAD_SPEC, params, wgrad_compile, "ConvWgradSm90", tmp_path, monkeypatch
    )
    _no_spills_and_fits(sass, found, kernel)
    assert kernel.reduce and re.search(r"UTMALDG\.5D\b", sass)
    # one bulk reduce-add of the staged fp32 tile (16-byte shared stores, a fragment's worth),
    # the part counted once; the last part's 16-byte loads of the slot and its zeroing stores
    assert len(re.findall(r"\bUBLKRED\.G\.S\.ADD\.F32", sass)) == 1
    vectors = cfg.tile_n // 2 // 4  # a thread's fp32 fragment, tile_n / 2 floats
    assert len(re.findall(r"\bSTS\.128", sass)) >= vectors
    assert len(re.findall(r"\bLDG\.E\.128", sass)) >= vectors
    assert len(re.findall(r"\bSTG\.E\.128", sass)) >= vectors
    assert "UTMASTG" in sass and re.search(r"\bATOMG?\.E\.ADD", sass)
