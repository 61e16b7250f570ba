"""The forward's 256x128 candidate (config.TALL: two consumer warpgroups of two m64 atoms each;
docs/conv/NOTES.md, "256 x 128 for the K = 128 conv3d layers"), on the CPU: the epilogue's
sub-tile index (kernel.sub_tile_value) is the stmatrix copy's own coordinate for every tile,
the 256-row one included (the flat e x frag + v of the 128-row tiles is not); the 256-pixel
rectangles cover every output pixel once; the kernel's model with the tile is torch's
convolution on small 3-D problems (odd extents, padding, dilation, stride 2, C and K off the
tile) through the launcher; the chooser never takes it and no standard key holds it; the bench
variants sit on exactly their cases; the builds have no spills and fit."""

from __future__ import annotations

import itertools
import os
import re
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forgekernel.bench.suites import conv_fwd
from forgekernel.kernels.conv.sm90 import SPEC, emulate, launch
from forgekernel.kernels.conv.sm90.config import (
    CANDIDATES,
    LARGE,
    NARROW,
    SQUARE,
    STANDARD_CONFIGS,
    TALL,
    SplitPlan,
    choose_plan,
    params_for,
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


def test_the_tall_tile_is_a_candidate_only():
    assert TALL.tile_m == 256 and TALL.tile_n == 128 and TALL in CANDIDATES
    assert TALL not in STANDARD_CONFIGS
    assert all(dict(p)["tile_m"] <= 128 for p in SPEC.standard_params())


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


def test_the_chooser_never_takes_the_tall_tile():
    """Every conv3d case of the suite and a sweep of 2-D / 3-D problems: a standard tile."""
    for case in conv_fwd.BENCH_CASES:
        p = case.params
        out = [s for s in _out_spatial(p)]
        m = p["n"] * out[0] * out[1] * (out[2] if len(out) > 2 else 1)
        taps = 1
        for f in p["kernel"]:
            taps *= f
        pixels = (p["n"], *([1] * (3 - len(out))), *out)
        plan = choose_plan(m, p["k"], p["c"], taps, 132, pixels)
        assert plan.config in STANDARD_CONFIGS and plan.config.tile_m == 128, case.name
    for n, d, hw, c, k, taps in itertools.product(
        (1, 4), (1, 16), (7, 64, 128), (64, 128, 512), (64, 128, 256), (1, 9, 27)
    ):
        plan = choose_plan(n * d * hw * hw, k, c, taps, 132, (n, d, hw, hw))
        assert plan.config.tile_m != 256


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


def test_the_bench_variants_sit_on_their_cases():
    """`m256` / `m256e64` / `ovl` on the three K = 128 conv3d cases, `epi64` on the four
    128x256 ones below 1.07x,
    each with the `launcher` control; nowhere else; the real problems' plans as the NOTES
    section counts them (1024 tiles of 256x128 on rectangles 8 wide; the launcher's own
    128x256 plan but for the epilogue)."""
    names = {c.name for c in conv_fwd.BENCH_CASES}
    assert set(conv_fwd.CONV3D_CANDIDATES) <= names
    for case in conv_fwd.BENCH_CASES:
        runs = conv_fwd.variants(case)
        want = set(conv_fwd.CONV3D_CANDIDATES.get(case.name, {}))
        assert ({"m256", "m256e64", "ovl", "epi64"} & set(runs)) == want, case.name
        if want:
            assert "launcher" in runs
    bf = torch.bfloat16
    for name, plans in conv_fwd.CONV3D_CANDIDATES.items():
        case = next(c for c in conv_fwd.BENCH_CASES if c.name == name)
        p = case.params
        out = _out_spatial(p)
        m = p["n"] * out[0] * out[1] * out[2]
        taps = p["kernel"][0] * p["kernel"][1] * p["kernel"][2]
        pixels = (p["n"], *out)
        chosen = launch._choose(bf, False, m, p["k"], p["c"], taps, None, None, False, pixels,
                                True, False)[2]  # fmt: skip
        for variant, given in plans.items():
            plan = launch._choose(bf, False, m, p["k"], p["c"], taps, None, given, False,
                                  pixels, True, False)[2]  # fmt: skip
            assert plan.parts == 1 and plan.rect == 8 == chosen.rect
            assert plan.overlap == (variant == "ovl")
            if variant == "ovl":
                assert chosen.config == SQUARE == plan.config and plan.tiles == chosen.tiles
            elif variant.startswith("m256"):
                assert chosen.config == SQUARE
                assert replace(plan.config, epi_n=32, epi_stages=2) == TALL
                assert plan.tiles == m // 256 and plan.per_split == taps * p["c"] // 64
            else:
                assert chosen.config == LARGE and plan.config.epi_n == 64
                assert replace(plan.config, epi_n=32, epi_stages=4) == LARGE
                assert plan.tiles == chosen.tiles


def test_the_kernel_refuses_what_the_tall_tile_is_not_built_for():
    pytest.importorskip("cutlass")
    from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90

    assert ConvFpropSm90(TALL).num_mma_wg == 2
    assert ConvFpropSm90(SQUARE, overlap=True).overlap
    for cfg, kw in (
        (replace(TALL, split=True), {}),
        (TALL, {"dgrad": True}),
        (replace(TALL, tile_n=256), {}),
        (replace(TALL, tile_m=192), {}),
        (TALL, {"overlap": True}),  # two 128-register accumulators
        (LARGE, {"overlap": True}),
        (replace(LARGE, tile_m=64), {"overlap": True}),  # 64x256: two 128-register ones too
        (replace(SQUARE, split=True), {"overlap": True}),
        (SQUARE, {"overlap": True, "dgrad": True}),
        (SQUARE, {"overlap": True, "trigger": "late"}),
    ):
        with pytest.raises(ValueError):
            ConvFpropSm90(cfg, **kw)


def test_the_overlap_key_only_when_set():
    """("overlap", True) joins the compile key only when asked for: every other key, standard
    or candidate, is the one it was."""
    plain = params_for("bfloat16", True, SQUARE, rect=8)
    assert "overlap" not in dict(plain)
    assert params_for("bfloat16", True, SQUARE, rect=8, overlap=False) == plain
    assert dict(params_for("bfloat16", True, SQUARE, rect=8, overlap=True)) == {
        **dict(plain),
        "overlap": True,
    }
    assert all("overlap" not in dict(p) for p in SPEC.standard_params())
    assert not SplitPlan(SQUARE, 1, 1, 1).overlap


@pytest.mark.parametrize("case", range(len(CASES) - 1))
def test_the_overlap_plan_through_the_launcher_is_torchs_convolution(model_kernel, case):
    """SQUARE with the overlapped epilogue (the kernel's model computes what the kernel is
    built to: the same tiles and k-tiles; the overlap reorders only when each tile is stored):
    the launcher asks for the overlap key, the output is torch's; a plan of too few k-tiles (the
    epilogue rides on k-tiles 1 .. tile_n / epi_n of the next tile), a split or a data gradient
    with it is refused."""
    n, c, k, size, g = CASES[case]
    torch.manual_seed(case)
    x = torch.randn(n, c, *size, dtype=F64)
    w = torch.randn(k, c, *g.filter, dtype=F64)
    bias = torch.randn(k, dtype=F64)
    want = _cl5(_torch_conv(x, w, bias, g))
    rect = rect_width(*want.shape[2:4], 128) if g.stride == (1, 1, 1) else 0
    wide = torch.full((*want.shape[:4], k + 8), float("nan"), dtype=F64)
    plan = SplitPlan(SQUARE, 1, 0, 0, rect, overlap=True)
    launch.fprop(_cl5(x), _cl5(w), bias, wide[..., :k], g, plan)
    assert torch.allclose(wide[..., :k], want, rtol=1e-6, atol=1e-5)
    assert bool(wide[..., k:].isnan().all())
    key = model_kernel[-1]
    assert key["overlap"] and key["tile_m"] == 128 and key["rect"] == rect


def test_the_overlap_refuses_short_reductions_and_splits(model_kernel):
    x = torch.randn(1, 8, 3, 5, 5, dtype=F64)
    g = _geometry((1, 1, 1), (0, 0, 0))
    y = torch.empty(1, 3, 5, 5, 16, dtype=F64)
    w = torch.randn(16, 8, 1, 1, 1, dtype=F64)
    with pytest.raises(ValueError, match="overlap"):  # one k-tile a tile
        launch.fprop(_cl5(x), _cl5(w), None, y, g, SplitPlan(SQUARE, 1, 0, 0, 0, overlap=True))
    g = _geometry((3, 3, 3), (1, 1, 1))
    w = torch.randn(16, 8, 3, 3, 3, dtype=F64)
    split = SplitPlan(replace(SQUARE, split=True), 9, 0, 0, 8, overlap=True)
    with pytest.raises(ValueError, match="overlap"):
        launch.fprop(_cl5(x), _cl5(w), None, y, g, split)


# ---------------------------------------------------------------- on the DSL (CPU)
CHECKED = {
    "128x128": SQUARE,
    "128x256": LARGE,
    "128x64": NARROW,
    "64x128": CANDIDATES[1],
    "256x128": TALL,
    "256x128-epi64": replace(TALL, epi_n=64, epi_stages=1),
    "128x256-epi64": replace(LARGE, epi_n=64, epi_stages=2),
}


@pytest.mark.parametrize("name", list(CHECKED))
def test_sub_tile_value_is_the_copys_coordinate(name):
    """For every consumer thread: value v of epilogue sub-tile e, taken from the accumulator at
    kernel.sub_tile_value, is the accumulator element the stmatrix copy stores at that
    sub-tile's (row, column) (coordinates of identity tensors, at trace time). The 128-row
    tiles' flat e x frag + v is the same index; on 256 rows it is not."""
    pytest.importorskip("cutlass")
    os.environ.setdefault("CUTE_DSL_ARCH", "sm_90a")
    import cutlass
    import cutlass.cute as cute

    from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90, sub_tile_value

    cfg = CHECKED[name]
    kernel = ConvFpropSm90(cfg)
    found = {"checked": 0, "bad": 0, "flat_bad": 0}

    def walk():  # plain Python, called at trace time: its loops are unrolled, not traced
        kernel._setup(cutlass.BFloat16)
        mma = kernel.tiled_mma
        r2s = kernel._r2s(mma)
        tm, tn, en = cfg.tile_m, cfg.tile_n, cfg.epi_n
        for t in range(kernel.num_mma_threads):
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
    assert found["checked"] == cfg.tile_m * cfg.tile_n and found["bad"] == 0
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


def test_the_overlap_build_keeps_one_batch_in_flight_under_the_epilogue(tmp_path, monkeypatch):
    """SQUARE rect 8 with bias and the overlap: 168 registers, no spills; two mainloop sites
    (one an accumulator, 48 HGMMA in all), each ending in the kernel's only two full waits
    (`DEPBAR.LE gsb0, 0x0`): every epilogue sub-tile of the tile before sits after a wait
    that leaves the next k-tile's batch in flight (`0x1`). A WGMMA under a branch, or an
    accumulator written while the other's WGMMAs run, had ptxas wait after every batch."""
    params = params_for("bfloat16", True, SQUARE, rect=8, overlap=True)
    sass, found, kernel = _build(params, tmp_path, monkeypatch)
    assert kernel.overlap and found["spill_bytes"] == 0 and found["registers"] == 168
    assert not re.search(r"\b(LDL|STL)\b", sass)
    assert len(re.findall(r"HGMMA\.64x128x16\.F32", sass)) == 48
    assert sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0") == 2
    # the stmatrix of each overlapped sub-tile: the last wait before it leaves one batch
    ops = re.findall(r"(HGMMA|WARPGROUP\.DEPBAR\.LE gsb0, 0x[01]|STSM)", sass)
    overlapped = 0
    for i, op in enumerate(ops):
        if op == "STSM" and ops[i - 1] != "STSM":
            waits = [o for o in ops[:i] if o.startswith("WARPGROUP")]
            overlapped += waits[-1].endswith("0x1")
    assert overlapped == 8  # 4 sub-tiles in each of the two sites; the drain's after 0x0


@pytest.mark.parametrize(
    "params",
    [
        params_for("bfloat16", True, TALL, rect=8),
        params_for("float16", False, TALL),
        params_for("bfloat16", False, replace(TALL, epi_n=64, epi_stages=1), rect=8),
    ],
    ids=["256x128-bias-r8", "256x128-im2col", "256x128-epi64-r8"],
)
def test_the_tall_builds_have_no_spills_and_fit(params, tmp_path, monkeypatch):
    """168 registers at entry (setmaxnreg 40 / 232: two consumer warpgroups, as every standard
    build), no local memory, 4 AB stages of 48 KB and a 2 x 16 KB epilogue ring in shared
    memory (1 x 32 KB with 256 x 64 sub-tiles), twice SQUARE's HGMMA.64x128x16 a k-tile (two
    m64 atoms a warpgroup)."""
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
