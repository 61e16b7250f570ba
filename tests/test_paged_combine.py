"""The split-KV combine (kernels/attention/paged/sm90/combine.py, shared by attention_paged,
mla_decode and dsa_sparse) on the CPU: its schedule (which group adds which split, in which
order; which CTA writes which columns) replayed in torch (split_combine.combine_lanes) against
the plain merge on 1 .. 300 splits with splits of no keys whose partial rows are NaN and rows of
no keys at all, head dims 64 / 128 / 256 / 512, both output dtypes; then the compiled kernels'
resources and SASS: the splits' partial rows as 16-byte loads issued a block ahead, no spills."""

from __future__ import annotations

import math
import re
import tempfile
from collections import Counter

import pytest
import torch

pytest.importorskip("cutlass")

from split_combine import combine_lanes, combine_splits, group_order, spread_of  # noqa: E402

from forgekernel.kernels.attention.paged.sm90 import combine as kc  # noqa: E402
from forgekernel.kernels.attention.paged.sm90.config import THREADS  # noqa: E402

HEAD_DIMS = (64, 128, 256, 512)


def _partials(splits: int, rows: int, heads: int, d: int, seed: int = 0):
    """(op, lp): random partials; splits 1, 4, 7, ... of row 0 and every split of the last row
    without keys (LSE -inf, partial O NaN: stale), LSEs spread over 2^-40 .. 2^40."""
    g = torch.Generator().manual_seed(seed)
    op = torch.randn(splits, rows, heads, d, generator=g)
    lp = torch.randn(splits, rows, heads, generator=g) * 12.0
    lp[1::3, 0] = -math.inf
    lp[:, -1] = -math.inf
    op[lp == -math.inf] = math.nan
    return op, lp


@pytest.mark.parametrize("splits", [1, 2, 7, 128, 257, 300, 600])
@pytest.mark.parametrize("groups", [4, 8])
def test_each_split_added_once_in_order(splits, groups):
    seen = []
    for g in range(groups):
        order = group_order(splits, groups, g, kc.UNROLL, kc.SPLIT_CAP)
        assert order == sorted(order) and all(s % groups == g for s in order)
        seen += order
    assert sorted(seen) == list(range(splits))


@pytest.mark.parametrize("d", HEAD_DIMS)
def test_the_threads_cover_the_columns(d):
    k = kc.PagedCombineSm90(d)
    assert k.groups * k.vecs == THREADS and k.cols * k.chunks == d
    for units in (1, 16, 128, 264, 1056, 2048, 100000):
        spread = spread_of(units, k.chunks, kc.WAVE_CTAS)
        assert 1 <= spread <= k.chunks
        assert units * spread <= max(kc.WAVE_CTAS, units)  # one wave, or one CTA a row


@pytest.mark.parametrize("splits", [1, 2, 7, 30, 45, 48, 96])
@pytest.mark.parametrize("d", [64, 128])
def test_held_rows_are_the_walks_splits_in_its_order(splits, d):
    """`_hold` / `_add_held` (one column chunk, splits <= HELD x groups): group g adds splits
    g, g + groups, ... < splits in order, `_accumulate`'s order (`group_order`); the b1 plans'
    30 (16-bit) and 45 (FP8) splits at D 128 are held. Past the last split with keys the held
    form adds weight-0 splits the walk stops before: + 0, the same sums."""
    k = kc.PagedCombineSm90(d)
    if splits > kc.HELD * k.groups:
        assert d == 128 and splits > 48
        return
    for g in range(k.groups):
        held = [i * k.groups + g for i in range(kc.HELD) if i * k.groups + g < splits]
        assert held == group_order(splits, k.groups, g, kc.UNROLL, kc.SPLIT_CAP)
    assert 30 <= kc.HELD * kc.PagedCombineSm90(128).groups and k.chunks == 1


def _few_schedule(d: int, splits: int, spread: int):
    """`PagedCombineSm90._few` replayed: per (CTA first, warp), the splits its `_few_loads` read
    and the splits its `_few_add` sums add (weight from lane s), per column vector, in order;
    the column vectors it writes."""
    k = kc.PagedCombineSm90(d)
    loads, adds, lanes, written = [], {}, set(), []
    for first in range(spread):
        for warp in range(kc.WARPS):
            chunk = first + warp * spread
            while chunk < k.chunks:
                for lane in range(32):
                    vec = chunk * k.vecs + lane
                    written.append(vec)
                    adds.setdefault(vec, [])
                    for r in range(kc.FEW_ROUNDS):
                        if r and not splits > r * kc.FEW:
                            continue
                        for s in range(kc.FEW):  # `_few_loads` then `_few_add`
                            if vec < d // 4 and r * kc.FEW + s < splits:
                                loads.append(r * kc.FEW + s)
                            lanes.add(r * kc.FEW + s)  # shuffle_sync(w, s0 + s)
                            if r * kc.FEW + s < splits:
                                adds[vec].append(r * kc.FEW + s)
                chunk += spread * kc.WARPS
    return k, loads, adds, lanes, written


