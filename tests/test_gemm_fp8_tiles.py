"""The FP8 GEMM's tile alternatives (issue 21) on the CPU: prebuilt for both outputs under
distinct compile keys, A multicast picked from M = LARGE_M_MCAST_A on, and the GPU script's
shape and config lists and its rows (scripts/fp8_tiles.py, loaded from its file)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.bench.suite import Case
from forgekernel.bench.suites import gemm_fp8 as suite_module
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.dense.sm90.tile import ring_stages
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_sm90
from forgekernel.kernels.gemm.fp8.sm90.config import (
    GROUPED,
    LARGE,
    LARGE_M_MCAST_A,
    LARGE_MCAST_A,
    MID,
    NARROW_CONFIGS,
    NARROW_SCALE_AHEAD,
    OUT_DTYPES,
    STANDARD_CONFIGS,
    STREAM,
    STREAM_DECODE,
    choose_config,
    params_for,
    tiled_config,
)
from forgekernel.reference.gemm import gemm_fp8_ref

PREFILL_CANDIDATES = (LARGE_MCAST_A, STREAM)
# a decode-box narrow pick's twins' tag suffixes (scripts/fp8_tiles.py `twins`)
SCALE_TWINS = ("_f2", "_sw", "_f4_sw")
# a 64-row-box narrow pick's (the pick loads its scales by its own warp four ahead, `_f4_sw`):
# one warp one ahead (the standard before), one warp four ahead, the scale warp two ahead
WARP_TWINS = ("", "_f4", "_f2_sw")
# LARGE's (its scales by their own warp two ahead since 2026-12-07): one warp two ahead (the
# standard before), the scale warp four ahead, then the band of 8 clusters
LARGE_TWINS = ("1m_f2", "1m_f4_sw", "8m_f2_sw")
# LARGE_MCAST_A's (the scale warp four ahead; its band the standard): one warp, the warp two ahead
MCAST_A_TWINS = ("_f2_mn", "_f2_mn_sw")


@pytest.fixture(scope="module")
def script():
    return load_script("fp8_tiles")


def test_candidates_are_prebuilt_for_both_outputs():
    standard = set(SPEC.standard_params())
    for cfg in PREFILL_CANDIDATES:
        assert cfg in STANDARD_CONFIGS
        assert {params_for(out, cfg) for out in OUT_DTYPES} <= standard


def test_standard_compile_keys_are_distinct():
    """Distinct keys; beside the partial-wave rule's band builds (tests/test_pdl_band.py), one
    per output dtype and standard config, and the grouped ones."""
    params = [p for p in SPEC.standard_params() if "pdl" not in dict(p)]
    grouped = [p for p in params if dict(p).get("grouped")]
    configs = (*STANDARD_CONFIGS, *NARROW_CONFIGS)  # the narrow full-K tiles the chooser picks
    assert len(set(params)) == len(params) == len(OUT_DTYPES) * len(configs) + len(grouped)
    assert all(dict(p)["cluster_m"] == 1 for p in grouped)  # B never multicast when grouped
    assert len({cfg.tag() for cfg in STANDARD_CONFIGS}) == len(STANDARD_CONFIGS)


def test_candidates_keep_the_fp8_tile_shape():
    """What the dense kernel takes with FP8: 128-column tiles, K steps of one scale block."""
    for cfg in PREFILL_CANDIDATES:
        assert (cfg.tile_m, cfg.tile_n, cfg.tile_k) == (128, 128, 128) and not cfg.a_rows


def test_tiled_128_row_tiles_take_six_stages_beside_a_3_deep_epilogue():
    """The sixth AB stage (measured faster at large K, H200 15:48): the tiled 128-row standard
    tiles fit 6 stages of A, B and their 512 B of staged scales beside a 3-deep epilogue ring
    (5 beside the 4-deep one); stream K keeps 4 deep and 5 stages, the grouped layout takes
    LARGE_MCAST_A's."""
    scales = 128 * 4
    for cfg in (LARGE, LARGE_MCAST_A):
        assert cfg.epi_stages == 3 and not cfg.stages and not cfg.stream_k
        assert ring_stages(cfg, 1, 2, scales) == 6
        assert ring_stages(dataclasses.replace(cfg, epi_stages=4), 1, 2, scales) == 5
    assert STREAM.epi_stages == 4 and ring_stages(STREAM, 1, 2, scales) == 5
    # the grouped layout takes the dense tile's ring (18:47), walked in bands of 8 (12-03 06:21)
    # (its scales K-major as measured; LARGE_MCAST_A reads them M-major since 2026-12-05)
    # (and its scales by the TMA warp two ahead: the grouped `f4_sw` was not adopted, 12-07)
    assert GROUPED == dataclasses.replace(
        LARGE_MCAST_A, swizzle=8, scale_mn_major=False, scale_warp=False, scale_ahead=2
    )
    # the dense tiles' scales by a warp of their own (2026-12-07 12:05): LARGE two ahead,
    # LARGE_MCAST_A four
    assert LARGE.scale_warp and LARGE.scale_ahead == 2
    assert LARGE_MCAST_A.scale_warp and LARGE_MCAST_A.scale_ahead == 4
    # the dense A-multicast tile walks the same bands (2026-12-07), LARGE still M first
    assert LARGE_MCAST_A.swizzle == 8 and LARGE.swizzle == 1
    assert LARGE_MCAST_A.raster_along_m and LARGE.raster_along_m


