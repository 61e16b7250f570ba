"""`attn_implementation="forgekernel"` for Hugging Face transformers models.

Importing this module registers `forgekernel` (`register()` does it again, under any name) in
transformers' `AttentionInterface` (the attention function) and `AttentionMaskInterface` (the
mask builder), so that a model loads with
`AutoModelForCausalLM.from_pretrained(..., attn_implementation="forgekernel")`.

The attention function takes transformers' (B, H, S, D) query / key / value and hands
`forgekernel.attention` their (B, S, H, D) transposes: views, not copies (every stride but the
innermost is dynamic in the compiled kernel, and a transpose of a row-major projection output
is TMA-ready as it is). GQA goes in as is (K / V keep their own head count, no `repeat_kv`);
the causal flag is `is_causal` or `module.is_causal`; the op is differentiable, so training
runs the forgekernel backward.

What the kernel cannot do runs transformers' own SDPA attention instead, with a warning the
first time each reason occurs in an eager call (dynamo cannot trace one): an attention mask
other than plain causal (padding, packed sequences, a custom mask), dropout > 0, a sliding
window shorter than the keys, a position bias, and tensors the kernel does not take (not CUDA,
not fp16 / bf16, head dims without a forward kernel, or without a backward kernel when
gradients are needed). Logit softcapping (Gemma 2) raises instead: SDPA has none either
(transformers 4.5x's SDPA function drops it silently, 5.x's raises), so such models need
`attn_implementation="eager"`.

The mask builder gives no mask where the attention is plain causal in the kernel's
bottom-right alignment, judged from shapes (same query and key lengths from position 0, no
padding mask, no pattern beyond causal), so that such calls reach the kernel also under
`torch.compile`, where transformers' SDPA builder would materialize the causal mask; elsewhere
it gives transformers' SDPA mask (boolean, 4-D). In eager calls a materialized mask that is
plain causal after all (transformers' packed-sequence check without a cache, a tokenizer's
all-ones mask) still reaches the kernel; under `torch.compile` only the shape-judged case
does, so a compiled model reaches the kernel with attention_mask=None and a cache (transformers'
default `use_cache=True`), and falls back to SDPA with `use_cache=False` (where SDPA itself gets
the materialized mask too).
"""

from __future__ import annotations

import warnings
import weakref
from typing import Any

import torch

try:
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, causal_mask_function, sdpa_mask
except ImportError as e:  # not installed, or older than 4.53 (no masking_utils)
    raise ImportError(
        "forgekernel.integrations.transformers needs transformers >= 4.53: "
        "pip install 'forgekernel[transformers]'"
    ) from e

import forgekernel
from forgekernel.ops.attention import SUPPORTED_HEAD_DIMS
from forgekernel.ops.attention_bwd import BWD_HEAD_DIMS

NAME = "forgekernel"
KERNEL_DTYPES = (torch.float16, torch.bfloat16)

# Fallback reasons already warned about (one warning per reason and process).
_warned: set[str] = set()
# (the mask, its key length, whether it is plain causal) of the last mask `_is_plain_causal` read.
_last_mask: list[tuple[weakref.ref, int, bool] | None] = [None]


