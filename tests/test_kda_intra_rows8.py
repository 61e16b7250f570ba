"""The re-laid-out first pass (opt-in compile key `layout` "rows8", `intra_rows8.py`) on the CPU:
its key is named only off the standard one, its spec and entry stay out of the standard kernels'
import closure (their cache and ledger key), `build --candidates` lists it, the launcher asks for
it (the op then runs on the kernels' torch replays: the same math as the standard first pass,
against the fp64 recurrence on awkward sizes), the suite times it as a variant; and, where
cuobjdump is installed, its sm_90a SASS: no spills, 16-byte global accesses, the mma.sync
blocks, and fewer instructions than the standard kernel. Its layouts only a GPU run checks
(tests/gpu/test_kda_prefill_gpu.py::test_first_pass_rows8_equals_standard)."""

from __future__ import annotations

import re
import subprocess
import tempfile
from pathlib import Path

import kda_prefill_replay as replay
import pytest
import torch

import forgekernel.ops.kda_chunked as op
from forgekernel.bench.check import verify
from forgekernel.bench.suites import kda_prefill
from forgekernel.kernels.linear_attention.kda_prefill import sm90
from forgekernel.kernels.linear_attention.kda_prefill.sm90 import launch
from forgekernel.reference.delta_rule import kimi_delta_attention_recurrent

ROWS8 = (("dtype", "bfloat16"), ("k", 128), ("layout", "rows8"))


def test_keys():
    assert sm90.intra_params_for("bfloat16") == (("dtype", "bfloat16"), ("k", 128))
    assert sm90.intra_params_for("bfloat16", layout="rows8") == ROWS8
    with pytest.raises(ValueError, match="layout"):
        sm90.intra_params_for("bfloat16", layout="rows4")
    assert sm90.intra_spec_for(sm90.intra_params_for("float16")) is sm90.INTRA_SPEC
    assert sm90.intra_spec_for(ROWS8) is sm90.ROWS8_SPEC


def test_standard_closure_and_candidates():
    """The standard kernels' sources (cache / ledger key) hold neither new module; the new
    spec's hold both and the standard first pass's fake tensors (compile.py); `build` (with or
    without --candidates) compiles both dtypes of it, its representative bf16."""
    new = {"intra_rows8.py", "compile_rows8.py"}
    for spec in (sm90.SPEC, sm90.INTRA_SPEC):
        assert not new & {p.name for p in spec.sources}, spec.name
    assert new | {"compile.py", "inverse_mma.py"} <= {p.name for p in sm90.ROWS8_SPEC.sources}
    assert not new & {p.name for p in kda_prefill.SOURCES}
    keys = list(sm90.ROWS8_SPEC.standard_params())
    assert [dict(p)["dtype"] for p in keys] == list(sm90.DTYPES)
    assert all(dict(p)["layout"] == "rows8" for p in keys)
    assert sm90.ROWS8_SPEC.representative_params() == ROWS8 and ROWS8 in keys
    assert all(dict(p).get("layout") is None for p in sm90.INTRA_SPEC.standard_params())


@pytest.fixture
def on_cpu(monkeypatch):
    """The op on the CPU (both first-pass specs by the standard first pass's replay: the same
    math); returns the (spec name, key) of every kernel asked for."""
    calls = []
    monkeypatch.setattr(op, "check_cuda", lambda name, t: None)

    def get(spec, params):
        calls.append((spec.name, tuple(params)))
        intra = spec.name in ("kda_intra_sm90", "kda_intra_rows8_sm90")
        return (replay.intra_kernel if intra else replay.kernel)(dict(params))

    monkeypatch.setattr(launch, "get_kernel", get)
    return calls


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lens", [[1, 63, 0, 64, 65, 130], [7], [200, 0]])
def test_launcher_asks_for_the_layout(on_cpu, dtype, lens):
    gen = torch.Generator().manual_seed(3)
    t, h, hv = sum(lens), 2, 4
    q = torch.randn(t, h, 128, generator=gen).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(t, h, 128, generator=gen), dim=-1).to(dtype)
    v = torch.randn(t, hv, 128, generator=gen).to(dtype)
    g = -4.0 - torch.rand(t, hv, 128, generator=gen)
    beta = torch.sigmoid(torch.randn(t, hv, generator=gen))
    h0 = 0.1 * torch.randn(len(lens), hv, 128, 128, generator=gen)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32)
    outs = []
    for layout in ("standard", "rows8"):
        o, final = torch.empty_like(v), torch.empty_like(h0)
        launch.kda_prefill(q, k, v, g, beta, h0, cu, o, final, 128**-0.5, l2norm=False,
                           layout=layout)  # fmt: skip
        outs.append((o, final))
    key = sm90.intra_params_for(launch.dtype_name(dtype), layout="rows8")
    assert ("kda_intra_rows8_sm90", key) in on_cpu
    assert ("kda_intra_sm90", sm90.intra_params_for(launch.dtype_name(dtype))) in on_cpu
    (o, s), (o8, s8) = outs
    assert torch.equal(o, o8) and torch.equal(s, s8)  # the replay: the same math
    args = (x[None].double() for x in (q, k, v, g, beta))
    o_ref, _ = kimi_delta_attention_recurrent(*args, initial_state=h0.double(),
                                              cu_seqlens=cu.long())  # fmt: skip
    err = float((o8[None].double() - o_ref).abs().max())
    assert err <= 2e-2 * float(o_ref.abs().max()), err


