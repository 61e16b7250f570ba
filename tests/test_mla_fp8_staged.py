"""The MLA / DSA pass over an FP8 cache on the CPU (decode.py, fp8.py; every tile after tile 0):
where a tile's e4m3 bytes wait in their stage, the warpgroup's cp.async and dequantization
jobs, and the in-place order, replayed byte by byte against the 16-bit tile layout the kernel's
WGMMAs read (taken from the DSL's own layout helper): every chunk written once, from its own
bytes, and no phase writing a byte that a thread of the same or a later phase still has to
read."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("cutlass")

from test_mla_decode import _dequantize_rows, dequantize_like_the_kernel  # noqa: E402

from forgekernel.kernels.attention.mla.sm90 import fp8  # noqa: E402
from forgekernel.kernels.attention.mla.sm90.config import (  # noqa: E402
    D_LATENT,
    FP8_CHUNK,
    FP8_SCALE_COLUMNS,
    TILE,
)

THREADS = 128  # warpgroup 1
CHUNKS = D_LATENT // FP8_CHUNK  # 16-byte chunks of a row's e4m3 bytes
STAGE_BYTES = TILE * D_LATENT * 2


def _tile_offsets() -> dict[tuple[int, int], int]:
    """(row, chunk) -> byte offset in its stage of the chunk's 16 bf16 columns, from the
    DSL's layout of the 16-bit key tile (decode.py `lay_kl`), checked contiguous."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    elements = {}

    @cute.jit
    def read():
        lay = sm90_utils.make_smem_layout_b(
            LayoutEnum.ROW_MAJOR, (64, TILE, D_LATENT), cutlass.BFloat16, 2
        )
        for r in cutlass.range_constexpr(TILE):
            for col in cutlass.range_constexpr(D_LATENT):
                elements[r, col] = lay((r, col, 0))

    read()
    for (r, col), at in elements.items():  # a chunk's 16 columns are one 32-byte run
        assert at == elements[r, col - col % 16] + col % 16
    return {(r, c): 2 * elements[r, 16 * c] for r in range(TILE) for c in range(CHUNKS)}


@pytest.fixture(scope="module")
def tile_offsets():
    return _tile_offsets()


def _jobs(phase: int) -> list[tuple[int, int]]:
    return [
        fp8.staged_job(phase, j, tid // 32, tid % 32)
        for tid in range(THREADS)
        for j in range(fp8.STAGED_JOBS[phase])
    ]


def test_issue_covers_the_tile_in_the_upper_half():
    """The cp.async jobs: every (row, chunk) once, its 16 bytes at `staged_raw_offset`, all
    inside the stage's upper half and disjoint; a warp instruction reads two 256-byte runs
    of two cache rows."""
    jobs = [fp8.staged_issue_job(tid, load) for tid in range(THREADS) for load in range(16)]
    assert sorted(jobs) == [(r, c) for r in range(TILE) for c in range(CHUNKS)]
    spans = sorted(fp8.staged_raw_offset(r, c) for r, c in jobs)
    assert spans[0] == fp8.STAGED_RAW_BASE == STAGE_BYTES // 2
    assert spans == list(range(STAGE_BYTES // 2, STAGE_BYTES, FP8_CHUNK))
    for load in range(16):
        for warp in range(4):
            lanes = [fp8.staged_issue_job(32 * warp + lane, load) for lane in range(32)]
            for half in (lanes[:16], lanes[16:]):
                assert len({r for r, _ in half}) == 1
                cols = [c for _, c in half]
                assert cols == list(range(cols[0], cols[0] + 16))


def test_dequantization_phases_in_place(tile_offsets):
    """Phases 0, 1, 2 (barriers between; phase 2's bytes read during phase 1): every
    (row, chunk) written once; a phase writes no byte any thread reads in it or later; a
    chunk's bytes and its scale group agree."""
    phases = [_jobs(p) for p in range(3)]
    done = sorted(j for p in phases for j in p)
    assert done == [(r, c) for r in range(TILE) for c in range(CHUNKS)]

    def raw(jobs):
        return {b for r, c in jobs for b in range(*_span(fp8.staged_raw_offset(r, c), 16))}

    def written(jobs):
        return {b for r, c in jobs for b in range(*_span(tile_offsets[r, c], 32))}

    reads = [raw(phases[0]), raw(phases[1]) | raw(phases[2]), set()]
    for p in range(3):
        later = set().union(*reads[p:])
        assert not (written(phases[p]) & later), f"phase {p} overwrites bytes still to be read"
    # every written byte lies in the 16-bit tile (the stage), and the whole stage is written
    assert set().union(*(written(j) for j in phases)) == set(range(STAGE_BYTES))
    for _, c in done:  # a chunk's 16 columns share one scale
        assert (16 * c) // FP8_SCALE_COLUMNS == (16 * c + 15) // FP8_SCALE_COLUMNS == c // 8


def _span(start: int, n: int) -> tuple[int, int]:
    return start, start + n


def test_replay_gives_the_dequantized_tile(tile_offsets):
    """The stage as bytes: the cp.async jobs fill the upper half with a random tile's e4m3,
    the phases run in the kernel's order (all of a phase's reads, then its writes: the
    barriers; phase 2's bytes read in phase 1), and the stage read through the 16-bit layout
    equals the kernel's dequantization (fp8.py) of every row."""
    gen = torch.Generator().manual_seed(5)
    codes = torch.randint(0, 256, (TILE, D_LATENT), generator=gen, dtype=torch.uint8)
    groups = D_LATENT // FP8_SCALE_COLUMNS
    scales = torch.exp2(torch.randint(-13, 3, (TILE, groups), generator=gen).float())
    stage = bytearray(STAGE_BYTES)
    for tid in range(THREADS):
        for load in range(16):
            r, c = fp8.staged_issue_job(tid, load)
            at = fp8.staged_raw_offset(r, c)
            stage[at : at + 16] = codes[r, 16 * c : 16 * c + 16].numpy().tobytes()

    def dequant(r, c, chunk_bytes):
        e4m3 = torch.frombuffer(bytearray(chunk_bytes), dtype=torch.uint8)
        vals = dequantize_like_the_kernel(e4m3[None], scales[r, c // 8].reshape(1))
        return vals.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()

    held = {}
    for phase in range(3):
        if phase == 1:  # phase 2's bytes into registers first
            for r, c in _jobs(2):
                held[r, c] = bytes(stage[fp8.staged_raw_offset(r, c) :][:16])
        src = held if phase == 2 else None
        outs = []
        for r, c in _jobs(phase):
            raw = src[r, c] if src else bytes(stage[fp8.staged_raw_offset(r, c) :][:16])
            outs.append((tile_offsets[r, c], dequant(r, c, raw)))
        for at, data in outs:
            stage[at : at + 32] = data
    tile = torch.empty(TILE, D_LATENT, dtype=torch.bfloat16)
    for r in range(TILE):
        for c in range(CHUNKS):
            at = tile_offsets[r, c]
            chunk = torch.frombuffer(bytearray(stage[at : at + 32]), dtype=torch.bfloat16)
            tile[r, 16 * c : 16 * c + 16] = chunk
    want = _dequantize_rows(codes, scales)
    assert torch.equal(tile.view(torch.int16), want.view(torch.int16))
