"""The chunked Gated DeltaNet prefill forward (TMA + WGMMA kernel, issue 20) on the GPU against
the fp64 recurrence: varlen with empty, single-token, sub-chunk and odd sequences (tail chunks
that read the next sequence's rows), one long sequence (64 chunks), both state layouts, with and
without an initial state, l2norm on unnormalized keys, grouped value heads, fp16 and bf16, more
CTAs than SMs, the V split (two CTAs per head, bitwise the unsplit kernel), strong / no decay,
misaligned inputs (the launcher's copies); torch.compile; the
FlashInfer-Bench definition through its adapter; fla's chunk_gated_delta_rule where installed.

Tolerances: o within 2e-2 of max |o|; the final state within 2e-2 (bf16) / 4e-3 (fp16) of
max |S|: the WGMMA operands are 16-bit (tests/test_gdn_prefill.py's CPU replay of the same
tile math sits at ~1x the bf16 epsilon)."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
STATE_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}


def _inputs(lens, h, hv, dtype, seed=0, knorm=1.0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, total, h, 128).to(dtype)
    k = (F.normalize(rnd(1, total, h, 128), dim=-1) * knorm).to(dtype)
    v = rnd(1, total, hv, 128).to(dtype)
    g, beta = F.logsigmoid(rnd(1, total, hv) + 2.0), torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, v, g, beta, state, cu


def _close(got, want, rel):
    assert got.shape == want.shape
    if want.numel() == 0:  # T = 0: max() of an empty tensor raises
        return
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, err


def _check(q, k, v, g, beta, state, cu, *, k_last=False, l2norm=False, with_state=True):
    init = state if with_state else None
    theirs = None if init is None else (init.transpose(-1, -2).contiguous() if k_last else init)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=theirs, output_final_state=True,
                                   cu_seqlens=cu.int(), use_qk_l2norm_in_kernel=l2norm,
                                   k_last=k_last)  # fmt: skip
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm=l2norm)  # fmt: skip
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    _close(o, want_o, 2e-2)
    _close(final.transpose(-1, -2) if k_last else final, want_s, STATE_TOL[q.dtype])
    return o, final


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "k_last", "l2norm", "with_state"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True),
        ([1000], 4, 8, True, True, True),
        ([3, 129, 7], 16, 32, False, True, False),
        ([300, 301], 16, 16, True, False, True),
        ([1], 1, 1, False, False, True),
        ([17, 5, 0, 0, 40], 1, 3, True, False, False),
        ([0, 0], 1, 2, True, False, True),  # T = 0: no launch, the initial state returned
    ],
)
def test_prefill_matches_the_recurrence(dtype, lens, h, hv, k_last, l2norm, with_state):
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype, knorm=4.0 if l2norm else 1.0)
    _check(q, k, v, g, beta, state, cu, k_last=k_last, l2norm=l2norm, with_state=with_state)


def test_one_long_sequence():
    """64 chunks on one CTA per head: the state carried through every chunk's recurrence."""
    _check(*_inputs([4096], 2, 4, torch.bfloat16, seed=1))


def test_more_ctas_than_sms():
    lens = [33 + 7 * (i % 9) for i in range(48)]
    _check(*_inputs(lens, 4, 8, torch.bfloat16, seed=2), k_last=True)


@pytest.mark.parametrize(
    ("lens", "h", "hv", "k_last", "l2norm", "with_state"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True),
        ([700], 16, 32, True, True, True),
        ([129, 3], 4, 8, False, True, False),
    ],
)
def test_v_split_is_bitwise_the_unsplit_kernel(
    monkeypatch, lens, h, hv, k_last, l2norm, with_state
):
    """Two CTAs per (sequence, head), each holding 64 value rows of the state (the launcher's
    choice when N HV <= SMs / 2), compute every row exactly as the one CTA does: outputs and
    final states equal bit for bit; each also matches the recurrence."""
    knorm = 4.0 if l2norm else 1.0  # unnormalized keys only where the kernel normalizes
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, torch.bfloat16, seed=11, knorm=knorm)
    got = []
    for sms in (1, 10**6):  # never split, always split
        monkeypatch.setattr(prefill_launch, "_sms", lambda device, sms=sms: sms)
        got.append(_check(q, k, v, g, beta, state, cu, k_last=k_last, l2norm=l2norm,
                          with_state=with_state))  # fmt: skip
    assert torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1])


