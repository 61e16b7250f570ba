"""FlashInfer-Bench operator definitions: load one, build inputs that satisfy it, run its own
reference and ForgeKernel's, and compare the two.

A definition (JSON) names its axes (const with a value, or var), its inputs and outputs (shape
as a list of axis names, dtype), constraints (python expressions over axes and inputs) and a
`reference`: PyTorch source defining `run(**inputs)`. That source is a specification: it is
executed here in a fresh namespace to compare against, never copied into ForgeKernel.

The definitions live outside the repository: $FORGEKERNEL_FLASHINFER_DEFS, else
../shared/external/flashinfer-bench beside the repository root. When absent, `missing()` says
so and loading raises FileNotFoundError; importing this module never fails.

Paged GQA definitions (decode and causal prefill): q bf16, caches (num_pages, page_size, Hkv,
D), FlashInfer's CSR page lists (kv_indptr, kv_indices, kv_last_page_len; no last_page_len
when page_size is 1), prefill queries packed by qo_indptr; outputs `output` bf16 and `lse`
base 2, (batch, Hq) for decode and (total_q, Hq) for prefill.

Ragged GQA causal prefill: q (total_q, Hq, D), k / v (total_kv, Hkv, D) bf16 packed by int32
qo_indptr / kv_indptr (sequence b: q rows qo_indptr[b]:qo_indptr[b + 1] against kv rows
kv_indptr[b]:kv_indptr[b + 1], causal mask bottom-right aligned); outputs `output` bf16 and
`lse` base 2 (total_q, Hq). GEMM: C = A @ B.T with A (M, K), B (N, K) fp16, C fp16.

`run_kernel` runs ForgeKernel's op on a definition's inputs as they are, chosen by the
definition's `op_type` (mla_paged, dsa_paged and gdn through the ops' own `*_flashinfer`
adapters, `OWN_ADAPTERS`); `NOT_SERVED` names the definitions no op serves yet and what each
needs.
"""

from __future__ import annotations

import importlib
import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from forgekernel.reference.flashinfer_paged import csr_to_page_table, lse_to_base2
from forgekernel.reference.paged_attention import paged_attention_ref

DEFS_ENV = "FORGEKERNEL_FLASHINFER_DEFS"
REPO_ROOT = Path(__file__).resolve().parents[2]
DEFAULT_DIR = REPO_ROOT.parent / "shared" / "external" / "flashinfer-bench"

# What issue 18 names; the dataset (commit ecafa9c2) has neither kv4 page-size-64 definition.
PAGED_GQA_DECODE = tuple(
    f"gqa_paged_decode_h32_kv{kv}_d128_ps{ps}" for kv in (4, 8) for ps in (1, 64)
)
PAGED_GQA_PREFILL = tuple(
    f"gqa_paged_prefill_causal_h32_kv{kv}_d128_ps{ps}" for kv in (4, 8) for ps in (1, 64)
)
RAGGED_GQA_PREFILL = ("gqa_ragged_prefill_causal_h32_kv8_d128",)
GEMM = ("gemm_n4096_k4096",)
# Definitions (commit ecafa9c2) that no ForgeKernel op serves yet: what each would need.
NOT_SERVED = {
    "moe_fp8_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048": "a fused MoE: DeepSeek-V3 "
    "routing (sigmoid + bias, top-4 of 8 groups, top-8, routed_scaling_factor, 32 local experts "
    "from local_expert_offset), grouped FP8 GEMMs with 128x128 weight scales and (K/128, T) "
    "activation scales, silu(second half) * first half, weighted sum to bf16",
    "moe_fp4_block_scale_ds_routing_topk8_ng8_kg4_e32_h7168_i2048__unmerged_c17d020b": "NVFP4 "
    "grouped GEMMs (e2m1 packed in uint8, e4m3 scale per 16, fp32 global scales, weights "
    "shuffled for TRT-LLM) and DeepSeek-V3 routing; draft: its reference returns zeros",
    "moe_fp4_block_scale_pre_routed_topk8_ng8_kg4_e32_h7168_i2048__unmerged_78cb6193": "NVFP4 "
    "grouped GEMMs (e2m1 in uint8, e4m3 scale per 16, per-expert output scales) routed by int32 "
    "topk_ids (expert << 16 | bf16 weight bits), silu(first half) * second half",
    "trtllm_fp4_block_scale_moe_topk8_e128_h2048_i768": "a bf16 MoE: top-8 of 128 bf16 logits "
    "then softmax (Renormalize), fp32 weights (MxFP4 in the kernel: its own quantization), "
    "grouped GEMMs, silu(second half) * first half; tagged gpu:sm100",
    "trtllm_fp4_block_scale_routed_moe_topk8_e128_h2048_i768": "the same bf16 MoE routed by "
    "int32 topk_ids (expert << 16 | bf16 weight bits) instead of logits",
}
# The ops' own FlashInfer-Bench adapters (keyword names the definitions', so `(**inputs)` works)
# by the definition name's prefix: (module under forgekernel.ops, function).
OWN_ADAPTERS = {
    "mla_paged_decode_": ("mla", "mla_paged_decode_flashinfer"),
    "mla_paged_prefill_": ("mla", "mla_paged_prefill_flashinfer"),
    "dsa_sparse_attention_": ("dsa", "dsa_sparse_attention_flashinfer"),
    "dsa_topk_indexer_": ("dsa_indexer", "dsa_topk_indexer_flashinfer"),
    "gdn_decode_": ("gated_delta_rule", "gdn_decode_flashinfer"),
    "gdn_mtp_": ("gated_delta_rule", "gdn_mtp_flashinfer"),
    "gdn_prefill_": ("gated_delta_rule_chunked", "gdn_prefill_flashinfer"),
}
DTYPES = {
    name: getattr(torch, name) for name in ("bfloat16", "float16", "float32", "int32", "int64")
}


