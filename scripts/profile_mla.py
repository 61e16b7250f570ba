"""ncu target for the MLA decode (a few `forgekernel.mla_decode` calls on one serving shape, page
size 64, bf16, FlashMLA's combined cache):

    ncu -k regex:MlaSeesaw -s 2 -c 1 ... python3 scripts/profile_mla.py BATCH HEADS TOKENS [S_Q]

(the seesaw pass; regex:MlaDecode with FORGEKERNEL_MLA_SCHEDULE=roles for decode.py's)
"""

from __future__ import annotations

import sys

import torch

import forgekernel


def main(batch: int, heads: int, tokens: int, s_q: int = 1) -> None:
    page, dev, bf16 = 64, "cuda", torch.bfloat16
    pages = batch * -(-tokens // page)
    cache = torch.randn(pages, page, 1, 576, device=dev, dtype=bf16)
    table = torch.randperm(pages, device=dev, dtype=torch.int32).view(batch, -1)
    seqlens = torch.full((batch,), tokens, device=dev, dtype=torch.int32)
    q = torch.randn(batch, s_q, heads, 576, device=dev, dtype=bf16)
    ckv, kpe = cache[..., 0, :512], cache[..., 0, 512:]
    for _ in range(3):
        forgekernel.mla_decode(
            q[..., :512], q[..., 512:], ckv, kpe, table, seqlens, softmax_scale=0.1
        )
    torch.cuda.synchronize()


if __name__ == "__main__":
    main(*map(int, sys.argv[1:]))
