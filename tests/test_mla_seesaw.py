"""The MLA seesaw pass's CPU models (tests/mla_seesaw.py): its schedule runs clean against the
hardware's rules for every tile count and interleaving tried, whole or partial last tile, breaks
when a wait or barrier of it is dropped, and matches the kernel's source order; what the
barrier-interval rule (suspected of racecheck) flags in it is what racecheck reported, and the
racecheck probe's seesaw replicas (scripts/diag_racecheck_arrive.py) are the schedule's
barriers and plain accesses; its arithmetic (two column halves, P handed over rescaled) equals
one softmax over all keys in exact arithmetic."""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap

import mla_seesaw as ms
import pytest
import torch
from script_modules import load_script  # tests/ is on the path

from forgekernel.kernels.attention.mla.sm90 import seesaw
from forgekernel.kernels.common.sm90.constants import THREADS_PER_WG, WARP_SIZE


@pytest.mark.parametrize("stale", [True, False])
@pytest.mark.parametrize("tiles", range(0, 12))
def test_schedule_runs_clean(tiles, stale):
    """No deadlock, no double arrival, no mbarrier phase aliasing; every S and P V reads the
    tile it means and every refill, P, scale, max and row-sum store follows the last read of
    what it overwrites (and every load the store it reads), whichever warpgroup runs ahead and
    however finely they interleave; with the last tile partial (its stale rows zeroed, the
    scorer's own barrier) or whole."""
    for first in (0, 1):
        for switch_every in (1, 2, 5, 1000, (1, 10**6), (10**6, 1)):
            ms.simulate(tiles, first, switch_every, stale=stale)


@pytest.mark.parametrize("tiles", range(0, 12))
def test_gather_schedule_runs_clean(tiles):
    """The gather form (every K load the refilling warpgroup's cp.async onto the chunk's
    mbarrier, tiles 0 and 1 by warpgroups 0 and 1, no stale rows zeroed): clean under the
    hardware's rules at every interleaving, and nothing for the barrier-interval rule (with the
    TMA form's `_zero_stale` it would flag the scorer's zeroing stores after the other
    warpgroup's cp.async into the last tile, WAW, though its mbarrier wait orders them: the form
    zeroes nothing, its rows past the split repeat the split's last key)."""
    for first in (0, 1):
        for switch_every in (1, 2, 5, 1000, (1, 10**6), (10**6, 1)):
            m = ms.simulate(tiles, first, switch_every, tool=True, gather=True)
            assert _flagged(m) == []
    wg0, wg1 = ms.schedule(tiles, gather=True)
    assert not any(op[0] == "tma" and op[1] != "Q" for op in wg0 + wg1)
    assert sum(op[0] == "gather" for op in wg0 + wg1) == sum(
        op[0] == "tma" and op[1] != "Q" for op in sum(ms.schedule(tiles), [])
    )
    if tiles > 2:  # the zeroing the form drops is what the rule would flag
        progs = ms.schedule(tiles, stale=True)
        gathered = tuple(
            [("gather", *op[1:]) if op[0] == "tma" and op[1] != "Q" else op for op in p]
            for p in progs
        )
        flags = _flagged(ms.run(gathered, 0, 1000, tool=True))
        assert flags and {(kind0, kind1) for _, _, kind0, _, kind1 in flags} == {("write", "write")}


@pytest.mark.parametrize("tiles", [0, 1, 2, 5])
def test_staged_epilogue_needs_its_barriers(tiles):
    """The partial O staged over the K buffers: clean after the last S / P V (wait_group 0)
    and the __syncthreads of the row sums; without the __syncthreads between the staging
    stores and warp 0's bulk copies (or without the one before the stores: the other
    warpgroup's WGMMAs may still read K) the model reports the race."""
    for first, every in ((0, 1), (1, 1), (0, 1000), (1, 1000)):
        ms.simulate(tiles, first, every, staged=True)
    for drop in ("STAGED", "END"):
        progs = ms.schedule(tiles)
        progs = tuple([op for op in p if op != ("sync", drop)] for p in progs)
        with pytest.raises(ms.ScheduleError, match="race"):
            for first, every in ((0, 1000), (1, 1000), (0, (1, 10**6)), (1, (10**6, 1))):
                ms.run(progs, first, every)


def _drop(op):
    def wrap(f):
        def g(*args):
            return [o for o in f(*args) if o != op]

        return g

    return wrap


@pytest.mark.parametrize(
    ("role", "op"),
    [
        (0, ("wait_group", 1)),  # buffer 1's left refill before P V of c is done
        (0, ("sync", "SCALE1")),  # P_a rescaled before c's factor is out
        (0, ("sync", "P1")),  # P V of c before P_c is in shared memory
        (0, ("wait_group", 0)),
        (1, ("sync", "P0")),
        (1, ("sync", "P1")),
        (1, ("wait_group", 1)),
        (1, ("wait_group", 0)),
        (1, ("sync", "SCALE0")),
    ],
)
def test_schedule_model_catches_a_dropped_step(monkeypatch, role, op):
    name = ("_pair0", "_pair1")[role]
    monkeypatch.setattr(ms, name, _drop(op)(getattr(ms, name)))
    with pytest.raises(ms.ScheduleError):
        for tiles in range(2, 8):
            for first in (0, 1):
                for switch_every in (1, 3, 1000):
                    ms.simulate(tiles, first, switch_every)


