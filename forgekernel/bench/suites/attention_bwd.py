"""Attention backward suite: dQ, dK, dV from dO, O and LSE, FlashAttention layout.

Outputs compared: (dq, dk, dv) against the fp32 reference gradients, each with FlashAttention's
criterion (`forgekernel.bench.check`). The forward is not timed: `make_inputs` computes O and LSE
once per input set with the fp32 reference (O rounded to the input dtype, as a forward kernel
returns it), and ours, FA4 and cuDNN are timed on the backward alone. Rows that see no key
(causal, Sq > Sk) must get dq = 0 exactly as the reference does. Deterministic cases must give
the same bits on every run (`check` runs them 3 times); on three bench cases the bench also times
deterministic=True against the default kernel (a variant of ours, recorded as its time ratio),
and on the GQA 16:1 cases of GQA16_TIMED the head-group walk they ran before the head split.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Explained, Inputs, OpSuite
from forgekernel.bench.suites.attention import _case as forward_case
from forgekernel.bench.suites.attention import _varlen_lengths, refuse_other_semantics
from forgekernel.bench.suites.attention import flops as forward_flops


def kernel_sources() -> list[Path]:
    """The bwd kernel leaf's sources (what the compile cache hashes): the ledger key. Empty
    while the leaf does not exist, so the ledger gate fails until it does and was checked."""
    try:
        from forgekernel.kernels.attention.bwd.sm90 import SPECS
    except ImportError:
        return []
    return sorted({p for spec in SPECS for p in spec.sources})


def varlen_supported() -> bool:
    """The kernel leaf declares `VARLEN = True` once its launcher takes cu_seqlens."""
    try:
        from forgekernel.kernels.attention.bwd import sm90
    except ImportError:
        return False
    return bool(getattr(sm90, "VARLEN", False))


def _case(
    b: int,
    hq: int,
    hkv: int,
    sq: int,
    d: int,
    causal: bool = True,
    *,
    sk: int | None = None,
    dv: int | None = None,
    scale: float | None = None,
    deterministic: bool = False,
    group: str = "",
) -> Case:
    """The forward suite's case (same name and shape parameters), plus deterministic mode."""
    fwd = forward_case(b, hq, hkv, sq, d, causal, sk=sk, dv=dv, scale=scale)
    name = fwd.name + ("-det" if deterministic else "")
    return Case(name, {**fwd.params, "deterministic": deterministic}, group)


def _varlen_case(
    lens_q: tuple[int, ...],
    lens_k: tuple[int, ...],
    hq: int,
    hkv: int,
    d: int,
    causal: bool,
    dv: int | None = None,
    deterministic: bool = False,
    group: str = "",
) -> Case:
    """Packed sequences; b / sq / sk hold the batch and the token totals (for flops / bytes)."""
    dv = d if dv is None else dv
    name = f"varlen{len(lens_q)}-hq{hq}-hkv{hkv}-tq{sum(lens_q)}-tk{sum(lens_k)}-d{d}"
    name += (f"-dv{dv}" if dv != d else "") + ("-causal" if causal else "")
    name += "-det" if deterministic else ""
    params = {"b": len(lens_q), "hq": hq, "hkv": hkv, "sq": sum(lens_q), "sk": sum(lens_k)}
    flags = {"causal": causal, "softmax_scale": None, "deterministic": deterministic}
    varlen = {"lens_q": list(lens_q), "lens_k": list(lens_k), "varlen": True}
    return Case(name, {**params, "d": d, "dv": dv, **flags, **varlen}, group)


