"""Programmatic dependent launch of the decode chains (runtime/pdl.py, common/sm90/pdl.py): the
switch and the compile keys on the host, the plans of the bench's `no_pdl` cases, and from the
SASS of the standard builds (CPU, sm_90a) that each PDL kernel executes griddepcontrol.wait
(ACQBULK) before its first global access and launch_dependents (PREEXIT) once, with the
registers and the rest of the kernel of the build without PDL. CI compiles one kernel of each
SASS test (the paged pass, the dense GEMM's stream K, the convolution forward's split): the
others are marked `slow` (tests/sweeps.py) and run before landing a kernel change."""

from __future__ import annotations

import re

import pytest
import torch
from cubins import GLOBAL, sass_builder
from script_modules import load_script  # tests/ is on the path
from sweeps import slow_past

from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
from forgekernel.kernels.attention.mla.sm90.config import params_for as mla_params
from forgekernel.kernels.attention.paged.sm90 import SPEC as PAGED_SPEC
from forgekernel.kernels.attention.paged.sm90.config import params_for as paged_params
from forgekernel.runtime import pdl

# ---------------------------------------------------------------- the switch and the keys


def test_the_environment_and_off(monkeypatch):
    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    assert pdl.enabled() and pdl.forced() is None
    with pdl.off():
        assert not pdl.enabled() and pdl.forced() is False
    assert pdl.enabled() and pdl.forced() is None
    monkeypatch.setenv("FORGEKERNEL_PDL", "0")
    assert not pdl.enabled()
    monkeypatch.setenv("FORGEKERNEL_PDL", "yes")
    with pytest.raises(ValueError, match="FORGEKERNEL_PDL"):
        pdl.enabled()


def test_keys_apart_and_standard_builds_are_pdl():
    params = paged_params("combine", "bfloat16", 128)
    assert pdl.key(params, True) == params
    assert dict(pdl.key(params, False)) == {**dict(params), "pdl": "off"}
    for spec in (PAGED_SPEC, MLA_SPEC):
        assert not any(dict(p).get("pdl") for p in spec.standard_params())
        off = [p for p in spec.candidate_params() if dict(p).get("pdl") == "off"]
        assert off and all(pdl.key(tuple(x for x in p if x[0] != "pdl"), False) == p for p in off)


# ---------------------------------------------------------------- the launchers' plans


@pytest.fixture
def keys_only(monkeypatch):
    """The launchers' `_plan` on an H200's 132 SMs, get_kernel returning the compile key."""
    from forgekernel.kernels.attention.mla.sm90 import launch as mla
    from forgekernel.kernels.attention.paged.sm90 import launch as paged

    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    for mod in (paged, mla):
        monkeypatch.setattr(mod, "num_sms", lambda index: 132)
        monkeypatch.setattr(mod, "get_kernel", lambda spec, params: params)
    return paged, mla


def _paged_keys(paged, b, length, scheduled=False):
    """The compile keys the paged plan of Llama-3 8B (32 / 8 heads, D 128, page 16) launches;
    scheduled: with a step's schedule (the suite's `ours`: the ranges pass and combine)."""
    bf16 = torch.bfloat16
    partial, combine, _, _ = paged._plan(bf16, bf16, b, 32, 8, 128, length, 1, 0, False,
                                         scheduled=scheduled)  # fmt: skip
    return [k for k in (partial, combine) if k is not None]


def _mla_keys(mla, b, hq, length):
    """The compile keys the MLA plan (16-bit combined cache, page 64) launches."""
    plan = mla._plan("partial", torch.bfloat16, b, hq, length, 1, 0, False, 64)
    return [k for k in (plan[0], plan[1]) if k is not None]


PAGED_NO_PDL = ((1, 16384), (1, 65536), (64, 4096))  # the suite's NO_PDL_CASES
MLA_NO_PDL = ((1, 16, 4096), (1, 128, 4096), (16, 16, 4096))


def test_the_bench_cases_are_the_suites():
    from forgekernel.bench.suites import attention_paged, mla_decode

    paged = {f"b{b}-hq32-hkv8-d128-p16-L{n}" for b, n in PAGED_NO_PDL}
    mla = {f"b{b}-h{h}-p64-L{n}" for b, h, n in MLA_NO_PDL}
    assert set(attention_paged.NO_PDL_CASES) == paged
    assert set(mla_decode.NO_PDL_CASES) == mla
    for suite, names in ((attention_paged, paged), (mla_decode, mla)):
        cases = [c for c in suite.BENCH_CASES if c.name in names]
        assert len(cases) == len(names)
        assert all("no_pdl" in suite.variants(c) for c in cases)


