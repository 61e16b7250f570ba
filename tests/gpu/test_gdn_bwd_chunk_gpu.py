"""The Gated DeltaNet backward's kernel 2 (kernels/linear_attention/gdn_bwd_chunk/sm90: pass 3,
one CTA per (chunk, value head, sequence), issue 20; both variants: `_output_grads` only and
all of pass 3, `wy`) on the GPU: against its model
(`reference.gdn_bwd_chunk.chunk_grads_model` in fp64 on the same 16-bit tiles, dPD rounded as
the kernel's register operand) and, through the torch finish, against reference/
delta_rule_bwd.py `_output_grads` in fp64 (the batched torch pass 3 it replaces); outputs
NaN-poisoned before the call (a row the kernel does not write fails); bf16 and fp16; T = 1, 63,
64, 65, 200, 1000 (tail chunks zero-filled by TMA); 1-3 sequences, 1-3 heads; misaligned
inputs (the launcher's copies); the 4 x 8192 HV 32 time printed (`-s`).

Tolerance: each output within 1e-2 of its reference's largest entry against the model (the
same 16-bit inputs; fp32 accumulation and the fp32 exponentials are the only differences),
2e-2 against `_output_grads` on unrounded inputs (tests/test_gdn_bwd_chunk.py's rounded
emulation passes at that)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import (
    empty_outputs,
    empty_wy_outputs,
    gdn_bwd_chunk,
    gdn_bwd_chunk_wy,
)
from forgekernel.reference.delta_rule_bwd import _output_grads, _wy_grads
from forgekernel.reference.gdn_bwd_chunk import (
    chunk_grad_tiles,
    chunk_grads_model,
    finish_output_grads,
    finish_wy,
    wy_grads_model,
    wy_tiles,
)
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
NAMES = ("dq", "dk", "dw", "dg", "te")


def _problem(b, t, hv, dtype, seed=0):
    """Random inputs' chunk factors (fp64 on the GPU), random states h, dh and U, dU (zero past
    T) -> (f, do_c, h, dh, U, dU, the kernel's tiles in `dtype`)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64)

    qs, ks = rnd(b, t, hv, 128) * 128**-0.5, F.normalize(rnd(b, t, hv, 128), dim=-1)
    v, do = rnd(b, t, hv, 128), rnd(b, t, hv, 128).to(dtype).double()
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta)
    nc = f.w.shape[1]
    h, dh = rnd(b, nc, hv, 128, 128) * 0.1, rnd(b, nc, hv, 128, 128) * 0.1
    big_u, d_u = (to_chunks(rnd(b, t, hv, 128), nc) for _ in range(2))
    tiles = list(chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype))
    tiles[-1] = tiles[-1].float()
    return f, to_chunks(do, nc), h, dh, big_u, d_u, tiles


def _poisoned(tiles):
    out = tuple(x.fill_(float("nan")) for x in empty_outputs(tiles[0], tiles[3].shape[-1]))
    return gdn_bwd_chunk(*tiles, out=out)


def _close(name, got, want, tol):
    assert got.shape == want.shape, name
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
    if want.numel() == 0:
        return
    err = float((got.double() - want).abs().max())
    assert err <= tol * float(want.abs().max()) + 1e-6, (name, err, float(want.abs().max()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "hv"), [(1, 1), (2, 3), (3, 2)])
def test_matches_the_model_and_output_grads(dtype, t, b, hv):
    f, do_c, h, dh, big_u, d_u, tiles = _problem(b, t, hv, dtype, seed=t + b)
    got = _poisoned(tiles)
    low = dtype

    def rounding(x):
        return x.to(low).to(x.dtype)

    model = chunk_grads_model(*(x.double() for x in tiles), rounding)
    for name, a, r in zip(NAMES, got, model):
        _close(name, a, r, 1e-2)
    dw_c, d_g = finish_output_grads(got[3].double(), got[4].double(), got[2].double(), h, dh,
                                    f.e_last)  # fmt: skip
    want = _output_grads(f, do_c, h, dh, big_u, d_u)
    tok = (to_tokens(want[0])[:, :t], to_tokens(want[1])[:, :t])
    for name, a, r in zip(("dq", "dk", "dw", "dG"), (got[0], got[1], dw_c, d_g), (*tok, *want[2:])):
        _close(name + " vs _output_grads", a, r, 2e-2)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "hv"), [(1, 1), (2, 3)])
