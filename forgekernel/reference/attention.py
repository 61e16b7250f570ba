"""Attention reference: O = softmax(scale * Q K^T + mask) V and its LSE, in fp32, and the
gradients dQ, dK, dV of the backward pass.

FlashAttention layout (batch, seqlen, heads, head_dim); GQA (query head h reads kv head
h // (Hq // Hkv)); V's head dim may differ from Q/K's; the causal mask is bottom-right aligned
(query i of Sq sees key j iff j <= i + Sk - Sq). Rows that see no key give O = 0, LSE = -inf.
LSE is natural-log, fp32, (batch, heads, seqlen_q).

Scores are materialized a chunk of heads and query rows at a time (at most `SCORE_BUDGET`
elements), so a B=4, Hq=32, S=8192 reference peaks at a few GB instead of 32 GB. The backward
is written out (no autograd graph): P recomputed from the LSE, dS = P * (dP - rowsum(dO * O)),
the same chunking, so the bwd suite's B=8, Hq=32, S=4096 reference fits as well.
"""

from __future__ import annotations

import torch

# Elements of one score chunk: 512 MB in fp32; softmax and logsumexp take about 3x that at peak.
SCORE_BUDGET = 1 << 27


def attention_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(out, lse) for q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv).

    upcast=True (the spec): every step in fp32, out fp32. upcast=False: the same math done by
    PyTorch in the input dtype (scores and probabilities rounded to it, out in it), the
    yardstick for a kernel's error. lse is fp32 either way.
    """
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    dtype = torch.float32 if upcast else q.dtype
    out = torch.empty(b, sq, hq, dv, dtype=dtype, device=q.device)
    lse = torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)
    heads, rows = _chunk_plan(sq, sk, hq, SCORE_BUDGET)
    for bi in range(b):
        for h0 in range(0, hq, heads):
            h1 = min(hq, h0 + heads)
            kv_head, kc, vc = _kv_chunk(k, v, bi, h0, h1, hq, dtype)
            for i0 in range(0, sq, rows):
                i1 = min(sq, i0 + rows)
                qc = q[bi, i0:i1, h0:h1].transpose(0, 1).to(dtype)  # (h, rows, D)
                mask = _causal_mask(i0, i1, sq, sk, q.device) if causal else None
                oc, lc = _chunk(qc, kc, vc, scale, mask)
                out[bi, i0:i1, h0:h1] = oc.transpose(0, 1)
                lse[bi, h0:h1, i0:i1] = lc
    return out, lse


def _chunk_plan(sq: int, sk: int, hq: int, budget: int) -> tuple[int, int]:
    """(heads, rows) per chunk: as many heads, then query rows, as `budget` score elements hold."""
    heads = min(hq, max(1, budget // max(1, sq * sk)))
    rows = min(max(1, sq), max(1, budget // max(1, heads * sk)))
    return heads, rows


def _kv_chunk(k, v, bi: int, h0: int, h1: int, hq: int, dtype: torch.dtype):
    """(kv head of each query head h0..h1, K (h, Sk, D), V (h, Sk, Dv)) of batch bi (GQA)."""
    kv_head = torch.arange(h0, h1, device=k.device) // (hq // k.shape[2])
    kc = k[bi].index_select(1, kv_head).transpose(0, 1).to(dtype)
    vc = v[bi].index_select(1, kv_head).transpose(0, 1).to(dtype)
    return kv_head, kc, vc


def _sequences(cu_seqlens_q: torch.Tensor, cu_seqlens_k: torch.Tensor):
    """(q0, q1, k0, k1) row bounds of each packed sequence."""
    return zip(
        cu_seqlens_q.tolist(),
        cu_seqlens_q[1:].tolist(),
        cu_seqlens_k.tolist(),
        cu_seqlens_k[1:].tolist(),
    )


def _causal_mask(i0: int, i1: int, sq: int, sk: int, device: torch.device) -> torch.Tensor:
    """True where key j is hidden from query row i (j > i + Sk - Sq), rows i0..i1."""
    rows = torch.arange(i0, i1, device=device)[:, None]
    return torch.arange(sk, device=device)[None, :] > rows + (sk - sq)


def _chunk(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    s = torch.bmm(qc, kc.transpose(1, 2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    lse = torch.logsumexp(s.float(), dim=-1)
    p = torch.softmax(s, dim=-1)
    del s
    # A row that sees no key is NaN after softmax (0/0); the spec says O = 0 there.
    p.masked_fill_(torch.isinf(lse)[..., None], 0.0)
    return torch.bmm(p, vc), lse


def attention_varlen_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed sequences: q (total_q, Hq, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv);
    sequence i is q[cu_seqlens_q[i]:cu_seqlens_q[i+1]] against k/v[cu_seqlens_k[i]:...].
    Returns out (total_q, Hq, Dv) and lse (Hq, total_q)."""
    dtype = torch.float32 if upcast else q.dtype
    out = torch.zeros(q.shape[0], q.shape[1], v.shape[2], dtype=dtype, device=q.device)
    lse = torch.full((q.shape[1], q.shape[0]), float("-inf"), device=q.device)
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        o, seq_lse = attention_ref(
            q[None, q0:q1], k[None, k0:k1], v[None, k0:k1], causal, softmax_scale, upcast
        )
        out[q0:q1], lse[:, q0:q1] = o[0], seq_lse[0]
    return out, lse


