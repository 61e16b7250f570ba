"""The dsa_sparse_bwd suite on the CPU: its judge passes on check cases with the op's
interim backward, refuses a wrong gradient; cuDNN's arguments (rows compacted, topk_length, -inf
sink) carry the same math (the reference under cuDNN's topk_length contract); the work counts
(cuDNN's 6.25 ms at the issue's point is 118 TFLOP/s); registered as pending only."""

from __future__ import annotations

import math

import pytest
import torch

from forgekernel.bench import suites
from forgekernel.bench.check import verify
from forgekernel.bench.suites import dsa_sparse_bwd as suite_mod
from forgekernel.ops import dsa as fwd_op
from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref


@pytest.fixture
def cpu(monkeypatch):
    monkeypatch.setattr(fwd_op, "check_cuda", lambda name, t: None)


def _inputs(case, seed=0):
    return suite_mod.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                                 torch.Generator().manual_seed(seed))  # fmt: skip


@pytest.mark.parametrize("case", suite_mod.CHECK_CASES[:4], ids=lambda c: c.name)
def test_check_passes_with_the_interim_backward(cpu, case):
    out, cmps = verify(suite_mod.suite(), _inputs(case), torch.device("cpu"))
    assert len(out) == len(cmps) == 4
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    assert out[2].shape == (case.params["ctx"], 1, 1, 576)


def test_judge_refuses_a_wrong_gradient(cpu):
    inputs = _inputs(suite_mod.CHECK_CASES[0], seed=1)
    outs = list(suite_mod.run_ours(inputs, None))
    outs[2] = outs[2] * 1.1  # dkv 10% off
    verdicts = suite_mod.judge(inputs, tuple(outs))
    assert [v["ok"] for v in verdicts] == [True, True, False, True]
    assert "dkv" in verdicts[2]["message"]


@pytest.mark.parametrize("case", [suite_mod.CHECK_CASES[1], suite_mod.CHECK_CASES[3]],
                         ids=lambda c: c.name)  # fmt: skip
def test_cudnn_arguments_carry_the_same_math(case):
    """Scattered -1s and empty rows: the compacted rows with topk_length (entries past it
    ignored, whatever they hold) give the reference's gradients bit for bit in fp64."""
    inputs = _inputs(case, seed=2)
    args = suite_mod.cudnn_inputs(inputs)
    idx, length = args["topk_idxs"], args["topk_length"]
    assert idx.dtype == length.dtype == torch.int32 and idx.is_contiguous()
    assert idx.shape[1] % suite_mod.CUDNN_TOPK_MULTIPLE == 0 and (idx >= 0).all()
    assert torch.equal(length, (inputs["idx"] >= 0).sum(1).int())
    sink = inputs["sink"]
    assert (
        torch.equal(args["attn_sink"], sink)
        if sink is not None
        else torch.isneginf(args["attn_sink"]).all()
    )
    common = (inputs["q"], inputs["kv"])
    rest = (suite_mod.SOFTMAX_SCALE, inputs["dout"])
    ours = dsa_sparse_attention_bwd_ref(*common, inputs["idx"], *rest, attn_sink=sink,
                                        dtype=torch.float64)  # fmt: skip
    theirs = dsa_sparse_attention_bwd_ref(*common, idx, *rest, attn_sink=sink, topk_length=length,
                                          dtype=torch.float64)  # fmt: skip
    for a, b in zip(ours, theirs):
        if a is not None:
            torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_cases_and_work_counts():
    cases = (*suite_mod.BENCH_CASES, *suite_mod.CHECK_CASES)
    names = [c.name for c in cases]
    assert len(names) == len(set(names))
    point = suite_mod.BENCH_CASES[0]
    assert (point.params["tokens"], point.params["hq"], point.params["ctx"]) == (4096, 16, 8192)
    tflops = suite_mod.flops(point) / 6.25e-3 / 1e12
    assert math.isclose(tflops, 118.2, rel_tol=1e-2)
    assert {c.params["hq"] for c in suite_mod.BENCH_CASES} == {16, 64, 128}
    assert {c.params["topk"] for c in suite_mod.BENCH_CASES} == {512, 2048}


