"""Gated delta rule decode / MTP step suite (issue 20): T = 1..4 tokens of B sequences through
their fp32 state, updated in place.

Two forms of case. fla's (the default): g log decay and beta fp32 given, the state
(N, HV, V, K) k-last or (N, HV, K, V). FlashInfer-Bench's definitions
(`gdn_decode_qk4_v8_d128_k_last`, `gdn_mtp_qk4_v8_d128_k_last`; params gates=True): the
projections A_log / dt_bias fp32 (HV,) and a / b (B, T, HV) in q's dtype, decay
exp(-exp(A_log) softplus(a + dt_bias)) and beta sigmoid(b) computed in the kernel, k-last state,
no l2norm in the kernel (k comes unit-norm, as in FlashInfer's own test inputs), rows arange(B)
of the state pool. verify=True (T > 1) is MTP's verification: every token's state into a
(B, T, HV, V, K) buffer, the state left as it is. The reference gets the (g, beta) the
projections mean (reference.gdn_flashinfer.flashinfer_gating).

Output compared: o (B, T, HV, V). Each call reads the state once and writes it once, or T times
into the buffer on verify cases (memory-bound: GB/s counts those fp32 states). Ours updates
`state_work`, a copy of the input set's state made with the inputs: the first call on each set
(the check) starts from the same state as the reference; the timed calls keep updating it.
A comparator that updates a state in place gets its own copy of the set's state on its first
call of that set (outside the timed calls) and keeps updating it the same way.

Comparators, each on the form it computes (on the other it raises: recorded as missing, with
the reason):
  fla         `fused_recurrent_gated_delta_rule` on fla's form (returns a new final state).
  flashinfer  FlashInfer 0.7.2.post1 on the definitions' form; see `_flashinfer`.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch
import torch.nn.functional as F

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.linear_attention.gdn_decode.sm90 import SPEC

HEAD = 128


def _case(b, t, h, hv, *, k_last=True, l2norm=True, group="") -> Case:
    name = f"b{b}-t{t}-h{h}-hv{hv}" + ("" if k_last else "-kfirst") + ("" if l2norm else "-nol2")
    params = {"b": b, "t": t, "h": h, "hv": hv, "k_last": k_last, "l2norm": l2norm}
    return Case(name, params, group)


def _def_case(b, t, h, hv, *, verify=False, group="") -> Case:
    """FlashInfer-Bench's form; verify: MTP verification (FlashInfer keeps per-token states
    only for T > 1)."""
    if verify and t < 2:
        raise ValueError("verify cases need T > 1")
    params = {"b": b, "t": t, "h": h, "hv": hv, "k_last": True, "l2norm": False,
              "gates": True, "verify": verify}  # fmt: skip
    return Case(f"b{b}-t{t}-h{h}-hv{hv}-gates" + ("-verify" if verify else ""), params, group)


# Qwen3-Next-80B (16 q/k heads, 32 value heads) per tensor-parallel shard and FlashInfer-Bench's
# qk4 / v8 shape, decode batches 1..256, MTP 2 and 4 tokens; the same in the definitions' form.
BENCH_CASES = (
    *(_case(b, 1, 4, 8, group="decode") for b in (1, 8, 64, 256)),
    *(_case(b, 1, 16, 32, group="decode") for b in (1, 32, 128)),
    _case(64, 2, 4, 8, group="mtp"),
    _case(64, 4, 16, 32, group="mtp"),
    _case(32, 1, 16, 32, k_last=False, group="layout"),
    *(_def_case(b, 1, 4, 8, group="def-decode") for b in (1, 8, 64, 256)),
    _def_case(128, 1, 16, 32, group="def-decode"),
    _def_case(64, 2, 4, 8, group="def-mtp"),
    _def_case(64, 4, 16, 32, group="def-mtp"),
    _def_case(64, 4, 4, 8, verify=True, group="def-mtp"),
)
CHECK_CASES = (
    _case(1, 1, 4, 8),
    _case(5, 3, 2, 4, l2norm=False),
    _case(7, 4, 16, 32, k_last=False),
    _case(33, 2, 4, 8),
    _def_case(3, 1, 4, 8),
    _def_case(5, 3, 2, 4, verify=True),
    _def_case(33, 2, 4, 8),
)
SANITIZE_CASES = (*CHECK_CASES[:3], *CHECK_CASES[4:6])


def _rnd(gen, device):
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, device=device, generator=gen) * scale

    return rnd


def _definition_inputs(p: dict, dtype: torch.dtype, rnd) -> Inputs:
    """The definitions' inputs with the distributions of FlashInfer's gdn_decode / gdn_mtp
    trace templates (k unit-norm, A_log / dt_bias / a x 0.1, b N(0, 1)), and the (g, beta)
    they mean for the reference."""
    from forgekernel.reference.gdn_flashinfer import flashinfer_gating

    b, t, h, hv = p["b"], p["t"], p["h"], p["hv"]
    q, k = rnd(b, t, h, HEAD).to(dtype), F.normalize(rnd(b, t, h, HEAD), dim=-1).to(dtype)
    v = rnd(b, t, hv, HEAD).to(dtype)
    a_log, dt_bias = rnd(hv, scale=0.1), rnd(hv, scale=0.1)
    a, bb = rnd(b, t, hv, scale=0.1).to(dtype), rnd(b, t, hv).to(dtype)
    g, beta = flashinfer_gating(a_log, a, dt_bias, bb)
    state = rnd(b, hv, HEAD, HEAD, scale=0.1)
    inter = state.new_empty(b, t, hv, HEAD, HEAD) if p["verify"] else None
    return {
        "q": q, "k": k, "v": v, "g": g, "beta": beta, "state": state,
        "state_work": state.clone(), "k_last": True, "l2norm": False, "gates": True,
        "verify": p["verify"], "A_log": a_log, "a": a, "dt_bias": dt_bias, "b": bb,
        "rows": torch.arange(b, dtype=torch.int32, device=q.device), "inter": inter,
    }  # fmt: skip


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    rnd = _rnd(gen, device)
    if p.get("gates"):
        return _definition_inputs(p, dtype, rnd)
    b, t, h, hv = p["b"], p["t"], p["h"], p["hv"]
    state = rnd(b, hv, HEAD, HEAD, scale=0.1)
    return {
        "q": rnd(b, t, h, HEAD).to(dtype), "k": rnd(b, t, h, HEAD).to(dtype),
        "v": rnd(b, t, hv, HEAD).to(dtype), "g": -rnd(b, t, hv).abs() * 0.5,
        "beta": torch.sigmoid(rnd(b, t, hv)), "state": state, "state_work": state.clone(),
        "k_last": p["k_last"], "l2norm": p["l2norm"],
    }  # fmt: skip


def alloc_out(inputs: Inputs) -> torch.Tensor:
    return torch.empty_like(inputs["v"])


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.gated_delta_rule")
    i = inputs
    if i.get("gates"):
        # What op.gdn_mtp_flashinfer(q, k, v, state_work, rows, A_log, a, dt_bias, b, None,
        # inter, disable_state_update=verify) runs (its _flashinfer_step), with out= added: the
        # adapters allocate their output, the harness wants it in `out`. (decode's adapter also
        # clones the state first, FlashInfer-Bench's semantics; FlashInfer updates in place.)
        # T = 1 with the state per sequence, as FlashInfer's decode takes it (no index list);
        # T > 1 through the rows, as its MTP takes initial_state_indices
        rows = None if i["q"].shape[1] == 1 else i["rows"]
        return op.gated_delta_rule_step(
            i["q"], i["k"], i["v"], i["a"], i["b"], i["state_work"], state_indices=rows,
            k_last=True, intermediate_states=i["inter"], out=out,
            _gates=(i["A_log"], i["dt_bias"]), _update_state=not i["verify"],
        )  # fmt: skip
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
        if i.get("gates"):
            raise NotImplementedError(
                "definition-form case: fla's fused recurrent kernel takes g / beta, not the "
                "projections A_log / a / dt_bias / b"
            )
        if "fla_state" not in i:  # fla's state is (N, HV, K, V), ours may be k-last
            st = i["state"]
            i["fla_state"] = st.transpose(-1, -2).contiguous() if i["k_last"] else st.clone()
        o, _ = fused_recurrent_gated_delta_rule(
            i["q"], i["k"], i["v"], i["g"], i["beta"], initial_state=i["fla_state"],
            output_final_state=True, use_qk_l2norm_in_kernel=i["l2norm"],
        )  # fmt: skip
        return o

    return run


def _flashinfer():
    """FlashInfer 0.7.2.post1's decode / MTP, read in its source, flashinfer/gdn_decode.py
    (the definition's fi_api tag names `flashinfer.gdn.gated_delta_rule_decode`: no
    `flashinfer.gdn` module in that release; its `gated_delta_rule_decode` there is the K-major
    (B, HV, K, V) variant, and its trace template for the k-last definition is on both):

      T = 1  gated_delta_rule_decode_pretranspose(q, k, v, state, A_log, a, dt_bias, b,
               scale=None, output=None, use_qk_l2norm=True, initial_state=None,
               initial_state_indices=None, output_state_indices=None,
               intermediate_states_buffer=None, disable_state_update=False, backend="auto")
             fp32 state (B, HV, V, K) updated in place (the "legacy" fp32 path; bf16 states take
             another kernel); backend "auto" tries the Cake GDN kernels only with a state pool,
             and those only on SM100 / SM103, so on the H200 it is the generic kernel.
      T > 1  gated_delta_rule_mtp(q, k, v, initial_state, initial_state_indices, A_log, a,
               dt_bias, b, scale=None, output=None, intermediate_states_buffer=None,
               ssm_state_indices=None, disable_state_update=None (True, with a deprecation
               warning), use_qk_l2norm=True, output_state_indices=None, ...)
             fp32 pool (P, HV, V, K) read at rows initial_state_indices and written back unless
             disable_state_update; the buffer (>= B, >= T, HV, V, K) indexed by batch row.

    Both: q / k / v bf16 (fp16 is converted first), A_log fp32, dt_bias fp32 or bf16,
    softplus(x) = x above 20, l2norm eps 1e-6 inside the rsqrt, scale None -> K ** -0.5, the
    output bf16 (cast when `output` is another dtype). CuTe DSL kernels JIT-compiled on the first
    call of each specialization (T, H, HV, K, V, dtypes, scale, l2norm; MTP's tiles also depend
    on B), cached on disk: the harness's untimed first call per case pays it."""
    try:
        from flashinfer.gdn_decode import gated_delta_rule_decode_pretranspose as decode
        from flashinfer.gdn_decode import gated_delta_rule_mtp as mtp
    except Exception:  # not installed, or a CUDA / DSL dependency it imports fails to load
        return None

    def setup(i: Inputs) -> tuple:
        """Its own copy of the set's state (updated in place, as ours updates state_work), its
        output and per-token state buffer."""
        inter = None if i["inter"] is None else torch.empty_like(i["inter"])
        return i["state"].clone(), torch.empty_like(i["v"]), inter

    def run(inputs: Inputs):
        i = inputs
        if not i.get("gates"):
            raise NotImplementedError(
                "fla-form case: FlashInfer's GDN decode takes the projections A_log / a / "
                "dt_bias / b, not g / beta (the definition-form cases compare it)"
            )
        if "flashinfer" not in i:
            i["flashinfer"] = setup(i)
        state, out, inter = i["flashinfer"]
        gates = {"A_log": i["A_log"], "a": i["a"], "dt_bias": i["dt_bias"], "b": i["b"]}
        if i["q"].shape[1] == 1:
            o, _ = decode(i["q"], i["k"], i["v"], state=state, **gates, scale=None, output=out,
                          use_qk_l2norm=False)  # fmt: skip
        else:
            o, _ = mtp(i["q"], i["k"], i["v"], initial_state=state,
                       initial_state_indices=i["rows"], **gates, scale=None, output=out,
                       intermediate_states_buffer=inter, disable_state_update=i["verify"],
                       use_qk_l2norm=False)  # fmt: skip
        return o

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fla": None, "flashinfer": None}
    return {"fla": _fla(), "flashinfer": _flashinfer()}


def flops(case: Case) -> float:
    p = case.params
    return 8.0 * p["b"] * p["t"] * p["hv"] * HEAD * HEAD


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """The fp32 states read and written: one read, then the final state or, on verify, T."""
    p = case.params
    writes = p["t"] if p.get("verify") else 1
    return (1 + writes) * p["b"] * p["hv"] * HEAD * HEAD * 4.0


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
