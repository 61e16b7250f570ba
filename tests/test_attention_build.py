"""The attention forward builds for sm_90a on a machine with no GPU in every standard
configuration, exports a loadable-shaped .so, and (when cuobjdump/nvdisasm are installed: the
`dev` extra) uses HGMMA and TMA with no local memory.

CI builds one configuration (or compared pair) of each build test: the bf16 D = 128 causal
default, with its FIXED_RULES rule; the standard 192/128 form; the first of each other list but
the candidates' (the L2 and 192/128 schedule candidates: all slow). The others are marked
`slow` (tests/sweeps.py) and run before landing a kernel change."""

import tempfile
from dataclasses import replace
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from dsl_toolchain import dsl_toolchain  # noqa: E402  (tests/ is on the path)
from sweeps import slow_past  # noqa: E402

from forgekernel.kernels.attention.fwd.sm90 import (  # noqa: E402
    D192_CANDIDATES,
    L2_CANDIDATES,
    PACK_CANDIDATES,
    PACK_CLASSES,
    SPEC,
    WG3_CANDIDATES,
    pack_groups,
)
from forgekernel.kernels.attention.fwd.sm90.config import (  # noqa: E402
    FIXED_RULES,
    HEAD_DIMS,
    SMEM_CAPACITY,
    AttnConfig,
    default_config,
    params_for,
    rule_config,
    rule_params,
    smem_bytes,
)
from forgekernel.runtime.cache import compile_to  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text  # noqa: E402

# tests/test_build_sm90.py builds every standard kernel; here the bf16 fixed-length ones (each
# head-dim pair's default, then each FIXED_RULES config) get the attention-specific SASS checks
# (TMA loads and store), keeping CI's compile time down: CI builds D = 128 causal (the default
# the D = 128 causal rule replaced: its pair in test_fixed_rules_build_as_their_default), the
# others are `slow`.
SAMPLE = [
    p
    for p in SPEC.standard_params()
    if dict(p)["dtype"] == "bfloat16" and not dict(p)["varlen"] and "view_group" not in dict(p)
]  # the GQA-packed standard keys: test_pack_candidates_build_as_the_standard (PACK_BUILDS)
SAMPLE_KEEP = params_for("bfloat16", 128, 128, True)


def _id(params) -> str:
    p = dict(params)
    knobs = "".join(f"-{k}{p[k]}" for k in ("dynamic", "wave_kv_mib") if k in p)
    return f"d{p['head_dim']}x{p['head_dim_v']}-{'causal' if p['causal'] else 'full'}{knobs}"


def test_standard_configs_cover_dtypes_head_dims_and_masks():
    keys = {
        (p["dtype"], p["head_dim"], p["head_dim_v"], p["causal"], p["varlen"])
        for p in map(dict, SPEC.standard_params())
    }
    assert len(keys) == 2 * len(HEAD_DIMS) * 2 * 2
    for d, dv in HEAD_DIMS:
        assert smem_bytes(default_config(d, dv), d, dv) <= SMEM_CAPACITY
    assert len(SAMPLE) == len(HEAD_DIMS) * 2 + len(FIXED_RULES) and SAMPLE_KEEP in SAMPLE


@pytest.mark.parametrize("params", slow_past(SAMPLE, keep=SAMPLE_KEEP), ids=_id)
def test_sampled_config_builds_with_hgmma_tma_and_no_local_memory(params, tmp_path):
    rec, _ = _build_with_sass(params, tmp_path)
    so = Path(rec["path"])
    assert so.is_file() and so.read_bytes()[:4] == b"\x7fELF"
    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    assert rec["hgmma"], rec["params"]
    assert rec["sass"].get("UTMALDG", 0) > 0 and rec["sass"].get("UTMASTG", 0) > 0
    assert rec["spill_bytes"] == 0, rec["params"]
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, rec["params"]


_BUILT: dict = {}


