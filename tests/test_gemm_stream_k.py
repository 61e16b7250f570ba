"""The GEMM's decode configurations and stream-K plan (CPU): which configuration the chooser
picks for small M, that a short A box refuses taller problems, and a Python mirror of the
kernel's stream-K walk (kernel.py `_stream_unit` / `_reduce_parts`): every k-iteration of every
tile is computed exactly once, each split tile's parts go to distinct workspace slots inside
the launcher's workspace, and the reducer finds the slots the writers used."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from forgekernel.kernels.gemm.dense.sm90 import config
from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_sm90
from forgekernel.kernels.gemm.dense.sm90.config import (
    DECODE,
    DECODE_STREAM,
    SKINNY_64,
    GemmConfig,
    choose_config,
    decode_time,
    stream_plan,
)


@pytest.mark.parametrize(
    ("m", "n", "want"),
    [
        (1, 24576, DECODE[0]),
        (8, 4096, DECODE[0]),
        (9, 4096, DECODE[1]),
        (32, 8192, DECODE[2]),
        (64, 8192, SKINNY_64),
        (1, 576, DECODE_STREAM[0]),
        (33, 1000, DECODE_STREAM[3]),
    ],
)
def test_decode_choice(m, n, want):
    assert choose_config(m, n, 4096) == want
    assert want.fits(m)


def test_ragged_n_takes_the_tile_that_divides_it():
    # 4 x 144, where 128 x 256 wastes a quarter and 3 x 192 leaves 36 of 132 SMs idle (96 tiles
    # of 128x192: 69.0 us on the H200; 128 of 128x144 51.3 there); A multicast since A, the
    # operand streamed from HBM, outweighs B 7x (config.py `walked`)
    assert choose_config(4096, 576, 7168) == config.FIT_144_A


def test_short_a_box_refuses_taller_problems(monkeypatch):
    monkeypatch.setattr(gemm_sm90, "num_sms", lambda device: 132)
    with pytest.raises(ValueError, match="rows of A"):
        gemm_sm90._choose(torch.bfloat16, False, 9, 64, 64, None, DECODE[0])


def _walk(cfg: GemmConfig, m: int, n: int, k: int, sms: int, min_k: int | None = None):
    """What each CTA of the stream-K grid computes: (tile, k0, count, parts, slot) units."""
    per, ctas, tiles = stream_plan(cfg, m, n, k, sms, min_k)
    k_tiles = -(-k // cfg.tile_k)
    total = tiles * k_tiles
    units = []
    for cta in range(ctas):
        it, end = cta * per, min(cta * per + per, total)
        assert it < end, "an empty CTA"
        while it < end:
            tile, k0 = divmod(it, k_tiles)
            count = min(end - it, k_tiles - k0)
            first = tile * k_tiles // per
            parts = (tile * k_tiles + k_tiles - 1) // per - first + 1
            slot = 2 * cta + int(cta * per < tile * k_tiles)
            units.append((tile, k0, count, parts, slot, cta))
            it += count
    return per, ctas, tiles, k_tiles, units


@pytest.mark.parametrize(
    ("m", "n", "k", "sms"),
    [(1, 576, 7168, 132), (2, 512, 16384, 132), (24, 1000, 4104, 132), (1, 8, 8, 132),
     (3, 200, 520, 114), (64, 1984, 65536, 132), (17, 136, 72, 7),
     (16, 10240, 8192, 132), (32, 51200, 5120, 132), (5, 8704, 2496, 132), (3, 128, 4160, 132)],
)  # fmt: skip
def test_stream_k_walk(m, n, k, sms):
    check_walk(DECODE_STREAM[0], m, n, k, sms)


def check_walk(cfg: GemmConfig, m: int, n: int, k: int, sms: int, min_k: int | None = None):
    """Every k-iteration of every tile once; each split tile's parts in distinct slots inside
    the workspace, where the reducer looks for them."""
    per, ctas, tiles, k_tiles, units = _walk(cfg, m, n, k, sms, min_k)
    assert ctas <= sms
    covered = {}
    for tile, k0, count, _parts, _slot, cta in units:
        for kt in range(k0, k0 + count):
            assert (tile, kt) not in covered
            covered[tile, kt] = cta
    assert len(covered) == tiles * k_tiles
    by_tile: dict[int, list] = {}
    for u in units:
        by_tile.setdefault(u[0], []).append(u)
    for tile, us in by_tile.items():
        parts = us[0][3]
        assert len(us) == parts and all(u[3] == parts for u in us)
        if parts == 1:
            assert us[0][2] == k_tiles
            continue
        slots = [u[4] for u in sorted(us, key=lambda u: u[1])]
        assert len(set(slots)) == parts and max(slots) < 2 * ctas  # inside the workspace
        # the reducer's slots, part p = CTA first + p, in k order
        first = tile * k_tiles // per
        want = [2 * c + int(c * per < tile * k_tiles) for c in range(first, first + parts)]
        assert slots == want
        # what `_reduce_parts` hands splitk.sum_parts: part 0 at `head`, part p at
        # first' + p step with (first', step) = (2 first, 2)
        head = 2 * first + int(first * per < tile * k_tiles)
        assert slots == [head] + [2 * first + 2 * p for p in range(1, parts)]


def _walk_classes(cfg: GemmConfig, m: int, n: int, k: int, sms: int) -> set[str]:
    """Which stream-K situations the walk of (m, n, k) meets: "head_last" a split tile whose
    part 0 is its CTA's last unit (slot 2c + 1), "whole_between" a CTA with a whole tile
    between its two parked units."""
    units = _walk(cfg, m, n, k, sms)[4]
    found = set()
    for _tile, k0, _count, parts, slot, _cta in units:
        if parts > 1 and k0 == 0 and slot % 2:
            found.add("head_last")
    for cta in {u[5] for u in units}:
        if sum(u[5] == cta for u in units) >= 3:
            found.add("whole_between")
    return found


def test_the_suite_checks_every_decode_stream_k_walk():
    """Each stream-K decode configuration (one compiled kernel per A box) is what the chooser
    picks for some case of the GEMM suite's check, on a walk with both situations only a GPU
    run proves (`_walk_classes`), and for some sanitizer case; every decode configuration the
    chooser can pick is sanitized."""
    from forgekernel.bench.suites import gemm as suite

    def picks(cases):
        out = {}
        for c in cases:
            m, n, k = (c.params[x] for x in "mnk")
            if m <= 64:
                cfg = choose_config(m, n, k, 132)
                out.setdefault(cfg, set()).update(
                    _walk_classes(cfg, m, n, k, 132) if cfg.stream_k else ()
                )
        return out

    checked, sanitized = picks(suite.CHECK_CASES), picks(suite.SANITIZE_CASES)
    for cfg in DECODE_STREAM:
        assert checked.get(cfg, set()) >= {"head_last", "whole_between"}, cfg.tag()
        assert "head_last" in sanitized.get(cfg, set()), cfg.tag()
    assert set(sanitized) >= {*DECODE, *DECODE_STREAM, SKINNY_64}


@pytest.mark.parametrize(
    ("m", "n", "k", "cfg", "us"),
    [
        (1, 4096, 4096, DECODE[0], 10.7),  # 64 CTAs
        (16, 10240, 8192, DECODE[1], 47.1),  # 160 tiles: a second round of 28 CTAs
        (1, 24576, 4096, DECODE[0], 49.6),
        (1, 24576, 4096, DECODE_STREAM[0], 52.5),
        (1, 576, 7168, DECODE_STREAM[0], 9.7),
        (1, 576, 7168, DECODE[0], 15.7),
    ],
)
def test_decode_model_reproduces_its_fit(m, n, k, cfg, us):
    """The chooser's time model, with the 13-stage ring the H200 figures of 2026-12-01 were
    measured with, within 15% of them (docs/gemm/NOTES.md, "Decode, stream K")."""
    old_ring = dataclasses.replace(cfg, stages=13)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(config, "ring_stages", lambda c, *a: c.stages or config.ring_stages(c))
        assert decode_time(old_ring, m, n, k) == pytest.approx(us, rel=0.15)


def test_decode_model_prefers_balance():
    """Stream K where the tiles leave most SMs idle, tiled where they fill whole rounds."""
    assert choose_config(1, 576, 7168).stream_k and choose_config(1, 512, 16384).stream_k
    assert not choose_config(1, 24576, 4096).stream_k
    assert not choose_config(4, 28672, 4096).stream_k
