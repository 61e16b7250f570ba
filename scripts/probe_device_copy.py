"""The device copy's two forms under the bench's two timings (a probe, GPU).

`dst.copy_(src)` of contiguous tensors is a cudaMemcpyAsync; `torch.neg(src, out=dst)` an SM
elementwise kernel. Both read and write every byte; the bench's yardstick (harness.COPY_OP)
must not depend on the timing method. Prints GB/s (read + write) per form and method.

    python3 scripts/probe_device_copy.py [GiB]
"""

from __future__ import annotations

import sys

import torch

from forgekernel.bench.harness import figures
from forgekernel.runtime.timing import l2_bytes, rotation_sets, time_eager_flushed, time_interleaved


def main() -> None:
    nbytes = int(float(sys.argv[1]) * 2**30) if len(sys.argv) > 1 else 2**30
    n = rotation_sets(2 * nbytes, l2=l2_bytes())
    sets = [(torch.rand(nbytes // 4, device="cuda"), torch.empty(nbytes // 4, device="cuda"))
            for _ in range(n)]  # fmt: skip
    fns = {
        "copy_": lambda src, dst: dst.copy_(src),
        "neg": lambda src, dst: torch.neg(src, out=dst),
    }
    graph = time_interleaved(fns, rotate=sets, warmup=max(5, n), reps=30)
    eager = time_eager_flushed(fns, rotate=sets[:1], warmup=5, reps=50)
    for name in fns:
        for method, samples in (("graph", graph[name]), ("eager", eager[name])):
            fig = figures(samples, 0.0, 2 * nbytes)
            print(f"{name:6s} {method}: {fig['ms']:.4f} ms  {fig['gbps']:.0f} GB/s"
                  f"  ({fig['launches']} launches a sample)")  # fmt: skip


if __name__ == "__main__":
    main()
