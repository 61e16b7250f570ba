"""The forward's L2-reuse model (scripts/attn_l2_model.py): the kernel's tile orders, and the
deal's effect on the K / V bytes from HBM that the 192/128 candidates `dyn` and `wave0` rest on
(docs/attention/NOTES.md, "192/128 against FA4's schedule")."""

from __future__ import annotations

from tests.script_modules import load_script

model = load_script("attn_l2_model")
BLOCK = 128 * (192 + 128) * 2  # K + V bytes of one 128-key block at 192/128


def test_tiles_follow_the_kernels_longest_first_orders():
    """Global: the row block slowest over every head (the last, longest first); sections:
    heads in groups, the row block slowest within each; GQA: query heads share kv heads."""
    assert model.tiles(1, 2, 2, 256, 256, None) == [(0, 2), (1, 2), (0, 1), (1, 1)]
    assert model.tiles(1, 4, 4, 256, 256, 2) == [(0, 2), (1, 2), (0, 1), (1, 1),
                                                 (2, 2), (3, 2), (2, 1), (3, 1)]  # fmt: skip
    assert {h for h, _ in model.tiles(2, 8, 2, 128, 128, None)} == {0, 1, 2, 3}
    assert model.tiles(1, 1, 1, 256, 1000, None) == [(0, 8), (0, 7)]  # Sq < Sk: the prefix
    assert model.tiles(1, 1, 1, 300, 100, None)[-1] == (0, 0)  # rows that see no key


def test_the_static_deal_loses_the_sections_l2_reuse():
    """64 MHA heads at s4096 in sections of 8 (20 MiB of K / V each) through a 25 MiB cache:
    the greedy deal reads each block from HBM once, the static one ~9 times as often (3.4x at
    50 MiB); the global order reads about half of all blocks again whatever the deal."""
    order = model.tiles(1, 64, 64, 4096, 4096, 8)
    once = 64 * 32 * BLOCK
    greedy = model.reads(order, "greedy")
    static = model.reads(order, "static")
    assert model.hbm_bytes(greedy, BLOCK, 25) == model.hbm_bytes(greedy, BLOCK, 50) == once
    assert model.hbm_bytes(static, BLOCK, 25) > 8 * once
    assert model.hbm_bytes(static, BLOCK, 50) > 3 * once
    flat = model.tiles(1, 64, 64, 4096, 4096, None)
    total = sum(n for _, n in flat) * BLOCK
    assert model.hbm_bytes(model.reads(flat, "greedy"), BLOCK, 25) > 0.45 * total
