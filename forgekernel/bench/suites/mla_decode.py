"""DeepSeek MLA paged decode suite (issue 19; its first GPU check passed
2026-12-01): absorbed decode, H query heads against one
576-wide latent row per token (512 latent + 64 RoPE columns), outputs (out (B, s_q, H, 512),
lse (B, H, s_q) natural log); one packed check case (cu_seqlens_q, 0..3 tokens per sequence).

Shapes: DeepSeek-V3 / R1 serving at TP8 (16 heads per GPU, FlashInfer-Bench's h16 definitions)
and TP1 (128 heads), softmax_scale DeepSeek-V3's (1 / sqrt(192) x mscale^2). Inputs are
FlashMLA's: q (B, s_q, H, 576) and the combined cache (pages, page_size, 1, 576), ours reading
their views in place; cache="split" cases hold FlashInfer's separate ckv / kpe caches instead.

Memory-bound at 16 heads: GB/s counts the latent rows once (tokens x 576 x 2 bytes) plus q, out
and the LSE (at 128 heads our kernel reads the cache once per 64-head block; L2 serves part of
it). FLOPs: 2 x (576 + 512) per (query row, head, visible key).

Comparators, set up by their first call on each input set (outside any timing, cached there):
FlashMLA (sgl-flash-mla 1.0's legacy sm90 kernels, the API `shared/gpu-host/comparators.py`
calls; page size 64 and uniform s_q only; its scheduler metadata made by that first call) and
FlashInfer's BatchMLAPagedAttentionWrapper (fa3, planned then; contiguous ckv / kpe / q copies
where the inputs are combined). Both return their LSE as we do.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.mla.sm90 import SPEC

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
# DeepSeek-V3's: the un-absorbed 1 / sqrt(128 + 64) times the YaRN mscale^2 (mscale 0.1 ln 40 + 1)
SOFTMAX_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)


def _case(b, hq, page, lens, *, s_q=1, q_lens=None, cache="combined", group="", tag="") -> Case:
    lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,) * b
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    form = f"-sq{s_q}" if s_q > 1 else ("-packed" if q_lens else "")
    name = f"b{b}-h{hq}-p{page}-{shape}{form}" + ("-split" if cache == "split" else "")
    params = {"b": b, "hq": hq, "page": page, "lens": lens, "s_q": s_q, "cache": cache}
    if q_lens is not None:
        params["q_lens"] = tuple(q_lens)
    return Case(name, params, group)


def _tp(hq: int) -> str:
    return "tp8" if hq == 16 else "tp1"


# DeepSeek-V3 decode per GPU at TP8 (h16) and TP1 (h128): one long sequence, serving batches at
# 4k / 8k (FlashMLA 3.16 TB/s, FlashInfer fa3 3.30 TB/s at b64 L4096 h16, anchors 2026-12-01),
# FlashInfer-Bench's page size 1 (its split caches), a mixed batch, MTP with 2 tokens.
SERVED = (4096, 8192)
BENCH_CASES = (
    *(_case(1, h, 64, n, group=_tp(h)) for h in (16, 128) for n in (4096, 16384, 65536)),
    *(_case(b, h, 64, n, group=_tp(h)) for h in (16, 128) for b in (16, 64, 128) for n in SERVED),
    _case(64, 16, 1, 4096, cache="split", group="page1"),
    _case(16, 128, 1, 4096, cache="split", group="page1"),
    _case(48, 16, 64, tuple(range(100, 48 * 170, 170)), group="mixed", tag="mixed"),
    _case(64, 16, 64, 4096, s_q=2, group="mtp"),
    _case(64, 128, 64, 8192, s_q=2, group="mtp"),
)
CHECK_CASES = (
    _case(3, 16, 64, (37, 0, 100)),
    _case(2, 16, 1, (1, 70), cache="split"),
    _case(1, 16, 16, (300,), cache="split"),
    _case(5, 16, 64, (1, 17, 129, 0, 1000)),
    _case(2, 128, 64, (65, 513)),
    _case(4, 32, 16, (1, 40, 77, 2), s_q=2, cache="split"),
    _case(3, 16, 64, (4, 300, 65), s_q=4),
    _case(4, 16, 16, (40, 3, 10, 0), q_lens=(1, 3, 0, 2), cache="split"),
)
# every compiled variant: 16 heads x 1 token, 8 x 2, 4 x 4 (packed), both cache forms
SANITIZE_CASES = (CHECK_CASES[0], CHECK_CASES[5], CHECK_CASES[6])


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    b, hq, ps, lens = p["b"], p["hq"], p["page"], p["lens"]
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 7
    rand = {"dtype": dtype, "device": device, "generator": gen}
    rows = (sum(p["q_lens"]),) if "q_lens" in p else (b, p["s_q"])
    inputs: dict[str, Any] = {"q": torch.randn(*rows, hq, WIDTH, **rand)}
    if p["cache"] == "combined":
        inputs["ckv"], inputs["kpe"] = torch.randn(pages, ps, 1, WIDTH, **rand), None
    else:
        inputs["ckv"] = torch.randn(pages, ps, LATENT, **rand)
        inputs["kpe"] = torch.randn(pages, ps, ROPE, **rand)
    perm = torch.randperm(pages, device=device, generator=gen)[: b * max_pages]
    inputs["table"] = perm.view(b, max_pages).to(torch.int32)
    inputs["seqlens"] = torch.tensor(lens, dtype=torch.int32, device=device)
    if "q_lens" in p:
        cu = torch.tensor([0, *torch.tensor(p["q_lens"]).cumsum(0).tolist()], dtype=torch.int32)
        inputs["cu_seqlens_q"], inputs["max_seqlen_q"] = cu.to(device), max(p["q_lens"])
    return inputs


def alloc_out(inputs: Inputs):
    q = inputs["q"]
    out = q.new_empty(*q.shape[:-1], LATENT)
    if "cu_seqlens_q" in inputs:  # (H, total_q)
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    b, s_q, hq, _ = q.shape
    return out, q.new_empty(b, hq, s_q, dtype=torch.float32)


def _packed(inputs: Inputs) -> dict[str, Any]:
    if "cu_seqlens_q" not in inputs:
        return {}
    return {"cu_seqlens_q": inputs["cu_seqlens_q"], "max_seqlen_q": inputs["max_seqlen_q"]}


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.mla")
    q = inputs["q"]
    res = op.mla_decode(
        q[..., :LATENT], q[..., LATENT:], inputs["ckv"], inputs["kpe"], inputs["table"],
        inputs["seqlens"], softmax_scale=SOFTMAX_SCALE, return_lse=True,
        out=None if out is None else out[0], **_packed(inputs),
    )  # fmt: skip
    if out is None:
        return res
    out[1].copy_(res[1])
    return out


def _reference(inputs: Inputs, upcast: bool):
    from forgekernel.reference.mla import mla_decode_ref, mla_prefill_ref

    q = inputs["q"]
    args = (q[..., :LATENT], q[..., LATENT:], inputs["ckv"], inputs["kpe"], inputs["table"],
            inputs["seqlens"])  # fmt: skip
    if "cu_seqlens_q" in inputs:
        return mla_prefill_ref(*args, inputs["cu_seqlens_q"], SOFTMAX_SCALE, upcast=upcast)
    return mla_decode_ref(*args, SOFTMAX_SCALE, upcast=upcast)


def reference(inputs: Inputs):
    return _reference(inputs, upcast=True)


def low_precision(inputs: Inputs):
    return _reference(inputs, upcast=False)


def _split_copies(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer's (ckv, kpe): the inputs' own, or contiguous copies of a combined cache's."""
    if inputs["kpe"] is not None:
        return inputs["ckv"], inputs["kpe"]
    row = inputs["ckv"][:, :, 0]
    return row[..., :LATENT].contiguous(), row[..., LATENT:].contiguous()


