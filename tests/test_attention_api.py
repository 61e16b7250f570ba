"""Attention torch layer and host launcher on the CPU: every bad input raises a clear error
naming the argument before any kernel runs, and the launcher hands the compiled function its
arguments in order, TMA-ready, packed for short GQA queries, and returns what it wrote (a
reference-backed stand-in for the compiled function)."""

import contextlib
import importlib
import math

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

import forgekernel
from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_sm90
from forgekernel.kernels.attention.fwd.sm90.config import (
    DYNAMIC_CTAS_PER_SM,
    VARLEN_CTAS_PER_SM,
    grid_ctas,
    params_for,
    rule_params,
)
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.reference.attention import attention_ref, attention_varlen_ref
from forgekernel.runtime.device import tma_ready

# The package re-exports the functions under the modules' names; these are the modules.
attention_module = importlib.import_module("forgekernel.ops.attention")
varlen_module = importlib.import_module("forgekernel.ops.attention_varlen")


def bf16(*shape):
    return torch.randn(*shape).to(torch.bfloat16)


def qkv(b=2, sq=8, sk=8, hq=4, hkv=2, d=64, dv=None):
    return bf16(b, sq, hq, d), bf16(b, sk, hkv, d), bf16(b, sk, hkv, dv or d)


Q, K, V = qkv()


@pytest.mark.parametrize(
    "args, kwargs, exc, words",
    [
        (qkv(d=80), {}, ValueError, "head_dim = 80 with head_dim_v = 80 is not supported"),
        (qkv(d=128, dv=64), {}, ValueError, "supported (head_dim, head_dim_v): (64, 64)"),
        (qkv(hq=6, hkv=4), {}, ValueError, "Hq = 6 (q) must be a multiple of"),
        (qkv(hq=4, hkv=0), {}, ValueError, "kv heads Hkv = 0"),
        ((Q, K[:1], V[:1]), {}, ValueError, "k has batch size 1 but q has 2"),
        ((Q, K, V[:, :5]), {}, ValueError, "k and v must agree"),
        ((Q, K, V[:, :, :1]), {}, ValueError, "k and v must agree"),
        ((Q, K[..., :32], V), {}, ValueError, "k head_dim = 32 must equal q head_dim = 64"),
        ((Q.float(), K, V), {}, TypeError, "q must have dtype in (float16, bfloat16)"),
        ((Q, K.half(), V), {}, TypeError, "k has dtype torch.float16 but q has"),
        ((Q, K, V.half()), {}, TypeError, "v has dtype torch.float16 but q has"),
        ((Q, K, V), {}, ValueError, "q must be a CUDA tensor"),
        ((Q[0], K, V), {}, ValueError, "q must be 4-D, got 3-D"),
        ((Q, K, V[0]), {}, ValueError, "v must be 4-D"),
        ((Q.tolist(), K, V), {}, TypeError, "q must be a torch.Tensor"),
        ((Q, K, V), {"causal": 1}, TypeError, "causal must be a bool"),
        ((Q, K, V), {"softmax_scale": "x"}, TypeError, "softmax_scale must be a float"),
        ((Q, K, V), {"softmax_scale": math.nan}, ValueError, "softmax_scale must be finite"),
        ((Q, K, V), {"softmax_scale": -0.1}, ValueError, "softmax_scale must be finite and >= 0"),
        ((Q, K, V), {"out": bf16(2, 8, 4, 64)}, TypeError, "out must be a tuple (o, lse)"),
        (
            (Q, K, V),
            {"out": (bf16(2, 8, 4, 32), torch.empty(2, 4, 8))},
            ValueError,
            "out[0] (o) must have shape (2, 8, 4, 64)",
        ),
        (
            (Q, K, V),
            {"out": (bf16(2, 8, 4, 64), bf16(2, 4, 8))},
            TypeError,
            "out[1] (lse) must have dtype in (float32)",
        ),
    ],
)
def test_bad_inputs_raise(args, kwargs, exc, words):
    with pytest.raises(exc) as info:
        forgekernel.attention(*args, **kwargs)
    assert words in str(info.value)


