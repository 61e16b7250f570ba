"""The block-scaled FP8 mainloop's own code run on the host (a `cute.jit` function runs on the
CPU with CPU tensors): `GemmSm90._mainloop_scaled` with its two alternating fragments, the
per-thread scale rows (`_thread_coords`, `_scale_rows`), the staged scales' reads and
`_promote`, for every consumer thread of a tile, against the fp64 reference (`gemm_fp8_ref`);
and the producer's scale staging (`_tile_scales`, `_fetch_scales`, `_stage_scales`, for each
of the 32 producer lanes into the k-tile's stage of the ring). Only the two device steps are
stand-ins: `_issue_scaled` stages the k-tile's scales as the producer would (the producer's
own helpers), then writes the k-tile's exact fp32 product A_k B_k^T into the fragment at the
thread's coordinates (what its WGMMAs compute; added to it instead where the MMA was left
accumulating, as a WGMMA with scale-d = 1 would) and `_retire` waits for nothing; both log
what they were asked, so the schedule is checked too: k-tiles issued in
order, each stage released once, in ring order, and only after its k-tile's group retired
(`wait_group(1)` leaves exactly the newest one in flight), a fragment promoted only once its
k-tile's group is retired and never reissued while in flight or unpromoted, and the pipeline
states handed back advanced by the unit's k-tiles (a unit run after another, as stream K runs
a CTA's units, starts where it left them). And the compiled kernel's SASS keeps that schedule
(a WGMMA batch in flight through every promotion)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch

from forgekernel.bench.suites import gemm_fp8 as suite_module
from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.kernels.gemm.dense.sm90.tile import straddles
from forgekernel.reference.gemm import gemm_fp8_ref

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cubins import build  # noqa: E402  (tests/ is on the path)
from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402
from dsl_toolchain import dsl_toolchain  # noqa: E402

ISSUE, RETIRE, PROMOTE, DONE = 1, 2, 3, 4
STAGES = 4  # the ring of the host replay: units of up to 7 k-tiles wrap it


@pytest.fixture
def host_dsl(monkeypatch):
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)


def _host_gemm(cfg: GemmConfig):
    """GemmSm90 whose two device steps are host stand-ins (see the module docstring)."""
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    accumulate_field = cute.nvgpu.warpgroup.Field.ACCUMULATE

    class HostGemm(GemmSm90):
        @cute.jit
        def _issue_scaled(self, tiled_mma, operands, frag, ab_pipe, read, src):
            products, coords, log, staged = self.host
            kt = log[0, 1]  # the k-tiles are issued in order: the next one's index
            log[0, 1] = kt + 1
            for lane in cutlass.range_constexpr(32):
                fetched = self._fetch_scales(staged, kt, lane)
                self._stage_scales(fetched, staged[2], read.index, lane)
            # the first WGMMA of the batch overwrites the fragment unless left accumulating
            onto = tiled_mma.get(accumulate_field)
            for i in cutlass.range_constexpr(cute.size(frag)):
                row, col = coords[i]
                product = products[kt, row, col]
                frag[i] = cutlass.Float32(cutlass.select_(onto, frag[i] + product, product))
            tiled_mma.set(accumulate_field, True)
            _log(log, ISSUE, kt, read.index, _tag(frag))
            return self._scales(src, read.index)

        @cute.jit
        def _retire(self, pending, ab_pipe, stage):
            _log(self.host[2], RETIRE, pending, stage, 0)

        @cute.jit
        def _promote(self, acc, frag, scales):
            _log(self.host[2], PROMOTE, 0, 0, _tag(frag))
            GemmSm90._promote(self, acc, frag, scales)

    return HostGemm(cfg)


@cute.jit
def _tag(frag: cute.Tensor) -> Int32:
    """Which fragment (its registers): its address, folded into an Int32."""
    return Int32(frag.iterator.toint() % 1000003)


@cute.jit
def _log(log: cute.Tensor, kind, value, stage, tag):
    """Append (kind, value, stage, tag) to the event log (row 0 holds the next free row)."""
    at = log[0, 0]
    log[at, 0] = Int32(kind)
    log[at, 1] = Int32(value)
    log[at, 2] = Int32(stage)
    log[at, 3] = Int32(tag)
    log[0, 0] = at + 1


def _run_tile(cfg, a, b, sa, sb, tile, k0, count, lead=None):
    """Every consumer thread's acc after `_mainloop_scaled` over k-tiles [k0, k0 + count) of
    tile (tile_m, tile_n) of C = (a x sa) @ (b x sb)^T, assembled into a (tile_m, tile_n) fp32
    tile, and each thread's event log. `lead`: (k0, count) of a unit run first on the same
    tile, its states handed on (as a stream-K CTA runs its units); its acc is dropped."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    from forgekernel.kernels.common.sm90.pipeline import consumer_state

    m, k = a.shape
    n = b.shape[0]
    tm, tn = tile
    rows = torch.arange(tm * cfg.tile_m, (tm + 1) * cfg.tile_m).clamp_max(m - 1)
    cols = torch.arange(tn * cfg.tile_n, (tn + 1) * cfg.tile_n).clamp_max(n - 1)
    k_tiles = k // 128
    # the k-tiles' unscaled products over this tile (fp32, as the tensor core accumulates)
    a_t = a.float()[rows].view(cfg.tile_m, k_tiles, 128).transpose(0, 1)
    b_t = b.float()[cols].view(cfg.tile_n, k_tiles, 128).transpose(0, 1)
    products = torch.bmm(a_t, b_t.transpose(1, 2)).contiguous()
    threads = cfg.tile_m // 64 * 128
    out = torch.full((cfg.tile_m, cfg.tile_n), float("nan"))
    lead_k0, lead_count = lead or (0, 0)
    log = torch.zeros(threads, 4 * (count + lead_count) + 12, 4, dtype=torch.int32)
    gemm = _host_gemm(cfg)
    # a tile_n not dividing 128 may straddle two blocks of B's scales (set by __call__)
    gemm.n_blocks = 2 if straddles(cfg.tile_n) else 1
    fp8 = cutlass.Float8E4M3FN
    k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()

    @cute.jit
    def unit(k0, count, mma, read, release, thread_log):
        thread_log[0, 1] = k0
        read, release, tiled_mma = gemm._mainloop_scaled(count, mma, None, read, release)
        _log(thread_log, DONE, read.index, read.phase, 0)
        _log(thread_log, DONE, release.index, release.phase, 1)
        return read, release, tiled_mma

    @cute.jit
    def run(products: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor, sSF: cute.Tensor,
            out: cute.Tensor, log: cute.Tensor, m: Int32, k0: Int32, count: Int32, tm: Int32,
            tn: Int32, lead_k0: Int32, lead_count: Int32):  # fmt: skip
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, Float32, (cfg.tile_m // 64, 1, 1),
            tiler_mn=(64, cfg.tile_n),
        )  # fmt: skip
        for t in cutlass.range(threads):
            coords = gemm._thread_coords(tiled_mma, t)
            r0, r1 = gemm._scale_rows(coords)
            acc = cute.make_rmem_tensor(coords.shape, Float32)
            frags = (cute.make_rmem_tensor(coords.shape, Float32),
                     cute.make_rmem_tensor(coords.shape, Float32))  # fmt: skip
            for f in cutlass.range_constexpr(2):  # registers nobody wrote: NaN where read
                frags[f].fill(float("nan"))
            for i in cutlass.range(cute.size(sSF)):  # each thread's run stages its own
                sSF[i] = Float32(float("nan"))
            thread_log = log[t, None, None]
            thread_log[0, 0] = Int32(1)
            blocks = (Int32(0), mSFB.shape[0] - 1)
            staged = gemm._tile_scales((mSFA, mSFB, sSF), tm * cfg.tile_m, tn, m, blocks)
            gemm.host = (products, coords, thread_log, staged)
            read, release = consumer_state(STAGES), consumer_state(STAGES)
            scaled = (frags, r0, r1, sSF)
            if cutlass.const_expr(gemm.n_blocks == 2):  # as `_consume` hands it on
                scaled = (*scaled, gemm._second_block_group(tn))
            if lead_count > 0:
                mma = (tiled_mma, None, None, acc, scaled)
                read, release, tiled_mma = unit(lead_k0, lead_count, mma, read, release,
                                                thread_log)  # fmt: skip
            mma = (tiled_mma, None, None, acc, scaled)
            unit(k0, count, mma, read, release, thread_log)
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, col = coords[i]
                out[row, col] = acc[i]

    # the ring's staged scales (NaN where nothing was staged: a stale read shows)
    staged = torch.full((cfg.tile_m, STAGES * gemm.n_blocks), float("nan"))
    run(from_dlpack(products), from_dlpack(sa), from_dlpack(sb), from_dlpack(staged),
        from_dlpack(out),
        from_dlpack(log), m, k0, count, tm, tn, lead_k0, lead_count)  # fmt: skip
    return out, log


