"""scripts/graph_vs_eager_probe.py on the CPU: its arguments and cases, the three forms' calls
(what reaches the op: shapes, cu_seqlens, l2norm, the slot route only inside the call) on the
suite's own inputs at a small equal-length case, and the kernel comparison's arithmetic. The
GPU part is the device session's one command (docs/linear_attention/NOTES.md
"next/capture-drop (2026-12-06)")."""

from __future__ import annotations

import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.bench.suites import gdn_bwd, gdn_prefill
from forgekernel.ops import _linattn_varlen as varlen

probe = load_script("graph_vs_eager_probe")


def test_arguments_and_default_cases(capsys):
    """Defaults: both 4 x 8192 bench cases (equal lengths), every form, l2norm off; --list
    needs no GPU; a case outside the two suites or a bad count is refused."""
    args = probe.parse_args([])
    assert (args.case, args.form, args.l2norm, args.reps) == (
        list(probe.DEFAULT_CASES), list(probe.FORMS), False, 10)  # fmt: skip
    cases = probe.resolve_cases(args.case)
    assert [(s, c.name) for s, c in cases] == [tuple(x.split(":")) for x in probe.DEFAULT_CASES]
    for suite_name, case in cases:
        assert case.params["lens"] == (8192,) * 4
        assert case in probe.profile_suite.load_suite(suite_name).bench_cases
    args = probe.parse_args(["--form", "batch", "--l2norm", "--case", "kda_bwd:1x2048-h16-hv16"])
    assert (args.form, args.l2norm, args.case) == (["batch"], True, ["kda_bwd:1x2048-h16-hv16"])
    with pytest.raises(SystemExit, match="SUITE:CASE"):
        probe.resolve_cases(["dsa_sparse_bwd:t4096-h16-kv8192-k2048"])
    with pytest.raises(SystemExit):
        probe.parse_args(["--reps", "0"])
    assert probe.main(["--list", "--form", "slots"]) == 0
    assert "forms: slots; l2norm off" in capsys.readouterr().out


def _small():
    """gdn_bwd's inputs and output buffers at 3 sequences of 64 tokens (CPU)."""
    case = gdn_prefill._case([64] * 3, 2, 4)
    gen = torch.Generator().manual_seed(0)
    inputs = gdn_bwd.make_inputs(case, torch.bfloat16, torch.device("cpu"), gen)
    return case, inputs, tuple(gdn_bwd.alloc_out(inputs))


def test_set_takes_profile_suites_form():
    """--set MODULE.NAME=VALUE (profile_suite.py's parser: a Python literal, repeatable);
    a malformed one is refused by the parser."""
    args = probe.parse_args(["--set", "forgekernel.ops._linattn_varlen.NATIVE_STORES=True"])
    assert args.set == [("forgekernel.ops._linattn_varlen", "NATIVE_STORES", True)]
    assert probe.parse_args([]).set == []
    with pytest.raises(SystemExit):
        probe.parse_args(["--set", "NATIVE_STORES"])


def test_batched_is_a_view_of_the_suite_form():
    """(1, 3 x 64, ...) -> (3, 64, ...) views of the same memory, no cu_seqlens, the states
    and the state buffer untouched; unequal lengths refused."""
    case, inputs, out = _small()
    shaped, shaped_out = probe.batched(inputs, out, case.params["lens"])
    assert shaped["cu_seqlens"] is None and inputs["cu_seqlens"] is not None
    for key in probe.TOKENS:
        assert shaped[key].shape == (3, 64, *inputs[key].shape[2:])
        assert shaped[key].data_ptr() == inputs[key].data_ptr()
        assert torch.equal(shaped[key].flatten(0, 1), inputs[key][0])
    assert shaped["state"] is inputs["state"] and shaped["d_final"] is inputs["d_final"]
    assert [o.shape[:2] for o in shaped_out[:5]] == [(3, 64)] * 5 and shaped_out[5] is out[5]
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(shaped_out, out))
    with pytest.raises(ValueError, match="equal lengths"):
        probe.batched(inputs, out, [64, 128])