def test_wy_matches_the_model_and_pass_3(dtype, t, b, hv):
    """The WY variant (all of pass 3) against its model (`wy_grads_model` after
    `chunk_grads_model`, the same roundings) and against `_output_grads` + `_wy_grads`."""
    f, do_c, h, dh, big_u, d_u, tiles = _problem(b, t, hv, dtype, seed=t + b)
    v, beta = to_tokens(f.v)[:, :t], to_tokens(f.beta.unsqueeze(-1))[:, :t, :, 0]
    extra = list(wy_tiles(f, v, beta, dtype))
    extra[-1] = extra[-1].float()
    out = tuple(x.fill_(float("nan")) for x in empty_wy_outputs(tiles[0], 128))
    got = gdn_bwd_chunk_wy(*tiles, *extra, out=out)

    def rounding(x):
        return x.to(dtype).to(x.dtype)

    wide = [x.double() for x in tiles]
    first = chunk_grads_model(*wide, rounding)
    model = wy_grads_model(first, wide[2], wide[4], wide[5], wide[7],
                           *(x.double() for x in extra), rounding, rounding)  # fmt: skip
    for name, a, r in zip(("dq", "dk", "dg", "te", "dv", "dbeta"), got, model):
        _close(name, a, r, 1e-2)
    dq_r, dk_r, dw_r, dg_r = _output_grads(f, do_c, h, dh, big_u, d_u)
    dk_wy, dv_r, dbeta_r, dg_wy = _wy_grads(f, dw_r, d_u)
    want = {"dq": to_tokens(dq_r)[:, :t], "dk": to_tokens(dk_r + dk_wy)[:, :t],
            "dv": to_tokens(dv_r)[:, :t], "dbeta": to_tokens(dbeta_r)[:, :t]}  # fmt: skip
    for name, a in zip(("dq", "dk"), got[:2]):
        _close(name + " vs pass 3", a, want[name], 2e-2)
    _close("dv vs pass 3", got[4], want["dv"], 2e-2)
    _close("dbeta vs pass 3", got[5], want["dbeta"], 2e-2)
    d_g = finish_wy(got[2].double(), got[3].double(), h, dh, f.e_last)
    _close("dG vs pass 3", d_g, dg_r + dg_wy, 2e-2)


def test_misaligned_inputs():
    """Strided (non-contiguous) token tiles go through the launcher's TMA-ready copies."""
    _, _, _, _, _, _, tiles = _problem(2, 130, 2, torch.bfloat16, seed=5)
    wide = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] if x.dim() == 4 else x for x in tiles]
    for name, a, r in zip(NAMES, _poisoned(wide), _poisoned(tiles)):
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


def test_time_at_bench_size():
    """4 x 8192 tokens, HV 32 (the gdn_bwd suite's batch case): one launch's time (printed; the
    prediction: NOTES.md "Backward kernel 2"), outputs finite."""
    b, t, hv, nc = 4, 8192, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    tiles = [rnd(b, t, hv, 128) for _ in range(3)]
    tiles += [rnd(b, t, hv, 128, scale=128**-0.5), rnd(b, t, hv, 128, scale=128**-0.5)]
    tiles += [rnd(b, nc, hv, 128, 128, scale=0.1) for _ in range(2)]
    g = F.logsigmoid(torch.randn(b, t, hv, device="cuda", generator=gen) + 2.0)
    tiles.append(to_tokens(to_chunks(g, nc).cumsum(-1)).contiguous())
    out = empty_outputs(tiles[0], 128)
    gdn_bwd_chunk(*tiles, out=out)
    for name, x in zip(NAMES, out):
        assert torch.isfinite(x).all(), name
    ms = median(time_ms(lambda: gdn_bwd_chunk(*tiles, out=out), reps=20))
    moved = sum(x.numel() * x.element_size() for x in (*tiles, *out)) / 1e9
    print(f"\nGDN backward kernel 2 (_output_grads), 4 x 8192 hv32 bf16: {ms:.3f} ms a "
          f"launch, {moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s")
    extra = [rnd(b, t, hv, 64, scale=0.3), rnd(b, t, hv, 128, scale=0.1),
             rnd(b, t, hv, 128), rnd(b, t, hv, 128),
             torch.rand(b, t, hv, device="cuda", generator=gen)]  # fmt: skip
    wy_out = empty_wy_outputs(tiles[0], 128)
    gdn_bwd_chunk_wy(*tiles, *extra, out=wy_out)
    for name, x in zip(("dq", "dk", "dg", "te", "dv", "dbeta"), wy_out):
        assert torch.isfinite(x).all(), name
    ms = median(time_ms(lambda: gdn_bwd_chunk_wy(*tiles, *extra, out=wy_out), reps=20))
    moved = sum(x.numel() * x.element_size() for x in (*tiles, *extra, *wy_out)) / 1e9
    print(f"GDN backward kernel 2 (all of pass 3), 4 x 8192 hv32 bf16: {ms:.3f} ms a launch, "
          f"{moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s")
