"""The DSA sparse backward v1 kernel's time split at a suite point (docs/attention/
DSA_BWD_NOTES.md, "Kernel v1": the prediction and its falsifiers):

    python3 scripts/time_dsa_bwd_kernel.py [S H TOPK S_KV]      (default 4096 16 2048 8192)

One line each, ms a launch (graph replays, `runtime.timing.time_interleaved`): the op (q and the
combined cache read in place, the preprocess kernel, the kernel, the dkv cast; the gradients
views); the launcher alone (the torch preprocess, zeroed accumulator, the default: the v1 kernel
at H 16 and 32, xchg4s, red4s under xchg; the h64 kernels at H a multiple of 64, where
`launcher, v1` is the v1 kernel, h64=False, the default before 2026-12-06); the v1 lines below
all pass h64=False: xchg4s with the probe build whose dkv reductions never run
(`params_for(..., reduce=False)`: the MMA / gather / softmax side alone); the same for xchg
without red4s's staging (no reductions); the `red4s` candidate (S^T / dP^T split over the heads:
the standard form before 2026-12-04 04:23, after an agreement check) with and without
reductions; the fragments' red.global.add.v2 (`launcher, v2`: both blocks' form before red4s)
with and without reductions (`v2, no reductions`: the 00:37 probe's `launcher, no reductions`);
the preprocess alone (torch: the launcher's `preprocess`), the preprocess kernel alone
(kernels/attention/dsa_sparse_bwd_pre, the d_sink sum over tokens included), the launcher with
the preprocess kernel's results (`pre=`: what the op runs), and the op given q and the cache as
separate tensors (the two concatenations the v1 kernel's one-row interface still costs;
docs/attention/DSA_BWD_NOTES.md "Torch around the kernel"). At H a multiple of 64 (where
`launcher` is the fused kernel, kernel_h64f.py) also, after an agreement check against v1, the
fused kernel without reductions (`h64f, no reductions`: its MMA / gather / softmax side alone;
docs/attention/DSA_BWD_NOTES.md "H >= 64: dq back in the tile loop"), and the two-kernel h64
form before it (kernel_h64.py, h64_fused=False): `launcher, split`, its kv part without
reductions (with the dq part), its kv part with the v2 reductions, and its dq part alone
(`h64 dq part`: the second gather and dq = dS K; "H >= 64: one gather a token").
Where the default sweeps (`launch.sweeps_by_default`), the launcher without the sweep
(`launcher, no sweep`: the index rows as given, one launch), and over the L2 where it does not,
with it (`launcher, sweep`); the other v1 / fused lines take the launcher's default, the sweep
included; the split form never sweeps. At two or more 64-head
blocks (H >= 128), after an agreement check, the fused kernel without the sweep on precomputed
preprocess results as one launch (`h64f, pre, no sweep`: a token's head blocks adjacent CTAs)
and as one launch a head block (`h64f, head blocks apart`: the CTA order before 2026-12-06).
docs/attention/DSA_BWD_NOTES.md "Long caches" predicts these lines.
The kernel at 5504 FLOP per (token, head, entry). Build first: `python3 -m forgekernel build
--only dsa_sparse_bwd_sm90 --only dsa_sparse_bwd_pre_sm90 --candidates`."""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import config, launch  # noqa: E402
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import (  # noqa: E402
    launch as pre_launch,
)
from forgekernel.ops.dsa_bwd import dsa_sparse_attention_backward  # noqa: E402
from forgekernel.runtime.timing import time_interleaved  # noqa: E402

WIDTH, LATENT = 576, 512


def _agrees(args, name: str, **flags) -> bool:
    """One call of candidate `name` (launcher flags `flags`) against the v1 kernel's standard
    build (h64=False): its lines are timed only if dq and dkv agree within 2e-2 of the largest
    entry (fp32 atomics in another order; a fault here stops the probe before any timing)."""
    want = launch.dsa_sparse_bwd(*args, h64=False)
    got = launch.dsa_sparse_bwd(*args, **flags)
    torch.cuda.synchronize()
    errs = [float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(got, want)]
    ok = all(e <= 2e-2 for e in errs)
    verdict = "timed" if ok else "SKIPPED"
    print(f"{name} vs default: dq, dkv, d_sink relative errors {errs} ({verdict})")
    return ok


