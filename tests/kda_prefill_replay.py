"""A torch replay of the KDA recurrence kernel (kernels/linear_attention/kda_prefill/sm90/
recurrence.py), called with exactly the tensors the launcher passes it: per (sequence, value
head), chunk c read at global chunk first[n] + c (rows 64 (first[n] + c) ..), v read as the
TMA box does (rows bos + 64 c .., the next sequence's rows or zeros past T), S^T as a bf16 A
operand, V^T - X^T and U^T rounded to bf16, fp32 accumulation, O rounded to the output dtype
and stored only for rows inside the sequence. Not a test module (tests/test_kda_op.py)."""

from __future__ import annotations

import gdn_prefill_replay
import torch

from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import CHUNK
from forgekernel.reference.kda_chunked import chunk_operands

OPERAND = torch.bfloat16


def _bf16(x: torch.Tensor) -> torch.Tensor:
    return x.to(OPERAND).float()


def _v_box(v: torch.Tensor, row0: int) -> torch.Tensor:
    """(64, HV, V) rows row0 .. of v as the TMA box loads them: zeros past T."""
    box = torch.zeros(CHUNK, *v.shape[1:], dtype=torch.float32, device=v.device)
    rows = v[row0 : row0 + CHUNK].float()
    box[: rows.shape[0]] = rows
    return box


def kernel(params: dict):
    """A callable with the compiled kernel's signature."""

    def run(q_g, k_g, k_d, t_beta, p, decay, v, init, cu, first, out, final, warm=None):
        assert q_g.dtype == k_g.dtype == k_d.dtype == t_beta.dtype == p.dtype == OPERAND
        assert (init is not None) == params["initial_state"]
        assert (warm is not None) == params.get("warmup", False)
        edges = cu.tolist()
        warms = [0] * (len(edges) - 1) if warm is None else warm.tolist()
        hv = v.shape[1]
        for n, (a, z) in enumerate(zip(edges[:-1], edges[1:])):
            w = warms[n]  # chunks walked before row a (first[n] - w ..), their o not stored
            a -= w * CHUNK
            s = (
                torch.zeros(hv, 128, 128, device=v.device)
                if init is None
                else init[n].float().clone()
            )
            for c in range(-(-(z - a) // CHUNK)):
                gc = int(first[n]) - w + c
                r = slice(gc * CHUNK, (gc + 1) * CHUNK)
                kg, qg, kd = (x[r].float().transpose(0, 1) for x in (k_g, q_g, k_d))
                tb, pp = (x[r].float().transpose(0, 1) for x in (t_beta, p))
                vc = _v_box(v, a + c * CHUNK).transpose(0, 1)  # (HV, 64, V)
                s_op = _bf16(s)
                x = _bf16(vc - kg @ s_op)  # V - X, the next product's 16-bit operand
                u = _bf16(tb @ x)
                o = qg @ s_op + pp @ u
                s = s * decay[gc].float().unsqueeze(-1) + kd.transpose(-1, -2) @ u
                valid = min(z - a - c * CHUNK, CHUNK)
                if c < w:
                    continue
                out[a + c * CHUNK : a + c * CHUNK + valid] = o.transpose(0, 1)[:valid].to(out.dtype)
            final[n] = s

    return run


def intra_kernel(params: dict):
    """A callable with the first-pass kernel's (`intra.py`) signature: per chunk (its first
    token and length), the kernel's math (`chunk_operands` with its bf16 operand roundings:
    Kl E, Kr, Ql E before the products, the outputs after; the kernel, "rows8" since
    2026-12-03, rounds Kl, Kr E, Ql instead: the same two roundings a product on the other
    operand, not modelled here) written where the kernel writes; T by the tensor-core merges'
    model (gdn_prefill_replay.blocked_inverse: the lanes' fragments, tf32 roundings). With the
    bwd key (tt, big_g not None) those two as well, rows past the chunk's length zero, P^T
    written where P is, and W = T_beta Kg, u = T_beta V from the bf16 rows it wrote (fp32
    products, one rounding)."""

    def blocked(akk: torch.Tensor) -> torch.Tensor:  # (HV, 64, 64)
        return torch.stack([gdn_prefill_replay.blocked_inverse(a) for a in akk])

    def run(q, k, g, beta, starts, lengths, q_g, k_g, k_d, t_beta, p, decay, tt, big_g, v, w, u,
            scale):  # fmt: skip
        bwd = params.get("bwd", False)
        assert all((x is None) == (not bwd) for x in (tt, big_g, v, w, u))
        hv = g.shape[1]
        heads = torch.arange(hv, device=q.device) // (hv // q.shape[1])
        for gc, (t0, n) in enumerate(zip(starts.tolist(), lengths.tolist())):
            if n == 0:  # past the last real chunk: the kernel returns at once
                continue

            def rows(x, heads=None, t0=t0, n=n):
                y = torch.zeros(CHUNK, *x.shape[1:], dtype=torch.float32, device=x.device)
                y[:n] = x[t0 : t0 + n].float()
                y = y if heads is None else y[:, heads]
                return y.transpose(0, 1)  # (HV, 64, ...)

            ops = chunk_operands(rows(q, heads) * scale, rows(k, heads), rows(g), rows(beta),
                                 operand_dtype=OPERAND, inverse=blocked,
                                 bwd=tt is not None)  # fmt: skip
            r = slice(gc * CHUNK, (gc + 1) * CHUNK)
            for name, dst in (("q_g", q_g), ("k_g", k_g), ("k_d", k_d), ("t_beta", t_beta)):
                dst[r] = ops[name].transpose(0, 1).to(dst.dtype)
            pp = ops["p"] if tt is None else ops["p"].transpose(-1, -2)  # bwd: P^T into p
            p[r] = pp.transpose(0, 1).to(p.dtype)
            decay[gc] = ops["decay"]
            if tt is not None:
                tt[r] = 0
                big_g[r] = 0
                tt[r][:n] = ops["tt"].transpose(0, 1)[:n].to(tt.dtype)
                big_g[r][:n] = ops["big_g"].transpose(0, 1)[:n]
                tb = t_beta[r].float().transpose(0, 1)  # (HV, 64, 64) as written
                for dst, x in ((w, k_g[r].float().transpose(0, 1)),
                               (u, rows(v.to(torch.bfloat16)))):  # fmt: skip
                    dst[r] = (tb @ x).transpose(0, 1).to(dst.dtype)

    return run
