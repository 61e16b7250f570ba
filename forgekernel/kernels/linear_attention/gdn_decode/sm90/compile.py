"""Compile the gated delta rule step against fake tensors: B, H, HV, the pool size and every
outer stride dynamic; K, V, dtype and the layout flags baked in (the state's unit stride
static, so that a thread's entries of a k-last state load 16 bytes at a time). A k-last key
with `tokens` compiles the row-streaming kernel (step_rows.py, T baked in); otherwise the staged
kernel (step.py, T dynamic: the k-first layout)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_decode.sm90.step import GdnStepSm90
from forgekernel.kernels.linear_attention.gdn_decode.sm90.step_rows import GdnStepRowsSm90


def _tensor(dtype, shape, unit: int, align: int = 16, divisibility: int = 4):
    """`shape` with mode `unit` of stride 1 and every other stride dynamic (multiples of
    `divisibility` elements: 4 gives 16-byte rows for fp32, 8 bytes for 16-bit). TVM-FFI checks
    the divisibility at every call (a ValueError otherwise)."""
    stride = tuple(
        1 if i == unit else cute.sym_int64(divisibility=divisibility) for i in range(len(shape))
    )
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def _planes(shape):
    """fp32 `shape` (..., HV, V, K) whose last three modes are compact (strides V K, K, 1: a
    warp's rows at constant offsets from one address, a head's plane at hv V K), the outer
    strides dynamic."""
    v, k = shape[-2:]
    outer = tuple(cute.sym_int64(divisibility=4) for _ in shape[:-3])
    stride = (*outer, v * k, k, 1)
    return make_fake_tensor(cutlass.Float32, shape, stride=stride, assumed_align=16)


def compile_gdn_step(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, h, hv, n = (cute.sym_int32() for _ in range(5))
    f32 = cutlass.Float32
    state_shape = (n, hv, vd, kd) if params["k_last"] else (n, hv, kd, vd)
    inter_shape = (n, t, hv, *state_shape[2:])
    g_shape = (b, t, hv, kd) if params["per_channel"] else (b, t, hv)
    gating = params.get("gating", False)
    tokens, pool = params.get("tokens"), params.get("pool", True)
    flags = {
        "per_channel": params["per_channel"], "l2norm": params["l2norm"],
        "intermediate": params["intermediate"], "gating": gating,
        "update_state": params.get("update_state", True),
    }  # fmt: skip
    if tokens is not None:
        if not params["k_last"]:
            raise ValueError("the row-streaming kernel (tokens in the key) is k-last only")
        rows = {"rows_per_warp": params["rows_per_warp"]} if "rows_per_warp" in params else {}
        kernel = GdnStepRowsSm90(kd, vd, tokens=tokens, pool=pool, **rows, **flags)
    else:
        if not pool:
            raise ValueError("the staged kernel reads the state rows from an index tensor")
        kernel = GdnStepSm90(kd, vd, k_last=params["k_last"], **flags)
    gate_dtype, gate_align = (dtype, 2) if gating else (f32, 4)
    per_head = (_tensor(f32, (hv,), 0, 4), _tensor(f32, (hv,), 0, 4)) if gating else (None, None)
    state = _planes if tokens is not None else (lambda shape: _tensor(f32, shape, len(shape) - 1))
    return cute.compile(
        kernel,
        _tensor(dtype, (b, t, h, kd), 3, 8),
        _tensor(dtype, (b, t, h, kd), 3, 8),
        _tensor(dtype, (b, t, hv, vd), 3, 2),
        # per key channel the rows kernel reads a lane's 4 decays in one 16-byte load; the
        # per-head scalars (g, beta, or a, b) are single loads: strides (T HV, HV, 1) of any HV
        _tensor(
            gate_dtype,
            g_shape,
            len(g_shape) - 1,
            16 if params["per_channel"] and tokens is not None else gate_align,
            4 if params["per_channel"] else 1,
        ),
        _tensor(gate_dtype, (b, t, hv), 2, gate_align, 1),
        state(state_shape),
        make_fake_tensor(cutlass.Int32, (b,), stride=(1,)) if pool else None,
        _tensor(dtype, (b, t, hv, vd), 3, 2),
        state(inter_shape) if params["intermediate"] else None,
        *per_head,
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
