"""A ladder of tiny MLA seesaw-pass cases (forgekernel.mla_decode over 16-bit caches whose page
size is a multiple of 64: seesaw.py's `tma` compiles), each in its own subprocess under a
timeout, so that one device call says which case passes, which fails (its max error against the
fp32 reference of forgekernel.reference.mla) and which hangs:

    python3 scripts/diag_mla_seesaw.py [--timeout 20] [--only NAME ...]

Each line: PASS / FAIL(max err > bound) / HANG (no exit in the timeout) / ERROR (an exception),
the route the launcher took (tma: the seesaw pass; roles: decode.py's) and the split count.
The ladder, smallest first: 1, 2 and 3 tiles; a split (2 splits of 4 tiles); pages of 64 and
128 (the second 64-row box of a page); 16 and 128 heads (two head blocks); 1 and 2 query tokens
(MTP, causal); an empty sequence in the batch (check mla_decode's first case, both dtypes); NaN
in every stale page slot; and one control case on decode.py's pass (FORGEKERNEL_MLA_SCHEDULE=
roles). Criterion (tests/gpu/test_mla_gpu.py's): max |out - ref| <= 2 x the same math in the
input dtype + 1e-3, the LSE within 1e-3 and -inf exactly where the reference's is. The kernels
should be built first (`python3 -m forgekernel build --only mla_decode_sm90`): a JIT compile
inside a case can take longer than its timeout (then raise --timeout)."""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)  # DeepSeek-V3's
# name: (batch, heads, page size, lengths, s_q, dtype, combined cache, NaN stale slots, schedule)
CASES = {
    "t1-L37": (1, 16, 64, (37,), 1, "bf16", False, False, "seesaw"),
    "t1-L64": (1, 16, 64, (64,), 1, "bf16", False, False, "seesaw"),
    "t2-L100": (1, 16, 64, (100,), 1, "bf16", False, False, "seesaw"),
    "t3-L150": (1, 16, 64, (150,), 1, "bf16", False, False, "seesaw"),
    "split-L500": (1, 16, 64, (500,), 1, "bf16", False, False, "seesaw"),
    "p128-L37": (1, 16, 128, (37,), 1, "bf16", False, False, "seesaw"),
    "p128-L300": (1, 16, 128, (300,), 1, "bf16", False, False, "seesaw"),
    "h128-L100": (1, 128, 64, (100,), 1, "bf16", False, False, "seesaw"),
    "sq2-L100": (1, 16, 64, (100,), 2, "bf16", False, False, "seesaw"),
    "check0-b3-L37-0-100": (3, 16, 64, (37, 0, 100), 1, "bf16", True, False, "seesaw"),
    "check0-b3-L37-0-100-fp16": (3, 16, 64, (37, 0, 100), 1, "fp16", True, False, "seesaw"),
    "nan-stale-b2-L1-129": (2, 16, 64, (1, 129), 1, "bf16", False, True, "seesaw"),
    "h128-sq2-p128-L700-nan": (2, 128, 128, (5, 700), 2, "fp16", True, True, "seesaw"),
    "control-roles-t2-L100": (1, 16, 64, (100,), 1, "bf16", False, False, "roles"),
}


def _problem(b, hq, ps, lens, s_q, dtype, combined, poison, device="cuda"):
    """q views (b, s_q, hq, 512 / 64), the caches (FlashMLA's combined (P, ps, 1, 576) or split),
    an int32 page table of distinct random pages, int32 lengths; stale slots NaN if poison."""
    import torch

    g = torch.Generator(device=device).manual_seed(0)
    rand = {"device": device, "dtype": dtype, "generator": g}
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 3
    if combined:
        ckv, kpe = torch.randn(pages, ps, 1, 576, **rand), None
    else:
        ckv, kpe = torch.randn(pages, ps, 512, **rand), torch.randn(pages, ps, 64, **rand)
    table = torch.randperm(pages, device=device, generator=g)[: b * max_pages].view(b, -1)
    if poison:
        for i, n in enumerate(lens):
            for j in range(max_pages):
                ckv[table[i, j], max(n - j * ps, 0) :] = float("nan")
                if kpe is not None:
                    kpe[table[i, j], max(n - j * ps, 0) :] = float("nan")
    q = torch.randn(b, s_q, hq, 576, **rand)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    return q[..., :512], q[..., 512:], ckv, kpe, table.to(torch.int32), seq


