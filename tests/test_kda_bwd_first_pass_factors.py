"""KDA's backward with its factors' P, Qe, Ke, e^(G_C), W and u from the forward's first pass
(ops/kda_bwd.py FACTORS_FROM_FIRST_PASS, on by default since 2026-12-06 with WY_IN_KERNEL: the
device pass; `reference.kda_bwd._FirstPassFactors`) on the CPU: the first-pass kernel replaced
by its torch model (`operands.kda_chunk_operands`, the kernel's yardstick; tests/
test_kda_bwd_kernel_path.py's `emulated_first_pass`), kernels 1 and 2 and the WY kernel by that
file's emulations. The tests set both switches explicitly, so the paths with either off (the
torch factors, the WY half in torch) stay covered. With
32-bit operands (the model's OPERAND_DTYPE and FIRST_PASS_DTYPES widened to fp32) the path
equals the interim path to fp32 tolerance (so the field map is right: layouts, scaling, chunk
order, head passes); in bf16 it stays within 2e-2 of autograd through the fp64 recurrence and
within 1e-2 of the torch factors' path."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_kda_bwd_kernel_path import (
    NAMES,
    _all_emulated,
    _bf16_problem,
    _close,
    _fp64_grads,
    _interim_and_kernel,
    emulated_first_pass,
    emulated_kernel,
    kernel_path,  # noqa: F401  (the fixture)
)
from test_kda_bwd_op import cpu_forward  # noqa: F401  (the fixture)

from forgekernel.kernels.linear_attention.kda_prefill.sm90 import operands

bwd = importlib.import_module("forgekernel.ops.kda_bwd")
kda_ref = importlib.import_module("forgekernel.reference.kda_bwd")
wy_ref = importlib.import_module("forgekernel.reference.kda_bwd_wy")


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm", "strong", "passes"),
    [
        (1, 1, 1, 1, False, False, False),
        (2, 63, 2, 2, True, False, False),
        (1, 64, 1, 2, False, True, False),
        (3, 65, 2, 4, True, True, False),
        (2, 200, 1, 2, True, False, False),
        (2, 70, 2, 4, True, False, True),
    ],
)
@pytest.mark.parametrize("wy", [False, True])
def test_first_pass_factors_equal_the_interim_path(monkeypatch, b, t, h, hv, l2norm, strong,
                                                   passes, wy):  # fmt: skip
    """32-bit operands: every gradient within 1e-4 of its max of the interim path's, the first
    pass launched once over every head (value heads in passes included), kernel 1 twice a pass.
    With the WY kernel (emulated; WY_IN_KERNEL, the default) the first pass's `bwd` key gives its
    T^T: no torch solve, no sub-chunked M(k, k), none of the torch WY factors formed; `wy` False
    pins WY_IN_KERNEL off (the first pass's factors, the WY half in torch)."""
    first, calls = [], []
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", wy)
    monkeypatch.setattr(bwd, "FIRST_PASS_DTYPES", (torch.float32,))
    monkeypatch.setattr(operands, "OPERAND_DTYPE", torch.float32)
    _all_emulated(monkeypatch, calls, first_calls=first)
    if wy:
        fail = lambda *a, **k: pytest.fail("torch WY factors")  # noqa: E731
        monkeypatch.setattr(wy_ref, "_solve_lower", fail)
        for name in ("decay", "e_g", "kk", "lower", "kb"):
            monkeypatch.setattr(kda_ref._FirstPassFactors, name, property(fail))
    if passes:
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", b * t * (hv // h))
    got, want = _interim_and_kernel(b, t, h, hv, l2norm=l2norm, with_h0=True, with_dht=True,
                                    strong=strong, seed=t)  # fmt: skip
    assert first == [(torch.float32, (b * t, h, 16), hv) + (("bwd",) if wy else ())]
    assert len(calls) == 2 * (h if passes else 1)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)


