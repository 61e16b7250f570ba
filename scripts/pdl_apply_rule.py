"""Adopt the partial-wave rule the wave probe's verdicts name (docs/gemm/NOTES.md "PDL's trigger
and the partial wave", "Adopting a partial-wave rule"): rewrite `PARTIAL_WAVE` in
forgekernel/runtime/pdl.py from /tmp/probes/pdl_wave.json, the same edit on the device (before
the builds and checks of the same call) and here (on the fetched JSON), so that both trees hash
alike.

    python3 scripts/pdl_apply_rule.py [JSON]     prints the rule; rewrites pdl.py

Per sweep (dense bf16, FP8): verdict 1 -> ("late", 0, 132); 2 -> ("late", 66, H) with H the last
CTAs where top/late > 1.01; 3 -> ("off", 66, H) with H the last CTAs where off/top < 0.98; 4 ->
None. Both 1: late everywhere; 1 and 2: the band (66, the 2's H]; both 2 or both 3: the band up
to the larger H; one says 4: the other's rule (the band's form is never slower than top there by
the probe's own rows); late against off, or a verdict none of 1-4: None (read the table)."""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

PDL = Path(__file__).resolve().parent.parent / "forgekernel" / "runtime" / "pdl.py"
LINE = re.compile(r"^PARTIAL_WAVE: tuple\[str, int, int\] \| None = .*$", re.M)


def rule_of(sweep: dict) -> tuple[str, int, int] | None | str:
    """A sweep's rule: (form, low, H), low 0 for verdict 1 (late everywhere; H kept for a
    combination with a band); None for 4; "unknown" otherwise."""
    verdict = sweep.get("verdict", "")
    rows = [r for r in sweep["rows"] if "graph" in r]
    g = lambda r, a, b: r["graph"][a] / r["graph"][b]  # noqa: E731
    if verdict.startswith(("1:", "2:")):
        high = max([r["ctas"] for r in rows if g(r, "top", "late") > 1.01] or [104])
        return ("late", 0 if verdict.startswith("1:") else 66, high)
    if verdict.startswith("3:"):
        return ("off", 66, max([r["ctas"] for r in rows if g(r, "off", "top") < 0.98] or [104]))
    if verdict.startswith("4 "):
        return None
    return "unknown"


def main() -> None:
    path = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/probes/pdl_wave.json")
    data = json.loads(path.read_text())
    rules = [rule_of(s) for s in data["sweeps"]]
    for s, r in zip(data["sweeps"], rules):
        print(f"pdl_apply_rule: {s['dtype']}: verdict {s.get('verdict')!r} -> {r}")
    known = [r for r in rules if r != "unknown"]
    if len(known) != len(rules) or not rules:
        rule = None
    else:
        bands = [r for r in known if r is not None]
        if not bands:
            rule = None
        elif all(b[1] == 0 for b in bands):  # low 0: verdict 1, late everywhere
            rule = ("late", 0, 132)
        elif all(b[0] == bands[0][0] for b in bands):
            # late everywhere in one sweep, in a band in the other: the band, up to the last
            # CTAs where either sweep's top loses to late (outside it the band sweep's top wins)
            rule = (bands[0][0], 66, max(b[2] for b in bands))
        else:
            rule = None
    shown = "None" if rule is None else f'("{rule[0]}", {rule[1]}, {rule[2]})'
    text = PDL.read_text()
    assert LINE.search(text), "PARTIAL_WAVE line not found"
    PDL.write_text(LINE.sub(f"PARTIAL_WAVE: tuple[str, int, int] | None = {shown}", text, count=1))
    print(f"pdl_apply_rule: PARTIAL_WAVE = {rule!r} ({data.get('gpu')}, {data.get('date')})")


if __name__ == "__main__":
    main()
