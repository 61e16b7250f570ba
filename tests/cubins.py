"""The CPU tests' compile of one kernel configuration to the cubin and PTX they read (SASS,
resources), once a process; the mbarrier waits read from its SASS (`trywait_offsets`,
`wait_pin`); the named barriers' sites (`barrier_sites`), the instructions the cubin lists
as unaligned (`unaligned_offsets`) and the rule between them (`pin_unaligned_barriers`); the
bar.syncs waited before each one (`waits_before`, racecheck's ordering)."""

from __future__ import annotations

import copy
import re
import subprocess
import tempfile
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

from forgekernel.runtime.spec import KernelSpec, Params


class Build(NamedTuple):
    """What the SASS tests read of one compile: inspect_cubin's resources, cuobjdump's listing
    and the PTX."""

    resources: dict
    sass: str
    ptx: str


# (kernel name, arch, source hash, params) -> its Build: runtime/cache.py's in-process key (that
# cache holds loaded .so functions, not the cubin and PTX read here). Several tests read one
# build: within a file (the paged merge test's standard leaves are the main-loop test's; the DSA
# indexer's and recompute's SASS and PTX tests) and across files (the MLA pass's standard build
# is read by the seesaw, schedule and PDL tests, its ranges build by the schedule and PDL ones:
# about 17 s a compile on CI), which conftest's SHARED_COMPILES groups keep in one
# process. Memory only: nothing is written beside the compile cache.
_BUILDS: dict[tuple, Build] = {}


def build(spec: KernelSpec, params: Params, compiler: Callable | None = None) -> Build:
    """`spec`'s compile of `params` (cubin and PTX kept: --keep-ptx leaves the SASS as it is),
    once a process; each call gets its own copy of the resources. `compiler(options)`: the
    compile of `params` to run in place of spec.compile(params, options) (a test that reads the
    kernel instance it compiles: its shared struct)."""
    key = (spec.name, spec.arch, spec.source_hash, params)
    if key not in _BUILDS:
        from forgekernel.runtime.resources import inspect_cubin, sass_text

        options = "--keep-cubin --keep-ptx --dump-dir {}"
        with tempfile.TemporaryDirectory() as d:
            if compiler is None:
                compiled = spec.compile(params, options.format(d))
            else:
                compiled = compiler(options.format(d))
            cubin = compiled.artifacts.CUBIN
            if isinstance(cubin, bytes):
                (Path(d) / "k.cubin").write_bytes(cubin)
                cubin = str(Path(d) / "k.cubin")
            ptx = "".join(p.read_text() for p in sorted(Path(d).glob("*.ptx")))
            _BUILDS[key] = Build(inspect_cubin(cubin), sass_text(cubin), ptx)
    found = _BUILDS[key]
    return found._replace(resources=copy.deepcopy(found.resources))


# a SASS line's global-memory access (loads, stores, TMA, bulk copies, reductions, atomics), and
# an instruction line of cuobjdump's listing (group 1: the instruction)
GLOBAL = re.compile(r"\b(LDG|STG|LDGSTS|UTMALDG|UTMASTG|UBLKCP|UBLKRED|RED|ATOM)\b")
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(.*)$")


def sass_builder() -> Callable[[KernelSpec, Params], tuple[dict, list[str]]]:
    """build(spec, params) -> (inspect_cubin's resources, the SASS instructions in order), each
    configuration compiled once a process (`build`); skips without the DSL or the CUDA tools."""
    import pytest

    pytest.importorskip("cutlass")
    from forgekernel.runtime.resources import find_tool

    if find_tool("cuobjdump") is None or find_tool("nvdisasm") is None:
        pytest.skip("cuobjdump / nvdisasm not found")

    def sass_of(spec: KernelSpec, params: Params) -> tuple[dict, list[str]]:
        found = build(spec, params)
        lines = [m.group(1) for m in map(INSTRUCTION.match, found.sass.splitlines()) if m]
        return found.resources, lines

    return sass_of


def trywait_offsets(instrs) -> list[int]:
    """The byte offsets (from the first mbarrier) of every mbarrier try_wait of `instrs` (SASS
    (op, args) pairs), in SASS order."""
    out = []
    for op, a in instrs:
        if op == "SYNCS.PHASECHK.TRANS64.TRYWAIT":
            m = re.search(r"\[[^\]]*?(?:\+(0x[0-9a-f]+))?\]", a)
            out.append(int(m.group(1), 16) if m.group(1) else 0)
    return out


