"""Varlen on the chunked linear-attention backwards' equal-length kernel paths (Gated DeltaNet,
ops/gated_delta_rule_bwd.py; Kimi Delta Attention, ops/kda_bwd.py).

Their kernels read (B, T, heads, ...) tiles of B sequences of one length T: kernel 1 runs one
CTA per (sequence, value head) through the chunks of its row. Sequences of unequal lengths
(the offsets read on the host, one sync a call) are zero-padded at their ends, where a zero
row (k = v = 0, g = 0, beta = 0) changes neither the state nor a real gradient, and grouped
into buckets (`buckets`): the sequences sorted by length, longest first, each bucket taking
the next ones while its padded chunks stay within WASTE times its real chunks. One kernel-path
call a bucket (`run_in_buckets`), its gradients scattered back to the callers' token rows and
sequences. Before 2026-12-06 the sequences were padded to the longest one in a single call,
and a call whose padding passed 4x (one long sequence among short ones: the suites' mixes,
5.9x and 22x) took the interim path (H100, 2026-12-06: gdn_bwd's mixes 60 and 127 ms, against
6.5 ms for 4 x 8192 tokens on the kernel path).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

CHUNK = 64  # the kernels' chunk (tokens)
# padded chunks / real chunks a bucket may reach: each bucket is one more pass of launches
# (host ~0.6 ms a call, 2026-12-06) against at most WASTE - 1 of its chunks' time in padding
WASTE = 1.5
# and its longest / its shortest sequence (chunks): the slack two long sequences leave must not
# pad a short one to their length (the suites' mix64: 3 chunks padded to 193)
SPREAD = 4


def chunks(length: int) -> int:
    """The chunks a sequence takes on the kernel path (a sequence without tokens still pads to
    one: its state gradient passes through the padding unchanged)."""
    return max(1, -(-length // CHUNK))


def buckets(lens: Sequence[int], waste: float = WASTE) -> list[list[int]]:
    """The sequences (indices into `lens`) grouped for padding: sorted longest first, a bucket
    opened by its longest sequence (m chunks) takes the next ones while (its size) x m <=
    `waste` x (its sequences' chunks) and each has at least m / SPREAD chunks. Every index
    once; a bucket's sequences longest first."""
    order = sorted(range(len(lens)), key=lambda i: -lens[i])
    out: list[list[int]] = []
    i = 0
    while i < len(order):
        width, real, j = chunks(lens[order[i]]), 0, i
        while j < len(order):
            c = chunks(lens[order[j]])
            if (j - i + 1) * width > waste * (real + c) or c * SPREAD < width:
                break
            real += c
            j += 1
        out.append(order[i:j])
        i = j
    return out


Grads = tuple[torch.Tensor, ...]


def run_in_buckets(
    run: Callable[..., Grads],
    tokens: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None],
    edges: Sequence[int],
    out: Sequence[torch.Tensor | None] | None = None,
) -> Grads:
    """`run(*padded_tokens, *states_of_the_bucket, n)` on each bucket of the sequences between
    `edges` (host offsets, N + 1): `tokens` the flat (T, ...) inputs (their gradients, in the
    same order, are `run`'s first len(tokens) - 1 outputs: the last token input, dO, has
    none), `states` (N, ...) or None (taken at the bucket's sequences), n the bucket's
    sequences, each padded to the bucket's longest. `run` returns the token gradients flat
    (n x t, ...) and the state gradient (n, ...); returned: the token gradients at the callers'
    rows and the state gradient at the callers' sequences, scattered into `out` (the flat
    token gradients' buffers and the state's, each may be None) where given."""
    device = tokens[0].device
    lens = [z - a for a, z in zip(edges[:-1], edges[1:])]
    given = list(out) if out is not None else [None] * len(tokens)
    grads: list[torch.Tensor] = [x.new_zeros(x.shape) if o is None else o.zero_()
                                 for x, o in zip(tokens[:-1], given)]  # fmt: skip
    d_state: torch.Tensor | None = given[-1]
    for seqs in buckets(lens):
        t = max(1, lens[seqs[0]])
        n = len(seqs)
        pos = torch.arange(t)
        seq_lens = torch.tensor([lens[i] for i in seqs])
        valid = (pos < seq_lens.unsqueeze(1)).flatten()
        starts = torch.tensor([edges[i] for i in seqs])
        rows = (starts.unsqueeze(1) + pos).flatten()[valid].to(device)  # callers' token rows
        slots = valid.nonzero()[:, 0].to(device)  # their padded rows, in the same order
        index = torch.tensor(seqs, device=device)

        def pad(x, n=n, t=t, rows=rows, slots=slots):
            out = x.new_zeros(n * t, *x.shape[1:])
            out[slots] = x[rows]
            return out

        taken = (None if s is None else s.index_select(0, index) for s in states)
        res = run(*(pad(x) for x in tokens), *taken, n)
        for grad, got in zip(grads, res[:-1]):
            grad[rows] = got[slots]
        if d_state is None:
            d_state = res[-1].new_empty((len(lens), *res[-1].shape[1:]))
        d_state[index] = res[-1]
    assert d_state is not None  # edges hold at least one sequence
    return (*grads, d_state)


def backward_varlen(
    run: Callable[..., Grads],
    tokens: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor,
    out: Sequence[torch.Tensor | None] | None = None,
) -> Grads | None:
    """Both ops' varlen backward on their kernel paths: the offsets read on the host (the
    caller refuses a CUDA-graph capture first); equal lengths run as one call of `run` on the
    tokens as they are (a reshape, no copy), unequal ones in buckets (`run_in_buckets`); None
    (the caller's interim path) when no sequence has a token. `run`, `tokens`, `states`, `out`
    as `run_in_buckets`' (`run` takes `out` as a keyword)."""
    edges = [int(e) for e in cu_seqlens.tolist()]
    lens = [z - a for a, z in zip(edges[:-1], edges[1:])]
    if max(lens) == 0:
        return None
    if all(x == lens[0] for x in lens):
        return run(*tokens, *states, len(lens), out=out)
    return run_in_buckets(run, tokens, states, edges, out)
