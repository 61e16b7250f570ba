"""CUDA-graph behaviour fixed on CPU evidence (branch next/kda-bench; the H200 run of
2026-12-02): fla's chunked comparators captured by the bench's graph timing over more input
sets than fla's table cache holds, their eager result unchanged after it (kda_prefill 1x2048
crashed there with an illegal memory access); fla's autograd backward comparators and our GDN /
KDA interim paths (the suites' `interim` variant) refused cleanly (event bursts, the device
still usable), our kernel paths on unequal varlen captured (the slot layout, no host read,
since 2026-12-06's next/linattn-bwd-varlen2; refused before); the DSA
sparse backward's interim captured and replayed on a new dout against eager calls."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.runtime.timing import time_interleaved

pytestmark = pytest.mark.gpu
DEV = torch.device("cuda")
SETS = 6  # more than fla 0.6.0's FLA_TENSOR_CACHE_SIZE (4): every set's own offsets missed


def _suite(name: str):
    return importlib.import_module(f"forgekernel.bench.suites.{name}")


def _sets(mod, case, n=SETS):
    return [mod.make_inputs(case, torch.bfloat16, DEV, torch.Generator(DEV).manual_seed(s))
            for s in range(n)]  # fmt: skip


def _fla(mod):
    comps = mod.comparators()
    if comps.get("fla") is None:
        pytest.skip("fla is not installed")
    return comps["fla"]


@pytest.mark.parametrize("name", ["kda_prefill", "gdn_prefill"])
def test_fla_forward_is_captured_over_many_input_sets(name):
    mod = _suite(name)
    run = _fla(mod)
    case = mod._case([300, 1, 700], 16, 16)
    sets = _sets(mod, case)
    before = run(sets[0]).clone()
    s = time_interleaved({"fla": run}, rotate=[(i,) for i in sets], warmup=2, reps=3)["fla"]
    assert s.method == "cuda-graph", s.note
    s.rerun()
    torch.cuda.synchronize()
    torch.testing.assert_close(run(sets[0]), before, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["kda_bwd", "gdn_bwd"])
def test_fla_backward_and_our_interim_fall_back_to_bursts(name):
    mod = _suite(name)
    case = mod.CHECK_CASES[0]
    sets = _sets(mod, case, 3)
    fns = {"ours": lambda i: mod.run_ours(i, None), "interim": lambda i: mod.run_interim(i, None)}
    if mod.comparators().get("fla") is not None:
        fns["fla"] = mod.comparators()["fla"]
    got = time_interleaved(fns, rotate=[(i,) for i in sets], warmup=2, reps=3)
    # ours on unequal varlen: captured since 2026-12-06 (the slot layout, no host read; NOTES
    # "Varlen backward, one launch"); the interim path still refuses
    assert got["ours"].method == "cuda-graph", got["ours"].note
    assert got["interim"].method == "event-burst" and "cannot be captured" in got["interim"].note
    if "fla" in got:
        assert got["fla"].method == "event-burst" and "forward's stream" in got["fla"].note
    torch.randn(4, device=DEV).sum().item()  # the device and the allocator still work


def test_dsa_sparse_backward_replays_on_a_new_dout():
    mod = _suite("dsa_sparse_bwd")
    i = mod.make_inputs(mod.CHECK_CASES[0], torch.bfloat16, DEV,
                        torch.Generator(DEV).manual_seed(0))  # fmt: skip
    mod.run_ours(i, None)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = mod.run_ours(i, None)
    i["dout"].copy_(torch.randn_like(i["dout"].float()).to(i["dout"].dtype))
    graph.replay()
    torch.cuda.synchronize()
    want = mod.run_ours(i, None)
    for got, ref in zip(outs, want):  # dkv by atomics: the order of its fp32 sums may differ
        err = float((got.double() - ref.double()).abs().max())
        assert err <= 1e-2 * float(ref.abs().max()) + 1e-5, err
