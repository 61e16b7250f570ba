"""Kimi Delta Attention's backward kernel 2 (pass 3's output side) compiled for sm_90a on the
CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin), both dtypes: 384 threads
(two math warpgroups split by key channels; the 256-thread form deleted 2026-12-06, NOTES
"next/lin-losers"), nothing spilled, 136-139 registers (cu13 ptxas), no setmaxnreg; 202,752
bytes of shared memory (within config's bound); each math warpgroup's code the WGMMAs -dU h^T,
dO h^T, U dh^T and dO U^T (8 x 64x64x16 each, the tiles' dtype; S whole in both) and the eight
sub-chunk blocks of dq and dk (one 64x64x16 each, bf16 for both dtypes, B transposed), twelve
commit groups; seven TMA tiles (fourteen 64-column halves) on five mbarriers, one a load group
(config.LOAD_GROUPS, 2026-12-06); dP^T by four transposed stmatrix a thread (warpgroup 1's);
te's column sums by 48 butterfly shuffles (16 columns x lanes 4, 8, 16)."""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import NamedTuple

import pytest
from sweeps import slow_past  # tests/ is on the path

pytest.importorskip("cutlass")

sys.path.insert(0, str(Path(__file__).parent))
from cubins import pin_unaligned_barriers, unaligned_offsets, wait_pin  # noqa: E402
from dsl_toolchain import dsl_toolchain  # noqa: E402

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import SPEC, config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.compile import (  # noqa: E402
    compile_kda_bwd_chunk,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

# compiled figures under cu13 (2026-12-06), (plain, dw16, dw16 + dq16); the 256-thread kernel's
# were 228, 228, 222
REGISTERS = {"bfloat16": (137, 137, 137), "float16": (139, 139, 136)}
FLAGS = ({}, {"dw16": True}, {"dw16": True, "dq16": True})
SMEM = 202752


class Built(NamedTuple):
    res: dict  # inspect_cubin's
    instrs: list  # (op, operands) in order
    smem: int  # the kernel's SharedStorage
    sass: str  # cuobjdump's listing
    unaligned: set  # cubins.unaligned_offsets


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, dw16=False, dq16=False, token_rows=False):
        key = (dtype, dw16, dq16) + (("token_rows",) if token_rows else ())
        if key not in cache:
            params = dict(config.params_for(dtype, dw16=dw16, dq16=dq16, token_rows=token_rows))
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_kda_bwd_chunk(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                           kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
                unaligned = unaligned_offsets(cubin)
            cache[key] = Built(res, sass_instructions(sass), kernel.shared_storage.size_in_bytes(),
                               sass, unaligned)  # fmt: skip
        return cache[key]

    return get


def test_standard_params():
    assert SPEC.name == "kda_bwd_chunk_sm90"
    keys = [tuple(dict(p).get(f, False) for f in ("dtype", "dw16", "dq16", "token_rows"))
            for p in SPEC.standard_params()]  # fmt: skip
    # the token_rows form standard since NATIVE_STORES went on (integration45's 2eaea6d2)
    flags = ((False, False, False), (True, False, False), (True, True, False), (True, False, True))
    assert keys == [(d, *f) for f in flags for d in config.DTYPES]
    assert "dw16" not in dict(config.params_for("bfloat16"))  # the old key unchanged
    assert "dq16" not in dict(config.params_for("bfloat16", dw16=True))


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dq16_stores_the_ops_dq_in_16_bits(compiled, dtype):
    """`dq16` (2026-12-06, next/kda-final-outputs: q unscaled, the scale in registers, the op's
    dq without the epilogue): dq's 32 values a thread (its warpgroup's 64 key channels) leave
    as 16 packed 16-bit pairs (STG.E) instead of 16 fp32 pairs (STG.E.64), over dw16; dk's 16
    STG.E.64 and every load unchanged; nothing spilled."""
    res, instrs = compiled(dtype, dw16=True, dq16=True)[:2]
    base = compiled(dtype, dw16=True).instrs
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base))
    assert ops0["STG.E.64"] == 2 * 16 and ops["STG.E.64"] == 16
    assert ops["STG.E"] == ops0["STG.E"] + 16
    assert ops["LDG.E"] == ops0["LDG.E"]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][2]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dw16_stores_dw_in_16_bits(compiled, dtype):
    """`dw16` (2026-12-06, next/kda-wy-acc: the WY kernel's operand, the op's cast moved in):
    dw's 32 values a thread leave as 16 packed 16-bit pairs (STG.E) instead of 16 fp32 pairs
    (STG.E.64); dq's and dk's 2 x 16 STG.E.64 and the rest unchanged; registers as without it,
    nothing spilled."""
    res, instrs = compiled(dtype, dw16=True)[:2]
    base = compiled(dtype).instrs
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base))
    assert ops0["STG.E.64"] == 3 * 16 and ops["STG.E.64"] == 2 * 16
    assert ops["STG.E"] == ops0["STG.E"] + 16
    assert ops["LDG.E"] == ops0["LDG.E"]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][1]