def wait_pin(instrs, n: int, waits) -> list[str]:
    """A kernel with `n` load mbarriers (one a load group, no consumer release): checks the n
    inits and n arms and that the try_waits' offsets are the multiset `waits` (each once, or
    twice where ptxas emits the retry loop's wait as a try_wait too); returns the HGMMA / DEPBAR
    / wait sequence of the math warpgroup from its wait on group 0 to its wait on the last
    group, runs of HGMMA counted ("HGMMA x3", "WARPGROUP", "wait 2")."""
    ops = [op for op, _ in instrs]
    assert ops.count("SYNCS.EXCH.64") == n  # the inits
    assert ops.count("SYNCS.ARRIVE.TRANS64") == n  # the arms (arrive.expect_tx)
    assert not [op for op in ops if op.startswith("SYNCS.ARRIVE.TRANS64.")]  # no release
    got = Counter(trywait_offsets(instrs))
    want = Counter(waits)
    assert got in ({k: m * c for k, c in want.items()} for m in (1, 2)), (got, want)
    kinds = []
    for op, a in instrs:
        if op == "SYNCS.PHASECHK.TRANS64.TRYWAIT":
            kinds.append(f"wait {trywait_offsets([(op, a)])[0] // 8}")
        elif op.startswith(("HGMMA", "WARPGROUP.DEPBAR")):
            kinds.append(op.split(".")[0])
    end = kinds.index("wait 1")
    start = end - 1 - kinds[end - 1 :: -1].index("wait 0")
    end = kinds.index(f"wait {n - 1}", end)
    seq = []
    for x in kinds[start : end + 1]:  # runs of HGMMA counted
        if x == "HGMMA" and seq and seq[-1].startswith("HGMMA"):
            seq[-1] = f"HGMMA x{int(seq[-1][7:] or 1) + 1}"
        else:
            seq.append("HGMMA x1" if x == "HGMMA" else x)
    return seq


# a SASS instruction (group 1: its address, 2: its opcode, 3: a branch's target when it ends the
# line) and the MLA seesaw pass's steady pair loop: a backward branch's body with one pair's
# HGMMA (S over 9 chunks + P V: 44 a warpgroup), shorter than MAX_LOOP (longer bodies with 44
# HGMMA are spin-wait branches spanning several pairs)
_OPCODE = re.compile(
    r"/\*([0-9a-f]{4,})\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)[^;]*?(0x[0-9a-f]+)?\s*;"
)
PAIR_HGMMA = 44
MAX_LOOP = 1500


def steady_loops(sass: str) -> list[Counter]:
    """Opcode counts (no modifiers) of each steady pair loop of the seesaw pass's SASS, in
    address order: one a warpgroup (MLA_NOTES.md, "next/mla-gap", plan item 4)."""
    instrs = [(int(m[1], 16), m[2], m[3]) for m in _OPCODE.finditer(sass)]
    at = {a: i for i, (a, _, _) in enumerate(instrs)}
    loops = []
    for i, (addr, op, target) in enumerate(instrs):
        if op != "BRA" or target is None or int(target, 16) > addr or int(target, 16) not in at:
            continue
        body = Counter(o for _, o, _ in instrs[at[int(target, 16)] : i + 1])
        if body["HGMMA"] == PAIR_HGMMA and sum(body.values()) < MAX_LOOP:
            loops.append(body)
    return loops


class BarrierSite(NamedTuple):
    """One BAR.SYNC / BAR.ARV of a SASS listing: its byte offset, SYNC or ARV, the barrier id
    and thread count as written (hex, or a register), its predicate ("" if none) and the
    setmaxnreg count in force (0 before any: a role's code follows its USETMAXREG)."""

    offset: int
    kind: str
    barrier: str
    threads: str
    predicate: str
    regs: int


_SITE = re.compile(r"^\s+/\*([0-9a-f]+)\*/\s+(@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)\s*([^;]*);")


def barrier_sites(sass: str) -> list[BarrierSite]:
    """Every named-barrier instruction of a cuobjdump listing (one kernel), in order."""
    out, regs = [], 0
    for line in sass.splitlines():
        m = _SITE.match(line)
        if not m:
            continue
        offset, pred, op, args = int(m[1], 16), (m[2] or "").strip(), m[3], m[4].strip()
        if op.startswith("USETMAXREG"):
            regs = int(args.split()[-1], 16)
        elif op.startswith("BAR.") and "," in args:
            bar, threads = (a.strip() for a in args.split(","))
            kind = "ARV" if op.startswith("BAR.ARV") else "SYNC"
            out.append(BarrierSite(offset, kind, bar, threads, pred, regs))
    return out


