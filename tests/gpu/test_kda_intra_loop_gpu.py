"""Stage 1 of the fused KDA design on the GPU: the aux role as a chunk loop (`intra_loop.py`, one
CTA per (sequence, value head)) against the first pass it restates (`intra.py`, one CTA per
chunk) and the torch first pass, and its time a chunk at 64 / 128 CTAs (the design's prediction:
<= 5.6 us a chunk at 128 CTAs). Not in the op: the kernel is compiled here, not through a spec.

    python -m pytest -m gpu tests/gpu/test_kda_intra_loop_gpu.py -s
"""

from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu


# the loop's forms: addresses held (256 B spilled), redone each chunk (the default), and both
# with the inverse's scratch and sP in their own shared memory (own_scratch: rolled block
# paths; held then spills nothing: the spill was the 48 accumulators over the products' barrier)
FORMS = {"held": {"recompute_addresses": False}, "redone": {}, "own": {"own_scratch": True},
         "own_held": {"own_scratch": True, "recompute_addresses": False}}  # fmt: skip


@functools.cache
def _kernel(dtype: str, form: str):
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile_loop import (
        compile_kda_intra_loop,
    )
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra_loop import (
        KdaIntraLoopSm90,
    )

    kernel = KdaIntraLoopSm90(128, **FORMS[form])
    return compile_kda_intra_loop({"dtype": dtype, "k": 128}, kernel=kernel)


def _inputs(lens, h, hv, seed, strong):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(total, h, 128).to(torch.bfloat16)
    k = F.normalize(rnd(total, h, 128), dim=-1).to(torch.bfloat16)
    if strong:
        g = -4.0 - torch.rand(total, hv, 128, device="cuda", generator=gen)
    else:
        g = F.logsigmoid(rnd(total, hv, 128) + 2.0)
    beta = torch.sigmoid(rnd(total, hv))
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, g, beta, cu.to(torch.int32)


def _run_loop(q, k, g, beta, cu, scale, form="redone"):
    """The loop kernel's outputs in `operands.py`'s layout (rows of chunks past the last real
    one left as NaN: nobody writes them)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import operands

    n = cu.shape[0] - 1
    first, _, _ = operands.chunk_tables(cu, operands.chunk_bound(q.shape[0], n))
    bound = operands.chunk_bound(q.shape[0], n)
    rows, hv = 64 * bound, g.shape[1]
    out = {
        name: torch.full((rows, hv, w), float("nan"), device="cuda", dtype=torch.bfloat16)
        for name, w in (("q_g", 128), ("k_g", 128), ("k_d", 128), ("t_beta", 64), ("p", 64))
    }
    out["decay"] = torch.full((bound, hv, 128), float("nan"), device="cuda")
    _kernel("bfloat16", form)(q, k, g, beta, cu, first, out["q_g"], out["k_g"], out["k_d"],
                        out["t_beta"], out["p"], out["decay"], scale)  # fmt: skip
    return out


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("strong", [False, True])
def test_loop_equals_first_pass(strong, form):
    """Output by output against intra.py (the same layout) within 3e-2 of each output's largest
    entry (the E-on-B rounding differs: bf16(bf16(Kr) bf16(E)) against intra's bf16(Kr E)),
    and against the torch first pass at the same bound; lengths 1, 63, 64, 65, 300, 1000 (one
    chunk, partial chunks, a long walk)."""
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch, operands

    lens = [1, 63, 64, 65, 300, 1000]
    q, k, g, beta, cu = _inputs(lens, 2, 4, seed=21, strong=strong)
    got = _run_loop(q, k, g, beta, cu, 0.1, form)
    ref = launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False)
    want = operands.kda_chunk_operands(q, k, g, beta, cu, 0.1, False)
    real = sum(-(-n // 64) for n in lens)
    for name in ("q_g", "k_g", "k_d", "t_beta", "p", "decay"):
        cut = real if name == "decay" else 64 * real
        for other in (ref, want):
            a, b = got[name][:cut].double(), other[name][:cut].double()
            assert torch.isfinite(a).all(), name
            err = float((a - b).abs().max())
            assert err <= 3e-2 * float(b.abs().max()) + 1e-5, (name, err)


@pytest.mark.parametrize("form", list(FORMS))
@pytest.mark.parametrize("hv", [16, 32])
def test_loop_time_a_chunk(hv, form):
    """4 x 8192, h 16: 4 hv CTAs (64, 128), 128 chunks each; printed: us a chunk (the walk's
    time / 128) beside intra.py's whole pass. No assertion: the design's figure to compare."""
    lens = [8192] * 4
    q, k, g, beta, cu = _inputs(lens, 16, hv, seed=22, strong=False)
    _run_loop(q, k, g, beta, cu, 0.1, form)  # compile, warm
    from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch

    def timed(fn, reps=10):
        fn()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / reps * 1e3  # us

    loop_us = timed(lambda: _run_loop(q, k, g, beta, cu, 0.1, form))
    intra_us = timed(lambda: launch.first_pass_kernel(q, k, g, beta, cu, 0.1, False, 8192))
    print(f"\nhv {hv} {form}: {4 * hv} CTAs, loop {loop_us:.0f} us = "
          f"{loop_us / 128:.2f} us a chunk (design: <= 5.6 at 128 CTAs); intra.py "
          f"{intra_us:.0f} us")  # fmt: skip
