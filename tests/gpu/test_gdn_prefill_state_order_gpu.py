"""The t_pre form's `state_order` key on the GPU (the two state warpgroups' WGMMA batches in
turns, state_wg.py `_take_turn` / `_pass_turn`; the bench's `t_pre_state_order`): against the
fp64 recurrence on NaN-poisoned outputs (awkward lengths: empty, single-token, partial and
whole chunks; grouped heads, l2norm, both state layouts, with and without a state; bf16 and
fp16); bit for bit the standard path and the lockstep t_pre form (only the issue order moves);
repeated runs against the standard (a wrong turn count hangs: the file's timeout; a hand-over
before the batch's issue would show as differing runs, not as a hang); a CUDA graph; and the
suite's unsplit worst cases timed (-s prints standard, t_pre, t_pre + turns and the precompute
alone; the bench's graph timings decide). Run the whole t_pre file on the key too:
FORGEKERNEL_GDN_PREFILL_STATE_ORDER=1 pytest -m gpu tests/gpu/test_gdn_prefill_t_pre_gpu.py
(every unsplit t_pre launch takes it there). CPU counterparts: tests/test_gdn_prefill_state_order.py
(replay), test_gdn_prefill_rings.py (the turns with the rings), test_gdn_prefill_t_pre_compile.py
(SASS)."""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu
STATE_TOL = {torch.bfloat16: 2e-2, torch.float16: 4e-3}
SCALE = 128**-0.5

CASES = [  # lens, h, hv, k_last, l2norm, with_state
    ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True),
    ([1000], 4, 8, True, True, True),
    ([3, 129, 7], 16, 32, False, True, False),
    ([17, 5, 0, 0, 40], 1, 3, False, False, True),
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


def _run(inputs, *, t_pre, state_order=False, k_last=False, l2norm=False, with_state=True):
    """One unsplit direct launch on NaN-poisoned outputs: the standard path (t_pre False), the
    lockstep t_pre form, or the t_pre form in turns."""
    q, k, v, g, beta, state, cu = inputs
    n, hv = cu.shape[0] - 1, v.shape[1]
    start = None
    if with_state:
        start = state.transpose(-1, -2).contiguous() if k_last else state
    out = torch.full_like(v, float("nan"))
    final = torch.full((n, hv, 128, 128), float("nan"), device="cuda")
    prefill_launch.gdn_prefill(q, k, v, g, beta, start, cu, out, final, SCALE, k_last=k_last,
                               l2norm=l2norm, v_split=1, segments=1, t_pre=t_pre,
                               state_order=state_order if t_pre else None)  # fmt: skip
    return out, (final.transpose(-1, -2) if k_last else final)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("lens", "h", "hv", "k_last", "l2norm", "with_state"), CASES)
def test_state_order_matches_the_recurrence(dtype, lens, h, hv, k_last, l2norm, with_state):
    inputs = _inputs(lens, h, hv, dtype, seed=3, knorm=4.0 if l2norm else 1.0)
    o, final = _run(inputs, t_pre=True, state_order=True, k_last=k_last, l2norm=l2norm,
                    with_state=with_state)  # fmt: skip
    q, k, v, g, beta, state, cu = inputs
    want_o, want_s = gated_delta_rule_recurrent(
        q[None], k[None], v[None], g[None], beta[None], scale=SCALE,
        initial_state=state if with_state else None, output_final_state=True,
        cu_seqlens=cu.long(), use_qk_l2norm=l2norm,
    )  # fmt: skip
    assert torch.isfinite(o).all() and torch.isfinite(final).all()  # every row written
    _close(o, want_o[0], 2e-2)
    _close(final, want_s, STATE_TOL[dtype])


@pytest.mark.parametrize(("lens", "h", "hv", "k_last", "l2norm", "with_state"), CASES)
def test_state_order_is_bitwise_the_standard(lens, h, hv, k_last, l2norm, with_state):
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=4, knorm=4.0 if l2norm else 1.0)
    kw = dict(k_last=k_last, l2norm=l2norm, with_state=with_state)
    o_std, s_std = _run(inputs, t_pre=False, **kw)
    o_lock, s_lock = _run(inputs, t_pre=True, **kw)
    o_turn, s_turn = _run(inputs, t_pre=True, state_order=True, **kw)
    assert torch.equal(o_turn, o_lock) and torch.equal(s_turn, s_lock)
    assert torch.equal(o_turn, o_std) and torch.equal(s_turn, s_std)


REPEAT_CASES = [  # lens, h, hv, with_state
    ([4096], 2, 4, True),  # 64 chunks: 256 turns a warpgroup
    ([300, 301], 16, 16, True),
    ([(37 * i) % 201 for i in range(600)], 2, 4, False),  # many CTAs, 0-4 chunks each
    ([8192] * 4, 16, 32, True),  # the suite's shape: 128 CTAs
]


