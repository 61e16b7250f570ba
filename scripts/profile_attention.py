"""Run one attention backward (and forward) of ours and of FA4 on the same inputs, for a
profiler wrapped around this script (scripts/device_profile.sh runs it under ncu).

    python scripts/profile_attention.py [b hq hkv s d [dv [sk]]]   (default 4 32 32 8192 128,
    causal; sk: a key length other than s, the chunked prefill shape)

FWD_ONLY=1: the forwards only (two rounds of each: ours, FA4), no backward.
"""

from __future__ import annotations

import os
import sys

import torch

import forgekernel


def main() -> None:
    dims = sys.argv[1:6] if len(sys.argv) > 5 else (4, 32, 32, 8192, 128)
    b, hq, hkv, s, d = (int(x) for x in dims)
    dv = int(sys.argv[6]) if len(sys.argv) > 6 else d
    sk = int(sys.argv[7]) if len(sys.argv) > 7 else s
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(h: int, width: int = d, length: int = s) -> torch.Tensor:
        return torch.randn(b, length, h, width, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, do = randn(hq), randn(hkv, d, sk), randn(hkv, dv, sk), randn(hq, dv)
    o, lse = forgekernel.attention(q, k, v, causal=True, return_lse=True)
    from flash_attn.cute import flash_attn_func
    from flash_attn.cute.interface import _flash_attn_bwd

    if os.environ.get("FWD_ONLY"):
        for _ in range(2):
            forgekernel.attention(q, k, v, causal=True, return_lse=True)
            flash_attn_func(q, k, v, causal=True)
        torch.cuda.synchronize()
        print("done (forwards)", b, hq, hkv, s, sk, d, dv)
        return
    for _ in range(2):  # the second round is the one to read (compiles and caches warm)
        flash_attn_func(q, k, v, causal=True)
        _flash_attn_bwd(q, k, v, o, do, lse, softmax_scale=d**-0.5, causal=True)
        forgekernel.attention_backward(q, k, v, o, lse, do, causal=True)
    torch.cuda.synchronize()
    print("done", b, hq, hkv, s, d, dv)


if __name__ == "__main__":
    main()
