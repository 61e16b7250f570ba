"""The Gated DeltaNet backward's kernel 2 (kernels/linear_attention/gdn_bwd_chunk/sm90) on the
CPU: its tile emulation (`reference.gdn_bwd_chunk`: `chunk_grads_model`, `wy_grads_model`, the
dG finish `kernel_dg`; the kernel's 16-bit operands rounded as it rounds them) equals
reference/delta_rule_bwd.py's pass 3 (`_output_grads`, and with the WY variant `_wy_grads`;
dG after its reverse cumsum) exactly in fp64 and within tolerance with bf16 / fp16 tiles, on
awkward T; the launcher's torch-only checks. The op with both kernels emulated:
tests/test_gdn_bwd_kernel_path.py; the GPU twin: tests/gpu/test_gdn_bwd_chunk_gpu.py. And the
varlen-native plan's premise (next/varlen-native-plan): a tail chunk's rows past its sequence,
finite, change no valid row under masks keyed on the chunk's valid length."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rows_past_valid import past_valid

from forgekernel.reference.delta_rule_bwd import _output_grads, _wy_grads
from forgekernel.reference.gdn_bwd_chunk import (
    chunk_grad_tiles,
    chunk_grads_model,
    kernel_dg,
    wy_grads_model,
    wy_tiles,
)
from forgekernel.reference.gdn_bwd_state import CHUNK, chunk_factors, to_chunks, to_tokens


def problem(b, t, hv, dk=16, dv=8, seed=0, dtype=torch.float64):
    """Chunk factors of random inputs and random h, dh, U, dU (U, dU zero past T, as the
    recurrences leave them) -> (f, do (B, T, HV, V), do chunked, h, dh, U, dU, qs, ks, g, v,
    beta (token-major))."""
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
    return f, do, to_chunks(do, nc), h, dh, big_u, d_u, qs, ks, g, v, beta


def emulate(p, dtype, wy):
    """The kernel's outputs on `problem` p's inputs in `dtype` (fp64 arithmetic): (dq, dk, dw,
    dG) or, wy, (dq, dk, dG, dv, dbeta)."""
    f, do, _, h, dh, big_u, d_u, qs, ks, g, v, beta = p
    tiles = [x.double() for x in chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype)]
    low = dtype in (torch.float16, torch.bfloat16)

    def rounding(x):
        return x.to(dtype).to(x.dtype)

    r = rounding if low else None
    dq, dk, dw, dg, te = chunk_grads_model(*tiles, r)
    if not wy:
        return dq, dk, dw, kernel_dg(dg, te, tiles[5], tiles[6], tiles[7])
    extra = [x.double() for x in wy_tiles(f, v, beta, dtype)]
    dq, dk, dg, te, dv, dbeta = wy_grads_model((dq, dk, dw, dg, te), tiles[2], tiles[4],
                                               tiles[5], tiles[7], *extra, r, r)  # fmt: skip
    return dq, dk, kernel_dg(dg, te, tiles[5], tiles[6], tiles[7]), dv, dbeta


def reference(p, wy):
    """Pass 3 of the reference on the same inputs, token-major, dG reverse-cumsummed."""
    f, _, do_c, h, dh, big_u, d_u, *_ = p
    t = p[1].shape[1]
    dq, dk, dw, d_g = _output_grads(f, do_c, h, dh, big_u, d_u)

    def tok(x):
        return to_tokens(x)[:, :t]

    if not wy:
        return tok(dq), tok(dk), tok(dw), tok(d_g.flip(-1).cumsum(-1).flip(-1))
    dk_wy, dv, dbeta, dg_wy = _wy_grads(f, dw, d_u)
    d_g = (d_g + dg_wy).flip(-1).cumsum(-1).flip(-1)
    return tok(dq), tok(dk + dk_wy), tok(d_g), tok(dv), tok(dbeta)


NAMES = {False: ("dq", "dk", "dw", "dg"), True: ("dq", "dk", "dg", "dv", "dbeta")}


@pytest.mark.parametrize("wy", [False, True])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200])
@pytest.mark.parametrize("b", [1, 2])
def test_emulation_is_pass_3_fp64(t, b, wy):
    """fp64, nothing rounded: the emulation is the reference's pass 3 (the dG folds, the
    column sums as row dots, the finish)."""
    p = problem(b, t, 3, seed=t)
    for name, a, r in zip(NAMES[wy], emulate(p, torch.float64, wy), reference(p, wy)):
        torch.testing.assert_close(a, r, rtol=1e-9, atol=1e-9, msg=name)


@pytest.mark.parametrize("wy", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [65, 200])
def test_emulation_rounded(t, dtype, wy):
    """16-bit tiles (do, U, dU, q, k, h, dh, T, w, u, v) and the kernel's 16-bit operands (dPD,
    dw, dkb, dvb, M) rounded: within 2e-2 of each gradient's max."""
    p = problem(2, t, 2, dk=32, dv=16, seed=t)
    for name, a, r in zip(NAMES[wy], emulate(p, dtype, wy), reference(p, wy)):
        err = float((a - r).abs().max())
        assert err <= 2e-2 * float(r.abs().max()), (name, err, float(r.abs().max()))


