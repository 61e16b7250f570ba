"""`forgekernel build`: compile every kernel's standard configurations ahead of time (no GPU
needed) and report each one's resources from the compiler's own output."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from forgekernel.runtime.cache import compile_to, user_cache_dir
from forgekernel.runtime.resources import inspect_cubin
from forgekernel.runtime.spec import all_specs


def build_all(
    arch: str = "sm_90a", out_dir: Path | None = None, candidates: bool = False
) -> list[dict[str, Any]]:
    """Compile all standard (spec, params) for `arch` into `out_dir` (default: user cache);
    with `candidates`, also the configurations a tuning sweep times."""
    target = Path(out_dir) if out_dir else user_cache_dir(arch)
    records = []
    for spec in all_specs():
        if spec.arch != arch:
            continue
        extra = list(spec.candidate_params()) if candidates else []
        for params in list(spec.standard_params()) + extra:
            with tempfile.TemporaryDirectory(prefix="forgekernel-cubin-") as keep:
                # A fresh folder per kernel: the DSL names dumps by signature, not config.
                rec = compile_to(spec, params, target, keep_dir=Path(keep))
                rec.update(inspect_cubin(rec.pop("cubin", None)))  # None: already built
            rec["config"] = _short(rec["params"])
            records.append(rec)
    return records


def _short(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
