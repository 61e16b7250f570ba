"""The bytes, aten ops and matmul FLOPs of the torch glue of Kimi Delta Attention's backward
kernel path (ops/kda_bwd.py `_backward_kernel` / `_chunk_pass`), counted on the CPU by
scripts/gdn_bwd_glue_bytes.py's `Written` mode, with the kernels (1: `_state_recurrence` x 2,
`channel_decay`, with --first-pass --wy-kernel the device pass's `out16` / `forward`; 2:
`_chunk_grads`; the WY kernel `_wy_kernel` with --wy-kernel; the q / k epilogue `_qk_grads`,
Gated DeltaNet's gdn_bwd_norm; the first pass with --first-pass) replaced by stubs that
allocate their outputs of the launchers' shapes and dtypes uncounted. Everything is per
token-head (token x value head) and grouped by the forgekernel source line that called the op.

    python3 scripts/kda_bwd_glue_bytes.py            # 1 x 2048, H = HV = 16, bf16, l2norm
    python3 scripts/kda_bwd_glue_bytes.py --t 256 --h 2 --hv 4 --no-l2norm
    python3 scripts/kda_bwd_glue_bytes.py --wy-kernel   # WY_IN_KERNEL: the WY half stubbed
    python3 scripts/kda_bwd_glue_bytes.py --first-pass --wy-kernel --launchers --ops
        # the default device pass with its launchers' own torch (as_tma_ready copies,
        # .contiguous(), casts) counted too: only the compiled kernels stubbed; --ops lists
        # every aten op that writes in the order called (shape, MiB written / read, site)
    python3 scripts/kda_bwd_glue_bytes.py --first-pass --wy-kernel --launchers --ops \
        --fp32-gates --no-l2norm --out --b 4 --t 8192   # the bench's 4 x 8192 call

Runs against whichever forgekernel is on PYTHONPATH."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import importlib.util
from pathlib import Path

import torch


def _glue():
    """scripts/gdn_bwd_glue_bytes.py as a module (its `Written` mode and `_quiet`)."""
    path = Path(__file__).resolve().with_name("gdn_bwd_glue_bytes.py")
    spec = importlib.util.spec_from_file_location("gdn_bwd_glue_bytes", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


glue = _glue()


@contextlib.contextmanager
def stub_kernels(chunk_in_kernel: bool = True, wy_in_kernel: bool = False,
                 first_pass: bool = False):  # fmt: skip
    """Kernels 1 and 2, the WY kernel, the q / k epilogue and the forward's first pass as stubs
    giving zero outputs of the launchers' shapes and dtypes (uncounted); `chunk_in_kernel`
    False: pass 3's output side in torch (CHUNK_IN_KERNEL's fallback); `wy_in_kernel`:
    WY_IN_KERNEL (its tiles counted); `first_pass`: FACTORS_FROM_FIRST_PASS (kernel 1's factors,
    with the WY kernel its T^T, W and u too, from the first pass)."""
    bwd = importlib.import_module("forgekernel.ops.kda_bwd")

    def first(q, k, g, beta, cu_seqlens, scale, seq_len, bwd=False, v=None):
        from forgekernel.kernels.linear_attention.kda_prefill.sm90.operands import chunk_bound

        # the launcher's rows: every sequence's chunks (B NC 64), not the tokens' (B T / 64)
        rows = chunk_bound(q.shape[0], cu_seqlens.numel() - 1, seq_len) * 64
        hv, dk = g.shape[1], q.shape[2]
        out = {n: torch.zeros(rows, hv, dk, dtype=q.dtype) for n in ("q_g", "k_g", "k_d")}
        out.update(t_beta=torch.zeros(rows, hv, 64, dtype=q.dtype),
                   decay=torch.zeros(rows // 64, hv, dk))  # fmt: skip
        out["pt" if bwd else "p"] = torch.zeros(rows, hv, 64, dtype=q.dtype)  # bwd: P^T
        if bwd:
            out.update(tt=torch.zeros(rows, hv, 64, dtype=q.dtype),
                       big_g=torch.zeros(rows, hv, dk),
                       w=torch.zeros(rows, hv, dk, dtype=q.dtype),
                       u=torch.zeros(rows, hv, v.shape[-1], dtype=q.dtype))  # fmt: skip
        return out

    def state(do, pt, ke, qe, w, e_last, dht, dh0=None, out16=False, forward=False):
        b, t, hv, dv = do.shape
        dk, nc = ke.shape[-1], -(-t // 64)
        dh0 = torch.zeros(b, hv, dk, dv) if dh0 is None else dh0  # the caller's buffer
        if out16:  # the device pass: dU and dS (K, V) a chunk in the tiles' dtype
            return (torch.zeros(b, t, hv, dv, dtype=do.dtype),
                    torch.zeros(b, nc, hv, dk, dv, dtype=do.dtype), dh0)  # fmt: skip
        return (torch.zeros(b, t, hv, dv), torch.zeros(b, nc, hv, dv, dk),
                torch.zeros(b, hv, dk, dv))  # fmt: skip

    def chunk(do, u, du, q, k, h, dh, big_g, dw16=False, dg=None, dq16=False, scale=1.0,
              dq=None):  # fmt: skip
        b, t, hv, dk = q.shape
        outs = [torch.zeros(b, t, hv, dk) for _ in range(4)]
        if dw16:  # dw in the tiles' dtype (the WY kernel's operand)
            outs[2] = torch.zeros(b, t, hv, dk, dtype=do.dtype)
        if dq16:  # the op's dq in the tiles' dtype
            outs[0] = torch.zeros(b, t, hv, dk, dtype=do.dtype) if dq is None else dq
        if dg is not None:
            outs[3] = dg
        return tuple(outs)

    def wy(dw, du, tt, w, k, u, v, beta, big_g, dk, dg, dv16=False, dk16=False, dk_out=None,
           dv=None, dbeta=None):  # adds onto dk, dG  # fmt: skip
        b, t, hv, _ = dw.shape
        if dv is None:
            dv = torch.zeros(b, t, hv, du.shape[-1], dtype=dw.dtype if dv16 else torch.float32)
        if dk16:  # the op's dk in the tiles' dtype
            dk = torch.zeros_like(dw) if dk_out is None else dk_out
        return dk, dv, dg, torch.zeros(b, t, hv) if dbeta is None else dbeta

    def qk(dxs, x, scale, l2norm):
        return torch.zeros_like(x)

    names = ("_state_recurrence", "_chunk_grads", "_wy_kernel", "_qk_grads", "_first_pass",
             "CHUNK_IN_KERNEL", "WY_IN_KERNEL", "FACTORS_FROM_FIRST_PASS")  # fmt: skip
    saved = {n: getattr(bwd, n) for n in names}
    bwd._state_recurrence, bwd._chunk_grads = glue._quiet(state), glue._quiet(chunk)
    bwd._wy_kernel, bwd._qk_grads = glue._quiet(wy), glue._quiet(qk)
    bwd._first_pass = glue._quiet(first)
    bwd.CHUNK_IN_KERNEL, bwd.WY_IN_KERNEL = chunk_in_kernel, wy_in_kernel
    bwd.FACTORS_FROM_FIRST_PASS = first_pass
    try:
        yield bwd
    finally:
        for n, x in saved.items():
            setattr(bwd, n, x)


LAUNCHERS = (
    "forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.launch",
    "forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90.launch",
    "forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.launch",
    "forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90.launch",
    "forgekernel.kernels.linear_attention.kda_prefill.sm90.launch",
)


@contextlib.contextmanager
def stub_compiled(wy_in_kernel: bool = True, first_pass: bool = True):
    """The launchers as they are (their torch counted: `as_tma_ready` copies, `.contiguous()`,
    casts), only their compiled kernels stubbed (`get_kernel` giving a kernel that writes
    nothing: the outputs stay the launchers' uninitialized allocations) and the first pass's
    chunk tables (built once and cached on the GPU) uncounted; WY_IN_KERNEL and
    FACTORS_FROM_FIRST_PASS set as given (the default device pass: both)."""
    bwd = importlib.import_module("forgekernel.ops.kda_bwd")
    mods = [importlib.import_module(m) for m in LAUNCHERS]
    prefill = mods[-1]

    def get_kernel(*args, **kwargs):
        return glue._quiet(lambda *a, **kw: None)

    saved = [(m, "get_kernel", m.get_kernel) for m in mods]
    saved += [(prefill, "_tables", prefill._tables),
              (bwd, "WY_IN_KERNEL", bwd.WY_IN_KERNEL),
              (bwd, "FACTORS_FROM_FIRST_PASS", bwd.FACTORS_FROM_FIRST_PASS)]  # fmt: skip
    for m in mods:
        m.get_kernel = get_kernel
    prefill._tables = glue._quiet(prefill._tables)
    bwd.WY_IN_KERNEL, bwd.FACTORS_FROM_FIRST_PASS = wy_in_kernel, first_pass
    try:
        yield bwd
    finally:
        for m, n, x in saved:
            setattr(m, n, x)


def count(b=1, t=2048, h=16, hv=16, l2norm=True, dtype=torch.bfloat16, with_states=True,
          chunk_in_kernel=True, dk=128, dv=128, wy_in_kernel=False,
          first_pass=False, launchers=False, g_dtype=None, with_out=False):  # fmt: skip
    """`_backward_kernel` on flat inputs (g per key channel in [-1, 0), g and beta in `g_dtype`,
    default `dtype`) under `Written`; `launchers`: `stub_compiled` (the launchers' torch
    counted, the kernels' real (K, V) = (128, 128) needed) instead of `stub_kernels`;
    `with_out`: the six gradients' `out=` buffers given (the bench's call), their copies
    counted."""
    gen = torch.Generator().manual_seed(0)
    g_dtype = g_dtype or dtype

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    q, k = rnd(b * t, h, dk), rnd(b * t, h, dk)
    v, do = rnd(b * t, hv, dv), rnd(b * t, hv, dv)
    g = (-torch.rand(b * t, hv, dk, generator=gen)).to(g_dtype)
    beta = torch.rand(b * t, hv, generator=gen).to(g_dtype)
    s0 = rnd(b, hv, dk, dv, dt=torch.float32) if with_states else None
    ds = rnd(b, hv, dk, dv, dt=torch.float32) if with_states else None
    stubs = (stub_compiled(wy_in_kernel, first_pass) if launchers
             else stub_kernels(chunk_in_kernel, wy_in_kernel, first_pass))  # fmt: skip
    out = None
    if with_out:
        state = torch.empty(b, hv, dk, dv)
        out = (*(torch.empty_like(x) for x in (q, k, v, g, beta)), state)
    with stubs as bwd, glue.Written() as mode:
        bwd._backward_kernel(q, k, v, g, beta, s0, do, ds, dk**-0.5, l2norm, b, out)
    return mode


def ops_table(mode, token_heads: int) -> list[str]:
    """Every op that writes, in the order called: op, dtype, shape, MiB written / read, bytes
    (read + written) a token-head, the forgekernel line."""
    lines = ["op                   dtype     shape                          W MiB   R MiB"
             "  B/th  site"]  # fmt: skip
    for name, dtype, shape, w, r, site in mode.ops:
        lines.append(f"{name:20s} {dtype:9s} {str(shape):28s} {w / 2**20:7.1f} {r / 2**20:7.1f}"
                     f" {(w + r) / token_heads:5.0f}  {site}")  # fmt: skip
    return lines


def report(mode, token_heads: int, top: int = 0) -> list[str]:
    """The table: KB a token-head, ops and GFLOP by source line, biggest writes first."""
    th, total = token_heads, sum(mode.by_site.values())
    lines = [f"total {total / th / 1024:.2f} KB a token-head ({total / 2**20:.1f} MiB), "
             f"{sum(mode.launches.values())} aten ops that write, "
             f"{sum(mode.flops.values()) / 1e9:.3f} GFLOP in torch matmuls",
             "     KB  ops   GFLOP  site"]  # fmt: skip
    sites = mode.by_site.most_common(top or None)
    for site, n in sites:
        f = mode.flops[site] / 1e9
        lines.append(f"{n / th / 1024:7.3f} {mode.launches[site]:4d} {f:7.3f}  {site}")
    lines.append("GFLOP by site: " + "; ".join(
        f"{s.split(' ', 1)[0]} {n / 1e9:.3f}" for s, n in mode.flops.most_common()))  # fmt: skip
    lines.append("by the ops/ line that led there:\n     KB  ops   GFLOP  line")
    for site, n in mode.by_caller.most_common():
        f, ops = mode.flops_by_caller[site] / 1e9, mode.launches_by_caller[site]
        lines.append(f"{n / th / 1024:7.3f} {ops:4d} {f:7.3f}  {site}")
    lines.append("KB by op: " + str({k: round(v / th / 1024, 3)
                                     for k, v in mode.by_op.most_common()}))  # fmt: skip
    return lines


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--h", type=int, default=16)
    ap.add_argument("--hv", type=int, default=16)
    ap.add_argument("--no-l2norm", action="store_true")
    ap.add_argument("--no-states", action="store_true", help="no initial / final state")
    ap.add_argument("--torch-chunk", action="store_true",
                    help="CHUNK_IN_KERNEL = False: pass 3's output side in torch")  # fmt: skip
    ap.add_argument("--wy-kernel", action="store_true",
                    help="WY_IN_KERNEL: the WY half on its (stubbed) kernel")  # fmt: skip
    ap.add_argument("--first-pass", action="store_true",
                    help="FACTORS_FROM_FIRST_PASS: the stubbed first pass")  # fmt: skip
    ap.add_argument("--top", type=int, default=0, help="only the N biggest sites")
    ap.add_argument("--launchers", action="store_true",
                    help="the launchers' own torch counted too (only the compiled kernels "
                         "stubbed; K = V = 128)")  # fmt: skip
    ap.add_argument("--ops", action="store_true", help="every op in the order called")
    ap.add_argument("--fp32-gates", action="store_true", help="g and beta fp32 (the bench's)")
    ap.add_argument("--out", action="store_true",
                    help="the gradients' out= buffers given (the bench's call)")  # fmt: skip
    args = ap.parse_args(argv)
    mode = count(args.b, args.t, args.h, args.hv, not args.no_l2norm,
                 with_states=not args.no_states, chunk_in_kernel=not args.torch_chunk,
                 wy_in_kernel=args.wy_kernel, first_pass=args.first_pass,
                 launchers=args.launchers,
                 g_dtype=torch.float32 if args.fp32_gates else None,
                 with_out=args.out)  # fmt: skip
    token_heads = args.b * args.t * args.hv
    if args.ops:
        print("\n".join(ops_table(mode, token_heads)))
    print("\n".join(report(mode, token_heads, args.top)))


if __name__ == "__main__":
    main()
