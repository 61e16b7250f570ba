"""A Llama training step (forward, backward, SGD step) with transformers' SDPA against
`attn_implementation="forgekernel"`: median step time over a few steps after a warm-up.

    python scripts/transformers_step.py [--layers 4] [--batch 2] [--seq 2048] [--compile]

8B-like layer shapes (hidden 4096, 32 / 8 heads, head dim 128, intermediate 14336), bf16, no
attention_mask (both implementations then run plain causal attention)."""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

import forgekernel.integrations.transformers  # noqa: F401  (registers "forgekernel")


def step_times(impl: str, args: argparse.Namespace) -> list[float]:
    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=4096,
        intermediate_size=14336,
        num_attention_heads=32,
        num_key_value_heads=8,
        num_hidden_layers=args.layers,
        vocab_size=32000,
        max_position_embeddings=8192,
    )
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl)
    assert model.config._attn_implementation == impl
    model = model.to("cuda", torch.bfloat16)
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=1e-5)
    run = torch.compile(model) if args.compile else model
    ids = torch.randint(0, cfg.vocab_size, (args.batch, args.seq), device="cuda")
    times = []
    for i in range(args.warmup + args.steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        loss = run(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append((time.perf_counter() - t0) * 1e3)
    del model, opt
    torch.cuda.empty_cache()
    return times


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--compile", action="store_true")
    args = p.parse_args()
    med = {impl: statistics.median(step_times(impl, args)) for impl in ("sdpa", "forgekernel")}
    mode = "compiled" if args.compile else "eager"
    print(
        f"llama step ({mode}, {args.layers} layers, B{args.batch} S{args.seq}, bf16): "
        f"sdpa {med['sdpa']:.2f} ms, forgekernel {med['forgekernel']:.2f} ms, "
        f"speedup {med['sdpa'] / med['forgekernel']:.3f}x"
    )


if __name__ == "__main__":
    main()
