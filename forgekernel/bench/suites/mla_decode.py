"""DeepSeek MLA paged decode suite (issue 19; its first GPU check passed
2026-12-01): absorbed decode, H query heads against one
576-wide latent row per token (512 latent + 64 RoPE columns), outputs (out (B, s_q, H, 512),
lse (B, H, s_q) natural log); packed cases (cu_seqlens_q): 0..3 tokens per sequence through
mla_decode, and chunked prefill (more than 4) through mla_prefill (group prefill).

Shapes: DeepSeek-V3 / R1 serving at TP8 (16 heads per GPU, FlashInfer-Bench's h16 definitions)
and TP1 (128 heads), softmax_scale DeepSeek-V3's (1 / sqrt(192) x mscale^2). Inputs are
FlashMLA's: q (B, s_q, H, 576) and the combined cache (pages, page_size, 1, 576), ours reading
their views in place; cache="split" cases hold FlashInfer's separate ckv / kpe caches instead;
cache="fp8" cases (group fp8 in the bench) FlashMLA's FP8 cache (pages, page_size, 1, 656), the
format DeepSeek serving uses (reference.mla.quantize_flashmla_fp8 of random bf16 rows), with bf16
queries whatever the dtype (e4m3 x a power-of-two scale is exact in bf16, not in fp16: the fp16
run of an FP8 check case is a second bf16 run on other inputs). Their reference reads the latent
as e4m3 x its scales (flashmla_fp8_views), in fp32 and (the yardstick) in bf16.

Memory-bound at 16 heads: GB/s counts the latent rows once (tokens x 576 x 2 bytes, FP8: 656)
plus q, out and the LSE (at 128 heads our kernel reads the cache once per 64-head block; L2
serves part of it). FLOPs: 2 x (576 + 512) per (query row, head, visible key).

Comparators, set up by their first call on each input set (outside any timing, cached there):
FlashMLA (sgl-flash-mla 1.0's legacy sm90 kernels, the API `shared/gpu-host/comparators.py`
calls; page size 64 and uniform s_q only; its scheduler metadata made by that first call) and
FlashInfer's BatchMLAPagedAttentionWrapper (fa3, planned then; contiguous ckv / kpe / q copies
where the inputs are combined). Both return their LSE as we do.

FP8 cases: neither reads the 656-byte cache (each says so as its missing reason). Read from
sgl-flash-mla 1.0.0's wheel: `flash_mla_with_kvcache(..., is_fp8_kvcache=True)` without
`indices` is the legacy dense FP8 decode (`fwd_kvcache_mla_fp8`: "Only head_size_k == 576 is
supported", descale_q / descale_k required, e4m3 queries: FlashMLA pull request #54's per-tensor
FP8), not this format; with `indices` it is the sparse decode (legacy, use_legacy=True), whose
V3.2 format is this cache. So `flashmla_fp8_sparse` runs FlashMLA's sparse decode over every key
of each sequence (indices page * 64 + slot for positions < seqlens_k, -1 after, the width
rounded up to its 64-entry blocks; no causal mask: s_q 1 only; 16 heads zero-padded to its 64):
the dense decode expressed as a sparse one, on the same cache, as
`dsa_sparse.flashmla_fp8_decode` calls it.
"""

from __future__ import annotations

import functools
import importlib
import math
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90.config import FP8_ROW_BYTES
from forgekernel.runtime import pdl

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
# DeepSeek-V3's: the un-absorbed 1 / sqrt(128 + 64) times the YaRN mscale^2 (mscale 0.1 ln 40 + 1)
SOFTMAX_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)
FLASHMLA_NO_DENSE_FP8 = (
    "sgl-flash-mla 1.0.0's dense FP8 decode (fwd_kvcache_mla_fp8) reads 576 e4m3 bytes a token"
    " with per-tensor descale_q / descale_k and e4m3 queries, not the 656-byte FP8 cache:"
    " flashmla_fp8_sparse runs it on this cache"
)


def _case(b, hq, page, lens, *, s_q=1, q_lens=None, cache="combined", group="", tag="",
          plain=False) -> Case:  # fmt: skip
    """plain: ours without the decode step's schedule (the width plan's call, what a caller
    that makes no schedule gets; `_our_call`)."""
    lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,) * b
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    form = f"-sq{s_q}" if s_q > 1 else ("-packed" if q_lens and max(q_lens) <= 4 else "")
    name = f"b{b}-h{hq}-p{page}-{shape}{form}" + ("" if cache == "combined" else f"-{cache}")
    params = {"b": b, "hq": hq, "page": page, "lens": lens, "s_q": s_q, "cache": cache}
    if q_lens is not None:
        params["q_lens"] = tuple(q_lens)
    if plain:
        name, params["plain"] = name + "-plain", True
    return Case(name, params, group)


