"""The chunked Gated DeltaNet forward's op and launcher on the CPU (the GPU's checks:
tests/gpu/test_gdn_prefill_gpu.py): the kernel's tile math replayed in torch (tests/
gdn_prefill_replay.py: the per-chunk schedule, the factor tables and masks, the 16-bit roundings
of every WGMMA operand, the blocked inverse phase by phase (tf32 merges), S^T in two 64-row
halves, a tail chunk seeing the next sequence's rows) through the real launcher against the fp64
recurrence: varlen with empty and odd sequences, initial states in both layouts, l2norm,
grouped value heads, strong decays; the inverse's schedule and accuracy on its own; the
FlashInfer-Bench definition's own reference through the adapter; argument errors.

Tolerances: o within 2e-2 of max |o| (its bf16 rounding is ~4e-3); the final state within 2e-2
of max |S| in bf16 (4e-3 in fp16): the state update's operands (U, k) and S^T as the next
chunk's operand are 16-bit, as in fla (the replay's error is ~1x the bf16 epsilon)."""

from __future__ import annotations

import importlib

import gdn_prefill_replay as replay
import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import CHUNK
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
STATE_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


SPLIT_SMS = {1: 1, 2: 10**6}  # SM counts under which the launcher chooses V split 1 / 2


@pytest.fixture(params=sorted(SPLIT_SMS), ids=lambda s: f"vsplit{s}")
def cpu_kernel(monkeypatch, request):
    """The replay as the compiled kernel, on a device of 1 SM (never split) or of a million
    (always split: each state's value rows over two CTAs); `.v_split` says which."""
    calls = CallLog()
    calls.v_split = request.param

    def get(spec, params):
        calls.append(dict(params))
        return replay_kernel(spec, params)

    monkeypatch.setattr(prefill_launch, "get_kernel", get)
    monkeypatch.setattr(prefill_launch, "_sms", lambda device: SPLIT_SMS[request.param])
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    return calls


class CallLog(list):
    v_split = 1


def replay_kernel(spec, params):
    """The replay's stand-in for `spec`: the T precompute or the chunked kernel (either form)."""
    if spec is prefill_launch.T_PRE_SPEC:
        return replay.t_pre_kernel(dict(params))
    return replay.kernel(dict(params))


def chunked_keys(calls):
    """The chunked kernel's keys among a log's (the precompute's key has no "v")."""
    return [c for c in calls if "v" in c]


def expected_keys(dtype, h, hv, split, *, k_last, l2norm, init):
    """The keys the launcher asks for on a direct launch: the chunked kernel's in the form
    `t_pre_for` picks (the standard form with its O warp), then the precompute's where that is
    the t_pre form."""
    t_pre = prefill_launch.t_pre_for(h, hv, split, 1)
    key = prefill_launch.params_for(dtype, k_last=k_last, l2norm=l2norm, initial_state=init,
                                    v_split=split, t_pre=t_pre, o_warp=not t_pre)  # fmt: skip
    pre = [dict(prefill_launch.t_pre_params_for(dtype, l2norm=l2norm))] if t_pre else []
    return [dict(key), *pre]


