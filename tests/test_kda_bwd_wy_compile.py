"""Kimi Delta Attention's backward WY kernel compiled for sm_90a on the CPU (the DSL compiles,
ptxas assembles, cuobjdump reads the cubin), both dtypes: 384 threads (two math warpgroups
split by value / key channels; the 256-thread form deleted 2026-12-06, NOTES
"next/lin-losers"), nothing spilled, 139-165 registers (cu13 ptxas; REGISTERS), no
setmaxnreg; 199,680 bytes of shared memory (within config's bound); each math warpgroup's code
the WGMMAs T^T du, T^T dw (4 x 64x64x16 each, the tiles' dtype, B transposed, the warpgroup's
channels), dvb u^T + dkb w^T (16 x 64x64x16 from shared memory, whole in both), and the eight
sub-chunk blocks of dx and dy (one 64x64x16 each, bf16 for both dtypes, B transposed), twelve
commit groups; seven TMA tiles (thirteen 64-column boxes) on six mbarriers, one a load group
(config.LOAD_GROUPS); dvb's / dkb's halves by 8 stmatrix, (beta dA)^T by four transposed
(warpgroup 1's); three quad row dots (12 butterfly shuffles, warpgroup 2's); dk and dG added
onto kernel 2's in place (dG by bulk reduce-add)."""

from __future__ import annotations

import sys
import tempfile
from collections import Counter
from pathlib import Path

import pytest
from sweeps import slow_past  # tests/ is on the path

pytest.importorskip("cutlass")

sys.path.insert(0, str(Path(__file__).parent))
from cubins import (  # noqa: E402
    indirect_targets,
    pin_unaligned_barriers,
    unaligned_offsets,
    wait_pin,
)
from dsl_toolchain import dsl_toolchain  # noqa: E402

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import SPEC, config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.compile import (  # noqa: E402
    compile_kda_bwd_wy,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

# compiled figures under cu13 (2026-12-06), (plain, dv16, dv16 + dk16); the 256-thread kernel's
# were 239, 239, 241
REGISTERS = {"bfloat16": (139, 139, 165), "float16": (139, 139, 165)}
FLAGS = ({}, {"dv16": True}, {"dv16": True, "dk16": True})
SMEM = 196608 + 3 * 2 * 128 * 4  # warpgroup 1's row-dot partials after the tables


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, dv16=False, dk16=False, flow=False, token_rows=False):
        key = (dtype, dv16, dk16) + (("token_rows",) if token_rows else ())
        if key not in cache:
            params = dict(config.params_for(dtype, dv16=dv16, dk16=dk16, token_rows=token_rows))
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_kda_bwd_wy(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                        kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
                # the barrier pin's inputs (`test_barriers_one_site`)
                pins = (sass, unaligned_offsets(cubin), indirect_targets(cubin))
            smem = kernel.shared_storage.size_in_bytes()
            cache[key] = (res, sass_instructions(sass), smem, pins)
        found = cache[key]
        return found if flow else found[:3]

    return get


def test_standard_params():
    assert SPEC.name == "kda_bwd_wy_sm90"
    keys = [tuple(dict(p).get(f, False) for f in ("dtype", "dv16", "dk16", "token_rows"))
            for p in SPEC.standard_params()]  # fmt: skip
    # the token_rows forms standard since NATIVE_STORES went on (integration45's 2eaea6d2)
    flags = ((False, False, False), (True, False, False), (True, True, False),
             (True, False, True), (True, True, True))  # fmt: skip
    assert keys == [(d, *f) for f in flags for d in config.DTYPES]
    assert "dv16" not in dict(config.params_for("bfloat16"))  # the old key unchanged
    assert "dk16" not in dict(config.params_for("bfloat16", dv16=True))


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dk16_writes_the_final_dk_in_16_bits(compiled, dtype):
    """`dk16` (2026-12-06, next/kda-final-outputs: the op's dk without the epilogue): dk's
    third term reads the fp32 partial (16 LDG.E.64 a thread, its warpgroup's 64 channels, as
    before) and writes kernel 2's + the WY half once in 16 bits (16 packed STG.E) instead of
    back in fp32 (16 STG.E.64); every other memory op unchanged; nothing spilled (a row's 8
    pairs held before its stores: 139 -> 165 registers)."""
    res, instrs, _ = compiled(dtype, dv16=True, dk16=True)
    _, base, _ = compiled(dtype, dv16=True)
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base))
    assert ops0["STG.E.64"] == 3 * 16 and ops["STG.E.64"] == 2 * 16
    assert ops["STG.E"] == ops0["STG.E"] + 16
    assert ops["LDG.E"] == ops0["LDG.E"] and ops["LDG.E.64"] == ops0["LDG.E.64"] == 3 * 16
    # each row's 16 fp32 pairs loaded before its first 16-bit store (next/kda-final-outputs
    # had one load a pair behind the previous pair's store: 32 turns, WY +0.4 ms on the H100)
    assert _store_then_load(instrs) == _store_then_load(base)
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][2]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dv16_stores_dv_in_16_bits(compiled, dtype):
    """`dv16` (2026-12-06, next/kda-wy-acc: the op's cast of dv to v's 16-bit dtype moved in):
    dv's 32 values a thread (its warpgroup's 64 channels) leave as 16 packed 16-bit pairs
    (STG.E) instead of 16 fp32 pairs (STG.E.64); dk's stores and every load unchanged;
    registers as without it, nothing spilled."""
    res, instrs, _ = compiled(dtype, dv16=True)
    _, base, _ = compiled(dtype)
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base))
    assert ops0["STG.E.64"] == 4 * 16 and ops["STG.E.64"] == 3 * 16
    assert ops["STG.E"] == ops0["STG.E"] + 16
    assert ops["LDG.E"] == ops0["LDG.E"] and ops["LDG.E.64"] == ops0["LDG.E.64"]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][1]