def _flagged(m) -> list[tuple]:
    """(resource, earlier warpgroup, kind, later warpgroup, kind) of the pairs of plain accesses
    the barrier-interval rule flags in a run (racecheck sees no WGMMA or TMA access)."""
    pairs = {(res, old["wg"], old["kind"], new["wg"], new["kind"]) for res, old, new in m.races}
    return sorted(pairs)


_SCALE1 = (("SCALE", 1), 1, "write", 0, "read")  # RAW: c's rescale, stored by 1, loaded by 0
# what the rule flags in the kernel of the first reports (before `_match_stale`): with a
# partial last tile of an odd count warpgroup 0 has passed its `_zero_stale` wait too
_ODD_FLAGS = [
    (("M",), 0, "read", 1, "write"),  # WAR: 0's softmax load of the old max, 1's store
    (("M",), 0, "write", 1, "read"),  # RAW: the case-2 report (+0xd5e0 -> +0x1c520, sM)
    (("M",), 0, "write", 1, "write"),  # WAW
    (("SCALE", 0), 0, "write", 1, "read"),  # RAW: a's rescale
]


def _reported_flags(tiles: int) -> list[tuple]:
    """The rule's flags in the kernel of 2026-12-02 01:40 (stale last tile, no
    `_match_stale`, no `_own_barrier`, O stored to global memory directly)."""
    if tiles % 2 == 0:
        return [_SCALE1]
    return sorted(_ODD_FLAGS + ([_SCALE1] if tiles > 1 else []))


@pytest.mark.parametrize("tiles", range(1, 12))
def test_racecheck_reports_are_the_barrier_interval_rule(tiles):
    """The 2026-12-02 racecheck reports (RAW on sScale[:, 1], stored by warpgroup 1, loaded by
    warpgroup 0, in b3-h16-p64-L0-100's CTAs; on sM, stored by warpgroup 0, loaded by warpgroup
    1, in b3-h16-p64-L4-300-sq4's split of 44 keys = 1 tile, before `_match_stale`) are what a
    checker sees that orders two warpgroups' accesses between two __syncthreads by how many
    named-barrier waits (bar.sync) each thread has passed, arrives not counted: warpgroup 1
    stores c's rescale after its SCALE0 wait, warpgroup 0 loads it after its SCALE1 wait, one
    wait each since the last common count. `_match_stale` (counted=False: the 06:40 and 13:49
    kernels) left that one in every CTA with a tile, whole or partial (06:40: 512 = 2 CTAs x 64
    rows x 4 bytes); `_own_barrier` (warpgroup 0's own wait after SCALE1, warpgroup 1's wait at
    P1) leaves nothing. The same runs are clean under the hardware's rule (simulate raises
    otherwise)."""
    for first, every in ((0, 1), (1, 1), (1, (1, 10**6)), (0, (10**6, 1))):
        for stale in (False, True):
            fixed = ms.simulate(tiles, first, every, tool=True, stale=stale)
            assert _flagged(fixed) == []
            before = ms.simulate(tiles, first, every, tool=True, stale=stale, counted=False)
            assert _flagged(before) == [_SCALE1]
        reported = ms.simulate(
            tiles, first, every, tool=True, stale=True, balanced=False, staged=False,
            counted=False,
        )  # fmt: skip
        assert _flagged(reported) == _reported_flags(tiles)


def test_interval_rule_on_the_probes_simple_variants():
    """The rule's verdicts on scripts/diag_racecheck_arrive.py's hand-overs: `early` clean (as
    the H200 found it, 2026-12-02 04:10), `private` (the producer first passes bar.sync 6, 128
    alone) flagged, `balanced` (the consumer passes bar.sync 5, 128 too) clean."""
    store, load = ("write", "X"), ("read", "X")
    early = ([("spin",), ("sync", "SCALE1"), load], [store, ("arrive", "SCALE1")])
    private = (early[0], [("sync", "WG1"), *early[1]])
    balanced = ([("sync", "WG0"), *early[0]], private[1])
    verdicts = [_flagged(ms.run(progs, 1, 1, tool=True)) for progs in (early, private, balanced)]
    assert verdicts == [[], [("X", 1, "write", 0, "read")], []]


def _probe():
    return load_script("diag_racecheck_arrive")


def _projection(progs) -> tuple[list, list]:
    """The schedule's named-barrier steps (bar 0's two uses as ALL), plain accesses of sM,
    sScale and sTotal (as the probe names them) and WGMMA waits (as spins)."""
    out = ([], [])
    for wg, prog in enumerate(progs):
        for op in prog:
            if op[0] in ("sync", "arrive"):
                out[wg].append((op[0], "ALL" if op[1] == "END" else op[1]))
            elif op[0] in ("read", "write") and op[1][0] in ("M", "SCALE", "TOTAL"):
                out[wg].append((op[0], "".join(str(x) for x in op[1])))
            elif op[0] == "wait_group":
                out[wg].append(("spin",))
    return out


