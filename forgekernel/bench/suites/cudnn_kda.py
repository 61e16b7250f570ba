"""cuDNN-frontend's own KDA op (`cudnn.linear_attention`, 1.32) as the `cudnn` comparator of the
kda_prefill and kda_bwd suites: our inputs in its layouts, its forward and its backward called
directly, and the engine its planner picked, for the record (`ran`).

Entry points (cudnn/linear_attention/ops/kda.py): the forward `kimi_delta_attention(q, k, v, g,
beta, cu_seqlens, scale, initial_state, output_final_state)` (the public op,
`cudnn.linear_attention.kimi_delta_attention`); the backward `kda_bwd(dO, q, k, v, g, beta,
cu_seqlens, scale, initial_state=, d_final_state=)`, the custom op
`cudnn::kimi_delta_attention_bwd` that the forward's registered autograd formula calls with the
forward's own inputs. Calling it directly times cuDNN's backward kernels and their host work
without the autograd engine and without a forward to record: its backward recomputes the
forward's chunk states itself, as ours does. Both run cached single-node graphs (one a shape)
whose first call plans and JIT-compiles; later calls allocate their outputs and workspace with
torch's allocator and launch on the current stream, which a CUDA graph captures (the CUDA
engine's docstring: it captures, host 151 us -> 3 us a call at 2048 tokens on the H100).

Layouts: THD, q / k (T, H, K), v (T, HV, V), g (T, HO, K) fp32, beta (T, HO) fp32 with
HO = max(H, HV) = HV, cu_seqlens int32 (N + 1): our (1, T, ...) tensors without the batch axis
(views, no copies); the states (initial, final and their gradients) (N, HO, V, K) fp32, our
"vk" (gdn_prefill.state_in_layout; confirmed for this graph through FlashInfer, which hands
cuDNN the state as given: scripts/probe_state_layouts.py, 2026-12-03). Scale 1/sqrt(K), as
ours; no in-kernel l2norm (k is unit-norm in the suites' inputs).

Engines on sm90 (cudnn/linear_attention/kda_heuristics.py ranks `kda_hopper_cuda` first, then
`kda_hopper`, then the rest in slot order; the planner takes the first that builds):
  kda_hopper_cuda  CUDA C++ through NVRTC (needs CUDA headers: CUDA_HOME, the pip nvidia-cu13
                   wheel or /usr/local/cuda): forward with grouped value heads (HV a multiple of
                   H), bf16 q / k / v, any scale; the only sm90 backward, which needs H == HV,
                   bf16 and the default scale.
  kda_hopper       CuTe DSL, forward only, H == HV, bf16, fp32 g / beta / state, int32
                   cu_seqlens, the default scale.
  kda_cutile       cuTile (the cuda.tile runtime, CUDA >= 13.3): both directions, grouped
                   value heads; on the H100 0.61x FlashKDA forward where kda_hopper_cuda is
                   2.09x.
  kda_frost, kda_summary_frost (Blackwell only) and kda_cake (opt-in) decline on sm90.
So bf16 H = HV cases run kda_hopper_cuda both ways; H 16 HV 32 runs kda_hopper_cuda forward and
kda_cutile backward (or nothing: then the record says why). `ran` names the engine of each case
and why the two Hopper engines declined where they did.
"""

from __future__ import annotations

import importlib
import math
from collections.abc import Callable
from typing import Any

import torch

from forgekernel.bench.suite import Inputs
from forgekernel.bench.suites.gdn_prefill import state_from_layout, state_in_layout

OPS_MODULE = "cudnn.linear_attention.ops.kda"
HOPPER_ENGINES = ("kda_hopper_cuda", "kda_hopper")  # the heuristics' sm90 order
SET_KEY = "cudnn_kda"  # where an input set keeps its arguments in cuDNN's layouts
REASON_CHARS = 110  # of each engine's decline in `ran` (the record keeps 300 in all)


