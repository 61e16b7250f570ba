"""GEMM torch layer and host launcher on the CPU: every bad input raises a clear error before
any kernel runs, the launcher hands the compiled function TMA-ready operands, the analytical
config and the cluster count, and the reference is the spec."""

import contextlib
import dataclasses
import importlib

import pytest
import torch

import forgekernel
from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_sm90
from forgekernel.kernels.gemm.dense.sm90.config import choose_config, params_for
from forgekernel.reference.gemm import gemm_ref
from forgekernel.runtime.device import on_device, tma_ready

gemm_module = importlib.import_module("forgekernel.ops.gemm")


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


@pytest.mark.parametrize(
    "a, b, kwargs, exc, words",
    [
        (torch.randn(16, 32), torch.randn(24, 32), {}, TypeError, "a must have dtype"),
        (bf16(16, 32), torch.randn(24, 32).half(), {}, TypeError, "b has dtype"),
        (bf16(2, 16, 32), bf16(24, 32), {}, ValueError, "a must be 2-D"),
        (bf16(16, 32), bf16(24, 40), {}, ValueError, "K mismatch (32 vs 40)"),
        (bf16(16, 36), bf16(20, 36), {}, ValueError, "a must be a CUDA tensor"),  # odd N, K
        (bf16(16, 32), bf16(24, 32), {"b_layout": "t"}, ValueError, "b_layout must be"),
        (bf16(16, 32), bf16(24, 32), {"out": bf16(16, 16)}, ValueError, "out must have shape"),
        (bf16(16, 32), bf16(24, 32), {}, ValueError, "a must be a CUDA tensor"),
        ([[1.0]], bf16(24, 32), {}, TypeError, "a must be a torch.Tensor"),
    ],
)
def test_bad_inputs_raise(a, b, kwargs, exc, words):
    with pytest.raises(exc) as info:
        forgekernel.gemm(a, b, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("m, n, k", [(1, 8, 8), (7, 24, 40), (129, 264, 520)])
def test_reference_matches_float64(m, n, k):
    a, b = bf16(m, k), bf16(n, k)
    want = a.double() @ b.double().t()
    assert torch.allclose(gemm_ref(a, b).double(), want, rtol=1e-5, atol=1e-4)
    assert torch.allclose(
        gemm_ref(a, b.t().contiguous(), "kn").double(), want, rtol=1e-5, atol=1e-4
    )


class Launches(list):
    operands: tuple = ()


@pytest.fixture
def cpu_kernel(monkeypatch, tmp_path):
    """The eager path on the CPU: no device check, 132 SMs, no tuning records, and as the
    compiled function the reference, which insists on what the compiled one does (TMA-ready
    operands, N and K multiples of 8; swapped: the output's transposed view) and records
    (params, max_clusters) per launch, and the operands of the last one, as the launcher's
    (A, B, C) before any swap, in `calls.operands`."""
    calls = Launches()

    def get_kernel(spec, params):
        swap = dict(params).get("swap", False)

        def fn(a, b, c, work, flags, per_cta, sfa, sfb, group, max_clusters):
            # swapped: C^T = B A^T, C the (N, M) transpose of a row-major (M, N) buffer
            row_major_c = c.t() if swap else c
            assert all(tma_ready(t) for t in (a, b, row_major_c))
            assert row_major_c.shape[1] % 8 == 0 and a.shape[1] % 8 == 0
            c.copy_(gemm_ref(a, b, "kn" if dict(params)["b_kn"] else "nk"))
            calls.append((params, max_clusters))
            calls.operands = (b, a, c.t()) if swap else (a, b, c)  # the launcher's A, B, C

        return fn

    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    gemm_sm90.tuning.load.cache_clear()
    monkeypatch.setattr(gemm_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(gemm_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(gemm_sm90, "_plans", gemm_sm90._Plans())  # plans hold their kernels
    monkeypatch.setattr(gemm_sm90, "num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    yield calls
    gemm_sm90.tuning.load.cache_clear()


@pytest.mark.parametrize("m, n, k", [(1, 8, 8), (7, 24, 40), (300, 264, 520)])
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_eager_path_launches_the_analytical_config(cpu_kernel, m, n, k, b_layout):
    a = bf16(m, k)
    b = bf16(n, k) if b_layout == "nk" else bf16(k, n)
    c = forgekernel.gemm(a, b, b_layout=b_layout)
    torch.testing.assert_close(c, gemm_ref(a, b, b_layout).to(c.dtype), rtol=0, atol=0)
    cfg = choose_config(m, n, k, 132, b_kn=b_layout == "kn")
    want = params_for("bfloat16", b_layout == "kn", cfg)
    assert cpu_kernel == [(want, 132 // (cfg.cluster_m * cfg.cluster_n))]


def test_strided_operands_and_out_are_copied(cpu_kernel):
    a = bf16(40, 7).t()  # (7, 40), column-major
    b = bf16(24, 80)[:, ::2]  # (24, 40), strided last dim
    out = bf16(7, 48)[:, ::2]  # (7, 24) view with a strided last dim
    assert forgekernel.gemm(a, b, out=out) is out
    torch.testing.assert_close(out, gemm_ref(a, b).to(out.dtype), rtol=0, atol=0)
    assert len(cpu_kernel) == 1


def test_empty_problems_skip_the_kernel(cpu_kernel):
    assert forgekernel.gemm(bf16(0, 16), bf16(8, 16)).shape == (0, 8)
    c = forgekernel.gemm(bf16(5, 0), bf16(8, 0))  # K = 0: C is zeros
    assert c.shape == (5, 8) and torch.all(c == 0)
    assert cpu_kernel == []


def assert_rounded_from(c, want, mag=None):
    """c is the float result `want` rounded once to c's dtype (half an ulp, with a margin for
    the float sums' order: 1e-4, plus 2^-21 of sum |a_i b_i| when `mag` gives it: fp32 sums of
    4k terms blocked differently differ by ~1e-4 where want is small)."""
    err = (c.float() - want).abs()
    margin = 1e-4 if mag is None else 1e-4 + 2.0**-21 * mag
    assert torch.all(err <= torch.finfo(c.dtype).eps * want.abs() + margin), err.max()


def operands(m, n, k, b_layout, dtype):
    a = torch.randn(m, k).to(dtype)
    b = torch.randn(n, k).to(dtype)
    return a, (b if b_layout == "nk" else b.t().contiguous())


@pytest.mark.parametrize(
    "m, n, k",
    [(1, 1, 1), (1, 7, 9), (1000, 1, 4097), (1, 1001, 4097), (1000, 1001, 9), (1000, 7, 1)]
    + [(1000, 1001, 64), (1, 7, 4096), (1000, 64, 4097), (1, 8, 9)],  # one of N, K aligned
)
@pytest.mark.parametrize("b_layout", ["nk", "kn"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_any_n_and_k_run_padded(cpu_kernel, m, n, k, b_layout, dtype):
    """N or K not a multiple of 8: the kernel gets N and K rounded up to 8 (zero K columns in A
    and B, zero B rows) and C keeps its first N columns; the analytical config is the one of
    the problem as asked."""
    a, b = operands(m, n, k, b_layout, dtype)
    c = forgekernel.gemm(a, b, b_layout=b_layout)
    assert c.shape == (m, n) and c.dtype == dtype
    assert_rounded_from(c, gemm_ref(a, b, b_layout), gemm_ref(a.abs(), b.abs(), b_layout))
    cfg = choose_config(m, n, k, 132, b_kn=b_layout == "kn")
    want = params_for(str(dtype).removeprefix("torch."), b_layout == "kn", cfg)
    assert cpu_kernel == [(want, 132 // (cfg.cluster_m * cfg.cluster_n))]
    a_k, b_k, c_k = cpu_kernel.operands
    np_, kp = -(-n // 8) * 8, -(-k // 8) * 8
    assert a_k.shape == (m, kp) and c_k.shape == (m, np_)
    assert b_k.shape == ((np_, kp) if b_layout == "nk" else (kp, np_))
    b_nk = b_k if b_layout == "nk" else b_k.t()
    assert torch.all(a_k[:, k:] == 0) and torch.all(b_nk[:, k:] == 0) and torch.all(b_nk[n:] == 0)
    assert (a_k.data_ptr() == a.data_ptr()) == (k == kp)  # A is copied only for an odd K


@pytest.mark.parametrize("b_layout", ["nk", "kn"])
def test_padded_path_writes_into_strided_out(cpu_kernel, b_layout):
    a, b = operands(9, 7, 9, b_layout, torch.bfloat16)
    a = a.t().contiguous().t()  # (9, 9) column-major
    out = bf16(9, 14)[:, ::2]  # (9, 7) view with a strided last dim
    assert forgekernel.gemm(a, b, out=out, b_layout=b_layout) is out
    assert_rounded_from(out, gemm_ref(a, b, b_layout))


def test_aligned_problems_run_in_place(cpu_kernel):
    """N and K multiples of 8: the caller's tensors themselves reach the kernel (no padding,
    no copy)."""
    a, b, out = bf16(5, 16), bf16(24, 16), bf16(5, 24)
    forgekernel.gemm(a, b, out=out)
    assert [t.data_ptr() for t in cpu_kernel.operands] == [
        a.data_ptr(),
        b.data_ptr(),
        out.data_ptr(),
    ]


def test_weights_as_parameters_run_eager(cpu_kernel):
    """nn.Parameter is a plain tensor for the dispatch rule: no custom op, no autograd node
    (inference: no_grad)."""
    a, w = bf16(5, 16), torch.nn.Parameter(bf16(24, 16))
    with torch.no_grad():
        c = forgekernel.gemm(a, w)
    assert c.grad_fn is None and len(cpu_kernel) == 1
    assert [t.data_ptr() for t in cpu_kernel.operands[:2]] == [a.data_ptr(), w.data_ptr()]
    torch.testing.assert_close(c, gemm_ref(a, w).to(c.dtype), rtol=0, atol=0)


def test_calls_autograd_would_record_fail_loudly_in_backward(cpu_kernel):
    """The GEMM has no backward: with grad, the custom op (its backward raises) rather than a
    result that silently stops the gradient."""
    a, w = bf16(5, 16), torch.nn.Parameter(bf16(24, 16))
    c = forgekernel.gemm(a, w)
    torch.testing.assert_close(c, gemm_ref(a, w).to(c.dtype), rtol=0, atol=0)
    assert c.grad_fn is not None
    with pytest.raises(RuntimeError, match="no autograd formula"):
        c.float().sum().backward()


@pytest.mark.parametrize("current, enters", [(0, False), (1, True)])
def test_launchers_enter_a_device_only_when_it_is_not_current(monkeypatch, current, enters):
    """runtime.device.on_device: torch.cuda.device(d) only when d is not the current device
    (entering it costs microseconds per launch); CPU tensors (no index) never."""
    entered = []
    monkeypatch.setattr(torch.cuda, "current_device", lambda: current)
    monkeypatch.setattr(
        torch.cuda, "device", lambda d: entered.append(d) or contextlib.nullcontext()
    )
    with on_device(torch.device("cuda", 0)):
        pass
    with on_device(torch.device("cpu")):
        pass
    assert entered == ([torch.device("cuda", 0)] if enters else [])


@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize("n", [264, 261])  # 261: N padded to 264, C a scratch copied back
def test_the_swap_hands_the_kernel_the_transposed_problem(monkeypatch, cpu_kernel, m, n):
    """The swap (config `swap`, B "nk"): the kernel's A is the weight, its B the tokens, its C
    the output's (N, M) transpose with unit stride along the kernel's M and the output's row
    stride along its N (no copy); the result is the reference's."""
    from forgekernel.kernels.gemm.dense.sm90.config import SWAP

    seen = []
    real = gemm_sm90.kernel_operands
    monkeypatch.setattr(gemm_sm90, "kernel_operands", lambda *x: seen.append(real(*x)) or seen[-1])
    k = 520
    a, b = bf16(m, k), bf16(n, k)
    np_ = -(-n // 8) * 8
    for cfg in SWAP:
        out = torch.full((m, n), float("nan"), dtype=torch.bfloat16)
        forgekernel.gemm(a, b, out=out, config=cfg)
        torch.testing.assert_close(out, gemm_ref(a, b).to(out.dtype), rtol=0, atol=0)
        a_k, b_k, c_k = seen[-1]
        assert a_k.shape == (np_, k) and b_k.shape == (m, k)
        assert b_k.data_ptr() == a.data_ptr() and torch.all(a_k[n:] == 0)
        assert (a_k.data_ptr() == b.data_ptr()) == (n == np_)  # the weight padded to 8 rows
        assert c_k.shape == (np_, m) and c_k.stride() == (1, np_)
        assert (c_k.data_ptr() == out.data_ptr()) == (n == np_)  # written in place
        assert cpu_kernel[-1][0] == params_for("bfloat16", False, cfg)


@pytest.mark.parametrize("m", [129, 300, 777])
@pytest.mark.parametrize("n", [3584, 3581, 10240])
@pytest.mark.parametrize("k", [3584, 8192])
def test_swapped_stream_k_plans_the_kernels_problem(cpu_kernel, m, n, k):
    """Swapped stream K (refused after the H200's wrong output of 2026-12-02 18:47, whose cause
    was splitk.sum_parts: tests/test_splitk_host.py): the plan is over the problem the kernel
    sees, (N padded, M), so that its per, flags and workspace are the kernel's own (kernel.py
    `_stream_grid`: every tile a flag, every CTA of the grid two slots)."""
    from forgekernel.kernels.gemm.dense.sm90.config import SWAP_TALL_80, GemmConfig, split_for
    from forgekernel.kernels.gemm.dense.sm90.plan import grid_blocks, stream_grid

    np_, kp = -(-n // 8) * 8, -(-k // 8) * 8
    one = GemmConfig(tile_n=144, cluster_m=1, epi_n=16, swap=True, stream_k=True)
    swap_tall = dataclasses.replace(SWAP_TALL_80, stream_k=True)
    for cfg in (one, dataclasses.replace(one, cluster_m=2), swap_tall):
        _, max_clusters, split, swap = gemm_sm90._choose(torch.bfloat16, False, m, n, k, None, cfg)
        assert swap
        plan = split_for(cfg, np_, m, kp, 132)
        per, tiles, floats = split
        assert (per, tiles) == (plan.per, plan.tiles)
        tiles_m, tiles_n, blocks = grid_blocks(cfg, np_, m)  # the kernel's (M, N) = (Np, M)
        k_tiles = -(-kp // cfg.tile_k)
        size = cfg.cluster_m * cfg.cluster_n
        ctas = stream_grid(blocks, k_tiles, max_clusters, per) * size
        assert tiles >= tiles_m * tiles_n and floats >= 2 * ctas * cfg.tile_m * cfg.tile_n


def test_the_swap_is_nk_only_and_picked_for_a_few_hundred_tokens(cpu_kernel):
    from forgekernel.kernels.gemm.dense.sm90.config import SWAP, SWAP_80, SWAP_MAX_M, TALL_72

    with pytest.raises(ValueError, match="B 'nk' only"):
        forgekernel.gemm(bf16(300, 64), bf16(64, 256), b_layout="kn", config=SWAP_80)
    with pytest.raises(ValueError, match="B 'nk' only"):  # B's 80-row ring is K-major
        forgekernel.gemm(bf16(300, 64), bf16(64, 256), b_layout="kn", config=TALL_72)
    assert choose_config(300, 28672, 4096, 132) in SWAP
    assert choose_config(300, 28672, 4096, 132, b_kn=True) not in SWAP
    assert gemm_sm90.config_for(torch.bfloat16, True, 300, 28672, 4096, 132) not in SWAP
    assert gemm_sm90.config_for(torch.bfloat16, False, 300, 28672, 4096, 132) in SWAP
    for m in (64, 128, SWAP_MAX_M + 1, 4096):  # decode, skinny and large M keep their plans
        assert choose_config(m, 28672, 4096, 132) not in SWAP
    assert choose_config(300, 264, 4096, 132) not in SWAP  # tokens not the shorter side
