"""The few-channel convolutions (the C = 3 stem) after their im2col became one strided copy
(docs/conv/NOTES.md, "The stem's im2col as one strided copy"): per case, the im2col alone (the
unfold + permuted copy it replaced against the strided copy), then the forward
(forgekernel.conv2d) and the weight gradient (forgekernel.conv2d_wgrad) against cuDNN, with
the 1x1 kernel alone on a ready im2col beside them (what is left when the im2col is free); all
timed interleaved (runtime/timing.py, graph replays). Checked first: the two im2cols bitwise,
each op against the fp32 reference (bench/check.py `verify`, the suites' criterion).

    PYTHONPATH=$PWD:$PYTHONPATH python3 scripts/conv_stem_probe.py [CASE ...]

Before (H200 2026-12-02 18:47 bench, unfold im2col): n32-c3-224x224-k64-7x7-s2 forward
856.7 us (cuDNN 220.9), weight gradient 865.7 us (cuDNN 154.3).
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from forgekernel.bench import check  # noqa: E402
from forgekernel.bench.suites import conv_fwd, conv_wgrad  # noqa: E402
from forgekernel.bench.suites import conv_layers as L  # noqa: E402
from forgekernel.kernels.conv.sm90 import launch  # noqa: E402
from forgekernel.ops import conv as op  # noqa: E402
from forgekernel.runtime.timing import median, time_interleaved  # noqa: E402

# (n, c, H = W, k, filter, stride); padding: the size-keeping one (3 for 7x7, 1 for 3x3)
CASES = (
    (32, 3, 224, 64, 7, 2),  # ResNet-50's stem, the bench's
    (8, 3, 512, 64, 7, 2),
    (32, 3, 224, 64, 3, 1),
    (16, 4, 256, 32, 3, 1),
)


def im2col_unfold(x, geometry, out_dhw):
    """The im2col before the strided copy (launch.py `_im2col` until 2026-12-02): torch's
    unfold on the (N, C, H, W) view of x (N, 1, H, W, C), a permuted copy into the (N, 1, P, Q,
    R x S x C rounded up to 8) buffer, the tail's fill. The tests' bitwise reference too."""
    n, _, h, w_, c = x.shape
    _, p, q = out_dhw
    (_, r, s_), lo, hi = geometry.filter, geometry.pad_lo, geometry.pad_hi
    planes = x[:, 0].permute(0, 3, 1, 2)
    if lo[1:] != hi[1:]:
        planes = F.pad(planes, (lo[2], hi[2], lo[1], hi[1]))
        pad = (0, 0)
    else:
        pad = lo[1:]
    unf = F.unfold(
        planes, (r, s_), dilation=geometry.dilation[1:], padding=pad, stride=geometry.stride[1:]
    )  # (N, C x R x S, P x Q), channels slowest
    width = r * s_ * c
    cols = x.new_empty(n, 1, p, q, -(-width // 8) * 8)
    cols[..., :width].view(n, p * q, r * s_, c).copy_(
        unf.view(n, c, r * s_, p * q).permute(0, 3, 2, 1)
    )
    cols[..., width:].zero_()
    return cols


def cases(names=()):
    """(the forward case, the weight-gradient case) of each CASES row (bench names), or those
    named."""
    out = []
    for n, c, hw, k, f, s in CASES:
        fwd = L.conv_case("fwd", n, c, k, (hw, hw), f, s)
        if not names or fwd.name in names:
            out.append((fwd, L.conv_case("wgrad", n, c, k, (hw, hw), f, s)))
    return out


def geometry(case):
    """The case's kernel geometry and output extents (Z, P, Q)."""
    p = case.params
    g = op._geometry(2, p["kernel"], p["stride"], p["padding"], p["dilation"])
    return g, g.output((1, *p["spatial"]))


def _verified(suite, inputs, device) -> bool:
    _, cmps = check.verify(suite, inputs, device)
    for c in cmps:
        if not c.ok:
            print(f"  {suite.name}: WRONG ({c.message})", flush=True)
    return all(c.ok for c in cmps)


def _line(name: str, samples: dict, base: str | None = None, extra: str = "") -> str:
    us = {k: median(v) * 1e3 for k, v in samples.items()}
    parts = [f"{k} {v:8.1f} us" for k, v in us.items()]
    if base is not None:
        parts += [f"{base}/{k} {us[base] / v:.2f}x" for k, v in us.items() if k != base]
    return f"{name:44s} " + "  ".join(parts) + extra


def main(names: list[str]) -> None:
    device = torch.device("cuda")
    gen = torch.Generator(device="cuda").manual_seed(0)
    fsuite, wsuite = conv_fwd.suite(), conv_wgrad.suite()
    for fcase, wcase in cases(names):
        finputs = L.make_inputs(fcase, torch.bfloat16, device, gen)
        winputs = L.make_inputs(wcase, torch.bfloat16, device, gen)
        g, out = geometry(fcase)
        x5, w5 = op._as5d(finputs["x"]), op._as5d(finputs["w"])
        if not launch.few_channels(x5, w5, g):
            print(f"{fcase.name}: not the few-channel path", flush=True)
            continue
        # the im2col alone: the two bitwise, then timed
        cols, one = launch._im2col(x5, g, out)
        torch.cuda.synchronize()
        if not torch.equal(cols, im2col_unfold(x5, g, out)):
            print(f"{fcase.name} im2col: WRONG (the strided copy differs from the unfold)")
            continue
        fns = {
            "unfold": functools.partial(im2col_unfold, x5, g, out),
            "strided": functools.partial(launch._im2col, x5, g, out),
        }
        samples = time_interleaved(fns, reps=10)
        mb = (cols.numel() + x5.numel()) * cols.element_size() / 1e6  # im2col written, x read
        extra = f"  ({mb:.0f} MB: {mb / median(samples['strided']):.0f} GB/s strided)"
        print(_line(f"{fcase.name} im2col", samples, "unfold", extra), flush=True)
        # the forward: ours (im2col + the 1x1 launch), the 1x1 launch alone, cuDNN
        if _verified(fsuite, finputs, device):
            y = L.alloc_out(finputs)
            w_cols = launch._taps_as_channels(w5, cols.shape[-1])
            kernel = functools.partial(
                launch._launch, cols, w_cols, None, op._view5d(y), one, None, False, True
            )
            fns = {
                "cudnn": functools.partial(L.cudnn, finputs),
                "ours": functools.partial(L.run_ours, finputs, y),
                "1x1 alone": kernel,
            }
            print(_line(f"{fcase.name} fwd", time_interleaved(fns, reps=10), "cudnn"), flush=True)
        # the weight gradient: ours, the 1x1 launch alone on the im2col, cuDNN
        if _verified(wsuite, winputs, device):
            dw = L.alloc_out(winputs)
            dy5 = op._as5d(winputs["dy"])
            wcols, _ = launch._im2col(op._as5d(winputs["x"]), g, out)
            dw_cols = dw.new_empty(dw.shape[0], 1, 1, 1, wcols.shape[-1])
            kernel = functools.partial(launch._wgrad_launch, dy5, wcols, dw_cols, one, None)
            fns = {
                "cudnn": functools.partial(L.cudnn, winputs),
                "ours": functools.partial(L.run_ours, winputs, dw),
                "1x1 alone": kernel,
            }
            print(_line(f"{wcase.name} wgrad", time_interleaved(fns, reps=10), "cudnn"), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
