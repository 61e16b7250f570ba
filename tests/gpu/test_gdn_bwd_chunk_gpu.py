"""The Gated DeltaNet backward's kernel 2 (kernels/linear_attention/gdn_bwd_chunk/sm90: pass 3,
one CTA per (chunk, value head, sequence), issue 20; both variants: `_output_grads` only and
all of pass 3, `wy`) on the GPU: against its model (`reference.gdn_bwd_chunk` in fp64 on the
same 16-bit tiles, the kernel's 16-bit operands rounded as it rounds them: tests/
test_gdn_bwd_chunk.py's `emulate`) and against reference/delta_rule_bwd.py's pass 3 in fp64 (the
batched torch it replaces; dG reverse-cumsummed); outputs NaN-poisoned before the call (a row
the kernel does not write fails); bf16 and fp16; T = 1, 63, 64, 65, 200, 1000 (tail chunks
zero-filled by TMA); 1-3 sequences, 1-3 heads; misaligned inputs (the launcher's copies); the
4 x 8192 HV 32 time of both variants printed (`-s`).

Tolerance: each output within 1e-2 of its reference's largest entry against the model (the
same 16-bit inputs; fp32 accumulation and the fp32 exponentials are the only differences),
2e-2 against the reference on unrounded inputs (the CPU rounded emulation passes at that)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from test_gdn_bwd_chunk import NAMES, emulate, reference

from forgekernel.kernels.linear_attention.gdn_bwd_chunk.sm90.launch import (
    empty_outputs,
    empty_wy_outputs,
    gdn_bwd_chunk,
    gdn_bwd_chunk_wy,
)
from forgekernel.reference.gdn_bwd_chunk import chunk_grad_tiles, wy_tiles
from forgekernel.reference.gdn_bwd_state import chunk_factors, to_chunks, to_tokens
from forgekernel.runtime.timing import median, time_ms

pytestmark = pytest.mark.gpu


def _problem(b, t, hv, dtype, seed=0, group=1):
    """`test_gdn_bwd_chunk.problem`'s tuple on the GPU at K = V = 128 (fp64), do rounded to
    `dtype` (the kernel path's do is 16-bit); `group`: q, k shared by each `group` value heads
    (HV / group heads repeated)."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float64)

    qs, ks = (
        rnd(b, t, hv // group, 128) * 128**-0.5,
        F.normalize(rnd(b, t, hv // group, 128), dim=-1),
    )
    qs, ks = (x.repeat_interleave(group, dim=2) for x in (qs, ks))
    v, do = rnd(b, t, hv, 128), rnd(b, t, hv, 128).to(dtype).double()
    g, beta = F.logsigmoid(rnd(b, t, hv) + 2.0), torch.sigmoid(rnd(b, t, hv))
    f = chunk_factors(qs, ks, v, g, beta)
    nc = f.w.shape[1]
    h, dh = rnd(b, nc, hv, 128, 128) * 0.1, rnd(b, nc, hv, 128, 128) * 0.1
    big_u, d_u = (to_chunks(rnd(b, t, hv, 128), nc) for _ in range(2))
    return f, do, to_chunks(do, nc), h, dh, big_u, d_u, qs, ks, g, v, beta


def _launch(p, dtype, wy, strided=False, group=1, dv16=False, dqk16=False, scale=1.0,
            fsplit=False):  # fmt: skip
    """The kernel on `_problem` p's tiles in `dtype`, outputs NaN-poisoned first; `group`: q, k
    passed at their HV / group heads (the `grouped` key); `dv16`: dv in `dtype`; `dqk16`: dq
    (times `scale`), dk in `dtype`."""
    f, do, _, h, dh, big_u, d_u, qs, ks, g, v, beta = p
    tiles = list(chunk_grad_tiles(qs, ks, do, big_u, d_u, h, dh, g, dtype))
    tiles[-1] = tiles[-1].float()
    if group > 1:
        tiles[3:5] = [x[:, :, ::group].contiguous() for x in tiles[3:5]]
    if strided:  # token tiles as every other 128-column half of a wider buffer
        tiles[:5] = [torch.cat([x, x], dim=-1)[..., : x.shape[-1]] for x in tiles[:5]]
    if not wy:
        out = tuple(x.fill_(float("nan")) for x in empty_outputs(tiles[0], 128))
        return gdn_bwd_chunk(*tiles, out=out)
    extra = list(wy_tiles(f, v, beta, dtype))
    extra[-1] = extra[-1].float()
    out = tuple(x.fill_(float("nan")) for x in empty_wy_outputs(tiles[0], 128, dv16, dqk16))
    return gdn_bwd_chunk_wy(
        *tiles, *extra, out=out, dv16=dv16, dqk16=dqk16, scale=scale, fsplit=fsplit
    )


def _close(name, got, want, tol):
    assert got.shape == want.shape, name
    assert not torch.isnan(got).any(), f"{name}: unwritten (NaN) entries"
    if want.numel() == 0:
        return
    err = float((got.double() - want).abs().max())
    assert err <= tol * float(want.abs().max()) + 1e-6, (name, err, float(want.abs().max()))


@pytest.mark.parametrize("wy", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 200, 1000])
@pytest.mark.parametrize(("b", "hv"), [(1, 1), (2, 3), (3, 2)])
def test_matches_the_model_and_pass_3(wy, dtype, t, b, hv):
    p = _problem(b, t, hv, dtype, seed=t + b)
    got = _launch(p, dtype, wy)
    for name, a, r in zip(NAMES[wy], got, emulate(p, dtype, wy)):
        _close(name, a, r, 1e-2)
    for name, a, r in zip(NAMES[wy], got, reference(p, wy)):
        _close(name + " vs pass 3", a, r, 2e-2)


@pytest.mark.parametrize("wy", [True, False])
@pytest.mark.parametrize("t", [65, 1000])
def test_grouped_heads(wy, t):
    """q, k at H = HV / 2 heads (the `grouped` key, value head hv reading hv // 2): exactly the
    call on the HV-repeated tiles."""
    p = _problem(2, t, 4, torch.bfloat16, seed=t, group=2)
    for name, a, r in zip(NAMES[wy], _launch(p, torch.bfloat16, wy, group=2),
                          _launch(p, torch.bfloat16, wy)):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("t", [1, 65, 1000])
@pytest.mark.parametrize("group", [1, 2])
def test_dv16(t, group):
    """`dv16` (the op's path, with `grouped` too): dv written in 16 bits is the fp32 call's dv
    rounded once; the other outputs are the fp32 call's exactly."""
    p = _problem(2, t, 4, torch.bfloat16, seed=t + group, group=group)
    got = _launch(p, torch.bfloat16, True, group=group, dv16=True)
    want = _launch(p, torch.bfloat16, True, group=group)
    assert got[3].dtype == torch.bfloat16
    for i, (name, a, r) in enumerate(zip(NAMES[True], got, want)):
        r = r.to(torch.bfloat16) if i == 3 else r
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


@pytest.mark.parametrize("wy", [True, False])
def test_misaligned_inputs(wy):
    """Strided token tiles (TMA reads them in place) give the contiguous call's outputs."""
    p = _problem(2, 130, 2, torch.bfloat16, seed=5)
    for name, a, r in zip(NAMES[wy], _launch(p, torch.bfloat16, wy, strided=True),
                          _launch(p, torch.bfloat16, wy)):  # fmt: skip
        torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


def _bench_size_tiles():
    """4 x 8192 tokens, HV 32, bf16: kernel 2's tiles (do, u, du, q, k, h, dh, G) and the WY
    variant's extra ones (T, W, u, v, beta), fixed seed."""
    b, t, hv, nc = 4, 8192, 32, 128
    gen = torch.Generator(device="cuda").manual_seed(3)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, device="cuda", generator=gen) * scale).bfloat16()

    tiles = [rnd(b, t, hv, 128) for _ in range(3)]
    tiles += [rnd(b, t, hv, 128, scale=128**-0.5), rnd(b, t, hv, 128, scale=128**-0.5)]
    tiles += [rnd(b, nc, hv, 128, 128, scale=0.1) for _ in range(2)]
    g = F.logsigmoid(torch.randn(b, t, hv, device="cuda", generator=gen) + 2.0)
    tiles.append(to_tokens(to_chunks(g, nc).cumsum(-1)).contiguous())
    extra = [rnd(b, t, hv, 64, scale=0.3), rnd(b, t, hv, 128, scale=0.1),
             rnd(b, t, hv, 128), rnd(b, t, hv, 128),
             torch.rand(b, t, hv, device="cuda", generator=gen)]  # fmt: skip
    return tiles, extra


def test_time_at_bench_size():
    """4 x 8192 tokens, HV 32 (the gdn_bwd suite's batch case): one launch of each variant
    (printed; the prediction: NOTES.md "Backward kernel 2"), outputs finite."""
    tiles, extra = _bench_size_tiles()
    runs = (
        ("_output_grads", gdn_bwd_chunk, [], empty_outputs(tiles[0], 128)),
        ("all of pass 3", gdn_bwd_chunk_wy, extra, empty_wy_outputs(tiles[0], 128)),
    )
    for form, fn, more, out in runs:
        fn(*tiles, *more, out=out)
        for x in out:
            assert torch.isfinite(x).all(), form
        ms = median(time_ms(lambda fn=fn, more=more, out=out: fn(*tiles, *more, out=out),
                            reps=20))  # fmt: skip
        moved = sum(x.numel() * x.element_size() for x in (*tiles, *more, *out)) / 1e9
        print(
            f"\nGDN backward kernel 2 ({form}), 4 x 8192 hv32 bf16: {ms:.3f} ms a launch, "
            f"{moved:.2f} GB moved, {moved / ms * 1e3:.0f} GB/s"
        )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 65, 1000])
