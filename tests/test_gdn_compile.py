"""The gated delta rule step compiled for sm_90a on the CPU (no GPU: the DSL compiles, ptxas
assembles, cuobjdump reads the cubin), its structure as the kernels state it.

The row-streaming kernel (k-last, step_rows.py): at T = 1 at most 64 registers (8 CTAs of 128
threads per SM: 128 KB of state in flight), at T = 4 at most 96 (5 CTAs); no spills, no shared
memory, no barrier; the state read with 8 and written with 8 16-byte accesses per thread (one
512-byte row per warp instruction), the intermediate states T times more; every global load
issued before the first instruction that uses the state (nothing waits for a second round trip
after the state's); per token 8 index shuffles (the u of the warp's rows; at T > 1 3 more, the
token's v, beta and decay) and 23 butterfly shuffles (k.q and the reduce-scatter of the row
sums; the l2 norms 10 more); the projection gating costs no registers. The staged kernel
(k-first, step.py): no spills, one CTA barrier and no global load after it (the tokens' inputs
staged in one round trip)."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.linear_attention.gdn_decode.sm90 import SPEC, params_for  # noqa: E402
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")
_STATE_LOAD = re.compile(r"R(\d+), desc\[\w+\]\[(R\d+)\.64(?:\+0x[0-9a-f]+)?\]")


def _compiled(**kw) -> tuple[dict, list[tuple[str, str]]]:
    """(resources, SASS (opcode, operands) in program order) of one bf16 configuration."""
    with tempfile.TemporaryDirectory() as d:
        compiled = SPEC.compile(params_for("bfloat16", **kw), f"--keep-cubin --dump-dir {d}")
        cubin = getattr(compiled.artifacts, "CUBIN", None)
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = path
        res = inspect_cubin(cubin)
        sass = sass_text(str(cubin))
    return res, _INSTR.findall(sass)


def _ops(instrs) -> list[str]:
    return [op for op, _ in instrs]


def _state_first_use(instrs) -> int:
    """Index of the first instruction that reads a register the state's loads wrote (the 8
    LDG.E.128 off one base register)."""
    loads = [(i, _STATE_LOAD.match(a.strip())) for i, (op, a) in enumerate(instrs)
             if op == "LDG.E.128"]  # fmt: skip
    bases = [m.group(2) for _, m in loads if m]
    base = max(set(bases), key=bases.count)
    regs = set()
    for _, m in loads:
        if m and m.group(2) == base:
            regs |= set(range(int(m.group(1)), int(m.group(1)) + 4))
    last = max(i for i, m in loads if m and m.group(2) == base)
    for i in range(last + 1, len(instrs)):
        op, args = instrs[i]
        sources = args.split(",")[1:] if not op.startswith("ST") else args.split(",")
        if any(int(r) in regs for a in sources for r in re.findall(r"\bR(\d+)", a)):
            return i
    raise AssertionError("the state is never used")


CONFIGS = {
    "decode": {"l2norm": True, "tokens": 1, "pool": False},  # the suite's fla-form decode
    "def_decode": {"gating": True, "tokens": 1, "pool": False},  # gdn_decode's definition
    "def_mtp": {"gating": True, "tokens": 4},  # gdn_mtp's, a pool
    "verify": {"gating": True, "tokens": 4, "intermediate": True, "update_state": False},
    "k_first": {"k_last": False, "l2norm": True},  # the staged kernel
}


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            cache[name] = _compiled(**CONFIGS[name])
        return cache[name]

    return get


@pytest.mark.parametrize(("name", "registers"), [("decode", 64), ("def_decode", 64),
                                                 ("def_mtp", 96), ("verify", 96)])  # fmt: skip
def test_rows_kernel_resources(compiled, name, registers):
    res, instrs = compiled(name)
    ops = _ops(instrs)
    assert res["registers"] <= registers
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert not [op for op in ops if op.startswith(("BAR", "LDS", "STS"))]


@pytest.mark.parametrize(("name", "stores"), [("decode", 8), ("def_decode", 8), ("def_mtp", 8),
                                              ("verify", 32)])  # fmt: skip
def test_rows_kernel_streams_whole_rows(compiled, name, stores):
    _, instrs = compiled(name)
    ops = _ops(instrs)
    assert ops.count("LDG.E.128") == 8 and ops.count("STG.E.128") == stores


@pytest.mark.parametrize("name", ["decode", "def_decode", "def_mtp", "verify"])
def test_rows_kernel_loads_everything_before_using_the_state(compiled, name):
    _, instrs = compiled(name)
    first_use = _state_first_use(instrs)
    assert not [op for op, _ in instrs[first_use:] if op.startswith("LDG")]


@pytest.mark.parametrize(
    ("name", "tokens", "norms"),
    [("decode", 1, True), ("def_decode", 1, False), ("def_mtp", 4, False)],
)
def test_rows_kernel_shuffles(compiled, name, tokens, norms):
    _, instrs = compiled(name)
    ops = _ops(instrs)
    scalars = 3 * tokens if tokens > 1 else 0  # each token's v, beta, decay from its lanes
    assert ops.count("SHFL.IDX") == 8 * tokens + scalars
    assert ops.count("SHFL.BFLY") == (23 + 10 * norms) * tokens


def test_gating_costs_no_registers(compiled):
    assert compiled("def_decode")[0]["registers"] <= compiled("decode")[0]["registers"]


def test_staged_kernel_reads_no_global_memory_in_the_token_loop(compiled):
    res, instrs = compiled("k_first")
    ops = _ops(instrs)
    assert res["spill_bytes"] == 0
    bars = [i for i, op in enumerate(ops) if op.startswith("BAR")]
    assert len(bars) == 1
    assert not [op for op in ops[bars[0] :] if op.startswith("LDG")]
