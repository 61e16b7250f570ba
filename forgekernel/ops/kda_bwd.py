"""The backward of `forgekernel.ops.kda_chunked.kimi_delta_attention` (issue 20) and its
autograd, built as Gated DeltaNet's (ops/gated_delta_rule_bwd.py).

`forgekernel::kda_chunked` (ops/kda_chunked.py, the forward: the first-pass kernel + the WGMMA
recurrence kernel) gets a backward formula here (`torch.library.register_autograd`): it saves
the forward's inputs (q, k, v, g, beta in their flat (T, heads, ...) form, the initial state,
the offsets) and nothing the kernel produced, and calls `forgekernel::kda_chunked_bwd`, which
returns the gradients in q, k, v, g (per key channel), beta and the initial state (grouped
value heads: dq, dk summed over the value heads sharing a q / k head; l2norm's backward
included), each in its input's dtype (the initial state's fp32).

INTERIM PATH (`FORGEKERNEL_KDA_BWD_KERNEL=0`, inside `interim()`, CPU tensors, and the calls
the kernel path declines): the backward op runs
`reference.kda_bwd.kimi_delta_attention_chunked_backward` in fp32 with torch ops
(`_backward_interim`: recompute of the chunk states, the reverse state recurrence as one
batched GEMM step per chunk, every chunk's gradients batched, the per-channel decays factored
around sub-chunk reference points; it reads the offsets on the host, one sync a call: a
CUDA-graph capture is refused before any work, `ops._dispatch.refuse_capture`). Correct, not
fast (docs/linear_attention/NOTES.md "Kimi Delta Attention backward"; the bench's `interim`
variant, `interim()`).

KERNEL PATH (the default since 2026-12-06, `_kernel_path`: FORGEKERNEL_KDA_BWD_KERNEL unset or
"1", outside `interim()`, CUDA tensors, 16-bit, (K, V) = (128, 128), at least one token and
value head; its GPU check tests/gpu/test_kda_bwd_kernel_path_gpu.py passed on the H100
2026-12-06, 100 tests, `forgekernel check kda_bwd` and its sanitizers 2026-12-05; NOTES.md "KDA
backward on kernel 1", "The backward kernel path the default"): `_backward_kernel` runs both
sequential recurrences on Gated DeltaNet's kernel 1 (kernels/linear_attention/
gdn_bwd_state/sm90, its `channel_decay` variant: e^(G_C) per key channel) as GDN's path does
(ops/gated_delta_rule_bwd.py): the forward's chunk states h and U = u - W h (the kernel fed
`reference.gdn_bwd_state.forward_state_tiles`), then the reverse recurrence (dU, dh, the initial
state's gradient); everything else is batched torch over every chunk at once: the sub-chunked
factors (reference/kda_bwd.py's `_Factors`: no e^(-G), g down to about -5 a step), the 16-bit
tiles, pass 3's output side on kernel 2 (kernels/linear_attention/kda_bwd_chunk/sm90,
`reference.kda_bwd_chunk` its model: `_output_grads` with KDA's per-channel dG finished on chip;
CHUNK_IN_KERNEL = False: reference/kda_bwd.py's `_output_grads` in torch, the fallback), the WY
half (`_wy_grads`) on the WY kernel (WY_IN_KERNEL, the default since 2026-12-06; False: in
torch; kernels/linear_attention/kda_bwd_wy/sm90, `reference.kda_bwd_wy` its model; with
FACTORS_FROM_FIRST_PASS, also the default, bf16: `_device_pass`, the factors from the forward's
first pass and kernel 1 writing kernel 2's 16-bit forms, `out16` / `forward`, as Gated
DeltaNet's device pass; NOTES.md "KDA's device pass"); q / k
normalized and scaled once at H heads (fp32: the torch factors read it; 16-bit on the device
pass); dq / dk's group sum, l2norm's
backward, scale and cast on Gated DeltaNet's q / k epilogue kernel
(kernels/linear_attention/gdn_bwd_norm/sm90, `_qk_grads`; NORM_IN_KERNEL = False: torch), dk
on the WY kernel (dk16, `_writes_dk`) where the epilogue would only cast it (device pass, no
l2norm, HV = H). Equal
lengths known on the host (the explicit backward without cu_seqlens, one sequence, autograd of a
call without cu_seqlens: the forward op's `batch` argument says B equal lengths; autograd's
setup saves it, eager and under torch.compile alike) run with no host read (CUDA-graph
capturable); several sequences behind a caller's cu_seqlens (`_backward_varlen`,
ops/_linattn_varlen.py): eagerly the offsets read on the host once (equal lengths a reshape),
unequal lengths (and any under a capture: no host read) on the device pass ONE launch of each
kernel over the forward's chunk slots, kernel 1 in its `varlen` form; the fallback forms (fp16
tiles, the switches off): buckets of similar lengths zero-padded at their ends, a capture
refused.

`kimi_delta_attention_backward` is the same backward for callers with their own autograd and
for the suite's backward timing.
"""

from __future__ import annotations

import contextlib

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.config import HEAD_DIMS

# the launchers as modules, imported once (an import a call cost ~1 us each; the tests patch
# their functions on these modules)
from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch as wy_launch
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.config import BULK_ALIGN
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch as first_pass_launch
from forgekernel.ops import kda_chunked as fwd
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

