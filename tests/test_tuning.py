"""Recorded tuning winners: stored atomically, seen by the next lookup, used by the GEMM op
for exactly the tuned problem and nothing else."""

import importlib

import torch

from forgekernel.kernels.gemm.dense.sm90.config import SKINNY_64, WIDE, choose_config
from forgekernel.runtime import tuning

gemm_op = importlib.import_module("forgekernel.ops.gemm")


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
    key = gemm_op._tuning_key(torch.bfloat16, False, 8192, 8192, 8192)
    tuning.record(gemm_op.SPEC.name, key, {"config": WIDE.__dict__})
    assert gemm_op._config_for(torch.bfloat16, False, 8192, 8192, 8192) == WIDE
    assert gemm_op._config_for(torch.float16, False, 8192, 8192, 8192) == choose_config(
        8192, 8192, 8192
    )
    assert gemm_op._config_for(torch.bfloat16, False, 64, 8192, 8192) == SKINNY_64
    tuning.load.cache_clear()