@pytest.mark.parametrize("scheduled", [False, True])
@pytest.mark.parametrize("b, length", PAGED_NO_PDL)
def test_paged_plans_take_prebuilt_keys(keys_only, b, length, scheduled):
    """Default plans launch standard (PDL) builds, `pdl.off()` plans the candidates without,
    with a step's schedule too (its ranges pair was compiled at the bench's first no_pdl case
    until 2026-12-06)."""
    paged, _ = keys_only
    standard, candidates = PAGED_SPEC.standard_params(), PAGED_SPEC.candidate_params()
    on = _paged_keys(paged, b, length, scheduled)
    assert on and all(k in standard for k in on)
    with pdl.off():
        off = _paged_keys(paged, b, length, scheduled)
    assert off == [pdl.key(k, False) for k in on]
    assert all(k in candidates for k in off)


@pytest.mark.parametrize("b, hq, length", MLA_NO_PDL)
def test_mla_plans_take_prebuilt_keys(keys_only, b, hq, length):
    _, mla = keys_only
    standard, candidates = MLA_SPEC.standard_params(), MLA_SPEC.candidate_params()
    on = _mla_keys(mla, b, hq, length)
    assert len(on) == 2 and all(k in standard for k in on)  # the seesaw pass and the combine
    with pdl.off():
        off = _mla_keys(mla, b, hq, length)
    assert off == [pdl.key(k, False) for k in on]
    assert all(k in candidates for k in off)


def test_mla_decode_py_passes_have_no_pdl_build(keys_only):
    """FP8 caches take decode.py's pass (no PDL build, one key either way); its combine is
    the PDL one unless off."""
    _, mla = keys_only
    plan = mla._plan("partial", torch.bfloat16, 1, 16, 4096, 1, 0, True, 64)
    with pdl.off():
        plan_off = mla._plan("partial", torch.bfloat16, 1, 16, 4096, 1, 0, True, 64)
    assert plan[0] == plan_off[0] and "pdl" not in dict(plan[0])
    assert plan_off[1] == pdl.key(plan[1], False)


# ---------------------------------------------------------------- the compiles (CPU, sm_90a)


@pytest.fixture(scope="module")
def compiled():
    return sass_builder()


KERNELS = {
    "paged_pass": (PAGED_SPEC, paged_params("partial", "bfloat16", 128, 4)),
    "paged_combine": (PAGED_SPEC, paged_params("combine", "bfloat16", 128)),
    "mla_seesaw": (MLA_SPEC, mla_params("partial", "bfloat16", 16, tma=True)),
    "mla_combine": (MLA_SPEC, mla_params("combine", "bfloat16")),
    # a decode step's schedule: the ranges pass and combine (the combine reads its row range)
    "mla_ranges_pass": (
        MLA_SPEC,
        mla_params("partial", "bfloat16", 16, tma=True, worklist=True, ranges=True),
    ),  # fmt: skip
    "mla_ranges_combine": (MLA_SPEC, mla_params("combine", "bfloat16", ranges=True)),
}


def _first(lines, pattern) -> int:
    return next(i for i, line in enumerate(lines) if re.search(pattern, line))


# The builds without PDL compared (below) with the standard one: one per kernel class and
# `pdl.wait` / `launch_dependents` site. The ranges pass is the seesaw pass's class and site
# (seesaw.py, `pdl.wait(self.pdl)` at the top), its compare the seesaw pass's: ~8 s of CI's CPU
# (an MLA compile) fewer; its standard build keeps every check of its own.
DECODE_OFF = ("paged_pass", "paged_combine", "mla_seesaw", "mla_combine", "mla_ranges_combine")
# The standard builds CI checks: the paged pass, and the MLA ones its `mla` scope compiles for
# other files anyway (test_mla_worklist, test_mla_seesaw_compile, test_mla_schedule: conftest's
# SHARED_COMPILES), so their checks cost no compile; the two combines are sweeps (`slow`).
CI_KERNELS = ("paged_pass", "mla_seesaw", "mla_ranges_pass", "mla_ranges_combine")


@pytest.mark.parametrize(
    "name", [n if n in CI_KERNELS else pytest.param(n, marks=pytest.mark.slow) for n in KERNELS]
)
def test_wait_precedes_every_global_access(compiled, name):
    """The standard (PDL) build: one ACQBULK (griddepcontrol.wait), before the first global
    load, store or TMA, and one PREEXIT (launch_dependents); no local memory."""
    spec, params = KERNELS[name]
    res, lines = compiled(spec, params)
    joined = "\n".join(lines)
    assert len(re.findall(r"\bACQBULK\b", joined)) == 1
    assert len(re.findall(r"\bPREEXIT\b", joined)) == 1
    wait = _first(lines, r"\bACQBULK\b")
    if name == "paged_pass":
        # the documented exception (decode.py `_prefetch_guess`): before the wait one page-table
        # load whose value addresses L2 prefetches only (CCTL.E.PF2: the length's line, K's and
        # V's two lines of the thread's token), no other global access
        before = [x for x in lines[:wait] if re.search(GLOBAL, x)]
        assert len(before) == 1 and re.match(r"LDG\.E\s", before[0])
        assert sum("CCTL.E.PF2" in x for x in lines[:wait]) == 5
    else:
        assert wait < _first(lines, GLOBAL)
    assert res["spill_bytes"] == 0
    assert res["sass"].get("LDL", 0) == res["sass"].get("STL", 0) == 0


