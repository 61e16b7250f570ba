"""Localize a fault or a hang of the DSA score recompute on the device, one case per process.

A ladder first (one token, every compiled H, key tiles 1, 2, 3, 10, 11, 17, 33: the ring's
first wrap, the two consumer warpgroups' alternation, a slot count's edge), then the suite's
check cases, each in its own process with CUDA_LAUNCH_BLOCKING=1 under a timeout, so that a
fault or a hang (a pipeline phase wrong) cannot hide the next case. The child builds the
inputs (seed 0), runs the op into a NaN-filled output, synchronizes, and compares it with the
fp32 reference through the harness's `check.compare`.

Per case: PASS, FAIL (the error) or HANG, and the plan (ring slots, CTAs per SM).

    python3 scripts/diag_dsa_recompute.py [--timeout 20] [--only SUBSTR ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

from forgekernel.bench import check
from forgekernel.bench.suites import dsa_recompute as S
from forgekernel.kernels.attention.dsa_recompute.sm90 import config

TILES = (1, 2, 3, 10, 11, 17, 33)


def cases() -> dict:
    ladder = [
        S._case(1, h, 64 * t, topk=64 * t, tag=f"ladder{t}") for h in config.HEADS for t in TILES
    ]
    every = (*ladder, *S.CHECK_CASES)
    named = {c.name: c for c in every}
    assert len(named) == len(every), "two cases share a name"
    return named


def child(name: str) -> None:
    case = cases()[name]
    device = torch.device("cuda")
    inputs = S.make_inputs(case, torch.bfloat16, device, torch.Generator(device).manual_seed(0))
    out = torch.full_like(S.alloc_out(inputs), float("nan"))
    S.run_ours(inputs, out)
    torch.cuda.synchronize()
    verdict = check.compare(out, S.reference(inputs), S.low_precision(inputs), atol=S.suite().atol)
    print(json.dumps({"ok": verdict.ok, "err": verdict.err, "message": verdict.message}))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--timeout", type=float, default=20.0)
    ap.add_argument("--only", nargs="*", default=())
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None)
    args = ap.parse_args()
    if args.child:
        child(args.child)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1")
    results, failed = [], 0
    for name, case in cases().items():
        if args.only and not any(s in name for s in args.only):
            continue
        h = case.params["hq"]
        plan = f"slots {config.ring_slots(h)}, {config.resident(h)} CTA/SM"
        start = time.time()
        try:
            run = subprocess.run([sys.executable, __file__, "--child", name], env=env,
                                 capture_output=True, text=True, timeout=args.timeout)  # fmt: skip
            last = (run.stdout.strip().splitlines() or ["{}"])[-1]
            verdict = json.loads(last) if run.returncode == 0 else {}
            status = "PASS" if verdict.get("ok") else "FAIL"
            detail = verdict.get("message") or run.stderr.strip()[-300:]
        except subprocess.TimeoutExpired:
            status, detail = "HANG", f"> {args.timeout} s"
        failed += status != "PASS"
        secs = time.time() - start
        print(f"{status:4s} {name:40s} {plan:22s} {secs:5.1f} s {detail}", flush=True)
        results.append({"case": name, "status": status, "detail": detail, "plan": plan})
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
