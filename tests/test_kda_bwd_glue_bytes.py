"""scripts/kda_bwd_glue_bytes.py (and gdn_bwd_glue_bytes.py's `Written` mode it imports) on a
tiny shape: the KDA backward's torch glue is counted with the kernels stubbed (bytes, ops that
write, matmul FLOPs, by source line and by the ops/ line that led there) and the stubs are put
back; the GDN count gains the op and FLOP columns."""

from __future__ import annotations

import importlib

import torch
from script_modules import load_script

kda = load_script("kda_bwd_glue_bytes")


def test_kda_glue_counted_and_stubs_restored(capsys):
    bwd = importlib.import_module("forgekernel.ops.kda_bwd")
    names = ("_state_recurrence", "_chunk_grads", "_qk_grads", "CHUNK_IN_KERNEL", "WY_IN_KERNEL",
             "FACTORS_FROM_FIRST_PASS")  # fmt: skip
    before = [getattr(bwd, n) for n in names]
    mode = kda.count(b=1, t=70, h=1, hv=2, dk=16, dv=16)
    assert [getattr(bwd, n) for n in names] == before
    assert sum(mode.by_site.values()) == sum(mode.by_caller.values()) > 0
    assert sum(mode.launches.values()) == sum(mode.launches_by_caller.values()) > 50
    assert sum(mode.flops.values()) == sum(mode.flops_by_caller.values()) > 0
    callers = " ".join(mode.by_caller)
    assert "ops/kda_bwd.py" in callers and "chunk_factors" in callers and "_wy_grads" in callers
    # one head pass: no concatenation; the q / k epilogue on its (stubbed) kernel, not in torch
    ours = [s for s in mode.by_site if "ops/kda_bwd.py" in s]
    assert ours and not any("torch.cat" in s or "_l2norm" in s for s in ours)
    assert not any("delta_rule_bwd.py" in s and "_l2norm" in s for s in mode.by_site)
    # the torch fallback of pass 3 adds `_output_grads`' matmuls
    torch_chunk = kda.count(b=1, t=70, h=1, hv=2, dk=16, dv=16, chunk_in_kernel=False)
    assert sum(torch_chunk.flops.values()) > sum(mode.flops.values())
    # the WY kernel (stubbed): `_wy_grads` and its matmuls gone, its tiles (T's solve) counted
    wy_kernel = kda.count(b=1, t=70, h=1, hv=2, dk=16, dv=16, wy_in_kernel=True)
    assert "_wy_grads" not in " ".join(wy_kernel.by_caller)
    assert "wy_tiles" in " ".join(wy_kernel.by_caller)
    assert sum(wy_kernel.by_site.values()) < sum(mode.by_site.values())
    assert [getattr(bwd, n) for n in names] == before  # the switches restored (defaults: on)
    kda.main(["--t", "40", "--h", "1", "--hv", "1", "--top", "3", "--no-states"])
    out = capsys.readouterr().out
    assert "KB a token-head" in out and "aten ops that write" in out and "GFLOP" in out


def test_gdn_count_has_ops_and_flops():
    mode = kda.glue.count(b=1, t=64, h=1, hv=2, dtype=torch.bfloat16)
    assert sum(mode.launches.values()) > 0
    assert sum(mode.flops.values()) == 0  # GDN's path has no torch GEMM left


def test_first_pass_and_wy_kernel_drop_the_torch_factors():
    """FACTORS_FROM_FIRST_PASS with WY_IN_KERNEL (both stubbed): no sub-chunked score and no
    score gradient in torch; fewer bytes than either alone; the module's switches restored."""
    glue_bytes = load_script("kda_bwd_glue_bytes")
    bwd = importlib.import_module("forgekernel.ops.kda_bwd")
    kb, switches = {}, (bwd.FACTORS_FROM_FIRST_PASS, bwd.WY_IN_KERNEL)
    for first, wy in ((False, False), (True, False), (False, True), (True, True)):
        mode = glue_bytes.count(t=130, h=2, hv=2, first_pass=first, wy_in_kernel=wy)
        kb[first, wy] = sum(mode.by_site.values())
        if first and wy:
            sites = " ".join(mode.by_site)
            assert "_block_scores" not in sites and "score_grads" not in sites
    assert kb[True, True] < min(kb[True, False], kb[False, True]) < kb[False, False]
    assert (bwd.FACTORS_FROM_FIRST_PASS, bwd.WY_IN_KERNEL) == switches  # restored


def test_device_pass_drops_the_tile_conversions():
    """Both opt-ins take the device pass (kernel 1's 16-bit forms, stubbed with out16): none of
    the default path's tile conversions (forward_state_tiles, forward_states, to_chunks of dO,
    the 16-bit tiles of P^T, W, h, dh, U, dU, the WY tiles) is left; what torch writes is W, u
    (two bmm), their reversed negated copies, P^T, G and the adds: 8.4 KB a token-head at
    1 x 2048 H16 (24.7 on the fp32-out path), under half of it at this size too (T = 130: a
    third of the last chunk padding)."""
    glue_bytes = load_script("kda_bwd_glue_bytes")
    bwd = importlib.import_module("forgekernel.ops.kda_bwd")
    on_device = bwd._on_device
    bwd._on_device = lambda dtype: False
    try:
        fp32_out = glue_bytes.count(t=130, h=2, hv=2, first_pass=True, wy_in_kernel=True)
    finally:
        bwd._on_device = on_device
    mode = glue_bytes.count(t=130, h=2, hv=2, first_pass=True, wy_in_kernel=True)
    callers = " ".join(mode.by_caller)
    assert "_device_pass" in callers
    for name in ("forward_state_tiles", "forward_states", "chunk_grad_tiles", "wy_tiles",
                 "_reverse_tiles", "_FirstPassFactors", "to_chunks(do"):  # fmt: skip
        assert name not in callers, name
    assert "_device_pass" not in " ".join(fp32_out.by_caller)
    assert sum(mode.by_site.values()) < 0.5 * sum(fp32_out.by_site.values())
    assert sum(mode.launches.values()) <= 45 < sum(fp32_out.launches.values())


def test_first_pass_stub_rows_of_a_batch():
    """The first pass's stub gives the launcher's rows, every sequence's chunks (B NC 64): B = 2
    sequences of 70 tokens take 4 chunks, not the 3 of their 140 tokens (`_first_pass_ops`
    unflattens them to (B, NC 64)), with the torch factors' path and the device pass."""
    glue_bytes = load_script("kda_bwd_glue_bytes")
    for wy in (False, True):
        mode = glue_bytes.count(b=2, t=70, h=1, hv=2, dk=16, dv=16, first_pass=True,
                                wy_in_kernel=wy)  # fmt: skip
        assert sum(mode.by_site.values()) > 0