@pytest.mark.parametrize("t", [1, 65, 200])
def test_grouped_heads_are_the_repeated_ones(t):
    """q, k at H < HV heads (the kernel's `grouped` key): the model reads head hv // (HV / H),
    exactly the HV-repeated tensors' result (both halves)."""
    gen = torch.Generator().manual_seed(t)
    b, h, hv, nc = 2, 2, 6, -(-t // 64)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    do, u, du = rnd(b, t, hv, 8), rnd(b, t, hv, 8), rnd(b, t, hv, 8)
    q, k = rnd(b, t, h, 16), rnd(b, t, h, 16)
    st, dst = rnd(b, nc, hv, 16, 8), rnd(b, nc, hv, 16, 8)
    big_g = -torch.rand(b, t, hv, generator=gen, dtype=torch.float64).cumsum(1) * 0.1
    qr, kr = (x.repeat_interleave(hv // h, dim=2) for x in (q, k))
    grouped = chunk_grads_model(do, u, du, q, k, st, dst, big_g)
    repeated = chunk_grads_model(do, u, du, qr, kr, st, dst, big_g)
    for a, r in zip(grouped, repeated):
        assert torch.equal(a, r)
    tt, w, uw, v = rnd(b, t, hv, 64), rnd(b, t, hv, 16), rnd(b, t, hv, 8), rnd(b, t, hv, 8)
    beta = torch.rand(b, t, hv, generator=gen, dtype=torch.float64)
    for a, r in zip(wy_grads_model(grouped, du, k, st, big_g, tt, w, uw, v, beta),
                    wy_grads_model(repeated, du, kr, st, big_g, tt, w, uw, v, beta)):  # fmt: skip
        assert torch.equal(a, r)


def test_launcher_checks():
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import (
        check_inputs,
        check_wy_inputs,
    )

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
    one = torch.zeros(b, t, 1, 128, dtype=torch.bfloat16)  # grouped: H = 1 divides HV = 3
    assert check_inputs(x16, x16, x16, one, one, st, st, big_g) == (b, t, hv, nc)
    with pytest.raises(ValueError, match="k must be"):
        check_inputs(x16, x16, x16, one, x16, st, st, big_g)
    with pytest.raises(ValueError, match="q must be"):
        two = torch.zeros(b, t, 2, 128, dtype=torch.bfloat16)  # 2 does not divide 3
        check_inputs(x16, x16, x16, two, two, st, st, big_g)
    tt = torch.zeros(b, t, hv, 64, dtype=torch.bfloat16)
    check_wy_inputs(x16, x16, tt, x16, x16, x16, big_g)
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import config
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import empty_wy_outputs

    assert empty_wy_outputs(x16, 128, dv16=True)[3].dtype == torch.bfloat16
    assert empty_wy_outputs(x16, 128)[3].dtype == torch.float32
    assert dict(config.params_for("bfloat16", wy=True)) == {"dtype": "bfloat16", "k": 128,
                                                             "v": 128, "wy": True}  # fmt: skip
    with pytest.raises(ValueError, match="dv16 needs wy"):
        config.params_for("bfloat16", dv16=True)
    with pytest.raises(ValueError):
        check_wy_inputs(x16, x16, x16, x16, x16, x16, big_g)  # T^T tile 128 wide
    with pytest.raises(TypeError):
        check_wy_inputs(x16, x16, tt, x16.half(), x16, x16, big_g)
    with pytest.raises(ValueError):
        check_wy_inputs(x16, x16, tt, x16, x16, x16, big_g.bfloat16())


def test_token_rows_checks():
    """The `token_rows` key's tables and tokens (`check_tables`, `empty_wy_outputs`): together,
    B = 1, int32 (NC,); the outputs at the tokens' count; the key flag with wy only."""
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90 import config
    from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import (
        check_tables,
        empty_wy_outputs,
    )

    tab = torch.zeros(3, dtype=torch.int32)
    check_tables(None, None, 2, 130)
    check_tables((tab, tab), 100, 1, 130)  # NC = 3
    with pytest.raises(ValueError, match="together"):
        check_tables((tab, tab), None, 1, 130)
    with pytest.raises(ValueError, match="B = 1"):
        check_tables((tab, tab), 100, 2, 130)
    with pytest.raises(ValueError, match="int32"):
        check_tables((tab, tab[:2]), 100, 1, 130)
    with pytest.raises(ValueError, match="int32"):
        check_tables((tab.long(), tab), 100, 1, 130)
    x16 = torch.zeros(1, 192, 3, 128, dtype=torch.bfloat16)
    shapes = [tuple(x.shape) for x in empty_wy_outputs(x16, 128, True, True, tokens=100)]
    assert shapes == [(1, 100, 3, 128), (1, 100, 3, 128), (1, 100, 3), (1, 100, 3, 128),
                      (1, 100, 3)]  # fmt: skip
    assert dict(config.params_for("bfloat16", wy=True, token_rows=True))["token_rows"]
    with pytest.raises(ValueError, match="token_rows needs wy"):
        config.params_for("bfloat16", token_rows=True)


def _one_chunk_past_valid(valid, fill):
    """Kernel 2's model (WY variant, fp64) on ONE chunk whose token tiles (dO, q, k, v) hold
    `valid` rows of a problem and 64 - valid rows of `fill` past them (`past_valid`: zeros, the
    slot layout; finite noise, a tail chunk's box reading the next sequence; NaN), the masks
    keyed on `valid` (G and beta `valid` rows long), the intermediates as kernels 0 / 1 leave
    them past valid (U, dU, W, u zero; T^T identity rows) and dG's rows stashed zero past valid
    (`_stash_rows`) -> its valid rows of (dq, dk, dG, dv, dbeta)."""
    f, do, _, h, dh, big_u, d_u, qs, ks, g, v, beta = problem(1, valid, 3, seed=valid)
    tiles = [x.double() for x in chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, torch.float32)]
    do_t, u_t, du_t, q_t, k_t, h_t, dh_t, big_g = tiles
    tt, w, uw, v_t, beta_t = (x.double() for x in wy_tiles(f, v, beta, torch.float32))
    gen = torch.Generator().manual_seed(99)
    do_e, q_e, k_e, v_e = (past_valid(x, fill, gen) for x in (do_t, q_t, k_t, v_t))
    u_e, du_e, w_e, uw_e = (past_valid(x, None, gen) for x in (u_t, du_t, w, uw))
    eye = torch.eye(CHUNK, dtype=tt.dtype)[valid:].unsqueeze(0).unsqueeze(2)
    tt_e = torch.cat([tt, eye.expand(1, CHUNK - valid, tt.shape[2], CHUNK)], 1)
    out = chunk_grads_model(do_e, u_e, du_e, q_e, k_e, h_t, dh_t, big_g)
    dq, dk, dg, te, dv, dbeta = wy_grads_model(out, du_e, k_e, h_t, big_g, tt_e, w_e, uw_e, v_e,
                                               beta_t)  # fmt: skip
    dg, te = dg.clone(), te.clone()
    dg[:, valid:] = 0
    te[:, valid:] = 0
    big_dg = kernel_dg(dg, te, h_t, dh_t, big_g)
    return [x[:, :valid] for x in (dq, dk, big_dg, dv, dbeta)]


@pytest.mark.parametrize("valid", [1, 37, 63])
def test_rows_past_valid_change_no_valid_row(valid):
    """The varlen-native plan's claim for kernel 2 (NOTES "next/varlen-native-plan" section 2,
    GDN kernel 2: masks from the table's `valid`, no new mask): the next sequence's rows in a
    tail chunk's token tiles (finite) leave every valid row's gradient bit for bit the
    zero-padded chunk's; NaN there does reach dq, dk, dG, dbeta (the finite premise the forward
    makes too: isolation would need the rows zeroed in shared memory)."""
    want = _one_chunk_past_valid(valid, None)
    got = _one_chunk_past_valid(valid, 1e4)
    for name, x, y in zip(("dq", "dk", "dg", "dv", "dbeta"), got, want):
        assert torch.equal(x, y), name
    poisoned = _one_chunk_past_valid(valid, float("nan"))
    assert [bool(x.isnan().any()) for x in poisoned] == [True, True, True, False, True]
