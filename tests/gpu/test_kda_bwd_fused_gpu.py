"""Kimi Delta Attention's fused backward kernel (kernels/linear_attention/kda_bwd_fused/sm90:
kernel 2's products, then the WY kernel's, in one CTA a chunk-head) on the GPU, against the two
launches it replaces (kda_bwd_chunk with dw16, then kda_bwd_wy on its dw) on the same tiles:
bit for bit (the same products, roundings and sums in the same order; NOTES "next/kda-fuse-wy"),
every output NaN-poisoned first (an entry the kernel does not write fails), one launch polled
for a hang first; bf16 and fp16; T = 1, 63, 65, 1000 (tail chunks zero-filled by TMA); 1-3
sequences, 1-3 heads; the keys fp32 dv, dv16, dv16 + dk16 and dq16 + dv16 + dk16; then the op
with FUSED_SWITCH on against off (bitwise; also varlen with NATIVE_STORES: the token_rows key),
and the times of both paths (`-s`). Not yet run to the end on a GPU: next/kda-fuse-wy's tree
produced nothing in 60 s on the H100 (2026-12-06; next/kda-fuse-hang: phase A's q + k
mbarrier under-armed, fixed). Keys: docs/pending/kda-fuse-keys.jsonl."""

from __future__ import annotations

import importlib
import time

import pytest
import torch
from test_kda_bwd_chunk_gpu import _problem  # tests/gpu is on the path
from test_kda_bwd_kernel_path_gpu import _problem as _op_problem

from forgekernel.kernels.linear_attention.kda_bwd_chunk.sm90 import launch as chunk_launch
from forgekernel.kernels.linear_attention.kda_bwd_fused.sm90 import launch
from forgekernel.kernels.linear_attention.kda_bwd_wy.sm90 import launch as wy_launch
from forgekernel.reference.kda_bwd_chunk import chunk_grad_tiles
from forgekernel.reference.kda_bwd_wy import wy_tiles
from forgekernel.runtime.cache import get_kernel
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu
bwd = importlib.import_module("forgekernel.ops.kda_bwd")
NAMES = ("dq", "dk", "dv", "dg", "dbeta")
FLAGS = ({}, {"dv16": True}, {"dv16": True, "dk16": True},
         {"dq16": True, "scale": 0.0883883, "dv16": True, "dk16": True})  # fmt: skip


def _tiles(b, t, hv, dtype, g_range=(-5.0, 0.0), seed=0):
    """Kernel 2's tiles (`test_kda_bwd_chunk_gpu._problem`'s) and the WY kernel's others from
    the same factors (`wy_tiles`: T^T, W, u, v in `dtype`; beta fp32)."""
    p = _problem(b, t, hv, dtype, g_range, seed)
    f, do, h, dh, big_u, d_u, qs, ks, g = p
    tiles = list(chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype))
    tiles[-1] = tiles[-1].float()
    wy = wy_tiles(f, torch.zeros_like(ks), d_u, tiles[-1], dtype)
    tt, w, uw, v, beta = wy[2], wy[3], wy[5], wy[6], wy[7].float()
    return tiles, (tt, w, uw, v, beta)


def _nan(x):
    return x.fill_(float("nan"))


def _two_launches(tiles, wy, dq16=False, scale=1.0, dv16=False, dk16=False):
    do, u, du, q, k, h, dh, big_g = tiles
    tt, w, uw, v, beta = wy
    flags = {"dq16": True, "scale": scale} if dq16 else {}
    out = tuple(_nan(x) for x in chunk_launch.empty_outputs(do, 128, True, dq16))
    dq, dk, dw, dg = chunk_launch.kda_bwd_chunk(*tiles, dw16=True, out=out, **flags)
    wy_out = wy_launch.empty_outputs(dw, 128, dv16)
    wy_out = (dk, _nan(wy_out[1]), dg, _nan(wy_out[3]))
    dk, dv, dg, dbeta = wy_launch.kda_bwd_wy(dw, du, tt, w, k, uw, v, beta, big_g, dv16=dv16,
                                             dk16=dk16, out=wy_out)  # fmt: skip
    return dq, dk, dv, dg, dbeta


def _fused(tiles, wy, dq16=False, scale=1.0, dv16=False, dk16=False):
    out = tuple(_nan(x) for x in launch.empty_outputs(tiles[0], 128, dq16, dv16))
    return launch.kda_bwd_fused(*tiles, *wy, dq16=dq16, scale=scale, dv16=dv16, dk16=dk16,
                                out=out)  # fmt: skip