def load() -> Any | None:
    """cuDNN's KDA ops module; None where the `cudnn` package is not installed; a module that
    is installed without the op raises ImportError naming its version."""
    try:
        import cudnn
    except Exception:
        return None
    try:
        return importlib.import_module(OPS_MODULE)
    except Exception as e:
        version = getattr(cudnn, "__version__", "?")
        raise ImportError(f"cudnn-frontend {version}: no {OPS_MODULE} ({e})") from e


def thd_arguments(inputs: Inputs, layout: str | None) -> dict[str, Any]:
    """The forward's arguments in cuDNN's layouts, made once per input set (the state's
    conversion outside any timed call): q, k, v, g, beta without the batch axis, cu_seqlens
    int32, initial_state in `layout` (None without one)."""
    if SET_KEY not in inputs:
        i = inputs
        if i["state"] is not None and layout is None:
            raise NotImplementedError("initial-state case: cuDNN's KDA state layout unconfirmed")
        args = {name: i[name][0] for name in ("q", "k", "v", "g", "beta")}
        args["cu_seqlens"] = i["cu_seqlens"].to(torch.int32)
        state = i["state"]
        args["initial_state"] = None if state is None else state_in_layout(state, layout)
        inputs[SET_KEY] = args
    return inputs[SET_KEY]


def backward_arguments(inputs: Inputs, layout: str | None) -> dict[str, Any]:
    """thd_arguments plus dO (T, HV, V) and the final state's gradient in `layout` (without an
    initial state, where `layout` may be unset: "vk", cuDNN's docstring's [N, HO, V, K]), made
    once."""
    args = thd_arguments(inputs, layout)
    if "dO" not in args:
        args["dO"] = inputs["do"][0]
        args["d_final_state"] = state_in_layout(inputs["d_final"], layout or "vk")
    return args


def scale(args: dict[str, Any]) -> float:
    """1/sqrt(K): ours, and the one scale cuDNN's sm90 backward takes."""
    return 1.0 / math.sqrt(args["q"].shape[-1])


def forward(ops: Any, args: dict[str, Any]) -> torch.Tensor:
    """cuDNN's KDA forward on thd_arguments; o (T, HV, V)."""
    a = args
    o, _ = ops.kimi_delta_attention(a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"],
                                    scale=scale(a), initial_state=a["initial_state"],
                                    output_final_state=True)  # fmt: skip
    return o


def backward(ops: Any, args: dict[str, Any]) -> tuple[torch.Tensor, ...]:
    """cuDNN's KDA backward on backward_arguments: (dq, dk, dv, dg, dbeta, d_initial_state), the
    last (N, HV, V, K), or empty without an initial state."""
    a = args
    grads = ops.kda_bwd(a["dO"], a["q"], a["k"], a["v"], a["g"], a["beta"], a["cu_seqlens"],
                        scale(a), initial_state=a["initial_state"],
                        d_final_state=a["d_final_state"])  # fmt: skip
    return tuple(grads[:6])


def ours_from_backward(grads: tuple[torch.Tensor, ...], inputs: Inputs, layout: str | None):
    """cuDNN's gradients as the suite's outputs (views, no copies): dq, dk, dv, dg, dbeta with
    the batch axis back, d_initial_state (where the case has a state) as ours, (N, HV, K, V)."""
    names = ("q", "k", "v", "g", "beta")
    out = [grad.view(inputs[name].shape) for grad, name in zip(grads, names)]
    if inputs["state"] is not None:
        out.append(state_from_layout(grads[5], layout or "vk"))
    return tuple(out)


def _cached_graph(cache: dict, head: tuple, state_at: int, state_dtype) -> Any | None:
    """The graph of the last entry in one of ops' graph caches whose key starts with `head` and
    holds `state_dtype` at `state_at` (the keys: ("fprop" | "bprop", total, N, H, HK, HV, K, V,
    dtypes..., the initial state's dtype at 16 / 17, flags...)); None where none does."""
    found = None
    for key, entry in cache.items():
        if tuple(key[: len(head)]) == head and key[state_at] == state_dtype:
            found = entry[0]
    return found


