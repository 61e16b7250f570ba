"""`forgekernel.kimi_delta_attention`: Kimi Delta Attention's chunked forward (prefill) with
fla's calling convention (`fla.ops.kda.chunk_kda`). Gated DeltaNet with a per-key-channel
decay: per value head, state S (K, V) fp32, g_t (K,) the log decay of token t,

    S_t = (I - beta_t k_t k_t^T) diag(exp(g_t)) S_{t-1} + beta_t k_t v_t^T
    o_t = scale S_t^T q_t

q, k (B, T, H, K), v (B, T, HV, V) with value head hv reading q / k head hv // (HV / H) (fla's
KDA has HV = H; grouped value heads are accepted as in `gated_delta_rule`), g (B, T, HV, K),
beta (B, T, HV); varlen as B = 1 with cu_seqlens (N + 1,); initial / final state fp32 (N, HV,
K, V) (fla's layout); use_qk_l2norm_in_kernel divides q and k by sqrt(sum x^2 + 1e-6).

Implementation: kernels/linear_attention/kda_prefill/sm90 in two passes, as FlashKDA and
fla split the work: the token-parallel first pass (every chunk's state-independent operands,
the per-channel decays folded into bf16 tiles around sub-chunk reference points so that no
factor overflows: `reference/kda_chunked.py`) on its own kernel (`intra.py`: one warpgroup per
chunk and value head; `operands.py` is its torch model, the tests' yardstick); the
recurrence runs on the tensor cores (`recurrence.py`: TMA + WGMMA, the state on chip). The
offsets are never read on the host (no sync; the call can be captured in a CUDA graph): the
first pass lays its chunks out on the device over an upper bound of chunks known from T and N
(exact for a batch or one sequence). Differentiable: ops/kda_bwd.py registers the backward
of `forgekernel::kda_chunked` (`torch.library.register_autograd`; its kernel path by default
since 2026-12-06, `FORGEKERNEL_KDA_BWD_KERNEL=0` and CPU tensors the interim torch path).
"""

from __future__ import annotations

import torch

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch as kda_sm90
from forgekernel.kernels.linear_attention.kda_prefill.sm90.config import HEAD_DIMS
from forgekernel.ops import gated_delta_rule_chunked as gdn_fwd
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


def _launch(q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, out=None,
            seq_len=None):  # fmt: skip
    """Flat contiguous tensors q, k (T, H, K) ..., cu_seqlens int32 -> (o (T, HV, V) in q's
    dtype, final state (N, HV, K, V) fp32). seq_len: every sequence's length where the host
    knows it (a batch without offsets)."""
    n, hv, dv = cu_seqlens.shape[0] - 1, v.shape[1], v.shape[2]
    o = q.new_empty(*v.shape) if out is None else out
    final = torch.empty(n, hv, q.shape[2], dv, dtype=torch.float32, device=q.device)
    with torch.no_grad():
        kda_sm90.kda_prefill(q, k, v, g, beta, initial_state, cu_seqlens, o, final, scale,
                             l2norm=l2norm, seq_len=seq_len)  # fmt: skip
    return o, final


@torch.library.custom_op("forgekernel::kda_chunked", mutates_args=())
def _chunked_op(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None,
    cu_seqlens: torch.Tensor,
    scale: float,
    l2norm: bool,
    batch: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """`batch`: B when the offsets are B equal lengths (the wrapper's, for a (B, T) batch), else
    0; unused here, saved by autograd's setup (ops/kda_bwd.py) so that the backward takes its
    equal-length kernel path with no host read, eager and under torch.compile alike."""
    gdn_fwd.check_batch(batch, cu_seqlens.shape[0] - 1)
    args = (x.contiguous() for x in (q, k, v, g, beta))
    init = None if initial_state is None else initial_state.contiguous()
    return _launch(*args, init, cu_seqlens.contiguous(), scale, l2norm)


@_chunked_op.register_fake
def _(q, k, v, g, beta, initial_state, cu_seqlens, scale, l2norm, batch=0):
    n = cu_seqlens.shape[0] - 1
    gdn_fwd.check_batch(batch, n)
    final = q.new_empty(n, v.shape[1], q.shape[2], v.shape[2], dtype=torch.float32)
    return q.new_empty(*v.shape), final


def _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens, l2norm, out=None):
    """Validated tensors -> (o (B, T, HV, V) in q's dtype, final state (N, HV, K, V) fp32):
    through the custom op where autograd records the call or it is traced, else the launcher
    directly (o written into `out`, flat (B T, HV, V), when given)."""
    b, t, hv, dv = v.shape
    seq_len = t if cu_seqlens is None else None  # known on the host: exact chunk tables
    if cu_seqlens is None:
        cu_seqlens = torch.arange(b + 1, dtype=torch.int32, device=q.device) * t  # T = 0 too
    offsets = cu_seqlens.to(torch.int32)
    flat = [x.reshape(b * t, *x.shape[2:]) for x in (q, k, v, g, beta)]
    if wants_grad(*flat, initial_state) or _traced(*flat, initial_state, offsets, out):
        # batch: the backward finds B equal lengths without reading the offsets (its kernel
        # path's capturable form, ops/kda_bwd.py), eager and compiled alike
        batch = b if seq_len is not None else 0
        o, final = torch.ops.forgekernel.kda_chunked(*flat, initial_state, offsets, scale, l2norm,
                                                     batch)  # fmt: skip
        if out is not None:
            o = out.copy_(o)
        return o.view(b, t, hv, dv), final
    flat = [x.contiguous() for x in flat]
    init = None if initial_state is None else initial_state.contiguous()
    o, final = _launch(*flat, init, offsets, scale, l2norm, out, seq_len)
    return o.view(b, t, hv, dv), final