def _build_with_sass(params, out: Path) -> tuple[dict, str]:
    """One configuration built into `out`: its record with the cubin's resources, and its SASS;
    once a process (the L2 and 192/128 candidates' standard builds are SAMPLE's: three ~3 s
    compiles of CI's CPU fewer)."""
    if params not in _BUILT:
        with tempfile.TemporaryDirectory(prefix="forgekernel-cubin-") as keep:
            rec = compile_to(SPEC, params, out, keep_dir=Path(keep))
            cubin = rec.pop("cubin")
            rec.update(inspect_cubin(cubin))
            _BUILT[params] = rec, sass_text(cubin)
    rec, sass = _BUILT[params]
    return dict(rec), sass


# The paged mode (issue 18): the D 256 causal kernel is the one where a consumer-side detail
# once moved ptxas off the uniform datapath (every producer TMA in a per-lane loop, a spill).
PAGED_SAMPLE = [
    params_for("bfloat16", 256, 256, True, varlen=True, page_box=64),
    params_for("float16", 128, 128, True, varlen=True, page_box=16),
    params_for("bfloat16", 64, 64, False, varlen=True, page_box=8),
]


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize("params", slow_past(PAGED_SAMPLE), ids=lambda p: f"d{dict(p)['head_dim']}")
def test_paged_mode_builds_with_uniform_tma_issue_and_no_spills(tmp_path, params):
    rec, sass = _build_with_sass(params, tmp_path)
    assert rec["spill_bytes"] == 0 and rec["hgmma"], params
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, params
    assert rec["sass"]["UTMALDG"] > 0 and rec["sass"]["STS"] > 0, params  # boxes, clearing
    assert "BRA.U.ANY" not in sass, params  # no TMA issued in a per-lane loop


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize(("d", "box", "group"), slow_past([(128, 16, 4), (64, 8, 16)], unpack=True))
def test_packed_paged_mode_builds_as_the_split_one(tmp_path, d, box, group):
    """The packed compile (params packed with view_group G: no sequence skipped, a warpgroup
    with no row in its tile's sequence running `_idle_blocks` instead of the mainloop, q / o /
    lse through views of G query heads a kv head; docs/attention/PAGED_NOTES.md, "The whole
    chunked-prefill batch in one launch") against the split's: the same registers (cu13: 168
    at D 128, 128 at D 64), no local memory, the same TMA and HGMMA counts, Q's loads and O's
    stores 4-D boxes ((G, tile_m / G) rows of D), and the WGMMA pipeline as the split's (6
    WARPGROUP.ARRIVE, 7 DEPBAR: a WGMMA skipped by a branch inside the mainloop made ptxas
    serialize all 48). G 4 at D 128 (the bench's) and G 16 at D 64 (192-row tiles: boxes of
    12 tokens), the standard set's ends."""
    split = params_for("bfloat16", d, d, True, varlen=True, page_box=box)
    views = params_for("bfloat16", d, d, True, varlen=True, page_box=box, packed=True,
                       view_group=group)  # fmt: skip
    (rs, ss), (rv, sv) = _build_with_sass(split, tmp_path), _build_with_sass(views, tmp_path)
    assert rv["registers"] == rs["registers"] and rv["spill_bytes"] == 0 and rv["hgmma"]
    assert rv["sass"].get("LDL", 0) == 0 and rv["sass"].get("STL", 0) == 0
    for op in ("UTMALDG", "UTMASTG", "HGMMA", "STS"):
        assert rv["sass"].get(op) == rs["sass"].get(op), op
    assert sv.count("UTMALDG.3D") == 0 and sv.count("UTMASTG.4D") == rv["sass"]["UTMASTG"]
    assert "BRA.U.ANY" not in sv
    for op in ("WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR"):
        assert sv.count(op) == ss.count(op) < 8, op


# Variants off by default (docs/attention/NOTES.md, "D=256 and 192/128 after split_softmax"):
# D=256 is where an epilogue detail once took the whole kernel off the uniform datapath (a
# branch around the dropped o_direct's row stores: 72 R2UR a step, every producer TMA in a
# per-lane loop).
VARIANT_SAMPLE = [
    params_for("bfloat16", 256, 256, True, AttnConfig(tile_n=64, snake=True)),
]