@pytest.mark.parametrize("d, dv", attention_module.SUPPORTED_HEAD_DIMS)
def test_supported_head_dims_reach_the_device_check(d, dv):
    with pytest.raises(ValueError, match="q must be a CUDA tensor"):
        forgekernel.attention(*qkv(d=d, dv=dv, hq=8, hkv=1))


def packed(lens_q=(3, 5), lens_k=(4, 4), hq=4, hkv=2, d=64):
    cu = [
        torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32)
        for n in (lens_q, lens_k)
    ]
    q, k, v = bf16(sum(lens_q), hq, d), bf16(sum(lens_k), hkv, d), bf16(sum(lens_k), hkv, d)
    return q, k, v, cu[0], cu[1], max(lens_q), max(lens_k)


def with_(args, **changes):
    names = ("q", "k", "v", "cu_q", "cu_k", "max_q", "max_k")
    return tuple(changes.get(n, a) for n, a in zip(names, args))


P = packed()
I32 = torch.int32


@pytest.mark.parametrize(
    "args, exc, words",
    [
        (with_(P, cu_q=P[3].long()), TypeError, "cu_seqlens_q must have dtype in (int32)"),
        (with_(P, cu_k=P[4][None]), ValueError, "cu_seqlens_k must be 1-D"),
        (with_(P, cu_q=P[3][:1]), ValueError, "cu_seqlens_q must hold batch + 1 >= 2"),
        (with_(P, cu_k=torch.tensor([0, 8], dtype=I32)), ValueError, "cu_seqlens_q has 3"),
        (with_(P, cu_q=torch.tensor([1, 3, 8], dtype=I32)), ValueError, "cu_seqlens_q[0] must"),
        (with_(P, cu_k=torch.tensor([0, 6, 4], dtype=I32)), ValueError, "non-decreasing"),
        (with_(P, cu_q=torch.tensor([0, 3, 7], dtype=I32)), ValueError, "cu_seqlens_q[-1] = 7"),
        (with_(P, max_q=4), ValueError, "max_seqlen_q = 4 is less than the longest sequence (5)"),
        (with_(P, max_k=4.0), TypeError, "max_seqlen_k must be an int"),
        (with_(P, max_k=-1), ValueError, "max_seqlen_k must be >= 0"),
        (with_(P, max_q=0), ValueError, "max_seqlen_q = 0 but q holds 8 tokens"),
        (with_(P, max_k=0), ValueError, "max_seqlen_k = 0 but k holds 8 tokens"),
        (with_(P, q=bf16(8, 4, 80)), ValueError, "head_dim = 80"),
        (with_(P, q=bf16(8, 3, 64)), ValueError, "Hq = 3 (q) must be a multiple"),
        (with_(P, q=bf16(1, 8, 4, 64)), ValueError, "q must be 3-D"),
        (with_(P, v=P[2].half()), TypeError, "v has dtype"),
        (P, ValueError, "q must be a CUDA tensor"),
    ],
)
def test_bad_varlen_inputs_raise(args, exc, words):
    with pytest.raises(exc) as info:
        forgekernel.attention_varlen(*args)
    assert words in str(info.value)


def packed_ref(qp, k, v, causal, scale, group):
    """The reference on pack-GQA rows: unpack q, attend, pack o and lse back."""
    b, rows, hkv, d = qp.shape
    sq = rows // group
    q = qp.view(b, sq, group, hkv, d).transpose(2, 3).reshape(b, sq, hkv * group, d)
    o, lse = attention_ref(q, k, v, causal, scale)
    o = o.view(b, sq, hkv, group, -1).transpose(2, 3).reshape(b, rows, hkv, -1)
    return o, lse.view(b, hkv, group, sq).transpose(2, 3).reshape(b, hkv, rows)


DYNAMIC: list[bool] = []  # cpu_kernel's launches: whether each ran a dynamic-tiles kernel
KEYS: list[dict] = []  # cpu_kernel's launches: each one's compile key


