"""The stem fold (kernels/conv/sm90/stem.py; docs/conv/NOTES.md, "The stem as its own kernel"):
per case, the forward and the weight gradient by cuDNN, ours as shipped (the 1x1 over the
explicit im2col), the fold through its overlapping view (`stem_direct`), through the view's
compact copy (`stem_copy`) and written by the fold kernel (`stem_fold`), and the parts alone:
the fold of x by torch (its fill and copy: `fold alone`) and by fold.py (`fold kernel`), and the
standard kernel's launch on a ready fold (`kernel alone`). Each variant is first checked
against the fp32 reference (bench/check.py `verify`, the suites' criterion): a WRONG line is a
bug and nothing after it counts. Graph replays, interleaved (runtime/timing.py).

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/conv_stem_fold_probe.py [CASE ...]
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from forgekernel.bench import check  # noqa: E402
from forgekernel.bench.suites import conv_fwd, conv_wgrad  # noqa: E402
from forgekernel.bench.suites import conv_layers as L  # noqa: E402
from forgekernel.kernels.conv.sm90 import launch, stem  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.timing import median, time_interleaved  # noqa: E402

# (n, H = W): C = 3, K = 64, 7x7, stride 2, pad 3
CASES = ((32, 224), (8, 512), (8, 223))


def _line(name: str, samples: dict, base: str) -> str:
    us = {k: median(v) * 1e3 for k, v in samples.items()}
    parts = [f"{k} {v:7.1f} us" for k, v in us.items()]
    parts += [f"{base}/{k} {us[base] / v:.2f}x" for k, v in us.items() if k != base]
    return f"{name:40s} " + "  ".join(parts)


def _verified(suite, inputs, device, name, run) -> bool:
    _, cmps = check.verify(suite, inputs, device, run=run)
    bad = [c.message for c in cmps if not c.ok]
    if bad:
        print(f"  {suite.name} {name}: WRONG ({bad})", flush=True)
    return not bad


def _parts(case, inputs, kernel: bool = False):
    """(the fold of x alone, by torch or by the fold kernel (`kernel`), the standard kernel's
    launch alone on a ready fold) of `stem_direct`."""
    p = inputs["params"]
    g = op._geometry(2, p["kernel"], p["stride"], p["padding"], p["dilation"])
    x = op._as5d(inputs["x"])
    out = g.output((1, *p["spatial"]))[1:]
    fold = stem.plan(p["c"], tuple(p["kernel"]), g, out)
    ready = stem.fold_input(x, fold)
    res = op._view5d(L.alloc_out(inputs))
    if p["op"] == "fwd":
        wf = stem.fold_filter(op._as5d(inputs["w"]), fold)
        launched = functools.partial(launch.fprop, ready, wf, None, res, fold.geometry())
    else:
        dwf = res.new_empty(res.shape[0], 1, fold.taps[0], 1, fold.channels)
        dy = op._as5d(inputs["dy"])
        launched = functools.partial(launch.wgrad, dy, ready, dwf, fold.geometry())
    return functools.partial(stem.fold_input, x, fold, kernel=kernel), launched


def main(names: list[str]) -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for n, hw in CASES:
        for suite in (conv_fwd.suite(), conv_wgrad.suite()):
            kind = "fwd" if suite.name == "conv_fwd" else "wgrad"
            case = L.conv_case(kind, n, 3, 64, (hw, hw), 7, 2)
            if names and case.name not in names:
                continue
            inputs = L.make_inputs(case, torch.bfloat16, device, gen)
            runs = {
                "ours": L.run_ours,
                "stem_direct": L.run_stem,
                "stem_copy": L.run_stem_copy,
                "stem_fold": L.run_stem_fold,
            }
            good = {k: r for k, r in runs.items() if _verified(suite, inputs, device, k, r)}
            res = L.alloc_out(inputs)
            fns = {"cudnn": functools.partial(L.cudnn, inputs)}
            fns.update({k: functools.partial(r, inputs, res) for k, r in good.items()})
            if "stem_direct" in good:
                fns["fold alone"], fns["kernel alone"] = _parts(case, inputs)
            if "stem_fold" in good:
                fns["fold kernel"] = _parts(case, inputs, kernel=True)[0]
            print(_line(f"{case.name} {kind}", time_interleaved(fns, reps=10), "cudnn"))


if __name__ == "__main__":
    main(sys.argv[1:])
