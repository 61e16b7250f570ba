"""The zero-copy GQA-packed forms' views (params view_group): the caller's q / o (Tq, Hq, D)
(paged) or (B, Sq, Hq, D) (fixed length) and lse (Hq, Tq) / (B, Hq, Sq), handed over as
(Tq, Hkv, G, D) / (B, Sq, Hkv, G, D) and (Hkv, G, Tq) / (B, Hkv, G, Sq), seen as the GQA-packed
rows they hold (the layout a pack-GQA copy would write; no data moves). The forward's own
module: kernels/common/sm90/layout.py is in every sm90 kernel's source hash."""

from __future__ import annotations

import cutlass.cute as cute


def grouped_rows_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """(T, Hkv, G, D) or (B, T, Hkv, G, D) (G static) as the (S, D, H, B) view of its packed
    rows: ((G, T), D, Hkv, B) (B 1 for the rank-4 form), row t * G + g of kv head h being
    query head h * G + g of token t."""
    lay = t.layout
    shape, stride = lay.shape[-4:], lay.stride[-4:]
    batch = (lay.shape[0], lay.stride[0]) if cute.rank(lay) == 5 else (1, 0)
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            ((shape[2], shape[0]), shape[3], shape[1], batch[0]),
            stride=((stride[2], stride[0]), stride[3], stride[1], batch[1]),
        ),
    )


def grouped_lse(t: cute.Tensor) -> cute.Tensor:
    """(Hkv, G, T) or (B, Hkv, G, T) as the kernel's (B, H, rows) LSE view of the packed rows:
    (B, Hkv, (G, T)) (B 1 for the rank-3 form), row t * G + g of kv head h at [h * G + g, t]
    of the caller's (Hq, T)."""
    lay = t.layout
    shape, stride = lay.shape[-3:], lay.stride[-3:]
    batch = (lay.shape[0], lay.stride[0]) if cute.rank(lay) == 4 else (1, 0)
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (batch[0], shape[0], (shape[1], shape[2])),
            stride=(batch[1], stride[0], (stride[1], stride[2])),
        ),
    )
