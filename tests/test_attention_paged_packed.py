"""The whole chunked-prefill batch in one GQA-packed launch of the forward's paged mode on views
of q / out / lse (`launch.attention_paged_fwd(packed=True)`, `ops.attention_paged.prefill_form(
"packed_views")`, the op's default since 2026-12-04 where the batch's G has a compile,
`launch.view_group`; else the split), on the CPU (the GPU's checks: tests/gpu/
test_paged_packed_gpu.py). The pack index map; the launcher's arguments to the packed compile
(views of q / out / lse themselves, qgroup G, offsets and the longest length x G); the
replayed kernel (tests/test_attention_paged_prefill.py, its mask on row // qgroup) through the
real op against the fp64 reference on mixed batches (decode rows of 1-4 tokens beside chunks,
sequences without queries or keys, more queries than keys, pages 8-256, D 64 / 128 / 256, G 1
/ 3 (the split) / 4 / 8, both 16-bit dtypes, NaN-poisoned outputs and unowned cache slots);
the compile keys (every key the op looks up standard); the bench's `split` variant; the packed
order's balance on the bench's prefill batches; the DSL's own reading of the views."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from test_attention_paged_prefill import (  # tests/ is on the path
    check_in_place_batch,
    cpu_paged_kernel,  # noqa: F401  (a fixture)
    cta_key_blocks,
    key_blocks,
    prefill_problem,
    tile_of,
)

from forgekernel.bench.suites import attention_paged as suite_module
from forgekernel.bench.suites.attention_paged import PREFILL_BENCH_CASES, _prefill_case
from forgekernel.kernels.attention.fwd.sm90 import SPEC
from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_launch
from forgekernel.kernels.attention.fwd.sm90.config import (
    PAGED_HEAD_DIMS,
    PAGED_MIN_SEQLEN_Q,
    VIEW_GROUPS,
    AttnConfig,
    default_config,
    params_for,
)
from forgekernel.reference.paged_attention import paged_attention_ref

op_module = importlib.import_module("forgekernel.ops.attention_paged")


# ------------------------------------------------------------------ the index maps
@pytest.mark.parametrize(
    ("tq", "hkv", "group", "d"), [(1, 1, 1, 64), (7, 2, 4, 128), (1000, 8, 8, 64), (5, 3, 3, 256)]
)
def test_pack_puts_query_head_h_g_of_token_t_on_row_t_g_of_head_h(tq, hkv, group, d):
    """pack_gqa_q on the packed varlen q (one batch): row t * G + g of kv head h is query head
    h * G + g of token t, bit for bit, a compact copy."""
    q = torch.randn(tq, hkv * group, d).to(torch.bfloat16)
    qp = fwd_launch.pack_gqa_q(q[None], group)[0]
    assert qp.shape == (tq * group, hkv, d) and qp.is_contiguous()
    t, h, g = tq - 1, hkv - 1, group - 1
    assert torch.equal(qp[t * group + g, h], q[t, h * group + g])
    want = torch.stack([q[:, h * group : (h + 1) * group] for h in range(hkv)], dim=2)
    assert torch.equal(qp, want.reshape(tq * group, hkv, d))  # (t, g, h) row-major


# ------------------------------------------------------------------ the launcher
def test_packed_launch_without_pages_or_rows(monkeypatch):
    """No pages: every row 0 / -inf, decode rows included (no sequence is another kernel's);
    no rows: nothing runs or is written."""
    monkeypatch.setattr(fwd_launch, "get_kernel", lambda *a: pytest.fail("no launch"))
    monkeypatch.setattr(fwd_launch, "_plans", type(fwd_launch._plans)())
    q = torch.randn(1 + 6, 8, 128).to(torch.bfloat16)
    k = torch.empty(0, 16, 2, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(2, 1, dtype=torch.int32), torch.zeros(2, dtype=torch.int32)
    cu = torch.tensor([0, 1, 7], dtype=torch.int32)
    o, lse = torch.full_like(q, math.nan), torch.full((8, 7), math.nan)
    fwd_launch.attention_paged_fwd(q, k, k, o, lse, table, lens, cu, 6, 0.1, True, packed=True)
    assert not o.isnan().any() and not o.any() and (lse == -math.inf).all()
    empty = q[:0]
    fwd_launch.attention_paged_fwd(empty, k, k, empty, lse[:, :0], table, lens, cu * 0, 0, 0.1,
                                   True, packed=True)  # fmt: skip


# ------------------------------------------------------------------ the whole batch
MIXED = [
    # hq, hkv, d, page_size, q_lens, k_lens: decode rows (1-4 tokens) beside chunks, sequences
    # without queries or keys, more queries than keys, a fresh prompt (queries = keys)
    (8, 2, 128, 16, [1, 3, 0, 200, 4, 1, 5], [40, 300, 9, 257, 4, 0, 7]),
    (6, 2, 64, 32, [2, 130, 1], [2, 385, 1000]),  # G 3: 390-row packed chunk, odd rows a token
    (4, 1, 256, 128, [70, 1, 6, 4], [190, 129, 6, 3]),  # G 4, 64-key tiles, 64-row boxes
    (8, 8, 128, 64, [150, 1, 1], [150, 100, 65]),  # MHA (G 1): the packed form is the plain one
    (16, 2, 64, 8, [0, 2, 1, 9, 3, 0], [50, 600, 5, 700, 33, 70]),  # G 8: 8-row pages
    (32, 4, 128, 256, [1, 40, 3, 2], [700, 300, 129, 1]),  # G 8, two key tiles a page
    (8, 2, 128, 16, [40, 6], [20, 3]),  # more queries than keys: rows that see none
    (8, 2, 128, 16, [3, 1, 5], [100, 17, 5]),  # decode rows and the shortest forward sequence
    (4, 2, 256, 16, [1, 70, 4], [300, 90, 5]),  # G 2
    (32, 2, 64, 32, [2, 1, 20, 0], [65, 700, 20, 3]),  # G 16: 320-row chunk, 192-row tiles
    (24, 4, 64, 16, [1, 30], [40, 35]),  # G 6 at D 64: divides the tile, no compile: split
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(MIXED)))
def test_default_batch_matches_the_reference(cpu_paged_kernel, case, causal, dtype):  # noqa: F811
    """The default form: one launch of the packed compile on views of q, out and lse over
    every sequence (none to the decode kernel) where the batch's G has one (`view_group`: G 1
    / 2 / 4 / 8 / 16 here), else the split (G 3, 6: the decode kernel, then the split's
    compile; never the copies); every row of the NaN-poisoned out and lse written, the batch
    matching the fp64 reference."""
    hq, hkv, d, ps, q_lens, k_lens = MIXED[case]
    problem = prefill_problem(hq, hkv, d, ps, q_lens, k_lens, seed=case, dtype=dtype)
    out, finite = check_in_place_batch(problem, max(q_lens), causal)
    assert not out[~finite.T].any()
    [params] = cpu_paged_kernel
    g = fwd_launch.view_group(hq // hkv, d)
    assert params["causal"] == causal and params.get("view_group", 0) == g
    assert params.get("packed", False) == (g > 0) and (cpu_paged_kernel.decode == []) == (g > 0)
    assert g or hq // hkv in (3, 6)  # the split cases
    ran = [b for b, n in enumerate(q_lens) if n >= (1 if g else PAGED_MIN_SEQLEN_Q)]
    assert cpu_paged_kernel.ran == ran
    assert op_module._prefill_form == ["packed_views"]
    assert tuple(sorted(params.items())) in STANDARD


def test_packed_batch_through_the_registered_op(cpu_paged_kernel):  # noqa: F811
    """The traced path's custom op reads the form when it runs: the packed launch alone by
    default, the split under prefill_form("split")."""
    q, k, v, table, lens, cu = prefill_problem(8, 2, 128, 16, [1, 40, 3, 0], [70, 60, 33, 5])
    out, lse = torch.ops.forgekernel.attention_paged_prefill(q, k, v, table, lens, cu, 40,
                                                             128**-0.5, True)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, lens, cu_seqlens_q=cu)
    assert float((out.float() - want).abs().max()) < 2e-2
    assert float((lse - want_lse).abs().max()) < 1e-4
    assert cpu_paged_kernel.ran == [0, 1, 2] and cpu_paged_kernel.decode == []
    assert cpu_paged_kernel[-1]["view_group"] == 4
    with op_module.prefill_form("split"):
        out, lse = torch.ops.forgekernel.attention_paged_prefill(q, k, v, table, lens, cu, 40,
                                                                 128**-0.5, True)  # fmt: skip
    assert float((out.float() - want).abs().max()) < 2e-2
    assert cpu_paged_kernel.ran[3:] == [1] and len(cpu_paged_kernel.decode) == 1
    assert "packed" not in cpu_paged_kernel[-1]


def test_prefill_form_is_checked_and_restored():
    """Two forms: the packed default and the split; the copy form ("packed") is gone."""
    assert op_module.PREFILL_FORMS == ("packed_views", "split")
    for bad in ("fused", "packed"):
        with pytest.raises(ValueError, match="prefill form"):
            with op_module.prefill_form(bad):
                pass
    with pytest.raises(RuntimeError):
        with op_module.prefill_form("split"):
            assert op_module._prefill_form == ["split"]
            raise RuntimeError
    assert op_module._prefill_form == ["packed_views"]


@pytest.mark.parametrize(("hq", "hkv", "d"), [(12, 4, 128), (6, 1, 64), (20, 4, 256), (32, 1, 128)])
def test_groups_without_a_packed_compile_run_the_split(cpu_paged_kernel, hq, hkv, d):  # noqa: F811
    """G 3 (D 128), 6 (D 64: it divides the 192-row tile but has no compile), 5, 32: the split
    (the decode kernel, then the split's standard compile), no lookup outside the standard
    set, the reference's numbers."""
    q, k, v, table, lens, cu = prefill_problem(hq, hkv, d, 16, [1, 40, 3], [70, 60, 33])
    out, lse = op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=40,
                                         return_lse=True)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, lens, cu_seqlens_q=cu)
    assert float((out.float() - want).abs().max()) < 2e-2
    assert float((lse - want_lse).abs().max()) < 1e-4
    [params] = cpu_paged_kernel
    assert "packed" not in params and len(cpu_paged_kernel.decode) == 1
    assert tuple(sorted(params.items())) in STANDARD