# CI: the first dtype's compile (~6 s of a CPU, 2026-12-06), read by this test and the next
# two; the other's is slow
@pytest.mark.parametrize("flags", range(3))
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_registers_and_no_spills(compiled, dtype, flags):
    """384 threads within the launch's 168 registers a thread (no setmaxnreg), nothing
    spilled."""
    res, instrs, _ = compiled(dtype, **FLAGS[flags])
    assert res["registers"] <= config.REGISTERS == 168
    assert res["registers"] * config.THREADS <= 65536
    if dsl_toolchain() == "cu13":
        assert res["registers"] == REGISTERS[dtype][flags]
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL", "USETMAXREG"))]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_shared_memory_fits(compiled, dtype):
    res, _, smem = compiled(dtype)
    assert smem == SMEM <= config.smem_bytes() <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_wgmmas_and_tma(compiled, dtype):
    """Each math warpgroup's code 32 HGMMA 64x64x16: dvb's and dkb's halves (4 each, the
    tiles' dtype, B transposed), dA whole from shared memory (16, the tiles' dtype; a CTA 32:
    dA twice), dx's and dy's blocks (4 each, bf16, B transposed), twelve commit groups; dvb's /
    dkb's halves by 8 plain stmatrix, (beta dA)^T by 4 transposed (warpgroup 1's); half the
    one-warpgroup kernel's per-thread SIMT (MUFU.EX2 116, the tables' two branches both in
    it); dbeta's quad sums (12 shuffles, warpgroup 2's)."""
    _, instrs, _ = compiled(dtype)
    ops = Counter(op for op, _ in instrs)
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    assert len(shapes) == 32 and all(op.startswith("HGMMA.64x64x16") for op, _ in shapes)
    tile = "BF16" if dtype == "bfloat16" else "F32"
    assert sum("tnspB" in a for _, a in shapes) == 16
    assert sum(op.endswith(".BF16") for op, _ in shapes) == (32 if tile == "BF16" else 8)
    assert sum("gsb0" in a for _, a in shapes) == 4 + 8  # one commit group a product
    assert ops["UTMALDG.4D"] == 6 * 2 + 1 and ops["SYNCS.EXCH.64"] == 6
    assert ops["STSM.16.M88.4"] == 8 and ops["STSM.16.MT88.4"] == 4
    assert ops["SHFL.BFLY"] == 12 and ops["MUFU.EX2"] == 116