def test_chooser_takes_the_a_multicast_from_large_m():
    rng = random.Random(21)
    shapes = [(rng.randint(129, 20000), rng.randint(1, 60000), 128 * rng.randint(1, 200))
              for _ in range(300)]  # fmt: skip
    for m, n, k in shapes:
        assert tiled_config(m) == (LARGE_MCAST_A if m >= LARGE_M_MCAST_A else LARGE)
        assert choose_config(m, n, k) in (tiled_config(m), STREAM)


def test_script_shapes(script):
    names = [c.name for c in script.cases(script.GROUPS)]
    assert len(names) == len(set(names))
    assert {"4096x36864x7168", "2048x7168x4096", "128x1536x7168"} <= set(names)
    assert all(c.params["n"] % 8 == 0 for c in script.cases(script.GROUPS))
    assert [c.group for c in script.cases(("extra",))] == ["extra"] * len(script.EXTRA)
    # the square case beside a K whose scale rows are not a power of two bytes apart
    assert [c.name for c in script.cases(("stride",))] == ["8192x8192x7680"]
    assert "8192x8192x7680" not in {c.name for c in script.cases(("square", "extra"))}


@pytest.mark.parametrize(("m", "n", "k"), [(4096, 36864, 7168), (128, 1536, 7168), (513, 576, 256)])
def test_script_configs(script, m, n, k):
    configs = script.configs_for(m, n, k)
    assert configs[0] == choose_config(m, n, k)
    assert len(configs) == len(set(configs))
    assert {LARGE, *PREFILL_CANDIDATES} <= set(configs)
    assert all(cfg.fits(m) for cfg in configs)
    assert (MID in configs) == (m <= script.SMALL_TILES_UP_TO)
    # the other epilogue depth (decided at 15:48) no longer timed
    assert {c.epi_stages for c in configs if c.tile_m == 128 and not c.stream_k} == {3}
    # no other scale distance is timed by one warp (`_f1` / `_f4` measured slower; the
    # standard before the scale warp: two); the scale warp's twins two and four ahead
    one = [c for c in configs if c.tile_m == 128 and not c.stream_k and not c.scale_warp]
    assert {c.scale_ahead for c in one} <= {2}
    assert {c for c in STANDARD_CONFIGS if c.scale_ahead != 1} == {LARGE, LARGE_MCAST_A}
    # and reading A's scales M-major (the standards as they are otherwise): nothing else does
    # (LARGE_MCAST_A reads them M-major since 2026-12-05: its twin is the K-major one)
    flipped = {
        dataclasses.replace(c, scale_mn_major=not c.scale_mn_major) for c in (LARGE, LARGE_MCAST_A)
    }
    assert flipped <= set(configs)
    assert {c for c in STANDARD_CONFIGS if c.scale_mn_major} == {LARGE_MCAST_A}
    # the chooser's pick also given M-major scales, where it is a tiled 128-row tile
    given = script.given_mn_major(m, n, k)
    pick = choose_config(m, n, k)
    if pick.tile_m == 128 and not pick.stream_k:
        assert given == dataclasses.replace(pick, scale_mn_major=True) and given in configs
    else:
        assert given is None


