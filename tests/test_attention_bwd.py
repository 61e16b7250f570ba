"""Attention backward on the CPU: autograd of `forgekernel.attention` / `attention_varlen` wired to
the backward kernel (a reference-backed stand-in that insists on what the real one needs), the
explicit `attention_backward`, bad inputs, `deterministic` reaching the kernel, and
torch.compile(fullgraph=True) recording the custom ops in the forward and backward graphs."""

import importlib
import math

import pytest
import torch
from compile_graphs import graphs_backend
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.reference.attention import (
    attention_bwd_ref,
    attention_ref,
    attention_varlen_bwd_ref,
    attention_varlen_ref,
)
from forgekernel.runtime import scratch
from forgekernel.runtime.device import tma_ready

fwd_module = importlib.import_module("forgekernel.ops.attention")
varlen_module = importlib.import_module("forgekernel.ops.attention_varlen")
bwd_module = importlib.import_module("forgekernel.ops.attention_bwd")
bwd_launch = importlib.import_module("forgekernel.kernels.attention.bwd.sm90.launch")


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def qkv(b=2, sq=9, sk=13, hq=8, hkv=2, d=64, dv=None, grad=True):
    ts = bf16(b, sq, hq, d), bf16(b, sk, hkv, d), bf16(b, sk, hkv, dv or d)
    return tuple(t.requires_grad_(grad) for t in ts)


@pytest.fixture
def kernels(monkeypatch):
    """Forward and backward 'kernels' on the CPU from the reference; the backward one records
    (causal, scale, deterministic, varlen?) per call and checks TMA-ready, contiguous operands."""
    calls = []

    def fwd(q, k, v, o, lse, scale, causal):
        ref_o, ref_lse = attention_ref(q, k, v, causal, scale)
        o.copy_(ref_o)
        lse.copy_(ref_lse)

    def varlen_fwd(q, k, v, o, lse, seqs, scale, causal):
        ref_o, ref_lse = attention_varlen_ref(q, k, v, seqs[0], seqs[1], causal, scale)
        o.copy_(ref_o)
        lse.copy_(ref_lse)

    def bwd(q, k, v, o, lse, do, dq, dk, dv, scale, causal, deterministic, seqs, config=None):
        assert all(tma_ready(t) for t in (q, k, v, o, do))
        assert all(t.is_contiguous() for t in (lse, dq, dk, dv))
        assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
        if seqs is None:
            grads = attention_bwd_ref(q, k, v, do, causal, scale)
        else:
            assert seqs[2:] == (max(seqs[0].diff()), max(seqs[1].diff()))
            grads = attention_varlen_bwd_ref(q, k, v, do, seqs[0], seqs[1], causal, scale)
        for g, r in zip((dq, dk, dv), grads):
            g.copy_(r)
        calls.append((causal, scale, deterministic, seqs is not None))

    no_device_check = lambda name, t: None  # noqa: E731
    for module in (fwd_module, varlen_module, bwd_module):
        monkeypatch.setattr(module, "check_cuda", no_device_check)
    monkeypatch.setattr(fwd_module, "_launch_fwd", fwd)
    monkeypatch.setattr(varlen_module, "_launch_varlen_fwd", varlen_fwd)
    monkeypatch.setattr(bwd_launch, "_launch_kernels", bwd)
    # the stand-in computes any head dims; the real kernel's HEAD_DIMS are a subset
    monkeypatch.setattr(bwd_module, "BWD_HEAD_DIMS", ((64, 64), (128, 128), (192, 128)))
    return calls


def want_grads(q, k, v, do, causal, scale=None):
    return tuple(g.to(q.dtype) for g in attention_bwd_ref(q, k, v, do, causal, scale))