# slow, all five: a build without PDL is no standard configuration's (the bench's variant
# `no_pdl`, `build --candidates`' no_pdl_params, or FORGEKERNEL_PDL=0's compile at first call);
# CI compiled the paged pass's for this compare alone (~2 s of an idle CPU, 2026-12-07). The
# standard builds' wait and trigger stay CI's (test_wait_precedes_every_global_access)
@pytest.mark.slow
@pytest.mark.parametrize("name", DECODE_OFF)
def test_the_build_without_pdl_is_the_standard_one_without_its_two_instructions(compiled, name):
    """The build without PDL (one a kernel class and `pdl.wait` site: DECODE_OFF) has neither
    ACQBULK nor PREEXIT, the standard build's registers and SASS counts but the two, no local
    memory."""
    spec, params = KERNELS[name]
    res, _ = compiled(spec, params)
    off, off_lines = compiled(spec, pdl.key(params, False))
    assert not re.search(r"\b(ACQBULK|PREEXIT)\b", "\n".join(off_lines))
    assert off["spill_bytes"] == 0
    assert res["registers"] == off["registers"]
    assert res["sass"] == off["sass"]


# CI: the ranges build (the standard one, test_mla_schedule's, compiled in the same `mla`
# scope); the per-call work list's (ranges False) is slow: a candidate, `build --candidates`
@pytest.mark.parametrize("ranges", [pytest.param(False, marks=pytest.mark.slow), True])
def test_the_scheduling_kernel_waits_before_its_first_store(compiled, ranges):
    """The work list's kernel fills the partial LSEs first (ranges: writes the list and the row
    ranges a previous step's calls may still read): its wait precedes that store."""
    res, lines = compiled(MLA_SPEC, mla_params("worklist", "bfloat16", ranges=ranges))
    assert len([x for x in lines if re.search(r"\bACQBULK\b", x)]) == 1
    assert _first(lines, r"\bACQBULK\b") < _first(lines, GLOBAL)
    assert res["spill_bytes"] == 0


# ---------------------------------------------------------------- the GEMM family


def _gemm_family() -> dict:
    """One standard build of each kernel of the dense GEMM's family (the dense GEMM, B N-major,
    192-row tiles, stream K, the swap, FP8 tiled / 8-row decode tiles / grouped / stream K, the
    masked FP8 GEMM, the weight gradient's rectangles, im2col and reduce split) and of the
    convolutions' forward (im2col, rectangles, the split with its flags and the bias, the
    strided data gradient's) and fused data gradient (unsplit and split): all launched with
    PDL. Each picked by what it must have (the first standard build that has it), so that no
    two names are one build."""
    from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, WGRAD_SPEC
    from forgekernel.kernels.conv.sm90 import SPEC as CONV_SPEC
    from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC
    from forgekernel.kernels.gemm.dense.sm90 import SPEC as GEMM_SPEC
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8_SPEC

    plain = {"stream_k": False, "swap": False, "grouped": False, "split": False}
    want = {
        "gemm": (GEMM_SPEC, plain),
        "gemm_stream_k": (GEMM_SPEC, {"stream_k": True}),
        "gemm_swap": (GEMM_SPEC, {"swap": True}),
        "gemm_kn": (GEMM_SPEC, {**plain, "b_kn": True}),
        "gemm_192": (GEMM_SPEC, {**plain, "tile_m": 192}),
        "fp8": (FP8_SPEC, plain),
        "fp8_stream_k": (FP8_SPEC, {"stream_k": True}),
        "fp8_rows": (FP8_SPEC, {**plain, "a_rows": 8}),
        "fp8_grouped": (FP8_SPEC, {"grouped": True}),
        "masked": (MASKED_SPEC, {}),
        "wgrad": (WGRAD_SPEC, {"rect": 8, "reduce": False}),
        "wgrad_im2col": (WGRAD_SPEC, {"rect": 0}),
        "wgrad_reduce": (WGRAD_SPEC, {"reduce": True}),
        "conv_fwd": (CONV_SPEC, {"rect": 0, "split": False, "bias": False, "dgrad": False}),
        "conv_fwd_rect": (CONV_SPEC, {"rect": 8, "split": False, "bias": False, "dgrad": False}),
        "conv_fwd_split_bias": (CONV_SPEC, {"rect": 8, "split": True, "bias": True}),
        "conv_fwd_dgrad_split": (CONV_SPEC, {"rect": 0, "split": True, "dgrad": True}),
        "dgrad": (DGRAD_SPEC, {"split": False}),
        "dgrad_split": (DGRAD_SPEC, {"split": True}),
    }
    found = {}
    for name, (spec, has) in want.items():
        found[name] = (
            spec,
            next(
                p
                for p in spec.standard_params()
                if all(dict(p).get(k, False) == v for k, v in has.items())
            ),
        )
    return found


GEMM_FAMILY = _gemm_family()

