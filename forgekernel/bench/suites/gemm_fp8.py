"""Block-scaled FP8 GEMM suite (DeepSeek-V3's recipe): C = (A x sa) @ (B x sb)^T, A (M, K) and
B (N, K) float8_e4m3fn, sa (M, K/128) per 1x128 group, sb (ceil(N/128), K/128) per 128x128
block. The suite's dtypes are the output's (bf16, fp16); the inputs are FP8 quantized from
fresh random fp32 values, each group / block scaled to use the e4m3 range (amax -> 448).
Comparators: cuBLASLt's block-scaled `torch._scaled_mm`, with A's scales column-major (the
layout DeepGEMM and cuBLASLt document) and row-major (which picks another cuBLASLt path);
DeepGEMM's `fp8_gemm_nt` where `deep_gemm` is installed."""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite, with_dispatch
from forgekernel.kernels.gemm.dense.sm90.config import NUM_SMS_H100_H200
from forgekernel.kernels.gemm.dense.sm90.tile import GemmConfig, straddles
from forgekernel.kernels.gemm.fp8.sm90 import SPEC
from forgekernel.kernels.gemm.fp8.sm90.config import (
    NARROW_WIDTHS,
    choose_config,
    narrow,
    one_warp_scales,
    wide_config,
)
from forgekernel.runtime import pdl

E4M3_MAX = 448.0


def _case(m: int, n: int, k: int, *, group: str = "", source: str = "") -> Case:
    params = {"m": m, "n": n, "k": k, **({"source": source} if source else {})}
    return Case(f"{m}x{n}x{k}", params, group)


