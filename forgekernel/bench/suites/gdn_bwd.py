"""Gated DeltaNet backward suite (issue 20): the gradients of `gated_delta_rule` in q, k, v, g,
beta (and the initial state where the case has one) from dO and the final state's gradient,
fla's form as the forward suite (gdn_prefill.py: q, k (1, T, H, 128), k unit-norm, v (1, T, HV,
128), g = logsigmoid(N(0, 1)) fp32, beta fp32, varlen as B = 1 with cu_seqlens).

Timed: the backward alone (`gated_delta_rule_backward`, which recomputes the forward's chunk
states itself): its default since 2026-12-06, the KERNEL PATH of ops/gated_delta_rule_bwd.py
(kernels 0, 1 and 2 and the q / k epilogue) on every case, the unequal varlen ones in one
launch of each kernel over the forward's chunk slots (ops/_linattn_varlen.py, no host read
under a graph capture; in buckets of similar lengths earlier on 2026-12-06, 5.60 and 11.03 ms
on the H100; before that padded to 5.9x and 22x their chunks on the INTERIM path: 60 and
127 ms); the
variant `interim` (`INTERIM_CASES`, the two smallest cases: the old default, ~14.7 ms at 1 x
2048) the INTERIM fp32 torch path beside it (`interim()`, as FORGEKERNEL_GDN_BWD_KERNEL=0); on
4x8192-h16-hv32 (`SWITCH_AB_CASES`) `no_fused_slots` and `no_groupsum`, ours with one of the
switches adopted on 2026-12-07 off (ops/gated_delta_rule_bwd.py FUSED_SLOTS: the graph column's
route, the slot layout; FUSED_GROUPSUM: the eager column's, the batch path), each gain in the
same run and the other column a control (~1.00x); each
comparator's backward through autograd of its forward recorded once per input set
(`autograd_backward`: `torch.autograd.grad` with retain_graph, its own recompute included, as
ours).

Comparators (bench/sidecar.py for the sidecars: a process of their own, the case's first input
set saved and loaded bit-identically, timed by the same methods, recorded in the same slot):
  fla       fla-core 0.6.0 `chunk_gated_delta_rule`'s backward. It refuses triton >= 3.4.0,
            < 3.7.1 on Hopper (fla #640) and the host has torch 2.11's triton 3.6: with
            FK_SIDE_SITE_TRITON set (a site holding triton 3.7.1: scripts/side_wheels.sh tri)
            it runs in a sidecar whose PYTHONPATH starts with that site (fla itself from the
            main wheel set), else in this process, where it raises its refusal (missing).
  flashqla  FlashQLA 0.1.3's backward (`flash_qla.chunk_gated_delta_rule`, TileLang), the issue's
            1.05x bar, in its sidecar (gdn_prefill.flashqla_sidecar: FK_SIDE_SITE_FLASHQLA, the
            main wheel set left out); unset: missing with the reason.

Outputs: (dq, dk, dv, dg, dbeta[, d_initial_state]). Judged, not compared element-wise by the
2x-low-precision rule (the fp32 gradients have no 16-bit yardstick): each within 2e-2 of its
reference's largest entry; reference = torch.autograd through the fp64 recurrence up to 4096
tokens, the fp64 chunked backward (reference/delta_rule_bwd.py, itself checked against that
autograd in tests/test_reference_delta_rule_bwd.py) above.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.sidecar import Sidecar
from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import fla_varlen, gdn_prefill
from forgekernel.bench.suites.gdn_prefill import HEAD, _mix

RECURRENT_UP_TO = 4096  # tokens: above, the fp64 chunked backward is the reference (speed)
REL_TOL = 2e-2
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
TRITON_SITE_ENV = "FK_SIDE_SITE_TRITON"  # a site holding triton 3.7.1, for fla's backward
INPUT_KEYS = (*gdn_prefill.INPUT_KEYS, "do", "d_final")  # what a sidecar's child is given
_case = gdn_prefill._case


def kernel_sources() -> list[Path]:
    """The forward kernel's sources, the kernel path's (kernels 0, 1 and 2's sources, the fused
    kernel's, the q / k epilogue's, their batched helpers: the default) and the interim
    backward's modules (the ledger key; it does not tell which path a run took)."""
    import forgekernel.ops._linattn_varlen as varlen
    import forgekernel.ops.gated_delta_rule_bwd as bwd_op
    import forgekernel.reference.delta_rule_bwd as bwd_ref
    import forgekernel.reference.gdn_bwd_chunk as chunk_ref
    import forgekernel.reference.gdn_bwd_factors as factors_ref
    import forgekernel.reference.gdn_bwd_norm as norm_ref
    import forgekernel.reference.gdn_bwd_state as state_ref
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import SPEC as CHUNK_SPEC
    from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import SPEC as FACTORS_SPEC
    from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import SPEC as FUSED_SPEC
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import SPEC as NORM_SPEC
    from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import SPEC as STATE_SPEC

    modules = (bwd_op, varlen, bwd_ref, state_ref, chunk_ref, factors_ref, norm_ref)
    specs = (gdn_prefill.SPEC, FACTORS_SPEC, STATE_SPEC, CHUNK_SPEC, FUSED_SPEC, NORM_SPEC)
    return [*(p for spec in specs for p in spec.sources), *(Path(m.__file__) for m in modules)]


