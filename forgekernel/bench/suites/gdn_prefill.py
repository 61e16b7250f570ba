"""Gated DeltaNet forward (prefill) suite (issue 20): fla's form, q, k (1, T, H, 128),
v (1, T, HV, 128), g fp32 log decay, beta fp32, varlen as B = 1 with cu_seqlens (fixed-length
batches are varlen with equal lengths here, as FlashInfer takes them), with or without an fp32
initial state (N, HV, K, V), the final state returned; k unit-norm (no l2norm in the kernel),
as in fla's and FlashInfer's own benchmarks; g = logsigmoid(N(0, 1)) (fla's test decay).

Output compared: o (1, T, HV, V). Reference: the fp64 recurrence up to 4096 tokens, the fp64
chunked form above (reference.delta_rule; tests/test_reference_delta_rule.py checks one against
the other). Shapes: Qwen3-Next / Kimi-Linear per shard (H 16, HV 32; H = HV = 16) and
FlashInfer-Bench's qk4 / v8, 2k to 256k tokens (the issue's 1 x 2k to 8 x 32k and 1 x 128k),
single sequences, equal batches and serving-like varlen mixes (many short sequences, a few long).

Comparators, each on the same inputs:
  fla         fla-core 0.6.0 `chunk_gated_delta_rule(q, k, v, g, beta, scale, initial_state,
              output_final_state, cu_seqlens)` (Triton; state (N, HV, K, V) as ours), the input
              sets sharing one cu_seqlens tensor (bench/suites/fla_varlen.py).
  flashinfer  FlashInfer 0.7.2.post1 `flashinfer.chunk_gated_delta_rule(q, k, v, g=exp(g),
              beta, cu_seqlens=int64)` on (T, H, K) tensors (its g is the linear decay, not the
              log); on initial-state cases with the state in FLASHINFER_STATE_LAYOUT, "vk" as its
              docstring says ((N, H, V, K)), confirmed on the device by
              scripts/probe_state_layouts.py (2026-12-03).
  flashqla    FlashQLA 0.1.3 (flash-qla, TileLang 0.1.15), the issue's bar: a sidecar comparator
              (bench/sidecar.py), timed in a process of its own whose PYTHONPATH starts with the
              site FK_SIDE_SITE_FLASHQLA names and leaves out /root/wheels-site (TileLang pins
              apache-tvm-ffi < 0.1.13; the CuTe DSL's 0.1.15 lives there): `flashqla_forward`,
              `flash_qla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=,
              output_final_state=True, cu_seqlens=int64)`, fla's signature (g the log decay,
              scale K^-1/2, state (N, HV, K, V) fp32 as ours: its state_v_first=False), on the
              case's first input set saved and loaded bit-identically, the sets sharing one
              cu_seqlens tensor as fla's (its chunk tables are memoized as fla's). Unset
              variable: reported missing with the reason (scripts/side_wheels.sh installs the
              site).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F

from forgekernel.bench.sidecar import MAIN_SITE, Sidecar
from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import fla_varlen
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import CHUNK

HEAD = 128
RECURRENT_UP_TO = 4096  # tokens: above, the fp64 chunked form is the reference (speed)
FP64_KEY = "o_fp64"  # the fp64 output from `reference` to `low_precision`
# FlashInfer's initial-state layout, one of STATE_LAYOUTS (None: initial-state cases raise):
# "vk", (N, HV, V, K) fp32, confirmed by scripts/probe_state_layouts.py on the H200 2026-12-03
# 14:19 ("kv" wrong, o rel 1.59; "vk" o rel 3.3e-3, final state rel 4.9e-3).
FLASHINFER_STATE_LAYOUT: str | None = "vk"
STATE_LAYOUTS = ("kv", "vk", "kv-bf16", "vk-bf16")


def state_in_layout(state: torch.Tensor, layout: str) -> torch.Tensor:
    """Our (N, HV, K, V) fp32 state in a comparator's layout, contiguous: "kv" as ours, "vk"
    transposed to (N, HV, V, K); a "-bf16" suffix rounds it to bf16."""
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"state layout {layout!r}: one of {STATE_LAYOUTS}")
    s = state.transpose(-1, -2) if layout.startswith("vk") else state
    return s.to(torch.bfloat16 if layout.endswith("bf16") else torch.float32).contiguous()


def state_from_layout(state: torch.Tensor, layout: str) -> torch.Tensor:
    """A comparator's state in `layout` back to our (N, HV, K, V) fp32 (state_in_layout's
    inverse, up to the bf16 rounding)."""
    if layout not in STATE_LAYOUTS:
        raise ValueError(f"state layout {layout!r}: one of {STATE_LAYOUTS}")
    s = state.transpose(-1, -2) if layout.startswith("vk") else state
    return s.float()


def _case(lens, h, hv, *, state=True, group="") -> Case:
    lens = tuple(lens)
    shape = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"mix{len(lens)}-t{sum(lens)}"
    name = f"{shape}-h{h}-hv{hv}" + ("" if state else "-nostate")
    return Case(name, {"lens": lens, "h": h, "hv": hv, "state": state}, group)


def _mix(n: int, total: int) -> tuple[int, ...]:
    """n lengths summing to total: a quarter of the tokens in n - 2 short sequences (odd sizes),
    the rest in two long ones (serving's prefill mixes)."""
    short = max(1, total // 4 // (n - 2))
    lens = [short + (i % 7) * 3 - 9 if short > 12 else short for i in range(n - 2)]
    rest = total - sum(lens)
    return (*lens, rest // 2, rest - rest // 2)


BENCH_CASES = (
    *(_case([t], 16, 32, group="single") for t in (2048, 4096, 16384, 65536)),
    # the longest: 1 x 128k and 8 x 32k, at H = HV = 16 as kda_prefill's (at HV 32 the
    # fp64 chunked reference, q and k repeated per value head, would peak near 50 GB at 8 x 32k)
    _case([131072], 16, 16, group="single"),
    _case([32768] * 8, 16, 16, group="batch"),
    _case([8192] * 4, 16, 32, group="batch"),
    _case([8192] * 4, 16, 16, group="batch"),
    _case([8192] * 4, 16, 32, state=False, group="batch"),
    _case([2048] * 8, 4, 8, group="batch"),
    _case(_mix(16, 16384), 16, 32, group="varlen"),
    _case(_mix(64, 32768), 16, 32, group="varlen"),
    _case(_mix(64, 65536), 4, 8, group="varlen"),
    # without an initial state (FlashInfer's comparator runs only these: its state layout is
    # unconfirmed), one a group beside 4 x 8192
    _case([16384], 16, 32, state=False, group="single"),
    _case([2048] * 16, 16, 32, state=False, group="batch"),
    _case(_mix(64, 32768), 16, 32, state=False, group="varlen"),
)
CHECK_CASES = (
    _case([1, 63, 64, 65, 130], 2, 4),
    _case([257], 4, 8, state=False),
    _case([100, 0, 37], 16, 32),
    _case([300, 301], 16, 16),
    # HV = H over 2 N HV > SMs CTAs: the launcher's one standard-form route (launch.t_pre_for);
    # the cases above take the t_pre form
    _case([40] * 9, 8, 8),
)
# the third has an empty sequence; the last the standard route (its O warp's tail rows: 40 of 64)
SANITIZE_CASES = (*CHECK_CASES[:3], CHECK_CASES[-1])


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    total, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    cu = torch.tensor([0, *torch.tensor(p["lens"]).cumsum(0).tolist()], device=device)
    return {
        "q": rnd(1, total, h, HEAD).to(dtype),
        "k": F.normalize(rnd(1, total, h, HEAD), dim=-1).to(dtype),
        "v": rnd(1, total, hv, HEAD).to(dtype),
        "g": F.logsigmoid(rnd(1, total, hv)),
        "beta": torch.sigmoid(rnd(1, total, hv)),
        "state": rnd(n, hv, HEAD, HEAD) * 0.1 if p["state"] else None,
        "cu_seqlens": cu.to(torch.int32),
        "cu_seqlens_long": cu,
    }


def alloc_out(inputs: Inputs) -> torch.Tensor:
    return torch.empty_like(inputs["v"])


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
    i = inputs
    o, _ = op.gated_delta_rule(i["q"], i["k"], i["v"], i["g"], i["beta"],
                               initial_state=i["state"], output_final_state=True,
                               cu_seqlens=i["cu_seqlens"], out=out)  # fmt: skip
    return o


def _reference(inputs: Inputs) -> torch.Tensor:
    """The fp64 output."""
    from forgekernel.reference.delta_rule import (
        gated_delta_rule_chunked,
        gated_delta_rule_recurrent,
    )

    i = inputs
    long = i["q"].shape[1] > RECURRENT_UP_TO
    run = gated_delta_rule_chunked if long else gated_delta_rule_recurrent
    extra = {"dtype": torch.float64}
    o, _ = run(i["q"], i["k"], i["v"], i["g"], i["beta"], initial_state=i["state"],
               cu_seqlens=i["cu_seqlens_long"], **extra)  # fmt: skip
    return o


H200_SMS = 132
# the t_pre form's state chain against next/gdn-tpre's (variant t_pre_state_lds): an unsplit
# case (two state warpgroups) and a split one (one)
STATE_CHAIN_AB = ("4x8192-h16-hv32", "1x4096-h16-hv32")
# the standard form without its O warp (variant no_o_warp; the launcher's standard form has it,
# H100 2026-12-07 0.943-0.986x): the case where the launcher takes the standard form (HV = H,
# unsplit) and one where `standard` is the variant
STANDARD_CHAIN_AB = ("8x32768-h16-hv16", "4x8192-h16-hv32")


def _run_forced(**forced):
    """Ours through the launcher with a choice forced: `v_split` (1: one CTA per sequence and
    head; 2: two, each with 64 value rows of the state and two aux warpgroups), `segments`
    (1: the direct launch; P: each sequence cut into P segments, three passes) or `t_pre` (True:
    T diag(beta) by the precompute kernel, read by the chunked kernel's t_pre form; False: the
    standard form, its aux forming T, with its O warp unless `o_warp=False`), `b_no_o`
    (False: the segmented path's pass B with o)."""

    def run(inputs: Inputs, out):
        launch = importlib.import_module(
            "forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch"
        )
        i = inputs
        n, hv = len(i["cu_seqlens"]) - 1, i["v"].shape[2]
        final = torch.empty(n, hv, HEAD, HEAD, dtype=torch.float32, device=i["v"].device)
        launch.gdn_prefill(i["q"][0], i["k"][0], i["v"][0], i["g"][0], i["beta"][0], i["state"],
                           i["cu_seqlens"], out[0], final, HEAD**-0.5, k_last=False,
                           l2norm=False, **forced)  # fmt: skip
        return out

    return run


def uses_t_pre(case: Case) -> bool:
    """Whether the launcher takes the t_pre form on the case (`launch.t_pre_for`)."""
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import v_split_for
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch import (
        segments_for,
        t_pre_for,
    )

    lens, h, hv = case.params["lens"], case.params["h"], case.params["hv"]
    n = len(lens)
    parts = segments_for(n, hv, sum(lens), H200_SMS)
    return t_pre_for(h, hv, v_split_for(n, hv, H200_SMS), parts)


def variants(case: Case) -> dict[str, Any]:
    """The form the launcher does not take on the case, on every case: `standard` (the aux
    forms T) where it takes the t_pre form, `t_pre` where it does not (launch.t_pre_for; its
    other choices its own). The other V split beside the launcher's choice, where the problem
    has at most two waves of split CTAs: whether a split CTA's chunk costs under half an
    unsplit one's decides where the split pays (config.v_split_for). Few long sequences: the
    direct launch beside the segmented one where the launcher segments (`segments_1`), and the
    segments that would fill one wave where it does not but might (N HV <= SMs / 4: 5 at
    1 x hv32, the model's break-even, launch.segments_for). The split and segment variants keep
    the case's form (t_pre forced as ours takes it), so each compares one choice.
    `t_pre_state_lds` on STATE_CHAIN_AB: the t_pre form with next/gdn-tpre's state chain, the
    A/B of its O warp and ldmatrix V^T. `no_o_warp` on STANDARD_CHAIN_AB: the standard form
    without its O warp (V^T by 16-bit loads, O stored by the state warps), against ours
    (8x32768-h16-hv16) and against `standard` (4x8192-h16-hv32), both of which have it.
    `b_with_o` where the launcher segments in the t_pre form: pass B with o (ours runs it on
    the `no_o` key: no q, P, O^T or o); likewise `segments_<P>_b_with_o` beside
    `segments_<P>`."""
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import v_split_for
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch import segments_for

    lens, hv = case.params["lens"], case.params["hv"]
    n = len(lens)
    t_pre = uses_t_pre(case)
    out: dict[str, Any] = {}
    out["standard" if t_pre else "t_pre"] = _run_forced(t_pre=not t_pre)
    if case.name in STATE_CHAIN_AB:
        out["t_pre_state_lds"] = _run_forced(t_pre=True, state_lds=True)
    if case.name in STANDARD_CHAIN_AB:
        out["no_o_warp"] = _run_forced(t_pre=False, o_warp=False)
    direct = segments_for(n, hv, sum(lens), H200_SMS) == 1
    if not direct:
        if t_pre:
            out["b_with_o"] = _run_forced(t_pre=True, b_no_o=False)
        return {**out, "segments_1": _run_forced(segments=1, t_pre=t_pre)}
    if 4 * n * hv <= H200_SMS and sum(lens) >= 16384 * n:
        parts = (H200_SMS // hv + 1) // n
        out[f"segments_{parts}"] = _run_forced(segments=parts, t_pre=t_pre)
        if t_pre:
            out[f"segments_{parts}_b_with_o"] = _run_forced(segments=parts, t_pre=True,
                                                            b_no_o=False)  # fmt: skip
    if v_split_for(n, hv, H200_SMS) == 2:
        out["v_split_1"] = _run_forced(v_split=1, t_pre=t_pre)
    elif 2 * n * hv <= 2 * H200_SMS:
        out["v_split_2"] = _run_forced(v_split=2, t_pre=t_pre)
    return out


def reference(inputs: Inputs) -> torch.Tensor:
    """The fp64 output in fp32; the fp64 kept in the inputs for `low_precision`, which takes
    it (`check.expected` asks for both: one fp64 pass, not two)."""
    o = inputs[FP64_KEY] = _reference(inputs)
    return o.float()


def low_precision(inputs: Inputs) -> torch.Tensor:
    """The fp64 result rounded to the output dtype: the yardstick is the rounding."""
    o = inputs.pop(FP64_KEY, None)
    return (_reference(inputs) if o is None else o).to(inputs["q"].dtype)


def fla_form(chunk_gated_delta_rule) -> Callable[[Inputs], torch.Tensor]:
    """fn(inputs) -> o for a `chunk_gated_delta_rule` of fla's signature (fla's, FlashQLA's):
    the input sets share one cu_seqlens tensor (fla_varlen), since both memoize their chunk
    tables by its identity (4 entries)."""

    def run(inputs: Inputs):
        i = inputs
        cu = fla_varlen.shared_offsets(i)
        o, _ = fla_varlen.call(chunk_gated_delta_rule, cu, i["q"], i["k"], i["v"], i["g"],
                               i["beta"], initial_state=i["state"], output_final_state=True,
                               cu_seqlens=cu)  # fmt: skip
        return o

    return run


def _fla():
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return fla_form(chunk_gated_delta_rule)


def _flashinfer():
    try:
        from flashinfer import chunk_gated_delta_rule
    except Exception:  # not installed, or a CUDA / DSL dependency it imports fails to load
        return None

    def run(inputs: Inputs):
        i = inputs
        layout = FLASHINFER_STATE_LAYOUT
        if i["state"] is not None and layout is None:
            raise NotImplementedError(
                "initial-state case: FlashInfer's prefill state layout is not yet confirmed on "
                "the device (scripts/probe_state_layouts.py; the -nostate cases compare it)"
            )
        if "flashinfer" not in i:  # its (T, H, K) form and linear decay, made once per set
            i["flashinfer"] = (i["q"][0], i["k"][0], i["v"][0], i["g"][0].exp(), i["beta"][0])
        q, k, v, alpha, beta = i["flashinfer"]
        extra = {}
        if i["state"] is not None:  # in its layout, made once per set (outside the timing)
            key = f"flashinfer_state_{layout}"
            if key not in i:
                i[key] = state_in_layout(i["state"], layout)
            extra["initial_state"] = i[key]
        o = chunk_gated_delta_rule(q, k, v, g=alpha, beta=beta, cu_seqlens=i["cu_seqlens_long"],
                                   **extra)  # fmt: skip
        o = o[0] if isinstance(o, tuple) else o
        return o.unsqueeze(0)

    return run


# FlashQLA 0.1.3 (PyPI `flash-qla`, pure Python: flash_qla.chunk_gated_delta_rule) needs tilelang
# >= 0.1.12, whose 0.1.15 wheel (49.5 MB) pins apache-tvm-ffi < 0.1.13 and z3-solver < 4.15.5 (read
# in the wheels' METADATA, 2026-12-04): the CuTe DSL's tvm-ffi 0.1.15 cannot share its process.
FLASHQLA_SITE_ENV = "FK_SIDE_SITE_FLASHQLA"
INPUT_KEYS = ("q", "k", "v", "g", "beta", "state", "cu_seqlens", "cu_seqlens_long")


def flashqla_forward():
    """FlashQLA's forward on the suite's inputs (run in its sidecar: `_flashqla`); None where
    flash_qla does not import (it selects its kernels by the GPU's compute capability)."""
    try:
        from flash_qla import chunk_gated_delta_rule
    except Exception:  # not installed, or TileLang / its tvm-ffi fails to load
        return None
    # FlashQLA memoizes its CP context and chunk tables by the identity of cu_seqlens, 4 entries
    # (flash_qla.utils.tensor_cache, fla's): fla's form, one shared tensor
    return fla_form(chunk_gated_delta_rule)


def flashqla_sidecar(runner: str, keys: tuple[str, ...]) -> Sidecar:
    """A FlashQLA runner ("module:factory") in its sidecar: its site first, the main wheel set
    (the DSL's tvm-ffi) left out."""
    return Sidecar("FlashQLA 0.1.3", runner, FLASHQLA_SITE_ENV, keys, drop=(MAIN_SITE,))


def _flashqla() -> Sidecar:
    return flashqla_sidecar(f"{__name__}:flashqla_forward", INPUT_KEYS)


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fla": None, "flashinfer": None, "flashqla": None}
    return {"fla": _fla(), "flashinfer": _flashinfer(), "flashqla": _flashqla()}


def flops(case: Case) -> float:
    """The chunked algorithm's multiply-adds per token and value head (K = V = 128, chunk C):
    K K^T, the triangular solve's products, w and u, W S, Q S, Q K^T, P U and K^T U."""
    p = case.params
    k = v = HEAD
    per_token = 6.0 * k * v + 2.0 * CHUNK * (3 * k + 2 * v)
    return per_token * sum(p["lens"]) * p["hv"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q, k, v read and o written (16-bit), g / beta (fp32), the states read and written."""
    p = case.params
    t, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])
    tokens = t * (2 * h * HEAD + 2 * hv * HEAD) * dtype.itemsize + t * hv * 8
    return tokens + (2 if p["state"] else 1) * n * hv * HEAD * HEAD * 4.0


def suite() -> OpSuite:
    return OpSuite(
        name="gdn_prefill",
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
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )
