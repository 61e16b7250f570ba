"""The FP8 128x256 tile's mainloop (`GemmSm90._mainloop_halves`: two 128-column halves a
k-tile, one fragment, DeepGEMM's wait-and-promote schedule) run on the host for every consumer
thread of a tile, against the fp64 reference; the device steps `_issue_half` (stand-in: the
half's exact fp32 product at the thread's coordinates) and `_retire_half` log what they were
asked, so the schedule is checked too: per k-tile, half 0 issued, retired, promoted, then half
1, its retire releasing the stage, stages in ring order, each half promoted with its own block
of B's scales. And the compiled kernel: no spills, the schedule in SASS, registers in use, no
register of a batch in flight touched (`test_gemm_fp8_mainloop`'s checks)."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from forgekernel.kernels.gemm.dense.sm90.config import GemmConfig
from forgekernel.reference.gemm import gemm_fp8_ref
from tests.test_gemm_fp8_mainloop import (
    _mainloop_sequence,
    _operands,
    _wgmma_violations,
)

cutlass = pytest.importorskip("cutlass")
cute = pytest.importorskip("cutlass.cute")

from cutlass import Float32, Int32  # noqa: E402
from cutlass.cute.runtime import from_dlpack  # noqa: E402

ISSUE, RETIRE, PROMOTE, DONE = 1, 2, 3, 4
STAGES = 4
WIDE = GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=1)


@pytest.fixture
def host_dsl(monkeypatch):
    monkeypatch.setattr(cute.arch, "make_warp_uniform", lambda x: x)


@cute.jit
def _log(log: cute.Tensor, kind, value, stage, half):
    at = log[0, 0]
    log[at, 0] = Int32(kind)
    log[at, 1] = Int32(value)
    log[at, 2] = Int32(stage)
    log[at, 3] = Int32(half)
    log[0, 0] = at + 1


def _host_gemm(cfg: GemmConfig):
    from forgekernel.kernels.gemm.dense.sm90.kernel import GemmSm90

    class HostGemm(GemmSm90):
        @cute.jit
        def _issue_half(self, tiled_mma, operands, frag, ab_pipe, read, at):
            products, coords, log = self.host
            kt, h = at
            size = cute.size(frag)
            for i in cutlass.range_constexpr(size):
                row, col = coords[size * h + i]
                frag[i] = products[kt, row, col]
            _log(log, ISSUE, kt, read.index, h)

        @cute.jit
        def _retire_half(self, h, ab_pipe, release):
            _log(self.host[2], RETIRE, 0, release.index, h)

        @cute.jit
        def _promote_half(self, acc, frag, h, scales):
            _log(self.host[2], PROMOTE, 0, 0, h)
            GemmSm90._promote_half(self, acc, frag, h, scales)

    gemm = HostGemm(cfg)
    gemm.scaled = True  # what __call__ sets from the scales
    return gemm


def _run_tile(cfg, a, b, sa, sb, tile, k0, count):
    """Every consumer thread's acc after `_mainloop_scaled` (-> `_mainloop_halves`) over
    k-tiles [k0, k0 + count) of tile `tile`, as a (tile_m, tile_n) fp32 tile, and the logs."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    from forgekernel.kernels.common.sm90.pipeline import consumer_state

    m, k = a.shape
    n = b.shape[0]
    tm, tn = tile
    rows = torch.arange(tm * cfg.tile_m, (tm + 1) * cfg.tile_m).clamp_max(m - 1)
    cols = torch.arange(tn * cfg.tile_n, (tn + 1) * cfg.tile_n).clamp_max(n - 1)
    k_tiles = k // 128
    a_t = a.float()[rows].view(cfg.tile_m, k_tiles, 128).transpose(0, 1)
    b_t = b.float()[cols].view(cfg.tile_n, k_tiles, 128).transpose(0, 1)
    products = torch.bmm(a_t, b_t.transpose(1, 2)).contiguous()
    threads = cfg.tile_m // 64 * 128
    out = torch.full((cfg.tile_m, cfg.tile_n), float("nan"))
    log = torch.zeros(threads, 6 * count + 4, 4, dtype=torch.int32)
    gemm = _host_gemm(cfg)
    fp8 = cutlass.Float8E4M3FN
    k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()

    @cute.jit
    def run(products: cute.Tensor, mSFA: cute.Tensor, mSFB: cute.Tensor, out: cute.Tensor,
            log: cute.Tensor, m: Int32, k0: Int32, count: Int32, tm: Int32, tn: Int32):  # fmt: skip
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, Float32, (cfg.tile_m // 64, 1, 1), tiler_mn=(64, 128)
        )
        for t in cutlass.range(threads):
            coords = gemm._thread_coords(tiled_mma, t)
            r0, r1 = gemm._scale_rows(coords)
            acc = cute.make_rmem_tensor(coords.shape, Float32)
            frag = cute.make_rmem_tensor((coords.shape[0], 1, 1), Float32)
            frag.fill(float("nan"))
            thread_log = log[t, None, None]
            thread_log[0, 0] = Int32(1)
            gemm.host = (products, coords, thread_log)
            where = (tm * cfg.tile_m, tn, m, (Int32(0), mSFB.shape[0] - 1))
            read, release = consumer_state(STAGES), consumer_state(STAGES)
            mma = (tiled_mma, None, (None, None), acc, ((frag,), r0, r1, mSFA, mSFB))
            read, release, _ = gemm._mainloop_scaled(k0, count, mma, where, None, read, release)
            _log(thread_log, DONE, read.index, read.phase, 0)
            _log(thread_log, DONE, release.index, release.phase, 1)
            for i in cutlass.range_constexpr(cute.size(acc)):
                row, col = coords[i]
                out[row, col] = acc[i]

    run(from_dlpack(products), from_dlpack(sa), from_dlpack(sb), from_dlpack(out),
        from_dlpack(log), m, k0, count, tm, tn)  # fmt: skip
    return out, log


