"""Which initial-state layout do the comparators take? On a GPU, one small case with a state per
comparator, run with the state in each plausible layout, its output o and final state checked
against our fp64 recurrence (forgekernel/reference/delta_rule.py):

    OUT=/tmp/out python3 scripts/probe_state_layouts.py [--only flashinfer|cudnn]

  flashinfer  FlashInfer `chunk_gated_delta_rule` (GDN prefill; bench/suites/gdn_prefill.py):
              2 sequences of 200 and 77 tokens, h 4, hv 8, head 128, bf16; its docstring says
              the final state is (N, H, V, K); it takes fp32 states only.
  cudnn       FlashInfer's `flashinfer.cudnn.cudnn_recurrent_kda` (cuDNN KDA;
              bench/suites/kda_prefill.py): the same lengths, h 4, hv 4; its docstring says
              "[N, HV, 128, 128], V-major, float32 or bfloat16" (so bf16 states are tried too),
              and that it advances initial_state in place unless given output_state (it gets a
              copy, and an output_state where its signature has one).

Layouts (gdn_prefill.STATE_LAYOUTS): "kv" our (N, HV, K, V), "vk" its transpose (N, HV, V, K),
each fp32 and "-bf16"; the comparator's final state is read back in the layout it was given
(and, for the record, in the other one). A "nostate" row runs the case without a state: the
comparator's own error, the yardstick a wrong layout stands out from. The state is N(0, 1)
(ten times the suites' 0.1), so that a wrong layout moves o by O(1), far above bf16 rounding,
and the decays mild (log decay in [-0.05, -0.005], not the suites' logsigmoid(N(0, 1)), under
which the initial state is forgotten within ~50 tokens), so that the final state depends on the
initial one too.

Verdict per row: "ok" where both errors, relative to the reference's largest magnitude, are
within TOL (the nostate row: o's; it also says which layout its final state reads right in);
the layout confirmed is the one orientation whose rows pass, fp32 where that passes (`decide`;
none, or both: nothing confirmed).
Where one is confirmed, the suite's wrapper is run once with its constant set to it (row
"suite:LAYOUT"), the path the bench takes. One line per row; $OUT/state_layouts.json (if OUT is
set) holds the rows and what to set: gdn_prefill.FLASHINFER_STATE_LAYOUT,
kda_prefill.CUDNN_STATE_LAYOUT. A comparator missing or raising prints its reason; the next one
runs; the exit code is 0 (2 without a GPU). FlashInfer's first call JIT-compiles its kernel
(13-90 s on the H200): first_call_s in its first row.
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this tree's forgekernel

LENS = (200, 77)
TOL = 3e-2  # largest error over the reference's largest magnitude, o and final state
LAYOUTS = {"flashinfer": ("kv", "vk"), "cudnn": ("kv", "vk", "kv-bf16", "vk-bf16")}
SUITE_CONSTANT = {
    "flashinfer": "gdn_prefill.FLASHINFER_STATE_LAYOUT",
    "cudnn": "kda_prefill.CUDNN_STATE_LAYOUT",
}


def make_case(name: str, device, seed: int = 0) -> dict:
    """The suite's inputs for the probe case (bf16), the state N(0, 1), the decays mild."""
    import torch

    from forgekernel.bench.suite import Case
    from forgekernel.bench.suites import gdn_prefill, kda_prefill

    mod, hv = (gdn_prefill, 8) if name == "flashinfer" else (kda_prefill, 4)
    params = {"lens": LENS, "h": 4, "hv": hv, "state": True}
    if mod is kda_prefill:
        params["strong"] = False
    gen = torch.Generator(device=device).manual_seed(seed)
    inputs = mod.make_inputs(Case("probe", params), torch.bfloat16, device, gen)
    inputs["state"] = inputs["state"] * 10.0
    # mild decays (log in [-0.05, -0.005]): the initial state still weighs in the final one
    g = inputs["g"]
    inputs["g"] = -0.005 - 0.045 * torch.rand(g.shape, device=device, generator=gen)
    return inputs


def reference(name: str, inputs: dict, with_state: bool):
    """Our fp64 recurrence: (o (1, T, HV, V), final (N, HV, K, V)), both fp64."""
    import torch

    from forgekernel.reference.delta_rule import (
        gated_delta_rule_recurrent,
        kimi_delta_attention_recurrent,
    )

    run = gated_delta_rule_recurrent if name == "flashinfer" else kimi_delta_attention_recurrent
    i = inputs
    return run(i["q"], i["k"], i["v"], i["g"], i["beta"],
               initial_state=i["state"] if with_state else None, output_final_state=True,
               cu_seqlens=i["cu_seqlens_long"], dtype=torch.float64)  # fmt: skip