def kernel_refusal(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> str | None:
    """Why forgekernel's kernel cannot take these (B, H, S, D) tensors, or None when it can."""
    if query.dtype not in KERNEL_DTYPES or key.dtype != query.dtype or value.dtype != query.dtype:
        return f"dtype {query.dtype} (the kernel takes float16 / bfloat16)"
    head_dims = (query.shape[-1], value.shape[-1])
    if head_dims not in SUPPORTED_HEAD_DIMS:
        return f"head dims {head_dims} (no forward kernel)"
    training = torch.is_grad_enabled() and (
        query.requires_grad or key.requires_grad or value.requires_grad
    )
    if training and head_dims not in BWD_HEAD_DIMS:
        return f"head dims {head_dims} with gradients (no backward kernel)"
    if query.device.type != "cuda":
        return f"tensors on {query.device.type}, not CUDA"
    return None


def _fallback_reason(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float,
    sliding_window: int | None,
    kwargs: dict[str, Any],
) -> str | None:
    """The first feature of this call the kernel does not have, or None."""
    if attention_mask is not None and not _is_plain_causal(attention_mask, key.shape[2]):
        return "an attention mask (padding, packed sequences or a custom mask)"
    if dropout > 0:
        return "attention dropout"
    if sliding_window is not None and key.shape[2] > sliding_window:
        return "a sliding window shorter than the keys"
    if kwargs.get("position_bias") is not None:
        return "a position bias"
    return kernel_refusal(query, key, value)


def _is_plain_causal(mask: torch.Tensor, kv_length: int) -> bool:
    """A materialized boolean mask that is bottom-right causal and nothing else (transformers
    4.5x builds one for every call without a cache, for its packed-sequence check). Eager only
    (it reads the mask: one comparison and a sync per mask, as SDPA's own padding check);
    the layers of one forward share the mask, so the verdict is kept for the last one seen."""
    if torch.compiler.is_compiling() or mask.dtype != torch.bool or mask.dim() != 4:
        return False
    last = _last_mask[0]
    if last is not None and last[0]() is mask and last[1] == kv_length:
        return last[2]
    view = mask[..., :kv_length]
    sq, sk = view.shape[-2:]
    causal = torch.ones(sq, sk, dtype=torch.bool, device=mask.device).tril(sk - sq)
    verdict = torch.equal(view, causal.expand(view.shape))
    _last_mask[0] = (weakref.ref(mask), kv_length, verdict)
    return verdict


def _warn_once(reason: str) -> None:
    # Dynamo cannot trace warnings.warn (a graph break per layer, an error with fullgraph): the
    # warning comes from eager calls only.
    if reason not in _warned and not torch.compiler.is_compiling():
        _warned.add(reason)
        warnings.warn(
            f"forgekernel attention: {reason}; these calls run transformers' SDPA attention "
            "(sdpa_attention_forward) instead",
            stacklevel=3,
        )


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function contract: query (B, Hq, Sq, D), key (B, Hkv, Sk, D),
    value (B, Hkv, Sk, Dv) -> ((B, Sq, Hq, Dv) output, None: no attention weights)."""
    if softcap is not None:
        raise ValueError(
            f"forgekernel attention has no logit softcapping (softcap = {softcap}), nor has "
            "SDPA; load this model with attn_implementation='eager'"
        )
    reason = _fallback_reason(query, key, value, attention_mask, dropout, sliding_window, kwargs)
    if reason is not None:
        _warn_once(reason)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, sliding_window=sliding_window, **kwargs,
        )  # fmt: skip
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    out = forgekernel.attention(
        query.transpose(1, 2),
        key.transpose(1, 2),
        value.transpose(1, 2),
        causal=bool(causal),
        softmax_scale=scaling,
    )
    return out, None


def _query_length(kwargs: dict[str, Any]) -> int:
    # transformers 5 passes q_length (and q_offset); 4.5x the query positions (cache_position)
    return kwargs["q_length"] if "q_length" in kwargs else kwargs["cache_position"].shape[0]


def _plain_causal(kwargs: dict[str, Any]) -> bool:
    """The mask these builder arguments describe is bottom-right causal and nothing else: the
    causal pattern alone, no padding mask, and as many queries as keys from position 0 (known
    from shapes, so also while compiling)."""
    if kwargs.get("mask_function", causal_mask_function) is not causal_mask_function:
        return False
    if kwargs.get("attention_mask") is not None or kwargs.get("local_size") is not None:
        return False
    offsets = (kwargs.get("q_offset", 0), kwargs.get("kv_offset", 0))
    same_length = _query_length(kwargs) == kwargs["kv_length"]
    return same_length and all(type(o) is int and o == 0 for o in offsets)


def attention_mask(*args: Any, **kwargs: Any) -> torch.Tensor | None:
    """The mask builder (transformers' `AttentionMaskInterface` contract, called with
    keywords): None where the attention is plain causal for the kernel, else SDPA's mask."""
    if args:
        return sdpa_mask(*args, **{**kwargs, "allow_is_causal_skip": False})
    if _plain_causal(kwargs):
        return None
    mask = sdpa_mask(**kwargs)
    # SDPA also skips the mask where only its top-left causal flag is right (transformers 5, a
    # static cache's prefill); the kernel's bottom-right alignment agrees with one query, or
    # with as many queries as keys.
    q_length = _query_length(kwargs)
    if mask is None and q_length != 1 and q_length != kwargs["kv_length"]:
        mask = sdpa_mask(**{**kwargs, "allow_is_causal_skip": False})
    return mask


def register(name: str = NAME) -> None:
    """Make `attn_implementation=name` select forgekernel's attention (and its mask builder)
    in every transformers model that dispatches through `AttentionInterface`."""
    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, attention_mask)


register()