def _same(got, want):
    for name, a, r in zip(NAMES, got, want):
        assert a.shape == r.shape and a.dtype == r.dtype, name
        assert not torch.isnan(a).any(), f"{name}: NaN (an entry the fused kernel did not write)"
        if not torch.equal(a, r):
            err = float((a.double() - r.double()).abs().max())
            pytest.fail(f"{name} differs from the two launches: max |diff| {err:.3e} "
                        f"(largest {float(r.double().abs().max()):.3e})")  # fmt: skip


HANG_S = 20.0  # a launch of 2 CTAs runs in microseconds


def test_one_launch_finishes():
    """First and cheapest (1 x 65 tokens, one head, bf16 dv16 + dk16: standard keys): the fused
    key loaded (its seconds printed: a prebuilt .so loads in well under one, a compile takes
    ~15), the two launches, then the fused one polled on an event: not done in HANG_S seconds
    fails as a hang (the process then stays in the kernel until its outer timeout); else its
    outputs the two launches' bit for bit."""
    tiles, wy = _tiles(1, 65, 1, torch.bfloat16, seed=1)
    t0 = time.perf_counter()
    get_kernel(launch.SPEC, launch._params("bfloat16", (128, 128), dv16=True, dk16=True))
    print(f"\nkda_bwd_fused key loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    want = _two_launches(tiles, wy, dv16=True, dk16=True)
    torch.cuda.synchronize()
    got = _fused(tiles, wy, dv16=True, dk16=True)
    done = torch.cuda.Event()
    done.record()
    t0 = time.perf_counter()
    while not done.query():
        if time.perf_counter() - t0 > HANG_S:
            pytest.fail(f"the fused launch has not finished in {HANG_S:.0f} s: a hang")
        time.sleep(0.01)
    _same(got, want)


@pytest.mark.parametrize("flags", range(len(FLAGS)))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("b", "t", "hv"), [(1, 1, 1), (2, 65, 3), (3, 63, 2), (1, 1000, 2)])
def test_fused_is_the_two_launches_bit_for_bit(dtype, b, t, hv, flags):
    """Every output of the fused launch equals kernel 2 (dw16) then the WY kernel, bit for bit
    (falsifiers: NaN = an unwritten entry, phase B's boxes or stores; dv / dbeta / dk off =
    dw's or du's on-chip copy; dg alone = the fence between phase A's dG stores and phase B's
    bulk reduce-adds; dq alone = phase A)."""
    tiles, wy = _tiles(b, t, hv, dtype, seed=t + 7 * hv)
    want = _two_launches(tiles, wy, **FLAGS[flags])
    got = _fused(tiles, wy, **FLAGS[flags])
    _same(got, want)


def test_strong_decay_and_strided_tiles():
    """g in [-5, -4] a channel (e^(+-a) at its largest) and token tiles as every other half of a
    wider buffer (TMA on strided views), bf16: still the two launches bit for bit."""
    tiles, wy = _tiles(2, 130, 2, torch.bfloat16, g_range=(-5.0, -4.0), seed=11)
    want = _two_launches(tiles, wy, dv16=True, dk16=True)
    wide = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] for x in tiles[:5]]
    wide_wy = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] for x in wy[:4]]
    got = _fused([*wide, *tiles[5:]], (*wide_wy, wy[4]), dv16=True, dk16=True)
    _same(got, want)


def _op_call(b, t, dtype=torch.bfloat16, hv=16, seed=0):
    q, k, v, g, beta, do, h0, dht = _op_problem(b, t, hv, hv, dtype, seed=seed)

    def run():
        return bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, initial_state=h0,
                                                 d_final_state=dht, scale=128**-0.5,
                                                 use_qk_l2norm_in_kernel=False)  # fmt: skip

    return run


@pytest.mark.parametrize(("b", "t", "hv"), [(1, 65, 2), (2, 1000, 3), (1, 4096, 16)])
def test_the_op_with_the_switch_is_the_op_without(monkeypatch, b, t, hv):
    """The op (bf16, no l2norm, H = HV: the bench's form, dk16 and dv16 on the device pass) with
    FUSED_SWITCH "1" against "0": every gradient bit for bit."""
    run = _op_call(b, t, hv=hv, seed=t)
    monkeypatch.setenv(bwd.FUSED_SWITCH, "0")
    want = run()
    monkeypatch.setenv(bwd.FUSED_SWITCH, "1")
    got = run()
    for name, a, r in zip((*NAMES, "dh0"), got, want):
        assert torch.equal(a, r), name


