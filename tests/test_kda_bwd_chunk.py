"""Kimi Delta Attention's backward kernel 2 (kernels/linear_attention/kda_bwd_chunk/sm90) on
the CPU: its tile emulation (`reference.kda_bwd_chunk.chunk_grads_model`: the sub-chunk column
blocks, the kernel's on-chip 16-bit operands rounded as it rounds them) equals
reference/kda_bwd.py's `_output_grads` (dG after its reverse cumsum within the chunk) in fp64 and
within tolerance with bf16 / fp16 tiles, on awkward T and strong decay; the launcher's torch-only
checks. The op with the kernels emulated: tests/test_kda_bwd_kernel_path.py; the GPU twin:
tests/gpu/test_kda_bwd_chunk_gpu.py. And the varlen-native plan's premise: a tail chunk's rows
past its sequence, finite, change no valid row under masks keyed on the chunk's valid length."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rows_past_valid import past_valid

from forgekernel.reference import kda_bwd_chunk
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.reference.kda_bwd import _Factors, _output_grads
from forgekernel.reference.kda_bwd_chunk import chunk_grad_tiles, chunk_grads_model

NAMES = ("dq", "dk", "dw", "dg")


def problem(b, t, hv, dk=16, dv=8, g_range=(-5.0, 0.0), seed=0, dtype=torch.float64):
    """KDA's chunk factors of random inputs and random h, dh, U, dU (zero past T, as the
    recurrences leave them) -> (f, do, h, dh, U, dU, qs, ks, g) (token-major do, qs, ks, g)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    qs, ks = rnd(b, t, hv, dk) * 0.3, F.normalize(rnd(b, t, hv, dk), dim=-1)
    v, do = rnd(b, t, hv, dv), rnd(b, t, hv, dv)
    lo, hi = g_range
    g = lo + (hi - lo) * torch.rand(b, t, hv, dk, generator=gen, dtype=dtype)
    beta = torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta, _Factors)
    nc = f.w.shape[1]
    h, dh = rnd(b, nc, hv, dk, dv) * 0.5, rnd(b, nc, hv, dk, dv) * 0.5
    big_u, d_u = (to_chunks(rnd(b, t, hv, dv), nc) for _ in range(2))
    return f, do, h, dh, big_u, d_u, qs, ks, g


def reference(p):
    """`_output_grads` of problem p, dG reverse-cumsummed, token-major."""
    f, do, h, dh, big_u, d_u = p[:6]
    t, nc = do.shape[1], h.shape[1]
    dq, dk, dw, d_g = _output_grads(f, to_chunks(do, nc), h, dh, big_u, d_u)
    dg = d_g.flip(-2).cumsum(-2).flip(-2)
    return tuple(to_tokens(x)[:, :t] for x in (dq, dk, dw, dg))


def emulate(p, dtype):
    """The kernel's outputs on p's inputs in `dtype` (fp64 arithmetic; for 16-bit dtypes the
    on-chip block operands rounded to bf16)."""
    f, do, h, dh, big_u, d_u, qs, ks, g = p
    tiles = [x.double() for x in chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)]
    low = dtype in (torch.float16, torch.bfloat16)

    def rounding(x):
        return x.to(torch.bfloat16).to(x.dtype)  # the block operands: bf16 for both dtypes

    return chunk_grads_model(*tiles, rounding if low else None)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_emulation_equals_output_grads_fp64(t, b, g_range):
    p = problem(b, t, 3, g_range=g_range, seed=t + b)
    for name, ours, ref in zip(NAMES, emulate(p, torch.float64), reference(p)):
        assert ours.shape == ref.shape
        assert rel(ours, ref) < 1e-9, name


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 65, 200])
def test_emulation_rounded_within_tolerance(t, dtype, g_range):
    p = problem(2, t, 3, dk=32, dv=32, g_range=g_range, seed=7 * t)
    for name, ours, ref in zip(NAMES, emulate(p, dtype), reference(p)):
        assert torch.isfinite(ours).all(), name
        assert rel(ours, ref) < 2e-2, name


def test_emulation_head_dims_128():
    """The kernel's (K, V) = (128, 128), bf16 tiles, 200 tokens, strong decay."""
    p = problem(1, 200, 2, dk=128, dv=128, g_range=(-5.0, -4.0), seed=3)
    for name, ours, ref in zip(NAMES, emulate(p, torch.bfloat16), reference(p)):
        assert rel(ours, ref) < 2e-2, name


def test_reference_points_clamped_inside_t():
    """A chunk's tail past T carries nothing: G zero-filled there (the kernel's loads) gives the
    reference's outputs, references clamped to the last row inside T (no e^(-G) overflow)."""
    p = problem(1, 70, 1, g_range=(-5.0, -4.0), seed=11)
    ours = emulate(p, torch.float64)
    assert all(torch.isfinite(x).all() for x in ours)
    for name, a, ref in zip(NAMES, ours, reference(p)):
        assert rel(a, ref) < 1e-9, name


