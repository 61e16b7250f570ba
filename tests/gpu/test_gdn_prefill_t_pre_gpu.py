"""T precomputed (`gdn_prefill/sm90/t_pre.py` and the chunked kernel's `t_pre` form, the bench's
variant `t_pre`) on the GPU: the precompute's T diag(beta) against fp64 on a NaN-poisoned buffer
(every used slot written, the partial chunks' rows and columns past the end 0, the slots between
sequences untouched); the launcher's t_pre path against the fp64 recurrence (the standard
tolerances) and against the standard path (expected bit for bit: the same aux arithmetic on the
same operands, `test_t_pre_is_bitwise_the_standard`; if only that test fails, T differs in its
last bits between the kernels and the first test's tolerances decide) on varlen with empty,
single-token and partial sequences, grouped value heads, l2norm, both state layouts, with and
without an initial state, V split 1 and 2, fp16 and bf16; many sequences (the precompute's
binary search over cu_seqlens); the O ring's whole and tail chunks; segments (T once for the
three passes); the suite's shapes with the times printed (-s); a CUDA graph; the H100's
intermittent failures (2026-12-05) repeated and localized per form and V split
(`test_t_pre_repeated_is_the_standard`, `test_t_pre_segments_repeated`, -s for the report);
the op's default route (`launch.t_pre_for`: the t_pre form but on direct unsplit launches over
ungrouped heads) bit for bit the form it names, forced (`test_default_route_is_the_forced_form`);
the standard form's `o_warp` key (the t_pre form's state chain, T by the aux; the launcher's
standard form) bit for bit the standard form without it, repeated
(`test_standard_o_warp_is_the_standard`, `..._repeated`); the t_pre path's two kernels timed
apart in CUDA graphs beside the path and the standard form with and without o_warp, with their
bytes' rates (`test_split_times`, -s: next/tpre-batch-gap in docs/linear_attention/NOTES.md);
the t_pre form's `no_o` key (the final state bit for bit, o untouched) and the segmented path's
pass B on it (`b_no_o`, the launcher's default: bit for bit the segmented path with B keeping
o; timed at 1 x 131072 h16).
CPU counterparts: tests/test_gdn_prefill_t_pre.py (replay), test_gdn_prefill_t_pre_compile.py."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F
from graphs import captured

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    first_slot,
    t_slots,
)
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu
STATE_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SCALE = 128**-0.5

CASES = [  # lens, h, hv, k_last, l2norm, with_state
    ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True),
    ([1000], 4, 8, True, True, True),
    ([3, 129, 7], 16, 32, False, True, False),
    ([300, 301], 16, 16, True, False, True),
    ([17, 5, 0, 0, 40], 1, 3, True, False, False),
]


def _inputs(lens, h, hv, dtype, seed=0, knorm=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(total, h, 128).to(dtype)
    k = (F.normalize(rnd(total, h, 128), dim=-1) * knorm).to(dtype)
    v = rnd(total, hv, 128).to(dtype)
    g, beta = F.logsigmoid(rnd(total, hv) + 2.0), torch.sigmoid(rnd(total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda",
                      dtype=torch.int32)  # fmt: skip
    return q, k, v, g, beta, state, cu


def _close(got, want, rel):
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, err


def _run(inputs, *, t_pre, k_last=False, l2norm=False, with_state=True, v_split=None,
         o_warp=None):  # fmt: skip
    q, k, v, g, beta, state, cu = inputs
    n, hv = cu.shape[0] - 1, v.shape[1]
    start = None
    if with_state:
        start = state.transpose(-1, -2).contiguous() if k_last else state
    out = torch.full_like(v, float("nan"))
    final = torch.full((n, hv, 128, 128), float("nan"), device="cuda")
    prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=k_last,
                               l2norm=l2norm, v_split=v_split, segments=1, t_pre=t_pre,
                               o_warp=o_warp)  # fmt: skip
    return out, (final.transpose(-1, -2) if k_last else final)


def _t_fp64(k, g, beta, l2norm):
    """(I + L)^-1 diag(beta) of one chunk in fp64, L_ij = beta_i exp(G_i - G_j) k_i . k_j (k
    normalized with l2norm) for j < i."""
    k, g, beta = k.double(), g.double(), beta.double()
    if l2norm:
        k = k * torch.rsqrt((k * k).sum(1, keepdim=True) + 1e-6)
    big = g.cumsum(0)
    lower = torch.tril((k @ k.t()) * torch.exp(big[:, None] - big[None, :]), -1) * beta[:, None]
    eye = torch.eye(k.shape[0], dtype=torch.float64, device=k.device)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False) * beta[None, :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lens", "h", "hv", "k_last", "l2norm", "with_state"), CASES)
def test_precompute_against_fp64(dtype, lens, h, hv, k_last, l2norm, with_state):
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype, knorm=4.0 if l2norm else 1.0)
    shape = (t_slots(sum(lens), len(lens)) * CHUNK, hv, CHUNK)
    buf = torch.full(shape, float("nan"), dtype=dtype, device="cuda")
    prefill_launch.t_diag_beta(k, g, beta, cu, l2norm=l2norm, out=buf)
    torch.cuda.synchronize()
    used = set()
    edges = cu.tolist()
    for n, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
        for c0 in range(0, t1 - t0, CHUNK):
            s = first_slot(t0, n) + c0 // CHUNK
            used.add(s)
            valid = min(CHUNK, t1 - t0 - c0)
            rows = slice(t0 + c0, t0 + c0 + valid)
            for head in range(hv):
                got = buf[CHUNK * s : CHUNK * (s + 1), head].double()
                want = _t_fp64(k[rows, head // (hv // h)], g[rows, head], beta[rows, head], l2norm)
                assert torch.isfinite(got).all()
                _close(got[:valid, :valid], want, 1e-2)
                assert not got[valid:].any() and not got[:, valid:].any()
    for s in set(range(shape[0] // CHUNK)) - used:
        assert buf[CHUNK * s : CHUNK * (s + 1)].isnan().all()


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lens", "h", "hv", "k_last", "l2norm", "with_state"), CASES)
def test_t_pre_matches_the_recurrence(dtype, v_split, lens, h, hv, k_last, l2norm, with_state):
    inputs = _inputs(lens, h, hv, dtype, seed=3, knorm=4.0 if l2norm else 1.0)
    o, final = _run(inputs, t_pre=True, k_last=k_last, l2norm=l2norm, with_state=with_state,
                    v_split=v_split)  # fmt: skip
    q, k, v, g, beta, state, cu = inputs
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE,
        initial_state=state if with_state else None, output_final_state=True,
        cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
    )  # fmt: skip
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    _close(o, want_o[0], 2e-2)
    _close(final, want_s, STATE_TOL[dtype])


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize(("lens", "h", "hv", "k_last", "l2norm", "with_state"), CASES)
def test_t_pre_is_bitwise_the_standard(v_split, lens, h, hv, k_last, l2norm, with_state):
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=4, knorm=4.0 if l2norm else 1.0)
    kw = dict(k_last=k_last, l2norm=l2norm, with_state=with_state, v_split=v_split)
    o_std, s_std = _run(inputs, t_pre=False, **kw)
    o_t, s_t = _run(inputs, t_pre=True, **kw)
    assert torch.equal(o_t, o_std) and torch.equal(s_t, s_std)


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize("lens", [[64, 128, 1, 640, 63, 192], [4096], [65, 0, 127]])
def test_o_ring_whole_and_tail_chunks(v_split, lens):
    """The t_pre form's O path (the state warps hand each tile to the O warp by an mbarrier
    ring; whole chunks by one TMA box, the tail chunk's rows by the warp's 16-byte copies):
    sequences ending on a chunk boundary (the last chunk a TMA box) beside partial ones (a box
    there would write the next sequence's rows), 64 chunks (the two tiles' parities wrap 32
    times); every row written (o NaN-poisoned) and bit for bit the standard path's."""
    inputs = _inputs(lens, 2, 4, torch.bfloat16, seed=9)
    o_std, s_std = _run(inputs, t_pre=False, v_split=v_split)
    o_t, s_t = _run(inputs, t_pre=True, v_split=v_split)
    assert not o_t.isnan().any()
    assert torch.equal(o_t, o_std) and torch.equal(s_t, s_std)


