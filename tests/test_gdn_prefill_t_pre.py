"""T precomputed (`gdn_prefill/sm90/t_pre.py`, the chunked kernel's `t_pre` form) on the CPU:
the slot layout of the T buffer, the precompute's stand-in (tests/gdn_prefill_replay.py's
`t_pre_kernel`: the aux's L, blocked tf32 inverse and 16-bit T diag(beta), chunk by chunk, at
the slots the kernel writes) against fp64, and the launcher's `t_pre` path (the precompute,
then the chunked form reading T from the buffer) through the replay: bit for bit the standard
path's outputs and states (the same arithmetic on the same operands), the fp64 recurrence's to
the standard tolerances, on varlen with empty / partial sequences, grouped value heads, l2norm,
both state layouts, V split 1 and 2, fp16 and bf16. The kernels' own numbers: tests/gpu/
test_gdn_prefill_gpu.py (`test_t_pre_*`)."""

from __future__ import annotations

import gdn_prefill_replay as replay
import pytest
import torch

from forgekernel.bench.suites import gdn_prefill as gdn_prefill_suite
from forgekernel.bench.suites.gdn_prefill import BENCH_CASES
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC, T_PRE_SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import (
    CHUNK,
    first_slot,
    params_for,
    t_pre_params_for,
    t_slots,
    v_split_for,
)
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

STATE_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SPLIT_SMS = {1: 1, 2: 10**6}  # SM counts under which the launcher chooses V split 1 / 2
LENS = [1, 63, 0, 64, 65, 130, 200]  # partial, empty, whole and multi-chunk sequences


