"""Host launchers of the sm90 dense GEMM and of the masked grouped FP8 GEMM on its kernel:
torch only (no DSL), the kernels through the compile cache.

`gemm`: callers validate first (`forgekernel.gemm`); the launcher makes the operands TMA-ready
(padding K and N up to multiples of 8 where they are not), picks the configuration (a recorded
tuning winner, else the analytical default) and launches fn(a, b, c, max_clusters).

`gemm_fp8_masked` (MoE decode; callers validate first: `forgekernel.ops.gemm_fp8_grouped_masked`):
the kernel takes each operand as (rows, cols, experts) with the cols contiguous, torch's
(E, rows, cols) tensors permuted, no copy. The experts' row counts stay on the device (one
launch, nothing read back: CUDA-graph capturable); `expected_m`, a host-side hint, picks the
tile."""

from __future__ import annotations

import torch

from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC, SPEC, masked_config
from forgekernel.kernels.gemm.dense.sm90.config import (
    NUM_SMS_H100_H200,
    GemmConfig,
    choose_config,
    params_for,
    split_for,
    takes_kn,
)
from forgekernel.kernels.gemm.dense.sm90.plan import grid_ctas
from forgekernel.runtime import pdl, tuning
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.device import (
    as_tma_ready,
    dtype_name,
    num_sms,
    on_device,
    tma_target,
)
from forgekernel.runtime.plans import PlanCache
from forgekernel.runtime.scratch import flags, scratch

# TMA rows are 16-byte multiples: the kernel is compiled for N and K divisible by 8 (16 bits).
ALIGN = 8


def tuning_key(dtype: torch.dtype, b_kn: bool, m: int, n: int, k: int) -> str:
    """The problem's key in the tuning table (`forgekernel.tune_gemm` records under it)."""
    return f"{dtype_name(dtype)},{'kn' if b_kn else 'nk'},{m},{n},{k}"


def config_for(
    dtype: torch.dtype, b_kn: bool, m: int, n: int, k: int, num_sms: int = NUM_SMS_H100_H200
) -> GemmConfig:
    """A recorded tuning winner for exactly this problem, else the analytical default for a
    chip with `num_sms` multiprocessors (132 on H100 SXM and H200, 114 on H100 PCIe)."""
    tuned = tuning.load(SPEC.name).get(tuning_key(dtype, b_kn, m, n, k))
    cfg = GemmConfig.from_record(tuned["config"]) if tuned else None
    return cfg or choose_config(m, n, k, num_sms, b_kn)


class _Plans(PlanCache):
    """(dtype, b_kn, M, N, K, device index, forced config, `pdl.forced()`) -> (the compiled
    function (a PDL build unless runtime/pdl.py says otherwise when the plan is built; its
    trigger late inside `pdl.late()`; the partial-wave rule's form for its grid otherwise:
    `pdl.form`),
    max_clusters, stream K: (k-iterations per CTA, output tiles, workspace floats) or None,
    whether the operands are swapped: `kernel_operands`):
    one kernel lookup per problem.
    Choosing it per call (tuning key, config, params_for's dataclass walk) cost 9 us of a 18 us
    launch on the CPU. The plans follow the tuning table: a new table (tuning.record reloads
    it) drops them."""

    table: dict | None = None

    def plan(self, key: tuple) -> tuple[object, int, tuple | None, bool]:
        table = tuning.load(SPEC.name)
        if table is not self.table:
            self.clear()
            self.table = table
        return self.get_or_build(key, _choose)


def _choose(
    dtype, b_kn, m, n, k, device_index, config, _pdl_forced=None
) -> tuple[object, int, tuple | None, bool]:
    sms = num_sms(device_index)
    cfg = config or config_for(dtype, b_kn, m, n, k, sms)
    if not cfg.fits(m):
        raise ValueError(f"GEMM config {cfg.tag()} loads {cfg.a_rows} rows of A: M = {m} is more")
    if b_kn and not takes_kn(cfg):
        raise ValueError(f"GEMM config {cfg.tag()} (swapped or 8 past 16 columns): B 'nk' only")
    # The problem as the kernel sees it (N and K padded up to multiples of 8 where they are
    # not; swapped: the weight's N rows as its M, the tokens as its N): its grid. Stream K: the
    # kernel derives the grid and the data-parallel blocks from per and max_clusters, and
    # indexes the flags and the workspace by its own tiles and CTAs.
    km, kn, kp = (_round_up(n), m, _round_up(k)) if cfg.swap else (m, _round_up(n), _round_up(k))
    split = None
    if cfg.stream_k:
        plan = split_for(cfg, km, kn, kp, sms)
        split = (plan.per, plan.tiles, 2 * plan.ctas * cfg.tile_m * cfg.tile_n)
    # One CTA per SM (the pipeline takes nearly all shared memory).
    max_clusters = sms // (cfg.cluster_m * cfg.cluster_n)
    params = params_for(dtype_name(dtype), b_kn, cfg)
    ctas = grid_ctas(cfg, km, kn, kp, sms, split[0] if split else 0)
    kernel = get_kernel(SPEC, pdl.key_for(params, pdl.form(ctas, sms)))
    return kernel, max_clusters, split, cfg.swap


_plans = _Plans()


def clear_plans() -> None:
    """Every plan (they hold the functions they looked up)."""
    _plans.clear()