@pytest.mark.parametrize("decay", [0.0, -20.0])
def test_no_and_strong_decay(decay):
    """g = 0 (nothing forgotten, beta up to 1) and g = -20 (2^-1846 over a chunk: every
    exponent the kernel forms is <= 0, nothing overflows, the state is forgotten at once)."""
    q, k, v, g, beta, state, cu = _inputs([70, 150], 2, 2, torch.bfloat16, seed=3)
    _check(q, k, v, torch.full_like(g, decay), beta, state, cu)


def test_tail_chunks_ignore_the_next_sequence():
    """Sequence 0's last chunk reads sequence 1's rows (TMA boxes run on): huge values there
    change nothing of sequence 0."""
    q, k, v, g, beta, state, cu = _inputs([70, 90], 1, 2, torch.bfloat16, seed=4)
    o, final = _check(q, k, v, g, beta, state, cu)
    big = [x.clone() for x in (q, k, v)]
    for x in big:
        x[:, 70:] *= 300
    o2, final2 = op.gated_delta_rule(*big, g, beta, initial_state=state, output_final_state=True,
                                     cu_seqlens=cu.int())  # fmt: skip
    assert torch.equal(o[:, :70], o2[:, :70]) and torch.equal(final[0], final2[0])


def test_misaligned_inputs_and_out():
    """Contiguous views at a 2-byte offset (not 16-byte aligned): the launcher copies q, k, v
    and the initial state, and writes out through an aligned temporary."""
    q, k, v, g, beta, state, cu = _inputs([77], 2, 4, torch.bfloat16, seed=5)

    def shifted(x):
        flat = torch.empty(x.numel() + 1, dtype=x.dtype, device=x.device)
        view = flat[1:].view(x.shape)
        view.copy_(x)
        return view

    out = shifted(torch.zeros_like(v))
    o, final = op.gated_delta_rule(shifted(q), shifted(k), shifted(v), g, beta,
                                   initial_state=shifted(state), output_final_state=True,
                                   cu_seqlens=cu.int(), out=out)  # fmt: skip
    want, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=state,
                                              output_final_state=True, cu_seqlens=cu)  # fmt: skip
    assert o.data_ptr() == out.data_ptr()
    _close(out, want, 2e-2)
    _close(final, want_s, STATE_TOL[torch.bfloat16])


def test_fixed_batch_and_torch_compile():
    q, k, v, g, beta, _, _ = _inputs([2 * 333], 2, 4, torch.bfloat16, seed=1)
    q, k, v, g, beta = (x.view(2, 333, *x.shape[2:]) for x in (q, k, v, g, beta))
    eager, _ = op.gated_delta_rule(q, k, v, g, beta)
    compiled, _ = torch.compile(op.gated_delta_rule, fullgraph=True)(q, k, v, g, beta)
    want, _ = gated_delta_rule_recurrent(q, k, v, g, beta)
    _close(eager, want, 2e-2)
    assert torch.equal(eager, compiled)


