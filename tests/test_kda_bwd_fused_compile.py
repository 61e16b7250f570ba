"""Kimi Delta Attention's fused backward kernel (kernel 2 + the WY kernel, one CTA a
chunk-head) compiled for sm_90a on the CPU (the DSL compiles, ptxas assembles, cuobjdump reads
the cubin), both dtypes: 384 threads, no setmaxnreg, nothing spilled, 155-166 registers under
the launch's 168 (cu13 ptxas, 2026-12-06); 222,208 bytes of shared memory (config's bound, the
opt-in 232,448); the two kernels' code joined: their 72 HGMMA, their boxes less the four dw and
k take from HBM, their global memory ops less dw's stores and the WY kernel's G loads; the
phase hand-overs BAR_FREE_U_DH and BAR_FREE (the math warpgroups arrive, the TMA warp waits)
and dG's `fence.proxy.async.global` before the bulk reduce-adds."""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from sweeps import slow_past  # tests/ is on the path

pytest.importorskip("cutlass")

sys.path.insert(0, str(Path(__file__).parent))
from cubins import tma_arms  # noqa: E402
from dsl_toolchain import dsl_toolchain  # noqa: E402

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import config as chunk_config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.compile import (  # noqa: E402
    compile_kda_bwd_chunk,
)
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90 import SPEC, config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.compile import (  # noqa: E402
    compile_kda_bwd_fused,
    kernel_for,
)
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90.fused_grads import (  # noqa: E402
    B_PLACES,
)
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import config as wy_config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.compile import (  # noqa: E402
    compile_kda_bwd_wy,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

# compiled figures under cu13 (2026-12-06): (dv16, dv16 + dk16)
REGISTERS = {"bfloat16": (155, 157), "float16": (155, 157)}
FLAGS = ({"dv16": True}, {"dv16": True, "dk16": True})
SMEM = 202752 + 3 * 2 * 128 * 4 + 64 * 128 * 2  # kernel 2's + the row-dot partials + dw


def _build(compile_fn, params, kernel=None):
    """(resources, SASS instructions, PTX) of one compile."""
    with tempfile.TemporaryDirectory() as d:
        fn = compile_fn(params, "sm_90a", f"--keep-cubin --keep-ptx --dump-dir {d}",
                        kernel=kernel)  # fmt: skip
        cubin = fn.artifacts.CUBIN
        if isinstance(cubin, bytes):
            Path(d, "k.cubin").write_bytes(cubin)
            cubin = Path(d, "k.cubin")
        ptx = "".join(p.read_text() for p in sorted(Path(d).glob("*.ptx")))
        return inspect_cubin(cubin), sass_instructions(sass_text(cubin)), ptx


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, **flags):
        key = (dtype, tuple(sorted(flags.items())))
        if key not in cache:
            params = dict(config.params_for(dtype, **flags))
            kernel = kernel_for(params)
            res, instrs, ptx = _build(compile_kda_bwd_fused, params, kernel)
            cache[key] = (res, instrs, kernel.shared_storage.size_in_bytes())
            offsets[key] = dict(kernel.shared_storage._offsets)  # the DSL struct's field starts
            ptxs[key] = ptx
        return cache[key]

    get.offsets = offsets = {}
    get.ptx = ptxs = {}

    return get


def _ops(instrs):
    return Counter(op for op, _ in instrs)


def test_params():
    """The device pass's two forms a dtype standard (built for the A/B, taken only with the
    switch), their `token_rows` forms and the GPU tests' fp32-dv and dq16 forms candidates;
    flags in the key only when set."""
    assert SPEC.name == "kda_bwd_fused_sm90"
    keys = [dict(p) for p in SPEC.standard_params()]
    assert [(k["dtype"], k["dv16"], k.get("dk16", False)) for k in keys] == [
        (d, True, dk16) for dk16 in (False, True) for d in config.DTYPES
    ]
    cands = [dict(p) for p in SPEC.candidate_params()]
    assert [c.get("token_rows", False) for c in cands] == [True] * 4 + [False] * 4
    # the GPU tests' other keys (fp32 dv, dq16 + dv16 + dk16): prebuilt by `build --candidates`
    assert [(c.get("dq16", False), c.get("dv16", False)) for c in cands[4:]] == [
        (False, False), (False, False), (True, True), (True, True)]  # fmt: skip
    assert dict(config.params_for("bfloat16")) == {"dtype": "bfloat16", "k": 128, "v": 128}


