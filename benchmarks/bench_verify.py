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
from jaxspec.model import causal_mask, feature_major_layers, forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=DEFAULT_MODEL)
    parser.add_argument("--sizes", default="1,2,4,8,16,32")
    parser.add_argument("--cache", type=int, default=256, help="cache slots per row")
    parser.add_argument("--unstacked", action="store_true",
                        help="on CPU, the per-layer feature-major layout and cache (JAXSPEC_LAYERS=unstacked)")
    parser.add_argument("--both", action="store_true",
                        help="both layouts, timed in turn in the same process (on a shared host, the fair comparison)")
    args = parser.parse_args()
    model = load_model(args.model, with_tokenizer=False)
    cfg = model.config
    layouts = {"stacked": model.weights, "per-layer": feature_major_layers(model.weights)}
    if not args.both:
        layouts = {k: v for k, v in layouts.items() if (k == "per-layer") == args.unstacked}

    def run(weights, n, t):  # n forwards of t tokens each
        cache = init_cache(cfg, 1, args.cache, per_layer=isinstance(weights.layers, tuple))
        cache = dataclasses.replace(cache, lengths=jnp.array([40], jnp.int32))

        def body(_, carry):
            cache, token = carry
            tokens = token[:, None] + jnp.arange(t)  # [1, t]
            out = forward(weights, cfg, tokens, cache.lengths[:, None] + jnp.arange(t), cache, causal_mask(1, t))
            # every position's logits are used, as a verification uses them (from the last one alone XLA would
            # drop the other rows' LM-head products)
            return out.cache, (jnp.argmax(out.logits, -1).sum(-1) % cfg.vocab_size).astype(jnp.int32)

        return jax.lax.fori_loop(0, n, body, (cache, jnp.array([5], jnp.int32)))[1]

    step = jax.jit(run, static_argnums=(1, 2))
    base = {}
    print(f"{'T':>4} " + " ".join(f"{name + ' ms':>15} {'x one step':>11}" for name in layouts))
    for t in [int(x) for x in args.sizes.split(",")]:
        best = {}
        for name, weights in layouts.items():
            step(weights, 20, t).block_until_ready()
            best[name] = float("inf")
        for _ in range(3):
            for name, weights in layouts.items():
                start = time.perf_counter()
                step(weights, 20, t).block_until_ready()
                best[name] = min(best[name], (time.perf_counter() - start) / 20 * 1000)
        for name in layouts:
            base.setdefault(name, best[name])
        print(f"{t:>4} " + " ".join(f"{best[n]:>15.2f} {best[n] / base[n]:>10.2f}x" for n in layouts), flush=True)


if __name__ == "__main__":
    main()