def test_flashinfer_prefill_definition():
    name = "gdn_prefill_qk4_v8_d128_k_last"
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    lens = [5, 0, 700, 64]
    q, k, v, _, _, state, cu = _inputs(lens, 4, 8, torch.bfloat16, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = {
        "q": q[0], "k": k[0], "v": v[0],
        "state": state, "A_log": torch.randn(8, device="cuda", generator=gen) * 0.5,
        "a": torch.randn(sum(lens), 8, device="cuda", generator=gen).bfloat16(),
        "dt_bias": torch.randn(8, device="cuda", generator=gen) * 0.5,
        "b": torch.randn(sum(lens), 8, device="cuda", generator=gen).bfloat16(),
        "cu_seqlens": cu, "scale": 0.0,
    }  # fmt: skip
    theirs_out, theirs_state = defs.run_definition(defn, inputs)
    out, new_state = op.gdn_prefill_flashinfer(**inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(new_state, theirs_state) == 0


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "with_state", "decay"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, True, None),
        ([700], 16, 32, True, True, None),
        ([129, 3], 4, 8, False, False, 0.0),  # no decay: T's largest entries
    ],
)
def test_tensor_core_inverse(dtype, split, lens, h, hv, l2norm, with_state, decay):
    """The inverse's merges on the tensor cores (inverse_mma.py: mma.sync m16n8k8 tf32, the
    standard form since 2026-12-03; checked against the FFMA form on the H200 in bf16 then,
    within 1e-2 of max |o|) against the recurrence, either V split, bf16 and fp16 (fp16's
    rounding of T diag(beta) is as fine as tf32's: its first GPU run); a wrong lane map is off
    by O(1). CPU model: the replay's `blocked_inverse`, the lane -> fragment map
    tests/test_gdn_prefill_aux.py."""
    knorm = 4.0 if l2norm else 1.0
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype, seed=13, knorm=knorm)
    if decay is not None:
        g = torch.full_like(g, decay)
    init = state if with_state else None
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm=l2norm)  # fmt: skip
    o = torch.full_like(v[0], float("nan"))
    final = torch.full_like(state, float("nan"))
    prefill_launch.gdn_prefill(q[0], k[0], v[0], g[0], beta[0], init, cu.int(), o, final,
                               128**-0.5, k_last=False, l2norm=l2norm, v_split=split)  # fmt: skip
    assert torch.isfinite(o).all() and torch.isfinite(final).all()
    _close(o[None], want_o, 2e-2)
    _close(final, want_s, STATE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "k_last", "with_state", "decay"),
    [
        ([1000, 0, 130], 2, 4, False, True, None),  # empty sequence, pieces past the end
        ([2048], 4, 8, True, True, 0.0),  # nothing forgotten: M far from 0
        ([777], 1, 2, False, False, None),
    ],
)
def test_segments_match_the_recurrence(monkeypatch, dtype, lens, h, hv, k_last, with_state,
                                       decay):  # fmt: skip
    """Few long sequences cut into segments (launch._segmented: passes A and B, the scan, pass
    C; here on short sequences by lowered thresholds): o and the final state within the direct
    launch's bounds; fp16 too (pass B's state 64 I: its U and o stay in range)."""
    monkeypatch.setattr(prefill_launch, "SEGMENT_MIN_TOKENS", 64)
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype, seed=31)
    if decay is not None:
        g = torch.full_like(g, decay)
    n = len(lens)
    assert prefill_launch.segments_for(n, hv, sum(lens), prefill_launch._sms(q.device)) > 1
    _check(q, k, v, g, beta, state, cu, k_last=k_last, with_state=with_state)


def test_segments_in_a_cuda_graph():
    """The suite's 1 x 131072 hv16 class (segments_for: 9 on an H200) at 16384 tokens: the
    segmented op captured in a CUDA graph (device-side offsets, no host sync) replays to the
    eager result, which matches the recurrence."""
    q, k, v, g, beta, state, cu = _inputs([16384], 16, 16, torch.bfloat16, seed=32)
    assert prefill_launch.segments_for(1, 16, 16384, prefill_launch._sms(q.device)) == 9
    o, final = _check(q, k, v, g, beta, state, cu)
    kw = {"initial_state": state, "output_final_state": True, "cu_seqlens": cu.int()}
    op.gated_delta_rule(q, k, v, g, beta, **kw)  # warm: compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got_o, got_final = op.gated_delta_rule(q, k, v, g, beta, **kw)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(got_o, o) and torch.equal(got_final, final)


# Last: fla's Triton kernels compile at first call (~20-30 s on a fresh host), which a device
# stream's per-file limit would otherwise spend before the tests of our own kernels.
def test_fla_agrees():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta, state, cu = _inputs([100, 4000, 33], 4, 8, torch.bfloat16, seed=4)
    ours, s_ours = op.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                       output_final_state=True, cu_seqlens=cu)  # fmt: skip
    theirs, s_theirs = fla.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu
    )
    _close(ours, theirs, 3e-2)
    _close(s_ours, s_theirs, 3e-2)
