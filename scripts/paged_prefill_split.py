"""Chunked prefill split between the paged decode and the forward's paged mode (issue 18,
docs/attention/PAGED_NOTES.md "Chunked prefill split"): for each PREFILL bench case of the
attention_paged suite (its inputs, bf16), device time per call (graph replays interleaved,
`runtime.timing.time_interleaved`: the bench's timer) of

    before        the batch as the op ran it before the split: all of it on the forward's paged
                  mode, each sequence of 1-4 query tokens padded to PAGED_MIN_SEQLEN_Q (the
                  tiles the forward gave it: a 128-row query tile a head over the same key
                  blocks; the mode now skips shorter sequences)
    fwd           the forward on the sequences of more than 4 query tokens only (compacted)
    decode        the decode kernel on the sequences of up to 4 only (compacted, the table
                  narrowed to them, one split: what the op's decode costs at best)
    decode_plan   the same with the decode's own split plan (what one split costs)
    decode_one_split  the decode as the op ran it at 15:48: the whole batch, the others given
                  no keys (`decode_lengths`, its masked_fill included), one split
    decode_in_op  the decode part as the op runs it now (`_decode_part`): that where the
                  decode's split plan for the batch has one split, else the plan's splits over
                  the compact slots (`decode_slots`: the index ops, the query gather, the
                  partial pass and combine over B x 4 rows, the copy into out / lse included)
    ours          the op in its split form (`prefill_form("split")`: decode_in_op, then the
                  forward over the whole batch; the op's default since 2026-12-04 is the
                  packed form, the bench's `ours`)
    flashinfer_fa3 / flashinfer   FlashInfer's paged prefill (fa3, fa2), where installed
    fa4           FlashAttention-4's paged varlen forward (the suite's `fa4` comparator)

and checks: ours against the fp32 reference, and ours' rows against the compacted fwd /
decode outputs (bitwise: the same kernels on the same tiles; the decode's rows only where the
op's decode part runs one split, else their max difference: `decode_splits`, the plan's
splits for the batch) and against decode_in_op's (bitwise).

    python scripts/paged_prefill_split.py [OUT.json]
"""

from __future__ import annotations

import importlib
import itertools
import json
import sys

import torch

from forgekernel.bench.suites import attention_paged as suite_module
from forgekernel.kernels.attention.fwd.sm90 import launch as fwd_sm90
from forgekernel.kernels.attention.fwd.sm90.config import PAGED_MIN_SEQLEN_Q
from forgekernel.kernels.attention.paged.sm90 import launch as paged_sm90
from forgekernel.runtime.timing import median, time_interleaved

op = importlib.import_module("forgekernel.ops.attention_paged")  # the module (ops exports the op)


