"""A ladder of tiny chunked linear-attention cases (the GDN prefill kernel unsplit and V-split,
the KDA op, its first-pass kernel and the recurrence in both grid forms), each in its own subprocess
under a timeout, so that one device call says which kernel form passes, fails or hangs before
the GPU test files run them all:

    python3 scripts/diag_linear_attn.py [--timeout 20] [--only NAME ...]
    python3 scripts/diag_linear_attn.py --bench-cases [kda_prefill] [diag_bench_cases options]

`--bench-cases`: instead of the ladder, a suite's bench cases x the bench's candidates (ours,
its variants, the comparators), each in its own process with blocking launches
(scripts/diag_bench_cases.py: the options and verdicts are there).

Each line: PASS / FAIL(err > bound) / HANG (no exit in the timeout) / ERROR (an exception), the
kernel's compile key as the launcher chose it (GDN: the t_pre form, after the T precompute, but
on unsplit launches over ungrouped heads, `launch.t_pre_for`: the unsplit control stays the
standard form). The ladder, control first: GDN unsplit (the
kernel checked on the H200), then V-split CTAs with 1, 2, 3, 4 and 8 chunks (the two aux
warpgroups: one with no chunk, alternating, odd counts, the 3-deep q / k ring wrapped) and a
varlen mix (empty, 1-token, 63 / 64 / 65, l2norm, k-last state); KDA (the first-pass kernel,
`intra.py`, then the recurrence) in one CTA and in the value split (1, 3, 8 chunks, varlen),
then a varlen mix with l2norm in the launcher's grid form. Criterion (the GPU tests'): o and
the final state within 2e-2 of their largest entry against the fp64 token recurrence
(forgekernel.reference.delta_rule). Build the kernels first (`python3 -m forgekernel build
--only gdn_prefill_sm90 --only kda_prefill_sm90 --only kda_intra_sm90`): a JIT compile inside
a case can outlast its timeout (then raise --timeout)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel
TOL = 2e-2
# name: (op, lengths, H, HV, split, l2norm, k_last); split None: the launcher's
CASES = {
    "gdn-one-cta-L150": ("gdn", (150,), 2, 2, False, False, False),
    "gdn-split-L37": ("gdn", (37,), 2, 2, True, False, False),
    "gdn-split-L100": ("gdn", (100,), 2, 2, True, False, False),
    "gdn-split-L150": ("gdn", (150,), 2, 2, True, False, False),
    "gdn-split-L250": ("gdn", (250,), 2, 2, True, False, False),
    "gdn-split-L500": ("gdn", (500,), 2, 4, True, False, False),
    "gdn-split-varlen": ("gdn", (1, 0, 63, 64, 65, 130), 2, 4, True, True, True),
    "kda-one-cta-L150": ("kda", (150,), 2, 2, False, False, False),
    "kda-split-L37": ("kda", (37,), 2, 2, True, False, False),
    "kda-split-L150": ("kda", (150,), 2, 2, True, False, False),
    "kda-split-L500": ("kda", (500,), 2, 4, True, False, False),
    "kda-split-varlen": ("kda", (1, 0, 63, 64, 65, 130), 2, 4, True, False, False),
    "kda-varlen-l2norm": ("kda", (1, 0, 64, 65, 200), 2, 4, None, True, False),
}


def _inputs(op: str, lens, h, hv, device):
    """fla-form (1, T, ...) inputs, unit-norm keys, g and beta as the GPU tests draw them."""
    import torch
    import torch.nn.functional as F

    gen = torch.Generator(device=device).manual_seed(0)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device=device, generator=gen)

    q = rnd(1, total, h, 128).to(torch.bfloat16)
    k = F.normalize(rnd(1, total, h, 128), dim=-1).to(torch.bfloat16)
    v = rnd(1, total, hv, 128).to(torch.bfloat16)
    gate = (1, total, hv) if op == "gdn" else (1, total, hv, 128)
    g = F.logsigmoid(rnd(*gate) + 2.0)
    beta = torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device=device)
    return q, k, v, g, beta, state, cu.to(torch.int32)


def _force_split(op: str, split) -> list:
    """Patch the launcher's choice of grid form (None: leave it); returns what to restore."""
    if split is None:
        return []
    if op == "gdn":
        from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch

        real = launch._sms
        launch._sms = lambda device: 10**6 if split else 1
        return [(launch, "_sms", real)]
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch

    real = launch.value_split
    launch.value_split = lambda n, hv, device: bool(split)
    return [(launch, "value_split", real)]


def _keys(op: str) -> tuple[list, list]:
    """Record the compile keys the launcher asks for of the op's main kernel (GDN's chunked
    kernel, not its T precompute; KDA's recurrence, not its first pass); returns (keys, what to
    restore)."""
    if op == "gdn":
        from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch
    else:
        from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch
    keys, real = [], launch.get_kernel

    def record(spec, params):
        if spec is launch.SPEC:
            keys.append(dict(params))
        return real(spec, params)

    launch.get_kernel = record
    return keys, [(launch, "get_kernel", real)]


def run_one(name: str, device: str = "cuda") -> dict:
    """One case in this process: the op, then the fp64 recurrence; the verdict as a dict."""
    import torch

    from forgekernel.reference import delta_rule as ref

    op, lens, h, hv, split, l2norm, k_last = CASES[name]
    q, k, v, g, beta, state, cu = _inputs(op, lens, h, hv, device)
    keys, restore = _keys(op)
    restore += _force_split(op, split)
    try:
        t0 = time.perf_counter()
        if op == "gdn":
            from forgekernel.ops import gated_delta_rule_chunked as gdn

            init = state.transpose(-1, -2).contiguous() if k_last else state
            o, s = gdn.gated_delta_rule(q, k, v, g, beta, initial_state=init,
                                        output_final_state=True, cu_seqlens=cu,
                                        use_qk_l2norm_in_kernel=l2norm, k_last=k_last)  # fmt: skip
            s = s.transpose(-1, -2) if k_last else s
            recurrent = ref.gated_delta_rule_recurrent
        else:
            from forgekernel.ops import kda_chunked as kda

            o, s = kda._forward(q, k, v, g, beta, 128**-0.5, state, cu, l2norm)
            recurrent = ref.kimi_delta_attention_recurrent
        if device == "cuda":
            torch.cuda.synchronize()
        took = time.perf_counter() - t0
    finally:
        for obj, attr, real in restore:
            setattr(obj, attr, real)
    o_ref, s_ref = recurrent(q, k, v, g, beta, initial_state=state, output_final_state=True,
                             cu_seqlens=cu.long(), use_qk_l2norm=l2norm)  # fmt: skip

    def rel(got, want):
        err = (got.double() - want.double()).abs().nan_to_num(float("inf")).max()
        return float(err) / max(float(want.abs().max()), 1e-6)

    err = max(rel(o, o_ref), rel(s, s_ref))
    key = {x: y for x, y in (keys[-1] if keys else {}).items() if x not in ("k", "v", "dtype")}
    return {"ok": err <= TOL, "err": err, "bound": TOL, "key": key, "seconds": took}


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
        print(f"{verdict} {name}: err {r['err']:.3g}, key {r['key']}, {r['seconds']:.2f} s",
              flush=True)  # fmt: skip
        all_ok &= r["ok"]
    return all_ok


def main() -> int:
    if "--bench-cases" in sys.argv[1:]:
        from diag_bench_cases import main as bench_cases

        return bench_cases([a for a in sys.argv[1:] if a != "--bench-cases"])
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
