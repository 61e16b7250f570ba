"""Run the chunked Gated DeltaNet forward on the suite's inputs a few times, for a profiler
wrapped around this script (scripts/device_profile.sh with SCRIPT set to it):

    python scripts/profile_gdn_prefill.py [n t h hv [state [flashinfer]]]   (default 4 8192 16 32 1)

n sequences of t tokens (varlen, B = 1), q / k heads h, value heads hv, an fp32 initial state
unless state is 0; k unit-norm and g = logsigmoid(N(0, 1)) as in bench/suites/gdn_prefill.py.
The launcher picks the V split (n hv <= SMs / 2: two CTAs per head).
Launches: 3 (profile the last: -s 2 -c 1). In ncu's source page the roles are address ranges
of the one kernel: the state warpgroups' loop lies between USETMAXREG.TRY_ALLOC 0xc0 and
USETMAXREG.DEALLOC 0x68, the aux warpgroup's after the latter (tests/
test_gdn_prefill_compile.py compiles the same code).
A sixth argument `flashinfer` runs FlashInfer's `chunk_gated_delta_rule` on the same inputs
instead (state 0 only: its -nostate comparator; KERNELS=FullyFusedDeltaRuleSm90; its first call
JITs). Its roles in ncu's source page: load / store warps up to USETMAXREG.DEALLOC 0x18, aux
from USETMAXREG.DEALLOC 0x68, state from USETMAXREG.TRY_ALLOC 0xc0 (docs/linear_attention/
NOTES.md, "FlashInfer's sm90 GDN prefill, read"). The op's own route is the t_pre path but on
unsplit launches over ungrouped heads (`launch.t_pre_for`). A sixth argument `t_pre` forces the
t_pre path (the T precompute, KERNELS=GdnTPre, then the chunked kernel's t_pre form,
KERNELS=GdnChunked: its aux from USETMAXREG.DEALLOC 0x68 is Q K^T, P and the tables only; its
O warp inside warpgroup 0's 0x18 region); `standard` forces the standard form (the bench's
variant `standard`); `t_pre_state_lds` the t_pre form with next/gdn-tpre's state chain (the
bench's A/B variant)."""

from __future__ import annotations

import importlib
import sys

import torch
import torch.nn.functional as F


def main() -> None:
    dims = [int(x) for x in sys.argv[1:6]] if len(sys.argv) > 4 else [4, 8192, 16, 32, 1]
    n, t, h, hv = dims[:4]
    state = dims[4] if len(dims) > 4 else 1
    op = importlib.import_module("forgekernel.ops.gated_delta_rule_chunked")
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rnd(*shape):
        return torch.randn(*shape, device="cuda", generator=gen)

    q = rnd(1, n * t, h, 128).bfloat16()
    k = F.normalize(rnd(1, n * t, h, 128), dim=-1).bfloat16()
    v = rnd(1, n * t, hv, 128).bfloat16()
    g, beta = F.logsigmoid(rnd(1, n * t, hv)), torch.sigmoid(rnd(1, n * t, hv))
    init = rnd(n, hv, 128, 128) * 0.1 if state else None
    cu = torch.arange(0, (n + 1) * t, t, dtype=torch.int32, device="cuda")
    flashinfer = len(sys.argv) > 6 and sys.argv[6] == "flashinfer"
    mode = sys.argv[6] if len(sys.argv) > 6 else "ours"
    forced = mode in ("t_pre", "t_pre_state_lds", "standard")
    if flashinfer and state:
        raise SystemExit("flashinfer: state 0 only (its -nostate comparator)")
    for _ in range(3):
        if flashinfer:  # as bench/suites/gdn_prefill.py calls it: (T, H, K), linear decay
            from flashinfer import chunk_gated_delta_rule

            chunk_gated_delta_rule(q[0], k[0], v[0], g=g[0].exp(), beta=beta[0],
                                   cu_seqlens=cu.long())  # fmt: skip
        elif forced:  # the bench's variants `t_pre`, `standard`, `t_pre_state_lds`
            from forgekernel.kernels.linear_attention.gdn_prefill.sm90 import launch

            out = torch.empty_like(v[0])
            final = torch.empty(n, hv, 128, 128, device="cuda")
            launch.gdn_prefill(q[0], k[0], v[0], g[0], beta[0], init, cu, out, final, 128**-0.5,
                               k_last=False, l2norm=False, t_pre=mode != "standard",
                               state_lds=mode == "t_pre_state_lds")  # fmt: skip
        else:
            op.gated_delta_rule(q, k, v, g, beta, initial_state=init, output_final_state=True,
                                cu_seqlens=cu)  # fmt: skip
    torch.cuda.synchronize()
    print("done", n, t, h, hv, state, mode)


if __name__ == "__main__":
    main()
