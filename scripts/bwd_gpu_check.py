"""GPU check of the sm90 attention backward (torch only, no DSL; kernels from the bundle or cache).

For each shape and dtype: fresh randn inputs, o and lse from an fp32 reference forward, dq/dk/dv
NaN-poisoned, then `attention_bwd`; each gradient's max abs error against fp32 autograd of the
fp32 reference must be <= 2 x the error of the same math run by torch in the input dtype + 1e-3.
Then a bitwise repeat check of deterministic=True (3 runs), then timings against cuDNN SDPA.

    python scripts/bwd_gpu_check.py [--quick] [--no-bench]
"""

from __future__ import annotations

import argparse
import sys

import torch

from forgekernel.kernels.attention.bwd.sm90.launch import attention_bwd

# (b, hq, hkv, sq, sk, d, dv, causal)
SHAPES = [
    (2, 4, 4, 128, 128, 128, 128, True),
    (2, 4, 4, 128, 128, 128, 128, False),
    (1, 8, 2, 1000, 1000, 128, 128, True),
    (2, 4, 1, 17, 17, 64, 64, False),
    (2, 4, 1, 17, 17, 64, 64, True),
    (1, 2, 2, 1, 1, 64, 64, False),
    (1, 2, 1, 1, 17, 128, 128, True),
    (1, 4, 4, 4097, 4097, 64, 64, True),
    (1, 4, 4, 100, 1000, 128, 128, True),
    (1, 4, 4, 1000, 100, 128, 128, True),
    (1, 4, 4, 1000, 100, 64, 64, False),
    (1, 8, 8, 512, 512, 192, 128, True),
    (1, 8, 8, 300, 700, 192, 128, False),
    # D=192 / Dv=128 (column-split layout, 64-key blocks): GQA, causal and not, lengths off
    # every tile, Sq < Sk and Sq > Sk, one token
    (2, 16, 2, 512, 512, 192, 128, True),
    (1, 16, 4, 1000, 1000, 192, 128, False),
    (2, 4, 1, 17, 17, 192, 128, True),
    (1, 4, 1, 1000, 1003, 192, 128, True),
    (1, 4, 4, 100, 1000, 192, 128, True),
    (1, 4, 2, 1000, 100, 192, 128, True),
    (1, 4, 2, 1000, 100, 192, 128, False),
    (1, 2, 1, 1, 65, 192, 128, True),
    (1, 2, 2, 4097, 4097, 192, 128, True),
]
QUICK = SHAPES[:5]
# varlen: (lens_q, lens_k, hq, hkv, d, causal, deterministic[, dv]); empty sequences on both
# sides
VARLEN_SHAPES = [
    ((1, 17, 1000, 300), (1, 17, 1000, 300), 8, 2, 128, True, False),
    ((100, 0, 513, 64), (200, 7, 513, 0), 4, 4, 64, False, False),
    ((129, 700, 5), (300, 65, 5), 4, 1, 128, True, True),
    ((255, 0, 1), (1, 9, 130), 2, 2, 64, True, False),
    # D=192 / Dv=128: key blocks of 64 ending inside a sequence, one deterministic
    ((1, 17, 1000, 300), (1, 17, 1000, 300), 8, 2, 192, True, False, 128),
    ((100, 0, 513, 64), (200, 7, 513, 0), 4, 4, 192, False, False, 128),
    ((129, 700, 5), (300, 65, 5), 4, 1, 192, True, True, 128),
]