class Calls(list):
    """(kernel name, params, the arguments' shapes) of each get_kernel call, and the T buffers
    the precompute was handed."""

    buffers: list


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The replay's stand-ins as the compiled kernels: the precompute for T_PRE_SPEC, the
    chunked kernel (standard or t_pre form, as the key says) for SPEC."""
    calls = Calls()
    calls.buffers = []

    def get(spec, params):
        calls.append((spec.name, dict(params)))
        if spec is T_PRE_SPEC:
            fn = replay.t_pre_kernel(dict(params))

            def keep(k, g, beta, cu, t):
                t.fill_(float("nan"))  # unwritten slots stay NaN: read, they would poison o
                calls.buffers.append(t)
                fn(k, g, beta, cu, t)

            return keep
        assert spec is SPEC
        return replay.kernel(dict(params))

    monkeypatch.setattr(prefill_launch, "get_kernel", get)
    return calls


def _inputs(lens, h, hv, *, seed=0, dtype=torch.bfloat16, scale_k=1.0):
    gen = torch.Generator().manual_seed(seed)
    t = sum(lens)
    q = torch.randn(t, h, 128, generator=gen).to(dtype)
    k = (torch.nn.functional.normalize(torch.randn(t, h, 128, generator=gen), dim=-1)
         * scale_k).to(dtype)  # fmt: skip
    v = torch.randn(t, hv, 128, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(t, hv, generator=gen) + 2.0)
    beta = torch.rand(t, hv, generator=gen)
    state = torch.randn(len(lens), hv, 128, 128, generator=gen) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    return q, k, v, g, beta, state, cu


def _run(inputs, *, t_pre, init, k_last=False, l2norm=False, v_split=1, segments=1):
    q, k, v, g, beta, state, cu = inputs
    n, hv = cu.shape[0] - 1, v.shape[1]
    start = None
    if init:
        start = state.transpose(-1, -2).contiguous() if k_last else state
    out = torch.empty_like(v)
    final = torch.empty(n, hv, 128, 128)
    prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, 128**-0.5,
                               k_last=k_last, l2norm=l2norm, v_split=v_split, segments=segments,
                               t_pre=t_pre)  # fmt: skip
    return out, (final.transpose(-1, -2) if k_last else final)


def _close(got, want, rel):
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-6, err


# ------------------------------------------------------------------------ the slot layout


@pytest.mark.parametrize("seed", range(6))
def test_slots_never_overlap_and_fit_the_buffer(seed):
    """Chunk c of sequence n at slot bos_n // C + n + c: the sequences' slot ranges are
    disjoint, in order, inside T // C + N; first_slot is strictly increasing in n (the
    precompute's binary search over cu_seqlens relies on it) and reaches T // C + N at n = N."""
    gen = torch.Generator().manual_seed(seed)
    picks = torch.tensor([0, 1, 2, 63, 64, 65, 127, 128, 129, 1000])
    lens = picks[torch.randint(len(picks), (int(torch.randint(1, 40, (1,), generator=gen)),),
                               generator=gen)].tolist()  # fmt: skip
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    total, n = cu[-1], len(lens)
    starts = [first_slot(b, i) for i, b in enumerate(cu)]
    assert starts[0] == 0 and starts[-1] == t_slots(total, n)
    assert all(a < b for a, b in zip(starts, starts[1:]))
    used = []
    for i, length in enumerate(lens):
        chunks = (length + CHUNK - 1) // CHUNK
        assert starts[i] + chunks <= starts[i + 1]  # inside its own range
        used += range(starts[i], starts[i] + chunks)
    assert len(used) == len(set(used)) == sum((x + CHUNK - 1) // CHUNK for x in lens)


def _owner(cu, s):
    """`t_pre.slot_owner`'s search, step for step."""
    lo, hi = 0, len(cu) - 1
    while hi - lo > 1:
        mid = (lo + hi) // 2
        below = first_slot(cu[mid], mid) <= s
        lo, hi = (mid, hi) if below else (lo, mid)
    return lo


def test_every_slot_finds_its_chunk_or_none():
    """Each slot of the grid maps to (n, c) with c < chunks_n for exactly the used slots (the
    CTAs of the others exit), including empty sequences at either end and in the middle."""
    lens = [0, 1, 63, 0, 64, 65, 0, 130, 0]
    cu = [0, *torch.tensor(lens).cumsum(0).tolist()]
    written = set()
    for s in range(t_slots(cu[-1], len(lens))):
        n = _owner(cu, s)
        c = s - first_slot(cu[n], n)
        assert c >= 0
        if c * CHUNK < cu[n + 1] - cu[n]:
            written.add((n, c))
    assert written == {(n, c) for n, ln in enumerate(lens) for c in range((ln + CHUNK - 1) // 64)}


# ------------------------------------------------------------------------ the precompute


def _t_fp64(k, g, beta):
    """T diag(beta) of one chunk in fp64 from the definition: (I + L)^-1 diag(beta), L_ij =
    beta_i exp(G_i - G_j) k_i . k_j for j < i, G = cumsum g."""
    k, g, beta = k.double(), g.double(), beta.double()
    big = g.cumsum(0)
    lower = torch.tril((k @ k.t()) * torch.exp(big[:, None] - big[None, :]), -1) * beta[:, None]
    eye = torch.eye(k.shape[0], dtype=torch.float64)
    return torch.linalg.solve_triangular(eye + lower, eye, upper=False) * beta[None, :]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_precompute_against_fp64(dtype):
    """The precompute's stand-in (the aux's arithmetic, rounded as the kernel rounds) against
    the fp64 T diag(beta) of every chunk and value head (grouped heads: k per head, g and beta
    per value head), the partial chunks' rows and columns past the end exactly 0; the slots
    between sequences untouched."""
    lens, h, hv = [1, 63, 0, 64, 65, 130], 2, 4
    q, k, v, g, beta, _, cu = _inputs(lens, h, hv, seed=1, dtype=dtype)
    t = torch.full((t_slots(sum(lens), len(lens)) * CHUNK, hv, CHUNK), float("nan"), dtype=dtype)
    replay.t_pre_kernel(dict(t_pre_params_for(replay_dtype(dtype))))(k, g, beta, cu, t)
    edges = cu.tolist()
    used = set()
    for n, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
        for c0 in range(0, t1 - t0, CHUNK):
            s = first_slot(t0, n) + c0 // CHUNK
            used.add(s)
            valid = min(CHUNK, t1 - t0 - c0)
            for head in range(hv):
                rows = slice(t0 + c0, t0 + c0 + valid)
                got = t[CHUNK * s : CHUNK * (s + 1), head].double()
                want = _t_fp64(k[rows, head // (hv // h)].float(), g[rows, head], beta[rows, head])
                _close(got[:valid, :valid], want, 1e-2)
                assert not got[valid:].any() and not got[:, valid:].any()
    gaps = [s for s in range(t.shape[0] // CHUNK) if s not in used]
    assert gaps and all(t[CHUNK * s : CHUNK * (s + 1)].isnan().all() for s in gaps)


def replay_dtype(dtype):
    return "float16" if dtype == torch.float16 else "bfloat16"


# ------------------------------------------------------------------------ the launcher's path


@pytest.mark.parametrize("v_split", sorted(SPLIT_SMS))
@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "init", "k_last", "dtype"),
    [
        (LENS, 2, 4, False, True, False, torch.bfloat16),  # varlen, grouped heads, a state
        ([200], 4, 8, True, True, True, torch.bfloat16),  # l2norm, FlashInfer's layout
        ([3, 129, 7], 1, 2, True, False, False, torch.float16),  # no state, fp16
        ([64, 64], 2, 2, False, True, True, torch.float16),  # H = HV, whole chunks
    ],
)
def test_t_pre_path_is_the_standard_bit_for_bit(
    cpu_kernels, lens, h, hv, l2norm, init, k_last, dtype, v_split
):  # fmt: skip
    """The launcher's t_pre path (precompute, then the t_pre form reading T) gives the standard
    path's o and final state exactly, and the recurrence's to the op's tolerances; the keys it
    asks for, the buffer's shape, the gaps never read (NaN there would reach o)."""
    inputs = _inputs(lens, h, hv, seed=sum(lens), dtype=dtype, scale_k=16.0 if l2norm else 1.0)
    kw = dict(init=init, k_last=k_last, l2norm=l2norm, v_split=v_split)
    o_std, s_std = _run(inputs, t_pre=False, **kw)
    o_t, s_t = _run(inputs, t_pre=True, **kw)
    assert torch.equal(o_t, o_std) and torch.equal(s_t, s_std)
    name = replay_dtype(dtype)
    key = dict(params_for(name, k_last=k_last, l2norm=l2norm, initial_state=init,
                          v_split=v_split, t_pre=True))  # fmt: skip
    assert cpu_kernels[1:] == [
        (SPEC.name, key),
        (T_PRE_SPEC.name, dict(t_pre_params_for(name, l2norm=l2norm))),
    ]
    assert "t_pre" not in cpu_kernels[0][1]  # the standard key names no t_pre
    (buf,) = cpu_kernels.buffers
    assert buf.shape == (t_slots(sum(lens), len(lens)) * CHUNK, hv, CHUNK) and buf.dtype == dtype
    q, k, v, g, beta, state, cu = inputs
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], initial_state=state if init else None,
        output_final_state=True, cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
    )  # fmt: skip
    _close(o_t, want_o[0], 2e-2)
    _close(s_t, want_s, STATE_TOL[dtype])


def test_t_pre_tail_chunk_ignores_the_next_sequence(cpu_kernels):
    """The precompute's k box of a partial chunk runs into the next sequence (as the chunked
    kernel's does): huge rows there change nothing of the first sequence."""
    q, k, v, g, beta, state, cu = _inputs([70, 90], 1, 2, seed=6)
    o, s = _run((q, k, v, g, beta, state, cu), t_pre=True, init=True)
    big = [x.clone() for x in (q, k, v)]
    for x in big:
        x[70:] *= 300
    o_big, s_big = _run((*big, g, beta, state, cu), t_pre=True, init=True)
    assert torch.equal(o[:70], o_big[:70]) and torch.equal(s[:1], s_big[:1])


@pytest.mark.parametrize(("lens", "parts"), [([300], 3), ([200, 1, 333], 4), ([130, 64], 2)])
def test_t_pre_through_segments(cpu_kernels, lens, parts):
    """With segments (few long sequences) T is computed once over all N P segments and each
    pass reads it from its first segment's slot on: the standard segmented path's result bit
    for bit (its own T formed per pass), every slot a pass reads written (NaN elsewhere)."""
    inputs = _inputs(lens, 1, 2, seed=8)
    q, k, v, g, beta, state, cu = inputs
    outs = {}
    for t_pre in (False, True):
        out = torch.empty_like(v)
        final = torch.empty(len(lens), 2, 128, 128)
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, 128**-0.5,
                                   k_last=False, l2norm=False, segments=parts,
                                   t_pre=t_pre)  # fmt: skip
        outs[t_pre] = (out, final)
    assert torch.equal(outs[True][0], outs[False][0]) and torch.equal(outs[True][1], outs[False][1])
    assert sum(name == T_PRE_SPEC.name for name, _ in cpu_kernels) == 1
    (buf,) = cpu_kernels.buffers
    assert buf.shape[0] == t_slots(sum(lens), len(lens) * parts) * CHUNK


# ------------------------------------------------------------------------ the default route

# The suite's cases on the H100, 2026-12-06 19:40-19:51 (benchmarks/reports/sm_90a/
# gdn_prefill.md): ours (then always the standard form) and its `t_pre` variant, ms, graph
# replays and eager launches.
MEASURED = {
    "1x2048-h16-hv32": (0.0869, 0.0598, 0.0932, 0.0684),
    "1x4096-h16-hv32": (0.1720, 0.1132, 0.1759, 0.1224),
    "1x16384-h16-hv32": (0.6697, 0.4185, 0.6730, 0.4281),
    "1x65536-h16-hv32": (2.6775, 1.7177, 2.6571, 1.7186),
    "1x131072-h16-hv16": (2.9738, 2.6542, 3.0353, 2.7312),
    "8x32768-h16-hv16": (2.2279, 2.4420, 2.1049, 2.4310),
    "4x8192-h16-hv32": (0.5715, 0.5060, 0.5430, 0.5062),
    "4x8192-h16-hv16": (0.3734, 0.3193, 0.3820, 0.3279),
    "4x8192-h16-hv32-nostate": (0.5692, 0.4984, 0.5562, 0.5016),
    "8x2048-h4-hv8": (0.1022, 0.0786, 0.1076, 0.0865),
    "mix16-t16384-h16-hv32": (0.4933, 0.3462, 0.4989, 0.3563),
    "mix64-t32768-h16-hv32": (1.0372, 0.7722, 1.0558, 0.7911),
    "mix64-t65536-h4-hv8": (1.6992, 0.8969, 1.6890, 0.9003),
    "1x16384-h16-hv32-nostate": (0.7159, 0.4160, 0.7195, 0.4270),
    "16x2048-h16-hv32-nostate": (0.5755, 0.5232, 0.5552, 0.5233),
    "mix64-t32768-h16-hv32-nostate": (1.0063, 0.6967, 1.0252, 0.7139),
}
H100_SMS = 132


@pytest.mark.parametrize("case", BENCH_CASES, ids=lambda c: c.name)
def test_the_rule_picks_the_faster_form_of_the_measured_table(case):
    """On each suite case the launcher takes the form that was faster in both of the H100's
    columns (the standard form only on 8x32768-h16-hv16: direct, unsplit, HV = H), and the
    suite's `uses_t_pre` (which names the variant) agrees."""
    lens, h, hv = case.params["lens"], case.params["h"], case.params["hv"]
    n = len(lens)
    parts = prefill_launch.segments_for(n, hv, sum(lens), H100_SMS)
    split = v_split_for(n, hv, H100_SMS)
    std_graph, t_pre_graph, std_eager, t_pre_eager = MEASURED[case.name]
    pick = prefill_launch.t_pre_for(h, hv, split, parts)
    assert pick == (t_pre_graph < std_graph) == (t_pre_eager < std_eager)
    assert gdn_prefill_suite.uses_t_pre(case) == pick
    assert set(MEASURED) == {c.name for c in BENCH_CASES}


@pytest.mark.parametrize(("heads", "value_heads", "v_split", "segments", "t_pre"), [
    (16, 16, 1, 1, False),  # direct, unsplit, ungrouped: 8x32768-h16-hv16
    (16, 32, 1, 1, True),  # grouped: q, k read once a group
    (16, 16, 2, 1, True),  # split: 4x8192-h16-hv16
    (16, 16, 1, 9, True),  # segments: 1x131072-h16-hv16 (T once for three passes)
    (4, 8, 1, 1, True),
])  # fmt: skip
def test_t_pre_everywhere_but_unsplit_ungrouped_direct(heads, value_heads, v_split, segments,
                                                       t_pre):  # fmt: skip
    assert prefill_launch.t_pre_for(heads, value_heads, v_split, segments) is t_pre


@pytest.mark.parametrize(
    ("lens", "h", "hv", "sms", "init", "l2norm", "k_last", "dtype", "t_pre"),
    [
        (LENS, 2, 4, 1, True, False, False, torch.bfloat16, True),  # varlen, grouped, unsplit
        ([3, 129, 7], 1, 2, 1, False, True, False, torch.float16, True),  # no state, l2norm
        ([200], 4, 8, 1, True, True, True, torch.bfloat16, True),  # FlashInfer's layout
        ([200, 0, 70], 2, 2, 10**6, True, False, False, torch.bfloat16, True),  # HV = H, split
        ([200, 0, 70], 2, 2, 1, True, False, False, torch.bfloat16, False),  # HV = H, unsplit
        ([130, 64], 2, 2, 1, False, False, True, torch.float16, False),  # the same, no state
    ],
)
def test_default_route_is_the_forced_form_bit_for_bit(
    cpu_kernels, monkeypatch, lens, h, hv, sms, init, l2norm, k_last, dtype, t_pre
):  # fmt: skip
    """The launcher's own choice (t_pre=None) is the form `t_pre_for` names, forced: the same
    keys asked for, o and the final state bit for bit."""
    monkeypatch.setattr(prefill_launch, "_sms", lambda device: sms)
    inputs = _inputs(lens, h, hv, seed=sum(lens) + h, dtype=dtype,
                     scale_k=16.0 if l2norm else 1.0)  # fmt: skip
    kw = dict(init=init, k_last=k_last, l2norm=l2norm, v_split=None)
    o_default, s_default = _run(inputs, t_pre=None, **kw)
    keys = list(cpu_kernels)
    o_forced, s_forced = _run(inputs, t_pre=t_pre, **kw)
    assert torch.equal(o_default, o_forced) and torch.equal(s_default, s_forced)
    assert keys == cpu_kernels[len(keys) :] and len(keys) == (2 if t_pre else 1)
    assert keys[0][1].get("t_pre", False) is t_pre
    assert keys[0][1]["v_split"] == (2 if sms > 1 else 1)


def test_default_route_segments_in_the_t_pre_form(cpu_kernels, monkeypatch):
    """Where the launcher segments by itself (HV = H here: the segments, not the heads, pick
    the form) it takes the t_pre form, T once for the three passes: bit for bit the segments
    forced with t_pre."""
    monkeypatch.setattr(prefill_launch, "SEGMENT_MIN_TOKENS", 64)
    monkeypatch.setattr(prefill_launch, "_sms", lambda device: 16)
    inputs = _inputs([300], 2, 2, seed=31)
    parts = prefill_launch.segments_for(1, 2, 300, 16)
    assert parts > 1
    o_default, s_default = _run(inputs, t_pre=None, init=True, v_split=None, segments=None)
    keys = list(cpu_kernels)
    o_forced, s_forced = _run(inputs, t_pre=True, init=True, v_split=None, segments=parts)
    assert torch.equal(o_default, o_forced) and torch.equal(s_default, s_forced)
    assert keys == cpu_kernels[len(keys) :]
    assert [name for name, _ in keys] == [T_PRE_SPEC.name] + [SPEC.name] * 3
    assert all(p["t_pre"] for name, p in keys if name == SPEC.name)