def naive_float64(q, k, v, causal, scale):
    """O by autograd-able float64 torch ops; rows that see no key give 0."""
    hq, hkv = q.shape[2], k.shape[2]
    q, k, v = q.double(), k.double().repeat_interleave(hq // hkv, 2), v.double()
    v = v.repeat_interleave(hq // hkv, 2)
    s = torch.einsum("bihd,bjhd->bhij", q, k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = torch.arange(sk)[None, :] <= torch.arange(sq)[:, None] + sk - sq
        s = s.masked_fill(~seen, -math.inf)
        alive = seen.any(-1)[:, None].double()
        s = s.masked_fill(~alive.bool(), 0.0)
        p = torch.softmax(s, -1) * alive
    else:
        p = torch.softmax(s, -1)
    return torch.einsum("bhij,bjhd->bihd", p, v)


@pytest.mark.parametrize(
    "shape, causal",
    [
        ((2, 9, 13, 8, 2, 64, 64), True),  # Sq < Sk, GQA 4
        ((1, 13, 5, 4, 4, 64, 64), True),  # Sq > Sk: the first 8 rows see no key
        ((1, 17, 17, 8, 1, 192, 128), False),  # DeepSeek dims, MQA
        ((2, 1, 7, 8, 8, 128, 128), True),  # one query row
    ],
)
def test_autograd_gives_the_reference_gradients(kernels, shape, causal):
    b, sq, sk, hq, hkv, d, dv = shape
    q, k, v = qkv(b, sq, sk, hq, hkv, d, dv)
    o = forgekernel.attention(q, k, v, causal=causal)
    do = bf16(*o.shape)
    o.backward(do)
    assert kernels == [(causal, d**-0.5, False, False)]
    for got, want in zip((q.grad, k.grad, v.grad), want_grads(q, k, v, do, causal)):
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got, want, rtol=0, atol=0)
    # and the reference those are is the gradient of the float64 forward
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    naive_float64(qd, kd, vd, causal, d**-0.5).backward(do.double())
    for got, want in zip((q.grad, k.grad, v.grad), (qd.grad, kd.grad, vd.grad)):
        torch.testing.assert_close(got.double(), want, rtol=2e-2, atol=2e-2)


def _misaligned(t: torch.Tensor) -> torch.Tensor:
    """t's values in a view one element past an allocation's start (base not 16-byte
    aligned): what an offloading hook's unpack may return."""
    return torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape).copy_(t)


def _transposed(t: torch.Tensor) -> torch.Tensor:
    """t's values with its last two dims' strides swapped (not contiguous)."""
    return t.transpose(-1, -2).contiguous().transpose(-1, -2)


@pytest.mark.parametrize("varlen", [False, True])
def test_saved_tensor_hooks_strides_reach_the_kernel_ready(kernels, varlen):
    """Saved-tensor hooks may hand back o at any base address and lse with any strides: the
    autograd's backward (compact: no layout checks) still gives the kernel TMA-ready o and
    contiguous lse (the stand-in asserts both) and the reference gradients."""
    q, k, v = qkv(2, 9, 13, 8, 2, 64)
    if varlen:
        q, k, v = (t.detach().flatten(0, 1).requires_grad_() for t in (q, k, v))
        cu_q, cu_k = torch.tensor([0, 4, 18], dtype=torch.int32), torch.tensor([0, 13, 26])
        cu_k = cu_k.to(torch.int32)

    def unpack(t: torch.Tensor) -> torch.Tensor:
        if t.dtype == torch.float32 and t.dim() >= 2:
            return _transposed(t)  # lse
        return _misaligned(t) if t.dtype == torch.bfloat16 else t

    with torch.autograd.graph.saved_tensors_hooks(lambda t: t, unpack):
        if varlen:
            o = forgekernel.attention_varlen(q, k, v, cu_q, cu_k, 14, 13, causal=True)
        else:
            o = forgekernel.attention(q, k, v, causal=True)
    do = bf16(*o.shape)
    o.backward(do)
    assert len(kernels) == 1
    if varlen:
        want = attention_varlen_bwd_ref(q, k, v, do, cu_q, cu_k, True, None)
    else:
        want = attention_bwd_ref(q, k, v, do, True, None)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w.to(got.dtype), rtol=0, atol=0)


