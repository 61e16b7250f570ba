"""The zero-copy packed paged form's views (params view_group): the caller's q / o (Tq, Hq, D)
and lse (Hq, Tq), handed over as (Tq, Hkv, G, D) and (Hkv, G, Tq), seen as the GQA-packed rows
they hold (the layout a pack-GQA copy would write; no data moves). The forward's own module:
kernels/common/sm90/layout.py is in every sm90 kernel's source hash."""

from __future__ import annotations

import cutlass.cute as cute


def grouped_rows_as_sdhb(t: cute.Tensor) -> cute.Tensor:
    """(T, Hkv, G, D) (G static) as the (S, D, H, B) view of its packed rows: ((G, T), D, Hkv,
    1), row t * G + g of kv head h being query head h * G + g of token t."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            ((lay.shape[2], lay.shape[0]), lay.shape[3], lay.shape[1], 1),
            stride=((lay.stride[2], lay.stride[0]), lay.stride[3], lay.stride[1], 0),
        ),
    )


def grouped_lse(t: cute.Tensor) -> cute.Tensor:
    """(Hkv, G, T) as the kernel's (1, H, rows) LSE view of the packed rows: (1, Hkv, (G, T)),
    row t * G + g of kv head h at [h * G + g, t] of the caller's (Hq, T)."""
    lay = t.layout
    return cute.make_tensor(
        t.iterator,
        cute.make_layout(
            (1, lay.shape[0], (lay.shape[1], lay.shape[2])),
            stride=(0, lay.stride[0], (lay.stride[1], lay.stride[2])),
        ),
    )