def _check_log(log, k0, count):
    """Per k-tile i (stage i mod STAGES): issue h0, retire h0, promote h0, issue h1, retire h1
    (the stage's release), promote h1; the states handed back `count` k-tiles on."""
    want = []
    for i in range(count):
        stage = i % STAGES
        for h in range(2):
            want += [(ISSUE, k0 + i, stage, h), (RETIRE, 0, stage, h), (PROMOTE, 0, 0, h)]
    state = (count % STAGES, (count // STAGES) % 2)
    for t in range(log.shape[0]):
        used = int(log[t, 0, 0])
        events = [tuple(map(int, e)) for e in log[t, 1:used]]
        assert events[:-2] == want
        assert events[-2][1:3] == state and events[-1][1:3] == state


@pytest.mark.parametrize(
    ("shape", "tile", "k0", "count"),
    [
        ((300, 600, 5 * 128), (1, 1), 0, 5),  # a whole tile, a ring of 4 wrapped
        ((300, 600, 3 * 128), (2, 2), 0, 3),  # the ragged corner: 2nd half past N (600 - 512)
        ((130, 384, 6 * 128), (0, 1), 2, 3),  # a stream-K unit in mid-K; half 1 past N
        ((128, 256, 128), (0, 0), 0, 1),  # one k-tile
    ],
)  # fmt: skip
def test_halves_mainloop_on_the_host_matches_the_reference(host_dsl, shape, tile, k0, count):
    m, n, k = shape
    a, b, sa, sb = _operands(m, n, k, seed=m + n + k0 + count)
    out, log = _run_tile(WIDE, a, b, sa, sb, tile, k0, count)
    keep = slice(k0 * 128, (k0 + count) * 128)
    want = gemm_fp8_ref(a[:, keep], b[:, keep], sa[:, k0 : k0 + count], sb[:, k0 : k0 + count])
    r0, c0 = tile[0] * 128, tile[1] * 256
    rows, cols = min(128, m - r0), min(256, n - c0)
    got, ref = out[:rows, :cols], want[r0 : r0 + rows, c0 : c0 + cols]
    assert not out.isnan().any()
    assert float((got - ref).abs().max()) <= 1e-5 * float(ref.abs().max()) * count
    _check_log(log, k0, count)


def test_each_half_takes_its_own_block_of_b_scales(host_dsl):
    """B's two scale blocks of the tile differ by powers of two per block and k-tile, A's per
    k-tile: a half promoted with the other half's (or k-tile's) scales is off by 2x or more."""
    m, n, k = 128, 512, 4 * 128
    a, b, _, _ = _operands(m, n, k, seed=3)
    sa = torch.tensor([2.0**i for i in range(4)]).repeat(m, 1) * torch.linspace(1, 2, m)[:, None]
    sb = torch.tensor([[4.0 ** -(i + 2 * j) for i in range(4)] for j in range(4)])
    out, _ = _run_tile(WIDE, a, b, sa.contiguous(), sb.contiguous(), (0, 1), 0, 4)
    want = gemm_fp8_ref(a, b, sa, sb)[:, 256:512]
    assert float((out - want).abs().max()) <= 1e-5 * float(want.abs().max()) * 4


@pytest.mark.parametrize("cluster", [(2, 1), (1, 2)])
def test_sass_wait_and_promote_per_half(cluster, tmp_path):
    """Compiled for sm_90a (bf16 out): no spills; per k-tile two batches of 4 QGMMA.64x128x32,
    each waited for with DEPBAR.LE 0 and promoted with 64 FFMAs, once in the loop (one k-tile a
    trip); registers in use (the highest R + 1) within setmaxnreg's 232; no register of a batch
    in flight touched, no stage released before a wait."""
    import re

    from forgekernel.kernels.gemm.fp8.sm90 import SPEC
    from forgekernel.kernels.gemm.fp8.sm90.config import params_for
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump/nvdisasm not installed")
    cfg = GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=cluster[0],
                     cluster_n=cluster[1])  # fmt: skip
    compiled = SPEC.compile(params_for("bfloat16", cfg), f"--keep-cubin --dump-dir {tmp_path}")
    cubin = compiled.artifacts.CUBIN
    if isinstance(cubin, bytes):
        path = tmp_path / "k.cubin"
        path.write_bytes(cubin)
        cubin = str(path)
    info = inspect_cubin(cubin)
    assert info["spill_bytes"] == 0 and info["sass"].get("LDL", 0) == 0
    nvdisasm = find_tool("nvdisasm")
    env = dict(os.environ, PATH=os.pathsep.join([str(Path(nvdisasm).parent), os.environ["PATH"]]))
    sass = subprocess.run(
        [find_tool("cuobjdump"), "-sass", cubin], capture_output=True, text=True, env=env
    ).stdout
    assert _mainloop_sequence(sass) == "AQQQQD0F64" * 2
    assert _wgmma_violations(sass) == []
    used = max(int(r) for r in re.findall(r"\bR(\d+)\b", sass)) + 1
    assert used <= 232


def test_no_config_set_routes_stream_k_grouped_or_masked_through_the_halves():
    """The halves loop is verified only for data-parallel dense tiles: no standard, candidate,
    grouped or masked configuration has tile_n = 256 together with stream K or a grouped
    layout."""
    from forgekernel.kernels.gemm.dense.sm90 import masked_config
    from forgekernel.kernels.gemm.fp8.sm90 import SPEC
    from forgekernel.kernels.gemm.fp8.sm90 import config as fp8_config

    for params in map(dict, SPEC.standard_params()):
        if params["tile_n"] == 256:
            assert not params["stream_k"] and not params.get("grouped")
    assert fp8_config.GROUPED.tile_n == 128
    assert all(c.tile_n <= 128 for c in masked_config.STANDARD_CONFIGS)
    assert all(c.tile_n <= 128 for c in (*fp8_config.STREAM_DECODE, fp8_config.STREAM))


@pytest.mark.parametrize(
    ("cfg", "grouped"),
    [
        (GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=1, stream_k=True), False),
        (GemmConfig(tile_m=128, tile_n=256, tile_k=128, cluster_m=1, cluster_n=2), True),
    ],
)
def test_halves_refuse_stream_k_and_the_grouped_layout(cfg, grouped):
    """A forced stream-K or grouped 128x256 FP8 configuration is refused while tracing (the
    halves loop has run neither: stream K's parked 128-register partial, an expert's B rows
    past its N in the second half), not compiled into an unverified kernel."""
    from forgekernel.kernels.gemm.fp8.sm90.compile import compile_gemm_fp8
    from forgekernel.kernels.gemm.fp8.sm90.config import params_for

    with pytest.raises(ValueError, match="128x256"):
        compile_gemm_fp8(dict(params_for("bfloat16", cfg, grouped)))