def test_probe_replicas_are_the_schedule():
    """The probe's seesaw replicas (scripts/diag_racecheck_arrive.py) are the model's schedule
    of the reported kernel (before `_match_stale`) of 2 tiles (even) and 1 tile (odd), last
    tile partial or whole (-full), reduced to what
    racecheck sees, with the kernel's barrier ids and counts; their expected loads replay
    without deadlock; the rule flags in them what it flags in the schedule."""
    probe = _probe()
    for name, tiles, stale in (("even", 2, True), ("even-full", 2, False), ("odd", 1, True),
                               ("odd-full", 1, False)):  # fmt: skip
        table = probe.TABLES[name]
        assert tuple(table) == _projection(
            ms.schedule(tiles, stale, balanced=False, staged=False, counted=False)
        ), name
        assert len(probe.expected_sums(table)) == probe.THREADS
        want = _ODD_FLAGS if (tiles % 2 and stale) else [_SCALE1]  # (H200: 512, 256 each)
        want = sorted(("".join(str(x) for x in res), *rest) for res, *rest in want)
        assert _flagged(ms.run(table, 1, 1, tool=True)) == want, name
    pairs = {b.name: b for b in seesaw.Bar}
    assert {name: bar for name, (bar, _) in probe.BARRIERS.items()} == pairs
    counts = {name: n for name, (_, n) in probe.BARRIERS.items()}
    assert counts == {"SCALE0": 256, "SCALE1": 256, "P0": 256, "P1": 256, "WG0": 128, "WG1": 128}
    rows = [probe.row_of(t, r) for t in (0, 4, 36, 127) for r in (0, 1)]
    assert rows == [0, 8, 1, 9, 17, 25, 55, 63]


def _kernel_events(fn) -> list[str]:
    """A pair function's synchronization steps in source order."""
    src = inspect.getsource(fn)
    pattern = (
        r"named_barrier\(Bar\.(\w+), THREADS\)\.(arrive_and_wait|arrive)\(\)"
        r"|_(?:(?:zero|match)_stale\([^)]*|own_barrier\()Bar\.(WG\d)\)"
        r"|_refill\(kv, st, (\d), (LEFT|RIGHT)"
        r"|_scores\(ops, (\d), ([A-Z +]+),"
        r"|wait_group\((\d)\)"
        r"|gemm\(ops\.mma\[\d\].*?, (False), (-?\d)\)"
    )
    out = []
    for m in re.finditer(pattern, src):
        bar, kind, own, rbuf, rchunks, sbuf, schunks, wait, _, gwait = m.groups()
        if bar:
            out.append(f"{'sync' if kind == 'arrive_and_wait' else 'arrive'} {bar}")
        elif own:  # the warpgroup's own barrier (after zeroing the stale rows, or matching it)
            out.append(f"sync {own}")
        elif rbuf:
            out.append(f"tma {rbuf} {rchunks}")
        elif sbuf:
            out.append(f"scores {sbuf} {schunks.replace(' ', '')}")
        elif wait:
            out.append(f"wait {wait}")
        else:
            out += ["pv"] + ([f"wait {gwait}"] if gwait != "-1" else [])
    return out


def _model_events(fn) -> list[str]:
    """The model's pair function's steps in source order (same vocabulary)."""
    src = inspect.getsource(fn)
    pattern = (
        r'\("(arrive|sync)", "(\w+)"\)'
        r"|_zero_stale\(\d, \w+, (\d)\)"
        r'|\("tma", (\d), c\w*, [^)]*\) for c\w* in (LEFT|RIGHT)'
        r"|_scores\([^,]+, (\d), ([A-Z +]+),"
        r'|\("wait_group", (\d)\)'
        r"|_pv\("
    )
    out = []
    for m in re.finditer(pattern, src):
        kind, bar, own, tbuf, tchunks, sbuf, schunks, wait = m.groups()
        if kind:
            out.append(f"{kind} {bar}")
        elif own:
            out.append(f"sync WG{own}")
        elif tbuf:
            out.append(f"tma {tbuf} {tchunks}")
        elif sbuf:
            out.append(f"scores {sbuf} {schunks.replace(' ', '')}")
        elif wait:
            out.append(f"wait {wait}")
        else:
            out.append("pv")
    return out


@pytest.mark.parametrize("pair", ["_pair0", "_pair1"])
def test_model_follows_the_kernel(pair):
    """The kernel's pair functions and the model's issue the same barriers, refills, scores,
    P V and waits in the same order (conditions aside: both keep them in the same places)."""
    kernel = _kernel_events(getattr(seesaw.MlaSeesawSm90, pair))
    model = _model_events(getattr(ms, pair))
    assert kernel == model and len(kernel) > 8