def test_only_some_inputs_require_grad_and_the_scale_reaches_the_kernel(kernels):
    q, k, v = qkv(grad=False)
    k.requires_grad_()
    o, lse = forgekernel.attention(q, k, v, True, 0.3, return_lse=True)
    assert not lse.requires_grad  # not differentiable: the kernel has no dLSE input
    o.float().square().sum().backward()
    assert q.grad is None and v.grad is None and k.grad is not None
    assert kernels == [(True, 0.3, False, False)]
    do = (2 * o.float()).to(torch.bfloat16)
    torch.testing.assert_close(k.grad, want_grads(q, k, v, do, True, 0.3)[1], rtol=0, atol=0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_deterministic_reaches_the_kernel(kernels, deterministic):
    q, k, v = qkv()
    forgekernel.attention(q, k, v, deterministic=deterministic).sum().backward()
    packed = varlen_args()
    forgekernel.attention_varlen(*packed, True, deterministic=deterministic).sum().backward()
    assert [c[2] for c in kernels] == [deterministic, deterministic]


def test_expanded_grad_output_is_copied_before_the_kernel(kernels):
    q, k, v = qkv()
    forgekernel.attention(q, k, v, causal=True).sum().backward()  # dO: stride-0 ones
    do = torch.ones(2, 9, 8, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(q.grad, want_grads(q, k, v, do, True)[0], rtol=0, atol=0)


def test_out_with_grad_returns_the_buffers_and_carries_the_gradient(kernels):
    q, k, v = qkv()
    o, lse = torch.empty(2, 9, 8, 64, dtype=torch.bfloat16), torch.empty(2, 8, 9)
    got = forgekernel.attention(q, k, v, True, return_lse=True, out=(o, lse))
    assert got[0] is o and got[1] is lse and o.requires_grad
    do = bf16(*o.shape)
    o.backward(do)
    torch.testing.assert_close(v.grad, want_grads(q, k, v, do, True)[2], rtol=0, atol=0)


def test_no_keys_or_no_queries_give_zero_gradients_without_the_kernel(kernels):
    q, k, v = qkv(sk=0)
    o = forgekernel.attention(q, k, v, causal=True)
    o.backward(bf16(*o.shape))
    assert torch.all(q.grad == 0) and k.grad.shape == k.shape
    q, k, v = qkv(sq=0)
    forgekernel.attention(q, k, v).sum().backward()
    assert torch.all(k.grad == 0) and torch.all(v.grad == 0)
    assert kernels == []


def test_head_dims_without_a_backward_kernel_raise_in_backward(kernels):
    q, k, v = qkv(d=256)
    o = forgekernel.attention(q, k, v)  # the forward has 256
    with pytest.raises(ValueError, match="backward: head_dim = 256 with head_dim_v = 256"):
        o.sum().backward()


def varlen_args(lens_q=(3, 0, 9), lens_k=(5, 4, 9), hq=8, hkv=2, d=128):
    cu = [
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        for n in (lens_q, lens_k)
    ]
    q = bf16(sum(lens_q), hq, d).requires_grad_()
    k, v = (bf16(sum(lens_k), hkv, d).requires_grad_() for _ in range(2))
    return q, k, v, cu[0], cu[1], max(lens_q), max(lens_k)


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_autograd_gives_the_reference_gradients(kernels, causal):
    q, k, v, cu_q, cu_k, mq, mk = varlen_args()
    o = forgekernel.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, causal)
    do = bf16(*o.shape)
    o.backward(do)
    want = attention_varlen_bwd_ref(q, k, v, do, cu_q, cu_k, causal)
    for got, w in zip((q.grad, k.grad, v.grad), want):
        torch.testing.assert_close(got, w.to(torch.bfloat16), rtol=0, atol=0)
    assert kernels == [(causal, 128**-0.5, False, True)]


def test_attention_backward_writes_strided_out(kernels):
    q, k, v = qkv(grad=False)
    o, lse = forgekernel.attention(q, k, v, True, return_lse=True)
    do = bf16(2, 9, 8, 64)
    dq = torch.empty(2, 9, 8, 128, dtype=torch.bfloat16)[..., ::2]  # strided last dim
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    got = forgekernel.attention_backward(
        q, k, v, o, lse, do, True, deterministic=True, out=(dq, dk, dv)
    )
    assert got[0] is dq and got[1] is dk and got[2] is dv
    for g, w in zip(got, want_grads(q, k, v, do, True)):
        torch.testing.assert_close(g, w, rtol=0, atol=0)
    assert kernels == [(True, 64**-0.5, True, False)]
    fresh = forgekernel.attention_backward(q, k, v, o, lse, do, True)
    assert all(torch.equal(a, b) for a, b in zip(fresh, got))


def test_attention_varlen_backward(kernels):
    q, k, v, cu_q, cu_k, mq, mk = varlen_args()
    q, k, v = (t.detach() for t in (q, k, v))
    o, lse = forgekernel.attention_varlen(q, k, v, cu_q, cu_k, mq, mk, True, None, True)
    do = bf16(*o.shape)
    got = forgekernel.attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, mq, mk, True)
    for g, w in zip(got, attention_varlen_bwd_ref(q, k, v, do, cu_q, cu_k, True)):
        torch.testing.assert_close(g, w.to(torch.bfloat16), rtol=0, atol=0)


Q, K, V = qkv(grad=False)
O_, LSE, DO = bf16(2, 9, 8, 64), torch.empty(2, 8, 9), bf16(2, 9, 8, 64)


def with_(**changes):
    args = {"q": Q, "k": K, "v": V, "o": O_, "lse": LSE, "do": DO}
    return tuple(changes.get(n, a) for n, a in args.items())


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        (with_(do=bf16(2, 9, 8, 32)), {}, ValueError, "do must have shape (2, 9, 8, 64)"),
        (with_(o=O_.half()), {}, TypeError, "o must have dtype in (bfloat16)"),
        (with_(lse=LSE.bfloat16()), {}, TypeError, "lse must have dtype in (float32)"),
        (with_(lse=LSE[:, :4]), {}, ValueError, "lse must have shape (2, 8, 9)"),
        (with_(do=DO[0]), {}, ValueError, "do must be 4-D"),
        (with_(q=bf16(2, 9, 8, 256), k=bf16(2, 13, 2, 256)), {}, ValueError, "head_dim = 256"),
        (with_(k=K[:1], v=V[:1]), {}, ValueError, "k has batch size 1 but q has 2"),
        (with_(q=bf16(2, 9, 3, 64)), {}, ValueError, "Hq = 3 (q) must be a multiple"),
        (with_(), {"deterministic": 1}, TypeError, "deterministic must be a bool"),
        (with_(), {"causal": None}, TypeError, "causal must be a bool"),
        (with_(), {"out": (Q, K)}, TypeError, "out must be a tuple (dq, dk, dv)"),
        (with_(), {"out": (Q, V, V[..., :32])}, ValueError, "out[2] (dv) must have shape"),
        (with_(), {"out": (Q, K, V.half())}, TypeError, "out[2] (dv) must have dtype"),
        (with_(), {}, ValueError, "q must be a CUDA tensor"),
    ],
)
def test_bad_backward_inputs_raise(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        forgekernel.attention_backward(*args, **kwargs)
    assert words in str(info.value)


def test_bad_deterministic_raises_in_the_forward():
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        forgekernel.attention(Q, K, V, deterministic="yes")
    packed = [t.detach() if isinstance(t, torch.Tensor) else t for t in varlen_args()]
    with pytest.raises(TypeError, match="deterministic must be a bool"):
        forgekernel.attention_varlen(*packed, deterministic=None)


def test_bad_varlen_backward_inputs_raise():
    q, k, v, cu_q, cu_k, mq, mk = (
        t.detach() if isinstance(t, torch.Tensor) else t for t in varlen_args()
    )
    o, lse, do = bf16(12, 8, 128), torch.empty(8, 12), bf16(12, 8, 128)
    with pytest.raises(ValueError, match=r"lse must have shape \(8, 12\)"):
        forgekernel.attention_varlen_backward(q, k, v, o, lse.T, do, cu_q, cu_k, mq, mk)
    with pytest.raises(ValueError, match="max_seqlen_q = 2 is less than the longest"):
        forgekernel.attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, 2, mk)
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        forgekernel.attention_varlen_backward(q, k, v, o, lse, do, cu_q, cu_k, mq, mk)