def _flashmla():
    try:
        import flash_mla
    except ImportError:
        return None

    def setup(inputs: Inputs):
        if "cu_seqlens_q" in inputs:
            raise ValueError("FlashMLA takes (batch, s_q, H, 576) queries, not a packed batch")
        q, table, seq = inputs["q"], inputs["table"], inputs["seqlens"]
        kv = inputs["ckv"]
        if inputs["kpe"] is not None:
            kv = torch.cat([inputs["ckv"], inputs["kpe"]], -1)[:, :, None]
        if kv.shape[1] != 64:
            raise ValueError(f"FlashMLA's sm90 decode takes page size 64, not {kv.shape[1]}")
        causal = q.shape[1] > 1
        try:  # sgl-flash-mla 1.0: a metadata object its first call fills, legacy sm90 kernels
            meta, _ = flash_mla.get_mla_metadata()

            def call():
                return flash_mla.flash_mla_with_kvcache(
                    q, kv, table, seq, LATENT, meta, softmax_scale=SOFTMAX_SCALE, causal=causal,
                    is_fp8_kvcache=False, use_legacy=True,
                )  # fmt: skip

            call()
        except TypeError:  # upstream FlashMLA: (tile_scheduler_metadata, num_splits)
            meta, splits = flash_mla.get_mla_metadata(seq, q.shape[1] * q.shape[2], 1)

            def call():
                return flash_mla.flash_mla_with_kvcache(
                    q, kv, table, seq, LATENT, meta, splits, softmax_scale=SOFTMAX_SCALE,
                    causal=causal,
                )  # fmt: skip

        return call, kv

    def run(inputs: Inputs):
        if "flashmla" not in inputs:
            inputs["flashmla"] = setup(inputs)
        return inputs["flashmla"][0]()

    return run