@pytest.mark.parametrize(
    ("m", "n", "k", "tags"),
    [
        # the narrow picks (one CTA a tile), 64-row box: the scale loading before the scale
        # warp (the control), one warp four ahead, the scale warp two ahead
        (128, 1536, 7168, tuple("64x32_c1x1_s0_e4x32_w1m" + t for t in WARP_TWINS)),
        (512, 576, 7168, tuple("64x48_c1x1_s0_e4x16_w1m" + t for t in WARP_TWINS)),
        (128, 7168, 16384, tuple("64x112_c1x1_s0_e4x16_w1m" + t for t in WARP_TWINS)),
        (64, 4096, 7168, tuple("64x32_c1x1_s0_e4x32_w1m" + t for t in WARP_TWINS)),
        # a decode box: the scales two ahead, by their own warp (four ahead)
        (1, 10240, 5120, tuple("64x80_c1x1_s0_e4x16_w1m_a8" + t for t in SCALE_TWINS)),
        # the tiled 128-row picks (their scales by their own warp): one warp, the warp's other
        # lead; LARGE walked in bands of 8 clusters (LARGE_MCAST_A walks them already)
        (4096, 36864, 7168, tuple("128x128_c2x1_s0_e3x32_w" + t for t in LARGE_TWINS)),
        (16384, 7168, 18432, tuple("128x128_c1x2_s0_e3x32_w8m" + t for t in MCAST_A_TWINS)),
        # a pick already clustered (SKINNY) or streaming K: none
        (64, 36864, 7168, ()),
        (1, 576, 7168, ()),
    ],
)
def test_script_twins(script, m, n, k, tags):
    """The pick's twins (scripts/fp8_tiles.py `twins`): timed after every other row, or alone
    beside the pick with --twins; each the pick with its scale loading (`scale_ahead`,
    `scale_warp`) or its walk changed, and none a standard build (compiled at first use)."""
    pick = choose_config(m, n, k)
    twins = script.twins(pick, m, n)
    assert tuple(t.tag() for t in twins) == tags
    for twin in twins:
        changed = {f for f, v in dataclasses.asdict(twin).items() if v != getattr(pick, f)}
        assert changed and changed <= {"scale_ahead", "scale_warp", "swizzle"}
        assert twin not in STANDARD_CONFIGS and twin not in NARROW_CONFIGS
    full = script.configs_for(m, n, k)
    assert full[0] == pick and full[len(full) - len(twins) :] == twins
    assert script.configs_for(m, n, k, only_twins=True) == [pick, *twins]


def test_scale_warp_keys_and_tags():
    """`scale_warp` keys and tags only where set (`_sw`): the 64-row-box narrow tiles (M > 32)
    load their scales by their own warp four ahead (`_f4_sw`, adopted 2026-12-07, docs/gemm/NOTES.md
    "Measured: next/fp8-narrow-scales"), the tiled 128-row tiles two (LARGE, `_f2_sw`) and four
    ahead (LARGE_MCAST_A, `_f4_mn_sw`; "Measured: next/integration50"); every other standard
    key (the 64-row 128-column tiles, stream K, the grouped tile) stays as it was; the chooser
    picks it on the mid narrow shapes and the tiled 128-row tiles, never on a decode box."""
    tiled = {LARGE: "_f2_sw", LARGE_MCAST_A: "_f4_mn_sw"}
    for cfg in (*STANDARD_CONFIGS, GROUPED):
        assert cfg.scale_warp == (cfg in tiled) == ("scale_warp" in cfg.key())
        assert cfg.tag().endswith("_sw") == cfg.scale_warp
        assert cfg not in tiled or cfg.tag().endswith(tiled[cfg])
    for cfg in NARROW_CONFIGS:
        assert cfg.scale_warp == (not cfg.a_rows)
        assert cfg.scale_ahead == (NARROW_SCALE_AHEAD if cfg.scale_warp else 1)
        assert cfg.tag().endswith("_f4_sw") == cfg.scale_warp
        assert GemmConfig.from_params(dict(params_for("bfloat16", cfg))) == cfg
    sw = dataclasses.replace(NARROW_CONFIGS[0], scale_warp=True)
    assert sw.key()["scale_warp"] is True and sw.tag() == NARROW_CONFIGS[0].tag() + "_sw"
    assert GemmConfig.from_params(dict(params_for("bfloat16", sw))) == sw
    for m, n, k in ((128, 1536, 7168), (64, 4096, 7168), (512, 576, 7168), (128, 7168, 16384)):
        cfg = choose_config(m, n, k)
        assert cfg.scale_warp and cfg.scale_ahead == NARROW_SCALE_AHEAD and cfg in NARROW_CONFIGS
    for m, n, k in ((1, 7168, 16384), (16, 7168, 2048), (1, 10240, 5120)):
        assert not choose_config(m, n, k).scale_warp
    for m, n, k in ((4096, 7168, 2048), (8192, 8192, 8192)):
        assert choose_config(m, n, k) in tiled


