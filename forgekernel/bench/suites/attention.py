"""Attention forward suite: O = softmax(scale * Q K^T + mask) V and LSE, FlashAttention layout.

Outputs compared: (o, lse). Rows that see no key have LSE = -inf in the reference; `compare`
counts a non-finite reference value as reproduced only when ours is the same value, so such
rows must be exactly -inf in ours too (NaN or a finite value there fails).
"""

from __future__ import annotations

from typing import Any

import torch

from forgekernel.bench.suite import Case, Inputs, OpSuite
from forgekernel.kernels.attention.fwd.sm90 import SPEC


def _case(
    b: int,
    hq: int,
    hkv: int,
    sq: int,
    d: int,
    causal: bool = True,
    *,
    sk: int | None = None,
    dv: int | None = None,
    scale: float | None = None,
) -> Case:
    sk, dv = sq if sk is None else sk, d if dv is None else dv
    seqs = f"s{sq}" if sq == sk else f"sq{sq}-sk{sk}"
    name = f"b{b}-hq{hq}-hkv{hkv}-{seqs}-d{d}" + (f"-dv{dv}" if dv != d else "")
    name += ("-causal" if causal else "") + (f"-scale{scale:g}" if scale is not None else "")
    params = {"b": b, "hq": hq, "hkv": hkv, "sq": sq, "sk": sk, "d": d, "dv": dv}
    return Case(name, {**params, "causal": causal, "softmax_scale": scale})


# OPS.md, "Attention forward" (bf16, causal unless noted), plus the anchor shape of the FA4 and
# cuDNN figures (b4 hq32 hkv2 s8192 d128 causal: FA4 655 TFLOP/s, cuDNN 559 on the H200).
BENCH_CASES = (
    *(_case(b, 64, 4, s, 128) for b, s in ((16, 2048), (8, 4096), (4, 8192), (2, 16384))),
    _case(1, 64, 4, 32768, 128),
    _case(8, 64, 4, 4096, 128, causal=False),
    _case(8, 32, 32, 4096, 64),
    _case(4, 16, 16, 4096, 256),
    _case(2, 128, 128, 8192, 192, dv=128),
    _case(4, 32, 2, 8192, 128),
)
# Every supported head dim and GQA ratios 1, 4, 16 at small sizes, then awkward lengths: a
# single token, lengths off every tile size, Sq < Sk (decode-like) and Sq > Sk, whose first
# Sq - Sk rows see no key under the causal mask (O = 0, LSE = -inf).
CHECK_CASES = (
    _case(2, 16, 1, 512, 128),
    _case(2, 16, 1, 512, 128, causal=False),
    _case(2, 8, 8, 512, 64),
    _case(1, 4, 4, 512, 256),
    _case(1, 8, 8, 512, 192, dv=128),
    _case(1, 32, 2, 1024, 128),
    _case(2, 4, 1, 1, 128),
    _case(2, 4, 4, 1, 64, causal=False),
    _case(3, 4, 4, 17, 64),
    _case(1, 16, 1, 17, 128, causal=False),
    _case(1, 8, 2, 1000, 128),
    _case(2, 4, 4, 1000, 64, causal=False),
    _case(1, 4, 1, 4097, 128),
    _case(1, 2, 2, 4097, 64, causal=False),
    _case(2, 4, 1, 100, 128, sk=1000),
    _case(1, 4, 1, 100, 128, sk=1000, causal=False),
    _case(2, 4, 4, 1000, 64, sk=100),
    _case(1, 4, 4, 1000, 64, sk=100, causal=False),
    _case(2, 8, 2, 1, 128, sk=1000),
    _case(1, 4, 4, 17, 256, sk=4097),
    _case(1, 4, 1, 1000, 192, dv=128, sk=1003),
    _case(1, 8, 2, 1000, 128, scale=0.3),
)


def make_inputs(
    case: Case, dtype: torch.dtype, device: torch.device, gen: torch.Generator
) -> Inputs:
    p = case.params

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, dtype=dtype, device=device, generator=gen)

    return {
        "q": randn(p["b"], p["sq"], p["hq"], p["d"]),
        "k": randn(p["b"], p["sk"], p["hkv"], p["d"]),
        "v": randn(p["b"], p["sk"], p["hkv"], p["dv"]),
        "causal": p["causal"],
        "softmax_scale": p["softmax_scale"],
    }


