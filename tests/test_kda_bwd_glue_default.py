"""The default KDA backward's (the device pass's) torch glue counted per token-head on the CPU
with its launchers running and only the compiled kernels stubbed (scripts/kda_bwd_glue_bytes.py
`count(..., launchers=True)`, `--launchers`), so that a regression in bytes or aten launches
shows here; and the per-head W / u products (`_chunk_products`) equal to the batched form.

Pinned at 1 x 8192 tokens (128 chunks a head: the per-head products), H = HV = 1 (per token-head
the same as the bench's H = HV = 16), K = V = 128: 1.16 KB written a token-head with fp32 g and
beta (the bench's), 1.92 with bf16 (before 2026-12-06's glue pass: 5.67 and 6.43; read + written
13.3 -> 10.3 and 14.9 -> 10.9 KB; then 3.92 and 4.18 written; kernel 1's forward launch reading
u, W, Kd in chunk order took its 3 flips and 2 negations, 1.26 KB written; the WY kernel adding
its dk and dG onto kernel 2's in place (next/kda-wy-acc) the two fp32 adds; kernel 2 writing dw
in 16 bits (dw16) and the WY kernel dv in v's dtype (dv16) their casts; with bf16 g dG's cast to
bf16 stays, the fp32 sum rounded once)."""

from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch
from script_modules import load_script

kda = load_script("kda_bwd_glue_bytes")
bwd = importlib.import_module("forgekernel.ops.kda_bwd")

# aten ops that write (int32 / int64 bookkeeping excluded) a call, by name
FP32_GATES = {"add": 2, "bmm": 2, "clone": 1,
              "linalg_vector_norm": 2, "mul": 4, "pow": 2, "rsqrt": 2}  # fmt: skip
BF16_GATES = {**FP32_GATES, "_to_copy": 4}  # g, beta widened; dG, dbeta to bf16


def _float_ops(mode):
    return [op for op in mode.ops if op[1] not in ("int32", "int64")]


PINNED = [(torch.float32, 1.16, FP32_GATES), (torch.bfloat16, 1.92, BF16_GATES)]


@pytest.mark.parametrize(("g_dtype", "kb", "want"), PINNED)
def test_default_path_glue_per_token_head(g_dtype, kb, want):
    """The default switches (first pass, WY kernel) with the launchers' own torch counted: the
    bytes written a token-head within 1% of the pinned figure, the launches by op exactly; no
    launcher does torch (T a multiple of 64: every tile TMA-ready as handed over, G contiguous);
    no layout copy around W and u (the one clone left is P^T's); no add of dk's or dG's halves
    (the WY kernel adds onto kernel 2's in place); no cast of dw (kernel 2 writes it in the
    tiles' dtype) nor of dv (the WY kernel writes it in v's); bf16 g: dG's one cast to bf16."""
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
    assert len(clones) == 1 and "to_tokens" in clones[0]
    assert not [op for op in ops if op[0] in ("add", "add_") and op[2] == (b, t, 1, 128)]
    casts = [
        op for op in ops if op[0] == "_to_copy" and op[2] == (b, t, 1, 128) and op[1] != "float32"
    ]  # dG's (not g's widening)
    dg_cast = [] if g_dtype == torch.float32 else [str(g_dtype)[6:]]
    assert sorted(op[1] for op in casts) == dg_cast  # no dw cast: kernel 2 writes it 16-bit
    assert not [op for op in ops if op[0] == "_to_copy" and op[2] == (b * t, 1, 128)]  # dv


def test_batched_products_below_the_threshold_and_no_launcher_copy():
    """Below HEADWISE_PRODUCTS_FROM chunks a head the batched product (its layout copies
    counted); G cut to T (B = 2, T = 130: not contiguous) made contiguous once in
    `_device_pass`, not once in each of kernel 2's and the WY kernel's launchers."""
    mode = kda.count(b=2, t=130, h=2, hv=2, first_pass=True, wy_in_kernel=True, launchers=True,
                     g_dtype=torch.float32)  # fmt: skip
    ops = _float_ops(mode)
    assert not [op for op in ops if "kernels/" in op[5]]
    big_g = [op for op in ops if op[0] == "clone" and "big_g" in op[5]]
    assert len(big_g) == 1 and big_g[0][2] == (2, 130, 2, 128)
    assert sum(op[0] == "bmm" for op in ops) == 2  # one batched product each for W and u


@pytest.mark.parametrize(
    ("b", "t", "hv", "heads"), [(2, 128, 3, slice(None)), (1, 130, 4, slice(1, 3))]
)
def test_chunk_products_headwise_equal_batched(monkeypatch, b, t, hv, heads):
    """`_chunk_products` one strided bmm a value head (threshold 0) equals the batched form
    (threshold past the chunks) bitwise, on the first pass's row layout (B NC 64 rows) and on
    head slices (a head pass), x zero-padded past T; the product token-major, contiguous."""
    nc = -(-t // 64)
    gen = torch.Generator().manual_seed(t)
    rows = torch.randn(b * nc * 64, hv, 64, generator=gen).bfloat16().unflatten(0, (b, nc * 64))
    x = torch.randn(b, t, hv, 128, generator=gen).bfloat16()
    x = torch.nn.functional.pad(x, (0, 0, 0, 0, 0, nc * 64 - t))
    a, x = rows[:, :, heads], x[:, :, heads]
    got = {}
    for threshold in (0, 10**9):
        monkeypatch.setattr(bwd, "HEADWISE_PRODUCTS_FROM", threshold)
        got[threshold] = bwd._chunk_products(a, x, nc)
    assert got[0].is_contiguous() and got[0].shape == x.shape
    assert torch.equal(got[0], got[10**9])
    want = (a.float().unflatten(1, (nc, 64)).transpose(2, 3)
            @ x.float().unflatten(1, (nc, 64)).transpose(2, 3))  # fmt: skip
    want = want.transpose(2, 3).flatten(1, 2)
    torch.testing.assert_close(got[0].float(), want, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize(("g_dtype", "kb"), [(torch.float32, 0.625), (torch.bfloat16, 1.381)])
def test_no_l2norm_final_outputs_glue(monkeypatch, g_dtype, kb):
    """Without l2norm at HV = H (the bench's case; next/kda-final-outputs, `_folds`): no q x
    scale copy (the first pass and kernel 2 take the scale; FINAL_QK False: 0.875 / 1.631 KB
    written a token-head with its one `mul`), the epilogue launcher not called (kernel 2 and
    the WY kernel write the op's 16-bit dq, dk). FINAL_QK is off by default since
    next/kda-bwd-regress (the H100 A/B: kernel 2 +0.65 ms with dq16), on here."""
    from forgekernel.kernels.linear_attention.gdn_bwd_norm.sm90 import launch as norm

    monkeypatch.setattr(bwd, "FINAL_QK", True)
    monkeypatch.setattr(norm, "gdn_bwd_norm", lambda *a, **k: pytest.fail("the epilogue"))
    b, t = 1, 8192
    mode = kda.count(b=b, t=t, h=1, hv=1, l2norm=False, first_pass=True, wy_in_kernel=True,
                     launchers=True, g_dtype=g_dtype)  # fmt: skip
    ops = _float_ops(mode)
    assert sum(op[3] for op in ops) / (b * t) / 1024 == pytest.approx(kb, rel=1e-2)
    assert not [op for op in ops if op[0] == "mul"]
