"""DeepSeek sparse attention suite (DSA, issue 22; its first GPU check passed
2026-12-01): the sparse MLA forward, query token t against
the latent cache rows its top-k list names (slot page * page_size + offset, -1 padding),
outputs (out (tokens, H, 512), lse (tokens, H) natural log), reference.dsa's math.

Shapes: DeepSeek-V3.2 at TP8 (16 heads per GPU, FlashInfer-Bench's h16 definitions) and TP1
(128 heads), top-k 2048, softmax_scale DeepSeek-V3's (1 / sqrt(192) x mscale^2). Decode: `tokens`
sequences of `ctx` cached tokens each, one query token per sequence picking topk of its own
sequence's slots (the cache holds every sequence's pages, shuffled). Prefill-like (`prefill`):
the last `tokens` positions of one sequence of `ctx` tokens, token i choosing among the
positions it sees (causal, bottom-right). Selections are random, not scored: the kernel's cost
does not depend on which rows win. Inputs are FlashMLA's: q (tokens, H, 576) and the combined
cache (pages, page_size, 1, 576), ours reading their views in place; cache="split" cases hold
FlashInfer's separate ckv / kpe caches; cache="fp8" cases (group fp8 in the bench) FlashMLA's FP8
cache (pages, page_size, 1, 656), DeepSeek-V3.2's serving format (mla_decode.fp8_cache), with
bf16 queries whatever the dtype (the fp16 run of an FP8 check case is a second bf16 run); their
reference reads the latent as e4m3 x its scales. Padding: "end" (-1s after the valid entries, as a
sorted top-k leaves them) or "scattered" (anywhere in the row); a sequence of length 0 gives a
row of -1s (out 0, lse -inf).

Memory-bound at decode: GB/s counts the rows each token reads (its valid entries x 576 x 2
bytes, FP8 656; at 128 heads our kernel reads them once per 64-head block, at prefill tokens
share most rows and L2 serves them) plus q, out and the LSE. FLOPs: 2 x (576 + 512) per
(token, head, valid entry).

Comparator, set up by its first call on each input set (outside any timing, cached there):
FlashMLA's sparse prefill forward (`flash_mla_sparse_fwd`, sgl-flash-mla; bf16; it takes 64 or
128 heads on sm90, so 16 heads run zero-padded to 64, as vLLM and SGLang pad them; the combined
cache as its (slots, 1, 576) view, split caches concatenated once); in sgl-flash-mla 1.0.0 it
is SM100-only ("only supported on SM100f" on the H200). On FP8 cases: FlashMLA's sparse decode
(`flashmla_fp8_decode`: `flash_mla_with_kvcache(q (tokens, 1, H, 576), cache, None, None, 512,
meta, softmax_scale, is_fp8_kvcache=True, indices=(tokens, 1, topk), use_legacy=True)`, read
from the wheel: the legacy sm90 sparse decode, bf16 q of 64 or 128 heads (16 zero-padded), the
V3.2 656-byte cache, -1 the invalid index, topk a multiple of its 64-entry blocks (padded with
-1)), the only sm90 DSA kernel in sgl-flash-mla 1.0.0. FlashInfer's sparse MLA decode
(trtllm-gen) and cuDNN's DSA forward have no sm90 kernel.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites.mla_decode import fp8, fp8_cache
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90.config import FP8_ROW_BYTES

LATENT, ROPE = 512, 64
WIDTH = LATENT + ROPE
# DeepSeek-V3's: the un-absorbed 1 / sqrt(128 + 64) times the YaRN mscale^2 (mscale 0.1 ln 40 + 1)
SOFTMAX_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)
TOPK = 2048
FLASHMLA_HEADS = (64, 128)  # FlashMLA's sm90 sparse prefill and decode
FLASHMLA_TOPK_BLOCK = 64  # its sparse decode's top-k blocks


def _case(tokens, hq, page, lens, *, topk=TOPK, pad="end", cache="combined", prefill=False,
          group="", tag="") -> Case:  # fmt: skip
    """lens: per token, its sequence's length (decode), or one int: every token's (decode) or
    the one sequence's (prefill)."""
    if not prefill:
        lens = tuple(lens) if isinstance(lens, (list, tuple)) else (lens,) * tokens
    else:
        lens = (lens,)
    shape = tag or (f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}")
    form = ("-prefill" if prefill else "") + ("-scattered" if pad == "scattered" else "")
    name = f"t{tokens}-h{hq}-p{page}-k{topk}-{shape}{form}" + (
        "" if cache == "combined" else f"-{cache}"
    )
    params = {"tokens": tokens, "hq": hq, "page": page, "topk": topk, "lens": lens,
              "pad": pad, "cache": cache, "prefill": prefill}  # fmt: skip
    return Case(name, params, group)


