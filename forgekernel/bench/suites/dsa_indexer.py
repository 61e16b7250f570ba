"""DeepSeek sparse attention's lightning indexer suite (DSA, issue 22; PENDING its first GPU
check): the FP8 logits I[t, s] = k_scale[s] sum_h w[t, h] relu(q[t, h] . k[s]) and each row's
top-k, decode over deep_gemm's paged cache (`dsa_indexer_paged`: FlashInfer-Bench's
dsa_topk_indexer_fp8_h64_d128_topk2048_ps64 form, next_n 1 or 2) and prefill over contiguous
keys (`dsa_indexer`, causal, packed sequences).

Inputs: q float8_e4m3fn straight from N(0, 1) (SGLang folds q's scale into the weights), keys
quantized per token with DeepSeek's act_quant (ue8m0 scales), weights N(0, 1) / 8; paged
sequences on distinct shuffled pages, block tables padded with page 0 to >= 2048 positions.

The check (`judge`, order-free, the selections are sets): the logits recomputed in fp64 from the
same FP8 inputs; per row, the indices must be distinct visible keys (positions < the row's
window), as many as min(topk, visible), -1 after them, and each selected logit at least the
k-th largest minus a tolerance, TOL x the row's largest |logit|: the kernel's fp32 logits
(tensor-core FP8 dot products, then fp32 head sums) may swap near-ties at the boundary, which
no check of ids can call wrong. err is the worst row's shortfall in tolerances (<= 1 passes).

Comparator: DeepGEMM (sgl-deep-gemm 0.1.4.post1, whose sources hold the sm90 kernels
`sm90_fp8_paged_mqa_logits` and `sm90_fp8_mqa_logits`): `fp8_paged_mqa_logits` (with
`get_paged_mqa_logits_metadata`; context_lens 2-D (B, next_n), each row's own length, so no
clean_logits: the columns past it are masked here) / `fp8_mqa_logits` (cu_seq_len_k start / end,
clean_logits) for the logits, then torch.topk and the -1 / slot mapping, the way a serving stack
without its own top-k kernel calls them. Work: 2 x 64 x 128 FLOPs per visible (row, key);
bytes: each sequence's keys once (132 B each), q, weights, the ids.
"""

from __future__ import annotations

import importlib
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.dsa_indexer.sm90 import SPEC
from forgekernel.kernels.attention.dsa_indexer.sm90.config import (
    FLOPS_PER_PAIR,
    HEAD_DIM,
    HEADS,
    PAGE,
)

FP8 = torch.float8_e4m3fn
TOPK = 2048
TOL = 2e-3  # of the row's largest |logit|: the near-tie band the check accepts
ROW_BYTES = HEAD_DIM + 4  # a key's fp8 row and its scale


def _paged(lens, *, next_n=1, topk=TOPK, group="") -> Case:
    lens = tuple(lens)
    shape = f"L{lens[0]}" if len(set(lens)) == 1 else f"L{min(lens)}-{max(lens)}"
    name = f"decode-b{len(lens)}-{shape}" + (f"-n{next_n}" if next_n > 1 else "") + f"-k{topk}"
    return Case(name, {"mode": "paged", "lens": lens, "next_n": next_n, "topk": topk}, group)


def _prefill(lens_q, lens_k, *, causal=True, topk=TOPK, group="") -> Case:
    lens_q, lens_k = tuple(lens_q), tuple(lens_k)
    name = f"prefill-q{sum(lens_q)}-k{sum(lens_k)}" + (f"-s{len(lens_q)}" if len(lens_q) > 1
                                                      else "")  # fmt: skip
    name += ("" if causal else "-noncausal") + f"-k{topk}"
    params = {"mode": "prefill", "lens_q": lens_q, "lens_k": lens_k, "causal": causal,
              "topk": topk}  # fmt: skip
    return Case(name, params, group)


# DeepSeek-V3.2 decode (one query token per sequence; MTP's two), 1-128 sequences of 4k-64k
# cached tokens; prefill of 4k-16k tokens (one sequence, causal) and a chunk after a prefix.
BENCH_CASES = (
    *(_paged([n] * b, group="decode") for b in (1, 8, 32, 128) for n in (4096, 16384, 65536)),
    _paged([32768] * 64, next_n=2, group="mtp"),
    _paged([1000 + 997 * i for i in range(64)], group="decode-mixed"),
    *(_prefill([n], [n], group="prefill") for n in (4096, 8192, 16384)),
    _prefill([2048], [32768], group="chunked"),
)
CHECK_CASES = (
    _paged([1, 70, 0, 2047, 2048, 2049, 5000]),
    _paged([1, 100, 3000, 64], next_n=2, topk=512),
    _paged(list(range(7, 33 * 131, 131)), topk=256),
    _paged([70001], topk=TOPK),  # a cluster of 8 CTAs
    _paged([40000, 3], next_n=4, topk=100),
    _prefill([300], [300], topk=64),
    _prefill([5, 0, 37, 300], [9, 4, 37, 2100], topk=256),
    _prefill([17], [20000]),
    _prefill([7, 9], [5000, 1], causal=False, topk=2048),
)
# every compiled variant: paged qtokens 1, 2, 4 and prefill 4; top-k clusters 1 (both), 2, 8
SANITIZE_CASES = (CHECK_CASES[0], CHECK_CASES[1], CHECK_CASES[3], CHECK_CASES[4], CHECK_CASES[6])


