"""Compile the chunked Gated DeltaNet prefill forward against fake tensors: T, H, HV, N and every
outer stride dynamic; K, V, dtype, the state layout, l2norm, the initial state and the V split
baked in. q,
k, v, o: unit last strides, token and head strides multiples of 8 elements, 16-byte aligned
(TMA boxes and 16-byte O stores); g, beta fp32 (T, HV); states fp32 with unit last strides."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.chunked_fwd import GdnChunkedFwdSm90
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.t_pre import GdnTPreSm90


def kernel_for(params: dict) -> GdnChunkedFwdSm90:
    return GdnChunkedFwdSm90(
        params["k"], params["v"], k_last=params["k_last"], l2norm=params["l2norm"],
        initial_state=params["initial_state"], v_split=params.get("v_split", 1),
        t_pre=params.get("t_pre", False), state_lds=params.get("state_lds", False),
        o_warp=params.get("o_warp", False), no_o=params.get("no_o", False),
    )  # fmt: skip


def compile_gdn_prefill(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    t, h, hv, n = (cute.sym_int32() for _ in range(4))
    f32 = cutlass.Float32
    state_shape = (n, hv, vd, kd) if params["k_last"] else (n, hv, kd, vd)
    kernel = kernel_for(params) if kernel is None else kernel

    def gates():
        return make_fake_tensor(f32, (t, hv), stride=(cute.sym_int64(), 1), assumed_align=4)

    return cute.compile(
        kernel,
        fake.rowmajor(dtype, (t, h, kd)),
        fake.rowmajor(dtype, (t, h, kd)),
        fake.rowmajor(dtype, (t, hv, vd)),
        gates(),
        gates(),
        fake.rowmajor(f32, state_shape, divisibility=4) if params["initial_state"] else None,
        fake.offsets(),
        fake.rowmajor(dtype, (t, hv, vd)),
        fake.rowmajor(f32, state_shape, divisibility=4),
        cutlass.Float32(1.0),
        fake.rowmajor(dtype, (cute.sym_int32(), hv, CHUNK)) if params.get("t_pre") else None,
        fake.stream(),
        options=fake.options(arch, extra_options),
    )


def compile_gdn_t_pre(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    """The T precompute (`t_pre.py`): T, H, HV, N, the slot rows and every outer stride
    dynamic; the k dtype, K and l2norm baked in. kernel: a `GdnTPreSm90` to compile, or None."""
    dtype = fake.dtype_of(params["dtype"])
    t, h, hv, rows = (cute.sym_int32() for _ in range(4))
    kernel = GdnTPreSm90(params["k"], l2norm=params["l2norm"]) if kernel is None else kernel

    def gates():
        return make_fake_tensor(cutlass.Float32, (t, hv), stride=(cute.sym_int64(), 1),
                                assumed_align=4)  # fmt: skip

    return cute.compile(
        kernel,
        fake.rowmajor(dtype, (t, h, params["k"])),
        gates(),
        gates(),
        fake.offsets(),
        fake.rowmajor(dtype, (rows, hv, CHUNK)),
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