# cubins.GLOBAL and what it leaves out: ATOMG (sm_90's global atomics: the split flags' and
# stream K's arrivals) and generic loads, stores and atomics (LD, ST, ATOM on a generic address)
ANY_GLOBAL = re.compile(rf"{GLOBAL.pattern}|\b(ATOMG|LD|ST)\b")


# The family's builds without PDL compared with their standard ones: one per kernel class and
# mode (GemmSm90 16-bit, block-scaled FP8 and masked; the convolutions' forward, fused data
# gradient and weight gradient). `pdl.wait` / `launch_dependents` are one const_expr site a
# class (gemm/dense/sm90/kernel.py, conv/sm90/kernel.py, dgrad_kernel.py and wgrad.py: the
# `pdl.wait(self.pdl)` at the top), the same call in every variant, so each class's compare is
# taken on its variant with the most code around it (stream K's and the splits' atomics, the
# reduce split's bulk reduce): 6 'off' compiles, not 19 (~1.3 s each on CI's CPU, ~20 s with
# the listings). Every variant's standard build keeps its own wait-before-every-global-access
# check.
GEMM_FAMILY_OFF = (
    "gemm_stream_k", "fp8_stream_k", "masked", "conv_fwd_split_bias", "dgrad_split",
    "wgrad_reduce",
)  # fmt: skip


@pytest.mark.parametrize("name", slow_past(sorted(GEMM_FAMILY), keep="gemm_stream_k"))
def test_gemm_family_waits_before_every_global_access(compiled, name):
    """As the decode kernels (above): one ACQBULK before the first global access, one PREEXIT,
    no spills."""
    spec, params = GEMM_FAMILY[name]
    assert "pdl" not in dict(params)  # the standard builds are the PDL ones
    res, lines = compiled(spec, params)
    joined = "\n".join(lines)
    assert len(re.findall(r"\bACQBULK\b", joined)) == 1
    assert len(re.findall(r"\bPREEXIT\b", joined)) == 1
    assert _first(lines, r"\bACQBULK\b") < _first(lines, ANY_GLOBAL)
    assert res["spill_bytes"] == 0


# slow, all six: as the decode kernels' compare (above), the builds without PDL are no standard
# configuration's (FORGEKERNEL_PDL=0 compiles them at first call); CI compiled stream K's for
# this compare alone (~1 s of an idle CPU, 2026-12-07), its standard build's check stays CI's
@pytest.mark.slow
@pytest.mark.parametrize("name", GEMM_FAMILY_OFF)
def test_gemm_family_build_without_pdl_is_the_standard_one_without_its_two(compiled, name):
    """The pdl 'off' build (GEMM_FAMILY_OFF) has neither ACQBULK nor PREEXIT, the standard
    build's registers and otherwise the same SASS counts."""
    spec, params = GEMM_FAMILY[name]
    res, _ = compiled(spec, params)
    off, off_lines = compiled(spec, pdl.key(params, False))
    assert not re.search(r"\b(ACQBULK|PREEXIT)\b", "\n".join(off_lines))
    assert off["spill_bytes"] == 0
    assert res["registers"] == off["registers"]
    assert {k: v for k, v in res["sass"].items()} == off["sass"]


def test_gemm_family_plans_are_keyed_by_the_switch(monkeypatch):
    """The launchers look their kernels up with pdl.key: the standard key by default, the
    pdl 'off' one inside `pdl.off()`, in plans kept apart (`pdl.forced()` in the plan keys)."""
    from forgekernel.kernels.conv.sm90 import launch as conv
    from forgekernel.kernels.gemm.dense.sm90 import launch as dense
    from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8
    from forgekernel.ops import conv as op

    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    for mod in (dense, fp8, conv):
        monkeypatch.setattr(mod, "get_kernel", lambda spec, params: params)
        monkeypatch.setattr(mod, "num_sms", lambda index: 132)
    on = dense._choose(torch.bfloat16, False, 64, 8192, 8192, 0, None, None)[0]
    with pdl.off():
        off = dense._choose(torch.bfloat16, False, 64, 8192, 8192, 0, None, False)[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)
    on = fp8._plan(torch.bfloat16, 4096, 7168, 2048, 0, None)[0]
    with pdl.off():
        off = fp8._plan(torch.bfloat16, 4096, 7168, 2048, 0, None, False)[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)
    on = fp8._grouped_plan(None, torch.bfloat16, 0, None)[0]
    with pdl.off():
        off = fp8._grouped_plan(None, torch.bfloat16, 0, None, False)[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)
    on = conv._wgrad_plan(torch.bfloat16, 512, 2048, 1, (8, 25), 0, None)[0]
    with pdl.off():
        off = conv._wgrad_plan(torch.bfloat16, 512, 2048, 1, (8, 25), 0, None)[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)
    # the forward's (n32-c512-7x7-k512-3x3) and the fused data gradient's (n8-c640-32x32-k640-
    # 3x3-s2) plans, as the suites' no_pdl cases build them
    fwd = (torch.bfloat16, False, 32 * 7 * 7, 512, 512, 9, 0, None, False, (32, 1, 7, 7), True)
    on = conv._choose(*fwd, False)[0]
    with pdl.off():
        off = conv._choose(*fwd, False, pdl.forced())[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)
    g = op._geometry_of((2, 2), (1, 1), (1, 1), (1, 1), (3, 3))
    fused = conv.fused_dgrad(g, (1, 32, 32), (1, 16, 16))
    args = (torch.bfloat16, (8, 1, 32, 32), 640, 640, fused, fused.walk, 0, None)
    on = conv._choose_fused(*args)[0]
    with pdl.off():
        off = conv._choose_fused(*args, pdl.forced())[0]
    assert "pdl" not in dict(on) and off == pdl.key(on, False)