# The suite before issue 17 (OPS.md, "Attention backward", bf16, causal): MHA Hq=Hkv=32 and GQA
# 8:1 Hq=64, Hkv=8 at D=128; D=64 at Hq=Hkv=32 and DeepSeek 192/128 at Hq=Hkv=128 (as the
# forward suite) at (2, 8192); plus the anchor shape of the FA4 / cuDNN figures (b4 s8192 d128
# causal, MHA 16 heads and GQA 32:4: FA4 572 TFLOP/s, cuDNN 496 on the H200).
LEGACY_BENCH_CASES = (
    *(_case(b, 32, 32, s, 128, group="causal-d128") for b, s in ((8, 4096), (4, 8192), (2, 16384))),
    *(_case(b, 64, 8, s, 128, group="causal-d128") for b, s in ((8, 4096), (4, 8192), (2, 16384))),
    _case(2, 32, 32, 8192, 64, group="d64"),
    _case(2, 128, 128, 8192, 192, dv=128, group="d192-128"),
    _case(4, 16, 16, 8192, 128, group="causal-d128"),
    _case(4, 32, 4, 8192, 128, group="causal-d128"),
)
# The forward suite's classes at the head dims the backward offers (64, 128, 192/128; `supported`
# drops the others): GQA 16:1, GQA at 512..1024 tokens (Llama-3 8B 32:8, Llama-3 70B 64:8,
# Qwen-2.5 7B 28:4), non-causal short and long, D = 64 short and non-causal, DeepSeek at 2048,
# chunked prefill (causal bottom-right, Sq < Sk), bf16.
CLASS_BENCH_CASES = (
    _case(4, 64, 4, 8192, 128, group="gqa16"),
    _case(8, 32, 2, 4096, 128, group="gqa16"),
    # the 4096 case's neighbours at the same group (16:1, Hkv 2): half and twice the length
    # (issue 17, BWD_NOTES.md "GQA 16 at 4096")
    _case(16, 32, 2, 2048, 128, group="gqa16"),
    _case(4, 32, 2, 8192, 128, group="gqa16"),
    _case(32, 32, 8, 512, 128, group="gqa-short"),
    _case(16, 64, 8, 1024, 128, group="gqa-short"),
    _case(16, 28, 4, 1024, 128, group="gqa-short"),
    _case(16, 16, 16, 1024, 128, causal=False, group="non-causal"),
    _case(8, 32, 32, 4096, 128, causal=False, group="non-causal"),
    _case(2, 64, 8, 8192, 128, causal=False, group="non-causal"),
    _case(1, 32, 8, 16384, 128, causal=False, group="non-causal"),
    _case(16, 32, 8, 1024, 64, group="d64"),
    _case(8, 16, 16, 2048, 64, causal=False, group="d64"),
    _case(8, 128, 128, 2048, 192, dv=128, group="d192-128"),
    _case(1, 32, 8, 2048, 128, sk=8192, group="chunked"),
    _case(2, 64, 8, 1024, 128, sk=16384, group="chunked"),
)
BENCH_CASES = LEGACY_BENCH_CASES + CLASS_BENCH_CASES
# 16 packed sequences of 256..4096 tokens (fixed draw), GQA 32:8, causal.
_VARLEN_LENS = _varlen_lengths(16, 256, 4096, seed=4)
VARLEN_BENCH_CASES = (_varlen_case(_VARLEN_LENS, _VARLEN_LENS, 32, 8, 128, True, group="varlen"),)
# deterministic=True timed against the default kernel on these (the cases the retired
# scripts/bwd_gpu_check.py timed); H200 2026-12-01 bench: 1.34x the time at MHA hq16, 1.73x at
# GQA 32:4, 1.06x at 192/128 (the script had 1.33x / 1.50x / 1.04x: eager launches on one
# input set, each side timed alone).
DETERMINISTIC_TIMED = (
    _case(4, 16, 16, 8192, 128),
    _case(4, 32, 4, 8192, 128),
    _case(2, 128, 128, 8192, 192, dv=128),
)
# Every head-dim pair, GQA ratios 1, 4, 8, causal and not, then awkward lengths: one token,
# lengths off every tile size, Sq < Sk and Sq > Sk (whose first Sq - Sk causal rows see no key:
# dq = 0 there), a scale, and deterministic mode (bitwise-repeatable: D = 64, 128 and 192/128,
# GQA); then the shapes the retired scripts/bwd_gpu_check.py checked besides (one exact tile,
# 17 tokens with GQA, and D = 192/128 at every awkward length: its 64-key blocks).
CHECK_CASES = (
    _case(2, 16, 2, 512, 128),
    _case(2, 16, 2, 512, 128, causal=False),
    _case(2, 8, 8, 512, 64),
    _case(1, 8, 8, 512, 192, dv=128),
    _case(1, 8, 2, 512, 192, dv=128, causal=False),
    _case(1, 32, 4, 1024, 128),
    _case(2, 4, 1, 1, 128),
    _case(2, 4, 4, 1, 64, causal=False),
    _case(3, 4, 4, 17, 64),
    _case(1, 16, 2, 17, 128, causal=False),
    _case(1, 8, 2, 1000, 128),
    _case(2, 4, 4, 1000, 64, causal=False),
    _case(1, 4, 1, 4097, 128),
    _case(1, 2, 2, 4097, 64, causal=False),
    _case(2, 4, 1, 100, 128, sk=1000),
    _case(1, 4, 1, 100, 128, sk=1000, causal=False),
    _case(2, 4, 4, 1000, 64, sk=100),
    _case(1, 4, 4, 1000, 64, sk=100, causal=False),
    _case(2, 8, 1, 1, 128, sk=1000),
    _case(1, 4, 1, 1000, 192, dv=128, sk=1003),
    _case(1, 8, 2, 1000, 128, scale=0.3),
    _case(1, 8, 2, 1000, 128, deterministic=True),
    _case(1, 8, 8, 777, 64, causal=False, deterministic=True),
    _case(2, 8, 2, 1000, 128, deterministic=True),
    _case(1, 4, 4, 4097, 64, deterministic=True),
    _case(1, 8, 2, 1000, 192, dv=128, deterministic=True),
    _case(2, 4, 4, 128, 128),
    _case(2, 4, 4, 128, 128, causal=False),
    _case(2, 4, 1, 17, 64),
    _case(2, 4, 1, 17, 64, causal=False),
    _case(1, 2, 1, 1, 128, sk=17),
    _case(1, 4, 4, 1000, 128, sk=100),
    _case(1, 8, 8, 300, 192, dv=128, sk=700, causal=False),
    _case(2, 16, 2, 512, 192, dv=128),
    _case(1, 16, 4, 1000, 192, dv=128, causal=False),
    _case(2, 4, 1, 17, 192, dv=128),
    _case(1, 4, 4, 100, 192, dv=128, sk=1000),
    _case(1, 4, 2, 1000, 192, dv=128, sk=100),
    _case(1, 4, 2, 1000, 192, dv=128, sk=100, causal=False),
    _case(1, 2, 1, 1, 192, dv=128, sk=65),
    _case(1, 2, 2, 4097, 192, dv=128),
    # one small case per bench class, with what the class adds: GQA 16:1, GQA 7:1 short,
    # non-causal GQA 5:1 past 1024, GQA at D = 64, a chunk against a longer cached prefix
    _case(2, 8, 8, 700, 128, group="causal-d128"),
    _case(1, 16, 1, 300, 128, group="gqa16"),
    _case(4, 28, 4, 200, 128, group="gqa-short"),
    _case(1, 40, 8, 1100, 128, causal=False, group="non-causal"),
    _case(4, 16, 4, 300, 64, causal=False, group="d64"),
    _case(1, 16, 16, 256, 192, dv=128, sk=2048, group="d192-128"),
    _case(1, 8, 2, 512, 128, sk=4096, group="chunked"),
)
# Empty sequences on either side, a sequence with keys but no queries and the reverse, and
# deterministic mode at D = 128 and 192/128.
VARLEN_CHECK_CASES = (
    _varlen_case((1, 17, 1000, 300), (1, 17, 1000, 300), 8, 2, 128, True),
    _varlen_case((100, 0, 513), (200, 7, 513), 4, 4, 64, False),
    _varlen_case((1, 17, 1000, 300), (1, 17, 1003, 300), 8, 2, 192, True, dv=128),
    _varlen_case((100, 0, 513, 64), (200, 7, 513, 0), 4, 4, 64, False),
    _varlen_case((255, 0, 1), (1, 9, 130), 2, 2, 64, True),
    _varlen_case((129, 700, 5), (300, 65, 5), 4, 1, 128, True, deterministic=True),
    _varlen_case((100, 0, 513, 64), (200, 7, 513, 0), 4, 4, 192, False, dv=128),
    _varlen_case((129, 700, 5), (300, 65, 5), 4, 1, 192, True, dv=128, deterministic=True),
    _varlen_case((128, 300, 64), (1024, 2048, 700), 8, 2, 128, True, group="varlen"),
)
# compute-sanitizer (`forgekernel check --sanitize`) and tests/gpu/: every kernel variant the
# launcher picks at small odd sizes: D = 64, 128 (MHA; GQA with head_split) and 192/128,
# causal and not, Sq != Sk, deterministic at each head dim, varlen (its own configs at 128 and
# 192/128, deterministic at 128).
SANITIZE_CASES = (
    _case(1, 4, 1, 17, 128),
    _case(1, 2, 2, 257, 128, causal=False, sk=300),
    _case(1, 2, 2, 1000, 64, causal=False),
    _case(1, 4, 2, 300, 192, dv=128, sk=333),
    _case(1, 4, 1, 1000, 128, deterministic=True),
    _case(1, 2, 2, 257, 64, deterministic=True),
    _case(1, 4, 4, 300, 192, dv=128, causal=False, deterministic=True),
)
SANITIZE_VARLEN_CASES = (
    _varlen_case((1, 17, 300), (1, 17, 303), 4, 2, 128, True),
    _varlen_case((129, 0, 5), (65, 7, 5), 2, 2, 128, False, deterministic=True),
    _varlen_case((200, 17, 33), (200, 17, 40), 4, 1, 192, True, dv=128),
)
# Sanitizer findings shown to be tool artifacts, Explained(tool, case, count, why): the ledger
# records `why` beside the count, and the case passes at exactly that count. One goes here only
# with the barrier that orders the accesses the tool flags.
SANITIZE_EXPLAINED: tuple[Explained, ...] = (
    Explained(
        "racecheck",
        "*",
        None,
        "WAR on the LSE / Dsum ring (sLSE, sDsum), a tool artifact: the consumers read a stage "
        "with generic loads (mma_step._col_stats) before the step's bar.sync CONSUMERS (named "
        "barrier 1, all 256 consumer threads); after it one lane per warp arrives on the "
        "stage's empty mbarrier (q_pipe / do_pipe consumer_release, release semantics), and the "
        "producer waits on that mbarrier (producer_acquire) before it issues the next "
        "cp.async.bulk into the stage. racecheck takes the bulk copy for a write by the "
        "producer thread and does not see the mbarrier arrive / wait between it and the "
        "readers. Baseline (main before the toolkit, JIT with line info, H200 2026-12-01): every "
        "flagged read is in _col_stats, every flagged write is by thread 0 (the producer) with "
        "an unknown incoming value (an async copy).",
        ("WAR",),
    ),
)


