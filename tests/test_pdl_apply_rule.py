"""scripts/pdl_apply_rule.py: the wave probe's two verdicts -> PARTIAL_WAVE, rewritten in a copy
of runtime/pdl.py (the device and this machine must make the same edit from the same JSON)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
ROWS = [
    {"ctas": 80, "graph": {"top": 10.0, "off": 8.0, "late": 8.0}},
    {"ctas": 96, "graph": {"top": 10.0, "off": 9.9, "late": 9.8}},
]


@pytest.fixture
def apply(tmp_path, monkeypatch):
    spec = importlib.util.spec_from_file_location(
        "pdl_apply_rule", ROOT / "scripts" / "pdl_apply_rule.py"
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    pdl = tmp_path / "pdl.py"
    pdl.write_text((ROOT / "forgekernel" / "runtime" / "pdl.py").read_text())
    monkeypatch.setattr(mod, "PDL", pdl)

    def run(dense: str, fp8: str):
        probe = tmp_path / "probe.json"
        sweeps = [{"dtype": "bfloat16", "verdict": dense, "rows": ROWS},
                  {"dtype": "float8", "verdict": fp8, "rows": ROWS[:1]}]  # fmt: skip
        probe.write_text(json.dumps({"gpu": "test", "sweeps": sweeps}))
        monkeypatch.setattr(sys, "argv", ["pdl_apply_rule.py", str(probe)])
        mod.main()
        text = pdl.read_text()
        scope: dict = {}
        line = next(x for x in text.splitlines() if x.startswith("PARTIAL_WAVE:"))
        exec(line.replace("PARTIAL_WAVE: tuple[str, int, int] | None", "PARTIAL_WAVE"), scope)
        return scope["PARTIAL_WAVE"]

    return run


@pytest.mark.parametrize(
    "dense, fp8, rule",
    [
        ("1: the late trigger everywhere", "1: the late trigger everywhere", ("late", 0, 132)),
        ("1: the late trigger everywhere", "2: late in the band", ("late", 66, 96)),
        ("2: late in the band", "4 (no loss at 72-88 CTAs)", ("late", 66, 96)),
        ("3: PDL off in the band", "3: PDL off in the band", ("off", 66, 80)),
        ("3: PDL off in the band", "2: late in the band", None),
        ("none of 1-4", "2: late in the band", None),
        ("4 (no loss at 72-88 CTAs)", "4 (no loss at 72-88 CTAs)", None),
    ],
)
def test_the_verdicts_give_the_rule(apply, dense, fp8, rule):
    assert apply(dense, fp8) == rule
