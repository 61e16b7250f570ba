"""What the convolution suites (conv_fwd, conv_dgrad, conv_wgrad; issue 23) share: the case
form, the layer tables they sample, inputs, outputs, the references and the cuDNN comparator.

A case's params: op ("fwd", "dgrad" or "wgrad"), n, c (input channels), k (output channels),
spatial ((H, W) or (D, H, W)), kernel ((R, S) or (T, R, S)), stride, padding, dilation (one
per spatial dim, symmetric padding), bias (forward only) and the model layer it comes from.
Every operand is random (never zeros) and channels-last, as the kernels and cuDNN's fastest
algorithms read them.

FLOPs count the convolution's useful multiply-adds, 2 x N x K x C x output pixels x taps, for
all three ops (a stride-2 data gradient computes no more: its phases skip the inserted zeros);
bytes count each operand and the result once.

Comparator: cuDNN through torch, channels-last, `torch.backends.cudnn.benchmark = True` (so
that cuDNN times its algorithms once per shape and runs its fastest), in the same process; the
data and weight gradients through `aten.convolution_backward` with one output asked for, given
a channels-last placeholder of the operand it does not read (its shape and layout pick the
algorithm).
"""

from __future__ import annotations

import importlib
import math
import sys
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F

from forgekernel.bench.suite import Case, Inputs, OpSuite

OPS = ("fwd", "dgrad", "wgrad")


def _per_dim(value, dims: int) -> tuple[int, ...]:
    return (value,) * dims if isinstance(value, int) else tuple(value)


def _tag(tag: str, value: tuple[int, ...], plain: tuple[int, ...]) -> str:
    """A name suffix for a geometry value other than the plain one ("-s2", "-p0x1x1")."""
    if value == plain:
        return ""
    return f"-{tag}{value[0] if len(set(value)) == 1 else 'x'.join(map(str, value))}"


def conv_case(
    op: str,
    n: int,
    c: int,
    k: int,
    spatial: Sequence[int],
    kernel: int | Sequence[int] = 3,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | None = None,
    dilation: int | Sequence[int] = 1,
    *,
    bias: bool = False,
    group: str = "",
    source: str = "",
) -> Case:
    """One convolution problem; padding defaults to dilation x (kernel - 1) / 2 per dim (the
    size-keeping padding of an odd kernel, 0 for 1x1 and even kernels' floor)."""
    if op not in OPS:
        raise ValueError(f"op must be one of {OPS}, got {op!r}")
    dims = len(spatial)
    kernel, stride, dilation = (_per_dim(v, dims) for v in (kernel, stride, dilation))
    same = tuple(d * (f - 1) // 2 for d, f in zip(dilation, kernel))
    padding = same if padding is None else _per_dim(padding, dims)
    name = f"n{n}-c{c}-{'x'.join(map(str, spatial))}-k{k}-{'x'.join(map(str, kernel))}"
    name += _tag("s", stride, (1,) * dims) + _tag("p", padding, same)
    name += _tag("d", dilation, (1,) * dims)
    name += "-bias" if bias else ""
    params = {
        "op": op,
        "n": n,
        "c": c,
        "k": k,
        "spatial": tuple(spatial),
        "kernel": kernel,
        "stride": stride,
        "padding": padding,
        "dilation": dilation,
        "bias": bias,
        **({"source": source} if source else {}),
    }
    return Case(name, params, group)


def output_spatial(p: dict) -> tuple[int, ...]:
    return tuple(
        (i + 2 * pad - d * (f - 1) - 1) // s + 1
        for i, f, s, pad, d in zip(p["spatial"], p["kernel"], p["stride"], p["padding"],
                                   p["dilation"])
    )  # fmt: skip


def shapes(p: dict) -> dict[str, tuple[int, ...]]:
    """x, w, y shapes in torch's (N, C, *spatial) order."""
    return {
        "x": (p["n"], p["c"], *p["spatial"]),
        "w": (p["k"], p["c"], *p["kernel"]),
        "y": (p["n"], p["k"], *output_spatial(p)),
    }


def _memory_format(dims: int) -> torch.memory_format:
    return torch.channels_last if dims == 2 else torch.channels_last_3d


def _randn_channels_last(shape, dtype, device, gen) -> torch.Tensor:
    """randn of (N, C, *spatial) drawn straight into channels-last memory (no copy)."""
    dims = len(shape) - 2
    t = torch.randn(shape[0], *shape[2:], shape[1], dtype=dtype, device=device, generator=gen)
    return t.permute(0, dims + 1, *range(1, dims + 1))


def empty_channels_last(shape, dtype, device) -> torch.Tensor:
    return torch.empty(
        shape, dtype=dtype, device=device, memory_format=_memory_format(len(shape) - 2)
    )


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen) -> Inputs:
    """fwd: x, w (and bias); dgrad: dy, w; wgrad: dy, x; plus the case's params."""
    p = dict(case.params)
    s = shapes(p)
    inputs: Inputs = {"params": p}
    if p["op"] in ("fwd", "wgrad"):
        inputs["x"] = _randn_channels_last(s["x"], dtype, device, gen)
    if p["op"] in ("fwd", "dgrad"):
        inputs["w"] = _randn_channels_last(s["w"], dtype, device, gen)
    if p["op"] in ("dgrad", "wgrad"):
        inputs["dy"] = _randn_channels_last(s["y"], dtype, device, gen)
    if p["op"] == "fwd" and p["bias"]:
        inputs["bias"] = torch.randn(p["k"], dtype=dtype, device=device, generator=gen)
    return inputs


