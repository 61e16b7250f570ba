"""Varlen on the chunked linear-attention backwards' kernel paths (Gated DeltaNet,
ops/gated_delta_rule_bwd.py; Kimi Delta Attention, ops/kda_bwd.py).

Their kernels read (B, T, heads, ...) tiles of B sequences of one length T. Unequal lengths on
the device passes (both ops' defaults) run IN SLOTS (`run_in_slots`, 2026-12-06): the layout is
the forward's chunk slots (kernels/linear_attention/gdn_prefill/sm90/config.py `first_slot`,
`t_slots`): S = T // C + N slots of C = 64 rows, chunk c of sequence n at slot bos_n // C + n +
c, sequence n owning [first_slot(bos_n, n), first_slot(eos_n, n + 1)), its ceil(len_n / C)
chunks and at most one more: the slots partition [0, S). The token inputs are copied in once
(`pack`, every row no token fills zero: k = v = 0, g = 0, beta = 0, dO = 0 change neither the
state nor a real gradient, and a zero chunk passes the state unchanged, e^0 = 1), the op's
kernel path runs on them as ONE sequence of S C tokens (the chunk-parallel kernels, under their
batch keys and code) with kernel 1, the state recurrences, in its `varlen` form (one CTA per
(value head, sequence) walking the slots it owns, longest first: `longest_first`); the token
gradients the kernels write at their token rows (NATIVE_STORES: the per-slot tables, the
`token_rows` keys) go straight to the caller's buffers, the rest are gathered back (`unpack`;
pack and unpack copy the rows as the widest integer words they split into, `word`). Every
table is made on the device from cu_seqlens: no host read, so a CUDA-graph capture takes this
path whatever the lengths, equal ones included (their batch path behind CUDA conditional nodes
gained nothing on the H100: docs/linear_attention/NOTES.md "next/capture-drop").

Eager calls read the offsets on the host once (`backward_varlen`): equal lengths stay the batch
path (a reshape, no copy; the same kernels and code as a call without cu_seqlens), no token
goes to the caller's interim path. The fallback forms without a varlen state launch (the
switches' torch factors; KDA's fp16 tiles) keep the BUCKETS of before (`buckets`,
`run_in_buckets`): sequences sorted by length, each bucket zero-padded to its longest, one
kernel-path call a bucket, a few host syncs a call, refused under capture by the caller.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import NamedTuple

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import first_slot, t_slots
from forgekernel.kernels.linear_attention.kda_prefill.sm90.launch import device_tables
from forgekernel.ops._dispatch import capturing

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


# docs/linear_attention/NOTES.md "next/varlen-stores" (its device A/B: "integration45 measured").
# True: an op whose slot-layout run can write its token gradients at their token rows
# (`run_in_slots`' `stores`: GDN's, kernel 2's `token_rows` key) gets the per-slot tables
# (`Slots.starts`, `lengths`) and the callers' out buffers, and only what it returns in the slot
# layout is unpacked. False: every token gradient unpacked (the path before).
NATIVE_STORES = True


class Slots(NamedTuple):
    """The slot layout of one varlen call (module docstring), all on the device."""

    cu_seqlens: torch.Tensor  # int32 (N + 1,)
    order: torch.Tensor  # int32 (N,): the sequences by their slots, most first
    rows: torch.Tensor  # int64 (T,): token i's row in the layout
    pad: torch.Tensor  # int64 (C S - T,): the rows no token fills
    count: int  # S = T // C + N slots (from the shapes alone)
    # `slot_tables` (NATIVE_STORES' runs only, else None): int32 (S,) each slot's first token and
    # its tokens (0 on a slot no token fills)
    starts: torch.Tensor | None = None
    lengths: torch.Tensor | None = None


def packed_rows(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """(T,) int64: token i of sequence n (bos_n <= i < eos_n) at row C first_slot(bos_n, n) +
    i - bos_n of the slot layout."""
    cu = cu_seqlens.long()
    i = torch.arange(tokens, device=cu.device)
    n = torch.searchsorted(cu[1:].contiguous(), i, right=True)  # empty sequences skipped
    bos = cu[n]
    return i - bos + CHUNK * first_slot(bos, n)


def pad_rows(cu_seqlens: torch.Tensor, tokens: int) -> torch.Tensor:
    """(C S - T,) int64: the rows no token fills, sequence n's C owned_n - len_n rows after its
    tokens, in order (their count from the shapes alone: the owned slots partition S)."""
    cu = cu_seqlens.long()
    n = cu.shape[0] - 1
    lens = cu[1:] - cu[:-1]
    first = first_slot(cu[:-1], torch.arange(n, device=cu.device))
    gap = CHUNK * owned_slots(cu) - lens
    ends = gap.cumsum(0)
    j = torch.arange(CHUNK * t_slots(tokens, n) - tokens, device=cu.device)
    s = torch.searchsorted(ends, j, right=True)
    return CHUNK * first[s] + lens[s] + j - (ends[s] - gap[s])


def owned_slots(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N,) int64: the slots sequence n owns, eos_n // C - bos_n // C + 1 (its chain in kernel
    1's varlen form): ceil(len_n / C) or one more."""
    cu = cu_seqlens.long()
    return cu[1:] // CHUNK - cu[:-1] // CHUNK + 1


