"""The DSA sparse backward's preprocess leaf (kernels/attention/dsa_sparse_bwd_pre/sm90) and the
op's torch around the kernels, on the CPU (the kernel's numbers on the GPU:
tests/gpu/test_dsa_sparse_bwd_pre_gpu.py; its SASS: tests/test_dsa_sparse_bwd_pre_compile.py):
compile keys and grid, the launcher's input checks, and ops/dsa_bwd.py's plumbing with both
launchers stood in by torch: the preprocess kernel's results handed to the backward launcher
(`pre=`), q and the cache read in place where they are cut from one buffer (no concatenation),
the eager gradients views of the two buffers (no split or join copies), the custom op's
contiguous ones, the same numbers as the interim path."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.attention.dsa_sparse_bwd.sm90 import launch as bwd_launch
from forgekernel.kernels.attention.dsa_sparse_bwd_pre.sm90 import SPEC, config, launch
from forgekernel.ops import dsa as fwd
from forgekernel.ops import dsa_bwd as bwd
from forgekernel.reference.dsa import dsa_sparse_attention_bwd_ref

LATENT, WIDTH = 512, 576


def test_params_grid_and_builds():
    assert config.params_for("bfloat16", True, False) == (
        ("dlse", False), ("dtype", "bfloat16"), ("sink", True),
    )  # fmt: skip
    with pytest.raises(ValueError, match="dtype"):
        config.params_for("float32", False, False)
    assert len(set(SPEC.standard_params())) == 8  # 2 dtypes x sink x dLSE
    assert SPEC.representative() in SPEC.standard_params() and not SPEC.mma
    assert config.LOADS * config.VEC * config.LANES == config.D_V == LATENT
    assert config.grid(130, 16) == (130, 4, 1) and config.grid(7, 18) == (7, 5, 1)


def test_unsupported_names_the_reason():
    out = torch.zeros(3, 16, LATENT, dtype=torch.bfloat16)
    assert "CUDA" in launch.unsupported(out, out)
    assert "16-bit" in launch.unsupported(out.float(), out.float())
    assert "16-bit" in launch.unsupported(out, out.half())
    assert "(tokens, H, 512)" in launch.unsupported(out[..., :256], out[..., :256])


def test_joined_views_only_where_rows_follow():
    q = torch.randn(4, 16, WIDTH)
    qn, qp = q[..., :LATENT], q[..., LATENT:]
    whole = bwd._joined(qn, qp)
    assert whole is not None and whole.data_ptr() == q.data_ptr() and torch.equal(whole, q)
    assert bwd._cat(qn, qp).data_ptr() == q.data_ptr()
    assert bwd._joined(qn.contiguous(), qp.contiguous()) is None  # two buffers
    assert bwd._joined(qp, qn) is None  # wrong order
    assert bwd._joined(q[..., :256], q[..., 320:]) is None  # a gap
    assert bwd._joined(q[:, ::2, :LATENT], qp[:, 1::2]) is None  # other rows
    wide = torch.randn(4, 16, 1024)  # rows of a wider buffer: a view with its strides
    got = bwd._joined(wide[..., :LATENT], wide[..., LATENT : LATENT + 64])
    assert got is not None and got.stride() == wide.stride()
    assert torch.equal(got, wide[..., :WIDTH])
    copied = bwd._cat(qn.contiguous(), qp.contiguous())
    assert copied.data_ptr() != q.data_ptr() and torch.equal(copied, q)
    assert bwd._joined(qn[:0], qp[:0]) is None


def _args(combined: bool, seed: int = 3):
    g = torch.Generator().manual_seed(seed)
    tokens, heads, pages, page = 5, 16, 3, 8
    q = torch.randn(tokens, heads, WIDTH, generator=g).bfloat16()
    cache = torch.randn(pages, page, 1, WIDTH, generator=g).bfloat16()
    if combined:
        ckv, kpe = cache.squeeze(2).split_with_sizes((LATENT, WIDTH - LATENT), -1)
        qn, qp = q[..., :LATENT], q[..., LATENT:]
    else:
        ckv, kpe = cache[:, :, 0, :LATENT].contiguous(), cache[:, :, 0, LATENT:].contiguous()
        qn, qp = q[..., :LATENT].contiguous(), q[..., LATENT:].contiguous()
    idx = torch.randint(-1, pages * page, (tokens, 12), generator=g, dtype=torch.int32)
    out = torch.randn(tokens, heads, LATENT, generator=g).bfloat16()
    lse = torch.randn(tokens, heads, generator=g) + 4
    dout = torch.randn(tokens, heads, LATENT, generator=g).bfloat16()
    dlse = torch.randn(tokens, heads, generator=g)
    sink = torch.randn(heads, generator=g)
    return (qn, qp, ckv, kpe, idx, WIDTH**-0.5, out, lse, dout, dlse, sink), q, cache


@pytest.fixture
def stand_ins(monkeypatch):
    """Both launchers taken on the CPU, in torch: the preprocess kernel as the torch form, the
    backward kernel as the reference given the rows it is handed (recorded in `seen`)."""
    seen: dict = {}

    def pre(out, dout, lse, dlse, sink):
        seen["pre"] = bwd_launch.preprocess(out, dout, lse, dlse, sink)
        return seen["pre"]

    def kernel(q, kv, dout, out, lse, dlse, sink, idx, scale, pre=None):
        seen.update(q=q, kv=kv, handed=pre)
        dq, dkv, _ = dsa_sparse_attention_bwd_ref(
            q, kv, idx, scale, dout, attn_sink=sink, out=out, lse=lse, dlse=dlse, d_v=LATENT,
            dtype=torch.float32, dq_dtype=q.dtype,
        )  # fmt: skip
        return dq, dkv, pre[2]

    monkeypatch.setenv(bwd.KERNEL_ENV, "1")
    monkeypatch.setattr(bwd.kernel_launch, "unsupported", lambda *a: None)
    monkeypatch.setattr(bwd.kernel_launch, "dsa_sparse_bwd", kernel)
    monkeypatch.setattr(bwd.pre_launch, "unsupported", lambda *a: None)
    monkeypatch.setattr(bwd.pre_launch, "preprocess", pre)
    monkeypatch.setattr(fwd, "check_cuda", lambda name, t: None)
    return seen


@pytest.mark.parametrize("combined", [True, False], ids=["one-buffer", "apart"])
def test_kernel_path_plumbing(stand_ins, combined):
    """The preprocess kernel's outputs reach the backward launcher; q and the cache are read in
    place when cut from one buffer; the gradients equal the interim path's."""
    args, q, cache = _args(combined)
    full = bwd._backward_full(*args)
    seen = stand_ins
    assert seen["handed"] is seen["pre"]
    assert (seen["q"].data_ptr() == q.data_ptr()) == combined
    assert (seen["kv"].data_ptr() == cache.data_ptr()) == combined
    want = bwd._backward_interim(*args)
    assert full[1].dtype == torch.bfloat16 and full[1].shape == (cache.shape[0] * 8, WIDTH)
    torch.testing.assert_close(full[0], want[0], rtol=0, atol=0)
    torch.testing.assert_close(full[1], want[1], rtol=0, atol=0)
    torch.testing.assert_close(full[2], want[2], rtol=1e-5, atol=1e-6)


