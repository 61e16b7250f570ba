"""The CPU model of the Gated DeltaNet backward's kernel 1 (kernels/linear_attention/
gdn_bwd_state/sm90): its inputs, the chunk factors of reference/delta_rule_bwd.py in the
kernel's token-major layouts, and its outputs, pass 2 of that reference (the reverse state
recurrence). Fixed length only (B sequences of T tokens) and H = HV, as the kernel's first
version. The batched forms at the end (`to_chunks`, `chunk_factors`,
`batched_state_pass_factors`, `forward_state_tiles`, `forward_states`: no chunk layout, no
loop) are what the op's kernel path (ops/gated_delta_rule_bwd.py `_backward_kernel`) runs;
given Kimi Delta Attention's factors (`reference.kda_bwd._Factors`, `factors=`) they give
KDA's tiles, e^(G_C) then per key channel (B, NC, HV, K) (the kernel's `channel_decay`
variant; ops/kda_bwd.py `_backward_kernel`)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from forgekernel.reference.delta_rule import _scale
from forgekernel.reference.delta_rule_bwd import ChunkLayout, _Factors, _reverse_states, _states

CHUNK = 64


def _layout(b: int, t: int, device: torch.device) -> ChunkLayout:
    """Equal lengths: the layout keeps sequence order, chunk j of sequence n at j B + n."""
    return ChunkLayout([i * t for i in range(b + 1)], CHUNK, device)


def _per_chunk(x: torch.Tensor, b: int) -> torch.Tensor:
    """(NC B, HV, ...) step-major -> (B, NC, HV, ...)."""
    return x.unflatten(0, (-1, b)).transpose(0, 1)


def state_pass_factors(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """q, k (B, T, H, K), v (B, T, HV, V), g, beta (B, T, HV), H = HV (q, k already
    l2-normalized where the model does so) -> the kernel's inputs in `dtype`: pt (B, T, HV, C)
    (row j of a chunk: column j of P), ke = K e^(G_C - G), qe = Q e^G (q scaled), w = T
    diag(beta e^G) K (B, T, HV, K), e_last = e^(G_C) (B, NC, HV); padded rows of the tail chunk
    are zero and dropped (the kernel's TMA zero-fills them)."""
    b, t, h, dk = q.shape
    if v.shape[2] != h:
        raise ValueError(f"H = HV only (no grouping yet), got H {h}, HV {v.shape[2]}")
    layout = _layout(b, t, q.device)
    flat = [x.reshape(b * t, *x.shape[2:]).to(dtype) for x in (q, k, v, g, beta)]
    flat[0] = flat[0] * _scale(scale, dk)
    f = _Factors(*(layout.gather(x) for x in flat))
    shaped = {name: layout.scatter(x, b * t).reshape(b, t, h, -1)
              for name, x in (("pt", f.p.transpose(-1, -2)), ("ke", f.ke), ("qe", f.qe),
                              ("w", f.w))}  # fmt: skip
    shaped["e_last"] = _per_chunk(f.e_last[..., 0], b).contiguous()
    return shaped


def corrected_values(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The forward's U = u - W S0 of every token (B, T, HV, V), by the reference's pass 1
    recurrence (`_states`); initial_state (B, HV, K, V) or None (zero). The kernel's dke
    variant reads it (a training forward would store it)."""
    b, t, h, dk = q.shape
    layout = _layout(b, t, q.device)
    flat = [x.reshape(b * t, *x.shape[2:]).to(dtype) for x in (q, k, v, g, beta)]
    flat[0] = flat[0] * _scale(scale, dk)
    f = _Factors(*(layout.gather(x) for x in flat))
    h0 = q.new_zeros(b, h, dk, v.shape[-1], dtype=dtype)
    h0 = h0 if initial_state is None else initial_state.to(dtype)
    _, big_u = _states(f, h0, layout.steps)
    return layout.scatter(big_u, b * t).reshape(b, t, h, -1)


def reverse_state_pass(
    factors: dict[str, torch.Tensor],
    do: torch.Tensor,
    d_final_state: torch.Tensor | None,
    u: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """reference/delta_rule_bwd.py's pass 2 on the kernel's inputs (in their dtype; e^(G_C)
    (B, NC, HV) or per key channel (B, NC, HV, K), reference/kda_bwd.py's): (dU (B, T,
    HV, V), dh = dS^T at every chunk's end (B, NC, HV, V, K) or, given U (B, T, HV, V), dke =
    U dh^T per token (B, T, HV, K) as pass 3 forms it, the initial state's gradient (B, HV, K,
    V)), the kernel's outputs."""
    b, t, hv, dv = do.shape
    dk = factors["ke"].shape[-1]
    dtype = factors["ke"].dtype
    layout = _layout(b, t, do.device)

    def chunks(x):
        return layout.gather(x.reshape(b * t, hv, -1).to(dtype))

    e_last = factors["e_last"]  # (B, NC, HV) or per key channel (B, NC, HV, K)
    e_last = e_last.unsqueeze(-1) if e_last.dim() == 3 else e_last
    f = SimpleNamespace(
        p=chunks(factors["pt"]).transpose(-1, -2), ke=chunks(factors["ke"]),
        qe=chunks(factors["qe"]), w=chunks(factors["w"]),
        e_last=e_last.transpose(0, 1).flatten(0, 1).to(dtype),
    )  # fmt: skip
    f.q = f.ke  # _reverse_states counts chunks by len(f.q)
    dht = do.new_zeros(b, hv, dk, dv, dtype=dtype) if d_final_state is None else d_final_state
    steps = layout.steps
    dh, d_u, dh0 = _reverse_states(f, chunks(do), dht.to(dtype), steps)
    du = layout.scatter(d_u, b * t).reshape(b, t, hv, dv)
    if u is not None:
        dke = chunks(u) @ dh.transpose(-1, -2)  # pass 3's d(k e^(G_C - G))
        return du, layout.scatter(dke, b * t).reshape(b, t, hv, dk), dh0
    return du, _per_chunk(dh, b).transpose(-1, -2), dh0