@pytest.mark.parametrize(("lens", "h", "hv", "with_state"), REPEAT_CASES,
                         ids=["1x4096", "2x300", "600-seqs", "4x8192"])  # fmt: skip
def test_state_order_repeated(lens, h, hv, with_state):
    """REPS runs (STATE_ORDER_REPS, default 6; 1 under the sanitizers) on fresh NaN-poisoned
    outputs, each bit for bit the standard path's."""
    reps = int(os.environ.get("STATE_ORDER_REPS", "6"))
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=11)
    o_std, s_std = _run(inputs, t_pre=False, with_state=with_state)
    bad = []
    for rep in range(reps):
        o, s = _run(inputs, t_pre=True, state_order=True, with_state=with_state)
        if not torch.equal(o, o_std) or not torch.equal(s, s_std):
            bad.append(f"rep {rep}: o {'exact' if torch.equal(o, o_std) else 'differs'}, "
                       f"state {'exact' if torch.equal(s, s_std) else 'differs'}")  # fmt: skip
    print(f"\nstate_order repeated {len(lens)} seqs h{h} hv{hv}: {len(bad)} of {reps} differ")
    assert not bad, bad


def test_state_order_in_a_cuda_graph():
    inputs = _inputs([100, 0, 300], 2, 4, torch.bfloat16, seed=7)
    want_o, want_s = _run(inputs, t_pre=True, state_order=True)
    q, k, v, g, beta, state, cu = inputs
    out = torch.empty_like(v)
    final = torch.empty(3, 4, 128, 128, device="cuda")

    def step():
        prefill_launch.gdn_prefill(q, k, v, g, beta, state, cu, out, final, SCALE, k_last=False,
                                   l2norm=False, v_split=1, segments=1, t_pre=True,
                                   state_order=True)  # fmt: skip

    step()  # compile and load outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    out.fill_(float("nan"))
    final.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want_o) and torch.equal(final, want_s)


def _graph_ms(fn, reps=20):
    """ms a call of fn replayed from a CUDA graph (the bench's form), warm."""
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


TIME_CASES = [  # the suite's unsplit cases (direct launches), the median's class
    ([8192] * 4, 16, 32, True),
    ([8192] * 4, 16, 32, False),
    ([2048] * 16, 16, 32, False),
    ([32768] * 8, 16, 16, True),
]


@pytest.mark.parametrize(("lens", "h", "hv", "with_state"), TIME_CASES,
                         ids=["4x8192-hv32", "4x8192-hv32-nostate", "16x2048-hv32-nostate",
                              "8x32768-hv16"])  # fmt: skip
def test_state_order_times(lens, h, hv, with_state):
    """Both forms bit for bit the standard; graph-replay times printed: the standard path, the
    lockstep t_pre form, the t_pre form in turns, the precompute alone (NOTES, next/gdn-prefill-
    gap: turns / lockstep predicted 0.86-0.95 where the state pair bounds the t_pre chunk, ~1.0
    where the precompute, HBM or the aux does)."""
    inputs = _inputs(lens, h, hv, torch.bfloat16, seed=6)
    o_std, s_std = _run(inputs, t_pre=False, with_state=with_state)
    o_turn, s_turn = _run(inputs, t_pre=True, state_order=True, with_state=with_state)
    assert torch.equal(o_turn, o_std) and torch.equal(s_turn, s_std)
    q, k, v, g, beta, state, cu = inputs
    n = len(lens)
    start = state if with_state else None
    out = torch.empty_like(v)
    final = torch.empty(n, hv, 128, 128, device="cuda")

    def call(**kw):
        return lambda: prefill_launch.gdn_prefill(
            q, k, v, g, beta, start, cu, out, final, SCALE, k_last=False, l2norm=False,
            v_split=1, segments=1, **kw,
        )  # fmt: skip

    std = _graph_ms(call(t_pre=False))
    lock = _graph_ms(call(t_pre=True, state_order=False))
    turn = _graph_ms(call(t_pre=True, state_order=True))
    pre = _graph_ms(lambda: prefill_launch.t_diag_beta(k, g, beta, cu, l2norm=False))
    gpu = torch.cuda.get_device_name()
    print(f"\nstate_order {n}x{lens[0]} h{h} hv{hv} state={with_state} ({gpu}):"
          f" standard {std:.4f} ms, t_pre {lock:.4f} ms ({lock / std:.3f}x), t_pre+turns "
          f"{turn:.4f} ms ({turn / std:.3f}x std, {turn / lock:.3f}x t_pre), precompute "
          f"{pre:.4f} ms")  # fmt: skip