def _inputs(b, t, h, hv, *, n=None, seed=0, beta_dtype=torch.float32, dtype=torch.bfloat16):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, 128, generator=gen).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(b, t, h, 128, generator=gen), dim=-1).to(dtype)
    v = torch.randn(b, t, hv, 128, generator=gen).to(dtype)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, hv, generator=gen) + 2.0)
    beta = torch.rand(b, t, hv, generator=gen).to(beta_dtype)
    state = torch.randn(n or b, hv, 128, 128, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _close(got, want, rel):
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-6, err


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "with_state", "k_last"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, True, False),  # varlen: empty and odd sequences
        ([200], 4, 8, True, True, True),  # one long sequence, FlashInfer's layout
        ([3, 129, 7], 1, 2, True, False, False),  # no initial state
        ([64, 64], 2, 2, False, True, True),  # H = HV
    ],
)
def test_varlen_matches_the_recurrence(cpu_kernel, lens, h, hv, l2norm, with_state, k_last):
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, state = _inputs(1, total, h, hv, n=n, seed=total)
    if l2norm:  # unnormalized keys: the kernel's l2norm is what keeps the recurrence stable
        k = k * 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    init = state if with_state else None
    theirs = None if init is None else (init.transpose(-1, -2).contiguous() if k_last else init)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=theirs, output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                   k_last=k_last)  # fmt: skip
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm=l2norm)  # fmt: skip
    assert o.shape == v.shape and o.dtype == q.dtype
    _close(o, want_o, 2e-2)
    _close(final.transpose(-1, -2) if k_last else final, want_s, STATE_TOL[torch.bfloat16])
    assert cpu_kernel == expected_keys("bfloat16", h, hv, cpu_kernel.v_split, k_last=k_last,
                                       l2norm=l2norm, init=with_state)  # fmt: skip


def test_use_qk_l2norm_is_issue_20s_name_of_the_fla_keyword(cpu_kernel):
    """use_qk_l2norm= (issue 20) and use_qk_l2norm_in_kernel= (fla) are one argument: either
    gives the recurrence's numbers with l2norm; both given and different is an error."""
    q, k, v, g, beta, state = _inputs(1, 70, 2, 4, seed=11)
    k = k * 16  # unnormalized keys: only the l2norm keeps the recurrence stable
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True,
                                                use_qk_l2norm=True)  # fmt: skip
    kw = {"initial_state": state, "output_final_state": True}
    o, final = op.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, **kw)
    _close(o, want_o, 2e-2)
    _close(final, want_s, STATE_TOL[torch.bfloat16])
    fla_o, fla_final = op.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, **kw)
    both_o, _ = op.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                    use_qk_l2norm=True, **kw)  # fmt: skip
    assert torch.equal(o, fla_o) and torch.equal(final, fla_final) and torch.equal(o, both_o)
    assert all(c["l2norm"] for c in cpu_kernel)
    with pytest.raises(ValueError, match="use_qk_l2norm_in_kernel=True and use_qk_l2norm=False"):
        op.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, use_qk_l2norm=False)


def test_fixed_length_batch_and_no_final_state(cpu_kernel):
    q, k, v, g, beta, state = _inputs(2, 77, 2, 4, seed=3, beta_dtype=torch.bfloat16)
    o, final = op.gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=state)
    assert final is None
    want, _ = gated_delta_rule_recurrent(q, k, v, g, beta.float(), scale=0.3, initial_state=state)
    _close(o, want, 2e-2)


def test_strong_decay_on_a_long_chunk_stays_finite(cpu_kernel):
    """Log decays of -20 per token: exp(G) of a chunk reaches e^-1280; no exponent is positive,
    so nothing overflows (the state is forgotten at once, o ~ beta v of the current token)."""
    q, k, v, g, beta, _ = _inputs(1, 150, 1, 1, seed=4)
    g = torch.full_like(g, -20.0)
    o, final = op.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    want, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o.float()).all() and torch.isfinite(final).all()
    _close(o, want, 2e-2)
    _close(final, want_s, STATE_TOL[torch.bfloat16])


@pytest.mark.parametrize("k_last", [False, True])
def test_all_sequences_empty(cpu_kernel, k_last):
    """T = 0: the launcher returns the initial state (zeros without one) without a launch (a
    TMA descriptor cannot span zero tokens)."""
    q, k, v, g, beta, state = _inputs(1, 0, 2, 4, n=2)
    theirs = state.transpose(-1, -2).contiguous() if k_last else state
    cu = torch.tensor([0, 0, 0])
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=theirs, output_final_state=True,
                                   cu_seqlens=cu, k_last=k_last)  # fmt: skip
    assert o.shape == v.shape and torch.equal(final, theirs) and not cpu_kernel  # no launch
    _, zero = op.gated_delta_rule(q, k, v, g, beta, output_final_state=True, cu_seqlens=cu)
    assert torch.equal(zero, torch.zeros_like(zero))