@pytest.mark.parametrize("flags", range(len(FLAGS)))
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_registers_smem_and_no_spills(compiled, dtype, flags):
    """Within the launch's 168 registers a thread at 384 threads, nothing spilled; the shared
    memory kernel 2's plus the row-dot partials and dw, within config's bound and the CTA's
    opt-in limit (one CTA a SM, as each kernel alone)."""
    res, instrs, smem = compiled(dtype, **FLAGS[flags])
    assert res["registers"] <= config.REGISTERS == 168
    assert res["registers"] * config.THREADS <= 65536
    assert res["spill_bytes"] == 0
    assert not [op for op in _ops(instrs) if op.startswith(("LDL", "STL"))]
    assert smem == SMEM <= config.smem_bytes() <= SMEM_CAPACITY
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][flags]


def test_the_two_kernels_joined(compiled):
    """bf16 dv16 + dk16 against kernel 2 (dw16) and the WY kernel (dv16 + dk16) compiled now:
    the same 72 HGMMA; 23 boxes (14 + 13 less dw's and k's two
    each); global stores less dw's 16 (on chip: 4 more stmatrix), global loads less the WY
    kernel's 8 of G (the tables staged by phase A); one bulk reduce-add of dG's rows after one
    `fence.proxy.async.global`; 11 mbarriers."""
    _, fused, _ = compiled("bfloat16", dv16=True, dk16=True)
    _, k2, _ = _build(compile_kda_bwd_chunk, dict(chunk_config.params_for("bfloat16", dw16=True)))
    _, wy, _ = _build(compile_kda_bwd_wy, dict(wy_config.params_for("bfloat16", dv16=True,
                                                                     dk16=True)))  # fmt: skip
    f, a, b = _ops(fused), _ops(k2), _ops(wy)
    hgmma = "HGMMA.64x64x16.F32.BF16"
    assert f[hgmma] == a[hgmma] + b[hgmma] == 72
    boxes = f["UTMALDG.4D"] + f["UTMALDG.5D"]
    assert boxes == a["UTMALDG.4D"] + a["UTMALDG.5D"] + b["UTMALDG.4D"] - 4 == 23
    assert f["STG.E"] == a["STG.E"] + b["STG.E"] - 16 and f["STG.E.64"] == a["STG.E.64"] + 32
    assert f["STSM.16.M88.4"] == b["STSM.16.M88.4"] + 4
    assert f["LDG.E"] == a["LDG.E"] + b["LDG.E"] - 8 and f["LDG.E.64"] == b["LDG.E.64"]
    assert f["UBLKRED.G.S.ADD.F32.RN"] == 1 and f["FENCE.VIEW.ASYNC.G"] == 1
    assert f["SYNCS.EXCH.64"] == len(config.A_GROUPS) + len(config.B_GROUPS) == 11


# a TMA box's bytes by its dimensionality (16-bit, 64 columns: the 128-byte swizzle's width):
# 4d the token tiles' and T^T's (C = 64 rows), 5d the states' (K = 128 rows)
BOX_BYTES = {4: 64 * 64 * 2, 5: 128 * 64 * 2}


