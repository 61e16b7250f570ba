"""The KDA forward's first pass with its `bwd` key (kernels/linear_attention/kda_prefill/sm90
`intra.py`, `launch.first_pass_kernel(..., bwd=True)`) on the GPU against its torch model
(`operands.kda_chunk_operands(..., bwd=True)`): tt (T^T unscaled, bf16) and big_g (G, fp32)
over the real chunks, rows past each sequence exact zeros, and the forward's outputs bitwise
those of the forward's key; W = T_beta Kg and u = T_beta V (next/kda-wu) one bf16 rounding from
the fp64 products of the kernel's own t_beta, k_g and v rows. The CPU twin:
tests/test_kda_first_pass_bwd.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu
C = 64


def _inputs(lens, h, hv, dtype, seed, strong):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(total, h, 128).to(dtype)
    k = F.normalize(rnd(total, h, 128), dim=-1).to(dtype)
    if strong:
        g = -4.0 - torch.rand(total, hv, 128, device="cuda", generator=gen)
    else:
        g = F.logsigmoid(rnd(total, hv, 128) + 2.0)
    beta = torch.sigmoid(rnd(total, hv))
    v = rnd(total, hv, 128).to(dtype)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, g, beta, v, cu.to(torch.int32)


def _close(got, want, rel, atol=1e-5):
    assert got.shape == want.shape and torch.isfinite(got).all()
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + atol, err


def _products_of_its_rows(got, v, real):
    """W and u against the fp64 products of the kernel's own bf16 rows chunk by chunk (t_beta,
    k_g, v rounded to bf16 as the kernel's fp16 key rounds it; v's rows by the layout: the
    tokens of the real chunks): one bf16 rounding (2^-8 relative) plus fp32 sums in another
    order (1e-5 of the largest entry). Falsifier: a wrong fragment mapping is off by O(1)."""

    def chunks(x):  # (64 real, HV, D) -> (real, HV, 64, D) fp64
        return x[: C * real].double().unflatten(0, (real, C)).transpose(1, 2)

    tb = chunks(got["t_beta"])
    for name, x in (("w", chunks(got["k_g"])), ("u", chunks(v))):
        exact = tb @ x
        out = chunks(got[name])
        err = (out - exact).abs()
        assert (err <= 2**-8 * exact.abs() + 1e-5 * exact.abs().max()).all(), (
            name, float(err.max()))  # fmt: skip


def _v_rows(v, cu, real):
    """v (T, HV, V) laid out as the first pass's rows (64 a real chunk, zeros past each
    sequence), bf16."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.operands import (
        chunk_bound,
        chunk_tables,
        row_tokens,
    )

    _, starts, lengths = chunk_tables(cu, chunk_bound(v.shape[0], cu.numel() - 1))
    token = row_tokens(starts, lengths)[: C * real]
    rows = v.to(torch.bfloat16)[token.clamp(min=0)]
    return torch.where((token >= 0).view(-1, 1, 1), rows, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "lens, h, hv, strong",
    [
        ([1, 63, 64, 65, 200], 2, 4, True),
        ([100, 0, 37, 0, 1000], 4, 4, False),
        ([129], 1, 2, False),
    ],
)
def test_bwd_outputs_equal_the_model(dtype, lens, h, hv, strong):
    """tt within 1e-2 of T's largest entry (tf32 merges, bf16 operands: the bound t_beta is
    held to), big_g within 2e-5 of G's largest magnitude (ln 2 x the kernel's exp2-form sums
    vs the model's cumsum), zeros past each sequence; the forward's outputs bitwise the
    forward key's (the flag adds stores only), P as P^T ("pt", each chunk transposed)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    q, k, g, beta, v, cu = _inputs(lens, h, hv, dtype, seed=31, strong=strong)
    real = sum(-(-n // C) for n in lens)
    got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, bwd=True, v=v)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False, bwd=True, v=v)
    assert got["tt"].dtype == torch.bfloat16 and got["big_g"].dtype == torch.float32
    _close(got["tt"][: C * real].float(), want["tt"][: C * real].float(), 1e-2)
    _close(got["big_g"][: C * real], want["big_g"][: C * real], 2e-5)
    # W, u (next/kda-wu): the model's within t_beta's bound, the products of the kernel's own
    # rows to one rounding
    for name in ("w", "u"):
        _close(got[name][: C * real].float(), want[name][: C * real].float(), 1e-2)
    _products_of_its_rows(got, _v_rows(v, cu, real), real)
    fwd = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    for name in ("q_g", "k_g", "k_d", "t_beta", "decay"):
        cut = real if name == "decay" else C * real
        assert torch.equal(got[name][:cut], fwd[name][:cut]), name
    # P^T in P's place (next/kda-glue3): the forward key's P, each chunk transposed, bitwise
    pt = fwd["p"][: C * real].unflatten(0, (real, C)).permute(0, 3, 2, 1)  # [c, j, h, i]
    assert "p" not in got and torch.equal(got["pt"][: C * real], pt.flatten(0, 1))
    row = 0  # rows past each sequence's end, within its last chunk: exact zeros
    for n in lens:
        chunks = -(-n // C)
        pad = slice(row + n, row + C * chunks)
        assert not got["tt"][pad].any() and not got["big_g"][pad].any()
        assert not got["w"][pad].any() and not got["u"][pad].any()
        row += C * chunks


def test_bwd_outputs_for_the_backward_layout():
    """B equal lengths (the backward's call: seq_len known, l2norm off) at 1 x 2048 H16 and
    2 x 200: tt as reference/kda_bwd_wy.py `wy_tiles` lays it out (B, T, HV, 64) by a view of
    the rows, within 1e-2 of the model's; prints the first pass's time with and without the
    flag (CUDA events, 20 runs)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    for b, t, hv in ((1, 2048, 16), (2, 200, 4)):
        q, k, g, beta, v, _ = _inputs([b * t], hv, hv, torch.bfloat16, seed=32, strong=False)
        cu = (torch.arange(b + 1, device="cuda") * t).to(torch.int32)
        got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, seq_len=t, bwd=True, v=v)
        want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False, seq_len=t, bwd=True,
                                           v=v)  # fmt: skip
        rows = got["tt"].shape[0] // b
        tt = got["tt"].unflatten(0, (b, rows))[:, :t]
        tt_want = want["tt"].unflatten(0, (b, rows))[:, :t]
        assert tt.shape == (b, t, hv, C)
        _close(tt.float(), tt_want.float(), 1e-2)
        _close(got["big_g"], want["big_g"], 2e-5)
        for name in ("w", "u"):  # (B NC 64, HV, 128): the WY kernel's and kernel 1's rows
            _close(got[name].float(), want[name].float(), 1e-2)
        times = {}
        for bwd in (False, True):
            vb = v if bwd else None
            for _ in range(3):
                launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, seq_len=t, bwd=bwd, v=vb)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(20):
                launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, seq_len=t, bwd=bwd, v=vb)
            end.record()
            end.synchronize()
            times[bwd] = start.elapsed_time(end) / 20 * 1e3
        print(f"first pass {b}x{t} HV{hv}: forward key {times[False]:.1f} us, "
              f"bwd key {times[True]:.1f} us")  # fmt: skip