def test_fp16_initial_state_and_odd_tail(cpu_kernel):
    q, k, v, g, beta, state = _inputs(1, 133, 2, 4, seed=5, dtype=torch.float16)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    want, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state,
                                              output_final_state=True)  # fmt: skip
    assert o.dtype == torch.float16
    _close(o, want, 2e-2)
    _close(final, want_s, STATE_TOL[torch.float16])


def test_a_tail_chunk_ignores_the_next_sequence(cpu_kernel):
    """A sequence's last chunk reads the next sequence's rows (its TMA box runs on): with huge
    values there, the first sequence's outputs and state equal those of it run alone."""
    q, k, v, g, beta, state = _inputs(1, 70 + 90, 1, 2, n=2, seed=6)
    q[:, 70:], k[:, 70:], v[:, 70:] = q[:, 70:] * 300, k[:, 70:] * 300, v[:, 70:] * 300
    cu = torch.tensor([0, 70, 160])
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True,
                                   cu_seqlens=cu)  # fmt: skip
    alone, alone_s = op.gated_delta_rule(q[:, :70], k[:, :70], v[:, :70], g[:, :70],
                                         beta[:, :70], initial_state=state[:1],
                                         output_final_state=True)  # fmt: skip
    assert torch.equal(o[:, :70], alone) and torch.equal(final[:1], alone_s)


@pytest.mark.parametrize("decay", [0.0, -0.05, -1.0, -30.0])
def test_blocked_inverse_matches_fp64(decay):
    """The kernel's T = (I + L)^-1 (phases, lanes' data movement; a phase that read a block
    another warp writes in it, or overwrote one another warp reads, would assert) against the
    fp64 inverse, on the L the kernel builds (beta in (0, 1], unit keys, the chunk's decays):
    the merges' tf32 products within 1e-3 of max |T| (with fp32 products, the FFMA merges
    dropped 2026-12-03, 1e-5; the tf32 bound's worst case is tests/test_gdn_prefill_aux.py's)."""
    gen = torch.Generator().manual_seed(7)
    k = torch.nn.functional.normalize(torch.randn(CHUNK, 128, generator=gen), dim=-1)
    beta = torch.rand(CHUNK, generator=gen) * 0.9 + 0.1
    g = torch.full((CHUNK,), decay) + 0.01 * torch.randn(CHUNK, generator=gen).clamp(max=0)
    big = g.cumsum(0)
    rows = torch.arange(CHUNK)
    below = rows[None, :] < rows[:, None]
    decays = torch.where(below, (big[:, None] - big[None, :]).exp(), torch.zeros(()))
    lower = (k @ k.t()) * decays * beta[:, None]
    got = replay.blocked_inverse(lower)
    want = torch.linalg.inv(torch.eye(CHUNK, dtype=torch.float64) + lower.double())
    assert torch.equal(got.triu(1), torch.zeros_like(got))
    assert float((got.double() - want).abs().max()) <= 1e-3 * float(want.abs().max())


def test_gate_scan_is_the_chunk_cumsum():
    g = -torch.rand(CHUNK, generator=torch.Generator().manual_seed(8))
    assert torch.allclose(replay.gates(g), g.cumsum(0) * replay.LOG2E, rtol=1e-6, atol=1e-6)


