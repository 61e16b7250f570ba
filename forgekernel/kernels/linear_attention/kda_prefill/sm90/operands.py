"""The first (token-parallel) pass of the KDA forward in torch, the model of its kernel
(`intra.py`, the op's first pass since 2026-12-02) and the tests' yardstick, and the chunk
tables both use: every chunk's state-independent operands
(`reference.kda_chunked.chunk_operands`, fp32) laid out for the recurrence kernel. Torch only
(no DSL).

Layout: sequence n's chunk c is global chunk first[n] + c, first = the exclusive prefix sum of
ceil(len / 64); its 64 rows are rows 64 (first[n] + c) .. of the row-major tensors below, the
rows past the sequence's end exact zeros (so nothing of theirs reaches a valid output). The
offsets stay on the device (no host read: CUDA-graph capturable), so the number of chunks NC
is an upper bound known from host sizes (`chunk_bound`: exact for a batch or one sequence);
the chunks past the last real one are zeros that the recurrence never reads.

    q_g, k_g, k_d   (R, HV, K) bf16       R = 64 NC
    t_beta, p       (R, HV, 64) bf16      row i of the chunk, column j
    decay           (NC, HV, K) fp32      e^(G_C) per key channel
    first           (N,) int32

and with `bwd` (the KDA backward's, `intra.py`'s bwd key) two more, rows past the sequence
exact zeros like the others', and P transposed in place of P (the backward's kernel 1 reads
P^T token-major; nothing else reads the bwd key's P):

    tt              (R, HV, 64) bf16      T^T, T = (I + diag(beta) M(k, k))^-1 unscaled: row j
                                          of the chunk is column j of T
    big_g           (R, HV, K) fp32       G = cumsum(g) within the chunk
    pt              (R, HV, 64) bf16      P^T (instead of p): row j of the chunk is column j of P
    w, u            (R, HV, K / V) bf16   W = T_beta Kg, u = T_beta V: the bf16 rows t_beta,
                                          k_g and v (bf16; zero past the sequence) multiplied
                                          in fp32 per chunk, rounded once (the backward's
                                          torch bmm before next/kda-wu)
"""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK
from forgekernel.reference.kda_chunked import chunk_operands

OPERAND_DTYPE = torch.bfloat16
CHUNKS_PER_GROUP = 1024  # chunks whose fp32 temporaries are alive at once (memory)
L2NORM_EPS = 1e-6


