"""The lightning indexer's kernels compiled for sm_90a on the CPU (no GPU: the DSL compiles,
ptxas assembles, cuobjdump reads the cubin), their structure as the kernels state it.

Logits (decode qtokens 1, paged; prefill qtokens 4): FP8 warpgroup MMAs (QGMMA, 4 per tile:
K = 128 in steps of 32), TMA loads (Q, the key tile, its scales), no spills; the 168 registers
of the launch are setmaxnreg's split (producer 40, consumers 232: one CTA per SM). Top-k (one
CTA, and a cluster of 8): one bulk copy of the row's part, no global load of the logits after
it, three histogram rounds (15 shuffles of the scans), shared-memory atomics, no spills; the
cluster's barriers (6 arrivals and waits: statistics, 3 rounds, totals, exit) and its peer
reads (ld.shared::cluster). Shared memory from config (the struct's sizes) fits the SM."""

from __future__ import annotations

import re
import subprocess
import tempfile
from collections import Counter
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.attention.dsa_indexer.sm90 import SPEC, config  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_OP = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")


def _compiled(params) -> tuple[dict, Counter, str]:
    with tempfile.TemporaryDirectory() as d:
        compiled = SPEC.compile(params, f"--keep-cubin --dump-dir {d}")
        cubin = compiled.artifacts.CUBIN
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = str(path)
        res = inspect_cubin(cubin)
        sass = subprocess.run([find_tool("cuobjdump"), "-sass", cubin], capture_output=True,
                              text=True, check=True).stdout  # fmt: skip
    return res, Counter(_OP.findall(sass)), sass


@pytest.mark.parametrize("qtokens, paged", [(1, True), (4, False)])
def test_logits_kernel(qtokens, paged):
    res, ops, _ = _compiled(config.logits_params(qtokens, paged))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert ops["QGMMA"] == config.HEAD_DIM // 32  # one tile's K = 128, e4m3 steps of 32
    assert ops["UTMALDG"] >= 3  # Q, the key tile, its scales
    assert res["registers"] <= 168
    assert config.logits_smem_bytes(qtokens) <= config.SMEM_PER_SM


@pytest.mark.parametrize("cluster", [1, 8])
def test_topk_kernel(cluster):
    res, ops, sass = _compiled(config.topk_params(cluster, cluster == 8))
    assert res["spill_bytes"] == 0 and ops["LDL"] == ops["STL"] == 0
    assert ops["UBLKCP"] == 1  # the row's part, one bulk copy
    assert ops["SHFL"] == 5 * 3  # the three rounds' scans
    assert ops["ATOMS"] >= 5 and ops["REDUX"] >= 3
    assert res["registers"] <= 64  # 2 CTAs of 512 threads per SM
    if cluster > 1:
        assert ops["UCGABAR_ARV"] == ops["UCGABAR_WAIT"] == 6
        assert re.search(r"\bLD\b", sass) is not None  # the peers' counts (generic ld)
    else:
        assert ops["UCGABAR_ARV"] == 0
    assert 2 * config.topk_smem_bytes() <= config.SMEM_PER_SM
