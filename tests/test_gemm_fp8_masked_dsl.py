"""The masked grouped FP8 GEMM's device code on a machine without a GPU: the kernel compiled for
sm_90a (no spills, its stores), and its own logic run on the host (a `cute.jit` function runs
on the CPU with CPU tensors; make_warp_uniform, a device hint, replaced by the identity): the
tile walk of masked.py against its model, and the partial-tile store writing exactly its
rows."""

from __future__ import annotations

import random

import pytest
import torch

from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC, masked_config

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402
from test_gemm_fp8_masked import walk  # noqa: E402


@pytest.mark.parametrize("which", [0, len(masked_config.STANDARD_CONFIGS) - 1])
def test_kernel_compiles_for_sm90a_without_spills(which, tmp_path):
    """The 8-row-box tile (registers-only stores) and the 128-row tile (TMA store too)."""
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not installed")
    params = masked_config.params_for("bfloat16", masked_config.STANDARD_CONFIGS[which])
    compiled = MASKED_SPEC.compile(params, f"--keep-cubin --dump-dir {tmp_path}")
    info = inspect_cubin(compiled.artifacts.CUBIN)
    assert info["spill_bytes"] == 0 and info["hgmma"]
    sass = info["sass"]
    assert sass.get("LDL", 0) == sass.get("STL", 0) == 0 and sass["QGMMA"] == 16  # 4 sites
    assert bool(sass.get("UTMASTG")) == (which != 0)  # whole 128-row tiles through TMA
    assert info["registers"] == (232 if which == 0 else 168)  # entry caps: 2 or 3 warpgroups


@pytest.fixture
def host_dsl(monkeypatch):
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)


def test_device_walk_matches_its_model(host_dsl):
    """masked.py's MaskedWalk, compiled and run on the host for each CTA, against `walk`."""
    from forgekernel.kernels.gemm.dense.sm90.masked import MaskedWalk

    @cute.jit
    def walk_all(masked_m: cute.Tensor, out: cute.Tensor, max_m: Int32, tiles_n: Int32,
                 ctas: Int32, h: cutlass.Constexpr):  # fmt: skip
        for cta in cutlass.range(ctas):
            walk = MaskedWalk(masked_m, max_m, tiles_n, h, cta, ctas)
            work, expert, before, rows = walk.first()
            i = Int32(0)
            while walk.valid(expert):
                m, n, r = walk.tile(work, before, rows)
                out[cta, i, 0], out[cta, i, 1], out[cta, i, 2], out[cta, i, 3] = expert, m, n, r
                i = i + 1
                work, expert, before, rows = walk.next(work, expert, before, rows)

    rng = random.Random(7)
    for h in (8, 64):
        for _ in range(4):
            experts, max_m = rng.randint(1, 12), rng.randint(1, 150)
            counts = [rng.choice((0, rng.randint(0, max_m), max_m, max_m + 9, -2)) for _ in
                      range(experts)]  # fmt: skip
            tiles_n, ctas = rng.randint(1, 5), rng.choice((1, 3, 16))
            order = walk(counts, max_m, tiles_n, h, ctas)
            out = torch.full((ctas, max(map(len, order)) + 1, 4), -1, dtype=torch.int32)
            masked_m = torch.tensor(counts, dtype=torch.int32)
            walk_all(from_dlpack(masked_m), from_dlpack(out), max_m, tiles_n, ctas, h)
            for cta, tiles in enumerate(order):
                assert out[cta, : len(tiles)].tolist() == [list(t) for t in tiles]
                assert bool((out[cta, len(tiles) :] == -1).all())


def test_device_partial_tile_store_writes_its_rows_only(host_dsl):
    """GemmSm90._store_rows with the masked consumer's addressing (expert slice, first row,
    n-tile), every thread of the 128-row tile run on the host: each value lands at its own
    coordinate, rows past the count untouched."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    cfg = masked_config.ROWS_128
    gemm = GemmSm90(cfg, masked=True)
    k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()

    @cute.jit
    def store(mC: cute.Tensor, expert: Int32, first_row: Int32, tile_n: Int32, rows: Int32):
        gemm.c_dtype = mC.element_type
        fp8 = cutlass.Float8E4M3FN
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, cutlass.Float32, (2, 1, 1), tiler_mn=(64, cfg.tile_n)
        )
        for t in cutlass.range(2 * 128):
            thr = tiled_mma.get_slice(t)
            coords = thr.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            gC_rows = cute.local_tile(
                cute.domain_offset((first_row, 0), mC[None, None, expert]),
                (cfg.tile_m, cfg.tile_n),
                (0, tile_n),
            )
            acc = cute.make_rmem_tensor(coords.shape, cutlass.Float32)
            for g in cutlass.range_constexpr(cute.size(acc) // 4):
                for j in cutlass.range_constexpr(4):
                    row, col = coords[4 * g + j]
                    acc[4 * g + j] = cutlass.Float32(row * 1000 + col)
            gemm._store_rows(acc, thr.partition_C(gC_rows), coords, rows)

    c = torch.full((3, 200, 384), -1.0)
    store(from_dlpack(c.permute(1, 2, 0)), 1, 64, 2, 70)
    want = torch.full_like(c, -1.0)
    values = torch.arange(128)[:, None] * 1000.0 + torch.arange(128)[None, :]
    want[1, 64:134, 256:384] = values[:70]
    assert torch.equal(c, want)
