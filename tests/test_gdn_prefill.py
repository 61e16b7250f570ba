"""The chunked Gated DeltaNet forward's op and launcher on the CPU (the GPU's checks:
tests/gpu/test_gdn_prefill_gpu.py): the kernel's algorithm (per sequence and value head, chunks
of 64: the decayed K K^T system solved for the WY form, U = u - w S, O = (Q e^G) S + the masked
intra-chunk scores times U, S <- e^{G_C} S + (K e^{G_C - G})^T U, all in fp32) replayed through
the real launcher against the fp64 recurrence: varlen with empty and odd sequences, initial
states in both layouts, l2norm, grouped value heads; the FlashInfer-Bench definition's own
reference through the adapter; argument errors."""

from __future__ import annotations

import importlib

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as prefill_launch
from forgekernel.kernels.linear_attention.gdn_prefill.sm90.config import CHUNK, L2NORM_EPS
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + L2NORM_EPS)


def _chunk(s, q, k, v, g, beta, scale):
    """One chunk of one (sequence, head): s (K, V), q / k (C, K), v (C, V), g / beta (C,)."""
    c = q.shape[0]
    big_g = g.cumsum(0)
    lower = torch.ones(c, c, dtype=torch.bool).tril()
    diff = (big_g[:, None] - big_g[None, :]).masked_fill(~lower, float("-inf"))
    decay = diff.exp()  # exp(G_i - G_j), j <= i, else 0: never an exp of a positive number
    a = (k @ k.t()) * decay * beta[:, None]
    a = a.tril(-1)
    eye = torch.eye(c)
    t = torch.linalg.solve_triangular(eye + a, eye, upper=False, unitriangular=True)
    w = t @ (beta[:, None] * k * big_g.exp()[:, None])
    u = t @ (beta[:, None] * v)
    new_v = u - w @ s
    o = scale * ((q * big_g.exp()[:, None]) @ s + ((q @ k.t()) * decay) @ new_v)
    s = big_g[-1].exp() * s + (k * (big_g[-1] - big_g).exp()[:, None]).t() @ new_v
    return s, o


