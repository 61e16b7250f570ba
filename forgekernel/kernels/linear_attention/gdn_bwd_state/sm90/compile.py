"""Compile the Gated DeltaNet backward's reverse state recurrence against fake tensors: B, T, HV,
the chunk count and every outer stride dynamic; K, V, the dtype, the final-state gradient and
whether dke replaces dh (or out16: dU, dh in 16 bits, dh (B, NC, HV, K, V) with its (K, V)
tiles compact) baked in. The 16-bit tiles: unit last strides, the others multiples of
8 elements, 16-byte aligned (TMA); e^(G_C) fp32 (B, NC, HV) unit last stride (channel_decay:
(B, NC, HV, K), TMA-ready: outer strides multiples of 4, 16-byte aligned); the fp32 outputs and
the final-state gradient: unit last strides, others multiples of 4."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.config import CHUNK
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.reverse_state import GdnBwdStateSm90


def kernel_for(params: dict) -> GdnBwdStateSm90:
    return GdnBwdStateSm90(
        params["k"], params["v"], d_final_state=params["d_final_state"], dke=params["dke"],
        channel_decay=params.get("channel_decay", False), out16=params.get("out16", False),
        forward=params.get("forward", False), varlen=params.get("varlen", False),
        fused=params.get("fused", False), w_from_t=params.get("w_from_t", False),
    )  # fmt: skip


def compile_gdn_bwd_state(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, hv, nc = (cute.sym_int32() for _ in range(4))
    varlen = params.get("varlen", False)
    n = cute.sym_int32() if varlen else b  # the states' sequences (varlen: N, the tiles' B = 1)
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel
    dke = params["dke"]
    out16 = params.get("out16", False)
    out = dtype if out16 else f32  # dU, dh: 16-bit with out16

    def side():
        if not out16:
            return fake.rowmajor(f32, (b, nc, hv, vd, kd), divisibility=4)
        # 16-bit dS (K, V) tiles compact (static strides): the transposed fragment's 2-byte
        # stores take immediate offsets (dynamic ones spilled a register without a final state)
        outer = tuple(cute.sym_int64(divisibility=8) for _ in range(3))
        return make_fake_tensor(dtype, (b, nc, hv, kd, vd), stride=(*outer, vd, 1),
                                assumed_align=16)  # fmt: skip

    def state():
        return fake.rowmajor(f32, (n, hv, kd, vd), divisibility=4)

    if params.get("channel_decay", False):
        e_last = fake.rowmajor(f32, (b, nc, hv, kd), divisibility=4)
    else:
        e_last = make_fake_tensor(
            f32, (b, nc, hv), stride=(cute.sym_int64(), cute.sym_int64(), 1), assumed_align=4
        )
    fw = params.get("forward", False)  # P^T and Qe not passed (I and 0 built in)
    fused = params.get("fused", False)  # the W slot: k (its own rows, H heads); G; no dU
    w_tile = fake.rowmajor(dtype, (b, t, hv, kd))
    if fused:
        w_tile = fake.rowmajor(dtype, (b, cute.sym_int32(), cute.sym_int32(), kd))
    w_from_t = params.get("w_from_t", False)  # dO's slot v, P^T's T^T, Ke's none; beta
    g_rows = cute.sym_int32() if w_from_t else t  # G: NC C rows, v: T
    return cute.compile(
        kernel,
        fake.rowmajor(dtype, (b, t, hv, vd)),
        None if fw and not w_from_t else fake.rowmajor(dtype, (b, t, hv, CHUNK)),
        None if w_from_t else fake.rowmajor(dtype, (b, t, hv, kd)),
        None if fw else fake.rowmajor(dtype, (b, t, hv, kd)),
        w_tile,
        fake.rowmajor(dtype, (b, t, hv, vd)) if dke else None,
        e_last,
        state() if params["d_final_state"] else None,
        None if fused else fake.rowmajor(out, (b, t, hv, vd), divisibility=4),
        None if dke else side(),
        fake.rowmajor(f32, (b, t, hv, kd), divisibility=4) if dke else None,
        state(),
        fake.offsets() if varlen else None,
        make_fake_tensor(cutlass.Int32, (n,), stride=(1,), assumed_align=4) if varlen else None,
        fake.rowmajor(f32, (b, g_rows, hv), divisibility=1, align=4) if fused else None,
        fake.rowmajor(f32, (b, t, hv), divisibility=1, align=4) if w_from_t else None,
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