def _tp(hq: int) -> str:
    return "tp8" if hq == 16 else "tp1"


# DeepSeek-V3 decode per GPU at TP8 (h16) and TP1 (h128): one long sequence, serving batches at
# 4k / 8k (FlashMLA 3.16 TB/s, FlashInfer fa3 3.30 TB/s at b64 L4096 h16, anchors 2026-12-01),
# FlashInfer-Bench's page size 1 (its split caches), a mixed batch, MTP with 2 tokens.
SERVED = (4096, 8192)
# a long-tailed serving batch: 32 lengths log-uniform from 512 to 37.6k keys (x 2^0.2 apart)
RAGGED = tuple(round(512 * 2 ** (i / 5)) for i in range(32))
BENCH_CASES = (
    *(_case(1, h, 64, n, group=_tp(h)) for h in (16, 128) for n in (4096, 16384, 65536)),
    *(_case(b, h, 64, n, group=_tp(h)) for h in (16, 128) for b in (16, 64, 128) for n in SERVED),
    # the other batches at TP8: 8 x 16k (FlashMLA 2.6 TB/s there, anchors), 32 x 2k and
    # 256 x 1k (short caches: the plan's split and the combine weigh most)
    _case(8, 16, 64, 16384, group="tp8"),
    _case(32, 16, 64, 2048, group="tp8"),
    _case(256, 16, 64, 1024, group="tp8"),
    _case(64, 16, 1, 4096, cache="split", group="page1"),
    _case(16, 128, 1, 4096, cache="split", group="page1"),
    _case(48, 16, 64, tuple(range(100, 48 * 170, 170)), group="mixed", tag="mixed"),
    _case(32, 16, 64, RAGGED, group="mixed", tag="ragged"),
    _case(64, 16, 64, 4096, s_q=2, group="mtp"),
    _case(64, 128, 64, 8192, s_q=2, group="mtp"),
    # chunked prefill (mla_prefill): a 1024-token chunk after 7168 cached at TP8, four 512-token
    # chunks over 4k, 256 new tokens at TP1; the largest chunk, 8k new tokens over 8k
    # cached (TP8), and a fresh 4k prompt at TP1
    _case(1, 16, 64, 8192, q_lens=(1024,), group="prefill", tag="L8192-q1024"),
    _case(4, 16, 64, 4096, q_lens=(512,) * 4, group="prefill", tag="L4096-q512"),
    _case(1, 128, 64, 4096, q_lens=(256,), group="prefill", tag="L4096-q256"),
    _case(1, 16, 64, 16384, q_lens=(8192,), group="prefill", tag="L16384-q8192"),
    _case(1, 128, 64, 4096, q_lens=(4096,), group="prefill", tag="L4096-q4096"),
    # FlashMLA's FP8 cache (DeepSeek serving's): a TP8 batch at 4k, one long TP8 sequence, TP1
    _case(64, 16, 64, 4096, cache="fp8", group="fp8"),
    _case(1, 16, 64, 32768, cache="fp8", group="fp8"),
    _case(16, 128, 64, 8192, cache="fp8", group="fp8"),
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
    _case(4, 16, 64, (40, 9, 10, 200), q_lens=(9, 9, 0, 70), tag="prefill"),
    _case(3, 16, 64, (37, 0, 100), cache="fp8"),
    _case(2, 16, 1, (1, 70), cache="fp8"),
    _case(2, 128, 16, (65, 513), cache="fp8"),
    _case(4, 32, 16, (1, 40, 77, 2), s_q=2, cache="fp8"),
    _case(3, 16, 64, (4, 300, 65), s_q=4, cache="fp8"),
    _case(4, 16, 16, (40, 3, 10, 0), q_lens=(1, 3, 0, 2), cache="fp8"),
    _case(4, 16, 64, (40, 9, 10, 200), q_lens=(9, 9, 0, 70), cache="fp8", tag="prefill"),
    # the seesaw pass's direct form (plans of one split: O and LSE written by the pass, no
    # combine) at every prebuilt block: 64 x 1 (h128), 32 x 1, 16 x 2, 32 x 2 (h128 MTP 2),
    # 16 x 4 (h32 s_q 3, h16 s_q 4); lengths off the 64-key tiles, sequences of 0 keys; and a
    # batch of 132 sequences (one split each by the plan, up to 16 tiles: steady pairs)
    _case(4, 128, 64, (1, 63, 65, 200)),
    _case(2, 32, 64, (0, 250)),
    _case(3, 16, 64, (5, 0, 130), s_q=2),
    _case(2, 128, 64, (70, 190), s_q=2),
    _case(2, 32, 64, (3, 90), s_q=3),
    _case(3, 16, 64, (4, 0, 129), s_q=4),
    _case(132, 16, 64, tuple((i * 7919) % 1000 for i in range(132)), tag="direct"),
    # the call without a schedule (the cases above with 16-bit page-64 caches take the step's
    # schedule, as the bench's ours): the width plan's seesaw splits, 16 / 128 heads, MTP 4
    _case(3, 16, 64, (37, 0, 100), plain=True),
    _case(5, 16, 64, (1, 17, 129, 0, 1000), plain=True),
    _case(2, 128, 64, (65, 513), plain=True),
    _case(3, 16, 64, (4, 300, 65), s_q=4, plain=True),
    # 16-bit page 1 takes the seesaw's gather form ("gather adopted"): CHECK_CASES[1] its direct
    # form (16 x 1, one split); here its partial pass at 64 x 1 (8 splits) with empty and
    # one-key sequences
    _case(3, 128, 1, (1, 0, 2000), cache="split"),
)
# every compiled variant: 16 heads x 1 token, 8 x 2, 4 x 4 (packed), both cache forms; the fp8
# compiles at 16 x 1 and 16 x 4; the 128-head seesaw blocks, partial (splits) and direct: the
# direct ones, 64 x 1 and 32 x 2 (MTP 2), on their `ostore` compiles; the gather form at page 1
# (cp.async rows onto the chunk mbarriers), direct 16 x 1 and partial 64 x 1
SANITIZE_CASES = (
    CHECK_CASES[0], CHECK_CASES[5], CHECK_CASES[6], CHECK_CASES[9], CHECK_CASES[13],
    CHECK_CASES[4], CHECK_CASES[16], CHECK_CASES[19], CHECK_CASES[24], CHECK_CASES[1],
    CHECK_CASES[-1],
)  # fmt: skip


