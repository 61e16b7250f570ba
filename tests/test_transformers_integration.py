"""`attn_implementation="forgekernel"` in Hugging Face transformers, on the CPU: a tiny GQA Llama
whose `forgekernel.attention` is the fp32 reference (the kernel's role) gives the logits and
gradients of transformers' eager and SDPA attention, the op receives views of transformers'
(B, H, S, D) tensors (no copies), and what the kernel cannot do (padding masks, dropout)
falls back to SDPA with one warning per reason. Skipped without transformers."""

from __future__ import annotations

import inspect
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

import forgekernel  # noqa: E402
from forgekernel.integrations import transformers as fk_tf  # noqa: E402
from forgekernel.runtime.device import tma_ready  # noqa: E402

# 2 layers, hidden 64, 4 query heads and 2 kv heads (GQA 2:1); head_dim 64, a kernel head dim.
CONFIG = dict(
    vocab_size=97,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=64,
)
B, S = 2, 11  # 11: not a tile multiple


def reference_attention(q, k, v, causal=False, softmax_scale=None, **kwargs):
    """forgekernel.attention's contract (OPS.md: (B, S, H, D), GQA, bottom-right causal) in
    fp32 torch, differentiable; records its calls."""
    reference_attention.calls.append((q, k, v, causal, softmax_scale))
    group = q.shape[2] // k.shape[2]
    k, v = (t.float().repeat_interleave(group, dim=2) for t in (k, v))
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else softmax_scale
    scores = torch.einsum("bqhd,bkhd->bhqk", q.float(), k) * scale
    if causal:
        sq, sk = q.shape[1], k.shape[1]
        seen = torch.ones(sq, sk, dtype=torch.bool).tril(sk - sq)
        scores = scores.masked_fill(~seen, float("-inf"))
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1), v).to(q.dtype)


@pytest.fixture
def calls(monkeypatch):
    """The kernel's stand-in: every call of forgekernel.attention (q, k, v, causal, scale), and
    the fp32 CPU tensors the real kernel refuses let through; no warning given yet."""
    reference_attention.calls = []
    monkeypatch.setattr(forgekernel, "attention", reference_attention)
    monkeypatch.setattr(fk_tf, "kernel_refusal", lambda q, k, v: None)
    monkeypatch.setattr(fk_tf, "_warned", set())
    return reference_attention.calls


def llama(impl: str) -> torch.nn.Module:
    """The same weights for every implementation (same seed)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(**CONFIG)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    return model.float()


def token_ids() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, CONFIG["vocab_size"], (B, S), generator=gen)


def test_registered_on_import():
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    assert AttentionInterface._global_mapping["forgekernel"] is fk_tf.attention_forward
    assert AttentionMaskInterface._global_mapping["forgekernel"] is fk_tf.attention_mask


@pytest.mark.parametrize("other", ["eager", "sdpa"])
def test_logits_match_eager_and_sdpa(calls, other):
    ids = token_ids()
    with torch.no_grad():
        want = llama(other)(ids, use_cache=False).logits
        got = llama("forgekernel")(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # one call per layer, GQA as is (2 kv heads), causal, the module's scale, (B, S, H, D)
    assert [(q.shape, k.shape, c, s) for q, k, v, c, s in calls] == 2 * [
        ((B, S, 4, 64), (B, S, 2, 64), True, pytest.approx(64**-0.5))
    ]


def test_training_gradients_match_sdpa(calls):
    ids = token_ids()
    models = {impl: llama(impl).train() for impl in ("sdpa", "forgekernel")}
    for model in models.values():
        model(ids, labels=ids, use_cache=False).loss.backward()
    assert len(calls) == 2
    want = dict(models["sdpa"].named_parameters())
    for name, p in models["forgekernel"].named_parameters():
        torch.testing.assert_close(p.grad, want[name].grad, rtol=1e-4, atol=1e-6, msg=name)


def test_qkv_reach_the_op_as_views_without_copies(calls, monkeypatch):
    """What transformers hands the attention function (B, H, S, D) is what reaches the op,
    transposed in place: same storage address, the transposed strides, TMA-ready."""
    from transformers import AttentionInterface

    seen = []

    def spy(module, query, key, value, *args, **kwargs):
        seen.append((query, key, value))
        return fk_tf.attention_forward(module, query, key, value, *args, **kwargs)

    monkeypatch.setitem(AttentionInterface._global_mapping, "forgekernel", spy)
    with torch.no_grad():
        llama("forgekernel")(token_ids())  # with a cache (the default): keys from the cache
    assert len(seen) == len(calls) == 2
    for hf_tensors, op_tensors in zip(seen, calls):
        for hf, op in zip(hf_tensors, op_tensors[:3]):
            assert op.data_ptr() == hf.data_ptr()
            assert op.stride() == hf.transpose(1, 2).stride()
            assert tma_ready(op)


def test_bf16_projection_views_are_tma_ready(calls):
    """The layout transformers produces (a (B, S, H*D) projection viewed (B, S, H, D) and
    transposed to (B, H, S, D)), in bf16 at D = 128: the op's (B, S, H, D) view needs no copy."""
    proj = torch.randn(B, S, 4 * 128, dtype=torch.bfloat16)
    kv = torch.randn(B, S, 2 * 128, dtype=torch.bfloat16)
    q = proj.view(B, S, 4, 128).transpose(1, 2)
    k = kv.view(B, S, 2, 128).transpose(1, 2)
    module = torch.nn.Module()
    out, weights = fk_tf.attention_forward(module, q, k, k, None, scaling=0.1)
    assert weights is None and out.shape == (B, S, 4, 128)
    op_q, op_k = calls[0][:2]
    assert op_q.data_ptr() == proj.data_ptr() and op_q.is_contiguous() and tma_ready(op_q)
    assert op_k.data_ptr() == kv.data_ptr() and tma_ready(op_k)
    assert calls[0][3:] == (True, 0.1)  # module.is_causal absent: causal, like SDPA's default


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    mask = torch.ones(B, S, dtype=torch.long)
    mask[0, :4] = 0  # row 0 left-padded by 4 tokens
    return token_ids(), mask