@pytest.mark.parametrize("decay", [(-1.0, 0.0), (-5.0, -4.0)])
def test_first_pass_factors_in_bf16(kernel_path, monkeypatch, decay):  # noqa: F811
    """bf16 (the first pass's operands, kernel 1's tiles), WY_IN_KERNEL pinned off (the WY half
    in torch; both on: the device pass, below): within 2e-2 of autograd through the fp64
    recurrence and within 1e-2 of the torch factors' path; the switch off (set here) never
    launches the first pass, fp16 tiles neither (FIRST_PASS_DTYPES)."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(2, 130, 1, 2, decay=decay, seed=5)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    first = []
    monkeypatch.setattr(bwd, "_first_pass", emulated_first_pass(first))
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", False)
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", False)
    torch_factors = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert first == []
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    got = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert first == [(torch.bfloat16, (260, 1, 128), 2)]
    assert kernel_path == [torch.bfloat16] * 4
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True)
    for name, a, t, r in zip(NAMES, got, torch_factors, want):
        _close(name, a, r, 2e-2)
        _close(name, a, t, 1e-2)
    half = [x.half() if x.dtype == torch.bfloat16 else x for x in (q, k, v, g, beta, do)]
    bwd.kimi_delta_attention_backward(*half, **kw)
    assert len(first) == 1


# ---- the device pass (both switches, the default: kernel 1's 16-bit forms, `_device_pass`) ---


def _device_opt_ins(monkeypatch, first, flags, fp32):
    """Both switches on (the default since 2026-12-06; set explicitly), the first pass and the
    kernels emulated (kernel 1 recording its flags); `fp32`: 32-bit operands
    (FIRST_PASS_DTYPES and the model's operands widened)."""
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    if fp32:
        monkeypatch.setattr(bwd, "FIRST_PASS_DTYPES", (torch.float32,))
        monkeypatch.setattr(operands, "OPERAND_DTYPE", torch.float32)
    _all_emulated(monkeypatch, first_calls=first)
    monkeypatch.setattr(bwd, "_state_recurrence", emulated_kernel([], flags))
    fail = lambda *a, **k: pytest.fail("torch factors on the device pass")  # noqa: E731
    for name in ("_reverse_tiles", "forward_state_tiles", "forward_states", "chunk_grad_tiles",
                 "wy_tiles"):  # fmt: skip
        monkeypatch.setattr(bwd, name, fail)
    monkeypatch.setattr(bwd, "_FirstPassFactors", fail)


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm", "strong", "states", "passes"),
    [
        (1, 1, 1, 1, False, False, True, False),
        (2, 63, 2, 2, True, False, True, False),
        (1, 64, 1, 2, False, True, False, False),
        (3, 65, 2, 4, True, True, True, False),
        (2, 200, 1, 2, True, False, False, False),
        (2, 70, 2, 4, True, False, True, True),
    ],
)
def test_device_pass_equals_the_interim_path(monkeypatch, b, t, h, hv, l2norm, strong, states,
                                             passes):  # fmt: skip
    """32-bit tiles, both switches on: `_device_pass` (kernel 1's forward launch `out16` +
    `forward`, then its reverse launch `out16`; kernel 2 and the WY kernel on the 16-bit
    forms, the first pass's rows cut to T as views; no torch factor, no `_FirstPassFactors`,
    no tile conversion of the default path) gives every gradient within 1e-4 of its max of
    the interim path's, and within 1e-5 of the same switches' fp32-out path (`_on_device`
    False: torch flips, transposes, converts)."""
    first, flags = [], []
    _device_opt_ins(monkeypatch, first, flags, fp32=True)
    if passes:
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", b * t * (hv // h))
    kw = {"l2norm": l2norm, "with_h0": states, "with_dht": states, "strong": strong, "seed": t}
    got, want = _interim_and_kernel(b, t, h, hv, **kw)
    assert first == [(torch.float32, (b * t, h, 16), hv, "bwd")]
    assert flags == [(True, True), (True, False)] * (h if passes else 1)
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)
    monkeypatch.undo()
    first, calls = [], []
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", True)
    monkeypatch.setattr(bwd, "FIRST_PASS_DTYPES", (torch.float32,))
    monkeypatch.setattr(operands, "OPERAND_DTYPE", torch.float32)
    _all_emulated(monkeypatch, calls, first_calls=first)
    monkeypatch.setattr(bwd, "_on_device", lambda dtype: False)
    if passes:
        monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", b * t * (hv // h))
    fp32_out, _ = _interim_and_kernel(b, t, h, hv, **kw)
    assert len(calls) == 2 * (h if passes else 1)
    for name, a, r in zip(NAMES, got, fp32_out):
        _close(name, a, r, 1e-5)


def _launchers_accept(monkeypatch, checked):
    """Each kernel's emulation behind its launcher's own input check, and every 16-bit tile
    TMA-ready as handed over (`as_tma_ready` makes no copy): the device pass's views are the
    layouts and dtypes the kernels read."""
    from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import launch as state_launch
    from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch as chunk_launch
    from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch as wy_launch
    from forgekernel.runtime.device import tma_ready

    def wrap(name, check, tiles):
        inner = getattr(bwd, name)

        def run(*args, **flags):
            check(*args[: tiles + 2])  # the tiles and the two after (not dk, dg)
            low = [x for x in args[:tiles] if x is not None]
            assert all(tma_ready(x) for x in low), name
            checked.append(name)
            return inner(*args, **flags)

        monkeypatch.setattr(bwd, name, run)

    wrap("_state_recurrence", state_launch.check_inputs, 5)
    wrap("_chunk_grads", chunk_launch.check_inputs, 7)
    wrap("_wy_kernel", wy_launch.check_inputs, 7)