def _sub_batch(inputs, keep: list[int], q_lens: list[int], pad_to: int = 0):
    """The sequences `keep` as a batch of their own: (q, cu, table, seqlens, max_q, rows), the
    table narrowed to their pages; pad_to > 0: sequences of 1 .. pad_to - 1 query tokens get
    pad_to (their first query row repeated; `rows`: the source rows, for comparisons)."""
    q, cu = inputs["q"], inputs["cu_seqlens_q"].tolist()
    lens = inputs["seqlens"].tolist()
    page = inputs["k"].shape[1]
    rows, new_lens = [], []
    for b in keep:
        n = q_lens[b]
        src = list(range(cu[b], cu[b + 1]))
        if pad_to and 0 < n < pad_to:
            src += [cu[b]] * (pad_to - n)
        rows += src
        new_lens.append(len(src))
    width = max(1, max(-(-lens[b] // page) for b in keep))
    idx = torch.tensor(rows, dtype=torch.long, device=q.device)
    sub_cu = torch.tensor([0, *itertools.accumulate(new_lens)], dtype=torch.int32,
                          device=q.device)  # fmt: skip
    table = inputs["table"][keep][:, :width].contiguous()
    seq = inputs["seqlens"][keep].contiguous()
    return q[idx].contiguous(), sub_cu, table, seq, max(1, *new_lens), idx


def _outputs(q):
    return torch.empty_like(q), torch.empty(q.shape[1], q.shape[0], device=q.device)


def run_case(case, device: torch.device | None = None) -> dict:
    device = device or torch.device("cuda")
    gen = torch.Generator(device=device).manual_seed(0)
    inputs = suite_module.make_inputs(case, torch.bfloat16, device, gen)
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    table, seq, cu = inputs["table"], inputs["seqlens"], inputs["cu_seqlens_q"]
    mq, scale = inputs["max_seqlen_q"], q.shape[-1] ** -0.5
    q_lens = list(case.params["q_lens"])
    long_ = [b for b, n in enumerate(q_lens) if n > op.MAX_QUERY_TOKENS]
    short = [b for b, n in enumerate(q_lens) if n <= op.MAX_QUERY_TOKENS]
    fns, outs = {}, {}

    qb, cub, tb, sb, mqb, _ = _sub_batch(inputs, list(range(len(q_lens))), q_lens,
                                         pad_to=PAGED_MIN_SEQLEN_Q)  # fmt: skip
    ob, lb = _outputs(qb)
    fns["before"] = lambda: fwd_sm90.attention_paged_fwd(qb, k, v, ob, lb, tb, sb, cub, mqb,
                                                         scale, True)  # fmt: skip
    if long_:
        ql, cul, tl, sl, mql, rows_l = _sub_batch(inputs, long_, q_lens)
        ol, ll = _outputs(ql)
        outs["fwd"] = (ol, ll, rows_l)
        fns["fwd"] = lambda: fwd_sm90.attention_paged_fwd(ql, k, v, ol, ll, tl, sl, cul, mql,
                                                          scale, True)  # fmt: skip
    if short:
        qs, cus, ts, ss, _, rows_s = _sub_batch(inputs, short, q_lens)
        os_, ls = _outputs(qs)
        outs["decode"] = (os_, ls, rows_s)
        os2, ls2 = _outputs(qs)
        fns["decode"] = lambda: paged_sm90.paged_decode(
            qs, k, v, ts, ss, scale, os_, ls.t(), None, None, cus, op.MAX_QUERY_TOKENS, True,
            one_split=True,
        )  # fmt: skip
        fns["decode_plan"] = lambda: paged_sm90.paged_decode(
            qs, k, v, ts, ss, scale, os2, ls2.t(), None, None, cus, op.MAX_QUERY_TOKENS, True,
        )  # fmt: skip
    oi, li = _outputs(q)
    fns["decode_one_split"] = lambda: paged_sm90.paged_decode(
        q, k, v, table, op.decode_lengths(seq, cu), scale, oi, li.t(), None, None, cu,
        op.MAX_QUERY_TOKENS, True, one_split=True,
    )  # fmt: skip
    op_, lp = _outputs(q)
    fns["decode_in_op"] = lambda: op._decode_part(q, k, v, table, seq, cu, scale, True, op_, lp)
    o, lse = _outputs(q)

    def ours():
        with op.prefill_form("split"):  # this script's subject (the op's default is packed)
            return op.attention_paged(q, k, v, table, seq, cu_seqlens_q=cu, max_seqlen_q=mq,
                                      out=o, lse=lse)  # fmt: skip

    fns["ours"] = ours
    for name, make in suite_module.comparators().items():
        if make is not None:
            fns[name] = lambda make=make: make(inputs)

    errors = {}
    for name, fn in list(fns.items()):  # one eager call each: plans, compiles, checks
        try:
            fn()
        except Exception as e:  # a comparator that does not run here
            errors[name] = f"{type(e).__name__}: {str(e)[:160]}"
            fns.pop(name)
    torch.cuda.synchronize()
    want, _ = suite_module.reference(inputs)
    checks = {"ours_max_err": float((o.float() - want.float()).abs().max()),
              "ours_finite": bool(torch.isfinite(o).all())}  # fmt: skip
    # the op's decode part: one split over the batch (then its rows equal the compacted one-
    # split decode's, bitwise) or the plan's splits over the compact slots (other split
    # boundaries than the compacted batch's plan: the rows agree to rounding, max_diff)
    splits = paged_sm90.packed_splits(q, k, table, len(q_lens), op.MAX_QUERY_TOKENS)
    checks["decode_splits"] = splits
    for name, (ox, lx, rows) in outs.items():
        if name == "decode" and splits > 1:
            checks["decode_rows_max_diff"] = float((o[rows].float() - ox.float()).abs().max())
            continue
        checks[f"{name}_rows_bitwise"] = bool(
            torch.equal(o[rows], ox) and torch.equal(lse[:, rows], lx)
        )
    if short:  # ours' decode rows are the decode part's: bitwise
        checks["decode_in_op_rows_bitwise"] = bool(
            torch.equal(op_[rows_s], o[rows_s]) and torch.equal(lp[:, rows_s], lse[:, rows_s])
        )
    samples = time_interleaved(fns)
    ms = {name: median(s) for name, s in samples.items()}
    return {"case": case.name, "ms": ms, "methods": {n: s.method for n, s in samples.items()},
            "checks": checks, "errors": errors}  # fmt: skip


def main() -> None:
    rows = []
    for case in suite_module.PREFILL_BENCH_CASES:
        r = run_case(case)
        rows.append(r)
        ms = r["ms"]
        print(f"{r['case']}")
        for name, t in ms.items():
            extra = ""
            if name == "ours":
                for comp in ("flashinfer_fa3", "flashinfer", "fa4"):
                    if comp in ms:
                        extra += f"  {comp}/ours {ms[comp] / t:.3f}x"
                if "before" in ms:
                    extra += f"  before/ours {ms['before'] / t:.3f}x"
            print(f"  {name:15s} {t:8.4f} ms  [{r['methods'][name]}]{extra}")
        if "fwd" in ms and "decode" in ms:
            print(f"  fwd + decode    {ms['fwd'] + ms['decode']:8.4f} ms (parts, compacted)")
        if "fwd" in ms and "decode_in_op" in ms:
            print(f"  fwd + in_op     {ms['fwd'] + ms['decode_in_op']:8.4f} ms (the op's parts)")
        print(f"  checks {r['checks']}")
        for name, e in r["errors"].items():
            print(f"  {name}: {e}")
        sys.stdout.flush()
    if len(sys.argv) > 1:
        with open(sys.argv[1], "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