def test_many_sequences():
    """600 sequences of 0 .. 200 tokens: 10 steps of the precompute's binary search, more CTAs
    than SMs in both kernels."""
    lens = [(37 * i) % 201 for i in range(600)]
    inputs = _inputs(lens, 2, 4, torch.bfloat16, seed=5)
    o_std, s_std = _run(inputs, t_pre=False)
    o_t, s_t = _run(inputs, t_pre=True)
    _close(o_t, o_std, 1e-2)
    _close(s_t, s_std, 1e-2)


def _ms(fn, reps=20):
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize(("lens", "h", "hv", "with_state"), [
    ([8192] * 4, 16, 32, True),
    ([8192] * 4, 16, 32, False),
    ([8192] * 4, 16, 16, True),
    ([16384], 16, 32, False),
    ([2048] * 8, 4, 8, True),
])  # fmt: skip
def test_suite_shapes(lens, h, hv, with_state):
    """The bench's shapes: t_pre within tolerance of the standard path (bitwise expected);
    eager event times of the standard path, the t_pre path and the precompute alone printed
    (the bench's graph timings decide)."""
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=6)
    o_std, s_std = _run(inputs, t_pre=False, with_state=with_state)
    o_t, s_t = _run(inputs, t_pre=True, with_state=with_state)
    _close(o_t, o_std, 1e-2)
    _close(s_t, s_std, 1e-2)
    q, k, v, g, beta, state, cu = inputs
    std = _ms(lambda: _run(inputs, t_pre=False, with_state=with_state))
    tpre = _ms(lambda: _run(inputs, t_pre=True, with_state=with_state))
    pre = _ms(lambda: prefill_launch.t_diag_beta(k, g, beta, cu, l2norm=False))
    print(f"\nt_pre {len(lens)}x{lens[0]} h{h} hv{hv} state={with_state}: standard {std:.4f} ms, "
          f"t_pre {tpre:.4f} ms ({tpre / std:.3f}x), precompute {pre:.4f} ms, "
          f"bitwise {torch.equal(o_t, o_std)}")  # fmt: skip


