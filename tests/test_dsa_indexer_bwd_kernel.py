"""The indexer backward kernel (kernels/attention/dsa_indexer_bwd/sm90) on the CPU: its
declaration, the launcher's input checks and the op's routing, the ring protocol (emulate.py:
the producer's LAG tiles in flight, the two consumers' alternate tiles), the dK reductions' lane
map, and the kernel's decomposition (emulate.py: the prologue's G, TILE-slot tiles split over the
consumers, masks, dK rows added tile by tile) against reference/dsa_indexer_bwd.py in fp64."""

from __future__ import annotations

import pytest
import torch

from forgekernel.kernels.attention.dsa_indexer_bwd.sm90 import SPEC, config, emulate, launch
from forgekernel.reference.dsa_indexer_bwd import dsa_indexer_kl_backward_ref
from forgekernel.runtime.spec import all_specs

H, D = config.HEADS, config.DIM


def test_spec_is_registered():
    assert SPEC.name == "dsa_indexer_bwd_sm90"
    assert SPEC.name in {s.name for s in all_specs()}
    assert SPEC.representative_params() in SPEC.standard_params()
    assert [dict(p)["dtype"] for p in SPEC.standard_params()] == list(config.DTYPES)


def test_params_and_shared_memory_plan():
    assert config.params_for("bfloat16") == (("dtype", "bfloat16"), ("heads", 64))
    assert dict(config.params_for("bfloat16", reduce=False))["noreduce"] is True
    candidates = SPEC.candidate_params()
    assert config.params_for("bfloat16", reduce=False) in candidates
    assert config.params_for("bfloat16", staged=True, pair=True) in candidates
    assert len(candidates) == 7 and config.params_for("bfloat16") not in candidates
    with pytest.raises(ValueError, match="dtype"):
        config.params_for("float32")
    with pytest.raises(ValueError, match="64 heads"):
        config.params_for("bfloat16", 32)
    assert config.TOPK_MAX % config.TILE == 0
    for p in (config.STANDARD, config.PAIR):
        assert p.stages > config.LAG and p.stages % p.consumers == 0
        assert p.ctas * (config.smem_bytes(p) + 1024) <= 233472  # the SM's 228 KB
        # setmaxnreg moves registers within the CTA's launch share
        launch_regs = 65536 // (p.threads * p.ctas) // 8 * 8
        assert (
            p.producer_regs * 128 + p.consumer_regs * 128 * p.consumers <= launch_regs * p.threads
        )
        assert p.per_thread * p.threads >= config.TOPK_MAX
    assert config.plan(True) is config.PAIR and config.plan() is config.STANDARD


def _cpu_inputs(dtype=torch.bfloat16, heads=H, dim=D, topk=128, ids=torch.int32):
    q = torch.randn(3, heads, dim, dtype=dtype)
    k = torch.randn(50, dim, dtype=dtype)
    idx = torch.randint(0, 50, (3, topk), dtype=ids)
    return q, k, idx


@pytest.mark.parametrize(
    "change, reason",
    [
        ({"dtype": torch.float32}, "takes bf16"),
        ({"dtype": torch.float16}, "underflows"),
        ({"heads": 32}, "64 heads"),
        ({"dim": 64}, "128 wide"),
        ({"ids": torch.int64}, "int32"),
        ({"topk": config.TOPK_MAX + 64}, "shared memory"),
        ({}, "CUDA"),
    ],
)
def test_launcher_declines_what_the_kernel_does_not_take(change, reason):
    q, k, idx = _cpu_inputs(**change)
    assert reason in launch.unsupported(q, k, idx)


def test_op_routes_declined_inputs_to_the_interim_path(monkeypatch):
    from forgekernel.ops import dsa_indexer_bwd as op

    q, k, idx = _cpu_inputs()
    w = torch.randn(3, H, dtype=q.dtype)
    t = torch.rand(3, idx.shape[1])
    assert op._backward_kernel(q, w, k, t, t, idx, None, 1.0, 1.0, False) is None  # CPU
    monkeypatch.setenv(op.KERNEL_ENV, "0")
    assert not op.kernel_selected()
    monkeypatch.setenv(op.KERNEL_ENV, "yes")
    with pytest.raises(ValueError, match=op.KERNEL_ENV):
        op.kernel_selected()


