"""`forgekernel.ops.gated_delta_rule_chunked.gated_delta_rule`: the chunked Gated DeltaNet
forward (prefill) with fla's calling convention (`fla.ops.gated_delta_rule.
chunk_gated_delta_rule`), and `gdn_prefill_flashinfer`, FlashInfer-Bench's
`gdn_prefill_qk4_v8_d128_k_last` as it is. Kernel: kernels/linear_attention/gdn_prefill/sm90.

Per value head, state S (K, V) fp32, decay exp(g_t), g_t the log decay (<= 0):

    S_t = exp(g_t) S_{t-1} + k_t beta_t (v_t - exp(g_t) S_{t-1}^T k_t)^T
    o_t = scale S_t^T q_t

computed chunk by chunk (64 tokens; WY / UT transform; reference.delta_rule documents the
chunked form and its overflow-free exponents). Value head hv reads q / k head hv // (HV / H).
Varlen: B = 1 and cu_seqlens (N + 1,), every sequence starting from its own initial-state row
(zeros without one). Differentiable in q, k, v, g, beta and the initial state (gradients on o
and on the final state): the custom op's autograd formula is ops/gated_delta_rule_bwd.py's,
whose backward runs on its kernels by default since 2026-12-06 (16-bit CUDA inputs;
`FORGEKERNEL_GDN_BWD_KERNEL=0`, CPU tensors and the calls the kernels decline: the interim fp32
torch path, the chunked backward of reference/delta_rule_bwd.py) (registered when the package
imports: ops/__init__ imports that module). Calls autograd would record take the custom op;
forward-only calls pay for no bookkeeping."""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_sm90
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import HEAD_DIMS
from forgekernel.ops._dispatch import traced as _traced
from forgekernel.ops._dispatch import wants_grad
from forgekernel.ops._validate import (
    check_bools,
    check_cuda,
    check_same_device,
    check_scale,
    check_shaped,
    check_tensor,
    one_of_two_names,
)

F32 = (torch.float32,)
OFFSETS = (torch.int32, torch.int64)


def _state_shape(n: int, hv: int, dk: int, dv: int, k_last: bool) -> tuple[int, ...]:
    return (n, hv, dv, dk) if k_last else (n, hv, dk, dv)


def check_batch(batch: int, n: int) -> None:
    """The forward ops' `batch` argument: B when the N = B sequences behind the offsets are known
    equal in length (the wrappers' offsets for a (B, T) batch), else 0."""
    if batch not in (0, n):
        raise ValueError(f"batch must be 0 or the number of sequences {n}, got {batch}")


def _launch(q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm, out=None):
    """Varlen tensors (T, H, K) ... -> (o (T, HV, V), final state (N, HV, ...))."""
    n = cu_seqlens.shape[0] - 1
    hv, dk, dv = v.shape[1], q.shape[2], v.shape[2]
    out = q.new_empty(*v.shape) if out is None else out
    final = torch.empty(_state_shape(n, hv, dk, dv, k_last), dtype=torch.float32, device=q.device)
    prefill_sm90.gdn_prefill(
        q, k, v, g, beta, initial_state, cu_seqlens, out, final, scale, k_last=k_last,
        l2norm=l2norm,
    )  # fmt: skip
    return out, final


