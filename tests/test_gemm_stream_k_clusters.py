"""Stream K over cluster blocks with data-parallel rounds first (kernel.py `_stream_grid`,
`_cta_range`, `_next_unit`, `_reduce_parts`; plan.py), on a machine without a GPU: the kernel's
own walk is traced by `cute.jit` and run on the host for every CTA of the grid (block_idx and
grid_dim, device registers, replaced by the loop's values; make_warp_uniform by the identity),
and checked against an independent model and the split-K protocol's needs: every k-tile of
every tile exactly once, the CTAs of a cluster in lockstep (the multicast), a CTA past M or N
parking nothing, each cut tile's parts in distinct workspace slots inside the launcher's
workspace, and the reducer reading them in k order from where they were parked."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgekernel.kernels.gemm.dense.sm90 import config
from forgekernel.kernels.gemm.dense.sm90.config import (
    DECODE_STREAM,
    LARGE_STREAM,
    MID,
    WIDE_STREAM,
    split_for,
)
from forgekernel.kernels.gemm.dense.sm90.plan import dp_rounds_of, stream_grid

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

SMS = 132
UNITS = 48  # room for one CTA's units in the traced walk's output
# MID streamed: out of the standard set since the refit of 2026-12-02 (config.py), but the
# kernel's stream-K walk on a 1x2 cluster (a block's two CTAs side by side along N) stays tested.
MID_STREAMED = dataclasses.replace(MID, stream_k=True)
# Swapped stream K: no standard configuration (128x144 over 129 tokens measured 1.04-1.08x the
# pick on 2026-12-03 16:35 and dropped, docs/gemm/NOTES.md), but the launcher still plans it
# for a forced configuration, so the kernel's walk through the swapped view stays tested.
SWAP_STREAMED_144 = config.GemmConfig(tile_n=144, cluster_m=1, epi_n=16, swap=True, stream_k=True)
SWAP_STREAMED_144_C2 = dataclasses.replace(SWAP_STREAMED_144, cluster_m=2)

# (config, M, N, K): data-parallel rounds, blocks over the edge of M (c2x1, odd tile rows) and
# of N (c1x2, odd tile columns), ranges shorter than a block (three parts and more), ranges
# across block boundaries, the decode walk (1x1, every block streamed), short K.
CASES = [
    (MID_STREAMED, 300, 28672, 4096),  # 3 data-parallel rounds, 82 blocks streamed
    (MID_STREAMED, 129, 10240, 8192),
    (MID_STREAMED, 777, 4096, 14336),
    (MID_STREAMED, 200, 2304, 8192),  # 9 tile columns: the last block's second CTA past N
    (LARGE_STREAM, 300, 2048, 4096),  # 3 tile rows: the second block row's CTA 1 past M
    (LARGE_STREAM, 512, 7168, 16384),
    (LARGE_STREAM, 5000, 6144, 4096),  # 6 data-parallel rounds
    (LARGE_STREAM, 1000, 1000, 200),  # K of 4 k-tiles
    (WIDE_STREAM, 4096, 576, 7168),
    (WIDE_STREAM, 3000, 576, 7168),
    (dataclasses.replace(WIDE_STREAM, cluster_m=1), 700, 1000, 3000),
    (DECODE_STREAM[0], 1, 576, 7168),
    # swapped stream K on 129 tokens, the kernel's problem (N, M): 80 weight tiles cut over
    # 132 CTAs, and over 66 2x1 clusters (40 blocks)
    (SWAP_STREAMED_144, 10240, 129, 8192),
    (SWAP_STREAMED_144_C2, 10240, 129, 8192),
    (DECODE_STREAM[3], 40, 8704, 2496),
    (DECODE_STREAM[0], 5, 4096, 1024),
]


def model_walk(cfg, m, n, k, sms=SMS):
    """(plan, {CTA: [(tile_m, tile_n, k0, count, parts, streamed)]}) from the plan alone, with
    the launcher's numbering of CTAs (cluster z, rank r: CTA z S + r)."""
    plan = split_for(cfg, m, n, k, sms)
    cm, cn = cfg.cluster_m, cfg.cluster_n
    tiles_m = -(-m // cfg.tile_m)
    blocks_m = -(-tiles_m // cm)
    kt, wave = plan.k_tiles, max(1, sms // (cm * cn))
    dp_blocks = plan.dp_rounds * wave
    total = plan.blocks * kt

    def tiles_of(block):
        bm, bn = block % blocks_m, block // blocks_m
        return [(bm * cm + x, bn * cn + y) for y in range(cn) for x in range(cm)]

    def parts_of(block):
        if block < dp_blocks:
            return 1
        off = block * kt - dp_blocks * kt
        return (off + kt - 1) // plan.per - off // plan.per + 1

    units = {}
    for z in range(plan.clusters):
        seq = [(b, 0, kt, False) for b in range(z, dp_blocks, wave)]
        it = dp_blocks * kt + z * plan.per
        end = min(it + plan.per, total)
        while it < end:
            b, k0 = divmod(it, kt)
            count = min(end - it, kt - k0)
            seq.append((b, k0, count, True))
            it += count
        for r in range(cm * cn):
            units[z * cm * cn + r] = [
                (*tiles_of(b)[r], k0, count, parts_of(b), streamed)
                for b, k0, count, streamed in seq
            ]
    return plan, units


@pytest.fixture
def host_dsl(monkeypatch):
    """The kernel's device reads of its coordinates, served from `where` on the host."""
    where: dict = {}
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)
    monkeypatch.setattr(cute.arch, "block_idx", lambda: where["block"])
    monkeypatch.setattr(cute.arch, "grid_dim", lambda: where["grid"])
    return where


def kernel_walk(cfg, m, n, k, where, sms=SMS):
    """The kernel's own grid and walk on the host: (grid clusters, data-parallel blocks, out)
    with out[cta, i] = (tile_m, tile_n, k0, count, tile, parts, workspace slot, head, first
    slot, slot step, whether the tile exists) of CTA cta's unit i (the slots `_reduce_parts`
    parks in and sums from)."""
    from forgekernel.kernels.common.sm90.scheduler.static import StaticSchedule, StaticScheduler
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    gemm = GemmSm90(cfg)
    size = cfg.cluster_m * cfg.cluster_n
    plan = split_for(cfg, m, n, k, sms)

    @cute.jit
    def walk(out: cute.Tensor, meta: cute.Tensor, m: Int32, n: Int32, k: Int32, per: Int32,
             wave: Int32):  # fmt: skip
        tiles_m, tiles_n = cute.ceil_div(m, cfg.tile_m), cute.ceil_div(n, cfg.tile_n)
        schedule = StaticSchedule(
            (tiles_m, tiles_n), (cfg.cluster_m, cfg.cluster_n), cfg.swizzle, cfg.raster_along_m
        )
        grid, dp_blocks = gemm._stream_grid(schedule, k, per, wave)
        meta[0], meta[1] = grid[2], dp_blocks
        k_tiles = cute.ceil_div(k, cfg.tile_k)
        streamk = (per, k_tiles, tiles_m, schedule.blocks * k_tiles, dp_blocks)
        for z in cutlass.range(grid[2]):
            for y in cutlass.range_constexpr(cfg.cluster_n):
                for x in cutlass.range_constexpr(cfg.cluster_m):
                    where["block"], where["grid"] = (Int32(x), Int32(y), z), grid
                    rank = gemm._cluster_rank()
                    cta = z * size + rank
                    sched = StaticScheduler(schedule)
                    work = sched.first()
                    it, end = gemm._cta_range(streamk)
                    i = Int32(0)
                    while work < dp_blocks or it < end:
                        unit, work, it = gemm._next_unit(work, it, end, streamk, sched)
                        tm, tn, k0, count, tile, parts, where_ = unit
                        slots = gemm._part_slots(where_, per)
                        exists = Int32(gemm._tile_exists(tm, tn, (m, n)))
                        row = (tm, tn, k0, count, tile, parts, *slots, exists)
                        for j in cutlass.range_constexpr(len(row)):
                            out[cta, i, j] = row[j]
                        i = i + 1

    out = torch.full((plan.ctas, UNITS, 11), -1, dtype=torch.int32)
    meta = torch.zeros(2, dtype=torch.int32)
    wave = sms // size
    walk(from_dlpack(out), from_dlpack(meta), m, n, k, plan.per, wave)
    return plan, meta.tolist(), out


@pytest.mark.parametrize(("cfg", "m", "n", "k"), CASES, ids=lambda x: getattr(x, "tag", str)())
def test_kernel_walk_is_the_plan(cfg, m, n, k, host_dsl):
    check_walk(cfg, m, n, k, host_dsl, SMS)


def random_walk_cases(count: int, seed: int) -> list:
    """(config, M, N, K, SMs): random shapes on every stream-K configuration, MID streamed and
    two cluster shapes no standard one has, for chips of 132, 114 and odd SM counts (131: a
    2-CTA cluster leaves one SM idle; 7: fewer clusters than blocks), small enough to trace."""
    import random

    rng = random.Random(seed)
    cfgs = [
        *config.PREFILL_STREAM,
        MID_STREAMED,
        DECODE_STREAM[0],
        DECODE_STREAM[3],
        dataclasses.replace(MID_STREAMED, cluster_m=2, cluster_n=1),
        dataclasses.replace(LARGE_STREAM, cluster_m=1, cluster_n=2),
    ]
    cases = []
    while len(cases) < count:
        cfg, sms = rng.choice(cfgs), rng.choice([132, 114, 131, 7])
        m = rng.choice([rng.randint(1, 64), rng.randint(65, 1100), rng.randint(1000, 6000)])
        if cfg.a_rows:
            m = rng.randint(1, cfg.a_rows)
        n, k = 8 * rng.randint(1, 2000), 8 * rng.randint(1, 2000)
        plan = split_for(cfg, m, n, k, sms)
        if plan.ctas <= 300 and plan.dp_rounds + plan.per // plan.k_tiles + 4 < UNITS:
            cases.append((cfg, m, n, k, sms))
    return cases


@pytest.mark.parametrize(("cfg", "m", "n", "k", "sms"), random_walk_cases(24, 17), ids=str)
def test_kernel_walk_is_the_plan_on_random_shapes_and_chips(cfg, m, n, k, sms, host_dsl):
    check_walk(cfg, m, n, k, host_dsl, sms)


def check_walk(cfg, m, n, k, host_dsl, sms):
    """The kernel's traced walk of (M, N, K) on a chip of `sms` SMs against `model_walk` and
    the split-K protocol's needs (module docstring)."""
    plan, (clusters, dp_blocks), out = kernel_walk(cfg, m, n, k, host_dsl, sms)
    wave = sms // (cfg.cluster_m * cfg.cluster_n)
    assert clusters == plan.clusters == stream_grid(plan.blocks, plan.k_tiles, wave, plan.per)
    assert dp_blocks == plan.dp_rounds * wave and plan.clusters <= wave
    _, model = model_walk(cfg, m, n, k, sms)
    tiles_m, tiles_n = -(-m // cfg.tile_m), -(-n // cfg.tile_n)
    covered: dict = {}
    parked: dict = {}
    for cta in range(plan.ctas):
        rows = [r for r in out[cta].tolist() if r[0] >= 0]
        assert len(rows) < UNITS and len(rows) == len(model[cta])
        assert [(*r[:4], r[5]) for r in rows] == [u[:5] for u in model[cta]]
        cluster = cta // plan.cluster_size
        mates = [c for c in range(plan.ctas) if c // plan.cluster_size == cluster]
        for mate in mates:  # the cluster in lockstep: the same k-tiles, unit after unit
            assert [r[2:4] for r in out[mate].tolist() if r[0] >= 0] == [r[2:4] for r in rows]
        for tm, tn, k0, count, tile, parts, slot, head, first, step, exists in rows:
            assert exists == (tm < tiles_m and tn < tiles_n)
            if not exists:
                continue  # past M or N: computes with its cluster, parks and stores nothing
            assert tile == tm + tn * tiles_m
            for kt in range(k0, k0 + count):
                assert (tile, kt) not in covered
                covered[tile, kt] = cta
            if parts > 1:
                assert 0 <= slot < 2 * plan.ctas  # inside the launcher's workspace
                parked.setdefault(tile, []).append((k0, slot, parts, head, first, step))
    assert len(covered) == tiles_m * tiles_n * plan.k_tiles
    slots_by_tile = {}
    for tile, us in parked.items():
        us.sort()
        parts = us[0][2]
        assert len(us) == parts and {u[2:] for u in us} == {us[0][2:]}
        _, _, _, head, first, step = us[0]
        # the reducer's slots: part 0 at head, part p at first + p step, in k order
        assert [u[1] for u in us] == [head] + [first + p * step for p in range(1, parts)]
        slots_by_tile[tile] = {u[1] for u in us}
    # a slot holds one partial: no two tiles' parts share one
    seen: set = set()
    for slots in slots_by_tile.values():
        assert not slots & seen
        seen |= slots


def test_the_kernel_derives_the_plans_data_parallel_rounds():
    """`dp_rounds_of` recovers the plan's rounds from (per, clusters) on every plan the
    launcher can make, and a plan without them (decode, FP8) leaves none."""
    for cfg in (*config.PREFILL_STREAM, MID_STREAMED, *DECODE_STREAM):
        for m in (65, 129, 300, 777, 1000, 2048, 5000, 16384):
            for n in (8, 576, 1000, 4096, 28672):
                for k in (8, 64, 520, 4096, 18944):
                    size = cfg.cluster_m * cfg.cluster_n
                    plan = split_for(cfg, m, n, k)
                    wave = SMS // size
                    assert dp_rounds_of(plan.blocks, plan.k_tiles, wave, plan.per) == (
                        plan.dp_rounds
                    )
                    assert plan.clusters == stream_grid(plan.blocks, plan.k_tiles, wave, plan.per)
                    assert plan.clusters <= wave and plan.per >= 1
                    if m <= 64:
                        assert plan.dp_rounds == 0


def walk_classes(cfg, m, n, k) -> set[str]:
    """Which situations the stream-K walk of (M, N, K) meets: "dp" data-parallel rounds,
    "dead_parked" a cut tile past M or N (its CTA skips the park), "parts3" a tile of three
    parts or more, "head_last" a cut tile whose part 0 is its cluster's last unit (cluster slot
    2z + 1), "whole_between" a cluster with a whole block between its two cut ones."""
    plan, units = model_walk(cfg, m, n, k)
    tiles_m, tiles_n = -(-m // cfg.tile_m), -(-n // cfg.tile_n)
    found = {"dp"} if plan.dp_rounds else set()
    for us in units.values():
        streamed = [u for u in us if u[5]]
        for tm, tn, _k0, _count, parts, _ in streamed:
            if parts > 1 and (tm >= tiles_m or tn >= tiles_n):
                found.add("dead_parked")
            if parts >= 3:
                found.add("parts3")
        if len(streamed) >= 2 and streamed[-1][2] == 0 and streamed[-1][4] > 1:
            found.add("head_last")
        if len(streamed) >= 3:
            found.add("whole_between")
    return found


def test_the_suite_checks_every_prefill_walk():
    """Each prefill stream-K configuration is what the chooser picks for check cases of the
    GEMM suite that together meet every situation of `walk_classes` a GPU run must prove, and
    for sanitizer cases where a dead CTA skips its part and part 0 is a last unit. MID (the
    64-row tile) is no longer the chooser's pick anywhere (the 192-row tiles of config.FIT are
    predicted faster): tests/gpu/test_gemm_prefill_stream_gpu.py forces it."""
    from forgekernel.bench.suites import gemm as suite

    def picks(cases):
        out: dict = {}
        for c in cases:
            m, n, k = (c.params[x] for x in "mnk")
            cfg = config.choose_config(m, n, k, SMS, c.params["b_layout"] == "kn")
            if m > 128 and (cfg.stream_k or cfg == config.MID):
                out.setdefault(cfg, set()).update(
                    walk_classes(cfg, m, n, k) if cfg.stream_k else {"tiled"}
                )
        return out

    checked, sanitized = picks(suite.CHECK_CASES), picks(suite.SANITIZE_CASES)
    need = {"dp", "dead_parked", "head_last"}
    for cfg in config.PREFILL_STREAM:
        # WIDE stream K's data-parallel rounds: no pick since the FIT tiles' refit (2026-12-02
        # 13:49 bench); the GPU test forces them (4095x1544x4104), the walk is LARGE's
        want = need - {"dp"} if cfg == config.WIDE_STREAM else need
        assert checked.get(cfg, set()) >= want, cfg.tag()
    assert set().union(*(sanitized.get(c, set()) for c in config.PREFILL_STREAM)) >= {
        *need,
        "parts3",
        "whole_between",
    }
    assert set(sanitized) >= set(config.PREFILL_STREAM)


# Slow (~6 s of CI's CPU, 2026-12-07), their code paths the CI cases': MID_STREAMED (no standard
# key; stream K as LARGE_STREAM's, the 64x256 1x2 tile as MID's, its walk traced above), SWAP_80
# (the swap's 64 x 16 boxes as SWAP_TALL_80's and the swapped stream K's) and FIT_144_A on "nk"
# (its "kn" form, the unshared N-major boxes, is the awkward one)
@pytest.mark.parametrize(
    ("cfg", "b_kn"),
    [
        (LARGE_STREAM, False),
        pytest.param(MID_STREAMED, True, marks=pytest.mark.slow),
        (MID, False),
        (config.FIT_144, True),  # 16-column epilogue sub-tiles, B's narrower swizzle atom
        (config.TALL_80, True),  # three consumer warpgroups (setmaxnreg 152)
        pytest.param(config.SWAP_80, False, marks=pytest.mark.slow),  # C M-major, 64 x 16 boxes
        (config.SWAP_TALL_80, False),  # the swap on three consumer warpgroups
        # 72 columns: B's ring of 80 rows, 8-column sub-tiles (stmatrix x2; swapped, plain)
        (config.TALL_72, False),
        (config.SWAP_TALL_72, False),
        (SWAP_STREAMED_144, False),  # swapped stream K (forced only)
        # the twins config.walked puts in: LARGE walked in bands of 6 N blocks, FIT_144 with A
        # multicast over a 1x2 cluster (B "kn" unshared: its N-major boxes per CTA)
        (config.LARGE_BAND, False),
        pytest.param(config.FIT_144_A, False, marks=pytest.mark.slow),
        (config.FIT_144_A, True),
        # the 256-token candidates (config.py CASE_CANDIDATES; bf16 "nk" as built): candidate
        # forms, slow (2-5 s of CI's CPU, 2026-12-06)
        pytest.param(config.SMALL_C12, False, marks=pytest.mark.slow),
        pytest.param(config.SMALL_N, False, marks=pytest.mark.slow),
    ],
    ids=lambda x: getattr(x, "tag", lambda: str(x))(),
)
def test_prefill_configs_compile_without_spills(cfg, b_kn, tmp_path):
    """sm_90a: no stack or local memory, one mainloop (the tiled kernel's 12 HGMMA: the
    data-parallel and the streamed units share it), the entry register caps (65,536 over the
    CTA's 1 + W warpgroups)."""
    from forgekernel.kernels.gemm.dense.sm90 import SPEC
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    params = config.params_for("bfloat16", b_kn, cfg)
    info = inspect_cubin(
        SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}").artifacts.CUBIN
    )
    sass = info["sass"]
    assert info["spill_bytes"] == 0 and sass.get("LDL", 0) == sass.get("STL", 0) == 0
    assert sass["HGMMA"] == 12 and info["registers"] == {64: 232, 128: 168, 192: 128}[cfg.tile_m]
    if cfg.epi_n == 8:
        # one tile_m x 8 box a sub-tile, either C major (kernel.py `_setup`)
        assert sass["UTMASTG"] == sass["STSM"] == cfg.tile_n // cfg.epi_n
    elif cfg.swap:
        # the M-major C in whole 64-row boxes, one per 64 rows of each (tile_m, epi_n)
        # sub-tile (by 8-element boxes of a 16-column atom it was 8 a sub-tile and band)
        assert sass["UTMASTG"] == cfg.tile_m // 64 * (cfg.tile_n // cfg.epi_n)
