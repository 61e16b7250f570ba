"""Localize a fault of the DSA lightning indexer on the device, one case per process.

Each case of the suite's check, then variants around the first H200 failure
(prefill-q342-k2150-s4-k256: "illegal instruction", a 1-D k_scale TMA box starting at an
unaligned key), runs in its own process with CUDA_LAUNCH_BLOCKING=1 under a timeout, so that a
fault or a hang cannot hide the next case. The child runs the op's two kernels as the op does,
one stage at a time, synchronizing after each:

    inputs  the suite's make_inputs (seed 0)
    logits  the FP8 logits kernel (launch.logits_paged / logits_contiguous) into a NaN-filled
            buffer; then every column of every row's window must be written and finite, and
            the values are compared with the fp64 logits (worst row error / row max)
    topk    the top-k kernel (launch.topk_paged / topk_windows)
    judge   the suite's order-free judge of the ids (what `forgekernel check` runs)
    model   the top-k kernel against its CPU model (emulate.topk_model) on the same logits
    op      the public op (the suite's run_ours) gives the same ids, bit for bit

Per case: PASS, FAIL (the stage and its error) or HANG (the stage it was in), the plan (logits
grid splits x groups and tiles per split, the top-k cluster) and, for prefill, how many rows
start at an unaligned key and how many logits TMA boxes would start unaligned (must be 0).

    python3 scripts/diag_dsa_indexer.py [--timeout 30] [--only SUBSTR ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from forgekernel.bench.suites import dsa_indexer as S
from forgekernel.kernels.attention.dsa_indexer.sm90 import config, launch
from forgekernel.kernels.attention.dsa_indexer.sm90 import emulate as em

FP8 = torch.float8_e4m3fn
LOGITS_TOL = 0.02  # of a row's largest |logit|: past it the logits kernel is wrong, not noisy
VARIANTS = (
    # the failing shape with every sequence's first key a multiple of 4 (aligned boxes)
    S._prefill([5, 0, 37, 300], [8, 4, 36, 2100], topk=256),
    S._prefill([5, 37], [9, 37], topk=256),  # one unaligned start (9)
    S._prefill([4, 4], [13, 64], topk=16),  # the smallest: two row groups, start 13
    S._prefill([342], [2150], topk=256),  # same sizes, one sequence: a tail row group
    S._prefill([5, 0, 37, 300], [9, 4, 37, 2100], causal=False, topk=256),
    S._prefill([7, 9], [4999, 6], causal=False),  # unaligned start 4999, non-causal
    S._prefill([40], [17000]),  # the top-k on a cluster of 2 CTAs (contiguous)
    S._paged([17000] * 40, topk=512),  # the top-k on a cluster of 2 CTAs (paged)
)


def cases() -> dict:
    every = (*S.CHECK_CASES, *VARIANTS)
    named = {c.name: c for c in every}
    assert len(named) == len(every), "two cases share a name"
    return named


# ---------------------------------------------------------------- the child (one case)


def _say(tag: str, value) -> None:
    print(f"@{tag} {json.dumps(value)}", flush=True)


def _plan(p: dict, inputs: dict, sms: int) -> dict:
    if p["mode"] == "paged":
        b, pages = inputs["table"].shape
        splits, per = config.split_plan(b, pages, p["next_n"], sms)
        cluster = config.topk_cluster(b * p["next_n"], pages * config.PAGE, sms)
        return {"logits_grid": [splits, b], "tiles_per_split": per, "qtokens": p["next_n"],
                "topk_cluster": cluster}  # fmt: skip
    rows, keys = inputs["weights"].shape[0], inputs["k"].shape[0]
    groups = -(-rows // config.QTOKENS[-1])
    splits, per = config.split_plan(groups, -(-keys // config.TILE) + 1, config.QTOKENS[-1], sms)
    starts, ends = inputs["starts"].cpu(), inputs["ends"].cpu()
    ctas = em.logits_ctas(starts, ends, launch.logits_width(keys), config.QTOKENS[-1], per, splits)
    boxes = [b for c in ctas for b in c["scale_box"]]
    return {"logits_grid": [splits, groups], "tiles_per_split": per,
            "topk_cluster": config.topk_cluster(rows, keys, sms),
            "rows_with_unaligned_start": int((starts % config.SCALE_ALIGN != 0).sum()),
            "unaligned_scale_boxes": sum(b % config.SCALE_ALIGN != 0 for b in boxes)}  # fmt: skip


def _windows(p: dict, inputs: dict) -> tuple[torch.Tensor, torch.Tensor]:
    if p["mode"] == "prefill":
        return inputs["starts"], inputs["ends"]
    n = p["next_n"]
    rows = inputs["weights"].shape[0]
    r = torch.arange(rows, device=inputs["seq_lens"].device)
    ends = inputs["seq_lens"].repeat_interleave(n) - (n - 1 - r % n)
    return torch.zeros_like(ends), ends.int()


def _run_kernels(p: dict, inputs: dict, stage) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits, ids) through the op's two launches, one stage each."""
    rows = inputs["weights"].shape[0]
    out = torch.full((rows, p["topk"]), -7, dtype=torch.int32, device="cuda")
    q2d = inputs["q"].reshape(rows * config.HEADS, config.HEAD_DIM)
    if p["mode"] == "paged":
        table, lens, n = inputs["table"], inputs["seq_lens"], p["next_n"]
        logits = torch.full((rows, table.shape[1] * config.PAGE), float("nan"), device="cuda")
        with stage("logits"):
            launch.logits_paged(q2d, inputs["weights"], inputs["cache"], table, lens, logits, n)
        with stage("topk"):
            launch.topk_paged(logits, table, lens, n, out)
        return logits, out
    keys = inputs["k"].shape[0]
    logits = torch.full((rows, launch.logits_width(keys)), float("nan"), device="cuda")
    starts, ends = inputs["starts"], inputs["ends"]
    with stage("logits"):
        launch.logits_contiguous(q2d, inputs["weights"], inputs["k"], inputs["k_scale"], starts,
                                 ends, logits)  # fmt: skip
    with stage("topk"):
        launch.topk_windows(logits, starts, ends, keys, out)
    return logits, out


