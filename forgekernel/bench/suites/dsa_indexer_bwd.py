"""DSA indexer backward suite (issue 22; its kernel kernels/attention/dsa_indexer_bwd/sm90, built
on the CPU 2026-12-04, pending its first device run):
`forgekernel.ops.dsa_indexer.dsa_indexer_backward` (ops/dsa_indexer_bwd.py has the math: the
clipped-KL gradient G = g - p sum(g) at the selected slots, then dw = sum_i G relu(s), dq, dk
through the ReLU-gated 64-head x 128 indexer), against reference/dsa_indexer_bwd.py in fp64.

Shapes (issue 22, training / prefill): one sequence of `ctx` keys whose last `tokens` positions
are the queries (token i sees ctx - tokens + i + 1 keys, picks min(visible, topk) of them at
random; cuDNN's cost does not depend on which), 64 indexer heads x 128, top-k 2048 (and 512),
4k-32k queries, keys up to 64k; a batch of 2. Inputs bf16 (cuDNN's only dtype); target: random
on the valid slots, L1-normalized (the score recompute's form); predict: the softmax of the
indexer logits at the slots, computed from the same q, k, w (fp32); grad_loss a device scalar;
sm_scale 1 (DeepSeek folds its scales into the weights), loss_coeff 1.

FLOPs: 6 H D per valid slot (the recomputed scores, dK, dQ GEMMs). Bytes: the K rows gathered
(D x 2 per valid slot: L2 serves most at prefill), the dK reduction (D x 4 per valid slot, fp32
into L2), q / dq, w / dw, target, predict, indices once.

Comparator (same process, its first call outside any timing): cuDNN-frontend 1.32's
`indexer_backward_wrapper` (cudnn.deepseek_sparse_attention; sm90: kernels `ScoreGradSm90`,
`IndexerBackwardSm90`, then a torch cast of dK), inputs as 4-D (B, S, ...) with per-batch ids,
topk a multiple of 128. It overwrites attn_score with its gradient signal: its set-up copies the
target into a scratch once; later (timed) calls reuse that scratch, which changes values, not
work (no data-dependent control flow beyond the clip mask's select).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite, with_dispatch
from forgekernel.bench.suites import dsa_recompute

HEADS, DIM = 64, 128
TOPK = 2048
SM_SCALE, LOSS_COEFF = 1.0, 1.0
W_STD = 0.1  # weights ~ H^-1/2 x a learned scale: logits of O(1-10), a spread softmax
REL_TOL = 2e-2  # of each gradient's largest entry: bf16 inputs and outputs
GRAD_NAMES = ("d_q", "d_weights", "d_k")


def kernel_sources() -> list[Path]:
    """The kernel's sources, its launcher and the op's modules (the ledger key)."""
    from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import SPEC

    name = "dsa_indexer_bwd"
    return with_dispatch(SPEC.sources, f"forgekernel.kernels.attention.{name}.sm90.launch",
                         f"forgekernel.ops.{name}", f"forgekernel.reference.{name}")  # fmt: skip


def _case(tokens, ctx, *, topk=TOPK, batch=1, pad="end", group="", tag="") -> Case:
    name = f"t{tokens}-kv{ctx}-k{topk}" + (f"-b{batch}" if batch > 1 else "")
    name += ("-scattered" if pad == "scattered" else "") + (f"-{tag}" if tag else "")
    params = {"tokens": tokens, "ctx": ctx, "topk": topk, "batch": batch, "pad": pad}
    return Case(name, params, group)


BENCH_CASES = (
    _case(4096, 4096, group="prefill"),  # causal from position 0: early rows padded
    _case(4096, 8192, group="prefill"),
    _case(8192, 8192, group="prefill"),
    _case(16384, 16384, group="prefill"),
    _case(32768, 32768, group="prefill"),
    _case(4096, 65536, group="long"),
    _case(16384, 65536, group="long"),
    _case(8192, 8192, topk=512, group="topk512"),
    _case(4096, 8192, batch=2, group="batch"),
)
CHECK_CASES = (
    _case(5, 300, topk=128),
    _case(7, 90, topk=128),  # S_kv < topk: every row's tail is -1
    _case(6, 500, topk=256, pad="scattered"),
    _case(3, 400, topk=128, batch=2),
    _case(9, 3000, topk=TOPK),
    _case(300, 300, topk=256),  # causal from 0: rows of 1..256 valid slots
)


def visible(case: Case) -> list[int]:
    p = case.params
    return [p["ctx"] - p["tokens"] + i + 1 for i in range(p["tokens"])]


def _selection(case: Case, device, gen) -> torch.Tensor:
    """int32 (tokens, topk): min(visible, topk) distinct random visible keys per row, -1 after
    them or scattered through the row."""
    p = case.params
    seen = torch.tensor(visible(case), device=device)
    width = max(p["topk"], p["ctx"])
    rows = []
    for r0 in range(0, p["tokens"], 1024):  # (rows, ctx) random scores a block at a time
        s = seen[r0 : r0 + 1024]
        scores = torch.rand(s.shape[0], width, device=device, generator=gen)
        scores = scores.masked_fill(torch.arange(width, device=device) >= s[:, None], -1.0)
        top, pos = scores.topk(p["topk"], dim=1)
        rows.append(torch.where(top >= 0, pos, -1))
    pos = torch.cat(rows)
    if p["pad"] == "scattered":
        order = torch.rand(pos.shape, device=device, generator=gen).argsort(dim=1)
        pos = pos.gather(1, order)
    return pos.to(torch.int32)


def _one(case: Case, dtype, device, gen):
    from forgekernel.reference.dsa_indexer_bwd import dsa_indexer_predict_ref

    p = case.params
    rand = {"device": device, "generator": gen}
    q = torch.randn(p["tokens"], HEADS, DIM, dtype=dtype, **rand)
    k = torch.randn(p["ctx"], DIM, dtype=dtype, **rand)
    w = (W_STD * torch.randn(p["tokens"], HEADS, **rand)).to(dtype)
    idx = _selection(case, device, gen)
    valid = idx >= 0
    target = torch.rand(idx.shape, **rand).masked_fill(~valid, 0.0)
    target = target / target.sum(-1, keepdim=True).clamp(min=1e-30)
    predict = dsa_indexer_predict_ref(q, k, w, idx, sm_scale=SM_SCALE, dtype=torch.float32)
    return q, w, k, target, predict, idx


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    parts = [_one(case, dtype, device, gen) for _ in range(case.params["batch"])]
    names = ("q", "w", "k", "target", "predict", "idx")
    if len(parts) == 1:
        inputs: dict[str, Any] = dict(zip(names, parts[0]))
    else:
        inputs = {n: torch.stack([x[j] for x in parts]) for j, n in enumerate(names)}
    inputs["grad_loss"] = torch.full((1,), 1.25, device=device)
    return inputs


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    return tuple(torch.empty_like(inputs[n]) for n in ("q", "w", "k"))


def run_ours(inputs: Inputs, out: tuple | None) -> tuple:
    op = importlib.import_module("forgekernel.ops.dsa_indexer")
    i = inputs
    args = (i[n] for n in ("q", "w", "k", "target", "predict", "idx", "grad_loss"))
    grads = op.dsa_indexer_backward(*args, sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF)
    if out is None:
        return grads
    for o, g in zip(out, grads):
        o.copy_(g)
    return out


def _launcher_variant(**flags):
    """A candidate build of the kernel (launch.py flags: staged, pair) with the op's dK cast,
    timed by `bench` beside the op after its own verification (docs/attention/
    DSA_INDEXER_NOTES.md "Backward kernel, built": the candidates)."""

    def run(inputs: Inputs, out: tuple | None) -> tuple:
        from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import launch

        i = inputs
        args = (i[n] for n in ("q", "w", "k", "target", "predict", "idx", "grad_loss"))
        dq, dw, dk = launch.dsa_indexer_bwd(*args, SM_SCALE, LOSS_COEFF, False, **flags)
        grads = (dq, dw, dk.to(i["k"].dtype))
        if out is None:
            return grads
        for o, g in zip(out, grads):
            o.copy_(g)
        return out

    return run


def variants(case: Case) -> dict[str, Any]:
    """Every case: the forms the standard (pair + staged since 2026-12-05) replaced beside it:
    `swap` (one CTA, the lane-pair swap: the standard until then), `staged` (one CTA) and `pair`
    (the swap's reductions)."""
    return {
        "swap": _launcher_variant(staged=False, pair=False),
        "staged": _launcher_variant(staged=True, pair=False),
        "pair": _launcher_variant(staged=False, pair=True),
    }


def _flat(inputs: Inputs):
    names = ("q", "k", "w", "idx", "target", "predict")
    if inputs["q"].dim() == 3:
        yield tuple(inputs[n] for n in names)
        return
    for b in range(inputs["q"].shape[0]):
        yield tuple(inputs[n][b] for n in names)


def reference(inputs: Inputs) -> tuple:
    """fp64 (d_q, d_weights, d_k), per sequence of the batch."""
    from forgekernel.reference.dsa_indexer_bwd import dsa_indexer_kl_backward_ref

    rows = inputs["q"].shape[0] * (inputs["q"].shape[1] if inputs["q"].dim() == 4 else 1)
    scale = float(inputs["grad_loss"]) * LOSS_COEFF / rows
    parts = [
        dsa_indexer_kl_backward_ref(*x, grad_scale=scale, sm_scale=SM_SCALE, dtype=torch.float64)
        for x in _flat(inputs)
    ]
    if inputs["q"].dim() == 3:
        return parts[0]
    return tuple(torch.stack([p[j] for p in parts]) for j in range(3))


def judge(inputs: Inputs, outs: tuple) -> list[dict[str, Any]]:
    """Each gradient within REL_TOL of its reference's largest entry (bf16 in and out)."""
    verdicts = []
    for name, got, want in zip(GRAD_NAMES, outs, reference(inputs)):
        scale = float(want.abs().max()) if want.numel() else 0.0
        err = float((got.double() - want).abs().max()) if want.numel() else 0.0
        finite = bool(torch.isfinite(got).all())
        bound = REL_TOL * scale + 1e-7
        ok = finite and err <= bound
        message = (
            ""
            if ok
            else f"{name}: error {err:.3g} > {bound:.3g}"
            + ("" if finite else " (non-finite values)")
        )
        verdicts.append({"ok": ok, "err": err, "lowprec_err": 0.0,
                         "rel_err": err / max(scale, 1e-30), "bound": bound,
                         "message": message})  # fmt: skip
    return verdicts


def _cudnn():
    wrapper = dsa_recompute.cudnn_dsa_wrapper("indexer_backward_wrapper")
    if wrapper is None:
        return None

    def setup(inputs: Inputs):
        four = inputs["q"].dim() == 4
        names = ("q", "w", "k", "target", "predict", "idx")
        q, w, k, target, predict, idx = (inputs[n] if four else inputs[n][None] for n in names)
        if q.dtype != torch.bfloat16 or idx.shape[-1] % 128:
            raise ValueError("cuDNN's indexer backward takes bf16 and topk % 128 == 0")
        scratch = target.clone()  # overwritten with its gradient signal

        def call():
            res = wrapper(q, w, k, scratch, predict, idx, inputs["grad_loss"],
                          sm_scale=SM_SCALE, loss_coeff=LOSS_COEFF)  # fmt: skip
            grads = (res["d_index_q"], res["d_weights"], res["d_index_k"])
            return grads if four else tuple(g[0] for g in grads)

        first = call()
        return call, first

    def run(inputs: Inputs):
        if "cudnn" not in inputs:
            inputs["cudnn"] = setup(inputs)
            return inputs["cudnn"][1]  # the call on the true target
        return inputs["cudnn"][0]()

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cudnn": None}
    return {"cudnn": _cudnn()}


def valid_slots(case: Case) -> int:
    p = case.params
    return p["batch"] * sum(min(v, p["topk"]) for v in visible(case))


def flops(case: Case) -> float:
    return 6.0 * HEADS * DIM * valid_slots(case)


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    size = torch.empty((), dtype=dtype).element_size()
    tokens = p["batch"] * p["tokens"]
    per_token = 2 * HEADS * (DIM + 1) * size + p["topk"] * (4 + 4 + 4)  # q, dq, w, dw; lists
    keys = p["batch"] * p["ctx"] * DIM * (size + 4)  # dk written (and its fp32 accumulator)
    return valid_slots(case) * DIM * (size + 4) + tokens * per_token + keys


def suite() -> OpSuite:
    return OpSuite(
        name="dsa_indexer_bwd",
        kernel_sources=kernel_sources(),
        leaf="kernels/attention/dsa_indexer_bwd/sm90",
        dtypes=(torch.bfloat16,),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=reference,  # unused: the judge holds the yardstick
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        bench_dtypes=(torch.bfloat16,),
        sanitize_cases=CHECK_CASES[:3],
        judge=judge,
        variants=variants,
    )
