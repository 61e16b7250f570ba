"""ncu target: convolution, ours (`forgekernel.conv2d_wgrad` / `conv3d_wgrad` and `conv2d` /
`conv3d`) against cuDNN through torch (benchmark mode, channels-last: the suites' `cudnn`
comparator, `aten.convolution_backward` with one output asked for the weight gradient) on each
suite's worst and median cases (benchmarks/reports/sm_90a/conv_wgrad.md and conv_fwd.md,
2026-12-02 04:29 / 04:27, graph ratios; the eager ratios in parentheses):

  conv_wgrad (median 0.512x, 0.580x eager): the stem n32-c3-224x224-k64-7x7-s2 0.179x (0.182x)
  the worst; n8-c640-32x32-k640-3x3-s2 0.256x (0.291x) the worst past the stem (SD's UNet
  downsampler); n32-c1024-14x14-k2048-1x1-s2 0.512x (0.580x) the median.
  conv_fwd (median 0.802x, 0.828x eager): the stem n32-c3-224x224-k64-7x7-s2 0.257x the worst;
  n4-c128-16x64x64-k128-3x3x3 0.506x the worst past the stem (video VAE, C = K = 128);
  n2-c512-8x64x64-k512-3x3x3 0.808x (0.828x) the median.

    python3 scripts/profile_conv.py [--suite conv_wgrad|conv_fwd] [--which ours|comparator|both]
                                    [--case SUITE:CASE ...]

Kernel-name regexes for KERNELS / `-k regex:` where filtering by name: ours `forgekernel`
(kernel_cutlass_kernel_forgekernelkernels... ConvWgradSm90 / GemmSm90, ConvFpropSm90, plus any
torch kernels ours launches around them), cuDNN on sm90 `xmma|cudnn|conv|wgrad|implicit|nhwc|
cutlass|sm90` (its engines' names vary with the version: read them off the summary);
`spin_kernel` is the segment marker (scripts/profile_suite.py).
"""

from __future__ import annotations

import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

STEM = "n32-c3-224x224-k64-7x7-s2"

TARGET = profile_suite.Target(
    name="conv",
    suites=("conv_wgrad", "conv_fwd"),
    default_cases=(
        f"conv_wgrad:{STEM}",
        "conv_wgrad:n8-c640-32x32-k640-3x3-s2",
        "conv_wgrad:n32-c1024-14x14-k2048-1x1-s2",
        f"conv_fwd:{STEM}",
        "conv_fwd:n4-c128-16x64x64-k128-3x3x3",
        "conv_fwd:n2-c512-8x64x64-k512-3x3x3",
    ),
    comparator={"conv_wgrad": "cudnn", "conv_fwd": "cudnn"},
)

if __name__ == "__main__":
    sys.exit(profile_suite.main(TARGET))
