"""Instruction mix of the MLA seesaw pass's steady pair loops (CPU only: the DSL compiles, ptxas
assembles, cuobjdump reads; MLA_NOTES.md, "next/mla-gap (2026-12-06)", plan item 4).

A steady loop is a backward branch's body of fewer than 1500 instructions holding 44 HGMMA (a
warpgroup's pair of tiles: S over 9 chunks + P V; tests/cubins.py `steady_loops`, which the
compile tests pin); each key has two, one a warpgroup. Printed
per loop: instructions, R2UR, IMAD + IADD3, ELECT, MUFU. With --flashmla CUBIN (an sm_90a
cubin of sgl-flash-mla's `_C_legacy` library, `cuobjdump -xelf all` of the wheel's .so), its
dense decode kernel's loops beside ours (read for counts only).

    python scripts/mla_loop_mix.py [--flashmla PATH]
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from collections import Counter
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE.parent / "tests"), str(_HERE.parent)]

from cubins import build, steady_loops  # noqa: E402

from forgekernel.kernels.attention.mla.sm90 import SPEC, params_for  # noqa: E402

KEYS = {
    "16x1 partial": {"heads": 16},
    "16x1 ranges (the scheduled call)": {"heads": 16, "worklist": True, "ranges": True},
    "64x1 partial": {"heads": 64},
    "32x2 partial": {"heads": 32, "qtokens": 2},
    "16x1 direct, scalar stores (unaligned out)": {"heads": 16, "direct": True},
    "16x1 direct ostore (b128 / b256 x 16 heads)": {"heads": 16, "direct": True, "ostore": True},
    "64x1 direct ostore (b64 / b128 x 128 heads)": {"heads": 64, "direct": True, "ostore": True},
    "32x2 direct ostore (MTP 2 x 128 heads)": {
        "heads": 32,
        "qtokens": 2,
        "direct": True,
        "ostore": True,
    },
}


def _row(name: str, loops: list[Counter]) -> str:
    cells = [
        f"{sum(c.values())} / R2UR {c['R2UR']} / IMAD+IADD3 {c['IMAD'] + c['IADD3']}"
        f" / ELECT {c['ELECT']} / MUFU {c['MUFU']}"
        for c in loops
    ]
    return f"{name:46s} " + " | ".join(cells)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--flashmla", type=Path, default=None, help="sgl-flash-mla sm_90a cubin")
    args = ap.parse_args()
    for name, form in KEYS.items():
        params = params_for("partial", "bfloat16", tma=True, **form)
        print(_row(name, steady_loops(build(SPEC, params).sass)))
    if args.flashmla is not None:
        sass = subprocess.run(
            ["cuobjdump", "-sass", str(args.flashmla)], capture_output=True, text=True, check=True
        ).stdout
        for func in re.split(r"\n\s+Function : ", sass)[1:]:
            head = func.split("\n", 1)[0]
            # (its 512-column instance has pairs of 40 HGMMA: not the 576-column comparator)
            if "splitkv_mla_kernel" in head and "dense" in head and "ILi576E" in head:
                print(_row("FlashMLA dense 576", steady_loops(func)))


if __name__ == "__main__":
    main()