def _tp(hq: int) -> str:
    return "tp8" if hq == 16 else "tp1"


# DeepSeek-V3.2 decode per GPU at TP8 (h16) and TP1 (h128): 1-128 sequences, 8k-128k cached
# tokens each, page size 64 (FlashMLA's) and 1 (FlashInfer-Bench's split caches); a chunked
# prefill of 1024 / 4096 tokens, and the prefill / training range at the backward's
# shapes (dsa_sparse_bwd): 4k-32k queries over 8k-64k keys, H 16 / 64 / 128, top-k 2048 and 512.
BENCH_CASES = (
    *(_case(t, 16, 64, n, group="tp8") for t in (1, 16, 64, 128) for n in (8192, 32768)),
    *(_case(t, 16, 64, 131072, group="tp8") for t in (1, 16)),
    _case(16, 16, 1, 8192, cache="split", group="page1"),
    _case(128, 16, 1, 8192, cache="split", group="page1"),
    _case(1, 128, 64, 32768, group="tp1"),
    _case(64, 128, 64, 8192, group="tp1"),
    _case(1024, 16, 64, 16384, prefill=True, group="prefill"),
    _case(4096, 16, 64, 32768, prefill=True, group="prefill"),
    _case(4096, 16, 64, 8192, topk=512, prefill=True, group="prefill"),
    _case(32768, 16, 64, 65536, prefill=True, group="prefill"),
    _case(4096, 64, 64, 16384, prefill=True, group="prefill"),
    _case(16384, 64, 64, 65536, topk=512, prefill=True, group="prefill"),
    _case(4096, 128, 64, 8192, prefill=True, group="prefill"),
    _case(8192, 128, 64, 65536, prefill=True, group="prefill"),
    # FlashMLA's FP8 cache (DeepSeek-V3.2 serving's): TP8 decode batches at 32k, TP1
    *(_case(t, 16, 64, 32768, cache="fp8", group="fp8") for t in (1, 16, 64, 128)),
    _case(64, 128, 64, 8192, cache="fp8", group="fp8"),
)
CHECK_CASES = (
    _case(1, 16, 64, (3000,)),
    _case(5, 16, 1, (1, 70, 0, 64, 200), topk=64, cache="split"),
    _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered"),
    _case(7, 16, 1, (1, 100, 2048, 5000, 0, 3000, 2047), pad="scattered", cache="split"),
    _case(33, 16, 64, tuple(range(0, 33 * 29, 29)), topk=256),
    _case(3, 128, 64, (700, 5, 1000), topk=512, pad="scattered"),
    _case(17, 16, 64, 140, topk=128, prefill=True, pad="scattered"),
    _case(2, 16, 16, (0, 0), topk=64),
    _case(1, 16, 64, (3000,), cache="fp8"),
    _case(5, 16, 1, (1, 70, 0, 64, 200), topk=64, cache="fp8"),
    _case(4, 16, 64, (100, 1, 333, 0), topk=200, pad="scattered", cache="fp8"),
    _case(3, 128, 64, (700, 5, 1000), topk=512, pad="scattered", cache="fp8"),
    _case(17, 16, 64, 140, topk=128, prefill=True, pad="scattered", cache="fp8"),
    # one tile a token: a one-split plan of two 64-head blocks, the lean + wide direct compile
    _case(3, 128, 16, (40, 0, 64), topk=64, pad="scattered", cache="fp8"),
)
# every compiled variant at 16 (h16, h128) heads, both cache forms, both paddings, empty rows;
# the fp8 compiles at 16 heads per CTA (lean: direct, split) and 64 (split: the form before;
# direct: lean with wide)
SANITIZE_CASES = (CHECK_CASES[1], CHECK_CASES[3], CHECK_CASES[5], CHECK_CASES[9], CHECK_CASES[10],
                  CHECK_CASES[11], CHECK_CASES[13])  # fmt: skip


