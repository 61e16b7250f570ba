"""FlashInfer-Bench's gqa_ragged prefill and gemm definitions through bench/flashinfer_defs'
`run_kernel` on the CPU: the real public ops (attention_varlen, gemm) with only their launchers
replaced by reference/ (attention_varlen_ref and gemm_ref, fp32), so what is proven here is the
adapter: the definition's tensors taken as they are, the host ints the ops need, the output
conversion (LSE natural log -> base 2, (Hq, total_q) -> (total_q, Hq), dtypes), judged against
the definition's own reference by its benchmark's criterion. Also: every definition in the
dataset is served by an adapter or listed in NOT_SERVED, and run_kernel hands the mla_paged,
dsa_paged and gdn definitions to their ops' own adapters (their numbers: the tests of those
ops). Skipped where the definitions directory is absent."""

from __future__ import annotations

import importlib
import math

import pytest
import torch

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference.attention import attention_varlen_ref
from forgekernel.reference.gemm import gemm_ref

varlen_module = importlib.import_module("forgekernel.ops.attention_varlen")
gemm_module = importlib.import_module("forgekernel.ops.gemm")
gemm_launch = importlib.import_module("forgekernel.kernels.gemm.dense.sm90.launch")

RAGGED = defs.RAGGED_GQA_PREFILL[0]
GEMM = defs.GEMM[0]
# Definitions run_kernel serves through an op's own FlashInfer adapter: (module, name).
OWN_ADAPTERS = {
    "dsa_topk_indexer_fp8_h64_d128_topk2048_ps64": ("dsa_indexer", "dsa_topk_indexer_flashinfer"),
    **{
        f"mla_paged_decode_h16_ckv512_kpe64_ps{ps}": ("mla", "mla_paged_decode_flashinfer")
        for ps in (1, 64)
    },
    **{
        f"mla_paged_prefill_causal_h16_ckv512_kpe64_ps{ps}": ("mla", "mla_paged_prefill_flashinfer")
        for ps in (1, 64)
    },
    **{
        f"dsa_sparse_attention_h16_ckv512_kpe64_topk2048_ps{ps}": (
            "dsa",
            "dsa_sparse_attention_flashinfer",
        )
        for ps in (1, 64)
    },
    "gdn_decode_qk4_v8_d128_k_last": ("gated_delta_rule", "gdn_decode_flashinfer"),
    "gdn_mtp_qk4_v8_d128_k_last": ("gated_delta_rule", "gdn_mtp_flashinfer"),
    "gdn_prefill_qk4_v8_d128_k_last": ("gated_delta_rule_chunked", "gdn_prefill_flashinfer"),
}


def _definition(name: str) -> defs.Definition:
    why = defs.missing(name)
    if why:
        pytest.skip(why)
    return defs.load_definition(name)


