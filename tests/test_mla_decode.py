"""DeepSeek MLA paged decode on the CPU (the GPU's checks: tests/gpu/test_mla_gpu.py): heads per
CTA, compile keys and the split plan; the kernels' algorithm (split ranges, 64-key tiles scored
over the 576 latent + RoPE columns with one running max per row per tile, P rounded to q's dtype
before P V, the split's normalized O and log2 LSE, the paged leaf's combine) replayed in Python
through the real launcher and op against reference.mla: decode, MTP (s_q 2 / 4), the packed
form, FlashMLA's combined cache, FlashInfer-Bench's adapter; argument errors; the
suite's own check; the custom op's fake implementation under make_fx."""

from __future__ import annotations

import importlib
import math

import pytest
import torch
from split_combine import combine_splits
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.fx.experimental.proxy_tensor import make_fx

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.bench.check import verify
from forgekernel.bench.suites import PENDING_SUITE_MODULES, SUITE_MODULES, mla_decode
from forgekernel.kernels.attention.mla.sm90 import SPEC
from forgekernel.kernels.attention.mla.sm90 import launch as mla_launch
from forgekernel.kernels.attention.mla.sm90.config import (
    HEADS,
    QTOKENS,
    ROWS,
    TILE,
    heads_per_cta,
    params_for,
    split_plan,
)
from forgekernel.kernels.attention.paged.sm90 import config as paged_config
from forgekernel.reference.flashinfer_paged import page_table_to_csr
from forgekernel.reference.mla import mla_decode_ref, mla_prefill_ref
from forgekernel.reference.mla_flashinfer import mla_flashinfer_decode

op = importlib.import_module("forgekernel.ops.mla")
SCALE = mla_decode.SOFTMAX_SCALE
LATENT = 512


# ---------------------------------------------------------------- configuration


@pytest.mark.parametrize(
    ("hq", "qtokens", "want"),
    [(16, 1, 16), (128, 1, 64), (128, 2, 32), (128, 4, 16), (16, 2, 16), (16, 4, 16),
     (8, 1, 8), (24, 1, 8), (3, 1, 1), (6, 4, 2), (32, 2, 32), (96, 1, 32)],
)  # fmt: skip
def test_heads_per_cta(hq, qtokens, want):
    h = heads_per_cta(hq, qtokens)
    assert h == want and hq % h == 0 and h in HEADS and h * qtokens <= ROWS


def test_compile_keys():
    """The combine is the paged leaf's kernel at head dim 512 under the key it would have
    there; every standard partial fits the MMA's rows."""
    for dtype in ("float16", "bfloat16"):
        assert params_for("combine", dtype) == paged_config.params_for("combine", dtype, 512)
    assert dict(params_for("partial", "bfloat16", 16)) == {
        "kind": "partial", "dtype": "bfloat16", "heads": 16,
    }  # fmt: skip
    assert dict(params_for("partial", "float16", 4, 4))["qtokens"] == 4
    partial = [dict(p) for p in SPEC.standard_params() if dict(p)["kind"] == "partial"]
    assert len(partial) == 2 * sum(1 for h in HEADS for t in QTOKENS if h * t <= ROWS)
    assert all(p["heads"] * p.get("qtokens", 1) <= ROWS for p in partial)
    with pytest.raises(ValueError, match="kind"):
        params_for("decode", "bfloat16")


@pytest.mark.parametrize(("b", "blocks", "tokens"), [(1, 1, 65536), (64, 1, 4096), (1, 8, 16384),
                                                     (128, 8, 8192), (3, 1, 17)])  # fmt: skip
