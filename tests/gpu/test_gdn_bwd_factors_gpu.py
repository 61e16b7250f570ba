"""The Gated DeltaNet backward's kernel 0 (kernels/linear_attention/gdn_bwd_factors/sm90: the
chunk factors, one CTA per (chunk, value head, sequence), issue 20) on the GPU: against its
model (`reference.gdn_bwd_factors.factors_model` in fp64 on the same 16-bit inputs, T diag(.)
rounded as the kernel's A operands) and against the torch factors it replaces (`_Factors`
through `factor_tiles`, fp64); outputs NaN-poisoned before the call (a row the kernel does not
write fails); bf16 and fp16; T = 1, 63, 64, 65, 200, 1000 (tail chunks zero-filled by TMA);
1-3 sequences, grouped heads (H < HV); correlated keys; 16-bit gates; misaligned inputs (the
launcher's copies or TMA in place); more CTAs than SMs; two launches bit for bit; the 4 x 8192
H16 HV32 time printed (`-s`).

Tolerance: each output within 1e-2 of its reference's largest entry against the model (the
kernel's tf32 inverse merges, fp32 accumulation and exponentials are the only differences),
2e-2 against the torch factors; e^(G_C) and G within 1e-5 (fp32 sums and exponentials)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from same_bits import assert_same_bits

from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90.launch import (
    empty_outputs,
    gdn_bwd_factors,
)
from forgekernel.reference.gdn_bwd_factors import (
    NAMES,
    factor_tiles,
    factors_model,
    rounding_to,
)
from forgekernel.reference.gdn_bwd_state import chunk_factors
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
VECTORS = ("e_last", "big_g")


def _problem(b, t, h, hv, dtype, seed=0, coupled=0.0):
    """q (scaled, normalized), k (B, T, H, 128), v (B, T, HV, 128) in `dtype`; g, beta fp32.
    `coupled`: keys share a common direction with this weight (larger T entries)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64)

    q = F.normalize(rnd(b, t, h, 128), dim=-1) * 128**-0.5
    k = F.normalize(rnd(b, t, h, 128) + coupled * rnd(1, 1, h, 128) * 128**0.5, dim=-1)
    v = rnd(b, t, hv, 128)
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    return tuple(x.to(dtype) for x in (q, k, v)) + (g.float(), beta.float())


def _launch(p):
    """The kernel on p, outputs NaN-poisoned first."""
    q, k, v, g, beta = p
    out = empty_outputs(q, v)
    for x in out.values():
        x.fill_(float("nan"))
    return gdn_bwd_factors(q, k, v, g, beta, out=out)


def _model(p):
    return factors_model(*(x.double() for x in p), p[0].dtype, rounding_to(p[0].dtype))


def _torch_factors(p):
    q, k, v, g, beta = (x.double() for x in p)
    group = v.shape[2] // q.shape[2]
    qs, ks = (x.repeat_interleave(group, dim=2) for x in (q, k))
    return factor_tiles(chunk_factors(qs, ks, v, g, beta), torch.float64)


def _close(name, got, want, tol):
    assert got.shape == want.shape, name
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
    err = float((got.double() - want.double()).abs().max())
    assert err <= tol * float(want.double().abs().max()) + 1e-6, (name, err)


def _check(got, p, tol_model=1e-2, tol_torch=2e-2):
    model, ref = _model(p), _torch_factors(p)
    for name in NAMES:
        exact = name in VECTORS
        _close(name, got[name], model[name], 1e-5 if exact else tol_model)
        _close(name + " vs torch", got[name], ref[name], 1e-5 if exact else tol_torch)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "h", "hv"), [(1, 1, 1), (2, 1, 3), (3, 2, 4)])
def test_matches_the_model_and_the_torch_factors(dtype, t, b, h, hv):
    p = _problem(b, t, h, hv, dtype, seed=t + b)
    _check(_launch(p), p)


