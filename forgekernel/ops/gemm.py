"""`forgekernel.gemm`: C = A @ B^T on Hopper, fp16/bf16 in and out, fp32 accumulation.

This module validates; eager calls then go straight to the leaf's host launcher
(`kernels/gemm/dense/sm90/launch.py`); under `torch.compile` the same work runs through the
custom ops `forgekernel::gemm` / `forgekernel::gemm_out`, whose fake implementations give the
compiler shapes without running anything. Calls that autograd would record take the custom op
too (no backward is registered: it fails loudly).
"""

from __future__ import annotations

import dataclasses

import torch

from forgekernel.kernels.gemm.dense.sm90 import SPEC, GemmConfig, choose_config
from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_sm90
from forgekernel.kernels.gemm.dense.sm90.config import CANDIDATES, STANDARD_CONFIGS, takes_kn
from forgekernel.ops._dispatch import plain, tracing, wants_grad
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._validate import (
    PassedChecks,
    check_cuda,
    check_same_device,
    check_same_dtype,
    check_shaped,
    check_tensor,
    on_one_device,
    tensor_key,
)
from forgekernel.runtime import tuning
from forgekernel.runtime.timing import median, rotation_sets, time_interleaved


def _validate(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None, b_layout: str
) -> tuple[int, int, int]:
    # Device checks come last so that every shape error is reported the same on any device.
    check_tensor("a", a, ndim=2, cuda=False)
    check_tensor("b", b, ndim=2, cuda=False)
    check_same_dtype(a=a, b=b)
    if b_layout not in ("nk", "kn"):
        raise ValueError(
            f"b_layout must be 'nk' (B is (N, K)) or 'kn' (B is (K, N)), got {b_layout!r}"
        )
    m, k = a.shape
    n, kb = b.shape if b_layout == "nk" else (b.shape[1], b.shape[0])
    if kb != k:
        raise ValueError(
            f"a is (M, K) = {tuple(a.shape)} and b ({b_layout}) is {tuple(b.shape)}: "
            f"K mismatch ({k} vs {kb})"
        )
    if out is not None:
        check_shaped("out", out, (m, n))
        check_same_dtype(a=a, out=out)
    check_cuda("a", a)
    check_same_device(a=a, b=b, **({} if out is None else {"out": out}))
    return m, n, k


# The named checks' (M, N, K) per plain eager call's key (issue 17: 4 of the 9 us per call on
# the CPU with a kernel stub): `_validate` depends on the shapes, dtypes and b_layout alone
# but for its device checks, which `_seen` makes per call.
_PASSED = PassedChecks()


def _seen(a, b, out, b_layout) -> tuple[tuple | None, tuple[int, int, int] | None]:
    """(key, (M, N, K)) of a call: key None when it is traced or its tensors are not plain
    (the named checks and the custom op), (M, N, K) None when the named checks must decide."""
    if tracing() or not plain(a, b, optional=(out,)) or type(b_layout) is not str:
        return None, None
    key = (a.shape, a.dtype, b.shape, b.dtype, tensor_key(out), b_layout)
    passed = _PASSED.get(key)
    if passed is None:
        return key, None
    check_cuda("a", a)
    # a tensor on another device: the named checks name it
    return key, passed if on_one_device(a, b, out) else None


@torch.library.custom_op("forgekernel::gemm", mutates_args=())
def _gemm_op(a: torch.Tensor, b: torch.Tensor, b_kn: bool) -> torch.Tensor:
    n = b.shape[1] if b_kn else b.shape[0]
    out = torch.empty(a.shape[0], n, dtype=a.dtype, device=a.device)
    gemm_sm90.gemm(a, b, out, b_kn)
    return out


@_gemm_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, b_kn: bool) -> torch.Tensor:
    n = b.shape[1] if b_kn else b.shape[0]
    return a.new_empty(a.shape[0], n)


@torch.library.custom_op("forgekernel::gemm_out", mutates_args=("out",))
def _gemm_out_op(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_kn: bool) -> None:
    gemm_sm90.gemm(a, b, out, b_kn)