# Gated DeltaNet's q / k side, one mechanism for both ops (imported, unchanged): `_normalized`
# (q / k normalized and scaled once at H heads), `_qk_grads` (the epilogue kernel
# kernels/linear_attention/gdn_bwd_norm/sm90: group sum, l2norm's backward, scale, cast; the
# CPU tests put its model on this module's name) and `_normalized_backward` (its torch form);
# its kernel-1 decisions (`side_by_side_states`, `state_flags`: the same kernel, the same CTAs,
# the same varlen slot layout), its kernel-1 wrapper `_state_recurrence` (KDA's e_last (B, NC,
# HV, K) per key channel takes the launcher's `channel_decay` kernel; dh0= the caller's buffer
# for dS at the start; the CPU tests put the tile emulation on this module's name) and its
# out= helpers (`check_grads_out`, `flat_out`, `given`, `_joined`, `written`)
from forgekernel.ops.gated_delta_rule_bwd import (
    GradsOut,
    _joined,
    _normalized,
    _normalized_backward,
    _qk_grads,
    _state_recurrence,
    check_grads_out,
    flat_out,
    given,
    native,
    pass_tokens,
    side_by_side_states,
    state_flags,
    written,
)
from forgekernel.reference.gdn_bwd_state import (
    CHUNK,
    chunk_decay,
    chunk_factors,
    cut,
    forward_state_tiles,
    forward_states,
    to_chunks,
    to_tokens,
)
from forgekernel.reference.kda_bwd import (
    TOKEN_HEADS_PER_PASS,
    _Factors,
    _FirstPassFactors,
    _output_grads,
    _wy_grads,
    kimi_delta_attention_chunked_backward,
)
from forgekernel.reference.kda_bwd_chunk import chunk_grad_tiles
from forgekernel.reference.kda_bwd_wy import wy_tiles
from forgekernel.runtime.device import side_by_side

Grads = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]
NOT_CAPTURABLE = (
    "kimi_delta_attention's interim backward reads the offsets on the host (its chunk layout, "
    "one sync a call) and builds its tables there"
)


def _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                      l2norm, out=None) -> Grads:  # fmt: skip
    """INTERIM: the chunked backward in fp32 torch (the kernel's stand-in). Flat tensors:
    q, k (T, H, K), v, do (T, HV, V), g (T, HV, K), beta (T, HV); states (N, HV, K, V)."""
    refuse_capture(NOT_CAPTURABLE, q)
    grads = kimi_delta_attention_chunked_backward(
        *(x.unsqueeze(0) for x in (q, k, v, g, beta, do)), scale=scale,
        initial_state=initial_state, d_final_state=d_final, cu_seqlens=cu_seqlens,
        use_qk_l2norm=l2norm, dtype=torch.float32,
    )  # fmt: skip
    return written(out, (*(x[0] for x in grads[:5]), grads[5]), (q, k, v, g, beta))


# "0": the interim path everywhere; unset or "1": the kernel path where it fits (`_kernel_path`).
KERNEL_SWITCH = "FORGEKERNEL_KDA_BWD_KERNEL"
KERNEL_DEVICES = ("cuda",)  # CPU tensors take the interim path (the CPU tests add "cpu")
TILE_DTYPES = (torch.float16, torch.bfloat16)
_SWITCH = KernelSwitch(KERNEL_SWITCH)


def kernel_selected() -> bool:
    """Whether the kernel path is chosen where it fits: False inside `interim()`, else
    KERNEL_SWITCH ("0" or "1", default "1")."""
    return _SWITCH.selected()


def interim() -> contextlib.AbstractContextManager[None]:
    """The backward calls inside take the interim path, as with KERNEL_SWITCH "0" (the bench's
    `interim` variant)."""
    return _SWITCH.off()


# Pass 3's output side (`_output_grads`) on kernel 2 (kernels/linear_attention/kda_bwd_chunk/sm90)
# on the kernel path; False: batched torch (the fallback if kernel 2 misbehaves on the GPU). The
# WY half (`_wy_grads`) is torch unless WY_IN_KERNEL.
CHUNK_IN_KERNEL = True
# The group sum, l2norm's backward, the scale and the cast of dq / dk on Gated DeltaNet's
# epilogue kernel (`_qk_grads`, kernels/linear_attention/gdn_bwd_norm/sm90); False: torch
# (`_normalized_backward`, the fallback).
NORM_IN_KERNEL = True


def _chunk_grads(do, u, du, q, k, h, dh, big_g, dw16=False, dg=None, dq16=False, scale=1.0,
                 dq=None, tables=None, tokens=None):  # fmt: skip
    """Kernel 2 (`_output_grads` on WGMMA, every chunk at once): (dq, dk, dw, dG (B, T, HV, K),
    dG reverse-cumsummed within the chunk) fp32 from `chunk_grad_tiles`' inputs, dw in do's
    16-bit dtype with dw16 (the WY kernel's operand); dg: the contiguous fp32 buffer dG is
    written into (the op's `out=` dg, the WY kernel adding its half onto it after), else the
    launcher's own. dq16: q unscaled, dq times `scale` in do's 16-bit dtype (the op's dq; into
    `dq`, contiguous, when given). tables, tokens: the varlen slot layout's dq, dk, dG at their
    `tokens` token rows (the launcher's; dw at the slots). The CPU tests put the tile emulation
    here."""
    flags = {"dw16": dw16, **({"dq16": True, "scale": scale} if dq16 else {})}
    if tables is not None:
        flags.update(tables=tables, tokens=tokens)
    if dg is None and dq is None:
        return chunk_launch.kda_bwd_chunk(do, u, du, q, k, h, dh, big_g, **flags)
    own = chunk_launch.empty_outputs(do, q.shape[-1], dw16, dq16, tokens)
    outs = (own[0] if dq is None else dq, own[1], own[2], own[3] if dg is None else dg)
    return chunk_launch.kda_bwd_chunk(do, u, du, q, k, h, dh, big_g, **flags, out=outs)


# On since 2026-12-06 (H100: with FACTORS_FROM_FIRST_PASS, the device pass 4.6-5.8x the previous
# default; docs/linear_attention/NOTES.md "KDA backward WY kernel"): the WY half (`_wy_grads`)
# on the WY kernel (kernels/linear_attention/kda_bwd_wy/sm90) after kernel 2, fed its dw; with
# CHUNK_IN_KERNEL only. T = L^-1 is formed in torch for its input tile, or read from the first
# pass with FACTORS_FROM_FIRST_PASS.
WY_IN_KERNEL = True


