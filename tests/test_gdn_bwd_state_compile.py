"""The Gated DeltaNet backward's kernel 1 (reverse state recurrence) compiled for sm_90a on the
CPU (the DSL compiles, ptxas assembles, cuobjdump reads the cubin): 384 threads, 168 registers
at launch, split by setmaxnreg 40 / 232 (producer / state warpgroups), nothing spilled; shared
memory within config's bound; per chunk and state warpgroup the WGMMAs dS^T Ke^T (8 x
64x64x16), dO^T P (4), dO^T Qe and -dU^T W (4 x 64x128x16 each, B transposed), four commit
groups; five TMA boxes a chunk (nine 64-column halves). The dke variant adds U's box (two
halves), dS^T into shared memory by 8 transposed stmatrix a thread, and dke = U dS^T (8 x
64x64x16, both operands in shared memory, one more group). The `channel_decay` variant (Kimi
Delta Attention's per-key-channel e^(G_C)) adds one (1, K) fp32 box a chunk (a tenth TMA load)
and reads each thread's 32 columns of it from shared memory (16 LDS.64 under cu13's ptxas),
with the same registers, groups and no spill."""

from __future__ import annotations

import re
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("cutlass")

from dsl_toolchain import dsl_toolchain  # noqa: E402

from forgekernel.kernels.common.sm90.constants import SMEM_CAPACITY, THREADS_PER_WG  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import config  # noqa: E402
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.compile import (  # noqa: E402
    compile_gdn_bwd_state,
    kernel_for,
)
from forgekernel.runtime.resources import find_tool, inspect_cubin, sass_instructions, sass_text  # noqa: E402

if find_tool("cuobjdump") is None:
    pytest.skip("cuobjdump not found", allow_module_level=True)

CONFIGS = {"bf16": ("bfloat16", False, False), "bf16_dht": ("bfloat16", True, False),
           "fp16_dht": ("float16", True, False), "bf16_dke": ("bfloat16", False, True),
           "fp16_dht_dke": ("float16", True, True), "bf16_channel": ("bfloat16", False, False),
           "fp16_dht_channel": ("float16", True, False)}  # fmt: skip


# CI: the plain form, dht + dke (each form's code in one build) and channel decay (with its plain
# base); the second dtype's fp16_dht and its channel-decay pair are slow (~3 s of CI's CPU, idle
# machine, 2026-12-06), and so are dht and dke alone (~5 s, 2026-12-07: fp16_dht_dke has both)
SLOW_CONFIGS = ("fp16_dht", "fp16_dht_channel", "bf16_dht", "bf16_dke")
NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in SLOW_CONFIGS else n for n in CONFIGS]


def _channel(name: str) -> bool:
    return name.endswith("_channel")


