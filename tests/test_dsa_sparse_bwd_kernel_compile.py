"""The v1 sparse backward kernel compiled for sm_90a on the CPU (the DSL compiles, ptxas
assembles, cuobjdump reads the cubin), its structure as kernel.py states it: no spills under
the setmaxnreg split, the WGMMAs of both consumer warpgroups' tiles (S^T / dP^T over 576 / 512
columns, dq^T blocks over 64 rows, dkv blocks over BLOCK heads), the gather by cp.async, the dkv
reductions (red4s: `red.global.add.v4.f32` from the staging in the stage; v2:
`red.global.add.v2.f32` from the fragments) and the WGMMAs pipelined (not serialized one by
one). CI builds each standard form's first configuration (xchg4s, the h64 parts); the other
blocks, dtypes and the candidate forms (v2, red4s without xchg) are marked `slow`
(tests/sweeps.py): they run before landing a kernel change."""

from __future__ import annotations

import re
from collections import Counter

import pytest

pytest.importorskip("cutlass")

from cubins import build  # noqa: E402  (tests/ is on the path)
from sweeps import slow_past  # noqa: E402

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC, config  # noqa: E402
from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9x.]+)?)")


def _build(params) -> tuple[dict, str]:
    """inspect_cubin's resources and the SASS text of one build, compiled once a process by
    tests/cubins.py's `build` (the h64 tests read both)."""
    found = build(SPEC, params)
    return found.resources, found.sass