def _wy_kernel(dw, du, tt, w, k, u, v, beta, big_g, dk, dg, dv16=False, dk16=False,
               dk_out=None, dv=None, dbeta=None, tables=None, tokens=None):  # fmt: skip
    """The WY kernel (`_wy_grads` on WGMMA, every chunk at once) from `wy_tiles`' inputs: its
    dk and dG (B, T, HV, K, dG reverse-cumsummed within the chunk) ADDED in place onto dk, dg
    (kernel 2's, contiguous fp32); returns (dk, dv (B, T, HV, V), dg, dbeta (B, T, HV)) fp32,
    dv in the tiles' 16-bit dtype with dv16; dk16: the final dk in the tiles' 16-bit dtype
    (into `dk_out` when given; dk then scratch); dv, dbeta: contiguous buffers to write them
    into (the op's `out=`), else new. tables, tokens: the varlen slot layout's outputs at their
    `tokens` token rows (the launcher's; dk, dg kernel 2's there). The CPU tests put the tile
    emulation here."""
    b, t, hv, _ = dw.shape
    t = t if tokens is None else tokens
    if dv is None:
        dv = torch.empty(b, t, hv, du.shape[-1], dtype=dw.dtype if dv16 else torch.float32,
                         device=dw.device)  # fmt: skip
    if dbeta is None:
        dbeta = torch.empty(b, t, hv, dtype=torch.float32, device=dw.device)
    final = {"dk16": True, **given(dk_out=dk_out)} if dk16 else {}
    if tables is not None:
        final.update(tables=tables, tokens=tokens)
    return wy_launch.kda_bwd_wy(dw, du, tt, w, k, u, v, beta, big_g, dv16=dv16,
                                out=(dk, dv, dg, dbeta), **final)  # fmt: skip


# On since 2026-12-06 (H100, with WY_IN_KERNEL; docs/linear_attention/NOTES.md "KDA backward
# factors from the forward's first pass?"): P, Qe, Ke, e^(G_C), W and u of the backward's
# factors from the forward's first-pass kernel (`_first_pass`, one launch over every head)
# instead of torch (`reference.kda_bwd._FirstPassFactors`), for tiles in FIRST_PASS_DTYPES (its
# operands are bf16); with CHUNK_IN_KERNEL only (the torch fallback's `_output_grads` reads q and
# e^(G_C - G), which `_FirstPassFactors` does not form).
FACTORS_FROM_FIRST_PASS = True
FIRST_PASS_DTYPES = (torch.bfloat16,)


def _first_pass(q, k, g, beta, cu_seqlens, scale, seq_len, bwd=False, v=None):
    """The KDA forward's first pass (kernels/linear_attention/kda_prefill/sm90 launch.py
    `first_pass_kernel`): q, k (B T, H, K) 16-bit unit rows where l2norm is on, g (B T, HV, K),
    beta (B T, HV) fp32, B sequences of `seq_len` tokens -> its dict (rows (B NC 64, HV, ...)
    bf16, decay (B NC, HV, K) fp32; bwd: its `bwd` key, T^T `tt`, G `big_g`, W `w` and u `u`
    too, from v (B T, HV, V) in q's dtype). The CPU tests put its torch model
    (`operands.kda_chunk_operands`, same arguments) here."""
    return first_pass_launch.first_pass_kernel(q, k, g, beta, cu_seqlens, scale, False, seq_len,
                                               bwd=bwd, v=v)  # fmt: skip


