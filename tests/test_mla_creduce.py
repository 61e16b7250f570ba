"""The `creduce` form (candidate; seesaw.py `_reduce_cluster`, launch.plan_form(creduce=True),
FORGEKERNEL_MLA_CREDUCE=1): a seesaw plan of 2, 4 or 8 splits runs each unit's splits as one
cluster (grid z), the splits reduced over the cluster's shared memory into the op's out and natural
LSE: no fp32 partials, no combine. On the CPU: its compile keys (keyed only when on, candidates
only, never a standard key), which plans take it and which keep theirs, the launcher's calls
replayed (tests/mla_seesaw.py `seesaw_creduce`) against the reference with NaN-poisoned outputs
and NaN stale slots, the reduction's order, the bench variant, and the compile's SASS."""

from __future__ import annotations

import inspect
import re
from collections import Counter

import pytest
import torch
from mla_seesaw import butterfly_order
from test_mla_decode import SCALE, _assert_close, _problem, cpu_kernels  # noqa: F401

from forgekernel import ops as op
from forgekernel.bench.suites import mla_decode as suite
from forgekernel.kernels.attention.mla.sm90 import SPEC, creduce_params, params_for, seesaw
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import CREDUCE_SIZES, RESIDENT, tile_split_plan
from forgekernel.reference.mla import mla_decode_ref


def test_keys_only_when_on():
    plain = params_for("partial", "bfloat16", 16, tma=True)
    assert "creduce" not in dict(plain)
    for size in CREDUCE_SIZES:
        key = dict(params_for("partial", "bfloat16", 16, tma=True, creduce=size))
        assert key.pop("creduce") == size and tuple(sorted(key.items())) == plain
    for bad in (
        {"creduce": 3, "tma": True},
        {"creduce": 16, "tma": True},
        {"creduce": 8},  # decode.py's pass
        {"creduce": 8, "tma": True, "direct": True},
        {"creduce": 8, "tma": True, "worklist": True},
        {"creduce": 8, "tma": True, "gather": True},
        {"creduce": 2, "tma": True, "pair": True},
    ):
        with pytest.raises(ValueError, match="creduce"):
            params_for("partial", "bfloat16", 16, **bad)


def test_candidates_not_standard():
    keys = creduce_params()
    assert len(keys) == 10 and all(dict(k)["creduce"] in CREDUCE_SIZES for k in keys)
    assert set(keys) <= set(SPEC.candidate_params())
    assert not any("creduce" in dict(k) for k in SPEC.standard_params())


def test_plan_sizes_of_the_bench_cases():
    """The width plans the variant rests on (132 SMs): the cluster is the unit's splits."""
    plans = {(16, 4096): 8, (16, 8192): 8, (32, 2048): 4, (64, 4096): 2, (64, 8192): 2,
             (8, 16384): 16, (128, 4096): 1}  # fmt: skip
    for (b, n), splits in plans.items():
        assert tile_split_plan(b, 1, n, 132, RESIDENT)[0] == splits, (b, n)


@pytest.fixture
def plans(monkeypatch):
    """The launcher's plans with each kernel's compile key in its place (132 SMs)."""
    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", lambda spec, p: dict(p))
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    yield lambda b, hq=16, n=4096, form=None: mla_launch._plan(
        "partial", torch.bfloat16, b, hq, n, 1, None, False, 64, form=form
    )
    mla_launch._plans.clear()


@pytest.mark.parametrize(
    ("lens", "hq", "s_q", "splits"),
    [
        ([2048, 2047, 0, 1, 1500, 64], 16, 1, 8),  # a 2k table, lengths 0 and 1: 8 splits
        ([1024, 0, 1, 700], 16, 1, 4),
        ([1000, 64, 0, 1], 16, 2, 4),  # MTP 2 (32 rows a CTA)
        ([1024, 65, 1, 0], 128, 1, 4),  # 64-head blocks
        ([600, 65, 1, 0], 16, 1, None),  # a plan of neither 2, 4 nor 8 splits: kept
    ],
)
@pytest.mark.parametrize("combined", [True, False])
def test_replay_matches_the_reference(cpu_kernels, lens, hq, s_q, splits, combined):  # noqa: F811
    qn, qp, ckv, kpe, table, seq = _problem(len(lens), hq, 64, lens, s_q, combined=combined)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    out = torch.full(want.shape, float("nan"), dtype=qn.dtype)
    lse = torch.full(want_lse.shape, float("nan"))
    with mla_launch.plan_form(creduce=True):
        op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out, lse=lse,
                      return_lse=True)  # fmt: skip
    params = [p for p, _, _ in cpu_kernels]
    if splits is None:
        assert not any(p.get("creduce") for p in params)
    else:
        assert len(params) == 1 and params[0]["creduce"] == splits  # one launch: no combine
    _assert_close(out, lse, want, want_lse)
    assert not torch.isnan(out).any()


