"""The zero-copy packed compile's views evaluated by the DSL while tracing (no GPU): a helper of
tests/test_attention_paged_packed.py, without `from __future__ import annotations` (the DSL
reads a jit function's annotations as objects)."""

import cutlass
import cutlass.cute as cute
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass.cute.nvgpu import cpasync
from cutlass.cute.runtime import make_fake_tensor
from cutlass.tensor_utils import LayoutEnum

from forgekernel.kernels.attention.fwd.sm90.views import grouped_lse, grouped_rows_as_sdhb
from forgekernel.kernels.common.sm90 import fake

TILE_M = 128


def trace_views(tq: int, hkv: int, g: int, d: int) -> dict:
    """For compact q (Tq, Hkv * G, D) seen as (Tq, Hkv, G, D) and lse (Hkv * G, Tq) as (Hkv, G,
    Tq): "q", the element offsets of packed rows 0, 5, 9, 279 (columns 0, 3; heads 0, 1)
    through `grouped_rows_as_sdhb`; "tma", the TMA coordinates (d, g, t, head) of head 1's
    128-row tiles after a packed offset of 8 rows (tile 0 row 0, tile 1 row 0, tile 1 row 5
    column 7); "lse", the offsets of rows 0, 9, 279 of heads 0, 1 through `grouped_lse`."""
    seen = {}

    @cute.jit
    def trace(mQ: cute.Tensor, mL: cute.Tensor):
        rows = grouped_rows_as_sdhb(mQ)
        seen["q"] = [
            int(cute.crd2idx((r, c, h, 0), rows.layout))
            for r in (0, 5, 9, 279)
            for c in (0, 3)
            for h in (0, 1)
        ]
        s_q = sm90_utils.make_smem_layout_a(
            LayoutEnum.ROW_MAJOR, (TILE_M, 128, d), cutlass.BFloat16, 1
        )
        _, coords = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileG2SOp(), rows, cute.slice_(s_q, (None, None, 0)), (TILE_M, d)
        )
        tiles = cute.local_tile(
            cute.domain_offset((8, 0), coords[None, None, 1, 0]), (TILE_M, d), (None, 0)
        )
        seen["tma"] = [
            tuple(int(x) for x in tiles[(i, c, m)]) for i, c, m in ((0, 0, 0), (0, 0, 1), (5, 7, 1))
        ]
        lse = grouped_lse(mL)
        seen["lse"] = [
            int(cute.crd2idx((0, h, r), lse.layout)) for h in (0, 1) for r in (0, 9, 279)
        ]

    q = make_fake_tensor(
        cutlass.BFloat16, (tq, hkv, g, d), stride=(hkv * g * d, g * d, d, 1), assumed_align=16
    )
    lse = make_fake_tensor(cutlass.Float32, (hkv, g, tq), stride=(g * tq, tq, 1))
    cute.compile(trace, q, lse, options=fake.options("sm_90a"))
    return seen