def comparator(name: str):
    """call(inputs, state in the comparator's layout or None) -> (o (1, T, HV, V), final state
    as returned or None), and its version; raises where the library is missing."""
    import torch

    if name == "flashinfer":
        import flashinfer
        from flashinfer import chunk_gated_delta_rule as fn

        def call(i, state):
            out = fn(i["q"][0], i["k"][0], i["v"][0], g=i["g"][0].exp(), beta=i["beta"][0],
                     initial_state=state, output_final_state=True,
                     cu_seqlens=i["cu_seqlens_long"])  # fmt: skip
            o, final = out if isinstance(out, tuple) else (out, None)
            return o.reshape(i["v"].shape), final

        return call, getattr(flashinfer, "__version__", "?")

    import flashinfer
    from flashinfer.cudnn import cudnn_recurrent_kda as fn

    try:
        takes_out = "output_state" in inspect.signature(fn).parameters
    except (TypeError, ValueError):
        takes_out = False

    def call(i, state):
        extra = {}
        if state is not None:
            extra["initial_state"] = state.clone()  # it may advance it in place
            if takes_out:
                extra["output_state"] = torch.empty_like(state)
        out = fn(i["q"], i["k"], i["v"], i["g"], i["beta"], use_qk_l2norm_in_kernel=False,
                 output_final_state=True, cu_seqlens=i["cu_seqlens_long"], **extra)  # fmt: skip
        o, final = out if isinstance(out, tuple) else (out, None)
        if final is None and state is not None and not takes_out:
            final = extra["initial_state"]
        return o.reshape(i["v"].shape), final

    try:
        import cudnn

        version = f"flashinfer {flashinfer.__version__}, cudnn-frontend {cudnn.__version__}"
    except Exception:
        version = f"flashinfer {getattr(flashinfer, '__version__', '?')}"
    return call, version


def errors(o, final, ref_o, ref_final, layout: str | None) -> dict:
    """Largest abs errors of o and of the final state (read in `layout`, and in the other one),
    and each over the reference's largest magnitude."""
    from forgekernel.bench.suites.gdn_prefill import state_from_layout

    row = {}
    o_err = float((o.double() - ref_o).abs().max())
    row["o_err"], row["o_rel"] = o_err, o_err / max(float(ref_o.abs().max()), 1e-30)
    if final is None:
        row["state_err"] = row["state_rel"] = None
        return row
    scale = max(float(ref_final.abs().max()), 1e-30)
    mine = (layout or "kv").split("-")[0]
    for tag, lay in (("", mine), ("_other", "kv" if mine == "vk" else "vk")):
        if tuple(final.shape) != tuple(ref_final.shape):
            row["state_err" + tag] = row["state_rel" + tag] = None
            row["state_shape"] = list(final.shape)
            continue
        err = float((state_from_layout(final, lay).double() - ref_final).abs().max())
        row["state_err" + tag], row["state_rel" + tag] = err, err / scale
    return row


def within(x) -> bool:
    return x is not None and x <= TOL


def verdict(row: dict) -> str:
    """Verdict "ok" / "wrong" / "raised"; a nostate row on o alone, with the layout its final state
    reads right in (final_layout: the returned state's layout, whatever the input's)."""
    if "error" in row:
        return "raised"
    if row["layout"] == "nostate":
        kv, vk = within(row.get("state_rel")), within(row.get("state_rel_other"))
        row["final_layout"] = "kv" if kv else "vk" if vk else None
        return "ok" if within(row["o_rel"]) else "wrong"
    return "ok" if within(row["o_rel"]) and within(row.get("state_rel")) else "wrong"


def decide(rows: list[dict]) -> str | None:
    """The layout confirmed: the one orientation (kv / vk) whose rows pass, its fp32 form where
    that passes (ours is fp32), else its bf16 one; None where no or both orientations pass."""
    good = [r["layout"] for r in rows if r["verdict"] == "ok" and r["layout"] != "nostate"]
    bases = {g.split("-")[0] for g in good}
    if len(bases) != 1:
        return None
    (base,) = bases
    return base if base in good else f"{base}-bf16"


def fmt(x) -> str:
    return "-" if x is None else f"{x:.3e}"


