"""Kimi Delta Attention forward (prefill) suite (issue 20): fla's `chunk_kda` form, q, k (1, T,
H, 128), v (1, T, HV, 128) bf16, g (1, T, HV, 128) fp32 log decay per key channel, beta fp32,
varlen as B = 1 with cu_seqlens (fixed-length batches are varlen with equal lengths, as the
comparators take them), with or without an fp32 initial state (N, HV, K, V), the final state
returned; k unit-norm (no l2norm in the kernel); g = logsigmoid(N(0, 1)) per channel (fla's
test gate), and on the `-strong` check cases uniform in [-5, -4] per step and channel (the
decays the sub-chunk references exist for: reference/kda_chunked.py).

Output compared: o (1, T, HV, V). Reference: the fp64 token recurrence up to 4096 tokens,
above it the fp64 sub-chunked form by segments (exact in fp64: tests/test_kda_chunked_model.py
checks it against the recurrence at g down to -5).

Shapes: Kimi Linear per shard (H = HV = 16: fla's KDA has one head count) and grouped value
heads (H 16, HV 32, as `gated_delta_rule`; fla 0.6.0 may refuse them: its record then says
so), B x T from 1 x 2k to 8 x 32k and 1 x 128k, serving-like varlen mixes.

Comparators, each on the same inputs:
  fla     fla-core 0.6.0 `fla.ops.kda.chunk_kda(q, k, v, g, beta, initial_state=,
          output_final_state=True, cu_seqlens=int64)` (Triton; state (N, HV, K, V) as ours;
          scale K^-1/2 as ours), the input sets sharing one cu_seqlens tensor so that fla's
          chunk tables are made once and its pass can be captured (bench/suites/fla_varlen.py).
  cudnn   cuDNN-frontend 1.32's own op, `cudnn.linear_attention.kimi_delta_attention(q, k, v,
          g, beta, cu_seqlens, scale=K^-1/2, initial_state=, output_final_state=True)` (THD:
          our tensors without the batch axis; state (N, HV, V, K) fp32, CUDNN_STATE_LAYOUT
          "vk", made once per input set), its planner's default engine: on sm90 kda_hopper_cuda
          (CUDA C++ through NVRTC; grouped value heads too), else kda_hopper (CuTe DSL, H = HV),
          else kda_cutile. Each case's record names the engine that ran and why the Hopper ones
          declined where they did (`ran`); a refusal is recorded as missing with the sm90
          engines' reasons (bench/suites/cudnn_kda.py). It replaces FlashInfer's
          `flashinfer.cudnn.cudnn_recurrent_kda` (until 2026-12-04), which builds the same cuDNN
          graph through the graph API but could not say which engine served it.

Ours: `forgekernel.ops.kda_chunked.kimi_delta_attention`: the first pass (the chunks'
state-independent operands) on its kernel (`intra.py`), the recurrence on the WGMMA kernel
(kernels/linear_attention/kda_prefill/sm90); its time includes the chunk tables (torch ops on
the device, no host sync). The torch first pass (`operands.py`), ours until 2026-12-02, is no
variant: it ran 3.9-4.7x slower than the kernel on every bench case (H200, 2026-12-02 06:40).
Nor is the first pass's WGMMA kernel of 2026-12-02: its re-laid-out form ("rows8", variant
`rows8` until adopted 2026-12-03) ran the op in 0.455-0.680x of its time on every case (graph;
eager 0.457-0.722x; docs/linear_attention/NOTES.md).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import cudnn_kda, fla_varlen
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import SPEC

HEAD = 128
CHUNK = 64
RECURRENT_UP_TO = 4096  # tokens: above, the fp64 sub-chunked form by segments (speed)
FP64_KEY = "o_fp64"  # the fp64 output from `reference` to `low_precision`
# cuDNN KDA's initial-state layout, one of gdn_prefill.STATE_LAYOUTS (None: initial-state cases
# raise): "vk", (N, HV, V, K) fp32, confirmed by scripts/probe_state_layouts.py on the H200
# 2026-12-03 14:19 through FlashInfer's wrapper, which hands cuDNN's graph the state as given
# ("kv" wrong, o rel 1.30; "vk" o rel 3.1e-3, final state rel 4.3e-3); cuDNN's own op's
# docstring: "initial_state / final_state: [N, HO, V, K]".
CUDNN_STATE_LAYOUT: str | None = "vk"
_ROOT = Path(__file__).resolve().parents[2]
# The two kernels (the first pass, intra.py, and the recurrence), the chunk tables and the
# first pass's torch model (operands.py and the reference it runs: the tests' yardstick).
SOURCES = (
    *SPEC.sources,
    SPEC.directory / "operands.py",
    _ROOT / "reference" / "kda_chunked.py",
    _ROOT / "reference" / "delta_rule.py",
)


def _case(lens, h, hv, *, state=True, strong=False, group="") -> Case:
    lens = tuple(lens)
    shape = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"mix{len(lens)}-t{sum(lens)}"
    name = f"{shape}-h{h}-hv{hv}" + ("" if state else "-nostate") + ("-strong" if strong else "")
    params = {"lens": lens, "h": h, "hv": hv, "state": state, "strong": strong}
    return Case(name, params, group)


def _mix(n: int, total: int) -> tuple[int, ...]:
    """n lengths summing to total: a quarter of the tokens in n - 2 short sequences (odd sizes),
    the rest in two long ones (serving's prefill mixes)."""
    short = max(1, total // 4 // (n - 2))
    lens = [short + (i % 7) * 3 - 9 if short > 12 else short for i in range(n - 2)]
    rest = total - sum(lens)
    return (*lens, rest // 2, rest - rest // 2)


BENCH_CASES = (
    *(_case([t], 16, 16, group="single") for t in (2048, 8192, 32768, 131072)),
    _case([8192] * 4, 16, 16, group="batch"),
    _case([8192] * 4, 16, 16, state=False, group="batch"),
    _case([8192] * 4, 16, 32, group="batch"),
    _case([32768] * 8, 16, 16, group="batch"),
    _case(_mix(16, 16384), 16, 16, group="varlen"),
    _case(_mix(64, 32768), 16, 16, group="varlen"),
    _case(_mix(64, 32768), 16, 32, state=False, group="varlen"),
    # without an initial state, one a group beside the two above (cuDNN's comparator ran
    # only these until its state layout was confirmed, 2026-12-03)
    _case([32768], 16, 16, state=False, group="single"),
    _case([2048] * 16, 16, 16, state=False, group="batch"),
    _case(_mix(16, 16384), 16, 16, state=False, group="varlen"),
)
CHECK_CASES = (
    _case([1, 63, 64, 65, 130], 2, 2),
    _case([257], 4, 8, state=False),
    _case([100, 0, 37], 16, 16),
    _case([300, 301], 16, 32),
    _case([1000, 77], 4, 4, strong=True),
    _case([5000], 2, 2, state=False, strong=True),
)
SANITIZE_CASES = CHECK_CASES[:3]  # the third has an empty sequence


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    total, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    if p["strong"]:
        g = -4.0 - torch.rand(1, total, hv, HEAD, device=device, generator=gen)
    else:
        g = F.logsigmoid(rnd(1, total, hv, HEAD))
    cu = torch.tensor([0, *torch.tensor(p["lens"]).cumsum(0).tolist()], device=device)
    return {
        "q": rnd(1, total, h, HEAD).to(dtype),
        "k": F.normalize(rnd(1, total, h, HEAD), dim=-1).to(dtype),
        "v": rnd(1, total, hv, HEAD).to(dtype),
        "g": g,
        "beta": torch.sigmoid(rnd(1, total, hv)),
        "state": rnd(n, hv, HEAD, HEAD) * 0.1 if p["state"] else None,
        "cu_seqlens": cu.to(torch.int32),
        "cu_seqlens_long": cu,
    }


def alloc_out(inputs: Inputs) -> torch.Tensor:
    return torch.empty_like(inputs["v"])


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.kda_chunked")
    i = inputs
    o, _ = op.kimi_delta_attention(i["q"], i["k"], i["v"], i["g"], i["beta"],
                                   initial_state=i["state"], output_final_state=True,
                                   cu_seqlens=i["cu_seqlens"], out=out)  # fmt: skip
    return o


H200_SMS = 132


def _segments(case: Case) -> int:
    """The segment count of GDN's rule (`gdn_prefill.sm90.launch.segments_for`: N HV <= SMs / 8
    and sequences averaging >= 16384 tokens; then the most segments whose passes fill a wave)."""
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch import segments_for

    lens = case.params["lens"]
    return segments_for(len(lens), case.params["hv"], sum(lens), H200_SMS)


def _pieces(case: Case) -> int:
    """Pieces a sequence for one wave of unsplit recurrence CTAs (SMs // (N HV)), where the
    launcher's recurrence has few CTAs (the V split's 2 N HV <= SMs); else 1."""
    n, hv = len(case.params["lens"]), case.params["hv"]
    return H200_SMS // (n * hv) if 2 * n * hv <= H200_SMS else 1


def _run_segments(parts: int, kind: str = "segments"):
    """Ours through the launcher with the recurrence over `parts` segments a sequence (opt-in,
    `launch.kda_prefill(segments=)`: three recurrence passes and a scan, the first pass once),
    or (kind "pieces") over `parts` pieces after warm-up chunks, one pass (`pieces=`)."""

    def run(inputs: Inputs, out):
        launch = importlib.import_module(
            "forgekernel.kernels.linear_attention.kda_prefill.sm90.launch"
        )
        i = inputs
        n, hv = len(i["cu_seqlens"]) - 1, i["v"].shape[2]
        final = torch.empty(n, hv, HEAD, HEAD, dtype=torch.float32, device=i["v"].device)
        launch.kda_prefill(i["q"][0], i["k"][0], i["v"][0], i["g"][0], i["beta"][0], i["state"],
                           i["cu_seqlens"], out[0], final, HEAD**-0.5, l2norm=False,
                           **{kind: parts})  # fmt: skip
        return out

    return run


def variants(case: Case) -> dict[str, Any]:
    """Few long sequences (1 x 32768, 1 x 131072 at hv16): the recurrence over exact segments
    (`segments_<P>`); few sequences (N HV <= SMs / 2: the singles, 4 x 8192 hv16): pieces after
    warm-up chunks (`pieces_<P>`, cuDNN's sequence parallelism). Ours is the direct launch
    (docs/linear_attention/NOTES.md, "cuDNN's kda_hopper_cuda forward, read against ours")."""
    out: dict[str, Any] = {}
    parts = _segments(case)
    if parts > 1:
        out[f"segments_{parts}"] = _run_segments(parts)
    parts = _pieces(case)
    if parts > 1:
        out[f"pieces_{parts}"] = _run_segments(parts, "pieces")
    return out


def _reference(inputs: Inputs) -> torch.Tensor:
    """The fp64 output."""
    from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent
    from forgekernel.reference.kda_chunked import kimi_delta_attention_segmented

    i = inputs
    args = (i["q"], i["k"], i["v"], i["g"], i["beta"])
    kw = {"initial_state": i["state"], "cu_seqlens": i["cu_seqlens_long"], "dtype": torch.float64}
    if i["q"].shape[1] > RECURRENT_UP_TO:
        o, _ = kimi_delta_attention_segmented(*args, segment=4096, **kw)
    else:
        o, _ = kimi_delta_attention_recurrent(*args, **kw)
    return o


def reference(inputs: Inputs) -> torch.Tensor:
    """The fp64 output in fp32; the fp64 kept in the inputs for `low_precision`, which takes
    it (`check.expected` asks for both: one fp64 pass, not two)."""
    o = inputs[FP64_KEY] = _reference(inputs)
    return o.float()


def low_precision(inputs: Inputs) -> torch.Tensor:
    """The fp64 result rounded to the output dtype: the yardstick is the rounding."""
    o = inputs.pop(FP64_KEY, None)
    return (_reference(inputs) if o is None else o).to(inputs["q"].dtype)


def _fla():
    try:
        from fla.ops.kda import chunk_kda
    except Exception:  # not installed, or its Triton import fails
        return None

    def run(inputs: Inputs):
        i = inputs
        cu = fla_varlen.shared_offsets(i)
        o, _ = fla_varlen.call(chunk_kda, cu, i["q"], i["k"], i["v"], i["g"], i["beta"],
                               initial_state=i["state"], output_final_state=True,
                               cu_seqlens=cu)  # fmt: skip
        return o

    return run


def _cudnn():
    """cuDNN-frontend's own KDA forward (bench/suites/cudnn_kda.py): the planner's default
    engine, named in each case's record; our state in CUDNN_STATE_LAYOUT."""
    return cudnn_kda.runner("fprop", lambda: CUDNN_STATE_LAYOUT)


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fla": None, "cudnn": None}
    return {"fla": _fla(), "cudnn": _cudnn()}


def flops(case: Case) -> float:
    """The chunked algorithm's multiply-adds per token and value head (K = V = 128, chunk C),
    as GDN's (the per-channel decays change the operands, not the products)."""
    p = case.params
    per_token = 6.0 * HEAD * HEAD + 2.0 * CHUNK * (3 * HEAD + 2 * HEAD)
    return per_token * sum(p["lens"]) * p["hv"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q, k, v read and o written (16-bit), g (fp32, per channel) and beta, the states."""
    p = case.params
    t, h, hv, n = sum(p["lens"]), p["h"], p["hv"], len(p["lens"])
    tokens = t * (2 * h * HEAD + 2 * hv * HEAD) * dtype.itemsize + t * hv * (4 * HEAD + 4)
    return tokens + (2 if p["state"] else 1) * n * hv * HEAD * HEAD * 4.0


def suite() -> OpSuite:
    return OpSuite(
        name="kda_prefill",
        kernel_sources=SOURCES,
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