def test_gemm_family_bench_variants():
    from forgekernel.bench.suites import (
        conv_dgrad,
        conv_fwd,
        conv_layers,
        conv_wgrad,
        gemm,
        gemm_fp8,
    )

    for suite in (gemm, gemm_fp8, conv_wgrad, conv_fwd, conv_dgrad):
        cases = [c for c in suite.BENCH_CASES if c.name in suite.NO_PDL_CASES]
        assert len(cases) == len(suite.NO_PDL_CASES)
        run = getattr(suite, "run_no_pdl", conv_layers.run_no_pdl)
        assert all(suite.variants(c)["no_pdl"] is run for c in cases)
        # the convolutions' late trigger beside it, on the same cases and no others
        late = [c for c in suite.BENCH_CASES if "pdl_late" in suite.variants(c)]
        assert late == (cases if suite in (conv_wgrad, conv_fwd, conv_dgrad) else [])
        assert all(suite.variants(c)["pdl_late"] is conv_layers.run_pdl_late for c in late)


# ---------------------------------------------------------------- the late trigger (opt-in)


def test_late_switch_and_keys(monkeypatch):
    """`pdl.late()`: PDL on whatever the environment says, the trigger "late", plans keyed
    apart; its key adds ("pdl", "late"), the standard (top) key is the params as they are."""
    monkeypatch.setenv("FORGEKERNEL_PDL", "0")
    assert pdl.trigger() == "top"
    with pdl.late():
        assert pdl.enabled() and pdl.forced() == "late" and pdl.trigger() == "late"
        with pdl.off():
            assert not pdl.enabled() and pdl.trigger() == "top"
    assert not pdl.enabled() and pdl.forced() is None
    params = paged_params("combine", "bfloat16", 128)
    assert pdl.key(params, True, "top") is params
    late = pdl.key(params, True, "late")
    assert dict(late) == {**dict(params), "pdl": "late"} and list(late) == sorted(late)
    assert pdl.key(params, False, "late") == pdl.key(params, False)
    assert pdl.built_on(dict(late)) and pdl.trigger_of(dict(late)) == "late"
    assert pdl.trigger_of(dict(params)) == "top" and not pdl.built_on(dict(pdl.key(params, False)))
    with pytest.raises(ValueError, match="trigger"):
        pdl.key(params, True, "bottom")


def test_gemm_plans_take_the_late_key_inside_late(monkeypatch):
    """The dense and FP8 launchers: the late key inside `pdl.late()`, the standard key as it
    was outside (no "pdl" component: the standard builds' keys unchanged); none of the GEMM
    family's standard or candidate builds is a late one (opt-in, compiled at first use). With no
    partial-wave rule: the adopted one's keys and band builds are tests/test_pdl_band.py's."""
    from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC
    from forgekernel.kernels.gemm.dense.sm90 import SPEC as GEMM_SPEC
    from forgekernel.kernels.gemm.dense.sm90 import launch as dense
    from forgekernel.kernels.gemm.dense.sm90.config import choose_config, params_for
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8_SPEC
    from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8

    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    monkeypatch.setattr(pdl, "PARTIAL_WAVE", None)
    for mod in (dense, fp8):
        monkeypatch.setattr(mod, "get_kernel", lambda spec, params: params)
        monkeypatch.setattr(mod, "num_sms", lambda index: 132)
    on = dense._choose(torch.bfloat16, False, 16, 5120, 8192, 0, None, None)[0]
    assert on == params_for("bfloat16", False, choose_config(16, 5120, 8192, 132))
    with pdl.late():
        late = dense._choose(torch.bfloat16, False, 16, 5120, 8192, 0, None, pdl.forced())[0]
    assert late == pdl.key(on, True, "late")
    on = fp8._plan(torch.bfloat16, 1, 10240, 5120, 0, None)[0]
    with pdl.late():
        late = fp8._plan(torch.bfloat16, 1, 10240, 5120, 0, None, pdl.forced())[0]
    assert "pdl" not in dict(on) and late == pdl.key(on, True, "late")
    for spec in (GEMM_SPEC, FP8_SPEC, MASKED_SPEC):
        params = [*spec.standard_params(), *(spec.candidate_params() or [])]
        assert not any(dict(p).get("pdl") == "late" for p in params)


