"""The Gated DeltaNet backward's kernel 2 (chunk-parallel pass 3) compiled for sm_90a on the
CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin), 256 threads, nothing
spilled. `_output_grads` variant: 168 registers; 156,672 bytes of shared memory (within
config's bound); per CTA the WGMMAs dO h^T, U dh^T, -dU h^T (8 x 64x128x16 each), dO U^T (8 x
64x64x16), dPD k and dPD^T q (4 x 64x128x16 each, B transposed), six commit groups; seven TMA
tiles (five token tiles, two states: fourteen 64-column halves); dPD^T by four transposed
stmatrix a thread; three quad row dots (twelve shuffles) and the finish warps' <dh, h> (five
more). WY variant (all of pass 3): 255
registers, 222,208 bytes; 80 HGMMA in 13 groups (adds T^T dw, T^T du, M k, M^T k: 4 x
64x128x16 each; dkb w^T, dvb u^T: 8 x 64x64x16 each, A from registers; K K^T: 8 x 64x64x16);
nineteen TMA halves; dw by eight stmatrix, M^T by four transposed; 37 shuffles. Both: the
TMA tiles on five mbarriers (config.LOAD_GROUPS, 2026-12-06; the `_output_grads` variant at
163 registers since)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("cutlass")

from cubins import pin_unaligned_barriers, trywait_offsets, unaligned_offsets  # noqa: E402
from dsl_toolchain import dsl_toolchain  # noqa: E402
from sweeps import slow_past  # noqa: E402  (tests/ is on the path)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.chunk_grads import (  # noqa: E402
    BAR_FINISH,
    BAR_HANDOVER,
    BAR_START,
)
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.compile import (  # noqa: E402
    compile_gdn_bwd_chunk,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

REGISTERS = {False: 168, True: 255}  # compiled figures (2026-12-04); a rise: look at it
SMEM = {False: 156672, True: 222208}
# CI: the first dtype's builds, both variants; the other dtype's are slow (tests/sweeps.py)
CONFIGS = [
    (dtype, wy) if dtype == config.DTYPES[0] else pytest.param(dtype, wy, marks=pytest.mark.slow)
    for dtype in config.DTYPES
    for wy in (False, True)
]


class Built(NamedTuple):
    res: dict  # inspect_cubin's
    instrs: list  # (op, operands) in order
    smem: int  # the kernel's SharedStorage
    sass: str  # cuobjdump's listing
    unaligned: set  # cubins.unaligned_offsets


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, wy, grouped=False, dv16=False, dqk16=False, fsplit=False, token_rows=False):
        key = (dtype, wy, grouped, dv16, dqk16) + ((True,) if fsplit else ())
        key += ("token_rows",) if token_rows else ()
        if key not in cache:
            params = dict(config.params_for(dtype, wy=wy, grouped=grouped, dv16=dv16,
                                            dqk16=dqk16, fsplit=fsplit,
                                            token_rows=token_rows))  # fmt: skip
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_gdn_bwd_chunk(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
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


@pytest.mark.parametrize(("dtype", "wy"), CONFIGS)
def test_registers_and_no_spills(compiled, dtype, wy):
    res, instrs = compiled(dtype, wy)[:2]
    assert res["registers"] <= min(REGISTERS[wy], 65536 // config.THREADS)
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]


@pytest.mark.parametrize(("dtype", "wy"), CONFIGS)
def test_shared_memory_fits(compiled, dtype, wy):
    res, _, smem = compiled(dtype, wy)[:3]
    assert smem == SMEM[wy] <= config.smem_bytes(wy=wy) <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize(("dtype", "wy"), CONFIGS)
def test_wgmmas_and_tma(compiled, dtype, wy):
    instrs = compiled(dtype, wy).instrs
    ops = [op for op, _ in instrs]
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    assert sum(op.startswith("HGMMA.64x64x16") for op, _ in shapes) == 8 + 24 * wy
    wide = [a for op, a in shapes if op.startswith("HGMMA.64x128x16")]
    assert len(wide) == 3 * 8 + 2 * 4 + 4 * 4 * wy
    # dPD k, dPD^T q (and T^T dw, T^T du, M k, M^T k): B transposed
    assert sum("tnspB" in a for a in wide) == 2 * 4 + 4 * 4 * wy
    assert sum("gsb0" in a for _, a in shapes) == 6 + 7 * wy  # one commit group a product
    assert ops.count("UTMALDG.4D") == 10 + 5 * wy and ops.count("UTMALDG.5D") == 4
    assert ops.count("STSM.16.MT88.4") == 4 + 4 * wy
    assert ops.count("STSM.16.M88.4") == 8 * wy
    assert ops.count("SHFL.BFLY") == 17 + 20 * wy


@pytest.mark.parametrize(("dtype", "wy"), CONFIGS)
def test_named_barriers_are_waits(compiled, dtype, wy):
    """Every named barrier a bar.sync, no bar.arrive: the hand-over of the stashed dG rows to
    the finish warps (BAR_FINISH, id 2, 192 threads) is a wait on both sides, so that
    racecheck sees the math warpgroup's last sRed stores (`_wy`'s read-modify-write) ordered
    before the finish warps' loads (2026-12-06: 57,024 RAW reports with its bar.arrive; see
    docs/linear_attention/NOTES.md). bar 0 once, the math warpgroup's 2 (4 with wy), the
    finish warps' own (id 3, 64 threads) once."""
    instrs = compiled(dtype, wy).instrs
    bars = [(op, a.strip()) for op, a in instrs if op.startswith("BAR")]
    assert not [op for op, _ in bars if not op.startswith("BAR.SYNC")]
    got = sorted(a for _, a in bars)
    assert got == sorted(["0x0", "0x3, 0x40"] + ["0x2, 0xc0"] * 2 + ["0x1, 0x80"] * (2 + 2 * wy))