def _h64_dq_part(q, kv, idx):
    """The h64 dq part alone on a random dS workspace (the kernel as the launcher calls it)."""
    from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import SPEC
    from forgekernel.runtime.cache import get_kernel

    rows = config.h64_workspace_rows(idx.shape[1])
    ws = torch.randn(q.shape[0], rows, q.shape[1], device=q.device).to(q.dtype)
    dq = torch.empty_like(q)
    dq_heads = config.h64_dq_heads(q.shape[1])
    kernel = get_kernel(SPEC, config.params_h64("bfloat16", "dq", dq_heads=dq_heads))
    return lambda: kernel(kv, idx, ws, dq)


def _head_blocks(q, kv, dout, out, lse, sink, idx, scale) -> dict:
    """At two or more 64-head blocks: the fused kernel without the sweep on the preprocess
    kernel's results (computed once, outside the timing) as one launch (a token's head blocks
    adjacent CTAs, the order since 2026-12-06) and as one launch a 64-head block (each launch's
    CTAs one head block of every token: the order before, head block 0 of every token ahead of
    head block 1; its only other costs, a dkv zeroing and a launch a block, are ~0.1 ms at S_kv
    65536). DSA_BWD_NOTES.md "Long caches" predicts their ratio; the lines are timed after the
    two forms' dq and summed dkv agree."""
    pre = pre_launch.preprocess(out, dout, lse, None, sink)
    together = (q, kv, dout, out, lse, None, sink, idx, scale)
    plain = {"sweep": False}  # the index rows as given, one launch: the order alone differs

    def apart():
        parts = []
        for h0 in range(0, q.shape[1], 64):
            hs = slice(h0, h0 + 64)
            part = (q[:, hs], kv, dout[:, hs], out[:, hs], lse[:, hs], None, sink[hs], idx, scale)
            part_pre = (pre[0][:, hs], pre[1][:, hs], pre[2][hs])
            parts.append(launch.dsa_sparse_bwd(*part, pre=part_pre, **plain))
        return parts

    want = launch.dsa_sparse_bwd(*together, pre=pre, **plain)
    parts = apart()
    got = (torch.cat([p[0] for p in parts], 1), sum(p[1] for p in parts))
    torch.cuda.synchronize()
    errs = [float((a - b).abs().max() / (b.abs().max() + 1e-6)) for a, b in zip(got, want)]
    ok = all(e <= 2e-2 for e in errs)
    print(f"head blocks apart vs together: dq, dkv relative errors {errs} "
          f"({'timed' if ok else 'SKIPPED'})")  # fmt: skip
    if not ok:
        return {}
    return {
        "h64f, pre, no sweep": lambda: launch.dsa_sparse_bwd(*together, pre=pre, **plain),
        "h64f, head blocks apart": apart,
    }