def _check_logits(p: dict, inputs: dict, logits: torch.Tensor) -> float:
    """Worst row's |ours - fp64| / the row's largest |logit| over the rows' windows."""
    ref = S.reference(inputs)  # (rows, keys or positions): the buffer may be wider
    logits = logits[:, : ref.shape[1]]
    starts, ends = _windows(p, inputs)
    cols = torch.arange(logits.shape[1], device=logits.device)
    seen = (cols >= starts[:, None]) & (cols < ends[:, None])
    bad = int((seen & ~logits.isfinite()).sum())
    if bad:
        raise AssertionError(f"{bad} logits of the windows unwritten or not finite")
    diff = torch.where(seen, (logits.double() - ref).abs(), 0.0).amax(1)
    scale = torch.where(seen, ref.abs(), 0.0).amax(1).clamp(min=1e-30)
    err = float((diff / scale).max()) if len(diff) else 0.0
    if err > LOGITS_TOL:
        raise AssertionError(f"logits off by {err:.3g} of a row's max (> {LOGITS_TOL})")
    return err


class _Stages:
    """`with stages("x"):` announces stage x, runs it, synchronizes, records the seconds."""

    def __init__(self):
        self.seconds: dict[str, float] = {}

    def __call__(self, name: str):
        self.name = name
        return self

    def __enter__(self):
        _say("stage", self.name)
        self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if exc[0] is None:
            torch.cuda.synchronize()
            self.seconds[self.name] = round(time.perf_counter() - self.t0, 3)
        return False


