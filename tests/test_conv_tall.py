"""The forward's 256x128 tile (config.TALL: two consumer warpgroups of two m64 atoms each;
docs/conv/NOTES.md, "256 x 128 adopted"), on the CPU: the chooser takes it exactly on its
class (`takes_tall`: the K = 128 conv3d layers measured, each edge of the rule) and its keys are
standard builds; the epilogue's sub-tile index (kernel.sub_tile_value) is the stmatrix copy's own
coordinate for every tile, the 256-row one included (the flat e x frag + v of the 128-row tiles
is not); the 256-pixel rectangles cover every output pixel once; the kernel's model with the
tile is torch's convolution on small 3-D problems (odd extents, padding, dilation, stride 2, C
and K off the tile) through the launcher; the bench's `was` sits on the moved cases; the
builds have no spills and fit."""

from __future__ import annotations

import itertools
import math
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from sweeps import slow_past  # tests/ is on the path

from forgekernel.bench.suites import conv_fwd
from forgekernel.kernels.conv.sm90 import SPEC, emulate, launch
from forgekernel.kernels.conv.sm90.config import (
    CANDIDATES,
    DTYPES,
    LARGE,
    NARROW,
    SQUARE,
    STANDARD_CONFIGS,
    TALL,
    TALL_RECT,
    SplitPlan,
    choose_plan,
    params_for,
    takes_tall,
)
from forgekernel.kernels.conv.sm90.geometry import Geometry, rect_count, rect_origin, rect_width

F64 = torch.float64


def _geometry(f, pad, stride=(1, 1, 1), dil=(1, 1, 1), pad_hi=None) -> Geometry:
    return Geometry(tuple(f), tuple(pad), tuple(pad_hi or pad), tuple(stride), tuple(dil))


def _torch_conv(x, w, bias, g: Geometry):
    pad = [v for d in (2, 1, 0) for v in (g.pad_lo[d], g.pad_hi[d])]
    return F.conv3d(F.pad(x, pad), w, bias, stride=g.stride, dilation=g.dilation)


def _cl5(t):
    return t.permute(0, 2, 3, 4, 1)


def test_the_tall_tile_is_standard_on_its_walk_only():
    """TALL's standard keys: the forward on rectangles TALL_RECT wide, each dtype, with and
    without bias (4 keys); no split, no data-gradient mode, no other walk. Not a candidate, not
    in STANDARD_CONFIGS (the data-gradient mode's tiles too)."""
    assert TALL.tile_m == 256 and TALL.tile_n == 128 and TALL not in CANDIDATES
    assert TALL not in STANDARD_CONFIGS
    tall = [dict(p) for p in SPEC.standard_params() if dict(p)["tile_m"] == 256]
    want = [dict(params_for(d, b, TALL, rect=TALL_RECT)) for d in DTYPES for b in (False, True)]
    assert sorted(map(str, tall)) == sorted(map(str, want))


@pytest.mark.parametrize(
    "n, z, p, q", [(1, 1, 64, 64), (2, 3, 17, 9), (1, 2, 33, 40), (1, 1, 1, 1)]
)
@pytest.mark.parametrize("rq", [8, 16])
def test_256_pixel_rectangles_cover_every_output_pixel_once(n, z, p, q, rq):
    seen = torch.zeros(n, z, p, q, dtype=torch.int64)
    rp = 256 // rq
    for tile in range(rect_count(n, z, p, q, rq, 256)):
        ni, zi, p0, q0 = rect_origin(tile, z, p, q, rq, 256)
        seen[ni, zi, p0 : p0 + rp, q0 : q0 + rq] += 1
    assert bool((seen == 1).all())


def _problem(case):
    """(m, k, c, taps, pixels) of a forward case as the launcher counts it (stride 1)."""
    p = case.params
    out = _out_spatial(p)
    m = p["n"] * math.prod(out)
    pixels = (p["n"], *([1] * (3 - len(out))), *out)
    return m, p["k"], p["c"], math.prod(p["kernel"]), pixels


