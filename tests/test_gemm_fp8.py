"""forgekernel.gemm_fp8 on the CPU: argument errors, the configuration per M, the launcher's
arguments (a stand-in kernel computing the reference), the suite's quantized inputs against
their fp32 source, and the custom op's fake implementation."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch

from forgekernel.bench.suites import gemm_fp8 as suite_module
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig, stream_plan
from forgekernel.kernels.gemm.dense.sm90.tile import ring_stages, straddles
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_sm90
from forgekernel.kernels.gemm.fp8.sm90.config import (
    DECODE,
    LARGE,
    LARGE_MCAST_A,
    MID,
    NARROW_WIDTHS,
    SKINNY,
    STANDARD_CONFIGS,
    STREAM,
    STREAM_DECODE,
    STREAM_MIN_K,
    busy_ctas,
    choose_config,
    params_for,
    tiled_config,
    wide_config,
)
from forgekernel.reference.gemm import gemm_fp8_ref

F8 = torch.float8_e4m3fn
op_module = importlib.import_module("forgekernel.ops.gemm_fp8")  # the module, not the function


def _operands(m, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    case = suite_module._case(m, n, k)
    inputs = suite_module.make_inputs(case, torch.bfloat16, torch.device("cpu"), gen)
    return inputs["a"], inputs["b"], inputs["sa"], inputs["sb"]


@pytest.mark.parametrize(
    ("m", "want"),
    [(1, DECODE[0]), (8, DECODE[0]), (9, DECODE[1]), (32, DECODE[2]), (33, SKINNY),
     (64, SKINNY), (65, MID), (128, MID), (129, LARGE)],
)  # fmt: skip
def test_config_by_m(m, want):
    assert tiled_config(m) == want
    # tiles enough for every SM: the tiled configuration of M
    assert choose_config(m, 36864, 2048) == want
    assert want.fits(m)


@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [(1, 7168, 16384, STREAM_DECODE[0]), (16, 7168, 2048, STREAM_DECODE[1]),
     (64, 4096, 7168, STREAM_DECODE[3]), (128, 1536, 7168, STREAM), (512, 576, 7168, STREAM),
     (1, 10240, 5120, DECODE[0]), (128, 7168, 16384, MID), (33, 1001, 512, SKINNY),
     (200, 7168, 128, LARGE)],
)  # fmt: skip
def test_stream_k_where_the_tiles_leave_most_sms_idle(m, n, k, want):
    """The 128-column plan (`wide_config`: the chooser before narrow, the bench's `was`):
    stream K when the tiled configuration keeps at most half of the 132 SMs busy and the
    plan spreads the k-tiles over at least twice as many; not for short K (33x1001x512: 8 tiles
    of 4 k-tiles) nor for tiles that fill more than half the chip (1x10240x5120: 80)."""
    cfg = wide_config(m, n, k)
    assert cfg == want and cfg.fits(m)
    if cfg.stream_k:
        busy = busy_ctas(tiled_config(m), m, n)
        per, ctas, _ = stream_plan(cfg, m, n, k, 132, STREAM_MIN_K)
        assert 2 * busy <= 132 and ctas >= 2 * busy and per >= STREAM_MIN_K


def test_standard_kernels_cover_both_outputs():
    params = [dict(p) for p in SPEC.standard_params()]
    assert {p["out"] for p in params} == {"bfloat16", "float16"}
    # three tile_n / 2 fp32 fragments per thread (the two alternating ones and the accumulator):
    # 128 columns, or a narrow full-K tile's (64 rows, tiled, no cluster)
    assert all(p["tile_k"] == 128 for p in params)
    narrow = [p for p in params if p["tile_n"] != 128]
    assert {p["tile_n"] for p in narrow} == set(NARROW_WIDTHS)
    assert all(p["tile_m"] == 64 and not p["stream_k"] and p["cluster_n"] == 1 for p in narrow)
    assert all(not p["stream_k"] or p["cluster_m"] * p["cluster_n"] == 1 for p in params)


def test_quantized_inputs_follow_their_source():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(130, 256, generator=gen)
    q, s = suite_module._quantize(x, 128)
    assert q.dtype == F8 and s.shape == (2, 2)
    back = q.float() * s.repeat_interleave(128, 0)[:130].repeat_interleave(128, 1)
    assert float((back - x).abs().max()) <= 0.07 * float(x.abs().max())  # e4m3: 3 bits
    assert float(q.float().abs().max()) <= 448


@pytest.mark.parametrize(
    ("kwargs", "err", "match"),
    [
        ({"a": torch.zeros(4, 256)}, TypeError, "a must have dtype"),
        ({"b": torch.zeros(8, 128, dtype=F8)}, ValueError, "K mismatch"),
        ({"k": 200}, ValueError, "multiple of 128"),
        ({"sa": torch.zeros(4, 1)}, ValueError, "scale_a must have shape"),
        ({"sb": torch.zeros(1, 2, dtype=torch.float64)}, TypeError, "scale_b must have dtype"),
        ({"out_dtype": torch.float32}, TypeError, "out_dtype"),
        ({"out": torch.zeros(4, 9, dtype=torch.bfloat16)}, ValueError, "out must have shape"),
    ],
)
def test_bad_arguments_name_the_argument(kwargs, err, match):
    k = kwargs.pop("k", 256)
    args = {
        "a": torch.zeros(4, k, dtype=F8),
        "b": torch.zeros(8, k, dtype=F8),
        "sa": torch.ones(4, k // 128),
        "sb": torch.ones(1, k // 128),
        **kwargs,
    }
    with pytest.raises(err, match=match):
        op_module.gemm_fp8(
            args["a"], args["b"], args["sa"], args["sb"],
            out_dtype=kwargs.get("out_dtype", torch.bfloat16), out=kwargs.get("out"),
        )  # fmt: skip


@pytest.mark.parametrize(
    ("m", "n", "k"), [(1, 128, 128), (33, 1001, 256), (130, 300, 384), (3, 250, 4096),
                      (129, 264, 7168)],
)  # fmt: skip
def test_launcher_arguments(monkeypatch, m, n, k):
    """The stand-in kernel insists on what the compiled one assumes: TMA-ready operands, an
    output whose N is a multiple of 8, the scales as given, and the stream-K workspace where
    the configuration streams (fp32 partials for every CTA's two slots, zeroed tile flags, the
    plan's k-tiles per CTA), none otherwise."""
    calls = []

    def get_kernel(spec, params):
        cfg = GemmConfig.from_params(dict(params))

        def fn(a, b, c, work, flags, per, sa, sb, group, clusters):
            if cfg.stream_k:
                want_per, ctas, tiles = stream_plan(cfg, m, c.shape[1], k, 132, STREAM_MIN_K)
                assert per == want_per and clusters == 132
                floats = 2 * ctas * cfg.tile_m * cfg.tile_n  # two slots per CTA
                assert work.dtype == torch.float32 and work.numel() >= floats
                assert flags.dtype == torch.int32 and flags.numel() >= tiles
                assert not flags.any()
            else:
                assert work is None and flags is None and per == 0
            assert c.shape[1] % 8 == 0 and a.is_contiguous() and b.is_contiguous()
            c[:, : b.shape[0]].copy_(gemm_fp8_ref(a, b, sa, sb).to(c.dtype))
            calls.append((cfg, clusters))

        return fn

    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "_plans", type(fp8_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)
    a, b, sa, sb = _operands(m, n, k)
    c = op_module.gemm_fp8(a, b, sa, sb)
    want = gemm_fp8_ref(a, b, sa, sb).to(torch.bfloat16)
    assert c.shape == (m, n) and torch.equal(c, want)
    cfg, clusters = calls[-1]
    assert cfg == choose_config(m, n, k) and clusters == 132 // (cfg.cluster_m * cfg.cluster_n)


def test_forced_config_must_fit(monkeypatch):
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)
    with pytest.raises(ValueError, match="rows of A"):
        fp8_sm90._choose(torch.bfloat16, 9, 128, 256, None, DECODE[0])


def test_custom_op_fake_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        a = torch.empty(5, 256, dtype=F8)
        b = torch.empty(300, 256, dtype=F8)
        c = torch.ops.forgekernel.gemm_fp8(
            a, b, torch.empty(5, 2), torch.empty(3, 2), torch.float16
        )
        assert c.shape == (5, 300) and c.dtype == torch.float16


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(1, 7168, 16384), (16, 7168, 2048), (64, 4096, 7168), (128, 1536, 7168), (512, 576, 7168),
     (129, 264, 7168), (300, 2048, 16384), (3, 256, 4096), (150, 256, 3072), (1, 576, 7168)],
)  # fmt: skip
def test_fp8_stream_k_walk(m, n, k):
    """The FP8 stream-K plans the chooser makes (128 of K per k-tile, parts of at least
    STREAM_MIN_K k-tiles): the kernel's walk (mirrored in test_gemm_stream_k) covers every
    k-tile of every tile once; each unit's k-tiles [k0, k0 + count) are what its scaled
    mainloop promotes (tests/test_gemm_fp8_mainloop.py runs mid-K units). The 128-column plans
    (`wide_config`): the chooser's where narrow is not taken (129x264x7168, 3x256x4096,
    150x256x3072, 1x576x7168: too few narrow tiles), the bench's `was` on the suite's cases."""
    from test_gemm_stream_k import check_walk

    cfg = wide_config(m, n, k)
    assert cfg.stream_k
    check_walk(cfg, m, n, k, 132, STREAM_MIN_K)


