"""Varlen on the linear-attention backwards' kernel paths (ops/_linattn_varlen.py): the slot
layout's tables (the forward's chunk slots) on random lengths, empty sequences and lengths 1, 63,
64, 65, the pack / unpack round trip and the routing; the fallback buckets' grouping invariants
and their padding / scatter round trip."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from forgekernel.ops import _linattn_varlen as varlen


def _check(lens, groups, waste=varlen.WASTE):
    assert sorted(i for g in groups for i in g) == list(range(len(lens)))
    for g in groups:
        widths = [varlen.chunks(lens[i]) for i in g]
        assert widths == sorted(widths, reverse=True)
        assert len(g) * widths[0] <= waste * sum(widths)
        assert widths[-1] * varlen.SPREAD >= widths[0]


@pytest.mark.parametrize("seed", range(6))
def test_buckets_hold_their_waste(seed):
    rnd = random.Random(seed)
    lens = [rnd.choice([0, 1, 7, 63, 64, 65, 300, 2048, 9000]) for _ in range(rnd.randint(1, 70))]
    _check(lens, varlen.buckets(lens))


def test_buckets_of_the_suites_forms():
    assert varlen.buckets([70, 70, 70]) == [[0, 1, 2]]
    assert varlen.buckets([600] + [1] * 10) == [[0], list(range(1, 11))]  # one long, many short
    assert len(varlen.buckets([64 * 2**i for i in range(9)])) == 5  # doublings: in pairs
    assert len(varlen.buckets([0, 0, 1])) == 1  # empty sequences pad to one chunk
    # two long sequences' slack does not take a short one (the suites' mix64 before SPREAD)
    assert varlen.buckets([12297, 12296, 141, 130]) == [[0, 1], [2, 3]]


def test_padding_round_trip():
    """A `run` that hands back its padded inputs and states: every caller's row and sequence
    comes back in place; the padding rows are zero."""
    lens = [5, 0, 130, 64, 1, 66]
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    x = torch.randn(edges[-1], 3)
    y = torch.randn(edges[-1], 2).bfloat16()
    do = torch.randn(edges[-1], 3)
    state = torch.randn(len(lens), 4)
    seen = []

    def run(x, y, do, state, n):
        seen.append(n)
        assert x.shape[0] % n == 0 and state.shape[0] == n
        t = x.shape[0] // n
        pad = x.reshape(n, t, 3)
        # the padding: exactly the rows past each sequence's length are zero
        assert int((pad.abs().sum(-1) == 0).sum()) >= n * t - int(do.abs().sum(-1).ne(0).sum())
        return x, y, state * 2

    gx, gy, gs = varlen.run_in_buckets(run, (x, y, do), (state,), edges)
    assert sum(seen) == len(lens) and len(seen) == len(varlen.buckets(lens))
    assert torch.equal(gx, x) and torch.equal(gy, y) and gy.dtype == y.dtype
    assert torch.equal(gs, state * 2)


def test_a_missing_state_stays_none():
    edges = [0, 3, 10]
    x = torch.randn(10, 2)

    def run(x, do, state, n, out=None):
        assert state is None
        return x, torch.zeros(n, 1)

    gx, gs = varlen.run_in_buckets(run, (x, x), (None,), edges)
    assert torch.equal(gx, x) and gs.shape == (2, 1)


def test_backward_varlen_routes(monkeypatch):
    """Equal lengths: one call on the tokens as they are (no copy); no token: None (the
    caller's interim path); unequal: the slot layout where the caller has it, else the buckets;
    under a CUDA-graph capture the slot layout with no host read, whatever the lengths."""
    x = torch.randn(12, 2)
    calls = []

    def run(x, do, state, n, out=None):
        calls.append((x.data_ptr(), n))
        return x, torch.zeros(n, 1)

    def in_slots(x, do, state, slots):
        calls.append(("slots", x.shape[0]))
        return x, torch.zeros(slots.cu_seqlens.shape[0] - 1, 1)

    equal = torch.tensor([0, 4, 8, 12], dtype=torch.int32)
    gx, gs = varlen.backward_varlen(run, (x, x), (None,), equal, in_slots=in_slots)
    assert calls == [(x.data_ptr(), 3)] and gx is x and gs.shape == (3, 1)
    assert varlen.backward_varlen(run, (x[:0], x[:0]), (None,), torch.zeros(3)) is None
    calls.clear()
    unequal = torch.tensor([0, 1, 12])
    gx, _ = varlen.backward_varlen(run, (x, x), (None,), unequal)
    assert torch.equal(gx, x) and len(calls) == len(varlen.buckets([1, 11]))
    calls.clear()
    gx, gs = varlen.backward_varlen(run, (x, x), (None,), unequal, in_slots=in_slots)
    assert calls == [("slots", 64 * (12 // 64 + 2))] and torch.equal(gx, x) and gs.shape == (2, 1)
    calls.clear()
    monkeypatch.setattr(varlen, "capturing", lambda t: True)
    no_read = SimpleNamespace(tolist=lambda: pytest.fail("host read"), shape=equal.shape,
                              to=lambda dtype: equal)  # fmt: skip
    gx, _ = varlen.backward_varlen(run, (x, x), (None,), no_read, in_slots=in_slots)
    assert calls == [("slots", 64 * (12 // 64 + 3))] and torch.equal(gx, x)


def _random_lens(seed: int) -> list[int]:
    rnd = random.Random(seed)
    pick = [0, 1, 7, 63, 64, 65, 127, 128, 129, 300, 1000]
    return [rnd.choice(pick) for _ in range(rnd.randint(1, 40))]


LENGTHS = [[1], [63], [64], [65], [0, 1], [1, 0], [0, 0, 5], [63, 64, 65], [64, 64],
           [1, 63, 0, 64, 65, 130], *(_random_lens(s) for s in range(8))]  # fmt: skip


@pytest.mark.parametrize("lens", LENGTHS)
def test_slot_tables(lens):
    """The slot layout's tables (`slot_layout`) against their definition, computed on the host
    here: sequence n owns [bos_n // 64 + n, eos_n // 64 + n + 1), the slots partition [0, S),
    S = T // 64 + N; its chunk c is slot bos_n // 64 + n + c and its tokens fill the slots' rows
    from the first in order (token i at row 64 (bos_n // 64 + n) + i - bos_n); it owns its
    ceil(len / 64) chunks and at most one more (an empty sequence one zero slot); the order
    lists every sequence once, owned slots not increasing."""
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(edges, dtype=torch.int32)
    t, n = edges[-1], len(lens)
    slots = varlen.slot_layout(cu, t)
    assert slots.count == t // 64 + n
    assert slots.rows.dtype == torch.int64 and slots.rows.shape == (t,)
    assert slots.order.dtype == torch.int32 and slots.cu_seqlens.dtype == torch.int32
    owned = varlen.owned_slots(cu).tolist()
    rows = slots.rows.tolist()
    at = 0
    for i, (a, z) in enumerate(zip(edges[:-1], edges[1:])):
        first = a // 64 + i
        assert first == at and owned[i] == z // 64 + i + 1 - first
        assert -(-(z - a) // 64) <= owned[i] <= -(-(z - a) // 64) + 1 and owned[i] >= 1
        assert rows[a:z] == list(range(64 * first, 64 * first + z - a))
        at = first + owned[i]
    assert at == slots.count  # the partition's end
    assert len(set(rows)) == t and all(0 <= r < 64 * slots.count for r in rows)
    pad = slots.pad.tolist()  # the complement, in order
    assert slots.pad.dtype == torch.int64
    assert pad == sorted(set(range(64 * slots.count)) - set(rows))
    order = slots.order.tolist()
    assert sorted(order) == list(range(n))
    assert [owned[i] for i in order] == sorted(owned, reverse=True)


@pytest.mark.parametrize("lens", LENGTHS)
def test_per_slot_tables(lens):
    """`slot_tables` (the KDA forward's `device_tables` over the owned slots, no host read):
    every slot's first token and token count, int32 (S,); token i at slot s, row r of the
    layout (`packed_rows`) is starts[s] + r with r < lengths[s], the lengths sum to T (every
    token once), a slot no token fills has length 0. With `tables` the layout carries them,
    without it None (the landed path builds none)."""
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    cu = torch.tensor(edges, dtype=torch.int32)
    t = edges[-1]
    slots = varlen.slot_layout(cu, t, tables=True)
    assert varlen.slot_layout(cu, t).starts is None
    starts, lengths = slots.starts, slots.lengths
    assert starts.dtype == lengths.dtype == torch.int32
    assert starts.shape == lengths.shape == (slots.count,)
    s, r = slots.rows // 64, slots.rows % 64
    assert torch.equal(starts.long()[s] + r, torch.arange(t))
    assert bool((r < lengths.long()[s]).all()) and int(lengths.sum()) == t
    assert bool(((lengths >= 0) & (lengths <= 64)).all())
    filled = torch.zeros(slots.count, dtype=torch.bool)
    filled[s] = True
    assert torch.equal(lengths > 0, filled)


def test_run_in_slots_takes_token_rows_as_they_are(monkeypatch):
    """`run_in_slots` with `stores` and NATIVE_STORES: `run` gets the tables and `out=` the
    buffers; a gradient it returns at the T token rows is taken as it is (in its buffer, or
    copied there), one in the slot layout unpacked as before; `stores` alone or the switch
    alone change nothing (no tables, no out=)."""
    lens = [5, 0, 130, 64, 1, 66]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x, y, do = torch.randn(266, 3), torch.randn(266, 2), torch.randn(266, 3)
    seen = []

    def run(x, y, do, state, slots, out=None):
        seen.append((slots.starts is not None, out is not None))
        if out is None:
            return x * 2, y + 1, state
        gx = out[0] if out[0] is not None else x.new_empty(266, 3)
        gx[...] = varlen.unpack(x, slots) * 2  # the caller's rows, written natively
        return gx, y + 1, state  # y's in the slot layout: unpacked

    state = torch.randn(len(lens), 4)
    for native, stores in ((False, True), (True, False), (True, True)):
        monkeypatch.setattr(varlen, "NATIVE_STORES", native)
        seen.clear()
        out = (torch.empty(266, 3), torch.empty(266, 2), torch.empty(len(lens), 4))
        gx, gy, gs = varlen.run_in_slots(run, (x, y, do), (state,), cu, out, stores)
        assert seen == [(native and stores,) * 2]
        assert gx is out[0] and gy is out[1] and gs is out[2]
        assert torch.equal(gx, x * 2) and torch.equal(gy, y + 1) and torch.equal(gs, state)
    gx, gy, _ = varlen.run_in_slots(run, (x, y, do), (state,), cu, None, True)
    assert torch.equal(gx, x * 2) and torch.equal(gy, y + 1)


@pytest.mark.parametrize("lens", LENGTHS[:10])
def test_pack_round_trip(lens):
    """`pack` puts every token at its row and zero everywhere else; `unpack` brings back the
    tokens (also into a given buffer), dtypes kept."""
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    t = edges[-1]
    slots = varlen.slot_layout(torch.tensor(edges), t)
    x = torch.randn(t, 3, 2).bfloat16() + 5  # no zero entry
    packed = varlen.pack(x, slots)
    assert packed.shape == (64 * slots.count, 3, 2) and packed.dtype == x.dtype
    assert int(packed.ne(0).any(-1).any(-1).sum()) == t
    assert torch.equal(packed[slots.rows], x)
    assert torch.equal(varlen.unpack(packed, slots), x)
    buf = torch.empty_like(x)
    assert varlen.unpack(packed, slots, buf) is buf and torch.equal(buf, x)


def test_run_in_slots_hands_over_the_states():
    """`run_in_slots`: the packed tokens and the states as given reach `run` with the layout;
    the token gradients come back at the callers' rows, into `out` where given, the state's
    copied into its buffer."""
    lens = [5, 0, 130, 64, 1, 66]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    x, do = torch.randn(266, 3), torch.randn(266, 3)
    state = torch.randn(len(lens), 4)

    def run(x, do, state, missing, slots):
        assert missing is None and x.shape[0] == 64 * slots.count
        return x * 2, state + 1

    out = (torch.empty(266, 3), torch.empty(len(lens), 4))
    gx, gs = varlen.run_in_slots(run, (x, do), (state, None), cu, out)
    assert gx is out[0] and gs is out[1]
    assert torch.equal(gx, x * 2) and torch.equal(gs, state + 1)


@pytest.mark.parametrize(
    ("shape", "dtype", "cut", "want"),
    [((5, 4, 128), torch.bfloat16, None, torch.int64),  # q, v: 256 B rows
     ((5, 32), torch.float32, None, torch.int64),  # g, beta at HV 32
     ((5, 1), torch.float32, None, torch.int32),  # HV 1: a word a row
     ((5, 3, 2), torch.bfloat16, None, torch.int32),
     ((5, 3), torch.bfloat16, None, torch.int16),  # odd rows: elements as they are
     ((5, 6, 8), torch.bfloat16, "heads", torch.int64),  # a head slice at a 16-byte offset
     ((5, 6, 8), torch.bfloat16, "odd", torch.int16),  # a slice at a 2-byte one
     ((5, 3), torch.float64, None, torch.int64),
     ((5, 8), torch.uint8, None, torch.int64),
     ((40,), torch.bfloat16, None, None)],  # 1-D: the words would straddle rows
)  # fmt: skip
def test_word(shape, dtype, cut, want):
    """`word`: the widest integer word every row splits into; the view copies bit for bit."""
    x = torch.arange(torch.Size(shape).numel()).reshape(shape).to(dtype)
    if cut == "heads":
        x = x[:, 1:5]
    elif cut == "odd":
        x = x.flatten(1)[:, 1:9]
    assert varlen.word(x) == want
    if want is not None:
        assert torch.equal(varlen.as_words(x, want).view(dtype), x)


def test_word_needs_one_dtype_and_an_aligned_pointer():
    """`word`: rows of different dtypes get no word (an index op across them must refuse, not
    copy one dtype's bits into the other's buffer), nor a pointer off the word's bytes (a view
    torch allows at storage offset 0 of a storage that starts off them)."""
    x = torch.zeros(4, 8, dtype=torch.bfloat16)
    assert varlen.word(x, x.half()) is None and varlen.word(x, x.float()) is None
    assert varlen.word(x, x.clone()) == torch.int64
    raw = torch.frombuffer(bytearray(2 + 4 * 8 * 2), dtype=torch.bfloat16, offset=2)
    y = raw.view(4, 8)  # storage offset 0, the data 2 bytes past an 8-byte boundary
    assert y.storage_offset() == 0 and y.data_ptr() % 8 == 2
    assert varlen.word(y) == torch.int16


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unpack_into_another_dtype_raises(dtype):
    """`unpack` into an out= of another dtype raises as torch.index_select does (before the
    words: the same error), not a silent bit copy (fp16) or a half-filled resized view (fp32)."""
    edges = torch.tensor([0, 3, 70], dtype=torch.int32)
    slots = varlen.slot_layout(edges, 70)
    packed = varlen.pack(torch.randn(70, 4, 8).bfloat16(), slots)
    with pytest.raises(RuntimeError, match="same scalar type"):
        varlen.unpack(packed, slots, torch.zeros(70, 4, 8, dtype=dtype))


@pytest.mark.parametrize("lens", [[5, 0, 130, 64, 1, 66], [64, 64]])
def test_pack_unpack_as_words(lens):
    """`pack` / `unpack` on strided head slices, odd widths, fp32 and 16-bit rows and into an
    offset buffer: the tokens at their rows, zeros elsewhere, bit for bit (NaN payloads and
    -0.0 included: the words are copied, not the values)."""
    edges = [0, *torch.tensor(lens).cumsum(0).tolist()]
    t = edges[-1]
    slots = varlen.slot_layout(torch.tensor(edges), t)
    fused = torch.randn(t, 3 * 4, 16).bfloat16()
    fused[0, 0, :2] = torch.tensor([float("nan"), -0.0])
    for x in (fused[:, 4:8], fused[:, 1:2, :3], torch.randn(t, 1), torch.randn(t, 7).half()):
        packed = varlen.pack(x, slots)
        assert packed.shape == (64 * slots.count, *x.shape[1:]) and packed.dtype == x.dtype
        bits = varlen.as_words(packed.contiguous(), torch.int16 if x.element_size() == 2
                               else torch.int32)  # fmt: skip
        assert int(bits.flatten(1).ne(0).any(-1).sum()) <= t
        assert torch.equal(bits[slots.pad], torch.zeros_like(bits[slots.pad]))
        back = varlen.unpack(packed, slots)
        assert back.view(torch.uint8).equal(x.contiguous().view(torch.uint8))
        buf = torch.empty(t * packed[0].numel() + 1, dtype=x.dtype)[1:].view(t, *x.shape[1:])
        assert varlen.unpack(packed, slots, buf) is buf
        assert buf.view(torch.uint8).equal(x.contiguous().view(torch.uint8))