def fp8(case: Case) -> bool:
    """The case holds FlashMLA's FP8 cache (bf16 queries whatever the dtype)."""
    return case.params.get("cache") == "fp8"


def fp8_cache(pages: int, page_size: int, device: torch.device, gen: torch.Generator):
    """FlashMLA's FP8 cache (pages, page_size, 1, 656) float8_e4m3fn of random bf16 latent and
    RoPE rows (reference.mla.quantize_flashmla_fp8: per-128-column power-of-two scales)."""
    from forgekernel.reference.mla import quantize_flashmla_fp8

    rand = {"dtype": torch.bfloat16, "device": device, "generator": gen}
    latent = torch.randn(pages, page_size, LATENT, **rand)
    return quantize_flashmla_fp8(latent, torch.randn(pages, page_size, ROPE, **rand))


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    b, hq, ps, lens = p["b"], p["hq"], p["page"], p["lens"]
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 7
    dtype = torch.bfloat16 if fp8(case) else dtype
    rand = {"dtype": dtype, "device": device, "generator": gen}
    rows = (sum(p["q_lens"]),) if "q_lens" in p else (b, p["s_q"])
    inputs: dict[str, Any] = {"q": torch.randn(*rows, hq, WIDTH, **rand)}
    if fp8(case):
        inputs["ckv"], inputs["kpe"] = fp8_cache(pages, ps, device, gen), None
    elif p["cache"] == "combined":
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
    if p.get("plain"):
        inputs["plain"] = True
    return inputs


def alloc_out(inputs: Inputs):
    q = inputs["q"]
    out = q.new_empty(*q.shape[:-1], LATENT)
    if "cu_seqlens_q" in inputs:  # (H, total_q)
        return out, q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)
    b, s_q, hq, _ = q.shape
    return out, q.new_empty(b, hq, s_q, dtype=torch.float32)


