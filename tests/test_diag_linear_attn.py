"""scripts/diag_linear_attn.py (the device ladder of tiny GDN / KDA prefill cases) on the CPU:
every case through its real op and launcher with the kernels' torch replays (tests/
gdn_prefill_replay.py, tests/kda_prefill_replay.py) in place of the compiled kernels, so that
the ladder's own setup (inputs, forced grid forms, references, verdicts) is right before it
spends device time; the compile keys it reports are the forms it names."""

from __future__ import annotations

import gdn_prefill_replay
import kda_prefill_replay
import pytest
from script_modules import load_script  # tests/ is on the path

from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch as gdn_launch
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch as kda_launch
from forgekernel.ops import gated_delta_rule_chunked as gdn_op
from forgekernel.ops import kda_chunked as kda_op

diag = load_script("diag_linear_attn", register=True)


@pytest.fixture
def replays(monkeypatch):
    def kda_kernel(spec, params):
        if spec.name == "kda_intra_sm90":
            return kda_prefill_replay.intra_kernel(dict(params))
        return kda_prefill_replay.kernel(dict(params))

    def gdn_kernel(spec, params):
        if spec is gdn_launch.T_PRE_SPEC:
            return gdn_prefill_replay.t_pre_kernel(dict(params))
        return gdn_prefill_replay.kernel(dict(params))

    monkeypatch.setattr(gdn_launch, "get_kernel", gdn_kernel)
    monkeypatch.setattr(kda_launch, "get_kernel", kda_kernel)
    for op in (gdn_op, kda_op):
        monkeypatch.setattr(op, "check_cuda", lambda name, t: None)


CHEAP = ["gdn-one-cta-L150", "gdn-split-L150", "gdn-split-varlen", "kda-one-cta-L150",
         "kda-split-varlen", "kda-varlen-l2norm"]  # fmt: skip


@pytest.mark.parametrize("name", CHEAP)
def test_case_passes_on_the_replays(replays, name):
    r = diag.run_one(name, device="cpu")
    assert r["ok"], r
    op, *_, split, _, k_last = diag.CASES[name]
    if op == "gdn":
        assert r["key"]["v_split"] == (2 if split else 1)
        assert r["key"]["k_last"] == k_last
    elif split is not None:
        assert r["key"]["value_split"] == split


def test_forced_forms_are_restored(replays):
    sms, choose = gdn_launch._sms, kda_launch.value_split
    diag.run_one("gdn-split-L37", device="cpu")
    diag.run_one("kda-split-L37", device="cpu")
    assert gdn_launch._sms is sms and kda_launch.value_split is choose
