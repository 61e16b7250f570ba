"""The first (token-parallel) pass of the KDA forward, in torch for now: every chunk's
state-independent operands (`reference.kda_chunked.chunk_operands`, fp32) laid out for the
recurrence kernel. Torch only (no DSL).

Layout: sequence n's chunk c is global chunk first[n] + c, first = the exclusive prefix sum of
ceil(len / 64); its 64 rows are rows 64 (first[n] + c) .. of the row-major tensors below, the
rows past the sequence's end exact zeros (so nothing of theirs reaches a valid output):

    q_g, k_g, k_d   (R, HV, K) bf16       R = 64 x the number of chunks
    t_beta, p       (R, HV, 64) bf16      row i of the chunk, column j
    decay           (NC, HV, K) fp32      e^(G_C) per key channel
    first           (N,) int32
"""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK
from forgekernel.reference.kda_chunked import chunk_operands

OPERAND_DTYPE = torch.bfloat16
CHUNKS_PER_GROUP = 1024  # chunks whose fp32 temporaries are alive at once (memory)
L2NORM_EPS = 1e-6


def chunk_layout(edges: list[int], device) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(first (N,) int32, token (R,) int64: the token of every padded row, -1 past a
    sequence's end) from the host offsets; token None where it is the identity (every length
    a multiple of the chunk: rows = tokens, nothing to gather). Built on the host in a fixed
    number of ops (a per-sequence loop cost ~10 us a sequence of host time) and copied once."""
    lens = torch.tensor(edges, dtype=torch.int64).diff()
    chunks = (lens + CHUNK - 1) // CHUNK
    first = (chunks.cumsum(0) - chunks).to(torch.int32).to(device)
    if not bool((lens % CHUNK).any()):
        return first, None
    seq = torch.repeat_interleave(torch.arange(lens.numel()), chunks * CHUNK)
    row = torch.arange(seq.numel()) - (chunks.cumsum(0) - chunks)[seq] * CHUNK
    start = torch.tensor(edges[:-1], dtype=torch.int64)[seq]
    token = torch.where(row < lens[seq], start + row, torch.full_like(row, -1))
    return first, token.to(device)


def chunk_table(edges: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) (NC,) int32: every global chunk's first token and valid length (1 ..
    64; empty sequences have no chunk), built on the host (the first-pass kernel's grid)."""
    lens = torch.tensor(edges, dtype=torch.int64).diff()
    chunks = (lens + CHUNK - 1) // CHUNK
    seq = torch.repeat_interleave(torch.arange(lens.numel()), chunks)
    local = torch.arange(seq.numel()) - (chunks.cumsum(0) - chunks)[seq]
    starts = torch.tensor(edges[:-1], dtype=torch.int64)[seq] + local * CHUNK
    lengths = (lens[seq] - local * CHUNK).clamp(max=CHUNK)
    return tuple(x.to(torch.int32).to(device) for x in (starts, lengths))


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


def kda_chunk_operands(q, k, g, beta, edges: list[int], scale: float, l2norm: bool) -> dict:
    """q, k (T, H, K) 16-bit, g (T, HV, K), beta (T, HV) (fp32 or q's dtype); edges the host
    offsets (N + 1). Returns the dict of the module docstring."""
    hv = g.shape[1]
    grouped = hv != q.shape[1]
    heads = torch.arange(hv, device=q.device) // (hv // q.shape[1]) if grouped else None
    first, token = chunk_layout(edges, q.device)
    rows, dk = (q.shape[0] if token is None else token.numel()), q.shape[2]
    out = {
        "q_g": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "k_g": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "k_d": q.new_empty(rows, hv, dk, dtype=OPERAND_DTYPE),
        "t_beta": q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE),
        "p": q.new_empty(rows, hv, CHUNK, dtype=OPERAND_DTYPE),
        "decay": q.new_empty(rows // CHUNK, hv, dk, dtype=torch.float32),
        "first": first,
    }
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
                             inverse=unit_lower_inverse)  # fmt: skip
        for name in ("q_g", "k_g", "k_d", "t_beta", "p"):
            out[name][a : a + span] = _rows(ops[name])
        out["decay"][a // CHUNK : (a + span) // CHUNK] = ops["decay"]
    return out