@pytest.fixture
def cpu_kernel(monkeypatch):
    """Run the eager path on the CPU: no device check, 132 SMs, and as the compiled function
    the reference, which insists on what the real one needs (TMA-ready tensors, LSE with unit
    stride) and records (scale, qgroup, num_ctas, max_seqlen_q) per launch."""
    calls = []
    DYNAMIC.clear()
    KEYS.clear()

    def get_kernel(spec, params):
        p = dict(params)

        def fn(q, k, v, o, lse, cu_q, cu_k, scale_log2, max_q, qgroup, num_ctas, page_table):
            assert all(tma_ready(t) for t in (q, k, v, o)) and lse.stride(-1) == 1
            assert not p["page_box"]
            if p.get("dynamic"):  # the tile counter in the page-table slot, zeroed
                assert page_table.dtype == torch.int32 and page_table.tolist() == [0]
            else:
                assert page_table is None
            DYNAMIC.append(bool(p.get("dynamic")))
            KEYS.append(p)
            scale = scale_log2 / LOG2E
            if p.get("view_group"):  # fixed length, GQA-packed through views (pack_gqa)
                g = p["view_group"]
                assert q.dim() == o.dim() == 5 and lse.dim() == 4 and qgroup == q.shape[3] == g
                assert lse.is_contiguous() and cu_q is None and max_q == 0
                # the kernel's reading (views.grouped_rows_as_sdhb): row s * G + g of kv head h
                # is q[b, s, h, g]; lse[b, h, g, s] that row's
                ref = packed_ref(q.transpose(2, 3).flatten(1, 2), k, v, p["causal"], scale, g)
                sq = q.shape[1]
                ref = (ref[0].unflatten(1, (sq, g)).transpose(2, 3),
                       ref[1].unflatten(2, (sq, g)).transpose(2, 3))  # fmt: skip
            elif p["varlen"]:
                assert qgroup == 1
                ref = attention_varlen_ref(q, k, v, cu_q, cu_k, p["causal"], scale)
            else:
                assert lse.is_contiguous() and cu_q is None and cu_k is None and max_q == 0
                ref = packed_ref(q, k, v, p["causal"], scale, qgroup)
            o.copy_(ref[0])
            lse.copy_(ref[1])
            calls.append((pytest.approx(scale), qgroup, num_ctas, max_q))

        return fn

    for module in (attention_module, varlen_module):
        monkeypatch.setattr(module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(fwd_sm90, "get_kernel", get_kernel)
    monkeypatch.setattr(fwd_sm90, "_plans", type(fwd_sm90._plans)())  # plans hold kernels
    monkeypatch.setattr(fwd_sm90, "num_sms", lambda device: 132)
    monkeypatch.setattr(torch.cuda, "device", lambda device: contextlib.nullcontext())
    return calls


@pytest.mark.parametrize("causal", [False, True])
def test_eager_path_returns_what_the_kernel_wrote(cpu_kernel, causal):
    q, k, v = qkv(b=2, sq=17, sk=9, hq=8, hkv=2, d=192, dv=128)
    o, lse = forgekernel.attention(q, k, v, causal=causal, return_lse=True)
    want_o, want_lse = attention_ref(q, k, v, causal)
    assert cpu_kernel == [(192**-0.5, 4, 132, 0)]  # Sq 17 < PACK_GQA_MAX_SQ: 4 heads packed
    assert o.dtype == torch.bfloat16 and o.shape == (2, 17, 8, 128) and lse.shape == (2, 8, 17)
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    assert forgekernel.attention(q, k, v, causal=causal).shape == o.shape


def test_strided_inputs_and_outputs_are_copied(cpu_kernel):
    q, k, v = qkv(b=1, sq=33, sk=33, hq=4, hkv=4, d=64)
    q_strided = q.transpose(-1, -2).contiguous().transpose(-1, -2)  # last dim not contiguous
    o = bf16(1, 33, 4, 128)[..., ::2]  # a view whose last dim is strided
    lse = torch.empty(1, 33, 4).transpose(1, 2)  # (B, Hq, Sq) view, not contiguous
    got = forgekernel.attention(q_strided, k, v, True, 0.5, return_lse=True, out=(o, lse))
    assert got[0] is o and got[1] is lse
    want_o, want_lse = attention_ref(q, k, v, True, 0.5)
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_no_keys_and_empty_problems_skip_the_kernel(cpu_kernel):
    o, lse = forgekernel.attention(*qkv(sk=0), causal=True, return_lse=True)
    assert torch.all(o == 0) and torch.all(lse == -math.inf)
    assert forgekernel.attention(*qkv(sq=0)).shape == (2, 0, 4, 64)
    assert cpu_kernel == []


@pytest.mark.parametrize(
    "sq, hq, hkv, qgroup",
    [(5, 8, 2, 4), (127, 4, 1, 4), (128, 8, 2, 1), (200, 8, 2, 1), (5, 4, 4, 1)],
)
def test_short_gqa_queries_run_packed(cpu_kernel, sq, hq, hkv, qgroup):
    """Outside PACK_CLASSES (D = 128): pack-GQA by a copy below PACK_GQA_MAX_SQ query rows
    (the kernel told qgroup = G); longer queries and MHA run unpacked. The outputs are the
    reference's either way."""
    q, k, v = qkv(b=1, sq=sq, sk=sq + 3, hq=hq, hkv=hkv, d=128)
    o, lse = forgekernel.attention(q, k, v, causal=True, return_lse=True)
    assert [c[1] for c in cpu_kernel] == [qgroup]
    assert not KEYS[-1].get("view_group")
    want_o, want_lse = attention_ref(q, k, v, True)
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(
    "sq, hq, hkv, views",
    [(5, 8, 2, 4), (128, 8, 2, 4), (300, 32, 8, 4), (200, 16, 1, 16), (77, 16, 8, 2),
     (300, 4, 4, 0), (300, 12, 4, 0)],
)  # fmt: skip
def test_d64_gqa_runs_packed_through_views(cpu_kernel, causal, sq, hq, hkv, views):
    """In PACK_CLASSES (D = 64, both masks) a GQA call runs the view_group compile at every
    Sq (G one of `pack_groups`: 2 / 4 / 8 / 16 under 192-row tiles); MHA unpacked, G = 3 (not
    in VIEW_GROUPS) by the copy below PACK_GQA_MAX_SQ else unpacked; pack_gqa=False the launch
    before (the bench's `unpacked`). The outputs are the reference's every way."""
    q, k, v = qkv(b=2, sq=sq, sk=sq + 3, hq=hq, hkv=hkv, d=64)
    o, lse = forgekernel.attention(q, k, v, causal=causal, return_lse=True)
    assert KEYS[-1].get("view_group", 0) == views
    assert fwd_sm90.pack_group(64, 64, causal, hq // hkv, 0) == views
    want_o, want_lse = attention_ref(q, k, v, causal)
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)
    o2, lse2 = bf16(2, sq, hq, 64), torch.empty(2, hq, sq)
    fwd_sm90.attention_fwd(q, k, v, o2, lse2, 64**-0.5, causal, pack_gqa=False)
    assert not KEYS[-1].get("view_group")
    torch.testing.assert_close(o2, o, rtol=0, atol=0)
    torch.testing.assert_close(lse2, lse, rtol=0, atol=0)


def test_the_default_packs_no_other_head_dim_or_rule():
    """`pack_group`: G only in PACK_CLASSES (D = Dv = 64, both masks) without a FIXED_RULES
    rule."""
    assert fwd_sm90.pack_group(64, 64, True, 4, 0) == 4
    assert fwd_sm90.pack_group(64, 64, False, 4, 0) == 4
    assert fwd_sm90.pack_group(64, 64, False, 3, 0) == 0  # G 3 divides no view
    assert fwd_sm90.pack_group(64, 64, True, 4, 7) == 0  # a rule took the problem
    for d, dv in ((128, 128), (96, 96), (256, 256), (192, 128)):
        assert fwd_sm90.pack_group(d, dv, True, 4, 0) == 0
        assert fwd_sm90.pack_group(d, dv, False, 4, 0) == 0


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("d", [64, 128])
def test_varlen_eager_path_hands_the_kernel_packed_tensors(cpu_kernel, causal, d):
    """The varlen launch: TMA-ready packed inputs, (Hq, total) LSE, the scale in log2 units,
    max_seqlen_q; D = 128 with the tile counter on one CTA a SM, the other head dims dealt
    statically over VARLEN_CTAS_PER_SM CTAs a SM; a reference-backed kernel."""
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lens_q=(3, 17, 0, 5), lens_k=(4, 9, 2, 0), d=d)
    o, lse = forgekernel.attention_varlen(
        q, k, v, cu_q, cu_k, max_q, max_k, causal=causal, return_lse=True
    )
    per_sm = DYNAMIC_CTAS_PER_SM if d == 128 else VARLEN_CTAS_PER_SM
    assert cpu_kernel == [(d**-0.5, 1, 132 * per_sm, 17)] and DYNAMIC == [d == 128]
    want_o, want_lse = attention_varlen_ref(q, k, v, cu_q, cu_k, causal)
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=1e-2)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_grid_ctas():
    """CTAs a SM times the SMs; 0: one a tile (the kernel launches min(num_ctas, tiles))."""
    assert VARLEN_CTAS_PER_SM >= 1
    assert grid_ctas(132, 1) == 132 and grid_ctas(132, 4) == 528
    assert grid_ctas(132, 0) == 2**31 - 1
    with pytest.raises(ValueError, match="ctas_per_sm"):
        grid_ctas(132, -1)