# slow: the sample is a variant off by default (64-key tiles with the snake order: D=256's
# default takes 80-key tiles, `default_config`), no standard or candidate key (~1.7 s of an idle
# CPU, 2026-12-07)
@pytest.mark.slow
@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
def test_snake_builds_on_the_uniform_datapath(tmp_path):
    for params in VARIANT_SAMPLE:
        rec, sass = _build_with_sass(params, tmp_path)
        assert rec["spill_bytes"] == 0 and rec["hgmma"], params
        assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, params
        # 14 R2UR outside the loops here, as in the standard build (15); the branching one had 388.
        assert "BRA.U.ANY" not in sass and sass.count("R2UR") < 32, params


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
def test_dynamic_tiles_build_with_one_atomic_and_no_spills(tmp_path):
    """AttnConfig.dynamic (docs/attention/NOTES.md, "The chunked varlen case at 0.765x"): the
    D = 128 varlen causal default keeps 168 registers and no local memory, takes its tiles
    with one global atomic, and hands them over through shared memory."""
    params = params_for("bfloat16", 128, 128, True, varlen=True)
    rec, sass = _build_with_sass(params, tmp_path)
    assert dict(params)["dynamic"] and rec["spill_bytes"] == 0 and rec["hgmma"]
    assert rec["registers"] == 168
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0
    assert sass.count("ATOMG.E.ADD") == 1 and rec["sass"]["STS"] > 0 and rec["sass"]["LDS"] > 0
    # no per-lane loop in what runs (cu13's ptxas); cu12's (CI's plain install) emits one here
    if dsl_toolchain() == "cu13":
        assert "BRA.U.ANY" not in sass


def test_dynamic_is_a_key_only_when_on():
    """The standard keys (and cache entries) are those of before the knob but D = 128 varlen's
    (the tile counter its default since 2026-12-04) and the fixed-length rules' that take the
    counter (2026-12-05: 192/128, D = 256 and D = 128 causal); paged refuses it."""
    dyn = AttnConfig(dynamic=True)
    on = [dict(p) for p in SPEC.standard_params() if "dynamic" in dict(p)]
    assert all(p["dynamic"] and not p["page_box"] for p in on)
    varlen = [p for p in on if p["varlen"]]
    assert {(p["head_dim"], p["head_dim_v"]) for p in varlen} == {(128, 128)}
    assert len(varlen) == 4  # both dtypes, both masks
    fixed = [p for p in on if not p["varlen"]]
    assert {(p["head_dim"], p["head_dim_v"], p["causal"]) for p in fixed} == {
        (192, 128, True), (256, 256, True), (128, 128, True)}  # fmt: skip
    assert len(fixed) == 6 and all(p["wave_kv_mib"] == 0 for p in fixed)
    assert default_config(128, 128, varlen=True) == dyn
    assert not default_config(128, 128, paged=True, varlen=True).dynamic
    assert not any(default_config(d, dv, varlen=True).dynamic for d, dv in HEAD_DIMS
                   if (d, dv) != (128, 128))  # fmt: skip
    # the static deal it replaced: the bench's `static` variant
    (static,) = [dict(p) for p in SPEC.candidate_params() if dict(p)["varlen"]]
    assert static["varlen"] and "dynamic" not in static
    key = dict(params_for("bfloat16", 128, 128, True, dyn, varlen=True))
    assert key["dynamic"] and AttnConfig.from_params(key) == dyn
    std = dict(params_for("bfloat16", 128, 128, True))
    assert AttnConfig.from_params(std) == default_config(128, 128) and dyn.tag().endswith("_dyn")
    with pytest.raises(ValueError, match="paged"):
        params_for("bfloat16", 128, 128, True, dyn, varlen=True, page_box=16)


