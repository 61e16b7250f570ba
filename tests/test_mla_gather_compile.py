"""The MLA seesaw pass's gather form (seesaw.py `gather`; standard at 16-bit page 1) compiled for
sm_90a on the CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin): what its design
takes for granted.

- K arrives by cp.async only: 128 LDGSTS.E.BYPASS.128 (16-byte, L1-bypassing: tiles 0 and 1 in
  the prologue, 9 chunks x 4 rows a thread, 36; the steady pairs' refills, warpgroup 0's two
  left halves 2 x 16 and warpgroup 1's two right halves 2 x 20; warpgroup 1's pair with a + 2
  alone, 20), each chunk's copies closed by one cp.async.mbarrier.arrive.noinc (32 sites: 9 +
  8 + 10 + 5); the K mbarriers count 128 arrivals (the gathering warpgroup's threads), Q's one
  (its TMA boxes, the only UTMALDG left: 9 a query token).
- Every mbarrier wait is followed by fence.proxy.async.shared::cta before the next WGMMA (cp.async
  writes are the generic proxy's, WGMMA reads the async proxy's), and the P V of the tile the
  other warpgroup scored follows one too.
- The page table: 4 loads a thread a tile (`_gather_rows`: one (page, slot) per gathered row),
  read a pair ahead as `_page`'s; no stale-row zeroing (no WG1 barrier).
- Warp-collective instructions reached by converged warps (no BRA.DIV / WARPSYNC.COLLECTIVE), no
  setmaxnreg, no spills; registers near the cap: 254 at 16 x 1 and at 64 x 1 direct `ostore`
  with cu13's ptxas and with cu12's (the cu12 libraries of this machine's venv, loaded by hand,
  2026-12-05; the same opcode counts), the TMA form's 230. The TMA form's SASS is unchanged
  (tests/test_mla_seesaw_compile.py)."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from cubins import build

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.mla.sm90 import SPEC, params_for  # noqa: E402
from forgekernel.kernels.attention.mla.sm90.seesaw import CHUNKS, STAGES, Bar  # noqa: E402
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)")
REGISTERS = 254  # both keys, both toolchains (cu13, and cu12's ptxas on this machine)


# CI: the bf16 16 x 1 build (a standard key, `gather_params`: the launcher's default at page
# size 1, prebuilt; CI's only compile of a gather key; the gather's mainloop, page table and
# fences are one code path for both forms); the f16 64 x 1 direct `ostore` build is slow (an
# MLA compile, ~10 s of an idle CPU, 2026-12-07; its direct `ostore` epilogue is
# test_mla_ostore's in CI)
@pytest.fixture(
    scope="module",
    params=[("bfloat16", 16, 1, False),
            pytest.param(("float16", 64, 1, True), marks=pytest.mark.slow)],
    ids=["bf16_16x1", "f16_64x1_direct_ostore"],
)  # fmt: skip
def compiled(request):
    dtype, heads, qtokens, direct = request.param
    params = params_for("partial", dtype, heads, qtokens, tma=True, direct=direct,
                        ostore=direct, gather=True)  # fmt: skip
    found = build(SPEC, params)
    return found.resources, Counter(_OP.findall(found.sass)), found.ptx, request.param


def test_k_arrives_by_cp_async_on_the_chunk_mbarriers(compiled):
    res, ops, ptx, (_, _, qtokens, _) = compiled
    assert ops["LDGSTS.E.BYPASS.128"] == 36 + 32 + 40 + 20
    assert sum(n for op, n in ops.items() if op.startswith("LDGSTS")) == 128
    assert ops["ARRIVES.LDGSTSBAR.64.ARVCNT"] == 32
    assert ptx.count("cp.async.mbarrier.arrive.noinc.shared.b64") == 32
    assert ops["UTMALDG.3D"] == CHUNKS * qtokens  # Q's boxes alone
    assert ops["SYNCS.ARRIVE.TRANS64"] == 1  # Q's arming
    inits = re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^\]]+\],\s*(%r\d+|\d+);", ptx)
    counts = Counter(
        int(re.search(rf"mov\.b32\s+{re.escape(reg)},\s*(\d+);", ptx).group(1)) for reg in inits
    )
    assert counts == {THREADS_PER_WG: STAGES * CHUNKS, 1: 1}
    assert sum(n for op, n in ops.items() if op.startswith("HGMMA")) == 196
    assert ops["BRA.DIV"] == 0 and ops["WARPSYNC.COLLECTIVE"] == 0
    assert "setmaxnreg" not in ptx


def test_every_wait_is_proxy_fenced_before_the_next_wgmma(compiled):
    _, _, ptx, _ = compiled
    pending, waits = False, 0
    for line in ptx.splitlines():
        if "mbarrier.try_wait" in line:
            pending, waits = True, waits + 1
        elif "fence.proxy.async.shared::cta" in line:
            pending = False
        elif "wgmma.mma_async" in line:
            assert not pending, line
    assert waits == 37  # (Q's, and each K chunk's in `_scores`' sites)
    # P V of the other warpgroup's tile: a fence after the P0 / P1 wait
    lines = ptx.splitlines()
    for i, line in enumerate(lines):
        if re.search(rf"\bbar(?:rier)?\.sync(?:\.aligned)?\s+({int(Bar.P0)}|{int(Bar.P1)}),", line):
            nxt = next(ln for ln in lines[i + 1 :] if "fence.proxy" in ln or "wgmma.mma" in ln)
            assert "fence.proxy.async.shared::cta" in nxt, (i, line)


def test_page_table_reads_and_no_stale_zeroing(compiled):
    _, ops, ptx, (_, _, qtokens, _) = compiled
    # 4 page-table entries a thread per tile read: prologue 1 tile, steady pairs 2 + 2, the
    # last pair variant of warpgroup 1 with a + 2 alone 1; + seqlens_k (+ cu_seqlens_q)
    assert ops["LDG.E"] == 4 * (1 + 2 + 2 + 1) + 1 + (2 if qtokens > 1 else 0)
    wg1 = rf"\bbar(?:rier)?\.sync(?:\.aligned)?\s+{int(Bar.WG1)},\s*128;"
    assert not re.search(wg1, ptx)  # (no `_zero_stale` / `_match_stale`)


def test_resources(compiled):
    res, ops, _, _ = compiled
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert res["registers"] == REGISTERS
    # the cubin's shared memory as the TMA form's (1024, both toolchains: the same Shared
    # struct, allocated at launch)
    assert res["smem_bytes"] == 1024