def test_split_plan_is_the_paged_leafs(b, blocks, tokens):
    """One resident CTA per SM: the plan's last wave filled to 90% where splits allow."""
    assert split_plan is paged_config.split_plan
    splits, per = split_plan(b, blocks, tokens, 132, 1)
    assert splits * per >= tokens and (splits - 1) * per < tokens
    if splits < -(-tokens // paged_config.MIN_TOKENS_PER_SPLIT):
        ctas = b * blocks * splits
        assert ctas / 132 / -(-ctas // 132) >= paged_config.WAVE_FILL


# ---------------------------------------------------------------- the kernels, replayed


def _partial(qn, qp, ckv, kpe, pt, seq, op_, lp, scale_log2, per, page_size, cu, causal, *,
             heads, qtokens):  # fmt: skip
    """The partial pass (decode.py) of CTA (split, head block, sequence): rows (token i, head
    h) of `heads` x `qtokens`; the split's keys in tiles of TILE, each tile's scores over all
    its keys at once (the warps share one running max per row), keys clamped to the split's
    last and masked past it / past the causal limit; P in q's dtype before P V."""
    _, hq, _ = qn.shape
    assert hq % heads == 0 and heads * qtokens <= ROWS and (cu is None) == (qtokens == 1)
    rows = [(i, h) for i in range(qtokens) for h in range(heads)]
    for b in range(seq.shape[0]):
        q_off, sq = (b, 1) if cu is None else (int(cu[b]), int(cu[b + 1] - cu[b]))
        sk = int(seq[b])
        for h0 in range(0, hq, heads):
            zero = torch.zeros(LATENT + 64, dtype=torch.float64)
            q = torch.stack([
                torch.cat([qn[q_off + i, h0 + h], qp[q_off + i, h0 + h]]).double()
                if i < sq else zero for i, h in rows
            ])  # fmt: skip
            for s in range(op_.shape[0]):
                t0, t1 = s * per, min(s * per + per, sk)
                limit = torch.tensor(
                    [(min(t1, sk - sq + i + 1) if causal else t1) if i < sq else 0 for i, _ in rows]
                )
                m = torch.full((len(rows),), -math.inf, dtype=torch.float64)
                lsum = torch.zeros(len(rows), dtype=torch.float64)
                o = torch.zeros(len(rows), LATENT, dtype=torch.float64)
                for first in range(t0, t1, TILE):
                    t = torch.arange(first, first + TILE).clamp(max=t1 - 1)
                    pages, slots = pt[b, t // page_size].long(), t % page_size
                    keys = torch.cat([ckv[pages, slots], kpe[pages, slots]], -1).double()
                    sc = q @ keys.T
                    key = torch.arange(first, first + TILE)
                    sc = torch.where(key[None, :] < limit[:, None], sc, -math.inf)
                    m_new = torch.maximum(m, sc.max(1).values)
                    base = torch.where(m_new > -math.inf, m_new * scale_log2, 0.0)
                    corr = torch.exp2(m * scale_log2 - base)
                    p = torch.exp2(sc * scale_log2 - base[:, None])
                    lsum = lsum * corr + p.sum(1)
                    o = o * corr[:, None] + p.to(qn.dtype).double() @ keys[:, :LATENT]
                    m = m_new
                for r, (i, h) in enumerate(rows):
                    if i < sq:
                        seen = bool(lsum[r] > 0)
                        op_[s, q_off + i, h0 + h] = o[r] / lsum[r] if seen else 0.0
                        lp[s, q_off + i, h0 + h] = (
                            m[r] * scale_log2 + torch.log2(lsum[r]) if seen else -math.inf
                        )


@pytest.fixture
def cpu_kernels(monkeypatch):
    """The launcher's kernels replaced by the replay; the calls' (params, scalar args)."""
    calls = []

    def get_kernel(spec, params):
        assert spec is SPEC
        p = dict(params)
        if p["kind"] == "combine":
            assert params == params_for("combine", p["dtype"])
            return combine_splits

        def partial(*args):
            assert args[0].dtype == getattr(torch, p["dtype"])
            calls.append((p, args[8:11], args[11] is not None))
            _partial(*args, heads=p["heads"], qtokens=p.get("qtokens", 1))

        return partial

    mla_launch._plans.clear()
    monkeypatch.setattr(mla_launch, "get_kernel", get_kernel)
    monkeypatch.setattr(mla_launch, "num_sms", lambda device: 132)
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    yield calls
    mla_launch._plans.clear()


def _problem(b, hq, page_size, lens, s_q=1, combined=False, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_pages = max(1, max(-(-n // page_size) for n in lens))
    pages = b * max_pages + 3
    if combined:
        ckv, kpe = torch.randn(pages, page_size, 1, LATENT + 64, generator=g).to(dtype), None
    else:
        ckv = torch.randn(pages, page_size, LATENT, generator=g).to(dtype)
        kpe = torch.randn(pages, page_size, 64, generator=g).to(dtype)
    table = torch.randperm(pages, generator=g)[: b * max_pages].view(b, max_pages).int()
    qn = torch.randn(b, s_q, hq, LATENT, generator=g).to(dtype)
    qp = torch.randn(b, s_q, hq, 64, generator=g).to(dtype)
    return qn, qp, ckv, kpe, table, torch.tensor(lens, dtype=torch.int32)


def _assert_close(out, lse, want, want_lse, atol=2e-2):
    assert out.shape == want.shape and lse.shape == want_lse.shape
    assert float((out.float() - want).abs().max()) < atol
    finite = torch.isfinite(want_lse)
    assert torch.equal(finite, torch.isfinite(lse))
    assert float((lse[finite] - want_lse[finite]).abs().max()) < 1e-4


@pytest.mark.parametrize(
    ("b", "hq", "page_size", "lens", "s_q", "combined", "dtype"),
    [
        (3, 16, 64, [37, 0, 100], 1, True, torch.bfloat16),
        (2, 16, 1, [1, 70], 1, False, torch.float16),
        (1, 16, 16, [300], 1, False, torch.bfloat16),
        (2, 128, 16, [65, 200], 1, True, torch.bfloat16),
        (2, 24, 16, [40, 3], 1, False, torch.float16),
        (3, 16, 16, [40, 1, 130], 2, False, torch.bfloat16),
        (2, 16, 64, [4, 300], 4, True, torch.float16),
        (2, 32, 16, [3, 90], 3, False, torch.bfloat16),
    ],
)
def test_decode_matches_the_reference(cpu_kernels, b, hq, page_size, lens, s_q, combined, dtype):
    qn, qp, ckv, kpe, table, seq = _problem(b, hq, page_size, lens, s_q, combined, dtype)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, return_lse=True)
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    assert out.dtype == dtype and lse.is_contiguous()
    _assert_close(out, lse, want, want_lse)
    assert torch.all(out.transpose(1, 2)[torch.isneginf(want_lse)] == 0)
    params, (scale_log2, per, ps), packed = cpu_kernels[-1]
    qtokens = next(t for t in QTOKENS if t >= s_q)
    assert params.get("qtokens", 1) == qtokens and packed == (s_q > 1)
    assert params["heads"] == heads_per_cta(hq, qtokens) and ps == page_size
    assert abs(scale_log2 - SCALE * math.log2(math.e)) < 1e-9
    max_tokens = table.shape[1] * page_size
    assert per == split_plan(b, hq // params["heads"], max_tokens, 132, 1)[1]


def test_mtp_without_causal_mask(cpu_kernels):
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [2, 50, 1], s_q=2)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, causal=False,
                             return_lse=True)  # fmt: skip
    want, want_lse = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE, causal=False)
    _assert_close(out, lse, want, want_lse)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(("q_lens", "k_lens"), [([1, 3, 0, 2], [40, 3, 10, 0]), ([4, 4], [4, 130]),
                                                ([1, 0, 1], [17, 5, 0])])  # fmt: skip
def test_packed_form(cpu_kernels, causal, q_lens, k_lens):
    """cu_seqlens_q: q (total_q, H, *), LSE (H, total_q); max_seqlen_q 1 still runs the packed
    kernel (a sequence may bring no token)."""
    b = len(q_lens)
    _, _, ckv, kpe, table, seq = _problem(b, 16, 16, k_lens)
    g = torch.Generator().manual_seed(3)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    qn = torch.randn(int(cu[-1]), 16, LATENT, generator=g).to(torch.bfloat16)
    qp = torch.randn(int(cu[-1]), 16, 64, generator=g).to(torch.bfloat16)
    out, lse = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, cu_seqlens_q=cu,
                             max_seqlen_q=max(q_lens), causal=causal,
                             return_lse=True)  # fmt: skip
    want, want_lse = mla_prefill_ref(qn, qp, ckv, kpe, table, seq, cu, SCALE, causal)
    _assert_close(out, lse, want, want_lse)
    params, _, packed = cpu_kernels[-1]
    assert packed and params["qtokens"] == next(t for t in QTOKENS if t >= max(2, max(q_lens)))


@pytest.mark.parametrize("s_q", [1, 2])
def test_out_is_written_in_place(cpu_kernels, s_q):
    """A NaN-poisoned out is the result, every element written; an out whose rows are not
    contiguous (or whose (batch, s_q) cannot be one dim) gets the result copied in."""
    qn, qp, ckv, kpe, table, seq = _problem(3, 16, 16, [5, 0, 70], s_q=s_q, combined=True)
    want, _ = mla_decode_ref(qn, qp, ckv, kpe, table, seq, SCALE)
    out = torch.full_like(qn, float("nan"))
    got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=out)
    assert got is out and float((out.float() - want).abs().max()) < 2e-2
    strided = torch.full((3, 16, s_q, LATENT * 2), float("nan"), dtype=qn.dtype)
    for view in (strided.transpose(1, 2)[..., :LATENT], strided.transpose(1, 2)[..., ::2]):
        got = op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, out=view)
        assert got is view and float((view.float() - want).abs().max()) < 2e-2


@pytest.mark.parametrize("page_size", [1, 64])
def test_flashinfer_bench_adapter(cpu_kernels, page_size):
    """FlashInfer-Bench's decode definition's inputs as they are: against reference.mla's run
    of them, and the definition's own reference by its benchmark's criterion."""
    name = f"mla_paged_decode_h16_ckv512_kpe64_ps{page_size}"
    _, _, ckv, kpe, table, seq = _problem(4, 16, page_size, [1, 0, 300, 65], seed=2)
    indptr, indices, last = page_table_to_csr(table, seq, page_size)
    g = torch.Generator().manual_seed(4)
    inputs = {
        "q_nope": torch.randn(4, 16, LATENT, generator=g).to(torch.bfloat16),
        "q_pe": torch.randn(4, 16, 64, generator=g).to(torch.bfloat16),
        "ckv_cache": ckv, "kpe_cache": kpe, "kv_indptr": indptr, "kv_indices": indices,
        "sm_scale": 1 / math.sqrt(192),
    }  # fmt: skip
    if page_size > 1:
        inputs["kv_last_page_len"] = last
    out, lse = op.mla_paged_decode_flashinfer(**inputs)
    want, want_lse = mla_flashinfer_decode(**inputs)
    _assert_close(out, lse, want, want_lse)
    # a wider table (another split plan): the same result up to rounding
    _assert_close(*op.mla_paged_decode_flashinfer(**inputs, max_pages=table.shape[1] + 9), want,
                  want_lse)  # fmt: skip
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    defs.check_inputs(defn, inputs)
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(lse, theirs_lse) == 0


def test_flashinfer_adapter_with_no_pages(cpu_kernels):
    _, _, ckv, kpe, _, _ = _problem(2, 16, 64, [1])
    q = torch.randn(2, 16, LATENT).bfloat16()
    empty = torch.zeros(0, dtype=torch.int32)
    out, lse = op.mla_paged_decode_flashinfer(q, q[..., :64], ckv, kpe, torch.zeros(3).int(),
                                              empty, 0.1, torch.zeros(2).int())  # fmt: skip
    assert torch.all(out == 0) and torch.all(torch.isneginf(lse))


# ---------------------------------------------------------------- arguments


def _args(**change):
    bf = torch.bfloat16
    args = {
        "q_nope": torch.randn(2, 1, 16, LATENT).to(bf),
        "q_pe": torch.randn(2, 1, 16, 64).to(bf),
        "ckv_cache": torch.randn(10, 16, LATENT).to(bf),
        "kpe_cache": torch.randn(10, 16, 64).to(bf),
        "page_table": torch.zeros(2, 4, dtype=torch.int32),
        "seqlens_k": torch.ones(2, dtype=torch.int32),
    }
    kwargs = {"softmax_scale": SCALE}
    for k, v in change.items():
        (args if k in args else kwargs)[k] = v
    return args, kwargs


@pytest.mark.parametrize(
    ("change", "err", "match"),
    [
        ({"q_nope": torch.zeros(2, 1, 16, 256, dtype=torch.bfloat16)}, ValueError, "D = 512"),
        ({"q_nope": torch.zeros(2, 16, 512, dtype=torch.bfloat16)}, ValueError, "batch, s_q"),
        ({"q_pe": torch.zeros(2, 1, 16, 64)}, TypeError, "q_pe must have dtype"),
        ({"q_nope": torch.zeros(2, 5, 16, 512, dtype=torch.bfloat16),
          "q_pe": torch.zeros(2, 5, 16, 64, dtype=torch.bfloat16)}, ValueError, "s_q must be"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float16)}, TypeError, "ckv_cache"),
        ({"kpe_cache": torch.zeros(10, 8, 64, dtype=torch.bfloat16)}, ValueError, "kpe_cache"),
        ({"ckv_cache": torch.zeros(10, 16, 512, dtype=torch.float8_e4m3fn)}, NotImplementedError,
         "issue 19"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 656, dtype=torch.uint8), "kpe_cache": None},
         NotImplementedError, "FP8"),
        ({"ckv_cache": torch.zeros(10, 64, 1, 512, dtype=torch.bfloat16), "kpe_cache": None},
         ValueError, "combined"),
        ({"page_table": torch.zeros(2, 4, dtype=torch.int64)}, TypeError, "page_table must"),
        ({"page_table": torch.zeros(3, 4, dtype=torch.int32)}, ValueError, "batch of 2"),
        ({"seqlens_k": torch.zeros(3, dtype=torch.int32)}, ValueError, "seqlens_k must"),
        ({"cu_seqlens_q": torch.zeros(3, dtype=torch.int32)}, ValueError, "come together"),
        ({"softmax_scale": None}, TypeError, "no default"),
        ({"softmax_scale": -1.0}, ValueError, "softmax_scale"),
        ({"out": torch.zeros(2, 1, 16, 512)}, TypeError, "out must have dtype"),
    ],
)  # fmt: skip
def test_bad_arguments(monkeypatch, change, err, match):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    args, kwargs = _args(**change)
    with pytest.raises(err, match=match):
        op.mla_decode(*args.values(), **kwargs)