MOVED = {
    "n4-c128-16x64x64-k128-3x3x3",
    "n1-c128-16x128x128-k128-3x3x3",
    "n1-c128-16x128x128-k128-1x3x3",
}


def test_the_chooser_takes_tall_on_the_measured_rows_only():
    """Of conv_fwd's cases exactly the three K = 128 conv3d layers (1024 tiles in 8 rounds on
    rectangles 8 wide, unsplit) and the check / sanitize case of the 1x3x3 one with bias; every
    other case's plan is the one the chooser took before (as with `forward` off: the
    data-gradient phases' setting, which never takes TALL)."""
    moved = set()
    for case in conv_fwd.BENCH_CASES + conv_fwd.CHECK_CASES + conv_fwd.SANITIZE_CASES:
        if case.params["stride"] != (1,) * len(case.params["stride"]):
            continue
        m, k, c, taps, pixels = _problem(case)
        k = -(-k // 8) * 8
        c = -(-c // 8) * 8
        plan = choose_plan(m, k, c, taps, 132, pixels, forward=True)
        before = choose_plan(m, k, c, taps, 132, pixels, forward=False)
        if plan.config == TALL:
            moved.add(case.name)
            assert before.config == SQUARE and before.rect == 8 and before.parts == 1
            assert plan == SplitPlan(TALL, before.per_split, 1, m // 256, TALL_RECT)
            assert plan.tiles == 1024
        else:
            assert plan == before, case.name
    assert moved == MOVED | {"n1-c128-16x128x128-k128-1x3x3-bias"}


def _tall(m, k=128, c=128, taps=27, sms=132, pixels=None, forward=True):
    pixels = pixels or (1, 16, 128, m // (16 * 128))
    return choose_plan(m, k, c, taps, sms, pixels, forward=forward).config == TALL


def test_the_rules_edges():
    """Each bound of `takes_tall` on its own, from the measured n1 16 x 128 x 128 (M = 2^18)."""
    m = 1 << 18
    assert _tall(m) and _tall(m, taps=9)  # the measured 3x3x3 and 1x3x3
    assert not _tall(m, forward=False)  # a data-gradient phase
    assert not _tall(m, k=120) and not _tall(m, k=136) and not _tall(m, k=256)
    assert not _tall(m, pixels=(16, 1, 128, 128))  # conv2d: one output plane a image
    assert not _tall(m, taps=1, c=1152)  # 18 k-tiles of a 1x1
    assert _tall(m, c=64, taps=27) and _tall(m, c=192, taps=9)  # 27 k-tiles: in range
    assert not _tall(m, c=64, taps=9)  # 9 k-tiles
    assert not _tall(m, c=256, taps=27) and not _tall(m, c=448, taps=9)  # 108, 63
    assert _tall(m, c=384, taps=9)  # 54
    assert not _tall(16 * 128 * 96, pixels=(1, 16, 128, 96))  # M below 2^18 (6 rounds of 12)
    # zero fill: 96 x 88 planes (P % 32 = 0, Q % 8 = 0) in, 100 x 88 and 96 x 84 out
    assert _tall(32 * 96 * 88, pixels=(1, 32, 96, 88))
    assert not _tall(32 * 100 * 88, pixels=(1, 32, 100, 88))
    assert not _tall(32 * 96 * 84, pixels=(1, 32, 96, 84))
    # whole rounds: 1024 TALL tiles are 512 clusters, 7.76 rounds of 66 (SQUARE 15.52 of 16);
    # 1080 (540 clusters: 8.18 -> 9 rounds against SQUARE's 16.36 -> 17) leave one more round
    assert not _tall(1080 * 256, pixels=(1, 30, 128, 72))
    # larger M: no upper bound (n8 16 x 64 x 64: 2048 tiles, 16 rounds against 32)
    assert _tall(8 * 16 * 64 * 64, pixels=(8, 16, 64, 64))
    # another SM count: 114 SMs (57 clusters) keep the measured rows (9 rounds against 18)
    assert _tall(m, sms=114) and _tall(m, taps=9, sms=114)


def test_takes_tall_counts_rounds_as_the_launcher_does():
    m, pixels = 1 << 18, (1, 16, 128, 128)
    assert takes_tall(m, 128, 128, 27, 132, pixels)
    assert not takes_tall(m, 128, 128, 27, 132, None)  # a strided forward
    # 512 clusters on 100 SMs (50 a round): 11 rounds against SQUARE's 21 (1024 clusters)
    assert not takes_tall(m, 128, 128, 27, 100, pixels)


def test_every_key_of_the_class_is_a_standard_build(model_kernel):
    """A sweep of the class through the launcher (keys only): each key standard, dtypes and
    bias both; TALL's among them."""
    standard = {tuple(p) for p in SPEC.standard_params()}
    seen = set()
    for dtype, bias in itertools.product((torch.bfloat16, torch.float16), (False, True)):
        for n, z, hw, c, taps in itertools.product((1, 4), (8, 16), (64, 128), (64, 128),
                                                   (9, 27)):  # fmt: skip
            m = n * z * hw * hw
            plan = launch._choose(dtype, bias, m, 128, c, taps, None, None, False,
                                  (n, z, hw, hw), True, False)  # fmt: skip
            key = model_kernel[-1]
            seen.add(key["tile_m"])
            assert tuple(sorted(key.items())) in standard, key
            assert (plan[2].config == TALL) == (key["tile_m"] == 256)
    assert seen == {128, 256}


def _out_spatial(p):
    from forgekernel.bench.suites import conv_layers as L

    return L.output_spatial(p)


CASES = [
    # n, c, k, (D, H, W), geometry; stride 1 and more than one tap: rectangles of the width
    # rect_width gives 256 pixels (9 x 11 outputs: one 16 x 16; 20 x 22: three 8 x 32; 7 x 33:
    # three 16 x 16), the rest the im2col walk
    (2, 72, 136, (5, 9, 11), _geometry((3, 3, 3), (1, 1, 1))),
    (1, 24, 40, (3, 19, 21), _geometry((1, 3, 3), (0, 2, 1), pad_hi=(0, 1, 2))),
    (1, 16, 200, (4, 7, 33), _geometry((3, 3, 3), (2, 2, 2), dil=(2, 2, 2))),
    (2, 72, 40, (7, 13, 11), _geometry((3, 3, 3), (1, 1, 1), stride=(2, 2, 2))),
    (1, 8, 8, (1, 1, 1), _geometry((1, 1, 1), (0, 0, 0))),
]


@pytest.fixture
def model_kernel(monkeypatch):
    keys = []

    def get_kernel(spec, params):
        keys.append(dict(params))
        return emulate.stand_in(spec, params)

    launch._plans.clear()
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    yield keys
    launch._plans.clear()


@pytest.mark.parametrize("case", range(len(CASES)))
def test_the_tall_tile_through_the_launcher_is_torchs_convolution(model_kernel, case):
    """The launcher with TALL (its rectangle width for 256 pixels at stride 1, the im2col walk
    otherwise; the bench's SplitPlan form too): bias, C and K off the tile, the output a channel
    slice of a wider buffer (the extra channels stay NaN)."""
    n, c, k, size, g = CASES[case]
    torch.manual_seed(case)
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    bias = torch.randn(k, dtype=F64)
    want = _cl5(_torch_conv(x, w, bias, g))
    rect = 0
    if g.stride == (1, 1, 1) and g.filter != (1, 1, 1):
        rect = rect_width(*want.shape[2:4], 256)
        assert rect == (16, 8, 16)[case]
    for plan in (TALL, SplitPlan(TALL, 1, 0, 0, rect)):
        wide = torch.full((*want.shape[:4], k + 8), float("nan"), dtype=F64)
        launch.fprop(_cl5(x), _cl5(w), bias, wide[..., :k], g, plan)
        assert torch.allclose(wide[..., :k], want, rtol=1e-6, atol=1e-5)
        assert bool(wide[..., k:].isnan().all())
        key = model_kernel[-1]
        assert key["tile_m"] == 256 and key["rect"] == rect and not key["split"]


def test_was_sits_on_the_moved_cases():
    """`was` (the plan before: SQUARE unsplit on rectangles 8 wide) on exactly the cases the
    rule moved, with the `launcher` control; nowhere else. Recounted by the launcher: `was`
    2048 tiles of 128x128, ours 1024 of 256x128, both unsplit on rectangles 8 wide."""
    assert set(conv_fwd.CONV3D_WAS) == MOVED
    for case in conv_fwd.BENCH_CASES + conv_fwd.CHECK_CASES:
        runs = conv_fwd.variants(case)
        assert ("was" in runs) == (case.name in MOVED), case.name
        assert "launcher" in runs or case.name not in MOVED
    bf = torch.bfloat16
    for name, plans in conv_fwd.CONV3D_WAS.items():
        case = next(c for c in conv_fwd.BENCH_CASES if c.name == name)
        m, k, c, taps, pixels = _problem(case)
        ours = launch._choose(bf, False, m, k, c, taps, None, None, False, pixels, True,
                              False)[2]  # fmt: skip
        was = launch._choose(bf, False, m, k, c, taps, None, plans["was"], False, pixels,
                             True, False)[2]  # fmt: skip
        assert ours == SplitPlan(TALL, taps * c // 64, 1, m // 256, 8)
        assert was == SplitPlan(SQUARE, taps * c // 64, 1, m // 128, 8)


def test_the_kernel_refuses_what_the_tall_tile_is_not_built_for():
    pytest.importorskip("cutlass")
    from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90

    assert ConvFpropSm90(TALL).num_mma_wg == 2
    for cfg, kw in (
        (replace(TALL, split=True), {}),
        (TALL, {"dgrad": True}),
        (replace(TALL, tile_n=256), {}),
        (replace(TALL, tile_m=192), {}),
    ):
        with pytest.raises(ValueError):
            ConvFpropSm90(cfg, **kw)


# ---------------------------------------------------------------- on the DSL (CPU)
CHECKED = {
    "128x128": SQUARE,
    "128x256": LARGE,
    "128x64": NARROW,
    "64x128": CANDIDATES[1],
    "256x128": TALL,
}


def _sampled_threads(n: int) -> list[int]:
    """Warp 0 whole, then the first and last lane of every other warp: the layouts are affine
    in the lane and warp digits, so these reach every mode; every thread of the 256x128 tile
    took 40 s of CI's CPU (trace-time Python, per element), this sample ~1/5 of it."""
    return sorted({*range(32), *range(32, n, 32), *range(63, n, 32)})


# CI: the 256-row tile (this file's, where the flat index is not the copy's); the 128-row
# tiles' traces are slow (~15 s of CI's CPU)
@pytest.mark.parametrize("name", slow_past(CHECKED, keep="256x128"))
def test_sub_tile_value_is_the_copys_coordinate(name):
    """For each sampled consumer thread (`_sampled_threads`): value v of epilogue sub-tile e,
    taken from the accumulator at kernel.sub_tile_value, is the accumulator element the
    stmatrix copy stores at that sub-tile's (row, column) (coordinates of identity tensors, at
    trace time). The 128-row tiles' flat e x frag + v is the same index; on 256 rows it is
    not."""
    pytest.importorskip("cutlass")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute

    from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90, sub_tile_value

    cfg = CHECKED[name]
    kernel = ConvFpropSm90(cfg)
    found = {"checked": 0, "bad": 0, "flat_bad": 0}
    threads = _sampled_threads(kernel.num_mma_threads)

    def walk():  # plain Python, called at trace time: its loops are unrolled, not traced
        kernel._setup(cutlass.BFloat16)
        mma = kernel.tiled_mma
        r2s = kernel._r2s(mma)
        tm, tn, en = cfg.tile_m, cfg.tile_n, cfg.epi_n
        for t in threads:
            acc = r2s.retile(mma.get_slice(t).partition_C(cute.make_identity_tensor((tm, tn))))
            dst = r2s.get_slice(t).partition_S(cute.make_identity_tensor((tm, en)))
            frag, total = cute.size(dst), cute.size(acc)
            for e, v in itertools.product(range(tn // en), range(frag)):
                want = (int(dst[v][0]), int(dst[v][1]) + e * en)
                got = acc[sub_tile_value(e, v, dst.shape, total)]
                flat = acc[e * frag + v]
                found["checked"] += 1
                found["bad"] += (int(got[0]), int(got[1])) != want
                found["flat_bad"] += (int(flat[0]), int(flat[1])) != want
                assert sub_tile_value(e, v, dst.shape, total) == e * frag + v or tm == 256

    @cute.jit
    def check():
        walk()

    cute.compile(check)
    per_thread = cfg.tile_m * cfg.tile_n // kernel.num_mma_threads
    assert found["checked"] == len(threads) * per_thread and found["bad"] == 0
    assert (found["flat_bad"] > 0) == (cfg.tile_m == 256)


def _build(params, tmp_path, monkeypatch):
    pytest.importorskip("cutlass")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    from forgekernel.kernels.conv.sm90 import compile as fprop_compile
    from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text

    made = []
    real = fprop_compile.ConvFpropSm90

    def keep(*args, **kw):
        made.append(real(*args, **kw))
        return made[-1]

    monkeypatch.setattr(fprop_compile, "ConvFpropSm90", keep)
    compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    cubin = compiled.artifacts.CUBIN
    path = Path(tmp_path) / "conv.cubin"
    path.write_bytes(cubin if isinstance(cubin, bytes) else Path(cubin).read_bytes())
    found = inspect_cubin(path)
    if found["registers"] is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not installed")
    return sass_text(path), found, made[-1]


@pytest.mark.parametrize(
    "params",
    slow_past(  # CI: the bf16 bias build; the fp16 one is slow
        [
            params_for("bfloat16", True, TALL, rect=8),
            params_for("float16", False, TALL, rect=8),
        ],
        ids=["256x128-bf16-bias-r8", "256x128-fp16-r8"],
    ),
)
def test_the_tall_builds_have_no_spills_and_fit(params, tmp_path, monkeypatch):
    """The standard keys (both dtypes, bias or not, rectangles 8 wide): 168 registers at entry
    (setmaxnreg 40 / 232: two consumer warpgroups, as every standard build), no local memory,
    4 AB stages of 48 KB and a 2 x 16 KB epilogue ring in shared memory, twice SQUARE's
    HGMMA.64x128x16 a k-tile (two m64 atoms a warpgroup)."""
    from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY

    sass, found, kernel = _build(params, tmp_path, monkeypatch)
    assert found["spill_bytes"] == 0 and not re.search(r"\b(LDL|STL)\b", sass)
    assert found["registers"] == 168 and kernel.threads_per_cta == 384
    assert kernel.stages == 4 and kernel.shared_storage.size_in_bytes() <= SMEM_CAPACITY
    assert "USETMAXREG.DEALLOC.CTAPOOL 0x28" in sass
    assert re.search(r"USETMAXREG\.TRY_ALLOC\.CTAPOOL \S+ 0xe8", sass)
    # a k-tile: 8 HGMMA.64x128x16 a warpgroup (two atoms x four k-blocks), one batch in flight
    assert len(re.findall(r"HGMMA\.64x128x16\.F32", sass)) == 24
    assert "WARPGROUP.DEPBAR.LE gsb0, 0x1" in sass
    walk = r"UTMALDG\.5D\.IM2COL" if dict(params)["rect"] == 0 else r"UTMALDG\.5D\b"
    assert re.search(walk, sass) and "UTMASTG" in sass