@pytest.mark.parametrize(("lens", "parts"), [([4096], 4), ([2000, 70, 3000], 3)])
def test_t_pre_segments(lens, parts):
    """Segments (the launcher's path for few long sequences): T once over all segments, each
    pass reading it from its first segment's slot; the standard segmented path's result (bitwise
    expected), the recurrence's to the standard tolerances."""
    q, k, v, g, beta, state, cu = _inputs(lens, 2, 4, torch.bfloat16, seed=8)
    got = {}
    for t_pre in (False, True):
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), 4, 128, 128), float("nan"), device="cuda")
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, segments=parts, t_pre=t_pre)  # fmt: skip
        got[t_pre] = (out, final)
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE, initial_state=state,
        output_final_state=True, cu_seqlens=cu.long(),
    )  # fmt: skip
    _close(got[True][0], want_o[0], 2e-2)
    _close(got[True][1], want_s, STATE_TOL[torch.bfloat16])
    _close(got[True][0], got[False][0], 1e-2)
    print(f"\nt_pre segments {lens} x{parts}: bitwise {torch.equal(got[True][0], got[False][0])}")


def _where(got, want, cu):
    """Where o (T, HV, V) differs from the reference: bad tokens, the first as (sequence, chunk,
    row), whether the bad rows sit in whole chunks (the O warp's TMA box) or tail chunks (its
    16-byte copies), the value heads and the 64-column blocks (a V split's parts)."""
    bad = got != want
    if not bad.any():
        return None
    toks = bad.any(-1).any(-1).nonzero().flatten()
    edges = cu.long()
    seqs = torch.searchsorted(edges, toks, right=True) - 1
    rows = toks - edges[seqs]
    chunk, row = rows // CHUNK, rows % CHUNK
    whole = edges[seqs + 1] - edges[seqs] - chunk * CHUNK >= CHUNK
    heads = bad.any(0).any(-1).nonzero().flatten().tolist()
    blocks = bad.view(*bad.shape[:2], -1, 64).any(0).any(0).any(-1).nonzero().flatten().tolist()
    return (f"{toks.numel()} tokens (whole chunks {int(whole.sum())}, tails "
            f"{int((~whole).sum())}), first seq {int(seqs[0])} chunk {int(chunk[0])} row "
            f"{int(row[0])}, heads {heads[:8]}, column blocks {blocks}")  # fmt: skip