def run_one(name: str, device: str = "cuda") -> dict:
    """One case in this process: the op, then the reference; the verdict as a dict. (The
    launcher's kernel lookup and plan are wrapped to record the route and the split count,
    and restored after.)"""
    import torch

    from forgekernel.kernels.attention.mla.sm90 import launch
    from forgekernel.ops import mla as op
    from forgekernel.reference.mla import mla_decode_ref

    b, hq, ps, lens, s_q, dt, combined, poison, schedule = CASES[name]
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dt]
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, ps, lens, s_q, dtype, combined, poison, device)
    keys, plans = [], []
    real_kernel, real_plan, real_env = launch.get_kernel, launch._plan, os.environ.copy()
    launch.get_kernel = lambda spec, p: keys.append(dict(p)) or real_kernel(spec, p)
    launch._plan = lambda *a: plans.append(real_plan(*a)) or plans[-1]
    os.environ["FORGEKERNEL_MLA_SCHEDULE"] = schedule
    launch._plans.clear()
    try:
        out = torch.full((*qn.shape[:-1], 512), float("nan"), device=device, dtype=dtype)
        t0 = time.perf_counter()
        _, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out,
                               return_lse=True)  # fmt: skip
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
    finally:
        launch.get_kernel, launch._plan = real_kernel, real_plan
        os.environ.clear()
        os.environ.update(real_env)
        launch._plans.clear()
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    low, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, upcast=False)
    err = float((out.float() - want).abs().nan_to_num(math.inf).max())
    bound = 2 * float((low.float() - want).abs().max()) + 1e-3
    finite = torch.isfinite(want_lse)
    lse_ok = torch.equal(finite, torch.isfinite(lse))
    lse_err = float((lse[finite] - want_lse[finite]).abs().max()) if finite.any() else 0.0
    partial = [k for k in keys if k["kind"] == "partial"]
    return {
        "ok": err <= bound and lse_ok and lse_err < 1e-3,
        "err": err,
        "bound": bound,
        "lse_err": lse_err if lse_ok else math.inf,
        "route": "tma" if partial and partial[-1].get("tma") else "roles",
        "splits": plans[-1][2] if plans else None,
        "seconds": took,
    }


def run_ladder(names: list[str], timeout: float) -> bool:
    """Every case in a subprocess (its own session, killed whole on timeout); one line each."""
    all_ok = True
    for name in names:
        cmd = [sys.executable, __file__, "--child", name]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                start_new_session=True)  # fmt: skip
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            print(f"HANG   {name}: no exit in {timeout:g} s", flush=True)
            all_ok = False
            continue
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        if proc.returncode != 0 or not lines:
            tail = (err.strip().splitlines() or ["(no output)"])[-1][:300]
            print(f"ERROR  {name}: rc {proc.returncode}: {tail}", flush=True)
            all_ok = False
            continue
        r = json.loads(lines[-1])
        verdict = "PASS  " if r["ok"] else f"FAIL({r['err']:.3g} > {r['bound']:.3g})"
        print(f"{verdict} {name}: err {r['err']:.3g} (bound {r['bound']:.3g}), lse err "
              f"{r['lse_err']:.3g}, route {r['route']}, splits {r['splits']}, "
              f"{r['seconds']:.2f} s", flush=True)  # fmt: skip
        all_ok &= r["ok"]
    return all_ok


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--timeout", type=float, default=20.0, help="seconds per case")
    parser.add_argument("--only", nargs="+", choices=sorted(CASES), help="these cases")
    parser.add_argument("--child", choices=sorted(CASES), help=argparse.SUPPRESS)
    parser.add_argument("--list", action="store_true", help="print the cases and exit")
    args = parser.parse_args()
    if args.list:
        for name, case in CASES.items():
            print(name, case)
        return 0
    if args.child:
        print(json.dumps(run_one(args.child)), flush=True)
        return 0
    return 0 if run_ladder(args.only or list(CASES), args.timeout) else 1


if __name__ == "__main__":
    sys.exit(main())