def show(row: dict) -> None:
    head = f"{row['comparator']:<10} {row['layout']:<14}"
    if "error" in row:
        print(f"{head} raised: {row['error']}", flush=True)
        return
    extra = f" first_call_s {row['first_call_s']:.1f}" if "first_call_s" in row else ""
    if row["layout"] == "nostate":
        extra += f" (its final state reads right as {row.get('final_layout')})"
    print(f"{head} o_err {fmt(row['o_err'])} (rel {fmt(row['o_rel'])})  state_err "
          f"{fmt(row.get('state_err'))} (rel {fmt(row.get('state_rel'))}; read as the other "
          f"layout {fmt(row.get('state_rel_other'))})  {row['verdict']}{extra}",
          flush=True)  # fmt: skip


def suite_row(name: str, inputs: dict, layout: str, ref_o) -> dict:
    """The suite's own wrapper with its constant set to `layout`: o against the reference."""
    from forgekernel.bench.suites import gdn_prefill, kda_prefill

    mod, attr = (gdn_prefill, "FLASHINFER_STATE_LAYOUT")
    if name == "cudnn":
        mod, attr = (kda_prefill, "CUDNN_STATE_LAYOUT")
    old = getattr(mod, attr)
    setattr(mod, attr, layout)
    try:
        run = mod._flashinfer() if name == "flashinfer" else mod._cudnn()
        row = errors(run(dict(inputs)), None, ref_o, None, layout)
        row["verdict"] = "ok" if row["o_rel"] <= TOL else "wrong"
        return row
    finally:
        setattr(mod, attr, old)


def probe(name: str, device) -> tuple[list[dict], str | None]:
    import torch

    rows: list[dict] = []

    def add(layout: str, **row) -> dict:
        row = {"comparator": name, "layout": layout, **row}
        if "verdict" not in row:
            row["verdict"] = verdict(row)
        rows.append(row)
        show(row)
        return row

    try:
        call, version = comparator(name)
    except Exception as e:  # not installed, or a dependency fails to load
        add("-", error=f"import: {type(e).__name__}: {str(e)[:300]}")
        return rows, None
    print(f"{name}: {version}", flush=True)
    inputs = make_case(name, device)
    first = True
    for layout in ("nostate", *LAYOUTS[name]):
        with_state = layout != "nostate"
        try:
            from forgekernel.bench.suites.gdn_prefill import state_in_layout

            ref_o, ref_final = reference(name, inputs, with_state)
            state = state_in_layout(inputs["state"], layout) if with_state else None
            t0 = time.time()
            o, final = call(inputs, state)
            if device.type == "cuda":
                torch.cuda.synchronize()
            extra = {"first_call_s": time.time() - t0} if first else {}
            first = False
            row = errors(o, final, ref_o, ref_final, layout if with_state else None)
            add(layout, version=version, **row, **extra)
        except Exception as e:
            add(layout, error=f"{type(e).__name__}: {str(e)[:300]}")
    confirmed = decide(rows)
    good = [r["layout"] for r in rows if r["verdict"] == "ok" and r["layout"] != "nostate"]
    if confirmed is None and good:
        print(f"{name}: both orientations pass ({good}): nothing confirmed", flush=True)
    if confirmed is not None:
        try:
            ref_o, _ = reference(name, inputs, True)
            add(f"suite:{confirmed}", **suite_row(name, inputs, confirmed, ref_o))
        except Exception as e:
            add(f"suite:{confirmed}", error=f"{type(e).__name__}: {str(e)[:300]}")
    return rows, confirmed


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description="Probe FlashInfer GDN's and cuDNN KDA's initial-state layout on a GPU "
        "(one small case each; errors of o and the final state against our fp64 reference)."
    )
    ap.add_argument("--only", choices=sorted(LAYOUTS), action="append",
                    help="probe only this comparator (repeatable; default: both)")  # fmt: skip
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    import torch

    if not torch.cuda.is_available():
        print("probe_state_layouts: no GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda")
    summary = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "lens": LENS,
               "tol": TOL, "rows": [], "confirmed": {}, "set": {}}  # fmt: skip
    for name in args.only or sorted(LAYOUTS):
        rows, confirmed = probe(name, device)
        summary["rows"] += rows
        summary["confirmed"][name] = confirmed
        summary["set"][SUITE_CONSTANT[name]] = confirmed
        print(f"{name}: confirmed layout {confirmed!r} -> set {SUITE_CONSTANT[name]} = "
              f"{confirmed!r}", flush=True)  # fmt: skip
    if os.environ.get("OUT"):
        path = Path(os.environ["OUT"]) / "state_layouts.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(summary, indent=1))
        print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
