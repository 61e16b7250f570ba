"""Compile the DSA sparse backward preprocess against fake tensors: tokens, H and every outer
stride dynamic (out / dO rows 16-byte aligned; lse, dlse and the outputs any strides, the sink
any stride); the dtype, the sink and dLSE given or not baked in."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass.cute.runtime import make_fake_tensor

from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.config import D_V
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.kernel import DsaSparseBwdPreSm90
from forgekernel.kernels.common.sm90 import fake


def compile_pre(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    sink, dlse = bool(params["sink"]), bool(params["dlse"])
    tokens, heads = cute.sym_int32(), cute.sym_int32()

    def per_head():
        strides = (cute.sym_int64(), cute.sym_int64())
        return make_fake_tensor(cutlass.Float32, (tokens, heads), stride=strides, assumed_align=4)

    sink_t = None
    if sink:
        sink_t = make_fake_tensor(cutlass.Float32, (heads,), stride=(cute.sym_int64(),),
                                  assumed_align=4)  # fmt: skip
    return cute.compile(
        DsaSparseBwdPreSm90(sink, dlse),
        fake.rowmajor(dtype, (tokens, heads, D_V)),
        fake.rowmajor(dtype, (tokens, heads, D_V)),
        per_head(),
        per_head() if dlse else None,
        sink_t,
        per_head(),
        per_head(),
        per_head() if sink else None,
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
