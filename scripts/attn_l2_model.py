"""L2-reuse model of the sm90 attention forward's tile order and deal (CPU only).

The tiles go in the kernel's longest-first order (`scheduler.longest_first`: the row block
slowest over every head and batch, or batch by batch in L2 sections of `section` query heads, the
row block slowest within a section; varlen: the row block slowest over (sequence, head)), at the
head dims' tile sizes, causal (bottom-right) or not; a deal runs them on 132 CTAs: `static` (CTA
c takes tiles c, c + 132, ...: ours) or `greedy` (each tile in order to the CTA that frees first:
FA4's one CTA a tile under the hardware's dispatch, FA3's and `AttnConfig.dynamic`'s tile
counter). A CTA reads its tile's key blocks last to first, one a step, steps of equal time,
tile_cost steps between tiles. Every K + V block read goes through an LRU cache of `l2_mib`; the
misses are the K / V bytes read from HBM.

    python scripts/attn_l2_model.py                 the 192/128 cases of the first round
    python scripts/attn_l2_model.py suite [names]   every bench case (default config and the
                                                    candidates) against the report's times

docs/attention/NOTES.md, "192/128 against FA4's schedule" and "The L2 model over every forward
class".
"""

from __future__ import annotations

import heapq
import math
import sys
from collections import OrderedDict
from pathlib import Path

SMS = 132
TILE = 128
EMPTY_COST = 0.1  # steps a tile of no key block holds its CTA (a varlen row block past the end)


