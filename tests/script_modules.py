"""Files outside the package (scripts/NAME.py, a GPU test file) loaded as modules by the CPU
tests: the one loader they share."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


def load_script(name: str, path: Path | None = None, *, register: bool = False) -> ModuleType:
    """scripts/`name`.py (or `path`) executed as a module named `name`; `register` puts it in
    sys.modules first (a script whose dataclasses look their module up there)."""
    spec = importlib.util.spec_from_file_location(name, path or SCRIPTS / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    if register:
        sys.modules[name] = module
    spec.loader.exec_module(module)
    return module