def test_padding_mask_falls_back_to_sdpa(calls):
    ids, mask = padded_batch()
    with torch.no_grad():
        want = llama("sdpa")(ids, attention_mask=mask).logits
        with pytest.warns(UserWarning, match="an attention mask .* SDPA attention") as record:
            got = llama("forgekernel")(ids, attention_mask=mask).logits
    assert calls == []
    assert len([w for w in record if "forgekernel" in str(w.message)]) == 1  # once, not per layer
    keep = mask.bool()
    torch.testing.assert_close(got[keep], want[keep], rtol=1e-5, atol=1e-5)


def test_all_ones_mask_reaches_the_kernel(calls):
    """A tokenizer's mask without padding is plain causal: no fallback."""
    ids = token_ids()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with torch.no_grad():
            llama("forgekernel")(ids, attention_mask=torch.ones(B, S, dtype=torch.long))
    assert len(calls) == 2


def test_fallbacks_warn_once_per_reason(calls):
    q = torch.randn(1, 4, 5, 64)
    k = torch.randn(1, 2, 5, 64)
    module = torch.nn.Module()
    module.num_key_value_groups = 2
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        for _ in range(3):
            fk_tf.attention_forward(module, q, k, k, None, dropout=0.1)
            fk_tf.attention_forward(module, q, k, k, None, sliding_window=4)
    messages = [str(w.message) for w in record]
    assert len(messages) == 2 and "dropout" in messages[0] and "sliding window" in messages[1]
    assert calls == []
    fk_tf.attention_forward(module, q, k, k, None, sliding_window=5)  # covers every key
    assert len(calls) == 1


def test_softcap_raises():
    q = torch.randn(1, 2, 3, 64)
    with pytest.raises(ValueError, match="no logit softcapping"):
        fk_tf.attention_forward(torch.nn.Module(), q, q, q, None, softcap=30.0)


def bhsd(d=64, dv=None, dtype=torch.bfloat16, grad=False):
    q, k = torch.randn(1, 4, 5, d, dtype=dtype), torch.randn(1, 2, 5, d, dtype=dtype)
    v = torch.randn(1, 2, 5, dv or d, dtype=dtype)
    return q.requires_grad_(grad), k, v


@pytest.mark.parametrize(
    "tensors, words",
    [
        (bhsd(dtype=torch.float32), "dtype torch.float32"),
        (bhsd(d=80), "head dims (80, 80) (no forward kernel)"),
        (bhsd(d=96, grad=True), "head dims (96, 96) with gradients (no backward kernel)"),
        (bhsd(d=96), "tensors on cpu, not CUDA"),  # forward-only: 96 has a forward kernel
        (bhsd(d=192, dv=128, grad=True), "tensors on cpu, not CUDA"),
    ],
)
def test_kernel_refusal_names_the_reason(tensors, words):
    assert words in fk_tf.kernel_refusal(*tensors)