@pytest.mark.parametrize("pair", [False, True])
@pytest.mark.parametrize("tiles", [0, 1, 2, 3, 5, 6, 7, 12, 13, 32])
def test_ring_protocol(tiles, pair):
    p = config.plan(pair)
    for seed in range(40):
        emulate.run_protocol(tiles, seed, stages=p.stages, consumers=p.consumers)


def test_ring_protocol_catches_a_lag_as_deep_as_the_ring():
    """The model is not vacuous: LAG = STAGES lets the producer wait on a stage whose tile it
    has not signalled yet."""
    with pytest.raises(emulate.Deadlock):
        for seed in range(20):
            emulate.run_protocol(3 * config.STAGES, seed, stages=4, lag=4)


def test_dk_reduction_lane_map():
    """Every element of a 64 x 64 dK accumulator is added exactly once, each lane's four values
    being four adjacent columns of one row at the address `_reduce_dk` computes."""
    seen = {}
    for (v, lane, j), vals in emulate.dk_reduction_map().items():
        row, col = emulate.kernel_destination(v, lane, j)
        assert vals == [(row, col + e) for e in range(4)]
        assert col % 4 == 0
        for rc in vals:
            assert rc not in seen
            seen[rc] = (v, lane, j)
    assert set(seen) == {(r, c) for r in range(64) for c in range(64)}


def _case(b, s_q, s_kv, topk, *, pad, indices_global, dtype=torch.float64, seed=0):
    """Inputs of the op's layouts (b None: 3-D) with padding of the kinds the kernel skips:
    -1, ids >= S_kv and < 0 (other batches' rows under indices_global), a row with no valid
    slot, a valid slot whose target is 0, predict 0 at a valid slot (the clip)."""
    gen = torch.Generator().manual_seed(seed)
    bb = 1 if b is None else b
    q = torch.randn(bb, s_q, H, D, generator=gen).to(dtype)
    k = torch.randn(bb, s_kv, D, generator=gen).to(dtype)
    w = (0.1 * torch.randn(bb, s_q, H, generator=gen)).to(dtype)
    idx = torch.randint(0, s_kv, (bb, s_q, topk), generator=gen, dtype=torch.int32)
    if pad == "end":  # causal-like: row r keeps r + 1 slots (the kernel's skipped tail tiles)
        keep = torch.arange(topk)[None, :] <= torch.arange(s_q)[:, None] * 37
        idx = torch.where(keep[None], idx, -1)
    else:  # scattered padding of every kind
        r = torch.rand(idx.shape, generator=gen)
        idx = torch.where(r < 0.15, -1, idx)
        idx = torch.where((r >= 0.15) & (r < 0.2), s_kv + 3, idx)
        idx = torch.where((r >= 0.2) & (r < 0.23), -7, idx)
    if s_q > 1:
        idx[:, 0, :] = -1  # query 0 has no valid slot
    if indices_global:
        base = (torch.arange(bb, dtype=torch.int32) * s_kv)[:, None, None]
        idx = torch.where(idx >= 0, idx + base, idx)  # -7 and -1 stay padding
    target = torch.rand(idx.shape, generator=gen, dtype=torch.float64)
    target[..., 1] = 0.0
    predict = torch.rand(idx.shape, generator=gen, dtype=torch.float64)
    predict[..., 2] = 0.0
    target, predict = target.float(), predict.float()
    if b is None:
        q, k, w, idx, target, predict = (x[0] for x in (q, k, w, idx, target, predict))
    return q, w, k, target, predict, idx