def test_fp8_tiles_are_at_most_128_columns():
    """The 128x256 two-halves tile ran 2-5% behind 128x128 on every prefill shape of the H200
    run of 2026-12-02 07:00 and its mainloop was removed (docs/gemm/NOTES.md): no standard,
    grouped, masked or chosen FP8 configuration is wider than one block of B's scales, and a
    forced 256-column one is refused while tracing, not compiled."""
    from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8

    for params in map(dict, [*SPEC.standard_params(), *MASKED_SPEC.standard_params()]):
        assert params["tile_n"] <= 128
    for m, n, k in [(8192, 8192, 8192), (4096, 36864, 7168), (16384, 7168, 18432),
                    (512, 51200, 5120), (4096, 7168, 2048), (1000, 3000, 4096)]:  # fmt: skip
        assert choose_config(m, n, k) == tiled_config(m)
    wide = GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=2)
    pytest.importorskip("cutlass")
    with pytest.raises(ValueError, match="tile_n <= 128"):
        compile_gemm_fp8(dict(params_for("bfloat16", wide)))


def test_sanitize_cases_refill_the_ring_with_and_without_a_cluster():
    """racecheck judges a stage's release (the consumers' arrivals, kernel.py `_retire`) only
    where a CTA refills a stage: among the sanitize cases, one whose CTAs run more k-tiles than
    their ring holds for stream K without a cluster, the 128-row tile over a 2x1 cluster, the
    decode box over a 1x2 one and a narrow tile over two blocks of B's scales (its ring's two
    products a row and stage); and the sanitize cases take every kind of configuration the
    chooser picks: narrow (A's 8 / 16 / 32-row box, the whole 64; straddling and not), decode
    a8, skinny, mid, large, the A-multicast tile (its scale warp four ahead over a refilled
    ring since 2026-12-07), stream K."""
    refilled, picked = set(), set()
    for case in suite_module.SANITIZE_CASES:
        m, n, k = (case.params[x] for x in "mnk")
        cfg = choose_config(m, -(-n // 8) * 8, k)
        picked.add(cfg if cfg.tile_n == 128 else ("narrow", cfg.a_rows, straddles(cfg.tile_n)))
        stages = ring_stages(cfg, 1, 2, cfg.tile_m * 4 * (1 + straddles(cfg.tile_n)))
        per_cta = stream_plan(cfg, m, n, k, 132, STREAM_MIN_K)[0] if cfg.stream_k else k // 128
        if per_cta > stages:
            refilled.add((cfg.tile_m, cfg.tile_n, cfg.cluster_m, cfg.cluster_n, cfg.stream_k))
    rings = {(128, 128, 1, 1, True), (128, 128, 2, 1, False), (64, 128, 1, 2, False)}
    assert rings | {(128, 128, 1, 2, False)} <= refilled
    assert any(t[:2] == (64, 96) for t in refilled)
    narrow = {("narrow", r, False) for r in (8, 16, 32, 0)} | {("narrow", r, True) for r in (0, 8)}
    assert narrow | {DECODE[0], SKINNY, MID, LARGE, LARGE_MCAST_A, STREAM} <= picked


# ---------------------------------------------------------------- A's scales M-major


@pytest.mark.parametrize(("m", "kb"), [(1, 1), (5, 3), (128, 2), (300, 7), (301, 56)])
def test_mn_major_copy_and_what_is_taken_as_is(m, kb):
    """`scale_mn_major` kernels read A's scales in 4-row vectors from an (M, K/128) view with
    unit stride along M and a K/128 stride of a multiple of 4 (16-byte columns), M rounded up
    to 4 readable in each: the launcher's copy is that (values equal, padding rows past M),
    DeepGEMM's TMA-aligned layout is passed as is, anything else is copied."""
    sa = torch.rand(m, kb, generator=torch.Generator().manual_seed(m))
    m4 = -(-m // 4) * 4
    assert not fp8_sm90.takes_mn_major(sa) or m == 1 == kb  # K-major
    mn = fp8_sm90.mn_major_copy(sa)
    assert mn.shape == (m, kb) and mn.stride() == (1, m4) and torch.equal(mn, sa)
    assert fp8_sm90.takes_mn_major(mn)
    assert fp8_sm90.mn_major_scales(mn) is mn  # as is: DeepGEMM's layout
    # else a copy into the stream's scratch, equal, M-major
    copied = fp8_sm90.mn_major_scales(sa.t().contiguous().t() if kb > 1 else sa * 1)
    assert torch.equal(copied, sa) and fp8_sm90.takes_mn_major(copied)
    if kb > 1:
        # a K/128 stride that is no multiple of 4, or less than M rounded up to 4
        odd = torch.empty(kb, m4 + 1).t()[:m]
        assert not fp8_sm90.takes_mn_major(odd) or (m4 + 1) % 4 == 0
        if m4 > 4:  # columns overlapping: 4 floats short of M rounded up
            overlapping = torch.empty(kb * m4).as_strided((m, kb), (1, m4 - 4))
            assert not fp8_sm90.takes_mn_major(overlapping)
        # the last column's padding rows past the storage
        short = torch.empty((kb - 1) * m4 + m).as_strided((m, kb), (1, m4))
        assert fp8_sm90.takes_mn_major(short) == (m == m4)
    # a base off 16 bytes
    flat = torch.empty(kb * m4 + 1)
    assert not fp8_sm90.takes_mn_major(flat[1:].as_strided((m, kb), (1, m4)))


def test_mn_major_compile_key_and_tag():
    """Off, the knob is in no compile key (every existing key, record and ledger stays valid);
    on, it keys and tags the config (`_mn`). LARGE_MCAST_A takes it (measured 2026-12-05), no
    other standard configuration."""
    for cfg in STANDARD_CONFIGS:
        on = cfg == LARGE_MCAST_A
        assert cfg.scale_mn_major == on and ("scale_mn_major" in cfg.key()) == on
    mn = dataclasses.replace(LARGE, scale_mn_major=True)
    assert mn.key()["scale_mn_major"] is True and mn.tag() == LARGE.tag().replace("_sw", "_mn_sw")
    assert params_for("bfloat16", mn) != params_for("bfloat16", LARGE)
    assert GemmConfig.from_params(dict(params_for("bfloat16", mn))) == mn
    keyed = [p for p in SPEC.standard_params() if "scale_mn_major" in dict(p)]
    assert len(keyed) == 2 and all(dict(p)["cluster_n"] == 2 for p in keyed)  # bf16 / fp16


@pytest.mark.parametrize(
    ("m", "n", "k", "given"),
    [(300, 264, 384, "k"), (301, 128, 1024, "k"), (130, 256, 256, "mn"), (5, 136, 128, "mn")],
)  # fmt: skip
def test_launcher_hands_an_mn_major_config_mn_major_scales(monkeypatch, m, n, k, given):
    """A forced `scale_mn_major` configuration gets A's scales M-major: the caller's own where
    they are (the same tensor), else the launcher's copy; the rest of the call as before."""
    seen = []

    def get_kernel(spec, params):
        def fn(a, b, c, work, flags, per, sa, sb, group, clusters):
            assert fp8_sm90.takes_mn_major(sa) and sa.stride(0) == 1
            seen.append(sa)
            c[:, : b.shape[0]].copy_(gemm_fp8_ref(a, b, sa, sb).to(c.dtype))

        return fn

    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "_plans", type(fp8_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)
    a, b, sa, sb = _operands(m, n, k)
    if given == "mn":
        sa = fp8_sm90.mn_major_copy(sa)
    out = torch.empty(m, n, dtype=torch.bfloat16)
    cfg = dataclasses.replace(LARGE, scale_mn_major=True)
    fp8_sm90.gemm_fp8(a, b, sa, sb, out, config=cfg)
    assert torch.equal(out, gemm_fp8_ref(a, b, sa, sb).to(torch.bfloat16))
    assert (seen[-1] is sa) == (given == "mn")


def test_mn_major_is_refused_where_a_lane_holds_no_whole_vector():
    """A 192-row tile would give a lane 6 rows (24 bytes): refused while tracing."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8

    cfg = GemmConfig(tile_m=192, tile_n=128, tile_k=128, cluster_m=1, scale_mn_major=True)
    with pytest.raises(ValueError, match="scale_mn_major"):
        compile_gemm_fp8(dict(params_for("bfloat16", cfg)))


# ------------------------------------------------- narrow full-K tiles (adopted)

NARROW_LOSERS = {  # case: the model's pick (docs/gemm/NOTES.md "Narrow full-K FP8 tiles")
    (512, 576, 7168): (48, 0),
    (128, 1536, 7168): (32, 0),
    (16, 7168, 2048): (64, 16),
    (64, 4096, 7168): (32, 0),
    (1, 10240, 5120): (80, 8),
    (64, 36864, 7168): (96, 0),
}


def test_narrow_keys_are_standard_builds():
    """Every narrow full-K tile the chooser may pick (`NARROW_CONFIGS`: A's 8 / 16 / 32-row box
    or the whole 64, each of the six widths) is a standard build for both outputs, in the top
    form and the partial-wave band's (its grids: 1 CTA to a whole wave); a narrow key differs
    from the 64-row standard's by the tile's width, A's box, cluster and epilogue sub-tile only;
    the masked builds stay 128 columns wide."""
    from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC
    from forgekernel.kernels.gemm.fp8.sm90 import band_configs
    from forgekernel.kernels.gemm.fp8.sm90.config import NARROW_CONFIGS, narrow, narrow_config
    from forgekernel.runtime import pdl

    for params in map(dict, MASKED_SPEC.standard_params()):
        assert params["tile_n"] == 128
    standard = set(SPEC.standard_params())
    assert len(NARROW_CONFIGS) == len(set(NARROW_CONFIGS)) == 24
    assert set(NARROW_CONFIGS) <= set(band_configs())
    for cfg in NARROW_CONFIGS:
        for out in ("bfloat16", "float16"):
            assert params_for(out, cfg) in standard
            assert pdl.key_for(params_for(out, cfg), pdl.band_form() or "top") in standard
    for (m, n, k), (width, rows) in NARROW_LOSERS.items():
        cfg = narrow(m, n, k)
        assert (cfg.tile_m, cfg.tile_n, cfg.a_rows, cfg.stream_k) == (64, width, rows, False)
        assert cfg.tile_n % cfg.epi_n == 0 and cfg.cluster_m * cfg.cluster_n == 1
        assert cfg.fits(m) and cfg in NARROW_CONFIGS
    for width in NARROW_WIDTHS:
        cfg = narrow_config(64, width)
        base, new = dict(params_for("bfloat16", SKINNY)), dict(params_for("bfloat16", cfg))
        moved = {key for key in base.keys() | new.keys() if base.get(key) != new.get(key)}
        # the 64-row box: its scales by their own warp, four ahead (config.py NARROW_SCALE_AHEAD)
        assert moved <= {"tile_n", "cluster_n", "epi_n", "scale_warp", "scale_ahead"}, moved
        assert cfg.scale_warp and cfg.scale_ahead == 4
        assert GemmConfig.from_params(new) == cfg


# (M, N, K): (narrow / the plan before it, H100 graph 2026-12-05 14:41; the 128-column tiles'
# first-wave CTAs on 132 SMs; the narrow pick's tiles = CTAs)
NARROW_MEASURED = {
    (16, 7168, 2048): (0.718, 56, 112),
    (1, 10240, 5120): (0.880, 80, 128),
    (64, 4096, 7168): (0.927, 32, 128),
    (128, 1536, 7168): (0.821, 24, 96),
    (512, 576, 7168): (0.734, 20, 96),
    (64, 36864, 7168): (0.964, 132, 384),  # 288 tiles: the 128-column plan kept
}


@pytest.mark.parametrize(("m", "n", "k"), list(NARROW_MEASURED))
def test_narrow_adopted_on_the_measured_cases(m, n, k):
    """The chooser takes `narrow`'s tile on the five measured cases whose 128-column tiles keep
    fewer than every SM busy and whose narrow grid is one round of 96-128 CTAs (narrow 0.72-0.93
    of the plan before), and keeps the 128-column plan on 64x36864x7168 (every SM busy, narrow
    three rounds; 0.964 there, not taken)."""
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow, narrow_tiles, takes_narrow

    _, busy, tiles = NARROW_MEASURED[(m, n, k)]
    assert busy_ctas(tiled_config(m), m, n) == busy
    assert narrow_tiles(narrow(m, n, k), m, n) == tiles
    cfg = choose_config(m, n, k)
    if busy < 132:
        assert takes_narrow(m, n, k) and cfg == narrow(m, n, k) != wide_config(m, n, k)
        assert cfg.tile_n == NARROW_LOSERS[(m, n, k)][0]
    else:
        assert not takes_narrow(m, n, k) and cfg == wide_config(m, n, k) == SKINNY


# (M, N, K): the model's verdict, narrow us against the plan it would replace (`narrow_time`
# for the full-K tiles; dense config.py `decode_time` / the 14:31 ledger for stream K)
NARROW_MODEL_LOSES = {
    # MID one round (128 CTAs, 19.1 us) against narrow's 256 tiles of 64x64 in two (27.8 us)
    (128, 8192, 7168): "two rounds",
    (96, 8192, 5120): "two rounds",
    # decode: 116 busy CTAs of 64x128 a8 against 232 tiles of 64x64 (two rounds)
    (1, 14848, 7168): "two rounds",
    # stream K (~4.7 us, 56 k-tile parts over a wave) against 18 / 8 CTAs x 56 k-tiles (13.0 us)
    (1, 576, 7168): "few CTAs",
    (1, 256, 7168): "few CTAs",
}


@pytest.mark.parametrize(("m", "n", "k"), list(NARROW_MODEL_LOSES))
def test_narrow_not_taken_where_its_model_loses(m, n, k):
    """Where the 128-column plan leaves SMs idle but `narrow`'s own model puts its pick behind
    (its grid two rounds, or a few CTAs each streaming the whole K where stream K spreads it
    over a wave), the chooser keeps the plan before: the class is the measured one (one round of
    at least half the SMs), not every shape with idle SMs."""
    from forgekernel.kernels.gemm.fp8.sm90.config import (
        narrow,
        narrow_tiles,
        narrow_time,
        takes_narrow,
    )

    pick, before = narrow(m, n, k), wide_config(m, n, k)
    tiles = narrow_tiles(pick, m, n)
    assert busy_ctas(tiled_config(m), m, n) < 132  # SMs idle: the class before
    assert not takes_narrow(m, n, k) and choose_config(m, n, k) == before
    if NARROW_MODEL_LOSES[(m, n, k)] == "two rounds":
        assert tiles > 132 and not before.stream_k
        # the model: the tiled plan's one round (its tiles as full-K 64-row ones) is faster
        one_round = narrow_time(before, m, n, k)
        assert narrow_time(pick, m, n, k) > one_round
    else:
        assert tiles < 66 and before.stream_k
        assert narrow_time(pick, m, n, k) > 2 * 4.7  # against stream K's ~4.7 us


@pytest.mark.parametrize(
    ("m", "n", "k", "want"),
    [
        # the narrow grid one round of at least half the SMs: 66 tiles of 64x32 taken, 65 not;
        # 132 taken; past one round (the model's pick then 64x64: 260 tiles) not
        (1, 2088, 1024, True), (1, 2056, 1024, False), (1, 4200, 1024, True),
        (64, 2088, 7168, True), (64, 2056, 7168, False),
        (128, 1032, 7168, True), (128, 2088, 7168, True),
        (1, 130 * 128, 1024, False),
        # the 128-column tiles keeping every SM busy (decode tiles in 1x2 clusters: 131 tiles
        # keep 66 clusters, 132 CTAs)
        (1, 131 * 128, 1024, False), (64, 132 * 128, 7168, False),
        # MID one round of 128 CTAs, narrow two (the model: 27.8 against 19.1 us)
        (128, 8192, 7168, False), (128, 65 * 128, 7168, False),
        # M = 512 taken, 513 not (the 128-column plan whatever the tiles)
        (512, 576, 7168, True), (512, 576, 1024, True), (513, 576, 7168, False),
        (513, 128, 7168, False), (1000, 3000, 4096, False),
    ],
)  # fmt: skip
def test_narrow_rule_edges(m, n, k, want):
    """`takes_narrow` at its edges (the pick's tiles at half the SMs and at a whole round, the
    128-column tiles at a whole wave, M = 512 / 513); in the class the chooser's pick is
    `narrow`'s (never stream K, no cluster, a tile over M's rows), outside it `wide_config`'s."""
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow, takes_narrow

    assert takes_narrow(m, n, k) == want
    cfg = choose_config(m, n, k)
    if want:
        assert cfg == narrow(m, n, k) and not cfg.stream_k and cfg.fits(m)
    else:
        assert cfg == wide_config(m, n, k)


def test_narrow_rule_counts_the_chips_sms():
    """On another chip the round and the busy CTAs are its own: 114 SMs (H100 PCIe) move the
    66-tile edge to 57; on an odd count (133) a 1x2-cluster tile's most is 132 CTAs
    (`max_ctas`), so 132 busy CTAs are a whole wave there (`busy < num_sms` never was)."""
    from forgekernel.kernels.gemm.dense.sm90.config import max_ctas
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow, narrow_tiles, takes_narrow

    # 57 tiles of 64x32 on 114 SMs taken, 56 not; on 132 SMs neither
    for n, want in ((57 * 32, True), (56 * 32, False)):
        assert narrow_tiles(narrow(1, n, 1024, num_sms=114), 1, n) == n // 32
        assert takes_narrow(1, n, 1024, 114) == want
        assert not takes_narrow(1, n, 1024)
    n = 131 * 128  # 66 clusters of 1x2: 132 CTAs, the most on 133 SMs
    assert busy_ctas(DECODE[0], 1, n, 133) == max_ctas(DECODE[0], 133) == 132
    assert not takes_narrow(1, n, 1024, 133)


def test_narrow_model_against_the_measured_rows():
    """`narrow_time` on the rows it is fitted to or must reproduce (H200 graph, 2026-12-05):
    MID's 40.8 us on 128x7168x16384 (two 64-row tile rows a block, as the model's 64-row tiles),
    the decode tile's 15.8 us without PDL on 1x10240x5120 (80 full-K tiles: the weight's
    bandwidth), SKINNY's 72.2 us on 64x36864x7168 within 10 %."""
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow_time

    assert narrow_time(MID, 128, 7168, 16384) == pytest.approx(40.8, rel=0.02)
    assert narrow_time(DECODE[0], 1, 10240, 5120) == pytest.approx(15.8, rel=0.06)
    assert narrow_time(SKINNY, 64, 36864, 7168) == pytest.approx(72.2, rel=0.1)


# CI: 80 (A's 16-row box) and 96; 32, 48 and 112 are slow (~3 s of CI's CPU, 2026-12-07): the
# same keys test_gemm_fp8_mainloop's scale-warp and schedule checks compile and check in CI
@pytest.mark.parametrize(
    "width",
    [
        pytest.param(32, marks=pytest.mark.slow),
        pytest.param(48, marks=pytest.mark.slow),
        80,
        96,
        pytest.param(112, marks=pytest.mark.slow),
    ],
)
def test_narrow_tiles_compile_without_spills(width, tmp_path):
    """Compiled for sm_90a: 0 spill / stack / local; the straddling widths load four staged
    products a k-tile (LDS) where the others load two, and the promotion's FFMA count is the
    fragment's (tile_n / 2 a k-tile and fragment)."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow_config
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    cfg = narrow_config(16 if width == 80 else 64, width)
    compiled = SPEC.compile(params_for("bfloat16", cfg), f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    assert info["sass"]["LDS"] == (16 if straddles(width) else 8)


@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (GemmConfig(tile_m=64, tile_n=48, tile_k=128, cluster_m=1, epi_n=16, stream_k=True),
         "two blocks of B's scales"),
        (GemmConfig(tile_m=64, tile_n=80, tile_k=128, cluster_m=1, epi_n=16, stream_k=True),
         "two blocks of B's scales"),
    ],
)  # fmt: skip
def test_straddling_tiles_are_refused_off_the_tiled_walk(cfg, match):
    """A tile over two blocks of B's scales takes the tiled walk: stream K raises while
    tracing (the grouped layouts too)."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8

    with pytest.raises(ValueError, match=match):
        compile_gemm_fp8(dict(params_for("bfloat16", cfg)))


@pytest.mark.parametrize(("m", "n", "k"), [(16, 1000, 384), (130, 576, 896), (600, 256, 3072)])
def test_suite_variants_force_their_plans(monkeypatch, m, n, k):
    """The gemm_fp8 suite's variants: `was` (the plan before narrow, `wide_config`) on every
    bench case whose plan the rule moved, `narrow` where its pick is not ours (64x36864x7168),
    `narrow_even` where ours or `narrow` straddles; each runs its config through the launcher
    (a stand-in kernel computing the reference), keyed as a standard build."""
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow

    seen = []

    def get_kernel(spec, params):
        seen.append(params)

        def fn(a, b, c, work, flags, per, sa, sb, group, clusters):
            c[:, : b.shape[0]].copy_(gemm_fp8_ref(a, b, sa, sb).to(c.dtype))

        return fn

    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "_plans", type(fp8_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)

    def timed(variant):
        return {c.name for c in suite_module.BENCH_CASES if variant in suite_module.variants(c)}

    moved = {"1x7168x16384", "16x7168x2048", "64x4096x7168", "1x10240x5120", "128x7168x16384",
             "128x1536x7168", "512x576x7168"}  # fmt: skip
    assert timed("was") == moved
    assert timed("narrow") == {"64x36864x7168"}
    # the straddling picks (ours on four, `narrow` on 64x36864x7168)
    assert timed("narrow_even") == {"512x576x7168", "1x10240x5120", "64x36864x7168",
                                    "128x7168x16384"}  # fmt: skip
    a, b, sa, sb = _operands(m, n, k)
    inputs = {"a": a, "b": b, "sa": sa, "sb": sb, "out_dtype": torch.bfloat16}
    standard = set(SPEC.standard_params())
    for run, want in (
        (suite_module.run_was, wide_config(m, n, k)),
        (suite_module.run_narrow, narrow(m, n, k)),
        (suite_module.run_narrow_even, narrow(m, n, k, (32, 64))),
    ):
        out = run(inputs, None)
        assert torch.equal(out, gemm_fp8_ref(a, b, sa, sb).to(torch.bfloat16))
        key = dict(seen[-1])
        key.pop("pdl", None)
        assert GemmConfig.from_params(key) == want and seen[-1] in standard
