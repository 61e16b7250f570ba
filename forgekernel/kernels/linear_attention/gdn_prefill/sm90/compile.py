"""Compile the Gated DeltaNet prefill forward against fake tensors: T, H, HV, N and every outer
stride dynamic; K, V, dtype, the state layout, l2norm and the initial state baked in (unit last
strides static: a lane's rows of a state column or of q / k load 8 or 16 bytes at a time)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.recurrent_fwd import (
    GdnRecurrentFwdSm90,
)


def _tensor(dtype, shape, align: int = 16):
    """`shape` with a unit last stride, the others dynamic multiples of 4 elements."""
    stride = (*(cute.sym_int64(divisibility=4) for _ in shape[:-1]), 1)
    return make_fake_tensor(dtype, shape, stride=stride, assumed_align=align)


def compile_gdn_prefill(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    t, h, hv, n = (cute.sym_int32() for _ in range(4))
    f32 = cutlass.Float32
    state_shape = (n, hv, vd, kd) if params["k_last"] else (n, hv, kd, vd)
    kernel = GdnRecurrentFwdSm90(
        kd, vd, k_last=params["k_last"], l2norm=params["l2norm"],
        initial_state=params["initial_state"],
    )  # fmt: skip
    gates = make_fake_tensor(f32, (t, hv), stride=(cute.sym_int64(), 1), assumed_align=4)
    return cute.compile(
        kernel,
        _tensor(dtype, (t, h, kd), 8),
        _tensor(dtype, (t, h, kd), 8),
        _tensor(dtype, (t, hv, vd), 2),
        gates,
        make_fake_tensor(f32, (t, hv), stride=(cute.sym_int64(), 1), assumed_align=4),
        _tensor(f32, state_shape) if params["initial_state"] else None,
        fake.offsets(),
        _tensor(dtype, (t, hv, vd), 2),
        _tensor(f32, state_shape),
        cutlass.Float32(1.0),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