def visible(case: Case) -> list[tuple[int, int]]:
    """(sequence, positions it sees) per query token."""
    p = case.params
    if p["prefill"]:
        ctx, t = p["lens"][0], p["tokens"]
        return [(0, ctx - t + i + 1) for i in range(t)]
    return list(enumerate(p["lens"]))


def _selection(case: Case, device, gen) -> torch.Tensor:
    """Positions int64 (tokens, topk): min(visible, topk) distinct random visible positions per
    row, -1 after them ("end") or scattered through the row."""
    p = case.params
    seen = torch.tensor([v for _, v in visible(case)], device=device)
    width = max(p["topk"], int(seen.max()) if seen.numel() else 0, 1)
    scores = torch.rand(p["tokens"], width, device=device, generator=gen)
    scores = scores.masked_fill(torch.arange(width, device=device) >= seen[:, None], -1.0)
    top, pos = scores.topk(p["topk"], dim=1)
    pos = torch.where(top >= 0, pos, -1)
    if p["pad"] == "scattered":
        order = torch.rand(pos.shape, device=device, generator=gen).argsort(dim=1)
        pos = pos.gather(1, order)
    return pos


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    tokens, hq, ps = p["tokens"], p["hq"], p["page"]
    seqs = p["lens"]
    widths = [max(1, -(-n // ps)) for n in seqs]
    pages = sum(widths) + 3
    dtype = torch.bfloat16 if fp8(case) else dtype
    rand = {"dtype": dtype, "device": device, "generator": gen}
    inputs: dict[str, Any] = {"q": torch.randn(tokens, hq, WIDTH, **rand)}
    if fp8(case):
        inputs["ckv"], inputs["kpe"] = fp8_cache(pages, ps, device, gen), None
    elif p["cache"] == "combined":
        inputs["ckv"], inputs["kpe"] = torch.randn(pages, ps, 1, WIDTH, **rand), None
    else:
        inputs["ckv"] = torch.randn(pages, ps, LATENT, **rand)
        inputs["kpe"] = torch.randn(pages, ps, ROPE, **rand)
    # sequence s owns a shuffled run of pages: table[s, j] holds its position j // ps
    perm = torch.randperm(pages, device=device, generator=gen)
    table = torch.zeros(len(seqs), max(widths), dtype=torch.int64, device=device)
    first = 0
    for s, w in enumerate(widths):
        table[s, :w] = perm[first : first + w]
        first += w
    pos = _selection(case, device, gen)
    seq = torch.tensor([s for s, _ in visible(case)], device=device)
    local = pos.clamp(min=0)
    slots = table[seq].gather(1, local // ps) * ps + local % ps
    inputs["idx"] = torch.where(pos >= 0, slots, -1).to(torch.int32)
    return inputs


def alloc_out(inputs: Inputs):
    q = inputs["q"]
    return q.new_empty(*q.shape[:-1], LATENT), q.new_empty(q.shape[:2], dtype=torch.float32)


def _our_args(inputs: Inputs) -> tuple:
    """The op's positional arguments, made once per input set outside any timed call (as
    mla_decode's `_our_call`): q_nope and q_pe are views of the bench's packed q, which a
    caller holds as two tensors."""
    if "ours" not in inputs:
        q = inputs["q"]
        inputs["ours"] = (q[..., :LATENT], q[..., LATENT:], inputs["ckv"], inputs["kpe"],
                          inputs["idx"])  # fmt: skip
    return inputs["ours"]


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.dsa")
    res = op.dsa_sparse_attention(*_our_args(inputs), softmax_scale=SOFTMAX_SCALE,
                                  return_lse=True, out=None if out is None else out[0])  # fmt: skip
    if out is None:
        return res
    out[1].copy_(res[1])
    return out


# Launcher-only plans on the FP8 decode cases (launch.plan_form: top-k positions a split in
# tiles of 64; the kernels as they are). Ours is launch.sparse_split_plan: one token 32 splits
# of one tile (the paged bound's 8 splits of 4 tiles, now per4, ran 1.87x its time at 17:35),
# 16 tokens 8 splits (per2: 1.121x), 128 tokens one split (per16, two: 1.038x). MLA_NOTES
# "DSA's plan forms". split1: the one-split plans of t128-h16 and t64-h128 on the partial pass
# + the combine (plan_form(direct=False)), the A/B of the sparse pass's direct form (MLA_NOTES,
# "The direct form of decode.py's pass"). was (plan_form(lean=False)): the form before the sparse
# FP8 pass's `lean` (all five FP8 cases) and its `wide` direct form at 64 heads (t64-h128), each
# moved case beside ours (H100 2026-12-05 16:44, ours then / was: t1 1.001, t64-h16 0.809,
# t128-h16 0.783, t64-h128 0.776 with wide; MLA_NOTES "lean and lean_wide adopted"). wide
# (plan_form(wide=True)): t128-h16's one-split plan with the 16-byte stores too (not taken at 16
# heads: a tie, 0.991).
WAS = {"lean": False}
PLAN_FORMS = {
    "t1-h16-p64-k2048-L32768-fp8": {
        "per2": {"per_tiles": 2},
        "per4": {"per_tiles": 4},
        "was": WAS,
    },
    "t16-h16-p64-k2048-L32768-fp8": {"per2": {"per_tiles": 2}, "was": WAS},
    "t64-h16-p64-k2048-L32768-fp8": {"was": WAS},
    "t128-h16-p64-k2048-L32768-fp8": {
        "per16": {"per_tiles": 16},
        "split1": {"direct": False},
        "was": WAS,
        "wide": {"wide": True},
    },
    "t64-h128-p64-k2048-L8192-fp8": {"split1": {"direct": False}, "was": WAS},
}


def _with_plan(form: dict[str, Any]):
    def run(inputs: Inputs, out):
        from forgekernel.kernels.attention.mla.sm90.launch import plan_form

        with plan_form(**form):
            return run_ours(inputs, out)

    return run


def variants(case: Case) -> dict[str, Any]:
    """PLAN_FORMS' launcher-only plans of `case` (none elsewhere)."""
    return {name: _with_plan(t) for name, t in PLAN_FORMS.get(case.name, {}).items()}


def _is_fp8_cache(inputs: Inputs) -> bool:
    return inputs["kpe"] is None and inputs["ckv"].shape[-1] == FP8_ROW_BYTES


def _kv(inputs: Inputs) -> torch.Tensor:
    """The cache as reference.dsa reads it: (pages, page_size, [1,] 576); FP8: the latent e4m3
    x its scales and the RoPE columns, fp32."""
    if _is_fp8_cache(inputs):
        from forgekernel.reference.mla import flashmla_fp8_views

        latent, scale, rope = flashmla_fp8_views(inputs["ckv"])
        latent = latent.float() * scale.repeat_interleave(LATENT // scale.shape[-1], -1)
        return torch.cat([latent, rope.float()], -1)
    if inputs["kpe"] is None:
        return inputs["ckv"]
    return torch.cat([inputs["ckv"], inputs["kpe"]], -1)


def _reference(inputs: Inputs, dtype: torch.dtype):
    from forgekernel.reference.dsa import dsa_sparse_attention_paged_ref

    return dsa_sparse_attention_paged_ref(
        inputs["q"], _kv(inputs), inputs["idx"], SOFTMAX_SCALE, dtype=dtype
    )


def reference(inputs: Inputs):
    return _reference(inputs, torch.float32)


def low_precision(inputs: Inputs):
    """out by the same math in q's dtype; the LSE fp32 (as reference.mla's yardstick)."""
    out, _ = _reference(inputs, inputs["q"].dtype)
    return out, _reference(inputs, torch.float32)[1]


def _flashmla():
    try:
        import flash_mla
    except ImportError:
        return None
    sparse_fwd = getattr(flash_mla, "flash_mla_sparse_fwd", None)
    if sparse_fwd is None:
        return None

    def setup(inputs: Inputs):
        q, idx = inputs["q"], inputs["idx"]
        if _is_fp8_cache(inputs):
            raise ValueError("FlashMLA's sparse prefill takes bf16 caches (FP8: flashmla_fp8)")
        if q.dtype != torch.bfloat16:
            raise ValueError(f"FlashMLA's sparse prefill takes bf16, not {q.dtype}")
        hq = q.shape[1]
        heads = next((h for h in FLASHMLA_HEADS if h >= hq), None)
        if heads is None:
            raise ValueError(f"FlashMLA's sm90 sparse prefill takes <= 128 heads, not {hq}")
        if heads != hq:  # zero heads up to its 64: the padded rows are computed and dropped
            q = torch.cat([q, q.new_zeros(q.shape[0], heads - hq, WIDTH)], 1)
        kv = _kv(inputs).reshape(-1, 1, WIDTH)
        indices = idx[:, None, :]

        def call():
            out, _, lse = sparse_fwd(q, kv, indices, SOFTMAX_SCALE, LATENT)
            return out[:, :hq], lse[:, :hq]

        return call, q, kv

    def run(inputs: Inputs):
        if "flashmla" not in inputs:
            inputs["flashmla"] = setup(inputs)
        return inputs["flashmla"][0]()

    return run


def _padded_heads(q: torch.Tensor, heads: int) -> torch.Tensor:
    """q (..., H, 576) with zero heads up to `heads` (computed by the comparator, dropped)."""
    if q.shape[-2] == heads:
        return q
    return torch.cat([q, q.new_zeros(*q.shape[:-2], heads - q.shape[-2], q.shape[-1])], -2)


def flashmla_fp8_decode(flash_mla, q: torch.Tensor, packed: torch.Tensor, indices: torch.Tensor):
    """call() -> (out (b, 1, H, 512), lse (b, H, 1)) of FlashMLA's sm90 sparse decode on its
    FP8 cache (module docstring): q (b, 1, H, 576) bf16, packed (pages, page_size, 1, 656),
    indices (b, 1, topk) int32 (-1 invalid); heads zero-padded to FLASHMLA_HEADS and topk to
    its blocks (-1), the scheduler metadata filled by a first call here."""
    if q.dtype != torch.bfloat16:
        raise ValueError(f"FlashMLA's sparse decode takes bf16 queries, not {q.dtype}")
    hq = q.shape[-2]
    heads = next((h for h in FLASHMLA_HEADS if h >= hq), None)
    if heads is None:
        raise ValueError(f"FlashMLA's sm90 sparse decode takes <= 128 heads, not {hq}")
    q = _padded_heads(q, heads).contiguous()
    pad = -indices.shape[-1] % FLASHMLA_TOPK_BLOCK
    if pad:
        indices = torch.cat([indices, indices.new_full((*indices.shape[:-1], pad), -1)], -1)
    indices = indices.contiguous()
    meta, _ = flash_mla.get_mla_metadata()

    def call():
        out, lse = flash_mla.flash_mla_with_kvcache(
            q, packed, None, None, LATENT, meta, softmax_scale=SOFTMAX_SCALE, causal=False,
            is_fp8_kvcache=True, indices=indices, use_legacy=True,
        )  # fmt: skip
        return out[:, :, :hq], lse[:, :hq]

    call()
    return call


def _flashmla_fp8():
    try:
        import flash_mla
    except ImportError:
        return None

    def setup(inputs: Inputs):
        if not _is_fp8_cache(inputs):
            raise ValueError("FlashMLA's sm90 sparse decode reads FP8 caches only")
        call = flashmla_fp8_decode(flash_mla, inputs["q"][:, None], inputs["ckv"],
                                   inputs["idx"][:, None])  # fmt: skip

        def tokens():  # (out (tokens, H, 512), lse (tokens, H)) as ours
            out, lse = call()
            return out[:, 0], lse[..., 0]

        return (tokens,)

    def run(inputs: Inputs):
        if "flashmla_fp8" not in inputs:
            inputs["flashmla_fp8"] = setup(inputs)
        return inputs["flashmla_fp8"][0]()

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"flashmla_sparse": None, "flashmla_fp8": None}
    return {"flashmla_sparse": _flashmla(), "flashmla_fp8": _flashmla_fp8()}


def _valid(case: Case) -> list[int]:
    """Valid entries per token: min(visible positions, topk)."""
    return [min(v, case.params["topk"]) for _, v in visible(case)]


def flops(case: Case) -> float:
    return 2.0 * (WIDTH + LATENT) * case.params["hq"] * sum(_valid(case))


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """The rows each token reads (its valid entries; FP8 656 bytes each), q in, out and the LSE
    out."""
    size = 2 if fp8(case) else torch.empty((), dtype=dtype).element_size()
    row = FP8_ROW_BYTES if fp8(case) else WIDTH * size
    rows = case.params["tokens"] * case.params["hq"]
    return sum(_valid(case)) * row + rows * ((WIDTH + LATENT) * size + 4)


def suite() -> OpSuite:
    return OpSuite(
        name="dsa_sparse",
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
        host_case=BENCH_CASES[0],  # t1 h16 L8192 bf16 (an FP8 one of equal flops moves fewer bytes)
    )