# DeepSeek-V3 (q_a 7168 -> 1536, kv_a -> 576, q_b 1536 -> 24576, o 16384 -> 7168, FFN 7168 <->
# 18432, MoE-sized 7168 <-> 2048 / 4096) and Qwen3-32B (qkv, gate_up, down) projections at
# M = 1 to 16384, and 8192^3. The shapes of the H200 comparator anchors are among them.
BENCH_CASES = (
    _case(1, 7168, 16384, group="decode", source="deepseek-v3.o"),
    _case(16, 7168, 2048, group="decode", source="deepseek-v3.moe_down"),
    _case(64, 4096, 7168, group="decode", source="deepseek-v3.moe_gate_up"),
    _case(16, 24576, 1536, group="decode", source="deepseek-v3.q_b"),
    _case(64, 36864, 7168, group="decode", source="deepseek-v3.gate_up"),
    _case(1, 10240, 5120, group="decode", source="qwen3-32b.qkv"),
    _case(128, 7168, 16384, group="mid", source="deepseek-v3.o"),
    _case(128, 1536, 7168, group="mid", source="deepseek-v3.q_a"),
    _case(512, 51200, 5120, group="mid", source="qwen3-32b.gate_up"),
    _case(512, 576, 7168, group="mid", source="deepseek-v3.kv_a"),
    _case(4096, 7168, 2048, group="prefill", source="deepseek-v3.moe_down"),
    _case(4096, 36864, 7168, group="prefill", source="deepseek-v3.gate_up"),
    _case(16384, 7168, 18432, group="prefill", source="deepseek-v3.down"),
    _case(16384, 5120, 25600, group="prefill", source="qwen3-32b.down"),
    _case(8192, 8192, 8192, group="square"),
)
# Awkward edges: M = 1, M off every tile, N off 128 (a partial scale block) and off 8 (the
# padded output path), the shortest K, long K (the promotion every 128 of K matters there).
CHECK_CASES = (
    _case(1, 128, 128),
    _case(7, 136, 256),
    _case(16, 4096, 4096),
    _case(33, 1001, 512),
    _case(100, 1000, 1024),
    _case(129, 264, 7168),
    _case(200, 7168, 128),
    _case(300, 2048, 16384),
    _case(1, 576, 7168),
    _case(1000, 3000, 4096),
    # ragged M with N 136 past a multiple of 256 (a partial scale block in the last tile),
    # odd k-tiles; N 92 past and off 8 (cases kept from the 128x256 tile, measured and dropped)
    _case(2000, 5000, 640),
    _case(1500, 4700, 1024),
    # the 128-column tiles where M <= 512 fills every SM (decode a16 and mid past the narrow
    # class's edge; N off 8) and stream K above M = 512
    _case(16, 16900, 384),
    _case(100, 8448, 1024),
    _case(513, 576, 7168),
    # M >= 8192: the A-multicast tile walked in bands of 8 cluster columns (2026-12-07): 65 tile
    # rows (the last of 8 rows), 23 n-tiles in 12 cluster columns (a band of 8, a last of 4, the
    # last cluster's second CTA past N)
    _case(8200, 2824, 384),
)
# compute-sanitizer: every kind of configuration the chooser takes: the narrow full-K tiles
# (M <= 512 where the 128-column tiles leave SMs idle and the pick is one round of at least 66
# CTAs: 64x32 with A's 8 / 16 / 32-row box and the whole 64, 64x48 and 64x96 over two blocks of
# B's scales), and the 128-column ones where their tiles fill the SMs, leave narrow too few or
# too many tiles, or M > 512 (decode a8 / a16 / a32 over 1x2, skinny, mid, large; stream K with
# 64x128 a8 and 128x128 tiles), and CTAs that refill their ring's stages (racecheck sees a
# stage's release only there: 600x256x3072 stream K without a cluster, 8 k-tiles a CTA on 5 stages;
# 1100x1024x1280 LARGE over 2x1, 10 on 6; 8x16896x2048 decode a8 over 1x2, 16 on 11;
# 8x9216x4096 narrow 64x96 a8, 32 k-tiles a CTA; 300x1000x4096 narrow 64x48 with the scale warp
# four ahead (the 64-row box's standard), 32 k-tiles a CTA: its 33-arrival full barrier over a
# refilled ring; 40x4104x256 and 300x1000x640 the same tiles with fewer k-tiles than the lead;
# the tiled 128-row tiles' scale warp (2026-12-07): 1100x1024x1280 LARGE's two ahead, 8200x256x1280
# LARGE_MCAST_A's four ahead, 10 k-tiles a CTA on 6 stages, 130 CTAs in bands).
SANITIZE_CASES = (
    _case(1, 256, 256),
    _case(12, 264, 384),
    _case(20, 1000, 256),
    _case(40, 136, 512),
    _case(100, 520, 384),
    _case(300, 1000, 640),
    _case(3, 256, 4096),
    _case(150, 256, 3072),
    _case(1100, 2200, 256),
    _case(1100, 1024, 1280),
    _case(8, 9216, 4096),
    _case(8, 16896, 2048),
    _case(40, 16896, 512),
    _case(100, 8448, 256),
    _case(600, 256, 3072),
    _case(1, 3001, 256),
    _case(12, 4000, 384),
    _case(20, 3072, 512),
    _case(40, 4104, 256),
    _case(300, 1000, 4096),
    _case(8200, 256, 1280),
)


