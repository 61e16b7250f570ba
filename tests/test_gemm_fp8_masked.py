"""forgekernel's masked grouped (MoE decode) FP8 GEMM on the CPU: the tile walk's model (every
counted tile exactly once, balanced over the CTAs), the op and the real launcher through a
stand-in kernel that writes what the compiled one would (tile by tile in the walk's order, the
counted rows only), argument errors, the fp64 reference against a naive loop, the chooser and
compile keys, the suite (its cases, inputs and check, per-expert outputs), the custom ops'
fake implementations under make_fx. The device code itself: tests/test_gemm_fp8_masked_dsl.py."""

from __future__ import annotations

import importlib
import random

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.bench.check import verify
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES
from forgekernel.bench.suites import gemm_fp8_masked as suite_module
from forgekernel.kernels.gemm.dense.sm90 import MASKED_SPEC, masked_config
from forgekernel.kernels.gemm.dense.sm90 import launch as dense_launch
from forgekernel.reference.gemm import gemm_fp8_masked_ref, gemm_fp8_ref

F8 = torch.float8_e4m3fn
CPU = torch.device("cpu")
op_module = importlib.import_module("forgekernel.ops.gemm_fp8_grouped_masked")
SUITE = suite_module.suite()


def walk(counts, max_m, tiles_n, h, ctas):
    """masked.py's MaskedWalk in Python: each CTA's (expert, m-tile, n-tile, rows) in order."""
    experts = len(counts)

    def rows_of(e):
        return max(0, min(counts[min(e, experts - 1)], max_m))

    def seek(work, e, before, rows):
        while e < experts and work >= before + -(-rows // h) * tiles_n:
            before += -(-rows // h) * tiles_n
            e += 1
            rows = rows_of(e)
        return e, before, rows

    order = []
    for cta in range(ctas):
        work = cta
        e, before, rows = seek(work, 0, 0, rows_of(0))
        tiles = []
        while e < experts:
            m_tiles = -(-rows // h)
            n, m = divmod(work - before, m_tiles)
            tiles.append((e, m, n, min(rows - m * h, h)))
            work += ctas
            e, before, rows = seek(work, e, before, rows)
        order.append(tiles)
    return order


@pytest.mark.parametrize("seed", range(6))
def test_walk_covers_every_counted_tile_once_and_balances(seed):
    rng = random.Random(seed)
    experts, max_m, h = rng.randint(1, 40), rng.randint(1, 300), rng.choice((8, 16, 32, 64, 128))
    counts = [rng.choice((0, rng.randint(0, max_m), max_m, max_m + 5, -3)) for _ in range(experts)]
    tiles_n, ctas = rng.randint(1, 9), rng.choice((1, 7, 132))
    order = walk(counts, max_m, tiles_n, h, ctas)
    seen = [t for tiles in order for t in tiles]
    want = {
        (e, m, n)
        for e, c in enumerate(counts)
        for m in range(-(-max(0, min(c, max_m)) // h))
        for n in range(tiles_n)
    }
    assert sorted((e, m, n) for e, m, n, _ in seen) == sorted(want)
    for e, m, _, rows in seen:
        assert 0 < rows <= h and m * h + rows == min(max(0, min(counts[e], max_m)), (m + 1) * h)
    sizes = [len(t) for t in order]
    assert max(sizes) - min(sizes) <= 1  # round robin over the counted tiles only
    for tiles in order:  # each CTA's m-tiles of one n-tile side by side: a CTA moves forward
        assert tiles == sorted(tiles, key=lambda t: (t[0], t[2], t[1]))


def _inputs(case, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return suite_module.make_inputs(case, dtype, CPU, gen)


def _args(inputs):
    return tuple(inputs[x] for x in ("a", "b", "sa", "sb", "masked_m"))


@pytest.fixture
def stand_in(monkeypatch):
    """The compiled kernel replaced by one that writes, tile by tile in the walk's order over
    a 132-CTA grid, the reference's counted rows of each tile; each call's (params, clusters,
    CTAs' tiles) recorded."""
    calls = []

    def get_kernel(spec, params):
        assert spec is MASKED_SPEC
        cfg = masked_config.GemmConfig.from_params(
            {k: v for k, v in dict(params).items() if k != "out"}
        )

        def fn(a, b, c, work, flags, per, sa, sb, masked_m, clusters):
            assert work is None and flags is None and per == 0
            max_m, k, experts = a.shape
            n = c.shape[1]
            assert a.stride(1) == b.stride(1) == c.stride(1) == 1  # (rows, cols, E), cols unit
            assert b.shape == (n, k, experts) and c.shape == (max_m, n, experts)
            assert sa.shape == (max_m, k // 128, experts)
            assert sb.shape == (n // 128, k // 128, experts)
            assert masked_m.dtype == torch.int32 and masked_m.is_contiguous()
            h = masked_config.rows_per_tile(cfg)
            order = walk(masked_m.tolist(), max_m, -(-n // cfg.tile_n), h, clusters)
            full = {}  # each expert's product, computed once
            for e, m, t, rows in (x for tiles in order for x in tiles):
                if e not in full:
                    full[e] = gemm_fp8_ref(a[..., e], b[..., e], sa[..., e], sb[..., e])
                r, cols = slice(m * h, m * h + rows), slice(t * cfg.tile_n, (t + 1) * cfg.tile_n)
                c[r, cols, e] = full[e][r, cols].to(c.dtype)
            calls.append((dict(params), clusters, order))

        return fn

    monkeypatch.setattr(op_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(dense_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(dense_launch, "num_sms", lambda device: 132)
    return calls


def _counted(counts, max_m):
    """Mask (E, max_m) of the counted rows."""
    return torch.arange(max_m)[None, :] < torch.tensor(counts)[:, None]


@pytest.mark.parametrize("case", SUITE.check_cases, ids=lambda c: c.name)
def test_op_writes_the_counted_rows_and_leaves_the_others(stand_in, case):
    inputs = _inputs(case)
    args = _args(inputs)
    e, max_m, _ = inputs["a"].shape
    out = torch.full((e, max_m, inputs["b"].shape[1]), 7.0, dtype=torch.bfloat16)
    got = op_module.gemm_fp8_grouped_masked(*args, inputs["expected_m"], out=out)
    counted = _counted(inputs["counts"], max_m)
    want = gemm_fp8_masked_ref(*args).to(torch.bfloat16)
    assert got is out
    assert torch.equal(out[counted], want[counted])
    assert bool((out[~counted] == 7).all())
    params, clusters, _ = stand_in[-1]
    assert clusters == 132 and params["out"] == "bfloat16"
    cfg = masked_config.choose_config(inputs["expected_m"])
    assert params == dict(masked_config.params_for("bfloat16", cfg))


def test_fresh_output_and_fp16(stand_in):
    inputs = _inputs(SUITE.check_cases[3], torch.float16, seed=2)
    c = op_module.gemm_fp8_grouped_masked(*_args(inputs), 32, out_dtype=torch.float16)
    counted = _counted(inputs["counts"], c.shape[1])
    want = gemm_fp8_masked_ref(*_args(inputs)).to(torch.float16)
    assert c.dtype == torch.float16 and c.shape == want.shape
    assert torch.equal(c[counted], want[counted])


def test_expected_m_picks_the_tile_not_the_rows(stand_in):
    """Counts far above expected_m take several m-tiles of A's short box; the same rows."""
    case = suite_module._case(3, 256, 256, counts=(200, 0, 65), max_m=200, expected_m=128)
    inputs = _inputs(case, seed=3)
    counted = _counted(inputs["counts"], 200)
    results = []
    for expected in (1, 9, 20, 64, 128, 1000):
        results.append(op_module.gemm_fp8_grouped_masked(*_args(inputs), expected)[counted])
        params, _, order = stand_in[-1]
        h = params["a_rows"] or params["tile_m"]
        assert h == masked_config.rows_per_tile(masked_config.choose_config(expected))
        assert sum(map(len, order)) == (-(-200 // h) + -(-65 // h)) * 2
    assert all(torch.equal(r, results[0]) for r in results)


def test_out_views_tma_cannot_address_keep_their_other_rows(stand_in):
    """An `out` whose rows are not 16-byte strided: a copy in, the kernel, a copy back (the
    rows past the counts come back as they were); a strided masked_m is read contiguous."""
    inputs = _inputs(SUITE.check_cases[2], seed=4)
    a, b, sa, sb, masked_m = _args(inputs)
    e, max_m, _ = a.shape
    n = b.shape[1]
    wide = torch.full((e, max_m, n + 3), 5.0, dtype=torch.bfloat16)
    out = wide[:, :, 1 : n + 1]
    strided = torch.stack([masked_m, masked_m + 1], dim=1)[:, 0]
    got = op_module.gemm_fp8_grouped_masked(a, b, sa, sb, strided, 16, out=out)
    counted = _counted(inputs["counts"], max_m)
    assert got is out
    assert torch.equal(out[counted], gemm_fp8_masked_ref(*_args(inputs)).to(out.dtype)[counted])
    assert bool((out[~counted] == 5).all() and (wide[..., 0] == 5).all())
    assert bool((wide[..., -2:] == 5).all())


def test_launcher_hands_the_operands_over_without_copies(monkeypatch):
    seen = {}

    def get_kernel(spec, params):
        return lambda *args: seen.update(args=args)

    monkeypatch.setattr(dense_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(dense_launch, "num_sms", lambda device: 132)
    inputs = _inputs(SUITE.check_cases[1])
    a, b, sa, sb, masked_m = _args(inputs)
    out = torch.empty(*a.shape[:2], b.shape[1], dtype=torch.bfloat16)
    dense_launch.gemm_fp8_masked(a, b, sa, sb, masked_m, 8, out)
    ka, kb, kc, _, _, _, ksa, ksb, km, clusters = seen["args"]
    for given, passed in ((a, ka), (b, kb), (out, kc), (sa, ksa), (sb, ksb)):
        assert passed.data_ptr() == given.data_ptr()
        assert passed.shape == given.permute(1, 2, 0).shape
    assert km is masked_m and clusters == 132


def test_no_rows_launches_nothing(stand_in):
    a, sa = torch.zeros(2, 0, 256, dtype=F8), torch.zeros(2, 0, 2)
    b, sb = torch.ones(2, 128, 256).to(F8), torch.ones(2, 1, 2)
    c = op_module.gemm_fp8_grouped_masked(a, b, sa, sb, torch.zeros(2, dtype=torch.int32), 4)
    assert c.shape == (2, 0, 128) and not stand_in


def _bad(**kw):
    e, m, n, k = kw.pop("e", 2), kw.pop("m", 16), kw.pop("n", 256), kw.pop("k", 256)
    args = {
        "a": torch.zeros(e, m, k, dtype=F8),
        "b": torch.zeros(e, n, k, dtype=F8),
        "sa": torch.ones(e, m, k // 128),
        "sb": torch.ones(e, n // 128, k // 128),
        "counts": torch.zeros(e, dtype=torch.int32),
        "expected_m": 8,
        "out_dtype": torch.bfloat16,
        "out": None,
    }
    args.update(kw)
    return args


@pytest.mark.parametrize(
    ("args", "err", "match"),
    [
        (_bad(a=torch.zeros(2, 16, 256)), TypeError, "a must have dtype"),
        (_bad(a=torch.zeros(32, 256, dtype=F8)), ValueError, "a must be 3-D"),
        (_bad(b=torch.zeros(256, 256, dtype=F8)), ValueError, "b must be 3-D"),
        (_bad(b=torch.zeros(2, 256, 384, dtype=F8)), ValueError, "E or K mismatch"),
        (_bad(b=torch.zeros(3, 256, 256, dtype=F8)), ValueError, "E or K mismatch"),
        (_bad(e=0), ValueError, "at least one expert"),
        (_bad(k=200), ValueError, "K must be a positive multiple of 128"),
        (_bad(n=200), ValueError, "N must be a positive multiple of 128"),
        (_bad(expected_m=0), TypeError, "expected_m must be a positive int"),
        (_bad(expected_m=8.0), TypeError, "expected_m must be a positive int"),
        (_bad(expected_m=True), TypeError, "expected_m must be a positive int"),
        (_bad(expected_m=torch.tensor(8)), TypeError, "expected_m must be a positive int"),
        (_bad(sa=torch.ones(2, 16, 3)), ValueError, "scale_a must have shape"),
        (_bad(sa=torch.ones(2, 16, 2, dtype=torch.float64)), TypeError, "scale_a must have dtype"),
        (_bad(sb=torch.ones(2, 2, 2, dtype=torch.float16)), TypeError, "scale_b must have dtype"),
        (_bad(sb=torch.ones(1, 2, 2)), ValueError, "scale_b must have shape"),
        (_bad(counts=torch.zeros(2, dtype=torch.int64)), TypeError, "masked_m must have dtype"),
        (_bad(counts=torch.zeros(3, dtype=torch.int32)), ValueError, "masked_m must have shape"),
        (_bad(out_dtype=torch.float32), TypeError, "out_dtype"),
        (_bad(out=torch.zeros(2, 16, 255, dtype=torch.bfloat16)), ValueError, "out must have"),
        (_bad(out=torch.zeros(2, 16, 256, dtype=torch.float16)), TypeError, "out must have dtype"),
    ],
)
def test_bad_arguments_name_the_argument(args, err, match):
    with pytest.raises(err, match=match):
        op_module.gemm_fp8_grouped_masked(
            args["a"], args["b"], args["sa"], args["sb"], args["counts"], args["expected_m"],
            out_dtype=args["out_dtype"], out=args["out"],
        )  # fmt: skip


def test_cpu_tensors_and_mixed_devices_are_refused():
    args = _bad()
    with pytest.raises(ValueError, match="a must be a CUDA tensor"):
        op_module.gemm_fp8_grouped_masked(
            args["a"], args["b"], args["sa"], args["sb"], args["counts"], 8
        )
    with FakeTensorMode(allow_non_fake_inputs=True):
        a, b, sa, sb, _ = _fake_inputs()
        with pytest.raises(ValueError, match="masked_m is on cpu"):
            op_module.gemm_fp8_grouped_masked(a, b, sa, sb, torch.zeros(3, dtype=torch.int32), 8)


def _naive_ref(a, b, sa, sb, counts):
    """Row by row, block of K by block: sum over k-blocks of sa * sb * (a . b), in fp64."""
    experts, max_m, k = a.shape
    n = b.shape[1]
    out = torch.full((experts, max_m, n), float("nan"), dtype=torch.float64)
    for e, c in enumerate(counts):
        for r in range(c):
            acc = torch.zeros(n, dtype=torch.float64)
            for kb in range(k // 128):
                ks = slice(128 * kb, 128 * (kb + 1))
                dots = b[e, :, ks].double() @ a[e, r, ks].double()
                acc += sb[e, :, kb].double().repeat_interleave(128) * float(sa[e, r, kb]) * dots
            out[e, r] = acc
    return out


def test_reference_matches_a_naive_loop_and_marks_the_other_rows():
    case = suite_module._case(3, 256, 384, counts=(5, 0, 7), max_m=9)
    inputs = _inputs(case, seed=5)
    got = gemm_fp8_masked_ref(*_args(inputs))
    want = _naive_ref(*_args(inputs)[:4], inputs["counts"])
    counted = _counted(inputs["counts"], 9)
    assert got.dtype == torch.float32 and got.shape == (3, 9, 256)
    assert torch.allclose(got[counted].double(), want[counted], rtol=1e-6, atol=1e-6)
    assert float(want[counted].abs().max()) > 1  # not a trivially small product
    assert bool(got[~counted].isnan().all())
    zeros = gemm_fp8_masked_ref(*_args(inputs), unwritten=0.0)
    assert not zeros[~counted].any() and torch.equal(zeros[counted], got[counted])
    for bad in ((5, 0, 10), (-1, 0, 0)):
        with pytest.raises(ValueError, match="outside"):
            gemm_fp8_masked_ref(*_args(inputs)[:4], torch.tensor(bad, dtype=torch.int32))


def test_chooser_and_compile_keys():
    cfgs = masked_config.STANDARD_CONFIGS
    rows = [masked_config.rows_per_tile(c) for c in cfgs]
    assert rows == [8, 16, 32, 64, 128]
    for expected in range(1, 300):
        cfg = masked_config.choose_config(expected)
        want = next((r for r in rows if masked_config.COVER * expected <= r), 128)
        assert masked_config.rows_per_tile(cfg) == want
    for cfg in cfgs:
        assert (cfg.tile_n, cfg.tile_k, cfg.cluster_m, cfg.cluster_n) == (128, 128, 1, 1)
        assert not cfg.stream_k
    params = MASKED_SPEC.standard_params()
    assert len(set(params)) == len(params) == len(cfgs) * len(masked_config.OUT_DTYPES)


def test_suite_cases_cover_the_layout():
    checks = [c.params for c in SUITE.check_cases]
    tiles = {masked_config.choose_config(suite_module.expected_rows(p)) for p in checks}
    assert tiles == set(masked_config.STANDARD_CONFIGS)  # every tile checked
    assert any(0 in p["counts"] for p in checks) and any(not any(p["counts"]) for p in checks)
    assert any(p["max_m"] in p["counts"] for p in checks)
    assert any(p["max_m"] % 8 for p in checks)
    several = [p for p in checks if max(p["counts"]) > 2 * suite_module.expected_rows(p)]
    assert several  # experts with several m-tiles
    assert min(p["k"] for p in checks) == 128 and max(p["k"] for p in checks) == 7168
    benches = [c.params for c in SUITE.bench_cases]
    assert {p["experts"] for p in benches} == {32, 256}
    assert {(p["n"], p["k"]) for p in benches} == {(4096, 7168), (7168, 2048)}
    for p in benches:
        counts = suite_module.expert_counts(p)
        assert min(counts) >= 1 and max(counts) <= 256 and len(set(counts)) > 1  # imbalanced
        assert suite_module.max_rows(p) % 64 == 0 and suite_module.max_rows(p) >= max(counts)
        assert abs(sum(counts) / len(counts) - p["tokens"]) <= 0.35 * p["tokens"] + 1
    assert max(max(suite_module.expert_counts(p)) for p in benches) > 128
    names = [c.name for c in SUITE.bench_cases + SUITE.check_cases]
    assert len(set(names)) == len(names)
    assert set(SUITE.dtypes) == {torch.bfloat16, torch.float16}


def test_suite_counts_are_drawn_the_same_everywhere():
    p = SUITE.bench_cases[1].params
    assert suite_module.expert_counts(p) == suite_module.expert_counts(dict(p))
    assert suite_module.expert_counts(p) != suite_module.expert_counts({**p, "tokens": 9})


def test_suite_inputs_follow_their_source():
    inputs = _inputs(SUITE.check_cases[2], seed=6)
    a, b, sa, sb, masked_m = _args(inputs)
    assert a.dtype == b.dtype == F8 and a.shape == (4, 64, 1024) and b.shape == (4, 384, 1024)
    assert sa.shape == (4, 64, 8) and sb.shape == (4, 3, 8)
    assert masked_m.tolist() == inputs["counts"] == [16, 0, 9, 64]
    counted = _counted(inputs["counts"], 64)
    assert bool(a.float()[~counted].isnan().all() and sa[~counted].isnan().all())
    assert bool((sa[counted] > 0).all() and (sb > 0).all() and not a.float()[counted].isnan().any())
    blocks = b.float().view(4, 3, 128, 8, 128).abs().amax(dim=(2, 4))
    assert float(blocks.min()) >= 240 and float(blocks.max()) <= 448


def test_suite_outputs_are_the_counted_rows(stand_in):
    inputs = _inputs(SUITE.check_cases[1])
    out, cmps = verify(SUITE, inputs, CPU)
    assert len(out) == len(cmps) == 3 and all(c.ok for c in cmps), [c.message for c in cmps]
    full = suite_module.full_output(out)
    assert [o.shape[0] for o in out] == [0, 5, 37] and full.shape == (3, 37, 256)
    assert all(o.data_ptr() == full[e].data_ptr() for e, o in enumerate(out) if o.numel())

    def skips_a_row(inp, o):
        SUITE.run_ours(inp, o)
        o[2][-1] = float("nan")
        return o

    _, cmps = verify(SUITE, inputs, CPU, run=skips_a_row)
    assert not cmps[2].ok and "NaN" in cmps[2].message


def test_suite_variants_through_the_launcher(stand_in):
    small = suite_module._case(3, 256, 128, counts=(3, 40, 1), max_m=64, expected_m=3)
    variants = SUITE.variants_for(small)
    assert set(variants) == {"rows16"}  # the chooser's: 8 (2 x 3 rows), its one neighbour
    chosen = suite_module._case(2, 128, 128, counts=(1, 2), expected_m=64)
    assert set(SUITE.variants_for(chosen)) == {"rows64"}  # the chooser's: 128
    middle = suite_module._case(2, 128, 128, counts=(1, 2), expected_m=9)
    assert set(SUITE.variants_for(middle)) == {"rows16", "rows64"}  # the chooser's: 32
    inputs = _inputs(small)
    for name, run in variants.items():
        _, cmps = verify(SUITE, inputs, CPU, run=run)
        assert all(c.ok for c in cmps), name
        params = stand_in[-1][0]
        assert (params["a_rows"] or params["tile_m"]) == int(name.removeprefix("rows"))


@pytest.mark.parametrize("case", SUITE.bench_cases, ids=lambda c: c.name)
def test_suite_work_counts(case):
    p = case.params
    tokens = sum(suite_module.expert_counts(p))
    assert suite_module.flops(case) == 2.0 * tokens * p["n"] * p["k"]
    weights = p["experts"] * p["n"] * p["k"]
    assert weights < suite_module.nbytes(case, torch.bfloat16) < 1.1 * weights


def test_suite_is_registered_and_has_no_comparator_on_the_cpu():
    assert SUITE_MODULES["gemm_fp8_masked"] == suite_module.__name__
    assert "gemm_fp8_masked" not in PENDING_SUITE_MODULES
    assert SUITE.name == "gemm_fp8_masked" and SUITE.sanitize_cases and SUITE.memory_bound
    if not torch.cuda.is_available():
        assert SUITE.comparators() == {"deepgemm": None}
    assert list(SUITE.kernel_sources) == list(MASKED_SPEC.sources)


def _fake_inputs():
    cuda = {"device": "cuda"}
    a = torch.empty(3, 40, 256, dtype=F8, **cuda)
    b = torch.empty(3, 640, 256, dtype=F8, **cuda)
    sa, sb = torch.empty(3, 40, 2, **cuda), torch.empty(3, 5, 2, **cuda)
    return a, b, sa, sb, torch.empty(3, dtype=torch.int32, **cuda)


def test_custom_ops_fake_under_make_fx():
    with FakeTensorMode():
        c = op_module.gemm_fp8_grouped_masked(*_fake_inputs(), 8, out_dtype=torch.float16)
        assert c.shape == (3, 40, 640) and c.dtype == torch.float16 and c.device.type == "cuda"
    with FakeTensorMode(allow_non_fake_inputs=True):
        f = lambda *x: op_module.gemm_fp8_grouped_masked(*x, 8) * 2  # noqa: E731
        graph = str(make_fx(f, tracing_mode="fake")(*_fake_inputs()).graph)
        assert "forgekernel.gemm_fp8_grouped_masked.default" in graph

        def g(*x):
            out = torch.zeros(3, 40, 640, dtype=torch.bfloat16, device="cuda")
            return op_module.gemm_fp8_grouped_masked(*x, 8, out=out) + 1

        graph = str(make_fx(g, tracing_mode="fake")(*_fake_inputs()).graph)
        assert "forgekernel.gemm_fp8_grouped_masked_out" in graph