def _decode_builds() -> dict:
    """The builds of the partial-wave losses (docs/gemm/NOTES.md "Measured 2026-12-05 04:10"):
    the dense decode tile of 16x5120x8192 (64x64 c1x2, a_rows 16), FP8's of 1x10240x5120 (64x128
    c1x2, a_rows 8: the plan before narrow, `wide_config`); and a stream-K build and two
    consumer warpgroups (128x256 c2x1)."""
    from forgekernel.kernels.gemm.dense.sm90 import SPEC as GEMM_SPEC
    from forgekernel.kernels.gemm.dense.sm90.config import choose_config, params_for
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC as FP8_SPEC
    from forgekernel.kernels.gemm.fp8.sm90.config import params_for as fp8_params
    from forgekernel.kernels.gemm.fp8.sm90.config import wide_config as fp8_config

    return {
        "gemm_decode": (GEMM_SPEC, params_for("bfloat16", False, choose_config(16, 5120, 8192))),
        "fp8_decode": (FP8_SPEC, fp8_params("bfloat16", fp8_config(1, 10240, 5120))),
        "gemm_stream_k": GEMM_FAMILY["gemm_stream_k"],
        "gemm": GEMM_FAMILY["gemm"],
    }


LATE_BUILDS = _decode_builds()
GMMA = re.compile(r"\b[HQ]GMMA\b")  # 16-bit and FP8 WGMMA


@pytest.mark.parametrize("name", slow_past(sorted(LATE_BUILDS), keep="gemm_stream_k"))
def test_the_late_trigger_follows_the_last_mainloop(compiled, name):
    """The late build: one ACQBULK, still before the first global access; one PREEXIT, after
    the last WGMMA and its wait and before the epilogue's first TMA store after it; registers,
    spills and the SASS counts of the standard (top) build, whose PREEXIT follows its ACQBULK."""
    spec, params = LATE_BUILDS[name]
    top, top_lines = compiled(spec, params)
    res, lines = compiled(spec, pdl.key(params, True, "late"))
    joined = "\n".join(lines)
    assert len(re.findall(r"\bACQBULK\b", joined)) == 1
    assert len(re.findall(r"\bPREEXIT\b", joined)) == 1
    assert _first(lines, r"\bACQBULK\b") < _first(lines, ANY_GLOBAL)
    trigger = _first(lines, r"\bPREEXIT\b")
    last_gmma = max(i for i, x in enumerate(lines) if GMMA.search(x))
    assert last_gmma < trigger
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", "\n".join(lines[last_gmma:trigger]))
    assert any(re.search(r"\bUTMASTG\b", x) for x in lines[trigger:])
    assert _first(top_lines, r"\bACQBULK\b") < _first(top_lines, r"\bPREEXIT\b")
    assert _first(top_lines, r"\bPREEXIT\b") < _first(top_lines, GMMA)
    assert res["spill_bytes"] == top["spill_bytes"] == 0
    assert res["registers"] == top["registers"]
    assert res["sass"] == top["sass"]


def test_the_late_trigger_takes_a_pdl_build_of_the_tiled_or_stream_k_walk():
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90
    from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig

    cfg = GemmConfig(tile_m=64, tile_n=64, cluster_m=1)
    assert GemmSm90(cfg, trigger="late").late_trigger
    assert not GemmSm90(cfg).late_trigger
    with pytest.raises(ValueError, match="late trigger"):
        GemmSm90(cfg, masked=True, trigger="late")
    with pytest.raises(ValueError, match="late trigger"):
        GemmSm90(cfg, pdl=False, trigger="late")
    with pytest.raises(ValueError, match="trigger must be"):
        GemmSm90(cfg, trigger="exit")


# ---------------------------------------------------------------- scripts/pdl_wave_probe.py


def test_the_wave_probe_plan():
    """The probe's sweeps: the decode configs of 16x5120x8192 and FP8's 1x10240x5120, forced,
    over one wave of 40 to 132 CTAs; per config three builds (the standard key, pdl "off",
    pdl "late"): six compiles in all."""
    probe = load_script("pdl_wave_probe")
    dense, fp8 = probe.sweeps(132)
    assert dense["config"].tag() == "64x64_c1x2_s13_e4x32_w1m_a16"
    assert fp8["config"].tag() == "64x128_c1x2_s0_e4x32_w1m_a8"
    for s, tiles in ((dense, probe.DENSE_TILES), (fp8, probe.FP8_TILES)):
        assert [probe.ctas(s["config"], s["m"], n, 132) for n in s["n"]] == list(tiles)
        top, off, late = (s["keys"][f] for f in probe.FORMS)
        assert "pdl" not in dict(top) and s["spec"].standard_params().count(top) == 1
        assert off == pdl.key(top, False) and late == pdl.key(top, True, "late")
    assert (16, 8192, 2560, 8448) == (dense["m"], dense["k"], dense["n"][0], dense["n"][-1])