def longest_first(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """(N,) int32: the sequences by owned slots, most first (ties in order): kernel 1's CTAs
    take them so, the longest chains start in the first wave."""
    return torch.argsort(owned_slots(cu_seqlens), descending=True, stable=True).to(torch.int32)


def slot_tables(cu_seqlens: torch.Tensor, count: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(starts, lengths) int32 (S,) of the slot layout (S = `count`): slot s of sequence n (s -
    first_slot(bos_n, n) = c) starts at token bos_n + C c and holds min(eos_n - that, C) tokens,
    0 past them. The KDA forward's chunk tables (kda_prefill launch.py `device_tables`) over
    each sequence's owned slots instead of ceil(len / C) chunks: the exclusive sum of
    `owned_slots` is first_slot(bos_n, n) (their sum is S: the slots partition). No host read.
    Token i at slot s, row r: packed row C s + r (`packed_rows`), i = starts[s] + r."""
    cu = cu_seqlens.to(torch.int32).contiguous()
    _, starts, lengths = device_tables(cu, count, owned_slots(cu).to(torch.int32))
    return starts, lengths


def slot_layout(cu_seqlens: torch.Tensor, tokens: int, tables: bool = False) -> Slots:
    """The layout of `tokens` tokens behind cu_seqlens (N + 1,): no host read; `tables`: with
    the per-slot tables (`slot_tables`)."""
    cu = cu_seqlens.to(torch.int32).contiguous()
    n = cu.shape[0] - 1
    count = t_slots(tokens, n)
    starts, lengths = slot_tables(cu, count) if tables else (None, None)
    return Slots(cu, longest_first(cu), packed_rows(cu, tokens), pad_rows(cu, tokens), count,
                 starts, lengths)  # fmt: skip


# The integer words `pack` / `unpack` copy a row in, widest first: torch's index kernels move one
# element a thread (its offsets worked out per element), and the 2-byte elements' ~2.7 GB at GDN
# 4 x 8192 hv32 took ~1.9 ms under capture (the H100 bench, 2026-12-06: ~1.4 TB/s, inferred from
# the gap to the batch path); 8-byte words move 4x the bytes a thread (NOTES "Varlen slots at
# equal lengths").
WORDS = (torch.int64, torch.int32, torch.int16)


def word(*xs: torch.Tensor) -> torch.dtype | None:
    """The widest of WORDS no narrower than the xs' elements that every x can be viewed as
    (`Tensor.view(dtype)`: a unit last stride, the last size, the other strides and the storage
    offset multiples of the word's elements; 2-D at least: a word splits the last dimension,
    never a row; the data pointer a multiple of the word's bytes: the index kernels load words
    there); None: none (the xs copied as they are), also where the xs' dtypes differ (torch's
    index ops then refuse them as before, where words would copy one dtype's bits into
    another's buffer, or half of them into a wider one: next/int44-review-ops)."""
    if len({x.dtype for x in xs}) > 1:
        return None
    for w in WORDS:
        ratios = [w.itemsize // x.element_size() for x in xs]
        if min(ratios) >= 1 and all(
            x.dim() > 1 and x.stride(-1) == 1 and x.storage_offset() % r == 0
            and x.data_ptr() % w.itemsize == 0
            and all(n % r == 0 for n in (x.shape[-1], *x.stride()[:-1]))
            for x, r in zip(xs, ratios)
        ):  # fmt: skip
            return w
    return None


def as_words(x: torch.Tensor, w: torch.dtype | None) -> torch.Tensor:
    """x viewed as `w` words (x itself for None)."""
    return x if w is None else x.view(w)


def pack(x: torch.Tensor, slots: Slots) -> torch.Tensor:
    """x (T, ...) in the slot layout (S C, ...): the rows no token fills are zero (written
    alone: a zero fill of the whole buffer first would write 64 S rows twice, ~0.15 ms of 3 at
    GDN's mix16 on the H100); both copied as the widest words the rows allow (`word`)."""
    out = x.new_empty(slots.count * CHUNK, *x.shape[1:])
    w = word(x, out)
    as_words(out, w).index_copy_(0, slots.rows, as_words(x, w)).index_fill_(0, slots.pad, 0)
    return out


def unpack(x: torch.Tensor, slots: Slots, out: torch.Tensor | None = None) -> torch.Tensor:
    """The token rows (T, ...) of x (S C, ...), into `out` (contiguous, x's dtype) when given;
    copied as the widest words the rows allow (`word`)."""
    if out is None:
        out = x.new_empty(slots.rows.shape[0], *x.shape[1:])
    w = word(x, out)
    torch.index_select(as_words(x, w), 0, slots.rows, out=as_words(out, w))
    return out


def into(out: torch.Tensor | None, x: torch.Tensor) -> torch.Tensor:
    """x, copied into `out` where given and not already there."""
    if out is None or (x.data_ptr() == out.data_ptr() and x.stride() == out.stride()):
        return x if out is None else out
    return out.copy_(x)


def run_in_slots(
    run: Callable[..., Grads],
    tokens: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor,
    out: Sequence[torch.Tensor | None] | None = None,
    stores: bool = False,
) -> Grads:
    """`run(*packed_tokens, *states, slots)` once on the slot layout (module docstring):
    `tokens` the flat (T, ...) inputs (their gradients, in the same order, are `run`'s first
    len(tokens) - 1 outputs: dO, the last, has none), `states` (N, ...) or None as given.
    `run` returns the token gradients (S C, ...) in the slot layout and the state gradient (N,
    ...); returned: the token gradients gathered back to the callers' rows and the state
    gradient, into `out` (the flat token gradients' buffers and the state's, each may be None)
    where given. `stores` (with NATIVE_STORES): `run` can write token gradients at their token
    rows: it gets `slots` with the per-slot tables and `out=` the buffers, and a gradient it
    returns with T rows (never S C: S C > T) is taken as it is (in its buffer), only the
    others unpacked."""
    t = tokens[0].shape[0]
    native = stores and NATIVE_STORES
    slots = slot_layout(cu_seqlens, t, tables=native)
    given = list(out) if out is not None else [None] * len(tokens)
    kw = {"out": given} if native else {}
    res = run(*(pack(x, slots) for x in tokens), *states, slots, **kw)
    grads = [into(o, g) if g.shape[0] == t else unpack(g, slots, o)
             for g, o in zip(res[:-1], given)]  # fmt: skip
    return (*grads, into(given[-1], res[-1]))


def backward_varlen(
    run: Callable[..., Grads],
    tokens: Sequence[torch.Tensor],
    states: Sequence[torch.Tensor | None],
    cu_seqlens: torch.Tensor,
    out: Sequence[torch.Tensor | None] | None = None,
    in_slots: Callable[..., Grads] | None = None,
    stores: bool = False,
) -> Grads | None:
    """Both ops' varlen backward on their kernel paths. Under a CUDA-graph capture: one call of
    `in_slots` (`run_in_slots`, whatever the lengths; the caller refuses the capture first
    where it has none). Eager: the offsets read on the host (one sync); equal lengths one call
    of `run` on the tokens as they are (a reshape, no copy), unequal ones `in_slots` where
    given, else `run` in buckets (`run_in_buckets`); None (the caller's interim path) when no
    sequence has a token. `run`, `tokens`, `states`, `out` as `run_in_buckets`' (`run` takes
    `out` as a keyword); `in_slots`, `stores` as `run_in_slots`' `run`, `stores`."""
    if in_slots is not None and capturing(tokens[0]):
        return run_in_slots(in_slots, tokens, states, cu_seqlens, out, stores)
    edges = [int(e) for e in cu_seqlens.tolist()]
    lens = [z - a for a, z in zip(edges[:-1], edges[1:])]
    if max(lens) == 0:
        return None
    if all(x == lens[0] for x in lens):
        return run(*tokens, *states, len(lens), out=out)
    if in_slots is not None:
        return run_in_slots(in_slots, tokens, states, cu_seqlens, out, stores)
    return run_in_buckets(run, tokens, states, edges, out)