def test_compiled_model_reaches_the_kernel(calls):
    """Under torch.compile transformers' SDPA mask builder materializes the causal mask; the
    forgekernel builder knows from shapes that it is plain causal, so the kernel still runs
    (with a cache, transformers' default: without one, its packed-sequence check makes a
    mask only eager calls can read)."""
    ids = token_ids()
    model = llama("forgekernel")
    with torch.no_grad():
        want = model(ids).logits
        calls.clear()
        got = torch.compile(model, backend="eager", fullgraph=True)(ids).logits
    assert len(calls) == 2 and all(c[3] for c in calls)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def builder_args(q_length: int, kv_length: int, q_offset: int, **extra) -> dict:
    """The mask builder's keywords as this transformers version passes them."""
    from transformers.masking_utils import sdpa_mask

    if "q_length" in inspect.signature(sdpa_mask).parameters:  # transformers 5
        return dict(
            batch_size=B, q_length=q_length, q_offset=q_offset, kv_length=kv_length, **extra
        )
    positions = torch.arange(q_offset, q_offset + q_length)
    return dict(batch_size=B, cache_position=positions, kv_length=kv_length, **extra)


@pytest.mark.parametrize(
    "q_length, kv_length, q_offset, padded, plain_causal",
    [
        (11, 11, 0, False, None),  # training / prefill: no mask built
        (1, 11, 10, False, None),  # decoding: one query sees every key
        (4, 11, 7, False, True),  # chunked prefill: built, and the kernel takes it (eager)
        (4, 11, 0, False, False),  # a static cache's prefill: keys 4..10 are empty slots
        (11, 11, 0, True, False),  # padding
    ],
)
def test_mask_builder(q_length, kv_length, q_offset, padded, plain_causal):
    """None (no mask) only where the kernel's bottom-right causal mask is the whole story;
    elsewhere SDPA's boolean mask, which the attention function reads in eager calls."""
    padding = None
    if padded:
        padding = torch.ones(B, kv_length, dtype=torch.bool)
        padding[0, :3] = False
    args = builder_args(q_length, kv_length, q_offset, attention_mask=padding)
    mask = fk_tf.attention_mask(**args)
    if plain_causal is None:
        assert mask is None
    else:
        assert mask.dtype == torch.bool and mask.shape[-2:] == (q_length, kv_length)
        assert fk_tf._is_plain_causal(mask, kv_length) is plain_causal


def training_step(impl: str, dtype: torch.dtype, ids: torch.Tensor) -> list[torch.Tensor]:
    """Loss and every parameter's gradient of one step of a GQA Llama (head dim 128, 4:1)."""
    torch.manual_seed(0)
    shape = {"hidden_size": 512, "intermediate_size": 1024, "num_attention_heads": 8}
    config = transformers.LlamaConfig(**{**CONFIG, **shape, "head_dim": 128, "vocab_size": 1000})
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation=impl)
    model.to("cuda", dtype).train()
    loss = model(ids, labels=ids, use_cache=False).loss
    loss.backward()
    return [loss.detach().float()] + [p.grad.float() for p in model.parameters()]


@pytest.mark.gpu
def test_llama_training_step_on_the_gpu(monkeypatch):
    """The real kernels in a bf16 training step: loss and gradients within 2x SDPA-bf16's error
    against fp32 eager attention (+ a small atol), and no input copied on the way in."""
    import importlib

    copied = []
    for leaf in ("fwd", "bwd"):
        launch = importlib.import_module(f"forgekernel.kernels.attention.{leaf}.sm90.launch")
        original = launch.as_tma_ready

        def spy(t, original=original):
            ready = original(t)
            copied.append(ready is not t)
            return ready

        monkeypatch.setattr(launch, "as_tma_ready", spy)
    kernel_calls = []
    kernel = forgekernel.attention

    def counted(*args, **kwargs):
        kernel_calls.append(1)
        return kernel(*args, **kwargs)

    monkeypatch.setattr(forgekernel, "attention", counted)
    ids = torch.randint(0, 1000, (2, 1000), device="cuda")  # S = 1000: not a tile multiple
    want = training_step("eager", torch.float32, ids)
    sdpa = training_step("sdpa", torch.bfloat16, ids)
    got = training_step("forgekernel", torch.bfloat16, ids)
    assert len(kernel_calls) == 2  # one per layer: no fallback
    assert copied and not any(copied)  # what the launchers made TMA-ready was so already
    for w, s, g in zip(want, sdpa, got):
        atol = 1e-3 * w.abs().max().item()
        assert (g - w).abs().max() <= 2 * (s - w).abs().max() + atol
