"""Kimi Delta Attention forward as the fused kernel's data flow (docs/linear_attention/NOTES.md,
"A fused KDA forward: design"): a torch model, fp64 by default, of who makes which operand
of a chunk, where it is held, and who reads and releases it. No kernel implements it yet.

Per (sequence, value head) a cluster of `ctas` CTAs (2: the value halves) walks the chunks in
order. CTA z holds value columns [z V / ctas, (z + 1) V / ctas) of the state S (K, V); the
aux role of CTA c % ctas builds chunk c's operands for all of them (rows8's sub-chunk
factorization, `aux_chunk`) and writes them into two rings of `stages` stages, stage c %
stages, in its own CTA and, as DSMEM twins, in the others:

    ring A   Kg, Qg                       read by X = Kg S_z and O = Qg S_z, released after them
    ring B   Kd, T diag(beta), P, e^G_C   read until the state update, released after it

`_Ring` raises where the kernel's mbarriers would have blocked or been wrong: a stage rewritten
before every CTA released its chunk, a chunk read from a stage holding another. The order of
events per period (the design's): every CTA's X and O of chunk c, the release of ring A, the
aux's ring-A writes of chunk c + stages; every CTA's U, O, decay and update, the release of
ring B, the aux's ring-B writes of chunk c + stages.

The segment scan (`segments` > 1; the design's section 4): each segment but the last runs
first on the augmented state [S | I] with values [v | 0] (2 ctas more: the identity halves),
no o, giving its final state from zero F_s and its transition A_s (S_end = A_s S_0 + F_s; the
first segment runs from the true initial state); the initial states are composed,
S_(s+1) = A_s S_s + F_s, and every segment reruns from its own with o. Segments are whole
chunks; only the last may be partial.

`operand_dtype` rounds what the kernel feeds the tensor cores as 16-bit operands, as
`reference.kda_chunked` does, with one difference: E_IJ multiplies the diagonal Kr_J tile on the
B fragments (Kr, E and the product each rounded), the design's smem saving over rows8's stored
Kr E tiles.
"""

from __future__ import annotations

import math

import torch

from forgekernel.reference.delta_rule import _check, _run, _split_chunks, _unit_lower_inverse
from forgekernel.reference.kda_chunked import SUB_CHUNK as SUB
from forgekernel.reference.kda_chunked import _round, _sub_chunk_factors


