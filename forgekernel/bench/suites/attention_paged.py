"""Paged GQA decode suite (issue 18): one query token per sequence against a paged KV cache
(vLLM / FlashAttention layout), outputs (o, lse natural log). Registered in
bench/suites/__init__.py once `pytest -m gpu tests/gpu/test_paged_gpu.py` passes.

Memory-bound: GB/s counts the K and V rows read (2 x tokens x Hkv x D x bytes per element: the
query dtype's for a 16-bit cache, 1 for an FP8 one). Comparator: FlashInfer's
BatchDecodeWithPagedKVCacheWrapper (fa2 backend, tensor cores: 4.1 TB/s at B64 L4096 on the
H200), planned once per input set outside any timing; it compiles its kernels with nvcc on first
use (13-90 s each, one more for the FP8 cache), so the first input set warms it up.

FP8 caches (group "fp8", check cases named kv_e4m3): float8_e4m3fn K and V holding N(0, 64^2)
draws (a calibrated cache's spread: amax near 6 sigma = 384 < 448), dequantized by k_scale /
v_scale (K = cache x k_scale) per tensor (python floats) or per KV head (fp32 (Hkv,)), so that
the dequantized rows have a spread of 0.5-2 (per tensor) or 0.25-2 (per head, each head its
own). The check's low-precision yardstick is the FP8-dequantized 16-bit computation (K and V
x scale rounded into q's dtype, the attention in it: reference.paged_attention's upcast=False).
FlashInfer gets the same cache and per-tensor scales; it takes no per-head scales (`_flashinfer`),
so the per-head case runs ours only (FlashInfer missing, with the reason).
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.paged.sm90 import SPEC

FP8 = "float8_e4m3fn"
SCALES = ("tensor", "head")  # an FP8 cache's scale granularity: per tensor, per KV head
FP8_SPREAD = 64.0  # std of the cached e4m3 values (module docstring)
FP8_MAX = 448.0  # e4m3fn's largest finite value


def _case(b, hq, hkv, d, page, lens, *, group: str = "", tag: str = "", fp8: str = "") -> Case:
    """fp8: "" (a cache in q's dtype) or the FP8 cache's scale granularity (SCALES)."""
    lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,) * b
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    name = f"b{b}-hq{hq}-hkv{hkv}-d{d}-p{page}-{shape}"
    params = {"b": b, "hq": hq, "hkv": hkv, "d": d, "page": page, "lens": lens}
    if fp8:
        if fp8 not in SCALES:
            raise ValueError(f"fp8 scales are one of {SCALES}, got {fp8!r}")
        name += f"-kv_e4m3-per_{fp8}"
        params |= {"kv": FP8, "scale": fp8}
    return Case(name, params, group)


# Llama-3 8B (32 / 8 heads, D 128) over page 16 at the batch x length points; the
# long-sequence, small-batch corner where split-KV matters; Llama-3 70B per GPU (64 / 8 at
# tp 1, 8 / 1 at tp 8); D 64 / 256; pages 1 and 64; mixed lengths as a server batch has them.
BENCH_CASES = (
    _case(64, 32, 8, 128, 16, 4096, group="llama3-8b"),
    _case(1, 32, 8, 128, 16, 16384, group="long"),
    _case(1, 32, 8, 128, 16, 65536, group="long"),
    _case(4, 32, 8, 128, 16, 32768, group="long"),
    _case(16, 32, 8, 128, 16, 8192, group="llama3-8b"),
    _case(128, 32, 8, 128, 16, 1024, group="llama3-8b"),
    _case(32, 64, 8, 128, 16, 4096, group="llama3-70b"),
    _case(64, 8, 1, 128, 16, 4096, group="llama3-70b"),
    _case(32, 32, 4, 128, 1, 2048, group="page"),
    _case(32, 32, 8, 128, 64, 4096, group="page"),
    _case(32, 16, 16, 64, 16, 4096, group="head-dim"),
    _case(16, 16, 2, 256, 64, 4096, group="head-dim"),
    _case(48, 32, 8, 128, 16, tuple(range(100, 48 * 170, 170)), group="mixed", tag="mixed"),
    # FP8 (e4m3) caches as serving engines run them: Llama-3 8B b64 x 4k and b1 x 32k, Llama-3
    # 70B at tp 1 (GQA 8), per-tensor scales (FlashInfer's form); per-head scales ours only.
    _case(64, 32, 8, 128, 16, 4096, group="fp8", fp8="tensor"),
    _case(1, 32, 8, 128, 16, 32768, group="fp8", fp8="tensor"),
    _case(32, 64, 8, 128, 16, 4096, group="fp8", fp8="tensor"),
    _case(64, 32, 8, 128, 16, 4096, group="fp8", fp8="head"),
)
FP8_CHECK_CASES = (
    _case(3, 8, 2, 128, 16, (37, 0, 300), fp8="tensor"),
    _case(2, 24, 8, 64, 32, (77, 700), fp8="head"),
)
CHECK_CASES = (
    _case(3, 8, 2, 64, 16, (37, 0, 100)),
    _case(2, 12, 4, 128, 1, (5, 70)),
    _case(1, 16, 2, 256, 64, (300,)),
    _case(2, 24, 8, 128, 32, (77, 700)),
    _case(4, 32, 8, 128, 16, (1, 17, 3000, 0)),
    *FP8_CHECK_CASES,
)
# every kernel variant under the sanitizers: the 16-bit partial at D 64 / 128 / 256, the FP8 one
SANITIZE_CASES = (*CHECK_CASES[:3], FP8_CHECK_CASES[0])


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """q in `dtype`; the cache in `dtype`, or FP8 with its scales (k_scale / v_scale: None for
    a 16-bit cache)."""
    p = case.params
    b, ps, lens = p["b"], p["page"], p["lens"]
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 7
    shape = (pages, ps, p["hkv"], p["d"])
    k = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(pages, device=device, generator=gen)[: b * max_pages]
    q = torch.randn(b, p["hq"], p["d"], dtype=dtype, device=device, generator=gen)
    table = perm.view(b, max_pages).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    inputs = {"q": q, "k": k, "v": v, "table": table, "seqlens": seq}
    if p.get("kv") == FP8:
        inputs |= _fp8_cache(k, v, p["scale"], gen)
    else:
        inputs |= {"k_scale": None, "v_scale": None}
    return inputs


def _fp8_cache(k: torch.Tensor, v: torch.Tensor, scale: str, gen: torch.Generator) -> Inputs:
    """The N(0, 1) draws k, v spread over e4m3's range (in place: no second copy of a
    GB-sized cache) and quantized, with dequantization scales: per tensor two python floats
    (spread 0.5-2 once dequantized), per head fp32 (Hkv,) tensors (spread 0.25-2, each head
    its own). Per-tensor cases also carry their scales as (Hkv,) tensors, k_scale_heads and
    v_scale_heads (`_run_scale_tensors`)."""
    hkv, device = k.shape[2], k.device
    if scale == "head":
        spread = 0.25 + 1.75 * torch.rand(2, hkv, device=device, generator=gen)
        scales = {"k_scale": spread[0] / FP8_SPREAD, "v_scale": spread[1] / FP8_SPREAD}
    else:
        spread = (0.5 + 1.5 * torch.rand(2, device=device, generator=gen)).tolist()
        scales = {"k_scale": spread[0] / FP8_SPREAD, "v_scale": spread[1] / FP8_SPREAD}
        scales |= {
            f"{name}_heads": torch.full((hkv,), scales[name], dtype=torch.float32, device=device)
            for name in ("k_scale", "v_scale")
        }
    cache = {
        name: x.mul_(FP8_SPREAD).clamp_(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
        for name, x in (("k", k), ("v", v))
    }
    return cache | scales


def alloc_out(inputs: Inputs):
    q = inputs["q"]
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def _run(inputs: Inputs, out, k_scale, v_scale):
    op = importlib.import_module("forgekernel.ops.attention_paged")
    o = None if out is None else out[0]
    res = op.attention_paged(
        inputs["q"], inputs["k"], inputs["v"], inputs["table"], inputs["seqlens"],
        return_lse=True, out=o, k_scale=k_scale, v_scale=v_scale,
    )  # fmt: skip
    if out is None:
        return res
    out[1].copy_(res[1])
    return out


def run_ours(inputs: Inputs, out):
    """The op as a caller uses it: an FP8 cache's per-tensor scales as python floats."""
    return _run(inputs, out, inputs["k_scale"], inputs["v_scale"])


