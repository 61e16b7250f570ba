"""The lightning indexer's kernels compiled for sm_90a on the CPU (no GPU: the DSL compiles,
ptxas assembles, cuobjdump reads the cubin), their structure as the kernels state it.

Logits (decode qtokens 1, paged; prefill qtokens 4): FP8 warpgroup MMAs (QGMMA, 4 per tile:
K = 128 in steps of 32), TMA loads (Q, the key tile, its scales), no spills; the 168 registers
of the launch are setmaxnreg's split (producer 40, consumers 232: one CTA per SM). Top-k (one
CTA, and a cluster of 8): one bulk copy of the row's part, no global load of the logits after
it, three histogram rounds (15 shuffles of the scans), shared-memory atomics, no spills; the
cluster's barriers (6 arrivals and waits: statistics, 3 rounds, totals, exit) and its peer
reads (ld.shared::cluster). Shared memory from config (the struct's sizes) fits the SM."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from cubins import build  # tests/ is on the path

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.dsa_indexer.sm90 import SPEC, config  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _compiled(params) -> tuple[dict, Counter, str]:
    """(resources, SASS opcode counts, SASS): cubins.build, once a process (the TMA box test
    reads the PTX of the same logits keys)."""
    found = build(SPEC, params)
    return found.resources, Counter(_OP.findall(found.sass)), found.sass


@pytest.mark.parametrize("qtokens, paged", [(1, True), (4, False)])
def test_logits_kernel(qtokens, paged):
    res, ops, _ = _compiled(config.logits_params(qtokens, paged))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert ops["QGMMA"] == config.HEAD_DIM // 32  # one tile's K = 128, e4m3 steps of 32
    assert ops["UTMALDG"] >= 3  # Q, the key tile, its scales
    assert res["registers"] <= 168
    assert config.logits_smem_bytes(qtokens) <= config.SMEM_PER_SM


@pytest.mark.parametrize("cluster", [1, 8])
def test_topk_kernel(cluster):
    res, ops, sass = _compiled(config.topk_params(cluster, cluster == 8))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert ops["UBLKCP"] == 1  # the row's part, one bulk copy
    assert ops["SHFL"] == 5 * 3  # the three rounds' scans
    assert ops["ATOMS"] >= 5 and ops["REDUX"] >= 3
    assert res["registers"] <= 64  # 2 CTAs of 512 threads per SM
    if cluster > 1:
        assert ops["UCGABAR_ARV"] == ops["UCGABAR_WAIT"] == 6
        assert re.search(r"\bLD\b", sass) is not None  # the peers' counts (generic ld)
    else:
        assert ops["UCGABAR_ARV"] == 0
    assert 2 * config.topk_smem_bytes() <= config.SMEM_PER_SM


# ---------------------------------------------------------------- TMA box starts (PTX dataflow)

_TMA = re.compile(r"cp\.async\.bulk\.tensor\.(\d)d\.\S+\s+\[[^\]]+\],\s*\[[^,\]]+,\s*\{([^}]*)\}")
_DEF = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)\s+(%r\d+),\s*([^;]*);", re.M)
_INF = 1 << 32


def _pow2(v: int) -> int:
    """The largest power of two dividing v (v = 0: any)."""
    return _INF if v == 0 else v & -v


def _divisors(ptx: str) -> dict[str, int]:
    """Per 32-bit register, a power of two that divides every value it takes: the greatest
    fixpoint over its definitions (mov / add / sub / shl / mul / and / selp with registers or
    immediates; anything else divides by 1)."""
    defs: dict[str, list[tuple[str, list[str]]]] = {}
    for op, dst, args in _DEF.findall(ptx):
        defs.setdefault(dst, []).append((op, [a.strip() for a in args.split(",")]))
    div = dict.fromkeys(defs, _INF)

    def of(a: str) -> int:
        if a.startswith("%r"):
            return div.get(a, 1)
        return _pow2(int(a, 0)) if re.fullmatch(r"-?(0x[0-9a-fA-F]+|\d+)", a) else 1

    def step(op: str, a: list[str]) -> int:
        kind = op.split(".")[0]
        if kind == "mov":
            return of(a[0])
        if kind in ("add", "sub"):
            return min(of(a[0]), of(a[1]))
        if kind == "shl" and not a[1].startswith("%"):
            return min(_INF, of(a[0]) << int(a[1], 0))
        if op.startswith("mul.lo"):
            return min(_INF, of(a[0]) * of(a[1]))
        if kind == "and":
            return max(of(a[0]), of(a[1]))
        if kind == "selp":
            return min(of(a[0]), of(a[1]))
        return 1

    changed = True
    while changed:
        changed = False
        for reg, ds in defs.items():
            new = min(step(op, a) for op, a in ds)
            if new < div[reg]:
                div[reg], changed = new, True
    return div


def _innermost_box_starts(ptx: str) -> list[tuple[int, int]]:
    """(dims, a power of two dividing the innermost start coordinate) of each TMA load."""
    div = _divisors(ptx)
    out = []
    for dims, coords in _TMA.findall(ptx):
        first = coords.split(",")[0].strip()
        out.append((int(dims), div.get(first, 1) if first.startswith("%r") else 1))
    return out


@pytest.mark.parametrize("qtokens, paged", [(4, False), (1, True)])
def test_logits_tma_boxes_start_16_byte_aligned(qtokens, paged):
    """TMA raises "illegal instruction" for a box whose innermost start is not 16-byte aligned
    (the first H200 run, prefill with packed sequences: a 1-D k_scale box at the group's
    smallest k_start, 13). Proven on the PTX: fp8 boxes (Q, K: 2-D) start at a multiple of 16
    elements, the fp32 scales' 1-D box (prefill) at a multiple of 4 (key_origin's rounding)."""
    boxes = _innermost_box_starts(build(SPEC, config.logits_params(qtokens, paged)).ptx)
    assert len(boxes) == 3  # Q, the key tile, its scales
    for dims, divisor in boxes:
        assert divisor >= (4 if dims == 1 else 16), boxes
