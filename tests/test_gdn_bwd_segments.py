"""Kernel 1 of the Gated DeltaNet backward over segments of each sequence (ops/
gated_delta_rule_bwd.py `_segmented_states`, SEGMENTS / FORGEKERNEL_GDN_BWD_SEGMENTS) on the
CPU: the scans (reference/gdn_bwd_state.py `segment_transitions`, `segment_starts`,
`segment_ends`) against the segments composed one by one; the device pass with kernel 0, 1, 2
and the epilogue emulated (tests/test_gdn_bwd_kernel_path.py) segmented against unsegmented:
fp32 tiles (nothing rounded) within fp32 rounding, S = 2, 3, 4, 8, B = 1 and 2, a tail chunk,
with and without h0 and dht, no decay (M far from 0) and mild decay, equal-length varlen; a
scan with M for M^T or the product order swapped fails; bf16 through the op against autograd
through the fp64 recurrence (out= too); the rule and the switch. The GPU twin:
tests/gpu/test_gdn_bwd_segments_gpu.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_gdn_bwd_kernel_path import (
    FLAGS,
    _bf16_problem,
    _both_emulated,
    _inputs,
    kernel_path,  # noqa: F401 (the fixture)
)

import forgekernel
from forgekernel.reference.gdn_bwd_state import (
    segment_ends,
    segment_starts,
    segment_transitions,
)

bwd = importlib.import_module("forgekernel.ops.gated_delta_rule_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


# ---- the scans ------------------------------------------------------------------------------


def _affine_segments(n, parts, hv, d, seed=0):
    """Random segment maps S_end = M S_start + L (forward) and dS_start = M^T dS_end + Ld
    (reverse), the start / end states, and what kernel 1's runs would give: local (from h0 at
    segment 0, zero elsewhere), shifted (from c I), rlocal (from dht at the last segment)."""
    gen = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float64)

    m, lf, ld = rnd(n, parts, hv, d, d) * 0.4, rnd(n, parts, hv, d, d), rnd(n, parts, hv, d, d)
    h0, dht, c = rnd(n, hv, d, d), rnd(n, hv, d, d), 64.0
    first, last = torch.zeros(n, parts, hv, d, d, dtype=torch.float64), torch.zeros_like(m)
    first[:, 0], last[:, -1] = h0, dht
    local = m @ first + lf
    shifted = m * c + lf
    rlocal = m.transpose(-1, -2) @ last + ld
    starts, ends = [h0], [dht]
    for p in range(parts - 1):
        starts.append(m[:, p] @ starts[-1] + lf[:, p])
    for p in range(parts - 1, 0, -1):
        ends.insert(0, m[:, p].transpose(-1, -2) @ ends[0] + ld[:, p])
    flat = (local, shifted, rlocal, first, last)
    return (*(x.flatten(0, 1) for x in flat), torch.stack(starts, 1), torch.stack(ends, 1), c)


@pytest.mark.parametrize("parts", [2, 3, 5])
@pytest.mark.parametrize("n", [1, 3])
def test_scans_compose_the_segments(parts, n):
    """The starts and ends from the runs' end states are the segments composed one by one;
    the rows the scans must not read (local's last segments, shifted's first and last,
    rlocal's first) poisoned."""
    local, shifted, rlocal, first, last, starts, ends, c = _affine_segments(n, parts, 2, 6)
    by_seq = (n, parts, 2, 6, 6)
    for x, unread in ((local, [-1]), (shifted, [0, -1]), (rlocal, [0])):
        x.view(by_seq)[:, unread] = float("nan")
    trans = segment_transitions(local, shifted, parts, c)
    got_s = segment_starts(trans, local, first).view(by_seq)
    got_e = segment_ends(trans, rlocal, last).view(by_seq)
    torch.testing.assert_close(got_s, starts, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(got_e, ends, rtol=1e-10, atol=1e-10)


def test_a_wrong_scan_is_caught_by_the_composition():
    """M for M^T in the reverse scan, the product order swapped in the forward one: both off."""
    local, shifted, rlocal, first, last, starts, ends, c = _affine_segments(1, 4, 2, 6)
    trans = segment_transitions(local, shifted, 4, c)
    wrong = trans.transpose(-1, -2)
    assert not torch.allclose(segment_ends(wrong, rlocal, last).view(ends.shape), ends)
    assert not torch.allclose(segment_starts(wrong, local, first).view(starts.shape), starts)


# ---- the device pass, emulated --------------------------------------------------------------


@pytest.fixture
def exact_path(monkeypatch):
    """The kernel path on the CPU with fp32 tiles (the emulations round nothing); kernel 1's
    launches recorded (FLAGS: (out16, forward) a launch)."""
    calls = []
    monkeypatch.setenv(bwd.KERNEL_SWITCH, "1")
    monkeypatch.setattr(bwd, "KERNEL_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(bwd, "TILE_DTYPES", (torch.float32,))
    _both_emulated(monkeypatch, calls)
    FLAGS.clear()
    return calls


def _problem(b, t, decay, seed=0):
    """fp32, H 1, HV 2, K = V = 16 (segments need K = V: M is a state)."""
    q, k, v, g, beta, do, h0, dht = _inputs(b, t, 1, 2, dk=16, dv=16, seed=seed,
                                            dtype=torch.float32)  # fmt: skip
    return q, k, v, g if decay else g * 0.0, beta, do, h0, dht


def _grads(problem, b, with_h0=True, with_dht=True, cu=None):
    q, k, v, g, beta, do, h0, dht = problem
    flat = [x.flatten(0, 1) for x in (q, k, v, g, beta, do)]
    args = (*flat[:5], h0 if with_h0 else None, flat[5], dht if with_dht else None, 0.3, False,
            True)  # fmt: skip
    if cu is None:
        return bwd._backward_kernel(*args, b)
    return bwd._backward_varlen(*args, cu)


def _max_rel_err(got, want):
    return max(float((a - r).abs().max()) / (float(r.abs().max()) + 1e-30)
               for a, r in zip(got, want))  # fmt: skip


@pytest.mark.parametrize(("b", "t", "parts"), [(1, 256, 2), (1, 256, 4), (2, 251, 4), (1, 512, 8),
                                                (2, 190, 3), (1, 100, 2)])  # fmt: skip
@pytest.mark.parametrize(("with_h0", "with_dht"), [(True, True), (False, True), (True, False),
                                                    (False, False)])  # fmt: skip
@pytest.mark.parametrize("decay", [False, True])
def test_segments_equal_the_unsegmented_pass(exact_path, monkeypatch, b, t, parts, with_h0,
                                             with_dht, decay):  # fmt: skip
    """S segments a sequence (forced) give the one-run gradients within fp32 rounding: five
    kernel-1 launches (three summary runs, two full ones; four at S = 2: no transitions) where
    the one run takes two, the forward variant's first."""
    problem = _problem(b, t, decay, seed=t + parts)
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "0")
    want = _grads(problem, b, with_h0, with_dht)
    assert len(exact_path) == 2
    exact_path.clear()
    FLAGS.clear()
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, str(parts))
    got = _grads(problem, b, with_h0, with_dht)
    forward, reverse = (True, True), (True, False)
    summary = [forward, forward, reverse] if parts > 2 else [forward, reverse]
    assert FLAGS == [*summary, forward, reverse], FLAGS
    for name, a, r in zip(NAMES, got, want):
        assert a.shape == r.shape, name
        err = float((a - r).abs().max())
        assert err <= 2e-5 * float(r.abs().max()) + 1e-6, (name, err, float(r.abs().max()))


@pytest.mark.parametrize(("scan", "grads"), [("segment_ends", ("dh0",)),
                                             ("segment_starts", ("dq", "dk"))])  # fmt: skip
def test_a_wrong_scan_fails(exact_path, monkeypatch, scan, grads):
    """M for M^T in the reverse scan (the initial state's gradient off) or the forward scan's
    product order swapped (S M: h, U off, so dq, dk) moves the gradients far past the
    tolerance above (no decay: M far from 0)."""
    problem = _problem(1, 256, decay=False, seed=3)
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "0")
    want = dict(zip(NAMES, _grads(problem, 1)))
    real = getattr(bwd, scan)
    monkeypatch.setattr(bwd, scan, lambda trans, x, y: real(trans.transpose(-1, -2), x, y))
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "4")
    got = dict(zip(NAMES, _grads(problem, 1)))
    for name in grads:
        assert _max_rel_err([got[name]], [want[name]]) > 1e-3, name