def attention_bwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(dq, dk, dv): the gradients of sum(O * dO) for O = attention_ref(q, k, v, ...).

    Shapes as q (B, Sq, Hq, D), k (B, Sk, Hkv, D), v (B, Sk, Hkv, Dv), do (B, Sq, Hq, Dv); dk and
    dv are summed over each kv head's group of query heads (GQA). O and LSE are recomputed here.
    upcast=True (the spec): every step in fp32, gradients fp32. upcast=False: the forward and
    the score-sized steps (S, P, dP, dS and the five matmuls) in the input dtype, as PyTorch's
    own autograd of the low-precision forward does; sums across chunks and heads in fp32;
    gradients in the input dtype. Rows that see no key get dq = 0 and add nothing to dk, dv.
    """
    b, sq, hq, d = q.shape
    sk, dv = k.shape[1], v.shape[3]
    scale = d**-0.5 if softmax_scale is None else softmax_scale
    dtype = torch.float32 if upcast else q.dtype
    o, lse = attention_ref(q, k, v, causal, scale, upcast)
    f32 = {"dtype": torch.float32, "device": q.device}
    grad_q, grad_k, grad_v = (torch.zeros(t.shape, **f32) for t in (q, k, v))
    # S, P, dP and dS of one chunk are alive at once: half the forward's budget each.
    heads, rows = _chunk_plan(sq, sk, hq, SCORE_BUDGET // 2)
    for bi in range(b):
        for h0 in range(0, hq, heads):
            h1 = min(hq, h0 + heads)
            kv_head, kc, vc = _kv_chunk(k, v, bi, h0, h1, hq, dtype)
            dkc = torch.zeros(h1 - h0, sk, d, **f32)
            dvc = torch.zeros(h1 - h0, sk, dv, **f32)
            for i0 in range(0, sq, rows):
                i1 = min(sq, i0 + rows)
                qc, doc, oc = (t[bi, i0:i1, h0:h1].transpose(0, 1).to(dtype) for t in (q, do, o))
                mask = _causal_mask(i0, i1, sq, sk, q.device) if causal else None
                stats = (oc, lse[bi, h0:h1, i0:i1])
                gq, gk, gv = _chunk_bwd(qc, kc, vc, doc, stats, scale, mask)
                grad_q[bi, i0:i1, h0:h1] = gq.transpose(0, 1)
                dkc += gk
                dvc += gv
            grad_k[bi].index_add_(1, kv_head, dkc.transpose(0, 1))
            grad_v[bi].index_add_(1, kv_head, dvc.transpose(0, 1))
    grads = (grad_q, grad_k, grad_v)
    return grads if upcast else tuple(g.to(q.dtype) for g in grads)


def _chunk_bwd(
    qc: torch.Tensor,
    kc: torch.Tensor,
    vc: torch.Tensor,
    doc: torch.Tensor,
    stats: tuple[torch.Tensor, torch.Tensor],
    scale: float,
    mask: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """fp32 (dq, dk, dv) of one chunk of heads and query rows; stats = (O chunk, LSE chunk)."""
    oc, lse = stats
    dtype = qc.dtype
    s = torch.bmm(qc, kc.transpose(1, 2)).mul_(scale)
    if mask is not None:
        s.masked_fill_(mask, float("-inf"))
    p = torch.exp(s.float() - lse[..., None])
    del s
    # A row that sees no key has LSE = -inf and exp(-inf - -inf) = NaN; its P is 0.
    p.masked_fill_(torch.isinf(lse)[..., None], 0.0)
    p = p.to(dtype)
    dp = torch.bmm(doc, vc.transpose(1, 2))
    delta = (doc.float() * oc.float()).sum(-1, keepdim=True)  # rowsum(dO * O) = rowsum(P * dP)
    ds = (p.float() * (dp.float() - delta)).to(dtype)
    del dp
    dv = torch.bmm(p.transpose(1, 2), doc).float()
    dq = torch.bmm(ds, kc).float().mul_(scale)
    dk = torch.bmm(ds.transpose(1, 2), qc).float().mul_(scale)
    return dq, dk, dv


def attention_varlen_bwd_ref(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    do: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    cu_seqlens_k: torch.Tensor,
    causal: bool = False,
    softmax_scale: float | None = None,
    upcast: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`attention_bwd_ref` per packed sequence: q, do (total_q, Hq, *), k, v (total_k, Hkv, *);
    returns (dq, dk, dv) packed the same way."""
    dtype = torch.float32 if upcast else q.dtype
    grads = tuple(torch.zeros(t.shape, dtype=dtype, device=q.device) for t in (q, k, v))
    for q0, q1, k0, k1 in _sequences(cu_seqlens_q, cu_seqlens_k):
        seq = attention_bwd_ref(
            q[None, q0:q1],
            k[None, k0:k1],
            v[None, k0:k1],
            do[None, q0:q1],
            causal,
            softmax_scale,
            upcast,
        )
        for grad, g, (a, z) in zip(grads, seq, ((q0, q1), (k0, k1), (k0, k1))):
            grad[a:z] = g[0]
    return grads
