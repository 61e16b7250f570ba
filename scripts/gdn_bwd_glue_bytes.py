"""The bytes the torch glue of the Gated DeltaNet backward's kernel path writes
(ops/gated_delta_rule_bwd.py `_backward_kernel`), counted on the CPU with the kernels (0:
factors, 1: state recurrence x 2, 2: chunk gradients, the q / k epilogue x 2) replaced by stubs
that allocate their outputs uncounted: every aten op's newly written output bytes (views and
plain allocations write none), attributed to the source line in forgekernel that called it, per
token-head (token x value head). The same mode counts the aten ops that write (each a kernel
launch on the GPU) and the FLOPs of the matmuls (torch.utils.flop_counter's registry: mm, bmm,
addmm, baddbmm; einsum and matmul reach it as those; triangular solves C^2 N), by the same
source line.
scripts/kda_bwd_glue_bytes.py counts Kimi Delta Attention's backward with this mode.

    python3 scripts/gdn_bwd_glue_bytes.py            # 1 x 2048, H 2, HV 4, bf16, l2norm
    python3 scripts/gdn_bwd_glue_bytes.py --t 1000 --no-l2norm

Runs against whichever forgekernel is on PYTHONPATH."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import traceback
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.flop_counter import flop_registry

# ops that write nothing: views, metadata, allocations without a fill
NO_WRITE = {
    "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "expand",
    "narrow", "new_empty", "new_empty_strided", "permute", "select", "slice", "squeeze",
    "t", "transpose", "unsqueeze", "view", "_reshape_alias", "reshape", "unflatten",
    "flatten", "unbind", "split", "chunk", "diagonal", "_unsafe_view", "lift_fresh",
}  # fmt: skip
PAUSED = [False]


class Written(TorchDispatchMode):
    """Bytes of every op's tensor outputs (in-place ops: the mutated argument's), by the
    calling line (file:line function) and op name; the ops that write (`launches`) and the
    matmul FLOPs (`flops`), by the same line; bytes and FLOPs by the ops/ line that led there
    (`by_caller`, `flops_by_caller`, `launches_by_caller`)."""

    def __init__(self):
        super().__init__()
        self.by_site: Counter = Counter()
        self.by_op: Counter = Counter()
        self.launches: Counter = Counter()
        self.flops: Counter = Counter()
        self.by_caller: Counter = Counter()  # bytes by the ops/ line that led there
        self.flops_by_caller: Counter = Counter()
        self.launches_by_caller: Counter = Counter()
        # every op that writes, in the order called: (op, dtype, shape, bytes written, bytes
        # of its tensor arguments (read; an in-place op's target counted), site)
        self.ops: list[tuple[str, str, tuple, int, int, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if PAUSED[0] or name in NO_WRITE:
            return out
        if name.endswith("_") or name in ("copy_", "index_put_", "fill_", "zero_"):
            written = [args[0]]
        else:
            written = [x for x in torch.utils._pytree.tree_leaves(out)
                       if isinstance(x, torch.Tensor)]  # fmt: skip
        nbytes = sum(x.numel() * x.element_size() for x in written)
        if nbytes:
            site, caller = _site()
            flops = _matmul_flops(func, args, kwargs or {}, out)
            self.by_site[site] += nbytes
            self.by_op[name] += nbytes
            self.launches[site] += 1
            self.by_caller[caller] += nbytes
            self.launches_by_caller[caller] += 1
            args_in = torch.utils._pytree.tree_leaves((args, kwargs or {}))
            read = sum(x.numel() * x.element_size() for x in args_in
                       if isinstance(x, torch.Tensor)
                       and not any(_same(x, w) for w in written))  # fmt: skip
            if name.endswith("_") and name != "copy_":  # in place: its target is read too
                read += nbytes
            dtype = str(written[0].dtype).removeprefix("torch.")
            self.ops.append((name, dtype, tuple(written[0].shape), nbytes, read, site))
            if flops:
                self.flops[site] += flops
                self.flops_by_caller[caller] += flops
        return out


def _same(x: torch.Tensor, y: torch.Tensor) -> bool:
    """The same view (an `out=` argument and the op's result)."""
    return (x.data_ptr(), x.shape, x.stride(), x.dtype) == (y.data_ptr(), y.shape, y.stride(),
                                                            y.dtype)  # fmt: skip


def _site() -> tuple[str, str]:
    """(the innermost forgekernel line, the innermost forgekernel/ops line) of the call."""
    inner = caller = "?"
    for frame in reversed(traceback.extract_stack()[:-2]):
        if "forgekernel" in frame.filename and "scripts" not in frame.filename:
            path = frame.filename.split("forgekernel/", 1)[-1]
            line = f"{path}:{frame.lineno} {frame.name}: {(frame.line or '').strip()[:60]}"
            inner = line if inner == "?" else inner
            if path.startswith("ops/"):
                caller = line
                break
    return inner, caller


def _matmul_flops(func, args, kwargs, out) -> int:
    """torch.utils.flop_counter's count (mm, bmm, addmm, baddbmm, ...); a triangular solve
    (A (..., C, C), B (..., C, N)): C^2 N a matrix."""
    if func.overloadpacket in flop_registry:
        return flop_registry[func.overloadpacket](*args, **kwargs, out_val=out)
    if func.overloadpacket.__name__ == "linalg_solve_triangular":
        c, n = args[1].shape[-2:]
        return args[1].numel() // (c * n) * c * c * n
    return 0


def _quiet(fn):
    def run(*a, **kw):
        PAUSED[0] = True
        try:
            return fn(*a, **kw)
        finally:
            PAUSED[0] = False

    return run


@contextlib.contextmanager
def stub_kernels():
    """The three kernels as stubs giving zero outputs of the launchers' shapes (uncounted)."""
    bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import wy_dtypes
    from forgekernel.reference.gdn_bwd_factors import TOKEN_TILES

    def factors(q, k, v, g, beta):
        b, t, hv = v.shape[:3]
        rows = -(-t // 64) * 64
        widths = {"w": 128, "u": 128, "pt": 64, "ke": 128, "qe": 128, "tt": 64}
        out = {n: q.new_zeros(b, rows, hv, widths[n]) for n in TOKEN_TILES}
        out["e_last"] = torch.zeros(b, rows // 64, hv)
        out["big_g"] = torch.zeros(b, rows, hv)
        return out

    def state(do, pt, ke, qe, w, e_last, dht, *rest, **kw):
        b, t, hv, dv = do.shape
        nc = -(-t // 64)
        return (torch.zeros(b, t, hv, dv), torch.zeros(b, nc, hv, dv, ke.shape[-1]),
                torch.zeros(b, hv, ke.shape[-1], dv))  # fmt: skip

    def chunk_wy(do, u, du, q, k, h, dh, big_g, *rest, dv16=False, dqk16=False, scale=1.0,
                 out=None, fsplit=False):  # fmt: skip
        if out is not None:
            return out
        b, t, hv, dv = do.shape
        shapes = ((b, t, hv, q.shape[-1]),) * 2 + ((b, t, hv), (b, t, hv, dv), (b, t, hv))
        return tuple(torch.zeros(s, dtype=dt)
                     for s, dt in zip(shapes, wy_dtypes(do, dv16, dqk16)))  # fmt: skip

    def state16(do, pt, ke, qe, w, e_last, dht, out16=False, forward=False, dh0=None):
        if not out16:
            return state(do, pt, ke, qe, w, e_last, dht)
        b, t, hv, dv = do.shape
        nc = -(-t // 64)
        return (do.new_zeros(b, t, hv, dv), do.new_zeros(b, nc, hv, ke.shape[-1], dv),
                torch.zeros(b, hv, ke.shape[-1], dv))  # fmt: skip

    def qk(dxs, x, scale, l2norm, out=None):
        return torch.zeros_like(x) if out is None else out

    names = ("_factors", "_state_recurrence", "_chunk_grads_wy", "_qk_grads")
    saved = {n: getattr(bwd, n) for n in names if hasattr(bwd, n)}
    for n, fn in zip(names, (factors, state16, chunk_wy, qk)):
        setattr(bwd, n, _quiet(fn))
    try:
        yield bwd
    finally:
        for n, fn in saved.items():
            setattr(bwd, n, fn)


def count(b=1, t=2048, h=2, hv=4, l2norm=True, dtype=torch.bfloat16, with_states=True):
    gen = torch.Generator().manual_seed(0)

    def rnd(*shape, dt=dtype):
        return torch.randn(*shape, generator=gen).to(dt)

    q, k, v, do = rnd(b * t, h, 128), rnd(b * t, h, 128), rnd(b * t, hv, 128), rnd(b * t, hv, 128)
    g = -torch.rand(b * t, hv, generator=gen)
    beta = torch.rand(b * t, hv, generator=gen)
    s0 = rnd(b, hv, 128, 128, dt=torch.float32) if with_states else None
    ds = rnd(b, hv, 128, 128, dt=torch.float32) if with_states else None
    with stub_kernels() as bwd, Written() as mode:
        bwd._backward_kernel(q, k, v, g, beta, s0, do, ds, 128**-0.5, False, l2norm, b)
    return mode


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--b", type=int, default=1)
    ap.add_argument("--t", type=int, default=2048)
    ap.add_argument("--h", type=int, default=2)
    ap.add_argument("--hv", type=int, default=4)
    ap.add_argument("--no-l2norm", action="store_true")
    args = ap.parse_args()
    mode = count(args.b, args.t, args.h, args.hv, not args.no_l2norm)
    th = args.b * args.t * args.hv
    total = sum(mode.by_site.values())
    print(f"total {total / th / 1024:.2f} KB a token-head ({total / 2**20:.1f} MiB)")
    for site, n in mode.by_site.most_common():
        print(f"{n / th / 1024:7.3f} KB  {site}")
    print("by op:", {k: round(v / th / 1024, 3) for k, v in mode.by_op.most_common()})
    print(f"{sum(mode.launches.values())} aten ops that write; "
          f"{sum(mode.flops.values()) / 1e9:.3f} GFLOP in torch matmuls")  # fmt: skip


if __name__ == "__main__":
    main()