def test_d192_schedule_candidates_are_keys_only_when_on():
    """k_ahead (docs/attention/NOTES.md, "192/128 against FA4's schedule") is in no standard
    key (its default), wave_kv_mib only in the fixed-length rules' (FIXED_RULES); both are in
    the open 192/128 candidate keys (bf16 causal, fixed length, with the tile counter) as set
    and round-trip through the key; paged refuses k_ahead. D = 128 has a causal wave_kv_mib 0
    candidate (the GQA-4 causal control); its non-causal one is rule 8's standard key."""
    rules = {rule_params(dtype, i) for dtype in ("bfloat16", "float16")
             for i in range(1, len(FIXED_RULES) + 1)}  # fmt: skip
    for p in SPEC.standard_params():
        assert "k_ahead" not in dict(p)
        assert ("wave_kv_mib" in dict(p)) == (p in rules), p

    def knobs_of(p: dict) -> dict:
        set_ = {k: p[k] for k in ("k_ahead", "dynamic", "wave_kv_mib") if k in p}
        default_mib = default_config(p["head_dim"], p["head_dim_v"]).l2_kv_mib
        return set_ | ({"l2_kv_mib": p["l2_kv_mib"]} if p["l2_kv_mib"] != default_mib else {})

    d192 = [dict(p) for p in SPEC.candidate_params() if dict(p)["head_dim"] == 192]
    assert [knobs_of(p) for p in d192] == list(D192_CANDIDATES)
    assert len(d192) == 2
    assert not any("o_direct" in dict(p) for p in SPEC.candidate_params())  # dropped 2026-12-05
    wave0 = [dict(p) for p in SPEC.candidate_params() if "wave_kv_mib" in dict(p)
             and dict(p)["head_dim"] == 128 and "dynamic" not in dict(p)
             and dict(p)["l2_kv_mib"] == 24]  # fmt: skip
    assert [p["causal"] for p in wave0] == [True]
    assert all(knobs_of(p) == {"wave_kv_mib": 0} and not p["varlen"] for p in wave0)
    wave0_full = params_for("bfloat16", 128, 128, False, replace(default_config(128, 128),
                                                                 wave_kv_mib=0))  # fmt: skip
    assert wave0_full == rule_params("bfloat16", 8) and wave0_full in rules
    base = default_config(192, 128)
    for p in d192:
        assert p["dtype"] == "bfloat16" and p["causal"] and not p["varlen"]
        cfg = AttnConfig.from_params(p)
        assert cfg == replace(base, **knobs_of(p))
        assert dict(params_for("bfloat16", 192, 128, True, cfg)) == p
    assert replace(base, k_ahead=True, wave_kv_mib=0).tag() == base.tag() + "_kahead_wave0"
    with pytest.raises(ValueError, match="k_ahead"):
        params_for("bfloat16", 128, 128, True, AttnConfig(k_ahead=True), varlen=True, page_box=16)


def test_l2_candidates_are_keys_only_when_on():
    """The L2 candidates still open (L2_CANDIDATES: D = 64 causal in sections, alone and with
    the tile counter; docs/attention/NOTES.md, "192/128 and the L2 rules adopted"; D = 128
    non-causal in 12 MiB sections dropped with rule 8): bf16 fixed-length keys of the head
    dim's default config with exactly those knobs set, none a standard key."""
    standard = set(SPEC.standard_params())
    cands = [dict(p) for p in SPEC.candidate_params()]
    for d, causal, knobs in L2_CANDIDATES:
        cfg = replace(default_config(d, d), **knobs)
        key = params_for("bfloat16", d, d, causal, cfg)
        assert key not in standard and dict(key) in cands, (d, causal, knobs)
        assert dict(key)["wave_kv_mib"] == 0 and not dict(key)["varlen"]
        assert dict(key).get("dynamic", False) == knobs.get("dynamic", False)
        assert dict(key)["l2_kv_mib"] == knobs.get("l2_kv_mib", default_config(d, d).l2_kv_mib)
        assert AttnConfig.from_params(dict(key)) == cfg
    assert len(L2_CANDIDATES) == 2
    assert len(cands) == len({tuple(sorted(p.items())) for p in cands})  # no key twice
    assert not any(p["head_dim"] == 128 and p["l2_kv_mib"] == 12 for p in cands)  # wave0_sec12


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize(
    "candidate",
    [pytest.param(c, marks=pytest.mark.slow) for c in L2_CANDIDATES],
    ids=lambda c: "-".join((f"d{c[0]}", str(c[1]), *c[2])),
)  # candidate forms: all slow (3-5 s of CI's CPU, 2026-12-06)
def test_l2_candidates_build_as_the_standard(tmp_path, candidate):
    """Sections at every size change one compare's constant; the counter adds one atomic and
    the tile ring (as at D = 128 varlen): each L2 candidate keeps its standard build's
    registers, no local memory, and its WGMMA / MUFU counts."""
    d, causal, knobs = candidate
    std_rec, std = _build_with_sass(params_for("bfloat16", d, d, causal), tmp_path)
    cfg = replace(default_config(d, d), **knobs)
    rec, sass = _build_with_sass(params_for("bfloat16", d, d, causal, cfg), tmp_path)
    assert rec["registers"] == std_rec["registers"] and rec["spill_bytes"] == 0, (d, knobs)
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, (d, knobs)
    for op in ("HGMMA", "MUFU.EX2"):
        assert sass.count(op) == std.count(op), (d, causal, knobs, op)
    assert sass.count("ATOMG.E.ADD") == (1 if knobs.get("dynamic") else 0), (d, knobs)