def _kernel(params):
    """The prefill kernel's algorithm in fp32, one (sequence, value head) at a time."""

    def fn(q, k, v, g, beta, init, cu_seqlens, out, final, scale):
        group = v.shape[1] // q.shape[1]
        edges = cu_seqlens.tolist()
        for n, (t0, t1) in enumerate(zip(edges[:-1], edges[1:])):
            for hv in range(v.shape[1]):
                if init is None:
                    s = torch.zeros(params["k"], params["v"])
                else:
                    s = init[n, hv].t() if params["k_last"] else init[n, hv]
                qs, ks = (x[t0:t1, hv // group].float() for x in (q, k))
                if params["l2norm"]:
                    qs, ks = _l2norm(qs), _l2norm(ks)
                for c0 in range(t0, t1, CHUNK):
                    c1 = min(c0 + CHUNK, t1)
                    span = slice(c0 - t0, c1 - t0)
                    s, o = _chunk(s, qs[span], ks[span], v[c0:c1, hv].float(), g[c0:c1, hv],
                                  beta[c0:c1, hv], scale)  # fmt: skip
                    out[c0:c1, hv] = o.to(out.dtype)
                final[n, hv] = s.t() if params["k_last"] else s

    return fn


@pytest.fixture
def cpu_kernel(monkeypatch):
    calls = []

    def get(spec, params):
        calls.append(dict(params))
        return _kernel(dict(params))

    monkeypatch.setattr(prefill_launch, "get_kernel", get)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    return calls


def _inputs(b, t, h, hv, *, n=None, seed=0, beta_dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, t, h, 128, generator=gen).to(torch.bfloat16)
    k = (torch.randn(b, t, h, 128, generator=gen) * 128**-0.5).to(torch.bfloat16)
    v = torch.randn(b, t, hv, 128, generator=gen).to(torch.bfloat16)
    g = torch.nn.functional.logsigmoid(torch.randn(b, t, hv, generator=gen) + 2.0)
    beta = torch.rand(b, t, hv, generator=gen).to(beta_dtype)
    state = torch.randn(n or b, hv, 128, 128, generator=gen) * 0.1
    return q, k, v, g, beta, state


def _close(got, want, rel):
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-6, err


@pytest.mark.parametrize(
    ("lens", "h", "hv", "l2norm", "with_state", "k_last"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, True, False),  # varlen: empty and odd sequences
        ([200], 4, 8, True, True, True),  # one long sequence, FlashInfer's layout
        ([3, 129, 7], 1, 2, True, False, False),  # no initial state
        ([64, 64], 2, 2, False, True, True),  # H = HV
    ],
)
def test_varlen_matches_the_recurrence(cpu_kernel, lens, h, hv, l2norm, with_state, k_last):
    n, total = len(lens), sum(lens)
    q, k, v, g, beta, state = _inputs(1, total, h, hv, n=n, seed=total)
    if l2norm:  # unnormalized keys: the kernel's l2norm is what keeps the recurrence stable
        k = k * 16
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int64)
    init = state if with_state else None
    theirs = None if init is None else (init.transpose(-1, -2).contiguous() if k_last else init)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=theirs, output_final_state=True,
                                   cu_seqlens=cu, use_qk_l2norm_in_kernel=l2norm,
                                   k_last=k_last)  # fmt: skip
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm=l2norm)  # fmt: skip
    assert o.shape == v.shape and o.dtype == q.dtype
    _close(o, want_o, 2e-2)  # bf16 output rounding
    _close(final.transpose(-1, -2) if k_last else final, want_s, 1e-4)  # fp32 state
    assert cpu_kernel == [dict(op.prefill_sm90.params_for(
        "bfloat16", k_last=k_last, l2norm=l2norm, initial_state=with_state))]  # fmt: skip


def test_fixed_length_batch_and_no_final_state(cpu_kernel):
    q, k, v, g, beta, state = _inputs(2, 77, 2, 4, seed=3, beta_dtype=torch.bfloat16)
    o, final = op.gated_delta_rule(q, k, v, g, beta, scale=0.3, initial_state=state)
    assert final is None
    want, _ = gated_delta_rule_recurrent(q, k, v, g, beta.float(), scale=0.3, initial_state=state)
    _close(o, want, 2e-2)


def test_strong_decay_on_a_long_chunk_stays_finite(cpu_kernel):
    """Log decays of -20 per token: exp(G) of a chunk reaches e^-1280; no exponent is positive,
    so nothing overflows (the state is forgotten at once, o ~ beta v of the current token)."""
    q, k, v, g, beta, _ = _inputs(1, 150, 1, 1, seed=4)
    g = torch.full_like(g, -20.0)
    o, final = op.gated_delta_rule(q, k, v, g, beta, output_final_state=True)
    want, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, output_final_state=True)
    assert torch.isfinite(o.float()).all() and torch.isfinite(final).all()
    _close(o, want, 2e-2)
    _close(final, want_s, 1e-4)


def _definition_inputs(lens, seed, with_state=True):
    gen = torch.Generator().manual_seed(seed)
    total, n = sum(lens), len(lens)

    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=gen) * scale

    return {
        "q": rnd(total, 4, 128).to(torch.bfloat16),
        "k": torch.nn.functional.normalize(rnd(total, 4, 128), dim=-1).to(torch.bfloat16),
        "v": rnd(total, 8, 128).to(torch.bfloat16),
        "state": rnd(n, 8, 128, 128, scale=0.1) if with_state else None,
        "A_log": rnd(8, scale=0.5), "a": rnd(total, 8).to(torch.bfloat16),
        "dt_bias": rnd(8, scale=0.5), "b": rnd(total, 8).to(torch.bfloat16),
        "cu_seqlens": torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()]),
        "scale": 0.0,
    }  # fmt: skip