def test_plans_that_take_it_and_those_that_keep_theirs(plans):
    """Under the form: 2, 4 or 8 splits a cluster, no combine; 16 splits (b8 x 16k: a cluster
    of 16 is not portable) keep the partials and the combine; one split the direct form. No
    form, no switch: never."""
    form = (None, None, False, True, False, False, False, True)
    for b, n, splits in ((16, 4096, 8), (16, 8192, 8), (32, 2048, 4), (64, 4096, 2)):
        kernel, combine, got, *_ = plans(b, n=n, form=form)
        assert got == splits and kernel["creduce"] == splits and combine is None, (b, n)
        kernel, combine, got, *_ = plans(b, n=n)
        assert got == splits and "creduce" not in kernel and combine is not None
    kernel, combine, splits, *_ = plans(8, n=16384, form=form)
    assert splits == 16 and combine is not None and "creduce" not in kernel
    kernel, combine, splits, *_ = plans(128, n=4096, form=form)
    assert splits == 1 and combine is None and kernel["direct"] and "creduce" not in kernel
    kernel, combine, splits, *_ = plans(16, hq=128, n=4096, form=form)  # 64-head blocks
    assert splits == 4 and kernel["creduce"] == 4 and kernel["heads"] == 64


def test_switch_and_schedule(plans, monkeypatch):
    """FORGEKERNEL_MLA_CREDUCE=1 takes it without a form; a decode step's schedule (form
    SCHEDULED) keeps its items and the combine; the form takes no work list."""
    monkeypatch.setenv("FORGEKERNEL_MLA_CREDUCE", "1")
    kernel, combine, *_ = plans(16)
    assert kernel["creduce"] == 8 and combine is None
    kernel, combine, *_ = plans(16, form=mla_launch.SCHEDULED)
    assert "creduce" not in kernel and combine is not None
    monkeypatch.setenv("FORGEKERNEL_MLA_CREDUCE", "2")
    with pytest.raises(ValueError, match="FORGEKERNEL_MLA_CREDUCE"):
        plans(16)
    with pytest.raises(ValueError, match="worklist"):
        with mla_launch.plan_form(creduce=True, worklist=True):
            pass


def test_weight_sum_order():
    """The kernel's weight sum: the combine's butterfly over lanes 0 .. n - 1 (others 0)."""

    class E(str):
        def __add__(self, other):
            return E(f"({self}+{other})")

    w = [E(f"w{i}") for i in range(8)]
    assert butterfly_order(w) == "(((w0+w4)+(w2+w6))+((w1+w5)+(w3+w7)))"
    assert butterfly_order(w[:2]) == "(w0+w1)"
    assert butterfly_order(w[:4]) == "((w0+w2)+(w1+w3))"


def test_bench_variant():
    names = {c.name: c for c in suite.BENCH_CASES}
    for name in suite.CREDUCE_CASES:
        case = names[name]
        assert "creduce" in suite.variants(case)
        assert case.params["page"] == 64 and case.params["cache"] == "combined"


def test_head_blocks_from_out():
    """The CTA's unit and head block take Hq from out's mode 1 (rows, Hq, 512) in the creduce
    form as in the direct one, not mode 2 (512: the partials' Hq), which would put every CTA of
    a 16-head call past Hq (heads 16 .. 511: out-of-bounds stores)."""
    src = inspect.getsource(seesaw.MlaSeesawSm90.kernel)
    assert "hq = mOp.shape[1] if const_expr(self.direct or self.creduce) else mOp.shape[2]" in src
    assert "self._block(hq)" in src


_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def test_compile_resources():
    """bf16 16 x 1, 8 splits: the cluster's two barriers, 8 x (1 + 4) DSMEM loads a thread, the
    op's out by 4 16-bit stores and one LSE store, no bulk copy of partial rows; the main loop's
    WGMMAs and TMA loads as the partial pass's; no spill (240 registers, cu13)."""
    cubins = pytest.importorskip("cubins")
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    found = cubins.build(SPEC, params_for("partial", "bfloat16", 16, tma=True, creduce=8))
    ops = Counter(_OP.findall(found.sass))
    assert found.resources["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert found.resources["registers"] <= 240
    assert ops["UCGABAR_ARV"] == 2 and ops["UCGABAR_WAIT"] == 2
    assert found.ptx.count("ld.shared::cluster") == 8 * 5 and ops["LD.E"] == 8 * 5
    assert ops["STG.E.U16"] == 4 and ops["STG.E"] == 1
    assert found.sass.count("HGMMA.64x64x16") == 144 and ops["UTMALDG.3D"] == 50
    assert "UBLKCP" not in " ".join(ops)
