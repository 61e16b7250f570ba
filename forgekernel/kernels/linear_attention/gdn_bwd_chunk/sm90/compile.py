"""Compile the Gated DeltaNet backward's kernel 2 (chunk-parallel pass 3) against fake tensors:
B, T, HV, the chunk count and every outer stride dynamic; K, V, the dtype and whether the WY half
runs too (`wy`) baked in; `grouped`: q, k with their own head count H (HV / H value heads
share one). The 16-bit tiles: unit last strides, the others multiples of 8
elements, 16-byte aligned (TMA); G, beta fp32 (B, T, HV) unit last stride; the fp32 outputs unit
last strides (dqk16: dq, dk 16-bit); the scale a runtime fp32."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.common.sm90 import fake
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import GdnBwdChunkSm90


def kernel_for(params: dict) -> GdnBwdChunkSm90:
    return GdnBwdChunkSm90(params["k"], params["v"], wy=params["wy"],
                           grouped=params.get("grouped", False),
                           fsplit=params.get("fsplit", False),
                           token_rows=params.get("token_rows", False))  # fmt: skip


def compile_gdn_bwd_chunk(params: dict, arch: str = "sm_90a", extra_options: str = "", kernel=None):
    """kernel: a `kernel_for(params)` object to compile (its shared_storage is set by the
    compile: the tests read its size), or None for a fresh one."""
    dtype = fake.dtype_of(params["dtype"])
    kd, vd = params["k"], params["v"]
    b, t, hv, nc = (cute.sym_int32() for _ in range(4))
    f32 = cutlass.Float32
    kernel = kernel_for(params) if kernel is None else kernel
    wy = params["wy"]
    # dqk16: dq, dk in the tiles' dtype (16-byte aligned rows: 8 elements)
    qk_out = (dtype, 8) if params.get("dqk16", False) else (f32, 4)
    # token_rows: the outputs at their own token count T' (the slot layout's inputs: T = S C)
    # and the per-slot tables (first token, valid rows), int32 (NC,)
    token_rows = params.get("token_rows", False)
    t_out = cute.sym_int32() if token_rows else t
    tables = (fake.rowmajor(cutlass.Int32, (nc,), divisibility=1, align=4),) * 2

    def tok(d):
        return fake.rowmajor(dtype, (b, t, hv, d))

    # grouped: q, k (B, T, H, K), value head hv reading head hv // (HV / H)
    h = cute.sym_int32() if params.get("grouped", False) else hv

    def qk():
        return fake.rowmajor(dtype, (b, t, h, kd))

    def vec(rows=t):
        return fake.rowmajor(f32, (b, rows, hv), divisibility=1, align=4)

    return cute.compile(
        kernel,
        tok(vd), tok(vd), tok(vd), qk(), qk(),
        fake.rowmajor(dtype, (b, nc, hv, kd, vd)),
        fake.rowmajor(dtype, (b, nc, hv, kd, vd)),
        vec(),
        fake.rowmajor(qk_out[0], (b, t_out, hv, kd), divisibility=qk_out[1]),
        fake.rowmajor(qk_out[0], (b, t_out, hv, kd), divisibility=qk_out[1]),
        None if wy else fake.rowmajor(f32, (b, t, hv, kd), divisibility=4),
        vec(t_out),
        *((tok(64), tok(kd), tok(vd), tok(vd), vec(),
           fake.rowmajor(dtype if params.get("dv16", False) else f32, (b, t_out, hv, vd),
                         divisibility=4), vec(t_out)) if wy else (None,) * 7),
        *(tables if token_rows else (None, None)),
        f32(1.0),  # scale: dqk16's dq
        fake.stream(),
        options=fake.options(arch, extra_options),
    )  # fmt: skip