def test_the_slot_layout_with_the_switch(monkeypatch):
    """Varlen (cu_seqlens: an empty, a one-token and tail sequences) with NATIVE_STORES on (the
    fused kernel's `token_rows` key: the outputs at their token rows) and FUSED_SWITCH "1"
    against "0": every gradient bit for bit."""
    varlen = importlib.import_module("forgekernel.ops._linattn_varlen")
    lens, hv = [1, 0, 65, 200, 7], 2
    t = sum(lens)
    q, k, v, g, beta, do, _, _ = _op_problem(1, t, hv, hv, torch.bfloat16, seed=9)
    gen = torch.Generator(device="cuda").manual_seed(10)
    h0, dht = (torch.randn(len(lens), hv, 128, 128, device="cuda", generator=gen) * 0.1
               for _ in range(2))  # fmt: skip
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                      device="cuda")  # fmt: skip
    monkeypatch.setattr(varlen, "NATIVE_STORES", True)
    got = {}
    for mode in ("0", "1"):
        monkeypatch.setenv(bwd.FUSED_SWITCH, mode)
        got[mode] = bwd.kimi_delta_attention_backward(q, k, v, g, beta, do, cu_seqlens=cu,
                                                      initial_state=h0, d_final_state=dht,
                                                      scale=128**-0.5,
                                                      use_qk_l2norm_in_kernel=False)  # fmt: skip
    for name, a, r in zip((*NAMES, "dh0"), got["1"], got["0"]):
        assert torch.equal(a, r), name


@pytest.mark.parametrize(("b", "t"), [(1, 2048), (1, 8192), (4, 8192)])
def test_time_both_paths(monkeypatch, b, t):
    """The op's backward (bf16, H = HV = 16, states, no l2norm: the bench's kda_bwd cases) with
    the switch off and on, interleaved, and at 4 x 8192 the gradient kernels alone (kernel 2 +
    WY against the fused launch), printed (`-s`). Prediction (NOTES "next/kda-fuse-wy"): the
    fused launch ~2.6-2.9 ms against ~3.3 for the two (H100, 4 x 8192)."""
    run = _op_call(b, t)
    times = {"0": [], "1": []}
    for _ in range(3):
        for mode in times:
            monkeypatch.setenv(bwd.FUSED_SWITCH, mode)
            times[mode].append(median(time_ms(run, reps=10)))
    off, on = median(times["0"]), median(times["1"])
    print(f"\nKDA backward {b} x {t} hv16 bf16: two launches {off:.3f} ms, fused {on:.3f} ms "
          f"({off / on:.2f}x)")  # fmt: skip
    if b * t < 4 * 8192:
        return
    tiles, wy = _tiles_at(b, t)
    flags = {"dv16": True, "dk16": True}
    two = median(time_ms(lambda: _two_launches(tiles, wy, **flags), reps=20))
    one = median(time_ms(lambda: _fused(tiles, wy, **flags), reps=20))
    print(f"KDA gradient kernels {b} x {t} hv16 bf16 (dv16 dk16, poisoning included): "
          f"kernel 2 + WY {two:.3f} ms, fused {one:.3f} ms ({two / one:.2f}x)")  # fmt: skip


def _tiles_at(b, t, hv=16):
    """Random bench-size tiles (bf16) for the kernels alone (no factors: timing only)."""
    gen = torch.Generator(device="cuda").manual_seed(3)
    nc = -(-t // 64)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    tiles = [rnd(b, t, hv, 128) for _ in range(3)]
    tiles += [rnd(b, t, hv, 128, scale=128**-0.5) for _ in range(2)]
    tiles += [rnd(b, nc, hv, 128, 128, scale=0.1) for _ in range(2)]
    g = -5.0 * torch.rand(b, nc, 64, hv, 128, device="cuda", generator=gen)
    tiles.append(g.cumsum(2).flatten(1, 2)[:, :t].contiguous())
    wy = (rnd(b, t, hv, 64, scale=0.1), rnd(b, t, hv, 128, scale=0.1), rnd(b, t, hv, 128),
          rnd(b, t, hv, 128), torch.rand(b, t, hv, device="cuda", generator=gen))  # fmt: skip
    return tiles, wy