def reference(q, k, v, scale, causal):
    """softmax(scale q k^T + mask) v in the tensors' dtype; (B, S, H, D) layout; rows that see
    no key give 0. Returns (o, lse) with lse (B, H, Sq) fp32 (-inf for empty rows)."""
    b, sq, hq, d = q.shape
    sk, hkv = k.shape[1], k.shape[2]
    g = hq // hkv
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(g, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(g, dim=1)
    s = torch.matmul(qh, kh.transpose(-1, -2)) * scale
    if causal:
        i = torch.arange(sq, device=q.device)[:, None]
        j = torch.arange(sk, device=q.device)[None, :]
        mask = j > i + sk - sq
        s = s.masked_fill(mask, float("-inf"))
        # rows with no visible key: a finite softmax input, then P = 0 (no NaN in autograd)
        empty = mask.all(dim=-1)[:, None]
    else:
        empty = None
    with torch.no_grad():
        lse = torch.logsumexp(s.float(), dim=-1)
    if empty is not None:
        s = s.masked_fill(empty, 0.0)
    p = torch.softmax(s, dim=-1)
    if empty is not None:
        p = p.masked_fill(empty, 0.0)
    o = torch.matmul(p, vh).transpose(1, 2)
    return o, lse


def grads(q, k, v, do, scale, causal):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    o, _ = reference(q, k, v, scale, causal)
    o.backward(do)
    return q.grad, k.grad, v.grad


def run_case(shape, dtype, deterministic=False):
    b, hq, hkv, sq, sk, d, dv, causal = shape
    dev = "cuda"
    scale = d**-0.5
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, device=dev, dtype=dtype)
    do = torch.randn(b, sq, hq, dv, device=dev, dtype=dtype)
    with torch.no_grad():
        o32, lse = reference(q.float(), k.float(), v.float(), scale, causal)
    o = o32.to(dtype).contiguous()
    lse = lse.contiguous()
    dq = torch.full_like(q, float("nan"))
    dk = torch.full_like(k, float("nan"))
    dvv = torch.full_like(v, float("nan"))
    attention_bwd(q, k, v, o, lse, do, dq, dk, dvv, scale, causal, deterministic=deterministic)
    torch.cuda.synchronize()
    ref = grads(q.float(), k.float(), v.float(), do.float(), scale, causal)
    same = grads(q, k, v, do, scale, causal)
    rows = []
    ok = True
    for name, ours, r, s in zip(("dq", "dk", "dv"), (dq, dk, dvv), ref, same):
        finite = bool(torch.isfinite(ours).all())
        err = (ours.float() - r).abs().max().item() if ours.numel() else 0.0
        err_t = (s.float() - r).abs().max().item() if s.numel() else 0.0
        good = finite and err <= 2 * err_t + 1e-3
        ok &= good
        rows.append(f"{name} err {err:.2e} torch {err_t:.2e}{'' if finite else ' NONFINITE'}")
    return ok, rows


def run_varlen_case(case, dtype):
    """Packed sequences through the varlen launcher against per-sequence fixed-length
    references (fp32 autograd and the same math in the input dtype)."""
    lens_q, lens_k, hq, hkv, d, causal, deterministic = case[:7]
    dv = case[7] if len(case) > 7 else d
    dev = "cuda"
    scale = d**-0.5
    tq, tk = sum(lens_q), sum(lens_k)
    q = torch.randn(tq, hq, d, device=dev, dtype=dtype)
    k = torch.randn(tk, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(tk, hkv, dv, device=dev, dtype=dtype)
    do = torch.randn(tq, hq, dv, device=dev, dtype=dtype)
    cu_q = torch.tensor([0, *torch.tensor(lens_q).cumsum(0).tolist()], dtype=torch.int32)
    cu_k = torch.tensor([0, *torch.tensor(lens_k).cumsum(0).tolist()], dtype=torch.int32)
    o = torch.zeros(tq, hq, dv, device=dev, dtype=dtype)
    lse = torch.full((hq, tq), float("-inf"), device=dev)
    ref = [torch.zeros(t.shape, device=dev) for t in (q, k, v)]
    same = [torch.zeros(t.shape, device=dev) for t in (q, k, v)]
    bounds = list(zip(cu_q.tolist(), cu_q[1:].tolist(), cu_k.tolist(), cu_k[1:].tolist()))
    for q0, q1, k0, k1 in bounds:
        if q1 == q0 or k1 == k0:
            continue  # o = 0, lse = -inf, gradients 0
        qs, ks, vs, dos = q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], do[None, q0:q1]
        with torch.no_grad():
            o32, l32 = reference(qs.float(), ks.float(), vs.float(), scale, causal)
        o[q0:q1] = o32[0].to(dtype)
        lse[:, q0:q1] = l32[0]
        for acc, g in ((ref, grads(qs.float(), ks.float(), vs.float(), dos.float(), scale,
                                    causal)),
                       (same, grads(qs, ks, vs, dos, scale, causal))):  # fmt: skip
            acc[0][q0:q1] = g[0][0].float()
            acc[1][k0:k1] = g[1][0].float()
            acc[2][k0:k1] = g[2][0].float()
    dq, dk, dvv = (torch.full_like(t, float("nan")) for t in (q, k, v))
    attention_bwd(
        q, k, v, o, lse, do, dq, dk, dvv, scale, causal, deterministic=deterministic,
        cu_seqlens_q=cu_q.to(dev), cu_seqlens_k=cu_k.to(dev),
        max_seqlen_q=max(lens_q), max_seqlen_k=max(lens_k),
    )  # fmt: skip
    torch.cuda.synchronize()
    rows, ok = [], True
    for name, ours, r, s_ in zip(("dq", "dk", "dv"), (dq, dk, dvv), ref, same):
        finite = bool(torch.isfinite(ours).all())
        err = (ours.float() - r).abs().max().item() if ours.numel() else 0.0
        err_t = (s_ - r).abs().max().item() if s_.numel() else 0.0
        good = finite and err <= 2 * err_t + 1e-3
        ok &= good
        rows.append(f"{name} err {err:.2e} torch {err_t:.2e}{'' if finite else ' NONFINITE'}")
    return ok, rows