@pytest.mark.parametrize(("group", "scale"), [(1, 1.0), (2, 1.0), (1, 0.0883883)])
def test_dqk16(dtype, t, group, scale):
    """`dqk16` (the op's default key, with dv16 and `grouped`): dq x scale and dk written in 16
    bits are the fp32 call's rounded once (dk's first half kept in fp32 in shared memory, not
    read back from a 16-bit store: exact but for the fp32 sum's order, so within one 16-bit ulp
    of the rounded fp32 value); dg, dv, dbeta exactly the fp32 call's."""
    p = _problem(2, t, 4, dtype, seed=t + group, group=group)
    got = _launch(p, dtype, True, group=group, dv16=True, dqk16=True, scale=scale)
    want = _launch(p, dtype, True, group=group, dv16=True)
    assert got[0].dtype == got[1].dtype == dtype
    for i, (name, a, r) in enumerate(zip(NAMES[True], got, want)):
        if i < 2:
            r = (r * (scale if i == 0 else 1.0)).to(dtype).double()
            ulp = r.abs() * 2.0 ** -(7 if dtype == torch.bfloat16 else 10)  # one, at most
            assert not torch.isnan(a).any(), f"{name}: unwritten (NaN) entries"
            slack = 1e-6 * float(r.abs().max())
            assert bool(((a.double() - r).abs() <= ulp + slack).all()), name
        else:
            torch.testing.assert_close(a, r, rtol=0, atol=0, msg=name)