def test_fixed_rules_are_standard_builds_of_their_head_dims_default():
    """Each FIXED_RULES config (docs/attention/NOTES.md, "192/128 and the L2 rules adopted",
    "Rule 8: D = 128 non-causal MHA in sections") is its head dims' default with the rule's
    knobs (sections at every size; the tile counter where the rule takes it), a standard key
    in both dtypes for its mask only (fixed length), no other's key and no candidate, and the
    default it replaced (the bench's `was`) stays standard."""
    standard = set(SPEC.standard_params())
    for i, rule in enumerate(FIXED_RULES, 1):
        d, dv = rule.head_dims
        cfg = rule_config(d, dv, i)
        assert cfg == replace(default_config(d, dv), **dict(rule.knobs)) != default_config(d, dv)
        assert cfg.wave_kv_mib == 0 and dict(rule.knobs).keys() <= {"dynamic", "wave_kv_mib"}
        for dtype in ("bfloat16", "float16"):
            key = rule_params(dtype, i)
            assert key in standard and AttnConfig.from_params(dict(key)) == cfg
            assert dict(key)["causal"] == rule.causal and not dict(key)["varlen"]
            assert params_for(dtype, d, dv, rule.causal) in standard  # `was`
    assert rule_config(128, 128, 0) == default_config(128, 128)
    assert len(standard) == len(SPEC.standard_params())  # no rule's key twice
    assert not standard & set(SPEC.candidate_params())


# CI compares the D = 128 causal rule's build with SAMPLE_KEEP (its default, built once)
RULE_KEEP = next(
    i for i, r in enumerate(FIXED_RULES, 1) if (*r.head_dims, r.causal) == (128, 128, True)
)


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize("i", slow_past(range(1, len(FIXED_RULES) + 1), keep=RULE_KEEP))
def test_fixed_rules_build_as_their_default(tmp_path, i):
    """Sections at every size change one compare's constant, the counter adds one atomic and
    the tile ring: each rule's build (CPU, 2026-12-05) keeps its default's registers, no local
    memory, and its HGMMA and TMA counts."""
    rule = FIXED_RULES[i - 1]
    d, dv = rule.head_dims
    rec = _build_with_sass(rule_params("bfloat16", i), tmp_path)[0]
    std = _build_with_sass(params_for("bfloat16", d, dv, rule.causal), tmp_path)[0]
    assert rec["registers"] == std["registers"] and rec["spill_bytes"] == 0, rule
    for op in ("HGMMA", "UTMALDG", "UTMASTG", "LDL", "STL"):
        assert rec["sass"].get(op, 0) == std["sass"].get(op, 0), (rule, op)


D192_BUILDS = [p for p in SPEC.candidate_params() if dict(p)["head_dim"] == 192]


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
def test_d192_standard_builds_on_the_uniform_datapath(tmp_path):
    """The standard 192/128 build (CI's only compile of the form; the candidates below compare
    with it): 168 registers, no local memory, no TMA issued in a per-lane loop."""
    rec, sass = _build_with_sass(params_for("bfloat16", 192, 128, True), tmp_path)
    assert rec["spill_bytes"] == 0 and rec["hgmma"]
    if dsl_toolchain() == "cu13":  # (what the GPU host builds with)
        assert rec["registers"] == 168
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0
    assert "BRA.U.ANY" not in sass