def test_one_warp_scales_are_candidates():
    """The bench's `one_warp_scales` variant (the scale-warp tiles loading their scales by the
    TMA warp as the standard before: one ahead on the narrow tiles, two on the 128-row ones) and
    the grouped bench's `f4_sw` compile from the candidates (`forgekernel build --candidates`),
    in each form the standard builds take; none is a standard build."""
    from forgekernel.kernels.gemm.fp8.sm90.config import one_warp_scales

    standard, cands = set(SPEC.standard_params()), set(SPEC.candidate_params())
    assert cands and not cands & standard
    for cfg in NARROW_CONFIGS:
        if cfg.scale_warp:
            one = one_warp_scales(cfg)
            assert not one.scale_warp and one.scale_ahead == 1 and one.a_rows == 0
            assert {params_for(out, one) for out in OUT_DTYPES} <= cands
    for cfg in (LARGE, LARGE_MCAST_A):  # their one-warp builds: the standard keys before
        one = one_warp_scales(cfg)
        assert not one.scale_warp and one.scale_ahead == 2
        assert one == dataclasses.replace(cfg, scale_warp=False, scale_ahead=2)
        assert {params_for(out, one) for out in OUT_DTYPES} <= cands
    # the grouped bench's `f4_sw` (the grouped layout's own key, always the top form)
    from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED_F4_SW

    assert GROUPED_F4_SW.scale_warp and GROUPED_F4_SW.scale_ahead == 4
    assert {params_for(out, GROUPED_F4_SW, True) for out in OUT_DTYPES} <= cands


def test_scale_ahead_keys_and_tags():
    """A config loading the scales one k-tile ahead has no `scale_ahead` in its compile key (the
    keys, records and ledgers from before the knob stay valid); two ahead (the tiled standards
    since 18:47; LARGE_MCAST_A four since 2026-12-07) keys and tags it."""
    f1 = dataclasses.replace(LARGE, scale_ahead=1, scale_warp=False)
    assert "scale_ahead" not in f1.key() and LARGE.key()["scale_ahead"] == 2
    assert LARGE.tag() == f1.tag() + "_f2_sw" and LARGE_MCAST_A.tag().endswith("_f4_mn_sw")
    assert params_for("bfloat16", f1) != params_for("bfloat16", LARGE)
    for cfg in (LARGE, LARGE_MCAST_A):
        assert GemmConfig.from_params(dict(params_for("bfloat16", cfg))) == cfg


