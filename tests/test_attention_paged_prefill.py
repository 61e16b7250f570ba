"""Chunked prefill on the attention forward's paged mode, on the CPU (the GPU's checks:
tests/gpu/test_paged_gpu.py). The producer's page / box walk (`kernel._page_of_lane`,
`_page_boxes`) and the consumers' stale-row clearing (`_clear_stale_v`) are replayed tile by
tile against the reference gather: which page and rows every box loads, for pages of 8 to 256
rows under 64- and 128-key tiles, tails, tables exactly as wide as the longest sequence, NaN in
every slot no sequence owns. A CPU stand-in for the compiled kernel built on that replay (and
on the kernel's key-block bounds) runs through the real op and launcher against the fp32
reference; the routing between the paged mode and the gather path; the compile params."""

from __future__ import annotations

import importlib
import importlib.util
import math
from pathlib import Path

import pytest
import torch
from script_modules import load_script  # tests/ is on the path
from test_attention_paged import install_cpu_decode

from forgekernel.bench.suites.attention_paged import PREFILL_BENCH_CASES
from forgekernel.kernels.attention.fwd.sm90 import SPEC
from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_launch
from forgekernel.kernels.attention.fwd.sm90.config import (
    PAGE_BOXES,
    PAGED_HEAD_DIMS,
    PAGED_MIN_SEQLEN_Q,
    AttnConfig,
    default_config,
    page_box_for,
)
from forgekernel.kernels.attention.paged.sm90 import launch as paged_launch
from forgekernel.reference.paged_attention import paged_attention_ref

op_module = importlib.import_module("forgekernel.ops.attention_paged")


