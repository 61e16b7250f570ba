"""Compile the gated delta rule step against fake tensors: B, T, H, HV, the pool size and
every outer stride dynamic; K, V, dtype and the layout flags baked in (the state's unit
stride static, so that a thread's rows of a k-last state load 16 bytes at a time)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_decode.sm90.step import GdnStepSm90


def _tensor(dtype, shape, unit: int, align: int = 16):
    """`shape` with mode `unit` of stride 1 and every other stride dynamic (multiples of 4
    elements: 16-byte rows for fp32, 8 bytes for 16-bit)."""
    stride = tuple(1 if i == unit else cute.sym_int64(divisibility=4) for i in range(len(shape)))
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_gdn_step(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, h, hv, n = (cute.sym_int32() for _ in range(5))
    f32 = cutlass.Float32
    state_shape = (n, hv, vd, kd) if params["k_last"] else (n, hv, kd, vd)
    inter_shape = (n, t, hv, *state_shape[2:])
    g_shape = (b, t, hv, kd) if params["per_channel"] else (b, t, hv)
    gating = params.get("gating", False)
    kernel = GdnStepSm90(
        kd, vd, per_channel=params["per_channel"], k_last=params["k_last"],
        l2norm=params["l2norm"], intermediate=params["intermediate"], gating=gating,
        update_state=params.get("update_state", True),
    )  # fmt: skip
    gate_dtype, gate_align = (dtype, 2) if gating else (f32, 4)
    per_head = (_tensor(f32, (hv,), 0, 4), _tensor(f32, (hv,), 0, 4)) if gating else (None, None)
    return cute.compile(
        kernel,
        _tensor(dtype, (b, t, h, kd), 3, 8),
        _tensor(dtype, (b, t, h, kd), 3, 8),
        _tensor(dtype, (b, t, hv, vd), 3, 2),
        _tensor(gate_dtype, g_shape, len(g_shape) - 1, gate_align),
        _tensor(gate_dtype, (b, t, hv), 2, gate_align),
        _tensor(f32, state_shape, 3),
        make_fake_tensor(cutlass.Int32, (b,), stride=(1,)),
        _tensor(dtype, (b, t, hv, vd), 3, 2),
        _tensor(f32, inter_shape, 4) if params["intermediate"] else None,
        *per_head,
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
