"""`forgekernel build`: compile every kernel's standard configurations ahead of time (no GPU
needed) and report each one's resources from the compiler's own output."""

from __future__ import annotations

import json
import tempfile
from pathlib import Path
from typing import Any

from forgekernel.runtime.cache import compile_to, user_cache_dir
from forgekernel.runtime.resources import inspect_cubin
from forgekernel.runtime.spec import all_specs


def build_all(
    arch: str = "sm_90a",
    out_dir: Path | None = None,
    candidates: bool = False,
    only: list[str] | None = None,
) -> list[dict[str, Any]]:
    """Compile all standard (spec, params) for `arch` into `out_dir` (default: user cache);
    with `candidates`, also the configurations a tuning sweep times; `only`: kernel names
    (KernelSpec.name) to restrict to."""
    target = Path(out_dir) if out_dir else user_cache_dir(arch)
    records = []
    for spec in all_specs():
        if spec.arch != arch or (only and spec.name not in only):
            continue
        extra = list(spec.candidate_params()) if candidates else []
        for params in list(spec.standard_params()) + extra:
            with tempfile.TemporaryDirectory(prefix="forgekernel-cubin-") as keep:
                # A fresh folder per kernel: the DSL names dumps by signature, not config.
                rec = compile_to(spec, params, target, keep_dir=Path(keep))
                rec.update(_resources(Path(rec["path"]), rec.pop("cubin", None)))
            rec["config"] = _short(rec["params"])
            records.append(rec)
    return records


def _resources(so: Path, cubin: Any) -> dict[str, Any]:
    """Read off the fresh cubin and kept beside the .so, or, for a kernel built earlier (no
    cubin this time), what was kept then."""
    sidecar = so.with_suffix(".resources.json")
    if cubin is None and sidecar.is_file():
        return json.loads(sidecar.read_text())
    found = inspect_cubin(cubin)
    if cubin is not None:
        sidecar.write_text(json.dumps(found))
    return found


def _short(params: dict) -> str:
    return " ".join(f"{k}={v}" for k, v in params.items())
