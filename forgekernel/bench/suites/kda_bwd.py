"""Kimi Delta Attention backward suite (issue 20): the gradients of `kimi_delta_attention` in
q, k, v, g (per key channel), beta (and the initial state where the case has one) from dO and
the final state's gradient, in the forward suite's form (kda_prefill.py: q, k (1, T, H, 128),
k unit-norm, v (1, T, HV, 128), g (1, T, HV, 128) = logsigmoid(N(0, 1)) fp32, or uniform in
[-5, -4] per step and channel on the `-strong` cases, beta fp32, varlen as B = 1).

Timed: the backward alone (`kimi_delta_attention_backward`, which recomputes the forward's
chunk states itself): its default since 2026-12-06, the KERNEL PATH of ops/kda_bwd.py (kernels
1 and 2) on every case, the unequal varlen ones in one launch of each kernel over the
forward's chunk slots (ops/_linattn_varlen.py; in buckets of similar lengths earlier on
2026-12-06, 9.80 and 17.05 ms on the H100; the INTERIM fp32 torch path before);
the variant `interim` (`INTERIM_CASES`, the two smallest cases: the old default) the interim
path beside it (`interim()`, as FORGEKERNEL_KDA_BWD_KERNEL=0); fla's chunk_kda
backward through autograd of a forward recorded once per input set (gdn_bwd.autograd_backward:
`torch.autograd.grad` with retain_graph, its own recompute included, as ours). fla's gated
backward refuses triton < 3.7.1 on Hopper: with FK_SIDE_SITE_TRITON set it runs in the triton
sidecar (gdn_bwd.triton_sidecar, bench/sidecar.py: a process of its own, the case's first input
set saved and loaded bit-identically, the same timing methods, the same record slot), else in
this process. cuDNN-frontend 1.32's backward op
called directly (`cudnn::kimi_delta_attention_bwd`, the one its forward's registered autograd
formula calls: dO, q, k, v, g, beta, cu_seqlens, scale, initial_state, d_final_state; no
forward recorded, its own recompute included, as ours; capturable), THD, the states (N, HV, V,
K) fp32 ("vk", kda_prefill.CUDNN_STATE_LAYOUT), converted once per input set, its gradients
handed back as ours (views). Its planner's sm90 default is kda_hopper_cuda, the only sm90 KDA
backward kernel, for H = HV, bf16 and the default scale; H 16 HV 32 falls to kda_cutile where
the cuda.tile runtime serves it, else is recorded missing with the engines' reasons; each
record names the engine that ran (`ran`, bench/suites/cudnn_kda.py).

Outputs: (dq, dk, dv, dg, dbeta[, d_initial_state]). Judged as gdn_bwd's (`judge_gradients`):
each within 2e-2 of its reference's largest entry; reference = torch.autograd through the fp64
recurrence up to 4096 tokens, the fp64 chunked backward (reference/kda_bwd.py, itself checked
against that autograd in tests/test_reference_kda_bwd.py) above.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import cudnn_kda, gdn_bwd, kda_prefill
from forgekernel.bench.suites.kda_prefill import HEAD, _case, _mix

RECURRENT_UP_TO = gdn_bwd.RECURRENT_UP_TO
_likes = gdn_bwd._likes
alloc_out = gdn_bwd.alloc_out


def kernel_sources() -> list[Path]:
    """The forward's sources, the kernel path's (kernels 1 and 2's sources, Gated DeltaNet's q /
    k epilogue's and the GDN op module its helpers come from, the varlen buckets, their batched
    helpers: the default; the WY kernel's and its model's, WY_IN_KERNEL's, on by default: a run
    with it on is keyed by them too) and the interim backward's modules (the ledger key; it does
    not tell which path a run took)."""
    import forgekernel.ops._linattn_varlen as varlen
    import forgekernel.ops.gated_delta_rule_bwd as gdn_op
    import forgekernel.ops.kda_bwd as bwd_op
    import forgekernel.reference.delta_rule_bwd as gdn_ref
    import forgekernel.reference.gdn_bwd_norm as norm_ref
    import forgekernel.reference.gdn_bwd_state as state_ref
    import forgekernel.reference.kda_bwd as bwd_ref
    import forgekernel.reference.kda_bwd_chunk as chunk_ref
    import forgekernel.reference.kda_bwd_wy as wy_ref
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import SPEC as NORM_SPEC
    from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import SPEC as STATE_SPEC
    from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import SPEC as CHUNK_SPEC
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import SPEC as WY_SPEC

    modules = (bwd_op, gdn_op, varlen, bwd_ref, gdn_ref, state_ref, chunk_ref, norm_ref, wy_ref)
    specs = (STATE_SPEC, CHUNK_SPEC, NORM_SPEC, WY_SPEC)
    kernels = tuple(p for spec in specs for p in spec.sources)
    return [*kda_prefill.SOURCES, *kernels, *(Path(m.__file__) for m in modules)]


BENCH_CASES = (
    _case([2048], 16, 16, group="single"),
    _case([8192], 16, 16, group="single"),
    _case([8192] * 4, 16, 16, group="batch"),
    _case([8192] * 4, 16, 16, state=False, group="batch"),
    _case([8192] * 4, 16, 32, group="batch"),
    _case(_mix(16, 16384), 16, 16, group="varlen"),
    _case(_mix(64, 32768), 16, 16, group="varlen"),
)
INTERIM_CASES = BENCH_CASES[:2]  # the `interim` variant's: the interim path is slow
CHECK_CASES = (
    _case([1, 15, 16, 17, 63, 64, 65, 130], 2, 2),
    _case([257], 4, 8, state=False),
    _case([100, 0, 37], 16, 16, strong=True),
    _case([300, 301], 16, 32),
    _case([1000, 77], 4, 4, strong=True),
)
SANITIZE_CASES = CHECK_CASES[:3]  # the third has an empty sequence and strong decays


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    return gdn_bwd.with_output_grads(kda_prefill.make_inputs(case, dtype, device, gen), case, gen)


def run_ours(inputs: Inputs, out: tuple | None) -> tuple:
    from forgekernel.ops.kda_bwd import kimi_delta_attention_backward

    return gdn_bwd.run_backward(kimi_delta_attention_backward, inputs, out)


def run_interim(inputs: Inputs, out: tuple | None) -> tuple:
    """Ours on the interim path (the `interim` variant: FORGEKERNEL_KDA_BWD_KERNEL=0's)."""
    from forgekernel.ops.kda_bwd import interim

    with interim():
        return run_ours(inputs, out)


def variants(case: Case) -> dict[str, Any]:
    """The two smallest cases (`INTERIM_CASES`): `interim`, the fp32 torch path the kernel path
    replaced as the default (2026-12-06)."""
    return gdn_bwd.interim_variant(case, INTERIM_CASES, run_interim)


def reference(inputs: Inputs) -> tuple:
    """fp64 gradients (upcast to fp32 by the caller's comparison)."""
    from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
    from forgekernel.reference.kda_bwd import kimi_delta_attention_chunked_backward

    return gdn_bwd.reference_gradients(
        kimi_delta_attention_recurrent, kimi_delta_attention_chunked_backward, inputs
    )


def judge(inputs: Inputs, outs: tuple) -> list[dict[str, Any]]:
    """Each gradient within gdn_bwd.REL_TOL of its reference's largest entry."""
    return gdn_bwd.judge_gradients(outs, reference(inputs))


def fla_backward():
    """fla's chunk_kda backward (in this process, or in the triton sidecar: `_fla`); None
    without fla."""
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # not installed, or its Triton import fails
        return None
    return gdn_bwd.autograd_backward(chunk_kda)


def _fla():
    if os.environ.get(gdn_bwd.TRITON_SITE_ENV):
        return gdn_bwd.triton_sidecar("fla-core 0.6.0 on triton 3.7.1", f"{__name__}:fla_backward")
    return fla_backward()


def _cudnn():
    """cuDNN-frontend's own KDA backward (bench/suites/cudnn_kda.py), called directly: the
    planner's default engine, named in each case's record."""
    return cudnn_kda.runner("bprop", lambda: kda_prefill.CUDNN_STATE_LAYOUT)


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fla": None, "cudnn": None}
    return {"fla": _fla(), "cudnn": _cudnn()}


def flops(case: Case) -> float:
    """2.5x the forward's count, as gdn_bwd's convention."""
    return 2.5 * kda_prefill.flops(case)


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q, k, v, dO read and dq, dk, dv written (16-bit), g and dg (fp32, per channel), beta
    and dbeta, the states (initial, its gradient, the final state's gradient)."""
    p = case.params
    t, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])
    tokens = t * (4 * h * HEAD + 4 * hv * HEAD) * dtype.itemsize + t * hv * (8 * HEAD + 8)
    return tokens + (3 if p["state"] else 1) * n * hv * HEAD * HEAD * 4.0


def suite() -> OpSuite:
    return OpSuite(
        name="kda_bwd",
        kernel_sources=kernel_sources(),
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=reference,  # unused: the judge holds the yardstick
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        judge=judge,
        variants=variants,
    )