def kimi_delta_attention_fused(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm: bool = False,
    chunk_size: int = 64,
    segments: int = 1,
    stages: int = 2,
    operand_dtype: torch.dtype | None = None,
    dtype: torch.dtype = torch.float64,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(o (B, T, HV, V), final state (N, HV, K, V) or None), arguments as
    `delta_rule.kimi_delta_attention_recurrent`; `segments` cuts each sequence for the scan,
    `stages` is the rings' depth."""
    _check(q, k, v, g, beta, initial_state, cu_seqlens, per_channel=True)
    if chunk_size % SUB or segments < 1 or stages < 1:
        raise ValueError(
            f"chunk_size a multiple of {SUB}, segments and stages >= 1: got {chunk_size}, "
            f"{segments}, {stages}"
        )

    def run(q_, k_, v_, g_, beta_, s_):
        return _scanned(q_, k_, v_, g_, beta_, s_, chunk_size, segments, stages, operand_dtype)

    return _run(
        run, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm, dtype,
    )  # fmt: skip


# ----------------------------------------------------------------------------- the aux role


def aux_chunk(q, k, g, beta, operand_dtype=None) -> dict[str, torch.Tensor]:
    """One chunk's operands, q (scaled), k, g (..., C, K), beta (..., C), as the aux role makes
    them: G = cumsum(g), references r_I = G at token 16 I + 8, a = G - r; Kl, Ql, Kr; L_IJ =
    Kl_I (Kr_J E_IJ)^T and P_IJ = Ql_I (Kr_J E_IJ)^T on the 10 blocks I >= J; T = (I + L)^-1;
    Kg = Kl e^r, Qg = Ql e^r, Kd = Kr e^(G_C - r). Rows past a sequence (k = q = g = beta = 0)
    give exact zeros."""
    c, dt = q.shape[-2], operand_dtype
    big_g = g.cumsum(dim=-2)
    ea, eb, r_row, e_ij, _ = _sub_chunk_factors(big_g)  # as reference/kda_chunked.py's
    kl, kr, ql = k * ea, k * eb, q * ea
    scores = {"l": torch.zeros(*q.shape[:-1], c, dtype=q.dtype, device=q.device)}
    scores["p"] = torch.zeros_like(scores["l"])
    for i in range(c // SUB):
        rows = slice(i * SUB, (i + 1) * SUB)
        for j in range(i + 1):
            cols = slice(j * SUB, (j + 1) * SUB)
            e = _round(e_ij[..., i, j, :], dt).unsqueeze(-2)
            b = _round(_round(kr[..., cols, :], dt) * e, dt)  # the B fragments times E_IJ
            scores["l"][..., rows, cols] = _round(kl[..., rows, :], dt) @ b.transpose(-1, -2)
            scores["p"][..., rows, cols] = _round(ql[..., rows, :], dt) @ b.transpose(-1, -2)
    lower = torch.ones(c, c, dtype=torch.bool, device=q.device).tril()
    strict = lower.tril(-1)
    akk = beta.unsqueeze(-1) * scores["l"].masked_fill(~strict, 0.0)
    g_last = big_g[..., -1:, :]
    return {
        "kg": _round(kl * r_row.exp(), dt),
        "qg": _round(ql * r_row.exp(), dt),
        "kd": _round(kr * (g_last - r_row).exp(), dt),
        "tb": _round(_unit_lower_inverse(akk) * beta.unsqueeze(-2), dt),
        "p": _round(scores["p"].masked_fill(~lower, 0.0), dt),
        "d": g_last.squeeze(-2).exp(),
    }


# ----------------------------------------------------------------------------- the rings


class _Ring:
    """One ring of a cluster: per CTA and stage the chunk it holds (the writer's copy and its
    DSMEM twins are the same tensors here), per stage the CTAs yet to release it."""

    def __init__(self, name: str, stages: int, ctas: int):
        self.name, self.stages, self.ctas = name, stages, ctas
        self.held = [[None] * stages for _ in range(ctas)]
        self.data = [None] * stages
        self.pending = [set() for _ in range(stages)]

    def write(self, writer: int, chunk: int, tensors: dict) -> None:
        s = chunk % self.stages
        if self.pending[s]:
            raise RuntimeError(
                f"ring {self.name}: CTA {writer}'s aux would write chunk {chunk} over chunk "
                f"{self.held[writer][s]} in stage {s} before CTAs {sorted(self.pending[s])} "
                "released it"
            )
        for z in range(self.ctas):
            self.held[z][s] = chunk
        self.data[s] = tensors
        self.pending[s] = set(range(self.ctas))

    def read(self, cta: int, chunk: int) -> dict:
        s = chunk % self.stages
        if self.held[cta][s] != chunk or cta not in self.pending[s]:
            raise RuntimeError(
                f"ring {self.name}: CTA {cta} waits for chunk {chunk}, stage {s} holds "
                f"{self.held[cta][s]}"
            )
        return self.data[s]

    def release(self, cta: int, chunk: int) -> None:
        self.pending[chunk % self.stages].discard(cta)


# ----------------------------------------------------------------------------- one launch


def fused_walk(q, k, v, g, beta, s, c: int, stages: int, ctas: int, emit_o: bool, dt=None):
    """One cluster launch over a sequence: q (scaled), k, g (B, HV, L, K), v (B, HV, L, V), beta
    (B, HV, L), s (B, HV, K, V) with V split over `ctas` CTAs. Returns (o or None, final s)."""
    length = q.shape[2]
    if length == 0:
        return (v.clone() if emit_o else None), s
    q, k, v, g, beta = (_split_chunks(x, c) for x in (q, k, v, g, beta))
    n, width = q.shape[2], v.shape[-1] // ctas
    parts = [s[..., z * width : (z + 1) * width] for z in range(ctas)]
    out = torch.zeros_like(v) if emit_o else None
    ring_a, ring_b = _Ring("A", stages, ctas), _Ring("B", stages, ctas)

    def make(cc):
        ops = aux_chunk(q[:, :, cc], k[:, :, cc], g[:, :, cc], beta[:, :, cc], dt)
        return {x: ops[x] for x in ("kg", "qg")}, {x: ops[x] for x in ("kd", "tb", "p", "d")}

    made = {}
    for cc in range(min(stages, n)):  # the prologue: each aux's first chunk
        made[cc] = make(cc)
        ring_a.write(cc % ctas, cc, made[cc][0])
        ring_b.write(cc % ctas, cc, made[cc][1])
    for cc in range(n):
        ahead = cc + stages
        x, o = [None] * ctas, [None] * ctas
        for z in range(ctas):
            ops = ring_a.read(z, cc)
            s_op = _round(parts[z], dt)
            x[z], o[z] = ops["kg"] @ s_op, ops["qg"] @ s_op
            ring_a.release(z, cc)
        if ahead < n:  # the aux of CTA ahead % ctas has worked on chunk `ahead` since it could
            made[ahead] = make(ahead)
            ring_a.write(ahead % ctas, ahead, made[ahead][0])
        for z in range(ctas):
            ops = ring_b.read(z, cc)
            cols = slice(z * width, (z + 1) * width)
            u = _round(ops["tb"] @ _round(v[:, :, cc][..., cols] - x[z], dt), dt)
            if emit_o:
                out[:, :, cc][..., cols] = o[z] + ops["p"] @ u
            parts[z] = parts[z] * ops["d"].unsqueeze(-1) + ops["kd"].transpose(-1, -2) @ u
            ring_b.release(z, cc)
        if ahead < n:
            ring_b.write(ahead % ctas, ahead, made.pop(ahead)[1])
        made.pop(cc, None)
    o = out.flatten(2, 3)[:, :, :length] if emit_o else None
    return o, torch.cat(parts, dim=-1)


# ----------------------------------------------------------------------------- the scan


def _scanned(q, k, v, g, beta, s, c: int, segments: int, stages: int, dt):
    """Launch 1: segment 0's final state from S_0, segments 1 .. S - 2 on [S | I] from [0 | I]
    (values [v | 0], two more CTAs: the transition's halves), no o; the initial states
    composed; launch 2: every segment from its own, with o, 2 CTAs."""
    length = q.shape[2]
    nchunks = math.ceil(length / c)
    per = math.ceil(nchunks / segments) * c if nchunks else c
    edges = list(range(0, length, per)) + [length] if length else [0, 0]
    spans = [slice(a, z) for a, z in zip(edges[:-1], edges[1:])]
    dk, dv = k.shape[-1], v.shape[-1]
    inits = [s]
    if len(spans) > 1:
        part = (x[:, :, spans[0]] for x in (q, k, v, g, beta))
        inits.append(fused_walk(*part, s, c, stages, 2, False, dt)[1])
    eye = torch.eye(dk, dtype=s.dtype, device=s.device).expand(*s.shape[:2], dk, dk)
    for span in spans[1:-1]:
        qs, ks, vs, gs, bs = (x[:, :, span] for x in (q, k, v, g, beta))
        v_aug = torch.cat([vs, vs.new_zeros(*vs.shape[:-1], dk)], dim=-1)
        s_aug = torch.cat([torch.zeros_like(s), eye], dim=-1)
        ctas = 2 * (dv + dk) // dv
        end = fused_walk(qs, ks, v_aug, gs, bs, s_aug, c, stages, ctas, False, dt)[1]
        f_s, a_s = end[..., :dv], end[..., dv:]
        inits.append(a_s @ inits[-1] + f_s)
    out, final = torch.zeros_like(v), s
    for span, init in zip(spans, inits):
        part = (x[:, :, span] for x in (q, k, v, g, beta))
        out[:, :, span], final = fused_walk(*part, init, c, stages, 2, True, dt)
    return out, final
