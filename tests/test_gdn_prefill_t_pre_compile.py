"""T precomputed, compiled for sm_90a on the CPU (cuobjdump reads the cubins):

- the precompute (`t_pre.py`, gdn_t_pre_sm90), bf16 / fp16, l2norm or not: 128 threads, no
  spills, registers and shared memory for five CTAs an SM (T diag(beta) over the k tile; its CTAs
  are short and latency-bound, a load, the aux chain, a store); K K^T one WGMMA group (8 x
  64x64x16), the inverse's 28 tf32 HMMA, T diag(beta) by 4 stmatrix a thread, the k box (two
  64-column halves) in and one 64 x 64 TMA store out;
- the chunked kernel's `t_pre` form: the standard split (24 / 104 / 192, no spills), less
  shared memory than the standard (no inverse scratch), the aux warpgroup's WGMMAs Q K^T only
  (8; the state's 24 + 4 unchanged), no HMMA, P the only stmatrix of the aux, one more TMA box
  a chunk (T), the T ring's barriers (one expect-tx, then the state warps' releases); its
  state chain (V^T by ldmatrix.trans, O handed to the O warp's TMA store: the O ring's
  barriers, no named barrier, LDS.U16 or state-side STG) and the `state_lds` key's, which keeps
  next/gdn-tpre's."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from dsl_toolchain import dsl_toolchain  # noqa: E402
from sweeps import slow_past  # noqa: E402  (tests/ is on the path)

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.compile import (  # noqa: E402
    compile_gdn_prefill,
    compile_gdn_t_pre,
    kernel_for,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.roles import (  # noqa: E402
    O_EMPTY_ARRIVALS,
    O_FULL_ARRIVALS,
    qk_consumer_warps,
    v_consumer_warps,
)
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.t_pre import (  # noqa: E402
    THREADS,
    GdnTPreSm90,
)
from forgekernel.runtime.resources import (  # noqa: E402
    find_tool,
    inspect_cubin,
    sass_instructions,
    sass_text,
)

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

SM_SHARED = 233472  # bytes of shared memory an H100 / H200 SM holds (228 KB)
CTAS_PER_SM = 5  # the precompute's target occupancy (T over the k tile: 42 KB a CTA)

PRE = {"bf16": ("bfloat16", False), "fp16_l2norm": ("float16", True)}
FORMS = {
    "bf16": {"dtype": "bfloat16"},
    "bf16_state_vsplit": {"dtype": "bfloat16", "initial_state": True, "v_split": 2},
    "fp16_l2norm_klast_state": {
        "dtype": "float16",
        "l2norm": True,
        "k_last": True,
        "initial_state": True,
    },  # fmt: skip
}

STATE_LDS = {"bf16_state_lds": {"dtype": "bfloat16", "state_lds": True}}  # the bench's A/B

# the standard form with the t_pre form's state chain (the launcher's standard form; standard keys)
STANDARD_O_WARP = {
    "bf16_std_o_warp_state": {"dtype": "bfloat16", "initial_state": True, "o_warp": True},
    "bf16_std_o_warp_vsplit": {"dtype": "bfloat16", "v_split": 2, "o_warp": True},
}
# the t_pre form without o (the segmented path's pass B, the launcher's; standard keys)
NO_O = {
    "bf16_no_o_state": {"dtype": "bfloat16", "initial_state": True, "no_o": True},
    "fp16_l2norm_no_o_vsplit": {
        "dtype": "float16",
        "l2norm": True,
        "initial_state": True,
        "v_split": 2,
        "no_o": True,
    },  # fmt: skip
}

# The chunked kernel's `t_pre` forms are standard keys (the launcher's default form): CI
# compiles the first (bf16), the others and the `state_lds` key are slow (~6 s of CI's CPU, idle
# machine, 2026-12-06); the precompute (gdn_t_pre_sm90, standard) keeps both its builds in CI
FORM_NAMES = slow_past(FORMS)
FORM_AND_STATE_LDS_NAMES = slow_past([*FORMS, *STATE_LDS])
STANDARD_O_WARP_NAMES = slow_past(STANDARD_O_WARP)
NO_O_NAMES = slow_past(NO_O)


def _build(compile_fn, params, kernel):
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_fn(params, "sm_90a", f"--keep-cubin --keep-ptx --dump-dir {d}",
                              kernel=kernel)  # fmt: skip
        ptx = compiled.artifacts.PTX
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        path = Path(d) / "k.cubin"
        path.write_bytes(compiled.artifacts.CUBIN)
        res = inspect_cubin(path)
        sass = sass_text(str(path))
    return res, sass_instructions(sass), kernel.shared_storage.size_in_bytes(), ptx


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(kind, name):
        if (kind, name) not in cache:
            if kind == "pre":
                dtype, l2 = PRE[name]
                params = dict(config.t_pre_params_for(dtype, l2norm=l2))
                kernel = GdnTPreSm90(128, l2norm=l2)
                cache[kind, name] = _build(compile_gdn_t_pre, params, kernel)
            else:
                if kind == "std_o":
                    kw = dict(STANDARD_O_WARP[name])
                    params = dict(config.params_for(kw.pop("dtype"), **kw))
                else:
                    kw = dict({**FORMS, **STATE_LDS, **NO_O}[name])
                    params = dict(config.params_for(kw.pop("dtype"), **kw, t_pre=True))
                cache[kind, name] = _build(compile_gdn_prefill, params, kernel_for(params))
        return cache[kind, name]

    return get


def _ops(instrs):
    return [op for op, _ in instrs]


def _mbarrier_init_counts(ptx: str) -> list[int]:
    regs = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx))
    return [
        int(regs.get(c, c))
        for c in re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^]]+\], ([^;]+);", ptx)
    ]


# ------------------------------------------------------------------------ the precompute


@pytest.mark.parametrize("name", list(PRE))
def test_precompute_resources(built, name):
    res, instrs, smem, _ = built("pre", name)
    assert THREADS == THREADS_PER_WG
    assert res["spill_bytes"] == 0 and not [op for op in _ops(instrs) if op[:3] in ("LDL", "STL")]
    assert res["registers"] * THREADS * CTAS_PER_SM <= 65536
    assert CTAS_PER_SM * (smem + res["smem_bytes"] + 1024) <= SM_SHARED  # 1 KB a CTA reserved


@pytest.mark.parametrize("name", list(PRE))
def test_precompute_products_and_copies(built, name):
    _, instrs, _, ptx = built("pre", name)
    ops = _ops(instrs)
    hgmma = [a for op, a in instrs if op.startswith("HGMMA")]
    assert ops.count("HGMMA.64x64x16.F32.BF16" if name == "bf16" else "HGMMA.64x64x16.F32") == 8
    assert sum("gsb0" in a for a in hgmma) == 1  # one group: K K^T
    assert ops.count("WARPGROUP.DEPBAR.LE") == 1
    assert ops.count("HMMA.1688.F32.TF32") == 28  # the inverse's merges, as the aux's
    assert ops.count("STSM.16.M88.4") == 4  # T diag(beta)
    assert ops.count("UTMALDG.3D") == 2 and ops.count("UTMASTG.3D") == 1
    assert _mbarrier_init_counts(ptx) == [1, THREADS // 32]


@pytest.mark.parametrize("name", list(PRE))
def test_precompute_store_completes_before_exit(built, name):
    """T is the chunked kernel's input: the store waited for whole (`cp.async.bulk.wait_group
    0`, whose SASS adds CCTL.IVALL to the read wait's DEPBAR), not only its shared-memory read,
    before the CTA exits (NOTES, "t_pre failed on the H100")."""
    _, instrs, _, ptx = built("pre", name)
    assert "cp.async.bulk.wait_group 0;" in " ".join(ptx.split())
    assert "cp.async.bulk.wait_group.read" not in ptx
    tail = _ops(instrs)[_ops(instrs).index("UTMASTG.3D") :]
    assert tail.index("DEPBAR.LE") < tail.index("CCTL.IVALL") < tail.index("EXIT")


# ------------------------------------------------------------------------ the t_pre form


def _wgs(name):
    return config.state_wgs(128, FORMS[name].get("v_split", 1))


@pytest.mark.parametrize("name", FORM_NAMES)
def test_form_registers_and_shared_memory(built, name):
    res, instrs, smem, _ = built("form", name)
    split = FORMS[name].get("v_split", 1)
    if dsl_toolchain() == "cu13":  # the GPU host's build; cu12's ptxas spills 40 bytes (CI)
        assert res["spill_bytes"] == 0
        assert not [op for op in _ops(instrs) if op[:3] in ("LDL", "STL")]
    maxreg = sorted(int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert maxreg == sorted([config.PRODUCER_REGS, config.AUX_REGS, config.STATE_REGS])
    assert smem <= config.smem_bytes(v_split=split, t_pre=True) < config.smem_bytes(v_split=split)
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("name", FORM_NAMES)
def test_form_aux_forms_only_p(built, name):
    _, instrs, _, ptx = built("form", name)
    ops = _ops(instrs)
    shapes = [op for op in ops if op.startswith("HGMMA")]
    assert sum(s.startswith("HGMMA.64x64x16") for s in shapes) == 8 + 24
    assert sum(s.startswith("HGMMA.64x128x16") for s in shapes) == 4
    hgmma = [a for op, a in instrs if op.startswith("HGMMA")]
    assert sum("gsb0" in a for a in hgmma) == 1 + 5  # Q K^T; the state's five
    assert not [op for op in ops if op.startswith("HMMA")]  # no inverse
    assert ops.count("STSM.16.M88.4") == 4  # P only
    assert ops.count("STSM.16.MT88.4") == 4
    assert ops.count("UTMALDG.3D") == 4 + _wgs(name) + 1  # q, k halves, v, the T tile


@pytest.mark.parametrize("name", FORM_NAMES)
def test_form_ring_arrive_counts(built, name):
    """The standard rings, then the T ring: one expect-tx a stage full, the state warps'
    lane-0 releases empty."""
    *_, ptx = built("form", name)
    wg, stages, wgs = THREADS_PER_WG, config.STAGES, _wgs(name)
    want = (
        [1] * config.QK_STAGES + [qk_consumer_warps(wgs)] * config.QK_STAGES
        + [1] * config.V_STAGES + [v_consumer_warps(wgs)] * config.V_STAGES
        + [32] * stages + [wg] * stages
        + [wg] * stages + [wgs * wg] * stages
        + [1] * stages + [v_consumer_warps(wgs)] * stages
        + [O_FULL_ARRIVALS] * 2 * wgs + [O_EMPTY_ARRIVALS] * 2 * wgs
    )  # fmt: skip
    assert _mbarrier_init_counts(ptx) == want
    assert config.o_ring_barriers(wgs) == 4 * wgs


@pytest.mark.parametrize("name", FORM_NAMES)
def test_form_state_chain(built, name):
    """The state warps' chunk chain off the tensor pipe (NOTES, "The t_pre form's state
    chain"): V^T by 4 transposed ldmatrix a thread (no 16-bit LDS), O by 4 transposed
    stmatrix and an mbarrier hand-off (no named barrier, no LDS.128 / STG: the O warp stores
    it, one TMA box a chunk and state warpgroup)."""
    _, instrs, _, _ = built("form", name)
    ops = _ops(instrs)
    assert ops.count("LDSM.16.MT88.4") == 4  # V^T
    assert not [op for op in ops if op.startswith("LDS.U16")]
    assert ops.count("UTMASTG.3D") == _wgs(name)  # the O warp's, one per state warpgroup
    named = [a for op, a in instrs if op == "BAR.SYNC.DEFER_BLOCKING" and "0x80" in a]
    assert len(named) == (1 if FORMS[name].get("l2norm") else 0)  # the aux's, l2norm only
    assert ops.count("STG.E.128") == _wgs(name)  # the O warp's tail rows (a rolled loop)


V_EMPTY = 2 * config.QK_STAGES * 8 + config.V_STAGES * 8  # byte offset of the v ring's empties


@pytest.mark.parametrize("name", FORM_AND_STATE_LDS_NAMES)
def test_form_v_released_after_u(built, name):
    """The state warps release their v stage only once U^T, built from the V^T registers, has
    completed: released after `_correct` (before the fix) ptxas issued the arrive with 3 of the
    4 LDSM (3 of 32 LDS.U16 with state_lds) in flight (NOTES, "t_pre failed on the H100"). In
    SASS: the lane-0 arrive on a v empty barrier comes after a WARPGROUP.DEPBAR that follows
    the last V^T load. Pinned on cu13's SASS (the GPU host's build); cu12's ptxas (CI) writes
    the arrive otherwise: there test_form_no_arrive_behind_shared_loads holds the property."""
    if dsl_toolchain() != "cu13":
        pytest.skip("the arrive's SASS form is cu13's (the GPU host's toolchain)")
    _, instrs, _, _ = built("form", name)
    loads = ("LDSM.16.MT88.4", "LDS.U16")
    last_ldsm = max(i for i, (op, _) in enumerate(instrs) if op in loads)
    releases = [
        i for i, (op, a) in enumerate(instrs)
        if op == "SYNCS.ARRIVE.TRANS64.A1T0" and a.rstrip().endswith(f"+{V_EMPTY:#x}], RZ")
    ]  # fmt: skip
    assert len(releases) == 1 and releases[0] > last_ldsm
    between = [op for op, _ in instrs[last_ldsm : releases[0]]]
    assert "WARPGROUP.DEPBAR.LE" in between and any(op.startswith("HGMMA") for op in between)


def _arrives_behind_loads(instrs) -> list[str]:
    """The mbarrier arrives (SYNCS.ARRIVE ... A1T0) issued while a shared-memory load's
    destination registers are still unread, straight-line (a branch, barrier, MEMBAR or
    WARPGROUP.DEPBAR starts afresh): such an arrive may release a stage before the load has
    read it, unless the SM orders the two."""
    widths = {"LDSM.16.MT88.4": 4, "LDSM.16.M88.4": 4, "LDS.128": 4, "LDS.64": 2}
    pending, found = set(), []
    for op, args in instrs:
        if op.startswith(("MEMBAR", "BAR.", "WARPGROUP.DEPBAR", "EXIT", "BRA")):
            pending.clear()
            continue
        pending -= {int(r) for r in re.findall(r"\bR(\d+)\b", args.partition(",")[2] or args)}
        if op == "SYNCS.ARRIVE.TRANS64.A1T0" and pending:
            found.append(args.strip())
        if op.startswith("LDS"):
            first = int(re.match(r"\s*R(\d+)", args).group(1))
            pending |= set(range(first, first + widths.get(op, 1)))
    return found


@pytest.mark.parametrize("name", FORM_AND_STATE_LDS_NAMES)
def test_form_no_arrive_behind_shared_loads(built, name):
    """No mbarrier arrive of the t_pre forms is issued with a shared-memory load unread (before
    the fix: the v stage's release, behind 3 V^T LDSM / LDS.U16; NOTES, "t_pre failed on the
    H100"). The standard form's v release has only the tables' loads of the aux stage behind
    it, released later."""
    _, instrs, _, _ = built("form", name)
    assert _arrives_behind_loads(instrs) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", list(STATE_LDS))
def test_state_lds_form_keeps_the_previous_chain(built, name):
    """Key field state_lds: next/gdn-tpre's t_pre state chain (V^T by 32 LDS.U16 a thread, O
    by the state warps' named barrier, LDS.128 and STG; no O warp, no O ring), the baseline of
    the bench's `t_pre_state_lds` (its SASS was byte-identical to next/gdn-tpre's t_pre form
    when built, 2026-12-05)."""
    res, instrs, _, ptx = built("form", name)
    ops = _ops(instrs)
    if dsl_toolchain() == "cu13":  # cu12's ptxas spills (CI)
        assert res["spill_bytes"] == 0
    assert ops.count("LDS.U16") == 32 and "LDSM.16.MT88.4" not in ops
    assert "UTMASTG.3D" not in ops and ops.count("STG.E.128") == 4
    assert O_FULL_ARRIVALS not in _mbarrier_init_counts(ptx)[-4:]


# ------------------------------------------------------------------------ the standard o_warp


def _std_o_wgs(name):
    return config.state_wgs(128, STANDARD_O_WARP[name].get("v_split", 1))


def _state_region(instrs):
    """The state warpgroups' code: from their setmaxnreg increase to the next decrease (the
    aux's, unsplit) or the end (split: the aux's code comes first)."""
    ops = _ops(instrs)
    start = next(i for i, op in enumerate(ops) if op.startswith("USETMAXREG.TRY_ALLOC"))
    stop = next((i for i in range(start, len(ops)) if ops[i].startswith("USETMAXREG.DEALLOC")),
                len(ops))  # fmt: skip
    return instrs[start:stop]


@pytest.mark.parametrize("name", STANDARD_O_WARP_NAMES)
def test_standard_o_warp_resources(built, name):
    """The standard form's split and shared memory (its O ring's barriers inside the budget);
    no spills on the GPU host's toolchain (cu12's ptxas spills 8 bytes in warpgroup 0's 24
    registers, the gate warp's loop, as it does on the t_pre forms)."""
    res, instrs, smem, _ = built("std_o", name)
    split = STANDARD_O_WARP[name].get("v_split", 1)
    if dsl_toolchain() == "cu13":
        assert res["spill_bytes"] == 0
        assert not [op for op in _ops(instrs) if op[:3] in ("LDL", "STL")]
    assert not [op for op, _ in _state_region(instrs) if op[:3] in ("LDL", "STL")]
    maxreg = sorted(int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert maxreg == sorted([config.PRODUCER_REGS, config.AUX_REGS, config.STATE_REGS])
    assert smem <= config.smem_bytes(v_split=split, o_warp=True)
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("name", STANDARD_O_WARP_NAMES)
def test_standard_o_warp_state_chain(built, name):
    """The t_pre form's state chain (4 LDSM.MT V^T, no LDS.U16; O by the O warp's one TMA box a
    chunk and state warpgroup, its tail rows by 16-byte copies; the O ring's init counts after
    the standard rings'), the standard aux unchanged (K K^T and Q K^T, the tf32 inverse)."""
    _, instrs, _, ptx = built("std_o", name)
    ops, wgs = _ops(instrs), _std_o_wgs(name)
    assert ops.count("LDSM.16.MT88.4") == 4
    assert not [op for op in ops if op.startswith("LDS.U16")]
    assert ops.count("UTMASTG.3D") == wgs and ops.count("STG.E.128") == wgs
    assert sum(op.startswith("HGMMA") for op in ops) == 16 + 28  # the aux's, the state's
    assert ops.count("HMMA.1688.F32.TF32") == 28
    counts = _mbarrier_init_counts(ptx)
    assert counts[-4 * wgs :] == [O_FULL_ARRIVALS] * 2 * wgs + [O_EMPTY_ARRIVALS] * 2 * wgs


@pytest.mark.parametrize("name", STANDARD_O_WARP_NAMES)
def test_standard_o_warp_v_released_after_u(built, name):
    """As the t_pre forms (test_form_v_released_after_u): the state warps' one arrive on a v
    empty barrier comes after the last V^T ldmatrix with U^T's HGMMA and its WARPGROUP.DEPBAR
    between (the standard form without the key releases v right after the corrections: its
    32 LDS.U16 are all read by then). Read in the state region, either toolchain's arrive."""
    _, instrs, _, _ = built("std_o", name)
    state = _state_region(instrs)
    last = max(i for i, (op, _) in enumerate(state) if op == "LDSM.16.MT88.4")
    releases = [
        i for i, (op, a) in enumerate(state)
        if op.startswith("SYNCS.ARRIVE.TRANS64") and f"+{V_EMPTY:#x}]" in a
    ]  # fmt: skip
    assert len(releases) == 1 and releases[0] > last
    between = [op for op, _ in state[last : releases[0]]]
    assert "WARPGROUP.DEPBAR.LE" in between and any(op.startswith("HGMMA") for op in between)
    assert _arrives_behind_loads(instrs) == []


# ------------------------------------------------------------------------ no_o


def _no_o_wgs(name):
    return config.state_wgs(128, NO_O[name].get("v_split", 1))


@pytest.mark.parametrize("name", NO_O_NAMES)
def test_no_o_resources(built, name):
    res, instrs, smem, _ = built("form", name)
    if dsl_toolchain() == "cu13":
        assert res["spill_bytes"] == 0
    assert not [op for op, _ in _state_region(instrs) if op[:3] in ("LDL", "STL")]
    maxreg = sorted(int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert maxreg == sorted([config.PRODUCER_REGS, config.AUX_REGS, config.STATE_REGS])
    assert smem <= config.smem_bytes(v_split=NO_O[name].get("v_split", 1), t_pre=True)


@pytest.mark.parametrize("name", NO_O_NAMES)
def test_no_o_forms_no_o(built, name):
    """X^T (8), U^T (4) and the update (4 x 64x128) only: no Q K^T, O^T or U^T P^T; no P or O
    stmatrix, no O store (the final state's STG.E only), no O ring; no q box (k's two halves, v,
    T) and with l2norm no q norm either (one rsqrt a row, k's: O's factor rq is unread); the v
    stage released after U^T as in the t_pre form."""
    _, instrs, _, ptx = built("form", name)
    ops, wgs = _ops(instrs), _no_o_wgs(name)
    shapes = [op for op in ops if op.startswith("HGMMA")]
    assert sum(s.startswith("HGMMA.64x64x16") for s in shapes) == 8 + 4
    assert sum(s.startswith("HGMMA.64x128x16") for s in shapes) == 4
    assert not [op for op in ops if op.startswith(("STSM", "UTMASTG", "STG.E.128"))]
    assert ops.count("UTMALDG.3D") == 2 + wgs + 1
    assert sum(op.startswith("MUFU.RSQ") for op in ops) == int(NO_O[name].get("l2norm", False))
    stages = config.STAGES
    want = (
        [1] * config.QK_STAGES + [qk_consumer_warps(wgs)] * config.QK_STAGES
        + [1] * config.V_STAGES + [v_consumer_warps(wgs)] * config.V_STAGES
        + [32] * stages + [THREADS_PER_WG] * stages
        + [THREADS_PER_WG] * stages + [wgs * THREADS_PER_WG] * stages
        + [1] * stages + [v_consumer_warps(wgs)] * stages
    )  # fmt: skip
    assert _mbarrier_init_counts(ptx) == want
    state = _state_region(instrs)
    last = max(i for i, (op, _) in enumerate(state) if op == "LDSM.16.MT88.4")
    releases = [
        i for i, (op, a) in enumerate(state)
        if op.startswith("SYNCS.ARRIVE.TRANS64") and f"+{V_EMPTY:#x}]" in a
    ]  # fmt: skip
    assert len(releases) == 1 and releases[0] > last
    assert "WARPGROUP.DEPBAR.LE" in [op for op, _ in state[last : releases[0]]]
    assert _arrives_behind_loads(instrs) == []