def gemm(
    a: torch.Tensor,
    b: torch.Tensor,
    out: torch.Tensor,
    b_kn: bool,
    config: GemmConfig | None = None,
) -> None:
    """out = a @ b^T with b (N, K), or a @ b with b_kn and b (K, N), written into out (any
    (M, N) view). a, b and out are 16-bit alike on one device; any M, N, K (N or K not a
    multiple of 8 runs padded: see `padded_operands`)."""
    m, k = a.shape
    n = out.shape[1]
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    # The configuration of the problem as asked (a tuning record for an odd N or K applies).
    fn, max_clusters, split, swap = _plans.plan(
        (a.dtype, b_kn, m, n, k, a.device.index, config, pdl.forced())
    )
    if n % ALIGN or k % ALIGN:
        a, b, c = padded_operands(a, b, out, b_kn)
    else:
        a, b, c = as_tma_ready(a), as_tma_ready(b), tma_target(out)
    with on_device(a.device):
        if split is None:
            fn(*kernel_operands(a, b, c, swap), None, None, 0, None, None, None, max_clusters)
        else:
            per, tiles, floats = split
            work, flags = stream_k_workspace(a.device, tiles, floats)
            fn(*kernel_operands(a, b, c, swap), work, flags, per, None, None, None, max_clusters)
    if c is not out:
        out.copy_(c if c.shape[1] == n else c[:, :n])


def kernel_operands(
    a: torch.Tensor, b: torch.Tensor, c: torch.Tensor, swap: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The kernel's (A, B, C) for C = A B^T (B "nk"; c row-major, TMA-ready): as given, or
    swapped (config `swap`), C^T = B A^T: the weight (N, K) as A, the tokens (M, K) as B and
    C's (N, M) transpose, unit stride along the kernel's M, as C (no copy)."""
    return (b, a, c.t()) if swap else (a, b, c)


def stream_k_workspace(device: torch.device, tiles: int, floats: int):
    """The stream-K workspace of `device`'s current stream: at least `floats` fp32 partials
    (contents undefined) and `tiles` int32 flags (zero; every launch leaves them zero), from
    runtime/scratch.py (reused per stream; a capture's own)."""
    with on_device(device):
        return (
            scratch("stream_k.partials", (floats,), torch.float32, device),
            flags("stream_k.flags", tiles, device),
        )


def padded_operands(
    a: torch.Tensor, b: torch.Tensor, out: torch.Tensor, b_kn: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Operands for a problem whose N or K is not a multiple of 8, rounded up to Np, Kp: A
    (M, Kp) and B with zero K columns (they add nothing to C), B with zero rows up to Np, C an
    (M, Np) scratch whose first N columns the caller copies into `out`. Cost per call: K not a
    multiple of 8, a copy of A and of B; N not a multiple of 8, a copy of B and of C (the
    kernel writes Np columns); a few small zero fills. An operand that fits is used in place."""
    m, k = a.shape
    n = out.shape[1]
    kp, np_ = _round_up(k), _round_up(n)
    a = _zero_padded(a, m, kp)
    b = _zero_padded(b, kp, np_) if b_kn else _zero_padded(b, np_, kp)
    c = out.new_empty(m, np_) if np_ != n else tma_target(out)
    return a, b, c


def _round_up(x: int) -> int:
    return -(-x // ALIGN) * ALIGN


def _zero_padded(t: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """`t` (r, c) in the top-left corner of a fresh (rows, cols) buffer whose margins are zero
    (each byte written once); `t` itself when it fits and TMA can read it."""
    r, c = t.shape
    if (r, c) == (rows, cols):
        return as_tma_ready(t)
    p = t.new_empty(rows, cols)
    p[:r, :c].copy_(t)
    if cols > c:
        p[:r, c:].zero_()
    if rows > r:
        p[r:].zero_()
    return p


def _batched(t: torch.Tensor) -> torch.Tensor:
    """(E, rows, cols) seen as (rows, cols, E)."""
    return t.permute(1, 2, 0)


def gemm_fp8_masked(
    a: torch.Tensor,
    b: torch.Tensor,
    scale_a: torch.Tensor,
    scale_b: torch.Tensor,
    masked_m: torch.Tensor,
    expected_m: int,
    out: torch.Tensor,
) -> None:
    """out[e, r] = (a[e, r] x scale_a[e, r]) @ (b[e] x scale_b[e])^T for r < masked_m[e]; the
    other rows of out are not written. a (E, max_m, K) and b (E, N, K) float8_e4m3fn; scale_a
    (E, max_m, K/128) and scale_b (E, N/128, K/128) fp32, any strides; masked_m int32 (E,)
    contiguous (a count outside [0, max_m] is read as the nearest end); out (E, max_m, N)
    16-bit, TMA-ready (written in place: a compact copy would lose the rows left alone). N and
    K multiples of 128."""
    experts, max_m, _ = a.shape
    if max_m == 0 or experts == 0:
        return
    cfg = masked_config.choose_config(expected_m)
    params = masked_config.params_for(dtype_name(out.dtype), cfg)
    fn = get_kernel(MASKED_SPEC, pdl.key(params, pdl.enabled()))
    with on_device(a.device):
        fn(
            _batched(as_tma_ready(a)),
            _batched(as_tma_ready(b)),
            _batched(out),
            None,
            None,
            0,
            _batched(scale_a),
            _batched(scale_b),
            masked_m,
            num_sms(a.device.index),
        )