@pytest.mark.parametrize(("dtype", "wy"), CONFIGS)
def test_load_barriers_split(compiled, dtype, wy):
    """The chunk's TMA boxes on one mbarrier a load group (config.LOAD_GROUPS, 5, in the math
    warpgroup's order; 2026-12-06, was one barrier pair): 5 inits, 5 arms (arrive.expect_tx,
    no consumer release), and the waits: the math warpgroup's one a group, the finish warps'
    on the states' groups (each wait a try_wait twice: the fast path and the retry loop). dqe
    = dO h^T (8 HGMMA) is in flight while U's group is waited: no DEPBAR between."""
    instrs = compiled(dtype, wy).instrs
    ops = [op for op, _ in instrs]
    n = len(config.LOAD_GROUPS)
    assert ops.count("SYNCS.EXCH.64") == n
    assert ops.count("SYNCS.ARRIVE.TRANS64") == n
    assert not [op for op in ops if op.startswith("SYNCS.ARRIVE.TRANS64.")]
    waits = [8 * g for g in config.STATE_GROUPS] + [8 * g for g in range(n)]
    assert sorted(trywait_offsets(instrs)) == sorted(2 * waits)
    # the math warpgroup's waits on groups 0 and 1 (only it waits on group 1) and between them
    kinds = []
    for op, a in instrs:
        if op == "SYNCS.PHASECHK.TRANS64.TRYWAIT":
            kinds.append(("wait", trywait_offsets([(op, a)])[0]))
        elif op.startswith(("HGMMA", "WARPGROUP.DEPBAR")):
            kinds.append((op.split(".")[0], None))
    end = kinds.index(("wait", 8))
    start = end - 1 - kinds[end - 1 :: -1].index(("wait", 0))
    seq = kinds[start : end + 1]
    assert [x for x, _ in seq[1:-1]] == ["HGMMA"] * 8