@pytest.mark.parametrize("which", [0, 1])
def test_the_wave_probe_checks_and_times_each_form(monkeypatch, which):
    """`measure` on the CPU, the launchers replaced by the references (each call recording the
    PDL state it ran under) and the timer by a stand-in: each form's call runs inside its own
    switch, its output is checked, and both methods time the three forms."""
    from forgekernel.bench import methods
    from forgekernel.kernels.gemm.dense.sm90 import launch as dense
    from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8
    from forgekernel.reference.gemm import gemm_fp8_ref, gemm_ref
    from forgekernel.runtime.timing import Samples

    states = []

    def dense_gemm(a, b, out, b_kn, config):
        states.append((pdl.forced(), config))
        out.copy_(gemm_ref(a, b))

    def fp8_gemm(a, b, sa, sb, out, config):
        states.append((pdl.forced(), config))
        out.copy_(gemm_fp8_ref(a, b, sa, sb))

    timed = []

    def time_method(method, fns, sets, **kw):
        timed.append((method, tuple(fns), len(sets)))
        for fn in fns.values():
            fn(*sets[0])
        return {f: Samples([0.02], method=method) for f in fns}

    monkeypatch.setattr(dense, "gemm", dense_gemm)
    monkeypatch.setattr(fp8, "gemm_fp8", fp8_gemm)
    monkeypatch.setattr(methods, "time_method", time_method)
    probe = load_script("pdl_wave_probe")
    s = {**probe.sweeps(132)[which], "k": 256}
    n = 7 * s["config"].tile_n
    row = probe.measure(s, n, 132, device="cpu")
    assert row["same"] and row["err"] < 1e-2 and row["ctas"] == 8  # 7 tiles: 4 clusters
    assert [m for m, _, _ in timed] == ["graph", "eager"]
    assert all(forms == probe.FORMS for _, forms, _ in timed)
    assert row["graph"] == {f: 20.0 for f in probe.FORMS}
    assert {c for _, c in states} == {s["config"]}
    assert [f for f, _ in states[:3]] == ["top", False, "late"]  # the check: top, off, late
    assert "20.0" in probe.line(row)


def _rows(times: dict) -> list[dict]:
    """Probe rows from {CTAs: (top, off, late) graph us}, eager all alike."""
    eager = dict.fromkeys(("top", "off", "late"), 30.0)
    return [
        {"ctas": c, "graph": dict(zip(("top", "off", "late"), t)), "eager": eager}
        for c, t in times.items()
    ]


@pytest.mark.parametrize(
    "times, rule",
    [
        ({64: (20, 21, 20.1), 80: (29, 22, 21.5), 128: (30, 31, 30)}, "1:"),
        ({64: (20, 21, 20.6), 80: (29, 22, 21.5), 128: (30, 31, 30)}, "2:"),
        ({64: (20, 21, 20.6), 80: (29, 22, 28.5), 128: (30, 31, 30)}, "3:"),
        ({64: (20, 21, 20.6), 80: (22, 22, 22), 128: (30, 31, 30)}, "4 "),
        ({64: (20, 21, 20.6), 80: (29, 22, 25), 128: (30, 31, 30)}, "none"),
    ],
)
def test_the_wave_probe_verdict(times, rule):
    """The probe's last lines name the NOTES' rule its graph times adopt."""
    probe = load_script("pdl_wave_probe")
    assert probe.verdict(_rows(times)).startswith(rule)


# ---------------------------------------------------------------- the convolutions' late trigger


def test_conv_plans_take_the_late_key_inside_late(monkeypatch):
    """The convolutions' launchers (forward `_choose`, fused data gradient `_choose_fused`,
    weight gradient `_wgrad_plan`): the late key inside `pdl.late()`, the standard key as it
    was outside; none of their standard or candidate builds is a late one."""
    from forgekernel.kernels.conv.sm90 import DGRAD_SPEC, WGRAD_SPEC
    from forgekernel.kernels.conv.sm90 import SPEC as CONV_SPEC
    from forgekernel.kernels.conv.sm90 import launch as conv
    from forgekernel.ops import conv as op

    monkeypatch.delenv("FORGEKERNEL_PDL", raising=False)
    monkeypatch.setattr(conv, "get_kernel", lambda spec, params: params)
    monkeypatch.setattr(conv, "num_sms", lambda index: 132)
    # the 98-CTA forward of 04:10 (n32-c256-14x14-k256-3x3), its fused data gradient's shape
    # at stride 2 and a resnet 1x1 weight gradient
    fwd = (torch.bfloat16, False, 32 * 14 * 14, 256, 256, 9, 0, None, False, (32, 1, 14, 14), True)
    g = op._geometry_of((2, 2), (1, 1), (1, 1), (1, 1), (3, 3))
    fused = conv.fused_dgrad(g, (1, 28, 28), (1, 14, 14))
    dgrad = (torch.bfloat16, (32, 1, 28, 28), 256, 256, fused, fused.walk, 0, None)
    wgrad = (torch.bfloat16, 512, 2048, 1, (8, 25), 0, None)
    plans = (
        lambda forced: conv._choose(*fwd, False, forced)[0],
        lambda forced: conv._choose_fused(*dgrad, forced)[0],
        lambda forced: conv._wgrad_plan(*wgrad, _pdl_forced=forced)[0],
    )
    for plan in plans:
        on = plan(None)
        with pdl.late():
            late = plan(pdl.forced())
        assert "pdl" not in dict(on) and late == pdl.key(on, True, "late")
    for spec in (CONV_SPEC, DGRAD_SPEC, WGRAD_SPEC):
        params = [*spec.standard_params(), *(spec.candidate_params() or [])]
        assert not any(dict(p).get("pdl") == "late" for p in params)


