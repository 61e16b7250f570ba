"""The Gated DeltaNet backward's kernel 2 (kernels/linear_attention/gdn_bwd_chunk/sm90) on the
CPU: its tile emulation (`reference.gdn_bwd_chunk.chunk_grads_model`: the kernel's products per
chunk, dPD rounded to the tiles' dtype as its 16-bit operands are) plus the torch finish equals
reference/delta_rule_bwd.py `_output_grads` exactly in fp64 (nothing rounded) and within
tolerance with bf16 / fp16 tiles, on awkward T; the launcher's torch-only checks. The op with
both kernels emulated: tests/test_gdn_bwd_kernel_path.py; the GPU twin:
tests/gpu/test_gdn_bwd_chunk_gpu.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgekernel.reference.delta_rule_bwd import _output_grads
from forgekernel.reference.gdn_bwd_chunk import (
    chunk_grad_tiles,
    chunk_grads_model,
    finish_output_grads,
)
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens


def problem(b, t, hv, dk=16, dv=8, seed=0, dtype=torch.float64):
    """Chunk factors of random inputs and random h, dh, U, dU (U, dU zero past T, as the
    recurrences leave them) -> (f, do (B, T, HV, V), do chunked, h, dh, U, dU, qs, ks, g)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    qs, ks = rnd(b, t, hv, dk) * 0.3, F.normalize(rnd(b, t, hv, dk), dim=-1)
    v, do = rnd(b, t, hv, dv), rnd(b, t, hv, dv)
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta)
    nc = f.w.shape[1]
    h, dh = rnd(b, nc, hv, dk, dv) * 0.5, rnd(b, nc, hv, dk, dv) * 0.5
    big_u, d_u = (to_chunks(rnd(b, t, hv, dv), nc) for _ in range(2))
    return f, do, to_chunks(do, nc), h, dh, big_u, d_u, qs, ks, g


def kernel_outputs(qs, ks, do, big_u, d_u, h, dh, g, dtype):
    """The emulated kernel on `chunk_grad_tiles`' inputs in `dtype`, fp64 arithmetic."""
    tiles = chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)
    low = dtype in (torch.float16, torch.bfloat16)

    def rounding(x):
        return x.to(dtype).to(x.dtype)

    wide = [x.double() for x in tiles]
    return chunk_grads_model(*wide, rounding if low else None)


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 2])
def test_emulation_is_output_grads_fp64(t, b):
    f, do, do_c, h, dh, big_u, d_u, qs, ks, g = problem(b, t, 3, seed=t)
    dq, dk, dw, dg, te = kernel_outputs(qs, ks, do, big_u, d_u, h, dh, g, torch.float64)
    dw_c, d_g = finish_output_grads(dg, te, dw, h, dh, f.e_last)
    want = _output_grads(f, do_c, h, dh, big_u, d_u)
    for name, a, r in zip(("dq", "dk", "dw", "dg"), (dq, dk, dw_c, d_g), want):
        if name in ("dq", "dk"):
            r = to_tokens(r)[:, :t]
        torch.testing.assert_close(a, r, rtol=1e-10, atol=1e-10, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [65, 200])
def test_emulation_rounded(t, dtype):
    """16-bit tiles (do, U, dU, q, k, h, dh and dPD rounded): within 2e-2 of each gradient's
    max."""
    f, do, do_c, h, dh, big_u, d_u, qs, ks, g = problem(2, t, 2, dk=32, dv=16, seed=t)
    dq, dk, dw, dg, te = kernel_outputs(qs, ks, do, big_u, d_u, h, dh, g, dtype)
    dw_c, d_g = finish_output_grads(dg, te, dw, h, dh, f.e_last)
    want = _output_grads(f, do_c, h, dh, big_u, d_u)
    for name, a, r in zip(("dq", "dk", "dw", "dg"), (dq, dk, dw_c, d_g), want):
        if name in ("dq", "dk"):
            r = to_tokens(r)[:, :t]
        err = float((a - r).abs().max())
        assert err <= 2e-2 * float(r.abs().max()), (name, err, float(r.abs().max()))


def test_launcher_checks():
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import check_inputs

    b, t, hv, nc = 2, 70, 3, 2
    x16 = torch.zeros(b, t, hv, 128, dtype=torch.bfloat16)
    st = torch.zeros(b, nc, hv, 128, 128, dtype=torch.bfloat16)
    big_g = torch.zeros(b, t, hv)
    assert check_inputs(x16, x16, x16, x16, x16, st, st, big_g) == (b, t, hv, nc)
    with pytest.raises(TypeError):
        check_inputs(x16.half(), x16, x16, x16, x16, st, st, big_g)
    with pytest.raises(ValueError):
        check_inputs(x16, x16, x16, x16, x16, st[:, :1], st, big_g)
    with pytest.raises(ValueError):
        check_inputs(x16, x16, x16, x16, x16, st, st, big_g.double())
    with pytest.raises(ValueError):
        small = torch.zeros(b, t, hv, 64, dtype=torch.bfloat16)
        check_inputs(x16, x16, x16, small, small, st, st, big_g)


