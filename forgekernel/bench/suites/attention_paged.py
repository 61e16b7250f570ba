"""Paged GQA decode suite (issue 18): one query token per sequence against a paged KV cache
(vLLM / FlashAttention layout), outputs (o, lse natural log). Registered in
bench/suites/__init__.py once `pytest -m gpu tests/gpu/test_paged_gpu.py` passes.

Memory-bound: GB/s counts the K and V rows read (2 x tokens x Hkv x D x 2 bytes). Comparator:
FlashInfer's BatchDecodeWithPagedKVCacheWrapper (fa2 backend, tensor cores: 4.1 TB/s at
B64 L4096 on the H200), planned once per input set outside any timing; it compiles its kernels
with nvcc on first use (13-90 s each), so the first input set warms it up.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.paged.sm90 import SPEC


def _case(b, hq, hkv, d, page, lens, *, group: str = "", tag: str = "") -> Case:
    lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,) * b
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    name = f"b{b}-hq{hq}-hkv{hkv}-d{d}-p{page}-{shape}"
    return Case(name, {"b": b, "hq": hq, "hkv": hkv, "d": d, "page": page, "lens": lens}, group)


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
)
CHECK_CASES = (
    _case(3, 8, 2, 64, 16, (37, 0, 100)),
    _case(2, 12, 4, 128, 1, (5, 70)),
    _case(1, 16, 2, 256, 64, (300,)),
    _case(2, 24, 8, 128, 32, (77, 700)),
    _case(4, 32, 8, 128, 16, (1, 17, 3000, 0)),
)
SANITIZE_CASES = CHECK_CASES[:3]


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    b, ps, lens = p["b"], p["page"], p["lens"]
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 7
    k = torch.randn(pages, ps, p["hkv"], p["d"], dtype=dtype, device=device, generator=gen)
    v = torch.randn(pages, ps, p["hkv"], p["d"], dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(pages, device=device, generator=gen)[: b * max_pages]
    q = torch.randn(b, p["hq"], p["d"], dtype=dtype, device=device, generator=gen)
    table = perm.view(b, max_pages).to(torch.int32)
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    return {"q": q, "k": k, "v": v, "table": table, "seqlens": seq}


def alloc_out(inputs: Inputs):
    q = inputs["q"]
    return torch.empty_like(q), q.new_empty(q.shape[0], q.shape[1], dtype=torch.float32)


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.attention_paged")
    o = None if out is None else out[0]
    res = op.attention_paged(
        inputs["q"], inputs["k"], inputs["v"], inputs["table"], inputs["seqlens"],
        return_lse=True, out=o,
    )  # fmt: skip
    if out is None:
        return res
    out[1].copy_(res[1])
    return out


def reference(inputs: Inputs):
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"])


def low_precision(inputs: Inputs):
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"], upcast=False)


def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None

    def run(inputs: Inputs):
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
        return w.run(inputs["q"], (inputs["k"], inputs["v"]), return_lse=True)

    return run


def comparators() -> dict[str, Any]:
    return {"flashinfer": _flashinfer() if torch.cuda.is_available() else None}


def flops(case: Case) -> float:
    p = case.params
    return 4.0 * sum(p["lens"]) * p["hq"] * p["d"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    return 2.0 * sum(p["lens"]) * p["hkv"] * p["d"] * torch.empty((), dtype=dtype).element_size()


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
    )