@_gemm_out_op.register_fake
def _(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_kn: bool) -> None:
    return None


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor | None = None,
    b_layout: str = "nk",
    config: GemmConfig | None = None,
) -> torch.Tensor:
    """C = A @ B^T with A (M, K) and B (N, K); `b_layout="kn"` takes B as (K, N) (C = A @ B).

    fp16 or bf16 (A, B and C alike), fp32 accumulation, any M, N, K. N and K that are
    multiples of 8 (16-byte rows, what TMA reads and writes) run in place; otherwise they are
    rounded up to multiples of 8 in scratch buffers (zero K columns in A and B, zero B rows,
    extra C columns dropped): each call then copies B, A when K is not a multiple of 8, and C
    when N is not; for a weight reused across calls, pad it once yourself. Non-contiguous or
    misaligned inputs are copied; `out` may be any (M, N) view.
    `config` forces a kernel configuration (eager calls only); by default a winner recorded by
    `tune_gemm` for this exact problem is used, else the analytical choice.
    """
    key, passed = _seen(a, b, out, b_layout)
    if passed is None:
        passed = _validate(a, b, out, b_layout)
        if key is not None:
            _PASSED.remember(key, passed)
    m, n, _ = passed
    b_kn = b_layout == "kn"
    if config is not None:
        if out is None:
            out = torch.empty(m, n, dtype=a.dtype, device=a.device)
        gemm_sm90.gemm(a, b, out, b_kn, config)
        return out
    # The GEMM has no backward formula: a call autograd would record takes the custom op, whose
    # backward fails loudly, instead of silently returning a result without grad.
    if (key is None and _traced(a, b, out)) or wants_grad(a, b):
        if out is None:
            return torch.ops.forgekernel.gemm(a, b, b_kn)
        torch.ops.forgekernel.gemm_out(a, b, out, b_kn)
        return out
    if out is None:
        out = torch.empty(m, n, dtype=a.dtype, device=a.device)
    gemm_sm90.gemm(a, b, out, b_kn)
    return out


def tune_gemm(
    m: int,
    n: int,
    k: int,
    dtype: torch.dtype = torch.bfloat16,
    b_layout: str = "nk",
    configs: tuple[GemmConfig, ...] | None = None,
    reps: int = 20,
) -> GemmConfig:
    """Opt-in autotune for one problem: time every configuration (standard and candidates by
    default) interleaved on fresh random inputs, record the winner for later `gemm` calls,
    and return it. Configurations that are not prebuilt compile first (needs the DSL)."""
    b_kn = b_layout == "kn"
    every = configs or STANDARD_CONFIGS + CANDIDATES
    configs = tuple(c for c in every if c.fits(m) and (takes_kn(c) or not b_kn))
    elems = m * k + n * k + m * n
    sets = [
        (
            torch.randn(m, k, device="cuda", dtype=dtype),
            torch.randn(*((k, n) if b_kn else (n, k)), device="cuda", dtype=dtype),
            torch.empty(m, n, device="cuda", dtype=dtype),
        )
        for _ in range(rotation_sets(elems * torch.finfo(dtype).bits / 8))
    ]
    fns = {c: _tuning_call(c, b_kn) for c in configs}
    samples = time_interleaved(fns, rotate=sets, reps=reps)
    best = min(samples, key=lambda c: median(samples[c]))
    tuning.record(
        SPEC.name,
        gemm_sm90.tuning_key(dtype, b_kn, m, n, k),
        {
            "config": dataclasses.asdict(best),
            "ms": median(samples[best]),
            "default_ms": median(samples[choose_config(m, n, k, b_kn=b_kn)])
            if choose_config(m, n, k, b_kn=b_kn) in samples
            else None,
            "source_hash": SPEC.source_hash,
        },
    )
    return best


def _tuning_call(cfg: GemmConfig, b_kn: bool):
    def call(a: torch.Tensor, b: torch.Tensor, c: torch.Tensor) -> None:
        gemm_sm90.gemm(a, b, c, b_kn, cfg)

    return call
