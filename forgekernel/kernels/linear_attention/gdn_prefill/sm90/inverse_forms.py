"""The forms of the chunked prefill's WY-inverse merges (phases 1, 2a, 2b), DSL-free: the
launcher, the bench and the tests read it (kept out of config.py, which KDA's kernels import:
their source hashes stay).

"fma": on the CUDA cores in fp32 (`inverse.invert_merge`; the standard kernels). Opt-in
"tf32" / "tf32x3": each 16 x 16 block product as mma.sync m16n8k8 with one / three tf32
passes (`inverse_mma.invert_merge_mma`): the aux warp's longest stretch on the tensor cores
(docs/linear_attention/NOTES.md, "The prefill at 0.57x FlashInfer")."""

from __future__ import annotations

INVERSES = {"fma": 0, "tf32": 1, "tf32x3": 3}  # form -> tf32 passes (0: FFMA)


def with_inverse(params: tuple, inverse: str) -> tuple:
    """A `config.params_for` key with the inverse form, named only off the standard "fma" (the
    standard keys, and the records behind them, stay as they were)."""
    if inverse not in INVERSES:
        raise ValueError(f"inverse must be one of {tuple(INVERSES)}, got {inverse!r}")
    if inverse == "fma":
        return params
    return tuple(sorted({**dict(params), "inverse": inverse}.items()))