def test_arithmetic_is_one_softmax():
    """Without P's rounding (fp64 throughout), the pair arithmetic equals softmax over all of a
    split's keys: O and LSE to 1e-12, masked keys and stale rows (NaN keys, zero values)
    included, for odd and even tile counts."""
    g = torch.Generator().manual_seed(3)
    rows, scale_log2 = 8, 0.2
    for tiles in (1, 2, 3, 4, 5):
        keys = torch.randn(tiles, ms.TILE, 576, generator=g, dtype=torch.float64)
        values = keys[..., : ms.LATENT].clone()
        index = torch.arange(tiles * ms.TILE).view(tiles, ms.TILE)
        t1 = tiles * ms.TILE - 7  # the last tile partly past the split
        keys[-1, -3:] = math.nan  # stale rows: masked in S ...
        values[-1, -3:] = 0.0  # ... zeroed as V
        limit = torch.tensor([t1 - 20 * (r % 3) for r in range(rows)])
        limit[5] = 0  # a row that sees no key
        q = torch.randn(rows, 576, generator=g, dtype=torch.float64)
        o, lse = ms.seesaw_split(q, keys, values, index, limit, 0, scale_log2, torch.float64)
        s = q @ keys.reshape(-1, 576).T * scale_log2
        s = torch.where(index.reshape(1, -1) < limit[:, None], s, -math.inf)
        top = s.max(1, keepdim=True).values
        p = torch.where(top > -math.inf, torch.exp2(s - top), 0.0)
        total = p.sum(1)
        want = torch.where(total[:, None] > 0, p @ values.reshape(-1, ms.LATENT), 0.0)
        want = want / torch.where(total > 0, total, 1.0)[:, None]
        assert torch.allclose(o, want, atol=1e-12, rtol=0)
        seen = total > 0
        assert torch.equal(seen, lse > -math.inf)
        assert torch.allclose(lse[seen], (top[:, 0] + torch.log2(total))[seen], atol=1e-12)


def _calls(fn, name: str) -> list:
    """The calls of `name` (a function or method name) in fn's source, as ast.Call nodes."""
    tree = ast.parse(textwrap.dedent(inspect.getsource(fn)))
    return [
        node
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and getattr(node.func, "id", getattr(node.func, "attr", None)) == name
    ]


def test_row_limits_take_the_blocks_key_bound():
    """The rows' causal limits (`query_row_limits`' fifth argument, the key bound the causal
    diagonal hangs from: key < bound - sq + token + 1) are the query block's kv_end, the one
    `_mask_from` takes, not the sequence's length sk: they differ for every block of a prefill
    but the last (sk - q_all + token0 + sq), and with sk token 0 of block 0 saw keys up to
    sk - sq instead of sk - q_all. (The kernel passed sk; the model, which computes its limits
    itself, could not see it; decode.py passes kv_end.)"""
    (limits,) = _calls(seesaw.MlaSeesawSm90.kernel, "query_row_limits")
    (mask_from,) = _calls(seesaw.MlaSeesawSm90.kernel, "_mask_from")
    assert ast.unparse(limits.args[4]) == ast.unparse(mask_from.args[1]) == "kv_end"


# ---------------------------------------------------------------- who issues the loads

_THREAD_NAMES = re.compile(r"\b(tidx|tid|warp|lane)\b|st\.(tid|loader)")


def _enclosing(fn, name: str) -> list[tuple[list[str], list[str]]]:
    """Per call of `name` in fn's source: (the tests of the `if`s around it that depend on the
    thread (tidx, warp, tid, st.tid, st.loader: the others are CTA-uniform), the context
    managers of the `with`s around it), as source text."""
    found = []

    def walk(node, tests, withs):
        if isinstance(node, ast.Call) and getattr(node.func, "attr", None) == name:
            found.append((tests, withs))
        if isinstance(node, ast.If) and _THREAD_NAMES.search(ast.unparse(node.test)):
            for child in node.body:
                walk(child, [*tests, ast.unparse(node.test)], withs)
            for child in node.orelse:
                walk(child, [*tests, f"not ({ast.unparse(node.test)})"], withs)
            return
        if isinstance(node, ast.With):
            ctx = [ast.unparse(item.context_expr) for item in node.items]
            for child in node.body:
                walk(child, tests, [*withs, *ctx])
            return
        for child in ast.iter_child_nodes(node):
            walk(child, tests, withs)

    walk(ast.parse(textwrap.dedent(inspect.getsource(fn))), [], [])
    return found


def _state_field(field: str) -> str:
    """The expression the kernel assigns to st.<field> (its SimpleNamespace of loop state)."""
    (call,) = (
        c for c in _calls(seesaw.MlaSeesawSm90.kernel, "SimpleNamespace")
        if any(k.arg == "scale_log2" for k in c.keywords)
    )  # fmt: skip
    values = [ast.unparse(k.value) for k in call.keywords if k.arg == field]
    return values[0] if values else "None"


