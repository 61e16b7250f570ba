"""The K = 128 conv3d forward cases the 256x128 tile took (docs/conv/NOTES.md, "256 x 128
adopted"; bench/suites/conv_fwd.py `CONV3D_WAS`): per case, cuDNN, the launcher's own plan
(config.TALL there) and `was` (the plan before: 128x128 c2x1 on rectangles 8 wide), each output
checked against cuDNN's first, then timed interleaved (runtime/timing.py: graph replays, each
sample after an untimed replay of its own plan).

    python3 scripts/conv3d_tall_probe.py [CASE ...]    (default: every case of the table)

Prints ms, TF/s, cudnn / this and this / launcher per row; the adoption holds where `was` /
launcher >= 1.0 here and in the bench (`forgekernel bench conv_fwd`).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from forgekernel.bench.suites import conv_layers as L  # noqa: E402
from forgekernel.bench.suites.conv_fwd import BENCH_CASES, CONV3D_WAS  # noqa: E402
from forgekernel.kernels.conv.sm90 import launch  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.timing import median, time_interleaved  # noqa: E402


def main(names: list[str]) -> None:
    gen = torch.Generator(device="cuda").manual_seed(0)
    wanted = names or list(CONV3D_WAS)
    for case in BENCH_CASES:
        if case.name not in wanted:
            continue
        p = dict(case.params)
        inputs = L.make_inputs(case, torch.bfloat16, torch.device("cuda"), gen)
        x5, w5 = op._as5d(inputs["x"]), op._as5d(inputs["w"])
        g = op._geometry(len(p["spatial"]), p["kernel"], p["stride"], p["padding"], p["dilation"])
        ref = L.cudnn(inputs).float()
        fns = {"cudnn": functools.partial(L.cudnn, inputs)}
        for name, plan in {"launcher": None, **CONV3D_WAS[case.name]}.items():
            y = L.alloc_out(inputs)
            y.fill_(float("nan"))
            fn = functools.partial(launch.fprop, x5, w5, inputs.get("bias"), op._view5d(y), g, plan)
            fn()
            torch.cuda.synchronize()
            err = ((y.float() - ref).abs().max() / ref.abs().max()).item()
            if not err < 2e-2:  # NaN included
                print(f"{case.name} {name}: WRONG (rel err {err:.3g})", flush=True)
                continue
            fns[name] = fn
        samples = time_interleaved(fns, reps=15, preroll=True)
        flop = L.flops(case)
        base, ours = median(samples["cudnn"]), median(samples.get("launcher", [float("nan")]))
        print(case.name, flush=True)
        for name, s in samples.items():
            ms = median(s)
            print(
                f"  {name:10s} {ms:.4f} ms {flop / ms / 1e9:5.0f} TF/s  cudnn/this "
                f"{base / ms:.3f}  this/launcher {ms / ours:.3f}",
                flush=True,
            )


if __name__ == "__main__":
    main(sys.argv[1:])