def _store_then_load(instrs) -> int:
    """How often a global load comes right after a global store in program order (LDG after
    STG, other instructions between ignored): each is a round trip the thread waits for behind
    its own store where the compiler cannot prove the two apart."""
    mem = [op[:3] for op, _ in instrs if op.startswith(("LDG", "STG"))]
    return sum(a == "STG" and b == "LDG" for a, b in zip(mem, mem[1:]))


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dk_and_dg_accumulated_in_place(compiled, dtype):
    """The accumulate form (2026-12-06, next/kda-wy-acc; its regressions fixed on
    next/kda-bwd-regress): dk's three terms each a read-modify-write of the thread's fp32 pairs
    (3 x 16 LDG.E.64, its warpgroup's 64 channels, each row's loads before its stores: six
    store-then-load turns in the code, one a term's row), kernel 2's dk rows prefetched into L2
    for the first term (one UBLKPF.L2 in a lane loop, warpgroup 1's); dG's reverse cumsum
    written over its rows in shared memory and added onto kernel 2's dG by one bulk reduce-add
    a row's half (UBLKRED .ADD.F32.RN): no load of kernel 2's dG (10 LDG.E: G's table rows and
    beta; kda-wy-acc's read-modify-write loop had 8 more and 14 turns in the code, 64 of them
    run a thread); stores: dv's 16 and dk's 3 x 16 (64 STG.E.64), dbeta's 2 STG.E; no local
    memory."""
    _, instrs, _ = compiled(dtype)
    ops = Counter(op for op, _ in instrs)
    assert ops["LDG.E.64"] == 3 * 16 and ops["LDG.E"] == 10
    assert ops["STG.E.64"] == 4 * 16 and ops["STG.E"] == 2
    assert ops["UBLKRED.G.S.ADD.F32.RN"] == 1 and ops["UBLKPF.L2"] == 1
    assert _store_then_load(instrs) == 3 * 2
    assert not [op for op in ops if op.startswith(("LDL", "STL"))]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_load_barriers_split(compiled, dtype):
    """The chunk's TMA tiles on one mbarrier a load group (config.LOAD_GROUPS, 6; 2026-12-06,
    was one barrier pair): 6 inits, 6 arms, no consumer release, the math warpgroups' waits one
    a group: dvb's half = T^T du (4 HGMMA) retired before v's wait, dkb's (4) before u's and
    w's; dA's 16 after both, in flight across k's wait."""
    _, instrs, _ = compiled(dtype)
    n = len(config.LOAD_GROUPS)
    assert wait_pin(instrs, n, [8 * g for g in range(n)]) == [
        "wait 0", "HGMMA x4", "WARPGROUP", "wait 2", "wait 3", "HGMMA x4", "WARPGROUP",
        "wait 1", "wait 4", "HGMMA x16", "wait 5"]  # fmt: skip


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_barriers(compiled, dtype):
    """The named barriers (wy_grads.py): bar 0 once; BAR_BOTH (3, 256) twice: after
    dvb's and dkb's half stores (8 STSM), before dA's HGMMAs; after (beta dA)^T's transposed
    stmatrix, before the block operands' stores; BAR_DOTS (6, 7, 8; 256) each one wait
    (warpgroup 2) and one arrive (warpgroup 1), so no barrier phase is waited at two
    instructions; the warpgroup's own barrier (4 + kh in a register, 128) seven times."""
    _, instrs, _ = compiled(dtype, dv16=True, dk16=True)
    flat = [(op, a.strip()) for op, a in instrs]
    bars = [x for x in flat if x[0].startswith("BAR.") and x[0] != "BAR.ALL.CTA"
            and not x[1].startswith(("gsb0", "SB0"))]  # fmt: skip
    dots = [(op, f"0x{i:x}, 0x100") for i in (6, 7, 8) for op in ("BAR.SYNC.DEFER_BLOCKING",
                                                                  "BAR.ARV")]  # fmt: skip
    own = [a for _, a in bars if a.endswith(", 0x80")]
    assert len(own) == 7 and len(set(own)) == 1 and own[0].startswith("R")
    assert sorted(x for x in bars if not x[1].endswith(", 0x80")) == sorted(
        [("BAR.SYNC.DEFER_BLOCKING", "0x0")] + [("BAR.SYNC.DEFER_BLOCKING", "0x3, 0x100")] * 2
        + dots
    )  # fmt: skip
    both = [i for i, x in enumerate(flat) if x == ("BAR.SYNC.DEFER_BLOCKING", "0x3, 0x100")]
    plain = [i for i, (op, _) in enumerate(flat) if op == "STSM.16.M88.4"]
    tr = [i for i, (op, _) in enumerate(flat) if op == "STSM.16.MT88.4"]
    hgmma = [i for i, (op, a) in enumerate(flat) if op.startswith("HGMMA") and "tnspB" not in a]
    assert max(plain) < both[0] < min(hgmma) and max(tr) < both[1]


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_barriers_one_site(compiled, dtype):
    """Review of integration44 (NOTES "integration44 reviewed for hangs and races"): no
    named barrier is waited at two instructions a phase in the listing's control flow
    (two_site_barriers: BAR_BOTH's two waits follow each other in both math warpgroups' one
    code path, each BAR_DOTS slot is waited once, by warpgroup 2, the warpgroup's own barrier
    by id in a register at shared sites), so every BAR.SYNC stays in the aligned form and none
    is in the cubin's unaligned list (synccheck's "Divergent thread(s) in block" otherwise)."""
    _, _, _, (sass, unaligned, indirect) = compiled(dtype, dv16=True, dk16=True, flow=True)
    bars = pin_unaligned_barriers(sass, unaligned, set(), indirect)
    dots = [b for b in bars if b.barrier in ("0x6", "0x7", "0x8")]
    assert sorted((b.barrier, b.kind) for b in dots) == [
        (f"0x{i:x}", kind) for i in (6, 7, 8) for kind in ("ARV", "SYNC")
    ]


