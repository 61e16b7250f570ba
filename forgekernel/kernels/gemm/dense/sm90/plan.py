"""Work plans of the dense GEMM's stream-K configurations and the time model of its prefill
configurations (M > 128). DSL-free: the launcher and the chooser run it on the host.

Stream K (kernel.py): the output tiles are cut into cluster blocks (cluster_m x cluster_n
tiles, the static scheduler's work units: block b, M fastest, is work index b). A k-iteration
is one k-tile of one block, computed by every CTA of a cluster on its own tile of the block,
so the CTAs of a cluster load the same k-tiles and the multicast is kept. The launch holds
`clusters` persistent clusters:

- the first `dp_rounds` x clusters blocks run whole, data-parallel (cluster z takes blocks
  z, z + clusters, ...: the tiled kernel's order, operands shared in L2 by the concurrent
  blocks);
- the k-iterations of the remaining blocks are cut into ranges of `per`, cluster z taking
  [z per, (z + 1) per) of them; a block that a range boundary cuts is summed from its parts
  (kernels/common/sm90/splitk.py).

Only the last full round and the remainder are streamed (`dp_rounds` = rounds - 2, at least 0):
a cluster then streams between one and two blocks, so no block has more than about three parts,
and the streamed blocks of one column run at nearly the same time (a cluster that streams
through several blocks one after another re-reads each block's operands from DRAM).

The kernel does not receive dp_rounds: it derives it from `per` and `clusters`
(`dp_rounds_of`), which the plan makes exact: per x clusters covers the streamed iterations and
falls short of the data-parallel blocks' by at least one k-iteration.

Time model (us), calibrated on the H200 ledger of 2026-12-02 (benchmarks/results/sm_90a/
gemm.json; docs/gemm/NOTES.md "Mid-size M"): a tile computes at `_SM_TFLOPS` x its
configuration's efficiency per SM with every SM busy, up to `_IDLE_BOOST` faster in a round that
leaves SMs idle (clock headroom: 4096x576x7168's 96 busy SMs ran 5% faster a tile); a launch
costs `_LAUNCH_US`; the busiest cluster's rounds are the time. Stream K adds the parked and
summed fp32 partials of its cut blocks (tile_m x tile_n x 4 bytes each, written and read back
through L2 by one SM: `_PARTIAL_KB_PER_US`). No plan runs faster than its bytes from HBM.
"""

from __future__ import annotations

from dataclasses import dataclass

NUM_SMS = 132  # H100 SXM / H200


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class StreamSplit:
    """A stream-K launch: `per` k-iterations per cluster in the streamed part, `clusters` in
    the grid, `dp_rounds` rounds of whole blocks first; `blocks` cluster blocks and `tiles`
    output tiles of `k_tiles` k-tiles each; `cluster_size` CTAs a cluster."""

    per: int
    clusters: int
    dp_rounds: int
    blocks: int
    tiles: int
    k_tiles: int
    cluster_size: int

    @property
    def ctas(self) -> int:
        """CTAs of the grid (each holds two workspace slots)."""
        return self.clusters * self.cluster_size

    @property
    def streamed(self) -> int:
        """k-iterations of the streamed blocks."""
        return (self.blocks - self.dp_rounds * self.clusters) * self.k_tiles


def grid_blocks(cfg, m: int, n: int) -> tuple[int, int, int]:
    """(tiles along M, tiles along N, cluster blocks) of `cfg` on an (M, N) output."""
    tiles_m, tiles_n = _ceil(m, cfg.tile_m), _ceil(n, cfg.tile_n)
    return tiles_m, tiles_n, _ceil(tiles_m, cfg.cluster_m) * _ceil(tiles_n, cfg.cluster_n)