def _first_pass_ops(q16, k16, v16, g, beta, scale, b, t):
    """`_first_pass` over every head of B equal sequences -> its token tiles as (B, NC C, HV,
    D) and decay (B, NC, HV, K) (views); with the WY kernel (WY_IN_KERNEL) its `bwd` key's T^T
    too, the WY kernel's input tile (no torch solve), P^T (`pt`, kernel 1's reverse-launch
    operand as it reads it) in P's place, and W = T_beta Kg, u = T_beta V (`w`, `u`: kernel 1's
    and the WY kernel's operands; v16 (B, T, HV, V) in q16's dtype; before next/kda-wu two
    cuBLAS GEMMs and a memset a value head, 353 us at 4 x 8192 H16 on the H100)."""
    cu = first_pass_launch.equal_offsets(q16.device, b, t)  # cached: no launch a call
    v = v16.flatten(0, 1) if WY_IN_KERNEL else None
    ops = _first_pass(q16.flatten(0, 1), k16.flatten(0, 1), g.flatten(0, 1).contiguous(),
                      beta.flatten(0, 1).contiguous(), cu, scale, t,
                      bwd=WY_IN_KERNEL, v=v)  # fmt: skip
    nc = -(-t // CHUNK)
    bwd_rows = ("pt", "tt", "big_g", "w", "u") if WY_IN_KERNEL else ("p",)
    rows = ("q_g", "k_g", "k_d", "t_beta") + bwd_rows
    out = {n: ops[n].unflatten(0, (b, nc * CHUNK)) for n in rows}
    out["decay"] = ops["decay"].unflatten(0, (b, nc))
    return out


def _on_device(dtype: torch.dtype) -> bool:
    """Both switches on (the default; the first pass's factors for `dtype` tiles, kernel 2 and
    the WY kernel): the device pass (`_device_pass`), kernel 1 writing kernel 2's 16-bit forms."""
    return (FACTORS_FROM_FIRST_PASS and dtype in FIRST_PASS_DTYPES and CHUNK_IN_KERNEL
            and WY_IN_KERNEL)  # fmt: skip


def _kernel_path(q, v) -> bool:
    """The kernel path is selected (`kernel_selected`) and the call fits kernel 1: a CUDA
    tensor, 16-bit, (K, V) = (128, 128), at least one token and value head."""
    return (kernel_selected() and q.device.type in KERNEL_DEVICES and q.shape[0] > 0
            and v.shape[1] > 0 and q.dtype in TILE_DTYPES
            and (q.shape[2], v.shape[2]) in HEAD_DIMS)  # fmt: skip


def _reverse_tiles(f, dtype):
    """Kernel 1's reverse-launch tiles pt, ke, qe, w (token-major, `dtype`): the first pass's
    ke, qe as it wrote them (`_FirstPassFactors`), the rest cast and laid out here."""
    if isinstance(f, _FirstPassFactors):
        pt = to_tokens(f.p.transpose(-1, -2).to(dtype))
        ke, qe = (f.tokens[n].to(dtype).contiguous() for n in ("ke", "qe"))
        return pt, ke, qe, to_tokens(f.w.to(dtype))
    return tuple(to_tokens(x.to(dtype)) for x in (f.p.transpose(-1, -2), f.ke, f.qe, f.w))


def _chunk_pass(qs, ks, v, g, beta, do, h0, dht, ops=None, dg_out=None, dg_dtype=torch.float32,
                dv_dtype=torch.float32, q_scale=None, into=None, slots=None,
                dk16=False):  # fmt: skip
    """Value heads of one pass, everything per value head: qs (scaled), ks (B, T, HV, K), v, do
    (B, T, HV, V), g (B, T, HV, K), beta (B, T, HV) fp32 except do (16-bit: the tiles' dtype);
    h0, dht (B, HV, K, V) fp32 or None; ops: this pass's heads of `_first_pass_ops` or None
    (the factors in torch) -> (dqs, dks (B, T, HV, K), dv, dg (B, T, HV, K), dbeta, dh0) fp32.
    On the device pass (`_on_device`) qs, ks and v come in do's 16-bit dtype and dG goes into
    dg_out where given and dv in `dv_dtype` where that is do's (`_device_pass`; the other
    paths ignore both; q_scale, into, slots, dk16: `_device_pass`'s, the device pass only)."""
    t, dtype = qs.shape[1], do.dtype
    if ops is not None and _on_device(dtype):
        return _device_pass(qs, ks, v, g, beta, do, h0, dht, ops, dg_out, dg_dtype, dv_dtype,
                            q_scale, into, slots, dk16)  # fmt: skip
    assert q_scale is None and into is None and not dk16, "final-form dq / dk: the device pass"
    if slots is not None:
        raise ValueError("the slot layout (varlen) is the device pass's")
    if ops is None:  # (B, NC, HV, C, ...) fp32, sub-chunked
        f = chunk_factors(qs, ks, v, g, beta, _Factors)
    else:
        nc = -(-t // CHUNK)
        f = _FirstPassFactors(ops, *(to_chunks(x, nc) for x in (ks, v, g, beta)))
    nc = f.w.shape[1]
    fw = forward_state_tiles(f, dtype)  # e^(G_C) (B, NC, HV, K): S <- diag(e^(G_C)) S + ...
    du_fw, dh_fw, _ = _state_recurrence(*(fw[n] for n in ("do", "pt", "ke", "qe", "w")),
                                        fw["e_last"], h0)  # fmt: skip
    h, big_u = forward_states(du_fw, dh_fw)
    del fw, du_fw, dh_fw  # the peak: free launch 1's tiles and outputs before launch 2's
    do_c = to_chunks(do, nc)
    tiles = _reverse_tiles(f, dtype)
    du_t, dh_t, dh0 = _state_recurrence(to_tokens(do_c), *tiles, chunk_decay(f), dht)
    d_u = du_t.unflatten(1, (nc, CHUNK)).transpose(2, 3)
    dh = dh_t.transpose(-1, -2)  # dS (K, V) at every chunk's end
    del du_t
    if CHUNK_IN_KERNEL:  # kernel 2: `_output_grads`, dG reverse-cumsummed within the chunk
        tiles = chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)
        del h, dh, big_u, do_c
        dq, dk, dw, dg = _chunk_grads(*tiles)
        big_g = tiles[7]
        del tiles
        if WY_IN_KERNEL:  # the WY half on its kernel, added onto kernel 2's dk, dG there
            _, dv, _, dbeta = _wy_kernel(*wy_tiles(f, dw, d_u, big_g, dtype), dk, dg)
            return dq, dk, dv, dg, dbeta, dh0
        del big_g
        dk_wy, dv, dbeta, dg_wy = _wy_grads(f, to_chunks(dw, nc), d_u)
        dg_wy = dg_wy.flip(-2).cumsum(-2).flip(-2)  # the cumsum is linear: added after
        wy = (to_tokens(x)[:, :t] for x in (dk_wy, dv, dg_wy, dbeta))
        dk_wy, dv, dg_wy, dbeta = wy
        return dq, dk + dk_wy, dv, dg + dg_wy, dbeta, dh0
    dq, dk, dw, d_g = _output_grads(f, do_c.float(), h, dh, big_u, d_u)
    del h, dh, big_u, do_c
    dk_wy, dv, dbeta, dg_wy = _wy_grads(f, dw, d_u)
    dg = (d_g + dg_wy).flip(-2).cumsum(-2).flip(-2)  # G = cumsum(g) within the chunk
    grads = (to_tokens(x)[:, :t] for x in (dq, dk + dk_wy, dv, dg, dbeta))
    return (*grads, dh0)


def _device_pass(qs, ks, v, g, beta, do, h0, dht, ops, dg_out=None, dg_dtype=torch.float32,
                 dv_dtype=torch.float32, q_scale=None, into=None, slots=None,
                 dk16=False):  # fmt: skip
    """`_chunk_pass` with kernel 1 writing kernel 2's 16-bit forms (`out16`), as Gated DeltaNet's
    `_device_pass`: W = (T diag(beta)) Kg and u = (T diag(beta)) V as the first pass's bwd key
    wrote them (no factor formed here), kernel 1's forward launch (`forward`: I, 0 and the signs
    built in, chunks first to last) on u, W and Ke as they are -> U, h (16-bit, chunk order);
    its reverse launch on P^T and the first pass's Ke, Qe as written -> dU, dS
    (16-bit); kernel 2 and the WY kernel on those, the first pass's T^T, G and rows cut to T
    (views). qs, ks, v, do (B, T, HV, ...) in do's dtype (strided head slices allowed), g (B, T,
    HV, K), beta (B, T, HV) fp32; ops: `_first_pass_ops`' pass of heads, with `tt` and `big_g`.
    Kernel 1's two launches side by side where both fit one wave (`concurrent_state_launches`:
    neither reads what the other writes); dg_out: the buffer for dG (B, T, HV, K) (the sum of
    kernel 2's and the WY kernel's written there) or None; without it dG comes in `dg_dtype`.
    dv comes in do's 16-bit dtype straight from the WY kernel where `dv_dtype` is that (the
    op's v 16-bit: no cast after), else fp32. q_scale (`_folds`: no l2norm, HV = H): qs is
    the op's q UNscaled (the first pass got the scale), kernel 2 writes the op's dq (dq16,
    times q_scale) in do's dtype: no dq epilogue; dk16 (`_writes_dk`): the WY kernel writes
    the op's dk in do's dtype: no dk epilogue. into: (dq, dk, dv, dbeta, dh0) contiguous
    buffers those kernels write ((B, T, HV, ...), dh0 (B, HV, K, V); the op's `out=`
    (`_direct`), each None or of the dtype its kernel writes; dq only with q_scale, dk only
    with dk16). slots: the varlen slot layout
    (B = 1 over its S C rows, h0 / dht / dh0 (N, HV, K, V)): kernel 1's varlen form, side by
    side (Gated DeltaNet's `side_by_side_states`); with its per-slot tables (`native`) kernel
    2 and the WY kernel write dq, dk, dv, dg, dbeta at their T token rows (`token_rows`;
    dg_out, `into` those rows' buffers), dw at the slots."""
    t, dtype = qs.shape[1], do.dtype
    upto = slice(None, t)  # the first pass's rows (NC C) cut to T (`cut`: no view at T = NC C)
    varlen = state_flags(slots)
    dq_o, dk_o, dv_o, db_o, dh0_o = (None,) * 5 if into is None else into
    w16, u16 = ops["w"], ops["u"]  # (B, NC C, HV, K / V), zero rows past T

    def forward_launch():  # chunks first to last on u, W, Kd as they are, the signs in registers
        return _state_recurrence(u16, None, w16, None, ops["k_d"], ops["decay"], h0,
                                 out16=True, forward=True, **varlen)  # fmt: skip

    def reverse_launch():  # P^T as the first pass's bwd key wrote it (no transposing copy)
        rev = tuple(cut(x, 1, upto) for x in (ops["pt"], ops["k_d"], ops["q_g"], w16))
        return _state_recurrence(do, *rev, ops["decay"], dht, out16=True, **given(dh0=dh0_o),
                                 **varlen)  # fmt: skip

    device = do.device
    if side_by_side_states(slots, do.shape[0], do.shape[2], device):
        (u_c, h16, _), (du16, dh16, dh0) = side_by_side(device, forward_launch, reverse_launch)
    else:
        u_c, h16, _ = forward_launch()
        du16, dh16, dh0 = reverse_launch()
    # G = cumsum(g) within the chunk, as the first pass formed it; kernel 2's and the WY
    # kernel's launchers read it contiguous (`.contiguous()`): cut to T it is not where B > 1
    # and T is no multiple of 64 (or in a head pass), so made so once here for both
    big_g = cut(ops["big_g"], 1, upto).contiguous()
    # kernel 2 writes dG straight into `dg_out` where that is a contiguous fp32 buffer whose
    # start suits the WY kernel's bulk reduce-adds onto it (`BULK_ALIGN`)
    into_dg = _direct(dg_out, torch.float32)
    # dw in the tiles' dtype from kernel 2 (the WY kernel's operand; no cast here)
    fold = {} if q_scale is None else {"dq16": True, "scale": q_scale, **given(dq=dq_o)}
    rows = {}  # the slot layout's outputs at their token rows (`native`)
    if native(slots):
        rows = {"tables": (slots.starts, slots.lengths), "tokens": slots.rows.shape[0]}
    final = {"dk16": True, **given(dk_out=dk_o)} if dk16 else {}
    dq, dk, dw, dg = _chunk_grads(do, cut(u_c, 1, upto), du16, qs, ks, h16, dh16, big_g,
                                  dw16=True, dg=into_dg, **fold, **rows)  # fmt: skip
    del u_c, h16, dh16
    wy = (dw, du16, *(cut(x, 1, upto) for x in (ops["tt"], w16)), ks, cut(u16, 1, upto), v,
          beta, big_g)  # fmt: skip
    # the WY kernel adds its dk and dG onto kernel 2's (in place, no torch add)
    dk_wy, dv, dg, dbeta = _wy_kernel(*wy, dk, dg, dv16=dv_dtype == dtype, **final,
                                      **given(dv=dv_o, dbeta=db_o), **rows)  # fmt: skip
    if dk16:  # the op's dk (16-bit), not kernel 2's fp32 scratch
        dk = dk_wy
    # left in torch: dG's copy into a strided `dg_out`, or its cast to a 16-bit `dg_dtype` (the
    # fp32 sum rounded once, as before)
    if dg_out is not None and into_dg is None:
        dg = dg_out.copy_(dg)
    elif dg_out is None and dg_dtype != dg.dtype:
        dg = dg.to(dg_dtype)
    return dq, dk, dv, dg, dbeta, dh0


# On the device pass without l2norm and with HV = H (`_folds`, the bench's case): kernel 2 reads
# the op's q unscaled (the first pass takes the scale) and writes dq x scale in 16 bits (dq16),
# dq into `out=`: no q x scale copy, no dq epilogue launch. TEMPORARY switch for the GPU A/B
# (False: the fp32 dq and its epilogue, as before 2026-12-06's next/kda-final-outputs). Off
# since next/kda-bwd-regress: on the H100 (4 x 8192, H = HV = 16) it cost kernel 2 +0.65 ms
# (3.18 -> 3.83; its SASS differs from dq16's absence only by the scale's 72 FMUL and the
# 16-bit stores: cause open) and the WY kernel +0.4 ms (dk16's loads serialized behind its
# stores, fixed there) for 0.52 ms of glue: 9.76 vs 9.23 ms. Re-time kernel 2 (now on two math
# warpgroups) with dq16: on again if its cost is gone, else remove the dq16 path. The WY kernel's
# half of it (dk16, `_writes_dk`) no longer rides on this switch (next/kda-glue3).
FINAL_QK = False


def _writes_dk(l2norm: bool, group: int, k: torch.Tensor, dtype) -> bool:
    """The WY kernel writes the op's dk (dk16: kernel 2's fp32 dk plus its half, rounded once
    to 16 bits, the epilogue's result bit for bit where that only casts): the device pass
    (`_on_device`), no l2norm, no value-head group (HV = H), k in the tiles' dtype. On since
    next/kda-glue3 (no switch: dk16's SASS is the plain key's but the 16-bit stores, its one
    H100 cost fixed at next/kda-bwd-regress): the dk epilogue launch (~139 us at 4 x 8192
    H16, half of the 277.7 us the two took) gone, 2 bytes a value less written."""
    return _on_device(dtype) and not l2norm and group == 1 and k.dtype == dtype


def _folds(l2norm: bool, group: int, q: torch.Tensor, k: torch.Tensor, dtype) -> bool:
    """Kernel 2 writes the op's dq (FINAL_QK; the WY kernel then the op's dk, `_writes_dk`):
    the device pass, no l2norm, no value-head group (HV = H), q and k in the tiles' dtype. The
    epilogue would only scale dq and cast there."""
    return FINAL_QK and _writes_dk(l2norm, group, k, dtype) and q.dtype == dtype


def _direct(buf: torch.Tensor | None, dtype: torch.dtype | None) -> torch.Tensor | None:
    """`buf` (an `out=` buffer) where a kernel may write it directly: of `dtype` (the kernel's;
    None: no kernel writes it), contiguous and starting `BULK_ALIGN`-byte aligned (the WY
    kernel's bulk reduce-adds onto dG, the 16-byte stores of the others); else None (the kernel
    writes its own buffer, copied after)."""
    ok = (buf is not None and dtype is not None and buf.dtype == dtype and buf.is_contiguous()
          and buf.data_ptr() % BULK_ALIGN == 0)  # fmt: skip
    return buf if ok else None


def _normalized32(x, scale, l2norm):
    """q / k (B, T, H, K) normalized and scaled once at H heads by Gated DeltaNet's
    `_normalized`, in fp32: the torch factors (`_Factors`) read fp32 q / k (repeated to the
    value heads a pass); without l2norm x is widened first (x scale rounded in fp32, not in
    x's 16-bit dtype)."""
    return _normalized(x if l2norm else x.float(), scale, l2norm, torch.float32)


def _backward_kernel(q, k, v, g, beta, initial_state, do, d_final, scale, l2norm,
                     batch, out: GradsOut = None, slots=None, token_qk=None) -> Grads:  # fmt: skip
    """The backward on kernel 1 (module docstring): flat tensors as `_backward_interim`'s
    holding `batch` sequences of equal length. Grouped heads: q / k normalized and scaled once
    at H heads in fp32 (`_normalized32`), repeated to the value heads a pass (not for HV = H)
    before the factors; dq / dk summed over each group, through l2norm's backward and the
    scale, in the input dtype on the epilogue kernel (`_qk_grads`, from the op's q / k; as
    Gated DeltaNet's `_backward_device`; NORM_IN_KERNEL False: torch); value heads in passes of
    reference/kda_bwd.py's TOKEN_HEADS_PER_PASS token-heads (two kernel-1 launches a pass), one
    pass: no concatenation. `out` (flat buffers, `GradsOut`): dq, dk written by the epilogue,
    on the device pass in one pass dg (fp32), dv, dbeta (the WY kernel) and d_initial_state
    (kernel 1) by the kernels where the buffer's dtype is theirs (`_direct`), else (several
    passes: their concatenation; another dtype: the cast) copied in. slots (with batch 1): the
    tokens in the varlen slot layout (ops/_linattn_varlen.py), the states (N, ...): the device
    pass only (`_slots_path`); with its tables (`native`) the token gradients come back at the
    callers' T token rows (`out` those rows' buffers), the epilogue reading `token_qk`, the
    callers' q, k (T, H, K) (Gated DeltaNet's `_backward_device`)."""
    b, h, hv = batch, q.shape[1], v.shape[1]
    t, group = q.shape[0] // b, hv // h
    rows = slots.rows.shape[0] if native(slots) else t  # the gradients' tokens a sequence

    def seq(x):
        return x.reshape(b, t, *x.shape[1:])

    def seq_out(x):
        return x.reshape(b, rows, *x.shape[1:])

    fold = _folds(l2norm, group, q, k, do.dtype)
    dk16 = _writes_dk(l2norm, group, k, do.dtype)
    if _on_device(do.dtype):  # q / k, v in 16 bits: the first pass and the kernels read them
        # fold: q as it is (no copy), the scale taken by the first pass and kernel 2
        qn = _normalized(seq(q), 1.0 if fold else scale, l2norm, do.dtype)
        kn = _normalized(seq(k), 1.0, l2norm, do.dtype)
        v_side = [seq(v).to(do.dtype), seq(g).float(), seq(beta).float(), seq(do)]
    else:
        qn = _normalized32(seq(q), scale, l2norm)
        kn = _normalized32(seq(k), 1.0, l2norm)
        v_side = [seq(v).float(), seq(g).float(), seq(beta).float(), seq(do)]
    ops = None
    if FACTORS_FROM_FIRST_PASS and CHUNK_IN_KERNEL and do.dtype in FIRST_PASS_DTYPES:  # 16-bit rows
        q16, k16 = (x.to(do.dtype) for x in (qn, kn))  # q scaled already unless fold
        ops = _first_pass_ops(q16, k16, v_side[0], v_side[1], v_side[2], scale if fold else 1.0,
                              b, t)  # fmt: skip
    step = max(1, TOKEN_HEADS_PER_PASS // max(1, pass_tokens(b, t, slots) * group))
    heads = range(0, h, step)
    outs = (None,) * 5 if out is None else tuple(None if o is None else seq_out(o)
                                                  for o in out[:5])  # fmt: skip
    dg_out = outs[3] if len(heads) == 1 and outs[3] is not None and g.dtype == torch.float32 \
        else None  # fmt: skip
    # one pass on the device pass: dv, dbeta (the WY kernel), dh0 (kernel 1), with fold dq
    # (kernel 2) and with dk16 dk (the WY kernel) written by the kernels into `out=` where its
    # dtype is theirs (dq, dk: do's 16-bit; dv: do's where v's is, else fp32; dbeta, dh0 fp32):
    # no copy after (`written` finds them in place; before 2026-12-06's next/kda-glue3 dv,
    # dbeta, dh0 were 3 DtoD copies, 96 us at 4 x 8192 H16 on the H100)
    into = None
    if out is not None and len(heads) == 1 and _on_device(do.dtype):
        f32 = torch.float32
        kinds = (do.dtype if fold else None, do.dtype if dk16 else None,
                 do.dtype if v.dtype == do.dtype else f32, f32, f32)  # fmt: skip
        bufs = (outs[0], outs[1], outs[2], outs[4], out[5])
        into = tuple(_direct(o, dt) for o, dt in zip(bufs, kinds))
    parts = []
    for first in heads:  # passes over heads, not chunks
        qh, vh = slice(first, first + step), slice(first * group, (first + step) * group)
        # `cut`: one pass (every head) takes the tensors themselves, no view each
        qs, ks = (cut(x, 2, qh) if group == 1 else x[:, :, qh].repeat_interleave(group, dim=2)
                  for x in (qn, kn))  # fmt: skip
        states = (None if x is None else cut(x, 1, vh).float().contiguous()
                  for x in (initial_state, d_final))  # fmt: skip
        mine = None if ops is None else {n: cut(x, 2, vh) for n, x in ops.items()}
        parts.append(_chunk_pass(qs, ks, *(cut(x, 2, vh) for x in v_side), *states, ops=mine,
                                 dg_out=dg_out, dg_dtype=g.dtype, dv_dtype=v.dtype,
                                 q_scale=scale if fold else None, into=into,
                                 slots=slots, dk16=dk16))  # fmt: skip
    del qn, kn
    # the kernels wrote the op's dq (fold: 16-bit, scaled) and dk (dk16): no epilogue for them
    dqs, dks = (_joined(parts, i, outs[i] if final else None)
                for i, final in ((0, fold), (1, dk16)))  # fmt: skip
    dv, dg, dbeta = (_joined(parts, i, outs[i]) for i in (2, 3, 4))
    dh0 = _joined(parts, 5, None if out is None else out[5])
    del parts
    epilogue = _qk_grads if NORM_IN_KERNEL else _normalized_backward
    xq, xk = (seq(q), seq(k)) if token_qk is None else (seq_out(x) for x in token_qk)
    dq = dqs if fold else epilogue(dqs, xq, scale, l2norm, **given(out=outs[0]))
    dk = dks if dk16 else epilogue(dks, xk, 1.0, l2norm, **given(out=outs[1]))
    grads = (*(x.flatten(0, 1) for x in (dq, dk, dv, dg, dbeta)), dh0)
    return written(out, grads, (q, k, v, g, beta))


def _empty_grads(q, k, v, g, beta, cu_seqlens) -> Grads:
    n = cu_seqlens.shape[0] - 1
    state = q.new_empty(n, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    return (*(x.new_empty(x.shape) for x in (q, k, v, g, beta)), state)


@torch.library.custom_op("forgekernel::kda_chunked_bwd", mutates_args=())
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
    l2norm: bool,
    batch: int = 0,
) -> Grads:
    return _backward_eager(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                           l2norm, batch)  # fmt: skip


@_chunked_bwd_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm, batch=0):
    return _empty_grads(q, k, v, g, beta, cu_seqlens)


NOT_CAPTURABLE_VARLEN = (
    "kimi_delta_attention's backward on its fallback forms (fp16 tiles, the torch factors) reads "
    "varlen offsets on the host (the padding to equal lengths in buckets; the default device "
    "pass has none under capture)"
)


def _backward_varlen(q, k, v, g, beta, initial_state, do, d_final, scale, l2norm,
                     cu_seqlens, out=None) -> Grads | None:  # fmt: skip
    """Varlen on the kernel path, as Gated DeltaNet's (ops/_linattn_varlen.py
    `backward_varlen`): on the device pass (`_slots_path`) unequal lengths run once in the slot
    layout, and so does every call under a CUDA-graph capture (no host read: equal lengths too,
    the suite's batch cases in its graph column); eagerly the offsets are read once (equal
    lengths, the suite's batch cases: B = 1 + cu_seqlens, a reshape). The fallback forms:
    buckets of sequences zero-padded at their ends, a capture refused first. None (the interim
    path) when no token."""
    in_slots = _slots_path(do.dtype)
    if not in_slots:
        refuse_capture(NOT_CAPTURABLE_VARLEN, q)

    def run(q, k, v, g, beta, do, h0, dht, n, out=None):
        return _backward_kernel(q, k, v, g, beta, h0, do, dht, scale, l2norm, n, out)

    def run_slots(qp, kp, v, g, beta, do, h0, dht, slots, out=None):
        # with the tables (`native`): the gradients at the callers' rows, the epilogue on q, k
        token_qk = (q, k) if native(slots) else None
        return _backward_kernel(qp, kp, v, g, beta, h0, do, dht, scale, l2norm, 1, out, slots,
                                token_qk)  # fmt: skip

    return backward_varlen(run, (q, k, v, g, beta, do), (initial_state, d_final), cu_seqlens,
                           out, run_slots if in_slots else None, in_slots)  # fmt: skip


def _slots_path(dtype: torch.dtype) -> bool:
    """Varlen runs in the slot layout: the device pass (`_on_device`, the bf16 default), the
    path whose state launches have the varlen form."""
    return _on_device(dtype)


def _backward_eager(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm,
                    batch, out=None) -> Grads:  # fmt: skip
    """Where the kernel path fits (`_kernel_path`): `batch` > 0 (the offsets are `batch` equal
    lengths, known on the host): the kernel path, no sync; else the offsets read on the host
    (`_backward_varlen`). The interim path otherwise. `out`: the flat gradient buffers."""
    if _kernel_path(q, v):
        args = (q, k, v, g, beta, initial_state, do, d_final, scale, l2norm)
        grads = (_backward_kernel(*args, batch, out) if batch > 0
                 else _backward_varlen(*args, cu_seqlens, out))  # fmt: skip
        if grads is not None:
            return grads
    return _backward_interim(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale,
                             l2norm, out)  # fmt: skip


def _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm,
              batch=0, out=None) -> Grads:  # fmt: skip
    """Eager: the path directly; traced: the custom op (its results copied into `out`)."""
    args = (q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, scale, l2norm, batch)
    if _traced(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *(out or ())):
        grads = torch.ops.forgekernel.kda_chunked_bwd(*args)
        return grads if out is None else written(out, grads, (q, k, v, g, beta))
    return _backward_eager(*args, out)