# CI: the dk16 key (the op's; `token_rows` a standard form, `_standard_params`: the varlen slot
# layout's default since ops/_linattn_varlen.py NATIVE_STORES went on, and this its only CI
# compile); without dk16 it is slow (its token_rows compile, ~4 s of an idle CPU, 2026-12-07,
# this check's alone: the same fourteen loads and unchanged rest)
@pytest.mark.parametrize("dk16", slow_past([False, True], keep=True))
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_token_rows_resources(compiled, dtype, dk16):
    """`token_rows` on the dv16 (+ dk16) keys (the op's default forms behind ops/_linattn_varlen.py
    NATIVE_STORES, on; NOTES "next/varlen-stores"): dk, dv, dG, dbeta at the per-slot tables' token
    rows cost fourteen global loads (two table entries at each of seven row groups: dk's L2
    prefetch, dv, dbeta, dk's three adds (the first, `_kb_rows`' term, was at the slot rows until
    next/int45-review), dG's bulk reduce-adds) and registers (bf16 166 / 168, fp16 168 / 166 of 168
    on 2026-12-06 cu13; 139 / 165 without), nothing spilled; shared memory, products, TMA loads,
    stores, bulk ops and barriers as without."""
    res, instrs, smem = compiled(dtype, dv16=True, dk16=dk16, token_rows=True)
    _, base, smem0 = compiled(dtype, dv16=True, dk16=dk16)
    ops, ops0 = (Counter(op for op, _ in x) for x in (instrs, base))
    assert res["registers"] <= config.REGISTERS == 168 and smem == smem0
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert ops["LDG.E"] == ops0["LDG.E"] + 14
    for prefix in ("HGMMA", "UTMA", "UBLK", "STG", "STS", "LDS", "LDG.E.64", "BAR", "MUFU"):
        assert {o: x for o, x in ops.items() if o.startswith(prefix)} == {
            o: x for o, x in ops0.items() if o.startswith(prefix)}, prefix  # fmt: skip