RACE_CASES = [  # lens, h, hv, with_state: run 1's failing V-split shapes on the suite's keys
    ([1000], 4, 8, True),
    ([300, 301], 16, 16, True),
    ([3, 129, 7], 16, 32, False),
    ([4096], 2, 4, True),
]


@pytest.mark.parametrize("state_lds", [False, True])
@pytest.mark.parametrize("v_split", [2, 1])
@pytest.mark.parametrize(("lens", "h", "hv", "with_state"), RACE_CASES)
def test_t_pre_repeated_is_the_standard(lens, h, hv, with_state, v_split, state_lds):
    """The H100's intermittent t_pre failures (NOTES, "t_pre failed on the H100"), localized:
    the t_pre form REPS times on fresh NaN-poisoned outputs against the standard path (bit for
    bit expected), per form (state_lds: no O warp, V^T by 16-bit loads, O by the state warps)
    and V split; the message says how many runs differed, whether o or the final state, and
    where (a race in the O hand-off or its store: o only, the state exact; upstream of U^T:
    both). T_PRE_REPS overrides the count (1 under the sanitizers)."""
    reps = int(os.environ.get("T_PRE_REPS", "6"))
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=11)
    q, k, v, g, beta, state, cu = inputs
    start = state if with_state else None

    def once(t_pre, lds=False):
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), hv, 128, 128), float("nan"), device="cuda")
        prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, v_split=v_split, segments=1, t_pre=t_pre,
                                   state_lds=lds)  # fmt: skip
        return out, final

    o_std, s_std = once(False)
    report = []
    for rep in range(reps):
        o_t, s_t = once(True, state_lds)
        torch.cuda.synchronize()
        where = _where(o_t, o_std, cu)
        s_bad = not torch.equal(s_t, s_std)
        if where or s_bad:
            report.append(f"rep {rep}: o {where or 'exact'}; final state "
                          f"{'differs' if s_bad else 'exact'}")  # fmt: skip
    print(
        f"\nt_pre repeated {lens} h{h} hv{hv} split {v_split} state_lds {state_lds}: "
        f"{len(report)} of {reps} runs differ" + "".join(f"\n  {r}" for r in report)
    )
    assert not report, report


@pytest.mark.parametrize("parts", [4, 3])
def test_t_pre_segments_repeated(parts):
    """The segmented path (T once for the three passes, V split 2 in each) REPS times against
    the standard segmented path, bit for bit expected (run 1 and run 2 failed different cases
    of test_t_pre_segments). T_PRE_REPS overrides the count."""
    reps = int(os.environ.get("T_PRE_REPS", "6"))
    lens = [4096] if parts == 4 else [2000, 70, 3000]
    q, k, v, g, beta, state, cu = _inputs(lens, 2, 4, torch.bfloat16, seed=8)

    def once(t_pre):
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), 4, 128, 128), float("nan"), device="cuda")
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, segments=parts, t_pre=t_pre)  # fmt: skip
        return out, final

    o_std, s_std = once(False)
    bad = []
    for rep in range(reps):
        o_t, s_t = once(True)
        where = _where(o_t, o_std, cu)
        if where or not torch.equal(s_t, s_std):
            bad.append(f"rep {rep}: o {where or 'exact'}, state "
                       f"{'exact' if torch.equal(s_t, s_std) else 'differs'}")  # fmt: skip
    print(f"\nt_pre segments repeated {lens} x{parts}: {len(bad)} of {reps} differ" +
          "".join(f"\n  {b}" for b in bad))  # fmt: skip
    assert not bad, bad