def _run_scale_tensors(inputs: Inputs, out):
    """The same per-tensor scales handed over as prebuilt fp32 (Hkv,) tensors: the op then
    fills no scale tensors per call (ours / this time: what the float form costs)."""
    return _run(inputs, out, inputs["k_scale_heads"], inputs["v_scale_heads"])


def variants(case: Case) -> dict[str, Any]:
    if case.params.get("scale") == "tensor":
        return {"scales_as_tensors": _run_scale_tensors}
    return {}


def reference(inputs: Inputs):
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"],
                               k_scale=i["k_scale"], v_scale=i["v_scale"])  # fmt: skip


def low_precision(inputs: Inputs):
    """PyTorch in q's dtype; an FP8 cache dequantized into it first (K x k_scale rounded to
    16 bits), the computation a 16-bit kernel on a dequantized cache would do."""
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"],
                               k_scale=i["k_scale"], v_scale=i["v_scale"],
                               upcast=False)  # fmt: skip


# FlashInfer 0.7.2.post1's FP8 cache, as read in the wheel (.wheels/): flashinfer/decode.py,
# BatchDecodeWithPagedKVCacheWrapper.plan (body in _plan_impl) and .run.
# - plan(..., q_data_type=q.dtype, kv_data_type=torch.float8_e4m3fn) takes an FP8 cache beside a
#   16-bit q: with use_tensor_cores=True, backend="fa2" it builds the fa2 prefill module for
#   (q 16-bit, kv e4m3, o q's dtype) (prefill.py, get_batch_prefill_module; jit/attention/
#   modules.py refuses only an FP8 q or o: "dtype_kv is deliberately not restricted"), whose
#   kernel widens FP8 tiles to 16 bits (include/flashinfer/attention/prefill.cuh,
#   repack_fp8_tile_to_bf16); run checks the cache's dtype against the planned one.
# - run(q, (k, v), k_scale=, v_scale=) types both Optional[float]: k_scale is folded into the
#   softmax scale on the host (`sm_scale *= k_scale`, a float argument of the kernel), v_scale
#   multiplies the output after the kernel (`out *= v_scale`: one more elementwise launch in the
#   timed call, skipped for 1.0). The scale tensors of *args reach the kernel only for an FP8 q.
# So one scale per tensor: a (Hkv,) tensor would make sm_scale a tensor and broadcast
# `out *= v_scale` over D, not over the KV heads. A per-head case is reported missing.
FLASHINFER_PER_HEAD = (
    "FlashInfer 0.7.2.post1's decode wrapper takes one k_scale / v_scale per tensor (floats: "
    "k_scale folded into sm_scale, out *= v_scale), not per KV head"
)