# CI: the first dtype. `token_rows` is a standard form (`_standard_params`: the varlen slot
# layout's default since ops/_linattn_varlen.py NATIVE_STORES went on), and this its only CI
# compile (test_build_sm90's representative is the first standard key, without it)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_token_rows_resources(compiled, dtype):
    """`token_rows` on the dw16 key (the op's default form behind ops/_linattn_varlen.py
    NATIVE_STORES, on; NOTES "next/varlen-stores"): dq, dk, dG at the per-slot tables' token rows
    cost six global loads (two table entries at each of the three store groups) and registers (153
    of 168 on 2026-12-06, 137 without), nothing spilled; shared memory, products, TMA loads, stores
    and barriers as the dw16 key's."""
    res, instrs, smem = compiled(dtype, dw16=True, token_rows=True)[:3]
    base = compiled(dtype, dw16=True)
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base.instrs))
    assert res["registers"] <= config.REGISTERS == 168 and smem == base.smem
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert ops["LDG.E"] == ops0["LDG.E"] + 6
    for prefix in ("HGMMA", "UTMA", "STG", "STS", "LDS", "BAR", "MUFU"):
        assert {o: x for o, x in ops.items() if o.startswith(prefix)} == {
            o: x for o, x in ops0.items() if o.startswith(prefix)}, prefix  # fmt: skip