@pytest.mark.parametrize("decay", [(-1.0, 0.0), (-5.0, -4.0)])
@pytest.mark.parametrize(("b", "t", "h", "hv"), [(2, 130, 1, 2), (1, 65, 2, 2)])
def test_device_pass_in_bf16(kernel_path, monkeypatch, decay, b, t, h, hv):  # noqa: F811
    """bf16, both switches on (the default): the device pass within 2e-2 of autograd through the
    fp64 recurrence and within 1e-2 of the torch factors' path (both switches set off here); the
    gradients in their inputs' dtypes; kernel 1's two launches carry out16 (+ forward first);
    every launch's arguments pass its launcher's input check, 16-bit tiles TMA-ready as handed
    over."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, hv, decay=decay, seed=t)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", False)
    monkeypatch.setattr(bwd, "WY_IN_KERNEL", False)
    torch_factors = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    first, flags, checked = [], [], []
    _device_opt_ins(monkeypatch, first, flags, fp32=False)
    _launchers_accept(monkeypatch, checked)
    got = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, **kw)
    assert first == [(torch.bfloat16, (b * t, h, 128), hv, "bwd")]
    assert flags == [(True, True), (True, False)]
    assert checked == ["_state_recurrence"] * 2 + ["_chunk_grads", "_wy_kernel"]
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True)
    for name, a, f, r in zip(NAMES, got, torch_factors, want):
        like = {"dq": q, "dk": k, "dv": v, "dg": g, "dbeta": beta}.get(name, dht)
        assert a.dtype == like.dtype, name
        _close(name, a, r, 2e-2)
        _close(name, a, f, 1e-2)


@pytest.mark.parametrize(
    ("b", "t", "h", "hv", "l2norm", "beta16", "varlen"),
    [(2, 128, 2, 2, False, False, True), (2, 65, 1, 2, True, False, False),
     (1, 130, 2, 2, False, True, False)],
)  # fmt: skip
def test_device_pass_writes_out_in_place(kernel_path, monkeypatch, b, t, h, hv, l2norm,  # noqa: F811
                                         beta16, varlen):  # fmt: skip
    """out= on the device pass (next/kda-glue3): dv, dbeta (the WY kernel), d_initial_state
    (kernel 1's reverse launch) and dg (kernel 2, the WY kernel adding onto it) written by the
    kernels into the buffers, so `written` copies none of them (before: dv, dbeta, dh0 three
    DtoD copies, 96 us at 4 x 8192 H16 on the H100); dq, dk by the epilogue into theirs; a
    16-bit beta's dbeta (the WY kernel writes fp32) still cast in. The gradients bitwise those
    of the call without out=. The bench's form first: no l2norm, HV = H, fp32 g and beta, B
    equal lengths behind cu_seqlens (read on the host: one run of `_backward_kernel`)."""
    (q, k, v, g, beta, h0), do, dht = _bf16_problem(b, t, h, hv, seed=t)
    if beta16:
        beta = beta.bfloat16()
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": l2norm}
    if not l2norm:  # unit keys: the recurrence stays bounded
        k = torch.nn.functional.normalize(k.float(), dim=-1).bfloat16()
    args = [q, k, v, g, beta, do]
    if varlen:  # (1, B T, ...) with B equal lengths, as the bench calls it
        args = [x.flatten(0, 1).unsqueeze(0) for x in args]
        kw["cu_seqlens"] = torch.arange(b + 1, dtype=torch.int32) * t
    first, flags = [], []
    _device_opt_ins(monkeypatch, first, flags, fp32=False)
    want = bwd.kimi_delta_attention_backward(*args, **kw)
    out = tuple(torch.full_like(x, float("nan")) for x in want)
    copied = []
    real = bwd.written

    def written(buffers, grads, likes):
        copied.extend(i for i, (x, o) in enumerate(zip(grads, buffers))
                      if o is not None and x.data_ptr() != o.data_ptr())  # fmt: skip
        return real(buffers, grads, likes)

    monkeypatch.setattr(bwd, "written", written)
    got = bwd.kimi_delta_attention_backward(*args, **kw, out=out)
    assert copied == ([4] if beta16 else [])
    for name, a, o, r in zip(NAMES, got, out, want):
        assert a is o and torch.equal(a, r), name


def test_first_pass_factors_off_with_the_torch_fallback(monkeypatch):
    """FACTORS_FROM_FIRST_PASS with CHUNK_IN_KERNEL = False (kernel 2's torch fallback): the
    fallback's `_output_grads` reads fields `_FirstPassFactors` does not form (q, e^(G_C - G)),
    so the torch factors run, the first pass is not launched, and the gradients are the
    interim path's (32-bit operands: 1e-4 of each max)."""
    first = []
    monkeypatch.setattr(bwd, "FACTORS_FROM_FIRST_PASS", True)
    monkeypatch.setattr(bwd, "FIRST_PASS_DTYPES", (torch.float32,))
    monkeypatch.setattr(operands, "OPERAND_DTYPE", torch.float32)
    _all_emulated(monkeypatch, first_calls=first)
    monkeypatch.setattr(bwd, "CHUNK_IN_KERNEL", False)
    got, want = _interim_and_kernel(2, 65, 1, 2, l2norm=True, with_h0=True, with_dht=True,
                                    strong=True, seed=3)  # fmt: skip
    assert first == []
    for name, a, r in zip(NAMES, got, want):
        _close(name, a, r, 1e-4)