def alloc_out(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    q, v = inputs["q"], inputs["v"]
    b, sq, hq, _ = q.shape
    o = torch.empty(b, sq, hq, v.shape[-1], dtype=q.dtype, device=q.device)
    return o, torch.empty(b, hq, sq, dtype=torch.float32, device=q.device)


def _args(inputs: Inputs) -> tuple:
    return inputs["q"], inputs["k"], inputs["v"], inputs["causal"], inputs["softmax_scale"]


def run_ours(inputs: Inputs, out: tuple[torch.Tensor, torch.Tensor] | None) -> tuple:
    from forgekernel.ops.attention import attention

    return attention(*_args(inputs), return_lse=True, out=out)


def reference(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    from forgekernel.reference.attention import attention_ref

    return attention_ref(*_args(inputs))


def low_precision(inputs: Inputs) -> tuple[torch.Tensor, torch.Tensor]:
    from forgekernel.reference.attention import attention_ref

    return attention_ref(*_args(inputs), upcast=False)


def _fa4() -> Any:
    try:
        from flash_attn.cute import flash_attn_func
    except Exception:
        return None

    def fa4(inputs: Inputs) -> Any:
        q, k, v, causal, scale = _args(inputs)
        return flash_attn_func(q, k, v, softmax_scale=scale, causal=causal)

    return fa4


def _cudnn() -> Any:
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    if not torch.backends.cudnn.is_available():
        return None

    def cudnn(inputs: Inputs) -> torch.Tensor:
        # (B, H, S, D) views, made once per input set outside the timed call. SDPA's causal
        # mask is top-left aligned: the same as ours for the bench cases (all Sq == Sk).
        if "bhsd" not in inputs:
            inputs["bhsd"] = tuple(inputs[n].transpose(1, 2) for n in ("q", "k", "v"))
        q, k, v = inputs["bhsd"]
        gqa = q.shape[1] != k.shape[1]
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return sdpa(
                q, k, v, is_causal=inputs["causal"], scale=inputs["softmax_scale"], enable_gqa=gqa
            )

    return cudnn


def comparators() -> dict[str, Any]:
    if not torch.cuda.is_available():
        return {"fa4": None, "cudnn": None}
    return {"fa4": _fa4(), "cudnn": _cudnn()}


def causal_pairs(sq: int, sk: int) -> int:
    """Unmasked (i, j) pairs under the bottom-right causal mask: row i sees i + Sk - Sq + 1
    keys, clamped to [0, Sk]."""
    return sum(min(max(i + sk - sq + 1, 0), sk) for i in range(sq))


def flops(case: Case) -> float:
    """4 * B * Hq * (D + Dv) / 2 per unmasked pair (FA4's count: masked pairs are free)."""
    p = case.params
    pairs = causal_pairs(p["sq"], p["sk"]) if p["causal"] else p["sq"] * p["sk"]
    return 2.0 * p["b"] * p["hq"] * (p["d"] + p["dv"]) * pairs


def nbytes(case: Case, dtype: torch.dtype) -> float:
    """q + k + v read, o written (the LSE, 1/D of o in fp32, is left out)."""
    p = case.params
    elem = torch.empty((), dtype=dtype).element_size()
    q_o = p["sq"] * p["hq"] * (p["d"] + p["dv"])
    k_v = p["sk"] * p["hkv"] * (p["d"] + p["dv"])
    return float(p["b"] * (q_o + k_v) * elem)


def suite() -> OpSuite:
    return OpSuite(
        name="attention",
        kernel_sources=SPEC.sources,  # the ledger hashes what the compile cache hashes
        dtypes=(torch.bfloat16, torch.float16),
        check_cases=CHECK_CASES,
        bench_cases=BENCH_CASES,
        make_inputs=make_inputs,
        alloc_out=alloc_out,
        run_ours=run_ours,
        reference=reference,
        low_precision=low_precision,
        comparators=comparators,
        flops=flops,
        bytes=nbytes,
        atol=1e-3,
        bench_dtypes=(torch.bfloat16,),
    )