def test_t_pre_in_a_cuda_graph():
    """The t_pre path captured (the T buffer from the graph's pool) and replayed gives the
    eager result."""
    inputs = _inputs([100, 0, 300], 2, 4, torch.bfloat16, seed=7)
    want_o, want_s = _run(inputs, t_pre=True)
    q, k, v, g, beta, state, cu = inputs
    out = torch.empty_like(v)
    final = torch.empty(3, 4, 128, 128, device="cuda")

    def step():
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, segments=1, t_pre=True)  # fmt: skip

    step()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_o) and torch.equal(final, want_s)


# lens, h, hv, with_state, dtype, l2norm, k_last: the op's default route on the GPU's own SM count
ROUTE_CASES = [
    ([2048] * 8, 4, 8, True, torch.bfloat16, False, False),  # the suite's 8x2048-h4-hv8: split
    ([300, 301], 16, 16, True, torch.bfloat16, False, False),  # HV = H, split (N HV <= SMs / 2)
    ([200] * 5, 16, 32, False, torch.bfloat16, False, False),  # grouped, unsplit (160 CTAs)
    ([300] * 9, 8, 8, True, torch.bfloat16, False, False),  # HV = H, unsplit: the standard form
    ([1, 63, 0, 640, 65] * 12, 2, 4, True, torch.float16, True, True),  # varlen, l2norm, k-last
    ([130, 7] * 40, 2, 2, False, torch.float16, False, False),  # HV = H unsplit, no state
]


@pytest.mark.parametrize(("lens", "h", "hv", "with_state", "dtype", "l2norm", "k_last"),
                         ROUTE_CASES)  # fmt: skip
def test_default_route_is_the_forced_form(monkeypatch, lens, h, hv, with_state, dtype, l2norm,
                                          k_last):  # fmt: skip
    """The op with the launcher's own choices asks for the keys of the form `t_pre_for` names
    (the t_pre form and the precompute, or the standard form alone) and gives that form's
    result, forced, bit for bit (o NaN-poisoned in the forced run: every row written)."""
    from forgekernel.ops.gated_delta_rule_chunked import gated_delta_rule
    from forgekernel.runtime.device import num_sms

    inputs = _inputs(lens, h, hv, dtype, seed=12, knorm=4.0 if l2norm else 1.0)
    q, k, v, g, beta, state, cu = inputs
    n, sms = len(lens), num_sms(torch.cuda.current_device())
    split = prefill_launch.v_split_for(n, hv, sms)
    t_pre = prefill_launch.t_pre_for(h, hv, split, prefill_launch.segments_for(n, hv, sum(lens),
                                                                                sms))  # fmt: skip
    keys = []
    real = prefill_launch.get_kernel

    def spy(spec, params):
        keys.append(dict(params))
        return real(spec, params)

    monkeypatch.setattr(prefill_launch, "get_kernel", spy)
    init = None
    if with_state:
        init = state.transpose(-1, -2).contiguous() if k_last else state
    o, final = gated_delta_rule(q[None], k[None], v[None], g[None], beta[None],
                                initial_state=init, output_final_state=True, cu_seqlens=cu,
                                use_qk_l2norm_in_kernel=l2norm, k_last=k_last)  # fmt: skip
    assert len(keys) == (2 if t_pre else 1)
    assert keys[0].get("t_pre", False) is t_pre and keys[0]["v_split"] == split
    assert keys[0].get("o_warp", False) is not t_pre  # the standard form with its O warp
    want_o, want_s = _run(inputs, t_pre=t_pre, k_last=k_last, l2norm=l2norm,
                          with_state=with_state)  # fmt: skip
    assert not want_o.isnan().any()
    assert torch.equal(o[0], want_o)
    assert torch.equal(final.transpose(-1, -2) if k_last else final, want_s)


