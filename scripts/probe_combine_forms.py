"""The split-KV combine alone, its CTA form against its warp form (a probe, GPU): where does the
warp form (one warp a (row, head): combine_form.py) win, and are its bounds (WARPS_FORM_UNITS
= 1024 rows x heads; FEW_FORM_UNITS = 4096 at D 512, where the CTA form has its few path for
rows of up to 16 splits) right? Prints us a call (CUDA-graph replays of the combine alone, its
partials rotated past L2) of both forms and cta / warps, per (rows x heads, splits, D), and the
rows x heads from which the warp form is faster at each (splits, D).

    python3 scripts/probe_combine_forms.py
"""

from __future__ import annotations

import torch

from forgekernel.kernels.attention.mla.sm90 import SPEC as MLA_SPEC
from forgekernel.kernels.attention.mla.sm90 import params_for as mla_params
from forgekernel.kernels.attention.paged.sm90 import SPEC as PAGED_SPEC
from forgekernel.kernels.attention.paged.sm90 import params_for as paged_params
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.timing import l2_bytes, median, rotation_sets, time_interleaved

HEADS = 16  # a row's heads; rows vary (units = rows x HEADS)
ROWS = (1, 8, 16, 32, 64, 128, 256)  # units 16 .. 4096
SPLITS = (1, 2, 4, 8, 16, 32, 128)  # 16: the few path's second round
DIMS = (128, 512)


def _kernels(d: int):
    """(cta, warps) combines at head dim d, bf16, called (partials O, LSE, out, lse)."""
    if d == 512:
        cta = get_kernel(MLA_SPEC, mla_params("combine", "bfloat16"))
        warps = get_kernel(MLA_SPEC, mla_params("combine", "bfloat16", warps=True))
    else:
        cta = get_kernel(PAGED_SPEC, paged_params("combine", "bfloat16", d))
        warps = get_kernel(PAGED_SPEC, paged_params("combine", "bfloat16", d, warps=True))
    return cta, warps


def _sets(rows: int, splits: int, d: int, g: torch.Generator):
    nbytes = splits * rows * HEADS * (d + 1) * 4
    sets = []
    for _ in range(rotation_sets(nbytes, l2=l2_bytes())):
        op = torch.randn(splits, rows, HEADS, d, device="cuda", generator=g)
        lp = torch.randn(splits, rows, HEADS, device="cuda", generator=g) * 4.0
        out = torch.empty(rows, HEADS, d, device="cuda", dtype=torch.bfloat16)
        lse = torch.empty(rows, HEADS, device="cuda")
        sets.append((op, lp, out, lse))
    return sets


def main() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    print(f"{'units':>6} {'splits':>6} {'D':>4} {'cta us':>8} {'warps us':>9} {'cta/warps':>9}")
    crossing = {}
    for d in DIMS:
        cta, warps = _kernels(d)
        for splits in SPLITS:
            for rows in ROWS:
                sets = _sets(rows, splits, d, g)
                got = time_interleaved({"cta": cta, "warps": warps}, rotate=sets, warmup=5,
                                       reps=15)  # fmt: skip
                t_cta, t_warps = (median(got[k]) * 1e3 for k in ("cta", "warps"))
                units = rows * HEADS
                print(f"{units:>6} {splits:>6} {d:>4} {t_cta:>8.2f} {t_warps:>9.2f} "
                      f"{t_cta / t_warps:>9.3f}", flush=True)  # fmt: skip
                if t_warps < t_cta and (splits, d) not in crossing:
                    crossing[(splits, d)] = units
    for (splits, d), units in sorted(crossing.items()):
        print(f"D {d} splits {splits}: the warp form faster from {units} units")


if __name__ == "__main__":
    main()