def test_suite_variant_passes_check_on_the_replays(on_cpu):
    suite = kda_prefill.suite()
    case = kda_prefill.CHECK_CASES[2]  # [100, 0, 37]: an empty sequence
    assert set(kda_prefill.variants(case)) == {"rows8"}
    inputs = suite.make_inputs(case, torch.bfloat16, torch.device("cpu"),
                               torch.Generator().manual_seed(0))  # fmt: skip
    run = suite.variants_for(case)["rows8"]
    _, cmps = verify(suite, inputs, torch.device("cpu"), run=run)
    assert cmps and all(c.ok for c in cmps), [c.message for c in cmps]
    assert any(name == "kda_intra_rows8_sm90" for name, _ in on_cpu)


# ----------------------------------------------------------------------------- the SASS

_INSTR = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Za-z0-9_.]*)([^;]*);")


@pytest.fixture(scope="module")
def sass():
    pytest.importorskip("cutlass")
    from forgekernel.runtime.resources import find_tool, inspect_cubin

    if find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found")
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile import compile_kda_intra
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.compile_rows8 import (
        compile_kda_intra_rows8,
    )
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra import KdaIntraSm90
    from forgekernel.kernels.linear_attention.kda_prefill.sm90.intra_rows8 import (
        KdaIntraRows8Sm90,
    )

    cache = {}

    def get(dtype, layout):
        if (dtype, layout) not in cache:
            rows8 = layout == "rows8"
            kernel = (KdaIntraRows8Sm90 if rows8 else KdaIntraSm90)(128)
            params = dict(sm90.intra_params_for(dtype, layout=layout))
            with tempfile.TemporaryDirectory() as d:
                fn = compile_kda_intra_rows8 if rows8 else compile_kda_intra
                compiled = fn(params, "sm_90a", f"--keep-cubin --dump-dir {d}", kernel=kernel)
                cubin = compiled.artifacts.CUBIN
                if isinstance(cubin, bytes):
                    path = Path(d) / "k.cubin"
                    path.write_bytes(cubin)
                    cubin = path
                res = inspect_cubin(cubin)
                cmd = [find_tool("cuobjdump"), "-sass", str(cubin)]
                text = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            ops = [o for o, _ in _INSTR.findall(text)]
            cache[dtype, layout] = (res, ops, kernel.shared_storage.size_in_bytes())
        return cache[dtype, layout]

    return get


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_rows8_sass(sass, dtype):
    """No spills, three CTAs an SM (162 registers under the launch bound of 168; 73,984 B of
    shared memory: the scan over the B tiles, the inverse's scratch and P over the A tiles, k
    and q staged in the A tiles' own slots, with the 1 KB static and the 1 KB the SM keeps a
    CTA, 3 x 76 KB within the SM's 228 KB); every global access a
    16-byte vector: g 8 + 8 LDG.128, k and q 8 + 8 cp.async (LDGSTS) into shared rows, Kg, Kd,
    Qg 8 STG.128 each, D 2, P 4, T 4; the scalars only the chunk's start, length and beta; the
    products 3 block paths x (L and P) x 16 mma.sync m16n8k16 bf16 from 3 ldmatrix.x4 a step
    (A: Kl, Ql; B shared), the inverse's 28 tf32; no WGMMA; the static instructions under 0.75
    of the standard kernel's (whose sub-chunk loops run 4 times: per warp ~3.4 k against ~12.7
    k, docs/linear_attention/NOTES.md)."""
    from forgekernel.kernels.common.sm90.constants import REGISTERS_PER_SM, THREADS_PER_WG

    res, ops, smem = sass(dtype, "rows8")
    assert res["spill_bytes"] == 0
    assert not [o for o in ops if o.startswith(("LDL", "STL"))]
    regs = -(-res["registers"] // 8) * 8  # allocated in 8s
    assert 3 * regs * THREADS_PER_WG <= REGISTERS_PER_SM
    assert 3 * (smem + res["smem_bytes"] + 1024) <= 228 * 1024
    assert ops.count("LDG.E.128") == 16 and ops.count("LDGSTS.E.128") == 16
    assert sum(o.startswith("LDG") and o != "LDGDEPBAR" for o in ops) == 16 + 16 + 3
    assert ops.count("STG.E.128") == sum(o.startswith("STG") for o in ops) == 34
    assert ops.count("HMMA.16816.F32.BF16") == 3 * 2 * 16
    assert ops.count("LDSM.16.M88.4") == 3 * 3 * 8
    assert ops.count("HMMA.1688.F32.TF32") == 28
    assert not [o for o in ops if o.startswith(("HGMMA", "WARPGROUP"))]
    _, std, _ = sass(dtype, "standard")
    assert len(ops) < 0.75 * len(std), (len(ops), len(std))