def _definition_inputs(lens, seed, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    total, n = sum(lens), len(lens)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "q": rnd(total, 4, 128).to(torch.bfloat16),
        "k": torch.nn.functional.normalize(rnd(total, 4, 128), dim=-1).to(torch.bfloat16),
        "v": rnd(total, 8, 128).to(torch.bfloat16),
        "state": rnd(n, 8, 128, 128, scale=0.1) if with_state else None,
        "A_log": rnd(8, scale=0.5), "a": rnd(total, 8).to(torch.bfloat16),
        "dt_bias": rnd(8, scale=0.5), "b": rnd(total, 8).to(torch.bfloat16),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        "scale": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(("lens", "with_state"), [([5, 0, 70], True), ([33], False)])
def test_flashinfer_prefill_definition(cpu_kernel, lens, with_state):
    name = "gdn_prefill_qk4_v8_d128_k_last"
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    inputs = _definition_inputs(lens, sum(lens), with_state)
    if with_state:  # (check_inputs reads every input's dtype; the state is optional)
        defs.check_inputs(defn, inputs)
    theirs_out, theirs_state = defs.run_definition(defn, inputs)
    before = None if inputs["state"] is None else inputs["state"].clone()
    out, state = op.gdn_prefill_flashinfer(**inputs)
    assert out.shape == theirs_out.shape and out.dtype == torch.bfloat16
    assert state.shape == theirs_state.shape and state.dtype == torch.float32
    assert before is None or torch.equal(inputs["state"], before)  # theirs is not modified
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(state, theirs_state) == 0
    assert torch.all(state[1] == 0) if lens[1:2] == [0] else True  # an empty sequence: zeros
    ours_out, ours_state = defs.run_kernel(defn, inputs)  # by op_type: the same adapter
    assert torch.equal(ours_out, out) and torch.equal(ours_state, state)


def _bad(change):
    q, k, v, g, beta, state = _inputs(1, 9, 2, 4, n=2)
    kw = {"initial_state": state, "cu_seqlens": torch.tensor([0, 4, 9])}
    args = [q, k, v, g, beta]
    change(args, kw)
    return args, kw


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        (lambda a, kw: a.__setitem__(2, a[2][:, :, :3]), ValueError, "multiple of H"),
        (lambda a, kw: a.__setitem__(0, a[0][..., :64]), ValueError, "k must have shape"),
        (lambda a, kw: a.__setitem__(3, a[3].double()), TypeError, "g must have dtype"),
        (lambda a, kw: a.__setitem__(4, a[4][..., :2]), ValueError, "beta must have shape"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 4, 8])), ValueError, "rise from 0"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 5, 4, 9])), ValueError, "rise"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0.0, 9.0])), TypeError, "cu_seqlens"),
        (lambda a, kw: kw.update(initial_state=kw["initial_state"][:1]), ValueError,
         "initial_state must have shape"),
        (lambda a, kw: kw.update(initial_state=kw["initial_state"].half()), TypeError,
         "initial_state must have dtype"),
        # the 2026-12-05 audit: float() took any scale, the flags reached the custom op's schema
        (lambda a, kw: kw.update(scale=float("nan")), ValueError, "scale must be finite"),
        (lambda a, kw: kw.update(scale="0.1"), TypeError, "scale must be a float or None"),
        (lambda a, kw: kw.update(output_final_state="yes"), TypeError,
         "output_final_state must be a bool"),
        (lambda a, kw: kw.update(use_qk_l2norm_in_kernel=1), TypeError,
         "use_qk_l2norm_in_kernel must be a bool"),
        (lambda a, kw: kw.update(k_last=None), TypeError, "k_last must be a bool"),
        (lambda a, kw: kw.update(out=torch.empty(1, 9, 4, 128, device="meta",
                                                 dtype=torch.bfloat16)), ValueError,
         "out is on meta but q is on cpu"),
    ],
)  # fmt: skip
def test_bad_arguments(cpu_kernel, change, err, match):
    args, kw = _bad(change)
    with pytest.raises(err, match=match):
        op.gated_delta_rule(*args, **kw)


def test_varlen_needs_batch_one_and_head_dims_128(cpu_kernel):
    q, k, v, g, beta, _ = _inputs(2, 5, 1, 1)
    with pytest.raises(ValueError, match="B = 1"):
        op.gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"\(K, V\)"):
        op.gated_delta_rule(q[..., :64], k[..., :64], v, g, beta)