# slow (~4 s of CI's CPU, idle machine, 2026-12-06): `grouped` without dv16 is no standard key
# (the op's is grouped + dv16: test_dv16_resources, which CI compares with the WY build)
@pytest.mark.slow
@pytest.mark.parametrize("dtype", config.DTYPES)
def test_grouped_wy_resources(compiled, dtype):
    """`grouped` (q, k read at head hv // (HV / H), the op's path): the WY variant's registers,
    shared memory, products and loads unchanged, no spill; only the producer's head index
    differs (one integer division a CTA: a MUFU.RCP more)."""
    res, instrs, smem = compiled(dtype, True, True)[:3]
    base_res, base_instrs, base_smem = compiled(dtype, True)[:3]
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    assert res["registers"] == base_res["registers"] and smem == base_smem == SMEM[True]
    assert res["registers"] <= REGISTERS[True]
    for prefix in ("HGMMA", "UTMALDG", "STSM", "SHFL", "STG", "MUFU.EX2"):
        got = sorted(op for op, _ in instrs if op.startswith(prefix))
        assert got == sorted(op for op, _ in base_instrs if op.startswith(prefix)), prefix


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dv16_resources(compiled, dtype):
    """`dv16` with `grouped` (the op's key): the WY variant's registers and shared memory, no
    spill; dv's 32 fp32 pair stores (STG.E.64) become 32 packed 16-bit pair stores (STG.E).
    Compared with the WY build (grouped moves none of these counts: test_grouped_wy_resources,
    slow), not the grouped one: one compile fewer."""
    res, instrs, smem = compiled(dtype, True, True, True)[:3]
    base_res, base_instrs = compiled(dtype, True)[:2]
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    assert res["registers"] == base_res["registers"] and smem == SMEM[True]
    ops, base_ops = [op for op, _ in instrs], [op for op, _ in base_instrs]
    assert ops.count("STG.E.64") < base_ops.count("STG.E.64")
    if dsl_toolchain() == "cu13":
        assert ops.count("STG.E.64") == base_ops.count("STG.E.64") - 32
        assert ops.count("STG.E") == base_ops.count("STG.E") + 32
    for prefix in ("HGMMA", "UTMALDG", "STSM", "SHFL"):
        got = sorted(op for op in ops if op.startswith(prefix))
        assert got == sorted(op for op in base_ops if op.startswith(prefix)), prefix


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_dqk16_resources(compiled, dtype):
    """`dqk16` with dv16 (the op's default key, ungrouped: grouped moves no count,
    test_grouped_wy_resources): registers within the WY bound (254, 2026-12-06), shared memory
    unchanged (dk's first half in fp32 over the spent dO, U tiles), no spill; dq, dk leave as
    64 packed 16-bit pair stores (STG.E) instead of 96 fp32 pair stores (dq 32, dk 32, dk's WY
    re-store 32: STG.E.64) and dk's 32 fp32 read-backs (LDG.E.64) are gone; the stash is 64
    STS + 64 LDS a thread; products, loads and shuffles unchanged."""
    res, instrs, smem = compiled(dtype, True, False, True, True)[:3]
    base_res, base_instrs = compiled(dtype, True, False, True)[:2]
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    assert res["registers"] <= REGISTERS[True] and smem == SMEM[True]
    ops, base_ops = [op for op, _ in instrs], [op for op, _ in base_instrs]
    assert "LDG.E.64" in base_ops and "LDG.E.64" not in ops
    if dsl_toolchain() == "cu13":
        assert ops.count("STG.E.64") == base_ops.count("STG.E.64") - 96 == 0
        assert ops.count("STG.E") == base_ops.count("STG.E") + 64
        assert ops.count("STS") == base_ops.count("STS") + 64
        assert ops.count("LDS") == base_ops.count("LDS") + 64
    for prefix in ("HGMMA", "UTMALDG", "STSM", "SHFL"):
        got = sorted(op for op in ops if op.startswith(prefix))
        assert got == sorted(op for op in base_ops if op.startswith(prefix)), prefix