def test_registered():
    """The v1 kernel checked on a GPU: registered (tests/test_ledger_gate.py asks for its
    ledger)."""
    assert suites.SUITE_MODULES["dsa_sparse_bwd"].endswith("dsa_sparse_bwd")
    assert "dsa_sparse_bwd" not in suites.PENDING_SUITE_MODULES
    assert suite_mod.suite().name == "dsa_sparse_bwd"


def test_ledger_key_holds_the_kernel():
    """The ledger key covers the backward kernel's and the preprocess kernel's sources, their
    launchers and the op."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC as BWD
    from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import SPEC as PRE

    names = {p.name for p in suite_mod.kernel_sources()}
    assert {"kernel.py", "launch.py", "dsa_bwd.py", "dsa.py"} <= names
    assert set(BWD.sources) | set(PRE.sources) <= set(suite_mod.kernel_sources())
    assert {p.parent.parent.name for p in suite_mod.kernel_sources() if p.name == "launch.py"} >= {
        "dsa_sparse_bwd",
        "dsa_sparse_bwd_pre",
    }


def test_red4s_variant_runs_the_previous_standard_form(monkeypatch):
    """Variant `red4s` on every bench case: the op's launches with the launcher's h64=False,
    xchg=False (v1's candidate red4s, built by `--candidates`), its dq / dkv split and cast as
    the op's (the kernel faked on the CPU: dq = 2 q, dkv = the slot index in every column)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC as BWD
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)  # the variants' sweep decision

    assert all(set(suite_mod.variants(c)) - {"unswept", "swept"} == {"red4s"}
               | ({"was"} if c.params["hq"] % 64 == 0 else set())
               for c in suite_mod.BENCH_CASES)  # fmt: skip
    for heads in (16, 64):
        case = next(c for c in suite_mod.CHECK_CASES if c.params["hq"] == heads)
        seen = _fake_v1(monkeypatch, launch)
        out = _run_faked(suite_mod.variants(case)["red4s"], case)
        block = 16 if heads == 16 else 32
        assert [dict(p) for p in seen] == [{"dtype": "bfloat16", "block": block, "red4s": True}]
        assert seen[0] in BWD.candidate_params()
        assert torch.equal(out[0], 2 * out[-1]["q"][..., :512])


def _fake_v1(monkeypatch, launch) -> list:
    """v1's kernel faked (dq = 2 q, dkv = the slot index in every column); the keys it gets."""
    seen = []

    def kernel(q, kv, dout, lse2, delta, idx, dq, dkv, *scales):
        dq.copy_(2 * q)
        dkv.copy_(torch.arange(dkv.shape[0], dtype=dkv.dtype)[:, None].expand_as(dkv))

    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: seen.append(params) or kernel)
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    return seen


def _run_faked(run, case) -> tuple:
    """run (a variant) on the case's inputs: its (dq_nope, dq_pe, dkv, d_sink) checked for the
    faked kernels' split and cast (dkv = the slot index), then with the inputs appended."""
    inputs = _inputs(case)
    out = run(inputs, suite_mod.alloc_out(inputs))
    q = inputs["q"]
    assert out[0].shape == q[..., :512].shape and out[1].shape == q[..., 512:].shape
    slots = torch.arange(case.params["ctx"], dtype=torch.bfloat16)
    assert torch.equal(out[2], slots.view(-1, 1, 1, 1).expand_as(out[2]))
    assert out[3].shape == (case.params["hq"],) and torch.isfinite(out[3]).all()
    return (*out, inputs)