def _reference(q, w, k, target, predict, idx, grad_loss, sm_scale, loss_coeff, indices_global):
    """The op's layouts through the reference, fp64 (the interim path's flattening)."""
    from forgekernel.ops.dsa_indexer_bwd import flat_indices

    four = q.dim() == 4
    q4, w3, k3, t3, p3, i3 = (x if four else x[None] for x in (q, w, k, target, predict, idx))
    b, s, h, d = q4.shape
    rows = flat_indices(i3, k3.shape[1], indices_global).reshape(b * s, -1)
    scale = grad_loss * loss_coeff / (b * s)
    dq, dw, dk = dsa_indexer_kl_backward_ref(
        q4.reshape(b * s, h, d), k3.reshape(-1, d), w3.reshape(b * s, h), rows,
        t3.reshape(b * s, -1), p3.reshape(b * s, -1), grad_scale=scale, sm_scale=sm_scale,
        dtype=torch.float64,
    )  # fmt: skip
    return dq.view(q.shape), dw.view(w.shape), dk.view(k.shape)


CASES = [
    # (b, s_q, s_kv, topk, pad, indices_global, sm_scale)
    (None, 5, 300, 128, "end", False, 1.0),
    (None, 7, 90, 130, "scattered", False, 0.37),  # topk not a multiple of 64; S_kv < topk
    (2, 3, 70, 100, "scattered", True, -0.8),  # global ids, a negative sm_scale
    (2, 4, 200, 64, "end", False, 1.0),
    (None, 1, 1, 7, "scattered", False, 1.0),  # one key
]


@pytest.mark.parametrize("consumers", [2, 1], ids=["standard", "pair"])
@pytest.mark.parametrize("b, s_q, s_kv, topk, pad, glob, sm_scale", CASES)
def test_emulated_kernel_matches_the_reference(b, s_q, s_kv, topk, pad, glob, sm_scale, consumers):
    args = _case(b, s_q, s_kv, topk, pad=pad, indices_global=glob)
    grad_loss, loss_coeff = 1.25, 0.7
    got = emulate.emulate_backward(*args, grad_loss, sm_scale, loss_coeff, glob,
                                   consumers=consumers)  # fmt: skip
    want = _reference(*args, grad_loss, sm_scale, loss_coeff, glob)
    for g, r in zip(got, want):
        assert g.shape == r.shape
        torch.testing.assert_close(g, r, rtol=1e-10, atol=1e-12 * float(r.abs().max()) + 1e-30)
    assert float(want[0].abs().max()) > 0 and float(want[2].abs().max()) > 0  # not vacuous


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_emulated_rounding_is_within_the_suite_tolerance(dtype):
    """dS rounded to the input dtype (the kernel's GEMM operands) against the fp64 reference of
    the same 16-bit inputs: within the suite's judge (REL_TOL of each gradient's largest)."""
    from forgekernel.bench.suites.dsa_indexer_bwd import REL_TOL

    args = _case(None, 6, 500, 256, pad="scattered", indices_global=False, dtype=dtype, seed=3)
    got = emulate.emulate_backward(*args, 1.0, 1.0, 1.0, False, ds_dtype=dtype)
    want = _reference(*args, 1.0, 1.0, 1.0, False)
    for g, r in zip(got, want):
        scale = float(r.abs().max())
        assert float((g.to(dtype).double() - r).abs().max()) <= REL_TOL * scale / 4


def test_staged_reduction_round_trip():
    """The staged candidate: the warp's 16 x 64 fp32 block stored through the swizzle and read
    back lane by lane is the block itself, each lane's load four adjacent columns of its row
    (row 2 k + lane // 16, columns 4 (lane % 16) ..), every element read once."""
    seen = set()
    for (lane, k), vals in emulate.staged_round_trip().items():
        row, col = 2 * k + lane // 16, 4 * (lane % 16)
        assert vals == [(row, col + e) for e in range(4)]
        seen.update(vals)
    assert seen == {(r, c) for r in range(16) for c in range(64)}


