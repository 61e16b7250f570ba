"""Compile the sm90 attention forward against fake tensors: batch, lengths, heads, pages, the
page size and every stride but the innermost are dynamic; dtype, head dims, causal, varlen,
the page box and the tile config are baked in.

Fixed length: fn(q, k, v, o, lse, None, None, scale_log2, 0, qgroup, num_ctas, None) with q
(B, Sq, Hq, D), lse (B, Hq, Sq). Varlen: fn(q, k, v, o, lse, cu_seqlens_q, cu_seqlens_k,
scale_log2, max_seqlen_q, 1, num_ctas, None) with q (Tq, Hq, D), lse (Hq, Tq), offsets int32
(B + 1,). Paged: fn(q, k_cache, v_cache, o, lse, cu_seqlens_q, seqlens_k, scale_log2,
max_seqlen_q, 1, num_ctas, page_table) with caches (pages, page_size, Hkv, D) (any outer
strides: a combined cache's halves), seqlens_k int32 (B,), page_table int32 (B, max_pages)
(any row stride). Paged, packed (params packed=True): the same call on GQA-packed queries
(Tq * G, Hkv, D) (row t * G + g of kv head h: query head h * G + g of token t), o and lse
alike, cu_seqlens_q * G, max_seqlen_q * G and qgroup G; no sequence skipped. Zero-copy
(params view_group=G, with packed): q and o as (Tq, Hkv, G, D) views of (Tq, Hq, D), lse as
(Hkv, G, Tq) of (Hq, Tq), G static (TMA boxes of (G, tile_m / G) tokens). Fixed length,
GQA-packed (params view_group=G without varlen): q and o as (B, Sq, Hkv, G, D) views, lse as
(B, Hkv, G, Sq), qgroup G. Dynamic tiles
(params dynamic=True, not paged): the page-table slot takes the zeroed int32 (1,) tile
counter."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute

from forgekernel.kernels.attention.fwd.sm90.config import AttnConfig
from forgekernel.kernels.attention.fwd.sm90.kernel import AttentionFwdSm90
from forgekernel.kernels.common.sm90 import fake


def compile_attention_fwd(params: dict, arch: str = "sm_90a", extra_options: str = ""):
    dtype = fake.dtype_of(params["dtype"])
    d, dv = params["head_dim"], params["head_dim_v"]
    varlen = bool(params.get("varlen", False))
    page_box = int(params.get("page_box", 0))
    hq, hkv = cute.sym_int32(), cute.sym_int32()
    group = int(params.get("view_group", 0))
    page_table = None
    if page_box:
        tq, pages, page_size = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q, o = fake.rowmajor(dtype, (tq, hq, d)), fake.rowmajor(dtype, (tq, hq, dv))
        if group:  # the zero-copy packed form: (Tq, Hkv, G, D) views, hq counting kv heads
            q = fake.rowmajor(dtype, (tq, hq, group, d))
            o = fake.rowmajor(dtype, (tq, hq, group, dv))
        k = fake.rowmajor(dtype, (pages, page_size, hkv, d))
        v = fake.rowmajor(dtype, (pages, page_size, hkv, dv))
        lse = fake.rowmajor(cutlass.Float32, (hq, tq), divisibility=1, align=None)
        if group:
            lse = fake.rowmajor(cutlass.Float32, (hq, group, tq), divisibility=1, align=None)
        cu_q, cu_k = fake.offsets(), fake.offsets()  # cu_k: the key lengths (B,)
        page_table = fake.rowmajor(
            cutlass.Int32, (cute.sym_int32(), cute.sym_int32()), divisibility=1, align=4
        )
    elif varlen:
        tq, tk = cute.sym_int32(), cute.sym_int32()
        q, o = fake.rowmajor(dtype, (tq, hq, d)), fake.rowmajor(dtype, (tq, hq, dv))
        k, v = fake.rowmajor(dtype, (tk, hkv, d)), fake.rowmajor(dtype, (tk, hkv, dv))
        lse = fake.rowmajor(cutlass.Float32, (hq, tq), divisibility=1, align=None)
        cu_q, cu_k = fake.offsets(), fake.offsets()
    else:
        b, sq, sk = cute.sym_int32(), cute.sym_int32(), cute.sym_int32()
        q, o = fake.rowmajor(dtype, (b, sq, hq, d)), fake.rowmajor(dtype, (b, sq, hq, dv))
        k, v = fake.rowmajor(dtype, (b, sk, hkv, d)), fake.rowmajor(dtype, (b, sk, hkv, dv))
        lse = fake.rowmajor(cutlass.Float32, (b, hq, sq), divisibility=1, align=None)
        if group:  # GQA-packed: (B, Sq, Hkv, G, D) views, hq counting kv heads
            q = fake.rowmajor(dtype, (b, sq, hq, group, d))
            o = fake.rowmajor(dtype, (b, sq, hq, group, dv))
            lse = fake.rowmajor(cutlass.Float32, (b, hq, group, sq), divisibility=1, align=None)
        cu_q = cu_k = None
    if params.get("dynamic"):  # the tile counter, in the page-table slot (AttnConfig.dynamic)
        page_table = fake.rowmajor(cutlass.Int32, (1,), divisibility=1, align=4)
    kernel = AttentionFwdSm90(
        d, dv, causal=params["causal"], config=AttnConfig.from_params(params), varlen=varlen,
        page_box=page_box, packed=bool(params.get("packed", False)), view_group=group,
    )  # fmt: skip
    return cute.compile(
        kernel,
        q,
        k,
        v,
        o,
        lse,
        cu_q,
        cu_k,
        cutlass.Float32(1.0),
        cutlass.Int32(0),
        cutlass.Int32(1),
        cutlass.Int32(1),
        page_table,
        fake.stream(),
        options=fake.options(arch, extra_options),
    )
