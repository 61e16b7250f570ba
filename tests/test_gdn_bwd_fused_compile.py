"""The Gated DeltaNet fused backward (kernels/linear_attention/gdn_bwd_fused/sm90: kernel 1's
reverse recurrence + kernel 2's chunk gradients, one CTA per (sequence, value head)) compiled
for sm_90a on the CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin): 384
threads launched at 168 registers, setmaxnreg config.REGS (32 / 224 / 248: at most 3 x 168
in all, the CTA's pool); 225,280 bytes of
shared memory (within config's bound and the 227 KB opt-in); the products split as designed
(S: K K^T, dPD, (e^G o dO)^T q and -dU^T W on both 64-row halves = 32 HGMMA; G: dU and kernel
2's WY chain less dPD = 76); sixteen TMA boxes a chunk on five mbarriers plus the stage's
release; every named barrier of `Bar` with its thread count.

Registers by setmaxnreg region (bf16, 2026-12-06): warpgroup 0 R0-R24, S R0-R221, G R0-R179
(`group_sum`: R0-R216) of 248 (kernel 2's WY body at 254 there: here K K^T and dPD are S's,
and the WY half's row sums go to shared memory as they are formed); nothing spilled (was 400
bytes in G before those moves)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path
from typing import NamedTuple

import pytest

pytest.importorskip("cutlass")

from cubins import (  # noqa: E402  (tests/ is on the path)
    indirect_targets,
    pin_unaligned_barriers,
    unaligned_offsets,
)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.compile import (  # noqa: E402
    compile_gdn_bwd_fused,
    kernel_for,
)
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.fused_bwd import Bar  # noqa: E402
from forgekernel.runtime.resources import (  # noqa: E402
    find_tool,
    inspect_cubin,
    sass_instructions,
    sass_text,
    setmaxnreg_wrong_way,
)

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

SMEM = 225280
CONFIGS = [(config.DTYPES[1], False), pytest.param(config.DTYPES[1], True, marks=pytest.mark.slow),
           pytest.param(config.DTYPES[0], False, marks=pytest.mark.slow)]  # fmt: skip


class Built(NamedTuple):
    res: dict  # inspect_cubin's
    instrs: list  # (op, operands) in order
    smem: int  # the kernel's SharedStorage
    sass: str  # cuobjdump's listing
    unaligned: set  # cubins.unaligned_offsets
    indirect: dict  # cubins.indirect_targets (`wg_split`'s four-way warpgroup switch: a BRX)


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(dtype, dht, grouped=False, u_from_h=False, varlen=False, group_sum=False,
            wg_split=False, w_from_t=False) -> Built:  # fmt: skip
        key = (dtype, dht, grouped, u_from_h, varlen, group_sum, wg_split, w_from_t)
        if key not in cache:
            params = dict(config.params_for(dtype, d_final_state=dht, grouped=grouped,
                                            u_from_h=u_from_h, varlen=varlen,
                                            group_sum=group_sum, wg_split=wg_split,
                                            w_from_t=w_from_t))  # fmt: skip
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_gdn_bwd_fused(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                           kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
                unaligned = unaligned_offsets(cubin)
                indirect = indirect_targets(cubin)
            cache[key] = Built(res, sass_instructions(sass), kernel.shared_storage.size_in_bytes(),
                               sass, unaligned, indirect)  # fmt: skip
        return cache[key]

    return get


def _regions(instrs) -> dict[int, list]:
    """The SASS between setmaxnreg instructions, keyed by the count in force (0: before)."""
    out, cur = {0: []}, 0
    for op, a in instrs:
        if op.startswith("USETMAXREG"):
            cur = int(a.split()[-1], 16)
            out.setdefault(cur, [])
            continue
        out[cur].append((op, a))
    return out


def _count(instrs, prefix) -> int:
    """Instructions of `instrs` whose opcode starts with `prefix`."""
    return sum(op.startswith(prefix) for op, _ in instrs)


def _max_register(instrs) -> int:
    return max([int(r) for _, a in instrs for r in re.findall(r"\bR(\d+)\b", a)] + [0])


@pytest.mark.parametrize(("dtype", "dht"), CONFIGS)
def test_registers_and_spills(compiled, dtype, dht):
    res, instrs = compiled(dtype, dht)[:2]
    assert res["registers"] == 168 == 65536 // config.THREADS // 8 * 8
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    setmax = sorted(int(a.split()[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert setmax == sorted(config.REGS)
    assert not setmaxnreg_wrong_way(instrs, res["registers"])
    # setmaxnreg.inc (USETMAXREG.TRY_ALLOC.CTAPOOL) takes only what the launch allocated the
    # CTA: a split over 3 x 168 spins forever (32 / 224 / 256 did: a hang on the GPU)
    assert sum(setmax) * 128 <= res["registers"] * config.THREADS
    regions = _regions(instrs)
    for regs in config.REGS:
        assert _max_register(regions[regs]) < regs


@pytest.mark.parametrize(("dtype", "dht"), CONFIGS)
def test_shared_memory_fits(compiled, dtype, dht):
    res, _, smem = compiled(dtype, dht)[:3]
    assert smem == SMEM <= config.smem_bytes() <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


def test_products_split_between_the_warpgroups(compiled):
    """S (224 registers): K K^T and dPD (8 HGMMA.64x64x16 each), the two 64-row halves'
    (e^G o dO)^T q and -dU^T W (4 HGMMA.64x128x16 each a half); G (248): dU (k dS 8, P^T dO
    4), kernel 2's dqe, dke, dw (8 each), dPD k, dPD^T q, T^T du, T^T dw, M k, M^T k (4 each),
    dvb u^T, dkb w^T (8 HGMMA.64x64x16 each)."""
    regions = _regions(compiled(config.DTYPES[1], False).instrs)

    def count(regs, shape):
        return sum(op.startswith(f"HGMMA.{shape}") for op, _ in regions[regs])

    s_regs, g_regs = config.REGS[1], config.REGS[2]
    assert count(s_regs, "64x64x16") == 16 and count(s_regs, "64x128x16") == 16
    assert count(g_regs, "64x64x16") == 16 and count(g_regs, "64x128x16") == 60


def test_loads_and_barriers(compiled):
    """Sixteen TMA boxes a chunk (six (C, 128) token tiles in two 64-column halves, P^T and
    T^T, h's two halves), six mbarriers (five load groups, the stage's release), the named
    barriers of `Bar` with their thread counts."""
    instrs = compiled(config.DTYPES[1], False).instrs
    ops = [op for op, _ in instrs]
    assert ops.count("UTMALDG.4D") == 14 and ops.count("UTMALDG.5D") == 2
    assert ops.count("SYNCS.EXCH.64") == len(config.LOAD_GROUPS) + 1
    ids = {(a.strip().split(",")[0], a.strip().split(",")[-1].strip())
           for op, a in instrs if op.startswith("BAR") and "," in a}  # fmt: skip
    want = {("0x1", "0x80"), ("0x2", "0xc0"), ("0x3", "0x40"), ("0x4", "0x140"),
            ("0x5", "0x100"), ("0x6", "0x140"), ("0x7", "0x100"), ("0x8", "0x80")}  # fmt: skip
    assert ids == want


@pytest.mark.parametrize(("dtype", "dht"), CONFIGS)
def test_barriers_waited_from_two_roles_are_unaligned(compiled, dtype, dht):
    """synccheck (H100, 2026-12-06) reported "Divergent thread(s) in block" at G's bar.sync of
    DS_READY (+0x2fd0, threads 256..383), whose phase the finish warps wait at their own
    bar.sync: the aligned form promises one instruction for a phase's waiters. The ids waited
    at two instructions a phase (cubins.two_site_barriers: BAR.SYNCs of one id neither of which
    reaches the other) are DS_READY (finish + G) and FINISH (G + finish): every BAR.SYNC of
    theirs is listed unaligned in the cubin (EIATTR_COOP_GROUP_INSTR_OFFSETS), every other
    BAR.SYNC is not (a phase's waiters at one instruction: the aligned form holds).
    The only predicated barriers are DH_FREE's (on the chunk index: warp-uniform). (Whether a
    warp is converged at a barrier the SASS does not say: ptxas opens BSSY spans well before
    the branch they reconverge, DH_FREE's G arrive sits in one.)"""
    built = compiled(dtype, dht)
    bars = pin_unaligned_barriers(built.sass, built.unaligned, {Bar.DS_READY, Bar.FINISH})
    assert {int(b.barrier, 16) for b in bars if b.predicate} == {Bar.DH_FREE}
    # the unaligned sites: G's and the finish warps' waits of both
    waits = sorted((int(b.barrier, 16), b.regs) for b in bars if b.offset in built.unaligned)
    want = sorted((int(i), r) for i in (Bar.DS_READY, Bar.FINISH)
                  for r in (config.REGS[0], config.REGS[2]))  # fmt: skip
    assert waits == want


# ---- `u_from_h` (next/gdn-fused-diet: U = u - W h formed by S, not read)

# CI: bf16 without dht, whose two compiles (the key and its base) are test_varlen_resources'
# bases and the file's standard key (no compile of its own; the dht case, 2 compiles, ~11 s of an
# idle CPU, is slow: dht with u_from_h still compiles in CI as test_group_sum's base, grouped)
U_FROM_H = [(config.DTYPES[1], False, False),
            pytest.param(config.DTYPES[1], True, False, marks=pytest.mark.slow),
            pytest.param(config.DTYPES[0], False, True, marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "dht", "grouped"), U_FROM_H)
def test_u_from_h(compiled, dtype, dht, grouped):
    """`u_from_h`: U's TMA box gone (12 + 2 boxes a chunk) on the same five load groups and
    barriers; S forms U = u - W h: 8 more HGMMA.64x128x16 (C x V x K) in its 224-register
    region, G's products unchanged; the same setmaxnreg split and shared memory, every region
    under its count (cu13, 2026-12-06: S R0-R221 as without it, G R0-R181 or R179 grouped),
    nothing spilled; the unaligned-barrier pins of the key without it hold."""
    built = compiled(dtype, dht, grouped, True)
    base = compiled(dtype, dht, grouped)
    assert built.res["registers"] == 168 and built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == base.smem == SMEM
    regions, base_regions = _regions(built.instrs), _regions(base.instrs)
    assert sorted(regions) == sorted(base_regions)
    for regs in config.REGS:
        assert _max_register(regions[regs]) < regs

    def count(r, op):
        return sum(o.startswith(op) for o, _ in r)

    s_regs, g_regs = config.REGS[1], config.REGS[2]
    for shape, extra in (("HGMMA.64x64x16", 0), ("HGMMA.64x128x16", 8)):
        assert count(regions[s_regs], shape) == count(base_regions[s_regs], shape) + extra
        assert count(regions[g_regs], shape) == count(base_regions[g_regs], shape)
    ops, base_ops = ([op for op, _ in x] for x in (built.instrs, base.instrs))
    assert ops.count("UTMALDG.4D") == base_ops.count("UTMALDG.4D") - 2 == 12
    assert ops.count("UTMALDG.5D") == 2
    assert ops.count("SYNCS.EXCH.64") == len(config.U_FROM_H_LOAD_GROUPS) + 1
    assert ops.count("STSM.16.M88.4") == base_ops.count("STSM.16.M88.4") + 8  # U's tile
    bars = pin_unaligned_barriers(built.sass, built.unaligned, {Bar.DS_READY, Bar.FINISH})
    assert {int(b.barrier, 16) for b in bars if b.predicate} == {Bar.DH_FREE}


# CI: U formed (the varlen mechanism is one for both: the slot walk and the token-row stores);
# U read is slow (its varlen key, ~6 s of an idle CPU, compiled for this check alone)
@pytest.mark.parametrize(
    "u_from_h", [pytest.param(False, marks=pytest.mark.slow), True], ids=["u_read", "u_from_h"]
)
def test_varlen_resources(compiled, u_from_h):
    """The `varlen` key (the slot layout: kernel 1's walk, kernel 2's token-row stores; bf16,
    2026-12-06), U read or formed (`u_from_h`, FUSED_DIET; next/fused-slots-on46): 168
    registers, nothing spilled, every setmaxnreg region within its count (warpgroup 0 R0-R22,
    S R0-R221 as the key without varlen, G R0-R184 of 248: R179 there), the same shared
    memory, products, TMA boxes, barriers and unaligned sites as the key without varlen; +13
    global loads (cu_seqlens x 2 and the order entry once a CTA, (start, valid) at each of
    dq's, dv's, dk's, dbeta's and dG's store groups)."""
    dtype = config.DTYPES[1]
    base, got = compiled(dtype, False, u_from_h=u_from_h), compiled(dtype, False,
                                                                    u_from_h=u_from_h,
                                                                    varlen=True)  # fmt: skip
    assert got.res["registers"] == 168 and got.res["spill_bytes"] == 0 and got.smem == SMEM
    assert not [op for op, _ in got.instrs if op.startswith(("LDL", "STL"))]
    regions = _regions(got.instrs)
    for regs in config.REGS:
        assert _max_register(regions[regs]) < regs
    s_base = _regions(base.instrs)[config.REGS[1]]
    assert _max_register(regions[config.REGS[1]]) == _max_register(s_base)

    def ops(built, prefix):
        return sorted(op for op, _ in built.instrs if op.startswith(prefix))

    for prefix in ("HGMMA", "UTMALDG", "BAR", "SYNCS", "STSM", "MUFU", "STS", "LDS"):
        assert ops(got, prefix) == ops(base, prefix), prefix
    assert len(ops(got, "LDG.E")) == len(ops(base, "LDG.E")) + 13
    bars = pin_unaligned_barriers(got.sass, got.unaligned, {Bar.DS_READY, Bar.FINISH})
    assert {int(b.barrier, 16) for b in bars if b.predicate} == {Bar.DH_FREE}


# ---- `group_sum` (next/gdn-bwd-groupsum: dq, dk summed over a 2-CTA cluster through DSMEM)

GROUP_SUM = [(config.DTYPES[1], True, True),
             pytest.param(config.DTYPES[0], False, True, marks=pytest.mark.slow),
             pytest.param(config.DTYPES[1], False, False, marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "dht", "u_from_h"), GROUP_SUM)
def test_group_sum(compiled, dtype, dht, u_from_h):
    """`group_sum` against the grouped key without it: 168 registers, nothing spilled, every
    setmaxnreg region under its count, S's the same (R0-R221; G R0-R216 of 248 here, R179
    without: the peer's 16 store addresses and the owners' 64 sums, cu13 2026-12-07); the same
    shared memory (the four mbarriers fit the padding: 225,280 bytes), products and TMA boxes;
    per chunk two exchanges of 16 STAS.128 (st.async, 16 bytes) and 16 LDS.128 (the owners'
    reads) each in G's region, two remote arrivals (the "free" signals), one more bar.sync of
    G alone (MATH: the owners' reads before dk's stash over dO), four more mbarrier inits and
    the inits' cluster barrier once (UCGABAR_ARV / WAIT); no MEMBAR.ALL.GPU (a cluster-scope
    release would put one before each remote arrival); the unaligned-barrier pins hold."""
    built = compiled(dtype, dht, True, u_from_h, group_sum=True)
    base = compiled(dtype, dht, True, u_from_h)
    assert built.res["registers"] == 168 and built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == base.smem == SMEM <= config.smem_bytes(group_sum=True) <= SMEM_CAPACITY
    regions, base_regions = _regions(built.instrs), _regions(base.instrs)
    assert sorted(regions) == sorted(base_regions)
    for regs in config.REGS:
        assert _max_register(regions[regs]) < regs
    s_regs, g_regs = config.REGS[1], config.REGS[2]
    assert _max_register(regions[s_regs]) == _max_register(base_regions[s_regs])

    for prefix in ("HGMMA", "UTMALDG", "STSM", "MUFU"):
        assert _count(built.instrs, prefix) == _count(base.instrs, prefix), prefix
    per_exchange = 128 * 64 // (4 * config.THREADS_PER_WG)  # 16-byte groups a sending thread
    assert _count(regions[g_regs], "STAS.128") == 2 * per_exchange == _count(built.instrs, "STAS")
    assert (_count(regions[g_regs], "LDS.128") - _count(base_regions[g_regs], "LDS.128")
            == 2 * per_exchange)  # fmt: skip
    assert _count(built.instrs, "SYNCS.ARRIVE.TRANS64.RED") == 2
    assert _count(built.instrs, "SYNCS.EXCH.64") == (_count(base.instrs, "SYNCS.EXCH.64")
                                                    + config.PAIR_BARRIERS)  # fmt: skip
    assert _count(built.instrs, "UCGABAR_ARV") == _count(built.instrs, "UCGABAR_WAIT") == 1
    assert _count(base.instrs, "UCGABAR") == 0 and _count(built.instrs, "MEMBAR.ALL.GPU") == 0

    def bars(instrs):
        return sorted(a.strip() for op, a in instrs if op.startswith("BAR"))

    extra = bars(built.instrs)
    for a in bars(base.instrs):
        extra.remove(a)
    assert [b.replace(" ", "") for b in extra] == [f"{int(Bar.MATH):#x},0x80"]
    pins = pin_unaligned_barriers(built.sass, built.unaligned, {Bar.DS_READY, Bar.FINISH})
    assert {int(b.barrier, 16) for b in pins if b.predicate} == {Bar.DH_FREE}


# ---- `varlen, group_sum` (next/gdn-bwd-slots-groupsum: the pair on the slot walk)

# The candidate keys' compiles (`varlen, group_sum`, `wg_split` and its forms) run under -m slow
# only: CI's ten minutes (docs/PENDING.md, 2026-12-07 04:20); the standard keys' stay in CI.
VARLEN_GROUP_SUM = [
    pytest.param(config.DTYPES[1], True, True, marks=pytest.mark.slow),
    pytest.param(config.DTYPES[0], False, False, marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("dtype", "dht", "u_from_h"), VARLEN_GROUP_SUM)
def test_varlen_group_sum(compiled, dtype, dht, u_from_h):
    """`varlen, group_sum` against the `varlen` key without the pair and the batch key with it
    (grouped): 168 registers, nothing spilled, every setmaxnreg region under its count, S's the
    same (R0-R221; G R0-R210 of 248 here, R182 varlen alone, R216 batch group_sum: bf16, dht,
    u_from_h, cu13 2026-12-07); the same shared memory, products, TMA boxes; the pair's code
    as on the batch key (two exchanges of 16 STAS.128 and 16 LDS.128 in G's region, two remote
    arrivals, four more mbarrier inits, one cluster barrier, one more MATH bar.sync, no
    MEMBAR.ALL.GPU); the varlen key's global loads (the owners read the slot's token-row
    tables where the plain store did: +0 over `varlen`, +13 over the batch pair); the
    unaligned-barrier pins hold."""
    built = compiled(dtype, dht, True, u_from_h, varlen=True, group_sum=True)
    base = compiled(dtype, dht, True, u_from_h, varlen=True)
    pair = compiled(dtype, dht, True, u_from_h, group_sum=True)
    assert built.res["registers"] == 168 and built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == base.smem == pair.smem == SMEM
    regions, base_regions = _regions(built.instrs), _regions(base.instrs)
    assert sorted(regions) == sorted(base_regions)
    for regs in config.REGS:
        assert _max_register(regions[regs]) < regs
    s_regs, g_regs = config.REGS[1], config.REGS[2]
    assert _max_register(regions[s_regs]) == _max_register(base_regions[s_regs])

    for prefix in ("HGMMA", "UTMALDG", "STSM", "MUFU"):
        assert _count(built.instrs, prefix) == _count(base.instrs, prefix), prefix
    g_pair = _regions(pair.instrs)[g_regs]
    for prefix in ("STAS", "LDS.128"):
        assert _count(regions[g_regs], prefix) == _count(g_pair, prefix), prefix
    for prefix in ("SYNCS.ARRIVE.TRANS64.RED", "SYNCS.EXCH.64", "UCGABAR", "MEMBAR"):
        assert _count(built.instrs, prefix) == _count(pair.instrs, prefix), prefix
    assert _count(built.instrs, "LDG.E") == _count(base.instrs, "LDG.E")
    assert _count(built.instrs, "LDG.E") == _count(pair.instrs, "LDG.E") + 13

    def bars(instrs):
        return sorted(a.strip() for op, a in instrs if op.startswith("BAR"))

    assert bars(built.instrs) == bars(pair.instrs)
    pins = pin_unaligned_barriers(built.sass, built.unaligned, {Bar.DS_READY, Bar.FINISH})
    assert {int(b.barrier, 16) for b in pins if b.predicate} == {Bar.DH_FREE}


# ---- `wg_split` (next/gdn-bwd-wgsplit: S, G1, G2 and warpgroup 0, 512 threads)

WG_SPLIT = [pytest.param(config.DTYPES[1], False, True, True, marks=pytest.mark.slow),
            pytest.param(config.DTYPES[1], True, False, False, marks=pytest.mark.slow),
            pytest.param(config.DTYPES[0], True, True, True, marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "dht", "grouped", "u_from_h"), WG_SPLIT)
def test_wg_split(compiled, dtype, dht, grouped, u_from_h):
    """`wg_split` against the key without it: 512 threads launched at 128 registers,
    setmaxnreg config.SPLIT_REGS (32 / 176 / 168 / 136, at most 4 x 128 in all), every region
    under its count (cu13, bf16 grouped u_from_h, 2026-12-07: warpgroup 0 R0-R18, S R0-R167,
    G1 R0-R165, G2 R0-R120), nothing spilled; the same shared memory, HGMMA, TMA boxes and
    mbarriers; S's region only the update's two halves (16 HGMMA.64x128x16); G2's K K^T and dPD
    (16 HGMMA.64x64x16), dqe, dPD k, dke, dPD^T q (24 HGMMA.64x128x16; + U's 8 with
    `u_from_h`); G1's the rest of G's (its 64x128 products less those 24); dPD into dq's
    product from registers (4 stmatrix fewer: its 16-bit tile is not stored, its transpose
    is); the named barriers with their counts (H_FREE, KK, ROWS new); DU_READY waited at two
    instructions (S's, G2's): unaligned with DS_READY and FINISH."""
    built = compiled(dtype, dht, grouped, u_from_h, wg_split=True)
    base = compiled(dtype, dht, grouped, u_from_h)
    assert built.res["registers"] == 128 == 65536 // config.SPLIT_THREADS // 8 * 8
    assert built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == base.smem == SMEM
    setmax = sorted(int(a.split()[-1], 16) for op, a in built.instrs if op.startswith("USETMAXREG"))
    assert setmax == sorted(config.SPLIT_REGS)
    # G2's 136 above the launch's 128: .inc (its .dec was CUDA error 715, next/ws-illegal)
    assert not setmaxnreg_wrong_way(built.instrs, built.res["registers"])
    assert sum(setmax) * 128 <= built.res["registers"] * config.SPLIT_THREADS
    regions, base_regions = _regions(built.instrs), _regions(base.instrs)
    for regs in config.SPLIT_REGS:
        assert _max_register(regions[regs]) < regs

    for prefix in ("HGMMA", "UTMALDG", "SYNCS.EXCH", "STSM.16.MT88"):
        assert _count(built.instrs, prefix) == _count(base.instrs, prefix), prefix
    assert _count(built.instrs, "STSM.16.M88") == _count(base.instrs, "STSM.16.M88") - 4
    s_regs, g1_regs, g2_regs = config.SPLIT_REGS[1:]
    moved = 24  # dqe 8, dPD k 4, dke 8, dPD^T q 4
    assert _count(regions[s_regs], "HGMMA.64x64x16") == 0
    assert _count(regions[s_regs], "HGMMA.64x128x16") == 16
    assert _count(regions[g2_regs], "HGMMA.64x64x16") == 16
    assert _count(regions[g2_regs], "HGMMA.64x128x16") == moved + (8 if u_from_h else 0)
    g = base_regions[config.REGS[2]]
    assert _count(regions[g1_regs], "HGMMA.64x64x16") == _count(g, "HGMMA.64x64x16")
    assert _count(regions[g1_regs], "HGMMA.64x128x16") == _count(g, "HGMMA.64x128x16") - moved
    ids = {a.replace(" ", "") for op, a in built.instrs if op.startswith("BAR") and "," in a}
    want = {(Bar.MATH, 128), (Bar.FINISH, 192), (Bar.FINISH_WARPS, 64), (Bar.DS_READY, 320),
            (Bar.DU_READY, 384), (Bar.DH_FREE, 448), (Bar.S_DONE, 256), (Bar.STATE, 128),
            (Bar.PRODUCTS, 128), (Bar.H_FREE, 320), (Bar.KK, 256), (Bar.ROWS, 256)}  # fmt: skip
    assert ids == {f"{int(b):#x},{n:#x}" for b, n in want}
    assert built.indirect and not base.indirect  # the warpgroup switch: a jump table
    pins = pin_unaligned_barriers(built.sass, built.unaligned,
                                  {Bar.DS_READY, Bar.FINISH, Bar.DU_READY},
                                  built.indirect)  # fmt: skip
    assert {int(b.barrier, 16) for b in pins if b.predicate} == {Bar.DH_FREE}


# slow, both: `wg_split` is a candidate (`_candidate_params` only; no route of the op takes it:
# ops.gated_delta_rule_bwd FUSED_WFROMT, its only way in, is off), and this its only key CI
# compiled (~8 s of an idle CPU, 2026-12-07). A wrong-way setmaxnreg stays checked in CI on the
# standard keys (test_registers_and_spills, test_build_sm90) and is printed by `forgekernel build
# --candidates` for every candidate key, this one included, before any GPU run of it.
@pytest.mark.slow
@pytest.mark.parametrize("group_sum", [False, True])
def test_wg_split_setmaxnreg_directions(compiled, group_sum):
    """The split's four setmaxnreg go the way the launch's 128 registers allow: warpgroup 0's
    .dec (32; 24 with `group_sum`), S's, G1's and G2's .inc (176, 168, 136; 176, 160, 152). G2's
    was a .dec to 136 (USETMAXREG.DEALLOC.CTAPOOL 0x88), an illegal instruction on the H100: CUDA
    error 715 at that instruction (+0x13670 of this key's cu13 build, the GPU host's; warpgroup
    3's threads) on the first launch of every `wg_split` key (next/ws-illegal). The key is the
    failing GPU case's: bf16, dht, `u_from_h` (grouped with `group_sum`)."""
    built = compiled(config.DTYPES[1], True, group_sum, True, group_sum=group_sum,
                     wg_split=True)  # fmt: skip
    launch = built.res["registers"]
    assert launch == config.SPLIT_LAUNCH_REGS == 128
    assert not setmaxnreg_wrong_way(built.instrs, launch)
    regs = config.SPLIT_PAIR_REGS if group_sum else config.SPLIT_REGS
    got = sorted((op.split(".")[1], int(a.split()[-1], 16)) for op, a in built.instrs
                 if op.startswith("USETMAXREG"))  # fmt: skip
    assert got == sorted([("DEALLOC", regs[0])] + [("TRY_ALLOC", r) for r in regs[1:]])


# ---- `wg_split, group_sum` (next/wgsplit-groupsum: the pair's exchanges on the split)

WG_SPLIT_GROUP_SUM = [pytest.param(config.DTYPES[1], False, True, False, marks=pytest.mark.slow),
                      pytest.param(config.DTYPES[0], True, False, False, marks=pytest.mark.slow),
                      pytest.param(config.DTYPES[1], True, True, True,
                                   marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "dht", "u_from_h", "varlen"), WG_SPLIT_GROUP_SUM)
def test_wg_split_group_sum(compiled, dtype, dht, u_from_h, varlen):
    """`wg_split, group_sum` against `wg_split` alone and `group_sum` alone (grouped): 512
    threads at 128 registers, setmaxnreg config.SPLIT_PAIR_REGS (24 / 176 / 160 / 152), every
    region under its count (cu13, bf16 grouped `u_from_h`, 2026-12-07: R0-R16, S R0-R167,
    G1 R0-R156, G2 R0-R144), nothing spilled (at G2 136: 40 bytes); the split's products,
    TMA boxes, stmatrix and exps; the pair's machinery as `group_sum`'s: 16 STAS.128 and 16
    more LDS.128 in G2's region (dq's exchange) and in G1's (dk's), two remote arrivals, four
    more mbarrier inits, one cluster barrier, no MEMBAR.ALL.GPU; the split's named barriers
    exactly (dq's exchange adds none: G2's S_DONE wait moves before it, PRODUCTS orders the
    owners' reads before the stash over dO); the unaligned pins as the split's."""
    built = compiled(dtype, dht, True, u_from_h, varlen, group_sum=True, wg_split=True)
    split = compiled(dtype, dht, True, u_from_h, varlen, wg_split=True)
    pair = compiled(dtype, dht, True, u_from_h, varlen, group_sum=True)
    assert built.res["registers"] == 128 and built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == split.smem == pair.smem == SMEM
    setmax = sorted(int(a.split()[-1], 16) for op, a in built.instrs if op.startswith("USETMAXREG"))
    assert setmax == sorted(config.SPLIT_PAIR_REGS)
    assert not setmaxnreg_wrong_way(built.instrs, built.res["registers"])
    assert sum(setmax) * 128 <= built.res["registers"] * config.SPLIT_THREADS
    regions, split_regions = _regions(built.instrs), _regions(split.instrs)
    for regs in config.SPLIT_PAIR_REGS:
        assert _max_register(regions[regs]) < regs

    for prefix in ("HGMMA", "UTMALDG", "STSM", "MUFU"):
        assert _count(built.instrs, prefix) == _count(split.instrs, prefix), prefix
    per_exchange = 128 * 64 // (4 * config.THREADS_PER_WG)  # 16-byte groups a sending thread
    _, s_regs, g1_regs, g2_regs = config.SPLIT_PAIR_REGS
    _, s_split, g1_split, g2_split = config.SPLIT_REGS
    for regs, was in ((g1_regs, g1_split), (g2_regs, g2_split)):
        assert _count(regions[regs], "STAS.128") == per_exchange
        assert (_count(regions[regs], "LDS.128") - _count(split_regions[was], "LDS.128")
                == per_exchange)  # fmt: skip
        assert _count(regions[regs], "HGMMA") == _count(split_regions[was], "HGMMA")
    assert _count(regions[s_regs], "HGMMA") == _count(split_regions[s_split], "HGMMA")
    assert _count(built.instrs, "STAS") == 2 * per_exchange
    for prefix in ("SYNCS.ARRIVE.TRANS64.RED", "SYNCS.EXCH.64", "UCGABAR", "MEMBAR"):
        assert _count(built.instrs, prefix) == _count(pair.instrs, prefix), prefix
    assert _count(built.instrs, "MEMBAR.ALL.GPU") == 0

    def bars(instrs):
        return sorted(a.replace(" ", "") for op, a in instrs if op.startswith("BAR"))

    assert bars(built.instrs) == bars(split.instrs)
    pins = pin_unaligned_barriers(built.sass, built.unaligned,
                                  {Bar.DS_READY, Bar.FINISH, Bar.DU_READY},
                                  built.indirect)  # fmt: skip
    assert {int(b.barrier, 16) for b in pins if b.predicate} == {Bar.DH_FREE}


# ---- `wg_split, w_from_t` (next/gdn-w-from-t: W, u formed by G2 from T^T, k, v)

WG_SPLIT_W_FROM_T = [pytest.param(config.DTYPES[1], False, True, False, False,
                                  marks=pytest.mark.slow),
                     pytest.param(config.DTYPES[0], True, False, False, False,
                                  marks=pytest.mark.slow),
                     pytest.param(config.DTYPES[1], True, True, True, False,
                                  marks=pytest.mark.slow),
                     pytest.param(config.DTYPES[1], False, True, False, True,
                                  marks=pytest.mark.slow)]  # fmt: skip


@pytest.mark.parametrize(("dtype", "dht", "grouped", "group_sum", "varlen"), WG_SPLIT_W_FROM_T)
def test_wg_split_w_from_t(compiled, dtype, dht, grouped, group_sum, varlen):
    """`wg_split, w_from_t` (`u_from_h`) against `wg_split` alone: 512 threads at 128
    registers, the split's setmaxnreg counts (SPLIT_REGS; with `group_sum` SPLIT_PAIR_REGS),
    every region under its count (cu13, 2026-12-07: G2 R0-R121 of 136, R0-R144 of 152 with
    `group_sum`: W's and u's products come before anything else of G2's chunk is live),
    nothing spilled; the same shared memory (225,280: beta, beta e^G's 512 bytes fit the
    padding); G2's region 8 HGMMA.64x128x16 more (W, u: 4 each), 16 stmatrix more (their
    16-bit tiles), one exp more (beta e^G) and two bar.syncs more (v read before u goes over
    it; W, u in place before U's product), S's and G1's HGMMA unchanged; two TMA loads fewer
    (W's box gone, v's in u's place: (C, 128) tiles load as two boxes) and one mbarrier init
    fewer (four load groups); the same named barriers and counts; the unaligned pins as the
    split's."""
    built = compiled(dtype, dht, grouped, True, varlen, group_sum, wg_split=True, w_from_t=True)
    split = compiled(dtype, dht, grouped, True, varlen, group_sum, wg_split=True)
    regs = config.SPLIT_PAIR_REGS if group_sum else config.SPLIT_REGS
    assert built.res["registers"] == 128 and built.res["spill_bytes"] == 0
    assert not [op for op, _ in built.instrs if op.startswith(("LDL", "STL"))]
    assert built.smem == split.smem == SMEM <= config.smem_bytes(group_sum=group_sum,
                                                                 w_from_t=True)  # fmt: skip
    setmax = sorted(int(a.split()[-1], 16) for op, a in built.instrs if op.startswith("USETMAXREG"))
    assert setmax == sorted(regs)
    assert not setmaxnreg_wrong_way(built.instrs, built.res["registers"])
    regions, split_regions = _regions(built.instrs), _regions(split.instrs)
    for r in regs:
        assert _max_register(regions[r]) < r

    _, s_regs, g1_regs, g2_regs = regs
    assert (_count(regions[g2_regs], "HGMMA.64x128x16")
            == _count(split_regions[g2_regs], "HGMMA.64x128x16") + 8)  # fmt: skip
    assert _count(regions[g2_regs], "HGMMA.64x64x16") == _count(split_regions[g2_regs],
                                                              "HGMMA.64x64x16")  # fmt: skip
    for r in (s_regs, g1_regs):
        assert _count(regions[r], "HGMMA") == _count(split_regions[r], "HGMMA")
    assert _count(regions[g2_regs], "STSM") == _count(split_regions[g2_regs], "STSM") + 16
    assert _count(built.instrs, "STSM") == _count(split.instrs, "STSM") + 16
    assert _count(regions[g2_regs], "MUFU") == _count(split_regions[g2_regs], "MUFU") + 1
    assert _count(regions[g2_regs], "BAR") == _count(split_regions[g2_regs], "BAR") + 2
    # the products' own two waits, no more: ptxas did not serialize the HGMMAs (C7520, as it did
    # the forward launch's `w_from_t` key before next/wft-review)
    assert _count(built.instrs, "WARPGROUP.DEPBAR") == _count(split.instrs, "WARPGROUP.DEPBAR") + 2
    assert _count(built.instrs, "UTMALDG") == _count(split.instrs, "UTMALDG") - 2
    assert _count(built.instrs, "SYNCS.EXCH.64") == _count(split.instrs, "SYNCS.EXCH.64") - 1

    def bar_ids(instrs):
        return {a.replace(" ", "") for op, a in instrs if op.startswith("BAR") and "," in a}

    assert bar_ids(built.instrs) == bar_ids(split.instrs)
    pins = pin_unaligned_barriers(built.sass, built.unaligned,
                                  {Bar.DS_READY, Bar.FINISH, Bar.DU_READY},
                                  built.indirect)  # fmt: skip
    assert {int(b.barrier, 16) for b in pins if b.predicate} == {Bar.DH_FREE}


def test_w_from_t_key_rules():
    """`w_from_t` needs `wg_split` and `u_from_h` (G2 forms W, u, then U from them)."""
    for flags in ({}, {"wg_split": True}, {"u_from_h": True}):
        with pytest.raises(ValueError, match="w_from_t"):
            config.params_for("bfloat16", w_from_t=True, **flags)
    key = dict(config.params_for("bfloat16", u_from_h=True, wg_split=True, w_from_t=True))
    assert key["w_from_t"] and "w_from_t" not in dict(config.params_for("bfloat16"))
