"""The MLA seesaw pass's CPU models (tests/mla_seesaw.py): its schedule runs clean against the
hardware's rules for every tile count and interleaving tried, breaks when a wait or barrier of
it is dropped, and matches the kernel's source order; its arithmetic (two column halves, P
handed over rescaled) equals one softmax over all keys in exact arithmetic."""

from __future__ import annotations

import ast
import inspect
import math
import re
import textwrap

import mla_seesaw as ms
import pytest
import torch

from forgekernel.kernels.attention.mla.sm90 import seesaw


@pytest.mark.parametrize("tiles", range(0, 12))
def test_schedule_runs_clean(tiles):
    """No deadlock, no double arrival, no mbarrier phase aliasing; every S and P V reads the
    tile it means and every refill, P, scale and max store follows the last read of what it
    overwrites, whichever warpgroup runs ahead and however finely they interleave."""
    for first in (0, 1):
        for switch_every in (1, 2, 5, 1000):
            ms.simulate(tiles, first, switch_every)


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
        (1, ("arrive", "P1")),
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


def _kernel_events(fn) -> list[str]:
    """A pair function's synchronization steps in source order."""
    src = inspect.getsource(fn)
    pattern = (
        r"named_barrier\(Bar\.(\w+), THREADS\)\.(arrive_and_wait|arrive)\(\)"
        r"|_refill\(kv, st, (\d), (LEFT|RIGHT)"
        r"|_scores\(ops, (\d), ([A-Z +]+),"
        r"|wait_group\((\d)\)"
        r"|gemm\(ops\.mma\[\d\].*?, (False), (-?\d)\)"
    )
    out = []
    for m in re.finditer(pattern, src):
        bar, kind, rbuf, rchunks, sbuf, schunks, wait, _, gwait = m.groups()
        if bar:
            out.append(f"{'sync' if kind == 'arrive_and_wait' else 'arrive'} {bar}")
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
        r'|\("tma", (\d), c\w*, [^)]*\) for c\w* in (LEFT|RIGHT)'
        r"|_scores\([^,]+, (\d), ([A-Z +]+),"
        r'|\("wait_group", (\d)\)'
        r"|_pv\("
    )
    out = []
    for m in re.finditer(pattern, src):
        kind, bar, tbuf, tchunks, sbuf, schunks, wait = m.groups()
        if kind:
            out.append(f"{kind} {bar}")
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
