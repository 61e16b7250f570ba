"""The attention backward's host path on the GPU (next/bwd-host): its workspaces come from the
stream's scratch buffer and every buffer that must start zeroed (dQ accumulator, GQA
head-split dK / dV accumulators, deterministic semaphores, the persistent tile counter) is
zeroed by the preprocess through its widened dQ-accumulator argument, or, when that would pass
twice the accumulator's rows, by one fill. Problems run in turn twice over one stream with the
buffer poisoned (NaN bits) in between: each call's gradients within twice the low-precision
reference's error (+ atol) of the fp32 reference, the second round's deterministic ones
bitwise the first's. A CUDA graph captured after eager calls owns its workspace and replays
right on new inputs. And the host case's host time per call, the op's and each launch's alone
(printed: where the rest of the H200's figure goes)."""

from __future__ import annotations

import pytest
import torch

import forgekernel
from forgekernel.bench.check import true_fp32
from forgekernel.reference.attention import attention_bwd_ref, attention_ref
from forgekernel.runtime import scratch

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
# (b, sq, sk, hq, hkv, d, dv, deterministic): the launch's workspace kinds
PROBLEMS = {
    "host case, head split": (1, 128, 128, 32, 8, 128, 128, False),
    "deterministic, zeroed semaphores": (1, 128, 128, 32, 8, 128, 128, True),
    "MHA, odd length": (2, 300, 300, 4, 4, 128, 128, False),
    "D 64, persistent tile counter": (2, 200, 200, 8, 8, 64, 64, False),
    "192/128": (1, 100, 100, 4, 4, 192, 128, False),
    "few queries, many keys: a fill": (1, 64, 1000, 4, 2, 128, 128, False),
}


def _inputs(problem, seed: int) -> tuple:
    b, sq, sk, hq, hkv, d, dv, _ = problem
    gen = torch.Generator(DEV).manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, device=DEV, generator=gen).to(torch.bfloat16)

    q, k, v, do = (
        randn(b, sq, hq, d),
        randn(b, sk, hkv, d),
        randn(b, sk, hkv, dv),
        randn(b, sq, hq, dv),
    )
    with true_fp32():
        o, lse = attention_ref(q, k, v, True)
    return q, k, v, o.to(torch.bfloat16), lse, do


def _bounds(q, k, v, do) -> tuple:
    with true_fp32():
        want = attention_bwd_ref(q, k, v, do, True)
    low = attention_bwd_ref(q, k, v, do, True, upcast=False)
    return want, [2 * float((lo.float() - w).abs().max()) + 1e-3 for lo, w in zip(low, want)]


def _poison_scratch() -> None:
    torch.cuda.synchronize()
    for flat, _ in scratch._SLOTS.values():
        flat.fill_(float("nan"))


def test_reused_workspaces_give_the_reference_gradients():
    scratch.release()
    cases = {name: _inputs(p, seed) for seed, (name, p) in enumerate(PROBLEMS.items())}
    rounds = []
    for _ in range(2):
        got = {}
        for name, (q, k, v, o, lse, do) in cases.items():
            det = PROBLEMS[name][-1]
            got[name] = forgekernel.attention_backward(q, k, v, o, lse, do, True, deterministic=det)
        torch.cuda.synchronize()
        rounds.append(got)
        _poison_scratch()
    for name, (q, k, v, _, _, do) in cases.items():
        want, bounds = _bounds(q, k, v, do)
        for grads in (rounds[0][name], rounds[1][name]):
            for g, w, bound in zip(grads, want, bounds):
                err = float((g.float() - w).abs().max())
                assert err <= bound, (name, err, bound)
        if PROBLEMS[name][-1]:
            assert all(torch.equal(a, b) for a, b in zip(rounds[0][name], rounds[1][name]))


def test_a_captured_backward_owns_its_workspace():
    problem = PROBLEMS["host case, head split"]
    static = _inputs(problem, 0)
    fresh = _inputs(problem, 1)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            forgekernel.attention_backward(*static, True)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = forgekernel.attention_backward(*static, True)
    for t, new in zip(static, fresh):
        t.copy_(new)
    eager = forgekernel.attention_backward(*fresh, True)  # the eager scratch, meanwhile
    _poison_scratch()
    graph.replay()
    torch.cuda.synchronize()
    want, bounds = _bounds(*fresh[:3], fresh[5])
    for g, e, w, bound in zip(out, eager, want, bounds):
        assert float((g.float() - w).abs().max()) <= bound
        assert float((e.float() - w).abs().max()) <= bound


def test_host_time_of_each_launch(capsys):
    """Where the host case's host time per call goes: the op, and each of its launches alone
    (the three kernels' FFI calls on the plan's own workspace, the head split's cast), us per
    back-to-back call (`timing.host_us_per_call`, median of 5 rounds of 200). Printed for the
    notes; the launches cannot take longer than the op that makes them."""
    from forgekernel.kernels.attention.bwd.sm90 import launch
    from forgekernel.kernels.common.sm90.constants import LOG2E
    from forgekernel.runtime.timing import host_us_per_call, median

    q, k, v, o, lse, do = _inputs(PROBLEMS["host case, head split"], 0)
    out = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
    scale = 128**-0.5
    launch.clear_plans()
    forgekernel.attention_backward(q, k, v, o, lse, do, True, out=out)
    (plan,) = launch._plans.values()
    lse2, dsum, dq_acc, sem, dk_acc, dv_acc, pre_dq, _ = plan.workspace.allocate(DEV)
    fns = {
        "op": lambda: forgekernel.attention_backward(q, k, v, o, lse, do, True, out=out),
        "pre": lambda: plan.pre(o, do, lse, lse2, dsum, None, pre_dq, 0),
        "main": lambda: plan.main(q, k, v, do, lse2, dsum, dq_acc, dk_acc, dv_acc, sem, None,
                                  None, plan.ctas, scale, scale * LOG2E),
        "post": lambda: plan.post(dq_acc, out[0], None, 0, scale),
        "cast": lambda: torch._foreach_copy_(out[1:], (dk_acc, dv_acc)),
    }  # fmt: skip
    us = {name: median(t.issued) for name, t in host_us_per_call(fns).items()}
    with capsys.disabled():
        print("\nattention_bwd host case, host us per call: " + ", ".join(
            f"{name} {t:.1f}" for name, t in us.items()))  # fmt: skip
    assert max(us[n] for n in ("pre", "main", "post", "cast")) < us["op"]
