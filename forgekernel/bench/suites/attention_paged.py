"""Paged GQA attention suite (issue 18): decode, speculative decoding and chunked prefill
against a paged KV cache (vLLM / FlashAttention layout), outputs (o, lse natural log).

Modes, as serving engines send them (`lens`: each sequence's KV length, its new tokens
included):
- decode: one query token a sequence, q (batch, Hq, D);
- packed (params `q_lens`: each sequence's query tokens, q (total_q, Hq, D) with cu_seqlens_q /
  max_seqlen_q, the queries a sequence's last tokens, causal bottom-right): group "spec", 2-4
  tokens a sequence (speculative decoding / MTP verification: the paged kernel's packed form),
  and group "prefill", vLLM / SGLang chunked-prefill batches (chunks of 512-4096 new tokens over
  0-16k cached ones, one-token decode rows beside them, a sequence without new tokens):
  more than 4 tokens route the whole batch to the attention forward's paged mode (16-bit
  caches, pages of 8 rows or more: kernels/attention/fwd/sm90, page_box), else (FP8 caches,
  page 1) through the page gather + varlen forward (ops/attention_paged._prefill_by_gather).

FLOPs: 4 x Hq x D per visible (query, key) pair, query i of s_q seeing kv_len - s_q + i + 1
keys (attention suite's `causal_pairs`; kv_len per decode row). GB/s: the K and V rows read once
(2 x tokens x Hkv x D x bytes per element: the query dtype's for a 16-bit cache, 1 for an FP8
one), plus for packed batches the query rows read and output rows written (at one token a
sequence those are under 0.2% of the cache's bytes, and the decode cases leave them out).

Ours: `forgekernel.attention_paged`; decode cases on 16-bit caches with the decode step's
schedule (`forgekernel.attention_paged_schedule`), made on the input set's first call as the
comparators plan (`_schedule`; since 2026-12-04 16:07, variant `plain` the call without it).

Comparators, planned once per input set outside any timing (their first call on it):
- flashinfer: FlashInfer 0.7.2.post1's BatchDecodeWithPagedKVCacheWrapper on decode cases (fa2
  backend, tensor cores: 4.1 TB/s at B64 L4096 on the H200) and BatchPrefillWithPagedKVCache-
  Wrapper(backend="fa2") on packed ones, the same JIT module (decode.py plans the tensor-core
  decode with get_batch_prefill_module("fa2", ...), as prefill.py does);
- flashinfer_fa3: BatchPrefillWithPagedKVCacheWrapper(backend="fa3") on packed cases, what
  backend="auto" runs on the H200 (utils.determine_attention_backend: fa3 on sm90 for 16-bit
  q / kv, D 64 / 128 / 256); decode cases are the decode wrapper's (its fa3 backend ran 4.2x
  slower than fa2 at B64 L4096: ../shared/anchors).
- flashinfer_cc: the decode wrapper without tensor cores (fa2's CUDA-core decode kernel, 2.8 TB/s
  at B64 L4096 on the H200 against 4.1 with them: ../shared/anchors), the issue's "plain fa2
  kernel", on 16-bit D 128 decode cases only (`_flashinfer_cc`: one more JIT module, 13.5 s).
- fa4: FlashAttention-4's `flash_attn_varlen_func` with `page_table` / `seqused_k` on every
  16-bit case (decode cases as one query token a sequence; FP8 caches missing: FA4 reads FP8 on
  SM100 only; `fa4_args`, the notes above `_fa4`).
FlashInfer compiles each module with nvcc on first use (13-90 s each), inside that first call
(FA4 its CuTe DSL kernels, one per head dim / GQA group / TMA-or-gather pages).
Its causal mask is bottom-right aligned as ours, read in the wheel (flashinfer/data/include/
flashinfer/attention/): the fa2 kernel masks `kv_idx + qo_len > kv_len + q_idx` (prefill.cuh,
logits_mask), the fa3 one keeps the columns below `qo_idx + 1 + kv_len - qo_len`
(hopper/mainloop_mma.cuh, col_limit_right), and the wrapper's docstring example (flashinfer/
prefill.py, BatchPrefillWithPagedKVCacheWrapper; docs.flashinfer.ai/api/prefill.html) equates
causal=True with the custom mask tril(ones(qo_len, kv_len), diagonal=kv_len - qo_len). Both
schedulers give a sequence without query tokens no work (scheduler.cuh: ceil_div(packed_qo_len,
tile) = 0 query tiles).

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
import itertools
import math
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites.attention import causal_pairs
from forgekernel.kernels.attention.fwd.sm90 import SPEC as FWD_SPEC
from forgekernel.kernels.attention.paged.sm90 import SPEC
from forgekernel.reference.flashinfer_paged import page_table_to_csr
from forgekernel.runtime import pdl

FP8 = "float8_e4m3fn"
SCALES = ("tensor", "head")  # an FP8 cache's scale granularity: per tensor, per KV head
FP8_SPREAD = 64.0  # std of the cached e4m3 values (module docstring)
FP8_MAX = 448.0  # e4m3fn's largest finite value


def _per_sequence(x, b: int, what: str) -> tuple[int, ...]:
    """x as one int per sequence (an int: the same for all b)."""
    x = tuple(x) if isinstance(x, (list, tuple)) else (x,) * b
    if len(x) != b:
        raise ValueError(f"{what}: {len(x)} values for a batch of {b}")
    return x


def _case(b, hq, hkv, d, page, lens, *, q_lens=None, group: str = "", tag: str = "",
          fp8: str = "", width: int = 0) -> Case:  # fmt: skip
    """lens: KV lengths, new tokens included. q_lens: None (decode: one query token a
    sequence) or each sequence's query tokens (the packed form, cu_seqlens_q). fp8: "" (a cache
    in q's dtype) or the FP8 cache's scale granularity (SCALES). width: the tokens the page
    table holds (0: the longest sequence's pages), as a serving engine's captured graph sizes
    it for its longest context; entries past a sequence's pages are page 0."""
    lens = _per_sequence(lens, b, "lens")
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    name = f"b{b}-hq{hq}-hkv{hkv}-d{d}-p{page}-{shape}"
    params = {"b": b, "hq": hq, "hkv": hkv, "d": d, "page": page, "lens": lens}
    if q_lens is not None:
        q_lens = _per_sequence(q_lens, b, "q_lens")
        name += f"-sq{q_lens[0]}" if len(set(q_lens)) == 1 else f"-q{sum(q_lens)}"
        params["q_lens"] = q_lens
    if fp8:
        if fp8 not in SCALES:
            raise ValueError(f"fp8 scales are one of {SCALES}, got {fp8!r}")
        name += f"-kv_e4m3-per_{fp8}"
        params |= {"kv": FP8, "scale": fp8}
    if width:
        name += f"-w{width}"
        params["width"] = width
    return Case(name, params, group)


def _prefill_case(hq, hkv, page, chunks, cached, decode_lens, tag: str) -> Case:
    """A chunked-prefill batch (D 128) as vLLM schedules one: decode rows first (one new token
    each, KV lengths `decode_lens`), then sequences of chunks[i] new tokens over cached[i]."""
    q_lens = (1,) * len(decode_lens) + tuple(chunks)
    lens = tuple(decode_lens) + tuple(c + n for c, n in zip(chunks, cached))
    return _case(len(q_lens), hq, hkv, 128, page, lens, q_lens=q_lens, group="prefill", tag=tag)


MIXED = tuple(range(100, 48 * 170, 170))  # 48 KV lengths, 100 .. 8090: a server's decode batch


def _tailed_lens(n: int, median: int, sigma: float, seed: int) -> tuple[int, ...]:
    """n KV lengths drawn log-normal around `median` (a fixed draw, 16 .. 65536): a serving
    batch's long tail, where one long sequence holds a fifth of the keys."""
    gen = torch.Generator().manual_seed(seed)
    draw = torch.exp(torch.randn(n, generator=gen) * sigma + math.log(median))
    return tuple(draw.round().clamp(16, 65536).int().tolist())


# 64 lengths, 66 .. 55661 (median ~1.3k, 291k keys): the ragged batch issue 18's bar names, long-
# tailed as real traffic is (MIXED is a linear ramp)
TAILED = _tailed_lens(64, 1500, 1.3, seed=5)
# Llama-3 8B (32 / 8 heads, D 128) over page 16 at the batch x length points; the
# long-sequence, small-batch corner where split-KV matters; Llama-3 70B per GPU (64 / 8 at
# tp 1, 8 / 1 at tp 8); D 64 / 256; pages 1 and 64; mixed lengths as a server batch has them.
DECODE_BENCH_CASES = (
    _case(64, 32, 8, 128, 16, 4096, group="llama3-8b"),
    _case(1, 32, 8, 128, 16, 16384, group="long"),
    _case(1, 32, 8, 128, 16, 65536, group="long"),
    _case(4, 32, 8, 128, 16, 32768, group="long"),
    _case(16, 32, 8, 128, 16, 8192, group="llama3-8b"),
    _case(128, 32, 8, 128, 16, 1024, group="llama3-8b"),
    # the batch 256 (FlashInfer fa2 tc 3.89 TB/s, FA4 3.34 at B256 L1024: anchors) and
    # its shortest KV length, 512, where the plan's split and the combine weigh most
    _case(256, 32, 8, 128, 16, 1024, group="llama3-8b"),
    _case(128, 32, 8, 128, 16, 512, group="llama3-8b"),
    _case(32, 64, 8, 128, 16, 4096, group="llama3-70b"),
    _case(64, 8, 1, 128, 16, 4096, group="llama3-70b"),
    _case(64, 32, 4, 128, 16, 4096, group="llama3-70b"),  # tp 2: GQA 8 at page 16
    _case(32, 32, 4, 128, 1, 2048, group="page"),
    _case(32, 32, 8, 128, 64, 4096, group="page"),
    _case(32, 16, 16, 64, 16, 4096, group="head-dim"),
    _case(16, 16, 2, 256, 64, 4096, group="head-dim"),
    _case(48, 32, 8, 128, 16, MIXED, group="mixed", tag="mixed"),
    _case(64, 32, 8, 128, 16, TAILED, group="mixed", tag="tailed"),
    # a decode step as a serving engine's captured graph sends it: the table 128k tokens wide
    _case(8, 32, 8, 128, 16, 4096, group="serving", width=131072),
    _case(32, 32, 8, 128, 16, MIXED[:32], group="serving", tag="mixed", width=131072),
    # FP8 (e4m3) caches as serving engines run them: Llama-3 8B b64 x 4k and b1 x 32k, Llama-3
    # 70B at tp 1 (GQA 8), per-tensor scales (FlashInfer's form); per-head scales ours only.
    _case(64, 32, 8, 128, 16, 4096, group="fp8", fp8="tensor"),
    _case(1, 32, 8, 128, 16, 32768, group="fp8", fp8="tensor"),
    _case(32, 64, 8, 128, 16, 4096, group="fp8", fp8="tensor"),
    _case(64, 32, 8, 128, 16, 4096, group="fp8", fp8="head"),
)
# Speculative decoding / MTP verification (2-4 query tokens a sequence: the paged kernel's
# packed form): Llama-3 8B at batch 32-64 x 2k-8k keys, Llama-3 70B at tp 1 (64 / 8 heads: at 4
# tokens 32 rows, one CTA of two row blocks a KV head; with 16 rows two CTAs each), and a batch
# verifying 1-4 tokens a sequence over the mixed decode lengths.
SPEC_BENCH_CASES = (
    _case(64, 32, 8, 128, 16, 4096, q_lens=2, group="spec"),
    _case(64, 32, 8, 128, 16, 4096, q_lens=4, group="spec"),
    _case(32, 32, 8, 128, 16, 8192, q_lens=2, group="spec"),
    _case(64, 32, 8, 128, 16, 2048, q_lens=4, group="spec"),
    _case(32, 64, 8, 128, 16, 4096, q_lens=2, group="spec"),
    _case(32, 64, 8, 128, 16, 4096, q_lens=4, group="spec"),
    _case(48, 32, 8, 128, 16, MIXED, q_lens=(1, 2, 3, 4) * 12, group="spec", tag="mixed"),
)
# Chunked prefill as vLLM / SGLang batch it (decode rows beside the chunks, KV lengths including
# the new tokens): a 2048-token chunk of a 16k prompt beside 32 decode rows; four chunks of
# 512-4096 tokens over 0-12k cached beside 16 decode rows, at pages 16 and 64; Llama-3 70B (64 /
# 8) with a fresh 4k prompt and a 1k chunk over 16k beside 64 decode rows; a ragged batch (odd
# chunks, a sequence with no new tokens, a fresh prompt, partial last pages).
CHUNKS, CACHED = (512, 1024, 2048, 4096), (0, 4096, 8192, 12288)
RAGGED_LENS, RAGGED_Q = (8000, 5000, 333, 3048, 12345, 3001, 78), (1000, 0, 333, 2049, 1, 1, 1)
PREFILL_BENCH_CASES = (
    _prefill_case(32, 8, 16, (2048,), (14336,), range(1000, 8040, 220), "c2048of16k+32dec"),
    _prefill_case(32, 8, 16, CHUNKS, CACHED, range(2000, 8400, 400), "c512-4096+16dec"),
    _prefill_case(32, 8, 64, CHUNKS, CACHED, range(2000, 8400, 400), "c512-4096+16dec"),
    _prefill_case(64, 8, 16, (4096, 1024), (0, 16384), range(2048, 6144, 64), "c1024-4096+64dec"),
    _case(7, 32, 8, 128, 64, RAGGED_LENS, q_lens=RAGGED_Q, group="prefill", tag="ragged"),
)
BENCH_CASES = DECODE_BENCH_CASES + SPEC_BENCH_CASES + PREFILL_BENCH_CASES
FP8_CHECK_CASES = (
    _case(3, 8, 2, 128, 16, (37, 0, 300), fp8="tensor"),
    _case(2, 24, 8, 64, 32, (77, 700), fp8="head"),
)
# The packed form, small and odd: GQA 4 / 3 / 8 / 1 / 2, D 64 / 128 / 256, pages 1 / 16 / 32 / 64,
# KV lengths off the tiles; sequences without queries, rows that see no key (2 queries over an
# empty cache: O = 0, LSE = -inf), queries beyond the paged kernel's 4 (the forward's paged mode;
# the gather + varlen path for the FP8 cache at page 1)
# mixed with one-token rows, a fresh prompt (queries = keys), FP8 caches per head and per tensor.
SPEC_CHECK_CASES = (
    _case(4, 8, 2, 64, 16, (40, 3, 700, 130), q_lens=(1, 3, 2, 4)),
    _case(4, 12, 4, 128, 1, (5, 0, 70, 33), q_lens=(2, 2, 0, 3)),
    _case(2, 16, 2, 256, 64, (129, 2048), q_lens=4),
    _case(3, 32, 8, 128, 16, (37, 300, 4), q_lens=(3, 1, 4), fp8="head"),
    # 32 rows a CTA (GQA 8 x 4 tokens at D 128: two row blocks, the warps' O merged over K's
    # and V's buffers), a sequence without keys
    _case(3, 32, 4, 128, 16, (33, 0, 700), q_lens=(4, 2, 3)),
)
PREFILL_CHECK_CASES = (
    _case(4, 8, 2, 128, 16, (300, 17, 77, 1000), q_lens=(100, 1, 0, 513)),
    _case(3, 16, 16, 64, 64, (77, 700, 9), q_lens=(77, 5, 9)),
    _case(2, 8, 4, 256, 32, (640, 33), q_lens=(128, 33)),
    _case(3, 8, 2, 64, 1, (300, 40, 5), q_lens=(200, 1, 5), fp8="tensor"),
)
CHECK_CASES = (
    _case(3, 8, 2, 64, 16, (37, 0, 100)),
    _case(2, 12, 4, 128, 1, (5, 70)),
    _case(1, 16, 2, 256, 64, (300,)),
    _case(2, 24, 8, 128, 32, (77, 700)),
    _case(4, 32, 8, 128, 16, (1, 17, 3000, 0)),
    _case(4, 32, 8, 128, 16, (700, 0, 3000, 129), width=65536),  # each over the width's splits
    *FP8_CHECK_CASES,
    *SPEC_CHECK_CASES,
    *PREFILL_CHECK_CASES,
)
# every kernel variant under the sanitizers: the 16-bit partial at D 64 / 128 / 256 (and over a
# wide table's splits), the FP8 one,
# the packed one at 4 query tokens (page 1, a sequence without queries, rows that see no key)
# and at 32 rows a CTA (the merge over K's and V's buffers), the forward's paged mode at D 128 /
# page 16 (a sequence without queries, a decode row, a partial last page) and D 256 / page 32
SANITIZE_CASES = (
    *CHECK_CASES[:3],
    CHECK_CASES[5],  # a 65536-token table
    FP8_CHECK_CASES[0],
    SPEC_CHECK_CASES[1],
    SPEC_CHECK_CASES[4],
    PREFILL_CHECK_CASES[0],
    PREFILL_CHECK_CASES[2],
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    """q in `dtype` ((batch, Hq, D), or (total_q, Hq, D) with cu_seqlens_q / max_seqlen_q for a
    packed case); the cache in `dtype`, or FP8 with its scales (k_scale / v_scale: None for a
    16-bit cache)."""
    p = case.params
    b, ps, lens = p["b"], p["page"], p["lens"]
    max_pages = max(1, max(-(-n // ps) for n in lens))
    pages = b * max_pages + 7
    shape = (pages, ps, p["hkv"], p["d"])
    k = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    v = torch.randn(shape, dtype=dtype, device=device, generator=gen)
    perm = torch.randperm(pages, device=device, generator=gen)[: b * max_pages]
    q_lens = p.get("q_lens")
    rows = b if q_lens is None else sum(q_lens)
    q = torch.randn(rows, p["hq"], p["d"], dtype=dtype, device=device, generator=gen)
    table = perm.view(b, max_pages).to(torch.int32)
    if p.get("width"):  # a serving graph's table: the context's width, page 0 past the pages
        wide = torch.zeros(b, -(-p["width"] // ps), dtype=torch.int32, device=device)
        wide[:, :max_pages] = table
        table = wide
    seq = torch.tensor(lens, dtype=torch.int32, device=device)
    inputs = {"q": q, "k": k, "v": v, "table": table, "seqlens": seq}
    if q_lens is not None:
        cu = torch.tensor([0, *itertools.accumulate(q_lens)], dtype=torch.int32, device=device)
        inputs |= {"cu_seqlens_q": cu, "max_seqlen_q": max(1, *q_lens)}
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


def _packed(inputs: Inputs) -> dict[str, Any]:
    """The packed form's arguments (empty for decode)."""
    if "cu_seqlens_q" not in inputs:
        return {}
    return {"cu_seqlens_q": inputs["cu_seqlens_q"], "max_seqlen_q": inputs["max_seqlen_q"]}


def alloc_out(inputs: Inputs):
    """(out like q, lse fp32): (batch, Hq) for decode, (Hq, total_q) packed (OPS.md)."""
    q = inputs["q"]
    rows, hq = q.shape[0], q.shape[1]
    lse = (hq, rows) if _packed(inputs) else (rows, hq)
    return torch.empty_like(q), q.new_empty(lse, dtype=torch.float32)


def _run(inputs: Inputs, out, k_scale, v_scale, schedule=None):
    op = importlib.import_module("forgekernel.ops.attention_paged")
    o, lse = (None, None) if out is None else out
    res = op.attention_paged(
        inputs["q"], inputs["k"], inputs["v"], inputs["table"], inputs["seqlens"],
        return_lse=True, out=o, lse=lse, k_scale=k_scale, v_scale=v_scale, schedule=schedule,
        **_packed(inputs),
    )  # fmt: skip
    return res if out is None else out


def _schedule(inputs: Inputs):
    """The input set's decode step schedule (`forgekernel.attention_paged_schedule`) for a
    decode case on a 16-bit cache, made on the set's first call (the warm-up, outside every
    timed region) as a server makes it once a step for all its layers and as the FlashInfer
    column plans; None for the forms a schedule does not serve (packed queries, FP8 caches)."""
    q, k = inputs["q"], inputs["k"]
    if _packed(inputs) or k.dtype == torch.float8_e4m3fn:
        return None
    if "schedule" not in inputs:
        op = importlib.import_module("forgekernel.ops.attention_paged")
        inputs["schedule"] = op.attention_paged_schedule(
            inputs["seqlens"], inputs["table"], num_heads=q.shape[1], num_kv_heads=k.shape[-2],
            head_dim=q.shape[-1], page_size=k.shape[-3], dtype=q.dtype,
        )  # fmt: skip
    return inputs["schedule"]


def run_ours(inputs: Inputs, out, plain: bool = False):
    """The op as a caller uses it: an FP8 cache's per-tensor scales as python floats, a decode
    step on a 16-bit cache with the step's schedule (`_schedule`; PAGED_NOTES.md, "A decode
    step's schedule"); plain: the call without one (the width plan's splits)."""
    schedule = None if plain else _schedule(inputs)
    return _run(inputs, out, inputs["k_scale"], inputs["v_scale"], schedule)


def _run_scale_tensors(inputs: Inputs, out):
    """The same per-tensor scales handed over as prebuilt fp32 (Hkv,) tensors: the op then
    fills no scale tensors per call (ours / this time: what the float form costs)."""
    return _run(inputs, out, inputs["k_scale_heads"], inputs["v_scale_heads"])


def _run_merge_elems(inputs: Inputs, out):
    """The launch the op makes on a packed (speculative) case, its partial pass the build with
    the per-element merge (launch.merge_params "": `combine.write_split`), the spec leaves'
    standard before merge "rows" (which ran in 0.969-0.991 of its time, graph, 2026-12-04
    04:39: docs/attention/PAGED_NOTES.md); the suite's inputs are valid, out (o, lse (Hq,
    total_q)) written in place."""
    from forgekernel.kernels.attention.paged.sm90 import launch

    o, lse = out if out is not None else alloc_out(inputs)
    q = inputs["q"]
    launch.paged_decode(
        q, inputs["k"], inputs["v"], inputs["table"], inputs["seqlens"], q.shape[-1] ** -0.5, o,
        lse.t(), cu_seqlens_q=inputs["cu_seqlens_q"], max_seqlen_q=inputs["max_seqlen_q"],
        merge="",
    )  # fmt: skip
    return o, lse


def _run_no_pdl(inputs: Inputs, out):
    """The op with its kernels built and launched without programmatic dependent launch
    (runtime/pdl.py `off`: the pass no longer starts under the previous kernel's tail, nor the
    combine under the pass's): ours / this time is what PDL saves (PAGED_NOTES.md,
    "Programmatic dependent launch")."""
    with pdl.off():
        return run_ours(inputs, out)


# The latency-bound cases timed without PDL (variant `no_pdl`; its kernels: sm90.no_pdl_params):
# one sequence of 16k / 64k keys (pass + combine), and b64 x 4k (one split: the pass alone)
NO_PDL_CASES = (
    "b1-hq32-hkv8-d128-p16-L16384",
    "b1-hq32-hkv8-d128-p16-L65536",
    "b64-hq32-hkv8-d128-p16-L4096",
)


def _run_serial_ramp(inputs: Inputs, out):
    """Ours with the pass and CTA combine built as before 2026-12-04 20:40 (launch.serial_ramp:
    the page ids read after the sequence length, tile by tile; the combine's partial rows
    loaded after its reductions): this time / ours is what the early reads save."""
    from forgekernel.kernels.attention.paged.sm90 import launch

    with launch.serial_ramp():
        return run_ours(inputs, out)


# The small-batch cases timed with the serial ramp (variant `serial_ramp`; its kernels:
# sm90.serial_ramp_params): b1 x 16k / 64k (pass + combine of 30 splits, the width plan), b4 x
# 32k (8 splits, the step's schedule), b64 x 4k (one item a sequence: the pass alone)
SERIAL_RAMP_CASES = (
    "b1-hq32-hkv8-d128-p16-L16384",
    "b1-hq32-hkv8-d128-p16-L65536",
    "b4-hq32-hkv8-d128-p16-L32768",
    "b64-hq32-hkv8-d128-p16-L4096",
)


def _run_plain(inputs: Inputs, out):
    """Ours without the step's schedule (the width plan's splits, what a caller that makes no
    schedule gets): this time / ours is what the schedule saves."""
    return run_ours(inputs, out, plain=True)


# The decode cases also timed without the schedule (variant `plain`). 15:45 (the schedule then
# a variant, time / the plain call): the serving mixed batch behind a 128k-token table 0.742,
# the mixed batch 0.921, b64 x 4k 1.028 (the combine the width plan's one split needs not),
# b8 x 4k behind the 128k table 1.046, b1 x 16k / 64k 1.106 / 1.004 (one sequence: the
# schedule now takes no list, launch.schedule_shapes). Beside them one case of each other
# decode group: what the schedule costs where the width plan's splits were already even.
PLAIN_CASES = (
    "b48-hq32-hkv8-d128-p16-mixed",
    "b8-hq32-hkv8-d128-p16-L4096-w131072",
    "b32-hq32-hkv8-d128-p16-mixed-w131072",
    "b64-hq32-hkv8-d128-p16-L4096",
    "b4-hq32-hkv8-d128-p16-L32768",
    "b32-hq64-hkv8-d128-p16-L4096",
    "b32-hq32-hkv4-d128-p1-L2048",
    "b16-hq16-hkv2-d256-p64-L4096",
)


def _run_split(inputs: Inputs, out):
    """The op on a chunked-prefill batch in its split form (`prefill_form("split")`: the decode
    kernel on the decode rows, then the forward's paged mode on the chunks) instead of the
    default packed form (the whole batch in one launch on GQA-packed views): this time / ours
    is what the packed form saves (H200 2026-12-04 20:10, packed / split on the five cases:
    0.907-1.013 graph, median 0.965)."""
    op = importlib.import_module("forgekernel.ops.attention_paged")
    with op.prefill_form("split"):
        return run_ours(inputs, out)


def variants(case: Case) -> dict[str, Any]:
    """FP8 per-tensor cases: the scales as tensors; spec cases (16-bit caches, 2-4 query tokens
    a sequence): the previous merge (`_run_merge_elems`); prefill cases on 16-bit caches: the
    split form (`_run_split`); NO_PDL_CASES:
    the kernels without PDL (`_run_no_pdl`); PLAIN_CASES: the op without the step's schedule
    (`_run_plain`); SERIAL_RAMP_CASES: the serial ramp (`_run_serial_ramp`)."""
    if case.params.get("scale") == "tensor":
        return {"scales_as_tensors": _run_scale_tensors}
    if case.group == "spec" and "kv" not in case.params:
        return {"merge_elems": _run_merge_elems}
    if case.group == "prefill" and "kv" not in case.params:
        return {"split": _run_split}
    found = {}
    if case.name in NO_PDL_CASES:
        found["no_pdl"] = _run_no_pdl
    if case.name in PLAIN_CASES:
        found["plain"] = _run_plain
    if case.name in SERIAL_RAMP_CASES:
        found["serial_ramp"] = _run_serial_ramp
    return found


def reference(inputs: Inputs):
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"],
                               cu_seqlens_q=i.get("cu_seqlens_q"), k_scale=i["k_scale"],
                               v_scale=i["v_scale"])  # fmt: skip


def low_precision(inputs: Inputs):
    """PyTorch in q's dtype; an FP8 cache dequantized into it first (K x k_scale rounded to
    16 bits), the computation a 16-bit kernel on a dequantized cache would do."""
    from forgekernel.reference.paged_attention import paged_attention_ref

    i = inputs
    return paged_attention_ref(i["q"], i["k"], i["v"], i["table"], i["seqlens"],
                               cu_seqlens_q=i.get("cu_seqlens_q"), k_scale=i["k_scale"],
                               v_scale=i["v_scale"], upcast=False)  # fmt: skip


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
#   BatchPrefillWithPagedKVCacheWrapper.run (prefill.py) does the same with both scales.
# So one scale per tensor: a (Hkv,) tensor would make sm_scale a tensor and broadcast
# `out *= v_scale` over D, not over the KV heads. A per-head case is reported missing. fa3 reads
# an FP8 cache only beside an FP8 q (utils.is_fa3_backend_supported).
FLASHINFER_PER_HEAD = (
    "FlashInfer 0.7.2.post1's decode and prefill wrappers take one k_scale / v_scale per tensor "
    "(floats: k_scale folded into sm_scale, out *= v_scale), not per KV head"
)
FA3_DECODE = (
    "decode cases: FlashInfer's decode wrapper (the flashinfer column); its fa3 backend ran 4.2x "
    "slower than fa2 at B64 L4096 on the H200 (../shared/anchors, 2026-12-01)"
)
FA3_FP8 = "FlashInfer 0.7.2.post1's fa3 backend reads an FP8 cache only with FP8 queries"
WORKSPACE_BYTES = 256 << 20  # FlashInfer's float workspace (its docs: 128 MB recommended)


def _scales(inputs: Inputs) -> tuple[float | None, float | None]:
    """The per-tensor k_scale / v_scale FlashInfer takes (NotImplementedError per head)."""
    ks, vs = inputs["k_scale"], inputs["v_scale"]
    if isinstance(ks, torch.Tensor) or isinstance(vs, torch.Tensor):
        raise NotImplementedError(FLASHINFER_PER_HEAD)
    return ks, vs


def _csr(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    """FlashInfer's page lists of the inputs (kv_indptr, kv_indices, kv_last_page_len)."""
    return page_table_to_csr(inputs["table"], inputs["seqlens"], inputs["k"].shape[1])


def _plan_decode(flashinfer, inputs: Inputs, tensor_cores: bool = True) -> tuple:
    """The decode wrapper (fa2; tensor cores or its CUDA-core kernel) planned for the inputs,
    with its workspace."""
    q, k = inputs["q"], inputs["k"]
    ps, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        ws, "NHD", use_tensor_cores=tensor_cores, backend="fa2"
    )
    w.plan(*_csr(inputs), q.shape[1], hkv, d, ps, q_data_type=q.dtype, kv_data_type=k.dtype)
    return w, ws


def _plan_prefill(flashinfer, inputs: Inputs, backend: str) -> tuple:
    """The prefill wrapper planned for the packed inputs (qo_indptr = cu_seqlens_q, causal:
    bottom-right as ours), with its workspace and the out / LSE it writes (allocated here, so
    that the timed call allocates and zero-fills nothing)."""
    q, k = inputs["q"], inputs["k"]
    ps, hkv, d = k.shape[1], k.shape[2], k.shape[3]
    ws = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=q.device)
    w = flashinfer.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", backend=backend)
    w.plan(inputs["cu_seqlens_q"], *_csr(inputs), q.shape[1], hkv, d, ps, causal=True,
           q_data_type=q.dtype, kv_data_type=k.dtype)  # fmt: skip
    lse = torch.empty(q.shape[0], q.shape[1], dtype=torch.float32, device=q.device)
    return w, ws, torch.empty_like(q), lse


def _run_prefill(state: tuple, inputs: Inputs, ks, vs):
    """(out (total_q, Hq, D), lse (total_q, Hq) base 2): FlashInfer's layout and base."""
    w, _, out, lse = state
    return w.run(inputs["q"], (inputs["k"], inputs["v"]), k_scale=ks, v_scale=vs, out=out,
                 lse=lse, return_lse=True)  # fmt: skip


def _flashinfer():
    """Decode cases: the decode wrapper (fa2, tensor cores); packed ones: the prefill wrapper
    on the same fa2 module."""
    try:
        import flashinfer
    except ImportError:
        return None

    def run(inputs: Inputs):
        ks, vs = _scales(inputs)
        packed = bool(_packed(inputs))
        if "flashinfer" not in inputs:
            inputs["flashinfer"] = (
                _plan_prefill(flashinfer, inputs, "fa2")
                if packed
                else _plan_decode(flashinfer, inputs)
            )
        if packed:
            return _run_prefill(inputs["flashinfer"], inputs, ks, vs)
        w, _ = inputs["flashinfer"]
        return w.run(inputs["q"], (inputs["k"], inputs["v"]), k_scale=ks, v_scale=vs,
                     return_lse=True)  # fmt: skip

    return run


def _flashinfer_fa3():
    """Packed cases: the prefill wrapper's fa3 backend (backend="auto" on the H200)."""
    try:
        import flashinfer
    except ImportError:
        return None

    def run(inputs: Inputs):
        if not _packed(inputs):
            raise NotImplementedError(FA3_DECODE)
        if inputs["k"].dtype == torch.float8_e4m3fn:
            raise NotImplementedError(FA3_FP8)
        ks, vs = _scales(inputs)
        if "flashinfer_fa3" not in inputs:
            inputs["flashinfer_fa3"] = _plan_prefill(flashinfer, inputs, "fa3")
        return _run_prefill(inputs["flashinfer_fa3"], inputs, ks, vs)

    return run


CC_DECODE_ONLY = (
    "FlashInfer's CUDA-core decode (use_tensor_cores=False) runs on 16-bit D 128 decode cases "
    "only: other head dims and FP8 caches would each JIT-build one more module (13.5 s and up), "
    "and its tensor-core decode (the flashinfer column) ran 1.46x faster at B64 L4096"
)


def _flashinfer_cc():
    """Decode cases (16-bit caches, D 128): the decode wrapper's CUDA-core kernel."""
    try:
        import flashinfer
    except ImportError:
        return None

    def run(inputs: Inputs):
        q, k = inputs["q"], inputs["k"]
        if _packed(inputs) or k.dtype == torch.float8_e4m3fn or q.shape[-1] != 128:
            raise NotImplementedError(CC_DECODE_ONLY)
        if "flashinfer_cc" not in inputs:
            inputs["flashinfer_cc"] = _plan_decode(flashinfer, inputs, tensor_cores=False)
        w, _ = inputs["flashinfer_cc"]
        return w.run(q, (k, inputs["v"]), return_lse=True)

    return run


# FlashAttention-4 (flash-attn-4 4.0.0b36, flash_attn/cute/interface.py, read in the wheel):
# `flash_attn_varlen_func(q, k, v, cu_seqlens_q=, max_seqlen_q=, seqused_k=, page_table=, ...)`
# takes a paged cache (num_pages, page_size, Hkv, D) with an int32 (batch, max_pages) table
# (last dim contiguous) and no cu_seqlens_k; max_seqlen_k defaults to the table's width x page
# size. On sm90 (FlashAttentionForwardSm90) any page size: pages of exactly the key tile (128
# rows at D 128, 80 at D 256) load by TMA, others by cp.async row gathers (paged_kv.py,
# `paged_kv_non_tma = page_size not in (None, tile_n)`); its causal mask is bottom-right as
# ours. It refuses FP8 on sm90 ("FP8 is only supported on SM100") and split-KV on sm90
# ("SplitKV not supported on SM 9.0": num_splits stays 1, decode cases included, so a few long
# sequences run on few CTAs there: FA4's sm90 limit, not an input of ours).
FA4_FP8 = "FA4 (flash-attn-4 4.0.0b36) reads FP8 only on SM100; on sm90 a 16-bit cache only"


def fa4_args(inputs: Inputs) -> dict[str, Any]:
    """FA4's paged varlen arguments for the inputs, besides q, k, v: the packed form's
    cu_seqlens_q / max_seqlen_q (decode: one token a sequence, cu_seqlens_q = 0 .. batch),
    seqused_k the KV lengths, the page table as is, causal (bottom-right) at ours' scale."""
    q = inputs["q"]
    packed = _packed(inputs)
    if not packed:
        cu = torch.arange(q.shape[0] + 1, dtype=torch.int32, device=q.device)
        packed = {"cu_seqlens_q": cu, "max_seqlen_q": 1}
    return {**packed, "seqused_k": inputs["seqlens"], "page_table": inputs["table"],
            "causal": True, "softmax_scale": q.shape[-1] ** -0.5, "return_lse": True}  # fmt: skip


def _fa4():
    """FA4's paged varlen forward on every 16-bit case (decode as one token a sequence)."""
    try:
        from flash_attn.cute import flash_attn_varlen_func
    except Exception:
        return None

    def run(inputs: Inputs):
        if inputs["k"].dtype == torch.float8_e4m3fn:
            raise NotImplementedError(FA4_FP8)
        if "fa4" not in inputs:
            inputs["fa4"] = fa4_args(inputs)
        return flash_attn_varlen_func(inputs["q"], inputs["k"], inputs["v"], **inputs["fa4"])

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"flashinfer": None, "flashinfer_cc": None, "flashinfer_fa3": None, "fa4": None}
    return {"flashinfer": _flashinfer(), "flashinfer_cc": _flashinfer_cc(),
            "flashinfer_fa3": _flashinfer_fa3(), "fa4": _fa4()}  # fmt: skip


def _query_rows(case: Case) -> list[tuple[int, int]]:
    """(query tokens, KV length) per sequence; decode: one token each."""
    p = case.params
    return list(zip(p.get("q_lens") or (1,) * p["b"], p["lens"]))


def flops(case: Case) -> float:
    """4 x Hq x D per visible (query, key) pair, causal bottom-right (`causal_pairs`: query i
    of s_q sees kv_len - s_q + i + 1 keys, clamped to [0, kv_len]); decode: kv_len a row."""
    p = case.params
    return 4.0 * p["hq"] * p["d"] * sum(causal_pairs(sq, sk) for sq, sk in _query_rows(case))


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """K and V rows read (1 byte an element for an FP8 cache, else `dtype`'s size), plus for a
    packed case the query rows read and the output rows written (in `dtype`)."""
    p = case.params
    size = torch.empty((), dtype=dtype).element_size()
    per = 1 if p.get("kv") == FP8 else size
    kv = 2.0 * sum(p["lens"]) * p["hkv"] * p["d"] * per
    return kv + 2.0 * sum(p.get("q_lens", ())) * p["hq"] * p["d"] * size


def suite() -> OpSuite:
    return OpSuite(
        name="attention_paged",
        # the decode kernels, and the forward whose paged mode runs the prefill cases
        kernel_sources=tuple(dict.fromkeys((*SPEC.sources, *FWD_SPEC.sources))),
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