@pytest.mark.parametrize(("lens", "with_state"), [([5, 0, 70], True), ([33], False)])
def test_flashinfer_prefill_definition(cpu_kernel, lens, with_state):
    name = "gdn_prefill_qk4_v8_d128_k_last"
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    inputs = _definition_inputs(lens, sum(lens), with_state)
    if with_state:  # (check_inputs reads every input's dtype; the state is optional)
        defs.check_inputs(defn, inputs)
    theirs_out, theirs_state = defs.run_definition(defn, inputs)
    before = None if inputs["state"] is None else inputs["state"].clone()
    out, state = op.gdn_prefill_flashinfer(**inputs)
    assert out.shape == theirs_out.shape and out.dtype == torch.bfloat16
    assert state.shape == theirs_state.shape and state.dtype == torch.float32
    assert before is None or torch.equal(inputs["state"], before)  # theirs is not modified
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(state, theirs_state, atol=1e-4, rtol=1e-4) == 0
    assert torch.all(state[1] == 0) if lens[1:2] == [0] else True  # an empty sequence: zeros


def _bad(change):
    q, k, v, g, beta, state = _inputs(1, 9, 2, 4, n=2)
    kw = {"initial_state": state, "cu_seqlens": torch.tensor([0, 4, 9])}
    args = [q, k, v, g, beta]
    change(args, kw)
    return args, kw


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        (lambda a, kw: a.__setitem__(2, a[2][:, :, :3]), ValueError, "multiple of H"),
        (lambda a, kw: a.__setitem__(0, a[0][..., :64]), ValueError, "k must have shape"),
        (lambda a, kw: a.__setitem__(3, a[3].double()), TypeError, "g must have dtype"),
        (lambda a, kw: a.__setitem__(4, a[4][..., :2]), ValueError, "beta must have shape"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 4, 8])), ValueError, "rise from 0"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0, 5, 4, 9])), ValueError, "rise"),
        (lambda a, kw: kw.update(cu_seqlens=torch.tensor([0.0, 9.0])), TypeError, "cu_seqlens"),
        (lambda a, kw: kw.update(initial_state=kw["initial_state"][:1]), ValueError,
         "initial_state must have shape"),
        (lambda a, kw: kw.update(initial_state=kw["initial_state"].half()), TypeError,
         "initial_state must have dtype"),
    ],
)  # fmt: skip
def test_bad_arguments(cpu_kernel, change, err, match):
    args, kw = _bad(change)
    with pytest.raises(err, match=match):
        op.gated_delta_rule(*args, **kw)


def test_varlen_needs_batch_one_and_head_dims_128(cpu_kernel):
    q, k, v, g, beta, _ = _inputs(2, 5, 1, 1)
    with pytest.raises(ValueError, match="B = 1"):
        op.gated_delta_rule(q, k, v, g, beta, cu_seqlens=torch.tensor([0, 5]))
    with pytest.raises(ValueError, match=r"\(K, V\)"):
        op.gated_delta_rule(q[..., :64], k[..., :64], v, g, beta)


def test_cpu_tensors_are_refused():
    q, k, v, g, beta, _ = _inputs(1, 5, 1, 1)
    with pytest.raises(ValueError, match="CUDA"):
        op.gated_delta_rule(q, k, v, g, beta)


def test_fake_gives_the_shapes():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        q, k = torch.empty(7, 2, 128, dtype=torch.bfloat16), torch.empty(7, 2, 128)
        v, g = torch.empty(7, 4, 128, dtype=torch.bfloat16), torch.empty(7, 4)
        cu = torch.tensor([0, 3, 7], dtype=torch.int32)
        o, s = torch.ops.forgekernel.gated_delta_rule_chunked(q, k.bfloat16(), v, g, g, None, cu,
                                                               0.1, True, False)  # fmt: skip
    assert o.shape == (7, 4, 128) and o.dtype == torch.bfloat16
    assert s.shape == (2, 4, 128, 128) and s.dtype == torch.float32
