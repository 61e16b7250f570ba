"""torch.compile of a loss through the custom ops: the AOT graphs it records, and the check that
the compiled forward and backward are our ops and give the eager gradients bit for bit (shared by
the attention, GDN, KDA and DSA backward tests)."""

from __future__ import annotations

import torch
from torch._dynamo.backends.common import aot_autograd
from torch._functorch.aot_autograd import make_boxed_func


def graphs_backend(graphs: list[str]):
    """An aot_autograd backend that appends each compiled graph's text to `graphs` and runs it
    as traced."""

    def keep(gm, example_inputs):
        graphs.append(str(gm.graph))
        return make_boxed_func(gm.forward)

    return aot_autograd(fw_compiler=keep, bw_compiler=keep)


def leaves(tensors):
    """Fresh leaf copies of `tensors` that require grad (None stays None: an absent optional)."""
    return [None if x is None else x.clone().requires_grad_() for x in tensors]


def assert_compiled_grads_match_eager(loss, args, forward_op: str, backward_op: str) -> None:
    """loss(*args) compiled fullgraph records two graphs, the forward holding `forward_op` and the
    backward `backward_op` (e.g. "forgekernel.kda_chunked.default"), and its gradients equal the
    eager ones exactly."""
    eager_leaves = leaves(args)
    loss(*eager_leaves).backward()
    eager = [x.grad.clone() for x in eager_leaves]
    compiled_leaves = leaves(args)
    graphs: list[str] = []
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True, backend=graphs_backend(graphs))(*compiled_leaves).backward()
    assert len(graphs) == 2
    assert forward_op in graphs[0]
    assert backward_op in graphs[1]
    for got, want in zip((x.grad for x in compiled_leaves), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
