"""forgekernel's grouped (MoE, contiguous) FP8 GEMM on the CPU: argument errors, the op and the
launcher through a stand-in kernel that computes the fp64 reference the way the compiled one
picks experts (per 128-row tile, from its first row), the reference against a naive per-expert,
per-block loop, the suite's inputs and its check (padding rows ignored, unwritten real rows
caught), and the custom op's fake implementation under make_fx."""

from __future__ import annotations

import dataclasses
import importlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

import forgekernel
from forgekernel.bench.check import verify
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
from forgekernel.bench.suites import gemm_fp8_grouped as suite_module
from forgekernel.kernels.gemm.fp8.sm90 import launch as fp8_sm90
from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED, params_for
from forgekernel.reference.gemm import gemm_fp8_grouped_ref

F8 = torch.float8_e4m3fn
CPU = torch.device("cpu")
op_module = importlib.import_module("forgekernel.ops.gemm_fp8_grouped")
SUITE = suite_module.suite()


def _inputs(case, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return suite_module.make_inputs(case, dtype, CPU, gen)


def _args(inputs):
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "m_indices"))


def _tile_experts(groups: torch.Tensor) -> torch.Tensor:
    """What the kernel multiplies each row by: its tile's first row's expert, -1 read as 0."""
    return groups.view(-1, 128)[:, 0].clamp_min(0).repeat_interleave(128).to(torch.int32)


