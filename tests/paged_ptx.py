"""The shared-memory addresses a kernel's ldmatrix / st.shared instructions use, per lane,
evaluated off its PTX: the integer ops on the address chains (tid.x = the lane, warp 0; the
registers they do not derive, loop state and the shared base, read 0, so addresses are
relative). A CPU check of what the DSL lowered, where tracing its layouts cannot see it
(tests/test_attention_paged.py: the 32-row pass's V pieces)."""

from __future__ import annotations

import re

_INSTR = re.compile(r"^\s*(?:@!?%p\d+\s+)?([a-z][a-z0-9_.]*)\s+(.*?);\s*$")
_ADDR = re.compile(r"\[(%r\d+)(?:\+(-?\d+))?\]")
_M32 = 0xFFFFFFFF
_CMP = {"eq": int.__eq__, "ne": int.__ne__, "lt": int.__lt__, "le": int.__le__,
        "gt": int.__gt__, "ge": int.__ge__}  # fmt: skip


def _s32(x: int) -> int:
    x &= _M32
    return x - (1 << 32) if x >> 31 else x


def _value(tok: str, regs: dict, lane: int) -> int:
    if tok == "%tid.x":
        return lane
    if tok.startswith("%"):
        return regs.get(tok, 0)
    try:
        return int(tok, 0)
    except ValueError:
        return 0


def _eval(op: str, v: list[int]) -> int:
    base = op.split(".")[0]
    if base == "mov" and len(v) == 1:
        return v[0]
    if base == "selp":
        return v[0] if v[2] else v[1]
    if base == "setp":
        return int(_CMP.get(op.split(".")[1], lambda a, b: False)(_s32(v[0]), _s32(v[1])))
    if base == "shr":
        return (v[0] & _M32) >> v[1] if ".s" not in op else _s32(v[0]) >> v[1]
    if base == "mad" and ".lo" in op:
        return v[0] * v[1] + v[2]
    binary = {"add": int.__add__, "sub": int.__sub__, "and": int.__and__, "or": int.__or__,
              "xor": int.__xor__, "shl": int.__lshift__}  # fmt: skip
    if base in binary:
        return binary[base](v[0], v[1])
    if base == "mul" and ".lo" in op:
        return v[0] * v[1]
    return 0  # loads, conversions, floats: not on the address chains


def shared_addresses(ptx: str, lane: int, opcode: str) -> list[int]:
    """The byte address of every `opcode` instruction (e.g. "ldmatrix.sync.aligned.m8n8.x4.trans",
    "st.shared.v2.b32") for `lane`, in program order, the PTX read once top to bottom."""
    regs: dict[str, int] = {}
    found = []
    for line in ptx.splitlines():
        m = _INSTR.match(line)
        if not m:
            continue
        op, args = m.groups()
        if op.startswith(opcode):
            reg, imm = _ADDR.search(args).groups()
            found.append(regs.get(reg, 0) + int(imm or 0))
            continue
        parts = [p.strip() for p in args.split(",")]
        if parts[0].startswith("%"):
            regs[parts[0]] = _eval(op, [_value(p, regs, lane) for p in parts[1:]]) & _M32
    return found