def _quantize(x: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x (R, K) fp32 -> (FP8, fp32 scales (ceil(R/rows), K/128)): each rows x 128 block scaled
    so that its largest magnitude maps to 448."""
    r, k = x.shape
    rp = -(-r // rows) * rows
    xp = torch.zeros(rp, k, dtype=x.dtype, device=x.device)
    xp[:r] = x
    blocks = xp.view(rp // rows, rows, k // 128, 128)
    amax = blocks.abs().amax(dim=(1, 3)).clamp_min(1e-4)
    scale = amax / E4M3_MAX
    q = (blocks / scale[:, None, :, None]).view(rp, k)[:r].to(torch.float8_e4m3fn)
    return q, scale.float()


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    a32 = torch.randn(p["m"], p["k"], device=device, generator=gen)
    b32 = torch.randn(p["n"], p["k"], device=device, generator=gen)
    a, sa = _quantize(a32, 1)
    b, sb = _quantize(b32, 128)
    return {"a": a, "b": b, "sa": sa, "sb": sb, "out_dtype": dtype}


def alloc_out(inputs: Inputs) -> torch.Tensor:
    a, b = inputs["a"], inputs["b"]
    return torch.empty(a.shape[0], b.shape[0], dtype=inputs["out_dtype"], device=a.device)


def run_ours(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    from forgekernel.ops.gemm_fp8 import gemm_fp8

    return gemm_fp8(
        inputs["a"], inputs["b"], inputs["sa"], inputs["sb"], out_dtype=inputs["out_dtype"],
        out=out,
    )  # fmt: skip


# The short calls timed without programmatic dependent launch too (variant `no_pdl`, as the
# dense GEMM's: docs/gemm/NOTES.md "Programmatic dependent launch").
NO_PDL_CASES = ("1x7168x16384", "16x7168x2048", "64x4096x7168", "1x10240x5120")


# The six mid / decode cases narrow was measured on (H100, 2026-12-05 14:41; docs/gemm/NOTES.md
# "Narrow adopted"): five are ours' narrow tile now (config.py `takes_narrow`: narrow grids of
# one round of 96-128 CTAs); 64x36864x7168 (288 tiles of 64x128: every SM busy) keeps the
# 128-column plan and times `narrow` beside it. Where the rule moved the plan, `was` times the
# plan before it (`config.wide_config`: the 128-column tiles or stream K) beside ours: the one
# bench call shows new against old. `narrow_even`: the best width dividing 128 where the pick
# straddles two blocks of B's scales (the straddling selection's cost). `one_warp_scales`: where
# ours' tile loads its scales by a warp of their own (config.py NARROW_SCALE_AHEAD), the same
# tile with the TMA warp loading them one k-tile ahead (the standard before; a candidate build,
# `forgekernel build --candidates`). Every other variant's kernel is a standard build; each
# plans as ours does (the device's SMs, N rounded up to 8).
EVEN_WIDTHS = tuple(w for w in NARROW_WIDTHS if not straddles(w))
NARROW_CASES = (
    "512x576x7168", "128x1536x7168", "16x7168x2048", "64x4096x7168", "1x10240x5120",
    "64x36864x7168",
)  # fmt: skip


def _num_sms(device_index: int | None) -> int:
    """The SMs ours plans for (the launcher's `num_sms`; the current GPU's for None), 132 (H100
    SXM, H200) without a GPU."""
    from forgekernel.kernels.gemm.fp8.sm90 import launch

    if device_index is None and not torch.cuda.is_available():
        return NUM_SMS_H100_H200
    return launch.num_sms(device_index)


@functools.cache
def _forced_config(variant: str, m: int, n8: int, k: int, device_index: int | None) -> GemmConfig:
    """The config a variant forces on (M, N rounded up to 8, K) on the device, as ours plans
    (once per shape: the timed calls look it up)."""
    sms = _num_sms(device_index)
    if variant == "was":
        return wide_config(m, n8, k, sms)
    if variant == "narrow_even":
        return narrow(m, n8, k, EVEN_WIDTHS, sms)
    if variant == "one_warp_scales":
        return one_warp_scales(choose_config(m, n8, k, sms))
    return narrow(m, n8, k, NARROW_WIDTHS, sms)


def variants(case: Case) -> dict[str, Any]:
    found: dict[str, Any] = {}
    if case.name in NO_PDL_CASES:
        found["no_pdl"] = run_no_pdl
    m, n, k = (case.params[x] for x in "mnk")
    n8, sms = -(-n // 8) * 8, _num_sms(None)
    ours, was = choose_config(m, n8, k, sms), _forced_config("was", m, n8, k, None)
    if ours != was:
        found["was"] = run_was
    pick = _forced_config("narrow", m, n8, k, None)
    if case.name in NARROW_CASES and pick != ours:
        found["narrow"] = run_narrow
    if (case.name in NARROW_CASES or pick == ours) and straddles(pick.tile_n):
        # the straddling pick's cost against the best width that never straddles
        found["narrow_even"] = run_narrow_even
    if ours.scale_warp:
        found["one_warp_scales"] = run_one_warp_scales
    return found


def _run_forced(variant: str, inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with the variant's config (`_forced_config`) forced through the leaf's launcher (its
    PDL form the grid's, as ours; N off 8 through its scratch, as ours)."""
    from forgekernel.kernels.gemm.fp8.sm90.launch import gemm_fp8

    a, b = inputs["a"], inputs["b"]
    m, k = a.shape
    cfg = _forced_config(variant, m, -(-b.shape[0] // 8) * 8, k, a.device.index)
    out = alloc_out(inputs) if out is None else out
    gemm_fp8(a, b, inputs["sa"], inputs["sb"], out, config=cfg)
    return out


def run_was(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """The chooser's plan before narrow (`config.wide_config`)."""
    return _run_forced("was", inputs, out)


def run_no_pdl(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with its kernel built and launched without PDL (compiled on first use)."""
    with pdl.off():
        return run_ours(inputs, out)


def run_narrow(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours with the model's narrow full-K tile (`config.narrow`) forced."""
    return _run_forced("narrow", inputs, out)


def run_narrow_even(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """`run_narrow` of the widths dividing 128 (one block of B's scales a tile)."""
    return _run_forced("narrow_even", inputs, out)


def run_one_warp_scales(inputs: Inputs, out: torch.Tensor | None) -> torch.Tensor:
    """Ours' tile with the scales loaded by the TMA warp one k-tile ahead (`one_warp_scales`)."""
    return _run_forced("one_warp_scales", inputs, out)


def reference(inputs: Inputs) -> torch.Tensor:
    from forgekernel.reference.gemm import gemm_fp8_ref

    return gemm_fp8_ref(inputs["a"], inputs["b"], inputs["sa"], inputs["sb"])


def _scaled_mm_call(inputs: Inputs):
    """cuBLASLt's block-scaled GEMM through `torch.nn.functional.scaled_mm` (BlockWise1x128 x
    BlockWise128x128), prepared once per input set outside any timing: cuBLASLt wants M and
    the scales' K-block count padded to multiples of 4 (zero rows of A, zero scale columns;
    the result's first M rows are the answer), B column-major (b.t()) and B's scales as the
    (K/128, N/128) view sb.t(), A's scales M-major (torch 2.11 rejects them K-major). None
    where this torch lacks it or it does not reproduce the reference."""
    key = "scaled_mm"
    if key in inputs:
        return inputs[key]
    inputs[key] = None
    F = torch.nn.functional
    if not (hasattr(F, "scaled_mm") and hasattr(F, "ScalingType")):
        return None
    a, b, sa, sb = inputs["a"], inputs["b"], inputs["sa"], inputs["sb"]
    m, kb = sa.shape
    mp, kbp = -(-m // 4) * 4, -(-kb // 4) * 4
    ap = a if mp == m else torch.cat([a, torch.zeros(mp - m, a.shape[1], device=a.device)
                                      .to(a.dtype)])  # fmt: skip
    sap = F.pad(sa, (0, kbp - kb, 0, mp - m), value=1.0)
    sa_arg = sap.t().contiguous().t()
    sb_arg = F.pad(sb, (0, kbp - kb), value=1.0).t()
    recipes = (F.ScalingType.BlockWise1x128, F.ScalingType.BlockWise128x128)

    def call() -> torch.Tensor:
        out = F.scaled_mm(
            ap, b.t(), sa_arg, recipes[0], sb_arg, recipes[1], output_dtype=inputs["out_dtype"]
        )
        return out[:m]

    try:
        c = call()
    except Exception:  # noqa: BLE001 (not a problem this cuBLASLt takes)
        return None
    ref = reference(inputs)
    if (
        c.shape == ref.shape
        and float((c.float() - ref).abs().max()) <= 0.02 * float(ref.abs().max()) + 1e-3
    ):
        inputs[key] = call
    return inputs[key]


def low_precision(inputs: Inputs) -> torch.Tensor:
    """cuBLASLt's block-scaled GEMM where it takes the problem (it promotes too); else the
    operands dequantized to the output dtype and multiplied there."""
    call = _scaled_mm_call(inputs) if torch.cuda.is_available() else None
    if call is not None:
        return call()
    d = inputs["out_dtype"]
    a, b, sa, sb = inputs["a"], inputs["b"], inputs["sa"], inputs["sb"]
    ad = (a.float() * sa.repeat_interleave(128, 1)).to(d)
    n = b.shape[0]
    bd = (b.float() * sb.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)).to(d)
    return ad @ bd.t()


def _cublaslt(inputs: Inputs) -> torch.Tensor:
    call = _scaled_mm_call(inputs)
    if call is None:
        raise RuntimeError("torch's scaled_mm does not take this block-scaled problem")
    return call()


def _deepgemm():
    try:
        import deep_gemm
    except ImportError:
        return None

    def run(inputs: Inputs) -> torch.Tensor:
        if "deepgemm" not in inputs:
            sa = inputs["sa"]
            align = getattr(deep_gemm, "get_mn_major_tma_aligned_tensor", None)
            inputs["deepgemm"] = (align(sa) if align else sa, alloc_out(inputs))
        sa, d = inputs["deepgemm"]
        deep_gemm.fp8_gemm_nt((inputs["a"], sa), (inputs["b"], inputs["sb"]), d)
        return d

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cublaslt": None, "deepgemm": None}
    return {"cublaslt": _cublaslt, "deepgemm": _deepgemm()}


def flops(case: Case) -> float:
    p = case.params
    return 2.0 * p["m"] * p["n"] * p["k"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """FP8 operands, their scales and the 16-bit output."""
    p = case.params
    m, n, k = p["m"], p["n"], p["k"]
    scales = 4 * (m * k // 128 + -(-n // 128) * (k // 128))
    return float(m * k + n * k + scales + 2 * m * n)


def kernel_sources() -> list[Path]:
    """What the compile cache hashes (the kernel's import closure) and the chooser beside it: the
    configuration table that picks a call's tile, its launcher and the op (a chooser change moves
    the ledger's key, as a kernel change does; before 2026-12-07 it did not, so a chooser change
    kept the FP8 ledger's figures)."""
    leaf = "forgekernel.kernels.gemm.fp8.sm90"
    ops = "forgekernel.ops"
    return with_dispatch(SPEC.sources, f"{leaf}.config", f"{leaf}.launch", f"{ops}.gemm_fp8")


def suite() -> OpSuite:
    return OpSuite(
        name="gemm_fp8",
        kernel_sources=kernel_sources(),
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=low_precision,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        atol=1e-2,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )


# DeepSeek-V3's routed experts (hidden 7168, moe_intermediate 2048): (N, K) of the fused gate
# and up projection and of the down projection, the MoE GEMM suites' shapes.
DSV3_MOE = {"up": (4096, 7168), "down": (7168, 2048)}


def deepgemm_scales(deep_gemm, sa: torch.Tensor) -> torch.Tensor:
    """A's scales as DeepGEMM's grouped GEMMs take them: MN-major and TMA-aligned where the
    installed version has the helper (sgl-deep-gemm 0.1.4), else as they are."""
    align = getattr(deep_gemm, "get_mn_major_tma_aligned_tensor", None)
    return align(sa) if align else sa