def test_too_many_sequences_are_refused(cpu_kernel):
    """The grid is (HV x V split, N): N above gridDim.y's 65535 would fail the launch."""
    q, k, v, g, beta, _ = _inputs(1, 65536, 1, 1)
    cu = torch.arange(65537, dtype=torch.int32)
    with pytest.raises(ValueError, match="at most 65535 sequences"):
        op.gated_delta_rule(q, k, v, g, beta, cu_seqlens=cu)
    assert not cpu_kernel


@pytest.mark.parametrize(("n", "hv", "sms", "split"), [
    (1, 32, 132, 2),  # 1 x 65536 h16 hv32: 32 CTAs -> 64
    (2, 32, 132, 2),  # 64 CTAs -> 128, one wave still
    (4, 32, 132, 1),  # 128 CTAs: doubled, a second wave
    (3, 32, 132, 1),  # 96: 192 would not fit one wave
    (1, 8, 114, 2),  # H100 PCIe
    (64, 32, 132, 1),
])  # fmt: skip
def test_v_split_only_where_it_adds_sms(n, hv, sms, split):
    assert op.prefill_sm90.v_split_for(n, hv, sms) == split


def test_v_split_parts_tile_the_value_rows():
    """Each CTA of a split holds contiguous value rows (its v tile's columns), together all V."""
    assert replay.split_parts(128, 1) == [slice(0, 128)]
    assert replay.split_parts(128, 2) == [slice(0, 64), slice(64, 128)]


def test_v_split_is_exact(monkeypatch):
    """The value rows of S^T never mix (each row's products read only itself, q, k and the
    aux pieces): the split kernel's outputs and states equal the unsplit one's bit for bit."""
    q, k, v, g, beta, state = _inputs(1, 150, 2, 4, n=2, seed=9)
    cu = torch.tensor([0, 61, 150])
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    got = {}
    for split, sms in SPLIT_SMS.items():
        monkeypatch.setattr(prefill_launch, "_sms", lambda device, sms=sms: sms)
        monkeypatch.setattr(prefill_launch, "get_kernel", replay_kernel)
        got[split] = op.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                         output_final_state=True, cu_seqlens=cu)  # fmt: skip
    assert torch.equal(got[1][0], got[2][0]) and torch.equal(got[1][1], got[2][1])


def test_cpu_tensors_are_refused():
    q, k, v, g, beta, _ = _inputs(1, 5, 1, 1)
    with pytest.raises(ValueError, match="CUDA"):
        op.gated_delta_rule(q, k, v, g, beta)


def test_fake_gives_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(7, 2, 128, dtype=torch.bfloat16), torch.empty(7, 2, 128)
        v, g = torch.empty(7, 4, 128, dtype=torch.bfloat16), torch.empty(7, 4)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        o, s = torch.ops.forgekernel.gated_delta_rule_chunked(q, k.bfloat16(), v, g, g, None, cu,
                                                               0.1, True, False)  # fmt: skip
    assert o.shape == (7, 4, 128) and o.dtype == torch.bfloat16
    assert s.shape == (2, 4, 128, 128) and s.dtype == torch.float32


