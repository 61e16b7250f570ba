"""Varlen under a CUDA-graph capture on the linear-attention backwards' kernel paths (Gated
DeltaNet, Kimi Delta Attention; ops/_linattn_varlen.py `backward_varlen`): one graph captured
at equal lengths and replayed with cu_seqlens rewritten in place (equal, unequal, equal again)
runs the slot layout every replay and equals an eager call on each (unequal lengths bit for
bit: eager takes the slot layout too; equal ones within the suite's tolerance of the eager
batch path). The 4 x 8192 times printed (`-s`): graph replays in the slot layout next to eager
launches on the batch path, in the bench's form (l2norm off): the bench's graph and eager
columns of the suites' batch cases (NOTES "next/capture-drop")."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F
from linattn_varlen import captured_outputs, problem

import forgekernel
from forgekernel.runtime.timing import median, time_eager_flushed, time_ms

pytestmark = pytest.mark.gpu
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
TOL = 2e-2
OPS = {
    "gdn": (importlib.import_module("forgekernel.ops.gated_delta_rule_bwd"),
            forgekernel.gated_delta_rule_backward),
    "kda": (importlib.import_module("forgekernel.ops.kda_bwd"),
            forgekernel.kimi_delta_attention_backward),
}  # fmt: skip


def _close(name, got, want):
    assert torch.isfinite(got).all(), f"{name}: NaN / inf"
    err = float((got.double() - want.double()).abs().max())
    assert err <= TOL * float(want.abs().max()) + 1e-5, (name, err, float(want.abs().max()))


@pytest.mark.parametrize("op", sorted(OPS))
def test_one_graph_replays_equal_and_unequal_lengths(monkeypatch, op):
    bwd, backward = OPS[op]
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    args, h0, dht = problem(op, 400, 2, 4, 2, seed=31)
    cu = torch.tensor([0, 200, 400], dtype=torch.int32, device="cuda")
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": cu,
          "use_qk_l2norm_in_kernel": True}  # fmt: skip

    def call():
        return backward(*args, **kw)

    graph, captured = captured_outputs(call)
    for edges in ([0, 200, 400], [0, 137, 400], [0, 64, 400], [0, 200, 400]):
        cu.copy_(torch.tensor(edges))
        graph.replay()
        torch.cuda.synchronize()
        want = call()  # eager: equal lengths the batch path, unequal the slot layout
        for name, a, r in zip(NAMES, captured, want):
            if edges[1] != 200:
                assert torch.equal(a, r), (edges, name)
            else:
                _close(name, a, r)


@pytest.mark.parametrize(("op", "hv"), [("gdn", 32), ("gdn", 16), ("kda", 16)])
def test_time_at_bench_size(op, hv):
    """4 x 8192 tokens, H 16, l2norm off (the suites' batch cases in their cu_seqlens form, as
    the bench calls them): graph replays (the slot layout: no host read) and eager launches on
    a flushed L2 (the offsets read: the batch path), as the bench times them (printed). The
    2026-12-06 16:58 run had l2norm on (graph 6.78 / 4.16 / 7.40 ms, eager 5.66 / 3.47 /
    6.33); the bench's own columns at 17:00-17:16 (l2norm off): graph 5.94 / 3.16 / 6.11,
    eager 4.79 / 2.50 / 5.17."""
    backward = OPS[op][1]
    args, h0, dht = problem(op, 4 * 8192, 16, hv, 4, seed=13)
    args[1] = F.normalize(args[1].float(), dim=-1).bfloat16()  # unit-norm k, as the suites'
    cu = torch.arange(5, dtype=torch.int32, device="cuda") * 8192
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": cu}

    def call():
        return backward(*args, **kw)

    eager = median(time_eager_flushed({"fn": call}, reps=10, min_reps=5)["fn"])
    samples = time_ms(call, reps=10)  # CUDA-graph replays (the bench's graph timing)
    assert samples.method == "cuda-graph", samples.note
    print(f"\n{op} backward 4 x 8192 h16 hv{hv} bf16, cu_seqlens at equal lengths: graph in "
          f"slots {median(samples):.2f} ms, eager (batch path) {eager:.2f} ms")  # fmt: skip
