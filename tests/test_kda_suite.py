"""The kda_prefill suite on the CPU: its own check (`bench.check.verify`) passes on every check
case through the op's launcher with torch replays of its two kernels (the first pass and the
recurrence), its cases are well formed, it is registered, and its comparators are absent
without a GPU."""

from __future__ import annotations

import kda_prefill_replay as replay
import pytest
import torch

import forgekernel.ops.kda_chunked as op
from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import kda_prefill
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch


@pytest.fixture
def on_cpu(monkeypatch):
    """The op on the CPU: its two kernels replayed in torch (tests/kda_prefill_replay.py)."""
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)

    def get(spec, params):
        pick = replay.intra_kernel if spec.name == "kda_intra_sm90" else replay.kernel
        return pick(dict(params))

    monkeypatch.setattr(launch, "get_kernel", get)


@pytest.mark.parametrize("case", kda_prefill.CHECK_CASES, ids=lambda c: c.name)
def test_check_passes_on_the_kernels_replays(on_cpu, case):
    suite = kda_prefill.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert cmps and all(c.ok for c in cmps), [c.message for c in cmps]


def test_cases_are_well_formed():
    names = [c.name for c in (*kda_prefill.BENCH_CASES, *kda_prefill.CHECK_CASES)]
    assert len(names) == len(set(names))
    for case in kda_prefill.BENCH_CASES:
        lens = case.params["lens"]
        assert all(n > 0 for n in lens) and 2048 <= sum(lens) <= 262144, case.name
        assert case.params["hv"] % case.params["h"] == 0
        assert kda_prefill.flops(case) > 0 and kda_prefill.nbytes(case, torch.bfloat16) > 0
    heads = {(c.params["h"], c.params["hv"]) for c in kda_prefill.BENCH_CASES}
    assert heads == {(16, 16), (16, 32)}
    states = {c.params["state"] for c in kda_prefill.BENCH_CASES}
    assert states == {True, False}
    assert all(path.is_file() for path in kda_prefill.SOURCES)


def test_registered():
    assert suites.SUITE_MODULES["kda_prefill"] == "forgekernel.bench.suites.kda_prefill"


def test_no_comparators_without_a_gpu():
    if not torch.cuda.is_available():
        assert kda_prefill.comparators() == {"fla": None, "cudnn": None}


def test_segments_and_pieces_variants(on_cpu):
    """`segments_<P>` (GDN's rule: 9 at 1 x hv16) on the long single sequences only, `pieces_<P>`
    (one wave of unsplit CTAs) where the recurrence has few CTAs; each variant is the launcher
    so forced and matches the reference as the check sees it (3 segments or pieces)."""
    by_name = {c.name: c for c in kda_prefill.BENCH_CASES}
    segmented = {n for n, c in by_name.items() if "segments_9" in kda_prefill.variants(c)}
    assert segmented == {"1x32768-h16-hv16", "1x131072-h16-hv16", "1x32768-h16-hv16-nostate"}
    assert set(kda_prefill.variants(by_name["1x32768-h16-hv16"])) == {"segments_9", "pieces_8"}
    assert set(kda_prefill.variants(by_name["1x2048-h16-hv16"])) == {"pieces_8"}
    suite = kda_prefill.suite()
    assert set(suite.variants_for(by_name["4x8192-h16-hv16"])) == {"pieces_2"}
    assert suite.variants_for(by_name["4x8192-h16-hv32"]) == {}
    for case in kda_prefill.CHECK_CASES[:2]:
        inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                   torch.Generator().manual_seed(1))  # fmt: skip
        want = suite.reference(inputs)
        out = kda_prefill.alloc_out(inputs)
        for kind in ("segments", "pieces"):
            got = kda_prefill._run_segments(3, kind)(inputs, out)
            assert got is out
            assert float((got.float() - want).abs().max() / want.abs().max()) < 2e-2
