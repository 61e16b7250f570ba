"""What `check` and `bench` need to know about one operator.

Each operator registers one `OpSuite` in `forgekernel/bench/suites/<op>.py`. The generic
harness (`forgekernel.bench.check`, `forgekernel.bench.harness`) drives it; nothing in the
harness is operator-specific.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

Inputs = dict[str, Any]
Runner = Callable[[Inputs, Any], Any]


@dataclass(frozen=True)
class Case:
    """One problem: a name for tables, a dict of parameters the suite understands, and the
    shape class it samples (e.g. "decode", "prefill", "non-causal", "d256"; the report gives
    each class's median beside the suite's)."""

    name: str
    params: dict[str, Any]
    group: str = ""


@dataclass(frozen=True)
class Explained:
    """A sanitizer finding shown not to be a bug: `tool` reports `count` (None: any count) on
    the sanitize case `case` ("*": every case), and `why` says what orders the accesses the tool
    flags. `kinds` (racecheck): the hazard kinds it covers (e.g. ("WAR",)); a reported hazard of
    another kind is not explained."""

    tool: str
    case: str
    count: int | None
    why: str
    kinds: tuple[str, ...] | None = None


def with_dispatch(sources: Sequence[Path], *modules: str) -> list[Path]:
    """A ledger key's files: `sources` (the kernel's import closure, what the compile cache
    hashes) and the files of the named host modules that choose what runs (configuration
    tables, launcher, op), each once, in order. A dispatch change then moves the key as a
    kernel change does."""
    files = [Path(importlib.import_module(name).__file__) for name in modules]
    return list(dict.fromkeys((*sources, *files)))


@dataclass(frozen=True)
class OpSuite:
    """Everything the harness needs for one operator.

    make_inputs(case, dtype, device, generator) -> Inputs: fresh random inputs (never zeros).
    run_ours(inputs, out) -> Tensor | tuple: our kernel writing into `out` (pre-poisoned with
        NaN by the harness) when `out` is not None; returns the output(s).
    alloc_out(inputs) -> Tensor | tuple: empty output(s) of the right shape / dtype.
    reference(inputs) -> Tensor | tuple: fp32 result (the spec, from forgekernel.reference).
    low_precision(inputs) -> Tensor | tuple: the same math done by PyTorch in the input dtype;
        our error must be <= 2x its error + atol (FlashAttention's criterion).
    comparators: name -> callable(inputs) -> output, or None when unavailable in this process
        (reported as missing, never faked), or a `sidecar.Sidecar`: a comparator timed in a
        process of its own with its own site directory (packages that cannot share ours).
        `available_comparators()` resolves them lazily.
        A comparator may cache per-input-set state in `inputs` on its first call: the bench
        calls every candidate on every input set before it times anything. A comparator that
        picks among several implementations (cuDNN's engines) may carry `ran(inputs) -> str`:
        after its first call on `inputs`, what ran; the bench keeps it in the comparator's
        entry of the case's record ("ran") and the reports list it.
    flops(case) / bytes(case): work counts for TFLOP/s and GB/s.
    kernel_sources: the files whose hash identifies the kernel measured (the ledger key).
    leaf: the kernel folder the README names (relative to the package), where most of
        kernel_sources are another kernel's (a backward keyed on its forward's sources too);
        empty: the folder holding most of them.
    sanitize_cases: a few small, odd-sized cases covering every kernel variant of the operator:
        `forgekernel check --sanitize` runs them under compute-sanitizer, tests/gpu/ against the
        reference. A suite without them fails the sanitize step.
    sanitize_explained: findings shown to be tool artifacts, recorded next to their counts.
    repeatable(case) -> bool: the case promises bitwise-repeatable outputs; `check` runs it
        `check.REPEATS` times and requires identical bits.
    variants(case) -> {name: run(inputs, out)}: other modes of our kernel timed beside it by
        `bench` on that case (for example deterministic=True); recorded as variant time / our
        time, kept apart from the comparator ratios.
    host_comparators: like comparators, timed only for `bench`'s host microseconds per eager
        call on `host_case` (torch's own op, e.g. torch.matmul or SDPA, where `comparators`
        lack it).
    judge(inputs, outs) -> [dict]: for outputs that are not values to compare element by
        element (an order-free top-k selection): one verdict per output, the fields of
        `check.Comparison` (ok, err, lowprec_err, rel_err, bound, message), from the suite's own
        yardstick; `reference` and `low_precision` are then not called by check or bench.
    """

    name: str
    kernel_sources: Sequence[Path]
    dtypes: Sequence[torch.dtype]
    check_cases: Sequence[Case]
    bench_cases: Sequence[Case]
    make_inputs: Callable[[Case, torch.dtype, torch.device, torch.Generator], Inputs]
    alloc_out: Callable[[Inputs], Any]
    run_ours: Callable[[Inputs, Any], Any]
    reference: Callable[[Inputs], Any]
    low_precision: Callable[[Inputs], Any]
    comparators: Callable[[], dict[str, Callable[[Inputs], Any] | None]]
    flops: Callable[[Case], float]
    bytes: Callable[[Case, torch.dtype], float]
    memory_bound: bool = False
    atol: float = 1e-5
    bench_dtypes: Sequence[torch.dtype] = field(default_factory=tuple)
    sanitize_cases: Sequence[Case] = ()
    sanitize_explained: Sequence[Explained] = ()
    repeatable: Callable[[Case], bool] | None = None
    variants: Callable[[Case], dict[str, Runner]] | None = None
    host_case: Case | None = None  # bench's host us per call (None: the fewest-flops bench case)
    host_comparators: Callable[[], dict[str, Callable[[Inputs], Any] | None]] | None = None
    judge: Callable[[Inputs, tuple], list[dict[str, Any]]] | None = None
    leaf: str = ""

    def dtypes_for_bench(self) -> Sequence[torch.dtype]:
        return self.bench_dtypes or self.dtypes

    def is_repeatable(self, case: Case) -> bool:
        return self.repeatable is not None and bool(self.repeatable(case))

    def variants_for(self, case: Case) -> dict[str, Runner]:
        return dict(self.variants(case)) if self.variants is not None else {}