def wy_outputs(f, qs, ks, v, beta, do, big_u, d_u, h, dh, g, dtype):
    """The emulated WY variant on its inputs in `dtype`, fp64 arithmetic."""
    from forgekernel.reference.gdn_bwd_chunk import wy_grads_model, wy_tiles

    tiles = [x.double() for x in chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)]
    extra = [x.double() for x in wy_tiles(f, v, beta, dtype)]
    low = dtype in (torch.float16, torch.bfloat16)

    def rounding(x):
        return x.to(dtype).to(x.dtype)

    r = rounding if low else None
    out = chunk_grads_model(*tiles, r)
    return wy_grads_model(out, tiles[2], tiles[4], tiles[5], tiles[7], *extra, r, r)


def wy_problem(b, t, hv, dk=16, dv=8, seed=0):
    f, do, do_c, h, dh, big_u, d_u, qs, ks, g = problem(b, t, hv, dk=dk, dv=dv, seed=seed)
    return f, do, do_c, h, dh, big_u, d_u, qs, ks, g, to_tokens(f.v)[:, :t], to_tokens(
        f.beta.unsqueeze(-1))[:, :t, :, 0]


@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 2])
def test_wy_emulation_is_pass_3_fp64(t, b):
    """The WY variant (`wy_grads_model` after `chunk_grads_model`, `finish_wy`) equals
    `_output_grads` + `_wy_grads` (dk, dv, dbeta, dG before the cumsum) in fp64."""
    from forgekernel.reference.delta_rule_bwd import _wy_grads
    from forgekernel.reference.gdn_bwd_chunk import finish_wy

    f, do, do_c, h, dh, big_u, d_u, qs, ks, g, v, beta = wy_problem(b, t, 3, seed=t)
    dq, dk, dg, te, dv, dbeta = wy_outputs(f, qs, ks, v, beta, do, big_u, d_u, h, dh, g,
                                           torch.float64)  # fmt: skip
    d_g = finish_wy(dg, te, h, dh, f.e_last)
    dq_r, dk_r, dw_r, dg_r = _output_grads(f, do_c, h, dh, big_u, d_u)
    dk_wy, dv_r, dbeta_r, dg_wy = _wy_grads(f, dw_r, d_u)
    want = {"dq": to_tokens(dq_r)[:, :t], "dk": to_tokens(dk_r + dk_wy)[:, :t],
            "dv": to_tokens(dv_r)[:, :t], "dbeta": to_tokens(dbeta_r)[:, :t],
            "dg": dg_r + dg_wy}  # fmt: skip
    got = {"dq": dq, "dk": dk, "dv": dv, "dbeta": dbeta, "dg": d_g}
    for name in want:
        torch.testing.assert_close(got[name], want[name], rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [65, 200])
def test_wy_emulation_rounded(t, dtype):
    from forgekernel.reference.delta_rule_bwd import _wy_grads
    from forgekernel.reference.gdn_bwd_chunk import finish_wy

    f, do, do_c, h, dh, big_u, d_u, qs, ks, g, v, beta = wy_problem(2, t, 2, dk=32, dv=16,
                                                                    seed=t)  # fmt: skip
    dq, dk, dg, te, dv, dbeta = wy_outputs(f, qs, ks, v, beta, do, big_u, d_u, h, dh, g, dtype)
    d_g = finish_wy(dg, te, h, dh, f.e_last)
    dq_r, dk_r, dw_r, dg_r = _output_grads(f, do_c, h, dh, big_u, d_u)
    dk_wy, dv_r, dbeta_r, dg_wy = _wy_grads(f, dw_r, d_u)
    want = {"dk": to_tokens(dk_r + dk_wy)[:, :t], "dv": to_tokens(dv_r)[:, :t],
            "dbeta": to_tokens(dbeta_r)[:, :t], "dg": dg_r + dg_wy}  # fmt: skip
    got = {"dk": dk, "dv": dv, "dbeta": dbeta, "dg": d_g}
    for name in want:
        err = float((got[name] - want[name]).abs().max())
        assert err <= 2e-2 * float(want[name].abs().max()), (name, err)