@pytest.mark.parametrize("splits", [0, 1, 7, 8, 9, 15, 16])
@pytest.mark.parametrize("spread", [1, 2, 3, 4])
def test_few_rounds_stay_within_the_row(splits, spread):
    """D 512's few-splits path (rows of at most FEW x FEW_ROUNDS splits, 2026-12-04
    next/mla-combine3): every load a split < splits; every column vector written once, its
    splits added once each in split order (the warp form's order); every lane a shuffle reads
    and every split whose LSE a lane reads below 32 (lane s < splits holds split s's weight)."""
    assert kc.FEW * kc.FEW_ROUNDS <= 32  # lane s holds split s's LSE / weight
    k, loads, adds, lanes, written = _few_schedule(512, splits, spread)
    assert k.chunks >= kc.WARPS  # the path's condition at D 512
    assert all(0 <= s < splits for s in loads)
    assert max(lanes) < 32
    assert sorted(written) == list(range(512 // 4))  # each 16-byte column vector once
    for vec, order in adds.items():
        assert order == list(range(splits)), vec


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("d", HEAD_DIMS)
@pytest.mark.parametrize("splits", [1, 2, 7, 128, 300])
def test_the_schedule_gives_the_merge(splits, d, dtype):
    rows, heads = 3, 2
    op, lp = _partials(splits, rows, heads, d)
    out, lse = torch.empty(rows, heads, d, dtype=dtype), torch.empty(rows, heads)
    want, want_lse = torch.empty(rows, heads, d, dtype=torch.float64), torch.empty(rows, heads)
    combine_lanes(op, lp, out, lse)
    combine_splits(op.double(), lp.double(), want, want_lse)
    assert not out.float().isnan().any()
    assert torch.equal(out[-1].float(), torch.zeros(heads, d))  # no keys: 0, LSE -inf
    assert torch.equal(lse[-1], torch.full((heads,), -math.inf))
    assert float((out.double() - want).abs().max()) <= 2**-7 * float(want.abs().max()) + 1e-6
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite].float()).abs().max()) < 1e-4
    if splits == 1:  # weight 1, sum 1: the partial row itself (the direct forms' bits)
        ok = lp[0] > -math.inf
        assert torch.equal(out[ok], op[0][ok].to(dtype))


_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def _compiled(spec, params):
    from forgekernel.runtime.resources import inspect_cubin, sass_text

    with tempfile.TemporaryDirectory() as d:
        cubin = spec.compile(params, f"--keep-cubin --dump-dir {d}").artifacts.CUBIN
        return inspect_cubin(cubin), sass_text(cubin)


def _specs():
    from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA
    from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
    from forgekernel.kernels.attention.paged.sm90 import SPEC as PAGED
    from forgekernel.kernels.attention.paged.sm90 import params_for as paged_params

    return [
        (MLA, mla_params("combine", "bfloat16")),
        (PAGED, paged_params("combine", "float16", 64)),
        (PAGED, paged_params("combine", "bfloat16", 256)),
    ]


@pytest.mark.parametrize("case", range(3))
def test_compiled_combine(case):
    """(cu13, 2026-12-03) 54 registers at D 512 / 256, 61 at D 64 / 128, no spills; the old
    kernel: 26-30, 72 LDG.E (scalar: the splits' LSEs walked three times, 4 columns a thread
    one after another), no vector load. Now 8 LDG.E.128 (the pipeline's first block, then the
    next block in the loop), the weights from shared memory (no MUFU.EX2 in the O loop), 15
    SHFL.BFLY (three warp reductions: the max, the last split with keys (2026-12-04: the O loop
    stops there), the sum). D 512 (2026-12-04, next/combine-few): the few-splits path beside it,
    FEW more 16-byte loads (every split's vector in flight), its two warp reductions (10 more
    SHFL.BFLY) and FEW SHFL.IDX (each split's weight from its lane), still no local memory.
    (2026-12-04, next/mla-combine3) the few path's first FEW loads issued beside its LSE's,
    before its reductions, and a second round of FEW for rows of 9-16 splits: 53 -> 64
    registers at D 512 (the 32 values live across the shuffles; 8 CTAs an SM still), FEW more
    16-byte loads and FEW more SHFL.IDX, the same barriers."""
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    res, sass = _compiled(*_specs()[case])
    ops = Counter(_OP.findall(sass))
    few = case == 0  # MLA's D 512: chunks >= WARPS
    held = case == 1  # D 64: one column chunk, `_hold`'s HELD loads (2026-12-04: 56 -> 78)
    assert res["spill_bytes"] == 0 and res["registers"] <= (80 if held else 64)
    assert ops["LDG.E.128"] == (
        2 * kc.UNROLL + (kc.FEW * kc.FEW_ROUNDS if few else 0) + (kc.HELD if held else 0)
    )
    assert ops["SHFL.BFLY"] == 15 + (10 if few else 0)
    assert ops["SHFL.IDX"] == (kc.FEW * kc.FEW_ROUNDS if few else 0)
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    if few:  # (2026-12-04, next/mla-combine3) every split's vector issued before the shuffles
        assert _loads_beside_the_lse(_OP.findall(sass)) == kc.FEW