def _reaches(tests: list[str]):
    """reaches(tidx): whether thread tidx of the CTA passes every test."""
    loader = _state_field("loader")
    consts = {"WARP_SIZE": WARP_SIZE, "THREADS_PER_WG": THREADS_PER_WG}
    consts["WARPS_PER_WG"] = THREADS_PER_WG // WARP_SIZE

    def reaches(tidx: int) -> bool:
        env = {**consts, "tidx": tidx, "warp": tidx // 32, "wg": tidx // 128, "tid": tidx % 128}
        if loader != "None":
            env["loader"] = eval(loader, {}, env)
        env["st"] = type("St", (), {"tid": tidx % 128, "loader": env.get("loader")})
        return all(eval(t, {}, env) for t in tests)

    return reaches


def test_tma_loads_are_issued_by_whole_warps():
    """The DSL's TMA copy (cute.copy with a TMA atom) elects its issuing lane with elect.sync
    over all 32 lanes: each load site must be reached by whole warps only, one warp of the CTA
    for tiles 0 and 1 (`kernel`) and one warp of the refilling warpgroup (`_refill`, run by
    one warpgroup at a time), else the model's warp-convergence rule reports the deadlock that
    hung the first GPU run (the loads were under `tidx == 0` and `st.tid == 0`). The copies
    themselves are in `_load_chunks`, reached only from those two sites, outside any
    elect_one (a copy inside one is the same one-lane elect)."""
    cls = seesaw.MlaSeesawSm90
    sites = _enclosing(cls.kernel, "_load_chunks")
    assert len(sites) == 1
    ((tests, _),) = sites
    assert ms.warp_collective(_reaches(tests), seesaw.THREADS) == [0]
    ((tests, _),) = _enclosing(cls._refill, "_load_chunks")
    reaches = _reaches(tests)
    for wg in (0, 1):
        lo = wg * THREADS_PER_WG
        warps = ms.warp_collective(lambda t, lo=lo: reaches(t) and lo <= t, lo + THREADS_PER_WG)
        assert len(warps) == 1 and warps[0] * 32 >= lo
    copies = _enclosing(cls._load_chunks, "copy")
    assert len(copies) == 2 and all(not withs for _, withs in copies)
    methods = {
        n: f for n, f in vars(cls).items() if inspect.isfunction(getattr(f, "__wrapped__", f))
    }
    callers = sorted(n for n, f in methods.items() if _calls(f, "_load_chunks"))
    assert callers == ["_refill", "kernel"]
    # Q's boxes: warp 0, whole, in the prologue only (`_load_query`), copies outside elect_one
    ((tests, _),) = _enclosing(cls.kernel, "_load_query")
    assert ms.warp_collective(_reaches(tests), seesaw.THREADS) == [0]
    copies = _enclosing(cls._load_query, "copy")
    assert len(copies) == 2 and all(not withs for _, withs in copies)
    assert [n for n, f in methods.items() if _calls(f, "_load_query")] == ["kernel"]


def test_mbarriers_are_armed_and_initialized_once():
    """Each box's mbarrier counts one arrival (init count 1): the arrival with its expected
    bytes, in the warp that issues the box, is one elected lane's; the init is one elected
    lane's of warp 0 (the same lane: elect.sync elects deterministically), fenced."""
    cls = seesaw.MlaSeesawSm90
    for fn in (cls._load_chunks, cls._load_query):  # K's boxes, Q's (one arming for all)
        ((tests, withs),) = _enclosing(fn, "mbarrier_arrive_and_expect_tx")
        assert not tests and withs == ["cute.arch.elect_one()"]
    inits = _enclosing(cls.kernel, "mbarrier_init")
    assert len(inits) == 2 and all(withs == ["cute.arch.elect_one()"] for _, withs in inits)
    assert all(ms.warp_collective(_reaches(t), seesaw.THREADS) == [0] for t, _ in inits)
    # K's boxes and Q's count one arrival (the gather form's K chunks one per thread of the
    # gathering warpgroup: `_gather_chunks`); the pair form's releases one from each CTA
    counts = [ast.unparse(init.args[1]) for init in _calls(cls.kernel, "mbarrier_init")]
    assert counts == ["self._chunk_arrivals(i)", "PAIR"]
    chunks = seesaw.STAGES * seesaw.CHUNKS
    tma, gather = cls(16), cls(16, gather=True)
    assert [tma._chunk_arrivals(i) for i in range(chunks + 1)] == [1] * (chunks + 1)
    assert [gather._chunk_arrivals(i) for i in range(chunks + 1)] == [THREADS_PER_WG] * chunks + [1]
    ((tests, withs),) = _enclosing(cls._gather_chunks, "cp_async_mbarrier_arrive_noinc")
    assert not tests and not withs  # every thread of the warpgroup, once a chunk
    assert len(_calls(cls.kernel, "mbarrier_init_fence")) == 1


def test_warp_convergence_rule():
    """The model's rule itself: one lane (the old `tidx == 0`) deadlocks, half a warp too, a
    whole warp issues."""
    with pytest.raises(ms.ScheduleError, match="deadlock"):
        ms.warp_collective(lambda t: t == 0, 256)
    with pytest.raises(ms.ScheduleError, match="deadlock"):
        ms.warp_collective(lambda t: t < 16, 256)
    assert ms.warp_collective(lambda t: t // 32 == 4, 256) == [4]


# ---------------------------------------------------------------- which CTA does what


def _grid_and_block():
    """(grid(b, q_blocks, hq, heads, splits), block(x, z, hq, heads)) evaluated from the
    kernel's source: the launch's grid expression and `_block`'s body, on plain integers."""
    (launch,) = _calls(seesaw.MlaSeesawSm90.__call__, "launch")
    (grid,) = (k.value for k in launch.keywords if k.arg == "grid")
    grid_src = ast.unparse(grid)
    src = textwrap.dedent(inspect.getsource(seesaw.MlaSeesawSm90._block))
    fn = next(n for n in ast.parse(src).body if isinstance(n, ast.FunctionDef))
    fn.decorator_list = []
    body = ast.unparse(fn)

    def ns(**kw):
        return type("NS", (), kw)

    def grid_of(b, q_blocks, hq, heads, splits, direct=False):
        kernel = ns(direct=direct, worklist=False)
        kernel._splits = lambda m: seesaw.MlaSeesawSm90._splits(kernel, m)
        out = ns(shape=(b * q_blocks, hq) if direct else (splits,))
        env = {
            "mSeq": ns(shape=(b,)), "mQn": ns(shape=(b, hq)), "mOp": out,
            "q_blocks": q_blocks, "mWork": None,
            "self": ns(h=heads, _grid=lambda *a: seesaw.MlaSeesawSm90._grid(kernel, *a)),
        }  # fmt: skip
        return eval(grid_src, {}, env)

    def block_of(x, z, hq, heads):
        env = {"cute": ns(arch=ns(block_idx=staticmethod(lambda: (x, 0, z))))}
        exec(body, env)
        return env["_block"](ns(h=heads), hq)

    return grid_of, block_of


@pytest.mark.parametrize(
    "b, q_blocks, hq, heads, splits",
    [(128, 1, 128, 64, 1), (64, 1, 128, 32, 1), (3, 5, 128, 16, 2), (1, 1, 128, 64, 64),
     (7, 1, 16, 16, 3), (2, 3, 64, 8, 1)],
)  # fmt: skip
def test_grid_covers_every_unit_head_block_and_split_once(b, q_blocks, hq, heads, splits):
    """Every (unit, head block, split) is one CTA, and the head blocks of a unit (which read
    the same latent tiles) are consecutive in launch order (x fastest, then z)."""
    grid_of, block_of = _grid_and_block()
    gx, gy, gz = grid_of(b, q_blocks, hq, heads, splits)
    assert gy == 1
    order = [block_of(x, z, hq, heads) for z in range(gz) for x in range(gx)]
    blocks = hq // heads
    assert sorted(order) == [
        (u, h, s) for u in range(b * q_blocks) for h in range(blocks) for s in range(splits)
    ]
    for i in range(0, len(order), blocks):
        group = order[i : i + blocks]
        assert [h for _, h, _ in group] == list(range(blocks))
        assert len({(u, s) for u, _, s in group}) == 1


def _cache_reads(order, sms: int) -> int:
    """Latent-cache reads from DRAM when CTAs run in waves of `sms` in launch order and the
    CTAs of one wave sharing a (unit, split) read its tiles once (L2), those of later waves
    again (the cache of a 128-head decode step is far larger than L2)."""
    return sum(len({(u, s) for u, _, s in order[i : i + sms]}) for i in range(0, len(order), sms))


@pytest.mark.parametrize("b, hq, heads, waves", [(128, 128, 64, 2), (64, 128, 32, 2)])
def test_head_blocks_of_a_unit_share_a_wave(b, hq, heads, waves):
    """b128 h128 (2 head blocks of 64) and b64 h128 s_q 2 (4 blocks of 32 heads x 2 tokens),
    one split each (the tile plan's), 256 CTAs on 132 SMs: the cache is read about once (the
    sequence straddling the wave boundary twice), not once per wave a unit's blocks span
    (units fastest: 2x)."""
    grid_of, block_of = _grid_and_block()
    gx, _, gz = grid_of(b, 1, hq, heads, 1)
    order = [block_of(x, z, hq, heads) for z in range(gz) for x in range(gx)]
    assert -(-len(order) // 132) == waves
    assert _cache_reads(order, 132) <= b + waves - 1
    blocks = hq // heads
    units_fastest = [(u, h, 0) for h in range(blocks) for u in range(b)]
    assert _cache_reads(units_fastest, 132) >= 2 * b - 4


@pytest.mark.parametrize(
    "b, q_blocks, hq, heads", [(3, 1, 16, 16), (2, 3, 128, 32), (5, 1, 128, 64)]
)
def test_direct_grid_is_one_split(b, q_blocks, hq, heads):
    """The direct form's grid: every unit and head block once, one split (mOp is the op's out,
    whose leading mode is the rows, not splits)."""
    grid_of, _ = _grid_and_block()
    assert grid_of(b, q_blocks, hq, heads, 7, direct=True) == (b * q_blocks * hq // heads, 1, 1)
    assert grid_of(b, q_blocks, hq, heads, 7)[2] == 7


def _direct_epilogue(coords, heads, qtokens, sq, q_off, head0, o, lse_log2, out, lse, writes):
    """`_write_split`'s direct branch on the traced fragment: thread tid of warpgroup wg writes
    its rows' columns of O (rounded to out's dtype) and, warpgroup 0's quad leaders, the rows'
    LSE x ln 2; rows past G or of tokens past sq are not written. Counts every store."""
    g = heads * qtokens
    for wg in range(2):
        for tid, rows in coords.items():
            for crd in rows:
                row = crd[0][0]
                token = row // heads
                if not (row < g and token < sq):
                    continue
                head = head0 + row % heads
                for _, col in crd:
                    c = wg * seesaw.COLS + col
                    out[q_off + token, head, c] = o[row, c].to(out.dtype)
                    writes[q_off + token, head, c] += 1
                if wg == 0 and tid % 4 == 0:
                    lse[q_off + token, head] = lse_log2[row] * ms.LN2_FP32
                    writes[q_off + token, head, -1] += 1


@pytest.mark.parametrize(
    "heads, qtokens, sq", [(16, 1, 1), (32, 1, 1), (64, 1, 1), (16, 2, 2), (32, 2, 1),
                           (16, 4, 4), (16, 4, 3), (16, 4, 0)],
)  # fmt: skip
def test_direct_epilogue_writes_every_output_once(heads, qtokens, sq):
    """The P V accumulator's fragment (traced from the kernel's own tiled MMA) through the direct
    epilogue: out[q_off + i, head0 + h] = O row i H + h in out's dtype and lse = its log2 LSE x
    ln 2, for every token i < sq and head of the block, each element stored exactly once, by one
    thread; nothing else in out / lse touched (other rows, other heads, tokens past sq)."""
    pytest.importorskip("cutlass")
    from mla_seesaw_probe import output_coords

    coords = output_coords(heads, qtokens)
    assert all(len(r) == 2 and len(r[0]) == seesaw.COLS // 4 for r in coords.values())
    g = torch.Generator().manual_seed(heads + qtokens + sq)
    rows, hq, q_off, head0 = 9, 3 * heads, 2, heads
    o = torch.randn(64, 512, generator=g)
    lse_log2 = torch.randn(64, generator=g) * 10
    lse_log2[1] = -math.inf  # a row that saw no key (its O is 0)
    o[1] = 0.0
    for dtype in (torch.bfloat16, torch.float16):
        out = torch.full((rows, hq, 512), float("nan"), dtype=dtype)
        lse = torch.full((rows, hq), float("nan"))
        writes = torch.zeros(rows, hq, 513, dtype=torch.int32)
        _direct_epilogue(coords, heads, qtokens, sq, q_off, head0, o, lse_log2, out, lse, writes)
        want = torch.zeros(rows, hq, 513, dtype=torch.int32)
        want[q_off : q_off + sq, head0 : head0 + heads] = 1
        assert torch.equal(writes, want)
        block = out[q_off : q_off + sq, head0 : head0 + heads]
        assert torch.equal(block, o[: sq * heads].view(sq, heads, 512).to(dtype))
        got_lse = lse[q_off : q_off + sq, head0 : head0 + heads]
        want_lse = (lse_log2[: sq * heads] * ms.LN2_FP32).view(sq, heads)
        assert torch.equal(got_lse, want_lse)
        untouched = writes[..., :512] == 0
        assert out[untouched].isnan().all() and lse[writes[..., -1] == 0].isnan().all()


def test_direct_epilogue_is_the_kernels():
    """The replayed epilogue's stores are `_write_split`'s direct branch: O x 1 / sum rounded to
    the output's dtype at (q_off + token, head, wg COLS + column), the LSE x LN2 from warpgroup
    0's quad leaders; the partial form's LSE store as before, its O staged (below). The ostore
    form (tests/test_mla_ostore.py) normalizes in place as the partial and stores no O here."""
    src = inspect.getsource(seesaw.MlaSeesawSm90._write_split)
    direct, partial = src.split("else:\n                    if wg == 0")
    assert "if const_expr(self.direct):" in direct
    assert "value = (o[r, c] * inv).to(mOp.element_type)" in direct
    assert "mOp[q_off + token, head, wg * COLS + o_crd[r, c][1]] = value" in direct
    lse_store = re.search(r"if wg == 0 and tid % 4 == 0:\s+mLp\[(.*)\] = (.*)\n", direct)
    assert lse_store.groups() == ("q_off + token, head", "lse * LN2")
    assert "mLp[split, q_off + token, head] = lse" in partial
    assert "if const_expr(not self.direct or self.ostore):" in direct
    assert "o[r, c] = o[r, c] * inv" in direct
    assert "0 if self.ostore else cute.size(o, mode=[1])" in direct


def _partial_epilogue(coords, heads, qtokens, sq, q_off, head0, o, out, writes):
    """The partial form's O on the traced fragment: every thread of both warpgroups stages its
    normalized O at (row, wg COLS + column) of the rows O_STRIDE floats apart over the K
    buffers (the kernel's `local_tile(sO, (ROWS, COLS), (0, wg))` and `partition_C`), then
    `_send_rows`' loop copies staged row r < G of token r // pitch < sq and head r % pitch <
    H (pitch = max(H, 8): Q's boxes), 512 floats, to out[q_off + token, head0 + r % pitch].
    Counts every staged float and every float sent. Returns the staged floats' last offset + 1
    (bytes / 4)."""
    pitch = max(heads, seesaw.Q_BOX_MIN)
    g = pitch * qtokens
    staged = torch.full((seesaw.ROWS * seesaw.O_STRIDE,), float("nan"))
    staged_count = torch.zeros_like(staged, dtype=torch.int32)
    for wg in range(2):
        for rows in coords.values():
            for crd in rows:
                for row, col in crd:
                    at = row * seesaw.O_STRIDE + wg * seesaw.COLS + col
                    staged[at] = o[row, wg * seesaw.COLS + col]
                    staged_count[at] += 1
    assert int(staged_count.max()) == 1
    for r in range(g):  # _send_rows
        token = r // pitch
        if token < sq and r % pitch < heads:
            row = staged[r * seesaw.O_STRIDE : r * seesaw.O_STRIDE + seesaw.D_LATENT]
            out[q_off + token, head0 + r % pitch] = row
            writes[q_off + token, head0 + r % pitch] += 1
    return int(torch.nonzero(staged_count).max()) + 1


@pytest.mark.parametrize(
    "heads, qtokens, sq",
    [(16, 1, 1), (64, 1, 1), (1, 1, 1), (16, 2, 2), (16, 4, 3), (16, 4, 0), (2, 4, 3), (8, 2, 1)],
)  # fmt: skip
def test_partial_epilogue_stages_and_sends_every_row_once(heads, qtokens, sq):
    """The staged partial O through the bulk copies: partial O[split, q_off + i, head0 + h] =
    O row i pitch + h (fp32, bit for bit; pitch = max(H, 8)) for every token i < sq and head of
    the block, each float
    written once, nothing else touched; every 64 x 512 float of the fragment staged once, the
    staging inside the K buffers (2 x 64 x 576 16-bit values: kl then kr), rows 16-byte
    aligned and 2 KB (one bulk copy each); the bank spread of the padded rows."""
    pytest.importorskip("cutlass")
    from mla_seesaw_probe import output_coords

    coords = output_coords(heads, qtokens)
    g = torch.Generator().manual_seed(heads * 7 + qtokens + sq)
    rows, hq, q_off, head0 = 9, 3 * heads, 2, heads
    o = torch.randn(64, 512, generator=g)
    out = torch.full((rows, hq, 512), float("nan"))
    writes = torch.zeros(rows, hq, dtype=torch.int32)
    end = _partial_epilogue(coords, heads, qtokens, sq, q_off, head0, o, out, writes)
    assert end * 4 <= 2 * 64 * 576 * 2
    assert seesaw.O_STRIDE * 4 % 16 == 0 and seesaw.D_LATENT * 4 == 2048
    want = torch.zeros(rows, hq, dtype=torch.int32)
    want[q_off : q_off + sq, head0 : head0 + heads] = 1
    assert torch.equal(writes, want)
    block = out[q_off : q_off + sq, head0 : head0 + heads]
    pitch = max(heads, seesaw.Q_BOX_MIN)
    assert torch.equal(block, o[: sq * pitch].view(sq, pitch, 512)[:, :heads])
    assert out[writes == 0].isnan().all()
    # a warp's 64-bit stores (rows lane // 4, column pairs lane % 4): each half-warp's 16 on
    # 32 distinct banks with the padded stride, 4 ways on the same 8 banks without it
    for stride, ways in ((seesaw.O_STRIDE, 1), (seesaw.D_LATENT, 4)):
        for half in range(2):
            banks = [
                ((lane // 4) * stride + 2 * (lane % 4) + e) % 32
                for lane in range(16 * half, 16 * half + 16)
                for e in range(2)
            ]
            assert max(banks.count(b) for b in set(banks)) == ways


def _assert_in_order(src: str, lines: list[str]) -> None:
    """Each of `lines` occurs in `src`, in this order."""
    at = [src.index(x) for x in lines]
    assert at == sorted(at)


def test_partial_epilogue_is_the_kernels():
    """The source the replay follows: the staging over kl with the padded rows, each
    warpgroup's half by the P V fragment, the proxy fence and __syncthreads before warp 0's
    elected lane sends; `_send_rows`' loop and its bulk group, waited until read (the direct
    form's `ostore` the same block: tests/test_mla_ostore.py)."""
    src = inspect.getsource(seesaw.MlaSeesawSm90.kernel)
    staged = src[src.index("if const_expr(not self.direct or self.ostore):") :]
    order = [
        "sO, tOrO = self._staged(storage, mOp, acc_o)",
        "half = cute.local_tile(sO, (ROWS, COLS), (0, wg))",
        "cute.autovec_copy(tOrO, thr_pv.partition_C(half))",
        "cute.arch.fence_view_async_shared()",
        "cute.arch.sync_threads()",
        "if warp == 0:",
        "with cute.arch.elect_one():",
        "self._send_rows(mOp, sO, (w_split, w_off, sq, head0))",
    ]
    _assert_in_order(staged, order)
    staging = inspect.getsource(seesaw.MlaSeesawSm90._staged)
    order = [
        "o_type, stride, tOrO = Float32, O_STRIDE, acc_o",
        "cute.recast_ptr(storage.kl.data_ptr(), dtype=o_type)",
        "cute.make_layout((ROWS, D_LATENT), stride=(stride, 1))",
    ]
    _assert_in_order(staging, order)
    ((tests, withs),) = _enclosing(seesaw.MlaSeesawSm90.kernel, "_send_rows")
    assert withs == ["cute.arch.elect_one()"]
    assert ms.warp_collective(_reaches(tests), seesaw.THREADS) == [0]
    send = inspect.getsource(seesaw.MlaSeesawSm90._send_rows)
    order = [
        "bulk = cute.make_copy_atom(cpasync.CopyBulkS2GOp(), mOp.element_type)",
        "for r in cutlass.range(self.g, unroll=1):",
        "token = r // self.pitch",
        "if self._written(r, token, sq):",
        "at_row = (q_off + token, head0 + r % self.pitch, None)",
        "at_row = (split,) + at_row",
        "row = mOp[at_row].iterator",
        "cute.copy(bulk, sO[r, None], cute.make_tensor(row, cute.make_layout(D_LATENT)))",
        "cute.arch.cp_async_bulk_commit_group()",
        "cute.arch.cp_async_bulk_wait_group(0, read=True)",
    ]
    _assert_in_order(send, order)