def _flashinfer():
    try:
        import flashinfer
    except ImportError:
        return None

    def setup(inputs: Inputs):
        q, table, seq = inputs["q"], inputs["table"], inputs["seqlens"]
        ckv, kpe = _split_copies(inputs)
        hq, ps = q.shape[-2], ckv.shape[1]
        rows = q.reshape(-1, hq, WIDTH)
        qn, qp = rows[..., :LATENT].contiguous(), rows[..., LATENT:].contiguous()
        if "cu_seqlens_q" in inputs:
            qo_indptr, causal = inputs["cu_seqlens_q"], True
        else:
            s_q = q.shape[1]
            qo_indptr = torch.arange(0, (q.shape[0] + 1) * s_q, s_q, dtype=torch.int32,
                                     device=q.device)  # fmt: skip
            causal = s_q > 1
        pages = (seq + ps - 1) // ps
        kv_indptr = torch.zeros(seq.shape[0] + 1, dtype=torch.int32, device=q.device)
        kv_indptr[1:] = torch.cumsum(pages, 0)
        used = torch.arange(table.shape[1], device=q.device)[None, :] < pages[:, None]
        ws = torch.empty(256 << 20, dtype=torch.uint8, device=q.device)
        w = flashinfer.mla.BatchMLAPagedAttentionWrapper(ws, backend="fa3")
        w.plan(qo_indptr, kv_indptr, table[used].contiguous(), seq, hq, LATENT, ROPE, ps, causal,
               SOFTMAX_SCALE, q.dtype, ckv.dtype)  # fmt: skip
        return w, ws, qn, qp, ckv, kpe

    def run(inputs: Inputs):
        if "flashinfer" not in inputs:
            inputs["flashinfer"] = setup(inputs)
        w, _, qn, qp, ckv, kpe = inputs["flashinfer"]
        return w.run(qn, qp, ckv, kpe, return_lse=True)

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"flashmla": None, "flashinfer": None}
    return {"flashmla": _flashmla(), "flashinfer": _flashinfer()}


def _query_rows(case: Case) -> list[tuple[int, int]]:
    """(KV length, query tokens) per sequence."""
    p = case.params
    q_lens = p.get("q_lens") or (p["s_q"],) * p["b"]
    return list(zip(p["lens"], q_lens))


def flops(case: Case) -> float:
    """Visible (query, key) pairs (causal, bottom-right) x heads x 2 (576 + 512)."""
    pairs = sum(min(sk, max(0, sk - sq + i + 1)) for sk, sq in _query_rows(case) for i in range(sq))
    return 2.0 * (WIDTH + LATENT) * pairs * case.params["hq"]


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """The latent rows read once, q in, out and the LSE out."""
    size = torch.empty((), dtype=dtype).element_size()
    rows = sum(sq for _, sq in _query_rows(case)) * case.params["hq"]
    return sum(case.params["lens"]) * WIDTH * size + rows * ((WIDTH + LATENT) * size + 4)


def suite() -> OpSuite:
    return OpSuite(
        name="mla_decode",
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
