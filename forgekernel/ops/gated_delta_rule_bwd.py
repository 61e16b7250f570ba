"""The backward of `forgekernel.gated_delta_rule` (issue 20) and its autograd.

`forgekernel::gated_delta_rule_chunked` (ops/gated_delta_rule_chunked.py, the forward on the
chunked WGMMA kernel) gets a backward formula here (`torch.library.register_autograd`): it
saves the forward's inputs (q, k, v, g, beta in their flat (T, heads, dim) form, the initial
state, the offsets) and nothing the kernel produced, and calls
`forgekernel::gated_delta_rule_chunked_bwd`, which returns the gradients in q, k, v, g, beta
and the initial state (grouped value heads: dq, dk summed over the value heads that share a
q / k head; l2norm's backward included; k_last: the state gradients in FlashInfer's layout).

INTERIM PATH (`FORGEKERNEL_GDN_BWD_KERNEL=0`, inside `interim()`, CPU tensors, and the calls
the kernel path declines): the backward op runs
`reference.delta_rule_bwd.gated_delta_rule_chunked_backward` in fp32 with torch ops
(`_backward_interim`: recompute of the chunk states, the reverse state recurrence as one
batched GEMM step per chunk, every chunk's gradients batched;
it reads the offsets on the host, one sync a call: a CUDA-graph capture is refused before any
work, `ops._dispatch.refuse_capture`). Correct, not fast: Python loops over chunk steps,
~14.7 ms a call at 1 x 2048 h16 hv32 on the H200 (the bench's `interim` variant, `interim()`).

KERNEL PATH (the default since 2026-12-06, `_kernel_path`: FORGEKERNEL_GDN_BWD_KERNEL unset or
"1", outside `interim()`, CUDA tensors, 16-bit, at least one token and value head; its GPU check
tests/gpu/test_gdn_bwd_kernel_path_gpu.py passed on the H100 2026-12-05, 64 tests, with
`forgekernel check gdn_bwd` and its sanitizers; NOTES.md "Backward on kernel 1", "The backward
kernel path the default"): `_backward_kernel`
runs both sequential recurrences on kernel 1 (kernels/linear_attention/gdn_bwd_state/sm90,
`gdn_bwd_state`): the forward's chunk states h and U = u - W h (the kernel's recurrence fed
transposed inputs, `reference.gdn_bwd_state.forward_state_tiles`), then the reverse recurrence
(dU, dh, the initial state's gradient); pass 3 (the reference's `_output_grads` and
`_wy_grads`: dq, dk, dv, dbeta and dG, its reverse cumsum within the chunk included) on
kernel 2 (kernels/linear_attention/gdn_bwd_chunk/sm90, every chunk at once,
`reference.gdn_bwd_chunk` its model; WY_IN_KERNEL = False: its `_output_grads` variant and
`_wy_grads` in torch); the chunk factors (A, T = L^-1, W, u, P, the decays, in the 16-bit
layouts the other two read) on kernel 0 (kernels/linear_attention/gdn_bwd_factors/sm90,
`reference.gdn_bwd_factors` its model; FACTORS_IN_KERNEL = False, or WY_IN_KERNEL = False: the
batched torch `_Factors` pass); with both of those on, STATES16 and NORM_IN_KERNEL (the
defaults): kernel 1 writes U, h and dU, dS in kernel 2's 16-bit forms
(`out16`; its forward launch the `forward` variant: chunks first to last on kernel 0's u, W, Ke
as written, P^T = I, Qe = 0 and the signs built in, outputs in chunk order), kernel 2 reads
q, k at their H heads (`grouped`), and the q / k epilogue kernel (kernels/linear_attention/
gdn_bwd_norm/sm90, `reference.gdn_bwd_norm` its model) does the group sum over the value heads,
l2norm's backward and the scale, kernel 2 writes dv in 16 bits (`dv16`): torch is left with q,
k normalized and scaled into 16 bits (~0.27 KB a token-head written; NOTES.md "GDN backward:
the torch glue"). The kernels
take equal-length sequences ((B, T, HV, D) tiles): the explicit backward without
cu_seqlens, autograd of `gated_delta_rule` without cu_seqlens (the forward op's `batch`
argument says B equal lengths; autograd's setup saves it, eager and under torch.compile alike)
and one sequence run with no host read (CUDA-graph capturable); several sequences behind a
caller's cu_seqlens (`_backward_varlen`, ops/_linattn_varlen.py): eagerly the offsets read on
the host once (equal lengths a reshape, no token the interim), unequal lengths (and any under a
capture: no host read) ONE launch of each kernel over the forward's chunk slots, kernel 1 in
its `varlen` form (the fallback forms, STATES16 or the switches off: buckets of similar lengths
zero-padded at their ends, a capture refused; 32-bit inputs: the interim).

Eager calls take the custom op when autograd records them (the dispatcher's ~30 us are nothing
beside this backward); under torch.compile the backward graph records the backward custom op,
whose fake implementation gives the shapes. `gated_delta_rule_backward` is the same backward for
callers with their own autograd and for the suite's backward timing.
"""

from __future__ import annotations

import contextlib
import os

import torch

from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

# the launchers as modules, imported once (an import a call cost ~1 us each; the tests patch
# their functions on these modules)
from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import launch as factors_launch
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90 import launch as fused_launch
from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import (
    PAIR,
    fused_fits,
    slots_fit,
)
from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import launch as norm_launch
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import config as state_config
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import launch as state_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.launch import SEGMENT_SCALE
from forgekernel.ops import gated_delta_rule_chunked as fwd
from forgekernel.ops._dispatch import KernelSwitch, refuse_capture
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._linattn_varlen import backward_varlen
from forgekernel.ops._validate import (
    check_bools,
    check_cuda,
    check_same_device,
    check_scale,
    check_shaped,
)
from forgekernel.reference.delta_rule import L2NORM_EPS
from forgekernel.reference.delta_rule_bwd import (
    _l2norm,
    _l2norm_backward,
    _wy_grads,
    gated_delta_rule_chunked_backward,
)
from forgekernel.reference.gdn_bwd_chunk import chunk_grad_tiles, wy_tiles
from forgekernel.reference.gdn_bwd_factors import for_kernel2, forward_launch_tiles
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    chunk_factors,
    cut,
    forward_state_tiles,
    forward_states,
    segment_ends,
    segment_starts,
    segment_transitions,
    to_chunks,
    to_tokens,
)
from forgekernel.runtime.device import num_sms, side_by_side

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
# (dq, dk, dv, dg, dbeta, d_initial_state) buffers for the gradients (`gated_delta_rule_backward`'s
# out=), d_initial_state may be None; None: every gradient allocated
GradsOut = tuple[torch.Tensor | None, ...] | None
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "d_initial_state")
INPUT_NAMES = ("q", "k", "v", "g", "beta")  # `check_grads_out`'s likes
NOT_CAPTURABLE = (
    "gated_delta_rule's interim backward reads the offsets on the host (its chunk layout, "
    "one sync a call) and builds its tables there"
)


def _to_kv(state: torch.Tensor | None, k_last: bool) -> torch.Tensor | None:
    """A state (or its gradient) in the reference's (N, HV, K, V) layout."""
    return state.transpose(-1, -2) if state is not None and k_last else state


