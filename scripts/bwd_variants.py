"""Time attention-backward main-kernel variants (BwdConfig knobs) side by side with cuDNN.

Each variant runs once and its dq / dk / dv are compared with the default variant's; then all
variants and cuDNN's backward (torch SDPA, SDPBackend.CUDNN_ATTENTION, forward outside the
timed region) are timed with CUDA graphs, interleaved.

    python scripts/bwd_variants.py --build DIR      (here, no GPU: prebuild every kernel)
    python scripts/bwd_variants.py [OUT.json]       (GPU; FORGEKERNEL_KERNEL_DIR=DIR)

A variant that fails to load or run is reported in the table and OUT.json, not fatal.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from dataclasses import replace

from forgekernel.kernels.attention.bwd.sm90.config import BwdConfig, default_config

C = BwdConfig
# name -> config, per head dim D (Dv = DV.get(D, D)). "default" first: the reference of the
# diffs.
DV = {192: 128}
D128 = default_config(128, 128)
D64 = default_config(64, 64)
D192 = default_config(192, 128)
VARIANTS = {
    128: {
        "default": D128,
        "expg0": replace(D128, exp_groups=0),
        "default_last": D128,  # the same kernel again, timed last: the rotation's bias
    },
    64: {
        "default": D64,
        "expg0": replace(D64, exp_groups=0),
        "expg8": replace(D64, exp_groups=8),
        "default_last": D64,
    },
    192: {
        "default": D192,
    },
}
# Earlier rounds and the knobs they measured and dropped: BWD_NOTES.md ("Measured and dropped:
# knobs that left the leaf" and the sections after it).
CASES = [  # (b, hq, hkv, s, d, causal): the attention_bwd bench suite
    (8, 32, 32, 4096, 128, True),
    (4, 32, 32, 8192, 128, True),
    (2, 32, 32, 16384, 128, True),
    (8, 64, 8, 4096, 128, True),
    (4, 64, 8, 8192, 128, True),
    (2, 64, 8, 16384, 128, True),
    (2, 32, 32, 8192, 64, True),
    (2, 128, 128, 8192, 192, True),  # DeepSeek (Dv = 128)
    (4, 16, 16, 8192, 128, True),
    (4, 32, 4, 8192, 128, True),
]
# BWD_PROBE=1 (build and run): also non-causal MHA cases of equal work (b s^2 constant) whose
# CTAs walk 16 .. 128 query blocks: the time per CTA that does not scale with its steps
# (launch, K / V load, dK / dV store), ours against FA4's.
PROBE_CASES = [(64, 32, 32, 1024, 128, False), (16, 32, 32, 2048, 128, False),
               (4, 32, 32, 4096, 128, False), (1, 32, 32, 8192, 128, False)]  # fmt: skip
if os.environ.get("BWD_PROBE") == "1":
    CASES = CASES + PROBE_CASES
# BWD_ODD=1 (build and run): also awkward shapes (partial key blocks, fewer tiles than
# multiprocessors, non-causal, odd GQA groups): the variants' agreement with the default there.
ODD_CASES = [(1, 4, 2, 1000, 128, True), (3, 6, 3, 777, 128, False),
             (1, 8, 8, 4100, 64, True), (2, 12, 4, 2500, 128, True)]  # fmt: skip
if os.environ.get("BWD_ODD") == "1":
    CASES = CASES + ODD_CASES
# BWD_CASES=0,1,4: only these cases (indices into CASES)
if os.environ.get("BWD_CASES"):
    CASES = [CASES[int(i)] for i in os.environ["BWD_CASES"].split(",")]
# BWD_REPEAT=n (run only): each case n times in a row (rows tagged "#1".."#n"), to see how far
# a noisy case (GQA s16384: several percent between runs) moves between repetitions.
REPEAT = max(1, int(os.environ.get("BWD_REPEAT", "1")))
# BWD_PREROLL=1: time everything twice, as the bench does and with each sample preceded by an
# untimed replay of the same candidate (rows "<name>+preroll"): how much a predecessor's
# power draw moves a sample on a power-capped GPU.
PREROLL = os.environ.get("BWD_PREROLL") == "1"
# BWD_EXPANDED=1: GQA cases also time the default kernel on K / V expanded to Hq heads
# ("expanded": one CTA per query head, dK / dV not summed over the group)
EXPANDED = os.environ.get("BWD_EXPANDED") == "1"
DTYPE = "bfloat16"


def build(out_dir: str) -> int:
    """Compile every kernel the GPU mode needs (pre, main variants, post) into out_dir and print
    each main variant's registers / spills (no GPU needed)."""
    import tempfile
    from pathlib import Path

    from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN, SPEC_POST, SPEC_PRE
    from forgekernel.kernels.attention.bwd.sm90.config import (
        main_params,
        post_params,
        pre_params,
    )
    from forgekernel.runtime.cache import compile_to
    from forgekernel.runtime.resources import inspect_cubin

    out = Path(out_dir)
    bad = 0
    seen = set()
    for _, _, _, _, d, causal in CASES:
        dv = DV.get(d, d)
        jobs = [(SPEC_PRE, pre_params(DTYPE, dv), "pre")]
        for name, cfg in VARIANTS[d].items():
            jobs.append((SPEC_MAIN, main_params(DTYPE, d, dv, causal, False, cfg), name))
            post = post_params(DTYPE, d, cfg.tile_m, dq_split=cfg.dq_split)
            jobs.append((SPEC_POST, post, "post"))
        for spec, params, name in jobs:
            key = (spec.name, params)
            if key in seen:
                continue
            seen.add(key)
            try:
                with tempfile.TemporaryDirectory() as keep:
                    rec = compile_to(spec, params, out, keep_dir=Path(keep))
                    res = inspect_cubin(rec.get("cubin")) if rec.get("cubin") else {}
                spill = res.get("spill_bytes")
                local = sum(res.get("sass", {}).get(k, 0) for k in ("LDL", "STL"))
                print(
                    f"built d{d} {'causal' if causal else 'full'} {spec.name} {name}: "
                    f"regs {res.get('registers')} spill {spill} LDL/STL {local} "
                    f"HGMMA {res.get('sass', {}).get('HGMMA')} ({rec.get('compile_s')} s)"
                )
                if spill or local:
                    print(f"  WARNING: {name} spills")
            except Exception as e:  # noqa: BLE001
                bad += 1
                print(f"FAILED d{d} {spec.name} {name}: {type(e).__name__}: {str(e)[:300]}")
    return 1 if bad else 0