def test_head_passes(exact_path, monkeypatch):
    """Value heads in two passes (strided head slices of v, do: the (B S) rows still views)
    segmented equal the one unsegmented pass; B = 2, H 2, HV 4."""
    q, k, v, g, beta, do, h0, dht = _inputs(2, 256, 2, 4, dk=16, dv=16, seed=5,
                                            dtype=torch.float32)  # fmt: skip
    flat = [x.flatten(0, 1) for x in (q, k, v, g, beta, do)]
    args = (*flat[:5], h0, flat[5], dht, 0.3, False, True, 2)
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "0")
    want = bwd._backward_kernel(*args)
    monkeypatch.setattr(bwd, "TOKEN_HEADS_PER_PASS", 2 * 256 * 2)  # one q head a pass
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "4")
    exact_path.clear()
    got = bwd._backward_kernel(*args)
    assert len(exact_path) == 2 * 5
    assert _max_rel_err(got, want) <= 2e-5


@pytest.mark.parametrize("lens", [[256, 256], [300, 212]])
def test_varlen(exact_path, monkeypatch, lens):
    """cu_seqlens: equal lengths run as B sequences and segment (forced S = 4: five launches);
    unequal ones run in the slot layout, which never segments (two launches); both equal to
    the unsegmented calls."""
    problem = _problem(1, sum(lens), decay=False, seed=len(lens))
    n = len(lens)
    states = _inputs(n, 1, 1, 2, dk=16, dv=16, seed=9, dtype=torch.float32)[-2:]
    problem = (*problem[:6], *states)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "0")
    want = _grads(problem, 1, cu=cu)
    exact_path.clear()
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "4")
    got = _grads(problem, 1, cu=cu)
    assert len(exact_path) == (5 if len(set(lens)) == 1 else 2)
    assert _max_rel_err(got, want) <= 2e-5


