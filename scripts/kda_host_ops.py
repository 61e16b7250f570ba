"""What one eager call of `forgekernel.ops.kda_chunked.kimi_delta_attention` asks of the host,
counted on the CPU with the kernels replaced by no-op recorders: every aten op (and those that
would launch device work: views and plain allocations launch none), the ones that read a
device value back (`_local_scalar_dense`, `nonzero`, ...), `Tensor.tolist` / `Tensor.item`
calls (which bypass the dispatcher on CPU tensors), and the ops that touch a CPU tensor (a
host-built table copied to the device: not allowed while a CUDA graph captures).

    python3 scripts/kda_host_ops.py                  # the bench's 1x2048 and mix16 cases
    python3 scripts/kda_host_ops.py --lens 5 0 64 71 # one varlen case
    python3 scripts/kda_host_ops.py --bwd-us 1       # host us a backward call, KDA and GDN
    python3 scripts/kda_host_ops.py --bwd-us 2048 --device cuda  # the bench's host line, faster

`--bwd-us`: the host microseconds one eager call of the kda_bwd and gdn_bwd suites' host cases
(`bench.harness.host_case`: 1x2048, H 16, HV 16 / 32, bf16) costs, called as the bench calls
them (`suite.run_ours(inputs, out)`) on CPU tensors with every linear-attention launcher's
compiled kernel a no-op (`no_op_launches`: the ops' device-pass dispatch and the launchers'
checks, plans and allocations run; the kernels' TVM-FFI argument conversion and launch do not),
the quietest of 25 rounds of 100 back-to-back calls (the bench's: 200, the median of 5).
`--device cuda` (a GPU): the real kernels, and the part of the time spent inside the kernels'
own calls (TVM-FFI argument conversion, the DSL's host side, the launch).

Runs against whichever forgekernel is on PYTHONPATH (a checkout of an older commit included:
only the op's public call and `launch.get_kernel` are used). `--device meta` runs the call on
meta tensors instead: any host read of a device value then raises, and every CPU tensor the
launch path builds is counted."""

from __future__ import annotations

import argparse
import contextlib
import importlib
import time
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

# ops that launch nothing on a device: views, metadata, allocations without a fill
NO_LAUNCH = {
    "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "expand",
    "narrow", "new_empty", "new_empty_strided", "permute", "select", "slice", "squeeze",
    "t", "transpose", "unsqueeze", "view", "_reshape_alias", "reshape", "unflatten",
    "flatten", "unbind", "split", "chunk", "diagonal", "_unsafe_view", "clone_view",
}  # fmt: skip
# ops that read a device value back to the host, or size their output by device values
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "tolist",
         "masked_select", "_unique2", "unique_consecutive", "repeat_interleave"}  # fmt: skip
HEAD = 128


class HostOps(TorchDispatchMode):
    """The aten ops run inside the context (by name), and those that touch a CPU tensor of one
    or more dimensions (0-d CPU tensors are scalars an op may take) while `device` is not the
    CPU."""

    def __init__(self, device: str = "cpu"):
        super().__init__()
        self.device = device
        self.names: list[str] = []
        self.on_host: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        self.names.append(name)
        out = func(*args, **(kwargs or {}))
        if self.device != "cpu":
            flat = torch.utils._pytree.tree_leaves((args, kwargs, out))
            if any(isinstance(x, torch.Tensor) and x.device.type == "cpu" and x.dim() > 0
                   for x in flat):  # fmt: skip
                self.on_host.append(name)
        return out

    def launching(self) -> list[str]:
        return [n for n in self.names if n not in NO_LAUNCH]

    def syncs(self) -> list[str]:
        return [n for n in self.names if n in SYNCS]


@contextlib.contextmanager
def _host_reads(calls: list[str]):
    """Tensor.tolist / Tensor.item / Tensor.__bool__ recorded (on CPU tensors they read memory
    without dispatching an op)."""
    saved = {name: getattr(torch.Tensor, name) for name in ("tolist", "item", "__bool__")}

    def wrap(name, fn):
        def method(self, *a, **kw):
            calls.append(name)
            return fn(self, *a, **kw)

        return method

    for name, fn in saved.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


