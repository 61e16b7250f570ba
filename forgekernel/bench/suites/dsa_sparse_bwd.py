"""DSA sparse attention backward suite (issue 22; the v1 kernel, checked 2026-12-03): the
gradients of `forgekernel.dsa_sparse_attention` in q, the latent rows and the sink from dO,
given the forward's out and KV-only LSE (`ops.dsa_bwd.dsa_sparse_attention_backward`: the
kernels of kernels/attention/dsa_sparse_bwd/sm90, after its preprocess kernel,
kernels/attention/dsa_sparse_bwd_pre/sm90, both run and sanitized by every case of the op: v1,
kernel.py, at H 16 and the fused h64 kernel, kernel_h64f.py, at H a multiple of 64;
FORGEKERNEL_DSA_BWD_KERNEL=0 runs the INTERIM fp32 torch path; docs/attention/DSA_BWD_NOTES.md
"Kernel v1", "H >= 64: one gather a token", "h64 adopted", "H >= 64: dq back in the tile loop").

Shapes (DeepSeek-V3.2 training / prefill, dsa_recompute's form): one sequence of `ctx` keys
whose last `tokens` positions are the queries, token i picking min(visible, topk) of the
positions it sees at random (the cost does not depend on which rows win); q (tokens, H, 576)
bf16 as cuDNN's, read by ours as its q_nope / q_pe views; kv (ctx, 576), ours as FlashMLA's
combined cache (ctx, 1, 1, 576) (page size 1: slot = position); H 16 (TP8), 64, 128 (TP1);
top-k 2048 (and 512); 4k-32k queries, keys 8k-64k; a sink (H,) fp32 on most cases (DeepSeek's
V3.2 has none: -inf). out / lse come from the fp32 reference forward (out rounded to q's dtype,
as a kernel writes it); dO random.

Outputs (dq_nope, dq_pe, dkv (ctx, 1, 1, 576), d_sink (H,) fp32, zeros without a sink), judged
as gdn_bwd's (`judge_gradients`): each within 2e-2 of its fp64 reference's largest entry
(reference.dsa.dsa_sparse_attention_bwd_ref in fp64, recomputing P and O from the inputs).

FLOPs: 2 x (3 x 576 + 2 x 512) = 5504 per (token, head, valid entry): S = q K^T and
dP = dO V^T recomputed, dq = dS K, dkv = dS^T q + P^T dO (cuDNN's count: its 6.25 ms at 4096 x
16 x 2048 is 118 TFLOP/s). Bytes: q, dq, dO, out (16-bit), the LSE, the valid entries' rows
read (576 x 2 each; L2 serves the shared ones), dkv written, the indices.

Comparator (same process, set up by its first call outside any timing): cuDNN-frontend 1.32's
`sparse_attention_backward_wrapper(q, kv, out, dout, lse, attn_sink, topk_idxs, softmax_scale=,
topk_length=)` (cudnn.deepseek_sparse_attention, sm90 `FlashAttentionDSABackwardSm90`): q
(S, H, 576) / kv (S_kv, 576) bf16 or fp16, out / dout (S, H, 512), lse (S, H) fp32 natural-log
KV-only, attn_sink (H,) fp32 required (-inf for none), int32 global indices; returns
{dq (q's dtype), dkv (kv's dtype, fp32 atomics into a scratch then cast), d_sink fp32}. Its
handling of -1 inside the list is not documented, so set-up compacts each row (valid entries
first, order is free), writes 0 past them, passes topk_length = the valid count and pads topk
to a multiple of its 64-row tiles, as Megatron's DSA integration sanitizes them.

Variants, each verified against the fp64 reference on the case like ours: `red4s` (every
case), the op's launches with v1's form before xchg4s (launcher h64=False, xchg=False); `was`
(H a multiple of 64: the h64 and tp1 groups), the same launches with the launcher's
h64_fused=False: the default before the fused kernel (kernel_h64.py's kv part and dq part with
the dS workspace between them, H100 2026-12-06 x17: 13.88 / 26.31 / 22.89 / 94.89 ms on the four
cases, graph), which had replaced v1's xchg4s at CTAs of 32 heads (0.64-0.84 of its time);
`unswept` / `swept` (a cache larger than the L2), the default's kernel with the launcher's
sweep=False where the default sweeps (t8192-h16-kv32768, t32768-h16-kv65536,
t8192-h128-kv65536: the index rows as given, one launch, the default before the sweep), with
sweep=True where it does not (t4096-h64-kv16384, t16384-h64-kv65536-k512; docs/attention/
DSA_BWD_NOTES.md "Long caches").
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.bench.suites import dsa_recompute, gdn_bwd
from forgekernel.bench.suites.dsa_recompute import SOFTMAX_SCALE, WIDTH, visible
from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC as BWD_SPEC
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import SPEC as PRE_SPEC
from forgekernel.kernels.attention.mla.sm90 import SPEC

LATENT = 512
GRAD_NAMES = ("dq_nope", "dq_pe", "dkv", "d_sink")
FLOPS_PER_ENTRY = 2 * (3 * WIDTH + 2 * LATENT)  # per (token, head, valid entry)
CUDNN_TOPK_MULTIPLE = 64  # its sm90 tile_n


def kernel_sources() -> list[Path]:
    """The forward kernel's sources, the backward kernel's and its preprocess kernel's (and
    their launchers) and the op's modules (the ledger key)."""
    import forgekernel.kernels.attention.dsa_sparse_bwd.sm90.launch as bwd_launch
    import forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90.launch as pre_launch
    import forgekernel.ops.dsa_bwd as bwd_op
    import forgekernel.reference.dsa as dsa_ref

    launchers = [Path(bwd_launch.__file__), Path(pre_launch.__file__)]
    return [*SPEC.sources, *BWD_SPEC.sources, *PRE_SPEC.sources, *launchers,
            Path(bwd_op.__file__), Path(dsa_ref.__file__)]  # fmt: skip