def test_was_variant_runs_split_h64_where_ours_runs_fused(monkeypatch):
    """Variant `was` on the H 64 / 128 bench cases only (where the op's default runs the fused
    kernel): the op's launches with the launcher's h64_fused=False, kernel_h64.py's kv then dq
    part (candidate builds), dq / dkv split and cast as the op's; the launcher's default on the
    same inputs runs the fused kernel's one launch (a standard build)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC as BWD
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import config, launch

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)  # the variants' sweep decision
    assert {c.params["hq"] for c in suite_mod.BENCH_CASES if "was" in suite_mod.variants(c)} == {
        64, 128}  # fmt: skip
    case = next(c for c in suite_mod.CHECK_CASES if c.params["hq"] == 64)
    seen = []

    def slots(dkv):
        dkv.copy_(torch.arange(dkv.shape[0], dtype=dkv.dtype)[:, None].expand_as(dkv))

    def kv_part(q, kv, dout, lse2, delta, idx, ws, dkv, *scales):
        slots(dkv)
        ws.zero_()

    def fused(q, kv, dout, lse2, delta, idx, dq, dkv, *scales):
        slots(dkv)
        dq.copy_(2 * q)

    def get_kernel(spec, params):
        seen.append(params)
        part = dict(params)["h64"]
        if part == "kv":
            return kv_part
        if part == "dq":
            return lambda kv, idx, ws, dq: dq.copy_(3 * torch.ones_like(dq))
        return fused

    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    out = _run_faked(suite_mod.variants(case)["was"], case)
    assert seen == [config.params_h64("bfloat16", "kv"), config.params_h64("bfloat16", "dq")]
    assert set(seen) <= set(BWD.candidate_params())
    assert (out[0] == 3).all() and (out[1] == 3).all()
    seen.clear()
    out = _run_faked(lambda i, o: suite_mod._run_launcher(i, o), case)
    assert seen == [config.params_h64("bfloat16", "fused")]
    assert set(seen) <= set(BWD.standard_params())
    assert torch.equal(out[0], 2 * out[-1]["q"][..., :512])
    assert torch.equal(out[1], 2 * out[-1]["q"][..., 512:])


def test_sweep_variants_run_the_other_form(monkeypatch):
    """Over the L2 the variant is the default's kernel in the other form (132 SMs): `unswept`
    (sweep=False: one launch on the index rows as given) where the default sweeps, `swept`
    (sweep=True: the rows sorted, one wave a launch) where it does not; no such variant under
    the L2 (kv 8192)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import config, launch

    monkeypatch.setattr(launch, "num_sms", lambda index: 132)
    forms = {c.name: set(suite_mod.variants(c)) & {"unswept", "swept"}
             for c in suite_mod.BENCH_CASES}  # fmt: skip
    assert forms == {
        "t4096-h16-kv8192-k2048": set(), "t4096-h16-kv8192-k2048-nosink": set(),
        "t4096-h16-kv8192-k512": set(), "t8192-h16-kv32768-k2048": {"unswept"},
        "t32768-h16-kv65536-k2048": {"unswept"}, "t4096-h64-kv16384-k2048": {"unswept"},
        "t16384-h64-kv65536-k512": {"unswept"}, "t4096-h128-kv8192-k2048": set(),
        "t8192-h128-kv65536-k2048": {"unswept"},
    }  # fmt: skip
    case = next(c for c in suite_mod.CHECK_CASES if c.params["hq"] == 64)
    idxs = []

    def fused(q, kv, dout, lse2, delta, idx, dq, dkv, *scales):
        idxs.append(idx)
        dkv.copy_(torch.arange(dkv.shape[0], dtype=dkv.dtype)[:, None].expand_as(dkv))
        dq.copy_(2 * q)

    monkeypatch.setattr(launch, "get_kernel", lambda spec, params: fused)
    monkeypatch.setattr(launch, "as_tma_ready", lambda t: t)
    monkeypatch.setattr(launch, "num_sms", lambda index: 4)
    out = _run_faked(suite_mod._run_unswept, case)
    assert len(idxs) == 1 and idxs[0] is out[-1]["idx"]
    assert torch.equal(out[0], 2 * out[-1]["q"][..., :512])
    idxs.clear()
    out = _run_faked(suite_mod._run_swept, case)
    assert len(idxs) == -(-case.params["tokens"] // 4)
    assert torch.equal(torch.cat(idxs), out[-1]["idx"].sort(dim=1).values)
    assert not config.sweep_far(case.params["ctx"])  # the default there: one launch