def chunk_bound(tokens: int, sequences: int, seq_len: int | None = None) -> int:
    """An upper bound on the number of chunks, from host sizes only: sum ceil(len / 64) <=
    (T + 63 N) / 64 (tight: N - 1 one-token sequences and a long one) and <= T (every chunk
    holds a token); exact, N ceil(L / 64), where every sequence's length L is known."""
    if seq_len is not None:
        return sequences * -(-seq_len // CHUNK)
    return min(tokens, (tokens + (CHUNK - 1) * sequences) // CHUNK)


def chunk_tables(cu_seqlens: torch.Tensor, bound: int):
    """(first (N,), starts (NC,), lengths (NC,)) int32 on cu_seqlens' device, in torch ops that
    never read a value on the host (CUDA-graph capturable): first the exclusive prefix sum of
    ceil(len / 64), every global chunk's first token and valid length (1 .. 64). NC = `bound`
    (`chunk_bound`): the chunks past the last real one have length 0 (their start is
    meaningless), so nothing of theirs is read."""
    cu = cu_seqlens.long()
    lens = cu.diff()
    chunks = (lens + CHUNK - 1) // CHUNK
    ends = chunks.cumsum(0)
    first = ends - chunks
    gc = torch.arange(bound, device=cu.device)
    # the sequence owning global chunk gc: the first whose chunks end past it (empty ones end
    # where their predecessor does, so they own none); past the last chunk: the last sequence
    seq = torch.searchsorted(ends, gc, right=True).clamp_(max=lens.numel() - 1)
    local = (gc - first[seq]) * CHUNK
    starts = cu[seq] + local
    lengths = (lens[seq] - local).clamp_(0, CHUNK)
    return tuple(x.to(torch.int32) for x in (first, starts, lengths))


def row_tokens(starts: torch.Tensor, lengths: torch.Tensor) -> torch.Tensor:
    """(64 NC,) int64: the token of every padded row, -1 past its chunk's valid length."""
    i = torch.arange(CHUNK, device=starts.device)
    token = starts.long()[:, None] + i
    return torch.where(i < lengths[:, None], token, -1).flatten()


def chunk_layout(cu_seqlens: torch.Tensor, tokens: int, seq_len: int | None = None):
    """(first (N,) int32, token (R,) int64 or None) on the device, without a host read: token
    None where rows are tokens (every length the known multiple `seq_len` of 64: nothing to
    gather), else the padded rows of `chunk_tables` (R = 64 `chunk_bound`). seq_len: every
    sequence's length where the host knows it (a batch; one sequence: T, by the offsets'
    contract 0 .. T)."""
    n = cu_seqlens.shape[0] - 1
    if seq_len is not None and seq_len % CHUNK == 0:
        first = torch.arange(n, dtype=torch.int32, device=cu_seqlens.device) * (seq_len // CHUNK)
        return first, None
    first, starts, lengths = chunk_tables(cu_seqlens, chunk_bound(tokens, n, seq_len))
    return first, row_tokens(starts, lengths)


def _gather(x: torch.Tensor, token: torch.Tensor | None) -> torch.Tensor:
    """Rows of x (T, ...) at `token`, zeros where token < 0 (x itself where token is None:
    the identity); fp32."""
    if token is None:
        return x.float()
    keep = (token >= 0).view(-1, *([1] * (x.dim() - 1)))
    return x.float()[token.clamp(min=0)] * keep


def _rows_of(token: torch.Tensor | None, a: int, span: int, total: int):
    """The group of padded rows a .. a + span: a slice of token, or of the identity."""
    if token is None:
        return None, min(span, total - a)
    part = token[a : a + span]
    return part, part.numel()


def unit_lower_inverse(a: torch.Tensor) -> torch.Tensor:
    """(I + A)^-1 for strictly lower-triangular A (..., C, C): one batched triangular solve."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype, device=a.device).expand_as(a)
    return torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)


def _chunks(x: torch.Tensor) -> torch.Tensor:
    """(rows, HV, ...) -> (chunks, HV, 64, ...)."""
    return x.unflatten(0, (-1, CHUNK)).transpose(1, 2)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """(chunks, HV, 64, ...) -> (rows, HV, ...), in the operand dtype."""
    return x.transpose(1, 2).flatten(0, 1).to(OPERAND_DTYPE)


def kda_chunk_operands(q, k, g, beta, cu_seqlens: torch.Tensor, scale: float, l2norm: bool,
                       seq_len: int | None = None, bwd: bool = False,
                       v: torch.Tensor | None = None) -> dict:  # fmt: skip
    """q, k (T, H, K) 16-bit, g (T, HV, K), beta (T, HV) (fp32 or q's dtype); cu_seqlens
    (N + 1,) on q's device (never read on the host); seq_len as `chunk_layout`; bwd: tt,
    big_g, w and u too (v (T, HV, V) 16-bit, given with bwd only), pt in p's place. Returns
    the dict of the module docstring."""
    if bwd != (v is not None):
        raise ValueError("v is the bwd outputs' input: given with bwd=True, and only then")
    hv = g.shape[1]
    grouped = hv != q.shape[1]
    heads = torch.arange(hv, device=q.device) // (hv // q.shape[1]) if grouped else None
    first, token = chunk_layout(cu_seqlens, q.shape[0], seq_len)
    rows, dk = (q.shape[0] if token is None else token.numel()), q.shape[2]
    out = {
        "q_g": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "k_g": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "k_d": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "t_beta": q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE),
        ("pt" if bwd else "p"): q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE),
        "decay": q.new_empty(rows // CHUNK, hv, dk, dtype=torch.float32),
        "first": first,
    }
    if bwd:
        out["tt"] = q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE)
        out["big_g"] = q.new_empty(rows, hv, dk, dtype=torch.float32)
        out["w"] = q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE)
        out["u"] = q.new_empty(rows, hv, v.shape[-1], dtype=OPERAND_DTYPE)
    qf, kf = q.float(), k.float()
    if l2norm:
        qf, kf = (x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS) for x in (qf, kf))
    qf = qf * scale
    span = CHUNKS_PER_GROUP * CHUNK
    for a in range(0, rows, span):
        part, n = _rows_of(token, a, span, rows)

        def rows_of(x, per_head=False, a=a, n=n, part=part):
            y = _gather(x if part is not None else x[a : a + n], part)
            return _chunks(y[:, heads] if per_head and grouped else y)

        ops = chunk_operands(rows_of(qf, True), rows_of(kf, True), rows_of(g), rows_of(beta),
                             inverse=unit_lower_inverse, bwd=bwd)  # fmt: skip
        for name in ("q_g", "k_g", "k_d", "t_beta"):
            out[name][a : a + span] = _rows(ops[name])
        if bwd:
            out["pt"][a : a + span] = _rows(ops["p"].transpose(-1, -2))
        else:
            out["p"][a : a + span] = _rows(ops["p"])
        out["decay"][a // CHUNK : (a + span) // CHUNK] = ops["decay"]
        if bwd:  # rows past the sequence: T's padded diagonal of ones, G_last carried: zeroed
            inside = 1 if part is None else (part >= 0).view(-1, 1, 1)
            out["tt"][a : a + span] = _rows(ops["tt"]) * inside
            out["big_g"][a : a + span] = ops["big_g"].transpose(1, 2).flatten(0, 1) * inside
            tb = _chunks(out["t_beta"][a : a + span].float())
            for name, x in (("w", _chunks(out["k_g"][a : a + span].float())),
                            ("u", rows_of(v.to(OPERAND_DTYPE)))):  # fmt: skip
                out[name][a : a + span] = _rows(tb @ x)
    return out