def _launcher_tiles(b=1, t=70, hv=2, kd=128, vd=128, dtype=torch.bfloat16):
    nc = -(-t // 64)

    def z(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt)

    tok = [z(b, t, hv, d) for d in (vd, vd, vd, kd, kd)]
    return [*tok, z(b, nc, hv, kd, vd), z(b, nc, hv, kd, vd), z(b, t, hv, kd, dt=torch.float32)]


def test_launcher_dw16_and_out_checks(monkeypatch):
    """`dw16`: dw in do's 16-bit dtype (the WY kernel's operand) from `empty_outputs` and in the
    compile key; `out` of the wrong shape, dtype (dw's per dw16) or count raises before any
    launch (the kernel writes every (B, T, HV, K) entry)."""
    from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch

    keys = []
    monkeypatch.setattr(launch, "get_kernel", lambda spec, key: keys.append(dict(key)) or
                        (lambda *a: None))  # fmt: skip
    tiles = _launcher_tiles()
    outs = launch.kda_bwd_chunk(*tiles, dw16=True)
    f32, bf16 = torch.float32, torch.bfloat16
    assert [x.dtype for x in outs] == [f32, f32, bf16, f32]
    assert keys[-1].get("dw16") is True
    launch.kda_bwd_chunk(*tiles)
    assert "dw16" not in keys[-1]
    n = len(keys)
    with pytest.raises(ValueError, match=r"out's dw must be contiguous torch.bfloat16.*dw16"):
        launch.kda_bwd_chunk(*tiles, dw16=True, out=launch.empty_outputs(tiles[0], 128))
    with pytest.raises(ValueError, match="out's dw must be contiguous torch.float32"):
        launch.kda_bwd_chunk(*tiles, out=launch.empty_outputs(tiles[0], 128, dw16=True))
    short = list(launch.empty_outputs(tiles[0], 128))
    short[3] = short[3][:, :64].contiguous()
    with pytest.raises(ValueError, match="out's dg must be"):
        launch.kda_bwd_chunk(*tiles, out=tuple(short))
    with pytest.raises(ValueError, match="4 tensors"):
        launch.kda_bwd_chunk(*tiles, out=launch.empty_outputs(tiles[0], 128)[:3])
    assert len(keys) == n


def test_launcher_token_rows(monkeypatch):
    """`tables`, `tokens` (the varlen slot layout, NATIVE_STORES): the `token_rows` key, dq, dk,
    dg at `tokens` rows and dw at the slots' (`empty_outputs`, `check_outputs`), the tables
    passed after the outputs; the WY launcher likewise (dk, dv, dg, dbeta and dk16's final dk
    at `tokens` rows); tables without tokens, or B > 1, raise before any launch."""
    from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch as wy

    keys, args = [], []

    def kernel(spec, key):
        keys.append(dict(key))
        return lambda *a: args.append(a)

    monkeypatch.setattr(launch, "get_kernel", kernel)
    monkeypatch.setattr(wy, "get_kernel", kernel)
    tiles = _launcher_tiles(t=130)  # NC = 3
    tab = (torch.zeros(3, dtype=torch.int32), torch.zeros(3, dtype=torch.int32))
    outs = launch.kda_bwd_chunk(*tiles, dw16=True, tables=tab, tokens=100)
    assert [tuple(x.shape)[1] for x in outs] == [100, 100, 130, 100]
    assert keys[-1].get("token_rows") is True
    assert args[-1][-3] is tab[0] and args[-1][-2] is tab[1]
    launch.kda_bwd_chunk(*tiles, dw16=True)
    assert "token_rows" not in keys[-1] and args[-1][-3] is None and args[-1][-2] is None
    n = len(keys)
    with pytest.raises(ValueError, match="together"):
        launch.kda_bwd_chunk(*tiles, tables=tab)
    with pytest.raises(ValueError, match="out's dq must be"):
        launch.kda_bwd_chunk(*tiles, tables=tab, tokens=100,
                             out=launch.empty_outputs(tiles[0], 128))  # fmt: skip
    assert len(keys) == n
    t16 = torch.zeros(1, 130, 2, 128, dtype=torch.bfloat16)
    wy_in = (t16, t16, torch.zeros(1, 130, 2, 64, dtype=torch.bfloat16), t16, t16, t16, t16,
             torch.zeros(1, 130, 2), torch.zeros(1, 130, 2, 128))  # fmt: skip
    got = wy.kda_bwd_wy(*wy_in, dv16=True, dk16=True, tables=tab, tokens=100)
    assert [tuple(x.shape)[1] for x in got] == [100, 100, 100, 100]
    assert keys[-1].get("token_rows") is True
    assert args[-1][-2] is tab[0] and args[-1][-1] is tab[1]


@pytest.mark.parametrize("valid", [1, 37, 63])
def test_rows_past_valid_change_no_valid_row(valid, monkeypatch):
    """The varlen-native plan's claim for KDA kernel 2 (NOTES "next/varlen-native-plan" section
    2): one chunk whose dO, q, k tiles hold the next sequence's rows past `valid` (finite), U,
    dU zero there (kernel 1), G zero there (the token-major first pass), the model's masks
    keyed on `valid` (`sub_chunk_decays`: rows, references, G_C): every valid row of dq, dk,
    dw, dG bit for bit the zero-padded chunk's; NaN there reaches dq, dk, dG (the finite
    premise)."""
    keyed = kda_bwd_chunk.sub_chunk_decays
    monkeypatch.setattr(kda_bwd_chunk, "sub_chunk_decays", lambda gc, t: keyed(gc, valid))
    f, do, h, dh, big_u, d_u, qs, ks, g = problem(1, valid, 3, seed=valid)
    tiles = [x.double() for x in chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, torch.float32)]
    do_t, u_t, du_t, q_t, k_t, h_t, dh_t, big_g = tiles

    def run(fill):
        gen = torch.Generator().manual_seed(5)
        do_e, q_e, k_e = (past_valid(x, fill, gen) for x in (do_t, q_t, k_t))
        u_e, du_e, g_e = (past_valid(x, None, gen) for x in (u_t, du_t, big_g))
        out = chunk_grads_model(do_e, u_e, du_e, q_e, k_e, h_t, dh_t, g_e)
        return [x[:, :valid] for x in out]

    for name, x, y in zip(NAMES, run(1e4), run(None)):
        assert torch.equal(x, y), name
    assert [bool(x.isnan().any()) for x in run(float("nan"))] == [True, True, False, True]