# ------------------------------------------------------------------ compile keys
STANDARD = set(SPEC.standard_params())


def test_packed_keys_leave_every_other_key_as_it_was():
    """A key gains `packed` and `view_group` only when on (every split key, cache entry and
    SASS stays): the paged split's D 128 page-16 key is the frozen tuple of before (less the
    `o_direct` field, dropped 2026-12-05); each
    standard paged split key has a packed twin for every G of VIEW_GROUPS dividing its tile's
    rows, differing by those entries alone; packed needs the paged mode and a view_group (the
    copy form is gone)."""
    before = (("causal", True), ("dtype", "bfloat16"), ("head_dim", 128), ("head_dim_v", 128),
              ("l2_kv_mib", 24), ("late_rescale", True), ("page_box", 16), ("snake", False),
              ("stages", 2), ("tile_m", 128), ("tile_n", 128), ("varlen", True))  # fmt: skip
    assert params_for("bfloat16", 128, 128, True, varlen=True, page_box=16) == before
    std = [dict(p) for p in SPEC.standard_params()]
    paged = [p for p in std if p["page_box"] and "packed" not in p]
    packed = [p for p in std if "packed" in p]
    assert packed and all(p["packed"] is True and p["view_group"] for p in packed)
    twins = sorted(
        tuple(sorted({**p, "packed": True, "view_group": g}.items()))
        for p in paged
        for g in VIEW_GROUPS
        if p["tile_m"] % g == 0
    )
    assert twins == sorted(tuple(sorted(p.items())) for p in packed)
    assert len(packed) == len(VIEW_GROUPS) * len(paged) == 5 * 56
    assert not any("packed" in p for p in std if not p["page_box"])
    with pytest.raises(ValueError, match="paged"):
        params_for("bfloat16", 128, 128, True, varlen=True, packed=True, view_group=4)
    with pytest.raises(ValueError, match="view_group"):
        params_for("bfloat16", 128, 128, True, varlen=True, page_box=16, packed=True)