@pytest.mark.parametrize("coupled", [0.3, 1.0])
def test_correlated_keys(coupled):
    """Keys sharing a direction (A's entries near beta, T's growing): the tf32 inverse and the
    16-bit T diag(.) still within the bounds."""
    p = _problem(2, 200, 2, 4, torch.bfloat16, seed=11, coupled=coupled)
    _check(_launch(p), p)


def test_gates_in_16_bits():
    """g, beta in q's dtype: the launcher widens them; the fp32 call's outputs exactly."""
    q, k, v, g, beta = _problem(1, 130, 1, 2, torch.bfloat16, seed=4)
    g16, b16 = g.bfloat16(), beta.bfloat16()
    got = _launch((q, k, v, g16, b16))
    want = _launch((q, k, v, g16.float(), b16.float()))
    for name in NAMES:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_misaligned_inputs():
    """q, k, v as every other 128-column half of wider buffers (TMA reads them in place) and
    g, beta strided: the contiguous call's outputs bitwise."""
    p = _problem(2, 130, 2, 4, torch.bfloat16, seed=5)
    q, k, v, g, beta = p
    wide = [torch.cat([x, x], dim=-1)[..., :128] for x in (q, k, v)]
    gates = [torch.stack([x, x], dim=-1)[..., 0] for x in (g, beta)]
    got, want = _launch((*wide, *gates)), _launch(p)
    for name in NAMES:
        torch.testing.assert_close(got[name], want[name], rtol=0, atol=0, msg=name)


def test_more_ctas_than_sms():
    """1 x 4096 tokens, H 4, HV 32: 2,048 CTAs, every output written and right."""
    p = _problem(1, 4096, 4, 32, torch.bfloat16, seed=8)
    _check(_launch(p), p)


def test_time_at_bench_size():
    """4 x 8192 tokens, H16 HV32 (the gdn_bwd suite's batch case): one launch (printed; the
    prediction: NOTES.md "Backward kernel 0"), outputs finite."""
    p = _problem(4, 8192, 16, 32, torch.bfloat16, seed=3)
    out = _launch(p)
    for name, x in out.items():
        assert torch.isfinite(x).all(), name
    ms = median(time_ms(lambda: gdn_bwd_factors(*p, out=out), reps=20))
    moved = sum(x.numel() * x.element_size() for x in (*p, *out.values())) / 1e9
    print(f"\nGDN backward kernel 0 (the factors), 4 x 8192 h16 hv32 bf16: {ms:.3f} ms a "
          f"launch, {moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s")  # fmt: skip


def _launch_filled(p, fill):
    """`_launch` with the outputs filled with `fill` first."""
    q, k, v, g, beta = p
    out = empty_outputs(q, v)
    for x in out.values():
        x.fill_(fill)
    return gdn_bwd_factors(q, k, v, g, beta, out=out)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 64, 65, 1000])
@pytest.mark.parametrize(("b", "h", "hv"), [(1, 1, 1), (2, 1, 3), (3, 2, 4)])
def test_same_bits_every_output_written(dtype, t, b, h, hv):
    """Two launches, outputs NaN-poisoned and 7-filled first: every tile, e^(G_C) and G equal
    bit for bit (an entry left unwritten differs; a race between the math warpgroups, T handed
    over through the inverse's fp32 scratch, would show as run-to-run bits) and within the
    model's bounds; correlated keys on the grouped case. The cases and inputs that compared the
    two-math-warpgroup kernel with the 256-thread one until next/fac-losers deleted that (bits
    equal on all 24, 2026-12-06); racecheck / synccheck run on `2-1-3-65-dtype0`."""
    p = _problem(b, t, h, hv, dtype, seed=5 * t + hv, coupled=1.0 if hv == 4 else 0.0)
    got, again = _launch(p), _launch_filled(p, 7.0)
    for name in NAMES:
        assert_same_bits(name, again[name], got[name])
    _check(got, p)