def main(s: int = 4096, h: int = 16, topk: int = 2048, s_kv: int = 8192) -> None:
    torch.manual_seed(0)
    dev, dt, scale = torch.device("cuda"), torch.bfloat16, WIDTH**-0.5
    q = torch.randn(s, h, WIDTH, device=dev).to(dt)
    kv = torch.randn(s_kv, WIDTH, device=dev).to(dt)
    idx = torch.rand(s, s_kv, device=dev).argsort(-1)[:, :topk].int().contiguous()
    out = torch.randn(s, h, LATENT, device=dev).to(dt)
    dout = torch.randn(s, h, LATENT, device=dev).to(dt)
    lse = torch.full((s, h), 12.0, device=dev)  # finite: every P is computed, none overflows
    sink = torch.randn(h, device=dev)
    cache = kv.view(s_kv, 1, 1, WIDTH)
    args = (q, kv, dout, out, lse, None, sink, idx, scale)

    def op():
        return dsa_sparse_attention_backward(
            q[..., :LATENT], q[..., LATENT:], cache, None, idx, dout, softmax_scale=scale,
            out=out, lse=lse, attn_sink=sink,
        )  # fmt: skip

    fns = {
        "op (the kernel)": op,
        "launcher": lambda: launch.dsa_sparse_bwd(*args),
    }
    v1 = {"h64": False}
    if launch.h64_unsupported(q) is None:
        fns["launcher, v1"] = lambda: launch.dsa_sparse_bwd(*args, **v1)
    if launch.sweeps_by_default(s_kv, topk, launch.ctas_per_token(h), None):
        fns["launcher, no sweep"] = lambda: launch.dsa_sparse_bwd(*args, sweep=False)
    elif s_kv * config.SWEEP_ROW_BYTES > config.SWEEP_L2_BYTES:  # over the L2, not swept
        fns["launcher, sweep"] = lambda: launch.dsa_sparse_bwd(*args, sweep=True)
    fns |= {
        "xchg4s, no reductions": lambda: launch.dsa_sparse_bwd(
            *args, reduce=False, xchg=True, red4s=True, **v1
        ),
        "xchg, no reductions": lambda: launch.dsa_sparse_bwd(
            *args, reduce=False, xchg=True, red4s=False, **v1
        ),
    }
    if _agrees(args, "red4s", xchg=False, **v1):  # the standard form before 04:23
        fns |= {
            "launcher, red4s": lambda: launch.dsa_sparse_bwd(*args, xchg=False, **v1),
            "red4s, no reductions": lambda: launch.dsa_sparse_bwd(
                *args, reduce=False, xchg=False, red4s=True, **v1
            ),
        }
    fns["launcher, v2"] = lambda: launch.dsa_sparse_bwd(*args, xchg=False, red4s=False, **v1)
    fns["v2, no reductions"] = lambda: launch.dsa_sparse_bwd(
        *args, reduce=False, xchg=False, red4s=False, **v1
    )
    if launch.h64_unsupported(q) is None and _agrees(args, "h64f", h64=True):
        fns["h64f, no reductions"] = lambda: launch.dsa_sparse_bwd(*args, reduce=False)
        if h >= 128:
            fns |= _head_blocks(q, kv, dout, out, lse, sink, idx, scale)
    split = {"h64": True, "h64_fused": False}
    if launch.h64_unsupported(q) is None and _agrees(args, "h64 split", **split):
        fns |= {
            "launcher, split": lambda: launch.dsa_sparse_bwd(*args, **split),
            "split, no reductions": lambda: launch.dsa_sparse_bwd(*args, reduce=False, **split),
            "split, v2": lambda: launch.dsa_sparse_bwd(*args, h64=True, h64_v2=True),
            "h64 dq part": _h64_dq_part(q, kv, idx),
        }
    qn, qp = q[..., :LATENT].contiguous(), q[..., LATENT:].contiguous()
    ckv, kpe = kv[:, :LATENT].contiguous(), kv[:, LATENT:].contiguous()

    def op_apart():  # q and the cache as separate tensors: the op concatenates them
        return dsa_sparse_attention_backward(
            qn, qp, ckv.view(s_kv, 1, LATENT), kpe.view(s_kv, 1, WIDTH - LATENT), idx, dout,
            softmax_scale=scale, out=out, lse=lse, attn_sink=sink,
        )  # fmt: skip

    fns |= {
        "preprocess": lambda: launch.preprocess(out, dout, lse, None, sink),
        "preprocess kernel": lambda: pre_launch.preprocess(out, dout, lse, None, sink),
        "launcher, pre kernel": lambda: launch.dsa_sparse_bwd(
            *args, pre=pre_launch.preprocess(out, dout, lse, None, sink)
        ),
        "op, q / cache apart": op_apart,
    }
    samples = time_interleaved(fns, reps=10)
    flop = 5504.0 * s * h * topk
    print(f"S {s} H {h} top-{topk} S_kv {s_kv}, ms a launch (median of 10 samples):")
    for name, x in samples.items():
        ms = median(x)
        print(f"  {name:26s} {ms:8.3f} ms  {flop / ms / 1e9:7.1f} TFLOP/s")


if __name__ == "__main__":
    main(*(int(x) for x in sys.argv[1:5]))
