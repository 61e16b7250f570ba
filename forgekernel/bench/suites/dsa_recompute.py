"""DSA score recompute suite (issue 22; pending its first GPU check): the indexer's training
target, `forgekernel.dsa_score_recompute` (ops/dsa_recompute.py has the math: the head sum of
exp(scale q . kv[idx] - lse) at the selected keys, L1-normalized per token with eps 1e-10),
against reference.dsa's `dsa_score_target_ref`.

Shapes: DeepSeek-V3.2 training / prefill, one sequence of `ctx` keys whose last `tokens`
positions are the queries (token i sees the ctx - tokens + i + 1 positions up to itself, picks
min(visible, topk) of them at random: the kernel's cost does not depend on which rows win),
H = 16 (TP8), 64, 128 (TP1), top-k 2048 (and 512), keys 8k-64k, 1-4096 queries. The LSE is
the forward's (fp32 logsumexp of the same keys, natural log; -inf for a row with none). Odd
cases: topk not a multiple of 64, a row of all -1 (its token sees nothing), S_kv < topk (the
tail -1), -1 scattered through the rows, topk_length (the valid count of "end"-padded rows, as
cuDNN's compact form; cuDNN's sm90 pass counts a -1 inside topk_length as a zero key row, so
length cases never hold one there), a batch of 2 sequences (4-D tensors, per-batch indices).

Memory-bound on the gather: GB/s counts the valid entries' rows (576 x 2 bytes each; at
prefill the tokens share most rows and L2 serves them), q, the LSE, the indices and the target
(written, read back and rewritten by the in-place normalization). FLOPs: 2 x 576 per (token,
head, valid entry).

Comparator (same process, its first call outside any timing): cuDNN-frontend 1.32's
`sparse_attn_score_recompute_wrapper` (cudnn.deepseek_sparse_attention; sm90 kernel
`SparseScoreRecomputeSm90`), bf16 only, inputs as 4-D (B, S, ...) with per-batch indices: the
same tensors as ours. Its sm90 L1 pass writes topk // 128 x 128 entries per row (positions
past the last multiple of 128 are left unwritten), so a topk that is not a multiple of 128 is
padded with -1 columns once at set-up and the result sliced back, as cuDNN's own training entry
(`training.sparse_attention_score_recompute`, `_pad_indices`) does.
"""

from __future__ import annotations

import importlib
import math
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.dsa_recompute.sm90 import SPEC

WIDTH = 576
# DeepSeek-V3's: the un-absorbed 1 / sqrt(128 + 64) times the YaRN mscale^2 (mscale 0.1 ln 40 + 1)
SOFTMAX_SCALE = (0.1 * math.log(40.0) + 1.0) ** 2 / math.sqrt(192.0)
TOPK = 2048
CUDNN_TOPK_MULTIPLE = 128  # its sm90 L1 pass: ELEMS_PER_THREAD = topk // 128 (padded to it)
LSE_ROWS = 256  # tokens per chunk of the inputs' LSE computation


def _case(tokens, hq, ctx, *, topk=TOPK, pad="end", length=False, batch=1, empty=0,
          group="", tag="") -> Case:  # fmt: skip
    """`tokens` queries at the end of a `ctx`-key sequence (x `batch`); `empty`: that many
    leading tokens see no key (rows of -1)."""
    name = f"t{tokens}-h{hq}-kv{ctx}-k{topk}" + (f"-b{batch}" if batch > 1 else "")
    name += ("-scattered" if pad == "scattered" else "") + ("-len" if length else "")
    name += (f"-empty{empty}" if empty else "") + (f"-{tag}" if tag else "")
    params = {"tokens": tokens, "hq": hq, "ctx": ctx, "topk": topk, "pad": pad,
              "length": length, "batch": batch, "empty": empty}  # fmt: skip
    return Case(name, params, group)