def test_script_rows_on_cpu(script, monkeypatch):
    """measure() end to end with stand-ins: a kernel computing the reference (insisting on the
    stream-K workspace exactly where the config streams), a DeepGEMM twice as slow, a fake
    timer; every config through the launcher."""
    seen_scales = {}

    def get_kernel(spec, params):
        cfg = GemmConfig.from_params(dict(params))

        def fn(a, b, c, work, flags, per, sa, sb, group, clusters):
            assert (work is not None and per > 0) == cfg.stream_k
            mn = fp8_sm90.takes_mn_major(sa)
            seen_scales.setdefault(cfg.tag(), []).append((*sa.stride(), mn))
            c.copy_(gemm_fp8_ref(a, b, sa, sb).to(c.dtype))

        return fn

    def timer(fns, rotate, **kwargs):
        for fn in fns.values():
            fn(*rotate[-1])
        return {name: [2.0 if name == "deepgemm" else 1.0] for name in fns}

    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "_plans", type(fp8_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda index: 132)
    monkeypatch.setattr(script, "time_interleaved", timer)
    monkeypatch.setattr(script, "rotation_sets", lambda nbytes: 2)
    deepgemm = lambda inputs: suite_module.reference(inputs).to(inputs["out_dtype"])  # noqa: E731
    suite = dataclasses.replace(suite_module.suite(), comparators=lambda: {"deepgemm": deepgemm})
    case = Case("300x264x384", {"m": 300, "n": 264, "k": 384}, "extra")
    rows = script.measure(case, suite, torch.Generator().manual_seed(3), torch.device("cpu"))
    by_config = {r["config"]: r for r in rows}
    # the band twin through the launcher, alone beside the pick with --twins
    band = dataclasses.replace(LARGE, swizzle=script.BAND)
    assert by_config[band.tag()]["status"] == "ok" and by_config[band.tag()]["ratio"] == 2.0
    short = script.measure(
        case, suite, torch.Generator().manual_seed(3), torch.device("cpu"), only_twins=True
    )
    one = dataclasses.replace(LARGE, scale_warp=False)  # the scales by the TMA warp (before)
    four = dataclasses.replace(LARGE, scale_ahead=4)  # the scale warp four ahead
    tags = [LARGE.tag(), one.tag(), four.tag(), band.tag(), "deepgemm"]
    assert [r["config"] for r in short] == tags
    assert all(r["status"] in ("ok", "comparator") for r in short)
    # the 128-row tile (6 of 132 SMs busy, but narrow's 45 tiles too few to take)
    pick = choose_config(300, 264, 384)
    assert by_config[pick.tag()]["chosen"] and pick == LARGE
    mn = dataclasses.replace(pick, scale_mn_major=True)
    for tag in (*(c.tag() for c in (*PREFILL_CANDIDATES, MID, STREAM_DECODE[-1], mn)),
                mn.tag() + "+sa_mn"):  # fmt: skip
        row = by_config[tag]
        assert row["status"] == "ok" and row["ratio"] == 2.0 and row["max_err"] <= row["bound"]
    # A's scales as each kernel takes them: M-major (4-padded) where the config says so,
    # through the launcher's copy or, `+sa_mn`, as the script made them; else the suite's
    assert seen_scales[mn.tag()] == [(1, 300, True)] * len(seen_scales[mn.tag()])
    assert all(s == (3, 1, False) for s in seen_scales[LARGE.tag()])
    assert by_config["deepgemm"]["max_err"] <= by_config[PREFILL_CANDIDATES[0].tag()]["bound"]


# slow, all four: a twin is scripts/fp8_tiles.py's tuning configuration beside its pick, none a
# standard build (the 64x48 pick's one-warp twin a candidate, its other twins and the tiled
# pick's no key at all), and each pick's own build is test_gemm_fp8_mainloop's in CI (64x48:
# test_narrow_tiles_keep_the_schedule; LARGE: test_scale_warp_compiles_on_the_other_mainloops).
# CI's two cases until 2026-12-07 compiled five twins for this check alone (~5.5 s of an idle
# CPU); the 64x32 and 64x112 picks' twins ~6.5 s more
@pytest.mark.slow
@pytest.mark.parametrize(
    ("m", "n", "k"), [(128, 1536, 7168), (512, 576, 7168), (128, 7168, 16384), (4096, 7168, 2048)]
)
def test_script_twins_compile_without_spills(script, m, n, k):
    """Every twin of these picks compiles for sm_90a (bf16 out) as its pick does: 0 spill bytes,
    no LDL, the pick's QGMMA and FFMA counts (only the scale loading or the walk differs)."""
    pytest.importorskip("cutlass")
    from cubins import build  # tests/ is on the path

    from forgekernel.runtime.resources import find_tool

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    pick = choose_config(m, n, k)

    def sass(cfg):
        """inspect_cubin's instruction counts of `cfg`'s build (tests/cubins.py: once a
        process), asserted free of spills."""
        info = build(SPEC, params_for("bfloat16", cfg)).resources
        assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0, cfg.tag()
        return info["sass"]

    ref = sass(pick)
    for twin in script.twins(pick, m, n):
        got = sass(twin)
        assert (got["QGMMA"], got["FFMA"]) == (ref["QGMMA"], ref["FFMA"])