# the late builds the SASS test reads: one a kernel class and split form, the split's (~1.5 s
# a compile on CI's CPU; their top builds shared with the family's test). The trigger is one
# site a class (conv/sm90 kernel.py and dgrad_kernel.py: after the CTA's last unit's mainloop;
# wgrad.py: after its one mainloop), ahead of the `split` branch: the split builds, whose
# parked parts, flags and bulk reduce are stores the unsplit ones lack, prove the order for
# those too (the forward's im2col / rectangle / data-gradient mode and the weight gradient's
# im2col change the mainloop's loads, not where it ends): forward split with bias, fused data
# gradient split, weight gradient rectangles (their splits park at run time) and reduce; 4
# late compiles, not 9
CONV_LATE = ("conv_fwd_split_bias", "dgrad_split", "wgrad", "wgrad_reduce")
# a global store of any kind: the epilogues' TMA stores and st.global, the split's parked parts
# and flags (STG, ATOMG), the reduce split's bulk reduce (UBLKRED); as the instruction itself,
# optionally predicated (not the mbarrier arrives' SYNCS.ARRIVE.TRANS64.RED)
STORE = re.compile(r"^(@!?U?P\w+\s+)?(STG|UTMASTG|UBLKRED|RED|ATOMG|ATOM|ST)\b")


@pytest.mark.parametrize("name", slow_past(CONV_LATE))
def test_the_conv_late_trigger_follows_the_last_mainloop(compiled, name):
    """The convolutions' late builds: one ACQBULK, before the first global access; one PREEXIT
    (the consumers' one issue site: after the last unit's mainloop in the persistent forward
    and data gradient, after the one mainloop in the weight gradient), after the last WGMMA and
    its wait and before the first global store of any kind anywhere in the kernel (epilogue,
    parked part, flag, bulk reduce); the top build's registers, spills and SASS counts."""
    spec, params = GEMM_FAMILY[name]
    top, top_lines = compiled(spec, params)
    res, lines = compiled(spec, pdl.key(params, True, "late"))
    joined = "\n".join(lines)
    assert len(re.findall(r"\bACQBULK\b", joined)) == 1
    assert len(re.findall(r"\bPREEXIT\b", joined)) == 1
    assert _first(lines, r"\bACQBULK\b") < _first(lines, ANY_GLOBAL)
    trigger = _first(lines, r"\bPREEXIT\b")
    last_gmma = max(i for i, x in enumerate(lines) if GMMA.search(x))
    assert last_gmma < trigger < _first(lines, STORE)
    assert re.search(r"WARPGROUP\.DEPBAR\.LE gsb0, 0x0", "\n".join(lines[last_gmma:trigger]))
    assert _first(top_lines, r"\bACQBULK\b") < _first(top_lines, r"\bPREEXIT\b")
    assert _first(top_lines, r"\bPREEXIT\b") < _first(top_lines, GMMA)
    assert res["spill_bytes"] == top["spill_bytes"] == 0
    assert res["registers"] == top["registers"]
    assert res["sass"] == top["sass"]


def test_the_conv_late_trigger_takes_a_pdl_build():
    pytest.importorskip("cutlass")
    from forgekernel.kernels.conv.sm90.config import ConvConfig
    from forgekernel.kernels.conv.sm90.dgrad_kernel import ConvDgradSm90
    from forgekernel.kernels.conv.sm90.kernel import ConvFpropSm90
    from forgekernel.kernels.conv.sm90.wgrad import ConvWgradSm90
    from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig

    cfg = ConvConfig(tile_m=128, tile_n=128)
    assert ConvFpropSm90(cfg, trigger="late").late_trigger
    assert ConvDgradSm90(cfg, trigger="late").late_trigger
    assert not ConvFpropSm90(cfg).late_trigger and not ConvDgradSm90(cfg).late_trigger
    gemm = GemmConfig(tile_m=128, tile_n=128, cluster_m=1)
    assert ConvWgradSm90(gemm, 8, trigger="late").late_trigger
    assert not ConvWgradSm90(gemm, 8).late_trigger
    for make in (
        lambda t, on: ConvFpropSm90(cfg, pdl=on, trigger=t),
        lambda t, on: ConvDgradSm90(cfg, pdl=on, trigger=t),
        lambda t, on: ConvWgradSm90(gemm, 8, pdl=on, trigger=t),
    ):
        with pytest.raises(ValueError, match="late trigger"):
            make("late", False)
        with pytest.raises(ValueError, match="trigger must be"):
            make("exit", True)