# ---- batched forms (no chunk layout, no loop): the op's kernel path (ops/gated_delta_rule_bwd)


def to_chunks(x: torch.Tensor, nc: int) -> torch.Tensor:
    """(B, T, HV, ...) -> (B, NC, HV, C, ...), zero rows past T (the reference's padding)."""
    b, t = x.shape[:2]
    padded = x.new_zeros(b, nc * CHUNK, *x.shape[2:])
    padded[:, :t] = x
    return padded.unflatten(1, (nc, CHUNK)).transpose(2, 3)


def cut(x: torch.Tensor, dim: int, part: slice) -> torch.Tensor:
    """x's `part` (start:stop, no step) of dim `dim` (x[:, :t], x[:, :, heads]); x itself where
    that is all of it: the same tensor to every reader (pointer, sizes, strides), without the
    view op (an eager call cut 27 whole views a call, ~1-2 us of host each on a GPU)."""
    start, stop = part.start or 0, x.shape[dim] if part.stop is None else part.stop
    if start == 0 and stop >= x.shape[dim]:
        return x
    return x.narrow(dim, start, min(stop, x.shape[dim]) - start)


def to_tokens(x: torch.Tensor) -> torch.Tensor:
    """(B, NC, HV, C, ...) -> (B, NC C, HV, ...), contiguous (the kernel's token-major tiles)."""
    return x.transpose(2, 3).flatten(1, 2).contiguous()