def test_packed_limits_and_cache_rows(monkeypatch):
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)
    cu = torch.tensor([0, 5, 6], dtype=torch.int32)
    q = {"q_nope": torch.zeros(6, 16, 512).bfloat16(), "q_pe": torch.zeros(6, 16, 64).bfloat16()}
    args, kwargs = _args(**q, cu_seqlens_q=cu, max_seqlen_q=5)
    with pytest.raises(ValueError, match="max_seqlen_q must be 1..4"):
        op.mla_decode(*args.values(), **kwargs)
    wide = torch.zeros(10, 16, 65, dtype=torch.bfloat16)
    args, kwargs = _args(kpe_cache=wide[..., 1:])  # rows 2 bytes off 16
    with pytest.raises(ValueError, match="16-byte-aligned rows"):
        op.mla_decode(*args.values(), **kwargs)
    monkeypatch.undo()
    with pytest.raises(ValueError, match="CUDA tensor"):
        op.mla_decode(*_args()[0].values(), softmax_scale=SCALE)


# ---------------------------------------------------------------- suite and tracing


def test_suite_is_registered():
    """Registered since its first GPU check passed (2026-12-01)."""
    assert SUITE_MODULES["mla_decode"] == "forgekernel.bench.suites.mla_decode"
    assert "mla_decode" not in PENDING_SUITE_MODULES
    s = mla_decode.suite()
    assert s.sanitize_cases and all(c.name for c in s.bench_cases)
    assert len({c.name for c in s.bench_cases + s.check_cases}) == len(s.bench_cases) + len(
        s.check_cases
    )


