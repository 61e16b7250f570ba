"""Read a kernel's resources off its cubin: registers, spills, and the instruction mix.

Uses `cuobjdump` / `nvdisasm` from PATH or from the pip wheels nvidia-cuda-cuobjdump and
nvidia-cuda-nvdisasm (the `dev` extra); without them only the cubin's presence is reported.
"""

from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

_RES = re.compile(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)")
_OPCODE = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)")
# An instruction whole: its opcode with the modifiers (LDG.E.128) and its operands.
_INSTRUCTION = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


def sass_instructions(sass: str) -> list[tuple[str, str]]:
    """(opcode with its modifiers, operands) of each instruction of `cuobjdump -sass` text, in
    order (the compile tests' per-class counts and operand checks)."""
    return _INSTRUCTION.findall(sass)


def setmaxnreg_wrong_way(instrs: list[tuple[str, str]], launch: int) -> list[str]:
    """The setmaxnreg instructions of `instrs` (`sass_instructions`) whose direction does not fit
    `launch` (the kernel's registers at the launch, cuobjdump -res-usage): a .dec
    (USETMAXREG.DEALLOC) above `launch`, a .inc (USETMAXREG.TRY_ALLOC) below it. A .dec above
    the warp's count is an illegal instruction on the H100 (CUDA error 715: the fused GDN
    backward's `wg_split` keys, DEALLOC 0x88 from 128; docs/linear_attention/NOTES.md
    "next/ws-illegal"); a .inc to the launch's own count runs (the FP8 masked GEMM's 64-row
    consumer, TRY_ALLOC 232 at 232: checked on the H100)."""
    out = []
    for op, args in instrs:
        if op.startswith("USETMAXREG"):
            count = int(args.split()[-1], 16)
            dec = op.startswith("USETMAXREG.DEALLOC")
            if (dec and count > launch) or (not dec and count < launch):
                out.append(f"{op} {args.strip()}")
    return out


def _tool_dirs() -> list[str]:
    dirs = [p for p in os.environ.get("PATH", "").split(os.pathsep) if p]
    for entry in sys.path:
        for cu in ("cu13", "cu12"):
            dirs.append(str(Path(entry or ".") / "nvidia" / cu / "bin"))
    return dirs


def find_tool(name: str) -> str | None:
    return shutil.which(name, path=os.pathsep.join(_tool_dirs()))


# The last few listings by the cubin's sha256: `inspect_cubin` then the caller's own read of one
# fresh cubin (the compile tests) disassemble it once (cuobjdump -sass: 0.4 s of a conv kernel's
# 1.7 s build on CI's CPU).
_SASS: dict[str, str] = {}
_SASS_KEPT = 4


def _on_file(image: bytes, read):
    """read(path) of a cubin image written to a temporary file (removed after)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(image)
    try:
        return read(f.name)
    finally:
        os.unlink(f.name)


def sass_text(cubin: str | os.PathLike | bytes | None) -> str:
    """The SASS listing of a cubin (a file, or the image some DSL paths hand back) as cuobjdump
    prints it with nvdisasm on its PATH; "" without the tools or the cubin."""
    if isinstance(cubin, bytes):
        return _on_file(cubin, sass_text)
    cuobjdump, nvdisasm = find_tool("cuobjdump"), find_tool("nvdisasm")
    if cubin is None or not Path(cubin).is_file() or cuobjdump is None or nvdisasm is None:
        return ""
    digest = hashlib.sha256(Path(cubin).read_bytes()).hexdigest()
    sass = _SASS.pop(digest, None)
    if sass is None:
        path = os.pathsep.join([str(Path(nvdisasm).parent), os.environ["PATH"]])
        cmd = [cuobjdump, "-sass", str(cubin)]
        sass = subprocess.run(cmd, capture_output=True, text=True, env=dict(os.environ, PATH=path))
        sass = sass.stdout
    _SASS[digest] = sass
    while len(_SASS) > _SASS_KEPT:
        del _SASS[next(iter(_SASS))]
    return sass


def inspect_cubin(cubin: str | os.PathLike | None) -> dict[str, Any]:
    """registers, stack/spill bytes, static smem, SASS counts of HGMMA / TMA / local memory, and
    the setmaxnreg instructions whose direction does not fit the launch's registers
    (`setmaxnreg_wrong_way`: none in a kernel that runs)."""
    out: dict[str, Any] = {
        "registers": None,
        "smem_bytes": None,
        "spill_bytes": None,
        "hgmma": None,
        "sass": {},
        "setmaxnreg_wrong_way": [],
    }
    cuobjdump = find_tool("cuobjdump")
    if isinstance(cubin, bytes):  # some DSL paths hand back the image, not its file
        return _on_file(cubin, inspect_cubin)
    if cubin is None or not Path(cubin).is_file() or cuobjdump is None:
        return out
    res = subprocess.run([cuobjdump, "-res-usage", str(cubin)], capture_output=True, text=True)
    m = _RES.search(res.stdout)
    if m:
        reg, stack, shared, local = map(int, m.groups())
        out.update(registers=reg, smem_bytes=shared, spill_bytes=stack + local)
    if find_tool("nvdisasm") is None:
        return out
    sass = sass_text(cubin)
    ops = Counter(_OPCODE.findall(sass))
    keep = (
        "HGMMA",
        "QGMMA",
        "HMMA",
        "UTMALDG",
        "UTMASTG",
        "LDL",
        "STL",
        "LDS",
        "STS",
        "STSM",
        "SYNCS",
        "BAR",
        "MUFU",
        "FFMA",
    )
    out["sass"] = {k: v for k, v in ops.items() if k in keep}
    out["hgmma"] = ops.get("HGMMA", 0) + ops.get("QGMMA", 0) > 0  # warpgroup MMA, 16 / 8 bit
    if out["registers"] is not None:
        instrs = sass_instructions(sass)
        out["setmaxnreg_wrong_way"] = setmaxnreg_wrong_way(instrs, out["registers"])
    return out