def _check_offsets(cu_seqlens: torch.Tensor, b: int, t: int) -> int:
    check_tensor("cu_seqlens", cu_seqlens, ndim=1, dtypes=OFFSETS, cuda=False)
    if b != 1:
        raise ValueError(f"varlen (cu_seqlens given) needs B = 1, got B = {b}")
    if cu_seqlens.shape[0] < 2:
        raise ValueError("cu_seqlens must hold N + 1 >= 2 offsets")
    if cu_seqlens.device.type == "cpu":  # values checked only where reading them is free
        edges = cu_seqlens.tolist()
        if edges[0] != 0 or edges[-1] != t or any(a > z for a, z in zip(edges, edges[1:])):
            raise ValueError(f"cu_seqlens must rise from 0 to T = {t}, got {edges}")
    return cu_seqlens.shape[0] - 1


def _validate(q, k, v, g, beta, initial_state, cu_seqlens, *, device_check: bool = True) -> None:
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
    check_shaped("g", g, (b, t, hv, dk), (torch.float32, q.dtype))
    check_shaped("beta", beta, (b, t, hv), (torch.float32, q.dtype))
    n = b if cu_seqlens is None else _check_offsets(cu_seqlens, b, t)
    if n > kda_sm90.MAX_SEQUENCES:  # one CTA row per sequence: gridDim.y
        raise ValueError(f"at most {kda_sm90.MAX_SEQUENCES} sequences, got {n}")
    if initial_state is not None:
        check_shaped("initial_state", initial_state, (n, hv, dk, dv), F32)
    if device_check:
        check_cuda("q", q)
    others = {"initial_state": initial_state, "cu_seqlens": cu_seqlens}
    check_same_device(q=q, k=k, v=v, g=g, beta=beta,
                      **{name: x for name, x in others.items() if x is not None})  # fmt: skip


def kimi_delta_attention(
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
    out: torch.Tensor | None = None,
    use_qk_l2norm: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fla's `chunk_kda` forward: q, k (B, T, H, 128) and v (B, T, HV, 128) bf16 / fp16 (HV a
    multiple of H); g (B, T, HV, 128) log decay per key channel (fp32 or q's dtype); beta (B,
    T, HV) (fp32 or q's dtype); scale default K ** -0.5; initial_state fp32 (N, HV, K, V), N =
    B or the number of sequences; cu_seqlens int32 / int64 (N + 1,) with B = 1 for varlen;
    use_qk_l2norm_in_kernel (fla's name) or use_qk_l2norm (issue 20's; default False) as the
    module docstring says.
    Returns (o (B, T, HV, V) in q's dtype, the final state fp32 (N, HV, K, V) or None unless
    output_final_state); o is written into `out` when given (a contiguous (B, T, HV, V) tensor
    in q's dtype). Accurate for per-step log decays down to about -5 per channel (the
    kernel's sub-chunk factors; reference/kda_chunked.py). Differentiable in q, k, v, g, beta
    and initial_state (the interim torch backward: ops/kda_bwd.py); with `out=` and grad, o is
    computed first and copied into out (autograd records the copy)."""
    use_qk_l2norm_in_kernel = one_of_two_names(
        "use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel, "use_qk_l2norm", use_qk_l2norm, False
    )
    check_bools(use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                output_final_state=output_final_state)  # fmt: skip
    _validate(q, k, v, g, beta, initial_state, cu_seqlens)
    if out is not None:
        check_shaped("out", out, tuple(v.shape), (q.dtype,))
        if not out.is_contiguous():
            raise ValueError("out must be contiguous")
        check_same_device(q=q, out=out)
    scale = check_scale("scale", scale, q.shape[3] ** -0.5)
    flat_out = None if out is None else out.view(-1, *out.shape[2:])
    o, final = _forward(q, k, v, g, beta, scale, initial_state, cu_seqlens,
                        use_qk_l2norm_in_kernel, flat_out)  # fmt: skip
    if out is not None and o.data_ptr() != out.data_ptr():
        o = out.copy_(o)
    return o, (final if output_final_state else None)


chunk_kda = kimi_delta_attention  # fla's name