def test_suite_work_counts():
    case = mla_decode._case(2, 16, 64, (10, 3), s_q=4)
    # visible pairs: sk 10 -> 7 + 8 + 9 + 10, sk 3 -> 0 + 1 + 2 + 3
    assert mla_decode.flops(case) == 2 * (576 + 512) * 16 * (34 + 6)
    assert mla_decode.nbytes(case, torch.bfloat16) == 13 * 1152 + 8 * 16 * (1088 * 2 + 4)


@pytest.mark.parametrize("case", mla_decode.CHECK_CASES, ids=lambda c: c.name)
def test_suite_check_passes_on_the_algorithm(cpu_kernels, case):
    """The suite's own check (`bench.check.verify`: NaN-poisoned outputs, 2x the
    rounding yardstick + atol, -inf LSEs reproduced) with the kernels' algorithm standing in."""
    suite = mla_decode.suite()
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    _, cmps = verify(suite, inputs, torch.device("cpu"))
    assert all(c.ok for c in cmps), [c.message for c in cmps]


def _fake_inputs(s_q=1, packed=False, combined=False):
    """(q_nope, q_pe, ckv, kpe or None, page_table, seqlens_k, cu_seqlens_q or None), CUDA."""
    cuda = {"device": "cuda", "dtype": torch.bfloat16}
    lead = (7,) if packed else (3, s_q)
    qn, qp = torch.empty(*lead, 16, 512, **cuda), torch.empty(*lead, 16, 64, **cuda)
    if combined:
        ckv, kpe = torch.empty(10, 64, 1, 576, **cuda), None
    else:
        ckv, kpe = torch.empty(10, 64, 512, **cuda), torch.empty(10, 64, 64, **cuda)
    index = {"device": "cuda", "dtype": torch.int32}
    cu = torch.empty(4, **index) if packed else None
    return qn, qp, ckv, kpe, torch.empty(3, 4, **index), torch.empty(3, **index), cu


