"""Kimi Delta Attention's backward WY kernel (kernels/linear_attention/kda_bwd_wy/sm90: the WY
half, one CTA per (chunk, value head, sequence)) on the GPU: against its model
(`reference.kda_bwd_wy` in fp64 on the same 16-bit tiles, the on-chip operands rounded:
tests/test_kda_bwd_wy.py's `emulate`) and against reference/kda_bwd.py's `_wy_grads` in fp64
(the batched torch it replaces; dG reverse-cumsummed); outputs NaN-poisoned before the call (an
entry the kernel does not write fails); bf16 and fp16; T = 1, 63, 64, 65, 200, 1000 (tail
chunks zero-filled by TMA, references clamped inside T); 1-3 sequences, 1-3 heads, grouped k;
g in [-5, 0] and [-5, -4] per channel; misaligned inputs (TMA in place); then the op's kernel
path with WY_IN_KERNEL on against off (the WY half in torch) and the fp64 backward; the 4 x 8192
HV16 time printed (`-s`).

Tolerance: each output within 1e-2 of its reference's largest entry against the model (the
same 16-bit inputs; fp32 accumulation and fp32 exponentials the only differences), 2e-2 against
`_wy_grads` on unrounded inputs (the CPU rounded emulation: 9e-3 at most); the path as
tests/gpu/test_kda_bwd_kernel_path_gpu.py's (2e-2 of the fp64 backward, 1e-2 between the two).
Not yet run on a GPU (branch next/kda-bwd-wy, 2026-12-06)."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_kda_bwd_kernel_path_gpu import (  # tests/gpu is on the path
    KERNEL_TOL,
    _problem,
    _reference,
    _run,
    kernel_path,  # noqa: F401  (the fixture)
)
from test_kda_bwd_kernel_path_gpu import NAMES as PATH_NAMES
from test_kda_bwd_kernel_path_gpu import _close as _path_close
from test_kda_bwd_wy import NAMES, emulate, problem, reference

from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch
from forgekernel.reference.gdn_bwd_state import to_chunks, to_tokens
from forgekernel.reference.kda_bwd_chunk import cumulative_decay
from forgekernel.reference.kda_bwd_wy import wy_tiles
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.kda_bwd")
DEVICE = "cuda"


def _problem_128(b, t, hv, g_range=(-5.0, 0.0), group=1, seed=0):
    """`test_kda_bwd_wy.problem` at K = V = 128 (fp64, on the CPU: the model's side)."""
    return problem(b, t, hv, dk=128, dv=128, group=group, g_range=g_range, seed=seed)


def _launch(p, dtype, strided=False, base=None, dv16=False, **flags):
    """The kernel on problem p's tiles in `dtype` on the GPU: dv, dbeta NaN-poisoned first, dk
    and dg (its accumulators) zero, or `base` (dk0, dg0: kernel 2's stand-ins) copied in;
    `flags` (dk16) to the launcher."""
    f, dw, d_u, g = p
    tiles = list(wy_tiles(f, dw, d_u, cumulative_decay(g, f.w.shape[1]), dtype))
    tiles[-2:] = [x.float() for x in tiles[-2:]]
    tiles = [x.to(DEVICE) for x in tiles]
    if strided:  # token tiles as every other half of a wider buffer
        tiles[:7] = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] for x in tiles[:7]]
    out = launch.empty_outputs(tiles[0], 128, dv16)
    out[1].fill_(float("nan")), out[3].fill_(float("nan"))
    if base is not None:
        out[0].copy_(base[0]), out[2].copy_(base[1])
    return tuple(x.cpu() for x in launch.kda_bwd_wy(*tiles, dv16=dv16, out=out, **flags))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "hv"), [(1, 1, 1), (2, 130, 3), (1, 1000, 2)])
def test_dv16_is_the_fp32_dv_rounded(dtype, b, t, hv):
    """dv16 (the device pass's key with a 16-bit v, next/kda-wy-acc): dv in `dtype`, bit-equal
    to the fp32 call's dv rounded to nearest (the same rows, converted at the store); dk, dg,
    dbeta bit-identical; nothing left unwritten."""
    p = _problem_128(b, t, hv, seed=t + 2 * hv)
    base, low = _launch(p, dtype), _launch(p, dtype, dv16=True)
    assert low[1].dtype == dtype and not torch.isnan(low[1]).any()
    torch.testing.assert_close(low[1], base[1].to(dtype), rtol=0, atol=0)
    for i in (0, 2, 3):
        torch.testing.assert_close(low[i], base[i], rtol=0, atol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "hv"), [(1, 1, 1), (2, 130, 3), (1, 1000, 2)])