def _our_call(inputs: Inputs, plain: bool = False) -> tuple:
    """(op, its positional arguments, its keywords but out / lse): made once per input set,
    outside any timed call (as the comparators' set-ups), so that the host time per eager call
    is the op's: q_nope and q_pe are views of the bench's FlashMLA-shaped q, which a caller holds
    as two tensors (2.9 us a call on the CPU when sliced per call). An input set's tensors are
    refilled in place, never replaced (the harness's contract with the comparators' set-ups).
    Decode calls on 16-bit caches take the decode step's schedule (`_schedule`), made here once
    per input set as FlashMLA's column makes its metadata; plain: the call without it."""
    plain = plain or inputs.get("plain", False)
    key = "ours_plain" if plain else "ours"
    if key not in inputs:
        op = importlib.import_module("forgekernel.ops.mla")
        q = inputs["q"]
        kwargs = {"softmax_scale": SOFTMAX_SCALE, "return_lse": True}
        if "cu_seqlens_q" in inputs:
            kwargs |= {"cu_seqlens_q": inputs["cu_seqlens_q"],
                       "max_seqlen_q": inputs["max_seqlen_q"]}  # fmt: skip
        prefill = inputs.get("max_seqlen_q", 1) > op.MAX_QUERY_TOKENS  # mla_prefill's form
        args = (q[..., :LATENT], q[..., LATENT:], inputs["ckv"], inputs["kpe"], inputs["table"],
                inputs["seqlens"])  # fmt: skip
        if not (plain or prefill or _is_fp8_cache(inputs)):
            kwargs["schedule"] = _schedule(op, inputs)
        inputs[key] = (op.mla_prefill if prefill else op.mla_decode), args, kwargs
    return inputs[key]


def _schedule(op, inputs: Inputs):
    """The input set's decode step schedule (forgekernel.mla_decode_schedule; MLA_NOTES.md, "A
    decode step's schedule, built"): one launch on the device, as a server makes it once a step
    for all its layers; the timed calls are mla_decode's alone (a plan that takes no list, one
    split or pages off the 64-key tiles, keeps its own)."""
    q = inputs["q"]
    form = {"s_q": q.shape[1]}
    if "cu_seqlens_q" in inputs:
        form = {"cu_seqlens_q": inputs["cu_seqlens_q"], "max_seqlen_q": inputs["max_seqlen_q"]}
    return op.mla_decode_schedule(inputs["seqlens"], q.shape[-2], inputs["table"],
                                  page_size=inputs["ckv"].shape[1], dtype=q.dtype,
                                  **form)  # fmt: skip


def run_ours(inputs: Inputs, out, plain: bool = False):
    fn, args, kwargs = _our_call(inputs, plain)
    if out is None:
        return fn(*args, **kwargs)
    fn(*args, out=out[0], lse=out[1], **kwargs)
    return out


def _is_fp8_cache(inputs: Inputs) -> bool:
    return inputs["kpe"] is None and inputs["ckv"].shape[-1] == FP8_ROW_BYTES


def _reference(inputs: Inputs, upcast: bool):
    from forgekernel.reference.mla import flashmla_fp8_views, mla_decode_ref, mla_prefill_ref

    q = inputs["q"]
    caches, scales = (inputs["ckv"], inputs["kpe"]), {}
    if _is_fp8_cache(inputs):
        latent, scale, rope = flashmla_fp8_views(inputs["ckv"])
        caches, scales = (latent, rope), {"ckv_scale": scale}
    args = (q[..., :LATENT], q[..., LATENT:], *caches, inputs["table"], inputs["seqlens"])
    if "cu_seqlens_q" in inputs:
        return mla_prefill_ref(*args, inputs["cu_seqlens_q"], SOFTMAX_SCALE, upcast=upcast,
                               **scales)  # fmt: skip
    return mla_decode_ref(*args, SOFTMAX_SCALE, upcast=upcast, **scales)


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
        if _is_fp8_cache(inputs):
            raise ValueError(FLASHMLA_NO_DENSE_FP8)
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
        if _is_fp8_cache(inputs):
            raise ValueError(
                "FlashInfer's MLA wrapper reads 16-bit ckv / kpe caches (fp8 ones with one scale"
                " per tensor), not FlashMLA's FP8 rows with their per-128-column scales"
            )
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


