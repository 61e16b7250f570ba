"""Speculative decoding over the paged cache at 0.82-0.90x FlashInfer (issue 18,
docs/attention/PAGED_NOTES.md "Speculative decoding at 0.82-0.90x, 18:47"): for each spec bench
case of the attention_paged suite (its inputs, bf16) and two decode controls, device time per
call of

    ours          the op (the partial pass reading a tile's page ids one loop iteration ahead of
                  its copies: `PagedDecodeSm90(page_ahead=True)`, the standard kernels now)
    inline        the same launch with the 18:47 partial pass (page ids read beside the copies:
                  params page_ids="inline", a candidate configuration; its SASS is the 18:47
                  kernel's), combine and plan unchanged
    decode        the op on the same caches at one query token a sequence (each sequence's last
                  query row): the decode kernel over the same KV bytes, the comparison the
                  issue's "decode is at the copy rate" rests on (spec cases only)
    decode_inline the same with the 18:47 decode kernel
    flashinfer    the suite's comparator (packed cases: BatchPrefillWithPagedKVCacheWrapper, fa2;
                  decode: BatchDecodeWithPagedKVCacheWrapper, tensor cores)
    flashinfer_decode  the decode wrapper on the one-token form (spec cases only)
    flashinfer_fa3 / fa4  with --fa3 / --fa4 (the bench interleaves both; fa3 runs 1.1 ms a
                  call of tensor-core work: --fa3 tells whether its heat is what slows ours)

in one interleaved graph timing (runtime.timing.time_interleaved, the bench's timer, two input
sets as the bench rotates) and one eager timing (time_eager_flushed: each launch alone on a cold
L2): the 18:47 ledger has ours 313.5 us in graph and 267.5 us eager at b64 x 4k x sq2 (FlashInfer
256.5 / 263.3), so both methods are reported. Checks first, on the first input set: ours
against the fp32 reference; inline against ours bitwise (the same arithmetic, only the page-id
reads moved); the mirror launch of the standard kernel against the op bitwise (so that inline is
the op but for its kernel); decode against the reference; FlashInfer's error for scale. Per
case also the plan (kernel heads / rows / query tokens, CTAs, splits, KV bytes a CTA streams,
how many CTAs read each KV page) and GB/s (the suite's bytes), and nvidia-smi's SM clock /
power / temperature after the timing.

    python scripts/paged_spec_probe.py [--fa3] [--fa4] [--preroll] [--only SUBSTR] [OUT.json]
"""

from __future__ import annotations

import argparse
import importlib
import json
import subprocess
import sys

import torch

from forgekernel.bench.suites import attention_paged as suite_module
from forgekernel.kernels.attention.paged.sm90 import SPEC, config
from forgekernel.kernels.attention.paged.sm90 import launch as paged_sm90
from forgekernel.kernels.attention.paged.sm90.rows import heads_for
from forgekernel.kernels.common.sm90.constants import LOG2E
from forgekernel.runtime.device import as_tma_ready, dtype_name
from forgekernel.runtime.timing import median, time_eager_flushed, time_interleaved

op = importlib.import_module("forgekernel.ops.attention_paged")  # the module (ops exports the op)
SETS = 2  # input sets, as the bench rotates them at these sizes (`input_sets` 2 at 18:47)
# the decode controls: the spec cases' decode twins in the decode groups (1.0x at 15:48)
CONTROLS = (suite_module.DECODE_BENCH_CASES[0], suite_module.DECODE_BENCH_CASES[6])


def qtokens_of(case) -> int:
    """The kernel's query tokens for a case (`launch._plan_for`): 1 for decode, else the
    compiled count covering its longest sequence."""
    q_lens = case.params.get("q_lens")
    if q_lens is None:
        return 1
    return next(t for t in config.QTOKENS if t >= max(max(q_lens), 2))