# bench's host microseconds per eager call: the forward suite's host shape (32:8, 128 tokens).
HOST_CASE = _case(1, 32, 8, 128, 128, group="host")


def supported(cases: tuple[Case, ...]) -> tuple[Case, ...]:
    """The cases whose head dims the kernel leaf offers (its HEAD_DIMS): a pair it adds enters
    the check and the bench by itself."""
    from forgekernel.ops.attention_bwd import BWD_HEAD_DIMS

    return tuple(c for c in cases if (c.params["d"], c.params["dv"]) in BWD_HEAD_DIMS)


def check_cases() -> tuple[Case, ...]:
    return supported(CHECK_CASES + (VARLEN_CHECK_CASES if varlen_supported() else ()))


def bench_cases() -> tuple[Case, ...]:
    return supported(BENCH_CASES + (VARLEN_BENCH_CASES if varlen_supported() else ()))


def sanitize_cases() -> tuple[Case, ...]:
    return supported(SANITIZE_CASES + (SANITIZE_VARLEN_CASES if varlen_supported() else ()))


def deterministic(case: Case) -> bool:
    return bool(case.params["deterministic"])


# GQA 16:1 (issue 17): the head split became the rule up to 4096 keys (config.HEAD_SPLIT_GROUP,
# measured 2026-12-03 21:50: split 0.887 / 0.934 / 0.990 of the walk's time at s4096 / s2048 /
# s8192; walk_order 2 + swizzle 8 1.013-1.071 and swizzle 16 1.043-1.080, dropped; BWD_NOTES.md
# "GQA 16 at 4096"). `walk`: the main kernel under the D = 128 default (the head-group walk
# the three cases ran before), pre / post kernels and workspaces as the launcher makes them.
GQA16_CANDIDATES: dict[str, dict[str, int]] = {"walk": {}}
GQA16_TIMED = (
    _case(8, 32, 2, 4096, 128),
    _case(16, 32, 2, 2048, 128),
    _case(4, 32, 2, 8192, 128),
)