BENCH_CASES = (
    # TP8 (16 heads): the cuDNN point (4096 x top-2048 over 8192 keys), longer contexts,
    # a decode-sized call
    _case(4096, 16, 8192, group="tp8"),
    _case(4096, 16, 32768, group="tp8"),
    _case(1024, 16, 65536, group="tp8"),
    _case(64, 16, 32768, group="tp8"),
    _case(1, 16, 8192, group="tp8"),
    _case(4096, 16, 8192, topk=512, group="tp8"),
    _case(4096, 64, 8192, group="h64"),
    _case(2048, 64, 32768, group="h64"),
    # TP1 (128 heads)
    _case(4096, 128, 8192, group="tp1"),
    _case(1024, 128, 65536, group="tp1"),
    _case(1, 128, 32768, group="tp1"),
)
CHECK_CASES = (
    _case(3, 16, 300, topk=128),
    _case(5, 16, 333, topk=100, pad="scattered"),  # topk not a multiple of 64
    _case(4, 128, 90, topk=256),  # S_kv < topk: every row's tail is -1
    _case(6, 32, 500, topk=192, empty=2),  # rows of all -1
    _case(7, 64, 1000, topk=320, length=True),
    _case(3, 16, 400, topk=128, batch=2),
    _case(17, 128, 700, topk=512, length=True),
    _case(9, 64, 800, topk=448, pad="scattered"),
    _case(2, 16, 5000, topk=TOPK),
)
# every compiled variant (16 / 32 / 64 / 128 heads, topk_length), odd sizes and empty rows
SANITIZE_CASES = (CHECK_CASES[1], CHECK_CASES[2], CHECK_CASES[3], CHECK_CASES[4])


def visible(case: Case) -> list[int]:
    """Positions each query token sees (per sequence of the batch)."""
    p = case.params
    ctx, t = p["ctx"], p["tokens"]
    return [0 if i < p["empty"] else ctx - t + i + 1 for i in range(t)]


def _selection(case: Case, device, gen) -> torch.Tensor:
    """int32 (tokens, topk): min(visible, topk) distinct random visible positions per row, -1
    after them ("end") or scattered through the row."""
    p = case.params
    seen = torch.tensor(visible(case), device=device)
    width = max(p["topk"], p["ctx"], 1)
    scores = torch.rand(p["tokens"], width, device=device, generator=gen)
    scores = scores.masked_fill(torch.arange(width, device=device) >= seen[:, None], -1.0)
    top, pos = scores.topk(p["topk"], dim=1)
    pos = torch.where(top >= 0, pos, -1)
    if p["pad"] == "scattered":
        order = torch.rand(pos.shape, device=device, generator=gen).argsort(dim=1)
        pos = pos.gather(1, order)
    return pos.to(torch.int32)


def forward_lse(q: torch.Tensor, kv: torch.Tensor, idx: torch.Tensor, scale: float):
    """The sparse forward's LSE (tokens, H) fp32 (natural log, -inf where a row lists no key),
    in chunks of LSE_ROWS tokens."""
    parts = []
    for r0 in range(0, q.shape[0], LSE_ROWS):
        sel = idx[r0 : r0 + LSE_ROWS]
        valid = sel >= 0
        rows = kv.float()[sel.clamp(min=0).long()]
        s = torch.einsum("rhd,rkd->rhk", q[r0 : r0 + LSE_ROWS].float(), rows) * scale
        parts.append(torch.logsumexp(s.masked_fill(~valid[:, None, :], -math.inf), dim=-1))
    return torch.cat(parts) if parts else q.new_zeros(0, q.shape[1], dtype=torch.float32)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    p = case.params
    rand = {"dtype": dtype, "device": device, "generator": gen}
    qs, kvs, idxs, lses, lens = [], [], [], [], []
    for _ in range(p["batch"]):
        q = torch.randn(p["tokens"], p["hq"], WIDTH, **rand)
        kv = torch.randn(p["ctx"], WIDTH, **rand)
        idx = _selection(case, device, gen)
        qs.append(q)
        kvs.append(kv)
        idxs.append(idx)
        lses.append(forward_lse(q, kv, idx, SOFTMAX_SCALE))
        lens.append((idx >= 0).sum(1).to(torch.int32))
    inputs: dict[str, Any] = {}
    if p["batch"] == 1:
        inputs.update(q=qs[0], kv=kvs[0], lse=lses[0], idx=idxs[0], length=lens[0])
    else:
        stack = torch.stack
        inputs.update(q=stack(qs), kv=stack(kvs), lse=stack(lses), idx=stack(idxs),
                      length=stack(lens))  # fmt: skip
    if not p["length"]:
        inputs["length"] = None
    return inputs


def alloc_out(inputs: Inputs):
    return torch.empty(inputs["idx"].shape, dtype=torch.float32, device=inputs["idx"].device)


