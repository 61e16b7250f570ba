"""What one call of the convolution launchers asks of the device, counted on the CPU: the
kernel launches, every other torch op that would launch work (views and allocations launch
none), no host synchronization, and the host time per call with no-op kernels.

Why (H200, 2026-12-01): the data gradient's graph figures were a flat ~0.3 ms per call
because its eager burst measured 0.3-0.9 ms of host time (the timer then refused its graph,
runtime/timing.py `work_missing`); each call also copied and flipped the filter twice per phase
(two launches each). The data-gradient mode now reads W in place: a stride-1 gradient is one
kernel launch and nothing else; a stride-2 one is one launch of the fused kernel and nothing
else (every phase, the zero ones too, straight into dx); stride 3 a launch and a scratch copy
per phase."""

from __future__ import annotations

import importlib.util
import itertools

import pytest
import torch
from script_modules import load_script  # tests/ is on the path
from torch.utils._python_dispatch import TorchDispatchMode

from forgekernel.kernels.conv.sm90 import launch
from forgekernel.kernels.conv.sm90.geometry import Geometry

op = importlib.import_module("forgekernel.ops.conv")
BF16 = torch.bfloat16
# ops that launch nothing on a device: views, metadata, allocations without a fill
NO_LAUNCH = {
    "alias", "as_strided", "detach", "empty", "empty_like", "empty_strided", "expand",
    "narrow", "new_empty", "new_empty_strided", "permute", "select", "slice", "squeeze",
    "t", "transpose", "unsqueeze", "view", "_reshape_alias", "reshape", "unflatten",
}  # fmt: skip
# ops that read a device value back to the host
SYNCS = {"_local_scalar_dense", "item", "nonzero", "is_nonzero", "equal", "tolist"}


class _Ops(TorchDispatchMode):
    """The aten ops run inside the context, by name."""

    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))

    def launching(self) -> list[str]:
        return [n for n in self.names if n not in NO_LAUNCH]


@pytest.fixture
def kernel_calls(monkeypatch):
    """Every compiled function a recorder: (compile key, the call's tensors)."""
    calls = []

    def get_kernel(spec, params):
        return lambda *args: calls.append((dict(params), args))

    launch.clear_plans()  # the weight gradient's plans hold their function too
    monkeypatch.setattr(launch, "get_kernel", get_kernel)
    monkeypatch.setattr(launch, "num_sms", lambda device: 132)
    yield calls
    launch.clear_plans()


def _geometry(f, pad, stride) -> Geometry:
    return Geometry((1, f, f), (0, pad, pad), (0, pad, pad), (1, stride, stride))


