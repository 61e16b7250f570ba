"""Gated delta rule decode / MTP step suite (issue 20; registered once tests/gpu's GDN tests
pass): T = 1..4 tokens of B sequences through their fp32 state, updated in place.

Output compared: o (B, T, HV, V). The state is read and written once per call (memory-bound:
GB/s counts 2 x B x HV x K x V x 4 bytes). Ours updates `state_work`, a copy of the input set's
state made with the inputs: the first call on each set (the check) starts from the same state
as the reference; the timed calls keep updating it. Comparator: fla's fused recurrent kernel
(`fused_recurrent_gated_delta_rule`, which returns a new final state instead)."""

from __future__ import annotations

import importlib
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.linear_attention.gdn_decode.sm90 import SPEC


def _case(b, t, h, hv, *, k_last=True, l2norm=True, group="") -> Case:
    name = f"b{b}-t{t}-h{h}-hv{hv}" + ("" if k_last else "-kfirst") + ("" if l2norm else "-nol2")
    params = {"b": b, "t": t, "h": h, "hv": hv, "k_last": k_last, "l2norm": l2norm}
    return Case(name, params, group)


# Qwen3-Next-80B (16 q/k heads, 32 value heads) per tensor-parallel shard and FlashInfer-Bench's
# qk4 / v8 shape, decode batches 1..256, MTP 2 and 4 tokens.
BENCH_CASES = (
    *(_case(b, 1, 4, 8, group="decode") for b in (1, 8, 64, 256)),
    *(_case(b, 1, 16, 32, group="decode") for b in (1, 32, 128)),
    _case(64, 2, 4, 8, group="mtp"),
    _case(64, 4, 16, 32, group="mtp"),
    _case(32, 1, 16, 32, k_last=False, group="layout"),
)
CHECK_CASES = (
    _case(1, 1, 4, 8),
    _case(5, 3, 2, 4, l2norm=False),
    _case(7, 4, 16, 32, k_last=False),
    _case(33, 2, 4, 8),
)
SANITIZE_CASES = CHECK_CASES[:3]


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    b, t, h, hv = p["b"], p["t"], p["h"], p["hv"]

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=gen) * scale

    state = rnd(b, hv, 128, 128, scale=0.1)
    return {
        "q": rnd(b, t, h, 128).to(dtype), "k": rnd(b, t, h, 128).to(dtype),
        "v": rnd(b, t, hv, 128).to(dtype), "g": -rnd(b, t, hv).abs() * 0.5,
        "beta": torch.sigmoid(rnd(b, t, hv)), "state": state, "state_work": state.clone(),
        "k_last": p["k_last"], "l2norm": p["l2norm"],
    }  # fmt: skip


def alloc_out(inputs: Inputs) -> torch.Tensor:
    return torch.empty_like(inputs["v"])


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.gated_delta_rule")
    i = inputs
    return op.gated_delta_rule_step(i["q"], i["k"], i["v"], i["g"], i["beta"], i["state_work"],
                                    use_qk_l2norm=i["l2norm"], k_last=i["k_last"],
                                    out=out)  # fmt: skip


def _reference(inputs: Inputs, upcast: bool) -> torch.Tensor:
    from forgekernel.reference.delta_rule import gated_delta_rule_step

    i = inputs
    o = gated_delta_rule_step(i["q"], i["k"], i["v"], i["g"], i["beta"], i["state"].clone(),
                              use_qk_l2norm=i["l2norm"], k_last=i["k_last"])  # fmt: skip
    return o.float() if upcast else o.to(i["q"].dtype)


def reference(inputs: Inputs) -> torch.Tensor:
    return _reference(inputs, True)


def low_precision(inputs: Inputs) -> torch.Tensor:
    """The fp64 recurrence rounded to the output dtype: the yardstick is the rounding."""
    return _reference(inputs, False)


def _fla():
    try:
        from fla.ops.gated_delta_rule import fused_recurrent_gated_delta_rule
    except ImportError:
        return None

    def run(inputs: Inputs):
        i = inputs
        if "fla_state" not in i:  # fla's state is (N, HV, K, V), ours may be k-last
            st = i["state"]
            i["fla_state"] = st.transpose(-1, -2).contiguous() if i["k_last"] else st.clone()
        o, _ = fused_recurrent_gated_delta_rule(
            i["q"], i["k"], i["v"], i["g"], i["beta"], initial_state=i["fla_state"],
            output_final_state=True, use_qk_l2norm_in_kernel=i["l2norm"],
        )  # fmt: skip
        return o

    return run


def comparators() -> dict[str, Any]:
    return {"fla": _fla() if torch.cuda.is_available() else None}


def flops(case: Case) -> float:
    p = case.params
    return 8.0 * p["b"] * p["t"] * p["hv"] * 128 * 128


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    return 2.0 * p["b"] * p["hv"] * 128 * 128 * 4


def suite() -> OpSuite:
    return OpSuite(
        name="gdn_decode",
        kernel_sources=SPEC.sources,
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=low_precision,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        memory_bound=True,
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
    )