@pytest.mark.parametrize(
    ("lens", "parts", "with_state", "k_last"),
    [
        ([300, 0, 130], 4, True, False),  # an empty sequence; pieces past the second's end
        ([450], 8, False, True),  # one sequence, no initial state, FlashInfer's layout
        ([257, 200], 2, True, True),  # partial last chunks
        ([300], 2, True, False),  # two segments: no pass B (no M needed)
    ],
)
def test_segments_match_the_recurrence(cpu_kernel, lens, parts, with_state, k_last):
    """Each sequence cut into `parts` segments (passes A, B, the scan, pass C): o and the final
    state within the direct launch's bounds of the fp64 recurrence, and near the direct launch
    (the transition M from c I's pass: its rounding ~ the state's own)."""
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, state = _inputs(1, total, 2, 4, n=n, seed=total + parts)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    init = state if with_state else None
    theirs = None if init is None else (init.transpose(-1, -2).contiguous() if k_last else init)
    got = {}
    for p in (1, parts):
        o = torch.empty(v[0].numel() + 1, dtype=v.dtype)[1:].view(v[0].shape)  # misaligned
        final = torch.empty(n, 4, 128, 128)
        prefill_launch.gdn_prefill(q[0], k[0], v[0], g[0], beta[0], theirs, cu, o, final,
                                   128**-0.5, k_last=k_last, l2norm=False,
                                   segments=p)  # fmt: skip
        got[p] = (o, final.transpose(-1, -2) if k_last else final)
    passes = 3 if n * parts > 2 else 2  # A, B, C; B only where some M is needed
    chunked = chunked_keys(cpu_kernel)
    assert len(chunked) == 1 + passes  # the direct launch first
    assert [c["initial_state"] for c in chunked[1:]] == [True] * passes
    # h 2, hv 4: both launches in the t_pre form (launch.t_pre_for), T once for the passes
    assert all(c["t_pre"] for c in chunked) and len(cpu_kernel) == len(chunked) + 2
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True,
                                                cu_seqlens=cu.long())  # fmt: skip
    _close(got[parts][0], want_o[0], 2e-2)
    _close(got[parts][1], want_s, STATE_TOL[torch.bfloat16])
    _close(got[parts][0], got[1][0], 2e-2)
    _close(got[parts][1], got[1][1], STATE_TOL[torch.bfloat16])


def test_segment_offsets_cut_whole_chunks():
    cu = torch.tensor([0, 300, 300, 430], dtype=torch.int32)
    got = prefill_launch._segment_offsets(cu, 4).tolist()
    # 300 tokens: 5 chunks -> 2 a piece (128 tokens); 130: 3 chunks -> 1 a piece; 0: empty
    assert got == [0, 128, 256, 300, 300, 300, 300, 300, 300, 364, 428, 430, 430]
    assert prefill_launch._segment_offsets(cu, 4).dtype == torch.int32


@pytest.mark.parametrize(("n", "hv", "tokens", "sms", "parts"), [
    (1, 16, 131072, 132, 9),  # the suite's 1 x 131072 hv16: 8 segments, 128 CTAs a pass
    (1, 32, 65536, 132, 1),  # 64 split CTAs already beat three passes (3 x 0.0434 x 32 > 1)
    (1, 16, 8192, 132, 1),  # short: launches and the scan not amortized
    (1, 8, 65536, 132, 16),  # capped at MAX_SEGMENTS
    (2, 8, 40000, 132, 8),  # 15 segments a pass: 120 CTAs
    (4, 16, 131072, 132, 1),
    (1, 16, 131072, 114, 1),  # H100 PCIe: N HV > SMs / 8
    (1, 8, 131072, 114, 15),  # 112 CTAs a pass
])  # fmt: skip
def test_segments_only_for_few_long_sequences(n, hv, tokens, sms, parts):
    assert op.prefill_sm90.segments_for(n, hv, tokens, sms) == parts


def test_the_launcher_segments_on_its_own(cpu_kernel, monkeypatch):
    """With the thresholds lowered, the op takes the segmented path by itself (three launches)
    and still matches the recurrence."""
    monkeypatch.setattr(prefill_launch, "SEGMENT_MIN_TOKENS", 64)
    monkeypatch.setattr(prefill_launch, "_sms", lambda device: 16)
    q, k, v, g, beta, state = _inputs(1, 260, 1, 2, seed=21)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=state, output_final_state=True)
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state,
                                                output_final_state=True)  # fmt: skip
    assert len(chunked_keys(cpu_kernel)) == 3 and len(cpu_kernel) == 4  # T once, 3 passes
    _close(o, want_o, 2e-2)
    _close(final, want_s, STATE_TOL[torch.bfloat16])
