"""The CPU model of the Gated DeltaNet backward's kernel 1 (kernels/linear_attention/
gdn_bwd_state/sm90): its inputs, the chunk factors of reference/delta_rule_bwd.py in the
kernel's token-major layouts, and its outputs, pass 2 of that reference (the reverse state
recurrence). Fixed length only (B sequences of T tokens) and H = HV, as the kernel's first
version."""

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
    """reference/delta_rule_bwd.py's pass 2 on the kernel's inputs (in their dtype): (dU (B, T,
    HV, V), dh = dS^T at every chunk's end (B, NC, HV, V, K) or, given U (B, T, HV, V), dke =
    U dh^T per token (B, T, HV, K) as pass 3 forms it, the initial state's gradient (B, HV, K,
    V)), the kernel's outputs."""
    b, t, hv, dv = do.shape
    dk = factors["ke"].shape[-1]
    dtype = factors["ke"].dtype
    layout = _layout(b, t, do.device)

    def chunks(x):
        return layout.gather(x.reshape(b * t, hv, -1).to(dtype))

    f = SimpleNamespace(
        p=chunks(factors["pt"]).transpose(-1, -2), ke=chunks(factors["ke"]),
        qe=chunks(factors["qe"]), w=chunks(factors["w"]),
        e_last=factors["e_last"].transpose(0, 1).reshape(-1, hv, 1).to(dtype),
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
