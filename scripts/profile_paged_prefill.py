"""ncu target: chunked prefill over a paged KV cache, ours (`forgekernel.attention_paged` with
cu_seqlens_q: the forward's paged mode) against FA4's varlen forward over the same page table
(flash-attn-4, the bench's `fa4`) on the bench's prefill group (benchmarks/reports/sm_90a/
attention_paged.md, 2026-12-04 17:28, graph): page 16 at 0.917x / 0.929x (8 TMA boxes a
64-key tile, issued by one thread), page 64 at 1.023x for contrast. The suite's `make_inputs`
and comparator callable (bench/suites/attention_paged.py).

    python3 scripts/profile_paged_prefill.py [--form packed_views|split]
        [--which ours|comparator|both] [--case NAME ...]

--form: the chunked-prefill form ours runs in (`ops.attention_paged.prefill_form`; default
packed_views, the op's default since 2026-12-04). scripts/device_profile_gaps.sh runs it
(target `paged_prefill`).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(_HERE), str(_HERE.parent)]  # profile_suite, this tree's forgekernel

import profile_suite  # noqa: E402

TARGET = profile_suite.Target(
    name="paged_prefill",
    suites=("attention_paged",),
    default_cases=(
        "attention_paged:b33-hq32-hkv8-d128-p16-c2048of16k+32dec-q2080",
        "attention_paged:b20-hq32-hkv8-d128-p16-c512-4096+16dec-q7696",
        "attention_paged:b20-hq32-hkv8-d128-p64-c512-4096+16dec-q7696",
    ),
    comparator={"attention_paged": "fa4"},
)


def split_form(argv: list[str]) -> tuple[str, list[str]]:
    """(the --form value, the other arguments for profile_suite)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--form", default="packed_views")
    known, rest = p.parse_known_args(argv)
    return known.form, rest


if __name__ == "__main__":
    form, rest = split_form(sys.argv[1:])
    from forgekernel.ops.attention_paged import prefill_form

    with prefill_form(form):
        sys.exit(profile_suite.main(TARGET, rest))
