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


def chunk_layout(edges: list[int], device) -> tuple[torch.Tensor, torch.Tensor]:
    """(first (N,) int32, token (R,) int64: the token of every padded row, -1 past a
    sequence's end) from the host offsets."""
    first, rows, start = [], [], 0
    for a, z in zip(edges[:-1], edges[1:]):
        nc = -(-(z - a) // CHUNK)
        first.append(start)
        start += nc
        t = torch.arange(nc * CHUNK, dtype=torch.int64)
        rows.append(torch.where(t < z - a, t + a, torch.full_like(t, -1)))
    token = torch.cat(rows) if rows else torch.zeros(0, dtype=torch.int64)
    return torch.tensor(first, dtype=torch.int32, device=device), token.to(device)


def _gather(x: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """Rows of x (T, ...) at `token`, zeros where token < 0; fp32."""
    keep = (token >= 0).view(-1, *([1] * (x.dim() - 1)))
    return x.float()[token.clamp(min=0)] * keep


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
    heads = torch.arange(hv, device=q.device) // (hv // q.shape[1])
    first, token = chunk_layout(edges, q.device)
    rows, dk = token.numel(), q.shape[2]
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
        part = token[a : a + span]
        ops = chunk_operands(
            _chunks(_gather(qf, part)[:, heads]),
            _chunks(_gather(kf, part)[:, heads]),
            _chunks(_gather(g, part)),
            _chunks(_gather(beta, part)),
            inverse=unit_lower_inverse,
        )
        for name in ("q_g", "k_g", "k_d", "t_beta", "p"):
            out[name][a : a + span] = _rows(ops[name])
        out["decay"][a // CHUNK : (a + span) // CHUNK] = ops["decay"]
    return out
