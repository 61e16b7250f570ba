"""scripts/warm_comparators.py on the CPU: its calls are the bench's first calls in the bench's
order (the host probe's case, then each bench case once, in the bench dtype), every comparator
once per case (its seconds said), a raising one named and skipped."""

from __future__ import annotations

import re
import sys
import types

import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.bench.harness import host_case
from forgekernel.bench.suites import gdn_prefill, kda_prefill

warm = load_script("warm_comparators")


def test_plan_is_the_bench_order_of_first_calls():
    for module in (gdn_prefill, kda_prefill):
        suite = module.suite()
        got = warm.plan(suite)
        assert [c for c, _ in got][0] == host_case(suite)
        assert [c.name for c, _ in got][1:] == [
            c.name for c in suite.bench_cases if c != host_case(suite)
        ]
        assert {d for _, d in got} == {torch.bfloat16}


def test_every_comparator_once_per_case(monkeypatch, capsys):
    suite = gdn_prefill.suite()
    small = [gdn_prefill.CHECK_CASES[1], gdn_prefill.CHECK_CASES[0]]
    monkeypatch.setattr(warm, "plan", lambda s: [(c, torch.bfloat16) for c in small])
    calls = []

    def fine(inputs):
        calls.append(inputs["q"].shape[1])

    fine.ran = lambda inputs: f"engine_{inputs['q'].shape[1]}"

    def broken(inputs):
        raise NotImplementedError("not this case")

    def in_process(inputs):
        raise AssertionError("its compiles would not reach the bench's process")

    in_process.cache_in_process = True
    import forgekernel.bench.harness as harness

    comps = {"fla": fine, "flashinfer": broken, "kept_here": in_process}
    monkeypatch.setattr(harness, "resolve_comparators", lambda s: (comps, {}))
    warm.warm(suite, 0, torch.device("cpu"))
    assert calls == [sum(c.params["lens"]) for c in small]
    out = capsys.readouterr().out.splitlines()
    assert len(out) == 2 and all("raised: flashinfer (NotImplementedError)" in ln for ln in out)
    assert [f"; fla ran engine_{n};" in ln for n, ln in zip(calls, out)] == [True, True]
    # each comparator's seconds, the raising one's too: where a fresh host's first calls go
    assert all(re.search(r": \d+\.\d s \(fla \d+\.\d, flashinfer \d+\.\d\);", ln) for ln in out)
    assert all(ln.endswith("; left to the bench: kept_here") for ln in out)


def test_flashinfer_gdn_prefill_is_left_to_the_bench(monkeypatch):
    """FlashInfer's sm90 GDN prefill compiles into a dict of its process (nothing on disk)."""
    fake = types.ModuleType("flashinfer")
    fake.chunk_gated_delta_rule = lambda *args, **kwargs: None
    monkeypatch.setitem(sys.modules, "flashinfer", fake)
    assert gdn_prefill._flashinfer().cache_in_process is True


def test_list(capsys):
    assert warm.main(["kda_prefill", "--list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"kda_prefill {host_case(kda_prefill.suite()).name} bfloat16"
    assert len(lines) == len(kda_prefill.BENCH_CASES)  # the host case is the first bench case
