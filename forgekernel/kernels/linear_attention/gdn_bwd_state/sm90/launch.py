"""Host launcher of the Gated DeltaNet backward's reverse state recurrence (kernel 1): torch only
(no DSL). Its inputs are the chunk factors of `forgekernel.reference.gdn_bwd_state`
(`state_pass_factors`) until the kernel forms them itself."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import SPEC
from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90.config import CHUNK, params_for
from forgekernel.runtime.cache import cached_params, get_kernel
from forgekernel.runtime.device import as_tma_ready, dtype_name, on_device

_params = cached_params(params_for)  # the compile key, built once per arguments

Outputs = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
MAX_SEQUENCES = 65535  # the varlen grid is (HV, N): N is gridDim.y


def check_inputs(do, pt, ke, qe, w, e_last, d_final_state, u=None, states: int | None = None,
                 kd: int | None = None) -> tuple[int, int, int, int]:  # fmt: skip
    """(B, T, HV, NC) of a valid call, else ValueError / TypeError saying what is off; `states`:
    the state tensors' leading size where it is not B (varlen: N sequences, B = 1); `kd`: K
    where ke is None (the `w_from_t` form: W formed, not read)."""
    if do.dim() != 4:
        raise ValueError(f"do must be (B, T, HV, V), got {tuple(do.shape)}")
    b, t, hv, v = do.shape
    nc = -(-t // CHUNK)
    if do.dtype not in (torch.float16, torch.bfloat16):
        raise TypeError(f"do must be float16 or bfloat16, got {do.dtype}")
    k = ke.shape[-1] if kd is None else kd
    want = {"pt": (b, t, hv, CHUNK), "ke": (b, t, hv, k), "qe": (b, t, hv, k), "w": (b, t, hv, k),
            "u": (b, t, hv, v)}  # fmt: skip
    for name, x in zip(want, (pt, ke, qe, w, do if u is None else u)):
        if x is None and name in ("pt", "ke", "qe", "w"):  # forward: I and 0 built in; w:
            continue  # `check_k_and_g`; ke: w_from_t (W formed)
        if tuple(x.shape) != want[name]:
            raise ValueError(f"{name} must be {want[name]}, got {tuple(x.shape)}")
        if x.dtype != do.dtype:
            raise TypeError(f"{name} must be {do.dtype} (do's dtype), got {x.dtype}")
    _params(dtype_name(do.dtype), (k, v))  # K, V supported
    if tuple(e_last.shape) not in ((b, nc, hv), (b, nc, hv, k)) or e_last.dtype != torch.float32:
        raise ValueError(f"e_last must be float32 {(b, nc, hv)} (one decay a chunk) or "
                         f"{(b, nc, hv, k)} (one a key channel), got {e_last.dtype} "
                         f"{tuple(e_last.shape)}")  # fmt: skip
    n = b if states is None else states
    if d_final_state is not None and (
        tuple(d_final_state.shape) != (n, hv, k, v) or d_final_state.dtype != torch.float32
    ):
        raise ValueError(f"d_final_state must be float32 {(n, hv, k, v)}, got "
                         f"{d_final_state.dtype} {tuple(d_final_state.shape)}")  # fmt: skip
    return b, t, hv, nc


def check_k_and_g(k: torch.Tensor, big_g: torch.Tensor, do: torch.Tensor) -> None:
    """The `fused` form's W-slot k (B, T', H, K) (T' <= T, the rows past it zero; H
    dividing HV) and G (B, NC C, HV) fp32 (kernel 0's, every chunk's rows: the `w_from_t`
    form's do, v, has T), else ValueError / TypeError."""
    b, t, hv, _ = do.shape
    if (
        k.dim() != 4
        or k.shape[0] != b
        or k.shape[1] > t
        or not 0 < k.shape[2] <= hv
        or hv % k.shape[2]
    ):
        raise ValueError(f"k must be (B, T' <= {t}, H, K) with H dividing {hv}, got "
                         f"{tuple(k.shape)}")  # fmt: skip
    if k.dtype != do.dtype:
        raise TypeError(f"k must be {do.dtype} (do's dtype), got {k.dtype}")
    rows = -(-t // CHUNK) * CHUNK  # every chunk's rows: the fused form's do has them already
    if tuple(big_g.shape) != (b, rows, hv) or big_g.dtype != torch.float32:
        raise ValueError(f"big_g must be float32 {(b, rows, hv)}, got {big_g.dtype} "
                         f"{tuple(big_g.shape)}")  # fmt: skip


def empty_outputs(do: torch.Tensor, k: int, dke: bool = False, out16: bool = False,
                  states: int | None = None, fused: bool = False) -> Outputs:  # fmt: skip
    """(dU (B, T, HV, V), dh (B, NC, HV, V, K) or with `dke` dke (B, T, HV, K), dh0 (B, HV, K,
    V)), fp32, uninitialized; `out16`: dU and dh (B, NC, HV, K, V) in do's dtype; `states`:
    dh0's leading size where it is not B (varlen: N); `fused`: dU None (not written)."""
    b, t, hv, v = do.shape
    n = b if states is None else states
    nc = -(-t // CHUNK)
    f32 = {"dtype": torch.float32, "device": do.device}
    if out16:
        low = {"dtype": do.dtype, "device": do.device}
        du = None if fused else torch.empty(b, t, hv, v, **low)
        return du, torch.empty(b, nc, hv, k, v, **low), torch.empty(n, hv, k, v, **f32)
    side = torch.empty(b, t, hv, k, **f32) if dke else torch.empty(b, nc, hv, v, k, **f32)
    return torch.empty(b, t, hv, v, **f32), side, torch.empty(n, hv, k, v, **f32)


def check_varlen(do: torch.Tensor, cu_seqlens: torch.Tensor, order: torch.Tensor) -> int:
    """N of a valid varlen call (the tiles (1, S C, HV, D) over S = T // C + N chunk slots, T =
    cu_seqlens[-1] not read: the slot count is checked against N alone), else ValueError."""
    if do.shape[0] != 1 or do.shape[1] % CHUNK:
        raise ValueError(f"varlen tiles must be (1, S x {CHUNK}, HV, V), got {tuple(do.shape)}")
    n = cu_seqlens.shape[0] - 1
    for name, x, size in (("cu_seqlens", cu_seqlens, n + 1), ("order", order, n)):
        if x.dim() != 1 or x.shape[0] != size or x.dtype != torch.int32 or x.stride(0) != 1:
            raise ValueError(f"{name} must be a contiguous int32 ({size},), got {x.dtype} "
                             f"{tuple(x.shape)}")  # fmt: skip
        if x.device != do.device:
            raise ValueError(f"{name} is on {x.device} but do is on {do.device}")
    if n < 1 or do.shape[1] // CHUNK < n:
        raise ValueError(f"{do.shape[1] // CHUNK} chunk slots cannot hold {n} sequences")
    if n > MAX_SEQUENCES:
        raise ValueError(f"at most {MAX_SEQUENCES} sequences (the grid's y), got {n}")
    return n


def gdn_bwd_state(
    do: torch.Tensor,
    pt: torch.Tensor,
    ke: torch.Tensor,
    qe: torch.Tensor,
    w: torch.Tensor,
    e_last: torch.Tensor,
    d_final_state: torch.Tensor | None = None,
    u: torch.Tensor | None = None,
    *,
    out: Outputs | None = None,
    out16: bool = False,
    forward: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    order: torch.Tensor | None = None,
    big_g: torch.Tensor | None = None,
    beta: torch.Tensor | None = None,
) -> Outputs:
    """The reverse recurrence dU = P^T dO + Ke dS, dS <- e^(G_C) dS + Qe^T dO - W^T dU over the
    chunks of each (sequence, value head), last first, dS from d_final_state (or zero).
    do (B, T, HV, V), pt (B, T, HV, 64), ke, qe, w (B, T, HV, K) in one 16-bit dtype; e_last
    fp32 (B, NC, HV) (Gated DeltaNet) or (B, NC, HV, K) (Kimi Delta Attention: dS <-
    diag(e^(G_C)) dS + ..., the `channel_decay` kernel); d_final_state (B, HV, K, V) fp32 or
    None; u (B, T, HV, V) 16-bit (the forward's corrected values U = u - W S0) or None.
    Returns (dU (B, T, HV, V), the state side:
    without u dh = dS^T at every chunk's end (B, NC, HV, V, K), with u dke = U dS^T per token
    (B, T, HV, K) (dS the gradient at the token's chunk end; dh then never reaches HBM), the
    initial state's gradient (B, HV, K, V)), fp32, written into `out` (contiguous) when
    given. `out16` (without u): dU and the state side in do's dtype, the state side as dS
    itself (B, NC, HV, K, V) (kernel 2's forms); `forward` (with out16; the op's forward
    launch, `reference.gdn_bwd_state.forward_launch_as_reverse`): the FORWARD recurrence U = u - W
    S, S <- e^(G_C) S + Ke^T U over the chunks first to last, S from d_final_state (the initial
    state), on the factors as written (chunk order, unnegated): do = u, ke = W, w = Ke, e_last
    e^(G_C); pt and qe None (P^T = I and Qe = 0 built in); returns (U, h = S at every chunk's
    start (B, NC, HV, K, V), the final state) in do's dtype but the last.
    `cu_seqlens` (int32 (N + 1,)) and `order` (int32 (N,), the sequences longest first,
    ops/_linattn_varlen.py `longest_first`): the `varlen` form, N sequences in the forward's
    chunk slots: the tiles (1, S C, HV, ...), e_last (1, S, HV[, K]), the per-chunk outputs
    at the same S slots, d_final_state and dh0 (N, HV, K, V) (reverse_state.py's docstring;
    out16 only, the op's device passes). `big_g` (with forward; the op's fused route, the
    `fused` key): U not written, None in its place (`out`'s first entry ignored); w is k
    itself, (B, T' <= T, H, K) at its own heads (value head hv reads hv // (HV / H)), and big_g
    (B, NC C, HV) fp32 kernel 0's G of every row (`check_k_and_g`): the kernel forms Ke's decays
    on U^T. `beta` (with big_g; the `w_from_t` key, the op's FUSED_WFROMT): W and u not read
    but formed from kernel 0's T^T: do is v itself (B, T, HV, V), pt T^T (B, T, HV, C) (kernel
    0's, cut to T rows), ke None, beta (B, T, HV) (fp32 or 16-bit; read as fp32); U^T = u^T -
    S^T W^T with u^T in fp32 and W rounded to 16 bits (reverse_state.py's docstring). Nothing
    is read on the host."""
    varlen = cu_seqlens is not None
    if varlen != (order is not None):
        raise ValueError("cu_seqlens and order come together (the varlen form)")
    if varlen and not out16:
        raise ValueError("the varlen form is out16's (the device passes)")
    states = check_varlen(do, cu_seqlens, order) if varlen else None
    fused = big_g is not None
    w_from_t = beta is not None
    if fused:
        if not forward or varlen:
            raise ValueError("big_g (the fused form) is the batch forward launch's")
        check_k_and_g(w, big_g, do)
    if w_from_t:
        if not fused or pt is None or ke is not None:
            raise ValueError("beta (the w_from_t form) needs big_g and pt = T^T, ke None")
        if tuple(beta.shape) != tuple(do.shape[:3]):
            raise ValueError(f"beta must be {tuple(do.shape[:3])}, got {tuple(beta.shape)}")
    b, t, hv, nc = check_inputs(do, pt, ke, qe, None if fused else w, e_last, d_final_state,
                                u, states, w.shape[-1] if w_from_t else None)  # fmt: skip
    dke = u is not None
    if (out16 and dke) or (forward and not out16):
        raise ValueError("out16 excludes u (dke); forward needs out16")
    if (pt is None and not w_from_t or qe is None) != forward:
        raise ValueError("pt and qe are None exactly when forward (I and 0 built in)")
    kd = w.shape[-1] if w_from_t else ke.shape[-1]
    if out is None:
        out = empty_outputs(do, kd, dke, out16, states, fused)
    du, side, dh0 = (None, *out[1:]) if fused else out
    want = (do.dtype, do.dtype, torch.float32) if out16 else (torch.float32,) * 3
    for x, dt in zip((du, side, dh0), want):
        if x is not None and (not x.is_contiguous() or x.dtype != dt):
            raise ValueError(f"out must be contiguous tensors of dtypes {want}")
    if b * hv == 0:
        return du, side, dh0
    if t == 0:
        dh0.copy_(d_final_state) if d_final_state is not None else dh0.zero_()
        return du, side, dh0
    channel_decay = e_last.dim() == 4
    params = _params(dtype_name(do.dtype), (kd, do.shape[-1]),
                     d_final_state=d_final_state is not None, dke=dke,
                     channel_decay=channel_decay, out16=out16,
                     forward=forward, varlen=varlen, fused=fused, w_from_t=w_from_t)  # fmt: skip
    fn = get_kernel(SPEC, params)
    tiles = [None if x is None else as_tma_ready(x) for x in (do, pt, ke, qe, w)]
    tiles.append(as_tma_ready(u) if dke else None)
    dht = None if d_final_state is None else d_final_state.contiguous()
    dh, dke_out = (None, side) if dke else (side, None)
    with on_device(do.device):
        el = as_tma_ready(e_last) if channel_decay else e_last.contiguous()
        g = big_g.contiguous() if fused else None
        bt = beta.float().contiguous() if w_from_t else None
        fn(*tiles, el, dht, du, dh, dke_out, dh0, cu_seqlens, order, g, bt)
    return du, side, dh0