def _loads_beside_the_lse(ops: list[str]) -> int:
    """The few-splits path's 16-byte loads issued in the stretch that also issues its LSE's load
    (a scalar LDG.E), from the path's start (the last EXIT or barrier before its first SHFL.IDX:
    the CTA path's code lies before it) to its first shuffle: FEW where the first round goes out
    with the LSE (before 2026-12-04 20:40 none: the O loads waited for the weights' shuffles)."""
    first_idx = ops.index("SHFL.IDX")
    start = max(i for i in range(first_idx) if ops[i] == "EXIT" or ops[i].startswith("BAR"))
    end = next(i for i in range(start, first_idx + 1) if ops[i].startswith("SHFL"))
    window = ops[start:end]
    return window.count("LDG.E.128") if "LDG.E" in window else 0


# CI: the standard combine; "serial" is slow: a candidate ramp (`serial_ramp_params`, the
# bench's variant serial_ramp), no standard configuration's (~0.5 s of an idle CPU, 2026-12-07)
@pytest.mark.parametrize("ramp", ["", pytest.param("serial", marks=pytest.mark.slow)])
def test_held_rows_load_before_the_reductions(ramp):
    """bf16 D 128 (the b1 plans' combine): the HELD 16-byte loads of partial O issue after the
    PDL wait and before the first barrier (the LSE reductions'), not behind them; no spill,
    78 registers or fewer (6 CTAs an SM). The candidate ramp "serial" (the bench's variant
    serial_ramp) is the walk alone: no 16-byte load before the first barrier, 54 registers.
    The trigger of the next pass (PREEXIT) before the wait where held, after it serial."""
    from forgekernel.kernels.attention.paged.sm90 import SPEC as PAGED
    from forgekernel.kernels.attention.paged.sm90 import params_for as paged_params
    from forgekernel.kernels.attention.paged.sm90 import serial_ramp_key
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    params = paged_params("combine", "bfloat16", 128)
    res, sass = _compiled(PAGED, serial_ramp_key(params) if ramp else params)
    lines = [x for x in sass.splitlines() if _OP.search(x)]
    wait = next(i for i, x in enumerate(lines) if "ACQBULK" in x)
    bar = next(i for i, x in enumerate(lines) if "BAR.SYNC" in x)
    early = sum("LDG.E.128" in x for x in lines[wait:bar])
    assert early == (0 if ramp else kc.HELD)
    assert not any("LDG" in x for x in lines[:wait])
    # the next pass scheduled before the wait where held (after it in the serial build)
    trigger = next(i for i, x in enumerate(lines) if "PREEXIT" in x)
    assert (trigger > wait) if ramp else (trigger < wait)
    assert res["spill_bytes"] == 0 and res["registers"] <= (64 if ramp else 78)


@pytest.mark.parametrize("d", [128, 512])
def test_compiled_warp_form(d):
    """The warp form (combine_form.py): no spill, no local memory, one griddepcontrol.wait
    before its first global load, 16-byte loads of partial O (unrolled 4 splits: 4 + the
    remainder's, D / 128 a split), the three warp reductions (15 SHFL.BFLY), no barrier."""
    from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA
    from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
    from forgekernel.kernels.attention.paged.sm90 import SPEC as PAGED
    from forgekernel.kernels.attention.paged.sm90 import params_for as paged_params
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    spec, params = (MLA, mla_params("combine", "bfloat16", warps=True)) if d == 512 else (
        PAGED, paged_params("combine", "bfloat16", d, warps=True))  # fmt: skip
    res, sass = _compiled(spec, params)
    ops = Counter(_OP.findall(sass))
    assert res["spill_bytes"] == 0 and res["registers"] <= 96
    assert ops["LDG.E.128"] >= 4 * (d // 128)
    assert ops["SHFL.BFLY"] == 15 and not any(op.startswith("BAR") for op in ops)
    assert not any(op.startswith(("LDL", "STL")) for op in ops)
    lines = sass.splitlines()
    first_load = next(i for i, x in enumerate(lines) if "LDG" in x)
    assert next(i for i, x in enumerate(lines) if "ACQBULK" in x) < first_load


def test_takes_warps():
    from forgekernel.kernels.attention.paged.sm90 import combine_form as cf

    assert cf.takes_warps(4096, 512) and cf.takes_warps(1024, 128)
    assert not cf.takes_warps(4095, 512) and not cf.takes_warps(2048, 512)
    assert not cf.takes_warps(1023, 128) and not cf.takes_warps(4096, 64)
    with cf.combine_form("cta"):
        assert not cf.takes_warps(4096, 512) and cf.forced() == "cta"
    with cf.combine_form("warps"):
        assert cf.takes_warps(16, 512) and not cf.takes_warps(16, 64)
    assert cf.forced() is None
    with pytest.raises(ValueError, match="form"):
        with cf.combine_form("lanes"):
            pass
