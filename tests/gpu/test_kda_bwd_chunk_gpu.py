"""Kimi Delta Attention's backward kernel 2 (kernels/linear_attention/kda_bwd_chunk/sm90: pass
3's output side, one CTA per (chunk, value head, sequence), issue 20) on the GPU: against its
model (`reference.kda_bwd_chunk` in fp64 on the same 16-bit tiles, the on-chip block operands
rounded to bf16: tests/test_kda_bwd_chunk.py's `emulate`) and against reference/kda_bwd.py's
`_output_grads` in fp64 (the batched torch it replaces; dG reverse-cumsummed); outputs NaN-
poisoned before the call (an entry the kernel does not write fails); bf16 and fp16; T = 1, 63,
64, 65, 200, 1000 (tail chunks zero-filled by TMA, references clamped inside T); 1-3 sequences,
1-3 heads; g in [-5, 0] and [-5, -4] per channel (the sub-chunk factors' bound); misaligned
inputs (the launcher's copies); the 4 x 8192 H16 HV16 / HV32 times printed (`-s`).

Tolerance: each output within 1e-2 of its reference's largest entry against the model (the
same 16-bit inputs; fp32 accumulation and the fp32 exponentials are the only differences),
2e-2 against `_output_grads` on unrounded inputs (the CPU rounded emulation: 3.4e-3 at most)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_kda_bwd_chunk import NAMES, emulate, reference

from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.reference.kda_bwd import _Factors
from forgekernel.reference.kda_bwd_chunk import chunk_grad_tiles
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
DEVICE = "cuda"


def _problem(b, t, hv, dtype, g_range=(-5.0, 0.0), seed=0):
    """`test_kda_bwd_chunk.problem`'s tuple on the GPU at K = V = 128 (fp64), do rounded to
    `dtype` (the kernel path's do is 16-bit)."""
    gen = torch.Generator(device=DEVICE).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device=DEVICE, generator=gen, dtype=torch.float64)

    qs, ks = rnd(b, t, hv, 128) * 128**-0.5, F.normalize(rnd(b, t, hv, 128), dim=-1)
    v, do = rnd(b, t, hv, 128), rnd(b, t, hv, 128).to(dtype).double()
    lo, hi = g_range
    g = lo + (hi - lo) * torch.rand(b, t, hv, 128, device=DEVICE, generator=gen,
                                    dtype=torch.float64)  # fmt: skip
    beta = torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta, _Factors)
    nc = f.w.shape[1]
    h, dh = rnd(b, nc, hv, 128, 128) * 0.1, rnd(b, nc, hv, 128, 128) * 0.1
    big_u, d_u = (to_chunks(rnd(b, t, hv, 128), nc) for _ in range(2))
    return f, do, h, dh, big_u, d_u, qs, ks, g


def _launch(p, dtype, strided=False, dw16=False, dq16=False, scale=1.0):
    """The kernel on `_problem` p's tiles in `dtype`, outputs NaN-poisoned first (dw in
    `dtype` with dw16; dq16: dq times `scale` in `dtype`)."""
    _, do, h, dh, big_u, d_u, qs, ks, g = p
    tiles = list(chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype))
    tiles[-1] = tiles[-1].float()
    if strided:  # token tiles as every other 128-column half of a wider buffer
        tiles[:5] = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] for x in tiles[:5]]
    empty = launch.empty_outputs(tiles[0], 128, dw16, dq16)
    out = tuple(x.fill_(float("nan")) for x in empty)
    flags = {"dq16": True, "scale": scale} if dq16 else {}
    return launch.kda_bwd_chunk(*tiles, dw16=dw16, out=out, **flags)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "hv"), [(1, 1, 1), (2, 130, 3), (1, 1000, 2)])
