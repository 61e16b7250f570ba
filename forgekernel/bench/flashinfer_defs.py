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
"""

from __future__ import annotations

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


def run_kernel(defn: Definition, inputs: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """ForgeKernel's paged attention on a gqa_paged definition's inputs as they are
    (FlashInfer's CSR page lists, qo_indptr for prefill): (output, lse base 2) in the
    definition's layouts. Decode runs the paged decode kernel; prefill up to 4 query tokens per
    sequence its speculative form, longer ones the gather + varlen forward path."""
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
