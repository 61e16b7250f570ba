"""scripts/gemm_worst_probe.py on the CPU: its rows are configurations `forgekernel build --only
gemm_dense_sm90 --candidates` builds (the docstring's promise), and the "pick" row's tag is the
configuration the op runs (launch.py `_choose`: a tuning record first, the device's SM count),
not the chooser's at 132 SMs."""

from __future__ import annotations

import dataclasses

import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.kernels.gemm.dense.sm90 import config as C
from forgekernel.kernels.gemm.dense.sm90 import launch

probe = load_script("gemm_worst_probe")


def test_rows_are_built_configurations():
    built = set(C.STANDARD_CONFIGS) | set(C.CANDIDATES)
    for shape, rows in probe.ROWS.items():
        assert rows[0] == ("pick", None), shape
        for label, cfg in rows[1:]:
            assert cfg in built, (shape, label)


def test_pick_is_the_ops_configuration(monkeypatch):
    m, n, k = 16384, 4608, 3584
    monkeypatch.setattr(probe, "num_sms", lambda index: 114)
    monkeypatch.setattr(launch.tuning, "load", lambda name: {})
    assert probe.pick(m, n, k, torch.device("cuda", 0)) == C.choose_config(m, n, k, 114)
    key = launch.tuning_key(torch.bfloat16, False, m, n, k)
    table = {key: {"config": dataclasses.asdict(C.TALL_96)}}
    monkeypatch.setattr(launch.tuning, "load", lambda name: table)
    assert probe.pick(m, n, k, torch.device("cuda", 0)) == C.TALL_96