def _result(inputs: Inputs) -> str:
    return {"fwd": "y", "dgrad": "x", "wgrad": "w"}[inputs["params"]["op"]]


def _like(inputs: Inputs) -> torch.Tensor:
    return next(inputs[n] for n in ("x", "w", "dy") if n in inputs)


def alloc_out(inputs: Inputs) -> torch.Tensor:
    """The result (y, dx or dw) in channels-last memory: what ours writes in place."""
    like = _like(inputs)
    return empty_channels_last(shapes(inputs["params"])[_result(inputs)], like.dtype, like.device)


def _geometry(p: dict) -> dict[str, Any]:
    return {"stride": p["stride"], "padding": p["padding"], "dilation": p["dilation"]}


def _conv_ops():
    """forgekernel.ops.conv, imported on first use (listing the suites imports no kernels);
    after that a dict lookup: `run_ours` is what the bench's host time per call times."""
    return sys.modules.get("forgekernel.ops.conv") or importlib.import_module(
        "forgekernel.ops.conv"
    )


def run_ours(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    op = _conv_ops()
    p = inputs["params"]
    d = len(p["spatial"])
    g = {"stride": p["stride"], "padding": p["padding"], "dilation": p["dilation"]}
    if p["op"] == "fwd":
        fn = op.conv2d if d == 2 else op.conv3d
        return fn(inputs["x"], inputs["w"], inputs.get("bias"), **g, out=out)
    if p["op"] == "dgrad":
        fn = op.conv2d_dgrad if d == 2 else op.conv3d_dgrad
        return fn(inputs["dy"], inputs["w"], (p["n"], p["c"], *p["spatial"]), **g, out=out)
    fn = op.conv2d_wgrad if d == 2 else op.conv3d_wgrad
    return fn(inputs["dy"], inputs["x"], (p["k"], p["c"], *p["kernel"]), **g, out=out)


def run_no_pdl(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with its kernels built and launched without programmatic dependent launch
    (runtime/pdl.py `off`; compiled on first use): the suites' `no_pdl` variant, ours / this
    time is what PDL saves (docs/gemm/NOTES.md "Programmatic dependent launch")."""
    from forgekernel.runtime import pdl

    with pdl.off():
        return run_ours(inputs, out)


def run_pdl_late(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with its kernels' PDL trigger after each CTA's last mainloop (runtime/pdl.py
    `late`; compiled on first use): the suites' `pdl_late` variant, beside `no_pdl` (docs/conv/
    NOTES.md "The late trigger")."""
    from forgekernel.runtime import pdl

    with pdl.late():
        return run_ours(inputs, out)


def stem_variants(case: Case) -> dict[str, Any]:
    """On the cases the stem fold takes (kernels/conv/sm90/stem.py `fits`: 2-D, C <= 8, stride
    2, several taps; ResNet's C = 3 7x7), which the launcher runs as the stride-1 R' x 1
    convolution of 64 channels over the fold kernel's fold of x, read through an overlapping
    view: `stem_copy`, a compact copy of that view (the fallback if TMA refuses the view), and
    `im2col`, the path before the fold (a 1x1 convolution over the explicit im2col).
    docs/conv/NOTES.md, "The stem as its own kernel"."""
    p = case.params
    if p["op"] == "dgrad" or len(p["spatial"]) != 2:
        return {}
    from forgekernel.kernels.conv.sm90 import stem

    x = torch.empty(p["n"], 1, *p["spatial"], p["c"], device="meta")
    w = torch.empty(p["k"], 1, *p["kernel"], p["c"], device="meta")
    if not stem.fits(x, w, _stem_geometry(p)):
        return {}
    return {"stem_copy": run_stem_copy, "im2col": run_im2col}


def run_im2col(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours on the stem's explicit im2col (`stem_variants`), into `out` as run_ours writes it."""
    from forgekernel.kernels.conv.sm90 import launch

    op, p = _conv_ops(), inputs["params"]
    res = alloc_out(inputs) if out is None else out
    g = _stem_geometry(p)
    if p["op"] == "fwd":
        x, w = op._as5d(inputs["x"]), op._as5d(inputs["w"])
        launch.fprop_im2col(x, w, inputs.get("bias"), op._view5d(res), g)
    else:
        launch.wgrad_im2col(op._as5d(inputs["dy"]), op._as5d(inputs["x"]), op._view5d(res), g)
    return res


def _stem_geometry(p: dict):
    return _conv_ops()._geometry(2, p["kernel"], p["stride"], p["padding"], p["dilation"])


def run_stem(
    inputs: Inputs, out: torch.Tensor | None, overlap: bool = True, kernel: bool = False
) -> torch.Tensor:
    """Ours through the stem fold (`stem_variants`), into `out` as run_ours writes it."""
    from forgekernel.kernels.conv.sm90 import stem

    op, p = _conv_ops(), inputs["params"]
    res = alloc_out(inputs) if out is None else out
    g = _stem_geometry(p)
    if p["op"] == "fwd":
        x, w = op._as5d(inputs["x"]), op._as5d(inputs["w"])
        stem.fprop(x, w, inputs.get("bias"), op._view5d(res), g, overlap, kernel=kernel)
    else:
        dy, x = op._as5d(inputs["dy"]), op._as5d(inputs["x"])
        stem.wgrad(dy, x, op._view5d(res), g, overlap, kernel=kernel)
    return res


def run_stem_copy(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    return run_stem(inputs, out, overlap=False)


def run_stem_fold(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    return run_stem(inputs, out, kernel=True)


def gemm_variants(case: Case) -> dict[str, Any]:
    """`as_gemm` on the forward and data gradient of an unpadded stride-1 1x1 without bias,
    channels multiples of 8: the dense GEMM on views of the same tensors (kernels/conv/sm90/
    launch.py `as_gemm`; its adoption rule there, `ONE_BY_ONE_AS_GEMM`). None on the weight
    gradient: dw = dy^T x reduces over the pixels, along which neither dy nor x is contiguous,
    and the GEMM takes A K-major only (a copy of dy or x would cost more than the gap)."""
    p = case.params
    one = all(v == 1 for v in (*p["kernel"], *p["stride"])) and not any(p["padding"])
    if p["op"] == "wgrad" or not one or p["bias"] or p["c"] % 8 or p["k"] % 8:
        return {}
    return {"as_gemm": run_as_gemm}


def split_plan(cfg, per_split: int, rect: int = 0):
    """A forward / data-gradient-mode launch of tile `cfg` handed to the launcher as a
    SplitPlan (a bench variant's plan): split (`cfg`'s split variant) at `per_split` k-tiles a
    part where `per_split` > 0, unsplit otherwise; on the im2col walk, or rectangles `rect`
    wide. The launcher recounts the parts and tiles for its problem."""
    from forgekernel.kernels.conv.sm90.config import SplitPlan

    return SplitPlan(replace(cfg, split=per_split > 0), max(per_split, 1), 0, 0, rect)


def run_as_gemm(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours through the dense GEMM (`gemm_variants`), into `out` as run_ours writes it."""
    from forgekernel.kernels.conv.sm90 import launch

    op, p = _conv_ops(), inputs["params"]
    res = alloc_out(inputs) if out is None else out
    dims = len(p["spatial"])
    g = op._geometry(dims, p["kernel"], p["stride"], p["padding"], p["dilation"])
    a, w = op._as5d(inputs["x" if p["op"] == "fwd" else "dy"]), op._as5d(inputs["w"])
    if not launch.as_gemm(a, w, op._view5d(res), g, dgrad=p["op"] == "dgrad"):
        raise ValueError(f"{p}: not a 1x1 the dense GEMM takes without a copy")
    return res


def reference(inputs: Inputs) -> torch.Tensor:
    """fp64 reference, returned as fp32 (forgekernel.reference.conv)."""
    ref = importlib.import_module("forgekernel.reference.conv")
    p = inputs["params"]
    s, g = shapes(p), _geometry(p)
    if p["op"] == "fwd":
        return ref.conv_ref(inputs["x"], inputs["w"], inputs.get("bias"), **g)
    if p["op"] == "dgrad":
        return ref.conv_dgrad_ref(inputs["dy"], inputs["w"], s["x"], **g)
    return ref.conv_wgrad_ref(inputs["dy"], inputs["x"], s["w"], **g)


def _placeholder(inputs: Inputs, name: str) -> torch.Tensor:
    """A channels-last tensor of operand `name`'s shape that the gradient never reads, made
    once per input set (its shape and layout select cuDNN's algorithm)."""
    key = f"{name}_placeholder"
    if key not in inputs:
        like = _like(inputs)
        shape = shapes(inputs["params"])[name]
        inputs[key] = empty_channels_last(shape, like.dtype, like.device)
    return inputs[key]


def torch_conv(inputs: Inputs) -> torch.Tensor:
    """The same op by PyTorch in the input dtype (cuDNN on a GPU)."""
    p = inputs["params"]
    d = len(p["spatial"])
    g = _geometry(p)
    if p["op"] == "fwd":
        conv = F.conv2d if d == 2 else F.conv3d
        return conv(inputs["x"], inputs["w"], inputs.get("bias"), **g)
    grads = torch.ops.aten.convolution_backward(
        inputs["dy"],
        inputs["x"] if "x" in inputs else _placeholder(inputs, "x"),
        inputs["w"] if "w" in inputs else _placeholder(inputs, "w"),
        None,
        list(g["stride"]),
        list(g["padding"]),
        list(g["dilation"]),
        False,
        [0] * d,
        1,
        [p["op"] == "dgrad", p["op"] == "wgrad", False],
    )
    return grads[0] if p["op"] == "dgrad" else grads[1]


def cudnn(inputs: Inputs) -> torch.Tensor:
    """cuDNN at its fastest: benchmark mode (the warm-up calls find each shape's algorithm
    before anything is timed), channels-last operands, TF32 irrelevant (16-bit)."""
    with torch.backends.cudnn.flags(enabled=True, benchmark=True, deterministic=False):
        return torch_conv(inputs)


def comparators() -> dict[str, Any]:
    return {"cudnn": cudnn if torch.cuda.is_available() else None}


def flops(case: Case) -> float:
    p = case.params
    out = output_spatial(p)
    return 2.0 * p["n"] * p["k"] * p["c"] * math.prod(out) * math.prod(p["kernel"])


def nbytes(case: Case, dtype: torch.dtype) -> float:
    elem = torch.empty((), dtype=dtype).element_size()
    s = shapes(case.params)
    return float(sum(math.prod(v) for v in s.values()) * elem)


# ---------------------------------------------------------------- the layers the suites sample
# ResNet-50 at 224 x 224 (torchvision v1.5: the stride sits in each stage's first 3x3):
# (C, K, input H = W, kernel, stride, layer). Each stage's later blocks repeat its block 1.
RESNET50 = (
    (3, 64, 224, 7, 2, "conv1"),
    (64, 64, 56, 1, 1, "layer1.0.conv1"),
    (64, 64, 56, 3, 1, "layer1.0.conv2"),
    (64, 256, 56, 1, 1, "layer1.0.conv3"),
    (256, 64, 56, 1, 1, "layer1.1.conv1"),
    (256, 128, 56, 1, 1, "layer2.0.conv1"),
    (128, 128, 56, 3, 2, "layer2.0.conv2"),
    (128, 512, 28, 1, 1, "layer2.0.conv3"),
    (256, 512, 56, 1, 2, "layer2.0.downsample"),
    (512, 128, 28, 1, 1, "layer2.1.conv1"),
    (128, 128, 28, 3, 1, "layer2.1.conv2"),
    (512, 256, 28, 1, 1, "layer3.0.conv1"),
    (256, 256, 28, 3, 2, "layer3.0.conv2"),
    (256, 1024, 14, 1, 1, "layer3.0.conv3"),
    (512, 1024, 28, 1, 2, "layer3.0.downsample"),
    (1024, 256, 14, 1, 1, "layer3.1.conv1"),
    (256, 256, 14, 3, 1, "layer3.1.conv2"),
    (1024, 512, 14, 1, 1, "layer4.0.conv1"),
    (512, 512, 14, 3, 2, "layer4.0.conv2"),
    (512, 2048, 7, 1, 1, "layer4.0.conv3"),
    (1024, 2048, 14, 1, 2, "layer4.0.downsample"),
    (2048, 512, 7, 1, 1, "layer4.1.conv1"),
    (512, 512, 7, 3, 1, "layer4.1.conv2"),
)
# ConvNeXt-T's downsampling layers between stages: 2x2, stride 2 (C, K, input H = W).
CONVNEXT_DOWNSAMPLE = ((96, 192, 56), (192, 384, 28), (384, 768, 14))
# Stable Diffusion's UNet encoder downsamplers at 512 px (64 x 64 latents): 3x3, stride 2,
# C -> C (C, input H = W).
SD_UNET_DOWNSAMPLE = ((320, 64), (640, 32), (1280, 16))
# Stable Diffusion's VAE decoder, the 3x3 convolutions of each resolution (C, K, H = W).
SD_VAE_DECODER = (
    (512, 512, 64),
    (512, 512, 128),
    (512, 256, 256),
    (256, 256, 256),
    (256, 128, 512),
    (128, 128, 512),
)
# Video VAE / 3-D UNet layers (CogVideoX / HunyuanVideo class): (N, C, K, (T, H, W), kernel).
VIDEO_VAE = (
    (4, 128, 128, (16, 64, 64), (3, 3, 3)),
    (1, 128, 128, (16, 128, 128), (3, 3, 3)),
    (2, 128, 256, (8, 64, 64), (3, 3, 3)),
    (2, 256, 256, (8, 64, 64), (3, 3, 3)),
    (2, 256, 512, (4, 32, 32), (3, 3, 3)),
    (2, 512, 512, (4, 32, 32), (3, 3, 3)),
    (1, 512, 512, (8, 32, 32), (3, 3, 3)),
    (2, 512, 512, (8, 64, 64), (3, 3, 3)),
    (1, 128, 128, (16, 128, 128), (1, 3, 3)),
    (2, 256, 256, (8, 64, 64), (1, 3, 3)),
    (2, 512, 512, (4, 32, 32), (1, 3, 3)),
)


def resnet50(op: str, n: int, which, group: str) -> tuple[Case, ...]:
    """ResNet-50's layers chosen by which(C, K, H, kernel, stride) at batch n."""
    return tuple(
        conv_case(op, n, c, k, (hw, hw), f, s, group=group, source=f"resnet50.{layer}")
        for c, k, hw, f, s, layer in RESNET50
        if which(c, k, hw, f, s)
    )


def stride2_layers(op: str, group: str) -> tuple[Case, ...]:
    """The stride-2 downsampling layers of ResNet-50 (3x3 and 1x1, batch 32), ConvNeXt-T (2x2,
    batch 32) and SD's UNet encoder (3x3, batch 8)."""
    resnet = resnet50(op, 32, lambda c, k, hw, f, s: s == 2 and c > 3, group)
    convnext = tuple(
        conv_case(op, 32, c, k, (hw, hw), 2, 2, 0, group=group, source=f"convnext_t.down{i}")
        for i, (c, k, hw) in enumerate(CONVNEXT_DOWNSAMPLE)
    )
    unet = tuple(
        conv_case(op, 8, c, c, (hw, hw), 3, 2, group=group, source=f"sd_unet.down{i}")
        for i, (c, hw) in enumerate(SD_UNET_DOWNSAMPLE)
    )
    return resnet + convnext + unet


def sd_vae_decoder(op: str, n: int, group: str) -> tuple[Case, ...]:
    return tuple(
        conv_case(op, n, c, k, (hw, hw), 3, group=group, source=f"sd_vae.decoder.{hw}")
        for c, k, hw in SD_VAE_DECODER
    )


def unique(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """First occurrence of each name wins."""
    seen: dict[str, Case] = {}
    for c in cases:
        seen.setdefault(c.name, c)
    return tuple(seen.values())


def conv_suite(
    name: str, kernel_sources, check_cases, bench_cases, sanitize_cases, variants=None
) -> OpSuite:
    """The convolution suites' common form: one of fwd / dgrad / wgrad (the case's `op`), the
    parts above, cuDNN as comparator; `variants`: the suite's other modes of ours (OpSuite)."""
    return OpSuite(
        name=name,
        kernel_sources=kernel_sources,
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=check_cases,
        bench_cases=bench_cases,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=torch_conv,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        atol=1e-3,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=sanitize_cases,
        variants=variants,
    )