def test_dk16_is_the_fp32_dk_rounded(dtype, b, t, hv):
    """dk16 (the op's dk, next/kda-final-outputs): the final dk in `dtype`, bit-equal to the
    fp32 call's dk (kernel 2's stand-in plus the WY half, the same fp32 sums) rounded to
    nearest; dv, dg, dbeta bit-identical (the coverage the 256-thread agreement test gave dk16
    at the kernel's level before 2026-12-06)."""
    p = _problem_128(b, t, hv, seed=t + 3 * hv)
    gen = torch.Generator().manual_seed(t)
    base = [torch.randn(b, t, hv, 128, generator=gen).to(DEVICE) for _ in range(2)]
    wide = _launch(p, dtype, base=base, dv16=True)
    low = _launch(p, dtype, base=base, dv16=True, dk16=True)
    assert low[0].dtype == dtype
    torch.testing.assert_close(low[0], wide[0].to(dtype), rtol=0, atol=0)
    for i in (1, 2, 3):
        torch.testing.assert_close(low[i], wide[i], rtol=0, atol=0)


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
@pytest.mark.parametrize(("b", "hv", "group"), [(1, 1, 1), (2, 3, 1), (3, 2, 2)])
def test_matches_the_model_and_wy_grads(dtype, t, b, hv, group, g_range):
    p = _problem_128(b, t, hv, g_range, group, seed=t + b)
    got = _launch(p, dtype)
    got = (*got[:3], got[3].unsqueeze(-1))  # dbeta as the model's (B, T, HV, 1)
    for name, a, r in zip(NAMES, got, emulate(p, dtype)):
        _close(name, a, r, 1e-2)
    for name, a, r in zip(NAMES, got, reference(p)):
        _close(name + " vs _wy_grads", a, r, 2e-2)


def test_misaligned_inputs():
    """Strided token tiles (TMA reads them in place) give the contiguous call's outputs."""
    p = _problem_128(2, 130, 2, seed=5)
    for name, a, r in zip(NAMES, _launch(p, torch.bfloat16, strided=True),
                          _launch(p, torch.bfloat16)):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "hv"), [(1, 1, 1), (2, 130, 3), (1, 1000, 2)])
def test_accumulates_onto_kernel_2s_dk_and_dg(dtype, b, t, hv):
    """dk, dg handed over holding kernel 2's halves (random here): the kernel adds its own onto
    them in place (read-modify-write of each CTA's rows) = the old form (zeros in, then the
    torch add) up to fp32 summation order (~1e-6 relative); dv, dbeta bit-identical; every
    row of dk, dg touched, none past T (the shapes are exact)."""
    p = _problem_128(b, t, hv, seed=t + hv)
    gen = torch.Generator().manual_seed(7)
    base = tuple(torch.randn(b, t, hv, 128, generator=gen) for _ in range(2))
    alone = _launch(p, dtype)
    acc = _launch(p, dtype, base=base)
    for i, j, name in ((0, 0, "dk"), (2, 1, "dg")):
        torch.testing.assert_close(acc[i], base[j] + alone[i], rtol=1e-5, atol=1e-5, msg=name)
    for i in (1, 3):
        torch.testing.assert_close(acc[i], alone[i], rtol=0, atol=0)


def test_launcher_checks():
    f, dw, d_u, g = _problem_128(1, 70, 1)
    tiles = [x.to(DEVICE) for x in wy_tiles(f, dw, d_u, cumulative_decay(g, 2), torch.bfloat16)]
    with pytest.raises(ValueError, match="beta must be float32"):
        launch.kda_bwd_wy(*tiles)  # fp64 beta and G
    tiles[-2:] = [x.float() for x in tiles[-2:]]
    with pytest.raises(TypeError, match="w must be"):
        launch.kda_bwd_wy(*tiles[:3], tiles[3].half(), *tiles[4:])


