"""What the linear-attention backwards' slot layout (ops/_linattn_varlen.py `run_in_slots`)
gives a sequence against the same sequence run alone, for the CPU and GPU tests of both ops
(tests/test_gdn_bwd_kernel_path.py, tests/gpu/test_gdn_bwd_kernel_path_gpu.py,
tests/gpu/test_kda_bwd_kernel_path_gpu.py; docs/linear_attention/NOTES.md "Slots against each
sequence alone").

Bit for bit: dq, dv, dbeta, the state gradient, and dk, dg on every row before the sequence's
last chunk. Within `TAIL_TOL` only: dk and dg on the rows of a last chunk that T cuts (len % 64
> 0). There the chunk kernel takes G_C, the chunk's total log decay, at the chunk's last row
inside T: row len % 64 - 1 alone (rows past T are outside the tensor), row 63 in the slot
layout (the zero rows after the sequence are inside it). The factors' warp scan (GDN's kernel
0, `reference.gdn_bwd_factors.scan_model`; KDA's first pass, `reference.kda_bwd_chunk.
first_pass_scan`) adds the same gates in another association for the two rows, so the two G_C
can differ in their last bits, and with them e^(G_C - G) (dk's dke term, te) and e^(G_C) <dh, h>
(dG's last position, reverse-summed into every row of the chunk). Nothing else reads that G_C:
kernel 0 / the first pass form e^(G_C) and K e^(G_C - G) for the state kernel from the chunk's
total, the same sums in both runs (the zero gates past T masked alone, zero rows in the slots).
"""

from __future__ import annotations

import torch

CHUNK = 64
# |slots - alone| on the tail rows of dk (16-bit) and dg (fp32), a fraction of the largest
# entry of the sequence's gradient. G_C's last bits move e^(G_C - G) by ~1e-6 relative: a 16-bit
# dk of the chunk kernel turns by one unit in the last place where it sat at a rounding edge
# (at most 2^-7 of the largest entry, before the q / k epilogue's sum and l2norm backward), dG's
# terms by ~1e-6. The CPU emulation with the kernels' sums (GDN, the H100 test's distributions,
# 6 seeds x 2 tails): dk 3-4 entries a tail at most 5.1e-4, dg at most 1.3e-6.
TAIL_TOL = {"dk": 2**-7, "dg": 1e-4}


def tail_start(length: int) -> int:
    """The first row of the sequence's last chunk where T cuts it, else `length` (no tail)."""
    return length if length % CHUNK == 0 else length - length % CHUNK


def assert_sequence_alone(names, got, alone, first: int, end: int, label) -> None:
    """The token gradients `got` (B = 1, the packed callers' rows) of rows [first, end) against
    `alone` (the sequence's own call), named `names` (dq, dk, dv, dg, dbeta): the module
    docstring's contract. `label` names the sequence in a failure."""
    tail = tail_start(end - first)
    for name, x, r in zip(names, got, alone):
        x = x[:, first:end]
        if name not in TAIL_TOL:
            assert torch.equal(x, r), (label, name)
            continue
        assert torch.equal(x[:, :tail], r[:, :tail]), (label, name, "before the last chunk")
        diff = (x[:, tail:].double() - r[:, tail:].double()).abs()
        err = float(diff.max()) if diff.numel() else 0.0
        bound = TAIL_TOL[name] * float(r.double().abs().max())
        assert err <= bound, (label, name, "last chunk", err, bound)


# The lens of both ops' CPU slot tests and whether the factors' own sums stand in for G (`scan`:
# the case whose cut last chunks are 45 and 39 rows, where the two G_C can differ)
CPU_CASES = (
    ([1, 63, 0, 64, 65, 130], False),
    ([200, 3], False),
    ([64, 0], False),
    ([130, 301, 0, 295], True),
)