def run_ours(inputs: Inputs, out):
    op = importlib.import_module("forgekernel.ops.dsa_recompute")
    return op.dsa_score_recompute(
        inputs["q"], inputs["kv"], inputs["lse"], inputs["idx"], SOFTMAX_SCALE,
        topk_length=inputs["length"], out=out,
    )  # fmt: skip


def _flat(inputs: Inputs):
    """Per sequence of the batch: (q, kv, lse, idx, length) as the 3-D reference takes them."""
    if inputs["q"].dim() == 3:
        yield inputs["q"], inputs["kv"], inputs["lse"], inputs["idx"], inputs["length"]
        return
    for b in range(inputs["q"].shape[0]):
        length = None if inputs["length"] is None else inputs["length"][b]
        yield inputs["q"][b], inputs["kv"][b], inputs["lse"][b], inputs["idx"][b], length


def _reference(inputs: Inputs, dtype: torch.dtype):
    from forgekernel.reference.dsa import dsa_score_target_ref

    parts = [
        dsa_score_target_ref(q, kv, lse, idx, SOFTMAX_SCALE, topk_length=length, dtype=dtype)
        for q, kv, lse, idx, length in _flat(inputs)
    ]
    return torch.stack(parts) if inputs["q"].dim() == 4 else parts[0]


def reference(inputs: Inputs):
    return _reference(inputs, torch.float32)


def low_precision(inputs: Inputs):
    """The same math in q's dtype (the scores, exponentials and sums), as fp32."""
    return _reference(inputs, inputs["q"].dtype).float()


def cudnn_dsa_wrapper(name: str):
    """cuDNN-frontend's DeepSeek sparse attention wrapper `name`
    (`cudnn.deepseek_sparse_attention`), or None where that frontend or the wrapper is missing
    (the comparator is then reported missing). Shared by the DSA suites' cuDNN comparators."""
    try:
        from cudnn import deepseek_sparse_attention as dsa
    except Exception:
        return None
    return getattr(dsa, name, None)


def _cudnn():
    wrapper = cudnn_dsa_wrapper("sparse_attn_score_recompute_wrapper")
    if wrapper is None:
        return None

    def setup(inputs: Inputs):
        q = inputs["q"]
        if q.dtype != torch.bfloat16:
            raise ValueError(f"cuDNN's score recompute takes bf16, not {q.dtype}")
        topk = inputs["idx"].shape[-1]
        four = q.dim() == 4
        q4, kv3, lse3, idx3 = (inputs[k] if four else inputs[k][None]
                               for k in ("q", "kv", "lse", "idx"))  # fmt: skip
        pad = -topk % CUDNN_TOPK_MULTIPLE
        if pad:
            idx3 = torch.nn.functional.pad(idx3, (0, pad), value=-1).contiguous()
        length = inputs["length"]
        if length is not None and not four:
            length = length[None]
        out = torch.empty(idx3.shape, dtype=torch.float32, device=q.device)

        def call():
            res = wrapper(q4, kv3, lse3, idx3, SOFTMAX_SCALE, topk_length=length, out=out)
            target = res["target"][..., :topk]
            return target if four else target[0]

        call()
        return (call,)

    def run(inputs: Inputs):
        if "cudnn" not in inputs:
            inputs["cudnn"] = setup(inputs)
        return inputs["cudnn"][0]()

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cudnn": None}
    return {"cudnn": _cudnn()}


def _valid(case: Case) -> int:
    p = case.params
    return p["batch"] * sum(min(v, p["topk"]) for v in visible(case))


def flops(case: Case) -> float:
    return 2.0 * WIDTH * case.params["hq"] * _valid(case)


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    size = torch.empty((), dtype=dtype).element_size()
    tokens = p["batch"] * p["tokens"]
    q = tokens * p["hq"] * (WIDTH * size + 4)  # q and the LSE
    lists = tokens * p["topk"] * (4 + 3 * 4)  # indices, target written, read, rewritten
    return _valid(case) * WIDTH * size + q + lists


def suite() -> OpSuite:
    return OpSuite(
        name="dsa_recompute",
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
        atol=1e-6,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=SANITIZE_CASES,
        host_case=BENCH_CASES[4],  # t1 h16 kv8192: one CTA, the launch cost in view
    )
