"""`forgekernel check`: every check case of every suite against the fp32 reference.

Criterion per output tensor (FlashAttention's): max|ours - ref| <= 2 * max|torch_lowprec - ref|
+ atol, no NaN/inf in ours where the reference is finite (outputs are NaN-poisoned first, so an
unwritten element fails), and the reference's own non-finite values reproduced. A case the
suite marks repeatable (the backward's deterministic mode) also runs `REPEATS` times and must
give the same bits each time.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench import ledger
from forgekernel.bench.report import dtype_name, format_table
from forgekernel.bench.suite import Case, Inputs, OpSuite, Runner
from forgekernel.runtime.arch import resolve_arch

REPEATS = 3


@dataclass
class Comparison:
    ok: bool
    err: float
    lowprec_err: float
    rel_err: float
    bound: float
    message: str = ""


def as_tuple(x: Any) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def poison(out: Any) -> Any:
    """Fill every floating output with NaN (integer outputs with their type's minimum) so that
    an element the kernel skips is caught."""
    for t in as_tuple(out):
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            t.fill_(float("nan"))
        elif isinstance(t, torch.Tensor) and t.dtype in INT_POISON:
            t.fill_(INT_POISON[t.dtype])
    return out


INT_POISON = {d: torch.iinfo(d).min for d in (torch.int32, torch.int64)}


def unwritten(t: torch.Tensor) -> int:
    """Elements of an output still holding the poison."""
    if t.is_floating_point():
        return int(torch.isnan(t).sum())
    return int((t == INT_POISON[t.dtype]).sum()) if t.dtype in INT_POISON else 0


def _masked_max(x: torch.Tensor, mask: torch.Tensor) -> float:
    return float(torch.where(mask, x, 0).max()) if x.numel() else 0.0


def compare(
    ours: torch.Tensor, ref: torch.Tensor, low: torch.Tensor, *, atol: float, factor: float = 2.0
) -> Comparison:
    """ours vs the fp32 reference, with torch's low-precision error as the yardstick."""
    if ours.shape != ref.shape:
        return Comparison(
            False,
            float("inf"),
            0.0,
            float("inf"),
            0.0,
            f"shape {tuple(ours.shape)}, expected {tuple(ref.shape)}",
        )
    o, r, lp = ours.float(), ref.float(), low.float()
    finite = torch.isfinite(r)
    both = finite & torch.isfinite(o)
    err = _masked_max((o - r).abs(), both)
    lowprec_err = _masked_max((lp - r).abs(), finite & torch.isfinite(lp))
    diff = torch.where(both, o - r, 0)
    rel = float(diff.norm() / torch.where(finite, r, 0).norm().clamp_min(1e-30))
    bound = factor * lowprec_err + atol
    problems = []
    if err > bound:
        problems.append(f"error {err:.3g} > {factor:g} x {lowprec_err:.3g} + {atol:g}")
    n_nan = int((torch.isnan(o) & finite).sum())
    if n_nan:
        problems.append(f"{n_nan} NaN where the reference is finite (unwritten?)")
    n_inf = int((torch.isinf(o) & finite).sum())
    if n_inf:
        problems.append(f"{n_inf} inf where the reference is finite")
    nonfinite = ~finite
    n_miss = int((nonfinite & ~((o == r) | (torch.isnan(o) & torch.isnan(r)))).sum())
    if n_miss:
        problems.append(f"{n_miss} of the reference's non-finite values not reproduced")
    return Comparison(not problems, err, lowprec_err, rel, bound, "; ".join(problems))


@contextlib.contextmanager
def true_fp32() -> Iterator[None]:
    """The fp32 reference must not silently run in TF32."""
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def expected(suite: OpSuite, inputs: Inputs) -> tuple[tuple, tuple]:
    """(fp32 reference outputs, the same math in the input dtype) for `inputs`; nothing for a
    suite with a judge (it holds its own yardstick)."""
    if suite.judge is not None:
        return (), ()
    with true_fp32():
        refs = as_tuple(suite.reference(inputs))
    return refs, as_tuple(suite.low_precision(inputs))


def verify(
    suite: OpSuite,
    inputs: Inputs,
    device: torch.device,
    *,
    factor: float = 2.0,
    run: Runner | None = None,
    expect: tuple[tuple, tuple] | None = None,
) -> tuple[Any, list[Comparison]]:
    """Run ours (or `run`, a variant of ours) into a poisoned `out` and compare each output with
    `expect` (default: computed here); returns (out, comparisons)."""
    out = poison(suite.alloc_out(inputs))
    returned = (run or suite.run_ours)(inputs, out)
    sync(device)
    outs = as_tuple(out)
    if returned is not None:
        ptrs = [t.data_ptr() for t in as_tuple(returned)]
        if ptrs != [t.data_ptr() for t in outs]:
            return out, [
                Comparison(
                    False,
                    float("inf"),
                    0.0,
                    float("inf"),
                    0.0,
                    "run_ours returned tensors other than `out`",
                )
            ]
    if suite.judge is not None:
        return out, [Comparison(**v) for v in suite.judge(inputs, outs)]
    refs, lows = expect or expected(suite, inputs)
    if not len(outs) == len(refs) == len(lows):
        msg = f"{len(outs)} outputs, reference has {len(refs)}, low precision {len(lows)}"
        return out, [Comparison(False, float("inf"), 0.0, float("inf"), 0.0, msg)]
    cmps = [compare(o, r, lp, atol=suite.atol, factor=factor) for o, r, lp in zip(outs, refs, lows)]
    return out, cmps


def free(device: torch.device) -> None:
    if device.type == "cuda":
        with contextlib.suppress(Exception):
            torch.cuda.synchronize(device)
            torch.cuda.empty_cache()


def _bits(t: torch.Tensor) -> torch.Tensor:
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
    return t.contiguous().view(ints[t.element_size()])


def repeat_differences(
    suite: OpSuite, inputs: Inputs, first: Any, device: torch.device, runs: int = REPEATS
) -> list[str]:
    """Run ours `runs - 1` more times; one message per output whose bits differ from `first`."""
    problems = []
    for run in range(2, runs + 1):
        again = poison(suite.alloc_out(inputs))
        suite.run_ours(inputs, again)
        sync(device)
        for i, (a, b) in enumerate(zip(as_tuple(first), as_tuple(again))):
            differ = int((_bits(a) != _bits(b)).sum())
            if differ:
                problems.append(f"run {run}: out{i} differs from run 1 in {differ} elements")
    return problems


def _check_once(
    suite: OpSuite, case: Case, dtype: torch.dtype, device: torch.device, seed: int
) -> tuple[list[Comparison], list[str] | None]:
    """The comparisons, and for a repeatable case the bitwise differences between runs."""
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = suite.make_inputs(case, dtype, device, gen)
    out, cmps = verify(suite, inputs, device)
    if not suite.is_repeatable(case):
        return cmps, None
    return cmps, repeat_differences(suite, inputs, out, device)


def check_case(
    suite: OpSuite, case: Case, dtype: torch.dtype, device: torch.device, seed: int
) -> dict[str, Any]:
    """One case and dtype; never raises (an exception is a FAIL carrying its message)."""
    rec: dict[str, Any] = {
        "case": case.name,
        "params": case.params,
        "dtype": dtype_name(dtype),
        "seed": seed,
        "passed": False,
        "outputs": [],
        "message": "",
    }
    try:
        cmps, differences = _check_once(suite, case, dtype, device, seed)
        rec["outputs"] = [asdict(c) for c in cmps]
        messages = [f"out{i}: {c.message}" for i, c in enumerate(cmps) if c.message]
        rec["passed"] = all(c.ok for c in cmps)
        if differences is not None:
            rec["repeat"] = {"runs": REPEATS, "bitwise_identical": not differences}
            rec["passed"] &= not differences
            messages += [f"not repeatable: {d}" for d in differences]
        rec["message"] = "; ".join(messages)
    except Exception as e:
        rec["message"] = f"{type(e).__name__}: {e}"[:500]
    free(device)
    return rec


def _rows(records: list[dict[str, Any]]) -> list[list[str]]:
    rows = []
    for rec in records:
        verdict = "PASS" if rec["passed"] else "FAIL"
        outs = rec["outputs"] or [None]
        for i, c in enumerate(outs):
            name = rec["case"] + (f"[{i}]" if len(outs) > 1 else "")
            figs = ["-"] * 3 if c is None else [f"{c[k]:.3g}" for k in _FIGS]
            rows.append([name, rec["dtype"], *figs, verdict, _note(rec) if i == 0 else ""])
    return rows


_FIGS = ("err", "lowprec_err", "rel_err")


def _note(rec: dict[str, Any]) -> str:
    if rec["message"] or not rec.get("repeat"):
        return rec["message"]
    return f"bitwise identical over {rec['repeat']['runs']} runs"


def run_check(
    suites: Iterable[OpSuite],
    *,
    seed: int | None = None,
    results_dir: Path | None = None,
    arch: str | None = None,
    device: str | torch.device = "cuda",
) -> bool:
    """Check every suite, print a table per suite, record its ledger; True when all passed.

    `arch` names the ledger (default: resolve_arch(), the CUDA device's).
    """
    device = torch.device(device)
    arch = arch or resolve_arch()
    base = seed if seed is not None else time.time_ns() % 2**31
    print(f"seed {base} (rerun with --seed {base})")
    all_ok = True
    for suite in suites:
        jobs = [(c, d) for c in suite.check_cases for d in suite.dtypes]
        records = []
        for i, (case, dtype) in enumerate(jobs):
            t0 = time.perf_counter()
            rec = check_case(suite, case, dtype, device, base + i)
            verdict = "PASS" if rec["passed"] else "FAIL"
            took = time.perf_counter() - t0
            where = f"[{i + 1}/{len(jobs)}] {suite.name} {case.name} {rec['dtype']}"
            print(f"{where}: {verdict} ({took:.1f} s)", flush=True)
            records.append(rec)
        passed = bool(records) and all(r["passed"] for r in records)
        all_ok &= passed
        headers = ["case", "dtype", "our err", "torch err", "rel err", "result", "message"]
        print(f"\n{suite.name}: {'PASS' if passed else 'FAIL'}")
        print(format_table(headers, _rows(records)))
        data = {"passed": passed, "seed": base, "cases": records}
        path = ledger.write_section(suite, "check", data, arch=arch, results_dir=results_dir)
        print(f"ledger: {path}")
    return all_ok