@pytest.mark.parametrize("deterministic", [False, True])
def test_compile_fullgraph_records_forward_and_backward_ops(kernels, deterministic):
    def loss(q, k, v):
        o, lse = forgekernel.attention(
            q, k, v, causal=True, return_lse=True, deterministic=deterministic
        )
        return o.float().square().sum() + lse.sum()

    q, k, v = qkv()
    loss(q, k, v).backward()
    eager = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    graphs = []
    torch._dynamo.reset()
    torch.compile(loss, fullgraph=True, backend=graphs_backend(graphs))(q, k, v).backward()
    assert len(graphs) == 2
    assert "forgekernel.attention_fwd.default" in graphs[0]
    assert "forgekernel.attention_bwd.default" in graphs[1]
    assert [c[2] for c in kernels] == [deterministic, deterministic]
    for got, want in zip((q.grad, k.grad, v.grad), eager):
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_compile_fullgraph_varlen(kernels):
    def loss(q, k, v, cu_q, cu_k):
        return forgekernel.attention_varlen(q, k, v, cu_q, cu_k, 9, 9, True).float().sum()

    q, k, v, cu_q, cu_k, _, _ = varlen_args()
    graphs = []
    torch._dynamo.reset()
    compiled = torch.compile(loss, fullgraph=True, backend=graphs_backend(graphs))
    compiled(q, k, v, cu_q, cu_k).backward()
    assert "forgekernel.attention_varlen_bwd.default" in graphs[1]
    do = torch.ones(12, 8, 128, dtype=torch.bfloat16)
    want = attention_varlen_bwd_ref(q, k, v, do, cu_q, cu_k, True)
    torch.testing.assert_close(q.grad, want[0].to(torch.bfloat16), rtol=0, atol=0)


def test_fake_tensors_take_the_backward_ops():
    def f(q, k, v, o, lse, do):
        return forgekernel.attention_backward(q, k, v, o, lse, do, True, deterministic=True)

    def f_out(q, k, v, o, lse, do, dq, dk, dv):
        return forgekernel.attention_backward(q, k, v, o, lse, do, out=(dq, dk, dv))

    with FakeTensorMode(allow_non_fake_inputs=True):
        cuda = {"device": "cuda", "dtype": torch.float16}
        q, o, do = (torch.empty(2, 100, 8, 128, **cuda) for _ in range(3))
        k, v = (torch.empty(2, 300, 2, 128, **cuda) for _ in range(2))
        lse = torch.empty(2, 8, 100, device="cuda")
        graph = make_fx(f, tracing_mode="fake")(q, k, v, o, lse, do)
        dq, dk, dv = f(q, k, v, o, lse, do)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        graph_out = make_fx(f_out, tracing_mode="fake")(q, k, v, o, lse, do, *grads)
    assert "forgekernel.attention_bwd.default" in str(graph.graph) and "True" in str(graph.graph)
    assert "forgekernel.attention_bwd_out" in str(graph_out.graph)
    assert dq.shape == q.shape and dk.shape == dv.shape == k.shape and dq.device.type == "cuda"


def test_opcheck_of_the_backward_op(kernels):
    q, k, v = (t.detach() for t in qkv())
    o, lse = attention_ref(q, k, v, True)
    args = (q, k, v, o.to(q.dtype), lse, bf16(2, 9, 8, 64), True, 0.125, False)
    torch.library.opcheck(torch.ops.forgekernel.attention_bwd.default, args)


def test_opcheck_of_the_differentiable_forward_op(kernels):
    q, k, v = qkv()
    torch.library.opcheck(torch.ops.forgekernel.attention_fwd.default, (q, k, v, True, 0.125))