@pytest.fixture
def varlen_on_reference(monkeypatch):
    """attention_varlen's launcher replaced by the fp32 reference, written into the op's own
    buffers (o in q's dtype, lse (Hq, total_q)); records (max_seqlen_q, max_seqlen_k)."""
    calls = []

    def launch(q, k, v, o, lse, seqs, scale, causal):
        assert causal and o.dtype == q.dtype and lse.shape == (q.shape[1], q.shape[0])
        ref_o, ref_lse = attention_varlen_ref(q, k, v, seqs[0], seqs[1], causal, scale)
        o.copy_(ref_o)
        lse.copy_(ref_lse)
        calls.append(seqs[2:])

    monkeypatch.setattr(varlen_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(varlen_module, "_launch_varlen_fwd", launch)
    return calls


@pytest.fixture
def gemm_on_reference(monkeypatch):
    """gemm's launcher replaced by the fp32 reference rounded into `out`; records (a, b, b_kn)."""
    calls = []

    def launch(a, b, out, b_kn, config=None):
        out.copy_(gemm_ref(a, b, "kn" if b_kn else "nk"))
        calls.append((a, b, b_kn))

    monkeypatch.setattr(gemm_module, "check_cuda", lambda name, t: None)
    monkeypatch.setattr(gemm_launch, "gemm", launch)
    return calls


@pytest.mark.parametrize(
    "q_lens, k_lens",
    [
        ([1, 7, 33, 0, 5, 6], [1, 40, 33, 9, 0, 3]),  # empty q, empty kv, more q than kv
        ([17, 1, 64], [130, 1, 64]),
        ([3], [5]),
    ],
)
def test_ragged_definition_through_attention_varlen(varlen_on_reference, q_lens, k_lens):
    defn = _definition(RAGGED)
    inputs = defs.ragged_gqa_inputs(
        defn, q_lens, k_lens, generator=torch.Generator().manual_seed(0)
    )
    theirs_out, theirs_lse = defs.run_definition(defn, inputs)
    ours_out, ours_lse = defs.run_kernel(defn, inputs)
    assert varlen_on_reference == [(max(q_lens), max(k_lens))]
    assert ours_out.shape == theirs_out.shape and ours_out.dtype == torch.bfloat16
    assert ours_lse.shape == theirs_lse.shape and ours_lse.dtype == torch.float32
    assert torch.isfinite(ours_out).all()
    # Rows that see no key: their softmax leaves NaN, ours 0; both LSEs -inf.
    nan = theirs_out.isnan().any(-1)
    blind = sum(max(0, qn - kn) for qn, kn in zip(q_lens, k_lens) if kn)
    assert int(nan.sum()) == blind * defn.const("num_qo_heads")
    assert torch.all(ours_out[nan] == 0) and torch.all(torch.isneginf(ours_lse[nan]))
    assert defs.benchmark_failures(ours_out[~nan], theirs_out[~nan]) == 0
    assert defs.benchmark_failures(ours_lse, theirs_lse) == 0
    # Tighter than the benchmark: both are fp32 math, so a base or layout slip cannot hide.
    both_inf = torch.isneginf(ours_lse) & torch.isneginf(theirs_lse)
    assert float(torch.where(both_inf, 0.0, (ours_lse - theirs_lse).abs()).max()) < 1e-4


def test_ragged_lse_is_base_2_in_their_layout(varlen_on_reference):
    """One sequence, one query row, one key: LSE = scale * q . k / ln 2 per head."""
    defn = _definition(RAGGED)
    inputs = defs.ragged_gqa_inputs(defn, [1], [1], generator=torch.Generator().manual_seed(1))
    _, lse = defs.run_kernel(defn, inputs)
    group = defn.const("num_qo_heads") // defn.const("num_kv_heads")
    k = inputs["k"][0].float().repeat_interleave(group, dim=0)
    dot = (inputs["q"][0].float() * k).sum(-1) * inputs["sm_scale"]
    torch.testing.assert_close(lse[0], dot / math.log(2.0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("m", [1, 7, 33])
def test_gemm_definition_through_gemm(gemm_on_reference, m):
    defn = _definition(GEMM)
    inputs = defs.gemm_inputs(defn, m, generator=torch.Generator().manual_seed(m))
    (theirs,) = defs.run_definition(defn, inputs)
    (ours,) = defs.run_kernel(defn, inputs)
    ((a, b, b_kn),) = gemm_on_reference
    assert a is inputs["A"] and b is inputs["B"] and not b_kn  # as they are: B (N, K), no copy
    assert ours.shape == theirs.shape == (m, defn.const("N")) and ours.dtype == torch.float16
    assert torch.isfinite(ours).all()
    assert defs.benchmark_failures(ours, theirs) == 0


def test_input_builders_check_the_definition():
    defn = _definition(RAGGED)
    with pytest.raises(ValueError, match="query lengths"):
        defs.ragged_gqa_inputs(defn, [1, 2], [3])
    inputs = defs.ragged_gqa_inputs(defn, [2, 3], [4, 3], generator=torch.Generator())
    inputs["qo_indptr"] = torch.tensor([0, 2, 4], dtype=torch.int32)
    with pytest.raises(ValueError, match="total_q"):
        defs.check_inputs(defn, inputs)
    gemm = _definition(GEMM)
    assert {t.dtype for t in defs.gemm_inputs(gemm, 3).values()} == {torch.float16}


@pytest.mark.parametrize("name", sorted(defs.NOT_SERVED))
def test_run_kernel_refuses_what_no_op_serves(name):
    defn = _definition(name)
    assert defn.op_type not in defs.KERNEL_ADAPTERS
    with pytest.raises(NotImplementedError, match=defn.op_type):
        defs.run_kernel(defn, {})


@pytest.mark.parametrize("name", sorted(OWN_ADAPTERS))
def test_run_kernel_hands_own_adapter_definitions_over(monkeypatch, name):
    """By op_type and name: the op's own adapter gets the definition's inputs by keyword, as
    they are (the same objects), and its outputs come back as a tuple."""
    defn = _definition(name)
    module, function = OWN_ADAPTERS[name]
    calls = []

    def adapter(**kwargs):
        calls.append(kwargs)
        return [f"out{i}" for i in range(len(defn.outputs))]

    monkeypatch.setattr(importlib.import_module(f"forgekernel.ops.{module}"), function, adapter)
    inputs = {n: object() for n in defn.inputs}
    assert defs.run_kernel(defn, {**inputs, "extra": 1}) == tuple(
        f"out{i}" for i in range(len(defn.outputs))
    )
    assert len(calls) == 1 and calls[0].keys() == inputs.keys()
    assert all(calls[0][n] is x for n, x in inputs.items())


def test_run_kernel_refuses_an_unknown_name_of_a_served_op_type():
    defn = defs.Definition("gdn_unknown_stage", {}, {}, {}, (), "", (), op_type="gdn")
    with pytest.raises(NotImplementedError, match="gdn_unknown_stage"):
        defs.run_kernel(defn, {})


def test_mla_prefill_definition_bounds_no_query_count():
    """The definition bounds no sequence's query count: served by ops.mla.mla_prefill (any
    count), not by mla_decode's <= 4 tokens."""
    defn = _definition("mla_paged_prefill_causal_h16_ckv512_kpe64_ps64")
    assert defn.axes["total_q"]["type"] == "var"
    assert not any("qo_indptr[1:]" in rule for rule in defn.constraints)
    assert callable(importlib.import_module("forgekernel.ops.mla").mla_prefill)


def test_every_definition_is_served_or_listed():
    why = defs.missing()
    if why:
        pytest.skip(why)
    names = sorted(p.stem for p in defs.definitions_dir().glob("*.json"))
    for name in names:
        defn = defs.load_definition(name)
        served = defn.op_type in defs.KERNEL_ADAPTERS or name in OWN_ADAPTERS
        assert served != (name in defs.NOT_SERVED), name
    assert set(defs.NOT_SERVED) <= set(names)
    for module, function in OWN_ADAPTERS.values():
        assert callable(getattr(importlib.import_module(f"forgekernel.ops.{module}"), function))