# ---- the op's kernel path, WY_IN_KERNEL on and off ----------------------------------------------


def _poisoned_wy_kernel(calls):
    """bwd._wy_kernel with dv, dbeta (the op's out= buffers, or new ones) NaN-poisoned first;
    dk, dg are accumulated into (kernel 2's), dk16's `dk_out` poisoned too."""
    real = bwd._wy_kernel

    def run(dw, du, tt, w, k, u, v, beta, big_g, dk, dg, dv16=False, dk16=False, dk_out=None,
            dv=None, dbeta=None):  # fmt: skip
        _, own_dv, _, own_dbeta = launch.empty_outputs(dw, du.shape[-1], dv16)
        dv = (own_dv if dv is None else dv).fill_(float("nan"))
        dbeta = (own_dbeta if dbeta is None else dbeta).fill_(float("nan"))
        if dk_out is not None:
            dk_out.fill_(float("nan"))
        calls.append(tuple(dw.shape))
        return real(dw, du, tt, w, k, u, v, beta, big_g, dk, dg, dv16=dv16, dk16=dk16,
                    dk_out=dk_out, dv=dv, dbeta=dbeta)  # fmt: skip

    return run


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "decay"),
    [(1, 1, 1, 1, (-1.0, 0.0)), (2, 333, 2, 4, (-5.0, 0.0)), (1, 1000, 2, 2, (-5.0, -4.0))],
)
def test_the_path_with_the_wy_kernel(kernel_path, monkeypatch, dtype, b, t, h, hv, decay):  # noqa: F811
    """WY_IN_KERNEL on (the WY kernel once a pass, outputs poisoned) and off (torch): both within
    2e-2 of the fp64 backward, within 1e-2 of each other."""
    q, k, v, g, beta, do, h0, dht = _problem(b, t, h, hv, dtype, seed=t, l2norm=True,
                                             decay=decay)  # fmt: skip
    inputs = (q, k, v, g, beta, do)
    in_torch = _run(inputs, h0=h0, dht=dht, l2norm=True)
    wy_calls = []
    monkeypatch.setattr(bwd, "_wy_kernel", _poisoned_wy_kernel(wy_calls))
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    on_chip = _run(inputs, h0=h0, dht=dht, l2norm=True)
    assert len(wy_calls) == 1 and len(kernel_path) == 4
    want = _reference(inputs, h0=h0, dht=dht, l2norm=True)
    for name, a, c, r in zip(PATH_NAMES, on_chip, in_torch, want):
        _path_close(name, a, r)
        _path_close(name + " vs the torch WY half", a, c.double(), KERNEL_TOL)


def test_time_at_bench_size():
    """4 x 8192 tokens, HV16 (the kda_bwd suite's batch case): one launch (printed; the
    prediction: NOTES.md "KDA backward WY kernel"), outputs finite."""
    b, t, hv, nc = 4, 8192, 16, 128
    gen = torch.Generator(device=DEVICE).manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device=DEVICE, generator=gen) * scale).bfloat16()

    tiles = [rnd(b, t, hv, 128), rnd(b, t, hv, 128), rnd(b, t, hv, 64, scale=0.1)]
    tiles += [rnd(b, t, hv, 128, scale=128**-0.5) for _ in range(2)]
    tiles += [rnd(b, t, hv, 128) for _ in range(2)]
    tiles.append(torch.rand(b, t, hv, device=DEVICE, generator=gen))
    g = -5.0 * torch.rand(b, t, hv, 128, device=DEVICE, generator=gen)
    tiles.append(to_tokens(to_chunks(g, nc).cumsum(-2)).contiguous())
    out = launch.empty_outputs(tiles[0], 128)
    launch.kda_bwd_wy(*tiles, out=out)
    for x in out:
        assert torch.isfinite(x).all()
    ms = median(time_ms(lambda: launch.kda_bwd_wy(*tiles, out=out), reps=20))
    moved = sum(x.numel() * x.element_size() for x in (*tiles, *out, out[0], out[2])) / 1e9
    # (dk and dg read as well as written: the accumulate form)
    print(
        f"\nKDA backward WY kernel, 4 x 8192 hv{hv} bf16: {ms:.3f} ms a launch, "
        f"{moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s"
    )