def child(name: str) -> int:
    case = cases()[name]
    p = case.params
    stage = _Stages()
    try:
        with stage("inputs"):
            gen = torch.Generator("cuda").manual_seed(0)
            inputs = S.make_inputs(case, FP8, torch.device("cuda"), gen)
        sms = torch.cuda.get_device_properties(0).multi_processor_count
        plan = _plan(p, inputs, sms)
        _say("plan", plan)
        logits, out = _run_kernels(p, inputs, stage)
        with stage("logits-values"):
            logits_err = _check_logits(p, inputs, logits)
        with stage("judge"):
            (verdict,) = S.judge(inputs, (out,))
            if not verdict["ok"]:
                raise AssertionError(verdict["message"])
        with stage("model"):
            starts, ends = (t.cpu() for t in _windows(p, inputs))
            table = inputs["table"].cpu() if p["mode"] == "paged" else None
            want = em.topk_model(logits.cpu(), starts, ends, p["topk"], plan["topk_cluster"],
                                 table, p.get("next_n", 1))  # fmt: skip
            differ = int((out.cpu() != want).sum())
            if differ:
                raise AssertionError(f"the top-k kernel differs from its model in {differ} ids")
        with stage("op"):
            again = torch.full_like(out, -7)
            S.run_ours(inputs, again)
            torch.cuda.synchronize()
            if not torch.equal(again, out):
                raise AssertionError("the op's ids differ from its two launches'")
    except Exception as e:  # noqa: BLE001 - reported, the parent reads it
        _say("error", {"stage": stage.name, "error": f"{type(e).__name__}: {e}"[:400]})
        return 1
    _say("done", {"seconds": stage.seconds, "logits_err": logits_err, "judge_err": verdict["err"]})
    return 0


# ---------------------------------------------------------------- the parent


def _parse(stdout: str) -> dict:
    got: dict = {}
    for line in stdout.splitlines():
        if line.startswith("@"):
            tag, _, value = line[1:].partition(" ")
            got[tag] = json.loads(value)
    return got


def run_case(name: str, timeout: float) -> dict:
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    t0 = time.perf_counter()
    cmd = [sys.executable, __file__, "--child", name]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
        out, err, rc = p.stdout, p.stderr, p.returncode
    except subprocess.TimeoutExpired as e:
        text = e.stdout.decode() if isinstance(e.stdout, bytes) else e.stdout or ""
        got = _parse(text)
        return {"case": name, "result": "HANG", "stage": got.get("stage"), "plan": got.get("plan"),
                "detail": f"no exit within {timeout:g} s"}  # fmt: skip
    got = _parse(out)
    rec = {"case": name, "seconds": round(time.perf_counter() - t0, 1), "plan": got.get("plan")}
    if rc == 0 and "done" in got:
        return {**rec, "result": "PASS", "stage": None, "detail": got["done"]}
    if "error" in got:
        return {**rec, "result": "FAIL", "stage": got["error"]["stage"],
                "detail": got["error"]["error"]}  # fmt: skip
    tail = err.strip().splitlines()[-3:]
    return {**rec, "result": "FAIL", "stage": got.get("stage"),
            "detail": f"exit {rc}: " + " | ".join(tail)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=float, default=30.0, help="seconds per case")
    ap.add_argument("--only", nargs="*", default=[], help="cases whose name holds one of these")
    ap.add_argument("--json", help="write the records here too")
    args = ap.parse_args(argv)
    if args.child:
        return child(args.child)
    names = [n for n in cases() if not args.only or any(s in n for s in args.only)]
    records = []
    for name in names:
        rec = run_case(name, args.timeout)
        records.append(rec)
        where = f" at {rec['stage']}" if rec["result"] != "PASS" else ""
        print(f"{name:42s} {rec['result']}{where}  plan {rec.get('plan')}  {rec['detail']}",
              flush=True)  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump(records, f, indent=1)
    bad = [r["case"] for r in records if r["result"] != "PASS"]
    summary = f"{len(records) - len(bad)} of {len(records)} passed"
    print(f"\n{summary}" + (f"; not: {bad}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