def _case(tokens, hq, ctx, *, topk=2048, pad="end", empty=0, sink=True, group="") -> Case:
    case = dsa_recompute._case(tokens, hq, ctx, topk=topk, pad=pad, empty=empty, group=group,
                               tag="" if sink else "nosink")  # fmt: skip
    return Case(case.name, {**case.params, "sink": sink}, group)


BENCH_CASES = (
    # TP8: the cuDNN point (4096 x top-2048 over 8192 keys), with and without a sink
    _case(4096, 16, 8192, group="tp8"),
    _case(4096, 16, 8192, sink=False, group="tp8"),
    _case(4096, 16, 8192, topk=512, group="tp8"),
    _case(8192, 16, 32768, group="tp8"),
    _case(32768, 16, 65536, group="tp8"),
    _case(4096, 64, 16384, group="h64"),
    _case(16384, 64, 65536, topk=512, group="h64"),
    _case(4096, 128, 8192, group="tp1"),
    _case(8192, 128, 65536, group="tp1"),
)
CHECK_CASES = (
    _case(3, 16, 300, topk=128),
    _case(5, 16, 333, topk=100, pad="scattered"),  # topk not a multiple of 64
    _case(4, 128, 90, topk=256, sink=False),  # S_kv < topk: every row's tail is -1
    _case(6, 32, 500, topk=192, empty=2),  # rows of all -1
    _case(7, 64, 1000, topk=320, pad="scattered", sink=False),
    _case(2, 16, 5000, topk=2048),
    _case(130, 16, 4000, topk=512),  # rows sharing keys: dkv sums over queries
)


def make_inputs(case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator):
    from forgekernel.reference.dsa import dsa_sparse_attention_ref

    p = case.params
    rand = {"device": device, "generator": gen}
    q = torch.randn(p["tokens"], p["hq"], WIDTH, dtype=dtype, **rand)
    kv = torch.randn(p["ctx"], WIDTH, dtype=dtype, **rand)
    idx = dsa_recompute._selection(case, device, gen)
    sink = torch.randn(p["hq"], **rand) if p["sink"] else None
    out, lse = dsa_sparse_attention_ref(q, kv, idx, SOFTMAX_SCALE, attn_sink=sink)
    dout = torch.randn(out.shape, **rand).to(dtype)
    return {"q": q, "kv": kv, "idx": idx, "sink": sink, "out": out.to(dtype), "lse": lse,
            "dout": dout}  # fmt: skip


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, ...]:
    q, kv = inputs["q"], inputs["kv"]
    rows = q.shape[:2]
    d_sink = q.new_empty(q.shape[1], dtype=torch.float32)
    return (q.new_empty(*rows, LATENT), q.new_empty(*rows, WIDTH - LATENT),
            kv.new_empty(kv.shape[0], 1, 1, WIDTH), d_sink)  # fmt: skip


