"""The DSA indexer backward kernel's time split at a suite case (docs/attention/
DSA_INDEXER_NOTES.md, "Backward kernel, built": the prediction and its falsifiers):

    python3 scripts/time_dsa_indexer_bwd_kernel.py [CASE ...]   (default t4096-kv8192-k2048
                                                                 t8192-kv8192-k512)

One line each, ms a launch (graph replays, `runtime.timing.time_interleaved`): the op (kernel +
dK cast), the launcher alone (zeroed accumulator + kernel), the probe build whose dK reductions
never run (`params_for(..., reduce=False)`: GEMMs, epilogue, gather and prologue alone; the
difference is the L2 reductions' share, the unknown R of the notes' model), and cuDNN-frontend's
indexer_backward_wrapper where installed; the staged candidate (dK through the dead stage, two
256-byte rows a warp instruction) with and without reductions; the pair plan (two CTAs an SM,
one consumer warpgroup each) with the swap (with and without reductions) and staged. Build
first: `python3 -m forgekernel build --only dsa_indexer_bwd_sm90 --candidates`."""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel

from forgekernel.bench.suites import dsa_indexer_bwd as S  # noqa: E402
from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import launch  # noqa: E402
from forgekernel.ops.dsa_indexer_bwd import dsa_indexer_backward  # noqa: E402
from forgekernel.runtime.timing import time_interleaved  # noqa: E402

DEFAULT = ("t4096-kv8192-k2048", "t8192-kv8192-k512")


def _time(case) -> None:
    dev = torch.device("cuda")
    i = S.make_inputs(case, torch.bfloat16, dev, torch.Generator(dev).manual_seed(0))
    args = tuple(i[n] for n in ("q", "w", "k", "target", "predict", "idx", "grad_loss"))
    fns = {
        "op (kernel + cast)": lambda: dsa_indexer_backward(*args),
        "launcher": lambda: launch.dsa_indexer_bwd(*args, 1.0, 1.0, False),
        "no reductions": lambda: launch.dsa_indexer_bwd(*args, 1.0, 1.0, False, reduce=False),
        "launcher, staged": lambda: launch.dsa_indexer_bwd(*args, 1.0, 1.0, False, staged=True),
        "staged, no reductions": lambda: launch.dsa_indexer_bwd(
            *args, 1.0, 1.0, False, reduce=False, staged=True
        ),
        "pair": lambda: launch.dsa_indexer_bwd(*args, 1.0, 1.0, False, pair=True),
        "pair, no reductions": lambda: launch.dsa_indexer_bwd(
            *args, 1.0, 1.0, False, reduce=False, pair=True
        ),
        "pair, staged": lambda: launch.dsa_indexer_bwd(
            *args, 1.0, 1.0, False, staged=True, pair=True
        ),
    }
    cudnn = S.comparators()["cudnn"]
    if cudnn is not None:
        cudnn(i)  # its set-up call (scratch target) outside the timing
        fns["cudnn"] = lambda: cudnn(i)
    samples = time_interleaved(fns, reps=10)
    slots = S.valid_slots(case)
    print(f"{case.name}: {slots / 1e6:.2f} M valid slots, ms a launch (median of 10):")
    for name, x in samples.items():
        ms = median(x)
        print(f"  {name:20s} {ms:8.3f} ms  {S.flops(case) / ms / 1e9:7.1f} TFLOP/s  "
              f"{slots * 512 / ms / 1e9:6.2f} TB/s of dK reductions")  # fmt: skip


def main(names: list[str]) -> None:
    cases = {c.name: c for c in S.BENCH_CASES}
    for name in names or DEFAULT:
        _time(cases[name])


if __name__ == "__main__":
    main(sys.argv[1:])