def _events(log_row: torch.Tensor) -> list[tuple[int, int, int, int]]:
    used = int(log_row[0, 0])
    return [tuple(map(int, e)) for e in log_row[1:used]]


def _units(events):
    """The log cut into units: each unit's events and its two DONE records (read, release)."""
    units, current = [], []
    for e in events:
        current.append(e)
        if e[0] == DONE and e[3] == 1:
            units.append((current[:-2], current[-2], current[-1]))
            current = []
    assert not current
    return units


def _check_schedule(events, k0, count, before=0):
    """One unit, `before` k-tiles through the ring ahead of it: issues in k order, each into
    stage before + i of the ring; every issue retired once, in order, its stage released by
    that retire; before each promotion, the promoted fragment's k-tile retired (issues minus
    retires-with-pending = what stays in flight); a fragment never reissued while its batch is
    in flight or unpromoted, nor promoted twice."""
    work = [e for e in events if e[0] != DONE]
    issued = [e for e in work if e[0] == ISSUE]
    assert [e[1] for e in issued] == list(range(k0, k0 + count))
    assert [e[2] for e in issued] == [(before + i) % STAGES for i in range(count)]
    assert sum(e[0] == RETIRE for e in work) == count
    assert sum(e[0] == PROMOTE for e in work) == count
    assert len({e[3] for e in issued}) == min(count, 2)  # two fragments alternate
    in_flight, retired, promoted = 0, 0, 0
    state = {}  # fragment tag -> "flight" | "done" (retired, not promoted) | "free"
    for kind, v, stage, tag in work:
        if kind == ISSUE:
            assert state.get(tag, "free") == "free"  # not over a batch in flight / unpromoted
            state[tag] = "flight"
            in_flight += 1
        elif kind == RETIRE:
            assert in_flight - retired - 1 >= v  # at most `pending` groups left after it...
            # the one group it retires: its stage is the one released
            assert stage == issued[retired][2]
            state[issued[retired][3]] = "done"
            retired = in_flight - v  # ...and wait_group(v) leaves exactly v
        else:
            assert promoted < retired  # the k-tile promoted now has been retired
            assert issued[promoted][3] == tag and state[tag] == "done"
            state[tag] = "free"
            promoted += 1
    # the tensor pipe keeps a batch: every retire but the last leaves one in flight
    pendings = [e[1] for e in work if e[0] == RETIRE]
    assert pendings == [1] * (count - 1) + [0]