# ------------------------------------------------------------------ the kernel, replayed
def box_walk(table_row, width, seqlen_k, n, tile_n, box, page_size):
    """[(page, first row in the page)] of the boxes of key block n, in smem order, as the
    producer issues them (`_page_of_lane` + `_page_boxes`); page -1: TMA zero-fills."""
    if box < tile_n:  # lane j: the page of box j; the box is the whole page
        walk = []
        for j in range(tile_n // box):
            col = n * (tile_n // box) + j
            ok = col * box < seqlen_k and col < width
            walk.append((int(table_row[col]) if ok else -1, 0))
        return walk
    key = n * tile_n  # one box: the tile's share of a page at least as long
    col = key // page_size
    page = int(table_row[col]) if col < width else -1
    return [(page, (key - col * page_size) // tile_n * tile_n)]


def load_tile(cache, walk, box):
    """The tile the boxes land: each box page_box rows of its page, zeros for a page outside
    the cache (TMA bounds every box by the tensor's extent)."""
    parts = []
    for page, row0 in walk:
        if 0 <= page < cache.shape[0]:
            parts.append(cache[page, row0 : row0 + box])
        else:
            parts.append(torch.zeros_like(cache[0, :box]))
    return torch.cat(parts)


def clear_stale(v_tile, n, seqlen_k, tile_n, box):
    """`_clear_stale_v` on block n's V tile (the first block a query tile processes)."""
    first = seqlen_k - n * tile_n
    end = min(-(-seqlen_k // box) * box - n * tile_n, tile_n)
    if first < end:
        v_tile[first:end] = 0


def key_blocks(m0, seqlen_q, seqlen_k, tile_m, tile_n, causal, qgroup=1):
    """`_key_blocks`' n_block_max: the key blocks a query tile loads (qgroup: rows a query
    position, the packed form's G; seqlen_q counts rows)."""
    n_max = -(-seqlen_k // tile_n)
    if causal:
        q_last = (min(m0 + tile_m, seqlen_q) - 1) // qgroup
        n_max = min(n_max, (q_last + seqlen_k - seqlen_q // qgroup + tile_n) // tile_n)
    return max(n_max, 0)


def loaded_keys(k, v, table_row, seqlen_k, n_max, cfg, box):
    """K and V of blocks 0 .. n_max - 1 as they sit in shared memory when the consumers use
    them (the last block's stale V rows cleared)."""
    width, page_size = table_row.shape[0], k.shape[1]
    ks, vs = [], []
    for n in range(n_max):
        walk = box_walk(table_row, width, seqlen_k, n, cfg.tile_n, box, page_size)
        ks.append(load_tile(k, walk, box))
        vt = load_tile(v, walk, box).clone()
        if n == n_max - 1:
            clear_stale(vt, n, seqlen_k, cfg.tile_n, box)
        vs.append(vt)
    return torch.cat(ks), torch.cat(vs)


def replayed_kernel(params, ran=None):
    """A CPU stand-in for the compiled paged kernel, in its argument order: per sequence of at
    least PAGED_MIN_SEQLEN_Q query tokens (the scheduler's tiles skip the others: the decode
    kernel's; the packed compile skips none) and query tile, the keys its walk loads, scores
    masked past the length and (causal) the bottom-right diagonal of row // qgroup, softmax in
    fp64; O and the natural-log LSE. ran: the sequences it computed are appended there."""
    p = dict(params)
    if "view_group" in p:  # the zero-copy form: views of q / o / lse (`_replayed_view_kernel`)
        return _replayed_view_kernel(p, ran)
    cfg, box, causal = AttnConfig.from_params(p), p["page_box"], p["causal"]
    packed = p.get("packed", False)
    assert p["varlen"] and box > 0

    def fn(q, k, v, o, lse, cu_q, lens, scale_log2, max_q, qgroup, ctas, table):
        # the packed form: one head a kv head, G rows a token (the split's: qgroup 1)
        assert (q.shape[1] == k.shape[2]) if packed else qgroup == 1
        assert ctas == 132 and max_q >= int((cu_q[1:] - cu_q[:-1]).max())
        scale = scale_log2 / math.log2(math.e)
        group = q.shape[1] // k.shape[2]
        for b in range(lens.shape[0]):
            q0, sq, sk = int(cu_q[b]), int(cu_q[b + 1] - cu_q[b]), int(lens[b])
            if sq < (1 if packed else PAGED_MIN_SEQLEN_Q):
                continue
            if ran is not None:
                ran.append(b)
            for m0 in range(0, sq, cfg.tile_m):
                n_max = key_blocks(m0, sq, sk, cfg.tile_m, cfg.tile_n, causal, qgroup)
                rows = torch.arange(m0, min(m0 + cfg.tile_m, sq))
                if n_max == 0:  # no key block: the epilogue of empty sums
                    o[q0 + rows] = 0
                    lse[:, q0 + rows] = -math.inf
                    continue
                kk, vv = loaded_keys(k, v, table[b], sk, n_max, cfg, box)
                qq = q[q0 + rows].double()  # (rows, Hq, D)
                kh = kk.double().repeat_interleave(group, dim=1)  # (keys, Hq, D)
                vh = vv.double().repeat_interleave(group, dim=1)
                s = torch.einsum("rhd,khd->hrk", qq, kh) * scale
                key = torch.arange(kk.shape[0])
                ok = key[None, :] < sk
                if causal:
                    ok = ok & (key[None, :] <= rows[:, None] // qgroup + sk - sq // qgroup)
                s = torch.where(ok[None], s, -math.inf)  # overwrites NaN, as the mask does
                top = s.amax(-1, keepdim=True)
                e = torch.where(ok[None], torch.exp(s - top), 0.0)
                total = e.sum(-1)
                out = torch.einsum("hrk,khd->rhd", e, vh) / total.T[..., None].clamp_min(1e-300)
                seen = total.T > 0
                o[q0 + rows] = torch.where(seen[..., None], out, 0.0).to(o.dtype)
                lse[:, q0 + rows] = torch.where(
                    seen.T, (top[..., 0] + torch.log(total)), -math.inf
                ).float()

    return fn


def _replayed_view_kernel(params, ran):
    """A CPU stand-in for the `view_group` compile: q / o (Tq, Hkv, G, D) and lse (Hkv, G, Tq)
    views seen as their packed rows the way `views.grouped_rows_as_sdhb` / `grouped_lse` lay
    them out (row t * G + g at token stride x t + head-in-group stride x g), the packed
    stand-in run on those rows, its results written back through the same strides."""
    p = dict(params)
    group = p.pop("view_group")
    inner = replayed_kernel(tuple(p.items()), ran)

    def rows(t):  # ((G, Tq), D, Hkv) as a torch view (Tq, G, Hkv, D): row t * G + g
        tq, h, g, d = t.shape
        return t.as_strided((tq, g, h, d), (t.stride(0), t.stride(2), t.stride(1), t.stride(3)))

    def fn(qv, k, v, ov, lv, cu_q, lens, scale_log2, max_q, qgroup, ctas, table):
        tq, hkv, g, d = qv.shape
        assert g == group == qgroup and ov.shape == qv.shape and lv.shape == (hkv, g, tq)
        op = torch.full((tq * g, hkv, d), math.nan, dtype=qv.dtype)
        lp = torch.full((hkv, tq * g), math.nan)
        inner(rows(qv).reshape(tq * g, hkv, d), k, v, op, lp, cu_q, lens, scale_log2, max_q,
              qgroup, ctas, table)  # fmt: skip
        rows(ov).copy_(op.view(tq, g, hkv, d))
        lse_rows = lv.as_strided((hkv, tq, g), (lv.stride(0), lv.stride(2), lv.stride(1)))
        lse_rows.copy_(lp.view(hkv, tq, g))

    return fn


class Calls(list):
    """The forward's kernel lookups (params dicts); .ran: the sequences its stand-in computed,
    .decode: the decode stand-in's partial-pass calls."""


@pytest.fixture
def cpu_paged_kernel(monkeypatch):
    calls = Calls()
    calls.ran = []

    def get_kernel(spec, params):
        assert spec is SPEC
        calls.append(dict(params))
        return replayed_kernel(params, calls.ran)

    monkeypatch.setattr(fwd_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(fwd_launch, "_plans", type(fwd_launch._plans)())  # plans hold kernels
    monkeypatch.setattr(fwd_launch, "num_sms", lambda device: 132)
    calls.decode = install_cpu_decode(monkeypatch)  # the batch's short sequences
    yield calls
    paged_launch._plans.clear()


@pytest.fixture
def split_form():
    """The op's chunked prefill in its split form (the decode kernel, then the forward) for
    the test (the default is the packed form where the batch's G has a compile)."""
    with op_module.prefill_form("split"):
        yield


# ------------------------------------------------------------------ problems
def prefill_problem(hq, hkv, d, page_size, q_lens, k_lens, seed=0, combined=False,
                    dtype=torch.bfloat16):  # fmt: skip
    """Caches with NaN in every slot no sequence owns (pages of no sequence, the last page's
    slots past the length), a table exactly as wide as the longest sequence whose entries past
    a sequence's pages are garbage (NaN pages, ids past the cache, -1), packed queries."""
    g = torch.Generator().manual_seed(seed)
    b = len(k_lens)
    width = max(1, max(-(-n // page_size) for n in k_lens))
    pages = b * width + 3
    if combined:
        kv = torch.full((pages, 2, page_size, hkv, d), math.nan, dtype=dtype)
        k, v, views = kv, None, (kv[:, 0], kv[:, 1])
    else:
        k, v = (torch.full((pages, page_size, hkv, d), math.nan, dtype=dtype) for _ in "kv")
        views = (k, v)
    perm = torch.randperm(pages, generator=g)[: b * width].view(b, width)
    # past a sequence's pages: pages no sequence owns (all NaN), ids past the cache, -1
    pick = torch.randint(0, 3, (b, width), generator=g)
    table = torch.where(pick == 0, perm, torch.where(pick == 1, pages + 7, -1))
    for s, n in enumerate(k_lens):
        owned = -(-n // page_size)
        table[s, :owned] = perm[s, :owned]
        for i in range(owned):
            rows = min(page_size, n - i * page_size)
            for view in views:
                view[perm[s, i], :rows] = torch.randn(rows, hkv, d, generator=g).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(cu[-1]), hq, d, generator=g).to(dtype)
    return q, k, v, table.int(), torch.tensor(k_lens, dtype=torch.int32), cu


# ------------------------------------------------------------------ the walk
@pytest.mark.parametrize("tile_n", [64, 128])
@pytest.mark.parametrize("page_size", [8, 16, 32, 64, 128, 256])
def test_box_walk_loads_the_reference_gather(tile_n, page_size):
    """Every loaded block: the rows of keys < seqlen_k are the sequence's keys (the
    reference's gather), V rows past it are zero after the clearing, and a box past the
    sequence is zeros (page -1 or an id past the cache)."""
    box = page_box_for(page_size, tile_n)
    assert box == min(page_size, tile_n)
    for sk in (1, 7, box - 1, box, box + 1, tile_n - 1, tile_n, tile_n + 1, 3 * tile_n + 5, 611):
        _, k, v, table, _, _ = prefill_problem(2, 1, 8, page_size, [1], [sk], seed=sk)
        want_k = k[table[0, torch.arange(sk) // page_size].long(), torch.arange(sk) % page_size]
        n_max = -(-sk // tile_n)
        cfg = type("Cfg", (), {"tile_n": tile_n})
        kk, vv = loaded_keys(k, v, table[0], sk, n_max, cfg, box)
        assert kk.shape[0] == n_max * tile_n
        assert torch.equal(kk[:sk], want_k), (page_size, tile_n, sk)
        assert torch.isfinite(vv).all() and not vv[sk:].any(), (page_size, tile_n, sk)
        # boxes wholly past the sequence: zeros (the table's entries there are garbage)
        first_empty = -(-sk // box) * box
        assert not kk[first_empty:].any()


def test_box_walk_reads_no_table_entry_past_the_width():
    """A length beyond the table's capacity (an invalid input) reads no entry past the row:
    the boxes there load zeros."""
    table = prefill_problem(2, 1, 8, 16, [1], [40])[3]
    walk = box_walk(table[0], 1, 40, 0, 128, 16, 16)
    assert [p for p, _ in walk[1:]] == [-1] * 7
    walk = box_walk(table[0], 1, 300, 2, 128, 128, 256)  # one box: block 2 is page 1
    assert walk == [(-1, 0)]


@pytest.mark.parametrize("causal", [True, False])
def test_stale_rows_only_in_the_first_processed_block(causal):
    """The only block holding slots past the sequence is the last one loaded, which a query
    tile processes first: the one whose V `_clear_stale_v` zeroes."""
    for tile_n in (64, 128):
        for sq, sk in ((5, 40), (300, 1000), (128, 77), (1, 1), (200, 129)):
            for m0 in range(0, sq, 128):
                n_max = key_blocks(m0, sq, sk, 128, tile_n, causal)
                for n in range(n_max - 1):  # processed after it: no slot past the length
                    assert (n + 1) * tile_n <= sk, (tile_n, sq, sk, m0, n)


# ------------------------------------------------------------------ the whole pass
CASES = [
    # hq, hkv, d, page_size, q_lens, k_lens, causal, combined
    # 257 keys: the last query sees exactly the first key of block 2 (the causal bound)
    (8, 2, 128, 16, [5, 0, 130, 7], [40, 9, 257, 7], True, False),
    (8, 2, 128, 16, [9, 20], [9, 0], True, False),  # a sequence without keys
    (6, 2, 64, 32, [200, 17, 5], [250, 17, 385], True, False),  # 192-row tiles
    (4, 1, 256, 128, [70, 6], [190, 6], True, False),  # 64-row boxes of 128-row pages
    (8, 8, 128, 64, [33, 150], [100, 150], False, False),
    (4, 2, 128, 8, [12, 40], [21, 40], True, True),
    (12, 4, 128, 256, [7, 140], [300, 140], True, False),  # 128-row boxes, 2 tiles a page
    (8, 2, 64, 16, [40, 6], [20, 3], True, False),  # more queries than keys: empty rows
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES)
def test_paged_prefill_matches_the_reference(cpu_paged_kernel, case, dtype):
    hq, hkv, d, ps, q_lens, k_lens, causal, combined = case
    q, k, v, table, lens, cu = prefill_problem(hq, hkv, d, ps, q_lens, k_lens,
                                               combined=combined, dtype=dtype)  # fmt: skip
    out, lse = op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu,
                                         max_seqlen_q=max(q_lens), causal=causal,
                                         return_lse=True)  # fmt: skip
    kk, vv = (k[:, 0], k[:, 1]) if combined else (k, v)
    want, want_lse = paged_attention_ref(q, kk, vv, table, lens, cu_seqlens_q=cu, causal=causal)
    assert out.shape == q.shape and lse.shape == (hq, q.shape[0])
    assert torch.isfinite(out).all()
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    assert not out[~finite.T].any()
    params = cpu_paged_kernel[-1]
    want_box = page_box_for(ps, default_config(d, d, paged=True).tile_n)
    assert params["page_box"] == want_box and params["causal"] == causal
    assert params["dtype"] == ("bfloat16" if dtype == torch.bfloat16 else "float16")


def test_out_is_written_in_place(cpu_paged_kernel):
    q, k, v, table, lens, cu = prefill_problem(8, 2, 128, 32, [9, 30], [50, 31])
    out = torch.full_like(q, math.nan)
    got = op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=30,
                                    out=out)  # fmt: skip
    assert got is out and torch.isfinite(out).all()


# ------------------------------------------------------------------ the batch split
def test_decode_lengths_give_the_forwards_sequences_no_keys():
    """The decode kernel's key lengths: a sequence's own up to MAX_QUERY_TOKENS query tokens
    (0 included), 0 past it; int32, no host read (a device op on cu_seqlens_q)."""
    lens = torch.tensor([40, 9, 257, 300, 7, 5000], dtype=torch.int32)
    cu = torch.tensor([0, 1, 1, 5, 9, 14, 2062], dtype=torch.int32)  # 1, 0, 4, 4, 5, 2048
    got = op_module.decode_lengths(lens, cu)
    assert got.dtype == torch.int32 and got.tolist() == [40, 9, 257, 300, 0, 0]
    assert op_module.MAX_QUERY_TOKENS + 1 == PAGED_MIN_SEQLEN_Q


@pytest.mark.parametrize(
    "q_lens",
    [[0, 2, 1, 9, 3, 0], [1, 40, 4, 3], [7, 0, 5], [2], [0, 0, 3, 0, 0], [300, 1, 1, 1, 1]],
)
def test_decode_slots_write_each_decode_row_once_with_its_token(q_lens):
    """The compact decode batch (`decode_slots`): every row of a sequence of 1-4 query tokens
    is the destination of exactly the slot computing it (its token: the slot's place among the
    sequence's last 4, bottom-right), keys only for those sequences; every other slot writes a
    row of the forward's sequences (overwritten after) or duplicates the slot of the batch's
    last row (one value a destination); every index in range; no host read (device ops)."""
    t = op_module.MAX_QUERY_TOKENS
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seqlens = torch.arange(100, 100 + len(q_lens), dtype=torch.int32)
    rows = int(cu[-1])
    keys, dst, src = op_module.decode_slots(seqlens, cu, rows)
    assert keys.dtype == torch.int32 and dst.dtype == src.dtype == torch.int64
    assert keys.tolist() == [int(seqlens[b]) if 1 <= n <= t else 0 for b, n in enumerate(q_lens)]
    assert dst.shape == src.shape == (len(q_lens) * t,)
    assert 0 <= int(dst.min()) and int(dst.max()) < rows and 0 <= int(src.min())
    owner = {}  # row -> (sequence, token)
    for b, n in enumerate(q_lens):
        for i in range(n):
            owner[int(cu[b]) + i] = (b, i, n)
    by_row = {}
    for slot, (r, s) in enumerate(zip(dst.tolist(), src.tolist())):
        by_row.setdefault(r, set()).add(s)
        if s == slot:  # a slot writing its own result: its sequence's row, its token
            b, j = divmod(slot, t)
            ob, i, n = owner[r]
            assert ob == b and i == n - t + j
    for r, srcs in by_row.items():
        assert len(srcs) == 1, f"row {r} written from slots {srcs}"
        b, i, n = owner[r]
        if n <= t:  # a decode row: from the slot of its sequence and token
            assert srcs == {b * t + t - n + i}
    decode_rows = {r for r, (_, _, n) in owner.items() if n <= t}
    assert decode_rows <= set(by_row)


MIXED_CASES = [
    # hq, hkv, d, page_size, q_lens, k_lens: decode rows and 2-4 speculative tokens beside
    # chunks, sequences without queries or keys, more queries than keys
    (8, 2, 128, 16, [1, 3, 0, 200, 4, 1, 5], [40, 300, 9, 257, 4, 0, 7]),
    (6, 2, 64, 32, [2, 130, 1], [2, 385, 1000]),  # GQA 3: one head a CTA
    (4, 1, 256, 128, [70, 1, 6, 4], [190, 129, 6, 3]),
    (8, 8, 128, 64, [150, 1, 1], [150, 100, 65]),  # MHA, the chunk first
    # the decode's split plan (2-3 splits) on the compact slots: a first sequence of 2 tokens
    # (padding slots before row 0), sequences without queries (first, middle, last), the
    # batch's last row a 3-token decode row's; a batch without decode rows, a chunk last
    (8, 2, 128, 16, [0, 2, 1, 9, 3, 0], [50, 600, 5, 700, 33, 70]),
    (4, 2, 64, 16, [6, 0, 9], [300, 40, 500]),
]
# the cases whose decode rows take the split plan over the compact slots (the others one split)
SLOT_CASES = {0, 1, 4, 5}


@pytest.mark.usefixtures("split_form")
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("case", range(len(MIXED_CASES)))
def test_mixed_batch_splits_between_the_kernels(cpu_paged_kernel, case, causal):
    """Every row written by its kernel (out and lse NaN-poisoned): the sequences of up to 4
    query tokens by the decode (one call, its 4-token packed kernel: one split over the batch,
    the others given no keys, where the plan has one; else the plan's splits over the compact
    slots, `decode_slots`), the rest by the forward (its tiles skip the short ones), both in
    place; the batch matches the reference."""
    hq, hkv, d, ps, q_lens, k_lens = MIXED_CASES[case]
    q, k, v, table, lens, cu = problem = prefill_problem(hq, hkv, d, ps, q_lens, k_lens)
    check_in_place_batch(problem, max(q_lens), causal)
    assert cpu_paged_kernel.ran == [b for b, n in enumerate(q_lens) if n > 4]
    [(params, _, direct)] = cpu_paged_kernel.decode
    assert params["qtokens"] == op_module.MAX_QUERY_TOKENS
    splits = paged_launch.packed_splits(q, k, table, len(q_lens), op_module.MAX_QUERY_TOKENS)
    assert (splits > 1) == (case in SLOT_CASES) and direct == (splits == 1)


def check_in_place_batch(problem, max_q: int, causal: bool):
    """The op on a chunked-prefill batch into NaN-poisoned out and lse given to it (returned
    as they are): every row written, near the fp64 reference, the LSE's infinite rows (no
    keys) exactly the reference's, none NaN. Returns (out, the reference LSE's finite mask)."""
    q, k, v, table, lens, cu = problem
    out = torch.full_like(q, math.nan)
    lse = torch.full((q.shape[1], q.shape[0]), math.nan)
    got, got_lse = op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu,
                                             max_seqlen_q=max_q, causal=causal,
                                             return_lse=True, out=out, lse=lse)  # fmt: skip
    assert got is out and got_lse is lse
    want, want_lse = paged_attention_ref(q, k, v, table, lens, cu_seqlens_q=cu, causal=causal)
    assert torch.isfinite(out).all()
    assert float((out.float() - want).abs().max()) < 2e-2
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse)) and not lse.isnan().any()
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4
    return out, finite


@pytest.mark.usefixtures("split_form")
def test_mixed_batch_into_an_out_the_forward_cannot_write_in_place(cpu_paged_kernel):
    """An out TMA cannot write (a misaligned view): the forward's buffer starts as out, so the
    decode's rows, written first, come back with the forward's copy."""
    q, k, v, table, lens, cu = prefill_problem(8, 2, 128, 16, [1, 40, 2], [70, 60, 33])
    buf = torch.full((q.numel() + 1,), math.nan, dtype=q.dtype)
    out = buf[1:].view(q.shape)
    assert fwd_launch.tma_target(out) is not out
    op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=40, out=out)
    want, _ = paged_attention_ref(q, k, v, table, lens, cu_seqlens_q=cu)
    assert torch.isfinite(out).all() and float((out.float() - want).abs().max()) < 2e-2


@pytest.mark.usefixtures("split_form")
def test_mixed_batch_through_the_registered_op(cpu_paged_kernel):
    """The traced path's custom op (`forgekernel::attention_paged_prefill`, what torch.compile
    and the tracing modes call) runs the same two launches into fresh outputs."""
    q, k, v, table, lens, cu = prefill_problem(8, 2, 128, 16, [1, 40, 3, 0], [70, 60, 33, 5])
    out, lse = torch.ops.forgekernel.attention_paged_prefill(q, k, v, table, lens, cu, 40,
                                                             128**-0.5, True)  # fmt: skip
    want, want_lse = paged_attention_ref(q, k, v, table, lens, cu_seqlens_q=cu)
    assert float((out.float() - want).abs().max()) < 2e-2
    assert float((lse - want_lse).abs().max()) < 1e-4
    assert cpu_paged_kernel.ran == [1] and len(cpu_paged_kernel.decode) == 1


def tile_of(t, m_blocks, heads, batch, paged):
    """`LongestFirst.tile`'s (m_rev, head, sequence) of tile t (varlen): the paged mode
    sequence by sequence (heads fastest, then the row block), else the row block slowest."""
    if paged:
        b, r = divmod(t, heads * m_blocks)
        m_rev, h = divmod(r, heads)
    else:
        m_rev, rest = divmod(t, heads * batch)
        b, h = divmod(rest, heads)
    return m_rev, h, b


def cta_key_blocks(case, paged, grid=132):
    """Each CTA's key blocks (D 128: 128 x 128 tiles, causal) over the tiles it takes, t = c,
    c + grid, ...; paged: the split (sequences of < PAGED_MIN_SEQLEN_Q query tokens skipped)
    and the paged order, else the order and tiles before them."""
    q_lens, k_lens, heads = case.params["q_lens"], case.params["lens"], case.params["hq"]
    m_blocks = -(-max(q_lens) // 128)
    load = [0] * grid
    for t in range(m_blocks * heads * len(q_lens)):
        m_rev, _, b = tile_of(t, m_blocks, heads, len(q_lens), paged)
        sq, mine = q_lens[b], -(-q_lens[b] // 128)
        if m_rev >= mine or (paged and sq < PAGED_MIN_SEQLEN_Q):
            continue
        load[t % grid] += key_blocks((mine - 1 - m_rev) * 128, sq, k_lens[b], 128, 128, True)
    return load


def test_paged_order_deals_every_prefill_bench_case_evenly():
    """The bench's chunked-prefill batches (a 132-CTA grid): with the row block slowest, the
    2048-row chunk beside 32 decode rows put all its tiles on 32 CTAs (33 x 32 tiles a row
    block, a multiple of 132): the busiest CTA 2.95x the mean, the 4.07 ms of the H200. The
    paged order (and the split) keeps every case within 1.12x; every valid tile once."""
    for case in PREFILL_BENCH_CASES:
        load = cta_key_blocks(case, paged=True)
        assert max(load) <= 1.12 * sum(load) / len(load), case.name
        q_lens, heads = case.params["q_lens"], case.params["hq"]
        m_blocks = -(-max(q_lens) // 128)
        tiles = [tile_of(t, m_blocks, heads, len(q_lens), True)
                 for t in range(m_blocks * heads * len(q_lens))]  # fmt: skip
        assert sorted(tiles) == sorted(
            (m, h, b) for b in range(len(q_lens)) for m in range(m_blocks) for h in range(heads)
        )
    before = cta_key_blocks(PREFILL_BENCH_CASES[0], paged=False)
    assert max(before) > 2.9 * sum(before) / len(before)


def cta_walk(q_lens, heads, c, grid=132, skip=True):
    """(the valid tiles CTA c takes, its loop's iterations) in the paged order; skip:
    `LongestFirst.next_tile`, which past an invalid tile goes to the CTA's first t in the
    next sequence."""
    m_blocks, b_count = -(-max(q_lens) // 128), len(q_lens)
    t, taken, steps = c, [], 0
    while t < m_blocks * heads * b_count:
        m_rev, _, b = tile_of(t, m_blocks, heads, b_count, True)
        mine = -(-q_lens[b] // 128) if q_lens[b] >= PAGED_MIN_SEQLEN_Q else 0
        valid, nxt, steps = m_rev < mine, t + grid, steps + 1
        if valid:
            taken.append(t)
        elif skip:
            end = (b + 1) * heads * m_blocks
            nxt = max(nxt, nxt + (end - nxt + grid - 1) // grid * grid)
        t = nxt
    return taken, steps


def test_next_tile_skips_only_invalid_tiles():
    """Each CTA takes the same valid tiles with the skip as without; at c2048of16k+32dec its
    loop runs 36 iterations at most instead of 128."""
    cases = [(c.params["q_lens"], c.params["hq"]) for c in PREFILL_BENCH_CASES]
    cases += [(c[4], c[0]) for c in MIXED_CASES]
    for q_lens, heads in cases:
        for c in range(0, 132, 5):
            assert cta_walk(q_lens, heads, c)[0] == cta_walk(q_lens, heads, c, skip=False)[0]
    q_lens, heads = cases[0]
    assert max(cta_walk(q_lens, heads, c)[1] for c in range(132)) <= 36
    assert max(cta_walk(q_lens, heads, c, skip=False)[1] for c in range(132)) == 128


@pytest.mark.usefixtures("split_form")
def test_mixed_batch_over_a_cache_without_pages(cpu_paged_kernel):
    """No pages: the forward's launcher fills only its sequences' rows (0, -inf), the decode
    its own; every row written."""
    q = torch.randn(1 + 6 + 2, 8, 128).to(torch.bfloat16)
    k = v = torch.empty(0, 16, 2, 128, dtype=torch.bfloat16)
    table, lens = torch.zeros(3, 1, dtype=torch.int32), torch.zeros(3, dtype=torch.int32)
    cu = torch.tensor([0, 1, 7, 9], dtype=torch.int32)
    out = torch.full_like(q, math.nan)
    lse = torch.full((8, 9), math.nan)
    op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=6, out=out,
                              lse=lse)  # fmt: skip
    assert not out.isnan().any() and not out.any() and (lse == -math.inf).all()
    assert cpu_paged_kernel.ran == []


@pytest.mark.parametrize(("decode_lens", "splits"), [((30, 50, 3), 1), ((30, 500, 3), 2)])
def test_split_script_runs_on_the_stand_ins(cpu_paged_kernel, monkeypatch, decode_lens, splits):
    """scripts/paged_prefill_split.py's case (its sub-batches, the op, the checks) on the CPU
    stand-ins, the timer replaced by one call each: ours matches the reference and its rows
    equal the compacted forward's and decode's (the decode's bitwise at one split), at one
    split and at the decode's split plan over the compact slots."""
    from forgekernel.bench.suites import attention_paged as suite_module
    from forgekernel.runtime.timing import Samples

    script = load_script("paged_prefill_split")

    def one_call(fns, **_):
        return {name: Samples([(fn(), 1.0)[1]], method="cpu") for name, fn in fns.items()}

    monkeypatch.setattr(script, "time_interleaved", one_call)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(suite_module, "comparators", lambda: {"flashinfer": None})
    case = suite_module._prefill_case(8, 2, 16, (40, 7), (60, 0), decode_lens, "cpu")
    r = script.run_case(case, torch.device("cpu"))
    assert set(r["ms"]) == {"before", "fwd", "decode", "decode_plan", "decode_one_split",
                            "decode_in_op", "ours"}  # fmt: skip
    checks = r["checks"]
    assert checks["ours_max_err"] < 2e-2 and checks["ours_finite"]
    assert checks["fwd_rows_bitwise"] and checks["decode_in_op_rows_bitwise"]
    assert checks["decode_splits"] == splits
    if splits == 1:
        assert checks["decode_rows_bitwise"]
    else:
        assert checks["decode_rows_max_diff"] < 2e-2


# ------------------------------------------------------------------ routing, params
@pytest.mark.parametrize(
    ("page_size", "d", "fp8", "box"),
    [(16, 128, False, 16), (128, 128, False, 128), (128, 256, False, 64), (8, 64, False, 8),
     (1, 128, False, 0), (24, 128, False, 0), (16, 128, True, 0)],
)  # fmt: skip
def test_routing_between_the_paged_mode_and_the_gather(monkeypatch, page_size, d, fp8, box):
    """16-bit caches with a page the mode covers run the paged kernel; FP8 caches and pages of
    1 (or 24) gather into the varlen forward."""
    taken = []
    monkeypatch.setattr(op_module, "_prefill", lambda *a: taken.append("paged") or (None, None))
    monkeypatch.setattr(op_module, "_prefill_by_gather",
                        lambda *a: taken.append("gather") or (None, None))  # fmt: skip
    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    q, k, v, table, lens, cu = prefill_problem(4, 2, d, page_size, [6], [30])
    scales = {}
    if fp8:
        k, v = k.nan_to_num().to(torch.float8_e4m3fn), v.nan_to_num().to(torch.float8_e4m3fn)
        scales = {"k_scale": 1.0, "v_scale": 1.0}
    op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=6, **scales)
    assert taken == ["paged" if box else "gather"]
    if not fp8:
        assert fwd_launch.paged_box(page_size, d) == box


def test_standard_params_cover_the_paged_op():
    """Every paged-op head dim, dtype and mask with a box per page size 8 .. 256."""
    paged = [p for p in map(dict, SPEC.standard_params()) if p.get("page_box")]
    keys = {(p["dtype"], p["head_dim"], p["causal"], p["page_box"]) for p in paged}
    for d in PAGED_HEAD_DIMS:
        tile_n = default_config(d, d, paged=True).tile_n
        boxes = {page_box_for(ps, tile_n) for ps in (*PAGE_BOXES, 256)}
        for dtype in ("bfloat16", "float16"):
            for causal in (False, True):
                assert {(dtype, d, causal, b) for b in boxes} <= keys
    assert all(p["varlen"] and p["head_dim_v"] == p["head_dim"] for p in paged)
    dense = [p for p in map(dict, SPEC.standard_params()) if not p.get("page_box")]
    # 5 head-dim pairs x 2 dtypes x 2 masks x fixed / varlen, 8 fixed-length rules x 2 dtypes,
    # and the GQA-packed D = 64 keys (PACK_CLASSES: both masks x G 2 / 4 / 8 / 16 x 2 dtypes)
    assert len(dense) == 40 + 16 + 16 and all(p["page_box"] == 0 for p in dense)


def _gpu_test_module(monkeypatch):
    """tests/gpu/test_paged_gpu.py as a module; tests/gpu on the path for its `graphs` import
    (alone this test found it only where an earlier test had put it there)."""
    gpu = Path(__file__).parent / "gpu"
    monkeypatch.syspath_prepend(str(gpu))
    return load_script("paged_gpu_tests", gpu / "test_paged_gpu.py")


def test_each_gpu_prefill_case_looks_its_kernel_up(cpu_paged_kernel, monkeypatch):
    """The GPU test asserts the paged mode by the kernel it looks up; pages 256 and 128 at D 128
    share one plan (box 128), so the second case looked nothing up through the launcher's
    shared plan cache and failed (2026-12-02 10:20, h64_8_d128_p128 x 4). Its recorder keeps a
    plan cache per test: the GPU cases in order, on the stand-in kernel, each see their box."""
    gpu = _gpu_test_module(monkeypatch)
    cases = [c for c in gpu.PREFILL_CASES if c[2] == 128 and c[3] in (128, 256)]
    assert len(cases) == 2 and fwd_launch.paged_box(128, 128) == fwd_launch.paged_box(256, 128)
    for hq, hkv, d, ps, _, _, combined in sorted(cases, key=lambda c: -c[3]):
        with pytest.MonkeyPatch.context() as mp:  # one GPU test's monkeypatch
            looked_up = gpu.record_kernel_lookups(mp)
            q, k, v, table, lens, cu = prefill_problem(hq // 8, hkv // 4, d, ps, [6, 1], [300, 9],
                                                       combined=combined)  # fmt: skip
            op_module.attention_paged(q, k, v, table, lens, cu_seqlens_q=cu, max_seqlen_q=6)
        assert [p["page_box"] for p in looked_up] == [fwd_launch.paged_box(ps, d)]