def dense_indices(table: torch.Tensor, seqlens: torch.Tensor, page_size: int) -> torch.Tensor:
    """(batch, 1, width) int32 slot indices of every cached key of each sequence (page *
    page_size + slot for positions < seqlens_k, -1 after), width the table's positions rounded
    up to FlashMLA's 64-entry blocks: a dense decode as a sparse one."""
    width = -(-table.shape[1] * page_size // 64) * 64
    pos = torch.arange(width, device=table.device)
    page = table.long()[:, (pos // page_size).clamp(max=table.shape[1] - 1)]
    slots = page * page_size + pos % page_size
    return torch.where(pos < seqlens[:, None], slots, -1).to(torch.int32)[:, None]


def _flashmla_fp8_sparse():
    try:
        import flash_mla
    except ImportError:
        return None
    from forgekernel.bench.suites.dsa_sparse import flashmla_fp8_decode

    def setup(inputs: Inputs):
        if not _is_fp8_cache(inputs):
            raise ValueError("FP8 cases only (16-bit caches: the flashmla comparator)")
        q = inputs["q"]
        if "cu_seqlens_q" in inputs or q.shape[1] != 1:
            raise ValueError("one query token per sequence: FlashMLA's sparse decode has no mask")
        indices = dense_indices(inputs["table"], inputs["seqlens"], inputs["ckv"].shape[1])
        return flashmla_fp8_decode(flash_mla, q, inputs["ckv"], indices), indices

    def run(inputs: Inputs):
        if "flashmla_fp8" not in inputs:
            inputs["flashmla_fp8"] = setup(inputs)
        return inputs["flashmla_fp8"][0]()

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"flashmla": None, "flashinfer": None, "flashmla_fp8_sparse": None}
    return {"flashmla": _flashmla(), "flashinfer": _flashinfer(),
            "flashmla_fp8_sparse": _flashmla_fp8_sparse()}  # fmt: skip


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
    """The latent rows read once (FP8: 656 bytes a token), q in, out and the LSE out."""
    size = 2 if fp8(case) else torch.empty((), dtype=dtype).element_size()
    row = FP8_ROW_BYTES if fp8(case) else WIDTH * size
    rows = sum(sq for _, sq in _query_rows(case)) * case.params["hq"]
    return sum(case.params["lens"]) * row + rows * ((WIDTH + LATENT) * size + 4)


# Launcher-only candidates (launch.plan_form: tiles per split, heads per CTA; the kernels as
# built) on the cases furthest behind FlashMLA on 2026-12-03 16:40; predictions and falsifiers in
# MLA_NOTES.md ("Measured 2026-12-03 16:40"). Model fitted to that run's graph times: A + t x (the
# greedy makespan of the CTAs in launch order, tiles + 2 a non-empty CTA, 0.5 an empty one) + c x
# splits, c 0.33-0.37 us a split (the combine's walk over the splits: ~1.3 dependent L2 round
# trips a split a thread in its SASS), t 2.2-2.8 us a 16-head tile, 1.95 at 64 heads.
CANDIDATES: dict[str, dict[str, dict[str, int | bool]]] = {
    # ragged 100 .. 8090 keys: the plan sizes splits by the table's width (8 x 16 tiles, 384
    # CTAs); 5 x 28 / 4 x 32 leave fewer, fuller CTAs: ~78 / ~84 us against 90.6
    # worklist: the device-side work list (schedule.py: tiles per split sized by the lengths on
    # the device, no CTA without keys; one more launch): predicted ~0.86-0.88 of our time here,
    # the width plan's splits on the uniform cases below at +2-3 us (MLA_NOTES.md, "A device-side
    # work list for ragged batches")
    "b48-h16-p64-mixed": {
        "per28": {"per_tiles": 28},
        "per32": {"per_tiles": 32},
        "worklist": {"worklist": True},
    },
    # 128 splits of 8 tiles, ~42 us of 65.5 in the combine by the model: 94 x 11 ~63 us, 64 x 16
    # ~67
    "b1-h16-p64-L65536": {"per11": {"per_tiles": 11}, "per16": {"per_tiles": 16}},
    # 64 x 16 tiles x 2 head blocks (128 CTAs): 52 x 20 on 104 CTAs, ~65 us against 61.7 (the
    # model's falsifier: faster would put more than 0.37 us a split in the combine)
    "b1-h128-p64-L65536": {"per20": {"per_tiles": 20}},
    # 8 x 8 tiles (128 CTAs): 16 x 4 in two waves, ~40 us against 32.4 (falsifier of the 2 tiles
    # a CTA's fixed cost)
    "b16-h16-p64-L4096": {"per4": {"per_tiles": 4}, "worklist": {"worklist": True}},
    # 4 x 16 tiles x 2 head blocks: 8 x 8 in two waves, ~54 us against 49.0 (the same at 64 rows)
    "b16-h128-p64-L4096": {"per8": {"per_tiles": 8}, "worklist": {"worklist": True}},
}


def run_plan(form: dict[str, int | bool], inputs: Inputs, out):
    """Ours under launch.plan_form(**form): the same kernels on another plan."""
    from forgekernel.kernels.attention.mla.sm90.launch import plan_form

    with plan_form(**form):  # a plan form on the call without a schedule
        return run_ours(inputs, out, plain=True)


def run_no_pdl(inputs: Inputs, out):
    """Ours with its kernels built and launched without programmatic dependent launch
    (runtime/pdl.py `off`): ours / this time is what PDL saves (MLA_NOTES.md, "Programmatic
    dependent launch")."""
    with pdl.off():
        return run_ours(inputs, out)


# The latency-bound cases timed without PDL (variant `no_pdl`; its kernels: sm90.no_pdl_params):
# one sequence of 4k keys at 16 and 128 heads, 16 of them at 16 heads (pass + combine each)
NO_PDL_CASES = ("b1-h16-p64-L4096", "b1-h128-p64-L4096", "b16-h16-p64-L4096")

# The call without a schedule (variant `plain`: the width plan, what a caller that makes no
# schedule gets): the 13:45 run put the scheduled call at 0.399x of its time on the ragged batch,
# 0.831x on the mixed one, 1.007x on uniform b16 x 4k; the wide-table b1 case (MLA_NOTES)
PLAIN_CASES = ("b32-h16-p64-ragged", "b48-h16-p64-mixed", "b16-h16-p64-L4096",
               "b1-h16-p64-L16384")  # fmt: skip


def run_plain(inputs: Inputs, out):
    """Ours without the step's schedule (the width plan)."""
    return run_ours(inputs, out, plain=True)


# The cases whose combine the rule moved from the warp form to the CTA form's few-splits path
# (combine_form.FEW_FORM_UNITS at D 512: 1024-4095 rows x heads; 2026-12-04 next/mla-combine3),
# timed with the warp form (variant `combine_warps`): combine_cta / ours was 0.973 at b64-h16,
# 0.996 / 0.995 at b16-h128 (20:21, before the few path's loads went out beside the LSE's).
# Predicted (time / ours): 1.02-1.05 at b64-h16 x 4k and MTP 2, 1.00-1.02 at b16-h128.
COMBINE_CASES = ("b16-h128-p64-L4096", "b16-h128-p64-L8192", "b64-h16-p64-L4096",
                 "b64-h16-p64-L4096-sq2")  # fmt: skip


def run_combine_warps(inputs: Inputs, out):
    """Ours with the combine's warp form where the rule takes the CTA form."""
    from forgekernel.kernels.attention.paged.sm90.combine_form import combine_form

    with combine_form("warps"):
        return run_ours(inputs, out)


# FlashInfer-Bench's page-1 cases, which the seesaw pass's `gather` form serves since its adoption
# (launch.GATHER_PAGES; MLA_NOTES.md, "gather adopted"), timed on the plan before (variant `was`,
# launch.plan_form(gather=False): decode.py's role-split pass). H100 2026-12-05 16:44, gather /
# was: 0.959 at b64-h16, 0.640 at b16-h128; the next bench's was / ours must read >= ~1.04 and
# ~1.56 (the build without the proxy fences, 0.995 / 0.983 of gather there, was dropped)
GATHER_CASES = ("b64-h16-p1-L4096-split", "b16-h128-p1-L4096-split")


def variants(case: Case) -> dict[str, Any]:
    """The launcher-only plan candidates of `case` (CANDIDATES, on the plain call), the `plain`
    call (PLAIN_CASES), NO_PDL_CASES' kernels without PDL (`run_no_pdl`) and COMBINE_CASES'
    combine in its warp form (`run_combine_warps`), GATHER_CASES on decode.py's pass (`was`,
    the plan before the gather form's adoption): variant time / our time decides their
    adoption (`was`: whether the adoption holds). (Measured and dropped: the `pair` form,
    2.4-8.8% slower on every 128-head case, 2026-12-03 16:40; the gather form without its proxy
    fences, a tie, 2026-12-05 16:44; the `ostore` store, a variant until 14:25, is the standard:
    MLA_NOTES.md.)"""
    forms = CANDIDATES.get(case.name, {})
    found = {name: functools.partial(run_plan, form) for name, form in forms.items()}
    if case.name in PLAIN_CASES:
        found["plain"] = run_plain
    if case.name in NO_PDL_CASES:
        found["no_pdl"] = run_no_pdl
    if case.name in COMBINE_CASES:
        found["combine_warps"] = run_combine_warps
    if case.name in GATHER_CASES:
        found["was"] = functools.partial(run_plan, {"gather": False})
    return found


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
        variants=variants,
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