def test_epilogue_sub_tiles_read_the_halves_accumulator_in_order(host_dsl):
    """The epilogue (`_consume`'s r2s, `_epilogue`'s tRS_acc[e x frag + v]) built on the halves'
    64x128 tiled MMA, run on the host for every consumer thread: value v of sub-tile e is the
    accumulator value at the stmatrix source coordinate v of the (128, epi_n) sub-tile, moved
    e x epi_n columns on (sub-tiles 4-7 the second half's); and the (V, 1, 2) accumulator's value
    64 h + i is the half's 64x128 fragment value i, 128 h columns on (`_promote_half`)."""
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    cfg = WIDE
    fp8, c_dtype = cutlass.Float8E4M3FN, cutlass.BFloat16
    k_major = LayoutEnum.ROW_MAJOR.sm90_mma_major_mode()
    c_major = LayoutEnum.ROW_MAJOR
    threads, epi_n = cfg.tile_m // 64 * 128, cfg.epi_n
    subtiles = cfg.tile_n // epi_n
    bad = torch.zeros(2, dtype=torch.int32)

    @cute.jit
    def run(bad: cute.Tensor):
        tiled_mma = sm90_utils.make_trivial_tiled_mma(
            fp8, fp8, k_major, k_major, Float32, (cfg.tile_m // 64, 1, 1), tiler_mn=(64, 128)
        )
        r2s_atom = sm90_utils.sm90_get_smem_store_op(
            c_major, elem_ty_d=c_dtype, elem_ty_acc=Float32
        )
        stm = cute.make_copy_atom(cute.nvgpu.warp.StMatrix8x8x16bOp(False, 4), c_dtype)
        r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stm, tiled_mma))
        sub_tile = cute.make_identity_tensor((cfg.tile_m, epi_n))
        for t in cutlass.range(threads):
            slice_ = tiled_mma.get_slice(t)
            coords = slice_.partition_C(cute.make_identity_tensor((cfg.tile_m, cfg.tile_n)))
            half = slice_.partition_C(cute.make_identity_tensor((cfg.tile_m, 128)))
            acc = cute.make_rmem_tensor(coords.shape, Float32)
            for i in cutlass.range_constexpr(cute.size(acc)):
                acc[i] = Float32(coords[i][0] * 1000 + coords[i][1])
            size = cute.size(half)
            for h in cutlass.range_constexpr(2):
                for i in cutlass.range_constexpr(size):
                    row, col = coords[size * h + i]
                    if row != half[i][0] or col != half[i][1] + 128 * h:
                        bad[1] = bad[1] + 1
            tRS_acc = r2s.retile(acc)
            source = r2s.get_slice(t).partition_S(sub_tile)
            frag = cute.size(source)
            for e in cutlass.range_constexpr(subtiles):
                for v in cutlass.range_constexpr(frag):
                    row, col = source[v]
                    if tRS_acc[e * frag + v] != Float32(row * 1000 + col + e * epi_n):
                        bad[0] = bad[0] + 1

    run(from_dlpack(bad))
    assert bad.tolist() == [0, 0]
