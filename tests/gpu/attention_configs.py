"""The attention forward's config checks on the GPU (the fixed rules', the D = 192 / L2 / wg3
candidates' tests): a config forced through the suite's launcher (or the op's own choice)
against the suite's reference and tolerance, every element written (NaN-poisoned out), bitwise
the same on a second call and, where only the tile order or the deal moves, bitwise the default
config's."""

from __future__ import annotations

import torch

from forgekernel.bench.check import poison, verify
from forgekernel.bench.suites import attention as suite_module

SUITE = suite_module.suite()


def forced(knobs: dict):
    """The suite's launcher with the config `knobs` forced (a `run(inputs, out)`)."""

    def run(inputs, out):
        return suite_module.run_config(inputs, out, **knobs)

    return run


def check_run(inputs, run, *, as_default: bool) -> None:
    """`run(inputs, out)` on `inputs` as the module docstring says; `as_default`: also bit for
    bit the default config's output."""
    _, cmps = verify(SUITE, inputs, torch.device("cuda"), run=run)
    assert all(c.ok for c in cmps), [c.message for c in cmps]
    first, again = (run(inputs, poison(SUITE.alloc_out(inputs))) for _ in range(2))
    default = None
    if as_default:
        default = suite_module.run_config(inputs, poison(SUITE.alloc_out(inputs)))
    torch.cuda.synchronize()
    assert not first[0].isnan().any() and not first[1].isnan().any()
    for i, (got, again_) in enumerate(zip(first, again)):
        assert torch.equal(got, again_)
        if default is not None:
            assert torch.equal(got, default[i])