def _dgrad_operands(n, c, k, hw, f, stride):
    g = _geometry(f, f // 2, stride)
    out = g.output((1, hw, hw))
    dy = torch.randn(n, *out, k, dtype=BF16)
    w = torch.randn(k, 1, f, f, c, dtype=BF16)
    dx = torch.empty(n, 1, hw, hw, c, dtype=BF16)
    return dy, w, dx, g


def _in_storage(t: torch.Tensor, base: torch.Tensor) -> bool:
    start = base.untyped_storage().data_ptr()
    return start <= t.data_ptr() < start + base.untyped_storage().nbytes()


def test_stride1_dgrad_is_one_launch_of_w_in_place(kernel_calls):
    dy, w, dx, g = _dgrad_operands(2, 64, 32, 9, 3, 1)
    # the first call may allocate the stream's split workspace (its flags: a zero fill; the
    # chooser splits this 2-tile problem): per call means from the second on
    launch.dgrad(dy, w, dx, g)
    with _Ops() as ops:
        launch.dgrad(dy, w, dx, g)
    assert ops.launching() == []
    assert len(kernel_calls) == 2
    params, args = kernel_calls[1]
    assert params["dgrad"] is True and params["bias"] is False
    x, w_seen, y = args[:3]
    assert w_seen.data_ptr() == w.data_ptr() and w_seen.shape == w.shape  # no filter copy
    assert x.data_ptr() == dy.data_ptr() and y.data_ptr() == dx.data_ptr()  # dx in place


@pytest.mark.parametrize("f", [3, 1, 2, 4])
def test_stride2_dgrad_is_one_fused_launch_into_dx(kernel_calls, f):
    """Every phase in one launch of the fused kernel (1x1: three phases of no tap, zero-filled
    by the same launch): no scratch buffer, no copy, no fill, w and dx themselves."""
    dy, w, dx, g = _dgrad_operands(2, 64, 32, 10, f, 2)
    launch.dgrad(dy, w, dx, g)  # the first call may make the stream's split workspace
    kernel_calls.clear()
    with _Ops() as ops:
        launch.dgrad(dy, w, dx, g)
    assert not set(ops.names) & SYNCS
    assert ops.launching() == []
    assert len(kernel_calls) == 1
    params, args = kernel_calls[0]
    assert "dgrad" not in params and params["epi_n"] == 64  # the fused kernel's compile key
    dy_seen, w_seen, dx_seen = args[:3]
    assert w_seen.data_ptr() == w.data_ptr() and w_seen.shape == w.shape  # W whole, no copy
    assert dx_seen.data_ptr() == dx.data_ptr() and dx_seen.shape == dx.shape  # dx in place
    assert _in_storage(dy_seen, dy)  # dy itself or a crop of it


def test_stride2_dgrad_pads_channels_off_8_through_one_copy(kernel_calls):
    """C = 36 output channels: the kernel writes 40-channel rows into a scratch dx, one copy
    into dx; K = 20 reduction channels padded to 24 (dy: a copy; w, padded in both: two)."""
    dy, w, dx, g = _dgrad_operands(1, 36, 20, 9, 3, 2)
    launch.dgrad(dy, w, dx, g)
    kernel_calls.clear()
    with _Ops() as ops:
        launch.dgrad(dy, w, dx, g)
    assert len(kernel_calls) == 1
    assert kernel_calls[0][1][2].shape[-1] == 40
    assert ops.launching().count("copy_") == 4


def test_stride3_dgrad_launches_per_phase_and_copies_no_filter(kernel_calls):
    """Strides past 2 keep the launch per phase: nine phases of 3x3 stride 3, a launch each
    on output rectangles written straight into dx's strided view (no scratch, no copy); no
    filter copy."""
    dy, w, dx, g = _dgrad_operands(2, 64, 32, 12, 3, 3)
    with _Ops() as ops:
        launch.dgrad(dy, w, dx, g)
    assert not set(ops.names) & SYNCS
    assert len(kernel_calls) == 9
    assert ops.launching() == []
    for params, args in kernel_calls:
        assert params["dgrad"] and _in_storage(args[1], w)  # the phase's taps: a view of w
        assert params["rect"] and _in_storage(args[2], dx)  # the phase's view of dx


def test_dgrad_fills_dx_once_where_phases_see_no_tap(kernel_calls):
    """1x1 stride 3 (the launch per phase): eight of nine phases are zero: one fill of dx, one
    launch (on rectangles, into dx's strided view: no copy)."""
    dy, w, dx, g = _dgrad_operands(2, 64, 32, 10, 1, 3)
    with _Ops() as ops:
        launch.dgrad(dy, w, dx, g)
    assert len(kernel_calls) == 1
    assert ops.launching() == ["zero_"]


def test_as_tma_ready_restrides_unit_dims_instead_of_copying():
    """A (K, C, 1, 1) weight is channels-last and contiguous at once, so torch leaves unit
    strides on its size-1 dims; the kernels' 5-D view of it needs 16-byte multiples there.
    A view with those strides fixed, not a copy; a tensor off elsewhere is still copied."""
    from forgekernel.runtime.device import as_tma_ready, tma_ready

    w = torch.randn(64, 64, 1, 1, dtype=BF16).contiguous(memory_format=torch.channels_last)
    w5 = op._as5d(w)
    assert not tma_ready(w5)
    ready = as_tma_ready(w5)
    assert tma_ready(ready) and ready.data_ptr() == w5.data_ptr() and torch.equal(ready, w5)
    odd = torch.randn(4, 1, 17, dtype=BF16)[..., 1:]  # rows of 17: not 16-byte multiples
    fixed = as_tma_ready(odd)
    assert tma_ready(fixed) and fixed.data_ptr() != odd.data_ptr() and torch.equal(fixed, odd)


@pytest.mark.parametrize("dims", [2, 3])
def test_the_5d_view_is_the_permuted_one(dims):
    """`_view5d` (one as_strided) is x.permute(0, *spatial, 1) (unsqueezed at 1 in 2-D): the
    same sizes, strides (the size-1 dims' too: tma_ready reads them) and storage offset, for
    channels-last, contiguous, sliced and size-1 operands."""
    spatial = (5, 3, 4)[3 - dims :]
    base = torch.randn(3, 7, *spatial, dtype=BF16)
    cases = [
        base,
        base.contiguous(memory_format=op._memory_format(dims)),
        base[1:, 2:6],
        base.contiguous(memory_format=op._memory_format(dims))[:, :, 1:],
        torch.randn(8, 6, *(1,) * dims, dtype=BF16),
    ]
    for t in cases:
        want = t.permute(0, *range(2, dims + 2), 1)
        want = want.unsqueeze(1) if dims == 2 else want
        got = op._view5d(t)
        assert got.shape == want.shape and got.stride() == want.stride()
        assert got.storage_offset() == want.storage_offset() and torch.equal(got, want)


# ---------------------------------------------------------------- the stem's im2col
# the im2col before the strided copy (torch's unfold and a permuted copy), the reference: the
# GPU probe's (scripts/conv_stem_probe.py), which times the two
probe = load_script("conv_stem_probe")


def _im2col_loop(x, geometry, out_dhw):
    """The windows element by element (the definition): column (r, s, c) of output pixel
    (n, p, q) is x[n, p * stride - pad + r * dil, q * stride - pad + s * dil, c], zero outside."""
    n, _, h, w_, c = x.shape
    _, p, q = out_dhw
    (_, r, s_), lo = geometry.filter, geometry.pad_lo
    (_, uh, uw), (_, dh, dw) = geometry.stride, geometry.dilation
    width = r * s_ * c
    cols = torch.zeros(n, 1, p, q, -(-width // 8) * 8, dtype=x.dtype)
    for i in range(p):
        for j in range(q):
            for a in range(r):
                for b in range(s_):
                    hh, ww = i * uh - lo[1] + a * dh, j * uw - lo[2] + b * dw
                    if 0 <= hh < h and 0 <= ww < w_:
                        k = (a * s_ + b) * c
                        cols[:, 0, i, j, k : k + c] = x[:, 0, hh, ww]
    return cols


_PADS = [(0, 0), (1, 1), (3, 3), ((1, 2), (2, 0)), ((2, 1), (-1, 3))]  # (lo, hi) per H / W


def _im2col_cases():
    """(filter, pad_lo, pad_hi, stride, dilation) with a non-empty output on 13 x 11."""
    for f, (lo, hi), stride, dil in itertools.product(
        [(7, 7), (3, 3), (2, 3)], _PADS, [1, 2, 3], [1, 2]
    ):
        lo = (lo, lo) if isinstance(lo, int) else lo
        hi = (hi, hi) if isinstance(hi, int) else hi
        g = Geometry((1, *f), (0, *lo), (0, *hi), (1, stride, stride), (1, dil, dil))
        if min(g.output((1, 13, 11))) > 0:
            yield g


@pytest.mark.parametrize("dtype", [BF16, torch.float16])
@pytest.mark.parametrize("c", [1, 3, 4, 8, 16])
def test_the_im2col_is_the_unfold_one_bitwise(c, dtype):
    """The strided copy (launch._im2col) against the unfold it replaced, bitwise: 7x7, 3x3
    and 2x3 filters, strides 1 / 2 / 3, dilations 1 / 2, padding 0 / 1 / 3 and asymmetric
    (one side negative: a crop), odd H and W; x compact and a channel slice of a wider one
    (its pixel strides are not C's: the view takes x's strides)."""
    gen = torch.Generator().manual_seed(c)
    wide = torch.randn(2, 1, 13, 11, c + 5, generator=gen).to(dtype)
    for x in (wide[..., :c].contiguous(), wide[..., 2 : 2 + c]):
        for g in _im2col_cases():
            out = g.output((1, 13, 11))
            cols, one = launch._im2col(x, g, out)
            want = probe.im2col_unfold(x, g, out)
            assert cols.shape == want.shape and cols.is_contiguous(), g
            assert torch.equal(cols.view(torch.int16), want.view(torch.int16)), g
            assert one == Geometry((1, 1, 1), (0, 0, 0), (0, 0, 0))


@pytest.mark.parametrize("c", [3, 16])
def test_the_im2col_is_its_definition(c):
    """Against the element-by-element windows (independent of torch's unfold): the stem's
    7x7 stride 2 padding 3, and 3x3 dilation 2 stride 3 with asymmetric padding."""
    x = torch.randn(2, 1, 13, 11, c, dtype=BF16)
    for g in (
        Geometry((1, 7, 7), (0, 3, 3), (0, 3, 3), (1, 2, 2)),
        Geometry((1, 3, 3), (0, 1, 2), (0, 2, 0), (1, 3, 3), (1, 2, 2)),
    ):
        out = g.output((1, 13, 11))
        cols, _ = launch._im2col(x, g, out)
        assert torch.equal(cols, _im2col_loop(x, g, out)), g


@pytest.mark.parametrize("pad", [3, 0])
def test_the_stem_im2col_is_one_copy(kernel_calls, pad):
    """The stem's im2col on the device's ops: the padded input (a fill and a copy: ~10 MB at
    n32-224x224) where it pads, one strided copy into the buffer, the tail's fill (147
    channels of 152); no unfold, no host sync. The forward and the weight gradient: one kernel
    launch each on the same (N, 1, P, Q, 152) columns."""
    g = Geometry((1, 7, 7), (0, pad, pad), (0, pad, pad), (1, 2, 2))
    x = torch.randn(2, 1, 16, 16, 3, dtype=BF16)
    out = g.output((1, 16, 16))
    with _Ops() as ops:
        cols, _ = launch._im2col(x, g, out)
    assert not set(ops.names) & SYNCS
    # constant_pad_nd: one op here, a fill and a copy of the padded input on the device
    assert ops.launching() == ["constant_pad_nd"] * (pad > 0) + ["copy_", "zero_"]
    assert cols.shape == (2, 1, *out[1:], 152)
    w = torch.randn(64, 1, 7, 7, 3, dtype=BF16)
    y = torch.empty(2, *out, 64, dtype=BF16)
    launch.fprop_im2col(x, w, None, y, g)
    launch.wgrad_im2col(torch.randn_like(y), x, w.clone(), g)
    # the forward reads (x, w, y, ...), the weight gradient (dy, x, dw, ...): the columns, or
    # their view as one plane of 8-pixel rows (an unpadded 1x1 over a multiple of 8 pixels)
    (_, fwd), (_, grad) = kernel_calls
    for seen in (fwd[0], grad[1]):
        assert seen.shape[-1] == 152 and seen.numel() == cols.numel()


def test_the_probe_cases_take_the_few_channel_path():
    """scripts/conv_stem_probe.py's cases: the brief's four by their bench names, each on the
    few-channel path; at batch 1 on the CPU the two im2cols it times agree bitwise."""
    names = [f.name for f, _ in probe.cases()]
    assert names == [
        "n32-c3-224x224-k64-7x7-s2",
        "n8-c3-512x512-k64-7x7-s2",
        "n32-c3-224x224-k64-3x3",  # stride 1: no suffix
        "n16-c4-256x256-k32-3x3",
    ]
    assert [f.name for f, _ in probe.cases(names[1:2])] == names[1:2]
    for fwd, wgrad in probe.cases():
        p = fwd.params
        assert wgrad.params == {**p, "op": "wgrad"}
        g, out = probe.geometry(fwd)
        (h, w_), c, k = p["spatial"], p["c"], p["k"]
        x = torch.randn(1, 1, h, w_, c, dtype=BF16)
        w = torch.empty(k, 1, *p["kernel"], c, dtype=BF16, device="meta")
        assert launch.few_channels(x, w, g)
        cols, _ = launch._im2col(x, g, out)
        assert torch.equal(cols, probe.im2col_unfold(x, g, out)), fwd.name