# ---- autograd of the forward op --------------------------------------------------------------


def _setup(ctx, inputs, output) -> None:
    q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, batch = inputs
    ctx.save_for_backward(q, k, v, g, beta, initial_state, cu_seqlens)
    ctx.flags = (scale, l2norm)
    ctx.has_state = initial_state is not None
    n = cu_seqlens.shape[0] - 1  # one sequence, or offsets the wrapper made for B equal lengths
    ctx.batch = 1 if n == 1 else batch


def _grad(ctx, do, d_final):
    q, k, v, g, beta, initial_state, cu_seqlens = ctx.saved_tensors
    do = torch.zeros_like(v) if do is None else do
    grads = _backward(q, k, v, g, beta, initial_state, cu_seqlens, do, d_final, *ctx.flags,
                      ctx.batch)  # fmt: skip
    dh0 = grads[5] if ctx.has_state else None
    return (*grads[:5], dh0, None, None, None, None)


torch.library.register_autograd("forgekernel::kda_chunked", _grad, setup_context=_setup)


# ---- explicit backward ---------------------------------------------------------------------


def kimi_delta_attention_backward(
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
    out: tuple[torch.Tensor | None, ...] | None = None,
) -> Grads:
    """(dq, dk, dv, dg, dbeta, d_initial_state) of `kimi_delta_attention(q, k, v, g, beta,
    ...)` given do (B, T, HV, V) in q's dtype and d_final_state (N, HV, K, V) fp32 or None.
    Arguments as `kimi_delta_attention`'s; the gradients come back shaped and typed as their
    inputs, d_initial_state fp32 (N, HV, K, V) (the zero state's when initial_state is None).
    out: six contiguous buffers shaped and typed as those gradients (d_initial_state's may be
    None), written and returned (`_backward_kernel` says which are written in place)."""
    check_bools(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel)
    fwd._validate(q, k, v, g, beta, initial_state, cu_seqlens, device_check=False)
    b, t, hv, dv = v.shape
    check_shaped("do", do, (b, t, hv, dv), (q.dtype,))
    n = b if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if d_final_state is not None:
        check_shaped("d_final_state", d_final_state, (n, hv, q.shape[3], dv), fwd.F32)
    if out is not None:
        reads = {"do": do, "initial_state": initial_state, "d_final_state": d_final_state}
        check_grads_out(out, (q, k, v, g, beta), (n, hv, q.shape[3], dv), reads)
    check_cuda("q", q)
    extra = {} if d_final_state is None else {"d_final_state": d_final_state}
    check_same_device(q=q, do=do, **extra)
    batch = b if cu_seqlens is None else int(n == 1)  # equal lengths known on the host
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t
    scale = check_scale("scale", scale, q.shape[3] ** -0.5)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta, do)]
    grads = _backward(*flat[:5], initial_state, cu_seqlens.to(torch.int32), flat[5],
                      d_final_state, scale, use_qk_l2norm_in_kernel, batch,
                      flat_out(out))  # fmt: skip
    if out is not None:
        return (*out[:5], grads[5])
    shaped = (x.reshape(b, t, *x.shape[1:]) for x in grads[:5])
    return (*shaped, grads[5])


__all__ = ["kimi_delta_attention_backward"]