def test_every_packed_lookup_is_standard():
    """No call JIT-compiles: for every G 1 .. 64, paged head dim, dtype, mask and page size 8
    .. 512 the key the op would look up (the packed one where `view_group` gives G, else the
    split's) is in the standard set (a page of 48 has no box: the gather path)."""
    for d in PAGED_HEAD_DIMS:
        for group in range(1, 65):
            g = fwd_launch.view_group(group, d)
            assert g in (0, group) and (g > 0) == (group in VIEW_GROUPS)
            for page in (8, 16, 32, 48, 64, 128, 256, 512):
                box = fwd_launch.paged_box(page, d)
                if not box:
                    continue
                for dtype in ("bfloat16", "float16"):
                    for causal in (False, True):
                        key = params_for(dtype, d, d, causal, varlen=True, page_box=box,
                                         packed=g > 0, view_group=g)  # fmt: skip
                        assert key in STANDARD, (d, group, page, dtype, causal)


def test_packed_kernel_skips_no_sequence():
    """The packed compile's tile order validates every sequence's tiles (min_seqlen_q 0); the
    split's skips those below PAGED_MIN_SEQLEN_Q, as before."""
    pytest.importorskip("cutlass")
    from forgekernel.kernels.attention.fwd.sm90.kernel import AttentionFwdSm90

    cfg = default_config(128, 128, paged=True)
    split = AttentionFwdSm90(128, 128, True, cfg, varlen=True, page_box=16)
    packed = AttentionFwdSm90(128, 128, True, cfg, varlen=True, page_box=16, packed=True,
                              view_group=4)  # fmt: skip
    assert split.scheduler.min_seqlen_q == PAGED_MIN_SEQLEN_Q
    assert packed.scheduler.min_seqlen_q == 0
    with pytest.raises(ValueError, match="paged"):
        AttentionFwdSm90(128, 128, True, AttnConfig(), varlen=True, packed=True)