def _compiled(params) -> tuple[dict, Counter]:
    res, sass = _build(params)
    ops = Counter(op.split(".")[0] for op in _OP.findall(sass))
    ops["RED_V2"] = sass.count("REDG.E.ADD.F32x2")
    ops["DEPBAR0"] = sass.count("WARPGROUP.DEPBAR.LE gsb0, 0x0")
    ops["STS_64"] = sass.count("STS.64 ")
    ops["RED_V4"] = sass.count("REDG.E.ADD.F32x4")
    ops["LDS_128"] = sass.count("LDS.128 ")
    ops["STG"] = len(re.findall(r"STG\.E [^\n]*", sass))
    # where the v4 reductions are: the consumers' code follows their setmaxnreg increase
    lines = [(int(a, 16), t) for a, t in re.findall(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    alloc = next(a for a, t in lines if "USETMAXREG.TRY_ALLOC" in t)
    reds = [a for a, t in lines if "REDG.E.ADD.F32x4" in t]
    ops["RED_V4_CONSUMER"] = sum(a > alloc for a in reds)
    ops["WG_BAR"] = len(re.findall(r"BAR\.SYNC\.DEFER_BLOCKING 0x[56], 0x80 ", sass))
    ops["ARRIVE_AFTER_LDS128"] = len(re.findall(r"LDS\.128 [^\n]*\n(?:\s*/\* 0x[0-9a-f]+ \*/\s*\n)?"
                                                r"[^\n]*SYNCS\.ARRIVE", sass))  # fmt: skip
    return res, ops


# Candidate forms' compile checks, all slow (~6.5 s of CI's CPU, idle machine, 2026-12-06): the
# v2 form (before red4s) and red4s without xchg; CI keeps the standard form's, xchg4s's first
# (block 16, bf16: the representative), and the h64 parts'.
@pytest.mark.slow
@pytest.mark.parametrize(("block", "xchg"), [(b, x) for b in config.BLOCKS for x in (False, True)])
def test_sparse_bwd_kernel(block, xchg):
    """The fragments' red.global.add.v2 (both blocks' form before red4s; the candidate v2;
    under xchg the form measured at 00:37)."""
    _check_kernel(block, xchg)


@pytest.mark.slow  # a candidate form (see test_sparse_bwd_kernel)
@pytest.mark.parametrize("block", config.BLOCKS)
def test_sparse_bwd_kernel_red4s(block):
    """The candidate red4s (the standard form before xchg4s): the dkv blocks staged (144
    STS.64 a thread loop), read back (72 LDS.128) into 72 REDG.E.ADD.F32x4, no v2, the staging
    in the stage, the WGMMAs as the v2 builds', one 128-thread named barrier a consumer path
    (its dq^T MMAs done) and each consumer path's empty arrival right after the last block's
    eight 128-bit loads."""
    _check_kernel(block, False, red4s=True)


@pytest.mark.parametrize(
    "block,reduce", slow_past([(16, True), (32, True), (32, False)], unpack=True)
)
def test_sparse_bwd_kernel_xchg4s(block, reduce):
    """The standard form xchg4s (red4s under xchg; config.py's RED4S_OFFSET comment): xchg's WGMMAs
    (S^T in one warpgroup, dP^T in the other) and exchange (scalar stores: no STS.64 of its
    own), red4s's 144 STS.64, 72 LDS.128 and 72 REDG.E.ADD.F32x4 a thread loop, the same one
    128-thread DQ_DONE barrier a consumer path and the empty arrival right after the last
    block's 128-bit loads; no spills under the 224-register consumers. reduce False: the
    probe's build keeps the same code behind a never-true guard."""
    _check_kernel(block, True, reduce, red4s=True)


def test_stage_chunks_are_contiguous():
    """red4s addresses the stage as fp32 bytes: column block k of the (64, 64, 9 x stages)
    128-byte-swizzled stage layout must be exactly the 8 KB at k x 8 KB (the swizzle permutes
    16-byte pieces inside 1 KB), config.STAGE_CHUNK_FLOATS."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.tensor_utils import LayoutEnum

    seen = {}

    @cute.jit
    def probe():
        for block in config.BLOCKS:
            lay = sm90_utils.make_smem_layout_a(
                LayoutEnum.ROW_MAJOR, (config.TILE, block, config.CHUNK), cutlass.BFloat16,
                config.NCHUNK * 2)  # fmt: skip
            seen[block] = {k: sorted({lay((r, c, k)) for r in range(config.TILE)
                                      for c in range(0, config.CHUNK, 8)})
                           for k in (0, 3, 4, 8, 9, 13, 17)}  # fmt: skip

    cute.compile(probe)
    elems = config.TILE * config.CHUNK  # 16-bit elements of a column block
    for block in config.BLOCKS:
        for k, idx in seen[block].items():
            assert idx == list(range(k * elems, (k + 1) * elems, 8))


def _check_kernel(block, xchg, reduce=True, red4s=False):
    res, ops = _compiled(config.params_for("bfloat16", block, reduce, xchg, red4s))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["registers"] <= 65536 // config.THREADS  # the launch's share (setmaxnreg splits it)
    k = block // 16  # k-steps of a dkv block
    n_dq = [len(b) for b in config.DQ_BLOCKS]
    n_dkv = [sum(2 if c < config.D_V // config.CHUNK else 1 for c in b) for b in config.DKV_BLOCKS]
    # S + dP (both in each warpgroup, or S in the first and dP in the second) + dq + dkv
    sdp = (36, 32) if xchg else (68, 68)
    per_wg = [a + 4 * q + k * v for a, q, v in zip(sdp, n_dq, n_dkv)]
    assert ops["HGMMA"] == sum(per_wg)
    q_rows = block // 16  # 16 rows a pass of 128 threads, 8 a row
    assert ops["LDGSTS"] == config.NCHUNK * (q_rows + 4) + 8 * q_rows
    acc_pairs = config.TILE * config.CHUNK // 128 // 2  # v2 reductions a thread, a dkv block
    if red4s:
        assert ops["RED_V2"] == 0 and ops["RED_V4"] == ops["REDG"] == acc_pairs // 2 * config.NCHUNK
        assert ops["RED_V4_CONSUMER"] == ops["RED_V4"]  # the warps' own stream
        assert ops["STS_64"] == acc_pairs * config.NCHUNK
        assert ops["LDS_128"] == acc_pairs // 2 * config.NCHUNK
        assert ops["WG_BAR"] == 2
        assert ops["ARRIVE_AFTER_LDS128"] == 2
    else:
        assert ops["RED_V2"] == ops["REDG"] == acc_pairs * config.NCHUNK
        assert ops["RED_V4"] == ops["LDS_128"] == ops["WG_BAR"] == 0
    assert ops["DEPBAR0"] <= 8  # the tiles' waits, not one per WGMMA
    return res, ops


def test_fragment_coordinates_the_kernel_assumes():
    """kernel.py reads a thread's accumulator coordinates three ways: `_rows_cols` of the
    S^T / dP^T halves (8 columns a warpgroup at block 16: no V mode), warpgroup 2's columns
    offset by BLOCK / 2 (the tiled MMA over 256 threads), and the dkv block's raw order (pairs
    of adjacent columns, i // 2 % 2 the row half, `_reduce`)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90.kernel import _rows_cols

    k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
    dt, f32 = cutlass.BFloat16, cutlass.Float32
    seen = {}

    @cute.jit
    def probe():
        for block in config.BLOCKS:
            half = block // 2
            mma = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, f32, (1, 2, 1),
                                                    (config.TILE, half))  # fmt: skip
            for tid in (0, 133):
                rc = _rows_cols(mma.get_slice(tid).partition_C(
                    cute.make_identity_tensor((config.TILE, block))))  # fmt: skip
                seen[block, tid] = [[rc[r, c] for c in range(cute.size(rc, mode=[1]))]
                                    for r in range(cute.size(rc, mode=[0]))]  # fmt: skip
            one = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, f32, (1, 1, 1),
                                                    (config.TILE, block))  # fmt: skip
            crd = one.get_slice(37).partition_C(cute.make_identity_tensor((config.TILE, block)))
            seen["x", block] = [crd[i] for i in range(cute.size(crd))]
        kv = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, f32, (1, 1, 1),
                                               (config.TILE, config.CHUNK))  # fmt: skip
        crd = kv.get_slice(5).partition_C(cute.make_identity_tensor((config.TILE, config.CHUNK)))
        seen["kv"] = [crd[i] for i in range(cute.size(crd))]
        for tid in (37, 69, 127):  # the bulk / red4 staging: warp w's rows are 16 w .. 16 w + 15
            crd = kv.get_slice(tid).partition_C(
                cute.make_identity_tensor((config.TILE, config.CHUNK)))  # fmt: skip
            seen["kv", tid] = [crd[i] for i in range(cute.size(crd))]

    cute.compile(probe)
    for block in config.BLOCKS:
        for tid, row0, col0 in ((0, 0, 0), (133, 1, block // 2 + 2)):
            rows = seen[block, tid]
            assert [r[0][0] for r in rows] == [row0, row0 + 8]
            for r in rows:
                assert {c[0] for c in r} == {r[0][0]}  # one row per rows_cols row
                cols = [c[1] for c in r]
                assert cols[:2] == [col0, col0 + 1]
                assert all(block // 2 * (tid // 128) <= c < block // 2 * (tid // 128 + 1)
                           for c in cols)  # fmt: skip
    for block in config.BLOCKS:  # xchg: raw element i of one warpgroup's S^T is in head
        # half i // (size / 2) (the own halves of kernel.py `_xchg_setup`)
        raw = seen["x", block]
        assert [c[1] // (block // 2) for c in raw] == [
            i // (len(raw) // 2) for i in range(len(raw))
        ]
    for tid in (37, 69, 127):
        w, lane = tid // 32, tid % 32
        rows = {r for r, _ in seen["kv", tid]}
        assert rows == {16 * w + lane // 4, 16 * w + lane // 4 + 8}  # r % 16: the staging row
        assert {c for _, c in seen["kv", tid]} == {2 * (lane % 4) + 8 * j + e
                                                  for j in range(8) for e in (0, 1)}  # fmt: skip
    kv = seen["kv"]
    for i in range(0, len(kv), 2):
        assert kv[i][0] == 1 + 8 * ((i // 2) % 2) and kv[i + 1] == (kv[i][0], kv[i][1] + 1)


H64_KV = [(d, True) for d in config.DTYPES] + [("bfloat16", False)]


# The two-kernel h64 form (kernel_h64.py: the kv and dq parts) is candidate-only since the fused
# h64f kernel became the default at H % 64 == 0 (`_h64_candidate_params`: the bench's `split`,
# the probe): its compile checks are slow, as the file's other candidate forms' (~7.5 s of an
# idle CPU, 2026-12-07); CI keeps the standard h64f build's (test_h64f_kernel).
@pytest.mark.slow
@pytest.mark.parametrize("dtype,shfl4", slow_past(H64_KV, unpack=True))
def test_h64_kv_kernel(dtype, shfl4):
    """The h64 kv part (kernel_h64.py): no spills under 56 / 224; S^T (36) in the first consumer
    warpgroup, dP^T (32) in the second, dkv blocks with K = 64 heads (4 k-steps each: 36 / 32),
    all m64n64k16; dkv by 72 red.global.add.v4.f32 after 144 butterfly shuffles (shfl4, 8 / 16 a
    block) or the fragments' 144 red.global.add.v2 (80 / 64); dS into the workspace by 16
    32-bit stores (8 a warpgroup); q / dO / rows by cp.async (36 + 32 + 36); four named
    barriers a consumer path plus the start's sync; the waits per group of MMAs."""
    res, ops = _compiled(config.params_h64(dtype, "kv", shfl4=shfl4))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    # the shared-memory plan and the cubin's static bytes within the block's 227 KB
    assert res["smem_bytes"] + config.h64_kv_bytes() <= SMEM_CAPACITY
    assert res["registers"] <= 65536 // config.THREADS
    assert ops["HGMMA"] == 36 + 32 + 4 * (9 + 8) == 136
    assert ops["HGMMA"] == len(re.findall(r"HGMMA\.64x64x16\.F32", _sass_of(dtype, "kv", shfl4)))
    if shfl4:
        assert ops["RED_V4"] == ops["REDG"] == 72 and ops["RED_V2"] == 0
        assert ops["SHFL"] == 144
    else:
        assert ops["RED_V2"] == ops["REDG"] == 144 and ops["RED_V4"] == ops["SHFL"] == 0
    assert ops["STG"] == 16
    assert ops["LDGSTS"] == 9 * 4 + 8 * 4 + 9 * 4
    assert ops["BAR"] == 2 * 4 + 1
    assert ops["DEPBAR0"] <= 8


# CI: the first dtype's build (its code the other's but the element type); bf16's is slow (~5 s
# of an idle CPU, 2026-12-07), as the other h64 parts' second dtype
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_h64f_kernel(dtype):
    """The fused h64 kernel (kernel_h64f.py, the default at H % 64 == 0): no spills under the
    setmaxnreg split 24 / 240 (168 at launch); the kv part's 136 m64n64k16 MMAs (S^T 36, dP^T 32,
    dkv 4 x 17) plus the dq^T blocks' 36 (4 k-steps x 9 blocks, both operands transposed); dkv by
    the kv part's 72 red.global.add.v4.f32 after 144 shuffles; no workspace stores, dq by 36
    128-bit stores (4 a 64 x 64 block a thread) through the dead stage; the gather by cp.async
    as the kv part's (q 36 + dO 32 + rows 36); four named barriers a consumer tile, two in the
    epilogue, each path, plus the start's sync."""
    res, ops = _compiled(config.params_h64(dtype, "fused"))
    sass = _build(config.params_h64(dtype, "fused"))[1]
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["smem_bytes"] + config.h64f_bytes() <= SMEM_CAPACITY
    assert res["registers"] <= 65536 // config.THREADS
    assert f"USETMAXREG.DEALLOC.CTAPOOL {hex(config.H64F_PRODUCER_REGS)} " in sass
    assert f"USETMAXREG.TRY_ALLOC.CTAPOOL UP0, {hex(config.H64F_CONSUMER_REGS)} " in sass
    assert ops["HGMMA"] == 136 + 36 == len(re.findall(r"HGMMA\.64x64x16\.F32", sass))
    assert len(re.findall(r"HGMMA\.64x64x16\.F32(?:\.\w+)? R\d+, gdesc\[UR\d+\]\.tnspA\.tnspB",
                          sass)) == 36  # fmt: skip
    assert ops["RED_V4"] == ops["REDG"] == 72 and ops["SHFL"] == 144
    assert sass.count("STG.E.128 ") == 36 and ops["STG"] == 0
    assert ops["LDGSTS"] == 9 * 4 + 8 * 4 + 9 * 4
    assert ops["BAR"] == 2 * (4 + 2) + 1


@pytest.mark.slow  # a candidate form (see test_h64_kv_kernel)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_h64_dq_kernel_128(dtype):
    """The h64 dq part at 128 heads a CTA (one 192-column group): one dq^T block a consumer
    warpgroup at m64n128 (3 x 4 k-steps), the group's three row chunks (3 x 4 cp.async) and the
    dS block 128 heads wide (8), no spills."""
    res, ops = _compiled(config.params_h64(dtype, "dq", dq_heads=128))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["registers"] <= 65536 // config.H64_DQ_THREADS
    sass = _sass_of(dtype, "dq", dq_heads=128)
    assert ops["HGMMA"] == 12 == len(re.findall(r"HGMMA\.64x128x16\.F32", sass))
    assert ops["LDGSTS"] == 3 * 4 + 8
    assert sass.count("DEPBAR.LE SB0, 0x1 ") == 1


@pytest.mark.slow  # a candidate form (see test_h64_kv_kernel)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_h64_dq_kernel(dtype):
    """The h64 dq part: three consumer warpgroups at setmaxnreg 152 (512 threads: 128 registers
    at launch), no spills with 96 accumulator registers; 3 x 3 dq^T blocks of 4 k-steps (36
    m64n64k16); the rows and the dS block by cp.async (36 + 4); no reductions; the producer at
    lag 1 (one cp.async group left in flight before signalling the previous tile)."""
    res, ops = _compiled(config.params_h64(dtype, "dq"))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["registers"] <= 65536 // config.H64_DQ_THREADS
    assert ops["HGMMA"] == 36
    assert ops["LDGSTS"] == 9 * 4 + 4
    assert ops["REDG"] == 0
    sass = _sass_of(dtype, "dq")
    assert sass.count("DEPBAR.LE SB0, 0x1 ") == 1 and sass.count("DEPBAR.LE SB0, 0x0 ") == 1


def _sass_of(dtype, part, shfl4=True, dq_heads=64) -> str:
    """The SASS text of an h64 build (`_build`'s, compiled once a process)."""
    return _build(config.params_h64(dtype, part, shfl4=shfl4, dq_heads=dq_heads))[1]


def test_h64_fragment_coordinates():
    """kernel_h64.py's assumptions about one warpgroup's m64n64 accumulator (S^T / dP^T and the
    dkv block alike): raw elements [0, 16) are heads [0, 32) and [16, 32) heads [32, 64) (the
    own halves), element e is in row r + 8 ((e // 2) % 2) (the row ids' index), elements 2 j
    and 2 j + 1 are adjacent heads of one row (the workspace's 32-bit pairs), and the S^T /
    dP^T and dkv fragments place every thread on the same rows."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    k_major, mn_major = OperandMajorMode.K, OperandMajorMode.MN
    dt, f32 = cutlass.BFloat16, cutlass.Float32
    seen = {}

    @cute.jit
    def probe():
        sdp = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, k_major, f32, (1, 1, 1),
                                                (config.TILE, config.H64_BLOCK))  # fmt: skip
        kv = sm90_utils.make_trivial_tiled_mma(dt, dt, k_major, mn_major, f32, (1, 1, 1),
                                               (config.TILE, config.CHUNK))  # fmt: skip
        for tid in (0, 37, 127):
            a = sdp.get_slice(tid).partition_C(
                cute.make_identity_tensor((config.TILE, config.H64_BLOCK)))  # fmt: skip
            b = kv.get_slice(tid).partition_C(
                cute.make_identity_tensor((config.TILE, config.CHUNK)))  # fmt: skip
            seen[tid] = ([a[i] for i in range(cute.size(a))], [b[i] for i in range(cute.size(b))])

    cute.compile(probe)
    for tid, (sdp, kv) in seen.items():
        assert len(sdp) == 32
        assert all(c // 32 == e // 16 for e, (_, c) in enumerate(sdp))
        r0 = 16 * (tid // 32) + (tid % 32) // 4
        assert all(r == r0 + 8 * ((e // 2) % 2) for e, (r, _) in enumerate(sdp))
        assert all(sdp[2 * j + 1] == (sdp[2 * j][0], sdp[2 * j][1] + 1) for j in range(16))
        assert [kv[2 * h][0] for h in range(2)] == [r0, r0 + 8]


def _frag(lane: int, e: int) -> tuple[int, int]:
    """(row, column) of raw element e of lane's m64n64 accumulator in warp 0 (the WGMMA
    fragment: rows lane // 4 + 8 ((e // 2) % 2), columns 8 (e // 4) + 2 (lane % 4) + e % 2)."""
    return lane // 4 + 8 * ((e // 2) % 2), 8 * (e // 4) + 2 * (lane % 4) + e % 2


def test_h64_shfl4_covers_every_element_once():
    """kernel_h64.py `_reduce_shfl4` replayed on one warp's dkv fragment: after the butterfly
    exchange each lane's four floats a (row half, group pair) are four adjacent columns of one
    row starting at the column the kernel computes (a multiple of 4), holding the accumulator's
    values there, and the warp's quads cover its 16 rows x 64 columns once. The fragment rule
    `_frag` checked against the DSL's partition on four lanes (a probe of all 32 exhausts the
    DSL's memory)."""
    import cutlass
    import cutlass.cute as cute
    import cutlass.utils.hopper_helpers as sm90_utils
    from cutlass.cute.nvgpu import OperandMajorMode

    seen = {}

    @cute.jit
    def probe():
        kv = sm90_utils.make_trivial_tiled_mma(
            cutlass.BFloat16, cutlass.BFloat16, OperandMajorMode.K, OperandMajorMode.MN,
            cutlass.Float32, (1, 1, 1), (config.TILE, config.CHUNK))  # fmt: skip
        for lane in (0, 1, 6, 31):
            crd = kv.get_slice(lane).partition_C(
                cute.make_identity_tensor((config.TILE, config.CHUNK)))  # fmt: skip
            seen[lane] = [crd[i] for i in range(cute.size(crd))]

    cute.compile(probe)
    for lane, crd in seen.items():
        assert crd == [_frag(lane, e) for e in range(32)]
    covered = []
    for lane in range(32):
        odd = lane % 2 == 1
        acc = [_frag(lane, e) for e in range(32)]  # each element's value is its coordinate
        partner = [_frag(lane ^ 1, e) for e in range(32)]
        for h in range(2):
            for g in range(4):
                ev, od = 8 * g + 2 * h, 8 * g + 4 + 2 * h
                # what the partner sends (its parity's choice): the odd lane its even group's
                # pair, the even lane its odd group's
                got = [partner[od + x] if odd else partner[ev + x] for x in range(2)]
                keep = [acc[od + x] if odd else acc[ev + x] for x in range(2)]
                quad = got + keep if odd else keep + got
                col = acc[od][1] - 2 if odd else acc[ev][1]
                row = acc[ev][0]
                assert col % 4 == 0
                assert quad == [(row, col + x) for x in range(4)]
                covered += quad
    assert sorted(covered) == sorted((r, c) for r in range(16) for c in range(64))