def unaligned_offsets(cubin) -> set[int]:
    """The offsets the cubin's EIATTR_COOP_GROUP_INSTR_OFFSETS lists (cuobjdump -elf): the
    instructions ptxas was told may run divergent (`barrier.sync` without .aligned, shfl.sync).
    A BAR.SYNC encodes the same either way: this list is what tells the aligned form (whose
    waiters of one phase must all be at that one instruction, or synccheck reports "Divergent
    thread(s) in block") from the unaligned one."""
    from forgekernel.runtime.resources import find_tool

    elf = subprocess.run([find_tool("cuobjdump"), "-elf", str(cubin)], capture_output=True,
                         text=True, check=True).stdout  # fmt: skip
    m = re.search(r"EIATTR_COOP_GROUP_INSTR_OFFSETS\s+Format:\s+\S+\s+Value:([^\n]*)", elf)
    return {int(x, 16) for x in m[1].split()} if m else set()


# a branch's target (cuobjdump writes it absolute, the last hex operand)
_TARGET = re.compile(r"0x([0-9a-f]+)\s*$")


def indirect_targets(cubin) -> dict[int, list[int]]:
    """Each indirect branch's (BRX: ptxas's jump table of a switch) targets, as nvdisasm
    annotates them (`BRANCH_TARGETS` labels; cuobjdump's listing has only the register): {the
    BRX's offset: the targets' offsets}, for `_successors`. One kernel a cubin."""
    from forgekernel.runtime.resources import find_tool

    text = subprocess.run([find_tool("nvdisasm"), "-c", str(cubin)], capture_output=True,
                          text=True, check=True).stdout  # fmt: skip
    labels, pending, brx = {}, [], {}
    for line in text.splitlines():
        if m := re.match(r"^\s*(\.L_x_\d+):", line):
            pending.append(m[1])
        elif m := re.match(r"^\s*/\*([0-9a-f]+)\*/\s+(.*)$", line):
            offset = int(m[1], 16)
            labels.update({name: offset for name in pending})
            pending = []
            if t := re.search(r'BRANCH_TARGETS ([^"]*)"', m[2]):
                brx[offset] = t[1].split(",")
    return {o: [labels[n.strip()] for n in names] for o, names in brx.items()}


def _successors(sass: str, indirect: dict[int, list[int]] | None = None) -> dict[int, list[int]]:
    """Each instruction's successors in the listing's control flow: the next one unless an
    unpredicated BRA / EXIT / RET, a branch's target, a call's target and its return point; an
    indirect branch's targets from `indirect` (`indirect_targets`; without them, an error)."""
    lines = [m for m in map(_SITE.match, sass.splitlines()) if m]
    out = {}
    for i, m in enumerate(lines):
        offset, pred, op, args = int(m[1], 16), m[2], m[3], m[4].strip()
        nxt = [int(lines[i + 1][1], 16)] if i + 1 < len(lines) else []
        if op.startswith("BRX") and indirect and offset in indirect:
            out[offset] = list(indirect[offset]) + (nxt if pred else [])
            continue
        if op.startswith(("BRX", "JMX", "JMP")):
            raise ValueError(f"indirect branch at +{offset:#x}: {op} {args}")
        if op.startswith(("BRA", "CALL")):
            # BRA.DIV (taken where the warp diverged) and a call fall through too
            falls = pred or op.startswith(("BRA.DIV", "CALL"))
            out[offset] = [int(_TARGET.search(args)[1], 16)] + (nxt if falls else [])
        elif op.startswith(("EXIT", "RET")):
            out[offset] = nxt if pred else []
        else:
            out[offset] = nxt
    return out


def _barrier_id(written: str) -> int | str:
    """A BarrierSite's id: an int, or the register of a computed one."""
    return int(written, 16) if written.startswith("0x") else written


def _collective_copies(sass: str) -> set[int]:
    """The offsets of the BAR.SYNCs between WARPSYNC.COLLECTIVE and ENDCOLLECTIVE: ptxas's copy
    of an unaligned `barrier.sync` for a warp that reaches it diverged (taken by BRA.DIV, id and
    count in a register; the converged warp's BAR.SYNC is the one `two_site_barriers` reads)."""
    out, inside = set(), False
    for m in map(_SITE.match, sass.splitlines()):
        if not m:
            continue
        if m[3].startswith("WARPSYNC.COLLECTIVE"):
            inside = True
        elif m[3].startswith("ENDCOLLECTIVE"):
            inside = False
        elif inside and m[3].startswith("BAR.SYNC"):
            out.add(int(m[1], 16))
    return out


