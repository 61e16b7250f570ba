"""Time attention-forward configurations side by side with FA4 (JIT path: the DSL compiles
the variants on the GPU host). Each variant's output is compared with FA4's first.

    python scripts/attn_variants.py [OUT.json]
    python scripts/attn_variants.py --build DIR      (here, no GPU: prebuild the variants)
"""

from __future__ import annotations

import json
import math
import sys

import torch

from forgekernel.kernels.attention.fwd import sm90
from forgekernel.kernels.attention.fwd.sm90.config import AttnConfig
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import num_sms
from forgekernel.runtime.timing import median, time_interleaved

C = AttnConfig
EARLY = {"late_rescale": False}
SNAKE = {"snake": True}
D256 = [C(128, 80, 2, **SNAKE), C(128, 64, 2), C(128, 64, 2, **SNAKE)]
SEC40 = {"l2_kv_mib": 40}
D192 = [C(**EARLY, **SEC40), C(**EARLY)]
D192 += [C(128, 112, 2, **EARLY, **SEC40)]
CASES = [
    # (b, hq, hkv, s, d, causal, configs); d = (D, Dv) when they differ. First: the default.
    # docs/attention/NOTES.md, "D=256 and 192/128 after split_softmax" and "Measured
    # 2026-12-03 16:50": snake = the tiles dealt in snake order; sec40 = L2 sections of 40
    # MiB: 8 heads (FA4's) instead of 4. The defaults adopted on that run (D=256 128x80
    # snaked, 192/128 sec40) against the old ones, and 128x112 on top of sec40 (O stored
    # from registers, the other knob then, was dropped 2026-12-05: NOTES.md).
    (16, 64, 4, 2048, 128, True, [C(), C(**SNAKE)]),
    (8, 64, 4, 4096, 128, False, [C()]),
    (8, 32, 32, 4096, 64, True, [C(192, 128, 3), C(192, 128, 3, **SNAKE)]),
    (4, 16, 16, 4096, 256, True, D256),
    (2, 128, 128, 8192, (192, 128), True, D192),
    # Partial last tiles (1000 rows), the same kernels as above (the length is dynamic): the
    # new defaults, maxdiff against FA4 as the old default's.
    (2, 16, 16, 1000, 256, True, [C(128, 80, 2, **SNAKE), C(128, 64, 2)]),
    (1, 16, 16, 1000, (192, 128), True, [C(**EARLY, **SEC40)]),
]


def _dims(d):
    return d if isinstance(d, tuple) else (d, d)


def build(out_dir: str) -> None:
    """Compile every variant here (no GPU) into out_dir, for FORGEKERNEL_KERNEL_DIR there."""
    from pathlib import Path

    from forgekernel.runtime.cache import compile_to

    for _, _, _, _, d, causal, cfgs in CASES:
        d, dv = _dims(d)
        for cfg in cfgs:
            params = sm90.params_for("bfloat16", d, dv, causal, cfg)
            try:
                compile_to(sm90.SPEC, params, Path(out_dir))
                print("built", d, dv, causal, cfg.tag())
            except Exception as e:
                print("FAILED", d, dv, causal, cfg.tag(), type(e).__name__, str(e)[:200])


def _compile(job):
    d, dv, causal, cfg = job
    get_kernel(sm90.SPEC, sm90.params_for("bfloat16", d, dv, causal, cfg))
    return cfg.tag()


def precompile() -> None:
    """Every variant compiled in parallel into the cache first, one process a core (one by
    one, 19 variants could outlast VARIANTS_TIMEOUT); already built ones (a carried bundle)
    just load. A variant that fails to build fails again, its error recorded, in `main`."""
    import os
    import time
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    jobs = [(*_dims(d), causal, cfg) for _, _, _, _, d, causal, cfgs in CASES for cfg in cfgs]
    jobs = list(dict.fromkeys(jobs))  # the ragged cases reuse kernels
    t = time.time()
    with ProcessPoolExecutor(
        min(os.cpu_count() or 1, len(jobs)), mp_context=get_context("spawn")
    ) as pool:
        futures = [pool.submit(_compile, job) for job in jobs]
    failed = sum(f.exception() is not None for f in futures)
    print(f"precompiled {len(jobs) - failed} of {len(jobs)} variants in {time.time() - t:.0f} s")


def main() -> None:
    from flash_attn.cute import flash_attn_func

    precompile()

    rows = []
    for b, hq, hkv, s, d, causal, cfgs in CASES:
        d, dv = _dims(d)
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, hq, d, device="cuda", dtype=torch.bfloat16, generator=g)
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(b, s, hkv, dv, device="cuda", dtype=torch.bfloat16, generator=g)
        o = torch.empty(b, s, hq, dv, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(b, hq, s, device="cuda")
        scale = d**-0.5
        want = flash_attn_func(q, k, v, causal=causal)
        want = want[0] if isinstance(want, tuple) else want
        fns = {"fa4": lambda q=q, k=k, v=v, c=causal: flash_attn_func(q, k, v, causal=c)}
        errs = {}
        for cfg in cfgs:
            try:
                fn = get_kernel(sm90.SPEC, sm90.params_for("bfloat16", d, dv, causal, cfg))
            except Exception as e:  # a config that does not build
                errs[cfg.tag()] = f"build: {type(e).__name__}: {e}"[:200]
                continue
            args = (q, k, v, o, lse, None, None, scale * LOG2E, 0, 1, num_sms(q.device.index), None)
            o.fill_(math.nan)
            fn(*args)
            torch.cuda.synchronize()
            errs[cfg.tag()] = float((o.float() - want.float()).abs().max())
            fns[cfg.tag()] = lambda fn=fn, args=args: fn(*args)
        samples = time_interleaved(fns, warmup=3, reps=15)
        flop = 2 * b * hq * (d + dv) * s * s / (2 if causal else 1)
        fa4 = median(samples["fa4"])
        for name, smp in samples.items():
            ms = median(smp)
            rows.append(
                {
                    "case": f"b{b} hq{hq} hkv{hkv} s{s} d{d}/{dv} {'c' if causal else 'full'}",
                    "variant": name,
                    "ms": ms,
                    "tflops": flop / ms / 1e9,
                    "fa4_ratio": fa4 / ms,
                    "maxdiff_vs_fa4": errs.get(name),
                }
            )
        for name, e in errs.items():
            if isinstance(e, str):
                rows.append({"case": f"d{d}", "variant": name, "error": e})
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)
    for r in rows:
        if "error" in r:
            print(f"{r['case']:34s} {r['variant']:14s} {r['error']}")
        else:
            print(
                f"{r['case']:34s} {r['variant']:14s} {r['ms']:8.3f} ms {r['tflops']:6.1f} TF/s "
                f"fa4/ours {r['fa4_ratio']:.3f} maxdiff {r['maxdiff_vs_fa4']}"
            )


if __name__ == "__main__":
    if len(sys.argv) > 2 and sys.argv[1] == "--build":
        build(sys.argv[2])
    else:
        main()