# lens, h, hv, with_state, dtype, l2norm, k_last, v_split: the standard form with the o_warp key
O_WARP_CASES = [
    ([64, 128, 1, 640, 63, 192], 2, 2, True, torch.bfloat16, False, False, 1),  # HV = H
    ([64, 128, 1, 640, 63, 192], 2, 4, False, torch.bfloat16, False, False, 2),
    ([4096], 1, 1, True, torch.bfloat16, False, False, 1),  # 64 chunks: the O tiles' parities
    ([65, 0, 127], 2, 4, True, torch.bfloat16, False, False, 2),
    ([300, 301], 16, 16, True, torch.float16, True, True, 1),
    ([300] * 9, 8, 8, False, torch.bfloat16, False, False, 1),  # the route's standard class
]


@pytest.mark.parametrize(("lens", "h", "hv", "with_state", "dtype", "l2norm", "k_last", "v_split"),
                         O_WARP_CASES)  # fmt: skip
def test_standard_o_warp_is_the_standard(lens, h, hv, with_state, dtype, l2norm, k_last,
                                         v_split):  # fmt: skip
    """The standard form's `o_warp` key: V^T by ldmatrix (the same 16-bit values), O by the O
    warp's TMA box a whole chunk and its 16-byte copies of a tail chunk's rows (the same
    stmatrix image), so o and the final state bit for bit the standard form's without it (o
    NaN-poisoned: every row written), and the recurrence's to the standard tolerances."""
    inputs = _inputs(lens, h, hv, dtype, seed=13, knorm=4.0 if l2norm else 1.0)
    kw = dict(k_last=k_last, l2norm=l2norm, with_state=with_state, v_split=v_split)
    o_std, s_std = _run(inputs, t_pre=False, o_warp=False, **kw)
    o_ow, s_ow = _run(inputs, t_pre=False, o_warp=True, **kw)
    assert not o_ow.isnan().any()
    assert torch.equal(o_ow, o_std) and torch.equal(s_ow, s_std)
    q, k, v, g, beta, state, cu = inputs
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE,
        initial_state=state if with_state else None, output_final_state=True,
        cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
    )  # fmt: skip
    _close(o_ow, want_o[0], 2e-2)
    _close(s_ow, want_s, STATE_TOL[dtype])


@pytest.mark.parametrize("v_split", [1, 2])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "with_state"), [([4096], 2, 2, True), ([300, 301], 16, 16, True)]
)
def test_standard_o_warp_repeated(lens, h, hv, with_state, v_split):
    """The key REPS times (O_WARP_REPS, 1 under the sanitizers) on fresh NaN-poisoned outputs
    against the standard form, bit for bit: the v stage's release moved after U^T (as the t_pre
    forms', "t_pre failed on the H100") and the O ring are where a race would show; the message
    says where (`_where`)."""
    reps = int(os.environ.get("O_WARP_REPS", "6"))
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=14)
    o_std, s_std = _run(inputs, t_pre=False, with_state=with_state, v_split=v_split,
                        o_warp=False)  # fmt: skip
    report = []
    for rep in range(reps):
        o_ow, s_ow = _run(inputs, t_pre=False, with_state=with_state, v_split=v_split,
                          o_warp=True)  # fmt: skip
        torch.cuda.synchronize()
        where = _where(o_ow, o_std, inputs[-1])
        s_bad = not torch.equal(s_ow, s_std)
        if where or s_bad:
            report.append(f"rep {rep}: o {where or 'exact'}; final state "
                          f"{'differs' if s_bad else 'exact'}")  # fmt: skip
    print(f"\no_warp repeated {lens} h{h} hv{hv} split {v_split}: {len(report)} of {reps} "
          "runs differ" + "".join(f"\n  {r}" for r in report))  # fmt: skip
    assert not report, report