def _inputs(b, hq, hkv, s, d, causal, dev):
    import torch

    dv = DV.get(d, d)
    g = torch.Generator(device=dev).manual_seed(0)
    dt = torch.bfloat16
    q = torch.randn(b, s, hq, d, device=dev, dtype=dt, generator=g)
    k = torch.randn(b, s, hkv, d, device=dev, dtype=dt, generator=g)
    v = torch.randn(b, s, hkv, dv, device=dev, dtype=dt, generator=g)
    do = torch.randn(b, s, hq, dv, device=dev, dtype=dt, generator=g)
    scale = d**-0.5
    grp = hq // hkv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(grp, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(grp, dim=1)
    with torch.no_grad():
        try:  # o and its LSE from the flash SDPA forward
            res = torch.ops.aten._scaled_dot_product_flash_attention(
                qh, kh, vh, 0.0, causal, False, scale=scale
            )
            o, lse = res[0].transpose(1, 2).contiguous(), res[1].float().contiguous()
        except Exception:  # noqa: BLE001  (fallback: math, per head)
            lse = torch.empty(b, hq, s, device=dev, dtype=torch.float32)
            o = torch.empty_like(do)
            for h in range(hq):
                sc = torch.matmul(qh[:, h].float(), kh[:, h].float().transpose(-1, -2)) * scale
                if causal:
                    upper = torch.ones(s, s, device=dev, dtype=torch.bool).triu(1)
                    sc.masked_fill_(upper, -math.inf)
                lse[:, h] = torch.logsumexp(sc, -1)
                o[:, :, h] = torch.matmul(torch.softmax(sc, -1), vh[:, h].float()).to(dt)
                del sc
    return q, k, v, o, lse, do, scale, (qh, kh, vh)