def two_site_barriers(sass: str, indirect: dict[int, list[int]] | None = None) -> set:
    """The named barriers (`_barrier_id`s) with two BAR.SYNCs neither of which reaches the other
    in the listing's control flow: two roles' code (or a branch's two sides) each waiting at its
    own instruction, so that one phase's waiters stand at two instructions. The BAR.SYNCs one
    role passes in turn (or a loop's) reach each other: one instruction a phase, whatever the
    arrivals (BAR.ARV: never checked). `indirect`: `_successors`' (a listing with a BRX)."""
    succ = _successors(sass, indirect)

    def reach(start):
        seen, todo = set(), list(succ[start])
        while todo:
            o = todo.pop()
            if o not in seen:
                seen.add(o)
                todo.extend(succ[o])
        return seen

    copies = _collective_copies(sass)
    syncs = [b for b in barrier_sites(sass) if b.kind == "SYNC" and b.offset not in copies]
    after = {b.offset: reach(b.offset) for b in syncs}
    return {
        _barrier_id(a.barrier)
        for i, a in enumerate(syncs)
        for b in syncs[i + 1 :]
        if a.barrier == b.barrier and b.offset not in after[a.offset]
        and a.offset not in after[b.offset]
    }  # fmt: skip


def pin_unaligned_barriers(
    sass: str, unaligned: set[int], two_site: set, indirect: dict[int, list[int]] | None = None
) -> list[BarrierSite]:
    """The rule of kernels/common/sm90/unaligned_barrier.py on one build: the barriers waited at
    two instructions a phase (`two_site_barriers`) are `two_site`, and a BAR.SYNC is in the
    cubin's unaligned list (`unaligned_offsets`) exactly when its id is one of them (synccheck:
    "Divergent thread(s) in block" at an aligned one), or when it is ptxas's diverged-warp copy
    of one (`_collective_copies`, only where there are some). Returns the listing's
    `barrier_sites` less those copies. `indirect`: `_successors`' (a listing with a BRX)."""
    two_site = {int(i) if isinstance(i, int) else i for i in two_site}  # IntEnum members too
    assert two_site_barriers(sass, indirect) == two_site
    copies = _collective_copies(sass)
    assert not copies or two_site
    assert copies <= unaligned
    bars = [b for b in barrier_sites(sass) if b.offset not in copies]
    for b in bars:
        if b.kind == "SYNC":
            assert (b.offset in unaligned) == (_barrier_id(b.barrier) in two_site), b
    return bars


def waits_before(sass: str, indirect: dict[int, list[int]] | None = None) -> dict[int, set[int]]:
    """Each BAR.SYNC of the listing (`barrier_sites`; bar 0's, every thread's, is not one): the
    counts of BAR.SYNCs passed before it on the paths from the kernel's entry (a predicated one:
    passed or not). racecheck orders one thread's shared-memory access after another thread's
    only if the later thread has waited at more bar.syncs (a bar.arrive counts for nothing:
    docs/attention/MLA_NOTES.md, "racecheck counts waits, not arrives"), so the warps that meet
    at a barrier and hand data over there must have waited equally often before it: one count a
    site. A BAR.SYNC on a cycle of the control flow: an error (not this helper's kernels).
    `indirect`: `_successors`' (a listing with a BRX)."""
    succ = _successors(sass, indirect)
    syncs = {b.offset: b.predicate for b in barrier_sites(sass) if b.kind == "SYNC"}
    first = int(_SITE.match(next(x for x in sass.splitlines() if _SITE.match(x)))[1], 16)
    out: dict[int, set[int]] = {o: set() for o in syncs}
    seen, todo = set(), [(first, 0)]
    while todo:
        offset, n = todo.pop()
        if (offset, n) in seen:
            continue
        if n > len(syncs):
            raise ValueError(f"a BAR.SYNC on a cycle (+{offset:#x} after {n} waits)")
        seen.add((offset, n))
        after = [n]
        if offset in syncs:
            out[offset].add(n)
            after = [n, n + 1] if syncs[offset] else [n + 1]
        todo.extend((s, m) for s in succ[offset] for m in after)
    return out