# Candidate forms' compile checks: all slow (the first's ~3 s of CI's CPU, idle machine,
# 2026-12-06); the standard 192/128 build they compare with stays in CI (the test above)
@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.slow
@pytest.mark.parametrize(
    "params",
    D192_BUILDS,
    ids=lambda p: "-".join(k for k in ("k_ahead", "dynamic", "wave_kv_mib") if k in dict(p)),
)
def test_d192_schedule_candidates_build_as_the_standard(tmp_path, params):
    """The candidates change the producer's load order (k_ahead: K of the next block before V
    of the current, one more TMA issue site), the deal (the tile counter) and the section
    size, not the mainloop: 168 registers, no local memory, and the WGMMA, MUFU and wait
    counts of the standard 192/128 build (CPU 2026-12-05: unmasked step 503 instructions in
    each)."""
    std_rec, std = _build_with_sass(params_for("bfloat16", 192, 128, True), tmp_path)
    rec, sass = _build_with_sass(params, tmp_path)
    assert rec["registers"] == std_rec["registers"] and rec["spill_bytes"] == 0, params
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, params
    for op in ("HGMMA", "MUFU.EX2", "WARPGROUP.ARRIVE", "WARPGROUP.DEPBAR", "F2FP"):
        assert sass.count(op) == std.count(op), (params, op)
    assert "BRA.U.ANY" not in sass, params
    if dict(params).get("k_ahead"):
        assert rec["sass"]["UTMALDG"] > std_rec["sass"]["UTMALDG"], params


def test_wg3_candidates_are_keys_only_when_on():
    """D = 96 on 192-row tiles (WG3_CANDIDATES, docs/attention/NOTES.md "next/attn-fwd-gap
    (2026-12-07)"): bf16 fixed-length candidate keys of D = 96's default with the tile, stages
    and section knobs set, none standard; the standard D = 96 keys keep 128-row tiles, and each
    fits shared memory."""
    standard = set(SPEC.standard_params())
    cands = set(SPEC.candidate_params())
    for d, causal, knobs in WG3_CANDIDATES:
        cfg = replace(default_config(d, d), **knobs)
        key = params_for("bfloat16", d, d, causal, cfg)
        assert key in cands and key not in standard, knobs
        assert cfg.tile_m == 192 and smem_bytes(cfg, d, d) <= SMEM_CAPACITY, knobs
        assert AttnConfig.from_params(dict(key)) == cfg
    assert all(dict(p)["tile_m"] == 128 for p in standard if dict(p)["head_dim"] == 96)
    assert len(cands) == len(set(cands))


# Built 2026-12-07 (CPU, cu13): 128 registers at entry (setmaxnreg 160 a consumer thread, D =
# 64's 192-row build the same), no spill; the 128-key 192-row D = 96 tile spills 96 bytes (30
# LDL, 48 STL), hence 112 / 96 keys. HGMMA sites: 39 at 112 keys (2 or 3 stages), 36 at 96;
# MUFU.EX2 174 / 150.
@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.slow
@pytest.mark.parametrize(
    "candidate",
    WG3_CANDIDATES,
    ids=lambda c: f"{'causal' if c[1] else 'full'}-" + "-".join(f"{k}{v}" for k, v in c[2].items()),
)
def test_wg3_candidates_build_without_spills(tmp_path, candidate):
    """Three consumer warpgroups at D = 96: D = 64's standard 192-row build's registers, no
    local memory, the warpgroups' GEMMs (HGMMA) and TMA loads and store present, and the same
    HGMMA / MUFU counts in sections (`wave_kv_mib` 0 moves only the tile order)."""
    d, causal, knobs = candidate
    d64 = _build_with_sass(params_for("bfloat16", 64, 64, causal), tmp_path)[0]
    cfg = replace(default_config(d, d), **knobs)
    rec, sass = _build_with_sass(params_for("bfloat16", d, d, causal, cfg), tmp_path)
    assert rec["registers"] == d64["registers"] and rec["spill_bytes"] == 0, knobs
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, knobs
    assert rec["hgmma"] and rec["sass"].get("UTMALDG", 0) and rec["sass"].get("UTMASTG", 0)
    assert "BRA.U.ANY" not in sass, knobs
    if "wave_kv_mib" in knobs:
        plain = {k: v for k, v in knobs.items() if k != "wave_kv_mib"}
        base = replace(default_config(d, d), **plain)
        std = _build_with_sass(params_for("bfloat16", d, d, causal, base), tmp_path)[1]
        for op in ("HGMMA", "MUFU.EX2"):
            assert sass.count(op) == std.count(op), (knobs, op)