def _phases(q, o, lse, do, d, scale):
    """The default config's preprocess and postprocess alone, launched as attention_bwd
    launches them ("pre", "post"; "zero": the preprocess's dQ zeroing alone, as a memset), to
    time the part of the backward that scales with tokens."""
    import torch

    from forgekernel.kernels.attention.bwd.sm90 import SPEC_POST, SPEC_PRE
    from forgekernel.kernels.attention.bwd.sm90.config import ROW_PAD, post_params, pre_params
    from forgekernel.runtime.cache import get_kernel

    b, sq, hq, _ = q.shape
    dv = DV.get(d, d)
    cfg = default_config(d, dv)
    sq_pad = -(-sq // ROW_PAD) * ROW_PAD
    f32 = torch.float32
    lse2 = torch.empty(b, hq, sq_pad, dtype=f32, device=q.device)
    dsum = torch.empty_like(lse2)
    dq_acc = torch.empty(b, hq, sq_pad * d, dtype=f32, device=q.device)
    dq = torch.empty_like(q)
    pre = get_kernel(SPEC_PRE, pre_params(DTYPE, dv))
    post = get_kernel(SPEC_POST, post_params(DTYPE, d, cfg.tile_m, dq_split=cfg.dq_split))
    return {
        "pre": lambda: pre(o, do, lse, lse2, dsum, None, dq_acc, 0),
        "post": lambda: post(dq_acc, dq, None, 0, scale),
        "zero": dq_acc.zero_,
    }


def run_case(case, rows):
    import torch
    from torch.nn.attention import SDPBackend, sdpa_kernel

    from forgekernel.kernels.attention.bwd.sm90.launch import attention_bwd
    from forgekernel.runtime.timing import median, time_interleaved

    b, hq, hkv, s, d, causal = case
    label = f"b{b} hq{hq} hkv{hkv} s{s} d{d} {'causal' if causal else 'full'}"
    dev = torch.device("cuda")
    q, k, v, o, lse, do, scale, (qh, kh, vh) = _inputs(b, hq, hkv, s, d, causal, dev)
    fns, diffs, errors = {}, {}, {}
    ref = None
    for name, cfg in VARIANTS[d].items():
        dq, dk, dv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)
        try:
            for t in (dq, dk, dv):
                t.fill_(math.nan)
            attention_bwd(q, k, v, o, lse, do, dq, dk, dv, scale, causal, config=cfg)
            torch.cuda.synchronize()
        except Exception as e:  # noqa: BLE001
            errors[name] = f"{type(e).__name__}: {str(e).strip()[:300]}"
            traceback.print_exc()
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001  (a sticky fault: later runs will fail too)
                pass
            continue
        if ref is None:
            ref = (dq, dk, dv)
            nonfinite = sum(int((~torch.isfinite(t)).sum()) for t in ref)
            diffs[name] = {"nonfinite": nonfinite}
        else:
            diffs[name] = {
                n: float((a.float() - r.float()).abs().max())
                for n, a, r in zip(("dq", "dk", "dv"), (dq, dk, dv), ref)
            }
            diffs[name]["nonfinite"] = sum(int((~torch.isfinite(t)).sum()) for t in (dq, dk, dv))

        def fn(cfg=cfg, dq=dq, dk=dk, dv=dv):
            attention_bwd(q, k, v, o, lse, do, dq, dk, dv, scale, causal, config=cfg)

        fns[name] = fn

    if EXPANDED and hkv != hq:
        # the default kernel on K / V expanded to Hq heads (MHA: a CTA per query head, no
        # head-group walk), dK / dV per query head left unsummed: what the walk's L2 locality
        # costs against one CTA per query head, before any dK / dV reduction
        k_x, v_x = (t.repeat_interleave(hq // hkv, dim=2).contiguous() for t in (k, v))
        dk_x, dv_x, dq_x = torch.empty_like(k_x), torch.empty_like(v_x), torch.empty_like(q)

        def expanded():
            attention_bwd(q, k_x, v_x, o, lse, do, dq_x, dk_x, dv_x, scale, causal)

        expanded()
        fns["expanded"] = expanded

    # cuDNN backward (K, V expanded to Hq heads for GQA; the expansion is outside the timing)
    try:
        qg, kg, vg = (t.detach().clone().requires_grad_(True) for t in (qh, kh, vh))
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, kg, vg, is_causal=causal, scale=scale
            )
        doh = do.transpose(1, 2)

        def cudnn():
            torch.autograd.grad(out, (qg, kg, vg), doh, retain_graph=True)

        gq, gk, gv = torch.autograd.grad(out, (qg, kg, vg), doh, retain_graph=True)
        if ref is not None:  # sanity of the default against cuDNN (dk, dv summed over groups)
            grp = hq // hkv
            gk = gk.unflatten(1, (hkv, grp)).sum(2).transpose(1, 2)
            gv = gv.unflatten(1, (hkv, grp)).sum(2).transpose(1, 2)
            diffs["cudnn"] = {
                n: float((a.float() - r.float()).abs().max())
                for n, a, r in zip(("dq", "dk", "dv"), (gq.transpose(1, 2), gk, gv), ref)
            }
        del gq, gk, gv
        fns["cudnn"] = cudnn
    except Exception as e:  # noqa: BLE001
        errors["cudnn"] = f"{type(e).__name__}: {str(e).strip()[:300]}"

    try:  # FA4's backward on the same O / LSE: the bench suite's comparator
        from forgekernel.bench.suites.attention_bwd import _fa4

        fa4_bwd = _fa4()
        if fa4_bwd is None:
            raise ImportError("flash_attn.cute is not installed")
        fa4_inputs = {"q": q, "k": k, "v": v, "o": o, "lse": lse, "do": do}
        fa4_inputs.update(softmax_scale=scale, causal=causal)

        def fa4():
            fa4_bwd(fa4_inputs)

        fa4()
        fns["fa4"] = fa4
    except Exception as e:  # noqa: BLE001
        errors["fa4"] = f"{type(e).__name__}: {str(e).strip()[:300]}"

    if os.environ.get("BWD_PROBE") == "1":
        try:
            fns.update(_phases(q, o, lse, do, d, scale))
        except Exception as e:  # noqa: BLE001
            errors["pre"] = f"{type(e).__name__}: {str(e).strip()[:300]}"

    if PROBE_CLOCKS and case == CASES[0]:
        _probe_clocks(fns, label)

    if PREROLL:  # the bench's order: ours, FA4, cuDNN
        first = [n for n in ("default", "fa4", "cudnn") if n in fns]
        fns = {n: fns[n] for n in first + [n for n in fns if n not in first]}
    samples = {}
    try:
        samples = time_interleaved(fns, warmup=3, reps=REPS)
        if PREROLL:
            pre = time_interleaved(fns, warmup=3, reps=REPS, preroll=True)
            samples.update({f"{n}+preroll": smp for n, smp in pre.items()})
    except Exception as e:  # noqa: BLE001  (time one by one, skipping the failing ones)
        print(f"interleaved timing failed ({e}); timing one by one", file=sys.stderr)
        for name, fn in fns.items():
            try:
                samples[name] = time_interleaved({name: fn}, warmup=3, reps=REPS)[name]
            except Exception as e2:  # noqa: BLE001
                errors[name] = f"timing: {type(e2).__name__}: {str(e2).strip()[:300]}"
    fwd = 2 * b * hq * s * s * (d + DV.get(d, d)) * (0.5 if causal else 1.0)
    flops = 2.5 * fwd
    ms = {n: median(smp) for n, smp in samples.items()}
    names = list(VARIANTS[d]) + ["expanded", "cudnn", "fa4", *PHASES]
    if PREROLL:
        names += [f"{n}+preroll" for n in names]
    for name in names:
        if name.split("+")[0] in (*PHASES, "expanded") and name not in ms:
            continue
        # ratios within one protocol: "x+preroll" against "default+preroll" and so on
        sfx = "+preroll" if name.endswith("+preroll") else ""
        row = {"case": label, "variant": name}
        if name in VARIANTS[d]:
            row["config"] = VARIANTS[d][name].tag()
        if name in ms:
            t = ms[name]
            ref = {k: ms.get(k + sfx) for k in ("default", "cudnn", "fa4")}
            row.update(
                ms=t,
                tflops=flops / t / 1e9,
                vs_default=ref["default"] / t if ref["default"] else None,
                vs_cudnn=ref["cudnn"] / t if ref["cudnn"] else None,
                vs_fa4=ref["fa4"] / t if ref["fa4"] else None,
                method=getattr(samples[name], "method", None),
            )
        if name in diffs:
            row["maxdiff_vs_default"] = diffs[name]
        if name in errors:
            row["error"] = errors[name]
        rows.append(row)


PROBE_CLOCKS = True
PHASES = ("pre", "post", "zero")
REPS = 20
PROBE_NAMES = ("default", "fa4")
CLOCKS: list[str] = []  # the probe's lines, printed again before the table


def _probe_clocks(fns, label):
    """SM clock and board power while each function runs back to back for ~2 s (nvidia-smi
    sampled 1 s in): whether one kernel is held to lower clocks than another (power)."""
    import subprocess

    import torch

    for name, fn in fns.items():
        if name not in PROBE_NAMES:
            continue
        try:
            torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            torch.cuda.synchronize()
            n = max(1, int(2.0 / max(time.perf_counter() - t, 1e-4)))
            for _ in range(n):
                fn()
            time.sleep(1.0)
            smi = subprocess.run(
                ["nvidia-smi", "--query-gpu=clocks.sm,power.draw,temperature.gpu",
                 "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()  # fmt: skip
            torch.cuda.synchronize()
            CLOCKS.append(f"clocks {label} {name}: {smi}")
            print(CLOCKS[-1], flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"clocks {label} {name}: {e}", flush=True)


def main() -> int:
    t0 = time.time()
    rows: list[dict] = []
    for i, case in enumerate(c for c in CASES for _ in range(REPEAT)):
        try:
            start = len(rows)
            run_case(case, rows)  # its tensors are freed on return
            if REPEAT > 1:
                for r in rows[start:]:
                    r["case"] += f" #{i % REPEAT + 1}"
        except Exception as e:  # noqa: BLE001
            traceback.print_exc()
            rows.append({"case": str(case), "variant": "*", "error": f"{type(e).__name__}: {e}"})
        try:
            import torch

            torch.cuda.empty_cache()
        except Exception:  # noqa: BLE001
            pass
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    print("\n".join(CLOCKS))
    print(
        f"{'case':32s} {'variant':16s} {'ms':>8s} {'TF/s':>6s} {'x dflt':>6s} {'x cudnn':>7s} "
        f"{'x fa4':>6s}"
        "  maxdiff vs default (dq, dk, dv)"
    )
    for r in rows:
        if "ms" in r:
            dd = r.get("maxdiff_vs_default") or {}
            diff = " ".join(f"{dd[k]:.3g}" for k in ("dq", "dk", "dv") if k in dd)
            if dd.get("nonfinite"):
                diff += f" NONFINITE {dd['nonfinite']}"
            vd = f"{r['vs_default']:6.3f}" if r.get("vs_default") else "     -"
            vc = f"{r['vs_cudnn']:7.3f}" if r.get("vs_cudnn") else "      -"
            vc += f" {r['vs_fa4']:6.3f}" if r.get("vs_fa4") else "      -"
            print(
                f"{r['case']:32s} {r['variant']:16s} {r['ms']:8.3f} {r['tflops']:6.1f} "
                f"{vd} {vc}  {diff}"
            )
        if "error" in r:
            print(f"{r['case']:32s} {r['variant']:16s} ERROR {r['error']}")
    print(f"total {time.time() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--build":
        sys.exit(build(sys.argv[2]))
    sys.exit(main())