def _max_register_by_region(instrs) -> dict[str, int]:
    """The highest R register named in each region of the SASS between USETMAXREG
    instructions, keyed by the setmaxnreg count in force ("launch" before the first)."""
    out, cur = {}, "launch"
    for op, a in instrs:
        if op.startswith("USETMAXREG"):
            cur = str(int(a.split()[-1], 16))
        regs = [int(r) for r in re.findall(r"\bR(\d+)\b", a)]
        out[cur] = max([out.get(cur, 0)] + regs)
    return out


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_fsplit_resources(compiled, dtype):
    """`fsplit` (NOTES "two math warpgroups or two CTAs a SM?", option A'; with dv16, dqk16):
    384 threads launched at 168 registers, setmaxnreg 24 (the TMA warp's warpgroup) / 256 (the
    WY warpgroup, R0-R252 named: its `_wy` as the 256-thread kernel's, dk's row coordinates
    re-read after the hand-over, else 16 bytes spilled) / 224 (the output warpgroup, R0-R151),
    nothing spilled; shared memory unchanged (six mbarriers in the padding before G); the same
    products, loads and stores as the dqk16 build; two G loads and e^G more (each math
    warpgroup its own rows')
    and the finish's warp sum twice in the SASS (ptxas' copy for a divergent `tid < 64`); six
    load groups (dU + h, T^T + u, w + k, dO + U, q, dh); every named barrier a bar.sync: BAR_MATH
    (id 1) once, the WY warpgroup's (4) twice, the 256-thread start (5) and hand-over (6) once a
    side, finish (2) twice a side (`_rows_to_finish`: test_fsplit_rows_handover), and ptxas's
    copies of the output side's two for a diverged warp (5, 6 and 2 are unaligned:
    test_barriers_waited_from_two_roles_are_unaligned)."""
    res, instrs, smem = compiled(dtype, True, False, True, True, True)[:3]
    base_res, base_instrs = compiled(dtype, True, False, True, True)[:2]
    assert res["registers"] == 168 == 65536 // config.FSPLIT_THREADS // 8 * 8
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    assert smem == SMEM[True] <= config.smem_bytes(wy=True, fsplit=True)
    ops, base_ops = [op for op, _ in instrs], [op for op, _ in base_instrs]
    assert ops.count("USETMAXREG.DEALLOC.CTAPOOL") == 1
    assert ops.count("USETMAXREG.TRY_ALLOC.CTAPOOL") == 2
    setmax = sorted(int(a.split()[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert setmax == sorted(config.FSPLIT_REGS)
    assert sum(setmax) * 128 <= res["registers"] * config.FSPLIT_THREADS  # the CTA's pool
    for prefix in ("HGMMA", "UTMALDG", "STSM", "STG", "STS", "LDS", "MUFU.RCP"):
        got = sorted(op for op in ops if op.startswith(prefix))
        assert got == sorted(op for op in base_ops if op.startswith(prefix)), prefix
    assert ops.count("LDG.E") == base_ops.count("LDG.E") + 2  # G of its two rows
    assert ops.count("MUFU.EX2") == base_ops.count("MUFU.EX2") + 2
    assert ops.count("SHFL.BFLY") == base_ops.count("SHFL.BFLY") + 5
    n = len(config.FSPLIT_LOAD_GROUPS)
    assert ops.count("SYNCS.EXCH.64") == ops.count("SYNCS.ARRIVE.TRANS64") == n == 6
    bars = [(op, a.strip()) for op, a in instrs if op.startswith("BAR")]
    assert not [op for op, _ in bars if not op.startswith("BAR.SYNC")]
    # ptxas's diverged-warp copies (id and count in a register) of the output warpgroup's two
    # unaligned BAR_FINISH waits, after its `tid < 64` branch (taken by BRA.DIV only)
    copies = [a for _, a in bars if a.startswith("R")]
    assert len(copies) == 2
    assert sorted(a for _, a in bars if a not in copies) == sorted(
        ["0x0"] + ["0x1, 0x80"] * 1 + ["0x4, 0x80"] * 2 + ["0x5, 0x100", "0x6, 0x100"] * 2
        + ["0x2, 0x100"] * 4
    )  # fmt: skip
    # setmaxnreg in force: 24 (the producer), 256 (the WY warpgroup), 224 (the output one)
    regions = _max_register_by_region(instrs)
    assert regions["256"] < 256 and regions["224"] < 224 and regions["24"] < 24


# CI: the first dtype. `token_rows` is a standard form (`_standard_params`: the varlen slot
# layout's default since ops/_linattn_varlen.py NATIVE_STORES went on), and this its only CI
# compile (test_build_sm90's representative is the first standard key, without it)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_token_rows_resources(compiled, dtype):
    """`token_rows` on the fsplit key (the op's default form behind ops/_linattn_varlen.py
    NATIVE_STORES, on; NOTES "next/varlen-stores"): the outputs at the per-slot tables' token rows
    cost ten global loads (two table entries at each of the five store groups: dq, dv, dk,
    dbeta, dG's finish) and nothing else: 168 registers launched, setmaxnreg regions within
    their caps (the WY warpgroup's R0-R250, the output one's R0-R153 on 2026-12-06), nothing
    spilled, the same shared memory, products, TMA loads, stores, barriers, shuffles and
    exponentials as the fsplit key. (The 256-thread dqk16 key with `token_rows` spills 16
    bytes: no such candidate, and the op takes the native stores with FSPLIT only.)"""
    res, instrs, smem = compiled(dtype, True, False, True, True, True, True)[:3]
    base_res, base_instrs = compiled(dtype, True, False, True, True, True)[:2]
    assert res["registers"] == base_res["registers"] == 168
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    assert smem == SMEM[True]
    ops, base_ops = [op for op, _ in instrs], [op for op, _ in base_instrs]
    for prefix in ("HGMMA", "UTMALDG", "STSM", "STG", "STS", "LDS", "BAR", "SHFL", "MUFU",
                   "USETMAXREG"):  # fmt: skip
        got = sorted(op for op in ops if op.startswith(prefix))
        assert got == sorted(op for op in base_ops if op.startswith(prefix)), prefix
    assert ops.count("LDG.E") == base_ops.count("LDG.E") + 10
    regions = _max_register_by_region(instrs)
    assert regions["256"] < 256 and regions["224"] < 224 and regions["24"] < 24


def _regions(instrs) -> dict[str, list[tuple[str, str]]]:
    """The SASS's instructions by setmaxnreg region (`_max_register_by_region`'s keys)."""
    out, cur = {}, "launch"
    for op, a in instrs:
        if op.startswith("USETMAXREG"):
            cur = str(int(a.split()[-1], 16))
        out.setdefault(cur, []).append((op, a.strip()))
    return out


def _waits(instrs) -> int:
    return sum(op.startswith("BAR.SYNC") for op, _ in instrs)


@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_fsplit_rows_handover(compiled, dtype):
    """`fsplit`'s WY rows to the finish (`_rows_to_finish`, NOTES "GDN fsplit race"): racecheck
    (H100, 2026-12-06) flagged sRed[0], stored by the WY warpgroup's last shared store (its dG
    rows' read-modify-write, after 4 waits since bar 0) and loaded by the finish after 4 waits
    of its own (one BAR_FINISH). Now the finish loads after 5 (BAR_FINISH twice, back to back
    on both sides): more waits than the stores had (racecheck's rule, docs/attention/
    MLA_NOTES.md), and after the storing thread has passed one of its own."""
    instrs = compiled(dtype, True, False, True, True, True).instrs
    regions = _regions(instrs)
    finish = ("BAR.SYNC.DEFER_BLOCKING", "0x2, 0x100")
    wy, out = regions["256"], regions["224"]  # the WY warpgroup, the output one
    at = wy.index(finish)
    assert wy[at + 1] == finish
    store = max(i for i, (op, _) in enumerate(wy[:at]) if op.startswith("STS"))
    at_out = out.index(finish)
    assert out[at_out + 1] == finish
    load = at_out + 2 + next(i for i, (op, _) in enumerate(out[at_out + 2 :]) if op == "LDS")
    assert _waits(out[:load]) == _waits(wy[:store]) + 1 == 5
    assert not [op for op, _ in wy[store:at] if op.startswith("BAR")]


# the forms' `compiled` arguments after dtype, the barriers waited in two roles' code, and how
# many BAR.SYNCs of theirs a CTA's code holds
BARRIER_FORMS = {
    "output": ((False,), {BAR_FINISH}, 2),
    "wy": ((True,), {BAR_FINISH}, 2),
    "dqk16": ((True, False, True, True), {BAR_FINISH}, 2),
    "fsplit": ((True, False, True, True, True), {BAR_FINISH, BAR_START, BAR_HANDOVER}, 8),
}


@pytest.mark.parametrize("form", BARRIER_FORMS)
@pytest.mark.parametrize("dtype", slow_past(config.DTYPES))
def test_barriers_waited_from_two_roles_are_unaligned(compiled, dtype, form):
    """The fused kernel's synccheck failure (NOTES "Fused GDN backward: synccheck's divergent
    barrier"), here: BAR_FINISH is waited by the math warpgroup at the end of `_math` and by
    the finish warps at the start of `_finish_dg`, one phase at two bar.syncs (the aligned
    form's promise broken: "Divergent thread(s) in block"); `fsplit`'s BAR_START, BAR_HANDOVER
    and both BAR_FINISH phases (`_rows_to_finish`) by the output warpgroup and the WY one each at
    its own. Exactly those are waited at two instructions a phase and listed unaligned in the
    cubin (`unaligned_barrier`); BAR_MATH, BAR_MATH_WY and the finish warps' own barrier, one
    role's in turn, stay aligned. fsplit: each side's four in its own setmaxnreg region."""
    args, two_site, count = BARRIER_FORMS[form]
    built = compiled(dtype, *args)
    bars = pin_unaligned_barriers(built.sass, built.unaligned, two_site)
    unaligned = [b for b in bars if b.offset in built.unaligned]
    assert len(unaligned) == count and all(b.kind == "SYNC" for b in unaligned)
    if form == "fsplit":  # the output warpgroup's (224) and the WY one's (256)
        output, wy = config.FSPLIT_REGS[1:]
        assert sorted(b.regs for b in unaligned) == [output] * 4 + [wy] * 4