# T = 65, 130: last chunks of 1 and 2 rows, where the WY warpgroup's tail is nearly empty and
# it reaches BAR_FINISH first: 130 with (2, 4, 2) is the check case mix5-t323-h2-hv4's first
# bucket (lengths 130, 65, 64 padded to 130, H 2, HV 4), where racecheck flagged the finish's
# hand-over (NOTES "GDN fsplit race"); run these under racecheck (the note's commands)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("t", [1, 63, 64, 65, 130, 200, 1000])
@pytest.mark.parametrize(("b", "hv", "group", "scale"),
                         [(1, 1, 1, 1.0), (2, 4, 2, 1.0), (3, 2, 1, 0.0883883)])  # fmt: skip
def test_fsplit_is_the_dqk16_kernel_bit_for_bit(dtype, t, b, hv, group, scale):
    """`fsplit` (two math warpgroups split by function, NOTES "two math warpgroups or two CTAs
    a SM?" option A'): the same products in the same order as the 256-thread dqk16 kernel, so
    every output (dq, dk, dg, dv, dbeta) equal bit for bit, NaN-poisoned outputs all written."""
    p = _problem(b, t, hv, dtype, seed=7 * t + hv, group=group)
    want = _launch(p, dtype, True, group=group, dv16=True, dqk16=True, scale=scale)
    got = _launch(p, dtype, True, group=group, dv16=True, dqk16=True, scale=scale, fsplit=True)
    for name, a, r in zip(NAMES[True], got, want):
        assert not torch.isnan(a).any(), f"{name}: unwritten (NaN) entries"
        torch.testing.assert_close(a, r, rtol=0, atol=0, equal_nan=True, msg=name)


def test_fsplit_time_at_bench_size():
    """4 x 8192 tokens, HV 32, bf16, dv16 + dqk16 (the op's key): the 256-thread kernel and
    `fsplit`, interleaved, each the median of 20 (printed, `-s`); the same outputs."""
    tiles, extra = _bench_size_tiles()
    outs = {fs: empty_wy_outputs(tiles[0], 128, True, True) for fs in (False, True)}

    def run(fs):
        return gdn_bwd_chunk_wy(*tiles, *extra, out=outs[fs], dv16=True, dqk16=True, fsplit=fs)

    for fs in (False, True):
        run(fs)
    for a, r in zip(outs[True], outs[False]):
        torch.testing.assert_close(a, r, rtol=0, atol=0, equal_nan=True)
    times = {False: [], True: []}
    for _ in range(3):
        for fs in (False, True):
            times[fs] += time_ms(lambda fs=fs: run(fs), reps=20)
    base, split = median(times[False]), median(times[True])
    print(
        f"\nGDN backward kernel 2 dqk16, 4 x 8192 hv32 bf16: {base:.3f} ms (256 threads), "
        f"{split:.3f} ms (fsplit, 384), {base / split:.2f}x"
    )