def chunk_factors(q, k, v, g, beta, factors=_Factors):
    """reference/delta_rule_bwd.py's `_Factors` (or `factors`: reference/kda_bwd.py's, g
    (B, T, HV, K)) of every chunk of B equal-length sequences at once: q (scaled, normalized),
    k (B, T, HV, K), v (B, T, HV, V), g, beta (B, T, HV) -> pieces shaped (B, NC, HV, C, ...)
    (the classes broadcast over leading dimensions)."""
    nc = -(-q.shape[1] // CHUNK)
    return factors(*(to_chunks(x, nc) for x in (q, k, v, g, beta)))


def chunk_decay(f) -> torch.Tensor:
    """e^(G_C) as kernel 1 reads it: (B, NC, HV) from Gated DeltaNet's factors (e_last (..., 1),
    e_g (..., C)), (B, NC, HV, K) from Kimi Delta Attention's (e_last (..., K), e_g (..., C,
    K)); a factors class that forms e_g lazily says `per_channel` itself."""
    per_channel = getattr(f, "per_channel", None)
    if per_channel is None:
        per_channel = f.e_g.dim() == f.k.dim()
    return (f.e_last if per_channel else f.e_last[..., 0]).contiguous()


def batched_state_pass_factors(q, k, v, g, beta, *, scale=None, dtype=torch.float32,
                               factors=_Factors):  # fmt: skip
    """`state_pass_factors` without the chunk layout's gathers: the same dict, same layouts
    (`factors`: as `chunk_factors`; KDA's e_last is (B, NC, HV, K))."""
    b, t, _, dk = q.shape
    q, k, v, g, beta = (x.to(dtype) for x in (q, k, v, g, beta))
    f = chunk_factors(q * _scale(scale, dk), k, v, g, beta, factors)
    shaped = {name: to_tokens(x)[:, :t]
              for name, x in (("pt", f.p.transpose(-1, -2)), ("ke", f.ke), ("qe", f.qe),
                              ("w", f.w))}  # fmt: skip
    shaped["e_last"] = chunk_decay(f)
    return shaped


def forward_state_tiles(f: _Factors, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Kernel 1's inputs that make its reverse recurrence run the FORWARD one (pass 1: the
    state h at every chunk's start and U = u - W h). The kernel computes, chunk by chunk from
    the last, X = P' Y + K' Z and Z <- e Z + Q'^T Y - W'^T X; with Y = u, P' = I, K' = -W,
    Q' = 0, W' = -Ke and the chunks in reverse order (chunk NC - 1 - j in slot j) that is
    U = u - W S, S <- e^(G_C) S + Ke^T U from the first chunk, Z starting at the initial
    state (its d_final_state input). Outputs: dU = U, dh[slot] = S^T at chunk NC - 1 - slot's
    start, dh0 = the final state. Token-major (B, NC C, HV, ...) in `dtype`, e_last fp32 (per
    key channel from KDA's factors: S <- diag(e^(G_C)) S + Ke^T U)."""
    b, nc, hv, c, dk = f.w.shape
    eye = torch.eye(c, dtype=dtype, device=f.w.device).expand(b, nc, hv, c, c)
    tiles = {"do": f.u, "pt": eye, "ke": -f.w, "qe": torch.zeros_like(f.w), "w": -f.ke}
    out = {n: to_tokens(x.flip(1).to(dtype)) for n, x in tiles.items()}
    out["e_last"] = chunk_decay(f).flip(1).float().contiguous()
    return out


def forward_launch_as_reverse(
    do: torch.Tensor, ke: torch.Tensor, w: torch.Tensor, e_last: torch.Tensor
) -> dict[str, torch.Tensor]:
    """Kernel 1's `forward` variant (chunks first to last, its tiles as the factors write them:
    do = u, ke = W, w = Ke token-major (B, T, HV, ...), e_last e^(G_C) (B, NC, HV[, K]) in chunk
    order, unnegated; the signs applied in registers) as the reverse recurrence's inputs: u, I,
    -W, 0, -Ke with the chunks reversed (zero rows past T), e_last reversed fp32, i.e.
    `forward_state_tiles`' dict. The kernel runs this recurrence bit for bit (a sign flip is
    exact), so its model is the reverse model on these, the outputs flipped back over the
    chunks (`out16_forms(..., forward=True)`, cut to T rows)."""
    b, t, hv, _ = do.shape
    nc = -(-t // CHUNK)

    def rev(x):
        return to_tokens(to_chunks(x, nc).flip(1))

    eye = torch.eye(CHUNK, dtype=do.dtype, device=do.device).view(1, 1, CHUNK, 1, CHUNK)
    eye = eye.expand(b, nc, CHUNK, hv, CHUNK).contiguous().view(b, nc * CHUNK, hv, CHUNK)
    neg_w = rev(ke).neg_()
    out = {"do": rev(do), "pt": eye, "ke": neg_w, "qe": torch.zeros_like(neg_w),
           "w": rev(w).neg_()}  # fmt: skip
    out["e_last"] = e_last.flip(1).float().contiguous()
    return out


def forward_states(du: torch.Tensor, dh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1's outputs on `forward_state_tiles` -> (h (B, NC, HV, K, V) the state at every
    chunk's start, U (B, NC, HV, C, V)), chunks back in order."""
    nc = dh.shape[1]
    u = du.unflatten(1, (nc, CHUNK)).transpose(2, 3).flip(1)
    return dh.flip(1).transpose(-1, -2), u


def decayed_keys(k: torch.Tensor, big_g: torch.Tensor) -> torch.Tensor:
    """Ke = k e^(G_C - G) of every row from k (B, T', H, K) at its own heads (value head hv
    reads hv // (HV / H); rows past T' zero) and G (B, NC C, HV) of every row (kernel 0's,
    G_C each chunk's last row's): (B, NC C, HV, K) in fp64, the decays kernel 1's `fused`
    forward launch forms on U^T's columns in place of reading Ke."""
    b, rows, hv = big_g.shape
    kk = k.new_zeros(b, rows, *k.shape[2:])
    kk[:, : k.shape[1]] = k
    kk = kk.double().repeat_interleave(hv // k.shape[2], dim=2)
    g = big_g.double().unflatten(1, (rows // CHUNK, CHUNK))  # (B, NC, C, HV)
    decay = (g[:, :, -1:] - g).exp().flatten(1, 2)  # (B, NC C, HV)
    return kk * decay.unsqueeze(-1)


def u_from_states(uw: torch.Tensor, w: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """U = u - W h per chunk, as the fused backward's `u_from_h` key forms it from the forward
    launch's h (its `fused` key): uw (B, T, HV, V), w (B, T, HV, K) and h (B, NC, HV, K, V)
    in one 16-bit dtype -> U (B, T, HV, V) in that dtype, the difference formed in fp64 and
    rounded once (the kernel's fp32 accumulator, up to its order of sums)."""
    t, nc = uw.shape[1], h.shape[1]
    wc, uc = to_chunks(w.double(), nc), to_chunks(uw.double(), nc)  # (B, NC, HV, C, .)
    big_u = uc - wc @ h.double()
    return to_tokens(big_u)[:, :t].to(uw.dtype)


def out16_forms(
    du: torch.Tensor, dh: torch.Tensor, dtype: torch.dtype, forward: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Kernel 1's `out16` outputs from its fp32 ones (dU (B, T, HV, V), dh = dS^T (B, NC, HV, V,
    K)): (dU, dS (B, NC, HV, K, V)) in `dtype`, kernel 2's forms (dS rounded once, as the
    kernel stores the 16-bit A operand it feeds the next product). `forward` (the forward
    launch, chunks arriving reversed): the outputs of the chunk the kernel processes c-th (slot
    NC - 1 - c) land at chunk c, i.e. both flipped over the chunks (dU's rows past T: the zero
    padding); on `forward_state_tiles` that is U and h (`forward_states`) in 16 bits."""
    t, nc = du.shape[1], dh.shape[1]
    ds, du = dh.transpose(-1, -2).to(dtype), du.to(dtype)
    if forward:
        ds, du = ds.flip(1), to_tokens(to_chunks(du, nc).flip(1))[:, :t]
    return du.contiguous(), ds.contiguous()


def over_slots(launch, cu_seqlens, order, do, pt, ke, qe, w, e_last, state, **flags):
    """Kernel 1's `varlen` form (ops/_linattn_varlen.py's slot layout) by its batch form
    `launch(do, pt, ke, qe, w, e_last, state, **flags)`, its model: sequence n's owned slots
    [bos_n // C + n, eos_n // C + n + 1) of the (1, S C, HV, ...) tiles (pt, qe None for the
    forward launch) and of e_last (1, S, HV[, K]) run as one sequence from state[n] (or zero),
    the outputs (dU (1, S C, HV, V), the per-chunk side (1, S, HV, ...), the state gradient (N,
    HV, K, V)) at the same slots. The slots partition [0, S) (asserted); `order` (the CTAs'
    order) changes nothing: only checked to be a permutation."""
    cu = [int(x) for x in cu_seqlens.tolist()]
    n = len(cu) - 1
    assert sorted(int(x) for x in order.tolist()) == list(range(n))
    spans = [(cu[i] // CHUNK + i, cu[i + 1] // CHUNK + i + 1) for i in range(n)]
    assert spans[0][0] == 0 and spans[-1][1] * CHUNK == do.shape[1]
    assert all(a[1] == b[0] for a, b in zip(spans[:-1], spans[1:]))
    parts = []
    for i, (lo, hi) in enumerate(spans):
        rows = slice(lo * CHUNK, hi * CHUNK)
        tiles = (None if x is None else x[:, rows] for x in (do, pt, ke, qe, w))
        st = None if state is None else state[i : i + 1]
        parts.append(launch(*tiles, e_last[:, lo:hi], st, **flags))
    du, side, s0 = (torch.cat(x, dim=0 if j == 2 else 1) for j, x in enumerate(zip(*parts)))
    return du, side, s0


# ---- segments (ops/gated_delta_rule_bwd.py `_segmented_states`): boundary states by linearity


def segment_transitions(local: torch.Tensor, shifted: torch.Tensor, parts: int,
                        scale: float) -> torch.Tensor:  # fmt: skip
    """M_p (N, P - 2, HV, K, K), the middle segments' transitions S_end = M_p S_start + L_p of the
    forward recurrence (K = V: M is a state), from kernel 1's forward runs over N P segments of
    whole chunks in flat order n P + p: `local` (N P, HV, K, V) holding at row n P + p (p < P -
    1) the segment's end state from its run's start (zero but at p = 0) and `shifted` at row
    n P + p (0 < p < P - 1) the end state from scale x I (scale M_p + L_p); fp32. The reverse
    recurrence's transition over the same segment is M_p^T (dS_start = M_p^T dS_end + L^d_p)."""
    shape = (-1, parts, *local.shape[1:])
    middle = slice(1, parts - 1)
    return (shifted.view(shape)[:, middle] - local.view(shape)[:, middle]) * (1.0 / scale)


def segment_starts(trans: torch.Tensor, local: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The forward's state at every segment's start (N P, HV, K, V): row n P the sequence's
    initial state (`first`'s row n P: the state its segment 0 ran from, the other rows are not
    read), row n P + 1 segment 0's end (`local`), then S_(p+1) = M_p S_p + L_p (`trans`:
    `segment_transitions`'); fp32, P - 2 batched products."""
    parts = trans.shape[1] + 2
    shape = (-1, parts, *local.shape[1:])
    lo, starts = local.view(shape), first.clone().view(shape)
    state = lo[:, 0]
    for p in range(1, parts):
        starts[:, p] = state
        if p + 1 < parts:
            state = trans[:, p - 1] @ state + lo[:, p]
    return starts.view(local.shape)


def segment_ends(trans: torch.Tensor, rlocal: torch.Tensor, last: torch.Tensor) -> torch.Tensor:
    """The reverse recurrence's state gradient at every segment's end (N P, HV, K, V): row
    n P + P - 1 the final state's gradient (`last`'s row; the other rows are not read), row
    n P + P - 2 the last segment's start gradient (`rlocal`: at row n P + p (p > 0) the start
    gradient of kernel 1's reverse run over the segment from `last`'s row, zero but at p =
    P - 1), then dS_end(p - 1) = M_p^T dS_end(p) + L^d_p; fp32, P - 2 batched products."""
    parts = trans.shape[1] + 2
    shape = (-1, parts, *rlocal.shape[1:])
    rl, ends = rlocal.view(shape), last.clone().view(shape)
    grad = rl[:, parts - 1]
    for p in range(parts - 2, -1, -1):
        ends[:, p] = grad
        if p > 0:
            grad = trans[:, p - 1].transpose(-1, -2) @ grad + rl[:, p]
    return ends.view(rlocal.shape)
