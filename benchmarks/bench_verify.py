"""What verifying T tokens costs against one decoding step: `python benchmarks/bench_verify.py [--model M]`.

Runs the target's forward with a KV cache (committed context of 40 tokens) on T = 1, 2, 4, 8, 16, 32 new tokens
under a causal/tree mask, 20 forwards inside one jitted loop, best of 3, and prints ms per forward and the ratio
to T = 1. This is the cost side of every speculative method on this device.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

import jax
import jax.numpy as jnp

from jaxspec.cache import init_cache
from jaxspec.loading import DEFAULT_MODEL, load_model
from jaxspec.model import causal_mask, forward, unstack_layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,2,4,8,16,32")
    parser.add_argument("--cache", type=int, default=256, help="cache slots per row")
    parser.add_argument("--unstacked", action="store_true",
                        help="on CPU, the layers as per-layer buffers (JAXSPEC_LAYERS=unstacked; jaxspec.model)")
    args = parser.parse_args()
    model = load_model(args.model, with_tokenizer=False)
    cfg = model.config
    weights = unstack_layers(model.weights) if args.unstacked else model.weights

    def run(weights, n, t):  # n forwards of t tokens each
        cache = dataclasses.replace(init_cache(cfg, 1, args.cache), lengths=jnp.array([40], jnp.int32))

        def body(_, carry):
            cache, token = carry
            tokens = token[:, None] + jnp.arange(t)  # [1, t]
            out = forward(weights, cfg, tokens, cache.lengths[:, None] + jnp.arange(t), cache, causal_mask(1, t))
            return out.cache, jnp.argmax(out.logits[:, -1], -1).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (cache, jnp.array([5], jnp.int32)))[1]

    step = jax.jit(run, static_argnums=(1, 2))
    base = None
    print(f"{'T':>4} {'ms/forward':>11} {'x one step':>11}")
    for t in [int(x) for x in args.sizes.split(",")]:
        step(weights, 20, t).block_until_ready()
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            step(weights, 20, t).block_until_ready()
            best = min(best, (time.perf_counter() - start) / 20 * 1000)
        base = base or best
        print(f"{t:>4} {best:>11.2f} {best / base:>10.2f}x", flush=True)


if __name__ == "__main__":
    main()