def definitions_dir() -> Path:
    return Path(os.environ.get(DEFS_ENV) or DEFAULT_DIR)


def missing(name: str | None = None) -> str | None:
    """Why the directory (or definition `name` in it) cannot be loaded; None when it can."""
    directory = definitions_dir()
    if not directory.is_dir():
        return f"no FlashInfer-Bench definitions at {directory} (set {DEFS_ENV})"
    if name is not None and not (directory / f"{name}.json").is_file():
        return f"{name}.json is not in {directory}"
    return None


@dataclass(frozen=True)
class Definition:
    name: str
    axes: dict[str, dict[str, Any]]
    inputs: dict[str, dict[str, Any]]
    outputs: dict[str, dict[str, Any]]
    constraints: tuple[str, ...]
    reference: str
    tags: tuple[str, ...]
    op_type: str = ""

    def const(self, axis: str) -> int:
        spec = self.axes[axis]
        if spec["type"] != "const":
            raise ValueError(f"{self.name}: axis {axis} is {spec['type']}, not const")
        return int(spec["value"])

    @property
    def stage(self) -> str:
        """'decode' or 'prefill', from the definition's `stage:` tag."""
        return next((t.split(":", 1)[1] for t in self.tags if t.startswith("stage:")), "")


def load_definition(name: str, directory: Path | None = None) -> Definition:
    path = (directory or definitions_dir()) / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"{path} (definitions directory: ${DEFS_ENV})")
    raw = json.loads(path.read_text())
    return Definition(
        name=raw["name"],
        axes=raw["axes"],
        inputs=raw["inputs"],
        outputs=raw["outputs"],
        constraints=tuple(raw.get("constraints", ())),
        reference=raw["reference"],
        tags=tuple(raw.get("tags", ())),
        op_type=raw.get("op_type", ""),
    )


def reference_function(defn: Definition) -> Callable[..., Any]:
    """The definition's own `run`, executed from its source in a fresh namespace."""
    namespace: dict[str, Any] = {"__name__": f"flashinfer_bench.{defn.name}"}
    exec(compile(defn.reference, f"<{defn.name}.reference>", "exec"), namespace)
    return namespace["run"]


