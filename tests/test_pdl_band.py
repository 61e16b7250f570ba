"""The partial-wave rule (runtime/pdl.py `PARTIAL_WAVE`, docs/gemm/NOTES.md "Adopting a
partial-wave rule"): the policy on its band's edges, the form the dense and FP8 launchers key
for the grid they launch, and the standard builds under each rule: every suite case's kernel
prebuilt, and without a rule the keys and the builds of before. CPU only."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.gemm.dense.sm90 import SPEC as GEMM_SPEC
from forgekernel.kernels.gemm.dense.sm90 import band_configs
from forgekernel.kernels.gemm.dense.sm90 import launch as dense
from forgekernel.kernels.gemm.dense.sm90.config import (
    DTYPES,
    STANDARD_CONFIGS,
    choose_config,
    params_for,
    takes_kn,
)
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig
from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8_SPEC
from forgekernel.kernels.gemm.fp8.sm90 import band_configs as fp8_band_configs
from forgekernel.kernels.gemm.fp8.sm90 import config as fp8_config
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8
from forgekernel.runtime import pdl
from forgekernel.runtime.build import build_tasks

LATE_BAND, OFF_BAND = ("late", 66, 104), ("off", 66, 104)
RULES = {"none": None, "late": LATE_BAND, "off": OFF_BAND, "late_all": ("late", 0, 132)}
RULES["shipped"] = pdl.PARTIAL_WAVE  # the rule adopted in runtime/pdl.py (None until adopted)


@pytest.fixture(params=sorted(RULES))
def rule(request, monkeypatch):
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", RULES[request.param])
    return RULES[request.param]


@pytest.fixture
def keys_only(monkeypatch, tmp_path):
    """The launchers on an H200's 132 SMs, no tuning table, get_kernel returning the key."""
    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    dense.tuning.load.cache_clear()
    for mod in (dense, fp8):
        monkeypatch.setattr(mod, "get_kernel", lambda spec, params: params)
        monkeypatch.setattr(mod, "num_sms", lambda index: 132)
    yield
    dense.tuning.load.cache_clear()


def _dense_key(m, n, k, dtype=torch.bfloat16, b_kn=False):
    return dense._choose(dtype, b_kn, m, n, k, 0, None, pdl.forced())[0]


