"""The MLA seesaw pass (seesaw.py) compiled for sm_90a on the CPU (the DSL compiles, ptxas
assembles, cuobjdump reads the cubin): the facts its schedule and the CPU model take for granted.

- Every warp-collective instruction is reached by converged warps: no BRA.DIV / WARPSYNC.COLLECTIVE
  in the SASS. The DSL's TMA copy elects its issuing lane with elect.sync over all 32 lanes;
  issued under `tidx == 0` (the first GPU run, which hung) ptxas branched each of the 41 copies
  to a WARPSYNC.COLLECTIVE of all 32 lanes, which the lane waited on forever (75 UTMALDG: the
  41 and their collective copies).
- 50 UTMALDG (Q: 9 boxes, a token's 8 latent chunks and its RoPE columns; tiles 0 and 1: 18
  boxes; the steady pairs' refills 8 + 10; warpgroup 1's pair with a + 2 alone: 5), no
  LDGSTS (Q's cp.async before), 196 HGMMA, 17 WARPGROUP.DEPBAR (one per wait_group).
- PTX: 19 mbarriers of one arrival, every K box armed with 8192 bytes (64 rows x 64 columns x
  2 bytes, the TMA atom's 65536 bits), Q's once with its 9 boxes' (9 x pitch x 128 bytes,
  pitch = max(H, 8)), named barriers 0 .. 7 only (SCALE0 .. P1 over 256 threads, WG0 / WG1
  over 128; a __syncthreads between warp 0's mbarrier inits and their first arming), no
  setmaxnreg.
- Every generic write of a WGMMA operand tile (stmatrix of P, st.shared of the zeroed stale
  rows and of Q's zero rows) is followed by fence.proxy.async.shared::cta before
  the next named barrier or bar.sync that hands it to a WGMMA (the async proxy): the CPU model
  orders accesses by barriers and mbarriers but has no proxies. (TMA-written K read by the
  warpgroup that did not wait on the chunk's mbarrier needs no fence: both sides are the async
  proxy, ordered through the waiter's acquire and the named barrier after it, as FlashMLA's
  warpgroup 1 reads sV0R.)
- No spills; registers under 256 x 255.
- The partial O leaves through shared memory: 64 STS.64 a thread (its 128 fp32 values, padded
  rows), one fence and __syncthreads, then one bulk-copy loop (UBLKCP, a 2 KB row each) by warp
  0's elected lane, waited until read before it exits; the only global stores left are the
  LSE's (2 STG a thread; 128 scalar STG of O a thread before)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from cubins import build, steady_loops

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.mla.sm90 import SPEC, params_for  # noqa: E402
from forgekernel.kernels.attention.mla.sm90.seesaw import CHUNKS, Q_BOX_MIN, Bar  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

# generic shared-memory writes of 16-bit operand tiles (sM / sScale / sTotal are st.shared.b32:
# read by loads, not by WGMMA), the proxy fence, and the barriers that publish them
_TILE_STORE = re.compile(
    r"^\s*(?:@!?%p\d+\s+)?(?:stmatrix\.|st\.shared\.(?:b16|u16|v[248]\.)|cp\.async\.c[ag]\.shared)"
)
_PROXY_FENCE = re.compile(r"^\s*fence\.proxy\.async\.shared::cta")
_BARRIER = re.compile(r"^\s*(?:@!?%p\d+\s+)?(?:bar|barrier)(?:\.cta)?\.(?:sync|arrive|red)\b")
_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")


def _compiled(params) -> tuple[dict, Counter, str]:
    """(resource usage, SASS opcode counts with modifiers, PTX) of one compile (cubins.build:
    once a process; the standard build is test_mla_worklist's and test_pdl's too)."""
    found = build(SPEC, params)
    return found.resources, Counter(_OP.findall(found.sass)), found.ptx


def _loops(params) -> list[tuple[int, int]]:
    """(instructions, R2UR) of each warpgroup's steady pair loop of one compile (cubins.build,
    cubins.steady_loops; scripts/mla_loop_mix.py prints more of their mix)."""
    return [(sum(c.values()), c["R2UR"]) for c in steady_loops(build(SPEC, params).sass)]


# CI: the standard build (bf16, 16 heads; the MLA scope's, SHARED_COMPILES); the 16-bit 1-head
# block (the Q box's minimum pitch) is slow (12-29 s of CI's CPU, idle / loaded machine, 2026-12-06)
@pytest.fixture(
    scope="module",
    params=[("bfloat16", 16, 1), pytest.param(("float16", 1, 1), marks=pytest.mark.slow)],
)
def compiled(request):
    dtype, heads, qtokens = request.param
    res, ops, ptx = _compiled(params_for("partial", dtype, heads, qtokens, tma=True))
    return res, ops, ptx, max(heads, Q_BOX_MIN)


def test_warp_collectives_are_reached_by_converged_warps(compiled):
    _, ops, _, _ = compiled
    assert ops["BRA.DIV"] == 0  # the old source: 7 (the divergent paths of its load sites)
    assert ops["WARPSYNC.COLLECTIVE"] == 0  # the old source: 41, one per TMA copy
    assert ops["ELECT"] > 0


def test_loads_and_mmas(compiled):
    res, ops, _, _ = compiled
    assert ops["UTMALDG.3D"] == 41 + CHUNKS  # K's boxes, then Q's (one query token)
    assert ops["SYNCS.ARRIVE.TRANS64"] == 41 + 1  # each K box armed once; Q's boxes at once
    assert not any(op.startswith("LDGSTS") for op in ops)  # (Q's cp.async before)
    assert sum(n for op, n in ops.items() if op.startswith("HGMMA")) == 196
    assert ops["WARPGROUP.DEPBAR.LE"] == 17
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["registers"] <= 255


def test_partial_o_leaves_by_bulk_copies(compiled):
    _, ops, ptx, _ = compiled
    assert ops["STS.64"] == 64  # the staged O: 128 fp32 a thread, 2 a store
    assert ops["UBLKCP.G.S"] == 1  # one loop over the rows, one elected lane
    assert ops["STG.E"] == 2 and not any(
        op.startswith("STG") and op != "STG.E" for op in ops
    )  # the LSE's rows only
    assert ptx.count("cp.async.bulk.global.shared::cta.bulk_group") == 1
    assert ptx.count("cp.async.bulk.commit_group") == 1
    assert re.search(r"cp\.async\.bulk\.wait_group\.read\s+0;", ptx)


def test_mbarriers_and_named_barriers(compiled):
    _, _, ptx, pitch = compiled
    assert ptx, "no PTX kept"
    inits = re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);", ptx)
    assert len(inits) == 19  # 2 x 9 K chunks, Q
    for reg in set(inits):  # the count, moved into a register once
        assert re.search(rf"mov\.b32\s+{re.escape(reg)},\s*1;", ptx), reg
    armed = re.findall(
        r"mbarrier\.arrive\.expect_tx\.shared\.b64\s+\S+,\s*\[[^\]]+\],\s*(%r\d+)", ptx
    )
    assert len(armed) == 42
    values = Counter(
        int(re.search(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx).group(1)) for reg in armed
    )
    assert values == {8192: 41, CHUNKS * pitch * 128: 1}  # (16-bit: 64 columns, 128 bytes)
    ids = Counter(
        (int(i), int(n) if n else None)
        for i, n in re.findall(
            r"\bbar(?:rier)?\.(?:sync|arrive)(?:\.aligned)?\s+(\d+)(?:,\s*(\d+))?;", ptx
        )
    )
    allowed = {(0, None)} | {(int(b), 256) for b in (Bar.SCALE0, Bar.SCALE1, Bar.P0, Bar.P1)}
    allowed |= {(int(Bar.WG0), 128), (int(Bar.WG1), 128)}
    assert set(ids) <= allowed and max(i for i, _ in ids) < 16
    last_init = max(m.start() for m in re.finditer(r"mbarrier\.init\.shared", ptx))
    first_arm = min(m.start() for m in re.finditer(r"mbarrier\.arrive\.expect_tx", ptx))
    sync = r"\bbar(?:rier)?\.sync(?:\.aligned)?\s+(\d+)[,;]"
    between = re.findall(sync, ptx[last_init:first_arm])
    # racecheck: the arming a wait after the inits, and that wait every thread's (bar 0), so
    # that warp 0 has waited at no more barriers than the others (a wait of its own put its
    # stores one behind every reader's: 320 + 544 RAW reports on 2026-12-02 18:47)
    assert between == ["0"]
    assert "setmaxnreg" not in ptx


def _unfenced_tile_stores(ptx: str) -> list[tuple[int, int]]:
    """(store line, barrier line) for each barrier reached, in the PTX's order, with a 16-bit
    tile store since the last fence.proxy.async.shared::cta."""
    pending, bad = None, []
    for n, line in enumerate(ptx.splitlines(), 1):
        if _TILE_STORE.match(line):
            pending = pending or n
        elif _PROXY_FENCE.match(line):
            pending = None
        elif _BARRIER.match(line) and pending:
            bad.append((pending, n))
            pending = None
    return bad


def test_generic_tile_writes_are_proxy_fenced_before_their_barrier(compiled):
    _, _, ptx, _ = compiled
    lines = ptx.splitlines()
    assert sum(bool(_TILE_STORE.match(ln)) for ln in lines) > 0
    assert _unfenced_tile_stores(ptx) == []
    fences = [i for i, ln in enumerate(lines) if _PROXY_FENCE.match(ln)]
    # Q; P_a and P_c per pair variant; the stale rows of both roles; the staged partial O
    assert len(fences) == 10
    for i in fences:  # each is needed: without it a store reaches its barrier unfenced
        assert _unfenced_tile_stores("\n".join(lines[:i] + lines[i + 1 :])), i


def test_steady_pair_loops():
    """The standard build's two steady pair loops (one a warpgroup) at their instruction counts,
    the TMA refills' operands in uniform registers (4 R2UR a loop): the counts the direct
    form's `ostore` compile now matches (tests/test_mla_ostore.py; MLA_NOTES.md, "next/mla-ur":
    the direct compiles before read 1136-1140 / 962-965 with 97 / 63-71 R2UR)."""
    assert _loops(params_for("partial", "bfloat16", 16, 1, tma=True)) == [(1013, 4), (830, 4)]