def run_definition(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """Outputs of the definition's reference, in the order of its `outputs`."""
    result = reference_function(defn)(**{name: inputs[name] for name in defn.inputs})
    return tuple(result) if isinstance(result, (tuple, list)) else (result,)


def axis_values(defn: Definition, inputs: dict[str, Any]) -> dict[str, int]:
    """Every axis that some input's shape names, read from the tensors; ValueError where two
    shapes disagree or a const axis has another size."""
    values = {a: int(s["value"]) for a, s in defn.axes.items() if s["type"] == "const"}
    for name, spec in defn.inputs.items():
        if spec.get("shape") is None:
            continue
        shape = tuple(inputs[name].shape)
        if len(shape) != len(spec["shape"]):
            raise ValueError(f"{defn.name}: {name} has shape {shape}, expected {spec['shape']}")
        for axis, size in zip(spec["shape"], shape):
            if values.setdefault(axis, size) != size:
                raise ValueError(f"{defn.name}: {name} axis {axis} is {size}, not {values[axis]}")
    return values


def check_inputs(defn: Definition, inputs: dict[str, Any]) -> dict[str, int]:
    """The axis values, after checking dtypes, shapes and the definition's constraints."""
    for name, spec in defn.inputs.items():
        if spec.get("shape") is not None and inputs[name].dtype != DTYPES[spec["dtype"]]:
            raise TypeError(f"{defn.name}: {name} is {inputs[name].dtype}, not {spec['dtype']}")
    values = axis_values(defn, inputs)
    scope = {**values, **inputs}
    for rule in defn.constraints:
        if not eval(rule, {"torch": torch}, scope):  # the definition's own expression
            raise ValueError(f"{defn.name}: constraint {rule!r} does not hold")
    return values


def paged_gqa_inputs(
    defn: Definition,
    seqlens_k: Sequence[int],
    seqlens_q: Sequence[int] | None = None,
    *,
    spare_pages: int = 3,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Random inputs of a paged GQA definition: sequence b holds seqlens_k[b] tokens (0 is an
    empty sequence) on distinct random pages of a cache with `spare_pages` unused pages;
    prefill packs seqlens_q[b] queries per sequence (default: one each)."""
    hq, hkv, d, ps = (
        defn.const(a) for a in ("num_qo_heads", "num_kv_heads", "head_dim", "page_size")
    )
    counts = torch.tensor([-(-s // ps) for s in seqlens_k], dtype=torch.long)
    num_pages = int(counts.sum()) + spare_pages
    rand = {"generator": generator}
    last = torch.tensor([s - (n - 1) * ps if n else 0 for s, n in zip(seqlens_k, counts.tolist())])
    inputs: dict[str, Any] = {
        "k_cache": torch.randn(num_pages, ps, hkv, d, **rand).bfloat16(),
        "v_cache": torch.randn(num_pages, ps, hkv, d, **rand).bfloat16(),
        "kv_indptr": _indptr(counts),
        "kv_indices": torch.randperm(num_pages, **rand)[: int(counts.sum())].int(),
        "kv_last_page_len": last.int(),
        "sm_scale": 1.0 / math.sqrt(d),
    }
    if defn.stage == "prefill":
        q_lens = torch.tensor(seqlens_q if seqlens_q is not None else [1] * len(seqlens_k))
        inputs["qo_indptr"] = _indptr(q_lens)
        rows = int(q_lens.sum())
    else:
        rows = len(seqlens_k)
    inputs["q"] = torch.randn(rows, hq, d, **rand).bfloat16()
    inputs = {name: inputs[name] for name in defn.inputs}
    check_inputs(defn, inputs)
    return inputs


def ragged_gqa_inputs(
    defn: Definition,
    seqlens_q: Sequence[int],
    seqlens_k: Sequence[int],
    *,
    generator: torch.Generator | None = None,
) -> dict[str, Any]:
    """Random inputs of a ragged GQA definition: sequence b packs seqlens_q[b] queries against
    seqlens_k[b] keys (either may be 0; more queries than keys leaves the first rows of that
    sequence without a visible key under the causal mask)."""
    if len(seqlens_q) != len(seqlens_k):
        raise ValueError(f"{len(seqlens_q)} query lengths but {len(seqlens_k)} key lengths")
    hq, hkv, d = (defn.const(a) for a in ("num_qo_heads", "num_kv_heads", "head_dim"))
    total_q, total_kv = sum(seqlens_q), sum(seqlens_k)
    rand = {"generator": generator}
    inputs: dict[str, Any] = {
        "q": torch.randn(total_q, hq, d, **rand).bfloat16(),
        "k": torch.randn(total_kv, hkv, d, **rand).bfloat16(),
        "v": torch.randn(total_kv, hkv, d, **rand).bfloat16(),
        "qo_indptr": _indptr(torch.tensor(list(seqlens_q), dtype=torch.long)),
        "kv_indptr": _indptr(torch.tensor(list(seqlens_k), dtype=torch.long)),
        "sm_scale": 1.0 / math.sqrt(d),
    }
    inputs = {name: inputs[name] for name in defn.inputs}
    check_inputs(defn, inputs)
    return inputs


def gemm_inputs(
    defn: Definition, m: int, *, generator: torch.Generator | None = None
) -> dict[str, Any]:
    """Random A (M, K) and B (N, K) of a gemm definition, in its dtypes."""
    n, k = defn.const("N"), defn.const("K")
    rows = {"A": m, "B": n}
    inputs = {
        name: torch.randn(rows[name], k, generator=generator).to(DTYPES[spec["dtype"]])
        for name, spec in defn.inputs.items()
    }
    check_inputs(defn, inputs)
    return inputs


def _indptr(lengths: torch.Tensor) -> torch.Tensor:
    return torch.cat([lengths.new_zeros(1), lengths.cumsum(0)]).int()


def run_ours(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """ForgeKernel's reference on a paged GQA definition's inputs: (output fp32, lse base 2 in
    the definition's layout)."""
    table, seqlens = csr_to_page_table(
        inputs["kv_indptr"],
        inputs["kv_indices"],
        inputs.get("kv_last_page_len"),
        defn.const("page_size"),
    )
    out, lse = paged_attention_ref(
        inputs["q"],
        inputs["k_cache"],
        inputs["v_cache"],
        table,
        seqlens,
        cu_seqlens_q=inputs.get("qo_indptr"),
        causal=True,
        softmax_scale=float(inputs["sm_scale"]),
    )
    return out, _their_lse(defn, lse)


def _their_lse(defn: Definition, lse: torch.Tensor) -> torch.Tensor:
    """Our natural-log LSE ((B, Hq) decode, (Hq, total_q) prefill) in a definition's form:
    base 2, (total_q, Hq) for prefill."""
    lse = lse_to_base2(lse)
    return lse.transpose(0, 1) if defn.stage == "prefill" else lse


def benchmark_failures(
    ours: torch.Tensor, theirs: torch.Tensor, atol: float = 1e-2, rtol: float = 1e-2
) -> int:
    """Elements FlashInfer-Bench fails (README of the definitions): |ours - theirs| > atol and
    |ours - theirs| / (|theirs| + 1e-8) > rtol; equal infinities pass."""
    ours, theirs = ours.float(), theirs.float()
    same_inf = torch.isinf(ours) & torch.isinf(theirs) & (ours == theirs)
    diff = torch.where(same_inf, 0.0, (ours - theirs).abs())
    return int(((diff > atol) & (diff / (theirs.abs() + 1e-8) > rtol)).sum())


def compare_paged_gqa(defn: Definition, inputs: dict[str, Any]) -> dict[str, float]:
    """Ours against the definition's reference on the same inputs.

    out_err / lse_err: max |ours - theirs| over the rows where theirs is finite (equal -inf
    LSEs count as 0); out_rounding: max |ours - theirs| / (2^-8 |theirs| + 1e-6) there, at most
    about 1 when theirs is ours rounded to bf16 (half an ulp is at most 2^-8 of the value);
    nan_rows: rows (query x head) whose output theirs leaves NaN (their prefill softmax over a
    fully masked row); nan_rows_ours_max: our largest |output| there (our convention: 0)."""
    theirs_out, theirs_lse = run_definition(defn, inputs)
    ours_out, ours_lse = run_ours(defn, inputs)
    nan = theirs_out.isnan().any(-1)
    err = (ours_out - theirs_out.float()).abs()[~nan]
    bound = theirs_out.float().abs()[~nan] * 2.0**-8 + 1e-6
    both_inf = torch.isneginf(ours_lse) & torch.isneginf(theirs_lse)
    lse_diff = torch.where(both_inf, 0.0, (ours_lse - theirs_lse).abs())
    return {
        "out_err": float(err.max()) if err.numel() else 0.0,
        "out_rounding": float((err / bound).max()) if err.numel() else 0.0,
        "lse_err": float(lse_diff.max()) if lse_diff.numel() else 0.0,
        "nan_rows": int(nan.sum()),
        "nan_rows_ours_max": float(ours_out[nan].abs().max()) if nan.any() else 0.0,
    }


def run_kernel(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """ForgeKernel's op on a definition's inputs as they are, chosen by its op_type: the
    outputs in the order, layouts and dtypes of the definition's `outputs` (LSE base 2).
    NotImplementedError for an op_type (or, for mla_paged / dsa_paged / gdn, a definition name)
    this module has no adapter for."""
    adapter = KERNEL_ADAPTERS.get(defn.op_type)
    if adapter is None:
        raise NotImplementedError(
            f"{defn.name}: run_kernel has no adapter for op_type {defn.op_type!r} "
            f"(it has {sorted(KERNEL_ADAPTERS)})"
        )
    return adapter(defn, inputs)


def _run_paged_gqa(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """gqa_paged: ForgeKernel's paged attention on FlashInfer's CSR page lists (qo_indptr for
    prefill). Decode runs the paged decode kernel; prefill up to 4 query tokens per sequence
    its speculative form, longer ones the gather + varlen forward path."""
    from forgekernel.ops.attention_paged import attention_paged_csr

    counts = inputs["kv_indptr"][1:] - inputs["kv_indptr"][:-1]
    varlen = {}
    if defn.stage == "prefill":
        q_counts = inputs["qo_indptr"][1:] - inputs["qo_indptr"][:-1]
        varlen = {
            "cu_seqlens_q": inputs["qo_indptr"].int(),
            "max_seqlen_q": max(1, int(q_counts.max())),
        }
    out, lse = attention_paged_csr(
        inputs["q"], inputs["k_cache"], inputs["v_cache"], inputs["kv_indptr"],
        inputs["kv_indices"], inputs.get("kv_last_page_len"),
        max_pages=max(1, int(counts.max())), softmax_scale=float(inputs["sm_scale"]),
        return_lse=True, **varlen,
    )  # fmt: skip
    return out, _their_lse(defn, lse)


def _run_ragged_gqa(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """gqa_ragged: `attention_varlen` with qo_indptr / kv_indptr as cu_seqlens_q / _k, causal
    (both bottom-right aligned); the longest sequences, which the op takes as host ints, are
    read from the offsets (a device sync when they are on the GPU)."""
    from forgekernel.ops.attention_varlen import attention_varlen

    qo, kv = inputs["qo_indptr"], inputs["kv_indptr"]
    out, lse = attention_varlen(
        inputs["q"], inputs["k"], inputs["v"], qo, kv,
        max_seqlen_q=_longest(qo), max_seqlen_k=_longest(kv), causal=True,
        softmax_scale=float(inputs["sm_scale"]), return_lse=True,
    )  # fmt: skip
    return out, _their_lse(defn, lse)


def _longest(indptr: torch.Tensor) -> int:
    return int((indptr[1:] - indptr[:-1]).max())


def _run_gemm(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor]:
    """gemm: C = A @ B.T is `gemm`'s default form (B given as (N, K))."""
    from forgekernel.ops.gemm import gemm

    return (gemm(inputs["A"], inputs["B"]),)


def _run_own_adapter(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """mla_paged / dsa_paged / gdn: the op's own `*_flashinfer` adapter (OWN_ADAPTERS, by the
    definition's name) on the definition's inputs by keyword, as they are; its outputs are
    already the definition's (order, layouts, dtypes, LSE base 2)."""
    entry = next((v for prefix, v in OWN_ADAPTERS.items() if defn.name.startswith(prefix)), None)
    if entry is None:
        raise NotImplementedError(
            f"{defn.name}: run_kernel has no adapter for this {defn.op_type!r} definition "
            f"(it serves the names starting {sorted(OWN_ADAPTERS)})"
        )
    module, function = entry
    adapter = getattr(importlib.import_module(f"forgekernel.ops.{module}"), function)
    return tuple(adapter(**{name: inputs[name] for name in defn.inputs}))


KERNEL_ADAPTERS: dict[str, Callable[[Definition, dict[str, Any]], tuple[torch.Tensor, ...]]] = {
    "gqa_paged": _run_paged_gqa,
    "gqa_ragged": _run_ragged_gqa,
    "gemm": _run_gemm,
    "mla_paged": _run_own_adapter,
    "dsa_paged": _run_own_adapter,
    "gdn": _run_own_adapter,
}
