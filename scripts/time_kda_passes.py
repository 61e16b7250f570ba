"""The KDA prefill's time split between its two kernels, measured (docs/linear_attention/
NOTES.md, "KDA prefill at 0.28x cuDNN": the fit from the bench says 80-85 % first pass at 4 x
8192 h16):

    python3 scripts/time_kda_passes.py [B T H HV]        (default 4 8192 16 16, no state)

One line each, ms a launch (graph replays, `runtime.timing.time_interleaved`): the whole op
through the launcher; the first pass alone (`launch.first_pass_kernel`: the chunk tables' torch
ops and `intra.py`); the recurrence alone (`recurrence.py` on operands made once). Build
first: `python3 -m forgekernel build --only kda_prefill_sm90 --only kda_intra_sm90`."""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch  # noqa: E402
from forgekernel.runtime.timing import time_interleaved  # noqa: E402


def main(b: int = 4, t: int = 8192, h: int = 16, hv: int = 16) -> None:
    torch.manual_seed(0)
    dev, d, n = torch.device("cuda"), 128, b
    q = torch.randn(b * t, h, d, device=dev).bfloat16()
    k = F.normalize(torch.randn(b * t, h, d, device=dev), dim=-1).bfloat16()
    v = torch.randn(b * t, hv, d, device=dev).bfloat16()
    g = F.logsigmoid(torch.randn(b * t, hv, d, device=dev))
    beta = torch.sigmoid(torch.randn(b * t, hv, device=dev))
    cu = torch.arange(0, b * t + 1, t, device=dev, dtype=torch.int32)
    o, final, scale = torch.empty_like(v), torch.empty(n, hv, d, d, device=dev), d**-0.5
    ops = launch.first_pass_kernel(q, k, g, beta, cu, scale, False)
    split = launch.value_split(n, hv, dev)

    fns = {"op": lambda: launch.kda_prefill(q, k, v, g, beta, None, cu, o, final, scale,
                                            l2norm=False)}  # fmt: skip
    fns["first_pass"] = lambda: launch.first_pass_kernel(q, k, g, beta, cu, scale, False)
    # the launcher's own recurrence call (its 13 arguments since the `warmup` key)
    fns["recurrence"] = lambda: launch._recurrence(ops, v, None, cu, ops["first"], o, final)
    samples = time_interleaved(fns, reps=20)
    print(f"{b}x{t} h{h} hv{hv} (value_split={split}), ms a launch (median of 20 samples):")
    for name, s in samples.items():
        print(f"  {name:22s} {median(s):.4f}")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5]))