@pytest.mark.gpu
def test_deterministic_backward_is_bitwise_repeatable_on_the_gpu():
    """OPS.md: deterministic=True gives bitwise-repeatable gradients (GQA 8:1: dk/dv sums)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    cuda = {"device": "cuda", "dtype": torch.bfloat16, "generator": gen}
    q, do = torch.randn(2, 1000, 16, 128, **cuda), torch.randn(2, 1000, 16, 128, **cuda)
    k, v = torch.randn(2, 1000, 2, 128, **cuda), torch.randn(2, 1000, 2, 128, **cuda)
    o, lse = forgekernel.attention(q, k, v, True, return_lse=True)
    runs = [
        forgekernel.attention_backward(q, k, v, o, lse, do, True, deterministic=True)
        for _ in range(3)
    ]
    for again in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], again))


def test_bwd_configs_fit_and_deepseek_layouts():
    from forgekernel.kernels.attention.bwd.sm90 import SPEC_MAIN, SPEC_POST
    from forgekernel.kernels.attention.bwd.sm90.config import (
        HEAD_DIMS,
        SMEM_CAPACITY,
        default_config,
        smem_bytes,
    )

    for d, dv in HEAD_DIMS:
        for det in (False, True):
            for varlen in (False, True):
                cfg = default_config(d, dv, det, varlen)
                assert smem_bytes(cfg, d, dv) <= SMEM_CAPACITY
    assert (192, 128) in HEAD_DIMS
    # DeepSeek: the key split in 32-query halves; varlen: the column split
    cfg = default_config(192, 128)
    assert (cfg.tile_n, cfg.tile_m, cfg.q_halves) == (128, 64, True)
    assert default_config(192, 128, False, True).tile_n == 64  # (BWD_NOTES.md)
    main = [dict(p) for p in SPEC_MAIN.standard_params() if dict(p)["head_dim"] == 192]
    assert len(main) == 16 and all(p["head_dim_v"] == 128 for p in main)
    assert all((p["tile_n"] == 64) == bool(p.get("varlen")) for p in main)
    post = [dict(p) for p in SPEC_POST.standard_params() if dict(p)["head_dim"] == 192]
    assert all(p["tile_m"] == 64 for p in post)
    assert default_config(64, 64).tile_n == default_config(128, 128).tile_n == 128
    # D=128: Dsum read with LSE, except varlen (it spills there)
    assert default_config(128, 128).dsum_early
    assert not default_config(128, 128, False, True).dsum_early
    # deterministic keeps the key-block-fastest launch order (the swizzled one lengthens the
    # GQA dQ chain, BWD_NOTES.md)
    for d, dv in HEAD_DIMS:
        assert default_config(d, dv, True).l2_swizzle == 0
    assert default_config(128, 128).l2_swizzle == default_config(64, 64).l2_swizzle == 4


@pytest.mark.parametrize("tile_m,d", [(64, 128), (128, 64), (64, 192)])
@pytest.mark.parametrize("halves", [False, True])
def test_dq_workspace_order_is_a_permutation(tile_m, d, halves):
    """The dQ accumulator order shared by the main kernel's staging stores and the postprocess
    (utils.dq_frag_offset): every element of the tile once; with `halves` (dq_split) warpgroup
    w's elements in half w; the main kernel's staging address formula (kernel._stage_dq)
    agrees."""
    from forgekernel.kernels.attention.bwd.sm90.utils import DQ_VEC, dq_frag_offset

    tile, threads = tile_m * d, 256
    n = tile // threads
    seen = []
    for t in range(threads):
        wg = t // 128
        for i in range(n):
            off = dq_frag_offset(t, i, n, halves)
            if halves:
                assert wg * tile // 2 <= off < (wg + 1) * tile // 2
                staged = t * DQ_VEC + wg * (tile // 2 - 128 * DQ_VEC)
                stride = DQ_VEC * 128
            else:
                staged, stride = t * DQ_VEC, DQ_VEC * threads
            assert off == staged + (i // DQ_VEC) * stride + i % DQ_VEC
            seen.append(off)
    assert sorted(seen) == list(range(tile))


@pytest.mark.parametrize("tm,tn", [(64, 128), (128, 128), (64, 64)])
def test_deterministic_causal_dq_order_is_a_chain_of_earlier_launched_blocks(tm, tn):
    """kernel._dq_turn (causal): for every query block, its contributing key blocks (those
    whose _query_blocks range holds it) take turns 0, 1, ... in descending key-block order,
    and each waits only for higher key blocks (launched before it: descending launch order),
    so the deterministic order cannot deadlock. Mirrors the kernel's integer formulas."""

    def m_begin(n, sq, sk):
        m_end = -(-sq // tm)
        return min(max(n * tn - (sk - sq), 0) // tm, m_end)

    def turn(n, m, sq, sk):
        n_max = min(((m + 1) * tm + sk - sq + tn - 1) // tn, -(-sk // tn))
        return n_max - 1 - n

    for sq, sk in [(1, 1), (17, 17), (1000, 1003), (4097, 4097), (100, 1000), (1000, 100),
                   (300, 65), (513, 513), (8192, 8192)]:  # fmt: skip
        m_end = -(-sq // tm)
        blocks = range(-(-sk // tn))
        for m in range(m_end):
            contrib = [n for n in blocks if m_begin(n, sq, sk) <= m]
            turns = sorted(turn(n, m, sq, sk) for n in contrib)
            assert turns == list(range(len(contrib))), (sq, sk, m)
            for n in contrib:  # waits only on higher key blocks
                assert all(k > n for k in contrib if turn(k, m, sq, sk) < turn(n, m, sq, sk))


@pytest.mark.parametrize("num_n", [1, 3, 64])
@pytest.mark.parametrize("pairs", [1, 2, 5, 8, 13])
@pytest.mark.parametrize("sw", [1, 2, 3, 4, 8, 100])
def test_l2_swizzle_order_is_a_permutation_key_blocks_ascending_per_pair(num_n, pairs, sw):
    """l2_swizzle: the 1-D grid covers every (key block, pair) once; within a pair the key
    blocks come in ascending order (deterministic causal reverses them, so a CTA still waits
    only for blocks dispatched before it); sections of `sw` pairs run one after another."""
    from forgekernel.kernels.attention.bwd.sm90.config import swizzled_block

    seen = [swizzled_block(i, num_n, pairs, sw) for i in range(num_n * pairs)]
    assert sorted(seen) == [(n, p) for n in range(num_n) for p in range(pairs)]
    for p in range(pairs):
        ns = [n for n, q in seen if q == p]
        assert ns == sorted(ns)
    sections = [p // min(sw, pairs) for _, p in seen]
    assert sections == sorted(sections)


def test_choose_config_head_split_for_small_gqa_descending_walk_for_long_gqa_at_d128():
    from forgekernel.kernels.attention.bwd.sm90.config import choose_config, default_config

    def pick(d, dv, det, b, sk, hq, hkv, causal=True):
        cfg = choose_config(d, dv, det, b, sk, hq, hkv, 132, causal)
        return cfg.head_split, cfg.l2_swizzle, cfg.walk_order

    sw = default_config(128, 128).l2_swizzle
    assert pick(128, 128, False, 1, 1000, 4, 2) == (2, sw, 0)  # 16 kv tiles: under two waves
    assert pick(128, 128, False, 2, 16384, 64, 8) == (0, 8, 2)  # long keys: descending walk
    assert pick(128, 128, False, 4, 8192, 64, 8) == (0, sw, 0)  # 2048 kv tiles, s8192
    # GQA 16 up to 4096 keys (causal): the head split whatever the waves
    assert pick(128, 128, False, 8, 4096, 32, 2) == (2, sw, 0)
    assert pick(128, 128, False, 16, 2048, 32, 2) == (2, sw, 0)
    assert pick(128, 128, False, 4, 8192, 32, 2) == (0, sw, 0)  # s8192: the walk (0.990)
    assert pick(128, 128, False, 8, 4096, 32, 4) == (0, sw, 0)  # GQA 8 keeps the walk
    assert pick(128, 128, False, 8, 4096, 32, 2, causal=False) == (0, sw, 0)  # not measured
    assert pick(128, 128, False, 2, 16384, 64, 8, causal=False) == (0, sw, 0)
    assert pick(128, 128, False, 1, 1000, 4, 4) == (0, sw, 0)  # MHA
    assert pick(128, 128, False, 2, 16384, 32, 32) == (0, sw, 0)  # MHA, long keys
    assert pick(128, 128, True, 2, 16384, 64, 8) == (0, 0, 0)  # deterministic: ascending
    assert pick(128, 128, True, 1, 1000, 4, 2)[0] == 0  # deterministic keeps the walk
    assert pick(64, 64, False, 1, 1000, 4, 2)[0] == 0  # D = 64: persistent instead
    assert choose_config(64, 64, False, 2, 8192, 32, 32, 132) == default_config(64, 64)


def _preprocess_zeroing(dq_acc: torch.Tensor, sq_pad: int) -> None:
    """What the fixed-length preprocess (preprocess.py `_zero_dq`) writes into its dQ
    accumulator argument (B, Hq, W): block m of row (b, h) zeroes its 128 rows' run of
    128 * (W // Sq_pad // 4) * 4 floats from m times that, 16 bytes per thread and store."""
    run = 128 * (dq_acc.shape[2] // sq_pad // 4) * 4
    for b in range(dq_acc.shape[0]):
        for h in range(dq_acc.shape[1]):
            row = dq_acc[b, h]
            for m in range(sq_pad // 128):
                row[m * run : (m + 1) * run] = 0


@pytest.fixture
def recorded_launches(monkeypatch):
    """The launcher with recording stand-ins for the three compiled kernels (name, args), on
    a 132-SM device, the fixed-length preprocess zeroing as the kernel does, with torch.empty's
    memory filled (NaN / int max) and a fresh scratch buffer, so that a workspace the kernels
    need zeroed is seen zeroed only when the launcher or the preprocess zeroed it."""
    calls = []

    def get_kernel(spec, params):
        def kernel(*args):
            calls.append((spec.name, dict(params), args))
            if spec.name == "attention_bwd_pre_sm90" and args[6] is not None:
                _preprocess_zeroing(args[6], args[3].shape[2])

        return kernel

    monkeypatch.setattr(bwd_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(bwd_launch, "num_sms", lambda index: 132)
    monkeypatch.setattr(scratch, "_SLOTS", {})
    bwd_launch._plans.clear()
    bwd_launch._varlen_workspaces.clear()
    deterministic_before = torch.are_deterministic_algorithms_enabled()
    fill_before = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield calls
    torch.use_deterministic_algorithms(deterministic_before)
    torch.utils.deterministic.fill_uninitialized_memory = fill_before
    bwd_launch._plans.clear()
    bwd_launch._varlen_workspaces.clear()


def _zeroed(t):
    return bool((t == 0).all())


@pytest.mark.parametrize(
    "shape, deterministic, head_split, persistent",
    [
        ((2, 300, 300, 4, 4, 128), False, False, False),  # MHA D = 128
        ((1, 128, 128, 32, 8, 128), False, True, False),  # GQA under two waves: head_split
        ((1, 128, 128, 32, 8, 128), True, False, False),  # deterministic: zeroed semaphores
        ((2, 200, 200, 8, 8, 64), False, False, True),  # D = 64: persistent (tile counter)
        # few queries, many keys: the dK / dV accumulators are > the dQ accumulator's size,
        # zeroed by the launcher
        ((1, 64, 1000, 4, 2, 128), False, True, False),
    ],
)
def test_launch_workspaces(recorded_launches, shape, deterministic, head_split, persistent):
    """The fixed-length launch: workspaces (B, Hq, Sq_pad) LSE / Dsum, (B, Hq, Sq_pad * D) dQ
    accumulator, (B, Hq, Sq_pad / tile_m) int32 semaphores zeroed when deterministic or
    persistent, fp32 dK / dV accumulators zeroed under head_split (copied into dk, dv after):
    contiguous, 512-byte aligned offsets of one buffer, no two overlapping. The preprocess's
    dQ-accumulator argument is a (B, Hq, W) row-major view from the accumulator's start that
    its zeroing turns into every zeroed buffer (unless the launcher zeroes the others: no
    zeroing twice) and never reaches LSE / Dsum."""
    b, sq, sk, hq, hkv, d = shape
    q, k, v, o, do = (
        bf16(b, sq, hq, d),
        bf16(b, sk, hkv, d),
        bf16(b, sk, hkv, d),
        bf16(b, sq, hq, d),
        bf16(b, sq, hq, d),
    )
    lse = torch.randn(b, hq, sq)
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        bwd_launch.attention_bwd(q, k, v, o, lse, do, dq, dk, dv, 0.1, True, deterministic)
    zero_fills = [e for e in prof.events() if e.name == "aten::zero_"]
    (pre, pre_p, pre_args), (main, main_p, args), (post, _, post_args) = recorded_launches
    assert (pre, main, post) == (
        "attention_bwd_pre_sm90",
        "attention_bwd_sm90",
        "attention_bwd_post_sm90",
    )
    assert main_p.get("head_split", 0) == (2 if head_split else 0)
    assert main_p.get("persistent", False) == persistent
    lse2, dsum, dq_acc, dk_main, dv_main, sem = args[4], args[5], args[6], args[7], args[8], args[9]
    s_pad = -(-sq // 128) * 128
    assert lse2.shape == dsum.shape == (b, hq, s_pad) and dq_acc.shape == (b, hq, s_pad * d)
    assert sem.shape == (b, hq, s_pad // main_p["tile_m"]) and sem.dtype == torch.int32
    assert pre_args[3] is lse2 and pre_args[4] is dsum and post_args[0] is dq_acc
    assert post_args[1] is dq
    pre_dq = pre_args[6]
    width = pre_dq.shape[2]
    assert pre_dq.shape[:2] == (b, hq) and width % (4 * s_pad) == 0 and width >= s_pad * d
    assert pre_dq.is_contiguous() and pre_dq.data_ptr() == dq_acc.data_ptr()
    assert _zeroed(dq_acc) and _zeroed(sem) == (deterministic or persistent)
    assert not _zeroed(lse2) and not _zeroed(dsum)  # left uninitialized for the kernels
    if head_split:
        assert dk_main.dtype == dv_main.dtype == torch.float32
        assert dk_main.shape == k.shape and _zeroed(dk_main) and _zeroed(dv_main)
    else:
        assert dk_main is dk and dv_main is dv
    # a fill kernel only where the preprocess's rows would be over twice the accumulator's
    assert len(zero_fills) == (width == s_pad * d and (head_split or deterministic or persistent))
    ws = [lse2, dsum, dq_acc, sem] + ([dk_main, dv_main] if head_split else [])
    base = lse2.untyped_storage().data_ptr()
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * 4) for t in ws)
    assert all(t.is_contiguous() and t.untyped_storage().data_ptr() == base for t in ws)
    assert all((t.data_ptr() - base) % 512 == 0 for t in ws)
    assert all(end <= start for (_, end), (start, _) in zip(spans, spans[1:]))
    # the persistent kernel's CTA count: one per kv tile up to one per SM
    assert args[12] == (min(-(-sk // 128) * hkv * b, 132) if persistent else 0)


@pytest.mark.parametrize("deterministic", [False, True])
def test_launch_varlen_workspaces(recorded_launches, deterministic):
    """Varlen: (Hq, rows) LSE / Dsum, the dQ accumulator zeroed, semaphores zeroed when
    deterministic."""
    from forgekernel.kernels.attention.bwd.sm90.config import varlen_ws_rows

    lens = (100, 0, 300)
    cu = torch.tensor([0, 100, 100, 400], dtype=torch.int32)
    q, k, v, o, do = (bf16(400, h, 128) for h in (4, 2, 2, 4, 4))
    dq, dk, dv = (torch.empty_like(t) for t in (q, k, v))
    lse = torch.randn(4, 400)
    bwd_launch.attention_bwd(
        q, k, v, o, lse, do, dq, dk, dv, 0.1, True, deterministic, cu, cu, max(lens), max(lens)
    )
    _, (_, _, args), _ = recorded_launches
    lse2, dsum, dq_acc, sem = args[4], args[5], args[6], args[9]
    rows = varlen_ws_rows(400, 3)
    assert lse2.shape == dsum.shape == sem.shape == (4, rows) and dq_acc.shape == (4, rows * 128)
    assert _zeroed(dq_acc) and _zeroed(sem) == deterministic and not _zeroed(lse2)
    assert (dsum.data_ptr() - lse2.data_ptr()) % 512 == 0
    assert args[7] is dk and args[8] is dv


def test_launch_layout_checks_are_remembered_per_strides_not_per_address(monkeypatch):
    """The launcher passes tensors laid out as the kernels take them as they are, and copies
    (or, gradients, writes through a compact buffer) the others: its per-layout memo answers
    for the strides, never for a base address (checked per call) or another layout."""
    seen = []
    monkeypatch.setattr(bwd_launch, "_launch_kernels", lambda *args: seen.append(args[:9]))
    bwd_launch.clear_plans()

    def call(**change):
        t = {
            "q": bf16(1, 64, 4, 64),
            "k": bf16(1, 64, 2, 64),
            "v": bf16(1, 64, 2, 64),
            "o": bf16(1, 64, 4, 64),
            "lse": torch.randn(1, 4, 64),
            "do": bf16(1, 64, 4, 64),
        }
        t |= {"dq": torch.empty_like(t["q"]), "dk": torch.empty_like(t["k"]),
              "dv": torch.empty_like(t["v"])} | change  # fmt: skip
        bwd_launch.attention_bwd(*t.values(), 0.1, True)
        return [got is t[name] for got, name in zip(seen[-1], t)]

    assert all(call()) and all(call())
    shifted = torch.empty(64 * 4 * 64 + 1, dtype=torch.bfloat16)[1:].view(1, 64, 4, 64)
    assert shifted.stride() == bf16(1, 64, 4, 64).stride()  # the memo's key, a new address
    assert call(q=shifted) == [False] + [True] * 8
    assert call(dq=shifted) == [True] * 6 + [False, True, True]
    # compact by torch's rule, but the size-1 batch dim's stride is not a 16-byte multiple
    odd = torch.empty(1, 64, 2, 64, dtype=torch.bfloat16).as_strided(
        (1, 64, 2, 64), (1, 128, 64, 1)
    )
    assert odd.is_contiguous() and call(dk=odd) == [True] * 7 + [False, True]
    assert call(k=odd) == [True, False] + [True] * 7
    assert all(call())


def test_launch_plans_are_chosen_once_per_problem(recorded_launches, monkeypatch):
    """The config, compile keys and workspace layout of a problem are chosen on its first
    launch only (the same launches after); another length gets its own plan."""
    chosen = []
    choose = bwd_launch.choose_config
    monkeypatch.setattr(bwd_launch, "choose_config", lambda *a: chosen.append(a) or choose(*a))

    def launch(sq):
        q, k, v = bf16(1, sq, 8, 128), bf16(1, 100, 2, 128), bf16(1, 100, 2, 128)
        o, do, lse = bf16(1, sq, 8, 128), bf16(1, sq, 8, 128), torch.randn(1, 8, sq)
        grads = (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v))
        bwd_launch.attention_bwd(q, k, v, o, lse, do, *grads, 0.1, True)

    def layout(args):
        return [(a.shape, a.stride(), a.dtype) if isinstance(a, torch.Tensor) else a for a in args]

    launch(100)
    launch(100)
    assert len(chosen) == 1
    first, again = recorded_launches[:3], recorded_launches[3:]
    assert [(n, p, layout(a)) for n, p, a in first] == [(n, p, layout(a)) for n, p, a in again]
    launch(50)
    assert len(chosen) == 2


class _DropsTheGradient(torch.autograd.Function):
    """x -> x whose backward returns no gradient for x (autograd then calls the attention
    node's backward without dO)."""

    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, g):
        return None


def test_autograd_materializes_no_dlse_and_a_missing_do_as_zeros(kernels, monkeypatch):
    """The eager Function's backward gets None for dLSE (no zero tensor per backward); a
    missing dO reaches the kernel as zeros, as autograd's materialized gradient did."""
    seen = []
    grad_fwd = bwd_module._grad_fwd
    monkeypatch.setattr(
        bwd_module,
        "_grad_fwd",
        lambda ctx, do, dlse: seen.append((do, dlse)) or grad_fwd(ctx, do, dlse),
    )
    q, k, v = qkv()
    o, lse = forgekernel.attention(q, k, v, True, return_lse=True)
    o.sum().backward()
    assert seen[0][1] is None and seen[0][0] is not None
    q.grad = k.grad = v.grad = None
    o, _ = forgekernel.attention(q, k, v, True, return_lse=True)
    (_DropsTheGradient.apply(o).float().sum() + 0 * q.float().sum()).backward()
    assert seen[1] == (None, None)  # autograd called the node without dO
    assert kernels[-1] == (True, 64**-0.5, False, False)
    assert all(_zeroed(g) for g in (q.grad, k.grad, v.grad))