@pytest.fixture(scope="module")
def compiled():
    cache = {}

    def get(name):
        if name not in cache:
            dtype, dht, dke = CONFIGS[name]
            params = dict(config.params_for(dtype, d_final_state=dht, dke=dke,
                                            channel_decay=_channel(name)))  # fmt: skip
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_gdn_bwd_state(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                           kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
            cache[name] = res, sass_instructions(sass), kernel.shared_storage.size_in_bytes()
        return cache[name]

    return get


@pytest.mark.parametrize("name", NAMES)
def test_registers_and_no_spills(compiled, name):
    res, instrs, _ = compiled(name)
    assert res["registers"] <= 65536 // config.THREADS
    assert res["spill_bytes"] == 0
    assert not [op for op, _ in instrs if op.startswith(("LDL", "STL"))]
    maxreg = [int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG")]
    assert sorted(maxreg) == [config.PRODUCER_REGS, config.STATE_REGS]
    split = config.PRODUCER_REGS + config.STATE_WGS * config.STATE_REGS
    assert split * THREADS_PER_WG <= res["registers"] * config.THREADS


@pytest.mark.parametrize("name", NAMES)
def test_shared_memory_fits(compiled, name):
    res, _, smem = compiled(name)
    assert smem <= config.smem_bytes(dke=CONFIGS[name][2], channel_decay=_channel(name))
    assert config.smem_bytes(dke=CONFIGS[name][2], channel_decay=_channel(name)) <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY


@pytest.mark.parametrize("name", NAMES)
def test_wgmmas_and_tma(compiled, name):
    _, instrs, _ = compiled(name)
    dke = CONFIGS[name][2]
    ops = [op for op, _ in instrs]
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    assert sum(op.startswith("HGMMA.64x64x16") for op, _ in shapes) == 8 + 4 + 8 * dke
    wide = [a for op, a in shapes if op.startswith("HGMMA.64x128x16")]
    assert len(wide) == 8 and all("tnspB" in a for a in wide)
    assert sum("gsb0" in a for _, a in shapes) == 4 + dke  # one commit group a product
    # dO, Ke, Qe, W (and U): two 64-column halves; P^T one; e^(G_C) (1, K) one
    assert ops.count("UTMALDG.4D") == 9 + 2 * dke + _channel(name)
    assert ops.count("STSM.16.MT88.4") == 8 * dke


@pytest.mark.parametrize(
    "name", ["bf16_channel", pytest.param("fp16_dht_channel", marks=pytest.mark.slow)]
)
def test_channel_decay_resources(compiled, name):
    """The per-channel decay costs no register and no spill (168 at launch as the scalar
    kernel) and 1 KB of shared memory (a (K,) fp32 vector a ring stage); its columns are read
    from shared memory (scalar kernel: no fp32 LDS)."""
    res, instrs, smem = compiled(name)
    scalar_res, scalar_instrs, scalar_smem = compiled(name.removesuffix("_channel"))
    assert res["registers"] == scalar_res["registers"]
    if dsl_toolchain() == "cu13":
        assert res["registers"] == 168
    assert smem == scalar_smem + 2 * 128 * 4
    lds64 = sum(op == "LDS.64" for op, _ in instrs)
    assert sum(op == "LDS.64" for op, _ in scalar_instrs) == 0
    if dsl_toolchain() == "cu13":
        assert lds64 == 16  # 32 columns a thread, two adjacent ones a load
    else:
        assert lds64 > 0


# ---- out16 / forward (the op's kernel path: kernel 2's 16-bit forms; the forward launch) ------

OUT16 = {
    "bf16_out16": ("bfloat16", False, False),
    "fp16_dht_out16": ("float16", True, False),
    "bf16_dht_fwd": ("bfloat16", True, True),
    "fp16_fwd": ("float16", False, True),
    # Kimi Delta Attention's device pass (bf16): e^(G_C) per key channel in both launches
    "bf16_out16_channel": ("bfloat16", False, False),
    "bf16_dht_out16_channel": ("bfloat16", True, False),
    "bf16_fwd_channel": ("bfloat16", False, True),
    "bf16_dht_fwd_channel": ("bfloat16", True, True),
}
# CI: one reverse and one forward channel key; the dht pair is slow (~1.5 s each)
OUT16_SLOW = ("bf16_dht_out16_channel", "bf16_fwd_channel")
OUT16_NAMES = [pytest.param(n, marks=pytest.mark.slow) if n in OUT16_SLOW else n for n in OUT16]


@pytest.fixture(scope="module")
def compiled16():
    cache = {}

    def get(name):
        if name not in cache:
            # the varlen / fused / fused w_from_t form of an OUT16 key
            base = name.removesuffix("_varlen").removesuffix("_fused").removesuffix("_wfromt")
            dtype, dht, forward = OUT16[base]
            w_from_t = name.endswith("_wfromt")
            params = dict(config.params_for(dtype, d_final_state=dht, out16=True,
                                            forward=forward, channel_decay=_channel(base),
                                            varlen=name.endswith("_varlen"),
                                            fused=name.endswith("_fused") or w_from_t,
                                            w_from_t=w_from_t))  # fmt: skip
            kernel = kernel_for(params)
            with tempfile.TemporaryDirectory() as d:
                fn = compile_gdn_bwd_state(params, "sm_90a", f"--keep-cubin --dump-dir {d}",
                                           kernel=kernel)  # fmt: skip
                cubin = fn.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    Path(d, "k.cubin").write_bytes(cubin)
                    cubin = Path(d, "k.cubin")
                res = inspect_cubin(cubin)
                sass = sass_text(cubin)
            cache[name] = res, sass_instructions(sass), kernel.shared_storage.size_in_bytes()
        return cache[name]

    return get


@pytest.mark.parametrize("name", OUT16_NAMES)
def test_out16_resources(compiled16, name):
    """16-bit dU and dS (K, V) a chunk: the dh variant's registers (168 at launch under cu13),
    setmaxnreg split and shared memory, no spill (the 16-bit dS tile's static (K, V) strides
    keep the 2-byte stores' offsets immediate: dynamic ones spilled 8 bytes without a final
    state); dS stored from the 16-bit A operand's registers (no second conversion): 64 2-byte
    stores of dS and 32 of dU a thread and chunk, fp32 stores only for dh0 (64). `forward`:
    P^T and Qe neither loaded nor multiplied (6 TMA loads, 8 + 4 HGMMA in 2 groups, dO^T added
    by 32 more FADD), 48 KB less shared memory. `channel_decay` (Kimi Delta Attention's device
    pass): the same figures but one more TMA load (e^(G_C)'s (1, K) box), 1 KB more shared
    memory and its columns by 16 LDS.64 (cu13)."""
    res, instrs, smem = compiled16(name)
    forward, channel = OUT16[name][2], _channel(name)
    ops = [op for op, _ in instrs]
    assert res["spill_bytes"] == 0 and not [op for op in ops if op.startswith(("LDL", "STL"))]
    assert res["registers"] <= 65536 // config.THREADS
    if dsl_toolchain() == "cu13":
        assert res["registers"] == 168
    maxreg = [int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG")]
    assert sorted(maxreg) == [config.PRODUCER_REGS, config.STATE_REGS]
    bound = config.smem_bytes(forward=forward, channel_decay=channel)
    assert smem <= bound <= SMEM_CAPACITY
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY
    assert smem == (99_328 if forward else 148_480) + 1024 * channel
    assert not [op for op in ops if op.startswith("STG.E.64")]  # no fp32 dh pairs
    if dsl_toolchain() == "cu13":  # cu12's ptxas may pack the stores differently
        assert ops.count("STG.E.U16") == 96 and ops.count("STG.E") == 64
    else:
        assert ops.count("STG.E.U16") > 0
    shapes = [(op, a) for op, a in instrs if op.startswith("HGMMA")]
    assert sum(op.startswith("HGMMA.64x64x16") for op, _ in shapes) == (8 if forward else 12)
    wide = [a for op, a in shapes if op.startswith("HGMMA.64x128x16")]
    assert len(wide) == (4 if forward else 8) and all("tnspB" in a for a in wide)
    assert sum("gsb0" in a for _, a in shapes) == (2 if forward else 4)
    assert ops.count("UTMALDG.4D") == (6 if forward else 9) + channel
    if dsl_toolchain() == "cu13":
        assert ops.count("LDS.64") == 16 * channel
    plain = compiled16("bf16_out16" if name.startswith("bf16") else "fp16_dht_out16")[1]
    if forward and dsl_toolchain() == "cu13":
        assert ops.count("FADD") == [op for op, _ in plain].count("FADD") + 32


# ---- varlen (ops/_linattn_varlen.py's slot layout: one CTA per (head, sequence), its own slots)


# CI: one reverse and one forward key; the channel-decay keys are slow (bf16_dht_out16_channel:
# its key and its varlen form compiled for this check alone, ~3 s of an idle CPU, 2026-12-07)
@pytest.mark.parametrize(
    "name",
    ["bf16_out16", "bf16_dht_fwd",
     pytest.param("bf16_dht_out16_channel", marks=pytest.mark.slow),
     pytest.param("bf16_fwd_channel", marks=pytest.mark.slow)],
)  # fmt: skip
def test_varlen_costs_nothing_per_chunk(compiled16, name):
    """The varlen form of a device-pass key: the same registers (168 at launch under cu13), the
    same shared memory, no spill, the same WGMMAs, TMA loads and 16-bit stores a chunk; its
    extra work is three int32 loads a CTA (order[n], cu_seqlens[n], cu_seqlens[n + 1])."""
    res, instrs, smem = compiled16(name + "_varlen")
    base_res, base_instrs, base_smem = compiled16(name)
    assert res["spill_bytes"] == 0 and res["registers"] == base_res["registers"]
    assert smem == base_smem
    ops, base_ops = ([op for op, _ in x] for x in (instrs, base_instrs))
    for prefix in ("HGMMA", "UTMALDG", "STG.E.U16", "STG.E.64", "USETMAXREG", "LDL", "STL"):
        assert sum(op.startswith(prefix) for op in ops) == sum(
            op.startswith(prefix) for op in base_ops
        ), prefix
    assert (
        sum(op.startswith("LDG") for op in ops) == sum(op.startswith("LDG") for op in base_ops) + 3
    )


def test_varlen_is_only_in_its_keys():
    """The standard keys (the batch path's) do not name varlen: their kernels, and so their
    cache entries, are the ones from before the form (their SASS compared identical on
    2026-12-06, docs/linear_attention/NOTES.md "Varlen backward, one launch")."""
    assert "varlen" not in dict(config.params_for("bfloat16", out16=True, forward=True))
    assert dict(config.params_for("bfloat16", out16=True, varlen=True))["varlen"] is True


# ---- fused (the fused route's forward launch, next/gdn-fused-diet: k and G for Ke, no U)


@pytest.mark.parametrize("name", ["bf16_dht_fwd", pytest.param("fp16_fwd", marks=pytest.mark.slow)])
def test_fused_forward_launch(compiled16, name):
    """`fused`: the forward key less U's 32 two-byte stores a thread and chunk, plus the token
    decays e^(G_C - G) of its U^T columns: 17 fp32 loads of G (16 columns and G_C) and 16
    exponentials a thread and chunk; the same registers at launch, setmaxnreg split, shared
    memory, WGMMAs, TMA loads (k's box in Ke's) and h / final-state stores, no spill (cu13,
    2026-12-06: the state region R0-R215 of 232, was R187)."""
    res, instrs, smem = compiled16(name + "_fused")
    base_res, base_instrs, base_smem = compiled16(name)
    assert res["spill_bytes"] == 0 and res["registers"] == base_res["registers"]
    assert smem == base_smem
    ops, base_ops = ([op for op, _ in x] for x in (instrs, base_instrs))
    assert ops.count("STG.E.U16") == base_ops.count("STG.E.U16") - 32
    assert ops.count("MUFU.EX2") == base_ops.count("MUFU.EX2") + 16
    for prefix in ("HGMMA", "UTMALDG", "STG.E.64", "USETMAXREG", "LDL", "STL"):
        assert sum(op.startswith(prefix) for op in ops) == sum(
            op.startswith(prefix) for op in base_ops
        ), prefix
    assert ops.count("STG.E") == base_ops.count("STG.E")  # dh0 (fp32)
    loads = sum(op.startswith("LDG") for op in ops) - sum(op.startswith("LDG") for op in base_ops)
    assert loads == 17
    for bad in ({"forward": False}, {"forward": True, "varlen": True}):
        with pytest.raises(ValueError, match="fused needs forward, not varlen"):
            config.params_for("bfloat16", out16=True, fused=True, **bad)


# ---- w_from_t (the fused route's forward launch forming W, u: next/gdn-w-from-t2)


def _state_region_max_register(instrs) -> int:
    """The highest register the state warpgroups' setmaxnreg region names."""
    region, cur = [], 0
    for op, a in instrs:
        if op.startswith("USETMAXREG"):
            cur = int(a.split(",")[-1], 16)
        elif cur == config.STATE_REGS:
            region.append(a)
    return max(int(r) for a in region for r in re.findall(r"\bR(\d+)\b", a))


# slow, both: `w_from_t` is a candidate (`_candidate_params` only; ops.gated_delta_rule_bwd
# FUSED_WFROMT, the route to it, off until its device A/B), ~2.4 s of an idle CPU in CI's run
# (2026-12-07). fp16_fwd (no dht) is the form whose HGMMAs ptxas serialized (next/wft-review):
# `-m slow` before landing a change to it or adopting it. The standard `fused` key it is
# compared with stays CI's at bf16 dht (test_fused_forward_launch; its fp16 case slow already)
@pytest.mark.slow
@pytest.mark.parametrize("name", ["bf16_dht_fwd", "fp16_fwd"])
def test_w_from_t_forward_launch(compiled16, name):
    """`w_from_t` against `fused` (the same flags): u^T's rows and -W's column half formed by
    each state warpgroup, 8 more HGMMA.64x64x16 a thread and chunk, all with B transposed (T^T
    and k MN-major; the key without has none); -W's 64 x 64 half by 4 stmatrix; beta e^(G_j)
    by 16 more exponentials; beta by 16 more fp32 loads; one TMA box fewer (v 2, T^T 1, k 2:
    5); one named barrier a chunk (Bar.STATE, 256: both halves in place), the only one; the
    same stores (h, the final state), registers at launch, setmaxnreg split, no spill; shared
    memory +16 KB (ring 2 x 40 KB, -W 2 x 16 KB), within config's bound; the state region
    under its 232 (cu13, 2026-12-07: R0-R222 with and without dht, both dtypes; `fused` R0-R213,
    R0-R215 with dht); the HGMMAs pipelined as the `fused` key's, one wait more (the formation's:
    with h's store after the formation ptxas serialized all 20 without dht, C7520)."""
    res, instrs, smem = compiled16(name + "_wfromt")
    base_res, base_instrs, base_smem = compiled16(name + "_fused")
    assert res["spill_bytes"] == 0 and res["registers"] == base_res["registers"]
    maxreg = sorted(int(a.split(",")[-1], 16) for op, a in instrs if op.startswith("USETMAXREG"))
    assert maxreg == [config.PRODUCER_REGS, config.STATE_REGS]
    assert _state_region_max_register(instrs) < config.STATE_REGS
    assert smem == base_smem + 16384 <= config.smem_bytes(forward=True, w_from_t=True)
    assert smem + res["smem_bytes"] <= SMEM_CAPACITY
    ops, base_ops = ([op for op, _ in x] for x in (instrs, base_instrs))

    def count(prefix, xs):
        return sum(op.startswith(prefix) for op in xs)

    narrow = [a for op, a in instrs if op.startswith("HGMMA.64x64x16")]
    base_narrow = [a for op, a in base_instrs if op.startswith("HGMMA.64x64x16")]
    assert len(narrow) == len(base_narrow) + 8
    assert sum("tnspB" in a for a in narrow) == 8 and not any("tnspB" in a for a in base_narrow)
    assert count("HGMMA.64x128x16", ops) == count("HGMMA.64x128x16", base_ops) == 4
    assert count("UTMALDG.4D", ops) == count("UTMALDG.4D", base_ops) - 1 == 5
    assert ops.count("STSM.16.M88.4") == 4 and count("STSM", base_ops) == 0
    waits = [x.count("WARPGROUP.DEPBAR.LE") for x in (ops, base_ops)]
    assert waits[0] == waits[1] + 1 < len(narrow), waits  # not one wait an HGMMA
    assert ops.count("MUFU.EX2") == base_ops.count("MUFU.EX2") + 16
    assert count("LDG", ops) == count("LDG", base_ops) + 16
    for op in ("STG.E.U16", "STG.E", "LDL", "STL"):
        assert ops.count(op) == base_ops.count(op), op
    named = [a.strip() for op, a in instrs if op.startswith("BAR.SYNC") and "," in a]
    assert named == ["0x1, 0x100"] and not [a for op, a in base_instrs if op.startswith("BAR.")
                                            and "," in a]  # fmt: skip
    with pytest.raises(ValueError, match="w_from_t needs fused"):
        config.params_for("bfloat16", out16=True, forward=True, w_from_t=True)