# CI: the first dtype's compile, read by this test and the next two; the other's is slow (~7 s
# of CI's CPU, 2026-12-06)
@pytest.mark.parametrize("flags", range(3))
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_registers_and_no_spills(compiled, dtype, flags):
    """384 threads within the launch's 168 registers a thread (no setmaxnreg: ptxas dropped a
    40 / 232 pair as moot), nothing spilled."""
    res, instrs = compiled(dtype, **FLAGS[flags])[:2]
    assert res["registers"] <= config.REGISTERS == 168
    assert res["registers"] * config.THREADS <= 65536
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][flags]
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL", "USETMAXREG"))]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_shared_memory_fits(compiled, dtype):
    res, _, smem = compiled(dtype)[:3]
    assert smem == SMEM <= config.smem_bytes() <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_wgmmas_and_tma(compiled, dtype):
    """Each math warpgroup's code (one copy, both run it): 40 HGMMA 64x64x16 (dw, dqe, S, dke 8
    each in the tiles' dtype, dq's and dk's 4 blocks bf16, B transposed; a CTA 80, S twice),
    twelve commit groups; the TMA boxes, dP^T's 4 transposed stmatrix; per thread half the
    one-warpgroup kernel's SIMT: te's shuffles 96 -> 48, MUFU.EX2 215 -> 117 (the tables' two
    branches both in the code), the fp32 row stores 96 -> 48 STG.E.64, dG's 8 STG.E (the
    finish loop unrolled 8); G's 8 loads."""
    instrs = compiled(dtype).instrs
    ops = Counter(op for op, _ in instrs)
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    assert len(shapes) == 40 and all(op.startswith("HGMMA.64x64x16") for op, _ in shapes)
    blocks = [op for op, a in shapes if "tnspB" in a]  # dq's and dk's sub-chunk blocks
    assert len(blocks) == 8 and all(op.endswith(".BF16") for op in blocks)
    tile = "BF16" if dtype == "bfloat16" else "F32"
    assert all(op.endswith(tile) for op, a in shapes if "tnspB" not in a)
    assert sum("gsb0" in a for _, a in shapes) == 4 + 8  # one commit group a product
    assert ops["UTMALDG.4D"] == 10 and ops["UTMALDG.5D"] == 4 and ops["SYNCS.EXCH.64"] == 5
    assert ops["STSM.16.MT88.4"] == 4
    assert ops["SHFL.BFLY"] == 48 and ops["MUFU.EX2"] == 117
    assert ops["STG.E.64"] == 3 * 16 and ops["STG.E"] == 8 and ops["LDG.E"] == 8


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_load_barriers_split(compiled, dtype):
    """The chunk's TMA tiles on one mbarrier a load group (config.LOAD_GROUPS, 5, in the math
    warpgroups' order; 2026-12-06, was one barrier pair): 5 inits, 5 arms, no consumer release;
    the waits: the math warpgroups' one a group, the <h, dh> warps' on the states' groups. dw
    (8 HGMMA) retired before dO's wait; dqe (8) in flight across U's wait (no DEPBAR between),
    S (8) waited before the block operands' q / k wait; dke after dh's."""
    instrs = compiled(dtype).instrs
    n = len(config.LOAD_GROUPS)
    seq = wait_pin(instrs, n, [8 * g for g in config.STATE_GROUPS] + [8 * g for g in range(n)])
    assert seq[:6] == ["wait 0", "HGMMA x8", "WARPGROUP", "wait 1", "HGMMA x8", "wait 2"]
    assert seq[6:9] == ["HGMMA x8", "WARPGROUP", "wait 3"]
    assert seq[-1] == "wait 4" and "HGMMA x8" not in seq[9:]  # dke's come after dh's wait


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_barriers(compiled, dtype):
    """The named barriers (chunk_grads.py): bar 0 once; BAR_HDH (id 2) over 320 (both math
    warpgroups wait, the <h, dh> warps arrive); BAR_BOTH (3, 256) once, after dP^T's stmatrix
    (warpgroup 1's; the other warpgroup's first read of it, a WGMMA, after its own wait there);
    the warpgroup's own barrier (id 4 + kh in a register, 128) four times: G's rows, the tables,
    the block operands, dG's rows before the finish. Every shared-memory hand-over between
    threads is loaded after more bar.syncs than it was stored after (NOTES "GDN fsplit
    race")."""
    instrs = compiled(dtype).instrs
    bars = [(op, a.strip()) for op, a in instrs if op.startswith("BAR")]
    assert sorted(bars) == sorted(
        [("BAR.ARV", "0x2, 0x140"), ("BAR.SYNC.DEFER_BLOCKING", "0x0"),
         ("BAR.SYNC.DEFER_BLOCKING", "0x2, 0x140"), ("BAR.SYNC.DEFER_BLOCKING", "0x3, 0x100")]
        + [("BAR.SYNC.DEFER_BLOCKING", a) for _, a in bars if a.endswith(", 0x80")]
    )  # fmt: skip
    own = [a for _, a in bars if a.endswith(", 0x80")]
    assert len(own) == 4 and len(set(own)) == 1 and own[0].startswith("R")
    flat = [(op, a.strip()) for op, a in instrs]
    both = flat.index(("BAR.SYNC.DEFER_BLOCKING", "0x3, 0x100"))
    hdh = flat.index(("BAR.SYNC.DEFER_BLOCKING", "0x2, 0x140"))
    stsm = [i for i, (op, _) in enumerate(flat) if op.startswith("STSM")]
    assert stsm and max(stsm) < both < hdh


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_no_barrier_waited_from_two_roles(compiled, dtype):
    """The fused GDN kernel's synccheck failure (a phase of an aligned barrier waited at two
    bar.syncs, one a role: NOTES "Fused GDN backward: synccheck's divergent barrier") has no
    counterpart here: BAR_HDH's math side waits at one instruction (both math warpgroups run
    one copy of `_math`), the <h, dh> warps only arrive, and every other barrier is one role's,
    passed in turn (the per-warpgroup id in a register). So nothing is listed unaligned, and
    synccheck's 0 (H100, 13:36) is the code's, not its test cases'."""
    built = compiled(dtype)
    bars = pin_unaligned_barriers(built.sass, built.unaligned, set())
    assert [b.kind for b in bars].count("ARV") == 1  # the <h, dh> warps' BAR_HDH