def _fp8_key(m, n, k, dtype=torch.bfloat16):
    return fp8._plan(dtype, m, -(-n // 8) * 8, k, 0, None, pdl.forced())[0]


# ---------------------------------------------------------------- the policy


@pytest.mark.parametrize("form", ["late", "off"])
def test_the_band_edges(monkeypatch, form):
    """low < CTAs <= high on 132 SMs, scaled exactly to another chip's SMs."""
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", (form, 66, 104))
    got = {c: pdl.form_for(c, 132) for c in (1, 64, 66, 67, 68, 80, 104, 105, 128, 132)}
    assert got == {c: form if 66 < c <= 104 else "top" for c in got}
    # 114 SMs (H100 PCIe): 57 < CTAs <= 89.8
    assert [pdl.form_for(c, 114) for c in (57, 58, 89, 90)] == ["top", form, form, "top"]
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", None)
    assert {pdl.form_for(c, 132) for c in range(1, 133)} == {"top"}
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", ("bottom", 66, 104))
    with pytest.raises(ValueError, match="PARTIAL_WAVE"):
        pdl.form_for(80, 132)


def test_the_switches_override_the_rule(monkeypatch):
    """FORGEKERNEL_PDL=0 and `off()`: "off" on every grid; `late()` and `top()`: theirs on
    every grid, PDL on whatever the environment says."""
    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", OFF_BAND)
    assert [pdl.form(c, 132) for c in (64, 80, 128)] == ["top", "off", "top"]
    with pdl.late():
        assert {pdl.form(c, 132) for c in (64, 80, 128)} == {"late"}
    with pdl.top():
        assert {pdl.form(c, 132) for c in (64, 80, 128)} == {"top"} and pdl.forced() == "top"
        assert pdl.trigger() == "top"
        with pdl.off():
            assert pdl.form(80, 132) == "off"
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", LATE_BAND)
    with pdl.off():
        assert {pdl.form(c, 132) for c in (64, 80, 128)} == {"off"}
    monkeypatch.setenv("FORGEKERNEL_PDL", "0")
    assert {pdl.form(c, 132) for c in (64, 80, 128)} == {"off"}
    with pdl.top():
        assert pdl.enabled() and pdl.form(80, 132) == "top"


def test_key_for_each_form():
    params = params_for("bfloat16", False, STANDARD_CONFIGS[0])
    assert pdl.key_for(params, "top") is params
    assert pdl.key_for(params, "late") == pdl.key(params, True, "late")
    assert pdl.key_for(params, "off") == pdl.key(params, False)
    with pytest.raises(ValueError, match="form"):
        pdl.key_for(params, "early")


# ---------------------------------------------------------------- the launchers


# (M, N, K) -> the grid's CTAs on 132 SMs (docs/gemm/NOTES.md "Measured 2026-12-05 04:10")
DENSE_GRIDS = {(16, 5120, 8192): 80, (1, 4096, 4096): 64, (64, 8192, 8192): 128}
# FP8 since narrow (docs/gemm/NOTES.md "Narrow adopted"): one CTA a narrow full-K tile,
# 1x10240x5120's 64x80 128 (its 128-column tiles' 80 before), 16x7168x2048's 64x64 112 and
# 128x1536x7168's 64x32 96 (in the band), 64x36864x7168's 64x128 a whole wave
FP8_GRIDS = {(1, 10240, 5120): 128, (16, 7168, 2048): 112, (128, 1536, 7168): 96,
             (64, 36864, 7168): 132}  # fmt: skip


def test_the_grids_are_the_kernels(keys_only):
    """The launchers' CTA counts (plan.py `grid_ctas`) on the measured cases: the tiles of the
    decode configs in one wave, as the 04:10 table counts them."""
    from forgekernel.kernels.gemm.dense.sm90.plan import grid_ctas

    for (m, n, k), ctas in DENSE_GRIDS.items():
        cfg = choose_config(m, n, k, 132)
        assert not cfg.stream_k and grid_ctas(cfg, m, n, k, 132) == ctas
    for (m, n, k), ctas in FP8_GRIDS.items():
        cfg = fp8_config.choose_config(m, n, k, 132)
        assert not cfg.stream_k and grid_ctas(cfg, m, n, k, 132) == ctas


def test_stream_k_grid_is_the_kernels():
    """Stream K: `grid_ctas` is the plan's clusters (the kernel's `_stream_grid` from per)."""
    from forgekernel.kernels.gemm.dense.sm90.config import split_for, stream_plan
    from forgekernel.kernels.gemm.dense.sm90.plan import grid_ctas

    for m, n, k in ((1, 576, 7168), (16, 10240, 8192), (2057, 216, 6344), (3680, 5832, 3896)):
        cfg = choose_config(m, n, k, 132)
        assert cfg.stream_k, (m, n, k)
        plan = split_for(cfg, m, n, k, 132)
        assert grid_ctas(cfg, m, n, k, 132, plan.per) == plan.ctas
    cfg = fp8_config.choose_config(1, 576, 7168, 132)  # narrow's 18 CTAs: too few to take
    per, ctas, _ = stream_plan(cfg, 1, 576, 7168, 132, fp8_config.STREAM_MIN_K)
    assert cfg.stream_k and grid_ctas(cfg, 1, 576, 7168, 132, per) == ctas


def test_the_launchers_key_the_rules_form(keys_only, rule):
    """Each measured case keyed in the rule's form where its grid lies in the band (80 CTAs),
    in the standard (top) form elsewhere; every key a standard build."""
    standard, fp8_standard = set(GEMM_SPEC.standard_params()), set(FP8_SPEC.standard_params())
    cases = [(_dense_key, params_for, choose_config, DENSE_GRIDS, standard)]
    cases.append((_fp8_key, fp8_config.params_for, fp8_config.choose_config, FP8_GRIDS,
                  fp8_standard))  # fmt: skip
    for key_of, params_of, chooser, grids, built in cases:
        for (m, n, k), ctas in grids.items():
            dense.clear_plans()
            fp8.clear_plans()
            top = (
                params_of("bfloat16", False, chooser(m, n, k, 132))
                if params_of is params_for
                else params_of("bfloat16", chooser(m, n, k, 132))
            )
            form = rule[0] if rule and rule[1] < ctas <= rule[2] else "top"
            got = key_of(m, n, k)
            assert got == pdl.key_for(top, form), (m, n, k, rule)
            assert got in built


def test_the_plans_key_the_switches_apart(keys_only, monkeypatch):
    """Inside `off()` and `late()` the plans take those forms on every grid, kept apart from
    the rule's plans (`pdl.forced()` in the plan keys)."""
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", OFF_BAND)
    dense.clear_plans()

    def planned():
        return dense._plans.plan((torch.bfloat16, False, 16, 5120, 8192, 0, None, pdl.forced()))

    ran = planned()[0]
    with pdl.off():
        off = planned()[0]
    with pdl.late():
        late = planned()[0]
    with pdl.top():
        top_ = planned()[0]
    assert planned()[0] is ran and len(dense._plans) == 4
    top = params_for("bfloat16", False, choose_config(16, 5120, 8192, 132))
    assert ran == off == pdl.key(top, False) and late == pdl.key(top, True, "late")
    assert top_ == top
    dense.clear_plans()


# ---------------------------------------------------------------- the standard builds


def _today_dense() -> list:
    """The dense spec's standard params before the rule (next/pdl-wave)."""
    return [
        params_for(dtype, b_kn, cfg)
        for dtype in DTYPES
        for b_kn in (False, True)
        for cfg in STANDARD_CONFIGS
        if not b_kn or takes_kn(cfg)
    ]


def _today_fp8() -> list:
    """The FP8 spec's standard params without a rule: the 128-column configs, the grouped one,
    the narrow full-K tiles the chooser picks (since 2026-12-05, `NARROW_CONFIGS`)."""
    outs = fp8_config.OUT_DTYPES
    dense_ = [fp8_config.params_for(o, c) for o in outs for c in fp8_config.STANDARD_CONFIGS]
    grouped = [fp8_config.params_for(o, fp8_config.GROUPED, True) for o in outs]
    narrow = [fp8_config.params_for(o, c) for o in outs for c in fp8_config.NARROW_CONFIGS]
    return dense_ + grouped + narrow


def test_without_a_rule_the_standard_builds_are_todays(monkeypatch):
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", None)
    assert GEMM_SPEC.standard_params() == _today_dense()
    assert FP8_SPEC.standard_params() == _today_fp8()
    tasks = build_tasks("sm_90a", only=[GEMM_SPEC.name, FP8_SPEC.name])
    # FP8: 26 before narrow, + 24 narrow tiles x 2 outputs (2026-12-05); dense: + LARGE_BAND
    # and FIT_144_A x 2 dtypes x 2 layouts (config.walked's twins, 2026-12-06)
    assert len(tasks) == len(_today_dense()) + len(_today_fp8()) == 106 + 74


@pytest.mark.parametrize(
    "name, dense_count, fp8_count",
    [("late", 212, 144), ("off", 212, 144), ("late_all", 212, 146)],
)
def test_a_rule_adds_the_band_forms(monkeypatch, name, dense_count, fp8_count):
    """The band's form of every config the band reaches: all dense ones (one cluster up to a
    whole wave), all FP8 ones but LARGE_MCAST_A (M >= 8192: 128 CTAs at least) in a band up
    to 104, the 24 narrow full-K tiles among them (one CTA a tile: 1 up to a whole wave; FP8
    48 -> 144 builds with narrow, 2026-12-05); the standard builds first, unchanged."""
    form = RULES[name][0]
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", RULES[name])
    dense_, fp8_ = GEMM_SPEC.standard_params(), FP8_SPEC.standard_params()
    assert dense_[:106] == _today_dense() and fp8_[:74] == _today_fp8()
    assert dense_[106:] == [pdl.key_for(p, form) for p in _today_dense()]
    assert len(set(dense_)) == len(dense_) == dense_count
    assert len(set(fp8_)) == len(fp8_) == fp8_count
    assert band_configs() == STANDARD_CONFIGS
    mcast = fp8_config.LARGE_MCAST_A
    assert (mcast in fp8_band_configs()) == (name == "late_all")
    assert set(fp8_config.NARROW_CONFIGS) <= set(fp8_band_configs())
    assert fp8_config.fewest_ctas(mcast) == 128
    tasks = build_tasks("sm_90a", only=[GEMM_SPEC.name, FP8_SPEC.name])
    assert len(tasks) == dense_count + fp8_count


def _suite_keys(suite) -> set:
    """The compile keys of the suite's bench cases in both 16-bit dtypes (fresh plans)."""
    keys = set()
    for case in suite.BENCH_CASES:
        p = case.params
        for dtype in (torch.bfloat16, torch.float16):
            dense.clear_plans()
            fp8.clear_plans()
            if "b_layout" in p:  # the dense suite
                keys.add(_dense_key(p["m"], p["n"], p["k"], dtype, p["b_layout"] == "kn"))
            else:
                keys.add(_fp8_key(p["m"], p["n"], p["k"], dtype))
    return keys


def test_every_suite_case_is_prebuilt(keys_only, rule):
    """Under each rule the kernel of every gemm and gemm_fp8 bench case (both 16-bit dtypes)
    is a standard build: no compile at first call."""
    from forgekernel.bench.suites import gemm, gemm_fp8

    dense_keys, fp8_keys = _suite_keys(gemm), _suite_keys(gemm_fp8)
    assert dense_keys <= set(GEMM_SPEC.standard_params())
    assert fp8_keys <= set(FP8_SPEC.standard_params())
    forms = {dict(k).get("pdl", "top") for k in dense_keys | fp8_keys}
    assert forms == ({"top"} if rule is None else {"top", rule[0]} if rule[1] else {rule[0]})


def test_every_fp8_bench_variant_is_prebuilt(keys_only, rule):
    """Under each rule the plans of the gemm_fp8 suite's `was`, `narrow` and `narrow_even`
    variants (a config forced through the launcher, keyed in its grid's form as ours) are
    standard builds, both 16-bit dtypes; the narrow picks of ours too, in the band's form where
    their grid lies in it (16x7168x2048's 64x64: 112 CTAs)."""
    from forgekernel.bench.suites import gemm_fp8

    forced = {
        "was": fp8_config.wide_config,
        "narrow": fp8_config.narrow,
        "narrow_even": lambda m, n, k: fp8_config.narrow(m, n, k, gemm_fp8.EVEN_WIDTHS),
    }
    built, keys = set(FP8_SPEC.standard_params()), set()
    for case in gemm_fp8.BENCH_CASES:
        m, n, k = (case.params[x] for x in "mnk")
        for name in gemm_fp8.variants(case).keys() & forced.keys():
            for dtype in (torch.bfloat16, torch.float16):
                fp8.clear_plans()
                cfg = forced[name](m, n, k)
                keys.add(fp8._plan(dtype, m, -(-n // 8) * 8, k, 0, cfg, pdl.forced())[0])
    assert keys and keys <= built
    fp8.clear_plans()
    narrow_key = _fp8_key(16, 7168, 2048)
    assert dict(narrow_key)["tile_n"] == 64 and narrow_key in built
    want = rule[0] if rule and rule[1] < 112 <= rule[2] else "top"
    assert dict(narrow_key).get("pdl", "top") == want


# A sweep of the narrow class (M 1-512, N 576 to two waves of 128-column tiles, K 128-28672):
# N values reaching each width (the model's 64x32 ... 64x112 picks) with each A box
NARROW_SWEEP_M = (1, 5, 8, 9, 16, 17, 32, 33, 64, 65, 100, 128, 129, 256, 384, 512)
NARROW_SWEEP_N = (576, 1032, 1536, 2088, 3072, 4096, 4272, 6352, 7168, 7912, 8536, 9056, 10240,
                  14848, 16640)  # fmt: skip
NARROW_SWEEP_K = (128, 1024, 2048, 7168, 16384, 28672)


def test_the_narrow_class_is_prebuilt(keys_only, rule):
    """Over a sweep of the narrow class, every plan the launcher makes (`_plan`, keys only: the
    chooser's config in its grid's PDL form) is a standard build under each rule, both 16-bit
    outputs; the sweep reaches every one of `NARROW_CONFIGS` (each is picked somewhere)."""
    built, picked = set(FP8_SPEC.standard_params()), set()
    for m in NARROW_SWEEP_M:
        for n in NARROW_SWEEP_N:
            for k in NARROW_SWEEP_K:
                if not fp8_config.takes_narrow(m, n, k, 132):
                    continue
                cfg = fp8_config.choose_config(m, n, k, 132)
                picked.add(cfg)
                for dtype in (torch.bfloat16, torch.float16):
                    fp8.clear_plans()
                    key = fp8._plan(dtype, m, n, k, 0, None, pdl.forced())[0]
                    assert key in built, (m, n, k, key)
                    params = {x: v for x, v in key if x not in ("pdl", "out")}
                    assert GemmConfig.from_params(params) == cfg
    assert picked == set(fp8_config.NARROW_CONFIGS)


def test_without_a_rule_the_keys_are_todays(keys_only, monkeypatch):
    """No rule: every suite case keyed as before (the chooser's params, no "pdl" part)."""
    from forgekernel.bench.suites import gemm, gemm_fp8

    monkeypatch.setattr(pdl, "PARTIAL_WAVE", None)
    for case in gemm.BENCH_CASES:
        p = case.params
        b_kn = p["b_layout"] == "kn"
        dense.clear_plans()
        want = params_for("bfloat16", b_kn, choose_config(p["m"], p["n"], p["k"], 132, b_kn))
        assert _dense_key(p["m"], p["n"], p["k"], b_kn=b_kn) == want
    for case in gemm_fp8.BENCH_CASES:
        p = case.params
        fp8.clear_plans()
        cfg = fp8_config.choose_config(p["m"], p["n"], p["k"], 132)
        assert _fp8_key(p["m"], p["n"], p["k"]) == fp8_config.params_for("bfloat16", cfg)