# The launch order's L2 reuse (scripts/attn_bwd_l2_model.py; BWD_NOTES.md "The launch order
# against the forward's L2 finding", CPU 2026-12-05): chunked causal GQA takes LONG_GQA_SWIZZLE
# 8 from its 16384 keys, but a section of 8 (kv head, batch) pairs holds 8 pairs x 8 heads x
# 1024 query rows of Q, dO and the dQ accumulator (67 MB, past L2): 7.3 GB from HBM in the model
# against 0.71 (compulsory) with sections of two pairs. `sw2_walk2`: the same walk in sections of
# two; `sw2`: the ascending walk (the D = 128 default's) in sections of two.
CHUNKED_CANDIDATES: dict[str, dict[str, int]] = {
    "sw2_walk2": {"l2_swizzle": 2, "walk_order": 2},
    "sw2": {"l2_swizzle": 2},
}
CHUNKED_TIMED = (_case(2, 64, 8, 1024, 128, sk=16384),)


def variants(case: Case) -> dict[str, Any]:
    """deterministic=True beside the default kernel on DETERMINISTIC_TIMED; the GQA16_CANDIDATES
    configurations on GQA16_TIMED, the CHUNKED_CANDIDATES ones on CHUNKED_TIMED."""
    out: dict[str, Any] = {}
    if case.name in {c.name for c in DETERMINISTIC_TIMED}:
        out["deterministic"] = run_deterministic
    for timed, candidates in ((GQA16_TIMED, GQA16_CANDIDATES),
                              (CHUNKED_TIMED, CHUNKED_CANDIDATES)):  # fmt: skip
        if case.name in {c.name for c in timed}:
            for name, knobs in candidates.items():
                out[name] = functools.partial(run_config, knobs)
    return out