def check_deterministic(shape, dtype, runs=3):
    b, hq, hkv, sq, sk, d, dv, causal = shape
    dev = "cuda"
    scale = d**-0.5
    torch.manual_seed(1)
    q = torch.randn(b, sq, hq, d, device=dev, dtype=dtype)
    k = torch.randn(b, sk, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(b, sk, hkv, dv, device=dev, dtype=dtype)
    do = torch.randn(b, sq, hq, dv, device=dev, dtype=dtype)
    with torch.no_grad():
        o32, lse = reference(q.float(), k.float(), v.float(), scale, causal)
    o = o32.to(dtype).contiguous()
    outs = []
    for _ in range(runs):
        dq, dk, dvv = (torch.full_like(t, float("nan")) for t in (q, k, v))
        attention_bwd(q, k, v, o, lse, do, dq, dk, dvv, scale, causal, deterministic=True)
        outs.append((dq, dk, dvv))
    torch.cuda.synchronize()
    return all(torch.equal(a, b_) for run in outs[1:] for a, b_ in zip(outs[0], run))


def time_ms(fn, warmup=3, iters=10):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e))
    times.sort()
    return times[len(times) // 2]


def bench(b, hq, hkv, s, d, causal, dtype=torch.bfloat16, dv=None):
    dev = "cuda"
    dv = d if dv is None else dv
    scale = d**-0.5
    q = torch.randn(b, s, hq, d, device=dev, dtype=dtype)
    k = torch.randn(b, s, hkv, d, device=dev, dtype=dtype)
    v = torch.randn(b, s, hkv, dv, device=dev, dtype=dtype)
    do = torch.randn(b, s, hq, dv, device=dev, dtype=dtype)
    # o, lse from cuDNN/flash SDPA forward (any correct forward will do for timing)
    from torch.nn.attention import SDPBackend, sdpa_kernel

    qh, kh, vh = (t.transpose(1, 2) for t in (q, k, v))
    g = hq // hkv
    with torch.no_grad():
        lse = torch.empty(b, hq, s, device=dev, dtype=torch.float32)
        o = torch.empty_like(do)
        # chunked fp32-free LSE: per head group, via bf16 matmuls in fp32 accumulate
        for h in range(hq):
            sc = torch.matmul(qh[:, h].float(), kh[:, h // g].float().transpose(-1, -2)) * scale
            if causal:
                i = torch.arange(s, device=dev)[:, None]
                j = torch.arange(s, device=dev)[None, :]
                sc.masked_fill_(j > i, float("-inf"))
            lse[:, h] = torch.logsumexp(sc, dim=-1)
            o[:, :, h] = torch.matmul(torch.softmax(sc, -1), vh[:, h // g].float()).to(dtype)
            del sc
    dq, dk, dvv = torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)

    def ours():
        attention_bwd(q, k, v, o, lse, do, dq, dk, dvv, scale, causal)

    def ours_det():
        attention_bwd(q, k, v, o, lse, do, dq, dk, dvv, scale, causal, deterministic=True)

    t_ours = time_ms(ours)
    t_det = time_ms(ours_det)
    fwd = 2 * b * hq * s * s * (d + dv) * (0.5 if causal else 1.0)
    flops = 2.5 * fwd

    t_cudnn = float("nan")
    try:
        qg, kg, vg = (t.transpose(1, 2).detach().requires_grad_(True) for t in (q, k, v))
        if g > 1:
            kx = kg.repeat_interleave(g, dim=1)
            vx = vg.repeat_interleave(g, dim=1)
        else:
            kx, vx = kg, vg
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            out = torch.nn.functional.scaled_dot_product_attention(
                qg, kx, vx, is_causal=causal, scale=scale
            )
            doh = do.transpose(1, 2)

            def cudnn():
                torch.autograd.grad(out, (qg, kx, vx), doh, retain_graph=True)

            t_cudnn = time_ms(cudnn)
    except Exception as exc:  # noqa: BLE001
        print(f"cuDNN comparator failed: {exc}", file=sys.stderr)
    return {
        "case": f"b{b} hq{hq} hkv{hkv} s{s} d{d}{f'/{dv}' if dv != d else ''}"
        f"{' causal' if causal else ''}",
        "ms": t_ours,
        "tflops": flops / t_ours / 1e9,
        "det_ms": t_det,
        "det_tflops": flops / t_det / 1e9,
        "cudnn_ms": t_cudnn,
        "cudnn_tflops": flops / t_cudnn / 1e9 if t_cudnn == t_cudnn else float("nan"),
    }


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-bench", action="store_true")
    args = ap.parse_args()
    torch.manual_seed(0)
    failures = 0
    summary = []
    jobs = [("", shape, run_case) for shape in (QUICK if args.quick else SHAPES)]
    jobs += [
        ("varlen ", case, run_varlen_case)
        for case in (VARLEN_SHAPES[:2] if args.quick else VARLEN_SHAPES)
    ]
    for prefix, case, run in jobs:
        for dtype in (torch.bfloat16, torch.float16):
            name = f"{prefix}{case} {str(dtype).removeprefix('torch.')}"
            try:
                ok, rows = run(case, dtype)
            except NotImplementedError as exc:
                print(f"SKIP {name}: {exc}", flush=True)
                summary.append((name, "skip"))
                continue
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} {name}: {'; '.join(rows)}", flush=True)
            summary.append((name, "pass" if ok else "FAIL"))
    det_cases = [
        (2, 8, 2, 1000, 1000, 128, 128, True),
        (1, 4, 4, 4097, 4097, 64, 64, True),
        (1, 8, 2, 1000, 1000, 192, 128, True),
    ]
    for shape in det_cases:
        for dtype in (torch.bfloat16,):
            try:
                same = check_deterministic(shape, dtype)
            except NotImplementedError as exc:
                print(f"SKIP deterministic {shape}: {exc}")
                continue
            failures += not same
            print(f"{'PASS' if same else 'FAIL'} deterministic bitwise x3 {shape}", flush=True)
            summary.append((f"deterministic {shape}", "pass" if same else "FAIL"))
            ok, rows = run_case(shape, dtype, deterministic=True)
            failures += not ok
            print(f"{'PASS' if ok else 'FAIL'} deterministic accuracy {shape}: {'; '.join(rows)}")
            summary.append((f"deterministic accuracy {shape}", "pass" if ok else "FAIL"))
    results = []
    if not args.no_bench:
        for cfg in ((4, 16, 16, 8192, 128, True), (4, 32, 4, 8192, 128, True)):
            results.append(bench(*cfg))
        # DeepSeek (OPS.md): b2 hq128 s8192 d192 / dv128 causal
        results.append(bench(2, 128, 128, 8192, 192, True, dv=128))
    print()
    print(
        f"correctness: {sum(1 for _, r in summary if r == 'pass')} pass, "
        f"{sum(1 for _, r in summary if r == 'FAIL')} fail, "
        f"{sum(1 for _, r in summary if r == 'skip')} skip"
    )
    if results:
        print(
            "| case (bf16, bwd) | ours ms | TFLOP/s | determ. ms | TFLOP/s | cuDNN ms | TFLOP/s |"
        )
        print("|---|---|---|---|---|---|---|")
        for r in results:
            print(
                f"| {r['case']} | {r['ms']:.3f} | {r['tflops']:.0f} | {r['det_ms']:.3f} | "
                f"{r['det_tflops']:.0f} | {r['cudnn_ms']:.3f} | {r['cudnn_tflops']:.0f} |"
            )
    return 1 if failures else 0


if __name__ == "__main__":
    if not torch.cuda.is_available():
        print("needs a CUDA device", file=sys.stderr)
        sys.exit(2)
    sys.exit(main())