@pytest.mark.parametrize("flags", range(len(FLAGS)))
def test_each_mbarrier_armed_with_its_boxes_bytes(compiled, flags):
    """Every load mbarrier's arm (arrive.expect_tx, once) carries exactly the bytes of the TMA
    boxes completing on it, phase A's five groups as kernel 2's (du + h, dO, U, q + k, dh),
    phase B's six as the WY kernel's but dw's and k's (on chip: 0 bytes, no box). The fused
    kernel's first build armed phase A's q + k group with 16 KB for its four 8 KB boxes (k's
    bytes zeroed for both phases): the phase completed on whichever two landed first, its math
    free to read q or k before they had (next/kda-fuse-hang)."""
    compiled("bfloat16", **FLAGS[flags])
    key = ("bfloat16", tuple(sorted(FLAGS[flags].items())))
    arms = list(tma_arms(compiled.ptx[key]).values())
    assert [armed for armed, _ in arms] == [sum(BOX_BYTES[d] for d in dims) for _, dims in arms]
    kb = 1024
    assert [armed // kb for armed, _ in arms] == [48, 16, 16, 32, 32, 24, 16, 0, 16, 16, 0]
    assert [len(dims) for _, dims in arms] == [4, 2, 2, 4, 2, 3, 2, 0, 2, 2, 0]


def test_barriers(compiled):
    """Kernel 2's (bar 0; BAR_HDH 2 sync + the <h, dh> warps' arrive; BAR_BOTH 3 once) and the
    WY kernel's (BAR_BOTH twice; BAR_DOTS 6-8 sync + arrive each) named barriers, each phase at
    one instruction, and BAR_FREE (9) and BAR_FREE_U_DH (10; 288 each = the two math
    warpgroups + the TMA warp) synced once (the TMA warp) and arrived at once (the math
    threads)."""
    _, instrs, _ = compiled("bfloat16", dv16=True, dk16=True)
    bars = Counter(f"{op} {' '.join(args.split())}" for op, args in instrs if op.startswith("BAR."))
    syncs = {k: n for k, n in bars.items() if k.startswith("BAR.SYNC.DEFER_BLOCKING 0x")}
    assert syncs == {"BAR.SYNC.DEFER_BLOCKING 0x0": 1, "BAR.SYNC.DEFER_BLOCKING 0x2, 0x140": 1,
                     "BAR.SYNC.DEFER_BLOCKING 0x3, 0x100": 3,
                     "BAR.SYNC.DEFER_BLOCKING 0x6, 0x100": 1,
                     "BAR.SYNC.DEFER_BLOCKING 0x7, 0x100": 1,
                     "BAR.SYNC.DEFER_BLOCKING 0x8, 0x100": 1,
                     "BAR.SYNC.DEFER_BLOCKING 0x9, 0x120": 1,
                     "BAR.SYNC.DEFER_BLOCKING 0xa, 0x120": 1}  # fmt: skip
    arrives = {k: n for k, n in bars.items() if k.startswith("BAR.ARV")}
    assert arrives == {"BAR.ARV 0x2, 0x140": 1, "BAR.ARV 0x6, 0x100": 1, "BAR.ARV 0x7, 0x100": 1,
                       "BAR.ARV 0x8, 0x100": 1, "BAR.ARV 0x9, 0x120": 1,
                       "BAR.ARV 0xa, 0x120": 1}  # fmt: skip


def test_shared_memory_plan(compiled):
    """Phase B's boxes (fused_grads.B_PLACES) land inside their fields, 1,024-byte aligned (the
    128-byte swizzle's atom), apart from each other and from every byte phase B reads or writes
    that phase A left: dw, k, G, the tables, dP^T's tile and the dG rows (fp32 (C, 136) over dU's
    and h's bytes, kernel 2's place: adjacent fields)."""
    compiled("bfloat16", dv16=True, dk16=True)
    at = compiled.offsets[("bfloat16", (("dk16", True), ("dv16", True)))]
    tile, tt, state = 64 * 128 * 2, 64 * 64 * 2, 128 * 128 * 2
    size = {"sDO": tile, "sU": tile, "sQ": tile, "sK": tile, "sDU": tile, "sDW": tile,
            "sH": state, "sDH": state, "sP": 64 * 64 * 2, "sG": 64 * 136 * 4}  # fmt: skip
    rows = (at["sDU"], at["sDU"] + 64 * 136 * 4)
    assert at["sH"] == at["sDU"] + tile and rows[1] <= at["sH"] + state
    kept = [rows, (at["sTab"], at["sG"])]
    kept += [(at[f], at[f] + size[f]) for f in ("sG", "sK", "sDW", "sP")]
    boxes = []
    for name, (field, tiles_in) in B_PLACES.items():
        start = at[field] + tiles_in * tile
        span = (start, start + (tt if name == "tt" else tile))
        assert start % 1024 == 0 and span[1] <= at[field] + size[field], name
        boxes.append(span)
    for i, (a0, a1) in enumerate(boxes):
        for b0, b1 in kept + boxes[i + 1 :]:
            assert a1 <= b0 or b1 <= a0, (a0, a1, b0, b1)