def _check_states(done_read, done_release, through):
    """The states handed back: read and release both `through` k-tiles into the ring (index,
    and phase flipped once per lap)."""
    want = (through % STAGES, (through // STAGES) % 2)
    assert done_read[1:3] == want and done_release[1:3] == want


def _check_log(log, k0, count, lead=None):
    lead_k0, lead_count = lead or (0, 0)
    for t in range(log.shape[0]):
        units = _units(_events(log[t]))
        assert len(units) == (2 if lead else 1)
        if lead:
            _check_schedule(units[0][0], lead_k0, lead_count)
            _check_states(units[0][1], units[0][2], lead_count)
        _check_schedule(units[-1][0], k0, count, before=lead_count)
        _check_states(units[-1][1], units[-1][2], lead_count + count)


def _operands(m, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    case = suite_module._case(m, n, k)
    inputs = suite_module.make_inputs(case, torch.bfloat16, torch.device("cpu"), gen)
    return inputs["a"], inputs["b"], inputs["sa"], inputs["sb"]


# CI: four cases (the ragged 128x128 corner, the narrow tiles' blocks); ten more are slow (~14 s
# of CI's CPU, 2026-12-06; ~4 s more, 2026-12-07: the whole tile, the ragged corner's path without
# its clamps, and 48 columns over two blocks, the straddle 80 columns over N = 140 takes in CI;
# ~8 s more, 2026-12-07 evening: the stream-K unit in mid-K, test_units_back_to_back's first
# case's second unit (the same shape, tile and 128x128 tiles, k-tiles 3-4 after 0-2), and one
# warpgroup with M past the tile, its 64-row cases' (M = 40 inside the tile, k0 2 and 0))
SLOW = pytest.mark.slow


@pytest.mark.parametrize(
    ("tile_m", "tile_n", "shape", "tile", "k0", "count"),
    [
        pytest.param(128, 128, (300, 300, 7 * 128), (1, 1), 0, 7, marks=SLOW),  # a whole tile
        (128, 128, (300, 300, 6 * 128), (2, 2), 0, 6),  # the ragged corner: row/column clamps
        # a stream-K unit in mid-K, even
        pytest.param(128, 128, (130, 256, 5 * 128), (0, 1), 2, 2, marks=SLOW),
        # one warpgroup, M past the tile
        pytest.param(64, 128, (70, 200, 4 * 128), (1, 0), 1, 3, marks=SLOW),
        pytest.param(64, 128, (64, 128, 128), (0, 0), 0, 1, marks=SLOW),  # one k-tile
        # two loop trips, odd tail
        pytest.param(64, 128, (64, 256, 6 * 128), (0, 1), 1, 5, marks=SLOW),
        # a 64-column tile in a block's 2nd half
        pytest.param(64, 64, (64, 192, 3 * 128), (0, 1), 0, 3, marks=SLOW),
        (64, 32, (64, 200, 2 * 128), (0, 5), 0, 2),  # 32 columns: a block's last quarter
        # narrow tiles over two blocks of B's scales (columns 96..143: groups 4, 5 on block 1)
        pytest.param(64, 48, (64, 576, 3 * 128), (0, 2), 0, 3, marks=SLOW),
        # two warpgroups, M past the tile
        pytest.param(128, 48, (200, 300, 3 * 128), (1, 2), 0, 3, marks=SLOW),
        (64, 80, (16, 140, 5 * 128), (0, 1), 0, 5),  # 80..159 over N = 140: block 1 partial
        # 288..383: inside block 2, no group moves
        pytest.param(64, 96, (64, 400, 2 * 128), (0, 3), 0, 2, marks=SLOW),
        # 224..335, N = 260: block 2 the last
        pytest.param(64, 112, (64, 260, 4 * 128), (0, 2), 1, 3, marks=SLOW),
        (64, 48, (64, 150, 1 * 128), (0, 3), 0, 1),  # 144..191 past N's last block: clamped
    ],
)  # fmt: skip
def test_mainloop_on_the_host_matches_the_reference(host_dsl, tile_m, tile_n, shape, tile, k0,
                                                    count):  # fmt: skip
    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, seed=tile_m + tile_n + k0 + count)
    epi_n = 32 if tile_n % 32 == 0 else 16  # dividing tile_n
    cfg = GemmConfig(tile_m=tile_m, tile_n=tile_n, tile_k=128, cluster_m=1, epi_n=epi_n)
    out, log = _run_tile(cfg, a, b, sa, sb, tile, k0, count)
    keep = slice(k0 * 128, (k0 + count) * 128)
    want = gemm_fp8_ref(a[:, keep], b[:, keep], sa[:, k0 : k0 + count], sb[:, k0 : k0 + count])
    r0, c0 = tile[0] * tile_m, tile[1] * tile_n
    rows, cols = min(tile_m, m - r0), min(tile_n, n - c0)
    got = out[:rows, :cols]
    ref = want[r0 : r0 + rows, c0 : c0 + cols]
    assert not got.isnan().any()
    tol = 1e-5 * float(ref.abs().max()) * count
    assert float((got - ref).abs().max()) <= tol
    _check_log(log, k0, count)


@pytest.mark.parametrize(
    ("tile_m", "shape", "lead", "k0", "count"),
    [
        (128, (130, 256, 5 * 128), (0, 3), 3, 2),  # odd then even: parity restarts per unit
        (64, (40, 256, 9 * 128), (0, 2), 2, 5),  # even then odd, the ring of 4 wrapped
        (64, (40, 256, 9 * 128), (4, 4), 0, 1),  # a one-k-tile unit after a full lap
    ],
)  # fmt: skip
def test_units_back_to_back_hand_on_the_pipeline_states(host_dsl, tile_m, shape, lead, k0,
                                                        count):  # fmt: skip
    """Stream K runs several units per CTA through one pair of pipeline states: each unit's
    stages continue the ring where the last left it, and its acc is its own k-tiles' only."""
    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, seed=17 + count)
    cfg = GemmConfig(tile_m=tile_m, tile_n=128, tile_k=128, cluster_m=1)
    out, log = _run_tile(cfg, a, b, sa, sb, (0, 1), k0, count, lead=lead)
    keep = slice(k0 * 128, (k0 + count) * 128)
    want = gemm_fp8_ref(a[:, keep], b[:, keep], sa[:, k0 : k0 + count], sb[:, k0 : k0 + count])
    got, ref = out[: min(m, tile_m), :128], want[:tile_m, 128:256]
    assert not got.isnan().any()
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) * count
    _check_log(log, k0, count, lead)