def _offsets(lens: list[int], device: torch.device) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32).to(device)


def make_inputs(
    case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> Inputs:
    from forgekernel.bench.check import true_fp32
    from forgekernel.reference.attention import attention_ref, attention_varlen_ref

    p = case.params
    varlen = "lens_q" in p
    lead = () if varlen else (p["b"],)

    def randn(s: int, h: int, d: int) -> torch.Tensor:
        return torch.randn(*lead, s, h, d, dtype=dtype, device=device, generator=gen)

    inputs: Inputs = {
        "q": randn(p["sq"], p["hq"], p["d"]),
        "k": randn(p["sk"], p["hkv"], p["d"]),
        "v": randn(p["sk"], p["hkv"], p["dv"]),
        "do": randn(p["sq"], p["hq"], p["dv"]),
        "causal": p["causal"],
        "softmax_scale": p["softmax_scale"],
        "deterministic": p["deterministic"],
    }
    qkv, flags = (inputs["q"], inputs["k"], inputs["v"]), (p["causal"], p["softmax_scale"])
    with true_fp32():
        if varlen:
            seqs = (_offsets(p["lens_q"], device), _offsets(p["lens_k"], device))
            inputs["varlen"] = (*seqs, max(p["lens_q"]), max(p["lens_k"]))
            o, lse = attention_varlen_ref(*qkv, *seqs, *flags)
        else:
            o, lse = attention_ref(*qkv, *flags)
    inputs["o"], inputs["lse"] = o.to(dtype), lse
    return inputs


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return tuple(torch.empty_like(inputs[n]) for n in ("q", "k", "v"))


def _tensors(inputs: Inputs) -> tuple:
    return tuple(inputs[n] for n in ("q", "k", "v", "o", "lse", "do"))


def run_ours(inputs: Inputs, out: tuple | None) -> tuple:
    from forgekernel.ops.attention_bwd import attention_backward, attention_varlen_backward

    flags = {"deterministic": inputs["deterministic"], "out": out}
    if "varlen" in inputs:
        return attention_varlen_backward(
            *_tensors(inputs), *inputs["varlen"], inputs["causal"], inputs["softmax_scale"], **flags
        )
    return attention_backward(*_tensors(inputs), inputs["causal"], inputs["softmax_scale"], **flags)


def run_deterministic(inputs: Inputs, out: tuple | None) -> tuple:
    return run_ours({**inputs, "deterministic": True}, out)


def run_config(knobs: dict[str, int], inputs: Inputs, out: tuple | None) -> tuple:
    """Ours (fixed length, not deterministic) with the main kernel's config the D = 128 default
    with `knobs` replaced, through the leaf's launcher (`config=`), in place of choose_config's."""
    from forgekernel.kernels.attention.bwd.sm90.config import default_config
    from forgekernel.kernels.attention.bwd.sm90.launch import attention_bwd

    q, k, v, o, lse, do = _tensors(inputs)
    out = tuple(out) if out is not None else alloc_out(inputs)
    scale = inputs["softmax_scale"]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    cfg = dataclasses.replace(default_config(q.shape[-1], v.shape[-1]), **knobs)
    attention_bwd(q, k, v, o, lse, do, *out, scale, inputs["causal"], False, config=cfg)
    return out


def _reference(inputs: Inputs, upcast: bool) -> tuple:
    from forgekernel.reference.attention import attention_bwd_ref, attention_varlen_bwd_ref

    q, k, v, do = (inputs[n] for n in ("q", "k", "v", "do"))
    flags = (inputs["causal"], inputs["softmax_scale"], upcast)
    if "varlen" in inputs:
        return attention_varlen_bwd_ref(q, k, v, do, *inputs["varlen"][:2], *flags)
    return attention_bwd_ref(q, k, v, do, *flags)


def reference(inputs: Inputs) -> tuple:
    return _reference(inputs, upcast=True)


def low_precision(inputs: Inputs) -> tuple:
    return _reference(inputs, upcast=False)


def _fa4() -> Any:
    try:
        from flash_attn.cute.interface import _flash_attn_bwd
    except Exception:
        return None

    takes = inspect.signature(_flash_attn_bwd).parameters

    def fa4(inputs: Inputs) -> Any:
        # FA4's LSE is ours: (B, H, Sq) fp32, natural log ((H, total) packed); it recomputes P
        # from it. Packed batches: the keywords its signature has (a missing one raises).
        q, k, v, o, lse, do = _tensors(inputs)
        flags = {"softmax_scale": inputs["softmax_scale"], "causal": inputs["causal"]}
        if "varlen" in inputs:
            names = ("cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
            packed = dict(zip(names, inputs["varlen"]))
            if not {"cu_seqlens_q", "cu_seqlens_k"} <= set(takes):
                raise NotImplementedError("this FA4 backward takes no cu_seqlens")
            flags |= {n: x for n, x in packed.items() if n in takes}
        return _flash_attn_bwd(q, k, v, o, do, lse, **flags)

    return fa4


def _cudnn_forward(inputs: Inputs) -> tuple:
    """cuDNN's own O and statistics (its backward reads its own LSE layout), on (B, H, S, D)
    views, and dO laid out as cuDNN's O; once per input set, before any timing."""
    q, k, v = (inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
    fwd = torch.ops.aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, inputs["causal"], False, scale=inputs["softmax_scale"]
    )
    o, lse, cum_q, cum_k, max_q, max_k, seed, offset = fwd[:8]
    do = torch.empty_strided(o.shape, o.stride(), dtype=o.dtype, device=o.device)
    do.copy_(inputs["do"].transpose(1, 2))
    return (do, q, k, v, o, lse, seed, offset, None, cum_q, cum_k, max_q, max_k)


def _cudnn() -> Any:
    if not torch.backends.cudnn.is_available():
        return None
    backward = torch.ops.aten._scaled_dot_product_cudnn_attention_backward

    def cudnn(inputs: Inputs) -> Any:
        refuse_other_semantics(inputs)  # packed batches; causal Sq != Sk (top-left mask)
        # The harness calls every comparator once per input set before timing, so the cached
        # forward is never inside a timed region.
        if "cudnn_fwd" not in inputs:
            inputs["cudnn_fwd"] = _cudnn_forward(inputs)
        args = inputs["cudnn_fwd"]
        return backward(*args, 0.0, inputs["causal"], scale=inputs["softmax_scale"])

    return cudnn


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fa4": None, "cudnn": None}
    return {"fa4": _fa4(), "cudnn": _cudnn()}


def flops(case: Case) -> float:
    """2.5x the forward's count: five matmuls (S, dP, dV, dQ, dK) against its two, masked
    pairs free (FA4's count); varlen cases count each sequence's own pairs."""
    return 2.5 * forward_flops(case)


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q, k, v, o, dO and lse read; dq, dk, dv written."""
    p = case.params
    elem = torch.empty((), dtype=dtype).element_size()
    rows = 1 if "lens_q" in p else p["b"]
    q_side = p["sq"] * p["hq"] * (2 * p["d"] + 2 * p["dv"])  # q, dq, o, dO
    kv_side = p["sk"] * p["hkv"] * 2 * (p["d"] + p["dv"])  # k, v, dk, dv
    return float(rows * ((q_side + kv_side) * elem + 4 * p["hq"] * p["sq"]))


def suite() -> OpSuite:
    return OpSuite(
        name="attention_bwd",
        kernel_sources=kernel_sources(),  # the ledger hashes what the compile cache hashes
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=check_cases(),
        bench_cases=bench_cases(),
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=low_precision,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        atol=1e-3,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=sanitize_cases(),
        sanitize_explained=SANITIZE_EXPLAINED,
        repeatable=deterministic,
        variants=variants,
        host_case=HOST_CASE,
    )
