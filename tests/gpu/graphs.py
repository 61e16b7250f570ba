"""CUDA-graph helpers of the GPU tests: a capture after a warm-up on a side stream, and the
programmatic-dependent-launch chain check (runtime/pdl.py) the decode ops' tests share."""

from __future__ import annotations

import importlib
from collections.abc import Callable
from typing import Any

import torch

CHAIN = 8  # calls of a chain


def captured(step: Callable[[], Any]) -> torch.cuda.CUDAGraph:
    """`step` run once on a side stream (its first calls' plans, scratch and compiles outside
    the capture, as torch's capture docs ask), then captured; the current stream waits for the
    warm-up."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        step()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    return graph


def replay_poisoned(graph: torch.cuda.CUDAGraph, outs) -> None:
    """`graph` replayed into its output buffers `outs` NaN-poisoned first (a row the replay does
    not write stays NaN), then synchronized."""
    for x in outs:
        x.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()


def assert_pdl_chain_is_serialized(
    call: Callable[[torch.Tensor, torch.Tensor, Any], Any],
    q0: torch.Tensor,
    prologue: Callable[[], Any] | None = None,
) -> None:
    """CHAIN back-to-back calls, call i + 1's query call i's output (`call(q, out, made)`, made
    `prologue()`'s result, made once a chain before its calls: a decode step's schedule), with
    programmatic dependent launch, eagerly and replayed in a CUDA graph, end with the output, bit
    for bit, of the chain without PDL with a synchronize after every call. The kernels trigger
    their dependents at their tops, so the next may be resident under one: a read before its
    griddepcontrol.wait would show here."""
    pdl = importlib.import_module("forgekernel.runtime.pdl")
    bufs = (q0.clone(), torch.empty_like(q0))

    def chain(sync: bool) -> None:
        made = prologue() if prologue is not None else None
        for i in range(CHAIN):
            call(bufs[i % 2], bufs[(i + 1) % 2], made)
            if sync:
                torch.cuda.synchronize()

    with pdl.off():
        chain(True)
    want = bufs[CHAIN % 2].clone()
    bufs[0].copy_(q0)
    graph = captured(lambda: chain(False))  # its warm-up: the eager chain
    torch.cuda.synchronize()
    assert torch.equal(bufs[CHAIN % 2], want)
    bufs[0].copy_(q0)
    bufs[1].fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(bufs[CHAIN % 2], want)