# ------------------------------------------------------------------ the bench variant
def test_bench_split_variant_on_16_bit_prefill_cases_only():
    """The prefill cases A / B the two forms in one process: ours (the packed default) and the
    `split` variant; no copy-form variant."""
    names = [c.name for c in suite_module.BENCH_CASES if "split" in suite_module.variants(c)]
    assert names == [c.name for c in PREFILL_BENCH_CASES]
    assert suite_module.variants(PREFILL_BENCH_CASES[0]) == {"split": suite_module._run_split}
    assert not any("packed" in suite_module.variants(c) for c in suite_module.BENCH_CASES)


def test_bench_variant_and_ours_run_their_forms(cpu_paged_kernel, monkeypatch):  # noqa: F811
    """On a small prefill case of the suite's own form (decode rows first, then chunks), into
    the bench's out buffers, the reference's numbers: ours the packed launch alone, the
    `split` variant the decode kernel and the split's compile."""
    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    case = _prefill_case(8, 2, 16, (40, 7), (60, 0), (30, 50, 3), "cpu")
    inputs = suite_module.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                      torch.Generator().manual_seed(0))  # fmt: skip
    want, want_lse = suite_module.reference(inputs)
    for run, packed in ((suite_module.run_ours, True), (suite_module._run_split, False)):
        out = suite_module.alloc_out(inputs)
        assert run(inputs, out) is out
        assert float((out[0].float() - want).abs().max()) < 2e-2
        assert float((out[1] - want_lse).abs().max()) < 1e-4
        assert cpu_paged_kernel[-1].get("packed", False) == packed
    assert [p.get("view_group") for p in cpu_paged_kernel] == [4, None]
    assert len(cpu_paged_kernel.decode) == 1  # the split's alone


# ------------------------------------------------------------------ the zero-copy form
def test_view_group_where_g_divides_the_tile_rows():
    """G where it is one of VIEW_GROUPS (the standard compiles) dividing the paged default's
    tile_m (128 at D 128 / 256, 192 at D 64), else 0: the split."""
    groups = (1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 32)
    assert [fwd_launch.view_group(g, 128) for g in groups] == [1, 2, 0, 4, 0, 0, 0, 8, 0, 16, 0]
    assert [fwd_launch.view_group(g, 64) for g in (3, 4, 6, 12, 16)] == [0, 4, 0, 0, 16]
    assert fwd_launch.view_group(4, 256) == 4