def test_bf16_op_against_the_fp64_recurrence(kernel_path, monkeypatch):  # noqa: F811
    """The op (bf16 tiles, the emulations rounding as the kernels) with S = 4 forced against
    autograd through the fp64 recurrence within 2e-2 of each gradient's max, as the one-run
    path's test; with out= the same gradients, d_initial_state written into its buffer."""
    from test_gdn_bwd_op import _fp64_grads

    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "4")
    q, k, v, g, beta, do, h0, dht = _bf16_problem(1, 256, 1, 2, seed=4)
    kw = {"initial_state": h0, "d_final_state": dht, "use_qk_l2norm_in_kernel": True}
    got = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, **kw)
    assert len(kernel_path) == 5
    want = _fp64_grads([q, k, v, g, beta, h0], None, do, dht, l2norm=True, with_state=True)
    for name, a, r in zip(NAMES, got, want):
        err = float((a.double() - r).abs().max())
        assert err <= 2e-2 * float(r.abs().max()), (name, err, float(r.abs().max()))
    out = tuple(torch.full_like(x, float("nan")) for x in got)
    again = forgekernel.gated_delta_rule_backward(q, k, v, g, beta, do, out=out, **kw)
    for name, a, o, r in zip(NAMES, again, out, got):
        assert a.data_ptr() == o.data_ptr() and torch.equal(a, r), name


# ---- the rule and the switch ----------------------------------------------------------------


@pytest.mark.parametrize(
    ("b", "hv", "nc", "sms", "parts"),
    [
        (1, 16, 128, 132, 4),  # 1 x 8192 hv16: (12 - 4) x 16 = 128 CTAs a summary phase
        (1, 32, 128, 132, 1),  # 1 x 8192 hv32: 256 CTAs, two waves: no gain (NOTES)
        (1, 16, 64, 132, 1),  # 1 x 4096: 16 chunks a segment
        (1, 16, 512, 132, 4),  # 8 segments: 320 CTAs
        (1, 4, 512, 132, 8),  # (24 - 4) x 4 = 80; 16 segments: 176
        (2, 8, 128, 132, 1),  # (24 - 4) x 8 = 160
        (1, 16, 130, 132, 1),  # 4 does not divide 130
        (1, 16, 128, 0, 1),  # off CUDA
    ],
)  # fmt: skip
def test_the_rule(b, hv, nc, sms, parts):
    assert bwd._segments_for_bwd(b, hv, nc, sms) == parts