def test_eager_gradients_are_views_and_the_custom_op_copies(stand_ins, monkeypatch):
    """Eager: dq_nope / dq_pe views of one (S, H, 576) buffer, the combined cache's gradient
    the (slots, 576) buffer itself (no torch.cat of 512-wide rows); the custom op's outputs
    contiguous, alias-free; the same numbers."""
    args, q, cache = _args(True)
    cats = []
    real_cat = torch.cat

    def spy(tensors, dim=0, **kw):
        cats.append([tuple(t.shape) for t in tensors])
        return real_cat(tensors, dim, **kw)

    monkeypatch.setattr(torch, "cat", spy)
    dq_nope, dq_pe, dcache, dkpe, d_sink = bwd.dsa_sparse_attention_backward(
        args[0], args[1], cache, None, args[4], args[8], softmax_scale=args[5], out=args[6],
        lse=args[7], attn_sink=args[10], dlse=args[9],
    )  # fmt: skip
    assert dkpe is None and dcache.shape == cache.shape and dcache.is_contiguous()
    assert dq_pe.data_ptr() == dq_nope.data_ptr() + LATENT * 2  # one buffer
    assert not any(s[0][-1] == LATENT for s in cats), cats  # no join of 512-wide rows
    monkeypatch.setattr(torch, "cat", real_cat)
    grads = bwd._backward_impl(*args)
    assert all(g.is_contiguous() for g in grads)
    assert len({g.untyped_storage().data_ptr() for g in grads}) == 5
    torch.testing.assert_close(torch.cat(grads[:2], -1), torch.cat((dq_nope, dq_pe), -1))
    torch.testing.assert_close(torch.cat(grads[2:4], -1).unsqueeze(2), dcache)
    torch.testing.assert_close(grads[4], d_sink)
