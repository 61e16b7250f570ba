"""DeepSeek Sparse Attention (DSA, DeepSeek-V3.2) references: the lightning indexer and its
top-k, the indexer's training loss and gradients, sparse MLA attention forward / backward, the
score recompute, and the fused prefill (query RoPE + sparse attention + output RoPE + FP8 cast).
fp32 by default; pass dtype=torch.float64 for a yardstick. Sources are cited in [brackets].

Lightning indexer [DeepSeek-V3.2-Exp paper eq. (1); inference/model.py `Indexer`, kernel.py
`fp8_index`]: H_I = 64 heads of D_I = 128, one shared key per token,

    I[t, s] = sum_h w[t, h] * relu(q[t, h] . k[s])

q, k may be float8_e4m3fn with scales: k = k_fp8 * k_scale[s] (per token: D_I is one 128-wide
block), q = q_fp8 * q_scale[t, h]. DeepSeek folds q_scale into the weights (w = weights_proj(x)
* H_I^-0.5 * q_scale * D_I^-0.5; exact since relu(a x) = a relu(x) for a > 0) and multiplies by
k_scale after the head sum; both orders are the same math, rounded differently. Causal rule
(OPS.md, bottom-right): query t of S sees key s of S_kv iff s <= t + S_kv - S, which is
DeepSeek's `triu(1)` mask for a prefill from position 0 and cuDNN's `k < q + 1 + offset`.

Top-k: the min(topk, visible) highest visible scores per row, int32 (S, topk), padded with -1.
Selection is order-free (DeepSeek calls topk(sorted=False)); this reference returns them by
descending score, ties to the lower key index, then -1s. DeepSeek's own reference takes
min(topk, end_pos) entries for every row, so early rows also pick hidden (-inf) keys and rely
on the attention's causal mask; kernels (FlashMLA, FlashInfer's definition) use -1 instead.
`topk_selection_error` judges a kernel's selection without requiring this order or tie rule.

Indexer training [paper eqs. (3), (4)]: the target p[t, :] is the main attention's
probabilities summed over heads and L1-normalized over the selected set S_t; the loss is
sum_t KL(p[t, S_t] || softmax(I[t, S_t])); the indexer's input is detached from the main model.
`dsa_score_recompute_ref` gives the per-head probabilities, `dsa_attention_target_ref` the
target, `dsa_score_target_ref` the target exactly as cuDNN's sparse_attn_score_recompute
returns it (from q, kv, lse and the indices; its L1 sum carries an eps of 1e-10),
`dsa_indexer_backward_ref` the gradients of the loss with respect to q, k and the weights
(autograd of the sparse scores; cross-entropy -sum p log softmax(I) has the same gradients,
as cuDNN's reference uses).

Sparse attention [paper eq. (2); FlashMLA flash_mla_sparse_fwd; cuDNN-frontend DSA backward]:
MQA over one latent KV head of D = 576 (512 compressed + 64 RoPE); V is kv[:, :d_v] (d_v=512).

    s[t, h, j] = scale * q[t, h] . kv[idx[t, j]]          over valid j (idx >= 0)
    lse[t, h]  = logsumexp_j s[t, h, j]                    natural log, the sink NOT included
    out[t, h]  = sum_j exp(s[t, h, j]) V[idx[t, j]] / (sum_j exp(s[t, h, j]) + exp(sink[h]))

The sink is a per-head logit that joins the softmax denominator only: FlashMLA documents it as
out_no_sink * exp(lse) / (exp(lse) + exp(sink)), "no effect on lse" (the "KV-only LSE" that
cuDNN's backward and score recompute take); -inf is no sink, +inf makes the output 0. A row with
no valid index gives out 0 and lse -inf (FlashMLA returns +inf there). Each listed index is one
term (gather semantics, as FlashMLA's and FlashInfer's references); indexers never list an index
twice, so duplicates are outside the contract. Indices past S_kv raise ValueError (FlashMLA and
cuDNN treat them as padding). topk_length[t], when given, keeps only the first topk_length[t]
entries of row t (FlashMLA / cuDNN). lse is (S, H), token-major like FlashMLA's sparse prefill,
cuDNN's DSA backward and FlashInfer's definitions, and like the kernel, which computes all heads
of a token from one gather of its top-k rows; OPS.md's varlen (heads, tokens) would be a
transpose in every caller. Indices address the flat kv, so packed sequences need nothing more;
paged caches address slot = page * page_size + offset (FlashMLA, FlashInfer).

Backward (`dsa_sparse_attention_bwd_ref`, the kernel's math, checked against autograd of the
differentiable forward): with P = exp(s - lse_all), lse_all = logaddexp(lse, sink), O = out,
Delta = rowsum(dO * O), dS = P * (dO V^T - Delta) (+ dLSE P_kv when the KV-only LSE has a
gradient, P_kv = exp(s - lse)): dq = scale dS K, dkv[idx] += scale dS^T q (all 576) + P^T dO
(first d_v), d_sink = -sum P_sink Delta with P_sink = exp(sink - lse_all); dkv sums over every
head and every query that picked the row. O and lse may be the forward's saved ones (the
kernel's inputs, as cuDNN's backward takes them) or recomputed.

RoPE [inference/model.py `apply_rotary_emb`, FlashMLA fused_norm_rope_attn_rope_cast]: MLA's
64 RoPE dims (the last 64 of q's 576) are rotated in interleaved pairs (x[2i], x[2i + 1])
(GPT-J style, view_as_complex); the indexer's 64 RoPE dims are its *first* 64 of 128 and rotate
in half-split pairs (x[i], x[i + 32]) (NeoX; DeepSeek's 2025-11 fix "rope in indexer is not
interleaved", vLLM `indexer_rope_interleave=False`). cos_sin_cache is (positions, rope_dim) =
[cos | sin] halves (vLLM layout). The fused prefill rotates q by +angle, rounds it to q's dtype,
and rotates the last rope_dim of the d_v-wide output by -angle (the conjugate), then casts the
output to FP8 e4m3 in groups of 32 channels with scale = amax / 448 (amax >= 1e-4) rounded up
to a power of two (UE8M0), as FlashMLA's fused kernel and DeepSeek's act_quant(ue8m0) do.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

# Elements of a chunk's largest intermediate (gathered rows, scores): 64 MB in fp32.
CHUNK_BUDGET = 1 << 24
FP8_E4M3_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4  # DeepSeek act_quant / TileKernels: amax is clamped before the scale

Scales = torch.Tensor | None


# ---------------------------------------------------------------- shared helpers


def _rows_per_chunk(elements_per_row: int, budget: int | None = None) -> int:
    return max(1, (budget or CHUNK_BUDGET) // max(1, elements_per_row))


def _chunks(rows: int, elements_per_row: int, budget: int | None = None):
    step = _rows_per_chunk(elements_per_row, budget)
    return ((r0, min(rows, r0 + step)) for r0 in range(0, rows, step))


def dequantize(x: torch.Tensor, scale: Scales, dtype: torch.dtype) -> torch.Tensor:
    """x in `dtype`, times `scale` broadcast from the left (x (..., D), scale (...)) if given.
    fp8 has no arithmetic: it is converted first and the product rounded once."""
    out = x.to(dtype)
    return out if scale is None else out * scale.to(dtype)[..., None]


def causal_visible(
    s: int, s_kv: int, device: torch.device | None = None, rows: tuple[int, int] | None = None
) -> torch.Tensor:
    """(S, S_kv) bool, or rows r0..r1 of it: query t sees key j iff j <= t + S_kv - S
    (bottom-right aligned)."""
    r0, r1 = rows or (0, s)
    t = torch.arange(r0, r1, device=device)[:, None]
    return torch.arange(s_kv, device=device)[None, :] <= t + (s_kv - s)


def _check_int(name: str, t: torch.Tensor) -> None:
    if t.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"{name}: expected int32 (or int64), got {t.dtype}")


def _valid_slots(
    indices: torch.Tensor, s_kv: int, topk_length: torch.Tensor | None, check_range: bool = True
) -> torch.Tensor:
    """(S, topk) bool: entries that take part (index >= 0, inside topk_length). check_range:
    raise on an entry >= s_kv (a host read of the largest entry; False where nothing may be
    read back, as under CUDA-graph capture: such an entry is then the caller's error)."""
    _check_int("topk_indices", indices)
    if check_range and indices.numel() and int(indices.max()) >= s_kv:
        raise ValueError(f"topk_indices: an entry is >= the {s_kv} keys (padding is -1)")
    valid = indices >= 0
    if topk_length is not None:
        if topk_length.shape != indices.shape[:1]:
            raise ValueError(
                f"topk_length: expected ({indices.shape[0]},), got {tuple(topk_length.shape)}"
            )
        positions = torch.arange(indices.shape[1], device=indices.device)
        valid = valid & (positions[None, :] < topk_length[:, None])
    return valid


def _gather_rows(x: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """x[indices] for indices (R, K) holding valid rows (padding already replaced)."""
    return x.index_select(0, indices.reshape(-1)).view(*indices.shape, x.shape[-1])


# ---------------------------------------------------------------- lightning indexer


def dsa_indexer_scores_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    *,
    q_scale: Scales = None,
    k_scale: Scales = None,
    causal: bool = True,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Index scores I (S, S_kv) in `dtype`, -inf where the causal rule hides the key.

    q_idx (S, H_I, D_I), k_idx (S_kv, D_I) (any float dtype, fp8 included), weights (S, H_I),
    q_scale (S, H_I) and k_scale (S_kv,) dequantization scales or None. Differentiable in
    float q_idx, k_idx and weights (autograd through the chunks).
    """
    parts = list(_index_score_chunks(q_idx, k_idx, weights, q_scale, k_scale, causal, dtype))
    return torch.cat(parts) if parts else k_idx.new_zeros(0, k_idx.shape[0], dtype=dtype)


def _index_score_chunks(q_idx, k_idx, weights, q_scale, k_scale, causal, dtype):
    """The index scores a chunk of query rows at a time, causal rows masked with -inf."""
    _check_indexer(q_idx, k_idx, weights, q_scale, k_scale)
    q = dequantize(q_idx, q_scale, dtype)
    k = dequantize(k_idx, k_scale, dtype)
    w = weights.to(dtype)
    s, heads = q.shape[:2]
    for r0, r1 in _chunks(s, heads * k.shape[0]):
        logits = torch.einsum("rhd,nd->rhn", q[r0:r1], k).relu()
        scores = torch.einsum("rhn,rh->rn", logits, w[r0:r1])
        if causal:
            visible = causal_visible(s, k.shape[0], q.device, rows=(r0, r1))
            scores = scores.masked_fill(~visible, float("-inf"))
        yield scores


def dsa_topk_ref(scores: torch.Tensor, topk: int) -> torch.Tensor:
    """int32 (S, topk): the columns of the min(topk, visible) largest finite scores of each row,
    by descending score, ties to the lower column, then -1 padding (-inf marks hidden keys)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices[:, :topk]
    picked = torch.where(scores.gather(-1, order) == float("-inf"), -1, order).int()
    pad = topk - picked.shape[1]
    return torch.nn.functional.pad(picked, (0, pad), value=-1) if pad > 0 else picked


def dsa_indexer_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    *,
    q_scale: Scales = None,
    k_scale: Scales = None,
    causal: bool = True,
    topk: int = 2048,
    cu_seqlens_q: torch.Tensor | None = None,
    cu_seqlens_k: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Top-k indices int32 (S, topk) of the index scores (computed in `dtype`), -1 padded (see
    the module docstring). Scores live one chunk of rows at a time, so 32k x 64k fits.

    Packed sequences: cu_seqlens_q / cu_seqlens_k int32 (batch + 1,); the causal rule applies
    within each sequence and the indices are global rows of k_idx (k0 + j), ready for the
    sparse attention over the packed kv.
    """
    if (cu_seqlens_q is None) != (cu_seqlens_k is None):
        raise ValueError("cu_seqlens_q, cu_seqlens_k: give both or neither")
    out = torch.full((q_idx.shape[0], topk), -1, dtype=torch.int32, device=q_idx.device)
    if cu_seqlens_q is None:
        bounds = [(0, q_idx.shape[0], 0, k_idx.shape[0])]
    else:
        cu_q, cu_k = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
        bounds = zip(cu_q[:-1], cu_q[1:], cu_k[:-1], cu_k[1:])
    for q0, q1, k0, k1 in bounds:
        qs = None if q_scale is None else q_scale[q0:q1]
        ks = None if k_scale is None else k_scale[k0:k1]
        chunks = _index_score_chunks(
            q_idx[q0:q1], k_idx[k0:k1], weights[q0:q1], qs, ks, causal, dtype
        )
        local = [dsa_topk_ref(scores, topk) for scores in chunks]  # top-k as each chunk comes
        if local:
            local = torch.cat(local)
            out[q0:q1] = torch.where(local >= 0, local + k0, -1)
    return out


def dsa_indexer_paged_ref(
    q_idx: torch.Tensor,
    k_cache: torch.Tensor,
    weights: torch.Tensor,
    page_table: torch.Tensor,
    seqlens_k: torch.Tensor,
    *,
    k_scale_cache: Scales = None,
    q_scale: Scales = None,
    cu_seqlens_q: torch.Tensor | None = None,
    topk: int = 2048,
) -> torch.Tensor:
    """Top-k over a paged indexer-key cache, as slot indices page * page_size + offset, int32
    (rows, topk), -1 padded: what a decode step feeds the paged sparse attention.

    k_cache (num_pages, page_size, D_I), k_scale_cache (num_pages, page_size) or None;
    page_table int32 (batch, max_pages), seqlens_k (batch,). Decode: q_idx (batch, H_I, D_I),
    one query per sequence seeing all its keys. Prefill chunks: cu_seqlens_q packs each
    sequence's last queries (bottom-right causal, as `paged_attention_ref`).
    """
    page_size = k_cache.shape[1]
    bounds = _query_bounds(q_idx.shape[0], cu_seqlens_q)
    logical = torch.full((q_idx.shape[0], topk), -1, dtype=torch.int32, device=q_idx.device)
    for b, (q0, q1) in enumerate(bounds):
        seqlen = int(seqlens_k[b])
        used = page_table[b, : -(-seqlen // page_size)].long()
        keys = k_cache.index_select(0, used).flatten(0, 1)[:seqlen]
        scale = None
        if k_scale_cache is not None:
            scale = k_scale_cache.index_select(0, used).flatten()[:seqlen]
        logical[q0:q1] = dsa_indexer_ref(
            q_idx[q0:q1],
            keys,
            weights[q0:q1],
            q_scale=None if q_scale is None else q_scale[q0:q1],
            k_scale=scale,
            topk=topk,
        )
    return page_table_to_slot_indices(logical, page_table, page_size, cu_seqlens_q=cu_seqlens_q)


def topk_selection_error(scores: torch.Tensor, indices: torch.Tensor, topk: int) -> float:
    """How far a kernel's top-k misses the exact one: the largest (k-th best visible score -
    a selected score) over rows, 0.0 when exact. Order and tie choice are free; ValueError for a
    structural fault (duplicate, hidden or out-of-range index, wrong count, -1 not padding)."""
    if indices.shape != (scores.shape[0], topk):
        raise ValueError(f"indices: expected {(scores.shape[0], topk)}, got {tuple(indices.shape)}")
    visible = torch.isfinite(scores).sum(-1)
    valid = indices >= 0
    if not torch.equal(valid.sum(-1), visible.clamp(max=topk)):
        raise ValueError("indices: the count of non-negative entries is not min(topk, visible)")
    if indices.numel() and int(indices.max()) >= scores.shape[1]:
        raise ValueError("indices: an entry is past the keys")
    picked = scores.gather(-1, indices.clamp(min=0).long())
    if not torch.isfinite(picked[valid]).all():
        raise ValueError("indices: a hidden key (score -inf) was selected")
    ordered = torch.sort(torch.where(valid, indices.long(), scores.shape[1]), dim=-1).values
    if (ordered[:, 1:] == ordered[:, :-1])[ordered[:, 1:] < scores.shape[1]].any():
        raise ValueError("indices: a row lists a key twice")
    kth = torch.sort(scores, dim=-1, descending=True).values[:, : max(topk, 1)]
    kth = kth.gather(-1, (visible.clamp(min=1, max=topk) - 1)[:, None]).squeeze(-1)
    gap = torch.where(valid, kth[:, None] - picked, 0.0)
    return float(gap.max().clamp(min=0)) if gap.numel() else 0.0


def dsa_indexer_topk_scores_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    *,
    q_scale: Scales = None,
    k_scale: Scales = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Index scores at the selected keys, (S, topk), -inf at -1 entries; differentiable (the
    sparse-stage indexer loss's logits). k_idx rows are addressed by topk_indices directly."""
    _check_indexer(q_idx, k_idx, weights, q_scale, k_scale)
    valid = _valid_slots(topk_indices, k_idx.shape[0], None)
    safe = torch.where(valid, topk_indices, 0).long()
    q = dequantize(q_idx, q_scale, dtype)
    k = dequantize(k_idx, k_scale, dtype)
    w = weights.to(dtype)
    heads, d = q.shape[1:]
    parts = []
    for r0, r1 in _chunks(q.shape[0], topk_indices.shape[1] * (heads + d)):
        logits = torch.einsum("rhd,rkd->rhk", q[r0:r1], _gather_rows(k, safe[r0:r1])).relu()
        parts.append(torch.einsum("rhk,rh->rk", logits, w[r0:r1]))
    scores = torch.cat(parts) if parts else q.new_zeros(0, topk_indices.shape[1])
    return scores.masked_fill(~valid, float("-inf"))


def dsa_attention_target_ref(probs: torch.Tensor) -> torch.Tensor:
    """The indexer's target (S, topk): probabilities (S, H, topk) summed over heads, then
    L1-normalized over the selected keys (rows summing to 0 stay 0)."""
    total = probs.sum(1)
    norm = total.sum(-1, keepdim=True)
    return total / torch.where(norm > 0, norm, 1)


def dsa_indexer_loss_ref(index_scores: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """sum_t KL(target[t] || softmax(index_scores[t])) over the entries where index_scores is
    finite (the selected keys); rows with none add 0. Differentiable in index_scores."""
    valid = torch.isfinite(index_scores)
    row_has = valid.any(-1, keepdim=True)
    # A row with no selected key would be NaN after log_softmax, in value and gradient.
    logits = torch.where(row_has, index_scores, 0.0)
    log_pred = torch.log_softmax(logits, dim=-1)
    target = target.to(log_pred.dtype)
    kl = torch.xlogy(target, target) - target * torch.where(valid, log_pred, 0.0)
    return torch.where(valid, kl, 0.0).sum()


def dsa_indexer_backward_ref(
    q_idx: torch.Tensor,
    k_idx: torch.Tensor,
    weights: torch.Tensor,
    topk_indices: torch.Tensor,
    target: torch.Tensor,
    *,
    q_scale: Scales = None,
    k_scale: Scales = None,
    grad_scale: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(d q_idx, d k_idx, d weights) of grad_scale * dsa_indexer_loss_ref(I[t, S_t], target), in
    `dtype`; with fp8 / scaled inputs, gradients with respect to the dequantized values."""
    q = dequantize(q_idx, q_scale, dtype).detach().requires_grad_(True)
    k = dequantize(k_idx, k_scale, dtype).detach().requires_grad_(True)
    w = weights.to(dtype).detach().requires_grad_(True)
    with torch.enable_grad():
        scores = dsa_indexer_topk_scores_ref(q, k, w, topk_indices, dtype=dtype)
        loss = grad_scale * dsa_indexer_loss_ref(scores, target)
        dq, dk, dw = torch.autograd.grad(loss, (q, k, w), allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in ((q, dq), (k, dk), (w, dw)))


def _check_indexer(q_idx, k_idx, weights, q_scale, k_scale) -> None:
    if q_idx.dim() != 3 or k_idx.dim() != 2 or k_idx.shape[1] != q_idx.shape[2]:
        raise ValueError(
            "q_idx (S, H_I, D_I), k_idx (S_kv, D_I): got"
            f" {tuple(q_idx.shape)}, {tuple(k_idx.shape)}"
        )
    if weights.shape != q_idx.shape[:2]:
        raise ValueError(f"weights: expected {tuple(q_idx.shape[:2])}, got {tuple(weights.shape)}")
    if q_scale is not None and q_scale.shape != q_idx.shape[:2]:
        raise ValueError(f"q_scale: expected {tuple(q_idx.shape[:2])}, got {tuple(q_scale.shape)}")
    if k_scale is not None and k_scale.shape != k_idx.shape[:1]:
        raise ValueError(f"k_scale: expected ({k_idx.shape[0]},), got {tuple(k_scale.shape)}")


# ---------------------------------------------------------------- sparse MLA attention


def dsa_sparse_attention_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    d_v: int = 512,
    return_lse: bool = True,
    dtype: torch.dtype = torch.float32,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """(out (S, H, d_v), lse (S, H)) in `dtype` (lse natural log, sink excluded), or out alone.

    q (S, H, D), kv (S_kv, D) with V = kv[:, :d_v], topk_indices int32 (S, topk) -1 padded,
    attn_sink (H,) or None, topk_length (S,) or None. Differentiable in q, kv and attn_sink:
    autograd through these chunks is the backward's reference. Autograd keeps every chunk's
    gathered rows (S x topk x D); at suite sizes use `dsa_sparse_attention_bwd_ref`.
    """
    valid = _check_sparse(q, kv, topk_indices, attn_sink, topk_length, d_v)
    safe = torch.where(valid, topk_indices, 0).long()
    qf, kvf = q.to(dtype), kv.to(dtype)
    sink = None if attn_sink is None else attn_sink.to(dtype)
    outs, lses = [], []
    per_row = topk_indices.shape[1] * (kv.shape[1] + 3 * q.shape[1])
    for r0, r1 in _chunks(q.shape[0], per_row):
        out, lse = _sparse_forward_chunk(
            qf[r0:r1], kvf, safe[r0:r1], valid[r0:r1], softmax_scale, sink, d_v
        )
        outs.append(out)
        lses.append(lse)
    if not outs:
        empty = qf.new_zeros(0, q.shape[1], d_v)
        return (empty, qf.new_zeros(0, q.shape[1])) if return_lse else empty
    out = torch.cat(outs)
    return (out, torch.cat(lses)) if return_lse else out


def _sparse_forward_chunk(q, kv, safe, valid, scale, sink, d_v):
    """One chunk of rows; max-shifted with a detached shift, so gradients are exact and rows
    with no valid index (or a +inf sink) give 0, never NaN, in value and gradient."""
    kv_rows = _gather_rows(kv, safe)  # (R, K, D)
    s = torch.einsum("rhd,rkd->rhk", q, kv_rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    shift = s.detach().amax(-1)
    shift = torch.where(torch.isfinite(shift), shift, 0.0)
    e = torch.exp(s - shift[..., None])
    z_kv = e.sum(-1)
    z = z_kv if sink is None else z_kv + torch.exp(sink[None, :] - shift)
    out = torch.einsum("rhk,rkv->rhv", e, kv_rows[..., :d_v])
    out = out / torch.where(z > 0, z, 1.0)[..., None]
    seen = z_kv > 0
    lse = torch.where(seen, torch.log(torch.where(seen, z_kv, 1.0)) + shift, float("-inf"))
    return out, lse


def dsa_sparse_attention_bwd_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    dout: torch.Tensor,
    *,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    dlse: torch.Tensor | None = None,
    d_v: int = 512,
    dtype: torch.dtype = torch.float32,
    dq_dtype: torch.dtype | None = None,
    chunk_elements: int | None = None,
    check_range: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(dq (S, H, D), dkv (S_kv, D), d_sink (H,) or None): the gradients of
    sum(out * dout) + sum(lse * dlse) (dlse None: 0), written out as a kernel computes them
    (module docstring), chunk by chunk in `dtype`, dkv accumulated by index_add over the
    selected rows (every head, every query that listed the row; a duplicate entry is one more
    term, as in the forward's gather). dkv and d_sink come back in `dtype`, dq in dq_dtype
    (default `dtype`; each chunk is rounded as it is written, so nothing S x H x D wide is held
    in `dtype` beyond dq itself). chunk_elements: the chunk's intermediates' size (default
    CHUNK_BUDGET; a GPU caller widens it). check_range False: no host read at all (an index
    >= S_kv not checked: the caller's under CUDA-graph capture).

    out (S, H, d_v) and lse (S, H) (the forward's: KV-only natural-log LSE, -inf for an empty
    row), when given, are used as a kernel uses them (P = exp(s - logaddexp(lse, sink)),
    Delta = rowsum(dout * out)) instead of recomputing them from the chunk's scores. The LSE's
    gradient adds dlse P_kv to dS (P_kv = exp(s - lse): the KV-only softmax) and nothing to
    d_sink: kernels fold it into Delta, Delta' = Delta - dlse exp(lse_all - lse)."""
    valid = _check_sparse(q, kv, topk_indices, attn_sink, topk_length, d_v, check_range)
    rows = (*q.shape[:2], d_v)
    for name, t, shape in (("dout", dout, rows), ("out", out, rows), ("lse", lse, rows[:2]),
                           ("dlse", dlse, rows[:2])):  # fmt: skip
        if t is not None and t.shape != shape:
            raise ValueError(f"{name}: expected {shape}, got {tuple(t.shape)}")
    safe = torch.where(valid, topk_indices, 0).long()
    kvf = kv.to(dtype)
    sink = None if attn_sink is None else attn_sink.to(dtype)
    dq = torch.zeros(q.shape, dtype=dq_dtype or dtype, device=q.device)
    dkv = torch.zeros_like(kvf)
    d_sink = None if sink is None else torch.zeros_like(sink)
    saved = {"out": out, "lse": lse, "dlse": dlse}
    per_row = topk_indices.shape[1] * (kv.shape[1] + 5 * q.shape[1])
    for r0, r1 in _chunks(q.shape[0], per_row, chunk_elements):
        part = {k: None if v is None else v[r0:r1].to(dtype) for k, v in saved.items()}
        grads = _sparse_backward_chunk(
            q[r0:r1].to(dtype), kvf, safe[r0:r1], valid[r0:r1], softmax_scale, sink,
            dout[r0:r1].to(dtype), d_v, **part,
        )  # fmt: skip
        dq[r0:r1] = grads[0]
        dkv.index_add_(0, safe[r0:r1].reshape(-1), grads[1].flatten(0, 1))
        if d_sink is not None:
            d_sink -= grads[2]
    return dq, dkv, d_sink


def _sparse_backward_chunk(q, kv, safe, valid, scale, sink, do, d_v, out, lse, dlse):
    """One chunk of rows: (dq (R, H, D), the gradients of its gathered rows (R, K, D), the
    chunk's share of -d_sink (H,) or None)."""
    kv_rows = _gather_rows(kv, safe)  # (R, K, D)
    s = torch.einsum("rhd,rkd->rhk", q, kv_rows) * scale
    s = s.masked_fill(~valid[:, None, :], float("-inf"))
    lse_kv = torch.logsumexp(s, dim=-1) if lse is None else lse
    lse_all = lse_kv if sink is None else torch.logaddexp(lse_kv, sink[None, :].expand_as(lse_kv))
    # Nothing in the denominator: +inf makes P 0 (never NaN) and the row's gradients 0.
    lse_all = lse_all.masked_fill(torch.isneginf(lse_all), float("inf"))
    p = torch.exp(s - lse_all[..., None])
    v_rows = kv_rows[..., :d_v]
    o = torch.einsum("rhk,rkv->rhv", p, v_rows) if out is None else out
    delta = (do * o).sum(-1)  # (R, H)
    ds = p * (torch.einsum("rhv,rkv->rhk", do, v_rows) - delta[..., None])
    if dlse is not None:
        p_kv = torch.exp(s - lse_kv.masked_fill(torch.isneginf(lse_kv), float("inf"))[..., None])
        ds = ds + dlse[..., None] * p_kv
    dq = torch.einsum("rhk,rkd->rhd", ds, kv_rows) * scale
    d_rows = torch.einsum("rhk,rhd->rkd", ds, q) * scale
    d_rows[..., :d_v] += torch.einsum("rhk,rhv->rkv", p, do)
    if sink is None:
        return dq, d_rows, None
    # P_sink = exp(sink - lse_all); a +inf sink has P_sink 1 (and an output of 0, Delta 0).
    p_sink = torch.exp(sink[None, :] - lse_all)
    p_sink = torch.where(torch.isposinf(sink)[None, :], 1.0, p_sink)
    return dq, d_rows, (p_sink * delta).sum(0)


def dsa_score_recompute_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """Attention probabilities at the selected keys, (S, H, topk) in `dtype`:
    exp(scale q . kv[idx] - lse), 0 at padding and on rows whose lse is -inf. With the forward's
    KV-only lse each valid row sums to 1; with `lse_with_sink` it sums to less (the sink's share).
    """
    valid = _check_sparse(q, kv, topk_indices, None, topk_length, kv.shape[1])
    if lse.shape != q.shape[:2]:
        raise ValueError(f"lse: expected {tuple(q.shape[:2])}, got {tuple(lse.shape)}")
    safe = torch.where(valid, topk_indices, 0).long()
    qf, kvf = q.to(dtype), kv.to(dtype)
    lse = lse.to(dtype).masked_fill(torch.isneginf(lse), float("inf"))
    parts = []
    for r0, r1 in _chunks(q.shape[0], topk_indices.shape[1] * (kv.shape[1] + q.shape[1])):
        s = torch.einsum("rhd,rkd->rhk", qf[r0:r1], _gather_rows(kvf, safe[r0:r1]))
        s = (s * softmax_scale).masked_fill(~valid[r0:r1, None, :], float("-inf"))
        parts.append(torch.exp(s - lse[r0:r1, :, None]))
    return torch.cat(parts) if parts else qf.new_zeros(0, q.shape[1], topk_indices.shape[1])


TARGET_EPS = 1e-10  # cuDNN-frontend's L1 normalization: S / (sum S + 1e-10)


def dsa_score_target_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    lse: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    *,
    topk_length: torch.Tensor | None = None,
    eps: float = TARGET_EPS,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """The indexer's target as cuDNN-frontend 1.32's `sparse_attn_score_recompute_wrapper`
    returns it (sm90 kernel `SparseScoreRecomputeSm90`, L1 path), (S, topk) in `dtype`:
    S[t, j] = sum_h exp(scale q[t, h] . kv[idx[t, j]] - lse[t, h]) (natural-log lse, the
    forward's KV-only one), target = S / (sum_j S[t, j] + eps); 0 at padding, past
    topk_length, and for heads whose lse is -inf. With eps 0 and each head's lse from the same
    indices, this is `dsa_attention_target_ref(dsa_score_recompute_ref(...))` (paper eq. (3))."""
    probs = dsa_score_recompute_ref(
        q, kv, lse, topk_indices, softmax_scale, topk_length=topk_length, dtype=dtype
    )
    total = probs.sum(1)
    return total / (total.sum(-1, keepdim=True) + eps)


def lse_with_sink(lse: torch.Tensor, attn_sink: torch.Tensor) -> torch.Tensor:
    """The LSE of the whole denominator, logaddexp(lse, sink[h]), for lse (S, H)."""
    return torch.logaddexp(lse, attn_sink.to(lse.dtype)[None, :].expand_as(lse))


def _check_sparse(q, kv, indices, attn_sink, topk_length, d_v, check_range=True) -> torch.Tensor:
    """The valid-entry mask, after ValueErrors naming the argument for misread shapes."""
    if q.dim() != 3 or kv.dim() != 2 or kv.shape[1] != q.shape[2]:
        raise ValueError(f"q (S, H, D), kv (S_kv, D): got {tuple(q.shape)}, {tuple(kv.shape)}")
    if not 0 < d_v <= kv.shape[1]:
        raise ValueError(f"d_v: expected 1..{kv.shape[1]}, got {d_v}")
    if indices.dim() != 2 or indices.shape[0] != q.shape[0]:
        raise ValueError(f"topk_indices: expected ({q.shape[0]}, topk), got {tuple(indices.shape)}")
    if attn_sink is not None and attn_sink.shape != (q.shape[1],):
        raise ValueError(f"attn_sink: expected ({q.shape[1]},), got {tuple(attn_sink.shape)}")
    return _valid_slots(indices, kv.shape[0], topk_length, check_range)


# ---------------------------------------------------------------- paged forms


def flatten_kv_cache(kv_cache: torch.Tensor) -> torch.Tensor:
    """(num_pages, page_size, [1,] D) -> (num_pages * page_size, D): slot p * page_size + o is
    token o of page p, the index space FlashMLA and FlashInfer's DSA definitions use."""
    if kv_cache.dim() == 4 and kv_cache.shape[2] == 1:
        kv_cache = kv_cache[:, :, 0]
    if kv_cache.dim() != 3:
        raise ValueError(
            f"kv_cache: expected (num_pages, page_size, [1,] D), got {tuple(kv_cache.shape)}"
        )
    return kv_cache.reshape(-1, kv_cache.shape[-1])


def page_table_to_slot_indices(
    indices: torch.Tensor,
    page_table: torch.Tensor,
    page_size: int,
    *,
    cu_seqlens_q: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-sequence token positions (rows, topk) -> cache slots page_table[b, j // page_size] *
    page_size + j % page_size, int32, -1 kept. Row r belongs to sequence r (decode) or to the
    sequence whose cu_seqlens_q range holds it. FlashInfer's CSR page lists become a page table
    through `flashinfer_paged.csr_to_page_table`."""
    _check_int("indices", indices)
    if cu_seqlens_q is None:
        seq = torch.arange(indices.shape[0], device=indices.device)
    else:
        lengths = (cu_seqlens_q[1:] - cu_seqlens_q[:-1]).long()
        seq = torch.repeat_interleave(torch.arange(lengths.numel(), device=indices.device), lengths)
    if seq.numel() != indices.shape[0]:
        raise ValueError(f"indices: {indices.shape[0]} rows, the sequences hold {seq.numel()}")
    pages = page_table.long()[seq]
    local = indices.long().clamp(min=0)
    if local.numel() and int(local.max()) // page_size >= page_table.shape[1]:
        raise ValueError("indices: a position is past the page table's capacity")
    slots = pages.gather(1, local // page_size) * page_size + local % page_size
    return torch.where(indices >= 0, slots, -1).int()


def dsa_sparse_attention_paged_ref(
    q: torch.Tensor,
    kv_cache: torch.Tensor,
    slot_indices: torch.Tensor,
    softmax_scale: float,
    **kwargs,
) -> tuple[torch.Tensor, torch.Tensor] | torch.Tensor:
    """`dsa_sparse_attention_ref` over a paged latent cache (num_pages, page_size, [1,] 576)
    addressed by slot indices (see `flatten_kv_cache`; `page_table_to_slot_indices` converts
    per-sequence positions)."""
    return dsa_sparse_attention_ref(
        q, flatten_kv_cache(kv_cache), slot_indices, softmax_scale, **kwargs
    )


def _query_bounds(rows: int, cu_seqlens_q: torch.Tensor | None) -> list[tuple[int, int]]:
    if cu_seqlens_q is None:
        return [(b, b + 1) for b in range(rows)]
    cu = cu_seqlens_q.tolist()
    if cu[-1] != rows:
        raise ValueError(f"cu_seqlens_q: ends at {cu[-1]}, q has {rows} rows")
    return list(zip(cu[:-1], cu[1:]))


# ---------------------------------------------------------------- RoPE, FP8 cast, fused prefill


def rope_cos_sin(
    cos_sin_cache: torch.Tensor, positions: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (S, rope_dim / 2), of a [cos | sin] cache (num_positions, rope_dim)."""
    half = cos_sin_cache.shape[-1] // 2
    rows = cos_sin_cache.index_select(0, positions.long())
    return rows[:, :half], rows[:, half:]


def apply_rope(
    x: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    *,
    interleaved: bool = True,
    conjugate: bool = False,
) -> torch.Tensor:
    """x (S, ..., rope_dim) rotated by the angles of cos / sin (S, rope_dim / 2), in fp32 (or
    x's dtype if wider): pairs (x[2i], x[2i+1]) when interleaved, else (x[i], x[i + rope/2]);
    conjugate rotates by -angle (the output RoPE)."""
    dtype = torch.promote_types(x.dtype, torch.float32)
    shape = (cos.shape[0],) + (1,) * (x.dim() - 2) + (cos.shape[1],)
    c, s = cos.to(dtype).view(shape), sin.to(dtype).view(shape)
    if conjugate:
        s = -s
    x = x.to(dtype)
    half = x.shape[-1] // 2
    x0, x1 = (x[..., 0::2], x[..., 1::2]) if interleaved else (x[..., :half], x[..., half:])
    y0, y1 = x0 * c - x1 * s, x0 * s + x1 * c
    return torch.stack((y0, y1), -1).flatten(-2) if interleaved else torch.cat((y0, y1), -1)


def quantize_fp8_groups(
    x: torch.Tensor, group_size: int = 32, *, round_scale: bool = True
) -> tuple[torch.Tensor, torch.Tensor]:
    """(float8_e4m3fn x / scale, scale fp32 (..., D / group_size)) per group of `group_size`
    channels of the last dim: scale = max(amax, 1e-4) / 448, rounded up to a power of two when
    round_scale (UE8M0); values clamped to +-448 before the cast (round to nearest even)."""
    if x.shape[-1] % group_size:
        raise ValueError(f"x: last dim {x.shape[-1]} is not a multiple of {group_size}")
    groups = x.float().unflatten(-1, (-1, group_size))
    scale = groups.abs().amax(-1).clamp(min=FP8_AMAX_FLOOR) / FP8_E4M3_MAX
    if round_scale:
        mantissa, exponent = torch.frexp(
            scale
        )  # scale = mantissa * 2^exponent, mantissa in [0.5, 1)
        scale = torch.ldexp(torch.ones_like(scale), exponent - (mantissa == 0.5).int())
    values = (groups / scale[..., None]).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX)
    return values.to(torch.float8_e4m3fn).flatten(-2), scale


def dequantize_fp8_groups(x_fp8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """fp32 x_fp8 * scale, each scale covering x.shape[-1] / scale.shape[-1] channels."""
    group = x_fp8.shape[-1] // scale.shape[-1]
    return (x_fp8.float().unflatten(-1, (-1, group)) * scale[..., None]).flatten(-2)


class FusedPrefillOutput(NamedTuple):
    out_fp8: torch.Tensor  # (S, H, d_v) float8_e4m3fn
    out_scale: torch.Tensor  # (S, H, d_v / group_size) fp32 powers of two
    lse: torch.Tensor  # (S, H) natural log, sink excluded
    out: torch.Tensor  # (S, H, d_v) fp32, after the output RoPE, before the cast


def dsa_fused_prefill_ref(
    q: torch.Tensor,
    kv: torch.Tensor,
    topk_indices: torch.Tensor,
    softmax_scale: float,
    cos_sin_cache: torch.Tensor,
    positions: torch.Tensor,
    *,
    attn_sink: torch.Tensor | None = None,
    topk_length: torch.Tensor | None = None,
    rope_dim: int = 64,
    interleaved: bool = True,
    rope_output: bool = True,
    q_rms_norm_eps: float | None = None,
    d_v: int = 512,
    group_size: int = 32,
    round_scale: bool = True,
) -> FusedPrefillOutput:
    """Unfused: RoPE on q[..., -rope_dim:] at `positions` (S,), rounded back to q's dtype;
    optionally q scaled by rsqrt(mean(q^2) + eps) (FlashMLA's weightless Q RMSNorm, from the
    un-rotated q); sparse attention with sink in fp32; the conjugate RoPE on out[..., -rope_dim:]
    (rope_output); FP8 cast per `group_size` channels. kv is taken as already rotated (the
    cache stores rotated keys)."""
    cos, sin = rope_cos_sin(cos_sin_cache, positions)
    if cos.shape[1] * 2 != rope_dim or positions.shape != q.shape[:1]:
        raise ValueError(
            f"cos_sin_cache (positions, {rope_dim}) and positions ({q.shape[0]},): got "
            f"{tuple(cos_sin_cache.shape)}, {tuple(positions.shape)}"
        )
    rotated = apply_rope(q[..., -rope_dim:], cos, sin, interleaved=interleaved)
    q_rope = torch.cat((q[..., :-rope_dim], rotated.to(q.dtype)), -1).float()
    if q_rms_norm_eps is not None:
        q_rope = q_rope * torch.rsqrt(q.float().square().mean(-1) + q_rms_norm_eps)[..., None]
    out, lse = dsa_sparse_attention_ref(
        q_rope,
        kv,
        topk_indices,
        softmax_scale,
        attn_sink=attn_sink,
        topk_length=topk_length,
        d_v=d_v,
    )
    if rope_output:
        out_rope = apply_rope(
            out[..., -rope_dim:], cos, sin, interleaved=interleaved, conjugate=True
        )
        out = torch.cat((out[..., :-rope_dim], out_rope), -1)
    out_fp8, out_scale = quantize_fp8_groups(out, group_size, round_scale=round_scale)
    return FusedPrefillOutput(out_fp8, out_scale, lse, out)