def run_ours(inputs: Inputs, out: tuple | None) -> tuple:
    """The op (v1 at H 16, the fused h64 kernel at H a multiple of 64; FORGEKERNEL_DSA_BWD_KERNEL=0
    times the interim path)."""
    from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward

    i = inputs
    q, kv = i["q"], i["kv"]
    dq_nope, dq_pe, dkv, _, d_sink = dsa_sparse_attention_backward(
        q[..., :LATENT], q[..., LATENT:], kv.view(kv.shape[0], 1, 1, WIDTH), None, i["idx"],
        i["dout"], softmax_scale=SOFTMAX_SCALE, out=i["out"], lse=i["lse"],
        attn_sink=i["sink"],
    )  # fmt: skip
    if d_sink is None:
        d_sink = torch.zeros(q.shape[1], dtype=torch.float32, device=q.device)
    grads = (dq_nope, dq_pe, dkv, d_sink)
    if out is None:
        return grads
    for o, x in zip(out, grads):
        o.copy_(x)
    return out


def _run_launcher(inputs: Inputs, out: tuple | None, **forms: Any) -> tuple:
    """The op's launches (the preprocess kernel, the kernel(s), the dkv cast) with the
    launcher's `forms` (its candidate keywords)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch
    from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import launch as pre_launch

    i = inputs
    q, kv = i["q"], i["kv"]
    pre = None
    if pre_launch.unsupported(i["out"], i["dout"]) is None:
        pre = pre_launch.preprocess(i["out"], i["dout"], i["lse"], None, i["sink"])
    dq, dkv, d_sink = launch.dsa_sparse_bwd(q, kv, i["dout"], i["out"], i["lse"], None,
                                            i["sink"], i["idx"], SOFTMAX_SCALE, pre=pre,
                                            **forms)  # fmt: skip
    grads = (dq[..., :LATENT], dq[..., LATENT:], dkv.to(kv.dtype).view(-1, 1, 1, WIDTH), d_sink)
    if out is None:
        return grads
    for o, x in zip(out, grads):
        o.copy_(x)
    return out


def _run_red4s(inputs: Inputs, out: tuple | None) -> tuple:
    """v1's candidate red4s (launcher h64=False, xchg=False: S^T / dP^T split over the heads),
    its standard form before xchg4s (2026-12-04 04:23, docs/attention/DSA_BWD_NOTES.md: the
    launcher 6.597 / 29.526 ms against xchg4s's 6.064 / 27.591 at H 16 / 128)."""
    return _run_launcher(inputs, out, h64=False, xchg=False)


def _run_was(inputs: Inputs, out: tuple | None) -> tuple:
    """The default before the fused kernel at H a multiple of 64 (launcher h64_fused=False:
    kernel_h64.py's kv and dq parts, the rows gathered twice a (token, 64 heads) with a dS
    workspace between the two launches)."""
    return _run_launcher(inputs, out, h64_fused=False)


def _run_unswept(inputs: Inputs, out: tuple | None) -> tuple:
    """The default's kernel (v1 or the fused one) without the sweep (launcher sweep=False: the
    index rows as given, one launch), the default before on caches larger than the L2
    (docs/attention/DSA_BWD_NOTES.md "Long caches")."""
    return _run_launcher(inputs, out, sweep=False)


def _run_swept(inputs: Inputs, out: tuple | None) -> tuple:
    """The default's kernel with the sweep where the default does not sweep (launcher
    sweep=True: the rows sorted, one wave a launch; docs/attention/DSA_BWD_NOTES.md "Long
    caches")."""
    return _run_launcher(inputs, out, sweep=True)


def variants(case: Case) -> dict[str, Any]:
    """Every case: v1's previous form red4s (`_run_red4s`); H a multiple of 64 (the h64 and tp1
    groups, where ours runs the fused kernel): the two-kernel h64 form, the default before
    (`_run_was`); over the L2 (kv 16384 and more), the default's kernel with the sweep where the
    default does not sweep (`_run_swept`: none of the suite's on 132 SMs since the rule's refit of
    2026-12-06), without it where it does (`_run_unswept`: t8192-h16-kv32768,
    t32768-h16-kv65536, t8192-h128-kv65536, t4096-h64-kv16384, t16384-h64-kv65536-k512; the
    device's SM count decides, `launch.sweeps_by_default`)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import config, launch

    p = case.params
    forms = {"red4s": _run_red4s}
    if p["hq"] % 64 == 0:
        forms["was"] = _run_was
    if p["ctx"] * config.SWEEP_ROW_BYTES > config.SWEEP_L2_BYTES:
        ctas = launch.ctas_per_token(p["hq"])
        if launch.sweeps_by_default(p["ctx"], p["topk"], ctas, None):
            forms["unswept"] = _run_unswept
        else:
            forms["swept"] = _run_swept
    return forms


def reference(inputs: Inputs) -> tuple:
    """fp64 gradients, P and O recomputed from the inputs."""
    from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref

    i = inputs
    dq, dkv, d_sink = dsa_sparse_attention_bwd_ref(
        i["q"], i["kv"], i["idx"], SOFTMAX_SCALE, i["dout"], attn_sink=i["sink"],
        dtype=torch.float64,
    )  # fmt: skip
    if d_sink is None:
        d_sink = dq.new_zeros(dq.shape[1])
    return dq[..., :LATENT], dq[..., LATENT:], dkv.view(-1, 1, 1, WIDTH), d_sink


def judge(inputs: Inputs, outs: tuple) -> list[dict[str, Any]]:
    return gdn_bwd.judge_gradients(outs, reference(inputs), names=GRAD_NAMES)


def cudnn_inputs(inputs: Inputs) -> dict[str, torch.Tensor]:
    """cuDNN's arguments: rows compacted (valid entries first, 0 after them), topk_length the
    valid count, topk padded to CUDNN_TOPK_MULTIPLE, the sink -inf where the case has none."""
    idx = inputs["idx"]
    valid = idx >= 0
    order = torch.argsort((~valid).to(torch.int8), dim=1, stable=True)
    packed = torch.where(valid.gather(1, order), idx.gather(1, order), 0)
    pad = -packed.shape[1] % CUDNN_TOPK_MULTIPLE
    if pad:
        packed = torch.nn.functional.pad(packed, (0, pad), value=0)
    q = inputs["q"]
    sink = inputs["sink"]
    if sink is None:
        sink = torch.full((q.shape[1],), -math.inf, dtype=torch.float32, device=q.device)
    return {"topk_idxs": packed.to(torch.int32).contiguous(), "attn_sink": sink,
            "topk_length": valid.sum(1).to(torch.int32)}  # fmt: skip


def _cudnn():
    wrapper = dsa_recompute.cudnn_dsa_wrapper("sparse_attention_backward_wrapper")
    if wrapper is None:
        return None

    def run(inputs: Inputs):
        i = inputs
        if "cudnn" not in i:  # set-up (and its compile) outside any timing
            i["cudnn"] = cudnn_inputs(i)
        c = i["cudnn"]
        res = wrapper(i["q"], i["kv"], i["out"], i["dout"], i["lse"], c["attn_sink"],
                      c["topk_idxs"], softmax_scale=SOFTMAX_SCALE,
                      topk_length=c["topk_length"])  # fmt: skip
        dq, dkv = res["dq"], res["dkv"]
        return (dq[..., :LATENT], dq[..., LATENT:], dkv.view(-1, 1, 1, WIDTH), res["d_sink"])

    return run


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"cudnn": None}
    return {"cudnn": _cudnn()}


def _valid(case: Case) -> int:
    return sum(min(v, case.params["topk"]) for v in visible(case))


def flops(case: Case) -> float:
    return float(FLOPS_PER_ENTRY * case.params["hq"] * _valid(case))


def nbytes(case: Case, dtype: torch.dtype) -> float:
    p = case.params
    size = torch.empty((), dtype=dtype).element_size()
    per_token = p["hq"] * (2 * WIDTH * size + 2 * LATENT * size + 4) + p["topk"] * 4
    return p["tokens"] * per_token + _valid(case) * WIDTH * size + p["ctx"] * WIDTH * size


def suite() -> OpSuite:
    return OpSuite(
        name="dsa_sparse_bwd",
        kernel_sources=kernel_sources(),
        leaf="kernels/attention/dsa_sparse_bwd/sm90",
        dtypes=(torch.bfloat16, torch.float16),
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
        host_case=CHECK_CASES[0],
        variants=variants,
    )