def _call(qn, qp, ckv, kpe, table, seq, cu, **kwargs):
    packed = {} if cu is None else {"cu_seqlens_q": cu, "max_seqlen_q": 4}
    return op.mla_decode(qn, qp, ckv, kpe, table, seq, softmax_scale=SCALE, **packed, **kwargs)


@pytest.mark.parametrize(
    ("form", "out_shape", "lse_shape"),
    [({}, (3, 1, 16, 512), (3, 16, 1)), ({"s_q": 3}, (3, 3, 16, 512), (3, 16, 3)),
     ({"packed": True}, (7, 16, 512), (16, 7)), ({"combined": True}, (3, 1, 16, 512), (3, 16, 1))],
)  # fmt: skip
def test_fake_implementation_under_make_fx(form, out_shape, lse_shape):
    """torch.compile / CUDA-graph support: on fake CUDA tensors the custom op's fake gives the
    shapes, nothing runs, and make_fx records the op."""
    with FakeTensorMode():
        o, lse = _call(*_fake_inputs(**form), return_lse=True)
        assert o.shape == out_shape and o.dtype == torch.bfloat16
        assert lse.shape == lse_shape and lse.dtype == torch.float32
    with FakeTensorMode(allow_non_fake_inputs=True):
        graph = make_fx(lambda *x: _call(*x) * 2, tracing_mode="fake")(*_fake_inputs(**form))
    assert "forgekernel.mla_decode" in str(graph.graph)