def _graph_ms(step, reps=20):
    """Milliseconds a replay of `step` captured in a CUDA graph (as the bench's graph column,
    without its input rotation: these working sets are 25-100x the L2)."""
    graph = captured(step)
    torch.cuda.synchronize()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


@pytest.mark.parametrize(("lens", "h", "hv", "with_state"), [
    ([8192] * 4, 16, 32, True),
    ([2048] * 16, 16, 32, False),
    ([32768] * 8, 16, 16, True),
])  # fmt: skip
def test_split_times(lens, h, hv, with_state):
    """The t_pre path's two kernels apart (graph replays): the precompute alone, the chunked
    kernel alone on T already made, the path; the standard form without and with its `o_warp`
    key beside.
    Each with its HBM bytes (q / k once a head, v, o, g, beta, the states; T 8 KB a chunk slot
    and value head) and their rate: where the path's time goes (NOTES, next/tpre-batch-gap).
    Checked: the chunked kernel alone writes the path's o and state bit for bit, the o_warp key
    the standard's."""
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=15)
    q, k, v, g, beta, state, cu = inputs
    n, total = len(lens), sum(lens)
    start = state if with_state else None
    t_buf = prefill_launch.t_diag_beta(k, g, beta, cu, l2norm=False)
    out, final = torch.empty_like(v), torch.empty(n, hv, 128, 128, device="cuda")

    def path(**kw):
        prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, v_split=1, segments=1, **kw)  # fmt: skip

    def main():
        prefill_launch._direct(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=False,
                               l2norm=False, v_split=1, t_pre=True, t_buf=t_buf)  # fmt: skip

    def pre():
        prefill_launch.t_diag_beta(k, g, beta, cu, l2norm=False, out=t_buf)

    results = {}
    for name, fn in (("path", lambda: path(t_pre=True)), ("main", main),
                     ("standard", lambda: path(t_pre=False, o_warp=False)),
                     ("o_warp", lambda: path(t_pre=False, o_warp=True))):  # fmt: skip
        out.fill_(float("nan"))
        fn()
        torch.cuda.synchronize()
        results[name] = (out.clone(), final.clone())
    assert torch.equal(results["main"][0], results["path"][0])
    assert torch.equal(results["main"][1], results["path"][1])
    assert torch.equal(results["o_warp"][0], results["standard"][0])
    assert torch.equal(results["o_warp"][1], results["standard"][1])
    ms = {name: _graph_ms(fn) for name, fn in (
        ("precompute", pre), ("main", main), ("path", lambda: path(t_pre=True)),
        ("standard", lambda: path(t_pre=False, o_warp=False)),
        ("o_warp", lambda: path(t_pre=False, o_warp=True)))}  # fmt: skip
    mb = 1e-6
    qk = 2 * total * h * 128 * 2 * mb
    vo = 2 * total * hv * 128 * 2 * mb
    gates = 2 * total * hv * 4 * mb
    states = (2 if with_state else 1) * n * hv * 128 * 128 * 4 * mb
    t_mb = t_buf.numel() * 2 * mb
    nbytes = {"precompute": qk / 2 + gates + t_mb, "main": qk + vo + gates + states + t_mb,
              "standard": qk + vo + gates + states}  # fmt: skip
    nbytes["path"] = nbytes["precompute"] + nbytes["main"]
    nbytes["o_warp"] = nbytes["standard"]
    chunks = -(-lens[0] // CHUNK)
    waves = -(-n * hv // torch.cuda.get_device_properties(0).multi_processor_count)
    print(f"\nsplit {n}x{lens[0]} h{h} hv{hv} state={with_state} ({torch.cuda.get_device_name()}"
          f", {chunks} chunks x {waves} waves a CTA chain):")  # fmt: skip
    for name, t in ms.items():
        print(f"  {name:10s} {t:.4f} ms  {nbytes[name]:7.0f} MB  {nbytes[name] / t * 1e-3:.2f} TB/s"
              f"  {t * 1e3 / (chunks * waves):.2f} us a chunk step")  # fmt: skip
    print(f"  main + precompute / path {(ms['main'] + ms['precompute']) / ms['path']:.3f}; "
          f"o_warp / standard {ms['o_warp'] / ms['standard']:.3f}")  # fmt: skip


@pytest.mark.parametrize(("lens", "h", "hv", "l2norm", "with_state", "dtype", "v_split"), [
    ([1, 63, 0, 64, 65, 130], 2, 4, False, True, torch.bfloat16, 1),
    ([200, 7], 2, 2, True, False, torch.float16, 2),
    ([4096], 2, 2, False, True, torch.bfloat16, 1),
])  # fmt: skip
def test_no_o_writes_the_state_only(lens, h, hv, l2norm, with_state, dtype, v_split):
    """The `no_o` key (pass B's): the final state bit for bit the t_pre form's (the same X^T,
    U^T and update on the same operands), not one element of o written (NaN-poisoned)."""
    inputs = _inputs(lens, h, hv, dtype, seed=16, knorm=4.0 if l2norm else 1.0)
    q, k, v, g, beta, state, cu = inputs
    start = state if with_state else None
    got = {}
    for no_o in (False, True):
        out = torch.full_like(v, float("nan"))
        final = torch.full((len(lens), hv, 128, 128), float("nan"), device="cuda")
        prefill_launch._direct(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=False,
                               l2norm=l2norm, v_split=v_split, t_pre=True, no_o=no_o)  # fmt: skip
        got[no_o] = (out, final)
    torch.cuda.synchronize()
    assert got[True][0].isnan().all()
    assert torch.equal(got[True][1], got[False][1])


@pytest.mark.parametrize(("lens", "h", "hv", "parts", "l2norm"), [
    ([4096], 2, 2, 4, False),
    ([2000, 70, 3000], 2, 4, 3, True),  # l2norm: the key loads no q, forms no q norm
    ([131072], 16, 16, None, False),  # the suite's 1x131072-h16-hv16 (the launcher's P = 9): timed
])  # fmt: skip
def test_segments_b_no_o(lens, h, hv, parts, l2norm):
    """The segmented t_pre path with pass B on the `no_o` key (the launcher's default): o and
    the final states bit for bit the path's with B keeping o (B's o is C's to overwrite); at
    the suite's 1 x 131072 both timed (graph replays; -s prints them: ours / the bench's
    `b_with_o`)."""
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, torch.bfloat16, seed=17,
                                          knorm=4.0 if l2norm else 1.0)  # fmt: skip
    out, final = torch.empty_like(v), torch.empty(len(lens), hv, 128, 128, device="cuda")

    def run(b_no_o):  # None: the launcher's choice (B on the key)
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, SCALE, k_last=False,
                                   l2norm=l2norm, segments=parts, t_pre=True,
                                   b_no_o=b_no_o)  # fmt: skip

    got = {}
    for b_no_o in (False, None):
        out.fill_(float("nan"))
        run(b_no_o)
        torch.cuda.synchronize()
        got[b_no_o] = (out.clone(), final.clone())
    assert not got[None][0].isnan().any()
    assert torch.equal(got[None][0], got[False][0]) and torch.equal(got[None][1], got[False][1])
    if parts is None:
        ms = {b: _graph_ms(lambda b=b: run(b)) for b in (False, None)}
        print(f"\nsegments {lens} h{h} hv{hv}: B with o {ms[False]:.4f} ms, ours (B without o) "
              f"{ms[None]:.4f} ms ({ms[None] / ms[False]:.3f}x)")  # fmt: skip
