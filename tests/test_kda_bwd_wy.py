"""Kimi Delta Attention's backward WY kernel (kernels/linear_attention/kda_bwd_wy/sm90) on the
CPU: its tile emulation (`reference.kda_bwd_wy.wy_grads_model`: T^T from its input tile, the
sub-chunk column blocks of the score gradients, the on-chip 16-bit operands rounded as the
kernel rounds them) equals reference/kda_bwd.py's `_wy_grads` (dG after its reverse cumsum
within the chunk) in fp64 (1e-10) and fp32, and within tolerance with bf16 / fp16 tiles, on
awkward T, grouped heads and strong decay; the launcher's torch-only checks. The op with the
kernel emulated: tests/test_kda_bwd_kernel_path.py; the GPU twin:
tests/gpu/test_kda_bwd_wy_gpu.py. And the varlen-native plan's premise, as kernel 2's."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rows_past_valid import past_valid

from forgekernel.reference import kda_bwd_wy
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.reference.kda_bwd import _Factors, _wy_grads
from forgekernel.reference.kda_bwd_chunk import cumulative_decay
from forgekernel.reference.kda_bwd_wy import wy_grads_model, wy_tiles

NAMES = ("dk", "dv", "dg", "dbeta")


def problem(b, t, hv, dk=16, dv=8, group=1, g_range=(-5.0, 0.0), seed=0, dtype=torch.float64):
    """KDA's chunk factors of random inputs (k shared by `group` value heads: grouped heads,
    repeated as the op repeats them) and random dw, dU (zero past T) -> (f, dw (B, T, HV, K)
    token-major, dU chunked, g)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=dtype)

    ks = F.normalize(rnd(b, t, hv // group, dk), dim=-1).repeat_interleave(group, dim=2)
    qs, v = rnd(b, t, hv, dk) * 0.3, rnd(b, t, hv, dv)
    lo, hi = g_range
    g = lo + (hi - lo) * torch.rand(b, t, hv, dk, generator=gen, dtype=dtype)
    beta = torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta, _Factors)
    nc = f.w.shape[1]
    dw, d_u = rnd(b, t, hv, dk), to_chunks(rnd(b, t, hv, dv), nc)
    return f, dw, d_u, g


def reference(p):
    """`_wy_grads` of problem p, dG reverse-cumsummed, token-major."""
    f, dw, d_u, g = p
    t, nc = g.shape[1], f.w.shape[1]
    dk, dv, dbeta, d_g = _wy_grads(f, to_chunks(dw, nc), d_u)
    dg = d_g.flip(-2).cumsum(-2).flip(-2)
    return tuple(to_tokens(x)[:, :t] for x in (dk, dv, dg, dbeta.unsqueeze(-1)))


def emulate(p, dtype, arith=torch.float64):
    """The kernel's outputs on p's inputs in `dtype`, computed in `arith` (16-bit dtypes: the
    on-chip operands rounded as the kernel rounds them)."""
    f, dw, d_u, g = p
    big_g = cumulative_decay(g, f.w.shape[1])
    tiles = [x.to(arith) for x in wy_tiles(f, dw, d_u, big_g, dtype)]
    low = dtype in (torch.float16, torch.bfloat16)
    dk, dv, dg, dbeta = wy_grads_model(*tiles, dtype if low else None)
    return dk, dv, dg, dbeta.unsqueeze(-1)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("b", [1, 2])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
def test_model_equals_wy_grads_fp64(t, b, g_range):
    p = problem(b, t, 3, g_range=g_range, seed=t + b)
    for name, ours, ref in zip(NAMES, emulate(p, torch.float64), reference(p)):
        assert ours.shape == ref.shape, name
        assert rel(ours, ref) < 1e-10, name


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("t", [1, 65, 200])
def test_model_equals_wy_grads_fp32(t, g_range):
    p = problem(2, t, 2, dk=32, dv=32, g_range=g_range, seed=5 * t)
    for name, ours, ref in zip(NAMES, emulate(p, torch.float32, torch.float32), reference(p)):
        assert ours.dtype == torch.float32
        assert rel(ours.double(), ref) < 1e-4, name


@pytest.mark.parametrize("group", [2, 4])
@pytest.mark.parametrize("t", [63, 130])
def test_model_grouped_heads(t, group):
    p = problem(1, t, 4, group=group, g_range=(-5.0, -4.0), seed=group)
    for name, ours, ref in zip(NAMES, emulate(p, torch.float64), reference(p)):
        assert rel(ours, ref) < 1e-10, name


@pytest.mark.parametrize("g_range", [(-5.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 65, 200])
def test_model_rounded_within_tolerance(t, dtype, g_range):
    p = problem(2, t, 3, dk=32, dv=32, g_range=g_range, seed=7 * t)
    for name, ours, ref in zip(NAMES, emulate(p, dtype), reference(p)):
        assert torch.isfinite(ours).all(), name
        assert rel(ours, ref) < 2e-2, name


def test_model_head_dims_128():
    """The kernel's (K, V) = (128, 128), bf16 tiles, 200 tokens, strong decay, grouped."""
    p = problem(1, 200, 4, dk=128, dv=128, group=2, g_range=(-5.0, -4.0), seed=3)
    for name, ours, ref in zip(NAMES, emulate(p, torch.bfloat16), reference(p)):
        assert rel(ours, ref) < 2e-2, name


def test_tail_past_t_carries_nothing():
    """Rows past T: G zero-filled (the kernel's loads), references clamped inside T, nothing
    overflows and the outputs are the reference's."""
    p = problem(1, 70, 1, g_range=(-5.0, -4.0), seed=11)
    ours = emulate(p, torch.float64)
    assert all(torch.isfinite(x).all() for x in ours)
    for name, a, ref in zip(NAMES, ours, reference(p)):
        assert rel(a, ref) < 1e-10, name


def _tiles(dtype=torch.bfloat16, b=1, t=70, hv=2, kd=128, vd=128):
    def z(*shape, dt=dtype):
        return torch.zeros(*shape, dtype=dt)

    return [z(b, t, hv, kd), z(b, t, hv, vd), z(b, t, hv, 64), z(b, t, hv, kd), z(b, t, hv, kd),
            z(b, t, hv, vd), z(b, t, hv, vd), z(b, t, hv, dt=torch.float32),
            z(b, t, hv, kd, dt=torch.float32)]  # fmt: skip


def test_launcher_checks():
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90.launch import check_inputs

    assert check_inputs(*_tiles()) == (1, 70, 2)
    bad = _tiles()
    bad[2] = bad[2][..., :32]  # T^T must be 64 wide
    with pytest.raises(ValueError, match="tt must be"):
        check_inputs(*bad)
    bad = _tiles()
    bad[4] = bad[4].half()
    with pytest.raises(TypeError, match="k must be"):
        check_inputs(*bad)
    bad = _tiles()
    bad[7] = bad[7].double()
    with pytest.raises(ValueError, match="beta must be float32"):
        check_inputs(*bad)
    with pytest.raises(ValueError, match=r"\(K, V\)"):
        check_inputs(*_tiles(kd=64))
    with pytest.raises(TypeError, match="dw must be"):
        check_inputs(*_tiles(dtype=torch.float32))


def test_wy_tiles_layouts():
    """The kernel's inputs: token-major, T^T's row j of a chunk column j of T (L T = I)."""
    p = problem(1, 70, 2, g_range=(-5.0, -4.0), seed=2)
    f, dw, d_u, g = p
    big_g = cumulative_decay(g, 2)
    dw16, du, tt, w, k, u, v, beta, _ = wy_tiles(f, dw, d_u, big_g, torch.bfloat16)
    assert tt.shape == (1, 70, 2, 64) and tt.dtype == torch.bfloat16
    assert beta.shape == (1, 70, 2) and beta.dtype == torch.float64
    t_exact = wy_tiles(f, dw, d_u, big_g, torch.float64)[2]
    chunk = to_chunks(t_exact, 2).transpose(-1, -2)  # T
    eye = torch.eye(64, dtype=torch.float64)
    assert torch.allclose(f.lower[:, 0] @ chunk[:, 0], eye.expand(1, 2, 64, 64), atol=1e-10)


def test_launcher_checks_out(monkeypatch):
    """`out` of the wrong shape (the kernel writes every (B, T, HV, ...) entry: a shorter
    tensor would be written past its end), dtype or device raises before any launch; the right
    one reaches the kernel."""
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch

    launched = []
    monkeypatch.setattr(launch, "get_kernel", lambda *a: lambda *b: launched.append(len(b)))
    tiles = _tiles()
    for i, name in enumerate(("dk", "dv", "dg", "dbeta")):
        for bad in ("short", "float64"):
            outs = list(launch.empty_outputs(tiles[0], 128))
            outs[i] = outs[i][:, :64].contiguous() if bad == "short" else outs[i].double()
            with pytest.raises(ValueError, match=f"out's {name} must be"):
                launch.kda_bwd_wy(*tiles, out=tuple(outs))
    with pytest.raises(ValueError, match="4 tensors"):
        launch.kda_bwd_wy(*tiles, out=launch.empty_outputs(tiles[0], 128)[:3])
    outs = list(launch.empty_outputs(tiles[0], 128))
    with pytest.raises(ValueError, match="dk and dg must be distinct"):  # both accumulated
        launch.kda_bwd_wy(*tiles, out=(outs[0], outs[1], outs[0], outs[3]))
    for i, name in ((0, "dk"), (2, "dg")):  # rows of bulk reduce-adds / L2 prefetches
        shifted = list(outs)
        shifted[i] = torch.zeros(outs[i].numel() + 1)[1:].view(outs[i].shape)  # 4 bytes in
        assert shifted[i].is_contiguous() and shifted[i].data_ptr() % 16 == 4
        with pytest.raises(ValueError, match=f"out's {name} must start 16-byte aligned"):
            launch.kda_bwd_wy(*tiles, out=tuple(shifted))
    assert launched == []
    launch.kda_bwd_wy(*tiles, out=launch.empty_outputs(tiles[0], 128))
    # 7 tiles, beta, G, 4 outputs, the final dk (dk itself without dk16), the tables (None)
    assert launched == [16]


def test_launcher_accumulates_into_dk_and_dg(monkeypatch):
    """dk and dg are the kernel's in / out accumulators: `empty_outputs` (and the call without
    `out`) zero them (the WY half alone), hands the caller's own tensors (kernel 2's dk, dG) to
    the kernel as they are, and returns them; dv and dbeta only written."""
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch

    seen = []
    # the kernel's outputs: (dk, dv, dg, dbeta) before the final dk and the two tables (None)
    monkeypatch.setattr(launch, "get_kernel", lambda *a: lambda *b: seen.append(b[-7:-3]))
    tiles = _tiles()
    dk, dv, dg, dbeta = launch.empty_outputs(tiles[0], 128)
    assert not dk.any() and not dg.any()
    dk.fill_(1.0), dg.fill_(2.0)
    got = launch.kda_bwd_wy(*tiles, out=(dk, dv, dg, dbeta))
    assert got[0] is dk and got[2] is dg and seen[0][0] is dk and seen[0][2] is dg
    assert (dk == 1.0).all() and (dg == 2.0).all()  # untouched by the launcher
    fresh = launch.kda_bwd_wy(*tiles)
    assert not fresh[0].any() and not fresh[2].any()


def test_launcher_dv16(monkeypatch):
    """`dv16`: dv in dw's 16-bit dtype from `empty_outputs` and in the compile key (absent
    without it); an `out` whose dv's dtype disagrees with dv16 raises before any launch."""
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch

    keys = []
    monkeypatch.setattr(launch, "get_kernel", lambda spec, key: keys.append(dict(key)) or
                        (lambda *a: None))  # fmt: skip
    tiles = _tiles()
    outs = launch.kda_bwd_wy(*tiles, dv16=True)
    assert outs[1].dtype == torch.bfloat16 and keys[-1].get("dv16") is True
    assert [outs[i].dtype for i in (0, 2, 3)] == [torch.float32] * 3
    launch.kda_bwd_wy(*tiles)
    assert "dv16" not in keys[-1]
    n = len(keys)
    with pytest.raises(ValueError, match=r"out's dv must be contiguous bfloat16.*dv16"):
        launch.kda_bwd_wy(*tiles, dv16=True, out=launch.empty_outputs(tiles[0], 128))
    with pytest.raises(ValueError, match="out's dv must be contiguous float32"):
        launch.kda_bwd_wy(*tiles, out=launch.empty_outputs(tiles[0], 128, dv16=True))
    assert len(keys) == n


@pytest.mark.parametrize("valid", [1, 37, 63])
def test_rows_past_valid_change_no_valid_row(valid, monkeypatch):
    """The varlen-native plan's claim for the WY kernel (NOTES "next/varlen-native-plan"
    section 2): one chunk whose k, v tiles hold the next sequence's rows past `valid` (finite),
    dw, dU zero there (kernel 2 writes dw's 64 rows, kernel 1 dU's), T^T, W, u, G zero there
    (the token-major first pass), beta `valid` rows, the model's masks keyed on `valid`: every
    valid row of dk, dv, dG, dbeta bit for bit the zero-padded chunk's; NaN there reaches dk,
    dG, dbeta (the finite premise)."""
    keyed = kda_bwd_wy.sub_chunk_decays
    monkeypatch.setattr(kda_bwd_wy, "sub_chunk_decays", lambda gc, t: keyed(gc, valid))
    f, dw, d_u, g = problem(1, valid, 3, seed=valid)
    big_g = cumulative_decay(g, f.w.shape[1])
    tiles = [x.double() for x in wy_tiles(f, dw, d_u, big_g, torch.float32)]
    dw_t, du_t, tt, w, k, u, v, beta, g_t = tiles

    def run(fill):
        gen = torch.Generator().manual_seed(5)
        k_e, v_e = (past_valid(x, fill, gen) for x in (k, v))
        dw_e, du_e, tt_e, w_e, u_e, g_e = (past_valid(x, None, gen)
                                           for x in (dw_t, du_t, tt, w, u, g_t))  # fmt: skip
        out = wy_grads_model(dw_e, du_e, tt_e, w_e, k_e, u_e, v_e, beta, g_e)
        return [x[:, :valid] for x in out]

    for name, x, y in zip(NAMES, run(1e4), run(None)):
        assert torch.equal(x, y), name
    assert [bool(x.isnan().any()) for x in run(float("nan"))] == [True, False, True, True]