def test_the_switch(monkeypatch):
    """On by default (SEGMENTS True: the rule); "1" the rule, "0" off, an integer forces the
    count where it divides NC; anything else refused."""
    cpu = torch.device("cpu")
    monkeypatch.delenv(bwd.SEGMENTS_SWITCH, raising=False)
    monkeypatch.setattr(bwd, "_device_sms", lambda device: 132)
    assert bwd.SEGMENTS and bwd._segments_selected(1, 16, 128, cpu) == 4
    monkeypatch.setattr(bwd, "SEGMENTS", False)
    assert bwd._segments_selected(1, 16, 128, cpu) == 1
    for mode, parts in (("0", 1), ("1", 4), ("2", 2), ("8", 8), ("3", 1)):
        monkeypatch.setenv(bwd.SEGMENTS_SWITCH, mode)
        assert bwd._segments_selected(1, 16, 128, cpu) == parts, mode
    monkeypatch.setenv(bwd.SEGMENTS_SWITCH, "on")
    with pytest.raises(ValueError, match="FORGEKERNEL_GDN_BWD_SEGMENTS"):
        bwd._segments_selected(1, 16, 128, cpu)


def test_fused_route_is_disjoint():
    """Where the fused kernel takes the pass (B HV >= 3/4 of the SMs) the rule never segments:
    segments need (3 B S - 4) HV <= SMs with S >= 4, so B HV <= 16 on 132 SMs."""
    from forgekernel.kernels.linear_attention.gdn_bwd_fused.sm90.config import fused_fits

    for b, hv in ((1, 128), (4, 32), (2, 64), (1, 99), (1, 16), (1, 8)):
        assert not (fused_fits(b, hv, 132) and bwd._segments_for_bwd(b, hv, 512, 132) > 1)


@pytest.mark.parametrize(("b", "t", "parts"), [(1, 512, 4), (2, 250, 2)])
def test_runs_through_the_launcher(monkeypatch, b, t, parts):
    """`_segmented_states` through kernel 1's launcher (its checks; the compiled kernel a
    recorder): bf16, K = V = 128; per launch the rows (R - 1, R - 2 from c I, R - 1; then
    R - 1 twice), every tile TMA-ready and read in place (a view of kernel 0's buffers or the
    padded do where T has a tail chunk), the outputs written in place at their rows of U, h,
    dU, dS."""
    from forgekernel.kernels.linear_attention.gdn_bwd_factors.sm90 import launch as k0
    from forgekernel.kernels.linear_attention.gdn_bwd_state.sm90 import launch as k1
    from forgekernel.reference.gdn_bwd_factors import forward_launch_tiles
    from forgekernel.runtime.device import tma_ready

    calls = []
    monkeypatch.setattr(k1, "get_kernel", lambda spec, params: lambda *a: calls.append(a))
    hv, nc = 2, -(-t // 64)
    q = torch.zeros(b, t, 1, 128, dtype=torch.bfloat16)
    tiles = k0.empty_outputs(q, torch.zeros(b, t, hv, 128, dtype=torch.bfloat16))
    tiles["e_last"].fill_(1.0)
    do = torch.zeros(b, t, hv, 128, dtype=torch.bfloat16)
    h0, dht = torch.zeros(b, hv, 128, 128), torch.zeros(b, hv, 128, 128)
    fw = forward_launch_tiles(tiles, identity=False)
    (u16, h16), (du16, dh16, _) = bwd._segmented_states(fw, tiles, do, h0, dht, parts)
    rows, seg = b * parts, nc // parts
    want_rows = [rows - 1, rows - 2, rows - 1] if parts > 2 else [rows - 1, rows - 1]
    assert [a[0].shape[0] for a in calls] == [*want_rows, rows - 1, rows - 1]
    inputs = {x.untyped_storage().data_ptr() for x in (*tiles.values(), do)}
    ins = [x for a in calls for x in a[:7] if x is not None]
    assert all(tma_ready(x) for x in ins if x.dtype == torch.bfloat16)
    copies = {x.untyped_storage().data_ptr() for x in ins} - inputs
    assert len(copies) == (t % 64 != 0)  # only do, padded to whole chunks
    step_u, step_h = seg * 64 * hv * 128 * 2, seg * hv * 128 * 128 * 2  # bytes a row
    fa, *_, fc, rc = calls
    ra = calls[-3]
    assert (fa[8].data_ptr(), fa[9].data_ptr()) == (u16.data_ptr(), h16.data_ptr())
    assert (fc[8].data_ptr(), fc[9].data_ptr()) == (u16.data_ptr() + step_u,
                                                    h16.data_ptr() + step_h)  # fmt: skip
    assert (ra[8].data_ptr(), ra[9].data_ptr()) == (du16.data_ptr() + step_u,
                                                    dh16.data_ptr() + step_h)  # fmt: skip
    assert (rc[8].data_ptr(), rc[9].data_ptr()) == (du16.data_ptr(), dh16.data_ptr())
