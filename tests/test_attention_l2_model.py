"""The forward's L2-reuse model (scripts/attn_l2_model.py): the kernel's tile orders, and the
deal's effect on the K / V bytes from HBM that the 192/128 candidates `dyn` and `wave0` rest on
(docs/attention/NOTES.md, "192/128 against FA4's schedule")."""

from __future__ import annotations

from dataclasses import replace

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


def test_forward_suite_orders_follow_the_kernels_rule():
    """Every class: non-causal tiles read every key block; D = 64's 192-row tiles; the kernel's
    section rule (sections past a 320 MiB wave, of l2_kv_mib of K / V, whole GQA groups); varlen
    row blocks past a sequence's end read nothing."""
    assert model.tiles(1, 2, 2, 256, 300, None, causal=False) == [(0, 3), (1, 3)] * 2
    assert [n for _, n in model.tiles(1, 1, 1, 384, 384, None, 192, 128)] == [3, 2]
    p = {"b": 8, "hq": 128, "hkv": 128, "sq": 2048, "sk": 2048, "d": 192, "dv": 128}
    assert model.kernel_section(p, 40, 320) is None  # a 166 MiB wave: the global order
    assert model.kernel_section(p, 40, 0) == 32  # 40 MiB of 1.25 MiB heads
    gqa = {**p, "hq": 32, "hkv": 8, "sk": 32768, "d": 128, "dv": 128}
    assert model.kernel_section(gqa, 24, 0) == 4  # one 16 MiB kv head: its group of 4
    order = model.varlen_tiles((256, 128), (256, 128), 2, 1)
    assert order == [(0, 2), (0, 2), (1, 1), (1, 1), (0, 1), (0, 1), (None, 0), (None, 0)]


def test_backward_sections_past_l2_lose_the_rows_reuse():
    """The backward model: key-block CTAs of a kv head share its Q / dO / dQ rows while their
    section's rows fit in L2 (sections of one pair here: the compulsory bytes), not when a
    section of four pairs holds more than it (the chunked GQA case at 8 pairs a section)."""
    from forgekernel.kernels.attention.bwd.sm90.config import default_config

    bwd = load_script("attn_bwd_l2_model")
    p = {"b": 2, "hq": 16, "hkv": 2, "sq": 256, "sk": 16384, "d": 128, "dv": 128, "causal": True}
    cfg = default_config(128, 128)
    got = {}
    for sw in (1, 4):
        work = bwd.ctas(p, "ours", replace(cfg, l2_swizzle=sw))
        got[sw] = bwd.hbm_bytes(p, work, 64, 128, l2_mib=5)  # a pair's rows: 2.1 MB
    rows = 2 * 16 * 256 * (256 * 2 + 8 + 128 * 4 * 2)  # read once, dQ written back once
    kv = 2 * 2 * 16384 * 256 * 2 * 2  # K / V read, dK / dV written
    assert got[1] == rows + kv
    assert got[4] - kv > 3 * rows