def tiles(
    b: int, hq: int, hkv: int, sq: int, sk: int, section: int | None,
    tile_m: int = TILE, tile_n: int = TILE, causal: bool = True,
) -> list[tuple]:  # fmt: skip
    """(kv head, key blocks) of each tile in the kernel's order (section None: global; else
    sections of `section` query heads, batch by batch). Non-causal: every tile reads every
    key block."""
    m_blocks, group, n_all = math.ceil(sq / tile_m), hq // hkv, math.ceil(sk / tile_n)

    def blocks(m: int) -> int:
        if not causal:
            return n_all
        last = min((m + 1) * tile_m, sq) - 1
        return max(min(n_all, (last + sk - sq + tile_n) // tile_n), 0)

    if section is None:
        heads = [(bb, h) for bb in range(b) for h in range(hq)]
        return [(bb * hkv + h // group, blocks(m_blocks - 1 - r))
                for r in range(m_blocks) for bb, h in heads]  # fmt: skip
    out = []
    for bb in range(b):
        for h0 in range(0, hq, section):
            here = range(h0, min(h0 + section, hq))
            out += [(bb * hkv + h // group, blocks(m_blocks - 1 - r))
                    for r in range(m_blocks) for h in here]  # fmt: skip
    return out


def varlen_tiles(
    lens_q: tuple, lens_k: tuple, hq: int, hkv: int, tile_m: int = TILE, tile_n: int = TILE,
    causal: bool = True,
) -> list[tuple]:  # fmt: skip
    """The varlen order (no sections): the row block slowest over every (sequence, head), each
    sequence's last row block first (causal: bottom-right); a row block past a sequence's end
    is a tile of no key block (it costs the deal a tile's overhead)."""
    group, m_max = hq // hkv, max(math.ceil(q / tile_m) for q in lens_q)
    out = []
    for r in range(m_max):
        for s, (sq, sk) in enumerate(zip(lens_q, lens_k)):
            m_blocks, n_all = math.ceil(sq / tile_m), math.ceil(sk / tile_n)
            m = m_blocks - 1 - r if causal else r
            if r >= m_blocks:
                out += [(None, 0)] * hq
                continue
            last = min((m + 1) * tile_m, sq) - 1
            n = n_all if not causal else max(min(n_all, (last + sk - sq + tile_n) // tile_n), 0)
            out += [(s * hkv + h // group, n) for h in range(hq)]
    return out


def reads(order: list[tuple], deal: str, tile_cost: float = 0.5) -> list[tuple]:
    """(time, kv head, key block) of every block read under `deal` ("static" or "greedy")."""
    events = []
    if deal == "greedy":
        free = [(0.0, c) for c in range(SMS)]
        for head, n in order:
            t, c = heapq.heappop(free)
            events += [(t + i, head, n - 1 - i) for i in range(n)]
            heapq.heappush(free, (t + (n + tile_cost if n else EMPTY_COST), c))
    else:
        for c in range(SMS):
            t = 0.0
            for head, n in order[c::SMS]:
                events += [(t + i, head, n - 1 - i) for i in range(n)]
                t += n + tile_cost if n else EMPTY_COST
    return sorted(events)


def hbm_bytes(events: list[tuple], block_bytes: int, l2_mib: float) -> int:
    """K / V bytes that miss an LRU cache of l2_mib holding whole blocks."""
    cap, lru, misses = int(l2_mib * 2**20 // block_bytes), OrderedDict(), 0
    for _, head, block in events:
        key = (head, block)
        if key in lru:
            lru.move_to_end(key)
        else:
            misses += 1
            lru[key] = None
            if len(lru) > cap:
                lru.popitem(last=False)
    return misses * block_bytes


# name: ((b, hq, hkv, sq, sk), D + Dv, section heads or None): the bench's 192/128 cases in the
# default's order (sections of 40 MiB of K / V past a 320 MiB wave) and in FA4's at s2048, two
# GQA D = 128 fixed-length cases the tile counter was timed on (2026-12-04).
CASES = {
    "d192 b8 s2048 (global)": ((8, 128, 128, 2048, 2048), 320, None),
    "d192 b8 s2048 (sections of 32)": ((8, 128, 128, 2048, 2048), 320, 32),
    "d192 b2 s8192 (sections of 8)": ((2, 128, 128, 8192, 8192), 320, 8),
    "d192 b1 s16384 (sections of 4)": ((1, 128, 128, 16384, 16384), 320, 4),
    "d192 chunked sq2048 sk16384 (sections of 4)": ((1, 128, 128, 2048, 16384), 320, 4),
    "d128 b1 hq32 hkv8 sq2048 sk8192 (global)": ((1, 32, 8, 2048, 8192), 256, None),
    "d128 b2 hq32 hkv8 sq1024 sk16384 (global)": ((2, 32, 8, 1024, 16384), 256, None),
}


def table(l2_mibs: tuple[float, ...] = (50, 25)) -> dict[str, dict]:
    """Per case: GB of K / V read, and from HBM per deal and cache size."""
    out = {}
    for name, (shape, dims, section) in CASES.items():
        order = tiles(*shape, section)
        block = TILE * dims * 2
        row = {"read": sum(n for _, n in order) * block / 1e9}
        for deal in ("static", "greedy"):
            events = reads(order, deal)
            for mib in l2_mibs:
                row[(deal, mib)] = hbm_bytes(events, block, mib) / 1e9
        out[name] = row
    return out


# The whole forward suite: each bench case in the order and deal of its default config
# (`std`) and of the candidates, K / V misses plus Q, O and LSE (read / written once) against the
# graph time of benchmarks/reports/sm_90a/attention.md at the device copy's rate.
COPY_TBPS = 4.25  # H200 device copy, TB/s (OPS.md)
REPORT = Path(__file__).resolve().parents[1] / "benchmarks/reports/sm_90a/attention.md"
FA4_L2 = 50 * 2**20  # FA4's SingleTileLPTScheduler: sections of 2^floor(log2(50 MiB / head))


def kernel_section(p: dict, l2_kv_mib: int, wave_kv_mib: int) -> int | None:
    """The query heads of one L2 section under `LongestFirst`'s rule, None for the global
    order: sections when min(grid // G + 1, B Hkv) kv heads' K + V exceed wave_kv_mib."""
    group, kv = p["hq"] // p["hkv"], max(p["sk"] * (p["d"] + p["dv"]) * 2, 1)
    wave = min(SMS // group + 1, p["b"] * p["hkv"])
    if wave * (kv // 1024) <= wave_kv_mib * 1024:
        return None
    return min(max(l2_kv_mib * 2**20 // kv, 1) * group, p["hq"])


def candidates(p: dict) -> dict[str, tuple]:
    """name: (order, deal) of the default config and the candidates at a case's params."""
    from forgekernel.kernels.attention.fwd.sm90.config import default_config

    varlen = bool(p.get("varlen"))
    cfg = default_config(p["d"], p["dv"], varlen=varlen)
    tm, tn, causal = cfg.tile_m, cfg.tile_n, p["causal"]
    if varlen:
        order = varlen_tiles(p["lens_q"], p["lens_k"], p["hq"], p["hkv"], tm, tn, causal)
        return {"std": (order, "greedy" if cfg.dynamic else "static")}
    shape = (p["b"], p["hq"], p["hkv"], p["sq"], p["sk"])
    sec = {w: kernel_section(p, cfg.l2_kv_mib, w) for w in (cfg.wave_kv_mib, 0)}
    std_order = tiles(*shape, sec[cfg.wave_kv_mib], tm, tn, causal)
    w0_order = tiles(*shape, sec[0], tm, tn, causal)
    kv = p["sk"] * (p["d"] + p["dv"]) * 2
    fa4_sec = 1 if kv > FA4_L2 else 2 ** int(math.log2(FA4_L2 // kv))
    b, hq, hkv, sq, sk = shape
    fa4 = tiles(1, b * hq, b * hkv, sq, sk, min(fa4_sec, b * hq), tm, tn, causal)
    out = {"std": (std_order, "greedy" if cfg.dynamic else "static"),
           "wave0": (w0_order, "static"), "dyn": (std_order, "greedy"),
           "wave0_dyn": (w0_order, "greedy"), "fa4": (fa4, "greedy")}  # fmt: skip
    for mib in (12, 40):  # another section size, in sections always, either deal
        if mib != cfg.l2_kv_mib:
            o = tiles(*shape, kernel_section(p, mib, 0), tm, tn, causal)
            out[f"wave0_sec{mib}"] = (o, "static")
            out[f"wave0_sec{mib}_dyn"] = (o, "greedy")
    return out


def measured() -> dict[str, tuple[float, float]]:
    """case: (ours ms, FA4 ms) from the report's graph table."""
    out, text = {}, REPORT.read_text().split("## eager")[0]
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) > 6 and cells[2] == "bf16":
            try:
                out[cells[0]] = (float(cells[3]), float(cells[5]))
            except ValueError:
                pass
    return out


def suite_rows(l2_mibs: tuple[float, ...] = (50, 25), names: str = "") -> list[dict]:
    """Per bench case: GB from HBM (K / V misses + Q, O, LSE) per candidate and cache size,
    the floor in ms at COPY_TBPS, the measured ms."""
    from forgekernel.bench.suites.attention import BENCH_CASES

    times, rows = measured(), []
    for case in BENCH_CASES:
        if names and not any(n in case.name for n in names.split(",")):
            continue
        p = case.params
        b = 1 if p.get("varlen") else p["b"]
        rows_q = sum(p["lens_q"]) if p.get("varlen") else b * p["sq"]
        qo = rows_q * p["hq"] * ((p["d"] + p["dv"]) * 2 + 4)
        from forgekernel.kernels.attention.fwd.sm90.config import default_config

        tn = default_config(p["d"], p["dv"], varlen=bool(p.get("varlen"))).tile_n
        block, memo = tn * (p["d"] + p["dv"]) * 2, {}
        row = {"case": case.name, "group": case.group, "ms": times.get(case.name, (0, 0))}
        for name, (order, deal) in candidates(p).items():
            key = (tuple(order[:64]), len(order), deal, hash(tuple(order)))
            if key not in memo:
                events = reads(order, deal)
                memo[key] = [(qo + hbm_bytes(events, block, m)) / 1e9 for m in l2_mibs]
            row[name] = memo[key]
        row["read"] = (qo + sum(n for _, n in candidates(p)["std"][0]) * block) / 1e9
        rows.append(row)
    return rows


def main() -> None:
    if sys.argv[1:2] == ["suite"]:
        for r in suite_rows(names=sys.argv[2] if len(sys.argv) > 2 else ""):
            ms, fa4 = r["ms"]
            std = r["std"]
            cells = " ".join(f"{k}={v[0]:.2f}/{v[1]:.2f}" for k, v in r.items()
                             if isinstance(v, list))  # fmt: skip
            floor = [g / COPY_TBPS for g in std]
            print(f"{r['case']} [{r['group']}] ms {ms} fa4 {fa4} read {r['read']:.2f} GB "
                  f"floor {floor[0]:.3f}/{floor[1]:.3f} ms ({floor[0] / ms:.2f}/"
                  f"{floor[1] / ms:.2f} of ours) | {cells}", flush=True)  # fmt: skip
        return
    for name, row in table().items():
        cells = ", ".join(f"{d} {m} MiB {v:.2f}" for (d, m), v in
                          ((k, v) for k, v in row.items() if k != "read"))  # fmt: skip
        print(f"{name}: read {row['read']:.1f} GB; from HBM (GB): {cells}")


if __name__ == "__main__":
    main()
