"""The varlen slot layout with its token gradients written at their token rows
(ops/_linattn_varlen.py NATIVE_STORES, TEMPORARY: off until this file passes on a GPU; the
`token_rows` keys of GDN kernel 2, KDA kernel 2 and the KDA WY kernel, candidate builds:
docs/linear_attention/NOTES.md "next/varlen-stores"), both ops (Gated DeltaNet, Kimi Delta
Attention): every gradient bit for bit the slot path's (the switch off), on unequal
lengths (empty, one-token and tail-cut sequences; eager: one host read, then the slot layout)
and on equal lengths under a capture (the only route of equal lengths into the slot layout),
one graph replayed with cu_seqlens rewritten in place, the op's out= buffers written in place;
no gradient unpacked. The 4 x 8192 graph replays with the switch off and on printed (`-s`)."""

from __future__ import annotations

import importlib

import pytest
import torch
from linattn_varlen import captured_outputs, problem

import forgekernel
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
OPS = {
    "gdn": (importlib.import_module("forgekernel.ops.gated_delta_rule_bwd"),
            forgekernel.gated_delta_rule_backward),
    "kda": (importlib.import_module("forgekernel.ops.kda_bwd"),
            forgekernel.kimi_delta_attention_backward),
}  # fmt: skip
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
MIXES = ([1, 0, 65, 64, 200, 0, 7, 1000], [300, 301, 295, 2], [8192, 5, 130])


def _cu(lens):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                        device="cuda")  # fmt: skip


def _equal(got, want, label):
    for name, a, r in zip(NAMES, got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, (label, name)
        assert torch.isfinite(r).all(), (label, name)
        assert torch.equal(a, r), (label, name, float((a.double() - r.double()).abs().max()))


@pytest.mark.parametrize("lens", MIXES)
@pytest.mark.parametrize(("h", "hv", "l2norm"), [(4, 4, False), (2, 4, False), (4, 4, True)])
@pytest.mark.parametrize("op", sorted(OPS))
def test_native_stores_are_the_slot_path(monkeypatch, op, lens, h, hv, l2norm):
    """Eager, unequal lengths (the slot layout): NATIVE_STORES on equals off bit for bit, the
    kernels writing the op's dq, dk (HV = H, no l2norm: GDN kernel 2's both, KDA's WY kernel's
    dk) or the epilogue reading the callers' q, k; nothing unpacked; into out= buffers in
    place."""
    bwd, backward = OPS[op]
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    args, h0, dht = problem(op, sum(lens), h, hv, len(lens), seed=len(lens), unit_k=not l2norm)
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": _cu(lens),
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip
    monkeypatch.setattr(varlen, "NATIVE_STORES", False)
    want = backward(*args, **kw)
    unpacked = []
    real = varlen.unpack
    monkeypatch.setattr(varlen, "unpack", lambda *a: unpacked.append(1) or real(*a))
    monkeypatch.setattr(varlen, "NATIVE_STORES", True)
    _equal(backward(*args, **kw), want, lens)
    assert unpacked == []
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    got = backward(*args, out=out, **kw)
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    _equal(out, want, (lens, "out="))


@pytest.mark.parametrize(("op", "dtype"), [("gdn", torch.bfloat16), ("gdn", torch.float16),
                                           ("kda", torch.bfloat16)])  # fmt: skip
def test_native_stores_in_passes_and_fp16(monkeypatch, op, dtype):
    """The corners the test above leaves: GDN's fp16 `token_rows` key (KDA's device pass, hence
    its slot layout, is bf16 only), value heads in several passes (TOKEN_HEADS_PER_PASS cut to
    one head a pass: each pass's kernels allocate their own T-row outputs, joined after) and
    empty first and last sequences: the native route taken (the per-slot tables made),
    NATIVE_STORES on equals off bit for bit, nothing unpacked, out= (NaN-filled) written in
    place (next/int45-review)."""
    bwd, backward = OPS[op]
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 1)
    lens = [0, 130, 1, 64, 0]
    args, h0, dht = problem(op, sum(lens), 2, 4, len(lens), seed=5, unit_k=True)
    args = [x.to(dtype) if x.dtype == torch.bfloat16 else x for x in args]
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": _cu(lens)}
    monkeypatch.setattr(varlen, "NATIVE_STORES", False)
    want = backward(*args, **kw)
    unpacked, tables = [], []
    real, real_tables = varlen.unpack, varlen.slot_tables
    monkeypatch.setattr(varlen, "unpack", lambda *a: unpacked.append(1) or real(*a))
    monkeypatch.setattr(varlen, "slot_tables", lambda *a: tables.append(1) or real_tables(*a))
    monkeypatch.setattr(varlen, "NATIVE_STORES", True)
    _equal(backward(*args, **kw), want, (op, dtype))
    assert unpacked == [] and tables == [1]
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    got = backward(*args, out=out, **kw)
    assert all(a.data_ptr() == o.data_ptr() for a, o in zip(got, out))
    _equal(out, want, (op, dtype, "out="))