def stream_split(
    cfg, m: int, n: int, k: int, num_sms: int, min_k: int, data_parallel: bool
) -> StreamSplit:
    """The stream-K plan of `cfg` on (M, N, K) for a chip of `num_sms` SMs: with
    `data_parallel`, the blocks before the last two rounds whole, the rest in equal ranges;
    without (the decode and FP8 plans), every block streamed. With no data-parallel round, no
    range is shorter than `min_k` k-iterations (fewer clusters then: a part parks a tile-sized
    fp32 partial)."""
    size = cfg.cluster_m * cfg.cluster_n
    tiles_m, tiles_n, blocks = grid_blocks(cfg, m, n)
    k_tiles = _ceil(k, cfg.tile_k)
    wave = max(1, num_sms // size)
    dp_rounds = max(blocks // wave - 1, 0) if data_parallel else 0
    streamed = (blocks - dp_rounds * wave) * k_tiles
    if dp_rounds:
        # every cluster runs the data-parallel rounds: the grid is a whole wave
        per, clusters = _ceil(streamed, wave), wave
    else:
        per = _ceil(streamed, max(1, min(wave, streamed // min_k)))
        clusters = _ceil(streamed, per)
    plan = StreamSplit(per, clusters, dp_rounds, blocks, tiles_m * tiles_n, k_tiles, size)
    assert dp_rounds_of(blocks, k_tiles, wave, per) == dp_rounds
    return plan


def dp_rounds_of(blocks: int, k_tiles: int, wave: int, per: int) -> int:
    """The kernel's derivation of the data-parallel rounds (GemmSm90.__call__): the whole
    blocks that `wave` clusters of `per` k-iterations leave uncovered, in rounds."""
    uncovered = max(blocks * k_tiles - wave * per, 0)
    return _ceil(uncovered, wave * k_tiles)


def stream_grid(blocks: int, k_tiles: int, wave: int, per: int) -> int:
    """The kernel's grid (clusters) of a stream-K launch (GemmSm90.__call__): a whole wave
    with data-parallel rounds, else as many ranges as the streamed iterations fill."""
    dp = dp_rounds_of(blocks, k_tiles, wave, per)
    return max(_ceil((blocks - dp * wave) * k_tiles, per), wave * min(dp, 1))


def grid_ctas(cfg, m: int, n: int, k: int, num_sms: int, per: int = 0) -> int:
    """CTAs of the kernel's grid as the launchers launch it on the (M, N, K) it sees (N and K
    padded, swapped where `cfg.swap`), `num_sms // cluster size` clusters at most (their
    max_clusters): tiled, one cluster a block up to that (StaticSchedule.grid); stream K
    (`per` k-iterations a cluster, the launcher's), `stream_grid` (GemmSm90._stream_grid)."""
    size = cfg.cluster_m * cfg.cluster_n
    wave = num_sms // size
    blocks = grid_blocks(cfg, m, n)[2]
    if cfg.stream_k:
        return stream_grid(blocks, _ceil(k, cfg.tile_k), wave, per) * size
    return min(blocks, wave) * size


# Prefill time model (module docstring). _SM_TFLOPS: LARGE's rate per SM with all 132 busy
# (5.12-5.31 over the multi-round LARGE cases of 2026-12-02); _IDLE_BOOST: a round with a
# fraction f of the SMs idle runs 1 + _IDLE_BOOST f faster (4096x576x7168 at 96 busy +5%,
# 1024x3584x18944 at 112 busy +2%); _LAUNCH_US: launch, pipeline fill and last epilogue
# (2-3 us over the single-round cases); partials: 1.0 + KB / 110 us to park one, 0.35 + KB /
# 110 to sum one (the decode fit's 1.3 / 0.5 us at 16 KB, 110 GB/s between one SM and L2);
# _HBM_MB_PER_US: the chip's streaming rate of the decode fit.
_SM_TFLOPS = 5.25
_IDLE_BOOST = 0.18
_LAUNCH_US = 2.5
_PARK_BASE_US = 1.0
_SUM_BASE_US = 0.35
_PARTIAL_KB_PER_US = 110.0
_HBM_MB_PER_US = 4.1
# The streamed part runs `_STREAM_SLOWDOWN` slower a k-iteration than a data-parallel round
# (fit over the 28 LARGE / WIDE stream-K plans timed beside their tile on 2026-12-02 07:00; the
# streamed part 1.16-1.33x slower where no round is data-parallel): the ranges of concurrent
# clusters sit at different k offsets of different blocks and share no operand in L2.
_STREAM_SLOWDOWN = 1.2


def _boost(busy: float) -> float:
    """Rate of a round with a `busy` fraction of the SMs computing, relative to all busy."""
    return 1.0 + _IDLE_BOOST * (1.0 - busy)


def tile_us(cfg, k: int, efficiency: float) -> float:
    """One whole tile of `cfg` with every SM busy."""
    flop = 2 * cfg.tile_m * cfg.tile_n * _ceil(k, cfg.tile_k) * cfg.tile_k
    return flop / (_SM_TFLOPS * efficiency * 1e6)


def tiled_us(cfg, m: int, n: int, k: int, num_sms: int, efficiency: float) -> float:
    """The tiled (static persistent) configuration: rounds of cluster blocks, the last one
    with the remainder (a dead CTA of a block past M or N computes too: it is busy)."""
    size = cfg.cluster_m * cfg.cluster_n
    wave = max(1, num_sms // size)
    blocks = grid_blocks(cfg, m, n)[2]
    rounds = _ceil(blocks, wave)
    last = blocks - (rounds - 1) * wave
    t = tile_us(cfg, k, efficiency)
    return _LAUNCH_US + (rounds - 1) * t + t / _boost(last * size / num_sms)


def restream_mb_per_us(cfg, m: int, k: int, num_sms: int, efficiency: float) -> float:
    """HBM rate (MB/us) at which the tiled M-first walk of `cfg` (swizzle 1) reads A: a round
    of a wave's tiles spans min(M, the wave's tile rows) rows of A, all K of them, over one
    tile's time; an A larger than the L2 has left it by the next column of tiles, so every
    round reads its rows from HBM anew (16-bit operands)."""
    size = cfg.cluster_m * cfg.cluster_n
    rows = min(m, max(1, num_sms // size) * cfg.cluster_m * cfg.tile_m)
    return rows * k * 2 / 1e6 / tile_us(cfg, k, efficiency)


def partial_us(cfg) -> tuple[float, float]:
    """(park, sum) of one tile-sized fp32 partial."""
    kb = cfg.tile_m * cfg.tile_n * 4 / 1024
    return _PARK_BASE_US + kb / _PARTIAL_KB_PER_US, _SUM_BASE_US + kb / _PARTIAL_KB_PER_US


def stream_us(plan: StreamSplit, cfg, k: int, num_sms: int, efficiency: float) -> float:
    """The stream-K configuration: its data-parallel rounds, one range, and the partials the
    busiest cluster parks (its first and its last unit where they are cut) and the most parts
    one block sums."""
    t = tile_us(cfg, k, efficiency)
    kt = plan.k_tiles
    parked = 0 if plan.per % kt == 0 else 1 if kt % plan.per == 0 else 2
    parts = 1 if not parked else _ceil(kt, plan.per) + (parked == 2)
    park, part = partial_us(cfg)
    fixup = (park * parked + part * parts) if parked else 0.0
    busy = plan.ctas / num_sms if not plan.dp_rounds else 1.0
    streamed = _STREAM_SLOWDOWN * plan.per * t / kt / _boost(busy)
    return _LAUNCH_US + plan.dp_rounds * t + streamed + fixup


def hbm_us(m: int, n: int, k: int, elem_bytes: int = 2) -> float:
    """A, B and C through HBM once: the floor under every plan."""
    return _LAUNCH_US + elem_bytes * (m * k + n * k + m * n) / 1e6 / _HBM_MB_PER_US