def plan_of(case, num_sms: int = 132) -> dict:
    """What the op launches for a case (16-bit cache, bf16): the partial pass's heads and rows a
    CTA, its grid, the split plan (as `launch._plan` makes it from the table's width), the KV
    bytes a CTA streams at most and how many CTAs read each KV head's pages (head blocks per KV
    head): host arithmetic only (the CPU tests run it)."""
    p = case.params
    b, hq, hkv, d, page = p["b"], p["hq"], p["hkv"], p["d"], p["page"]
    qt = qtokens_of(case)
    heads = heads_for(hq // hkv, qt, d)
    rows = heads * qt
    max_tokens = max(1, max(-(-n // page) for n in p["lens"])) * page
    splits, per = config.split_plan(b, hq // heads, max_tokens, num_sms, config.RESIDENT[d])
    ctas = splits * (hq // heads) * b
    return {
        "qtokens": qt, "heads": heads, "rows": rows,
        "row_blocks": 1 if rows <= config.ROWS else 2,
        "ctas": ctas, "splits": splits, "tokens_per_split": per,
        "waves": ctas / (num_sms * config.RESIDENT[d]),
        "kv_bytes_per_cta": 2 * min(per, max(p["lens"])) * d * 2,
        "ctas_per_kv_page": (hq // hkv) // heads,
        "combine": splits > 1,
    }  # fmt: skip


def inline_params(q, k, qtokens: int):
    """The 18:47 partial pass for the call's shapes: the standard params plus page_ids="inline"
    (compile.py builds `PagedDecodeSm90(page_ahead=False)`)."""
    hq, hkv, d = q.shape[1], k.shape[2], q.shape[2]
    heads = heads_for(hq // hkv, qtokens, d)
    params = config.params_for("partial", dtype_name(q.dtype), d, heads, "", qtokens)
    return tuple(sorted((*params, ("page_ids", "inline"))))


def mirror(q, k, v, table, seq, cu, max_q, out, lse_view, inline: bool):
    """`launch.paged_decode`'s launch with its plan, the partial kernel the standard one or the
    inline one: a callable of no arguments (buffers made here, once)."""
    b = seq.shape[0]
    partial, combine, splits, per = paged_sm90._plan_for(q, k, table, b, cu is not None, max_q,
                                                         False)  # fmt: skip
    qt = 1 if cu is None else next(t for t in config.QTOKENS if t >= max(max_q, 2))
    if inline:
        partial = paged_sm90.get_kernel(SPEC, inline_params(q, k, qt))  # (the launcher's lookup)
    rows, hq, d = q.shape
    direct = combine is None
    shape = (1, 1, 1) if direct else (splits, rows, hq)
    po = torch.empty((*shape, 1 if direct else d), dtype=torch.float32, device=q.device)
    pl = torch.empty(shape, dtype=torch.float32, device=q.device)
    scale, page, group = d**-0.5 * LOG2E, k.shape[1], hq // k.shape[2]
    qq, cc = as_tma_ready(q), None if cu is None else cu.contiguous()

    def run():
        partial(qq, k, v, table, seq, po, pl, out, lse_view, int(direct), scale, per, page, group,
                None, None, cc, 1)  # fmt: skip
        if not direct:
            combine(po, pl, out, lse_view)

    return run


def _decode_form(inputs) -> dict:
    """The inputs at one query token a sequence: each sequence's last query row (the caches,
    table and lengths shared)."""
    cu = inputs["cu_seqlens_q"]
    q = inputs["q"][(cu[1:] - 1).long()].contiguous()
    rest = {k: inputs[k] for k in ("k", "v", "table", "seqlens", "k_scale", "v_scale")}
    return {"q": q, **rest}


def _gpu_state() -> str:
    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=clocks.sm,clocks.mem,power.draw,temperature.gpu",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=10,
        ).stdout.strip()  # fmt: skip
    except Exception as e:  # no nvidia-smi: say so
        return f"nvidia-smi: {type(e).__name__}"


def _err(x, want) -> float:
    return float((x.float() - want.float()).abs().max())


def run_case(case, args, device: torch.device | None = None) -> dict:
    device = device or torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    sets = [suite_module.make_inputs(case, torch.bfloat16, device, gen) for _ in range(SETS)]
    packed = "cu_seqlens_q" in sets[0]
    comps = suite_module.comparators()
    runners: dict[str, list] = {}
    outs: dict[str, list] = {}

    def add(name, make):
        runners[name], outs[name] = [], []
        for inp in sets:
            fn, o = make(inp)
            runners[name].append(fn)
            outs[name].append(o)

    def op_call(form):
        def make(inp):
            x = form(inp)
            o, lse = suite_module.alloc_out(x)
            # the width plan (plain): the mirror below is its launch, compared bitwise
            return (lambda: suite_module.run_ours(x, (o, lse), plain=True)), (o, lse)

        return make

    def mirror_call(form, inline):
        def make(inp):
            x = form(inp)
            o, lse = suite_module.alloc_out(x)
            cu, mq = x.get("cu_seqlens_q"), x.get("max_seqlen_q", 1)
            view = lse.t() if cu is not None else lse
            fn = mirror(x["q"], x["k"], x["v"], x["table"], x["seqlens"], cu, mq, o, view, inline)
            return fn, (o, lse)

        return make

    def comp_call(name, form):
        def make(inp):
            x = dict(form(inp))
            return (lambda: comps[name](x)), None

        return make

    same = lambda inp: inp  # noqa: E731
    add("ours", op_call(same))
    add("inline", mirror_call(same, True))
    add("mirror", mirror_call(same, False))  # checked, not timed
    if packed:
        add("decode", op_call(_decode_form))
        add("decode_inline", mirror_call(_decode_form, True))
    wanted = ["flashinfer"] + (["flashinfer_fa3"] if args.fa3 else []) + (["fa4"] if args.fa4
                                                                          else [])  # fmt: skip
    for name in wanted:
        if comps.get(name) is not None:
            add(name, comp_call(name, same))
    if packed and comps.get("flashinfer") is not None:
        add("flashinfer_decode", comp_call("flashinfer", _decode_form))

    errors = {}
    for name in list(runners):  # one eager call each on every set: plans, compiles, JIT
        try:
            for fn in runners[name]:
                fn()
        except Exception as e:  # a comparator (or variant) that does not run here
            errors[name] = f"{type(e).__name__}: {str(e)[:200]}"
            runners.pop(name)
    torch.cuda.synchronize()
    checks = {}
    want, want_lse = suite_module.reference(sets[0])
    o, lse = outs["ours"][0]
    checks["ours_max_err"] = _err(o, want)
    checks["ours_finite"] = bool(torch.isfinite(o).all())
    for name in ("inline", "mirror"):
        if name in runners:
            oi, li = outs[name][0]
            checks[f"{name}_bitwise_ours"] = bool(torch.equal(oi, o) and torch.equal(li, lse))
    if "decode" in runners:
        dform = _decode_form(sets[0])
        dwant, _ = suite_module.reference(dform)
        checks["decode_max_err"] = _err(outs["decode"][0][0], dwant)
        if "decode_inline" in runners:
            a, b = outs["decode"][0], outs["decode_inline"][0]
            checks["decode_inline_bitwise"] = bool(torch.equal(a[0], b[0]) and
                                                   torch.equal(a[1], b[1]))  # fmt: skip
    if "flashinfer" in runners:
        fo = comps["flashinfer"](dict(sets[0]))
        checks["flashinfer_max_err"] = _err(fo[0] if isinstance(fo, tuple) else fo, want)
    runners.pop("mirror", None)

    fns = {name: (lambda i, fs=fs: fs[i]()) for name, fs in runners.items()}
    rotate = [(i,) for i in range(SETS)]
    graph = time_interleaved(fns, rotate=rotate, preroll=args.preroll)
    state_graph = _gpu_state()
    eager = time_eager_flushed(fns, rotate=rotate, reps=40)
    state_eager = _gpu_state()
    nbytes = suite_module.nbytes(case, torch.bfloat16)
    res = {"case": case.name, "plan": plan_of(case), "checks": checks, "errors": errors,
           "bytes": nbytes, "gpu_after_graph": state_graph,
           "gpu_after_eager": state_eager}  # fmt: skip
    for method, samples in (("graph", graph), ("eager", eager)):
        res[method] = {name: median(s) for name, s in samples.items()}
        res[f"{method}_first"] = {name: s[0] for name, s in samples.items()}
        res[f"{method}_methods"] = {name: s.method for name, s in samples.items()}
    return res


def _report(r: dict) -> None:
    p = r["plan"]
    print(f"{r['case']}")
    print(f"  plan: {p['heads']} heads x {p['qtokens']} tokens = {p['rows']} rows "
          f"({p['row_blocks']} row block(s)), {p['ctas']} CTAs ({p['waves']:.2f} waves), "
          f"{p['splits']} split(s) of {p['tokens_per_split']} tokens, "
          f"{p['kv_bytes_per_cta'] / 2**20:.2f} MiB a CTA, each KV page read by "
          f"{p['ctas_per_kv_page']} CTA(s), combine {p['combine']}")  # fmt: skip
    for method in ("graph", "eager"):
        ms = r[method]
        ref = ms.get("flashinfer")
        print(f"  {method}:")
        for name, t in ms.items():
            extra = f"  first {r[method + '_first'][name] * 1e3:7.1f} us"
            if ref and name != "flashinfer":
                extra += f"  flashinfer/this {ref / t:.3f}x"
            if "ours" in ms and name == "inline":
                extra += f"  inline/ours {t / ms['ours']:.3f}x"
            rate = f"{r['bytes'] / (t * 1e-3) / 1e9:7.0f} GB/s"  # the KV bytes: all alike
            print(f"    {name:18s} {t * 1e3:8.1f} us {rate} [{r[method + '_methods'][name]}]"
                  f"{extra}")  # fmt: skip
    print(f"  checks {r['checks']}")
    print(f"  gpu after graph: {r['gpu_after_graph']}; after eager: {r['gpu_after_eager']}")
    for name, e in r["errors"].items():
        print(f"  {name}: {e}")
    sys.stdout.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", help="write the results as JSON here")
    ap.add_argument("--fa3", action="store_true", help="interleave FlashInfer's fa3 backend")
    ap.add_argument("--fa4", action="store_true", help="interleave FA4")
    ap.add_argument("--preroll", action="store_true", help="time_interleaved(preroll=True)")
    ap.add_argument("--only", default="", help="cases whose name contains this")
    args = ap.parse_args()
    cases = [c for c in (*suite_module.SPEC_BENCH_CASES, *CONTROLS) if args.only in c.name]
    rows = []
    print(f"gpu before: {_gpu_state()}")
    for case in cases:
        r = run_case(case, args)
        rows.append(r)
        _report(r)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
