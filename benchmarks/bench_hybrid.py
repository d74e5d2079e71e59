"""What verifying T tokens costs on a hybrid model (Qwen3.5's 3 Gated DeltaNet layers to 1 attention layer) and on
the same model with attention in every layer: `python benchmarks/bench_hybrid.py`.

Random weights of one mid-sized shape (d=1024, 16 layers, vocabulary 32000; about 200M parameters), float32, batch
1. For each model and committed context (64 and 1024 tokens), T = 1, 4, 16, 64 new tokens in one forward under a
causal mask (a chain; a tree of T nodes costs the same here: the ancestor mask replaces the causal one), 10
forwards in one jitted loop, best of 3; printed in ms and as a multiple of one decoding step (T=1). This says how
the linear-attention layers change the cost side of speculation: their work per token does not grow with the
context, but their tree form grows as T^2 per head.

`--stages N`: instead, the cost of each pipeline stage when the 16 layers are cut into N stages of 16/N layers (how
`jaxspec.pipeline` cuts them): each stage's layers run alone on one token (`run_hybrid_layers`, the layers of the
hybrid forward), at each context, 10 times in one jitted loop, best of 3. A stage's time is what one pipeline step
waits for when the stages run on their own devices; the slowest stage sets the step.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxspec.cache import init_cache
from jaxspec.config import FULL, LINEAR, ModelConfig
from jaxspec.model import causal_mask, forward, init_weights, run_hybrid_layers, unstack_layers

LAYERS = 16
HYBRID = ModelConfig(
    architecture="qwen3_5", vocab_size=32000, hidden_size=1024, intermediate_size=3072, num_layers=LAYERS,
    num_heads=8, num_kv_heads=2, head_dim=128, qk_norm=True, rope_theta=1e7, partial_rotary_factor=0.25,
    attention_output_gate=True, layer_types=tuple(LINEAR if (i + 1) % 4 else FULL for i in range(LAYERS)),
    linear_num_key_heads=8, linear_num_value_heads=16, linear_key_head_dim=64, linear_value_head_dim=64,
    linear_conv_kernel=4,
)
ATTENTION = dataclasses.replace(HYBRID, layer_types=(FULL,) * LAYERS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1,4,16,64")
    parser.add_argument("--contexts", default="64,1024")
    parser.add_argument("--mask", choices=("tree", "chain"), default="tree",
                        help="tree: an explicit (causal) ancestor mask, the verification path; chain: the default "
                             "mask, the prefill path (linear-attention layers in chunks)")
    parser.add_argument("--stages", type=int, default=0, help="time each of N pipeline stages instead")
    args = parser.parse_args()
    if args.stages:
        return stage_costs(args.stages, [int(x) for x in args.contexts.split(",")])
    sizes = [int(x) for x in args.sizes.split(",")]
    print(f"{'model':>10} {'context':>8} {'T':>4} {'ms/forward':>11} {'x one step':>11}")
    for name, cfg in (("hybrid", HYBRID), ("attention", ATTENTION)):
        weights = init_weights(cfg, jax.random.key(0))
        weights = weights if cfg.is_hybrid else unstack_layers(weights)  # both as per-layer buffers

        def run(weights, n, t, context, cfg=cfg):  # n forwards of t new tokens after `context` committed ones
            cache = dataclasses.replace(init_cache(cfg, 1, context + 128), lengths=jnp.array([context], jnp.int32))

            def body(_, carry):
                cache, token = carry
                tokens = token[:, None] + jnp.arange(t)  # [1, t]
                mask = causal_mask(1, t) if args.mask == "tree" else None
                out = forward(weights, cfg, tokens, cache.lengths[:, None] + jnp.arange(t), cache, mask)
                return out.cache, jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)

            return jax.lax.fori_loop(0, n, body, (cache, jnp.array([5], jnp.int32)))[1]

        step = jax.jit(run, static_argnums=(1, 2, 3))
        for context in (int(x) for x in args.contexts.split(",")):
            base = None
            for t in sizes:
                step(weights, 10, t, context).block_until_ready()
                best = float("inf")
                for _ in range(3):
                    start = time.perf_counter()
                    step(weights, 10, t, context).block_until_ready()
                    best = min(best, (time.perf_counter() - start) / 10)
                base = best if base is None else base
                print(f"{name:>10} {context:>8} {t:>4} {best * 1e3:>11.2f} {best / base:>10.2f}x", flush=True)
        del weights
        jax.clear_caches()


def stage_costs(num_stages: int, contexts: list[int]) -> None:
    """Prints each stage's layer kinds and its time for one token (ms) at each context, and its share of the step
    time of a pipeline whose stages run in parallel (the slowest stage)."""
    if LAYERS % num_stages:
        raise SystemExit(f"--stages must divide {LAYERS}")
    size = LAYERS // num_stages
    weights = init_weights(HYBRID, jax.random.key(0))
    print(f"{'stage':>5} {'layers':>12} {'context':>8} {'ms/token':>9} {'/ slowest':>10}")
    for context in contexts:
        times = []
        for j in range(num_stages):
            kinds = HYBRID.layer_types[j * size:(j + 1) * size]
            cfg = dataclasses.replace(HYBRID, num_layers=size, layer_types=kinds)
            layers = weights.layers[j * size:(j + 1) * size]
            cache = dataclasses.replace(init_cache(cfg, 1, context + 128), lengths=jnp.array([context], jnp.int32))

            def run(layers, cache, n, cfg=cfg):  # n one-token passes through the stage's layers
                def body(i, x):  # x: [1, 1, d]
                    out = run_hybrid_layers(cfg, layers, x, cache.lengths[:, None] + i, cache, None)[0]
                    return out / (1.0 + jnp.max(jnp.abs(out)))  # keeps the values bounded over the loop
                return jax.lax.fori_loop(0, n, body, jnp.ones((1, 1, cfg.hidden_size), jnp.float32))

            step = jax.jit(run, static_argnums=2)
            step(layers, cache, 10).block_until_ready()
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                step(layers, cache, 10).block_until_ready()
                best = min(best, (time.perf_counter() - start) / 10)
            times.append((j, "".join("L" if k == LINEAR else "A" for k in kinds), best))
        slowest = max(t for _, _, t in times)
        for j, kinds, t in times:
            print(f"{j:>5} {kinds:>12} {context:>8} {t * 1e3:>9.2f} {t / slowest:>9.2f}", flush=True)
        jax.clear_caches()


if __name__ == "__main__":
    main()