def test_unsupported_head_dims_are_refused():
    with pytest.raises(ValueError, match="head dims"):
        default_config(80, 80)


def test_pack_candidates_are_keys_only_when_on():
    """GQA packed in the fixed-length mode (docs/attention/NOTES.md "next/attn-gqa-pack
    (2026-12-07)", "next/gqa-pack-d64"): PACK_CANDIDATES are bf16 candidate keys of the head
    dim's default with view_group G, none standard; the fixed-length standard keys carry a
    view_group only in PACK_CLASSES (D = 64, both masks), each G of `pack_groups` (2 / 4 / 8 /
    16 under D = 64's 192-row tiles), both dtypes, the default's key plus view_group; a
    view_group needs fixed length or the packed paged form, and G dividing tile_m."""
    standard = set(SPEC.standard_params())
    cands = set(SPEC.candidate_params())
    for d, causal, g in PACK_CANDIDATES:
        key = params_for("bfloat16", d, d, causal, view_group=g)
        assert key in cands and key not in standard
        assert dict(key) == {**dict(params_for("bfloat16", d, d, causal)), "view_group": g}
    assert pack_groups(64, True) == pack_groups(64, False) == (2, 4, 8, 16)
    assert pack_groups(128, True) == pack_groups(128, False) == pack_groups(96, True) == ()
    fixed = {p for p in standard if "view_group" in dict(p) and not dict(p)["varlen"]}
    want = {
        params_for(dtype, d, d, causal, view_group=g)
        for dtype in ("bfloat16", "float16")
        for d, causal in PACK_CLASSES
        for g in pack_groups(d, causal)
    }
    assert fixed == want and len(want) == 16
    with pytest.raises(ValueError, match="view_group"):
        params_for("bfloat16", 128, 128, True, varlen=True, view_group=4)  # varlen, not paged
    with pytest.raises(ValueError, match="view_group"):
        params_for("bfloat16", 128, 128, True, view_group=3)  # 128-row tiles


def _pack_id(c) -> str:
    return f"d{c[0]}-{'causal' if c[1] else 'full'}-g{c[2]}"


# the G = 4 packed builds of PACK_CLASSES (standard) and the candidates
PACK_BUILDS = [(d, causal, 4) for d, causal in PACK_CLASSES]
PACK_BUILDS += list(PACK_CANDIDATES)


# Built 2026-12-07 (CPU, cu13): each the registers of its standard build, no spill, the same
# HGMMA / MUFU.EX2 counts (D = 64: 36 / 198; D = 128: 48 / 198); Q's loads and O's store 5-D
# boxes ((G, tile_m / G) rows, D, Hkv, B); 5687 -> 5895 SASS lines at D = 64 causal (the
# packed rows' coordinates). Standard keys unchanged: every bf16 fixed-length and varlen
# standard key and the 64-row-box paged ones byte-identical SASS before / after (the notes).
@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize("candidate", slow_past(PACK_BUILDS), ids=_pack_id)
def test_pack_candidates_build_as_the_standard(tmp_path, candidate):
    """The GQA-packed fixed-length build against its head dim's standard one: the same
    registers, no local memory, the same GEMMs and exponentials (only the views of q / o /
    lse move), Q loaded and O stored through 5-D TMA boxes, TMA issued uniformly."""
    d, causal, g = candidate
    std_rec, std = _build_with_sass(params_for("bfloat16", d, d, causal), tmp_path)
    rec, sass = _build_with_sass(params_for("bfloat16", d, d, causal, view_group=g), tmp_path)
    assert rec["registers"] == std_rec["registers"] and rec["spill_bytes"] == 0, candidate
    assert rec["sass"].get("LDL", 0) == 0 and rec["sass"].get("STL", 0) == 0, candidate
    for op in ("HGMMA", "MUFU.EX2"):
        assert sass.count(op) == std.count(op), (candidate, op)
    assert sass.count("UTMALDG.5D") > 0 and sass.count("UTMASTG.5D") == rec["sass"]["UTMASTG"]
    assert std.count("UTMALDG.5D") == 0
    assert "BRA.U.ANY" not in sass, candidate