def test_lane_map_is_the_kernels_accumulator_layout():
    """dk_reduction_map's accumulator layout is the DSL's: GEMM2's tiled MMA (kernel.py
    `_setup`) partitions the (TILE, CHUNK) tile so that thread 32 v + l holds raw element
    4 j + 2 h + e at (16 v + l // 4 + 8 h, 8 j + 2 (l % 4) + e)."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute

    from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.kernel import DsaIndexerBwdSm90

    seen = {}
    kernel = DsaIndexerBwdSm90()

    @cute.jit
    def probe():
        kernel._setup(cutlass.BFloat16)
        tile = cute.make_identity_tensor((config.TILE, config.CHUNK))
        for t in cutlass.range_constexpr(128):
            crd = kernel.mma_dk.get_slice(t).partition_C(tile)
            seen[t] = [tuple(crd[i]) for i in range(cute.size(crd))]

    cute.compile(probe)
    for t, coords in seen.items():
        v, lane = divmod(t, 32)
        for i, rc in enumerate(coords):
            j, h, e = i // 4, (i // 2) % 2, i % 2
            assert rc == (16 * v + lane // 4 + 8 * h, 8 * j + 2 * (lane % 4) + e)


def test_stages_are_contiguous():
    """The staged form addresses stage s as the fp32 bytes [s x 16 KB, (s + 1) x 16 KB): the
    ring's two 64-column chunks of a stage (kernel.py `_setup`'s lay_k, index s x NCHUNK + k)
    must be exactly those bytes (the 128-byte swizzle permutes 16-byte pieces inside 1 KB)."""
    pytest.importorskip("cutlass")
    import cutlass
    import cutlass.cute as cute

    from forgekernel.kernels.attention.dsa_indexer_bwd.sm90.kernel import DsaIndexerBwdSm90

    seen = {}
    kernel = DsaIndexerBwdSm90(pair=True)  # 4 stages (8 chunks); the standard plan: the same atoms

    @cute.jit
    def probe():
        kernel._setup(cutlass.BFloat16)
        lay = kernel.lay_k
        for k in cutlass.range_constexpr(config.NCHUNK * kernel.p.stages):
            seen[k] = sorted(
                {lay((r, c, k)) for r in range(config.TILE) for c in range(0, config.CHUNK, 8)}
            )

    cute.compile(probe)
    elems = config.TILE * config.CHUNK
    for k, offsets in seen.items():
        assert offsets == list(range(k * elems, (k + 1) * elems, 8))


def _gpu_test_module():
    """tests/gpu/test_dsa_indexer_bwd_kernel_gpu.py (its cases, problem, reference, judge),
    loaded by path: it is not a package."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).parent / "gpu" / "test_dsa_indexer_bwd_kernel_gpu.py"
    spec = importlib.util.spec_from_file_location("_indexer_bwd_kernel_gpu_cases", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("dtype", [torch.bfloat16], ids=["bf16"])  # the kernel's one dtype
def test_gpu_cases_meet_their_judge_under_the_kernels_rounding(dtype):
    """Every case of the GPU test's reference comparison, built on the CPU by its own `_problem`
    and emulated with the kernel's rounding (dS, dq and dw in the inputs' dtype, dK fp32), passes
    that test's judge. It caught (2026-12-04 review) the one-key case failing by 1e3-1e4 x: with
    S_kv = 1 and predict summing to 1 the exact gradients are 0 and the rounded dS is not."""
    gpu = _gpu_test_module()
    cpu = torch.device("cpu")
    for b, s_q, s_kv, topk, pad, glob in gpu.CASES:
        *args, gl = gpu._problem(b, s_q, s_kv, topk, dtype, pad=pad, glob=glob,
                                 seed=s_q * 7 + topk, device=cpu)  # fmt: skip
        dq, dw, dk = emulate.emulate_backward(*args, float(gl), 1.0, 1.0, glob, ds_dtype=dtype)
        *want, _ = gpu._reference(*args, gl, glob)
        gpu._judge((dq.to(dtype), dw.to(dtype), dk.float()), want)
