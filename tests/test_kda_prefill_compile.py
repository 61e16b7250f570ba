"""The KDA recurrence kernel (kernels/linear_attention/kda_prefill/sm90/recurrence.py) compiled
for sm_90a on the CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin): its
resources as config.py says, the WGMMAs it issues, its TMA loads, its barriers.

- 384 threads (value_split: 256, one state warpgroup per CTA, grid z = 2), split by setmaxnreg
  40 / 232 (producer / state warpgroups) within the launch's registers; nothing spilled (no
  local memory);
- shared memory (SharedStorage, plus the DSL's static) within the 227 KB opt-in, under
  config's bound;
- per state warpgroup and chunk: X^T, O^T (8 x 64x64x16 each, over K), U^T and U^T P^T (4
  each, over the chunk), the update (4 x 64x128x16, B transposed), in 5 commit groups, none
  serialized;
- TMA per chunk: Qg, Kg, Kd and v (two 64-column boxes each), T diag(beta), P, D (one box);
- the rings' arrive counts (TMA: one expect-tx; consumers: the 8 state warps)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG  # noqa: E402
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import (  # noqa: E402
    compile_kda_recurrence,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")
CONFIGS = {
    "bf16": {"dtype": "bfloat16"},
    "bf16_state": {"dtype": "bfloat16", "initial_state": True},
    "fp16_state": {"dtype": "float16", "initial_state": True},
    "bf16_state_split": {"dtype": "bfloat16", "initial_state": True, "value_split": True},
    "fp16_split": {"dtype": "float16", "value_split": True},
}


def _split(name: str) -> bool:
    return CONFIGS[name].get("value_split", False)


def _compile(dtype: str, **kw):
    """(resources, SASS (opcode, operands) in program order, shared memory bytes, PTX)."""
    params = dict(config.params_for(dtype, **kw))
    kernel = kernel_for(params)
    with tempfile.TemporaryDirectory() as d:
        compiled = compile_kda_recurrence(
            params, "sm_90a", f"--keep-cubin --keep-ptx --dump-dir {d}", kernel=kernel
        )
        ptx = compiled.artifacts.PTX
        ptx = ptx if isinstance(ptx, str) else ptx.decode()
        cubin = getattr(compiled.artifacts, "CUBIN", None)
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = path
        res = inspect_cubin(cubin)
        sass = subprocess.run([find_tool("cuobjdump"), "-sass", str(cubin)],
                              capture_output=True, text=True, check=True).stdout  # fmt: skip
    return res, _INSTR.findall(sass), kernel.shared_storage.size_in_bytes(), ptx


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            kw = dict(CONFIGS[name])
            cache[name] = _compile(kw.pop("dtype"), **kw)
        return cache[name]

    return get


@pytest.mark.parametrize("name", list(CONFIGS))
def test_registers_and_no_spills(compiled, name):
    res, instrs, _, _ = compiled(name)
    ops = [op for op, _ in instrs]
    threads, wgs = (config.SPLIT_THREADS, 1) if _split(name) else (config.THREADS, 2)
    assert res["registers"] * threads <= 65536 and res["registers"] <= 255
    assert res["spill_bytes"] == 0
    assert not [op for op in ops if op.startswith(("LDL", "STL"))]
    maxreg = [int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG")]
    assert sorted(maxreg) == [config.PRODUCER_REGS, config.STATE_REGS]
    split = config.PRODUCER_REGS + wgs * config.STATE_REGS
    assert split * THREADS_PER_WG <= res["registers"] * threads


@pytest.mark.parametrize("name", list(CONFIGS))
def test_shared_memory_fits(compiled, name):
    res, _, smem, _ = compiled(name)
    assert smem <= config.smem_bytes() <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wgmmas_and_commit_groups(compiled, name):
    _, instrs, _, _ = compiled(name)
    hgmma = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    shapes = [op for op, _ in hgmma]
    assert sum(s.startswith("HGMMA.64x64x16") for s in shapes) == 16 + 8
    assert sum(s.startswith("HGMMA.64x128x16") for s in shapes) == 4
    assert all("tnspB" in a for s, a in hgmma if s.startswith("HGMMA.64x128x16"))
    groups = sum("gsb0" in a for _, a in hgmma)
    assert groups == 5  # X^T + O^T, U^T, U^T P^T, the update (X and O: 2 groups, 1 wait)
    waits = sum(op == "WARPGROUP.DEPBAR.LE" for op, _ in instrs)
    assert waits <= groups


@pytest.mark.parametrize("name", list(CONFIGS))
def test_tma_loads(compiled, name):
    _, instrs, _, _ = compiled(name)
    ops = [op for op, _ in instrs]
    loads = [op for op in ops if op.startswith("UTMALDG")]
    v_boxes = 1 if _split(name) else 2  # value_split: its 64 value columns of v
    assert len(loads) == 2 * 3 + v_boxes + 3, loads  # Qg, Kg, Kd: two boxes; T, P, D: one
    assert ops.count("STSM.16.MT88.4") == 4  # O^T, transposed into the token-major tile


def _mbarrier_init_counts(ptx: str) -> list[int]:
    regs = dict(re.findall(r"mov\.b32\s+(%r\d+), (\d+);", ptx))
    return [
        int(regs.get(c, c))
        for c in re.findall(r"mbarrier\.init\.shared\.b64\s+\[[^]]+\], ([^;]+);", ptx)
    ]


@pytest.mark.parametrize("name", list(CONFIGS))
def test_ring_arrive_counts(compiled, name):
    *_, ptx = compiled(name)
    want = []
    warps = 4 if _split(name) else 8
    for stages in (config.QK_STAGES, config.V_STAGES, config.AUX_STAGES):
        want += [1] * stages + [warps] * stages
    assert _mbarrier_init_counts(ptx) == want


@pytest.mark.parametrize("name", list(CONFIGS))
def test_wgmma_descriptors_and_named_barriers(compiled, name):
    """The shared-memory descriptors' constant fields: 128-byte swizzle, 1024 bytes between
    8-row groups; the K-major B operands (Kg, Qg, T diag(beta), P) a 16-byte leading offset,
    the update's MN-major Kd (its tile transposed) 8192 bytes between its two 64-column halves
    (the TMA boxes). Named barriers: only the state warpgroups' OUT + w (computed ids), 128
    threads each, besides __syncthreads."""
    *_, ptx = compiled(name)
    consts = {int(c) for c in re.findall(r"or\.b64\s+%rd\d+, %rd\d+, (\d+);", ptx)}

    def desc(lbo: int, sbo: int) -> int:
        return (1 << 62) | ((sbo >> 4) << 32) | ((lbo >> 4) << 16)

    assert consts == {desc(16, 1024), desc(8192, 1024)}
    syncs = re.findall(r"bar\.sync\s+([^,;]+)(?:,\s*(\d+))?;", ptx)
    assert {(i, n) for i, n in syncs if i.isdigit()} == {("0", "")}
    assert {n for i, n in syncs if not i.isdigit()} == {str(THREADS_PER_WG)}


# ----------------------------------------------------------------------------- the first pass


@pytest.fixture(scope="module")
def compiled_intra():
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import compile_kda_intra
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra import KdaIntraSm90

    cache = {}

    def get(dtype):
        if dtype not in cache:
            kernel = KdaIntraSm90(128)
            params = {"dtype": dtype, "k": 128}
            with tempfile.TemporaryDirectory() as d:
                opts = f"--keep-cubin --dump-dir {d}"
                compiled = compile_kda_intra(params, "sm_90a", opts, kernel=kernel)
                cubin = compiled.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    path = Path(d) / "k.cubin"
                    path.write_bytes(cubin)
                    cubin = path
                res = inspect_cubin(cubin)
                cmd = [find_tool("cuobjdump"), "-sass", str(cubin)]
                sass = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            cache[dtype] = (res, _INSTR.findall(sass),
                            kernel.shared_storage.size_in_bytes())  # fmt: skip
        return cache[dtype]

    return get


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_first_pass_resources(compiled_intra, dtype):
    """128 threads, no spills (210 registers with the sub-chunk loads and the tf32 merges), two
    CTAs an SM by shared memory (~104 KB each, unchanged by them); 64 HGMMA 64x16x16 (4 column
    blocks x 8 k-steps, k side and q side), in 8 commit groups with 2 waits (not serialized:
    ptxas serialized them all while the inverse ran under the q side)."""
    res, instrs, smem = compiled_intra(dtype)
    ops = [op for op, _ in instrs]
    assert res["registers"] <= 255 and res["spill_bytes"] == 0
    assert not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert 2 * (smem + res["smem_bytes"]) <= SMEM_CAPACITY
    assert sum(op.startswith("HGMMA.64x16x16.F32.BF16") for op in ops) == 64
    assert ops.count("WARPGROUP.DEPBAR.LE") == 2
    assert ops.count("WARPGROUP.ARRIVE") == 8


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_first_pass_loads_a_sub_chunk_ahead(compiled_intra, dtype):
    """Loads in flight: pass 0's 64 g loads all issued before the first global store (D); the
    k and q sides load sub-chunk b + 1 (16 k or q loads, 2-byte, one channel a thread, and 16
    of g) at the top of sub-chunk b's run-time loop, before its stores, so that they fly
    under its math; the q side's first sub-chunk before the k-side WGMMAs' wait. The token
    loops of before had one load in flight (the next token's behind this one's stores)."""
    _, instrs, _ = compiled_intra(dtype)
    ops = [op for op, _ in instrs]
    first_store = next(i for i, op in enumerate(ops) if op.startswith("STG"))
    assert sum(op == "LDG.E" for op in ops[:first_store]) >= 64 + 2  # g, chunk start / length
    narrow = [i for i, op in enumerate(ops) if op == "LDG.E.U16"]
    assert len(narrow) == 4 * 16  # k: first, in the loop; q: first, in the loop
    groups = [narrow[16 * n : 16 * n + 16] for n in range(4)]
    for group in groups:
        assert not [op for op in ops[group[0] : group[-1]] if op.startswith("STG")]
    assert groups[2][-1] < ops.index("WARPGROUP.DEPBAR.LE")


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_first_pass_tensor_core_inverse(compiled_intra, dtype):
    """The inverse's merges on the tensor cores (GDN's `inverse_mma`): the 7 block products of
    the two warp paths as mma.sync m16n8k8 tf32, 4 HMMA each; FFMA 979 -> 123 against the FFMA
    merges dropped 2026-12-03 (phase 0 and the rest; bf16 6,328 -> 5,448 static instructions,
    the same 210 registers and shared memory)."""
    _, instrs, _ = compiled_intra(dtype)
    ops = [op for op, _ in instrs]
    assert sum(op.startswith("HMMA.1688.F32.TF32") for op in ops) == 7 * 4
    assert ops.count("FFMA") <= 160