def given(**buffers: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """The out= keywords of a kernel wrapper call that were given (a call without out= passes
    none: the wrappers' stand-ins in tests and scripts need not take them)."""
    return {name: x for name, x in buffers.items() if x is not None}


def written(out: GradsOut, grads, likes) -> Grads:
    """The six gradients in their inputs' dtypes (`likes`: q, k, v, g, beta's; the state's
    fp32, contiguous), each written into its `out` buffer where one is given (a copy, the cast,
    unless a kernel wrote it there already: no copy then)."""
    got = []
    for i, x in enumerate(grads):
        o = None if out is None else out[i]
        dtype = likes[i].dtype if i < 5 else torch.float32
        if o is None:
            got.append(x.to(dtype) if i < 5 else x.contiguous())
        elif x.data_ptr() == o.data_ptr() and x.stride() == o.stride() and x.dtype == o.dtype:
            got.append(o)
        else:
            got.append(o.copy_(x))
    return tuple(got)


def _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last,
                      l2norm, out=None) -> Grads:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). Flat tensors:
    q, k (T, H, K), v, do (T, HV, V), g, beta (T, HV); states in the op's layout; `out` the
    flat gradient buffers (`GradsOut`), the results copied in."""
    refuse_capture(NOT_CAPTURABLE, q)
    grads = gated_delta_rule_chunked_backward(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta, do)), scale=scale,
        initial_state=_to_kv(initial_state, k_last), d_final_state=_to_kv(d_final, k_last),
        cu_seqlens=cu_seqlens, use_qk_l2norm=l2norm, dtype=torch.float32,
    )  # fmt: skip
    flat = (x[0] for x in grads[:5])
    return written(out, (*flat, _to_kv(grads[5], k_last)), (q, k, v, g, beta))


# "0": the interim path everywhere; unset or "1": the kernel path where it fits (`_kernel_path`).
KERNEL_SWITCH = "FORGEKERNEL_GDN_BWD_KERNEL"
KERNEL_DEVICES = ("cuda",)  # CPU tensors take the interim path (the CPU tests add "cpu")
_SWITCH = KernelSwitch(KERNEL_SWITCH)


def kernel_selected() -> bool:
    """Whether the kernel path is chosen where it fits: False inside `interim()`, else
    KERNEL_SWITCH ("0" or "1", default "1")."""
    return _SWITCH.selected()


def interim() -> contextlib.AbstractContextManager[None]:
    """The backward calls inside take the interim path, as with KERNEL_SWITCH "0" (the bench's
    `interim` variant)."""
    return _SWITCH.off()


# Token x value heads of one pass of the kernel path: its temporaries were ~56 KB a token-head
# allocated over the pass, ~25 KB live at the peak with pass 3 in torch (CPU profile and
# resident set at K = V = 128): ~26 GB at 2^20 (4 x 8192 HV 32 is one pass; 8 x 32768 HV 32
# eight). With pass 3 on kernel 2: ~33 KB a token-head written (dispatch count), with the
# factors on kernel 0 too ~14 KB, with kernel 1's 16-bit outputs and the q / k epilogue ~0.3 KB
# (scripts/gdn_bwd_glue_bytes.py); peak not re-measured (at most the old one).
TOKEN_HEADS_PER_PASS = 2**20
TILE_DTYPES = (torch.float16, torch.bfloat16)


def _state_recurrence(do, pt, ke, qe, w, e_last, d_final_state, dh0=None, out=None, **flags):
    """Kernel 1 (dh variant): (dU (B, T, HV, V), dh = dS^T per chunk end (B, NC, HV, V, K),
    dS at the start (B, HV, K, V)), fp32; `flags` out16 / forward: dU and dS (B, NC, HV, K, V)
    in 16 bits, kernel 2's forms (`reference.gdn_bwd_state.out16_forms`; forward: pt, qe None,
    I and 0 built in, outputs in chunk order); dh0: the caller's contiguous buffer for dS at
    the start (the kernel writes it there); out: all three buffers (the segmented pass's views,
    `_segmented_states`). The CPU tests put the tile emulation here."""
    if dh0 is not None:
        du, side, _ = state_launch.empty_outputs(do, ke.shape[-1], out16=flags.get("out16", False))
        out = (du, side, dh0)
    return state_launch.gdn_bwd_state(do, pt, ke, qe, w, e_last, d_final_state, out=out, **flags)


# Kernel 1 holds one CTA an SM (the register file: 128 threads x (40 + 2 x 232) registers
# after setmaxnreg; shared memory 106 KB forward, 155 KB reverse) and runs B x HV of them, each
# through every chunk in sequence. On the device pass (`_device_pass`) its two launches are
# independent: the forward one reads kernel 0's fw_u, fw_w, fw_ke, the reversed e_last and h0
# and writes U, h; the reverse one reads dO, P^T, Ke, Qe, W, e_last and dht and writes dU, dS
# and dh0 (no tile of one is the other's). Side by side (`side_by_side`) they take one launch's
# time where both fit one wave, 2 B HV CTAs <= STATE_CTAS_PER_SM x the SMs: B HV <= 66 on the
# H100's 132 (1 x 2048 and 1 x 8192 hv32: 32 CTAs a launch, ~950 us for the two in a row at
# 1 x 8192, plan 2026-12-06 item 2). Above, the second launch's CTAs wait for SMs either way
# (4 x 8192 hv32: 128 a launch) and the serial order frees the forward's tiles first.
STATE_CTAS_PER_SM = REGISTERS_PER_SM // (
    (state_config.PRODUCER_REGS + state_config.STATE_WGS * state_config.STATE_REGS) * THREADS_PER_WG
)
CONCURRENT_STATE = True  # False: the two launches one after the other (the fallback)


def concurrent_state_launches(b: int, hv: int, sms: int) -> bool:
    """Whether kernel 1's two launches of B x HV CTAs each run side by side on `sms` SMs: both
    fit one wave (the comment above)."""
    return CONCURRENT_STATE and 0 < 2 * b * hv <= sms * STATE_CTAS_PER_SM


def _device_sms(device: torch.device) -> int:
    """The SMs `concurrent_state_launches` counts on: the CUDA device's, none off CUDA (the CPU
    tests run the launches one after the other unless they ask otherwise)."""
    return num_sms(device.index) if device.type == "cuda" else 0


# Kernel 1 over segments (stage 2 of docs/linear_attention/segment_parallel_plan_2026-12-06.md,
# launcher only, `_segmented_states`): each sequence cut into S segments of whole chunks, the
# (B, NC C, ...) tiles seen as (B S, NC C / S, ...) rows, the boundary states exact by
# linearity as in the gdn_prefill launcher's `_segmented`: a summary phase (forward runs from
# the initial state or zero and from SEGMENT_SCALE x I, a reverse run from the final state's
# gradient or zero), two scans of S - 2 batched products, then both launches over the segments
# from their true states. Depth 2 NC / S chunk steps instead of NC for 3.5x (S = 4) the chunk
# steps of work: it pays only where the summary phase, (3 B S - 4) HV CTAs at one an SM, fits
# one wave: B HV <= 16 on 132 SMs (1 x 8192 hv16, predicted ~460 -> ~350 us); at B HV = 32 (1 x
# 8192 hv32) each phase takes two waves and it loses (~460 -> ~620 us predicted; NOTES.md
# "next/gdn-bwd-segments"). On since the H100 A/B of 2026-12-07 00:12 (graph replays, the rule's
# S = 4: 1 x 8192 h16 hv16 0.860 -> 0.807 ms, 1 x 32768 h16 hv16 3.383 -> 2.942; memcheck 0
# errors; at hv32 the rule keeps S = 1, where forced S = 2 / 4 lost: 1.304 -> 1.329 / 1.567 ms
# at 1 x 8192; log benchmarks/logs/sm_90a/2026-12-07T0006-integration47-device-run.log).
# SEGMENTS_SWITCH overrides SEGMENTS: "0" off (the A/B baseline), "1" on (the rule,
# `_segments_for_bwd`), an integer S >= 2 forces S segments wherever S divides NC (the A/Bs;
# the fused route and the varlen slot layout never segment).
SEGMENTS = True
SEGMENTS_SWITCH = "FORGEKERNEL_GDN_BWD_SEGMENTS"
MIN_SEGMENT_CHUNKS = 32  # a segment's chunks: shorter, the scans' ~20 small launches eat the gain


def _segments_for_bwd(b: int, hv: int, nc: int, sms: int) -> int:
    """Segments a sequence for kernel 1 (1: none): the largest power of two S >= 4 dividing NC
    with NC / S >= MIN_SEGMENT_CHUNKS whose summary phase, (3 B S - 4) HV CTAs (forward runs
    over rows [0, B S - 1) and [1, B S - 1), the reverse run over [1, B S)), fits one wave of
    `sms` SMs (0, off CUDA: none)."""
    parts, s = 1, 4
    while (nc % s == 0 and nc // s >= MIN_SEGMENT_CHUNKS
           and (3 * b * s - 4) * hv <= sms * STATE_CTAS_PER_SM):  # fmt: skip
        parts, s = s, 2 * s
    return parts


def _segments_selected(b: int, hv: int, nc: int, device: torch.device) -> int:
    """Segments a sequence for the device pass of B sequences x HV value heads of NC chunks:
    SEGMENTS_SWITCH's (or SEGMENTS') choice (the comment above)."""
    mode = os.environ.get(SEGMENTS_SWITCH, "1" if SEGMENTS else "0")
    if mode == "0":
        return 1
    if mode == "1":
        return _segments_for_bwd(b, hv, nc, _device_sms(device))
    if not mode.isdigit():
        raise ValueError(f"{SEGMENTS_SWITCH} must be 0, 1 or a segment count, got {mode!r}")
    parts = int(mode)
    return parts if nc % parts == 0 else 1


def _segmented_states(fw, tiles, do, h0, dht, parts, dh0=None):
    """Kernel 1's two launches over `parts` segments of each of B sequences (the comment
    above; rows n P + p in flat order, each launch over a contiguous run of rows, every row
    given its own state): (U, h), (dU, dS, the initial state's gradient) as the unsegmented
    launches give them, U and dU at NC C rows. fw: the forward launch's tiles
    (`forward_launch_tiles`, the variant's own), tiles: kernel 0's (pt, ke, qe, w at NC C rows,
    zero past T; e_last), do (B, T, HV, V), h0, dht (B, HV, K, V) fp32 or None, dh0: the
    caller's buffer for the initial state's gradient or None. Summary phase at once (three
    streams): forward over rows [0, R - 1) from h0 at each sequence's segment 0 and zero
    elsewhere (segment 0's U, h final), forward over [1, R - 1) from SEGMENT_SCALE x I (outputs
    discarded), reverse over [1, R) from dht at each last segment and zero elsewhere (the last
    segment's dU, dS final); the scans (reference/gdn_bwd_state.py `segment_starts`,
    `segment_ends`); then forward over [1, R) and reverse over [0, R - 1) from the true states,
    side by side. With B > 1 the runs take a few rows they need not (a sequence's last segment
    in the first forward run, ...): their results unread or rewritten bit for bit. No host
    read: CUDA-graph capturable."""
    b, t, hv, vd = do.shape
    kd, nc = fw["ke"].shape[-1], fw["e_last"].shape[1]
    rows, chunks = b * parts, nc // parts
    low = {"dtype": do.dtype, "device": do.device}
    f32 = {"dtype": torch.float32, "device": do.device}
    # a tail chunk: do's rows past T zero, as kernel 0's tiles there (a copy also where B > 1
    # sequences' rows are not one stride apart: no (B S) view)
    if t < nc * CHUNK or (b > 1 and do.stride(0) != t * do.stride(1)):
        padded = do.new_zeros(b, nc * CHUNK, hv, vd)
        padded[:, :t] = do
        do = padded

    def seg(x):  # (B, N, ...) -> (B S, N / S, ...), a view (strided head slices stay views)
        return x.view(rows, x.shape[1] // parts, *x.shape[2:])

    fwd_tiles = [seg(fw[n]) for n in ("do", "ke", "w", "e_last")]
    rev_tiles = [seg(x) for x in (do, *(tiles[n] for n in ("pt", "ke", "qe", "w", "e_last")))]

    def forward(run, start, outs):
        u, ke, w, e_last = (x[run] for x in fwd_tiles)
        return _state_recurrence(u, None, ke, None, w, e_last, start, out=outs, out16=True,
                                 forward=True)  # fmt: skip

    def reverse(run, end, outs):
        return _state_recurrence(*(x[run] for x in rev_tiles), end, out=outs, out16=True)

    u16, du16 = (torch.empty(b, nc * CHUNK, hv, vd, **low) for _ in range(2))
    h16, dh16 = (torch.empty(b, nc, hv, kd, vd, **low) for _ in range(2))
    su, sh, sdu, sdh = (seg(x) for x in (u16, h16, du16, dh16))
    head, tail, middle = slice(0, rows - 1), slice(1, rows), slice(1, rows - 1)
    by_seq = (b, parts, hv, kd, vd)
    first, last = (torch.zeros(rows, hv, kd, vd, **f32) for _ in range(2))
    if h0 is not None:
        first.view(by_seq)[:, 0] = h0
    if dht is not None:
        last.view(by_seq)[:, -1] = dht
    local, shifted, rlocal = (torch.empty(rows, hv, kd, vd, **f32) for _ in range(3))
    summary = [
        lambda: forward(head, None if h0 is None else first[head],
                        (su[head], sh[head], local[head])),
        lambda: reverse(tail, None if dht is None else last[tail],
                        (sdu[tail], sdh[tail], rlocal[tail])),
    ]  # fmt: skip
    if parts > 2:  # the middle segments' transitions (K = V: M a state; from c I: c M + L)
        init = (torch.eye(kd, **f32) * SEGMENT_SCALE).expand(rows - 2, hv, kd, vd).contiguous()
        scratch = (torch.empty(rows - 2, chunks * CHUNK, hv, vd, **low),
                   torch.empty(rows - 2, chunks, hv, kd, vd, **low))  # fmt: skip
        summary.insert(1, lambda: forward(middle, init, (*scratch, shifted[middle])))
    side_by_side(do.device, *summary)
    trans = segment_transitions(local, shifted, parts, SEGMENT_SCALE)
    starts = segment_starts(trans, local, first)
    ends = segment_ends(trans, rlocal, last)
    # local and rlocal take the full runs' end states (the scans read them first, in stream
    # order); the forward's final state is not the device pass's output
    side_by_side(
        do.device,
        lambda: forward(tail, starts[tail], (su[tail], sh[tail], local[tail])),
        lambda: reverse(head, ends[head], (sdu[head], sdh[head], rlocal[head])),
    )
    grad0 = rlocal.view(by_seq)[:, 0]
    return (u16, h16), (du16, dh16, grad0 if dh0 is None else dh0.copy_(grad0))


# Kernel 1 writes U, h (forward launch, `forward`: I and 0 built in, chunk order) and dU, dS
# (reverse launch) in kernel 2's 16-bit forms (`out16`), with kernel 0 and kernel 2's WY variant
# on the path; False: fp32 out, torch flips, transposes, converts (the fallback; ~4.9 KB a
# token-head more written, NOTES "GDN backward: the torch glue").
STATES16 = True


def _chunk_grads(do, u, du, q, k, h, dh, big_g):
    """Kernel 2 (`_output_grads` on WGMMA, every chunk at once): (dq, dk, dw (B, T, HV, K),
    dG (B, T, HV), reverse-cumsummed within the chunk) fp32 from `chunk_grad_tiles`' inputs.
    The CPU tests put the tile emulation here."""

    return chunk_launch.gdn_bwd_chunk(do, u, du, q, k, h, dh, big_g)


# Kernel 2 runs all of pass 3 (its WY variant, `_chunk_grads_wy`); False: `_output_grads` only
# (`_chunk_grads`), the WY half in torch (`_wy_grads`).
WY_IN_KERNEL = True


def _chunk_grads_wy(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, **flags):
    """Kernel 2, WY variant (all of pass 3): (dq, dk (B, T, HV, K), dG (B, T, HV, the reverse
    cumsum done), dv (B, T, HV, V), dbeta (B, T, HV)) fp32 (`flags` dv16: dv in do's dtype;
    out: the five contiguous buffers it writes). The CPU tests put the tile emulation here."""

    return chunk_launch.gdn_bwd_chunk_wy(do, u, du, q, k, h, dh, big_g, tt, w, uw, v, beta, **flags)


NOT_CAPTURABLE_VARLEN = (
    "gated_delta_rule's backward on its fallback forms reads varlen offsets on the host (the "
    "padding to equal lengths in buckets; the default device pass has none under capture)"
)


def _kernel_path(q, v) -> bool:
    """The kernel path is selected (`kernel_selected`) and the call fits kernel 1: a CUDA
    tensor, 16-bit, at least one token and value head."""
    return (kernel_selected() and q.device.type in KERNEL_DEVICES and q.shape[0] > 0
            and q.dtype in TILE_DTYPES and v.shape[1] > 0)  # fmt: skip


def _factors(q, k, v, g, beta, fused=False, w_from_t=False):
    """Kernel 0: the chunk factors of every (chunk, value head) at once (`reference.
    gdn_bwd_factors.NAMES`' dict: the tiles kernel 1's two launches and kernel 2 read) from q
    (scaled, normalized), k (B, T, H, K), v (B, T, HV, V) 16-bit, g, beta (B, T, HV) fp32;
    `fused` (the fused route's key): no Ke, Qe in the dict; `w_from_t` (FUSED_WFROMT's T-only
    key): no W, u either. The CPU tests put the tile emulation here."""

    return factors_launch.gdn_bwd_factors(q, k, v, g, beta, fused=fused, w_from_t=w_from_t)


# Kernel 0 forms the chunk factors (with kernel 2's WY variant, which reads its T^T, w, u);
# False: the batched torch `_Factors` pass and its 16-bit conversions (the fallback).
FACTORS_IN_KERNEL = True


def _torch_factor_tiles(qs, ks, v, g, beta, dtype):
    """The factors by the batched torch pass: (kernel 1's forward launch's tiles, its reverse
    launch's (pt, ke, qe, w), e_last, the `_Factors` themselves)."""
    f = chunk_factors(qs, ks, v, g, beta)  # (B, NC, HV, C, ...) fp32, every chunk at once
    rev = tuple(to_tokens(x.to(dtype)) for x in (f.p.transpose(-1, -2), f.ke, f.qe, f.w))
    return forward_state_tiles(f, dtype), rev, f.e_last[..., 0].contiguous(), f


def _on_device() -> bool:
    """Kernel 0 forms the factors and kernel 2 runs all of pass 3 (the path's default)."""
    return FACTORS_IN_KERNEL and WY_IN_KERNEL


def _chunk_pass(qs, ks, v, g, beta, do, h0, dht, into=None, q_scale=None, slots=None,
                group_sum=False):  # fmt: skip
    """Value heads of one pass, everything per value head: qs (scaled), ks (B, T, HV, K), v, do
    (B, T, HV, V), g, beta (B, T, HV); h0, dht (B, HV, K, V) fp32 or None -> (dqs, dks (B, T,
    HV, K), dv, dg, dbeta, dh0) fp32. On the 16-bit device path (`_device_pass`) qs, ks, v, do
    come in do's 16-bit dtype, qs / ks at the pass's H / HV q heads (strided head slices
    allowed: TMA reads them in place), else fp32 but do, qs / ks repeated to HV; into,
    q_scale, slots: the device pass's buffers, dq scale (`_device_pass`; q_scale only where
    `_folds` or the fused kernel's sums are the op's) and varlen slot layout (ops/
    _linattn_varlen.py), the other paths take none; group_sum: the fused kernel's `group_sum`
    key (`_pair_sums`: dqs, dks at the H heads, summed over each head's two value heads)."""
    t, dtype = qs.shape[1], do.dtype
    nc = -(-t // CHUNK)
    on_device = _on_device()
    if on_device and STATES16:
        return _device_pass(qs, ks, v, g, beta, do, h0, dht, into, q_scale, slots, group_sum)
    if group_sum:
        raise ValueError("group_sum is the fused kernel's (the device pass)")
    if slots is not None:
        raise ValueError("the slot layout (varlen) is the device pass's")
    if on_device:  # kernel 0: the factors from the 16-bit tiles kernel 2 reads too
        qs, ks, v16 = (x.to(dtype) for x in (qs, ks, v))
        out = _factors(qs, ks, v16, g, beta)
        fw = forward_launch_tiles(out)  # u, -W, -Ke with the chunks reversed (copies)
        # `out` keeps only what kernel 2 reads: the others go with `rev` (the peak)
        rev = (*(out.pop(n) for n in ("pt", "ke", "qe")), out["w"])
        e_last = out["e_last"]
    else:
        fw, rev, e_last, f = _torch_factor_tiles(qs, ks, v, g, beta, dtype)
    du_fw, dh_fw, _ = _state_recurrence(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")),
                                        fw["e_last"], h0)  # fmt: skip
    h, big_u = forward_states(du_fw, dh_fw)  # copies (the chunks flipped back)
    del fw, du_fw, dh_fw  # the peak: free launch 1's tiles and outputs before launch 2's
    do_c = to_chunks(do, nc)
    du_t, dh_t, dh0 = _state_recurrence(to_tokens(do_c), *rev, e_last, dht)
    del rev
    d_u = du_t.unflatten(1, (nc, CHUNK)).transpose(2, 3)
    dh = dh_t.transpose(-1, -2)  # dS (K, V) at every chunk's end
    del do_c
    tiles = chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)
    del big_u, h, dh  # kernel 2 reads the 16-bit tiles
    if on_device:  # kernel 2, all of pass 3, on kernel 0's T^T, w, u and G
        k2 = for_kernel2(out, t)
        tiles = (*tiles[:-1], k2["big_g"])
        wide = beta.to(torch.promote_types(beta.dtype, torch.float32)).contiguous()
        wy = (k2["tt"], k2["w"], k2["u"], v16.contiguous(), wide)
        dq, dk, dg, dv, dbeta = _chunk_grads_wy(*tiles, *wy)
        return dq, dk, dv, dg, dbeta, dh0
    if WY_IN_KERNEL:  # kernel 2: all of pass 3
        dq, dk, dg, dv, dbeta = _chunk_grads_wy(*tiles, *wy_tiles(f, v, beta, dtype))
        return dq, dk, dv, dg, dbeta, dh0
    dq, dk, dw, dg = _chunk_grads(*tiles)  # kernel 2: `_output_grads`
    del tiles
    dk_wy, dv, dbeta, dg_wy = _wy_grads(f, to_chunks(dw, nc), d_u)  # the WY half: torch
    dg_wy = dg_wy.flip(-1).cumsum(-1).flip(-1)  # G = cumsum(g) within the chunk
    dk_wy, dv, dg_wy, dbeta = (to_tokens(x)[:, :t] for x in (dk_wy, dv, dg_wy, dbeta))
    return dq, dk + dk_wy, dv, dg + dg_wy, dbeta, dh0


def _wy_buffers(do, kd, dg, dv, dbeta, dq=None, dk=None, tokens=None, heads=None):
    """Kernel 2's (WY, dv16) five outputs: dq, dk, dg, dv, dbeta the given buffers, the rest
    (and any None) new: dq, dk (B, T, HV, K) fp32 (QK16: do's dtype; `heads` heads where given:
    the fused kernel's `group_sum`), dg, dbeta (B, T, HV) fp32, dv do's shape (T = `tokens`
    where given: the token rows of the slot layout's `token_rows` outputs) and dtype."""
    b, t, hv, vd = do.shape
    t = t if tokens is None else tokens
    hq = hv if heads is None else heads
    f32 = {"dtype": torch.float32, "device": do.device}
    qk = {"dtype": do.dtype if QK16 else torch.float32, "device": do.device}
    return (torch.empty(b, t, hq, kd, **qk) if dq is None else dq,
            torch.empty(b, t, hq, kd, **qk) if dk is None else dk,
            torch.empty(b, t, hv, **f32) if dg is None else dg,
            torch.empty(b, t, hv, vd, dtype=do.dtype, device=do.device) if dv is None else dv,
            torch.empty(b, t, hv, **f32) if dbeta is None else dbeta)  # fmt: skip


# Kernel 2 writes dq, dk in the tiles' 16-bit dtype (its `dqk16` key: rounded once from fp32,
# the epilogue kernel's `d16` key sums them in fp32), and without l2norm and with HV = H
# (`_folds`) times the q scale, the op's dq / dk themselves: no epilogue launch. TEMPORARY
# switch for the GPU A/B (NOTES "GDN backward: 16-bit dq / dk from the chunk kernel"); False:
# fp32 dq, dk and the epilogue always (64 KB a chunk-head more moved at K = 128).
QK16 = True

# Kernel 2's `fsplit` form (with QK16 only): two math warpgroups split by function, the output
# half and the WY half meeting once at dk's fp32 stash (the same outputs bit for bit). On since
# the H100 A/B: 1.968 vs 2.319 ms (1.18x) at 4 x 8192 hv32 bf16 (2026-12-06), its racecheck
# report answered (NOTES "GDN fsplit race"). False: the 256-thread dqk16 key, kept for A/Bs
# until it is retired.
FSPLIT = True

# The fused backward (kernels/linear_attention/gdn_bwd_fused/sm90, `_fused_pass`: kernel 1's
# reverse launch and kernel 2 in one kernel, one CTA per (sequence, value head), dU and dS on
# chip) with QK16, where B x HV fills about a wave (`fused_fits`; fewer CTAs: today's path).
# On since the H100 A/B of 2026-12-06 16:58 (4 x 8192 hv32: 4.601 -> 3.802 ms, 1.21x; synccheck 0
# errors and racecheck 0 hazards with DS_READY / FINISH in the unaligned form, NOTES "GDN fused
# backward" and next/fused-sync); below the rule it is slower (1 x 8192 hv32 1.319 vs 2.568 ms
# forced). FUSED_SWITCH overrides it for the GPU checks: "1" as FUSED = True, "all" every device
# pass (small shapes too), "0" off (today's two-launch path, kept while the rule decides).
FUSED = True
FUSED_SWITCH = "FORGEKERNEL_GDN_BWD_FUSED"

# The fused route without the tiles nobody needs there (NOTES "next/gdn-fused-diet"). Kernel 0's
# `fused` key writes no Qe, Ke (32 KB a chunk-head); kernel 1's forward launch (its `fused` key)
# reads k (at the H heads) and G in place of Ke and writes h only (U's 16 KB not stored); the
# fused kernel forms U = u - W h (`u_from_h`: U's 16 KB not read, its box filled by the state
# warpgroup). ~72 KB a chunk-head less moved in all. Measured on the H100 (2026-12-06 22:05, the
# gdn_bwd bench): 4 x 8192 hv32 bf16 eager 3.834 -> 3.615 ms; graph replay 5.59 -> 5.54 ms,
# unchanged as expected (a capture runs the varlen slot layout, which takes the fused route only
# with FUSED_SLOTS, and there only the fused kernel's part applies); the diet_keys GPU tests 10
# passed, racecheck 0 hazards (2-63-2-4-dtype0). False: the fused route of before (U read), kept
# as the baseline of the diet GPU tests and of the slot route's `forced diet off` column
# (tests/gpu/test_gdn_bwd_fused_slots_gpu.py test_time: `varlen` against `varlen, u_from_h`). In the
# varlen slot layout (FUSED_SLOTS) only the fused kernel's part: kernel 0's and kernel 1's `fused`
# keys have no varlen form, so there the forward launch reads Ke and writes U, and the fused
# kernel's `varlen, u_from_h` key saves only U's read (NOTES "next/fused-slots-on46").
FUSED_DIET = True

# The fused kernel's `group_sum` key (next/gdn-bwd-groupsum): at HV = 2 H the two value heads of
# a q / k head run as one cluster of two CTAs and sum dq, dk in fp32 through distributed shared
# memory, the 16-bit sum stored once at the H head; without l2norm those are the op's dq, dk
# (dq times the scale): no norm epilogue launch (two of them at 4 x 8192 h16 hv32, est. 0.20-0.27
# ms of the 3.615 ms call); with l2norm the epilogue stays, on the summed H-head gradients (its
# group sum a copy: half its reads). One pass of heads on the fused route only, B equal
# sequences (the slot layout: FUSED_SLOTS_GROUPSUM as well; `_pair_sums`). Measured on the H100
# (2026-12-07 00:11-00:23, 4 x 8192 h16 hv32 bf16): the call 3.530 -> 3.307 ms eager (-0.223),
# the two GdnBwdNorm launches (280 us) gone from the batch form's graph; the fused kernel alone
# 1.988 -> 2.117 ms (+0.129: the two exchanges a chunk, over the rule's 0.1 ms guard, which was
# there to catch them costing more than the launches save: the net decides, NOTES
# "next/gdn-bwd-adopt"); GPU tests 69 passed, racecheck 0 hazards, synccheck and memcheck 0
# errors. The bench's graph column (cu_seqlens: the slot
# layout) takes it only with FUSED_SLOTS_GROUPSUM. False: the epilogue's group sum, the GPU
# tests' A/B.
FUSED_GROUPSUM = True

# TEMPORARY (next/gdn-bwd-slots-groupsum, no GPU run yet): FUSED_GROUPSUM in the varlen slot
# layout too, on the fused slot route (FUSED_SLOTS, `_fused_slots_selected`): the fused kernel's
# `varlen, group_sum` key, the pair of value heads of a q / k head one cluster walking one
# sequence's slots, dq, dk summed at the H heads and stored at their token rows, so that a
# CUDA-graph capture (every varlen call in slots) loses the two norm launches too (280 us at 4 x
# 8192 h16 hv32 on the H100; predicted graph 4.676 -> ~4.45 ms). Off until its device A/B
# (docs/pending/gdn-bwd-slots-groupsum-probes.txt; adoption rule there and in NOTES).
FUSED_SLOTS_GROUPSUM = False

# TEMPORARY (next/gdn-w-from-t, next/gdn-w-from-t2; no GPU run yet): the fused kernel's
# `wg_split, w_from_t` key on the fused route with FUSED_DIET (`u_from_h`), B equal sequences and
# the slot layout alike: G's chain on two math warpgroups (`wg_split`, a candidate itself) and W
# = T diag(beta e^G) K, u = T diag(beta) V formed in the kernel from T^T, k, v (its G2), not read
# (32 KB a chunk-head, v's 16 KB read by TMA in their place). On B equal sequences also kernel
# 0's and kernel 1's forward launch's `w_from_t` keys: kernel 0 the T-only form (P^T, T^T, G,
# e^(G_C); no W, u written, v not read: 48 KB a chunk-head), the forward launch forming u^T and
# W from T^T, v, k, beta, G (reads v 16 + T^T 8 in place of u, W 32): W, u never in HBM
# (predicted, 4 x 8192 h16 hv32: kernel 0 -0.3 to -0.45 ms, the call -0.3 to -0.5 ms from W, u
# alone, the split's own change beside it; NOTES "next/gdn-w-from-t2 (2026-12-07)"). In the
# slot layout kernel 0 and the forward launch keep their standard keys (no varlen form): there
# only the fused kernel's reads go. Off until its device A/B
# (docs/pending/gdn-bwd-w-from-t-probes.txt; the rule there).
FUSED_WFROMT = False


def _pair_sums(b: int, h: int, hv: int, device: torch.device, one_pass: bool, slots) -> bool:
    """Whether the device pass of B sequences x HV value heads (H q / k heads) has the fused
    kernel sum dq, dk over each head's value heads (its `group_sum` key): FUSED_GROUPSUM, HV =
    PAIR H, one pass of heads (a pass is then the call: the fused rule is decided on the same
    B, HV) and the fused route taken: B equal sequences (`_fused_selected`), or the varlen slot
    layout (`slots`) with FUSED_SLOTS_GROUPSUM on the fused slot route (`_fused_slots_selected`:
    its tables present; the `varlen, group_sum` key)."""
    if not (FUSED_GROUPSUM and hv == PAIR * h and one_pass):
        return False
    if slots is None:
        return _fused_selected(b, hv, device)
    return FUSED_SLOTS_GROUPSUM and _fused_slots_selected(slots, hv, device)


def _fused_selected(b: int, hv: int, device: torch.device, slots: bool = False) -> bool:
    """Whether the device pass of B sequences x HV value heads runs the fused kernel (`slots`:
    N sequences in the slot layout, `slots_fit`'s rule)."""
    mode = os.environ.get(FUSED_SWITCH, "1" if FUSED else "0")
    if mode == "all":
        return QK16
    fits = slots_fit if slots else fused_fits
    return mode == "1" and QK16 and fits(b, hv, _device_sms(device))


# The fused kernel on the varlen slot layout (its `varlen` key: kernel 1's varlen walk, one CTA
# a (value head, sequence), the token outputs at their token rows; `native` slots only), so that
# a CUDA-graph capture, which runs every varlen call in slots, gets the fused route too (H100
# 2026-12-06, 4 x 8192 h16 hv32 as cu_seqlens: eager 3.92 ms on the batch path's fused kernel,
# graph 5.52 on the two-launch slot path). The rule (`config.slots_fit`): N x HV from 3/4 of a
# wave to one wave. A capture cannot see the lengths: a skewed mix within a wave pays the fused
# kernel's ~15 us a slot down its longest chain (up to ~1.7x the call at 4 sequences, one
# holding every token; NOTES "next/fused-slots"). Measured on the H100 (2026-12-07 00:11-00:23,
# graph_vs_eager_probe gdn_bwd:4x8192-h16-hv32, varlen form): graph 5.543 -> 4.676 ms (-0.867;
# GdnBwdChunk + two GdnBwdState, 4199 us, replaced by GdnBwdFused + one state launch, 2675 us),
# eager unchanged (the batch path); GPU tests 22 + 2 passed, racecheck 0 hazards, synccheck and
# memcheck 0 errors (NOTES "next/gdn-bwd-adopt"). FUSED_SLOTS_SWITCH "1" / "0" overrides
# (FUSED_SWITCH "all" forces every shape, as on the batch path); False: the two-launch slot path
# (what the rule takes outside its wave), the GPU tests' A/B.
FUSED_SLOTS = True
FUSED_SLOTS_SWITCH = "FORGEKERNEL_GDN_BWD_FUSED_SLOTS"


def _fused_slots_selected(slots, hv: int, device: torch.device) -> bool:
    """Whether the slot layout's device pass (N sequences x HV value heads) runs the fused
    kernel: FUSED_SLOTS, the per-slot tables present (`native`: the kernel writes token rows
    only) and `_fused_selected`'s slot rule."""
    mode = os.environ.get(FUSED_SLOTS_SWITCH, "1" if FUSED_SLOTS else "0")
    if mode != "1" or not native(slots):
        return False
    return _fused_selected(slots.cu_seqlens.shape[0] - 1, hv, device, slots=True)


def state_flags(slots) -> dict:
    """Kernel 1's launch keywords for the varlen slot layout (ops/_linattn_varlen.py `Slots`)
    or none (None: B equal sequences)."""
    return {} if slots is None else {"cu_seqlens": slots.cu_seqlens, "order": slots.order}


def side_by_side_states(slots, b: int, hv: int, device: torch.device) -> bool:
    """Kernel 1's two launches side by side: both fit one wave (`concurrent_state_launches`),
    or varlen (`slots`): there the longest chain, not the work, sets a launch's time wherever
    N HV CTAs leave SMs idle behind it, and side by side the second launch's CTAs fill them
    (GDN mix16-t16384 hv32 on 132 SMs: chains of 98 slots, 2 x 98 slot steps in a row, ~134
    side by side; work-bound cases take their work either way)."""
    return slots is not None or concurrent_state_launches(b, hv, _device_sms(device))


def native(slots) -> bool:
    """The slot layout's run writes its token gradients at their token rows: `slots` carries
    the per-slot tables (ops/_linattn_varlen.py NATIVE_STORES, given where `stores_natively`)."""
    return slots is not None and slots.starts is not None


def stores_natively() -> bool:
    """Kernel 2 has the `token_rows` form here: the device pass with QK16 and FSPLIT (the
    256-thread dqk16 key with `token_rows` spills: 16 bytes, NOTES "next/varlen-stores")."""
    return _slots_path() and QK16 and FSPLIT


def pass_tokens(b: int, t: int, slots) -> int:
    """The tokens a pass of heads counts against TOKEN_HEADS_PER_PASS: B T, or in the varlen
    slot layout the callers' tokens (its zero rows, fewer than 64 N, left out: the suites'
    mix64-t32768, 32768 tokens in 576 slots, stays one pass as 4 x 8192; two would run kernel
    1's 194-slot chain twice, ~1 ms more on the H100's 5.5 us a slot step)."""
    return b * t if slots is None else slots.rows.shape[0]


def _device_pass(qs, ks, v, g, beta, do, h0, dht, into=None, q_scale=None, slots=None,
                 group_sum=False):  # fmt: skip
    """`_chunk_pass` with every kernel writing what the next reads (kernel 1 `out16`): kernel
    0's tiles, kernel 1's forward launch (`forward`: chunks first to last on kernel 0's u, W,
    Ke as written, the signs in registers) -> U, h (16-bit, chunk order), its reverse launch on
    kernel 0's tiles cut to T -> dU, dS (16-bit), kernel 2 on those; the two launches side by
    side where both fit one wave (`concurrent_state_launches`), or over segments of each
    sequence where SEGMENTS_SWITCH / SEGMENTS picks them (`_segmented_states`: a summary phase
    and two scans in torch before them). No torch op between the kernels otherwise (views
    only; the forward launch builds its I and 0 tiles in). into: (dq, dk, dv,
    dg, dbeta, dh0) contiguous buffers (or None each) kernel 2 / kernel 1 write directly (dq,
    dk only with q_scale). q_scale (QK16, `_folds`): kernel 2's 16-bit dq times it, dq and dk
    the op's gradients (no epilogue). slots: the varlen slot layout (B = 1 over its S C
    rows, h0 / dht / dh0 (N, HV, K, V)): kernel 1's varlen form, side by side; with its
    per-slot tables (`native`) kernel 2 writes dq, dk, dv, dg, dbeta at their T token rows
    (the `token_rows` key; `into` those rows' buffers). group_sum (`_pair_sums`, which took
    the fused route's rule): the fused kernel's `group_sum` key, dq, dk at the H heads."""
    t, device = qs.shape[1], qs.device
    # the fused kernel: B equal sequences, or the slot layout's N (`_fused_slots_selected`)
    if (_fused_selected(do.shape[0], do.shape[2], device) if slots is None
            else _fused_slots_selected(slots, do.shape[2], device)):  # fmt: skip
        return _fused_pass(qs, ks, v, g, beta, do, h0, dht, into, q_scale, slots, group_sum)
    if group_sum:
        raise ValueError("group_sum is the fused route's (`_pair_sums` decides with its rule)")
    varlen = state_flags(slots)
    dq_o, dk_o, dv_o, dg_o, dbeta_o, dh0_o = into or (None,) * 6
    out = _factors(qs, ks, v, g, beta)
    fw = forward_launch_tiles(out, identity=False)  # u, W, Ke, e^(G_C) as written (views)

    def forward_launch():
        return _state_recurrence(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")),
                                 fw["e_last"], h0, out16=True, forward=True,
                                 **varlen)  # fmt: skip

    def reverse_launch():
        rev = tuple(cut(out[n], 1, slice(None, t)) for n in ("pt", "ke", "qe", "w"))
        return _state_recurrence(do, *rev, out["e_last"], dht, out16=True, **given(dh0=dh0_o),
                                 **varlen)  # fmt: skip

    nc = out["e_last"].shape[1]
    parts = 1 if slots is not None else _segments_selected(do.shape[0], do.shape[2], nc, device)
    if parts > 1:
        (u16, h16), (du16, dh16, dh0) = _segmented_states(fw, out, do, h0, dht, parts, dh0_o)
    elif side_by_side_states(slots, do.shape[0], do.shape[2], device):
        (u16, h16, _), (du16, dh16, dh0) = side_by_side(device, forward_launch, reverse_launch)
    else:
        u16, h16, _ = forward_launch()
        du16, dh16, dh0 = reverse_launch()
    for name in ("pt", "ke", "qe"):
        del out[name]
    k2 = for_kernel2(out, t)
    wide = beta.to(torch.promote_types(beta.dtype, torch.float32))
    u16, du16 = (cut(x, 1, slice(None, t)) for x in (u16, du16))  # segments: NC C rows
    tiles = (do, u16, du16, qs, ks, h16, dh16, k2["big_g"])
    rows = {}  # the slot layout's outputs at their token rows (`native`)
    if native(slots):
        rows = {"tables": (slots.starts, slots.lengths), "tokens": slots.rows.shape[0]}
    wy_out = None if into is None else _wy_buffers(do, qs.shape[-1], dg_o, dv_o, dbeta_o, dq_o,
                                                   dk_o, rows.get("tokens"))  # fmt: skip
    flags = {"dqk16": True, "scale": 1.0 if q_scale is None else q_scale} if QK16 else {}
    if QK16 and FSPLIT:
        flags["fsplit"] = True
    flags.update(rows)
    dq, dk, dg, dv, dbeta = _chunk_grads_wy(*tiles, k2["tt"], k2["w"], k2["u"], v, wide,
                                            dv16=True, **flags, **given(out=wy_out))  # fmt: skip
    return dq, dk, dv, dg, dbeta, dh0


def _fused_bwd(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, **flags):
    """The fused kernel (kernel 1's reverse recurrence + kernel 2, `gdn_bwd_fused`): (dq, dk,
    dg, dv, dbeta, dh0) (`flags`: scale, out; the slot layout's cu_seqlens, order, tables,
    tokens; group_sum: dq, dk at the H heads; u None: U = uw - W h formed in the kernel; w, uw
    None and wg_split (FUSED_WFROMT): W, u formed in the kernel from T^T, k, v). The CPU tests
    put an emulation here."""

    return fused_launch.gdn_bwd_fused(do, u, q, k, h, big_g, pt, tt, w, uw, v, beta, dht, **flags)


def _fused_pass(qs, ks, v, g, beta, do, h0, dht, into=None, q_scale=None, slots=None,
                group_sum=False):  # fmt: skip
    """`_device_pass` on the fused kernel (FUSED): kernel 0's tiles, kernel 1's forward
    launch (U, h), then `_fused_bwd` on kernel 0's P^T, T^T, W, u, G (its Ke, Qe, e^(G_C) not
    read: folded in registers) with the same outputs as kernel 2 + the reverse launch. slots
    (`native`): the varlen slot layout, both kernels' varlen forms, the token gradients at
    their token rows (`_device_pass`'s). With FUSED_DIET: U formed in the fused kernel; on B
    equal sequences also kernel 0 without Ke, Qe and the forward launch on k and G writing h
    only (their `fused` keys have no varlen form: in the slot layout the forward launch reads
    Ke and writes U as before). group_sum: the kernel's `group_sum` key (dq, dk at the H
    heads, summed over each head's two value heads in fp32)."""
    t = qs.shape[1]
    dq_o, dk_o, dv_o, dg_o, dbeta_o, dh0_o = into or (None,) * 6
    batch_diet = FUSED_DIET and slots is None  # kernel 0's and kernel 1's `fused` keys
    t_only = FUSED_WFROMT and batch_diet  # and their `w_from_t` keys: W, u never in HBM
    out = _factors(qs, ks, v, g, beta, fused=batch_diet, w_from_t=t_only)
    k2 = for_kernel2(out, t)
    wide = beta.to(torch.promote_types(beta.dtype, torch.float32))
    # t_only: v in u's place, T^T in P^T's, no W (formed), beta
    fw = forward_launch_tiles(out, identity=False, k=ks if batch_diet else None,
                              **({"v": v, "beta": wide} if t_only else {}))  # fmt: skip
    diet = given(big_g=fw.get("big_g"), beta=fw.get("beta"))
    u16, h16, _ = _state_recurrence(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")),
                                    fw["e_last"], h0, out16=True, forward=True,
                                    **diet, **state_flags(slots))  # fmt: skip
    rows = {}  # the slot layout's walk and token rows
    if slots is not None:
        rows = {**state_flags(slots), "tables": (slots.starts, slots.lengths),
                "tokens": slots.rows.shape[0]}  # fmt: skip
    bufs = None
    if into is not None:
        b, _, hv, vd = do.shape
        n = b if slots is None else slots.cu_seqlens.shape[0] - 1
        dh0 = dh0_o if dh0_o is not None else do.new_empty(n, hv, qs.shape[-1], vd,
                                                           dtype=torch.float32)  # fmt: skip
        heads = qs.shape[2] if group_sum else None
        bufs = (*_wy_buffers(do, qs.shape[-1], dg_o, dv_o, dbeta_o, dq_o, dk_o,
                             rows.get("tokens"), heads), dh0)  # fmt: skip
    big_u = None if FUSED_DIET else u16[:, :t]  # FUSED_DIET: formed in the kernel (`u_from_h`)
    if group_sum:
        rows["group_sum"] = True
    wy = (None, None)  # FUSED_WFROMT: W, u formed in the kernel (`wg_split, w_from_t`)
    if FUSED_WFROMT and FUSED_DIET:
        rows["wg_split"] = True
    else:
        wy = (k2["w"], k2["u"])
    dq, dk, dg, dv, dbeta, dh0 = _fused_bwd(
        do, big_u, qs, ks, h16, k2["big_g"], out["pt"][:, :t], k2["tt"], *wy, v, wide, dht,
        scale=1.0 if q_scale is None else q_scale, **given(out=bufs), **rows,
    )  # fmt: skip
    return dq, dk, dv, dg, dbeta, dh0


def _normalized(x, scale, l2norm, dtype):
    """The device path's q / k side (B, T, H, D) -> x scale / sqrt(x.x + eps) (l2norm) or x
    scale, written once in `dtype` (the norm reduced in fp32 from x as it is: no fp32 copy;
    the backward recomputes it from x); x itself where that is x (no l2norm, scale 1, x in
    `dtype`: k without l2norm; every reader takes it read-only). q x scale stays a copy: no
    kernel reading q (kernel 0's P, Qe; kernel 2's dk) has a scale argument to fold it into."""
    if not l2norm and scale == 1.0 and x.dtype == dtype:
        return x
    out = torch.empty(x.shape, dtype=dtype, device=x.device)
    if not l2norm:
        return torch.mul(x, scale, out=out)
    norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True, dtype=torch.float32)
    return torch.mul(x, (norm.square() + L2NORM_EPS).rsqrt() * scale, out=out)


def _qk_grads(dxs, x, scale, l2norm, out=None):
    """The q / k epilogue (kernels/linear_attention/gdn_bwd_norm/sm90): dxs (B, T, HV, K) fp32
    or x's 16-bit dtype (kernel 2's dq or dk; QK16) -> the gradient of the op's input x (B, T,
    H, K) in x's dtype (group sum, l2norm's backward, scale), into `out` (contiguous, x's
    shape and dtype) when given.
    The CPU tests put the model here."""

    return norm_launch.gdn_bwd_norm(dxs, x, scale, l2norm, out=out)


# The group sum and l2norm's backward on the epilogue kernel (`_qk_grads`); False: torch
# (`_normalized_backward`, ~1.75 KB a token-head more written).
NORM_IN_KERNEL = True


def _normalized_backward(dxs, x, scale, l2norm, out=None):
    """`_qk_grads` in torch: the group sum, then scale / ||x|| (d - x (x . d) / ||x||^2)
    (l2norm) or scale d, in x's dtype (the fallback), into `out` when given."""
    h = x.shape[2]
    dsum = dxs.float().unflatten(2, (h, dxs.shape[2] // h)).sum(3)  # 16-bit (QK16): in fp32
    if out is None:
        out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if not l2norm:
        return torch.mul(dsum, scale, out=out)
    xf = x.float()
    sq = (xf.unsqueeze(-2) @ xf.unsqueeze(-1)).squeeze(-1) + L2NORM_EPS
    c = (xf.unsqueeze(-2) @ dsum.unsqueeze(-1)).squeeze(-1) / sq
    return torch.mul(dsum.addcmul_(xf, c, value=-1), sq.rsqrt() * scale, out=out)


def _pass_buffers(out: GradsOut, seq, dtypes, k_last: bool, fold: bool = False) -> tuple | None:
    """The one pass's (dq, dk, dv, dg, dbeta, dh0) buffers its kernels write directly
    (`_device_pass`'s `into`): each of `out`'s (flat) in (B, T, ...) form where it has the
    dtype the kernel writes (`dtypes`: dv's, dg's, dbeta's, dh0's; dq, dk only where kernel 2
    writes the op's dq, dk: `fold`, in dv's 16-bit dtype); d_initial_state only in the
    kernel's (K, V) layout (k_last: copied after the transpose)."""
    if out is None:
        return None
    qk = [None if o is None or not fold or o.dtype != dtypes[0] else seq(o) for o in out[:2]]
    into = [None if o is None or o.dtype != dt else seq(o)
            for o, dt in zip(out[2:5], dtypes[:3])]  # fmt: skip
    dh0 = out[5]
    into.append(None if dh0 is None or k_last or dh0.dtype != dtypes[3] else dh0)
    return (*qk, *into)


def _folds(l2norm: bool, group: int, q: torch.Tensor, k: torch.Tensor, dtype) -> bool:
    """Kernel 2 writes the op's dq, dk (16-bit, dq times the scale: QK16): no l2norm, no
    value-head group (HV = H), q and k in the tiles' dtype, the device pass (`_on_device`,
    STATES16). The epilogue kernel would only scale dq there."""
    return (QK16 and _on_device() and STATES16 and not l2norm and group == 1
            and q.dtype == k.dtype == dtype)  # fmt: skip


def _joined(parts, i, out):
    """Gradient i of one pass (as it is) or of several passes (value heads) concatenated, into
    `out` (the (B, T, ...) or state buffer) when given and of its dtype."""
    if len(parts) == 1:
        return parts[0][i]
    dim = 1 if i == 5 else 2
    xs = [p[i] for p in parts]
    if out is not None and out.dtype == xs[0].dtype:
        return torch.cat(xs, dim=dim, out=out)
    return torch.cat(xs, dim=dim)


def _backward_device(q, k, v, g, beta, h0, do, dht, scale, l2norm, b, out=None,
                     k_last=False, slots=None, token_qk=None) -> Grads:  # fmt: skip
    """`_backward_kernel` on the device path with 16-bit kernel-1 outputs: q / k normalized,
    scaled and converted at H heads (`_normalized`), read there by kernels 0 and 2 (value head
    hv: head hv // (HV / H); no repeated copy), v and do passed as they are (strided head
    slices), the group sum, l2norm's backward and the scale on the epilogue kernel
    (`_qk_grads`; NORM_IN_KERNEL False: torch), one pass: no concatenation. `out` (flat
    buffers, `GradsOut`): written by the last writer of each gradient (the epilogue's dq, dk;
    kernel 2's dv, dg, dbeta and kernel 1's dh0 in one pass, their concatenation in several),
    a copy only where the dtype or layout differs (beta in 16 bits, k_last's dh0). Without
    l2norm and with HV = H (`_folds`) kernel 2 writes dq (times the scale) and dk themselves
    in 16 bits: no epilogue launch; with FUSED_GROUPSUM at HV = 2 H on the fused route
    (`_pair_sums`) the fused kernel writes them summed at the H heads (without l2norm the
    op's: no epilogue launch; with it the epilogue on those). slots: the varlen slot layout the
    tokens are in (b = 1; `_device_pass`); with its tables (`native`) the token gradients come
    back at the callers' T token rows (`out` those rows' buffers), the epilogue reading
    `token_qk`, the callers' q, k (T, H, K)."""
    h, hv, dtype = q.shape[1], v.shape[1], do.dtype
    t, group = q.shape[0] // b, hv // h
    rows = slots.rows.shape[0] if native(slots) else t  # the gradients' tokens a sequence

    def seq(x):
        return x.reshape(b, t, *x.shape[1:])

    def seq_out(x):
        return x.reshape(b, rows, *x.shape[1:])

    qs = _normalized(seq(q), scale, l2norm, dtype)
    ks = _normalized(seq(k), 1.0, l2norm, dtype)
    v_side = [seq(v).to(dtype), seq(g).float(), seq(beta), seq(do)]
    step = max(1, TOKEN_HEADS_PER_PASS // max(1, pass_tokens(b, t, slots) * group))
    heads = range(0, h, step)
    one = len(heads) == 1
    f32 = torch.float32
    fold = _folds(l2norm, group, q, k, dtype)
    # the fused kernel's `group_sum`: dq, dk summed at the H heads; without l2norm the op's
    pair = not fold and _pair_sums(b, h, hv, q.device, one, slots)
    final = fold or (pair and not l2norm and q.dtype == k.dtype == dtype)
    into = _pass_buffers(out, seq_out, (dtype, f32, f32, f32), k_last, final) if one else None
    parts = []
    for first in heads:  # passes over heads, not chunks
        qh, vh = slice(first, first + step), slice(first * group, (first + step) * group)
        # q / k at their own heads: kernels 0 and 2 read head hv // (HV / H) (`grouped`)
        # `cut`: one pass (every head) takes the tensors themselves, no view each
        states = (None if x is None else cut(x, 1, vh).float().contiguous() for x in (h0, dht))
        parts.append(_chunk_pass(cut(qs, 2, qh), cut(ks, 2, qh), *(cut(x, 2, vh) for x in v_side),
                                 *states, into=into, q_scale=scale if final else None,
                                 slots=slots, group_sum=pair))  # fmt: skip
    outs = (None,) * 6 if out is None else (*(None if o is None else seq_out(o) for o in out[:5]),
                                           None if k_last else out[5])  # fmt: skip
    if final:  # kernel 2 / the fused kernel wrote the op's dq, dk (16-bit, scaled): no epilogue
        dq, dk = (_joined(parts, i, outs[i]) for i in (0, 1))
    else:  # at HV heads (16-bit with QK16, else fp32; `pair`: summed at H): the epilogue's
        dqs, dks = (_joined(parts, i, None) for i in (0, 1))
    dv, dg, dbeta, dh0 = (_joined(parts, i, outs[i]) for i in range(2, 6))
    del parts
    if not final:
        epilogue = _qk_grads if NORM_IN_KERNEL else _normalized_backward
        xq, xk = (seq(q), seq(k)) if token_qk is None else (seq_out(x) for x in token_qk)
        dq = epilogue(dqs, xq, scale, l2norm, **given(out=outs[0]))
        dk = epilogue(dks, xk, 1.0, l2norm, **given(out=outs[1]))
    return (*(x.flatten(0, 1) for x in (dq, dk, dv, dg, dbeta)), dh0)


def _backward_kernel(q, k, v, g, beta, initial_state, do, d_final, scale, k_last, l2norm,
                     batch, out=None, slots=None, token_qk=None) -> Grads:  # fmt: skip
    """The backward on kernel 1 (see the module docstring): flat tensors as
    `_backward_interim`'s holding `batch` sequences of equal length. Grouped heads: q / k
    (normalized, scaled) repeated to the value heads before the factors (kernel 1 and every
    factor are per value head), dq / dk summed over each group of HV / H value heads after;
    value heads in passes of TOKEN_HEADS_PER_PASS token-heads (two kernel launches a pass) to
    bound the fp32 temporaries. slots (with batch 1): the tokens in the varlen slot layout
    (ops/_linattn_varlen.py), the states (N, ...): the device pass only (`_slots_path`);
    token_qk: `_backward_device`'s (the slot layout's tables given)."""
    b, h, hv = batch, q.shape[1], v.shape[1]
    t, group = q.shape[0] // b, hv // h
    h0 = _to_kv(initial_state, k_last)
    dht = _to_kv(d_final, k_last)
    likes = (q, k, v, g, beta)
    if _on_device() and STATES16:
        grads = _backward_device(q, k, v, g, beta, h0, do, dht, scale, l2norm, b, out, k_last,
                                 slots, token_qk)  # fmt: skip
        return written(out, (*grads[:5], _to_kv(grads[5], k_last)), likes)
    if slots is not None:
        raise ValueError("the slot layout (varlen) is the device pass's")

    def seq(x):
        return x.reshape(b, t, *x.shape[1:])

    qf, kf = seq(q).float(), seq(k).float()
    qn, q_norm = _l2norm(qf) if l2norm else (qf, None)
    kn, k_norm = _l2norm(kf) if l2norm else (kf, None)
    v_side = [seq(v).float(), seq(g).float(), seq(beta).float(), seq(do)]
    step = max(1, TOKEN_HEADS_PER_PASS // max(1, b * t * group))
    parts = []
    for first in range(0, h, step):  # passes over heads, not chunks
        qh, vh = slice(first, first + step), slice(first * group, (first + step) * group)
        qs = (qn[:, :, qh] * scale).repeat_interleave(group, dim=2)
        ks = kn[:, :, qh].repeat_interleave(group, dim=2)
        states = (None if x is None else x[:, vh].float().contiguous() for x in (h0, dht))
        parts.append(_chunk_pass(qs, ks, *(x[:, :, vh] for x in v_side), *states))
    dqs, dks, dv, dg, dbeta, dh0 = (torch.cat(x, dim=1 if i == 5 else 2)
                                    for i, x in enumerate(zip(*parts)))  # fmt: skip
    dqn = dqs.unflatten(2, (h, group)).sum(3) * scale
    dkn = dks.unflatten(2, (h, group)).sum(3)
    dq = _l2norm_backward(qn, q_norm, dqn) if l2norm else dqn
    dk = _l2norm_backward(kn, k_norm, dkn) if l2norm else dkn
    flat = (x.flatten(0, 1) for x in (dq, dk, dv, dg, dbeta))
    return written(out, (*flat, _to_kv(dh0, k_last)), likes)


def _backward_varlen(q, k, v, g, beta, initial_state, do, d_final, scale, k_last, l2norm,
                     cu_seqlens, out=None) -> Grads | None:  # fmt: skip
    """Varlen on the kernel path (ops/_linattn_varlen.py `backward_varlen`): on the device pass
    (`_slots_path`) unequal lengths run once in the slot layout, and so does every call under
    a CUDA-graph capture (no host read: equal lengths too); eagerly the offsets are read once
    (equal lengths: a reshape). The fallback forms: buckets of sequences zero-padded at their
    ends, a capture refused first. None (the interim path) when no token."""
    in_slots = _slots_path()
    if not in_slots:
        refuse_capture(NOT_CAPTURABLE_VARLEN, q)

    def run(q, k, v, g, beta, do, h0, dht, n, out=None):
        return _backward_kernel(q, k, v, g, beta, h0, do, dht, scale, k_last, l2norm, n, out)

    def run_slots(qp, kp, v, g, beta, do, h0, dht, slots, out=None):
        # with the tables (`native`): the gradients at the callers' rows, the epilogue on q, k
        token_qk = (q, k) if native(slots) else None
        return _backward_kernel(qp, kp, v, g, beta, h0, do, dht, scale, k_last, l2norm, 1, out,
                                slots, token_qk)  # fmt: skip

    return backward_varlen(run, (q, k, v, g, beta, do), (initial_state, d_final), cu_seqlens,
                           out, run_slots if in_slots else None,
                           in_slots and stores_natively())  # fmt: skip


def _slots_path() -> bool:
    """Varlen runs in the slot layout: the device pass with kernel 1's 16-bit outputs (the
    default), the path whose state launches have the varlen form."""
    return _on_device() and STATES16


def _empty_grads(q, k, v, g, beta, cu_seqlens, k_last) -> Grads:
    n = cu_seqlens.shape[0] - 1
    shape = fwd._state_shape(n, v.shape[1], q.shape[2], v.shape[2], k_last)
    like = (q, k, v, g, beta)
    return (*(x.new_empty(x.shape) for x in like), q.new_empty(shape, dtype=torch.float32))


@torch.library.custom_op("forgekernel::gated_delta_rule_chunked_bwd", mutates_args=())
def _chunked_bwd_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    do: torch.Tensor,
    d_final: torch.Tensor | None,
    scale: float,
    k_last: bool,
    l2norm: bool,
    batch: int = 0,
) -> Grads:
    return _backward_eager(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                           k_last, l2norm, batch)  # fmt: skip


@_chunked_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last, l2norm,
      batch=0):  # fmt: skip
    return _empty_grads(q, k, v, g, beta, cu_seqlens, k_last)


def _backward_eager(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last,
                    l2norm, batch, out=None) -> Grads:  # fmt: skip
    """Where the kernel path fits (`_kernel_path`): `batch` > 0 (the offsets are `batch` equal
    lengths, known on the host): the kernel path, no sync; else the offsets read on the host
    and the kernel path on the sequences padded to equal length (`_backward_varlen`). The
    interim path otherwise. `out`: the flat gradient buffers (`GradsOut`)."""
    if _kernel_path(q, v):
        args = (q, k, v, g, beta, initial_state, do, d_final, scale, k_last, l2norm)
        grads = (_backward_kernel(*args, batch, out) if batch > 0
                 else _backward_varlen(*args, cu_seqlens, out))  # fmt: skip
        if grads is not None:
            return grads
    return _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                             k_last, l2norm, out)  # fmt: skip


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last,
              l2norm, batch=0, out=None) -> Grads:  # fmt: skip
    """Eager: the path directly; traced: the custom op (its results copied into `out`)."""
    args = (q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, k_last, l2norm,
            batch)  # fmt: skip
    if _traced(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *(out or ())):
        grads = torch.ops.forgekernel.gated_delta_rule_chunked_bwd(*args)
        return grads if out is None else written(out, grads, (q, k, v, g, beta))
    return _backward_eager(*args, out)


# ---- autograd of the forward op --------------------------------------------------------------


def _setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm, batch = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.flags = (scale, k_last, l2norm)
    ctx.has_state = initial_state is not None
    n = cu_seqlens.shape[0] - 1  # one sequence, or offsets the wrapper made for B equal lengths
    ctx.batch = 1 if n == 1 else batch


def _grad(ctx, do, d_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    grads = _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *ctx.flags,
                      ctx.batch)  # fmt: skip
    dh0 = grads[5] if ctx.has_state else None
    return (*grads[:5], dh0, None, None, None, None, None)


torch.library.register_autograd(
    "forgekernel::gated_delta_rule_chunked", _grad, setup_context=_setup
)


# ---- explicit backward ---------------------------------------------------------------------


def gated_delta_rule_backward(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    d_final_state: torch.Tensor | None = None,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    k_last: bool = False,
    out: tuple[torch.Tensor | None, ...] | None = None,
) -> Grads:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of `gated_delta_rule(q, k, v, g, beta, ...)`
    given do (B, T, HV, V) in q's dtype and d_final_state (the final state's gradient, in the
    initial state's layout) or None. Arguments as `gated_delta_rule`'s; the gradients come
    back shaped and typed as their inputs, d_initial_state fp32 (N, HV, ...) (the zero
    state's when initial_state is None). out: six contiguous buffers shaped and typed as those
    gradients (d_initial_state's may be None: allocated), written and returned; on the kernel
    path the last kernel writing each gradient writes it there (the q / k epilogue dq, dk;
    kernel 2 dv, dg and an fp32 dbeta; kernel 1 d_initial_state unless k_last), a copy only
    for a 16-bit dbeta, k_last's d_initial_state, varlen (gathered from the slot layout or
    the buckets) and the interim path."""
    check_bools(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, k_last=k_last)
    b, t, _, hv, dk, dv = fwd._check_heads(q, k, v)
    check_shaped("g", g, (b, t, hv), fwd.F32)
    check_shaped("beta", beta, (b, t, hv), (torch.float32, q.dtype))
    check_shaped("do", do, (b, t, hv, dv), (q.dtype,))
    n = b if cu_seqlens is None else fwd._check_offsets(cu_seqlens, b, t)
    state_shape = fwd._state_shape(n, hv, dk, dv, k_last)
    if initial_state is not None:
        check_shaped("initial_state", initial_state, state_shape, fwd.F32)
    if d_final_state is not None:
        check_shaped("d_final_state", d_final_state, state_shape, fwd.F32)
    if out is not None:
        reads = {"do": do, "initial_state": initial_state, "d_final_state": d_final_state}
        check_grads_out(out, (q, k, v, g, beta), state_shape, reads)
    check_cuda("q", q)
    others = {"initial_state": initial_state, "d_final_state": d_final_state,
              "cu_seqlens": cu_seqlens}  # fmt: skip
    check_same_device(q=q, k=k, v=v, g=g, beta=beta, do=do,
                      **{name: x for name, x in others.items() if x is not None})  # fmt: skip
    batch = b if cu_seqlens is None else int(n == 1)  # equal lengths known on the host
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    scale = check_scale("scale", scale, dk**-0.5)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    grads = _backward(*flat[:5], initial_state, cu_seqlens.to(torch.int32), flat[5],
                      d_final_state, scale, k_last, use_qk_l2norm_in_kernel, batch,
                      flat_out(out))  # fmt: skip
    if out is not None:
        return (*out[:5], grads[5])
    shaped = (x.reshape(b, t, *x.shape[1:]) for x in grads[:5])
    return (*shaped, grads[5])


def check_grads_out(out: object, likes: tuple[torch.Tensor, ...], state_shape,
                    reads: dict[str, torch.Tensor | None] | None = None) -> None:  # fmt: skip
    """`out` of a linear-attention backward (this op's, KDA's): a tuple of six tensors, each
    contiguous, on q's device, shaped and typed as its input's gradient (`likes`: q, k, v, g,
    beta), the last (d_initial_state) fp32 `state_shape` or None; none overlapping another nor
    an input (`likes` and `reads`, the other inputs by name): the kernels write dv, dg, dbeta,
    d_initial_state (both ops) and dq, dk (where they fold) into `out` while they still read
    the inputs (v on the WY pass, the initial state beside dS's launch)."""
    if not isinstance(out, (tuple, list)) or len(out) != 6:
        raise TypeError("out must be a tuple (dq, dk, dv, dg, dbeta, d_initial_state) of six "
                        "tensors (d_initial_state may be None)")  # fmt: skip
    for i, (name, o) in enumerate(zip(GRAD_NAMES, out)):
        if i == 5 and o is None:
            continue
        shape, dtypes = (state_shape, (torch.float32,)) if i == 5 else (
            likes[i].shape, (likes[i].dtype,))  # fmt: skip
        label = f"out[{i}] ({name})"
        check_shaped(label, o, shape, dtypes)
        if not o.is_contiguous():
            raise ValueError(f"{label} must be contiguous")
        if o.device != likes[0].device:
            raise ValueError(f"{label} is on {o.device} but q is on {likes[0].device}")
    named = (*zip(INPUT_NAMES, likes), *(reads or {}).items())
    spans = [(name, _span(x)) for name, x in named if x is not None]
    for i, o in enumerate(out):
        if o is None:
            continue
        a0, a1 = span = _span(o)
        for other, (b0, b1) in spans:
            if a0 < b1 and b0 < a1:
                raise ValueError(f"out[{i}] ({GRAD_NAMES[i]}) overlaps {other}")
        spans.append((f"out[{i}]", span))


def _span(x: torch.Tensor) -> tuple[int, int]:
    """The bytes x's elements lie in: [its first, past its last) (empty: (0, 0))."""
    n, p = x.numel(), x.data_ptr()
    if n == 0:
        return 0, 0
    if x.is_contiguous():
        return p, p + n * x.element_size()
    last = sum((d - 1) * s for d, s in zip(x.shape, x.stride()))
    return p, p + (last + 1) * x.element_size()


def flat_out(out: GradsOut) -> GradsOut:
    """(B, T, ...) gradient buffers as the flat (B T, ...) views the paths write."""
    if out is None:
        return None
    return (*(o.view(-1, *o.shape[2:]) for o in out[:5]), out[5])


__all__ = ["gated_delta_rule_backward"]