@pytest.mark.parametrize(
    ("tile_m", "shape", "tile", "k0", "count"),
    [
        # rows past M: lanes read M's last vector; slow (~3 s of CI's CPU, 2026-12-07): M = 301's
        # tile row 2 below reads past M too, and pads
        pytest.param(128, (300, 256, 5 * 128), (2, 1), 0, 5, marks=SLOW),
        (128, (301, 256, 3 * 128), (2, 0), 1, 2),  # M not a multiple of 4: the 4-padded rows
        # a whole tile: the others' path with no edge; slow (3-7 s of CI's CPU, 2026-12-06)
        pytest.param(128, (256, 128, 4 * 128), (1, 0), 0, 4, marks=SLOW),
        (64, (70, 128, 3 * 128), (1, 0), 0, 3),  # 8-byte vectors (2 rows a lane)
    ],
)  # fmt: skip
def test_mn_major_scales_stage_the_same_rows(host_dsl, tile_m, shape, tile, k0, count):
    """`scale_mn_major`: the producer's lanes read A's scales as vectors of tile_m / 32 rows from
    the launcher's M-major copy (`mn_major_scales`: K/128 x M rounded up to 4, NaN in the
    padding here) and stage them where the K-major path does: the tile matches the reference
    and nothing staged for a row inside M is NaN."""
    from forgekernel.kernels.gemm.fp8.sm90.launch import mn_major_copy

    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, seed=tile_m + m)
    m4 = -(-m // 4) * 4
    sa_mn = mn_major_copy(sa, torch.full((k // 128, m4), float("nan")))
    assert sa_mn.stride() == (1, m4) and torch.equal(sa_mn, sa)
    cfg = GemmConfig(tile_m=tile_m, tile_n=128, tile_k=128, cluster_m=1, scale_mn_major=True)
    out, log = _run_tile(cfg, a, b, sa_mn, sb, tile, k0, count)
    keep = slice(k0 * 128, (k0 + count) * 128)
    want = gemm_fp8_ref(a[:, keep], b[:, keep], sa[:, k0 : k0 + count], sb[:, k0 : k0 + count])
    r0, c0 = tile[0] * tile_m, tile[1] * 128
    rows, cols = min(tile_m, m - r0), min(128, n - c0)
    got, ref = out[:rows, :cols], want[r0 : r0 + rows, c0 : c0 + cols]
    assert not got.isnan().any()
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) * count
    _check_log(log, k0, count)


@pytest.mark.parametrize("mn_major", [False, True])
def test_the_last_tile_row_starts_on_a_whole_scale_vector(host_dsl, mn_major):
    """The last tile row of a ragged M is moved back to end at M (`_tail_pads`); reading A's
    scales M-major it is moved back by a multiple of 4 rows only (its scales start on a whole
    vector, `_fetch_mn_major`): it ends within M rounded up to 4, never before M."""
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1, scale_mn_major=mn_major)
    gemm = GemmSm90(cfg)
    gemm.scaled = True

    @cute.jit
    def pads(mC: cute.Tensor, out: cute.Tensor):
        pad_m, pad_n, _, _ = gemm._tail_pads(mC)
        out[0] = pad_m
        out[1] = pad_n

    for m in (64, 128, 129, 130, 131, 132, 300, 301, 302, 303, 8191):
        out = torch.zeros(2, dtype=torch.int32)
        pads(from_dlpack(torch.empty(m, 256)), from_dlpack(out))
        pad, tiles = int(out[0]), -(-m // 128)
        end = tiles * 128 - pad  # where the last tile row ends
        first = end - 128
        assert int(out[1]) == 0  # N is never moved back with FP8 (B's scale blocks)
        if m < 128:
            assert pad == 0
        elif mn_major:
            assert first % 4 == 0 and m <= end < m + 4
        else:
            assert end == m


# slow (~4 s of CI's CPU, 2026-12-07): a host run of its own; in CI the reference cases' scales
# (the suite's quantizer: each row's and block's amax of its k-tile) differ by k-tile too, and a
# fragment promoted with a neighbour's would miss their 1e-5 bound by far (the ragged corner:
# the 128x128 tile, six k-tiles)
@pytest.mark.slow
def test_the_promotion_uses_each_k_tiles_own_scales(host_dsl):
    """Scales that differ by k-tile by powers of two (exact): a fragment promoted with its
    neighbour's scales would be off by a factor of 2 or more somewhere."""
    m, n, k = 128, 128, 6 * 128
    a, b, _, _ = _operands(m, n, k, seed=5)
    sa = torch.tensor([2.0**i for i in range(6)]).repeat(m, 1) * torch.linspace(1, 2, m)[:, None]
    sb = torch.tensor([[4.0**-i for i in range(6)]])
    cfg = GemmConfig(tile_m=128, tile_n=128, tile_k=128, cluster_m=1)
    out, _ = _run_tile(cfg, a, b, sa.contiguous(), sb.contiguous(), (0, 0), 0, 6)
    want = gemm_fp8_ref(a, b, sa, sb)
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max()) * 6


def _mainloop_sequence(sass: str) -> str:
    """The consumer's WGMMA schedule in SASS: A = WARPGROUP.ARRIVE (the fence before a batch),
    Q = QGMMA, Dn = WARPGROUP.DEPBAR.LE gsb0, n (wait_group(n)), Fk = k FFMAs in a row (other
    instructions left out)."""
    out = []
    for line in sass.splitlines():
        # "/*0040*/  @!P0 OP args ;  /* encoding */" (cuobjdump) or "OP args" (normalized)
        body = line.split(";", 1)[0]
        body = body.split("*/", 1)[-1] if "*/" in body else body
        tokens = body.replace(",", " ").split()
        if tokens and tokens[0].startswith("@"):
            tokens = tokens[1:]
        if not tokens:
            continue
        op = tokens[0]
        if op.startswith("QGMMA"):
            out.append("Q")
        elif op == "WARPGROUP.ARRIVE":
            out.append("A")
        elif op == "WARPGROUP.DEPBAR.LE":
            out.append("D" + tokens[-1][-1])
        elif op == "FFMA":
            out.append("F")
    return re.sub(r"F+", lambda m: f"F{len(m.group())}", "".join(out))


def _instructions(sass: str) -> list[tuple[str, str]]:
    """(opcode, operands) of each SASS instruction, predicates dropped."""
    out = []
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(.*?)\s*;", line)
        if match:
            tokens = match.group(1).split(None, 1)
            if tokens[0].startswith("@"):
                tokens = tokens[1].split(None, 1)
            out.append((tokens[0], tokens[1] if len(tokens) > 1 else ""))
    return out


# A consumer's local stage release: cu12's ptxas spells it ART0, cu13's (the GPU host's) A1T0
LOCAL_RELEASE = ("SYNCS.ARRIVE.TRANS64.ART0", "SYNCS.ARRIVE.TRANS64.A1T0")


def _wgmma_violations(sass: str, frag_regs: int = 64) -> list[str]:
    """Read in address order (the loop body and both tails in their layout: a linear scan,
    blind only across the back edge and between the tails): an instruction reading or writing
    a register of a QGMMA batch still in flight (committed with gsb0, not yet retired by a
    WARPGROUP.DEPBAR.LE that leaves fewer groups), and a stage's release (the consumers'
    local SYNCS.ARRIVE.TRANS64.ART0) not preceded by a wait of its own (releases never
    outnumber waits: the producer may overwrite a stage only once the WGMMAs reading it
    completed). `frag_regs`: a fragment's registers a thread (tile_n / 2)."""
    groups: list[set[int]] = []  # committed, in flight, oldest first
    batch: set[int] = set()
    waits = releases = 0
    found = []
    for op, args in _instructions(sass):
        if op.startswith("QGMMA"):
            first = int(re.match(r"R(\d+)", args).group(1))
            regs = set(range(first, first + frag_regs))  # 64x128 fp32: 64 registers a thread
            if any(regs & g for g in groups):
                found.append(f"QGMMA onto a batch in flight: {args}")
            batch |= regs
            if "gsb0" in args:
                groups.append(batch)
                batch = set()
        elif op == "WARPGROUP.DEPBAR.LE":
            keep = int(args.split(",")[-1], 16)
            groups = groups[len(groups) - keep :] if keep else []
            waits += 1
        elif op in LOCAL_RELEASE:  # the local release (peers': ...RED.ART0 / .RED.A1T0)
            releases += 1
            if releases > waits:
                found.append(f"stage released before its wait: {op} {args}")
        elif groups or batch:
            used = {int(r) for r in re.findall(r"\bR(\d+)\b", args)}
            used |= {int(r) + 1 for r in re.findall(r"\bR(\d+)\.64\b", args)}
            if used & set().union(batch, *groups):
                found.append(f"in-flight register touched: {op} {args}")
    return found


def _producer_arrivals(sass: str) -> list[tuple[str, int]]:
    """The producer's full-barrier arrivals (SYNCS.ARRIVE.TRANS64 without a suffix: the
    consumers' releases are ...ART0) in address order: each one's predicate ("" when every
    lane arrives) and the STS since the last barrier wait (the stage's staged scales)."""
    found, stores = [], 0
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?(\S+)", line)
        if not match:
            continue
        predicate, op = (match.group(1) or "").strip(), match.group(2)
        if "TRYWAIT" in op:
            stores = 0
        elif op.startswith("STS"):
            stores += 1
        elif op == "SYNCS.ARRIVE.TRANS64":
            found.append((predicate, stores))
    return found


def _consumer_releases(sass: str) -> list[tuple[str, str]]:
    """The consumers' stage releases (SYNCS.ARRIVE.TRANS64...ART0) in address order: each one's
    predicate ("" when every thread arrives) and whether it is the local arrive ("local") or a
    multicast peer's (...RED.ART0: "peer")."""
    found = []
    for line in sass.splitlines():
        match = re.search(r"/\*[0-9a-f]{4}\*/\s+(@!?U?P\w+\s+)?(\S+)", line)
        if match and match.group(2).startswith("SYNCS.ARRIVE.TRANS64."):
            op = match.group(2)
            if op.endswith(("ART0", "A1T0")):
                kind = "peer" if ".RED." in op else "local"
                found.append(((match.group(1) or "").strip(), kind))
    return found


def _consumer_loop(sass: str) -> list[tuple[str, str]]:
    """The consumer mainloop's steady-state trip (two k-tiles): the shortest backward branch
    whose body holds both QGMMAs and FFMAs, as (opcode, operands) in address order."""
    listing = []
    for line in sass.splitlines():
        match = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if match:
            listing.append((int(match.group(1), 16), match.group(2)))
    best: list[tuple[str, str]] | None = None
    for addr, text in listing:
        branch = re.match(r"(@!?U?P\w+\s+)?BRA\S*\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(2), 16) < addr:
            start = int(branch.group(2), 16)
            body = [t for a, t in listing if start <= a <= addr]
            ops = [re.sub(r"^@!?U?P\w+\s+", "", t).split(None, 1) for t in body]
            ops = [(o[0], o[1] if len(o) > 1 else "") for o in ops]
            if any(o.startswith("QGMMA") for o, _ in ops) and any(o == "FFMA" for o, _ in ops):
                if best is None or len(ops) < len(best):
                    best = ops
    return best or []


# CI: stream_decode, mcast_a_mn, grouped (GROUPED, the grouped layout's standard: CI's only
# compile of it since test_scale_warp_compiles_on_the_other_mainloops' `grouped`, its candidate
# scale warp against it, is slow); large is slow since its one-warp form is no longer the
# standard (the scale warp's test builds it in CI)
@pytest.mark.parametrize(
    "which",
    [
        pytest.param("large", marks=SLOW),
        "stream_decode",
        "mcast_a_mn",
        "grouped",
    ],
)
def test_sass_keeps_a_wgmma_batch_in_flight_through_each_promotion(which):
    """Compiled for sm_90a: no spills, and the schedule the mainloop asks for survives ptxas:
    k-tile 0 issued; in the loop (two k-tiles per trip) each batch of 4 QGMMAs is issued before
    the previous one is waited for with DEPBAR.LE 1 and its 64 FFMAs run (the tensor pipe keeps
    the new batch); the tails wait with DEPBAR.LE 0. No DEPBAR inside a batch (ptxas did not
    serialize the WGMMAs), no register of a batch in flight touched, no stage released before
    a wait (`_wgmma_violations`). The producer's every lane arrives on the stage's full
    barrier right after its own scale stores (no ELECT-predicated arrive: racecheck follows each
    store's own thread's release, `_load`), and every consumer thread on the stage's empty
    barrier once it is done with it (unpredicated: each one's reads of the staged scales are
    released by its own arrive, `_retire`), with a cluster also one lane a warp on the peers'.
    `large`: LARGE's one-warp form (`one_warp_scales`: the standard before the scale warp, the
    bench's `one_warp_scales`; the scale warp's own test is
    test_scale_warp_compiles_on_the_other_mainloops) loads the scales two k-tiles ahead
    (`scale_ahead` 2, timed by scripts/fp8_tiles.py) within the producer's 40 registers, the
    consumers' SASS schedule kept (asserted: a `large_ahead2` case, LARGE with scale_ahead=2,
    was this same build once LARGE took it).
    `mcast_a_mn`: LARGE_MCAST_A's one-warp form, reading A's scales M-major (`scale_mn_major`):
    per k-tile one LDG.E.128 a lane for A's and one LDG.E for B's (4 + 1 LDG.E K-major), one
    STS.128 staging them, the consumers' schedule kept; walked in bands of 8 since 2026-12-07,
    as `grouped`: the grouped layout's standard (GROUPED, walked in bands of 8): only the tile
    decode differs from the M-first walk, the loops as LARGE's.
    And the trip's instruction count (`_consumer_loop`) stays within the 2026-12-03 diet's."""
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC
    from forgekernel.kernels.gemm.fp8.sm90.config import (
        GROUPED,
        LARGE,
        LARGE_MCAST_A,
        STREAM_DECODE,
        one_warp_scales,
        params_for,
    )
    from forgekernel.runtime.resources import find_tool

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    cfg, out = {
        "large": (one_warp_scales(LARGE), "bfloat16"),
        "stream_decode": (STREAM_DECODE[0], "float16"),
        "mcast_a_mn": (one_warp_scales(LARGE_MCAST_A), "bfloat16"),
        "grouped": (GROUPED, "bfloat16"),
    }[which]
    if which == "large":
        assert cfg.scale_ahead == 2  # the scales two k-tiles ahead: what `large` proves
    params = params_for(out, cfg, grouped=which.startswith("grouped"))
    # tests/cubins.py `build`, once a process: `mcast_a_mn`'s key is the one-warp base
    # test_scale_warp_compiles_on_the_other_mainloops compares with
    found = build(SPEC, params)
    info, sass = found.resources, found.sass
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    batch = "AQQQQ"
    step = f"{batch}D1F64"
    assert _mainloop_sequence(sass) == batch + step * 3 + "D0F64" * 2
    assert _wgmma_violations(sass) == []
    arrivals = _producer_arrivals(sass)
    stores = 1 if cfg.scale_mn_major else cfg.tile_m // 32  # STS.128 / STS a k-tile
    assert arrivals and all(a == ("", stores) for a in arrivals), arrivals
    if cfg.scale_mn_major:  # A's 4 rows a lane in one vector, B's block scale (no stream K)
        loads = [op for op, _ in _instructions(sass) if op.startswith("LDG")]
        assert set(loads) == {"LDG.E.128", "LDG.E"}
        assert loads.count("LDG.E.128") == loads.count("LDG.E")
    # The steady-state trip (two k-tiles) as counted on 2026-12-03 (docs/gemm/NOTES.md
    # "Instruction diet"): 128 FFMA, 8 QGMMA, 4 LDS and at most this many instructions in all
    # (233 / 224 before the releases went by the read index); more is a regression to look at.
    trip = _consumer_loop(sass)
    ops = [op for op, _ in trip]
    assert ops.count("FFMA") == 128 and ops.count("LDS") == 4, ops
    assert sum(op.startswith("QGMMA") for op in ops) == 8, ops
    clustered = cfg.cluster_m * cfg.cluster_n > 1
    # (`_f4`: ptxas schedules the same trip in 229, two uniform moves more, 2026-12-05)
    extra = 2 if cfg.scale_ahead == 4 else 0
    # cu12's ptxas (a plain install, CI) schedules the same trip in 1-2 more (228 / 216)
    extra += 2 if dsl_toolchain() == "cu12" else 0
    assert len(trip) <= (227 if clustered else 214) + extra, len(trip)
    releases = _consumer_releases(sass)
    local = [r for r in releases if r[1] == "local"]
    peers = [r for r in releases if r[1] == "peer"]
    assert local and all(r == ("", "local") for r in local), releases
    assert len(peers) == (len(local) if clustered else 0), releases


# CI: 32 (no straddle), 48 (straddling, 64 rows) and 80 (straddling, A's 8-row box); 112 (a
# straddling width of 64 rows again) is slow (a compile, ~1.3 s of an idle CPU, 2026-12-07)
@pytest.mark.parametrize(
    ("m", "width"), [(64, 32), (64, 48), (1, 80), pytest.param(64, 112, marks=SLOW)]
)
def test_narrow_tiles_keep_the_schedule(m, width):
    """The narrow full-K candidates (`config.narrow_config`; docs/gemm/NOTES.md "Narrow full-K
    FP8 tiles") compiled for sm_90a: no spills, the standard's schedule with tile_n / 2 FFMAs a
    promotion (a batch in flight through each), no in-flight register touched (`frag_regs`
    tile_n / 2). Straddling widths (48, 80, 112): the producer stores two products a row (4
    STS a lane before its arrive where 2 do), the consumers load four (8 LDS a trip of two
    k-tiles where 4 do) and select per 8-column group (at most one FSEL a group and row)."""
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow_config, params_for
    from forgekernel.runtime.resources import find_tool

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    cfg = narrow_config(m, width)
    # tests/cubins.py `build`, once a process: 64x32's key is the scale-warp test's standard,
    # 1x80's its one-warp base, 64x48's a twin of test_gemm_fp8_tiles' 512x576 pick (one scope)
    found = build(SPEC, params_for("bfloat16", cfg))
    info, sass = found.resources, found.sass
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    step = f"AQQQQD1F{width // 2}"
    consumer = _consumer_part(sass)
    assert _mainloop_sequence(consumer) == "AQQQQ" + step * 3 + f"D0F{width // 2}" * 2
    assert _wgmma_violations(consumer, width // 2) == []
    two = straddles(width)
    arrivals = _producer_arrivals(sass)
    if cfg.scale_warp:
        # the 64-row box: the TMA warp's elected arrive (its expect_tx) stores nothing; the
        # scale warp's lanes' arrives after their stores: the test below
        assert arrivals and all(a[0] and a[1] == 0 for a in arrivals), arrivals
    else:
        # each lane's arrive after its stores of the stage's scales
        assert arrivals and all(a == ("", 4 if two else 2) for a in arrivals), arrivals
    ops = [op for op, _ in _consumer_loop(sass)]
    assert ops.count("FFMA") == width and sum(op.startswith("QGMMA") for op in ops) == 8
    assert ops.count("LDS") == (8 if two else 4), ops
    fsel = ops.count("FSEL")
    assert (0 < fsel <= width // 2) if two else fsel == 0, ops


def _consumer_part(sass: str) -> str:
    """The consumer warpgroups' code: from the target of the branch that sends them past the
    producer warpgroup's `USETMAXREG.DEALLOC` (the producer's code lies before it)."""
    lines = sass.splitlines()
    dealloc = next(i for i, line in enumerate(lines) if "USETMAXREG.DEALLOC" in line)
    target = next(
        int(m.group(1), 16)
        for line in reversed(lines[:dealloc])
        if (m := re.search(r"BRA\s+0x([0-9a-f]+)", line))
    )
    return "\n".join(
        line
        for line in lines
        if (m := re.search(r"/\*([0-9a-f]{4,})\*/", line)) and int(m.group(1), 16) >= target
    )


def _producer_loops(sass: str) -> list[tuple[list[tuple[str, str]], list[str]]]:
    """Every loop (a backward branch's body, as `_consumer_loop` reads them) without a QGMMA
    that issues a TMA load or a global load: the producer warps' k-tile loops, each as its
    lines split in two (a predicated line: the predicate, then the rest) and its opcodes."""
    listing = []
    for line in sass.splitlines():
        match = re.search(r"/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;", line)
        if match:
            listing.append((int(match.group(1), 16), match.group(2)))
    loops = []
    for addr, text in listing:
        branch = re.match(r"(@!?U?P\w+\s+)?BRA\S*\s+0x([0-9a-f]+)", text)
        if branch and int(branch.group(2), 16) < addr:
            start = int(branch.group(2), 16)
            body = [t.split(None, 1) for a, t in listing if start <= a <= addr]
            body = [(b[0], b[1] if len(b) > 1 else "") for b in body]
            plain = [re.sub(r"^@!?U?P\w+\s+", "", f"{o} {a}").split()[0] for o, a in body]
            if any(o.startswith("QGMMA") for o in plain):
                continue
            if any(o.startswith(("UTMALDG", "LDG")) for o in plain):
                loops.append((body, plain))
    return loops


def _sass_without_spills(cfg: GemmConfig, grouped: bool = False) -> str:
    """The SASS of `cfg`'s bf16-out FP8 build (tests/cubins.py `build`: once a process),
    asserted free of spills and local loads."""
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC
    from forgekernel.kernels.gemm.fp8.sm90.config import params_for

    found = build(SPEC, params_for("bfloat16", cfg, grouped))
    assert found.resources["spill_bytes"] == 0 and found.resources["sass"].get("LDL", 0) == 0
    return found.sass


# CI: 32 (no straddle) and 112 (straddling, 64 rows: the longest trip, +3), the 64-row box's
# standard (four ahead) each; 48 (straddling, 64 rows again) is slow (two compiles, ~2 s of CI's
# CPU, 2026-12-07), and 80 (A's 8-row box) too: a decode box's standard has no scale warp
# (`narrow_config`), so its `_sw` build here is no standard or candidate key (~1.3 s of an idle
# CPU; its one-warp base is the standard test_narrow_tiles_keep_the_schedule checks in CI)
@pytest.mark.parametrize(
    ("m", "width"),
    [(64, 32), pytest.param(64, 48, marks=SLOW), (64, 112), pytest.param(1, 80, marks=SLOW)],
)
def test_scale_warp_takes_the_scale_loads_off_the_tma_loop(m, width):
    """`scale_warp` (docs/gemm/NOTES.md "next/fp8-narrow-scales"; the 64-row box's standard
    since 2026-12-07, four ahead) on the narrow tiles, compiled for sm_90a: no spills; the
    consumers' code as the one-warp key's (the same WGMMA schedule, no in-flight register
    touched, the same trip of two k-tiles); the producer's k-tile loops
    split in two: the TMA warp's issue UTMALDG after one ELECT-predicated full-barrier arrive
    (its expect_tx) and hold no LDG, FMUL or STS (no TMA waits on a scale load: with one warp
    a k-tile's UTMALDG followed its FMUL of the LDG before); the scale warp's hold the LDGs, the
    FMUL products, their STS and every lane's plain arrive after them, and no UTMALDG."""
    from forgekernel.kernels.gemm.fp8.sm90.config import narrow_config, one_warp_scales
    from forgekernel.runtime.resources import find_tool

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")

    # the 64-row box's standard (the scale warp four ahead) or, on a decode box, `_sw`, against
    # the tile with one warp loading the scales one ahead
    std = narrow_config(m, width)
    one = one_warp_scales(std)
    sass = _sass_without_spills(
        std if std.scale_warp else dataclasses.replace(one, scale_warp=True)
    )
    base = _sass_without_spills(one)
    consumer = _consumer_part(sass)
    assert _mainloop_sequence(consumer) == _mainloop_sequence(base)
    assert _wgmma_violations(consumer, width // 2) == []
    trip, base_trip = _consumer_loop(sass), _consumer_loop(base)
    # (the four-ahead keys' trip is up to 3 instructions longer, moves of uniform registers:
    # 64x48 +1, 64x112 +3 under cu12, the keys the H100 timed 4.5-11 % faster; the math and
    # the releases below are the same)
    assert 0 <= len(trip) - len(base_trip) <= (3 if std.scale_warp else 0)
    for op in ("FFMA", "LDS", "FSEL", *LOCAL_RELEASE):
        assert [o for o, _ in trip].count(op) == [o for o, _ in base_trip].count(op), op
    tma, scale = [], []
    for body, plain in _producer_loops(sass):
        (tma if any(o.startswith("UTMALDG") for o in plain) else scale).append((body, plain))
    assert tma and scale
    for body, plain in tma:
        assert not any(o.startswith(("LDG", "STS")) or o == "FMUL" for o in plain), plain
        arrives = [(o, a) for o, a in body if "SYNCS.ARRIVE" in f"{o} {a}"]
        assert arrives and all(o.startswith("@") for o, _ in arrives), arrives
    two = straddles(width)
    for body, plain in scale:
        assert not any(o.startswith("UTMALDG") for o in plain), plain
        arrives = [i for i, o in enumerate(plain) if o.startswith("SYNCS.ARRIVE.TRANS64")]
        assert arrives and all(not body[i][0].startswith("@") for i in arrives), arrives
        # each arrive after its k-tile's scale stores (4 a lane straddling, else 2)
        stores = [i for i, o in enumerate(plain) if o.startswith("STS")]
        assert len(stores) == len(arrives) * (4 if two else 2), plain
        assert plain.count("FMUL") == len(stores)


# CI: large and mcast_a_mn (LARGE's and LARGE_MCAST_A's scale warp the standards since
# 2026-12-07: each built against its one-warp form, the schedule test's `large` / `mcast_a_mn`);
# grouped is slow: GROUPED_F4_SW is a candidate build (the grouped bench's `f4_sw`), GROUPED's
# standard build stays in CI as the schedule test's `grouped` (~1.5 s of an idle CPU)
@pytest.mark.parametrize("which", ["large", "mcast_a_mn", pytest.param("grouped", marks=SLOW)])
def test_scale_warp_compiles_on_the_other_mainloops(which):
    """`scale_warp` on the tiled mainloops tests/gpu/test_gemm_fp8_scale_warp_gpu.py runs it on
    besides the narrow tiles (the standards since 2026-12-07: LARGE, B multicast, two ahead;
    LARGE_MCAST_A, A multicast, A's scales M-major, four ahead; the grouped layout's tile, four
    ahead, the grouped bench's `f4_sw`): no spills, the consumers' WGMMA schedule as the
    one-warp form's (`one_warp_scales`; GROUPED), and the TMA loads in loops of their own (no
    LDG among them). (Stream K refuses it: its scale warp spilled 24 bytes, kernel.py.)"""
    from forgekernel.kernels.gemm.fp8.sm90.config import (
        GROUPED,
        GROUPED_F4_SW,
        LARGE,
        LARGE_MCAST_A,
        one_warp_scales,
    )
    from forgekernel.runtime.resources import find_tool

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    warp = {"large": LARGE, "mcast_a_mn": LARGE_MCAST_A, "grouped": GROUPED_F4_SW}[which]
    assert warp.scale_warp
    grouped = which == "grouped"

    sass = _sass_without_spills(warp, grouped)
    base = _sass_without_spills(GROUPED if grouped else one_warp_scales(warp), grouped)
    assert _mainloop_sequence(_consumer_part(sass)) == _mainloop_sequence(base)
    loops = [plain for _, plain in _producer_loops(sass)]
    tma = [ops for ops in loops if any(o.startswith("UTMALDG") for o in ops)]
    assert tma
    if grouped:  # the tile loop reads its tile's expert (one LDG a tile), the k-tile loop none
        assert not any(o.startswith("LDG") for o in min(tma, key=len))
        assert all(sum(o.startswith("LDG") for o in ops) <= 1 for ops in tma)
    else:
        assert not any(o.startswith("LDG") for ops in tma for o in ops)
