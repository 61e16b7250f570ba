"""Speculative decoding over the paged cache (issue 18, docs/attention/PAGED_NOTES.md
"Speculative decoding at 0.82-0.90x, 18:47"): the plans of the spec bench cases (the probe's
`plan_of`), the page ids read a loop iteration ahead (`PagedDecodeSm90.page_ahead`: the schedule
replayed, and the compiled main loops: no copy waits on a page-table read of its own iteration)
and the 18:47 pass kept as candidate params."""

from __future__ import annotations

import re
from collections import Counter

import pytest
import torch
from cubins import build  # tests/ is on the path
from script_modules import load_script
from sweeps import slow_past

from forgekernel.bench.suites import attention_paged as suite
from forgekernel.kernels.attention.paged.sm90 import SPEC, config
from forgekernel.runtime.resources import find_tool


def _probe():
    return load_script("paged_spec_probe")


def test_spec_bench_plans_are_their_decode_twins():
    """Every spec case streams each KV head's pages from one CTA, at one split (mixed: 2, its
    decode twin's), on its decode twin's grid: the cache is read once, not once per query token
    or head block, so the 18:47 gap is not in the plan."""
    probe = _probe()
    twins = {c.name: c for c in suite.DECODE_BENCH_CASES}
    for case in suite.SPEC_BENCH_CASES:
        p = probe.plan_of(case)
        assert p["ctas_per_kv_page"] == 1, case.name
        assert p["splits"] == (2 if "mixed" in case.name else 1), case.name
        twin = twins.get(case.name.rsplit("-", 1)[0])
        if twin is not None:
            t = probe.plan_of(twin)
            assert (p["ctas"], p["splits"], p["kv_bytes_per_cta"]) == (
                t["ctas"], t["splits"], t["kv_bytes_per_cta"]
            ), case.name  # fmt: skip
    b64 = probe.plan_of(suite.SPEC_BENCH_CASES[0])  # b64 x 4k x sq2: 4 heads x 2 tokens
    assert (b64["heads"], b64["rows"], b64["ctas"], b64["kv_bytes_per_cta"]) == (4, 8, 512, 2 << 20)
    hq64 = probe.plan_of(suite.SPEC_BENCH_CASES[5])  # 64 / 8 heads x sq4: two row blocks
    assert (hq64["heads"], hq64["rows"], hq64["row_blocks"], hq64["ctas"]) == (8, 32, 2, 256)


SPLITS = [(4096, 4096, 0), (700, 256, 2), (33, 40, 0), (130, 64, 1), (64, 64, 0), (65, 4096, 0)]