def graph_of(ops: Any, direction: str, args: dict[str, Any]) -> Any | None:
    """The cached cuDNN graph that served (or refused) `args` in `direction`, "fprop" or
    "bprop" (our suites vary nothing else that cuDNN's cache keys hold)."""
    q, v = args["q"], args["v"]
    head = (direction, q.shape[0], args["cu_seqlens"].shape[0] - 1, q.shape[1],
            args["k"].shape[1], v.shape[1], q.shape[2], v.shape[2])  # fmt: skip
    state = args["initial_state"]
    dtype = None if state is None else state.dtype
    cache = getattr(ops, "fprop_cache" if direction == "fprop" else "bprop_cache", {})
    return _cached_graph(cache, head, 16 if direction == "fprop" else 17, dtype)


def _declines(graph: Any, names: tuple[str, ...]) -> dict[str, str]:
    """Why each engine of `names` declines `graph` (its check_support, re-run), where it does."""
    try:
        from cudnn.engines.heuristics import decline_reasons

        declined, _ = decline_reasons(graph._candidate_engines(), graph)
    except Exception:
        return {}
    return {n: declined[n] for n in names if n in declined}


def _plan_names(graph: Any) -> list[str]:
    try:
        return [graph.get_plan_name_at_index(i) for i in range(len(graph.plans))]
    except Exception:
        return []


def account(graph: Any | None) -> str:
    """What ran: the planner's engine for `graph`, its ranked plans, and why each sm90 engine
    that did not run declined (e.g. "kda_cutile (plans kda_cutile; kda_hopper_cuda: ...)")."""
    if graph is None:
        return "unknown (no cached cuDNN graph matched the call)"
    engine = getattr(graph, "selected_engine", None)
    chosen = getattr(engine, "name", None) or "not built"
    others = tuple(n for n in HOPPER_ENGINES if n != chosen)
    parts = [f"plans {' > '.join(_plan_names(graph)) or '?'}"]
    parts += [f"{n}: {why[:REASON_CHARS]}" for n, why in _declines(graph, others).items()]
    return f"{chosen} ({'; '.join(parts)})"


def declined(error: Exception) -> bool:
    """Whether `error` is cuDNN's refusal of a graph (an engine's NotImplementedError, the
    planner's cudnnGraphNotSupportedError), not a failure of a call it took."""
    return isinstance(error, NotImplementedError) or "NotSupported" in type(error).__name__


def refused(ops: Any, direction: str, args: dict[str, Any], error: Exception) -> Exception:
    """A NotImplementedError for a call cuDNN refused, led by the sm90 engines' declines (its
    own message lists every engine's, Blackwell's first, past the record's 300 characters)."""
    graph = graph_of(ops, direction, args)
    why = _declines(graph, HOPPER_ENGINES) if graph is not None else {}
    text = "; ".join(f"{n}: {w[:REASON_CHARS]}" for n, w in why.items())
    return NotImplementedError(f"cuDNN KDA {direction} refused: {text or error}")


def runner(direction: str, layout: Callable[[], str | None]) -> Callable[[Inputs], Any] | None:
    """The suites' comparator: cuDNN's KDA forward ("fprop": o (1, T, HV, V)) or backward
    ("bprop": the gradients as ours) on an input set, carrying `ran` (the engine); None without
    the `cudnn` package; a runner that raises the reason where its KDA op is missing. `layout`:
    the state layout constant, read at each input set's first call."""
    try:
        ops = load()
    except ImportError as e:
        reason = str(e)

        def missing(inputs: Inputs):
            raise NotImplementedError(reason)

        return missing
    if ops is None:
        return None

    def run(inputs: Inputs):
        if direction == "fprop":
            args = thd_arguments(inputs, layout())
        else:
            args = backward_arguments(inputs, layout())
        try:
            if direction == "fprop":
                return forward(ops, args).view(inputs["v"].shape)
            return ours_from_backward(backward(ops, args), inputs, layout())
        except Exception as e:
            if declined(e):
                raise refused(ops, direction, args, e) from e
            raise

    run.ran = lambda inputs: account(graph_of(ops, direction, inputs[SET_KEY]))
    return run
