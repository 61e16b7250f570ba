"""The Gated DeltaNet prefill forward on the GPU against the fp64 recurrence (issue 20): varlen
with empty and odd sequences, both state layouts, with and without an initial state, l2norm,
grouped value heads, fp16 and bf16; the FlashInfer-Bench definition through its adapter; and
fla's chunk_gated_delta_rule where it is installed."""

from __future__ import annotations

import importlib

import pytest
import torch
import torch.nn.functional as F

from forgekernel.bench import flashinfer_defs as defs
from forgekernel.reference.delta_rule import gated_delta_rule_recurrent

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")


def _inputs(lens, h, hv, dtype, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    total = sum(lens)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q, k = rnd(1, total, h, 128).to(dtype), (rnd(1, total, h, 128) * 0.1).to(dtype)
    v = rnd(1, total, hv, 128).to(dtype)
    g, beta = F.logsigmoid(rnd(1, total, hv) + 2.0), torch.sigmoid(rnd(1, total, hv))
    state = rnd(len(lens), hv, 128, 128) * 0.1
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], device="cuda")
    return q, k, v, g, beta, state, cu


def _close(got, want, rel):
    err = float((got.double() - want.double()).abs().max())
    assert err <= rel * float(want.abs().max()) + 1e-5, err


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("lens", "h", "hv", "k_last", "l2norm", "with_state"),
    [
        ([1, 63, 0, 64, 65, 130], 2, 4, False, False, True),
        ([1000], 4, 8, True, True, True),
        ([3, 129, 7], 16, 32, False, True, False),
        ([300, 301], 16, 16, True, False, True),
    ],
)
def test_prefill_matches_the_recurrence(dtype, lens, h, hv, k_last, l2norm, with_state):
    q, k, v, g, beta, state, cu = _inputs(lens, h, hv, dtype)
    init = state if with_state else None
    theirs = None if init is None else (init.transpose(-1, -2).contiguous() if k_last else init)
    o, final = op.gated_delta_rule(q, k, v, g, beta, initial_state=theirs, output_final_state=True,
                                   cu_seqlens=cu.int(), use_qk_l2norm_in_kernel=l2norm,
                                   k_last=k_last)  # fmt: skip
    want_o, want_s = gated_delta_rule_recurrent(q, k, v, g, beta, initial_state=init,
                                                output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm=l2norm)  # fmt: skip
    _close(o, want_o, 2e-2)
    _close(final.transpose(-1, -2) if k_last else final, want_s, 1e-4)


def test_fixed_batch_and_torch_compile():
    q, k, v, g, beta, _, _ = _inputs([2 * 333], 2, 4, torch.bfloat16, seed=1)
    q, k, v, g, beta = (x.view(2, 333, *x.shape[2:]) for x in (q, k, v, g, beta))
    eager, _ = op.gated_delta_rule(q, k, v, g, beta)
    compiled, _ = torch.compile(op.gated_delta_rule, fullgraph=True)(q, k, v, g, beta)
    want, _ = gated_delta_rule_recurrent(q, k, v, g, beta)
    _close(eager, want, 2e-2)
    assert torch.equal(eager, compiled)


def test_flashinfer_prefill_definition():
    name = "gdn_prefill_qk4_v8_d128_k_last"
    if defs.missing(name):
        pytest.skip(defs.missing(name))
    defn = defs.load_definition(name)
    lens = [5, 0, 700, 64]
    q, k, v, _, _, state, cu = _inputs(lens, 4, 8, torch.bfloat16, seed=2)
    gen = torch.Generator(device="cuda").manual_seed(3)
    inputs = {
        "q": q[0], "k": F.normalize(k[0].float(), dim=-1).bfloat16(), "v": v[0],
        "state": state, "A_log": torch.randn(8, device="cuda", generator=gen) * 0.5,
        "a": torch.randn(sum(lens), 8, device="cuda", generator=gen).bfloat16(),
        "dt_bias": torch.randn(8, device="cuda", generator=gen) * 0.5,
        "b": torch.randn(sum(lens), 8, device="cuda", generator=gen).bfloat16(),
        "cu_seqlens": cu, "scale": 0.0,
    }  # fmt: skip
    theirs_out, theirs_state = defs.run_definition(defn, inputs)
    out, new_state = op.gdn_prefill_flashinfer(**inputs)
    assert defs.benchmark_failures(out, theirs_out) == 0
    assert defs.benchmark_failures(new_state, theirs_state) == 0


def test_fla_agrees():
    fla = pytest.importorskip("fla.ops.gated_delta_rule")
    q, k, v, g, beta, state, cu = _inputs([100, 4000, 33], 4, 8, torch.bfloat16, seed=4)
    k = F.normalize(k.float(), dim=-1).bfloat16()
    ours, s_ours = op.gated_delta_rule(q, k, v, g, beta, initial_state=state,
                                       output_final_state=True, cu_seqlens=cu)  # fmt: skip
    theirs, s_theirs = fla.chunk_gated_delta_rule(
        q, k, v, g, beta, initial_state=state, output_final_state=True, cu_seqlens=cu
    )
    _close(ours, theirs, 3e-2)
    _close(s_ours, s_theirs, 1e-2)