def test_dw16_is_the_fp32_dw_rounded(dtype, b, t, hv):
    """dw16 (the device pass's key, next/kda-wy-acc): dw in `dtype`, bit-equal to the fp32
    call's dw rounded to nearest (the same accumulator, converted at the store); dq, dk, dg
    bit-identical; nothing left unwritten."""
    p = _problem(b, t, hv, dtype, seed=t + hv)
    base, low = _launch(p, dtype), _launch(p, dtype, dw16=True)
    assert low[2].dtype == dtype and not torch.isnan(low[2]).any()
    torch.testing.assert_close(low[2], base[2].to(dtype), rtol=0, atol=0)
    for i in (0, 1, 3):
        torch.testing.assert_close(low[i], base[i], rtol=0, atol=0)


def _close(name, got, want, tol):
    assert got.shape == want.shape, name
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
    if want.numel() == 0:
        return
    err = float((got.double() - want).abs().max())
    assert err <= tol * float(want.abs().max()) + 1e-6, (name, err, float(want.abs().max()))


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "hv"), [(1, 1), (2, 3), (3, 2)])
def test_matches_the_model_and_pass_3(dtype, t, b, hv, g_range):
    p = _problem(b, t, hv, dtype, g_range, seed=t + b)
    got = _launch(p, dtype)
    for name, a, r in zip(NAMES, got, emulate(p, dtype)):
        _close(name, a, r, 1e-2)
    for name, a, r in zip(NAMES, got, reference(p)):
        _close(name + " vs pass 3", a, r, 2e-2)


def test_misaligned_inputs():
    """Strided token tiles (TMA reads them in place) give the contiguous call's outputs."""
    p = _problem(2, 130, 2, torch.bfloat16, seed=5)
    for name, a, r in zip(NAMES, _launch(p, torch.bfloat16, strided=True),
                          _launch(p, torch.bfloat16)):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


def test_launcher_checks():
    p = _problem(1, 70, 1, torch.bfloat16)
    _, do, h, dh, big_u, d_u, qs, ks, g = p
    tiles = list(chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, torch.bfloat16))
    with pytest.raises(ValueError, match="G must be float32"):
        launch.kda_bwd_chunk(*tiles)  # fp64 G
    tiles[-1] = tiles[-1].float()
    with pytest.raises(TypeError, match="k must be"):
        launch.kda_bwd_chunk(*tiles[:4], tiles[4].half(), *tiles[5:])
    with pytest.raises(ValueError, match="h must be"):
        launch.kda_bwd_chunk(*tiles[:5], tiles[5][:, :1].contiguous(), *tiles[6:])


@pytest.mark.parametrize("hv", [16, 32])
def test_time_at_bench_size(hv):
    """4 x 8192 tokens, H16 HV16 / HV32 (the kda_bwd suite's batch cases): one launch (printed;
    the prediction: NOTES.md "KDA backward kernel 2"), outputs finite."""
    b, t, nc = 4, 8192, 128
    gen = torch.Generator(device=DEVICE).manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).bfloat16()

    tiles = [rnd(b, t, hv, 128) for _ in range(3)]
    tiles += [rnd(b, t, hv, 128, scale=128**-0.5), rnd(b, t, hv, 128, scale=128**-0.5)]
    tiles += [rnd(b, nc, hv, 128, 128, scale=0.1) for _ in range(2)]
    g = -5.0 * torch.rand(b, t, hv, 128, device=DEVICE, generator=gen)
    tiles.append(to_tokens(to_chunks(g, nc).cumsum(-2)).contiguous())
    out = launch.empty_outputs(tiles[0], 128)
    launch.kda_bwd_chunk(*tiles, out=out)
    for x in out:
        assert torch.isfinite(x).all()
    ms = median(time_ms(lambda: launch.kda_bwd_chunk(*tiles, out=out), reps=20))
    moved = sum(x.numel() * x.element_size() for x in (*tiles, *out)) / 1e9
    print(
        f"\nKDA backward kernel 2, 4 x 8192 hv{hv} bf16: {ms:.3f} ms a launch, "
        f"{moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s"
    )