@contextlib.contextmanager
def no_op_kernels():
    """The op's compiled kernels as no-op recorders, its CUDA checks off, its eager path on
    (a dispatch mode would otherwise route it through the custom op). Yields the kernel
    calls (spec name, compile key)."""
    op = importlib.import_module("forgekernel.ops.kda_chunked")
    launch = importlib.import_module("forgekernel.kernels.linear_attention.kda_prefill.sm90.launch")
    calls = []

    def get_kernel(spec, params):
        calls.append((spec.name, dict(params)))
        return lambda *args: None

    saved = (launch.get_kernel, op.check_cuda, op._traced)
    launch.get_kernel, op.check_cuda = get_kernel, lambda name, t: None
    op._traced = lambda *tensors: False
    try:
        yield calls
    finally:
        launch.get_kernel, op.check_cuda, op._traced = saved


LAUNCHERS = ("gdn_bwd_state", "kda_bwd_chunk", "kda_bwd_wy", "gdn_bwd_norm", "kda_prefill",
             "gdn_bwd_chunk", "gdn_bwd_factors", "gdn_bwd_fused")  # fmt: skip


@contextlib.contextmanager
def no_op_launches(timed: list[float] | None = None):
    """The backward ops' kernel path on CPU tensors (`KERNEL_DEVICES` widened) with every
    linear-attention launcher's `get_kernel` handing a no-op kernel. Yields the kernel lookups
    (spec name, compile key). `timed` (on a GPU): the real kernels instead, the seconds spent
    inside their calls (TVM-FFI conversion and launch) added to timed[0], no lookup recorded."""
    ops = [importlib.import_module(f"forgekernel.ops.{m}")
           for m in ("kda_bwd", "gated_delta_rule_bwd")]  # fmt: skip
    mods = [importlib.import_module(f"forgekernel.kernels.linear_attention.{m}.sm90.launch")
            for m in LAUNCHERS]  # fmt: skip
    calls = []

    def get_kernel(spec, params):
        calls.append((spec.name, params))
        return _no_op

    def get_timed(spec, params, real=mods[0].get_kernel):
        fn = real(spec, params)

        def call(*args):
            t0 = time.perf_counter()
            fn(*args)
            timed[0] += time.perf_counter() - t0

        return call

    saved = [(m, "get_kernel", m.get_kernel) for m in mods]
    if timed is None:
        saved += [(o, n, getattr(o, n)) for o in ops for n in ("KERNEL_DEVICES", "check_cuda")]
        for o in ops:
            o.KERNEL_DEVICES, o.check_cuda = ("cuda", "cpu"), lambda name, t: None
    for m in mods:
        m.get_kernel = get_kernel if timed is None else get_timed
    try:
        yield calls
    finally:
        for m, n, x in saved:
            setattr(m, n, x)


def _no_op(*args) -> None:
    return None


def bwd_host_us(name: str, tokens: int, device: str = "cpu", calls: int = 100,
                rounds: int = 25) -> tuple[float, float, list]:  # fmt: skip
    """The quietest round's host us a call of suite `name`'s host case (`--bwd-us`) cut to
    `tokens` tokens (64: one whole chunk, as 2048's layout; on CPU tensors the torch ops do the
    arithmetic the GPU queues, 7 ms a call at 2048 tokens on this machine), the us of it inside
    the kernels' calls (on "cuda": the real kernels, `no_op_launches`' `timed`; 0 on the CPU)
    and one call's kernel lookups (on the CPU)."""
    import dataclasses

    from forgekernel.bench.harness import host_case

    suite = importlib.import_module(f"forgekernel.bench.suites.{name}").suite()
    case = host_case(suite)
    case = dataclasses.replace(case, params={**case.params, "lens": [tokens]})
    x = suite.make_inputs(case, torch.bfloat16, torch.device(device),
                          torch.Generator(device).manual_seed(0))  # fmt: skip
    out = suite.alloc_out(x)
    cuda = device == "cuda"
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    timed = [0.0] if cuda else None
    rows = []
    with no_op_launches(timed) as kernels:
        suite.run_ours(x, out)
        sync()
        one = list(kernels)
        for _ in range(rounds):  # the bench's timer: back to back, synced at the round's end
            sync()
            if cuda:
                timed[0] = 0.0
            t0 = time.perf_counter()
            for _ in range(calls):
                suite.run_ours(x, out)
            us = (time.perf_counter() - t0) / calls * 1e6
            rows.append((us, timed[0] / calls * 1e6 if cuda else 0.0))
            sync()
    us, inside = min(rows)
    return us, inside, one