@torch.library.custom_op("forgekernel::gated_delta_rule_chunked", mutates_args=())
def _chunked_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    scale: float,
    k_last: bool,
    l2norm: bool,
    batch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch`: B when the offsets are B equal lengths (the wrapper's, for a (B, T) batch), else
    0; unused here, saved by autograd's setup (ops/gated_delta_rule_bwd.py) so that the backward
    takes its equal-length kernel path with no host read, eager and under torch.compile alike."""
    check_batch(batch, cu_seqlens.shape[0] - 1)
    args = (x.contiguous() for x in (q, k, v, g, beta))
    init = None if initial_state is None else initial_state.contiguous()
    return _launch(*args, init, cu_seqlens.contiguous(), scale, k_last, l2norm)


@_chunked_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, k_last, l2norm, batch=0):
    n = cu_seqlens.shape[0] - 1
    check_batch(batch, n)
    shape = _state_shape(n, v.shape[1], q.shape[2], v.shape[2], k_last)
    return q.new_empty(*v.shape), q.new_empty(*shape, dtype=torch.float32)


def _check_heads(q, k, v) -> tuple[int, int, int, int, int, int]:
    check_tensor("q", q, ndim=4, cuda=False)
    check_shaped("k", k, tuple(q.shape), (q.dtype,))
    b, t, h, dk = q.shape
    check_tensor("v", v, ndim=4, cuda=False)
    hv, dv = v.shape[2], v.shape[3]
    if v.shape[:2] != (b, t) or v.dtype != q.dtype or hv % h:
        raise ValueError(f"v must be (B, T, HV, V) in q's dtype with HV a multiple of H = {h}, "
                         f"got {tuple(v.shape)} {v.dtype}")  # fmt: skip
    if (dk, dv) not in HEAD_DIMS:
        raise ValueError(f"(K, V) must be one of {HEAD_DIMS}, got {(dk, dv)}")
    return b, t, h, hv, dk, dv


def _check_offsets(cu_seqlens: torch.Tensor, b: int, t: int) -> int:
    """The number of sequences; the offsets' values are checked only where they are on the
    host (reading them from the GPU would synchronize every call, as FlashAttention, fla and
    FlashInfer trust them too)."""
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=OFFSETS, cuda=False)
    if b != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B = 1, got B = {b}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold N + 1 >= 2 offsets")
    if cu_seqlens.device.type == "cpu":
        edges = cu_seqlens.tolist()
        if edges[0] != 0 or edges[-1] != t or any(a > z for a, z in zip(edges, edges[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {t}, got {edges}")
    return cu_seqlens.shape[0] - 1


def gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    *,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool | None = None,
    k_last: bool = False,
    out: torch.Tensor | None = None,
    use_qk_l2norm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `chunk_gated_delta_rule` forward: q, k (B, T, H, 128) and v (B, T, HV, 128) bf16 /
    fp16 (HV a multiple of H); g (B, T, HV) fp32 log decay; beta (B, T, HV) fp32 or q's dtype;
    scale default K ** -0.5; initial_state fp32 (N, HV, K, V), or (N, HV, V, K) with k_last
    (FlashInfer's layout), N = B or the number of sequences; cu_seqlens int32 / int64 (N + 1,)
    with B = 1 for varlen; use_qk_l2norm_in_kernel (fla's name) or use_qk_l2norm (issue 20's;
    default False): q and k divided by sqrt(sum x^2 + 1e-6).
    Returns (o (B, T, HV, V) in q's dtype, the final state (N, HV, ...) fp32 in the initial
    state's layout, or None unless output_final_state); o is written into `out` when given (a
    contiguous (B, T, HV, V) tensor in q's dtype). Differentiable in q, k, v, g, beta and
    initial_state (the interim torch backward: ops/gated_delta_rule_bwd.py); with `out=` and
    grad, o is computed first and copied into out (autograd records the copy)."""
    use_qk_l2norm_in_kernel = one_of_two_names(
        "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel, "use_qk_l2norm", use_qk_l2norm, False
    )
    check_bools(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, k_last=k_last,
                output_final_state=output_final_state)  # fmt: skip
    b, t, h, hv, dk, dv = _check_heads(q, k, v)
    check_shaped("g", g, (b, t, hv), F32)
    check_shaped("beta", beta, (b, t, hv), (torch.float32, q.dtype))
    n = b if cu_seqlens is None else _check_offsets(cu_seqlens, b, t)
    if n > prefill_sm90.MAX_SEQUENCES:  # one CTA row per sequence: gridDim.y
        raise ValueError(f"at most {prefill_sm90.MAX_SEQUENCES} sequences, got {n}")
    if initial_state is not None:
        check_shaped("initial_state", initial_state, _state_shape(n, hv, dk, dv, k_last), F32)
    check_cuda("q", q)
    others = {"initial_state": initial_state, "cu_seqlens": cu_seqlens}
    check_same_device(q=q, k=k, v=v, g=g, beta=beta,
                      **{name: x for name, x in others.items() if x is not None})  # fmt: skip
    if out is not None:
        check_shaped("out", out, (b, t, hv, dv), (q.dtype,))
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        check_same_device(q=q, out=out)
    scale = check_scale("scale", scale, dk**-0.5)
    batch = b if cu_seqlens is None else 0  # B equal lengths, known on the host
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t  # T = 0 too
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta.float())]
    offsets = cu_seqlens.to(torch.int32)
    if wants_grad(*flat, initial_state) or _traced(*flat, initial_state, offsets, out):
        o, final = torch.ops.forgekernel.gated_delta_rule_chunked(
            *flat, initial_state, offsets, scale, k_last, use_qk_l2norm_in_kernel, batch
        )
        o = o.view(b, t, hv, dv) if out is None else out.copy_(o.view(b, t, hv, dv))
    else:
        flat = [x if x.is_contiguous() else x.contiguous() for x in flat]
        init = None if initial_state is None else initial_state.contiguous()
        flat_out = None if out is None else out.view(b * t, hv, dv)
        o, final = _launch(*flat, init, offsets, scale, k_last, use_qk_l2norm_in_kernel,
                           flat_out)  # fmt: skip
        o = o.view(b, t, hv, dv) if out is None else out
    return o, (final if output_final_state else None)


chunk_gated_delta_rule = gated_delta_rule  # fla's name


def gdn_prefill_flashinfer(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    state: torch.Tensor | None,
    A_log: torch.Tensor,
    a: torch.Tensor,
    dt_bias: torch.Tensor,
    b: torch.Tensor,
    cu_seqlens: torch.Tensor,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """FlashInfer-Bench's `gdn_prefill_qk4_v8_d128_k_last` as it is: q, k (T, H, K), v (T, HV,
    V) bf16, state (N, HV, V, K) fp32 k-last or None, A_log / dt_bias fp32 (HV,), a / b (T, HV)
    bf16, cu_seqlens int64 (N + 1,), scale None or 0 -> K ** -0.5 -> (output (T, HV, V),
    new_state (N, HV, V, K) fp32). Log decay -exp(A_log) softplus(a + dt_bias) and beta
    sigmoid(b) in fp32 (T x HV elements, computed here); as their reference, an empty
    sequence's new_state row is zero even with an initial state."""
    check_tensor("q", q, ndim=3, cuda=False)
    check_tensor("v", v, ndim=3, cuda=False)
    t, hv = v.shape[:2]
    check_shaped("a", a, (t, hv), (q.dtype,))
    check_shaped("b", b, (t, hv), (q.dtype,))
    check_shaped("A_log", A_log, (hv,), F32)
    check_shaped("dt_bias", dt_bias, (hv,), F32)
    g = -torch.exp(A_log) * torch.nn.functional.softplus(a.float() + dt_bias)
    beta = torch.sigmoid(b.float())
    scale = q.shape[-1] ** -0.5 if scale is None or float(scale) == 0.0 else float(scale)
    out, new_state = gated_delta_rule(
        q.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), g.unsqueeze(0), beta.unsqueeze(0),
        scale=scale, initial_state=state, output_final_state=True, cu_seqlens=cu_seqlens,
        k_last=True,
    )  # fmt: skip
    empty = (cu_seqlens[1:] - cu_seqlens[:-1]) <= 0
    return out[0], new_state.masked_fill_(empty.view(-1, 1, 1, 1), 0.0)