def test_views_launch_arguments(monkeypatch):
    """The view form hands the kernel q, out and lse themselves (views: the same storage, no
    copy): q (Tq, Hkv, G, D), out alike, lse (Hkv, G, Tq); an lse whose rows are not contiguous
    (a transposed (Tq, Hq) buffer) goes through a buffer copied back."""
    seen = {}

    def get_kernel(spec, params):
        seen["params"] = dict(params)

        def fn(*args):
            seen["args"] = args
            args[3].fill_(1.0)
            args[4].fill_(2.0)

        return fn

    monkeypatch.setattr(fwd_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(fwd_launch, "_plans", type(fwd_launch._plans)())
    monkeypatch.setattr(fwd_launch, "num_sms", lambda device: 132)
    q, k, v, table, lens, cu = prefill_problem(16, 2, 128, 16, [1, 0, 40, 4], [9, 3, 50, 33])
    o, lse = torch.empty_like(q), torch.empty(16, q.shape[0])
    fwd_launch.attention_paged_fwd(q, k, v, o, lse, table, lens, cu, 40, 0.125, True,
                                   packed=True)  # fmt: skip
    qv, _, _, ov, lv, cu_p, _, _, max_p, qgroup, _, _ = seen["args"]
    assert qv.shape == ov.shape == (45, 2, 8, 128) and lv.shape == (2, 8, 45)
    assert qv.data_ptr() == q.data_ptr() and ov.data_ptr() == o.data_ptr()
    assert lv.data_ptr() == lse.data_ptr() and qv.stride() == (2048, 1024, 128, 1)
    assert lv.stride() == (8 * 45, 45, 1) and cu_p.tolist() == [0, 8, 8, 328, 360]
    assert (max_p, qgroup, seen["params"]["view_group"]) == (320, 8, 8)
    assert (o == 1).all() and (lse == 2).all()
    lse_t = torch.zeros(q.shape[0], 16).t()
    fwd_launch.attention_paged_fwd(q, k, v, o, lse_t, table, lens, cu, 40, 0.125, True,
                                   packed=True)  # fmt: skip
    assert seen["args"][4].data_ptr() != lse_t.data_ptr() and (lse_t == 2).all()


def test_view_keys_are_standard_not_candidates():
    """view_group in the paged mode: a key only with packed (and G dividing tile_m); every
    packed key standard (the bench's four of before among them), none a candidate (the
    fixed-length view_group keys, PACK_CANDIDATES and PACK_CLASSES' standard ones, are:
    test_attention_build)."""
    assert not any("view_group" in dict(p) and dict(p)["page_box"] for p in SPEC.candidate_params())
    keys = map(dict, SPEC.standard_params())
    views = [p for p in keys if "view_group" in p and p["page_box"]]
    bench = {(p["page_box"], p["view_group"]) for p in views
             if p["dtype"] == "bfloat16" and p["head_dim"] == 128 and p["causal"]}  # fmt: skip
    assert {(16, 4), (16, 8), (64, 4), (64, 8)} <= bench
    assert all(p["packed"] for p in views)
    for bad in ({"view_group": 4}, {"packed": True, "view_group": 3}):
        with pytest.raises(ValueError, match="view_group"):
            params_for("bfloat16", 128, 128, True, varlen=True, page_box=16, **bad)


def test_packed_launcher_refuses_a_group_without_a_compile(monkeypatch):
    """attention_paged_fwd(packed=True) at G 3: ValueError (the op sends such batches to the
    split; nothing is looked up)."""
    monkeypatch.setattr(fwd_launch, "get_kernel", lambda *a: pytest.fail("no lookup"))
    q, k, v, table, lens, cu = prefill_problem(12, 4, 128, 16, [1, 40], [9, 50])
    o, lse = torch.empty_like(q), torch.empty(12, q.shape[0])
    with pytest.raises(ValueError, match="view_group"):
        fwd_launch.attention_paged_fwd(q, k, v, o, lse, table, lens, cu, 40, 0.125, True,
                                       packed=True)  # fmt: skip


# ------------------------------------------------------------------ the packed order
def packed_cta_blocks(case, grid=132, tile=128):
    """Each CTA's key blocks over the packed form's tiles (D 128, 128 x 128, causal): rows
    q_len x G a sequence, Hkv heads, the paged order (sequence by sequence), no skip; and
    the blocks of the decode rows' tiles."""
    p = case.params
    g, heads = p["hq"] // p["hkv"], p["hkv"]
    rows = [n * g for n in p["q_lens"]]
    m_blocks = -(-max(rows) // tile)
    load, decode = [0] * grid, 0
    for t in range(m_blocks * heads * len(rows)):
        m_rev, _, b = tile_of(t, m_blocks, heads, len(rows), True)
        mine = -(-rows[b] // tile)
        if m_rev >= mine:
            continue
        blocks = key_blocks((mine - 1 - m_rev) * tile, rows[b], p["lens"][b], tile, tile, True, g)
        load[t % grid] += blocks
        decode += blocks if p["q_lens"][b] < PAGED_MIN_SEQLEN_Q else 0
    return load, decode


# (busiest CTA / mean, the decode rows' share of the key blocks, the busiest CTA's blocks /
# the split forward's busiest) of the packed form on each bench prefill case, in the model of
# `packed_cta_blocks` (docs/attention/PAGED_NOTES.md, "The whole chunked-prefill batch in one
# launch": the predictions)
PACKED_MODEL = {
    "c2048of16k+32dec": (1.117, 0.127, 1.225),
    "c512-4096+16dec": (1.065, 0.030, 1.060),
    "c1024-4096+64dec": (1.038, 0.139, 1.160),
    "ragged": (1.397, 0.039, 1.275),  # the 12,345-key decode row: one 97-block tile a kv head
}


def test_packed_order_on_the_bench_prefill_cases():
    """The bench's batches in the packed form (a model for the notes' predictions: key blocks
    per CTA, no per-tile cost, every block alike): the figures of PACKED_MODEL (the split's
    forward: `cta_key_blocks`); every valid tile once."""
    for case in PREFILL_BENCH_CASES:
        load, decode = packed_cta_blocks(case)
        split = cta_key_blocks(case, paged=True)
        got = (max(load) / (sum(load) / len(load)), decode / sum(load), max(load) / max(split))
        want = PACKED_MODEL[case.name.split("-", 5)[-1].rsplit("-q", 1)[0]]
        assert got == pytest.approx(want, abs=1e-3), case.name


# ------------------------------------------------------------------ the DSL's view, traced
def test_dsl_view_maps_packed_rows_to_query_heads():
    """The layouts the zero-copy compile builds, evaluated by the DSL while tracing
    (tests/packed_views_trace.py; static sizes Tq 70, Hkv 2, G 4, D 64): packed row r = t G + g
    of kv head h at q's element (t, h G + g); the TMA coordinates (d, g, t, head) of 128-row
    tiles after the sequence's packed offset (8 rows: token 2), so a box is ((G, 32) tokens'
    rows, D) from g 0; the LSE's row r of head h at lse[h G + g, t]."""
    pytest.importorskip("cutlass")
    from packed_views_trace import trace_views  # tests/ is on the path

    tq, hkv, g, d = 70, 2, 4, 64
    seen = trace_views(tq, hkv, g, d)
    hq = hkv * g
    want_q = [(r // g) * hq * d + (h * g + r % g) * d + c
              for r in (0, 5, 9, 279) for c in (0, 3) for h in (0, 1)]  # fmt: skip
    assert seen["q"] == want_q
    # tile 0 from packed row 8 (token 2), tile 1 from row 136 (token 34), its row 5 column 7
    assert seen["tma"] == [(0, 0, 2, 1), (0, 0, 34, 1), (7, 1, 35, 1)]
    assert seen["lse"] == [(h * g + r % g) * tq + r // g for h in (0, 1) for r in (0, 9, 279)]


def test_profile_script_takes_the_form():
    """scripts/profile_paged_prefill.py --form: the prefill form ours runs in under ncu, the
    other arguments left to profile_suite."""
    from script_modules import load_script  # tests/ is on the path

    script = load_script("profile_paged_prefill")
    assert script.split_form(["--form", "split", "--which", "ours"]) == (
        "split",
        ["--which", "ours"],
    )
    assert script.split_form(["--case", "x"]) == ("packed_views", ["--case", "x"])