@pytest.mark.parametrize(("h", "hv", "l2norm"), [(2, 4, True), (4, 4, False)])
@pytest.mark.parametrize("op", sorted(OPS))
def test_one_graph_with_native_stores(monkeypatch, op, h, hv, l2norm):
    """One graph each way (switch off, switch on), captured at equal lengths and replayed with
    cu_seqlens rewritten in place (equal, unequal, a tail, equal): every replay's gradients bit
    for bit between the two graphs (both the slot layout; equal lengths reach it only so)."""
    bwd, backward = OPS[op]
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    args, h0, dht = problem(op, 400, h, hv, 2, seed=31, unit_k=not l2norm)
    cu = torch.tensor([0, 200, 400], dtype=torch.int32, device="cuda")
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": cu,
          "use_qk_l2norm_in_kernel": l2norm}  # fmt: skip

    def call():
        return backward(*args, **kw)

    graphs = {}
    for native in (False, True):
        monkeypatch.setattr(varlen, "NATIVE_STORES", native)
        graphs[native] = captured_outputs(call)
    for edges in ([0, 200, 400], [0, 137, 400], [0, 64, 400], [0, 200, 400]):
        cu.copy_(torch.tensor(edges))
        for graph, _ in graphs.values():
            graph.replay()
        torch.cuda.synchronize()
        _equal(graphs[True][1], graphs[False][1], edges)


@pytest.mark.parametrize(("op", "hv"), [("gdn", 32), ("gdn", 16), ("kda", 16)])
def test_time_native_stores(monkeypatch, op, hv):
    """4 x 8192 tokens, H 16, l2norm off (the bench's batch cases in their cu_seqlens form):
    graph replays (the slot layout) with the switch off and on, printed; the two bit for bit.
    Predicted (NOTES "next/varlen-stores"): on below off by ~0.36 ms (GDN hv32), ~0.27 (GDN
    hv16), ~0.45 (KDA hv16) (the 2026-12-06 bench's graph: 5.94 / 3.16 / 6.11 ms). GDN's
    fused slot route off (FUSED_SLOTS, the default since 2026-12-07, takes 4 x 32 CTAs, with
    the switch on only: it needs the token-row tables): both graphs the two-launch slot path."""
    bwd, backward = OPS[op]
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setenv(OPS["gdn"][0].FUSED_SLOTS_SWITCH, "0")
    args, h0, dht = problem(op, 4 * 8192, 16, hv, 4, seed=13, unit_k=True)
    cu = torch.arange(5, dtype=torch.int32, device="cuda") * 8192
    kw = {"initial_state": h0, "d_final_state": dht, "cu_seqlens": cu}
    times, grads = {}, {}
    for native in (False, True):
        monkeypatch.setattr(varlen, "NATIVE_STORES", native)
        out = tuple(torch.empty_like(x) for x in (*args[:5], h0))

        def call(out=out):
            return backward(*args, out=out, **kw)

        samples = time_ms(call, reps=10)  # CUDA-graph replays (the bench's graph timing)
        assert samples.method == "cuda-graph", samples.note
        times[native] = median(samples)
        grads[native] = out
    _equal(grads[True], grads[False], "4 x 8192")
    print(f"\n{op} backward 4 x 8192 h16 hv{hv} bf16, cu_seqlens at equal lengths, graph in "
          f"slots: NATIVE_STORES off {times[False]:.3f} ms, on {times[True]:.3f} ms "
          f"({times[False] - times[True]:+.3f})")  # fmt: skip