def test_bench_grid_variants_pass_their_grid(cpu_kernel):
    """The suite's GRID_CANDIDATES reach the kernel as num_ctas and the counter flag (the
    default: the tile counter on one CTA a SM; `static`: the deal it replaced) and write what
    the default launch writes; only the varlen D = 128 cases carry them."""
    from forgekernel.bench.suites import attention as suite

    q, k, v, cu_q, cu_k, max_q, max_k = packed(lens_q=(3, 300, 5), lens_k=(40, 900, 5), d=128)
    inputs = {"q": q, "k": k, "v": v, "cu_seqlens_q": cu_q, "cu_seqlens_k": cu_k,
              "max_seqlen_q": max_q, "max_seqlen_k": max_k}  # fmt: skip
    name = "varlen8-hq32-hkv8-chunk256to2048-d128-causal"
    inputs |= {"causal": True, "softmax_scale": None}
    want = suite.run_ours(inputs, None)
    case = next(c for c in suite.BENCH_CASES if c.name == name)
    runs = suite.variants(case)
    knobs = suite.GRID_CANDIDATES[suite.GRID_TIMED[name]]
    assert set(runs) == set(knobs) == {"static"}
    for run in runs.values():
        got = run(inputs, None)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
    grids = [grid_ctas(132, k["ctas_per_sm"]) for k in knobs.values()]
    assert [c[2] for c in cpu_kernel] == [132 * DYNAMIC_CTAS_PER_SM, *grids]
    assert DYNAMIC == [True] + [bool(k.get("dynamic")) for k in knobs.values()]
    assert set(suite.GRID_TIMED.values()) == {"varlen"}
    assert suite.variants(suite.CHECK_CASES[0]) == {}