@pytest.mark.parametrize("page_size", [1, 16, 64, 48])
@pytest.mark.parametrize(("sk", "per", "split"), SPLITS)
@pytest.mark.parametrize("stages", [3, 4])
def test_page_ahead_schedule(page_size, sk, per, split, stages):
    """The kernel's order replayed (16-bit cache, TILE keys a tile, a thread's rows r + 8 m):
    the prologue's S - 1 tiles read their page ids inline, then tile S - 1's ids are read, and
    iteration i copies tile i + S - 1 with the ids read before it and reads tile i + S's. Every
    tile's copies get their own tokens' pages, and no read leaves the sequence's pages (tokens
    clamped to t1 - 1, past the last tile too)."""
    tile, rows = config.TILE, 8
    t0 = split * per
    t1 = min(t0 + per, sk)
    tiles = -(-max(t1 - t0, 0) // tile)
    table = list(range(100, 100 + -(-sk // page_size)))  # page ids; reading past raises
    reads = []

    def ids(first, r):
        out = []
        for m in range(rows):
            token = min(first + r + 8 * m, t1 - 1)
            assert 0 <= token < sk
            reads.append(token // page_size)
            out.append(table[token // page_size])
        return out

    for r in (0, 3, 7):
        copies = {}
        for s in range(stages - 1):
            if s < tiles:
                copies[s] = ids(t0 + s * tile, r)
        ahead = ids(t0 + (stages - 1) * tile, r) if stages - 1 < tiles else None
        for i in range(tiles):
            nxt = i + stages - 1
            if nxt < tiles:
                copies[nxt] = ahead
                ahead = ids(t0 + (nxt + 1) * tile, r)
        assert sorted(copies) == list(range(tiles))
        for n, got in copies.items():
            want = [table[min(t0 + n * tile + r + 8 * m, t1 - 1) // page_size] for m in range(rows)]
            assert got == want, (n, r)
    assert all(0 <= p < len(table) for p in reads)


EARLY = [(16384, 16384, 30, 256), (65536, 65536, 30, 256), (4096, 131072, 4, 256),
         (4096, 4096, 1, 4096), (65, 4096, 1, 4096), (700, 4096, 8, 256), (33, 64, 2, 256),
         (0, 64, 2, 256), (300, 300, 3, 256), (1000, 1024, 8, 256)]  # fmt: skip


@pytest.mark.parametrize("page_size", [1, 16, 48])
@pytest.mark.parametrize(("sk", "width", "splits", "per_split"), EARLY)
@pytest.mark.parametrize("stages", [3, 4])
def test_early_ids_schedule(page_size, sk, width, splits, per_split, stages):
    """The 16-bit pass's prologue since 2026-12-04 (`PagedDecodeSm90.early_ids`) replayed: the
    first STAGES tiles' ids of the split the table's width gives (`_guess_ids`: per_w =
    max(per_split, ceil(width / splits)), tokens clamped to t1_w - 1, nothing read where the
    split is empty), issued with the length's read, kept where the sequence's own split is that
    one (per and t1 equal), else read again, all STAGES tiles at once; then the loop as
    `test_page_ahead_schedule`'s. Every tile's copies get their own tokens' pages (never a
    table entry past the sequence: those hold garbage here), and every read is inside the
    table. The b1 bench cases (a table as wide as the sequence) keep the guess on every split."""
    tile, rows = config.TILE, 8
    pages = -(-width // page_size)
    table = [100 + p if p * page_size < sk else -1 for p in range(pages)]  # -1: garbage
    kept_all = True
    for split in range(splits):
        per_w = max(per_split, -(-width // splits))
        t0_w, t1_w = split * per_w, min(split * per_w + per_w, width)
        per = max(per_split, -(-sk // splits))
        t0, t1 = split * per, min(split * per + per, sk)
        tiles = -(-max(t1 - t0, 0) // tile)
        kept = per == per_w and t1 == t1_w
        kept_all &= kept or tiles == 0
        for r in (0, 3, 7):
            ids = {}
            for s in range(stages):
                if t0_w < t1_w:
                    tokens = [min(t0_w + s * tile + r + 8 * m, t1_w - 1) for m in range(rows)]
                    assert all(0 <= t < width for t in tokens)
                    ids[s] = [table[t // page_size] for t in tokens]
            if not kept:
                for s in range(stages):
                    if s < tiles:
                        tokens = [min(t0 + s * tile + r + 8 * m, t1 - 1) for m in range(rows)]
                        assert all(0 <= t < sk for t in tokens)
                        ids[s] = [table[t // page_size] for t in tokens]
            copies = {s: ids[s] for s in range(stages - 1) if s < tiles}
            # `_prefetch_guess`: the rows of the guessed split's first STAGES - 1 tiles, ids
            # clamped into the cache; kept, they are the first copies' rows
            prefetched = {table[t // page_size]
                          for t in range(t0_w, min(t0_w + (stages - 1) * tile, t1_w))}  # fmt: skip
            if kept:
                assert {p for s in copies for p in copies[s]} <= prefetched
            ahead = ids.get(stages - 1)
            for i in range(tiles):
                nxt = i + stages - 1
                if nxt < tiles:
                    copies[nxt] = ahead
                    first = t0 + (nxt + 1) * tile
                    ahead = [table[min(first + r + 8 * m, t1 - 1) // page_size]
                             for m in range(rows)]  # fmt: skip
            assert sorted(copies) == list(range(tiles))
            for n, got in copies.items():
                want = [table[min(t0 + n * tile + r + 8 * m, t1 - 1) // page_size]
                        for m in range(rows)]  # fmt: skip
                assert got == want and -1 not in got, (split, n, r)
    if sk == width and per_split <= -(-width // splits):
        assert kept_all  # a sequence that fills its table: no split reads its ids twice


@pytest.mark.parametrize("ramp", slow_past(["", "serial"]))  # CI: the standard build
def test_early_ids_in_the_sass(ramp):
    """bf16 D 128, 4 heads (the b1 / b4 / b64 bench cases' pass): after the wait the length's
    load, then the STAGES x 8 guessed page-table loads, all before the length's first use,
    `after`'s VIMNMX (made to depend on a guessed load: left alone, ptxas put the length's
    first use after two of them and the warp waited there), before the first cp.async copy;
    before the wait the five L2 prefetches; 254 registers, no local memory. The candidate ramp
    "serial" (the bench's variant serial_ramp) prefetches nothing."""
    from forgekernel.kernels.attention.paged.sm90 import serial_ramp_key

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    params = config.params_for("partial", "bfloat16", 128, 4)
    found = build(SPEC, serial_ramp_key(params) if ramp else params)
    ins = [t.strip() for _, t in _INS.findall(found.sass)]
    assert found.resources["spill_bytes"] == 0 and found.resources["registers"] <= 255
    assert not any(t.split()[0].startswith(("LDL", "STL")) for t in ins)
    copy = next(i for i, t in enumerate(ins) if "LDGSTS" in t)
    wait = next(i for i, t in enumerate(ins) if "ACQBULK" in t)
    loads = [i for i, t in enumerate(ins) if re.search(r"\bLDG\.E\b", t) and i > wait]
    prefetches = [i for i, t in enumerate(ins) if "CCTL.E.PF2" in t]
    if ramp:
        assert not prefetches
        return
    # before the wait (`_prefetch_guess`): the length's line, two lines each of K and V
    assert len(prefetches) == 5 and max(prefetches) < wait
    # `after`: the length's register through max(length, last id | 0x80000000), its first use
    length = re.search(r"LDG\.E (R\d+),", ins[loads[0]]).group(1)
    first_use = next(
        i for i in range(loads[0] + 1, len(ins)) if re.search(rf"\b{length}\b", ins[i])
    )
    assert re.match(rf"VIMNMX {length}, {length}, R\d+, !PT", ins[first_use])
    early = [i for i in loads if i < first_use]
    assert len(early) == 1 + config.STAGES[128] * 8 and first_use < copy


def test_candidates_are_standard_leaves_with_one_knob():
    """The candidate params: the bf16 D 128 standard leaves with page_ids "inline" (compile.py:
    `PagedDecodeSm90(page_ahead=False)`, the 18:47 pass), one per standard leaf. The
    speculative leaves (2 / 4 query tokens) with merge "rows" (`merge_rows`, the launcher's
    default on them since 2026-12-04 04:39) are standard builds beside the same leaves without
    it (the bench's variant `merge_elems`, the chunked-prefill decode rows). The builds without
    PDL of the variant `no_pdl` (`no_pdl_params`, tests/test_pdl.py) and the serial ramp of the
    variant `serial_ramp` (`serial_ramp_params`: ramp "serial") are the others."""
    from forgekernel.kernels.attention.paged.sm90 import (
        merge_rows_params,
        no_pdl_params,
        serial_ramp_params,
    )

    standard = set(SPEC.standard_params())
    cands = SPEC.candidate_params()
    assert cands and len(set(cands)) == len(cands) and not standard & set(cands)
    assert set(no_pdl_params()) <= set(cands) and set(serial_ramp_params()) <= set(cands)
    for c in serial_ramp_params():  # a standard leaf with the one knob ramp "serial"
        d = dict(c)
        assert d.pop("ramp") == "serial" and tuple(sorted(d.items())) in standard
    inline = set()
    others = set(no_pdl_params()) | set(serial_ramp_params())
    for c in (c for c in cands if c not in others):
        d = dict(c)
        assert d.pop("page_ids") == "inline"
        assert (d["dtype"], d["head_dim"]) == ("bfloat16", 128)
        assert tuple(sorted(d.items())) in standard
        inline.add(tuple(sorted(d.items())))
    wanted = {config.params_for("partial", "bfloat16", 128, h, "", q)
              for h, q in ((4, 1), (4, 2), (4, 4), (8, 2), (8, 4), (8, 1))}  # fmt: skip
    assert wanted <= inline
    rows = set(merge_rows_params())
    assert len(rows) == 9 and rows <= standard
    bare = set()
    for p in rows:
        d = dict(p)
        assert d.pop("merge") == "rows" and d.get("qtokens", 1) > 1
        assert (d["dtype"], d["head_dim"], d.get("kv", "")) == ("bfloat16", 128, "")
        bare.add(tuple(sorted(d.items())))
    assert bare <= standard
    assert {w for w in wanted if dict(w).get("qtokens", 1) > 1} <= bare


_INS = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(.*?);")


def _main_loop_loads(sass: str) -> str:
    """The main loop's global loads in issue order, 'G' a page-table read (LDG), 'S' a
    cp.async copy (LDGSTS): the backward branch whose body holds the HMMAs, out-of-line blocks
    it branches to (the 18:47 loads) spliced in where it branches."""
    ins = [(int(a, 16), t.strip()) for a, t in _INS.findall(sass)]
    at = {a: i for i, (a, _) in enumerate(ins)}

    def target(t):
        m = re.search(r"BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", t)
        return int(m.group(1), 16) if m else None

    loops = []
    for i, (a, t) in enumerate(ins):
        tgt = target(t) if "BRA" in t else None
        if tgt is not None and tgt < a and tgt in at:
            body = range(at[tgt], i + 1)
            if sum("HMMA" in ins[j][1] for j in body) and any("BAR.SYNC" in ins[j][1]
                                                                for j in body):  # fmt: skip
                loops.append(body)
    body = max(loops, key=len)
    lo, hi = ins[body[0]][0], ins[body[-1]][0]
    seq = []

    def emit(t):
        op = re.sub(r"^@!?U?P\w+\s+", "", t).split()[0]
        if op.startswith("LDGSTS"):
            seq.append("S")
        elif op.startswith("LDG."):
            seq.append("G")

    for j in body:
        t = ins[j][1]
        emit(t)
        tgt = target(t) if "BRA" in t else None
        if tgt is not None and not lo <= tgt <= hi and tgt in at:  # an out-of-line block
            k = at[tgt]
            while True:
                emit(ins[k][1])
                if "BRA" in ins[k][1] and not ins[k][1].startswith("@"):
                    break
                k += 1
    return "".join(seq)


def _compile_sass(params: dict) -> tuple[str, dict]:
    """(SASS, resources) of the leaf's compile (SPEC.compile: compile_paged for sm_90a), once a
    process (cubins.build): the merge test's standard leaves are the main-loop test's."""
    found = build(SPEC, tuple(sorted(params.items())))
    return found.sass, found.resources


LEAVES = [(128, 4, 1), (128, 4, 2), (128, 4, 4), (128, 8, 2), (128, 8, 4), (64, 4, 4)]


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
# CI: the 4-head decode leaf (test_early_ids_in_the_sass's build); the other leaves are slow
@pytest.mark.parametrize(("d", "heads", "qtokens"), slow_past(LEAVES, unpack=True))
def test_main_loop_copies_wait_on_no_page_read_of_their_iteration(d, heads, qtokens):
    """Compiled (sm_90a), page ids ahead: the main loop issues its tile's 16-byte copies (2 a
    row: K and V) before any page-table read, and reads the next tile's ids after them, one per
    row; registers within the plan's residency (RESIDENT CTAs an SM: 255 at D 128, 170 at D 64),
    no spill. The 18:47 pass of the 4 x 2 leaf (page_ids inline) read its ids in two dependent
    rounds beside the copies (G+ S+ G+ S+); compiled since with the D 128 residency told to
    ptxas (254 registers where it held 168), it reads all of them first, in one round."""
    pytest.importorskip("cutlass.cute")
    params = {"kind": "partial", "dtype": "bfloat16", "head_dim": d, "heads": heads}
    if qtokens > 1:
        params["qtokens"] = qtokens
    sass, res = _compile_sass(params)
    rows = config.TILE * d // 8 // config.THREADS
    assert _main_loop_loads(sass) == "S" * (2 * rows) + "G" * rows
    assert res["spill_bytes"] == 0
    assert res["registers"] <= min(255, 65536 // (config.THREADS * config.RESIDENT[d]))
    if (d, heads, qtokens) == (128, 4, 2):
        old, _ = _compile_sass(params | {"page_ids": "inline"})
        loads = _main_loop_loads(old)
        assert loads == "G" * rows + "S" * (2 * rows), loads


@pytest.mark.parametrize("q_lens", [(2, 1, 2), (4, 3, 4, 1)])
def test_probe_runs_on_the_stand_ins(monkeypatch, q_lens):
    """scripts/paged_spec_probe.py's case (the op, the inline mirror, the decode twins, the
    checks) on the CPU stand-ins of the paged decode (test_attention_paged's), the timers
    replaced by one call each: ours matches the reference, the inline pass (its candidate
    params looked up through the launcher) and the mirror launch equal the op bitwise, and the
    decode twin matches its reference."""
    from test_attention_paged import install_cpu_decode

    from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
    from forgekernel.runtime.timing import Samples

    calls = install_cpu_decode(monkeypatch)
    probe = _probe()

    def one_call(fns, rotate, **_):
        return {name: Samples([(fn(*rotate[0]), 1.0)[1]], method="cpu") for name, fn in
                fns.items()}  # fmt: skip

    monkeypatch.setattr(probe, "time_interleaved", one_call)
    monkeypatch.setattr(probe, "time_eager_flushed", one_call)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(suite, "comparators", lambda: {"flashinfer": None})
    lens = (40, 300, 77, 129)[: len(q_lens)]
    case = suite._case(len(q_lens), 8, 2, 128, 16, lens, q_lens=q_lens, group="spec")
    args = type("Args", (), {"fa3": False, "fa4": False, "preroll": False})
    try:
        r = probe.run_case(case, args, torch.device("cpu"))
    finally:
        paged_launch._plans.clear()
    assert set(r["graph"]) == {"ours", "inline", "decode", "decode_inline"}
    checks = r["checks"]
    assert checks["ours_max_err"] < 2e-2 and checks["ours_finite"]
    assert checks["inline_bitwise_ours"] and checks["mirror_bitwise_ours"]
    assert checks["decode_max_err"] < 2e-2 and checks["decode_inline_bitwise"]
    assert any(dict(p).get("page_ids") == "inline" for p, _, _ in calls)
    probe._report(r)  # the printout runs on these fields


def test_merge_params_pick_the_candidate_leaf():
    """launch.merge_params: "" keeps the per-element compile key, "rows" adds merge "rows" (a
    standard key of every spec leaf the bench times), anything else raises; `merge_rows` (the
    launcher's default) says "rows" on exactly the bf16 D 128 16-bit speculative leaves."""
    from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
    from forgekernel.kernels.attention.paged.sm90 import merge_rows, merge_rows_params

    p = config.params_for("partial", "bfloat16", 128, 4, "", 4)
    assert paged_launch.merge_params(p) == p
    rows = paged_launch.merge_params(p, "rows")
    assert dict(rows) == {**dict(p), "merge": "rows"} and rows in merge_rows_params()
    with pytest.raises(ValueError):
        paged_launch.merge_params(p, "vector")
    for case in suite.SPEC_BENCH_CASES:
        plan = _probe().plan_of(case)
        leaf = config.params_for("partial", "bfloat16", 128, plan["heads"], "",
                                 _probe().qtokens_of(case))  # fmt: skip
        assert paged_launch.merge_params(leaf, "rows") in merge_rows_params(), case.name
    assert merge_rows("bfloat16", 128, "", 2) and merge_rows("bfloat16", 128, "", 4)
    for args in (("bfloat16", 128, "", 1), ("float16", 128, "", 4), ("bfloat16", 64, "", 4),
                 ("bfloat16", 256, "", 2), ("bfloat16", 128, "float8_e4m3fn", 4)):  # fmt: skip
        assert not merge_rows(*args), args


def test_merge_elems_variant_on_the_stand_ins(monkeypatch):
    """The op on a spec case looks up the merge "rows" leaf (the default), the bench's spec
    variant `merge_elems` the same leaf without it, on the same plan, and both write the same
    outputs (the CPU stand-ins of test_attention_paged share one arithmetic); single-token
    decode and the chunked-prefill decode rows keep the per-element merge."""
    from test_attention_paged import install_cpu_decode, op_module

    from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch

    calls = install_cpu_decode(monkeypatch)
    case = suite._case(3, 8, 2, 128, 16, (40, 300, 77), q_lens=(2, 4, 1), group="spec")
    assert set(suite.variants(case)) == {"merge_elems"}
    try:
        inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                   torch.Generator().manual_seed(0))  # fmt: skip
        want = suite.run_ours(inputs, suite.alloc_out(inputs))
        got = suite.variants(case)["merge_elems"](inputs, suite.alloc_out(inputs))
        decode = suite._case(3, 8, 2, 128, 16, (40, 300, 77))
        # the width plan (plain: these stand-ins replay no scheduling kernel)
        one = suite.make_inputs(decode, torch.bfloat16, torch.device("cpu"),
                                torch.Generator().manual_seed(0))  # fmt: skip
        suite.run_ours(one, None, plain=True)
        i = inputs
        o, lse = suite.alloc_out(i)
        op_module._decode_part(i["q"], i["k"], i["v"], i["table"], i["seqlens"],
                               i["cu_seqlens_q"], 128**-0.5, True, o, lse)  # fmt: skip
    finally:
        paged_launch._plans.clear()
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(o, want[0]) and torch.equal(lse, want[1])
    (ours, _, _), (elems, _, _), (single, _, _), (part, _, _) = calls
    assert ours == {**elems, "merge": "rows"} and "merge" not in elems
    assert "merge" not in single and single.get("qtokens", 1) == 1
    assert part == elems  # the chunked-prefill decode rows: the per-element merge


def _loop_ops(sass: str) -> list[str]:
    """The opcodes of the main loop (the longest backward branch's body)."""
    ins = [(int(a, 16), t.strip()) for a, t in _INS.findall(sass)]
    spans = []
    for a, t in ins:
        m = re.search(r"BRA\s+(?:!?U?P\w+,\s*)?0x([0-9a-f]+)", t)
        if m and int(m.group(1), 16) < a:
            spans.append((int(m.group(1), 16), a))
    lo, hi = max(spans, key=lambda s: s[1] - s[0])
    return [
        re.sub(r"^@!?U?P\w+\s+", "", t).split()[0].split(".")[0] for a, t in ins if lo <= a <= hi
    ]


@pytest.mark.skipif(find_tool("nvdisasm") is None, reason="cuobjdump/nvdisasm not installed")
@pytest.mark.parametrize(("heads", "qtokens"), slow_past([(4, 2), (4, 4), (8, 2), (8, 4)],
                                                          unpack=True))  # fmt: skip
def test_merge_rows_compiles_within_the_residency(heads, qtokens):
    """Compiled (sm_90a), the merge candidate of the spec leaves the bench runs: registers
    within 2 CTAs an SM, no spill, the main loop the standard leaf's work (the same MMA,
    shared / global memory, MUFU, FP32, shuffle and barrier instructions, the total within 1%:
    624 / 632 / 632 / 851 standard, ptxas orders them a little differently and saved one
    UIADD3 at 8 x 4), and no exponent, logarithm or division per output element: fewer MUFUs
    than the standard leaf's."""
    pytest.importorskip("cutlass.cute")
    params = {"kind": "partial", "dtype": "bfloat16", "head_dim": 128, "heads": heads,
              "qtokens": qtokens}  # fmt: skip
    std, _ = _compile_sass(params)
    sass, res = _compile_sass(params | {"merge": "rows"})
    assert res["spill_bytes"] == 0
    assert res["registers"] <= 65536 // (config.THREADS * config.RESIDENT[128])
    ops, std_ops = Counter(_loop_ops(sass)), Counter(_loop_ops(std))
    for op in ("HMMA", "LDSM", "LDS", "LDGSTS", "LDG", "MUFU", "FFMA", "FMUL", "SHFL", "BAR"):
        assert ops[op] == std_ops[op], op
    assert abs(ops.total() - std_ops.total()) <= 0.01 * std_ops.total()
    assert res["sass"].get("MUFU", 0) < _compile_sass_mufu(std)


def _compile_sass_mufu(sass: str) -> int:
    return sum(1 for _, t in _INS.findall(sass) if re.sub(r"^@!?U?P\w+\s+", "", t.strip())
               .startswith("MUFU"))  # fmt: skip


@pytest.mark.parametrize("name", suite.SERIAL_RAMP_CASES)
def test_serial_ramp_variant_takes_prebuilt_keys(monkeypatch, name):
    """The bench's variant `serial_ramp` on its cases (all in the suite, the variant listed):
    inside `launch.serial_ramp()` the plans launch the standard keys with ramp "serial" (the
    width plan's and, for the step's schedule, the ranges pass and combine; a warp-form
    combine, which holds no rows, stays standard), each a prebuilt candidate."""
    from forgekernel.kernels.attention.paged.sm90 import launch, serial_ramp_key

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: params)
    case = next(c for c in suite.BENCH_CASES if c.name == name)
    assert "serial_ramp" in suite.variants(case)
    b, n = case.params["b"], case.params["lens"][0]
    bf16 = torch.bfloat16
    standard, cands = set(SPEC.standard_params()), set(SPEC.candidate_params())
    for scheduled in (False, True):
        plain = launch._plan(bf16, bf16, b, 32, 8, 128, n, 1, 0, False, None, None, scheduled)
        serial = launch._plan(bf16, bf16, b, 32, 8, 128, n, 1, 0, False, None, None, scheduled,
                              True)  # fmt: skip
        for key, ramp in zip(plain[:2], serial[:2]):
            if key is None:
                assert ramp is None
                continue
            assert key in standard and ramp in cands | standard
            warps = dict(key).get("form") == "warps"
            assert ramp == (key if warps else serial_ramp_key(key))
