"""The KDA forward's first pass with its `bwd` key (kernels/linear_attention/kda_prefill/sm90
`intra.py`; `intra_params_for(dtype, k, bwd=True)`): the two more outputs the KDA backward's WY
kernel reads (reference/kda_bwd_wy.py `wy_tiles`' tt and G), on the CPU.

- the model (`operands.kda_chunk_operands(..., bwd=True)`): tt = T^T (T = L^-1 unscaled) and
  big_g = G equal reference/kda_bwd.py `_Factors`' (its `lower` inverted and transposed, g's
  cumsum within the chunk; fp64) to bf16 / fp32 rounding on awkward lengths, grouped heads and
  g in [-5, -4]; rows past the sequence exact zeros; the forward's outputs unchanged; W and u
  (next/kda-wu) the fp64 products of its own bf16 t_beta, k_g and v rows to one bf16 rounding,
  and `_Factors`' w, u to the bf16 operands' roundings;
- the launcher's bwd call on the kernel's CPU replay (tests/kda_prefill_replay.py) equals the
  model, varlen with empty sequences; P^T ("pt") in P's place, bitwise the forward key's P
  transposed chunk by chunk (next/kda-glue3);
- the compile key: the forward's keys as before, `bwd` named only when on;
- the bwd key compiled for sm_90a: no spill, three CTAs an SM as the forward's key, the same
  shared memory, 20 more 16-byte stores (tt 4, big_g 16) and 32 scalar shared loads; P^T's 32
  scalar 16-bit column loads in place of P's 4 row loads (its 4 stores the same count); W and
  u's stage (next/kda-wu): 16 more cp.async, 20 more mma.sync in a rolled loop of 4, 4
  transposed ldmatrix, 48 LDS.64 and 16 8-byte stores (two branches of 8); the forward keys'
  SASS pinned (tests/test_kda_prefill_compile.py `test_first_pass_forward_sass_pinned`);
- the varlen-native backward's premise (next/varlen-native-plan): the model on token-major
  inputs equals the backward's packed slot run chunk by chunk on the valid rows."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import intra_params_for, operands
from forgekernel.reference.delta_rule_bwd import _solve_lower
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.reference.kda_bwd import _Factors

C = 64
K = 128
SMEM_FORWARD = 73984  # the forward key's SharedStorage (the DSL adds a 1 KB static)


def _inputs(b, t, h, hv, strong, seed, with_v=False):
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen)

    q = rnd(b, t, h, K).to(torch.bfloat16)
    k = F.normalize(rnd(b, t, h, K), dim=-1).to(torch.bfloat16)
    if strong:
        g = -4.0 - torch.rand(b, t, hv, K, generator=gen)
    else:
        g = F.logsigmoid(rnd(b, t, hv, K) + 2.0)
    beta = torch.sigmoid(rnd(b, t, hv))
    if with_v:
        return q, k, g, beta, rnd(b, t, hv, K).to(torch.bfloat16)
    return q, k, g, beta


def _reference(k, g, beta, hv):
    """(T^T, G) of reference/kda_bwd.py `_Factors` in fp64, token-major (B, T, HV, ...)."""
    b, t = k.shape[:2]
    kx = k.double().repeat_interleave(hv // k.shape[2], dim=2)
    v = torch.zeros(b, t, hv, 1, dtype=torch.float64)
    f = chunk_factors(kx, kx, v, g.double(), beta.double(), _Factors)
    eye = torch.eye(C, dtype=torch.float64).expand_as(f.lower)
    tt = _solve_lower(f.lower, eye).transpose(-1, -2)
    big_g = to_chunks(g.double(), f.lower.shape[1]).cumsum(-2)
    return to_tokens(tt)[:, :t], to_tokens(big_g)[:, :t]


def _model(q, k, g, beta, bwd=True, v=None):
    b, t = q.shape[:2]
    cu = torch.arange(b + 1, dtype=torch.int32) * t
    flat = (x.flatten(0, 1) for x in (q, k, g, beta))
    if bwd and v is None:  # tt / big_g tests: any v
        v = torch.ones(*g.shape[:3], K, dtype=q.dtype)
    v = None if v is None else v.flatten(0, 1)
    return operands.kda_chunk_operands(*flat, cu, 0.1, False, seq_len=t, bwd=bwd, v=v)


CASES = [
    (1, 1, 1, 1, False),
    (2, 63, 2, 2, False),
    (1, 64, 1, 2, True),
    (3, 65, 2, 4, True),
    (2, 200, 1, 2, True),
    (2, 200, 2, 2, False),
]


@pytest.mark.parametrize(("b", "t", "h", "hv", "strong"), CASES)
def test_model_equals_the_backward_factors(b, t, h, hv, strong):
    """tt within one bf16 rounding (2^-8 relative) of fp64 T^T plus fp32 noise (1e-5 of its
    largest entry); big_g within 1e-5 of G's largest magnitude (fp32 cumsum); the padded rows
    (past each sequence, to the chunk's end) exact zeros in both."""
    q, k, g, beta = _inputs(b, t, h, hv, strong, seed=t)
    got = _model(q, k, g, beta)
    rows = got["tt"].shape[0] // b
    assert rows == -(-t // C) * C
    tt, big_g = (got[n].unflatten(0, (b, rows)) for n in ("tt", "big_g"))
    assert got["tt"].dtype == torch.bfloat16 and got["big_g"].dtype == torch.float32
    tt_ref, g_ref = _reference(k, g, beta, hv)
    err = (tt[:, :t].double() - tt_ref).abs()
    assert (err <= 2**-8 * tt_ref.abs() + 1e-5 * tt_ref.abs().max()).all(), float(err.max())
    assert float(tt_ref.abs().max()) >= 1.0  # the unit diagonal (T is unscaled)
    g_err = float((big_g[:, :t].double() - g_ref).abs().max())
    assert g_err <= 1e-5 * float(g_ref.abs().max()) + 1e-6, g_err
    assert not tt[:, t:].any() and not big_g[:, t:].any()


def test_bwd_leaves_the_forward_outputs_as_they_were():
    q, k, g, beta = _inputs(2, 130, 2, 4, True, seed=3)
    on, off = _model(q, k, g, beta, bwd=True), _model(q, k, g, beta, bwd=False)
    assert set(on) - set(off) == {"tt", "big_g", "pt", "w", "u"} and set(off) - set(on) == {"p"}
    for name, x in off.items():
        if name != "p":
            assert torch.equal(on[name], x), name
    assert torch.equal(on["pt"], _transposed(off["p"]))  # P^T in P's place, bitwise


@pytest.mark.parametrize(("b", "t", "h", "hv", "strong"), CASES)
def test_model_w_u(b, t, h, hv, strong):
    """W = T_beta Kg and u = T_beta V (next/kda-wu: the bwd key writes them, the backward's two
    torch GEMMs a value head gone): the fp64 products of the model's own bf16 t_beta, k_g and
    v rows chunk by chunk to one bf16 rounding (2^-8 relative) plus fp32 noise; `_Factors`' w,
    u (fp64 from scratch, the triangular solve) within the bf16 operands' roundings (2^-6 of
    the largest entry); rows past the sequence exact zeros."""
    q, k, g, beta, v = _inputs(b, t, h, hv, strong, seed=t + 7, with_v=True)
    got = _model(q, k, g, beta, v=v)
    rows = got["w"].shape[0] // b
    assert got["w"].dtype == got["u"].dtype == torch.bfloat16

    def chunks(x):  # (B rows, HV, D) -> (B, NC, HV, 64, D) fp64
        return to_chunks(x.unflatten(0, (b, rows)).double(), rows // C)

    tb = chunks(got["t_beta"])
    vp = F.pad(v, (0, 0, 0, 0, 0, rows - t)).double()
    kx = k.double().repeat_interleave(hv // h, dim=2)
    f = chunk_factors(kx, kx, v.double(), g.double(), beta.double(), _Factors)
    for name, x, ref in (("w", chunks(got["k_g"]), f.w), ("u", to_chunks(vp, rows // C), f.u)):
        out = got[name].unflatten(0, (b, rows))
        exact = to_tokens(tb @ x)
        err = (out.double() - exact).abs()
        assert (err <= 2**-8 * exact.abs() + 1e-5 * exact.abs().max()).all(), name
        want = to_tokens(ref)[:, :t]
        loose = float((out[:, :t].double() - want).abs().max())
        assert loose <= 2**-6 * float(want.abs().max()), (name, loose)
        assert not out[:, t:].any(), name


def _transposed(p):
    """The first pass's (R, HV, 64) rows with each chunk's 64 x 64 tile transposed."""
    return p.unflatten(0, (-1, C)).permute(0, 3, 2, 1).flatten(0, 1)  # [c, j, h, i] = P_c[i, j]


def test_launcher_bwd_on_the_kernel_replay(monkeypatch):
    """first_pass_kernel(bwd=True) with get_kernel answering the kernel's CPU replay: the bwd
    key asked for, tt, big_g, w and u as the model's over the real chunks (varlen: empty
    sequences, lengths off the chunk, grouped heads, strong decay): T by the tensor-core merges'
    tf32 model, so tt, w and u within 1e-2 of their largest entry; G bitwise (the same fp32
    cumsum)."""
    import kda_prefill_replay as replay  # tests/ is on the path

    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch

    keys = []

    def get(spec, params):
        keys.append(params)
        return replay.intra_kernel(dict(params))

    monkeypatch.setattr(launch, "get_kernel", get)
    lens = [1, 0, 63, 64, 65, 130]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, g, beta, v = (x[0] for x in _inputs(1, sum(lens), 2, 4, True, seed=5, with_v=True))
    got = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, bwd=True, v=v)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False, bwd=True, v=v)
    assert keys == [intra_params_for("bfloat16", 128, bwd=True)]
    real = C * sum(-(-n // C) for n in lens)
    assert got["tt"].shape == want["tt"].shape and got["big_g"].shape == want["big_g"].shape
    tt, tt_want = got["tt"][:real].float(), want["tt"][:real].float()
    assert float((tt - tt_want).abs().max()) <= 1e-2 * float(tt_want.abs().max())
    assert torch.equal(got["big_g"][:real], want["big_g"][:real])
    for name in ("w", "u"):  # from the replay's t_beta (the tf32 merges' T): as tt's bound
        x, x_want = got[name][:real].float(), want[name][:real].float()
        assert float((x - x_want).abs().max()) <= 1e-2 * float(x_want.abs().max()), name
    # P^T where the forward key writes P: the same replayed values, each chunk transposed
    fwd = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    assert "w" not in fwd and "u" not in fwd
    assert "p" not in got and torch.equal(got["pt"][:real], _transposed(fwd["p"][:real]))


def test_v_goes_with_bwd():
    """v is the bwd key's input (W, u): refused without bwd, required with it, (T, HV, K) in q's
    dtype; the model the same."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch

    q, k, g, beta, v = (x[0] for x in _inputs(1, 70, 1, 2, False, seed=1, with_v=True))
    cu = torch.tensor([0, 70], dtype=torch.int32)
    for fn in (launch.first_pass_kernel, operands.kda_chunk_operands):
        with pytest.raises(ValueError, match="v is the bwd"):
            fn(q, k, g, beta, cu, 0.1, False, bwd=True)
        with pytest.raises(ValueError, match="v is the bwd"):
            fn(q, k, g, beta, cu, 0.1, False, v=v)
    for bad in (v[:, :1], v.half()):
        with pytest.raises(ValueError, match="v must be"):
            launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, bwd=True, v=bad)


def test_compile_keys():
    """The forward's keys as before the flag; bwd named only when on; the standard builds the
    forward's two, then the backward's bf16 key (prebuilt: `forgekernel build`)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import INTRA_SPEC

    assert INTRA_SPEC.standard_params() == [
        (("dtype", "float16"), ("k", 128)),
        (("dtype", "bfloat16"), ("k", 128)),
        (("bwd", True), ("dtype", "bfloat16"), ("k", 128)),
    ]
    assert intra_params_for("bfloat16") == (("dtype", "bfloat16"), ("k", 128))
    assert intra_params_for("float16", 128, bwd=False) == (("dtype", "float16"), ("k", 128))
    assert intra_params_for("bfloat16", bwd=True) == (
        ("bwd", True), ("dtype", "bfloat16"), ("k", 128),
    )  # fmt: skip


# ----------------------------------------------------------------------------- the compile


def _compiled(dtype: str, bwd: bool):
    pytest.importorskip("cutlass")
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import compile_kda_intra
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra import KdaIntraSm90
    from forgekernel.runtime.resources import (
        find_tool,
        inspect_cubin,
        sass_instructions,
        sass_text,
    )

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    kernel = KdaIntraSm90(K, bwd=bwd)
    with tempfile.TemporaryDirectory() as d:
        params = dict(intra_params_for(dtype, K, bwd=bwd))
        compiled = compile_kda_intra(params, "sm_90a", f"--keep-cubin --dump-dir {d}", kernel)
        cubin = compiled.artifacts.CUBIN
        if isinstance(cubin, bytes):
            path = Path(d) / "k.cubin"
            path.write_bytes(cubin)
            cubin = path
        res = inspect_cubin(cubin)
        ops = [op for op, _ in sass_instructions(sass_text(cubin))]
    return res, ops, kernel.shared_storage.size_in_bytes()


@pytest.mark.parametrize("dtype", ["bfloat16", pytest.param("float16", marks=pytest.mark.slow)])
def test_bwd_key_compiles(dtype):
    """No spill, three CTAs an SM (registers within the launch bound 168: 159 bf16 / 168 fp16
    with W and u, cu13 ptxas 2026-12-06 (152 / 162 before); the forward's key 168), 73,984 B of
    shared memory as the forward's key (Kg and V land in the B tiles, free after the
    products); the forward's 34 STG.128 plus tt's 4 and big_g's 16 (two a token), tt's 32
    scalar column loads (LDS); the L / P mma.sync blocks unchanged. W and u (next/kda-wu):
    Kg's and V's 8 + 8 cp.async (LDGSTS) after the products, their 80 mma a warp as a rolled
    loop of 4 steps (20 HMMA, 4 transposed ldmatrix each), T_beta's 10 A fragments from 40
    LDS.64 of T and 8 of beta, the C fragments in 8-byte stores (a lane pair's shuffle: whole
    sectors): 8 a step, in the W and the u branch (16 STG.E.64)."""
    from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

    res, ops, smem = _compiled(dtype, bwd=True)
    assert res["spill_bytes"] == 0
    assert not [op for op in ops if op.startswith(("LDL", "STL"))]
    regs = -(-res["registers"] // 8) * 8
    assert 3 * regs * THREADS_PER_WG <= REGISTERS_PER_SM
    assert smem == SMEM_FORWARD and res["smem_bytes"] == 1024
    assert 3 * (smem + res["smem_bytes"] + 1024) <= 228 * 1024
    assert ops.count("STG.E.128") == 34 + 4 + 16
    assert ops.count("STG.E.64") == 2 * 8  # W's, u's C fragments (two bf16 pairs a lane)
    assert sum(op.startswith("STG") for op in ops) == 34 + 4 + 16 + 16
    assert sum(op.startswith("LDGSTS") for op in ops) == 16 + 16  # q, k; then Kg, V
    # P^T (next/kda-glue3): P's 4 row loads (LDS.128, the forward key's 82) and 4 stores gone,
    # its 32 scalar column loads and 4 stores in their place
    assert ops.count("LDS.128") == 78 and ops.count("LDS.U16") == 32
    assert ops.count("LDS.64") == 4 + 40 + 8  # the forward's 4; T_beta's A fragments
    assert ops.count("HMMA.16816.F32.BF16") == 3 * 2 * 16 + 20  # L, P; W and u (a loop step)
    assert ops.count("LDSM.16.M88.4") == 3 * 3 * 8 and ops.count("LDSM.16.MT88.4") == 4
    assert ops.count("HMMA.1688.F32.TF32") == 7 * 4


def test_token_major_chunks_are_the_packed_slots():
    """The premise of the varlen-native backward's KDA step (NOTES "next/varlen-native-plan"
    section 2, KDA first pass): a chunk's first-pass outputs depend on its own valid rows only,
    so the model on the token-major inputs (dense chunks, `chunk_tables`) gives at chunk c of
    sequence n what the backward's slot path gets from the PACKED inputs (ops/_linattn_varlen.py
    `pack`, one sequence of S C tokens) at slot bos_n // 64 + n + c: every output bit for bit on
    the chunk's valid rows, decay too. Past them the token-major run writes exact zeros; the
    packed run zeros too but T^T's identity rows and G held at its last valid value (kernel 2
    and the WY kernel in slot form read that row as G_C: the native form must mask by the
    table's valid, as the batch path's T-tail). The packed run's other slots (the pad slots
    kernel 1 walks) are zero tiles, T^T = I and decay 1: what a token-major call through a
    per-slot table must put there (the first pass leaves a length-0 chunk unwritten)."""
    from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import first_slot
    from forgekernel.ops import _linattn_varlen as varlen

    lens = [1, 0, 63, 64, 65, 130, 0]
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    q, k, g, beta, v = (x[0] for x in _inputs(1, sum(lens), 2, 4, True, seed=7, with_v=True))
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False, bwd=True, v=v)
    slots = varlen.slot_layout(cu, sum(lens))
    rows = C * slots.count
    packed = [varlen.pack(x, slots) for x in (q, k, g, beta, v)]
    one = torch.tensor([0, rows], dtype=torch.int32)
    got = operands.kda_chunk_operands(*packed[:4], one, 0.1, False, seq_len=rows, bwd=True,
                                      v=packed[4])  # fmt: skip
    names = ("q_g", "k_g", "k_d", "t_beta", "pt", "tt", "big_g", "w", "u")
    used = set()
    for n, (a, z) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist())):
        for c in range(-(-(z - a) // C)):
            gc, s = int(want["first"][n]) + c, first_slot(a, n) + c
            used.add(s)
            assert torch.equal(got["decay"][s], want["decay"][gc]), (n, c)
            valid = min(C, z - a - C * c)
            for name in names:
                x, y = got[name][C * s : C * s + C], want[name][C * gc : C * gc + C]
                assert torch.equal(x[:valid], y[:valid]), (n, c, name)
                assert not y[valid:].any(), (n, c, name)
                if name == "tt":  # T's identity rows
                    eye = torch.eye(C, dtype=x.dtype).unsqueeze(1)[valid:]
                    assert torch.equal(x[valid:], eye.expand_as(x[valid:]))
                elif name == "big_g":  # G flat past the sequence (g = 0 there)
                    assert torch.equal(x[valid:], x[valid - 1 : valid].expand_as(x[valid:]))
                else:
                    assert not x[valid:].any(), (n, c, name)
    pad = sorted(set(range(slots.count)) - used)
    assert len(pad) == slots.count - sum(-(-n // C) for n in lens) > 0
    for s in pad:
        assert bool((got["decay"][s] == 1).all())
        tile = slice(C * s, C * s + C)
        for name in names:
            want_pad = torch.zeros_like(got[name][tile])
            if name == "tt":
                want_pad += torch.eye(C, dtype=want_pad.dtype).unsqueeze(1)
            assert torch.equal(got[name][tile], want_pad), (s, name)