def _keys(n: int, device, gen) -> tuple[torch.Tensor, torch.Tensor]:
    """(k float8_e4m3fn (n, 128), k_scale fp32 (n,)): act_quant per token (ue8m0)."""
    from forgekernel.reference.dsa import quantize_fp8_groups

    k, scale = quantize_fp8_groups(torch.randn(n, HEAD_DIM, device=device, generator=gen), HEAD_DIM)
    return k, scale[:, 0].contiguous()


def _paged_inputs(p: dict, device, gen) -> Inputs:
    from forgekernel.reference.dsa_flashinfer import pack_indexer_k_cache

    lens, next_n = p["lens"], p["next_n"]
    counts = [-(-n // PAGE) for n in lens]
    pages = sum(counts) + 2
    k, scale = _keys(pages * PAGE, device, gen)
    cache = pack_indexer_k_cache(k.view(pages, PAGE, HEAD_DIM), scale.view(pages, PAGE))
    width = max(max(counts), -(-p["topk"] // PAGE))
    perm = torch.randperm(pages, device=device, generator=gen).int()
    table = torch.zeros(len(lens), width, dtype=torch.int32, device=device)
    first = 0
    for b, c in enumerate(counts):
        table[b, :c] = perm[first : first + c]
        first += c
    rows = len(lens) * next_n
    return {
        "q": torch.randn(len(lens), next_n, HEADS, HEAD_DIM, device=device, generator=gen).to(FP8),
        "cache": cache,
        "weights": torch.randn(rows, HEADS, device=device, generator=gen) / 8,
        "seq_lens": torch.tensor(lens, dtype=torch.int32, device=device),
        "table": table,
    }


def _prefill_inputs(p: dict, device, gen) -> Inputs:
    from forgekernel.ops.dsa_indexer import key_windows

    s, skv = sum(p["lens_q"]), sum(p["lens_k"])
    k, scale = _keys(skv, device, gen)
    packed = len(p["lens_q"]) > 1
    cu = {}
    if packed:
        for name, lens in (("cu_q", p["lens_q"]), ("cu_k", p["lens_k"])):
            cu[name] = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()],
                                    dtype=torch.int32, device=device)  # fmt: skip
    starts, ends = key_windows(s, skv, p["causal"], cu.get("cu_q"), cu.get("cu_k"), device)
    return {
        "q": torch.randn(s, HEADS, HEAD_DIM, device=device, generator=gen).to(FP8),
        "k": k,
        "k_scale": scale,
        "weights": torch.randn(s, HEADS, device=device, generator=gen) / 8,
        "cu_q": cu.get("cu_q"),
        "cu_k": cu.get("cu_k"),
        "starts": starts,
        "ends": ends,
    }


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    inputs = (
        _paged_inputs(p, device, gen) if p["mode"] == "paged" else _prefill_inputs(p, device, gen)
    )
    inputs["case"] = p
    return inputs


def _rows(inputs: Inputs) -> int:
    return inputs["weights"].shape[0]


def alloc_out(inputs: Inputs) -> torch.Tensor:
    return torch.empty(_rows(inputs), inputs["case"]["topk"], dtype=torch.int32,
                       device=inputs["weights"].device)  # fmt: skip


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.dsa_indexer")
    p = inputs["case"]
    if p["mode"] == "paged":
        return op.dsa_indexer_paged(inputs["q"], inputs["cache"], inputs["weights"],
                                    inputs["seq_lens"], inputs["table"], topk=p["topk"],
                                    out=out)  # fmt: skip
    return op.dsa_indexer(inputs["q"], inputs["k"], inputs["k_scale"], inputs["weights"],
                          topk=p["topk"], causal=p["causal"], cu_seqlens_q=inputs["cu_q"],
                          cu_seqlens_k=inputs["cu_k"], out=out)  # fmt: skip


# ---------------------------------------------------------------- the judge


def _scores(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(fp64 logits (rows, width) with -inf outside each row's window, the ids ours returned
    mapped to those columns by the caller, the windows' ends); paged: columns are positions."""
    from forgekernel.reference.dsa import dsa_indexer_scores_ref

    p = inputs["case"]
    if p["mode"] == "prefill":
        scores = dsa_indexer_scores_ref(inputs["q"], inputs["k"], inputs["weights"],
                                        k_scale=inputs["k_scale"], causal=False,
                                        dtype=torch.float64)  # fmt: skip
        cols = torch.arange(scores.shape[1], device=scores.device)
        seen = (cols >= inputs["starts"][:, None]) & (cols < inputs["ends"][:, None])
        return scores.masked_fill(~seen, float("-inf"))
    from forgekernel.reference.dsa_flashinfer import unpack_indexer_k_cache

    k, scale = unpack_indexer_k_cache(inputs["cache"])
    table, lens, next_n = inputs["table"].long(), inputs["seq_lens"], p["next_n"]
    width = table.shape[1] * PAGE
    q = inputs["q"].flatten(0, 1)
    rows = []
    k_bytes = k.view(torch.uint8)  # fp8 has no gather kernel everywhere: gather the bytes
    for b in range(table.shape[0]):
        keys = k_bytes[table[b]].flatten(0, 1).view(FP8)
        sc = dsa_indexer_scores_ref(q[b * next_n : (b + 1) * next_n], keys,
                                    inputs["weights"][b * next_n : (b + 1) * next_n],
                                    k_scale=scale[table[b]].flatten(), causal=False,
                                    dtype=torch.float64)  # fmt: skip
        ends = lens[b] - next_n + 1 + torch.arange(next_n, device=sc.device)
        cols = torch.arange(width, device=sc.device)
        rows.append(sc.masked_fill(cols[None, :] >= ends[:, None], float("-inf")))
    return torch.cat(rows)


def _positions(inputs: Inputs, ids: torch.Tensor) -> torch.Tensor:
    """Paged: slots back to sequence positions (page index in the row's table x 64 + offset);
    a slot of a page outside the row's table maps past the width (a structural fault)."""
    p = inputs["case"]
    if p["mode"] == "prefill":
        return ids
    table, next_n = inputs["table"].long(), p["next_n"]
    width = table.shape[1] * PAGE
    where = torch.full((int(inputs["cache"].shape[0]),), width, dtype=torch.long,
                       device=ids.device)  # fmt: skip
    out = torch.full_like(ids, -1)
    for b in range(table.shape[0]):
        lens = int(inputs["seq_lens"][b])
        used = table[b, : -(-lens // PAGE)]
        where.fill_(width)
        where[used] = torch.arange(used.numel(), device=ids.device) * PAGE
        rows = slice(b * next_n, (b + 1) * next_n)
        slot = ids[rows].long()
        page = (slot.clamp(min=0) // PAGE).clamp(max=where.numel() - 1)
        pos = where[page] + slot.clamp(min=0) % PAGE
        out[rows] = torch.where(slot >= 0, pos, -1).to(ids.dtype)
    return out


def in_position_order(inputs: Inputs, ids: torch.Tensor) -> bool:
    """The kernels' order, beyond the order-free contract: per row the selected keys by ascending
    position, then the -1 padding. Paged ids are slots in the rows' pages, which the block table
    shuffles: ascending positions, not ascending slot ids (the 2026-12-02 GPU run's test read
    the slots)."""
    pos = _positions(inputs, ids).long()
    key = torch.where(pos >= 0, pos, torch.iinfo(torch.int64).max)
    return bool((key[:, 1:] >= key[:, :-1]).all())


def judge(inputs: Inputs, outs: tuple) -> list[dict[str, Any]]:
    """One verdict for the ids (module docstring)."""
    from forgekernel.reference.dsa import topk_selection_error

    (ids,) = outs
    scores = _scores(inputs)
    topk = inputs["case"]["topk"]
    finite = torch.isfinite(scores)
    tol = (TOL * torch.where(finite, scores.abs(), 0.0).amax(-1, keepdim=True)).clamp(min=1e-30)
    try:
        err = topk_selection_error(scores / tol, _positions(inputs, ids).int(), topk)
        message = "" if err <= 1.0 else f"a selected logit {err:.3g} tolerances below the k-th"
    except ValueError as e:
        err, message = float("inf"), str(e)
    return [{"ok": not message, "err": err, "lowprec_err": 0.0, "rel_err": err, "bound": 1.0,
             "message": message}]  # fmt: skip


def reference(inputs: Inputs) -> torch.Tensor:
    """The fp64 logits (the judge's yardstick; check and bench call the judge)."""
    return _scores(inputs)


# ---------------------------------------------------------------- DeepGEMM + torch.topk


def deep_gemm_context_lens(seq_lens: torch.Tensor, next_n: int) -> torch.Tensor:
    """DeepGEMM's context_lens int32 (B, next_n), contiguous: each query row's own visible
    length, seq_lens[b] - next_n + 1 + i for token i (ours and the 1-D form's rule). sgl-deep-gemm
    0.1.4 takes only this 2-D form (`context_lens.dim() == 2` in get_paged_mqa_logits_metadata
    and fp8_paged_mqa_logits; a (B,) tensor raised there in the 2026-12-02 run)."""
    tokens = torch.arange(next_n, dtype=seq_lens.dtype, device=seq_lens.device)
    return (seq_lens[:, None] - next_n + 1 + tokens).clamp(min=0).int().contiguous()


def _deep_gemm_sms(deep_gemm, q: torch.Tensor) -> int:
    """The SMs DeepGEMM schedules over: its metadata must have get_num_sms() + 1 rows."""
    if hasattr(deep_gemm, "get_num_sms"):
        return int(deep_gemm.get_num_sms())
    return torch.cuda.get_device_properties(q.device).multi_processor_count


def _deep_gemm():
    try:
        import deep_gemm
    except Exception:  # not installed, or its CUDA extension fails to load
        return None
    if not hasattr(deep_gemm, "fp8_paged_mqa_logits"):
        return None

    def setup(inputs: Inputs):
        p = inputs["case"]
        if p["mode"] == "paged":
            q, table = inputs["q"], inputs["table"]
            lens = deep_gemm_context_lens(inputs["seq_lens"], p["next_n"])
            meta = deep_gemm.get_paged_mqa_logits_metadata(lens, PAGE, _deep_gemm_sms(deep_gemm, q))
            cache = inputs["cache"].view(torch.uint8)
            width = table.shape[1] * PAGE
            cols = torch.arange(width, device=q.device)
            hidden = cols[None, :] >= lens.reshape(-1, 1)

            def logits():
                # clean_logits asserts 1-D context_lens: the columns past a row's length hold
                # whatever the kernel left there, hidden here
                raw = deep_gemm.fp8_paged_mqa_logits(q, cache, inputs["weights"], lens, table,
                                                     meta, width, clean_logits=False)  # fmt: skip
                return raw.masked_fill(hidden, float("-inf"))

            def ids(values, cols):
                slots = table.repeat_interleave(p["next_n"], 0).gather(1, cols // PAGE)
                return torch.where(values.isfinite(), slots * PAGE + cols % PAGE, -1)

        else:
            kv = (inputs["k"], inputs["k_scale"])

            def logits():
                return deep_gemm.fp8_mqa_logits(inputs["q"], kv, inputs["weights"],
                                                inputs["starts"], inputs["ends"],
                                                clean_logits=True)  # fmt: skip

            def ids(values, cols):
                return torch.where(values.isfinite(), cols, -1)

        def call():
            values, cols = torch.topk(logits(), min(p["topk"], width_of(inputs)), dim=-1)
            return ids(values, cols).int()

        return (call,)

    def run(inputs: Inputs):
        if "deep_gemm" not in inputs:
            inputs["deep_gemm"] = setup(inputs)
        return inputs["deep_gemm"][0]()

    return run


def width_of(inputs: Inputs) -> int:
    p = inputs["case"]
    if p["mode"] == "paged":
        return inputs["table"].shape[1] * PAGE
    return inputs["k"].shape[0]


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"deep_gemm_topk": None}
    return {"deep_gemm_topk": _deep_gemm()}


# ---------------------------------------------------------------- work counts


def _visible(case: Case) -> list[tuple[int, int]]:
    """(keys of the row's sequence, keys it sees) per query row."""
    p = case.params
    if p["mode"] == "paged":
        n = p["next_n"]
        return [(s, max(0, s - n + 1 + i)) for s in p["lens"] for i in range(n)]
    out = []
    for sq, sk in zip(p["lens_q"], p["lens_k"]):
        for i in range(sq):
            out.append((sk, max(0, min(sk, sk - sq + i + 1)) if p["causal"] else sk))
    return out


def flops(case: Case) -> float:
    return float(FLOPS_PER_PAIR * sum(seen for _, seen in _visible(case)))


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    rows = len(_visible(case))
    keys = sum(p["lens"]) if p["mode"] == "paged" else sum(p["lens_k"])
    return float(keys * ROW_BYTES + rows * (HEADS * HEAD_DIM + HEADS * 4 + p["topk"] * 4))


def suite() -> OpSuite:
    return OpSuite(
        name="dsa_indexer",
        kernel_sources=SPEC.sources,
        dtypes=(FP8,),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=reference,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        memory_bound=True,
        sanitize_cases=SANITIZE_CASES,
        judge=judge,
        host_case=BENCH_CASES[0],
    )