def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None

    def run(inputs: Inputs):
        ks, vs = inputs["k_scale"], inputs["v_scale"]
        if isinstance(ks, torch.Tensor) or isinstance(vs, torch.Tensor):
            raise NotImplementedError(FLASHINFER_PER_HEAD)
        if "flashinfer" not in inputs:
            q, k, table, seq = inputs["q"], inputs["k"], inputs["table"], inputs["seqlens"]
            ps, hkv, d = k.shape[1], k.shape[2], k.shape[3]
            pages = (seq + ps - 1) // ps
            indptr = torch.zeros(q.shape[0] + 1, dtype=torch.int32, device=q.device)
            indptr[1:] = torch.cumsum(pages, 0)
            rows = torch.arange(table.shape[1], device=q.device)[None, :] < pages[:, None]
            indices = table[rows].contiguous()
            last = torch.where(seq > 0, (seq - 1) % ps + 1, 0).to(torch.int32)
            ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
            w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
                ws, "NHD", use_tensor_cores=True, backend="fa2"
            )
            w.plan(indptr, indices, last, q.shape[1], hkv, d, ps, q_data_type=q.dtype,
                   kv_data_type=k.dtype)  # fmt: skip
            inputs["flashinfer"] = (w, ws)
        w, _ = inputs["flashinfer"]
        return w.run(inputs["q"], (inputs["k"], inputs["v"]), k_scale=ks, v_scale=vs,
                     return_lse=True)  # fmt: skip

    return run


def comparators() -> dict[str, Any]:
    return {"flashinfer": _flashinfer() if torch.cuda.is_available() else None}


def flops(case: Case) -> float:
    p = case.params
    return 4.0 * sum(p["lens"]) * p["hq"] * p["d"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """K and V rows read: 1 byte an element for an FP8 cache, else `dtype`'s size."""
    p = case.params
    per = 1 if p.get("kv") == FP8 else torch.empty((), dtype=dtype).element_size()
    return 2.0 * sum(p["lens"]) * p["hkv"] * p["d"] * per


def suite() -> OpSuite:
    return OpSuite(
        name="attention_paged",
        kernel_sources=SPEC.sources,
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
        memory_bound=True,
        atol=1e-3,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        variants=variants,
    )