BENCH_CASES = (
    _case([2048], 16, 32, group="single"),
    _case([8192], 16, 32, group="single"),
    _case([8192] * 4, 16, 32, group="batch"),
    _case([8192] * 4, 16, 16, group="batch"),
    _case([8192] * 4, 16, 32, state=False, group="batch"),
    _case([32768] * 8, 16, 32, group="batch"),
    _case(_mix(16, 16384), 16, 32, group="varlen"),
    _case(_mix(64, 32768), 16, 32, group="varlen"),
)
INTERIM_CASES = BENCH_CASES[:2]  # the `interim` variant's: the interim path is slow
SWITCH_AB_CASES = BENCH_CASES[2:3]  # 4x8192-h16-hv32: the switches' A/B variants
SWITCH_AB = {"no_fused_slots": "FUSED_SLOTS", "no_groupsum": "FUSED_GROUPSUM"}
CHECK_CASES = (
    _case([1, 63, 64, 65, 130], 2, 4),
    _case([257], 4, 8, state=False),
    _case([100, 0, 37], 16, 32),
    _case([300, 301], 16, 16),
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    return with_output_grads(gdn_prefill.make_inputs(case, dtype, device, gen), case, gen)


def with_output_grads(inputs: Inputs, case: Case, gen: torch.Generator) -> Inputs:
    """A forward suite's inputs plus dO and the final state's gradient (shared with kda_bwd)."""
    v, n = inputs["v"], len(case.params["lens"])
    inputs["do"] = torch.randn(v.shape, device=v.device, generator=gen).to(v.dtype)
    inputs["d_final"] = torch.randn(n, v.shape[2], HEAD, HEAD, device=v.device, generator=gen)
    return inputs


def _likes(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    names = ("q", "k", "v", "g", "beta") + (("state",) if inputs["state"] is not None else ())
    return tuple(inputs[n] for n in names)


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(x) for x in _likes(inputs))


def run_ours(inputs: Inputs, out: tuple | None) -> tuple:
    from forgekernel.ops.gated_delta_rule_bwd import gated_delta_rule_backward

    return run_backward(gated_delta_rule_backward, inputs, out)


def run_interim(inputs: Inputs, out: tuple | None) -> tuple:
    """Ours on the interim path (the `interim` variant: FORGEKERNEL_GDN_BWD_KERNEL=0's)."""
    from forgekernel.ops.gated_delta_rule_bwd import interim

    with interim():
        return run_ours(inputs, out)


def run_without(switch: str) -> Callable:
    """Ours with ops/gated_delta_rule_bwd.py's constant `switch` False (the baseline of an
    adopted route; patched around the call, so a graph capture records that route)."""
    from unittest import mock

    import forgekernel.ops.gated_delta_rule_bwd as bwd_op

    def run(inputs: Inputs, out: tuple | None) -> tuple:
        with mock.patch.object(bwd_op, switch, False):
            return run_ours(inputs, out)

    return run


def variants(case: Case) -> dict[str, Any]:
    """The two smallest cases (`INTERIM_CASES`): `interim`, the fp32 torch path the kernel path
    replaced as the default (2026-12-06). 4x8192-h16-hv32 (`SWITCH_AB_CASES`): `SWITCH_AB`."""
    out = interim_variant(case, INTERIM_CASES, run_interim)
    if case.name in {c.name for c in SWITCH_AB_CASES}:
        out.update({name: run_without(switch) for name, switch in SWITCH_AB.items()})
    return out


def interim_variant(case: Case, cases, run: Callable) -> dict[str, Any]:
    """{"interim": run} on `cases` (by name), else none (shared with kda_bwd)."""
    return {"interim": run} if case.name in {c.name for c in cases} else {}


def run_backward(backward: Callable, inputs: Inputs, out: tuple | None) -> tuple:
    """An explicit backward entry (GDN's or KDA's) on the suite's inputs, writing `out` if given
    through its out= (the kernels write the buffers: no copy, as the comparators, which return
    their own tensors; until 2026-12-06 ours was timed with a copy of every gradient into
    `out`, 371 us of 6.36 ms at 4 x 8192 on the H100). A case without an initial state has
    five buffers: d_initial_state is allocated and dropped."""
    i = inputs
    n = len(_likes(i))
    given = None if out is None else (*out, *(None,) * (6 - len(out)))
    grads = backward(i["q"], i["k"], i["v"], i["g"], i["beta"], i["do"],
                     initial_state=i["state"], d_final_state=i["d_final"],
                     cu_seqlens=i["cu_seqlens"], out=given)  # fmt: skip
    return grads[:n] if out is None else tuple(out)


def reference(inputs: Inputs) -> tuple:
    """fp64 gradients (upcast to fp32 by the caller's comparison)."""
    from forgekernel.reference.delta_rule import gated_delta_rule_recurrent
    from forgekernel.reference.delta_rule_bwd import gated_delta_rule_chunked_backward

    return reference_gradients(
        gated_delta_rule_recurrent, gated_delta_rule_chunked_backward, inputs
    )


def reference_gradients(recurrent: Callable, chunked_backward: Callable, inputs: Inputs) -> tuple:
    """fp64 gradients: autograd through the fp64 recurrence up to RECURRENT_UP_TO tokens, the
    fp64 chunked backward above (shared with kda_bwd, whose recurrence and backward differ),
    one q head's value heads a pass (8 x 32768 tokens in passes of 2^21 token-heads ran the
    80 GB H100 out of memory, 2026-12-06)."""
    i = inputs
    n_out = len(_likes(i))
    if i["q"].shape[1] > RECURRENT_UP_TO:
        grads = chunked_backward(
            i["q"], i["k"], i["v"], i["g"], i["beta"], i["do"], initial_state=i["state"],
            d_final_state=i["d_final"], cu_seqlens=i["cu_seqlens_long"], dtype=torch.float64,
            heads_per_pass=1,
        )  # fmt: skip
        return grads[:n_out]
    leaves = [x.double().requires_grad_() for x in _likes(i)]
    state = leaves[5] if n_out == 6 else None
    o, final = recurrent(*leaves[:5], initial_state=state, output_final_state=True,
                         cu_seqlens=i["cu_seqlens_long"])  # fmt: skip
    loss = (o * i["do"].double()).sum() + (final * i["d_final"].double()).sum()
    return torch.autograd.grad(loss, leaves)


def judge(inputs: Inputs, outs: tuple) -> list[dict[str, Any]]:
    """Each gradient within REL_TOL of its reference's largest entry."""
    return judge_gradients(outs, reference(inputs))


def judge_gradients(
    outs: tuple, wants: tuple, names: tuple[str, ...] = GRAD_NAMES
) -> list[dict[str, Any]]:
    """The verdict on each gradient (`names` order) against its fp64 reference (shared with
    the kda_bwd and dsa_sparse_bwd suites)."""
    verdicts = []
    for name, got, want in zip(names, outs, wants):
        scale = float(want.abs().max()) if want.numel() else 0.0
        err = float((got.double() - want.double()).abs().max()) if want.numel() else 0.0
        finite = bool(torch.isfinite(got).all())
        bound = REL_TOL * scale + 1e-5
        rel = err / max(scale, 1e-30)
        ok = finite and err <= bound
        message = (
            ""
            if ok
            else f"{name}: error {err:.3g} > {bound:.3g}"
            + ("" if finite else " (non-finite values)")
        )
        verdicts.append({"ok": ok, "err": err, "lowprec_err": 0.0, "rel_err": rel,
                         "bound": bound, "message": message})  # fmt: skip
    return verdicts


def autograd_backward(chunk: Callable) -> Callable[[Inputs], tuple]:
    """The backward of a chunked forward of fla's signature (chunk(q, k, v, g, beta,
    initial_state=, output_final_state=True, cu_seqlens=int64) -> (o, final)) through autograd:
    the forward recorded once per input set, never timed; `torch.autograd.grad` of (o, final)
    with (dO, d_final) and retain_graph (fla's, FlashQLA's, kda_bwd's fla)."""
    key = f"graph:{chunk.__module__}.{chunk.__name__}"  # the recorded forward, in the set

    def grads(i: Inputs, cu: torch.Tensor):
        if key not in i:
            leaves = [x.detach().clone().requires_grad_() for x in _likes(i)]
            state = leaves[5] if len(leaves) == 6 else None
            o, final = chunk(*leaves[:5], initial_state=state, output_final_state=True,
                             cu_seqlens=cu)  # fmt: skip
            i[key] = ((o, final), leaves)
        outputs, leaves = i[key]
        return torch.autograd.grad(outputs, leaves, (i["do"], i["d_final"]), retain_graph=True)

    def run(inputs: Inputs):
        cu = fla_varlen.shared_offsets(inputs)
        return fla_varlen.call(grads, cu, inputs, cu, capturable=False)

    return run


def fla_backward():
    """fla's backward (in this process, or in the triton sidecar: `_fla`); None without fla."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return autograd_backward(chunk_gated_delta_rule)


def flashqla_backward():
    """FlashQLA's backward (run in its sidecar); None where flash_qla does not import."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except Exception:  # not installed, or TileLang / its tvm-ffi fails to load
        return None
    return autograd_backward(chunk_gated_delta_rule)


def triton_sidecar(label: str, runner: str) -> Sidecar:
    """fla's runner ("module:factory") in the sidecar whose site holds triton 3.7.1, first on
    its PYTHONPATH (the main wheel set, fla's, kept after it)."""
    return Sidecar(label, runner, TRITON_SITE_ENV, INPUT_KEYS)


def fla_refusal() -> str | None:
    """Why fla 0.6.0's gated backward will refuse this process (triton >= 3.4.0, < 3.7.1 on
    Hopper, fla #640), else None. Known before its first call: that call would run (and
    autotune) fla's forward first, ~100 s on a fresh host (2026-12-06, H100), then raise."""
    try:
        import triton
    except ImportError:
        return None
    version = tuple(int(x) for x in triton.__version__.split("+")[0].split(".")[:3])
    if (3, 4, 0) <= version < (3, 7, 1) and torch.cuda.get_device_capability()[0] == 9:
        return (f"fla-core 0.6.0 refuses its gated backward on Hopper with triton "
                f"{triton.__version__} (>= 3.4.0, < 3.7.1: fla #640); set {TRITON_SITE_ENV} to a "
                "site holding triton 3.7.1 (scripts/side_wheels.sh tri)")  # fmt: skip
    return None


def _refused(why: str) -> Callable[[Inputs], tuple]:
    def run(inputs: Inputs):
        raise RuntimeError(why)

    return run


def _fla():
    if os.environ.get(TRITON_SITE_ENV):
        return triton_sidecar("fla-core 0.6.0 on triton 3.7.1", f"{__name__}:fla_backward")
    run = fla_backward()
    why = fla_refusal() if run is not None else None
    return _refused(why) if why else run


def comparators() -> dict[str, Any]:
    """fla (in the triton sidecar where FK_SIDE_SITE_TRITON is set) and FlashQLA (the issue's
    backward bar, in its sidecar)."""
    if not torch.cuda.is_available():
        return {"fla": None, "flashqla": None}
    flashqla = gdn_prefill.flashqla_sidecar(f"{__name__}:flashqla_backward", INPUT_KEYS)
    return {"fla": _fla(), "flashqla": flashqla}


def flops(case: Case) -> float:
    """About 2.5x the forward's count (fla's backward: the state recompute, the reverse state
    recurrence, dq / dk / dw from the states, the WY transpose): a convention, as attention's."""
    return 2.5 * gdn_prefill.flops(case)


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q, k, v, dO read and dq, dk, dv written (16-bit), g / beta and their gradients (fp32),
    the states (initial, its gradient, the final state's gradient)."""
    p = case.params
    t, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])
    tokens = t * (4 * h * HEAD + 4 * hv * HEAD) * dtype.itemsize + t * hv * 16
    return tokens + (3 if p["state"] else 1) * n * hv * HEAD * HEAD * 4.0


def suite() -> OpSuite:
    return OpSuite(
        name="gdn_bwd",
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
        sanitize_cases=CHECK_CASES[:3],
        judge=judge,
        variants=variants,
    )
