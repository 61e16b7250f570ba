"""The score recompute compiled for sm_90a on the CPU (no GPU: the DSL compiles, ptxas
assembles, cuobjdump reads the cubin), its structure as kernel.py states it: one key tile's
NCHUNK x 4 warpgroup MMAs (K = 576 in steps of 16), the gather by cp.async (LDGSTS: Q's chunks
and 4 rows per K-chunk), no spills, registers within one CTA (or two at 16 heads) per SM."""

from __future__ import annotations

import re
from collections import Counter

import pytest
from cubins import build  # tests/ is on the path

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.dsa_recompute.sm90 import SPEC, config  # noqa: E402
from forgekernel.runtime.resources import find_tool  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
REGISTERS = 65536


def _compiled(params) -> tuple[dict, Counter]:
    """(resources, SASS opcode counts): cubins.build, once a process (the PTX test's build)."""
    found = build(SPEC, params)
    return found.resources, Counter(_OP.findall(found.sass))


@pytest.mark.parametrize("heads, length", [(16, False), (128, True)])
def test_recompute_kernel(heads, length):
    res, ops = _compiled(config.params_for("bfloat16", heads, length))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert ops["HGMMA"] == config.NCHUNK * config.CHUNK // 16
    q_rows = heads // (config.THREADS // 3 // (config.CHUNK // 8))  # Q rows per thread, chunk
    kv_rows = config.TILE // (128 // (config.CHUNK // 8))
    assert ops["LDGSTS"] == config.NCHUNK * (q_rows + kv_rows)
    ctas = config.resident(heads)
    assert res["registers"] * config.THREADS * ctas <= REGISTERS
    assert ctas * config.smem_bytes(heads) <= 233472 - 1024 * ctas


def _ptx(params) -> str:
    return build(SPEC, params).ptx  # the kernel test's compile of the same key


def test_every_signal_follows_a_wait_and_a_proxy_fence():
    """The producer's hand-over (kernel.py): every cp.async.wait_group is followed by a
    fence.proxy.async before the next mbarrier arrive (the landed bytes are made visible to the
    WGMMAs' async proxy by the thread that wrote them, then released)."""
    ptx = _ptx(config.params_for("bfloat16", 16))
    events = re.findall(r"(cp\.async\.wait_group|fence\.proxy\.async|mbarrier\.arrive)", ptx)
    waits = events.count("cp.async.wait_group")
    assert waits == events.count("fence.proxy.async") == config.NCHUNK + 1
    pending = False
    for e in events:
        if e == "cp.async.wait_group":
            pending = True
        elif e == "fence.proxy.async":
            pending = False
        else:
            assert not pending, "an arrive between a cp.async wait and its proxy fence"