def test_form_calls_reach_the_op_as_named():
    """varlen: the suite's tensors and cu_seqlens (the bench's call); batch: (N, T / N, ...)
    without cu_seqlens; slots: varlen with `_linattn_varlen.capturing` true during the call
    only; l2norm passed through; the output buffers given as out=."""
    case, inputs, out = _small()
    seen = []

    def backward(q, k, v, g, beta, do, **kw):
        seen.append((q.shape, kw["cu_seqlens"], kw["use_qk_l2norm_in_kernel"],
                     varlen.capturing(q), kw["out"][0].data_ptr()))  # fmt: skip
        return kw["out"]

    lens = case.params["lens"]
    for form in probe.FORMS:
        probe.form_call(backward, inputs, out, lens, form, form == "slots")()
    cu = inputs["cu_seqlens"]
    assert seen == [((1, 192, 2, 128), cu, False, False, out[0].data_ptr()),
                    ((3, 64, 2, 128), None, False, False, out[0].data_ptr()),
                    ((1, 192, 2, 128), cu, True, True, out[0].data_ptr())]  # fmt: skip
    assert not varlen.capturing(inputs["q"])  # restored: a CPU tensor never captures


def test_comparison_lines():
    """Totals a call on each side, then kernels by |graph - eager| us, a kernel one side lacks
    at 0 launches (the slot layout's copies show as graph-only rows)."""
    eager = {"chunk": (1.0, 1000.0), "state": (2.0, 800.0), "norm": (1.0, 50.0)}
    graph = {"chunk": (1.0, 1010.0), "state": (2.0, 700.0), "index_copy": (6.0, 600.0)}
    lines = probe.comparison(eager, graph, top=3)
    assert lines[0] == ("  kernels a call: eager 4 launches 1850.0 us, graph 9 launches 2310.0 "
                        "us, graph - eager +460.0 us")  # fmt: skip
    rows = [line.split() for line in lines[2:]]
    assert [r[-1] for r in rows] == ["index_copy", "state", "norm"]
    assert rows[0][:5] == ["0.0", "0.0", "600.0", "6.0", "+600.0"]
    assert rows[1][4] == "-100.0" and rows[2][4] == "-50.0"


def test_measure_profiles_what_was_timed(monkeypatch):
    """Both methods timed on the one call; the profiler then runs the eager Samples' rerun
    --calls times and the graph's once, each table per call (the graph's over the calls its
    replay holds); the medians as given."""
    from forgekernel.bench import methods
    from forgekernel.runtime.timing import Samples

    ran = []
    timed = {"eager": Samples([4.0, 5.0, 6.0], method="eager-flushed", launches=1,
                              rerun=lambda: ran.append("eager")),
             "graph": Samples([6.0, 7.0], method="cuda-graph", launches=3,
                              rerun=lambda: ran.append("graph"))}  # fmt: skip
    seen = []

    def time_method(method, fns, sets, **kw):
        seen.append((method, sets, kw["reps"], kw["eager_reps"]))
        return {"fn": timed[method]}

    def profiled(torch_, work):
        ran.clear()
        work()
        launches = ran.count("graph") * 3 + ran.count("eager")  # each call: one kernel "k"
        return [("k", 10.0)] * launches, 0.0

    monkeypatch.setattr(methods, "time_method", time_method)
    monkeypatch.setattr(probe.profile_suite, "profiled_kernels", profiled)
    rec = probe.measure(torch, lambda: None, probe.parse_args(["--reps", "7", "--calls", "2"]))
    assert seen == [("eager", [()], 7, 7), ("graph", [()], 7, 7)]
    assert (rec["eager_ms"], rec["graph_ms"], rec["graph_calls"]) == (5.0, 6.5, 3)
    assert rec["eager_kernels"] == {"k": (1.0, 10.0)} and rec["graph_kernels"] == {"k": (1.0, 10.0)}
    lines = probe.report("gdn_bwd:x varlen", rec, top=5)
    assert lines[0].startswith("gdn_bwd:x varlen: graph 6.500 ms (cuda-graph, 3 calls a replay)")
    assert "graph - eager +1.500 ms" in lines[0]


def test_a_profiler_failure_keeps_the_times(monkeypatch):
    """torch.profiler raising: the record keeps both medians, empty tables and the error,
    which the report prints instead of the tables."""
    from forgekernel.bench import methods
    from forgekernel.runtime.timing import Samples

    def time_method(method, fns, sets, **kw):
        return {"fn": Samples([2.0], method=method, launches=2, rerun=lambda: None)}

    def profiled(torch_, work):
        raise RuntimeError("CUPTI unavailable")

    monkeypatch.setattr(methods, "time_method", time_method)
    monkeypatch.setattr(probe.profile_suite, "profiled_kernels", profiled)
    rec = probe.measure(torch, lambda: None, probe.parse_args([]))
    assert (rec["eager_ms"], rec["graph_ms"], rec["graph_kernels"]) == (2.0, 2.0, {})
    lines = probe.report("kda_bwd:x batch", rec, top=5)
    assert lines[-1] == "  torch.profiler failed: RuntimeError: CUPTI unavailable"
