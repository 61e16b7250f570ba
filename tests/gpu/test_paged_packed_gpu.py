"""The chunked-prefill batch in one GQA-packed launch of the forward's paged mode on views of q /
out / lse (the op's default since 2026-12-04, `ops.attention_paged.prefill_form("packed_views")`:
`launch.attention_paged_fwd(packed=True)`, the `view_group` compiles) on the GPU against the
fp32 reference: decode rows of 1-4 query tokens beside chunks, page sizes 8 to 256, D 64 / 128
/ 256, every G of config.VIEW_GROUPS (1, 2, 4, 8, 16) and G without a compile (3, 6, 12: the
split), sequences without queries or keys, more queries than keys, NaN in every cache slot no
sequence owns (`test_paged_gpu._prefill_problem`), NaN-poisoned out and lse, both dtypes and
masks, every key looked up standard (no compile at call time); the split form on the same
batch; a CUDA graph of the packed call replayed on new lengths; torch.compile. The CPU replay
of the same path: tests/test_attention_paged_packed.py."""

from __future__ import annotations

import importlib

import pytest
import torch
from test_paged_gpu import (  # tests/gpu is on the path
    _prefill_problem,
    check_graph_replay_and_compile,
    check_prefill,
    graph_problem,
    record_kernel_lookups,
)

from forgekernel.kernels.attention.fwd.sm90 import SPEC
from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_launch
from forgekernel.kernels.attention.fwd.sm90.config import PAGED_HEAD_DIMS, VIEW_GROUPS

pytestmark = pytest.mark.gpu
op = importlib.import_module("forgekernel.ops.attention_paged")

# the bench's c1024-4096+64dec (G 8), with 24 decode rows
DECODE_24 = ([1] * 24 + [4096, 1024], [3000 + 37 * i for i in range(24)] + [4096, 17408])
PACKED_CASES = [
    # hq, hkv, d, page_size, q_lens, k_lens, combined
    (32, 8, 128, 16, [1, 3, 0, 130, 4, 2, 7], [40, 300, 9, 257, 4, 2000, 7], False),  # G 4
    (32, 8, 128, 64, [1, 1, 2048, 2, 513], [4000, 77, 16384, 9, 513], False),
    (64, 8, 128, 16, *DECODE_24, False),
    (8, 8, 64, 32, [200, 1, 5, 3, 300], [250, 17, 385, 1, 1000], False),  # MHA, 192-row tiles
    (12, 4, 128, 8, [2, 12, 40, 1, 100], [21, 21, 40, 5, 1001], True),  # G 3, page 8, combined
    (32, 4, 64, 16, [40, 4, 6, 9], [20, 0, 3, 0], False),  # more queries than keys, no keys
    (32, 8, 128, 256, [7, 1, 140, 4, 1000], [300, 600, 140, 3, 2000], False),  # 2 tiles a page
    (16, 2, 256, 128, [70, 1, 4, 129], [190, 6, 700, 4096], False),  # G 8, 64-row boxes
]


STANDARD = set(SPEC.standard_params())


def _run_default(monkeypatch, case, dtype, causal, seed):
    """The op in its default form on `case`, checked against the reference: the packed
    compile of the case's G where it has one (one launch, no decode part), else the split (the
    decode part, then the split's compile); every key looked up standard."""
    hq, hkv, d, ps, q_lens, k_lens, combined = case
    q, k, v, table, seq, cu = _prefill_problem(hq, hkv, d, ps, q_lens, k_lens, dtype, combined,
                                               seed=seed)  # fmt: skip
    looked_up = record_kernel_lookups(monkeypatch)
    decode, real = [], op.paged_sm90.paged_decode
    monkeypatch.setattr(op.paged_sm90, "paged_decode",
                        lambda *a, **kw: decode.append(a) or real(*a, **kw))  # fmt: skip
    out = torch.full_like(q, float("nan"))
    lse = torch.full((hq, q.shape[0]), float("nan"), device="cuda")
    op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=max(q_lens),
                       causal=causal, return_lse=True, out=out, lse=lse)  # fmt: skip
    group = fwd_launch.view_group(hq // hkv, d)
    assert [(p["page_box"], p.get("view_group", 0)) for p in looked_up] == [
        (fwd_launch.paged_box(ps, d), group)
    ]
    assert all(tuple(sorted(p.items())) in STANDARD for p in looked_up)
    assert bool(decode) == (not group)  # packed: one launch; split: the decode part first
    check_prefill(out, lse, q, k, v, table, seq, cu, causal, combined)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "case", PACKED_CASES, ids=lambda c: f"h{c[0]}_{c[1]}_d{c[2]}_p{c[3]}_q{sum(c[4])}"
)
def test_packed_prefill_matches_the_reference(monkeypatch, case, dtype, causal):
    _run_default(monkeypatch, case, dtype, causal, seed=len(case[4]) + case[3] + 100)


# Every standard packed compile's G at each paged head dim, pages 8 to 128 (boxes 8 to the
# tile), and G without a compile (the split): 3 and 12 everywhere, 6 at D 64 (it divides the
# 192-row tile but has no compile). One batch shape: decode rows of 1, 4 and 2 tokens, a
# sequence without queries, a 150-token chunk (2400 packed rows at G 16), more queries than
# keys.
COVER_Q, COVER_K = [1, 4, 0, 150, 2, 37], [700, 129, 9, 300, 2, 30]
COVER_GROUPS = (*VIEW_GROUPS, 3, 6, 12)


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("page", [8, 16, 32, 64, 128])
@pytest.mark.parametrize("group", COVER_GROUPS)
@pytest.mark.parametrize("d", PAGED_HEAD_DIMS)
def test_every_standard_packed_compile(monkeypatch, d, group, page, dtype, causal):
    """The newly standard `view_group` compiles (D 64 / 128 / 256, both dtypes and masks, G 1
    / 2 / 4 / 8 / 16, boxes 8 to the tile) against the reference; G 3 / 6 / 12 through the
    split."""
    if group == 6 and d != 64:
        pytest.skip("G 6: the D 64 case (a divisor of its 192-row tile without a compile)")
    hkv = 4 if group == 1 else 2
    case = (hkv * group, hkv, d, page, COVER_Q, COVER_K, page == 32)  # page 32: combined view
    _run_default(monkeypatch, case, dtype, causal, seed=d + group + page)


def test_packed_and_split_forms_agree():
    """The forms on one batch (decode rows over the split plan's compact slots at the split,
    packed tiles on views in the default): the same attention, to rounding."""
    q_lens, k_lens = [300, 1, 0, 2000, 1, 3, 4], [800, 12345, 5000, 3000, 78, 40, 2]
    q, k, v, table, seq, cu = _prefill_problem(32, 8, 128, 64, q_lens, k_lens, torch.bfloat16,
                                               False, seed=7)  # fmt: skip
    with op.prefill_form("split"):
        split, split_lse = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu,
                                              max_seqlen_q=2000, return_lse=True)  # fmt: skip
    packed, packed_lse = op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu,
                                            max_seqlen_q=2000, return_lse=True)  # fmt: skip
    assert float((packed.float() - split.float()).abs().max()) < 2e-2
    finite = torch.isfinite(split_lse)
    assert torch.equal(finite, torch.isfinite(packed_lse))
    assert float((packed_lse[finite] - split_lse[finite]).abs().max()) < 1e-3


def test_packed_prefill_replays_in_a_graph_and_compiles():
    """The packed call (the default form: views, no copy, G 4) has no host read:
    `check_graph_replay_and_compile` on the split test's batch."""
    check_graph_replay_and_compile(*graph_problem())