def test_bench_config_variants_pass_their_config(cpu_kernel):
    """The suite's CONFIG_CANDIDATES reach the kernel as the head dims' default config with
    their knobs set (`was`: none, the standard key of the plan before the fixed-length rules;
    the others candidate keys or a rule's standard one), on the config's grid, and write what
    the default launch writes: the cases a rule moved carry `was`, the three long 192/128 ones
    also the open `dyn_kahead` / `dyn_sec12`; the cases left unmoved the L2 round's variants
    (`wave0`, causal `wave0_dyn`); the three D = 96 cases the 192-row tiles (`wg3`,
    `wg3_s3`, `wg3_n96s3`; `wg3_wave0` beside `was` where a rule moved)."""
    from forgekernel.bench.suites import attention as suite
    from forgekernel.kernels.attention.fwd.sm90 import SPEC
    from forgekernel.kernels.attention.fwd.sm90.config import fixed_rule

    built = {tuple(sorted(dict(p).items())) for p in SPEC.candidate_params()}
    built |= {tuple(sorted(dict(p).items())) for p in SPEC.standard_params()}
    for case in suite.BENCH_CASES:
        runs = suite.variants(case)
        kind = suite.CONFIG_TIMED.get(case.name)
        if kind is None:
            assert not runs or case.name in suite.GRID_TIMED or case.name in suite.PACK_TIMED
            continue
        p = case.params
        moved = fixed_rule(p["d"], p["dv"], p["causal"], p["b"], p["sq"], p["sk"], p["hq"],
                           p["hkv"])  # fmt: skip
        knobs = suite.CONFIG_CANDIDATES[kind]
        assert set(runs) == set(knobs) and ("was" in runs) == bool(moved)
        if p["d"] == 192 and p["sk"] > 2048:
            assert set(runs) == {"was", "dyn_kahead", "dyn_sec12"}
        elif p["d"] == 96:  # 192-row tiles (WG3_CANDIDATES), in sections where a rule moved
            assert set(runs) == ({"was", "wg3_wave0"} if moved else {"wg3", "wg3_s3", "wg3_n96s3"})
        elif moved:
            assert set(runs) == {"was"}
        else:
            assert set(runs) == ({"wave0", "wave0_dyn"} if p["causal"] else {"wave0"})
        q, k, v = qkv(b=1, sq=130, sk=300, hq=4, hkv=4, d=p["d"], dv=p["dv"])
        inputs = {"q": q, "k": k, "v": v, "causal": p["causal"], "softmax_scale": None}
        want = suite.run_ours(inputs, None)
        for name, run in runs.items():
            KEYS.clear()
            got = run(inputs, None)
            for g, w in zip(got, want):
                torch.testing.assert_close(g, w, rtol=0, atol=0)
            (key,) = KEYS
            assert {n: key[n] for n in knobs[name]} == knobs[name]
            assert DYNAMIC[-1] == bool(knobs[name].get("dynamic"))  # the counter passed
            assert tuple(sorted(key.items())) in built
            if name == "was":
                default = params_for("bfloat16", p["d"], p["dv"], p["causal"])
                assert tuple(sorted(key.items())) == tuple(sorted(default))
    assert [c[2] for c in cpu_kernel] == [132] * len(cpu_kernel)
    assert len(suite.CONFIG_TIMED) == 17
    assert set(suite.CONFIG_TIMED) <= {c.name for c in suite.BENCH_CASES}


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize(("hq", "hkv", "d"), [(8, 4, 64), (8, 2, 128), (16, 2, 64), (4, 4, 64)])
def test_pack_gqa_runs_every_length_on_views(cpu_kernel, causal, hq, hkv, d):
    """attention_fwd(pack_gqa=True) (the `gqa_pack` candidate): with GQA, any Sq (here 300 >
    PACK_GQA_MAX_SQ, 1000 keys) runs the view_group compile of the problem's plan on
    (B, Sq, Hkv, G, D) views of q / o and (B, Hkv, G, Sq) of lse, qgroup G, writing the
    caller's buffers (no pack copy) what the reference gives; MHA runs as before."""
    q, k, v = qkv(b=2, sq=300, sk=1000, hq=hq, hkv=hkv, d=d)
    o, lse = bf16(2, 300, hq, d), torch.empty(2, hq, 300)
    fwd_sm90.attention_fwd(q, k, v, o, lse, 0.125, causal, pack_gqa=True)
    want_o, want_lse = attention_ref(q, k, v, causal, 0.125)
    group = hq // hkv
    (key,) = KEYS
    assert key.get("view_group", 0) == (group if group > 1 else 0)
    default = dict(params_for("bfloat16", d, d, causal))
    assert {n: w for n, w in key.items() if n != "view_group"} == default
    assert cpu_kernel == [(0.125, group, 132, 0)]
    torch.testing.assert_close(o, want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_pack_gqa_needs_a_group_dividing_the_tile(cpu_kernel):
    """G = 3 at D = 128 (128-row tiles): no packed compile (TMA boxes of (G, tile_m / G))."""
    q, k, v = qkv(b=1, sq=200, sk=200, hq=6, hkv=2, d=128)
    o, lse = bf16(1, 200, 6, 128), torch.empty(1, 6, 200)
    with pytest.raises(ValueError, match="view_group 3"):
        fwd_sm90.attention_fwd(q, k, v, o, lse, 0.1, True, pack_gqa=True)


def test_bench_pack_variant_runs_packed(cpu_kernel):
    """The suite's PACK_TIMED rows: outside PACK_CLASSES `gqa_pack` reaches the kernel as
    the view_group key of the case's plan, a PACK_CANDIDATES build; in PACK_CLASSES ours is
    that standard key and `unpacked` the plain one. Either writes what the default writes."""
    from forgekernel.bench.suites import attention as suite
    from forgekernel.kernels.attention.fwd.sm90 import PACK_CLASSES, SPEC

    cands = {tuple(sorted(dict(p).items())) for p in SPEC.candidate_params()}
    standard = {tuple(sorted(dict(p).items())) for p in SPEC.standard_params()}
    names = set()
    for case in suite.BENCH_CASES:
        if case.name not in suite.PACK_TIMED:
            continue
        names.add(case.name)
        p = case.params
        group, default = p["hq"] // p["hkv"], (p["d"], p["causal"]) in PACK_CLASSES
        runs = suite.variants(case)
        assert set(runs) == ({"unpacked"} if default else {"gqa_pack"})
        q, k, v = qkv(b=1, sq=200, sk=300, hq=group * 2, hkv=2, d=p["d"])
        inputs = {"q": q, "k": k, "v": v, "causal": p["causal"], "softmax_scale": None}
        KEYS.clear()
        want = suite.run_ours(inputs, None)
        (ours,) = KEYS
        assert ours.get("view_group", 0) == (group if default else 0)
        KEYS.clear()
        got = runs["unpacked" if default else "gqa_pack"](inputs, None)
        for g, w in zip(got, want):
            torch.testing.assert_close(g, w, rtol=0, atol=0)
        (key,) = KEYS
        packed = ours if default else key
        assert packed["view_group"] == group
        assert tuple(sorted(packed.items())) in (standard if default else cands)
        assert not (key if default else ours).get("view_group")
    assert names == set(suite.PACK_TIMED)


def test_the_launcher_runs_the_fixed_rule_of_the_problem(cpu_kernel, monkeypatch):
    """A fixed-length call picks its kernel by `config.fixed_rule` (FIXED_RULES): inside a
    rule's class its key (sections at every size; the counter passed where the rule takes
    it), one query row short of the class the head dims' default; each remembered as its own
    plan. The stand-in kernel writes nothing here (the shapes are the bench's)."""
    monkeypatch.setitem(globals(), "packed_ref", lambda q, k, v, causal, scale, group: (
        torch.zeros(q.shape[:-1] + v.shape[-1:]), torch.zeros(q.shape[0], q.shape[2], q.shape[1])
    ))  # fmt: skip
    cases = [  # (rule, b, s, hq, hkv, d, dv, causal): its class's smallest corner
        (7, 32, 512, 16, 16, 64, 64, False),
        (5, 16, 1024, 8, 4, 256, 256, False),
        (6, 16, 1024, 32, 32, 128, 128, True),
        (4, 4, 2048, 16, 16, 256, 256, True),
        (1, 1, 2048, 128, 128, 192, 128, True),
        (8, 8, 2048, 32, 32, 128, 128, False),
    ]
    for rule, b, s, hq, hkv, d, dv, causal in cases:
        for sq, want in ((s, rule_params("bfloat16", rule)),
                         (s - 1, params_for("bfloat16", d, dv, causal))):  # fmt: skip
            q = torch.empty(b, sq, hq, d, dtype=torch.bfloat16)
            k = torch.empty(b, s, hkv, d, dtype=torch.bfloat16)
            v = torch.empty(b, s, hkv, dv, dtype=torch.bfloat16)
            o = torch.empty(b, sq, hq, dv, dtype=torch.bfloat16)
            lse = torch.empty(b, hq, sq)
            KEYS.clear()
            fwd_sm90.attention_fwd(q, k, v, o, lse, d**-0.5, causal)
            (key,) = KEYS
            assert tuple(sorted(key.items())) == tuple(sorted(want)), (rule, sq)
            assert DYNAMIC[-1] == bool(dict(want).get("dynamic"))
    assert len(fwd_sm90._plans) == 2 * len(cases)


def test_forward_only_calls_keep_no_autograd_state(cpu_kernel):
    """Nothing requires grad, or grad mode is off: the eager path, no graph node, nothing saved
    (the backward lives in tests/test_attention_bwd.py)."""
    q, k, v = qkv()
    assert forgekernel.attention(q, k, v).grad_fn is None
    with torch.no_grad():
        assert forgekernel.attention(q.requires_grad_(), k, v).grad_fn is None
    assert forgekernel.attention(q, k, v).grad_fn is not None


def test_eager_grad_calls_skip_the_dispatcher(cpu_kernel, monkeypatch):
    """A call autograd records runs the forward op's autograd formula (setup and backward of
    ops/attention_bwd.py) in an autograd.Function: same outputs, q, k, v, o, lse saved, lse
    not differentiable, and the custom op not called."""

    def no_dispatcher(*args):
        raise AssertionError("eager grad call went through the custom op")

    monkeypatch.setattr(torch.ops.forgekernel, "attention_fwd", no_dispatcher)
    q, k, v = (t.requires_grad_() for t in qkv(b=1, sq=5, sk=9, hq=4, hkv=2, d=64))
    o, lse = forgekernel.attention(q, k, v, causal=True, return_lse=True)
    assert type(o.grad_fn) is attention_module._EagerAttentionFwd._backward_cls
    assert not lse.requires_grad
    saved = o.grad_fn.saved_tensors
    assert [t.data_ptr() for t in saved] == [t.data_ptr() for t in (q, k, v, o, lse)]
    assert o.grad_fn.flags == (True, 64**-0.5, False)  # (causal, scale, deterministic)
    want_o, want_lse = attention_ref(q.detach(), k.detach(), v.detach(), True)
    torch.testing.assert_close(o.detach(), want_o.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=0)


def test_eager_varlen_grad_calls_skip_the_dispatcher(cpu_kernel, monkeypatch):
    def no_dispatcher(*args):
        raise AssertionError("eager grad call went through the custom op")

    monkeypatch.setattr(torch.ops.forgekernel, "attention_varlen_fwd", no_dispatcher)
    q, k, v, cu_q, cu_k, max_q, max_k = packed(lens_q=(3, 17), lens_k=(4, 9))
    q.requires_grad_()
    o = forgekernel.attention_varlen(q, k, v, cu_q, cu_k, max_q, max_k, causal=True)
    assert type(o.grad_fn) is varlen_module._EagerVarlenFwd._backward_cls
    assert len(o.grad_fn.saved_tensors) == 7 and o.grad_fn.max_seqlens == (17, 9)
    want_o, _ = attention_varlen_ref(q.detach(), k, v, cu_q, cu_k, True)
    torch.testing.assert_close(o.detach(), want_o.to(torch.bfloat16), rtol=0, atol=1e-2)


@pytest.mark.parametrize("causal", [False, True])
def test_pack_gqa_is_the_same_attention(causal):
    """Packed rows s * G + g of kv head h hold query head h * G + g: attention over the packed
    problem, with row r masked as query r // G, unpacks to the original outputs."""
    q, k, v = qkv(b=2, sq=5, sk=9, hq=8, hkv=2, d=64)
    group = 4
    qp = fwd_sm90.pack_gqa_q(q, group)
    assert qp.shape == (2, 20, 2, 64) and torch.equal(
        qp[:, 3 * group + 1, 1], q[:, 3, 1 * group + 1]
    )
    # The reference on the packed problem: one query head per kv head, row r = query r // G.
    scale = 64**-0.5
    s = torch.einsum("brhd,bkhd->bhrk", qp.float(), k.float()) * scale
    if causal:
        rows = torch.arange(20)[:, None] // group
        s = s.masked_fill(torch.arange(9)[None, :] > rows + 9 - 5, float("-inf"))
    op = torch.einsum("bhrk,bkhd->brhd", s.softmax(-1), v.float())
    lsep = s.logsumexp(-1)
    o, lse = fwd_sm90.unpack_gqa(op, lsep, group)
    want_o, want_lse = attention_ref(q, k, v, causal)
    torch.testing.assert_close(o, want_o, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(lse, want_lse, rtol=1e-5, atol=1e-5)


def test_tensors_on_different_devices():
    with FakeTensorMode():
        q = torch.empty(2, 8, 4, 64, device="cuda", dtype=torch.bfloat16)
        k = torch.empty(2, 8, 2, 64, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match="k is on cpu but q is on cuda"):
            forgekernel.attention(q, k, k)
