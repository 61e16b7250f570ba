"""Recorded tuning winners: stored atomically, seen by the next lookup, used by the GEMM launcher
for exactly the tuned problem and nothing else."""

import torch

from forgekernel.kernels.gemm.dense.sm90 import launch as gemm_sm90
from forgekernel.kernels.gemm.dense.sm90.config import SKINNY_64, WIDE, choose_config
from forgekernel.runtime import tuning


def test_record_then_load(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    tuning.load.cache_clear()
    assert tuning.load("k") == {}
    path = tuning.record("k", "a", {"x": 1})
    tuning.record("k", "b", {"x": 2})
    assert path == tmp_path / "k.json"
    assert tuning.load("k") == {"a": {"x": 1}, "b": {"x": 2}}
    tuning.load.cache_clear()


def test_gemm_uses_a_recorded_winner_for_that_problem_only(tmp_path, monkeypatch):
    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    tuning.load.cache_clear()
    key = gemm_sm90.tuning_key(torch.bfloat16, False, 8192, 8192, 8192)
    tuning.record(gemm_sm90.SPEC.name, key, {"config": WIDE.__dict__})
    assert gemm_sm90.config_for(torch.bfloat16, False, 8192, 8192, 8192) == WIDE
    assert gemm_sm90.config_for(torch.float16, False, 8192, 8192, 8192) == choose_config(
        8192, 8192, 8192
    )
    assert gemm_sm90.config_for(torch.bfloat16, False, 64, 8192, 8192) == SKINNY_64
    tuning.load.cache_clear()


def test_a_winner_recorded_with_a_dropped_knob_falls_back_to_the_default(tmp_path, monkeypatch):
    """Split K and ping-pong left the GEMM: a record that turns one on names no kernel."""
    monkeypatch.setenv("FORGEKERNEL_TUNING_DIR", str(tmp_path))
    tuning.load.cache_clear()
    key = gemm_sm90.tuning_key(torch.bfloat16, False, 128, 8192, 8192)
    old = {**WIDE.__dict__, "split_k": 2, "pingpong": False}
    tuning.record(gemm_sm90.SPEC.name, key, {"config": old})
    want = choose_config(128, 8192, 8192)
    assert gemm_sm90.config_for(torch.bfloat16, False, 128, 8192, 8192) == want
    tuning.load.cache_clear()
