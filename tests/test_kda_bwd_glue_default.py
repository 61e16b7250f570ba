"""The default KDA backward's (the device pass's) torch glue counted per token-head on the CPU
with its launchers running and only the compiled kernels stubbed (scripts/kda_bwd_glue_bytes.py
`count(..., launchers=True)`, `--launchers`), so that a regression in bytes or aten launches
shows here.

Pinned at 1 x 8192 tokens (128 chunks a head: the per-head products), H = HV = 1 (per token-head
the same as the bench's H = HV = 16), K = V = 128: 1.16 KB written a token-head with fp32 g and
beta (the bench's), 1.92 with bf16 (before 2026-12-06's glue pass: 5.67 and 6.43; read + written
13.3 -> 10.3 and 14.9 -> 10.9 KB; then 3.92 and 4.18 written; kernel 1's forward launch reading
u, W, Kd in chunk order took its 3 flips and 2 negations, 1.26 KB written; the WY kernel adding
its dk and dG onto kernel 2's in place (next/kda-wy-acc) the two fp32 adds; kernel 2 writing dw
in 16 bits (dw16) and the WY kernel dv in v's dtype (dv16) their casts; with bf16 g dG's cast to
bf16 stays, the fp32 sum rounded once; the first pass's bwd key writing P^T as kernel 1 reads
it (next/kda-glue3) its transposing copy: 1.04 and 1.80; the bwd key writing W and u
(next/kda-wu) the two bmm a value head and their bf16 products: 0.54 and 1.30)."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from script_modules import load_script

kda = load_script("kda_bwd_glue_bytes")
bwd = importlib.import_module("forgekernel.ops.kda_bwd")

# aten ops that write (int32 / int64 bookkeeping excluded) a call, by name
FP32_GATES = {"add": 2, "linalg_vector_norm": 2, "mul": 4, "pow": 2, "rsqrt": 2}
BF16_GATES = {**FP32_GATES, "_to_copy": 4}  # g, beta widened; dG, dbeta to bf16


def _float_ops(mode):
    return [op for op in mode.ops if op[1] not in ("int32", "int64")]


PINNED = [(torch.float32, 0.54, FP32_GATES), (torch.bfloat16, 1.30, BF16_GATES)]


@pytest.mark.parametrize(("g_dtype", "kb", "want"), PINNED)
def test_default_path_glue_per_token_head(g_dtype, kb, want):
    """The default switches (first pass, WY kernel) with the launchers' own torch counted: the
    bytes written a token-head within 1% of the pinned figure, the launches by op exactly; no
    launcher does torch (T a multiple of 64: every tile TMA-ready as handed over, G contiguous);
    no product or copy for W and u, none of P^T (the first pass's bwd key writes them); no add of
    dk's or dG's halves (the WY kernel adds onto kernel 2's in place); no cast of dw (kernel 2
    writes it in the tiles' dtype) nor of dv (the WY kernel writes it in v's); bf16 g: dG's one
    cast to bf16."""
    b, t = 1, 8192
    assert bwd.WY_IN_KERNEL and bwd.FACTORS_FROM_FIRST_PASS  # the default measured here
    mode = kda.count(b=b, t=t, h=1, hv=1, first_pass=True, wy_in_kernel=True, launchers=True,
                     g_dtype=g_dtype)  # fmt: skip
    assert (bwd.WY_IN_KERNEL, bwd.FACTORS_FROM_FIRST_PASS) == (True, True)  # restored
    ops = _float_ops(mode)
    written = sum(op[3] for op in ops) / (b * t) / 1024
    assert written == pytest.approx(kb, rel=1e-2)
    assert dict(Counter(op[0] for op in ops)) == want
    assert not [op for op in ops if "kernels/" in op[5]], "a launcher copied or cast"
    clones = [op[5] for op in ops if op[0] in ("clone", "copy_", "new_zeros", "zeros")]
    assert not clones  # P^T from the first pass as kernel 1 reads it (next/kda-glue3)
    assert not [op for op in ops if op[0] in ("add", "add_") and op[2] == (b, t, 1, 128)]
    casts = [
        op for op in ops if op[0] == "_to_copy" and op[2] == (b, t, 1, 128) and op[1] != "float32"
    ]  # dG's (not g's widening)
    dg_cast = [] if g_dtype == torch.float32 else [str(g_dtype)[6:]]
    assert sorted(op[1] for op in casts) == dg_cast  # no dw cast: kernel 2 writes it 16-bit
    assert not [op for op in ops if op[0] == "_to_copy" and op[2] == (b * t, 1, 128)]  # dv


def test_no_launcher_copy_and_no_products():
    """G cut to T (B = 2, T = 130: not contiguous) made contiguous once in `_device_pass`, not
    once in each of kernel 2's and the WY kernel's launchers; W and u from the first pass (no
    bmm, no pad of v: the bwd key's rows past T are zeros)."""
    mode = kda.count(b=2, t=130, h=2, hv=2, first_pass=True, wy_in_kernel=True, launchers=True,
                     g_dtype=torch.float32)  # fmt: skip
    ops = _float_ops(mode)
    assert not [op for op in ops if "kernels/" in op[5]]
    big_g = [op for op in ops if op[0] == "clone" and "big_g" in op[5]]
    assert len(big_g) == 1 and big_g[0][2] == (2, 130, 2, 128)
    assert not [op for op in ops if op[0] in ("bmm", "matmul", "constant_pad_nd")]


@pytest.mark.parametrize(("g_dtype", "kb"), [(torch.float32, 0.0), (torch.bfloat16, 0.756)])
def test_no_l2norm_final_outputs_glue(monkeypatch, g_dtype, kb):
    """Without l2norm at HV = H (the bench's case; next/kda-final-outputs, `_folds`): no q x
    scale copy (the first pass and kernel 2 take the scale; FINAL_QK False: 0.25 / 1.006 KB
    written a token-head with its one `mul`), the epilogue launcher not called (kernel 2 and
    the WY kernel write the op's 16-bit dq, dk). Since next/kda-wu (W and u from the first
    pass) nothing at fp32 g (0.5 KB before), bf16 g's widening and dG's cast (1.256 before).
    FINAL_QK is off by default since next/kda-bwd-regress (the H100 A/B: kernel 2 +0.65 ms
    with dq16), on here."""
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import launch as norm

    monkeypatch.setattr(bwd, "FINAL_QK", True)
    monkeypatch.setattr(norm, "gdn_bwd_norm", lambda *a, **k: pytest.fail("the epilogue"))
    b, t = 1, 8192
    mode = kda.count(b=b, t=t, h=1, hv=1, l2norm=False, first_pass=True, wy_in_kernel=True,
                     launchers=True, g_dtype=g_dtype)  # fmt: skip
    ops = _float_ops(mode)
    assert sum(op[3] for op in ops) / (b * t) / 1024 == pytest.approx(kb, rel=1e-2)
    assert not [op for op in ops if op[0] == "mul"]


def test_bench_call_glue_is_q_scale():
    """The bench's call (next/kda-glue3, next/kda-wu): no l2norm, HV = H, fp32 g and beta, out=
    given, B sequences of 128 chunks a head between them: what torch still launches is q x
    scale (FINAL_QK off) and nothing else: no W / u products (the first pass's bwd key; two
    bmm a value head before next/kda-wu, 0.5 KB), no copy into out= (dv, dbeta,
    d_initial_state, dg written by the kernels), no P^T copy (the first pass's bwd key), no dk
    epilogue (the WY kernel's dk16, only the dq one: stubbed, uncounted), 0.25 KB written a
    token-head."""
    b, t, hv = 2, 4096, 2
    calls = []
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import launch as norm

    real = norm.gdn_bwd_norm

    def epilogue(dxs, x, scale, l2norm, out=None):
        calls.append(scale)
        return real(dxs, x, scale, l2norm, out=out)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(norm, "gdn_bwd_norm", epilogue)
        mode = kda.count(b=b, t=t, h=hv, hv=hv, l2norm=False, first_pass=True, wy_in_kernel=True,
                         launchers=True, g_dtype=torch.float32, with_out=True)  # fmt: skip
    ops = _float_ops(mode)
    assert dict(Counter(op[0] for op in ops)) == {"mul": 1}
    assert calls == [pytest.approx(128**-0.5)]  # dq's epilogue only
    assert sum(op[3] for op in ops) / (b * t * hv) / 1024 == pytest.approx(0.25, rel=1e-2)