def inputs(lens: list[int], h: int = 16, hv: int = 16, device: str = "cpu", seed: int = 0):
    """The bench's inputs (bf16 q, k, v; fp32 g, beta, state; int32 offsets), B = 1."""
    gen = torch.Generator().manual_seed(seed)
    total = sum(lens)

    def rnd(*shape, dtype=torch.float32):
        return torch.randn(*shape, generator=gen).to(dtype).to(device)

    cu = torch.tensor([0, *torch.tensor(lens, dtype=torch.int64).cumsum(0).tolist()])
    return {
        "q": rnd(1, total, h, HEAD, dtype=torch.bfloat16),
        "k": rnd(1, total, h, HEAD, dtype=torch.bfloat16),
        "v": rnd(1, total, hv, HEAD, dtype=torch.bfloat16),
        "g": -torch.rand(1, total, hv, HEAD, generator=gen).to(device),
        "beta": torch.rand(1, total, hv, generator=gen).to(device),
        "initial_state": rnd(len(lens), hv, HEAD, HEAD),
        "cu_seqlens": cu.to(torch.int32).to(device),
    }


def count(x: dict, **kw) -> dict:
    """One eager call of the op on inputs x (`inputs`): the counts of the module docstring."""
    op = importlib.import_module("forgekernel.ops.kda_chunked")
    reads: list[str] = []
    device = x["q"].device.type
    with no_op_kernels() as kernels, _host_reads(reads), HostOps(device) as mode:
        op.kimi_delta_attention(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                initial_state=x["initial_state"], output_final_state=True,
                                cu_seqlens=x["cu_seqlens"], **kw)  # fmt: skip
    return {
        "ops": len(mode.names),
        "launching": len(mode.launching()),
        "syncs": mode.syncs(),
        "host_reads": reads,
        "on_host": mode.on_host,
        "kernels": [name for name, _ in kernels],
        "by_name": Counter(mode.launching()),
    }


def _mix(n: int, total: int) -> list[int]:
    from forgekernel.bench.suites.kda_prefill import _mix as mix

    return list(mix(n, total))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lens", type=int, nargs="+", help="one varlen case (default: the bench's)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "meta", "cuda"),
                    help="cuda: --bwd-us only")  # fmt: skip
    ap.add_argument("--by-name", action="store_true", help="the launching ops by name")
    ap.add_argument("--bwd-us", type=int, metavar="TOKENS",
                    help="host us a backward call at TOKENS tokens (docstring)")  # fmt: skip
    args = ap.parse_args()
    if args.bwd_us:
        torch.set_num_threads(1)  # torch's CPU thread pool spins on this shared machine
        for name in ("kda_bwd", "gdn_bwd"):
            us, inside, kernels = bwd_host_us(name, args.bwd_us, args.device)
            what = (f"real kernels, {inside:.1f} inside their calls" if args.device == "cuda"
                    else f"launches no-ops; kernels {[k for k, _ in kernels]}")  # fmt: skip
            print(f"{name} {args.device} {args.bwd_us} tokens: {us:.1f} us a call ({what})")
        return
    cases = {"custom": args.lens} if args.lens else {"1x2048": [2048], "mix16": _mix(16, 16384)}
    for name, lens in cases.items():
        got = count(inputs(lens, device=args.device))
        print(f"{name}: {got['ops']} ops, {got['launching']} launching; syncs {got['syncs']}; "
              f"host reads {got['host_reads']}; ops on CPU tensors {len(got['on_host'])}; "
              f"kernels {got['kernels']}")  # fmt: skip
        if args.by_name:
            print("   ", dict(sorted(got["by_name"].items())))


if __name__ == "__main__":
    main()