@pytest.fixture
def stand_in(monkeypatch):
    """The compiled kernel replaced by the fp64 reference on the arguments it would get; each
    call's (params, clusters) recorded. Padding rows get their tile's expert (not zeros)."""
    calls = []

    def get_kernel(spec, params):
        def fn(a, b, c, work, flags, per, sa, sb, groups, clusters):
            assert work is None and flags is None and per == 0
            assert a.is_contiguous() and b.is_contiguous() and c.is_contiguous()
            assert groups.dtype == torch.int32 and groups.is_contiguous()
            n, k = c.shape[1], a.shape[1]
            e = b.shape[0] // n
            assert b.shape == (e * n, k) and sb.shape == (e * n // 128, k // 128)
            b3, sb3 = b.view(e, n, k), sb.reshape(e, n // 128, k // 128)
            c.copy_(gemm_fp8_grouped_ref(a, b3, sa, sb3, _tile_experts(groups)).to(c.dtype))
            calls.append((dict(params), clusters))

        return fn

    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(fp8_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fp8_sm90, "_plans", type(fp8_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fp8_sm90, "num_sms", lambda device: 132)
    return calls


SMALL = (
    suite_module._case(3, 384, 512, counts=(0, 77, 300)),
    suite_module._case(4, 640, 256, counts=(1, 128, 0, 129), tail=128),
    suite_module._case(2, 256, 128, counts=(0, 0), tail=256),
)


@pytest.mark.parametrize("case", SMALL, ids=lambda c: c.name)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_op_through_the_launcher(stand_in, case, dtype):
    inputs = _inputs(case, dtype)
    # issue 21's name for it (forgekernel.grouped_gemm_fp8): the contiguous layout
    fn = forgekernel.grouped_gemm_fp8 if dtype == torch.float16 else op_module.gemm_fp8_grouped
    c = fn(*_args(inputs), out_dtype=dtype)
    want = gemm_fp8_grouped_ref(*_args(inputs)).to(dtype)
    real = inputs["m_indices"] >= 0
    assert c.shape == want.shape and c.dtype == dtype
    assert torch.equal(c[real], want[real])
    params, clusters = stand_in[-1]
    assert params["grouped"] is True and params["out"] == str(dtype).removeprefix("torch.")
    assert params["tile_m"] == 128 and params["tile_n"] == GROUPED.tile_n
    assert clusters == 132 // (GROUPED.cluster_m * GROUPED.cluster_n)


def test_strided_out_and_indices(stand_in):
    """An `out` TMA cannot address (row stride off 16 bytes) and strided indices: written
    through a compact buffer, read contiguous."""
    inputs = _inputs(SMALL[0])
    a, b, sa, sb, idx = _args(inputs)
    wide = torch.full((a.shape[0], b.shape[1] + 3), 7.0, dtype=torch.bfloat16)
    out = wide[:, 1 : b.shape[1] + 1]
    strided_idx = torch.stack([idx, idx + 1], dim=1)[:, 0]
    got = op_module.gemm_fp8_grouped(a, b, sa, sb, strided_idx, out=out)
    real = idx >= 0
    assert got is out
    assert torch.equal(out[real], gemm_fp8_grouped_ref(a, b, sa, sb, idx).to(out.dtype)[real])
    assert bool((wide[:, 0] == 7).all() and (wide[:, -2:] == 7).all())  # nothing outside out


def test_no_rows_launches_nothing(stand_in):
    a, sa = torch.zeros(0, 256, dtype=F8), torch.zeros(0, 2)
    b, sb = torch.ones(2, 128, 256).to(F8), torch.ones(2, 1, 2)
    c = op_module.gemm_fp8_grouped(a, b, sa, sb, torch.zeros(0, dtype=torch.int32))
    assert c.shape == (0, 128) and not stand_in


def _bad(**kw):
    m, e, n, k = kw.pop("m", 128), kw.pop("e", 2), kw.pop("n", 256), kw.pop("k", 256)
    args = {
        "a": torch.zeros(m, k, dtype=F8),
        "b": torch.zeros(e, n, k, dtype=F8),
        "sa": torch.ones(m, k // 128),
        "sb": torch.ones(e, n // 128, k // 128),
        "idx": torch.zeros(m, dtype=torch.int32),
        "out_dtype": torch.bfloat16,
        "out": None,
    }
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        (_bad(a=torch.zeros(128, 256)), TypeError, "a must have dtype"),
        (_bad(b=torch.zeros(256, 256, dtype=F8)), ValueError, "b must be 3-D"),
        (_bad(b=torch.zeros(2, 256, 384, dtype=F8)), ValueError, "K mismatch"),
        (_bad(e=0), ValueError, "at least one expert"),
        (_bad(k=200), ValueError, "K must be a positive multiple of 128"),
        (_bad(n=200), ValueError, "N must be a multiple of 128"),
        (_bad(m=100), ValueError, "M must be a multiple of 128"),
        (_bad(sa=torch.ones(128, 3)), ValueError, "scale_a must have shape"),
        (_bad(sb=torch.ones(2, 2, 2, dtype=torch.float16)), TypeError, "scale_b must have dtype"),
        (_bad(sb=torch.ones(1, 2, 2)), ValueError, "scale_b must have shape"),
        (_bad(idx=torch.zeros(128, dtype=torch.int64)), TypeError, "m_indices must have dtype"),
        (_bad(idx=torch.zeros(256, dtype=torch.int32)), ValueError, "m_indices must have shape"),
        (_bad(out_dtype=torch.float32), TypeError, "out_dtype"),
        (_bad(out=torch.zeros(128, 255, dtype=torch.bfloat16)), ValueError, "out must have"),
        (_bad(out=torch.zeros(128, 256, dtype=torch.float16)), TypeError, "out must have dtype"),
    ],
)
def test_bad_arguments_name_the_argument(args, err, match):
    with pytest.raises(err, match=match):
        op_module.gemm_fp8_grouped(
            args["a"], args["b"], args["sa"], args["sb"], args["idx"],
            out_dtype=args["out_dtype"], out=args["out"],
        )  # fmt: skip


def test_cpu_tensors_and_mixed_devices_are_refused():
    args = _bad()
    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        op_module.gemm_fp8_grouped(args["a"], args["b"], args["sa"], args["sb"], args["idx"])
    with FakeTensorMode(allow_non_fake_inputs=True):
        a = torch.empty(128, 256, dtype=F8, device="cuda")
        b = torch.empty(2, 256, 256, dtype=F8, device="cuda")
        sa, sb = torch.empty(128, 2, device="cuda"), torch.empty(2, 2, 2, device="cuda")
        with pytest.raises(ValueError, match="m_indices is on cpu"):
            op_module.gemm_fp8_grouped(a, b, sa, sb, torch.zeros(128, dtype=torch.int32))


def _naive_ref(a, b, sa, sb, idx):
    """Row by row, block of K by block: sum over k-blocks of sa * sb * (a . b), in fp64."""
    m, k = a.shape
    n = b.shape[1]
    out = torch.zeros(m, n, dtype=torch.float64)
    for r in range(m):
        e = int(idx[r])
        if e < 0:
            continue
        for kb in range(k // 128):
            ks = slice(128 * kb, 128 * (kb + 1))
            dots = b[e, :, ks].double() @ a[r, ks].double()  # (N,)
            scales = sb[e, :, kb].double().repeat_interleave(128)[:n] * float(sa[r, kb])
            out[r] += scales * dots
    return out


def test_reference_matches_a_naive_loop():
    case = suite_module._case(3, 256, 384, counts=(5, 0, 130), tail=128)
    inputs = _inputs(case, seed=3)
    got = gemm_fp8_grouped_ref(*_args(inputs))
    want = _naive_ref(*_args(inputs))
    assert got.dtype == torch.float32
    assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6)
    assert float(want.abs().max()) > 1  # not a trivially small product
    assert not got[inputs["m_indices"] < 0].any()


def test_reference_follows_the_indices_not_the_row_order():
    inputs = _inputs(SMALL[1], seed=4)
    a, b, sa, sb, idx = _args(inputs)
    perm = torch.randperm(a.shape[0], generator=torch.Generator().manual_seed(5))
    got = gemm_fp8_grouped_ref(a[perm], b, sa[perm], sb, idx[perm])
    assert torch.equal(got, gemm_fp8_grouped_ref(a, b, sa, sb, idx)[perm])
    with pytest.raises(ValueError, match="m_indices holds 4"):
        gemm_fp8_grouped_ref(a, b, sa, sb, torch.full_like(idx, 4))


@pytest.mark.parametrize("case", SUITE.check_cases + tuple(SUITE.sanitize_cases), ids=str)
def test_suite_layout(case):
    p = case.params
    idx = suite_module.m_indices_for(p)
    counts = suite_module.expert_counts(p)
    assert idx.dtype == torch.int32 and idx.numel() == suite_module.total_rows(p)
    assert idx.numel() % 128 == 0 and len(counts) == p["experts"]
    row = 0
    for e, c in enumerate(counts):
        seg = idx[row : row + -(-c // 128) * 128]
        assert bool((seg[:c] == e).all() and (seg[c:] == -1).all())
        row += seg.numel()
    assert bool((idx[row:] == -1).all()) and idx.numel() - row == p.get("tail", 0)


def test_suite_cases_cover_the_layout():
    checks = [c.params for c in SUITE.check_cases]
    assert {p["experts"] for p in checks} >= {2, 8} and all(2 <= p["experts"] <= 8 for p in checks)
    assert min(p["n"] for p in checks) == 256 and max(p["n"] for p in checks) == 4096
    assert min(p["k"] for p in checks) == 128 and max(p["k"] for p in checks) == 7168
    assert any(0 in p["counts"] for p in checks) and any(p.get("tail") for p in checks)
    assert any(c % 128 for p in checks for c in p["counts"])  # partial segments: padding rows
    assert any(p["n"] % 192 for p in checks)  # the wide tile's ragged N edge
    assert set(SUITE.dtypes) == {torch.bfloat16, torch.float16}
    benches = [c.params for c in SUITE.bench_cases]
    assert {p["experts"] for p in benches} >= {8, 32, 256}
    assert {(p["n"], p["k"]) for p in benches} >= {(4096, 7168), (7168, 2048)}
    assert len({c.name for c in SUITE.bench_cases + SUITE.check_cases}) == len(benches) + len(
        checks
    )
    for p in checks + benches:
        assert p["n"] % 128 == 0 and p["k"] % 128 == 0


def test_skewed_counts_spread_around_their_mean():
    p = {"experts": 32, "tokens": 512, "skew": 0.75}
    counts = suite_module.expert_counts(p)
    assert min(counts) >= 128 and max(counts) <= 896 and len(set(counts)) == 32
    assert abs(sum(counts) / 32 - 512) < 40
    assert suite_module.flops(suite_module._case(32, 256, 128, tokens=512, skew=0.75)) == (
        2.0 * sum(counts) * 256 * 128
    )


def test_suite_inputs_follow_their_source():
    inputs = _inputs(SMALL[1], seed=6)
    a, b, sa, sb, idx = _args(inputs)
    assert a.dtype == b.dtype == F8 and b.shape == (4, 640, 256) and sb.shape == (4, 5, 2)
    assert sa.shape == (a.shape[0], 2) and bool((sa > 0).all() and (sb > 0).all())
    assert torch.equal(inputs["padding"], (idx < 0).nonzero().squeeze(1))
    assert bool((a.float() != 0).any(dim=1).all())  # padding rows are data too, never zeros
    # every 128x128 block of every expert scaled to use the e4m3 range
    blocks = b.float().view(4, 5, 128, 2, 128).abs().amax(dim=(2, 4))
    assert float(blocks.min()) >= 240 and float(blocks.max()) <= 448


def test_suite_check_ignores_padding_and_catches_unwritten_rows(stand_in):
    inputs = _inputs(SMALL[1])
    out, cmps = verify(SUITE, inputs, CPU)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    assert not out[inputs["m_indices"] < 0].any()  # zeroed, as in the reference

    def skips_a_real_row(inp, o):
        SUITE.run_ours(inp, o)
        o[int((inp["m_indices"] >= 0).nonzero()[-1])] = float("nan")
        return o

    _, cmps = verify(SUITE, inputs, CPU, run=skips_a_real_row)
    assert not cmps[0].ok and "NaN" in cmps[0].message


def test_suite_is_registered_and_has_no_comparator_on_the_cpu():
    assert SUITE_MODULES["gemm_fp8_grouped"] == suite_module.__name__
    assert "gemm_fp8_grouped" not in PENDING_SUITE_MODULES
    assert SUITE.name == "gemm_fp8_grouped" and SUITE.sanitize_cases
    if not torch.cuda.is_available():
        assert SUITE.comparators() == {"deepgemm": None}
    assert SUITE.variants_for(SUITE.bench_cases[0]) == {}  # band6 dropped, band8 the standard


@pytest.mark.parametrize("case", SMALL[:2], ids=lambda c: c.name)
def test_the_op_walks_bands_of_8_and_a_forced_walk_reaches_the_kernel(stand_in, case):
    """The suite's run (the op) launches GROUPED: LARGE_MCAST_A's tile walked in bands of 8
    cluster columns (adopted 2026-12-03); the launcher's `config=` launches the walk it is
    given (M first here), the rest of the key as GROUPED's, and both pass the suite's check."""
    inputs = _inputs(case)
    _, cmps = verify(SUITE, inputs, CPU)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    params, clusters = stand_in[-1]
    assert params == dict(params_for("bfloat16", GROUPED, True)) and params["swizzle"] == 8
    assert clusters == 66
    m_first = dataclasses.replace(GROUPED, swizzle=1)

    def forced(inp, out):
        fp8_sm90.gemm_fp8_grouped(*_args(inp), out, config=m_first)
        return suite_module._zero_padding(inp, out)

    _, cmps = verify(SUITE, inputs, CPU, run=forced)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    params, clusters = stand_in[-1]
    assert params == dict(params_for("bfloat16", m_first, True)) and params["swizzle"] == 1
    assert clusters == 66


def _fake_inputs():
    cuda = {"device": "cuda"}
    a = torch.empty(384, 256, dtype=F8, **cuda)
    b = torch.empty(3, 640, 256, dtype=F8, **cuda)
    sa, sb = torch.empty(384, 2, **cuda), torch.empty(3, 5, 2, **cuda)
    return a, b, sa, sb, torch.empty(384, dtype=torch.int32, **cuda)


def test_custom_op_fake_under_make_fx():
    with FakeTensorMode():
        c = op_module.gemm_fp8_grouped(*_fake_inputs(), out_dtype=torch.float16)
        assert c.shape == (384, 640) and c.dtype == torch.float16 and c.device.type == "cuda"
    with FakeTensorMode(allow_non_fake_inputs=True):
        f = lambda *x: op_module.gemm_fp8_grouped(*x) * 2  # noqa: E731
        graph = str(make_fx(f, tracing_mode="fake")(*_fake_inputs()).graph)
    assert "forgekernel.gemm_fp8_grouped" in graph


def test_suite_f4_variant_forces_the_scales_four_ahead(monkeypatch):
    """`f4` (one case a group) runs the leaf's launcher with GROUPED's scales four k-tiles
    ahead; the other cases time no variant."""
    import forgekernel.kernels.gemm.fp8.sm90.launch as leaf
    from forgekernel.kernels.gemm.fp8.sm90.config import GROUPED

    timed = [c for c in suite_module.BENCH_CASES if suite_module.variants(c)]
    assert len(timed) == 6 and len({c.group for c in timed}) == 5
    seen = {}

    def fake(a, b, sa, sb, idx, out, config=None):
        seen["config"] = config
        out.fill_(1)

    monkeypatch.setattr(leaf, "gemm_fp8_grouped", fake)
    case = suite_module._case(3, 256, 256, counts=(0, 5, 128), tail=128)
    inputs = suite_module.make_inputs(
        case, torch.bfloat16, torch.device("cpu"), torch.Generator().manual_seed(0)
    )
    out = suite_module.variants(timed[0])["f4"](inputs, None)
    assert seen["config"] == dataclasses.replace(GROUPED, scale_ahead=4)
    padding = inputs["padding"]
    assert (out[padding] == 0).all() and out.sum() == out.numel() - padding.numel() * out.shape[1]
